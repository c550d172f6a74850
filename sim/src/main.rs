//! `payonce-sim` (also run as `payonce simulate`, which execs this binary
//! from its own directory): a payment platform played against payonce.
//!
//! The simulator creates orders, delivers signed callbacks in every
//! real-world duplicate form (concurrent duplicates, a re-delivery 40 ms
//! later, a gateway replay after a lost answer, the platforms' retry
//! schedules, two payments of one order, a payment after close, a refund
//! and its duplicate, an order refunded in three parts with a duplicate and
//! a failure on the way, a triple-clicked order creation; and, against
//! payonce's calls to the platforms' merchant APIs, a triple-clicked
//! payment, a lost notification, a payment racing payonce's close, a
//! platform that is down, a refund submitted through failures and a
//! restart, payments payonce did not want returned to their buyers), then
//! reads the results back
//! through payonce's own read API and judges them:
//!
//! - the answers payonce gave (`applied`, `duplicate`, ...) are the ones the
//!   contract prescribes, as a multiset (which of two racing deliveries wins
//!   is not fixed, that exactly one wins is);
//! - `GET /v1/orders/{order_no}`: the final status, one `pay_callback_log`
//!   row per pay_no with the right outcome, at most one coupon per (order,
//!   template), at most one `ORDER_PAID` points entry, reversals and frozen
//!   coupons after a refund;
//! - `GET /v1/events`: exactly the events each order must have caused, once;
//! - `GET /v1/inspections`: payonce's own independent witness (it knows the
//!   rewards that were due), no finding on the simulator's orders except the
//!   `refund_required` each double payment must raise.
//!
//! Nothing is assumed: a verdict comes only from what payonce answered and
//! what its read API shows. Without `--target` the simulator starts a payonce
//! in this process (in-memory database, HTTP on loopback) and then also knows
//! the reward settings, so it expects exact coupon and points counts.
//!
//! The modules, by concern:
//!
//! - `main.rs` (here): the arguments and the wiring;
//! - [`scenarios`]: what each scenario sends and expects, and reading the
//!   results back; its `platform_calls`: the scenarios of the platform
//!   calls of docs/platforms.md (lost_notification, close_race,
//!   platform_down, refund_submitted, unwanted_money, and triple_click and
//!   partial_refunds on the platforms' channels), each against a payonce of its own that
//!   calls the simulated platforms' APIs;
//! - [`platform`]: each [`Platform`]'s notifications, signed from the
//!   platforms' documentation with this crate's own code (payonce's generic
//!   HMAC format, WeChat Pay v3: SHA256-RSA over `"{ts}\n{nonce}\n{body}\n"`
//!   and an AES-256-GCM resource, Alipay: RSA2 form notices), never with the
//!   service's channel code: the simulator is the independent oracle of its
//!   verification. A real platform is one more variant and one more arm in
//!   [`Platform::sign_payment`], [`Platform::sign_refund`] and
//!   [`Platform::answer`]. The platforms' protocols carry no outcome (WeChat
//!   answers 204, Alipay `success`): for them an answer only says
//!   "processed", and the outcome is judged from the read API alone;
//! - [`platform_api`]: the other direction, the platforms' merchant APIs
//!   payonce calls (docs/platforms.md: WeChat Pay v3 query, close, refund and
//!   refund query; Alipay's gateway), on loopback, requests verified and answers
//!   signed with this crate's code, with switchable faults;
//! - [`standalone`]: `payonce-sim platforms`, those merchant APIs on their
//!   own for a real `payonce serve` to call, driven from stdin;
//! - [`judge`]: one order's verdict; [`table`]: the table and its rows;
//! - [`client`]: the target and its keep-alive connections (over
//!   `payonce-testclient`); [`workers`] and [`progress`]: threads and the
//!   progress bar; [`local`]: the in-process payonce.

mod alipay_certs;
mod client;
mod judge;
mod local;
mod payonce_log;
mod platform;
// The platforms' merchant APIs (docs/platforms.md), served by
// `payonce-sim platforms` and played against payonce by the scenarios that
// talk to the platforms; some controls only the tests use.
#[cfg_attr(not(test), allow(dead_code))]
mod platform_api;
mod progress;
mod scenarios;
mod standalone;
mod table;
mod workers;

