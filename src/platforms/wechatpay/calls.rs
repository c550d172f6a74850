//! WeChat Pay's calls: API v3, the merchant's side: requests signed
//! `WECHATPAY2-SHA256-RSA2048` over `"{METHOD}\n{path?query}\n{timestamp}\n{nonce}\n{body}\n"`
//! with the merchant's API key; answers verified like notifications (the
//! platform key of `Wechatpay-Serial`, a timestamp within 5 minutes), then
//! checked to name this `mchid` and the `out_trade_no` asked about.

use super::notices::{currency_of, named_serial};
use super::{verify_signed, KeyExpiries, NAME};
use crate::domain::PlatformStatus;
use crate::platforms::{
    agent, beijing_rfc3339, body_text, nonce, normalised_time, unusable, Calls, CloseAnswer, Exchange, MerchantKey,
    Payment, PrepayAnswer, RefundAnswer, RefundState, TradeState,
};
use crate::platforms::{PrepayRequest, RefundRequest};
use rsa::RsaPublicKey;
use serde::Serialize;
use serde_json::{Map, Value};
use std::sync::Arc;
use std::time::Duration;

pub const API_BASE_DEFAULT: &str = "https://api.mch.weixin.qq.com";

/// An answer not verified yet: (HTTP status, body, its `Wechatpay-*` headers).
pub(super) type Unverified = (u16, String, Vec<(String, String)>);

/// WeChat Pay's `out_trade_no`: 6-32 characters of `[A-Za-z0-9_*|-]`.
pub fn can_carry(order_no: &str) -> bool {
    (6..=32).contains(&order_no.len())
        && order_no.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'*' | b'|' | b'-'))
}

pub struct WechatpayApi {
    pub mchid: String,
    pub merchant_serial: String,
    /// The merchant key requests are signed with, the platform keys and
    /// certificates answers are verified with (an answer signed by an
    /// expired certificate counts as no answer); a reload replaces them.
    keys: super::HeldKeys,
    /// `--wechatpay-api-base`, without a trailing `/`.
    pub api_base: String,
    agent: ureq::Agent,
    /// `notify_url` of refund requests (`--public-base-url`), if any.
    pub refund_notify_url: Option<String>,
    /// The certificate downloads (`--wechatpay-platform-certs auto`): an
    /// answer naming a serial not held is verified after they looked for it.
    pub(super) downloads: Option<Arc<super::certs::Downloads>>,
    /// `--wechatpay-appid`, repeated: the official accounts, mini programs
    /// and apps payments are created under; none, no payment is created.
    pub appids: Vec<String>,
}

impl WechatpayApi {
    pub fn new(
        mchid: String,
        merchant_serial: String,
        key: MerchantKey,
        api_base: &str,
        platform_keys: Vec<(String, RsaPublicKey)>,
        timeout: Duration,
    ) -> WechatpayApi {
        let keys = super::Keys::configured(platform_keys, Vec::new(), Some(Arc::new(key)));
        WechatpayApi::with_keys(mchid, merchant_serial, api_base, super::HeldKeys::new(keys), timeout)
    }

    /// The calls signed and verified with `keys` (shared with the notices,
    /// replaced by a reload).
    pub(super) fn with_keys(
        mchid: String,
        merchant_serial: String,
        api_base: &str,
        keys: super::HeldKeys,
        timeout: Duration,
    ) -> WechatpayApi {
        WechatpayApi {
            mchid,
            merchant_serial,
            keys,
            api_base: api_base.trim_end_matches('/').to_owned(),
            agent: agent(timeout),
            refund_notify_url: None,
            appids: Vec::new(),
            downloads: None,
        }
    }

    /// The platform certificates' ends of validity: an answer signed by an
    /// expired one counts as no answer.
    pub fn set_certificate_expiries(&mut self, expiries: KeyExpiries) {
        self.keys.update(|keys| super::Keys {
            platform: keys.platform.clone(),
            expiries,
            merchant: keys.merchant.clone(),
            downloaded: keys.downloaded.clone(),
        });
    }

    /// The merchant key of `keys`.
    fn merchant(keys: &super::Keys) -> Result<&MerchantKey, String> {
        keys.merchant.as_deref().ok_or_else(|| "no --wechatpay-merchant-key".to_owned())
    }

