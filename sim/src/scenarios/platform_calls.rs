//! The scenarios of the platform calls (docs/platforms.md, issue 13):
//! payonce asks the platforms instead of only listening.
//!
//! Each one plays the simulated WeChat Pay and Alipay merchant APIs
//! ([`crate::platform_api`]) against a payonce of its own, in this process:
//! configured with both platforms' outgoing settings (the scenario's channel
//! is the platform the buyer pays at; the order carries no channel, so
//! payonce asks and closes at both), on a manual clock the scenario moves,
//! with its sweeper and platform-call pool driven a round at a time
//! (`App::close_expired`, `App::run_platform_calls_once`) as payonce's
//! background threads would run them. Every trade is made through payonce
//! (`POST /v1/orders/{order_no}/pay`, the methods varied across orders; the
//! buyer opens what Alipay's page, wap and app answers), at both platforms,
//! as a checkout page offering both would. Notifications still arrive
//! signed over HTTP, and the verdict comes from payonce's read API (the
//! order with its payments and their sources, its audit rows, events,
//! inspections) and from what the platforms show (trade states, refunds,
//! the calls payonce made) with payonce's own `platform_call` rows.
//!
//! The platforms stamp their answers with the real time, and payonce trusts
//! a WeChat Pay answer only within 5 minutes of its own clock: the clock
//! starts at the real time and moves by a minute or two at most.
//!
//! `lost_notification`, `close_race` and `triple_click` also play the same
//! buyers against a payonce without platform settings (payonce before it called the
//! platforms, issue 13: an expired order is closed here, whatever the
//! platform did, and the merchant's own code makes each payment at the
//! platform, payonce's client called directly) and note how those orders
//! ended, next to the judged pass. That pass is not judged.

use super::{api_label, OrderRun, RefundPlan, Scenario, ScenarioRun, Sim, SimOrder};
use crate::alipay_certs::KeyMode;
use crate::client::{Conn, Req, Target};
use crate::judge::{OrderExpect, OrderSeen};
use crate::local::{self, LocalServer};
use crate::platform::{
    random_digits, PaymentNotice, Platform, RefundNotice, SIM_ALIPAY_APP_ID, SIM_RSA_BITS, SIM_WECHATPAY_SERIAL,
    WECHATPAY_APPID,
};
use crate::platform_api::{AlipayApiConfig, Call, Fault, PlatformApi, RefundStatus, Refused, WechatpayApiConfig};
use crate::progress::Progress;
use crate::s;
use crate::standalone::MERCHANT_SERIAL;
use parking_lot::Mutex;
use payonce::app::Config;
use payonce::domain::PlatformCallKind;
use payonce::platform_ops::Platforms;
use payonce::platforms::alipay::AlipayApi;
use payonce::platforms::wechatpay::WechatpayApi;
use payonce::platforms::{
    MerchantKey, Parts, Platform as PlatformParts, PrepayAnswer, PrepayRequest, Registry, PLATFORM_WAITERS_MAX,
};
use payonce::{App, Clock};
use rsa::{RsaPrivateKey, RsaPublicKey};
use serde_json::json;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread;
use std::time::Duration;

/// Platform calls one pool round claims at a time (payonce's own pool takes 8).
const POOL: usize = 16;
/// A platform call that works answers in milliseconds; this bounds one that
/// does not, generously, so a loaded machine never makes a healthy platform
/// look unreachable.
const HEALTHY_TIMEOUT: Duration = Duration::from_secs(5);
/// platform_down: payonce's timeout for the platform that is down. The
/// round of hanging calls costs this much real time (the pool works every
/// order's call at once). Every call to that platform is refused or hangs,
/// and the verdict reads payonce's own attempts, so a call that a loaded
/// machine did not even send in time changes nothing.
const DOWN_TIMEOUT: Duration = Duration::from_millis(100);
/// The orders of these scenarios live a minute; the clock then moves a
/// second past that. The platforms keep the trade's `time_expire` by their
/// own clock, the real one, to the second: the scenario's buyers (who pay in
/// real time, while the clock moves on in jumps) must find their trades
/// payable, and the jumps must keep payonce within the 5 minutes of the real
/// time its signatures and the platforms' need.
const EXPIRES_IN_S: i64 = 60;
const PAST_EXPIRY_MS: i64 = EXPIRES_IN_S * 1000 + 1_000;
/// `--platform-retry-s` of these scenarios: 1 s, repeated.
const RETRY_MS: u64 = 1_000;
/// platform_down's `--close-give-up-s`: 3 s after expires_at.
const GIVE_UP_MS: i64 = 3_000;
/// refund_submitted's `--refund-query-after-s`: 3 s.
const REFUND_QUERY_AFTER_MS: i64 = 3_000;
/// The merchant's `--public-base-url`. Each platform checks every payment's
/// `notify_url` against it; the scenarios still deliver the notifications
/// to the payonce they run themselves, which is what this URL reaches
/// behind the merchant's proxy.
const PUBLIC_BASE_URL: &str = "https://shop.payonce.test";
/// What the buyers' pages send with a payment: the JSAPI payer's openid, the
/// H5 buyer's address (a documentation address: it is only a field), and
/// where Alipay's page payment returns the buyer.
const BUYER_OPENID: &str = "oSimulatedBuyer000000000000";
const BUYER_IP: &str = "198.51.100.7";
const RETURN_URL: &str = "https://shop.payonce.test/paid";
/// Each platform's methods, in the order the orders take them (order `i`
/// pays by `METHODS[i % 4]` at the buyer's platform, by the next one at the
/// other), so every method is played in every scenario of four orders or more.
const WECHATPAY_METHODS: [&str; 4] = ["native", "jsapi", "h5", "app"];
const ALIPAY_METHODS: [&str; 4] = ["precreate", "page", "wap", "app"];

mod unwanted_money;

/// [`RETRY_MS`], to move the clock by.
fn retry_ms() -> i64 {
    i64::try_from(RETRY_MS).unwrap_or(i64::MAX)
}

/// Runs one of these scenarios on `sim`'s channel (wechatpay or alipay).
pub fn run(sim: &Sim, scenario: Scenario) -> Result<ScenarioRun, String> {
    // unwanted_money's buyers pay at both platforms, whose notices it signs.
    let both;
    let sim = if scenario == Scenario::UnwantedMoney {
        both = Sim { keys: Arc::new(sim.keys.with_both_platforms()?), ..sim.for_channel(sim.channel, sim.partner) };
        &both
    } else {
        sim
    };
    let world = World::start(sim)?;
    let (orders, seen, notes) = match scenario {
        Scenario::LostNotification => lost_notification(sim, &world)?,
        Scenario::CloseRace => close_race(sim, &world)?,
        Scenario::PlatformDown => platform_down(sim, &world)?,
        Scenario::RefundSubmitted => refund_submitted(sim, &world)?,
        Scenario::TripleClick => triple_click(sim, &world)?,
        Scenario::PartialRefunds => partial_refunds(sim, &world)?,
        Scenario::UnwantedMoney => unwanted_money::unwanted_money(sim, &world)?,
        other => return Err(format!("{} does not talk to the platforms' APIs", other.name())),
    };
    Ok(ScenarioRun { scenario, channel: sim.channel, orders, seen: Some(seen), skipped: None, notes })
}

type Played = (Vec<OrderRun>, Vec<OrderSeen>, Vec<String>);

// ---- the world: two platforms, a clock, and the payonces that call them ----

/// The merchant's API key payonce signs its requests with (ring: 2048 bits
/// or more), and its public half the platforms verify them with.
pub(crate) struct Merchant {
    pub(crate) pem: String,
    pub(crate) public: RsaPublicKey,
}

/// The merchant's key, PEM and public half (certificate mode's app
/// certificate holds the public half).
pub(crate) fn merchant_key() -> Result<(String, RsaPrivateKey), String> {
    use rsa::pkcs8::DecodePrivateKey;
    let pem = &merchant()?.pem;
    let key = RsaPrivateKey::from_pkcs8_pem(pem).map_err(|e| format!("the merchant key: {e}"))?;
    Ok((pem.clone(), key))
}

/// One per run, made when first needed. Unoptimised builds (the test suite)
/// take seconds per 2048-bit key, so they use the test fixture key, which
/// never leaves this process (payonce and the platforms it calls are both
/// here); release builds make a fresh one.
pub(crate) fn merchant() -> Result<&'static Merchant, String> {
    static MERCHANT: OnceLock<Result<Merchant, String>> = OnceLock::new();
    MERCHANT.get_or_init(make_merchant).as_ref().map_err(Clone::clone)
}

#[cfg(debug_assertions)]
fn make_merchant() -> Result<Merchant, String> {
    use rsa::pkcs8::DecodePrivateKey;
    let pem = include_str!("../../../tests/fixtures/keys/merchant.pem");
    let key = RsaPrivateKey::from_pkcs8_pem(pem).map_err(|e| format!("the merchant key fixture: {e}"))?;
    Ok(Merchant { pem: pem.to_owned(), public: key.to_public_key() })
}

#[cfg(not(debug_assertions))]
fn make_merchant() -> Result<Merchant, String> {
    use rsa::pkcs8::{EncodePrivateKey, LineEnding};
    let key = RsaPrivateKey::new(&mut rsa::rand_core::OsRng, crate::standalone::MERCHANT_KEY_BITS_MIN)
        .map_err(|e| format!("cannot generate the merchant key: {e}"))?;
    let pem = key.to_pkcs8_pem(LineEnding::LF).map_err(|e| format!("cannot encode the merchant key: {e}"))?;
    Ok(Merchant { pem: pem.to_string(), public: key.to_public_key() })
}

