//! `make bench`, second half: several `payonce serve` processes on one
//! database, SQLite beside PostgreSQL, over loopback HTTP.
//!
//! For each engine and process count: create the orders, then applied
//! callbacks (one per order) and duplicate callbacks (re-deliveries of the
//! applied pay_nos), C keep-alive clients, request `i` to process `i % N`
//! (as a load balancer would spread them). Prints applied/s, duplicates/s
//! and each one's p99 latency, then what the outbox lock costs: the same
//! applied run on 4 PostgreSQL processes with the lock off
//! (`PAYONCE_TEST_NAIVE_OUTBOX=1`, a plain sequence whose event feed can skip).
//!
//! PostgreSQL runs when `PAYONCE_BENCH_PG` names a server where this may
//! create databases (`make bench` starts a durable throwaway cluster and
//! sets it); otherwise that half is skipped, loudly.
//!
//! Run: `cargo run --release --example bench_processes -- [--quick]
//! [--orders N] [--duplicates N] [--clients N]` after `cargo build --release`.

#[path = "support/mod.rs"]
mod support;

use payonce::Clock;
use payonce_testclient as client;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};
use support::{fresh_postgres_database, payonce_binary, serve, Measured, Served};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const SECRET: &str = "bench-processes-secret-0123456789";
const AMOUNT: i64 = 9900;
const IO_TIMEOUT: Duration = Duration::from_secs(30);

struct Options {
    orders: usize,
    duplicates: usize,
    clients: usize,
}

