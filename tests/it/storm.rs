//! Storms: many orders, each paid by several re-deliveries of one pay_no and
//! some by a second channel's pay_no as well, all delivered at once from 16
//! threads in a seeded random order. Whatever the interleaving, every order
//! is PAID once by exactly one of its payments, its coupons and points land
//! once, there is one `order.paid` per order and one
//! `payment.refund_required` per losing payment.
//!
//! One generator ([`Storm`]) and one verifier ([`verify`]) serve every
//! variant: in process on the shared memdb and on a file database, over
//! HTTP against one `payonce serve`, and against two `payonce serve`
//! processes on one database file (where only SQLite, not the in-process
//! key lock, keeps the two processes apart).
//!
//! A failure names its seed; `PAYONCE_STORM_SEED=<seed>` replays that storm
//! (the deliveries and their order in the list are the same; the thread
//! interleaving is whatever the machine does).
//!
//! Run with `--nocapture` to see each storm's deliveries/s, how many pairs
//! of deliveries of one order were actually in flight together, and the
//! keyed-lock map's size after the in-process storms.
//!
//! These tests were checked against planted bugs (in a scratch copy of
//! the crate): the order's status read before `BEGIN IMMEDIATE` with the
//! CAS count ignored fails all four storms; the same with the key lock on
//! the order instead of the pay_no (so one process serialises an order and
//! stays correct) fails only the two-process storm; a keyed-lock map that
//! keeps its entries and a `duplicate` naming a wrong `original` fail too.

use crate::util::{Rng, Server};
use payonce::{App, Clock, Config, CreateOrder, PaymentCallback, PlatformStatus, Rewards};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// Worker threads (in process) or client threads (over HTTP).
const THREADS: usize = 16;
const COUPONS: [&str; 2] = ["NEW10", "VIP"];
const POINTS_PER_YUAN: i64 = 1;
/// `--coupon NEW10 --coupon VIP --points-per-yuan 1`, the in-process rewards' twin.
const SERVE_FLAGS: [&str; 6] = ["--coupon", "NEW10", "--coupon", "VIP", "--points-per-yuan", "1"];
/// How often one HTTP delivery is re-sent after a 503 `database_busy`
/// (what a payment platform does with a non-2xx answer) before the test fails.
const BUSY_RETRIES_MAX: usize = 20;

/// Sizes, measured to keep the module well under a minute in a debug build
/// on two cores with synchronous=FULL (see the numbers each test prints).
/// The memdb storm is larger because it is cheap (no fsync) and because
/// without I/O a delivery rarely blocks, so races are rarer per order: with
/// 300 orders a planted stale-read bug (the order's status read before
/// BEGIN IMMEDIATE, the CAS count ignored) was caught in about half of the
/// memdb runs, with 2,000 in every run tried; the file and HTTP storms
/// caught it every time at the sizes below.
const ORDERS_MEMDB: usize = 2_000;
const ORDERS_IN_PROCESS: usize = 300;
const ORDERS_HTTP: usize = 200;
const ORDERS_TWO_PROCESSES: usize = 200;

// ---- the generator ----

struct StormOrder {
    order_no: String,
    user_id: String,
    amount: i64,
    /// The first channel's pay_no, then for some orders a second channel's.
    pay_nos: Vec<String>,
}

#[derive(Clone, Copy, Debug)]
struct Delivery {
    order: usize,
    /// Index into the order's `pay_nos`.
    pay: usize,
    /// Which process receives it, in the two-process storm (0 or 1).
    target: usize,
}

struct Storm {
    seed: u64,
    orders: Vec<StormOrder>,
    /// Every delivery of every pay_no, shuffled into one list.
    deliveries: Vec<Delivery>,
}

/// What one delivery was answered.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Answer {
    outcome: String,
    original: Option<String>,
}

