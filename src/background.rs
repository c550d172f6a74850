//! Background workers of `payonce serve`, each on its own thread, on the
//! same exactly-once operations as the API, stopping when the shutdown flag
//! is set:
//!
//! - the platform-call pool (`spawn_platform_worker`), a worker of `src/outgoing/`;
//! - the sweeper: while the mode is normal, decides records that waited in
//!   record-only mode (in arrival order) and then closes PENDING orders past
//!   `expires_at`; always removes expired Idempotency-Key results;
//! - the inspector: runs the inspection and logs each finding as an error;
//! - the storage watch: about once a second, checks that the database's
//!   paths still name the files payonce has open, and once they do not,
//!   logs an error every few seconds until payonce is restarted;
//! - the key refresh: about once a second, lets each platform download the
//!   certificates its schedule says are due (WeChat Pay's
//!   `--wechatpay-cert-refresh-s`), on its own thread, so no request waits;
//! - the signal handler: SIGINT, SIGTERM and SIGQUIT stop `serve`; SIGHUP
//!   re-reads every key and certificate file; SIGUSR1 and SIGUSR2 are
//!   logged, not obeyed.

use crate::app::App;
use crate::error::Error;
use crate::log;
use crate::ops::Mode;
use crate::outgoing::{self, AtShutdown, Claimed, Queue, Shape};
use crate::services::PlatformCalls;
use crate::store::PlatformCallRow;
use crate::store::Signal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Orders closed, or expired Idempotency-Key results removed, per sweep
/// batch; the sweep repeats batches until none are due.
pub const SWEEP_BATCH_MAX: usize = 500;
pub const SWEEP_INTERVAL_S_DEFAULT: u64 = 1;
pub const INSPECT_INTERVAL_S_DEFAULT: u64 = 300;
/// How often a sleeping worker looks at the shutdown flag.
const SHUTDOWN_POLL_MS: u64 = 100;
/// How often the storage watch looks at the database's paths (writes also
/// look, after each commit).
pub const STORAGE_CHECK_INTERVAL_MS: u64 = 1_000;
/// How often a lost storage is logged again, until the restart.
pub const STORAGE_LOST_LOG_INTERVAL_MS: u64 = 5_000;

pub fn spawn_sweeper(app: Arc<App>, interval: Duration, shutdown: Arc<AtomicBool>) -> std::io::Result<JoinHandle<()>> {
    thread::Builder::new().name("payonce-sweeper".into()).spawn(move || {
        while sleep_unless_shutdown(interval, &shutdown) {
            sweep_once(&app, &shutdown);
        }
    })
}

/// One round of the sweeper (what it does every `--sweep-interval-s`).
pub fn sweep_once(app: &App, shutdown: &AtomicBool) {
    // Every write would be refused; the storage watch says so, once every few seconds.
    if !app.operations().storage_writable() {
        return;
    }
    let mode = match app.operations().mode() {
        Ok(mode) => mode,
        Err(e) => {
            log::warn("reading the mode failed, will retry", &[("error", &e)]);
            return;
        }
    };
    // Back to normal: the records kept in record-only mode are decided first,
    // in arrival order, so a payment that arrived in time is not judged
    // against an order the sweeper closed meanwhile.
    if mode == Mode::Normal {
        match app.operations().received_waiting().and_then(|n| {
            if n > 0 {
                app.operations().drain().map(Some)
            } else {
                Ok(None)
            }
        }) {
            Ok(Some(n)) => log::info("decided records kept in record-only mode", &[("decided", &n)]),
            Ok(None) => {}
            Err(e) => log::warn("draining record-only records failed, will retry", &[("error", &e)]),
        }
    }
    // Record-only freezes order state too: no order expires while payments
    // for it may be waiting undecided.
    if mode == Mode::Normal {
        in_batches_until_none_due(shutdown, "expiry sweep failed, will retry", || {
            app.orders().close_expired(SWEEP_BATCH_MAX)
        });
    }
    // Batches until none is due, like the expiry above: one batch per sweep
    // fell behind any keyed load faster than SWEEP_BATCH_MAX per interval,
    // and the table then grew without bound.
    in_batches_until_none_due(shutdown, "purging expired Idempotency-Key results failed, will retry", || {
        app.operations().purge_expired_responses(SWEEP_BATCH_MAX)
    });
}

