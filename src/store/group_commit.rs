//! Group commit on SQLite (PRODUCT.md section 9): many write operations in
//! one `BEGIN IMMEDIATE` transaction and one COMMIT (one fsync), each in its
//! own SAVEPOINT, none answered before that COMMIT returned.
//!
//! The writer connection is the baton. An operation (its caller already
//! holds its key locks) waits for the baton; the first of a batch opens
//! `BEGIN IMMEDIATE`; each runs `SAVEPOINT op` / its work / `RELEASE op` (or
//! `ROLLBACK TO op` on an error or a panic, caught right there, on the
//! caller's own thread) and then either hands the baton to the next queued
//! operation, leaving the transaction open, or, when nobody is queued or the
//! batch is full, COMMITs for the whole batch and publishes the batch's
//! outcome under its epoch. Every operation of the batch waits for that
//! outcome before it returns, so its caller's key locks drop after the
//! COMMIT that made its work durable, by scope order, as before.
//!
//! ```text
//! lock keys → queue for the baton → [BEGIN IMMEDIATE if none is open]
//!   SAVEPOINT op; work; RELEASE op | ROLLBACK TO op; RELEASE op
//!   → hand the baton on (the next op joins this transaction)
//!     or COMMIT (ROLLBACK if it fails) → publish the epoch's outcome
//! → wait for my epoch's outcome → return → key guards drop
//! ```
//!
//! Closures never cross threads (no `'static + Send` bound on the work), and
//! a panic unwinds only to this thread's `catch_unwind`.

use super::sqlite::SqliteTx;
use super::Conn;
use crate::error::Error;
use parking_lot::{Condvar, Mutex};
use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::Connection;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub const GROUP_COMMIT_MAX_DEFAULT: usize = 64;
pub const GROUP_COMMIT_WAIT_US_DEFAULT: u64 = 0;

type Pooled = r2d2::PooledConnection<SqliteConnectionManager>;

/// What `/metrics` reads: batches committed (or failed) and the operations in them.
#[derive(Debug, Default)]
pub struct GroupCommitCounters {
    pub batches: AtomicU64,
    pub operations: AtomicU64,
}

pub(super) struct GroupCommitter {
    max: usize,
    wait: Duration,
    state: Mutex<State>,
    /// Wakes an operation queued for the baton.
    turn: Condvar,
    /// Wakes the operations of a batch once its outcome is published.
    done: Condvar,
    /// Wakes a committer waiting `--group-commit-wait-us` for more operations.
    arrived: Condvar,
    pub(super) counters: GroupCommitCounters,
    /// Test hook: the next COMMIT fails (it rolls back instead).
    fail_next_commit: AtomicBool,
}

#[derive(Default)]
struct State {
    /// The writer connection, here while nobody holds the baton.
    conn: Option<Pooled>,
    /// Someone holds the baton (and the connection).
    busy: bool,
    /// Operations waiting for the baton.
    queued: usize,
    /// A transaction is open on the connection.
    in_transaction: bool,
    /// The open (or next) batch.
    epoch: u64,
    /// Operations that ran in the open batch.
    batch_ops: usize,
    /// Outcomes of finished batches not yet read by all their operations:
    /// epoch → (outcome, operations still to read it).
    outcomes: HashMap<u64, (Result<(), String>, usize)>,
}

/// How one operation's savepoint ended.
enum Ran<T> {
    Done(Result<T, Error>),
    /// The transaction is gone (SQLite rolled it back, or a savepoint
    /// statement failed): the whole batch fails.
    Poisoned(Error),
}

impl GroupCommitter {
    pub(super) fn new(max: usize, wait_us: u64) -> GroupCommitter {
        GroupCommitter {
            max: max.max(1),
            wait: Duration::from_micros(wait_us),
            state: Mutex::new(State::default()),
            turn: Condvar::new(),
            done: Condvar::new(),
            arrived: Condvar::new(),
            counters: GroupCommitCounters::default(),
            fail_next_commit: AtomicBool::new(false),
        }
    }

    pub(super) fn fail_next_commit(&self) {
        self.fail_next_commit.store(true, Ordering::SeqCst);
    }

    /// Operations waiting for the baton right now (tests use it to know a batch is forming).
    pub(super) fn queued(&self) -> usize {
        self.state.lock().queued
    }