use client::Target;
use judge::RewardRule;
use local::{LocalServer, SIM_COUPON, SIM_POINTS_PER_YUAN};
use payonce::app::ApiToken;
use payonce::domain::Rewards;
use platform::{first_secret, platform_keys, Platform};
use progress::Progress;
use scenarios::{Scenario, Sim};
use std::ffi::OsString;
use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

pub const USAGE: &str = "\
Usage: payonce simulate [--target URL] [--channel NAME] [options]
       payonce simulate platforms [options]   (WeChat Pay's and Alipay's merchant
                                  APIs for a payonce serve to call; its --help)

Plays a payment platform against payonce and checks that every payment took
effect exactly once. Without --target it starts its own payonce in this
process (in-memory database; coupon template SIM-COUPON and 1 point per yuan
on payment; every channel configured with keys made for this run) and talks
to it over HTTP on loopback. Each scenario creates its own orders (order_nos
prefixed with a fresh run id, so reruns against one server never collide),
delivers signed callbacks, then reads the results back (GET /v1/orders/{no},
/v1/events, /v1/inspections) and prints a table on stdout: scenario, channel
(with several), deliveries sent (and what payonce answered), effects expected,
effects observed, verdict; a line on stderr as each scenario ends. Exit
status 0 when every scenario is ok, 1 on any violation, 2 on an error (e.g.
the target is unreachable, a key is refused).

This is the payonce-sim binary; `payonce simulate ARGS` runs it from the
directory the payonce binary is in.

Scenarios (default: all, in this order):
  concurrent           K deliveries of one pay_no at the same moment (--concurrency)
  redelivery_40ms      the same callback again 40 ms after the first (the incident)
  gateway_replay       the first answer is lost (the client times out) and the
                       callback is re-sent on a new connection
  retry_schedule       WeChat Pay's (15s 15s 30s 3m 10m 20m 30m 30m 30m 1h 3h 3h 3h
                       6h 6h) and Alipay's (4m 10m 10m 1h 2h 6h 15h) retry schedules,
                       every answer treated as lost so each retry is delivered;
                       compressed by --time-factor. By default the first hour
                       of each (WeChat Pay 15s 15s 30s 3m 10m 20m, Alipay 4m 10m
                       10m); --full-schedules plays all 24 hours. Each platform
                       channel plays its own; generic alternates the two
  two_channels         two pay_nos for one order at once: one applied, one
                       already_paid (+ payment.refund_required); with several
                       channels selected the second goes through the next one
  payment_after_close  the order is closed, then paid: paid_after_close
  refund               pay, request the refund twice, deliver its SUCCESS twice
  partial_refunds      pay, then refund the order in three parts (POST
                       /v1/orders/{order_no}/refunds): 30 % and a fen, its SUCCESS
                       delivered twice; 20 % and a fen, first FAILED (WeChat Pay
                       REFUND.CLOSED; not on alipay, which tells of no failed
                       refund), then asked again under a new refund_no; the rest,
                       without an amount. Meanwhile a refund asked while one is in
                       flight (409 refund_in_progress) and one a fen past what is
                       left (409 refund_exceeds_balance). REFUNDED, refunded_amount
                       = amount, each refund's row, one points reversal per refund
                       (floor(points x refund / amount), the last what is left),
                       frozen coupons. wechatpay and alipay in process: against a
                       payonce of its own that submits each refund to the simulated
                       platform (as below), which settles it and sends its notice,
                       and must end having refunded what payonce says
  triple_click         generic (and with --target): three concurrent POST /v1/orders with
                       one order_no. wechatpay and alipay: against a payonce of its own
                       that calls the simulated platform (as below), three concurrent
                       POST /v1/orders/{order_no}/pay, the platform slow enough that they
                       meet its one call, then the buyer pays there: one prepay call, one
                       trade, three identical answers, one payment, coupon and points entry
