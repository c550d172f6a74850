//! The exactly-once operations: what the HTTP API offers, callable in
//! process with no socket.
//!
//! Every write follows one shape, the corrected sequence of the incident:
//!
//! ```text
//! let key = self.locks.lock(LockKey::Pay(pay_no)); // 1. process-local key lock, outside the transaction
//! self.store.write(&[&key], |tx| {     // 2. BEGIN IMMEDIATE (after the writer queue); PostgreSQL locks `key` too
//!     ...record the request...         // 3. under its UNIQUE key (uk_pay_no, uk_order_no, uk_refund_no)
//!     ...CAS the order...              // 4. UPDATE .. WHERE status = ?; affected rows decide
//!     ...each side effect...           // 5. its own UNIQUE key
//!     ...outbox event...               // 6. uk_event_id
//! })                                   // 7. COMMIT
//! // 8. `key` drops here: after the commit, by scope order
//! ```

use crate::clock::Clock;
use crate::domain::{
    is_amount, is_currency, is_identifier, EventType, Order, OrderStatus, PaymentOutcome, PlatformStatus,
    RefundOutcome, RefundStatus, Rewards,
};
use crate::domain::{AuditDetail, EventData, JsonText, Refused, RewardsDue};
use crate::domain::{
    AuditRow, CallbackRecord, CouponRow, EventRow, IdempotencySlot, NewCallback, NewOrder, PlatformCallSummary,
    PointRow, StoredResponse,
};
pub use crate::domain::{PaymentCallback, PaymentReply, PaymentReplyOutcome, RefundCallback};
use crate::error::{Error, ErrorKind};
use crate::keylock::{KeyGuard, KeyedLocks, LockKey};
use crate::metrics::Metrics;
use crate::platforms::Notices;
use crate::store::{Store, StoreOptions, WriteTx};
use serde_json::Value;
use std::sync::atomic::{AtomicU32, Ordering};

/// Default PENDING lifetime (`--order-ttl-s`).
pub const ORDER_TTL_S_DEFAULT: i64 = 900;
/// Default retention of Idempotency-Key results (`--idempotency-ttl-s`).
pub const IDEMPOTENCY_TTL_S_DEFAULT: i64 = 86_400;
/// Bounds of `expires_in_s`.
pub const EXPIRES_IN_S_MAX: i64 = 86_400;
/// Page size bounds of the list endpoints.
pub const PAGE_LIMIT_DEFAULT: usize = 100;
pub const PAGE_LIMIT_MAX: usize = 1_000;

/// The actor written to `audit_log` for what payonce decides by itself.
pub(crate) const ACTOR_SYSTEM: &str = "payonce";

#[derive(Clone, Debug)]
pub struct Config {
    pub rewards: Rewards,
    pub order_ttl_s: i64,
    /// How long Idempotency-Key results are kept (`--idempotency-ttl-s`).
    pub idempotency_ttl_s: i64,
    /// Bearer tokens for `/v1` except callbacks; empty = no authentication.
    pub api_tokens: Vec<ApiToken>,
    /// The webhook relay's endpoints, secrets, timeout and schedule.
    pub webhooks: crate::webhook::WebhookConfig,
    /// The platforms that are on (their notices, and the calls payonce may
    /// make, section 11) and how calls are paced; none by default.
    pub platforms: crate::platforms::Platforms,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            rewards: Rewards::default(),
            order_ttl_s: ORDER_TTL_S_DEFAULT,
            idempotency_ttl_s: IDEMPOTENCY_TTL_S_DEFAULT,
            api_tokens: Vec::new(),
            webhooks: crate::webhook::WebhookConfig::default(),
            platforms: crate::platforms::Platforms::default(),
        }
    }
}

/// One API token: `name:token`, or a bare token whose caller name is a hash
/// of it (a raw token is never stored or logged).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiToken {
    pub caller: String,
    pub token: String,
}

impl ApiToken {
    /// Parses one entry of `--api-token`.
    pub fn parse(entry: &str) -> Option<ApiToken> {
        let entry = entry.trim();
        let (caller, token) = match entry.split_once(':') {
            Some((name, token)) => (name.to_owned(), token.to_owned()),
            None => (format!("token-{}", &sha256_hex(entry.as_bytes())[..16]), entry.to_owned()),
        };
        let caller_ok = is_identifier(&caller);
        (caller_ok && !token.is_empty() && token.bytes().all(|b| b.is_ascii_graphic()))
            .then_some(ApiToken { caller, token })
    }
}

/// Hex SHA-256, for request fingerprints and token-derived caller names.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// What an operation's success answers over the API: status and JSON body.
/// A keyed write stores exactly this with its work, so a replay is the
/// same answer. Implemented in `render.rs`, the one place JSON is shaped,
/// for every result and for [`Error`] (what a refusal stores).
pub trait Answer {
    fn answer(&self) -> (u16, Value);
    /// [`Answer::answer`] as the bytes sent and stored; an answer that can
    /// be large writes them without building the `Value` first.
    fn answer_body(&self) -> (u16, Vec<u8>) {
        let (status, body) = self.answer();
        (status, body.to_string().into_bytes())
    }
}

impl<T: Answer> Answer for &T {
    fn answer(&self) -> (u16, Value) {
        (**self).answer()
    }
    fn answer_body(&self) -> (u16, Vec<u8>) {
        (**self).answer_body()
    }
}

/// One payonce: a store, the key locks, a clock and the settings.
pub struct App {
    pub store: Store,
    pub locks: KeyedLocks,
    pub clock: Clock,
    pub config: Config,
    /// Test hook ([`App::fail_writes_after_work`]): while positive, each API
    /// write fails with a 500 after its work and stored response are written
    /// but before commit (and counts down).
    fail_writes_after_work: AtomicU32,
    pub metrics: Metrics,
}

