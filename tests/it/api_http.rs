//! The HTTP API of docs/openapi.yaml, black box: every endpoint and every
//! outcome, with its exact field names, status codes and headers, against
//! the real binary. Database effects are read through a read-only
//! connection to the server's file (schema.sql's names).

use crate::util::{self, count, footprint, read_only, HttpResponse, Pay, Server, SECRET};
use rusqlite::Connection;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The order object's keys (docs/openapi.yaml, `Order`).
const ORDER_KEYS: [&str; 14] = [
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
    "refunded_amount",
    "refunding_amount",
];

const REWARDS: [&str; 6] = ["--coupon", "NEW10", "--coupon", "VIP", "--points-per-yuan", "2"];

// ---- helpers ----

fn keys(value: &Value) -> BTreeSet<String> {
    value.as_object().unwrap_or_else(|| panic!("not an object: {value}")).keys().cloned().collect()
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// `YYYY-MM-DDTHH:MM:SS.sssZ`
fn is_time(value: &Value) -> bool {
    let Some(text) = value.as_str() else { return false };
    let b = text.as_bytes();
    b.len() == 24
        && b.iter().enumerate().all(|(i, c)| match i {
            4 | 7 => *c == b'-',
            10 => *c == b'T',
            13 | 16 => *c == b':',
            19 => *c == b'.',
            23 => *c == b'Z',
            _ => c.is_ascii_digit(),
        })
}

fn ms(value: &Value) -> i64 {
    payonce::clock::parse_rfc3339_ms(value.as_str().unwrap_or_default())
        .unwrap_or_else(|| panic!("not a timestamp: {value}"))
}

/// The order object: exactly the documented keys, times in the documented form.
fn assert_order(order: &Value) {
    let mut expected = set(&ORDER_KEYS);
    // The detail view adds its eight lists.
    for extra in ["payments", "coupons", "points", "events", "audit", "platform_calls", "refunds", "webhook_deliveries"]
    {
        if order.get(extra).is_some() {
            expected.insert(extra.to_owned());
        }
    }
    assert_eq!(keys(order), expected, "order keys of {order}");
    for key in ["created_at", "expires_at", "paid_at", "closed_at", "refunded_at"] {
        assert!(order[key].is_null() || is_time(&order[key]), "{key} of {order}");
    }
    assert!(is_time(&order["created_at"]) && is_time(&order["expires_at"]), "{order}");
}

fn expect_error(resp: &HttpResponse, status: u16, code: &str, context: &str) {
    assert_eq!(resp.status, status, "{context}: {}", resp.text());
    let body = resp.json();
    assert_eq!(body["error"]["code"], code, "{context}: {body}");
    assert!(body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{context}: {body}");
}

fn create(server: &Server, order_no: &str, user_id: &str, amount: i64) -> Value {
    let resp = server.post_json("/v1/orders", &json!({"order_no": order_no, "user_id": user_id, "amount": amount}));
    assert_eq!(resp.status, 201, "create {order_no}: {}", resp.text());
    resp.json()
}

fn order(server: &Server, order_no: &str) -> Value {
    let resp = server.get(&format!("/v1/orders/{order_no}"));
    assert_eq!(resp.status, 200, "get {order_no}: {}", resp.text());
    resp.json()
}

fn status_of(server: &Server, order_no: &str) -> String {
    order(server, order_no)["status"].as_str().unwrap_or_default().to_owned()
}

/// A payment callback answered 200 with `outcome` (and `original` for duplicates).
fn check_pay(server: &Server, pay: Pay, outcome: &str, original: Option<&str>) {
    let resp = pay.send(server);
    let Pay { pay_no, order_no, amount, status } = pay;
    let context = format!("{pay_no} {status} {amount} for {order_no}");
    assert_eq!(resp.status, 200, "{context}: {}", resp.text());
    let body = resp.json();
    assert_eq!(body["code"], "SUCCESS", "{context}: {body}");
    assert_eq!(body["outcome"], outcome, "{context}: {body}");
    match original {
        Some(original) => assert_eq!(body["original"], original, "{context}: {body}"),
        None => assert!(body.get("original").is_none(), "{context}: {body}"),
    }
}

fn refund_cb(server: &Server, refund_no: &str, order_no: &str, status: &str) -> HttpResponse {
    server.callback(
        "/v1/callbacks/generic/refund",
        &json!({"refund_no": refund_no, "order_no": order_no, "status": status}),
    )
}

fn check_refund_cb(server: &Server, refund_no: &str, order_no: &str, status: &str, outcome: &str) {
    let resp = refund_cb(server, refund_no, order_no, status);
    let context = format!("refund {refund_no} {status} for {order_no}");
    assert_eq!(resp.status, 200, "{context}: {}", resp.text());
    let body = resp.json();
    assert_eq!(body["code"], "SUCCESS", "{context}: {body}");
    assert_eq!(body["outcome"], outcome, "{context}: {body}");
}

fn request_refund(server: &Server, order_no: &str, refund_no: &str) -> HttpResponse {
    server.post_json(&format!("/v1/orders/{order_no}/refund"), &json!({"refund_no": refund_no}))
}

fn close(server: &Server, order_no: &str) -> HttpResponse {
    server.post_json(&format!("/v1/orders/{order_no}/close"), &json!({}))
}

/// A read-only connection to the server's database file.
fn db(server: &Server) -> Connection {
    read_only(&server.db)
}

fn all_events(server: &Server) -> Vec<Value> {
    let resp = server.get("/v1/events?after=0&limit=1000");
    assert_eq!(resp.status, 200, "{}", resp.text());
    resp.json()["events"].as_array().cloned().unwrap_or_default()
}

fn event_ids(server: &Server) -> Vec<String> {
    all_events(server).iter().map(|e| e["event_id"].as_str().unwrap_or_default().to_owned()).collect()
}

fn event(server: &Server, event_id: &str) -> Value {
    all_events(server)
        .into_iter()
        .find(|e| e["event_id"] == event_id)
        .unwrap_or_else(|| panic!("no event {event_id}; have {:?}", event_ids(server)))
}

fn now_s() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

fn post_raw(server: &Server, path: &str, headers: &[(&str, &str)], body: &[u8]) -> HttpResponse {
    util::request(server.addr, "POST", path, headers, body)
}

// ---- POST /v1/orders ----

#[test]
fn create_order_new_replay_conflict_and_key_required() {
    let server = Server::start(&[]);

    // New: 201, every key present, unset ones null, currency CNY, expires = created + expires_in_s.
    let resp = server
        .post_json("/v1/orders", &json!({"order_no": "ORD-1", "user_id": "u1", "amount": 9900, "expires_in_s": 60}));
    assert_eq!(resp.status, 201, "{}", resp.text());
    assert!(resp.header("Content-Type").is_some_and(|c| c.starts_with("application/json")));
    assert_eq!(resp.header("Idempotent-Replayed"), None, "a new order is not a replay");
    let created = resp.json();
    assert_order(&created);
    for (key, value) in [
        ("order_no", json!("ORD-1")),
        ("user_id", json!("u1")),
        ("amount", json!(9900)),
        ("currency", json!("CNY")),
        ("status", json!("PENDING")),
    ] {
        assert_eq!(created[key], value, "{key} of {created}");
    }
    for key in ["pay_no", "paid_at", "closed_at", "refund_no", "refunded_at"] {
        assert!(created[key].is_null(), "{key} of a new order: {created}");
    }
    assert_eq!(ms(&created["expires_at"]) - ms(&created["created_at"]), 60_000, "{created}");

    // Default lifetime: --order-ttl-s 900.
    let default_ttl = create(&server, "ORD-TTL", "u1", 1);
    assert_eq!(ms(&default_ttl["expires_at"]) - ms(&default_ttl["created_at"]), 900_000, "{default_ttl}");

    // Explicit currency.
    let usd = server
        .post_json("/v1/orders", &json!({"order_no": "ORD-USD", "user_id": "u1", "amount": 5, "currency": "USD"}));
    assert_eq!(usd.status, 201, "{}", usd.text());
    assert_eq!(usd.json()["currency"], "USD");

    // The same order again (same user_id, amount, currency; expires_in_s is not part of the identity).
    let replays = [
        json!({"order_no": "ORD-1", "user_id": "u1", "amount": 9900, "expires_in_s": 60}),
        json!({"order_no": "ORD-1", "user_id": "u1", "amount": 9900}),
        json!({"order_no": "ORD-1", "user_id": "u1", "amount": 9900, "currency": "CNY", "expires_in_s": 5}),
    ];
    for body in replays {
        let resp = server.post_json("/v1/orders", &body);
        assert_eq!(resp.status, 200, "{body}: {}", resp.text());
        assert_eq!(resp.header("Idempotent-Replayed"), Some("true"), "{body}");
        assert_eq!(resp.json(), created, "a replay answers the stored order: {body}");
    }

    // Different fields: 409 order_no_conflict, the stored order untouched.
    let conflicts = [
        json!({"order_no": "ORD-1", "user_id": "u2", "amount": 9900}),
        json!({"order_no": "ORD-1", "user_id": "u1", "amount": 9901}),
        json!({"order_no": "ORD-1", "user_id": "u1", "amount": 9900, "currency": "USD"}),
    ];
    for body in conflicts {
        let resp = server.post_json("/v1/orders", &body);
        expect_error(&resp, 409, "order_no_conflict", &body.to_string());
        assert_eq!(resp.header("Idempotent-Replayed"), None, "{body}");
    }
    let stored = order(&server, "ORD-1");
    for key in ORDER_KEYS {
        assert_eq!(stored[key], created[key], "{key} changed after conflicts");
    }

    // Neither order_no nor Idempotency-Key.
    let resp = server.post_json("/v1/orders", &json!({"user_id": "u1", "amount": 9900}));
    expect_error(&resp, 400, "idempotency_key_required", "no order_no, no key");
    let resp = server.post_json("/v1/orders", &json!({"order_no": null, "user_id": "u1", "amount": 9900}));
    expect_error(&resp, 400, "idempotency_key_required", "order_no null, no key");

    // A replay of an order that has since changed answers it as stored now.
    assert_eq!(close(&server, "ORD-1").status, 200);
    let resp = server.post_json("/v1/orders", &json!({"order_no": "ORD-1", "user_id": "u1", "amount": 9900}));
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.json()["status"], "CLOSED");
    assert_eq!(count(&db(&server), "SELECT count(*) FROM orders", []), 3, "three orders created, no more");
}

#[test]
fn create_order_validation() {
    let server = Server::start(&[]);
    let base = json!({"order_no": "V-1", "user_id": "u1", "amount": 9900});
    let with = |field: &str, value: Value| {
        let mut body = base.clone();
        body[field] = value;
        body
    };
    let without = |field: &str| {
        let mut body = base.clone();
        body.as_object_mut().map(|m| m.remove(field));
        body
    };
    // (body, the field the message must name)
    let bad: Vec<(Value, &str)> = vec![
        (with("amount", json!(0)), "amount"),
        (with("amount", json!(-1)), "amount"),
        (with("amount", json!(-9900)), "amount"),
        (with("amount", json!(1_000_000_000_001i64)), "amount"),
        (with("amount", json!(99.5)), "amount"),
        (with("amount", json!(99.0)), "amount"),
        (with("amount", json!("9900")), "amount"),
        (with("amount", json!(true)), "amount"),
        (with("amount", json!([9900])), "amount"),
        (with("amount", json!(18_446_744_073_709_551_615u64)), "amount"),
        (without("amount"), "amount"),
        (with("currency", json!("cny")), "currency"),
        (with("currency", json!("CNYY")), "currency"),
        (with("currency", json!("CN")), "currency"),
        (with("currency", json!("")), "currency"),
        (with("currency", json!("C1Y")), "currency"),
        (with("currency", json!(156)), "currency"),
        (with("expires_in_s", json!(0)), "expires_in_s"),
        (with("expires_in_s", json!(86_401)), "expires_in_s"),
        (with("expires_in_s", json!(-5)), "expires_in_s"),
        (with("expires_in_s", json!(1.5)), "expires_in_s"),
        (with("expires_in_s", json!("60")), "expires_in_s"),
        (with("user_id", json!("u".repeat(65))), "user_id"),
        (with("user_id", json!("用户")), "user_id"),
        (with("user_id", json!("ü1")), "user_id"),
        (with("user_id", json!("u 1")), "user_id"),
        (with("user_id", json!("")), "user_id"),
        (with("user_id", json!(7)), "user_id"),
        (without("user_id"), "user_id"),
        (with("order_no", json!("o".repeat(65))), "order_no"),
        (with("order_no", json!("a/b")), "order_no"),
        (with("order_no", json!("订单")), "order_no"),
        (with("order_no", json!("")), "order_no"),
        (with("order_no", json!(12)), "order_no"),
        (with("color", json!("red")), "color"),
    ];
    for (body, field) in &bad {
        let resp = server.post_json("/v1/orders", body);
        expect_error(&resp, 400, "invalid_request", &body.to_string());
        let message = resp.json()["error"]["message"].as_str().unwrap_or_default().to_owned();
        assert!(message.contains(field), "the message names {field}: {message} (body {body})");
    }
    // Not an object at all.
    for body in [json!([]), json!(null), json!("order"), json!(5)] {
        let resp = server.post_json("/v1/orders", &body);
        assert_eq!(resp.status, 400, "{body}: {}", resp.text());
    }
    assert_eq!(count(&db(&server), "SELECT count(*) FROM orders", []), 0, "no invalid order was stored");

    // The boundaries themselves are valid.
    let good = [
        (with("amount", json!(1)), "B-1"),
        (with("amount", json!(1_000_000_000_000i64)), "B-2"),
        (with("expires_in_s", json!(1)), "B-3"),
        (with("expires_in_s", json!(86_400)), "B-4"),
        (with("user_id", json!("u".repeat(64))), "B-5"),
        (with("user_id", json!("A-z_0.9")), "B-6"),
        (with("currency", json!("EUR")), "B-7"),
    ];
    for (mut body, order_no) in good {
        body["order_no"] = json!(order_no);
        let resp = server.post_json("/v1/orders", &body);
        assert_eq!(resp.status, 201, "{body}: {}", resp.text());
    }
    let long_no = "o".repeat(64);
    let resp = server.post_json("/v1/orders", &json!({"order_no": long_no, "user_id": "u", "amount": 1}));
    assert_eq!(resp.status, 201, "64-character order_no: {}", resp.text());
}

// ---- GET /v1/orders ----

#[test]
fn list_orders_newest_first_paged_and_filtered() {
    let server = Server::start(&[]);
    let mut a_orders = Vec::new();
    for i in 0..7 {
        let no = format!("A-{i}");
        create(&server, &no, "ua", 100 + i);
        a_orders.push(no);
        if i == 2 {
            create(&server, "B-0", "ub", 1);
        }
    }
    create(&server, "B-1", "ub", 1);
    for no in ["A-1", "A-4", "B-1"] {
        let amount = order(&server, no)["amount"].as_i64().unwrap_or_default();
        assert_eq!(
            Pay { pay_no: &format!("P-{no}"), order_no: no, amount, status: "SUCCESS" }.send(&server).status,
            200
        );
    }

    let list = |query: &str| {
        let resp = server.get(&format!("/v1/orders{query}"));
        assert_eq!(resp.status, 200, "{query}: {}", resp.text());
        let body = resp.json();
        assert_eq!(keys(&body), set(&["orders", "next_after"]), "{query}: {body}");
        body
    };
    let nos = |body: &Value| -> Vec<String> {
        body["orders"]
            .as_array()
            .map(|a| a.iter().map(|o| o["order_no"].as_str().unwrap_or_default().to_owned()).collect())
            .unwrap_or_default()
    };

    // Unfiltered: every order, newest first, no further page.
    let everything = list("");
    assert_eq!(nos(&everything), ["B-1", "A-6", "A-5", "A-4", "A-3", "B-0", "A-2", "A-1", "A-0"]);
    assert!(everything["next_after"].is_null());
    for o in everything["orders"].as_array().into_iter().flatten() {
        assert_order(o);
    }

    // Paging by user: 3 + 3 + 1, cursor passed back as `after`, null at the end.
    let mut seen = Vec::new();
    let mut query = "?user_id=ua&limit=3".to_owned();
    let mut pages = 0;
    loop {
        let page = list(&query);
        pages += 1;
        let page_nos = nos(&page);
        assert!(page_nos.len() <= 3, "{page}");
        seen.extend(page_nos);
        if page["next_after"].is_null() {
            break;
        }
        assert!(pages < 10, "paging does not end");
        let cursor = match &page["next_after"] {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        query = format!("?user_id=ua&limit=3&after={cursor}");
    }
    assert_eq!(pages, 3);
    let mut expected: Vec<String> = a_orders.clone();
    expected.reverse();
    assert_eq!(seen, expected);

    // Filters.
    assert_eq!(nos(&list("?status=PAID")), ["B-1", "A-4", "A-1"]);
    assert_eq!(nos(&list("?status=PAID&user_id=ua")), ["A-4", "A-1"]);
    assert_eq!(nos(&list("?status=PENDING&user_id=ub")), ["B-0"]);
    assert_eq!(nos(&list("?status=CLOSED")), Vec::<String>::new());
    assert_eq!(nos(&list("?user_id=nobody")), Vec::<String>::new());
    assert_eq!(nos(&list("?limit=1000")).len(), 9);
    assert_eq!(nos(&list("?limit=1")), ["B-1"]);
    // A page that ends exactly at the last order says so: no empty trailing page.
    let exact = list("?user_id=ub&limit=2");
    assert_eq!(nos(&exact), ["B-1", "B-0"]);
    assert!(exact["next_after"].is_null(), "{exact}");
    assert!(!list("?limit=1")["next_after"].is_null());

    // Bad parameters.
    for query in [
        "?status=paid",
        "?status=BOGUS",
        "?status=PAID,CLOSED",
        "?limit=0",
        "?limit=-1",
        "?limit=abc",
        "?limit=1.5",
        "?after=abc",
        "?after=-1",
        "?user_id=%zz",
    ] {
        expect_error(&server.get(&format!("/v1/orders{query}")), 400, "invalid_request", query);
    }
}

// ---- GET /v1/orders/{order_no} ----

#[test]
fn order_detail_lists_payments_coupons_points() {
    let server = Server::start(&REWARDS);
    let created = create(&server, "D-1", "u1", 9999);

    let detail = order(&server, "D-1");
    assert_order(&detail);
    for key in ORDER_KEYS {
        assert_eq!(detail[key], created[key], "{key}");
    }
    assert_eq!(detail["payments"], json!([]));
    assert_eq!(detail["coupons"], json!([]));
    assert_eq!(detail["points"], json!([]));

    check_pay(&server, Pay { pay_no: "DP-0", order_no: "D-1", amount: 9999, status: "FAILED" }, "payment_failed", None);
    check_pay(&server, Pay { pay_no: "DP-1", order_no: "D-1", amount: 9999, status: "SUCCESS" }, "applied", None);
    check_pay(&server, Pay { pay_no: "DP-2", order_no: "D-1", amount: 9999, status: "SUCCESS" }, "already_paid", None);

    let detail = order(&server, "D-1");
    assert_order(&detail);
    assert_eq!(detail["status"], "PAID");
    assert_eq!(detail["pay_no"], "DP-1");
    let payments = detail["payments"].as_array().cloned().unwrap_or_default();
    assert_eq!(payments.len(), 3, "{detail}");
    let payment_keys =
        set(&["pay_no", "channel", "amount", "outcome", "state", "source", "received_at", "resolution", "refunds"]);
    for (payment, (pay_no, outcome)) in
        payments.iter().zip([("DP-0", "payment_failed"), ("DP-1", "applied"), ("DP-2", "already_paid")])
    {
        assert_eq!(keys(payment), payment_keys, "{payment}");
        assert_eq!(payment["pay_no"], pay_no);
        assert_eq!(payment["outcome"], outcome);
        assert_eq!(payment["channel"], "generic");
        assert_eq!(payment["amount"], 9999);
        assert_eq!(payment["state"], "decided");
        assert_eq!(payment["source"], "callback");
        assert!(is_time(&payment["received_at"]), "{payment}");
        assert_eq!(payment["resolution"], Value::Null, "none resolved yet: {payment}");
        assert_eq!(payment["refunds"], json!([]), "{payment}");
    }
    let coupons = detail["coupons"].as_array().cloned().unwrap_or_default();
    let templates: BTreeSet<String> =
        coupons.iter().map(|c| c["coupon_template_id"].as_str().unwrap_or_default().to_owned()).collect();
    assert_eq!(templates, set(&["NEW10", "VIP"]), "{detail}");
    for coupon in &coupons {
        assert_eq!(keys(coupon), set(&["coupon_template_id", "status", "created_at"]), "{coupon}");
        assert_eq!(coupon["status"], "ACTIVE");
        assert!(is_time(&coupon["created_at"]));
    }
    let points = detail["points"].as_array().cloned().unwrap_or_default();
    assert_eq!(points.len(), 1, "{detail}");
    assert_eq!(keys(&points[0]), set(&["point_type", "points", "created_at"]));
    assert_eq!(points[0]["point_type"], "ORDER_PAID");
    assert_eq!(points[0]["points"], 199, "floor(9999 * 2 / 100)");
    assert!(is_time(&points[0]["created_at"]));

    for missing in ["NOPE", "d-1", "D-1x"] {
        expect_error(&server.get(&format!("/v1/orders/{missing}")), 404, "order_not_found", missing);
    }
}

// ---- POST /v1/orders/{no}/close ----

#[test]
fn close_order_transitions_and_refusals() {
    let server = Server::start(&[]);
    let created = create(&server, "C-1", "u1", 500);

    let resp = close(&server, "C-1");
    assert_eq!(resp.status, 200, "{}", resp.text());
    let closed = resp.json();
    assert_order(&closed);
    assert_eq!(closed["status"], "CLOSED");
    assert!(is_time(&closed["closed_at"]), "{closed}");
    assert_eq!(closed["created_at"], created["created_at"]);
    let ev = event(&server, "order.closed:C-1");
    assert_eq!(ev["type"], "order.closed");
    assert_eq!(ev["order_no"], "C-1");
    assert_eq!(ev["data"], json!({"order": closed}), "order.closed carries the order only");

    // Again: 200 with the same order, no second event. An empty body is fine too.
    let again = close(&server, "C-1");
    assert_eq!(again.status, 200, "{}", again.text());
    assert_eq!(again.json(), closed);
    let empty = post_raw(&server, "/v1/orders/C-1/close", &[], b"");
    assert_eq!(empty.status, 200, "{}", empty.text());
    assert_eq!(empty.json(), closed);
    assert_eq!(event_ids(&server), ["order.closed:C-1"]);

    // A PAID order: 409 invalid_transition and an audit_log row.
    create(&server, "C-2", "u1", 500);
    check_pay(&server, Pay { pay_no: "CP-2", order_no: "C-2", amount: 500, status: "SUCCESS" }, "applied", None);
    let audits = |no: &str| count(&db(&server), "SELECT count(*) FROM audit_log WHERE order_no = ?1", [&no]);
    let before = audits("C-2");
    expect_error(&close(&server, "C-2"), 409, "invalid_transition", "close PAID");
    assert_eq!(audits("C-2"), before + 1, "the refused close is written to audit_log");
    assert_eq!(status_of(&server, "C-2"), "PAID");

    // REFUNDING and REFUNDED orders refuse too, each with an audit row.
    assert_eq!(request_refund(&server, "C-2", "CR-2").status, 200);
    expect_error(&close(&server, "C-2"), 409, "invalid_transition", "close REFUNDING");
    assert_eq!(audits("C-2"), before + 2);
    check_refund_cb(&server, "CR-2", "C-2", "SUCCESS", "applied");
    expect_error(&close(&server, "C-2"), 409, "invalid_transition", "close REFUNDED");
    assert_eq!(audits("C-2"), before + 3);
    assert_eq!(status_of(&server, "C-2"), "REFUNDED");

    expect_error(&close(&server, "C-404"), 404, "order_not_found", "close unknown");
    let bad_body = post_raw(&server, "/v1/orders/C-1/close", &[("Content-Type", "application/json")], b"{\"x\":");
    expect_error(&bad_body, 400, "invalid_json", "close with broken JSON");
}

#[test]
fn expired_pending_orders_are_closed_by_the_sweeper() {
    // --order-ttl-s is the default lifetime; the sweeper runs every second by default.
    let server = Server::start(&["--order-ttl-s", "1"]);
    let keep = server
        .post_json("/v1/orders", &json!({"order_no": "KEEP", "user_id": "u1", "amount": 100, "expires_in_s": 3600}));
    assert_eq!(keep.status, 201);
    let expiring = create(&server, "EXP-1", "u1", 100);
    assert_eq!(ms(&expiring["expires_at"]) - ms(&expiring["created_at"]), 1_000, "--order-ttl-s 1: {expiring}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while status_of(&server, "EXP-1") == "PENDING" && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let expired = order(&server, "EXP-1");
    assert_eq!(expired["status"], "CLOSED", "a PENDING order past expires_at is closed by the sweeper: {expired}");
    assert!(ms(&expired["closed_at"]) >= ms(&expired["expires_at"]), "{expired}");
    let ev = event(&server, "order.closed:EXP-1");
    assert_eq!(ev["data"]["order"]["status"], "CLOSED");
    assert_eq!(status_of(&server, "KEEP"), "PENDING", "an order within its lifetime stays PENDING");
    check_pay(
        &server,
        Pay { pay_no: "EXP-P", order_no: "EXP-1", amount: 100, status: "SUCCESS" },
        "paid_after_close",
        None,
    );
    assert_eq!(event_ids(&server).iter().filter(|e| e.starts_with("order.closed:")).count(), 1);
}

// ---- POST /v1/orders/{no}/refund ----

#[test]
fn refund_request_lifecycle() {
    let server = Server::start(&[]);
    create(&server, "R-1", "u1", 800);

    expect_error(&request_refund(&server, "R-1", "RF-0"), 409, "invalid_transition", "refund PENDING");
    expect_error(&request_refund(&server, "R-404", "RF-X"), 404, "order_not_found", "refund unknown order");
    check_pay(&server, Pay { pay_no: "RP-1", order_no: "R-1", amount: 800, status: "SUCCESS" }, "applied", None);

    let resp = request_refund(&server, "R-1", "RF-1");
    assert_eq!(resp.status, 200, "{}", resp.text());
    let refunding = resp.json();
    assert_order(&refunding);
    assert_eq!(refunding["status"], "REFUNDING");
    assert_eq!(refunding["refund_no"], "RF-1");
    let ev = event(&server, "order.refunding:R-1/RF-1");
    assert_eq!(ev["data"]["refund"], json!({"refund_no": "RF-1", "status": "REQUESTED", "amount": 800}));

    // The same refund_no again: 200 with the order.
    let again = request_refund(&server, "R-1", "RF-1");
    assert_eq!(again.status, 200, "{}", again.text());
    assert_eq!(again.json(), refunding);
    // Another refund_no while one is in flight: 409.
    expect_error(&request_refund(&server, "R-1", "RF-2"), 409, "invalid_transition", "second refund_no");

    // The refund fails: PAID again, a new refund_no works, the old stays FAILED.
    check_refund_cb(&server, "RF-1", "R-1", "FAILED", "refund_failed");
    assert_eq!(status_of(&server, "R-1"), "PAID");
    let resp = request_refund(&server, "R-1", "RF-2");
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.json()["status"], "REFUNDING");
    assert_eq!(resp.json()["refund_no"], "RF-2");
    let refund_status = |no: &str| -> String {
        db(&server)
            .query_row("SELECT status FROM refund WHERE refund_no = ?1", [no], |r| r.get(0))
            .unwrap_or_else(|e| panic!("refund {no}: {e}"))
    };
    assert_eq!(refund_status("RF-1"), "FAILED");
    assert_eq!(refund_status("RF-2"), "REQUESTED");

    check_refund_cb(&server, "RF-2", "R-1", "SUCCESS", "applied");
    assert_eq!(refund_status("RF-2"), "SUCCEEDED");
    assert_eq!(refund_status("RF-1"), "FAILED");
    // The same refund_no while REFUNDED: 200 with the order; another: 409.
    let done = request_refund(&server, "R-1", "RF-2");
    assert_eq!(done.status, 200, "{}", done.text());
    assert_eq!(done.json()["status"], "REFUNDED");
    expect_error(&request_refund(&server, "R-1", "RF-3"), 409, "invalid_transition", "refund REFUNDED");

    // A refund_no already used by another order.
    create(&server, "R-2", "u1", 800);
    check_pay(&server, Pay { pay_no: "RP-2", order_no: "R-2", amount: 800, status: "SUCCESS" }, "applied", None);
    expect_error(&request_refund(&server, "R-2", "RF-2"), 409, "invalid_transition", "refund_no of another order");
    assert_eq!(status_of(&server, "R-2"), "PAID");
    // A closed order cannot be refunded.
    create(&server, "R-3", "u1", 800);
    assert_eq!(close(&server, "R-3").status, 200);
    expect_error(&request_refund(&server, "R-3", "RF-9"), 409, "invalid_transition", "refund CLOSED");

    // Bad bodies.
    let bad_bodies = [
        (json!({}), "refund_no"),
        (json!({"refund_no": "has space"}), "refund_no"),
        (json!({"refund_no": 5}), "refund_no"),
        (json!({"refund_no": "x".repeat(65)}), "refund_no"),
        (json!({"refund_no": "RF-7", "extra": 1}), "extra"),
    ];
    for (body, field) in bad_bodies {
        let resp = server.post_json("/v1/orders/R-2/refund", &body);
        expect_error(&resp, 400, "invalid_request", &body.to_string());
        let message = resp.json()["error"]["message"].as_str().unwrap_or_default().to_owned();
        assert!(message.contains(field), "the message names {field}: {message}");
    }
    assert_eq!(status_of(&server, "R-2"), "PAID");
    assert_eq!(count(&db(&server), "SELECT count(*) FROM refund", []), 2);
}

// ---- payment callbacks ----

#[test]
fn payment_callback_every_outcome() {
    let server = Server::start(&REWARDS);
    let coupons_of = |user: &str| {
        server.get(&format!("/v1/users/{user}/coupons")).json()["coupons"].as_array().cloned().unwrap_or_default()
    };
    let points_of = |user: &str| server.get(&format!("/v1/users/{user}/points")).json();

    // applied: PENDING→PAID, two ACTIVE coupons, floor(9999*2/100) points, order.paid.
    create(&server, "O-1", "u1", 9999);
    check_pay(&server, Pay { pay_no: "P-1", order_no: "O-1", amount: 9999, status: "SUCCESS" }, "applied", None);
    let paid = order(&server, "O-1");
    assert_eq!(paid["status"], "PAID");
    assert_eq!(paid["pay_no"], "P-1");
    assert!(is_time(&paid["paid_at"]));
    let coupons = coupons_of("u1");
    assert_eq!(coupons.len(), 2, "{coupons:?}");
    assert!(coupons.iter().all(|c| c["status"] == "ACTIVE" && c["order_no"] == "O-1"), "{coupons:?}");
    assert_eq!(points_of("u1")["balance"], 199);
    let ev = event(&server, "order.paid:O-1");
    assert_eq!(ev["type"], "order.paid");
    assert_eq!(
        ev["data"]["payment"],
        json!({"pay_no": "P-1", "channel": "generic", "amount": 9999, "outcome": "applied"})
    );
    assert_eq!(ev["data"]["order"]["status"], "PAID");

    // duplicate, with the original outcome, whatever the re-delivery says.
    let before = footprint(&db(&server));
    check_pay(
        &server,
        Pay { pay_no: "P-1", order_no: "O-1", amount: 9999, status: "SUCCESS" },
        "duplicate",
        Some("applied"),
    );
    check_pay(
        &server,
        Pay { pay_no: "P-1", order_no: "O-1", amount: 9999, status: "FAILED" },
        "duplicate",
        Some("applied"),
    );
    assert_eq!(footprint(&db(&server)), before, "a duplicate changes nothing");

    // payment_failed: recorded, order unchanged; a later SUCCESS of the pay_no supersedes it once.
    create(&server, "O-2", "u2", 5000);
    check_pay(&server, Pay { pay_no: "P-2", order_no: "O-2", amount: 5000, status: "FAILED" }, "payment_failed", None);
    assert_eq!(status_of(&server, "O-2"), "PENDING");
    assert!(coupons_of("u2").is_empty());
    check_pay(
        &server,
        Pay { pay_no: "P-2", order_no: "O-2", amount: 5000, status: "FAILED" },
        "duplicate",
        Some("payment_failed"),
    );
    check_pay(&server, Pay { pay_no: "P-2", order_no: "O-2", amount: 5000, status: "SUCCESS" }, "applied", None);
    assert_eq!(status_of(&server, "O-2"), "PAID");
    assert_eq!(coupons_of("u2").len(), 2);
    assert_eq!(points_of("u2")["balance"], 100);
    check_pay(
        &server,
        Pay { pay_no: "P-2", order_no: "O-2", amount: 5000, status: "SUCCESS" },
        "duplicate",
        Some("applied"),
    );
    check_pay(
        &server,
        Pay { pay_no: "P-2", order_no: "O-2", amount: 5000, status: "FAILED" },
        "duplicate",
        Some("applied"),
    );
    assert_eq!(coupons_of("u2").len(), 2, "superseded once only");
    assert_eq!(event_ids(&server).iter().filter(|e| e.as_str() == "order.paid:O-2").count(), 1);
    let payments = order(&server, "O-2")["payments"].as_array().cloned().unwrap_or_default();
    assert_eq!(payments.len(), 1, "one record per pay_no: {payments:?}");
    assert_eq!(payments[0]["outcome"], "applied");

    // paid_after_close: recorded, order stays CLOSED, payment.refund_required:{pay_no}, no rewards.
    create(&server, "O-3", "u3", 3000);
    assert_eq!(close(&server, "O-3").status, 200);
    check_pay(
        &server,
        Pay { pay_no: "P-3", order_no: "O-3", amount: 3000, status: "SUCCESS" },
        "paid_after_close",
        None,
    );
    assert_eq!(status_of(&server, "O-3"), "CLOSED");
    let ev = event(&server, "payment.refund_required:P-3");
    assert_eq!(ev["type"], "payment.refund_required");
    assert_eq!(ev["order_no"], "O-3");
    assert_eq!(ev["data"]["payment"]["outcome"], "paid_after_close");
    assert!(coupons_of("u3").is_empty());
    assert_eq!(points_of("u3")["balance"], 0);
    check_pay(
        &server,
        Pay { pay_no: "P-3", order_no: "O-3", amount: 3000, status: "SUCCESS" },
        "duplicate",
        Some("paid_after_close"),
    );

    // already_paid: a second pay_no on a paid order; no rewards; event.
    check_pay(&server, Pay { pay_no: "P-1b", order_no: "O-1", amount: 9999, status: "SUCCESS" }, "already_paid", None);
    let still = order(&server, "O-1");
    assert_eq!(still["pay_no"], "P-1", "the paying payment stays");
    assert_eq!(still["coupons"].as_array().map(Vec::len), Some(2));
    assert_eq!(still["points"].as_array().map(Vec::len), Some(1));
    assert_eq!(points_of("u1")["balance"], 199);
    let ev = event(&server, "payment.refund_required:P-1b");
    assert_eq!(
        ev["data"]["payment"],
        json!({"pay_no": "P-1b", "channel": "generic", "amount": 9999, "outcome": "already_paid"})
    );
    check_pay(
        &server,
        Pay { pay_no: "P-1b", order_no: "O-1", amount: 9999, status: "SUCCESS" },
        "duplicate",
        Some("already_paid"),
    );

    // amount_mismatch: order stays PENDING; event; the right amount later applies.
    create(&server, "O-4", "u4", 2000);
    check_pay(
        &server,
        Pay { pay_no: "P-4", order_no: "O-4", amount: 1999, status: "SUCCESS" },
        "amount_mismatch",
        None,
    );
    assert_eq!(status_of(&server, "O-4"), "PENDING");
    assert!(coupons_of("u4").is_empty());
    let ev = event(&server, "payment.refund_required:P-4");
    assert_eq!(ev["data"]["payment"]["outcome"], "amount_mismatch");
    assert_eq!(ev["data"]["payment"]["amount"], 1999);
    assert_eq!(ev["data"]["order"]["status"], "PENDING");
    check_pay(
        &server,
        Pay { pay_no: "P-4", order_no: "O-4", amount: 2000, status: "SUCCESS" },
        "duplicate",
        Some("amount_mismatch"),
    );
    check_pay(&server, Pay { pay_no: "P-4b", order_no: "O-4", amount: 2000, status: "SUCCESS" }, "applied", None);
    assert_eq!(status_of(&server, "O-4"), "PAID");

    // Points: none when floor(amount * 2 / 100) is 0, coupons still.
    create(&server, "O-5", "u5", 49);
    check_pay(&server, Pay { pay_no: "P-5", order_no: "O-5", amount: 49, status: "SUCCESS" }, "applied", None);
    let small = order(&server, "O-5");
    assert_eq!(small["points"], json!([]), "no entry when the points are 0");
    assert_eq!(small["coupons"].as_array().map(Vec::len), Some(2));

    // The raw body is recorded byte for byte, with the outcome and decision.
    let conn = db(&server);
    let (raw, outcome, state, source, decided_at): (Vec<u8>, String, String, String, Option<String>) = conn
        .query_row(
            "SELECT raw_body, outcome, state, source, decided_at FROM pay_callback_log WHERE pay_no = 'P-4'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
        )
        .expect("P-4 recorded");
    let sent = json!({"pay_no": "P-4", "order_no": "O-4", "amount": 1999, "status": "SUCCESS"}).to_string();
    assert_eq!(raw, sent.as_bytes(), "raw_body is the first delivery's exact bytes");
    assert_eq!((outcome.as_str(), state.as_str(), source.as_str()), ("amount_mismatch", "decided", "callback"));
    assert!(decided_at.is_some());
    assert_eq!(count(&conn, "SELECT count(*) FROM pay_callback_log", []), 7, "one row per pay_no");
}

#[test]
fn payment_outcome_precedence() {
    let server = Server::start(&REWARDS);
    // FAILED beats CLOSED (row 3 before 4).
    create(&server, "Q-1", "u", 100);
    assert_eq!(close(&server, "Q-1").status, 200);
    check_pay(&server, Pay { pay_no: "QP-1", order_no: "Q-1", amount: 100, status: "FAILED" }, "payment_failed", None);
    // ...and a later SUCCESS of that pay_no is judged by the rows below it: paid_after_close.
    check_pay(
        &server,
        Pay { pay_no: "QP-1", order_no: "Q-1", amount: 100, status: "SUCCESS" },
        "paid_after_close",
        None,
    );
    assert!(event_ids(&server).contains(&"payment.refund_required:QP-1".to_owned()));
    // FAILED beats a wrong amount (row 3 before 6).
    create(&server, "Q-2", "u", 100);
    check_pay(&server, Pay { pay_no: "QP-2", order_no: "Q-2", amount: 7, status: "FAILED" }, "payment_failed", None);
    assert_eq!(status_of(&server, "Q-2"), "PENDING");
    // CLOSED beats a wrong amount (row 4 before 6).
    check_pay(&server, Pay { pay_no: "QP-3", order_no: "Q-1", amount: 7, status: "SUCCESS" }, "paid_after_close", None);
    // Past PENDING beats a wrong amount (row 5 before 6), in every paid state.
    create(&server, "Q-3", "u", 100);
    check_pay(&server, Pay { pay_no: "QP-4", order_no: "Q-3", amount: 100, status: "SUCCESS" }, "applied", None);
    check_pay(&server, Pay { pay_no: "QP-5", order_no: "Q-3", amount: 7, status: "SUCCESS" }, "already_paid", None);
    assert_eq!(request_refund(&server, "Q-3", "QR-1").status, 200);
    check_pay(&server, Pay { pay_no: "QP-6", order_no: "Q-3", amount: 100, status: "SUCCESS" }, "already_paid", None);
    assert_eq!(status_of(&server, "Q-3"), "REFUNDING");
    check_refund_cb(&server, "QR-1", "Q-3", "SUCCESS", "applied");
    check_pay(&server, Pay { pay_no: "QP-7", order_no: "Q-3", amount: 100, status: "SUCCESS" }, "already_paid", None);
    assert_eq!(status_of(&server, "Q-3"), "REFUNDED");
    // No rewards for any of the refund-required payments.
    assert_eq!(order(&server, "Q-3")["coupons"].as_array().map(Vec::len), Some(2));
    assert_eq!(order(&server, "Q-1")["coupons"], json!([]));
    // FAILED on a paid order is payment_failed, not a refund.
    check_pay(&server, Pay { pay_no: "QP-8", order_no: "Q-3", amount: 100, status: "FAILED" }, "payment_failed", None);
    let ids = event_ids(&server);
    for pay_no in ["QP-3", "QP-5", "QP-6", "QP-7"] {
        assert!(ids.contains(&format!("payment.refund_required:{pay_no}")), "{pay_no}: {ids:?}");
    }
    for pay_no in ["QP-2", "QP-8"] {
        assert!(!ids.iter().any(|e| e.ends_with(pay_no)), "{pay_no} emits nothing: {ids:?}");
    }
}

#[test]
fn payment_for_unknown_order_records_nothing_and_can_succeed_later() {
    let server = Server::start(&REWARDS);
    let before = footprint(&db(&server));
    for _ in 0..2 {
        expect_error(
            &Pay { pay_no: "PU-1", order_no: "LATE-1", amount: 700, status: "SUCCESS" }.send(&server),
            404,
            "order_not_found",
            "unknown order",
        );
    }
    assert_eq!(footprint(&db(&server)), before, "nothing recorded for an unknown order");
    create(&server, "LATE-1", "u1", 700);
    check_pay(&server, Pay { pay_no: "PU-1", order_no: "LATE-1", amount: 700, status: "SUCCESS" }, "applied", None);
    assert_eq!(status_of(&server, "LATE-1"), "PAID");
    assert_eq!(order(&server, "LATE-1")["coupons"].as_array().map(Vec::len), Some(2));
}

#[test]
fn callback_authentication_failures_record_nothing() {
    let server = Server::start(&[]);
    create(&server, "S-1", "u1", 100);
    create(&server, "S-2", "u1", 100);
    check_pay(&server, Pay { pay_no: "SP-0", order_no: "S-2", amount: 100, status: "SUCCESS" }, "applied", None);
    assert_eq!(request_refund(&server, "S-2", "SR-1").status, 200);
    let before = footprint(&db(&server));

    let body = json!({"pay_no": "SP-1", "order_no": "S-1", "amount": 100, "status": "SUCCESS"}).to_string();
    let other_body = json!({"pay_no": "SP-1", "order_no": "S-1", "amount": 1, "status": "SUCCESS"}).to_string();
    let now = now_s();
    let good = payonce::signature::sign(SECRET.as_bytes(), now, body.as_bytes());
    let good_v1 = good.split_once(",v1=").map(|(_, v)| v.to_owned()).unwrap_or_default();
    let wrong_secret = payonce::signature::sign(b"not-the-secret", now, body.as_bytes());
    let other_body_sig = payonce::signature::sign(SECRET.as_bytes(), now, other_body.as_bytes());
    let other_t = payonce::signature::sign(SECRET.as_bytes(), now - 1, body.as_bytes());
    let other_t_v1 = other_t.split_once(",v1=").map(|(_, v)| v.to_owned()).unwrap_or_default();
    let invalid: Vec<(&str, Option<String>)> = vec![
        ("missing", None),
        ("empty", Some(String::new())),
        ("garbage", Some("garbage".into())),
        ("t only", Some(format!("t={now}"))),
        ("v1 only", Some(format!("v1={good_v1}"))),
        ("wrong secret", Some(wrong_secret)),
        ("signed another body", Some(other_body_sig)),
        ("mac of another t", Some(format!("t={now},v1={other_t_v1}"))),
        ("t not a number", Some(format!("t=abc,v1={good_v1}"))),
        ("v1 truncated", Some(format!("t={now},v1={}", &good_v1[..40]))),
        ("v1 not hex", Some(format!("t={now},v1={}", "z".repeat(64)))),
        ("v1 empty", Some(format!("t={now},v1="))),
    ];
    for (what, header) in &invalid {
        let mut headers = vec![("Content-Type", "application/json")];
        if let Some(h) = header {
            headers.push(("Payonce-Signature", h.as_str()));
        }
        expect_error(
            &post_raw(&server, "/v1/callbacks/generic", &headers, body.as_bytes()),
            401,
            "invalid_signature",
            what,
        );
    }
    // Authentic but t more than 300 s from now, either way. 302, not 301: the
    // server reads its clock up to a second after this test read `now`, and
    // t = now + 301 would then be exactly 300 s ahead, which is allowed.
    // (The 301 s edge itself is a unit test on a fixed clock in signature.rs.)
    for t in [now - 302, now - 3600, now + 302, now + 3600] {
        let header = payonce::signature::sign(SECRET.as_bytes(), t, body.as_bytes());
        let headers = [("Content-Type", "application/json"), ("Payonce-Signature", header.as_str())];
        expect_error(
            &post_raw(&server, "/v1/callbacks/generic", &headers, body.as_bytes()),
            401,
            "signature_expired",
            &format!("t={t}"),
        );
    }
    // The same for refund callbacks.
    let refund_body = json!({"refund_no": "SR-1", "order_no": "S-2", "status": "SUCCESS"}).to_string();
    let stale = payonce::signature::sign(SECRET.as_bytes(), now - 302, refund_body.as_bytes());
    let wrong = payonce::signature::sign(b"nope", now, refund_body.as_bytes());
    for (header, code) in
        [(None, "invalid_signature"), (Some(wrong), "invalid_signature"), (Some(stale), "signature_expired")]
    {
        let mut headers = vec![("Content-Type", "application/json")];
        if let Some(h) = &header {
            headers.push(("Payonce-Signature", h.as_str()));
        }
        expect_error(
            &post_raw(&server, "/v1/callbacks/generic/refund", &headers, refund_body.as_bytes()),
            401,
            code,
            "refund callback",
        );
    }
    assert_eq!(footprint(&db(&server)), before, "a request that fails authentication records nothing");
    assert_eq!(status_of(&server, "S-1"), "PENDING");
    assert_eq!(status_of(&server, "S-2"), "REFUNDING");

    // Within the window, and with several v1 entries of which one matches: accepted.
    let t = now - 250;
    let in_window = payonce::signature::sign(SECRET.as_bytes(), t, body.as_bytes());
    let v1 = in_window.split_once(",v1=").map(|(_, v)| v.to_owned()).unwrap_or_default();
    let wrong_v1 = "0".repeat(64);
    let several = format!("t={t},v1={wrong_v1},v1={v1}");
    let headers = [("Content-Type", "application/json"), ("Payonce-Signature", several.as_str())];
    let resp = post_raw(&server, "/v1/callbacks/generic", &headers, body.as_bytes());
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.json()["outcome"], "applied");
}

#[test]
fn callback_unknown_channel_and_media_type() {
    let server = Server::start(&[]);
    create(&server, "K-1", "u1", 100);
    let before = footprint(&db(&server));
    let body = json!({"pay_no": "KP-1", "order_no": "K-1", "amount": 100, "status": "SUCCESS"});
    for path in [
        "/v1/callbacks/paypal",
        "/v1/callbacks/wechatpay",
        "/v1/callbacks/alipay",
        "/v1/callbacks/GENERIC",
        "/v1/callbacks/paypal/refund",
        "/v1/callbacks/wechatpay/refund",
    ] {
        expect_error(&server.callback(path, &body), 404, "channel_not_configured", path);
    }
    // Signed correctly but not JSON by media type.
    let text = body.to_string();
    let sig = util::sign_now(SECRET, text.as_bytes());
    let headers = [("Content-Type", "text/plain"), ("Payonce-Signature", sig.as_str())];
    expect_error(
        &post_raw(&server, "/v1/callbacks/generic", &headers, text.as_bytes()),
        415,
        "unsupported_media_type",
        "text/plain",
    );
    assert_eq!(footprint(&db(&server)), before, "nothing recorded");
    // With parameters and in any case, application/json is JSON.
    let headers = [("Content-Type", "Application/JSON; charset=utf-8"), ("Payonce-Signature", sig.as_str())];
    let resp = post_raw(&server, "/v1/callbacks/generic", &headers, text.as_bytes());
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.json()["outcome"], "applied");
}

