//! The access-layer Idempotency-Key (docs/decisions.md): the work runs
//! once per (scope, key) and its answer is stored with it, in one
//! transaction; repeats replay it; what is not the work's answer (400, 413,
//! 415, 5xx, this section's own 409 and 422) is never stored.
//!
//! Most cases run in process through `api::handle` on a memdb with a manual
//! clock (fast, and expiry is exact); the concurrency, crash and throughput
//! cases also run against the real binary. Token scopes are in `auth.rs`.

use crate::util::{self, count, footprint, order_states, Footprint, HttpResponse, Pay, Server, TempDir, SECRET};
use payonce::api::{self, Request, Response, IDEMPOTENCY_KEY_BYTES_MAX, IDEMPOTENCY_WAIT_MS_MAX};
use payonce::store::StoreOptions;
use payonce::{App, Clock, Config, CreateOrder};
use rusqlite::{Connection, OpenFlags};
use serde_json::{json, Value};
use std::collections::{BTreeSet, HashMap};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// The manual clock's start (2023-11-14T22:13:20Z).
const T0_MS: i64 = 1_700_000_000_000;
/// `idempotency_ttl_s` of the in-process apps.
const TTL_S: i64 = 60;
const JSON: (&str, &str) = ("Content-Type", "application/json");
/// Identical requests sent at once in the concurrency tests.
const CONCURRENT: usize = 16;

// ---- answers, in process and over HTTP alike ----

/// What a caller sees of one answer.
#[derive(Clone)]
struct Answer {
    status: u16,
    /// `Idempotent-Replayed: true` was present.
    replayed: bool,
    retry_after: Option<String>,
    body: Vec<u8>,
}

impl Answer {
    fn new(status: u16, replayed: Option<&str>, retry_after: Option<&str>, body: Vec<u8>) -> Answer {
        if let Some(value) = replayed {
            assert_eq!(value, "true", "Idempotent-Replayed is `true` when present");
        }
        Answer { status, replayed: replayed.is_some(), retry_after: retry_after.map(str::to_owned), body }
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn order_no(&self) -> String {
        self.json()["order_no"].as_str().unwrap_or_else(|| panic!("no order_no in {}", self.text())).to_owned()
    }
}

impl std::fmt::Debug for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let replayed = if self.replayed { " (replayed)" } else { "" };
        write!(f, "{}{replayed} {}", self.status, self.text())
    }
}

impl From<Response> for Answer {
    fn from(r: Response) -> Answer {
        Answer::new(r.status, r.header("Idempotent-Replayed"), r.header("Retry-After"), r.body.clone())
    }
}

impl From<HttpResponse> for Answer {
    fn from(r: HttpResponse) -> Answer {
        Answer::new(r.status, r.header("Idempotent-Replayed"), r.header("Retry-After"), r.body.clone())
    }
}

/// A first answer (the work ran): `status`, no replay header.
fn expect_fresh(a: &Answer, status: u16, context: &str) {
    assert_eq!((a.status, a.replayed), (status, false), "{context}: expected a fresh {status}, got {a:?}");
}

/// A replay of `first`: same status and the same body bytes, with the header.
fn expect_replay(a: &Answer, first: &Answer, context: &str) {
    assert_eq!(
        (a.status, a.replayed),
        (first.status, true),
        "{context}: expected a replay, got {} {}",
        a.status,
        a.text()
    );
    assert_eq!(a.text(), first.text(), "{context}: a replay answers the stored body byte for byte");
}

/// The contract's error shape `{"error":{"code","message"}}` with `status`/`code`, not a replay.
fn expect_error(a: &Answer, status: u16, code: &str, context: &str) {
    assert_eq!(a.status, status, "{context}: {}", a.text());
    let v = a.json();
    assert_eq!(v["error"]["code"], code, "{context}: {}", a.text());
    assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{context}: a message: {}", a.text());
    assert_eq!(v.as_object().map(|o| o.len()), Some(1), "{context}: only `error`: {}", a.text());
    assert!(!a.replayed, "{context}: not a replay");
}

// ---- in process ----

fn config() -> Config {
    Config {
        idempotency_ttl_s: TTL_S,
        platforms: payonce::platforms::Platforms::with([payonce::platforms::Platform::notices(
            payonce::platforms::generic::Generic::new(vec![SECRET.as_bytes().to_vec()]),
        )]),
        ..Default::default()
    }
}

fn new_app() -> App {
    App::open(":memory:", Clock::manual(T0_MS), config()).expect("open app")
}

/// One request through `api::handle`; `target` may carry `?query`.
fn call(app: &App, method: &str, target: &str, headers: &[(&str, &str)], body: &[u8]) -> Answer {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let req = Request {
        method: method.into(),
        path: path.into(),
        query: query.into(),
        headers: headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect(),
        body: body.to_vec(),
    };
    api::handle(app, &req).into()
}

/// A keyed JSON POST.
fn post(app: &App, target: &str, key: &str, body: &str) -> Answer {
    call(app, "POST", target, &[JSON, ("Idempotency-Key", key)], body.as_bytes())
}

fn create_body(user_id: &str, amount: i64) -> String {
    json!({"user_id": user_id, "amount": amount}).to_string()
}

fn key_rows(app: &App, key: &str) -> i64 {
    count(
        &app.store().raw_connection().expect("raw connection"),
        "SELECT count(*) FROM idempotency_key WHERE key = ?1",
        [&key],
    )
}

/// (scope, status, body) of every stored response of `key`.
fn stored(app: &App, key: &str) -> Vec<(String, u16, String)> {
    let conn = app.store().raw_connection().expect("raw connection");
    let mut stmt = conn
        .prepare("SELECT scope, status_code, response_body FROM idempotency_key WHERE key = ?1 ORDER BY scope")
        .expect("prepare");
    let rows = stmt
        .query_map([key], |r| {
            let body: Vec<u8> = r.get(2)?;
            Ok((r.get(0)?, r.get(1)?, String::from_utf8_lossy(&body).into_owned()))
        })
        .expect("query");
    rows.collect::<Result<_, _>>().expect("rows")
}

fn orders_of(app: &App, user_id: &str) -> i64 {
    count(
        &app.store().raw_connection().expect("raw connection"),
        "SELECT count(*) FROM orders WHERE user_id = ?1",
        [&user_id],
    )
}

fn status_of(app: &App, order_no: &str) -> String {
    app.orders().order(order_no).expect("order").order.status.as_str().to_owned()
}

/// Every table's row count and every order's state: what any request could have changed.
fn snapshot(app: &App) -> (Footprint, Vec<String>) {
    let conn = app.store().raw_connection().expect("raw connection");
    (footprint(&conn), order_states(&conn))
}

fn create_plain(app: &App, order_no: &str, user_id: &str, amount: i64) {
    let req = CreateOrder {
        order_no: order_no.into(),
        user_id: user_id.into(),
        amount,
        currency: "CNY".into(),
        expires_in_s: None,
    };
    let (_, created) = app.orders().create_order(&req).expect("create order");
    assert!(created, "{order_no} is new");
}

fn signed(app: &App, body: &[u8]) -> String {
    payonce::signature::sign(SECRET.as_bytes(), app.clock().now_ms().div_euclid(1000), body)
}

// ---- concurrency ----

/// One answer and how long its request took.
struct Timed {
    answer: Answer,
    elapsed: Duration,
}

