//! The payment platforms, one folder each (`generic/`, `wechatpay/`,
//! `alipay/`): its notices (incoming notifications verified and mapped),
//! its calls (outgoing questions, answers verified), its statement format
//! for reconciliation, and its keys, loaded from the settings.
//!
//! Two traits say what a platform does: [`Notices`] for what it tells
//! payonce, [`Calls`] for what payonce asks it. One [`Registry`] holds the
//! platforms the checked configuration turned on, looked up by name; `App`,
//! `api` and `platform_ops.rs` reach a platform only through it, as trait
//! objects. The platforms know neither `App` nor the store: `api` delivers
//! what a notice parses, `platform_ops.rs` records and acts on a call.
//!
//! Adding a platform is one folder here, one line in [`LINES`], and its
//! settings (docs/platforms.md, "Adding a platform").
//!
//! A notification that fails verification is refused in the platform's
//! protocol and records nothing: verification happens before the first write.

pub mod alipay;
mod calls;
pub mod generic;
pub mod wechatpay;

#[cfg(test)]
pub(crate) use calls::test_keys;
pub use calls::{
    agent, public_key_from_pem, CloseAnswer, Exchange, MerchantKey, Payment, PrepayAnswer, RefundAnswer, RefundState,
    TradeState, CLOSE_GIVE_UP_S_DEFAULT, PLATFORM_RETRY_S_DEFAULT, PLATFORM_TIMEOUT_MS_DEFAULT, PLATFORM_WAITERS_MAX,
    PREPAY_REUSE_S_DEFAULT, REFUND_QUERY_AFTER_S_DEFAULT, RESPONSE_BYTES_MAX, SOURCE_QUERY,
};
pub(crate) use calls::{
    beijing_plain, beijing_rfc3339, body_text, nonce, normalised_time, read_key_file, require, unusable,
};

use crate::domain::{PaymentCallback, PaymentReply, RefundCallback, RefundOutcome};
use crate::error::Error;
use crate::recon::BillFormat;
use crate::wire::{Request, Response};
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

/// What a verified notification asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Notice {
    Payment(PaymentCallback),
    Refund(RefundCallback),
    /// A refund result that names no refund request (Alipay's full refund,
    /// `TRADE_CLOSED` with `gmt_refund` and no `out_biz_no`): it settles the
    /// order's refund in flight, looked up inside the refund's transaction;
    /// `refund_no` is the one to use when the order has none.
    RefundInFlight(RefundCallback),
    /// Authentic, but changes nothing (e.g. Alipay's TRADE_CLOSED of an unpaid trade).
    Ignored(&'static str),
}

/// What payonce did with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    Payment(PaymentReply),
    Refund(RefundOutcome),
    Ignored,
}

/// A platform's incoming notifications: `/v1/callbacks/{name}[/refund]`.
pub trait Notices: Send + Sync {
    /// The `{channel}` of `/v1/callbacks/{channel}`.
    fn name(&self) -> &'static str;
    /// Verifies the request at `now_ms` and maps it; `refund_route` is true
    /// for `/v1/callbacks/{channel}/refund`.
    fn parse(&self, now_ms: i64, req: &Request, refund_route: bool) -> Result<Notice, Error>;
    /// The platform's success answer (2xx tells it to stop retrying).
    fn acknowledge(&self, reply: &Reply) -> Response;
    /// The platform's failure answer (it will retry).
    fn refuse(&self, err: &Error) -> Response;
    /// The field of a payment notification that carries the platform's
    /// payment time (`PaymentCallback::paid_at`), for a refusal to name.
    fn paid_time_field(&self) -> &'static str {
        "paid_at"
    }
    /// What it verifies notices with, for the line `serve` prints at start
    /// (key identifiers and expiries, never a secret).
    fn describe(&self) -> String {
        String::new()
    }
}

/// A refund to submit: `amount` (in the currency's minor unit) of the
/// order `order_no`'s payment, under the merchant's `refund_no`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RefundRequest<'a> {
    pub order_no: &'a str,
    pub refund_no: &'a str,
    /// What this refund returns, minor units.
    pub amount: i64,
    /// The order's (the payment's) whole amount, minor units.
    pub total: i64,
    pub currency: &'a str,
    /// Why, shown to the buyer (WeChat `reason`, Alipay `refund_reason`).
    pub reason: Option<&'a str>,
    /// The platform's own number of the payment to refund (WeChat
    /// `transaction_id`, Alipay `trade_no`) when the refund returns one
    /// payment rather than the order: then it is named by that number, not
    /// by `out_trade_no`, and `total` is that payment's amount.
    pub pay_no: Option<&'a str>,
}

