//! Money payonce did not want, returned once across a SIGKILL: a real
//! `payonce serve --refund-unwanted auto` against `payonce-sim platforms`.
//! The buyer pays one order at both platforms; payonce's sync hears of both,
//! applies one and records the other `already_paid`, its refund requested
//! in the same transaction; payonce is SIGKILLed before its pool submits
//! that refund. The payonce started next on the database submits it, once,
//! to the platform that took the payment, by the platform's own number of
//! it, for its whole amount; a third start submits nothing more. (The same
//! in process, on both channels and for paid_after_close and
//! amount_mismatch too: the unwanted_money scenario.) The processes:
//! tests/common/serve.rs, which says when these tests skip.

mod common;

use common::platforms_sim::Sim;
use common::serve::{json_of, payonce_binary, platforms, Serve};
use common::TempDir;
use serde_json::{json, Value};
use std::thread;
use std::time::{Duration, Instant};

const ORDER: &str = "ORD_UNWANTED_1";
const AMOUNT: i64 = 990;

impl Serve {
    fn post(&self, path: &str, body: &Value) -> Value {
        let (status, answer) = self.call("POST", path, Some(body));
        assert!((200..300).contains(&status), "POST {path}: {status} {}", String::from_utf8_lossy(&answer));
        json_of(&answer)
    }

    fn get(&self, path: &str) -> Value {
        let (status, answer) = self.call("GET", path, None);
        assert_eq!(status, 200, "GET {path}: {}", String::from_utf8_lossy(&answer));
        json_of(&answer)
    }

    /// The order's payment of `outcome`.
    fn payment(&self, outcome: &str) -> Value {
        let order = self.get(&format!("/v1/orders/{ORDER}"));
        let payments = order["payments"].as_array().cloned().unwrap_or_default();
        payments.into_iter().find(|p| p["outcome"] == outcome).unwrap_or_else(|| panic!("no {outcome}: {order}"))
    }

    fn refund_required(&self) -> Vec<Value> {
        let findings = self.get("/v1/inspections")["findings"].as_array().cloned().unwrap_or_default();
        findings.into_iter().filter(|f| f["kind"] == "refund_required").collect()
    }
}

/// The refund submissions the platforms acted on, as `calls` logs them.
fn submissions(sim: &mut Sim) -> Vec<String> {
    let refund = |c: &String| {
        c.starts_with("wechatpay POST /v3/refund/domestic/refunds ")
            || c.starts_with("alipay POST alipay.trade.refund ")
    };
    sim.calls().into_iter().filter(refund).collect()
}