/// Exactly one fresh 201; every other answer a byte-identical 201 replay of
/// it, or a 409 `idempotency_key_in_use` with Retry-After, and only after
/// waiting the whole bound. Returns the fresh answer.
fn check_one_winner(answers: &[Timed], context: &str) -> Answer {
    let fresh: Vec<&Answer> = answers.iter().map(|t| &t.answer).filter(|a| !a.replayed && a.status == 201).collect();
    assert_eq!(
        fresh.len(),
        1,
        "{context}: exactly one request ran the work: {:?}",
        answers.iter().map(|t| (t.answer.status, t.answer.replayed)).collect::<Vec<_>>()
    );
    let first = fresh[0].clone();
    let mut replays = 0;
    for t in answers {
        let a = &t.answer;
        match (a.status, a.replayed) {
            (201, false) => {}
            (201, true) => {
                expect_replay(a, &first, context);
                replays += 1;
            }
            (409, _) => {
                expect_error(a, 409, "idempotency_key_in_use", context);
                assert!(a.retry_after.is_some(), "{context}: 409 idempotency_key_in_use carries Retry-After");
                assert!(
                    t.elapsed >= Duration::from_millis(IDEMPOTENCY_WAIT_MS_MAX),
                    "{context}: 409 after only {:?}, before the {IDEMPOTENCY_WAIT_MS_MAX} ms wait bound",
                    t.elapsed
                );
            }
            _ => panic!("{context}: unexpected answer {} {}", a.status, a.text()),
        }
    }
    assert_eq!(
        replays,
        answers.len() - 1,
        "{context}: every other request waited and replayed (none should hit the bound here)"
    );
    first
}

/// The two bodies the concurrency cases send: without an order_no (the
/// server generates one) and with an explicit one.
fn concurrency_cases(tag: &str) -> Vec<(String, Option<String>, String)> {
    let user = format!("u-conc-{tag}");
    let explicit = format!("ORD-CONC-{tag}");
    vec![
        (format!("gen-{tag}"), None, create_body(&format!("{user}-gen"), 990)),
        (
            format!("explicit-{tag}"),
            Some(explicit.clone()),
            json!({"order_no": explicit, "user_id": format!("{user}-explicit"), "amount": 990}).to_string(),
        ),
    ]
}

/// Sends `send` from CONCURRENT threads released at once by a barrier.
fn at_once(send: impl Fn() -> Answer + Sync) -> Vec<Timed> {
    let barrier = Barrier::new(CONCURRENT);
    thread::scope(|s| {
        let handles: Vec<_> = (0..CONCURRENT)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    let started = Instant::now();
                    let answer = send();
                    Timed { answer, elapsed: started.elapsed() }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("sender thread")).collect()
    })
}

#[test]
fn concurrent_identical_keyed_creations_run_once_in_process() {
    for (key, explicit, body) in concurrency_cases("mem") {
        let app = new_app();
        let context = format!("in process, key {key}");
        let answers = at_once(|| post(&app, "/v1/orders", &key, &body));
        let first = check_one_winner(&answers, &context);
        let order_no = first.order_no();
        if let Some(explicit) = &explicit {
            assert_eq!(&order_no, explicit, "{context}");
        }
        assert_eq!(
            count(&app.store().raw_connection().expect("raw connection"), "SELECT count(*) FROM orders", []),
            1,
            "{context}: one order"
        );
        let rows = stored(&app, &key);
        assert_eq!(rows.len(), 1, "{context}: one stored response");
        assert_eq!(
            (rows[0].1, rows[0].2.as_str()),
            (201, first.text().as_str()),
            "{context}: the stored answer is the one sent"
        );
        // And later: still the same answer.
        expect_replay(&post(&app, "/v1/orders", &key, &body), &first, &context);
    }
}

#[test]
fn concurrent_identical_keyed_creations_run_once_over_http() {
    let server = Server::start(&[]);
    for (key, explicit, body) in concurrency_cases("http") {
        let context = format!("over HTTP, key {key}");
        let headers = [JSON, ("Idempotency-Key", key.as_str())];
        let answers = at_once(|| util::request(server.addr, "POST", "/v1/orders", &headers, body.as_bytes()).into());
        let first = check_one_winner(&answers, &context);
        let order_no = first.order_no();
        if let Some(explicit) = &explicit {
            assert_eq!(&order_no, explicit, "{context}");
        }
        let conn = read_only(&server.db);
        let user_id = first.json()["user_id"].as_str().unwrap_or_default().to_owned();
        let orders: i64 = conn
            .query_row("SELECT count(*) FROM orders WHERE user_id = ?1", [&user_id], |r| r.get(0))
            .expect("count orders");
        assert_eq!(orders, 1, "{context}: one order");
        let bodies = stored_bodies(&conn, &key);
        assert_eq!(bodies, vec![(201, first.text())], "{context}: one stored response, the one sent");
    }
}

/// A keyed request still running holds the key: a duplicate waits for it and
/// replays its answer; past IDEMPOTENCY_WAIT_MS_MAX it gets 409
/// `idempotency_key_in_use` with Retry-After, stores nothing, and its retry
/// replays. The first request is held inside its transaction by another
/// connection's write lock (with a busy timeout longer than the wait bound).
#[test]
fn a_duplicate_waits_for_the_running_request_then_replays_or_409_past_the_bound() {
    let options = StoreOptions { busy_timeout_ms: 30_000, ..StoreOptions::default() };
    let app = App::open_with(":memory:", Clock::manual(T0_MS), config(), &options).expect("open app");
    let bound = Duration::from_millis(IDEMPOTENCY_WAIT_MS_MAX);
    // (key, how long the blocker holds the database after the duplicate starts; None = until the duplicate answers)
    let cases: [(&str, Option<Duration>); 2] = [("wait-short", Some(Duration::from_millis(800))), ("wait-long", None)];
    for (key, hold) in cases {
        let body = create_body(&format!("u-{key}"), 700);
        let mut blocker = app.store().raw_connection().expect("raw connection");
        let tx = blocker
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .expect("blocker BEGIN IMMEDIATE");
        let (first, second) = thread::scope(|s| {
            let first = s.spawn(|| post(&app, "/v1/orders", key, &body));
            // Wait until the first holds its Idempotency-Key (it is the only request, so it gets
            // the key at once) and give it time to block on the database.
            let deadline = Instant::now() + Duration::from_secs(10);
            while app.locks().is_empty() {
                assert!(Instant::now() < deadline, "{key}: the first request never reached the database");
                thread::sleep(Duration::from_millis(5));
            }
            thread::sleep(Duration::from_millis(50));
            let second = s.spawn(|| {
                let started = Instant::now();
                let answer = post(&app, "/v1/orders", key, &body);
                Timed { answer, elapsed: started.elapsed() }
            });
            let second = match hold {
                Some(hold) => {
                    thread::sleep(hold);
                    tx.commit().expect("release the blocker");
                    second.join().expect("second")
                }
                None => {
                    let second = second.join().expect("second");
                    tx.commit().expect("release the blocker");
                    second
                }
            };
            (first.join().expect("first"), second)
        });
        drop(blocker);
        expect_fresh(&first, 201, key);
        match hold {
            Some(hold) => {
                expect_replay(&second.answer, &first, key);
                assert!(second.elapsed >= hold, "{key}: the duplicate waited for the first ({:?})", second.elapsed);
            }
            None => {
                expect_error(&second.answer, 409, "idempotency_key_in_use", key);
                assert_eq!(
                    second.answer.retry_after.as_deref(),
                    Some(api::RETRY_AFTER_S.to_string().as_str()),
                    "{key}: Retry-After"
                );
                assert!(second.elapsed >= bound, "{key}: 409 only past the bound, got it after {:?}", second.elapsed);
                // The 409 stored nothing of its own: the key holds the first's answer, and a retry replays it.
                expect_replay(&post(&app, "/v1/orders", key, &body), &first, key);
            }
        }
        assert_eq!(stored(&app, key).len(), 1, "{key}: one stored response");
        assert_eq!(orders_of(&app, &format!("u-{key}")), 1, "{key}: one order");
    }
}

