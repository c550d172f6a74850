//! Webhooks to the merchant's app (docs/webhooks.md), against a real
//! receiver over a loopback socket that verifies every delivery with the
//! third-party `standardwebhooks` library (`receiver.rs`).

use crate::engines::Db;
use crate::receiver::{webhook_id, webhook_timestamp, Receiver, SECRETS};
use crate::util::{self, now_ms, Pay, Server};
use payonce::domain::AttemptResult;
use payonce::relay::Relay;
use payonce::webhook::{parse_secrets, WebhookConfig};
use payonce::{App, Clock, Config};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `payonce serve` on `db` with each of `urls` as a `--webhook-url` and the
/// test secrets, its stderr printed if the test fails.
fn serve_with_webhooks(db: &Db, urls: &[String], extra: &[&str]) -> Server {
    let mut args: Vec<&str> = Vec::new();
    for url in urls {
        args.extend(["--webhook-url", url.as_str()]);
    }
    args.extend(extra);
    db.serve_env(&args, &[("PAYONCE_WEBHOOK_SECRET", SECRETS)])
}

/// A paid order: its `order.paid` event.
fn pay_order(server: &Server, order_no: &str) {
    let created = server.post_json("/v1/orders", &json!({"order_no": order_no, "user_id": "u1", "amount": 100}));
    assert_eq!(created.status, 201, "{}", created.text());
    let pay_no = format!("PAY-{order_no}");
    let paid = Pay { pay_no: &pay_no, order_no, amount: 100, status: "SUCCESS" }.send(server);
    assert_eq!(paid.status, 200, "{}", paid.text());
}

/// A refund requested on a paid order: its `order.refunding` event.
fn refund_order(server: &Server, order_no: &str) {
    let refund =
        server.post_json(&format!("/v1/orders/{order_no}/refund"), &json!({"refund_no": format!("R-{order_no}")}));
    assert_eq!(refund.status, 200, "{}", refund.text());
}

fn events(server: &Server) -> Vec<Value> {
    server.get("/v1/events?limit=1000").json()["events"].as_array().cloned().unwrap_or_default()
}

fn deliveries(server: &Server, query: &str) -> Vec<Value> {
    let page = server.get(&format!("/v1/webhooks/deliveries{query}"));
    assert_eq!(page.status, 200, "{}", page.text());
    page.json()["deliveries"].as_array().cloned().unwrap_or_default()
}

fn distinct_ids(calls: &[Value]) -> BTreeSet<String> {
    calls.iter().map(webhook_id).collect()
}