impl Storm {
    /// `orders` orders; each first pay_no delivered 2..=5 times, and for
    /// about a quarter of the orders a second pay_no delivered 1..=3 times.
    ///
    /// The deliveries are shuffled into one list with locality: orders are
    /// shuffled, and each delivery lands at a random place within a window
    /// of `SPREAD` orders around its order's place, interleaved with the
    /// deliveries of the neighbouring orders. A uniform shuffle of ~1,000
    /// deliveries would put an order's deliveries hundreds of places apart,
    /// so 16 threads would rarely have two of them in flight at once (a run
    /// measured ~50 racing pairs of one pay_no in 300 orders and ~15 across
    /// channels); the window keeps them a few dozen places apart, so the
    /// threads race on almost every order (see the `overlaps` line printed).
    fn new(seed: u64, orders: usize) -> Storm {
        /// The window, in orders (about 4 deliveries each; 16 threads take
        /// ~16 consecutive deliveries at a time).
        const SPREAD: u64 = 4;
        let mut rng = Rng::new(seed);
        let mut list = Vec::with_capacity(orders);
        let mut deliveries = Vec::new();
        for i in 0..orders {
            // >= 100 minor units, so points (floor(amount / 100)) are positive.
            let amount = 100 + rng.below(99_900) as i64;
            let mut pay_nos = vec![format!("PAY-A-{i:05}")];
            let first_deliveries = 2 + rng.below(4) as usize;
            deliveries.extend((0..first_deliveries).map(|_| Delivery { order: i, pay: 0, target: 0 }));
            if rng.below(4) == 0 {
                pay_nos.push(format!("PAY-B-{i:05}"));
                let second_deliveries = 1 + rng.below(3) as usize;
                deliveries.extend((0..second_deliveries).map(|_| Delivery { order: i, pay: 1, target: 0 }));
            }
            list.push(StormOrder {
                order_no: format!("ORD-{i:05}"),
                user_id: format!("user-{}", i % 37),
                amount,
                pay_nos,
            });
        }
        let mut places: Vec<u64> = (0..orders as u64).collect();
        rng.shuffle(&mut places);
        // Sort key: the order's place plus a random offset inside the window,
        // at a finer grain so deliveries of neighbouring orders interleave.
        const GRAIN: u64 = 1 << 16;
        let mut keyed: Vec<(u64, Delivery)> = deliveries
            .into_iter()
            .map(|mut d| {
                d.target = rng.below(2) as usize;
                (places[d.order] * GRAIN + rng.below(SPREAD * GRAIN), d)
            })
            .collect();
        keyed.sort_by_key(|(key, _)| *key);
        let deliveries = keyed.into_iter().map(|(_, d)| d).collect();
        let storm = Storm { seed, orders: list, deliveries };
        assert!(storm.second_channel_payments() > 0, "seed {seed:#x} made no second-channel payment; pick another");
        storm
    }

    fn pay_no(&self, d: &Delivery) -> &str {
        &self.orders[d.order].pay_nos[d.pay]
    }

    fn second_channel_payments(&self) -> usize {
        self.orders.iter().filter(|o| o.pay_nos.len() > 1).count()
    }

    /// The generic channel's body of one delivery.
    fn body(&self, d: &Delivery) -> Value {
        let order = &self.orders[d.order];
        json!({"pay_no": order.pay_nos[d.pay], "order_no": order.order_no, "amount": order.amount, "status": "SUCCESS"})
    }

    fn context(&self, label: &str) -> String {
        format!("{label} storm, seed {:#x} (replay with PAYONCE_STORM_SEED={:#x})", self.seed, self.seed)
    }

    /// Delivers every delivery of the list from `THREADS` threads, each
    /// taking the next one off a shared atomic index.
    fn run(&self, deliver: impl Fn(&Delivery) -> Answer + Sync) -> Ran {
        let start = Instant::now();
        let timed = in_parallel(self.deliveries.len(), |i| {
            // Not a sleep and no ordering: offer the core to the next thread
            // so that more deliveries are in flight at once (about twice the
            // overlapping pairs on two cores).
            thread::yield_now();
            let begin = start.elapsed();
            let answer = deliver(&self.deliveries[i]);
            (answer, begin, start.elapsed())
        });
        let elapsed = start.elapsed();
        // Pairs of deliveries of one order that were in flight at the same time.
        let mut of_order: HashMap<usize, Vec<usize>> = HashMap::new();
        for (i, d) in self.deliveries.iter().enumerate() {
            of_order.entry(d.order).or_default().push(i);
        }
        let (mut same_pay, mut cross_channel) = (0, 0);
        for list in of_order.values() {
            for (n, &i) in list.iter().enumerate() {
                for &j in &list[n + 1..] {
                    if timed[i].1 < timed[j].2 && timed[j].1 < timed[i].2 {
                        if self.deliveries[i].pay == self.deliveries[j].pay {
                            same_pay += 1;
                        } else {
                            cross_channel += 1;
                        }
                    }
                }
            }
        }
        Ran { answers: timed.into_iter().map(|t| t.0).collect(), elapsed, same_pay, cross_channel }
    }
}

