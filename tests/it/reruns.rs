//! A write body may run twice: PostgreSQL re-runs it after a serialization
//! failure or a deadlock, on a new transaction (src/store/mod.rs). Nothing
//! of the rolled-back run may show — not in the answer, not in the answer
//! stored under the Idempotency-Key, not in the rows, not in `/metrics`.
//!
//! One script of every keyed write (and the callbacks) runs on two fresh
//! databases of the same engine: on one, every write body runs twice
//! (`Store::rerun_next_writes`: a real `40001` from PostgreSQL, a rehearsal
//! rolled back to a savepoint on SQLite); on the other, once. The two must
//! be indistinguishable through the API.

use crate::engines::Db;
use crate::util::{Pay, SECRET};
use payonce::api::{self, Request};
use payonce::relay::Relay;
use payonce::webhook::WebhookConfig;
use payonce::{App, Clock, Config, Rewards};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::sync::Arc;

const T0_MS: i64 = 1_700_000_000_000;
const USER: &str = "u-rerun";
/// Never called: the relay does not run here, only its endpoint is registered.
const ENDPOINT: &str = "http://127.0.0.1:9/hook";

fn open(db: &Db) -> Arc<App> {
    let config = Config {
        rewards: Rewards { coupon_templates: vec!["NEW10".into()], points_per_yuan: 1 },
        platforms: payonce::platforms::Platforms::with([payonce::platforms::Platform::notices(
            payonce::platforms::generic::Generic::new(vec![SECRET.as_bytes().to_vec()]),
        )]),
        webhooks: WebhookConfig {
            endpoints: vec![ENDPOINT.into()],
            secrets: payonce::held::Held::new(vec![b"rerun-webhook-secret".to_vec()]),
            ..WebhookConfig::default()
        },
        ..Config::default()
    };
    let app = Arc::new(App::open(&db.spec, Clock::manual(T0_MS), config).expect("open app"));
    Relay::new(Arc::clone(&app)).expect("register the webhook endpoint");
    app
}

/// One request of the script.
struct Step {
    method: &'static str,
    target: String,
    body: Value,
    /// `Some(key)`: sent with this Idempotency-Key (and replayed once).
    key: Option<String>,
    /// A callback: signed with the generic channel's secret.
    signed: bool,
}

fn keyed(method: &'static str, target: impl Into<String>, body: Value) -> Step {
    let target = target.into();
    let key = format!("rerun-{}-{}", method, target.replace(['/', '?', '=', '&'], "_"));
    Step { method, target, body, key: Some(key), signed: false }
}

fn callback(target: &str, body: Value) -> Step {
    Step { method: "POST", target: target.into(), body, key: None, signed: true }
}

fn pay(pay_no: &str, order_no: &str, amount: i64) -> Step {
    callback("/v1/callbacks/generic", Pay { pay_no, order_no, amount, status: "SUCCESS" }.body())
}

fn create(order_no: &str, amount: i64) -> Step {
    keyed("POST", "/v1/orders", json!({"order_no": order_no, "user_id": USER, "amount": amount}))
}

