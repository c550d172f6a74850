-- Migration 9 (v8 -> v9) on PostgreSQL, the twin of
-- migrations/0009_pay_callback_log_currency.sql: `pay_callback_log.currency`,
-- the currency a payment notice stated for its amount (docs/channels.md,
-- "Currency is part of the amount"), so a record decided later from its row
-- (record-only mode, drain) is judged in the currency it was paid in. Rows
-- recorded before v9 keep NULL: the order's own currency, as until now.
-- ADD COLUMN appends it, last, where schema.postgres.sql has it; with no
-- default, no row is rewritten. Run by src/store/postgres.rs in the
-- transaction, under the schema advisory lock, that read version 8 and then
-- records 9.

ALTER TABLE pay_callback_log ADD COLUMN currency TEXT CHECK (currency IS NULL OR currency ~ '^[A-Z]{3}$');