/// The platform's answer key: the one its notifications are signed with
/// when the simulator holds it (the channels selected), else one made for
/// this run, once.
fn platform_key(sim: &Sim, platform: Platform) -> Result<RsaPrivateKey, String> {
    static WECHATPAY: OnceLock<Result<RsaPrivateKey, String>> = OnceLock::new();
    static ALIPAY: OnceLock<Result<RsaPrivateKey, String>> = OnceLock::new();
    let held = match platform {
        Platform::Wechatpay => sim.keys.wechatpay.as_ref().map(|k| k.signing_key.as_ref().clone()),
        _ => sim.keys.alipay.as_ref().map(|k| k.signing_key.as_ref().clone()),
    };
    if let Some(key) = held {
        return Ok(key);
    }
    let made = if platform == Platform::Wechatpay { &WECHATPAY } else { &ALIPAY };
    made.get_or_init(|| {
        RsaPrivateKey::new(&mut rsa::rand_core::OsRng, SIM_RSA_BITS)
            .map_err(|e| format!("cannot generate an RSA key: {e}"))
    })
    .clone()
}

/// How a scenario's payonce paces and bounds its platform calls.
#[derive(Clone, Copy)]
struct Pace {
    /// `--platform-timeout-ms` of calls to the scenario's channel.
    timeout: Duration,
    give_up_ms: i64,
    refund_query_after_ms: i64,
}

impl Pace {
    fn healthy() -> Pace {
        Pace { timeout: HEALTHY_TIMEOUT, give_up_ms: 600_000, refund_query_after_ms: 600_000 }
    }
}

/// Both platforms' merchant APIs on loopback and the clock of the payonces
/// that call them.
struct World {
    channel: Platform,
    clock: Clock,
    wechatpay: Arc<PlatformApi>,
    alipay: Arc<PlatformApi>,
    /// Certificate mode (`--key-mode certificate`): Alipay's certificates,
    /// which payonce is configured with.
    alipay_certs: Option<Arc<crate::alipay_certs::CertSetup>>,
    /// `--key-mode certificate`: WeChat Pay's keys, whose certificate payonce downloads.
    certificates: Option<crate::platform::WechatpayKeys>,
}

impl World {
    fn start(sim: &Sim) -> Result<World, String> {
        let merchant = merchant()?;
        let serial = sim.keys.wechatpay.as_ref().map_or(SIM_WECHATPAY_SERIAL, |k| k.serial.as_str());
        let wechatpay = match sim.keys.wechatpay.as_ref().filter(|k| k.certificate) {
            // --key-mode certificate: it signs with a platform certificate payonce downloads.
            Some(wx) => local::certificate_platform(wx, |config| {
                config.expected_notify_url = Some(notify_url(Platform::Wechatpay));
            })?,
            None => PlatformApi::start_wechatpay(WechatpayApiConfig {
                platform_key: Some(platform_key(sim, Platform::Wechatpay)?),
                platform_serial: serial.to_owned(),
                expected_notify_url: Some(notify_url(Platform::Wechatpay)),
                ..WechatpayApiConfig::new(MERCHANT_SERIAL, merchant.public.clone())
            })?,
        };
        let app_id = sim.keys.alipay.as_ref().map_or(SIM_ALIPAY_APP_ID, |k| k.app_id.as_str());
        let alipay_key = platform_key(sim, Platform::Alipay)?;
        let alipay_certs = match sim.keys.key_mode {
            KeyMode::PublicKey => None,
            KeyMode::Certificate => {
                let (pem, key) = merchant_key()?;
                Some(crate::alipay_certs::setup(&alipay_key.to_public_key(), &pem, &key)?)
            }
        };
        let alipay = PlatformApi::start_alipay(AlipayApiConfig {
            alipay_key: Some(alipay_key),
            app_id: app_id.to_owned(),
            expected_notify_url: Some(notify_url(Platform::Alipay)),
            certificates: alipay_certs.as_ref().map(|setup| setup.certs.sns.clone()),
            ..AlipayApiConfig::new(merchant.public.clone())
        })?;
        Ok(World {
            channel: sim.channel,
            clock: Clock::manual(Clock::System.now_ms()),
            wechatpay: Arc::new(wechatpay),
            alipay: Arc::new(alipay),
            alipay_certs,
            certificates: sim.keys.wechatpay.clone().filter(|k| k.certificate),
        })
    }

    /// The platform the buyers pay at.
    fn api(&self) -> &Arc<PlatformApi> {
        match self.channel {
            Platform::Alipay => &self.alipay,
            _ => &self.wechatpay,
        }
    }

    /// The other one: configured in payonce all the same.
    fn partner(&self) -> &Arc<PlatformApi> {
        match self.channel {
            Platform::Alipay => &self.wechatpay,
            _ => &self.alipay,
        }
    }

    /// payonce's outgoing settings for both platforms, as `payonce serve`
    /// builds them from its flags.
    /// The calls are added to `registry`, the notices' settings.
    fn platforms(&self, pace: &Pace, mut registry: Registry) -> Result<Platforms, String> {
        let merchant = merchant()?;
        let timeout = |platform: Platform| if platform == self.channel { pace.timeout } else { HEALTHY_TIMEOUT };
        let key = || MerchantKey::from_pem(&merchant.pem);
        let wx = &self.wechatpay;
        let wx_api: &PlatformApi = wx;
        let ali = &self.alipay;
        let mut wechatpay = WechatpayApi::new(
            wx.merchant_id().to_owned(),
            MERCHANT_SERIAL.to_owned(),
            key()?,
            &wx.endpoint(),
            vec![(wx.platform_serial().unwrap_or_default().to_owned(), wx.platform_public_key().clone())],
            timeout(Platform::Wechatpay),
        );
        // As `payonce serve --wechatpay-appid --public-base-url` sets them.
        wechatpay.appids = vec![WECHATPAY_APPID.to_owned()];
        wechatpay.refund_notify_url = Some(format!("{}/refund", notify_url(Platform::Wechatpay)));
        match &self.certificates {
            // As `serve --wechatpay-platform-certs auto` builds its calls: no key configured.
            Some(wx) => {
                let timeout = timeout(Platform::Wechatpay);
                let downloading =
                    local::downloading_wechatpay(wx, wx_api, Parts::CallsOnly, timeout, Some(PUBLIC_BASE_URL))?;
                registry.add(PlatformParts { notices: None, keys: None, ..downloading });
            }
            None => registry.add(PlatformParts::calls(wechatpay)),
        }
        match &self.alipay_certs {
            // Certificate mode: as `payonce serve` builds it from the certificate flags.
            Some(setup) => registry
                .add(setup.payonce_alipay(ali.merchant_id(), Some((&ali.endpoint(), timeout(Platform::Alipay))))?),
            None => registry.add(PlatformParts::calls(AlipayApi::new(
                ali.merchant_id().to_owned(),
                key()?,
                &ali.endpoint(),
                ali.platform_public_key().clone(),
                timeout(Platform::Alipay),
            ))),
        }
        Ok(Platforms {
            registry,
            timeout_ms: u64::try_from(HEALTHY_TIMEOUT.max(pace.timeout).as_millis()).unwrap_or(u64::MAX),
            retry_schedule_ms: vec![RETRY_MS],
            close_give_up_ms: pace.give_up_ms,
            refund_query_after_ms: pace.refund_query_after_ms,
            public_base_url: Some(PUBLIC_BASE_URL.to_owned()),
            ..Platforms::default()
        })
    }

    /// payonce on `db` with both platforms' outgoing settings.
    fn payonce(&self, sim: &Sim, db: &str, pace: &Pace) -> Result<LocalServer, String> {
        LocalServer::open(db, self.clock.clone(), self.config(sim, pace)?)
    }

    fn config(&self, sim: &Sim, pace: &Pace) -> Result<Config, String> {
        let base = local::config(&sim.keys)?;
        Ok(Config { platforms: self.platforms(pace, base.platforms.registry.clone())?, ..base })
    }

    /// payonce before issue 13: the same notification settings, no outgoing
    /// calls, and so no payments made through it: see [`World::merchant_prepays`].
    fn baseline(&self, sim: &Sim) -> Result<LocalServer, String> {
        LocalServer::open(":memory:", self.clock.clone(), local::config(&sim.keys)?)
    }

    /// The merchant's own code calling the platforms (beside a baseline
    /// payonce): payonce's platform clients, with the same settings.
    fn merchant_code(&self) -> Result<Registry, String> {
        Ok(self.platforms(&Pace::healthy(), Registry::default())?.registry)
    }

    /// Each order's payment made through payonce (`POST /v1/orders/{no}/pay`)
    /// at both platforms, as a checkout page offering both would: the buyer
    /// may open either cashier, and payonce asks and closes at both. Order
    /// `i` pays by method `i % 4` at the buyer's platform and by the next at
    /// the other; a signed Alipay request is opened by the buyer, which is
    /// what makes its trade. The answers' labels, per order.
    fn create_payments(&self, here: &Sim, orders: &[SimOrder]) -> Result<Vec<Vec<String>>, String> {
        let (channel, partner) = (self.channel, self.partner().platform());
        // payonce lets this many requests wait on the platforms at once and
        // answers the next 503: a checkout page's buyers come one at a time.
        here.par_orders_on(orders.len(), PLATFORM_WAITERS_MAX, |conn, i| {
            let mut labels = Vec::new();
            for (platform, k) in [(channel, i), (partner, i + 1)] {
                let method = method_of(platform, k);
                let reply = here.api(conn, Req::post_json(pay_path(&orders[i]), &pay_body(platform, method)))?;
                labels.push(self.opened(platform, method, &reply));
            }
            Ok(labels)
        })
    }

    /// The label of a pay answer, once the buyer opened what a signed-only
    /// method answered (nothing exists at the platform before that).
    fn opened(&self, platform: Platform, method: &str, reply: &crate::client::Reply) -> String {
        let label = pay_label(platform, method, reply);
        if reply.status != 200 {
            return label;
        }
        let payment = crate::client::ReplyExt::json(reply)["payment"].clone();
        let signed = payment["url"].as_str().or_else(|| payment["order_string"].as_str());
        match (signed, platform) {
            (Some(signed), Platform::Alipay) => match self.alipay.buyer_opens(signed) {
                Ok(_) => label,
                Err(e) => format!("{label}, which the buyer could not open: {e}"),
            },
            _ => label,
        }
    }
}