/// A finished storm: the answers in list order, the wall time, and how many
/// pairs of deliveries of one order were in flight together.
struct Ran {
    answers: Vec<Answer>,
    elapsed: Duration,
    same_pay: usize,
    cross_channel: usize,
}

/// `f(0..n)` on `THREADS` threads pulling indexes off one atomic counter;
/// results in index order. After a worker panics the others stop taking
/// work, and the first panic is re-raised with its message.
fn in_parallel<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    /// Sets the flag when its worker unwinds.
    struct StopOnPanic<'a>(&'a AtomicBool);
    impl Drop for StopOnPanic<'_> {
        fn drop(&mut self) {
            if thread::panicking() {
                self.0.store(true, Ordering::SeqCst);
            }
        }
    }
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let chunks: Vec<Vec<(usize, T)>> = thread::scope(|scope| {
        let workers: Vec<_> = (0..THREADS)
            .map(|_| {
                scope.spawn(|| {
                    let _stop = StopOnPanic(&stop);
                    let mut done = Vec::new();
                    while !stop.load(Ordering::SeqCst) {
                        let i = next.fetch_add(1, Ordering::SeqCst);
                        if i >= n {
                            break;
                        }
                        done.push((i, f(i)));
                    }
                    done
                })
            })
            .collect();
        let mut results = Vec::new();
        let mut panic = None;
        for worker in workers {
            match worker.join() {
                Ok(done) => results.push(done),
                Err(payload) => panic = panic.or(Some(payload)),
            }
        }
        if let Some(payload) = panic {
            std::panic::resume_unwind(payload);
        }
        results
    });
    let mut slots: Vec<Option<T>> = (0..n).map(|_| None).collect();
    for (i, value) in chunks.into_iter().flatten() {
        slots[i] = Some(value);
    }
    slots.into_iter().enumerate().map(|(i, v)| v.unwrap_or_else(|| panic!("item {i} was never run"))).collect()
}

fn seed(default: u64) -> u64 {
    match std::env::var("PAYONCE_STORM_SEED") {
        Ok(text) => {
            let text = text.trim();
            let parsed = match text.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => text.parse(),
            };
            parsed.unwrap_or_else(|_| panic!("PAYONCE_STORM_SEED={text:?} is not a number"))
        }
        Err(_) => default,
    }
}

fn report(label: &str, storm: &Storm, ran: &Ran) {
    let secs = ran.elapsed.as_secs_f64();
    let n = storm.deliveries.len();
    println!(
        "{label} storm: {n} deliveries in {secs:.2} s = {:.0} deliveries/s ({} orders, {} second-channel payments, seed {:#x})",
        n as f64 / secs.max(1e-9),
        storm.orders.len(),
        storm.second_channel_payments(),
        storm.seed
    );
    println!(
        "{label} storm: overlaps: {} pairs of deliveries of one pay_no and {} pairs across channels were in flight together",
        ran.same_pay, ran.cross_channel
    );
    // Not a timing claim, a guard: a storm that never overlapped tested nothing.
    assert!(
        ran.same_pay + ran.cross_channel > 0,
        "{}: no two deliveries of one order were ever in flight together",
        storm.context(label)
    );
}

// ---- what the database holds, however it was read ----

#[derive(Debug, Default)]
struct OrderView {
    status: String,
    pay_no: Option<String>,
    /// (pay_no, outcome, decided)
    payments: Vec<(String, String, bool)>,
    /// (coupon_template_id, status)
    coupons: Vec<(String, String)>,
    /// (point_type, points)
    points: Vec<(String, i64)>,
}

