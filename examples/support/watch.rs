//! Counters from inside SQLite and from /proc, for `bench` (examples/bench.rs):
//! where a payment's CPU time goes, measured without touching payonce.
//!
//! - **The writer's CPU.** payonce has no writer thread of its own: the
//!   worker that finds no batch running leads one and runs every queued
//!   operation itself (src/store/sqlite/group_commit.rs), so the writer is
//!   whichever worker leads. A trace callback (`sqlite3_trace_v2`) on each of
//!   payonce's connections reads the calling thread's CPU clock when a
//!   `BEGIN IMMEDIATE` starts and again when its `COMMIT` (or `ROLLBACK`)
//!   has finished, on the same thread; the sum over batches is the CPU the
//!   writer spent inside its transactions: every operation's SQL and the
//!   payonce code between the statements, the COMMIT's WAL writes and
//!   checkpoints (the fsync itself waits off-CPU). It leaves out the
//!   leader's queue handling before BEGIN and its wake-ups of the batch's
//!   callers after COMMIT. The callback is installed on payonce's
//!   connections from an auto extension (`sqlite3_auto_extension`), which
//!   SQLite runs for every connection opened afterwards; it costs two
//!   clock reads per batch and a string comparison per statement.
//! - **WAL frames per COMMIT**, from a WAL hook (`sqlite3_wal_hook`) that
//!   also checkpoints at 1,000 frames as SQLite's own autocheckpoint hook
//!   does (installing a hook replaces that one), so checkpoints still
//!   happen where they would. SQLite sets its own hook when a connection
//!   opens, after the auto extensions; on payonce's connections ours is set
//!   when a `BEGIN IMMEDIATE` starts.
//! - **Per statement** (only when asked: two more clock reads per
//!   statement, which slows the writer): the thread CPU of each statement
//!   run inside a `BEGIN IMMEDIATE` transaction, and how often each trigger
//!   fired.
//! - **Per thread**, from /proc/self/task: on-CPU time (`schedstat`) and
//!   voluntary context switches (each one a wait for a wake-up) of
//!   payonce's edge (`payonce-io`) and worker (`payonce-worker-N`) threads.
#![allow(dead_code)]

use rusqlite::ffi;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// SQLite's default `wal_autocheckpoint`: the frames after which a COMMIT checkpoints.
const AUTOCHECKPOINT_FRAMES: c_int = 1000;

/// What one database's connections did: transactions, WAL frames, statements.
pub struct Watch {
    /// `BEGIN IMMEDIATE ... COMMIT | ROLLBACK` transactions finished.
    batches: AtomicU64,
    /// Thread CPU inside them, ns.
    batch_cpu_ns: AtomicU64,
    /// WAL frames appended by COMMITs, and the COMMITs.
    wal_frames: AtomicU64,
    wal_commits: AtomicU64,
    /// Frames in the WAL after the last COMMIT (the log restarts after a checkpoint).
    wal_last: AtomicU64,
    /// Per-statement counting is on.
    profiling: AtomicBool,
    statements: Mutex<BTreeMap<Box<str>, Cost>>,
    triggers: Mutex<BTreeMap<Box<str>, u64>>,
}

/// Runs and thread CPU of one statement text.
#[derive(Clone, Copy, Default)]
pub struct Cost {
    pub runs: u64,
    pub cpu_ns: u64,
}

/// Per-statement costs (statement text with its whitespace collapsed) and
/// trigger firings.
#[derive(Default)]
pub struct Profile {
    pub statements: Vec<(String, Cost)>,
    pub triggers: Vec<(String, u64)>,
}

/// A reading of a [`Watch`]'s counters; subtract two for a phase.
#[derive(Clone, Copy, Default, Debug)]
pub struct WatchTotals {
    pub batches: u64,
    pub batch_cpu_ns: u64,
    pub wal_frames: u64,
    pub wal_commits: u64,
}

impl WatchTotals {
    pub fn since(self, before: WatchTotals) -> WatchTotals {
        WatchTotals {
            batches: self.batches - before.batches,
            batch_cpu_ns: self.batch_cpu_ns - before.batch_cpu_ns,
            wal_frames: self.wal_frames - before.wal_frames,
            wal_commits: self.wal_commits - before.wal_commits,
        }
    }