/// A payment to create at the platform (docs/platforms.md, "Paying"): the
/// order `order_no`'s `amount` (minor units) in `currency`, payable until
/// `expires_at_ms`, its result notified to `notify_url`, by `method` (one of
/// [`Calls::prepay_methods`]); what some methods need besides: the WeChat
/// `appid`, the JSAPI payer's `openid`, the H5 buyer's `client_ip`, the
/// page Alipay returns the buyer to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrepayRequest<'a> {
    pub order_no: &'a str,
    pub amount: i64,
    pub currency: &'a str,
    pub description: &'a str,
    pub expires_at_ms: i64,
    pub notify_url: &'a str,
    pub method: &'a str,
    pub appid: Option<&'a str>,
    pub openid: Option<&'a str>,
    pub client_ip: Option<&'a str>,
    pub return_url: Option<&'a str>,
}

/// A platform's merchant API: the questions payonce asks it (docs/platforms.md).
/// Each call is one HTTP exchange, bounded by `--platform-timeout-ms`, whose
/// answer is trusted only once it verifies and names what was asked.
pub trait Calls: Send + Sync {
    /// The channel it answers for, as `platform_call.channel` holds it.
    fn name(&self) -> &'static str;
    /// Where the calls go (its API base or gateway), for logs and `Debug`.
    fn endpoint(&self) -> &str;
    /// The trade's state.
    fn query(&self, order_no: &str, now_ms: i64) -> Exchange<TradeState>;
    /// Close the trade, so the buyer can no longer pay it there.
    fn close(&self, order_no: &str, now_ms: i64) -> Exchange<CloseAnswer>;
    /// Submit a refund of its amount in its currency under its refund_no.
    fn refund(&self, refund: &RefundRequest<'_>, now_ms: i64) -> Exchange<RefundAnswer>;
    /// The state of a refund it accepted.
    /// `pay_no`: the payment a payment's refund returns (as in [`RefundRequest`]).
    fn refund_query(&self, order_no: &str, refund_no: &str, pay_no: Option<&str>, now_ms: i64)
        -> Exchange<RefundState>;
    /// The payment methods it creates payments for (`PrepayRequest::method`).
    fn prepay_methods(&self) -> &'static [&'static str];
    /// Whether `method`'s payment is a request signed for the buyer to open
    /// (no server call, nothing kept: Alipay page, wap, app) rather than one
    /// made at the platform once.
    fn prepay_is_signed_only(&self, _method: &str) -> bool {
        false
    }
    /// The apps payments are created under (WeChat Pay's `appid`s, from
    /// `--wechatpay-appid`; empty: none configured, so no payment), or
    /// `None` where a payment names no app.
    fn prepay_appids(&self) -> Option<&[String]> {
        None
    }
    /// Why `request` cannot be sent as asked (the field named), checked
    /// before anything is recorded or called.
    fn prepay_check(&self, request: &PrepayRequest<'_>) -> Result<(), String>;

    /// Create the order's payment, with `out_trade_no` = order_no: one
    /// signed call bounded by the timeout, or, for a request the buyer
    /// opens (Alipay page, wap, app), no call (no `http_status`).
    fn prepay(&self, request: &PrepayRequest<'_>, now_ms: i64) -> Exchange<PrepayAnswer>;
}

/// A key file that failed to load on a reload: its path and why. The key
/// it held before stays in use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyFileFailure {
    pub file: String,
    pub why: String,
}

/// One file of a reload: what `read` makes of it; or, when that fails, what
/// `old` gives (the key in use) and the file named in `failures` with why.
pub(crate) fn reload_or_keep<T>(
    file: &str,
    read: impl FnOnce(&str) -> Result<T, String>,
    old: impl FnOnce() -> T,
    failures: &mut Vec<KeyFileFailure>,
) -> T {
    read(file).unwrap_or_else(|why| {
        failures.push(KeyFileFailure { file: file.to_owned(), why });
        old()
    })
}

/// A certificate payonce holds: its platform, its id (WeChat Pay's serial)
/// and its notAfter, Unix ms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldCertificate {
    pub platform: &'static str,
    pub id: String,
    pub not_after_ms: i64,
}