impl World {
    /// Before payonce made payments, the merchant's own code made them: each
    /// click calls the platform (payonce's client, called directly), as
    /// `clicks` concurrent calls with the same parameters; a signed request
    /// is opened by the buyer each time. What each click came to.
    fn merchant_prepays(
        &self,
        code: &Registry,
        baseline: &App,
        order: &SimOrder,
        method: &str,
        clicks: usize,
    ) -> Result<Vec<String>, String> {
        let platform = self.channel;
        let client = code.calls(platform.name()).ok_or_else(|| format!("no {} client", platform.name()))?;
        let detail = baseline.orders().order(&order.no).map_err(|e| format!("reading order {}: {e}", order.no))?;
        let expires_at_ms = payonce::clock::parse_rfc3339_ms(&detail.order.expires_at)
            .ok_or_else(|| format!("order {}: expires_at {:?}", order.no, detail.order.expires_at))?;
        let notify = notify_url(platform);
        let request = PrepayRequest {
            order_no: &order.no,
            amount: order.amount,
            currency: &detail.order.currency,
            description: &order.no,
            expires_at_ms,
            notify_url: &notify,
            method,
            appid: (platform == Platform::Wechatpay).then_some(WECHATPAY_APPID),
            openid: (method == "jsapi").then_some(BUYER_OPENID),
            client_ip: (method == "h5").then_some(BUYER_IP),
            return_url: matches!(method, "page" | "wap").then_some(RETURN_URL),
        };
        let click = || -> String {
            match client.prepay(&request, self.clock.now_ms()).meaning {
                PrepayAnswer::Created(payment) => {
                    let signed = payment.fields.get("url").or_else(|| payment.fields.get("order_string"));
                    match signed.and_then(|s| s.as_str()) {
                        Some(signed) => match self.alipay.buyer_opens(signed) {
                            Ok(_) => s("created"),
                            Err(e) => format!("the buyer could not open it: {e}"),
                        },
                        None => s("created"),
                    }
                }
                other => format!("{other:?}"),
            }
        };
        Ok(thread::scope(|scope| {
            let clicks: Vec<_> = (0..clicks).map(|_| scope.spawn(click)).collect();
            clicks.into_iter().map(|c| c.join().unwrap_or_else(|_| s("the click panicked"))).collect()
        }))
    }

    /// [`World::merchant_prepays`] of one click for each order, by its method.
    fn merchant_prepays_all(&self, baseline: &App, orders: &[SimOrder]) -> Result<(), String> {
        let code = self.merchant_code()?;
        for (i, order) in orders.iter().enumerate() {
            let made = self.merchant_prepays(&code, baseline, order, method_of(self.channel, i), 1)?;
            if made != [s("created")] {
                return Err(format!("the merchant could not make {}'s payment: {made:?}", order.no));
            }
        }
        Ok(())
    }
}

/// `{PUBLIC_BASE_URL}/v1/callbacks/{platform}`: where payonce's payments at
/// `platform` are notified.
fn notify_url(platform: Platform) -> String {
    format!("{PUBLIC_BASE_URL}/v1/callbacks/{}", platform.name())
}

/// Order `i`'s method at `platform` (see [`WECHATPAY_METHODS`]).
fn method_of(platform: Platform, i: usize) -> &'static str {
    match platform {
        Platform::Alipay => ALIPAY_METHODS[i % ALIPAY_METHODS.len()],
        _ => WECHATPAY_METHODS[i % WECHATPAY_METHODS.len()],
    }
}

fn pay_path(order: &SimOrder) -> String {
    format!("/v1/orders/{}/pay", order.no)
}

/// The body of a pay request by `method`, with what that method needs.
fn pay_body(platform: Platform, method: &str) -> serde_json::Value {
    let mut body = json!({"channel": platform.name(), "method": method});
    match (platform, method) {
        (Platform::Wechatpay, "jsapi") => body["openid"] = json!(BUYER_OPENID),
        (Platform::Wechatpay, "h5") => body["client_ip"] = json!(BUYER_IP),
        (Platform::Alipay, "page" | "wap") => body["return_url"] = json!(RETURN_URL),
        _ => {}
    }
    body
}

/// `api:pay 200 wechatpay native`; a refusal as `api:pay 409 order_expired`.
fn pay_label(platform: Platform, method: &str, reply: &crate::client::Reply) -> String {
    use crate::client::ReplyExt;
    match reply.status {
        200 => format!("api:pay 200 {} {method}", platform.name()),
        status => format!("api:pay {status} {}", reply.error_code()),
    }
}

/// What [`World::create_payments`] must answer for order `i`.
fn payments_made(platform: Platform, partner: Platform, i: usize) -> Vec<String> {
    vec![
        format!("api:pay 200 {} {}", platform.name(), method_of(platform, i)),
        format!("api:pay 200 {} {}", partner.name(), method_of(partner, i + 1)),
    ]
}

/// `sim` against another payonce (the scenario's own).
fn sim_on(sim: &Sim, server: &LocalServer) -> Sim {
    Sim {
        target: Arc::new(Target::local(server.addr)),
        keys: Arc::clone(&sim.keys),
        channel: sim.channel,
        partner: sim.partner,
        run_id: sim.run_id.clone(),
        orders: sim.orders,
        concurrency: sim.concurrency,
        time_factor: sim.time_factor,
        full_schedules: sim.full_schedules,
        replay_timeout_ms: sim.replay_timeout_ms,
        verbose: sim.verbose,
        progress: Progress::new(false),
    }
}

/// `{run_id}_{scenario}{channel}{pass}_{i}`: `_`, not `-`, which Alipay's
/// out_trade_no cannot carry (an order_no a platform cannot carry is never
/// asked about there).
fn sim_orders(sim: &Sim, scenario: Scenario, pass: &str) -> Vec<SimOrder> {
    (0..sim.orders)
        .map(|i| {
            let mut order = sim.order(scenario, i);
            order.no = format!("{}_{}{}{pass}_{i}", sim.run_id, scenario.tag(), sim.channel.tag());
            order.user = format!("{}_u", order.no);
            order
        })
        .collect()
}

fn create_all(here: &Sim, orders: &[SimOrder], expires_in_s: i64) -> Result<Vec<String>, String> {
    here.par_orders(orders.len(), |conn, i| {
        Ok(api_label("create", &here.create_expiring(conn, &orders[i], expires_in_s)?))
    })
}

/// One round of payonce's platform-call pool at the clock's time: every
/// call due now, `POOL` at a time. Returns how many it worked.
fn round(app: &App) -> Result<usize, String> {
    let mut worked = 0;
    for _ in 0..10_000 {
        match app
            .platform_calls()
            .run_platform_calls_once(POOL)
            .map_err(|e| format!("the platform-call pool: {}", e.message))?
        {
            0 => return Ok(worked),
            n => worked += n,
        }
    }
    Err("the platform-call pool never ran out of due calls".into())
}

/// payonce's sweeper, once: with platforms it queues the closes, without it closes.
fn sweep(app: &App) -> Result<usize, String> {
    app.orders().close_expired(500).map_err(|e| format!("the sweeper: {}", e.message))
}

fn get(here: &Sim, conn: &mut Conn, order: &SimOrder) -> Result<String, String> {
    Ok(api_label("get", &here.api(conn, Req::get(format!("/v1/orders/{}", order.no)))?))
}

/// The platform's notification of a payment it took.
fn notice(order: &SimOrder, pay_no: &str, attempt: usize) -> PaymentNotice {
    PaymentNotice {
        pay_no: pay_no.to_owned(),
        order_no: order.no.clone(),
        amount: order.amount,
        success: true,
        attempt,
    }
}

/// `wechatpay trade SUCCESS`: the trade's state in the platform's words.
fn trade(api: &PlatformApi, order_no: &str) -> String {
    format!("{} trade {}", api.platform().name(), api.trade_state(order_no).unwrap_or("missing"))
}

/// What the state words are on `platform`.
fn paid_word(platform: Platform) -> &'static str {
    if platform == Platform::Alipay {
        "TRADE_SUCCESS"
    } else {
        "SUCCESS"
    }
}

fn closed_word(platform: Platform) -> &'static str {
    if platform == Platform::Alipay {
        "TRADE_CLOSED"
    } else {
        "CLOSED"
    }
}

fn open_word(platform: Platform) -> &'static str {
    if platform == Platform::Alipay {
        "WAIT_BUYER_PAY"
    } else {
        "NOTPAY"
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// A payment's creation (WeChat Pay's four prepay paths, Alipay precreate).
    Prepay,
    Query,
    Close,
    Refund,
    RefundQuery,
}

/// Which merchant call `call` was, and about which order_no (refund_no for refunds).
fn classify(platform: Platform, call: &Call) -> Option<(Kind, String)> {
    let field = |name: &str| call.body[name].as_str().map(str::to_owned);
    match platform {
        Platform::Alipay => match call.api.as_str() {
            "alipay.trade.precreate" => Some((Kind::Prepay, field("out_trade_no")?)),
            "alipay.trade.query" => Some((Kind::Query, field("out_trade_no")?)),
            "alipay.trade.close" => Some((Kind::Close, field("out_trade_no")?)),
            "alipay.trade.refund" => Some((Kind::Refund, field("out_request_no")?)),
            "alipay.trade.fastpay.refund.query" => Some((Kind::RefundQuery, field("out_request_no")?)),
            _ => None,
        },
        _ => {
            let path = call.api.split('?').next().unwrap_or_default();
            const PREPAY: [&str; 4] = ["native", "jsapi", "h5", "app"];
            if path.strip_prefix("/v3/pay/transactions/").is_some_and(|method| PREPAY.contains(&method)) {
                return Some((Kind::Prepay, field("out_trade_no")?));
            }
            if let Some(rest) = path.strip_prefix("/v3/pay/transactions/out-trade-no/") {
                return Some(match rest.strip_suffix("/close") {
                    Some(no) => (Kind::Close, no.to_owned()),
                    None => (Kind::Query, rest.to_owned()),
                });
            }
            if path == "/v3/refund/domestic/refunds" {
                return Some((Kind::Refund, field("out_refund_no")?));
            }
            path.strip_prefix("/v3/refund/domestic/refunds/").map(|no| (Kind::RefundQuery, no.to_owned()))
        }
    }
}

