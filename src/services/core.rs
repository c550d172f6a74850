//! The core every service borrows: the store, the key locks, the clock,
//! the metrics and the settings, each behind a crate-visible accessor, and
//! the one shape of an API write (`Core::write_op`).

use super::{Operations, Orders, Payments, PlatformCalls, Prepays, Refunds, Webhooks};
use crate::app::{Answer, Config};
use crate::clock::Clock;
use crate::domain::IdempotencySlot;
use crate::domain::JsonText;
use crate::error::{Error, ErrorKind};
use crate::keylock::{KeyGuard, KeyedLocks, LockKey};
use crate::metrics::Metrics;
use crate::recent::{RecentKeys, RECENT_KEYS_DEFAULT};
use crate::store::{Store, WriteTx};
use std::sync::atomic::{AtomicU32, Ordering};

/// One payonce's state: a store, the key locks, a clock and the settings.
pub(crate) struct Core {
    store: Store,
    locks: KeyedLocks,
    clock: Clock,
    config: Config,
    metrics: Metrics,
    /// The pay_nos this process recorded or answered lately: a re-delivery
    /// of one is answered from a read snapshot, any other delivery goes
    /// straight to the writer (`Payments::deliver_payment_from`).
    recent_pay_nos: RecentKeys,
    /// Test hook ([`Core::fail_writes_after_work`]): while positive, each API
    /// write fails with a 500 after its work and stored response are written
    /// but before commit (and counts down).
    fail_writes_after_work: AtomicU32,
}

impl Core {
    pub(crate) fn new(store: Store, clock: Clock, config: Config) -> Core {
        let metrics = Metrics::with_storage_flag(store.storage_flag());
        Core {
            store,
            locks: KeyedLocks::new(),
            clock,
            config,
            metrics,
            recent_pay_nos: RecentKeys::new(RECENT_KEYS_DEFAULT),
            fail_writes_after_work: AtomicU32::new(0),
        }
    }

    pub(crate) fn recent_pay_nos(&self) -> &RecentKeys {
        &self.recent_pay_nos
    }

    pub(crate) fn store(&self) -> &Store {
        &self.store
    }

    pub(crate) fn locks(&self) -> &KeyedLocks {
        &self.locks
    }

    pub(crate) fn clock(&self) -> &Clock {
        &self.clock
    }

    pub(crate) fn config(&self) -> &Config {
        &self.config
    }

    pub(crate) fn config_mut(&mut self) -> &mut Config {
        &mut self.config
    }

    pub(crate) fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Records the reward settings this process runs with in `settings`
    /// (an offline command reads them back).
    pub(crate) fn record_reward_settings(&self) -> Result<(), Error> {
        let config = self.config();
        let coupons = config.rewards.coupon_templates.json_text();
        let points = config.rewards.points_per_yuan.to_string();
        self.store().write(&[], |tx| {
            tx.put_setting("reward_coupon_templates", &coupons)?;
            tx.put_setting("reward_points_per_yuan", &points)
        })
    }

    pub(crate) fn orders(&self) -> Orders<'_> {
        Orders::new(self)
    }

    pub(crate) fn payments(&self) -> Payments<'_> {
        Payments::new(self)
    }

    pub(crate) fn refunds(&self) -> Refunds<'_> {
        Refunds::new(self)
    }

    pub(crate) fn operations(&self) -> Operations<'_> {
        Operations::new(self)
    }

    pub(crate) fn platform_calls(&self) -> PlatformCalls<'_> {
        PlatformCalls::new(self)
    }

    pub(crate) fn prepays(&self) -> Prepays<'_> {
        Prepays::new(self)
    }

    pub(crate) fn webhooks(&self) -> Webhooks<'_> {
        Webhooks::new(self)
    }

    /// Runs `work` in one IMMEDIATE transaction as an API write: a business
    /// refusal commits (its audit row stays) and, with a `slot`, the answer —
    /// success ([`Answer`]) or refusal — is stored in the same
    /// transaction. Any other error rolls everything back and stores nothing.
    pub(crate) fn write_op<T: Answer + Send>(
        &self,
        held: &[&KeyGuard<'_>],
        slot: Option<&IdempotencySlot>,
        work: impl Fn(&WriteTx) -> Result<T, Error> + Send + Sync,
    ) -> Result<T, Error> {
        // The Idempotency-Key's lock first, as the API layer took it.
        let keys: Vec<String> = slot
            .map(|slot| LockKey::IdempotencyKey { scope: &slot.scope, key: &slot.key }.text())
            .into_iter()
            .chain(held.iter().map(|guard| guard.key().to_owned()))
            .collect();
        // Decided once per write, not per run of its body: a body may run
        // again (PostgreSQL's retries, SQLite's batch run again with
        // savepoints) and this write must fail every time.
        let fail_after_work = self.take_armed_failure();
        self.store().write_locking(&keys, |tx| {
            let result = match work(tx) {
                Err(e) if !e.is_refusal() => return Err(e),
                result => result,
            };
            if let Some(slot) = slot {
                let (status, body) = match &result {
                    Ok(value) => value.answer_body(),
                    Err(refusal) => refusal.answer_body(),
                };
                if !tx.store_response(slot, status, &body)? {
                    return Err(Error::new(ErrorKind::IdempotencyKeyInUse, "another request stored this key first"));
                }
            }
            if fail_after_work {
                return Err(Error::internal("injected failure after the work (test hook)"));
            }
            Ok(result)
        })?
    }

    /// Test hook: the next `writes` API writes fail with a 500 after their
    /// work and stored response are written but before commit, to prove
    /// that nothing of a failed request survives. Returns how many of the
    /// previously armed failures had not fired.
    #[cfg(any(test, feature = "test-support"))]
    pub(crate) fn fail_writes_after_work(&self, writes: u32) -> u32 {
        self.fail_writes_after_work.swap(writes, Ordering::SeqCst)
    }

    /// Whether this write is one of the armed failures (counting it down).
    fn take_armed_failure(&self) -> bool {
        self.fail_writes_after_work.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
    }
}
