//! `GET /v1/admin/stats?window=1h|24h` (docs/operations.md, "Counts over
//! time") on both engines: counts from the database per aligned bucket,
//! oldest first, every known key at 0, the window's edges, a restart that
//! answers the same, and the bad windows; and SQLite's plans of its queries.

use crate::engines::Db;
use crate::util::Pay;
use payonce::api::{self, Request};
use payonce::app::{App, Config, CreateOrder};
use payonce::clock::{format_ms, parse_rfc3339_ms, Clock};
use payonce::domain::{PlatformStatus, RefundCallback};
use payonce::ops::Mode;
use serde_json::{json, Value};

fn ms(text: &str) -> i64 {
    parse_rfc3339_ms(text).unwrap_or_else(|| panic!("time {text:?}"))
}

/// 12:00:00.000 UTC: a bucket start of both windows.
const T0: &str = "2026-03-10T12:00:00.000Z";

fn get(app: &App, query: &str) -> (u16, Value) {
    let req = Request {
        method: "GET".into(),
        path: "/v1/admin/stats".into(),
        query: query.into(),
        headers: Vec::new(),
        body: Vec::new(),
    };
    let resp = api::handle(app, &req);
    let body = serde_json::from_slice(&resp.body).unwrap_or_else(|e| panic!("{query}: not JSON ({e})"));
    (resp.status, body)
}

fn stats(app: &App, window: &str) -> Value {
    let (status, body) = get(app, &format!("window={window}"));
    assert_eq!(status, 200, "{body}");
    body
}

fn at(app: &App, time: &str) {
    assert!(app.clock().set_ms(ms(time)), "manual clock");
}

fn order(app: &App, order_no: &str) {
    let create = CreateOrder {
        order_no: order_no.into(),
        user_id: "u1".into(),
        amount: 1000,
        currency: "CNY".into(),
        expires_in_s: Some(86_400),
    };
    app.orders().create_order(&create).unwrap_or_else(|e| panic!("create {order_no}: {e}"));
}

fn pay(app: &App, pay_no: &str, order_no: &str, status: &str) -> String {
    Pay { pay_no, order_no, amount: 1000, status }.deliver(app).outcome_str().to_owned()
}

fn refund_result(app: &App, refund_no: &str, order_no: &str) {
    let cb = RefundCallback {
        channel: "generic".into(),
        refund_no: refund_no.into(),
        order_no: order_no.into(),
        status: PlatformStatus::Success,
        settled_at: None,
        amount: None,
        refunded_total: None,
    };
    app.refunds().deliver_refund(&cb).unwrap_or_else(|e| panic!("refund {refund_no}: {e}"));
}

/// The non-zero counts of one series of the buckets, as (start, key, n).
fn nonzero(body: &Value, series: &str) -> Vec<(String, String, i64)> {
    let mut out = Vec::new();
    for bucket in body["buckets"].as_array().expect("buckets") {
        let start = bucket["start"].as_str().expect("start");
        for (key, n) in bucket[series].as_object().expect("series") {
            let n = n.as_i64().expect("count");
            if n != 0 {
                out.push((start.to_owned(), key.clone(), n));
            }
        }
    }
    out.sort();
    out
}

fn row(start: &str, key: &str, n: i64) -> (String, String, i64) {
    (start.to_owned(), key.to_owned(), n)
}