#[derive(Debug)]
struct EventView {
    seq: i64,
    event_type: String,
    event_id: String,
    order_no: String,
    /// `data.payment.pay_no` and `data.payment.outcome`.
    payment_pay_no: Option<String>,
    payment_outcome: Option<String>,
}

impl EventView {
    fn new(seq: i64, event_type: String, event_id: String, order_no: String, data: &Value) -> EventView {
        let field = |name: &str| data["payment"][name].as_str().map(str::to_owned);
        EventView {
            seq,
            event_type,
            event_id,
            order_no,
            payment_pay_no: field("pay_no"),
            payment_outcome: field("outcome"),
        }
    }
}

#[derive(Debug, Default)]
struct DbView {
    orders: BTreeMap<String, OrderView>,
    events: Vec<EventView>,
}

/// The database through the library's own reads: `app.order` for each order
/// and `app.events` page by page.
fn view_of_app(app: &App, storm: &Storm) -> DbView {
    let mut view = DbView::default();
    for order in &storm.orders {
        let detail = app
            .orders()
            .order(&order.order_no)
            .unwrap_or_else(|e| panic!("app.orders().order({}): {e}", order.order_no));
        view.orders.insert(
            order.order_no.clone(),
            OrderView {
                status: detail.order.status.as_str().to_owned(),
                pay_no: detail.order.pay_no.clone(),
                payments: detail
                    .payments
                    .iter()
                    .map(|p| (p.pay_no.clone(), p.outcome.as_str().to_owned(), p.decided))
                    .collect(),
                coupons: detail.coupons.iter().map(|c| (c.coupon_template_id.clone(), c.status.clone())).collect(),
                points: detail.points.iter().map(|p| (p.point_type.clone(), p.points)).collect(),
            },
        );
    }
    let mut after = 0;
    loop {
        let page = app.orders().events(after, 100).unwrap_or_else(|e| panic!("app.orders().events({after}): {e}"));
        let Some(last) = page.last() else { break };
        after = last.seq;
        view.events
            .extend(page.into_iter().map(|e| EventView::new(e.seq, e.event_type, e.event_id, e.order_no, &e.data)));
    }
    view
}

/// The database file read directly, read-only, in one snapshot: every row
/// of the tables a payment touches, so stray rows of any order show too.
fn view_of_file(db: &Path) -> DbView {
    use rusqlite::{Connection, OpenFlags, Row};
    fn all<T>(tx: &rusqlite::Transaction, sql: &str, f: impl Fn(&Row) -> rusqlite::Result<T>) -> Vec<T> {
        let mut stmt = tx.prepare(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
        let rows = stmt.query_map([], |r| f(r)).unwrap_or_else(|e| panic!("{sql}: {e}"));
        rows.collect::<Result<_, _>>().unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
    let mut conn = Connection::open_with_flags(db, OpenFlags::SQLITE_OPEN_READ_ONLY)
        .unwrap_or_else(|e| panic!("open {} read-only: {e}", db.display()));
    let tx = conn.transaction().expect("read transaction");
    let mut view = DbView::default();
    for (order_no, status, pay_no) in all(&tx, "SELECT order_no, status, pay_no FROM orders ORDER BY id", |r| {
        Ok((r.get::<_, String>(0)?, r.get(1)?, r.get(2)?))
    }) {
        view.orders.insert(order_no, OrderView { status, pay_no, ..OrderView::default() });
    }
    fn order<'v>(orders: &'v mut BTreeMap<String, OrderView>, order_no: &str) -> &'v mut OrderView {
        orders.get_mut(order_no).unwrap_or_else(|| panic!("a row names order {order_no}, which does not exist"))
    }
    let payments = all(
        &tx,
        "SELECT o.order_no, p.pay_no, p.outcome, p.state FROM pay_callback_log p JOIN orders o ON o.id = p.order_id ORDER BY p.id",
        |r| Ok((r.get::<_, String>(0)?, r.get(1)?, r.get(2)?, r.get::<_, String>(3)? == "decided")),
    );
    for (order_no, pay_no, outcome, decided) in payments {
        order(&mut view.orders, &order_no).payments.push((pay_no, outcome, decided));
    }
    let coupons = all(
        &tx,
        "SELECT o.order_no, c.coupon_template_id, c.status FROM user_coupon c JOIN orders o ON o.id = c.order_id ORDER BY c.id",
        |r| Ok((r.get::<_, String>(0)?, r.get(1)?, r.get(2)?)),
    );
    for (order_no, template, status) in coupons {
        order(&mut view.orders, &order_no).coupons.push((template, status));
    }
    let points = all(
        &tx,
        "SELECT o.order_no, p.point_type, p.points FROM point_log p JOIN orders o ON o.id = p.order_id ORDER BY p.id",
        |r| Ok((r.get::<_, String>(0)?, r.get(1)?, r.get(2)?)),
    );
    for (order_no, point_type, n) in points {
        order(&mut view.orders, &order_no).points.push((point_type, n));
    }
    let events = all(&tx, "SELECT seq, type, event_id, order_no, data FROM outbox_event ORDER BY seq", |r| {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get::<_, String>(4)?))
    });
    for (seq, event_type, event_id, order_no, data) in events {
        let data: Value =
            serde_json::from_str(&data).unwrap_or_else(|e| panic!("event data is not JSON ({e}): {data}"));
        view.events.push(EventView::new(seq, event_type, event_id, order_no, &data));
    }
    drop(tx);
    view
}