/// An order to create (already shaped; [`App::create_order`] validates it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CreateOrder {
    pub order_no: String,
    pub user_id: String,
    pub amount: i64,
    pub currency: String,
    pub expires_in_s: Option<i64>,
}

/// A payment to decide: what the decision needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Delivery {
    pub pay_no: String,
    pub channel: String,
    pub amount: i64,
    /// `None`: the order's currency (a generic notice without one, or a
    /// record from before schema version 9).
    pub currency: Option<String>,
    pub status: PlatformStatus,
    pub paid_at: Option<String>,
}

/// Where a decision is written: the `received` row of a recorded payment
/// (record-only mode, drain, a superseded FAILED), or a delivery seen for the
/// first time, inserted already decided. Either happens in the transaction
/// that makes the decision's effects, so nobody ever sees the second kind
/// `received`: recording and deciding it in one INSERT writes the row and
/// its indexes once instead of twice.
#[derive(Clone, Copy)]
pub(crate) enum DecisionRow<'a> {
    Received(i64),
    New(&'a NewCallback<'a>),
}

impl Delivery {
    /// A `received` record read back (record-only mode, drain).
    pub(crate) fn from_record(record: &CallbackRecord) -> Delivery {
        assert!(!record.decided, "deciding a callback twice");
        Delivery {
            pay_no: record.pay_no.clone(),
            channel: record.channel.clone(),
            amount: record.amount,
            currency: record.currency.clone(),
            status: record.status,
            paid_at: record.paid_at.clone(),
        }
    }
}

/// An order with everything it caused, for `GET /v1/orders/{order_no}`.
#[derive(Clone, Debug)]
pub struct OrderDetail {
    pub order: Order,
    pub payments: Vec<CallbackRecord>,
    pub coupons: Vec<CouponRow>,
    pub points: Vec<PointRow>,
    /// The order's outbox events, in seq order.
    pub events: Vec<EventRow>,
    /// The order's `audit_log` rows, oldest first.
    pub audit: Vec<AuditRow>,
    /// What was asked of the platforms about it, oldest first.
    pub platform_calls: Vec<PlatformCallSummary>,
}

/// Where a payment came from, for `pay_callback_log.source`.
pub const SOURCE_CALLBACK: &str = "callback";
pub const SOURCE_RECONCILIATION: &str = "reconciliation";
/// The `settings` row of the mode, and its values.
pub const SETTING_MODE: &str = "mode";
pub const MODE_NORMAL: &str = "normal";
pub const MODE_RECORD_ONLY: &str = "record_only";

impl App {
    /// Opens payonce on `db` (`":memory:"` for a shared in-memory database)
    /// and records the reward settings it runs with in `settings`.
    pub fn open(db: &str, clock: Clock, config: Config) -> Result<App, Error> {
        App::open_with(db, clock, config, &StoreOptions::default())
    }

    pub fn open_with(db: &str, clock: Clock, config: Config, options: &StoreOptions) -> Result<App, Error> {
        let store = Store::open(db, options)?;
        let metrics = Metrics::with_storage_flag(store.storage_flag());
        let app =
            App { store, locks: KeyedLocks::new(), clock, config, fail_writes_after_work: AtomicU32::new(0), metrics };
        app.record_reward_settings()?;
        Ok(app)
    }

    /// Opens an existing database for offline commands (`inspect`,
    /// `reconcile`), with the reward settings `serve` recorded in it, so a
    /// repair applies the same rewards. Never creates a file.
    pub fn open_existing(db: &str, clock: Clock) -> Result<App, Error> {
        if db != ":memory:" && !crate::store::is_postgres_url(db) && !std::path::Path::new(db).exists() {
            return Err(Error::invalid(format!("no database at {db:?}")));
        }
        let store = Store::open(db, &StoreOptions::default())?;
        let (coupons, points) =
            store.read(|tx| Ok((tx.setting("reward_coupon_templates")?, tx.setting("reward_points_per_yuan")?)))?;
        let coupon_templates: Vec<String> =
            coupons.as_deref().and_then(|c| serde_json::from_str(c).ok()).unwrap_or_default();
        let points_per_yuan = points.as_deref().and_then(|p| p.parse().ok()).unwrap_or(0);
        let config = Config { rewards: Rewards { coupon_templates, points_per_yuan }, ..Config::default() };
        let metrics = Metrics::with_storage_flag(store.storage_flag());
        Ok(App { store, locks: KeyedLocks::new(), clock, config, fail_writes_after_work: AtomicU32::new(0), metrics })
    }

    /// The configured channel of that name (`generic` only with a secret).
    pub fn channel(&self, name: &str) -> Option<&dyn Notices> {
        self.config.platforms.registry.notices(name)
    }

    fn record_reward_settings(&self) -> Result<(), Error> {
        let coupons = self.config.rewards.coupon_templates.json_text();
        let points = self.config.rewards.points_per_yuan.to_string();
        self.store.write(&[], |tx| {
            tx.put_setting("reward_coupon_templates", &coupons)?;
            tx.put_setting("reward_points_per_yuan", &points)
        })
    }

    // ---- orders ----

    /// Creates the order once per order_no: `(order, true)` when created,
    /// `(stored, false)` when the same order was created before, 409
    /// `order_no_conflict` when the order_no holds a different order.
    pub fn create_order(&self, req: &CreateOrder) -> Result<(Order, bool), Error> {
        self.create_order_keyed(req, None)
    }

