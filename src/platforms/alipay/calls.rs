//! Alipay's calls: OpenAPI, the merchant's side: a form POSTed to the gateway with
//! `app_id, method, format=JSON, charset=utf-8, sign_type=RSA2, timestamp`
//! (Beijing time), `version=1.0, biz_content` and `sign`, RSA2 over every
//! non-empty parameter but `sign`, sorted; the answer's `*_response` value
//! verified, as the exact text it is in the body, with the Alipay public key,
//! then checked to name the `out_trade_no` asked about.

use super::{CURRENCY, NAME};
use crate::clock::{format_ms, UTC8_OFFSET_MS};
use crate::domain::PlatformStatus;
use crate::platforms::RefundRequest;
use crate::platforms::{
    agent, body_text, unusable, Calls, CloseAnswer, Exchange, MerchantKey, RefundAnswer, RefundState, TradeState,
};
use base64::Engine as _;
use rsa::pkcs1v15::{Signature, VerifyingKey};
use rsa::signature::Verifier;
use rsa::RsaPublicKey;
use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::Value;
use sha2::Sha256;
use std::collections::BTreeMap;
use std::time::Duration;

pub const GATEWAY_DEFAULT: &str = "https://openapi.alipay.com/gateway.do";

/// Alipay's `out_trade_no`: up to 64 characters of `[A-Za-z0-9_]`.
pub fn can_carry(order_no: &str) -> bool {
    (1..=64).contains(&order_no.len()) && order_no.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

pub struct AlipayApi {
    pub app_id: String,
    key: MerchantKey,
    pub gateway: String,
    alipay_key: RsaPublicKey,
    agent: ureq::Agent,
}

impl AlipayApi {
    pub fn new(
        app_id: String,
        key: MerchantKey,
        gateway: &str,
        alipay_key: RsaPublicKey,
        timeout: Duration,
    ) -> AlipayApi {
        AlipayApi { app_id, key, gateway: gateway.to_owned(), alipay_key, agent: agent(timeout) }
    }

    /// The signed form of one call.
    fn form(&self, method: &str, biz_content: &str, now_ms: i64) -> Result<BTreeMap<&'static str, String>, String> {
        // yyyy-MM-dd HH:mm:ss in Beijing time.
        let beijing = format_ms(now_ms.saturating_add(UTC8_OFFSET_MS));
        let timestamp = format!("{} {}", &beijing[..10], &beijing[11..19]);
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
        let content = sign_content(&form);
        form.insert("sign", self.key.sign_base64(content.as_bytes())?);
        Ok(form)
    }

    /// One signed call of `method`: the verified `*_response`, or why
    /// there is none (with the status and text received).
    fn call(&self, method: &str, biz: &str, now_ms: i64) -> Result<Answered, Unanswered> {
        let form = self.form(method, biz, now_ms).map_err(|e| (None, String::new(), e))?;
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
    /// member that is read (docs/channels.md, "Alipay answers").
    fn verified_response(&self, body: &str, method: &str) -> Result<Value, String> {
        let name = format!("{}_response", method.replace('.', "_"));
        let (signed, sign) = signed_member(body, &name)?;
        let signature = base64::engine::general_purpose::STANDARD
            .decode(sign)
            .ok()
            .and_then(|bytes| Signature::try_from(bytes.as_slice()).ok())
            .ok_or("the answer's sign is not a base64 RSA signature")?;
        VerifyingKey::<Sha256>::new(self.alipay_key.clone())
            .verify(signed.as_bytes(), &signature)
            .map_err(|_| "the answer's sign does not verify".to_owned())?;
        let response: Value = serde_json::from_str(signed).map_err(|_| format!("{name} is not JSON"))?;
        if !response.is_object() {
            return Err(format!("{name} is not an object"));
        }
        Ok(response)
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
fn signed_member<'b>(body: &'b str, name: &str) -> Result<(&'b str, String), String> {
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
    Ok((signed.get(), sign))
}

/// A call's `biz_content`, members in this order, those without a value left out.
#[derive(Serialize)]
struct Biz<'a> {
    out_trade_no: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    refund_amount: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    out_request_no: Option<&'a str>,
}

impl<'a> Biz<'a> {
    fn of(out_trade_no: &'a str) -> Biz<'a> {
        Biz { out_trade_no, refund_amount: None, out_request_no: None }
    }

    fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
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
        let RefundRequest { order_no, refund_no, amount, currency } = *refund;
        const METHOD: &str = "alipay.trade.refund";
        let refund_amount = crate::money::fen_to_yuan(amount);
        let biz = Biz { refund_amount: Some(&refund_amount), out_request_no: Some(refund_no), ..Biz::of(order_no) };
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
                if response["code"] == "10000" && response.get("out_trade_no").is_none_or(|n| n == order_no) =>
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
    fn refund_query(&self, order_no: &str, refund_no: &str, now_ms: i64) -> Exchange<RefundState> {
        const METHOD: &str = "alipay.trade.fastpay.refund.query";
        let biz = Biz { out_request_no: Some(refund_no), ..Biz::of(order_no) }.to_json();
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
            Ok((r#"{"code":"10000","msg":"a } in \"text\"","sub":{"x":[1,{"y":2}]}}"#, "abc".to_owned()))
        );
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
        let form = api.form("alipay.trade.query", r#"{"out_trade_no":"ORD_1"}"#, 1_700_000_000_000).expect("form");
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
}
