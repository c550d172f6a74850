//! Alipay's calls: OpenAPI, the merchant's side: a form POSTed to the gateway with
//! `app_id, method, format=JSON, charset=utf-8, sign_type=RSA2, timestamp`
//! (Beijing time), `version=1.0, biz_content` and `sign`, RSA2 over every
//! non-empty parameter but `sign`, sorted; the answer's `*_response` value
//! verified, as the exact text it is in the body, with the Alipay public key,
//! then checked to name the `out_trade_no` asked about.

use super::{CURRENCY, NAME};
use crate::domain::PlatformStatus;
use crate::platforms::{
    agent, beijing_plain, body_text, unusable, Calls, CloseAnswer, Exchange, MerchantKey, Payment, PrepayAnswer,
    RefundAnswer, RefundState, TradeState,
};
use crate::platforms::{PrepayRequest, RefundRequest};
use base64::Engine as _;
use rsa::pkcs1v15::{Signature, VerifyingKey};
use rsa::signature::Verifier;
use rsa::RsaPublicKey;
use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::Value;
use sha2::Sha256;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

pub const GATEWAY_DEFAULT: &str = "https://openapi.alipay.com/gateway.do";

/// Alipay's `out_trade_no`: up to 64 characters of `[A-Za-z0-9_]`.
pub fn can_carry(order_no: &str) -> bool {
    (1..=64).contains(&order_no.len()) && order_no.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

pub struct AlipayApi {
    pub app_id: String,
    /// The app key requests are signed with, Alipay's public key answers
    /// are verified with (and, in certificate mode, the SNs); a reload
    /// replaces them.
    keys: super::HeldKeys,
    pub gateway: String,
    agent: ureq::Agent,
    /// The `alipay_cert_sn`s of verified answers that were not the
    /// configured certificate's, each logged once.
    rotations_seen: parking_lot::Mutex<std::collections::HashSet<String>>,
}

impl AlipayApi {
    pub fn new(
        app_id: String,
        key: MerchantKey,
        gateway: &str,
        alipay_key: RsaPublicKey,
        timeout: Duration,
    ) -> AlipayApi {
        let keys = super::Keys { public_key: alipay_key, app_private: Some(Arc::new(key)), certs: None };
        AlipayApi::with_keys(app_id, gateway, super::HeldKeys::new(keys), timeout)
    }

    /// The calls signed and verified with `keys` (shared with the notices).
    pub(super) fn with_keys(app_id: String, gateway: &str, keys: super::HeldKeys, timeout: Duration) -> AlipayApi {
        AlipayApi {
            app_id,
            keys,
            gateway: gateway.to_owned(),
            agent: agent(timeout),
            rotations_seen: parking_lot::Mutex::default(),
        }
    }

    /// The signed form of one call with `extra` common parameters
    /// (`notify_url`, `return_url`), signed with the rest.
    fn form_with(
        &self,
        method: &str,
        biz_content: &str,
        extra: &[(&'static str, &str)],
        now_ms: i64,
    ) -> Result<BTreeMap<&'static str, String>, String> {
        // yyyy-MM-dd HH:mm:ss in Beijing time.
        let timestamp = beijing_plain(now_ms);
        let mut form: BTreeMap<&'static str, String> = BTreeMap::from([
            ("app_id", self.app_id.clone()),
            ("method", method.to_owned()),
            ("format", "JSON".to_owned()),
            ("charset", "utf-8".to_owned()),
            ("sign_type", "RSA2".to_owned()),
            ("timestamp", timestamp),
            ("version", "1.0".to_owned()),
            ("biz_content", biz_content.to_owned()),
        ]);
        form.extend(extra.iter().map(|(k, v)| (*k, (*v).to_owned())));
        let keys = self.keys.current();
        if let Some(certs) = &keys.certs {
            // Certificate mode: the SNs are common parameters, signed with the rest.
            form.insert("app_cert_sn", certs.app.sn.clone());
            form.insert("alipay_root_cert_sn", certs.root_sn.clone());
        }
        let content = sign_content(&form);
        let key = keys.app_private.as_deref().ok_or("no --alipay-app-private-key")?;
        form.insert("sign", key.sign_base64(content.as_bytes())?);
        Ok(form)
    }

    /// One signed call of `method`: the verified `*_response`, or why
    /// there is none (with the status and text received).
    fn call(&self, method: &str, biz: &str, now_ms: i64) -> Result<Answered, Unanswered> {
        self.call_with(method, biz, &[], now_ms)
    }

    /// [`AlipayApi::call`] with `extra` common parameters.
    fn call_with(
        &self,
        method: &str,
        biz: &str,
        extra: &[(&'static str, &str)],
        now_ms: i64,
    ) -> Result<Answered, Unanswered> {
        let form = self.form_with(method, biz, extra, now_ms).map_err(|e| (None, String::new(), e))?;
        let sent = self
            .agent
            .post(&self.gateway)
            .header("Accept", "application/json")
            .send_form(form.iter().map(|(k, v)| (*k, v.as_str())));
        let mut answer = sent.map_err(|e| (None, e.to_string(), format!("no answer: {e}")))?;
        let status = answer.status().as_u16();
        let text = body_text(&mut answer).map_err(|e| (Some(status), String::new(), e))?;
        match self.verified_response(&text, method) {
            Ok(response) => Ok((status, text, response)),
            Err(why) => Err((Some(status), text, why)),
        }
    }

    /// The `*_response` object of `method`'s answer once its `sign` verifies
    /// over the exact text of that value: the member that is verified is the
    /// member that is read (docs/channels.md, "Alipay answers"). In
    /// certificate mode an answer naming another `alipay_cert_sn` than the
    /// configured certificate's is still verified with the key payonce
    /// holds, and logged once per SN as a rotation (docs/channels.md, "Keys
    /// and rotation").
    fn verified_response(&self, body: &str, method: &str) -> Result<Value, String> {
        let name = format!("{}_response", method.replace('.', "_"));
        let (signed, sign, cert_sn) = signed_member(body, &name)?;
        let signature = base64::engine::general_purpose::STANDARD
            .decode(sign)
            .ok()
            .and_then(|bytes| Signature::try_from(bytes.as_slice()).ok())
            .ok_or("the answer's sign is not a base64 RSA signature")?;
        let keys = self.keys.current();
        let verified = VerifyingKey::<Sha256>::new(keys.public_key.clone()).verify(signed.as_bytes(), &signature);
        if let (Some(named), Some(certs)) = (cert_sn.as_deref(), &keys.certs) {
            if named != certs.alipay.sn {
                self.rotation(named, &certs.alipay.sn, verified.is_ok());
            }
        }
        verified.map_err(|_| "the answer's sign does not verify".to_owned())?;
        let response: Value = serde_json::from_str(signed).map_err(|_| format!("{name} is not JSON"))?;
        if !response.is_object() {
            return Err(format!("{name} is not an object"));
        }
        Ok(response)
    }

    /// Logs, once per SN, an answer naming the Alipay certificate `named`
    /// while payonce holds `configured`'s: Alipay is moving to a new
    /// certificate, which the operator installs with `SIGHUP`.
    fn rotation(&self, named: &str, configured: &str, verified: bool) {
        let named = crate::platforms::printable(named);
        let mut seen = self.rotations_seen.lock();
        // Bounded: a verified answer is Alipay's, and a forger may add a few.
        if seen.len() >= 64 || !seen.insert(named.clone()) {
            return;
        }
        drop(seen);
        let verified = if verified { "yes" } else { "no" };
        crate::log::warn(
            "an Alipay answer names another alipay_cert_sn than the configured Alipay public certificate: \
             Alipay is rotating its certificate; install the new one with --alipay-public-cert and SIGHUP",
            &[("alipay_cert_sn", &named), ("configured", &configured), ("verified_with_held_key", &verified)],
        );
    }
}

/// The top-level members of a JSON object in the order written, repeats
/// kept (a map would keep one of them silently), each value as its exact text.
struct Members<'b>(Vec<(String, &'b RawValue)>);

