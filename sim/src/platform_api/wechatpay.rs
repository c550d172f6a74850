//! WeChat Pay APIv3, the merchant's side: the prepay of each trade type
//! (`POST /v3/pay/transactions/{native|jsapi|h5|app}`, the only way a
//! trade is made), query by out_trade_no, close, domestic refund (of the
//! trade named by out_trade_no or by transaction_id) and its query, at the
//! documented paths. Requests carry
//! `Authorization: WECHATPAY2-SHA256-RSA2048 ...`, SHA256withRSA by the merchant's key over
//! `"{METHOD}\n{path?query}\n{timestamp}\n{nonce}\n{body}\n"`; answers are
//! signed by the platform key exactly as its notifications are.

use super::http::{parse_form, percent_decode, Answer, Api, Request};
use super::ledger::{CloseRefused, Ledger, PrepayRefused, RefundRefused, Trade, TradeState};
use super::{
    beijing_unix, notify_url_refusal, now_ms, other_trade_no, random_token, tamper, unique_digits, Call, Fault,
    RefundStatus, WechatpayApiConfig,
};
use crate::platform::{china_time, wechatpay_signature_headers};
use base64::Engine;
use rsa::pkcs1v15::{Signature, SigningKey, VerifyingKey};
use rsa::signature::Verifier;
use serde_json::{json, Value};
use sha2::Sha256;
use std::collections::HashMap;
use std::sync::Arc;

/// How far a request's timestamp may be from the platform's clock.
const CLOCK_SKEW_S: i64 = 300;
/// `mchid` and `appid` of the merchant a [`Fault::WrongMerchant`] answer names.
const OTHER_MCHID: &str = "1900009999";
const OTHER_APPID: &str = "wxothermerchant0000";

/// A QR code the buyer scans; also what a trade made out of band is taken for.
pub(super) const NATIVE: &str = "NATIVE";
/// The prepay paths' last segment and the trade type each makes.
const TRADE_TYPES: [(&str, &str); 4] = [("native", NATIVE), ("jsapi", "JSAPI"), ("h5", "H5"), ("app", "APP")];
const PREPAY_PATH: &str = "/v3/pay/transactions/";
/// WeChat's limit on a trade's `description`, in characters.
const DESCRIPTION_CHARS_MAX: usize = 127;

/// `target` (a path, with any query) is one of the prepay APIs.
pub(super) fn is_prepay(target: &str) -> bool {
    let path = target.split_once('?').map_or(target, |(path, _)| path);
    path.strip_prefix(PREPAY_PATH).is_some_and(|kind| TRADE_TYPES.iter().any(|(k, _)| *k == kind))
}

/// The member of a prepay answer that hands the buyer the payment.
fn payment_key(trade_type: &str) -> &'static str {
    match trade_type {
        NATIVE => "code_url",
        "H5" => "h5_url",
        _ => "prepay_id",
    }
}

/// A fresh payment identifier of its trade type: the QR code text of a
/// NATIVE trade, the page an H5 trade is paid on, or the prepay_id
/// (`wx`, the Beijing time, digits) a JSAPI page or an app passes on.
fn new_payment(trade_type: &str) -> String {
    let date: String = china_time(crate::now_s()).plain().chars().filter(char::is_ascii_digit).collect();
    let prepay_id = format!("wx{date}{}", unique_digits(20));
    match trade_type {
        NATIVE => format!("weixin://wxpay/bizpayurl?pr={}", random_token(9)),
        "H5" => format!(
            "https://wx.tenpay.com/cgi-bin/mmpayweb-bin/checkmweb?prepay_id={prepay_id}&package={}",
            unique_digits(10)
        ),
        _ => prepay_id,
    }
}

/// `yyyy-MM-DDTHH:mm:ss+08:00`, the one form of `time_expire` taken here, as Unix milliseconds.
fn time_expire_ms(text: &str) -> Option<i64> {
    let local = text.strip_suffix("+08:00")?;
    Some(beijing_unix(local, b'T')? * 1000)
}

