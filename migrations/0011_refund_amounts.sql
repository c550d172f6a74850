-- Migration 11 (v10 -> v11): the database half of refunds by amount
-- (docs/decisions.md, "Refunds by amount"): a refund has its own `amount`,
-- its `reason`, and, for a refund of one payment rather than of an order,
-- that payment's `pay_no`; an order keeps the sum of its succeeded order
-- refunds in `refunded_amount`, which can never pass its `amount`; and a
-- points entry names the refund it reverses, its order's points never going
-- below zero. Every refund before v11 refunded its whole order (one per
-- order), so it gets its order's amount, and every REFUNDED order has
-- refunded its whole amount.
--
-- orders and point_log take ADD COLUMN (orders is referenced by four tables,
-- and a rebuild would rename those references away): SQLite writes the new
-- column's text right after the last column of the stored CREATE TABLE,
-- which is where schema.sql has it, text for text. refund, whose CHECKs and
-- indexes change and which nothing references, is rebuilt as migration 2
-- did: the old table renamed aside, the new one created exactly as
-- schema.sql has it, every row copied with its id and its order's amount,
-- the old one dropped (with its indexes and triggers), and they created
-- again. uk_refund_succeeded goes: an order may have many succeeded refunds.
-- uk_refund_requested keeps one order refund in flight per order; a refund
-- of a payment (pay_no set) is outside it.
--
-- Run by src/store/sqlite.rs inside the IMMEDIATE transaction that read
-- PRAGMA user_version = 10, which it then sets to 11.

ALTER TABLE orders ADD COLUMN refunded_amount INTEGER NOT NULL DEFAULT 0 CHECK (refunded_amount BETWEEN 0 AND amount);
UPDATE orders SET refunded_amount = amount WHERE status = 'REFUNDED';

-- What was refunded stays refunded.
CREATE TRIGGER orders_refunded_amount_only_grows
BEFORE UPDATE OF refunded_amount ON orders
WHEN NEW.refunded_amount < OLD.refunded_amount
BEGIN
    SELECT RAISE(ABORT, 'an order''s refunded_amount only grows');
END;

ALTER TABLE refund RENAME TO refund_v10;

