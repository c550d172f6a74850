//! The incident payonce exists to prevent (ARCHITECTURE.md), replayed
//! deterministically.
//!
//! A deliberately naive payment handler lives only in this file. Each of its
//! three defenses can be switched off on its own; a small scheduler drives two
//! deliveries through it with fail points (hooks at named places) and
//! channels, never sleeps, so every interleaving below is the same on every
//! run. The table test shows which defense, alone, stops which form of
//! duplicate, and that payonce's own `deliver_payment` stops all of them
//! (ENGINEERING.md: "Every defense layer is proven alone").
//!
//! Why a copy of the handler and not payonce itself: payonce cannot be
//! configured into the incident (its key guard drops after commit by scope
//! order, on purpose), so the broken variants have to be written out here.

use crate::util::TempDir;
use payonce::app::PaymentReplyOutcome;
use payonce::keylock::KeyedLocks;
use payonce::store::{StoreOptions, Synchronous, SCHEMA_SQL};
use payonce::{App, Clock, Config, CreateOrder, PaymentCallback, PlatformStatus, Rewards};
use rusqlite::{params, Connection};
use std::fmt;
use std::path::Path;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

/// A whole scenario must finish within this; a hang fails the test instead
/// of blocking the suite.
const SCENARIO_DEADLINE: Duration = Duration::from_secs(30);
/// One wait for a fail point or a "go"; shorter than the deadline so a stuck
/// worker reports where it stuck.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);
/// SQLite's busy handler: B's BEGIN IMMEDIATE waits here while A, paused
/// before COMMIT, still holds the write lock.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

const ORDER_NO: &str = "ORD-INCIDENT";
const USER_ID: &str = "u-incident";
const AMOUNT: i64 = 9_900;
/// 9 900 minor units at 1 point per yuan.
const POINTS: i64 = 99;
const COUPON_TEMPLATE: &str = "NEW10";
const NOW: &str = "2024-01-01T00:00:00.000Z";

/// The side-effect unique keys the `unique_indexes` defense consists of.
const SIDE_EFFECT_INDEXES: [&str; 5] =
    ["uk_order_tpl", "uk_order_type", "uk_event_id", "uk_pay_no", "uk_applied_order"];

// ---------------------------------------------------------------------------
// The naive handler and its switchable defenses
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Defenses {
    /// On: the keyed lock (key = pay_no) drops after COMMIT. Off: it is
    /// released in a `finally`-like position just before COMMIT (the incident).
    lock_until_commit: bool,
    /// On: status read, CAS and its affected-row check inside one BEGIN
    /// IMMEDIATE. Off: status read before BEGIN IMMEDIATE, row count ignored.
    cas_in_immediate_tx: bool,
    /// On: the side-effect unique indexes exist and inserts say ON CONFLICT
    /// DO NOTHING. Off: a schema copy without them, plain INSERTs.
    unique_indexes: bool,
}

const NONE: Defenses = Defenses { lock_until_commit: false, cas_in_immediate_tx: false, unique_indexes: false };
const LOCK_ONLY: Defenses = Defenses { lock_until_commit: true, ..NONE };
const CAS_ONLY: Defenses = Defenses { cas_in_immediate_tx: true, ..NONE };
const UNIQUE_ONLY: Defenses = Defenses { unique_indexes: true, ..NONE };
const ALL: Defenses = Defenses { lock_until_commit: true, cas_in_immediate_tx: true, unique_indexes: true };

impl fmt::Display for Defenses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let on: Vec<&str> = [
            (self.lock_until_commit, "lock_until_commit"),
            (self.cas_in_immediate_tx, "cas_in_immediate_tx"),
            (self.unique_indexes, "unique_indexes"),
        ]
        .into_iter()
        .filter_map(|(enabled, name)| enabled.then_some(name))
        .collect();
        match on.len() {
            0 => f.write_str("none (the incident)"),
            1 => write!(f, "{} only", on[0]),
            3 => f.write_str("all three"),
            _ => f.write_str(&on.join(" + ")),
        }
    }
}

