//! Operator tools of docs/operations.md: the admin and service endpoints,
//! the `inspect` and `backup` commands, and the database's side: record-only
//! mode and drain (including a SIGKILL in the middle of a drain), the mode
//! shared by every process on a file, inspection with every finding kind
//! produced by editing a copy of the database (the independent witness),
//! resolutions, compensation, `/metrics` checked with a strict Prometheus
//! text parser, an online backup taken during a callback storm, and expiry
//! by the background sweeper over HTTP.
//!
//! In-process cases run through `payonce::api::handle` on an `App` with a
//! manual clock; black-box cases run the real binary on a file database and
//! read it back through a read-only connection with the contract's names.

use crate::util::{self, count, footprint, payonce_cli, read_only, HttpResponse, Pay, Server, TempDir, SECRET};
use payonce::api::{self, Request};
use payonce::{App, Clock, Config, Rewards};
use rusqlite::Connection;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// A sample's labels, without `le`.
type Labels = Vec<(String, String)>;
/// A histogram's (le, count) buckets, its _sum and its _count.
type HistogramParts = (Vec<(f64, f64)>, Option<f64>, Option<f64>);

const T0_MS: i64 = 1_700_000_000_000;
const REWARDS: [&str; 4] = ["--coupon", "NEW10", "--points-per-yuan", "1"];
const USER: &str = "u-ops";

// ---- in-process helpers ----

fn config() -> Config {
    Config {
        rewards: Rewards { coupon_templates: vec!["NEW10".into()], points_per_yuan: 1 },
        platforms: payonce::platforms::Platforms::with([payonce::platforms::Platform::notices(
            payonce::platforms::generic::Generic::new(vec![SECRET.as_bytes().to_vec()]),
        )]),
        ..Config::default()
    }
}

fn app_on(db: &str) -> App {
    App::open(db, Clock::manual(T0_MS), config()).expect("open app")
}

fn handle(app: &App, method: &str, target: &str, headers: Vec<(String, String)>, body: Vec<u8>) -> (u16, Value) {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let req = Request { method: method.into(), path: path.into(), query: query.into(), headers, body };
    let resp = api::handle(app, &req);
    let value = if resp.body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&resp.body)
            .unwrap_or_else(|e| panic!("{method} {target}: not JSON ({e}): {}", String::from_utf8_lossy(&resp.body)))
    };
    (resp.status, value)
}

/// An API request in process; `body` is sent as application/json.
fn call(app: &App, method: &str, target: &str, body: Option<&Value>) -> (u16, Value) {
    match body {
        Some(v) => handle(
            app,
            method,
            target,
            vec![("Content-Type".into(), "application/json".into())],
            v.to_string().into_bytes(),
        ),
        None => handle(app, method, target, Vec::new(), Vec::new()),
    }
}

/// A generic-channel callback signed at the app's (manual) clock.
fn deliver(app: &App, path: &str, body: &Value) -> (u16, Value) {
    let bytes = body.to_string().into_bytes();
    let signature = payonce::signature::sign(SECRET.as_bytes(), app.clock().now_ms().div_euclid(1000), &bytes);
    let headers = vec![("Content-Type".into(), "application/json".into()), ("Payonce-Signature".into(), signature)];
    handle(app, "POST", path, headers, bytes)
}

fn create(app: &App, order_no: &str, amount: i64) {
    let (status, body) =
        call(app, "POST", "/v1/orders", Some(&json!({"order_no": order_no, "user_id": USER, "amount": amount})));
    assert_eq!(status, 201, "create {order_no}: {body}");
}

/// A payment through the API in process, answered 200.
fn pay(app: &App, pay: Pay) -> Value {
    let (status, body) = deliver(app, "/v1/callbacks/generic", &pay.body());
    assert_eq!(status, 200, "pay {}: {body}", pay.pay_no);
    body
}

fn refund_callback(app: &App, refund_no: &str, order_no: &str, status: &str) -> Value {
    let (code, body) = deliver(
        app,
        "/v1/callbacks/generic/refund",
        &json!({"refund_no": refund_no, "order_no": order_no, "status": status}),
    );
    assert_eq!(code, 200, "refund callback {refund_no}: {body}");
    body
}

fn set_mode(app: &App, mode: &str) {
    let (status, body) = call(app, "PUT", "/v1/admin/mode", Some(&json!({"mode": mode})));
    assert_eq!((status, body), (200, json!({"mode": mode})));
}

fn inspections(app: &App) -> Value {
    let (status, body) = call(app, "GET", "/v1/inspections", None);
    assert_eq!(status, 200, "{body}");
    body
}

/// (kind, order_no) of every finding, checking the finding shape on the way.
fn findings(report: &Value) -> Vec<(String, String)> {
    let list = report["findings"].as_array().unwrap_or_else(|| panic!("no findings array: {report}"));
    assert_eq!(report["ok"], json!(list.is_empty()), "ok is true exactly when there are no findings: {report}");
    list.iter()
        .map(|f| {
            let keys: BTreeSet<&str> = f.as_object().expect("finding object").keys().map(String::as_str).collect();
            assert_eq!(keys, BTreeSet::from(["kind", "order_no", "detail"]), "finding shape: {f}");
            (f["kind"].as_str().unwrap_or_default().to_owned(), f["order_no"].as_str().unwrap_or_default().to_owned())
        })
        .collect()
}

const LEDGER: [&str; 8] =
    ["orders", "pay_callback_log", "refund", "user_coupon", "point_log", "outbox_event", "audit_log", "settings"];

// ---- black-box helpers ----

fn put_mode_http(server: &Server, body: &[u8]) -> HttpResponse {
    util::request(server.addr, "PUT", "/v1/admin/mode", &[("Content-Type", "application/json")], body)
}

fn create_http(server: &Server, order_no: &str, amount: i64) {
    let resp = server.post_json("/v1/orders", &json!({"order_no": order_no, "user_id": USER, "amount": amount}));
    assert_eq!(resp.status, 201, "create {order_no}: {}", resp.text());
}

fn order_http(server: &Server, order_no: &str) -> Value {
    let resp = server.get(&format!("/v1/orders/{order_no}"));
    assert_eq!(resp.status, 200, "{order_no}: {}", resp.text());
    resp.json()
}

fn event_ids_http(server: &Server) -> Vec<String> {
    let resp = server.get("/v1/events?after=0&limit=1000");
    assert_eq!(resp.status, 200, "{}", resp.text());
    resp.json()["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| e["event_id"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// `payonce inspect --db PATH`: (exit code, the JSON it printed).
fn inspect_cli(db: &Path) -> (Option<i32>, Value) {
    let (code, stdout, stderr) = payonce_cli(&["inspect", "--db", &db.display().to_string()]);
    let report = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("inspect printed no JSON ({e}); stdout {stdout:?}, stderr {stderr:?}"));
    (code, report)
}

/// Runs `f` over `items` on `threads` threads; results in item order.
fn parallel<T: Sync, R: Send>(threads: usize, items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let next = AtomicUsize::new(0);
    let results = Mutex::new(Vec::with_capacity(items.len()));
    thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(item) = items.get(i) else { break };
                let r = f(item);
                results.lock().expect("results").push((i, r));
            });
        }
    });
    let mut results = results.into_inner().expect("results");
    results.sort_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, r)| r).collect()
}

/// Polls `done` until it holds or `limit` passes; false on timeout.
fn wait_for(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if done() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(50));
    }
}

// ---- mode ----

