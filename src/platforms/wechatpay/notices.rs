//! WeChat Pay's notices: API v3 notifications.
//!
//! Verification, in order: `Wechatpay-Serial` names a configured platform
//! key (compared case-insensitively); `Wechatpay-Signature` is SHA256-RSA over
//! `"{Wechatpay-Timestamp}\n{Wechatpay-Nonce}\n{body}\n"` (the raw bytes);
//! the timestamp is within 5 minutes. Then `resource` is decrypted
//! (AEAD_AES_256_GCM, key = APIv3 key, its `nonce` and `associated_data`; the
//! last 16 bytes of the ciphertext are the tag). `TRANSACTION.*` events are
//! payments (`transaction_id`→pay_no, `out_trade_no`→order_no,
//! `amount.total` in fen, `trade_state`), `REFUND.*` events refund results
//! (`out_refund_no`→refund_no; SUCCESS, or CLOSED/ABNORMAL = failed; a
//! success's `success_time` is kept as the refund's platform time).
//! Success is 204; a refusal is 4xx/5xx with `{"code":"FAIL","message":..}`.

use super::NAME;
use crate::clock::{format_ms, parse_rfc3339_ms};
use crate::domain::{PaymentCallback, PlatformStatus, RefundCallback};
use crate::error::{Error, ErrorKind};
use crate::platforms::{Notice, Notices, Reply};
use crate::wire::{Request, Response, RETRY_AFTER_S};
use aes_gcm::aead::{Aead, Payload};
use aes_gcm::{Aes256Gcm, KeyInit, Nonce};
use base64::Engine;
use rsa::pkcs1v15::{Signature, VerifyingKey};
use rsa::signature::Verifier;
use rsa::RsaPublicKey;
use serde_json::{Map, Value};
use sha2::Sha256;

/// How far `Wechatpay-Timestamp` may be from now, either way.
pub const TIMESTAMP_TOLERANCE_S: i64 = 300;
/// The APIv3 key is 32 bytes.
pub const APIV3_KEY_BYTES: usize = 32;
/// WeChat Pay's deliberate signature probes start with this; they must fail.
const SIGN_TEST_PREFIX: &str = "WECHATPAY/SIGNTEST/";

#[derive(Clone, Debug)]
pub struct WechatpayConfig {
    pub apiv3_key: Vec<u8>,
    /// (serial or `PUB_KEY_ID_...`, key); two during rotation.
    pub platform_keys: Vec<(String, RsaPublicKey)>,
    /// The certificates' ends of validity, by serial.
    pub expiries: super::KeyExpiries,
}

impl WechatpayConfig {
    pub fn new(apiv3_key: &str, platform_keys: Vec<(String, RsaPublicKey)>) -> Result<WechatpayConfig, String> {
        if platform_keys.is_empty() {
            return Err(
                "WeChat Pay needs at least one --wechatpay-public-key SERIAL=FILE (or --wechatpay-platform-certs auto)"
                    .into(),
            );
        }
        WechatpayConfig::downloading(apiv3_key, platform_keys)
    }

    /// The same, where the platform certificates are downloaded: no
    /// configured key is required.
    pub fn downloading(apiv3_key: &str, platform_keys: Vec<(String, RsaPublicKey)>) -> Result<WechatpayConfig, String> {
        if apiv3_key.len() != APIV3_KEY_BYTES {
            return Err(format!("the WeChat Pay APIv3 key must be {APIV3_KEY_BYTES} bytes, got {}", apiv3_key.len()));
        }
        Ok(WechatpayConfig { apiv3_key: apiv3_key.as_bytes().to_vec(), platform_keys, expiries: Vec::new() })
    }
}

/// The serial a signed message names (`Wechatpay-Serial`), trimmed; `None` when absent.
pub(super) fn named_serial(header: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    header("Wechatpay-Serial").map(|v| v.trim().to_owned()).filter(|v| !v.is_empty())
}

