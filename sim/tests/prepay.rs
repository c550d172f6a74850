//! `POST /v1/orders/{order_no}/pay` by real `payonce serve` processes
//! against `payonce-sim platforms` (docs/platforms.md, "Paying"): a triple
//! click split across two processes on one SQLite file is one prepay call
//! and one trade, answered alike; a process SIGKILLed between the
//! platform's answer and storing it leaves one trade, which the restarted
//! process asks for again with the same request once the dead call's lease
//! has run out. (The same in one process, the client signatures and the
//! reuse window: sim/src/platform_api/pay_http.rs.) The processes:
//! tests/common/serve.rs, which says when these tests skip.

mod common;

use common::platforms_sim::Sim;
use common::serve::{json_of, payonce_binary, platforms, request, Serve, PUBLIC_BASE_URL};
use common::TempDir;
use serde_json::{json, Value};
use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

/// `--platform-timeout-ms` of the SIGKILL test: a waiting request waits this
/// plus a second; a dead call's lease lasts twice this (the creation and the
/// query a "paid" answer makes) plus five seconds for the writes around them
/// (src/services/prepays.rs, `lease_ms`).
const PLATFORM_TIMEOUT_MS: u64 = 500;
const LEASE_MS: u64 = 2 * PLATFORM_TIMEOUT_MS + 5_000;

/// What only these tests ask of a `payonce serve`.
impl Serve {
    fn order(&self, order_no: &str) {
        let body = json!({"order_no": order_no, "user_id": "u1", "amount": 990, "currency": "CNY"});
        let (status, answer) = self.call("POST", "/v1/orders", Some(&body));
        assert_eq!(status, 201, "{}", String::from_utf8_lossy(&answer));
    }

    /// The order's platform calls of kind `prepay`: (channel, status, attempts).
    fn prepay_rows(&self, order_no: &str) -> Vec<(String, String, i64)> {
        let (status, detail) = self.call("GET", &format!("/v1/orders/{order_no}"), None);
        assert_eq!(status, 200);
        let detail = json_of(&detail);
        let calls = detail["platform_calls"].as_array().cloned().unwrap_or_default();
        calls
            .iter()
            .filter(|c| c["kind"] == "prepay")
            .map(|c| {
                let text = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
                (text("channel"), text("status"), c["attempts"].as_i64().unwrap_or(-1))
            })
            .collect()
    }
}

