-- Migration 4 (v3 -> v4): reconciliation selects the applied payments
-- decided in a period and places each by its paid time in Rust, so the
-- expression index on coalesce(paid_at, decided_at) serves no query; an
-- index on (outcome, decided_at) serves that one (the planner takes it for
-- `outcome = 'applied' AND decided_at` in a range).
--
-- Run by src/store/sqlite.rs inside the IMMEDIATE transaction that read
-- PRAGMA user_version = 3, which it then sets to 4. Indexes only: no table
-- is rebuilt and no row changes.

DROP INDEX ix_pay_callback_log_paid_time;

-- Reconciliation reads the applied payments decided in a period (it places
-- each by the platform's time when that lies within 72 h before to 5 min
-- after the decision, else by the decision: src/store/reports.rs).
CREATE INDEX ix_pay_callback_log_decided ON pay_callback_log (outcome, decided_at);
