//! Group commit on SQLite (docs/performance.md): many write operations in
//! one `BEGIN IMMEDIATE` transaction and one COMMIT (one fsync), none
//! answered before that COMMIT returned. An operation that fails rolls back
//! its own work only: it ran in its own SAVEPOINT, or its batch is run again
//! with one SAVEPOINT per operation (below, "Savepoints only when needed").
//!
//! An operation (its caller already holds its key locks) joins the queue.
//! If no thread is leading a batch, the caller leads one: it takes the
//! writer connection, opens `BEGIN IMMEDIATE`, and runs the queued
//! operations one after another, its own among them, each in `SAVEPOINT op`
//! / work / `RELEASE op` (or `ROLLBACK TO op` after an error or a caught
//! panic), until the queue is empty or the batch is full; then it COMMITs
//! and tells each operation of the batch how the COMMIT went. The other
//! callers sleep meanwhile, each woken once, when its batch is over. Every
//! caller returns only after that, so its key locks drop after the COMMIT
//! that made its work durable, by scope order, as before.
//!
//! ```text
//! lock keys → queue → lead, or sleep until my batch is over
//!   leader: [BEGIN IMMEDIATE;
//!            for each queued op: work (bare, until one fails: then ROLLBACK;
//!              BEGIN IMMEDIATE; the ops so far again, and the rest, each as
//!              SAVEPOINT op; work; RELEASE op | ROLLBACK TO op; RELEASE op)
//!            COMMIT (ROLLBACK if it fails)] → wake every op of the batch
//!           → lead the next batch while my own op is still queued,
//!             else wake the next queued op to lead → return
//! → return → key guards drop
//! ```
//!
//! Why the leader runs the others' work rather than passing the connection
//! from thread to thread: handing the writer to the next operation's thread
//! costs a wake-up and a context switch per operation, in the serial part
//! (measured 30-40 µs of about 150 µs per payment on this machine type,
//! docs/performance.md); the leader runs them back to back with SQLite's
//! pages in its cache, and each waiting thread is woken once. The work is
//! `Send`, and its caller stays blocked here, its stack alive, until the
//! leader has finished with it (see [`Slot`]); a panic in the work is caught
//! on the leader, in that operation's savepoint, and becomes its caller's
//! error.
//!
//! Savepoints only when needed. A SAVEPOINT costs each operation a copy of
//! every page it changes into SQLite's in-memory sub-journal (about 8 µs of
//! the writer's 55 per payment, docs/performance.md), and almost every
//! operation succeeds. So a batch runs its operations bare, back to back in
//! the transaction; the first one that fails (an error or a caught panic)
//! makes the leader ROLLBACK the whole transaction, BEGIN IMMEDIATE again
//! and run every operation taken so far again, each in its own savepoint,
//! then go on that way. The one that failed fails again in its savepoint and
//! only its work is undone, as if the batch had used savepoints throughout:
//! nothing was answered yet, and a body that runs twice is what PostgreSQL's
//! retries already require (tests/it/reruns.rs). A batch after one with a
//! failing operation starts with savepoints, so a stream of failing
//! operations does not run each batch twice.

use crate::error::Error;
use parking_lot::Mutex;
use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::Connection;
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::Thread;
use std::time::{Duration, Instant};

pub const GROUP_COMMIT_MAX_DEFAULT: usize = 64;
pub const GROUP_COMMIT_WAIT_US_DEFAULT: u64 = 0;

type Pooled = r2d2::PooledConnection<SqliteConnectionManager>;

/// What `/metrics` reads: batches committed (or failed) and the operations in them.
#[derive(Debug, Default)]
pub struct GroupCommitCounters {
    pub batches: AtomicU64,
    pub operations: AtomicU64,
    /// Batches run again with savepoints after an operation failed bare.
    pub reruns: AtomicU64,
}

pub(in crate::store) struct GroupCommitter {
    max: usize,
    wait: Duration,
    state: Mutex<State>,
    pub(in crate::store) counters: GroupCommitCounters,
    /// Test hook: the next COMMIT fails (it rolls back instead).
    fail_next_commit: AtomicBool,
    /// Test hook: the next batch's leader panics after its operations ran,
    /// before its COMMIT, outside any operation.
    panic_next_leader: AtomicBool,
    /// The last batch had an operation that failed: the next one starts
    /// with savepoints (and so on while operations keep failing).
    failed_last_batch: AtomicBool,
}

