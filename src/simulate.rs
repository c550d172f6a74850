//! `payonce simulate`: a payment platform played against payonce.
//!
//! The simulator creates orders, delivers signed callbacks in every
//! real-world duplicate form (concurrent duplicates, a re-delivery 40 ms
//! later, a gateway replay after a lost answer, the platforms' retry
//! schedules, two payments of one order, a payment after close, a refund
//! and its duplicate, a triple-clicked order creation), then reads the
//! results back through payonce's own read API and judges them:
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
//! Signing is per [`Channel`]: payonce's generic HMAC format, WeChat Pay v3
//! (SHA256-RSA over `"{ts}\n{nonce}\n{body}\n"`, an AES-256-GCM resource)
//! and Alipay (RSA2 form notices). A real platform is one more variant and
//! one more arm in [`Channel::sign_payment`], [`Channel::sign_refund`] and
//! [`Channel::answer`]. The platforms' protocols carry no outcome (WeChat
//! answers 204, Alipay `success`): for them an answer only says "processed",
//! and the outcome is judged from the read API alone, the same as always.

use crate::app::{ApiToken, Config};
use crate::channel::alipay::AlipayConfig;
use crate::channel::wechatpay::{WechatpayConfig, APIV3_KEY_BYTES};
use crate::clock::Clock;
use crate::domain::Rewards;
use crate::http::{Server, WORKERS_DEFAULT};
use crate::App;
use aes_gcm::aead::{Aead, Payload};
use aes_gcm::{Aes256Gcm, KeyInit, Nonce};
use base64::Engine;
use parking_lot::{Condvar, Mutex};
use rsa::pkcs1v15::SigningKey;
use rsa::signature::{SignatureEncoding, Signer};
use rsa::{RsaPrivateKey, RsaPublicKey};
use serde_json::{json, Value};
use sha2::Sha256;
use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::ffi::OsString;
use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub const USAGE: &str = "\
Usage: payonce simulate [--target URL] [--channel NAME] [options]

Plays a payment platform against payonce and checks that every payment took
effect exactly once. Without --target it starts its own payonce in this
process (in-memory database; coupon template SIM-COUPON and 1 point per yuan
on payment; every channel configured with keys made for this run) and talks
to it over HTTP on loopback. Each scenario creates its own orders (order_nos
prefixed with a fresh run id, so reruns against one server never collide),
delivers signed callbacks, then reads the results back (GET /v1/orders/{no},
/v1/events, /v1/inspections) and prints a table on stdout: scenario, channel
(with several), deliveries sent (and what payonce answered), effects expected,
effects observed, verdict. Exit status 0 when every scenario is ok, 1 on any
violation, 2 on an error (e.g. the target is unreachable, a key is refused).

Scenarios (default: all, in this order):
  concurrent           K deliveries of one pay_no at the same moment (--concurrency)
  redelivery_40ms      the same callback again 40 ms after the first (the incident)
  gateway_replay       the first answer is lost (the client times out) and the
                       callback is re-sent on a new connection
  retry_schedule       WeChat Pay's (15s 15s 30s 3m 10m 20m 30m 30m 30m 1h 3h 3h 3h
                       6h 6h) and Alipay's (4m 10m 10m 1h 2h 6h 15h) retry schedules,
                       every answer treated as lost so the whole schedule is
                       delivered; compressed by --time-factor. Each platform
                       channel plays its own; generic alternates the two
  two_channels         two pay_nos for one order at once: one applied, one
                       already_paid (+ payment.refund_required); with several
                       channels selected the second goes through the next one
  payment_after_close  the order is closed, then paid: paid_after_close
  refund               pay, request the refund twice, deliver its SUCCESS twice
  triple_click         three concurrent POST /v1/orders with one order_no

Channels (--channel; default generic):
  generic    payonce's own JSON + Payonce-Signature (HMAC-SHA256); payonce
             answers the outcome (applied, duplicate, ...)
  wechatpay  WeChat Pay v3: TRANSACTION.SUCCESS (transaction_id = pay_no) to
             /v1/callbacks/wechatpay, REFUND.SUCCESS to .../wechatpay/refund,
             SHA256-RSA signed, resource AES-256-GCM-encrypted with the APIv3
             key; payonce answers 204 (shown as `processed`)
  alipay     Alipay RSA2 form notices to /v1/callbacks/alipay: TRADE_SUCCESS
             (re-deliveries alternate with TRADE_FINISHED, which must be the
             same payment), amounts as yuan strings; refunds as TRADE_SUCCESS
             with refund_fee and out_biz_no = refund_no; payonce answers the
             text `success` (shown as `processed`)
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
                          plays the full 24-hour schedules in about 90 s]
  --replay-timeout-ms MS  how long gateway_replay's first attempt waits for the
                          answer before the gateway gives up [default: 0: it gives
                          up at once, so that answer is always lost; with MS > 0
                          a fast payonce may answer in time]
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

/// The coupon template and points rate of the in-process payonce.
pub const SIM_COUPON: &str = "SIM-COUPON";
pub const SIM_POINTS_PER_YUAN: i64 = 1;

/// WeChat Pay's notification retry intervals after the first delivery, in seconds.
pub const WECHATPAY_RETRY_S: [u64; 15] =
    [15, 15, 30, 180, 600, 1_200, 1_800, 1_800, 1_800, 3_600, 10_800, 10_800, 10_800, 21_600, 21_600];
/// Alipay's asynchronous-notification retry intervals, in seconds.
pub const ALIPAY_RETRY_S: [u64; 7] = [240, 600, 600, 3_600, 7_200, 21_600, 54_000];

/// The gap of the incident's re-delivery.
const REDELIVERY_GAP: Duration = Duration::from_millis(40);
/// Connections that run orders side by side (the server has 16 workers).
const WORKERS: usize = 8;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const IO_TIMEOUT: Duration = Duration::from_secs(30);
const RESPONSE_BYTES_MAX: usize = 64 << 20;
const HEADER_LINE_BYTES_MAX: u64 = 16 * 1024;
/// How often a 503 `database_busy` is retried (after its Retry-After), as a platform would.
const BUSY_RETRIES: u32 = 5;
/// At most this many violation lines are printed per scenario.
const DETAILS_MAX: usize = 20;

/// The serial of the in-process payonce's WeChat Pay platform key.
pub const SIM_WECHATPAY_SERIAL: &str = "PUB_KEY_ID_SIMULATOR";
/// The Alipay app_id of the in-process payonce.
pub const SIM_ALIPAY_APP_ID: &str = "2021000000000000";
/// Modulus size of the in-process run's throwaway platform keys. Release
/// builds use the platforms' 2048 bits (keygen measured 0.14-0.5 s a key,
/// a signature 1.7 ms). Unoptimised debug builds (the test suite) take 2-13 s
/// per 2048-bit key and 40 ms per signature, so they use 1024 bits (about
/// 1.2 s, 8 ms): these keys never leave the process and live for one run;
/// nothing verifies differently at 1024 bits.
const SIM_RSA_BITS: usize = if cfg!(debug_assertions) { 1024 } else { 2048 };
/// How a platform's success answer (WeChat 204, Alipay `success`) is shown:
/// the protocol says the notice was processed, not with which outcome.
pub const PROCESSED: &str = "processed";

// ---------------------------------------------------------------- scenarios

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    Concurrent,
    Redelivery40ms,
    GatewayReplay,
    RetrySchedule,
    TwoChannels,
    PaymentAfterClose,
    Refund,
    TripleClick,
}

impl Scenario {
    pub const ALL: [Scenario; 8] = [
        Scenario::Concurrent,
        Scenario::Redelivery40ms,
        Scenario::GatewayReplay,
        Scenario::RetrySchedule,
        Scenario::TwoChannels,
        Scenario::PaymentAfterClose,
        Scenario::Refund,
        Scenario::TripleClick,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scenario::Concurrent => "concurrent",
            Scenario::Redelivery40ms => "redelivery_40ms",
            Scenario::GatewayReplay => "gateway_replay",
            Scenario::RetrySchedule => "retry_schedule",
            Scenario::TwoChannels => "two_channels",
            Scenario::PaymentAfterClose => "payment_after_close",
            Scenario::Refund => "refund",
            Scenario::TripleClick => "triple_click",
        }
    }

    /// Two letters in order_nos, so an operator sees which scenario made an order.
    fn tag(self) -> &'static str {
        match self {
            Scenario::Concurrent => "cc",
            Scenario::Redelivery40ms => "rd",
            Scenario::GatewayReplay => "gr",
            Scenario::RetrySchedule => "rs",
            Scenario::TwoChannels => "tc",
            Scenario::PaymentAfterClose => "pc",
            Scenario::Refund => "rf",
            Scenario::TripleClick => "tk",
        }
    }

    pub fn parse(text: &str) -> Option<Scenario> {
        Scenario::ALL.into_iter().find(|s| s.name() == text)
    }
}

// ---------------------------------------------------------------- channels

/// A payment channel the simulator can sign for. A real platform is one
/// more variant here and one more arm in each `match` of this `impl`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Channel {
    Generic,
    Wechatpay,
    Alipay,
}

impl Channel {
    pub const ALL: [Channel; 3] = [Channel::Generic, Channel::Wechatpay, Channel::Alipay];