/// Verifies a message WeChat Pay signed (a notification, or an answer of
/// its API): `Wechatpay-Signature` by the key that `Wechatpay-Serial` names
/// in `keys` ([`super::Keys::lookup`]: a `PUB_KEY_ID_` serial a configured
/// public key, any other a configured or downloaded certificate), over
/// `"{Wechatpay-Timestamp}\n{Wechatpay-Nonce}\n{body}\n"`, with a timestamp
/// within 5 minutes of `now_ms`.
pub fn verify_signed(
    keys: &super::Keys,
    now_ms: i64,
    header: &dyn Fn(&str) -> Option<String>,
    body: &[u8],
) -> Result<(), Error> {
    let header = |name: &str| header(name).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
    let unauthorized = |why: &str| Error::new(ErrorKind::InvalidSignature, why.to_owned());
    let serial = header("Wechatpay-Serial").ok_or_else(|| unauthorized("Wechatpay-Serial is missing"))?;
    let timestamp = header("Wechatpay-Timestamp").ok_or_else(|| unauthorized("Wechatpay-Timestamp is missing"))?;
    let nonce = header("Wechatpay-Nonce").ok_or_else(|| unauthorized("Wechatpay-Nonce is missing"))?;
    let signature = header("Wechatpay-Signature").ok_or_else(|| unauthorized("Wechatpay-Signature is missing"))?;
    let (key, not_after) = keys.lookup(&serial).ok_or_else(|| {
        // The operator's first question: which key did WeChat Pay sign
        // with, and which does payonce have? (A key given under the
        // wrong serial starts fine and refuses every notification.)
        let named = crate::platforms::printable(&serial);
        crate::log::warn(
            "a WeChat Pay notification names a key payonce does not have",
            &[("serial", &named), ("configured", &keys.serials().join(","))],
        );
        unauthorized(&format!("Wechatpay-Serial {named} names no configured platform key"))
    })?;
    if not_after.is_some_and(|not_after| now_ms > not_after) {
        return Err(unauthorized("the platform certificate Wechatpay-Serial names has expired"));
    }
    if signature.starts_with(SIGN_TEST_PREFIX) {
        return Err(unauthorized("a WECHATPAY/SIGNTEST/ probe signature never verifies"));
    }
    let signature = base64::engine::general_purpose::STANDARD
        .decode(&signature)
        .ok()
        .and_then(|bytes| Signature::try_from(bytes.as_slice()).ok())
        .ok_or_else(|| unauthorized("Wechatpay-Signature is not a base64 RSA signature"))?;
    let mut message = Vec::with_capacity(timestamp.len() + nonce.len() + body.len() + 3);
    for part in [timestamp.as_bytes(), b"\n", nonce.as_bytes(), b"\n", body, b"\n"] {
        message.extend_from_slice(part);
    }
    VerifyingKey::<Sha256>::new(key.clone())
        .verify(&message, &signature)
        .map_err(|_| unauthorized("Wechatpay-Signature does not verify"))?;
    let t: i64 = timestamp.parse().map_err(|_| unauthorized("Wechatpay-Timestamp is not unix seconds"))?;
    if (now_ms.div_euclid(1000) - t).abs() > TIMESTAMP_TOLERANCE_S {
        return Err(Error::new(ErrorKind::SignatureExpired, "Wechatpay-Timestamp is more than 5 minutes from now"));
    }
    Ok(())
}

pub struct Wechatpay {
    /// Replaced by a reload of `--wechatpay-apiv3-key-file`.
    apiv3_key: super::HeldApiv3Key,
    keys: super::HeldKeys,
    /// The certificate downloads (`--wechatpay-platform-certs auto`): a
    /// serial not held is looked for there before the notice is refused.
    downloads: Option<std::sync::Arc<super::certs::Downloads>>,
}

impl Wechatpay {
    /// The notices of `config`, with keys of their own.
    pub fn new(config: WechatpayConfig) -> Wechatpay {
        let keys = super::Keys::configured(config.platform_keys, config.expiries, None);
        Wechatpay {
            apiv3_key: super::HeldApiv3Key::new(config.apiv3_key),
            keys: super::HeldKeys::new(keys),
            downloads: None,
        }
    }

