-- Migration 3 (v2 -> v3): audit_log.refund_no, a plain column for the
-- refund_no of 'unexpected_refund' and 'unexpected_refund_resolved' rows,
-- replacing the index on json_extract(detail, '$.refund_no'): no query of
-- either engine needs JSON functions (the same queries run on PostgreSQL,
-- docs/postgres.md).
--
-- Run by src/store/sqlite.rs inside the IMMEDIATE transaction that read
-- PRAGMA user_version = 2, which it then sets to 3. Rebuilt rather than
-- altered, as migration 2 explains: the new table gets schema.sql's exact
-- text and column order. audit_log is append-only (its triggers refuse
-- UPDATE), so the refund_no of existing rows is filled in by the copy.
-- No other table references audit_log. Every row keeps its id.

ALTER TABLE audit_log RENAME TO audit_log_v2;

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

INSERT INTO audit_log (id, at, actor, action, order_no, refund_no, detail)
SELECT id, at, actor, action, order_no,
       CASE WHEN action IN ('unexpected_refund', 'unexpected_refund_resolved')
            THEN json_extract(detail, '$.refund_no') END,
       detail
FROM audit_log_v2;

DROP TABLE audit_log_v2;

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