fn parse_options() -> Result<Options, String> {
    let mut options = Options { orders: 4_000, duplicates: 20_000, clients: 16 };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut number = |name: &str| -> Result<usize, String> {
            args.next().and_then(|v| v.parse().ok()).ok_or_else(|| format!("{name} needs a number"))
        };
        match arg.as_str() {
            "--quick" => {
                options.orders = 400;
                options.duplicates = 2_000;
            }
            "--orders" => options.orders = number("--orders")?,
            "--duplicates" => options.duplicates = number("--duplicates")?,
            "--clients" => options.clients = number("--clients")?,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(options)
}

fn order_no(i: usize) -> String {
    format!("BP-{i:07}")
}

fn create_request(i: usize) -> Vec<u8> {
    let body = format!(r#"{{"order_no":"{}","user_id":"u{}","amount":{AMOUNT}}}"#, order_no(i), i % 1000);
    client::encode_request("POST", "bench", "/v1/orders", &[("Content-Type", "application/json")], body.as_bytes())
}

fn callback_request(i: usize) -> Vec<u8> {
    let body =
        format!(r#"{{"pay_no":"BPP-{i:07}","order_no":"{}","amount":{AMOUNT},"status":"SUCCESS"}}"#, order_no(i));
    let now_s = Clock::System.now_ms().div_euclid(1000);
    let signature = payonce::signature::sign(SECRET.as_bytes(), now_s, body.as_bytes());
    client::encode_request(
        "POST",
        "bench",
        "/v1/callbacks/generic",
        &[("Content-Type", "application/json"), ("Payonce-Signature", &signature)],
        body.as_bytes(),
    )
}

/// `clients` threads, each with a keep-alive connection to every process,
/// send requests `0..total` (request `i` to process `i % N`).
fn round(
    addrs: &[SocketAddr],
    clients: usize,
    total: usize,
    make: impl Fn(usize) -> Vec<u8> + Send + Sync + 'static,
    expect: &'static [u8],
) -> Result<Measured, BoxError> {
    let make = Arc::new(make);
    let next = Arc::new(AtomicUsize::new(0));
    let mut per_client = Vec::new();
    for _ in 0..clients {
        let mut connections = Vec::new();
        for addr in addrs {
            connections.push(client::Connection::connect(*addr, IO_TIMEOUT, IO_TIMEOUT)?);
        }
        per_client.push(connections);
    }
    let started = Instant::now();
    let handles: Vec<_> = per_client
        .into_iter()
        .map(|mut connections| {
            let (make, next) = (Arc::clone(&make), Arc::clone(&next));
            thread::spawn(move || {
                let (mut latencies, mut errors) = (Vec::new(), 0usize);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        break;
                    }
                    let request = make(i);
                    let sent = Instant::now();
                    let n = connections.len();
                    match connections[i % n].exchange(&request) {
                        Ok(response) if response.body.windows(expect.len()).any(|w| w == expect) => {
                            latencies.push(sent.elapsed().as_micros() as u64);
                        }
                        _ => errors += 1,
                    }
                }
                (latencies, errors)
            })
        })
        .collect();
    let mut measured = Measured::default();
    for handle in handles {
        let (latencies, errors) = handle.join().map_err(|_| "client thread panicked")?;
        measured.count += latencies.len();
        measured.latencies_us.extend(latencies);
        measured.errors += errors;
    }
    measured.seconds = started.elapsed().as_secs_f64();
    Ok(measured)
}

struct Row {
    engine: String,
    processes: usize,
    applied: Measured,
    duplicates: Measured,
}

fn run_one(
    options: &Options,
    binary: &Path,
    engine: &str,
    db: &str,
    processes: usize,
    env: &[(&str, &str)],
) -> Result<Row, BoxError> {
    eprintln!("bench_processes: {engine}, {processes} process(es)...");
    let rewards = ["--coupon", "NEW10", "--points-per-yuan", "1"];
    let servers: Vec<Served> =
        (0..processes).map(|_| serve(binary, db, SECRET, &rewards, env)).collect::<Result<_, _>>()?;
    let addrs: Vec<SocketAddr> = servers.iter().map(|p| p.addr).collect();
    let created = round(&addrs, options.clients, options.orders, create_request, br#""status":"PENDING""#)?;
    if created.errors > 0 {
        return Err(format!("{engine}: {} order creations failed", created.errors).into());
    }
    let applied = round(&addrs, options.clients, options.orders, callback_request, br#""outcome":"applied""#)?;
    let orders = options.orders;
    let duplicates = round(
        &addrs,
        options.clients,
        options.duplicates,
        move |i| callback_request(i % orders),
        br#""outcome":"duplicate""#,
    )?;
    drop(servers);
    Ok(Row { engine: engine.to_owned(), processes, applied, duplicates })
}

fn main() {
    let options = match parse_options() {
        Ok(options) => options,
        Err(e) => {
            eprintln!("bench_processes: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&options) {
        eprintln!("bench_processes: {e}");
        std::process::exit(1);
    }
}

fn run(options: &Options) -> Result<(), BoxError> {
    let binary = payonce_binary()?;
    let dir = std::env::temp_dir().join(format!("payonce-bench-processes-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut rows = Vec::new();
    for processes in [1, 2, 4] {
        let db = dir.join(format!("sqlite-{processes}.db")).display().to_string();
        rows.push(run_one(options, &binary, "sqlite (synchronous=FULL)", &db, processes, &[])?);
    }
    let pg = std::env::var("PAYONCE_BENCH_PG").ok().filter(|s| !s.is_empty());
    let mut naive = None;
    match &pg {
        Some(server) => {
            for (n, processes) in [1, 2, 4].into_iter().enumerate() {
                let db = fresh_postgres_database(server, &format!("bench_{}_{n}", std::process::id()))?;
                rows.push(run_one(options, &binary, "postgres", &db, processes, &[])?);
            }
            let db = fresh_postgres_database(server, &format!("bench_{}_naive", std::process::id()))?;
            naive = Some(run_one(
                options,
                &binary,
                "postgres, no outbox lock",
                &db,
                4,
                &[("PAYONCE_TEST_NAIVE_OUTBOX", "1")],
            )?);
        }
        None => println!("=== PostgreSQL: SKIPPED (PAYONCE_BENCH_PG is not set; `make bench` sets it) ==="),
    }
    let _ = std::fs::remove_dir_all(&dir);

    println!();
    println!(
        "{} orders (one applied callback each), {} duplicate callbacks, {} keep-alive clients, request i to process i % N",
        options.orders, options.duplicates, options.clients
    );
    println!(
        "{:<28} {:>9} {:>11} {:>13} {:>14} {:>16}",
        "engine", "processes", "applied/s", "applied p99", "duplicates/s", "duplicates p99"
    );
    let mut errors = 0;
    for row in rows.iter().chain(naive.iter()) {
        println!(
            "{:<28} {:>9} {:>11.0} {:>10.2} ms {:>14.0} {:>13.2} ms",
            row.engine,
            row.processes,
            row.applied.rate(),
            row.applied.percentile_ms(0.99),
            row.duplicates.rate(),
            row.duplicates.percentile_ms(0.99)
        );
        errors += row.applied.errors + row.duplicates.errors;
    }
    if let (Some(naive), Some(locked)) = (&naive, rows.iter().find(|r| r.engine == "postgres" && r.processes == 4)) {
        println!(
            "outbox lock on 4 PostgreSQL processes: applied {:.0}/s with it, {:.0}/s without ({:+.1}%); p99 {:.2} ms vs {:.2} ms",
            locked.applied.rate(),
            naive.applied.rate(),
            (locked.applied.rate() / naive.applied.rate() - 1.0) * 100.0,
            locked.applied.percentile_ms(0.99),
            naive.applied.percentile_ms(0.99)
        );
    }
    if errors > 0 {
        return Err(format!("{errors} unexpected answers: the figures above are not valid").into());
    }
    Ok(())
}
