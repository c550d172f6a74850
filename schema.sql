-- payonce schema, version 11: the whole current schema.
--
-- Every uniqueness and every allowed value is a constraint here, so the
-- database refuses what the code must never do, even if the code is wrong.
-- Unique keys are named indexes with the incident review's `uk_` names.
-- Times are RFC 3339 UTC text with milliseconds (YYYY-MM-DDTHH:MM:SS.sssZ),
-- so they sort as text. Money is an integer number of minor units.
--
-- Applied by src/store.rs to a new database (PRAGMA user_version 0) in one
-- IMMEDIATE transaction that also sets user_version, so two processes
-- opening a new file do not race. An older database is brought here by the
-- numbered migrations in migrations/, in order, in that same kind of
-- transaction; tests/it/schema.rs proves a migrated v1 database ends with
-- exactly this schema. A change here is also a new migration.

-- refunded_amount: the sum of the order's succeeded refunds, kept by the
-- refund triggers, never past amount. Migration 11 added it with ADD COLUMN
-- (four tables reference orders), so its text sits where SQLite writes it.
CREATE TABLE orders (
    id          INTEGER PRIMARY KEY,
    order_no    TEXT    NOT NULL CHECK (length(order_no) BETWEEN 1 AND 64
                                        AND order_no NOT GLOB '*[^A-Za-z0-9_.-]*'),
    user_id     TEXT    NOT NULL CHECK (length(user_id) BETWEEN 1 AND 64
                                        AND user_id NOT GLOB '*[^A-Za-z0-9_.-]*'),
    amount      INTEGER NOT NULL CHECK (typeof(amount) = 'integer'
                                        AND amount BETWEEN 1 AND 1000000000000),
    currency    TEXT    NOT NULL CHECK (currency GLOB '[A-Z][A-Z][A-Z]'),
    status      TEXT    NOT NULL CHECK ((status = 'PENDING' OR status = 'PAID' OR status = 'CLOSED' OR status = 'REFUNDING' OR status = 'REFUNDED')),
    pay_no      TEXT,
    created_at  TEXT    NOT NULL,
    expires_at  TEXT    NOT NULL,
    paid_at     TEXT,
    closed_at   TEXT,
    refund_no   TEXT,
    refunded_at TEXT, refunded_amount INTEGER NOT NULL DEFAULT 0 CHECK (refunded_amount BETWEEN 0 AND amount),
    -- A paid order always names the payment that paid it, and only such an order does.
    CHECK ((status IN ('PENDING', 'CLOSED')) = (pay_no IS NULL)),
    CHECK ((status IN ('PENDING', 'CLOSED')) = (paid_at IS NULL)),
    CHECK ((status = 'CLOSED') = (closed_at IS NOT NULL)),
    CHECK ((status = 'REFUNDED') = (refunded_at IS NOT NULL)),
    CHECK ((status IN ('REFUNDING', 'REFUNDED')) = (refund_no IS NOT NULL))
);
CREATE UNIQUE INDEX uk_order_no ON orders (order_no);
CREATE INDEX ix_orders_user ON orders (user_id, id);
CREATE INDEX ix_orders_status ON orders (status, id);
CREATE INDEX ix_orders_pending_expiry ON orders (expires_at) WHERE status = 'PENDING';

-- The five legal edges of the order state machine (src/domain.rs holds the
-- same table). Anything else is refused here even if the code tries it.
CREATE TRIGGER orders_legal_transitions
BEFORE UPDATE OF status ON orders
WHEN NEW.status IS NOT OLD.status
 AND NOT ((OLD.status = 'PENDING'   AND NEW.status = 'PAID')
       OR (OLD.status = 'PENDING'   AND NEW.status = 'CLOSED')
       OR (OLD.status = 'PAID'      AND NEW.status = 'REFUNDING')
       OR (OLD.status = 'REFUNDING' AND NEW.status = 'REFUNDED')
       OR (OLD.status = 'REFUNDING' AND NEW.status = 'PAID'))
