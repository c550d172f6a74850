//! Expiry with the settable clock: the sweeper closes PENDING orders past
//! `expires_at`, and a payment racing the sweeper for one order either wins
//! (`applied`) or loses (`paid_after_close`), never both.

use payonce::{App, Clock, Config, CreateOrder, PaymentCallback, PlatformStatus, Rewards};
use std::sync::{Arc, Barrier};
use std::thread;

const T0_MS: i64 = 1_700_000_000_000;

fn app() -> App {
    let config =
        Config { rewards: Rewards { coupon_templates: vec!["NEW10".into()], points_per_yuan: 1 }, ..Config::default() };
    App::open(":memory:", Clock::manual(T0_MS), config).expect("open app")
}

fn order(app: &App, order_no: &str, expires_in_s: i64) {
    let (_, created) = app
        .orders()
        .create_order(&CreateOrder {
            order_no: order_no.into(),
            user_id: "u1".into(),
            amount: 500,
            currency: "CNY".into(),
            expires_in_s: Some(expires_in_s),
        })
        .expect("create order");
    assert!(created);
}

fn payment(order_no: &str, pay_no: &str) -> PaymentCallback {
    PaymentCallback {
        channel: "generic".into(),
        pay_no: pay_no.into(),
        order_no: order_no.into(),
        amount: 500,
        currency: None,
        status: PlatformStatus::Success,
        paid_at: None,
        raw_body: b"{}".to_vec(),
    }
}

#[test]
fn sweeper_closes_exactly_the_expired_orders() {
    let app = app();
    order(&app, "short", 60);
    order(&app, "long", 600);
    app.clock().advance_ms(59_999);
    assert_eq!(app.orders().close_expired(100).expect("sweep"), 0, "nothing is due before expires_at");
    app.clock().advance_ms(1);
    assert_eq!(app.orders().close_expired(100).expect("sweep"), 1);
    assert_eq!(app.orders().close_expired(100).expect("sweep"), 0, "a second sweep finds nothing");

    let short = app.orders().order("short").expect("order").order;
    assert_eq!(short.status.as_str(), "CLOSED");
    assert_eq!(short.closed_at, Some(payonce::clock::format_ms(T0_MS + 60_000)));
    assert_eq!(short.expires_at, payonce::clock::format_ms(T0_MS + 60_000));
    assert_eq!(app.orders().order("long").expect("order").order.status.as_str(), "PENDING");
    let events = app.orders().events(0, 100).expect("events");
    let ids: Vec<&str> = events.iter().map(|e| e.event_id.as_str()).collect();
    assert_eq!(ids, ["order.closed:short"]);

    // A payment arriving after the close is recorded, not applied.
    let reply = app.payments().deliver_payment(&payment("short", "P-late")).expect("deliver");
    assert_eq!(reply.outcome_str(), "paid_after_close");
    let detail = app.orders().order("short").expect("order");
    assert_eq!(detail.order.status.as_str(), "CLOSED");
    assert!(detail.coupons.is_empty() && detail.points.is_empty());
    let ids: Vec<String> = app.orders().events(0, 100).expect("events").into_iter().map(|e| e.event_id).collect();
    assert_eq!(ids, ["order.closed:short", "payment.refund_required:P-late"]);
}

#[test]
fn sweep_respects_the_batch_bound() {
    let app = app();
    for i in 0..7 {
        order(&app, &format!("o{i}"), 1);
    }
    app.clock().advance_ms(1_000);
    assert_eq!(app.orders().close_expired(3).expect("sweep"), 3);
    assert_eq!(app.orders().close_expired(3).expect("sweep"), 3);
    assert_eq!(app.orders().close_expired(3).expect("sweep"), 1);
}

#[test]
fn a_payment_racing_the_sweeper_wins_or_loses_but_never_both() {
    const ORDERS: usize = 200;
    let app = Arc::new(app());
    for i in 0..ORDERS {
        order(&app, &format!("race{i}"), 10);
    }
    app.clock().advance_ms(10_000);
    let start = Arc::new(Barrier::new(2));
    let sweeper = {
        let (app, start) = (Arc::clone(&app), Arc::clone(&start));
        thread::spawn(move || {
            start.wait();
            let mut closed = 0;
            // Small batches interleave the sweeper with the payments.
            loop {
                let n = app.orders().close_expired(5).expect("sweep");
                closed += n;
                if n == 0 {
                    return closed;
                }
            }
        })
    };
    let payer = {
        let (app, start) = (Arc::clone(&app), Arc::clone(&start));
        thread::spawn(move || {
            start.wait();
            (0..ORDERS)
                .rev()
                .map(|i| {
                    app.payments().deliver_payment(&payment(&format!("race{i}"), &format!("pay{i}"))).expect("deliver")
                })
                .map(|reply| reply.outcome_str())
                .collect::<Vec<_>>()
        })
    };
    let closed = sweeper.join().expect("sweeper thread");
    let outcomes = payer.join().expect("payer thread");
    let applied = outcomes.iter().filter(|o| **o == "applied").count();
    let late = outcomes.iter().filter(|o| **o == "paid_after_close").count();
    assert_eq!(applied + late, ORDERS, "every payment is applied or paid_after_close: {outcomes:?}");
    assert_eq!(late, closed, "every closed order's payment came late");

    let events = app.orders().events(0, 1_000).expect("events");
    for i in 0..ORDERS {
        let detail = app.orders().order(&format!("race{i}")).expect("order");
        let (paid, closed) = (
            events.iter().any(|e| e.event_id == format!("order.paid:race{i}")),
            events.iter().any(|e| e.event_id == format!("order.closed:race{i}")),
        );
        assert!(paid != closed, "race{i}: paid={paid} closed={closed}");
        match detail.order.status.as_str() {
            "PAID" => assert!(paid && detail.coupons.len() == 1 && detail.points.len() == 1),
            "CLOSED" => assert!(closed && detail.coupons.is_empty() && detail.points.is_empty()),
            other => panic!("race{i} ended {other}"),
        }
    }
    assert!(app.locks().is_empty());
}
