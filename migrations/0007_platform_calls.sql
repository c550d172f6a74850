-- Migration 7 (v6 -> v7): the platform calls (docs/platforms.md).
-- `pay_callback_log.source` gains `query` (a payment learnt by asking the
-- platform). SQLite cannot widen a CHECK in place, so the table is rebuilt:
-- the old one is renamed aside, the new one created exactly as schema.sql
-- has it, every row copied (the columns are the same, in the same order),
-- the old one dropped (with its indexes and triggers, which nothing else
-- names), and the indexes and triggers created again. No other table
-- references pay_callback_log. Then the new table platform_call.
--
-- Run by src/store/sqlite.rs inside the IMMEDIATE transaction that read
-- PRAGMA user_version = 6, which it then sets to 7.

ALTER TABLE pay_callback_log RENAME TO pay_callback_log_v6;

CREATE TABLE pay_callback_log (
    id          INTEGER PRIMARY KEY,
    pay_no      TEXT    NOT NULL CHECK (length(pay_no) BETWEEN 1 AND 64
                                        AND pay_no NOT GLOB '*[^A-Za-z0-9_.-]*'),
    channel     TEXT    NOT NULL CHECK (channel IN ('generic', 'wechatpay', 'alipay')),
    order_id    INTEGER NOT NULL REFERENCES orders (id),
    amount      INTEGER NOT NULL CHECK (typeof(amount) = 'integer'
                                        AND amount BETWEEN 1 AND 1000000000000),
    -- What the platform reported for this pay_no; FAILED may be superseded
    -- once by SUCCESS (the FAILED delivery is kept in audit_log).
    status      TEXT    NOT NULL CHECK (status IN ('SUCCESS', 'FAILED')),
    outcome     TEXT    NOT NULL CHECK (outcome IN ('recorded', 'payment_failed', 'paid_after_close',
                                                    'already_paid', 'amount_mismatch', 'applied')),
    state       TEXT    NOT NULL CHECK (state IN ('received', 'decided')),
    source      TEXT    NOT NULL CHECK (source IN ('callback', 'reconciliation', 'query')),
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
    CHECK ((state = 'received') = (outcome = 'recorded')),
    CHECK ((state = 'decided') = (decided_at IS NOT NULL)),
    CHECK (state = 'received' OR (outcome = 'payment_failed') = (status = 'FAILED')),
    CHECK ((outcome = 'applied') = (rewards_due IS NOT NULL)),
    CHECK (resolution IS NULL OR outcome IN ('paid_after_close', 'already_paid', 'amount_mismatch')),
    CHECK ((resolution IS NULL) = (resolved_at IS NULL)),
    CHECK ((resolution IS NULL) = (resolution_reason IS NULL))
);

INSERT INTO pay_callback_log SELECT * FROM pay_callback_log_v6;
DROP TABLE pay_callback_log_v6;
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

-- Every call payonce makes to a payment platform's API (docs/platforms.md),
-- one row per logical call: `attempts` counts its HTTP calls,
-- `http_status` and `response` are the last one's. A row is written before
-- the call and updated after it; no transaction spans the call. Never deleted.
CREATE TABLE platform_call (
    id              INTEGER PRIMARY KEY,
    channel         TEXT    NOT NULL CHECK (channel IN ('wechatpay', 'alipay')),
    kind            TEXT    NOT NULL CHECK (kind IN ('query', 'close', 'refund', 'refund_query')),
    order_no        TEXT    NOT NULL,
    refund_no       TEXT,
    status          TEXT    NOT NULL CHECK (status IN ('pending', 'done', 'failed', 'given_up')),
    attempts        INTEGER NOT NULL CHECK (attempts >= 0),
    -- Pending only: when the next attempt may start (or the lease of the one in flight).
    next_attempt_at TEXT,
    -- What was sent last, as the platform received it (its signature left out).
    request         TEXT,
    http_status     INTEGER,
    response        TEXT,
    created_at      TEXT    NOT NULL,
    updated_at      TEXT    NOT NULL,
    CHECK ((kind IN ('refund', 'refund_query')) = (refund_no IS NOT NULL)),
    CHECK ((status = 'pending') = (next_attempt_at IS NOT NULL))
);
-- One close per order and one refund submission per refund_no at each platform.
CREATE UNIQUE INDEX uk_platform_call ON platform_call (channel, kind, order_no, coalesce(refund_no, ''))
    WHERE kind IN ('close', 'refund');
CREATE INDEX ix_platform_call_due ON platform_call (next_attempt_at) WHERE status = 'pending';
CREATE INDEX ix_platform_call_order ON platform_call (order_no, id);

CREATE TRIGGER platform_call_no_delete BEFORE DELETE ON platform_call
BEGIN
    SELECT RAISE(ABORT, 'platform_call is append-only');
END;