fn metric(server: &Server, line_prefix: &str) -> f64 {
    let text = server.get("/metrics").text();
    text.lines()
        .find_map(|l| l.strip_prefix(line_prefix).and_then(|rest| rest.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no {line_prefix} in /metrics:\n{text}"))
}

#[test]
fn every_delivery_verifies_with_the_standard_webhooks_library() {
    let receiver = Receiver::start();
    let db = Db::sqlite("wh-verify");
    let server = serve_with_webhooks(&db, &[receiver.url("/hooks")], &[]);
    for n in 0..3 {
        pay_order(&server, &format!("V-{n}"));
    }
    refund_order(&server, "V-0");
    let events = events(&server);
    assert_eq!(events.len(), 4);
    let calls = receiver.wait_for("4 deliveries", |log| log.len() >= 4);
    receiver.assert_all_verified(&calls);
    for event in &events {
        let call = calls
            .iter()
            .find(|c| webhook_id(c) == event["event_id"].as_str().unwrap_or_default())
            .unwrap_or_else(|| panic!("{event} was delivered"));
        assert_eq!(call["headers"]["content-type"], "application/json");
        let body: Value = serde_json::from_str(call["body"].as_str().unwrap_or_default()).expect("a JSON body");
        assert_eq!(&body, event, "the body is the event object of GET /v1/events");
        assert_eq!(call["status"], 200);
        let signatures = call["headers"]["webhook-signature"].as_str().unwrap_or_default();
        assert_eq!(signatures.split(' ').filter(|s| s.starts_with("v1,")).count(), 2, "both secrets sign");
        assert!((webhook_timestamp(call) - now_ms() / 1000).abs() < 60, "a timestamp of now: {call}");
    }
    util::eventually(util::EVENTUALLY, "4 delivered", || deliveries(&server, "?status=delivered").len() == 4);
    let listed = deliveries(&server, "");
    for d in &listed {
        for field in [
            "id",
            "endpoint",
            "event_id",
            "event_seq",
            "status",
            "attempts",
            "next_attempt_at",
            "last_status",
            "last_error",
        ] {
            assert!(d.get(field).is_some(), "{field} in {d}");
        }
        assert_eq!(d["attempts"], 1);
        assert_eq!(d["last_status"], 200);
        assert_eq!(d["next_attempt_at"], Value::Null);
    }
    // Each order's detail lists its own deliveries, as the listing has them.
    for order_no in ["V-0", "V-1", "V-2"] {
        let detail = server.get(&format!("/v1/orders/{order_no}")).json();
        let own: Vec<Value> = listed.iter().filter(|d| d["order_no"] == order_no).cloned().collect();
        assert_eq!(own.len(), if order_no == "V-0" { 2 } else { 1 }, "{order_no}: paid (and V-0 refunding)");
        assert_eq!(detail["webhook_deliveries"], Value::Array(own), "{order_no}");
    }
    assert_eq!(metric(&server, "payonce_webhook_deliveries_total{result=\"delivered\"}"), 4.0);
    assert_eq!(metric(&server, "payonce_webhook_pending "), 0.0);
    assert_eq!(metric(&server, "payonce_webhook_oldest_pending_seconds "), 0.0);
}

#[test]
fn a_receiver_failing_twice_then_succeeding_is_retried_on_the_schedule() {
    let receiver = Receiver::start();
    receiver.behave("/flaky", json!({"fail_first": 2, "fail_status": 503}));
    let db = Db::sqlite("wh-flaky");
    let server = serve_with_webhooks(&db, &[receiver.url("/flaky")], &["--webhook-retry-s", "0.3,0.6,5"]);
    pay_order(&server, "F-1");
    let calls = receiver.wait_for("3 attempts", |log| log.iter().any(|c| c["status"] == 200));
    assert_eq!(calls.len(), 3, "{calls:#?}");
    receiver.assert_all_verified(&calls);
    assert_eq!(distinct_ids(&calls).len(), 1, "every attempt carries the event's webhook-id");
    let at: Vec<f64> = calls.iter().map(|c| c["at"].as_f64().unwrap_or_default()).collect();
    // Waits of 0.3 s and 0.6 s, each jittered by at most 20 %.
    assert!(at[1] - at[0] >= 0.3 * 0.8, "first retry after {} s", at[1] - at[0]);
    assert!(at[2] - at[1] >= 0.6 * 0.8, "second retry after {} s", at[2] - at[1]);
    util::eventually(util::EVENTUALLY, "delivered", || deliveries(&server, "?status=delivered").len() == 1);
    let delivery = &deliveries(&server, "")[0];
    assert_eq!(delivery["attempts"], 3);
    assert_eq!(delivery["last_status"], 200);
    assert_eq!(metric(&server, "payonce_webhook_deliveries_total{result=\"retried\"}"), 2.0);
    assert_eq!(metric(&server, "payonce_webhook_deliveries_total{result=\"delivered\"}"), 1.0);
}

#[test]
fn a_receiver_that_times_out_is_retried() {
    let receiver = Receiver::start();
    receiver.behave("/slow", json!({"delay_ms": 1500}));
    let db = Db::sqlite("wh-timeout");
    let server = serve_with_webhooks(
        &db,
        &[receiver.url("/slow")],
        &["--webhook-timeout-ms", "300", "--webhook-retry-s", "0.2,0.2,0.2,0.2,0.2,0.2"],
    );
    pay_order(&server, "T-1");
    receiver.wait_for("two attempts", |log| log.len() >= 2);
    let pending = deliveries(&server, "?status=pending");
    assert_eq!(pending.len(), 1);
    let error = pending[0]["last_error"].as_str().unwrap_or_default().to_lowercase();
    assert!(error.contains("timeout") || error.contains("timed out"), "the timeout is the last error: {error}");
    assert_eq!(pending[0]["last_status"], Value::Null);
    receiver.behave("/slow", json!({}));
    util::eventually(util::EVENTUALLY, "delivered", || deliveries(&server, "?status=delivered").len() == 1);
    let calls = receiver.log();
    assert_eq!(distinct_ids(&calls).len(), 1);
    receiver.assert_all_verified(&calls);
}

#[test]
fn one_orders_failing_calls_do_not_hold_another_order() {
    let receiver = Receiver::start();
    receiver.behave("/orders", json!({"fail_orders": ["STUCK"]}));
    let db = Db::sqlite("wh-order");
    let server = serve_with_webhooks(
        &db,
        &[receiver.url("/orders")],
        &["--webhook-retry-s", "0.4,0.4,0.4", "--webhook-concurrency", "2"],
    );
    pay_order(&server, "STUCK");
    refund_order(&server, "STUCK");
    pay_order(&server, "FLOW");
    refund_order(&server, "FLOW");
    // FLOW's two events arrive, in order, while STUCK's first is still being retried.
    let calls = receiver.wait_for("FLOW's events", |log| log.iter().filter(|c| c["order_no"] == "FLOW").count() == 2);
    let stuck_pending = deliveries(&server, "?status=pending");
    assert!(stuck_pending.iter().any(|d| d["order_no"] == "STUCK"), "STUCK is still retrying: {stuck_pending:#?}");
    let flow: Vec<String> = calls.iter().filter(|c| c["order_no"] == "FLOW").map(webhook_id).collect();
    assert!(flow[0].starts_with("order.paid:") && flow[1].starts_with("order.refunding:"), "{flow:?}");
    // STUCK's second event waits until its first is failed (4 attempts), then is tried.
    let calls = receiver.wait_for("STUCK's second event", |log| {
        log.iter().any(|c| c["order_no"] == "STUCK" && webhook_id(c).starts_with("order.refunding:"))
    });
    let stuck: Vec<&Value> = calls.iter().filter(|c| c["order_no"] == "STUCK").collect();
    let first_of_second = stuck.iter().position(|c| webhook_id(c).starts_with("order.refunding:")).unwrap_or_default();
    assert_eq!(first_of_second, 4, "order.refunding comes after the 4 attempts of order.paid: {stuck:#?}");
    assert!(stuck[..4].iter().all(|c| webhook_id(c).starts_with("order.paid:")));
    receiver.assert_all_verified(&calls);
}

/// One order's endpoint call hangs until the timeout; the other orders'
/// events are delivered meanwhile, each holding a sender only for its call.
#[test]
fn a_hanging_call_holds_only_its_own_order() {
    let receiver = Receiver::start();
    receiver.behave("/hang", json!({"delay_ms": 4000, "delay_orders": ["HANG"]}));
    let db = Db::sqlite("wh-hang");
    let server = serve_with_webhooks(&db, &[receiver.url("/hang")], &["--webhook-timeout-ms", "3000"]);
    pay_order(&server, "HANG");
    receiver.wait_for("the hanging call", |log| log.iter().any(|c| c["order_no"] == "HANG"));
    let started = std::time::Instant::now();
    for n in 0..10 {
        pay_order(&server, &format!("FREE-{n}"));
    }
    let calls = receiver.wait_for("the other orders", |log| log.iter().filter(|c| c["status"] == 200).count() == 10);
    assert!(started.elapsed() < Duration::from_millis(2_500), "delivered while the call hung: {:?}", started.elapsed());
    let hanging = calls.iter().find(|c| c["order_no"] == "HANG").expect("the hanging call");
    assert_eq!(hanging["status"], Value::Null, "still hanging when the others were delivered");
    receiver.assert_all_verified(&calls);
}

#[test]
fn serve_refuses_bad_webhook_settings() {
    let scratch = Db::sqlite("wh-flags");
    let db = scratch.spec.clone();
    let serve = |args: &[&str], secret: Option<&str>| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_payonce"));
        command.args(["serve", "--db", &db, "--listen", "127.0.0.1:0", "--dev"]).args(args);
        command.env_remove("PAYONCE_WEBHOOK_SECRET");
        if let Some(secret) = secret {
            command.env("PAYONCE_WEBHOOK_SECRET", secret);
        }
        let out = command.stdout(std::process::Stdio::null()).output().expect("run serve");
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    for url in ["ftp://merchant.example/hook", "merchant.example/hook", "http://"] {
        let (code, stderr) = serve(&["--webhook-url", url], Some(SECRETS));
        assert_eq!(code, Some(2), "{url}: {stderr}");
        assert!(stderr.contains("--webhook-url") && stderr.contains("http://"), "{stderr}");
    }
    for secret in ["not-a-secret", "whsec_", "whsec_***"] {
        let (code, stderr) = serve(&["--webhook-url", "http://127.0.0.1:9/"], Some(secret));
        assert_eq!(code, Some(2), "{secret}: {stderr}");
        assert!(stderr.contains("PAYONCE_WEBHOOK_SECRET") && stderr.contains("whsec_"), "{stderr}");
    }
    let (code, stderr) = serve(&["--webhook-url", "http://127.0.0.1:9/"], None);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("PAYONCE_WEBHOOK_SECRET"), "{stderr}");
    let (code, stderr) = serve(&["--webhook-retry-s", "5,soon"], None);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("--webhook-retry-s"), "{stderr}");
}

