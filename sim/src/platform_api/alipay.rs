//! Alipay's OpenAPI gateway (`POST .../gateway.do`, a utf-8 form): the
//! common parameters, RSA2 over the sorted non-empty parameters but `sign`,
//! and four methods. Every answer is `{"<method>_response":{...},"sign":".."}`
//! with `sign` = RSA2 by the Alipay key over the exact text of the
//! `_response` value, so the body is built around the text that was signed.
//! The methods after the precreate find the trade by the merchant's
//! `out_trade_no` or by Alipay's `trade_no`.
//! Trades are made by `alipay.trade.precreate`, or by the buyer opening a
//! page, wap or app request the merchant signed ([`Alipay::buyer_opens`]).

use super::http::{parse_form, Answer, Api, Request};
use super::ledger::{CloseRefused, Ledger, PrepayRefused, RefundRefused, Trade, TradeState};
use super::{
    beijing_unix, notify_url_refusal, now_ms, other_trade_no, random_token, tamper, unique_digits, yuan_to_fen,
    AlipayApiConfig, Call, Fault, RefundStatus,
};
use crate::alipay_certs::CertSns;
use crate::platform::{china_time, fen_to_yuan, rsa_sign};
use base64::Engine;
use rsa::pkcs1v15::{Signature, SigningKey, VerifyingKey};
use rsa::signature::Verifier;
use rsa::RsaPrivateKey;
use serde_json::{json, Map, Value};
use sha2::Sha256;
use std::sync::Arc;

/// The methods the gateway answers (server calls).
const METHODS: [&str; 5] =
    [PRECREATE, "alipay.trade.query", "alipay.trade.close", "alipay.trade.refund", "alipay.trade.fastpay.refund.query"];
/// The one method that makes a trade by a server call (a QR code to scan);
/// also what a trade made out of band is taken for.
pub(super) const PRECREATE: &str = "alipay.trade.precreate";
/// The methods signed for the buyer to open, each with the `product_code`
/// it must carry and whether it comes as a URL (a browser) or an order
/// string (the Alipay app).
const BUYER_METHODS: [(&str, &str, Opened); 3] = [
    ("alipay.trade.page.pay", "FAST_INSTANT_TRADE_PAY", Opened::Url),
    ("alipay.trade.wap.pay", "QUICK_WAP_WAY", Opened::Url),
    ("alipay.trade.app.pay", "QUICK_MSECURITY_PAY", Opened::OrderString),
];
/// Alipay's limits on a trade: `subject` in characters, `total_amount` in fen.
const SUBJECT_CHARS_MAX: usize = 256;
const TOTAL_AMOUNT_FEN_MAX: i64 = 10_000_000_000;
/// How far a request's Beijing-time timestamp may be from the gateway's
/// clock: wide, but an 8-hour UTC mix-up is refused.
const CLOCK_SKEW_S: i64 = 15 * 60;
/// Alipay shows buyers masked.
const BUYER_LOGON_ID: &str = "159****5620";
const BUYER_USER_ID: &str = "2088000000000000";

