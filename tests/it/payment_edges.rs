//! Edges of the payment path: a FAILED superseded by a SUCCESS (never
//! across orders; also while waiting in record-only mode), record-only
//! freezing expiry, and `applied_at` as a real column.

use crate::util::{Pay, Server};
use payonce::ops::Mode;
use payonce::{App, Clock, Config, CreateOrder, PaymentCallback, Rewards};
use serde_json::json;
use std::time::{Duration, Instant};

const T0_MS: i64 = 1_700_000_000_000;

fn app() -> App {
    let config =
        Config { rewards: Rewards { coupon_templates: vec!["NEW10".into()], points_per_yuan: 1 }, ..Config::default() };
    App::open(":memory:", Clock::manual(T0_MS), config).expect("open app")
}

fn order(app: &App, order_no: &str) {
    app.orders()
        .create_order(&CreateOrder {
            order_no: order_no.into(),
            user_id: format!("user-{order_no}"),
            amount: 500,
            currency: "CNY".into(),
            expires_in_s: Some(600),
        })
        .expect("create order");
}

/// Delivered in process with `PAY_NO/STATUS` as its raw bytes (an audit row keeps them).
fn pay(app: &App, pay: Pay) -> String {
    let cb = PaymentCallback { raw_body: format!("{}/{}", pay.pay_no, pay.status).into_bytes(), ..pay.callback() };
    let reply = app.payments().deliver_payment(&cb).expect("deliver");
    reply.to_json().to_string()
}

#[test]
fn a_failed_pay_no_is_never_superseded_for_another_order() {
    let app = app();
    order(&app, "A");
    order(&app, "B");
    assert_eq!(
        pay(&app, Pay { pay_no: "P1", order_no: "A", amount: 500, status: "FAILED" }),
        json!({"code":"SUCCESS","outcome":"payment_failed"}).to_string()
    );
    // The same pay_no, now SUCCESS but naming another order: a pay_no never moves.
    assert_eq!(
        pay(&app, Pay { pay_no: "P1", order_no: "B", amount: 500, status: "SUCCESS" }),
        json!({"code":"SUCCESS","outcome":"duplicate","original":"payment_failed"}).to_string()
    );
    assert_eq!(app.orders().order("B").expect("B").order.status.as_str(), "PENDING");
    assert!(app.orders().order("B").expect("B").coupons.is_empty());
    // A is still payable by another payment, and the inspection is clean.
    assert_eq!(
        pay(&app, Pay { pay_no: "P2", order_no: "A", amount: 500, status: "SUCCESS" }),
        json!({"code":"SUCCESS","outcome":"applied"}).to_string()
    );
    assert!(app.operations().inspect().expect("inspect").is_empty());
    // And the SUCCESS for its own order still supersedes the FAILED once.
    order(&app, "C");
    pay(&app, Pay { pay_no: "P3", order_no: "C", amount: 500, status: "FAILED" });
    assert_eq!(
        pay(&app, Pay { pay_no: "P3", order_no: "C", amount: 500, status: "SUCCESS" }),
        json!({"code":"SUCCESS","outcome":"applied"}).to_string()
    );
    assert_eq!(
        pay(&app, Pay { pay_no: "P3", order_no: "C", amount: 500, status: "SUCCESS" }),
        json!({"code":"SUCCESS","outcome":"duplicate","original":"applied"}).to_string()
    );
    // Nothing acknowledged is lost: the FAILED delivery's bytes are in the audit row.
    let conn = app.store().raw_connection().expect("conn");
    let kept: String = conn
        .query_row(
            "SELECT json_extract(detail, '$.superseded_raw_body_base64') FROM audit_log
             WHERE action = 'payment_failed_superseded' AND order_no = 'C'",
            [],
            |r| r.get(0),
        )
        .expect("audit row");
    use base64::Engine;
    assert_eq!(base64::engine::general_purpose::STANDARD.decode(kept).expect("base64"), b"P3/FAILED");
}