// ---- atomicity: 5xx stores nothing, refusals are stored ----

#[test]
fn a_failed_write_stores_nothing_and_its_retry_runs() {
    let app = new_app();
    create_plain(&app, "ORD-OPEN", "u-open", 300);
    create_plain(&app, "ORD-PAID", "u-paid", 400);
    assert_eq!(
        Pay { pay_no: "PAY-ORD-PAID", order_no: "ORD-PAID", amount: 400, status: "SUCCESS" }
            .deliver(&app)
            .outcome_str(),
        "applied"
    );
    create_plain(&app, "ORD-PAID2", "u-paid2", 500);
    assert_eq!(
        Pay { pay_no: "PAY-ORD-PAID2", order_no: "ORD-PAID2", amount: 500, status: "SUCCESS" }
            .deliver(&app)
            .outcome_str(),
        "applied"
    );
    // (key, path, body, the retry's status, its error code when a refusal)
    let cases: [(&str, &str, String, u16, Option<&str>); 5] = [
        ("f-gen", "/v1/orders", create_body("u-f-gen", 100), 201, None),
        (
            "f-explicit",
            "/v1/orders",
            json!({"order_no": "ORD-F", "user_id": "u-f", "amount": 100}).to_string(),
            201,
            None,
        ),
        ("f-close", "/v1/orders/ORD-OPEN/close", "{}".into(), 200, None),
        ("f-refund", "/v1/orders/ORD-PAID/refund", json!({"refund_no": "RF-F"}).to_string(), 200, None),
        // A refusal's audit row and stored answer roll back with the 5xx too.
        ("f-refused", "/v1/orders/ORD-PAID2/close", "{}".into(), 409, Some("invalid_transition")),
    ];
    for (key, path, body, retry_status, retry_code) in &cases {
        let before = snapshot(&app);
        app.fail_writes_after_work(1);
        let failed = post(&app, path, key, body);
        expect_error(&failed, 500, "internal_error", key);
        assert_eq!(app.fail_writes_after_work(0), 0, "{key}: the hook fired");
        assert_eq!(snapshot(&app), before, "{key}: nothing of the failed request survives, no key row either");
        assert_eq!(key_rows(&app, key), 0, "{key}: no idempotency_key row after a 5xx");

        let retry = post(&app, path, key, body);
        match retry_code {
            None => expect_fresh(&retry, *retry_status, key),
            Some(code) => expect_error(&retry, *retry_status, code, key),
        }
        assert_eq!(key_rows(&app, key), 1, "{key}: the retry's answer is stored");
        expect_replay(&post(&app, path, key, body), &retry, key);
    }
    assert_eq!(orders_of(&app, "u-f-gen"), 1, "one generated order after the failure and the retry");
    assert_eq!(status_of(&app, "ORD-F"), "PENDING");
    assert_eq!(status_of(&app, "ORD-OPEN"), "CLOSED");
    assert_eq!(status_of(&app, "ORD-PAID"), "REFUNDING");
    assert_eq!(status_of(&app, "ORD-PAID2"), "PAID");
}

/// A business refusal (404, 409 invalid_transition / order_no_conflict) is
/// the work's answer: stored, replayed with the header, and the replay does
/// not run the work again (no second audit row; a later change of the order
/// does not change the replay).
#[test]
fn business_refusals_are_stored_and_replayed_without_running_again() {
    let app = new_app();
    create_plain(&app, "ORD-PAID", "u-paid", 400);
    assert_eq!(
        Pay { pay_no: "PAY-ORD-PAID", order_no: "ORD-PAID", amount: 400, status: "SUCCESS" }
            .deliver(&app)
            .outcome_str(),
        "applied"
    );
    create_plain(&app, "ORD-PEND", "u-pend", 300);
    let refused = |order_no: &str| {
        count(
            &app.store().raw_connection().expect("raw connection"),
            "SELECT count(*) FROM audit_log WHERE action = 'transition_refused' AND order_no = ?1",
            [&order_no],
        )
    };
    // (key, path, body, status, code)
    let cases = [
        ("r-close-paid", "/v1/orders/ORD-PAID/close", "{}".to_owned(), 409, "invalid_transition"),
        (
            "r-refund-pending",
            "/v1/orders/ORD-PEND/refund",
            json!({"refund_no": "RF-P"}).to_string(),
            409,
            "invalid_transition",
        ),
        ("r-close-unknown", "/v1/orders/ORD-GHOST/close", "{}".to_owned(), 404, "order_not_found"),
        (
            "r-refund-unknown",
            "/v1/orders/ORD-GHOST2/refund",
            json!({"refund_no": "RF-G"}).to_string(),
            404,
            "order_not_found",
        ),
        (
            "r-conflict",
            "/v1/orders",
            json!({"order_no": "ORD-PAID", "user_id": "u-other", "amount": 1}).to_string(),
            409,
            "order_no_conflict",
        ),
    ];
    for (key, path, body, status, code) in &cases {
        let first = post(&app, path, key, body);
        expect_error(&first, *status, code, key);
        let rows = stored(&app, key);
        assert_eq!(rows.len(), 1, "{key}: the refusal is stored");
        assert_eq!((rows[0].1, rows[0].2.clone()), (*status, first.text()), "{key}: stored status and body");
        let footprint_before = snapshot(&app);
        for _ in 0..3 {
            expect_replay(&post(&app, path, key, body), &first, key);
        }
        assert_eq!(snapshot(&app), footprint_before, "{key}: the replays ran no work");
    }
    assert_eq!(refused("ORD-PAID"), 1, "one audit row for the refused close, however often it was replayed");
    assert_eq!(refused("ORD-PEND"), 1, "one audit row for the refused refund");
    // A fresh key runs the work again: a second audit row (so the count above means something).
    expect_error(
        &post(&app, "/v1/orders/ORD-PAID/close", "r-close-paid-2", "{}"),
        409,
        "invalid_transition",
        "fresh key",
    );
    assert_eq!(refused("ORD-PAID"), 2);

    // The stored 404 stays the answer after the order appears: the replay did not look.
    create_plain(&app, "ORD-GHOST", "u-ghost", 100);
    let replay = post(&app, "/v1/orders/ORD-GHOST/close", "r-close-unknown", "{}");
    assert_eq!((replay.status, replay.replayed), (404, true), "{}", replay.text());
    assert_eq!(status_of(&app, "ORD-GHOST"), "PENDING", "the replay did not close the order");
}