    /// [`App::create_order`], storing the API's answer in `slot` in the same
    /// transaction as the order.
    pub fn create_order_keyed(
        &self,
        req: &CreateOrder,
        slot: Option<&IdempotencySlot>,
    ) -> Result<(Order, bool), Error> {
        validate_create_order(req)?;
        let expires_in_s = req.expires_in_s.unwrap_or(self.config.order_ttl_s);
        let key = self.locks.lock(LockKey::Order(&req.order_no));
        let now_ms = self.clock.now_ms();
        let new = NewOrder {
            order_no: req.order_no.clone(),
            user_id: req.user_id.clone(),
            amount: req.amount,
            currency: req.currency.clone(),
            created_at: crate::clock::format_ms(now_ms),
            expires_at: crate::clock::format_ms(now_ms.saturating_add(expires_in_s.saturating_mul(1000))),
        };
        self.write_op(&[&key], slot, |tx| match tx.insert_order(&new)? {
            Ok(order) => Ok((order, true)),
            Err(existing)
                if existing.user_id == req.user_id
                    && existing.amount == req.amount
                    && existing.currency == req.currency =>
            {
                Ok((existing, false))
            }
            Err(_) => Err(Error::new(
                ErrorKind::OrderNoConflict,
                format!("order_no {:?} already holds an order with other user_id, amount or currency", req.order_no),
            )),
        })
    }

    /// A new order_no for a keyed request without one: `ORD`, the creation
    /// time in Unix milliseconds (so they sort by time) and 64 random bits
    /// (so processes never collide): 32 characters, within WeChat Pay's
    /// 6-32 for `out_trade_no`.
    pub fn generate_order_no(&self) -> Result<String, Error> {
        let mut random = [0u8; 8];
        getrandom::fill(&mut random).map_err(|e| Error::internal(format!("no OS randomness: {e}")))?;
        let ms = self.clock.now_ms().clamp(0, 9_999_999_999_999);
        Ok(format!("ORD{ms:013}{:016x}", u64::from_be_bytes(random)))
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
        self.store.write_locking(&keys, |tx| {
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
            self.maybe_fail_after_work()?;
            Ok(result)
        })?
    }

    /// Test hook: the next `writes` API writes fail with a 500 after their
    /// work and stored response are written but before commit, to prove
    /// that nothing of a failed request survives. Returns how many of the
    /// previously armed failures had not fired.
    #[cfg(any(test, feature = "test-support"))]
    pub fn fail_writes_after_work(&self, writes: u32) -> u32 {
        self.fail_writes_after_work.swap(writes, Ordering::SeqCst)
    }

    fn maybe_fail_after_work(&self) -> Result<(), Error> {
        let armed =
            self.fail_writes_after_work.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
        if armed {
            return Err(Error::internal("injected failure after the work (test hook)"));
        }
        Ok(())
    }

    /// The live stored response of (scope, key), if any.
    pub fn stored_response(&self, scope: &str, key: &str) -> Result<Option<StoredResponse>, Error> {
        // A replay vouches for work that may live only in a deleted -wal.
        self.store.check_storage()?;
        let now = self.clock.now_text();
        self.store.read(|tx| tx.stored_response(scope, key, &now))
    }

    /// A slot for a keyed request arriving now.
    pub fn idempotency_slot(&self, scope: String, key: String, fingerprint: String) -> IdempotencySlot {
        let now_ms = self.clock.now_ms();
        IdempotencySlot {
            scope,
            key,
            fingerprint,
            created_at: crate::clock::format_ms(now_ms),
            expires_at: crate::clock::format_ms(
                now_ms.saturating_add(self.config.idempotency_ttl_s.saturating_mul(1000)),
            ),
        }
    }

    /// Removes up to `batch` expired Idempotency-Key results.
    pub fn purge_expired_responses(&self, batch: usize) -> Result<usize, Error> {
        let now = self.clock.now_text();
        self.store.write(&[], |tx| tx.purge_expired_responses(&now, batch))
    }

    pub fn order(&self, order_no: &str) -> Result<OrderDetail, Error> {
        self.store.read(|tx| {
            let order = tx.order_by_no(order_no)?.ok_or_else(|| Error::order_not_found(order_no))?;
            Ok(OrderDetail {
                payments: tx.callbacks_of_order(order.id)?,
                coupons: tx.coupons_of_order(order.id)?,
                points: tx.points_of_order(order.id)?,
                events: tx.events_of_order(order_no)?,
                audit: tx.audit_of_order(order_no)?,
                platform_calls: tx.platform_calls_of_order(order_no)?,
                order,
            })
        })
    }

    /// Newest first; the cursor is the last order's position, opaque to callers.
    pub fn list_orders(
        &self,
        user_id: Option<&str>,
        status: Option<OrderStatus>,
        after: Option<i64>,
        limit: usize,
    ) -> Result<(Vec<Order>, Option<i64>), Error> {
        let limit = limit.clamp(1, PAGE_LIMIT_MAX);
        // One extra row tells whether another page exists.
        let mut orders = self.store.read(|tx| tx.list_orders(user_id, status, after, limit + 1))?;
        let next = if orders.len() > limit {
            orders.truncate(limit);
            orders.last().map(|o| o.id)
        } else {
            None
        };
        Ok((orders, next))
    }

    /// PENDING→CLOSED; an already CLOSED order is answered as it is.
    pub fn close_order(&self, order_no: &str) -> Result<Order, Error> {
        self.close_order_keyed(order_no, None)
    }

