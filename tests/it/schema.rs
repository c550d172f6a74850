//! The database contract of schema.sql, in process: named unique
//! indexes, append-only ledgers, CHECKs, the order state machine as a
//! trigger, the shared `:memory:` database and an idempotent schema setup.
//! Rows are created through the App's own operations first, so every refusal
//! below would otherwise have hit something real.

use crate::util::{count, Pay, TempDir};
use payonce::{App, Clock, Config, CreateOrder, PlatformStatus, RefundCallback, Rewards};
use rusqlite::{Connection, ErrorCode};

const T0: i64 = 1_700_000_000_000;

fn config() -> Config {
    Config {
        rewards: Rewards { coupon_templates: vec!["NEW10".into(), "VIP".into()], points_per_yuan: 2 },
        ..Config::default()
    }
}

fn memory_app() -> App {
    App::open(":memory:", Clock::manual(T0), config()).expect("open :memory:")
}

fn create(app: &App, order_no: &str, amount: i64) {
    let (_, created) = app
        .orders()
        .create_order(&CreateOrder {
            order_no: order_no.into(),
            user_id: "u1".into(),
            amount,
            currency: "CNY".into(),
            expires_in_s: None,
        })
        .expect("create order");
    assert!(created, "{order_no} created");
}

/// Real rows in every ledger table, made by the App's operations.
fn seed(app: &App) {
    create(app, "O-1", 9999);
    assert_eq!(
        Pay { pay_no: "P-1", order_no: "O-1", amount: 9999, status: "SUCCESS" }.deliver(app).outcome_str(),
        "applied"
    );
    app.refunds().request_refund("O-1", "R-1").expect("request refund");
    let refund = RefundCallback {
        channel: "generic".into(),
        refund_no: "R-1".into(),
        order_no: "O-1".into(),
        status: PlatformStatus::Success,
        settled_at: None,
        amount: None,
        refunded_total: None,
    };
    assert_eq!(app.refunds().deliver_refund(&refund).expect("deliver refund").as_str(), "applied");
    create(app, "O-2", 5000);
    assert_eq!(
        Pay { pay_no: "P-2", order_no: "O-2", amount: 5000, status: "SUCCESS" }.deliver(app).outcome_str(),
        "applied"
    );
    let refused = app.orders().close_order("O-2").expect_err("closing a PAID order is refused");
    assert_eq!(
        (payonce::api::status_of(refused.kind), payonce::api::code_of(refused.kind)),
        (409, "invalid_transition")
    );
    create(app, "O-3", 100);
    app.orders().close_order("O-3").expect("close");
    assert_eq!(
        Pay { pay_no: "P-3", order_no: "O-3", amount: 100, status: "SUCCESS" }.deliver(app).outcome_str(),
        "paid_after_close"
    );
}

fn order_id(conn: &Connection, order_no: &str) -> i64 {
    conn.query_row("SELECT id FROM orders WHERE order_no = ?1", [order_no], |r| r.get(0)).expect("order id")
}

/// The statement is refused by a constraint (CHECK, UNIQUE, FOREIGN KEY or a
/// trigger's RAISE), not by a typo.
fn assert_refused(conn: &Connection, sql: &str) {
    match conn.execute_batch(sql) {
        Ok(()) => panic!("the database accepted: {sql}"),
        Err(e) => assert_eq!(e.sqlite_error_code(), Some(ErrorCode::ConstraintViolation), "{sql}: {e}"),
    }
}

/// Runs `sql` inside a savepoint that is rolled back, so a case leaves no trace.
fn attempt(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.execute_batch("SAVEPOINT attempt")?;
    let result = conn.execute_batch(sql);
    conn.execute_batch("ROLLBACK TO attempt; RELEASE attempt")?;
    result
}

#[test]
fn named_unique_indexes_exist_with_their_columns() {
    let app = memory_app();
    seed(&app);
    let conn = app.store().raw_connection().expect("raw connection");
    let expected: [(&str, &str, &[&str]); 8] = [
        ("uk_order_no", "orders", &["order_no"]),
        ("uk_pay_no", "pay_callback_log", &["pay_no"]),
        ("uk_refund_no", "refund", &["refund_no"]),
        ("uk_order_tpl", "user_coupon", &["order_id", "coupon_template_id"]),
        ("uk_order_type", "point_log", &["order_id", "point_type", "<expression>"]),
        ("uk_event_id", "outbox_event", &["event_id"]),
        ("uk_scope_key", "idempotency_key", &["scope", "key"]),
        ("uk_endpoint_event", "webhook_delivery", &["endpoint", "event_id"]),
    ];
    for (index, table, columns) in expected {
        let mut list = conn.prepare(&format!("PRAGMA index_list({table})")).expect("index_list");
        let found: Vec<(String, bool, bool)> = list
            .query_map([], |r| Ok((r.get::<_, String>(1)?, r.get::<_, i64>(2)? == 1, r.get::<_, i64>(4)? == 1)))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        let entry = found.iter().find(|(name, _, _)| name == index);
        let Some((_, unique, partial)) = entry else {
            panic!("{table} has no index named {index}; it has {found:?}");
        };
        assert!(*unique, "{index} is UNIQUE");
        assert!(!*partial, "{index} covers every row (not a partial index)");
        let mut info = conn.prepare(&format!("PRAGMA index_info({index})")).expect("index_info");
        // An expression's column has no name: coalesce(refund_no, '') in uk_order_type.
        let cols: Vec<String> = info
            .query_map([], |r| Ok(r.get::<_, Option<String>>(2)?.unwrap_or_else(|| "<expression>".to_owned())))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        assert_eq!(cols, columns, "{index} columns");
    }

    // And they bite: a second row with an existing key is refused.
    conn.execute_batch(
        "INSERT INTO idempotency_key (scope, key, fingerprint, status_code, response_body, created_at, expires_at)
         VALUES ('anonymous POST /v1/orders', 'k1', printf('%064d', 0), 201, x'7b7d', 't', 't')",
    )
    .expect("an idempotency_key row");
    let duplicates = [
        "INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at)
         SELECT order_no, 'other', 1, 'CNY', 'PENDING', created_at, expires_at FROM orders WHERE order_no = 'O-1'",
        "INSERT INTO pay_callback_log (pay_no, channel, order_id, amount, status, outcome, state, source, raw_body, received_at)
         SELECT pay_no, channel, (SELECT id FROM orders WHERE order_no = 'O-3'), amount, status, 'recorded', 'received', source, raw_body, received_at
         FROM pay_callback_log WHERE pay_no = 'P-1'",
        "INSERT INTO refund (refund_no, order_id, status, requested_at, settled_at, amount)
         SELECT refund_no, (SELECT id FROM orders WHERE order_no = 'O-2'), 'FAILED', requested_at, 't', amount FROM refund WHERE refund_no = 'R-1'",
        "INSERT INTO user_coupon (user_id, order_id, coupon_template_id, status, created_at)
         SELECT user_id, order_id, coupon_template_id, 'ACTIVE', created_at FROM user_coupon LIMIT 1",
        "INSERT INTO point_log (user_id, order_id, point_type, points, created_at)
         SELECT user_id, order_id, point_type, points, created_at FROM point_log LIMIT 1",
        "INSERT INTO outbox_event (event_id, type, order_no, data, created_at)
         SELECT event_id, type, order_no, data, created_at FROM outbox_event LIMIT 1",
        "INSERT INTO idempotency_key (scope, key, fingerprint, status_code, response_body, created_at, expires_at)
         SELECT scope, key, fingerprint, status_code, response_body, created_at, expires_at FROM idempotency_key LIMIT 1",
    ];
    for sql in duplicates {
        assert_refused(&conn, sql);
    }
}

#[test]
fn contract_tables_have_their_columns() {
    let app = memory_app();
    let conn = app.store().raw_connection().expect("raw connection");
    let tables: [(&str, &[&str]); 11] = [
        (
            "orders",
            &[
                "id",
                "order_no",
                "user_id",
                "amount",
                "currency",
                "status",
                "pay_no",
                "created_at",
                "expires_at",
                "paid_at",
                "closed_at",
                "refund_no",
                "refunded_at",
            ],
        ),
        (
            "pay_callback_log",
            &[
                "id",
                "pay_no",
                "channel",
                "order_id",
                "amount",
                "outcome",
                "state",
                "source",
                "raw_body",
                "received_at",
                "applied_at",
                "decided_at",
            ],
        ),
        ("refund", &["id", "refund_no", "order_id", "status", "requested_at", "settled_at"]),
        ("user_coupon", &["id", "user_id", "order_id", "coupon_template_id", "status", "created_at"]),
        ("point_log", &["id", "user_id", "order_id", "point_type", "points", "created_at"]),
        ("outbox_event", &["seq", "event_id", "type", "order_no", "data", "created_at"]),
        (
            "idempotency_key",
            &["scope", "key", "fingerprint", "status_code", "response_body", "created_at", "expires_at"],
        ),
        ("audit_log", &["id", "at", "actor", "action", "order_no", "detail"]),
        ("settings", &["name", "value"]),
        ("webhook_endpoint", &["endpoint", "status", "from_seq", "disabled_at"]),
        (
            "webhook_delivery",
            &[
                "id",
                "endpoint",
                "event_seq",
                "event_id",
                "order_no",
                "status",
                "attempts",
                "next_attempt_at",
                "last_attempt_at",
                "last_status",
                "last_error",
            ],
        ),
    ];
    for (table, columns) in tables {
        let mut stmt = conn.prepare(&format!("PRAGMA table_xinfo({table})")).expect("table_xinfo");
        let have: Vec<String> =
            stmt.query_map([], |r| r.get::<_, String>(1)).expect("query").collect::<Result<_, _>>().expect("rows");
        assert!(!have.is_empty(), "table {table} exists");
        for column in columns {
            assert!(have.iter().any(|c| c == column), "{table}.{column} exists (have {have:?})");
        }
    }
}