The next five talk to the platforms' merchant APIs (docs/platforms.md):
each plays the simulated WeChat Pay and Alipay APIs against a payonce of its
own in this process, configured with both platforms' outgoing settings, on a
clock the simulator moves (seconds pass in milliseconds), its sweeper and
platform-call pool run a round at a time. payonce makes every trade: each
order is paid through POST /v1/orders/{order_no}/pay at both platforms, the
method varied across orders (WeChat Pay native, jsapi, h5, app; Alipay
precreate, and page, wap and app requests the simulated buyer opens). On
wechatpay and alipay only (the buyer pays at that platform); skipped on
generic, which has no API to ask, and with --target, whose payonce has
neither these settings nor that clock.
  lost_notification    the buyer pays, the notification is lost; at expiry payonce
                       asks before it closes and applies the payment (source query);
                       half the notifications come late anyway: duplicates
  close_race           the buyer pays while payonce closes: between its query and
                       its close (with and without the notification arriving
                       meanwhile), after the platform's close (refused there), or
                       at a random moment: paid or closed, never both
  platform_down        the platform refuses connections, then hangs: the order stays
                       PENDING, retried on the schedule, then closed here after
                       the give-up and reported close_unconfirmed
  refund_submitted     the refund is submitted to the platform that took the
                       payment through a 5xx, a lost answer and a restart (onto
                       the same database, next to a second payonce): one refund
                       there per refund_no; its late result comes by the query
  unwanted_money       payments payonce did not want: paid at both platforms (one
                       already_paid), paid at the platform payonce could not reach
                       to close the expired order (closed here after the give-up:
                       paid_after_close), paid on a trade the merchant's own code
                       made at another amount (amount_mismatch). With
                       --refund-unwanted auto each is refunded at the platform that
                       took it, by its pay_no, in full, once (payonce stopped between
                       the refunds' requests and their submission, then started
                       again next to a second payonce): resolution refunded, no
                       refund_required finding left, the order and its applied
                       payment untouched. The same buyers with --refund-unwanted
                       manual are noted beside: findings open, nothing refunded
lost_notification, close_race and triple_click (on wechatpay and alipay) also
play the same buyers against a payonce without platform settings (as before
payonce called the platforms, when the merchant's own code made each payment
at the platform, one call per click), and unwanted_money against one with
--refund-unwanted manual, and print how both ended under the table; that
pass is not judged.