/// The fail points of the naive handler, in the order one delivery passes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Point {
    BeforeKeyLock,
    AfterStatusRead,
    BeforeBeginImmediate,
    AfterEffectsBeforeCommit,
    /// Only when `lock_until_commit` is off.
    AfterLockRelease,
    /// Every path passes it, right before COMMIT.
    BeforeCommit,
}

/// One payment notification.
#[derive(Clone, Debug)]
struct Delivery {
    pay_no: String,
    order_no: String,
    amount: i64,
}

/// What the naive handler believed it did (the database may have disagreed:
/// with only the unique indexes on, it "applies" and the indexes swallow it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Decision {
    Applied,
    StoppedByStatusCheck,
    StoppedByRowCount,
}

/// The incident's handler with its defenses on switches. `hook` is called at
/// each fail point, so a test can pause the delivery exactly there.
fn naive_deliver(
    conn: &Connection,
    locks: &KeyedLocks,
    defenses: Defenses,
    delivery: &Delivery,
    hook: &dyn Fn(Point),
) -> rusqlite::Result<Decision> {
    hook(Point::BeforeKeyLock);
    let key = locks.lock(payonce::keylock::LockKey::Pay(&delivery.pay_no));

    // The incident's mistake on SQLite: the check reads the last committed
    // state, outside the write transaction that acts on it.
    let status_read_outside = if defenses.cas_in_immediate_tx {
        None
    } else {
        let order = read_order(conn, &delivery.order_no)?;
        hook(Point::AfterStatusRead);
        Some(order)
    };

    hook(Point::BeforeBeginImmediate);
    conn.execute_batch("BEGIN IMMEDIATE")?;
    let (order_id, status) = match status_read_outside {
        Some(order) => order,
        None => {
            let order = read_order(conn, &delivery.order_no)?;
            hook(Point::AfterStatusRead);
            order
        }
    };

    let decision = if status != "PENDING" {
        Decision::StoppedByStatusCheck
    } else {
        let changed = conn.execute(
            "UPDATE orders SET status = 'PAID', pay_no = ?2, paid_at = ?3 WHERE id = ?1 AND status = 'PENDING'",
            params![order_id, delivery.pay_no, NOW],
        )?;
        if defenses.cas_in_immediate_tx && changed == 0 {
            Decision::StoppedByRowCount
        } else {
            // With the defense off the count is ignored, as in the incident.
            Decision::Applied
        }
    };

    let on_conflict = if defenses.unique_indexes { " ON CONFLICT DO NOTHING" } else { "" };
    let (outcome, rewards_due) = match decision {
        Decision::Applied => ("applied", Some(format!(r#"{{"coupons":["{COUPON_TEMPLATE}"],"points":{POINTS}}}"#))),
        Decision::StoppedByStatusCheck | Decision::StoppedByRowCount => ("already_paid", None),
    };
    conn.execute(
        &format!(
            "INSERT INTO pay_callback_log
                 (pay_no, channel, order_id, amount, status, outcome, state, source, raw_body,
                  received_at, decided_at, rewards_due)
             VALUES (?1, 'generic', ?2, ?3, 'SUCCESS', ?4, 'decided', 'callback', ?5, ?6, ?6, ?7){on_conflict}"
        ),
        params![delivery.pay_no, order_id, delivery.amount, outcome, b"{}".as_slice(), NOW, rewards_due],
    )?;
    if decision == Decision::Applied {
        conn.execute(
            &format!(
                "INSERT INTO user_coupon (user_id, order_id, coupon_template_id, status, created_at)
                 VALUES (?1, ?2, ?3, 'ACTIVE', ?4){on_conflict}"
            ),
            params![USER_ID, order_id, COUPON_TEMPLATE, NOW],
        )?;
        conn.execute(
            &format!(
                "INSERT INTO point_log (user_id, order_id, point_type, points, created_at)
                 VALUES (?1, ?2, 'ORDER_PAID', ?3, ?4){on_conflict}"
            ),
            params![USER_ID, order_id, POINTS, NOW],
        )?;
        conn.execute(
            &format!(
                "INSERT INTO outbox_event (event_id, type, order_no, data, created_at)
                 VALUES ('order.paid:' || ?1, 'order.paid', ?1, '{{}}', ?2){on_conflict}"
            ),
            params![delivery.order_no, NOW],
        )?;
    }
    hook(Point::AfterEffectsBeforeCommit);

    if !defenses.lock_until_commit {
        // The incident: `finally { lock.unlock() }` runs before the commit.
        drop(key);
        hook(Point::AfterLockRelease);
    }
    hook(Point::BeforeCommit);
    conn.execute_batch("COMMIT")?;
    // With lock_until_commit on, `key` drops here: after the commit.
    Ok(decision)
}

fn read_order(conn: &Connection, order_no: &str) -> rusqlite::Result<(i64, String)> {
    conn.query_row("SELECT id, status FROM orders WHERE order_no = ?1", [order_no], |r| Ok((r.get(0)?, r.get(1)?)))
}

/// payonce's schema without the side-effect unique indexes. Panics when one
/// of them is not found, so a renamed index cannot silently turn this
/// defense "off" in a test that believes it is on, or vice versa.
fn schema_without_side_effect_indexes() -> String {
    let mut schema = SCHEMA_SQL.to_owned();
    for name in SIDE_EFFECT_INDEXES {
        let head = format!("CREATE UNIQUE INDEX {name} ON ");
        assert_eq!(schema.matches(&head).count(), 1, "schema.sql must create {name} exactly once");
        let start = schema.find(&head).expect("counted above");
        let len = schema[start..].find(';').expect("CREATE INDEX statement ends with ';'") + 1;
        schema.replace_range(start..start + len, &format!("-- {name} removed by tests/it/incident.rs"));
    }
    schema
}

/// A connection to the scenario's file database. A file, not memory, and WAL:
/// two connections must really interleave, a reader must see the last commit
/// while a writer is open, and BEGIN IMMEDIATE must wait on the busy handler.
fn open_connection(path: &Path) -> Connection {
    let conn = Connection::open(path).expect("open scenario database");
    conn.busy_timeout(BUSY_TIMEOUT).expect("set busy_timeout");
    let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0)).expect("switch to WAL");
    assert_eq!(mode, "wal", "scenario database must run in WAL mode");
    // Speed only: nothing here survives the test.
    conn.pragma_update(None, "synchronous", "NORMAL").expect("set synchronous");
    conn.pragma_update(None, "foreign_keys", "ON").expect("enable foreign keys");
    conn
}

fn create_database(path: &Path, defenses: Defenses) {
    let conn = open_connection(path);
    let schema = if defenses.unique_indexes { SCHEMA_SQL.to_owned() } else { schema_without_side_effect_indexes() };
    conn.execute_batch(&schema).expect("apply schema");
    conn.execute(
        "INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at)
         VALUES (?1, ?2, ?3, 'CNY', 'PENDING', ?4, '2024-01-01T00:15:00.000Z')",
        params![ORDER_NO, USER_ID, AMOUNT, NOW],
    )
    .expect("create the order");
}

// ---------------------------------------------------------------------------
// The scheduler: three forms of duplicate, driven through fail points
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Form {
    /// Two deliveries of one pay_no start at the same time.
    Concurrent,
    /// The same pay_no again while the first holds its write transaction open
    /// (and, with lock_until_commit off, has already released its key).
    Redelivery40ms,
    /// Another pay_no for the same order (a second channel paid), arriving the
    /// same way as the redelivery.
    SecondChannel,
}

const FORMS: [Form; 3] = [Form::Concurrent, Form::Redelivery40ms, Form::SecondChannel];

impl Form {
    fn name(self) -> &'static str {
        match self {
            Form::Concurrent => "concurrent",
            Form::Redelivery40ms => "redelivery_40ms",
            Form::SecondChannel => "second_channel",
        }
    }

    fn pay_nos(self) -> [&'static str; 2] {
        match self {
            Form::Concurrent | Form::Redelivery40ms => ["PAY-A", "PAY-A"],
            Form::SecondChannel => ["PAY-A", "PAY-B"],
        }
    }
}