// ---- the verifier ----

/// Checks a finished storm from its answers and from the database.
fn verify(label: &str, storm: &Storm, answers: &[Answer], db: &DbView) {
    let ctx = storm.context(label);
    assert_eq!(answers.len(), storm.deliveries.len(), "{ctx}: one answer per delivery");

    // Answers: per pay_no exactly one decided answer; every other delivery
    // of that pay_no is `duplicate` naming the decided outcome.
    let mut by_pay: HashMap<&str, Vec<&Answer>> = HashMap::new();
    for (d, answer) in storm.deliveries.iter().zip(answers) {
        by_pay.entry(storm.pay_no(d)).or_default().push(answer);
    }
    let mut decided: HashMap<&str, &str> = HashMap::new();
    for (pay_no, list) in &by_pay {
        let fresh: Vec<&&Answer> = list.iter().filter(|a| a.outcome != "duplicate").collect();
        assert_eq!(fresh.len(), 1, "{ctx}: pay_no {pay_no} got {} non-duplicate answers: {list:?}", fresh.len());
        let first = fresh[0];
        assert!(
            first.outcome == "applied" || first.outcome == "already_paid",
            "{ctx}: pay_no {pay_no} was decided {:?}; a payment of a PENDING order at its amount is applied or already_paid",
            first.outcome
        );
        assert_eq!(first.original, None, "{ctx}: pay_no {pay_no}: a decided answer carries no \"original\"");
        for answer in list.iter().filter(|a| a.outcome == "duplicate") {
            assert_eq!(
                answer.original.as_deref(),
                Some(first.outcome.as_str()),
                "{ctx}: pay_no {pay_no}: a duplicate must name the outcome recorded first; answers {list:?}"
            );
        }
        decided.insert(pay_no, first.outcome.as_str());
    }
    let applied_total = decided.values().filter(|o| **o == "applied").count();
    assert_eq!(applied_total, storm.orders.len(), "{ctx}: answers `applied` in all, one per order");

    // The database: every order PAID by exactly one of its payments, rewards once.
    assert_eq!(db.orders.len(), storm.orders.len(), "{ctx}: orders in the database");
    let mut winner_of: HashMap<&str, &str> = HashMap::new();
    let mut losers: HashMap<&str, &str> = HashMap::new(); // losing pay_no -> order_no
    for order in &storm.orders {
        let no = order.order_no.as_str();
        let winners: Vec<&str> =
            order.pay_nos.iter().map(String::as_str).filter(|p| decided.get(p) == Some(&"applied")).collect();
        assert_eq!(winners.len(), 1, "{ctx}: order {no}: applied answers for {winners:?} of {:?}", order.pay_nos);
        let winner = winners[0];
        winner_of.insert(no, winner);
        for loser in order.pay_nos.iter().filter(|p| p.as_str() != winner) {
            losers.insert(loser, no);
        }

        let view = db.orders.get(no).unwrap_or_else(|| panic!("{ctx}: order {no} is missing"));
        assert_eq!(view.status, "PAID", "{ctx}: order {no}: {view:?}");
        assert_eq!(
            view.pay_no.as_deref(),
            Some(winner),
            "{ctx}: order {no} is paid by another pay_no than the one answered `applied`"
        );

        let mut payments = view.payments.clone();
        payments.sort();
        let mut expected: Vec<(String, String, bool)> = order
            .pay_nos
            .iter()
            .map(|p| (p.clone(), if p == winner { "applied" } else { "already_paid" }.to_owned(), true))
            .collect();
        expected.sort();
        assert_eq!(payments, expected, "{ctx}: order {no}: pay_callback_log rows (pay_no, outcome, decided)");

        let mut coupons = view.coupons.clone();
        coupons.sort();
        let expected: Vec<(String, String)> = COUPONS.iter().map(|t| (t.to_string(), "ACTIVE".to_owned())).collect();
        assert_eq!(coupons, expected, "{ctx}: order {no}: coupons, exactly one per template");

        let points = order.amount * POINTS_PER_YUAN / 100;
        assert_eq!(
            view.points,
            vec![("ORDER_PAID".to_owned(), points)],
            "{ctx}: order {no}: exactly one ORDER_PAID point entry"
        );
    }
    assert_eq!(losers.len(), storm.second_channel_payments(), "{ctx}: one losing payment per second-channel order");

    // Events: one `order.paid` per order, one `payment.refund_required` per
    // losing payment, nothing else.
    let mut paid: HashMap<&str, usize> = HashMap::new();
    let mut refund_required: HashMap<String, usize> = HashMap::new();
    for pair in db.events.windows(2) {
        assert!(pair[0].seq < pair[1].seq, "{ctx}: event seq not increasing: {} then {}", pair[0].seq, pair[1].seq);
    }
    for event in &db.events {
        match event.event_type.as_str() {
            "order.paid" => {
                let no = event.order_no.as_str();
                let winner =
                    winner_of.get(no).unwrap_or_else(|| panic!("{ctx}: order.paid for unknown order: {event:?}"));
                assert_eq!(event.event_id, format!("order.paid:{no}"), "{ctx}: {event:?}");
                assert_eq!(
                    event.payment_pay_no.as_deref(),
                    Some(*winner),
                    "{ctx}: order.paid names another payment: {event:?}"
                );
                assert_eq!(event.payment_outcome.as_deref(), Some("applied"), "{ctx}: {event:?}");
                *paid.entry(no).or_default() += 1;
            }
            "payment.refund_required" => {
                let pay_no = event.payment_pay_no.as_deref().unwrap_or_default();
                let order_no = losers.get(pay_no).unwrap_or_else(|| {
                    panic!("{ctx}: payment.refund_required for a payment that did not lose: {event:?}")
                });
                assert_eq!(event.order_no, *order_no, "{ctx}: {event:?}");
                assert_eq!(event.event_id, format!("payment.refund_required:{pay_no}"), "{ctx}: {event:?}");
                assert_eq!(event.payment_outcome.as_deref(), Some("already_paid"), "{ctx}: {event:?}");
                *refund_required.entry(pay_no.to_owned()).or_default() += 1;
            }
            other => panic!("{ctx}: unexpected event type {other:?}: {event:?}"),
        }
    }
    for order in &storm.orders {
        let n = paid.get(order.order_no.as_str()).copied().unwrap_or(0);
        assert_eq!(n, 1, "{ctx}: order {}: order.paid events", order.order_no);
    }
    for loser in losers.keys() {
        let n = refund_required.get(*loser).copied().unwrap_or(0);
        assert_eq!(n, 1, "{ctx}: pay_no {loser}: payment.refund_required events");
    }
    assert_eq!(db.events.len(), storm.orders.len() + storm.second_channel_payments(), "{ctx}: events in all");
}