impl<'de> serde::Deserialize<'de> for Members<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Members<'de>, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Members<'de>, A::Error> {
                let mut members = Vec::new();
                while let Some(member) = map.next_entry::<String, &'de RawValue>()? {
                    members.push(member);
                }
                Ok(Members(members))
            }
        }
        deserializer.deserialize_map(Visit)
    }
}

/// The exact text of the one top-level member `name` of the JSON object
/// `body` (what Alipay signed) and its `sign`. Anything else is refused:
/// a body that is not one JSON object, a top-level member written twice
/// (`name` or `sign`: which copy would be read is a parser's choice), or
/// any other `*_response` member beside it (another method's answer).
/// A copy of `name` nested deeper is part of some member's text: only the
/// top-level one is verified, and only it is read.
/// Also answers the top-level `alipay_cert_sn` (certificate mode), if any.
fn signed_member<'b>(body: &'b str, name: &str) -> Result<(&'b str, String, Option<String>), String> {
    let Members(members) = serde_json::from_str(body).map_err(|_| "the answer is not one JSON object".to_owned())?;
    let mut seen = std::collections::HashSet::new();
    if let Some((repeated, _)) = members.iter().find(|(key, _)| !seen.insert(key.as_str())) {
        return Err(format!("the answer holds {repeated} more than once"));
    }
    let responses: Vec<&str> =
        members.iter().map(|(key, _)| key.as_str()).filter(|k| k.ends_with("_response")).collect();
    if responses != [name] {
        return Err(format!("the answer must hold exactly one *_response member, {name}; it holds {responses:?}"));
    }
    let member = |wanted: &str| members.iter().find(|(key, _)| key == wanted).map(|(_, value)| *value);
    let signed = member(name).ok_or_else(|| format!("the answer has no {name}"))?;
    let sign = member("sign")
        .and_then(|raw| serde_json::from_str::<String>(raw.get()).ok())
        .ok_or("the answer is not signed")?;
    let cert_sn = member("alipay_cert_sn").and_then(|raw| serde_json::from_str::<String>(raw.get()).ok());
    Ok((signed.get(), sign, cert_sn))
}