#[test]
fn ledger_tables_refuse_delete() {
    let app = memory_app();
    seed(&app);
    let conn = app.store().raw_connection().expect("raw connection");
    for table in ["pay_callback_log", "refund", "user_coupon", "point_log", "outbox_event", "audit_log"] {
        let before = count(&conn, &format!("SELECT count(*) FROM {table}"), []);
        assert!(before > 0, "{table} has rows from the App's operations");
        assert_refused(&conn, &format!("DELETE FROM {table}"));
        assert_refused(&conn, &format!("DELETE FROM {table} WHERE rowid = (SELECT min(rowid) FROM {table})"));
        assert_eq!(count(&conn, &format!("SELECT count(*) FROM {table}"), []), before, "{table} keeps its rows");
    }
    // What the seed wrote, as the spec describes it.
    let reversal: i64 = conn
        .query_row("SELECT points FROM point_log WHERE point_type = 'ORDER_PAID_REVERSAL'", [], |r| r.get(0))
        .expect("reversal entry");
    assert_eq!(reversal, -199);
    let frozen: i64 =
        conn.query_row("SELECT count(*) FROM user_coupon WHERE status = 'FROZEN'", [], |r| r.get(0)).expect("frozen");
    assert_eq!(frozen, 2, "the refunded order's coupons are frozen, not deleted");
}

#[test]
fn checks_refuse_bad_states_and_amounts() {
    let app = memory_app();
    seed(&app);
    let conn = app.store().raw_connection().expect("raw connection");
    let o2 = order_id(&conn, "O-2");
    let o3 = order_id(&conn, "O-3");
    let long = format!("'{}'", "a".repeat(65));
    // (what, statement with {V}, accepted values, refused values)
    let cases: Vec<(&str, String, Vec<String>, Vec<String>)> = vec![
        (
            "orders.status",
            "INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at) VALUES ('X-1', 'u', 100, 'CNY', {V}, 't', 't')".into(),
            vec!["'PENDING'".into()],
            vec!["'FOO'".into(), "'pending'".into(), "'DELETED'".into(), "NULL".into()],
        ),
        (
            "orders.amount",
            "INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at) VALUES ('X-1', 'u', {V}, 'CNY', 'PENDING', 't', 't')".into(),
            vec!["1".into(), "1000000000000".into()],
            vec!["0".into(), "-1".into(), "1000000000001".into(), "99.5".into(), "'abc'".into(), "NULL".into()],
        ),
        (
            "orders.currency",
            "INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at) VALUES ('X-1', 'u', 1, {V}, 'PENDING', 't', 't')".into(),
            vec!["'CNY'".into(), "'USD'".into()],
            vec!["'cny'".into(), "'CNYY'".into(), "'CN'".into(), "NULL".into()],
        ),
        (
            "orders.order_no",
            "INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at) VALUES ({V}, 'u', 1, 'CNY', 'PENDING', 't', 't')".into(),
            vec!["'X-1'".into()],
            vec!["''".into(), "'a b'".into(), long.clone(), "NULL".into()],
        ),
        (
            "orders.status by UPDATE",
            format!("UPDATE orders SET status = {{V}}, refund_no = 'RX-1' WHERE id = {o2}"),
            vec!["'REFUNDING'".into()],
            vec!["'BOGUS'".into(), "NULL".into()],
        ),
        (
            "pay_callback_log.outcome",
            format!("INSERT INTO pay_callback_log (pay_no, channel, order_id, amount, status, outcome, state, source, raw_body, received_at, decided_at) VALUES ('PX-1', 'generic', {o2}, 100, 'SUCCESS', {{V}}, 'decided', 'callback', x'7b7d', 't', 't')"),
            vec!["'already_paid'".into(), "'amount_mismatch'".into(), "'paid_after_close'".into()],
            vec!["'bogus'".into(), "'APPLIED'".into(), "NULL".into()],
        ),
        (
            "pay_callback_log.state",
            format!("INSERT INTO pay_callback_log (pay_no, channel, order_id, amount, status, outcome, state, source, raw_body, received_at, decided_at) VALUES ('PX-1', 'generic', {o2}, 100, 'SUCCESS', 'already_paid', {{V}}, 'callback', x'7b7d', 't', 't')"),
            vec!["'decided'".into()],
            vec!["'done'".into(), "NULL".into()],
        ),
        (
            "pay_callback_log.source",
            format!("INSERT INTO pay_callback_log (pay_no, channel, order_id, amount, status, outcome, state, source, raw_body, received_at, decided_at) VALUES ('PX-1', 'generic', {o2}, 100, 'SUCCESS', 'already_paid', 'decided', {{V}}, x'7b7d', 't', 't')"),
            vec!["'callback'".into(), "'reconciliation'".into()],
            vec!["'manual'".into(), "NULL".into()],
        ),
        (
            "pay_callback_log.amount",
            format!("INSERT INTO pay_callback_log (pay_no, channel, order_id, amount, status, outcome, state, source, raw_body, received_at, decided_at) VALUES ('PX-1', 'generic', {o2}, {{V}}, 'SUCCESS', 'already_paid', 'decided', 'callback', x'7b7d', 't', 't')"),
            vec!["1".into(), "1000000000000".into()],
            vec!["0".into(), "-5".into(), "99.5".into(), "1000000000001".into(), "'x'".into()],
        ),
        (
            "pay_callback_log.pay_no",
            format!("INSERT INTO pay_callback_log (pay_no, channel, order_id, amount, status, outcome, state, source, raw_body, received_at, decided_at) VALUES ({{V}}, 'generic', {o2}, 100, 'SUCCESS', 'already_paid', 'decided', 'callback', x'7b7d', 't', 't')"),
            vec!["'PX-1'".into()],
            vec!["''".into(), "'a b'".into(), long.clone()],
        ),
        (
            "pay_callback_log.order_id (foreign key)",
            "INSERT INTO pay_callback_log (pay_no, channel, order_id, amount, status, outcome, state, source, raw_body, received_at, decided_at) VALUES ('PX-1', 'generic', {V}, 100, 'SUCCESS', 'already_paid', 'decided', 'callback', x'7b7d', 't', 't')".into(),
            vec![o2.to_string()],
            vec!["987654".into()],
        ),
        (
            "refund.status",
            format!("INSERT INTO refund (refund_no, order_id, status, requested_at, settled_at, amount) VALUES ('RX-1', {o3}, {{V}}, 't', 't', 1)"),
            vec!["'FAILED'".into()],
            vec!["'DONE'".into(), "'failed'".into(), "NULL".into()],
        ),
        (
            "refund.order_id (foreign key)",
            "INSERT INTO refund (refund_no, order_id, status, requested_at, settled_at, amount) VALUES ('RX-1', {V}, 'FAILED', 't', 't', 1)".into(),
            vec![o3.to_string()],
            vec!["987654".into()],
        ),
        (
            "user_coupon.status",
            format!("INSERT INTO user_coupon (user_id, order_id, coupon_template_id, status, created_at) VALUES ('u1', {o3}, 'T-X', {{V}}, 't')"),
            vec!["'ACTIVE'".into()],
            vec!["'DELETED'".into(), "'active'".into(), "NULL".into()],
        ),
        (
            "user_coupon.status by UPDATE",
            format!("UPDATE user_coupon SET status = {{V}} WHERE order_id = {o2}"),
            vec!["'FROZEN'".into(), "'USED'".into()],
            vec!["'GONE'".into(), "NULL".into()],
        ),
        (
            "point_log.point_type",
            format!("INSERT INTO point_log (user_id, order_id, point_type, points, created_at) VALUES ('u1', {o3}, {{V}}, 5, 't')"),
            vec!["'ORDER_PAID'".into()],
            vec!["'BONUS'".into(), "NULL".into()],
        ),
        (
            "point_log.points",
            format!("INSERT INTO point_log (user_id, order_id, point_type, points, created_at) VALUES ('u1', {o3}, 'ORDER_PAID', {{V}}, 't')"),
            vec!["5".into()],
            vec!["1.5".into(), "'many'".into(), "NULL".into()],
        ),
        (
            "point_log.order_id (foreign key)",
            "INSERT INTO point_log (user_id, order_id, point_type, points, created_at) VALUES ('u1', {V}, 'ORDER_PAID', 5, 't')".into(),
            vec![o3.to_string()],
            vec!["987654".into()],
        ),
        (
            "outbox_event.type",
            "INSERT INTO outbox_event (event_id, type, order_no, data, created_at) VALUES ({V} || ':X-9', {V}, 'O-3', '{}', 't')".into(),
            vec!["'order.paid'".into(), "'payment.refund_required'".into()],
            vec!["'order.deleted'".into(), "'ORDER.PAID'".into()],
        ),
        (
            "settings mode",
            "UPDATE settings SET value = {V} WHERE name = 'mode'".into(),
            vec!["'record_only'".into(), "'normal'".into()],
            vec!["'chaos'".into(), "'RECORD_ONLY'".into()],
        ),
    ];
    for (what, template, good, bad) in &cases {
        for value in good {
            let sql = template.replace("{V}", value);
            attempt(&conn, &sql).unwrap_or_else(|e| panic!("{what}: {value} must be accepted: {e}\n{sql}"));
        }
        for value in bad {
            let sql = template.replace("{V}", value);
            match attempt(&conn, &sql) {
                Ok(()) => panic!("{what}: {value} was accepted\n{sql}"),
                Err(e) => assert_eq!(
                    e.sqlite_error_code(),
                    Some(ErrorCode::ConstraintViolation),
                    "{what}: {value} refused by a constraint: {e}"
                ),
            }
        }
    }
    assert_eq!(
        conn.query_row("SELECT value FROM settings WHERE name = 'mode'", [], |r| r.get::<_, String>(0)).expect("mode"),
        "normal"
    );
}