/// A platform's key and certificate files, as its settings named them:
/// re-read on `SIGHUP` (docs/channels.md, "Keys and rotation").
pub trait KeyFiles: Send + Sync {
    /// The platform's name.
    fn name(&self) -> &'static str;
    /// Re-reads every file and swaps the keys at once for every later
    /// request (one in flight finishes with the keys it started with); a
    /// file that fails keeps the key it held, and is answered here.
    fn reload(&self) -> Vec<KeyFileFailure>;
    /// The certificates held now (bare public keys have no expiry).
    fn certificates(&self) -> Vec<HeldCertificate>;
    /// Downloads the platform's certificates when its schedule says so
    /// (the background's key refresh calls it about once a second); most
    /// platforms download nothing.
    fn refresh(&self, _now_ms: i64) {}
    /// Its certificate downloads so far, (ok, failed); `None` when it
    /// downloads none.
    fn downloads(&self) -> Option<(u64, u64)> {
        None
    }
}

/// Keys that a reload replaces (src/held.rs).
pub use crate::held::Held;

/// One platform as its settings turned it on: its notices when its incoming
/// settings are given, its calls when its outgoing ones are, and the key
/// files both read.
#[derive(Clone, Default)]
pub struct Platform {
    pub notices: Option<Arc<dyn Notices>>,
    pub calls: Option<Arc<dyn Calls>>,
    pub keys: Option<Arc<dyn KeyFiles>>,
}

impl Platform {
    pub fn notices(notices: impl Notices + 'static) -> Platform {
        Platform { notices: Some(Arc::new(notices)), calls: None, keys: None }
    }

    pub fn calls(calls: impl Calls + 'static) -> Platform {
        Platform { notices: None, calls: Some(Arc::new(calls)), keys: None }
    }

    pub fn both(notices: impl Notices + 'static, calls: impl Calls + 'static) -> Platform {
        Platform { notices: Some(Arc::new(notices)), calls: Some(Arc::new(calls)), keys: None }
    }
}

/// What every platform's settings are, as `payonce serve` was given them:
/// each platform's own (its folder's `Settings`), and what they share.
#[derive(Clone, Debug, Default)]
pub struct PlatformSettings {
    /// The generic channel's HMAC secrets; none = not configured.
    pub callback_secrets: Held<Vec<Vec<u8>>>,
    pub wechatpay: wechatpay::Settings,
    pub alipay: alipay::Settings,
    /// `--platform-timeout-ms`.
    pub timeout: Duration,
    /// `--public-base-url`: where platforms reach this payonce.
    pub public_base_url: Option<String>,
}

/// Which parts of the platforms to build: `serve` builds both, `sync` only
/// the calls (its notices' settings are not checked).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parts {
    NoticesAndCalls,
    CallsOnly,
}

/// One platform payonce ships: its name, how its settings turn it on
/// (reading each of its key files once; warnings for `serve` to print), and
/// its statement format.
pub struct Line {
    pub name: &'static str,
    /// Its notices' [`Notices::paid_time_field`], known when they are off too.
    pub paid_time_field: &'static str,
    pub configure: fn(&PlatformSettings, Parts, &mut Vec<String>) -> Result<Platform, String>,
    pub bills: &'static dyn BillFormat,
}

/// Every platform payonce ships, one line each.
pub const LINES: &[Line] = &[
    Line {
        name: generic::NAME,
        paid_time_field: generic::PAID_TIME_FIELD,
        configure: generic::configure,
        bills: &generic::Bill,
    },
    Line {
        name: wechatpay::NAME,
        paid_time_field: wechatpay::PAID_TIME_FIELD,
        configure: wechatpay::configure,
        bills: &wechatpay::Bill,
    },
    Line {
        name: alipay::NAME,
        paid_time_field: alipay::PAID_TIME_FIELD,
        configure: alipay::configure,
        bills: &alipay::Bill,
    },
];

/// The statement format of the platform `name` (reconciliation's `format`).
pub fn bills(name: &str) -> Option<(&'static str, &'static dyn BillFormat)> {
    LINES.iter().find(|line| line.name == name).map(|line| (line.name, line.bills))
}