    pub fn name(self) -> &'static str {
        match self {
            Channel::Generic => "generic",
            Channel::Wechatpay => "wechatpay",
            Channel::Alipay => "alipay",
        }
    }

    /// One letter in order_nos, so runs of several channels never share an order.
    fn tag(self) -> &'static str {
        match self {
            Channel::Generic => "g",
            Channel::Wechatpay => "w",
            Channel::Alipay => "a",
        }
    }

    pub fn parse(text: &str) -> Option<Channel> {
        Channel::ALL.into_iter().find(|c| c.name() == text)
    }

    /// The answer label a delivery with payonce outcome `outcome` must get:
    /// the outcome itself where the protocol carries it (generic), else
    /// [`PROCESSED`].
    pub fn label(self, outcome: &str) -> String {
        match self {
            Channel::Generic => outcome.to_owned(),
            Channel::Wechatpay | Channel::Alipay => PROCESSED.to_owned(),
        }
    }

    /// The signed HTTP request of a payment notification. `Err` when the
    /// simulator holds no keys for this channel (a setup error).
    pub fn sign_payment(self, keys: &Keys, notice: &PaymentNotice, now_s: i64) -> Result<Signed, String> {
        match self {
            Channel::Generic => {
                let body = json!({
                    "pay_no": notice.pay_no, "order_no": notice.order_no, "amount": notice.amount,
                    "status": if notice.success { "SUCCESS" } else { "FAILED" },
                });
                generic_signed("/v1/callbacks/generic", keys.generic_secret()?, body, now_s)
            }
            Channel::Wechatpay => {
                let keys = keys.wechatpay()?;
                // WeChat Pay notifies successful payments only; a failed one is
                // signed all the same (any TRANSACTION.* with its trade_state).
                let (event, state, summary) = match notice.success {
                    true => ("TRANSACTION.SUCCESS", "SUCCESS", "支付成功"),
                    false => ("TRANSACTION.PAYERROR", "PAYERROR", "支付失败"),
                };
                let mut plain = json!({
                    "mchid": WECHATPAY_MCHID,
                    "appid": WECHATPAY_APPID,
                    "out_trade_no": notice.order_no,
                    "transaction_id": notice.pay_no,
                    "trade_type": "JSAPI",
                    "trade_state": state,
                    "trade_state_desc": summary,
                    "bank_type": "OTHERS",
                    "attach": "",
                    "payer": {"openid": "oSimulatorPayonceBuyer0000000"},
                    "amount": {"total": notice.amount, "payer_total": notice.amount,
                               "currency": "CNY", "payer_currency": "CNY"},
                });
                if notice.success {
                    plain["success_time"] = Value::String(china_time(now_s).rfc3339());
                }
                wechatpay_signed(keys, "/v1/callbacks/wechatpay", event, summary, "transaction", &plain, now_s)
            }
            Channel::Alipay => {
                let keys = keys.alipay()?;
                let yuan = fen_to_yuan(notice.amount);
                // Re-deliveries alternate TRADE_SUCCESS and TRADE_FINISHED:
                // Alipay may send either first, and both are one payment.
                let status = match (notice.success, notice.attempt % 2) {
                    (true, 0) => "TRADE_SUCCESS",
                    (true, _) => "TRADE_FINISHED",
                    // An unpaid trade's notice: payonce acknowledges and ignores it.
                    (false, _) => "TRADE_CLOSED",
                };
                let mut form = alipay_form(keys, &notice.pay_no, &notice.order_no, &yuan, status, now_s)?;
                if notice.success {
                    form.push(("gmt_payment".into(), china_time(now_s).plain()));
                }
                alipay_signed(keys, form)
            }
        }
    }

    /// The signed HTTP request of a refund result.
    pub fn sign_refund(self, keys: &Keys, notice: &RefundNotice, now_s: i64) -> Result<Signed, String> {
        match self {
            Channel::Generic => {
                let body = json!({
                    "refund_no": notice.refund_no, "order_no": notice.order_no,
                    "status": if notice.success { "SUCCESS" } else { "FAILED" },
                });
                generic_signed("/v1/callbacks/generic/refund", keys.generic_secret()?, body, now_s)
            }
            Channel::Wechatpay => {
                let keys = keys.wechatpay()?;
                let (event, status, summary) = match notice.success {
                    true => ("REFUND.SUCCESS", "SUCCESS", "退款成功"),
                    false => ("REFUND.ABNORMAL", "ABNORMAL", "退款异常"),
                };
                let mut plain = json!({
                    "mchid": WECHATPAY_MCHID,
                    "out_trade_no": notice.order_no,
                    "transaction_id": notice.pay_no,
                    "out_refund_no": notice.refund_no,
                    "refund_id": format!("50{}", random_digits(27)?),
                    "refund_status": status,
                    "user_received_account": "支付用户零钱",
                    "amount": {"total": notice.amount, "refund": notice.amount,
                               "payer_total": notice.amount, "payer_refund": notice.amount},
                });
                if notice.success {
                    plain["success_time"] = Value::String(china_time(now_s).rfc3339());
                }
                wechatpay_signed(keys, "/v1/callbacks/wechatpay/refund", event, summary, "refund", &plain, now_s)
            }
            Channel::Alipay => {
                let keys = keys.alipay()?;
                if !notice.success {
                    return Err("Alipay sends no notice of a failed refund".into());
                }
                let yuan = fen_to_yuan(notice.amount);
                let mut form = alipay_form(keys, &notice.pay_no, &notice.order_no, &yuan, "TRADE_SUCCESS", now_s)?;
                form.push(("refund_fee".into(), yuan));
                form.push(("out_biz_no".into(), notice.refund_no.clone()));
                form.push(("gmt_refund".into(), format!("{}.000", china_time(now_s).plain())));
                alipay_signed(keys, form)
            }
        }
    }

    /// What payonce's answer, in the channel's protocol, says happened: the
    /// outcome (generic) or [`PROCESSED`] (the platforms), an unexpected
    /// answer as `HTTP <status> <code>`, or `Err` when the answer shows the
    /// simulator is set up wrong (signature or key refused, channel not
    /// configured).
    pub fn answer(self, reply: &Reply) -> Result<String, String> {
        if reply.status == 404 && reply.error_code() == "channel_not_configured" {
            return Err(format!("the target has no {} channel configured", self.name()));
        }
        match self {
            Channel::Generic => {
                let body = reply.json();
                match (reply.status, body["outcome"].as_str()) {
                    (200, Some(outcome)) => Ok(outcome.to_owned()),
                    (401, _) => Err(format!(
                        "payonce refused the callback signature ({}): is the callback secret right, and are the clocks within 300 s?",
                        reply.error_code()
                    )),
                    _ => Ok(reply.summary()),
                }
            }
            Channel::Wechatpay => {
                let body = reply.json();
                let message = body["message"].as_str().unwrap_or("");
                match reply.status {
                    // WeChat Pay takes 200 or 204 as success; payonce answers 204.
                    200 | 204 => Ok(PROCESSED.to_owned()),
                    401 => Err(format!(
                        "payonce refused the WeChat Pay signature ({message}): do --wechatpay-private-key and \
                         --wechatpay-serial match a key the target has, and are the clocks within 300 s?"
                    )),
                    400 if message.contains("APIv3 key") => {
                        Err(format!("payonce cannot decrypt the resource ({message}): is --wechatpay-apiv3-key right?"))
                    }
                    status => Ok(format!("HTTP {status} {}", body["code"].as_str().unwrap_or("-"))),
                }
            }
            Channel::Alipay => {
                let text = String::from_utf8_lossy(&reply.body);
                let text = text.trim();
                match reply.status {
                    200 if text == "success" => Ok(PROCESSED.to_owned()),
                    401 => Err("payonce refused the Alipay notice's sign or app_id: do --alipay-private-key and \
                         --alipay-app-id match the target's --alipay-public-key and --alipay-app-id?"
                        .into()),
                    status => Ok(format!("HTTP {status} {}", text.chars().take(40).collect::<String>())),
                }
            }
        }
    }
}

/// The simulated merchant's WeChat Pay mchid and appid (payonce reads neither).
const WECHATPAY_MCHID: &str = "1900000100";
const WECHATPAY_APPID: &str = "wxsimulatorpayonce";

/// What the simulator signs with; each channel takes what it needs.
#[derive(Clone, Debug, Default)]
pub struct Keys {
    /// Empty: no generic channel.
    pub generic_secret: Vec<u8>,
    pub wechatpay: Option<WechatpayKeys>,
    pub alipay: Option<AlipayKeys>,
}

impl Keys {
    fn generic_secret(&self) -> Result<&[u8], String> {
        match self.generic_secret.as_slice() {
            [] => Err("no generic callback secret (--callback-secret)".into()),
            secret => Ok(secret),
        }
    }

    fn wechatpay(&self) -> Result<&WechatpayKeys, String> {
        self.wechatpay.as_ref().ok_or_else(|| s("no WeChat Pay keys (--wechatpay-private-key ...)"))
    }

    fn alipay(&self) -> Result<&AlipayKeys, String> {
        self.alipay.as_ref().ok_or_else(|| s("no Alipay keys (--alipay-private-key ...)"))
    }
}

/// The WeChat Pay platform's side: its signing key (and the serial payonce
/// knows the public half by) and the merchant's APIv3 key.
#[derive(Clone, Debug)]
pub struct WechatpayKeys {
    pub signing_key: SigningKey<Sha256>,
    pub serial: String,
    /// 32 bytes.
    pub apiv3_key: Vec<u8>,
}

/// The Alipay platform's signing key, and the merchant's app_id.
#[derive(Clone, Debug)]
pub struct AlipayKeys {
    pub signing_key: SigningKey<Sha256>,
    pub app_id: String,
}

#[derive(Clone, Debug)]
pub struct PaymentNotice {
    pub pay_no: String,
    pub order_no: String,
    pub amount: i64,
    pub success: bool,
    /// Which delivery of this payment this is (0: the first). Alipay
    /// alternates TRADE_SUCCESS and TRADE_FINISHED over deliveries.
    pub attempt: usize,
}

#[derive(Clone, Debug)]
pub struct RefundNotice {
    pub refund_no: String,
    pub order_no: String,
    /// The refunded payment (WeChat's transaction_id, Alipay's trade_no).
    pub pay_no: String,
    /// Fen, refunded in full.
    pub amount: i64,
    pub success: bool,
}

/// A signed notification, ready to POST.
#[derive(Clone, Debug)]
pub struct Signed {
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

fn generic_signed(path: &str, secret: &[u8], body: Value, now_s: i64) -> Result<Signed, String> {
    let body = body.to_string().into_bytes();
    let signature = crate::signature::sign(secret, now_s, &body);
    Ok(Signed {
        path: path.to_owned(),
        headers: vec![("Content-Type".into(), "application/json".into()), ("Payonce-Signature".into(), signature)],
        body,
    })
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// SHA256withRSA (PKCS#1 v1.5), base64.
fn rsa_sign(key: &SigningKey<Sha256>, message: &[u8]) -> Result<String, String> {
    let signature = key.try_sign(message).map_err(|e| format!("RSA signing failed: {e}"))?;
    Ok(b64(&signature.to_bytes()))
}

/// A WeChat Pay v3 notification: the envelope with `plain` encrypted as its
/// AEAD_AES_256_GCM `resource` (a fresh 12-character nonce, associated data
/// = `original_type`), signed over `"{timestamp}\n{nonce}\n{body}\n"`.
fn wechatpay_signed(
    keys: &WechatpayKeys,
    path: &str,
    event_type: &str,
    summary: &str,
    original_type: &str,
    plain: &Value,
    now_s: i64,
) -> Result<Signed, String> {
    let resource_nonce = random_text(12)?;
    let cipher = Aes256Gcm::new_from_slice(&keys.apiv3_key)
        .map_err(|_| format!("the WeChat Pay APIv3 key must be {APIV3_KEY_BYTES} bytes"))?;
    let plaintext = plain.to_string();
    let ciphertext = cipher
        .encrypt(
            Nonce::from_slice(resource_nonce.as_bytes()),
            Payload { msg: plaintext.as_bytes(), aad: original_type.as_bytes() },
        )
        .map_err(|_| s("AES-256-GCM encryption failed"))?;
    let envelope = json!({
        "id": format!("EV-{}", random_digits(24)?),
        "create_time": china_time(now_s).rfc3339(),
        "resource_type": "encrypt-resource",
        "event_type": event_type,
        "summary": summary,
        "resource": {
            "original_type": original_type,
            "algorithm": "AEAD_AES_256_GCM",
            "ciphertext": b64(&ciphertext),
            "associated_data": original_type,
            "nonce": resource_nonce,
        },
    });
    let body = envelope.to_string().into_bytes();
    let timestamp = now_s.to_string();
    let nonce = random_text(32)?;
    let mut message = format!("{timestamp}\n{nonce}\n").into_bytes();
    message.extend_from_slice(&body);
    message.push(b'\n');
    let signature = rsa_sign(&keys.signing_key, &message)?;
    Ok(Signed {
        path: path.to_owned(),
        headers: vec![
            ("Content-Type".into(), "application/json".into()),
            ("Wechatpay-Serial".into(), keys.serial.clone()),
            ("Wechatpay-Timestamp".into(), timestamp),
            ("Wechatpay-Nonce".into(), nonce),
            ("Wechatpay-Signature".into(), signature),
            ("Wechatpay-Signature-Type".into(), "WECHATPAY2-SHA256-RSA2048".into()),
        ],
        body,
    })
}

/// The fields every Alipay trade notice carries (utf-8; unsigned).
fn alipay_form(
    keys: &AlipayKeys,
    trade_no: &str,
    order_no: &str,
    yuan: &str,
    trade_status: &str,
    now_s: i64,
) -> Result<Vec<(String, String)>, String> {
    let now = china_time(now_s).plain();
    let notify_id = random_text(34)?;
    let pairs = [
        ("notify_time", now.as_str()),
        ("notify_type", "trade_status_sync"),
        ("notify_id", notify_id.as_str()),
        ("charset", "utf-8"),
        ("version", "1.0"),
        ("sign_type", "RSA2"),
        ("app_id", keys.app_id.as_str()),
        ("auth_app_id", keys.app_id.as_str()),
        ("trade_no", trade_no),
        ("out_trade_no", order_no),
        ("trade_status", trade_status),
        ("total_amount", yuan),
        ("receipt_amount", yuan),
        ("invoice_amount", yuan),
        ("buyer_pay_amount", yuan),
        ("point_amount", "0.00"),
        ("subject", "payonce simulate 模拟订单"),
        ("gmt_create", now.as_str()),
        ("buyer_id", "2088000000000000"),
        ("seller_id", "2088000000000001"),
    ];
    Ok(pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect())
}

/// Signs an Alipay form (RSA2 over the sorted non-empty `k=v&...` of every
/// field but sign and sign_type, utf-8) and URL-encodes it.
fn alipay_signed(keys: &AlipayKeys, mut form: Vec<(String, String)>) -> Result<Signed, String> {
    let mut signed: Vec<&(String, String)> =
        form.iter().filter(|(k, v)| !v.is_empty() && k != "sign" && k != "sign_type").collect();
    signed.sort();
    let content = signed.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&");
    let sign = rsa_sign(&keys.signing_key, content.as_bytes())?;
    form.push(("sign".into(), sign));
    let body = form.iter().map(|(k, v)| format!("{k}={}", form_encode(v))).collect::<Vec<_>>().join("&");
    Ok(Signed {
        path: "/v1/callbacks/alipay".into(),
        headers: vec![("Content-Type".into(), "application/x-www-form-urlencoded; charset=utf-8".into())],
        body: body.into_bytes(),
    })
}

/// URL-encoding as Java's URLEncoder does it (Alipay's servers are Java):
/// `A-Za-z0-9-_.*` as they are, space as `+`, every other byte `%XX`.
fn form_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'*' => out.push(char::from(b)),
            b' ' => out.push('+'),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// Fen as Alipay's yuan string, exactly: 9900 → `99.00`, 5 → `0.05`.
pub fn fen_to_yuan(fen: i64) -> String {
    let sign = if fen < 0 { "-" } else { "" };
    let abs = fen.unsigned_abs();
    format!("{sign}{}.{:02}", abs / 100, abs % 100)
}

/// A wall-clock time in China Standard Time (UTC+8), the platforms' clock.
struct ChinaTime {
    date: String,
    time: String,
}

impl ChinaTime {
    /// `2023-11-15T06:13:20+08:00` (WeChat Pay).
    fn rfc3339(&self) -> String {
        format!("{}T{}+08:00", self.date, self.time)
    }

    /// `2023-11-15 06:13:20` (Alipay).
    fn plain(&self) -> String {
        format!("{} {}", self.date, self.time)
    }
}

fn china_time(now_s: i64) -> ChinaTime {
    let local = time::OffsetDateTime::from_unix_timestamp(now_s.saturating_add(8 * 3600))
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    ChinaTime {
        date: format!("{:04}-{:02}-{:02}", local.year(), u8::from(local.month()), local.day()),
        time: format!("{:02}:{:02}:{:02}", local.hour(), local.minute(), local.second()),
    }
}

fn random_bytes(n: usize) -> Result<Vec<u8>, String> {
    let mut bytes = vec![0u8; n];
    getrandom::fill(&mut bytes).map_err(|e| format!("no randomness from the OS: {e}"))?;
    Ok(bytes)
}

/// `n` random characters of `[A-Za-z0-9]` (nonces, the in-process APIv3 key).
fn random_text(n: usize) -> Result<String, String> {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    Ok(random_bytes(n)?.iter().map(|b| char::from(ALPHABET[usize::from(*b) % ALPHABET.len()])).collect())
}

fn random_digits(n: usize) -> Result<String, String> {
    Ok(random_bytes(n)?.iter().map(|b| char::from(b'0' + b % 10)).collect())
}

// ---------------------------------------------------------------- judging

/// What the simulator knows about the rewards a payment earns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RewardRule {
    /// The in-process payonce: exact counts are expected.
    Known(Rewards),
    /// An external target: only "at most once" can be judged here; payonce's
    /// inspection (`paid_without_rewards`) witnesses missing rewards.
    Unknown,
}

/// What must be true of one order at the end of its scenario.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OrderExpect {
    pub status: String,
    /// Every answer payonce must give, as a multiset (`applied`, `duplicate`,
    /// `refund applied`, `api:create 201 PENDING`, ...). Labels starting with
    /// `api:` are the order API's answers; the rest are shown as deliveries.
    pub answers: Vec<String>,
    /// The outcomes of the order's `pay_callback_log` rows, as a multiset.
    pub payments: Vec<String>,
    /// Rewards were earned (one applied payment).
    pub paid: bool,
    /// Refunded: coupons FROZEN, points reversed.
    pub refunded: bool,
    /// Exact count of each event type for the order; types not listed: none.
    pub events: Vec<(String, usize)>,
    /// Exact count of each inspection finding kind; kinds not listed: none.
    pub findings: Vec<(String, usize)>,
    /// How many orders the order's user must have (triple_click).
    pub orders_of_user: Option<usize>,
    /// The pay_no the order must be paid by, when an answer said which one
    /// won (two_channels).
    pub pay_no: Option<String>,
}

