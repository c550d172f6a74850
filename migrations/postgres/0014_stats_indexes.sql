-- Migration 14 (v13 -> v14), PostgreSQL: what
-- migrations/0014_stats_indexes.sql does on SQLite. The stats counts of
-- settled refunds and ended webhook deliveries read an index, not the table.

CREATE INDEX ix_refund_settled_at ON refund (settled_at) WHERE settled_at IS NOT NULL;
CREATE INDEX ix_webhook_delivery_finished ON webhook_delivery (last_attempt_at) WHERE status IN ('delivered', 'failed');
