//! Reconciliation memory: what a 16 MiB statement costs the server that
//! compares it (docs/performance.md, "Reconciliation memory").
//!
//! Starts the release `payonce serve` on a fresh SQLite file, loads (with
//! SQL, before serving) one applied payment for every row of a generic
//! statement just under the 16 MiB body limit, then, each phase in a fresh
//! `payonce serve` process (VmHWM cannot be reset), uploads:
//!
//! - one statement whose every row matches a recorded payment;
//! - four of them at once;
//! - one statement whose every row is unknown to payonce (every row is in
//!   `missing_local`, so the answer lists them all: the largest answer);
//! - four of those at once.
//!
//! For each it prints the server's resident memory before the upload
//! (VmRSS), its peak (VmHWM from /proc/PID/status), the peak's growth over
//! the idle figure against the targets (one statement: at most 8 × its size;
//! four at once: under 1 GiB), and VmRSS two seconds after the last answer.
//!
//! `cargo build --release && cargo run --release --example bench_reconcile [-- --quick | --mib N]`

#[path = "support/mod.rs"]
mod support;

use payonce::clock::{format_ms, parse_rfc3339_ms};
use payonce_testclient as client;
use std::path::Path;
use std::time::{Duration, Instant};
use support::{payonce_binary, serve};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const SECRET: &str = "bench-secret";
const MIB: usize = 1024 * 1024;
const HEADER: &str = "pay_no,order_no,amount,status,paid_at\n";
/// The statement's day (UTC, as a generic statement's period is).
const DAY_START: &str = "2024-03-04T00:00:00Z";
/// Rows are spread over the day this far apart (254,000 rows fit in 22 h).
const ROW_STEP_MS: i64 = 300;
/// One upload waits at most this long for its answer.
const UPLOAD_TIMEOUT: Duration = Duration::from_secs(600);

struct Options {
    /// The statement's size bound in MiB (16: the body limit).
    mib: usize,
}

fn parse_options() -> Result<Options, String> {
    let mut options = Options { mib: 16 };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => options.mib = 2,
            "--mib" => {
                options.mib = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|n| (1..=16).contains(n))
                    .ok_or("--mib takes 1 to 16")?
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(options)
}

/// One statement row, all the same length: `prefix` + 9 digits.
fn row(prefix: &str, i: usize, paid_at: &str) -> String {
    format!("BR-{prefix}{i:09},BR-O{i:09},9900,SUCCESS,{paid_at}\n")
}

fn paid_at(i: usize) -> Result<String, BoxError> {
    let start = parse_rfc3339_ms(DAY_START).ok_or("bad DAY_START")?;
    Ok(format_ms(start + i as i64 * ROW_STEP_MS))
}

/// How many rows fit in `bytes` after the header.
fn rows_for(bytes: usize) -> Result<usize, BoxError> {
    Ok((bytes - HEADER.len()) / row("P", 0, &paid_at(0)?).len())
}

fn statement(prefix: &str, rows: usize) -> Result<Vec<u8>, BoxError> {
    let mut text = String::from(HEADER);
    for i in 0..rows {
        text.push_str(&row(prefix, i, &paid_at(i)?));
    }
    Ok(text.into_bytes())
}

/// One PAID order and its applied payment per row, written with SQL into
/// the database `payonce serve` created (the exactly-once path would take
/// minutes for a quarter of a million payments; reconciliation only reads).
fn load_payments(db: &Path, rows: usize) -> Result<(), BoxError> {
    let mut conn = rusqlite::Connection::open(db)?;
    let tx = conn.transaction()?;
    {
        let mut order = tx.prepare(
            "INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at)
             VALUES (?1, 'u-bench', 9900, 'CNY', 'PENDING', ?2, ?2)",
        )?;
        let mut paid =
            tx.prepare("UPDATE orders SET status = 'PAID', pay_no = ?2, paid_at = ?3 WHERE order_no = ?1")?;
        let mut payment = tx.prepare(
            "INSERT INTO pay_callback_log (pay_no, channel, order_id, amount, status, outcome, state, source,
                                           raw_body, paid_at, received_at, decided_at, applied_at, rewards_due)
             VALUES (?1, 'generic', (SELECT id FROM orders WHERE order_no = ?2), 9900, 'SUCCESS', 'applied',
                     'decided', 'callback', x'', ?3, ?4, ?4, ?4, '{}')",
        )?;
        for i in 0..rows {
            let (order_no, pay_no, at) = (format!("BR-O{i:09}"), format!("BR-P{i:09}"), paid_at(i)?);
            let decided = format_ms(parse_rfc3339_ms(&at).ok_or("bad time")? + 60_000);
            order.execute(rusqlite::params![order_no, at])?;
            paid.execute(rusqlite::params![order_no, pay_no, decided])?;
            payment.execute(rusqlite::params![pay_no, order_no, at, decided])?;
        }
    }
    tx.commit()?;
    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
    Ok(())
}