/// A 6-32 character out_trade_no of `[A-Za-z0-9_*|-]` (payonce's rule, docs/platforms.md).
pub(super) fn valid_out_trade_no(no: &str) -> bool {
    (6..=32).contains(&no.len()) && no.bytes().all(|b| b.is_ascii_alphanumeric() || b"_*|-".contains(&b))
}

/// WeChat's refund numbers: up to 64 of `[A-Za-z0-9_|*@-]`.
fn valid_out_refund_no(no: &str) -> bool {
    (1..=64).contains(&no.len()) && no.bytes().all(|b| b.is_ascii_alphanumeric() || b"_|*@-".contains(&b))
}

/// A transaction_id as a merchant may send it: up to 32 of `[A-Za-z0-9]`
/// (WeChat's own are 28 digits).
fn valid_transaction_id(id: &str) -> bool {
    (1..=32).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// A 28-digit transaction_id, `4200...` like WeChat's.
pub(super) fn new_transaction_id() -> String {
    format!("4200{}", unique_digits(24))
}

/// `trade_state` of a trade: a paid one becomes `REFUND` once a refund is requested.
pub(super) fn trade_state(trade: &Trade, ledger: &Ledger) -> &'static str {
    match trade.state {
        TradeState::NotPaid => "NOTPAY",
        TradeState::Paying => "USERPAYING",
        TradeState::Paid | TradeState::Finished if ledger.has_refunds(&trade.out_trade_no) => "REFUND",
        TradeState::Paid | TradeState::Finished => "SUCCESS",
        TradeState::Closed => "CLOSED",
    }
}

fn trade_state_desc(state: &str) -> &'static str {
    match state {
        "SUCCESS" => "支付成功",
        "REFUND" => "转入退款",
        "USERPAYING" => "用户支付中",
        "CLOSED" => "已关闭",
        _ => "订单未支付",
    }
}

#[derive(Debug)]
enum Route {
    /// The trade type to make.
    Prepay(&'static str),
    Query(String),
    Close(String),
    Refund,
    RefundQuery(String),
    /// `GET /v3/certificates`.
    Certificates,
}

pub(super) struct Checked {
    /// `None`: no such API.
    route: Option<Route>,
    /// Why the request is not the merchant's (401), or a header WeChat
    /// requires is missing (400).
    refusal: Option<(u16, &'static str, String)>,
    body: Value,
}

pub(super) struct Wechatpay {
    mchid: String,
    appid: String,
    appids: Vec<String>,
    expected_notify_url: Option<String>,
    merchant_serial: String,
    verifying_key: VerifyingKey<Sha256>,
    /// What it signs with now and the certificates it lists: shared with
    /// [`super::PlatformApi`], whose controls rotate them.
    keys: Arc<parking_lot::RwLock<SigningState>>,
    /// The merchant's APIv3 key, which `/v3/certificates` encrypts with;
    /// `None`: that API answers 404.
    apiv3_key: Option<Vec<u8>>,
    ledger: Arc<Ledger>,
}

/// The simulated WeChat Pay's keys at one moment.
pub(super) struct SigningState {
    /// The serial its answers name (`Wechatpay-Serial`), and its key.
    pub serial: String,
    pub key: SigningKey<Sha256>,
    /// The platform certificates `GET /v3/certificates` lists.
    pub certificates: Vec<super::certs::PlatformCertificate>,
}

impl Wechatpay {
    pub fn new(
        config: &WechatpayApiConfig,
        keys: Arc<parking_lot::RwLock<SigningState>>,
        ledger: Arc<Ledger>,
    ) -> Wechatpay {
        Wechatpay {
            mchid: config.mchid.clone(),
            appid: config.appid.clone(),
            appids: config.appids.clone(),
            expected_notify_url: config.expected_notify_url.clone(),
            merchant_serial: config.merchant_serial.clone(),
            verifying_key: VerifyingKey::new(config.merchant_public_key.clone()),
            keys,
            apiv3_key: config.apiv3_key.clone(),
            ledger,
        }
    }