// ---- in process ----

fn rewards_config() -> Config {
    Config {
        rewards: Rewards {
            coupon_templates: COUPONS.iter().map(|t| t.to_string()).collect(),
            points_per_yuan: POINTS_PER_YUAN,
        },
        ..Default::default()
    }
}

/// Creates the storm's orders and runs it on an [`App`] opened on `db`,
/// verified through the app's own reads; returns the answers.
fn in_process_storm(label: &str, db: &str, storm: &Storm) -> Vec<Answer> {
    let ctx = storm.context(label);
    let app = App::open(db, Clock::manual(1_700_000_000_000), rewards_config())
        .unwrap_or_else(|e| panic!("{ctx}: open {db}: {e}"));
    in_parallel(storm.orders.len(), |i| {
        let order = &storm.orders[i];
        let create = CreateOrder {
            order_no: order.order_no.clone(),
            user_id: order.user_id.clone(),
            amount: order.amount,
            currency: "CNY".into(),
            expires_in_s: None,
        };
        let (_, created) =
            app.orders().create_order(&create).unwrap_or_else(|e| panic!("{ctx}: create {}: {e}", order.order_no));
        assert!(created, "{ctx}: order {} existed before", order.order_no);
    });

    let ran = storm.run(|d| {
        let order = &storm.orders[d.order];
        let callback = PaymentCallback {
            channel: "generic".into(),
            pay_no: order.pay_nos[d.pay].clone(),
            order_no: order.order_no.clone(),
            amount: order.amount,
            currency: None,
            status: PlatformStatus::Success,
            paid_at: None,
            raw_body: storm.body(d).to_string().into_bytes(),
        };
        let reply = app
            .payments()
            .deliver_payment(&callback)
            .unwrap_or_else(|e| panic!("{ctx}: deliver {} of {}: {e}", callback.pay_no, callback.order_no));
        let original = match reply.outcome {
            payonce::app::PaymentReplyOutcome::Duplicate { original } => Some(original.as_str().to_owned()),
            payonce::app::PaymentReplyOutcome::Decided(_) => None,
        };
        Answer { outcome: reply.outcome_str().to_owned(), original }
    });
    report(label, storm, &ran);

    let locks = app.locks().len();
    println!("{label} storm: keyed-lock map size after the storm = {locks}");
    assert_eq!(locks, 0, "{ctx}: the keyed-lock map keeps {locks} entries after every request finished");

    verify(label, storm, &ran.answers, &view_of_app(&app, storm));
    ran.answers
}