/// The day of data: each kind of count in a bucket of its own.
fn seed(app: &App, db: &Db) {
    for order_no in ["S-EDGE-OUT", "S-EDGE-IN", "S-A", "S-B", "S-C", "S-D", "S-E"] {
        order(app, order_no);
    }
    // One millisecond before the hour's first bucket, and exactly at its start.
    at(app, "2026-03-10T11:59:59.999Z");
    assert_eq!(pay(app, "SP-OUT", "S-EDGE-OUT", "SUCCESS"), "applied");
    at(app, T0);
    assert_eq!(pay(app, "SP-IN", "S-EDGE-IN", "SUCCESS"), "applied");
    // 12:00: applied; 12:01: a failed payment and a second payment of S-A.
    at(app, "2026-03-10T12:00:10.000Z");
    assert_eq!(pay(app, "SP-A", "S-A", "SUCCESS"), "applied");
    at(app, "2026-03-10T12:01:59.999Z");
    assert_eq!(pay(app, "SP-B", "S-B", "FAILED"), "payment_failed");
    assert_eq!(pay(app, "SP-A2", "S-A", "SUCCESS"), "already_paid");
    // A re-delivery writes nothing, so it is counted nowhere.
    assert_eq!(pay(app, "SP-A", "S-A", "SUCCESS"), "duplicate", "a re-delivery");
    // Refunds: S-C's requested at 12:02 and settled at 12:03 (counted once,
    // SUCCEEDED at 12:03); S-D's requested at 12:03 and still REQUESTED.
    assert_eq!(pay(app, "SP-C", "S-C", "SUCCESS"), "applied");
    assert_eq!(pay(app, "SP-D", "S-D", "SUCCESS"), "applied");
    at(app, "2026-03-10T12:02:30.000Z");
    app.refunds().request_refund_keyed("S-C", "SR-C", None).expect("refund S-C");
    at(app, "2026-03-10T12:03:00.000Z");
    refund_result(app, "SR-C", "S-C");
    app.refunds().request_refund_keyed("S-D", "SR-D", None).expect("refund S-D");
    // 12:04: a record-only record, waiting: `recorded` at its received_at.
    at(app, "2026-03-10T12:04:00.000Z");
    app.operations().set_mode(Mode::RecordOnly, "test", None).expect("record_only");
    assert_eq!(pay(app, "SP-E", "S-E", "SUCCESS"), "recorded");
    app.operations().set_mode(Mode::Normal, "test", None).expect("normal");
    // Webhook deliveries of S-A's order.paid: one delivered at 12:05, one
    // dead-lettered at 12:06, one pending since 12:50.
    let store = db.store();
    let seq = db.count(&store, "SELECT min(seq) FROM outbox_event");
    for sql in [
        "INSERT INTO webhook_endpoint (endpoint, status, from_seq, relayed_seq, disabled_at, created_at)
         VALUES ('https://a.example/hook', 'enabled', 0, 0, NULL, '2026-03-10T11:00:00.000Z')"
            .to_owned(),
        format!(
            "INSERT INTO webhook_delivery (endpoint, event_seq, event_id, order_no, status, attempts, next_attempt_at,
                                           last_attempt_at, last_status, last_error, queued_at)
             VALUES ('https://a.example/hook', {seq}, 'e-1', 'S-A', 'delivered', 1, NULL,
                     '2026-03-10T12:05:01.000Z', 200, NULL, '2026-03-10T12:05:00.000Z'),
                    ('https://a.example/hook', {seq}, 'e-2', 'S-A', 'failed', 5, NULL,
                     '2026-03-10T12:06:59.000Z', 500, 'HTTP 500', '2026-03-10T12:05:00.000Z'),
                    ('https://a.example/hook', {seq}, 'e-3', 'S-A', 'pending', 0, '2026-03-10T12:50:00.000Z',
                     NULL, NULL, NULL, '2026-03-10T12:50:00.000Z')"
        ),
    ] {
        store.execute_raw(&sql).unwrap_or_else(|e| panic!("{}: {sql}: {e}", db.label()));
    }
}

fn open(db: &Db, now: &str) -> App {
    App::open(&db.spec, Clock::manual(ms(now)), Config::default()).unwrap_or_else(|e| panic!("open {}: {e}", db.spec))
}

