//! Replays the incident that made payonce: a "payment succeeded" callback
//! delivered twice, 40 ms apart, while the first is still being handled; then
//! a third delivery from a second channel for the same order. Prints the
//! effects: one PAID order, one coupon, one points entry, one `order.paid`.
//!
//! Run: `cargo run --example incident_replay`

use payonce::{App, Clock, Config, CreateOrder, PaymentCallback, PlatformStatus, Rewards};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

fn main() -> Result<(), payonce::Error> {
    let config =
        Config { rewards: Rewards { coupon_templates: vec!["NEW10".into()], points_per_yuan: 1 }, ..Config::default() };
    let app = Arc::new(App::open(":memory:", Clock::manual(1_700_000_000_000), config)?);
    app.orders().create_order(&CreateOrder {
        order_no: "ORD-20240101-0001".into(),
        user_id: "buyer-1".into(),
        amount: 9900,
        currency: "CNY".into(),
        expires_in_s: None,
    })?;

    let callback = |pay_no: &str, channel: &str| PaymentCallback {
        channel: channel.into(),
        pay_no: pay_no.into(),
        order_no: "ORD-20240101-0001".into(),
        amount: 9900,
        currency: None,
        status: PlatformStatus::Success,
        paid_at: None,
        raw_body: format!(r#"{{"pay_no":"{pay_no}"}}"#).into_bytes(),
    };

    // Two deliveries of one pay_no: the second starts 40 ms after the first.
    let start = Arc::new(Barrier::new(2));
    let deliveries: Vec<_> = [0u64, 40]
        .into_iter()
        .map(|delay_ms| {
            let (app, start, cb) = (Arc::clone(&app), Arc::clone(&start), callback("WX-4200001", "generic"));
            thread::spawn(move || {
                start.wait();
                thread::sleep(Duration::from_millis(delay_ms));
                (delay_ms, app.payments().deliver_payment(&cb))
            })
        })
        .collect();
    println!("delivery                         answer");
    for handle in deliveries {
        let (delay_ms, reply) = handle.join().map_err(|_| payonce::Error::internal("delivery thread panicked"))?;
        println!("pay_no WX-4200001 at +{delay_ms:>2} ms     {}", reply?.to_json());
    }
    // The buyer also paid through a second channel.
    let second = app.payments().deliver_payment(&callback("ALI-2024-77", "generic"))?;
    println!("pay_no ALI-2024-77 (2nd channel) {}", second.to_json());

    let detail = app.orders().order("ORD-20240101-0001")?;
    let events = app.orders().events(0, 100)?;
    println!("\neffects");
    println!(
        "  order status        {} (paid by {})",
        detail.order.status.as_str(),
        detail.order.pay_no.unwrap_or_default()
    );
    println!("  coupons issued      {}", detail.coupons.len());
    println!("  points entries      {}", detail.points.len());
    for event in &events {
        println!("  event               {}", event.event_id);
    }
    let paid_events = events.iter().filter(|e| e.event_type == "order.paid").count();
    let exactly_once = detail.coupons.len() == 1 && detail.points.len() == 1 && paid_events == 1;
    println!("\nexactly once: {}", if exactly_once { "yes" } else { "NO" });
    if exactly_once {
        Ok(())
    } else {
        Err(payonce::Error::internal("a side effect ran more than once"))
    }
}
