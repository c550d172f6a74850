//! The mechanism alone: the claim and finish CASes on a real store (a
//! `platform_call` row, which needs no order), the schedule's arithmetic,
//! and the worker's bounds.

use super::*;
use crate::domain::{PlatformCallKind, PlatformCallStatus};
use crate::store::{PlatformCallRow, StoreOptions};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const T0: i64 = 1_700_000_000_000;

fn store_with_a_close() -> (Store, PlatformCallRow) {
    let store = Store::open(":memory:", &StoreOptions::default()).expect("store");
    let now = format_ms(T0);
    store.write(&[], |tx| tx.enqueue_platform_close("alipay", "ORD-1", &now)).expect("queued");
    let row = due(&store, T0).pop().expect("due");
    assert_eq!((row.kind, row.attempts), (PlatformCallKind::Close, 0));
    (store, row)
}

fn due(store: &Store, at_ms: i64) -> Vec<PlatformCallRow> {
    store.read(|tx| tx.due_platform_calls(&format_ms(at_ms), 10)).expect("due")
}

fn done(call: &str) -> PlatformAttempt {
    PlatformAttempt {
        settle: Settle::Final(PlatformCallStatus::Done),
        request: call.into(),
        http_status: Some(200),
        response: "ok".into(),
    }
}

#[test]
fn a_second_claim_of_the_same_read_loses() {
    let (store, row) = store_with_a_close();
    let lease = Lease::new(T0, 30_000);
    let first = claim(&store, &row, &lease).expect("claim").expect("the first claim wins");
    assert_eq!(first.attempt, 1);
    assert_eq!(claim(&store, &row, &lease).expect("claim"), None, "the row moved on: the second loses");
    assert!(due(&store, T0 + 29_999).is_empty(), "leased: not due before the lease ends");
    let again = due(&store, T0 + 30_000).pop().expect("due once the lease ran out");
    assert_eq!(again.attempts, 1);
    assert_eq!(again.next_attempt_at.as_deref(), Some(lease.until.as_str()));
}

#[test]
fn a_stale_finisher_changes_nothing() {
    let (store, row) = store_with_a_close();
    let stale = claim(&store, &row, &Lease::new(T0, 1_000)).expect("claim").expect("won");
    // Its lease runs out mid-call and another worker claims attempt 2.
    let reread = due(&store, T0 + 1_000).pop().expect("due again");
    let current = claim(&store, &reread, &Lease::new(T0 + 1_000, 1_000)).expect("claim").expect("won");
    assert_eq!((stale.attempt, current.attempt), (1, 2));
    let now = format_ms(T0 + 1_500);
    assert!(!finish(&store, &stale, &done("stale"), &now, |_| None).expect("finish"), "attempt 1 is refused");
    assert!(finish(&store, &current, &done("current"), &now, |_| None).expect("finish"));
    let rows = store.read(|tx| tx.platform_closes_of_order("ORD-1")).expect("rows");
    assert_eq!(
        (rows[0].status, rows[0].attempts, rows[0].next_attempt_at.as_deref()),
        (PlatformCallStatus::Done, 2, None)
    );
    assert!(!finish(&store, &current, &done("twice"), &now, |_| None).expect("finish"), "settled: nothing more");
    assert_eq!(claim(&store, &rows[0], &Lease::new(T0 + 2_000, 1_000)).expect("claim"), None, "not pending");
}

#[test]
fn a_retry_is_pending_again_at_its_time_and_pending_is_no_final_state() {
    let (store, row) = store_with_a_close();
    let call = claim(&store, &row, &Lease::new(T0, 1_000)).expect("claim").expect("won");
    let now = format_ms(T0 + 10);
    let stuck = PlatformAttempt { settle: Settle::Final(PlatformCallStatus::Pending), ..done("x") };
    assert!(finish(&store, &call, &stuck, &now, |_| None).is_err(), "settling as pending is refused");
    let retry = PlatformAttempt { settle: Settle::Retry { at: format_ms(T0 + 5_000) }, ..done("x") };
    assert!(finish(&store, &call, &retry, &now, |_| None).expect("finish"));
    assert!(due(&store, T0 + 4_999).is_empty());
    assert_eq!(due(&store, T0 + 5_000).pop().map(|r| (r.status, r.attempts)), Some((PlatformCallStatus::Pending, 1)));
}

