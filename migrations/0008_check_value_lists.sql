-- Migration 8 (v7 -> v8): every CHECK that lists three or more values is
-- written as `=` comparisons joined by OR. SQLite evaluates an IN list of
-- three or more constants through an ephemeral table that it builds again on
-- every statement that checks it: nine of them per applied payment, about a
-- third of the payment's work on the one writer (docs/performance.md). Both
-- forms accept and refuse the same values, NULL included (either form of a
-- NULL is NULL, which a CHECK lets through), so no row is read or copied.
--
-- A CHECK's text does not change the file format, so this is SQLite's own
-- procedure for changing one without rebuilding the table (ALTER TABLE, "Making
-- Other Kinds Of Table Schema Changes"): the stored CREATE TABLE text is edited
-- in sqlite_schema, then src/store/sqlite.rs bumps schema_version so every
-- connection parses the new text, and reads the schema back before the
-- transaction commits. Each replace() names text that schema.sql at version 7
-- has exactly once per table (tests/it/schema.rs: a v1 database migrated
-- through every migration equals a fresh one, object by object).
--
-- Run by src/store/sqlite.rs inside the IMMEDIATE transaction that read
-- PRAGMA user_version = 7, which it then sets to 8.

PRAGMA writable_schema = ON;

UPDATE sqlite_schema SET sql = replace(sql,
    'status IN (''PENDING'', ''PAID'', ''CLOSED'', ''REFUNDING'', ''REFUNDED'')',
    '(status = ''PENDING'' OR status = ''PAID'' OR status = ''CLOSED'' OR status = ''REFUNDING'' OR status = ''REFUNDED'')')
WHERE type = 'table' AND name = 'orders';

UPDATE sqlite_schema SET sql = replace(sql,
    'channel IN (''generic'', ''wechatpay'', ''alipay'')',
    '(channel = ''generic'' OR channel = ''wechatpay'' OR channel = ''alipay'')')
WHERE type = 'table' AND name = 'pay_callback_log';

UPDATE sqlite_schema SET sql = replace(sql,
    'outcome IN (''recorded'', ''payment_failed'', ''paid_after_close'',
                                                    ''already_paid'', ''amount_mismatch'', ''applied'')',
    '(outcome = ''recorded'' OR outcome = ''payment_failed'' OR outcome = ''paid_after_close''
                                                    OR outcome = ''already_paid'' OR outcome = ''amount_mismatch'' OR outcome = ''applied'')')
WHERE type = 'table' AND name = 'pay_callback_log';

UPDATE sqlite_schema SET sql = replace(sql,
    'source IN (''callback'', ''reconciliation'', ''query'')',
    '(source = ''callback'' OR source = ''reconciliation'' OR source = ''query'')')
WHERE type = 'table' AND name = 'pay_callback_log';

UPDATE sqlite_schema SET sql = replace(sql,
    'outcome IN (''paid_after_close'', ''already_paid'', ''amount_mismatch'')',
    '(outcome = ''paid_after_close'' OR outcome = ''already_paid'' OR outcome = ''amount_mismatch'')')
WHERE type = 'table' AND name = 'pay_callback_log';

UPDATE sqlite_schema SET sql = replace(sql,
    'status IN (''REQUESTED'', ''SUCCEEDED'', ''FAILED'')',
    '(status = ''REQUESTED'' OR status = ''SUCCEEDED'' OR status = ''FAILED'')')
WHERE type = 'table' AND name = 'refund';

UPDATE sqlite_schema SET sql = replace(sql,
    'status IN (''ACTIVE'', ''FROZEN'', ''USED'')',
    '(status = ''ACTIVE'' OR status = ''FROZEN'' OR status = ''USED'')')
WHERE type = 'table' AND name = 'user_coupon';

UPDATE sqlite_schema SET sql = replace(sql,
    'type IN (''order.paid'', ''order.closed'', ''order.refunding'',
                                                ''order.refunded'', ''order.refund_failed'',
                                                ''payment.refund_required'')',
    '(type = ''order.paid'' OR type = ''order.closed'' OR type = ''order.refunding''
                                                OR type = ''order.refunded'' OR type = ''order.refund_failed''
                                                OR type = ''payment.refund_required'')')
WHERE type = 'table' AND name = 'outbox_event';

UPDATE sqlite_schema SET sql = replace(sql,
    'status IN (''pending'', ''delivered'', ''failed'', ''disabled'')',
    '(status = ''pending'' OR status = ''delivered'' OR status = ''failed'' OR status = ''disabled'')')
WHERE type = 'table' AND name = 'webhook_delivery';

UPDATE sqlite_schema SET sql = replace(sql,
    'kind IN (''query'', ''close'', ''refund'', ''refund_query'')',
    '(kind = ''query'' OR kind = ''close'' OR kind = ''refund'' OR kind = ''refund_query'')')
WHERE type = 'table' AND name = 'platform_call';

UPDATE sqlite_schema SET sql = replace(sql,
    'status IN (''pending'', ''done'', ''failed'', ''given_up'')',
    '(status = ''pending'' OR status = ''done'' OR status = ''failed'' OR status = ''given_up'')')
WHERE type = 'table' AND name = 'platform_call';

PRAGMA writable_schema = OFF;
