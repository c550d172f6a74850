//! Group commit on SQLite (docs/performance.md): operations queued behind
//! one writer share one transaction and one COMMIT, and a failing one rolls
//! back alone. A gate operation holds the writer while the others queue, so
//! the batch below is certain, and the counters prove the operations shared
//! one COMMIT (these tests cannot pass with batches of one).

use crate::util::{new_order, Pay, TempDir};
use payonce::store::{Store, StoreOptions};
use payonce::{App, Clock, Config, Error};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

fn totals(store: &Store) -> (u64, u64) {
    store.group_commit_totals().expect("SQLite has a group committer")
}

fn wait_until_queued(store: &Store, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.queued_writers() < n {
        assert!(Instant::now() < deadline, "only {} of {n} writers queued", store.queued_writers());
        thread::sleep(Duration::from_millis(1));
    }
}

/// One write operation of a batch, run on its own thread.
type Op<'s, T> = Box<dyn FnOnce(&'s Store) -> Result<T, Error> + Send + 's>;

fn order_exists(store: &Store, order_no: &str) -> bool {
    store.read(|tx| tx.order_by_no(order_no)).expect("read").is_some()
}

/// Runs `ops` as one batch: a gate operation takes the writer and waits
/// until every op is queued behind it, in the order given. Returns each
/// op's result, in order.
fn one_batch<'s, T: Send>(store: &'s Store, ops: Vec<Op<'s, T>>) -> (Result<(), Error>, Vec<Result<T, Error>>) {
    let (gate, results) = one_batch_joined(store, ops);
    (gate.expect("gate thread"), results)
}

/// The gate's thread as joined: its write's result, or its panic.
type GateJoined = thread::Result<Result<(), Error>>;

/// [`one_batch`], with the gate's thread as joined: a panic of the gate
/// (the batch's leader) is its `Err`.
fn one_batch_joined<'s, T: Send>(store: &'s Store, ops: Vec<Op<'s, T>>) -> (GateJoined, Vec<Result<T, Error>>) {
    let (entered_tx, entered_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    // The work of a write is Send (the leader of its batch may run it).
    let release_rx = std::sync::Mutex::new(release_rx);
    // A body may run again (its batch run again with savepoints): the gate
    // waits on its first run only.
    let released = std::sync::atomic::AtomicBool::new(false);
    thread::scope(|s| {
        let gate = s.spawn(move || {
            store.write(&[], |tx| {
                if !released.swap(true, std::sync::atomic::Ordering::SeqCst) {
                    let _ = entered_tx.send(());
                    release_rx.lock().expect("gate").recv().map_err(|_| Error::internal("gate released"))?;
                }
                tx.insert_order(&new_order("GATE")).map(drop)
            })
        });
        entered_rx.recv().expect("the gate holds the writer");
        // One at a time, so the queue (and the batch) holds them in the
        // order given: a test of which body runs again depends on it.
        let handles: Vec<_> = ops
            .into_iter()
            .enumerate()
            .map(|(i, op)| {
                let handle = s.spawn(move || op(store));
                wait_until_queued(store, i + 1);
                handle
            })
            .collect();
        release_tx.send(()).expect("release the gate");
        let results = handles.into_iter().map(|h| h.join().expect("op thread")).collect();
        (gate.join(), results)
    })
}

fn insert<'s>(order_no: &'static str) -> Op<'s, bool> {
    Box::new(move |store: &Store| store.write(&[], |tx| tx.insert_order(&new_order(order_no)).map(|r| r.is_ok())))
}