/// Validation errors (400, 415) and 405 are not the work's answer: nothing
/// is stored, and the same key with a corrected body runs (not 422).
#[test]
fn validation_errors_are_not_stored_and_a_corrected_retry_runs() {
    let app = new_app();
    create_plain(&app, "ORD-PAID", "u-paid", 400);
    assert_eq!(
        Pay { pay_no: "PAY-ORD-PAID", order_no: "ORD-PAID", amount: 400, status: "SUCCESS" }
            .deliver(&app)
            .outcome_str(),
        "applied"
    );
    struct Case {
        key: &'static str,
        path: &'static str,
        content_type: &'static str,
        bad: String,
        status: u16,
        code: &'static str,
        good: String,
        good_status: u16,
    }
    let case = |key, path, content_type, bad: String, status, code, good: String, good_status| Case {
        key,
        path,
        content_type,
        bad,
        status,
        code,
        good,
        good_status,
    };
    let good_create = |user: &str| create_body(user, 100);
    let cases = [
        case(
            "v-neg",
            "/v1/orders",
            "application/json",
            create_body("u-v1", -5),
            400,
            "invalid_request",
            good_create("u-v1"),
            201,
        ),
        case(
            "v-zero",
            "/v1/orders",
            "application/json",
            create_body("u-v2", 0),
            400,
            "invalid_request",
            good_create("u-v2"),
            201,
        ),
        case(
            "v-float",
            "/v1/orders",
            "application/json",
            r#"{"user_id":"u-v3","amount":99.5}"#.into(),
            400,
            "invalid_request",
            good_create("u-v3"),
            201,
        ),
        case("v-json", "/v1/orders", "application/json", "{nope".into(), 400, "invalid_json", good_create("u-v4"), 201),
        case(
            "v-field",
            "/v1/orders",
            "application/json",
            r#"{"user_id":"u-v5","amount":100,"x":1}"#.into(),
            400,
            "invalid_request",
            good_create("u-v5"),
            201,
        ),
        case(
            "v-user",
            "/v1/orders",
            "application/json",
            create_body("bad user!", 100),
            400,
            "invalid_request",
            good_create("u-v6"),
            201,
        ),
        case(
            "v-media",
            "/v1/orders",
            "text/plain",
            good_create("u-v7"),
            415,
            "unsupported_media_type",
            good_create("u-v7"),
            201,
        ),
        case(
            "v-refund-no",
            "/v1/orders/ORD-PAID/refund",
            "application/json",
            json!({"refund_no": "bad no!"}).to_string(),
            400,
            "invalid_request",
            json!({"refund_no": "RF-V"}).to_string(),
            200,
        ),
    ];
    for c in &cases {
        let before = snapshot(&app);
        let bad = call(
            &app,
            "POST",
            c.path,
            &[("Content-Type", c.content_type), ("Idempotency-Key", c.key)],
            c.bad.as_bytes(),
        );
        expect_error(&bad, c.status, c.code, c.key);
        assert_eq!(key_rows(&app, c.key), 0, "{}: a {} is not stored", c.key, c.status);
        assert_eq!(snapshot(&app), before, "{}: nothing changed", c.key);
        // The same bad request again is judged again, not replayed.
        let again = call(
            &app,
            "POST",
            c.path,
            &[("Content-Type", c.content_type), ("Idempotency-Key", c.key)],
            c.bad.as_bytes(),
        );
        expect_error(&again, c.status, c.code, c.key);
        // Nothing was stored, so another body under the same key is a first use: it runs.
        let good = post(&app, c.path, c.key, &c.good);
        expect_fresh(&good, c.good_status, c.key);
        assert_eq!(key_rows(&app, c.key), 1, "{}: the corrected request's answer is stored", c.key);
    }
    // A method the path does not allow: 405, nothing stored.
    let put = call(&app, "PUT", "/v1/orders", &[JSON, ("Idempotency-Key", "v-put")], good_create("u-put").as_bytes());
    expect_error(&put, 405, "method_not_allowed", "PUT /v1/orders");
    assert_eq!(key_rows(&app, "v-put"), 0, "a 405 is not stored");
}

// ---- 422, scopes, key syntax ----