BEGIN
    SELECT RAISE(ABORT, 'illegal order transition');
END;

-- PENDING is the only way in: a payment is the only way to PAID.
CREATE TRIGGER orders_born_pending BEFORE INSERT ON orders
WHEN NEW.status IS NOT 'PENDING'
BEGIN
    SELECT RAISE(ABORT, 'an order is created PENDING');
END;

-- Once set, the paying pay_no and the times of payment, close and refund stay.
CREATE TRIGGER orders_history_immutable
BEFORE UPDATE OF pay_no, paid_at, closed_at, refunded_at ON orders
WHEN (OLD.pay_no IS NOT NULL AND NEW.pay_no IS NOT OLD.pay_no)
  OR (OLD.paid_at IS NOT NULL AND NEW.paid_at IS NOT OLD.paid_at)
  OR (OLD.closed_at IS NOT NULL AND NEW.closed_at IS NOT OLD.closed_at)
  OR (OLD.refunded_at IS NOT NULL AND NEW.refunded_at IS NOT OLD.refunded_at)
BEGIN
    SELECT RAISE(ABORT, 'an order''s pay_no, paid_at, closed_at and refunded_at never change once set');
END;

-- What was refunded stays refunded.
CREATE TRIGGER orders_refunded_amount_only_grows
BEFORE UPDATE OF refunded_amount ON orders
WHEN NEW.refunded_amount < OLD.refunded_amount
BEGIN
    SELECT RAISE(ABORT, 'an order''s refunded_amount only grows');
END;

CREATE TRIGGER orders_identity_immutable
BEFORE UPDATE OF id, order_no, user_id, amount, currency, created_at ON orders
WHEN NEW.id IS NOT OLD.id OR NEW.order_no IS NOT OLD.order_no OR NEW.user_id IS NOT OLD.user_id
  OR NEW.amount IS NOT OLD.amount OR NEW.currency IS NOT OLD.currency
  OR NEW.created_at IS NOT OLD.created_at
BEGIN
    SELECT RAISE(ABORT, 'an order''s identity, amount and currency never change');
END;

CREATE TRIGGER orders_no_delete BEFORE DELETE ON orders
BEGIN
    SELECT RAISE(ABORT, 'orders are never deleted');
END;

-- One row per platform payment serial number. `state` is `received` while
-- the record waits in record-only mode (outcome `recorded`), `decided` once
-- its outcome is decided.
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
    resolution  TEXT CHECK ((resolution = 'refunded_externally' OR resolution = 'accepted'
                             OR resolution = 'refunded')),
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

-- `refunded` is the one resolution payonce gives itself, when the payment's
-- own refund succeeded (migration 12).
CREATE TRIGGER pay_callback_log_refunded_by_its_refund
BEFORE UPDATE OF resolution ON pay_callback_log
WHEN NEW.resolution = 'refunded'
 AND NOT EXISTS (SELECT 1 FROM refund WHERE pay_no = NEW.pay_no AND status = 'SUCCEEDED')
BEGIN
    SELECT RAISE(ABORT, 'a payment is resolved refunded only by its own succeeded refund');
END;

CREATE TRIGGER pay_callback_log_no_delete BEFORE DELETE ON pay_callback_log
BEGIN
    SELECT RAISE(ABORT, 'pay_callback_log is append-only');
END;

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

