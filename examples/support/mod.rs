//! What `bench`, `bench_group_commit`, `bench_processes` and `bench_webhooks` share
//! (included with `#[path]`; a directory without `main.rs` is not an example
//! of its own). Each uses only part of it.
#![allow(dead_code)]

/// The tables, columns and unique keys the apply SQL of L_min, L_batch,
/// (a) and A_batch touches; nothing else (no CHECK, trigger or other index).
pub const MINIMAL_SCHEMA: &str = "
CREATE TABLE orders (id INTEGER PRIMARY KEY, order_no TEXT NOT NULL, user_id TEXT NOT NULL, amount INTEGER NOT NULL,
    currency TEXT NOT NULL, status TEXT NOT NULL, pay_no TEXT, created_at TEXT NOT NULL, expires_at TEXT NOT NULL,
    paid_at TEXT);
CREATE UNIQUE INDEX uk_order_no ON orders (order_no);
CREATE TABLE pay_callback_log (id INTEGER PRIMARY KEY, pay_no TEXT NOT NULL, channel TEXT NOT NULL,
    order_id INTEGER NOT NULL, amount INTEGER NOT NULL, status TEXT NOT NULL, outcome TEXT NOT NULL,
    state TEXT NOT NULL, source TEXT NOT NULL, raw_body BLOB NOT NULL, paid_at TEXT, received_at TEXT NOT NULL,
    decided_at TEXT, applied_at TEXT, rewards_due TEXT);
CREATE UNIQUE INDEX uk_pay_no ON pay_callback_log (pay_no);
CREATE TABLE user_coupon (id INTEGER PRIMARY KEY, user_id TEXT NOT NULL, order_id INTEGER NOT NULL,
    coupon_template_id TEXT NOT NULL, status TEXT NOT NULL, created_at TEXT NOT NULL);
CREATE UNIQUE INDEX uk_order_tpl ON user_coupon (order_id, coupon_template_id);
CREATE TABLE point_log (id INTEGER PRIMARY KEY, user_id TEXT NOT NULL, order_id INTEGER NOT NULL,
    point_type TEXT NOT NULL, points INTEGER NOT NULL, created_at TEXT NOT NULL, refund_no TEXT);
CREATE UNIQUE INDEX uk_order_type ON point_log (order_id, point_type, coalesce(refund_no, ''));
CREATE TABLE outbox_event (seq INTEGER PRIMARY KEY AUTOINCREMENT, event_id TEXT NOT NULL, type TEXT NOT NULL,
    order_no TEXT NOT NULL, data TEXT NOT NULL, created_at TEXT NOT NULL);
CREATE UNIQUE INDEX uk_event_id ON outbox_event (event_id);
";

/// Latencies and a wall time: throughput and percentiles.
#[derive(Default)]
pub struct Measured {
    pub count: usize,
    pub seconds: f64,
    pub latencies_us: Vec<u64>,
    pub errors: usize,
    /// CPU time of this whole process (server and clients) during the phase.
    pub cpu_seconds: f64,
}

impl Measured {
    pub fn merge(&mut self, other: Measured) {
        self.count += other.count;
        self.seconds += other.seconds;
        self.cpu_seconds += other.cpu_seconds;
        self.latencies_us.extend(other.latencies_us);
        self.errors += other.errors;
    }

    pub fn rate(&self) -> f64 {
        self.count as f64 / self.seconds.max(1e-9)
    }

    /// The latency below which `p` of the requests finished, in ms.
    pub fn percentile_ms(&self, p: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return f64::NAN;
        }
        let mut sorted = self.latencies_us.clone();
        sorted.sort_unstable();
        let at = ((sorted.len() as f64 * p) as usize).min(sorted.len() - 1);
        sorted[at] as f64 / 1000.0
    }
}

/// utime + stime of this process, from /proc/self/stat (clock ticks of 10 ms).
pub fn process_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit_once(')').map_or(vec![], |(_, rest)| rest.split_whitespace().collect());
    let ticks: u64 = [11, 12].iter().filter_map(|&i| fields.get(i).and_then(|f| f.parse::<u64>().ok())).sum();
    ticks as f64 / 100.0
}

/// Creates the empty database `name` on the PostgreSQL server `server` (a
/// URL, as `PAYONCE_BENCH_PG`) and returns its URL: `server`'s with the
/// database path replaced, its query kept.
pub fn fresh_postgres_database(server: &str, name: &str) -> Result<String, Box<dyn std::error::Error + Send + Sync>> {
    let mut admin = postgres::Client::connect(server, postgres::NoTls)?;
    // One statement per call: CREATE DATABASE cannot run in the implicit
    // transaction of a multi-statement query.
    admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name}"))?;
    admin.batch_execute(&format!("CREATE DATABASE {name}"))?;
    let (base, query) = match server.split_once('?') {
        Some((base, query)) => (base, format!("?{query}")),
        None => (server, String::new()),
    };
    let base = match base.rfind('/') {
        Some(slash) if slash > base.find("://").map_or(0, |i| i + 2) => &base[..slash],
        _ => base,
    };
    Ok(format!("{base}/{name}{query}"))
}

/// The `payonce` binary beside this example's directory (target/release/).
pub fn payonce_binary() -> Result<std::path::PathBuf, Box<dyn std::error::Error + Send + Sync>> {
    let exe = std::env::current_exe()?;
    let release = exe.parent().and_then(|examples| examples.parent()).ok_or("no target directory")?;
    let binary = release.join("payonce");
    if !binary.exists() {
        return Err(format!("{} not found: run `cargo build --release` first", binary.display()).into());
    }
    Ok(binary)
}

/// A `payonce serve` child listening on `addr`; killed on drop.
pub struct Served {
    child: std::process::Child,
    pub addr: std::net::SocketAddr,
}

impl Served {
    /// The child's process id, for reading its /proc/PID/status.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `binary serve --db db --listen 127.0.0.1:0 --callback-secret
/// secret` with `args` and `env` added and `PAYONCE_LOG=warn`, and reads the
/// address it prints.
pub fn serve(
    binary: &std::path::Path,
    db: &str,
    secret: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> Result<Served, Box<dyn std::error::Error + Send + Sync>> {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let mut child = Command::new(binary)
        .args(["serve", "--db", db, "--listen", "127.0.0.1:0", "--callback-secret", secret])
        .args(args)
        .env("PAYONCE_LOG", "warn")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let stdout = child.stdout.take();
    // Killed on drop from here, should the address not come.
    let mut served = Served { child, addr: ([0, 0, 0, 0], 0).into() };
    let mut line = String::new();
    std::io::BufReader::new(stdout.ok_or("no stdout")?).read_line(&mut line)?;
    let addr = line.trim().strip_prefix("listening on http://").ok_or_else(|| format!("unexpected {line:?}"))?;
    served.addr = addr.parse()?;
    Ok(served)
}