    /// `Ok` when the request is the merchant's, signed within the clock skew.
    fn authenticate(&self, request: &Request) -> Result<(), String> {
        let header = request.header("Authorization").ok_or("no Authorization header")?;
        let list = header
            .strip_prefix("WECHATPAY2-SHA256-RSA2048 ")
            .ok_or("the Authorization scheme is not WECHATPAY2-SHA256-RSA2048")?;
        let mut fields = HashMap::new();
        for part in list.split(',') {
            let (name, value) = part.trim().split_once('=').ok_or_else(|| format!("Authorization: {part:?}"))?;
            let value = value.strip_prefix('"').and_then(|v| v.strip_suffix('"'));
            fields.insert(name, value.ok_or_else(|| format!("Authorization: {name} is not quoted"))?);
        }
        let field = |name: &str| fields.get(name).copied().ok_or_else(|| format!("Authorization has no {name}"));
        let (mchid, nonce, signature) = (field("mchid")?, field("nonce_str")?, field("signature")?);
        let (timestamp, serial) = (field("timestamp")?, field("serial_no")?);
        if mchid != self.mchid {
            return Err(format!("mchid {mchid} is not this merchant ({})", self.mchid));
        }
        if serial != self.merchant_serial {
            return Err(format!("serial_no {serial} is not the merchant's certificate serial"));
        }
        let t: i64 = timestamp.parse().map_err(|_| format!("timestamp {timestamp:?} is not Unix seconds"))?;
        let skew = (crate::now_s() - t).abs();
        if skew > CLOCK_SKEW_S {
            return Err(format!("timestamp {t} is {skew} s off"));
        }
        let mut message = format!("{}\n{}\n{timestamp}\n{nonce}\n", request.method, request.target).into_bytes();
        message.extend_from_slice(&request.body);
        message.push(b'\n');
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(signature)
            .map_err(|_| "the signature is not base64".to_owned())?;
        let signature = Signature::try_from(bytes.as_slice()).map_err(|_| "not an RSA signature".to_owned())?;
        self.verifying_key.verify(&message, &signature).map_err(|_| "the signature does not verify".to_owned())
    }

    /// A JSON answer, signed (and tampered with after, if that is the fault).
    fn json(&self, status: u16, value: &Value, fault: Option<&Fault>) -> Answer {
        let mut body = value.to_string().into_bytes();
        let mut headers = vec![("Content-Type".into(), "application/json; charset=utf-8".into())];
        headers.extend(self.signature_headers(&body));
        if fault == Some(&Fault::TamperAnswers) {
            tamper(&mut body);
        }
        let code = value.get("code").and_then(Value::as_str).map(str::to_owned);
        Answer { status, headers, body, code }
    }

    /// `204 No Content`, signed over the empty body.
    fn no_content(&self, fault: Option<&Fault>) -> Answer {
        let mut headers = self.signature_headers(b"");
        if fault == Some(&Fault::TamperAnswers) {
            // Nothing to change in an empty body: its signature goes wrong instead.
            for (name, value) in &mut headers {
                if name == "Wechatpay-Signature" {
                    let first = if value.starts_with('A') { "B" } else { "A" };
                    value.replace_range(..1, first);
                }
            }
        }
        Answer { status: 204, headers, body: Vec::new(), code: None }
    }

    fn signature_headers(&self, body: &[u8]) -> Vec<(String, String)> {
        let mut headers = vec![("Request-ID".to_owned(), format!("sim-{}", unique_digits(20)))];
        let keys = self.keys.read();
        match wechatpay_signature_headers(&keys.key, &keys.serial, body, crate::now_s()) {
            Ok(signed) => headers.extend(signed),
            // Unsigned, so the client refuses it: the honest answer of a
            // platform that cannot sign.
            Err(e) => headers.push(("Wechatpay-Sim-Error".into(), e)),
        }
        headers
    }