#[test]
fn the_same_key_with_another_body_is_422_and_changes_nothing() {
    let app = new_app();
    let body = create_body("u-422", 100);
    let first = post(&app, "/v1/orders", "k-422", &body);
    expect_fresh(&first, 201, "first use");
    let stored_before = stored(&app, "k-422");
    // Every other byte sequence is another body: the fingerprint is the raw body's.
    let others = [
        create_body("u-422", 101),
        create_body("u-other", 100),
        r#"{"user_id": "u-422", "amount": 100}"#.to_owned(),
        r#"{"amount":100,"user_id":"u-422"}"#.to_owned(),
        format!("{body}\n"),
        String::new(),
        "{nope".to_owned(),
    ];
    assert_eq!(body, r#"{"user_id":"u-422","amount":100}"#, "the table above assumes this encoding");
    for other in &others {
        let context = format!("other body {other:?}");
        let answer = post(&app, "/v1/orders", "k-422", other);
        expect_error(&answer, 422, "idempotency_key_reused", &context);
        assert!(answer.retry_after.is_none(), "{context}: no Retry-After on 422");
        assert_eq!(stored(&app, "k-422"), stored_before, "{context}: the stored answer is untouched");
    }
    assert_eq!(
        count(&app.store().raw_connection().expect("raw connection"), "SELECT count(*) FROM orders", []),
        1,
        "no order from the 422s"
    );
    expect_replay(&post(&app, "/v1/orders", "k-422", &body), &first, "the original body still replays");

    // The same for a stored refusal.
    let refusal = post(&app, "/v1/orders/ORD-NONE/close", "k-422-refusal", "{}");
    expect_error(&refusal, 404, "order_not_found", "refusal");
    expect_error(
        &post(&app, "/v1/orders/ORD-NONE/close", "k-422-refusal", ""),
        422,
        "idempotency_key_reused",
        "refusal, another body",
    );
    expect_replay(&post(&app, "/v1/orders/ORD-NONE/close", "k-422-refusal", "{}"), &refusal, "refusal replays");
}

/// Scope = (caller, method, path with query string): the same key elsewhere
/// is another key. (Another token: auth.rs.)
#[test]
fn the_same_key_in_another_scope_is_independent() {
    let app = new_app();
    let key = "shared-key";
    let body = create_body("u-scope", 100);
    // Every target is its own scope; each first use runs (a new server-generated order each time).
    let targets = ["/v1/orders", "/v1/orders?src=app", "/v1/orders?src=web", "/v1/orders?src=app&x=1"];
    let firsts: Vec<Answer> = targets
        .iter()
        .map(|target| {
            let a = post(&app, target, key, &body);
            expect_fresh(&a, 201, target);
            a
        })
        .collect();
    let order_nos: BTreeSet<String> = firsts.iter().map(Answer::order_no).collect();
    assert_eq!(order_nos.len(), targets.len(), "one order per scope: {order_nos:?}");
    assert_eq!(orders_of(&app, "u-scope"), targets.len() as i64);
    // Another path, with another body even: not 422, it runs.
    let order_no = firsts[0].order_no();
    let close_path = format!("/v1/orders/{order_no}/close");
    let closed = post(&app, &close_path, key, "{}");
    expect_fresh(&closed, 200, "close under the same key");
    assert_eq!(closed.json()["status"], "CLOSED");
    // And every scope replays its own answer.
    for (target, first) in targets.iter().zip(&firsts) {
        expect_replay(&post(&app, target, key, &body), first, target);
    }
    expect_replay(&post(&app, &close_path, key, "{}"), &closed, "close replay");
    let scopes: Vec<String> = stored(&app, key).into_iter().map(|(scope, _, _)| scope).collect();
    assert_eq!(scopes.len(), targets.len() + 1, "one row per scope: {scopes:?}");
    for target in targets.iter().copied().chain([close_path.as_str()]) {
        assert!(
            scopes
                .iter()
                .any(|s| s.starts_with("anonymous ") && s.contains("POST") && s.ends_with(&format!(" {target}"))),
            "a scope names the caller, the method and {target:?} with its query: {scopes:?}"
        );
    }
}

#[test]
fn a_quoted_key_is_the_same_key() {
    let app = new_app();
    // (first key header, second key header, same key?)
    let cases = [
        ("abc", "\"abc\"", true),
        ("\"q-1\"", "q-1", true),
        ("\"q-2\"", "\"q-2\"", true),
        ("\"with space\"", "with space", true),
        ("x-1", "x-10", false),
        ("\"y-1\"", "\"y-10\"", false),
    ];
    for (i, (first_key, second_key, same)) in cases.iter().enumerate() {
        let context = format!("{first_key:?} then {second_key:?}");
        let body = create_body(&format!("u-q{i}"), 100);
        let first = post(&app, "/v1/orders", first_key, &body);
        expect_fresh(&first, 201, &context);
        let second = post(&app, "/v1/orders", second_key, &body);
        if *same {
            expect_replay(&second, &first, &context);
            assert_eq!(orders_of(&app, &format!("u-q{i}")), 1, "{context}");
            // Stored without the quotes.
            let bare = first_key.trim_matches('"');
            assert_eq!(key_rows(&app, bare), 1, "{context}: stored as {bare:?}");
        } else {
            assert!(!second.replayed, "{context}: another key never replays the first: {}", second.text());
        }
    }
}

#[test]
fn invalid_keys_are_400_and_store_nothing() {
    let app = new_app();
    let long = "k".repeat(IDEMPOTENCY_KEY_BYTES_MAX + 1);
    let long_quoted = format!("\"{long}\"");
    let invalid: Vec<(&str, String)> = vec![
        ("empty", String::new()),
        ("blank", "   ".into()),
        ("quoted empty", "\"\"".into()),
        ("256 characters", long),
        ("256 characters quoted", long_quoted),
        ("non-ASCII", "caf\u{e9}".into()),
        ("non-ASCII only", "\u{952e}".into()),
        ("tab", "a\tb".into()),
        ("control character", "a\u{1}b".into()),
        ("newline", "a\nb".into()),
        ("DEL", "a\u{7f}b".into()),
    ];
    for (i, (name, key)) in invalid.iter().enumerate() {
        let order_no = format!("ORD-INV-{i}");
        let body = json!({"order_no": order_no, "user_id": "u-inv", "amount": 100}).to_string();
        let before = snapshot(&app);
        let answer = post(&app, "/v1/orders", key, &body);
        expect_error(&answer, 400, "invalid_idempotency_key", name);
        assert_eq!(snapshot(&app), before, "{name}: no order, no stored response");
        // The same holds on the other keyed routes.
        let close = post(&app, "/v1/orders/ORD-NONE/close", key, "{}");
        expect_error(&close, 400, "invalid_idempotency_key", &format!("{name} on close"));
    }
    assert_eq!(
        count(&app.store().raw_connection().expect("raw connection"), "SELECT count(*) FROM idempotency_key", []),
        0
    );

    // The bounds themselves are valid.
    for (i, key) in [
        "x".to_owned(),
        "k".repeat(IDEMPOTENCY_KEY_BYTES_MAX),
        format!("\"{}\"", "q".repeat(IDEMPOTENCY_KEY_BYTES_MAX)),
    ]
    .iter()
    .enumerate()
    {
        let body = create_body(&format!("u-bound-{i}"), 100);
        let first = post(&app, "/v1/orders", key, &body);
        expect_fresh(&first, 201, &format!("valid key of {} bytes", key.len()));
        expect_replay(&post(&app, "/v1/orders", key, &body), &first, "bound key replays");
    }
}

/// Spec: "1–255 printable ASCII characters". A quote or a backslash inside
/// an unquoted key is printable ASCII, so it is a valid key.
#[test]
fn an_unquoted_key_may_hold_any_printable_ascii() {
    let app = new_app();
    let every_printable: String = (0x21u8..=0x7e).map(char::from).collect();
    let keys =
        ["a\"b".to_owned(), "back\\slash".to_owned(), "x y!#$%&'()*+,-./:;<=>?@[]^_`{|}~".to_owned(), every_printable];
    for (i, key) in keys.iter().enumerate() {
        let body = create_body(&format!("u-pr-{i}"), 100);
        let first = post(&app, "/v1/orders", key, &body);
        expect_fresh(&first, 201, &format!("printable ASCII key {key:?}"));
        expect_replay(&post(&app, "/v1/orders", key, &body), &first, key);
    }
}

// ---- expiry ----

#[test]
fn results_expire_after_the_ttl_judged_on_read() {
    let app = new_app();
    let body = create_body("u-exp", 100);
    let first = post(&app, "/v1/orders", "exp-1", &body);
    expect_fresh(&first, 201, "first use");
    app.clock().advance_ms(TTL_S * 1000 - 1);
    expect_replay(&post(&app, "/v1/orders", "exp-1", &body), &first, "1 ms before the ttl");
    // Another body inside the ttl: 422.
    expect_error(
        &post(&app, "/v1/orders", "exp-1", &create_body("u-exp", 101)),
        422,
        "idempotency_key_reused",
        "inside the ttl",
    );

    app.clock().advance_ms(2);
    let again = post(&app, "/v1/orders", "exp-1", &body);
    expect_fresh(&again, 201, "1 ms after the ttl: a new request");
    assert_ne!(again.order_no(), first.order_no(), "a new server-generated order");
    assert_eq!(orders_of(&app, "u-exp"), 2);
    let rows = stored(&app, "exp-1");
    assert_eq!(rows.len(), 1, "the expired row was replaced");
    assert_eq!(rows[0].2, again.text(), "the key now names the new order");
    expect_replay(&post(&app, "/v1/orders", "exp-1", &body), &again, "the new answer replays");

    // After expiry another body is a new request too (not 422).
    app.clock().advance_ms(TTL_S * 1000 + 1);
    let other = post(&app, "/v1/orders", "exp-1", &create_body("u-exp", 102));
    expect_fresh(&other, 201, "another body after the ttl");
    // A stored refusal expires the same way.
    let refusal = post(&app, "/v1/orders/ORD-LATE/close", "exp-2", "{}");
    expect_error(&refusal, 404, "order_not_found", "refusal");
    create_plain(&app, "ORD-LATE", "u-late", 100);
    app.clock().advance_ms(TTL_S * 1000 + 1);
    let closed = post(&app, "/v1/orders/ORD-LATE/close", "exp-2", "{}");
    expect_fresh(&closed, 200, "the expired refusal's key runs again");
    assert_eq!(closed.json()["status"], "CLOSED");
}

#[test]
fn purge_removes_expired_results_only_in_bounded_batches() {
    let app = new_app();
    let create =
        |key: &str, user: &str| expect_fresh(&post(&app, "/v1/orders", key, &create_body(user, 100)), 201, key);
    for i in 0..5 {
        create(&format!("old-{i}"), &format!("u-old-{i}"));
    }
    app.clock().advance_ms(30_000);
    let live_body = create_body("u-live-0", 100);
    let live = post(&app, "/v1/orders", "live-0", &live_body);
    expect_fresh(&live, 201, "live-0");
    create("live-1", "u-live-1");
    assert_eq!(app.operations().purge_expired_responses(100).expect("purge"), 0, "nothing expired yet");
    app.clock().advance_ms(31_000); // old-* expired (t0+60 s), live-* not (t0+90 s)
    let rows =
        || count(&app.store().raw_connection().expect("raw connection"), "SELECT count(*) FROM idempotency_key", []);
    assert_eq!(rows(), 7, "expired rows stay until purged (expiry is judged on read)");
    assert_eq!(app.operations().purge_expired_responses(2).expect("purge"), 2, "a bounded batch");
    assert_eq!(app.operations().purge_expired_responses(100).expect("purge"), 3);
    assert_eq!(app.operations().purge_expired_responses(100).expect("purge"), 0);
    assert_eq!(rows(), 2);
    assert_eq!(
        count(
            &app.store().raw_connection().expect("raw connection"),
            "SELECT count(*) FROM idempotency_key WHERE key LIKE 'live-%'",
            []
        ),
        2,
        "the live rows stay"
    );
    assert_eq!(
        count(&app.store().raw_connection().expect("raw connection"), "SELECT count(*) FROM orders", []),
        7,
        "purging keys touches no order"
    );
    expect_replay(&post(&app, "/v1/orders", "live-0", &live_body), &live, "a live key still replays");
    create("old-0", "u-old-0"); // a purged key is a new request
    assert_eq!(orders_of(&app, "u-old-0"), 2);
}

/// A keyed load faster than one sweep batch per interval: three batches
/// worth of results come due between two sweeps, and the next sweep
/// removes all of them (one batch per sweep fell behind any load above
/// SWEEP_BATCH_MAX per interval, and the table grew without bound). The
/// sweeper's own round, on the manual clock: no timing involved.
#[test]
fn a_keyed_load_above_the_batch_size_is_pruned_in_one_sweep() {
    const KEYS: usize = 3 * payonce::background::SWEEP_BATCH_MAX;
    let app = new_app();
    let rows =
        || count(&app.store().raw_connection().expect("raw connection"), "SELECT count(*) FROM idempotency_key", []);
    for i in 0..KEYS {
        expect_fresh(
            &post(&app, "/v1/orders", &format!("load-{i}"), &create_body(&format!("u-{i}"), 100)),
            201,
            "load",
        );
    }
    let live_body = create_body("u-live", 100);
    app.clock().advance_ms(TTL_S * 1000 / 2);
    let live = post(&app, "/v1/orders", "live", &live_body);
    expect_fresh(&live, 201, "live");
    app.clock().advance_ms(TTL_S * 1000 / 2 + 1); // the load's results are due, the live one not
    assert_eq!(rows(), KEYS as i64 + 1);
    payonce::background::sweep_once(&app, &AtomicBool::new(false));
    assert_eq!(rows(), 1, "one sweep removes every due result, {KEYS} of them, and keeps the live one");
    expect_replay(&post(&app, "/v1/orders", "live", &live_body), &live, "the live key still replays");
    assert_eq!(
        count(&app.store().raw_connection().expect("raw connection"), "SELECT count(*) FROM orders", []),
        KEYS as i64 + 1,
        "pruning keys touches no order"
    );
}

// ---- what ignores the header ----

#[test]
fn callbacks_and_reads_ignore_the_key() {
    let app = new_app();
    create_plain(&app, "ORD-CB", "u-cb", 900);
    let pay_body = json!({"pay_no": "PAY-CB", "order_no": "ORD-CB", "amount": 900, "status": "SUCCESS"}).to_string();
    let callback = |key: &str, path: &str, body: &str| {
        let sig = signed(&app, body.as_bytes());
        call(&app, "POST", path, &[JSON, ("Payonce-Signature", &sig), ("Idempotency-Key", key)], body.as_bytes())
    };
    let first = callback("cb-key", "/v1/callbacks/generic", &pay_body);
    expect_fresh(&first, 200, "keyed callback");
    assert_eq!(first.json()["outcome"], "applied");
    // The same again is processed again by the callback path (a duplicate), not replayed.
    let second = callback("cb-key", "/v1/callbacks/generic", &pay_body);
    expect_fresh(&second, 200, "keyed callback again");
    assert_eq!(second.json()["outcome"], "duplicate", "{}", second.text());
    // Even a key the access layer would refuse is ignored on callbacks.
    let third = callback("", "/v1/callbacks/generic", &pay_body);
    expect_fresh(&third, 200, "invalid key on a callback");
    assert_eq!(third.json()["outcome"], "duplicate");
    app.refunds().request_refund("ORD-CB", "RF-CB").expect("request refund");
    let refund_body = json!({"refund_no": "RF-CB", "order_no": "ORD-CB", "status": "SUCCESS"}).to_string();
    let refunded = callback("cb-key", "/v1/callbacks/generic/refund", &refund_body);
    expect_fresh(&refunded, 200, "keyed refund callback");
    assert_eq!(refunded.json()["outcome"], "applied");
    assert_eq!(
        count(&app.store().raw_connection().expect("raw connection"), "SELECT count(*) FROM idempotency_key", []),
        0,
        "callbacks store nothing"
    );

    // GETs: answered live each time, never stored or replayed.
    for key in ["get-key", "caf\u{e9}"] {
        for target in
            ["/v1/orders/ORD-CB", "/v1/orders?user_id=u-cb", "/v1/events", "/v1/users/u-cb/points", "/healthz"]
        {
            let a = call(&app, "GET", target, &[("Idempotency-Key", key)], b"");
            expect_fresh(&a, 200, &format!("GET {target} with key {key:?}"));
        }
    }
    let before = call(&app, "GET", "/v1/orders/ORD-CB", &[("Idempotency-Key", "get-2")], b"");
    assert_eq!(before.json()["status"], "REFUNDED");
    assert_eq!(
        count(&app.store().raw_connection().expect("raw connection"), "SELECT count(*) FROM idempotency_key", []),
        0,
        "GETs store nothing"
    );
}

// ---- over HTTP: the header on the wire, 413 ----

#[test]
fn over_http_replay_header_and_unstored_413_415() {
    let server = Server::start(&[]);
    let send = |key: &str, content_type: &str, body: &[u8]| -> Answer {
        util::request(
            server.addr,
            "POST",
            "/v1/orders",
            &[("Content-Type", content_type), ("Idempotency-Key", key)],
            body,
        )
        .into()
    };
    let body = create_body("u-wire", 100);
    let first = send("wire-1", "application/json", body.as_bytes());
    expect_fresh(&first, 201, "first");
    let replay = send("\"wire-1\"", "application/json", body.as_bytes());
    expect_replay(&replay, &first, "replay over HTTP, quoted");

    let huge = vec![b' '; api::BODY_BYTES_MAX + 1];
    expect_error(&send("wire-413", "application/json", &huge), 413, "payload_too_large", "413");
    expect_fresh(&send("wire-413", "application/json", create_body("u-413", 100).as_bytes()), 201, "after 413");
    expect_error(&send("wire-415", "text/plain", body.as_bytes()), 415, "unsupported_media_type", "415");
    expect_fresh(&send("wire-415", "application/json", create_body("u-415", 100).as_bytes()), 201, "after 415");

    let conn = read_only(&server.db);
    let keys: Vec<String> = conn
        .prepare("SELECT key FROM idempotency_key ORDER BY key")
        .and_then(|mut s| s.query_map([], |r| r.get(0))?.collect())
        .expect("keys");
    assert_eq!(keys, ["wire-1", "wire-413", "wire-415"], "one row per key that ran");
    for key in ["wire-413", "wire-415"] {
        let bodies = stored_bodies(&conn, key);
        assert_eq!(bodies.len(), 1);
        assert_eq!(bodies[0].0, 201, "{key}: the stored answer is the corrected request's");
    }
}

/// Spec: a key that is not 1-255 printable ASCII is "400
/// invalid_idempotency_key" — on the wire too, where a non-ASCII header byte
/// must still get that answer (not a dropped connection).
#[test]
fn over_http_a_non_ascii_key_is_400() {
    // The edge hands a non-ASCII header byte over as U+FFFD, which no valid
    // key contains.
    let server = Server::start(&[]);
    let body = create_body("u-wire-utf8", 100);
    for key in ["caf\u{e9}", "\u{952e}"] {
        let answer = try_request(server.addr, "POST", "/v1/orders", &[JSON, ("Idempotency-Key", key)], body.as_bytes())
            .unwrap_or_else(|| panic!("key {key:?}: the connection closed without an answer"));
        expect_error(&answer.into(), 400, "invalid_idempotency_key", &format!("non-ASCII key {key:?} over HTTP"));
    }
    assert_eq!(server.get("/healthz").status, 200);
    assert_eq!(
        read_only(&server.db).query_row("SELECT count(*) FROM orders", [], |r| r.get::<_, i64>(0)).expect("count"),
        0
    );
}

// ---- crash: SIGKILL mid-storm ----

fn read_only(db: &Path) -> Connection {
    Connection::open_with_flags(db, OpenFlags::SQLITE_OPEN_READ_ONLY).expect("open db read-only")
}

fn stored_bodies(conn: &Connection, key: &str) -> Vec<(u16, String)> {
    let mut stmt =
        conn.prepare("SELECT status_code, response_body FROM idempotency_key WHERE key = ?1").expect("prepare");
    let rows = stmt
        .query_map([key], |r| {
            let body: Vec<u8> = r.get(1)?;
            Ok((r.get(0)?, String::from_utf8_lossy(&body).into_owned()))
        })
        .expect("query");
    rows.collect::<Result<_, _>>().expect("rows")
}

/// `util::request` without the panics: `None` when the server is gone
/// (refused, reset, or closed without an answer).
fn try_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Option<HttpResponse> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body);
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    stream.set_write_timeout(Some(Duration::from_secs(30))).ok()?;
    stream.write_all(&bytes).ok()?;
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let mut out = Vec::new();
    stream.read_to_end(&mut out).ok()?;
    util::parse_response(&out)
}