/// The columns an order carries in `state`, for raw SQL.
fn state_columns(state: &str) -> &'static str {
    match state {
        "PENDING" => "pay_no = NULL, paid_at = NULL, closed_at = NULL, refund_no = NULL, refunded_at = NULL",
        "CLOSED" => "pay_no = NULL, paid_at = NULL, closed_at = 't', refund_no = NULL, refunded_at = NULL",
        "PAID" => "pay_no = 'SM-PAY', paid_at = 't', closed_at = NULL, refund_no = NULL, refunded_at = NULL",
        "REFUNDING" => "pay_no = 'SM-PAY', paid_at = 't', closed_at = NULL, refund_no = 'SM-REF', refunded_at = NULL",
        "REFUNDED" => "pay_no = 'SM-PAY', paid_at = 't', closed_at = NULL, refund_no = 'SM-REF', refunded_at = 't'",
        other => panic!("unknown state {other}"),
    }
}

/// The legal path from PENDING to `state`.
fn path_to(state: &str) -> &'static [&'static str] {
    match state {
        "PENDING" => &[],
        "PAID" => &["PAID"],
        "CLOSED" => &["CLOSED"],
        "REFUNDING" => &["PAID", "REFUNDING"],
        "REFUNDED" => &["PAID", "REFUNDING", "REFUNDED"],
        other => panic!("unknown state {other}"),
    }
}

fn move_to(conn: &Connection, id: i64, state: &str) -> rusqlite::Result<()> {
    conn.execute_batch(&format!("UPDATE orders SET status = '{state}', {} WHERE id = {id}", state_columns(state)))
}

/// A new PENDING order walked along legal edges to `state`; returns its id.
fn order_in_state(conn: &Connection, order_no: &str, state: &str) -> i64 {
    conn.execute(
        "INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at)
         VALUES (?1, 'u', 100, 'CNY', 'PENDING', 't', 't')",
        [order_no],
    )
    .expect("insert a PENDING order");
    let id = conn.last_insert_rowid();
    for step in path_to(state) {
        move_to(conn, id, step).unwrap_or_else(|e| panic!("{order_no}: legal step to {step} refused: {e}"));
    }
    id
}

#[test]
fn order_state_machine_trigger_allows_exactly_the_five_edges() {
    let app = memory_app();
    let conn = app.store().raw_connection().expect("raw connection");
    let states = ["PENDING", "PAID", "CLOSED", "REFUNDING", "REFUNDED"];
    let mut legal = vec![
        ("PENDING", "PAID"),
        ("PENDING", "CLOSED"),
        ("PAID", "REFUNDING"),
        ("REFUNDING", "REFUNDED"),
        ("REFUNDING", "PAID"),
    ];
    let mut allowed = Vec::new();
    for (i, from) in states.iter().enumerate() {
        for (j, to) in states.iter().enumerate() {
            let id = order_in_state(&conn, &format!("SM-{i}-{j}"), from);
            // The update sets exactly the columns a `to` order has (the legal
            // walks above prove that shape passes every CHECK), so a refusal
            // comes from the transition trigger.
            let result =
                attempt(&conn, &format!("UPDATE orders SET status = '{to}', {} WHERE id = {id}", state_columns(to)));
            let status: String =
                conn.query_row("SELECT status FROM orders WHERE id = ?1", [id], |r| r.get(0)).expect("status");
            assert_eq!(&status, from, "attempts are rolled back");
            if from == to {
                continue; // not a move
            }
            match result {
                Ok(()) => allowed.push((*from, *to)),
                Err(e) => assert_eq!(
                    e.sqlite_error_code(),
                    Some(ErrorCode::ConstraintViolation),
                    "{from} -> {to} refused by the trigger: {e}"
                ),
            }
        }
    }
    allowed.sort();
    legal.sort();
    assert_eq!(allowed, legal, "exactly the five legal edges pass at the SQL level");

    // Committed for real, the legal path walks end to end, and never back.
    let id = order_in_state(&conn, "SM-WALK", "PENDING");
    for to in ["PAID", "REFUNDING", "PAID", "REFUNDING", "REFUNDED"] {
        move_to(&conn, id, to).unwrap_or_else(|e| panic!("-> {to}: {e}"));
    }
    for back in ["PENDING", "PAID", "REFUNDING", "CLOSED"] {
        assert_refused(&conn, &format!("UPDATE orders SET status = '{back}', {} WHERE id = {id}", state_columns(back)));
    }
}

/// PENDING -> PAID by a payment callback is the only way in (the five legal edges, schema.sql):
/// an order written straight into a later state would skip the state machine
/// the trigger guards, so the database refuses it too.
#[test]
fn orders_are_born_pending() {
    let app = memory_app();
    let conn = app.store().raw_connection().expect("raw connection");
    for state in ["PAID", "CLOSED", "REFUNDING", "REFUNDED"] {
        let (columns, values): (Vec<&str>, Vec<&str>) =
            state_columns(state).split(", ").filter_map(|a| a.split_once(" = ")).unzip();
        let sql = format!(
            "INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at, {})
             VALUES ('BORN-{state}', 'u', 100, 'CNY', '{state}', 't', 't', {})",
            columns.join(", "),
            values.join(", ")
        );
        match attempt(&conn, &sql) {
            Ok(()) => panic!("an order was inserted directly as {state}, bypassing PENDING -> ... (schema.sql has no INSERT guard on orders)"),
            Err(e) => assert_eq!(e.sqlite_error_code(), Some(ErrorCode::ConstraintViolation), "{state}: {e}"),
        }
    }
}

#[test]
fn memory_database_is_shared_by_every_pool_connection() {
    let app = memory_app();
    // Hold two pool connections open while the app writes on a third.
    let first = app.store().raw_connection().expect("first");
    let second = app.store().raw_connection().expect("second");
    seed(&app);
    for conn in [&first, &second] {
        assert_eq!(count(conn, "SELECT count(*) FROM orders", []), 3, "every connection sees the App's writes");
        assert_eq!(count(conn, "SELECT count(*) FROM pay_callback_log", []), 3);
    }
    // A raw write on one connection is seen by the other and by the App.
    first
        .execute_batch(
            "INSERT INTO audit_log (at, actor, action, order_no, detail) VALUES ('t', 'test', 'probe', 'O-1', '{}')",
        )
        .expect("raw write");
    assert_eq!(
        second
            .query_row("SELECT count(*) FROM audit_log WHERE action = 'probe'", [], |r| r.get::<_, i64>(0))
            .expect("read"),
        1
    );
    assert_eq!(app.orders().order("O-1").expect("order").order.status.as_str(), "REFUNDED");
    // Pool connections come and go; the database stays.
    drop(first);
    drop(second);
    let conns: Vec<_> = (0..8).map(|_| app.store().raw_connection().expect("conn")).collect();
    for conn in &conns {
        assert_eq!(count(conn, "SELECT count(*) FROM orders", []), 3);
    }
    drop(conns);
    // Each App on ":memory:" is a database of its own.
    let other = memory_app();
    assert!(other.orders().order("O-1").is_err(), "a second :memory: App starts empty");
    assert_eq!(count(&other.store().raw_connection().expect("conn"), "SELECT count(*) FROM orders", []), 0);
}