    /// Runs `work` as one operation of a batch; returns once the batch's
    /// COMMIT returned (or failed). `connect` gives the writer connection
    /// the first time one is needed.
    pub(super) fn run<T>(
        &self,
        connect: impl Fn() -> Result<Pooled, Error>,
        work: &mut dyn FnMut(&dyn Conn) -> Result<T, Error>,
    ) -> Result<T, Error> {
        // 1. The baton.
        let mut state = self.state.lock();
        state.queued += 1;
        self.arrived.notify_one();
        while state.busy {
            self.turn.wait(&mut state);
        }
        state.queued -= 1;
        state.busy = true;
        let taken = state.conn.take();
        let open = state.in_transaction;
        drop(state);
        let conn = match taken.map_or_else(&connect, Ok) {
            Ok(conn) => conn,
            Err(e) => {
                self.hand_on(None);
                return Err(e);
            }
        };
        if !open {
            if let Err(e) = conn.execute_batch("BEGIN IMMEDIATE") {
                self.hand_on(Some(conn));
                return Err(e.into());
            }
        }
        let epoch = {
            let mut state = self.state.lock();
            state.in_transaction = true;
            state.batch_ops += 1;
            state.epoch
        };

        // 2. This operation's savepoint, on this thread.
        let ran = run_in_savepoint(&conn, work);

        // 3. Hand on, or commit the batch.
        let mut state = self.state.lock();
        let poisoned = matches!(ran, Ran::Poisoned(_));
        let mut commit_now = poisoned || state.queued == 0 || state.batch_ops >= self.max;
        if commit_now && !poisoned && state.queued == 0 && state.batch_ops < self.max && !self.wait.is_zero() {
            // Wait a little for more operations, holding the open transaction.
            let deadline = Instant::now() + self.wait;
            while state.queued == 0 && !self.arrived.wait_until(&mut state, deadline).timed_out() {}
            commit_now = state.queued == 0;
        }
        if !commit_now {
            state.conn = Some(conn);
            state.busy = false;
            self.turn.notify_one();
            return self.await_outcome(state, epoch, ran);
        }
        let ops = state.batch_ops;
        drop(state);
        let outcome = match &ran {
            Ran::Poisoned(e) => Err(e.message.clone()),
            Ran::Done(_) => self.commit(&conn),
        };
        if outcome.is_err() && !conn.is_autocommit() {
            let _ = conn.execute_batch("ROLLBACK");
        }
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        self.counters.operations.fetch_add(ops as u64, Ordering::Relaxed);
        let mut state = self.state.lock();
        state.outcomes.insert(epoch, (outcome, ops));
        state.epoch += 1;
        state.batch_ops = 0;
        state.in_transaction = false;
        state.conn = Some(conn);
        state.busy = false;
        self.done.notify_all();
        self.turn.notify_one();
        self.await_outcome(state, epoch, ran)
    }

    fn commit(&self, conn: &Connection) -> Result<(), String> {
        if self.fail_next_commit.swap(false, Ordering::SeqCst) {
            return Err("injected COMMIT failure (test hook)".to_owned());
        }
        conn.execute_batch("COMMIT").map_err(|e| e.to_string())
    }

    /// Gives the baton back when this operation could not join a batch (no
    /// connection, or BEGIN failed): no transaction is open then, since an
    /// open one keeps its connection in the state and skips BEGIN.
    fn hand_on(&self, conn: Option<Pooled>) {
        let mut state = self.state.lock();
        if conn.is_some() {
            state.conn = conn;
        }
        state.busy = false;
        self.turn.notify_one();
    }

    /// Waits until batch `epoch` is committed or failed; then this
    /// operation's own result, or the batch's failure.
    fn await_outcome<T>(
        &self,
        mut state: parking_lot::MutexGuard<'_, State>,
        epoch: u64,
        ran: Ran<T>,
    ) -> Result<T, Error> {
        while !state.outcomes.contains_key(&epoch) {
            self.done.wait(&mut state);
        }
        let (outcome, readers) = state.outcomes.get_mut(&epoch).expect("outcome present");
        let outcome = outcome.clone();
        *readers -= 1;
        if *readers == 0 {
            state.outcomes.remove(&epoch);
        }
        drop(state);
        match (outcome, ran) {
            (Ok(()), Ran::Done(result)) => result,
            (Ok(()), Ran::Poisoned(e)) => Err(e),
            (Err(why), _) => Err(Error::internal(format!("the batch's transaction did not commit: {why}"))),
        }
    }
}

/// `SAVEPOINT op`; the work; `RELEASE op` on success, `ROLLBACK TO op;
/// RELEASE op` on an error or a panic. After a failure, SQLite may have
/// rolled the whole transaction back (FULL, IOERR, NOMEM, BUSY): then the
/// connection is in autocommit and the batch is poisoned. A SAVEPOINT is
/// never opened in autocommit mode (it would start a DEFERRED transaction).
fn run_in_savepoint<T>(conn: &Connection, work: &mut dyn FnMut(&dyn Conn) -> Result<T, Error>) -> Ran<T> {
    if conn.is_autocommit() {
        return Ran::Poisoned(Error::internal("no open transaction for the savepoint"));
    }
    // Through the statement cache: these run once per operation, on the writer.
    if let Err(e) = conn.prepare_cached("SAVEPOINT op").and_then(|mut s| s.execute([])) {
        return Ran::Poisoned(e.into());
    }
    let result = match catch_unwind(AssertUnwindSafe(|| work(&SqliteTx { conn }))) {
        Ok(result) => result,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".to_owned());
            crate::log::error("a write operation panicked; its savepoint is rolled back", &[("panic", &what)]);
            Err(Error::internal(format!("the operation panicked: {what}")))
        }
    };
    if conn.is_autocommit() {
        let why = result.err().map_or_else(|| "SQLite ended the transaction".to_owned(), |e| e.message);
        return Ran::Poisoned(Error::internal(format!("the batch's transaction was rolled back: {why}")));
    }
    let end = match &result {
        Ok(_) => conn.prepare_cached("RELEASE op").and_then(|mut s| s.execute([])).map(drop),
        Err(_) => conn.execute_batch("ROLLBACK TO op; RELEASE op"),
    };
    match end {
        Ok(()) if !conn.is_autocommit() => Ran::Done(result),
        Ok(()) => Ran::Poisoned(Error::internal("the batch's transaction ended inside a savepoint")),
        Err(e) => Ran::Poisoned(e.into()),
    }
}