/// How many merchant calls other than a payment's creation the platform
/// received (the requests a buyer opened are no calls).
fn merchant_calls(api: &PlatformApi) -> usize {
    // Alipay's gateway records what the buyer opened as GET (a URL) or APP (an order string).
    let opened_by_buyer = |c: &Call| api.platform() == Platform::Alipay && c.http_method != "POST";
    let creation = |c: &Call| matches!(classify(api.platform(), c), Some((Kind::Prepay, _)));
    // WeChat Pay's certificate download (--key-mode certificate) is about no trade.
    let certificates = |c: &Call| c.api == "/v3/certificates";
    api.calls().iter().filter(|c| !opened_by_buyer(c) && !creation(c) && !certificates(c)).count()
}

/// How many `kind` calls about `no` the platform received.
fn calls_about(api: &PlatformApi, kind: Kind, no: &str) -> usize {
    api.calls().iter().filter(|c| classify(api.platform(), c).is_some_and(|(k, n)| k == kind && n == no)).count()
}

/// payonce's close row of `order_no` at `channel`, as the order's
/// `platform_calls` show it: its attempts and status.
fn close_row(app: &App, channel: Platform, order_no: &str) -> Result<String, String> {
    let detail = app.orders().order(order_no).map_err(|e| format!("reading order {order_no}: {e}"))?;
    let closes: Vec<_> = detail
        .platform_calls
        .iter()
        .filter(|c| c.kind == PlatformCallKind::Close && c.channel == channel.name())
        .collect();
    Ok(match closes.as_slice() {
        [close] => format!("attempts {}, {}", close.attempts, close.status.as_str()),
        [] => s("no close row"),
        more => format!("{} close rows", more.len()),
    })
}

/// Reads the orders back from `here` (the scenario's own payonce) as the
/// other scenarios are read, with each order's platform facts.
fn observe(
    here: &Sim,
    scenario: Scenario,
    orders: &[OrderRun],
    facts: Vec<Vec<String>>,
) -> Result<Vec<OrderSeen>, String> {
    let mut conn = Conn::new(&here.target);
    let events = here.events_since(&mut conn, 0)?;
    let findings = here.findings(&mut conn)?;
    let run = ScenarioRun {
        scenario,
        channel: here.channel,
        orders: orders.iter().map(clone_run).collect(),
        seen: None,
        skipped: None,
        notes: Vec::new(),
    };
    let mut seen = here.observe(&run, &events, &findings)?;
    for (order, facts) in seen.iter_mut().zip(facts) {
        order.platform = facts;
    }
    Ok(seen)
}

fn clone_run(run: &OrderRun) -> OrderRun {
    OrderRun {
        order: run.order.clone(),
        expect: run.expect.clone(),
        answers: run.answers.clone(),
        lost: run.lost,
        deliveries: run.deliveries,
    }
}

/// How the orders of one pass ended: `10 CLOSED, 5 paid_after_close`.
fn outcome_counts(seen: &[OrderSeen]) -> (BTreeCounts, usize) {
    let mut statuses = BTreeCounts::new();
    let mut paid_after_close = 0;
    for order in seen {
        *statuses.entry(order.status.clone().unwrap_or_else(|| s("missing"))).or_default() += 1;
        paid_after_close += order.payments.iter().filter(|p| p.outcome == "paid_after_close").count();
    }
    (statuses, paid_after_close)
}

type BTreeCounts = std::collections::BTreeMap<String, usize>;

fn counts_text(counts: &BTreeCounts) -> String {
    counts.iter().map(|(status, n)| format!("{n} {status}")).collect::<Vec<_>>().join(", ")
}

/// The orders of a baseline pass, read back: status and payment outcomes.
fn read_back(here: &Sim, orders: &[SimOrder]) -> Result<Vec<OrderSeen>, String> {
    here.par_orders(orders.len(), |conn, i| {
        let reply = here.api(conn, Req::get(format!("/v1/orders/{}", orders[i].no)))?;
        let mut seen = OrderSeen { order_no: orders[i].no.clone(), ..OrderSeen::default() };
        if reply.status == 200 {
            super::read_order_detail(&crate::client::ReplyExt::json(&reply), &mut seen);
        }
        Ok(seen)
    })
}

// ---- lost_notification ----

/// The buyer pays at the platform before the order expires, and the
/// platform's notification is lost. At expiry the sweeper queues the close;
/// the pool asks first, hears "paid", and applies it (source `query`)
/// instead of closing. Odd orders' notifications do come in the end, late:
/// a duplicate by then.
fn lost_notification(sim: &Sim, world: &World) -> Result<Played, String> {
    let payonce = world.payonce(sim, ":memory:", &Pace::healthy())?;
    let here = sim_on(sim, &payonce);
    let orders = sim_orders(sim, Scenario::LostNotification, "");
    let created = create_all(&here, &orders, EXPIRES_IN_S)?;
    let made = world.create_payments(&here, &orders)?;
    let api = world.api();
    let pay_nos = pay_all(api, &orders)?;
    world.clock.advance_ms(PAST_EXPIRY_MS);
    sweep(&payonce.app)?;
    round(&payonce.app)?;
    let late = here.par_orders(orders.len(), |conn, i| match i % 2 {
        1 => Ok(Some(here.deliver_payment(conn, &notice(&orders[i], &pay_nos[i], 1))?)),
        _ => Ok(None),
    })?;
    let (platform, partner) = (sim.channel, world.partner().platform());
    let mut runs = Vec::new();
    let mut facts = Vec::new();
    for (i, ((order, created), late)) in orders.iter().zip(created).zip(late).enumerate() {
        let mut answers = vec![created];
        answers.extend(made[i].iter().cloned());
        let mut expected = vec![Sim::created()];
        expected.extend(payments_made(platform, partner, i));
        if let Some(late) = &late {
            answers.push(late.label.clone());
            expected.push(here.said("duplicate"));
        }
        facts.push(vec![
            trade(api, &order.no),
            format!("{} close calls at {}", calls_about(api, Kind::Close, &order.no), platform.name()),
        ]);
        runs.push(OrderRun {
            order: order.clone(),
            expect: OrderExpect {
                sources: Some(vec![s("query")]),
                audit: Some(Vec::new()),
                platform: vec![
                    format!("{} trade {}", platform.name(), paid_word(platform)),
                    format!("0 close calls at {}", platform.name()),
                ],
                ..Sim::paid_expect(expected)
            },
            answers,
            lost: 0,
            deliveries: late.map_or(0, |d| d.sends),
        });
    }
    let seen = observe(&here, Scenario::LostNotification, &runs, facts)?;
    drop(payonce);

    // Before the platform calls: the same buyers, a payonce that closes expired orders itself.
    let baseline = world.baseline(sim)?;
    let there = sim_on(sim, &baseline);
    let before = sim_orders(sim, Scenario::LostNotification, "b");
    create_all(&there, &before, EXPIRES_IN_S)?;
    world.merchant_prepays_all(&baseline.app, &before)?;
    let before_pay_nos = pay_all(api, &before)?;
    world.clock.advance_ms(PAST_EXPIRY_MS);
    sweep(&baseline.app)?;
    there.par_orders(before.len(), |conn, i| match i % 2 {
        1 => there.deliver_payment(conn, &notice(&before[i], &before_pay_nos[i], 1)).map(|_| ()),
        _ => Ok(()),
    })?;
    let before_seen = read_back(&there, &before)?;
    let (before_statuses, before_pac) = outcome_counts(&before_seen);
    let unknown = before_seen.iter().filter(|o| o.payments.is_empty() && o.status.as_deref() == Some("CLOSED")).count();
    let (after_statuses, after_pac) = outcome_counts(&seen);
    let by_query =
        seen.iter().flat_map(|o| &o.payments).filter(|p| p.outcome == "applied" && p.source == "query").count();
    let note = format!(
        "lost_notification ({}): {} buyers paid, notification lost (half of them notified late). Before: {}, \
         {before_pac} paid_after_close, {unknown} paid with payonce never knowing. After: {}, {by_query} applied \
         with source query, {after_pac} paid_after_close",
        platform.name(),
        orders.len(),
        counts_text(&before_statuses),
        counts_text(&after_statuses),
    );
    Ok((runs, seen, vec![note]))
}

/// Every buyer pays at `api`: their pay_nos.
fn pay_all(api: &PlatformApi, orders: &[SimOrder]) -> Result<Vec<String>, String> {
    orders
        .iter()
        .map(|o| {
            api.buyer_pays(&o.no)
                .map_err(|e| format!("{}: the buyer could not pay {}: {e:?}", api.platform().name(), o.no))
        })
        .collect()
}

// ---- close_race ----

/// When a close_race buyer pays, relative to payonce's close.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Moment {
    /// Once the platform answered payonce's query "not paid", before its
    /// close arrives: the platform refuses the close (paid), payonce asks
    /// again and applies the payment.
    AfterQuery,
    /// The same, and the platform's notification reaches payonce before its
    /// close does: applied by the notification; the close still refused.
    AfterQueryNotified,
    /// Once the platform closed the trade: the platform refuses the payment.
    AfterClose,
    /// From another thread, at a random moment of the pool's round (once
    /// the platform has seen a random number of payonce's calls, of any
    /// order): before payonce asks, between its query and its close, or
    /// after the close, as the platform's one lock over its book decides.
    AtRandom,
}