#[test]
fn callback_invalid_bodies_record_nothing() {
    let server = Server::start(&REWARDS);
    create(&server, "I-1", "u1", 100);
    create(&server, "I-2", "u1", 100);
    check_pay(&server, Pay { pay_no: "IP-0", order_no: "I-2", amount: 100, status: "SUCCESS" }, "applied", None);
    assert_eq!(request_refund(&server, "I-2", "IR-1").status, 200);
    let before = footprint(&db(&server));

    let base = json!({"pay_no": "IP-1", "order_no": "I-1", "amount": 100, "status": "SUCCESS"});
    let with = |field: &str, value: Value| {
        let mut body = base.clone();
        body[field] = value;
        body
    };
    let without = |field: &str| {
        let mut body = base.clone();
        body.as_object_mut().map(|m| m.remove(field));
        body
    };
    let bad = [
        without("pay_no"),
        without("order_no"),
        without("amount"),
        without("status"),
        with("amount", json!(99.5)),
        with("amount", json!(100.0)),
        with("amount", json!("100")),
        with("amount", json!(0)),
        with("amount", json!(-100)),
        with("amount", json!(1_000_000_000_001i64)),
        with("amount", json!(null)),
        with("pay_no", json!("bad pay")),
        with("pay_no", json!("")),
        with("pay_no", json!("p".repeat(65))),
        with("pay_no", json!("支付")),
        with("pay_no", json!(42)),
        with("order_no", json!("I-1/x")),
        with("order_no", json!(1)),
        with("status", json!("OK")),
        with("status", json!("success")),
        with("status", json!(true)),
        with("paid_at", json!("yesterday")),
        with("paid_at", json!("2024-01-01 10:00:00")),
        with("paid_at", json!(1_700_000_000)),
        // Platform times (docs/decisions.md): outside [received - 72 h, received + 5 min], or outside 2000-2199.
        with("paid_at", json!(payonce::clock::format_ms(util::now_ms() - 73 * 3_600_000))),
        with("paid_at", json!(payonce::clock::format_ms(util::now_ms() + 6 * 60_000))),
        with("paid_at", json!("2000-01-01T00:00:00Z")),
        with("paid_at", json!("9999-12-31T23:59:59-05:00")),
        with("paid_at", json!("0001-01-01T00:00:00Z")),
        json!([base.clone()]),
        json!("SUCCESS"),
    ];
    for body in &bad {
        let resp = server.callback("/v1/callbacks/generic", body);
        expect_error(&resp, 400, "invalid_request", &body.to_string());
        // The message names the field at fault (the first one that differs from `base`).
        if let (Some(map), Some(base_map)) = (body.as_object(), base.as_object()) {
            let field = base_map
                .keys()
                .find(|k| map.get(*k) != base_map.get(*k))
                .or_else(|| map.keys().find(|k| !base_map.contains_key(*k)))
                .cloned()
                .unwrap_or_default();
            let message = resp.json()["error"]["message"].as_str().unwrap_or_default().to_owned();
            assert!(message.contains(&field), "message names {field}: {message} ({body})");
        }
    }
    // Not JSON at all.
    let text = b"{\"pay_no\": \"IP-1\", ";
    let sig = util::sign_now(SECRET, text);
    let headers = [("Content-Type", "application/json"), ("Payonce-Signature", sig.as_str())];
    expect_error(&post_raw(&server, "/v1/callbacks/generic", &headers, text), 400, "invalid_json", "truncated JSON");

    let refund_base = json!({"refund_no": "IR-1", "order_no": "I-2", "status": "SUCCESS"});
    let refund_bad = [
        json!({"order_no": "I-2", "status": "SUCCESS"}),
        json!({"refund_no": "IR-1", "status": "SUCCESS"}),
        json!({"refund_no": "IR-1", "order_no": "I-2"}),
        json!({"refund_no": "IR 1", "order_no": "I-2", "status": "SUCCESS"}),
        json!({"refund_no": "IR-1", "order_no": "I-2", "status": "DONE"}),
        json!({"refund_no": 1, "order_no": "I-2", "status": "SUCCESS"}),
    ];
    for body in &refund_bad {
        expect_error(&server.callback("/v1/callbacks/generic/refund", body), 400, "invalid_request", &body.to_string());
    }
    assert_eq!(footprint(&db(&server)), before, "invalid bodies record nothing");
    assert_eq!(status_of(&server, "I-1"), "PENDING");
    assert_eq!(status_of(&server, "I-2"), "REFUNDING");

    // The valid bodies still work, and a paid_at with an offset is accepted.
    check_pay(&server, Pay { pay_no: "IP-1", order_no: "I-1", amount: 100, status: "SUCCESS" }, "applied", None);
    let resp = server.callback("/v1/callbacks/generic/refund", &refund_base);
    assert_eq!(resp.json()["outcome"], "applied", "{}", resp.text());
    create(&server, "I-3", "u1", 100);
    let resp = server.callback(
        "/v1/callbacks/generic",
        &json!({"pay_no": "IP-3", "order_no": "I-3", "amount": 100, "status": "SUCCESS",
                "paid_at": util::utc8_rfc3339(util::now_ms() - 60_000).replace(".000+", ".5+")}),
    );
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.json()["outcome"], "applied");
}

