//! `App`: one payonce, what the HTTP API offers, callable in process with
//! no socket. It owns the core (store, key locks, clock, metrics, settings;
//! `src/services/core.rs`) and hands out the services that do the work:
//! `app.orders()`, `app.payments()`, `app.refunds()`, `app.operations()`,
//! `app.platform_calls()`, `app.webhooks()` (`src/services/`). Here too:
//! the settings (`Config`), the `Answer` a keyed write stores, and the
//! types the operations take and return.

use crate::clock::Clock;
use crate::domain::{is_identifier, Order, Rewards};
use crate::domain::{AuditRow, CallbackRecord, CouponRow, EventRow, PlatformCallSummary, PointRow};
pub use crate::domain::{PaymentCallback, PaymentReply, PaymentReplyOutcome, RefundCallback};
use crate::error::Error;
#[cfg(any(test, feature = "test-support"))]
use crate::keylock::KeyedLocks;
use crate::metrics::Metrics;
use crate::services::{Core, Operations, Orders, Payments, PlatformCalls, Prepays, Refunds, Webhooks};
use crate::store::{Store, StoreOptions};
use serde_json::Value;

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
    /// A reload of `--api-token-file` replaces them (never with none).
    pub api_tokens: crate::held::Held<Vec<ApiToken>>,
    /// The webhook relay's endpoints, secrets, timeout and schedule.
    pub webhooks: crate::webhook::WebhookConfig,
    /// The platforms that are on (their notices, and the calls payonce may
    /// make, docs/platforms.md) and how calls are paced; none by default.
    pub platforms: crate::platforms::Platforms,
    /// What payonce does with a payment it did not want (`--refund-unwanted`).
    pub refund_unwanted: crate::domain::RefundUnwanted,
    /// The secrets given as files, which `SIGHUP` reads again.
    pub secret_files: Vec<crate::held::SecretFile>,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            rewards: Rewards::default(),
            order_ttl_s: ORDER_TTL_S_DEFAULT,
            idempotency_ttl_s: IDEMPOTENCY_TTL_S_DEFAULT,
            api_tokens: crate::held::Held::default(),
            webhooks: crate::webhook::WebhookConfig::default(),
            platforms: crate::platforms::Platforms::default(),
            refund_unwanted: crate::domain::RefundUnwanted::Manual,
            secret_files: Vec::new(),
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

/// One payonce: its core and the services over it. Nothing of it is
/// reached directly; a caller asks a service (`app.orders()` ...).
pub struct App {
    core: Core,
}

/// An order to create (already shaped; [`Orders::create_order`](crate::services::Orders::create_order) validates it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CreateOrder {
    pub order_no: String,
    pub user_id: String,
    pub amount: i64,
    pub currency: String,
    pub expires_in_s: Option<i64>,
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
    /// The webhook deliveries of its events, by event then endpoint.
    pub webhook_deliveries: Vec<crate::domain::DeliveryRow>,
    /// Its own refunds (not its payments'), oldest first.
    pub refunds: Vec<crate::domain::RefundRecord>,
    /// The refunds of its refund-required payments, oldest first.
    pub payment_refunds: Vec<crate::domain::RefundRecord>,
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
        let app = App { core: Core::new(Store::open(db, options)?, clock, config) };
        app.core.record_reward_settings()?;
        Ok(app)
    }

    /// Opens an existing database for offline commands (`inspect`,
    /// `reconcile`), with the reward settings `serve` recorded in it, so a
    /// repair applies the same rewards. Never creates a file.
    pub fn open_existing(db: &str, clock: Clock) -> Result<App, Error> {
        if db != ":memory:" && !crate::store::is_postgres(db) && !std::path::Path::new(db).exists() {
            return Err(Error::invalid(format!("no database at {db:?}")));
        }
        let store = Store::open(db, &StoreOptions::default())?;
        let (coupons, points) =
            store.read(|tx| Ok((tx.setting("reward_coupon_templates")?, tx.setting("reward_points_per_yuan")?)))?;
        let coupon_templates: Vec<String> =
            coupons.as_deref().and_then(|c| serde_json::from_str(c).ok()).unwrap_or_default();
        let points_per_yuan = points.as_deref().and_then(|p| p.parse().ok()).unwrap_or(0);
        let config = Config { rewards: Rewards { coupon_templates, points_per_yuan }, ..Config::default() };
        Ok(App { core: Core::new(store, clock, config) })
    }

    /// This payonce with these platforms on (`sync` opens an existing
    /// database, then turns on the platforms its flags name).
    pub fn with_platforms(mut self, platforms: crate::platforms::Platforms) -> App {
        self.core.config_mut().platforms = platforms;
        self
    }

    /// Orders: create, close, expire, read; the event feed, a user's rewards.
    pub fn orders(&self) -> Orders<'_> {
        self.core.orders()
    }

    /// Payment callbacks and their decisions; payment resolutions.
    pub fn payments(&self) -> Payments<'_> {
        self.core.payments()
    }

    /// Refund requests, refund callbacks, refund resolutions.
    pub fn refunds(&self) -> Refunds<'_> {
        self.core.refunds()
    }

    /// The mode, drain, inspection, compensation, reconciliation, backup,
    /// Idempotency-Key results and health.
    pub fn operations(&self) -> Operations<'_> {
        self.core.operations()
    }

    /// Sync, closes and refunds at the platforms; the platform-call pool's queue.
    pub fn platform_calls(&self) -> PlatformCalls<'_> {
        self.core.platform_calls()
    }

    /// Payments created at the platforms, once per order and channel.
    pub fn prepays(&self) -> Prepays<'_> {
        self.core.prepays()
    }

    /// Webhook deliveries and the relay's reads and writes.
    pub fn webhooks(&self) -> Webhooks<'_> {
        self.core.webhooks()
    }

    /// The clock payonce runs on (a manual one moves under a test).
    pub fn clock(&self) -> &Clock {
        self.core.clock()
    }

    /// The settings payonce runs with.
    pub fn config(&self) -> &Config {
        self.core.config()
    }

    /// The counters `/metrics` renders.
    pub fn metrics(&self) -> &Metrics {
        self.core.metrics()
    }

    /// Test hatch: the store, for raw SQL and the store's own test hooks.
    #[cfg(any(test, feature = "test-support"))]
    pub fn store(&self) -> &Store {
        self.core.store()
    }

    /// Test hatch: the key locks, to hold a key while a test races it.
    #[cfg(any(test, feature = "test-support"))]
    pub fn locks(&self) -> &KeyedLocks {
        self.core.locks()
    }

    /// Test hook: the next `writes` API writes fail with a 500 after their
    /// work and stored response are written but before commit, to prove
    /// that nothing of a failed request survives. Returns how many of the
    /// previously armed failures had not fired.
    #[cfg(any(test, feature = "test-support"))]
    pub fn fail_writes_after_work(&self, writes: u32) -> u32 {
        self.core.fail_writes_after_work(writes)
    }
}
