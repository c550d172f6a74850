//! Alipay's notices: asynchronous notifications (`application/x-www-form-urlencoded`).
//!
//! Alipay signs decoded values, not bytes: the form is decoded in its
//! `charset` (utf-8 or gbk), then RSA2 (SHA256withRSA) is verified over the
//! sorted `k=v&...` string of every parameter except `sign` and
//! `sign_type`, encoded back in that charset: first with empty values kept
//! as `k=` (Alipay's Java SDK), then with them left out (its PHP SDK).
//! Everywhere else an empty value is an absent one. `app_id` must be the
//! merchant's. `total_amount` is a decimal yuan string converted to fen
//! exactly. `TRADE_SUCCESS` or `TRADE_FINISHED` (either may come first) is a
//! payment of `trade_no`, so both for one trade are one payment. A notice
//! carrying `refund_fee` is a refund result, classified before the duplicate
//! check (`out_biz_no`→refund_no, or the order's refund in flight for a full
//! refund's `TRADE_CLOSED`; `gmt_refund` is kept as its platform time);
//! `TRADE_CLOSED` without it is an unpaid close and changes nothing. The
//! answer is the plain text `success`, or `failure` with a 4xx/5xx.

use super::{CURRENCY, NAME};
use crate::clock::{format_ms, local_time_ms, UTC8_OFFSET_MS};
use crate::domain::{PaymentCallback, PlatformStatus, RefundCallback};
use crate::error::{Error, ErrorKind};
use crate::money::yuan_to_fen;
use crate::platforms::{Notice, Notices, Reply};
use crate::wire::{self, Request, Response};
use base64::Engine;
use rsa::pkcs1v15::{Signature, VerifyingKey};
use rsa::signature::Verifier;
use rsa::RsaPublicKey;
use sha2::Sha256;
use std::collections::BTreeMap;

/// Parameters accepted in one notice (Alipay sends about 30).
pub const FORM_FIELDS_MAX: usize = 128;

#[derive(Clone, Debug)]
pub struct AlipayConfig {
    pub public_key: RsaPublicKey,
    pub app_id: String,
}

pub struct Alipay {
    app_id: String,
    /// Alipay's public key (shared with the calls, replaced by a reload).
    keys: super::HeldKeys,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Charset {
    Utf8,
    Gbk,
}

impl Alipay {
    /// The notices of `config`, with a key of their own.
    pub fn new(config: AlipayConfig) -> Alipay {
        let keys = super::Keys { public_key: config.public_key, app_private: None, certs: None };
        Alipay { app_id: config.app_id, keys: super::HeldKeys::new(keys) }
    }

    /// The notices of `app_id`, verified with the public key of `keys`.
    pub(super) fn with_keys(app_id: String, keys: super::HeldKeys) -> Alipay {
        Alipay { app_id, keys }
    }