impl Moment {
    fn of(i: usize) -> Moment {
        [Moment::AfterQuery, Moment::AfterQueryNotified, Moment::AfterClose, Moment::AtRandom][i % 4]
    }
}

/// One close_race buyer: when they pay, what the platform said, and the
/// notification's answer when it came during the close.
#[derive(Clone)]
struct Buyer {
    moment: Moment,
    paid: Option<Result<String, Refused>>,
    notified: Option<String>,
}

/// Tells the platform's buyers to pay when payonce's calls reach the moment
/// each one waits for (the platform sees each call after it made its answer
/// and before it sends it).
fn watch_calls(
    world: &World,
    here: &Sim,
    orders: &[SimOrder],
    buyers: &Arc<Mutex<HashMap<String, Buyer>>>,
    seen_calls: &Arc<AtomicUsize>,
) {
    let api = Arc::downgrade(world.api());
    let platform = world.channel;
    let (buyers, target, keys) = (Arc::clone(buyers), Arc::clone(&here.target), Arc::clone(&here.keys));
    let seen_calls = Arc::clone(seen_calls);
    let amounts: HashMap<String, i64> = orders.iter().map(|o| (o.no.clone(), o.amount)).collect();
    world.api().on_call(move |call: &Call| {
        seen_calls.fetch_add(1, Ordering::SeqCst);
        let Some((kind, order_no)) = classify(platform, call) else { return };
        let moment = {
            let book = buyers.lock();
            match book.get(&order_no) {
                Some(buyer) if buyer.paid.is_none() => buyer.moment,
                _ => return,
            }
        };
        let due = matches!(
            (moment, kind),
            (Moment::AfterQuery | Moment::AfterQueryNotified, Kind::Query) | (Moment::AfterClose, Kind::Close)
        );
        let Some(api) = api.upgrade().filter(|_| due) else { return };
        let paid = api.buyer_pays(&order_no);
        let notify = match (&paid, moment) {
            (Ok(pay_no), Moment::AfterQueryNotified) => Some(pay_no.clone()),
            _ => None,
        };
        if let Some(buyer) = buyers.lock().get_mut(&order_no) {
            buyer.paid = Some(paid);
        }
        if let Some(pay_no) = notify {
            // payonce holds no transaction across its call: the notification is decided meanwhile.
            let amount = amounts.get(&order_no).copied().unwrap_or(0);
            let notice = PaymentNotice { pay_no, order_no: order_no.clone(), amount, success: true, attempt: 0 };
            let answered = platform
                .sign_payment(&keys, &notice, crate::now_s())
                .map(Req::from)
                .and_then(|req| Conn::new(&target).request(&req))
                .and_then(|reply| platform.answer(&reply));
            let label = answered.unwrap_or_else(|e| format!("notification failed: {e}"));
            if let Some(buyer) = buyers.lock().get_mut(&order_no) {
                buyer.notified = Some(label);
            }
        }
    });
}

/// The buyer pays while payonce closes the expired order: between its
/// query and its close, between them with the notification arriving too,
/// after the platform's close (refused there), or at any moment. Exactly
/// one of: the payment applied (PAID), or the order closed at every
/// platform with the payment refused; never both, never paid_after_close.
fn close_race(sim: &Sim, world: &World) -> Result<Played, String> {
    let payonce = world.payonce(sim, ":memory:", &Pace::healthy())?;
    let here = sim_on(sim, &payonce);
    let orders = sim_orders(sim, Scenario::CloseRace, "");
    let created = create_all(&here, &orders, EXPIRES_IN_S)?;
    // Before the watch below begins to count payonce's calls.
    let made = world.create_payments(&here, &orders)?;
    let buyers: Arc<Mutex<HashMap<String, Buyer>>> = Arc::new(Mutex::new(
        orders
            .iter()
            .enumerate()
            .map(|(i, o)| (o.no.clone(), Buyer { moment: Moment::of(i), paid: None, notified: None }))
            .collect(),
    ));
    let seen_calls = Arc::new(AtomicUsize::new(0));
    watch_calls(world, &here, &orders, &buyers, &seen_calls);
    let api = world.api();
    world.clock.advance_ms(PAST_EXPIRY_MS);
    // payonce makes about two calls per order at the buyers' platform (a
    // query and a close): each "any moment" buyer pays after a random number of them.
    let moments: Vec<usize> = (0..orders.len())
        .map(|_| random_digits(4).ok().and_then(|d| d.parse::<usize>().ok()).unwrap_or(0) % (2 * orders.len() + 1))
        .collect();
    let round_over = AtomicBool::new(false);
    let worked: Result<usize, String> = thread::scope(|scope| {
        for (i, order) in orders.iter().enumerate().filter(|(i, _)| Moment::of(*i) == Moment::AtRandom) {
            let (buyers, seen_calls, round_over, after) = (&buyers, &seen_calls, &round_over, moments[i]);
            scope.spawn(move || {
                while seen_calls.load(Ordering::SeqCst) < after && !round_over.load(Ordering::SeqCst) {
                    thread::sleep(Duration::from_millis(1));
                }
                let paid = api.buyer_pays(&order.no);
                if let Some(buyer) = buyers.lock().get_mut(&order.no) {
                    buyer.paid = Some(paid);
                }
            });
        }
        let worked = sweep(&payonce.app).and_then(|_| round(&payonce.app));
        round_over.store(true, Ordering::SeqCst);
        worked
    });
    worked?;
    // A payment the platform took is notified (late, unless it came during the close).
    let book: HashMap<String, Buyer> = buyers.lock().clone();
    let of = |order: &SimOrder| book.get(&order.no).map_or((None, None), |b| (b.paid.clone(), b.notified.clone()));
    let late = here.par_orders(orders.len(), |conn, i| match of(&orders[i]) {
        (Some(Ok(pay_no)), None) => Ok(Some(here.deliver_payment(conn, &notice(&orders[i], &pay_no, 1))?)),
        _ => Ok(None),
    })?;
    let (platform, partner) = (sim.channel, world.partner().platform());
    let mut runs = Vec::new();
    let mut facts = Vec::new();
    for (i, ((order, created), late)) in orders.iter().zip(created).zip(late).enumerate() {
        let moment = Moment::of(i);
        let (paid, notified) = of(order);
        let buyer = match &paid {
            None => s("the buyer never paid"),
            Some(Ok(_)) => s("the platform took the payment"),
            Some(Err(refused)) => format!("the platform refused the payment: {refused:?}"),
        };
        let mut answers = vec![created];
        answers.extend(made[i].iter().cloned());
        answers.extend(notified.clone());
        let mut expected = vec![Sim::created()];
        expected.extend(payments_made(platform, partner, i));
        answers.extend(late.as_ref().map(|d| d.label.clone()));
        let mut order_facts = vec![buyer, trade(api, &order.no)];
        // Judged by when the buyer paid; at any moment, by what the platform said.
        let took = match moment {
            Moment::AfterQuery | Moment::AfterQueryNotified => true,
            Moment::AfterClose => false,
            Moment::AtRandom => matches!(paid, Some(Ok(_))),
        };
        let expect = if took {
            let (answer, source) = match moment {
                Moment::AfterQueryNotified => (here.said("applied"), "callback"),
                _ => (here.said("duplicate"), "query"),
            };
            OrderExpect {
                sources: Some(vec![s(source)]),
                audit: Some(Vec::new()),
                platform: vec![
                    s("the platform took the payment"),
                    format!("{} trade {}", platform.name(), paid_word(platform)),
                ],
                ..Sim::paid_expect(expected.into_iter().chain([answer]).collect())
            }
        } else {
            order_facts.push(trade(world.partner(), &order.no));
            OrderExpect {
                status: s("CLOSED"),
                answers: expected,
                events: vec![(s("order.closed"), 1)],
                sources: Some(Vec::new()),
                audit: Some(vec![s("platform_closed")]),
                platform: vec![
                    format!("the platform refused the payment: {:?}", Refused::Closed),
                    format!("{} trade {}", platform.name(), closed_word(platform)),
                    format!("{} trade {}", partner.name(), closed_word(partner)),
                ],
                ..OrderExpect::default()
            }
        };
        facts.push(order_facts);
        runs.push(OrderRun {
            order: order.clone(),
            expect,
            answers,
            lost: 0,
            deliveries: usize::from(notified.is_some()) + late.map_or(0, |d| d.sends),
        });
    }
    let seen = observe(&here, Scenario::CloseRace, &runs, facts)?;
    drop(payonce);

    // Before the platform calls: the order closes here at expiry; the platform, never
    // told, takes the buyer's payment, and its notification comes after the close.
    let baseline = world.baseline(sim)?;
    let there = sim_on(sim, &baseline);
    let before = sim_orders(sim, Scenario::CloseRace, "b");
    create_all(&there, &before, EXPIRES_IN_S)?;
    world.merchant_prepays_all(&baseline.app, &before)?;
    world.clock.advance_ms(PAST_EXPIRY_MS);
    sweep(&baseline.app)?;
    let before_pay_nos = pay_all(api, &before)?;
    there.par_orders(before.len(), |conn, i| {
        there.deliver_payment(conn, &notice(&before[i], &before_pay_nos[i], 0)).map(|_| ())
    })?;
    let before_seen = read_back(&there, &before)?;
    let (before_statuses, before_pac) = outcome_counts(&before_seen);
    let (after_statuses, after_pac) = outcome_counts(&seen);
    let refused = book.values().filter(|b| matches!(b.paid, Some(Err(_)))).count();
    // When the "any moment" buyers' payments landed, as the platform saw it.
    let (mut first, mut between, mut after) = (0, 0, 0);
    for (_, order) in orders.iter().enumerate().filter(|(i, _)| Moment::of(*i) == Moment::AtRandom) {
        match of(order).0 {
            Some(Ok(_)) if calls_about(api, Kind::Close, &order.no) == 0 => first += 1,
            Some(Ok(_)) => between += 1,
            _ => after += 1,
        }
    }
    let note = format!(
        "close_race ({}): {} buyers paying while payonce closes. Before: {}, {before_pac} paid_after_close. \
         After: {}, {refused} payments refused by the platform after its close, {after_pac} paid_after_close \
         (the {} paying at a random moment: {first} before payonce's query, {between} between its query and \
         close, {after} after its close)",
        platform.name(),
        orders.len(),
        counts_text(&before_statuses),
        counts_text(&after_statuses),
        first + between + after,
    );
    Ok((runs, seen, vec![note]))
}