/// What a worker reports to the scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    At(Point),
    /// The worker returned or panicked.
    Finished,
}

#[derive(Clone, Copy, Debug)]
struct Event {
    worker: usize,
    step: Step,
}

/// Reports `Finished` when dropped, including while unwinding from a panic,
/// so the scheduler stops waiting for a worker that will never arrive.
struct FinishedOnDrop {
    worker: usize,
    events: Sender<Event>,
}

impl Drop for FinishedOnDrop {
    fn drop(&mut self) {
        let _ = self.events.send(Event { worker: self.worker, step: Step::Finished });
    }
}

/// The scheduler's record of events and the channel they arrive on.
struct Trace {
    events: Receiver<Event>,
    seen: Vec<Event>,
}

impl Trace {
    /// Waits until `worker` reaches `point` (or already has). Fails fast when
    /// that worker finishes without reaching it.
    fn wait_for(&mut self, worker: usize, point: Point) {
        let reached = |e: &Event| e.worker == worker && e.step == Step::At(point);
        let finished = |e: &Event| e.worker == worker && e.step == Step::Finished;
        loop {
            if self.seen.iter().any(reached) {
                return;
            }
            assert!(
                !self.seen.iter().any(finished),
                "worker {worker} finished before {point:?}; trace {:?}",
                self.seen
            );
            self.next();
        }
    }