    pub fn add(&mut self, other: WatchTotals) {
        self.batches += other.batches;
        self.batch_cpu_ns += other.batch_cpu_ns;
        self.wal_frames += other.wal_frames;
        self.wal_commits += other.wal_commits;
    }
}

impl Watch {
    pub const fn new() -> Watch {
        Watch {
            batches: AtomicU64::new(0),
            batch_cpu_ns: AtomicU64::new(0),
            wal_frames: AtomicU64::new(0),
            wal_commits: AtomicU64::new(0),
            wal_last: AtomicU64::new(0),
            profiling: AtomicBool::new(false),
            statements: Mutex::new(BTreeMap::new()),
            triggers: Mutex::new(BTreeMap::new()),
        }
    }

    pub fn totals(&self) -> WatchTotals {
        WatchTotals {
            batches: self.batches.load(Ordering::SeqCst),
            batch_cpu_ns: self.batch_cpu_ns.load(Ordering::SeqCst),
            wal_frames: self.wal_frames.load(Ordering::SeqCst),
            wal_commits: self.wal_commits.load(Ordering::SeqCst),
        }
    }

    /// Turns per-statement counting on or off.
    pub fn profile(&self, on: bool) {
        self.profiling.store(on, Ordering::SeqCst);
    }

    /// Per-statement costs and trigger firings so far, then cleared.
    pub fn take_profile(&self) -> Profile {
        let statements = std::mem::take(&mut *self.statements.lock().unwrap_or_else(|e| e.into_inner()));
        let triggers = std::mem::take(&mut *self.triggers.lock().unwrap_or_else(|e| e.into_inner()));
        let collapse = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
        Profile {
            statements: statements.iter().map(|(sql, cost)| (collapse(sql), *cost)).collect(),
            triggers: triggers.iter().map(|(name, n)| (collapse(name), *n)).collect(),
        }
    }

    fn note_statement(&self, sql: &str, cpu_ns: u64) {
        let mut statements = self.statements.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(cost) = statements.get_mut(sql) {
            cost.runs += 1;
            cost.cpu_ns += cpu_ns;
        } else {
            statements.insert(sql.into(), Cost { runs: 1, cpu_ns });
        }
    }

    fn note_trigger(&self, what: &str) {
        let mut triggers = self.triggers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = triggers.get_mut(what) {
            *n += 1;
        } else {
            triggers.insert(what.into(), 1);
        }
    }
}

impl Default for Watch {
    fn default() -> Watch {
        Watch::new()
    }
}

/// The calling thread's CPU time (user + system), ns.
pub fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// The whole process's CPU time, every thread (also those that ended), ns.
pub fn process_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid timespec to write into.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return 0;
    }
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

// ---- payonce's connections, from an auto extension ----

