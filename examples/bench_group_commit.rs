//! `make bench`, group commit (docs/performance.md): applied callbacks over
//! HTTP with batching on and off, at 16 and 64 clients, against the physical
//! limit of the same apply SQL, all in one run on one disk.
//!
//! - **L_min**: the apply SQL (find the order, look the pay_no up, CAS the
//!   order, coupon, points, the payment recorded decided, outbox event), as
//!   payonce runs it, on a *minimal* schema (only
//!   the tables, columns and unique keys it needs), one connection, one
//!   `BEGIN IMMEDIATE ... COMMIT` per payment, payonce's PRAGMAs,
//!   synchronous=FULL: one fsync per payment, native code, no HTTP.
//! - **(a)**: the same on payonce's own schema (its CHECKs, triggers and
//!   extra indexes), printed beside it with the WAL bytes and pages each
//!   payment writes on either schema.
//! - **payonce**: the service in process on loopback HTTP, keep-alive
//!   clients sending pre-signed callbacks (the client is not the
//!   bottleneck), `--group-commit-max` 64 (on) and 1 (off); throughput, p50,
//!   p99 and the mean batch size from the committer's counters.
//! - **pgbench**: when `PAYONCE_BENCH_PG` names a PostgreSQL server (`make
//!   bench` starts a durable one), `pgbench -M prepared`, 16 clients, on
//!   `schema.postgres.sql`, running the same apply SQL
//!   (`examples/bench_apply.pgbench`).
//!
//! Run: `cargo run --release --example bench_group_commit -- [--quick]`.

#[path = "support/mod.rs"]
mod support;

use payonce::http::Server;
use payonce::store::StoreOptions;
use payonce::{App, Clock, Config, Rewards};
use payonce_testclient as client;
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};
use support::{fresh_postgres_database, process_cpu_seconds, Measured, MINIMAL_SCHEMA};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const SECRET: &[u8] = b"bench-group-commit-secret-0123456";
const AMOUNT: i64 = 9900;
const COUPON: &str = "NEW10";
const IO_TIMEOUT: Duration = Duration::from_secs(30);
const WORKERS: usize = 64;

struct Options {
    payments: usize,
    bare: usize,
    rounds: usize,
}

fn parse_options() -> Result<Options, String> {
    let mut options = Options { payments: 6_000, bare: 4_000, rounds: 2 };
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--quick" => options = Options { payments: 1_000, bare: 1_000, rounds: 1 },
            other => return Err(format!("unknown argument {other:?} (only --quick)")),
        }
    }
    Ok(options)
}

fn order_no(i: usize) -> String {
    format!("GO{i:08}")
}

fn pay_no(i: usize) -> String {
    format!("GP{i:08}")
}

fn user_id(i: usize) -> String {
    format!("u{}", i % 97)
}

