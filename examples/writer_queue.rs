//! Measures what the process-wide writer queue buys: 16 threads apply
//! distinct payments on one file database, once with the queue and once
//! without (SQLite's busy handler arbitrating alone, sleeping in steps of up
//! to 100 ms). Prints throughput and latency percentiles for each.
//!
//! Run: `cargo run --release --example writer_queue [ORDERS]`

use payonce::store::StoreOptions;
use payonce::{App, Clock, Config, CreateOrder, PaymentCallback, PlatformStatus, Rewards};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const THREADS: usize = 16;

fn main() -> Result<(), payonce::Error> {
    let orders: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(2_000);
    println!("{orders} applied payments, {THREADS} threads, file database, synchronous=FULL");
    println!(
        "{:<14} {:>10} {:>9} {:>9} {:>9} {:>6}",
        "writer queue", "payments/s", "p50 ms", "p99 ms", "max ms", "busy"
    );
    for writer_queue in [true, false] {
        let (rate, p50, p99, max, busy) = run(orders, writer_queue)?;
        let label = if writer_queue { "on" } else { "off" };
        println!("{label:<14} {rate:>10.0} {p50:>9.2} {p99:>9.2} {max:>9.2} {busy:>6}");
    }
    Ok(())
}

fn run(orders: usize, writer_queue: bool) -> Result<(f64, f64, f64, f64, usize), payonce::Error> {
    let dir = std::env::temp_dir().join(format!("payonce-writer-queue-{}-{writer_queue}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| payonce::Error::internal(e.to_string()))?;
    let db = dir.join("bench.db").display().to_string();
    let options = StoreOptions { writer_queue, ..StoreOptions::default() };
    let config =
        Config { rewards: Rewards { coupon_templates: vec!["NEW10".into()], points_per_yuan: 1 }, ..Config::default() };
    let app = Arc::new(App::open_with(&db, Clock::System, config, &options)?);
    for i in 0..orders {
        app.orders().create_order(&CreateOrder {
            order_no: format!("O{i}"),
            user_id: format!("u{}", i % 97),
            amount: 9900,
            currency: "CNY".into(),
            expires_in_s: Some(3600),
        })?;
    }
    let next = Arc::new(AtomicUsize::new(0));
    let busy = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let threads: Vec<_> = (0..THREADS)
        .map(|_| {
            let (app, next, busy) = (Arc::clone(&app), Arc::clone(&next), Arc::clone(&busy));
            std::thread::spawn(move || {
                let mut latencies = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= orders {
                        return latencies;
                    }
                    let cb = PaymentCallback {
                        channel: "generic".into(),
                        pay_no: format!("P{i}"),
                        order_no: format!("O{i}"),
                        amount: 9900,
                        currency: None,
                        status: PlatformStatus::Success,
                        paid_at: None,
                        raw_body: b"{}".to_vec(),
                    };
                    let t = Instant::now();
                    if app.payments().deliver_payment(&cb).is_err() {
                        busy.fetch_add(1, Ordering::SeqCst);
                    }
                    latencies.push(t.elapsed());
                }
            })
        })
        .collect();
    let mut latencies: Vec<Duration> = threads.into_iter().flat_map(|t| t.join().unwrap_or_default()).collect();
    let elapsed = started.elapsed().as_secs_f64();
    latencies.sort();
    let pct = |p: f64| {
        let i = ((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1));
        latencies.get(i).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    let _ = std::fs::remove_dir_all(&dir);
    Ok((orders as f64 / elapsed, pct(0.50), pct(0.99), pct(1.0), busy.load(Ordering::SeqCst)))
}