    /// `GET /v3/certificates`: every certificate listed, its PEM encrypted
    /// with the APIv3 key (AEAD_AES_256_GCM, a fresh nonce, associated data
    /// `certificate`), the answer signed like every other.
    fn certificates(&self, fault: Option<&Fault>) -> Answer {
        use aes_gcm::aead::{Aead, Payload};
        use aes_gcm::{Aes256Gcm, KeyInit, Nonce};
        let Some(cipher) = self.apiv3_key.as_deref().and_then(|key| Aes256Gcm::new_from_slice(key).ok()) else {
            return self.error(404, "NOT_FOUND", "该商户未使用平台证书", fault);
        };
        let listed: Vec<(String, String, i64)> =
            self.keys.read().certificates.iter().map(|c| (c.serial.clone(), c.pem.clone(), c.expire_ms)).collect();
        let mut data = Vec::new();
        for (serial, pem, expire_ms) in listed {
            let nonce = random_token(12);
            let Ok(ciphertext) = cipher
                .encrypt(Nonce::from_slice(nonce.as_bytes()), Payload { msg: pem.as_bytes(), aad: b"certificate" })
            else {
                return self.error(500, "SYSTEM_ERROR", "加密失败", fault);
            };
            data.push(json!({
                "serial_no": serial,
                "effective_time": china_time(crate::now_s() - 86_400).rfc3339(),
                "expire_time": china_time(expire_ms.div_euclid(1000)).rfc3339(),
                "encrypt_certificate": {
                    "algorithm": "AEAD_AES_256_GCM",
                    "nonce": nonce,
                    "associated_data": "certificate",
                    "ciphertext": base64::engine::general_purpose::STANDARD.encode(ciphertext),
                }
            }));
        }
        self.json(200, &json!({ "data": data }), fault)
    }

    fn error(&self, status: u16, code: &str, message: &str, fault: Option<&Fault>) -> Answer {
        self.json(status, &json!({"code": code, "message": message}), fault)
    }

    /// A prepay: the trade made (or its identical twin found) and the
    /// payment handed over, or why not. The same request again gets the
    /// same answer, as WeChat gives for a merchant's retry.
    fn prepay(&self, trade_type: &'static str, body: &Value, fault: Option<&Fault>) -> Answer {
        let wanted = match self.prepay_trade(trade_type, body) {
            Ok(trade) => trade,
            Err((code, message)) => return self.error(400, code, &message, fault),
        };
        let consistent = |existing: &Trade| {
            let mut other = Vec::new();
            if existing.trade_type != wanted.trade_type {
                other.push(format!("trade_type {} (now {})", existing.trade_type, wanted.trade_type));
            }
            if existing.appid.is_some() && existing.appid != wanted.appid {
                other.push(format!("appid {}", existing.appid.as_deref().unwrap_or_default()));
            }
            if existing.amount != wanted.amount {
                other.push(format!("amount.total {}", existing.amount));
            }
            if other.is_empty() {
                Ok(())
            } else {
                Err(format!("made with {}", other.join(", ")))
            }
        };
        match self.ledger.prepay(wanted.clone(), now_ms(), consistent) {
            Ok(trade) => {
                let mut answer = serde_json::Map::new();
                answer.insert(payment_key(trade_type).to_owned(), json!(trade.payment));
                self.json(200, &Value::Object(answer), fault)
            }
            Err(PrepayRefused::Paid) => self.error(400, "ORDERPAID", "该订单已支付", fault),
            Err(PrepayRefused::Closed) => self.error(400, "ORDER_CLOSED", "订单已关闭", fault),
            Err(PrepayRefused::Inconsistent(why)) => {
                let message = format!("订单号重复: out_trade_no used with other parameters ({why})");
                self.error(400, "INVALID_REQUEST", &message, fault)
            }
        }
    }