    /// The `Authorization` header of one request.
    fn authorization(
        &self,
        keys: &super::Keys,
        method: &str,
        path_and_query: &str,
        body: &str,
        now_ms: i64,
    ) -> Result<String, String> {
        let timestamp = now_ms.div_euclid(1000);
        let nonce = nonce();
        let message = format!("{method}\n{path_and_query}\n{timestamp}\n{nonce}\n{body}\n");
        let signature = WechatpayApi::merchant(keys)?.sign_base64(message.as_bytes())?;
        Ok(format!(
            "WECHATPAY2-SHA256-RSA2048 mchid=\"{}\",nonce_str=\"{nonce}\",signature=\"{signature}\",timestamp=\"{timestamp}\",serial_no=\"{}\"",
            self.mchid, self.merchant_serial
        ))
    }
}

impl WechatpayApi {
    /// One signed call: (HTTP status, body) of an answer that verifies, or
    /// (status if any, what was received, why) when there is none to trust.
    fn exchange(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
        now_ms: i64,
    ) -> Result<(u16, String), (Option<u16>, String, String)> {
        // Signed and its answer verified with the keys in use when it started.
        let keys = self.keys.current();
        let authorization = self
            .authorization(&keys, method, path, body.unwrap_or(""), now_ms)
            .map_err(|e| (None, String::new(), e))?;
        let url = format!("{}{path}", self.api_base);
        let sent = match body {
            Some(body) => self
                .agent
                .post(url)
                .header("Authorization", &authorization)
                .header("Accept", "application/json")
                .header("Content-Type", "application/json")
                .send(body.as_bytes()),
            None => {
                self.agent.get(url).header("Authorization", &authorization).header("Accept", "application/json").call()
            }
        };
        let mut answer = sent.map_err(|e| (None, e.to_string(), format!("no answer: {e}")))?;
        let status = answer.status().as_u16();
        let text = body_text(&mut answer).map_err(|e| (Some(status), String::new(), e))?;
        let header = |name: &str| answer.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let mut keys = keys;
        if let (Some(downloads), Some(serial)) = (&self.downloads, named_serial(&header)) {
            if keys.lookup(&serial).is_none() {
                // A serial not held: the downloads look for it, then the
                // same answer is verified with what they brought.
                let _ = downloads.learn(&serial, now_ms);
                keys = self.keys.current();
            }
        }
        match verify_signed(&keys, now_ms, &header, text.as_bytes()) {
            Ok(()) => Ok((status, text)),
            Err(e) => Err((Some(status), text, format!("the answer does not verify: {}", e.message))),
        }
    }

    /// One signed `GET` whose answer is not verified here (the certificate
    /// download verifies it with what it lists): (status, body, the
    /// answer's `Wechatpay-*` headers), or why there is none.
    pub(super) fn fetch_unverified(&self, path: &str, now_ms: i64) -> Result<Unverified, String> {
        let keys = self.keys.current();
        let authorization = self.authorization(&keys, "GET", path, "", now_ms)?;
        let url = format!("{}{path}", self.api_base);
        let mut answer = self
            .agent
            .get(url)
            .header("Authorization", &authorization)
            .header("Accept", "application/json")
            .call()
            .map_err(|e| format!("no answer: {e}"))?;
        let status = answer.status().as_u16();
        let text = body_text(&mut answer)?;
        let headers = answer
            .headers()
            .iter()
            .filter(|(name, _)| name.as_str().starts_with("wechatpay-"))
            .filter_map(|(name, value)| Some((name.as_str().to_owned(), value.to_str().ok()?.to_owned())))
            .collect();
        Ok((status, text, headers))
    }
}

impl WechatpayApi {
    /// The body of a prepay request, or why payonce cannot send it.
    fn prepay_body<'a>(&'a self, request: &PrepayRequest<'a>) -> Result<PrepayBody<'a>, String> {
        let method = request.method;
        if !PREPAY_METHODS.contains(&method) {
            return Err(format!("WeChat Pay has no payment method {method:?}"));
        }
        if !can_carry(request.order_no) {
            return Err("WeChat Pay cannot carry this order_no (6-32 characters of [A-Za-z0-9_*|-])".into());
        }
        if request.currency != PREPAY_CURRENCY {
            let currency = request.currency;
            return Err(format!("WeChat Pay's payment API takes {PREPAY_CURRENCY}, and this order is in {currency}"));
        }
        let appid = request.appid.ok_or("WeChat Pay's payments need an appid")?;
        let payer = match (method, request.openid) {
            ("jsapi", None) => return Err("a jsapi payment needs the payer's openid".into()),
            ("jsapi", Some(openid)) => Some(Payer { openid }),
            _ => None,
        };
        let scene_info = match (method, request.client_ip) {
            ("h5", None) => return Err("an h5 payment needs the buyer's client_ip".into()),
            ("h5", Some(payer_client_ip)) => Some(SceneInfo { payer_client_ip, h5_info: H5Info { kind: "Wap" } }),
            _ => None,
        };
        Ok(PrepayBody {
            appid,
            mchid: &self.mchid,
            description: request.description,
            out_trade_no: request.order_no,
            time_expire: beijing_rfc3339(request.expires_at_ms),
            notify_url: request.notify_url,
            amount: PrepayAmount { total: request.amount, currency: PREPAY_CURRENCY },
            payer,
            scene_info,
        })
    }