for_each_engine! {
/// The mode lives in the database: every process on it obeys it, across restarts.
fn mode_shapes_validation_and_one_mode_for_every_process_across_restarts(db) {
    let mut a = db.serve(&[]);

    let resp = a.get("/v1/admin/mode");
    assert_eq!((resp.status, resp.json()), (200, json!({"mode": "normal"})), "a new database is normal");

    let invalid: [(&str, &[u8], &str); 7] = [
        ("unknown mode", br#"{"mode":"degraded"}"#, "invalid_request"),
        ("wrong case", br#"{"mode":"RECORD_ONLY"}"#, "invalid_request"),
        ("empty", br#"{"mode":""}"#, "invalid_request"),
        ("not a string", br#"{"mode":1}"#, "invalid_request"),
        ("null", br#"{"mode":null}"#, "invalid_request"),
        ("missing", b"{}", "invalid_request"),
        ("not JSON", b"record_only", "invalid_json"),
    ];
    for (case, body, code) in invalid {
        let resp = put_mode_http(&a, body);
        assert_eq!(resp.status, 400, "{case}: {}", resp.text());
        assert_eq!(resp.error_code(), code, "{case}");
        let mode = a.get("/v1/admin/mode").json();
        assert_eq!(mode, json!({"mode": "normal"}), "{case}: a refused PUT changes nothing");
    }

    for _ in 0..2 {
        let resp = put_mode_http(&a, br#"{"mode":"record_only"}"#);
        assert_eq!((resp.status, resp.json()), (200, json!({"mode": "record_only"})), "PUT (and its repeat)");
    }
    assert_eq!(a.get("/v1/admin/mode").json(), json!({"mode": "record_only"}));
    create_http(&a, "MODE-A", 100);
    let resp = Pay { pay_no: "MODE-PA", order_no: "MODE-A", amount: 100, status: "SUCCESS" }.send(&a);
    assert_eq!((resp.status, resp.json()), (200, json!({"code": "SUCCESS", "outcome": "recorded"})));

    // A second process on the same file obeys the mode it finds there.
    let b = db.serve(&["--sweep-interval-s", "3600"]);
    assert_eq!(b.get("/v1/admin/mode").json(), json!({"mode": "record_only"}), "second process");
    create_http(&b, "MODE-B", 100);
    let resp = Pay { pay_no: "MODE-PB", order_no: "MODE-B", amount: 100, status: "SUCCESS" }.send(&b);
    assert_eq!(resp.json(), json!({"code": "SUCCESS", "outcome": "recorded"}), "second process records");

    // The mode survives a SIGKILL and a restart.
    a.kill();
    let c = db.serve(&["--sweep-interval-s", "3600"]);
    assert_eq!(c.get("/v1/admin/mode").json(), json!({"mode": "record_only"}), "after a restart");

    // Switched by one process, obeyed at once by the other.
    let resp = put_mode_http(&b, br#"{"mode":"normal"}"#);
    assert_eq!((resp.status, resp.json()), (200, json!({"mode": "normal"})));
    assert_eq!(c.get("/v1/admin/mode").json(), json!({"mode": "normal"}));
    create_http(&c, "MODE-C", 100);
    let resp = Pay { pay_no: "MODE-PC", order_no: "MODE-C", amount: 100, status: "SUCCESS" }.send(&c);
    assert_eq!(resp.json(), json!({"code": "SUCCESS", "outcome": "applied"}), "normal again, set by another process");

    let resp = put_mode_http(&c, br#"{"mode":"record_only"}"#);
    assert_eq!(resp.status, 200);
    create_http(&b, "MODE-D", 100);
    let resp = Pay { pay_no: "MODE-PD", order_no: "MODE-D", amount: 100, status: "SUCCESS" }.send(&b);
    assert_eq!(resp.json(), json!({"code": "SUCCESS", "outcome": "recorded"}), "record-only set by another process");

    let store = db.store();
    let stored = db.count(&store, "SELECT count(*) FROM settings WHERE name = 'mode' AND value = 'record_only'");
    assert_eq!(stored, 1, "the mode lives in the settings table");
}
}

// ---- record-only and drain ----

#[test]
fn record_only_records_then_the_worker_decides_in_arrival_order_exactly_once() {
    let server = Server::start(&["--sweep-interval-s", "1", "--coupon", "NEW10", "--points-per-yuan", "1"]);
    let db = server.db.clone();
    let orders = [("RO-1", 1001), ("RO-2", 1002), ("RO-3", 1003), ("RO-X", 500), ("RO-M", 700), ("RO-F", 800)];
    for (order_no, amount) in orders {
        create_http(&server, order_no, amount);
    }
    let resp = put_mode_http(&server, br#"{"mode":"record_only"}"#);
    assert_eq!(resp.status, 200);

    // Arrival order; RO-X is paid twice (two pay_nos), RO-M with the wrong amount, RO-F fails.
    let deliveries = [
        ("ROP-X1", "RO-X", 500, "SUCCESS"),
        ("ROP-1", "RO-1", 1001, "SUCCESS"),
        ("ROP-M", "RO-M", 701, "SUCCESS"),
        ("ROP-X2", "RO-X", 500, "SUCCESS"),
        ("ROP-2", "RO-2", 1002, "SUCCESS"),
        ("ROP-F", "RO-F", 800, "FAILED"),
        ("ROP-3", "RO-3", 1003, "SUCCESS"),
    ];
    for (pay_no, order_no, amount, status) in deliveries {
        let resp = Pay { pay_no, order_no, amount, status }.send(&server);
        assert_eq!(resp.status, 200, "{pay_no}: {}", resp.text());
        assert_eq!(resp.json(), json!({"code": "SUCCESS", "outcome": "recorded"}), "{pay_no}");
    }
    for (pay_no, order_no, amount, status) in [deliveries[1], deliveries[3]] {
        let resp = Pay { pay_no, order_no, amount, status }.send(&server);
        assert_eq!(
            resp.json(),
            json!({"code": "SUCCESS", "outcome": "duplicate", "original": "recorded"}),
            "re-delivery of recorded {pay_no}"
        );
    }
    let resp = Pay { pay_no: "ROP-404", order_no: "RO-NOPE", amount: 100, status: "SUCCESS" }.send(&server);
    assert_eq!((resp.status, resp.error_code()), (404, "order_not_found".to_owned()), "unknown order in record-only");

    let check_waiting = |context: &str| {
        let conn = read_only(&db);
        assert_eq!(count(&conn, "SELECT count(*) FROM pay_callback_log", []), 7, "{context}");
        assert_eq!(
            count(&conn, "SELECT count(*) FROM pay_callback_log WHERE state = 'received' AND outcome = 'recorded'", []),
            7,
            "{context}: every record waits, received"
        );
        assert_eq!(count(&conn, "SELECT count(*) FROM user_coupon", []), 0, "{context}: no coupon");
        assert_eq!(count(&conn, "SELECT count(*) FROM point_log", []), 0, "{context}: no points");
        assert_eq!(count(&conn, "SELECT count(*) FROM outbox_event", []), 0, "{context}: no event");
        assert_eq!(count(&conn, "SELECT count(*) FROM orders WHERE status <> 'PENDING'", []), 0, "{context}");
    };
    check_waiting("while record-only");
    for (order_no, _) in orders {
        let order = order_http(&server, order_no);
        assert_eq!(order["status"], "PENDING", "{order_no}");
        assert_eq!(order["coupons"], json!([]), "{order_no}");
        assert_eq!(order["points"], json!([]), "{order_no}");
        for p in order["payments"].as_array().expect("payments") {
            assert_eq!(
                (p["state"].as_str(), p["outcome"].as_str()),
                (Some("received"), Some("recorded")),
                "{order_no}"
            );
        }
    }
    // The worker (every second) leaves them alone while the mode is record-only.
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(2_200) {
        thread::sleep(Duration::from_millis(200));
    }
    check_waiting("after two sweep intervals in record-only");

    let resp = put_mode_http(&server, br#"{"mode":"normal"}"#);
    assert_eq!(resp.status, 200);
    let drained = wait_for(Duration::from_secs(15), || {
        count(&read_only(&db), "SELECT count(*) FROM pay_callback_log WHERE state = 'received'", []) == 0
    });
    assert!(drained, "the background worker decides the waiting records once the mode is normal");

    let conn = read_only(&db);
    let mut stmt =
        conn.prepare("SELECT pay_no, outcome, state, decided_at FROM pay_callback_log ORDER BY id").expect("prepare");
    let rows: Vec<(String, String, String, String)> = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    let outcomes: Vec<(&str, &str)> = rows.iter().map(|r| (r.0.as_str(), r.1.as_str())).collect();
    assert_eq!(
        outcomes,
        [
            ("ROP-X1", "applied"),
            ("ROP-1", "applied"),
            ("ROP-M", "amount_mismatch"),
            ("ROP-X2", "already_paid"),
            ("ROP-2", "applied"),
            ("ROP-F", "payment_failed"),
            ("ROP-3", "applied"),
        ],
        "decided in arrival order: the first pay_no of RO-X wins"
    );
    assert!(rows.iter().all(|r| r.2 == "decided"));
    let decided_at: Vec<&str> = rows.iter().map(|r| r.3.as_str()).collect();
    let mut sorted = decided_at.clone();
    sorted.sort();
    assert_eq!(decided_at, sorted, "decided_at follows arrival order");

    for (order_no, pay_no) in [("RO-1", "ROP-1"), ("RO-2", "ROP-2"), ("RO-3", "ROP-3"), ("RO-X", "ROP-X1")] {
        let order = order_http(&server, order_no);
        assert_eq!((order["status"].as_str(), order["pay_no"].as_str()), (Some("PAID"), Some(pay_no)), "{order_no}");
        assert_eq!(order["coupons"].as_array().map(Vec::len), Some(1), "{order_no}: one coupon");
        assert_eq!(order["points"].as_array().map(Vec::len), Some(1), "{order_no}: one points entry");
    }
    for order_no in ["RO-M", "RO-F"] {
        let order = order_http(&server, order_no);
        assert_eq!(order["status"], "PENDING", "{order_no}");
        assert_eq!((order["coupons"].clone(), order["points"].clone()), (json!([]), json!([])), "{order_no}");
    }
    let mut events = event_ids_http(&server);
    events.sort();
    assert_eq!(
        events,
        [
            "order.paid:RO-1",
            "order.paid:RO-2",
            "order.paid:RO-3",
            "order.paid:RO-X",
            "payment.refund_required:ROP-M",
            "payment.refund_required:ROP-X2",
        ]
    );
    for (pay_no, order_no, amount, original) in
        [("ROP-1", "RO-1", 1001, "applied"), ("ROP-X2", "RO-X", 500, "already_paid")]
    {
        let resp = Pay { pay_no, order_no, amount, status: "SUCCESS" }.send(&server);
        assert_eq!(resp.json(), json!({"code": "SUCCESS", "outcome": "duplicate", "original": original}), "{pay_no}");
    }
    assert_eq!(count(&conn, "SELECT count(*) FROM user_coupon", []), 4);
    assert_eq!(count(&conn, "SELECT count(*) FROM point_log", []), 4);
}

#[test]
fn drain_decides_now_whatever_the_mode() {
    let app = app_on(":memory:");
    for order_no in ["DR-1", "DR-2", "DR-3"] {
        create(&app, order_no, 300);
    }
    set_mode(&app, "record_only");
    assert_eq!(
        pay(&app, Pay { pay_no: "DRP-1", order_no: "DR-1", amount: 300, status: "SUCCESS" }),
        json!({"code": "SUCCESS", "outcome": "recorded"})
    );
    assert_eq!(
        pay(&app, Pay { pay_no: "DRP-2", order_no: "DR-2", amount: 300, status: "SUCCESS" }),
        json!({"code": "SUCCESS", "outcome": "recorded"})
    );

    // In record-only mode.
    assert_eq!(call(&app, "POST", "/v1/admin/drain", None), (200, json!({"applied": 2})));
    assert_eq!(
        call(&app, "GET", "/v1/admin/mode", None),
        (200, json!({"mode": "record_only"})),
        "drain keeps the mode"
    );
    for order_no in ["DR-1", "DR-2"] {
        assert_eq!(app.orders().order(order_no).expect("order").order.status.as_str(), "PAID", "{order_no}");
    }
    assert_eq!(call(&app, "POST", "/v1/admin/drain", None), (200, json!({"applied": 0})), "nothing left");

    // Recorded while degraded, then normal with no worker in process: drain decides it.
    assert_eq!(
        pay(&app, Pay { pay_no: "DRP-3", order_no: "DR-3", amount: 300, status: "SUCCESS" }),
        json!({"code": "SUCCESS", "outcome": "recorded"})
    );
    set_mode(&app, "normal");
    assert_eq!(app.orders().order("DR-3").expect("order").order.status.as_str(), "PENDING");
    assert_eq!(call(&app, "POST", "/v1/admin/drain", Some(&json!({}))), (200, json!({"applied": 1})));
    let detail = app.orders().order("DR-3").expect("order");
    assert_eq!(detail.order.status.as_str(), "PAID");
    assert_eq!((detail.coupons.len(), detail.points.len()), (1, 1));
    assert_eq!(
        pay(&app, Pay { pay_no: "DRP-3", order_no: "DR-3", amount: 300, status: "SUCCESS" }),
        json!({"code": "SUCCESS", "outcome": "duplicate", "original": "applied"})
    );
    let ids: Vec<String> = app.orders().events(0, 100).expect("events").into_iter().map(|e| e.event_id).collect();
    assert_eq!(ids, ["order.paid:DR-1", "order.paid:DR-2", "order.paid:DR-3"]);
}

for_each_engine! {
/// A drain SIGKILLed midway, then two processes draining at once on the same database.
fn a_kill_during_drain_loses_nothing_and_applies_nothing_twice(db) {
    const ORDERS: usize = 270;
    const SECOND_PAYMENTS: usize = 30;
    // The worker never drains in record-only mode; only the explicit drains decide.
    let mut server = db.serve(&REWARDS);
    let order_nos: Vec<String> = (0..ORDERS).map(|i| format!("DK-{i:03}")).collect();
    parallel(8, &order_nos, |o| create_http(&server, o, 1000));
    assert_eq!(put_mode_http(&server, br#"{"mode":"record_only"}"#).status, 200);

    let firsts: Vec<(String, String)> = order_nos.iter().map(|o| (format!("{o}-a"), o.clone())).collect();
    let seconds: Vec<(String, String)> =
        order_nos.iter().take(SECOND_PAYMENTS).map(|o| (format!("{o}-b"), o.clone())).collect();
    for batch in [&firsts, &seconds] {
        let answers = parallel(8, batch, |(pay_no, order_no)| {
            Pay { pay_no, order_no, amount: 1000, status: "SUCCESS" }.send(&server)
        });
        for (answer, (pay_no, _)) in answers.iter().zip(batch.iter()) {
            assert_eq!(answer.json(), json!({"code": "SUCCESS", "outcome": "recorded"}), "{pay_no}");
        }
    }
    let total = ORDERS + SECOND_PAYMENTS;
    let watch = db.store();
    let received_sql = "SELECT count(*) FROM pay_callback_log WHERE state = 'received'";
    assert_eq!(db.count(&watch, received_sql) as usize, total);

    let addr = server.addr;
    let drainer = thread::spawn(move || {
        let raw = util::raw(
            addr,
            b"POST /v1/admin/drain HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
        );
        util::parse_response(&raw).map(|r| (r.status, r.body))
    });
    // Kill as soon as the drain has visibly started (bounded).
    let decided_sql = "SELECT count(*) FROM pay_callback_log WHERE state = 'decided'";
    let deadline = Instant::now() + Duration::from_secs(10);
    while db.count(&watch, decided_sql) < 5 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(1));
    }
    server.kill();
    let answered = drainer.join().expect("drain thread");
    let decided_before_restart = db.count(&watch, decided_sql) as usize;
    eprintln!(
        "drain killed after deciding {decided_before_restart} of {total} records (answered: {})",
        answered.is_some()
    );
    if let Some((status, body)) = &answered {
        // The drain finished before the kill: then it decided everything.
        assert_eq!(*status, 200);
        let body: Value = serde_json::from_slice(body).expect("drain JSON");
        assert_eq!(body, json!({"applied": total}));
        assert_eq!(decided_before_restart, total);
    }

    // Restart as two processes on the file, both draining at once.
    let servers = [db.serve(&REWARDS), db.serve(&REWARDS)];
    assert_eq!(servers[0].get("/v1/admin/mode").json(), json!({"mode": "record_only"}), "the mode survived the kill");
    let answers = parallel(2, &servers, |s| s.post_json("/v1/admin/drain", &json!({})));
    let mut applied = 0;
    for resp in &answers {
        assert_eq!(resp.status, 200, "{}", resp.text());
        applied += resp.json()["applied"].as_u64().unwrap_or_else(|| panic!("{}", resp.text())) as usize;
    }
    assert_eq!(applied, total - decided_before_restart, "the rest, and only the rest, between the two processes");
    assert_eq!(servers[1].post_json("/v1/admin/drain", &json!({})).json(), json!({"applied": 0}));

    let conn = db.store();
    let count = |sql: &str| db.count(&conn, sql);
    assert_eq!(count(received_sql), 0, "no record left received");
    assert_eq!(count("SELECT count(*) FROM pay_callback_log") as usize, total, "nothing lost");
    let checks = [
        ("applied payments", "SELECT o.id, count(p.id) AS n FROM orders o LEFT JOIN pay_callback_log p ON p.order_id = o.id AND p.outcome = 'applied' GROUP BY o.id"),
        ("coupons", "SELECT o.id, count(c.id) AS n FROM orders o LEFT JOIN user_coupon c ON c.order_id = o.id GROUP BY o.id"),
        ("points", "SELECT o.id, count(l.id) AS n FROM orders o LEFT JOIN point_log l ON l.order_id = o.id AND l.point_type = 'ORDER_PAID' GROUP BY o.id"),
        ("order.paid events", "SELECT o.id, count(e.seq) AS n FROM orders o LEFT JOIN outbox_event e ON e.order_no = o.order_no AND e.type = 'order.paid' GROUP BY o.id"),
    ];
    for (what, per_order) in checks {
        let not_once = count(&format!("SELECT count(*) FROM ({per_order}) t WHERE t.n <> 1"));
        assert_eq!(not_once, 0, "{}: exactly one of {what} per order", db.label());
    }
    assert_eq!(count("SELECT count(*) FROM orders") as usize, ORDERS);
    assert_eq!(count("SELECT count(*) FROM point_log") as usize, ORDERS);
    assert_eq!(
        count("SELECT count(*) FROM orders WHERE status = 'PAID' AND pay_no = order_no || '-a'") as usize,
        ORDERS,
        "every order paid by its first-arrived payment"
    );
    assert_eq!(
        count("SELECT count(*) FROM pay_callback_log WHERE pay_no LIKE '%-b' AND outcome = 'already_paid'") as usize,
        SECOND_PAYMENTS
    );
    assert_eq!(
        count("SELECT count(*) FROM outbox_event WHERE type = 'payment.refund_required'") as usize,
        SECOND_PAYMENTS
    );
}
}

for_each_engine! {
/// Currency is part of the amount in record-only mode too (docs/channels.md):
/// a recorded notice keeps the currency it named, so the drain decides 9900
/// CNY for a USD order of 9900 `amount_mismatch` with a refund required, as a
/// live notice is, and 9900 USD (or a notice naming none) `applied`. A
/// SUCCESS superseding a recorded FAILED brings its own currency.
fn a_recorded_payment_keeps_its_currency_through_the_drain(db) {
    // No background drain: the explicit one decides, after the mode is normal.
    let server = db.serve(&["--sweep-interval-s", "3600", "--coupon", "NEW10"]);
    let orders = ["CUR-USD-CNY", "CUR-USD-USD", "CUR-USD-NONE", "CUR-USD-SUPERSEDED"];
    for order_no in orders {
        let body = json!({"order_no": order_no, "user_id": USER, "amount": 9900, "currency": "USD"});
        let created = server.post_json("/v1/orders", &body);
        assert_eq!(created.status, 201, "create {order_no}: {}", created.text());
    }
    assert_eq!(put_mode_http(&server, br#"{"mode":"record_only"}"#).status, 200);
    let notices = [
        ("CUR-P-CNY", "CUR-USD-CNY", Some("CNY"), "SUCCESS"),
        ("CUR-P-USD", "CUR-USD-USD", Some("USD"), "SUCCESS"),
        ("CUR-P-NONE", "CUR-USD-NONE", None, "SUCCESS"),
        ("CUR-P-SUPERSEDED", "CUR-USD-SUPERSEDED", Some("USD"), "FAILED"),
        ("CUR-P-SUPERSEDED", "CUR-USD-SUPERSEDED", Some("CNY"), "SUCCESS"),
    ];
    for (pay_no, order_no, currency, status) in notices {
        let mut body = json!({"pay_no": pay_no, "order_no": order_no, "amount": 9900, "status": status});
        if let Some(currency) = currency {
            body["currency"] = json!(currency);
        }
        let resp = server.callback("/v1/callbacks/generic", &body);
        assert_eq!(resp.status, 200, "{pay_no} {status}: {}", resp.text());
        assert_eq!(resp.json()["outcome"], "recorded", "{pay_no} {status}: {}", resp.text());
    }

    assert_eq!(put_mode_http(&server, br#"{"mode":"normal"}"#).status, 200);
    let drained = server.post_json("/v1/admin/drain", &json!({}));
    assert_eq!((drained.status, drained.json()), (200, json!({"applied": 4})), "{}", db.label());

    let decided = |order_no: &str| {
        let order = order_http(&server, order_no);
        (order["status"].as_str().unwrap_or_default().to_owned(), order["payments"][0]["outcome"].clone(), order)
    };
    for order_no in ["CUR-USD-CNY", "CUR-USD-SUPERSEDED"] {
        let (status, outcome, order) = decided(order_no);
        assert_eq!(
            (status.as_str(), outcome),
            ("PENDING", json!("amount_mismatch")),
            "{}: 9900 CNY recorded for a USD order of 9900: {order}",
            db.label()
        );
        assert_eq!(order["coupons"], json!([]), "{}: {order}", db.label());
    }
    for order_no in ["CUR-USD-USD", "CUR-USD-NONE"] {
        let (status, outcome, order) = decided(order_no);
        assert_eq!((status.as_str(), outcome), ("PAID", json!("applied")), "{}: {order}", db.label());
    }
    let events = event_ids_http(&server);
    for expected in [
        "payment.refund_required:CUR-P-CNY",
        "payment.refund_required:CUR-P-SUPERSEDED",
        "order.paid:CUR-USD-USD",
        "order.paid:CUR-USD-NONE",
    ] {
        assert!(events.iter().any(|e| e == expected), "{}: {expected} in {events:?}", db.label());
    }
    assert_eq!(events.len(), 4, "{}: nothing else: {events:?}", db.label());

    // What the rows keep: the currency each notice named, NULL where none was.
    let store = db.store();
    let kept = db.count(
        &store,
        "SELECT count(*) FROM pay_callback_log
         WHERE (pay_no = 'CUR-P-CNY' AND currency = 'CNY') OR (pay_no = 'CUR-P-USD' AND currency = 'USD')
            OR (pay_no = 'CUR-P-NONE' AND currency IS NULL) OR (pay_no = 'CUR-P-SUPERSEDED' AND currency = 'CNY')",
    );
    assert_eq!(kept, 4, "{}", db.label());
}
}

// ---- inspection ----

#[test]
fn inspection_of_a_clean_database_is_ok_over_http_and_cli() {
    let server = Server::start(&REWARDS);
    create_http(&server, "IC-1", 1000);
    assert_eq!(
        Pay { pay_no: "ICP-1", order_no: "IC-1", amount: 1000, status: "SUCCESS" }.send(&server).json()["outcome"],
        "applied"
    );
    assert_eq!(
        Pay { pay_no: "ICP-1", order_no: "IC-1", amount: 1000, status: "SUCCESS" }.send(&server).json()["outcome"],
        "duplicate"
    );
    create_http(&server, "IC-2", 2000);
    assert_eq!(
        Pay { pay_no: "ICP-2", order_no: "IC-2", amount: 2000, status: "SUCCESS" }.send(&server).json()["outcome"],
        "applied"
    );
    let resp = server.post_json("/v1/orders/IC-2/refund", &json!({"refund_no": "ICR-2"}));
    assert_eq!(resp.status, 200, "{}", resp.text());
    let resp = server.callback(
        "/v1/callbacks/generic/refund",
        &json!({"refund_no": "ICR-2", "order_no": "IC-2", "status": "SUCCESS"}),
    );
    assert_eq!(resp.json()["outcome"], "applied");
    create_http(&server, "IC-3", 3000);
    assert_eq!(server.post_json("/v1/orders/IC-3/close", &json!({})).status, 200);
    create_http(&server, "IC-4", 4000);

    let resp = server.get("/v1/inspections");
    assert_eq!((resp.status, resp.json()), (200, json!({"ok": true, "findings": []})));
    let (code, report) = inspect_cli(&server.db);
    assert_eq!(code, Some(0), "inspect exits 0 on a clean database");
    assert_eq!(report, json!({"ok": true, "findings": []}));
}

/// Each kind is produced on its own copy of one clean database by raw SQL
/// (dropping the unique indexes and triggers that would refuse it): the
/// inspection is the witness that does not trust the constraints.
#[test]
fn inspection_finds_each_kind_on_edited_copies() {
    let dir = TempDir::new("inspect-copies");
    let base = dir.path("base.db");
    {
        let app = app_on(&base.display().to_string());
        create(&app, "K-1", 1000);
        assert_eq!(
            pay(&app, Pay { pay_no: "KP-1", order_no: "K-1", amount: 1000, status: "SUCCESS" })["outcome"],
            "applied"
        );
        create(&app, "K-2", 500);
        assert!(app.operations().inspect().expect("inspect").is_empty(), "the base is clean");
    }
    let (code, report) = inspect_cli(&base);
    assert_eq!((code, report), (Some(0), json!({"ok": true, "findings": []})), "the base is clean for the CLI too");

    let cases: [(&str, &str, &str, &str); 8] = [
        (
            "duplicate_coupon",
            "DROP INDEX uk_order_tpl;
             INSERT INTO user_coupon (user_id, order_id, coupon_template_id, status, created_at)
             SELECT user_id, order_id, coupon_template_id, 'ACTIVE', created_at FROM user_coupon;",
            "duplicate_coupon",
            "K-1",
        ),
        (
            "duplicate_points",
            "DROP INDEX uk_order_type;
             INSERT INTO point_log (user_id, order_id, point_type, points, created_at)
             SELECT user_id, order_id, point_type, points, created_at FROM point_log;",
            "duplicate_points",
            "K-1",
        ),
        ("coupon_deleted", "DELETE FROM user_coupon;", "paid_without_rewards", "K-1"),
        ("points_deleted", "DELETE FROM point_log;", "paid_without_rewards", "K-1"),
        (
            "order_back_to_pending",
            "UPDATE orders SET status = 'PENDING', pay_no = NULL, paid_at = NULL WHERE order_no = 'K-1';",
            "applied_callback_order_not_paid",
            "K-1",
        ),
        (
            "already_paid_unresolved",
            "INSERT INTO pay_callback_log (pay_no, channel, order_id, amount, status, outcome, state, source,
                                           raw_body, received_at, decided_at)
             SELECT 'KP-1b', 'generic', id, amount, 'SUCCESS', 'already_paid', 'decided', 'callback', X'7B7D',
                    created_at, created_at FROM orders WHERE order_no = 'K-1';",
            "refund_required",
            "K-1",
        ),
        (
            "paid_after_close_unresolved",
            "UPDATE orders SET status = 'CLOSED', closed_at = created_at WHERE order_no = 'K-2';
             INSERT INTO pay_callback_log (pay_no, channel, order_id, amount, status, outcome, state, source,
                                           raw_body, received_at, decided_at)
             SELECT 'KP-2', 'generic', id, amount, 'SUCCESS', 'paid_after_close', 'decided', 'callback', X'7B7D',
                    created_at, created_at FROM orders WHERE order_no = 'K-2';",
            "refund_required",
            "K-2",
        ),
        (
            "received_long_ago_in_normal_mode",
            "INSERT INTO pay_callback_log (pay_no, channel, order_id, amount, status, outcome, state, source,
                                           raw_body, received_at)
             SELECT 'KP-2', 'generic', id, amount, 'SUCCESS', 'recorded', 'received', 'callback', X'7B7D',
                    '2023-01-01T00:00:00.000Z' FROM orders WHERE order_no = 'K-2';",
            "received_not_applied",
            "K-2",
        ),
    ];
    for (name, sql, kind, order_no) in cases {
        let copy = dir.path(&format!("{name}.db"));
        {
            let source = Connection::open(&base).expect("open base");
            source.execute("VACUUM INTO ?1", [copy.display().to_string()]).expect("copy the database");
            let edit = Connection::open(&copy).expect("open copy");
            // The triggers would refuse the damage (that is their job): drop them on the copy.
            let triggers: Vec<String> = edit
                .prepare("SELECT name FROM sqlite_master WHERE type = 'trigger'")
                .and_then(|mut st| st.query_map([], |r| r.get(0))?.collect())
                .expect("list triggers");
            for trigger in triggers {
                edit.execute_batch(&format!("DROP TRIGGER \"{trigger}\";")).expect("drop trigger");
            }
            edit.execute_batch(sql).unwrap_or_else(|e| panic!("{name}: edit the copy: {e}"));
        }
        let (code, report) = inspect_cli(&copy);
        assert_eq!(code, Some(1), "{name}: inspect exits 1 with findings: {report}");
        let found = findings(&report);
        assert!(!found.is_empty(), "{name}: {report}");
        for (k, o) in &found {
            assert_eq!((k.as_str(), o.as_str()), (kind, order_no), "{name}: only the damage made here: {report}");
        }
        // The same finding in process, through the HTTP route.
        let app = App::open(&copy.display().to_string(), Clock::System, config()).expect("open copy");
        let report = inspections(&app);
        assert!(
            findings(&report).iter().any(|(k, o)| k == kind && o == order_no),
            "{name}: GET /v1/inspections: {report}"
        );
    }
}

/// Findings produced by real operations on a live database (manual clock),
/// seen through GET /v1/inspections and the CLI, and resolved.
#[test]
fn inspection_findings_from_operations_and_their_resolutions() {
    let dir = TempDir::new("inspect-live");
    let db = dir.path("live.db");
    let app = app_on(&db.display().to_string());
    let conn = app.store().raw_connection().expect("raw connection");
    create(&app, "L-1", 1000);
    assert_eq!(
        pay(&app, Pay { pay_no: "LP-1", order_no: "L-1", amount: 1000, status: "SUCCESS" })["outcome"],
        "applied"
    );
    assert_eq!(findings(&inspections(&app)), []);

    // refund_required: a second pay_no for a paid order.
    assert_eq!(
        pay(&app, Pay { pay_no: "LP-1b", order_no: "L-1", amount: 1000, status: "SUCCESS" })["outcome"],
        "already_paid"
    );
    assert_eq!(findings(&inspections(&app)), [("refund_required".to_owned(), "L-1".to_owned())]);
    let (code, report) = inspect_cli(&db);
    assert_eq!(code, Some(1));
    assert_eq!(findings(&report), [("refund_required".to_owned(), "L-1".to_owned())]);

    let audit_rows = |order_no: &str| count(&conn, "SELECT count(*) FROM audit_log WHERE order_no = ?1", [order_no]);
    let before = audit_rows("L-1");
    let resolve = json!({"resolution": "refunded_externally", "reason": "refunded by hand, ticket 42"});
    let (status, first) = call(&app, "POST", "/v1/admin/payments/LP-1b/resolve", Some(&resolve));
    assert_eq!(status, 200, "{first}");
    assert_eq!(audit_rows("L-1"), before + 1, "the resolution is audited");
    app.clock().advance_ms(5_000);
    let other = json!({"resolution": "accepted", "reason": "a second operator"});
    for body in [&resolve, &other] {
        let (status, repeat) = call(&app, "POST", "/v1/admin/payments/LP-1b/resolve", Some(body));
        assert_eq!((status, &repeat), (200, &first), "a repeat answers the first result");
    }
    assert_eq!(audit_rows("L-1"), before + 1, "audited once");
    assert_eq!(findings(&inspections(&app)), [], "resolved: the finding is gone");

    let refusals: [(&str, Value, u16, &str); 5] = [
        ("/v1/admin/payments/LP-1/resolve", resolve.clone(), 409, "invalid_transition"),
        ("/v1/admin/payments/LP-NOPE/resolve", resolve.clone(), 404, "_not_found"),
        ("/v1/admin/payments/LP-1b/resolve", json!({"resolution": "forgotten", "reason": "x"}), 400, "invalid_request"),
        ("/v1/admin/payments/LP-1b/resolve", json!({"resolution": "accepted"}), 400, "invalid_request"),
        ("/v1/admin/refunds/LR-NOPE/resolve", resolve.clone(), 404, "_not_found"),
    ];
    for (path, body, expected, code) in refusals {
        let (status, answer) = call(&app, "POST", path, Some(&body));
        assert_eq!(status, expected, "{path} {body}: {answer}");
        let got = answer["error"]["code"].as_str().unwrap_or_default();
        assert!(got.ends_with(code), "{path}: code {got:?}, expected {code:?}");
    }

    // unexpected_refund: a refund result nobody asked for.
    assert_eq!(refund_callback(&app, "LR-U", "L-1", "SUCCESS")["outcome"], "unexpected_refund");
    assert_eq!(findings(&inspections(&app)), [("unexpected_refund".to_owned(), "L-1".to_owned())]);
    let (code, report) = inspect_cli(&db);
    assert_eq!((code, findings(&report)), (Some(1), vec![("unexpected_refund".to_owned(), "L-1".to_owned())]));
    let before = audit_rows("L-1");
    let (status, first) = call(&app, "POST", "/v1/admin/refunds/LR-U/resolve", Some(&resolve));
    assert_eq!(status, 200, "{first}");
    app.clock().advance_ms(5_000);
    let (status, repeat) = call(&app, "POST", "/v1/admin/refunds/LR-U/resolve", Some(&other));
    assert_eq!((status, repeat), (200, first), "a repeat answers the first result");
    assert_eq!(audit_rows("L-1"), before + 1, "audited once");
    assert_eq!(findings(&inspections(&app)), []);
    // A refund that settled as asked is not unexpected.
    let (status, _) = call(&app, "POST", "/v1/orders/L-1/refund", Some(&json!({"refund_no": "LR-1"})));
    assert_eq!(status, 200);
    assert_eq!(refund_callback(&app, "LR-1", "L-1", "SUCCESS")["outcome"], "applied");
    let (status, answer) = call(&app, "POST", "/v1/admin/refunds/LR-1/resolve", Some(&resolve));
    assert_eq!((status, answer["error"]["code"].as_str()), (409, Some("invalid_transition")), "{answer}");
    assert_eq!(findings(&inspections(&app)), []);

    // received_not_applied: older than 10 minutes, and only while the mode is normal.
    create(&app, "L-3", 300);
    set_mode(&app, "record_only");
    assert_eq!(
        pay(&app, Pay { pay_no: "LP-3", order_no: "L-3", amount: 300, status: "SUCCESS" })["outcome"],
        "recorded"
    );
    app.clock().advance_ms(3_600_000);
    assert_eq!(findings(&inspections(&app)), [], "waiting is expected while record-only");
    app.clock().advance_ms(-3_600_000);
    set_mode(&app, "normal");
    app.clock().advance_ms(10 * 60_000);
    assert_eq!(findings(&inspections(&app)), [], "exactly 10 minutes is not older than 10 minutes");
    app.clock().advance_ms(1);
    assert_eq!(findings(&inspections(&app)), [("received_not_applied".to_owned(), "L-3".to_owned())]);
    let (code, report) = inspect_cli(&db);
    assert_eq!((code, findings(&report)), (Some(1), vec![("received_not_applied".to_owned(), "L-3".to_owned())]));
    assert_eq!(call(&app, "POST", "/v1/admin/drain", None), (200, json!({"applied": 1})));
    assert_eq!(findings(&inspections(&app)), []);
    let (code, report) = inspect_cli(&db);
    assert_eq!((code, report), (Some(0), json!({"ok": true, "findings": []})));
}

// ---- compensation ----

#[test]
fn compensation_twice_is_one_effect_answered_the_same_and_never_deletes() {
    let app = app_on(":memory:");
    let conn = app.store().raw_connection().expect("raw connection");
    let mut footprints = vec![footprint(&conn)];
    let reason_rows =
        |reason: &str| count(&conn, "SELECT count(*) FROM audit_log WHERE instr(detail, ?1) > 0", [reason]);
    let reversals = |order_no: &str| {
        count(
            &conn,
            "SELECT count(*) FROM point_log l JOIN orders o ON o.id = l.order_id
             WHERE o.order_no = ?1 AND l.point_type = 'ORDER_PAID_REVERSAL'",
            [order_no],
        )
    };
    let balance =
        || call(&app, "GET", &format!("/v1/users/{USER}/points"), None).1["balance"].as_i64().unwrap_or(i64::MIN);

    for order_no in ["C-1", "C-2", "C-3"] {
        create(&app, order_no, 2500);
        assert_eq!(
            pay(&app, Pay { pay_no: &format!("{order_no}-p"), order_no, amount: 2500, status: "SUCCESS" })["outcome"],
            "applied"
        );
    }
    footprints.push(footprint(&conn));
    assert_eq!(balance(), 75);

    // Twice each: one effect, one audit row, the same answer.
    let cases = [
        (
            json!({"order_no": "C-1", "action": "freeze_coupon", "coupon_template_id": "NEW10",
                "reason": "coupon issued by the 40 ms re-delivery (freeze C-1)"}),
            "freeze C-1",
        ),
        (
            json!({"order_no": "C-1", "action": "reverse_points", "reason": "points given twice (reverse C-1)"}),
            "reverse C-1",
        ),
    ];
    for (request, reason) in &cases {
        let (status, first) = call(&app, "POST", "/v1/compensations", Some(request));
        assert_eq!(status, 200, "{request}: {first}");
        footprints.push(footprint(&conn));
        let (status, second) = call(&app, "POST", "/v1/compensations", Some(request));
        assert_eq!((status, &second), (200, &first), "{reason}: the repeat is answered the same");
        assert_eq!(footprint(&conn), *footprints.last().expect("footprint"), "{reason}: the repeat writes nothing");
        assert_eq!(reason_rows(reason), 1, "{reason}: one audit row with the reason");
        // Idempotent by (order, action, target): another reason is still the same compensation.
        let mut other = request.clone();
        other["reason"] = json!(format!("another operator, same target ({reason})"));
        let (status, third) = call(&app, "POST", "/v1/compensations", Some(&other));
        assert_eq!((status, &third), (200, &first), "{reason}: same target, same answer");
        assert_eq!(
            footprint(&conn),
            *footprints.last().expect("footprint"),
            "{reason}: no second effect, no second audit row"
        );
    }
    let c1 = app.orders().order("C-1").expect("order");
    assert_eq!(c1.coupons.iter().map(|c| c.status.as_str()).collect::<Vec<_>>(), ["FROZEN"], "frozen, not deleted");
    let mut points: Vec<(String, i64)> = c1.points.iter().map(|p| (p.point_type.clone(), p.points)).collect();
    points.sort();
    assert_eq!(points, [("ORDER_PAID".to_owned(), 25), ("ORDER_PAID_REVERSAL".to_owned(), -25)]);
    assert_eq!(c1.order.status.as_str(), "PAID", "compensation does not move the order");
    assert_eq!(balance(), 50);

    // Refund first, then the compensation: one reversal.
    assert_eq!(call(&app, "POST", "/v1/orders/C-2/refund", Some(&json!({"refund_no": "CR-2"}))).0, 200);
    assert_eq!(refund_callback(&app, "CR-2", "C-2", "SUCCESS")["outcome"], "applied");
    assert_eq!(reversals("C-2"), 1);
    let request = json!({"order_no": "C-2", "action": "reverse_points", "reason": "after the refund (reverse C-2)"});
    let (status, first) = call(&app, "POST", "/v1/compensations", Some(&request));
    assert_eq!(status, 200, "{first}");
    let (status, second) = call(&app, "POST", "/v1/compensations", Some(&request));
    assert_eq!((status, &second), (200, &first));
    assert_eq!(reversals("C-2"), 1, "refund and compensation share the reversal's key");
    assert!(reason_rows("reverse C-2") <= 1, "at most one audit row, and none for an effect that did not happen twice");
    footprints.push(footprint(&conn));

    // The compensation first, then the refund: one reversal, the refund still settles.
    let request = json!({"order_no": "C-3", "action": "reverse_points", "reason": "before the refund (reverse C-3)"});
    assert_eq!(call(&app, "POST", "/v1/compensations", Some(&request)).0, 200);
    assert_eq!(reason_rows("reverse C-3"), 1);
    assert_eq!(call(&app, "POST", "/v1/orders/C-3/refund", Some(&json!({"refund_no": "CR-3"}))).0, 200);
    assert_eq!(refund_callback(&app, "CR-3", "C-3", "SUCCESS")["outcome"], "applied");
    let c3 = app.orders().order("C-3").expect("order");
    assert_eq!(c3.order.status.as_str(), "REFUNDED");
    assert_eq!(reversals("C-3"), 1, "whichever comes first reverses, the other is a no-op");
    assert_eq!(c3.coupons.iter().map(|c| c.status.as_str()).collect::<Vec<_>>(), ["FROZEN"]);
    assert_eq!(balance(), 0);
    footprints.push(footprint(&conn));

    let refusals: [(Value, u16, &str); 6] = [
        (json!({"order_no": "C-NOPE", "action": "reverse_points", "reason": "r"}), 404, "order_not_found"),
        (
            json!({"order_no": "C-1", "action": "freeze_coupon", "coupon_template_id": "NOPE", "reason": "r"}),
            404,
            "_not_found",
        ),
        (json!({"order_no": "C-1", "action": "freeze_coupon", "reason": "r"}), 400, "invalid_request"),
        (
            json!({"order_no": "C-1", "action": "delete_coupon", "coupon_template_id": "NEW10", "reason": "r"}),
            400,
            "invalid_request",
        ),
        (json!({"order_no": "C-1", "action": "reverse_points"}), 400, "invalid_request"),
        (json!({"order_no": "C-1", "action": "reverse_points", "reason": ""}), 400, "invalid_request"),
    ];
    for (request, expected, code) in refusals {
        let (status, answer) = call(&app, "POST", "/v1/compensations", Some(&request));
        assert_eq!(status, expected, "{request}: {answer}");
        let got = answer["error"]["code"].as_str().unwrap_or_default();
        assert!(got.ends_with(code), "{request}: code {got:?}, expected {code:?}");
    }
    footprints.push(footprint(&conn));

    // Nothing is ever deleted: every table only grows, and ids have no holes.
    for pair in footprints.windows(2) {
        for table in LEDGER {
            assert!(pair[1][table] >= pair[0][table], "{table} shrank: {:?} -> {:?}", pair[0], pair[1]);
        }
    }
    for table in ["pay_callback_log", "refund", "user_coupon", "point_log", "audit_log"] {
        let max_id = count(&conn, &format!("SELECT coalesce(max(id), 0) FROM {table}"), []);
        assert_eq!(max_id, count(&conn, &format!("SELECT count(*) FROM {table}"), []), "{table}: no row removed");
    }
}

// ---- /metrics ----

#[derive(Debug, Clone)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

#[derive(Debug, Default)]
struct Exposition {
    types: BTreeMap<String, String>,
    samples: Vec<Sample>,
}

impl Exposition {
    /// Samples of the family `family` (histogram samples included).
    fn family(&self, family: &str) -> Vec<&Sample> {
        self.samples.iter().filter(|s| family_of(&s.name, &self.types).as_deref() == Some(family)).collect()
    }

    /// Families of a type whose name contains `part` and whose samples carry `label`.
    fn find(&self, kind: &str, part: &str, label: Option<&str>) -> Vec<String> {
        self.types
            .iter()
            .filter(|(name, t)| t.as_str() == kind && name.contains(part))
            .filter(|(name, _)| label.is_none_or(|l| self.family(name).iter().any(|s| s.labels.contains_key(l))))
            .map(|(name, _)| name.clone())
            .collect()
    }
}

fn is_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn is_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !name.starts_with("__")
}

fn family_of(name: &str, types: &BTreeMap<String, String>) -> Option<String> {
    if types.contains_key(name) {
        return Some(name.to_owned());
    }
    for (suffix, kinds) in [
        ("_bucket", &["histogram"][..]),
        ("_sum", &["histogram", "summary"][..]),
        ("_count", &["histogram", "summary"][..]),
    ] {
        if let Some(base) = name.strip_suffix(suffix) {
            if types.get(base).is_some_and(|t| kinds.contains(&t.as_str())) {
                return Some(base.to_owned());
            }
        }
    }
    None
}

fn parse_float(text: &str) -> Result<f64, String> {
    match text {
        "+Inf" | "Inf" => return Ok(f64::INFINITY),
        "-Inf" => return Ok(f64::NEG_INFINITY),
        "NaN" => return Ok(f64::NAN),
        _ => {}
    }
    if text.is_empty() || !text.chars().all(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '+' | '-')) {
        return Err(format!("not a float: {text:?}"));
    }
    text.parse::<f64>().map_err(|e| format!("not a float {text:?}: {e}"))
}

/// A strict parser of the Prometheus text exposition format 0.0.4.
fn parse_exposition(text: &str) -> Result<Exposition, String> {
    if !text.ends_with('\n') {
        return Err("the exposition must end with a newline".into());
    }
    let mut out = Exposition::default();
    let mut helps = BTreeSet::new();
    let mut series = HashSet::new();
    let mut finished_families = BTreeSet::new();
    let mut current: Option<String> = None;
    for (n, line) in text[..text.len() - 1].split('\n').enumerate() {
        let at = |msg: String| format!("line {}: {msg}: {line:?}", n + 1);
        if line.is_empty() {
            continue;
        }
        if let Some(comment) = line.strip_prefix('#') {
            let comment = comment.strip_prefix(' ').unwrap_or(comment);
            let mut parts = comment.splitn(3, ' ');
            match parts.next() {
                Some("TYPE") => {
                    let name = parts.next().ok_or_else(|| at("TYPE without a name".into()))?;
                    let kind = parts.next().ok_or_else(|| at("TYPE without a type".into()))?;
                    if !is_metric_name(name) {
                        return Err(at(format!("invalid metric name {name:?}")));
                    }
                    if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind) {
                        return Err(at(format!("unknown type {kind:?}")));
                    }
                    if out.types.insert(name.to_owned(), kind.to_owned()).is_some() {
                        return Err(at(format!("second TYPE for {name}")));
                    }
                    if out.samples.iter().any(|s| family_of(&s.name, &out.types).as_deref() == Some(name)) {
                        return Err(at(format!("TYPE of {name} after its samples")));
                    }
                }
                Some("HELP") => {
                    let name = parts.next().ok_or_else(|| at("HELP without a name".into()))?;
                    if !is_metric_name(name) {
                        return Err(at(format!("invalid metric name {name:?}")));
                    }
                    let help = parts.next().unwrap_or("");
                    let mut chars = help.chars();
                    while let Some(c) = chars.next() {
                        if c == '\\' && !matches!(chars.next(), Some('\\' | 'n')) {
                            return Err(at("bad escape in HELP".into()));
                        }
                    }
                    if !helps.insert(name.to_owned()) {
                        return Err(at(format!("second HELP for {name}")));
                    }
                }
                _ => {} // an ordinary comment
            }
            continue;
        }
        // name{labels} value [timestamp]
        let name_end = line.find(['{', ' ']).ok_or_else(|| at("no value".into()))?;
        let name = &line[..name_end];
        if !is_metric_name(name) {
            return Err(at(format!("invalid metric name {name:?}")));
        }
        let mut rest = &line[name_end..];
        let mut labels = BTreeMap::new();
        if let Some(after) = rest.strip_prefix('{') {
            let mut chars = after.char_indices().peekable();
            let consumed: usize;
            loop {
                if let Some(&(i, '}')) = chars.peek() {
                    consumed = i + 1;
                    break;
                }
                let mut label = String::new();
                for (_, c) in chars.by_ref() {
                    if c == '=' {
                        break;
                    }
                    label.push(c);
                }
                if !is_label_name(&label) {
                    return Err(at(format!("invalid label name {label:?}")));
                }
                if chars.next().map(|(_, c)| c) != Some('"') {
                    return Err(at(format!("label {label} value is not quoted")));
                }
                let mut value = String::new();
                let mut closed = false;
                while let Some((_, c)) = chars.next() {
                    match c {
                        '"' => {
                            closed = true;
                            break;
                        }
                        '\\' => match chars.next().map(|(_, c)| c) {
                            Some('\\') => value.push('\\'),
                            Some('"') => value.push('"'),
                            Some('n') => value.push('\n'),
                            other => return Err(at(format!("bad escape \\{other:?} in label {label}"))),
                        },
                        '\n' => return Err(at("raw newline in a label value".into())),
                        c => value.push(c),
                    }
                }
                if !closed {
                    return Err(at(format!("unterminated value of label {label}")));
                }
                if labels.insert(label.clone(), value).is_some() {
                    return Err(at(format!("label {label} twice")));
                }
                match chars.next() {
                    Some((i, '}')) => {
                        consumed = i + 1;
                        break;
                    }
                    Some((_, ',')) => continue,
                    other => return Err(at(format!("expected , or }} after a label, got {other:?}"))),
                }
            }
            rest = &after[consumed..];
        }
        let rest = rest.strip_prefix(' ').ok_or_else(|| at("no space before the value".into()))?;
        let mut fields = rest.split(' ');
        let value = parse_float(fields.next().unwrap_or(""))?;
        if let Some(ts) = fields.next() {
            ts.parse::<i64>().map_err(|_| at(format!("bad timestamp {ts:?}")))?;
        }
        if fields.next().is_some() {
            return Err(at("trailing fields".into()));
        }
        let family = family_of(name, &out.types).ok_or_else(|| at(format!("no # TYPE declared for {name}")))?;
        if current.as_deref() != Some(family.as_str()) {
            if let Some(previous) = current.take() {
                finished_families.insert(previous);
            }
            if finished_families.contains(&family) {
                return Err(at(format!("samples of {family} are not contiguous")));
            }
            current = Some(family.clone());
        }
        if out.types[&family] == "counter" && (value.is_nan() || value < 0.0) {
            return Err(at("a counter below zero".into()));
        }
        let key = format!("{name}{labels:?}");
        if !series.insert(key) {
            return Err(at("the same series twice".into()));
        }
        out.samples.push(Sample { name: name.to_owned(), labels, value });
    }
    check_histograms(&out)?;
    Ok(out)
}

fn check_histograms(exp: &Exposition) -> Result<(), String> {
    for (family, kind) in &exp.types {
        if kind != "histogram" {
            continue;
        }
        let mut groups: BTreeMap<Labels, HistogramParts> = BTreeMap::new();
        for s in exp.family(family) {
            let mut key: Vec<(String, String)> = s.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            key.retain(|(k, _)| k != "le");
            let group = groups.entry(key).or_default();
            if s.name == format!("{family}_bucket") {
                let le = s.labels.get("le").ok_or_else(|| format!("{family}: a bucket without le"))?;
                group.0.push((parse_float(le)?, s.value));
            } else if s.name == format!("{family}_sum") {
                group.1 = Some(s.value);
            } else if s.name == format!("{family}_count") {
                group.2 = Some(s.value);
            } else {
                return Err(format!("{family}: unexpected sample {}", s.name));
            }
        }
        if groups.is_empty() {
            return Err(format!("histogram {family} has no samples"));
        }
        for (labels, (buckets, sum, count)) in groups {
            let context = format!("{family}{labels:?}");
            if buckets.windows(2).any(|w| w[0].0.partial_cmp(&w[1].0) != Some(std::cmp::Ordering::Less)) {
                return Err(format!("{context}: le not strictly increasing"));
            }
            if buckets.windows(2).any(|w| w[1].1 < w[0].1) {
                return Err(format!("{context}: bucket counts decrease"));
            }
            let last = buckets.last().ok_or_else(|| format!("{context}: no buckets"))?;
            if last.0 != f64::INFINITY {
                return Err(format!("{context}: no +Inf bucket"));
            }
            let count = count.ok_or_else(|| format!("{context}: no _count"))?;
            sum.ok_or_else(|| format!("{context}: no _sum"))?;
            if last.1 != count {
                return Err(format!("{context}: +Inf bucket {} != _count {count}", last.1));
            }
        }
    }
    Ok(())
}

#[test]
fn the_metrics_parser_refuses_what_prometheus_refuses() {
    let good = "# HELP x_total a counter\n# TYPE x_total counter\nx_total{a=\"q\\\"uote\\\\ \\n\"} 3\n\
                # TYPE h histogram\nh_bucket{le=\"0.1\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 0.3\nh_count 2\n";
    let parsed = parse_exposition(good).expect("a valid exposition");
    assert_eq!(parsed.samples[0].labels["a"], "q\"uote\\ \n");
    let bad = [
        ("no TYPE", "x 1\n"),
        ("bad name", "# TYPE 1x counter\n1x 1\n"),
        ("unquoted label", "# TYPE x counter\nx{a=b} 1\n"),
        ("bad escape", "# TYPE x counter\nx{a=\"\\t\"} 1\n"),
        ("float words", "# TYPE x gauge\nx infinity\n"),
        ("no newline at the end", "# TYPE x gauge\nx 1"),
        ("substring value", "# TYPE x gauge\nx 1abc\n"),
        ("duplicate series", "# TYPE x gauge\nx{a=\"1\"} 1\nx{a=\"1\"} 2\n"),
        ("non-contiguous", "# TYPE x gauge\n# TYPE y gauge\nx 1\ny 1\nx{a=\"1\"} 1\n"),
        ("+Inf != count", "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 3\n"),
        (
            "decreasing buckets",
            "# TYPE h histogram\nh_bucket{le=\"1\"} 3\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 2\n",
        ),
        ("no +Inf", "# TYPE h histogram\nh_bucket{le=\"1\"} 3\nh_sum 1\nh_count 3\n"),
        ("negative counter", "# TYPE x counter\nx -1\n"),
    ];
    for (case, text) in bad {
        assert!(parse_exposition(text).is_err(), "{case} must be refused");
    }
}

fn scrape(server: &Server) -> (Exposition, String) {
    let resp = server.get("/metrics");
    assert_eq!(resp.status, 200, "{}", resp.text());
    let content_type = resp.header("Content-Type").unwrap_or_default().to_owned();
    assert!(content_type.starts_with("text/plain"), "Prometheus text is text/plain: {content_type:?}");
    let text = resp.text();
    let exposition = parse_exposition(&text).unwrap_or_else(|e| panic!("/metrics is not Prometheus text: {e}\n{text}"));
    (exposition, text)
}

/// A fresh payonce's first scrape already holds every counter whose label
/// values payonce knows, at 0, so Prometheus' `increase()` sees the first
/// event after a (re)start and an alert on the first finding of a kind fires.
#[test]
fn a_fresh_payonce_exports_every_known_counter_at_zero() {
    let server = Server::start(&REWARDS);
    let (m, text) = scrape(&server);
    let zero = |family: &str, labels: &[(&str, &str)]| {
        let found: Vec<f64> = m
            .family(family)
            .iter()
            .filter(|s| labels.iter().all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v)))
            .map(|s| s.value)
            .collect();
        assert_eq!(found, [0.0], "{family} {labels:?} at 0 from the start:\n{text}");
    };
    for outcome in ["recorded", "payment_failed", "paid_after_close", "already_paid", "amount_mismatch", "applied"] {
        zero("payonce_callback_outcomes_total", &[("kind", "payment"), ("outcome", outcome)]);
    }
    zero("payonce_callback_outcomes_total", &[("kind", "payment"), ("outcome", "duplicate")]);
    for outcome in ["applied", "refund_failed", "duplicate", "unexpected_refund"] {
        zero("payonce_callback_outcomes_total", &[("kind", "refund"), ("outcome", outcome)]);
    }
    for layer in ["callback", "idempotency_key"] {
        zero("payonce_duplicates_suppressed_total", &[("layer", layer)]);
    }
    // The kinds the API describes, every one of them.
    let openapi = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.yaml")).expect("openapi");
    let kinds: Vec<&str> = openapi
        .split("- duplicate_coupon")
        .nth(1)
        .map(|rest| rest.split("order_no:").next().unwrap_or_default())
        .into_iter()
        .flat_map(|list| list.lines())
        .filter_map(|line| line.trim().strip_prefix("- "))
        .chain(["duplicate_coupon"])
        .collect();
    assert_eq!(kinds.len(), 9, "the inspection's kinds in docs/openapi.yaml: {kinds:?}");
    for kind in &kinds {
        zero("payonce_inspection_findings_total", &[("kind", kind)]);
        zero("payonce_inspection_last_findings", &[("kind", kind)]);
    }
    for result in ["ok", "failed"] {
        zero("payonce_keys_reload_total", &[("result", result)]);
    }
    // One event moves one series and leaves the others at 0.
    create_http(&server, "MZ-1", 1000);
    let paid = Pay { pay_no: "MZP-1", order_no: "MZ-1", amount: 1000, status: "SUCCESS" }.send(&server);
    assert_eq!(paid.json()["outcome"], "applied");
    let (m, text) = scrape(&server);
    let value = |outcome: &str| {
        m.family("payonce_callback_outcomes_total")
            .iter()
            .find(|s| s.labels.get("kind").map(String::as_str) == Some("payment") && s.labels["outcome"] == outcome)
            .map(|s| s.value)
    };
    assert_eq!((value("applied"), value("duplicate")), (Some(1.0), Some(0.0)), "{text}");
}

#[test]
fn metrics_are_strict_prometheus_text_with_every_promised_series() {
    let server = Server::start(&REWARDS);
    let mut requests = 0;
    let mut counted = |n: usize| requests += n;
    create_http(&server, "MT-1", 1000);
    create_http(&server, "MT-2", 1000);
    assert_eq!(
        Pay { pay_no: "MTP-1", order_no: "MT-1", amount: 1000, status: "SUCCESS" }.send(&server).json()["outcome"],
        "applied"
    );
    assert_eq!(
        Pay { pay_no: "MTP-1", order_no: "MT-1", amount: 1000, status: "SUCCESS" }.send(&server).json()["outcome"],
        "duplicate"
    );
    assert_eq!(
        Pay { pay_no: "MTP-1b", order_no: "MT-1", amount: 1000, status: "SUCCESS" }.send(&server).json()["outcome"],
        "already_paid"
    );
    assert_eq!(server.get("/v1/no-such-route").status, 404);
    let report = server.get("/v1/inspections").json();
    assert_eq!(findings(&report), [("refund_required".to_owned(), "MT-1".to_owned())]);
    assert_eq!(put_mode_http(&server, br#"{"mode":"record_only"}"#).status, 200);
    assert_eq!(
        Pay { pay_no: "MTP-2", order_no: "MT-2", amount: 1000, status: "SUCCESS" }.send(&server).json()["outcome"],
        "recorded"
    );
    counted(9);

    let (m, text) = scrape(&server);
    for name in m.types.keys().chain(m.samples.iter().map(|s| &s.name)) {
        assert!(name.starts_with("payonce_"), "every name is prefixed payonce_: {name}");
    }
    let value = |family: &str, labels: &[(&str, &str)]| -> f64 {
        m.family(family)
            .iter()
            .filter(|s| labels.iter().all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v)))
            .map(|s| s.value)
            .sum()
    };

    // Requests by route and status.
    let families = m.find("counter", "request", Some("status"));
    let requests_family = families
        .iter()
        .find(|f| m.family(f).iter().all(|s| s.labels.contains_key("route")))
        .unwrap_or_else(|| panic!("no request counter by route and status:\n{text}"));
    let by = |route_part: &str, status: &str| -> f64 {
        m.family(requests_family)
            .iter()
            .filter(|s| s.labels["route"].contains(route_part) && s.labels["status"] == status)
            .map(|s| s.value)
            .sum()
    };
    assert!(by("/v1/callbacks", "200") >= 4.0, "callback requests answered 200:\n{text}");
    assert!(by("/v1/orders", "201") >= 2.0, "order creations answered 201:\n{text}");
    assert!(by("", "404") >= 1.0, "a 404 is counted:\n{text}");
    assert!(by("/v1/admin/mode", "200") >= 1.0, "{text}");

    // Callback outcomes by outcome.
    let outcomes = m.find("counter", "callback", Some("outcome"));
    let outcomes = outcomes.first().unwrap_or_else(|| panic!("no callback outcome counter:\n{text}"));
    for outcome in ["applied", "duplicate", "already_paid", "recorded"] {
        assert!(value(outcomes, &[("outcome", outcome)]) >= 1.0, "callback outcome {outcome}:\n{text}");
    }

    // Duplicates suppressed.
    let duplicates = m.find("counter", "duplicate", None);
    let duplicates = duplicates.first().unwrap_or_else(|| panic!("no duplicates-suppressed counter:\n{text}"));
    assert!(value(duplicates, &[]) >= 1.0, "{text}");

    // The latency histogram counts the requests made so far.
    let histograms = m.find("histogram", "", None);
    let latency = histograms.first().unwrap_or_else(|| panic!("no latency histogram:\n{text}"));
    let latency_count: f64 = m.samples.iter().filter(|s| s.name == format!("{latency}_count")).map(|s| s.value).sum();
    assert!(latency_count >= requests as f64, "latency histogram count {latency_count} < {requests} requests:\n{text}");

    // Inspection findings by kind.
    let inspection = m.find("counter", "inspection", Some("kind"));
    let inspection = inspection.first().unwrap_or_else(|| panic!("no inspection findings by kind:\n{text}"));
    assert!(value(inspection, &[("kind", "refund_required")]) >= 1.0, "{text}");

    // The mode and the records waiting, as gauges.
    let mode_gauge = |m: &Exposition| -> (f64, f64) {
        let name = m.find("gauge", "mode", Some("mode"));
        let name = name.first().unwrap_or_else(|| panic!("no mode gauge"));
        let pick = |mode: &str| -> f64 {
            m.family(name)
                .iter()
                .filter(|s| s.labels.get("mode").map(String::as_str) == Some(mode))
                .map(|s| s.value)
                .sum()
        };
        (pick("normal"), pick("record_only"))
    };
    let waiting = |m: &Exposition| -> f64 {
        let name = m.find("gauge", "waiting", None);
        let name = name.first().unwrap_or_else(|| panic!("no records-waiting gauge"));
        m.family(name).iter().map(|s| s.value).sum()
    };
    assert_eq!(mode_gauge(&m), (0.0, 1.0), "record-only is the mode in force:\n{text}");
    assert_eq!(waiting(&m), 1.0, "one record waits:\n{text}");

    // Back to normal: the worker decides the record; the gauges follow; counters never go down.
    assert_eq!(put_mode_http(&server, br#"{"mode":"normal"}"#).status, 200);
    let settled = wait_for(Duration::from_secs(15), || waiting(&scrape(&server).0) == 0.0);
    assert!(settled, "the waiting gauge drops to 0 once the worker decided the record");
    let (after, text) = scrape(&server);
    assert_eq!(mode_gauge(&after), (1.0, 0.0), "{text}");
    for before in m.samples.iter().filter(|s| m.types.get(&s.name).is_some_and(|t| t == "counter")) {
        let now = after.samples.iter().find(|s| s.name == before.name && s.labels == before.labels);
        let now = now.unwrap_or_else(|| panic!("counter series {} {:?} vanished", before.name, before.labels));
        assert!(now.value >= before.value, "counter {} {:?} went down", before.name, before.labels);
    }
}

// ---- backup ----

#[test]
fn backup_during_a_storm_holds_every_payment_acknowledged_before_it_started() {
    const THREADS: usize = 4;
    const PER_THREAD: usize = 150;
    let dir = TempDir::new("backup");
    let db = dir.path("live.db");
    let copy = dir.path("copy.db");
    let server = Server::start_on(&db, &REWARDS);
    // A long-running reader (a report, an operator's sqlite3 session) pins an
    // old snapshot: checkpoints cannot move the storm's pages into the main
    // file, so only a copy that reads through the WAL holds the payments.
    let pinned = read_only(&db);
    pinned.execute_batch("BEGIN").expect("begin");
    assert_eq!(count(&pinned, "SELECT count(*) FROM pay_callback_log", []), 0);
    let acked: Arc<Mutex<Vec<(String, Instant)>>> = Arc::new(Mutex::new(Vec::new()));
    let addr = server.addr;
    let storm: Vec<_> = (0..THREADS)
        .map(|t| {
            let acked = Arc::clone(&acked);
            thread::spawn(move || {
                for i in 0..PER_THREAD {
                    let order_no = format!("BK-{t}-{i:03}");
                    let pay_no = format!("BKP-{t}-{i:03}");
                    let body = json!({"order_no": order_no, "user_id": USER, "amount": 100}).to_string();
                    let resp = util::request(
                        addr,
                        "POST",
                        "/v1/orders",
                        &[("Content-Type", "application/json")],
                        body.as_bytes(),
                    );
                    assert_eq!(resp.status, 201, "{}", resp.text());
                    let body =
                        json!({"pay_no": pay_no, "order_no": order_no, "amount": 100, "status": "SUCCESS"}).to_string();
                    let signature = util::sign_now(SECRET, body.as_bytes());
                    let resp = util::request(
                        addr,
                        "POST",
                        "/v1/callbacks/generic",
                        &[("Content-Type", "application/json"), ("Payonce-Signature", &signature)],
                        body.as_bytes(),
                    );
                    if resp.status == 200 && resp.json()["outcome"] == "applied" {
                        acked.lock().expect("acks").push((pay_no, Instant::now()));
                    }
                }
            })
        })
        .collect();

    let started_storm = wait_for(Duration::from_secs(30), || acked.lock().expect("acks").len() >= 100);
    assert!(started_storm, "the storm acknowledged 100 payments");
    let backup_started = Instant::now();
    let (code, _, stderr) =
        payonce_cli(&["backup", "--db", &db.display().to_string(), "--to", &copy.display().to_string()]);
    let backup_finished = Instant::now();
    assert_eq!(code, Some(0), "backup failed: {stderr}");
    pinned.execute_batch("COMMIT").expect("end the pinned read");
    for handle in storm {
        handle.join().expect("storm thread");
    }
    let acked = acked.lock().expect("acks").clone();
    assert_eq!(acked.len(), THREADS * PER_THREAD, "every payment of the storm was applied");
    let before: Vec<&String> = acked.iter().filter(|(_, at)| *at < backup_started).map(|(p, _)| p).collect();
    let during = acked.iter().filter(|(_, at)| *at > backup_started && *at < backup_finished).count();
    let after = acked.iter().filter(|(_, at)| *at > backup_started).count();
    eprintln!("backup: {} acknowledged before, {during} during, {after} after it started", before.len());
    assert!(after > 0, "the storm went on while the backup ran");

    let conn = read_only(&copy);
    let check: String = conn.query_row("PRAGMA integrity_check", [], |r| r.get(0)).expect("integrity_check");
    assert_eq!(check, "ok");
    let mut stmt = conn.prepare("SELECT outcome FROM pay_callback_log WHERE pay_no = ?1").expect("prepare");
    for pay_no in &before {
        let outcome: Option<String> = stmt.query_row([pay_no.as_str()], |r| r.get(0)).ok();
        assert_eq!(outcome.as_deref(), Some("applied"), "{pay_no} was acknowledged before the backup started");
    }
    // One consistent snapshot: every applied payment in the copy comes with its order PAID and its rewards.
    let applied = count(&conn, "SELECT count(*) FROM pay_callback_log WHERE outcome = 'applied'", []);
    assert!(applied as usize >= before.len());
    assert_eq!(count(&conn, "SELECT count(*) FROM orders WHERE status = 'PAID'", []), applied);
    assert_eq!(count(&conn, "SELECT count(*) FROM user_coupon", []), applied);
    assert_eq!(count(&conn, "SELECT count(*) FROM point_log", []), applied);
    assert_eq!(count(&conn, "SELECT count(*) FROM outbox_event WHERE type = 'order.paid'", []), applied);
}

// ---- expiry ----

#[test]
fn expired_orders_are_closed_over_http_by_the_sweeper_with_an_event() {
    let server = Server::start(&["--sweep-interval-s", "1", "--order-ttl-s", "1"]);
    let bodies = [
        json!({"order_no": "EX-1", "user_id": USER, "amount": 100, "expires_in_s": 1}),
        json!({"order_no": "EX-2", "user_id": USER, "amount": 100}),
        json!({"order_no": "EX-3", "user_id": USER, "amount": 100, "expires_in_s": 3600}),
    ];
    for body in &bodies {
        let resp = server.post_json("/v1/orders", body);
        assert_eq!(resp.status, 201, "{}", resp.text());
    }
    let closed = wait_for(Duration::from_secs(15), || {
        ["EX-1", "EX-2"].iter().all(|o| order_http(&server, o)["status"] == "CLOSED")
    });
    assert!(closed, "expired orders are closed within a few seconds");
    for order_no in ["EX-1", "EX-2"] {
        let order = order_http(&server, order_no);
        let closed_at = order["closed_at"].as_str().unwrap_or_else(|| panic!("{order_no}: closed_at: {order}"));
        assert!(closed_at >= order["expires_at"].as_str().unwrap_or_default(), "closed at or after expiry: {order}");
    }
    assert_eq!(order_http(&server, "EX-3")["status"], "PENDING");
    let resp = server.get("/v1/events?after=0&limit=1000");
    let events = resp.json()["events"].as_array().cloned().unwrap_or_default();
    let closes: Vec<&Value> = events.iter().filter(|e| e["type"] == "order.closed").collect();
    let mut ids: Vec<&str> = closes.iter().map(|e| e["event_id"].as_str().unwrap_or_default()).collect();
    ids.sort();
    assert_eq!(ids, ["order.closed:EX-1", "order.closed:EX-2"]);
    for e in closes {
        assert_eq!(e["data"]["order"]["status"], "CLOSED", "{e}");
    }
    let resp = Pay { pay_no: "EXP-1", order_no: "EX-1", amount: 100, status: "SUCCESS" }.send(&server);
    assert_eq!(resp.json(), json!({"code": "SUCCESS", "outcome": "paid_after_close"}));
}

// ---- access-layer Idempotency-Key on the admin endpoints ----

/// A keyed request in process: (status, Idempotent-Replayed present, body).
fn call_keyed(app: &App, method: &str, target: &str, key: &str, content_type: &str, body: &[u8]) -> (u16, bool, Value) {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let headers = vec![("Content-Type".into(), content_type.into()), ("Idempotency-Key".into(), key.into())];
    let req = Request { method: method.into(), path: path.into(), query: query.into(), headers, body: body.to_vec() };
    let resp = api::handle(app, &req);
    let replayed = resp.header("Idempotent-Replayed") == Some("true");
    let value = serde_json::from_slice(&resp.body).unwrap_or(Value::Null);
    (resp.status, replayed, value)
}

/// The access-layer Idempotency-Key (docs/decisions.md): its response is
/// stored in the same transaction as the work it did, so a crash can never
/// leave one without the other; a 5xx stores nothing and its retry runs. The test
/// hook fails a write after its work and stored response, before commit.
/// Returns the violations found (checked all together by the caller).
fn keyed_failure_then_retry(
    app: &App,
    method: &str,
    target: &str,
    key: &str,
    content_type: &str,
    body: &[u8],
) -> Vec<String> {
    let conn = app.store().raw_connection().expect("raw connection");
    let keys = |conn: &Connection| count(conn, "SELECT count(*) FROM idempotency_key", []);
    let before = (footprint(&conn), keys(&conn));
    let mut violations = Vec::new();
    app.fail_writes_after_work(1);
    let (status, _, answer) = call_keyed(app, method, target, key, content_type, body);
    app.fail_writes_after_work(0);
    assert_eq!(status, 500, "{key}: the injected failure is a 500: {answer}");
    let after = (footprint(&conn), keys(&conn));
    if after != before {
        violations.push(format!(
            "{method} {target}: a request that failed with 500 left its work behind: {:?} -> {:?}",
            before, after
        ));
    }
    let (status, replayed, first) = call_keyed(app, method, target, key, content_type, body);
    assert!(status == 200 && !replayed, "{key}: the retry runs: {status} {first}");
    let settled = footprint(&conn);
    let (status, replayed, again) = call_keyed(app, method, target, key, content_type, body);
    assert_eq!((status, replayed, &again), (200, true, &first), "{key}: replayed with Idempotent-Replayed: true");
    assert_eq!(footprint(&conn), settled, "{key}: a replay does no work");
    violations
}

#[test]
fn keyed_admin_requests_replay_and_a_failed_one_leaves_nothing_behind() {
    let app = app_on(":memory:");
    let json_type = "application/json";
    create(&app, "KA-1", 1000);
    assert_eq!(
        pay(&app, Pay { pay_no: "KAP-1", order_no: "KA-1", amount: 1000, status: "SUCCESS" })["outcome"],
        "applied"
    );
    assert_eq!(
        pay(&app, Pay { pay_no: "KAP-1b", order_no: "KA-1", amount: 1000, status: "SUCCESS" })["outcome"],
        "already_paid"
    );
    let mut violations = Vec::new();

    violations.extend(keyed_failure_then_retry(
        &app,
        "PUT",
        "/v1/admin/mode",
        "k-mode",
        json_type,
        br#"{"mode":"record_only"}"#,
    ));
    assert_eq!(app.operations().mode().expect("mode"), payonce::ops::Mode::RecordOnly);

    let freeze =
        json!({"order_no": "KA-1", "action": "freeze_coupon", "coupon_template_id": "NEW10", "reason": "keyed"});
    violations.extend(keyed_failure_then_retry(
        &app,
        "POST",
        "/v1/compensations",
        "k-comp",
        json_type,
        freeze.to_string().as_bytes(),
    ));
    assert_eq!(app.orders().order("KA-1").expect("order").coupons[0].status, "FROZEN");

    let resolve = json!({"resolution": "accepted", "reason": "keyed"});
    violations.extend(keyed_failure_then_retry(
        &app,
        "POST",
        "/v1/admin/payments/KAP-1b/resolve",
        "k-resolve",
        json_type,
        resolve.to_string().as_bytes(),
    ));

    // Two records waiting in record-only mode: a keyed drain.
    for (order_no, pay_no) in [("KA-2", "KAP-2"), ("KA-3", "KAP-3")] {
        create(&app, order_no, 500);
        assert_eq!(pay(&app, Pay { pay_no, order_no, amount: 500, status: "SUCCESS" })["outcome"], "recorded");
    }
    violations.extend(keyed_failure_then_retry(&app, "POST", "/v1/admin/drain", "k-drain", json_type, b"{}"));
    assert_eq!(app.operations().received_waiting().expect("waiting"), 0);

    // A keyed reconciliation with repair: one payment the platform has and payonce never recorded.
    set_mode(&app, "normal");
    create(&app, "KA-4", 700);
    let statement =
        format!("pay_no,order_no,amount,status,paid_at\nKAP-4,KA-4,700,SUCCESS,{}\n", payonce::clock::format_ms(T0_MS));
    violations.extend(keyed_failure_then_retry(
        &app,
        "POST",
        "/v1/reconciliations?format=generic&repair=true",
        "k-recon",
        "text/csv",
        statement.as_bytes(),
    ));
    assert_eq!(app.orders().order("KA-4").expect("order").order.status.as_str(), "PAID");

    assert!(violations.is_empty(), "Idempotency-Key atomicity violated:\n{}", violations.join("\n"));
}

/// The inspection also runs on its timer (`--inspect-interval-s`), and its
/// findings are counted in metrics without anyone calling GET /v1/inspections.
#[test]
fn the_timed_inspection_counts_findings_in_metrics() {
    let server = Server::start(&["--inspect-interval-s", "1"]);
    create_http(&server, "TI-1", 100);
    assert_eq!(
        Pay { pay_no: "TIP-1", order_no: "TI-1", amount: 100, status: "SUCCESS" }.send(&server).json()["outcome"],
        "applied"
    );
    assert_eq!(
        Pay { pay_no: "TIP-1b", order_no: "TI-1", amount: 100, status: "SUCCESS" }.send(&server).json()["outcome"],
        "already_paid"
    );
    let counted = wait_for(Duration::from_secs(10), || {
        let (m, _) = scrape(&server);
        m.find("counter", "inspection", Some("kind")).iter().any(|family| {
            m.family(family)
                .iter()
                .any(|s| s.labels.get("kind").map(String::as_str) == Some("refund_required") && s.value >= 1.0)
        })
    });
    assert!(counted, "the timer's inspection counted refund_required in /metrics");
}

/// Label values must stay bounded whatever a client sends (the route label
/// already is: unknown paths are `other`). A request line's method is any
/// token a client or a scanner chooses; each distinct one must not become
/// a new series kept forever in memory and in every scrape.
#[test]
fn request_metrics_stay_bounded_under_arbitrary_methods() {
    let server = Server::start(&[]);
    assert_eq!(server.get("/healthz").status, 200);
    let series = |server: &Server| -> usize {
        let (m, _) = scrape(server);
        let families = m.find("counter", "request", Some("status"));
        families.iter().map(|f| m.family(f).len()).sum()
    };
    let before = series(&server);
    for i in 0..100 {
        let request = format!(
            "JUNK{i} /v1/callbacks/generic HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
        );
        let answer = util::parse_response(&util::raw(server.addr, request.as_bytes())).expect("an answer");
        assert_eq!(answer.status, 405, "an unknown method on a known path");
    }
    let after = series(&server);
    assert!(
        after <= before + 5,
        "100 invented methods made {} new request series ({before} -> {after})",
        after - before
    );
}

for_each_engine! {
    /// Three processes sweep one database at once: each expired order is
    /// closed once, with one order.closed event. The claim
    /// is the database's (the order's key lock, on PostgreSQL an advisory
    /// lock, and the PENDING→CLOSED CAS), not one process being the sweeper.
    fn three_sweepers_close_each_expired_order_once(db) {
        const EXPIRING: usize = 40;
        let flags = ["--sweep-interval-s", "1", "--order-ttl-s", "1"];
        let servers: Vec<Server> = (0..3).map(|_| db.serve(&flags)).collect();
        let order_nos: Vec<String> = (0..EXPIRING).map(|i| format!("SW-{i:02}")).collect();
        parallel(4, &order_nos, |o| {
            let resp = servers[o.len() % 3].post_json("/v1/orders", &json!({"order_no": o, "user_id": USER, "amount": 100}));
            assert_eq!(resp.status, 201, "{}", resp.text());
        });
        let store = db.store();
        let closed_sql = "SELECT count(*) FROM orders WHERE status = 'CLOSED'";
        assert!(
            wait_for(Duration::from_secs(20), || db.count(&store, closed_sql) == EXPIRING as i64),
            "{}: every expired order is closed within seconds ({} closed)",
            db.label(),
            db.count(&store, closed_sql)
        );
        // Let every sweeper run again over the closed orders.
        thread::sleep(Duration::from_millis(1500));
        assert_eq!(db.count(&store, "SELECT count(*) FROM outbox_event WHERE type = 'order.closed'"), EXPIRING as i64);
        assert_eq!(
            db.count(&store, "SELECT count(*) FROM (SELECT order_no FROM outbox_event GROUP BY order_no HAVING count(*) > 1) t"),
            0,
            "{}: no order closed twice",
            db.label()
        );
    }
}

/// `payonce_callback_outcomes_total{kind="payment",outcome=...}` of `app`.
fn payment_outcome_count(app: &App, outcome: &str) -> u64 {
    let req = Request {
        method: "GET".into(),
        path: "/metrics".into(),
        query: String::new(),
        headers: Vec::new(),
        body: Vec::new(),
    };
    let text = String::from_utf8(api::handle(app, &req).body).expect("metrics text");
    let series = format!("payonce_callback_outcomes_total{{kind=\"payment\",outcome=\"{outcome}\"}} ");
    text.lines().find_map(|line| line.strip_prefix(&series)).map_or(0, |n| n.parse().expect("a count"))
}

for_each_engine! {
    /// A keyed drain whose transaction PostgreSQL re-runs (two forced
    /// serialization failures) decides, answers, stores and counts each
    /// record once: the answer stored under the key and the metrics come
    /// from the attempt that committed, never from the rolled-back ones.
    /// (On SQLite nothing re-runs; the same case holds on one attempt.)
    fn a_keyed_drain_rerun_after_serialization_failures_answers_and_counts_once(db) {
        let app = app_on(&db.spec);
        for order_no in ["RR-1", "RR-2", "RR-3"] {
            create(&app, order_no, 300);
        }
        set_mode(&app, "record_only");
        for (pay_no, order_no) in [("RRP-1", "RR-1"), ("RRP-2", "RR-2"), ("RRP-3", "RR-3")] {
            let answer = pay(&app, Pay { pay_no, order_no, amount: 300, status: "SUCCESS" });
            assert_eq!(answer, json!({"code": "SUCCESS", "outcome": "recorded"}), "{pay_no}");
        }
        app.store().fail_next_writes_serializing(2);
        let keyed = || {
            let headers = vec![
                ("Content-Type".to_owned(), "application/json".to_owned()),
                ("Idempotency-Key".to_owned(), "drain-rerun".to_owned()),
            ];
            handle(&app, "POST", "/v1/admin/drain", headers, b"{}".to_vec())
        };
        assert_eq!(keyed(), (200, json!({"applied": 3})), "{}: three records, decided once each", db.label());
        assert_eq!(keyed(), (200, json!({"applied": 3})), "{}: the stored answer replays", db.label());
        assert_eq!(payment_outcome_count(&app, "applied"), 3, "{}: counted once each", db.label());
        for order_no in ["RR-1", "RR-2", "RR-3"] {
            assert_eq!(app.orders().order(order_no).expect("order").order.status.as_str(), "PAID", "{order_no}");
        }
    }
}

for_each_engine! {
    /// A keyed drain (one transaction, no pay_no locks) racing another
    /// process's drain (the sweeper's path: each record under its pay_no
    /// lock): every record is decided exactly once, the keyed drain counts
    /// only its own, and it answers 200, never a 500. On PostgreSQL the
    /// keyed drain reads records the other process decides meanwhile (READ
    /// COMMITTED): it skips those, and a CAS overtaken between its read and
    /// its write re-runs the body.
    fn a_keyed_drain_racing_another_processes_drain_decides_each_record_once(db) {
        const RECORDS: usize = 300;
        let (one, two) = (app_on(&db.spec), app_on(&db.spec));
        let order_nos: Vec<String> = (0..RECORDS).map(|i| format!("RACE-{i:03}")).collect();
        for order_no in &order_nos {
            create(&one, order_no, 300);
        }
        set_mode(&one, "record_only");
        for (i, order_no) in order_nos.iter().enumerate() {
            let pay_no = format!("RACEP-{i:03}");
            let answer = pay(&one, Pay { pay_no: &pay_no, order_no, amount: 300, status: "SUCCESS" });
            assert_eq!(answer["outcome"], "recorded", "{pay_no}");
        }
        let barrier = std::sync::Barrier::new(2);
        let (keyed, other) = thread::scope(|s| {
            let keyed = s.spawn(|| {
                barrier.wait();
                let headers = vec![
                    ("Content-Type".to_owned(), "application/json".to_owned()),
                    ("Idempotency-Key".to_owned(), "drain-race".to_owned()),
                ];
                handle(&one, "POST", "/v1/admin/drain", headers, b"{}".to_vec())
            });
            let other = s.spawn(|| {
                barrier.wait();
                two.operations().drain().expect("the other process's drain")
            });
            (keyed.join().expect("keyed drain thread"), other.join().expect("other drain thread"))
        });
        assert_eq!(keyed.0, 200, "{}: {}", db.label(), keyed.1);
        let by_keyed = keyed.1["applied"].as_u64().expect("applied") as usize;
        assert_eq!(by_keyed + other, RECORDS, "{}: each record decided once ({by_keyed} + {other})", db.label());
        for order_no in &order_nos {
            let detail = one.orders().order(order_no).expect("order");
            assert_eq!(detail.order.status.as_str(), "PAID", "{order_no}");
            assert_eq!(detail.payments.len(), 1, "{order_no}");
            assert_eq!(detail.coupons.len(), 1, "{order_no}: one coupon");
            assert_eq!(detail.events.len(), 1, "{order_no}: one order.paid");
        }
        println!("{}: keyed drain decided {by_keyed}, the other process {other}", db.label());
    }
}
