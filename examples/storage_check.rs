//! Measures what watching the database files costs a write: the check that
//! `Store::write` runs before BEGIN and after COMMIT (three `stat` calls of
//! the database, `-wal` and `-shm` paths), alone and next to one applied
//! payment (one IMMEDIATE transaction, fsynced at `synchronous=FULL`), on a
//! file database in the system's temporary directory.
//!
//! Run: `cargo run --release --example storage_check [CHECKS] [PAYMENTS]`

use payonce::{App, Clock, Config, CreateOrder, PaymentCallback, PlatformStatus};
use std::time::Instant;

fn main() -> Result<(), payonce::Error> {
    let checks: u32 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(200_000);
    let payments: u32 = std::env::args().nth(2).and_then(|a| a.parse().ok()).unwrap_or(2_000);
    let dir = std::env::temp_dir().join(format!("payonce-storage-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| payonce::Error::internal(e.to_string()))?;
    let db = dir.join("payonce.db");
    let app = App::open(&db.display().to_string(), Clock::System, Config::default())?;

    let started = Instant::now();
    for _ in 0..checks {
        app.store().check_storage()?;
    }
    let check_us = started.elapsed().as_secs_f64() * 1e6 / f64::from(checks);

    let started = Instant::now();
    for i in 0..payments {
        let order_no = format!("SC-{i}");
        app.orders().create_order(&CreateOrder {
            order_no: order_no.clone(),
            user_id: "u".into(),
            amount: 100,
            currency: "CNY".into(),
            expires_in_s: None,
        })?;
        app.payments().deliver_payment(&PaymentCallback {
            channel: "generic".into(),
            pay_no: format!("SCP-{i}"),
            order_no,
            amount: 100,
            currency: None,
            status: PlatformStatus::Success,
            paid_at: None,
            raw_body: b"{}".to_vec(),
        })?;
    }
    // Two writes per payment (the order, then the callback), each checked twice.
    let write_us = started.elapsed().as_secs_f64() * 1e6 / f64::from(payments * 2);
    println!("one check (3 stat calls): {check_us:.2} us, mean of {checks}");
    println!("one write (order or callback, fsynced): {write_us:.1} us, mean of {}", payments * 2);
    println!("two checks per write: {:.2}% of a write", 2.0 * check_us / write_us * 100.0);
    drop(app);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