/// One payment row as `GET /v1/orders/{order_no}` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeenPayment {
    pub pay_no: String,
    pub outcome: String,
    pub state: String,
}

/// What the simulator saw of one order: the answers to its deliveries and
/// the read API's view afterwards.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OrderSeen {
    pub order_no: String,
    pub amount: i64,
    /// `None`: the order does not exist (404).
    pub status: Option<String>,
    pub pay_no: Option<String>,
    pub payments: Vec<SeenPayment>,
    /// (coupon_template_id, status)
    pub coupons: Vec<(String, String)>,
    /// (point_type, points)
    pub points: Vec<(String, i64)>,
    pub events: BTreeMap<String, usize>,
    pub findings: BTreeMap<String, usize>,
    pub answers: Vec<String>,
    /// Answers the simulator never received (the gateway timed out).
    pub lost: usize,
    pub orders_of_user: Option<usize>,
}

/// Every way `seen` breaks `expect`; empty means exactly once, as promised.
pub fn judge(expect: &OrderExpect, rewards: &RewardRule, seen: &OrderSeen) -> Vec<String> {
    let mut bad = Vec::new();
    // Answers: nothing unexpected; whatever is missing was lost in transit.
    let (missing, extra) = multiset_diff(&expect.answers, &seen.answers);
    if !extra.is_empty() {
        bad.push(format!("answered {} (expected {})", counted(&extra), counted(&multiset(&expect.answers))));
    }
    let missing_n: usize = missing.iter().map(|(_, n)| n).sum();
    if missing_n != seen.lost {
        bad.push(format!("{} answer(s) not seen ({}) but {} lost in transit", missing_n, counted(&missing), seen.lost));
    }
    let Some(status) = &seen.status else {
        bad.push("the order does not exist".into());
        return bad;
    };
    if *status != expect.status {
        bad.push(format!("status {status}, expected {}", expect.status));
    }
    // Payments: one row per pay_no, with the prescribed outcomes, decided.
    let mut rows_per_pay_no: BTreeMap<&str, usize> = BTreeMap::new();
    for p in &seen.payments {
        *rows_per_pay_no.entry(p.pay_no.as_str()).or_default() += 1;
        if p.state != "decided" {
            bad.push(format!("payment {} is in state {}, not decided", p.pay_no, p.state));
        }
    }
    for (pay_no, n) in rows_per_pay_no.iter().filter(|(_, n)| **n > 1) {
        bad.push(format!("pay_no {pay_no} has {n} payment rows"));
    }
    let outcomes: Vec<String> = seen.payments.iter().map(|p| p.outcome.clone()).collect();
    let (missing, extra) = multiset_diff(&expect.payments, &outcomes);
    if !missing.is_empty() || !extra.is_empty() {
        bad.push(format!(
            "payment rows {}, expected {}",
            counted(&multiset(&outcomes)),
            counted(&multiset(&expect.payments))
        ));
    }
    if expect.paid {
        let applied: Vec<&SeenPayment> = seen.payments.iter().filter(|p| p.outcome == "applied").collect();
        if let [one] = applied.as_slice() {
            if seen.pay_no.as_deref() != Some(one.pay_no.as_str()) {
                bad.push(format!("order pay_no {:?} is not the applied payment {}", seen.pay_no, one.pay_no));
            }
        }
    }
    judge_coupons(expect, rewards, seen, &mut bad);
    judge_points(expect, rewards, seen, &mut bad);
    exact_counts("event", &expect.events, &seen.events, &mut bad);
    exact_counts("inspection finding", &expect.findings, &seen.findings, &mut bad);
    if let Some(want) = &expect.pay_no {
        if seen.pay_no.as_ref() != Some(want) {
            bad.push(format!("order pay_no {:?}, but the answers said {want} won", seen.pay_no));
        }
    }
    if let Some(want) = expect.orders_of_user {
        if seen.orders_of_user != Some(want) {
            bad.push(format!("the user has {:?} orders, expected {want}", seen.orders_of_user));
        }
    }
    bad
}

fn judge_coupons(expect: &OrderExpect, rewards: &RewardRule, seen: &OrderSeen, bad: &mut Vec<String>) {
    let mut per_template: BTreeMap<&str, usize> = BTreeMap::new();
    for (template, _) in &seen.coupons {
        *per_template.entry(template.as_str()).or_default() += 1;
    }
    for (template, n) in per_template.iter().filter(|(_, n)| **n > 1) {
        bad.push(format!("{n} coupons of template {template} (at most 1 per order)"));
    }
    match rewards {
        RewardRule::Known(rules) if expect.paid => {
            let want: Vec<&str> = rules.coupon_templates.iter().map(String::as_str).collect();
            let have: Vec<&str> = per_template.keys().copied().collect();
            let mut want_sorted = want.clone();
            want_sorted.sort_unstable();
            if have != want_sorted {
                bad.push(format!("coupon templates {have:?}, expected {want_sorted:?}"));
            }
        }
        _ if !expect.paid && !seen.coupons.is_empty() => {
            bad.push(format!("{} coupon(s) on an order that earned none", seen.coupons.len()));
        }
        _ => {}
    }
    let want_status = if expect.refunded { "FROZEN" } else { "ACTIVE" };
    for (template, status) in seen.coupons.iter().filter(|(_, s)| s != want_status) {
        bad.push(format!("coupon {template} is {status}, expected {want_status}"));
    }
}

fn judge_points(expect: &OrderExpect, rewards: &RewardRule, seen: &OrderSeen, bad: &mut Vec<String>) {
    let paid: Vec<i64> = seen.points.iter().filter(|(t, _)| t == "ORDER_PAID").map(|(_, p)| *p).collect();
    let reversed: Vec<i64> = seen.points.iter().filter(|(t, _)| t == "ORDER_PAID_REVERSAL").map(|(_, p)| *p).collect();
    for (point_type, _) in seen.points.iter().filter(|(t, _)| t != "ORDER_PAID" && t != "ORDER_PAID_REVERSAL") {
        bad.push(format!("unexpected points entry of type {point_type}"));
    }
    if paid.len() > 1 {
        bad.push(format!("{} ORDER_PAID points entries (at most 1 per order)", paid.len()));
    }
    if reversed.len() > 1 {
        bad.push(format!("{} ORDER_PAID_REVERSAL points entries (at most 1 per order)", reversed.len()));
    }
    match rewards {
        RewardRule::Known(rules) => {
            let due = if expect.paid { rules.points_for(seen.amount) } else { 0 };
            let want: Vec<i64> = if due > 0 { vec![due] } else { vec![] };
            if paid != want {
                bad.push(format!("ORDER_PAID points {paid:?}, expected {want:?}"));
            }
        }
        RewardRule::Unknown if !expect.paid && !paid.is_empty() => {
            bad.push("points on an order that earned none".into());
        }
        RewardRule::Unknown => {}
    }
    if expect.refunded {
        let net: i64 = paid.iter().chain(&reversed).sum();
        if reversed.len() != paid.len() || net != 0 {
            bad.push(format!("points {paid:?} reversed by {reversed:?}: expected one reversal to 0"));
        }
    } else if !reversed.is_empty() {
        bad.push(format!("points reversed by {reversed:?} without a refund"));
    }
}

fn exact_counts(what: &str, want: &[(String, usize)], have: &BTreeMap<String, usize>, bad: &mut Vec<String>) {
    let want: BTreeMap<&str, usize> = want.iter().map(|(k, n)| (k.as_str(), *n)).collect();
    let mut keys: Vec<&str> = want.keys().copied().chain(have.keys().map(String::as_str)).collect();
    keys.sort_unstable();
    keys.dedup();
    for key in keys {
        let (w, h) = (want.get(key).copied().unwrap_or(0), have.get(key).copied().unwrap_or(0));
        if w != h {
            bad.push(format!("{h} {what}(s) {key}, expected {w}"));
        }
    }
}

fn multiset(items: &[String]) -> Vec<(String, usize)> {
    let mut counts: Vec<(String, usize)> = Vec::new();
    for item in items {
        match counts.iter_mut().find(|(k, _)| k == item) {
            Some((_, n)) => *n += 1,
            None => counts.push((item.clone(), 1)),
        }
    }
    counts
}

/// (in `want` but not in `have`, in `have` but not in `want`), with counts.
/// Labels with their counts, in order of first appearance.
type Counts = Vec<(String, usize)>;

fn multiset_diff(want: &[String], have: &[String]) -> (Counts, Counts) {
    let (want, have) = (multiset(want), multiset(have));
    let count = |set: &[(String, usize)], key: &str| set.iter().find(|(k, _)| k == key).map_or(0, |(_, n)| *n);
    let missing = want
        .iter()
        .filter_map(|(k, n)| n.checked_sub(count(&have, k)).filter(|d| *d > 0).map(|d| (k.clone(), d)))
        .collect();
    let extra = have
        .iter()
        .filter_map(|(k, n)| n.checked_sub(count(&want, k)).filter(|d| *d > 0).map(|d| (k.clone(), d)))
        .collect();
    (missing, extra)
}

fn counted(items: &[(String, usize)]) -> String {
    if items.is_empty() {
        return "nothing".into();
    }
    items.iter().map(|(k, n)| format!("{n} {k}")).collect::<Vec<_>>().join(", ")
}

// ---------------------------------------------------------------- HTTP client

/// Where payonce is: a socket address, the Host header and an optional path prefix.
struct Target {
    addr: SocketAddr,
    authority: String,
    prefix: String,
    token: Option<String>,
    url: String,
}

impl Target {
    fn parse(url: &str, token: Option<String>) -> Result<Target, String> {
        let lower = url.to_ascii_lowercase();
        if lower.starts_with("https://") {
            return Err(format!(
                "--target {url}: https is not supported; point the simulator at payonce's plain-HTTP address"
            ));
        }
        let rest = if lower.starts_with("http://") { &url[7..] } else { url };
        let (authority, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        if authority.is_empty() {
            return Err(format!("--target {url:?}: expected http://HOST:PORT"));
        }
        let with_port = if authority.rsplit_once(':').is_some_and(|(_, p)| p.bytes().all(|b| b.is_ascii_digit()))
            && !authority.ends_with(']')
        {
            authority.to_owned()
        } else {
            format!("{authority}:80")
        };
        let addr = with_port
            .to_socket_addrs()
            .map_err(|e| format!("--target {url}: cannot resolve {authority}: {e}"))?
            .next()
            .ok_or_else(|| format!("--target {url}: {authority} has no address"))?;
        Ok(Target { addr, authority: authority.to_owned(), prefix: prefix.to_owned(), token, url: url.to_owned() })
    }

    fn local(addr: SocketAddr) -> Target {
        Target { addr, authority: addr.to_string(), prefix: String::new(), token: None, url: format!("http://{addr}") }
    }
}

/// One HTTP request to send.
#[derive(Clone, Debug)]
struct Req {
    method: &'static str,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Req {
    fn get(path: String) -> Req {
        Req { method: "GET", path, headers: Vec::new(), body: Vec::new() }
    }