const CRASH_KEYS: usize = 150;
const CRASH_THREADS: usize = 6;
/// Answers received before the SIGKILL.
const CRASH_KILL_AFTER: usize = 40;

fn crash_key(i: usize) -> String {
    format!("crash-key-{i}")
}

fn crash_user(i: usize) -> String {
    format!("crash-u{i}")
}

fn crash_body(i: usize) -> String {
    create_body(&crash_user(i), 100 + i as i64)
}

/// Sends key `i` until it is answered 201; retries a 503 or a 409
/// idempotency_key_in_use. `None` when the server is gone.
fn send_crash_key(addr: SocketAddr, i: usize) -> Option<Answer> {
    let key = crash_key(i);
    let body = crash_body(i);
    for _ in 0..200 {
        let r = try_request(addr, "POST", "/v1/orders", &[JSON, ("Idempotency-Key", &key)], body.as_bytes())?;
        let a = Answer::from(r);
        match a.status {
            // A body cut short by the kill is no answer.
            201 if serde_json::from_slice::<Value>(&a.body).is_err() => return None,
            201 => return Some(a),
            503 | 409 => thread::sleep(Duration::from_millis(20)),
            _ => panic!("key {i}: unexpected answer {} {}", a.status, a.text()),
        }
    }
    panic!("key {i}: still busy after 200 tries");
}