/// One operation's work, type-erased: runs it on the writer connection,
/// bare or in its own savepoint, and keeps the result where its caller will
/// read it (see [`Step`]).
type Job<'a> = dyn FnMut(&Connection, Isolation) -> Step + Send + 'a;

/// How an operation runs inside its batch's transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isolation {
    /// Directly in the transaction: a failure can only be undone with the
    /// whole transaction.
    Bare,
    /// In `SAVEPOINT op`: a failure undoes this operation's work alone.
    Savepoint,
}

/// What running one job told the leader.
enum Step {
    /// Its result is kept for its caller; `failed`: that result is an
    /// error (possible in savepoint mode only).
    Done { failed: bool },
    /// It failed bare: its result is not kept; the batch runs again with savepoints.
    FailedBare,
    /// The transaction is gone: every operation of the batch fails with this.
    Poisoned(String),
}

/// A queued operation: its job, on its caller's stack, and the thread to wake.
///
/// The caller of [`GroupCommitter::run`] does not return before its slot's
/// batch is over (its `finished` entry is set), and nobody touches the job
/// after that, so the pointer is valid whenever the leader uses it.
struct Slot {
    ticket: u64,
    job: *mut Job<'static>,
    thread: Thread,
}

// SAFETY: the job is `Send`; the pointer is dereferenced by one thread at a
// time (the leader), while its owner is blocked in `run` (see `Slot`).
unsafe impl Send for Slot {}

#[derive(Default)]
struct State {
    /// The writer connection, here while nobody leads.
    conn: Option<Pooled>,
    /// A thread is leading a batch.
    leading: bool,
    /// The leader is waiting `--group-commit-wait-us` for more operations.
    leader_waiting: Option<Thread>,
    /// Operations waiting for a leader, oldest first.
    queue: VecDeque<Slot>,
    /// Tickets whose batch is over, with the batch's outcome, until their
    /// callers read them.
    finished: Vec<(u64, Result<(), Error>)>,
    next_ticket: u64,
}

/// How one operation's savepoint ended.
enum Ran<T> {
    Done(Result<T, Error>),
    /// The transaction is gone (SQLite rolled it back, or a savepoint
    /// statement failed): the whole batch fails.
    Poisoned(Error),
}

impl GroupCommitter {
    pub(in crate::store) fn new(max: usize, wait_us: u64) -> GroupCommitter {
        GroupCommitter {
            max: max.max(1),
            wait: Duration::from_micros(wait_us),
            state: Mutex::new(State::default()),
            counters: GroupCommitCounters::default(),
            fail_next_commit: AtomicBool::new(false),
            panic_next_leader: AtomicBool::new(false),
            failed_last_batch: AtomicBool::new(false),
        }
    }

    #[cfg(any(test, feature = "test-support"))]
    pub(in crate::store) fn panic_next_leader(&self) {
        self.panic_next_leader.store(true, Ordering::SeqCst);
    }

    #[cfg(any(test, feature = "test-support"))]
    pub(in crate::store) fn fail_next_commit(&self) {
        self.fail_next_commit.store(true, Ordering::SeqCst);
    }

    /// Operations waiting for a leader right now (tests use it to know a batch is forming).
    #[cfg(any(test, feature = "test-support"))]
    pub(in crate::store) fn queued(&self) -> usize {
        self.state.lock().queue.len()
    }