#[test]
fn storm_in_process_on_memdb() {
    let storm = Storm::new(seed(0x5EED_0001), ORDERS_MEMDB);
    in_process_storm("memdb", ":memory:", &storm);
}

// ---- over HTTP ----

fn create_orders_http(ctx: &str, storm: &Storm, servers: &[&Server]) {
    in_parallel(storm.orders.len(), |i| {
        let order = &storm.orders[i];
        let server = servers[i % servers.len()];
        let body = json!({"order_no": order.order_no, "user_id": order.user_id, "amount": order.amount});
        let response = server.post_json("/v1/orders", &body);
        assert_eq!(response.status, 201, "{ctx}: create {}: {}", order.order_no, response.text());
    });
}

/// Sends one signed delivery and reads the platform-facing answer. A 503
/// `database_busy` (nothing recorded) is re-sent as the platform would.
fn deliver_http(ctx: &str, server: &Server, body: &Value, busy: &AtomicUsize) -> Answer {
    for _ in 0..=BUSY_RETRIES_MAX {
        let response = server.callback("/v1/callbacks/generic", body);
        if response.status == 503 {
            assert_eq!(response.error_code(), "database_busy", "{ctx}: {body}: {}", response.text());
            busy.fetch_add(1, Ordering::SeqCst);
            continue;
        }
        assert_eq!(response.status, 200, "{ctx}: {body}: {}", response.text());
        let json = response.json();
        assert_eq!(json["code"], "SUCCESS", "{ctx}: {body}: {json}");
        return Answer {
            outcome: json["outcome"].as_str().unwrap_or_else(|| panic!("{ctx}: no outcome in {json}")).to_owned(),
            original: json.get("original").map(|o| o.as_str().unwrap_or_else(|| panic!("{ctx}: {json}")).to_owned()),
        };
    }
    panic!("{ctx}: {body}: still 503 database_busy after {BUSY_RETRIES_MAX} retries");
}