    /// The payment a verified 200 answer gives, when it is about this
    /// merchant and trade (an answer naming another is no answer) and holds
    /// the method's identifier.
    fn created(&self, request: &PrepayRequest<'_>, json: &Value, now_ms: i64) -> Result<Payment, String> {
        let names_other = |field: &str, ours: &str| json.get(field).is_some_and(|v| v != ours);
        let appid = request.appid.unwrap_or_default();
        if names_other("mchid", &self.mchid)
            || names_other("appid", appid)
            || names_other("out_trade_no", request.order_no)
        {
            return Err("the answer names another mchid, appid or out_trade_no".into());
        }
        let key = match request.method {
            "native" => "code_url",
            "h5" => "h5_url",
            _ => "prepay_id",
        };
        let value = json[key].as_str().filter(|v| !v.is_empty()).ok_or_else(|| format!("the answer has no {key}"))?;
        let client_params = match request.method {
            "jsapi" => self.jsapi_params(appid, value, now_ms)?,
            "app" => self.app_params(appid, value, now_ms)?,
            _ => return Ok(Payment::of(&[(key, value)])),
        };
        let mut payment = Payment::of(&[(key, value)]);
        payment.fields.insert("client_params".into(), Value::Object(client_params));
        Ok(payment)
    }

    /// What a JSAPI page hands WeChat's client: `paySign` by the merchant's
    /// key over `"{appId}\n{timeStamp}\n{nonceStr}\n{package}\n"`.
    fn jsapi_params(&self, appid: &str, prepay_id: &str, now_ms: i64) -> Result<Map<String, Value>, String> {
        let (timestamp, nonce) = (now_ms.div_euclid(1000).to_string(), nonce());
        let package = format!("prepay_id={prepay_id}");
        let pay_sign = WechatpayApi::merchant(&self.keys.current())?
            .sign_base64(format!("{appid}\n{timestamp}\n{nonce}\n{package}\n").as_bytes())?;
        Ok(text_map(&[
            ("appId", appid),
            ("timeStamp", &timestamp),
            ("nonceStr", &nonce),
            ("package", &package),
            ("signType", "RSA"),
            ("paySign", &pay_sign),
        ]))
    }

    /// What an app hands WeChat's SDK: `sign` by the merchant's key over
    /// `"{appid}\n{timestamp}\n{noncestr}\n{prepayid}\n"`.
    fn app_params(&self, appid: &str, prepay_id: &str, now_ms: i64) -> Result<Map<String, Value>, String> {
        let (timestamp, nonce) = (now_ms.div_euclid(1000).to_string(), nonce());
        let sign = WechatpayApi::merchant(&self.keys.current())?
            .sign_base64(format!("{appid}\n{timestamp}\n{nonce}\n{prepay_id}\n").as_bytes())?;
        Ok(text_map(&[
            ("appid", appid),
            ("partnerid", &self.mchid),
            ("prepayid", prepay_id),
            ("package", "Sign=WXPay"),
            ("noncestr", &nonce),
            ("timestamp", &timestamp),
            ("sign", &sign),
        ]))
    }
}

/// A JSON object of text members.
fn text_map(members: &[(&str, &str)]) -> Map<String, Value> {
    members.iter().map(|(k, v)| ((*k).to_owned(), Value::from(*v))).collect()
}

/// A verified 4xx answer to a prepay: `ORDERPAID` is paid, `ORDER_CLOSED`
/// (or `ORDERCLOSED`) closed, any other code a refusal; none, no answer.
fn prepay_refusal(json: &Value) -> Option<PrepayAnswer> {
    let code = json["code"].as_str().filter(|c| !c.is_empty())?;
    Some(match code {
        "ORDERPAID" => PrepayAnswer::Paid,
        "ORDER_CLOSED" | "ORDERCLOSED" => PrepayAnswer::Closed,
        _ => PrepayAnswer::Refused {
            code: code.to_owned(),
            message: json["message"].as_str().unwrap_or_default().to_owned(),
        },
    })
}