Channels (--channel; default generic):
  generic    payonce's own JSON + Payonce-Signature (HMAC-SHA256), refund
             results with the refund's `amount`; payonce answers the outcome
             (applied, duplicate, ...)
  wechatpay  WeChat Pay v3: TRANSACTION.SUCCESS (transaction_id = pay_no) to
             /v1/callbacks/wechatpay, REFUND.SUCCESS (a failed refund:
             REFUND.CLOSED; amount.refund the refund's, amount.total the
             order's) to .../wechatpay/refund,
             SHA256-RSA signed, resource AES-256-GCM-encrypted with the APIv3
             key; payonce answers 204 (shown as `processed`)
  alipay     Alipay RSA2 form notices to /v1/callbacks/alipay: TRADE_SUCCESS
             (re-deliveries alternate with TRADE_FINISHED, which must be the
             same payment), amounts as yuan strings; refunds as TRADE_SUCCESS
             (TRADE_CLOSED once nothing is left to refund) with refund_fee =
             the trade's refunded total so far and out_biz_no = refund_no;
             payonce answers the text `success` (shown as `processed`)
  all        every scenario once per channel
WeChat Pay and Alipay answers carry no outcome: the outcome of each payment is
judged from GET /v1/orders/{no} (payments[].outcome), events and inspections.

Options:
  --target URL            a running payonce, e.g. http://127.0.0.1:8080 (plain HTTP)
  --callback-secret S     generic-channel secret (the first of a comma-separated
                          list); env PAYONCE_CALLBACK_SECRET. Required with --target
                          when the generic channel is selected.
  --api-token T           bearer token for the order, event and inspection endpoints;
                          env PAYONCE_API_TOKEN (a `name:token` entry works too)
  --channel NAME          generic, wechatpay, alipay or all (or a comma-separated
                          list) [default: generic]
  --scenario NAME         run only this scenario (repeatable, or comma-separated)
  --orders N              orders per scenario and channel [default: 10]
  --concurrency K         simultaneous deliveries in `concurrent` [default: 8]
  --time-factor F         retry schedules run F times faster [default: 1000, which
                          plays their first hour in about 2 s]
  --full-schedules        play the whole 24-hour retry schedules (about 90 s per
                          channel at the default --time-factor)
  --replay-timeout-ms MS  how long gateway_replay's first attempt waits for the
                          answer before the gateway gives up [default: 0: it gives
                          up at once, so that answer is always lost; with MS > 0
                          a fast payonce may answer in time]
  --key-mode MODE         public-key or certificate: how the simulated platforms
                          sign and how the in-process payonce holds their keys.
                          public-key: WeChat Pay signs under a public key
                          (PUB_KEY_ID_...) payonce is configured with, Alipay
                          with the Alipay public key. certificate: WeChat Pay signs
                          with a platform certificate payonce downloads from it
                          (--wechatpay-platform-certs auto, no key configured for
                          that serial; in process only); Alipay plays certificate
                          mode (a root file with an RSA and an ECDSA root, an
                          Alipay public certificate and the merchant's app
                          certificate, made for the run; app_cert_sn and
                          alipay_root_cert_sn checked on every request,
                          alipay_cert_sn in every answer) and payonce holds the
                          three files, as by --alipay-app-cert, --alipay-public-cert
                          and --alipay-root-cert [default: public-key]
  -v, --verbose           the whole table: each scenario's deliveries and its
                          expected and observed effects in full (by default the
                          table fits 100 columns)
  -h, --help              this help

Platform keys (needed with --target for the channels selected):
  --wechatpay-private-key FILE  the WeChat Pay platform's private key (PKCS#8 PEM)
                                whose public half the target has under the serial
  --wechatpay-serial S          that key's serial, e.g. PUB_KEY_ID_...
  --wechatpay-apiv3-key KEY     the merchant's APIv3 key (32 bytes); env
                                PAYONCE_WECHATPAY_APIV3_KEY
  --alipay-private-key FILE     the Alipay platform's private key (PKCS#8 PEM)
  --alipay-app-id ID            the merchant's app_id the target expects
These private keys are the *platforms'* signing keys: a real platform never
hands them out, so only a test setup has them (payonce's tests use the
TEST_ONLY_*_private.pem fixtures). Never point the simulator with such keys at
a payonce that trusts a real platform's public key; it would not verify
anyway. Without --target none are needed: the simulator makes fresh key pairs
(WeChat serial PUB_KEY_ID_SIMULATOR, a random APIv3 key, Alipay app_id
2021000000000000) and configures the in-process payonce with the public
halves; given private keys (and serial, APIv3 key, app_id) are used instead.

Against --target the simulator cannot know the server's reward settings: it
then checks at most one coupon per (order, template) and at most one
ORDER_PAID points entry per order, and relies on payonce's inspection
(paid_without_rewards) for rewards that were due but are missing.
";

/// `--key-mode`: what the simulated platforms sign with (sim/src/alipay_certs.rs).
pub use alipay_certs::KeyMode;

/// The command line.
struct Options {
    target: Option<String>,
    callback_secret: Option<String>,
    api_token: Option<String>,
    channels: Vec<Platform>,
    scenarios: Vec<Scenario>,
    orders: usize,
    concurrency: usize,
    time_factor: f64,
    full_schedules: bool,
    replay_timeout_ms: u64,
    verbose: bool,
    wechatpay_private_key: Option<String>,
    wechatpay_serial: Option<String>,
    wechatpay_apiv3_key: Option<String>,
    alipay_private_key: Option<String>,
    alipay_app_id: Option<String>,
    key_mode: KeyMode,
}

fn string_value(parser: &mut lexopt::Parser) -> Result<String, String> {
    parser.value().map_err(|e| e.to_string())?.into_string().map_err(|v| format!("{v:?} is not UTF-8"))
}

fn int_value(parser: &mut lexopt::Parser, flag: &str, min: u64, max: u64) -> Result<u64, String> {
    let text = string_value(parser)?;
    match text.parse::<u64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(format!("{flag} {text:?}: expected an integer from {min} to {max}")),
    }
}