/// Polls `check` until it holds, or fails with `what` after 20 s.
fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !check() {
        assert!(Instant::now() < deadline, "never: {what}");
        thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_payonce_sigkilled_before_submitting_an_unwanted_payments_refund_submits_it_once_after_the_restart() {
    let Some(exe) = payonce_binary() else { return };
    let mut sim = platforms();
    let dir = TempDir::new("unwanted-kill");
    let db = dir.0.join("payonce.db");
    // The pool looks for due calls at start and then every
    // --sweep-interval-s: an hour keeps the first payonce from submitting
    // anything after its start.
    let auto = ["--refund-unwanted", "auto", "--platform-timeout-ms", "2000"];
    let quiet = [&auto[..], &["--sweep-interval-s", "3600"]].concat();
    let mut first = Serve::start(&exe, &db, &sim, &quiet, &[]);
    first.post("/v1/orders", &json!({"order_no": ORDER, "user_id": "u1", "amount": AMOUNT, "currency": "CNY"}));
    // A checkout page offering both: a payment made at each, and the buyer pays both.
    for (channel, method) in [("wechatpay", "native"), ("alipay", "precreate")] {
        first.post(&format!("/v1/orders/{ORDER}/pay"), &json!({"channel": channel, "method": method}));
    }
    let wechatpay_no = sim.command(&format!("pay wechatpay {ORDER}"));
    let alipay_no = sim.command(&format!("pay alipay {ORDER}"));
    assert!(!wechatpay_no.starts_with("refused") && !alipay_no.starts_with("refused"), "{wechatpay_no} {alipay_no}");
    // Both notifications lost: payonce's sync hears of both payments.
    let synced = first.post(&format!("/v1/orders/{ORDER}/sync"), &json!({}));
    assert_eq!(synced["order"]["status"], "PAID", "{synced}");
    let applied = first.payment("applied");
    let unwanted = first.payment("already_paid");
    let pay_no = unwanted["pay_no"].as_str().expect("its pay_no").to_owned();
    let platform = unwanted["channel"].as_str().expect("its channel").to_owned();
    assert!([&wechatpay_no, &alipay_no].contains(&&pay_no) && applied["pay_no"] != pay_no.as_str(), "{unwanted}");
    let refund_no = format!("U-{pay_no}");
    // Requested with the payment, in flight: refunding, still reported.
    assert_eq!(unwanted["resolution"], "refunding", "{unwanted}");
    let refunds = unwanted["refunds"].as_array().cloned().unwrap_or_default();
    let asked: Vec<(&str, i64, &str)> = refunds
        .iter()
        .map(|r| {
            (
                r["refund_no"].as_str().unwrap_or("-"),
                r["amount"].as_i64().unwrap_or(-1),
                r["status"].as_str().unwrap_or("-"),
            )
        })
        .collect();
    assert_eq!(asked, [(refund_no.as_str(), AMOUNT, "REQUESTED")], "{unwanted}");
    assert_eq!(first.refund_required().len(), 1, "reported while in flight");
    first.kill();

    assert_eq!(submissions(&mut sim), Vec::<String>::new(), "nothing submitted before the kill");
    assert_eq!(sim.listing("refunds"), Vec::<String>::new());

    // The next payonce on the database submits it at its start, once.
    let pace = ["--sweep-interval-s", "1", "--platform-retry-s", "0.2", "--refund-query-after-s", "1"];
    let mut second = Serve::start(&exe, &db, &sim, &[&auto[..], &pace[..]].concat(), &[]);
    let held = format!("{platform} {ORDER} {pay_no} {refund_no} {AMOUNT} Processing");
    eventually("the refund reaches the platform", || sim.listing("refunds") == [held.clone()]);
    // The platform logs a call once it has answered it, just after acting on it.
    eventually("the submission is answered", || !submissions(&mut sim).is_empty());
    let submitted = submissions(&mut sim);
    assert_eq!(submitted.len(), 1, "once: {submitted:?}");
    assert!(submitted[0].contains(" verified 200"), "accepted: {submitted:?}");
    // Its result, asked for by payonce's query.
    assert_eq!(sim.command(&format!("settle {refund_no} success")), "ok");
    eventually("payonce's query settles it", || second.payment("already_paid")["resolution"] == "refunded");
    let refunded = second.payment("already_paid");
    assert_eq!(refunded["refunds"][0]["status"], "SUCCEEDED", "{refunded}");
    assert_eq!(second.refund_required(), Vec::<Value>::new(), "no longer reported");
    let order = second.get(&format!("/v1/orders/{ORDER}"));
    assert_eq!((&order["status"], &order["pay_no"]), (&json!("PAID"), &applied["pay_no"]), "untouched: {order}");
    assert_eq!((&order["refunded_amount"], &order["refunds"]), (&json!(0), &json!([])), "{order}");
    assert_eq!(second.payment("applied")["resolution"], Value::Null);
    second.kill();

    // A third start finds it done: nothing is submitted again.
    let third = Serve::start(&exe, &db, &sim, &[&auto[..], &pace[..]].concat(), &[]);
    thread::sleep(Duration::from_millis(2_500));
    assert_eq!(submissions(&mut sim).len(), 1, "still once");
    assert_eq!(sim.listing("refunds"), [format!("{platform} {ORDER} {pay_no} {refund_no} {AMOUNT} Success")]);
    assert_eq!(third.payment("already_paid")["resolution"], "refunded");
}
