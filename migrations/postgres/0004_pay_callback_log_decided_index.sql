-- Migration 4 (v3 -> v4) on PostgreSQL, the twin of
-- migrations/0004_pay_callback_log_decided_index.sql: the expression index on
-- coalesce(paid_at, decided_at) serves no query any more; an index on
-- (outcome, decided_at) serves reconciliation's.
--
-- Run by src/store/postgres.rs in the transaction, under the schema advisory
-- lock, that read version 3 from payonce_schema_version and then records 4.

DROP INDEX ix_pay_callback_log_paid_time;

-- Reconciliation reads the applied payments decided in a period (it places
-- each by the platform's time when that lies within 72 h before to 5 min
-- after the decision, else by the decision: src/store/reports.rs).
CREATE INDEX ix_pay_callback_log_decided ON pay_callback_log (outcome, decided_at);