/// A call's `biz_content`, members in this order, those without a value left out.
#[derive(Serialize)]
struct Biz<'a> {
    /// The order, or, for a payment's refund, the payment (`trade_no`).
    #[serde(skip_serializing_if = "Option::is_none")]
    out_trade_no: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    trade_no: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    refund_amount: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    out_request_no: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    refund_reason: Option<&'a str>,
}

impl<'a> Biz<'a> {
    fn of(out_trade_no: &'a str) -> Biz<'a> {
        Biz {
            out_trade_no: Some(out_trade_no),
            trade_no: None,
            refund_amount: None,
            out_request_no: None,
            refund_reason: None,
        }
    }

    /// Of the order `order_no`, or of the payment `pay_no` when one is named.
    fn of_trade(order_no: &'a str, pay_no: Option<&'a str>) -> Biz<'a> {
        match pay_no {
            Some(trade_no) => Biz { out_trade_no: None, trade_no: Some(trade_no), ..Biz::of(order_no) },
            None => Biz::of(order_no),
        }
    }

    fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// The payment methods, each with its OpenAPI method and `product_code`
/// (precreate, a QR code the buyer scans, takes none).
const PREPAY_METHODS: &[&str] = &["precreate", "page", "wap", "app"];
const PRECREATE: &str = "alipay.trade.precreate";

fn prepay_method(method: &str) -> Option<(&'static str, Option<&'static str>)> {
    Some(match method {
        "precreate" => (PRECREATE, None),
        "page" => ("alipay.trade.page.pay", Some("FAST_INSTANT_TRADE_PAY")),
        "wap" => ("alipay.trade.wap.pay", Some("QUICK_WAP_WAY")),
        "app" => ("alipay.trade.app.pay", Some("QUICK_MSECURITY_PAY")),
        _ => return None,
    })
}

/// A payment's `biz_content`, members in this order.
#[derive(Serialize)]
struct PrepayBiz<'a> {
    out_trade_no: &'a str,
    total_amount: String,
    subject: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    product_code: Option<&'static str>,
    time_expire: String,
}

impl AlipayApi {
    /// The OpenAPI method and `biz_content` of a payment, or why payonce
    /// cannot send it.
    fn prepay_biz(request: &PrepayRequest<'_>) -> Result<(&'static str, String), String> {
        let (method, product_code) = prepay_method(request.method)
            .ok_or_else(|| format!("Alipay has no payment method {:?}", request.method))?;
        if !can_carry(request.order_no) {
            return Err("Alipay cannot carry this order_no (up to 64 characters of [A-Za-z0-9_])".into());
        }
        if request.currency != CURRENCY {
            return Err(format!("Alipay takes {CURRENCY}, and this order is in {}", request.currency));
        }
        let biz = PrepayBiz {
            out_trade_no: request.order_no,
            total_amount: crate::money::fen_to_yuan(request.amount),
            subject: request.description,
            product_code,
            time_expire: beijing_plain(request.expires_at_ms),
        };
        Ok((method, serde_json::to_string(&biz).unwrap_or_default()))
    }