    /// The notices decrypted with `apiv3_key` and verified with `keys`
    /// (both shared with the calls and the downloads, replaced by a reload)
    /// and the certificates `downloads` brings.
    pub(super) fn with_keys(
        apiv3_key: super::HeldApiv3Key,
        keys: super::HeldKeys,
        downloads: Option<std::sync::Arc<super::certs::Downloads>>,
    ) -> Wechatpay {
        Wechatpay { apiv3_key, keys, downloads }
    }

    /// Verified with the keys in use when it arrived; a certificate serial
    /// not held first makes the downloads look for it (at most once every
    /// `--wechatpay-cert-unknown-serial-interval-s`), then the notice is
    /// verified with the keys that brings. A download that failed answers
    /// 503 (WeChat Pay delivers the notice again); a serial still unknown
    /// is refused as before (401).
    fn verify(&self, now_ms: i64, req: &Request) -> Result<(), Error> {
        let header = |name: &str| req.header(name).map(str::to_owned);
        let mut keys = self.keys.current();
        if let (Some(downloads), Some(serial)) = (&self.downloads, named_serial(&header)) {
            if keys.lookup(&serial).is_none() {
                if let Err(super::certs::NotLearned::Failed(why)) = downloads.learn(&serial, now_ms) {
                    return Err(Error::new(
                        ErrorKind::PlatformUnavailable,
                        format!(
                            "Wechatpay-Serial {} is not held yet and the certificate download failed: {why}",
                            crate::platforms::printable(&serial)
                        ),
                    ));
                }
                keys = self.keys.current();
            }
        }
        verify_signed(&keys, now_ms, &header, &req.body)
    }

    /// The decrypted `resource` of an authentic notification.
    fn decrypt(&self, envelope: &Value) -> Result<Value, Error> {
        let resource = &envelope["resource"];
        let text =
            |name: &str| resource[name].as_str().ok_or_else(|| Error::invalid(format!("resource.{name} is missing")));
        if text("algorithm")? != "AEAD_AES_256_GCM" {
            return Err(Error::invalid("resource.algorithm must be AEAD_AES_256_GCM"));
        }
        let nonce = text("nonce")?.as_bytes();
        if nonce.len() != 12 {
            return Err(Error::invalid("resource.nonce must be 12 bytes"));
        }
        let aad = resource["associated_data"].as_str().unwrap_or("").as_bytes();
        let ciphertext = base64::engine::general_purpose::STANDARD
            .decode(text("ciphertext")?)
            .map_err(|_| Error::invalid("resource.ciphertext is not base64"))?;
        let cipher = Aes256Gcm::new_from_slice(&self.apiv3_key.current())
            .map_err(|_| Error::internal("the APIv3 key is not 32 bytes"))?;
        let plain = cipher
            .decrypt(Nonce::from_slice(nonce), Payload { msg: &ciphertext, aad })
            .map_err(|_| Error::invalid("resource does not decrypt with the configured APIv3 key"))?;
        serde_json::from_slice(&plain).map_err(|_| Error::invalid("the decrypted resource is not JSON"))
    }
}