/// The platforms that are on: their notices and their calls, by name.
#[derive(Clone, Default)]
pub struct Registry {
    notices: Vec<Arc<dyn Notices>>,
    calls: Vec<Arc<dyn Calls>>,
    keys: Vec<Arc<dyn KeyFiles>>,
}

impl Registry {
    /// The registry of these platforms, in this order (a later one of a
    /// name already there replaces that part of it).
    pub fn with(platforms: impl IntoIterator<Item = Platform>) -> Registry {
        let mut registry = Registry::default();
        for platform in platforms {
            registry.add(platform);
        }
        registry
    }

    /// Adds a platform's parts; a part of a name already there replaces it.
    pub fn add(&mut self, platform: Platform) {
        if let Some(notices) = platform.notices {
            self.notices.retain(|n| n.name() != notices.name());
            self.notices.push(notices);
        }
        if let Some(calls) = platform.calls {
            self.calls.retain(|c| c.name() != calls.name());
            self.calls.push(calls);
        }
        if let Some(keys) = platform.keys {
            self.keys.retain(|k| k.name() != keys.name());
            self.keys.push(keys);
        }
    }

    /// Re-reads every platform's key files (`SIGHUP`): the files that
    /// failed, each still served by the key it held before.
    pub fn reload_keys(&self) -> Vec<KeyFileFailure> {
        self.keys.iter().flat_map(|k| k.reload()).collect()
    }

    /// Every certificate the platforms hold now.
    pub fn certificates(&self) -> Vec<HeldCertificate> {
        self.keys.iter().flat_map(|k| k.certificates()).collect()
    }

    /// Lets every platform download what its schedule says is due.
    pub fn refresh_keys(&self, now_ms: i64) {
        for keys in &self.keys {
            keys.refresh(now_ms);
        }
    }

    /// The certificate downloads of the platform `name` so far, (ok,
    /// failed); zeros when it downloads none.
    pub fn certificate_downloads(&self, name: &str) -> (u64, u64) {
        self.keys.iter().filter(|k| k.name() == name).find_map(|k| k.downloads()).unwrap_or((0, 0))
    }

    /// The platforms of [`LINES`] as `settings` turn them on.
    pub fn configured(
        settings: &PlatformSettings,
        parts: Parts,
        warnings: &mut Vec<String>,
    ) -> Result<Registry, String> {
        let mut platforms = Vec::new();
        for line in LINES {
            platforms.push((line.configure)(settings, parts, warnings)?);
        }
        Ok(Registry::with(platforms))
    }

    /// The notices of the channel `name`, when they are on.
    pub fn notices(&self, name: &str) -> Option<&dyn Notices> {
        self.notices.iter().find(|n| n.name() == name).map(|n| n.as_ref())
    }

    /// One line per channel and per platform payonce calls, as `serve`
    /// prints them at start: the keys a notice must be signed with (a key
    /// given under the wrong serial is seen here, not at the first refused
    /// notification), and where the calls go.
    pub fn describe(&self) -> Vec<String> {
        let notices = self.notices.iter().map(|n| {
            let keys = n.describe();
            if keys.is_empty() {
                format!("channel {}: on", n.name())
            } else {
                format!("channel {}: {keys}", n.name())
            }
        });
        let calls = self.calls.iter().map(|c| format!("calls to {}: {}", c.name(), c.endpoint()));
        notices.chain(calls).collect()
    }

    /// The calls to the channel `name`, when they are on.
    pub fn calls(&self, name: &str) -> Option<&dyn Calls> {
        self.calls.iter().find(|c| c.name() == name).map(|c| c.as_ref())
    }

    /// Every platform whose calls are on, in registry order.
    pub fn callers(&self) -> impl Iterator<Item = &dyn Calls> {
        self.calls.iter().map(|c| c.as_ref())
    }

    /// The field of the channel `name`'s payment notices that carries the
    /// payment time, for a refusal to name: its notices', when they are on.
    pub fn paid_time_field(&self, name: &str) -> &'static str {
        match self.notices(name) {
            Some(notices) => notices.paid_time_field(),
            None => LINES.iter().find(|line| line.name == name).map_or("paid_at", |line| line.paid_time_field),
        }
    }

    /// The name `name` as payonce spells it, when it is a platform it knows
    /// (one of [`LINES`], or one registered).
    pub fn known(&self, name: &str) -> Option<&'static str> {
        let registered = self.notices.iter().map(|n| n.name()).chain(self.calls.iter().map(|c| c.name()));
        LINES.iter().map(|line| line.name).chain(registered).find(|known| *known == name)
    }
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("notices", &self.notices.iter().map(|n| n.name()).collect::<Vec<_>>())
            .field("calls", &self.calls.iter().map(|c| (c.name(), c.endpoint())).collect::<Vec<_>>())
            .finish()
    }
}