    /// Page, wap and app: no call, a request signed for the buyer to open:
    /// the gateway URL with the signed form (page, wap: `url`), or the
    /// signed form itself (app: `order_string`).
    fn signed_for_buyer(
        &self,
        request: &PrepayRequest<'_>,
        method: &str,
        biz: &str,
        now_ms: i64,
    ) -> Exchange<PrepayAnswer> {
        let sent = format!("{} method={method} biz_content={biz}", self.gateway);
        let mut extra = vec![("notify_url", request.notify_url)];
        extra.extend(request.return_url.filter(|_| request.method != "app").map(|url| ("return_url", url)));
        let form = match self.form_with(method, biz, &extra, now_ms) {
            Ok(form) => form,
            Err(why) => return Exchange::unknown(sent, None, String::new(), why, PrepayAnswer::Unknown),
        };
        let encoded = form_encode(&form);
        let payment = if request.method == "app" {
            Payment::of(&[("order_string", &encoded)])
        } else {
            let joint = if self.gateway.contains('?') { '&' } else { '?' };
            Payment::of(&[("url", &format!("{}{joint}{encoded}", self.gateway))])
        };
        Exchange {
            request: sent,
            http_status: None,
            response: format!("not sent: {method} is signed for the buyer to open"),
            meaning: PrepayAnswer::Created(payment),
            distrust: None,
        }
    }
}

/// What a verified `alipay_trade_precreate_response` means: success naming
/// this trade with a `qr_code` is created; `ACQ.TRADE_HAS_SUCCESS` paid,
/// `ACQ.TRADE_HAS_CLOSE` closed; Alipay's own failure (`20000`) no answer;
/// any other code a refusal.
fn precreate_meaning(response: &Value, order_no: &str) -> Result<PrepayAnswer, String> {
    let text = |name: &str| response[name].as_str().filter(|v| !v.is_empty());
    match (text("code"), text("sub_code")) {
        (Some("10000"), _) => {
            if response["out_trade_no"] != order_no {
                return Err("the answer names another out_trade_no".into());
            }
            let qr_code = text("qr_code").ok_or("the answer has no qr_code")?;
            Ok(PrepayAnswer::Created(Payment::of(&[("qr_code", qr_code)])))
        }
        (_, Some("ACQ.TRADE_HAS_SUCCESS")) => Ok(PrepayAnswer::Paid),
        (_, Some("ACQ.TRADE_HAS_CLOSE")) => Ok(PrepayAnswer::Closed),
        (None, _) | (Some("20000"), _) => Err("Alipay could not answer".into()),
        (Some(code), sub_code) => Ok(PrepayAnswer::Refused {
            code: sub_code.unwrap_or(code).to_owned(),
            message: text("sub_msg").or(text("msg")).unwrap_or_default().to_owned(),
        }),
    }
}

/// `k=v&...` of a form, each name and value percent-encoded (all but
/// `[A-Za-z0-9*-._~]`), as a browser or Alipay's app SDK sends it.
fn form_encode(form: &BTreeMap<&'static str, String>) -> String {
    let encode = |text: &str| -> String {
        text.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'*' | b'-' | b'.' | b'_' | b'~' => char::from(b).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect()
    };
    form.iter().map(|(k, v)| format!("{}={}", encode(k), encode(v))).collect::<Vec<_>>().join("&")
}

