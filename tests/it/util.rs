//! Shared test helpers: start the real binary on port 0 with a fresh
//! database, talk HTTP to it with a tiny client that can also send hostile
//! bytes, and sign generic-channel callbacks.

#![allow(dead_code)]

use payonce_testclient as client;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub const SECRET: &str = "test-secret";
const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// A scratch directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let dir = std::env::temp_dir().join(format!(
            "payonce-test-{tag}-{}-{}-{nanos}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running `payonce serve`, killed on drop.
pub struct Server {
    pub addr: SocketAddr,
    pub child: Child,
    pub db: PathBuf,
    /// Owns the database's directory when the server created it.
    _dir: Option<TempDir>,
}

impl Server {
    /// A server on a fresh file database with the test secret and `extra` flags.
    pub fn start(extra: &[&str]) -> Server {
        let dir = TempDir::new("srv");
        let db = dir.path("payonce.db");
        let mut server = Server::start_on(&db, extra);
        server._dir = Some(dir);
        server
    }

    /// A server on `db` (which the caller owns), e.g. a second process on one file.
    pub fn start_on(db: &Path, extra: &[&str]) -> Server {
        Server::start_logged(db, extra, Stdio::null())
    }

    /// [`Server::start_on`] with its stderr (the logs) sent to `stderr`.
    pub fn start_logged(db: &Path, extra: &[&str], stderr: Stdio) -> Server {
        let mut args = vec![
            "serve".to_owned(),
            "--db".to_owned(),
            db.display().to_string(),
            "--listen".to_owned(),
            "127.0.0.1:0".to_owned(),
            "--callback-secret".to_owned(),
            SECRET.to_owned(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut child = Command::new(env!("CARGO_BIN_EXE_payonce"))
            .args(&args)
            .env_remove("PAYONCE_CALLBACK_SECRET")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("spawn payonce serve");
        let stdout = child.stdout.take().expect("stdout piped");
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).expect("read first line");
        let addr = line
            .trim()
            .strip_prefix("listening on http://")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .parse()
            .expect("socket address");
        Server { addr, child, db: db.to_path_buf(), _dir: None }
    }

    pub fn get(&self, path: &str) -> HttpResponse {
        request(self.addr, "GET", path, &[], b"")
    }

    pub fn post_json(&self, path: &str, body: &Value) -> HttpResponse {
        let body = body.to_string();
        request(self.addr, "POST", path, &[("Content-Type", "application/json")], body.as_bytes())
    }

    /// A generic-channel callback signed with the test secret now.
    pub fn callback(&self, path: &str, body: &Value) -> HttpResponse {
        let body = body.to_string();
        let signature = sign_now(SECRET, body.as_bytes());
        request(
            self.addr,
            "POST",
            path,
            &[("Content-Type", "application/json"), ("Payonce-Signature", &signature)],
            body.as_bytes(),
        )
    }

    /// Sends SIGKILL and waits.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends a signal by number (15 = SIGTERM, 2 = SIGINT) with `kill(1)`.
    pub fn signal(&self, signal: i32) {
        let _ = Command::new("kill").arg(format!("-{signal}")).arg(self.child.id().to_string()).status();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl From<client::Response> for HttpResponse {
    fn from(r: client::Response) -> HttpResponse {
        HttpResponse { status: r.status, headers: r.headers, body: r.body }
    }
}

impl HttpResponse {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// The contract's error code, `{"error":{"code":..}}`.
    pub fn error_code(&self) -> String {
        self.json()["error"]["code"].as_str().unwrap_or_default().to_owned()
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Now, in Unix milliseconds, from the system clock `payonce serve` uses.
pub fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// `unix_ms` as RFC 3339 in UTC+8 (`2024-01-02T14:00:00.000+08:00`), the way
/// WeChat Pay writes its times.
pub fn utc8_rfc3339(unix_ms: i64) -> String {
    let text = payonce::clock::format_ms(unix_ms + 8 * 3_600_000);
    format!("{}+08:00", text.trim_end_matches('Z'))
}

/// `unix_ms` as Alipay's `YYYY-MM-DD HH:MM:SS` in UTC+8.
pub fn alipay_time(unix_ms: i64) -> String {
    let text = payonce::clock::format_ms(unix_ms + 8 * 3_600_000);
    format!("{} {}", &text[..10], &text[11..19])
}

pub fn sign_now(secret: &str, body: &[u8]) -> String {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    payonce::signature::sign(secret.as_bytes(), now as i64, body)
}

/// One HTTP/1.1 request on its own connection (`Connection: close`).
pub fn request(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> HttpResponse {
    client::request(addr, method, path, headers, body, IO_TIMEOUT)
        .map(HttpResponse::from)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Sends raw bytes, half-closes, and returns everything the server answered.
pub fn raw(addr: SocketAddr, bytes: &[u8]) -> Vec<u8> {
    client::raw(addr, bytes, IO_TIMEOUT).expect("connect")
}

/// Parses one HTTP/1.1 response (Content-Length, chunked or read-to-close bodies).
pub fn parse_response(bytes: &[u8]) -> Option<HttpResponse> {
    client::parse_response(bytes).map(HttpResponse::from)
}

/// A small seeded PRNG (xorshift64*), so a failing interleaving replays.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}