    /// Closes a PENDING order. With platforms configured (section 11) it
    /// closes at each platform first ([`App::close_order_at_platforms`]).
    pub fn close_order_keyed(&self, order_no: &str, slot: Option<&IdempotencySlot>) -> Result<Order, Error> {
        if self.config.platforms.is_empty() {
            self.close_order_locally(order_no, slot)
        } else {
            self.close_order_at_platforms(order_no, slot)
        }
    }

    /// PENDING → CLOSED here; CLOSED answers the order; any other state is 409.
    pub(crate) fn close_order_locally(&self, order_no: &str, slot: Option<&IdempotencySlot>) -> Result<Order, Error> {
        let key = self.locks.lock(LockKey::Order(order_no));
        let now = self.clock.now_text();
        self.write_op(&[&key], slot, |tx| {
            let order = tx.order_by_no(order_no)?.ok_or_else(|| Error::order_not_found(order_no))?;
            if let Some(closed) = close_in_tx(tx, &order, &now)? {
                return Ok(closed);
            }
            if order.status == OrderStatus::Closed {
                return Ok(order);
            }
            Err(refuse_transition(tx, &order, OrderStatus::Closed, "close", &now, Refused::Order)?)
        })
    }

    /// Closes up to `batch` PENDING orders whose `expires_at` has passed, one
    /// transaction each (a payment racing the sweeper waits at most one
    /// order's close). Returns how many it closed.
    ///
    /// With platforms configured it closes nothing itself: it queues the
    /// close at each platform ([`App::queue_platform_closes`]) and returns
    /// how many orders it queued.
    pub fn close_expired(&self, batch: usize) -> Result<usize, Error> {
        if !self.config.platforms.is_empty() {
            return self.queue_platform_closes(batch);
        }
        let now = self.clock.now_text();
        let due = self.store.read(|tx| tx.expired_pending_orders(&now, batch))?;
        let mut closed = 0;
        for order_no in due {
            let key = self.locks.lock(LockKey::Order(&order_no));
            let did_close = self.store.write(&[&key], |tx| {
                let Some(order) = tx.order_by_no(&order_no)? else {
                    return Ok(false);
                };
                // Re-judged inside the write transaction: a payment may have won meanwhile.
                if order.expires_at > now {
                    return Ok(false);
                }
                Ok(close_in_tx(tx, &order, &now)?.is_some())
            })?;
            closed += usize::from(did_close);
        }
        Ok(closed)
    }

    /// PAID→REFUNDING with a `refund` row REQUESTED. The same refund_no again
    /// while REFUNDING or REFUNDED answers the order.
    pub fn request_refund(&self, order_no: &str, refund_no: &str) -> Result<Order, Error> {
        self.request_refund_keyed(order_no, refund_no, None)
    }

    pub fn request_refund_keyed(
        &self,
        order_no: &str,
        refund_no: &str,
        slot: Option<&IdempotencySlot>,
    ) -> Result<Order, Error> {
        if !is_identifier(refund_no) {
            return Err(Error::invalid("refund_no must be 1-64 characters of [A-Za-z0-9_.-]"));
        }
        let key = self.locks.lock(LockKey::Refund(refund_no));
        let now = self.clock.now_text();
        self.write_op(&[&key], slot, |tx| {
            let order = tx.order_by_no(order_no)?.ok_or_else(|| Error::order_not_found(order_no))?;
            let detail = Refused::Refund { refund_no };
            if let Some(existing) = tx.refund_by_no(refund_no)? {
                if existing.order_id == order.id && existing.status != RefundStatus::Failed {
                    return Ok(order);
                }
                return Err(refuse_transition(tx, &order, OrderStatus::Refunding, "refund", &now, detail)?);
            }
            if !tx.cas_order_refunding(order.id, refund_no)? {
                return Err(refuse_transition(tx, &order, OrderStatus::Refunding, "refund", &now, detail)?);
            }
            let inserted = tx.insert_refund(refund_no, order.id, &now)?;
            assert!(inserted, "refund_no {refund_no} appeared inside its own transaction");
            // The submission to the platform that took the payment is queued
            // with the request, in its transaction: it cannot be lost.
            let took = tx.callbacks_of_order(order.id)?.into_iter().find(|p| p.outcome == PaymentOutcome::Applied);
            if let Some(channel) =
                took.map(|p| p.channel).filter(|c| self.config.platforms.channels().contains(&c.as_str()))
            {
                tx.enqueue_platform_refund_call(
                    crate::domain::PlatformCallKind::Refund,
                    &channel,
                    order_no,
                    refund_no,
                    &now,
                    &now,
                )?;
            }
            let refunding = tx.order_by_id(order.id)?;
            let data = EventData::Refund { order: &refunding, refund_no, status: RefundStatus::Requested };
            tx.emit_event(EventType::OrderRefunding, &format!("{order_no}/{refund_no}"), order_no, &data, &now)?;
            Ok(refunding)
        })
    }

    // ---- payment callbacks: the incident's path ----

    /// Delivers a verified payment callback, exactly once per pay_no.
    pub fn deliver_payment(&self, cb: &PaymentCallback) -> Result<PaymentReply, Error> {
        let reply = self.deliver_payment_from(cb, SOURCE_CALLBACK)?;
        self.metrics.observe_callback("payment", reply.outcome_str());
        if matches!(reply.outcome, PaymentReplyOutcome::Duplicate { .. }) {
            self.metrics.observe_duplicate("callback");
        }
        Ok(reply)
    }

