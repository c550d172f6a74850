-- Migration 9 (v8 -> v9): `pay_callback_log.currency`, the currency a
-- payment notice stated for its amount (docs/channels.md, "Currency is part
-- of the amount"). A record kept `received` in record-only mode is decided
-- later from its row alone (drain, the sweeper), so the row must carry the
-- currency or a payment in another currency would be decided in the order's.
-- Rows recorded before v9 keep NULL: the order's own currency, as they were
-- decided (or will be) until now.
--
-- The column comes last, where PostgreSQL's ALTER TABLE ADD COLUMN puts it,
-- so both engines keep the same column order. SQLite's ADD COLUMN would
-- splice the column into the stored CREATE TABLE text on its own terms
-- (no comment, on the line of the last column), which a fresh database from
-- schema.sql would not have; so, as migration 7 did, the table is rebuilt:
-- the old one renamed aside, the new one created exactly as schema.sql has
-- it, every row copied with its id (the new table's columns are the old
-- ones in the same order, then currency, NULL), the old one dropped (with
-- its indexes and triggers, which nothing else names), and the indexes and
-- triggers created again. No other table references pay_callback_log.
--
-- Run by src/store/sqlite.rs inside the IMMEDIATE transaction that read
-- PRAGMA user_version = 8, which it then sets to 9.

ALTER TABLE pay_callback_log RENAME TO pay_callback_log_v8;

CREATE TABLE pay_callback_log (
    id          INTEGER PRIMARY KEY,
    pay_no      TEXT    NOT NULL CHECK (length(pay_no) BETWEEN 1 AND 64
                                        AND pay_no NOT GLOB '*[^A-Za-z0-9_.-]*'),
    channel     TEXT    NOT NULL CHECK ((channel = 'generic' OR channel = 'wechatpay' OR channel = 'alipay')),
    order_id    INTEGER NOT NULL REFERENCES orders (id),
    amount      INTEGER NOT NULL CHECK (typeof(amount) = 'integer'
                                        AND amount BETWEEN 1 AND 1000000000000),
    -- What the platform reported for this pay_no; FAILED may be superseded
    -- once by SUCCESS (the FAILED delivery is kept in audit_log).
    status      TEXT    NOT NULL CHECK (status IN ('SUCCESS', 'FAILED')),
    outcome     TEXT    NOT NULL CHECK ((outcome = 'recorded' OR outcome = 'payment_failed' OR outcome = 'paid_after_close'
                                                    OR outcome = 'already_paid' OR outcome = 'amount_mismatch' OR outcome = 'applied')),
    state       TEXT    NOT NULL CHECK (state IN ('received', 'decided')),
    source      TEXT    NOT NULL CHECK ((source = 'callback' OR source = 'reconciliation' OR source = 'query')),
    raw_body    BLOB    NOT NULL,
    -- The platform's own payment time when it sent one, else NULL.
    paid_at     TEXT,
    received_at TEXT    NOT NULL,
    decided_at  TEXT,
    -- The decision time of an applied payment, equal to decided_at; NULL
    -- for every other outcome. A plain column, so PRAGMA table_info lists it.
    applied_at  TEXT CHECK (applied_at IS NULL OR (outcome = 'applied' AND applied_at = decided_at)),
    -- The rewards due when the payment was applied: {"coupons":[..],"points":N}.
    rewards_due TEXT CHECK (rewards_due IS NULL OR json_valid(rewards_due)),
    -- For refund-required payments: how an operator resolved them.
    resolution  TEXT CHECK (resolution IN ('refunded_externally', 'accepted')),
    resolution_reason TEXT,
    resolved_at TEXT,
    -- The currency the platform stated for `amount` (docs/channels.md,
    -- "Currency is part of the amount"); NULL when a generic notice named
    -- none (the order's own), and on every row recorded before version 9.
    -- Last, because PostgreSQL's migration 9 appends it (ALTER TABLE ADD
    -- COLUMN) and schema.postgres.sql keeps the columns in this order.
    currency    TEXT CHECK (currency IS NULL OR currency GLOB '[A-Z][A-Z][A-Z]'),
    CHECK ((state = 'received') = (outcome = 'recorded')),
    CHECK ((state = 'decided') = (decided_at IS NOT NULL)),
    CHECK (state = 'received' OR (outcome = 'payment_failed') = (status = 'FAILED')),
    CHECK ((outcome = 'applied') = (rewards_due IS NOT NULL)),
    CHECK (resolution IS NULL OR (outcome = 'paid_after_close' OR outcome = 'already_paid' OR outcome = 'amount_mismatch')),
    CHECK ((resolution IS NULL) = (resolved_at IS NULL)),
    CHECK ((resolution IS NULL) = (resolution_reason IS NULL))
);

INSERT INTO pay_callback_log
    (id, pay_no, channel, order_id, amount, status, outcome, state, source, raw_body, paid_at, received_at,
     decided_at, applied_at, rewards_due, resolution, resolution_reason, resolved_at, currency)
SELECT id, pay_no, channel, order_id, amount, status, outcome, state, source, raw_body, paid_at, received_at,
       decided_at, applied_at, rewards_due, resolution, resolution_reason, resolved_at, NULL
FROM pay_callback_log_v8;
DROP TABLE pay_callback_log_v8;
CREATE UNIQUE INDEX uk_pay_no ON pay_callback_log (pay_no);
CREATE INDEX ix_pay_callback_log_order ON pay_callback_log (order_id);
CREATE INDEX ix_pay_callback_log_received ON pay_callback_log (id) WHERE state = 'received';
CREATE INDEX ix_pay_callback_log_outcome ON pay_callback_log (outcome, id);

-- At most one applied payment per order: the database's own answer to two
-- channels paying one order.
CREATE UNIQUE INDEX uk_applied_order ON pay_callback_log (order_id) WHERE outcome = 'applied';
-- Created after uk_applied_order, as migration 4 creates it.
-- Reconciliation reads the applied payments decided in a period (it places
-- each by the platform's time when that lies within 72 h before to 5 min
-- after the decision, else by the decision: src/store/reports.rs).
CREATE INDEX ix_pay_callback_log_decided ON pay_callback_log (outcome, decided_at);

CREATE TRIGGER pay_callback_log_identity_immutable
BEFORE UPDATE ON pay_callback_log
WHEN NEW.id IS NOT OLD.id OR NEW.pay_no IS NOT OLD.pay_no OR NEW.channel IS NOT OLD.channel
  OR NEW.order_id IS NOT OLD.order_id OR NEW.received_at IS NOT OLD.received_at
  OR (NEW.status IS NOT OLD.status AND NOT (OLD.status = 'FAILED' AND NEW.status = 'SUCCESS'))
  -- The SUCCESS that supersedes a FAILED may come from reconciliation.
  OR (NEW.source IS NOT OLD.source AND NOT (OLD.status = 'FAILED' AND NEW.status = 'SUCCESS'))
BEGIN
    SELECT RAISE(ABORT, 'a recorded callback keeps its pay_no, channel, order and source; FAILED may become SUCCESS once');
END;

-- A decided outcome is final, except that payment_failed may be superseded
-- by a later SUCCESS of the same pay_no.
CREATE TRIGGER pay_callback_log_outcome_final
BEFORE UPDATE OF outcome ON pay_callback_log
WHEN NEW.outcome IS NOT OLD.outcome
 AND NOT (OLD.outcome IN ('recorded', 'payment_failed'))
BEGIN
    SELECT RAISE(ABORT, 'a decided payment outcome is final');
END;

CREATE TRIGGER pay_callback_log_resolution_final
BEFORE UPDATE OF resolution, resolution_reason, resolved_at ON pay_callback_log
WHEN OLD.resolution IS NOT NULL
 AND (NEW.resolution IS NOT OLD.resolution OR NEW.resolution_reason IS NOT OLD.resolution_reason
      OR NEW.resolved_at IS NOT OLD.resolved_at)
BEGIN
    SELECT RAISE(ABORT, 'a payment is resolved once');
END;

CREATE TRIGGER pay_callback_log_no_delete BEFORE DELETE ON pay_callback_log
BEGIN
    SELECT RAISE(ABORT, 'pay_callback_log is append-only');
END;