    /// Waits until any worker reaches `point`; returns which one.
    fn wait_for_any(&mut self, point: Point) -> usize {
        loop {
            if let Some(e) = self.seen.iter().find(|e| e.step == Step::At(point)) {
                return e.worker;
            }
            assert!(
                !self.seen.iter().any(|e| e.step == Step::Finished),
                "a worker finished before any reached {point:?}; trace {:?}",
                self.seen
            );
            self.next();
        }
    }

    fn next(&mut self) {
        match self.events.recv_timeout(STEP_TIMEOUT) {
            Ok(event) => self.seen.push(event),
            Err(e) => panic!("no fail point reached within {STEP_TIMEOUT:?} ({e:?}); trace {:?}", self.seen),
        }
    }

    fn passed(&self, worker: usize, point: Point) -> bool {
        self.seen.iter().any(|e| e.worker == worker && e.step == Step::At(point))
    }
}

/// The database after a scenario.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Effects {
    coupons: i64,
    points_entries: i64,
    paid_events: i64,
    applied_payments: i64,
    order_status: String,
    order_pay_no: Option<String>,
}

fn read_effects(conn: &Connection) -> Effects {
    let count = |sql: &str| -> i64 { conn.query_row(sql, [], |r| r.get(0)).expect(sql) };
    let (order_status, order_pay_no) = conn
        .query_row("SELECT status, pay_no FROM orders WHERE order_no = ?1", [ORDER_NO], |r| Ok((r.get(0)?, r.get(1)?)))
        .expect("read the order back");
    Effects {
        coupons: count("SELECT count(*) FROM user_coupon WHERE coupon_template_id = 'NEW10'"),
        points_entries: count("SELECT count(*) FROM point_log WHERE point_type = 'ORDER_PAID'"),
        paid_events: count("SELECT count(*) FROM outbox_event WHERE type = 'order.paid'"),
        applied_payments: count("SELECT count(*) FROM pay_callback_log WHERE outcome = 'applied'"),
        order_status,
        order_pay_no,
    }
}

#[derive(Debug)]
struct NaiveRun {
    effects: Effects,
    /// The delivery that committed first.
    first_pay_no: String,
    decisions: [Decision; 2],
}