for_each_engine! {
    fn counts_per_bucket_survive_a_restart(db) {
        let label = db.label();
        let app = open(db, "2026-03-10T11:00:00.000Z");
        seed(&app, db);
        at(&app, "2026-03-10T12:59:59.999Z");
        let hour = stats(&app, "1h");
        assert_eq!(hour["window"], "1h", "{label}");
        assert_eq!(hour["bucket_s"], 60, "{label}");
        let buckets = hour["buckets"].as_array().expect("buckets");
        assert_eq!(buckets.len(), 60, "{label}: empty buckets included");
        for (i, bucket) in buckets.iter().enumerate() {
            assert_eq!(bucket["start"], format_ms(ms(T0) + 60_000 * i as i64), "{label}: aligned, oldest first");
            let keys: Vec<&str> = bucket["payments"].as_object().expect("payments").keys().map(String::as_str).collect();
            for outcome in ["recorded", "payment_failed", "paid_after_close", "already_paid", "amount_mismatch", "applied"] {
                assert!(keys.contains(&outcome), "{label}: {outcome} always present: {bucket}");
            }
            assert_eq!(bucket["refunds"].as_object().map(|o| o.len()), Some(3), "{label}: {bucket}");
            assert_eq!(bucket["webhook_deliveries"].as_object().map(|o| o.len()), Some(2), "{label}: {bucket}");
        }
        // SP-IN at exactly 12:00:00.000 and SP-A; SP-OUT, 1 ms earlier, is outside.
        assert_eq!(
            nonzero(&hour, "payments"),
            [
                row("2026-03-10T12:00:00.000Z", "applied", 2),
                row("2026-03-10T12:01:00.000Z", "already_paid", 1),
                row("2026-03-10T12:01:00.000Z", "applied", 2),
                row("2026-03-10T12:01:00.000Z", "payment_failed", 1),
                row("2026-03-10T12:04:00.000Z", "recorded", 1),
            ],
            "{label}: {hour}"
        );
        assert_eq!(
            nonzero(&hour, "refunds"),
            [row("2026-03-10T12:03:00.000Z", "REQUESTED", 1), row("2026-03-10T12:03:00.000Z", "SUCCEEDED", 1)],
            "{label}"
        );
        assert_eq!(
            nonzero(&hour, "webhook_deliveries"),
            [row("2026-03-10T12:05:00.000Z", "delivered", 1), row("2026-03-10T12:06:00.000Z", "failed", 1)],
            "{label}"
        );
        assert_eq!(hour["now"]["webhook_pending"], 1, "{label}");
        assert_eq!(hour["now"]["webhook_oldest_pending_s"], 599, "{label}: 12:50:00 to 12:59:59.999, whole seconds");
        let findings = hour["now"]["findings"].as_object().expect("findings");
        assert_eq!(findings.len(), payonce::domain::FINDING_KINDS.len(), "{label}: every kind: {findings:?}");
        assert_eq!(findings["refund_required"], 1, "{label}: SP-A2");
        assert_eq!(findings["received_not_applied"], 1, "{label}: SP-E waits past 10 minutes in normal mode");
        assert_eq!(findings.values().filter_map(Value::as_i64).sum::<i64>(), 2, "{label}: {findings:?}");
        // The inspection's own answer agrees.
        let inspected = app.operations().inspect().expect("inspect");
        assert_eq!(inspected.len(), 2, "{label}");

        // The day: 15-minute buckets, the newest holding now (12:45).
        let day = stats(&app, "24h");
        assert_eq!((day["window"].clone(), day["bucket_s"].clone()), (json!("24h"), json!(900)), "{label}");
        let buckets = day["buckets"].as_array().expect("buckets");
        assert_eq!(buckets.len(), 96, "{label}");
        assert_eq!(buckets[0]["start"], "2026-03-09T13:00:00.000Z", "{label}");
        assert_eq!(buckets[95]["start"], "2026-03-10T12:45:00.000Z", "{label}");
        assert_eq!(
            nonzero(&day, "payments"),
            [
                row("2026-03-10T11:45:00.000Z", "applied", 1),
                row("2026-03-10T12:00:00.000Z", "already_paid", 1),
                row("2026-03-10T12:00:00.000Z", "applied", 4),
                row("2026-03-10T12:00:00.000Z", "payment_failed", 1),
                row("2026-03-10T12:00:00.000Z", "recorded", 1),
            ],
            "{label}: {day}"
        );

        // A restart (the same database, opened again): the same answer.
        drop(app);
        let again = open(db, "2026-03-10T12:59:59.999Z");
        assert_eq!(stats(&again, "1h"), hour, "{label}: the counts live in the database");
        assert_eq!(stats(&again, "24h"), day, "{label}");

        // One millisecond later the hour's window moves by a bucket: 12:00 leaves it.
        at(&again, "2026-03-10T13:00:00.000Z");
        let later = stats(&again, "1h");
        assert_eq!(later["buckets"][0]["start"], "2026-03-10T12:01:00.000Z", "{label}");
        assert_eq!(later["buckets"][59]["start"], "2026-03-10T13:00:00.000Z", "{label}");
        let applied: i64 = nonzero(&later, "payments").iter().filter(|r| r.1 == "applied").map(|r| r.2).sum();
        assert_eq!(applied, 2, "{label}: only 12:01's applied payments are left");
    }

    fn a_bad_window_is_refused(db) {
        let app = open(db, T0);
        for query in ["", "window=", "window=2h", "window=1H", "window=1h&window=24h", "other=1"] {
            let (status, body) = get(&app, query);
            assert_eq!(status, 400, "{query:?}");
            assert_eq!(body["error"]["code"], "invalid_request", "{query:?}: {body}");
            assert!(body["error"]["message"].as_str().is_some_and(|m| m.contains("window")), "{query:?}: {body}");
        }
        let empty = stats(&app, "24h");
        assert!(nonzero(&empty, "payments").is_empty() && nonzero(&empty, "refunds").is_empty(), "{empty}");
        assert_eq!(empty["now"]["webhook_pending"], 0);
        assert_eq!(empty["now"]["webhook_oldest_pending_s"], Value::Null, "null with nothing pending");
    }
}

/// Each statement reads the index docs/operations.md names (SQLite's plan),
/// (migration 14 gave the settled refunds and the ended deliveries theirs).
#[test]
fn sqlite_plans_use_the_indexes() {
    let db = Db::sqlite("stats_plans");
    let store = db.store();
    let conn = store.raw_connection().expect("connection");
    let plans: Vec<String> = payonce::store::STATS_STATEMENTS
        .iter()
        .map(|sql| {
            let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).expect("explain");
            let details = stmt
                .query_map(["2026-03-10T12:00:00.000Z", "2026-03-10T13:00:00.000Z"], |r| r.get::<_, String>(3))
                .expect("plan");
            details.collect::<Result<Vec<_>, _>>().expect("plan rows").join("; ")
        })
        .collect();
    let expected = [
        "SEARCH pay_callback_log USING COVERING INDEX ix_pay_callback_log_decided (outcome=? AND decided_at>? AND decided_at<?)",
        // ix_pay_callback_log_decided or ix_pay_callback_log_outcome: either holds only the waiting records.
        "(outcome=?)",
        "USING INDEX ix_refund_settled_at (settled_at>? AND settled_at<?)",
        "USING INDEX uk_refund_requested",
        "USING INDEX uk_refund_payment_in_flight",
        "USING INDEX ix_webhook_delivery_finished (last_attempt_at>? AND last_attempt_at<?)",
    ];
    for (plan, expected) in plans.iter().zip(expected) {
        assert!(plan.contains(expected), "{plan:?} should contain {expected:?}");
    }
}