// ---- platform_down ----

/// The platform the buyer would pay at is unreachable (refused
/// connections, then a hanging answer) when the order expires: the order
/// stays PENDING (the other platform closed its trade), the close is
/// retried on the schedule and not before, and once `--close-give-up-s`
/// has passed since expires_at payonce closes here anyway, says
/// `close_unconfirmed` in its inspection, and stops calling.
fn platform_down(sim: &Sim, world: &World) -> Result<Played, String> {
    eprintln!(
        "platform_down ({}): payonce's warnings of unanswered {} calls are this scenario's faults",
        sim.channel.name(),
        sim.channel.name()
    );
    let pace = Pace { timeout: DOWN_TIMEOUT, give_up_ms: GIVE_UP_MS, refund_query_after_ms: 600_000 };
    let payonce = world.payonce(sim, ":memory:", &pace)?;
    let app = &payonce.app;
    let here = sim_on(sim, &payonce);
    let orders = sim_orders(sim, Scenario::PlatformDown, "");
    let created = create_all(&here, &orders, EXPIRES_IN_S)?;
    let made = world.create_payments(&here, &orders)?;
    let (api, platform, partner) = (world.api(), sim.channel, world.partner().platform());
    let mut facts: Vec<Vec<String>> = orders.iter().map(|_| Vec::new()).collect();
    let mut answers: Vec<Vec<String>> =
        created.into_iter().zip(made).map(|(c, made)| std::iter::once(c).chain(made).collect()).collect();
    let note_rows = |facts: &mut Vec<Vec<String>>, when: &str| -> Result<(), String> {
        for (order, facts) in orders.iter().zip(facts.iter_mut()) {
            facts.push(format!("{when}: {}", close_row(app, platform, &order.no)?));
        }
        Ok(())
    };
    let read_status = |answers: &mut Vec<Vec<String>>| -> Result<(), String> {
        let statuses = here.par_orders(orders.len(), |conn, i| get(&here, conn, &orders[i]))?;
        for (answers, status) in answers.iter_mut().zip(statuses) {
            answers.push(status);
        }
        Ok(())
    };
    world.clock.advance_ms(PAST_EXPIRY_MS);
    api.set_fault(Some(Fault::Refuse));
    sweep(app)?;
    round(app)?;
    note_rows(&mut facts, "refused")?;
    read_status(&mut answers)?;
    world.clock.advance_ms(retry_ms() - 1);
    round(app)?;
    note_rows(&mut facts, "1 ms before the retry")?;
    world.clock.advance_ms(1);
    api.set_fault(Some(Fault::Hang));
    round(app)?;
    note_rows(&mut facts, "hanging")?;
    read_status(&mut answers)?;
    let unconfirmed_early = unconfirmed(&here)?;
    // expires_at + the give-up: the next attempt is the last.
    world.clock.advance_ms(EXPIRES_IN_S * 1000 + GIVE_UP_MS - PAST_EXPIRY_MS - retry_ms());
    api.set_fault(Some(Fault::Refuse));
    round(app)?;
    note_rows(&mut facts, "given up")?;
    api.set_fault(None);
    world.clock.advance_ms(retry_ms() * 5);
    round(app)?;
    note_rows(&mut facts, "back up")?;
    let unconfirmed_late = unconfirmed(&here)?;
    let mut runs = Vec::new();
    for (i, ((order, order_facts), answers)) in orders.iter().zip(facts.iter_mut()).zip(answers).enumerate() {
        order_facts.push(format!("{} close row: {}", partner.name(), close_row(app, partner, &order.no)?));
        order_facts.push(trade(api, &order.no));
        order_facts.push(trade(world.partner(), &order.no));
        let early = unconfirmed_early.get(&order.no).cloned();
        order_facts.push(format!("close_unconfirmed before the give-up: {early:?}"));
        let late = unconfirmed_late.get(&order.no).cloned();
        order_facts.push(format!("close_unconfirmed at: {late:?}"));
        runs.push(OrderRun {
            order: order.clone(),
            expect: OrderExpect {
                status: s("CLOSED"),
                answers: std::iter::once(Sim::created())
                    .chain(payments_made(platform, partner, i))
                    .chain([s("api:get 200 PENDING"), s("api:get 200 PENDING")])
                    .collect(),
                events: vec![(s("order.closed"), 1)],
                findings: vec![(s("close_unconfirmed"), 1)],
                sources: Some(Vec::new()),
                audit: Some(vec![s("close_given_up")]),
                platform: vec![
                    s("refused: attempts 1, pending"),
                    s("1 ms before the retry: attempts 1, pending"),
                    s("hanging: attempts 2, pending"),
                    s("given up: attempts 3, given_up"),
                    s("back up: attempts 3, given_up"),
                    format!("{} close row: attempts 1, done", partner.name()),
                    // Never closed there: payonce gave up on it.
                    format!("{} trade {}", platform.name(), open_word(platform)),
                    format!("{} trade {}", partner.name(), closed_word(partner)),
                    s("close_unconfirmed before the give-up: None"),
                    format!("close_unconfirmed at: Some({:?})", vec![platform.name()]),
                ],
                ..OrderExpect::default()
            },
            answers,
            lost: 0,
            deliveries: 0,
        });
    }
    let seen = observe(&here, Scenario::PlatformDown, &runs, facts)?;
    Ok((runs, seen, Vec::new()))
}

/// The platforms of each `close_unconfirmed` finding, by order_no.
fn unconfirmed(here: &Sim) -> Result<HashMap<String, Vec<String>>, String> {
    let mut conn = Conn::new(&here.target);
    let reply = here.api(&mut conn, Req::get(s("/v1/inspections")))?;
    if reply.status != 200 {
        return Err(format!("GET /v1/inspections: {}", crate::client::ReplyExt::summary(&reply)));
    }
    let body = crate::client::ReplyExt::json(&reply);
    Ok(body["findings"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["kind"] == "close_unconfirmed")
        .filter_map(|f| {
            let platforms = f["detail"]["platforms"].as_array()?.iter().filter_map(|p| p.as_str().map(str::to_owned));
            Some((f["order_no"].as_str()?.to_owned(), platforms.collect()))
        })
        .collect())
}

// ---- refund_submitted ----

/// A database file for a payonce that restarts, removed (with its -wal and
/// -shm) when dropped.
struct DbFile(PathBuf);

impl DbFile {
    fn new(sim: &Sim, scenario: Scenario) -> DbFile {
        let (run, channel, pid) = (&sim.run_id, sim.channel.name(), std::process::id());
        let name = format!("payonce-sim-{run}-{}-{channel}-{pid}.db", scenario.name());
        let file = DbFile(std::env::temp_dir().join(name));
        file.remove();
        file
    }

    fn path(&self) -> Result<&str, String> {
        self.0.to_str().ok_or_else(|| format!("{} is not UTF-8", self.0.display()))
    }

    fn remove(&self) {
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", self.0.display()));
        }
    }
}

impl Drop for DbFile {
    fn drop(&mut self) {
        self.remove();
    }
}