#[test]
fn in_record_only_mode_a_success_supersedes_a_waiting_failed() {
    let app = app();
    order(&app, "R");
    app.operations().set_mode(Mode::RecordOnly, "test", None).expect("record-only");
    assert_eq!(
        pay(&app, Pay { pay_no: "PR", order_no: "R", amount: 500, status: "FAILED" }),
        json!({"code":"SUCCESS","outcome":"recorded"}).to_string()
    );
    // Not a duplicate: the SUCCESS replaces the waiting FAILED (once).
    assert_eq!(
        pay(&app, Pay { pay_no: "PR", order_no: "R", amount: 500, status: "SUCCESS" }),
        json!({"code":"SUCCESS","outcome":"recorded"}).to_string()
    );
    assert_eq!(
        pay(&app, Pay { pay_no: "PR", order_no: "R", amount: 500, status: "FAILED" }),
        json!({"code":"SUCCESS","outcome":"duplicate","original":"recorded"}).to_string()
    );
    assert_eq!(app.operations().drain().expect("drain"), 1);
    let detail = app.orders().order("R").expect("R");
    assert_eq!(detail.order.status.as_str(), "PAID");
    assert_eq!((detail.payments.len(), detail.coupons.len(), detail.points.len()), (1, 1, 1));
}

#[test]
fn applied_at_is_a_listed_column_set_only_for_applied_payments() {
    let app = app();
    order(&app, "X");
    order(&app, "Y");
    pay(&app, Pay { pay_no: "PX", order_no: "X", amount: 500, status: "SUCCESS" });
    pay(&app, Pay { pay_no: "PY", order_no: "Y", amount: 500, status: "FAILED" });
    let conn = app.store().raw_connection().expect("conn");
    let listed: bool = conn
        .query_row("SELECT count(*) FROM pragma_table_info('pay_callback_log') WHERE name = 'applied_at'", [], |r| {
            r.get::<_, i64>(0).map(|n| n == 1)
        })
        .expect("table_info");
    assert!(listed, "PRAGMA table_info lists applied_at");
    let rows: Vec<(String, Option<String>, Option<String>)> = conn
        .prepare("SELECT pay_no, applied_at, decided_at FROM pay_callback_log ORDER BY pay_no")
        .expect("prepare")
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    assert_eq!(rows[0].0, "PX");
    assert!(rows[0].1.is_some() && rows[0].1 == rows[0].2, "applied: applied_at = decided_at: {rows:?}");
    assert_eq!((rows[1].0.as_str(), rows[1].1.as_deref()), ("PY", None));
    // The database refuses an applied_at on another outcome.
    let refused = conn.execute("UPDATE pay_callback_log SET applied_at = decided_at WHERE pay_no = 'PY'", []);
    assert!(refused.is_err());
}

#[test]
fn record_only_freezes_expiry_and_normal_decides_before_closing() {
    let server = Server::start(&["--sweep-interval-s", "1"]);
    let created = server
        .post_json("/v1/orders", &json!({"order_no": "ORD-FRZ", "user_id": "u", "amount": 100, "expires_in_s": 1}));
    assert_eq!(created.status, 201);
    let mode = crate::util::request(
        server.addr,
        "PUT",
        "/v1/admin/mode",
        &[("Content-Type", "application/json")],
        json!({"mode": "record_only"}).to_string().as_bytes(),
    );
    assert_eq!(mode.status, 200);
    // Paid in time, but recorded only.
    let paid = server.callback(
        "/v1/callbacks/generic",
        &json!({"pay_no": "PAY-FRZ", "order_no": "ORD-FRZ", "amount": 100, "status": "SUCCESS"}),
    );
    assert_eq!(paid.json()["outcome"], "recorded");
    // Past expires_at and past two sweeps: still PENDING while record-only.
    std::thread::sleep(Duration::from_millis(2_500));
    assert_eq!(server.get("/v1/orders/ORD-FRZ").json()["status"], "PENDING");
    let mode = crate::util::request(
        server.addr,
        "PUT",
        "/v1/admin/mode",
        &[("Content-Type", "application/json")],
        json!({"mode": "normal"}).to_string().as_bytes(),
    );
    assert_eq!(mode.status, 200);
    // The sweeper decides the waiting payment before it looks at expiry.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = server.get("/v1/orders/ORD-FRZ").json()["status"].as_str().unwrap_or_default().to_owned();
        if status != "PENDING" {
            assert_eq!(status, "PAID");
            break;
        }
        assert!(Instant::now() < deadline, "the waiting payment was never decided");
        std::thread::sleep(Duration::from_millis(100));
    }
}
