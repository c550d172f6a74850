//! Shared test helpers (the one test kit): start the real binary on port 0
//! with a fresh database (its stderr kept in a file and printed when the
//! test fails), talk HTTP to it with a tiny client that can also send
//! hostile bytes, sign generic-channel callbacks, build payments with named
//! fields ([`Pay`]), and read the database back ([`count`], [`footprint`]).

use payonce::{App, PaymentCallback, PaymentReply, PlatformStatus};
use payonce_testclient as client;
use rusqlite::{Connection, OpenFlags};
use serde_json::{json, Value};
use std::collections::BTreeMap;
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

/// A running `payonce serve`, killed on drop. Its stderr (the logs) goes
/// to a file beside the database, printed if the test is failing.
pub struct Server {
    pub addr: SocketAddr,
    pub child: Child,
    pub db: PathBuf,
    /// Where the server's stderr went, unless the caller took it.
    stderr_log: Option<PathBuf>,
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
        static N: AtomicU64 = AtomicU64::new(0);
        let mut name = db.file_name().unwrap_or_default().to_owned();
        name.push(format!(".stderr.{}.log", N.fetch_add(1, Ordering::SeqCst)));
        let log = db.with_file_name(name);
        let file = std::fs::File::create(&log).unwrap_or_else(|e| panic!("create {}: {e}", log.display()));
        let mut server = Server::start_logged(db, extra, Stdio::from(file));
        server.stderr_log = Some(log);
        server
    }

    /// [`Server::start_on`] with its stderr (the logs) sent to `stderr`.
    pub fn start_logged(db: &Path, extra: &[&str], stderr: Stdio) -> Server {
        Server::start_logged_env(db, extra, stderr, &[])
    }

    /// [`Server::start_logged`] with extra environment variables (test hooks).
    pub fn start_logged_env(db: &Path, extra: &[&str], stderr: Stdio, env: &[(&str, &str)]) -> Server {
        let mut args = vec!["--callback-secret", SECRET];
        args.extend(extra);
        Server::start_without_secret(db, &args, stderr, env)
    }

    /// `payonce serve --db DB --listen 127.0.0.1:0` and `extra` alone: the
    /// caller gives the callback secret (or its file).
    pub fn start_without_secret(db: &Path, extra: &[&str], stderr: Stdio, env: &[(&str, &str)]) -> Server {
        let mut args = vec![
            "serve".to_owned(),
            "--db".to_owned(),
            db.display().to_string(),
            "--listen".to_owned(),
            "127.0.0.1:0".to_owned(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut child = Command::new(env!("CARGO_BIN_EXE_payonce"))
            .args(&args)
            .env_remove("PAYONCE_CALLBACK_SECRET")
            .envs(env.iter().copied())
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
        Server { addr, child, db: db.to_path_buf(), stderr_log: None, _dir: None }
    }

    /// Names the file the caller sent this server's stderr to, printed if the test fails.
    pub fn set_stderr_log(&mut self, log: PathBuf) {
        self.stderr_log = Some(log);
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

    /// Waits up to `timeout` for the process to exit; `None` if it did not.
    pub fn wait_exit(&mut self, timeout: std::time::Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(20))
                }
                _ => return None,
            }
        }
    }

    /// Sends a signal by number (15 = SIGTERM, 2 = SIGINT) with `kill(1)`.
    pub fn signal(&self, signal: i32) {
        let _ = Command::new("kill").arg(format!("-{signal}")).arg(self.child.id().to_string()).status();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
        if let (true, Some(log)) = (std::thread::panicking(), &self.stderr_log) {
            let text = std::fs::read_to_string(log).unwrap_or_else(|e| format!("(unreadable: {e})"));
            eprintln!("---- payonce serve stderr ({}) ----\n{text}---- end of stderr ----", log.display());
        }
    }
}

/// A new PENDING order of 100 minor units for user `u1`, for the tests that
/// write through `Store` directly.
pub fn new_order(order_no: &str) -> payonce::domain::NewOrder {
    payonce::domain::NewOrder {
        order_no: order_no.into(),
        user_id: "u1".into(),
        amount: 100,
        currency: "CNY".into(),
        created_at: "2026-01-01T00:00:00.000Z".into(),
        expires_at: "2026-01-01T00:15:00.000Z".into(),
    }
}

/// A read-only connection to a database file.
pub fn read_only(db: &Path) -> Connection {
    Connection::open_with_flags(db, OpenFlags::SQLITE_OPEN_READ_ONLY).expect("open db read-only")
}

/// The one integer `sql` selects.
pub fn count(conn: &Connection, sql: &str, params: impl rusqlite::Params) -> i64 {
    conn.query_row(sql, params, |r| r.get(0)).unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// Row counts of a database's tables, by name.
pub type Footprint = BTreeMap<String, i64>;

/// The row count of every table `sqlite_master` lists (SQLite's own
/// `sqlite_*` tables aside), so a new table is counted without editing this.
pub fn footprint(conn: &Connection) -> Footprint {
    let mut stmt = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY name")
        .expect("list tables");
    let tables: Vec<String> =
        stmt.query_map([], |r| r.get(0)).expect("list tables").collect::<Result<_, _>>().expect("table names");
    assert!(tables.iter().any(|t| t == "orders"), "no payonce schema: {tables:?}");
    tables.into_iter().map(|t| (t.clone(), count(conn, &format!("SELECT count(*) FROM \"{t}\""), []))).collect()
}

/// `order_no:STATUS` of every order, by order_no.
pub fn order_states(conn: &Connection) -> Vec<String> {
    let mut stmt = conn.prepare("SELECT order_no || ':' || status FROM orders ORDER BY order_no").expect("prepare");
    let states = stmt.query_map([], |r| r.get::<_, String>(0)).expect("query");
    states.collect::<Result<_, _>>().expect("rows")
}

/// A generic-channel payment, with named fields: `status` is the
/// platform's `SUCCESS` or `FAILED`.
#[derive(Clone, Copy, Debug)]
pub struct Pay<'a> {
    pub pay_no: &'a str,
    pub order_no: &'a str,
    pub amount: i64,
    pub status: &'a str,
}

