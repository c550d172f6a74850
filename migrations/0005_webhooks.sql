-- Migration 5 (v4 -> v5): the webhook relay's tables (docs/webhooks.md).
-- New tables and indexes only: no existing row changes. Run by
-- src/store/sqlite.rs inside the IMMEDIATE transaction that read
-- PRAGMA user_version = 4, which it then sets to 5.

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
    status          TEXT    NOT NULL CHECK (status IN ('pending', 'delivered', 'failed', 'disabled')),
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