    /// The trade a prepay body asks for, or the code and message (naming
    /// the field) it is refused with.
    fn prepay_trade(&self, trade_type: &'static str, body: &Value) -> Result<Trade, (&'static str, String)> {
        let param = |message: String| ("PARAM_ERROR", message);
        let text = |value: &Value| value.as_str().filter(|v| !v.is_empty()).map(str::to_owned);
        match text(&body["mchid"]) {
            None => return Err(param("缺少参数 mchid".into())),
            Some(mchid) if mchid != self.mchid => return Err(param("mchid 与请求头中的商户号不一致".into())),
            Some(_) => {}
        }
        let appid = text(&body["appid"]).ok_or_else(|| param("缺少参数 appid".into()))?;
        if !self.appids.contains(&appid) {
            return Err(("APPID_MCHID_NOT_MATCH", format!("appid {appid} 与 mchid {} 不匹配", self.mchid)));
        }
        let out_trade_no = text(&body["out_trade_no"])
            .filter(|no| valid_out_trade_no(no))
            .ok_or_else(|| param("out_trade_no 缺失或格式错误 (6-32 个 [A-Za-z0-9_*|-] 字符)".into()))?;
        let description = text(&body["description"])
            .filter(|d| d.chars().count() <= DESCRIPTION_CHARS_MAX)
            .ok_or_else(|| param(format!("description 缺失或超过 {DESCRIPTION_CHARS_MAX} 个字符")))?;
        let amount = &body["amount"];
        let total =
            amount["total"].as_i64().filter(|t| *t > 0).ok_or_else(|| param("amount.total 须为正整数(分)".into()))?;
        // WeChat takes a missing currency as CNY, its only one here.
        if amount.get("currency").is_some_and(|c| c != "CNY") {
            return Err(param("amount.currency 须为 CNY".into()));
        }
        let expire = text(&body["time_expire"]).ok_or_else(|| param("缺少参数 time_expire".into()))?;
        let expires_at_ms = time_expire_ms(&expire)
            .ok_or_else(|| param(format!("time_expire {expire:?} 格式错误 (yyyy-MM-DDTHH:mm:ss+08:00)")))?;
        if expires_at_ms <= now_ms() {
            return Err(param(format!("time_expire {expire} 已过")));
        }
        let notify_url = text(&body["notify_url"]);
        if let Some(why) = notify_url_refusal(notify_url.as_deref(), self.expected_notify_url.as_deref()) {
            return Err(param(why));
        }
        if trade_type == "JSAPI" && text(&body["payer"]["openid"]).is_none() {
            return Err(param("JSAPI 下单缺少参数 payer.openid".into()));
        }
        if trade_type == "H5" {
            let scene = &body["scene_info"];
            if text(&scene["payer_client_ip"]).is_none() {
                return Err(param("H5 下单缺少参数 scene_info.payer_client_ip".into()));
            }
            if text(&scene["h5_info"]["type"]).is_none() {
                return Err(param("H5 下单缺少参数 scene_info.h5_info.type".into()));
            }
        }
        Ok(Trade {
            expires_at_ms: Some(expires_at_ms),
            notify_url,
            appid: Some(appid),
            description: Some(description),
            payment: Some(new_payment(trade_type)),
            ..Trade::new(&out_trade_no, total, trade_type)
        })
    }