/// (VmRSS, VmHWM, RssAnon) of a process, in bytes.
fn memory(pid: u32) -> Result<(usize, usize, usize), BoxError> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> Result<usize, BoxError> {
        let line = status.lines().find(|l| l.starts_with(name)).ok_or_else(|| format!("no {name} in status"))?;
        let kib: usize = line[name.len()..].trim().trim_end_matches("kB").trim().parse()?;
        Ok(kib * 1024)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?, field("RssAnon:")?))
}

/// Uploads `body` from `clients` threads at once; returns the slowest answer
/// time and the answer's `matched` and `missing_local` counts.
fn upload(addr: std::net::SocketAddr, body: &[u8], clients: usize) -> Result<(f64, u64, usize), BoxError> {
    let started = Instant::now();
    let answers = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..clients)
            .map(|_| {
                scope.spawn(move || -> Result<(u64, usize), String> {
                    let answer = client::request(
                        addr,
                        "POST",
                        "/v1/reconciliations?format=generic",
                        &[("Content-Type", "text/csv")],
                        body,
                        UPLOAD_TIMEOUT,
                    )?;
                    if answer.status != 200 {
                        return Err(format!("answer {}: {}", answer.status, answer.text()));
                    }
                    let value: serde_json::Value = serde_json::from_slice(&answer.body).map_err(|e| e.to_string())?;
                    let matched = value["matched"].as_u64().ok_or("no matched")?;
                    let missing = value["missing_local"].as_array().map_or(0, Vec::len);
                    Ok((matched, missing))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().map_err(|_| "a client panicked".to_owned())?).collect::<Vec<_>>()
    });
    let seconds = started.elapsed().as_secs_f64();
    let mut counts = (0, 0);
    for answer in answers {
        counts = answer?;
    }
    Ok((seconds, counts.0, counts.1))
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / MIB as f64
}

fn main() {
    let options = match parse_options() {
        Ok(options) => options,
        Err(e) => {
            eprintln!("bench_reconcile: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&options) {
        eprintln!("bench_reconcile: {e}");
        std::process::exit(1);
    }
}

fn run(options: &Options) -> Result<(), BoxError> {
    let binary = payonce_binary()?;
    let dir = std::env::temp_dir().join(format!("payonce-bench-reconcile-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let db = dir.join("payonce.db");
    let db_text = db.display().to_string();
    let rows = rows_for(options.mib * MIB)?;
    // The schema, by payonce itself; then the payments, with nothing serving.
    drop(serve(&binary, &db_text, SECRET, &[], &[])?);
    let loading = Instant::now();
    load_payments(&db, rows)?;
    println!("reconciliation memory: {rows} applied payments loaded in {:.1} s", loading.elapsed().as_secs_f64());
    let matching = statement("P", rows)?;
    let unknown = statement("Q", rows)?;
    let size = matching.len();
    println!(
        "statement: generic, {rows} rows, {size} bytes ({:.2} MiB); targets: one at most 8 × its size ({:.0} MiB), \
         four at once under 1024 MiB",
        mib(size),
        mib(8 * size)
    );
    println!("| statement | uploads at once | answer s | RSS idle MiB | peak (VmHWM) MiB | peak − idle MiB | target MiB | RSS 2 s after MiB | anonymous idle → after MiB |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let phases = [
        ("every row matched", &matching, 1, rows, 0),
        ("every row matched", &matching, 4, rows, 0),
        ("every row missing_local", &unknown, 1, 0, rows),
        ("every row missing_local", &unknown, 4, 0, rows),
    ];
    for (label, body, clients, matched, missing) in phases {
        let server = serve(&binary, &db_text, SECRET, &[], &[])?;
        // The idle figure after one request, so start-up is behind it (not a
        // statement: even a one-row statement compares the period's payments).
        client::request(server.addr, "GET", "/healthz", &[], b"", UPLOAD_TIMEOUT)?;
        let (idle, _, idle_anon) = memory(server.pid())?;
        let (seconds, got_matched, got_missing) = upload(server.addr, body, clients)?;
        if (got_matched, got_missing) != (matched as u64, missing) {
            return Err(format!(
                "{label}: answered matched {got_matched}, missing_local {got_missing}; expected {matched}, {missing}"
            )
            .into());
        }
        std::thread::sleep(Duration::from_secs(2));
        let (after, peak, after_anon) = memory(server.pid())?;
        let target = if clients == 1 { 8 * size } else { 1024 * MIB };
        println!(
            "| {label} | {clients} | {seconds:.1} | {:.0} | {:.0} | {:.0} | {} {:.0} | {:.0} | {:.0} → {:.0} |",
            mib(idle),
            mib(peak),
            mib(peak.saturating_sub(idle)),
            if clients == 1 { "≤" } else { "<" },
            mib(target),
            mib(after),
            mib(idle_anon),
            mib(after_anon)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