    /// Runs `work` as one operation of a batch; returns once the batch's
    /// COMMIT returned (or failed). `connect` gives the writer connection
    /// the first time one is needed.
    pub(in crate::store) fn run<T: Send>(
        &self,
        connect: impl Fn() -> Result<Pooled, Error>,
        work: &mut (dyn FnMut(&Connection) -> Result<T, Error> + Send),
    ) -> Result<T, Error> {
        let mut ran: Option<Ran<T>> = None;
        let mut job = |conn: &Connection, isolation: Isolation| {
            let result = match isolation {
                Isolation::Bare => match run_bare(conn, work) {
                    Some(result) => result,
                    None => return Step::FailedBare,
                },
                Isolation::Savepoint => run_in_savepoint(conn, work),
            };
            let step = match &result {
                Ran::Poisoned(e) => Step::Poisoned(e.message.clone()),
                Ran::Done(result) => Step::Done { failed: result.is_err() },
            };
            ran = Some(result);
            step
        };
        let job: *mut Job<'_> = &mut job;
        // SAFETY: only the lifetime is erased. This function does not return
        // while the slot is queued or in a batch (the loop below leaves only
        // once its ticket is finished); if its own `lead` unwinds, that
        // batch is finished by `Batch`'s Drop and the slot leaves the queue
        // in `Unqueue`'s; nobody uses the job after that (see `Slot`).
        let job: *mut Job<'static> = unsafe { std::mem::transmute::<*mut Job<'_>, *mut Job<'static>>(job) };

        let mut state = self.state.lock();
        let ticket = state.next_ticket;
        state.next_ticket += 1;
        state.queue.push_back(Slot { ticket, job, thread: std::thread::current() });
        if let Some(leader) = &state.leader_waiting {
            leader.unpark();
        }
        // Only this thread's own `lead` can unwind out of the loop below;
        // then its slot, if still queued, must not outlive this frame.
        let _unqueue_on_unwind = Unqueue { committer: self, ticket };
        let outcome = loop {
            if let Some(at) = state.finished.iter().position(|(t, _)| *t == ticket) {
                debug_assert!(
                    state.queue.iter().all(|slot| slot.ticket != ticket),
                    "a finished ticket is no longer queued"
                );
                break state.finished.swap_remove(at).1;
            }
            if state.leading {
                drop(state);
                std::thread::park();
            } else {
                state.leading = true;
                let taken = state.conn.take();
                drop(state);
                self.lead(taken, &connect);
            }
            state = self.state.lock();
        };
        drop(state);
        match (outcome, ran) {
            (Ok(()), Some(Ran::Done(result))) => result,
            (Ok(()), Some(Ran::Poisoned(e))) => Err(e),
            (Ok(()), None) => Err(Error::internal("the operation's batch committed without running it")),
            (Err(e), _) => Err(e),
        }
    }

    /// Leads one batch: the queued operations, oldest first, up to
    /// `--group-commit-max`, in one transaction; then publishes its outcome
    /// and gives up leadership (the caller leads again if its own operation
    /// did not fit in this batch).
    fn lead(&self, taken: Option<Pooled>, connect: &dyn Fn() -> Result<Pooled, Error>) {
        let mut batch = Batch { committer: self, members: Vec::new(), conn: None };
        let outcome = self.run_batch(&mut batch, taken, connect);
        batch.publish(outcome);
    }

    /// BEGIN, the operations, COMMIT; the operations taken are `batch.members`.
    fn run_batch(
        &self,
        batch: &mut Batch<'_>,
        taken: Option<Pooled>,
        connect: &dyn Fn() -> Result<Pooled, Error>,
    ) -> Result<(), Error> {
        // Without a connection or a transaction nothing can run: the oldest
        // operation fails with the reason (`database_busy` after another
        // process held the file past the busy timeout), the rest stay queued.
        let conn = match taken.map_or_else(connect, Ok) {
            Ok(conn) => batch.conn.insert(conn),
            Err(e) => {
                batch.take_next();
                return Err(e);
            }
        };
        // BEGIN and COMMIT through the statement cache, as SAVEPOINT and RELEASE.
        if let Err(e) = conn.prepare_cached("BEGIN IMMEDIATE").and_then(|mut s| s.execute([])) {
            batch.take_next();
            return Err(e.into());
        }
        let mut isolation =
            if self.failed_last_batch.swap(false, Ordering::Relaxed) { Isolation::Savepoint } else { Isolation::Bare };
        while let Some((ticket, job)) = batch.take_next() {
            // A job runs only as a member of the batch that will finish its
            // ticket: that is what keeps its caller blocked meanwhile.
            assert_eq!(batch.members.last().map(|(t, _, _)| *t), Some(ticket), "the job's ticket is a member");
            let conn = batch.conn.as_ref().expect("the batch's connection");
            // SAFETY: see `Slot`: the job's owner is blocked in `run` until
            // `publish` finishes its ticket, and only this thread uses it.
            match unsafe { (*job)(conn, isolation) } {
                Step::Done { failed } => {
                    if failed {
                        self.failed_last_batch.store(true, Ordering::Relaxed);
                    }
                }
                Step::Poisoned(why) => return Err(did_not_commit(&why)),
                Step::FailedBare => {
                    isolation = Isolation::Savepoint;
                    self.counters.reruns.fetch_add(1, Ordering::Relaxed);
                    self.failed_last_batch.store(true, Ordering::Relaxed);
                    self.rerun_with_savepoints(batch)?;
                }
            }
            if batch.members.len() >= self.max || self.queue_empty_after_wait() {
                break;
            }
        }
        assert!(batch.members.len() <= self.max, "a batch holds at most --group-commit-max operations");
        if self.panic_next_leader.swap(false, Ordering::SeqCst) {
            panic!("the batch's leader panics outside any operation (test hook)");
        }
        self.commit(batch.conn.as_ref().expect("the batch's connection"))
    }