/// A refund answer about this refund of this order: its `out_refund_no`
/// and, as a query answer's, its `out_trade_no`.
fn names_refund(json: &Value, order_no: &str, refund_no: &str, pay_no: Option<&str>) -> bool {
    json["out_refund_no"] == refund_no
        && json["out_trade_no"] == order_no
        && pay_no.is_none_or(|pay_no| json["transaction_id"] == pay_no)
}

/// The body of a refund request, members in this order.
#[derive(Serialize)]
struct RefundBody<'a> {
    /// A payment's refund names the payment (`transaction_id`), an order's
    /// refund the order (`out_trade_no`): WeChat takes exactly one.
    #[serde(skip_serializing_if = "Option::is_none")]
    transaction_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    out_trade_no: Option<&'a str>,
    out_refund_no: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'a str>,
    amount: RefundAmount<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    notify_url: Option<&'a str>,
}

#[derive(Serialize)]
struct RefundAmount<'a> {
    refund: i64,
    total: i64,
    currency: &'a str,
}

/// The payment methods: each is its own `/v3/pay/transactions/{method}`.
const PREPAY_METHODS: &[&str] = &["native", "jsapi", "h5", "app"];
/// The one currency of the domestic payment API.
const PREPAY_CURRENCY: &str = "CNY";

/// The body of a prepay request, members in this order.
#[derive(Serialize)]
struct PrepayBody<'a> {
    appid: &'a str,
    mchid: &'a str,
    description: &'a str,
    out_trade_no: &'a str,
    time_expire: String,
    notify_url: &'a str,
    amount: PrepayAmount<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    payer: Option<Payer<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    scene_info: Option<SceneInfo<'a>>,
}

#[derive(Serialize)]
struct PrepayAmount<'a> {
    total: i64,
    currency: &'a str,
}

#[derive(Serialize)]
struct Payer<'a> {
    openid: &'a str,
}

#[derive(Serialize)]
struct SceneInfo<'a> {
    payer_client_ip: &'a str,
    h5_info: H5Info,
}

#[derive(Serialize)]
struct H5Info {
    #[serde(rename = "type")]
    kind: &'static str,
}

/// The body of a close request.
#[derive(Serialize)]
struct CloseBody<'a> {
    mchid: &'a str,
}