impl Calls for AlipayApi {
    fn name(&self) -> &'static str {
        NAME
    }

    fn endpoint(&self) -> &str {
        &self.gateway
    }

    /// `alipay.trade.query`: the trade's state.
    fn query(&self, order_no: &str, now_ms: i64) -> Exchange<TradeState> {
        const METHOD: &str = "alipay.trade.query";
        let biz = Biz::of(order_no).to_json();
        let request = format!("POST {} method={METHOD} biz_content={biz}", self.gateway);
        if !can_carry(order_no) {
            return Exchange::<TradeState>::not_carried(request, "Alipay");
        }
        let unknown = |status: Option<u16>, response: String, why: String| {
            Exchange::unknown(request.clone(), status, response, why, TradeState::Unknown)
        };
        let (status, text, response) = match self.call(METHOD, &biz, now_ms) {
            Ok(answered) => answered,
            Err((status, text, why)) => return unknown(status, text, why),
        };
        let meaning = match (response["code"].as_str(), response["sub_code"].as_str()) {
            (Some("10000"), _) => {
                if response["out_trade_no"] != order_no {
                    return unknown(Some(status), text, "the answer names another out_trade_no".into());
                }
                match trade_state(&response) {
                    Some(state) => state,
                    None => return unknown(Some(status), text, "the answer's trade_status is unknown".into()),
                }
            }
            (Some("40004"), Some("ACQ.TRADE_NOT_EXIST")) => TradeState::NotPaid { paying: false },
            _ => return unknown(Some(status), text, "Alipay refused the call".into()),
        };
        if let Some(why) = unusable(&meaning) {
            return unknown(Some(status), text, why);
        }
        Exchange { request, http_status: Some(status), response: text, meaning, distrust: None }
    }

    /// `alipay.trade.close`: success, `ACQ.TRADE_NOT_EXIST` and a closed
    /// trade mean closed; `ACQ.TRADE_STATUS_ERROR` (paid, or closed
    /// already) means query again and decide.
    fn close(&self, order_no: &str, now_ms: i64) -> Exchange<CloseAnswer> {
        const METHOD: &str = "alipay.trade.close";
        let biz = Biz::of(order_no).to_json();
        let request = format!("POST {} method={METHOD} biz_content={biz}", self.gateway);
        if !can_carry(order_no) {
            return Exchange::<CloseAnswer>::not_carried(request, "Alipay");
        }
        let (status, text, response) = match self.call(METHOD, &biz, now_ms) {
            Ok(answered) => answered,
            Err((status, text, why)) => return Exchange::unknown(request, status, text, why, CloseAnswer::Unknown),
        };
        let meaning = match (response["code"].as_str(), response["sub_code"].as_str()) {
            (Some("10000"), _) if response.get("out_trade_no").is_none_or(|n| n == order_no) => CloseAnswer::Closed,
            (Some("40004"), Some("ACQ.TRADE_NOT_EXIST")) => CloseAnswer::Closed,
            (Some("40004"), Some("ACQ.TRADE_STATUS_ERROR")) => CloseAnswer::Paid,
            _ => {
                return Exchange::unknown(
                    request,
                    Some(status),
                    text,
                    "Alipay refused the close".into(),
                    CloseAnswer::Unknown,
                )
            }
        };
        Exchange { request, http_status: Some(status), response: text, meaning, distrust: None }
    }

    /// `alipay.trade.refund` with `out_request_no` = refund_no (Alipay's
    /// idempotency key): success is accepted, also for a repeat
    /// (`fund_change` `N`: the money moved the first time).
    fn refund(&self, refund: &RefundRequest<'_>, now_ms: i64) -> Exchange<RefundAnswer> {
        let RefundRequest { order_no, refund_no, amount, currency, reason, pay_no, .. } = *refund;
        const METHOD: &str = "alipay.trade.refund";
        let refund_amount = crate::money::fen_to_yuan(amount);
        let biz = Biz {
            refund_amount: Some(&refund_amount),
            out_request_no: Some(refund_no),
            refund_reason: reason,
            ..Biz::of_trade(order_no, pay_no)
        };
        let biz = biz.to_json();
        let request = format!("POST {} method={METHOD} biz_content={biz}", self.gateway);
        // `refund_amount` is yuan: an order in another currency cannot be
        // refunded through this API without refunding the wrong money.
        if currency != CURRENCY {
            let why = format!("not sent: Alipay refunds {}, and this order is in {currency}", CURRENCY);
            return Exchange::unknown(request, None, String::new(), why, RefundAnswer::NotSendable);
        }
        match self.call(METHOD, &biz, now_ms) {
            Ok((status, text, response))
                if response["code"] == "10000"
                    && response.get("out_trade_no").is_none_or(|n| n == order_no)
                    && pay_no.is_none_or(|pay_no| response.get("trade_no").is_none_or(|n| n == pay_no)) =>
            {
                Exchange {
                    request,
                    http_status: Some(status),
                    response: text,
                    meaning: RefundAnswer::Accepted,
                    distrust: None,
                }
            }
            Ok((status, text, _)) => Exchange::unknown(
                request,
                Some(status),
                text,
                "Alipay did not accept the refund".into(),
                RefundAnswer::Unknown,
            ),
            Err((status, text, why)) => Exchange::unknown(request, status, text, why, RefundAnswer::Unknown),
        }
    }

    /// `alipay.trade.fastpay.refund.query`: `refund_status` REFUND_SUCCESS
    /// settles it; without `refund_status` it is not yet, never failed.
    fn refund_query(
        &self,
        order_no: &str,
        refund_no: &str,
        pay_no: Option<&str>,
        now_ms: i64,
    ) -> Exchange<RefundState> {
        const METHOD: &str = "alipay.trade.fastpay.refund.query";
        let biz = Biz { out_request_no: Some(refund_no), ..Biz::of_trade(order_no, pay_no) }.to_json();
        let request = format!("POST {} method={METHOD} biz_content={biz}", self.gateway);
        let (status, text, response) = match self.call(METHOD, &biz, now_ms) {
            Ok(answered) => answered,
            Err((status, text, why)) => return Exchange::unknown(request, status, text, why, RefundState::Unknown),
        };
        if response["code"] != "10000" || response.get("out_trade_no").is_some_and(|n| n != order_no) {
            return Exchange::unknown(
                request,
                Some(status),
                text,
                "Alipay refused the query".into(),
                RefundState::Unknown,
            );
        }
        let meaning = match response["refund_status"].as_str() {
            Some("REFUND_SUCCESS") => RefundState::Settled(PlatformStatus::Success),
            _ => RefundState::NotYet,
        };
        Exchange { request, http_status: Some(status), response: text, meaning, distrust: None }
    }

    fn prepay_methods(&self) -> &'static [&'static str] {
        PREPAY_METHODS
    }

    fn prepay_check(&self, request: &PrepayRequest<'_>) -> Result<(), String> {
        Self::prepay_biz(request).map(drop)
    }

    fn prepay_is_signed_only(&self, method: &str) -> bool {
        prepay_method(method).is_some_and(|(api_method, _)| api_method != PRECREATE)
    }

    /// `alipay.trade.precreate` (one call: the `qr_code`), or, for page,
    /// wap and app, a request signed for the buyer to open (no call).
    fn prepay(&self, prepay: &PrepayRequest<'_>, now_ms: i64) -> Exchange<PrepayAnswer> {
        let (method, biz) = match Self::prepay_biz(prepay) {
            Ok(made) => made,
            Err(why) => return Exchange::not_sendable(format!("POST {} method={}", self.gateway, prepay.method), why),
        };
        if method != PRECREATE {
            return self.signed_for_buyer(prepay, method, &biz, now_ms);
        }
        let request = format!("POST {} method={method} biz_content={biz}", self.gateway);
        let (status, text, response) = match self.call_with(method, &biz, &[("notify_url", prepay.notify_url)], now_ms)
        {
            Ok(answered) => answered,
            Err((status, text, why)) => return Exchange::unknown(request, status, text, why, PrepayAnswer::Unknown),
        };
        let meaning = match status {
            200 => precreate_meaning(&response, prepay.order_no),
            _ => Err(format!("HTTP {status}")),
        };
        match meaning {
            Ok(meaning) => Exchange { request, http_status: Some(status), response: text, meaning, distrust: None },
            Err(why) => Exchange::unknown(request, Some(status), text, why, PrepayAnswer::Unknown),
        }
    }
}