#[test]
fn a_failing_and_a_panicking_operation_roll_back_alone_and_the_rest_commit_in_one_commit() {
    let store = Store::open(":memory:", &StoreOptions::default()).expect("open");
    let before = totals(&store);
    let failing: Op<bool> = Box::new(|store: &Store| {
        store.write(&[], |tx| {
            let _inserted = tx.insert_order(&new_order("FAILS"))?;
            Err(Error::internal("this operation fails after its insert"))
        })
    });
    let panicking: Op<bool> = Box::new(|store: &Store| {
        store.write(&[], |tx| {
            let _inserted = tx.insert_order(&new_order("PANICS"))?;
            panic!("this operation panics after its insert")
        })
    });
    let (gate, results) = one_batch(&store, vec![insert("GOOD-1"), failing, panicking, insert("GOOD-2")]);
    gate.expect("the gate commits");
    assert!(matches!(results[0], Ok(true)), "{:?}", results[0]);
    let failed = results[1].as_ref().expect_err("the failing op gets its own error");
    assert!(failed.message.contains("fails after its insert"), "{failed}");
    let panicked = results[2].as_ref().expect_err("the panicking op gets an error");
    assert_eq!(payonce::api::status_of(panicked.kind), 500, "{panicked}");
    assert!(panicked.message.contains("panicked"), "{panicked}");
    assert!(matches!(results[3], Ok(true)), "{:?}", results[3]);
    for (order_no, kept) in [("GATE", true), ("GOOD-1", true), ("FAILS", false), ("PANICS", false), ("GOOD-2", true)] {
        assert_eq!(order_exists(&store, order_no), kept, "{order_no}");
    }
    let after = totals(&store);
    assert_eq!((after.0 - before.0, after.1 - before.1), (1, 5), "five operations, one COMMIT");
}

/// An insert that counts the runs of its body.
fn counted_insert<'s>(order_no: &'static str, runs: &'s std::sync::atomic::AtomicUsize) -> Op<'s, bool> {
    Box::new(move |store: &Store| {
        store.write(&[], |tx| {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tx.insert_order(&new_order(order_no)).map(|r| r.is_ok())
        })
    })
}

/// Operations run bare until one fails: then the batch is rolled back and
/// what it took runs again, each in its own savepoint (src/store/sqlite/
/// group_commit.rs, "Savepoints only when needed"). So a body runs once in
/// a batch where all succeed, the ones before a failure twice; the batch
/// after a failure uses savepoints from its start, and every body runs once.
#[test]
fn a_batch_runs_bare_until_an_operation_fails_then_again_with_savepoints() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    let store = Store::open(":memory:", &StoreOptions::default()).expect("open");
    let runs: Vec<AtomicUsize> = (0..7).map(|_| AtomicUsize::new(0)).collect();
    let count = |i: usize| runs[i].load(SeqCst);
    let failing = |runs: &'static str, counter: &AtomicUsize| -> Result<bool, Error> {
        store.write(&[], |tx| {
            counter.fetch_add(1, SeqCst);
            let _inserted = tx.insert_order(&new_order(runs))?;
            Err(Error::internal("this operation fails after its insert"))
        })
    };

    assert_eq!(store.group_commit_reruns(), 0);
    // All succeed: one run each.
    let (gate, results) =
        one_batch(&store, vec![counted_insert("BARE-1", &runs[0]), counted_insert("BARE-2", &runs[1])]);
    gate.expect("gate");
    assert!(results.iter().all(|r| matches!(r, Ok(true))), "{results:?}");
    assert_eq!((count(0), count(1)), (1, 1), "no failure, no second run");

    // The second of three fails: the first and the failing one run twice, the third once.
    let (gate, results) = one_batch(
        &store,
        vec![
            counted_insert("RERUN-1", &runs[2]),
            Box::new(|_: &Store| failing("RERUN-FAILS", &runs[3])),
            counted_insert("RERUN-3", &runs[4]),
        ],
    );
    gate.expect("gate");
    assert!(matches!(results[0], Ok(true)) && results[1].is_err() && matches!(results[2], Ok(true)), "{results:?}");
    assert_eq!((count(2), count(3), count(4)), (2, 2, 1), "run again with savepoints from the failure on");
    assert_eq!(store.group_commit_reruns(), 1, "one batch run again, counted for /metrics");
    for (order_no, kept) in [("RERUN-1", true), ("RERUN-FAILS", false), ("RERUN-3", true)] {
        assert_eq!(order_exists(&store, order_no), kept, "{order_no}");
    }

    // The next batch starts with savepoints: its failure costs no second run.
    let (gate, results) = one_batch(
        &store,
        vec![counted_insert("AFTER-1", &runs[5]), Box::new(|_: &Store| failing("AFTER-FAILS", &runs[6]))],
    );
    gate.expect("gate");
    assert!(matches!(results[0], Ok(true)) && results[1].is_err(), "{results:?}");
    assert_eq!((count(5), count(6)), (1, 1), "savepoints from the start");
    assert_eq!(store.group_commit_reruns(), 1, "no second run, none counted");
    assert!(order_exists(&store, "AFTER-1") && !order_exists(&store, "AFTER-FAILS"));
}

