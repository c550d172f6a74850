-- Migration 10 (v9 -> v10): the prepay row (src/store/platform_calls.rs):
-- `platform_call.kind` gains `prepay`, the call that creates the platform's
-- payment for an order, once per order and channel (`uk_platform_call_prepay`),
-- with the new columns `method`, `appid`, `params` (the first request's
-- other parameters), `answer` (what payonce answered, JSON text) and
-- `trade_may_exist`, which only prepay rows set.
--
-- SQLite cannot widen a CHECK in place, and ADD COLUMN would splice the
-- columns into the stored CREATE TABLE text on its own terms, so, as
-- migrations 7 and 9 did, the table is rebuilt: the old one renamed aside,
-- the new one created exactly as schema.sql has it, every row copied with
-- its id (the old columns in the same order, then method, appid, params and
-- answer NULL and trade_may_exist 0: no row before v10 is a prepay), the
-- old one dropped (with its
-- indexes and trigger, which nothing else names), and the indexes and the
-- no-delete trigger created again. No other table references platform_call.
--
-- Run by src/store/sqlite.rs inside the IMMEDIATE transaction that read
-- PRAGMA user_version = 9, which it then sets to 10.

ALTER TABLE platform_call RENAME TO platform_call_v9;

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

INSERT INTO platform_call
    (id, channel, kind, order_no, refund_no, status, attempts, next_attempt_at, request, http_status, response,
     created_at, updated_at, method, appid, params, answer, trade_may_exist)
SELECT id, channel, kind, order_no, refund_no, status, attempts, next_attempt_at, request, http_status, response,
       created_at, updated_at, NULL, NULL, NULL, NULL, 0
FROM platform_call_v9;
DROP TABLE platform_call_v9;
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