#[test]
fn schedule_without_jitter_repeats_its_last_wait() {
    let waits = [1_000, 5_000];
    let schedule = Schedule::new(&waits, 0.0, Spent::RepeatLast);
    for (attempt, wait) in [(0, 1_000), (1, 1_000), (2, 5_000), (3, 5_000), (100, 5_000)] {
        assert_eq!(schedule.wait_ms(attempt, 0.9, None), Some(wait), "attempt {attempt}");
    }
    assert_eq!(Schedule::new(&[], 0.0, Spent::RepeatLast).wait_ms(1, 0.5, None), Some(Schedule::EMPTY_REPEAT_MS));
    assert_eq!(schedule.next_attempt_at(T0, 2, 0.0, None), Some(format_ms(T0 + 5_000)));
}

#[test]
fn schedule_with_jitter_stays_within_its_fraction_and_gives_up_when_spent() {
    let waits = [1_000, 2_000];
    let schedule = Schedule::new(&waits, 0.2, Spent::GiveUp);
    assert_eq!(schedule.wait_ms(1, 0.0, None), Some(800));
    assert_eq!(schedule.wait_ms(1, 0.5, None), Some(1_000));
    assert_eq!(schedule.wait_ms(1, 0.999_999, None), Some(1_200));
    for _ in 0..1000 {
        let unit = random_unit();
        assert!((0.0..1.0).contains(&unit));
        assert!((1_600..=2_400).contains(&schedule.wait_ms(2, unit, None).expect("a wait")));
    }
    // A Retry-After only stretches a wait, and the schedule ends the retries.
    assert_eq!(schedule.wait_ms(1, 0.5, Some(50)), Some(1_000));
    assert_eq!(schedule.wait_ms(2, 0.5, Some(9_000)), Some(9_000));
    assert_eq!(schedule.wait_ms(3, 0.5, None), None);
    assert_eq!(schedule.wait_ms(0, 0.5, None), None);
    assert_eq!(schedule.next_attempt_at(T0, 3, 0.5, None), None);
}

/// A queue of `total` calls that each take `call_ms`, counting the most in flight.
struct Counting {
    total: usize,
    claimed: AtomicUsize,
    worked: AtomicUsize,
    in_flight: AtomicUsize,
    most: AtomicUsize,
    call_ms: u64,
}

impl Counting {
    fn new(total: usize, call_ms: u64) -> Counting {
        let zero = || AtomicUsize::new(0);
        Counting { total, claimed: zero(), worked: zero(), in_flight: zero(), most: zero(), call_ms }
    }
}

impl Queue for Counting {
    type Job = usize;
    type Done = usize;
    const ROUND_FAILED: &'static str = "test round failed";

    fn ready(&self) -> bool {
        true
    }

    fn claim_due(&self, limit: usize) -> Result<Vec<usize>, Error> {
        let from = self.claimed.load(Ordering::SeqCst);
        let until = (from + limit).min(self.total);
        self.claimed.store(until, Ordering::SeqCst);
        Ok((from..until).collect())
    }

    fn work(&self, job: &usize) -> usize {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(self.call_ms));
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.worked.fetch_add(1, Ordering::SeqCst);
        *job
    }
}

#[test]
fn a_round_by_hand_works_what_it_claimed() {
    let queue = Counting::new(5, 1);
    let mut done = run_once(&queue, 3).expect("round");
    done.sort_unstable();
    assert_eq!(done, vec![0, 1, 2]);
    assert_eq!(run_once(&queue, 3).expect("round").len(), 2);
    assert!(run_once(&queue, 3).expect("round").is_empty());
}