#[test]
fn a_failed_commit_fails_every_operation_of_the_batch_and_leaves_nothing() {
    let store = Store::open(":memory:", &StoreOptions::default()).expect("open");
    store.fail_next_commit();
    let before = totals(&store);
    let (gate, results) = one_batch(&store, vec![insert("C-1"), insert("C-2"), insert("C-3")]);
    let gate = gate.expect_err("the gate is not acknowledged");
    assert!(gate.message.contains("did not commit"), "{gate}");
    for (i, result) in results.iter().enumerate() {
        let e = result.as_ref().expect_err("no operation of the batch is acknowledged");
        assert!(e.message.contains("did not commit"), "op {i}: {e}");
    }
    for order_no in ["GATE", "C-1", "C-2", "C-3"] {
        assert!(!order_exists(&store, order_no), "{order_no} is not visible");
    }
    let after = totals(&store);
    assert_eq!((after.0 - before.0, after.1 - before.1), (1, 4));
    // The writer recovers: the next operation commits on its own.
    assert!(store.write(&[], |tx| tx.insert_order(&new_order("AFTER")).map(|r| r.is_ok())).expect("next write"));
    assert!(order_exists(&store, "AFTER"));
}

/// The leader of a batch panics after its operations ran and before its
/// COMMIT, outside any operation's savepoint: the whole batch fails (no
/// operation is acknowledged, none of their rows is visible), no caller
/// waits forever, and the writer serves the next operation. Each job ran on
/// the leader's thread from its caller's stack; this is the path where a
/// job used after its caller returned would be a use-after-free.
#[test]
fn a_leader_that_panics_outside_any_operation_fails_its_whole_batch_and_the_writer_recovers() {
    let store = Store::open(":memory:", &StoreOptions::default()).expect("open");
    store.panic_next_batch_leader();
    let (gate, results) = one_batch_joined(&store, vec![insert("P-1"), insert("P-2"), insert("P-3")]);
    let panic = gate.expect_err("the gate led the batch and panicked");
    let what = panic.downcast_ref::<&str>().copied().unwrap_or_default();
    assert!(what.contains("outside any operation"), "{what:?}");
    for (i, result) in results.iter().enumerate() {
        let e = result.as_ref().expect_err("no operation of the batch is acknowledged");
        assert!(e.message.contains("leader panicked"), "op {i}: {e}");
    }
    for order_no in ["GATE", "P-1", "P-2", "P-3"] {
        assert!(!order_exists(&store, order_no), "{order_no} is not visible");
    }
    assert_eq!(store.queued_writers(), 0, "no slot of the failed batch stays queued");
    // The writer recovers, for one operation and for a batch.
    assert!(store.write(&[], |tx| tx.insert_order(&new_order("AFTER")).map(|r| r.is_ok())).expect("next write"));
    let (gate, results) = one_batch(&store, vec![insert("Q-1"), insert("Q-2")]);
    gate.expect("the next batch commits");
    assert!(results.iter().all(|r| matches!(r, Ok(true))), "{results:?}");
    for order_no in ["AFTER", "Q-1", "Q-2"] {
        assert!(order_exists(&store, order_no), "{order_no}");
    }
}