#[test]
fn schema_applies_once_and_connections_are_configured() {
    let dir = TempDir::new("schema");
    let path = dir.path("twice.db").display().to_string();
    let first = App::open(&path, Clock::manual(T0), config()).expect("first open");
    seed(&first);
    let conn = first.store().raw_connection().expect("conn");
    conn.execute_batch("UPDATE settings SET value = 'record_only' WHERE name = 'mode'").expect("set mode");
    let objects = |c: &Connection| -> Vec<(String, String)> {
        let mut stmt = c.prepare("SELECT type, name FROM sqlite_master ORDER BY type, name").expect("master");
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).expect("query").collect::<Result<_, _>>().expect("rows")
    };
    let before = objects(&conn);
    let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0)).expect("user_version");
    assert!(version >= 1, "the schema is versioned with user_version");

    // A second App on the same file while the first is open, then a third after both close.
    let second = App::open(&path, Clock::manual(T0), config()).expect("second open on the same file");
    let conn2 = second.store().raw_connection().expect("conn");
    assert_eq!(objects(&conn2), before, "no object added or dropped");
    assert_eq!(conn2.query_row("PRAGMA user_version", [], |r| r.get::<_, i64>(0)).expect("v"), version);
    assert_eq!(count(&conn2, "SELECT count(*) FROM orders", []), 3, "data kept");
    assert_eq!(
        count(&conn2, "SELECT count(*) FROM outbox_event", []),
        count(&conn, "SELECT count(*) FROM outbox_event", [])
    );
    assert_eq!(
        conn2.query_row("SELECT value FROM settings WHERE name = 'mode'", [], |r| r.get::<_, String>(0)).expect("mode"),
        "record_only",
        "re-opening does not reset the mode"
    );
    assert_eq!(second.orders().order("O-2").expect("order").order.status.as_str(), "PAID");
    drop((conn, conn2, first, second));
    let third = App::open(&path, Clock::manual(T0), config()).expect("third open");
    let conn3 = third.store().raw_connection().expect("conn");
    assert_eq!(objects(&conn3), before);
    assert_eq!(count(&conn3, "SELECT count(*) FROM pay_callback_log", []), 3);

    // The connection settings (WAL and the rest of src/store/sqlite.rs's PRAGMAs) on a file database.
    let journal: String = conn3.query_row("PRAGMA journal_mode", [], |r| r.get(0)).expect("journal_mode");
    assert_eq!(journal.to_lowercase(), "wal");
    let synchronous: i64 = conn3.query_row("PRAGMA synchronous", [], |r| r.get(0)).expect("synchronous");
    assert_eq!(synchronous, 2, "synchronous=FULL by default");
    let foreign_keys: i64 = conn3.query_row("PRAGMA foreign_keys", [], |r| r.get(0)).expect("foreign_keys");
    assert_eq!(foreign_keys, 1);
    let busy: i64 = conn3.query_row("PRAGMA busy_timeout", [], |r| r.get(0)).expect("busy_timeout");
    assert!(busy > 0, "busy_timeout set");
    let memory = memory_app();
    let mconn = memory.store().raw_connection().expect("conn");
    assert_eq!(mconn.query_row("PRAGMA foreign_keys", [], |r| r.get::<_, i64>(0)).expect("fk"), 1);
}

// ---- upgrades (docs/decisions.md, "Upgrades") ----

/// payonce's schema.sql as released in version 1 (commit 0aaa515).
const SCHEMA_V1: &str = include_str!("../fixtures/schema_v1.sql");
/// Rows in every state, written into a v1 database.
const V1_ROWS: &str = include_str!("../fixtures/v1_rows.sql");

/// A v1 database as a v1 payonce left it: v1's schema, user_version 1, rows.
pub(crate) fn v1_database(path: &std::path::Path) {
    let conn = Connection::open(path).expect("create the v1 file");
    conn.execute_batch("PRAGMA foreign_keys = ON; PRAGMA journal_mode = WAL;").expect("v1 pragmas");
    conn.execute_batch(&format!("BEGIN IMMEDIATE; {SCHEMA_V1}; PRAGMA user_version = 1; COMMIT;")).expect("v1 schema");
    conn.execute_batch(&format!("BEGIN; {V1_ROWS}; COMMIT;")).expect("v1 rows");
}

/// Every object of the schema, as SQLite stores it: (type, name, table, sql).
fn schema_objects(conn: &Connection) -> Vec<(String, String, String, Option<String>)> {
    let mut stmt =
        conn.prepare("SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name").expect("master");
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows")
}

/// Each table's columns and each index's columns, as the pragmas describe them.
fn schema_pragmas(conn: &Connection) -> Vec<String> {
    let objects = schema_objects(conn);
    let mut out = Vec::new();
    for (kind, name, _, _) in &objects {
        let pragmas: &[&str] = match kind.as_str() {
            "table" => &["table_xinfo", "index_list", "foreign_key_list"],
            "index" => &["index_xinfo"],
            _ => &[],
        };
        for pragma in pragmas {
            let mut stmt = conn.prepare(&format!("PRAGMA {pragma}(\"{name}\")")).expect("pragma");
            let width = stmt.column_count();
            let rows = stmt
                .query_map([], |r| {
                    (0..width)
                        .map(|i| r.get::<_, rusqlite::types::Value>(i).map(|v| format!("{v:?}")))
                        .collect::<Result<Vec<_>, _>>()
                })
                .expect("query")
                .collect::<Result<Vec<_>, _>>()
                .expect("rows");
            out.extend(rows.into_iter().map(|r| format!("{pragma}({name}): {}", r.join(", "))));
        }
    }
    out
}

/// Every row of every table, by the columns `columns_of` names for it, in rowid order.
/// Every row of every table `columns_of` names columns for (tables it
/// answers `None` for, e.g. those newer than v1, are left out).
fn all_rows(conn: &Connection, columns_of: &dyn Fn(&str) -> Option<Vec<String>>) -> Vec<(String, Vec<String>)> {
    let tables: Vec<String> = schema_objects(conn).into_iter().filter(|o| o.0 == "table").map(|o| o.1).collect();
    let mut out = Vec::new();
    for table in tables {
        let Some(columns) = columns_of(&table) else {
            continue;
        };
        let sql = format!("SELECT {} FROM \"{table}\" ORDER BY rowid", columns.join(", "));
        let mut stmt = conn.prepare(&sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
        let rows = stmt
            .query_map([], |r| {
                (0..columns.len())
                    .map(|i| r.get::<_, rusqlite::types::Value>(i).map(|v| format!("{v:?}")))
                    .collect::<Result<Vec<_>, _>>()
            })
            .expect("query")
            .collect::<Result<Vec<_>, _>>()
            .expect("rows");
        out.extend(rows.into_iter().map(|r| (table.clone(), r)));
    }
    out
}

fn column_names(conn: &Connection, table: &str) -> Vec<String> {
    let mut stmt = conn.prepare(&format!("PRAGMA table_info(\"{table}\")")).expect("table_info");
    stmt.query_map([], |r| r.get(1)).expect("query").collect::<Result<_, _>>().expect("rows")
}

/// Equal lists, or a message naming only what differs.
fn assert_same<T: PartialEq + std::fmt::Debug>(migrated: &[T], fresh: &[T], what: &str) {
    let only_migrated: Vec<&T> = migrated.iter().filter(|x| !fresh.contains(x)).collect();
    let only_fresh: Vec<&T> = fresh.iter().filter(|x| !migrated.contains(x)).collect();
    assert!(
        only_migrated.is_empty() && only_fresh.is_empty() && migrated.len() == fresh.len(),
        "{what}\n  only in the migrated database: {only_migrated:#?}\n  only in a fresh one: {only_fresh:#?}"
    );
}

#[test]
fn migrations_are_numbered_in_order_up_to_the_schema_version() {
    let versions: Vec<i64> = payonce::store::MIGRATIONS.iter().map(|m| m.version).collect();
    let expected: Vec<i64> = (2..=payonce::store::SCHEMA_VERSION).collect();
    assert_eq!(versions, expected, "one migration per version after 1, in order");
    let versions: Vec<i64> = payonce::store::POSTGRES_MIGRATIONS.iter().map(|m| m.version).collect();
    let expected: Vec<i64> =
        (payonce::store::POSTGRES_SCHEMA_VERSION_FIRST + 1..=payonce::store::SCHEMA_VERSION).collect();
    assert_eq!(versions, expected, "PostgreSQL: one migration per version after its first, numbered as SQLite's");
}

/// Migration 10 rebuilds `platform_call` on SQLite: a v9 database's close,
/// refund and query rows come through with their ids and every column, and
/// none of them is a prepay (method, appid, params, answer NULL; 0).
#[test]
fn a_v9_database_keeps_its_platform_calls_through_migration_10() {
    let dir = TempDir::new("migrate-v9");
    let old = dir.path("v9.db");
    v1_database(&old);
    let rows_v9 = {
        let conn = Connection::open(&old).expect("open v1");
        for migration in payonce::store::MIGRATIONS.iter().filter(|m| m.version <= 9) {
            conn.execute_batch(&format!(
                "BEGIN IMMEDIATE; {} PRAGMA user_version = {}; COMMIT;",
                migration.sql, migration.version
            ))
            .unwrap_or_else(|e| panic!("migration {}: {e}", migration.version));
        }
        conn.execute_batch(
            "INSERT INTO platform_call (channel, kind, order_no, refund_no, status, attempts, next_attempt_at, request,
                                        http_status, response, created_at, updated_at)
             VALUES ('wechatpay', 'close', 'O-1', NULL, 'pending', 2, '2023-11-14T22:20:00.000Z', 'close O-1', 503,
                     'busy', '2023-11-14T22:13:20.000Z', '2023-11-14T22:14:00.000Z'),
                    ('alipay', 'refund', 'O-2', 'R-9', 'done', 1, NULL, 'refund R-9', 200, '{}',
                     '2023-11-14T22:13:20.000Z', '2023-11-14T22:13:21.000Z'),
                    ('wechatpay', 'query', 'O-3', NULL, 'failed', 1, NULL, 'query O-3', NULL, 'timed out',
                     '2023-11-14T22:13:20.000Z', '2023-11-14T22:13:30.000Z');",
        )
        .expect("v9 platform calls");
        all_rows(&conn, &|t| (t == "platform_call").then(|| column_names(&conn, "platform_call")))
    };
    assert_eq!(rows_v9.len(), 3, "{rows_v9:?}");
    let app = App::open(&old.display().to_string(), Clock::manual(T0), config()).expect("the new payonce opens v9");
    let conn = app.store().raw_connection().expect("conn");
    let v9_columns: Vec<String> = column_names(&conn, "platform_call").into_iter().take(13).collect();
    let after = all_rows(&conn, &|t| (t == "platform_call").then(|| v9_columns.clone()));
    assert_eq!(after, rows_v9, "every v9 row, column for column");
    let prepay_columns: i64 = conn
        .query_row(
            "SELECT count(*) FROM platform_call WHERE method IS NULL AND appid IS NULL AND params IS NULL
                AND answer IS NULL AND trade_may_exist = 0",
            [],
            |r| r.get(0),
        )
        .expect("count");
    assert_eq!(prepay_columns, 3);
}