/// A paid order's refund is submitted to the platform that took the
/// payment: the first submission fails (5xx), the second is taken but its
/// answer is lost (it does not verify: no answer, for payonce), then
/// payonce restarts (stopped, then started again on the same database file
/// next to a second payonce process, both working the pool's next round at
/// once) and submits once more with the same refund_no, which the platform
/// answers with the refund it has. Exactly one refund at the platform per
/// refund_no, never submitted again; its result is late, so payonce asks
/// (PROCESSING, then SUCCESS) and settles it; the refund notification that
/// comes in the end is a duplicate.
fn refund_submitted(sim: &Sim, world: &World) -> Result<Played, String> {
    let db = DbFile::new(sim, Scenario::RefundSubmitted);
    let pace = Pace { refund_query_after_ms: REFUND_QUERY_AFTER_MS, ..Pace::healthy() };
    let config = world.config(sim, &pace)?;
    let first = LocalServer::open(db.path()?, world.clock.clone(), config.clone())?;
    let here = sim_on(sim, &first);
    let orders = sim_orders(sim, Scenario::RefundSubmitted, "");
    let refund_no = |order: &SimOrder| format!("{}_R1", order.no);
    let created = create_all(&here, &orders, 3_600)?;
    let made = world.create_payments(&here, &orders)?;
    let (api, partner) = (world.api(), world.partner());
    let pay_nos = pay_all(api, &orders)?;
    let mut answers: Vec<Vec<String>> =
        created.into_iter().zip(made).map(|(c, made)| std::iter::once(c).chain(made).collect()).collect();
    let mut deliveries = vec![0usize; orders.len()];
    let paid =
        here.par_orders(orders.len(), |conn, i| here.deliver_payment(conn, &notice(&orders[i], &pay_nos[i], 0)))?;
    for ((answers, deliveries), paid) in answers.iter_mut().zip(deliveries.iter_mut()).zip(paid) {
        answers.push(paid.label);
        *deliveries += paid.sends;
    }
    // The refund is requested (twice: one refund) while the platform fails.
    api.set_fault(Some(Fault::ServerError));
    let requested = here.par_orders(orders.len(), |conn, i| {
        let path = format!("/v1/orders/{}/refund", orders[i].no);
        let mut labels = Vec::new();
        for _ in 0..2 {
            let reply = here.api(conn, Req::post_json(path.clone(), &json!({"refund_no": refund_no(&orders[i])})))?;
            labels.push(api_label("refund", &reply));
        }
        Ok(labels)
    })?;
    for (answers, labels) in answers.iter_mut().zip(requested) {
        answers.extend(labels);
    }
    round(&first.app)?;
    let mut facts: Vec<Vec<String>> = orders
        .iter()
        .map(|o| vec![format!("after the 5xx: {} refunds at the platform", refunds_of(api, &refund_no(o)).len())])
        .collect();
    api.set_fault(None);
    world.clock.advance_ms(retry_ms() - 1);
    round(&first.app)?;
    for (order, facts) in orders.iter().zip(facts.iter_mut()) {
        facts.push(format!("1 ms before the retry: {} submissions", calls_about(api, Kind::Refund, &refund_no(order))));
    }
    world.clock.advance_ms(1);
    // Taken at the platform, its answer lost on the way: here it does not
    // verify, which payonce treats exactly as no answer (as a timeout).
    api.set_fault(Some(Fault::TamperAnswers));
    round(&first.app)?;
    api.set_fault(None);
    for (order, facts) in orders.iter().zip(facts.iter_mut()) {
        facts.push(format!("answer lost: {} refunds at the platform", refunds_of(api, &refund_no(order)).len()));
    }
    // The restart: payonce stops; on the same file it starts again, and a
    // second process with it (two payonce processes on one database): both
    // work the next round at once, then the other one stops.
    drop(first);
    let second = LocalServer::open(db.path()?, world.clock.clone(), config.clone())?;
    let other = LocalServer::open(db.path()?, world.clock.clone(), config)?;
    world.clock.advance_ms(retry_ms());
    let rounds: Result<Vec<usize>, String> = thread::scope(|scope| {
        let one = scope.spawn(|| round(&second.app));
        let two = scope.spawn(|| round(&other.app));
        [one, two].into_iter().map(|r| r.join().unwrap_or_else(|_| Err(s("a pool round panicked")))).collect()
    });
    let worked: usize = rounds?.iter().sum();
    for facts in &mut facts {
        facts.push(format!("the two payonces worked {worked} calls after the restart"));
    }
    drop(other);
    let here = sim_on(sim, &second);
    for _ in 0..2 {
        world.clock.advance_ms(retry_ms());
        round(&second.app)?;
    }
    // The result is late: the query asks, hears PROCESSING, then SUCCESS.
    world.clock.advance_ms(REFUND_QUERY_AFTER_MS);
    round(&second.app)?;
    let statuses = here.par_orders(orders.len(), |conn, i| get(&here, conn, &orders[i]))?;
    for (answers, status) in answers.iter_mut().zip(statuses) {
        answers.push(status);
    }
    for order in &orders {
        if !api.settle_refund(&refund_no(order), RefundStatus::Success) {
            return Err(format!("{}: no refund {} to settle", api.platform().name(), refund_no(order)));
        }
    }
    world.clock.advance_ms(retry_ms());
    round(&second.app)?;
    // The platform's refund notification, in the end: a duplicate.
    let late = here.par_orders(orders.len(), |conn, i| {
        let notice =
            RefundNotice::full(refund_no(&orders[i]), orders[i].no.clone(), pay_nos[i].clone(), orders[i].amount, true);
        here.deliver_refund(conn, &notice)
    })?;
    let mut runs = Vec::new();
    for (i, order) in orders.iter().enumerate() {
        let no = refund_no(order);
        answers[i].push(late[i].label.clone());
        deliveries[i] += late[i].sends;
        let refunds: Vec<String> =
            refunds_of(api, &no).iter().map(|r| format!("{} fen, {:?}", r.amount, r.status)).collect();
        facts[i].extend([
            format!("{} submissions of {no}", calls_about(api, Kind::Refund, &no)),
            format!("refunds of {no} at the platform: {refunds:?}"),
            format!("{} refund queries of {no}", calls_about(api, Kind::RefundQuery, &no)),
            format!("{} calls to {} after the payment's creation", merchant_calls(partner), partner.platform().name()),
        ]);
        runs.push(OrderRun {
            order: order.clone(),
            expect: OrderExpect {
                status: s("REFUNDED"),
                answers: std::iter::once(Sim::created())
                    .chain(payments_made(sim.channel, partner.platform(), i))
                    .chain([
                        here.said("applied"),
                        s("api:refund 200 REFUNDING"),
                        s("api:refund 200 REFUNDING"),
                        s("api:get 200 REFUNDING"),
                        format!("refund {}", here.said("duplicate")),
                    ])
                    .collect(),
                payments: vec![s("applied")],
                paid: true,
                refunded: true,
                events: vec![(s("order.paid"), 1), (s("order.refunding"), 1), (s("order.refunded"), 1)],
                sources: Some(vec![s("callback")]),
                platform: vec![
                    s("after the 5xx: 0 refunds at the platform"),
                    s("1 ms before the retry: 1 submissions"),
                    s("answer lost: 1 refunds at the platform"),
                    format!("the two payonces worked {} calls after the restart", orders.len()),
                    format!("3 submissions of {no}"),
                    format!("refunds of {no} at the platform: {:?}", vec![format!("{} fen, Success", order.amount)]),
                    format!("2 refund queries of {no}"),
                    format!("0 calls to {} after the payment's creation", partner.platform().name()),
                ],
                ..OrderExpect::default()
            },
            answers: answers[i].clone(),
            lost: 0,
            deliveries: deliveries[i],
        });
    }
    let seen = observe(&here, Scenario::RefundSubmitted, &runs, facts)?;
    drop(second);
    Ok((runs, seen, Vec::new()))
}

// ---- partial_refunds ----

/// partial_refunds on the platform that took the payment: each order paid
/// there, then its three refunds (see [`RefundPlan`]) asked of payonce,
/// which submits each to the platform (a round of its pool); each settles
/// there (SUCCESS, or CLOSED for the one that fails) and the platform's
/// notice of it, with the amounts it holds, reaches payonce. In the end the
/// platform holds each refund once, with its own amount, and has refunded
/// what payonce says it refunded: the whole order.
fn partial_refunds(sim: &Sim, world: &World) -> Result<Played, String> {
    let payonce = world.payonce(sim, ":memory:", &Pace::healthy())?;
    let app = &payonce.app;
    let here = sim_on(sim, &payonce);
    let orders = sim_orders(sim, Scenario::PartialRefunds, "");
    let created = create_all(&here, &orders, 3_600)?;
    let made = world.create_payments(&here, &orders)?;
    let (api, platform, partner) = (world.api(), sim.channel, world.partner().platform());
    let pay_nos = pay_all(api, &orders)?;
    let paid =
        here.par_orders(orders.len(), |conn, i| here.deliver_payment(conn, &notice(&orders[i], &pay_nos[i], 0)))?;
    let plans: Vec<RefundPlan> =
        orders.iter().zip(&pay_nos).map(|(order, pay_no)| RefundPlan::new(order, pay_no, '_', platform)).collect();
    // A refund that never reached the platform settles nowhere: its result
    // is then the simulator's own, and the platform's refunds in the facts
    // lack it.
    let settle = |refund: &super::PlannedRefund| {
        let status = if refund.fails { RefundStatus::Closed } else { RefundStatus::Success };
        api.settle_refund(&refund.refund_no, status).then(|| api.refund_notice(&refund.refund_no)).flatten()
    };
    let played = here.play_refunds(&plans, &|| round(app).map(drop), &settle)?;
    let suffix = |order: &SimOrder, no: &str| no.strip_prefix(order.no.as_str()).unwrap_or(no).to_owned();
    // What the platform holds of the order's trade, in the order asked.
    let held = |order: &SimOrder| -> Vec<String> {
        let refunds = api.refunds().into_iter().filter(|r| r.out_trade_no == order.no);
        refunds.map(|r| format!("{} {} fen {:?}", suffix(order, &r.out_refund_no), r.amount, r.status)).collect()
    };
    let mut runs = Vec::new();
    let mut facts = Vec::new();
    for (i, (((order, created), paid), (answers, sends))) in
        orders.iter().zip(created).zip(paid).zip(played).enumerate()
    {
        let plan = &plans[i];
        let submissions: Vec<usize> =
            plan.refunds.iter().map(|r| calls_about(api, Kind::Refund, &r.refund_no)).collect();
        facts.push(vec![
            format!("refunds at {}: {:?}", platform.name(), held(order)),
            format!("submissions of each: {submissions:?}"),
            trade(api, &order.no),
            format!("{} calls to {} after the payment's creation", merchant_calls(world.partner()), partner.name()),
        ]);
        let settled = |r: &super::PlannedRefund| if r.fails { "Closed" } else { "Success" };
        let said = |outcome: &str| here.said(outcome);
        let expected = std::iter::once(Sim::created())
            .chain(payments_made(platform, partner, i))
            .chain(std::iter::once(here.said("applied")))
            .chain(plan.answers(&said))
            .collect();
        let refunded_word = if platform == Platform::Alipay { "TRADE_CLOSED" } else { "REFUND" };
        let held_there: Vec<String> = plan
            .refunds
            .iter()
            .map(|r| format!("{} {} fen {}", suffix(order, &r.refund_no), r.amount, settled(r)))
            .collect();
        runs.push(OrderRun {
            order: order.clone(),
            expect: OrderExpect {
                sources: Some(vec![s("callback")]),
                platform: vec![
                    format!("refunds at {}: {held_there:?}", platform.name()),
                    format!("submissions of each: {:?}", vec![1; plan.refunds.len()]),
                    format!("{} trade {refunded_word}", platform.name()),
                    format!("0 calls to {} after the payment's creation", partner.name()),
                    refunded_fact(platform, order.amount, Some(order.amount)),
                ],
                ..plan.expect(expected)
            },
            answers: [created].into_iter().chain(made[i].iter().cloned()).chain([paid.label]).chain(answers).collect(),
            lost: 0,
            deliveries: paid.sends + sends,
        });
    }
    let mut seen = observe(&here, Scenario::PartialRefunds, &runs, facts)?;
    for (order, seen) in orders.iter().zip(seen.iter_mut()) {
        seen.platform.push(refunded_fact(platform, api.refunded_total(&order.no), seen.refunded_amount));
    }
    Ok((runs, seen, Vec::new()))
}