    fn post_json(path: String, body: &Value) -> Req {
        Req {
            method: "POST",
            path,
            headers: vec![("Content-Type".into(), "application/json".into())],
            body: body.to_string().into_bytes(),
        }
    }

    fn signed(signed: Signed) -> Req {
        Req { method: "POST", path: signed.path, headers: signed.headers, body: signed.body }
    }

    fn encode(&self, target: &Target) -> Vec<u8> {
        let mut head =
            format!("{} {}{} HTTP/1.1\r\nHost: {}\r\n", self.method, target.prefix, self.path, target.authority);
        for (name, value) in &self.headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        if let Some(token) = target.token.as_deref().filter(|_| !self.path.starts_with("/v1/callbacks/")) {
            head.push_str(&format!("Authorization: Bearer {token}\r\n"));
        }
        head.push_str(&format!("Content-Length: {}\r\n\r\n", self.body.len()));
        let mut bytes = head.into_bytes();
        bytes.extend_from_slice(&self.body);
        bytes
    }
}

/// An HTTP response.
#[derive(Clone, Debug, Default)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    close: bool,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn error_code(&self) -> String {
        self.json()["error"]["code"].as_str().unwrap_or("-").to_owned()
    }

    /// `HTTP 409 invalid_transition`, for answers no scenario expects.
    fn summary(&self) -> String {
        format!("HTTP {} {}", self.status, self.error_code())
    }
}

enum RecvError {
    /// Nothing arrived: the connection was closed or failed before the first byte.
    Nothing(String),
    Timeout,
    Failed(String),
}

impl RecvError {
    fn describe(&self) -> String {
        match self {
            RecvError::Nothing(e) => format!("no answer ({e})"),
            RecvError::Timeout => "no answer within the timeout".into(),
            RecvError::Failed(e) => format!("a broken answer ({e})"),
        }
    }
}

/// A keep-alive HTTP/1.1 connection over `std::net::TcpStream`, reopened
/// when needed. `writes` counts requests written (deliveries).
struct Conn {
    target: Arc<Target>,
    stream: Option<BufReader<TcpStream>>,
    answered_on_stream: usize,
    writes: usize,
}

impl Conn {
    fn new(target: &Arc<Target>) -> Conn {
        Conn { target: Arc::clone(target), stream: None, answered_on_stream: 0, writes: 0 }
    }

    /// Opens a connection and proves it is served (`GET /healthz`) before
    /// the next one opens, so a scenario's concurrency starts on connections
    /// that are known to be live; the deliveries themselves stay as
    /// concurrent as the scenario says.
    fn open(target: &Target, read_timeout: Option<Duration>) -> Result<BufReader<TcpStream>, String> {
        static OPENING: Mutex<()> = parking_lot::const_mutex(());
        let _one_at_a_time = OPENING.lock();
        let stream = TcpStream::connect_timeout(&target.addr, CONNECT_TIMEOUT)
            .map_err(|e| format!("cannot connect to {}: {e}", target.url))?;
        let setup = stream
            .set_read_timeout(Some(IO_TIMEOUT))
            .and_then(|()| stream.set_write_timeout(Some(IO_TIMEOUT)))
            .and_then(|()| stream.set_nodelay(true));
        setup.map_err(|e| format!("cannot set up a connection to {}: {e}", target.url))?;
        let mut reader = BufReader::new(stream);
        let probe = Req::get(s("/healthz")).encode(target);
        reader.get_mut().write_all(&probe).map_err(|e| format!("cannot send to {}: {e}", target.url))?;
        let reply = read_reply(&mut reader)
            .map_err(|e| format!("GET /healthz on a new connection: {} from {}", e.describe(), target.url))?;
        if reply.close {
            return Err(format!("{} closed a keep-alive connection after GET /healthz", target.url));
        }
        if let Some(timeout) = read_timeout {
            reader
                .get_ref()
                .set_read_timeout(Some(timeout))
                .map_err(|e| format!("cannot set up a connection to {}: {e}", target.url))?;
        }
        Ok(reader)
    }

    /// Connects ahead of time, so concurrent deliveries start together.
    fn warm(&mut self) {
        if self.stream.is_none() {
            self.stream = Conn::open(&self.target, None).ok();
            self.answered_on_stream = 0;
        }
    }

    fn send(&mut self, req: &Req) -> Result<(), String> {
        if self.stream.is_none() {
            self.stream = Some(Conn::open(&self.target, None)?);
            self.answered_on_stream = 0;
        }
        let Some(stream) = self.stream.as_mut() else {
            return Err("no connection".into());
        };
        match stream.get_mut().write_all(&req.encode(&self.target)) {
            Ok(()) => {
                self.writes += 1;
                Ok(())
            }
            Err(e) => {
                self.stream = None;
                Err(format!("cannot send {} {}: {e}", req.method, req.path))
            }
        }
    }

    fn receive(&mut self) -> Result<Reply, RecvError> {
        let Some(stream) = self.stream.as_mut() else {
            return Err(RecvError::Nothing("not connected".into()));
        };
        match read_reply(stream) {
            Ok(reply) => {
                if reply.close {
                    self.stream = None;
                } else {
                    self.answered_on_stream += 1;
                }
                Ok(reply)
            }
            Err(e) => {
                self.stream = None;
                Err(e)
            }
        }
    }

    /// Sends and reads the answer. A keep-alive connection the server closed
    /// while idle is reopened once (the request is then sent again: a real
    /// delivery, counted in `writes`).
    fn request(&mut self, req: &Req) -> Result<Reply, String> {
        for attempt in 0..2 {
            let reused = self.stream.is_some() && self.answered_on_stream > 0;
            let result = match self.send(req) {
                Ok(()) => self.receive(),
                Err(e) if reused => Err(RecvError::Nothing(e)),
                Err(e) => return Err(e),
            };
            match result {
                Ok(reply) => return Ok(reply),
                Err(RecvError::Nothing(_)) if reused && attempt == 0 => {}
                Err(e) => {
                    return Err(format!("{} {}: {} from {}", req.method, req.path, e.describe(), self.target.url))
                }
            }
        }
        Err(format!("{} {}: no answer from {}", req.method, req.path, self.target.url))
    }
}

fn read_line(reader: &mut BufReader<TcpStream>, line: &mut String) -> std::io::Result<usize> {
    line.clear();
    reader.by_ref().take(HEADER_LINE_BYTES_MAX).read_line(line)
}

fn recv_error(e: std::io::Error, nothing_yet: bool) -> RecvError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => RecvError::Timeout,
        _ if nothing_yet => RecvError::Nothing(e.to_string()),
        _ => RecvError::Failed(e.to_string()),
    }
}

/// Reads one response: Content-Length or chunked bodies, or up to close.
fn read_reply(reader: &mut BufReader<TcpStream>) -> Result<Reply, RecvError> {
    let mut line = String::new();
    match read_line(reader, &mut line) {
        Ok(0) => return Err(RecvError::Nothing("connection closed".into())),
        Ok(_) => {}
        Err(e) => return Err(recv_error(e, true)),
    }
    let mut parts = line.split_whitespace();
    let version = parts.next().unwrap_or("").to_owned();
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .filter(|_| version.starts_with("HTTP/1."))
        .ok_or_else(|| RecvError::Failed(format!("not an HTTP status line: {:?}", line.trim_end())))?;
    let mut headers = Vec::new();
    loop {
        match read_line(reader, &mut line) {
            Ok(0) => return Err(RecvError::Failed("connection closed inside the headers".into())),
            Ok(_) => {}
            Err(e) => return Err(recv_error(e, false)),
        }
        let trimmed = line.trim_end_matches(['\r', '\n']);
        if trimmed.is_empty() {
            break;
        }
        if headers.len() > 200 {
            return Err(RecvError::Failed("too many headers".into()));
        }
        if let Some((name, value)) = trimmed.split_once(':') {
            headers.push((name.trim().to_owned(), value.trim().to_owned()));
        }
    }
    let mut reply = Reply { status, headers, body: Vec::new(), close: false };
    let connection = reply.header("Connection").unwrap_or("").to_ascii_lowercase();
    reply.close = connection.contains("close") || (version == "HTTP/1.0" && !connection.contains("keep-alive"));
    let chunked = reply.header("Transfer-Encoding").is_some_and(|t| t.to_ascii_lowercase().contains("chunked"));
    let length = reply.header("Content-Length").map(|v| v.parse::<usize>());
    if chunked {
        reply.body = read_chunked(reader)?;
    } else if let Some(length) = length {
        let length = length.map_err(|_| RecvError::Failed("a malformed Content-Length".into()))?;
        if length > RESPONSE_BYTES_MAX {
            return Err(RecvError::Failed(format!("a {length}-byte answer")));
        }
        reply.body = vec![0; length];
        reader.read_exact(&mut reply.body).map_err(|e| recv_error(e, false))?;
    } else if !(status == 204 || status == 304 || (100..200).contains(&status)) {
        reader
            .by_ref()
            .take(RESPONSE_BYTES_MAX as u64)
            .read_to_end(&mut reply.body)
            .map_err(|e| recv_error(e, false))?;
        reply.close = true;
    }
    Ok(reply)
}

fn read_chunked(reader: &mut BufReader<TcpStream>) -> Result<Vec<u8>, RecvError> {
    let mut body = Vec::new();
    let mut line = String::new();
    loop {
        read_line(reader, &mut line).map_err(|e| recv_error(e, false))?;
        let size_text = line.trim().split(';').next().unwrap_or("");
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| RecvError::Failed(format!("a malformed chunk size {size_text:?}")))?;
        if size == 0 {
            // Trailers, up to the empty line.
            while read_line(reader, &mut line).map_err(|e| recv_error(e, false))? > 0 && !line.trim().is_empty() {}
            return Ok(body);
        }
        if body.len() + size > RESPONSE_BYTES_MAX {
            return Err(RecvError::Failed("an oversized chunked answer".into()));
        }
        let start = body.len();
        body.resize(start + size, 0);
        reader.read_exact(&mut body[start..]).map_err(|e| recv_error(e, false))?;
        read_line(reader, &mut line).map_err(|e| recv_error(e, false))?;
    }
}