#[test]
fn a_v1_database_migrates_keeping_every_row_and_ends_with_the_fresh_schema() {
    let dir = TempDir::new("migrate");
    let old = dir.path("v1.db");
    v1_database(&old);
    let (before, v1_columns) = {
        let conn = Connection::open(&old).expect("open v1");
        let v1_columns: std::collections::BTreeMap<String, Vec<String>> = schema_objects(&conn)
            .into_iter()
            .filter(|o| o.0 == "table")
            .map(|o| (o.1.clone(), column_names(&conn, &o.1)))
            .collect();
        let before = all_rows(&conn, &|t| v1_columns.get(t).cloned());
        (before, v1_columns)
    };
    for table in v1_columns.keys() {
        assert!(before.iter().any(|r| &r.0 == table), "the v1 database has rows in {table}");
    }

    let app = App::open(&old.display().to_string(), Clock::manual(T0), config()).expect("the new payonce opens v1");
    let conn = app.store().raw_connection().expect("conn");
    assert_eq!(
        conn.query_row("PRAGMA user_version", [], |r| r.get::<_, i64>(0)).expect("v"),
        payonce::store::SCHEMA_VERSION
    );
    // App::open records its reward settings; everything else is v1's, row for row.
    let after = all_rows(&conn, &|t| v1_columns.get(t).cloned());
    let not_settings = |rows: &[(String, Vec<String>)]| -> Vec<(String, Vec<String>)> {
        rows.iter().filter(|r| r.0 != "settings").cloned().collect()
    };
    assert_eq!(not_settings(&after), not_settings(&before), "every row survives the migration");
    let mode: String =
        conn.query_row("SELECT value FROM settings WHERE name = 'mode'", [], |r| r.get(0)).expect("mode");
    assert_eq!(mode, "record_only", "the mode survives");
    let platform_times: i64 = conn
        .query_row("SELECT count(*) FROM refund WHERE platform_settled_at IS NOT NULL", [], |r| r.get(0))
        .expect("count");
    assert_eq!(platform_times, 0, "refunds settled before v2 have no platform time");
    // Migration 11: every refund before it refunded its whole order.
    let count = |sql: &str| conn.query_row(sql, [], |r| r.get::<_, i64>(0)).expect(sql);
    assert!(count("SELECT count(*) FROM orders WHERE status = 'REFUNDED'") > 0, "the v1 rows hold a refunded order");
    assert_eq!(
        count(
            "SELECT count(*) FROM orders WHERE refunded_amount <> CASE status WHEN 'REFUNDED' THEN amount ELSE 0 END"
        ),
        0
    );
    assert_eq!(count("SELECT count(*) FROM refund r JOIN orders o ON o.id = r.order_id WHERE r.amount <> o.amount"), 0);
    // Migration 3 copies each unexpected refund's refund_no into its own column.
    let refund_nos: Vec<(String, Option<String>)> = conn
        .prepare("SELECT action, refund_no FROM audit_log ORDER BY id")
        .expect("audit_log")
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    assert!(refund_nos.contains(&("unexpected_refund".into(), Some("R-NONE".into()))), "{refund_nos:?}");
    for (action, refund_no) in &refund_nos {
        let carries = action == "unexpected_refund" || action == "unexpected_refund_resolved";
        assert_eq!(refund_no.is_some(), carries, "{action}: refund_no {refund_no:?}");
    }
    let check: String = conn.query_row("PRAGMA integrity_check", [], |r| r.get(0)).expect("integrity_check");
    assert_eq!(check, "ok");
    let broken: Vec<String> = conn
        .prepare("PRAGMA foreign_key_check")
        .expect("foreign_key_check")
        .query_map([], |r| r.get(0))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    assert!(broken.is_empty(), "foreign keys hold: {broken:?}");

    // The schema is a fresh database's, text for text and column for column.
    let fresh_path = dir.path("fresh.db");
    let fresh = App::open(&fresh_path.display().to_string(), Clock::manual(T0), config()).expect("fresh");
    let fresh_conn = fresh.store().raw_connection().expect("conn");
    assert_same(&schema_objects(&conn), &schema_objects(&fresh_conn), "sqlite_master equals a fresh database's");
    assert_same(&schema_pragmas(&conn), &schema_pragmas(&fresh_conn), "columns and indexes equal a fresh database's");
    assert_eq!(
        fresh_conn.query_row("PRAGMA user_version", [], |r| r.get::<_, i64>(0)).expect("v"),
        payonce::store::SCHEMA_VERSION
    );

    // The migrated database works: the refund in flight settles with the
    // platform's time, and the new rules hold on the old rows.
    let refund = RefundCallback {
        channel: "wechatpay".into(),
        refund_no: "R-REQ".into(),
        order_no: "O-REFUNDING".into(),
        status: PlatformStatus::Success,
        settled_at: Some("2024-01-01T00:59:00.000Z".into()),
        amount: None,
        refunded_total: None,
    };
    assert_eq!(app.refunds().deliver_refund(&refund).expect("deliver refund").as_str(), "applied");
    let stored: Option<String> = conn
        .query_row("SELECT platform_settled_at FROM refund WHERE refund_no = 'R-REQ'", [], |r| r.get(0))
        .expect("R-REQ");
    assert_eq!(stored.as_deref(), Some("2024-01-01T00:59:00.000Z"));
    assert_refused(
        &conn,
        "UPDATE refund SET platform_settled_at = '2024-01-01T00:00:00.000Z' WHERE refund_no = 'R-REQ'",
    );
    assert_refused(
        &conn,
        "UPDATE refund SET platform_settled_at = '2024-01-01T00:00:00.000Z' WHERE refund_no = 'R-OK'",
    );
    assert_refused(&conn, "UPDATE refund SET settled_at = '2024-01-01T00:00:00.000Z' WHERE refund_no = 'R-FAIL'");
    assert_refused(&conn, "DELETE FROM refund WHERE refund_no = 'R-OK'");
    assert_refused(
        &conn,
        "INSERT INTO refund (refund_no, order_id, status, requested_at, amount) VALUES ('R-OK', 1, 'REQUESTED', 't', 1)",
    );
    // Migration 8 rewrote the value lists in place: the pool that migrated
    // the file and a connection opened afterwards enforce them alike.
    assert_value_lists_enforced(&conn);
    drop((conn, app));

    // Opening it again changes nothing.
    let objects = schema_objects(&fresh_conn);
    let again = App::open(&old.display().to_string(), Clock::manual(T0), config()).expect("reopen");
    let conn = again.store().raw_connection().expect("conn");
    assert_eq!(schema_objects(&conn), objects);
    assert_value_lists_enforced(&conn);
    assert_eq!(conn.query_row("SELECT count(*) FROM refund", [], |r| r.get::<_, i64>(0)).expect("count"), 3);
    // Migration 9: every row recorded before it states no currency (the
    // order's own), and the payment v1 left waiting is decided as before
    // (last: the checks above need its order PENDING).
    let stated: i64 = conn
        .query_row("SELECT count(*) FROM pay_callback_log WHERE currency IS NOT NULL", [], |r| r.get(0))
        .expect("count");
    assert_eq!(stated, 0, "rows from before v9 keep currency NULL");
    assert_eq!(again.operations().drain().expect("drain"), 1, "P-REC, recorded by v1 in record-only mode");
    let decided: (String, String) = conn
        .query_row(
            "SELECT p.outcome, o.status FROM pay_callback_log p JOIN orders o ON o.id = p.order_id
             WHERE p.pay_no = 'P-REC'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .expect("P-REC");
    assert_eq!(decided, ("applied".to_owned(), "PAID".to_owned()), "1000 for a CNY order of 1000, no currency named");
}

/// The CHECKs that list three or more values (OR chains since migration 8)
/// refuse a value outside the list and let each listed one through.
fn assert_value_lists_enforced(conn: &Connection) {
    let id: i64 = conn
        .query_row("SELECT id FROM orders WHERE status = 'PENDING' LIMIT 1", [], |r| r.get(0))
        .expect("a PENDING order");
    assert_refused(conn, &format!("UPDATE orders SET status = 'LOST' WHERE id = {id}"));
    let insert_callback = |channel: &str, source: &str| {
        format!(
            "INSERT INTO pay_callback_log (pay_no, channel, order_id, amount, status, outcome, state, source, raw_body,
                                           received_at)
             VALUES ('P-LIST-{channel}-{source}', '{channel}', {id}, 1, 'SUCCESS', 'recorded', 'received', '{source}',
                     x'00', 't')"
        )
    };
    assert_refused(conn, &insert_callback("paypal", "callback"));
    assert_refused(conn, &insert_callback("alipay", "guess"));
    conn.execute_batch("SAVEPOINT lists").expect("savepoint");
    for channel in ["generic", "wechatpay", "alipay"] {
        for source in ["callback", "reconciliation", "query"] {
            conn.execute_batch(&insert_callback(channel, source)).expect("a listed channel and source");
        }
    }
    conn.execute_batch("ROLLBACK TO lists; RELEASE lists").expect("roll back");
    assert_refused(
        conn,
        &format!("INSERT INTO user_coupon (user_id, order_id, coupon_template_id, status, created_at) VALUES ('u', {id}, 'T', 'LOST', 't')"),
    );
    assert_refused(
        conn,
        "INSERT INTO outbox_event (event_id, type, order_no, data, created_at) VALUES ('e-list', 'order.lost', 'O', '{}', 't')",
    );
}