fn callback_body(i: usize) -> String {
    format!(r#"{{"pay_no":"{}","order_no":"{}","amount":{AMOUNT},"status":"SUCCESS"}}"#, pay_no(i), order_no(i))
}

// ---- the bare limits ----

struct Bare {
    conn: Connection,
    path: PathBuf,
    rewards_due: String,
}

impl Bare {
    fn open(path: &Path, schema: &str, orders: usize) -> Result<Bare, BoxError> {
        let _ = std::fs::remove_file(path);
        let mut conn = Connection::open(path)?;
        let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
        assert!(mode.eq_ignore_ascii_case("wal"), "journal_mode {mode}");
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.execute_batch(schema)?;
        let now = Clock::System.now_text();
        {
            let mut insert = tx.prepare(
                "INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at)
                 VALUES (?1, ?2, ?3, 'CNY', 'PENDING', ?4, ?4)",
            )?;
            for i in 0..orders {
                insert.execute(params![order_no(i), user_id(i), AMOUNT, now])?;
            }
        }
        tx.commit()?;
        // Empty the WAL, then keep every frame of the run in it to count them.
        conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
        conn.pragma_update(None, "wal_autocheckpoint", 0)?;
        let rewards_due = format!(r#"{{"coupons":["{COUPON}"],"points":{}}}"#, AMOUNT / 100);
        Ok(Bare { conn, path: path.to_owned(), rewards_due })
    }

    /// One transaction per payment, sequential; plus (WAL bytes, WAL frames) per payment.
    fn apply(&mut self, range: std::ops::Range<usize>) -> Result<(Measured, f64, f64), BoxError> {
        let wal = PathBuf::from(format!("{}-wal", self.path.display()));
        let wal_before = std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0);
        let page_size: i64 = self.conn.query_row("PRAGMA page_size", [], |r| r.get(0))?;
        let n = range.len();
        let mut measured = Measured::default();
        let started = Instant::now();
        let cpu = process_cpu_seconds();
        for i in range {
            let t = Instant::now();
            match self.apply_one(i) {
                Ok(()) => measured.latencies_us.push(t.elapsed().as_micros() as u64),
                Err(_) => measured.errors += 1,
            }
            measured.count += 1;
        }
        measured.seconds = started.elapsed().as_secs_f64();
        measured.cpu_seconds = process_cpu_seconds() - cpu;
        let wal_after = std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0);
        let bytes = wal_after.saturating_sub(wal_before) as f64 / n.max(1) as f64;
        let frames = bytes / (page_size as f64 + 24.0);
        self.conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
        Ok((measured, bytes, frames))
    }

    fn apply_one(&mut self, i: usize) -> Result<(), BoxError> {
        let now = Clock::System.now_text();
        let (order_no, pay_no) = (order_no(i), pay_no(i));
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let (order_id, user_id): (i64, String) = tx
            .prepare_cached("SELECT id, user_id FROM orders WHERE order_no = ?1")?
            .query_row([&order_no], |r| Ok((r.get(0)?, r.get(1)?)))?;
        // payonce reads the pay_no's record inside the transaction; a new
        // one is inserted below, already decided.
        let known: Option<i64> = tx
            .prepare_cached("SELECT id FROM pay_callback_log WHERE pay_no = ?1")?
            .query_row([&pay_no], |r| r.get(0))
            .optional()?;
        if known.is_some() {
            return Err("the pay_no was recorded before".into());
        }
        let paid = tx
            .prepare_cached(
                "UPDATE orders SET status = 'PAID', pay_no = ?3, paid_at = ?4
                 WHERE id = ?1 AND status = 'PENDING' AND amount = ?2",
            )?
            .execute(params![order_id, AMOUNT, pay_no, now])?;
        if paid != 1 {
            return Err("the order was not PENDING".into());
        }
        tx.prepare_cached(
            "INSERT INTO user_coupon (user_id, order_id, coupon_template_id, status, created_at)
             VALUES (?1, ?2, ?3, 'ACTIVE', ?4) ON CONFLICT (order_id, coupon_template_id) DO NOTHING",
        )?
        .execute(params![user_id, order_id, COUPON, now])?;
        tx.prepare_cached(
            "INSERT INTO point_log (user_id, order_id, point_type, points, created_at)
             VALUES (?1, ?2, 'ORDER_PAID', ?3, ?4) ON CONFLICT (order_id, point_type, coalesce(refund_no, '')) DO NOTHING",
        )?
        .execute(params![user_id, order_id, AMOUNT / 100, now])?;
        tx.prepare_cached(
            "INSERT INTO pay_callback_log
                 (pay_no, channel, order_id, amount, status, outcome, state, source, raw_body, paid_at, received_at,
                  decided_at, applied_at, rewards_due)
             VALUES (?1, 'generic', ?2, ?3, 'SUCCESS', 'applied', 'decided', 'callback', ?4, NULL, ?5, ?5, ?5, ?6)
             ON CONFLICT (pay_no) DO NOTHING",
        )?
        .execute(params![pay_no, order_id, AMOUNT, callback_body(i).as_bytes(), now, self.rewards_due])?;
        let data = format!(
            r#"{{"order":{{"order_no":"{order_no}","user_id":"{user_id}","amount":{AMOUNT},"currency":"CNY","status":"PAID","pay_no":"{pay_no}","created_at":"{now}","expires_at":"{now}","paid_at":"{now}","closed_at":null,"refund_no":null,"refunded_at":null}},"payment":{{"pay_no":"{pay_no}","channel":"generic","amount":{AMOUNT},"outcome":"applied"}}}}"#
        );
        tx.prepare_cached(
            "INSERT INTO outbox_event (event_id, type, order_no, data, created_at)
             VALUES (?1, 'order.paid', ?2, ?3, ?4) ON CONFLICT (event_id) DO NOTHING",
        )?
        .execute(params![format!("order.paid:{order_no}"), order_no, data, now])?;
        tx.commit()?;
        Ok(())
    }
}

// ---- payonce over HTTP ----

struct Service {
    app: Arc<App>,
    addr: SocketAddr,
    shutdown: Arc<AtomicBool>,
    serving: Option<thread::JoinHandle<bool>>,
}

