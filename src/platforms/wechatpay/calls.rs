//! WeChat Pay's calls: API v3, the merchant's side: requests signed
//! `WECHATPAY2-SHA256-RSA2048` over `"{METHOD}\n{path?query}\n{timestamp}\n{nonce}\n{body}\n"`
//! with the merchant's API key; answers verified like notifications (the
//! platform key of `Wechatpay-Serial`, a timestamp within 5 minutes), then
//! checked to name this `mchid` and the `out_trade_no` asked about.

use super::{notices::currency_of, verify_signed, KeyExpiries, NAME};
use crate::domain::PlatformStatus;
use crate::platforms::RefundRequest;
use crate::platforms::{
    agent, body_text, nonce, normalised_time, unusable, Calls, CloseAnswer, Exchange, MerchantKey, RefundAnswer,
    RefundState, TradeState,
};
use rsa::RsaPublicKey;
use serde::Serialize;
use serde_json::Value;
use std::time::Duration;

pub const API_BASE_DEFAULT: &str = "https://api.mch.weixin.qq.com";

/// WeChat Pay's `out_trade_no`: 6-32 characters of `[A-Za-z0-9_*|-]`.
pub fn can_carry(order_no: &str) -> bool {
    (6..=32).contains(&order_no.len())
        && order_no.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'*' | b'|' | b'-'))
}

pub struct WechatpayApi {
    pub mchid: String,
    pub merchant_serial: String,
    key: MerchantKey,
    /// `--wechatpay-api-base`, without a trailing `/`.
    pub api_base: String,
    platform_keys: Vec<(String, RsaPublicKey)>,
    agent: ureq::Agent,
    /// `notify_url` of refund requests (`--public-base-url`), if any.
    pub refund_notify_url: Option<String>,
    /// The platform certificates' ends of validity: an answer signed by an
    /// expired one counts as no answer.
    pub certificate_expiries: KeyExpiries,
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
        WechatpayApi {
            mchid,
            merchant_serial,
            key,
            api_base: api_base.trim_end_matches('/').to_owned(),
            platform_keys,
            agent: agent(timeout),
            refund_notify_url: None,
            certificate_expiries: Vec::new(),
        }
    }

    /// The `Authorization` header of one request.
    fn authorization(&self, method: &str, path_and_query: &str, body: &str, now_ms: i64) -> Result<String, String> {
        let timestamp = now_ms.div_euclid(1000);
        let nonce = nonce();
        let message = format!("{method}\n{path_and_query}\n{timestamp}\n{nonce}\n{body}\n");
        let signature = self.key.sign_base64(message.as_bytes())?;
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
        let authorization =
            self.authorization(method, path, body.unwrap_or(""), now_ms).map_err(|e| (None, String::new(), e))?;
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
        match verify_signed(&self.platform_keys, &self.certificate_expiries, now_ms, &header, text.as_bytes()) {
            Ok(()) => Ok((status, text)),
            Err(e) => Err((Some(status), text, format!("the answer does not verify: {}", e.message))),
        }
    }
}

/// A refund answer about this refund of this order: its `out_refund_no`
/// and, as a query answer's, its `out_trade_no`.
fn names_refund(json: &Value, order_no: &str, refund_no: &str) -> bool {
    json["out_refund_no"] == refund_no && json["out_trade_no"] == order_no
}

/// The body of a refund request, members in this order.
#[derive(Serialize)]
struct RefundBody<'a> {
    out_trade_no: &'a str,
    out_refund_no: &'a str,
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
        let RefundRequest { order_no, refund_no, amount, currency } = *refund;
        let path = "/v3/refund/domestic/refunds";
        // The order's currency: the money goes back as it came (docs/channels.md).
        let body = RefundBody {
            out_trade_no: order_no,
            out_refund_no: refund_no,
            amount: RefundAmount { refund: amount, total: amount, currency },
            notify_url: self.refund_notify_url.as_deref(),
        };
        let body = serde_json::to_string(&body).unwrap_or_default();
        let request = format!("POST {}{path} {body}", self.api_base);
        match self.exchange("POST", path, Some(&body), now_ms) {
            Ok((200, text))
                if serde_json::from_str::<Value>(&text).is_ok_and(|j| names_refund(&j, order_no, refund_no)) =>
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
    fn refund_query(&self, _order_no: &str, refund_no: &str, now_ms: i64) -> Exchange<RefundState> {
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
        assert!(names_refund(&ours, "ORD-1", "RF-1"));
        assert!(!names_refund(&ours, "ORD-1", "RF-2"), "another refund");
        assert!(!names_refund(&ours, "ORD-2", "RF-1"), "another trade");
        let no_trade = answer(r#"{"out_refund_no": "RF-1", "status": "PROCESSING"}"#);
        assert!(!names_refund(&no_trade, "ORD-1", "RF-1"), "no trade named");
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
            .authorization("GET", "/v3/pay/transactions/out-trade-no/ORD-1?mchid=1900000001", "", 1_700_000_000_000)
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
}
