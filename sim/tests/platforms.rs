//! `payonce-sim platforms` (`payonce simulate platforms`): the simulated
//! WeChat Pay and Alipay merchant APIs on their own, for a real payonce.
//! The flags it prints are what payonce is configured with, read from the
//! files it wrote; payonce's sync finds the payment whose notification was
//! lost; the stdin commands open trades, pay them and switch faults; each
//! call is logged on stderr.
//!
//! The payonce here is the library's `App` behind its own HTTP edge in this
//! process, configured from the printed flags as `payonce serve` reads them:
//! the `payonce` binary belongs to another package, so `cargo test -p
//! payonce-sim` does not build it (see tests/simulate.rs).

mod common;

use common::platforms_sim::{read, Sim};
use common::{Payonce, TempDir};
use payonce::app::Config;
use payonce::http::Server;
use payonce::platform_ops::Platforms;
use payonce::platforms::alipay::public_key_from_text;
use payonce::platforms::alipay::AlipayApi;
use payonce::platforms::wechatpay::public_key_from_pem;
use payonce::platforms::wechatpay::WechatpayApi;
use payonce::platforms::MerchantKey;
use payonce::{App, Clock};
use payonce_testclient as client;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

/// payonce's merchant key fixture (2048 bits: ring signs with no less).
const MERCHANT_KEY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/keys/merchant.pem");
/// The flags `payonce serve` needs for both platforms' outgoing calls, in
/// the order printed (`--public-base-url` follows when it was given).
const FLAGS: [&str; 10] = [
    "--wechatpay-mchid",
    "--wechatpay-merchant-serial",
    "--wechatpay-merchant-key",
    "--wechatpay-public-key",
    "--wechatpay-api-base",
    "--wechatpay-appid",
    "--alipay-app-id",
    "--alipay-app-private-key",
    "--alipay-public-key",
    "--alipay-gateway",
];
const HTTP_TIMEOUT: Duration = Duration::from_secs(30);

/// payonce on a fresh file database, in process (`common::Payonce`), its
/// outgoing calls configured from the printed flags the way `payonce serve`
/// reads them.
impl Payonce {
    fn start(sim: &Sim) -> Payonce {
        let timeout = Duration::from_secs(5);
        let merchant_key = |flag: &str| MerchantKey::from_pem(&read(sim.flag(flag))).expect("the merchant key");
        let (serial, file) = sim.flag("--wechatpay-public-key").split_once('=').expect("SERIAL=FILE");
        let wechatpay_key = public_key_from_pem(&read(file)).expect("WeChat Pay's platform key");
        let alipay_key = public_key_from_text(&read(sim.flag("--alipay-public-key"))).expect("the Alipay key");
        let platforms = Platforms {
            registry: payonce::platforms::Registry::with([
                payonce::platforms::Platform::calls(WechatpayApi::new(
                    sim.flag("--wechatpay-mchid").to_owned(),
                    sim.flag("--wechatpay-merchant-serial").to_owned(),
                    merchant_key("--wechatpay-merchant-key"),
                    sim.flag("--wechatpay-api-base"),
                    vec![(serial.to_owned(), wechatpay_key)],
                    timeout,
                )),
                payonce::platforms::Platform::calls(AlipayApi::new(
                    sim.flag("--alipay-app-id").to_owned(),
                    merchant_key("--alipay-app-private-key"),
                    sim.flag("--alipay-gateway"),
                    alipay_key,
                    timeout,
                )),
            ]),
            timeout_ms: timeout.as_millis() as u64,
            ..Platforms::default()
        };
        let dir = TempDir::new("payonce");
        let db = dir.0.join("payonce.db");
        let config = Config { platforms, ..Config::default() };
        let app = App::open(db.to_str().expect("utf-8 path"), Clock::System, config).expect("open payonce");
        Payonce::serve(
            Server::bind("127.0.0.1:0").expect("bind"),
            move |server, flag| server.serve(Arc::new(app), flag, 4),
            db,
            dir,
        )
    }

    fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let headers: &[(&str, &str)] = if body.is_empty() { &[] } else { &[("Content-Type", "application/json")] };
        let reply = client::request(self.addr, method, path, headers, body.as_bytes(), HTTP_TIMEOUT).expect(path);
        (reply.status, serde_json::from_slice(&reply.body).unwrap_or(Value::Null))
    }

    fn create_order(&self, order_no: &str, amount: i64) {
        let order = json!({"order_no": order_no, "user_id": "u1", "amount": amount, "currency": "CNY"});
        let (status, body) = self.call("POST", "/v1/orders", Some(order));
        assert_eq!(status, 201, "{body}");
    }

    /// `POST /v1/orders/{no}/sync`: the order's status and each platform's state.
    fn sync(&self, order_no: &str) -> (String, Vec<(String, String, Value)>) {
        let (status, body) = self.call("POST", &format!("/v1/orders/{order_no}/sync"), None);
        assert_eq!(status, 200, "{body}");
        let platforms = body["platforms"].as_array().expect("platforms").iter();
        let states = platforms
            .map(|p| {
                (
                    p["channel"].as_str().unwrap_or("").to_owned(),
                    p["state"].as_str().unwrap_or("").to_owned(),
                    p["pay_no"].clone(),
                )
            })
            .collect();
        (body["order"]["status"].as_str().unwrap_or("").to_owned(), states)
    }
}

fn states(synced: &[(String, String, Value)]) -> Vec<(&str, &str)> {
    synced.iter().map(|(channel, state, _)| (channel.as_str(), state.as_str())).collect()
}

