-- Migration 14 (v13 -> v14): the two counts of GET /v1/admin/stats that
-- read a whole table read an index instead (docs/operations.md, "Counts
-- over time"): refunds by the time they were settled, and webhook
-- deliveries that ended (delivered or dead-lettered) by their last attempt.
-- The console's overview asks for them every few seconds; webhook_delivery
-- grows by an event times the endpoints. Neither table is written on a
-- payment's path: a refund's row when it settles, a delivery's when it ends.
--
-- Run by src/store/sqlite.rs inside the IMMEDIATE transaction that read
-- PRAGMA user_version = 13, which it then sets to 14.

CREATE INDEX ix_refund_settled_at ON refund (settled_at) WHERE settled_at IS NOT NULL;
CREATE INDEX ix_webhook_delivery_finished ON webhook_delivery (last_attempt_at) WHERE status IN ('delivered', 'failed');