impl Pay<'_> {
    /// The generic channel's notification body.
    pub fn body(&self) -> Value {
        json!({"pay_no": self.pay_no, "order_no": self.order_no, "amount": self.amount, "status": self.status})
    }

    /// As the generic channel maps it, with the body as the raw bytes.
    pub fn callback(&self) -> PaymentCallback {
        PaymentCallback {
            channel: "generic".into(),
            pay_no: self.pay_no.into(),
            order_no: self.order_no.into(),
            amount: self.amount,
            currency: None,
            status: PlatformStatus::parse(self.status).unwrap_or_else(|| panic!("status {:?}", self.status)),
            paid_at: None,
            raw_body: self.body().to_string().into_bytes(),
        }
    }

    /// Signed with the test secret and sent to `server` over HTTP.
    pub fn send(&self, server: &Server) -> HttpResponse {
        server.callback("/v1/callbacks/generic", &self.body())
    }

    /// Delivered in process.
    pub fn deliver(&self, app: &App) -> PaymentReply {
        app.payments().deliver_payment(&self.callback()).unwrap_or_else(|e| panic!("deliver {}: {e}", self.pay_no))
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

/// The value of `series` (its name and labels as payonce writes them) in a
/// Prometheus text.
pub fn metric_in(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// `series` as `server`'s /metrics reads now (a server without API tokens).
pub fn metric(server: &Server, series: &str) -> Option<f64> {
    metric_in(&server.get("/metrics").text(), series)
}

/// Waits until `series` on `server`'s /metrics reads `value` (a SIGHUP
/// reload, say, which runs on the signal thread).
pub fn wait_for_metric(server: &Server, series: &str, value: f64) {
    eventually(std::time::Duration::from_secs(30), &format!("{series} reads {value}"), || {
        metric(server, series) == Some(value)
    });
}

/// How long a test waits, by default, for what must happen soon.
pub const EVENTUALLY: std::time::Duration = std::time::Duration::from_secs(20);

/// Polls `check` until it holds, or fails with `what` after `within`.
pub fn eventually(within: std::time::Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + within;
    while !check() {
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        std::thread::sleep(std::time::Duration::from_millis(20));
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

/// `text` as a form value the way Alipay's SDKs encode it
/// (application/x-www-form-urlencoded, UTF-8, a space as `+`).
pub fn form_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'*' => (b as char).to_string(),
            b' ' => "+".to_owned(),
            _ => format!("%{b:02X}"),
        })
        .collect()
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

/// Runs a `payonce` command to its end (offline commands: inspect,
/// reconcile, backup ...): exit code, stdout, stderr.
pub fn payonce_cli(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_payonce"))
        .args(args)
        .env_remove("PAYONCE_CALLBACK_SECRET")
        .stdin(Stdio::null())
        .output()
        .expect("run payonce");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The body of a WeChat Pay `TRANSACTION.SUCCESS` notification of
/// `order_no` (9900 fen, merchant 1900000100) as WeChat Pay sends it: its
/// resource encrypted with `apiv3_key` (AEAD_AES_256_GCM), each call with
/// its own transaction id, nonce and event id. Signing is the caller's.
pub fn wechatpay_payment_body(apiv3_key: &str, order_no: &str) -> Vec<u8> {
    use aes_gcm::aead::{Aead, Payload};
    use aes_gcm::{Aes256Gcm, KeyInit, Nonce};
    use base64::Engine;
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::SeqCst);
    let plain = json!({
        "mchid": "1900000100", "appid": "wxd678efh567hg6787",
        "out_trade_no": order_no, "transaction_id": format!("4200000001202612040{n:09}"),
        "trade_type": "JSAPI", "trade_state": "SUCCESS", "trade_state_desc": "支付成功",
        "success_time": utc8_rfc3339(now_ms() - 1_000),
        "payer": {"openid": "oUpF8uMuAJO_M2pxb1Q9zNjWeS6o"},
        "amount": {"total": 9900, "payer_total": 9900, "currency": "CNY", "payer_currency": "CNY"}
    });
    let nonce = format!("wx{n:010}");
    let cipher = Aes256Gcm::new_from_slice(apiv3_key.as_bytes()).expect("a 32-byte APIv3 key");
    let ciphertext = cipher
        .encrypt(
            Nonce::from_slice(nonce.as_bytes()),
            Payload { msg: plain.to_string().as_bytes(), aad: b"transaction" },
        )
        .expect("encrypt");
    json!({
        "id": format!("EV-WX-{n}"), "create_time": utc8_rfc3339(now_ms()),
        "resource_type": "encrypt-resource", "event_type": "TRANSACTION.SUCCESS", "summary": "支付成功",
        "resource": {
            "original_type": "transaction", "algorithm": "AEAD_AES_256_GCM",
            "ciphertext": base64::engine::general_purpose::STANDARD.encode(ciphertext),
            "associated_data": "transaction", "nonce": nonce
        }
    })
    .to_string()
    .into_bytes()
}