#[test]
fn two_payments_of_one_order_in_one_batch_are_applied_and_already_paid() {
    let dir = TempDir::new("group-commit-pay");
    let config = Config {
        rewards: payonce::Rewards { coupon_templates: vec!["NEW10".into()], points_per_yuan: 1 },
        ..Config::default()
    };
    let app = App::open(&dir.path("payonce.db").display().to_string(), Clock::manual(1_700_000_000_000), config)
        .expect("open");
    let (_, created) = app
        .orders()
        .create_order(&payonce::CreateOrder {
            order_no: "O-1".into(),
            user_id: "u1".into(),
            amount: 100,
            currency: "CNY".into(),
            expires_in_s: None,
        })
        .expect("create");
    assert!(created);
    let before = totals(app.store());
    let app = &app;
    let pay = |pay_no: &'static str| -> Op<String> {
        Box::new(move |_: &Store| {
            Ok(Pay { pay_no, order_no: "O-1", amount: 100, status: "SUCCESS" }.deliver(app).outcome_str().to_owned())
        })
    };
    let (gate, results) = one_batch(app.store(), vec![pay("P-A"), pay("P-B")]);
    gate.expect("gate");
    let mut outcomes: Vec<String> = results.into_iter().map(|r| r.expect("delivered")).collect();
    outcomes.sort();
    assert_eq!(outcomes, ["already_paid", "applied"], "whichever ran first in the batch applied");
    let after = totals(app.store());
    assert_eq!((after.0 - before.0, after.1 - before.1), (1, 3), "both payments and the gate in one COMMIT");
    let detail = app.orders().order("O-1").expect("order");
    assert_eq!((detail.coupons.len(), detail.points.len()), (1, 1), "one coupon, one points entry");
}

#[test]
fn concurrent_payments_over_one_writer_share_commits() {
    let dir = TempDir::new("group-commit-storm");
    let app =
        App::open(&dir.path("payonce.db").display().to_string(), Clock::manual(1_700_000_000_000), Config::default())
            .expect("open");
    const ORDERS: usize = 200;
    for i in 0..ORDERS {
        app.orders()
            .create_order(&payonce::CreateOrder {
                order_no: format!("S-{i}"),
                user_id: "u1".into(),
                amount: 100,
                currency: "CNY".into(),
                expires_in_s: None,
            })
            .expect("create");
    }
    let before = totals(app.store());
    thread::scope(|s| {
        for t in 0..16 {
            let app = &app;
            s.spawn(move || {
                for i in (t..ORDERS).step_by(16) {
                    let pay_no = format!("SP-{i}");
                    let order_no = format!("S-{i}");
                    let outcome =
                        Pay { pay_no: &pay_no, order_no: &order_no, amount: 100, status: "SUCCESS" }.deliver(app);
                    assert_eq!(outcome.outcome_str(), "applied");
                }
            });
        }
    });
    let after = totals(app.store());
    let (batches, ops) = (after.0 - before.0, after.1 - before.1);
    println!("group commit: {ops} operations in {batches} batches ({:.2} per COMMIT)", ops as f64 / batches as f64);
    assert_eq!(ops, ORDERS as u64, "one write per payment");
    assert!(batches < ops, "16 writers at once shared commits: {ops} operations in {batches} batches");
}

#[test]
fn group_commit_max_one_turns_batching_off() {
    let options = StoreOptions { group_commit_max: 1, ..StoreOptions::default() };
    let store = Store::open(":memory:", &options).expect("open");
    let before = totals(&store);
    let (gate, results) = one_batch(&store, vec![insert("M-1"), insert("M-2")]);
    gate.expect("gate");
    assert!(results.iter().all(|r| matches!(r, Ok(true))));
    let after = totals(&store);
    assert_eq!((after.0 - before.0, after.1 - before.1), (3, 3), "one COMMIT per operation");
}

/// The leader of a batch runs the queued operations' work on its own thread.
/// With batches of at most 3 and 8 writers at once, some leaders find their
/// own operation left for a later batch (they lead again) and some wake to
/// find it done by another leader: every operation still runs exactly once,
/// returns its own result, and its caller sees its row committed.
#[test]
fn a_small_batch_limit_under_many_writers_runs_every_operation_once() {
    const WRITERS: usize = 8;
    const EACH: usize = 40;
    let options = StoreOptions { group_commit_max: 3, ..StoreOptions::default() };
    let store = Store::open(":memory:", &options).expect("open");
    let before = totals(&store);
    thread::scope(|s| {
        for w in 0..WRITERS {
            let store = &store;
            s.spawn(move || {
                for i in 0..EACH {
                    let order_no = format!("W{w}-{i}");
                    let inserted = store
                        .write(&[], |tx| tx.insert_order(&new_order(&order_no)).map(|r| r.is_ok()))
                        .expect("write");
                    assert!(inserted, "{order_no} inserted by its own operation");
                    assert!(order_exists(store, &order_no), "{order_no} committed before its write returned");
                }
            });
        }
    });
    let after = totals(&store);
    let (batches, ops) = (after.0 - before.0, after.1 - before.1);
    assert_eq!(ops, (WRITERS * EACH) as u64, "every operation once");
    assert!(batches * 3 >= ops, "no batch above the limit: {ops} operations in {batches} batches");
    assert!(batches < ops, "8 writers at once shared commits: {ops} operations in {batches} batches");
}