/// `prepays ORDER_NO`: each call's platform and body.
fn prepays(sim: &mut Sim, order_no: &str) -> Vec<(String, Value)> {
    sim.listing(&format!("prepays {order_no}"))
        .iter()
        .map(|line| {
            let (platform, body) = line.split_once(' ').unwrap_or_else(|| panic!("{line:?}"));
            (platform.to_owned(), serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {line}")))
        })
        .collect()
}

#[test]
fn a_triple_click_across_two_processes_on_one_database_is_one_prepay_and_one_trade() {
    let Some(exe) = payonce_binary() else { return };
    let mut sim = platforms();
    let dir = TempDir::new("prepay-two");
    let db = dir.0.join("payonce.db");
    let one = Serve::start(&exe, &db, &sim, &[], &[]);
    let two = Serve::start(&exe, &db, &sim, &[], &[]);
    let held = Duration::from_millis(600);
    let cases = [
        ("wechatpay", "native", "ORD_TWO_WX", "code_url", "wechatpay=NOTPAY alipay=none", "NATIVE"),
        (
            "alipay",
            "precreate",
            "ORD_TWO_ALI",
            "qr_code",
            "wechatpay=none alipay=WAIT_BUYER_PAY",
            "alipay.trade.precreate",
        ),
    ];
    for (platform, method, order_no, key, state, trade_type) in cases {
        one.order(order_no);
        // Every request to the platform waits before it is acted on: the
        // clicks meet its call whichever process makes it.
        assert_eq!(sim.command(&format!("fault {platform} delay {}", held.as_millis())), "ok");
        let body = json!({"channel": platform, "method": method});
        let barrier = Barrier::new(4);
        let clicks: Vec<(u16, Vec<u8>, Duration)> = thread::scope(|scope| {
            let clicks: Vec<_> = [&one, &two, &one, &two]
                .into_iter()
                .map(|serve| {
                    let (barrier, body) = (&barrier, &body);
                    scope.spawn(move || {
                        barrier.wait();
                        let started = Instant::now();
                        let (status, bytes) = serve.call("POST", &format!("/v1/orders/{order_no}/pay"), Some(body));
                        (status, bytes, started.elapsed())
                    })
                })
                .collect();
            clicks.into_iter().map(|c| c.join().expect("a click")).collect()
        });
        assert_eq!(sim.command(&format!("fault {platform} none")), "ok");
        for (status, bytes, took) in &clicks {
            assert_eq!(*status, 200, "{}", String::from_utf8_lossy(bytes));
            assert!(*took >= held - Duration::from_millis(100), "{platform}: answered in {took:?}, before the call");
        }
        assert!(clicks.iter().all(|(_, bytes, _)| *bytes == clicks[0].1), "{platform}: four identical bodies");
        let payment = &json_of(&clicks[0].1)["payment"];
        let calls = prepays(&mut sim, order_no);
        assert_eq!(calls.len(), 1, "{platform}: one call reached the platform: {calls:?}");
        assert_eq!((calls[0].0.as_str(), &calls[0].1["out_trade_no"]), (platform, &json!(order_no)));
        assert_eq!(sim.command(&format!("state {order_no}")), state, "one trade, at {platform} only");
        let trade = json_of(sim.command(&format!("trade {platform} {order_no}")).as_bytes());
        assert_eq!((&trade["trade_type"], &trade["payment"]), (&json!(trade_type), &payment[key]), "{trade}");
        assert_eq!(trade["notify_url"], format!("{PUBLIC_BASE_URL}/v1/callbacks/{platform}"));
        for serve in [&one, &two] {
            assert_eq!(serve.prepay_rows(order_no), [(platform.to_owned(), "done".to_owned(), 1)]);
        }
    }
}

#[test]
fn a_payonce_killed_before_storing_the_platform_answer_leaves_one_trade_asked_again_after_the_lease() {
    let Some(exe) = payonce_binary() else { return };
    let mut sim = platforms();
    let dir = TempDir::new("prepay-kill");
    let db = dir.0.join("payonce.db");
    let timeout = PLATFORM_TIMEOUT_MS.to_string();
    let extra = ["--platform-timeout-ms", timeout.as_str()];
    let hold_ms = 3_000u64;
    let hold = hold_ms.to_string();
    let mut first = Serve::start(&exe, &db, &sim, &extra, &[("PAYONCE_TEST_HOLD_AFTER_PREPAY_MS", hold.as_str())]);
    first.order("ORD_KILLED");
    let body = json!({"channel": "wechatpay", "method": "native"});
    let sent = Instant::now();
    let addr = first.addr;
    let paying = {
        let body = body.clone();
        thread::spawn(move || request(addr, "POST", "/v1/orders/ORD_KILLED/pay", Some(&body)))
    };
    // The platform made the trade and answered; payonce holds before storing it.
    while prepays(&mut sim, "ORD_KILLED").is_empty() {
        assert!(sent.elapsed() < Duration::from_secs(10), "the prepay never reached the platform");
        thread::sleep(Duration::from_millis(20));
    }
    let made = json_of(sim.command("trade wechatpay ORD_KILLED").as_bytes());
    let code_url = made["payment"].as_str().expect("the code_url handed over").to_owned();
    first.kill();
    assert!(sent.elapsed() < Duration::from_millis(hold_ms), "SIGKILLed within the hold, before the answer was stored");
    let lost = paying.join().expect("the pay request");
    assert!(lost.is_err(), "the killed process answered nothing: {lost:?}");

    // On the same file: the row of the dead call, still leased.
    let second = Serve::start(&exe, &db, &sim, &extra, &[]);
    assert_eq!(second.prepay_rows("ORD_KILLED"), [("wechatpay".to_owned(), "pending".to_owned(), 1)]);
    let lease = Duration::from_millis(LEASE_MS);
    thread::sleep((lease + Duration::from_millis(200)).saturating_sub(sent.elapsed()));
    let (status, bytes) = second.call("POST", "/v1/orders/ORD_KILLED/pay", Some(&body));
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let payment = &json_of(&bytes)["payment"];
    assert_eq!(payment["code_url"], code_url.as_str(), "the trade the dead call made, answered again");

    let calls = prepays(&mut sim, "ORD_KILLED");
    assert_eq!(calls.len(), 2, "the dead call and the one after the lease: {calls:?}");
    assert_eq!(calls[1], calls[0], "the same request again: same out_trade_no, every body field alike");
    assert_eq!(calls[0].1["out_trade_no"], "ORD_KILLED");
    assert_eq!(sim.command("state ORD_KILLED"), "wechatpay=NOTPAY alipay=none", "one trade");
    let trade = json_of(sim.command("trade wechatpay ORD_KILLED").as_bytes());
    assert_eq!(trade, made, "the one trade, unchanged");
    assert_eq!(second.prepay_rows("ORD_KILLED"), [("wechatpay".to_owned(), "done".to_owned(), 2)]);
    let (status, again) = second.call("POST", "/v1/orders/ORD_KILLED/pay", Some(&body));
    assert_eq!((status, &again), (200, &bytes), "now stored: answered again without a call");
    assert_eq!(prepays(&mut sim, "ORD_KILLED").len(), 2);
}
