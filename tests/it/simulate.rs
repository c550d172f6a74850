//! `payonce simulate`: every scenario ends ok against an in-process payonce
//! and against the real binary, on every channel (generic, WeChat Pay and
//! Alipay, the latter two signed with the TEST_ONLY fixture keys against the
//! binary); the judge says VIOLATION when effects are not exactly once;
//! setup errors are errors (exit 2), not verdicts.

use crate::util::{Server, SECRET};
use payonce::domain::Rewards;
use payonce::recon::yuan_to_fen;
use payonce::simulate::{fen_to_yuan, judge, render_table, run, OrderExpect, OrderSeen, RewardRule, Row, SeenPayment};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

fn simulate(args: &[&str]) -> Result<ExitCode, String> {
    run(args.iter().map(OsString::from).collect::<Vec<_>>().into_iter())
}

fn is_success(code: &Result<ExitCode, String>) -> bool {
    matches!(code, Ok(c) if format!("{c:?}") == format!("{:?}", ExitCode::SUCCESS))
}

/// Fast enough for the test suite: the 24-hour schedules in under half a second.
const FAST: [&str; 4] = ["--orders", "3", "--time-factor", "200000"];
/// Every channel, two orders each: WeChat Pay and Alipay sign with RSA, which
/// an unoptimised build does at about 8 ms (1024 bits) to 40 ms (2048 bits).
const ALL_CHANNELS: [&str; 6] = ["--channel", "all", "--orders", "2", "--time-factor", "200000"];

// The TEST_ONLY platform keys (tests/fixtures/README.md) and the settings
// the binary is started with to trust them.
const WX_PUBLIC: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/TEST_ONLY_wechatpay_platform_a_public.pem");
const WX_PRIVATE: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/TEST_ONLY_wechatpay_platform_a_private.pem");
const ALIPAY_PUBLIC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/TEST_ONLY_alipay_platform_public.pem");
const ALIPAY_PRIVATE: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/TEST_ONLY_alipay_platform_private.pem");
const OTHER_PRIVATE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/TEST_ONLY_merchant_other_private.pem");
const WX_SERIAL: &str = "PUB_KEY_ID_TEST_A";
const APIV3_KEY: &str = "TESTONLYapiv3key0123456789abcdef";
const ALIPAY_APP_ID: &str = "2021000000000001";

#[test]
fn every_scenario_is_ok_against_an_in_process_payonce() {
    let result = simulate(&FAST);
    assert!(is_success(&result), "{result:?}");
}

/// Fresh key pairs for WeChat Pay and Alipay, the in-process payonce
/// configured with their public halves, every scenario on every channel.
#[test]
fn every_channel_is_ok_against_an_in_process_payonce() {
    let result = simulate(&ALL_CHANNELS);
    assert!(is_success(&result), "{result:?}");
}