impl Calls for WechatpayApi {
    fn name(&self) -> &'static str {
        NAME
    }

    fn endpoint(&self) -> &str {
        &self.api_base
    }

    /// `GET /v3/pay/transactions/out-trade-no/{order_no}?mchid=`: the trade's state.
    fn query(&self, order_no: &str, now_ms: i64) -> Exchange<TradeState> {
        let path = format!("/v3/pay/transactions/out-trade-no/{order_no}?mchid={}", self.mchid);
        let request = format!("GET {}{path}", self.api_base);
        if !can_carry(order_no) {
            return Exchange::<TradeState>::not_carried(request, "WeChat Pay");
        }
        let (status, text) = match self.exchange("GET", &path, None, now_ms) {
            Ok(answered) => answered,
            Err((status, text, why)) => return Exchange::unknown(request, status, text, why, TradeState::Unknown),
        };
        let json: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let meaning = match status {
            200 if json["mchid"] != self.mchid.as_str() || json["out_trade_no"] != order_no => None,
            200 => trade_state(&json),
            404 if json["code"] == "ORDER_NOT_EXIST" => Some(TradeState::NotPaid { paying: false }),
            _ => None,
        };
        if let Some(why) = meaning.as_ref().and_then(unusable) {
            return Exchange::unknown(request, Some(status), text, why, TradeState::Unknown);
        }
        match meaning {
            Some(meaning) => Exchange { request, http_status: Some(status), response: text, meaning, distrust: None },
            None => {
                let why = if status == 200 {
                    "the answer names another mchid or out_trade_no, or an unknown trade_state".to_owned()
                } else {
                    format!("HTTP {status}")
                };
                Exchange::unknown(request, Some(status), text, why, TradeState::Unknown)
            }
        }
    }

    /// `POST /v3/pay/transactions/out-trade-no/{order_no}/close`: 204 (also
    /// for an unknown out_trade_no) and `ORDER_CLOSED` mean closed;
    /// `ORDERPAID` means query again and apply.
    fn close(&self, order_no: &str, now_ms: i64) -> Exchange<CloseAnswer> {
        let path = format!("/v3/pay/transactions/out-trade-no/{order_no}/close");
        let body = serde_json::to_string(&CloseBody { mchid: &self.mchid }).unwrap_or_default();
        let request = format!("POST {}{path} {body}", self.api_base);
        if !can_carry(order_no) {
            return Exchange::<CloseAnswer>::not_carried(request, "WeChat Pay");
        }
        let (status, text) = match self.exchange("POST", &path, Some(&body), now_ms) {
            Ok(answered) => answered,
            Err((status, text, why)) => return Exchange::unknown(request, status, text, why, CloseAnswer::Unknown),
        };
        let code = serde_json::from_str::<Value>(&text).ok().and_then(|j| j["code"].as_str().map(str::to_owned));
        let meaning = match (status, code.as_deref()) {
            (204, _) | (400, Some("ORDER_CLOSED")) => CloseAnswer::Closed,
            (400, Some("ORDERPAID")) => CloseAnswer::Paid,
            _ => return Exchange::unknown(request, Some(status), text, format!("HTTP {status}"), CloseAnswer::Unknown),
        };
        Exchange { request, http_status: Some(status), response: text, meaning, distrust: None }
    }

    /// `POST /v3/refund/domestic/refunds` with `out_refund_no` = refund_no
    /// (WeChat Pay's idempotency key): a 200 naming it and the order's
    /// `out_trade_no` is accepted; one naming another trade is no answer.
    fn refund(&self, refund: &RefundRequest<'_>, now_ms: i64) -> Exchange<RefundAnswer> {
        let RefundRequest { order_no, refund_no, amount, total, currency, reason, pay_no } = *refund;
        let path = "/v3/refund/domestic/refunds";
        // The order's currency: the money goes back as it came (docs/channels.md).
        let body = RefundBody {
            transaction_id: pay_no,
            out_trade_no: if pay_no.is_some() { None } else { Some(order_no) },
            out_refund_no: refund_no,
            reason,
            amount: RefundAmount { refund: amount, total, currency },
            notify_url: self.refund_notify_url.as_deref(),
        };
        let body = serde_json::to_string(&body).unwrap_or_default();
        let request = format!("POST {}{path} {body}", self.api_base);
        match self.exchange("POST", path, Some(&body), now_ms) {
            Ok((200, text))
                if serde_json::from_str::<Value>(&text)
                    .is_ok_and(|j| names_refund(&j, order_no, refund_no, pay_no)) =>
            {
                Exchange {
                    request,
                    http_status: Some(200),
                    response: text,
                    meaning: RefundAnswer::Accepted,
                    distrust: None,
                }
            }
            Ok((status, text)) => Exchange::unknown(
                request,
                Some(status),
                text,
                format!("HTTP {status}: not accepted"),
                RefundAnswer::Unknown,
            ),
            Err((status, text, why)) => Exchange::unknown(request, status, text, why, RefundAnswer::Unknown),
        }
    }

    /// `GET /v3/refund/domestic/refunds/{refund_no}`, by `out_refund_no`
    /// alone (WeChat Pay's refund numbers are the merchant's): SUCCESS
    /// settles it; CLOSED and ABNORMAL settle it as failed; PROCESSING is not yet.
    fn refund_query(
        &self,
        _order_no: &str,
        refund_no: &str,
        _pay_no: Option<&str>,
        now_ms: i64,
    ) -> Exchange<RefundState> {
        let path = format!("/v3/refund/domestic/refunds/{refund_no}");
        let request = format!("GET {}{path}", self.api_base);
        let (status, text) = match self.exchange("GET", &path, None, now_ms) {
            Ok(answered) => answered,
            Err((status, text, why)) => return Exchange::unknown(request, status, text, why, RefundState::Unknown),
        };
        let json: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        if status != 200 || json["out_refund_no"] != refund_no {
            return Exchange::unknown(request, Some(status), text, format!("HTTP {status}"), RefundState::Unknown);
        }
        let meaning = match json["status"].as_str() {
            Some("SUCCESS") => RefundState::Settled(PlatformStatus::Success),
            Some("CLOSED") | Some("ABNORMAL") => RefundState::Settled(PlatformStatus::Failed),
            Some("PROCESSING") => RefundState::NotYet,
            _ => {
                return Exchange::unknown(
                    request,
                    Some(status),
                    text,
                    "unknown refund status".into(),
                    RefundState::Unknown,
                )
            }
        };
        Exchange { request, http_status: Some(status), response: text, meaning, distrust: None }
    }

    fn prepay_methods(&self) -> &'static [&'static str] {
        PREPAY_METHODS
    }

    fn prepay_appids(&self) -> Option<&[String]> {
        Some(&self.appids)
    }

    fn prepay_check(&self, request: &PrepayRequest<'_>) -> Result<(), String> {
        self.prepay_body(request).map(drop)
    }

    /// `POST /v3/pay/transactions/{method}`: a 200 gives the method's
    /// identifier (and, for jsapi and app, the client's signed parameters);
    /// `ORDERPAID` is paid, `ORDER_CLOSED` closed, another 4xx a refusal.
    fn prepay(&self, prepay: &PrepayRequest<'_>, now_ms: i64) -> Exchange<PrepayAnswer> {
        let path = format!("/v3/pay/transactions/{}", prepay.method);
        let body = match self.prepay_body(prepay) {
            Ok(body) => serde_json::to_string(&body).unwrap_or_default(),
            Err(why) => return Exchange::not_sendable(format!("POST {}{path}", self.api_base), why),
        };
        let request = format!("POST {}{path} {body}", self.api_base);
        let (status, text) = match self.exchange("POST", &path, Some(&body), now_ms) {
            Ok(answered) => answered,
            Err((status, text, why)) => return Exchange::unknown(request, status, text, why, PrepayAnswer::Unknown),
        };
        let json: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let meaning = match status {
            200 => self.created(prepay, &json, now_ms).map(PrepayAnswer::Created),
            400..=499 => prepay_refusal(&json).ok_or_else(|| format!("HTTP {status} without a code")),
            _ => Err(format!("HTTP {status}")),
        };
        match meaning {
            Ok(meaning) => Exchange { request, http_status: Some(status), response: text, meaning, distrust: None },
            Err(why) => Exchange::unknown(request, Some(status), text, why, PrepayAnswer::Unknown),
        }
    }
}

