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
//! What is locked is a [`LockKey`], never a string: each kind of key has its
//! own space, so a misspelt prefix cannot silently share or split a lock.
//! The guards a write holds are passed to `Store::write` by its caller: on
//! PostgreSQL the store takes an advisory lock on each of them inside the
//! write transaction, so the database holds the same keys across processes
//! and releases them only at COMMIT or ROLLBACK.

use parking_lot::{Mutex, RawMutex};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

type EntryGuard = parking_lot::lock_api::ArcMutexGuard<RawMutex, ()>;

struct Entry {
    mutex: Arc<Mutex<()>>,
    /// Holders plus waiters; guarded by the map lock.
    users: usize,
}

/// What one key lock serializes: the work on one order, one payment, one
/// refund, the mode, or one Idempotency-Key. Lock order, where several are
/// held: Idempotency-Key, then order / payment / refund, then the writer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockKey<'a> {
    Order(&'a str),
    Pay(&'a str),
    Refund(&'a str),
    Mode,
    /// A caller's key in its scope (caller, method and path).
    IdempotencyKey {
        scope: &'a str,
        key: &'a str,
    },
}

impl LockKey<'_> {
    /// The key's text: the lock map's key, and (hashed) PostgreSQL's
    /// advisory lock. A kind's prefix keeps the spaces apart; identifiers
    /// hold no `:` or newline, so no two keys share a text.
    pub fn text(&self) -> String {
        match self {
            LockKey::Order(order_no) => format!("order:{order_no}"),
            LockKey::Pay(pay_no) => format!("pay:{pay_no}"),
            LockKey::Refund(refund_no) => format!("refund:{refund_no}"),
            LockKey::Mode => "admin:mode".to_owned(),
            LockKey::IdempotencyKey { scope, key } => format!("idem:{scope}\n{key}"),
        }
    }
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
    pub fn lock(&self, key: LockKey<'_>) -> KeyGuard<'_> {
        let key = key.text();
        let mutex = self.enter(&key);
        let guard = mutex.lock_arc();
        KeyGuard { locks: self, key, guard: Some(guard) }
    }

    /// Waits at most `wait` for `key`; `None` when it stayed taken.
    pub fn lock_for(&self, key: LockKey<'_>, wait: Duration) -> Option<KeyGuard<'_>> {
        let key = key.text();
        let mutex = self.enter(&key);
        match mutex.try_lock_arc_for(wait) {
            Some(guard) => Some(KeyGuard { locks: self, key, guard: Some(guard) }),
            None => {
                self.leave(&key);
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

impl KeyGuard<'_> {
    /// The held key's text ([`LockKey::text`]).
    pub fn key(&self) -> &str {
        &self.key
    }
}

impl Drop for KeyGuard<'_> {
    fn drop(&mut self) {
        // Release the key first, then account for it, so a waiter that
        // arrived meanwhile keeps the entry alive.
        drop(self.guard.take());
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
                        let _g = locks.lock(LockKey::Order(&key));
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
        let _a = locks.lock(LockKey::Order("a"));
        assert!(locks.lock_for(LockKey::Order("b"), Duration::from_millis(1)).is_some());
        assert!(locks.lock_for(LockKey::Order("a"), Duration::from_millis(10)).is_none());
        assert_eq!(locks.len(), 1, "a timed-out waiter must not leave an entry");
        // One value in two kinds of key is two keys.
        assert!(locks.lock_for(LockKey::Pay("a"), Duration::from_millis(1)).is_some());
        assert!(locks.lock_for(LockKey::Refund("a"), Duration::from_millis(1)).is_some());
    }

    #[test]
    fn a_waiter_gets_the_key_after_release() {
        let locks = Arc::new(KeyedLocks::new());
        let g = locks.lock(LockKey::Pay("x"));
        let l2 = locks.clone();
        let waiter = thread::spawn(move || {
            let _g = l2.lock(LockKey::Pay("x"));
        });
        while locks.map.lock().get("pay:x").map(|e| e.users) != Some(2) {
            thread::yield_now();
        }
        drop(g);
        waiter.join().expect("waiter panicked");
        assert!(locks.is_empty());
    }
}