    /// After an operation failed bare: the whole transaction is rolled
    /// back and begun again, and every operation the batch took runs again,
    /// oldest first, each in its own savepoint (module docs).
    fn rerun_with_savepoints(&self, batch: &mut Batch<'_>) -> Result<(), Error> {
        let conn = batch.conn.as_ref().expect("the batch's connection");
        if !conn.is_autocommit() {
            conn.execute_batch("ROLLBACK").map_err(|e| did_not_commit(&e.to_string()))?;
        }
        conn.prepare_cached("BEGIN IMMEDIATE")
            .and_then(|mut s| s.execute([]))
            .map_err(|e| did_not_commit(&e.to_string()))?;
        for (_, _, job) in &batch.members {
            // SAFETY: as in `run_batch`: every member's owner is blocked in `run`.
            match unsafe { (**job)(conn, Isolation::Savepoint) } {
                Step::Done { .. } => {}
                Step::Poisoned(why) => return Err(did_not_commit(&why)),
                Step::FailedBare => unreachable!("a job run in its savepoint keeps its result"),
            }
        }
        Ok(())
    }

    /// Whether no operation is queued, after waiting up to
    /// `--group-commit-wait-us` for one.
    fn queue_empty_after_wait(&self) -> bool {
        let mut state = self.state.lock();
        if !state.queue.is_empty() || self.wait.is_zero() {
            return state.queue.is_empty();
        }
        let deadline = Instant::now() + self.wait;
        state.leader_waiting = Some(std::thread::current());
        while state.queue.is_empty() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            drop(state);
            std::thread::park_timeout(deadline - now);
            state = self.state.lock();
        }
        state.leader_waiting = None;
        state.queue.is_empty()
    }

    fn commit(&self, conn: &Connection) -> Result<(), Error> {
        if self.fail_next_commit.swap(false, Ordering::SeqCst) {
            return Err(did_not_commit("injected COMMIT failure (test hook)"));
        }
        conn.prepare_cached("COMMIT")
            .and_then(|mut s| s.execute([]))
            .map(drop)
            .map_err(|e| did_not_commit(&e.to_string()))
    }
}

/// Every operation of a batch whose transaction did not commit gets this.
fn did_not_commit(why: &str) -> Error {
    Error::internal(format!("the batch's transaction did not commit: {why}"))
}

/// Takes a caller's slot out of the queue when its thread unwinds (a panic
/// in its own `lead` outside any operation), so no later leader runs a job
/// whose stack frame is gone.
struct Unqueue<'c> {
    committer: &'c GroupCommitter,
    ticket: u64,
}

impl Drop for Unqueue<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let mut state = self.committer.state.lock();
            state.queue.retain(|slot| slot.ticket != self.ticket);
            state.finished.retain(|(ticket, _)| *ticket != self.ticket);
        }
    }
}

/// The batch being led: the operations it took (ticket and thread) and the
/// connection. [`Batch::publish`] ends it; if the leader unwinds before
/// that, `Drop` ends it with a failure, so no caller waits forever and no
/// job is used after its caller returned.
struct Batch<'c> {
    committer: &'c GroupCommitter,
    /// Ticket, thread to wake, job (run again after a bare failure).
    members: Vec<(u64, Thread, *mut Job<'static>)>,
    conn: Option<Pooled>,
}

