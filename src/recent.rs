//! A bounded, process-local memory of keys seen lately: which pay_nos this
//! process recorded or answered. It only chooses a path, never an answer:
//! a re-delivery of a pay_no it remembers is answered from a read snapshot
//! without queueing for the writer; any other delivery goes straight to the
//! writer, whose transaction reads the pay_no's record under uk_pay_no and
//! answers a duplicate there just the same (docs/performance.md, "Near the
//! batching limit"). Forgetting a key, a restart, or another process
//! recording it costs one trip through the writer, never a wrong answer.
//!
//! Keys are kept as 64-bit keyed hashes (SipHash with this process's random
//! keys), so the memory is a fixed 16 bytes or so per key however long the
//! keys are; a collision only sends a new payment through the read first.

use parking_lot::Mutex;
use std::collections::{HashSet, VecDeque};
use std::hash::BuildHasher;

/// How many keys a [`RecentKeys`] remembers by default: a day of a small
/// merchant's payments, about a megabyte.
pub const RECENT_KEYS_DEFAULT: usize = 65_536;

pub struct RecentKeys {
    hasher: std::collections::hash_map::RandomState,
    capacity: usize,
    /// The hashes remembered, and the order they came in (the oldest is
    /// forgotten first).
    seen: Mutex<(HashSet<u64>, VecDeque<u64>)>,
}

impl RecentKeys {
    pub fn new(capacity: usize) -> RecentKeys {
        RecentKeys {
            hasher: std::collections::hash_map::RandomState::new(),
            capacity,
            seen: Mutex::new((HashSet::new(), VecDeque::new())),
        }
    }

    pub fn contains(&self, key: &str) -> bool {
        let hash = self.hasher.hash_one(key);
        self.seen.lock().0.contains(&hash)
    }

    /// Remembers `key`, forgetting the oldest key past the capacity.
    pub fn insert(&self, key: &str) {
        if self.capacity == 0 {
            return;
        }
        let hash = self.hasher.hash_one(key);
        let mut seen = self.seen.lock();
        let (set, order) = &mut *seen;
        if set.insert(hash) {
            order.push_back(hash);
            if order.len() > self.capacity {
                if let Some(oldest) = order.pop_front() {
                    set.remove(&oldest);
                }
            }
        }
    }

    pub fn len(&self) -> usize {
        self.seen.lock().1.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::RecentKeys;

    #[test]
    fn remembers_up_to_its_capacity_and_forgets_the_oldest_first() {
        let recent = RecentKeys::new(2);
        assert!(!recent.contains("P-1"));
        recent.insert("P-1");
        recent.insert("P-2");
        recent.insert("P-1");
        assert_eq!(recent.len(), 2, "a key remembered twice is one entry");
        assert!(recent.contains("P-1") && recent.contains("P-2"));
        recent.insert("P-3");
        assert!(!recent.contains("P-1") && recent.contains("P-2") && recent.contains("P-3"));
        let none = RecentKeys::new(0);
        none.insert("P-1");
        assert!(!none.contains("P-1") && none.is_empty());
    }
}