/// With no key given, the merchant key is made and written with the
/// platforms' public keys into a temporary directory, gone after the exit.
/// payonce configured from the printed flags finds the payment the
/// notification never brought; the commands play a trade at Alipay through
/// a fault.
#[test]
fn payonce_pointed_at_the_printed_flags_syncs_a_lost_payment() {
    let mut sim = Sim::start(&["--trade", "ORD_T1=1000:paid"]);
    let printed: Vec<&str> = sim.flags.iter().map(|(flag, _)| flag.as_str()).collect();
    assert_eq!(printed, FLAGS);
    assert_eq!(sim.flag("--wechatpay-mchid"), "1900000100");
    assert_eq!(sim.flag("--wechatpay-merchant-serial"), "SIMULATOR-MERCHANT");
    assert_eq!(sim.flag("--wechatpay-appid"), "wxsimulatorpayonce");
    assert_eq!(sim.flag("--alipay-app-id"), "2021000000000000");
    assert!(sim.flag("--wechatpay-api-base").starts_with("http://127.0.0.1:"), "{:?}", sim.flags);
    assert!(sim.flag("--alipay-gateway").ends_with("/gateway.do"), "{:?}", sim.flags);
    let key_file = PathBuf::from(sim.flag("--wechatpay-merchant-key"));
    assert_eq!(sim.flag("--alipay-app-private-key"), key_file.to_str().unwrap(), "one merchant key for both");
    let dir = key_file.parent().expect("a directory").to_owned();
    assert!(key_file.is_absolute() && key_file.ends_with("merchant-key.pem"), "{key_file:?}");
    assert!(read(key_file.to_str().unwrap()).starts_with("-----BEGIN PRIVATE KEY-----"));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&key_file).expect("key file").permissions().mode();
        assert_eq!(mode & 0o077, 0, "the private key is the owner's only: {mode:o}");
    }
    assert_eq!(
        sim.flag("--wechatpay-public-key"),
        format!("PUB_KEY_ID_SIMULATOR={}", dir.join("wechatpay-platform.pem").display())
    );
    assert_eq!(Path::new(sim.flag("--alipay-public-key")), dir.join("alipay-public.pem"));

    let payonce = Payonce::start(&sim);
    payonce.create_order("ORD_T1", 1000);
    let (status, synced) = payonce.sync("ORD_T1");
    assert_eq!(status, "PAID");
    assert_eq!(states(&synced), [("wechatpay", "paid"), ("alipay", "not_paid")]);
    let pay_no = synced[0].2.as_str().expect("pay_no").to_owned();
    let (_, detail) = payonce.call("GET", "/v1/orders/ORD_T1", None);
    let payments = detail["payments"].as_array().expect("payments");
    assert_eq!(payments.len(), 1, "{detail}");
    assert_eq!(payments[0]["source"], "query");
    assert_eq!(payments[0]["pay_no"], pay_no.as_str());
    assert_eq!(sim.command("state ORD_T1"), "wechatpay=SUCCESS alipay=none");
    // Made out of band: no prepay asked for it, nothing handed over.
    let trade: Value = serde_json::from_str(&sim.command("trade wechatpay ORD_T1")).expect("a JSON line");
    assert_eq!((trade["trade_type"].as_str(), trade["amount"].as_i64()), (Some("NATIVE"), Some(1000)), "{trade}");
    assert!(trade["payment"].is_null() && trade["pay_no"].is_string(), "{trade}");
    assert_eq!(sim.command("trade alipay ORD_T1"), "none");
    assert_eq!(sim.listing("prepays ORD_T1"), Vec::<String>::new());
    assert!(sim.command("open-url https://elsewhere/gateway.do?a=1").starts_with("refused: "), "not this gateway");
    assert_eq!(
        sim.calls(),
        [
            "wechatpay GET /v3/pay/transactions/out-trade-no/ORD_T1?mchid=1900000100 verified 200",
            "alipay POST alipay.trade.query verified 200 ACQ.TRADE_NOT_EXIST",
        ],
        "payonce's requests verify with the key the flags name"
    );

    // A trade at Alipay, driven from stdin.
    assert_eq!(sim.command("open alipay ORD_T2 500"), "ok");
    payonce.create_order("ORD_T2", 500);
    assert_eq!(sim.command("fault alipay 5xx"), "ok");
    let (status, synced) = payonce.sync("ORD_T2");
    assert_eq!((status.as_str(), states(&synced)), ("PENDING", vec![("wechatpay", "not_paid"), ("alipay", "unknown")]));
    assert_eq!(sim.command("fault alipay none"), "ok");
    let (status, synced) = payonce.sync("ORD_T2");
    assert_eq!(
        (status.as_str(), states(&synced)),
        ("PENDING", vec![("wechatpay", "not_paid"), ("alipay", "not_paid")])
    );
    let trade_no = sim.command("pay ORD_T2");
    assert!(trade_no.len() == 28 && trade_no.bytes().all(|b| b.is_ascii_digit()), "{trade_no:?}");
    assert_eq!(sim.command("pay ORD_T2"), format!("refused: already paid ({trade_no})"));
    assert_eq!(sim.command("pay ORD_NONE"), "refused: no such trade");
    let (status, synced) = payonce.sync("ORD_T2");
    assert_eq!((status.as_str(), states(&synced)), ("PAID", vec![("wechatpay", "not_paid"), ("alipay", "paid")]));
    assert_eq!(synced[1].2, trade_no.as_str());
    assert_eq!(sim.command("state ORD_T2"), "wechatpay=none alipay=TRADE_SUCCESS");
    assert!(sim.command("open ORD.T3 100").starts_with("error: "), "a number WeChat Pay cannot carry");
    assert!(sim.command("fault paypal 5xx").starts_with("error: "));
    assert!(sim.command("nonsense").starts_with("error: "));
    // No refund asked: none held, none to settle.
    assert_eq!(sim.listing("refunds"), Vec::<String>::new());
    assert_eq!(sim.command("settle U-1 success"), "error: no refund U-1");
    assert!(sim.command("settle U-1 done").starts_with("error: status \"done\""));
    assert!(sim.command("settle U-1").starts_with("error: usage: settle"));
    let calls = sim.calls();
    assert_eq!(calls.len(), 8, "{calls:#?}");
    assert!(calls.contains(&"alipay POST alipay.trade.query verified 500 isp.unknow-error".to_owned()), "{calls:#?}");

    let (exit, stderr) = sim.finish();
    assert!(exit.success(), "{exit:?} {stderr}");
    // Each call logged as it came, in the same words as `calls`.
    let logged: Vec<&str> =
        stderr.lines().filter(|l| l.starts_with("wechatpay GET ") || l.starts_with("alipay POST ")).collect();
    assert_eq!(logged.len(), calls.len(), "{stderr}");
    for call in &calls {
        assert!(logged.contains(&call.as_str()), "{call} not logged: {stderr}");
    }
    assert!(!dir.exists(), "its own temporary directory is removed at the exit");
}