// ---------------------------------------------------------------- threads

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
fn scoped_workers(count: usize, work: impl Fn(usize) + Sync) -> Result<(), String> {
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
struct Failure {
    failed: AtomicBool,
    first: Mutex<Option<String>>,
}

impl Failure {
    fn new() -> Failure {
        Failure { failed: AtomicBool::new(false), first: Mutex::new(None) }
    }

    fn set(&self, error: String) {
        self.failed.store(true, Ordering::SeqCst);
        self.first.lock().get_or_insert(error);
    }

    fn is_set(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    fn into_result(self) -> Result<(), String> {
        self.first.into_inner().map_or(Ok(()), Err)
    }
}

/// A one-line progress bar on stderr, redrawn at most every 1%.
struct Progress {
    enabled: bool,
    state: Mutex<ProgressState>,
}

struct ProgressState {
    label: &'static str,
    done: usize,
    total: usize,
    last_percent: Option<usize>,
    drawn: bool,
}

impl Progress {
    const WIDTH: usize = 40;

    fn new(enabled: bool) -> Progress {
        Progress {
            enabled,
            state: Mutex::new(ProgressState { label: "", done: 0, total: 0, last_percent: None, drawn: false }),
        }
    }

    fn start(&self, label: &'static str, total: usize) {
        *self.state.lock() = ProgressState { label, done: 0, total, last_percent: None, drawn: false };
        self.tick_by(0);
    }

    fn tick(&self) {
        self.tick_by(1);
    }

    fn tick_by(&self, n: usize) {
        if !self.enabled {
            return;
        }
        let mut s = self.state.lock();
        s.done += n;
        let percent = (s.done.min(s.total) * 100).checked_div(s.total).unwrap_or(100);
        if s.last_percent == Some(percent) {
            return;
        }
        s.last_percent = Some(percent);
        let filled = percent * Self::WIDTH / 100;
        eprint!(
            "\r{:<20} [{}{}] {percent:>3}% {}/{} deliveries",
            s.label,
            "#".repeat(filled),
            "-".repeat(Self::WIDTH - filled),
            s.done.min(s.total),
            s.total
        );
        s.drawn = true;
    }

    fn finish(&self) {
        let mut s = self.state.lock();
        if s.drawn {
            eprintln!();
            s.drawn = false;
        }
    }
}

// ---------------------------------------------------------------- the simulator

#[derive(Clone, Debug)]
struct SimOrder {
    no: String,
    user: String,
    amount: i64,
}

/// What one delivery (with its 503 retries) came to.
struct Delivery {
    label: String,
    sends: usize,
}

/// What a scenario did to one order, and what it expects of it.
struct OrderRun {
    order: SimOrder,
    expect: OrderExpect,
    answers: Vec<String>,
    lost: usize,
    deliveries: usize,
}

struct ScenarioRun {
    scenario: Scenario,
    channel: Channel,
    orders: Vec<OrderRun>,
}

struct Sim {
    target: Arc<Target>,
    keys: Arc<Keys>,
    /// The channel every delivery goes through...
    channel: Channel,
    /// ...except two_channels' second payment, which goes through this one
    /// (the next selected channel; the same one when only one is selected).
    partner: Channel,
    run_id: String,
    orders: usize,
    concurrency: usize,
    time_factor: f64,
    replay_timeout_ms: u64,
    progress: Progress,
}

fn now_s() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

fn s(text: &str) -> String {
    text.to_owned()
}

/// The label of an order-API answer: `api:create 201 PENDING`, `api:close 409 invalid_transition`.
fn api_label(what: &str, reply: &Reply) -> String {
    let body = reply.json();
    let detail = match body["status"].as_str() {
        Some(status) if (200..300).contains(&reply.status) => status.to_owned(),
        _ => reply.error_code(),
    };
    format!("api:{what} {} {detail}", reply.status)
}

impl Sim {
    /// The same run (target, keys, run id, settings) for another channel.
    fn for_channel(&self, channel: Channel, partner: Channel) -> Sim {
        Sim {
            target: Arc::clone(&self.target),
            keys: Arc::clone(&self.keys),
            channel,
            partner,
            run_id: self.run_id.clone(),
            orders: self.orders,
            concurrency: self.concurrency,
            time_factor: self.time_factor,
            replay_timeout_ms: self.replay_timeout_ms,
            progress: Progress::new(self.progress.enabled),
        }
    }

    /// `{run_id}-{scenario}{channel}-{i}`: at most 22 characters for up to
    /// 100,000 orders, within WeChat Pay's 6-32 for out_trade_no.
    fn order(&self, scenario: Scenario, i: usize) -> SimOrder {
        let no = format!("{}-{}{}-{i}", self.run_id, scenario.tag(), self.channel.tag());
        // Not round, and at least 10 yuan, so points are never 0.
        let amount = 1_000 + i64::try_from(i % 90).unwrap_or(0) * 100 + i64::try_from(i % 7).unwrap_or(0);
        SimOrder { user: format!("{no}-u"), no, amount }
    }

    /// Payment `k` of `order`, its delivery number `attempt` (0: the first).
    fn payment(&self, order: &SimOrder, k: usize, attempt: usize) -> PaymentNotice {
        PaymentNotice {
            pay_no: format!("{}-P{k}", order.no),
            order_no: order.no.clone(),
            amount: order.amount,
            success: true,
            attempt,
        }
    }

    fn sign_payment(&self, channel: Channel, notice: &PaymentNotice) -> Result<Req, String> {
        Ok(Req::signed(channel.sign_payment(&self.keys, notice, now_s())?))
    }

    /// Sends `build()` (rebuilt each time, so signatures stay fresh) and
    /// retries a 503 after its Retry-After, as a platform would.
    fn send_retrying(
        &self,
        conn: &mut Conn,
        build: &dyn Fn() -> Result<Req, String>,
    ) -> Result<(Reply, usize), String> {
        let before = conn.writes;
        let mut tries = 0;
        loop {
            let reply = conn.request(&build()?)?;
            if reply.status == 503 && tries < BUSY_RETRIES {
                tries += 1;
                let wait_s = reply.header("Retry-After").and_then(|v| v.parse::<u64>().ok()).unwrap_or(1).clamp(1, 5);
                thread::sleep(Duration::from_secs(wait_s));
                continue;
            }
            return Ok((reply, conn.writes - before));
        }
    }

    fn deliver_payment(&self, conn: &mut Conn, notice: &PaymentNotice) -> Result<Delivery, String> {
        self.deliver_payment_via(conn, self.channel, notice, None)
    }

    /// A payment delivery through `channel`; `presigned` is sent first (signed
    /// ahead of a moment that must be sharp), re-signed for 503 retries.
    fn deliver_payment_via(
        &self,
        conn: &mut Conn,
        channel: Channel,
        notice: &PaymentNotice,
        presigned: Option<Req>,
    ) -> Result<Delivery, String> {
        let presigned = RefCell::new(presigned);
        let build = || match presigned.borrow_mut().take() {
            Some(req) => Ok(req),
            None => self.sign_payment(channel, notice),
        };
        let (reply, sends) = self.send_retrying(conn, &build)?;
        Ok(Delivery { label: channel.answer(&reply)?, sends })
    }

    fn deliver_refund(&self, conn: &mut Conn, notice: &RefundNotice) -> Result<Delivery, String> {
        let build = || Ok(Req::signed(self.channel.sign_refund(&self.keys, notice, now_s())?));
        let (reply, sends) = self.send_retrying(conn, &build)?;
        Ok(Delivery { label: format!("refund {}", self.channel.answer(&reply)?), sends })
    }

    /// The answer a delivery with payonce outcome `outcome` must get here.
    fn said(&self, outcome: &str) -> String {
        self.channel.label(outcome)
    }

    /// An order-API call; 401 is a setup error (the token), not a verdict.
    fn api(&self, conn: &mut Conn, req: Req) -> Result<Reply, String> {
        let (method, path) = (req.method, req.path.clone());
        let (reply, _) = self.send_retrying(conn, &|| Ok(req.clone()))?;
        if reply.status == 401 {
            return Err(format!(
                "{method} {path}: 401 {}: the target needs an API token (PAYONCE_API_TOKEN or --api-token)",
                reply.error_code()
            ));
        }
        Ok(reply)
    }

    fn create(&self, conn: &mut Conn, order: &SimOrder) -> Result<Reply, String> {
        let body = json!({"order_no": order.no, "user_id": order.user, "amount": order.amount, "expires_in_s": 3600});
        self.api(conn, Req::post_json(s("/v1/orders"), &body))
    }

    /// `work(conn, i)` for every order, on up to `WORKERS` keep-alive connections.
    fn par_orders<T: Send>(
        &self,
        n: usize,
        work: impl Fn(&mut Conn, usize) -> Result<T, String> + Sync,
    ) -> Result<Vec<T>, String> {
        let next = Mutex::new(0usize);
        let results: Mutex<Vec<Option<T>>> = Mutex::new((0..n).map(|_| None).collect());
        let failure = Failure::new();
        scoped_workers(n.clamp(1, WORKERS), |_| {
            let mut conn = Conn::new(&self.target);
            loop {
                let i = {
                    let mut next = next.lock();
                    *next += 1;
                    *next - 1
                };
                if i >= n || failure.is_set() {
                    return;
                }
                match work(&mut conn, i) {
                    Ok(value) => results.lock()[i] = Some(value),
                    Err(e) => failure.set(e),
                }
            }
        })?;
        failure.into_result()?;
        results.into_inner().into_iter().map(|r| r.ok_or_else(|| s("a worker stopped early"))).collect()
    }

    /// For each order in turn, `prepare(i, t)` (e.g. signing, which is slow
    /// in a debug build) and then `work(conn, i, t, prepared)` on `k` threads
    /// released at the same moment (each thread its own keep-alive connection).
    fn rounds<P, T: Send>(
        &self,
        n: usize,
        k: usize,
        prepare: impl Fn(usize, usize) -> Result<P, String> + Sync,
        work: impl Fn(&mut Conn, usize, usize, P) -> Result<T, String> + Sync,
    ) -> Result<Vec<Vec<T>>, String> {
        let barrier = Barrier::new(k);
        let results: Mutex<Vec<Vec<Option<T>>>> = Mutex::new((0..n).map(|_| (0..k).map(|_| None).collect()).collect());
        let failure = Failure::new();
        scoped_workers(k, |t| {
            let mut conn = Conn::new(&self.target);
            conn.warm();
            for i in 0..n {
                let prepared = if failure.is_set() { None } else { prepare(i, t).map_err(|e| failure.set(e)).ok() };
                barrier.wait();
                let Some(prepared) = prepared.filter(|_| !failure.is_set()) else {
                    continue;
                };
                match work(&mut conn, i, t, prepared) {
                    Ok(value) => results.lock()[i][t] = Some(value),
                    Err(e) => failure.set(e),
                }
            }
        })?;
        failure.into_result()?;
        results
            .into_inner()
            .into_iter()
            .map(|row| row.into_iter().map(|r| r.ok_or_else(|| s("a worker stopped early"))).collect())
            .collect()
    }

    /// Creates every order of a scenario (201 expected, checked by the judge).
    fn create_all(&self, orders: &[SimOrder]) -> Result<Vec<String>, String> {
        self.par_orders(orders.len(), |conn, i| Ok(api_label("create", &self.create(conn, &orders[i])?)))
    }

    fn run_scenario(&self, scenario: Scenario) -> Result<ScenarioRun, String> {
        let orders: Vec<SimOrder> = (0..self.orders).map(|i| self.order(scenario, i)).collect();
        let runs = match scenario {
            Scenario::Concurrent => self.concurrent(orders)?,
            Scenario::Redelivery40ms => self.redelivery(orders)?,
            Scenario::GatewayReplay => self.gateway_replay(orders)?,
            Scenario::RetrySchedule => self.retry_schedule(orders)?,
            Scenario::TwoChannels => self.two_channels(orders)?,
            Scenario::PaymentAfterClose => self.payment_after_close(orders)?,
            Scenario::Refund => self.refund(orders)?,
            Scenario::TripleClick => self.triple_click(orders)?,
        };
        self.progress.finish();
        Ok(ScenarioRun { scenario, channel: self.channel, orders: runs })
    }

    fn paid_expect(answers: Vec<String>) -> OrderExpect {
        OrderExpect {
            status: s("PAID"),
            answers,
            payments: vec![s("applied")],
            paid: true,
            events: vec![(s("order.paid"), 1)],
            ..OrderExpect::default()
        }
    }

    fn created() -> String {
        s("api:create 201 PENDING")
    }

    fn concurrent(&self, orders: Vec<SimOrder>) -> Result<Vec<OrderRun>, String> {
        let k = self.concurrency;
        let created = self.create_all(&orders)?;
        self.progress.start("concurrent", orders.len() * k);
        let rounds = self.rounds(
            orders.len(),
            k,
            |i, t| {
                let notice = self.payment(&orders[i], 1, t);
                let req = self.sign_payment(self.channel, &notice)?;
                Ok((notice, req))
            },
            |conn, _, _, (notice, req)| {
                let delivery = self.deliver_payment_via(conn, self.channel, &notice, Some(req));
                self.progress.tick();
                delivery
            },
        )?;
        let mut expected = vec![Sim::created(), self.said("applied")];
        expected.extend((1..k).map(|_| self.said("duplicate")));
        Ok(orders
            .into_iter()
            .zip(created)
            .zip(rounds)
            .map(|((order, created), deliveries)| OrderRun {
                order,
                expect: Sim::paid_expect(expected.clone()),
                deliveries: deliveries.iter().map(|d| d.sends).sum(),
                answers: std::iter::once(created).chain(deliveries.into_iter().map(|d| d.label)).collect(),
                lost: 0,
            })
            .collect())
    }

    /// A second answer read after a 503 is retried on the same connection.
    fn settle(&self, conn: &mut Conn, reply: Reply, notice: &PaymentNotice) -> Result<Delivery, String> {
        if reply.status == 503 {
            let retry = self.deliver_payment(conn, notice)?;
            return Ok(Delivery { label: retry.label, sends: retry.sends + 1 });
        }
        Ok(Delivery { label: self.channel.answer(&reply)?, sends: 1 })
    }

    fn redelivery(&self, orders: Vec<SimOrder>) -> Result<Vec<OrderRun>, String> {
        let created = self.create_all(&orders)?;
        self.progress.start("redelivery_40ms", orders.len() * 2);
        let runs = self.par_orders(orders.len(), |_, i| {
            let notices = [self.payment(&orders[i], 1, 0), self.payment(&orders[i], 1, 1)];
            // Both signed ahead, so signing time never stretches the 40 ms.
            let reqs = [self.sign_payment(self.channel, &notices[0])?, self.sign_payment(self.channel, &notices[1])?];
            let (mut first, mut second) = (Conn::new(&self.target), Conn::new(&self.target));
            first.send(&reqs[0])?;
            let sent_at = Instant::now();
            thread::sleep(REDELIVERY_GAP.saturating_sub(sent_at.elapsed()));
            second.send(&reqs[1])?;
            let mut answers = Vec::new();
            let mut deliveries = 0;
            for (conn, notice) in [&mut first, &mut second].into_iter().zip(&notices) {
                let reply = conn
                    .receive()
                    .map_err(|e| format!("redelivery_40ms: {} from {}", e.describe(), self.target.url))?;
                let delivery = self.settle(conn, reply, notice)?;
                answers.push(delivery.label);
                deliveries += delivery.sends;
                self.progress.tick();
            }
            Ok((answers, deliveries))
        })?;
        let expect = Sim::paid_expect(vec![Sim::created(), self.said("applied"), self.said("duplicate")]);
        Ok(orders
            .into_iter()
            .zip(created)
            .zip(runs)
            .map(|((order, created), (answers, deliveries))| OrderRun {
                order,
                expect: expect.clone(),
                answers: std::iter::once(created).chain(answers).collect(),
                lost: 0,
                deliveries,
            })
            .collect())
    }

    /// The first attempt of a gateway replay: a fresh connection, the
    /// request, a read timeout of `--replay-timeout-ms` (0: no wait at all),
    /// then the connection is dropped, as a gateway that timed out drops it.
    /// `Some(label)` when the answer arrived in time anyway.
    fn deliver_abandoned(&self, notice: &PaymentNotice) -> Result<Option<String>, String> {
        let timeout = Duration::from_millis(self.replay_timeout_ms.max(1));
        let req = self.sign_payment(self.channel, notice)?;
        let mut reader = Conn::open(&self.target, Some(timeout))?;
        reader
            .get_mut()
            .write_all(&req.encode(&self.target))
            .map_err(|e| format!("gateway_replay: cannot send to {}: {e}", self.target.url))?;
        if self.replay_timeout_ms == 0 {
            return Ok(None);
        }
        match read_reply(&mut reader) {
            Ok(reply) => Ok(Some(self.channel.answer(&reply)?)),
            Err(_) => Ok(None),
        }
    }

    fn gateway_replay(&self, orders: Vec<SimOrder>) -> Result<Vec<OrderRun>, String> {
        let created = self.create_all(&orders)?;
        self.progress.start("gateway_replay", orders.len() * 2);
        let runs = self.par_orders(orders.len(), |_, i| {
            let first = self.deliver_abandoned(&self.payment(&orders[i], 1, 0))?;
            self.progress.tick();
            // The platform saw no answer (or too late for its gateway): re-send on a new connection.
            let mut fresh = Conn::new(&self.target);
            let replay = self.deliver_payment(&mut fresh, &self.payment(&orders[i], 1, 1))?;
            self.progress.tick();
            Ok((first, replay))
        })?;
        let expect = Sim::paid_expect(vec![Sim::created(), self.said("applied"), self.said("duplicate")]);
        Ok(orders
            .into_iter()
            .zip(created)
            .zip(runs)
            .map(|((order, created), (first, replay))| OrderRun {
                order,
                expect: expect.clone(),
                lost: usize::from(first.is_none()),
                deliveries: 1 + replay.sends,
                answers: [Some(created), first, Some(replay.label)].into_iter().flatten().collect(),
            })
            .collect())
    }

    fn retry_schedule(&self, orders: Vec<SimOrder>) -> Result<Vec<OrderRun>, String> {
        let n = orders.len();
        // Each platform its own schedule; the generic channel alternates both.
        let schedule = |i: usize| -> &'static [u64] {
            match self.channel {
                Channel::Wechatpay => &WECHATPAY_RETRY_S,
                Channel::Alipay => &ALIPAY_RETRY_S,
                Channel::Generic if i % 2 == 0 => &WECHATPAY_RETRY_S,
                Channel::Generic => &ALIPAY_RETRY_S,
            }
        };
        let offsets: Vec<Vec<Duration>> = (0..n)
            .map(|i| {
                let mut at = 0u64;
                std::iter::once(Ok(Duration::ZERO))
                    .chain(schedule(i).iter().map(|interval| {
                        at += interval;
                        Duration::try_from_secs_f64(at as f64 / self.time_factor)
                            .map_err(|e| format!("--time-factor {}: {e}", self.time_factor))
                    }))
                    .collect::<Result<Vec<Duration>, String>>()
            })
            .collect::<Result<_, _>>()?;
        let created = self.create_all(&orders)?;
        self.progress.start("retry_schedule", offsets.iter().map(Vec::len).sum());
        let workers = n.clamp(1, WORKERS);
        let results: Mutex<Vec<Vec<Delivery>>> = Mutex::new((0..n).map(|_| Vec::new()).collect());
        let failure = Failure::new();
        let start = Instant::now();
        scoped_workers(workers, |w| {
            let mut conn = Conn::new(&self.target);
            let mut due: BinaryHeap<Reverse<(Duration, usize, usize)>> =
                (w..n).step_by(workers).map(|i| Reverse((Duration::ZERO, i, 0))).collect();
            while let Some(Reverse((at, i, attempt))) = due.pop() {
                // Sleep in slices so another worker's failure stops this one soon.
                while !failure.is_set() {
                    let left = (start + at).saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    thread::sleep(left.min(Duration::from_millis(100)));
                }
                if failure.is_set() {
                    return;
                }
                match self.deliver_payment(&mut conn, &self.payment(&orders[i], 1, attempt)) {
                    Ok(delivery) => results.lock()[i].push(delivery),
                    Err(e) => return failure.set(e),
                }
                self.progress.tick();
                if let Some(next) = offsets[i].get(attempt + 1) {
                    due.push(Reverse((*next, i, attempt + 1)));
                }
            }
        })?;
        failure.into_result()?;
        Ok(orders
            .into_iter()
            .zip(created)
            .zip(results.into_inner())
            .enumerate()
            .map(|(i, ((order, created), deliveries))| {
                let mut expected = vec![Sim::created(), self.said("applied")];
                expected.extend((1..offsets[i].len()).map(|_| self.said("duplicate")));
                OrderRun {
                    order,
                    expect: Sim::paid_expect(expected),
                    deliveries: deliveries.iter().map(|d| d.sends).sum(),
                    answers: std::iter::once(created).chain(deliveries.into_iter().map(|d| d.label)).collect(),
                    lost: 0,
                }
            })
            .collect())
    }

    fn two_channels(&self, orders: Vec<SimOrder>) -> Result<Vec<OrderRun>, String> {
        let created = self.create_all(&orders)?;
        self.progress.start("two_channels", orders.len() * 2);
        // Two independent payments of one order, at the same moment: the
        // second through the partner channel (another one when several are
        // selected).
        let channels = [self.channel, self.partner];
        let rounds = self.rounds(
            orders.len(),
            2,
            |i, t| {
                let notice = self.payment(&orders[i], t + 1, 0);
                let req = self.sign_payment(channels[t], &notice)?;
                Ok((notice, req))
            },
            |conn, _, t, (notice, req)| {
                let delivery = self.deliver_payment_via(conn, channels[t], &notice, Some(req));
                self.progress.tick();
                delivery
            },
        )?;
        Ok(orders
            .into_iter()
            .zip(created)
            .zip(rounds)
            .map(|((order, created), deliveries)| {
                let labels: Vec<String> = deliveries.iter().map(|d| d.label.clone()).collect();
                let (answers, pay_no) = two_channels_answers(channels, &labels, &order);
                OrderRun {
                    expect: OrderExpect {
                        status: s("PAID"),
                        answers: std::iter::once(Sim::created()).chain(answers).collect(),
                        payments: vec![s("applied"), s("already_paid")],
                        paid: true,
                        events: vec![(s("order.paid"), 1), (s("payment.refund_required"), 1)],
                        findings: vec![(s("refund_required"), 1)],
                        pay_no,
                        ..OrderExpect::default()
                    },
                    order,
                    deliveries: deliveries.iter().map(|d| d.sends).sum(),
                    answers: std::iter::once(created).chain(labels).collect(),
                    lost: 0,
                }
            })
            .collect())
    }

    fn payment_after_close(&self, orders: Vec<SimOrder>) -> Result<Vec<OrderRun>, String> {
        let created = self.create_all(&orders)?;
        self.progress.start("payment_after_close", orders.len() * 2);
        let runs = self.par_orders(orders.len(), |conn, i| {
            let close = self.api(conn, Req::post_json(format!("/v1/orders/{}/close", orders[i].no), &json!({})))?;
            let mut answers = vec![api_label("close", &close)];
            let mut deliveries = 0;
            for attempt in 0..2 {
                let delivery = self.deliver_payment(conn, &self.payment(&orders[i], 1, attempt))?;
                answers.push(delivery.label);
                deliveries += delivery.sends;
                self.progress.tick();
            }
            Ok((answers, deliveries))
        })?;
        let expect = OrderExpect {
            status: s("CLOSED"),
            answers: vec![
                Sim::created(),
                s("api:close 200 CLOSED"),
                self.said("paid_after_close"),
                self.said("duplicate"),
            ],
            payments: vec![s("paid_after_close")],
            events: vec![(s("order.closed"), 1), (s("payment.refund_required"), 1)],
            findings: vec![(s("refund_required"), 1)],
            ..OrderExpect::default()
        };
        Ok(orders
            .into_iter()
            .zip(created)
            .zip(runs)
            .map(|((order, created), (answers, deliveries))| OrderRun {
                order,
                expect: expect.clone(),
                answers: std::iter::once(created).chain(answers).collect(),
                lost: 0,
                deliveries,
            })
            .collect())
    }

    fn refund(&self, orders: Vec<SimOrder>) -> Result<Vec<OrderRun>, String> {
        let created = self.create_all(&orders)?;
        self.progress.start("refund", orders.len() * 3);
        let runs = self.par_orders(orders.len(), |conn, i| {
            let order = &orders[i];
            let payment = self.payment(order, 1, 0);
            let paid = self.deliver_payment(conn, &payment)?;
            self.progress.tick();
            let mut answers = vec![paid.label];
            let mut deliveries = paid.sends;
            let refund_no = format!("{}-R1", order.no);
            for _ in 0..2 {
                let path = format!("/v1/orders/{}/refund", order.no);
                let reply = self.api(conn, Req::post_json(path, &json!({"refund_no": refund_no})))?;
                answers.push(api_label("refund", &reply));
            }
            let notice = RefundNotice {
                refund_no,
                order_no: order.no.clone(),
                pay_no: payment.pay_no,
                amount: order.amount,
                success: true,
            };
            for _ in 0..2 {
                let delivery = self.deliver_refund(conn, &notice)?;
                answers.push(delivery.label);
                deliveries += delivery.sends;
                self.progress.tick();
            }
            Ok((answers, deliveries))
        })?;
        let expect = OrderExpect {
            status: s("REFUNDED"),
            answers: vec![
                Sim::created(),
                self.said("applied"),
                s("api:refund 200 REFUNDING"),
                s("api:refund 200 REFUNDING"),
                format!("refund {}", self.said("applied")),
                format!("refund {}", self.said("duplicate")),
            ],
            payments: vec![s("applied")],
            paid: true,
            refunded: true,
            events: vec![(s("order.paid"), 1), (s("order.refunding"), 1), (s("order.refunded"), 1)],
            ..OrderExpect::default()
        };
        Ok(orders
            .into_iter()
            .zip(created)
            .zip(runs)
            .map(|((order, created), (answers, deliveries))| OrderRun {
                order,
                expect: expect.clone(),
                answers: std::iter::once(created).chain(answers).collect(),
                lost: 0,
                deliveries,
            })
            .collect())
    }

    fn triple_click(&self, orders: Vec<SimOrder>) -> Result<Vec<OrderRun>, String> {
        self.progress.start("triple_click", orders.len() * 3);
        let rounds = self.rounds(
            orders.len(),
            3,
            |_, _| Ok(()),
            |conn, i, _, ()| {
                let reply = self.create(conn, &orders[i])?;
                self.progress.tick();
                Ok(match (reply.status, reply.header("Idempotent-Replayed")) {
                    (201, None) => s("created"),
                    (200, Some("true")) => s("replayed"),
                    _ => format!("create {}", reply.summary()),
                })
            },
        )?;
        let expect = OrderExpect {
            status: s("PENDING"),
            answers: vec![s("created"), s("replayed"), s("replayed")],
            orders_of_user: Some(1),
            ..OrderExpect::default()
        };
        Ok(orders
            .into_iter()
            .zip(rounds)
            .map(|(order, answers)| OrderRun { order, expect: expect.clone(), answers, lost: 0, deliveries: 3 })
            .collect())
    }

    // ---- reading results back ----

    /// The highest event seq now, found by galloping and bisection over
    /// `GET /v1/events?after=X&limit=1` (no paging through old events).
    fn last_event_seq(&self, conn: &mut Conn) -> Result<u64, String> {
        let mut exists_after = |after: u64| -> Result<bool, String> {
            let reply = self.api(conn, Req::get(format!("/v1/events?after={after}&limit=1")))?;
            if reply.status != 200 {
                return Err(format!("GET /v1/events: {}", reply.summary()));
            }
            Ok(reply.json()["events"].as_array().is_some_and(|e| !e.is_empty()))
        };
        if !exists_after(0)? {
            return Ok(0);
        }
        let (mut lo, mut hi) = (0u64, 1u64);
        while exists_after(hi)? {
            lo = hi;
            hi = hi.checked_mul(2).ok_or("event seq overflow")?;
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if exists_after(mid)? {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Ok(hi)
    }

    /// Event counts by order_no and type, for this run's orders.
    fn events_since(
        &self,
        conn: &mut Conn,
        mut after: u64,
    ) -> Result<BTreeMap<String, BTreeMap<String, usize>>, String> {
        let mut by_order: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
        loop {
            let reply = self.api(conn, Req::get(format!("/v1/events?after={after}&limit=1000")))?;
            if reply.status != 200 {
                return Err(format!("GET /v1/events: {}", reply.summary()));
            }
            let page = reply.json();
            let events = page["events"].as_array().cloned().unwrap_or_default();
            if events.is_empty() {
                return Ok(by_order);
            }
            for event in &events {
                let (Some(order_no), Some(kind)) = (event["order_no"].as_str(), event["type"].as_str()) else {
                    continue;
                };
                if order_no.starts_with(&self.run_id) {
                    *by_order.entry(order_no.to_owned()).or_default().entry(kind.to_owned()).or_default() += 1;
                }
            }
            let next = page["next_after"].as_u64().ok_or("GET /v1/events: no next_after")?;
            if next <= after {
                return Err("GET /v1/events: next_after does not advance".into());
            }
            after = next;
        }
    }

    /// Inspection finding counts by order_no and kind, for this run's orders.
    fn findings(&self, conn: &mut Conn) -> Result<BTreeMap<String, BTreeMap<String, usize>>, String> {
        let reply = self.api(conn, Req::get(s("/v1/inspections")))?;
        if reply.status != 200 {
            return Err(format!("GET /v1/inspections: {}", reply.summary()));
        }
        let mut by_order: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
        for finding in reply.json()["findings"].as_array().into_iter().flatten() {
            let (Some(order_no), Some(kind)) = (finding["order_no"].as_str(), finding["kind"].as_str()) else {
                continue;
            };
            if order_no.starts_with(&self.run_id) {
                *by_order.entry(order_no.to_owned()).or_default().entry(kind.to_owned()).or_default() += 1;
            }
        }
        Ok(by_order)
    }

    fn observe(
        &self,
        run: &ScenarioRun,
        events: &BTreeMap<String, BTreeMap<String, usize>>,
        findings: &BTreeMap<String, BTreeMap<String, usize>>,
    ) -> Result<Vec<OrderSeen>, String> {
        self.par_orders(run.orders.len(), |conn, i| {
            let order_run = &run.orders[i];
            let order = &order_run.order;
            let mut seen = OrderSeen {
                order_no: order.no.clone(),
                amount: order.amount,
                events: events.get(&order.no).cloned().unwrap_or_default(),
                findings: findings.get(&order.no).cloned().unwrap_or_default(),
                answers: order_run.answers.clone(),
                lost: order_run.lost,
                ..OrderSeen::default()
            };
            let reply = self.api(conn, Req::get(format!("/v1/orders/{}", order.no)))?;
            match reply.status {
                200 => read_order_detail(&reply.json(), &mut seen),
                404 => {}
                _ => return Err(format!("GET /v1/orders/{}: {}", order.no, reply.summary())),
            }
            if order_run.expect.orders_of_user.is_some() {
                let reply = self.api(conn, Req::get(format!("/v1/orders?user_id={}&limit=1000", order.user)))?;
                if reply.status != 200 {
                    return Err(format!("GET /v1/orders?user_id={}: {}", order.user, reply.summary()));
                }
                seen.orders_of_user = reply.json()["orders"].as_array().map(Vec::len);
            }
            Ok(seen)
        })
    }
}

/// two_channels' expected answers (after the order's create) and, when an
/// answer said which payment won, its pay_no. Generic answers name the
/// outcome (which of the two is `applied` is the race's); a platform's only
/// says [`PROCESSED`], so with one generic delivery its answer decides.
fn two_channels_answers(channels: [Channel; 2], labels: &[String], order: &SimOrder) -> (Vec<String>, Option<String>) {
    let pay_no = |t: usize| format!("{}-P{}", order.no, t + 1);
    let generic: Vec<usize> = (0..2).filter(|t| channels[*t] == Channel::Generic).collect();
    let answers = if generic.len() == 2 {
        vec![s("applied"), s("already_paid")]
    } else {
        (0..2)
            .map(|t| match channels[t] {
                Channel::Generic if labels.get(t).map(String::as_str) == Some("already_paid") => s("already_paid"),
                channel => channel.label("applied"),
            })
            .collect()
    };
    let winner = generic.iter().find_map(|t| match labels.get(*t).map(String::as_str) {
        Some("applied") => Some(pay_no(*t)),
        Some("already_paid") => Some(pay_no(1 - *t)),
        _ => None,
    });
    (answers, winner)
}

fn read_order_detail(detail: &Value, seen: &mut OrderSeen) {
    let text = |v: &Value, key: &str| v[key].as_str().unwrap_or("").to_owned();
    seen.status = Some(text(detail, "status"));
    seen.pay_no = detail["pay_no"].as_str().map(str::to_owned);
    let list = |key: &str| detail[key].as_array().cloned().unwrap_or_default();
    seen.payments = list("payments")
        .iter()
        .map(|p| SeenPayment { pay_no: text(p, "pay_no"), outcome: text(p, "outcome"), state: text(p, "state") })
        .collect();
    seen.coupons = list("coupons").iter().map(|c| (text(c, "coupon_template_id"), text(c, "status"))).collect();
    seen.points = list("points").iter().map(|p| (text(p, "point_type"), p["points"].as_i64().unwrap_or(0))).collect();
}

// ---------------------------------------------------------------- the table

/// One row of the table.
pub struct Row {
    pub scenario: String,
    /// Shown as a column when the rows are of more than one channel.
    pub channel: String,
    pub deliveries: String,
    pub expected: String,
    pub observed: String,
    pub violations: Vec<String>,
}

fn push_item(items: &mut Vec<String>, n: usize, what: &str) {
    items.push(format!("{n} {what}"));
}

fn expected_effects(runs: &[OrderRun], rewards: &RewardRule) -> String {
    let expects: Vec<&OrderExpect> = runs.iter().map(|r| &r.expect).collect();
    let mut items = Vec::new();
    for (status, n) in multiset(&expects.iter().map(|e| e.status.clone()).collect::<Vec<_>>()) {
        push_item(&mut items, n, &status);
    }
    push_item(&mut items, expects.iter().map(|e| e.payments.len()).sum(), "payments");
    let paid = expects.iter().filter(|e| e.paid).count();
    let refunded = expects.iter().filter(|e| e.refunded).count();
    let coupon = if refunded > 0 { "frozen coupons" } else { "coupons" };
    match rewards {
        RewardRule::Known(rules) => {
            push_item(&mut items, paid * rules.coupon_templates.len(), coupon);
            let points = runs.iter().filter(|r| r.expect.paid && rules.points_for(r.order.amount) > 0).count();
            push_item(&mut items, points, "points");
            if refunded > 0 {
                push_item(&mut items, refunded, "reversals");
            }
        }
        RewardRule::Unknown if paid > 0 => {
            items.push(format!("<=1 {coupon}/template/order"));
            items.push(s("<=1 points/order"));
            if refunded > 0 {
                items.push(s("1 reversal per points"));
            }
        }
        RewardRule::Unknown => {
            push_item(&mut items, 0, "coupons");
            push_item(&mut items, 0, "points");
        }
    }
    let mut events: BTreeMap<&str, usize> = BTreeMap::new();
    let mut findings: BTreeMap<&str, usize> = BTreeMap::new();
    for e in &expects {
        for (kind, n) in &e.events {
            *events.entry(kind).or_default() += n;
        }
        for (kind, n) in &e.findings {
            *findings.entry(kind).or_default() += n;
        }
    }
    for (kind, n) in events {
        push_item(&mut items, n, kind);
    }
    for (kind, n) in findings {
        push_item(&mut items, n, &format!("{kind} findings"));
    }
    let users: Vec<usize> = expects.iter().filter_map(|e| e.orders_of_user).collect();
    if !users.is_empty() {
        push_item(&mut items, users.iter().sum(), "orders (1 per user)");
    }
    items.join(", ")
}

fn observed_effects(seen: &[OrderSeen]) -> String {
    let mut items = Vec::new();
    let statuses: Vec<String> = seen.iter().map(|o| o.status.clone().unwrap_or_else(|| s("missing"))).collect();
    for (status, n) in multiset(&statuses) {
        push_item(&mut items, n, &status);
    }
    push_item(&mut items, seen.iter().map(|o| o.payments.len()).sum(), "payments");
    let coupon_statuses: Vec<String> = seen.iter().flat_map(|o| o.coupons.iter().map(|(_, st)| st.clone())).collect();
    if coupon_statuses.is_empty() {
        push_item(&mut items, 0, "coupons");
    }
    for (status, n) in multiset(&coupon_statuses) {
        let what = match status.as_str() {
            "ACTIVE" => s("coupons"),
            other => format!("{} coupons", other.to_ascii_lowercase()),
        };
        push_item(&mut items, n, &what);
    }
    let point_types: Vec<String> = seen.iter().flat_map(|o| o.points.iter().map(|(t, _)| t.clone())).collect();
    if point_types.is_empty() {
        push_item(&mut items, 0, "points");
    }
    for (kind, n) in multiset(&point_types) {
        let what = match kind.as_str() {
            "ORDER_PAID" => s("points"),
            "ORDER_PAID_REVERSAL" => s("reversals"),
            other => other.to_owned(),
        };
        push_item(&mut items, n, &what);
    }
    let mut events: BTreeMap<&str, usize> = BTreeMap::new();
    let mut findings: BTreeMap<&str, usize> = BTreeMap::new();
    for o in seen {
        for (kind, n) in &o.events {
            *events.entry(kind).or_default() += n;
        }
        for (kind, n) in &o.findings {
            *findings.entry(kind).or_default() += n;
        }
    }
    for (kind, n) in events {
        push_item(&mut items, n, kind);
    }
    for (kind, n) in findings {
        push_item(&mut items, n, &format!("{kind} findings"));
    }
    let users: Vec<usize> = seen.iter().filter_map(|o| o.orders_of_user).collect();
    if !users.is_empty() {
        let per_user = if users.iter().all(|n| *n == 1) { "orders (1 per user)" } else { "orders" };
        push_item(&mut items, users.iter().sum(), per_user);
    }
    items.join(", ")
}

fn deliveries_cell(run: &ScenarioRun) -> String {
    let sent: usize = run.orders.iter().map(|o| o.deliveries).sum();
    let shown: Vec<String> =
        run.orders.iter().flat_map(|o| o.answers.iter().filter(|a| !a.starts_with("api:")).cloned()).collect();
    let mut answers = multiset(&shown);
    // In the order the scenario tells its story (applied before duplicate); surprises last.
    let story: Vec<&String> = run.orders.iter().flat_map(|o| &o.expect.answers).collect();
    answers.sort_by_key(|(label, _)| story.iter().position(|a| *a == label).unwrap_or(usize::MAX));
    let lost: usize = run.orders.iter().map(|o| o.lost).sum();
    if lost > 0 {
        answers.push((s("lost"), lost));
    }
    format!("{sent}: {}", counted(&answers))
}

fn build_row(run: &ScenarioRun, seen: &[OrderSeen], rewards: &RewardRule) -> Row {
    let violations = run
        .orders
        .iter()
        .zip(seen)
        .flat_map(|(r, o)| judge(&r.expect, rewards, o).into_iter().map(move |v| format!("{}: {v}", o.order_no)))
        .collect();
    Row {
        scenario: run.scenario.name().to_owned(),
        channel: run.channel.name().to_owned(),
        deliveries: deliveries_cell(run),
        expected: expected_effects(&run.orders, rewards),
        observed: observed_effects(seen),
        violations,
    }
}

/// The table, and the violations under it.
pub fn render_table(rows: &[Row]) -> String {
    let with_channel = rows.iter().any(|r| r.channel != rows[0].channel);
    let mut header = vec!["scenario", "deliveries", "effects expected", "effects observed", "verdict"];
    if with_channel {
        header.insert(1, "channel");
    }
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let verdict = if r.violations.is_empty() { "ok" } else { "VIOLATION" };
            let mut row = vec![
                r.scenario.clone(),
                r.deliveries.clone(),
                r.expected.clone(),
                r.observed.clone(),
                verdict.to_owned(),
            ];
            if with_channel {
                row.insert(1, r.channel.clone());
            }
            row
        })
        .collect();
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in &cells {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |row: &[String]| -> String {
        let padded: Vec<String> = row.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        padded.join("  ").trim_end().to_owned() + "\n"
    };
    let mut out = line(&header.iter().map(|h| (*h).to_owned()).collect::<Vec<_>>());
    out.push_str(&line(&widths.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>()));
    for row in &cells {
        out.push_str(&line(row));
    }
    for r in rows.iter().filter(|r| !r.violations.is_empty()) {
        let which = if with_channel { format!("{} ({})", r.scenario, r.channel) } else { r.scenario.clone() };
        out.push_str(&format!("\nVIOLATION in {which} ({} finding(s)):\n", r.violations.len()));
        for v in r.violations.iter().take(DETAILS_MAX) {
            out.push_str(&format!("  {v}\n"));
        }
        if r.violations.len() > DETAILS_MAX {
            out.push_str(&format!("  ... and {} more\n", r.violations.len() - DETAILS_MAX));
        }
    }
    out
}

// ---------------------------------------------------------------- the in-process payonce

struct LocalServer {
    addr: SocketAddr,
    shutdown: Arc<AtomicBool>,
    handle: Option<thread::JoinHandle<bool>>,
}

impl LocalServer {
    /// payonce on `:memory:` with the generic secret and the channels the
    /// simulator holds keys for, configured with their public halves.
    fn start(keys: &Keys) -> Result<LocalServer, String> {
        let wechatpay = match &keys.wechatpay {
            Some(wx) => {
                let public = RsaPublicKey::from(wx.signing_key.as_ref());
                let apiv3_key = std::str::from_utf8(&wx.apiv3_key).map_err(|_| s("the APIv3 key is not UTF-8"))?;
                Some(WechatpayConfig::new(apiv3_key, vec![(wx.serial.clone(), public)])?)
            }
            None => None,
        };
        let alipay = keys.alipay.as_ref().map(|ali| AlipayConfig {
            public_key: RsaPublicKey::from(ali.signing_key.as_ref()),
            app_id: ali.app_id.clone(),
        });
        let config = Config {
            callback_secrets: vec![keys.generic_secret.clone()],
            rewards: Rewards { coupon_templates: vec![SIM_COUPON.into()], points_per_yuan: SIM_POINTS_PER_YUAN },
            wechatpay,
            alipay,
            ..Config::default()
        };
        let app = App::open(":memory:", Clock::System, config).map_err(|e| e.message)?;
        let server = Server::bind("127.0.0.1:0").map_err(|e| e.message)?;
        let addr = server.local_addr();
        let shutdown = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&shutdown);
        let handle = thread::Builder::new()
            .name("payonce-simulated-server".into())
            .spawn(move || server.serve(Arc::new(app), flag, WORKERS_DEFAULT))
            .map_err(|e| format!("cannot start the in-process payonce: {e}"))?;
        Ok(LocalServer { addr, shutdown, handle: Some(handle) })
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        self.shutdown.store(true, Ordering::SeqCst);
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

// ---------------------------------------------------------------- the command

struct Options {
    target: Option<String>,
    callback_secret: Option<String>,
    api_token: Option<String>,
    channels: Vec<Channel>,
    scenarios: Vec<Scenario>,
    orders: usize,
    concurrency: usize,
    time_factor: f64,
    replay_timeout_ms: u64,
    wechatpay_private_key: Option<String>,
    wechatpay_serial: Option<String>,
    wechatpay_apiv3_key: Option<String>,
    alipay_private_key: Option<String>,
    alipay_app_id: Option<String>,
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
        replay_timeout_ms: 0,
        wechatpay_private_key: None,
        wechatpay_serial: None,
        wechatpay_apiv3_key: env("PAYONCE_WECHATPAY_APIV3_KEY"),
        alipay_private_key: None,
        alipay_app_id: None,
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
                        "all" => Channel::ALL.to_vec(),
                        _ => vec![Channel::parse(name).ok_or_else(|| {
                            let known: Vec<&str> = Channel::ALL.iter().map(|c| c.name()).collect();
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
            Long("replay-timeout-ms") => {
                opts.replay_timeout_ms = int_value(&mut parser, "--replay-timeout-ms", 0, 60_000)?
            }
            Long("wechatpay-private-key") => opts.wechatpay_private_key = Some(string_value(&mut parser)?),
            Long("wechatpay-serial") => opts.wechatpay_serial = Some(string_value(&mut parser)?),
            Long("wechatpay-apiv3-key") => opts.wechatpay_apiv3_key = Some(string_value(&mut parser)?),
            Long("alipay-private-key") => opts.alipay_private_key = Some(string_value(&mut parser)?),
            Long("alipay-app-id") => opts.alipay_app_id = Some(string_value(&mut parser)?),
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
        opts.channels = vec![Channel::Generic];
    } else {
        opts.channels.sort_by_key(|c| Channel::ALL.iter().position(|a| a == c));
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

fn first_secret(list: &str) -> Option<String> {
    list.split(',').map(str::trim).find(|s| !s.is_empty()).map(str::to_owned)
}

/// A platform's private key: PKCS#8 PEM (`PRIVATE KEY`), or PKCS#1 (`RSA PRIVATE KEY`).
fn private_key_from_file(flag: &str, path: &str) -> Result<RsaPrivateKey, String> {
    use rsa::pkcs1::DecodeRsaPrivateKey;
    use rsa::pkcs8::DecodePrivateKey;
    let pem = std::fs::read_to_string(path).map_err(|e| format!("{flag} {path}: {e}"))?;
    let key = if pem.contains("-----BEGIN RSA PRIVATE KEY-----") {
        RsaPrivateKey::from_pkcs1_pem(pem.trim()).map_err(|e| e.to_string())
    } else {
        RsaPrivateKey::from_pkcs8_pem(pem.trim()).map_err(|e| e.to_string())
    };
    key.map_err(|e| format!("{flag} {path}: not a PKCS#8 PEM RSA private key ({e})"))
}

/// The platforms' keys for the selected channels. Against a target every
/// selected channel needs its flags; in process, what is not given is made
/// for this run (the RSA key pairs on their own threads, side by side).
fn platform_keys(opts: &Options, in_process: bool) -> Result<Keys, String> {
    let selected = |c: Channel| opts.channels.contains(&c);
    let mut missing = Vec::new();
    let mut need = |value: &Option<String>, what: &'static str| {
        if value.is_none() && !in_process {
            missing.push(what);
        }
    };
    if selected(Channel::Generic) {
        need(&opts.callback_secret, "--callback-secret (or PAYONCE_CALLBACK_SECRET)");
    }
    if selected(Channel::Wechatpay) {
        need(&opts.wechatpay_private_key, "--wechatpay-private-key");
        need(&opts.wechatpay_serial, "--wechatpay-serial");
        need(&opts.wechatpay_apiv3_key, "--wechatpay-apiv3-key (or PAYONCE_WECHATPAY_APIV3_KEY)");
    }
    if selected(Channel::Alipay) {
        need(&opts.alipay_private_key, "--alipay-private-key");
        need(&opts.alipay_app_id, "--alipay-app-id");
    }
    if !missing.is_empty() {
        let channels: Vec<&str> = opts.channels.iter().map(|c| c.name()).collect();
        return Err(format!("--target with --channel {} needs {}", channels.join(","), missing.join(", ")));
    }
    let apiv3_key = opts.wechatpay_apiv3_key.as_ref().filter(|_| selected(Channel::Wechatpay));
    if let Some(key) = apiv3_key.filter(|k| k.len() != APIV3_KEY_BYTES) {
        return Err(format!("--wechatpay-apiv3-key: the APIv3 key is {APIV3_KEY_BYTES} bytes, got {}", key.len()));
    }
    let load_or_make = |flag: &str, path: &Option<String>| -> Result<RsaPrivateKey, String> {
        match path {
            Some(path) => private_key_from_file(flag, path),
            None => RsaPrivateKey::new(&mut rsa::rand_core::OsRng, SIM_RSA_BITS)
                .map_err(|e| format!("cannot generate an RSA key: {e}")),
        }
    };
    let (wechatpay_key, alipay_key) = thread::scope(|scope| {
        let wechatpay = selected(Channel::Wechatpay)
            .then(|| scope.spawn(|| load_or_make("--wechatpay-private-key", &opts.wechatpay_private_key)));
        let alipay = selected(Channel::Alipay)
            .then(|| load_or_make("--alipay-private-key", &opts.alipay_private_key))
            .transpose();
        let wechatpay = match wechatpay {
            Some(handle) => handle.join().map_err(|_| s("RSA key generation failed")).and_then(|r| r).map(Some),
            None => Ok(None),
        };
        (wechatpay, alipay)
    });
    let wechatpay = match wechatpay_key? {
        Some(key) => {
            let apiv3_key = match &opts.wechatpay_apiv3_key {
                Some(key) => key.clone(),
                None => random_text(APIV3_KEY_BYTES)?,
            };
            let serial = opts.wechatpay_serial.clone().unwrap_or_else(|| s(SIM_WECHATPAY_SERIAL));
            Some(WechatpayKeys { signing_key: SigningKey::new(key), serial, apiv3_key: apiv3_key.into_bytes() })
        }
        None => None,
    };
    let alipay = alipay_key?.map(|key| AlipayKeys {
        signing_key: SigningKey::new(key),
        app_id: opts.alipay_app_id.clone().unwrap_or_else(|| s(SIM_ALIPAY_APP_ID)),
    });
    let generic_secret = match opts.callback_secret.as_deref().and_then(first_secret) {
        Some(secret) => secret,
        None if in_process => format!("sim-{}", new_run_id()),
        // Generic not selected against a target: never signed for.
        None => String::new(),
    };
    Ok(Keys { generic_secret: generic_secret.into_bytes(), wechatpay, alipay })
}

/// `payonce simulate`: parses its flags from `args` (after the command name).
/// Exit 0 when every scenario is ok, 1 on a violation; `Err` (exit 2) on errors.
pub fn run(args: impl Iterator<Item = OsString>) -> Result<ExitCode, String> {
    let Some(opts) = parse_args(args)? else {
        return Ok(ExitCode::SUCCESS);
    };
    let started = Instant::now();
    let keys = platform_keys(&opts, opts.target.is_none())?;
    let keys_s = started.elapsed().as_secs_f64();
    let (target, local, rewards) = match &opts.target {
        Some(url) => {
            let token = match opts.api_token.as_deref().and_then(first_secret) {
                Some(entry) => Some(ApiToken::parse(&entry).ok_or("--api-token: not a valid token")?.token),
                None => None,
            };
            (Target::parse(url, token)?, None, RewardRule::Unknown)
        }
        None => {
            let local = LocalServer::start(&keys)?;
            let rewards = Rewards { coupon_templates: vec![SIM_COUPON.into()], points_per_yuan: SIM_POINTS_PER_YUAN };
            (Target::local(local.addr), Some(local), RewardRule::Known(rewards))
        }
    };
    let progress = Progress::new(opts.orders >= 50 || std::io::stderr().is_terminal());
    if progress.enabled && keys_s >= 0.1 {
        eprintln!("platform keys ready in {keys_s:.1} s");
    }
    let first = opts.channels.first().copied().unwrap_or(Channel::Generic);
    let sim = Sim {
        target: Arc::new(target),
        keys: Arc::new(keys),
        channel: first,
        partner: first,
        run_id: new_run_id(),
        orders: opts.orders,
        concurrency: opts.concurrency,
        time_factor: opts.time_factor,
        replay_timeout_ms: opts.replay_timeout_ms,
        progress,
    };
    let result = simulate(&sim, &opts, &rewards, local.is_some());
    drop(local);
    result
}

fn simulate(sim: &Sim, opts: &Options, rewards: &RewardRule, in_process: bool) -> Result<ExitCode, String> {
    let mut conn = Conn::new(&sim.target);
    let health = conn.request(&Req::get(s("/healthz")))?;
    if health.status != 200 {
        return Err(format!("{} answered GET /healthz with {}", sim.target.url, health.summary()));
    }
    if !in_process {
        let mode = sim.api(&mut conn, Req::get(s("/v1/admin/mode")))?;
        if mode.json()["mode"].as_str() == Some("record_only") {
            return Err(format!(
                "{} is in record_only mode: callbacks would be recorded, not decided; PUT /v1/admin/mode normal first",
                sim.target.url
            ));
        }
    }
    let first_seq = sim.last_event_seq(&mut conn)?;
    let names: Vec<&str> = opts.channels.iter().map(|c| c.name()).collect();
    println!(
        "payonce simulate: run {} against {}{}, {} channel{}, {} orders per scenario{}, time factor {}",
        sim.run_id,
        sim.target.url,
        if in_process { " (in-process payonce, :memory:)" } else { "" },
        names.join(", "),
        if names.len() > 1 { "s" } else { "" },
        sim.orders,
        if names.len() > 1 { " and channel" } else { "" },
        sim.time_factor
    );
    // One simulator per channel; each pays two_channels' second payment
    // through the next selected channel.
    let sims: Vec<Sim> = opts
        .channels
        .iter()
        .enumerate()
        .map(|(i, channel)| sim.for_channel(*channel, opts.channels[(i + 1) % opts.channels.len()]))
        .collect();
    let mut runs = Vec::new();
    for scenario in &opts.scenarios {
        for channel_sim in &sims {
            let started = Instant::now();
            let run = channel_sim.run_scenario(*scenario);
            channel_sim.progress.finish();
            runs.push(run?);
            if channel_sim.progress.enabled {
                let channel = if sims.len() > 1 { format!(" ({})", channel_sim.channel.name()) } else { String::new() };
                eprintln!(
                    "{:<20} done in {:.1} s",
                    format!("{}{channel}", scenario.name()),
                    started.elapsed().as_secs_f64()
                );
            }
        }
    }
    let events = sim.events_since(&mut conn, first_seq)?;
    let findings = sim.findings(&mut conn)?;
    let mut rows = Vec::new();
    for run in &runs {
        let seen = sim.observe(run, &events, &findings)?;
        rows.push(build_row(run, &seen, rewards));
    }
    print!("{}", render_table(&rows));
    let _ = std::io::stdout().flush();
    Ok(if rows.iter().all(|r| r.violations.is_empty()) { ExitCode::SUCCESS } else { ExitCode::from(1) })
}
