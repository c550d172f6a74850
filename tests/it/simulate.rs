//! `payonce simulate`: every scenario ends ok against an in-process payonce
//! and against the real binary; the judge says VIOLATION when effects are
//! not exactly once; setup errors are errors (exit 2), not verdicts.

use crate::util::{Server, SECRET};
use payonce::domain::Rewards;
use payonce::simulate::{judge, render_table, run, OrderExpect, OrderSeen, RewardRule, Row, SeenPayment};
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

#[test]
fn every_scenario_is_ok_against_an_in_process_payonce() {
    let result = simulate(&FAST);
    assert!(is_success(&result), "{result:?}");
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
/// (exit 1) from what this server answers and shows, not pass it.
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
    let result =
        simulate(&["--target", &target, "--callback-secret", "x", "--scenario", "concurrent", "--orders", "2"]);
    shutdown.store(true, Ordering::SeqCst);
    let _ = serving.join();
    assert_eq!(format!("{result:?}"), format!("{:?}", Ok::<ExitCode, String>(ExitCode::from(1))));
}

#[test]
fn setup_problems_are_errors() {
    let unreachable = simulate(&["--target", "http://127.0.0.1:1", "--callback-secret", "x"]);
    assert!(unreachable.is_err(), "{unreachable:?}");
    assert!(simulate(&["--target", "http://127.0.0.1:1"]).is_err(), "a target needs a secret");
    assert!(simulate(&["--scenario", "nonsense"]).is_err());
    assert!(simulate(&["--orders", "0"]).is_err());
    assert!(simulate(&["--channel", "paypal"]).is_err());
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

    let table = render_table(&[Row {
        scenario: "concurrent".into(),
        deliveries: "2: 2 applied".into(),
        expected: "1 PAID".into(),
        observed: "1 PAID".into(),
        violations: judge(&expect, &known, &twice),
    }]);
    assert!(table.contains("VIOLATION"), "{table}");
}