/// Up to 64 of `[A-Za-z0-9_]` (payonce's rule, docs/platforms.md).
pub(super) fn valid_out_trade_no(no: &str) -> bool {
    (1..=64).contains(&no.len()) && no.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// A trade_no as a merchant may send it: up to 64 of `[A-Za-z0-9]`
/// (Alipay's own are 28 digits).
fn valid_trade_no(no: &str) -> bool {
    (1..=64).contains(&no.len()) && no.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// A 28-digit trade_no: the Beijing date, then digits, like Alipay's.
pub(super) fn new_trade_no(now_s: i64) -> String {
    let date: String = china_time(now_s).plain().chars().take(10).filter(char::is_ascii_digit).collect();
    format!("{date}2200{}", unique_digits(16))
}

/// `trade_status`: a paid trade refunded in full is `TRADE_CLOSED`, as at Alipay.
pub(super) fn trade_status(trade: &Trade, ledger: &Ledger) -> &'static str {
    match trade.state {
        TradeState::NotPaid | TradeState::Paying => "WAIT_BUYER_PAY",
        TradeState::Paid if ledger.refunded(&trade.out_trade_no).0 >= trade.amount => "TRADE_CLOSED",
        TradeState::Paid => "TRADE_SUCCESS",
        TradeState::Finished => "TRADE_FINISHED",
        TradeState::Closed => "TRADE_CLOSED",
    }
}

/// Why the gateway or the method refused a request.
#[derive(Clone)]
struct Refusal {
    code: &'static str,
    msg: &'static str,
    sub_code: &'static str,
    sub_msg: String,
}

fn missing(sub_code: &'static str, what: &str) -> Refusal {
    Refusal { code: "40001", msg: "Missing Required Arguments", sub_code, sub_msg: format!("缺少{what}参数") }
}

fn invalid(sub_code: &'static str, sub_msg: String) -> Refusal {
    Refusal { code: "40002", msg: "Invalid Arguments", sub_code, sub_msg }
}

fn business(sub_code: &'static str, sub_msg: &str) -> Refusal {
    Refusal { code: "40004", msg: "Business Failed", sub_code, sub_msg: sub_msg.to_owned() }
}

impl Refusal {
    /// `sub_code: sub_msg`, for a refusal told to the buyer rather than answered.
    fn told(&self) -> String {
        format!("{}: {}", self.sub_code, self.sub_msg)
    }
}

/// How a request signed for the buyer reached the platform.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Opened {
    /// The gateway URL with the signed form as its query, opened in a browser.
    Url,
    /// The signed form alone, handed to the Alipay app.
    OrderString,
}

pub(super) struct Checked {
    /// One of [`METHODS`], or `None`: answered as `error_response`.
    method: Option<&'static str>,
    /// The parsed `biz_content`, or why the gateway refuses the request.
    biz: Result<Map<String, Value>, Refusal>,
    /// The common parameter `notify_url`, if any.
    notify_url: Option<String>,
}

pub(super) struct Alipay {
    app_id: String,
    expected_notify_url: Option<String>,
    verifying_key: VerifyingKey<Sha256>,
    signing_key: SigningKey<Sha256>,
    ledger: Arc<Ledger>,
    /// Certificate mode's SNs, or `None` (public-key mode).
    certificates: Option<CertSns>,
}

impl Alipay {
    pub fn new(config: &AlipayApiConfig, key: RsaPrivateKey, ledger: Arc<Ledger>) -> Alipay {
        Alipay {
            app_id: config.app_id.clone(),
            expected_notify_url: config.expected_notify_url.clone(),
            verifying_key: VerifyingKey::new(config.app_public_key.clone()),
            signing_key: SigningKey::new(key),
            ledger,
            certificates: config.certificates.clone(),
        }
    }