CREATE TABLE refund (
    id           INTEGER PRIMARY KEY,
    refund_no    TEXT    NOT NULL CHECK (length(refund_no) BETWEEN 1 AND 64
                                         AND refund_no NOT GLOB '*[^A-Za-z0-9_.-]*'),
    order_id     INTEGER NOT NULL REFERENCES orders (id),
    status       TEXT    NOT NULL CHECK ((status = 'REQUESTED' OR status = 'SUCCEEDED' OR status = 'FAILED')),
    requested_at TEXT    NOT NULL,
    settled_at   TEXT,
    -- The platform's own time of a successful refund when its notice carries
    -- one (WeChat Pay success_time, Alipay gmt_refund); reconciliation dates
    -- the refund by it, else by settled_at (when payonce learnt of it).
    platform_settled_at TEXT,
    -- What this refund returns, in the order's minor units; why (the
    -- platforms' `reason` / `refund_reason`, at most 80 characters); and
    -- the payment it returns when it refunds one payment rather than the
    -- order (NULL for an order's refund). Last, where PostgreSQL's
    -- migration 11 appends them.
    amount       INTEGER NOT NULL CHECK (typeof(amount) = 'integer' AND amount > 0),
    reason       TEXT    CHECK (reason IS NULL OR length(reason) BETWEEN 1 AND 80),
    pay_no       TEXT,
    CHECK ((status = 'REQUESTED') = (settled_at IS NULL)),
    CHECK (platform_settled_at IS NULL OR status = 'SUCCEEDED')
);

INSERT INTO refund (id, refund_no, order_id, status, requested_at, settled_at, platform_settled_at, amount, reason, pay_no)
SELECT r.id, r.refund_no, r.order_id, r.status, r.requested_at, r.settled_at, r.platform_settled_at, o.amount, NULL, NULL
FROM refund_v10 r JOIN orders o ON o.id = r.order_id;
DROP TABLE refund_v10;

CREATE UNIQUE INDEX uk_refund_no ON refund (refund_no);
CREATE INDEX ix_refund_order ON refund (order_id);
CREATE INDEX ix_refund_settled ON refund (coalesce(platform_settled_at, settled_at)) WHERE status = 'SUCCEEDED';
-- One order refund in flight per order (a payment's refund is its own).
CREATE UNIQUE INDEX uk_refund_requested ON refund (order_id) WHERE status = 'REQUESTED' AND pay_no IS NULL;

CREATE TRIGGER refund_legal_transitions
BEFORE UPDATE ON refund
WHEN NEW.refund_no IS NOT OLD.refund_no OR NEW.order_id IS NOT OLD.order_id
  OR NEW.requested_at IS NOT OLD.requested_at
  OR NEW.amount IS NOT OLD.amount OR NEW.reason IS NOT OLD.reason OR NEW.pay_no IS NOT OLD.pay_no
  OR (NEW.status IS NOT OLD.status
      AND NOT (OLD.status = 'REQUESTED' AND NEW.status IN ('SUCCEEDED', 'FAILED')))
  OR (OLD.settled_at IS NOT NULL AND NEW.settled_at IS NOT OLD.settled_at)
  OR (OLD.status <> 'REQUESTED' AND NEW.platform_settled_at IS NOT OLD.platform_settled_at)
BEGIN
    SELECT RAISE(ABORT, 'a refund only settles once, REQUESTED -> SUCCEEDED | FAILED, and its times and amount stay');
END;

CREATE TRIGGER refund_no_delete BEFORE DELETE ON refund
BEGIN
    SELECT RAISE(ABORT, 'refund is append-only');
END;

-- An order's refunded_amount is the sum of its succeeded order refunds,
-- kept by the database itself: the orders CHECK then refuses a refund that
-- would return more than was paid.
CREATE TRIGGER refund_succeeded_adds_to_its_order
AFTER UPDATE OF status ON refund
WHEN NEW.status = 'SUCCEEDED' AND OLD.status = 'REQUESTED' AND NEW.pay_no IS NULL
BEGIN
    UPDATE orders SET refunded_amount = refunded_amount + NEW.amount WHERE id = NEW.order_id;
END;

CREATE TRIGGER refund_succeeded_at_once_adds_to_its_order
AFTER INSERT ON refund
WHEN NEW.status = 'SUCCEEDED' AND NEW.pay_no IS NULL
BEGIN
    UPDATE orders SET refunded_amount = refunded_amount + NEW.amount WHERE id = NEW.order_id;
END;

ALTER TABLE point_log ADD COLUMN refund_no TEXT CHECK (refund_no IS NULL OR point_type = 'ORDER_PAID_REVERSAL');
DROP INDEX uk_order_type;
DROP INDEX ix_point_log_user;
-- One ORDER_PAID per order, one reversal per refund, and one without a
-- refund (compensation's reverse_points). ix_point_log_user is made again
-- after it, in schema.sql's order, so the two list alike.
CREATE UNIQUE INDEX uk_order_type ON point_log (order_id, point_type, coalesce(refund_no, ''));
CREATE INDEX ix_point_log_user ON point_log (user_id, id);

-- An entry whose key is taken is no entry (ON CONFLICT DO NOTHING skips it
-- after this trigger ran), so only a new one is weighed.
CREATE TRIGGER point_log_never_below_zero
BEFORE INSERT ON point_log
WHEN (SELECT coalesce(sum(points), 0) FROM point_log WHERE order_id = NEW.order_id) + NEW.points < 0
 AND NOT EXISTS (SELECT 1 FROM point_log WHERE order_id = NEW.order_id AND point_type = NEW.point_type
                 AND coalesce(refund_no, '') = coalesce(NEW.refund_no, ''))
BEGIN
    SELECT RAISE(ABORT, 'an order''s points never go below zero');
END;

-- The event of a refund that returned part of an order. A CHECK's text does
-- not change the file format, so, as migration 8 did, the stored CREATE TABLE
-- text is edited (src/store/sqlite.rs then bumps schema_version and reads
-- the schema back).
PRAGMA writable_schema = ON;
UPDATE sqlite_schema SET sql = replace(sql,
    'OR type = ''payment.refund_required'')',
    'OR type = ''payment.refund_required''
                                                OR type = ''order.partially_refunded'')')
WHERE type = 'table' AND name = 'outbox_event';
PRAGMA writable_schema = OFF;