/// Runs two deliveries of `form` through the naive handler with `defenses`.
///
/// The schedule is the worst one the defenses allow. Whoever reaches
/// BeforeCommit first ("first") pauses there, holding SQLite's write lock
/// and, unless it already released it, its key. The other ("second") then
/// runs until it must block on something the first holds: the key (same
/// pay_no, key still held) or otherwise BEGIN IMMEDIATE. Only once the second
/// has announced that point is the first allowed to commit. So every read of
/// the second falls on a known side of the first's commit: before it when it
/// precedes that point, after it otherwise; the same on every run, and so is
/// the outcome. Announcing a point a moment before blocking is enough:
/// whether the second then blocks or arrives just after the commit, it sees
/// the same committed state.
fn run_naive(defenses: Defenses, form: Form) -> NaiveRun {
    let dir = TempDir::new("incident");
    let path = dir.path("incident.db");
    create_database(&path, defenses);

    let locks = Arc::new(KeyedLocks::new());
    let (event_tx, event_rx) = mpsc::channel::<Event>();
    let mut trace = Trace { events: event_rx, seen: Vec::new() };
    // Both workers of `concurrent` wait here, at BeforeKeyLock, so neither
    // takes the key before the other has arrived.
    let start = (form == Form::Concurrent).then(|| Arc::new(Barrier::new(2)));
    let pay_nos = form.pay_nos();

    let mut go = Vec::new();
    let mut spawn_worker = |worker: usize| {
        let (go_tx, go_rx) = mpsc::channel::<()>();
        go.push(go_tx);
        let conn = open_connection(&path);
        let locks = Arc::clone(&locks);
        let events = event_tx.clone();
        let start = start.clone();
        let delivery = Delivery { pay_no: pay_nos[worker].to_owned(), order_no: ORDER_NO.to_owned(), amount: AMOUNT };
        thread::spawn(move || {
            let _finished = FinishedOnDrop { worker, events: events.clone() };
            let hook = |point: Point| {
                // The scheduler may already have failed; the worker then just runs on.
                let _ = events.send(Event { worker, step: Step::At(point) });
                match point {
                    Point::BeforeKeyLock => {
                        if let Some(start) = &start {
                            start.wait();
                        }
                    }
                    Point::BeforeCommit => {
                        go_rx.recv_timeout(STEP_TIMEOUT).expect("the scheduler never allowed this commit");
                    }
                    _ => {}
                }
            };
            naive_deliver(&conn, &locks, defenses, &delivery, &hook).expect("naive delivery failed in SQL")
        })
    };

    let mut workers = vec![spawn_worker(0)];
    if form == Form::Concurrent {
        workers.push(spawn_worker(1));
    }
    let first = trace.wait_for_any(Point::BeforeCommit);
    if form != Form::Concurrent {
        // The redelivery / second channel arrives now: the first is between
        // its side effects (and, lock off, its key release) and its COMMIT.
        assert_eq!(first, 0);
        workers.push(spawn_worker(1));
    }
    let second = 1 - first;
    let first_holds_key = !trace.passed(first, Point::AfterLockRelease);
    let blocks_on_key = first_holds_key && pay_nos[first] == pay_nos[second];
    trace.wait_for(second, if blocks_on_key { Point::BeforeKeyLock } else { Point::BeforeBeginImmediate });
    // Let the first commit, and let the second's own commit through whenever it gets there.
    for g in &go {
        g.send(()).expect("worker waits for its go");
    }

    let mut decisions = Vec::new();
    for (worker, handle) in workers.into_iter().enumerate() {
        match handle.join() {
            Ok(decision) => decisions.push(decision),
            Err(panic) => panic!("worker {worker} panicked: {}", panic_text(&panic)),
        }
    }
    let effects = read_effects(&open_connection(&path));
    NaiveRun { effects, first_pay_no: pay_nos[first].to_owned(), decisions: [decisions[0], decisions[1]] }
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(non-string panic)".to_owned())
}

/// Runs `work` on its own thread and fails the test if it takes longer than
/// the deadline, so a scheduling mistake cannot hang the suite.
fn within_deadline<T: Send + 'static>(what: &str, work: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    let handle = thread::spawn(move || {
        let _ = tx.send(work());
    });
    match rx.recv_timeout(SCENARIO_DEADLINE) {
        Ok(value) => {
            let _ = handle.join();
            value
        }
        // The sender dropped without a value: the scenario panicked; show why.
        Err(RecvTimeoutError::Disconnected) => match handle.join() {
            Err(panic) => panic!("{what}: {}", panic_text(&panic)),
            Ok(()) => unreachable!("{what}: scenario neither answered nor panicked"),
        },
        Err(RecvTimeoutError::Timeout) => panic!("{what}: hung for {SCENARIO_DEADLINE:?}"),
    }
}