    fn query(&self, out_trade_no: &str, request: &Request, fault: Option<&Fault>) -> Answer {
        let query = parse_form(request.query()).unwrap_or_default();
        match query.iter().find(|(name, _)| name == "mchid") {
            None => return self.error(400, "PARAM_ERROR", "缺少参数 mchid", fault),
            Some((_, mchid)) if *mchid != self.mchid => {
                return self.error(400, "PARAM_ERROR", "mchid 与请求头中的商户号不一致", fault);
            }
            Some(_) => {}
        }
        let Some(trade) = self.ledger.trade(out_trade_no) else {
            return self.error(404, "ORDER_NOT_EXIST", "订单不存在", fault);
        };
        let state = trade_state(&trade, &self.ledger);
        let paid = matches!(trade.state, TradeState::Paid | TradeState::Finished);
        let (mchid, appid) = match fault {
            Some(Fault::WrongMerchant) => (OTHER_MCHID, OTHER_APPID),
            _ => (self.mchid.as_str(), trade.appid.as_deref().unwrap_or(&self.appid)),
        };
        let mut answer = json!({
            "mchid": mchid,
            "appid": appid,
            "out_trade_no": answered_trade_no(&trade.out_trade_no, fault),
        });
        if paid {
            answer["transaction_id"] = json!(trade.pay_no);
        }
        answer["trade_type"] = json!(trade.trade_type);
        answer["trade_state"] = json!(state);
        answer["trade_state_desc"] = json!(trade_state_desc(state));
        if paid {
            answer["bank_type"] = json!("OTHERS");
        }
        answer["attach"] = json!("");
        if let (true, Some(paid_at)) = (paid, trade.paid_at) {
            answer["success_time"] = json!(china_time(paid_at).rfc3339());
            answer["payer"] = json!({"openid": "oSimulatorPayonceBuyer0000000"});
        }
        let currency = match fault {
            Some(Fault::Currency(currency)) => currency.as_str(),
            _ => "CNY",
        };
        answer["amount"] = if paid {
            json!({"total": trade.amount, "payer_total": trade.amount, "currency": currency, "payer_currency": currency})
        } else {
            json!({"total": trade.amount, "currency": currency, "payer_currency": currency})
        };
        self.json(200, &answer, fault)
    }

    fn close(&self, out_trade_no: &str, body: &Value, fault: Option<&Fault>) -> Answer {
        match body.get("mchid").and_then(Value::as_str) {
            None => return self.error(400, "PARAM_ERROR", "缺少参数 mchid", fault),
            Some(mchid) if mchid != self.mchid => {
                return self.error(400, "PARAM_ERROR", "mchid 与请求头中的商户号不一致", fault);
            }
            Some(_) => {}
        }
        match self.ledger.close(out_trade_no) {
            // WeChat answers 204 for a trade it never had, too.
            Ok(_) | Err(CloseRefused::NoSuchTrade) => self.no_content(fault),
            Err(CloseRefused::AlreadyClosed) => self.error(400, "ORDER_CLOSED", "订单已关闭", fault),
            Err(CloseRefused::Paid) => self.error(400, "ORDERPAID", "订单已支付", fault),
        }
    }