    /// The decoded form, verified.
    fn verified_form(&self, req: &Request) -> Result<BTreeMap<String, String>, Error> {
        if let Some(media_type) = wire::media_type(req) {
            if !media_type.eq_ignore_ascii_case("application/x-www-form-urlencoded") {
                return Err(Error::new(
                    ErrorKind::UnsupportedMediaType,
                    "Alipay notices are application/x-www-form-urlencoded",
                ));
            }
        }
        let raw = wire::split_form(&req.body, FORM_FIELDS_MAX)?;
        let charset = match raw.iter().find(|(k, _)| k == "charset").map(|(_, v)| v.to_ascii_lowercase()) {
            None => Charset::Utf8,
            Some(c) if c == b"utf-8" || c == b"utf8" => Charset::Utf8,
            Some(c) if c == b"gbk" || c == b"gb2312" => Charset::Gbk,
            Some(_) => return Err(Error::invalid("charset must be utf-8 or gbk")),
        };
        let mut form = BTreeMap::new();
        for (key, value) in raw {
            let value =
                decode(&value, charset).ok_or_else(|| Error::invalid(format!("{key} is not valid in the charset")))?;
            if form.insert(key.clone(), value).is_some() {
                return Err(Error::invalid(format!("parameter {key} appears twice")));
            }
        }
        let unauthorized = |why: &str| Error::new(ErrorKind::InvalidSignature, why.to_owned());
        match form.get("sign_type").map(String::as_str) {
            None | Some("RSA2") => {}
            Some(_) => return Err(unauthorized("sign_type must be RSA2")),
        }
        let signature = form
            .get("sign")
            .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
            .and_then(|bytes| Signature::try_from(bytes.as_slice()).ok())
            .ok_or_else(|| unauthorized("sign is missing or not a base64 RSA signature"))?;
        // Alipay's SDKs disagree on empty values: the Java SDK
        // (AlipaySignature.getSignCheckContentV1) and python-alipay-sdk keep
        // them as `k=`, the PHP SDK leaves them out. Both strings are
        // deterministic functions of the decoded form, so either verifying
        // is a signature by Alipay's key; the second is built only when the
        // form has an empty value (otherwise the two are the same string).
        let key = VerifyingKey::<Sha256>::new(self.keys.current().public_key.clone());
        let verifies = |keep_empty: bool| {
            let content = sign_check_content(&form, keep_empty);
            let signed_bytes = match charset {
                Charset::Utf8 => content.into_bytes(),
                Charset::Gbk => encoding_rs::GBK.encode(&content).0.into_owned(),
            };
            key.verify(&signed_bytes, &signature).is_ok()
        };
        let has_empty = form.iter().any(|(k, v)| v.is_empty() && k != "sign" && k != "sign_type");
        if !(verifies(true) || (has_empty && verifies(false))) {
            return Err(unauthorized("the RSA2 sign does not verify"));
        }
        if form.get("app_id") != Some(&self.app_id) {
            let named = crate::platforms::printable(form.get("app_id").map(String::as_str).unwrap_or(""));
            crate::log::warn(
                "an Alipay notification names another app_id",
                &[("app_id", &named), ("configured", &self.app_id)],
            );
            return Err(unauthorized(&format!("app_id {named} is not this merchant's")));
        }
        Ok(form)
    }
}

impl Notices for Alipay {
    fn name(&self) -> &'static str {
        NAME
    }

    fn describe(&self) -> String {
        match &self.keys.current().certs {
            None => format!("app_id {}, public-key mode (Alipay public key)", self.app_id),
            Some(certs) => format!(
                "app_id {}, certificate mode (Alipay public certificate {} expires {}, app_cert_sn {}, \
                 alipay_root_cert_sn {})",
                self.app_id,
                certs.alipay.sn,
                crate::clock::format_ms(certs.alipay.not_after_ms),
                certs.app.sn,
                certs.root_sn
            ),
        }
    }

    fn parse(&self, _now_ms: i64, req: &Request, _refund_route: bool) -> Result<Notice, Error> {
        let form = self.verified_form(req)?;
        let get = |name: &str| form.get(name).map(String::as_str).filter(|v| !v.is_empty());
        let required =
            |name: &str| get(name).map(str::to_owned).ok_or_else(|| Error::invalid(format!("{name} is required")));
        let trade_no = required("trade_no")?;
        let order_no = required("out_trade_no")?;
        // A refund result first: its trade_no is the payment's, so the
        // duplicate check of the payment must never see it.
        if let Some(refund_fee) = get("refund_fee") {
            return refund_notice(refund_fee, get("gmt_refund"), get("out_biz_no"), trade_no, order_no);
        }
        match get("trade_status") {
            Some("TRADE_SUCCESS") | Some("TRADE_FINISHED") => {}
            Some("TRADE_CLOSED") => return Ok(Notice::Ignored("an unpaid trade was closed")),
            Some("WAIT_BUYER_PAY") => return Ok(Notice::Ignored("the buyer has not paid yet")),
            _ => {
                return Err(Error::invalid(
                    "trade_status must be TRADE_SUCCESS, TRADE_FINISHED, TRADE_CLOSED or WAIT_BUYER_PAY",
                ))
            }
        }
        let amount = get("total_amount").and_then(|t| yuan_to_fen(t, false)).ok_or_else(|| {
            Error::invalid("total_amount must be yuan with at most two decimals, no sign or exponent")
        })?;
        let paid_at = match get("gmt_payment") {
            Some(text) => Some(format_ms(
                local_time_ms(text, UTC8_OFFSET_MS)
                    .ok_or_else(|| Error::invalid("gmt_payment must be YYYY-MM-DD HH:MM:SS"))?,
            )),
            None => None,
        };
        Ok(Notice::Payment(PaymentCallback {
            channel: NAME.to_owned(),
            pay_no: trade_no,
            order_no,
            amount,
            // Alipay's domestic API quotes every amount in CNY yuan (docs/channels.md).
            currency: Some(CURRENCY.to_owned()),
            status: PlatformStatus::Success,
            paid_at,
            raw_body: req.body.clone(),
        }))
    }

