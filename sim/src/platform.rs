//! The platforms' side: each [`Platform`]'s payment and refund
//! notifications, signed the way the platform documents it, and what
//! payonce's answer in that platform's protocol says.
//!
//! This is the independent oracle of payonce's channel verification, so it
//! shares no code with the service's `channel/` or `signature` modules: the
//! generic HMAC, WeChat Pay's SHA256-RSA and AES-256-GCM resource and
//! Alipay's RSA2 form are written here from payonce's documentation
//! (docs/channels.md) and the platforms' documentation.

use crate::client::{Reply, ReplyExt, Req};
use crate::{new_run_id, s, KeyMode, Options};
use aes_gcm::aead::{Aead, Payload};
use aes_gcm::{Aes256Gcm, KeyInit, Nonce};
use base64::Engine;
use hmac::{Hmac, Mac};
use rsa::pkcs1v15::SigningKey;
use rsa::signature::{SignatureEncoding, Signer};
use rsa::RsaPrivateKey;
use serde_json::{json, Value};
use sha2::Sha256;
use std::thread;

/// The WeChat Pay APIv3 key's length: AES-256 takes 32 bytes.
pub const APIV3_KEY_BYTES: usize = 32;

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
pub(crate) const SIM_RSA_BITS: usize = if cfg!(debug_assertions) { 1024 } else { 2048 };
/// How a platform's success answer (WeChat 204, Alipay `success`) is shown:
/// the protocol says the notice was processed, not with which outcome.
pub const PROCESSED: &str = "processed";

/// A payment platform (payonce's channel) the simulator can sign for. A real platform is one
/// more variant here and one more arm in each `match` of this `impl`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Platform {
    Generic,
    Wechatpay,
    Alipay,
}

impl Platform {
    pub const ALL: [Platform; 3] = [Platform::Generic, Platform::Wechatpay, Platform::Alipay];