#[test]
fn the_admin_routes_need_the_token() {
    let db = Db::sqlite("wh-auth");
    let server = serve_with_webhooks(&db, &["http://127.0.0.1:9/".to_owned()], &["--api-token", "ops:s3cret"]);
    for (method, path) in [
        ("GET", "/v1/webhooks/deliveries"),
        ("POST", "/v1/webhooks/deliveries/1/retry"),
        ("POST", "/v1/webhooks/endpoints/enable"),
        ("POST", "/v1/webhooks/replay"),
    ] {
        let refused = crate::util::request(server.addr, method, path, &[("Content-Type", "application/json")], b"{}");
        assert_eq!((refused.status, refused.error_code().as_str()), (401, "unauthorized"), "{method} {path}");
    }
    let allowed =
        crate::util::request(server.addr, "GET", "/v1/webhooks/deliveries", &[("Authorization", "Bearer s3cret")], b"");
    assert_eq!(allowed.status, 200);
}

/// The library's clock and payonce's both move ten minutes between two
/// attempts: the retry verifies because it is signed afresh; had it reused
/// the first attempt's timestamp, the receiver would refuse it as too old.
#[test]
fn a_retry_more_than_five_minutes_after_the_first_attempt_still_verifies() {
    let receiver = Receiver::start();
    receiver.behave("/later", json!({"fail_first": 1}));
    let clock = Clock::manual(now_ms());
    let config = Config {
        platforms: payonce::platforms::Platforms::with([payonce::platforms::Platform::notices(
            payonce::platforms::generic::Generic::new(vec![crate::util::SECRET.as_bytes().to_vec()]),
        )]),
        webhooks: WebhookConfig {
            endpoints: vec![receiver.url("/later")],
            secrets: payonce::held::Held::new(parse_secrets(SECRETS).expect("secrets")),
            timeout_ms: 5_000,
            retry_schedule_ms: vec![600_000],
            ..WebhookConfig::default()
        },
        ..Config::default()
    };
    let app = Arc::new(App::open(":memory:", clock.clone(), config).expect("app"));
    let relay = Relay::new(Arc::clone(&app)).expect("relay");
    app.orders()
        .create_order(&payonce::CreateOrder {
            order_no: "LATER".into(),
            user_id: "u1".into(),
            amount: 100,
            currency: "CNY".into(),
            expires_in_s: None,
        })
        .expect("order");
    Pay { pay_no: "PAY-LATER", order_no: "LATER", amount: 100, status: "SUCCESS" }.deliver(&app);
    let first = relay.run_once().expect("round 1");
    assert!(matches!(first[..], [AttemptResult::Retry { status: Some(500), .. }]), "{first:?}");
    assert!(relay.run_once().expect("round 2").is_empty(), "nothing is due before the wait");
    // Ten minutes and a bit (the wait of 600 s is jittered up to 720 s).
    clock.advance_ms(721_000);
    receiver.set_clock_offset(721.0);
    let second = relay.run_once().expect("round 3");
    assert!(matches!(second[..], [AttemptResult::Delivered { status: 200 }]), "{second:?}");
    let calls = receiver.log();
    assert_eq!(calls.len(), 2);
    assert!(webhook_timestamp(&calls[1]) - webhook_timestamp(&calls[0]) >= 600, "signed afresh: {calls:#?}");
    assert_eq!(webhook_id(&calls[0]), webhook_id(&calls[1]));
    receiver.assert_all_verified(&calls[1..]);
    if receiver.library.is_some() {
        assert_eq!(calls[0]["verified"], true, "the first attempt verified when it was made");
    }
}