/// WeChat Pay's trade states in payonce's words: SUCCESS and REFUND are
/// paid; NOTPAY, USERPAYING and PAYERROR not paid; CLOSED and REVOKED closed.
fn trade_state(json: &Value) -> Option<TradeState> {
    Some(match json["trade_state"].as_str()? {
        "SUCCESS" | "REFUND" => TradeState::Paid {
            pay_no: json["transaction_id"].as_str()?.to_owned(),
            amount: json["amount"]["total"].as_i64()?,
            currency: currency_of(&json["amount"]).ok()?,
            paid_at: json["success_time"].as_str().map(normalised_time),
        },
        "NOTPAY" | "PAYERROR" => TradeState::NotPaid { paying: false },
        "USERPAYING" => TradeState::NotPaid { paying: true },
        "CLOSED" | "REVOKED" => TradeState::Closed,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_numbers_it_can_carry() {
        assert!(can_carry("ORD-123456") && can_carry("a_b*c|d-e"));
        assert!(!can_carry("ORD1") && !can_carry("ORD.123456") && !can_carry(&"x".repeat(33)));
    }

    #[test]
    fn trade_states_map_as_section_11_says() {
        let json = |text: &str| serde_json::from_str::<Value>(text).expect("JSON");
        let paid = json(r#"{"trade_state": "SUCCESS", "transaction_id": "4200", "amount": {"total": 100}}"#);
        assert_eq!(
            trade_state(&paid),
            Some(TradeState::Paid { pay_no: "4200".into(), amount: 100, currency: "CNY".into(), paid_at: None })
        );
        let usd = json(
            r#"{"trade_state": "SUCCESS", "transaction_id": "4200", "amount": {"total": 100, "currency": "USD"}}"#,
        );
        assert!(matches!(trade_state(&usd), Some(TradeState::Paid { currency, .. }) if currency == "USD"));
        for (state, expected) in [
            ("NOTPAY", TradeState::NotPaid { paying: false }),
            ("PAYERROR", TradeState::NotPaid { paying: false }),
            ("USERPAYING", TradeState::NotPaid { paying: true }),
            ("CLOSED", TradeState::Closed),
            ("REVOKED", TradeState::Closed),
        ] {
            assert_eq!(trade_state(&json(&format!(r#"{{"trade_state": "{state}"}}"#))), Some(expected), "{state}");
        }
        assert_eq!(trade_state(&json(r#"{"trade_state": "LATER"}"#)), None);
    }

    #[test]
    fn a_refund_answer_names_the_refund_and_its_order() {
        let answer = |text: &str| serde_json::from_str::<Value>(text).expect("JSON");
        let ours = answer(r#"{"out_refund_no": "RF-1", "out_trade_no": "ORD-1", "status": "PROCESSING"}"#);
        assert!(names_refund(&ours, "ORD-1", "RF-1", None));
        assert!(!names_refund(&ours, "ORD-1", "RF-2", None), "another refund");
        assert!(!names_refund(&ours, "ORD-2", "RF-1", None), "another trade");
        let no_trade = answer(r#"{"out_refund_no": "RF-1", "status": "PROCESSING"}"#);
        assert!(!names_refund(&no_trade, "ORD-1", "RF-1", None), "no trade named");
        // A payment's refund: the answer names that payment too.
        let of_payment = answer(
            r#"{"out_refund_no": "U-42", "out_trade_no": "ORD-1", "transaction_id": "42", "status": "PROCESSING"}"#,
        );
        assert!(names_refund(&of_payment, "ORD-1", "U-42", Some("42")));
        assert!(!names_refund(&of_payment, "ORD-1", "U-42", Some("43")), "another payment");
        assert!(!names_refund(&ours, "ORD-1", "RF-1", Some("42")), "no payment named");
    }

    #[test]
    fn requests_are_signed_with_the_merchant_key() {
        use rsa::signature::Verifier;
        let pair = crate::platforms::test_keys::merchant();
        let api = WechatpayApi::new(
            "1900000001".into(),
            "MERCHANT-SERIAL".into(),
            MerchantKey::from_pem(pair.private_pem).expect("key"),
            "http://127.0.0.1:9/",
            Vec::new(),
            Duration::from_secs(1),
        );
        let header = api
            .authorization(
                &api.keys.current(),
                "GET",
                "/v3/pay/transactions/out-trade-no/ORD-1?mchid=1900000001",
                "",
                1_700_000_000_000,
            )
            .expect("signed");
        let field = |name: &str| {
            header
                .split([',', ' '])
                .find_map(|p| p.strip_prefix(&format!("{name}=\"")))
                .map(|v| v.trim_end_matches('"').to_owned())
        };
        assert!(header.starts_with("WECHATPAY2-SHA256-RSA2048 "));
        assert_eq!(field("mchid").as_deref(), Some("1900000001"));
        assert_eq!(field("serial_no").as_deref(), Some("MERCHANT-SERIAL"));
        assert_eq!(field("timestamp").as_deref(), Some("1700000000"));
        let message = format!(
            "GET\n/v3/pay/transactions/out-trade-no/ORD-1?mchid=1900000001\n1700000000\n{}\n\n",
            field("nonce_str").expect("nonce")
        );
        use base64::Engine as _;
        let signature =
            base64::engine::general_purpose::STANDARD.decode(field("signature").expect("signature")).expect("b64");
        let signature = rsa::pkcs1v15::Signature::try_from(signature.as_slice()).expect("signature");
        rsa::pkcs1v15::VerifyingKey::<sha2::Sha256>::new(pair.public)
            .verify(message.as_bytes(), &signature)
            .expect("verifies");
    }

    fn verifies(public: &rsa::RsaPublicKey, message: &str, signature: &str) -> bool {
        use base64::Engine as _;
        use rsa::signature::Verifier;
        let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(signature) else { return false };
        let Ok(signature) = rsa::pkcs1v15::Signature::try_from(bytes.as_slice()) else { return false };
        rsa::pkcs1v15::VerifyingKey::<sha2::Sha256>::new(public.clone()).verify(message.as_bytes(), &signature).is_ok()
    }

    fn api(pair: &crate::platforms::test_keys::Pair) -> WechatpayApi {
        WechatpayApi::new(
            "1900000001".into(),
            "MERCHANT-SERIAL".into(),
            MerchantKey::from_pem(pair.private_pem).expect("key"),
            "http://127.0.0.1:9",
            Vec::new(),
            Duration::from_secs(1),
        )
    }

    fn prepay_request(method: &str) -> PrepayRequest<'_> {
        PrepayRequest {
            order_no: "ORD-123456",
            amount: 990,
            currency: "CNY",
            description: "Tea",
            expires_at_ms: 1_700_000_900_000,
            notify_url: "https://shop.example/v1/callbacks/wechatpay",
            method,
            appid: Some("wx0000000000000001"),
            openid: Some("oBuyer"),
            client_ip: Some("203.0.113.7"),
            return_url: None,
        }
    }

    #[test]
    fn jsapi_pay_sign_verifies_with_the_merchant_public_key() {
        let pair = crate::platforms::test_keys::merchant();
        let answer = serde_json::from_str::<Value>(r#"{"prepay_id": "wx201410272009395522657a690389285100"}"#).unwrap();
        let payment = api(&pair).created(&prepay_request("jsapi"), &answer, 1_700_000_000_000).expect("created");
        assert_eq!(payment.fields.keys().collect::<Vec<_>>(), ["prepay_id", "client_params"]);
        let p = &payment.fields["client_params"];
        let field = |name: &str| p[name].as_str().expect(name).to_owned();
        assert_eq!(
            (field("package"), field("signType")),
            ("prepay_id=wx201410272009395522657a690389285100".into(), "RSA".into())
        );
        assert_eq!((field("appId"), field("timeStamp")), ("wx0000000000000001".into(), "1700000000".into()));
        let message =
            format!("{}\n{}\n{}\n{}\n", field("appId"), field("timeStamp"), field("nonceStr"), field("package"));
        assert!(verifies(&pair.public, &message, &field("paySign")), "paySign verifies");
        assert!(!verifies(&crate::platforms::test_keys::platform().public, &message, &field("paySign")));
    }

    #[test]
    fn app_sign_verifies_with_the_merchant_public_key() {
        let pair = crate::platforms::test_keys::merchant();
        let answer = serde_json::from_str::<Value>(r#"{"prepay_id": "wx2014"}"#).unwrap();
        let payment = api(&pair).created(&prepay_request("app"), &answer, 1_700_000_000_000).expect("created");
        let p = &payment.fields["client_params"];
        let field = |name: &str| p[name].as_str().expect(name).to_owned();
        assert_eq!(
            (field("partnerid"), field("prepayid"), field("package")),
            ("1900000001".into(), "wx2014".into(), "Sign=WXPay".into())
        );
        let message =
            format!("{}\n{}\n{}\n{}\n", field("appid"), field("timestamp"), field("noncestr"), field("prepayid"));
        assert!(verifies(&pair.public, &message, &field("sign")), "sign verifies");
    }

    #[test]
    fn prepay_bodies_and_answers() {
        let pair = crate::platforms::test_keys::merchant();
        let api = api(&pair);
        let h5 = serde_json::to_value(api.prepay_body(&prepay_request("h5")).expect("body")).unwrap();
        assert_eq!(h5["time_expire"], "2023-11-15T06:28:20+08:00");
        assert_eq!(h5["scene_info"]["h5_info"]["type"], "Wap");
        assert_eq!((h5["amount"]["total"].as_i64(), h5.get("payer")), (Some(990), None));
        let jsapi = serde_json::to_value(api.prepay_body(&prepay_request("jsapi")).expect("body")).unwrap();
        assert_eq!(jsapi["payer"]["openid"], "oBuyer");
        let no_openid = PrepayRequest { openid: None, ..prepay_request("jsapi") };
        assert!(api.prepay_body(&no_openid).is_err());
        let usd = PrepayRequest { currency: "USD", ..prepay_request("native") };
        assert!(matches!(api.prepay(&usd, 0).meaning, PrepayAnswer::NotSendable(why) if why.contains("USD")));
        let short = PrepayRequest { order_no: "ORD1", ..prepay_request("native") };
        assert!(matches!(api.prepay(&short, 0).meaning, PrepayAnswer::NotSendable(_)));
        let other = serde_json::from_str::<Value>(r#"{"code_url": "weixin://x", "mchid": "1900009999"}"#).unwrap();
        assert!(api.created(&prepay_request("native"), &other, 0).is_err(), "another merchant");
        let code = |c: &str| serde_json::from_str::<Value>(&format!(r#"{{"code": "{c}", "message": "m"}}"#)).unwrap();
        assert_eq!(prepay_refusal(&code("ORDERPAID")), Some(PrepayAnswer::Paid));
        assert_eq!(prepay_refusal(&code("ORDER_CLOSED")), Some(PrepayAnswer::Closed));
        assert_eq!(prepay_refusal(&code("ORDERCLOSED")), Some(PrepayAnswer::Closed));
        assert_eq!(
            prepay_refusal(&code("APPID_MCHID_NOT_MATCH")),
            Some(PrepayAnswer::Refused { code: "APPID_MCHID_NOT_MATCH".into(), message: "m".into() })
        );
    }
}
