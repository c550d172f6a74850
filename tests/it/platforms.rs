//! The platform settings (docs/platforms.md, docs/settings.md) and `POST /v1/orders/{order_no}/sync` over HTTP
//! (the clients against the simulated platforms: sim/src/platform_api/payonce_sync.rs).

use crate::util::{payonce_cli, Server, TempDir};
use serde_json::{json, Value};

const MERCHANT_KEY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/keys/merchant.pem");

/// The public half of a fixture key, as `--wechatpay-public-key` and `--alipay-public-key` take it.
fn public_pem(dir: &TempDir) -> String {
    use rsa::pkcs8::{DecodePrivateKey, EncodePublicKey, LineEnding};
    let private = rsa::RsaPrivateKey::from_pkcs8_pem(&std::fs::read_to_string(MERCHANT_KEY).expect("fixture"))
        .expect("a PKCS#8 key");
    let path = dir.path("platform-public.pem");
    std::fs::write(&path, private.to_public_key().to_public_key_pem(LineEnding::LF).expect("pem")).expect("write");
    path.display().to_string()
}

#[test]
fn outgoing_settings_come_whole_or_serve_names_what_is_missing() {
    let dir = TempDir::new("platform-flags");
    let db = dir.path("payonce.db").display().to_string();
    let public = public_pem(&dir);
    let serve = |extra: &[&str]| {
        let mut args = vec!["serve", "--db", &db, "--listen", "127.0.0.1:0", "--dev"];
        args.extend(extra);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_payonce")).args(&args).output().expect("serve");
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, stderr) = serve(&["--wechatpay-mchid", "1900000100"]);
    assert_eq!(code, Some(2), "{stderr}");
    for missing in ["--wechatpay-merchant-serial", "--wechatpay-merchant-key", "--wechatpay-public-key"] {
        assert!(stderr.contains(missing), "names {missing}: {stderr}");
    }
    let (code, stderr) = serve(&["--alipay-app-private-key", MERCHANT_KEY]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--alipay-app-id") && stderr.contains("--alipay-public-key"), "{stderr}");
    let (code, stderr) = serve(&["--wechatpay-api-base", "ftp://example/"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--wechatpay-api-base"), "{stderr}");
    // v1's notification-only settings start exactly as before: a platform key needs the APIv3 key.
    let (code, stderr) = serve(&["--wechatpay-public-key", &format!("S1={public}")]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--wechatpay-apiv3-key"), "{stderr}");
}

#[test]
fn sync_asks_the_configured_platforms_and_says_when_one_cannot_answer() {
    let dir = TempDir::new("platform-sync");
    let public = public_pem(&dir);
    let key = format!("S1={public}");
    let wechatpay = unreachable_wechatpay(&key);
    let server =
        Server::start_on(&dir.path("payonce.db"), &[&wechatpay[..], &["--platform-timeout-ms", "2000"]].concat());
    let created = server.post_json("/v1/orders", &json!({"order_no": "ORD-SYNC-HTTP", "user_id": "u1", "amount": 100}));
    assert_eq!(created.status, 201);
    let synced = server.post_json("/v1/orders/ORD-SYNC-HTTP/sync", &json!({}));
    assert_eq!(synced.status, 200, "{}", synced.text());
    let body = synced.json();
    assert_eq!(body["order"]["status"], "PENDING");
    assert_eq!(
        body["platforms"],
        json!([{"channel": "wechatpay", "state": "unknown", "pay_no": null, "amount": null}])
    );
    // Never stored under an Idempotency-Key: the same key asks again.
    let keyed = crate::util::request(
        server.addr,
        "POST",
        "/v1/orders/ORD-SYNC-HTTP/sync",
        &[("Content-Type", "application/json"), ("Idempotency-Key", "k-1")],
        b"{}",
    );
    assert_eq!(keyed.status, 200);
    assert_eq!(keyed.header("Idempotent-Replayed"), None);
    let missing = server.post_json("/v1/orders/NO-SUCH/sync", &json!({}));
    assert_eq!((missing.status, missing.error_code().as_str()), (404, "order_not_found"));
    let db = server.db.display().to_string();
    drop(server);
    let conn = rusqlite::Connection::open(&db).expect("db");
    let failed: i64 = conn
        .query_row("SELECT count(*) FROM platform_call WHERE kind = 'query' AND status = 'failed'", [], |r| r.get(0))
        .expect("count");
    assert_eq!(failed, 2, "each call kept");

    // payonce sync: the same, offline; exit 1 because a platform could not answer.
    let (code, stdout, stderr) = payonce_cli(&[&["sync", "--db", &db][..], &wechatpay, &["ORD-SYNC-HTTP"]].concat());
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    let printed: serde_json::Value = serde_json::from_str(&stdout).expect("JSON on stdout");
    assert_eq!(printed["platforms"][0]["state"], "unknown");
    let (code, _, stderr) = payonce_cli(&["sync", "--db", &db, "ORD-SYNC-HTTP"]);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("outgoing settings"), "{stderr}");
}

/// WeChat Pay's outgoing settings with `key` as its public key, at a base
/// URL where nothing listens (port 9): every platform call fails at once.
fn unreachable_wechatpay(key: &str) -> [&str; 10] {
    [
        "--wechatpay-mchid",
        "1900000100",
        "--wechatpay-merchant-serial",
        "M1",
        "--wechatpay-merchant-key",
        MERCHANT_KEY,
        "--wechatpay-public-key",
        key,
        "--wechatpay-api-base",
        "http://127.0.0.1:9",
    ]
}

/// `payonce simulate platforms` (the simulator's standalone servers) as a
/// child process: the `payonce serve` flags it printed, and its stdin for
/// commands (tests/it/partial_refunds.rs starts it too).
pub(crate) struct SimulatedPlatforms {
    child: std::process::Child,
    stdout: std::io::BufReader<std::process::ChildStdout>,
    pub(crate) flags: Vec<String>,
    _dir: TempDir,
}

impl SimulatedPlatforms {
    /// `None` when payonce-sim was not built next to payonce (a lone `cargo test --test it`).
    pub(crate) fn start(trade: &str) -> Option<SimulatedPlatforms> {
        use std::io::BufRead;
        let sim = std::path::Path::new(env!("CARGO_BIN_EXE_payonce")).with_file_name("payonce-sim");
        if !sim.exists() {
            let required = std::env::var("CI").is_ok();
            assert!(!required, "payonce-sim is not built next to payonce ({})", sim.display());
            eprintln!("=== payonce-sim not built: skipping (cargo build --workspace) ===");
            return None;
        }
        let dir = TempDir::new("sim-platforms");
        let mut child = std::process::Command::new(&sim)
            .args(["platforms", "--trade", trade, "--dir"])
            .arg(dir.path(""))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start payonce-sim platforms");
        let mut stdout = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        let mut flags = Vec::new();
        loop {
            let mut line = String::new();
            assert!(stdout.read_line(&mut line).expect("a line") > 0, "payonce-sim platforms ended before ready");
            if line.trim() == "ready" {
                break;
            }
            flags.extend(line.split_whitespace().map(|w| w.trim_matches('\'').to_owned()));
        }
        Some(SimulatedPlatforms { child, stdout, flags, _dir: dir })
    }

    /// Every call the platforms were made so far, one line each (`calls`).
    pub(crate) fn calls(&mut self) -> Vec<String> {
        use std::io::{BufRead, Write};
        let stdin = self.child.stdin.as_mut().expect("stdin");
        writeln!(stdin, "calls").and_then(|()| stdin.flush()).expect("command");
        let mut lines = Vec::new();
        loop {
            let mut line = String::new();
            assert!(self.stdout.read_line(&mut line).expect("a line") > 0, "payonce-sim ended");
            match line.trim() {
                "end" => return lines,
                call => lines.push(call.to_owned()),
            }
        }
    }

    /// The trade's state at each platform (`state ORDER_NO` on its stdin).
    fn state(&mut self, order_no: &str) -> String {
        use std::io::{BufRead, Write};
        let stdin = self.child.stdin.as_mut().expect("stdin");
        writeln!(stdin, "state {order_no}").expect("command");
        stdin.flush().expect("flush");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("its answer");
        line.trim().to_owned()
    }
}

impl Drop for SimulatedPlatforms {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A SIGKILL between a platform's close and the local one: after the restart
/// the order is closed, exactly once, with one `platform_closed` audit row.
#[test]
fn sigkill_between_the_platform_close_and_the_local_close_closes_once() {
    let Some(mut platforms) = SimulatedPlatforms::start("ORD_KILL_1=1000") else {
        return;
    };
    let dir = TempDir::new("platform-kill");
    let db = dir.path("payonce.db");
    let flags = platforms.flags.clone();
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    args.extend(["--sweep-interval-s", "1", "--platform-timeout-ms", "1000", "--platform-retry-s", "0.2"]);
    let log = dir.path("first.log");
    let mut first = Server::start_logged_env(
        &db,
        &args,
        std::process::Stdio::from(std::fs::File::create(&log).expect("log")),
        &[("PAYONCE_TEST_HOLD_AFTER_PLATFORM_CLOSE_MS", "30000")],
    );
    first.set_stderr_log(log);
    let created = first.post_json(
        "/v1/orders",
        &json!({"order_no": "ORD_KILL_1", "user_id": "u1", "amount": 1000, "expires_in_s": 1}),
    );
    assert_eq!(created.status, 201, "{}", created.text());
    // Expiry, then the sweeper queues and the pool works both closes; each
    // platform confirms and the pool holds before recording it.
    let closes_in_flight = || {
        let conn = rusqlite::Connection::open(&db).expect("db");
        conn.query_row(
            "SELECT count(*) FROM platform_call WHERE kind = 'close' AND status = 'pending' AND attempts = 1",
            [],
            |r| r.get::<_, i64>(0),
        )
        .unwrap_or(0)
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while closes_in_flight() < 2 {
        assert!(std::time::Instant::now() < deadline, "the pool never started the closes");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // The calls are made at once; the hold keeps payonce from recording them.
    std::thread::sleep(std::time::Duration::from_millis(800));
    assert_eq!(first.get("/v1/orders/ORD_KILL_1").json()["status"], "PENDING");
    let at_the_platform = platforms.state("ORD_KILL_1");
    assert!(at_the_platform.contains("wechatpay=CLOSED"), "closed at WeChat Pay before the kill: {at_the_platform}");
    first.kill();

    let second = Server::start_on(&db, &args);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let detail = second.get("/v1/orders/ORD_KILL_1").json();
        if detail["status"] == "CLOSED" {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never closed after the restart: {detail}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    std::thread::sleep(std::time::Duration::from_millis(1_500));
    let detail = second.get("/v1/orders/ORD_KILL_1").json();
    let closed_rows =
        detail["audit"].as_array().into_iter().flatten().filter(|a| a["action"] == "platform_closed").count();
    assert_eq!(closed_rows, 1, "one platform_closed audit row: {detail}");
    let closed_events =
        detail["events"].as_array().into_iter().flatten().filter(|e| e["type"] == "order.closed").count();
    assert_eq!(closed_events, 1, "closed once: {detail}");
    // The order shows what was asked of each platform, and never the
    // request or the answer: the close at each, done, begun before the kill.
    let calls = detail["platform_calls"].as_array().cloned().unwrap_or_default();
    let closes: Vec<&Value> = calls.iter().filter(|c| c["kind"] == "close").collect();
    let mut channels: Vec<&str> = closes.iter().filter_map(|c| c["channel"].as_str()).collect();
    channels.sort_unstable();
    assert_eq!(channels, ["alipay", "wechatpay"], "one close row per platform: {detail}");
    for close in closes {
        assert_eq!(close["status"], "done", "{close}");
        assert!(close["attempts"].as_i64().is_some_and(|n| n >= 1), "{close}");
        // When it last changed, and nothing due any more.
        assert_eq!((close["refund_no"].clone(), close["next_attempt_at"].clone()), (Value::Null, Value::Null));
        let (created, updated) =
            (close["created_at"].as_str().unwrap_or(""), close["updated_at"].as_str().unwrap_or(""));
        assert!(!created.is_empty() && updated >= created, "a finished call's last change: {close}");
    }
    for call in &calls {
        let keys: Vec<&String> = call.as_object().map(|o| o.keys().collect()).unwrap_or_default();
        let expected =
            ["channel", "kind", "status", "attempts", "http_status", "created_at", "refund_no", "updated_at"];
        assert_eq!(keys, [&expected[..], &["next_attempt_at"]].concat(), "never the request or the answer: {call}");
    }
}

/// A payonce on `db` whose WeChat Pay never answers (nothing listens on port 9).
fn app_with_dead_wechatpay(db: &crate::engines::Db, clock: payonce::Clock) -> payonce::App {
    use payonce::platforms::wechatpay::WechatpayApi;
    use payonce::platforms::{MerchantKey, Platform, Platforms};
    let merchant = std::fs::read_to_string(MERCHANT_KEY).expect("fixture");
    let certificate =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/keys/platform-cert-valid.pem"))
            .expect("fixture");
    let api = WechatpayApi::new(
        "1900000100".into(),
        "M1".into(),
        MerchantKey::from_pem(&merchant).expect("key"),
        "http://127.0.0.1:9",
        vec![("S1".into(), payonce::platforms::wechatpay::public_key_from_pem(&certificate).expect("key"))],
        std::time::Duration::from_millis(500),
    );
    let platforms = Platforms { retry_schedule_ms: vec![1_000], ..Platforms::with([Platform::calls(api)]) };
    let config = payonce::Config { platforms, ..payonce::Config::default() };
    payonce::App::open(&db.spec, clock, config).expect("payonce")
}

for_each_engine! {
    /// The platform-call rows on both engines: a close queued at expiry,
    /// claimed and rescheduled; a query kept as failed; a refund submission
    /// queued in the REFUNDING transaction, once.
    fn platform_calls_are_kept_alike(db) {
        let clock = payonce::Clock::manual(crate::util::now_ms());
        let app = app_with_dead_wechatpay(db, clock.clone());
        let order = |order_no: &str, expires_in_s: Option<i64>| {
            app.orders().create_order(&payonce::CreateOrder {
                order_no: order_no.into(), user_id: "u1".into(), amount: 100, currency: "CNY".into(), expires_in_s,
            }).expect("order");
        };
        order("ORD-PC-1", Some(1));
        clock.advance_ms(2_000);
        assert_eq!(app.orders().close_expired(10).expect("sweep"), 1, "{}: queued", db.label());
        assert_eq!(app.orders().close_expired(10).expect("sweep"), 0, "{}: queued once", db.label());
        assert_eq!(app.platform_calls().run_platform_calls_once(8).expect("pool"), 1);
        let store = db.store();
        let count = |sql: &str| db.count(&store, sql);
        assert_eq!(count("SELECT count(*) FROM platform_call WHERE kind = 'close' AND status = 'pending' AND attempts = 1"), 1);
        assert_eq!(count("SELECT count(*) FROM platform_call WHERE kind = 'query' AND status = 'failed'"), 1);
        assert_eq!(app.platform_calls().run_platform_calls_once(8).expect("pool"), 0, "{}: the retry waits", db.label());
        assert_eq!(app.orders().order("ORD-PC-1").expect("detail").order.status, payonce::OrderStatus::Pending);

        order("ORD-PC-2", None);
        let synced = app.platform_calls().sync_order("ORD-PC-2").expect("sync");
        assert_eq!(synced.platforms[0].state, payonce::platforms::TradeState::Unknown);
        assert_eq!(count("SELECT count(*) FROM platform_call WHERE kind = 'query' AND status = 'failed'"), 2);

        let paid = app.payments().deliver_payment(&payonce::PaymentCallback {
            channel: "wechatpay".into(), pay_no: "WX-PC-2".into(), order_no: "ORD-PC-2".into(), amount: 100, currency: None,
            status: payonce::PlatformStatus::Success, paid_at: None, raw_body: b"{}".to_vec(),
        }).expect("payment");
        assert_eq!(paid.outcome_str(), "applied");
        app.refunds().request_refund("ORD-PC-2", "RF-PC-2").expect("refund");
        app.refunds().request_refund("ORD-PC-2", "RF-PC-2").expect("the same request again");
        assert_eq!(count("SELECT count(*) FROM platform_call WHERE kind = 'refund' AND refund_no = 'RF-PC-2'"), 1);
        assert_eq!(app.platform_calls().run_platform_calls_once(8).expect("pool"), 1, "{}: the submission is tried", db.label());
        assert_eq!(count("SELECT count(*) FROM platform_call WHERE kind = 'refund' AND status = 'pending' AND attempts = 1"), 1);
    }
}