    /// The exactly-once path for a payment from `source` (`callback` or
    /// `reconciliation`).
    pub fn deliver_payment_from(&self, cb: &PaymentCallback, source: &str) -> Result<PaymentReply, Error> {
        validate_payment(cb)?;
        // 1. The key is the payment's own serial number, not the order: two
        //    payments of one order are not serialised here; the database decides.
        let pay_key = self.locks.lock(LockKey::Pay(&cb.pay_no));
        // A re-delivery of a decided pay_no is answered from a read snapshot,
        // without queueing for the writer: a decided outcome is final (trigger
        // pay_callback_log_outcome_final), except payment_failed, which a
        // SUCCESS may supersede; that case, and everything else, takes the
        // write path (whose storage checks come before and after its commit).
        // Nothing is written on this path.
        if let Some(original) = self.settled_outcome(cb)? {
            // Not even a duplicate is acknowledged once the files are lost:
            // the record it vouches for may live only in a deleted -wal, and
            // a platform that hears 2xx stops retrying.
            self.store.check_storage()?;
            return Ok(PaymentReply { outcome: PaymentReplyOutcome::Duplicate { original } });
        }
        let now = self.clock.now_text();
        // 2. BEGIN IMMEDIATE ... 7. COMMIT, inside `write`.
        self.store.write(&[&pay_key], |tx| self.record_and_decide(tx, cb, source, &now))
        // 8. `_pay_key` drops here, after the commit.
    }

    /// The final outcome already recorded for this delivery's pay_no, if
    /// the delivery cannot change it. An unknown order answers `None`, so
    /// the write path refuses it exactly as before.
    fn settled_outcome(&self, cb: &PaymentCallback) -> Result<Option<PaymentOutcome>, Error> {
        self.store.read(|tx| {
            if tx.order_by_no(&cb.order_no)?.is_none() {
                return Ok(None);
            }
            let prior = tx.callback_by_pay_no(&cb.pay_no)?;
            Ok(prior
                .filter(|p| p.decided)
                .filter(|p| !(p.outcome == PaymentOutcome::PaymentFailed && cb.status == PlatformStatus::Success))
                .map(|p| p.outcome))
        })
    }

    /// Steps 3-6 of the pipeline inside the caller's IMMEDIATE transaction:
    /// record the delivery under uk_pay_no, then decide it. A refusal (an
    /// unknown order) happens before the first write.
    pub(crate) fn record_and_decide(
        &self,
        tx: &WriteTx,
        cb: &PaymentCallback,
        source: &str,
        now: &str,
    ) -> Result<PaymentReply, Error> {
        check_platform_time(tx, cb, source, now, &self.config.platforms.registry)?;
        let order = tx.order_by_no(&cb.order_no)?.ok_or_else(|| Error::order_not_found(&cb.order_no))?;
        let new = NewCallback {
            pay_no: &cb.pay_no,
            channel: &cb.channel,
            order_id: order.id,
            amount: cb.amount,
            currency: cb.currency.as_deref(),
            status: cb.status,
            source,
            raw_body: &cb.raw_body,
            paid_at: cb.paid_at.as_deref(),
            received_at: now,
        };
        // 3. The record that already holds this pay_no (uk_pay_no), read
        //    inside the writer's transaction, so nothing can claim the pay_no
        //    between this read and the INSERT below.
        let row = match tx.callback_by_pay_no(&cb.pay_no)? {
            None if tx.setting(SETTING_MODE)?.as_deref() == Some(MODE_RECORD_ONLY) => {
                // Record-only mode (a setting every process on the file
                // obeys): the record waits, `received`, to be decided later by `drain`.
                tx.record_received(&new)?;
                return Ok(PaymentReply { outcome: PaymentReplyOutcome::Decided(PaymentOutcome::Recorded) });
            }
            None => DecisionRow::New(&new),
            Some(prior) => {
                // A FAILED of this pay_no — decided `payment_failed`, or still
                // waiting in record-only mode — may be superseded once by a
                // SUCCESS for the same order. A pay_no never moves to another order.
                let supersedes = prior.status == PlatformStatus::Failed
                    && cb.status == PlatformStatus::Success
                    && prior.order_id == order.id;
                // The FAILED delivery was acknowledged: its exact bytes move to the audit row.
                let failed_body = if supersedes { Some(tx.raw_body_of(prior.id)?) } else { None };
                if !(supersedes && tx.supersede_failed_payment(prior.id, &new)?) {
                    return Ok(PaymentReply { outcome: PaymentReplyOutcome::Duplicate { original: prior.outcome } });
                }
                use base64::Engine;
                let failed_body = base64::engine::general_purpose::STANDARD.encode(failed_body.unwrap_or_default());
                let detail = AuditDetail::PaymentFailedSuperseded {
                    pay_no: &cb.pay_no,
                    prior: &prior,
                    failed_body: &failed_body,
                };
                tx.audit(now, ACTOR_SYSTEM, "payment_failed_superseded", Some(&order.order_no), &detail)?;
                if tx.setting(SETTING_MODE)?.as_deref() == Some(MODE_RECORD_ONLY) {
                    return Ok(PaymentReply { outcome: PaymentReplyOutcome::Decided(PaymentOutcome::Recorded) });
                }
                DecisionRow::Received(prior.id)
            }
        };
        // 4-6. Decide: CAS, side effects, event, and the record's outcome.
        let delivery = Delivery {
            pay_no: cb.pay_no.clone(),
            channel: cb.channel.clone(),
            amount: cb.amount,
            currency: cb.currency.clone(),
            status: cb.status,
            paid_at: cb.paid_at.clone(),
        };
        let outcome = self.decide_payment(tx, &delivery, row, &order, now)?;
        Ok(PaymentReply { outcome: PaymentReplyOutcome::Decided(outcome) })
    }