/// `None` when --help was printed.
fn parse_args(args: impl Iterator<Item = OsString>) -> Result<Option<Options>, String> {
    use lexopt::prelude::*;
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let mut opts = Options {
        target: None,
        callback_secret: env("PAYONCE_CALLBACK_SECRET"),
        api_token: env("PAYONCE_API_TOKEN"),
        channels: Vec::new(),
        scenarios: Vec::new(),
        orders: 10,
        concurrency: 8,
        time_factor: 1000.0,
        full_schedules: false,
        replay_timeout_ms: 0,
        verbose: false,
        wechatpay_private_key: None,
        wechatpay_serial: None,
        wechatpay_apiv3_key: env("PAYONCE_WECHATPAY_APIV3_KEY"),
        alipay_private_key: None,
        alipay_app_id: None,
        key_mode: KeyMode::PublicKey,
    };
    let mut parser = lexopt::Parser::from_args(args);
    while let Some(arg) = parser.next().map_err(|e| e.to_string())? {
        match arg {
            Long("target") => opts.target = Some(string_value(&mut parser)?),
            Long("callback-secret") => opts.callback_secret = Some(string_value(&mut parser)?),
            Long("api-token") => opts.api_token = Some(string_value(&mut parser)?),
            Long("channel") => {
                for name in string_value(&mut parser)?.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                    let chosen = match name {
                        "all" => Platform::ALL.to_vec(),
                        _ => vec![Platform::parse(name).ok_or_else(|| {
                            let known: Vec<&str> = Platform::ALL.iter().map(|c| c.name()).collect();
                            format!("--channel {name:?}: known channels: {}, or all", known.join(", "))
                        })?],
                    };
                    for channel in chosen {
                        if !opts.channels.contains(&channel) {
                            opts.channels.push(channel);
                        }
                    }
                }
            }
            Long("scenario") => {
                for name in string_value(&mut parser)?.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                    let scenario = Scenario::parse(name).ok_or_else(|| {
                        let known: Vec<&str> = Scenario::ALL.iter().map(|s| s.name()).collect();
                        format!("--scenario {name:?}: known scenarios: {}", known.join(", "))
                    })?;
                    if !opts.scenarios.contains(&scenario) {
                        opts.scenarios.push(scenario);
                    }
                }
            }
            Long("orders") => {
                opts.orders = usize::try_from(int_value(&mut parser, "--orders", 1, 100_000)?).unwrap_or(1)
            }
            Long("concurrency") => {
                opts.concurrency = usize::try_from(int_value(&mut parser, "--concurrency", 2, 64)?).unwrap_or(2)
            }
            Long("time-factor") => {
                let text = string_value(&mut parser)?;
                opts.time_factor = match text.parse::<f64>() {
                    Ok(f) if f.is_finite() && (0.001..=1e9).contains(&f) => f,
                    _ => return Err(format!("--time-factor {text:?}: expected a number from 0.001 to 1e9")),
                };
            }
            Long("full-schedules") => opts.full_schedules = true,
            Short('v') | Long("verbose") => opts.verbose = true,
            Long("replay-timeout-ms") => {
                opts.replay_timeout_ms = int_value(&mut parser, "--replay-timeout-ms", 0, 60_000)?
            }
            Long("wechatpay-private-key") => opts.wechatpay_private_key = Some(string_value(&mut parser)?),
            Long("wechatpay-serial") => opts.wechatpay_serial = Some(string_value(&mut parser)?),
            Long("wechatpay-apiv3-key") => opts.wechatpay_apiv3_key = Some(string_value(&mut parser)?),
            Long("alipay-private-key") => opts.alipay_private_key = Some(string_value(&mut parser)?),
            Long("alipay-app-id") => opts.alipay_app_id = Some(string_value(&mut parser)?),
            Long("key-mode") => opts.key_mode = KeyMode::parse(&string_value(&mut parser)?)?,
            Short('h') | Long("help") => {
                print!("{USAGE}");
                return Ok(None);
            }
            other => return Err(format!("{}\n\n{USAGE}", other.unexpected())),
        }
    }
    if opts.scenarios.is_empty() {
        opts.scenarios = Scenario::ALL.to_vec();
    } else {
        opts.scenarios.sort_by_key(|s| Scenario::ALL.iter().position(|a| a == s));
    }
    if opts.channels.is_empty() {
        opts.channels = vec![Platform::Generic];
    } else {
        opts.channels.sort_by_key(|c| Platform::ALL.iter().position(|a| a == c));
    }
    Ok(Some(opts))
}

/// `S` + the time in base 36 + random characters: unique per run, short
/// enough that order_nos stay within WeChat Pay's 32 characters.
fn new_run_id() -> String {
    const DIGITS: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ";
    let base36 = |mut n: u64, width: usize| -> String {
        let mut out = Vec::new();
        while n > 0 || out.len() < width {
            out.push(DIGITS[usize::try_from(n % 36).unwrap_or(0)]);
            n /= 36;
        }
        out.reverse();
        String::from_utf8(out).unwrap_or_default()
    };
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    let mut random = [0u8; 8];
    let entropy = match getrandom::fill(&mut random) {
        Ok(()) => u64::from_le_bytes(random),
        Err(_) => u64::from(now.subsec_nanos()) ^ u64::from(std::process::id()).rotate_left(32),
    };
    let millis = u64::try_from(now.as_millis()).unwrap_or(0);
    format!("S{}{}", base36(millis, 8), base36(entropy % (36 * 36 * 36), 3))
}

