-- Migration 6 (v5 -> v6): GET /v1/orders/{order_no} returns the order's
-- outbox events (for the operator console, docs/console.md), found by order_no.
-- An index only: no table is rebuilt and no row changes. Run by
-- src/store/sqlite.rs inside the IMMEDIATE transaction that read
-- PRAGMA user_version = 5, which it then sets to 6.

CREATE INDEX ix_outbox_event_order ON outbox_event (order_no, seq);