impl Batch<'_> {
    /// The oldest queued operation's ticket and job, now part of this batch.
    fn take_next(&mut self) -> Option<(u64, *mut Job<'static>)> {
        let mut state = self.committer.state.lock();
        assert!(state.leading, "only a batch's leader takes operations");
        let slot = state.queue.pop_front()?;
        debug_assert!(state.queue.iter().all(|queued| queued.ticket != slot.ticket), "a ticket is queued once");
        drop(state);
        debug_assert!(self.members.iter().all(|(t, _, _)| *t != slot.ticket), "a ticket joins one batch once");
        self.members.push((slot.ticket, slot.thread, slot.job));
        Some((slot.ticket, slot.job))
    }

    fn publish(mut self, outcome: Result<(), Error>) {
        self.end(outcome);
        std::mem::forget(self);
    }

    /// Rolls back what did not commit, gives the connection back, finishes
    /// every ticket of the batch with `outcome`, releases leadership, and
    /// wakes, if operations are still queued, the oldest one's thread, to
    /// lead the next batch, and then the batch's callers. The next leader
    /// first: waking a batch's callers takes a system call each, and the
    /// next batch, which is the writer's serial path, should not wait for
    /// them.
    fn end(&mut self, outcome: Result<(), Error>) {
        let committer = self.committer;
        if let Some(conn) = &self.conn {
            if outcome.is_err() && !conn.is_autocommit() {
                let _ = conn.execute_batch("ROLLBACK");
            }
        }
        committer.counters.batches.fetch_add(1, Ordering::Relaxed);
        committer.counters.operations.fetch_add(self.members.len() as u64, Ordering::Relaxed);
        let mut state = committer.state.lock();
        assert!(state.leading, "a batch ends while its leader still leads");
        if let Some(conn) = self.conn.take() {
            state.conn = Some(conn);
        }
        for (ticket, _, _) in &self.members {
            debug_assert!(state.queue.iter().all(|slot| slot.ticket != *ticket), "a member left the queue");
            state.finished.push((*ticket, outcome.clone()));
        }
        state.leading = false;
        let next_leader = state.queue.front().map(|slot| slot.thread.clone());
        drop(state);
        if let Some(thread) = next_leader {
            thread.unpark();
        }
        for (_, thread, _) in self.members.drain(..) {
            thread.unpark();
        }
    }
}

impl Drop for Batch<'_> {
    fn drop(&mut self) {
        self.end(Err(did_not_commit("the batch's leader panicked outside any operation")));
    }
}

/// The work directly in the transaction. `None` when it failed (an error
/// or a caught panic) with the transaction still open: its writes cannot
/// be undone alone, so the batch runs again with savepoints, and this
/// result is not kept. A transaction SQLite ended is the batch's failure.
fn run_bare<T>(conn: &Connection, work: &mut (dyn FnMut(&Connection) -> Result<T, Error> + Send)) -> Option<Ran<T>> {
    if conn.is_autocommit() {
        return Some(Ran::Poisoned(Error::internal("no open transaction for the operation")));
    }
    let result = catch_unwind(AssertUnwindSafe(|| work(conn)));
    if conn.is_autocommit() {
        let why = match result {
            Ok(Err(e)) => e.message,
            _ => "SQLite ended the transaction".to_owned(),
        };
        return Some(Ran::Poisoned(Error::internal(format!("the batch's transaction was rolled back: {why}"))));
    }
    match result {
        Ok(Ok(value)) => Some(Ran::Done(Ok(value))),
        Ok(Err(_)) | Err(_) => None,
    }
}

/// `SAVEPOINT op`; the work; `RELEASE op` on success, `ROLLBACK TO op;
/// RELEASE op` on an error or a panic. After a failure, SQLite may have
/// rolled the whole transaction back (FULL, IOERR, NOMEM, BUSY): then the
/// connection is in autocommit and the batch is poisoned. A SAVEPOINT is
/// never opened in autocommit mode (it would start a DEFERRED transaction).
fn run_in_savepoint<T>(conn: &Connection, work: &mut (dyn FnMut(&Connection) -> Result<T, Error> + Send)) -> Ran<T> {
    if conn.is_autocommit() {
        return Ran::Poisoned(Error::internal("no open transaction for the savepoint"));
    }
    // Through the statement cache: these run once per operation, on the writer.
    if let Err(e) = conn.prepare_cached("SAVEPOINT op").and_then(|mut s| s.execute([])) {
        return Ran::Poisoned(e.into());
    }
    let result = match catch_unwind(AssertUnwindSafe(|| work(conn))) {
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
