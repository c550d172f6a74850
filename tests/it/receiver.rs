//! The merchant's endpoint in the webhook tests: `tests/webhooks/receiver.py`,
//! a real HTTP server on a loopback socket that verifies every delivery
//! with the PyPI `standardwebhooks` library (never payonce's own code) and
//! answers as a test tells it. Its Python is `PAYONCE_WEBHOOK_PYTHON`, else
//! the virtual environment `scripts/webhook-venv` makes, else `python3`
//! (without the library: deliveries are not verified, said loudly, and with
//! `PAYONCE_REQUIRE_WEBHOOK_LIB=1`, as in CI, that is a failure).

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Two secrets, as during a rotation: payonce signs with both, and the
/// receiver verifies with each on its own.
pub const SECRETS: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw,whsec_c2Vjb25kLXNlY3JldC1vZi1wYXlvbmNlLXRlc3Rz";

pub struct Receiver {
    child: Child,
    pub addr: SocketAddr,
    /// The standardwebhooks version, or `None` when the library is missing.
    pub library: Option<String>,
}

fn python() -> String {
    if let Ok(python) = std::env::var("PAYONCE_WEBHOOK_PYTHON") {
        return python;
    }
    let venv = concat!(env!("CARGO_MANIFEST_DIR"), "/target/webhook-venv/bin/python");
    if std::path::Path::new(venv).exists() {
        venv.to_owned()
    } else {
        "python3".to_owned()
    }
}

impl Receiver {
    pub fn start() -> Receiver {
        Receiver::start_with_secrets(SECRETS)
    }

    pub fn start_with_secrets(secrets: &str) -> Receiver {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/webhooks/receiver.py");
        let mut child = Command::new(python())
            .arg(script)
            .env("WEBHOOK_SECRETS", secrets)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start tests/webhooks/receiver.py (python3)");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("receiver's port line");
        let port: u16 = line
            .trim()
            .strip_prefix("port ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("receiver said {line:?}"));
        let mut receiver = Receiver { child, addr: SocketAddr::from(([127, 0, 0, 1], port)), library: None };
        receiver.library = receiver.get("/_info")["library"].as_str().map(str::to_owned);
        if receiver.library.is_none() {
            let required = std::env::var("PAYONCE_REQUIRE_WEBHOOK_LIB").is_ok_and(|v| v == "1");
            assert!(!required, "PAYONCE_REQUIRE_WEBHOOK_LIB=1 but standardwebhooks is not importable by {}", python());
            eprintln!(
                "=== standardwebhooks is missing: webhook deliveries are NOT verified with the third-party library \
                 (run scripts/webhook-venv) ==="
            );
        }
        receiver
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn get(&self, path: &str) -> Value {
        let response = crate::util::request(self.addr, "GET", path, &[], b"");
        assert_eq!(response.status, 200, "receiver {path}");
        response.json()
    }

    fn post(&self, path: &str, body: &Value) {
        let body = body.to_string();
        let response =
            crate::util::request(self.addr, "POST", path, &[("Content-Type", "application/json")], body.as_bytes());
        assert_eq!(response.status, 200, "receiver {path}: {}", response.text());
    }

    /// How `path` answers from now on (see receiver.py: status, fail_first,
    /// fail_status, fail_orders, fail_ids, fail_body_hex, delay_ms, delay_orders, retry_after).
    pub fn behave(&self, path: &str, behaviour: Value) {
        let mut body = behaviour;
        body["path"] = json!(path);
        self.post("/_behave", &body);
    }

    /// The library's verification clock: real time plus `offset_s`.
    pub fn set_clock_offset(&self, offset_s: f64) {
        self.post("/_clock", &json!({"offset_s": offset_s}));
    }

    /// Every endpoint call so far, in arrival order.
    pub fn log(&self) -> Vec<Value> {
        self.get("/_log")["requests"].as_array().cloned().unwrap_or_default()
    }

    /// Polls the log until `done` holds (20 s at most, then fails with the log).
    pub fn wait_for(&self, what: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let log = self.log();
            if done(&log) {
                return log;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}; receiver log: {log:#?}");
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// Every call was verified by the library for every secret, and its
    /// tampered copies refused (when the library is there).
    pub fn assert_all_verified(&self, calls: &[Value]) {
        if self.library.is_none() {
            return;
        }
        for call in calls {
            assert_eq!(call["verified"], true, "standardwebhooks verifies {call:#}");
            assert_eq!(call["tampered_refused"], true, "standardwebhooks refuses a tampered copy of {call:#}");
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `webhook-id` of a call.
pub fn webhook_id(call: &Value) -> String {
    call["headers"]["webhook-id"].as_str().unwrap_or_default().to_owned()
}

/// The `webhook-timestamp` of a call.
pub fn webhook_timestamp(call: &Value) -> i64 {
    call["headers"]["webhook-timestamp"].as_str().and_then(|t| t.parse().ok()).unwrap_or_default()
}