impl Service {
    fn start(dir: &Path, name: &str, group_commit_max: usize) -> Result<Service, BoxError> {
        let db = dir.join(name).display().to_string();
        let config = Config {
            platforms: payonce::platforms::Platforms::with([payonce::platforms::Platform::notices(
                payonce::platforms::generic::Generic::new(vec![SECRET.to_vec()]),
            )]),
            rewards: Rewards { coupon_templates: vec![COUPON.into()], points_per_yuan: 1 },
            ..Default::default()
        };
        let options = StoreOptions { group_commit_max, ..StoreOptions::default() };
        let app = Arc::new(App::open_with(&db, Clock::System, config, &options)?);
        let server = Server::bind("127.0.0.1:0")?;
        let addr = server.local_addr();
        let shutdown = Arc::new(AtomicBool::new(false));
        let serving = {
            let (app, shutdown) = (Arc::clone(&app), Arc::clone(&shutdown));
            thread::spawn(move || server.serve(app, shutdown, WORKERS))
        };
        Ok(Service { app, addr, shutdown, serving: Some(serving) })
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.shutdown.store(true, Ordering::SeqCst);
        if let Some(serving) = self.serving.take() {
            let _ = serving.join();
        }
    }
}

/// `clients` keep-alive connections send `requests` (already encoded), one at a time each.
fn http_round(
    addr: SocketAddr,
    clients: usize,
    requests: Vec<Vec<u8>>,
    expect: &'static [u8],
) -> Result<Measured, BoxError> {
    let requests = Arc::new(requests);
    let next = Arc::new(AtomicUsize::new(0));
    let mut connections = Vec::new();
    for _ in 0..clients {
        connections.push(client::Connection::connect(addr, IO_TIMEOUT, IO_TIMEOUT)?);
    }
    let started = Instant::now();
    let cpu = process_cpu_seconds();
    let handles: Vec<_> = connections
        .into_iter()
        .map(|mut connection| {
            let (requests, next) = (Arc::clone(&requests), Arc::clone(&next));
            thread::spawn(move || {
                let mut measured = Measured::default();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(request) = requests.get(i) else { break };
                    let t = Instant::now();
                    match connection.exchange(request) {
                        Ok(r) if r.body.windows(expect.len()).any(|w| w == expect) => {
                            measured.latencies_us.push(t.elapsed().as_micros() as u64)
                        }
                        _ => measured.errors += 1,
                    }
                    measured.count += 1;
                }
                measured
            })
        })
        .collect();
    let mut all = Measured::default();
    for handle in handles {
        all.merge(handle.join().map_err(|_| "client panicked")?);
    }
    all.seconds = started.elapsed().as_secs_f64();
    all.cpu_seconds = process_cpu_seconds() - cpu;
    Ok(all)
}

fn encode(path: &str, headers: &[(&str, &str)], body: &str) -> Vec<u8> {
    let mut all = vec![("Content-Type", "application/json")];
    all.extend_from_slice(headers);
    client::encode_request("POST", "bench", path, &all, body.as_bytes())
}