    /// The gateway's checks, in its order: common parameters, app, signature.
    fn gateway(&self, params: &[(String, String)]) -> Result<(), Refusal> {
        let get =
            |name: &str| params.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str()).filter(|v| !v.is_empty());
        let app_id = get("app_id").ok_or_else(|| missing("isv.missing-app-id", "AppID"))?;
        let sign = get("sign").ok_or_else(|| missing("isv.missing-signature", "签名"))?;
        match get("sign_type") {
            None => return Err(missing("isv.missing-signature-type", "签名类型")),
            Some("RSA2") => {}
            Some(other) => return Err(invalid("isv.invalid-signature-type", format!("无效的签名类型 {other}"))),
        }
        if !get("charset").is_some_and(|c| c.eq_ignore_ascii_case("utf-8")) {
            return Err(invalid("isv.invalid-charset", "字符集须为 utf-8".into()));
        }
        if get("format").is_some_and(|f| !f.eq_ignore_ascii_case("JSON")) {
            return Err(invalid("isv.invalid-format", "格式须为 JSON".into()));
        }
        let timestamp = get("timestamp").ok_or_else(|| missing("isv.missing-timestamp", "时间戳"))?;
        match beijing_unix(timestamp, b' ') {
            Some(t) if (crate::now_s() - t).abs() <= CLOCK_SKEW_S => {}
            _ => {
                let why = format!("时间戳 {timestamp} 格式错误或偏离北京时间超过 15 分钟 (yyyy-MM-dd HH:mm:ss)");
                return Err(invalid("isv.invalid-timestamp", why));
            }
        }
        match get("version") {
            None => return Err(missing("isv.missing-version", "版本")),
            Some("1.0") => {}
            Some(other) => return Err(invalid("isv.invalid-version", format!("无效的版本 {other}"))),
        }
        if app_id != self.app_id {
            return Err(invalid("isv.invalid-app-id", format!("无效的 AppID 参数 {app_id}")));
        }
        if let Some(sns) = &self.certificates {
            // Certificate mode: the app's certificate and Alipay's root, by SN.
            let app_cert_sn =
                get("app_cert_sn").ok_or_else(|| missing("isv.missing-app-cert-sn", "应用公钥证书序列号"))?;
            if app_cert_sn != sns.app_cert_sn {
                return Err(invalid("isv.invalid-app-cert-sn", format!("应用公钥证书序列号 {app_cert_sn} 不匹配")));
            }
            let root_sn =
                get("alipay_root_cert_sn").ok_or_else(|| missing("isv.missing-root-cert-sn", "支付宝根证书序列号"))?;
            if root_sn != sns.alipay_root_cert_sn {
                return Err(invalid("isv.invalid-root-cert-sn", format!("支付宝根证书序列号 {root_sn} 不匹配")));
            }
        }
        if !self.verifies(params, sign) {
            return Err(invalid("isv.invalid-signature", "验签出错".into()));
        }
        Ok(())
    }

    /// RSA2 over `k=v&...` of every non-empty parameter but `sign`, sorted
    /// by name (the first of a repeated name).
    fn verifies(&self, params: &[(String, String)], sign: &str) -> bool {
        let mut signed: Vec<&(String, String)> = Vec::new();
        for pair in params {
            if pair.0 != "sign" && !pair.1.is_empty() && !signed.iter().any(|p| p.0 == pair.0) {
                signed.push(pair);
            }
        }
        signed.sort();
        let content = signed.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&");
        let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(sign) else { return false };
        let Ok(signature) = Signature::try_from(bytes.as_slice()) else { return false };
        self.verifying_key.verify(content.as_bytes(), &signature).is_ok()
    }

    /// `{"<method>_response":<response>,"sign":"<RSA2 of that text>"}`.
    fn respond(&self, method: Option<&str>, http_status: u16, response: &Value, fault: Option<&Fault>) -> Answer {
        let key = match method {
            Some(method) => format!("{}_response", method.replace('.', "_")),
            None => "error_response".to_owned(),
        };
        let text = response.to_string();
        let prefix = format!("{{\"{key}\":");
        let mut body = prefix.clone().into_bytes();
        body.extend_from_slice(text.as_bytes());
        if let Some(sns) = &self.certificates {
            // Certificate mode: which Alipay certificate's key signed it.
            body.extend_from_slice(format!(",\"alipay_cert_sn\":\"{}\"", sns.alipay_cert_sn).as_bytes());
        }
        match rsa_sign(&self.signing_key, text.as_bytes()) {
            Ok(sign) => body.extend_from_slice(format!(",\"sign\":\"{sign}\"}}").as_bytes()),
            // Unsigned, so the client refuses it.
            Err(_) => body.push(b'}'),
        }
        if fault == Some(&Fault::TamperAnswers) {
            tamper(&mut body[prefix.len()..prefix.len() + text.len()]);
        }
        let code = ["sub_code", "code"].iter().find_map(|k| response.get(*k)).and_then(Value::as_str);
        Answer {
            status: http_status,
            // What Alipay's gateway declares, though the body is JSON.
            headers: vec![("Content-Type".into(), "text/html;charset=utf-8".into())],
            body,
            code: code.map(str::to_owned),
        }
    }

    fn refused(&self, method: Option<&str>, refusal: &Refusal, fault: Option<&Fault>) -> Answer {
        let response = json!({
            "code": refusal.code, "msg": refusal.msg, "sub_code": refusal.sub_code, "sub_msg": refusal.sub_msg,
        });
        self.respond(method, 200, &response, fault)
    }

    /// The trade a precreate or a request the buyer opens asks for, or why
    /// it is refused (naming the parameter).
    fn requested_trade(
        &self,
        method: &'static str,
        biz: &Map<String, Value>,
        notify_url: Option<&str>,
    ) -> Result<Trade, Refusal> {
        let text = |name: &str| biz.get(name).and_then(Value::as_str).filter(|v| !v.is_empty());
        let out_trade_no = text("out_trade_no")
            .filter(|no| valid_out_trade_no(no))
            .ok_or_else(|| business("ACQ.INVALID_PARAMETER", "参数无效: out_trade_no"))?;
        let amount = text("total_amount")
            .and_then(yuan_to_fen)
            .filter(|fen| (1..=TOTAL_AMOUNT_FEN_MAX).contains(fen))
            .ok_or_else(|| business("ACQ.INVALID_PARAMETER", "参数无效: total_amount (0.01 至 100000000 元)"))?;
        let subject = text("subject")
            .filter(|s| s.chars().count() <= SUBJECT_CHARS_MAX)
            .ok_or_else(|| business("ACQ.INVALID_PARAMETER", "参数无效: subject 缺失或过长"))?;
        let expire =
            text("time_expire").ok_or_else(|| business("ACQ.INVALID_PARAMETER", "参数无效: 缺少 time_expire"))?;
        let expires_at_ms = beijing_unix(expire, b' ').map(|s| s * 1000).ok_or_else(|| {
            business("ACQ.INVALID_PARAMETER", &format!("参数无效: time_expire {expire:?} (yyyy-MM-dd HH:mm:ss)"))
        })?;
        if expires_at_ms <= now_ms() {
            return Err(business("ACQ.INVALID_PARAMETER", &format!("参数无效: time_expire {expire} 已过")));
        }
        if let Some(why) = notify_url_refusal(notify_url, self.expected_notify_url.as_deref()) {
            return Err(business("ACQ.INVALID_PARAMETER", &format!("参数无效: {why}")));
        }
        let payment = (method == PRECREATE).then(|| format!("https://qr.alipay.com/{}", random_token(24)));
        Ok(Trade {
            // Alipay numbers the trade when it is made.
            pay_no: Some(new_trade_no(crate::now_s())),
            expires_at_ms: Some(expires_at_ms),
            notify_url: notify_url.map(str::to_owned),
            description: Some(subject.to_owned()),
            payment,
            ..Trade::new(out_trade_no, amount, method)
        })
    }

    /// Makes the trade, or finds the one an identical earlier request made
    /// (the same amount: Alipay lets a trade be paid by any of its methods).
    fn make(&self, wanted: Trade) -> Result<Trade, Refusal> {
        let consistent = |existing: &Trade| {
            if existing.amount == wanted.amount {
                Ok(())
            } else {
                let (asked, made) = (fen_to_yuan(wanted.amount), fen_to_yuan(existing.amount));
                Err(format!("total_amount {asked} 与原交易 {made} 不一致"))
            }
        };
        match self.ledger.prepay(wanted.clone(), now_ms(), consistent) {
            Ok(trade) => Ok(trade),
            Err(PrepayRefused::Paid) => Err(business("ACQ.TRADE_HAS_SUCCESS", "交易已被支付")),
            Err(PrepayRefused::Closed) => Err(business("ACQ.TRADE_HAS_CLOSE", "交易已经关闭")),
            Err(PrepayRefused::Inconsistent(why)) => {
                Err(business("ACQ.CONTEXT_INCONSISTENT", &format!("交易信息被篡改: {why}")))
            }
        }
    }

    /// The buyer opens a page, wap or app request the merchant signed:
    /// checked as the gateway checks a call (the same signature, over the
    /// same parameters), then the trade made. What the platform records of
    /// it, and the out_trade_no or why it was refused (`sub_code: sub_msg`).
    pub(super) fn buyer_opens(&self, params: Vec<(String, String)>, opened: Opened) -> (Call, Result<String, String>) {
        let get = |name: &str| params.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone()).filter(|v| !v.is_empty());
        let method_text = get("method").unwrap_or_default();
        let biz_value = get("biz_content").and_then(|text| serde_json::from_str::<Value>(&text).ok());
        let verified = self.gateway(&params);
        let made = verified.as_ref().map_err(|refusal| refusal.clone()).and_then(|()| {
            let Some(&(method, product_code, how)) = BUYER_METHODS.iter().find(|(m, _, _)| *m == method_text) else {
                return Err(invalid("isv.invalid-method", format!("不存在的方法名 {method_text}")));
            };
            if how != opened {
                let by = if how == Opened::Url { "浏览器 (url)" } else { "支付宝 App (order_string)" };
                return Err(invalid("isv.invalid-method", format!("{method} 须由{by}打开")));
            }
            let Some(Value::Object(biz)) = &biz_value else {
                return Err(business("ACQ.INVALID_PARAMETER", "参数无效: biz_content 须为 JSON 对象"));
            };
            if biz.get("product_code").and_then(Value::as_str) != Some(product_code) {
                return Err(business("ACQ.INVALID_PARAMETER", &format!("参数无效: product_code 须为 {product_code}")));
            }
            let wanted = self.requested_trade(method, biz, get("notify_url").as_deref())?;
            self.make(wanted).map(|trade| trade.out_trade_no)
        });
        let code = match &made {
            Ok(_) => "10000",
            Err(refusal) => refusal.sub_code,
        };
        let call = Call {
            http_method: match opened {
                Opened::Url => "GET".to_owned(),
                Opened::OrderString => "APP".to_owned(),
            },
            api: method_text,
            body: biz_value.unwrap_or(Value::Null),
            params,
            verified: verified.is_ok(),
            // The cashier page (or Alipay's error page) is shown either way.
            status: Some(200),
            code: Some(code.to_owned()),
        };
        (call, made.map_err(|refusal| refusal.told()))
    }

    fn execute(
        &self,
        method: &str,
        biz: &Map<String, Value>,
        notify_url: Option<&str>,
        fault: Option<&Fault>,
    ) -> Result<Value, Refusal> {
        let text = |name: &str| biz.get(name).and_then(Value::as_str).filter(|v| !v.is_empty());
        let trade_not_exist = || business("ACQ.TRADE_NOT_EXIST", "交易不存在");
        // A trade is named by the merchant's out_trade_no or by Alipay's
        // trade_no (not both empty; both given, they must be one trade's).
        // A trade being made has only the merchant's (precreate takes no trade_no).
        let invalid_no = || business("ACQ.INVALID_PARAMETER", "参数无效: out_trade_no");
        let by_trade_no = match text("trade_no") {
            None => None,
            Some(_) if method == PRECREATE => None,
            Some(no) if !valid_trade_no(no) => {
                return Err(business("ACQ.INVALID_PARAMETER", "参数无效: trade_no"));
            }
            Some(no) => Some(self.ledger.trade_by_pay_no(no).ok_or_else(trade_not_exist)?),
        };
        let out_trade_no = match (text("out_trade_no"), &by_trade_no) {
            (Some(no), _) if !valid_out_trade_no(no) => return Err(invalid_no()),
            (Some(no), Some(trade)) if no != trade.out_trade_no => {
                return Err(business("ACQ.INVALID_PARAMETER", "参数无效: out_trade_no 与 trade_no 不是同一笔交易"));
            }
            (Some(no), _) => no.to_owned(),
            (None, Some(trade)) => trade.out_trade_no.clone(),
            (None, None) => return Err(invalid_no()),
        };
        let out_trade_no = out_trade_no.as_str();
        let answered_no = match fault {
            Some(Fault::WrongTrade) => other_trade_no(out_trade_no),
            _ => out_trade_no.to_owned(),
        };
        let mut answer = json!({"code": "10000", "msg": "Success"});
        match method {
            PRECREATE => {
                let trade = self.make(self.requested_trade(PRECREATE, biz, notify_url)?)?;
                answer["out_trade_no"] = json!(answered_no);
                answer["qr_code"] = json!(trade.payment);
            }
            "alipay.trade.query" => {
                let trade = self.ledger.trade(out_trade_no).ok_or_else(trade_not_exist)?;
                let paid = matches!(trade.state, TradeState::Paid | TradeState::Finished);
                let yuan = fen_to_yuan(trade.amount);
                let paid_yuan = if paid { yuan.clone() } else { fen_to_yuan(0) };
                answer["trade_no"] = json!(trade.pay_no);
                answer["out_trade_no"] = json!(answered_no);
                answer["buyer_logon_id"] = json!(BUYER_LOGON_ID);
                answer["buyer_user_id"] = json!(BUYER_USER_ID);
                answer["trade_status"] = json!(trade_status(&trade, &self.ledger));
                if let (true, Some(at)) = (paid, trade.paid_at) {
                    answer["send_pay_date"] = json!(china_time(at).plain());
                }
                // The amounts last, so a tampered answer (the last digit) is a wrong amount.
                answer["total_amount"] = json!(yuan);
                answer["buyer_pay_amount"] = json!(paid_yuan);
                answer["point_amount"] = json!("0.00");
                answer["invoice_amount"] = json!(paid_yuan);
                answer["receipt_amount"] = json!(paid_yuan);
            }
            "alipay.trade.close" => {
                let trade = match self.ledger.close(out_trade_no) {
                    Ok(trade) => trade,
                    Err(CloseRefused::NoSuchTrade) => return Err(trade_not_exist()),
                    Err(CloseRefused::AlreadyClosed | CloseRefused::Paid) => {
                        return Err(business("ACQ.TRADE_STATUS_ERROR", "交易状态不合法"));
                    }
                };
                answer["trade_no"] = json!(trade.pay_no);
                answer["out_trade_no"] = json!(answered_no);
            }
            "alipay.trade.refund" => {
                let amount = text("refund_amount")
                    .and_then(yuan_to_fen)
                    .ok_or_else(|| business("ACQ.INVALID_PARAMETER", "参数无效: refund_amount"))?;
                // Without out_request_no Alipay takes the refund as the trade's whole one.
                let request_no = text("out_request_no").unwrap_or(out_trade_no);
                let new_id = || unique_digits(28);
                let (_, trade, fresh) =
                    match self.ledger.refund(out_trade_no, request_no, amount, crate::now_s(), new_id) {
                        Ok(done) => done,
                        Err(RefundRefused::NoSuchTrade) => return Err(trade_not_exist()),
                        Err(RefundRefused::NotPaid) => {
                            return Err(business("ACQ.TRADE_STATUS_ERROR", "交易状态不合法"))
                        }
                        Err(RefundRefused::Finished) => return Err(business("ACQ.TRADE_HAS_FINISHED", "交易已完结")),
                        Err(RefundRefused::Exceeds) => {
                            return Err(business("ACQ.REFUND_AMT_NOT_EQUAL_TOTAL", "退款金额超限"));
                        }
                        Err(RefundRefused::Discordant) => {
                            return Err(business("ACQ.DISCORDANT_REPEAT_REQUEST", "请求信息不一致"));
                        }
                    };
                answer["trade_no"] = json!(trade.pay_no);
                answer["out_trade_no"] = json!(answered_no);
                answer["buyer_logon_id"] = json!(BUYER_LOGON_ID);
                // "Did this call move money": a repeat of a refund does not.
                answer["fund_change"] = json!(if fresh { "Y" } else { "N" });
                // The trade's refunds so far, this one included.
                answer["refund_fee"] = json!(fen_to_yuan(self.ledger.refunded(out_trade_no).1));
                answer["gmt_refund_pay"] = json!(china_time(crate::now_s()).plain());
                answer["buyer_user_id"] = json!(BUYER_USER_ID);
            }
            _ => {
                let trade = self.ledger.trade(out_trade_no).ok_or_else(trade_not_exist)?;
                let request_no = text("out_request_no").unwrap_or(out_trade_no);
                answer["trade_no"] = json!(trade.pay_no);
                answer["out_trade_no"] = json!(answered_no);
                let refund = self.ledger.refund_of(request_no).filter(|(r, _)| r.out_trade_no == out_trade_no);
                // No such refund: a success without refund fields, as Alipay answers.
                if let Some((refund, _)) = refund {
                    answer["out_request_no"] = json!(refund.out_refund_no);
                    answer["total_amount"] = json!(fen_to_yuan(trade.amount));
                    answer["refund_amount"] = json!(fen_to_yuan(refund.amount));
                    // Only a settled refund says so; one not yet settled (or
                    // failed) has no refund_status at all.
                    if let (RefundStatus::Success, Some(at)) = (refund.status, refund.settled_at) {
                        answer["refund_status"] = json!("REFUND_SUCCESS");
                        answer["gmt_refund_pay"] = json!(china_time(at).plain());
                    }
                }
            }
        }
        Ok(answer)
    }
}