#[test]
fn a_database_newer_than_this_payonce_is_refused_untouched() {
    let dir = TempDir::new("newer");
    let path = dir.path("newer.db");
    v1_database(&path);
    let conn = Connection::open(&path).expect("open");
    let newer = payonce::store::SCHEMA_VERSION + 1;
    conn.execute_batch(&format!("PRAGMA user_version = {newer}")).expect("set version");
    let objects = schema_objects(&conn);
    drop(conn);
    let err = App::open(&path.display().to_string(), Clock::manual(T0), config()).err().expect("refused");
    assert!(err.message.contains("newer"), "{err:?}");
    let conn = Connection::open(&path).expect("open");
    assert_eq!(schema_objects(&conn), objects, "nothing migrated");
    assert_eq!(conn.query_row("PRAGMA user_version", [], |r| r.get::<_, i64>(0)).expect("v"), newer);
}

// ---- the contract on each engine (the conformance suite) ----

/// Runs `sql` with raw SQL of its own and expects the database to refuse it;
/// `because` is a part of the message the engine must give (a trigger's
/// text, or on PostgreSQL the unique index's `uk_` name).
fn refused_by(db: &crate::engines::Db, store: &payonce::store::Store, sql: &str, because: &str) {
    match store.execute_raw(sql) {
        Ok(n) => panic!("{}: the database accepted ({n} rows): {sql}", db.label()),
        Err(message) => {
            assert!(message.contains(because), "{}: {sql}: refused with {message:?}, not {because:?}", db.label())
        }
    }
}