// ---- refund callbacks ----

#[test]
fn refund_callback_every_outcome() {
    let server = Server::start(&REWARDS);
    let audits = |no: &str| count(&db(&server), "SELECT count(*) FROM audit_log WHERE order_no = ?1", [&no]);

    // applied
    create(&server, "F-1", "u1", 9999);
    check_pay(&server, Pay { pay_no: "FP-1", order_no: "F-1", amount: 9999, status: "SUCCESS" }, "applied", None);
    assert_eq!(request_refund(&server, "F-1", "FR-1").status, 200);
    check_refund_cb(&server, "FR-1", "F-1", "SUCCESS", "applied");
    let refunded = order(&server, "F-1");
    assert_eq!(refunded["status"], "REFUNDED");
    assert_eq!(refunded["refund_no"], "FR-1");
    assert!(is_time(&refunded["refunded_at"]), "{refunded}");
    let points = refunded["points"].as_array().cloned().unwrap_or_default();
    let entries: Vec<(String, i64)> = points
        .iter()
        .map(|p| (p["point_type"].as_str().unwrap_or_default().to_owned(), p["points"].as_i64().unwrap_or_default()))
        .collect();
    assert_eq!(entries, [("ORDER_PAID".to_owned(), 199), ("ORDER_PAID_REVERSAL".to_owned(), -199)]);
    assert!(refunded["coupons"].as_array().into_iter().flatten().all(|c| c["status"] == "FROZEN"), "{refunded}");
    let ev = event(&server, "order.refunded:F-1/FR-1");
    assert_eq!(ev["type"], "order.refunded");
    assert_eq!(ev["order_no"], "F-1");
    assert_eq!(ev["data"]["refund"], json!({"refund_no": "FR-1", "status": "SUCCEEDED", "amount": 9999}));
    assert_eq!(ev["data"]["order"]["status"], "REFUNDED");

    // The user's views.
    let points = server.get("/v1/users/u1/points");
    assert_eq!(points.status, 200);
    let points = points.json();
    assert_eq!(keys(&points), set(&["balance", "entries"]));
    assert_eq!(points["balance"], 0, "{points}");
    let entry_keys = set(&["order_no", "point_type", "points", "created_at"]);
    for entry in points["entries"].as_array().into_iter().flatten() {
        assert_eq!(keys(entry), entry_keys, "{entry}");
        assert_eq!(entry["order_no"], "F-1");
        assert!(is_time(&entry["created_at"]));
    }
    assert_eq!(points["entries"].as_array().map(Vec::len), Some(2));
    let coupons = server.get("/v1/users/u1/coupons");
    assert_eq!(coupons.status, 200);
    let coupons = coupons.json();
    assert_eq!(keys(&coupons), set(&["coupons"]));
    let coupon_keys = set(&["order_no", "coupon_template_id", "status", "created_at"]);
    let list = coupons["coupons"].as_array().cloned().unwrap_or_default();
    assert_eq!(list.len(), 2);
    for coupon in &list {
        assert_eq!(keys(coupon), coupon_keys, "{coupon}");
        assert_eq!((coupon["order_no"].as_str(), coupon["status"].as_str()), (Some("F-1"), Some("FROZEN")));
    }
    assert_eq!(server.get("/v1/users/nobody/points").json(), json!({"balance": 0, "entries": []}));
    // A user_id in the path is an identifier like anywhere else.
    for path in
        ["/v1/users/%E7%94%A8/points", "/v1/users/a%20b/coupons", &format!("/v1/users/{}/points", "u".repeat(65))]
    {
        let answer = server.get(path);
        assert_eq!((answer.status, answer.error_code().as_str()), (400, "invalid_request"), "{path}");
    }
    assert_eq!(server.get("/v1/users/nobody/coupons").json(), json!({"coupons": []}));

    // duplicate
    let before = footprint(&db(&server));
    check_refund_cb(&server, "FR-1", "F-1", "SUCCESS", "duplicate");
    assert_eq!(footprint(&db(&server)), before);
    // FAILED after SUCCEEDED contradicts a settled refund.
    let a = audits("F-1");
    check_refund_cb(&server, "FR-1", "F-1", "FAILED", "unexpected_refund");
    assert_eq!(audits("F-1"), a + 1, "unexpected_refund is recorded in audit_log");
    assert_eq!(status_of(&server, "F-1"), "REFUNDED");

    // refund_failed
    create(&server, "F-2", "u2", 5000);
    check_pay(&server, Pay { pay_no: "FP-2", order_no: "F-2", amount: 5000, status: "SUCCESS" }, "applied", None);
    assert_eq!(request_refund(&server, "F-2", "FR-2").status, 200);
    check_refund_cb(&server, "FR-2", "F-2", "FAILED", "refund_failed");
    let failed = order(&server, "F-2");
    assert_eq!(failed["status"], "PAID");
    assert!(failed["refunded_at"].is_null());
    assert!(failed["coupons"].as_array().into_iter().flatten().all(|c| c["status"] == "ACTIVE"), "{failed}");
    assert_eq!(failed["points"].as_array().map(Vec::len), Some(1));
    let ev = event(&server, "order.refund_failed:F-2/FR-2");
    assert_eq!(ev["data"]["refund"], json!({"refund_no": "FR-2", "status": "FAILED", "amount": 5000}));
    assert_eq!(ev["data"]["order"]["status"], "PAID");
    let before = footprint(&db(&server));
    check_refund_cb(&server, "FR-2", "F-2", "FAILED", "duplicate");
    assert_eq!(footprint(&db(&server)), before);

    // unexpected_refund: SUCCESS after FAILED; an unknown refund_no; another order's refund_no.
    for (refund_no, status) in
        [("FR-2", "SUCCESS"), ("FR-NEVER", "SUCCESS"), ("FR-NEVER", "FAILED"), ("FR-1", "SUCCESS")]
    {
        let a = audits("F-2");
        check_refund_cb(&server, refund_no, "F-2", status, "unexpected_refund");
        assert_eq!(audits("F-2"), a + 1, "{refund_no} {status} audited");
        let now = order(&server, "F-2");
        assert_eq!(now["status"], "PAID", "{refund_no} {status}");
        assert!(now["coupons"].as_array().into_iter().flatten().all(|c| c["status"] == "ACTIVE"));
        assert_eq!(now["points"].as_array().map(Vec::len), Some(1));
    }
    // An unexpected result on a PENDING order.
    create(&server, "F-3", "u3", 100);
    check_refund_cb(&server, "FR-3", "F-3", "SUCCESS", "unexpected_refund");
    assert_eq!(status_of(&server, "F-3"), "PENDING");

    // Unknown order: 404 order_not_found, recorded nowhere.
    let before = footprint(&db(&server));
    expect_error(&refund_cb(&server, "FR-9", "F-404", "SUCCESS"), 404, "order_not_found", "refund for unknown order");
    assert_eq!(footprint(&db(&server)), before);
}