/// The platforms that are on, and how calls to them are paced.
#[derive(Clone, Debug)]
pub struct Platforms {
    pub registry: Registry,
    pub timeout_ms: u64,
    /// The waits between attempts of a close, in ms; the last repeats.
    pub retry_schedule_ms: Vec<u64>,
    pub close_give_up_ms: i64,
    /// How long after its submission a refund without a result is queried.
    pub refund_query_after_ms: i64,
    /// API requests waiting on platforms right now.
    pub waiting: Arc<AtomicUsize>,
    /// `--public-base-url`: the payments' `notify_url` is this plus
    /// `/v1/callbacks/{channel}`; without it no payment is created.
    pub public_base_url: Option<String>,
    /// `--prepay-reuse-s` in ms: how long a created payment is answered
    /// again without asking the platform.
    pub prepay_reuse_ms: i64,
}

impl Default for Platforms {
    fn default() -> Platforms {
        Platforms {
            registry: Registry::default(),
            timeout_ms: PLATFORM_TIMEOUT_MS_DEFAULT,
            retry_schedule_ms: crate::webhook::parse_waits("--platform-retry-s", PLATFORM_RETRY_S_DEFAULT)
                .unwrap_or_default(),
            close_give_up_ms: CLOSE_GIVE_UP_S_DEFAULT * 1000,
            refund_query_after_ms: REFUND_QUERY_AFTER_S_DEFAULT * 1000,
            waiting: Arc::default(),
            public_base_url: None,
            prepay_reuse_ms: PREPAY_REUSE_S_DEFAULT * 1000,
        }
    }
}

impl Platforms {
    /// These platforms, with the default pacing.
    pub fn with(platforms: impl IntoIterator<Item = Platform>) -> Platforms {
        Platforms { registry: Registry::with(platforms), ..Platforms::default() }
    }

    /// Whether no platform's calls are on.
    pub fn is_empty(&self) -> bool {
        self.registry.calls.is_empty()
    }

    /// The channels whose outgoing calls are on.
    pub fn channels(&self) -> Vec<&'static str> {
        self.registry.callers().map(|c| c.name()).collect()
    }

    pub(crate) fn query(&self, channel: &str, order_no: &str, now_ms: i64) -> Option<Exchange<TradeState>> {
        self.registry.calls(channel).map(|api| api.query(order_no, now_ms))
    }

    pub(crate) fn close(&self, channel: &str, order_no: &str, now_ms: i64) -> Option<Exchange<CloseAnswer>> {
        self.registry.calls(channel).map(|api| api.close(order_no, now_ms))
    }

    pub(crate) fn refund(
        &self,
        channel: &str,
        refund: &RefundRequest<'_>,
        now_ms: i64,
    ) -> Option<Exchange<RefundAnswer>> {
        self.registry.calls(channel).map(|api| api.refund(refund, now_ms))
    }

    pub(crate) fn refund_query(
        &self,
        channel: &str,
        order_no: &str,
        refund_no: &str,
        pay_no: Option<&str>,
        now_ms: i64,
    ) -> Option<Exchange<RefundState>> {
        self.registry.calls(channel).map(|api| api.refund_query(order_no, refund_no, pay_no, now_ms))
    }
}

/// The outcome word of a reply, for platforms that carry none in their protocol (logs).
pub fn reply_outcome(reply: &Reply) -> &'static str {
    match reply {
        Reply::Payment(p) => p.outcome_str(),
        Reply::Refund(r) => r.as_str(),
        Reply::Ignored => "ignored",
    }
}

/// An identifier a platform's request named (a serial, an app_id), fit for a
/// log line and an answer: at most 64 characters of `[A-Za-z0-9_.-]`, the
/// rest replaced by `?`, `(none)` when empty.
pub(crate) fn printable(named: &str) -> String {
    if named.is_empty() {
        return "(none)".to_owned();
    }
    named
        .chars()
        .take(64)
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') { c } else { '?' })
        .collect()
}
