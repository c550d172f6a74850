//! Webhook latency: from an event's commit to its arrival at a local
//! receiver (the webhook relay, docs/webhooks.md; the figures are in
//! docs/performance.md).
//!
//! Starts the release `payonce serve` on a fresh SQLite file with one
//! `--webhook-url` pointing at a minimal HTTP/1.1 receiver in this process,
//! pays N orders (an `order.paid` event each), and measures, per event, the
//! time from its `created_at` (taken in the transaction, just before COMMIT,
//! so the figure includes the commit's fsync) to the receiver reading the
//! request: both on this machine's clock. Two load shapes: one payment at a
//! time (the relay wakes on each commit), and `--clients` at once.
//!
//! `cargo build --release && cargo run --release --example bench_webhooks [-- --events N --clients C]`

#[path = "support/mod.rs"]
mod support;

use payonce::clock::parse_rfc3339_ms;
use payonce::Clock;
use payonce_testclient as client;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use support::{payonce_binary, serve};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const SECRET: &str = "bench-secret";
const WEBHOOK_SECRET: &str = "whsec_YmVuY2gtd2ViaG9vay1zZWNyZXQtb2YtcGF5b25jZQ==";

struct Options {
    events: usize,
    clients: usize,
}

fn parse_options() -> Result<Options, String> {
    let mut options = Options { events: 1_000, clients: 8 };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut number = |flag: &str| -> Result<usize, String> {
            args.next().and_then(|v| v.parse().ok()).filter(|n| *n > 0).ok_or(format!("{flag} takes a positive number"))
        };
        match arg.as_str() {
            "--events" => options.events = number("--events")?,
            "--clients" => options.clients = number("--clients")?,
            "--quick" => options.events = 100,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(options)
}

/// A keep-alive HTTP/1.1 receiver that answers 204 to everything and sends
/// (event created_at in ms, arrival in ms) for each request on `arrivals`.
fn start_receiver(arrivals: mpsc::Sender<(i64, i64)>) -> Result<SocketAddr, BoxError> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let arrivals = arrivals.clone();
            std::thread::spawn(move || serve_connection(stream, &arrivals));
        }
    });
    Ok(addr)
}