/// Replays `form` against the naive handler with `defenses` and asserts the
/// number of coupons issued; points, order.paid events and applied payment
/// records must match it, and the order changed state exactly once.
fn check(defenses: Defenses, form: Form, expected_coupons: i64) -> NaiveRun {
    let what = format!("naive handler, defenses: {defenses}, form: {}", form.name());
    let run = within_deadline(&what, move || run_naive(defenses, form));
    let e = &run.effects;
    assert_eq!(e.coupons, expected_coupons, "{what}: coupons; {run:?}");
    assert_eq!(e.points_entries, expected_coupons, "{what}: ORDER_PAID point entries; {run:?}");
    assert_eq!(e.paid_events, expected_coupons, "{what}: order.paid events; {run:?}");
    assert_eq!(e.applied_payments, expected_coupons, "{what}: applied payment records; {run:?}");
    // The incident's signature: the status changed once whatever the side effects did.
    assert_eq!(e.order_status, "PAID", "{what}");
    assert_eq!(e.order_pay_no.as_deref(), Some(run.first_pay_no.as_str()), "{what}: the first commit paid the order");
    assert!(run.decisions.contains(&Decision::Applied), "{what}: someone must apply the payment; {run:?}");
    run
}

fn verdict(coupons: i64) -> &'static str {
    if coupons == 1 {
        "stopped"
    } else {
        "duplicated"
    }
}

// ---------------------------------------------------------------------------
// payonce's own pipeline
// ---------------------------------------------------------------------------

/// How many times each form is replayed against payonce. Its interleavings
/// cannot be forced from outside, so a few rounds let the race go both ways.
const PAYONCE_ROUNDS: usize = 8;

#[derive(Debug)]
struct PayonceRun {
    /// Per round: the two replies, sorted.
    replies: Vec<[String; 2]>,
    coupons: Vec<usize>,
    points_entries: Vec<usize>,
    paid_events: Vec<usize>,
    refund_required_events: Vec<usize>,
}

fn payonce_config() -> Config {
    Config {
        rewards: Rewards { coupon_templates: vec![COUPON_TEMPLATE.to_owned()], points_per_yuan: 1 },
        ..Default::default()
    }
}

fn open_payonce(db: &str, clock: &Clock) -> App {
    let options = StoreOptions { synchronous: Synchronous::Normal, ..Default::default() };
    App::open_with(db, clock.clone(), payonce_config(), &options).expect("open payonce")
}