/// A crash between the work and its answer cannot leave the work without
/// its key: kill `payonce serve` mid-storm, restart it on the same file,
/// retry every key, and find exactly one order per key and one stored
/// response per key naming it.
#[test]
fn sigkill_mid_storm_leaves_exactly_one_order_per_key() {
    let dir = TempDir::new("idem-crash");
    let db = dir.path("crash.db");
    let mut server = Server::start_on(&db, &[]);
    let addr = server.addr;
    let answered_before: Mutex<HashMap<usize, Answer>> = Mutex::new(HashMap::new());
    let answered = AtomicUsize::new(0);
    let stopped = AtomicBool::new(false);
    thread::scope(|s| {
        for t in 0..CRASH_THREADS {
            let (answered_before, answered, stopped) = (&answered_before, &answered, &stopped);
            s.spawn(move || {
                for i in (t..CRASH_KEYS).step_by(CRASH_THREADS) {
                    match send_crash_key(addr, i) {
                        Some(a) => {
                            answered_before.lock().expect("lock").insert(i, a);
                            answered.fetch_add(1, Ordering::SeqCst);
                        }
                        None => {
                            stopped.store(true, Ordering::SeqCst);
                            return;
                        }
                    }
                }
            });
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while answered.load(Ordering::SeqCst) < CRASH_KILL_AFTER && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(1));
        }
        server.kill();
    });
    let answered_before = answered_before.into_inner().expect("lock");
    assert!(
        answered_before.len() >= CRASH_KILL_AFTER,
        "the storm was answered before the kill ({})",
        answered_before.len()
    );
    assert!(
        answered_before.len() < CRASH_KEYS && stopped.load(Ordering::SeqCst),
        "the kill landed mid-storm ({} of {CRASH_KEYS} answered)",
        answered_before.len()
    );

    let server = Server::start_on(&db, &[]);
    let after: Mutex<HashMap<usize, Answer>> = Mutex::new(HashMap::new());
    thread::scope(|s| {
        for t in 0..CRASH_THREADS {
            let (after, addr) = (&after, server.addr);
            s.spawn(move || {
                for i in (t..CRASH_KEYS).step_by(CRASH_THREADS) {
                    let a = send_crash_key(addr, i)
                        .unwrap_or_else(|| panic!("key {i}: the restarted server did not answer"));
                    after.lock().expect("lock").insert(i, a);
                }
            });
        }
    });
    let after = after.into_inner().expect("lock");
    let mut recovered = 0;
    for i in 0..CRASH_KEYS {
        let a = &after[&i];
        match answered_before.get(&i) {
            Some(before) => expect_replay(a, before, &format!("key {i} answered before the kill")),
            None => recovered += usize::from(a.replayed),
        }
    }

    let conn = read_only(&db);
    let total = |sql: &str| -> i64 { conn.query_row(sql, [], |r| r.get(0)).expect(sql) };
    assert_eq!(total("SELECT count(*) FROM orders"), CRASH_KEYS as i64, "one order per key, no more");
    assert_eq!(total("SELECT count(*) FROM idempotency_key"), CRASH_KEYS as i64, "one stored response per key");
    for i in 0..CRASH_KEYS {
        let mut stmt = conn.prepare_cached("SELECT order_no FROM orders WHERE user_id = ?1").expect("prepare");
        let order_nos: Vec<String> =
            stmt.query_map([crash_user(i)], |r| r.get(0)).expect("query").collect::<Result<_, _>>().expect("rows");
        assert_eq!(order_nos.len(), 1, "key {i}: exactly one order, got {order_nos:?}");
        let bodies = stored_bodies(&conn, &crash_key(i));
        assert_eq!(bodies.len(), 1, "key {i}: one stored response");
        let (status, body) = &bodies[0];
        assert_eq!(*status, 201, "key {i}");
        let stored: Value = serde_json::from_str(body).expect("stored body is JSON");
        assert_eq!(stored["order_no"], order_nos[0].as_str(), "key {i}: the stored response names the key's order");
        assert_eq!(after[&i].order_no(), order_nos[0], "key {i}: the answer after restart names it too");
    }
    println!(
        "idempotency crash: {} of {CRASH_KEYS} keys answered before SIGKILL, {recovered} committed but unanswered (replayed after restart), {} run after restart",
        answered_before.len(),
        CRASH_KEYS - answered_before.len() - recovered
    );
}