// ---- GET /v1/events ----

#[test]
fn events_feed_order_ids_and_data() {
    let server = Server::start(&[]);
    create(&server, "E-1", "u1", 1000);
    create(&server, "E-2", "u1", 2000);
    create(&server, "E-3", "u1", 3000);
    check_pay(&server, Pay { pay_no: "EP-1", order_no: "E-1", amount: 1000, status: "SUCCESS" }, "applied", None);
    assert_eq!(close(&server, "E-2").status, 200);
    check_pay(
        &server,
        Pay { pay_no: "EP-2", order_no: "E-2", amount: 2000, status: "SUCCESS" },
        "paid_after_close",
        None,
    );
    assert_eq!(request_refund(&server, "E-1", "ER-1").status, 200);
    check_refund_cb(&server, "ER-1", "E-1", "FAILED", "refund_failed");
    assert_eq!(request_refund(&server, "E-1", "ER-2").status, 200);
    check_refund_cb(&server, "ER-2", "E-1", "SUCCESS", "applied");
    check_pay(&server, Pay { pay_no: "EP-3", order_no: "E-3", amount: 1, status: "SUCCESS" }, "amount_mismatch", None);
    check_pay(&server, Pay { pay_no: "EP-4", order_no: "E-3", amount: 3000, status: "FAILED" }, "payment_failed", None);

    let expected: [(&str, &str, &str, &str); 8] = [
        ("order.paid", "order.paid:E-1", "E-1", "PAID"),
        ("order.closed", "order.closed:E-2", "E-2", "CLOSED"),
        ("payment.refund_required", "payment.refund_required:EP-2", "E-2", "CLOSED"),
        ("order.refunding", "order.refunding:E-1/ER-1", "E-1", "REFUNDING"),
        ("order.refund_failed", "order.refund_failed:E-1/ER-1", "E-1", "PAID"),
        ("order.refunding", "order.refunding:E-1/ER-2", "E-1", "REFUNDING"),
        ("order.refunded", "order.refunded:E-1/ER-2", "E-1", "REFUNDED"),
        ("payment.refund_required", "payment.refund_required:EP-3", "E-3", "PENDING"),
    ];
    let resp = server.get("/v1/events");
    assert_eq!(resp.status, 200, "{}", resp.text());
    let body = resp.json();
    assert_eq!(keys(&body), set(&["events", "next_after"]));
    let events = body["events"].as_array().cloned().unwrap_or_default();
    assert_eq!(events.len(), expected.len(), "{body}");
    let mut last_seq = 0;
    for (ev, (ty, id, order_no, order_status)) in events.iter().zip(expected) {
        assert_eq!(keys(ev), set(&["seq", "event_id", "type", "order_no", "data", "created_at"]), "{ev}");
        let seq = ev["seq"].as_i64().unwrap_or_else(|| panic!("seq of {ev}"));
        assert!(seq > last_seq, "ascending seq: {ev}");
        last_seq = seq;
        assert_eq!(
            (ev["type"].as_str(), ev["event_id"].as_str(), ev["order_no"].as_str()),
            (Some(ty), Some(id), Some(order_no))
        );
        assert!(is_time(&ev["created_at"]), "{ev}");
        let data = &ev["data"];
        assert_order(&data["order"]);
        assert_eq!(data["order"]["order_no"], order_no);
        assert_eq!(data["order"]["status"], order_status, "{ev}");
        let expected_keys: &[&str] = match ty {
            "order.paid" | "payment.refund_required" => &["order", "payment"],
            "order.closed" => &["order"],
            _ => &["order", "refund"],
        };
        assert_eq!(keys(data), set(expected_keys), "{ev}");
        if let Some(payment) = data.get("payment") {
            assert_eq!(keys(payment), set(&["pay_no", "channel", "amount", "outcome"]), "{ev}");
            assert_eq!(payment["channel"], "generic");
            if ty == "payment.refund_required" {
                assert_eq!(Some(id), payment["pay_no"].as_str().map(|p| format!("{ty}:{p}")).as_deref());
            }
        }
        if let Some(refund) = data.get("refund") {
            assert_eq!(keys(refund), set(&["refund_no", "status", "amount"]), "{ev}");
            assert!(id.ends_with(&format!("/{}", refund["refund_no"].as_str().unwrap_or("?"))), "{ev}");
        }
    }
    assert_eq!(body["next_after"], last_seq, "next_after is the last seq");

    // Paging with limit, after.
    let mut after = 0;
    let mut paged = Vec::new();
    for _ in 0..10 {
        let page = server.get(&format!("/v1/events?after={after}&limit=3")).json();
        let page_events = page["events"].as_array().cloned().unwrap_or_default();
        assert!(page_events.len() <= 3);
        if page_events.is_empty() {
            assert_eq!(page["next_after"], after, "next_after is `after` when no event is returned");
            break;
        }
        after = page["next_after"].as_i64().unwrap_or_default();
        assert_eq!(Some(after), page_events.last().and_then(|e| e["seq"].as_i64()));
        paged.extend(page_events);
    }
    assert_eq!(paged, events, "paging returns every event once, in order");
    let tail = server.get(&format!("/v1/events?after={}", last_seq + 1000)).json();
    assert_eq!(tail, json!({"events": [], "next_after": last_seq + 1000}));
    let middle = server.get(&format!("/v1/events?after={}&limit=1", events[3]["seq"])).json();
    assert_eq!(middle["events"], json!([events[4].clone()]));

    for query in ["?after=abc", "?after=-1", "?limit=0", "?limit=x", "?after=1.5"] {
        expect_error(&server.get(&format!("/v1/events{query}")), 400, "invalid_request", query);
    }
}

