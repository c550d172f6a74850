//! `payonce-sim` (the binary `payonce simulate` runs): every scenario ends
//! ok against its own in-process payonce and against a payonce on a file
//! database, on every channel (generic, WeChat Pay and Alipay, the latter two
//! signed with the TEST_ONLY fixture keys against the file-backed one); it
//! says VIOLATION when effects are not exactly once; setup errors are errors
//! (exit 2), not verdicts.

mod common;

use common::{Payonce, TempDir};
use payonce::api::{Request, Response};
use payonce::app::Config;
use payonce::domain::Rewards;
use payonce::http::Server;
use payonce::platforms::alipay::{public_key_from_text, Alipay, AlipayConfig};
use payonce::platforms::generic::Generic;
use payonce::platforms::wechatpay::{public_key_from_pem, Wechatpay, WechatpayConfig};
use payonce::platforms::{Platform, Platforms};
use payonce::{App, Clock};
use payonce_testclient as client;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

/// What a run of the binary came to.
#[derive(Debug)]
struct Run {
    /// The exit status (None: killed by a signal).
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Run {
    fn ok(&self) -> bool {
        self.code == Some(0)
    }

    /// A setup error: exit 2, and its message.
    fn error(&self) -> &str {
        assert_eq!(self.code, Some(2), "expected a setup error: {self:?}");
        &self.stderr
    }
}

/// Runs `payonce-sim ARGS` with none of the simulator's environment variables set.
fn simulate(args: &[&str]) -> Run {
    let output = Command::new(env!("CARGO_BIN_EXE_payonce-sim"))
        .args(args)
        .env_remove("PAYONCE_CALLBACK_SECRET")
        .env_remove("PAYONCE_API_TOKEN")
        .env_remove("PAYONCE_WECHATPAY_APIV3_KEY")
        .output()
        .expect("run payonce-sim");
    Run {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// Fast enough for the test suite: the retry schedules' first hour in 18 ms
/// (their whole 24 hours, with --full-schedules, in under half a second).
const FAST: [&str; 4] = ["--orders", "3", "--time-factor", "200000"];
/// Every channel, two orders each: WeChat Pay and Alipay sign with RSA, which
/// an unoptimised build does at about 8 ms (1024 bits) to 40 ms (2048 bits).
const ALL_CHANNELS: [&str; 6] = ["--channel", "all", "--orders", "2", "--time-factor", "200000"];
/// In process, four orders each: close_race pays at each of its four
/// moments once per platform (between payonce's query and its close, the
/// same with the notification meanwhile, after the close, at random).
/// With `--verbose`: the whole table and the before/after lines unwrapped,
/// which these tests read.
const ALL_CHANNELS_IN_PROCESS: [&str; 7] =
    ["--channel", "all", "--orders", "4", "--time-factor", "200000", "--verbose"];
/// The scenarios that talk to the platforms' merchant APIs (docs/platforms.md).
const PLATFORM_SCENARIOS: [&str; 5] =
    ["lost_notification", "close_race", "platform_down", "refund_submitted", "unwanted_money"];

// The TEST_ONLY platform keys (tests/fixtures/README.md) and the settings
// the payonce under test is given to trust them.
const WX_PUBLIC: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/TEST_ONLY_wechatpay_platform_a_public.pem");
const WX_PRIVATE: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/TEST_ONLY_wechatpay_platform_a_private.pem");
const ALIPAY_PUBLIC: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/TEST_ONLY_alipay_platform_public.pem");
const ALIPAY_PRIVATE: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/TEST_ONLY_alipay_platform_private.pem");
const OTHER_PRIVATE: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/TEST_ONLY_merchant_other_private.pem");
const WX_SERIAL: &str = "PUB_KEY_ID_TEST_A";
const APIV3_KEY: &str = "TESTONLYapiv3key0123456789abcdef";
const ALIPAY_APP_ID: &str = "2021000000000001";
const SECRET: &str = "test-secret";

/// payonce on a fresh file database, in process (`common::Payonce`).
impl Payonce {
    /// The generic secret, the simulator's reward settings (SIM-COUPON, 1
    /// point per yuan) and, with `platforms`, the TEST_ONLY platform keys.
    fn start(platforms: bool) -> Payonce {
        let read = |path: &str| std::fs::read_to_string(path).expect("fixture");
        let (wechatpay, alipay) = if platforms {
            let wx = public_key_from_pem(&read(WX_PUBLIC)).expect("wechatpay public key");
            let ali = public_key_from_text(&read(ALIPAY_PUBLIC)).expect("alipay public key");
            (
                Some(WechatpayConfig::new(APIV3_KEY, vec![(WX_SERIAL.into(), wx)]).expect("wechatpay config")),
                Some(AlipayConfig { public_key: ali, app_id: ALIPAY_APP_ID.into() }),
            )
        } else {
            (None, None)
        };
        let mut platforms = vec![Platform::notices(Generic::new(vec![SECRET.as_bytes().to_vec()]))];
        platforms.extend(wechatpay.map(|config| Platform::notices(Wechatpay::new(config))));
        platforms.extend(alipay.map(|config| Platform::notices(Alipay::new(config))));
        let config = Config {
            rewards: Rewards { coupon_templates: vec!["SIM-COUPON".into()], points_per_yuan: 1 },
            platforms: Platforms::with(platforms),
            ..Config::default()
        };
        let dir = TempDir::new("payonce");
        let db = dir.0.join("payonce.db");
        let app = App::open(db.to_str().expect("utf-8 path"), Clock::System, config).expect("open payonce");
        Payonce::serve(
            Server::bind("127.0.0.1:0").expect("bind"),
            move |server, flag| server.serve(Arc::new(app), flag, 16),
            db,
            dir,
        )
    }

    fn target(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn get(&self, path: &str) -> Value {
        let reply = client::request(self.addr, "GET", path, &[], b"", Duration::from_secs(30)).expect("GET");
        serde_json::from_slice(&reply.body).expect("JSON")
    }

    /// How many events of `kind` payonce has.
    fn events(&self, kind: &str) -> usize {
        let events = self.get("/v1/events?limit=1000");
        events["events"].as_array().expect("events").iter().filter(|e| e["type"] == kind).count()
    }
}

#[test]
fn every_scenario_is_ok_against_an_in_process_payonce() {
    let run = simulate(&FAST);
    assert!(run.ok(), "{run:?}");
    // Progress as it goes: a line on stderr per scenario.
    assert_eq!(run.stderr.matches(" done in ").count(), 9, "{run:?}");
    // The verdict is the last line.
    let last = run.stdout.lines().last().unwrap_or_default();
    // The generic channel has no platform API: the five scenarios that
    // need one are skipped on it.
    assert_eq!(last, "14 scenario runs: 9 ok, 0 with violations, 5 skipped (0 violations in all)", "{run:?}");
    // Without --verbose the output fits 100 columns, each row's verdict in it.
    for line in run.stdout.lines() {
        assert!(line.chars().count() <= 100, "{} columns: {line}", line.chars().count());
    }
    let row = run.stdout.lines().find(|l| l.starts_with("concurrent ")).unwrap_or_default();
    assert_eq!(row.split_whitespace().nth(2), Some("ok"), "scenario, deliveries, verdict: {row}");
    // payonce's own repeated warnings, if any, are counted, not repeated.
    assert!(run.stderr.lines().filter(|l| l.contains("level=warn")).count() <= 5, "{}", run.stderr);
}

/// Fresh key pairs for WeChat Pay and Alipay, the in-process payonce
/// configured with their public halves, every scenario on every channel:
/// those that talk to the platforms' APIs on WeChat Pay and Alipay (each
/// against a payonce of its own that calls the simulated platforms),
/// skipped on generic, with the before/after comparison under the table.
/// `--key-mode certificate`: the simulated WeChat Pay signs its notices and
/// answers with a platform certificate, and the in-process payonces (the
/// notices' and each platform scenario's) hold no key for its serial: they
/// download it (`--wechatpay-platform-certs auto`), so a WeChat Pay scenario
/// is ok only if the download worked.
#[test]
fn every_channel_is_ok_in_certificate_mode() {
    let run = simulate(&[&ALL_CHANNELS[..], &["--key-mode", "certificate"]].concat());
    assert!(run.ok(), "{run:?}");
    assert!(run.stderr.contains("WeChat Pay signs with the platform certificate"), "{run:?}");
    for scenario in PLATFORM_SCENARIOS {
        let row = run.stdout.lines().find(|l| l.split_whitespace().take(2).eq([scenario, "wechatpay"]));
        let verdict = row.and_then(|r| r.split_whitespace().nth(3));
        assert_eq!(verdict, Some("ok"), "{scenario} on wechatpay: {run:?}");
    }
}

#[test]
fn every_channel_is_ok_against_an_in_process_payonce() {
    let run = simulate(&ALL_CHANNELS_IN_PROCESS);
    assert!(run.ok(), "{run:?}");
    assert_eq!(run.stderr.matches(" done in ").count(), 9 * 3 + 5 * 2, "{run:?}");
    // Refunded in three parts on every channel; on WeChat Pay and Alipay
    // against the simulated platform, which refunded what payonce says.
    for channel in ["generic", "wechatpay", "alipay"] {
        let row = run.stdout.lines().find(|l| l.split_whitespace().take(2).eq(["partial_refunds", channel]));
        assert!(row.is_some_and(|r| r.ends_with("ok")), "partial_refunds on {channel}: {run:?}");
    }
    for scenario in PLATFORM_SCENARIOS {
        for (channel, verdict) in [("generic", "skipped"), ("wechatpay", "ok"), ("alipay", "ok")] {
            let row = run
                .stdout
                .lines()
                .find(|l| l.split_whitespace().take(2).eq([scenario, channel]))
                .unwrap_or_else(|| panic!("no {scenario} row for {channel}: {run:?}"));
            assert!(row.ends_with(verdict), "{scenario} on {channel}: {row}");
        }
    }
    for channel in ["wechatpay", "alipay"] {
        let note = |scenario: &str| -> String {
            let prefix = format!("{scenario} ({channel}): ");
            let line = run.stdout.lines().map(str::trim).find(|l| l.starts_with(&prefix)).unwrap_or_default();
            assert!(!line.is_empty(), "no before/after line for {scenario} on {channel}: {run:?}");
            line.to_owned()
        };
        // Before the platform calls the lost and the raced payments end paid_after_close
        // (or unknown); with the platforms asked, none does.
        let lost = note("lost_notification");
        assert!(lost.contains("Before: 4 CLOSED, 2 paid_after_close, 2 paid with payonce never knowing"), "{lost}");
        assert!(lost.contains("After: 4 PAID, 4 applied with source query, 0 paid_after_close"), "{lost}");
        let race = note("close_race");
        assert!(race.contains("Before: 4 CLOSED, 4 paid_after_close"), "{race}");
        assert!(race.contains(", 0 paid_after_close"), "{race}");
        // Three pay clicks per order: the merchant's own code called the
        // platform for each; payonce calls once, and answers alike.
        let clicks = note("triple_click");
        assert!(
            clicks.contains("12 prepay calls for 4 trades, 4 PAID, 4 coupons, 4 points entries. After"),
            "{clicks}"
        );
        assert!(
            clicks.contains("After (payonce): 4 prepay calls for 4 trades, 4 PAID, 4 coupons, 4 points"),
            "{clicks}"
        );
        assert!(clicks.contains("4 orders answered 3 byte-identical times"), "{clicks}");
        let row = run.stdout.lines().find(|l| l.split_whitespace().take(2).eq(["triple_click", channel]));
        assert!(row.is_some_and(|r| r.contains("16: 12 pay 200, 4 processed") && r.ends_with("ok")), "{run:?}");
        // Money payonce did not want: left to the operator with manual,
        // returned once each with auto.
        let unwanted = note("unwanted_money");
        assert!(unwanted.contains("(2 already_paid, 1 amount_mismatch, 1 paid_after_close)"), "{unwanted}");
        assert!(
            unwanted.contains(
                "Before (--refund-unwanted manual): 4 refund_required findings open, 0 refunds at the platforms \
                 (0 payments refunded once in full), 0 payments resolved refunded."
            ),
            "{unwanted}"
        );
        assert!(
            unwanted.ends_with(
                ": 0 refund_required findings open, 4 refunds at the platforms (4 payments refunded once in full), \
                 4 payments resolved refunded"
            ),
            "{unwanted}"
        );
    }
}

/// `--key-mode certificate`: Alipay plays certificate mode (its gateway
/// refuses a request without the right app_cert_sn and alipay_root_cert_sn)
/// and the in-process payonces hold the three certificate files; every
/// scenario is ok on Alipay, those that call the platform too.
#[test]
fn alipay_in_certificate_mode_is_ok_in_process() {
    let run =
        simulate(&["--channel", "alipay", "--key-mode", "certificate", "--orders", "2", "--time-factor", "200000"]);
    assert!(run.ok(), "{run:?}");
    assert!(run.stderr.contains("alipay: certificate mode: payonce holds the app, Alipay public and root"), "{run:?}");
    let last = run.stdout.lines().last().unwrap_or_default();
    assert_eq!(last, "14 scenario runs: 14 ok, 0 with violations, 0 skipped (0 violations in all)", "{run:?}");
    assert!(simulate(&["--key-mode", "pem"])
        .error()
        .contains("--key-mode \"pem\": expected public-key or certificate"));
}

/// payonce trusts the TEST_ONLY platform public keys; the simulator signs
/// with their private halves, on every channel.
#[test]
fn every_channel_is_ok_against_a_running_server_with_the_test_keys() {
    let server = Payonce::start(true);
    let target = server.target();
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
    let run = simulate(&args);
    assert!(run.ok(), "{run:?}");
    // Every channel's rows, without --verbose, fit 100 columns.
    for line in run.stdout.lines() {
        assert!(line.chars().count() <= 100, "{} columns: {line}", line.chars().count());
    }
    // A target's payonce has neither the simulated platforms' settings nor a clock to set.
    let skipped = format!("skipped against --target: {}", PLATFORM_SCENARIOS.join(", "));
    let said: String = run.stdout.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(said.contains(&skipped), "{run:?}");
    assert!(PLATFORM_SCENARIOS.iter().all(|s| !run.stderr.contains(&format!("{s} ("))), "{run:?}");

    // The payments really came through each channel: per channel, 2 orders
    // of each of the 8 scenarios that pay, plus the 2 second payments of the
    // previous channel's two_channels.
    let db =
        rusqlite::Connection::open_with_flags(&server.db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).expect("open db");
    let per_channel = |channel: &str| -> i64 {
        db.query_row("SELECT count(*) FROM pay_callback_log WHERE channel = ?1", [channel], |r| r.get(0))
            .expect("count")
    };
    for channel in ["generic", "wechatpay", "alipay"] {
        assert_eq!(per_channel(channel), 18, "{channel} payments");
    }
    assert_eq!(server.events("order.paid"), 3 * 14);

    // Keys the target does not trust are setup errors (exit 2), named as such.
    let one = |channel: &'static str, keys: Vec<&'static str>| -> String {
        let mut args = vec!["--target", target.as_str(), "--channel", channel, "--scenario", "concurrent"];
        args.extend(["--orders", "1"]);
        args.extend(keys);
        simulate(&args).error().to_owned()
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
fn every_scenario_is_ok_against_a_running_server_and_reruns_do_not_collide() {
    let server = Payonce::start(false);
    let target = server.target();
    let mut args = vec!["--target", target.as_str(), "--callback-secret", SECRET];
    args.extend(FAST);
    let run = simulate(&args);
    assert!(run.ok(), "{run:?}");

    // The simulator really did the work: 7 scenarios pay 3 orders each.
    assert_eq!(server.events("order.paid"), 21);

    // A second run on the same server uses new order_nos and is judged on its own orders.
    let mut again =
        vec!["--target", target.as_str(), "--callback-secret", SECRET, "--scenario", "concurrent,triple_click"];
    again.extend(FAST);
    let run = simulate(&again);
    assert!(run.ok(), "{run:?}");

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
    assert!(wrong.error().contains("signature"), "{wrong:?}");
}

/// By default a retry schedule is played for its first hour (WeChat Pay: the
/// first delivery and 6 retries; Alipay: 1 and 3); --full-schedules plays
/// all 24 hours (16 and 8). The generic channel alternates the two, so two
/// orders are one of each. Every delivery after the first is a duplicate.
#[test]
fn retry_schedules_play_their_first_hour_unless_full() {
    let table_row = |run: &Run| -> String {
        assert!(run.ok(), "{run:?}");
        run.stdout.lines().find(|l| l.starts_with("retry_schedule")).unwrap_or_default().to_owned()
    };
    let args = ["--scenario", "retry_schedule", "--orders", "2", "--time-factor", "200000", "--verbose"];
    let short = table_row(&simulate(&args));
    assert!(short.contains("11: 2 applied, 9 duplicate"), "{short}");
    let mut full_args = args.to_vec();
    full_args.push("--full-schedules");
    let full = table_row(&simulate(&full_args));
    assert!(full.contains("24: 2 applied, 22 duplicate"), "{full}");
}

/// A "payment service" with the seed's bug: every delivery is `applied` and
/// every payment issued the coupon again. The simulator must say VIOLATION
/// (exit 1) from what this server answers and shows, not pass it — also on
/// the platforms' channels, whose answers (204, `success`) carry no outcome,
/// so only the read API can show it.
#[test]
fn a_server_that_applies_every_delivery_is_a_violation() {
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
    let server = Payonce::serve(
        Server::bind("127.0.0.1:0").expect("bind"),
        move |server, flag| server.serve_fn(handler, flag, 4),
        PathBuf::new(),
        TempDir::new("buggy"),
    );
    let target = server.target();
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
    for channel in ["generic", "wechatpay", "alipay"] {
        let mut args = vec!["--target", target.as_str(), "--channel", channel];
        args.extend(["--scenario", "concurrent", "--orders", "2"]);
        args.extend(keys);
        let run = simulate(&args);
        assert_eq!(run.code, Some(1), "{channel}: {run:?}");
        assert!(run.stdout.contains("VIOLATION in concurrent"), "{channel}: {run:?}");
        let last = run.stdout.lines().last().unwrap_or_default();
        assert!(last.starts_with("1 scenario runs: 0 ok, 1 with violations, 0 skipped"), "{channel}: {last}");
    }
}

#[test]
fn setup_problems_are_errors() {
    simulate(&["--target", "http://127.0.0.1:1", "--callback-secret", "x"]).error();
    let no_secret = simulate(&["--target", "http://127.0.0.1:1"]);
    assert!(no_secret.error().contains("--callback-secret"), "a target needs a secret: {no_secret:?}");
    simulate(&["--scenario", "nonsense"]).error();
    simulate(&["--orders", "0"]).error();
    simulate(&["--channel", "paypal"]).error();
    // Against a target, every selected channel needs its keys, named in the error.
    let missing = simulate(&["--target", "http://127.0.0.1:1", "--channel", "all"]);
    for flag in ["--callback-secret", "--wechatpay-private-key", "--wechatpay-serial", "--wechatpay-apiv3-key"] {
        assert!(missing.error().contains(flag), "{flag}: {missing:?}");
    }
    let mode = simulate(&["--key-mode", "both"]);
    assert!(mode.error().contains("public-key or certificate"), "{mode:?}");
    let certificate_target =
        simulate(&["--target", "http://127.0.0.1:1", "--channel", "wechatpay", "--key-mode", "certificate"]);
    assert!(certificate_target.error().contains("in-process payonce only"), "{certificate_target:?}");
    let short = simulate(&["--channel", "wechatpay", "--wechatpay-apiv3-key", "short", "--orders", "1"]);
    assert!(short.error().contains("32 bytes"), "{short:?}");
    let help = simulate(&["--help"]);
    assert!(help.ok() && help.stdout.contains("--full-schedules"), "{help:?}");
    for scenario in PLATFORM_SCENARIOS {
        assert!(help.stdout.contains(&format!("\n  {scenario} ")), "{scenario} in the scenario list: {help:?}");
    }
}