#[test]
fn the_worker_bounds_its_calls_and_stops_on_shutdown() {
    let queue = Arc::new(Counting::new(12, 20));
    let shutdown = Arc::new(AtomicBool::new(false));
    let wake = Arc::new(crate::store::Signal::default());
    let shape = Shape {
        name: "test-dispatcher",
        sender_name: "test-sender",
        concurrency: 3,
        wake,
        poll: Duration::from_secs(5),
        at_shutdown: AtShutdown::FinishCalls,
    };
    let worker = spawn(Arc::clone(&queue), shape, Arc::clone(&shutdown)).expect("spawn");
    let deadline = Instant::now() + Duration::from_secs(10);
    // Each finished call wakes the dispatcher: far sooner than the 5 s poll.
    while queue.worked.load(Ordering::SeqCst) < 12 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(queue.worked.load(Ordering::SeqCst), 12);
    assert!(queue.most.load(Ordering::SeqCst) <= 3, "at most 3 at once: {}", queue.most.load(Ordering::SeqCst));
    let asked = Instant::now();
    shutdown.store(true, Ordering::SeqCst);
    worker.join().expect("the dispatcher ends");
    assert!(asked.elapsed() < Duration::from_secs(2), "stopped within its shutdown poll");
}

/// One call that blocks until released.
struct Hanging {
    started: AtomicBool,
    released: AtomicBool,
    claimed: AtomicBool,
}

impl Queue for Hanging {
    type Job = ();
    type Done = ();
    const ROUND_FAILED: &'static str = "test round failed";

    fn ready(&self) -> bool {
        true
    }

    fn claim_due(&self, _limit: usize) -> Result<Vec<()>, Error> {
        Ok(if self.claimed.swap(true, Ordering::SeqCst) { Vec::new() } else { vec![()] })
    }

    fn work(&self, _job: &()) {
        self.started.store(true, Ordering::SeqCst);
        while !self.released.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// A stopping worker with a call that never ends: `LeaveCalls` ends its
/// dispatcher at once (the call is left to its lease), `FinishCalls` only
/// once the call ended.
#[test]
fn a_stopping_worker_leaves_or_finishes_the_call_in_flight_as_its_queue_says() {
    for at_shutdown in [AtShutdown::LeaveCalls, AtShutdown::FinishCalls] {
        let queue = Arc::new(Hanging {
            started: AtomicBool::new(false),
            released: AtomicBool::new(false),
            claimed: AtomicBool::new(false),
        });
        let shutdown = Arc::new(AtomicBool::new(false));
        let shape = Shape {
            name: "test-dispatcher",
            sender_name: "test-sender",
            concurrency: 1,
            wake: Arc::new(crate::store::Signal::default()),
            poll: Duration::from_millis(10),
            at_shutdown,
        };
        let worker = spawn(Arc::clone(&queue), shape, Arc::clone(&shutdown)).expect("spawn");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !queue.started.load(Ordering::SeqCst) {
            assert!(Instant::now() < deadline, "the call never started");
            std::thread::sleep(Duration::from_millis(5));
        }
        shutdown.store(true, Ordering::SeqCst);
        // Ending at once is seen within seconds; waiting, for as long as we look.
        let look = if at_shutdown == AtShutdown::LeaveCalls { 10_000 } else { 300 };
        let deadline = Instant::now() + Duration::from_millis(look);
        while !worker.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        match at_shutdown {
            AtShutdown::LeaveCalls => assert!(worker.is_finished(), "left the hanging call to its lease"),
            AtShutdown::FinishCalls => assert!(!worker.is_finished(), "waits for the call in flight"),
        }
        queue.released.store(true, Ordering::SeqCst);
        worker.join().expect("the dispatcher ends");
    }
}