/// The database file whose connections get `PAYONCE`'s hooks, and the
/// counters they feed.
static TARGET: OnceLock<(String, &'static Watch)> = OnceLock::new();

/// From now on, every connection opened to `db_path` (as SQLite names it:
/// the absolute path) is watched by `watch`. Once per process.
pub fn watch_connections_to(db_path: &str, watch: &'static Watch) -> Result<(), String> {
    TARGET.set((db_path.to_owned(), watch)).map_err(|_| "connections are watched already".to_owned())?;
    // SAFETY: registers a function with the signature SQLite calls it with.
    let rc = unsafe { ffi::sqlite3_auto_extension(Some(on_open)) };
    if rc == ffi::SQLITE_OK {
        Ok(())
    } else {
        Err(format!("sqlite3_auto_extension failed: {rc}"))
    }
}

unsafe extern "C" fn on_open(
    db: *mut ffi::sqlite3,
    _err: *mut *mut c_char,
    _api: *const ffi::sqlite3_api_routines,
) -> c_int {
    let Some((target, watch)) = TARGET.get() else { return ffi::SQLITE_OK };
    // SAFETY: `db` is the connection being opened; "main" names its file.
    let name = unsafe { ffi::sqlite3_db_filename(db, c"main".as_ptr()) };
    if name.is_null() {
        return ffi::SQLITE_OK;
    }
    // SAFETY: SQLite returns a NUL-terminated path that lives as long as the connection.
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
    if name == target.as_str() {
        // SAFETY: an open connection, and a watch that lives for the process.
        unsafe { install(db, watch, true, true) };
    }
    ffi::SQLITE_OK
}

/// Installs the hooks on `conn`, a connection the caller owns.
pub fn watch_connection(conn: &rusqlite::Connection, watch: &'static Watch, trace: bool) {
    // SAFETY: the handle of an open connection, used only to register hooks
    // on it; `watch` lives for the process.
    unsafe { install(conn.handle(), watch, trace, true) };
}

/// # Safety
/// `db` is an open connection.
unsafe fn install(db: *mut ffi::sqlite3, watch: &'static Watch, trace: bool, wal: bool) {
    let context = watch as *const Watch as *mut c_void;
    if trace {
        let mask = (ffi::SQLITE_TRACE_STMT | ffi::SQLITE_TRACE_PROFILE) as c_uint;
        // SAFETY: per the caller; the callback reads `context` as a `&'static Watch`.
        unsafe { ffi::sqlite3_trace_v2(db, mask, Some(on_trace), context) };
    }
    if wal {
        // SAFETY: as above.
        unsafe { ffi::sqlite3_wal_hook(db, Some(on_wal_commit), context) };
    }
}

thread_local! {
    /// Thread CPU when this thread's `BEGIN IMMEDIATE` started (a batch is open).
    static BATCH_STARTED_NS: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
    /// Statements running on this thread inside a batch, with their starting thread CPU.
    static RUNNING: std::cell::RefCell<Vec<(usize, u64)>> = const { std::cell::RefCell::new(Vec::new()) };
}

unsafe extern "C" fn on_trace(kind: c_uint, context: *mut c_void, p: *mut c_void, x: *mut c_void) -> c_int {
    // SAFETY: `context` is the `&'static Watch` given at install.
    let watch = unsafe { &*(context as *const Watch) };
    if kind == ffi::SQLITE_TRACE_STMT as c_uint {
        // X: the statement's text, or "-- TRIGGER name" when a trigger starts.
        // SAFETY: SQLite passes a NUL-terminated string.
        let text = unsafe { CStr::from_ptr(x as *const c_char) }.to_bytes();
        if text == b"BEGIN IMMEDIATE" {
            // SQLite installs its autocheckpoint hook after the auto
            // extensions ran, replacing ours: (re)install it here, on the
            // writing connection, before its COMMIT.
            // SAFETY: P is a statement of an open connection, which is running it.
            unsafe { install(ffi::sqlite3_db_handle(p as *mut ffi::sqlite3_stmt), watch, false, true) };
            BATCH_STARTED_NS.with(|b| b.set(Some(thread_cpu_ns())));
            RUNNING.with(|r| r.borrow_mut().clear());
        } else if watch.profiling.load(Ordering::Relaxed) && BATCH_STARTED_NS.with(|b| b.get()).is_some() {
            if text.starts_with(b"--") {
                watch.note_trigger(&String::from_utf8_lossy(text));
            } else {
                RUNNING.with(|r| r.borrow_mut().push((p as usize, thread_cpu_ns())));
            }
        }
    } else if kind == ffi::SQLITE_TRACE_PROFILE as c_uint {
        let Some(started) = BATCH_STARTED_NS.with(|b| b.get()) else { return 0 };
        // SAFETY: P is the statement that finished; its text lives as long as it does.
        let sql = unsafe { ffi::sqlite3_sql(p as *mut ffi::sqlite3_stmt) };
        if sql.is_null() {
            return 0;
        }
        // SAFETY: NUL-terminated, owned by the statement.
        let sql = unsafe { CStr::from_ptr(sql) }.to_bytes();
        let ended = sql == b"COMMIT" || sql == b"ROLLBACK";
        if watch.profiling.load(Ordering::Relaxed) || ended {
            let now = thread_cpu_ns();
            if watch.profiling.load(Ordering::Relaxed) {
                let began = RUNNING.with(|r| {
                    let mut running = r.borrow_mut();
                    let at = running.iter().rposition(|(stmt, _)| *stmt == p as usize)?;
                    Some(running.swap_remove(at).1)
                });
                if let Some(began) = began {
                    watch.note_statement(&String::from_utf8_lossy(sql), now.saturating_sub(began));
                }
            }
            if ended {
                watch.batches.fetch_add(1, Ordering::SeqCst);
                watch.batch_cpu_ns.fetch_add(now.saturating_sub(started), Ordering::SeqCst);
                BATCH_STARTED_NS.with(|b| b.set(None));
            }
        }
    }
    0
}

unsafe extern "C" fn on_wal_commit(
    context: *mut c_void,
    db: *mut ffi::sqlite3,
    schema: *const c_char,
    frames: c_int,
) -> c_int {
    // SAFETY: `context` is the `&'static Watch` given at install.
    let watch = unsafe { &*(context as *const Watch) };
    let frames = frames.max(0) as u64;
    let last = watch.wal_last.swap(frames, Ordering::SeqCst);
    // After a checkpoint the next COMMIT starts the log from its beginning.
    let appended = if frames > last { frames - last } else { frames };
    watch.wal_frames.fetch_add(appended, Ordering::SeqCst);
    watch.wal_commits.fetch_add(1, Ordering::SeqCst);
    if frames >= AUTOCHECKPOINT_FRAMES as u64 {
        // What SQLite's default hook does at wal_autocheckpoint frames.
        // SAFETY: the connection and schema name SQLite passed to this hook.
        unsafe { ffi::sqlite3_wal_checkpoint(db, schema) };
    }
    ffi::SQLITE_OK
}

// ---- threads ----

/// On-CPU time and voluntary context switches of some of this process's threads.
#[derive(Clone, Copy, Default, Debug)]
pub struct ThreadTotals {
    /// payonce's HTTP edge: the tokio runtime's threads (`payonce-io`).
    pub edge_ns: u64,
    pub edge_switches: u64,
    /// payonce's worker threads (`payonce-worker-N`), the writer among them.
    pub workers_ns: u64,
    pub workers_switches: u64,
    /// The whole process, every thread (also those that ended), ns.
    pub process_ns: u64,
    /// The process's CPU when the reading ended: reading /proc costs some.
    process_after_reading_ns: u64,
}

impl ThreadTotals {
    /// Reads /proc/self/task/*. Both of `bench`'s servers name their threads
    /// alike; the one not being driven adds almost nothing.
    pub fn now() -> ThreadTotals {
        let mut totals = ThreadTotals { process_ns: process_cpu_ns(), ..ThreadTotals::default() };
        totals.read_tasks();
        totals.process_after_reading_ns = process_cpu_ns();
        totals
    }

    fn read_tasks(&mut self) {
        let totals = self;
        let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return };
        for task in tasks.flatten() {
            let dir = task.path();
            let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
            let (ns, switches) = (schedstat_ns(&dir), voluntary_switches(&dir));
            if comm.starts_with("payonce-io") {
                totals.edge_ns += ns;
                totals.edge_switches += switches;
            } else if comm.starts_with("payonce-worker") {
                totals.workers_ns += ns;
                totals.workers_switches += switches;
            }
        }
    }

    /// What happened between two readings; the process's CPU leaves out
    /// both readings' own.
    pub fn since(self, before: ThreadTotals) -> ThreadTotals {
        ThreadTotals {
            edge_ns: self.edge_ns.saturating_sub(before.edge_ns),
            edge_switches: self.edge_switches.saturating_sub(before.edge_switches),
            workers_ns: self.workers_ns.saturating_sub(before.workers_ns),
            workers_switches: self.workers_switches.saturating_sub(before.workers_switches),
            process_ns: self.process_ns.saturating_sub(before.process_after_reading_ns),
            process_after_reading_ns: 0,
        }
    }

    pub fn add(&mut self, other: ThreadTotals) {
        self.edge_ns += other.edge_ns;
        self.edge_switches += other.edge_switches;
        self.workers_ns += other.workers_ns;
        self.workers_switches += other.workers_switches;
        self.process_ns += other.process_ns;
    }
}

/// The first field of /proc/self/task/TID/schedstat: time on a CPU, ns.
fn schedstat_ns(task: &std::path::Path) -> u64 {
    std::fs::read_to_string(task.join("schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

fn voluntary_switches(task: &std::path::Path) -> u64 {
    std::fs::read_to_string(task.join("status"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| l.strip_prefix("voluntary_ctxt_switches:")).and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}
