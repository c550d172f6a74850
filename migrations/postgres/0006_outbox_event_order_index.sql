-- Migration 6 (v5 -> v6) on PostgreSQL, the twin of
-- migrations/0006_outbox_event_order_index.sql: an order's events are read
-- by order_no. Run by src/store/postgres.rs in the transaction, under the
-- schema advisory lock, that read version 5 and then records 6.

CREATE INDEX ix_outbox_event_order ON outbox_event (order_no, seq);