fn main() -> ExitCode {
    // The in-process payonce would log every request on stderr; the table is
    // the output. Set before any thread exists.
    if std::env::var_os("PAYONCE_LOG").is_none() {
        std::env::set_var("PAYONCE_LOG", "warn");
    }
    let mut args = std::env::args_os().skip(1).peekable();
    // Any leading word used to be refused as unexpected, so no invocation
    // that worked before changes meaning.
    let result = if args.peek().is_some_and(|first| first == "platforms") {
        args.next();
        standalone::run(args)
    } else {
        run(args)
    };
    match result {
        Ok(code) => code,
        Err(message) => {
            eprintln!("payonce simulate: error: {message}");
            ExitCode::from(2)
        }
    }
}

/// Parses the flags in `args` (after the program name) and runs.
/// Exit 0 when every scenario is ok, 1 on a violation; `Err` (exit 2) on errors.
fn run(args: impl Iterator<Item = OsString>) -> Result<ExitCode, String> {
    let Some(opts) = parse_args(args)? else {
        return Ok(ExitCode::SUCCESS);
    };
    let started = Instant::now();
    let keys = platform_keys(&opts, opts.target.is_none())?;
    let keys_s = started.elapsed().as_secs_f64();
    if let Some(wx) = keys.wechatpay.as_ref().filter(|k| k.certificate) {
        eprintln!(
            "WeChat Pay signs with the platform certificate {}; payonce holds no key for it and downloads it (--wechatpay-platform-certs auto)",
            wx.serial
        );
    }
    let (target, local, rewards) = match &opts.target {
        Some(url) => {
            let token = match opts.api_token.as_deref().and_then(first_secret) {
                Some(entry) => Some(ApiToken::parse(&entry).ok_or("--api-token: not a valid token")?.token),
                None => None,
            };
            (Target::parse(url, token)?, None, RewardRule::Unknown)
        }
        None => {
            // Its warnings each shown once, their repeats counted after the table.
            payonce_log::aggregate();
            let local = LocalServer::start(&keys)?;
            if let (KeyMode::Certificate, Some(ali)) = (keys.key_mode, &keys.alipay) {
                let sns = &local::alipay_setup(ali)?.certs.sns;
                eprintln!(
                    "alipay: certificate mode: payonce holds the app, Alipay public and root certificate files; \
                     app_cert_sn {}, alipay_root_cert_sn {}, alipay_cert_sn {}",
                    sns.app_cert_sn, sns.alipay_root_cert_sn, sns.alipay_cert_sn
                );
            }
            let rewards = Rewards { coupon_templates: vec![SIM_COUPON.into()], points_per_yuan: SIM_POINTS_PER_YUAN };
            (Target::local(local.addr), Some(local), RewardRule::Known(rewards))
        }
    };
    let progress = Progress::new(opts.orders >= 50 || std::io::stderr().is_terminal());
    if keys_s >= 0.1 {
        eprintln!("platform keys ready in {keys_s:.1} s");
    }
    let first = opts.channels.first().copied().unwrap_or(Platform::Generic);
    let sim = Sim {
        target: Arc::new(target),
        keys: Arc::new(keys),
        channel: first,
        partner: first,
        run_id: new_run_id(),
        orders: opts.orders,
        concurrency: opts.concurrency,
        time_factor: opts.time_factor,
        full_schedules: opts.full_schedules,
        replay_timeout_ms: opts.replay_timeout_ms,
        verbose: opts.verbose,
        progress,
    };
    let result = scenarios::simulate(&sim, &opts.channels, &opts.scenarios, &rewards, local.is_some());
    drop(local);
    alipay_certs::remove_files();
    if let Some(repeats) = payonce_log::repeats() {
        eprintln!("{repeats}");
    }
    result
}

/// Owned text, for the many string literals of expectations.
fn s(text: &str) -> String {
    text.to_owned()
}

/// Now, in Unix seconds (signatures carry it; payonce allows ±300 s).
fn now_s() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}