/// A given PKCS#1 merchant key is used where it is (not copied), the files
/// go into --dir and stay; with --ignore-stdin only a signal stops it.
#[cfg(unix)]
#[test]
fn a_given_key_and_dir_are_used_and_a_signal_stops_it() {
    use rsa::pkcs1::EncodeRsaPrivateKey;
    use rsa::pkcs8::DecodePrivateKey;
    let dir = TempDir::new("given");
    let key = rsa::RsaPrivateKey::from_pkcs8_pem(&read(MERCHANT_KEY)).expect("the fixture key");
    let key_file = dir.0.join("merchant-pkcs1.pem");
    std::fs::write(&key_file, key.to_pkcs1_pem(rsa::pkcs8::LineEnding::LF).expect("PKCS#1").as_bytes()).expect("write");
    let files = dir.0.join("files");
    let mut sim =
        Sim::start(&["--merchant-key", key_file.to_str().unwrap(), "--dir", files.to_str().unwrap(), "--ignore-stdin"]);
    let files = std::fs::canonicalize(&files).expect("--dir made");
    assert_eq!(Path::new(sim.flag("--wechatpay-merchant-key")), std::fs::canonicalize(&key_file).unwrap());
    assert!(!files.join("merchant-key.pem").exists(), "a given key is not copied");

    // Both platforms answer this merchant's signature: an order they never
    // had is not paid at either (a refused signature would be `unknown`).
    let payonce = Payonce::start(&sim);
    payonce.create_order("ORD_NOT_AT_ALL", 100);
    let (status, synced) = payonce.sync("ORD_NOT_AT_ALL");
    assert_eq!(
        (status.as_str(), states(&synced)),
        ("PENDING", vec![("wechatpay", "not_paid"), ("alipay", "not_paid")])
    );

    // Closing stdin does not stop it; SIGTERM does.
    drop(sim.stdin.take());
    thread::sleep(Duration::from_millis(300));
    assert!(sim.child.try_wait().expect("wait").is_none(), "still serving with stdin closed");
    let killed = Command::new("kill").args(["-TERM", &sim.child.id().to_string()]).status().expect("kill");
    assert!(killed.success());
    let (exit, stderr) = sim.finish();
    assert!(exit.success(), "{exit:?} {stderr}");
    assert!(stderr.contains("stopping (a signal)"), "{stderr}");
    assert_eq!(stderr.lines().filter(|l| l.contains(" verified ")).count(), 2, "{stderr}");
    for name in ["wechatpay-platform.pem", "alipay-public.pem"] {
        assert!(read(files.join(name).to_str().unwrap()).starts_with("-----BEGIN PUBLIC KEY-----"), "{name} kept");
    }
}

#[test]
fn help_and_setup_errors() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_payonce-sim")).arg("platforms").args(args).output().expect("run")
    };
    let help = run(&["--help"]);
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(help.status.success(), "{help:?}");
    for word in [
        "--wechatpay-port",
        "--merchant-key",
        "--public-base-url",
        "--trade",
        "Commands on stdin",
        "open-url",
        "fault PLATFORM",
        "calls",
    ] {
        assert!(text.contains(word), "{word} in the help");
    }
    for (args, says) in [
        (&["--trade", "ORD_1=ten"][..], "--trade"),
        (&["--trade", "paypal:ORD_1=10"][..], "--trade"),
        (&["--wechatpay-port", "70000"][..], "--wechatpay-port"),
        (&["--public-base-url", "ftp://shop"][..], "--public-base-url"),
        (&["--merchant-key", "/nonexistent/key.pem"][..], "--merchant-key"),
        (&["--bogus"][..], "--bogus"),
    ] {
        let out = run(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    // The simulator's own help still names the scenarios, and the subcommand.
    let main_help = Command::new(env!("CARGO_BIN_EXE_payonce-sim")).arg("--help").output().expect("run");
    let text = String::from_utf8_lossy(&main_help.stdout);
    assert!(main_help.status.success() && text.contains("--full-schedules") && text.contains("platforms"));
}