    pub fn name(self) -> &'static str {
        match self {
            Platform::Generic => "generic",
            Platform::Wechatpay => "wechatpay",
            Platform::Alipay => "alipay",
        }
    }

    /// One letter in order_nos, so runs of several channels never share an order.
    pub fn tag(self) -> &'static str {
        match self {
            Platform::Generic => "g",
            Platform::Wechatpay => "w",
            Platform::Alipay => "a",
        }
    }

    pub fn parse(text: &str) -> Option<Platform> {
        Platform::ALL.into_iter().find(|c| c.name() == text)
    }

    /// The answer label a delivery with payonce outcome `outcome` must get:
    /// the outcome itself where the protocol carries it (generic), else
    /// [`PROCESSED`].
    pub fn label(self, outcome: &str) -> String {
        match self {
            Platform::Generic => outcome.to_owned(),
            Platform::Wechatpay | Platform::Alipay => PROCESSED.to_owned(),
        }
    }

    /// The signed HTTP request of a payment notification. `Err` when the
    /// simulator holds no keys for this channel (a setup error).
    pub fn sign_payment(self, keys: &Keys, notice: &PaymentNotice, now_s: i64) -> Result<Signed, String> {
        match self {
            Platform::Generic => {
                let body = json!({
                    "pay_no": notice.pay_no, "order_no": notice.order_no, "amount": notice.amount,
                    "status": if notice.success { "SUCCESS" } else { "FAILED" },
                });
                generic_signed("/v1/callbacks/generic", keys.generic_secret()?, body, now_s)
            }
            Platform::Wechatpay => {
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
            Platform::Alipay => {
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
            Platform::Generic => {
                let body = json!({
                    "refund_no": notice.refund_no, "order_no": notice.order_no, "amount": notice.amount,
                    "status": if notice.success { "SUCCESS" } else { "FAILED" },
                });
                generic_signed("/v1/callbacks/generic/refund", keys.generic_secret()?, body, now_s)
            }
            Platform::Wechatpay => {
                let keys = keys.wechatpay()?;
                // A failed refund is signed CLOSED, not ABNORMAL: WeChat
                // gives a closed refund's money back to what is left to
                // refund, so the merchant's next refund_no may ask for it
                // again, while an ABNORMAL one still holds it.
                let (event, status, summary) = match notice.success {
                    true => ("REFUND.SUCCESS", "SUCCESS", "退款成功"),
                    false => ("REFUND.CLOSED", "CLOSED", "退款关闭"),
                };
                let mut plain = json!({
                    "mchid": WECHATPAY_MCHID,
                    "out_trade_no": notice.order_no,
                    "transaction_id": notice.pay_no,
                    "out_refund_no": notice.refund_no,
                    "refund_id": format!("50{}", random_digits(27)?),
                    "refund_status": status,
                    "user_received_account": "支付用户零钱",
                    "amount": {"total": notice.total, "refund": notice.amount,
                               "payer_total": notice.total, "payer_refund": notice.amount},
                });
                if notice.success {
                    plain["success_time"] = Value::String(china_time(now_s).rfc3339());
                }
                wechatpay_signed(keys, "/v1/callbacks/wechatpay/refund", event, summary, "refund", &plain, now_s)
            }
            Platform::Alipay => {
                let keys = keys.alipay()?;
                if !notice.success {
                    return Err("Alipay sends no notice of a failed refund".into());
                }
                // The trade's state after the refund: closed once nothing is
                // left to refund, still TRADE_SUCCESS after a partial one.
                let status = if notice.refunded_total >= notice.total { "TRADE_CLOSED" } else { "TRADE_SUCCESS" };
                let yuan = fen_to_yuan(notice.total);
                let mut form = alipay_form(keys, &notice.pay_no, &notice.order_no, &yuan, status, now_s)?;
                // refund_fee is the trade's refunds so far, not this one's.
                form.push(("refund_fee".into(), fen_to_yuan(notice.refunded_total)));
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
            Platform::Generic => {
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
            Platform::Wechatpay => {
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
            Platform::Alipay => {
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

/// The simulated merchant's WeChat Pay mchid and appid (payonce's
/// notification handling reads neither; its merchant API calls send the mchid).
pub(crate) const WECHATPAY_MCHID: &str = "1900000100";
pub(crate) const WECHATPAY_APPID: &str = "wxsimulatorpayonce";

/// What the simulator signs with; each channel takes what it needs.
#[derive(Clone, Debug, Default)]
pub struct Keys {
    /// Empty: no generic channel.
    pub generic_secret: Vec<u8>,
    pub wechatpay: Option<WechatpayKeys>,
    pub alipay: Option<AlipayKeys>,
    /// How the in-process payonce holds Alipay's key (`--key-mode`).
    pub key_mode: crate::alipay_certs::KeyMode,
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

    /// These keys, with fresh ones (as an in-process run makes them) for a
    /// platform they have none for: a scenario in process that has buyers
    /// pay at both platforms signs both platforms' notices, whichever
    /// channels were selected.
    pub fn with_both_platforms(&self) -> Result<Keys, String> {
        let fresh = || {
            RsaPrivateKey::new(&mut rsa::rand_core::OsRng, SIM_RSA_BITS)
                .map_err(|e| format!("cannot generate an RSA key: {e}"))
        };
        let wechatpay = match &self.wechatpay {
            Some(keys) => keys.clone(),
            None => WechatpayKeys {
                signing_key: SigningKey::new(fresh()?),
                serial: s(SIM_WECHATPAY_SERIAL),
                apiv3_key: random_text(APIV3_KEY_BYTES)?.into_bytes(),
                certificate: false,
            },
        };
        let alipay = match &self.alipay {
            Some(keys) => keys.clone(),
            None => AlipayKeys { signing_key: SigningKey::new(fresh()?), app_id: s(SIM_ALIPAY_APP_ID) },
        };
        Ok(Keys {
            generic_secret: self.generic_secret.clone(),
            wechatpay: Some(wechatpay),
            alipay: Some(alipay),
            key_mode: self.key_mode,
        })
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
    /// `--key-mode certificate`: the key is a platform certificate's, under
    /// that certificate's hex serial, which payonce downloads
    /// (`--wechatpay-platform-certs auto`) rather than is configured with.
    pub certificate: bool,
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
    /// This refund's fen (WeChat's `amount.refund`, the generic `amount`).
    pub amount: i64,
    /// The order's fen, what the buyer paid (WeChat's `amount.total`,
    /// Alipay's `total_amount`).
    pub total: i64,
    /// The fen refunded on the trade with this refund included (Alipay's
    /// `refund_fee`, a running total).
    pub refunded_total: i64,
    pub success: bool,
}

impl RefundNotice {
    /// The refund of the whole order, its only one.
    pub fn full(refund_no: String, order_no: String, pay_no: String, amount: i64, success: bool) -> RefundNotice {
        RefundNotice { refund_no, order_no, pay_no, amount, total: amount, refunded_total: amount, success }
    }
}

/// A signed notification, ready to POST.
#[derive(Clone, Debug)]
pub struct Signed {
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl From<Signed> for Req {
    fn from(signed: Signed) -> Req {
        Req::signed(signed.path, signed.headers, signed.body)
    }
}

/// `t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<raw body>")>`, the
/// generic channel's `Payonce-Signature` (docs/channels.md, "The generic
/// callback channel").
fn payonce_signature(secret: &[u8], t: i64, body: &[u8]) -> String {
    // HMAC takes keys of any length.
    let mut mac = match <Hmac<Sha256> as Mac>::new_from_slice(secret) {
        Ok(mac) => mac,
        Err(_) => unreachable!("HMAC takes keys of any length"),
    };
    mac.update(format!("{t}.").as_bytes());
    mac.update(body);
    let digest = mac.finalize().into_bytes();
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("t={t},v1={hex}")
}

fn generic_signed(path: &str, secret: &[u8], body: Value, now_s: i64) -> Result<Signed, String> {
    let body = body.to_string().into_bytes();
    let signature = payonce_signature(secret, now_s, &body);
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
pub(crate) fn rsa_sign(key: &SigningKey<Sha256>, message: &[u8]) -> Result<String, String> {
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
    let mut headers = vec![("Content-Type".into(), "application/json".into())];
    headers.extend(wechatpay_signature_headers(&keys.signing_key, &keys.serial, &body, now_s)?);
    Ok(Signed { path: path.to_owned(), headers, body })
}

/// The headers WeChat Pay signs a body with, its notifications and its
/// merchant API's answers alike: the key's serial, a timestamp, a fresh
/// nonce and SHA256withRSA over `"{timestamp}\n{nonce}\n{body}\n"`.
pub(crate) fn wechatpay_signature_headers(
    signing_key: &SigningKey<Sha256>,
    serial: &str,
    body: &[u8],
    now_s: i64,
) -> Result<Vec<(String, String)>, String> {
    let timestamp = now_s.to_string();
    let nonce = random_text(32)?;
    let mut message = format!("{timestamp}\n{nonce}\n").into_bytes();
    message.extend_from_slice(body);
    message.push(b'\n');
    let signature = rsa_sign(signing_key, &message)?;
    Ok(vec![
        ("Wechatpay-Serial".into(), serial.to_owned()),
        ("Wechatpay-Timestamp".into(), timestamp),
        ("Wechatpay-Nonce".into(), nonce),
        ("Wechatpay-Signature".into(), signature),
        ("Wechatpay-Signature-Type".into(), "WECHATPAY2-SHA256-RSA2048".into()),
    ])
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
pub(crate) fn form_encode(text: &str) -> String {
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
pub(crate) struct ChinaTime {
    date: String,
    time: String,
}

impl ChinaTime {
    /// `2023-11-15T06:13:20+08:00` (WeChat Pay).
    pub(crate) fn rfc3339(&self) -> String {
        format!("{}T{}+08:00", self.date, self.time)
    }

    /// `2023-11-15 06:13:20` (Alipay).
    pub(crate) fn plain(&self) -> String {
        format!("{} {}", self.date, self.time)
    }
}

pub(crate) fn china_time(now_s: i64) -> ChinaTime {
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
pub(crate) fn random_text(n: usize) -> Result<String, String> {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    Ok(random_bytes(n)?.iter().map(|b| char::from(ALPHABET[usize::from(*b) % ALPHABET.len()])).collect())
}

pub(crate) fn random_digits(n: usize) -> Result<String, String> {
    Ok(random_bytes(n)?.iter().map(|b| char::from(b'0' + b % 10)).collect())
}

/// The first entry of a comma-separated list of secrets or tokens.
pub fn first_secret(list: &str) -> Option<String> {
    list.split(',').map(str::trim).find(|s| !s.is_empty()).map(str::to_owned)
}

/// A platform's private key: PKCS#8 PEM (`PRIVATE KEY`), or PKCS#1 (`RSA PRIVATE KEY`).
pub(crate) fn private_key_from_file(flag: &str, path: &str) -> Result<RsaPrivateKey, String> {
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
pub fn platform_keys(opts: &Options, in_process: bool) -> Result<Keys, String> {
    let selected = |c: Platform| opts.channels.contains(&c);
    let mut missing = Vec::new();
    let mut need = |value: &Option<String>, what: &'static str| {
        if value.is_none() && !in_process {
            missing.push(what);
        }
    };
    if selected(Platform::Generic) {
        need(&opts.callback_secret, "--callback-secret (or PAYONCE_CALLBACK_SECRET)");
    }
    if selected(Platform::Wechatpay) {
        need(&opts.wechatpay_private_key, "--wechatpay-private-key");
        need(&opts.wechatpay_serial, "--wechatpay-serial");
        need(&opts.wechatpay_apiv3_key, "--wechatpay-apiv3-key (or PAYONCE_WECHATPAY_APIV3_KEY)");
    }
    if selected(Platform::Alipay) {
        need(&opts.alipay_private_key, "--alipay-private-key");
        need(&opts.alipay_app_id, "--alipay-app-id");
    }
    if opts.key_mode == KeyMode::Certificate && !in_process && selected(Platform::Wechatpay) {
        return Err("--key-mode certificate runs against the in-process payonce only (its simulated WeChat Pay serves the certificates payonce downloads)".into());
    }
    if !missing.is_empty() {
        let channels: Vec<&str> = opts.channels.iter().map(|c| c.name()).collect();
        return Err(format!("--target with --channel {} needs {}", channels.join(","), missing.join(", ")));
    }
    let apiv3_key = opts.wechatpay_apiv3_key.as_ref().filter(|_| selected(Platform::Wechatpay));
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
        let wechatpay = selected(Platform::Wechatpay)
            .then(|| scope.spawn(|| load_or_make("--wechatpay-private-key", &opts.wechatpay_private_key)));
        let alipay = selected(Platform::Alipay)
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
            let certificate = opts.key_mode == KeyMode::Certificate;
            let serial = match &opts.wechatpay_serial {
                Some(serial) => serial.clone(),
                None if certificate => crate::platform_api::new_serial(),
                None => s(SIM_WECHATPAY_SERIAL),
            };
            Some(WechatpayKeys {
                signing_key: SigningKey::new(key),
                serial,
                apiv3_key: apiv3_key.into_bytes(),
                certificate,
            })
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
    Ok(Keys { generic_secret: generic_secret.into_bytes(), wechatpay, alipay, key_mode: opts.key_mode })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fen_become_exact_yuan_strings() {
        for (fen, yuan) in [(0, "0.00"), (1, "0.01"), (5, "0.05"), (99, "0.99"), (100, "1.00"), (9_900, "99.00")] {
            assert_eq!(fen_to_yuan(fen), yuan);
        }
        // What the service parses back is what was meant.
        for fen in [1, 10, 101, 1_007, 123_456, 99_999_999_999] {
            assert_eq!(payonce::recon::yuan_to_fen(&fen_to_yuan(fen), false), Some(fen), "{fen}");
        }
    }

    /// The oracle's own HMAC agrees with the service's verification (and
    /// would catch a change of either).
    #[test]
    fn the_generic_signature_is_the_contracts() {
        let body = br#"{"pay_no":"P1"}"#;
        let header = payonce_signature(b"secret", 1_700_000_000, body);
        assert!(header.starts_with("t=1700000000,v1="), "{header}");
        let verified = payonce::signature::verify(Some(&header), body, &[b"secret".to_vec()], 1_700_000_000);
        assert_eq!(verified, Ok(()));
        assert!(payonce::signature::verify(Some(&header), b"{}", &[b"secret".to_vec()], 1_700_000_000).is_err());
    }

    #[test]
    fn alipay_forms_are_encoded_as_java_does() {
        assert_eq!(form_encode("a b*-_.~/é"), "a+b*-_.%7E%2F%C3%A9");
    }

    /// Signing keys for every channel: the fixture key stands in for both
    /// platforms' (only the fields are read here, not the signatures).
    fn fixture_keys() -> Keys {
        use rsa::pkcs8::DecodePrivateKey;
        let pem = include_str!("../../tests/fixtures/keys/merchant.pem");
        let key = RsaPrivateKey::from_pkcs8_pem(pem).expect("the fixture key");
        Keys {
            generic_secret: b"secret".to_vec(),
            wechatpay: Some(WechatpayKeys {
                signing_key: SigningKey::new(key.clone()),
                serial: SIM_WECHATPAY_SERIAL.into(),
                apiv3_key: b"0123456789abcdef0123456789abcdef".to_vec(),
                certificate: false,
            }),
            alipay: Some(AlipayKeys { signing_key: SigningKey::new(key), app_id: SIM_ALIPAY_APP_ID.into() }),
            key_mode: crate::alipay_certs::KeyMode::PublicKey,
        }
    }

    /// The second of three refunds of a 10.03 yuan order: 2.00 yuan, after
    /// 3.00 yuan refunded before it.
    fn second_of_three(success: bool) -> RefundNotice {
        RefundNotice {
            refund_no: "R2".into(),
            order_no: "ORD_1".into(),
            pay_no: "PAY_1".into(),
            amount: 200,
            total: 1_003,
            refunded_total: 500,
            success,
        }
    }

    fn wechatpay_resource(keys: &Keys, signed: &Signed) -> (Value, Value) {
        let envelope: Value = serde_json::from_slice(&signed.body).expect("JSON");
        let resource = &envelope["resource"];
        let text = |v: &Value| v.as_str().expect("a string").to_owned();
        let ciphertext = base64::engine::general_purpose::STANDARD.decode(text(&resource["ciphertext"])).expect("b64");
        let cipher = Aes256Gcm::new_from_slice(&keys.wechatpay.as_ref().expect("keys").apiv3_key).expect("key");
        let nonce = text(&resource["nonce"]);
        let aad = text(&resource["associated_data"]);
        let plain = cipher
            .decrypt(Nonce::from_slice(nonce.as_bytes()), Payload { msg: &ciphertext, aad: aad.as_bytes() })
            .expect("decrypts");
        (envelope.clone(), serde_json::from_slice(&plain).expect("JSON resource"))
    }

    /// The form's value of `name`, decoded as Java's URLDecoder would.
    fn form_value(signed: &Signed, name: &str) -> Option<String> {
        let body = std::str::from_utf8(&signed.body).expect("utf-8");
        let raw = body.split('&').find_map(|pair| pair.strip_prefix(&format!("{name}=")))?;
        let mut bytes = Vec::new();
        let mut rest = raw.as_bytes();
        while let Some((&b, tail)) = rest.split_first() {
            match b {
                b'+' => bytes.push(b' '),
                b'%' => {
                    let hex = std::str::from_utf8(&tail[..2]).expect("hex");
                    bytes.push(u8::from_str_radix(hex, 16).expect("hex"));
                    rest = &tail[2..];
                    continue;
                }
                _ => bytes.push(b),
            }
            rest = tail;
        }
        Some(String::from_utf8(bytes).expect("utf-8"))
    }

    #[test]
    fn refund_notices_carry_the_refund_the_order_and_the_running_total() {
        let keys = fixture_keys();
        let now = 1_700_000_000;

        let generic = Platform::Generic.sign_refund(&keys, &second_of_three(true), now).expect("signed");
        let body: Value = serde_json::from_slice(&generic.body).expect("JSON");
        assert_eq!((body["amount"].as_i64(), body["status"].as_str()), (Some(200), Some("SUCCESS")));
        assert_eq!(body["refund_no"], "R2");

        let wechatpay = Platform::Wechatpay.sign_refund(&keys, &second_of_three(true), now).expect("signed");
        let (envelope, resource) = wechatpay_resource(&keys, &wechatpay);
        assert_eq!(envelope["event_type"], "REFUND.SUCCESS");
        assert_eq!(
            resource["amount"],
            json!({"total": 1_003, "refund": 200, "payer_total": 1_003, "payer_refund": 200}),
            "{resource}"
        );
        assert_eq!(
            (resource["out_refund_no"].as_str(), resource["refund_status"].as_str()),
            (Some("R2"), Some("SUCCESS"))
        );
        let failed = Platform::Wechatpay.sign_refund(&keys, &second_of_three(false), now).expect("signed");
        let (envelope, resource) = wechatpay_resource(&keys, &failed);
        assert_eq!(
            (envelope["event_type"].as_str(), resource["refund_status"].as_str()),
            (Some("REFUND.CLOSED"), Some("CLOSED"))
        );
        assert_eq!(resource["amount"]["refund"], 200);
        assert!(resource.get("success_time").is_none(), "{resource}");

        let alipay = Platform::Alipay.sign_refund(&keys, &second_of_three(true), now).expect("signed");
        let field = |name: &str| form_value(&alipay, name);
        assert_eq!(field("refund_fee").as_deref(), Some("5.00"), "the running total, not this refund's 2.00");
        assert_eq!(field("total_amount").as_deref(), Some("10.03"));
        assert_eq!(field("out_biz_no").as_deref(), Some("R2"));
        assert_eq!(field("trade_status").as_deref(), Some("TRADE_SUCCESS"), "3.03 yuan is left to refund");
        let last = RefundNotice { refund_no: "R3".into(), amount: 503, refunded_total: 1_003, ..second_of_three(true) };
        let closed = Platform::Alipay.sign_refund(&keys, &last, now).expect("signed");
        assert_eq!(form_value(&closed, "refund_fee").as_deref(), Some("10.03"));
        assert_eq!(form_value(&closed, "trade_status").as_deref(), Some("TRADE_CLOSED"), "nothing is left");
        assert!(Platform::Alipay.sign_refund(&keys, &second_of_three(false), now).is_err(), "no failed notice");

        // A full refund means what it always did: one amount everywhere.
        let full = RefundNotice::full("R1".into(), "ORD_1".into(), "PAY_1".into(), 1_003, true);
        assert_eq!((full.amount, full.total, full.refunded_total), (1_003, 1_003, 1_003));
        let alipay = Platform::Alipay.sign_refund(&keys, &full, now).expect("signed");
        assert_eq!(form_value(&alipay, "refund_fee"), form_value(&alipay, "total_amount"));
    }
}