/// Runs `batch` (which does at most SWEEP_BATCH_MAX rows and says how many)
/// again while it found a full batch, so a sweep leaves nothing due behind.
/// Each batch is its own short write transaction: requests interleave.
fn in_batches_until_none_due(
    shutdown: &AtomicBool,
    failure: &str,
    batch: impl Fn() -> Result<usize, crate::error::Error>,
) {
    loop {
        match batch() {
            Ok(n) if n == SWEEP_BATCH_MAX && !shutdown.load(Ordering::SeqCst) => continue,
            Ok(_) => return,
            Err(e) => {
                log::warn(failure, &[("error", &e)]);
                return;
            }
        }
    }
}

/// Platform calls in flight at once in the platform-call pool.
pub const PLATFORM_POOL_SIZE: usize = 8;

/// The platform-call pool (docs/platforms.md): the leased-call worker of
/// `src/outgoing/` over the due `platform_call` rows (closes: ask, apply
/// or close at the platform, then the local close; refund submissions and
/// queries), while the mode is normal. It looks for due calls every
/// `interval` and after each call it made; its calls never hold up the
/// sweeper, which only queues them.
pub fn spawn_platform_worker(
    app: Arc<App>,
    interval: Duration,
    shutdown: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    let shape = Shape {
        name: "payonce-platform-calls",
        sender_name: "payonce-platform-call",
        concurrency: PLATFORM_POOL_SIZE,
        wake: Arc::new(Signal::default()),
        poll: interval,
        at_shutdown: AtShutdown::FinishCalls,
    };
    outgoing::spawn(Arc::new(PlatformPool(app)), shape, shutdown)
}

/// The pool's queue, owned by its threads: the `PlatformCalls` service of
/// the shared `App`, asked afresh for each step.
struct PlatformPool(Arc<App>);

impl Queue for PlatformPool {
    type Job = Claimed<PlatformCallRow>;
    type Done = ();
    const ROUND_FAILED: &'static str = <PlatformCalls<'static> as Queue>::ROUND_FAILED;

    fn ready(&self) -> bool {
        self.0.platform_calls().ready()
    }

    fn claim_due(&self, limit: usize) -> Result<Vec<Claimed<PlatformCallRow>>, Error> {
        self.0.platform_calls().claim_due(limit)
    }

    fn work(&self, call: &Claimed<PlatformCallRow>) {
        self.0.platform_calls().work(call)
    }
}

pub fn spawn_inspector(
    app: Arc<App>,
    interval: Duration,
    shutdown: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    thread::Builder::new().name("payonce-inspector".into()).spawn(move || {
        while sleep_unless_shutdown(interval, &shutdown) {
            match app.operations().inspect() {
                Ok(findings) => {
                    for f in &findings {
                        log::error(
                            "inspection finding",
                            &[("kind", &f.kind), ("order_no", &f.order_no), ("detail", &f.detail)],
                        );
                    }
                }
                Err(e) => log::warn("inspection failed, will retry", &[("error", &e)]),
            }
        }
    })
}

pub fn spawn_storage_watch(app: Arc<App>, shutdown: Arc<AtomicBool>) -> std::io::Result<JoinHandle<()>> {
    thread::Builder::new().name("payonce-storage-watch".into()).spawn(move || {
        let mut last_logged: Option<Instant> = None;
        while sleep_unless_shutdown(Duration::from_millis(STORAGE_CHECK_INTERVAL_MS), &shutdown) {
            if app.operations().storage_writable() {
                continue;
            }
            // Retries a rescue checkpoint still pending, then says it again.
            let Some((why, rescue)) = app.operations().storage_lost_state() else {
                continue;
            };
            let due = last_logged.is_none_or(|at| at.elapsed() >= Duration::from_millis(STORAGE_LOST_LOG_INTERVAL_MS));
            if due {
                log::error(
                    "storage lost: every write is refused (503 storage_lost); restart payonce",
                    &[("why", &why), ("wal_rescue", &rescue)],
                );
                last_logged = Some(Instant::now());
            }
        }
    })
}