/// A verified answer: (HTTP status, body, the `*_response` object).
type Answered = (u16, String, Value);
/// No trusted answer: (HTTP status if any, what was received, why).
type Unanswered = (Option<u16>, String, String);

/// Every non-empty parameter but `sign`, sorted by name, `k=v` joined by `&`.
fn sign_content(form: &BTreeMap<&'static str, String>) -> String {
    form.iter()
        .filter(|(k, v)| **k != "sign" && !v.is_empty())
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("&")
}

/// Alipay's trade states in payonce's words: TRADE_SUCCESS and
/// TRADE_FINISHED are paid, WAIT_BUYER_PAY not paid, TRADE_CLOSED closed.
fn trade_state(response: &Value) -> Option<TradeState> {
    Some(match response["trade_status"].as_str()? {
        "TRADE_SUCCESS" | "TRADE_FINISHED" => TradeState::Paid {
            pay_no: response["trade_no"].as_str()?.to_owned(),
            amount: crate::money::yuan_to_fen(response["total_amount"].as_str()?, false)?,
            currency: CURRENCY.to_owned(),
            paid_at: None,
        },
        "WAIT_BUYER_PAY" => TradeState::NotPaid { paying: false },
        "TRADE_CLOSED" => TradeState::Closed,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_numbers_it_can_carry() {
        assert!(can_carry("ORD_123") && can_carry(&"a".repeat(64)));
        assert!(!can_carry("ORD-123") && !can_carry("") && !can_carry(&"a".repeat(65)));
    }

    #[test]
    fn the_signed_text_is_the_exact_text_of_the_one_top_level_member() {
        let name = "alipay_trade_query_response";
        let body = r#"{"alipay_trade_query_response" : {"code":"10000","msg":"a } in \"text\"","sub":{"x":[1,{"y":2}]}},"sign":"abc"}"#;
        assert_eq!(
            signed_member(body, name),
            Ok((r#"{"code":"10000","msg":"a } in \"text\"","sub":{"x":[1,{"y":2}]}}"#, "abc".to_owned(), None))
        );
        let certified = r#"{"alipay_trade_query_response":{},"alipay_cert_sn":"fda5","sign":"abc"}"#;
        assert_eq!(signed_member(certified, name), Ok(("{}", "abc".to_owned(), Some("fda5".to_owned()))));
        let refused = [
            r#"{"sign":"abc"}"#,
            r#"{"alipay_trade_query_response":{},"alipay_trade_query_response":{},"sign":"abc"}"#,
            r#"{"alipay_trade_query_response":{},"alipay_trade_query\u005fresponse":{},"sign":"abc"}"#,
            r#"{"alipay_trade_query_response":{},"sign":"abc","sign":"abd"}"#,
            r#"{"alipay_trade_query_response":{},"alipay_trade_close_response":{},"sign":"abc"}"#,
            r#"{"alipay_trade_close_response":{},"sign":"abc"}"#,
            r#"{"alipay_trade_query_response":{}}"#,
            r#"{"alipay_trade_query_response":{},"sign":7}"#,
            r#"[{"alipay_trade_query_response":{},"sign":"abc"}]"#,
            r#"{"alipay_trade_query_response":{},"sign":"abc"} trailing"#,
        ];
        for body in refused {
            assert!(signed_member(body, name).is_err(), "refused: {body}");
        }
    }

    #[test]
    fn requests_are_signed_and_answers_verified() {
        let merchant = crate::platforms::test_keys::merchant();
        let alipay = crate::platforms::test_keys::platform();
        let api = AlipayApi::new(
            "2021000000000001".into(),
            MerchantKey::from_pem(merchant.private_pem).expect("key"),
            "http://127.0.0.1:9/gateway.do",
            alipay.public.clone(),
            Duration::from_secs(1),
        );
        let form =
            api.form_with("alipay.trade.query", r#"{"out_trade_no":"ORD_1"}"#, &[], 1_700_000_000_000).expect("form");
        assert_eq!(form["timestamp"], "2023-11-15 06:13:20", "Beijing time");
        let signature = base64::engine::general_purpose::STANDARD.decode(&form["sign"]).expect("b64");
        let signature = Signature::try_from(signature.as_slice()).expect("signature");
        VerifyingKey::<Sha256>::new(merchant.public.clone())
            .verify(sign_content(&form).as_bytes(), &signature)
            .expect("the request verifies with the merchant's public key");
        assert!(sign_content(&form).contains("sign_type=RSA2") && !sign_content(&form).contains("sign="));

        let response = r#"{"code":"10000","msg":"Success","out_trade_no":"ORD_1","trade_no":"2023111522001","trade_status":"TRADE_SUCCESS","total_amount":"10.50"}"#;
        let sign = crate::platforms::test_keys::sign(&alipay.private, response.as_bytes());
        let body = format!(r#"{{"alipay_trade_query_response":{response},"sign":"{sign}"}}"#);
        let verified = api.verified_response(&body, "alipay.trade.query").expect("verifies");
        assert_eq!(
            trade_state(&verified),
            Some(TradeState::Paid {
                pay_no: "2023111522001".into(),
                amount: 1050,
                currency: "CNY".into(),
                paid_at: None
            })
        );
        let tampered = body.replace("10.50", "10.51");
        assert!(api.verified_response(&tampered, "alipay.trade.query").is_err(), "a tampered answer is refused");
        let forged = crate::platforms::test_keys::sign(&merchant.private, response.as_bytes());
        let forged = format!(r#"{{"alipay_trade_query_response":{response},"sign":"{forged}"}}"#);
        assert!(api.verified_response(&forged, "alipay.trade.query").is_err(), "another key's sign is refused");
    }

    fn prepay_request(method: &str) -> PrepayRequest<'_> {
        PrepayRequest {
            order_no: "ORD_1",
            amount: 1050,
            currency: "CNY",
            description: "Tea & cake",
            expires_at_ms: 1_700_000_900_000,
            notify_url: "https://shop.example/v1/callbacks/alipay",
            method,
            appid: None,
            openid: None,
            client_ip: None,
            return_url: Some("https://shop.example/paid?o=ORD_1"),
        }
    }

    /// The form of a signed URL or order string, decoded.
    fn decoded(encoded: &str) -> BTreeMap<String, String> {
        let decode = |text: &str| {
            let bytes = text.as_bytes();
            let mut out = Vec::new();
            let mut i = 0;
            while i < bytes.len() {
                if bytes[i] == b'%' {
                    out.push(u8::from_str_radix(&text[i + 1..i + 3], 16).expect("hex"));
                    i += 3;
                } else {
                    out.push(bytes[i]);
                    i += 1;
                }
            }
            String::from_utf8(out).expect("utf-8")
        };
        encoded.split('&').map(|pair| pair.split_once('=').expect("k=v")).map(|(k, v)| (decode(k), decode(v))).collect()
    }

    #[test]
    fn a_page_payment_is_a_gateway_url_signed_with_the_app_key() {
        let merchant = crate::platforms::test_keys::merchant();
        let api = AlipayApi::new(
            "2021000000000001".into(),
            MerchantKey::from_pem(merchant.private_pem).expect("key"),
            "http://127.0.0.1:9/gateway.do",
            crate::platforms::test_keys::platform().public,
            Duration::from_secs(1),
        );
        let exchange = api.prepay(&prepay_request("page"), 1_700_000_000_000);
        assert_eq!(exchange.http_status, None, "no call");
        let PrepayAnswer::Created(payment) = exchange.meaning else { panic!("{exchange:?}") };
        assert_eq!(payment.fields.keys().collect::<Vec<_>>(), ["url"]);
        let url = payment.fields["url"].as_str().expect("text");
        let query = url.strip_prefix("http://127.0.0.1:9/gateway.do?").expect("the gateway URL");
        let form = decoded(query);
        assert_eq!(form["method"], "alipay.trade.page.pay");
        assert_eq!(form["return_url"], "https://shop.example/paid?o=ORD_1");
        assert_eq!(form["notify_url"], "https://shop.example/v1/callbacks/alipay");
        let biz: Value = serde_json::from_str(&form["biz_content"]).expect("JSON");
        assert_eq!(biz["product_code"], "FAST_INSTANT_TRADE_PAY");
        assert_eq!((biz["total_amount"].as_str(), biz["subject"].as_str()), (Some("10.50"), Some("Tea & cake")));
        assert_eq!(biz["time_expire"], "2023-11-15 06:28:20", "Beijing time");
        let content = form
            .iter()
            .filter(|(k, v)| *k != "sign" && !v.is_empty())
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("&");
        let signature = base64::engine::general_purpose::STANDARD.decode(&form["sign"]).expect("b64");
        let signature = Signature::try_from(signature.as_slice()).expect("signature");
        VerifyingKey::<Sha256>::new(merchant.public.clone())
            .verify(content.as_bytes(), &signature)
            .expect("the URL's form verifies with the app's public key");

        let app = api.prepay(&prepay_request("app"), 1_700_000_000_000);
        let PrepayAnswer::Created(payment) = app.meaning else { panic!("{app:?}") };
        let form = decoded(payment.fields["order_string"].as_str().expect("text"));
        assert_eq!((form["method"].as_str(), form.get("return_url")), ("alipay.trade.app.pay", None));
        let usd = PrepayRequest { currency: "USD", ..prepay_request("precreate") };
        assert!(matches!(api.prepay(&usd, 0).meaning, PrepayAnswer::NotSendable(why) if why.contains("USD")));
        let dashed = PrepayRequest { order_no: "ORD-1", ..prepay_request("wap") };
        assert!(matches!(api.prepay(&dashed, 0).meaning, PrepayAnswer::NotSendable(_)));
    }

    #[test]
    fn precreate_answers_mean_what_they_say() {
        let json = |text: &str| serde_json::from_str::<Value>(text).expect("JSON");
        let created = json(r#"{"code":"10000","msg":"Success","out_trade_no":"ORD_1","qr_code":"https://qr/x"}"#);
        assert_eq!(
            precreate_meaning(&created, "ORD_1"),
            Ok(PrepayAnswer::Created(Payment::of(&[("qr_code", "https://qr/x")])))
        );
        assert!(precreate_meaning(&created, "ORD_2").is_err(), "another trade");
        let refusal = |sub: &str| {
            json(&format!(r#"{{"code":"40004","msg":"Business Failed","sub_code":"{sub}","sub_msg":"m"}}"#))
        };
        assert_eq!(precreate_meaning(&refusal("ACQ.TRADE_HAS_SUCCESS"), "ORD_1"), Ok(PrepayAnswer::Paid));
        assert_eq!(precreate_meaning(&refusal("ACQ.TRADE_HAS_CLOSE"), "ORD_1"), Ok(PrepayAnswer::Closed));
        assert_eq!(
            precreate_meaning(&refusal("ACQ.ACCESS_FORBIDDEN"), "ORD_1"),
            Ok(PrepayAnswer::Refused { code: "ACQ.ACCESS_FORBIDDEN".into(), message: "m".into() })
        );
        assert!(precreate_meaning(&json(r#"{"code":"20000","sub_code":"isp.unknow-error"}"#), "ORD_1").is_err());
    }
}