    /// Decides a recorded payment in the spec's order of precedence. The
    /// CAS's affected-row count decides `applied`; only when it changed
    /// nothing is the order read to say why.
    pub(crate) fn decide_payment(
        &self,
        tx: &WriteTx,
        record: &Delivery,
        row: DecisionRow<'_>,
        order: &Order,
        now: &str,
    ) -> Result<PaymentOutcome, Error> {
        let paid_at = record.paid_at.clone().unwrap_or_else(|| now.to_owned());
        // Currency is part of the amount: money in another currency never
        // pays the order, whatever the number (docs/channels.md).
        let same_currency = record.currency.as_deref().is_none_or(|c| c == order.currency);
        // The order as it stands after the decision (for the event), known
        // without another read when the CAS moved it.
        let (outcome, current) = if record.status == PlatformStatus::Failed {
            (PaymentOutcome::PaymentFailed, None)
        } else if same_currency && tx.cas_order_paid(order.id, record.amount, &record.pay_no, &paid_at)? {
            let paid = Order {
                status: OrderStatus::Paid,
                pay_no: Some(record.pay_no.clone()),
                paid_at: Some(paid_at.clone()),
                ..order.clone()
            };
            // A read that fails (the connection just went away) proves
            // nothing: the transaction cannot commit either.
            #[cfg(debug_assertions)]
            if let Ok(read) = tx.order_by_id(order.id) {
                assert_eq!(read, paid, "the paid order as computed");
            }
            (PaymentOutcome::Applied, Some(paid))
        } else {
            let current = tx.order_by_id(order.id)?;
            let outcome = match current.status {
                OrderStatus::Closed => PaymentOutcome::PaidAfterClose,
                OrderStatus::Pending => {
                    assert!(
                        !same_currency || current.amount != record.amount,
                        "CAS refused a PENDING order at its own amount"
                    );
                    PaymentOutcome::AmountMismatch
                }
                _ => PaymentOutcome::AlreadyPaid,
            };
            (outcome, Some(current))
        };
        let rewards_due = if outcome == PaymentOutcome::Applied {
            Some(self.apply_rewards(tx, order, record.amount, now)?)
        } else {
            None
        };
        let rewards_due = rewards_due.as_ref().map(JsonText::json_text);
        match row {
            DecisionRow::Received(id) => {
                // Under its pay_no lock nobody else decides it; the keyed
                // drain holds none, and on PostgreSQL a callback it read as
                // received may be decided by another process before its CAS.
                if !tx.decide_callback(id, outcome, now, rewards_due.as_deref())? {
                    return Err(tx.stale_read(&format!("callback {id} was decided by a concurrent transaction")));
                }
            }
            DecisionRow::New(new) => tx.record_decided(new, outcome, now, rewards_due.as_deref())?,
        }
        if let (Some(current), true) = (current, outcome == PaymentOutcome::Applied || outcome.requires_refund()) {
            let (pay_no, channel, amount) = (&record.pay_no, &record.channel, record.amount);
            let data = EventData::Payment { order: &current, pay_no, channel, amount, outcome };
            let (event_type, subject) = if outcome == PaymentOutcome::Applied {
                (EventType::OrderPaid, order.order_no.as_str())
            } else {
                (EventType::PaymentRefundRequired, record.pay_no.as_str())
            };
            if !tx.emit_event(event_type, subject, &order.order_no, &data, now)? {
                // Impossible while the CAS and uk_pay_no hold; the unique key is the last word.
                log_suppressed("outbox_event", &event_type.event_id(subject));
            }
        }
        Ok(outcome)
    }

    /// Issues the configured coupons and points, each under its own UNIQUE
    /// key, and returns the rewards due as recorded with the payment.
    fn apply_rewards(&self, tx: &WriteTx, order: &Order, amount: i64, now: &str) -> Result<RewardsDue, Error> {
        let rewards = &self.config.rewards;
        for template in &rewards.coupon_templates {
            if !tx.issue_coupon(&order.user_id, order.id, template, now)? {
                log_suppressed("user_coupon", &format!("{}/{template}", order.order_no));
            }
        }
        let points = rewards.points_for(amount);
        if points > 0 && !tx.add_order_points(&order.user_id, order.id, points, now)? {
            log_suppressed("point_log", &format!("{}/ORDER_PAID", order.order_no));
        }
        Ok(RewardsDue { coupons: rewards.coupon_templates.clone(), points })
    }

    // ---- refund callbacks ----

    /// Delivers a verified refund result, exactly once per refund_no.
    pub fn deliver_refund(&self, cb: &RefundCallback) -> Result<RefundOutcome, Error> {
        self.deliver_refund_of(cb, RefundOf::Named)
    }

    /// Delivers a refund result that names no refund request: it settles
    /// the order's refund in flight, read inside the refund's transaction,
    /// or, when the order has none, is the refund `cb.refund_no`.
    pub fn deliver_refund_in_flight(&self, cb: &RefundCallback) -> Result<RefundOutcome, Error> {
        self.deliver_refund_of(cb, RefundOf::InFlight)
    }

    fn deliver_refund_of(&self, cb: &RefundCallback, of: RefundOf) -> Result<RefundOutcome, Error> {
        let outcome = self.deliver_refund_once(cb, of)?;
        self.metrics.observe_callback("refund", outcome.as_str());
        if outcome == RefundOutcome::Duplicate {
            self.metrics.observe_duplicate("callback");
        }
        Ok(outcome)
    }