/// `--group-commit-wait-us`: a leader whose queue ran dry holds its open
/// transaction that long for more operations, so a write arriving a little
/// later joins the same COMMIT. Here the wait (500 ms) dwarfs the gap (20 ms).
#[test]
fn the_commit_wait_lets_a_later_operation_join_the_batch() {
    let options = StoreOptions { group_commit_wait_us: 500_000, ..StoreOptions::default() };
    let store = Store::open(":memory:", &options).expect("open");
    let before = totals(&store);
    let started = Instant::now();
    thread::scope(|s| {
        let first = s.spawn(|| store.write(&[], |tx| tx.insert_order(&new_order("WAIT-1")).map(|r| r.is_ok())));
        thread::sleep(Duration::from_millis(20));
        let second = s.spawn(|| store.write(&[], |tx| tx.insert_order(&new_order("WAIT-2")).map(|r| r.is_ok())));
        assert!(matches!(first.join().expect("first"), Ok(true)));
        assert!(matches!(second.join().expect("second"), Ok(true)));
    });
    let after = totals(&store);
    assert_eq!((after.0 - before.0, after.1 - before.1), (1, 2), "both writes in one COMMIT");
    // After the second write nobody came: the leader waited the whole
    // setting before it committed, and only then did either write return.
    assert!(started.elapsed() >= Duration::from_millis(520), "the leader waited after the second write");
}

/// A re-delivery of a pay_no this process recorded is answered from a read
/// snapshot, without a batch; one it does not remember (recorded by another
/// process on the file, or before a restart) goes through the writer, whose
/// transaction finds the record and answers the same duplicate, writing
/// nothing (src/recent.rs).
#[test]
fn a_remembered_redelivery_skips_the_writer_and_a_forgotten_one_is_the_same_duplicate() {
    let dir = TempDir::new("group-commit-recent");
    let db = dir.path("payonce.db").display().to_string();
    let open = || App::open(&db, Clock::manual(1_700_000_000_000), Config::default()).expect("open");
    let (a, b) = (open(), open());
    a.orders()
        .create_order(&payonce::CreateOrder {
            order_no: "R-1".into(),
            user_id: "u1".into(),
            amount: 100,
            currency: "CNY".into(),
            expires_in_s: None,
        })
        .expect("create");
    let pay = Pay { pay_no: "RP-1", order_no: "R-1", amount: 100, status: "SUCCESS" };
    assert_eq!(pay.deliver(&a).outcome_str(), "applied");
    let before_a = totals(a.store());
    assert_eq!(pay.deliver(&a).outcome_str(), "duplicate");
    assert_eq!(totals(a.store()), before_a, "remembered: answered from a read, no batch");
    let footprint = |app: &App| app.orders().order("R-1").expect("order");
    let seen_before = footprint(&a);
    let before_b = totals(b.store());
    assert_eq!(pay.deliver(&b).outcome_str(), "duplicate", "the other process answers the same");
    assert_eq!(totals(b.store()).0, before_b.0 + 1, "not remembered there: one trip through its writer");
    assert_eq!(pay.deliver(&b).outcome_str(), "duplicate");
    assert_eq!(totals(b.store()).0, before_b.0 + 1, "remembered now: no second trip");
    let seen_after = footprint(&a);
    assert_eq!(
        (seen_after.payments.len(), seen_after.coupons.len(), seen_after.points.len(), seen_after.events.len()),
        (seen_before.payments.len(), seen_before.coupons.len(), seen_before.points.len(), seen_before.events.len()),
        "nothing written by either duplicate"
    );
}
