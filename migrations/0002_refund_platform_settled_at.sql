-- Migration 2 (v1 -> v2): refund.platform_settled_at, the platform's own
-- time of a successful refund (WeChat Pay success_time, Alipay gmt_refund),
-- by which reconciliation dates refunds (docs/operations.md).
--
-- Run by src/store.rs inside the IMMEDIATE transaction that read
-- PRAGMA user_version = 1, which it then sets to 2. The table is rebuilt
-- rather than altered: ALTER TABLE ADD COLUMN would leave a CREATE TABLE
-- text (and a column order) that differs from a fresh database's, and the
-- new CHECK could not be added to an existing table at all. The old table is
-- renamed first so the new one is created under its own name, with the
-- exact text of schema.sql (a rename would store it quoted); dropping the
-- old table drops its indexes and triggers, which are then created again,
-- as in schema.sql. No other table references refund. Every row is copied
-- with its id; platform_settled_at is NULL for refunds settled before v2
-- (reconciliation falls back to settled_at for them).

ALTER TABLE refund RENAME TO refund_v1;

CREATE TABLE refund (
    id           INTEGER PRIMARY KEY,
    refund_no    TEXT    NOT NULL CHECK (length(refund_no) BETWEEN 1 AND 64
                                         AND refund_no NOT GLOB '*[^A-Za-z0-9_.-]*'),
    order_id     INTEGER NOT NULL REFERENCES orders (id),
    status       TEXT    NOT NULL CHECK (status IN ('REQUESTED', 'SUCCEEDED', 'FAILED')),
    requested_at TEXT    NOT NULL,
    settled_at   TEXT,
    -- The platform's own time of a successful refund when its notice carries
    -- one (WeChat Pay success_time, Alipay gmt_refund); reconciliation dates
    -- the refund by it, else by settled_at (when payonce learnt of it).
    platform_settled_at TEXT,
    CHECK ((status = 'REQUESTED') = (settled_at IS NULL)),
    CHECK (platform_settled_at IS NULL OR status = 'SUCCEEDED')
);

INSERT INTO refund (id, refund_no, order_id, status, requested_at, settled_at)
SELECT id, refund_no, order_id, status, requested_at, settled_at FROM refund_v1 ORDER BY id;

DROP TABLE refund_v1;

CREATE UNIQUE INDEX uk_refund_no ON refund (refund_no);
CREATE INDEX ix_refund_order ON refund (order_id);
CREATE INDEX ix_refund_settled ON refund (coalesce(platform_settled_at, settled_at)) WHERE status = 'SUCCEEDED';
-- One refund in flight per order, and one full refund per order in this version.
CREATE UNIQUE INDEX uk_refund_requested ON refund (order_id) WHERE status = 'REQUESTED';
CREATE UNIQUE INDEX uk_refund_succeeded ON refund (order_id) WHERE status = 'SUCCEEDED';

CREATE TRIGGER refund_legal_transitions
BEFORE UPDATE ON refund
WHEN NEW.refund_no IS NOT OLD.refund_no OR NEW.order_id IS NOT OLD.order_id
  OR NEW.requested_at IS NOT OLD.requested_at
  OR (NEW.status IS NOT OLD.status
      AND NOT (OLD.status = 'REQUESTED' AND NEW.status IN ('SUCCEEDED', 'FAILED')))
  OR (OLD.settled_at IS NOT NULL AND NEW.settled_at IS NOT OLD.settled_at)
  OR (OLD.status <> 'REQUESTED' AND NEW.platform_settled_at IS NOT OLD.platform_settled_at)
BEGIN
    SELECT RAISE(ABORT, 'a refund only settles once, REQUESTED -> SUCCEEDED | FAILED, and its times stay');
END;

CREATE TRIGGER refund_no_delete BEFORE DELETE ON refund
BEGIN
    SELECT RAISE(ABORT, 'refund is append-only');
END;