    fn refund(&self, body: &Value, fault: Option<&Fault>) -> Answer {
        let text = |name: &str| body.get(name).and_then(Value::as_str);
        // The trade by the merchant's number or by WeChat's (二选一: exactly one).
        let trade = match (body.get("out_trade_no"), body.get("transaction_id")) {
            (Some(_), Some(_)) => {
                return self.error(400, "PARAM_ERROR", "transaction_id 与 out_trade_no 二选一，不能同时传入", fault);
            }
            (None, None) => return self.error(400, "PARAM_ERROR", "缺少参数 transaction_id 或 out_trade_no", fault),
            (Some(no), None) => match no.as_str().filter(|no| valid_out_trade_no(no)) {
                Some(no) => self.ledger.trade(no),
                None => return self.error(400, "PARAM_ERROR", "out_trade_no 格式错误", fault),
            },
            (None, Some(id)) => match id.as_str().filter(|id| valid_transaction_id(id)) {
                Some(id) => self.ledger.trade_by_pay_no(id),
                None => return self.error(400, "PARAM_ERROR", "transaction_id 格式错误", fault),
            },
        };
        let Some(out_refund_no) = text("out_refund_no").filter(|no| valid_out_refund_no(no)) else {
            return self.error(400, "PARAM_ERROR", "out_refund_no 缺失或格式错误", fault);
        };
        let amount = &body["amount"];
        let (Some(refund), Some(total)) = (amount["refund"].as_i64(), amount["total"].as_i64()) else {
            return self.error(400, "PARAM_ERROR", "amount.refund 与 amount.total 须为整数(分)", fault);
        };
        if amount["currency"].as_str() != Some("CNY") {
            return self.error(400, "PARAM_ERROR", "amount.currency 须为 CNY", fault);
        }
        // Both optional; present, they must be strings WeChat can hold.
        let malformed =
            |name: &str, max: usize| body.get(name).is_some_and(|v| v.as_str().is_none_or(|s| s.chars().count() > max));
        if malformed("reason", 80) || malformed("notify_url", 256) {
            return self.error(400, "PARAM_ERROR", "reason 或 notify_url 格式错误", fault);
        }
        let out_trade_no = match trade {
            None => return self.error(404, "RESOURCE_NOT_EXISTS", "订单不存在", fault),
            Some(trade) if trade.amount != total => {
                return self.error(400, "INVALID_REQUEST", "amount.total 与原订单金额不一致", fault);
            }
            Some(trade) => trade.out_trade_no,
        };
        let now = crate::now_s();
        let new_id = || format!("50{}", unique_digits(27));
        match self.ledger.refund(&out_trade_no, out_refund_no, refund, now, new_id) {
            Ok((refund, trade, _)) => self.json(200, &self.refund_answer(&refund, &trade, fault), fault),
            Err(RefundRefused::NoSuchTrade) => self.error(404, "RESOURCE_NOT_EXISTS", "订单不存在", fault),
            Err(RefundRefused::NotPaid | RefundRefused::Finished) => {
                self.error(400, "INVALID_REQUEST", "订单未支付或已关闭，不能退款", fault)
            }
            Err(RefundRefused::Exceeds) => self.error(400, "INVALID_REQUEST", "申请退款金额超过订单可退金额", fault),
            Err(RefundRefused::Discordant) => {
                self.error(400, "INVALID_REQUEST", "退款单号已用于另一订单或另一金额", fault)
            }
        }
    }

    fn refund_query(&self, out_refund_no: &str, fault: Option<&Fault>) -> Answer {
        match self.ledger.refund_of(out_refund_no) {
            Some((refund, trade)) => self.json(200, &self.refund_answer(&refund, &trade, fault), fault),
            None => self.error(404, "RESOURCE_NOT_EXISTS", "退款单不存在", fault),
        }
    }

    fn refund_answer(&self, refund: &super::ledger::Refund, trade: &Trade, fault: Option<&Fault>) -> Value {
        let mut answer = json!({
            "refund_id": refund.refund_id,
            "out_refund_no": refund.out_refund_no,
            "transaction_id": trade.pay_no,
            "out_trade_no": answered_trade_no(&trade.out_trade_no, fault),
            "channel": "ORIGINAL",
            "user_received_account": "支付用户零钱",
        });
        if let (RefundStatus::Success, Some(at)) = (refund.status, refund.settled_at) {
            answer["success_time"] = json!(china_time(at).rfc3339());
        }
        answer["create_time"] = json!(china_time(refund.created_at).rfc3339());
        answer["status"] = json!(refund.status.wechatpay());
        answer["funds_account"] = json!("AVAILABLE");
        answer["amount"] = json!({
            "total": trade.amount,
            "refund": refund.amount,
            "payer_total": trade.amount,
            "payer_refund": refund.amount,
            "settlement_total": trade.amount,
            "settlement_refund": refund.amount,
            "discount_refund": 0,
            "currency": "CNY",
        });
        answer
    }
}

/// The out_trade_no an answer names: the one asked about, unless the fault
/// is answering about another trade.
fn answered_trade_no(out_trade_no: &str, fault: Option<&Fault>) -> String {
    match fault {
        Some(Fault::WrongTrade) => other_trade_no(out_trade_no),
        _ => out_trade_no.to_owned(),
    }
}

fn route(method: &str, path: &str) -> Option<Route> {
    const TRADE: &str = "/v3/pay/transactions/out-trade-no/";
    const REFUNDS: &str = "/v3/refund/domestic/refunds";
    if let (true, Some(kind)) = (method == "POST", path.strip_prefix(PREPAY_PATH)) {
        if let Some((_, trade_type)) = TRADE_TYPES.iter().find(|(k, _)| *k == kind) {
            return Some(Route::Prepay(trade_type));
        }
    }
    if (method, path) == ("GET", super::CERTIFICATES_PATH) {
        return Some(Route::Certificates);
    }
    let segment = |rest: &str| percent_decode(rest, false).filter(|s| !s.is_empty() && !s.contains('/'));
    if let Some(rest) = path.strip_prefix(TRADE) {
        return match (method, rest.strip_suffix("/close")) {
            ("POST", Some(no)) => segment(no).map(Route::Close),
            ("GET", None) => segment(rest).map(Route::Query),
            _ => None,
        };
    }
    match (method, path.strip_prefix(REFUNDS)) {
        ("POST", Some("")) => Some(Route::Refund),
        ("GET", Some(rest)) => segment(rest.strip_prefix('/')?).map(Route::RefundQuery),
        _ => None,
    }
}

impl Api for Wechatpay {
    type Checked = Checked;