/// The real binary trusts the TEST_ONLY platform public keys; the simulator
/// signs with their private halves, on every channel.
#[test]
fn every_channel_is_ok_against_a_running_server_with_the_test_keys() {
    let wx_key = format!("{WX_SERIAL}={WX_PUBLIC}");
    let server = Server::start(&[
        "--wechatpay-apiv3-key",
        APIV3_KEY,
        "--wechatpay-public-key",
        &wx_key,
        "--alipay-public-key",
        ALIPAY_PUBLIC,
        "--alipay-app-id",
        ALIPAY_APP_ID,
        "--coupon",
        "SIM-COUPON",
        "--points-per-yuan",
        "1",
    ]);
    let target = format!("http://{}", server.addr);
    let platform = |wx_private: &'static str, apiv3_key: &'static str, app_id: &'static str| -> Vec<&'static str> {
        vec![
            "--wechatpay-private-key",
            wx_private,
            "--wechatpay-serial",
            WX_SERIAL,
            "--wechatpay-apiv3-key",
            apiv3_key,
            "--alipay-private-key",
            ALIPAY_PRIVATE,
            "--alipay-app-id",
            app_id,
        ]
    };
    let mut args = vec!["--target", target.as_str(), "--callback-secret", SECRET];
    args.extend(platform(WX_PRIVATE, APIV3_KEY, ALIPAY_APP_ID));
    args.extend(ALL_CHANNELS);
    let result = simulate(&args);
    assert!(is_success(&result), "{result:?}");

    // The payments really came through each channel: per channel, 2 orders
    // of each of the 7 scenarios that pay, plus the 2 second payments of the
    // previous channel's two_channels.
    let db =
        rusqlite::Connection::open_with_flags(&server.db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).expect("open db");
    let per_channel = |channel: &str| -> i64 {
        db.query_row("SELECT count(*) FROM pay_callback_log WHERE channel = ?1", [channel], |r| r.get(0))
            .expect("count")
    };
    for channel in ["generic", "wechatpay", "alipay"] {
        assert_eq!(per_channel(channel), 16, "{channel} payments");
    }
    let events = server.get("/v1/events?limit=1000").json();
    let paid = events["events"].as_array().expect("events").iter().filter(|e| e["type"] == "order.paid").count();
    assert_eq!(paid, 3 * 12, "{events}");

    // Keys the target does not trust are setup errors (exit 2), named as such.
    let one = |channel: &'static str, keys: Vec<&'static str>| -> String {
        let mut args = vec!["--target", target.as_str(), "--channel", channel, "--scenario", "concurrent"];
        args.extend(["--orders", "1"]);
        args.extend(keys);
        simulate(&args).expect_err("a setup error")
    };
    let wrong_key = one("wechatpay", platform(OTHER_PRIVATE, APIV3_KEY, ALIPAY_APP_ID));
    assert!(wrong_key.contains("WeChat Pay signature"), "{wrong_key}");
    let wrong_apiv3 = one("wechatpay", platform(WX_PRIVATE, "TESTONLYotherkey0123456789abcdef", ALIPAY_APP_ID));
    assert!(wrong_apiv3.contains("--wechatpay-apiv3-key"), "{wrong_apiv3}");
    let wrong_app = one("alipay", platform(WX_PRIVATE, APIV3_KEY, "2021000000000999"));
    assert!(wrong_app.contains("app_id"), "{wrong_app}");
    // A selected channel without its flags is refused before anything is sent.
    let missing = one("alipay", vec!["--wechatpay-private-key", WX_PRIVATE]);
    assert!(missing.contains("--alipay-private-key") && missing.contains("--alipay-app-id"), "{missing}");
}

#[test]
fn fen_become_exact_yuan_strings() {
    for (fen, yuan) in [(0, "0.00"), (1, "0.01"), (5, "0.05"), (99, "0.99"), (100, "1.00"), (9_900, "99.00")] {
        assert_eq!(fen_to_yuan(fen), yuan);
    }
    for fen in [1, 10, 101, 1_007, 123_456, 99_999_999_999] {
        assert_eq!(yuan_to_fen(&fen_to_yuan(fen), false), Some(fen), "{fen}");
    }
}

#[test]
fn every_scenario_is_ok_against_a_running_server_and_reruns_do_not_collide() {
    let server = Server::start(&["--coupon", "SIM-COUPON", "--points-per-yuan", "1"]);
    let target = format!("http://{}", server.addr);
    let mut args = vec!["--target", target.as_str(), "--callback-secret", SECRET];
    args.extend(FAST);
    let result = simulate(&args);
    assert!(is_success(&result), "{result:?}");

    // The simulator really did the work: 6 scenarios pay 3 orders each.
    let events = server.get("/v1/events?limit=1000").json();
    let paid = events["events"].as_array().expect("events").iter().filter(|e| e["type"] == "order.paid").count();
    assert_eq!(paid, 18, "{events}");

    // A second run on the same server uses new order_nos and is judged on its own orders.
    let mut again =
        vec!["--target", target.as_str(), "--callback-secret", SECRET, "--scenario", "concurrent,triple_click"];
    again.extend(FAST);
    let result = simulate(&again);
    assert!(is_success(&result), "{result:?}");

    // A wrong secret is a setup error (exit 2), not a verdict.
    let wrong = simulate(&[
        "--target",
        target.as_str(),
        "--callback-secret",
        "nope",
        "--scenario",
        "concurrent",
        "--orders",
        "1",
    ]);
    let message = wrong.expect_err("wrong secret must be an error");
    assert!(message.contains("signature"), "{message}");
}