    fn paid_time_field(&self) -> &'static str {
        super::PAID_TIME_FIELD
    }

    fn acknowledge(&self, _reply: &Reply) -> Response {
        plain_text(200, "success")
    }

    fn refuse(&self, err: &Error) -> Response {
        plain_text(wire::status_of(err.kind), "failure")
    }
}

/// A refund result: of the request `out_biz_no` names, or of the order's
/// refund in flight when it names none.
fn refund_notice(
    refund_fee: &str,
    gmt_refund: Option<&str>,
    out_biz_no: Option<&str>,
    trade_no: String,
    order_no: String,
) -> Result<Notice, Error> {
    // refund_fee is the trade's refunded total so far, this refund included.
    let refunded_total = yuan_to_fen(refund_fee, false)
        .ok_or_else(|| Error::invalid("refund_fee must be yuan with at most two decimals"))?;
    // gmt_refund: Beijing time, with milliseconds as Alipay sends it
    // (`2015-04-28 15:45:57.320`) or without.
    let settled_at = match gmt_refund {
        Some(text) => Some(format_ms(
            local_time_ms(text, UTC8_OFFSET_MS)
                .ok_or_else(|| Error::invalid("gmt_refund must be YYYY-MM-DD HH:MM:SS[.SSS]"))?,
        )),
        None => None,
    };
    Ok(match out_biz_no {
        Some(out_biz_no) => Notice::Refund(RefundCallback {
            channel: NAME.to_owned(),
            refund_no: out_biz_no.to_owned(),
            order_no,
            status: PlatformStatus::Success,
            settled_at,
            amount: None,
            refunded_total: Some(refunded_total),
        }),
        // A full refund (TRADE_CLOSED + gmt_refund) may name no
        // request: it settles the order's refund in flight, if there
        // is one, else it is the trade's own (unexpected) refund.
        // The look-up happens inside the refund's transaction.
        None => Notice::RefundInFlight(RefundCallback {
            channel: NAME.to_owned(),
            refund_no: trade_no,
            order_no,
            status: PlatformStatus::Success,
            settled_at,
            amount: None,
            refunded_total: Some(refunded_total),
        }),
    })
}

/// The string Alipay signs: every parameter except `sign` and `sign_type`,
/// sorted by name (the form is a BTreeMap), as `k=v` joined by `&`; empty
/// values kept as `k=` or left out.
fn sign_check_content(form: &BTreeMap<String, String>, keep_empty: bool) -> String {
    form.iter()
        .filter(|(k, v)| (keep_empty || !v.is_empty()) && k.as_str() != "sign" && k.as_str() != "sign_type")
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("&")
}

fn plain_text(status: u16, text: &str) -> Response {
    Response {
        status,
        headers: vec![("Content-Type".into(), "text/plain; charset=utf-8".into())],
        body: text.as_bytes().to_vec(),
        outcome: None,
    }
}

fn decode(bytes: &[u8], charset: Charset) -> Option<String> {
    match charset {
        Charset::Utf8 => String::from_utf8(bytes.to_vec()).ok(),
        Charset::Gbk => {
            let (text, _, had_errors) = encoding_rs::GBK.decode(bytes);
            (!had_errors).then(|| text.into_owned())
        }
    }
}