// ---- service endpoints and protocol errors ----

#[test]
fn healthz_and_protocol_errors() {
    let server = Server::start(&[]);
    let health = server.get("/healthz");
    assert_eq!(health.status, 200);
    assert_eq!(health.json(), json!({"status": "ok"}));

    for path in [
        "/",
        "/v2/orders",
        "/v1",
        "/v1/order",
        "/v1/orders/X/unknown",
        "/healthz/extra",
        "/v1/users/u1",
        "/v1/callbacks",
        "/v1/events/1",
    ] {
        expect_error(&server.get(path), 404, "not_found", path);
    }
    let methods = [
        ("DELETE", "/v1/orders", "GET"),
        ("PUT", "/v1/orders", "POST"),
        ("POST", "/v1/orders/X", "GET"),
        ("DELETE", "/v1/orders/X", "GET"),
        ("GET", "/v1/orders/X/close", "POST"),
        ("GET", "/v1/orders/X/refund", "POST"),
        ("POST", "/v1/users/u1/coupons", "GET"),
        ("POST", "/v1/users/u1/points", "GET"),
        ("POST", "/v1/events", "GET"),
        ("GET", "/v1/callbacks/generic", "POST"),
        ("PUT", "/v1/callbacks/generic/refund", "POST"),
        ("POST", "/healthz", "GET"),
    ];
    for (method, path, allowed) in methods {
        let resp = util::request(server.addr, method, path, &[("Content-Type", "application/json")], b"{}");
        expect_error(&resp, 405, "method_not_allowed", &format!("{method} {path}"));
        let allow = resp.header("Allow").unwrap_or_default();
        assert!(allow.contains(allowed), "{method} {path}: Allow {allow:?}");
    }
    let order = br#"{"order_no":"M-1","user_id":"u1","amount":100}"#;
    for content_type in ["text/plain", "application/x-www-form-urlencoded", "application/jsonx", "multipart/form-data"]
    {
        let resp = post_raw(&server, "/v1/orders", &[("Content-Type", content_type)], order);
        expect_error(&resp, 415, "unsupported_media_type", content_type);
    }
    let resp = post_raw(&server, "/v1/orders/M-1/refund", &[("Content-Type", "text/plain")], br#"{"refund_no":"x"}"#);
    expect_error(&resp, 415, "unsupported_media_type", "refund text/plain");
    assert_eq!(count(&db(&server), "SELECT count(*) FROM orders", []), 0);
    let resp = post_raw(&server, "/v1/orders", &[("Content-Type", "application/json; charset=utf-8")], order);
    assert_eq!(resp.status, 201, "{}", resp.text());
    expect_error(
        &post_raw(&server, "/v1/orders", &[("Content-Type", "application/json")], b"{nope"),
        400,
        "invalid_json",
        "broken JSON",
    );
}

// ---- 503 database_busy, and shutdown finishing requests in flight ----

#[test]
fn database_busy_is_503_and_shutdown_finishes_requests_in_flight() {
    // No sweeper writes during the test: only our lock and our requests.
    let mut server = Server::start(&["--sweep-interval-s", "3600"]);
    create(&server, "BUSY-1", "u1", 100);
    // Another process holds the write lock longer than payonce's busy_timeout.
    let other = Connection::open(&server.db).expect("open db");
    other.execute_batch("BEGIN IMMEDIATE").expect("take the write lock");
    assert_eq!(server.get("/healthz").status, 200, "reads go on under a writer (WAL)");
    assert_eq!(status_of(&server, "BUSY-1"), "PENDING");
    let resp = Pay { pay_no: "BUSY-P", order_no: "BUSY-1", amount: 100, status: "SUCCESS" }.send(&server);
    expect_error(&resp, 503, "database_busy", "payment while another process writes");
    assert!(resp.header("Retry-After").is_some_and(|v| v.parse::<u64>().is_ok()), "Retry-After: {:?}", resp.headers);
    other.execute_batch("ROLLBACK").expect("release");
    assert_eq!(count(&db(&server), "SELECT count(*) FROM pay_callback_log", []), 0, "a 503 recorded nothing");
    // The platform's retry succeeds once the database is free.
    check_pay(&server, Pay { pay_no: "BUSY-P", order_no: "BUSY-1", amount: 100, status: "SUCCESS" }, "applied", None);

    // SIGTERM while a request waits on the database: it is answered, then payonce exits 0.
    create(&server, "BUSY-2", "u1", 100);
    other.execute_batch("BEGIN IMMEDIATE").expect("take the write lock again");
    let addr = server.addr;
    let in_flight = std::thread::spawn(move || {
        let body = json!({"pay_no": "BUSY-P2", "order_no": "BUSY-2", "amount": 100, "status": "SUCCESS"}).to_string();
        let sig = util::sign_now(SECRET, body.as_bytes());
        util::request(
            addr,
            "POST",
            "/v1/callbacks/generic",
            &[("Content-Type", "application/json"), ("Payonce-Signature", &sig)],
            body.as_bytes(),
        )
    });
    std::thread::sleep(Duration::from_millis(500));
    server.signal(15);
    std::thread::sleep(Duration::from_millis(500));
    other.execute_batch("ROLLBACK").expect("release");
    let resp = in_flight.join().expect("request thread");
    assert_eq!(resp.status, 200, "the request in flight at SIGTERM is finished: {}", resp.text());
    assert_eq!(resp.json()["outcome"], "applied");
    let status = wait_with_timeout(&mut server.child, Duration::from_secs(15));
    assert_eq!(status.and_then(|s| s.code()), Some(0));
    let outcome: String = db(&server)
        .query_row("SELECT outcome FROM pay_callback_log WHERE pay_no = 'BUSY-P2'", [], |r| r.get(0))
        .expect("the acknowledged payment is committed");
    assert_eq!(outcome, "applied");
}

// ---- the serve command ----

fn payonce() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_payonce"));
    cmd.env_remove("PAYONCE_CALLBACK_SECRET").stdin(Stdio::null());
    cmd
}