/// Creates `range`'s orders, then sends their callbacks, pre-signed just before.
fn applied_round(
    service: &Service,
    clients: usize,
    range: std::ops::Range<usize>,
) -> Result<(Measured, f64), BoxError> {
    let creations = range
        .clone()
        .map(|i| {
            encode(
                "/v1/orders",
                &[],
                &format!(r#"{{"order_no":"{}","user_id":"{}","amount":{AMOUNT}}}"#, order_no(i), user_id(i)),
            )
        })
        .collect();
    let created = http_round(service.addr, clients, creations, br#""status":"PENDING""#)?;
    if created.errors > 0 {
        return Err(format!("{} order creations failed", created.errors).into());
    }
    let now_s = Clock::System.now_ms().div_euclid(1000);
    let callbacks = range
        .map(|i| {
            let body = callback_body(i);
            let signature = payonce::signature::sign(SECRET, now_s, body.as_bytes());
            encode("/v1/callbacks/generic", &[("Payonce-Signature", &signature)], &body)
        })
        .collect();
    let (b0, o0) = service.app.store().group_commit_totals().unwrap_or((0, 0));
    let applied = http_round(service.addr, clients, callbacks, br#""outcome":"applied""#)?;
    let (b1, o1) = service.app.store().group_commit_totals().unwrap_or((0, 0));
    let mean_batch = (o1 - o0) as f64 / (b1 - b0).max(1) as f64;
    Ok((applied, mean_batch))
}

// ---- pgbench ----

/// `pgbench -M prepared -c 16` on a fresh database with schema.postgres.sql
/// and `orders` PENDING orders; (tps, mean latency ms) from its report.
fn pgbench(server: &str, orders: usize, seconds: u64) -> Result<(f64, String), BoxError> {
    let bindir = std::process::Command::new("scripts/pg-cluster").arg("bindir").output()?;
    let bindir = String::from_utf8(bindir.stdout)?.trim().to_owned();
    let pgbench = if bindir.is_empty() { PathBuf::from("pgbench") } else { Path::new(&bindir).join("pgbench") };
    let name = format!("bench_gc_{}", std::process::id());
    let url = fresh_postgres_database(server, &name)?;
    let mut db = postgres::Client::connect(&url, postgres::NoTls)?;
    db.batch_execute(include_str!("../schema.postgres.sql"))?;
    db.batch_execute(&format!(
        "CREATE SEQUENCE bench_payment;
         INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at)
         SELECT 'GO' || lpad(i::text, 8, '0'), 'u' || (i % 97), {AMOUNT}, 'CNY', 'PENDING',
                '2026-01-01T00:00:00.000Z', '2026-01-01T00:15:00.000Z'
         FROM generate_series(1, {orders}) AS i;"
    ))?;
    db.batch_execute("VACUUM ANALYZE")?;
    let output = std::process::Command::new(pgbench)
        .args(["-n", "-M", "prepared", "-c", "16", "-j", "2", "-T", &seconds.to_string()])
        .arg("-f")
        .arg("examples/bench_apply.pgbench")
        .arg(&url)
        .output()?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        return Err(format!("pgbench failed: {}{}", text, String::from_utf8_lossy(&output.stderr)).into());
    }
    let tps = text
        .lines()
        .find_map(|l| l.strip_prefix("tps = "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("no tps in pgbench's report: {text}"))?;
    let latency = text.lines().find(|l| l.starts_with("latency average")).unwrap_or("").to_owned();
    drop(db);
    postgres::Client::connect(server, postgres::NoTls)?.batch_execute(&format!("DROP DATABASE IF EXISTS {name}"))?;
    Ok((tps, latency))
}

fn main() {
    std::env::set_var("PAYONCE_LOG", std::env::var("PAYONCE_LOG").unwrap_or_else(|_| "warn".into()));
    let options = match parse_options() {
        Ok(options) => options,
        Err(e) => {
            eprintln!("bench_group_commit: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&options) {
        eprintln!("bench_group_commit: {e}");
        std::process::exit(1);
    }
}

fn run(options: &Options) -> Result<(), BoxError> {
    let dir = std::env::temp_dir().join(format!("payonce-bench-gc-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    println!("payonce group-commit bench · {} · {} rounds", Clock::System.now_text(), options.rounds);

    let mut minimal = Bare::open(&dir.join("minimal.db"), MINIMAL_SCHEMA, options.bare * options.rounds)?;
    let mut full = Bare::open(&dir.join("full.db"), payonce::store::SCHEMA_SQL, options.bare * options.rounds)?;
    let (mut l_min, mut a_full) = (Measured::default(), Measured::default());
    let (mut min_wal, mut full_wal) = ((0.0, 0.0), (0.0, 0.0));
    let mut rows: Vec<(String, Measured, Option<f64>)> = Vec::new();
    let mut services: Vec<(String, usize, Service, Measured, f64)> = Vec::new();
    for (label, max, clients) in
        [("on (max 64)", 64, 16), ("off (max 1)", 1, 16), ("on (max 64)", 64, 64), ("off (max 1)", 1, 64)]
    {
        let service = Service::start(&dir, &format!("payonce-{max}-{clients}.db"), max)?;
        services.push((label.to_owned(), clients, service, Measured::default(), 0.0));
    }
    // Interleaved rounds: the disk's mood changes; each figure sums its rounds.
    for round in 0..options.rounds {
        eprintln!("bench_group_commit: round {}/{}", round + 1, options.rounds);
        let bare = (round * options.bare)..((round + 1) * options.bare);
        let (m, bytes, frames) = minimal.apply(bare.clone())?;
        l_min.merge(m);
        min_wal = (min_wal.0 + bytes / options.rounds as f64, min_wal.1 + frames / options.rounds as f64);
        let (m, bytes, frames) = full.apply(bare)?;
        a_full.merge(m);
        full_wal = (full_wal.0 + bytes / options.rounds as f64, full_wal.1 + frames / options.rounds as f64);
        for (_, clients, service, measured, batch) in &mut services {
            let range = (round * options.payments)..((round + 1) * options.payments);
            let (m, mean_batch) = applied_round(service, *clients, range)?;
            measured.merge(m);
            *batch += mean_batch / options.rounds as f64;
        }
    }
    drop(minimal);
    drop(full);
    rows.push(("L_min: apply SQL, minimal schema, 1 connection".into(), l_min, Some(1.0)));
    rows.push(("(a): apply SQL, payonce's schema, 1 connection".into(), a_full, Some(1.0)));
    let mut applied_16 = (0.0, 0.0, 0.0);
    let mut p99 = std::collections::HashMap::new();
    for (label, clients, service, measured, batch) in services {
        drop(service);
        if label.starts_with("on") && clients == 16 {
            applied_16.0 = measured.rate();
        }
        p99.insert((label.starts_with("on"), clients), measured.percentile_ms(0.99));
        rows.push((format!("payonce HTTP, group commit {label}, {clients} clients"), measured, Some(batch)));
    }
    let pg = std::env::var("PAYONCE_BENCH_PG").ok().filter(|s| !s.is_empty());
    let pg_result = pg.as_ref().map(|server| pgbench(server, 100_000, if options.rounds > 1 { 15 } else { 5 }));
    let _ = std::fs::remove_dir_all(&dir);

    println!();
    println!(
        "{:<58} {:>8} {:>10} {:>9} {:>9} {:>11} {:>10}",
        "what", "count", "per s", "p50 ms", "p99 ms", "mean batch", "CPU cores"
    );
    let mut errors = 0;
    for (what, m, batch) in &rows {
        println!(
            "{what:<58} {:>8} {:>10.0} {:>9.2} {:>9.2} {:>11} {:>10.2}",
            m.count,
            m.rate(),
            m.percentile_ms(0.5),
            m.percentile_ms(0.99),
            batch.map_or("-".into(), |b| format!("{b:.1}")),
            m.cpu_seconds / m.seconds.max(1e-9)
        );
        errors += m.errors;
    }
    println!("(CPU cores: this process's CPU time / wall time during the phase; the machine has {} cores)", cores());
    let l_min_rate = rows[0].1.rate();
    applied_16.1 = l_min_rate;
    println!();
    println!(
        "WAL per payment: minimal schema {:.0} bytes ({:.1} pages), payonce's schema {:.0} bytes ({:.1} pages)",
        min_wal.0, min_wal.1, full_wal.0, full_wal.1
    );
    let pg_tps = match pg_result {
        Some(Ok((tps, latency))) => {
            println!(
                "pgbench -M prepared, 16 clients, the same apply SQL on schema.postgres.sql: {tps:.0} tps ({latency})"
            );
            Some(tps)
        }
        Some(Err(e)) => {
            println!("pgbench: FAILED: {e:?}");
            errors += 1;
            None
        }
        None => {
            println!("=== pgbench: SKIPPED (PAYONCE_BENCH_PG is not set; `make bench` sets it) ===");
            None
        }
    };
    applied_16.2 = pg_tps.unwrap_or(f64::NAN);
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
    println!();
    println!("{:<58} {:>10} {:>10}  verdict", "target", "measured", "target");
    let ratio = applied_16.0 / applied_16.1;
    println!(
        "{:<58} {:>10.2} {:>10}  {}",
        "applied at 16 clients, batching on / L_min",
        ratio,
        ">= 2.00",
        verdict(ratio >= 2.0)
    );
    if let Some(tps) = pg_tps {
        println!(
            "{:<58} {:>10.0} {:>10.0}  {}",
            "applied at 16 clients, batching on, vs pgbench tps",
            applied_16.0,
            tps,
            verdict(applied_16.0 > tps)
        );
    }
    for clients in [16, 64] {
        let (on, off) = (p99[&(true, clients)], p99[&(false, clients)]);
        println!(
            "{:<58} {:>10.2} {:>10}  {}",
            format!("p99 at {clients} clients, batching on / off"),
            on / off,
            "<= 2.00",
            verdict(on <= 2.0 * off)
        );
    }
    if errors > 0 {
        return Err(format!("{errors} unexpected answers: the figures above are not valid").into());
    }
    Ok(())
}

fn cores() -> usize {
    thread::available_parallelism().map_or(1, |n| n.get())
}
