-- Migration 11 (v10 -> v11) on PostgreSQL, the twin of
-- migrations/0011_refund_amounts.sql: a refund's own `amount` (every older
-- refund refunded its whole order: its order's amount), `reason` and
-- `pay_no`; an order's `refunded_amount`, the sum of its succeeded order
-- refunds, kept by a trigger and never past `amount`; a points entry's
-- `refund_no`, and an order's points never below zero. ADD COLUMN appends
-- the columns last, where schema.postgres.sql has them; the named CHECKs are
-- named alike in a fresh database.
-- Run by src/store/postgres.rs in the transaction, under the schema
-- advisory lock, that read version 10 and then records 11.

ALTER TABLE orders ADD COLUMN refunded_amount BIGINT NOT NULL DEFAULT 0;
ALTER TABLE orders ADD CONSTRAINT orders_refunded_amount_check CHECK (refunded_amount BETWEEN 0 AND amount);
UPDATE orders SET refunded_amount = amount WHERE status = 'REFUNDED';

CREATE FUNCTION orders_refunded_amount_only_grows() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.refunded_amount < OLD.refunded_amount THEN
        RAISE EXCEPTION 'an order''s refunded_amount only grows';
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER orders_refunded_amount_only_grows
BEFORE UPDATE OF refunded_amount ON orders
FOR EACH ROW EXECUTE FUNCTION orders_refunded_amount_only_grows();

ALTER TABLE refund ADD COLUMN amount BIGINT;
UPDATE refund SET amount = o.amount FROM orders o WHERE o.id = refund.order_id;
ALTER TABLE refund ALTER COLUMN amount SET NOT NULL;
ALTER TABLE refund ADD CONSTRAINT refund_amount_check CHECK (amount > 0);
ALTER TABLE refund ADD COLUMN reason TEXT CHECK (reason IS NULL OR length(reason) BETWEEN 1 AND 80);
ALTER TABLE refund ADD COLUMN pay_no TEXT;

DROP INDEX uk_refund_succeeded;
DROP INDEX uk_refund_requested;
-- One order refund in flight per order (a payment's refund is its own).
CREATE UNIQUE INDEX uk_refund_requested ON refund (order_id) WHERE status = 'REQUESTED' AND pay_no IS NULL;

CREATE OR REPLACE FUNCTION refund_legal_transitions() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.refund_no IS DISTINCT FROM OLD.refund_no
       OR NEW.order_id IS DISTINCT FROM OLD.order_id
       OR NEW.requested_at IS DISTINCT FROM OLD.requested_at
       OR NEW.amount IS DISTINCT FROM OLD.amount
       OR NEW.reason IS DISTINCT FROM OLD.reason
       OR NEW.pay_no IS DISTINCT FROM OLD.pay_no
       OR (NEW.status IS DISTINCT FROM OLD.status
           AND NOT (OLD.status = 'REQUESTED' AND NEW.status IN ('SUCCEEDED', 'FAILED')))
       OR (OLD.settled_at IS NOT NULL AND NEW.settled_at IS DISTINCT FROM OLD.settled_at)
       OR (OLD.status <> 'REQUESTED'
           AND NEW.platform_settled_at IS DISTINCT FROM OLD.platform_settled_at) THEN
        RAISE EXCEPTION 'a refund only settles once, REQUESTED -> SUCCEEDED | FAILED, and its times and amount stay';
    END IF;
    RETURN NEW;
END;
$$;

-- An order's refunded_amount is the sum of its succeeded order refunds,
-- kept by the database itself: the orders CHECK then refuses a refund that
-- would return more than was paid.
CREATE FUNCTION refund_succeeded_adds_to_its_order() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'SUCCEEDED' AND NEW.pay_no IS NULL
       AND (TG_OP = 'INSERT' OR OLD.status = 'REQUESTED') THEN
        UPDATE orders SET refunded_amount = refunded_amount + NEW.amount WHERE id = NEW.order_id;
    END IF;
    RETURN NULL;
END;
$$;
-- Two triggers, as SQLite has: a refund settled, and one written settled.
CREATE TRIGGER refund_succeeded_adds_to_its_order
AFTER UPDATE OF status ON refund
FOR EACH ROW EXECUTE FUNCTION refund_succeeded_adds_to_its_order();
CREATE TRIGGER refund_succeeded_at_once_adds_to_its_order
AFTER INSERT ON refund
FOR EACH ROW EXECUTE FUNCTION refund_succeeded_adds_to_its_order();

ALTER TABLE point_log ADD COLUMN refund_no TEXT;
ALTER TABLE point_log ADD CONSTRAINT point_log_refund_no_check
    CHECK (refund_no IS NULL OR point_type = 'ORDER_PAID_REVERSAL');
DROP INDEX uk_order_type;
-- One ORDER_PAID per order, one reversal per refund, and one without a
-- refund (compensation's reverse_points).
CREATE UNIQUE INDEX uk_order_type ON point_log (order_id, point_type, (coalesce(refund_no, '')));

CREATE FUNCTION point_log_never_below_zero() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- An entry whose key is taken is no entry (ON CONFLICT DO NOTHING skips
    -- it after this trigger ran), so only a new one is weighed.
    IF (SELECT coalesce(sum(points), 0) FROM point_log WHERE order_id = NEW.order_id) + NEW.points < 0
       AND NOT EXISTS (SELECT 1 FROM point_log WHERE order_id = NEW.order_id AND point_type = NEW.point_type
                       AND coalesce(refund_no, '') = coalesce(NEW.refund_no, '')) THEN
        RAISE EXCEPTION 'an order''s points never go below zero';
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER point_log_never_below_zero BEFORE INSERT ON point_log
FOR EACH ROW EXECUTE FUNCTION point_log_never_below_zero();

-- The event of a refund that returned part of an order.
ALTER TABLE outbox_event DROP CONSTRAINT outbox_event_type_check;
ALTER TABLE outbox_event ADD CONSTRAINT outbox_event_type_check
    CHECK (type IN ('order.paid', 'order.closed', 'order.refunding', 'order.refunded', 'order.refund_failed',
                    'payment.refund_required', 'order.partially_refunded'));
