//! Background workers of `payonce serve`: the sweeper (order expiry and
//! Idempotency-Key retention). Each runs on
//! its own thread, on the same exactly-once operations as the API, and stops
//! when the shutdown flag is set.

use crate::app::App;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Orders closed per sweep transaction batch; the sweep repeats until none are due.
pub const SWEEP_BATCH_MAX: usize = 500;
pub const SWEEP_INTERVAL_S_DEFAULT: u64 = 1;
/// How often a sleeping worker looks at the shutdown flag.
const SHUTDOWN_POLL_MS: u64 = 100;

/// Starts the sweeper: every `interval`, PENDING orders past `expires_at`
/// are closed (event `order.closed`) and expired Idempotency-Key results
/// are removed, each in bounded batches.
pub fn spawn_sweeper(app: Arc<App>, interval: Duration, shutdown: Arc<AtomicBool>) -> std::io::Result<JoinHandle<()>> {
    thread::Builder::new().name("payonce-sweeper".into()).spawn(move || {
        while sleep_unless_shutdown(interval, &shutdown) {
            loop {
                match app.close_expired(SWEEP_BATCH_MAX) {
                    Ok(n) if n == SWEEP_BATCH_MAX && !shutdown.load(Ordering::SeqCst) => continue,
                    Ok(_) => break,
                    Err(e) => {
                        eprintln!("payonce: warning: expiry sweep failed, will retry: {e}");
                        break;
                    }
                }
            }
            if let Err(e) = app.purge_expired_responses(SWEEP_BATCH_MAX) {
                eprintln!("payonce: warning: purging expired Idempotency-Key results failed, will retry: {e}");
            }
        }
    })
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
