-- Migration 13 (v12 -> v13): an applied payment writes less, with every
-- unique key, CHECK and trigger's rule unchanged (docs/performance.md,
-- "Near the batching limit").
--
-- * ix_user_coupon_user and ix_point_log_user go. A coupon's and a points
--   entry's user is their order's user (both are written with the order's
--   user_id, which the orders table refuses to change), so a user's coupons
--   and points are found through ix_orders_user and the unique keys that
--   lead with order_id (uk_order_tpl, uk_order_type). Each of the two cost
--   an index entry on another leaf page for nearly every payment of a batch.
-- * point_log_never_below_zero weighs the order's sum only for an entry
--   that takes points away: one that adds points cannot take an order below
--   zero, so the rule is the same and ORDER_PAID no longer sums the order.
--
-- Run by src/store/sqlite.rs inside the IMMEDIATE transaction that read
-- PRAGMA user_version = 12, which it then sets to 13.

DROP INDEX ix_user_coupon_user;
DROP INDEX ix_point_log_user;

DROP TRIGGER point_log_never_below_zero;
-- An entry whose key is taken is no entry (ON CONFLICT DO NOTHING skips it
-- after this trigger ran), so only a new one is weighed.
CREATE TRIGGER point_log_never_below_zero
BEFORE INSERT ON point_log
WHEN NEW.points < 0
 AND (SELECT coalesce(sum(points), 0) FROM point_log WHERE order_id = NEW.order_id) + NEW.points < 0
 AND NOT EXISTS (SELECT 1 FROM point_log WHERE order_id = NEW.order_id AND point_type = NEW.point_type
                 AND coalesce(refund_no, '') = coalesce(NEW.refund_no, ''))
BEGIN
    SELECT RAISE(ABORT, 'an order''s points never go below zero');
END;