#[test]
fn storm_over_http() {
    let storm = Storm::new(seed(0x5EED_0003), ORDERS_HTTP);
    let ctx = storm.context("http");
    let server = Server::start(&SERVE_FLAGS);
    create_orders_http(&ctx, &storm, &[&server]);

    let busy = AtomicUsize::new(0);
    let ran = storm.run(|d| deliver_http(&ctx, &server, &storm.body(d), &busy));
    report("http", &storm, &ran);
    println!("http storm: {} re-sends after 503 database_busy", busy.load(Ordering::SeqCst));

    verify("http", &storm, &ran.answers, &view_of_file(&server.db));
    spot_check_api(&ctx, &storm, &server);
}

/// The API reads what the file holds: one order with two payments, via
/// `GET /v1/orders/{order_no}`.
fn spot_check_api(ctx: &str, storm: &Storm, server: &Server) {
    let Some(order) = storm.orders.iter().find(|o| o.pay_nos.len() > 1) else {
        return;
    };
    let response = server.get(&format!("/v1/orders/{}", order.order_no));
    assert_eq!(response.status, 200, "{ctx}: {}", response.text());
    let detail = response.json();
    assert_eq!(detail["status"], "PAID", "{ctx}: {detail}");
    let count = |key: &str| detail[key].as_array().map(Vec::len);
    assert_eq!(count("payments"), Some(2), "{ctx}: {detail}");
    assert_eq!(count("coupons"), Some(2), "{ctx}: {detail}");
    assert_eq!(count("points"), Some(1), "{ctx}: {detail}");
}

// ---- the conformance suite: the same storms on each engine ----

/// The database after a storm: on SQLite the file read from outside
/// payonce; on PostgreSQL through a new process's own reads (a new App on
/// the same database, so nothing is answered from the storm's memory).
fn view_of_db(db: &crate::engines::Db, storm: &Storm) -> DbView {
    match db.sqlite_file() {
        Some(file) => view_of_file(&file),
        None => {
            let app = App::open(&db.spec, Clock::manual(1_700_000_000_000), rewards_config())
                .unwrap_or_else(|e| panic!("{}: reopen: {e}", db.label()));
            view_of_app(&app, storm)
        }
    }
}

/// `processes` servers on one database; each delivery goes to one of them.
fn storm_across(db: &crate::engines::Db, processes: usize, seed_default: u64) {
    let storm = Storm::new(seed(seed_default), ORDERS_TWO_PROCESSES);
    let label = format!("{}, {processes} processes", db.label());
    let ctx = storm.context(&label);
    let servers: Vec<Server> = (0..processes).map(|_| db.serve(&SERVE_FLAGS)).collect();
    let refs: Vec<&Server> = servers.iter().collect();
    create_orders_http(&ctx, &storm, &refs);

    let busy = AtomicUsize::new(0);
    // d.target picks one of two; the order spreads those pairs over every process.
    let ran = storm.run(|d| deliver_http(&ctx, refs[(d.target + 2 * d.order) % processes], &storm.body(d), &busy));
    report(&label, &storm, &ran);
    println!("{label} storm: {} re-sends after 503 database_busy", busy.load(Ordering::SeqCst));
    verify(&label, &storm, &ran.answers, &view_of_db(db, &storm));
    for server in &refs {
        spot_check_api(&ctx, &storm, server);
    }
}

for_each_engine! {
    /// Many threads of one process, each delivery through the library.
    fn storm_in_process_conformance(db) {
        let storm = Storm::new(seed(0x5EED_0011), ORDERS_IN_PROCESS);
        let answers = in_process_storm(db.label(), &db.spec, &storm);
        verify(&format!("{} (read afresh)", db.label()), &storm, &answers, &view_of_db(db, &storm));
    }

    /// Two `payonce serve` on one database, deliveries of one pay_no split between them.
    fn storm_two_processes(db) {
        storm_across(db, 2, 0x5EED_0012);
    }

    /// Four `payonce serve` on one database.
    fn storm_four_processes(db) {
        storm_across(db, 4, 0x5EED_0013);
    }
}