    fn deliver_refund_once(&self, cb: &RefundCallback, of: RefundOf) -> Result<RefundOutcome, Error> {
        validate_refund(cb)?;
        // An in-flight refund's own refund_no is known only inside the
        // transaction; its key is the notice's (the trade's), so re-deliveries
        // of one notice still queue here, and the settle CAS decides the rest.
        let refund_key = self.locks.lock(LockKey::Refund(&cb.refund_no));
        let now = self.clock.now_text();
        self.store.write(&[&refund_key], |tx| {
            let order = tx.order_by_no(&cb.order_no)?.ok_or_else(|| Error::order_not_found(&cb.order_no))?;
            let in_flight;
            let cb = match (of, &order.refund_no) {
                (RefundOf::InFlight, Some(refund_no)) => {
                    in_flight = RefundCallback { refund_no: refund_no.clone(), ..cb.clone() };
                    &in_flight
                }
                _ => cb,
            };
            let refund = tx.refund_by_no(&cb.refund_no)?.filter(|r| r.order_id == order.id);
            let Some(refund) = refund else {
                return unexpected_refund(tx, &order, cb, None, &now);
            };
            let (settle_to, outcome) = match (refund.status, cb.status) {
                (RefundStatus::Requested, PlatformStatus::Success) => (RefundStatus::Succeeded, RefundOutcome::Applied),
                (RefundStatus::Requested, PlatformStatus::Failed) => {
                    (RefundStatus::Failed, RefundOutcome::RefundFailed)
                }
                (RefundStatus::Succeeded, PlatformStatus::Success) | (RefundStatus::Failed, PlatformStatus::Failed) => {
                    return Ok(RefundOutcome::Duplicate)
                }
                (settled, _) => return unexpected_refund(tx, &order, cb, Some(settled), &now),
            };
            // Only a success has a platform settlement time worth keeping.
            let platform_settled_at = cb.settled_at.as_deref().filter(|_| settle_to == RefundStatus::Succeeded);
            if !tx.settle_refund(refund.id, settle_to, &now, platform_settled_at)? {
                return Err(Error::internal(format!("refund {} changed inside its transaction", cb.refund_no)));
            }
            let moved = match outcome {
                RefundOutcome::Applied => tx.cas_order_refunded(order.id, &cb.refund_no, &now)?,
                _ => tx.cas_order_refund_failed(order.id, &cb.refund_no)?,
            };
            if !moved {
                // A REQUESTED refund always has its order REFUNDING (uk_refund_requested,
                // the CAS in request_refund); anything else is a bug: roll back.
                return Err(Error::internal(format!("order {} is not REFUNDING for {}", order.order_no, cb.refund_no)));
            }
            let event_type = if outcome == RefundOutcome::Applied {
                tx.reverse_order_points(order.id, &now)?;
                tx.freeze_active_coupons(order.id)?;
                EventType::OrderRefunded
            } else {
                EventType::OrderRefundFailed
            };
            let current = tx.order_by_id(order.id)?;
            let data = EventData::Refund { order: &current, refund_no: &cb.refund_no, status: settle_to };
            let subject = format!("{}/{}", order.order_no, cb.refund_no);
            tx.emit_event(event_type, &subject, &order.order_no, &data, &now)?;
            Ok(outcome)
        })
    }

    // ---- reads ----

    pub fn events(&self, after: i64, limit: usize) -> Result<Vec<EventRow>, Error> {
        self.store.read(|tx| tx.events_after(after, limit.clamp(1, PAGE_LIMIT_MAX)))
    }

    pub fn user_coupons(&self, user_id: &str) -> Result<Vec<CouponRow>, Error> {
        self.store.read(|tx| tx.coupons_of_user(user_id))
    }

    /// The user's points balance and entries.
    pub fn user_points(&self, user_id: &str) -> Result<(i64, Vec<PointRow>), Error> {
        let entries = self.store.read(|tx| tx.points_of_user(user_id))?;
        let balance = entries.iter().map(|e| e.points).sum();
        Ok((balance, entries))
    }

    /// Healthy when the database's paths name the files payonce has open
    /// and a fresh connection reads the schema version and a page of
    /// `orders`. Every failure is a 503: the service cannot serve.
    pub fn health(&self) -> Result<(), Error> {
        self.store.check_health().map_err(|e| match e.kind.is_unavailable() {
            true => e,
            false => Error::new(ErrorKind::DatabaseUnavailable, format!("the database cannot be read: {}", e.message)),
        })
    }
}

/// Which refund a refund result settles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RefundOf {
    /// The one its `refund_no` names.
    Named,
    /// The order's refund in flight, else its `refund_no`.
    InFlight,
}

/// CAS PENDING→CLOSED with its `order.closed` event; `None` when the CAS
/// changed nothing (the order is not PENDING).
pub(crate) fn close_in_tx(tx: &WriteTx, order: &Order, now: &str) -> Result<Option<Order>, Error> {
    if !tx.cas_order_closed(order.id, now)? {
        return Ok(None);
    }
    let closed = tx.order_by_id(order.id)?;
    let data = EventData::Closed { order: &closed };
    tx.emit_event(EventType::OrderClosed, &order.order_no, &order.order_no, &data, now)?;
    Ok(Some(closed))
}

/// Writes the refusal to `audit_log` (committed with the transaction) and
/// returns the 409 for the caller.
pub(crate) fn refuse_transition(
    tx: &WriteTx,
    order: &Order,
    to: OrderStatus,
    action: &str,
    now: &str,
    about: Refused,
) -> Result<Error, Error> {
    let detail = AuditDetail::TransitionRefused { about, from: order.status, to, request: action };
    tx.audit(now, "api", "transition_refused", Some(&order.order_no), &detail)?;
    Ok(Error::invalid_transition(format!("order {} is {}; cannot {action} it", order.order_no, order.status.as_str())))
}