    fn check(&self, request: &Request) -> (Call, Checked) {
        let route = route(&request.method, request.path());
        let body = if request.body.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&request.body).unwrap_or(Value::Null)
        };
        let authenticated = self.authenticate(request);
        let refusal = match &authenticated {
            Err(reason) => Some((401, "SIGN_ERROR", format!("签名错误: {reason}"))),
            // WeChat's API gateway wants both on every request.
            Ok(()) if request.header("Accept").is_none() || request.header("User-Agent").is_none() => {
                Some((400, "PARAM_ERROR", "HTTP 头缺少 Accept 或 User-Agent".to_owned()))
            }
            Ok(()) if request.method == "POST" && !is_json(request) => {
                Some((400, "PARAM_ERROR", "Content-Type 须为 application/json，包体须为 JSON".to_owned()))
            }
            Ok(()) => None,
        };
        let call = Call {
            http_method: request.method.clone(),
            api: request.target.clone(),
            body: body.clone(),
            params: Vec::new(),
            verified: authenticated.is_ok(),
            status: None,
            code: None,
        };
        (call, Checked { route, refusal, body })
    }

    fn answer(&self, request: &Request, checked: Checked, fault: Option<&Fault>) -> Answer {
        if fault == Some(&Fault::ServerError) {
            return self.error(500, "SYSTEM_ERROR", "系统错误", fault);
        }
        let Some(route) = checked.route else {
            return self.error(404, "NOT_FOUND", "请求的资源不存在", fault);
        };
        if let Some((status, code, message)) = &checked.refusal {
            return self.error(*status, code, message, fault);
        }
        let bad_number = match &route {
            Route::Query(no) | Route::Close(no) => !valid_out_trade_no(no),
            Route::RefundQuery(no) => !valid_out_refund_no(no),
            Route::Refund | Route::Prepay(_) | Route::Certificates => false,
        };
        if bad_number {
            return self.error(400, "PARAM_ERROR", "商户订单号或退款单号格式错误", fault);
        }
        match route {
            Route::Prepay(trade_type) => self.prepay(trade_type, &checked.body, fault),
            Route::Query(no) => self.query(&no, request, fault),
            Route::Close(no) => self.close(&no, &checked.body, fault),
            Route::Refund => self.refund(&checked.body, fault),
            Route::RefundQuery(no) => self.refund_query(&no, fault),
            Route::Certificates => self.certificates(fault),
        }
    }
}

/// A POST's body is JSON, declared as such.
fn is_json(request: &Request) -> bool {
    let declared =
        request.header("Content-Type").is_some_and(|t| t.to_ascii_lowercase().starts_with("application/json"));
    declared && serde_json::from_slice::<Value>(&request.body).is_ok_and(|v| v.is_object())
}