/// Every keyed route at least once, and the callbacks, in an order where
/// each finds what it needs: applied, duplicate and refused answers alike.
fn script() -> Vec<Step> {
    let statement = format!("pay_no,order_no,amount,status,paid_at\nRRP-D,RR-D,700,SUCCESS,{}\n", iso(T0_MS));
    vec![
        create("RR-A", 1000),
        create("RR-B", 1000),
        create("RR-C", 500),
        create("RR-D", 700),
        create("RR-E", 300),
        pay("RRP-A", "RR-A", 1000),
        pay("RRP-A", "RR-A", 1000),
        pay("RRP-A2", "RR-A", 1000),
        keyed("POST", "/v1/orders/RR-B/close", json!({})),
        // No platform here: the refusal (404 channel_not_configured) is the answer stored once.
        keyed("POST", "/v1/orders/RR-C/pay", json!({"channel": "wechatpay", "method": "native"})),
        keyed("POST", "/v1/orders/RR-A/refunds", json!({"refund_no": "RF-A0", "amount": 100, "reason": "part"})),
        callback(
            "/v1/callbacks/generic/refund",
            json!({"refund_no": "RF-A0", "order_no": "RR-A", "status": "SUCCESS", "amount": 100}),
        ),
        keyed("POST", "/v1/orders/RR-A/refund", json!({"refund_no": "RF-A"})),
        callback("/v1/callbacks/generic/refund", json!({"refund_no": "RF-A", "order_no": "RR-A", "status": "SUCCESS"})),
        keyed("PUT", "/v1/admin/mode", json!({"mode": "record_only"})),
        pay("RRP-C", "RR-C", 500),
        pay("RRP-E", "RR-E", 300),
        keyed("POST", "/v1/admin/drain", json!({})),
        keyed("PUT", "/v1/admin/mode", json!({"mode": "normal"})),
        // No platform here: the refusal (404 channel_not_configured) is the answer stored once.
        keyed("POST", "/v1/admin/payments/RRP-A2/refund", json!({"reason": "rerun"})),
        keyed("POST", "/v1/admin/payments/RRP-A2/resolve", json!({"resolution": "accepted", "reason": "rerun"})),
        keyed("POST", "/v1/admin/refunds/RF-A/resolve", json!({"resolution": "accepted", "reason": "rerun"})),
        keyed("POST", "/v1/admin/orders/RR-D/resolve-close", json!({"reason": "rerun"})),
        keyed(
            "POST",
            "/v1/compensations",
            json!({"order_no": "RR-C", "action": "freeze_coupon", "coupon_template_id": "NEW10", "reason": "rerun"}),
        ),
        Step {
            body: Value::String(statement),
            ..keyed("POST", "/v1/reconciliations?format=generic&repair=true", json!(null))
        },
        keyed("POST", "/v1/webhooks/endpoints/enable", json!({"endpoint": ENDPOINT})),
        keyed("POST", "/v1/webhooks/replay", json!({"endpoint": ENDPOINT, "after_seq": 0})),
        // The delivery's id is each database's own: a PostgreSQL sequence
        // keeps the values a rolled-back run drew.
        keyed("POST", "/v1/webhooks/deliveries/{first_delivery}/retry", json!({})),
    ]
}

fn iso(ms: i64) -> String {
    payonce::clock::format_ms(ms)
}

/// (status, Idempotent-Replayed, body) of `step` on `app`.
fn send(app: &App, step: &Step) -> (u16, bool, Value) {
    let delivery = first_delivery(app);
    let target = step.target.replace("{first_delivery}", &delivery);
    let (path, query) = target.split_once('?').unwrap_or((&target, ""));
    let (content_type, body) = match &step.body {
        Value::String(csv) => ("text/csv", csv.clone().into_bytes()),
        other => ("application/json", other.to_string().into_bytes()),
    };
    let mut headers = vec![("Content-Type".to_owned(), content_type.to_owned())];
    if let Some(key) = &step.key {
        headers.push(("Idempotency-Key".to_owned(), key.clone()));
    }
    if step.signed {
        let signature = payonce::signature::sign(SECRET.as_bytes(), T0_MS.div_euclid(1000), &body);
        headers.push(("Payonce-Signature".to_owned(), signature));
    }
    let req = Request { method: step.method.into(), path: path.into(), query: query.into(), headers, body };
    let resp = api::handle(app, &req);
    let replayed = resp.header("Idempotent-Replayed") == Some("true");
    // The delivery's id, which each database draws itself, as the script names it.
    let text =
        String::from_utf8_lossy(&resp.body).replace(&format!("delivery {delivery} "), "delivery {first_delivery} ");
    (resp.status, replayed, serde_json::from_str(&text).unwrap_or(Value::Null))
}

fn get(app: &App, target: &str) -> Value {
    let step = Step { method: "GET", target: target.into(), body: Value::Null, key: None, signed: false };
    let (path, query) = step.target.split_once('?').unwrap_or((&step.target, ""));
    let req =
        Request { method: "GET".into(), path: path.into(), query: query.into(), headers: Vec::new(), body: Vec::new() };
    let resp = api::handle(app, &req);
    assert_eq!(resp.status, 200, "GET {target}: {}", String::from_utf8_lossy(&resp.body));
    serde_json::from_slice(&resp.body).expect("JSON")
}

fn first_delivery(app: &App) -> String {
    get(app, "/v1/webhooks/deliveries?limit=1")["deliveries"][0]["id"].to_string()
}

/// The counters of `/metrics` (no durations, no gauges of the moment), by line.
fn counters(app: &App) -> Vec<String> {
    let req = Request {
        method: "GET".into(),
        path: "/metrics".into(),
        query: String::new(),
        headers: Vec::new(),
        body: Vec::new(),
    };
    let text = String::from_utf8(api::handle(app, &req).body).expect("metrics text");
    text.lines()
        .filter(|l| l.starts_with("payonce_") && l.contains("_total"))
        .filter(|l| !l.contains("_seconds") && !l.contains("http_requests"))
        .map(str::to_owned)
        .collect()
}