fn serve_connection(stream: TcpStream, arrivals: &mpsc::Sender<(i64, i64)>) {
    let _ = stream.set_nodelay(true);
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    loop {
        let mut length = 0usize;
        let mut line = String::new();
        // The head: the request line and headers up to the empty line.
        loop {
            line.clear();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let trimmed = line.trim_end();
            if trimmed.is_empty() {
                break;
            }
            if let Some((name, value)) = trimmed.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut body = vec![0u8; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let arrived_ms = Clock::System.now_ms();
        let event: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        if let Some(created_ms) = event["created_at"].as_str().and_then(parse_rfc3339_ms) {
            let _ = arrivals.send((created_ms, arrived_ms));
        }
        if writer.write_all(b"HTTP/1.1 204 No Content\r\n\r\n").is_err() {
            return;
        }
    }
}

fn pay(connection: &mut client::Connection, i: usize) -> Result<(), BoxError> {
    let order_no = format!("BW-{i:07}");
    let body = format!(r#"{{"order_no":"{order_no}","user_id":"u{}","amount":100}}"#, i % 100);
    let create =
        client::encode_request("POST", "bench", "/v1/orders", &[("Content-Type", "application/json")], body.as_bytes());
    let created = connection.exchange(&create).map_err(|e| format!("create {order_no}: {e:?}"))?;
    if created.status != 201 {
        return Err(format!("create {order_no}: {}", created.status).into());
    }
    let body = format!(r#"{{"pay_no":"BWP-{i:07}","order_no":"{order_no}","amount":100,"status":"SUCCESS"}}"#);
    let signature =
        payonce::signature::sign(SECRET.as_bytes(), Clock::System.now_ms().div_euclid(1000), body.as_bytes());
    let callback = client::encode_request(
        "POST",
        "bench",
        "/v1/callbacks/generic",
        &[("Content-Type", "application/json"), ("Payonce-Signature", &signature)],
        body.as_bytes(),
    );
    let paid = connection.exchange(&callback).map_err(|e| format!("pay {order_no}: {e:?}"))?;
    if paid.status != 200 {
        return Err(format!("pay {order_no}: {}", paid.status).into());
    }
    Ok(())
}

/// Pays orders `first..first + count` from `clients` threads and collects
/// the `count` arrivals; returns the latencies in ms.
fn phase(
    addr: SocketAddr,
    arrivals: &mpsc::Receiver<(i64, i64)>,
    first: usize,
    count: usize,
    clients: usize,
) -> Result<Vec<i64>, BoxError> {
    let started = Instant::now();
    std::thread::scope(|scope| -> Result<(), BoxError> {
        let mut handles = Vec::new();
        for c in 0..clients {
            handles.push(scope.spawn(move || -> Result<(), BoxError> {
                let mut connection =
                    client::Connection::connect(addr, Duration::from_secs(5), Duration::from_secs(30))?;
                for i in (first + c..first + count).step_by(clients) {
                    pay(&mut connection, i)?;
                }
                Ok(())
            }));
        }
        for handle in handles {
            handle.join().map_err(|_| "a client panicked")??;
        }
        Ok(())
    })?;
    let paid_s = started.elapsed().as_secs_f64();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut latencies = Vec::with_capacity(count);
    while latencies.len() < count {
        let left = deadline.checked_duration_since(Instant::now()).ok_or("not every event arrived within 60 s")?;
        let (created, arrived) = arrivals.recv_timeout(left)?;
        latencies.push(arrived - created);
    }
    let delivered_s = started.elapsed().as_secs_f64();
    println!(
        "  ({count} payments in {paid_s:.2} s: {:.0}/s; the last event delivered after {delivered_s:.2} s: {:.0}/s)",
        count as f64 / paid_s,
        count as f64 / delivered_s
    );
    latencies.sort_unstable();
    Ok(latencies)
}

fn percentile(sorted: &[i64], p: f64) -> i64 {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

fn main() {
    let options = match parse_options() {
        Ok(options) => options,
        Err(e) => {
            eprintln!("bench_webhooks: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&options) {
        eprintln!("bench_webhooks: {e}");
        std::process::exit(1);
    }
}

fn run(options: &Options) -> Result<(), BoxError> {
    let binary = payonce_binary()?;
    let dir = std::env::temp_dir().join(format!("payonce-bench-webhooks-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let db = dir.join("payonce.db");
    let (tx, arrivals) = mpsc::channel();
    let receiver = start_receiver(tx)?;
    let webhook_url = format!("http://{receiver}/hooks");
    let server = serve(
        &binary,
        &db.display().to_string(),
        SECRET,
        &["--webhook-url", &webhook_url],
        &[("PAYONCE_WEBHOOK_SECRET", WEBHOOK_SECRET)],
    )?;
    let addr = server.addr;
    println!("webhook latency, event created_at (in the transaction, before COMMIT) to arrival at a local receiver");
    println!("SQLite file, synchronous=FULL; defaults otherwise (--webhook-concurrency 8, --webhook-poll-ms 200)");
    println!("| load | events | p50 ms | p99 ms | max ms |");
    println!("|---|---:|---:|---:|---:|");
    let shapes = [("1 client, one payment at a time", 1), ("concurrent clients", options.clients)];
    let mut first = 0;
    for (label, clients) in shapes {
        let latencies = phase(addr, &arrivals, first, options.events, clients)?;
        first += options.events;
        let label = if clients == 1 { label.to_owned() } else { format!("{clients} {label}") };
        println!(
            "| {label} | {} | {} | {} | {} |",
            latencies.len(),
            percentile(&latencies, 0.50),
            percentile(&latencies, 0.99),
            latencies.last().copied().unwrap_or(0)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