for_each_engine! {
    fn a_new_endpoint_starts_after_the_last_event_and_replay_sends_the_older_ones(db) {
        let receiver = Receiver::start();
        {
            let plain = db.serve(&[]);
            pay_order(&plain, "OLD-1");
            pay_order(&plain, "OLD-2");
        }
        let url = receiver.url("/late");
        let server = serve_with_webhooks(db, std::slice::from_ref(&url), &[]);
        pay_order(&server, "NEW-1");
        let seqs: Vec<i64> = events(&server).iter().map(|e| e["seq"].as_i64().unwrap_or_default()).collect();
        assert_eq!(seqs.len(), 3);
        let calls = receiver.wait_for("the new event", |log| !log.is_empty());
        std::thread::sleep(Duration::from_millis(300));
        let calls = if calls.len() == 1 { receiver.log() } else { calls };
        assert_eq!(calls.len(), 1, "only the event after the endpoint was configured: {calls:#?}");
        assert!(webhook_id(&calls[0]).starts_with("order.paid:"));

        // Bad replays: each a clear 4xx.
        let bad =
            server.post_json("/v1/webhooks/replay", &json!({"endpoint": "http://elsewhere.example/", "after_seq": 0}));
        assert_eq!((bad.status, bad.error_code().as_str()), (404, "endpoint_not_found"));
        let bad = server.post_json("/v1/webhooks/replay", &json!({"endpoint": url, "after_seq": 3, "until_seq": 2}));
        assert_eq!((bad.status, bad.error_code().as_str()), (400, "invalid_request"));
        let bad = server.post_json("/v1/webhooks/replay", &json!({"endpoint": url}));
        assert_eq!(bad.status, 400);
        let bad = server.post_json("/v1/webhooks/replay", &json!({"endpoint": url, "after_seq": "zero"}));
        assert_eq!(bad.status, 400);

        // (0, seq of OLD-2]: the two older events, delivered with their own webhook-ids.
        let replayed =
            server.post_json("/v1/webhooks/replay", &json!({"endpoint": url, "after_seq": 0, "until_seq": seqs[1]}));
        assert_eq!(replayed.status, 200, "{}", replayed.text());
        assert_eq!(replayed.json()["queued"], 2);
        let calls = receiver.wait_for("the replayed events", |log| log.len() >= 3);
        receiver.assert_all_verified(&calls);
        let all_ids: BTreeSet<String> =
            events(&server).iter().map(|e| e["event_id"].as_str().unwrap_or_default().to_owned()).collect();
        assert_eq!(distinct_ids(&calls), all_ids);

        // Replaying a delivered event sends it again under the same webhook-id.
        let again = server.post_json("/v1/webhooks/replay", &json!({"endpoint": url, "after_seq": seqs[1]}));
        assert_eq!(again.json()["queued"], 1);
        let calls = receiver.wait_for("the re-sent event", |log| log.len() >= 4);
        let new_event_calls: Vec<&Value> = calls.iter().filter(|c| webhook_id(c) == webhook_id(&calls[0])).collect();
        assert_eq!(new_event_calls.len(), 2, "the same event twice, with the same webhook-id");
        receiver.assert_all_verified(&calls);
    }

    fn retry_after_stretches_the_wait_and_the_last_failure_is_a_dead_letter(db) {
        let receiver = Receiver::start();
        receiver.behave("/down", json!({"status": 500, "retry_after": "1"}));
        let server = serve_with_webhooks(db, &[receiver.url("/down")], &["--webhook-retry-s", "0.05"]);
        pay_order(&server, "D-1");
        util::eventually(util::EVENTUALLY, "a dead letter", || deliveries(&server, "?status=failed").len() == 1);
        let calls = receiver.log();
        assert_eq!(calls.len(), 2, "one retry on a one-wait schedule: {calls:#?}");
        let waited = calls[1]["at"].as_f64().unwrap_or_default() - calls[0]["at"].as_f64().unwrap_or_default();
        assert!(waited >= 0.95, "Retry-After: 1 stretched the 0.05 s wait to {waited} s");
        let failed = &deliveries(&server, "?status=failed")[0];
        assert_eq!(failed["attempts"], 2);
        assert_eq!(failed["last_status"], 500);
        assert!(failed["last_error"].as_str().unwrap_or_default().contains("HTTP 500"), "{failed}");
        assert_eq!(metric(&server, "payonce_webhook_deliveries_total{result=\"failed\"}"), 1.0);
        // The order's detail lists its delivery as the listing does, and the
        // database's counts have the dead letter (every process's, any restart).
        let detail = server.get("/v1/orders/D-1").json();
        assert_eq!(detail["webhook_deliveries"], json!([failed.clone()]), "{detail}");
        let stats = server.get("/v1/admin/stats?window=1h").json();
        let finished = |status: &str| -> i64 {
            let buckets = stats["buckets"].as_array().cloned().unwrap_or_default();
            buckets.iter().filter_map(|b| b["webhook_deliveries"][status].as_i64()).sum()
        };
        assert_eq!((finished("failed"), finished("delivered")), (1, 0), "{stats}");

        // Retrying a dead letter queues it again with the same webhook-id.
        receiver.behave("/down", json!({"status": 200}));
        let id = failed["id"].as_i64().unwrap_or_default();
        let retried = server.post_json(&format!("/v1/webhooks/deliveries/{id}/retry"), &json!({}));
        assert_eq!(retried.status, 200, "{}", retried.text());
        assert_eq!(retried.json()["status"], "pending");
        receiver.wait_for("the retried delivery", |log| log.iter().any(|c| c["status"] == 200));
        util::eventually(util::EVENTUALLY, "delivered", || deliveries(&server, "?status=delivered").len() == 1);
        assert_eq!(distinct_ids(&receiver.log()).len(), 1);
        // A delivered delivery is not retried; an unknown one is 404.
        let again = server.post_json(&format!("/v1/webhooks/deliveries/{id}/retry"), &json!({}));
        assert_eq!((again.status, again.error_code().as_str()), (409, "invalid_transition"));
        for unknown in ["999999", "abc", "0", "-1", "01"] {
            let missing = server.post_json(&format!("/v1/webhooks/deliveries/{unknown}/retry"), &json!({}));
            assert_eq!((missing.status, missing.error_code().as_str()), (404, "delivery_not_found"), "{unknown}");
        }
    }

    /// A receiver's error body with NUL bytes and invalid UTF-8 is recorded
    /// escaped, and the delivery still fails after its schedule's attempts,
    /// no more; the order's next event is delivered after it.
    fn a_receivers_nul_bytes_and_invalid_utf8_do_not_stop_the_schedule(db) {
        let receiver = Receiver::start();
        let body: &[u8] = b"bad\x00answer \xff\xfe end";
        let hex: String = body.iter().map(|b| format!("{b:02x}")).collect();
        receiver.behave("/nul", json!({"fail_ids": ["order.paid:"], "fail_body_hex": hex}));
        let flags = ["--webhook-retry-s", "0.1,0.1", "--webhook-timeout-ms", "1000"];
        let server = serve_with_webhooks(db, &[receiver.url("/nul")], &flags);
        pay_order(&server, "NUL-1");
        refund_order(&server, "NUL-1");
        let calls = receiver.wait_for("the order's next event", |log| {
            log.iter().any(|c| webhook_id(c).starts_with("order.refunding:") && c["status"] == 200)
        });
        let paid_calls = |calls: &[Value]| calls.iter().filter(|c| webhook_id(c).starts_with("order.paid:")).count();
        assert_eq!(paid_calls(&calls), 3, "one attempt and two retries: {calls:#?}");
        let failed = deliveries(&server, "?status=failed");
        assert_eq!(failed.len(), 1, "{failed:#?}");
        assert_eq!(failed[0]["attempts"], 3);
        assert_eq!(failed[0]["last_status"], 500);
        let error = failed[0]["last_error"].as_str().unwrap_or_default();
        assert_eq!(error, "HTTP 500: bad\\u0000answer \u{fffd}\u{fffd} end", "recorded escaped");
        util::eventually(util::EVENTUALLY, "the next event delivered", || deliveries(&server, "?status=delivered").len() == 1);
        std::thread::sleep(Duration::from_millis(1_500));
        assert_eq!(paid_calls(&receiver.log()), 3, "nothing more after the dead letter");
        assert_eq!(metric(&server, "payonce_webhook_deliveries_total{result=\"failed\"}"), 1.0);
    }

    fn a_410_disables_the_endpoint_until_the_admin_call_enables_it(db) {
        let receiver = Receiver::start();
        receiver.behave("/gone", json!({"status": 410}));
        let url = receiver.url("/gone");
        let server = serve_with_webhooks(db, std::slice::from_ref(&url), &[]);
        pay_order(&server, "G-1");
        util::eventually(util::EVENTUALLY, "disabled", || deliveries(&server, "?status=disabled").len() == 1);
        assert_eq!(metric(&server, "payonce_webhook_deliveries_total{result=\"disabled\"}"), 1.0);
        // While disabled nothing more is sent, and neither retry nor replay is taken.
        pay_order(&server, "G-2");
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(receiver.log().len(), 1);
        let id = deliveries(&server, "?status=disabled")[0]["id"].as_i64().unwrap_or_default();
        let retry = server.post_json(&format!("/v1/webhooks/deliveries/{id}/retry"), &json!({}));
        assert_eq!((retry.status, retry.error_code().as_str()), (409, "invalid_transition"));
        let replay = server.post_json("/v1/webhooks/replay", &json!({"endpoint": url, "after_seq": 0}));
        assert_eq!((replay.status, replay.error_code().as_str()), (409, "invalid_transition"));

        let unknown = server.post_json("/v1/webhooks/endpoints/enable", &json!({"endpoint": "http://nowhere.example/"}));
        assert_eq!((unknown.status, unknown.error_code().as_str()), (404, "endpoint_not_found"));
        let missing = server.post_json("/v1/webhooks/endpoints/enable", &json!({}));
        assert_eq!(missing.status, 400);
        receiver.behave("/gone", json!({}));
        let enabled = server.post_json("/v1/webhooks/endpoints/enable", &json!({"endpoint": url}));
        assert_eq!(enabled.status, 200, "{}", enabled.text());
        assert_eq!(enabled.json()["status"], "enabled");
        assert_eq!(enabled.json()["resumed"], 1);
        let calls = receiver.wait_for("both events", |log| log.iter().filter(|c| c["status"] == 200).count() == 2);
        receiver.assert_all_verified(&calls);
        // Two orders: neither waits for the other.
        let delivered: BTreeSet<String> = calls
            .iter()
            .filter(|c| c["status"] == 200)
            .map(|c| c["order_no"].as_str().unwrap_or_default().to_owned())
            .collect();
        assert_eq!(delivered, BTreeSet::from(["G-1".to_owned(), "G-2".to_owned()]));
        util::eventually(util::EVENTUALLY, "both delivered", || deliveries(&server, "?status=delivered").len() == 2);
    }

    fn sigkill_with_deliveries_in_flight_loses_no_event(db) {
        let receiver = Receiver::start();
        receiver.behave("/k", json!({"delay_ms": 400}));
        let url = receiver.url("/k");
        let flags = ["--webhook-timeout-ms", "1000", "--webhook-concurrency", "4", "--webhook-retry-s", "0.1"];
        let mut server = serve_with_webhooks(db, std::slice::from_ref(&url), &flags);
        for n in 0..12 {
            pay_order(&server, &format!("K-{n}"));
        }
        let all: BTreeSet<String> =
            events(&server).iter().map(|e| e["event_id"].as_str().unwrap_or_default().to_owned()).collect();
        assert_eq!(all.len(), 12);
        receiver.wait_for("calls in flight", |log| log.len() >= 2);
        server.kill();
        receiver.behave("/k", json!({}));
        let server = serve_with_webhooks(db, std::slice::from_ref(&url), &flags);
        util::eventually(util::EVENTUALLY, "every event delivered", || deliveries(&server, "?status=delivered").len() == 12);
        let calls = receiver.log();
        assert_eq!(distinct_ids(&calls), all, "every event reached the endpoint at least once");
        receiver.assert_all_verified(&calls);
    }

    fn delivery_listing_pages_and_refuses_bad_queries(db) {
        let receiver = Receiver::start();
        let server = serve_with_webhooks(db, &[receiver.url("/list")], &[]);
        for n in 0..5 {
            pay_order(&server, &format!("L-{n}"));
        }
        util::eventually(util::EVENTUALLY, "5 delivered", || deliveries(&server, "?status=delivered").len() == 5);
        let first = server.get("/v1/webhooks/deliveries?limit=2").json();
        assert_eq!(first["deliveries"].as_array().map(Vec::len), Some(2));
        let mut ids: Vec<i64> =
            first["deliveries"].as_array().into_iter().flatten().map(|d| d["id"].as_i64().unwrap_or_default()).collect();
        let mut cursor = first["next_after"].as_str().map(str::to_owned);
        while let Some(after) = cursor {
            let page = server.get(&format!("/v1/webhooks/deliveries?limit=2&after={after}")).json();
            ids.extend(page["deliveries"].as_array().into_iter().flatten().map(|d| d["id"].as_i64().unwrap_or_default()));
            cursor = page["next_after"].as_str().map(str::to_owned);
        }
        assert_eq!(ids.len(), 5);
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
        // As every list endpoint: a limit above 1000 is clamped to it.
        assert_eq!(server.get("/v1/webhooks/deliveries?limit=5000").json()["deliveries"].as_array().map(Vec::len), Some(5));
        for bad in ["?status=lost", "?limit=0", "?after=-1", "?after=x"] {
            let refused = server.get(&format!("/v1/webhooks/deliveries{bad}"));
            assert_eq!(refused.status, 400, "{bad}: {}", refused.text());
        }
    }

    /// Two processes on one database, one endpoint: each attempt is claimed
    /// in the database, so every event is sent once.
    fn two_processes_claim_each_attempt_once(db) {
        let receiver = Receiver::start();
        let url = receiver.url("/shared");
        let a = serve_with_webhooks_on(db, &url);
        let b = serve_with_webhooks_on(db, &url);
        for n in 0..10 {
            pay_order(if n % 2 == 0 { &a } else { &b }, &format!("P-{n}"));
        }
        let calls = receiver.wait_for("10 events", |log| distinct_ids(log).len() == 10);
        util::eventually(util::EVENTUALLY, "10 delivered", || deliveries(&a, "?status=delivered").len() == 10);
        std::thread::sleep(Duration::from_millis(300));
        let calls = if calls.len() == 10 { receiver.log() } else { calls };
        let mut per_id: BTreeMap<String, usize> = BTreeMap::new();
        for call in &calls {
            *per_id.entry(webhook_id(call)).or_default() += 1;
        }
        assert!(per_id.values().all(|n| *n == 1), "one attempt per event across both processes: {per_id:#?}");
        receiver.assert_all_verified(&calls);
    }
}