/// The SQLite message of a UNIQUE violation names columns, PostgreSQL's the index.
fn unique_message(db: &crate::engines::Db, index: &'static str) -> &'static str {
    match db.engine {
        crate::engines::Engine::Sqlite => "UNIQUE constraint failed",
        crate::engines::Engine::Postgres => index,
    }
}

fn seeded(db: &crate::engines::Db) -> (App, payonce::store::Store) {
    let app = App::open(&db.spec, Clock::manual(T0), config()).unwrap_or_else(|e| panic!("{}: open: {e}", db.label()));
    seed(&app);
    (app, db.store())
}

for_each_engine! {
    /// Every ledger refuses DELETE (and, on PostgreSQL, TRUNCATE) and keeps its rows.
    fn ledgers_refuse_delete_and_truncate(db) {
        let (_app, store) = seeded(db);
        for table in ["orders", "pay_callback_log", "refund", "user_coupon", "point_log", "outbox_event", "audit_log"] {
            let before = db.count(&store, &format!("SELECT count(*) FROM {table}"));
            assert!(before > 0, "{}: {table} has rows from the App's operations", db.label());
            refused_by(db, &store, &format!("DELETE FROM {table}"), "");
            refused_by(db, &store, &format!("DELETE FROM {table} WHERE id = (SELECT min(id) FROM {table})").replace(
                "WHERE id = (SELECT min(id) FROM outbox_event)", "WHERE seq = (SELECT min(seq) FROM outbox_event)"), "");
            if db.engine == crate::engines::Engine::Postgres {
                refused_by(db, &store, &format!("TRUNCATE {table} CASCADE"), "");
            }
            assert_eq!(db.count(&store, &format!("SELECT count(*) FROM {table}")), before, "{}: {table} keeps its rows", db.label());
        }
        // platform_call (docs/platforms.md) keeps every call too; one close and one refund submission per key.
        let call = |kind: &str, refund_no: &str| format!(
            "INSERT INTO platform_call (channel, kind, order_no, refund_no, status, attempts, created_at, updated_at)
             VALUES ('wechatpay', '{kind}', 'O-1', {refund_no}, 'done', 1, '2026-01-01T00:00:00.000Z', '2026-01-01T00:00:00.000Z')");
        for (kind, refund_no) in [("query", "NULL"), ("query", "NULL"), ("close", "NULL"), ("refund", "'R-1'"), ("refund", "'R-2'")] {
            store.execute_raw(&call(kind, refund_no)).unwrap_or_else(|e| panic!("{}: {kind}: {e}", db.label()));
        }
        refused_by(db, &store, &call("close", "NULL"), "");
        refused_by(db, &store, &call("refund", "'R-1'"), "");
        refused_by(db, &store, &call("refund", "NULL"), "");
        refused_by(db, &store, "DELETE FROM platform_call", "");
        if db.engine == crate::engines::Engine::Postgres {
            refused_by(db, &store, "TRUNCATE platform_call", "");
        }
        assert_eq!(db.count(&store, "SELECT count(*) FROM platform_call"), 5, "{}", db.label());
        // Not a ledger: expired idempotency results may be removed.
        store.execute_raw("DELETE FROM idempotency_key WHERE expires_at < '2000'").expect("idempotency_key is not a ledger");
    }

    /// Refunds by amount, kept by the database itself (migration 11): an
    /// order's refunded_amount is the sum of its succeeded order refunds (a
    /// payment's refund is outside it and outside the one-in-flight rule),
    /// never past its amount and never smaller; a refund's amount stays; an
    /// order's points never go below zero, one reversal per refund.
    fn refunds_by_amount_are_kept_by_the_database(db) {
        let (app, store) = seeded(db);
        // A second payment of O-2, refund-required: its refund is its own.
        assert_eq!(
            Pay { pay_no: "P-2X", order_no: "O-2", amount: 5000, status: "SUCCESS" }.deliver(&app).outcome_str(),
            "already_paid"
        );
        let check = match db.engine {
            crate::engines::Engine::Sqlite => "CHECK constraint failed",
            crate::engines::Engine::Postgres => "check constraint",
        };
        let refunded = |order_no: &str| {
            db.count(&store, &format!("SELECT refunded_amount FROM orders WHERE order_no = '{order_no}'"))
        };
        assert_eq!((refunded("O-1"), refunded("O-2")), (9999, 0), "the seed's full refund, and none");
        let o2 = "(SELECT id FROM orders WHERE order_no = 'O-2')";
        let request = |refund_no: &str, amount: i64, pay_no: &str| {
            format!(
                "INSERT INTO refund (refund_no, order_id, status, requested_at, amount, pay_no)
                 VALUES ('{refund_no}', {o2}, 'REQUESTED', 't', {amount}, {pay_no})"
            )
        };
        let settle =
            |refund_no: &str| format!("UPDATE refund SET status = 'SUCCEEDED', settled_at = 't' WHERE refund_no = '{refund_no}'");
        let run = |sql: &str| store.execute_raw(sql).unwrap_or_else(|e| panic!("{}: {sql}: {e}", db.label()));
        run(&request("RP-1", 3000, "NULL"));
        refused_by(db, &store, &request("RP-X", 1, "NULL"), unique_message(db, "uk_refund_requested"));
        run(&request("RP-PAY", 5000, "'P-2X'"));
        run(&settle("RP-1"));
        run(&settle("RP-PAY"));
        assert_eq!(refunded("O-2"), 3000, "a payment's refund is not the order's");
        run(&request("RP-2", 1500, "NULL"));
        run(&settle("RP-2"));
        assert_eq!(refunded("O-2"), 4500);
        run(&request("RP-3", 600, "NULL"));
        refused_by(db, &store, &settle("RP-3"), check);
        assert_eq!(refunded("O-2"), 4500, "refused whole");
        refused_by(db, &store, "UPDATE orders SET refunded_amount = 0 WHERE order_no = 'O-2'", "refunded_amount only grows");
        refused_by(db, &store, "UPDATE refund SET amount = 1 WHERE refund_no = 'RP-1'", "its times and amount stay");
        refused_by(db, &store, &request("RP-0", 0, "NULL"), check);

        let points = db.count(
            &store,
            &format!("SELECT points FROM point_log WHERE point_type = 'ORDER_PAID' AND order_id = {o2}"),
        );
        assert!(points > 1, "{}: the seed's order earned points: {points}", db.label());
        let reverse = |refund_no: &str, points: i64| {
            let refund_no = if refund_no.is_empty() { "NULL".to_owned() } else { format!("'{refund_no}'") };
            format!(
                "INSERT INTO point_log (user_id, order_id, point_type, points, created_at, refund_no)
                 VALUES ('u1', {o2}, 'ORDER_PAID_REVERSAL', {points}, 't', {refund_no})"
            )
        };
        run(&reverse("RP-1", -(points - 1)));
        refused_by(db, &store, &reverse("RP-1", -1), unique_message(db, "uk_order_type"));
        refused_by(db, &store, &reverse("RP-2", -2), "points never go below zero");
        run(&reverse("RP-2", -1));
        refused_by(db, &store, &reverse("", -1), "points never go below zero");
        refused_by(
            db,
            &store,
            &format!(
                "INSERT INTO point_log (user_id, order_id, point_type, points, created_at, refund_no)
                 VALUES ('u1', {o2}, 'ORDER_PAID', 5, 't', 'RP-1')"
            ),
            check,
        );
    }

    /// A payment's own refund (migration 12) returns an unresolved
    /// refund-required payment of its order, whole; one in flight and one
    /// succeeded per payment; `refunded` is a resolution only its success gives.
    fn payment_refunds_are_kept_by_the_database(db) {
        let (_app, store) = seeded(db);
        let run = |sql: &str| store.execute_raw(sql).unwrap_or_else(|e| panic!("{}: {sql}: {e}", db.label()));
        let request = |refund_no: &str, order_no: &str, amount: i64, pay_no: &str| {
            format!(
                "INSERT INTO refund (refund_no, order_id, status, requested_at, amount, reason, pay_no)
                 VALUES ('{refund_no}', (SELECT id FROM orders WHERE order_no = '{order_no}'), 'REQUESTED', 't',
                         {amount}, 'r', '{pay_no}')"
            )
        };
        let settle = |refund_no: &str, to: &str| {
            format!("UPDATE refund SET status = '{to}', settled_at = 't' WHERE refund_no = '{refund_no}'")
        };
        let resolve = |how: &str| {
            format!(
                "UPDATE pay_callback_log SET resolution = '{how}', resolution_reason = 'r', resolved_at = 't'
                 WHERE pay_no = 'P-3'"
            )
        };
        let whole = "returns an unresolved refund-required payment of its order, whole";
        // P-3: paid_after_close on O-3, 100.
        refused_by(db, &store, &request("U-P-3", "O-3", 99, "P-3"), whole);
        refused_by(db, &store, &request("U-P-3", "O-2", 100, "P-3"), whole);
        refused_by(db, &store, &request("U-P-2", "O-2", 5000, "P-2"), whole);
        refused_by(db, &store, &resolve("refunded"), "only by its own succeeded refund");
        run(&request("U-P-3", "O-3", 100, "P-3"));
        refused_by(db, &store, &request("U-P-3-2", "O-3", 100, "P-3"), unique_message(db, "uk_refund_payment_in_flight"));
        run(&settle("U-P-3", "FAILED"));
        refused_by(db, &store, &resolve("refunded"), "only by its own succeeded refund");
        run(&request("U-P-3-2", "O-3", 100, "P-3"));
        run(&settle("U-P-3-2", "SUCCEEDED"));
        run(&request("U-P-3-3", "O-3", 100, "P-3"));
        refused_by(db, &store, &settle("U-P-3-3", "SUCCEEDED"), unique_message(db, "uk_refund_payment_succeeded"));
        run(&settle("U-P-3-3", "FAILED"));
        run(&resolve("refunded"));
        refused_by(db, &store, &request("U-P-3-4", "O-3", 100, "P-3"), whole);
        let refunded = db.count(&store, "SELECT refunded_amount FROM orders WHERE order_no = 'O-3'");
        assert_eq!(refunded, 0, "{}: a payment's refund is not its order's", db.label());
    }

    /// Each side effect's own UNIQUE key refuses a second row.
    fn unique_keys_refuse_a_second_row(db) {
        let (_app, store) = seeded(db);
        let prepay = "INSERT INTO platform_call (channel, kind, order_no, status, attempts, next_attempt_at, created_at,
                                                 updated_at, method, params)
                      VALUES ('wechatpay', 'prepay', 'O-1', 'pending', 1, 't', 't', 't', 'native', '{}')";
        let cases: [(&str, &'static str); 9] = [
            (prepay, "uk_platform_call_prepay"),
            ("INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at)
              SELECT order_no, user_id, amount, currency, 'PENDING', created_at, expires_at FROM orders WHERE order_no = 'O-1'",
             "uk_order_no"),
            ("INSERT INTO pay_callback_log (pay_no, channel, order_id, amount, status, outcome, state, source, raw_body, received_at)
              SELECT pay_no, channel, order_id, amount, status, 'recorded', 'received', source, raw_body, received_at
              FROM pay_callback_log WHERE pay_no = 'P-1'",
             "uk_pay_no"),
            ("INSERT INTO pay_callback_log (pay_no, channel, order_id, amount, status, outcome, state, source, raw_body,
                                            paid_at, received_at, decided_at, applied_at, rewards_due)
              SELECT 'P-1-TWICE', channel, order_id, amount, status, outcome, state, source, raw_body,
                     paid_at, received_at, decided_at, applied_at, rewards_due
              FROM pay_callback_log WHERE pay_no = 'P-1'",
             "uk_applied_order"),
            ("INSERT INTO refund (refund_no, order_id, status, requested_at, amount)
              SELECT refund_no, (SELECT id FROM orders WHERE order_no = 'O-2'), 'REQUESTED', requested_at, amount
              FROM refund WHERE refund_no = 'R-1'",
             "uk_refund_no"),
            ("INSERT INTO user_coupon (user_id, order_id, coupon_template_id, status, created_at)
              SELECT user_id, order_id, coupon_template_id, 'ACTIVE', created_at FROM user_coupon WHERE coupon_template_id = 'NEW10'
              AND order_id = (SELECT id FROM orders WHERE order_no = 'O-2')",
             "uk_order_tpl"),
            ("INSERT INTO point_log (user_id, order_id, point_type, points, created_at)
              SELECT user_id, order_id, point_type, points, created_at FROM point_log
              WHERE point_type = 'ORDER_PAID' AND order_id = (SELECT id FROM orders WHERE order_no = 'O-2')",
             "uk_order_type"),
            ("INSERT INTO outbox_event (event_id, type, order_no, data, created_at)
              SELECT event_id, type, order_no, data, created_at FROM outbox_event WHERE event_id = 'order.paid:O-1'",
             "uk_event_id"),
            ("INSERT INTO idempotency_key (scope, key, fingerprint, status_code, response_body, created_at, expires_at)
              SELECT scope, key, fingerprint, status_code, response_body, created_at, expires_at FROM idempotency_key",
             "uk_scope_key"),
        ];
        store
            .execute_raw(&format!(
                "INSERT INTO idempotency_key (scope, key, fingerprint, status_code, response_body, created_at, expires_at)
                 VALUES ('POST /v1/orders', 'k-1', '{}', 201, 'x', '2023-11-14T22:13:20.000Z', '2099-01-01T00:00:00.000Z')",
                "0".repeat(64)
            ))
            .expect("a first stored response");
        store.execute_raw(prepay).expect("a first prepay row");
        for (sql, index) in cases {
            refused_by(db, &store, sql, unique_message(db, index));
        }
    }

    /// The triggers and CHECKs refuse what the code must never do, with the
    /// same words on both engines.
    fn triggers_and_checks_refuse_illegal_rows(db) {
        let (_app, store) = seeded(db);
        let check = match db.engine {
            crate::engines::Engine::Sqlite => "CHECK constraint failed",
            crate::engines::Engine::Postgres => "check constraint",
        };
        let cases: Vec<(&str, &str)> = vec![
            ("UPDATE orders SET status = 'PENDING' WHERE order_no = 'O-2'", "illegal order transition"),
            ("UPDATE orders SET status = 'CLOSED', closed_at = '2023-11-14T22:13:20.000Z' WHERE order_no = 'O-2'", "illegal order transition"),
            ("INSERT INTO orders (order_no, user_id, amount, currency, status, pay_no, created_at, expires_at, paid_at)
              VALUES ('O-BORN-PAID', 'u1', 100, 'CNY', 'PAID', 'P-X', '2023-11-14T22:13:20.000Z', '2023-11-14T22:28:20.000Z',
                      '2023-11-14T22:13:20.000Z')", "an order is created PENDING"),
            ("UPDATE orders SET amount = amount + 1 WHERE order_no = 'O-2'", "never change"),
            ("UPDATE orders SET paid_at = '2000-01-01T00:00:00.000Z' WHERE order_no = 'O-2'", "never change once set"),
            ("UPDATE pay_callback_log SET outcome = 'paid_after_close' WHERE pay_no = 'P-2'", "a decided payment outcome is final"),
            ("UPDATE pay_callback_log SET channel = 'alipay' WHERE pay_no = 'P-2'", "keeps its pay_no, channel"),
            ("UPDATE refund SET status = 'FAILED' WHERE refund_no = 'R-1'", "a refund only settles once"),
            ("UPDATE user_coupon SET status = 'ACTIVE' WHERE status = 'FROZEN'", "a coupon only moves"),
            ("UPDATE point_log SET points = points + 1", "point_log is append-only"),
            ("UPDATE outbox_event SET order_no = order_no", "outbox_event is append-only"),
            ("UPDATE audit_log SET actor = actor", "audit_log is append-only"),
            ("INSERT INTO user_coupon (user_id, order_id, coupon_template_id, status, created_at)
              SELECT 'u1', id, 'FRESH', 'FROZEN', created_at FROM orders WHERE order_no = 'O-2'", "a coupon is issued ACTIVE"),
            ("INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at)
              VALUES ('O-ZERO', 'u1', 0, 'CNY', 'PENDING', '2023-11-14T22:13:20.000Z', '2023-11-14T22:28:20.000Z')", check),
            ("INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at)
              VALUES ('O SPACE', 'u1', 10, 'CNY', 'PENDING', '2023-11-14T22:13:20.000Z', '2023-11-14T22:28:20.000Z')", check),
            ("INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at)
              VALUES ('O-LOWER', 'u1', 10, 'cny', 'PENDING', '2023-11-14T22:13:20.000Z', '2023-11-14T22:28:20.000Z')", check),
            ("INSERT INTO point_log (user_id, order_id, point_type, points, created_at)
              SELECT 'u1', id, 'ORDER_PAID_REVERSAL', 5, created_at FROM orders WHERE order_no = 'O-2'", check),
            ("UPDATE settings SET value = 'sometimes' WHERE name = 'mode'", check),
            ("UPDATE pay_callback_log SET currency = 'cny' WHERE pay_no = 'P-1'", check),
            ("UPDATE pay_callback_log SET currency = 'US' WHERE pay_no = 'P-1'", check),
            ("UPDATE pay_callback_log SET currency = 'USDT' WHERE pay_no = 'P-1'", check),
            ("INSERT INTO pay_callback_log (pay_no, channel, order_id, amount, status, outcome, state, source, raw_body, received_at)
              SELECT 'P-NO-ORDER', 'generic', 999999, 100, 'SUCCESS', 'recorded', 'received', 'callback', raw_body, received_at
              FROM pay_callback_log WHERE pay_no = 'P-1'", match db.engine {
                crate::engines::Engine::Sqlite => "FOREIGN KEY constraint failed",
                crate::engines::Engine::Postgres => "foreign key constraint",
            }),
        ];
        for (sql, because) in cases {
            refused_by(db, &store, sql, because);
        }
        // What the refusals left: the seed's rows, unchanged.
        assert_eq!(db.count(&store, "SELECT count(*) FROM orders"), 3, "{}", db.label());
        assert_eq!(db.count(&store, "SELECT count(*) FROM orders WHERE status = 'PAID'"), 1, "{}", db.label());
    }

    /// The schema is applied once: a second store on the same database (a
    /// second process starting) finds it current and changes nothing.
    fn the_schema_is_applied_once_and_versioned(db) {
        let (_app, store) = seeded(db);
        let orders = db.count(&store, "SELECT count(*) FROM orders");
        let again = db.store();
        assert_eq!(db.count(&again, "SELECT count(*) FROM orders"), orders, "{}", db.label());
        let version = match db.engine {
            crate::engines::Engine::Sqlite => db.count(&store, "PRAGMA user_version"),
            crate::engines::Engine::Postgres => db.count(&store, "SELECT max(version) FROM payonce_schema_version"),
        };
        assert_eq!(version, payonce::store::SCHEMA_VERSION, "{}", db.label());
        again.check_health().unwrap_or_else(|e| panic!("{}: healthz: {e}", db.label()));
    }
}

/// The catalog of a PostgreSQL database, as comparable text: indexes,
/// columns, constraints, triggers and functions of the public schema.
fn postgres_catalog(client: &mut postgres::Client) -> Vec<(String, Vec<String>)> {
    let queries = [
        ("indexes", "SELECT indexname || ' ' || indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY 1"),
        (
            "columns",
            "SELECT table_name || '.' || column_name || ' ' || data_type || ' ' || is_nullable || ' ' ||
                    coalesce(column_default, '') || ' ' || is_identity
             FROM information_schema.columns WHERE table_schema = 'public' ORDER BY table_name, ordinal_position",
        ),
        (
            "constraints",
            "SELECT conrelid::regclass::text || ' ' || conname || ' ' || pg_get_constraintdef(oid)
             FROM pg_constraint WHERE connamespace = 'public'::regnamespace ORDER BY 1",
        ),
        ("triggers", "SELECT pg_get_triggerdef(oid) FROM pg_trigger WHERE NOT tgisinternal ORDER BY 1"),
        (
            "functions",
            "SELECT pg_get_functiondef(oid) FROM pg_proc WHERE pronamespace = 'public'::regnamespace ORDER BY 1",
        ),
    ];
    queries
        .iter()
        .map(|(what, sql)| {
            let rows = client.query(*sql, &[]).unwrap_or_else(|e| panic!("{what}: {e}"));
            (what.to_string(), rows.iter().map(|r| r.get::<_, String>(0)).collect())
        })
        .collect()
}

/// A PostgreSQL database made by the first PostgreSQL schema (version 3),
/// with rows, opened by this payonce: it migrates in place, every row
/// survives, and its catalog equals a fresh database's.
#[test]
fn a_postgres_v3_database_migrates_in_place_to_the_fresh_schema() {
    let Some(old) = crate::pg::fresh_database("pg_v3") else { return };
    let Some(fresh) = crate::pg::fresh_database("pg_fresh") else { return };
    let mut client = postgres::Client::connect(&old, postgres::NoTls).expect("connect");
    {
        let mut tx = client.transaction().expect("begin");
        tx.batch_execute(include_str!("../fixtures/schema_postgres_v3.sql")).expect("the v3 schema");
        tx.batch_execute(
            "CREATE TABLE payonce_schema_version (version BIGINT NOT NULL PRIMARY KEY);
             INSERT INTO payonce_schema_version (version) VALUES (3);
             INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at)
             VALUES ('V3-1', 'u1', 100, 'CNY', 'PENDING', '2026-01-01T00:00:00.000Z', '2026-01-01T00:15:00.000Z');
             UPDATE orders SET status = 'PAID', pay_no = 'V3P-1', paid_at = '2026-01-01T00:01:00.000Z' WHERE order_no = 'V3-1';
             INSERT INTO pay_callback_log (pay_no, channel, order_id, amount, status, outcome, state, source, raw_body,
                                           received_at, decided_at, applied_at, rewards_due)
             SELECT 'V3P-1', 'generic', id, 100, 'SUCCESS', 'applied', 'decided', 'callback', '\\x7b7d',
                    '2026-01-01T00:01:00.000Z', '2026-01-01T00:01:00.000Z', '2026-01-01T00:01:00.000Z',
                    '{\"coupons\":[],\"points\":0}'
             FROM orders WHERE order_no = 'V3-1';
             INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at)
             VALUES ('V3-2', 'u1', 200, 'USD', 'PENDING', '2026-01-01T00:00:00.000Z', '2026-01-01T00:15:00.000Z');
             INSERT INTO pay_callback_log (pay_no, channel, order_id, amount, status, outcome, state, source, raw_body,
                                           received_at)
             SELECT 'V3P-2', 'generic', id, 200, 'SUCCESS', 'recorded', 'received', 'callback', '\\x7b7d',
                    '2026-01-01T00:01:00.000Z'
             FROM orders WHERE order_no = 'V3-2';
             INSERT INTO audit_log (at, actor, action, order_no, refund_no, detail)
             VALUES ('2026-01-01T00:02:00.000Z', 'payonce', 'unexpected_refund', 'V3-1', 'R-X', '{\"refund_no\":\"R-X\"}');",
        )
        .expect("v3 rows");
        tx.commit().expect("commit");
    }
    // Each row as JSON; pay_callback_log's without the column migration 9
    // adds, orders' without migration 11's (both checked on their own below).
    let rows = |client: &mut postgres::Client| -> Vec<String> {
        ["orders", "pay_callback_log", "audit_log", "settings"]
            .iter()
            .flat_map(|t| {
                let row = match *t {
                    "pay_callback_log" => "to_jsonb(t) - 'currency'",
                    "orders" => "to_jsonb(t) - 'refunded_amount'",
                    _ => "to_jsonb(t)",
                };
                client
                    .query(&format!("SELECT ({row})::text FROM {t} t ORDER BY 1"), &[])
                    .expect("rows")
                    .iter()
                    .map(|r| r.get::<_, String>(0))
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let before = rows(&mut client);

    let migrated = App::open(&old, Clock::manual(T0), Config::default()).expect("this payonce opens a v3 database");
    let after = rows(&mut client);
    // App::open records its reward settings; every other row is v3's.
    let not_settings = |r: &[String]| -> Vec<String> { r.iter().filter(|l| !l.contains("reward_")).cloned().collect() };
    assert_eq!(not_settings(&after), not_settings(&before), "every row survives the migration");
    let version: i64 = client.query_one("SELECT max(version) FROM payonce_schema_version", &[]).expect("v").get(0);
    assert_eq!(version, payonce::store::SCHEMA_VERSION);
    migrated.store().check_health().expect("healthz on the migrated database");
    let stated: i64 =
        client.query_one("SELECT count(*) FROM pay_callback_log WHERE currency IS NOT NULL", &[]).expect("n").get(0);
    assert_eq!(stated, 0, "rows from before v9 keep currency NULL");
    // The payment v3 left waiting is decided as before: no currency named is the order's.
    assert_eq!(migrated.operations().drain().expect("drain"), 1);
    let outcome: String =
        client.query_one("SELECT outcome FROM pay_callback_log WHERE pay_no = 'V3P-2'", &[]).expect("V3P-2").get(0);
    assert_eq!(outcome, "applied");

    let _fresh_app = App::open(&fresh, Clock::manual(T0), Config::default()).expect("a fresh database");
    let mut fresh_client = postgres::Client::connect(&fresh, postgres::NoTls).expect("connect");
    let (migrated_catalog, fresh_catalog) = (postgres_catalog(&mut client), postgres_catalog(&mut fresh_client));
    for ((what, got), (_, want)) in migrated_catalog.iter().zip(&fresh_catalog) {
        assert_same(got, want, &format!("PostgreSQL {what} equal a fresh database's"));
    }
}
