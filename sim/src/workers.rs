//! Threads that start together, and the first error among them.

use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;

/// A start signal: workers begin only once all of them exist, so a failed
/// spawn never leaves the others waiting at a barrier.
struct Gate {
    go: Mutex<Option<bool>>,
    cond: Condvar,
}

impl Gate {
    fn new() -> Gate {
        Gate { go: Mutex::new(None), cond: Condvar::new() }
    }

    fn open(&self, go: bool) {
        *self.go.lock() = Some(go);
        self.cond.notify_all();
    }

    fn wait(&self) -> bool {
        let mut go = self.go.lock();
        loop {
            if let Some(go) = *go {
                return go;
            }
            self.cond.wait(&mut go);
        }
    }
}

/// Runs `work(worker)` on `count` scoped threads that start together.
pub fn scoped_workers(count: usize, work: impl Fn(usize) + Sync) -> Result<(), String> {
    let gate = Gate::new();
    let mut spawn_error = None;
    thread::scope(|scope| {
        for w in 0..count {
            let (gate, work) = (&gate, &work);
            let spawned = thread::Builder::new().name(format!("payonce-simulate-{w}")).spawn_scoped(scope, move || {
                if gate.wait() {
                    work(w);
                }
            });
            if let Err(e) = spawned {
                spawn_error = Some(format!("cannot start a simulator thread: {e}"));
                break;
            }
        }
        gate.open(spawn_error.is_none());
    });
    spawn_error.map_or(Ok(()), Err)
}

/// The first error of several threads, and a flag that tells the others to stop.
pub struct Failure {
    failed: AtomicBool,
    first: Mutex<Option<String>>,
}

impl Failure {
    pub fn new() -> Failure {
        Failure { failed: AtomicBool::new(false), first: Mutex::new(None) }
    }

    pub fn set(&self, error: String) {
        self.failed.store(true, Ordering::SeqCst);
        self.first.lock().get_or_insert(error);
    }

    pub fn is_set(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    pub fn into_result(self) -> Result<(), String> {
        self.first.into_inner().map_or(Ok(()), Err)
    }
}
