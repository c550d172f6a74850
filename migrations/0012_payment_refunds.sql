-- Migration 12 (v11 -> v12): the database half of returning money payonce
-- did not want (docs/decisions.md, "Money returned once"). A refund-required
-- payment (`already_paid`, `paid_after_close`, `amount_mismatch`) may have a
-- refund of its own (refund.pay_no, added by migration 11): of that payment
-- and that order, for the payment's whole amount, one in flight and one
-- succeeded at most; its success resolves the payment `refunded`, a
-- resolution only such a success can give. Nothing is copied: no refund
-- before v12 names a payment.
--
-- Run by src/store/sqlite.rs inside the IMMEDIATE transaction that read
-- PRAGMA user_version = 11, which it then sets to 12.

-- One refund of a payment in flight, and one succeeded: the platform returns
-- a payment once, whatever payonce asks.
CREATE UNIQUE INDEX uk_refund_payment_in_flight ON refund (pay_no) WHERE status = 'REQUESTED' AND pay_no IS NOT NULL;
CREATE UNIQUE INDEX uk_refund_payment_succeeded ON refund (pay_no) WHERE status = 'SUCCEEDED' AND pay_no IS NOT NULL;

CREATE TRIGGER refund_of_payment_returns_it_whole
BEFORE INSERT ON refund
WHEN NEW.pay_no IS NOT NULL
 AND NOT EXISTS (SELECT 1 FROM pay_callback_log
                 WHERE pay_no = NEW.pay_no AND order_id = NEW.order_id AND amount = NEW.amount
                   AND (outcome = 'paid_after_close' OR outcome = 'already_paid' OR outcome = 'amount_mismatch')
                   AND resolution IS NULL)
BEGIN
    SELECT RAISE(ABORT, 'a payment''s refund returns an unresolved refund-required payment of its order, whole');
END;

CREATE TRIGGER pay_callback_log_refunded_by_its_refund
BEFORE UPDATE OF resolution ON pay_callback_log
WHEN NEW.resolution = 'refunded'
 AND NOT EXISTS (SELECT 1 FROM refund WHERE pay_no = NEW.pay_no AND status = 'SUCCEEDED')
BEGIN
    SELECT RAISE(ABORT, 'a payment is resolved refunded only by its own succeeded refund');
END;

-- The resolution `refunded` and the event `payment.refunded`. A CHECK's text
-- does not change the file format, so, as migrations 8 and 11 did, the stored
-- CREATE TABLE text is edited (src/store/sqlite.rs then bumps schema_version
-- and reads the schema back). Three values are written as `=` joined by OR
-- (migration 8 says why).
PRAGMA writable_schema = ON;
UPDATE sqlite_schema SET sql = replace(sql,
    'resolution  TEXT CHECK (resolution IN (''refunded_externally'', ''accepted'')),',
    'resolution  TEXT CHECK ((resolution = ''refunded_externally'' OR resolution = ''accepted''
                             OR resolution = ''refunded'')),')
WHERE type = 'table' AND name = 'pay_callback_log';
UPDATE sqlite_schema SET sql = replace(sql,
    'OR type = ''order.partially_refunded'')',
    'OR type = ''order.partially_refunded''
                                                OR type = ''payment.refunded'')')
WHERE type = 'table' AND name = 'outbox_event';
PRAGMA writable_schema = OFF;