/// How often the key refresh asks the platforms whether a download is due.
pub const KEY_REFRESH_POLL_MS: u64 = 1_000;

pub fn spawn_key_refresh(app: Arc<App>, shutdown: Arc<AtomicBool>) -> std::io::Result<JoinHandle<()>> {
    thread::Builder::new().name("payonce-key-refresh".into()).spawn(move || {
        while sleep_unless_shutdown(Duration::from_millis(KEY_REFRESH_POLL_MS), &shutdown) {
            app.operations().refresh_keys();
        }
    })
}

/// SIGINT, SIGTERM and SIGQUIT set `shutdown`: `serve` finishes the
/// requests in flight and exits 0. SIGHUP re-reads every key and
/// certificate file of `app` ([`reload_keys`]; without an app it is
/// logged like the others). SIGUSR1 and SIGUSR2 would kill the process at
/// once by default (a log rotation script): they are logged and change
/// nothing.
pub fn handle_signals(shutdown: &Arc<AtomicBool>, app: Option<Arc<App>>) -> std::io::Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2};
    const STOPPING: [i32; 3] = [SIGINT, SIGTERM, SIGQUIT];
    for signal in STOPPING {
        signal_hook::flag::register(signal, Arc::clone(shutdown))?;
    }
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGQUIT, SIGHUP, SIGUSR1, SIGUSR2])?;
    // Lives as long as the process; a blocked signal wait holds nothing.
    thread::Builder::new().name("payonce-signals".into()).spawn(move || {
        for signal in signals.forever() {
            let name = signal_name(signal);
            if STOPPING.contains(&signal) {
                log::info("shutting down: finishing requests in flight", &[("signal", &name)]);
            } else if let (SIGHUP, Some(app)) = (signal, &app) {
                reload_keys(app);
            } else {
                log::warn("signal ignored: payonce keeps serving", &[("signal", &name)]);
            }
        }
    })?;
    Ok(())
}

/// One reload of every platform's key and certificate files (SIGHUP): one
/// log line per file that failed, naming it and why (its old key stays in
/// use), or one line saying all loaded.
pub fn reload_keys(app: &App) {
    let failures = app.operations().reload_keys();
    if failures.is_empty() {
        log::info("keys reloaded: every key and certificate file loaded", &[("signal", &"SIGHUP")]);
    }
    for failure in &failures {
        log::error(
            "a key file failed to load; its old key stays in use",
            &[("signal", &"SIGHUP"), ("file", &failure.file), ("why", &failure.why)],
        );
    }
}

fn signal_name(signal: i32) -> String {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2};
    let name = match signal {
        SIGINT => "SIGINT",
        SIGTERM => "SIGTERM",
        SIGQUIT => "SIGQUIT",
        SIGHUP => "SIGHUP",
        SIGUSR1 => "SIGUSR1",
        SIGUSR2 => "SIGUSR2",
        _ => return signal.to_string(),
    };
    name.to_owned()
}

/// Sleeps `interval` in small steps; false once shutdown is requested.
fn sleep_unless_shutdown(interval: Duration, shutdown: &AtomicBool) -> bool {
    let deadline = Instant::now() + interval;
    while Instant::now() < deadline {
        if shutdown.load(Ordering::SeqCst) {
            return false;
        }
        thread::sleep(Duration::from_millis(SHUTDOWN_POLL_MS).min(deadline - Instant::now()));
    }
    !shutdown.load(Ordering::SeqCst)
}