/// A "payment service" with the seed's bug: every delivery is `applied` and
/// every payment issued the coupon again. The simulator must say VIOLATION
/// (exit 1) from what this server answers and shows, not pass it — also on
/// the platforms' channels, whose answers (204, `success`) carry no outcome,
/// so only the read API can show it.
#[test]
fn a_server_that_applies_every_delivery_is_a_violation() {
    use payonce::api::{Request, Response};
    use serde_json::json;
    let handler = |req: &Request| -> Response {
        let order_no = req.path.strip_prefix("/v1/orders/").unwrap_or("").to_owned();
        let after: u64 =
            req.query.split('&').find_map(|kv| kv.strip_prefix("after=")).and_then(|v| v.parse().ok()).unwrap_or(0);
        match (req.method.as_str(), req.path.as_str()) {
            ("GET", "/healthz") => Response::json(200, &json!({"status": "ok"})),
            ("GET", "/v1/admin/mode") => Response::json(200, &json!({"mode": "normal"})),
            ("GET", "/v1/events") => Response::json(200, &json!({"events": [], "next_after": after})),
            ("GET", "/v1/inspections") => Response::json(200, &json!({"ok": true, "findings": []})),
            ("POST", "/v1/orders") => Response::json(201, &json!({"status": "PENDING"})),
            ("POST", "/v1/callbacks/generic") => Response::json(200, &json!({"code": "SUCCESS", "outcome": "applied"})),
            ("POST", "/v1/callbacks/wechatpay") => {
                Response { status: 204, headers: vec![], body: vec![], outcome: None }
            }
            ("POST", "/v1/callbacks/alipay") => {
                Response { status: 200, headers: vec![], body: b"success".to_vec(), outcome: None }
            }
            ("GET", _) if !order_no.is_empty() => Response::json(
                200,
                &json!({
                    "order_no": order_no, "status": "PAID", "pay_no": format!("{order_no}-P1"),
                    "payments": [{"pay_no": format!("{order_no}-P1"), "outcome": "applied", "state": "decided"}],
                    "coupons": [{"coupon_template_id": "SIM-COUPON", "status": "ACTIVE"},
                                {"coupon_template_id": "SIM-COUPON", "status": "ACTIVE"}],
                    "points": [],
                }),
            ),
            _ => Response::json(404, &json!({"error": {"code": "not_found", "message": "-"}})),
        }
    };
    let server = payonce::http::Server::bind("127.0.0.1:0").expect("bind");
    let target = format!("http://{}", server.local_addr());
    let shutdown = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&shutdown);
    let serving = std::thread::spawn(move || server.serve_fn(handler, flag, 4));
    let keys = [
        "--callback-secret",
        "x",
        "--wechatpay-private-key",
        WX_PRIVATE,
        "--wechatpay-serial",
        WX_SERIAL,
        "--wechatpay-apiv3-key",
        APIV3_KEY,
        "--alipay-private-key",
        ALIPAY_PRIVATE,
        "--alipay-app-id",
        ALIPAY_APP_ID,
    ];
    let results: Vec<(&str, Result<ExitCode, String>)> = ["generic", "wechatpay", "alipay"]
        .into_iter()
        .map(|channel| {
            let mut args = vec!["--target", target.as_str(), "--channel", channel];
            args.extend(["--scenario", "concurrent", "--orders", "2"]);
            args.extend(keys);
            (channel, simulate(&args))
        })
        .collect();
    shutdown.store(true, Ordering::SeqCst);
    let _ = serving.join();
    for (channel, result) in results {
        assert_eq!(format!("{result:?}"), format!("{:?}", Ok::<ExitCode, String>(ExitCode::from(1))), "{channel}");
    }
}

#[test]
fn setup_problems_are_errors() {
    let unreachable = simulate(&["--target", "http://127.0.0.1:1", "--callback-secret", "x"]);
    assert!(unreachable.is_err(), "{unreachable:?}");
    assert!(simulate(&["--target", "http://127.0.0.1:1"]).is_err(), "a target needs a secret");
    assert!(simulate(&["--scenario", "nonsense"]).is_err());
    assert!(simulate(&["--orders", "0"]).is_err());
    assert!(simulate(&["--channel", "paypal"]).is_err());
    // Against a target, every selected channel needs its keys, named in the error.
    let missing = simulate(&["--target", "http://127.0.0.1:1", "--channel", "all"]).expect_err("no keys");
    for flag in ["--callback-secret", "--wechatpay-private-key", "--wechatpay-serial", "--wechatpay-apiv3-key"] {
        assert!(missing.contains(flag), "{flag}: {missing}");
    }
    let short = simulate(&["--channel", "wechatpay", "--wechatpay-apiv3-key", "short", "--orders", "1"]);
    assert!(short.as_ref().is_err_and(|e| e.contains("32 bytes")), "{short:?}");
    assert!(is_success(&simulate(&["--help"])));
}