/// What the platform refunded on the trade beside what payonce says it
/// refunded (`refunded_amount`; `none`: the order does not show it).
fn refunded_fact(platform: Platform, at_platform: i64, payonce: Option<i64>) -> String {
    let payonce = payonce.map_or_else(|| s("none"), |fen| fen.to_string());
    format!("{} refunded {at_platform} fen, payonce's refunded_amount {payonce}", platform.name())
}

/// The platform's refunds of one refund number.
fn refunds_of(api: &PlatformApi, refund_no: &str) -> Vec<crate::platform_api::RefundRecord> {
    api.refunds().into_iter().filter(|r| r.out_refund_no == refund_no).collect()
}

// ---- triple_click ----

/// How long the platform holds each payment's creation in triple_click: a
/// real platform answers in a hundred milliseconds or so, and a buyer
/// clicks as fast, so the three clicks meet the one call in flight.
const CLICK_DELAY: Duration = Duration::from_millis(30);
/// The clicks of one order.
const CLICKS: usize = 3;

/// triple_click's method for order `i`: WeChat Pay's four in turn; Alipay
/// precreate, its one method made by a server call (its page, wap and app
/// requests are signed afresh per click and made by the buyer opening one,
/// as the other scenarios play them).
fn click_method(platform: Platform, i: usize) -> &'static str {
    match platform {
        Platform::Alipay => "precreate",
        _ => method_of(platform, i),
    }
}

/// What a created payment hands over, by method (docs/platforms.md, "Paying").
fn payment_keys(method: &str) -> &'static str {
    match method {
        "native" => "code_url",
        "h5" => "h5_url",
        "jsapi" | "app" => "prepay_id, client_params",
        _ => "qr_code",
    }
}

/// The trade type the platform keeps for a trade made by `method`.
fn trade_type(platform: Platform, method: &str) -> String {
    match platform {
        Platform::Alipay => format!("alipay.trade.{method}"),
        _ => method.to_ascii_uppercase(),
    }
}

/// The buyer clicks "pay" three times at once (three concurrent
/// `POST /v1/orders/{order_no}/pay`, the platform slow enough that they
/// meet its one call), then pays at the platform, whose notification
/// reaches payonce: one trade there, made by one prepay call; three
/// byte-identical answers; one applied payment, one coupon, one points
/// entry. Before payonce made payments, each click was the merchant's own
/// call to the platform: three calls for each trade.
fn triple_click(sim: &Sim, world: &World) -> Result<Played, String> {
    let payonce = world.payonce(sim, ":memory:", &Pace::healthy())?;
    let app = &payonce.app;
    let here = sim_on(sim, &payonce);
    let orders = sim_orders(sim, Scenario::TripleClick, "");
    let created = create_all(&here, &orders, 3_600)?;
    let (api, platform) = (world.api(), sim.channel);
    api.set_fault(Some(Fault::Delay(CLICK_DELAY)));
    let clicked = here.rounds(
        orders.len(),
        CLICKS,
        |_, _| Ok(()),
        |conn, i, _, ()| {
            let body = pay_body(platform, click_method(platform, i));
            let reply = here.api(conn, Req::post_json(pay_path(&orders[i]), &body))?;
            Ok((reply.status, reply.body))
        },
    );
    api.set_fault(None);
    let clicked = clicked?;
    let mut facts: Vec<Vec<String>> = Vec::new();
    for (i, (order, clicks)) in orders.iter().zip(&clicked).enumerate() {
        let method = click_method(platform, i);
        let bodies: std::collections::BTreeSet<&[u8]> = clicks.iter().map(|(_, body)| body.as_slice()).collect();
        let identical = match bodies.len() {
            1 => format!("the {CLICKS} answers are byte-identical"),
            n => format!("the {CLICKS} answers are {n} different bodies"),
        };
        let answered = serde_json::from_slice::<serde_json::Value>(&clicks[0].1).unwrap_or_default();
        let keys: Vec<&str> = answered["payment"]
            .as_object()
            .map(|p| p.keys().map(String::as_str).filter(|k| !PAYMENT_COMMON.contains(k)).collect())
            .unwrap_or_default();
        let made = api.trade(&order.no).map_or_else(|| s("no trade"), |t| format!("trade made by {}", t.trade_type));
        facts.push(vec![
            format!("{} prepay calls at {}", calls_about(api, Kind::Prepay, &order.no), platform.name()),
            format!("{} {made}", platform.name()),
            identical,
            format!("{method} answered {}", keys.join(", ")),
            format!("prepay row: {}", prepay_row(app, platform, &order.no)?),
        ]);
    }
    let pay_nos = pay_all(api, &orders)?;
    let notified =
        here.par_orders(orders.len(), |conn, i| here.deliver_payment(conn, &notice(&orders[i], &pay_nos[i], 0)))?;
    let mut runs = Vec::new();
    for (i, (((order, created), clicks), notified)) in
        orders.iter().zip(created).zip(&clicked).zip(notified).enumerate()
    {
        let method = click_method(platform, i);
        facts[i].push(trade(api, &order.no));
        let mut answers = vec![created];
        answers.extend(clicks.iter().map(|(status, _)| format!("pay {status}")));
        answers.push(notified.label);
        let mut expected = vec![Sim::created()];
        expected.extend((0..CLICKS).map(|_| s("pay 200")));
        expected.push(here.said("applied"));
        runs.push(OrderRun {
            order: order.clone(),
            expect: OrderExpect {
                sources: Some(vec![s("callback")]),
                audit: Some(Vec::new()),
                platform: vec![
                    format!("1 prepay calls at {}", platform.name()),
                    format!("{} trade made by {}", platform.name(), trade_type(platform, method)),
                    format!("the {CLICKS} answers are byte-identical"),
                    format!("{method} answered {}", payment_keys(method)),
                    s("prepay row: attempts 1, done"),
                    format!("{} trade {}", platform.name(), paid_word(platform)),
                ],
                ..Sim::paid_expect(expected)
            },
            answers,
            lost: 0,
            deliveries: CLICKS + notified.sends,
        });
    }
    let seen = observe(&here, Scenario::TripleClick, &runs, facts)?;
    drop(payonce);

    // Before payonce made payments: the same clicks, each the merchant's own
    // call to the platform (as slow), beside a payonce without platform settings.
    let baseline = world.baseline(sim)?;
    let there = sim_on(sim, &baseline);
    let before = sim_orders(sim, Scenario::TripleClick, "b");
    create_all(&there, &before, 3_600)?;
    let code = world.merchant_code()?;
    api.set_fault(Some(Fault::Delay(CLICK_DELAY)));
    let made: Result<Vec<Vec<String>>, String> = before
        .iter()
        .enumerate()
        .map(|(i, order)| world.merchant_prepays(&code, &baseline.app, order, click_method(platform, i), CLICKS))
        .collect();
    api.set_fault(None);
    let refused: usize = made?.iter().flatten().filter(|m| *m != "created").count();
    let before_pay_nos = pay_all(api, &before)?;
    there.par_orders(before.len(), |conn, i| {
        there.deliver_payment(conn, &notice(&before[i], &before_pay_nos[i], 0)).map(|_| ())
    })?;
    let before_seen = read_back(&there, &before)?;
    let tally = |orders: &[SimOrder], seen: &[OrderSeen]| -> String {
        let calls: usize = orders.iter().map(|o| calls_about(api, Kind::Prepay, &o.no)).sum();
        let trades = orders.iter().filter(|o| api.trade(&o.no).is_some()).count();
        let (statuses, _) = outcome_counts(seen);
        let coupons: usize = seen.iter().map(|o| o.coupons.len()).sum();
        let points = seen.iter().flat_map(|o| &o.points).filter(|(kind, _)| kind == "ORDER_PAID").count();
        format!(
            "{calls} prepay calls for {trades} trades, {}, {coupons} coupons, {points} points entries",
            counts_text(&statuses)
        )
    };
    let identical = seen.iter().filter(|o| o.platform.iter().any(|f| f.ends_with("byte-identical"))).count();
    let note = format!(
        "triple_click ({}): {} buyers clicking pay {CLICKS} times at once, then paying. Before (each click the \
         merchant's own call to the platform): {}{}. After (payonce): {}, {identical} orders answered {CLICKS} \
         byte-identical times",
        platform.name(),
        orders.len(),
        tally(&before, &before_seen),
        if refused > 0 { format!(", {refused} clicks refused") } else { String::new() },
        tally(&orders, &seen),
    );
    Ok((runs, seen, vec![note]))
}

/// The keys every payment answer has besides its method's.
const PAYMENT_COMMON: [&str; 4] = ["channel", "method", "created_at", "expires_at"];

/// payonce's prepay row of `order_no` at `channel`, as the order's
/// `platform_calls` show it: its attempts and status.
fn prepay_row(app: &App, channel: Platform, order_no: &str) -> Result<String, String> {
    let detail = app.orders().order(order_no).map_err(|e| format!("reading order {order_no}: {e}"))?;
    let rows: Vec<_> = detail
        .platform_calls
        .iter()
        .filter(|c| c.kind == PlatformCallKind::Prepay && c.channel == channel.name())
        .collect();
    Ok(match rows.as_slice() {
        [row] => format!("attempts {}, {}", row.attempts, row.status.as_str()),
        [] => s("no prepay row"),
        more => format!("{} prepay rows", more.len()),
    })
}