impl Notices for Wechatpay {
    fn name(&self) -> &'static str {
        NAME
    }

    /// `platform keys SERIAL (expires …), PUB_KEY_ID_… (no expiry)`.
    fn describe(&self) -> String {
        let held = self.keys.current();
        let keys: Vec<String> = held
            .platform
            .iter()
            .map(|(serial, _)| {
                let expiry = held.expiries.iter().find(|(s, _)| s.eq_ignore_ascii_case(serial));
                match expiry {
                    Some((_, not_after)) => format!("{serial} (expires {})", crate::clock::format_ms(*not_after)),
                    None => format!("{serial} (no expiry)"),
                }
            })
            .chain(
                held.downloaded
                    .iter()
                    .map(|d| format!("{} (downloaded, expires {})", d.serial, crate::clock::format_ms(d.not_after_ms))),
            )
            .collect();
        format!("platform keys {}", keys.join(", "))
    }

    fn parse(&self, now_ms: i64, req: &Request, _refund_route: bool) -> Result<Notice, Error> {
        self.verify(now_ms, req)?;
        let envelope: Value = serde_json::from_slice(&req.body)
            .map_err(|e| Error::new(ErrorKind::InvalidJson, format!("not JSON: {e}")))?;
        let event_type = envelope["event_type"].as_str().unwrap_or("").to_owned();
        let plain = self.decrypt(&envelope)?;
        let field = |name: &str| {
            plain[name].as_str().map(str::to_owned).ok_or_else(|| Error::invalid(format!("resource {name} is missing")))
        };
        // Classified by the event, whichever of the two URLs it was sent to.
        if let Some(kind) = event_type.strip_prefix("REFUND.") {
            let status = match kind {
                "SUCCESS" => PlatformStatus::Success,
                "CLOSED" | "ABNORMAL" => PlatformStatus::Failed,
                _ => return Err(Error::invalid(format!("unknown refund event {event_type}"))),
            };
            // success_time is sent with a successful refund only.
            let settled_at = match (status, plain["success_time"].as_str().filter(|t| !t.is_empty())) {
                (PlatformStatus::Success, Some(text)) => Some(format_ms(
                    parse_rfc3339_ms(text).ok_or_else(|| Error::invalid("success_time is not RFC 3339"))?,
                )),
                _ => None,
            };
            let amount = match &plain["amount"]["refund"] {
                Value::Null => None,
                refund => Some(
                    refund.as_i64().ok_or_else(|| Error::invalid("resource amount.refund must be an integer (fen)"))?,
                ),
            };
            return Ok(Notice::Refund(RefundCallback {
                channel: NAME.to_owned(),
                refund_no: field("out_refund_no")?,
                order_no: field("out_trade_no")?,
                status,
                settled_at,
                amount,
                refunded_total: None,
            }));
        }
        if !event_type.starts_with("TRANSACTION.") {
            return Err(Error::invalid(format!("unknown event_type {event_type:?}")));
        }
        let amount = plain["amount"]["total"]
            .as_i64()
            .ok_or_else(|| Error::invalid("resource amount.total must be an integer (fen)"))?;
        let status = match field("trade_state")?.as_str() {
            "SUCCESS" => PlatformStatus::Success,
            _ => PlatformStatus::Failed,
        };
        let paid_at = match plain["success_time"].as_str() {
            Some(text) => {
                Some(format_ms(parse_rfc3339_ms(text).ok_or_else(|| Error::invalid("success_time is not RFC 3339"))?))
            }
            None => None,
        };
        Ok(Notice::Payment(PaymentCallback {
            channel: NAME.to_owned(),
            pay_no: field("transaction_id")?,
            order_no: field("out_trade_no")?,
            amount,
            currency: Some(currency_of(&plain["amount"])?),
            status,
            paid_at,
            raw_body: req.body.clone(),
        }))
    }

    fn paid_time_field(&self) -> &'static str {
        super::PAID_TIME_FIELD
    }

    fn acknowledge(&self, _reply: &Reply) -> Response {
        Response { status: 204, headers: Vec::new(), body: Vec::new(), outcome: None }
    }

    fn refuse(&self, err: &Error) -> Response {
        let mut body = Map::new();
        body.insert("code".into(), "FAIL".into());
        body.insert("message".into(), err.message.clone().into());
        let mut response = Response::json(crate::wire::status_of(err.kind), &Value::Object(body));
        if err.kind.is_unavailable() {
            response.headers.push(("Retry-After".into(), RETRY_AFTER_S.to_string()));
        }
        response
    }
}

/// `amount.currency` of a WeChat Pay transaction: CNY when absent (WeChat's
/// default); anything but a string is refused.
pub(crate) fn currency_of(amount: &Value) -> Result<String, Error> {
    match &amount["currency"] {
        Value::Null => Ok("CNY".to_owned()),
        Value::String(currency) => Ok(currency.clone()),
        _ => Err(Error::invalid("resource amount.currency must be a string")),
    }
}