/// The form's parameters: the query string's (where Alipay's SDKs put the
/// common ones), then the body's when it is a form.
fn parameters(request: &Request) -> Option<Vec<(String, String)>> {
    let mut params = parse_form(request.query())?;
    let form = request
        .header("Content-Type")
        .is_some_and(|t| t.to_ascii_lowercase().starts_with("application/x-www-form-urlencoded"));
    if form {
        params.extend(parse_form(std::str::from_utf8(&request.body).ok()?)?);
    }
    Some(params)
}

impl Api for Alipay {
    type Checked = Checked;

    fn check(&self, request: &Request) -> (Call, Checked) {
        let params = parameters(request);
        let get = |name: &str| params.as_ref()?.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
        let method_text = get("method").unwrap_or_default();
        let notify_url = get("notify_url");
        let method = METHODS.iter().copied().find(|m| *m == method_text);
        let biz_value = get("biz_content").and_then(|text| serde_json::from_str::<Value>(&text).ok());
        let biz = match (&params, method) {
            (None, _) => Err(invalid("isv.invalid-parameter", "参数编码无效 (须为 utf-8 的表单)".into())),
            (Some(_), _) if method_text.is_empty() => Err(missing("isv.missing-method", "方法名")),
            (Some(_), None) => Err(invalid("isv.invalid-method", format!("不存在的方法名 {method_text}"))),
            (Some(params), Some(_)) => self.gateway(params).and_then(|()| match &biz_value {
                Some(Value::Object(biz)) => Ok(biz.clone()),
                _ => Err(business("ACQ.INVALID_PARAMETER", "参数无效: biz_content 须为 JSON 对象")),
            }),
        };
        // Verified when the gateway got past the signature (a business
        // refusal comes after it).
        let verified = match &biz {
            Ok(_) => true,
            Err(refusal) => refusal.code == "40004",
        };
        let call = Call {
            http_method: request.method.clone(),
            api: method_text,
            body: biz_value.unwrap_or(Value::Null),
            params: params.unwrap_or_default(),
            verified,
            status: None,
            code: None,
        };
        (call, Checked { method, biz, notify_url })
    }

    fn answer(&self, _request: &Request, checked: Checked, fault: Option<&Fault>) -> Answer {
        if fault == Some(&Fault::ServerError) {
            let response = json!({
                "code": "20000", "msg": "Service Currently Unavailable",
                "sub_code": "isp.unknow-error", "sub_msg": "系统繁忙",
            });
            return self.respond(checked.method, 500, &response, fault);
        }
        let result = match (checked.biz, checked.method) {
            (Ok(biz), Some(method)) => self.execute(method, &biz, checked.notify_url.as_deref(), fault),
            (Err(refusal), _) => Err(refusal),
            // check() refuses every request without a known method.
            (Ok(_), None) => Err(invalid("isv.invalid-method", "不存在的方法名".into())),
        };
        match result {
            Ok(response) => self.respond(checked.method, 200, &response, fault),
            Err(refusal) => self.refused(checked.method, &refusal, fault),
        }
    }
}