fn paid_expect() -> OrderExpect {
    OrderExpect {
        status: "PAID".into(),
        answers: vec!["applied".into(), "duplicate".into()],
        payments: vec!["applied".into()],
        paid: true,
        events: vec![("order.paid".into(), 1)],
        ..OrderExpect::default()
    }
}

fn exactly_once_seen() -> OrderSeen {
    OrderSeen {
        order_no: "ORD-1".into(),
        amount: 9_900,
        status: Some("PAID".into()),
        pay_no: Some("PAY-1".into()),
        payments: vec![SeenPayment { pay_no: "PAY-1".into(), outcome: "applied".into(), state: "decided".into() }],
        coupons: vec![("SIM-COUPON".into(), "ACTIVE".into())],
        points: vec![("ORDER_PAID".into(), 99)],
        events: BTreeMap::from([("order.paid".to_owned(), 1)]),
        answers: vec!["applied".into(), "duplicate".into()],
        ..OrderSeen::default()
    }
}

#[test]
fn the_judge_reports_effects_that_are_not_exactly_once() {
    let known = RewardRule::Known(Rewards { coupon_templates: vec!["SIM-COUPON".into()], points_per_yuan: 1 });
    let expect = paid_expect();
    assert_eq!(judge(&expect, &known, &exactly_once_seen()), Vec::<String>::new());
    assert_eq!(judge(&expect, &RewardRule::Unknown, &exactly_once_seen()), Vec::<String>::new());

    // The incident: the status changed once, the side effects ran twice.
    let mut twice = exactly_once_seen();
    twice.coupons.push(("SIM-COUPON".into(), "ACTIVE".into()));
    twice.points.push(("ORDER_PAID".into(), 99));
    twice.events.insert("order.paid".into(), 2);
    twice.answers = vec!["applied".into(), "applied".into()];
    for rewards in [&known, &RewardRule::Unknown] {
        let violations = judge(&expect, rewards, &twice);
        let all = violations.join("\n");
        assert!(all.contains("2 coupons of template SIM-COUPON"), "{all}");
        assert!(all.contains("2 ORDER_PAID points entries"), "{all}");
        assert!(all.contains("order.paid"), "{all}");
        assert!(all.contains("answered 1 applied"), "{all}");
    }

    // Missing rewards are visible when the rewards are known.
    let mut missing = exactly_once_seen();
    missing.coupons.clear();
    missing.points.clear();
    assert_eq!(judge(&expect, &known, &missing).len(), 2, "{:?}", judge(&expect, &known, &missing));

    // A lost answer is allowed only when the simulator really lost one.
    let mut lost = exactly_once_seen();
    lost.answers = vec!["duplicate".into()];
    assert!(!judge(&expect, &known, &lost).is_empty());
    lost.lost = 1;
    assert_eq!(judge(&expect, &known, &lost), Vec::<String>::new());

    // A second payment row for one pay_no, and a refund-time reversal without a refund.
    let mut rows = exactly_once_seen();
    rows.payments.push(rows.payments[0].clone());
    rows.points.push(("ORDER_PAID_REVERSAL".into(), -99));
    let all = judge(&expect, &known, &rows).join("\n");
    assert!(all.contains("pay_no PAY-1 has 2 payment rows"), "{all}");
    assert!(all.contains("without a refund"), "{all}");

    let row = |channel: &str, violations: Vec<String>| Row {
        scenario: "concurrent".into(),
        channel: channel.into(),
        deliveries: "2: 2 applied".into(),
        expected: "1 PAID".into(),
        observed: "1 PAID".into(),
        violations,
    };
    let table = render_table(&[row("generic", judge(&expect, &known, &twice))]);
    assert!(table.contains("VIOLATION"), "{table}");
    assert!(!table.contains("channel"), "one channel, no channel column: {table}");
    let table = render_table(&[row("generic", vec![]), row("wechatpay", judge(&expect, &known, &twice))]);
    let header: Vec<&str> = table.lines().next().unwrap_or_default().split_whitespace().collect();
    assert_eq!(header[..2], ["scenario", "channel"], "{table}");
    assert!(table.contains("VIOLATION in concurrent (wechatpay)"), "{table}");

    // The answers said which of two payments won: the order must be paid by it.
    let mut won = exactly_once_seen();
    won.answers = vec!["applied".into(), "duplicate".into()];
    let expect_won = OrderExpect { pay_no: Some("PAY-2".into()), ..paid_expect() };
    let all = judge(&expect_won, &known, &won).join("\n");
    assert!(all.contains("the answers said PAY-2 won"), "{all}");
}
