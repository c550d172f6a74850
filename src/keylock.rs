//! A process-local keyed mutex: requests that share a key (a pay_no, an
//! order_no, a refund_no) run one at a time, others run in parallel.
//!
//! Entries exist only while someone holds or waits for them, so the map does
//! not grow with traffic. The map's own lock is held only to find or drop an
//! entry, never while blocking on a key.
//!
//! The lock is the first layer of defense, not the guarantee: the caller
//! declares the guard *before* it opens the write transaction, so the guard
//! drops *after* the commit, and the database (IMMEDIATE transaction, CAS,
//! UNIQUE keys) still decides when two processes share one file.
//!
//! Each thread's held keys are also listed, in the order taken
//! ([`held_keys`]): on PostgreSQL the store takes an advisory lock on each of
//! them inside the write transaction, so the database holds the same keys
//! across processes and releases them only at COMMIT or ROLLBACK. A guard
//! cannot move to another thread (it is not `Send`), so the list is exact.

use parking_lot::{Mutex, RawMutex};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

type EntryGuard = parking_lot::lock_api::ArcMutexGuard<RawMutex, ()>;

struct Entry {
    mutex: Arc<Mutex<()>>,
    /// Holders plus waiters; guarded by the map lock.
    users: usize,
}

thread_local! {
    static HELD: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// The keys this thread holds right now, in the order it took them.
pub fn held_keys() -> Vec<String> {
    HELD.with(|held| held.borrow().clone())
}

#[derive(Default)]
pub struct KeyedLocks {
    map: Mutex<HashMap<String, Entry>>,
}

/// Holds one key; dropping it releases the key and, when nobody else holds
/// or waits for it, removes the entry from the map.
#[must_use = "the key is released when the guard drops"]
pub struct KeyGuard<'a> {
    locks: &'a KeyedLocks,
    key: String,
    guard: Option<EntryGuard>,
}

impl KeyedLocks {
    pub fn new() -> KeyedLocks {
        KeyedLocks::default()
    }

    /// Blocks until `key` is free.
    pub fn lock(&self, key: &str) -> KeyGuard<'_> {
        let mutex = self.enter(key);
        let guard = mutex.lock_arc();
        HELD.with(|held| held.borrow_mut().push(key.to_owned()));
        KeyGuard { locks: self, key: key.to_owned(), guard: Some(guard) }
    }

    /// Waits at most `wait` for `key`; `None` when it stayed taken.
    pub fn lock_for(&self, key: &str, wait: Duration) -> Option<KeyGuard<'_>> {
        let mutex = self.enter(key);
        match mutex.try_lock_arc_for(wait) {
            Some(guard) => {
                HELD.with(|held| held.borrow_mut().push(key.to_owned()));
                Some(KeyGuard { locks: self, key: key.to_owned(), guard: Some(guard) })
            }
            None => {
                self.leave(key);
                None
            }
        }
    }

    /// Number of keys held or waited for right now.
    pub fn len(&self) -> usize {
        self.map.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn enter(&self, key: &str) -> Arc<Mutex<()>> {
        let mut map = self.map.lock();
        let entry = map.entry(key.to_owned()).or_insert_with(|| Entry { mutex: Arc::new(Mutex::new(())), users: 0 });
        entry.users += 1;
        Arc::clone(&entry.mutex)
    }

    fn leave(&self, key: &str) {
        let mut map = self.map.lock();
        let remove = match map.get_mut(key) {
            Some(entry) => {
                assert!(entry.users > 0, "keyed lock user count underflow");
                entry.users -= 1;
                entry.users == 0
            }
            None => unreachable!("keyed lock entry vanished while in use"),
        };
        if remove {
            map.remove(key);
        }
    }
}

impl Drop for KeyGuard<'_> {
    fn drop(&mut self) {
        // Release the key first, then account for it, so a waiter that
        // arrived meanwhile keeps the entry alive.
        drop(self.guard.take());
        HELD.with(|held| {
            let mut held = held.borrow_mut();
            if let Some(at) = held.iter().rposition(|k| *k == self.key) {
                held.remove(at);
            }
        });
        self.locks.leave(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::thread;

    #[test]
    fn one_holder_per_key_under_contention_and_map_empties() {
        let locks = Arc::new(KeyedLocks::new());
        let inside = Arc::new(AtomicUsize::new(0));
        let entered = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..16)
            .map(|i| {
                let (locks, inside, entered) = (locks.clone(), inside.clone(), entered.clone());
                thread::spawn(move || {
                    for n in 0..200 {
                        let key = format!("k{}", (i + n) % 3);
                        let _g = locks.lock(&key);
                        // Only keys k0..k2 exist; count holders of k0 exactly.
                        if key == "k0" {
                            assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders of k0");
                            thread::yield_now();
                            inside.fetch_sub(1, Ordering::SeqCst);
                        }
                        entered.fetch_add(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("worker panicked");
        }
        assert_eq!(entered.load(Ordering::SeqCst), 16 * 200);
        assert!(locks.is_empty(), "map kept {} entries", locks.len());
    }

    #[test]
    fn different_keys_do_not_block_each_other() {
        let locks = KeyedLocks::new();
        let _a = locks.lock("a");
        assert!(locks.lock_for("b", Duration::from_millis(1)).is_some());
        assert!(locks.lock_for("a", Duration::from_millis(10)).is_none());
        assert_eq!(locks.len(), 1, "a timed-out waiter must not leave an entry");
    }

    #[test]
    fn a_waiter_gets_the_key_after_release() {
        let locks = Arc::new(KeyedLocks::new());
        let g = locks.lock("x");
        let l2 = locks.clone();
        let waiter = thread::spawn(move || {
            let _g = l2.lock("x");
        });
        while locks.map.lock().get("x").map(|e| e.users) != Some(2) {
            thread::yield_now();
        }
        drop(g);
        waiter.join().expect("waiter panicked");
        assert!(locks.is_empty());
    }
}
