-- Migration 12 (v11 -> v12), PostgreSQL: what migrations/0012_payment_refunds.sql
-- does on SQLite. A refund-required payment may have a refund of its own
-- (refund.pay_no): of that payment and that order, for the payment's whole
-- amount, one in flight and one succeeded at most; its success resolves the
-- payment `refunded`, a resolution only such a success can give; the event
-- `payment.refunded` says so. No row changes.

-- One refund of a payment in flight, and one succeeded: the platform returns
-- a payment once, whatever payonce asks.
CREATE UNIQUE INDEX uk_refund_payment_in_flight ON refund (pay_no) WHERE status = 'REQUESTED' AND pay_no IS NOT NULL;
CREATE UNIQUE INDEX uk_refund_payment_succeeded ON refund (pay_no) WHERE status = 'SUCCEEDED' AND pay_no IS NOT NULL;

CREATE FUNCTION refund_of_payment_returns_it_whole() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.pay_no IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM pay_callback_log
                       WHERE pay_no = NEW.pay_no AND order_id = NEW.order_id AND amount = NEW.amount
                         AND outcome IN ('paid_after_close', 'already_paid', 'amount_mismatch')
                         AND resolution IS NULL) THEN
        RAISE EXCEPTION 'a payment''s refund returns an unresolved refund-required payment of its order, whole';
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER refund_of_payment_returns_it_whole BEFORE INSERT ON refund
FOR EACH ROW EXECUTE FUNCTION refund_of_payment_returns_it_whole();

CREATE FUNCTION pay_callback_log_refunded_by_its_refund() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.resolution = 'refunded'
       AND NOT EXISTS (SELECT 1 FROM refund WHERE pay_no = NEW.pay_no AND status = 'SUCCEEDED') THEN
        RAISE EXCEPTION 'a payment is resolved refunded only by its own succeeded refund';
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER pay_callback_log_refunded_by_its_refund BEFORE UPDATE OF resolution ON pay_callback_log
FOR EACH ROW EXECUTE FUNCTION pay_callback_log_refunded_by_its_refund();

ALTER TABLE pay_callback_log DROP CONSTRAINT pay_callback_log_resolution_check;
ALTER TABLE pay_callback_log ADD CONSTRAINT pay_callback_log_resolution_check
    CHECK (resolution IN ('refunded_externally', 'accepted', 'refunded'));

ALTER TABLE outbox_event DROP CONSTRAINT outbox_event_type_check;
ALTER TABLE outbox_event ADD CONSTRAINT outbox_event_type_check
    CHECK (type IN ('order.paid', 'order.closed', 'order.refunding', 'order.refunded', 'order.refund_failed',
                    'payment.refund_required', 'order.partially_refunded', 'payment.refunded'));
