-- Migration 13 (v12 -> v13), PostgreSQL: what
-- migrations/0013_cheaper_payment_writes.sql does on SQLite. A user's
-- coupons and points are found through ix_orders_user (their user is their
-- order's), so their own user_id indexes go; point_log_never_below_zero sums
-- the order's points only for an entry that takes points away. No row
-- changes; every rule is the same.

DROP INDEX ix_user_coupon_user;
DROP INDEX ix_point_log_user;

CREATE OR REPLACE FUNCTION point_log_never_below_zero() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- Only an entry that takes points away can take the order below zero.
    -- An entry whose key is taken is no entry (ON CONFLICT DO NOTHING skips
    -- it after this trigger ran), so only a new one is weighed.
    IF NEW.points < 0 THEN
        IF (SELECT coalesce(sum(points), 0) FROM point_log WHERE order_id = NEW.order_id) + NEW.points < 0
           AND NOT EXISTS (SELECT 1 FROM point_log WHERE order_id = NEW.order_id AND point_type = NEW.point_type
                           AND coalesce(refund_no, '') = coalesce(NEW.refund_no, '')) THEN
            RAISE EXCEPTION 'an order''s points never go below zero';
        END IF;
    END IF;
    RETURN NEW;
END;
$$;