CREATE UNIQUE INDEX uk_refund_no ON refund (refund_no);
CREATE INDEX ix_refund_order ON refund (order_id);
CREATE INDEX ix_refund_settled ON refund (coalesce(platform_settled_at, settled_at)) WHERE status = 'SUCCEEDED';
-- One order refund in flight per order (a payment's refund is its own).
CREATE UNIQUE INDEX uk_refund_requested ON refund (order_id) WHERE status = 'REQUESTED' AND pay_no IS NULL;
-- One refund of a payment in flight, and one succeeded: the platform returns
-- a payment once, whatever payonce asks (migration 12).
CREATE UNIQUE INDEX uk_refund_payment_in_flight ON refund (pay_no) WHERE status = 'REQUESTED' AND pay_no IS NOT NULL;
CREATE UNIQUE INDEX uk_refund_payment_succeeded ON refund (pay_no) WHERE status = 'SUCCEEDED' AND pay_no IS NOT NULL;

-- A payment's refund returns an unresolved refund-required payment of its
-- order, for the payment's whole amount.
CREATE TRIGGER refund_of_payment_returns_it_whole
BEFORE INSERT ON refund
WHEN NEW.pay_no IS NOT NULL
 AND NOT EXISTS (SELECT 1 FROM pay_callback_log
                 WHERE pay_no = NEW.pay_no AND order_id = NEW.order_id AND amount = NEW.amount
                   AND (outcome = 'paid_after_close' OR outcome = 'already_paid' OR outcome = 'amount_mismatch')
                   AND resolution IS NULL)
BEGIN
    SELECT RAISE(ABORT, 'a payment''s refund returns an unresolved refund-required payment of its order, whole');
END;

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

CREATE TABLE user_coupon (
    id                 INTEGER PRIMARY KEY,
    user_id            TEXT    NOT NULL,
    order_id           INTEGER NOT NULL REFERENCES orders (id),
    coupon_template_id TEXT    NOT NULL CHECK (length(coupon_template_id) BETWEEN 1 AND 64
                                               AND coupon_template_id NOT GLOB '*[^A-Za-z0-9_.-]*'),
    status             TEXT    NOT NULL CHECK ((status = 'ACTIVE' OR status = 'FROZEN' OR status = 'USED')),
    created_at         TEXT    NOT NULL
);
CREATE UNIQUE INDEX uk_order_tpl ON user_coupon (order_id, coupon_template_id);
-- No index by user_id: a coupon's user is its order's, and a user's coupons
-- are found through ix_orders_user and uk_order_tpl (migration 13).

-- Compensation freezes, never deletes; a coupon is issued ACTIVE.
CREATE TRIGGER user_coupon_issued_active BEFORE INSERT ON user_coupon
WHEN NEW.status IS NOT 'ACTIVE'
BEGIN
    SELECT RAISE(ABORT, 'a coupon is issued ACTIVE');
END;

CREATE TRIGGER user_coupon_status_only
BEFORE UPDATE ON user_coupon
WHEN NEW.id IS NOT OLD.id OR NEW.user_id IS NOT OLD.user_id OR NEW.order_id IS NOT OLD.order_id
  OR NEW.coupon_template_id IS NOT OLD.coupon_template_id OR NEW.created_at IS NOT OLD.created_at
  OR (NEW.status IS NOT OLD.status AND NOT (OLD.status = 'ACTIVE' AND NEW.status IN ('FROZEN', 'USED')))
BEGIN
    SELECT RAISE(ABORT, 'a coupon only moves ACTIVE -> FROZEN | USED');
END;

CREATE TRIGGER user_coupon_no_delete BEFORE DELETE ON user_coupon
BEGIN
    SELECT RAISE(ABORT, 'user_coupon is append-only: freeze instead');
END;

-- refund_no: the refund a reversal undoes (NULL for ORDER_PAID and for
-- compensation's reverse_points); added by migration 11's ADD COLUMN, its
-- text where SQLite writes it.
CREATE TABLE point_log (
    id         INTEGER PRIMARY KEY,
    user_id    TEXT    NOT NULL,
    order_id   INTEGER NOT NULL REFERENCES orders (id),
    point_type TEXT    NOT NULL CHECK (point_type IN ('ORDER_PAID', 'ORDER_PAID_REVERSAL')),
    points     INTEGER NOT NULL CHECK (typeof(points) = 'integer'),
    created_at TEXT    NOT NULL, refund_no TEXT CHECK (refund_no IS NULL OR point_type = 'ORDER_PAID_REVERSAL'),
    CHECK ((point_type = 'ORDER_PAID' AND points > 0)
        OR (point_type = 'ORDER_PAID_REVERSAL' AND points < 0))
);
-- One ORDER_PAID per order, one reversal per refund, and one without a
-- refund (compensation's reverse_points).
CREATE UNIQUE INDEX uk_order_type ON point_log (order_id, point_type, coalesce(refund_no, ''));
-- No index by user_id, as for user_coupon (migration 13).

-- Only an entry that takes points away can take the order below zero, so
-- only such an entry sums the order's points. An entry whose key is taken is
-- no entry (ON CONFLICT DO NOTHING skips it after this trigger ran), so only
-- a new one is weighed.
CREATE TRIGGER point_log_never_below_zero
BEFORE INSERT ON point_log
WHEN NEW.points < 0
 AND (SELECT coalesce(sum(points), 0) FROM point_log WHERE order_id = NEW.order_id) + NEW.points < 0
 AND NOT EXISTS (SELECT 1 FROM point_log WHERE order_id = NEW.order_id AND point_type = NEW.point_type
                 AND coalesce(refund_no, '') = coalesce(NEW.refund_no, ''))
BEGIN
    SELECT RAISE(ABORT, 'an order''s points never go below zero');
END;

CREATE TRIGGER point_log_no_update BEFORE UPDATE ON point_log
BEGIN
    SELECT RAISE(ABORT, 'point_log is append-only: reverse with a negative entry');
END;

CREATE TRIGGER point_log_no_delete BEFORE DELETE ON point_log
BEGIN
    SELECT RAISE(ABORT, 'point_log is append-only: reverse with a negative entry');
END;

-- AUTOINCREMENT: a seq is never reused, so a consumer's cursor never skips an event.
CREATE TABLE outbox_event (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id   TEXT    NOT NULL,
    type       TEXT    NOT NULL CHECK ((type = 'order.paid' OR type = 'order.closed' OR type = 'order.refunding'
                                                OR type = 'order.refunded' OR type = 'order.refund_failed'
                                                OR type = 'payment.refund_required'
                                                OR type = 'order.partially_refunded'
                                                OR type = 'payment.refunded')),
    order_no   TEXT    NOT NULL,
    data       TEXT    NOT NULL CHECK (json_valid(data)),
    created_at TEXT    NOT NULL,
    CHECK (substr(event_id, 1, length(type) + 1) = type || ':')
);
CREATE UNIQUE INDEX uk_event_id ON outbox_event (event_id);
-- An order's events, for GET /v1/orders/{order_no}.
CREATE INDEX ix_outbox_event_order ON outbox_event (order_no, seq);

CREATE TRIGGER outbox_event_no_update BEFORE UPDATE ON outbox_event
BEGIN
    SELECT RAISE(ABORT, 'outbox_event is append-only');
END;

CREATE TRIGGER outbox_event_no_delete BEFORE DELETE ON outbox_event
BEGIN
    SELECT RAISE(ABORT, 'outbox_event is append-only');
END;

-- Stored API responses of the access-layer Idempotency-Key. Not a ledger:
-- expired rows may be deleted.
CREATE TABLE idempotency_key (
    scope         TEXT    NOT NULL,
    key           TEXT    NOT NULL CHECK (length(key) BETWEEN 1 AND 255),
    fingerprint   TEXT    NOT NULL CHECK (length(fingerprint) = 64),
    status_code   INTEGER NOT NULL CHECK (status_code BETWEEN 200 AND 499),
    response_body BLOB    NOT NULL,
    created_at    TEXT    NOT NULL,
    expires_at    TEXT    NOT NULL
);
CREATE UNIQUE INDEX uk_scope_key ON idempotency_key (scope, key);
CREATE INDEX ix_idempotency_key_expiry ON idempotency_key (expires_at);

CREATE TABLE audit_log (
    id       INTEGER PRIMARY KEY,
    at       TEXT NOT NULL,
    actor    TEXT NOT NULL,
    action   TEXT NOT NULL,
    order_no TEXT,
    -- The refund_no of an unexpected refund result and of its resolution
    -- (also in detail), as a plain column so no query needs JSON functions.
    refund_no TEXT,
    detail   TEXT NOT NULL CHECK (json_valid(detail))
);
CREATE INDEX ix_audit_log_order ON audit_log (order_no, id);
CREATE INDEX ix_audit_log_action ON audit_log (action, id);
-- Unexpected refund results and their resolutions are found by refund_no.
CREATE INDEX ix_audit_log_refund ON audit_log (refund_no, action) WHERE refund_no IS NOT NULL;

CREATE TRIGGER audit_log_no_update BEFORE UPDATE ON audit_log
BEGIN
    SELECT RAISE(ABORT, 'audit_log is append-only');
END;

CREATE TRIGGER audit_log_no_delete BEFORE DELETE ON audit_log
BEGIN
    SELECT RAISE(ABORT, 'audit_log is append-only');
END;

CREATE TABLE settings (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    CHECK (name <> 'mode' OR value IN ('normal', 'record_only'))
);
INSERT INTO settings (name, value) VALUES ('mode', 'normal');

-- The webhook relay (docs/webhooks.md). An endpoint is a configured
-- --webhook-url; it receives the events after from_seq, older ones only by
-- replay. relayed_seq is the relay's cursor over outbox_event: a delivery row
-- exists for every event up to it (the outbox's seq order is its commit
-- order, on SQLite by the single writer, on PostgreSQL by the outbox lock).
CREATE TABLE webhook_endpoint (
    endpoint    TEXT    NOT NULL PRIMARY KEY,
    status      TEXT    NOT NULL CHECK (status IN ('enabled', 'disabled')),
    from_seq    INTEGER NOT NULL CHECK (from_seq >= 0),
    relayed_seq INTEGER NOT NULL,
    disabled_at TEXT,
    created_at  TEXT    NOT NULL,
    CHECK (relayed_seq >= from_seq),
    CHECK ((status = 'disabled') = (disabled_at IS NOT NULL))
);

-- One row per (endpoint, event): its state is the delivery's whole truth.
-- An attempt is claimed by a CAS on next_attempt_at (moved past the call's
-- timeout: the lease) with attempts + 1; the call runs outside any
-- transaction; its result is written by a CAS on attempts. A process that
-- dies mid-call leaves the row pending with an expiring lease.
CREATE TABLE webhook_delivery (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    endpoint        TEXT    NOT NULL REFERENCES webhook_endpoint (endpoint),
    event_seq       INTEGER NOT NULL REFERENCES outbox_event (seq),
    event_id        TEXT    NOT NULL,
    order_no        TEXT    NOT NULL,
    status          TEXT    NOT NULL CHECK ((status = 'pending' OR status = 'delivered' OR status = 'failed' OR status = 'disabled')),
    attempts        INTEGER NOT NULL CHECK (attempts >= 0),
    -- Pending only: when the next attempt may start, or the lease of the one in flight.
    next_attempt_at TEXT,
    last_attempt_at TEXT,
    last_status     INTEGER,
    last_error      TEXT,
    -- When it last became pending (queued, retried, replayed, re-enabled).
    queued_at       TEXT    NOT NULL,
    CHECK ((status = 'pending') = (next_attempt_at IS NOT NULL))
);
CREATE UNIQUE INDEX uk_endpoint_event ON webhook_delivery (endpoint, event_id);
-- Per-order ordering: "is an earlier event of this order still pending at
-- this endpoint?" is one probe of this index.
CREATE INDEX ix_webhook_delivery_order ON webhook_delivery (endpoint, order_no, event_seq) WHERE status = 'pending';
-- The relay's "what is due now" and the oldest-pending gauge.
CREATE INDEX ix_webhook_delivery_due ON webhook_delivery (next_attempt_at) WHERE status = 'pending';
CREATE INDEX ix_webhook_delivery_queued ON webhook_delivery (queued_at) WHERE status = 'pending';

-- Every call payonce makes to a payment platform's API (docs/platforms.md),
-- one row per logical call: `attempts` counts its HTTP calls,
-- `http_status` and `response` are the last one's. A row is written before
-- the call and updated after it; no transaction spans the call. Never deleted.
CREATE TABLE platform_call (
    id              INTEGER PRIMARY KEY,
    channel         TEXT    NOT NULL CHECK (channel IN ('wechatpay', 'alipay')),
    kind            TEXT    NOT NULL CHECK ((kind = 'query' OR kind = 'close' OR kind = 'refund' OR kind = 'refund_query'
                                             OR kind = 'prepay')),
    order_no        TEXT    NOT NULL,
    refund_no       TEXT,
    status          TEXT    NOT NULL CHECK ((status = 'pending' OR status = 'done' OR status = 'failed' OR status = 'given_up')),
    attempts        INTEGER NOT NULL CHECK (attempts >= 0),
    -- Pending only: when the next attempt may start (or the lease of the one in flight).
    next_attempt_at TEXT,
    -- What was sent last, as the platform received it (its signature left out).
    request         TEXT,
    http_status     INTEGER,
    response        TEXT,
    created_at      TEXT    NOT NULL,
    updated_at      TEXT    NOT NULL,
    -- Prepay rows only (the payment created once per order and channel,
    -- src/store/platform_calls.rs): the method asked for; the appid it is
    -- created under (NULL where the platform has none); the first request's
    -- other parameters (JSON: openid, client_ip, description), so a refresh
    -- sends the platform the same request; and what payonce answered last
    -- (JSON: the payment object when done, the error object when failed),
    -- so every waiter and every reuse answers the same bytes; and whether
    -- an attempt may have made the trade at the platform (created, paid,
    -- closed, unanswered, or a request signed for the buyer): until then a
    -- request with other parameters replaces them instead of conflicting. Last, because PostgreSQL's migration 10
    -- appends them (ALTER TABLE ADD COLUMN).
    method          TEXT,
    appid           TEXT,
    params          TEXT CHECK (params IS NULL OR json_valid(params)),
    answer          TEXT CHECK (answer IS NULL OR json_valid(answer)),
    trade_may_exist INTEGER NOT NULL DEFAULT 0 CHECK (trade_may_exist IN (0, 1)),
    CHECK ((kind IN ('refund', 'refund_query')) = (refund_no IS NOT NULL)),
    CHECK ((status = 'pending') = (next_attempt_at IS NOT NULL)),
    CONSTRAINT platform_call_prepay_method CHECK ((kind = 'prepay') = (method IS NOT NULL AND params IS NOT NULL)),
    CONSTRAINT platform_call_prepay_only
        CHECK (kind = 'prepay' OR (appid IS NULL AND params IS NULL AND answer IS NULL AND trade_may_exist = 0))
);
-- One close per order and one refund submission per refund_no at each platform.
CREATE UNIQUE INDEX uk_platform_call ON platform_call (channel, kind, order_no, coalesce(refund_no, ''))
    WHERE kind IN ('close', 'refund');
CREATE INDEX ix_platform_call_due ON platform_call (next_attempt_at) WHERE status = 'pending';
CREATE INDEX ix_platform_call_order ON platform_call (order_no, id);
-- One payment created per order at each platform: concurrent pay requests
-- race on this index, and the loser waits for the winner's row.
CREATE UNIQUE INDEX uk_platform_call_prepay ON platform_call (channel, order_no) WHERE kind = 'prepay';

CREATE TRIGGER platform_call_no_delete BEFORE DELETE ON platform_call
BEGIN
    SELECT RAISE(ABORT, 'platform_call is append-only');
END;

-- The counts of GET /v1/admin/stats that would otherwise read a whole
-- table (migration 14): settled refunds and ended webhook deliveries, per
-- minute. Last here, as a migrated database has them last.
CREATE INDEX ix_refund_settled_at ON refund (settled_at) WHERE settled_at IS NOT NULL;
CREATE INDEX ix_webhook_delivery_finished ON webhook_delivery (last_attempt_at) WHERE status IN ('delivered', 'failed');