/// Replays `form` against payonce, two threads released by a barrier.
///
/// payonce has no window in which its key is free but its transaction open:
/// the guard drops after the commit by scope order. The nearest thing to
/// the redelivery and the second channel is a second instance on the same
/// file (the incident's "instance B"), whose key lock is a different map,
/// so only the database stands between the two. `concurrent` uses one
/// instance, as two worker threads of one process would.
fn run_payonce(form: Form, db: &str) -> PayonceRun {
    let clock = Clock::manual(1_700_000_000_000);
    let first = Arc::new(open_payonce(db, &clock));
    let second = if form == Form::Concurrent { Arc::clone(&first) } else { Arc::new(open_payonce(db, &clock)) };
    let mut run = PayonceRun {
        replies: Vec::new(),
        coupons: Vec::new(),
        points_entries: Vec::new(),
        paid_events: Vec::new(),
        refund_required_events: Vec::new(),
    };
    for round in 0..PAYONCE_ROUNDS {
        let order_no = format!("{ORDER_NO}-{round}");
        first
            .orders()
            .create_order(&CreateOrder {
                order_no: order_no.clone(),
                user_id: USER_ID.to_owned(),
                amount: AMOUNT,
                currency: "CNY".to_owned(),
                expires_in_s: None,
            })
            .expect("create order");
        let barrier = Arc::new(Barrier::new(2));
        let threads: Vec<_> = [&first, &second]
            .into_iter()
            .zip(form.pay_nos())
            .map(|(app, pay_no)| {
                let (app, barrier) = (Arc::clone(app), Arc::clone(&barrier));
                let callback = PaymentCallback {
                    channel: "generic".to_owned(),
                    pay_no: format!("{pay_no}-{round}"),
                    order_no: order_no.clone(),
                    amount: AMOUNT,
                    currency: None,
                    status: PlatformStatus::Success,
                    paid_at: None,
                    raw_body: b"{}".to_vec(),
                };
                thread::spawn(move || {
                    barrier.wait();
                    app.payments().deliver_payment(&callback).expect("payonce delivery")
                })
            })
            .collect();
        let mut replies: Vec<String> = threads
            .into_iter()
            .map(|t| match t.join() {
                Ok(reply) => match reply.outcome {
                    // `duplicate` alone would hide a wrong original outcome.
                    PaymentReplyOutcome::Duplicate { original } => format!("duplicate of {}", original.as_str()),
                    PaymentReplyOutcome::Decided(outcome) => outcome.as_str().to_owned(),
                },
                Err(panic) => panic!("payonce delivery thread panicked: {}", panic_text(&panic)),
            })
            .collect();
        replies.sort();
        run.replies.push([replies[0].clone(), replies[1].clone()]);

        let detail = first.orders().order(&order_no).expect("read order back");
        assert_eq!(detail.order.status.as_str(), "PAID", "{} round {round}", form.name());
        run.coupons.push(detail.coupons.len());
        run.points_entries.push(detail.points.iter().filter(|p| p.point_type == "ORDER_PAID").count());
        let events = first.orders().events(0, 1_000).expect("read events");
        let of_type = |t: &str| events.iter().filter(|e| e.order_no == order_no && e.event_type == t).count();
        run.paid_events.push(of_type("order.paid"));
        run.refund_required_events.push(of_type("payment.refund_required"));
    }
    run
}