#[test]
fn serve_cli_secret_help_and_signals() {
    let dir = util::TempDir::new("cli");
    let db_path = dir.path("cli.db").display().to_string();

    // No secret and no --dev: a non-zero exit with a message, never a listening line.
    let out =
        payonce().args(["serve", "--db", &db_path, "--listen", "127.0.0.1:0"]).output().expect("run payonce serve");
    assert!(!out.status.success(), "serve without a secret must fail");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("secret"), "the message says what is missing: {stderr:?}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("listening"));

    // --help: exit 0 with usage.
    for args in [&["serve", "--help"][..], &["--help"][..]] {
        let out = payonce().args(args).output().expect("run --help");
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        assert!(String::from_utf8_lossy(&out.stdout).to_lowercase().contains("usage"), "{args:?}");
    }

    // --dev without a secret: starts, warns loudly on stderr, stdout carries only the first line.
    let mut dev = payonce()
        .args(["serve", "--dev", "--db", &db_path, "--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn --dev");
    let mut dev_out = BufReader::new(dev.stdout.take().expect("stdout"));
    let mut first = String::new();
    dev_out.read_line(&mut first).expect("first line");
    assert!(first.starts_with("listening on http://127.0.0.1:"), "{first:?}");
    let _ = Command::new("kill").args(["-15", &dev.id().to_string()]).status();
    let mut dev_err = String::new();
    let _ = dev.stderr.take().expect("stderr").read_to_string(&mut dev_err);
    assert_eq!(wait_with_timeout(&mut dev, Duration::from_secs(15)).and_then(|s| s.code()), Some(0));
    let mut rest = String::new();
    let _ = dev_out.read_to_string(&mut rest);
    assert_eq!(rest, "", "logs and warnings go to stderr, not stdout");
    assert!(dev_err.to_lowercase().contains("warning") && dev_err.contains("dev"), "a loud --dev warning: {dev_err:?}");

    // SIGTERM and SIGINT: exit status 0; the first stdout line names the real port.
    for signal in [15, 2] {
        let mut server = Server::start(&[]);
        assert_ne!(server.addr.port(), 0);
        assert!(server.addr.ip().is_loopback());
        assert_eq!(server.get("/healthz").status, 200);
        server.signal(signal);
        let status = wait_with_timeout(&mut server.child, Duration::from_secs(15));
        assert_eq!(status.and_then(|s| s.code()), Some(0), "exit status after signal {signal}");
    }

    // The secret from the environment; the first line verbatim.
    let mut child = payonce()
        .args(["serve", "--db", &db_path, "--listen", "127.0.0.1:0"])
        .env("PAYONCE_CALLBACK_SECRET", SECRET)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    stdout.read_line(&mut line).expect("first line");
    let port = line.strip_prefix("listening on http://127.0.0.1:").map(|p| p.trim_end_matches('\n'));
    let port: u16 = port.and_then(|p| p.parse().ok()).unwrap_or_else(|| panic!("first line {line:?}"));
    assert_ne!(port, 0);
    let addr = format!("127.0.0.1:{port}").parse().expect("addr");
    let body = json!({"order_no": "ENV-1", "user_id": "u1", "amount": 100}).to_string();
    let created = util::request(addr, "POST", "/v1/orders", &[("Content-Type", "application/json")], body.as_bytes());
    assert_eq!(created.status, 201);
    let cb = json!({"pay_no": "ENV-P", "order_no": "ENV-1", "amount": 100, "status": "SUCCESS"}).to_string();
    let sig = util::sign_now(SECRET, cb.as_bytes());
    let paid = util::request(
        addr,
        "POST",
        "/v1/callbacks/generic",
        &[("Content-Type", "application/json"), ("Payonce-Signature", &sig)],
        cb.as_bytes(),
    );
    assert_eq!(paid.status, 200, "{}", paid.text());
    assert_eq!(paid.json()["outcome"], "applied");
    let _ = std::process::Command::new("kill").args(["-15", &child.id().to_string()]).status();
    assert_eq!(wait_with_timeout(&mut child, Duration::from_secs(15)).and_then(|s| s.code()), Some(0));
    let mut rest = String::new();
    let _ = stdout.read_to_string(&mut rest);
}

fn wait_with_timeout(child: &mut std::process::Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

/// Every `/v1` answer — a route's, an error, a replay, a callback's, one the
/// HTTP edge refuses before a worker sees it, and an unknown path's — tells
/// browsers and proxies not to keep it and not to sniff it: an operator's
/// browser would otherwise keep payment data in its disk cache.
#[test]
fn every_v1_answer_is_no_store_and_nosniff() {
    let server = Server::start(&["--api-token", "admin:tok-admin"]);
    let auth = ("Authorization", "Bearer tok-admin");
    let json = ("Content-Type", "application/json");
    let body = br#"{"order_no":"ORD-HDR","user_id":"u1","amount":100}"#;
    let keyed = [auth, json, ("Idempotency-Key", "hdr-1")];
    let pay = Pay { pay_no: "PAY-HDR", order_no: "ORD-HDR", amount: 100, status: "SUCCESS" };
    let answers: Vec<(&str, HttpResponse)> = vec![
        ("created", util::request(server.addr, "POST", "/v1/orders", &keyed, body)),
        ("replayed", util::request(server.addr, "POST", "/v1/orders", &keyed, body)),
        ("read", util::request(server.addr, "GET", "/v1/orders/ORD-HDR", &[auth], b"")),
        ("list", util::request(server.addr, "GET", "/v1/orders?limit=1", &[auth], b"")),
        ("inspection", util::request(server.addr, "GET", "/v1/inspections", &[auth], b"")),
        ("not found", util::request(server.addr, "GET", "/v1/orders/NO-SUCH", &[auth], b"")),
        ("no token", util::request(server.addr, "GET", "/v1/orders/ORD-HDR", &[], b"")),
        ("unknown path", util::request(server.addr, "GET", "/v1/nothing-here", &[auth], b"")),
        ("callback", pay.send(&server)),
    ];
    let mut answers = answers;
    let declared_too_large = b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok-admin\r\n\
        Content-Type: application/json\r\nContent-Length: 107374182400\r\n\r\n";
    let refused = util::parse_response(&util::raw(server.addr, declared_too_large)).expect("an answer");
    answers.push(("too large at the edge", refused));
    for (what, answer) in &answers {
        assert_eq!(answer.header("Cache-Control"), Some("no-store"), "{what}: {} {:?}", answer.status, answer.headers);
        assert_eq!(answer.header("X-Content-Type-Options"), Some("nosniff"), "{what}: {:?}", answer.headers);
    }
    let statuses: Vec<u16> = answers.iter().map(|(_, a)| a.status).collect();
    assert_eq!(statuses, [201, 201, 200, 200, 200, 404, 401, 404, 200, 413], "each case is the answer it names");
    assert_eq!(answers[1].1.header("Idempotent-Replayed"), Some("true"));
}