/// What the API shows of everything the script touched.
fn everything(app: &App) -> Value {
    let orders: Vec<Value> =
        ["RR-A", "RR-B", "RR-C", "RR-D", "RR-E"].iter().map(|o| get(app, &format!("/v1/orders/{o}"))).collect();
    without_drawn_numbers(json!({
        "orders": orders,
        "events": get(app, "/v1/events?after=0&limit=1000"),
        "deliveries": get(app, "/v1/webhooks/deliveries?limit=1000"),
        "mode": get(app, "/v1/admin/mode"),
        "inspections": get(app, "/v1/inspections"),
        "stats": get(app, "/v1/admin/stats?window=24h"),
        "coupons": get(app, &format!("/v1/users/{USER}/coupons")),
        "points": get(app, &format!("/v1/users/{USER}/points")),
    }))
}

/// `value` without the numbers each database draws itself: row ids and
/// event sequence numbers (a PostgreSQL sequence keeps the values a
/// rolled-back run drew; their order is what the feed promises, and arrays
/// keep it).
fn without_drawn_numbers(value: Value) -> Value {
    const DRAWN: [&str; 4] = ["id", "seq", "event_seq", "next_after"];
    match value {
        Value::Object(map) => Value::Object(
            map.into_iter()
                .filter(|(k, _)| !DRAWN.contains(&k.as_str()))
                .map(|(k, v)| (k, without_drawn_numbers(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.into_iter().map(without_drawn_numbers).collect()),
        other => other,
    }
}

for_each_engine! {
    /// Every keyed write and every callback, its body run twice on one
    /// database and once on the other: the same answers, the same stored
    /// answers (replayed with `Idempotent-Replayed: true`), the same rows,
    /// the same counters.
    fn every_write_whose_body_runs_twice_answers_stores_and_counts_as_once(db) {
        let twin = db.twin("reruns_once");
        let (twice, once) = (open(db), open(&twin));
        // PostgreSQL: two real serialization failures, the body's third run commits.
        let reruns = if db.label() == "postgres" { 2 } else { 1 };
        let mut covered = BTreeSet::new();
        for (n, mut step) in script().into_iter().enumerate() {
            if let Some(key) = &mut step.key {
                *key = format!("{key}-{n}");
            }
            twice.store().rerun_next_writes(reruns);
            let answered_twice = send(&twice, &step);
            twice.store().rerun_next_writes(0);
            let answered_once = send(&once, &step);
            let what = format!("{}: {} {}", db.label(), step.method, step.target);
            let reached_the_work = !matches!(answered_once.0, 400 | 401 | 415 | 422) && answered_once.0 < 500;
            assert!(reached_the_work, "{what}: the script's own request is refused before its work: {answered_once:?}");
            assert_eq!(answered_twice, answered_once, "{what}: a body run twice answers as one run");
            if step.key.is_some() {
                for app in [&twice, &once] {
                    let (status, replayed, body) = send(app, &step);
                    assert_eq!((status, replayed, &body), (answered_once.0, true, &answered_once.2), "{what}: replayed");
                }
                let (path, _) = step.target.split_once('?').unwrap_or((&step.target, ""));
                covered.insert((step.method, template_of(path)));
            }
        }
        assert_eq!(everything(&twice), everything(&once), "{}: the same rows through the API", db.label());
        assert_eq!(counters(&twice), counters(&once), "{}: the same counters", db.label());
        let keyed_routes: BTreeSet<(&str, &str)> =
            api::routes().filter(|r| r.keyed).map(|r| (r.method, r.template)).collect();
        let missing: Vec<_> = keyed_routes.difference(&covered).collect();
        assert!(missing.is_empty(), "keyed routes the script never re-runs: {missing:?}");
    }
}

/// The route template a concrete path was routed by.
fn template_of(path: &str) -> &'static str {
    api::routes()
        .filter(|r| r.keyed)
        .find(|r| {
            let (t, p): (Vec<&str>, Vec<&str>) = (r.template.split('/').collect(), path.split('/').collect());
            t.len() == p.len() && t.iter().zip(&p).all(|(t, p)| t.starts_with('{') || t == p)
        })
        .map_or("?", |r| r.template)
}