/// payonce must stop `form` in every round: one coupon, one points entry,
/// one order.paid event, and the second delivery told why.
fn check_payonce(form: Form, db: &crate::engines::Db) -> PayonceRun {
    let what = format!("payonce deliver_payment on {}, form: {}", db.label(), form.name());
    let spec = db.spec.clone();
    let run = within_deadline(&what, move || run_payonce(form, &spec));
    let rounds = vec![1; PAYONCE_ROUNDS];
    assert_eq!(run.coupons, rounds, "{what}: coupons per round; {run:?}");
    assert_eq!(run.points_entries, rounds, "{what}: points entries per round; {run:?}");
    assert_eq!(run.paid_events, rounds, "{what}: order.paid events per round; {run:?}");
    let (expected_replies, refund_required) = match form {
        Form::Concurrent | Form::Redelivery40ms => (["applied", "duplicate of applied"], 0),
        // The second channel's money arrived for a paid order: refund it.
        Form::SecondChannel => (["already_paid", "applied"], 1),
    };
    for (round, replies) in run.replies.iter().enumerate() {
        assert_eq!(replies, &expected_replies.map(str::to_owned), "{what}: replies of round {round}");
    }
    assert_eq!(run.refund_required_events, vec![refund_required; PAYONCE_ROUNDS], "{what}: refund events; {run:?}");
    run
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

/// The truth table: which defense, alone, stops which form. A defense that
/// does not stop a form is asserted as not stopping it.
const TRUTH_TABLE: [(Defenses, [i64; 3]); 5] = [
    //            concurrent, redelivery_40ms, second_channel (coupons issued)
    (NONE, [2, 2, 2]),
    // The key is the pay_no: it cannot see a second pay_no for the same order.
    (LOCK_ONLY, [1, 1, 2]),
    // SQLite has one writer: a status read inside BEGIN IMMEDIATE sees every
    // earlier commit, whatever the key lock did.
    (CAS_ONLY, [1, 1, 1]),
    // The second delivery still believes it applied; the indexes swallow its writes.
    (UNIQUE_ONLY, [1, 1, 1]),
    (ALL, [1, 1, 1]),
];

#[test]
fn the_incident_happens_with_every_defense_off() {
    for form in FORMS {
        let run = check(NONE, form, 2);
        // Both deliveries passed the check: the order changed once, the side effects twice.
        assert_eq!(run.decisions, [Decision::Applied, Decision::Applied], "{}", form.name());
    }
}

#[test]
fn the_incident_needs_the_lock_released_before_commit() {
    // The exact incident: everything off. Holding the key until commit is
    // the one change that makes the same redelivery harmless, and the
    // second delivery is stopped by its own status check, not by luck.
    let run = check(LOCK_ONLY, Form::Redelivery40ms, 1);
    assert_eq!(run.decisions, [Decision::Applied, Decision::StoppedByStatusCheck]);
}

#[test]
fn unique_indexes_alone_stop_what_the_handler_itself_lets_through() {
    // Proof that the indexes, not a check, did the stopping: both deliveries
    // believe they applied the payment, yet each side effect landed once.
    for form in FORMS {
        let run = check(UNIQUE_ONLY, form, 1);
        assert_eq!(run.decisions, [Decision::Applied, Decision::Applied], "{}", form.name());
    }
}

#[test]
fn each_defense_alone_and_payonce_truth_table() {
    let mut table = String::from(
        "| defenses on (naive handler) | concurrent | redelivery_40ms | second_channel |\n|---|---|---|---|\n",
    );
    for (defenses, expected) in TRUTH_TABLE {
        let cells: Vec<&str> = FORMS
            .iter()
            .zip(expected)
            .map(|(&form, coupons)| verdict(check(defenses, form, coupons).effects.coupons))
            .collect();
        table.push_str(&format!("| {defenses} | {} |\n", cells.join(" | ")));
    }
    let cells: Vec<&str> = FORMS
        .iter()
        .map(|&form| {
            let run = check_payonce(form, &crate::engines::Db::sqlite("incident-payonce"));
            verdict(run.coupons.iter().copied().max().unwrap_or(0) as i64)
        })
        .collect();
    table.push_str(&format!("| payonce `deliver_payment` | {} |\n", cells.join(" | ")));

    println!("{table}");
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    std::fs::create_dir_all(&target).expect("create target/");
    std::fs::write(target.join("incident-table.md"), &table).expect("write target/incident-table.md");
}

#[test]
fn unique_index_defense_really_removes_the_indexes() {
    // The "off" schema must lack exactly the five side-effect keys and keep
    // everything else (uk_order_no still guards order creation).
    let dir = TempDir::new("incident-schema");
    let index_names = |defenses: Defenses| -> Vec<String> {
        let path = dir.path(&format!("schema-{}.db", defenses.unique_indexes));
        create_database(&path, defenses);
        let conn = open_connection(&path);
        let mut stmt = conn
            .prepare("SELECT name FROM sqlite_master WHERE type = 'index' AND name LIKE 'uk_%' ORDER BY name")
            .expect("prepare");
        let names = stmt.query_map([], |r| r.get(0)).expect("query").collect::<Result<Vec<String>, _>>();
        names.expect("index names")
    };
    let with = index_names(UNIQUE_ONLY);
    let without = index_names(NONE);
    for name in SIDE_EFFECT_INDEXES {
        assert!(with.iter().any(|n| n == name), "{name} missing from the full schema: {with:?}");
        assert!(!without.iter().any(|n| n == name), "{name} survived the removal: {without:?}");
    }
    assert!(without.iter().any(|n| n == "uk_order_no"), "only the side-effect keys are removed: {without:?}");
    assert_eq!(with.len() - without.len(), SIDE_EFFECT_INDEXES.len());
}

for_each_engine! {
    /// The incident replay's payonce half: every form stopped, with two
    /// App instances (two key-lock maps, as two processes) on one database
    /// for the redelivery and the second channel.
    fn payonce_stops_every_form_of_the_incident(db) {
        for (k, &form) in FORMS.iter().enumerate() {
            // Each form on a fresh database: the rounds reuse their order_nos.
            let fresh = match (k, db.engine) {
                (0, _) => None,
                (_, crate::engines::Engine::Sqlite) => Some(crate::engines::Db::sqlite(form.name())),
                (_, crate::engines::Engine::Postgres) => crate::engines::Db::postgres(form.name()),
            };
            check_payonce(form, fresh.as_ref().unwrap_or(db));
        }
    }
}