/// A refund result payonce did not ask for, or one contradicting a settled
/// refund: recorded in `audit_log` for an operator.
fn unexpected_refund(
    tx: &WriteTx,
    order: &Order,
    cb: &RefundCallback,
    settled: Option<RefundStatus>,
    now: &str,
) -> Result<RefundOutcome, Error> {
    let detail = AuditDetail::UnexpectedRefund {
        refund_no: &cb.refund_no,
        channel: &cb.channel,
        status: cb.status,
        settled_status: settled,
        order_status: order.status,
    };
    tx.audit(now, ACTOR_SYSTEM, "unexpected_refund", Some(&order.order_no), &detail)?;
    Ok(RefundOutcome::UnexpectedRefund)
}

/// Section 13's window: a platform notification of a pay_no payonce has
/// not recorded must carry a payment time within [received − 72 h,
/// received + 5 min] and in the years 2000-2199, or it is 400 naming the
/// field and nothing is recorded (the transaction has written nothing yet).
/// Otherwise a forger with the secret could date a payment where
/// reconciliation never looks. A re-delivery of a recorded pay_no is judged
/// by uk_pay_no as always (`duplicate`); reconciliation repairs are the
/// platform's own statement and are not windowed. Refund notices never
/// reach here.
fn check_platform_time(
    tx: &WriteTx,
    cb: &PaymentCallback,
    source: &str,
    now: &str,
    platforms: &crate::platforms::Registry,
) -> Result<(), Error> {
    let Some(paid_at) = cb.paid_at.as_deref().filter(|_| source == SOURCE_CALLBACK) else {
        return Ok(());
    };
    let paid_ms = crate::clock::parse_rfc3339_ms(paid_at);
    let now_ms = crate::clock::parse_rfc3339_ms(now)
        .ok_or_else(|| Error::internal(format!("payonce's own time {now:?} does not parse")))?;
    if paid_ms.is_some_and(|ms| crate::domain::platform_time_plausible(ms, now_ms)) {
        return Ok(());
    }
    // Only an implausible time costs this look-up.
    if tx.callback_by_pay_no(&cb.pay_no)?.is_some() {
        return Ok(());
    }
    let field = platforms.paid_time_field(&cb.channel);
    Err(Error::invalid(format!(
        "{field} {paid_at} is not within {} h before and {} min after payonce received the notification ({now}), \
         or not in the years {}-{}",
        crate::domain::PLATFORM_TIME_BEFORE_MS_MAX / 3_600_000,
        crate::domain::PLATFORM_TIME_AFTER_MS_MAX / 60_000,
        crate::domain::PLATFORM_YEAR_FIRST,
        crate::domain::PLATFORM_YEAR_LAST
    )))
}

/// A unique key stopped a second side effect that the CAS should have
/// stopped first. Never expected; logged so an operator sees it.
fn log_suppressed(table: &str, key: &str) {
    crate::log::warn("a unique key suppressed a duplicate side effect", &[("table", &table), ("key", &key)]);
}

fn validate_create_order(req: &CreateOrder) -> Result<(), Error> {
    if !is_identifier(&req.order_no) {
        return Err(Error::invalid("order_no must be 1-64 characters of [A-Za-z0-9_.-]"));
    }
    if !is_identifier(&req.user_id) {
        return Err(Error::invalid("user_id must be 1-64 characters of [A-Za-z0-9_.-]"));
    }
    if !is_amount(req.amount) {
        return Err(Error::invalid("amount must be an integer from 1 to 1000000000000 (minor units)"));
    }
    if !is_currency(&req.currency) {
        return Err(Error::invalid("currency must be 3 upper-case letters"));
    }
    if let Some(s) = req.expires_in_s {
        if !(1..=EXPIRES_IN_S_MAX).contains(&s) {
            return Err(Error::invalid("expires_in_s must be an integer from 1 to 86400"));
        }
    }
    Ok(())
}

fn validate_payment(cb: &PaymentCallback) -> Result<(), Error> {
    if !is_identifier(&cb.pay_no) {
        return Err(Error::invalid("pay_no must be 1-64 characters of [A-Za-z0-9_.-]"));
    }
    if !is_identifier(&cb.order_no) {
        return Err(Error::invalid("order_no must be 1-64 characters of [A-Za-z0-9_.-]"));
    }
    if !is_amount(cb.amount) {
        return Err(Error::invalid("amount must be an integer from 1 to 1000000000000 (minor units)"));
    }
    if cb.currency.as_deref().is_some_and(|c| !is_currency(c)) {
        return Err(Error::invalid("currency must be 3 upper-case letters"));
    }
    Ok(())
}

fn validate_refund(cb: &RefundCallback) -> Result<(), Error> {
    if !is_identifier(&cb.refund_no) {
        return Err(Error::invalid("refund_no must be 1-64 characters of [A-Za-z0-9_.-]"));
    }
    if !is_identifier(&cb.order_no) {
        return Err(Error::invalid("order_no must be 1-64 characters of [A-Za-z0-9_.-]"));
    }
    // Stored times sort as text only in payonce's one format.
    if let Some(at) = &cb.settled_at {
        if crate::clock::parse_rfc3339_ms(at).map(crate::clock::format_ms).as_ref() != Some(at) {
            return Err(Error::invalid("a refund's settled_at must be YYYY-MM-DDTHH:MM:SS.sssZ"));
        }
    }
    Ok(())
}