fn serve_with_webhooks_on(db: &Db, url: &str) -> Server {
    db.serve_env(&["--webhook-url", url], &[("PAYONCE_WEBHOOK_SECRET", SECRETS)])
}

/// A receiver that accepts and never answers does not hold payonce's exit:
/// on SIGTERM the relay leaves its call in flight to the lease (a restart
/// makes it again), and payonce exits within its shutdown grace, not after
/// `--webhook-timeout-ms`.
#[test]
fn a_receiver_that_never_answers_does_not_hold_the_exit() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}/hook", listener.local_addr().expect("addr"));
    let accepted = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let held = Arc::clone(&accepted);
    std::thread::spawn(move || {
        let mut open = Vec::new();
        for stream in listener.incoming().flatten() {
            held.store(true, std::sync::atomic::Ordering::SeqCst);
            open.push(stream); // read nothing, answer nothing, close nothing
        }
    });
    let db = Db::sqlite("webhook_hanging_exit");
    let mut server =
        serve_with_webhooks(&db, &[url], &["--webhook-timeout-ms", "60000", "--shutdown-grace-ms", "1000"]);
    pay_order(&server, "HANG-1");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !accepted.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "the relay never called the receiver");
        std::thread::sleep(Duration::from_millis(20));
    }
    let asked = Instant::now();
    server.signal(15);
    let status = server.wait_exit(Duration::from_secs(30));
    assert_eq!(status.and_then(|s| s.code()), Some(0), "payonce exits 0 on SIGTERM");
    assert!(
        asked.elapsed() < Duration::from_secs(15),
        "exited {:?} after SIGTERM, not after the 60 s webhook timeout",
        asked.elapsed()
    );
}
