//! `POST /v1/orders/{order_no}/pay` by real `payonce serve` processes
//! against `payonce-sim platforms` (docs/platforms.md, "Paying"): a triple
//! click split across two processes on one SQLite file is one prepay call
//! and one trade, answered alike; a process SIGKILLed between the
//! platform's answer and storing it leaves one trade, which the restarted
//! process asks for again with the same request once the dead call's lease
//! has run out. (The same in one process, the client signatures and the
//! reuse window: sim/src/platform_api/pay_http.rs.)
//!
//! The `payonce` binary belongs to another package: `cargo test -p
//! payonce-sim` does not build it, `make test` (`cargo test --workspace`)
//! does. These tests use the one beside `payonce-sim`, and skip, loudly,
//! when it is missing or older than the service's sources (in CI they
//! fail instead).

mod common;

use common::platforms_sim::Sim;
use common::TempDir;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Barrier, OnceLock};
use std::thread;
use std::time::{Duration, Instant, SystemTime};

/// payonce's merchant key fixture (2048 bits: ring signs with no less):
/// given, so the simulator makes no merchant key, which an unoptimised
/// build takes seconds for.
const MERCHANT_KEY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/keys/merchant.pem");
const PUBLIC_BASE_URL: &str = "https://shop.example";
const HTTP_TIMEOUT: Duration = Duration::from_secs(30);
/// `--platform-timeout-ms` of the SIGKILL test: a waiting request waits this
/// plus a second; a dead call's lease lasts twice this (the creation and the
/// query a "paid" answer makes) plus five seconds for the writes around them
/// (src/services/prepays.rs, `lease_ms`).
const PLATFORM_TIMEOUT_MS: u64 = 500;
const LEASE_MS: u64 = 2 * PLATFORM_TIMEOUT_MS + 5_000;

/// The `payonce` binary beside `payonce-sim`, when it is there and built
/// after every source it is made of was last changed; else why not.
fn find_payonce() -> Result<PathBuf, String> {
    let exe =
        Path::new(env!("CARGO_BIN_EXE_payonce-sim")).with_file_name(format!("payonce{}", std::env::consts::EXE_SUFFIX));
    let built =
        std::fs::metadata(&exe).and_then(|m| m.modified()).map_err(|_| format!("{} is not built", exe.display()))?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let root = std::fs::canonicalize(&root).unwrap_or(root);
    let mut newest: Option<(SystemTime, PathBuf)> = None;
    let mut pending: Vec<PathBuf> = ["src", "migrations", "console", "Cargo.toml", "Cargo.lock"]
        .iter()
        .map(|p| root.join(p))
        .chain(["schema.sql", "schema.postgres.sql"].iter().map(|p| root.join(p)))
        .collect();
    while let Some(path) = pending.pop() {
        let Ok(meta) = std::fs::metadata(&path) else { continue };
        if meta.is_dir() {
            let entries = std::fs::read_dir(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            pending.extend(entries.filter_map(|e| e.ok()).map(|e| e.path()));
        } else if let Ok(modified) = meta.modified() {
            if newest.as_ref().is_none_or(|(at, _)| modified > *at) {
                newest = Some((modified, path));
            }
        }
    }
    match newest {
        Some((at, path)) if at > built => {
            Err(format!("{} is older than {}: a stale build", exe.display(), path.display()))
        }
        _ => Ok(exe),
    }
}

/// [`find_payonce`], once; `None` (said on stderr) means skip, outside CI.
fn payonce_binary() -> Option<PathBuf> {
    static FOUND: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match FOUND.get_or_init(find_payonce) {
        Ok(exe) => Some(exe.clone()),
        Err(why) => {
            assert!(std::env::var_os("CI").is_none(), "{why}; CI builds it (cargo test --workspace)");
            // Straight to fd 2: the harness captures eprintln! of a test that passes.
            let _ = writeln!(
                std::io::stderr(),
                "=== {why}: the `payonce serve` tests of sim/tests/prepay.rs are SKIPPED \
                 (make test, or cargo build --bin payonce first) ==="
            );
            None
        }
    }
}

/// The simulated platforms, expecting payonce's notify_urls under
/// [`PUBLIC_BASE_URL`], which they print among the flags.
fn platforms() -> Sim {
    let sim = Sim::start(&["--merchant-key", MERCHANT_KEY, "--public-base-url", PUBLIC_BASE_URL]);
    assert_eq!(sim.flag("--public-base-url"), PUBLIC_BASE_URL);
    assert_eq!(sim.flag("--wechatpay-appid"), "wxsimulatorpayonce");
    sim
}

/// A `payonce serve` on `db`, configured with every flag `sim` printed;
/// SIGKILLed on drop, its stderr shown if the test failed.
struct Serve {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Serve {
    fn start(exe: &Path, db: &Path, sim: &Sim, extra: &[&str], env: &[(&str, &str)]) -> Serve {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let log = db.with_file_name(format!("serve-{n}.log"));
        let mut command = Command::new(exe);
        command.args(["serve", "--listen", "127.0.0.1:0", "--callback-secret", "test-secret", "--db"]).arg(db);
        for (flag, value) in &sim.flags {
            command.args([flag, value]);
        }
        let mut child = command
            .args(extra)
            .env_remove("PAYONCE_TEST_HOLD_AFTER_PREPAY_MS")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(std::fs::File::create(&log).expect("the log file")))
            .spawn()
            .expect("start payonce serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("its first line");
        let Some(addr) = line.trim().strip_prefix("listening on http://").and_then(|a| a.parse().ok()) else {
            let _ = child.kill();
            let stderr = std::fs::read_to_string(&log).unwrap_or_default();
            panic!("payonce serve did not start: {line:?}\n{stderr}");
        };
        Serve { child, addr, log }
    }

    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Vec<u8>) {
        request(self.addr, method, path, body).unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

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

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.kill();
        if thread::panicking() {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            eprintln!("---- payonce serve stderr ({}) ----\n{text}---- end ----", self.log.display());
        }
    }
}

fn request(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> Result<(u16, Vec<u8>), String> {
    let text = body.map(Value::to_string).unwrap_or_default();
    let headers: &[(&str, &str)] = if body.is_some() { &[("Content-Type", "application/json")] } else { &[] };
    let reply = payonce_testclient::request(addr, method, path, headers, text.as_bytes(), HTTP_TIMEOUT)
        .map_err(|e| e.to_string())?;
    Ok((reply.status, reply.body))
}

fn json_of(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(bytes)))
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
