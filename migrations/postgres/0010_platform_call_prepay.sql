-- Migration 10 (v9 -> v10) on PostgreSQL, the twin of
-- migrations/0010_platform_call_prepay.sql: `platform_call.kind` gains
-- `prepay` (the call that creates the platform's payment for an order, once
-- per order and channel: `uk_platform_call_prepay`; src/store/platform_calls.rs),
-- and the prepay rows' own columns `method`, `appid`, `params` (the first
-- request's other parameters), `answer` (what payonce answered, JSON) and
-- `trade_may_exist` (0 on every older row). PostgreSQL swaps the kind
-- CHECK in place, keeping its name; ADD COLUMN appends the columns, last,
-- where schema.postgres.sql has them, and with no default rewrites no row.
-- The two table CHECKs are named, so a fresh database and a migrated one
-- name them alike; every row before v10 (no prepay, no method) passes them.
-- Run by src/store/postgres.rs in the transaction, under the schema
-- advisory lock, that read version 9 and then records 10.

ALTER TABLE platform_call DROP CONSTRAINT platform_call_kind_check;
ALTER TABLE platform_call ADD CONSTRAINT platform_call_kind_check
    CHECK (kind IN ('query', 'close', 'refund', 'refund_query', 'prepay'));

ALTER TABLE platform_call ADD COLUMN method TEXT;
ALTER TABLE platform_call ADD COLUMN appid TEXT;
ALTER TABLE platform_call ADD COLUMN params TEXT CHECK (params IS NULL OR payonce_json_valid(params));
ALTER TABLE platform_call ADD COLUMN answer TEXT CHECK (answer IS NULL OR payonce_json_valid(answer));
ALTER TABLE platform_call ADD COLUMN trade_may_exist INTEGER NOT NULL DEFAULT 0 CHECK (trade_may_exist IN (0, 1));
ALTER TABLE platform_call ADD CONSTRAINT platform_call_prepay_method
    CHECK ((kind = 'prepay') = (method IS NOT NULL AND params IS NOT NULL));
ALTER TABLE platform_call ADD CONSTRAINT platform_call_prepay_only
    CHECK (kind = 'prepay' OR (appid IS NULL AND params IS NULL AND answer IS NULL AND trade_may_exist = 0));

-- One payment created per order at each platform: concurrent pay requests
-- race on this index, and the loser waits for the winner's row.
CREATE UNIQUE INDEX uk_platform_call_prepay ON platform_call (channel, order_no) WHERE kind = 'prepay';