// ---- replay throughput (printed, never asserted) ----

#[test]
fn replay_throughput_in_process() {
    const REPLAYS: usize = 2_000;
    let app = new_app();
    let body = create_body("u-tput", 100);
    let first = post(&app, "/v1/orders", "tput", &body);
    expect_fresh(&first, 201, "first");
    let started = Instant::now();
    for _ in 0..REPLAYS {
        let a = post(&app, "/v1/orders", "tput", &body);
        assert!(a.replayed && a.status == 201, "{}", a.text());
    }
    let s = started.elapsed().as_secs_f64();
    println!(
        "idempotency replay (in process, api::handle): {REPLAYS} replays in {s:.3} s = {:.0}/s",
        REPLAYS as f64 / s
    );
    assert_eq!(orders_of(&app, "u-tput"), 1);
}

#[test]
fn replay_throughput_over_http() {
    const THREADS: usize = 4;
    const PER_THREAD: usize = 250;
    let server = Server::start(&[]);
    let body = create_body("u-tput-http", 100);
    let headers = [JSON, ("Idempotency-Key", "tput-http")];
    let first: Answer = util::request(server.addr, "POST", "/v1/orders", &headers, body.as_bytes()).into();
    expect_fresh(&first, 201, "first");
    let started = Instant::now();
    thread::scope(|s| {
        for _ in 0..THREADS {
            s.spawn(|| {
                for _ in 0..PER_THREAD {
                    let a: Answer = util::request(server.addr, "POST", "/v1/orders", &headers, body.as_bytes()).into();
                    assert!(a.replayed && a.status == 201, "{}", a.text());
                }
            });
        }
    });
    let s = started.elapsed().as_secs_f64();
    let n = THREADS * PER_THREAD;
    println!(
        "idempotency replay (over HTTP, {THREADS} client threads, a connection each): {n} replays in {s:.3} s = {:.0}/s",
        n as f64 / s
    );
}

// ---- across processes, on each engine (the conformance suite) ----

/// Keyed creations spread over `processes` servers on one database, every
/// key sent to two of them at once; the first server is SIGKILLed mid-storm
/// and restarted; then every key is sent again to another process. One order
/// and one stored response per key, and every answer names the same order.
fn keyed_storm_across_processes(db: &crate::engines::Db, processes: usize) {
    let label = format!("{}, {processes} processes", db.label());
    let mut servers: Vec<Server> = (0..processes).map(|_| db.serve(&[])).collect();
    let addrs: Vec<SocketAddr> = servers.iter().map(|s| s.addr).collect();
    let answered_before: Mutex<HashMap<usize, Answer>> = Mutex::new(HashMap::new());
    let answered = AtomicUsize::new(0);
    thread::scope(|s| {
        for t in 0..CRASH_THREADS {
            let (answered_before, answered, addrs) = (&answered_before, &answered, &addrs);
            s.spawn(move || {
                for i in (t..CRASH_KEYS).step_by(CRASH_THREADS) {
                    // The same key to two processes at once: one runs it, the other replays or waits.
                    let (a, b) = thread::scope(|pair| {
                        let twin = pair.spawn(|| send_crash_key(addrs[(i + 1) % addrs.len()], i));
                        (send_crash_key(addrs[i % addrs.len()], i), twin.join().expect("twin"))
                    });
                    if let (Some(a), Some(b)) = (&a, &b) {
                        assert_eq!(a.order_no(), b.order_no(), "key {i}: two processes answered two orders");
                    }
                    if let Some(a) = a.or(b) {
                        answered_before.lock().expect("lock").insert(i, a);
                        answered.fetch_add(1, Ordering::SeqCst);
                    }
                }
            });
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while answered.load(Ordering::SeqCst) < CRASH_KILL_AFTER && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(1));
        }
        servers[0].kill();
    });
    let answered_before = answered_before.into_inner().expect("lock");
    assert!(answered_before.len() >= CRASH_KILL_AFTER, "{label}: answered before the kill: {}", answered_before.len());

    servers[0] = db.serve(&[]);
    let addrs: Vec<SocketAddr> = servers.iter().map(|s| s.addr).collect();
    for i in 0..CRASH_KEYS {
        let a = send_crash_key(addrs[(i + 1) % processes], i).unwrap_or_else(|| panic!("{label}: key {i}: no answer"));
        if let Some(before) = answered_before.get(&i) {
            expect_replay(&a, before, &format!("{label}: key {i} answered before the kill"));
        }
        // And once more on yet another process: the same order.
        let again =
            send_crash_key(addrs[(i + 2) % processes], i).unwrap_or_else(|| panic!("{label}: key {i}: no answer"));
        assert!(again.replayed, "{label}: key {i}: the third answer is a replay");
        assert_eq!(again.order_no(), a.order_no(), "{label}: key {i}");
    }
    let store = db.store();
    let total = |sql: &str| db.count(&store, sql);
    assert_eq!(total("SELECT count(*) FROM orders"), CRASH_KEYS as i64, "{label}: one order per key, no more");
    assert_eq!(
        total("SELECT count(*) FROM idempotency_key"),
        CRASH_KEYS as i64,
        "{label}: one stored response per key"
    );
    for i in 0..CRASH_KEYS {
        let user = crash_user(i);
        assert_eq!(total(&format!("SELECT count(*) FROM orders WHERE user_id = '{user}'")), 1, "{label}: key {i}");
    }
    println!(
        "{label}: keyed storm: {} of {CRASH_KEYS} keys answered by some process; the first process was SIGKILLed after {CRASH_KILL_AFTER}",
        answered_before.len()
    );
}

for_each_engine! {
    fn keyed_requests_run_once_across_two_processes(db) {
        keyed_storm_across_processes(db, 2);
    }
}
