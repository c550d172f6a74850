//! The merchant APIs against requests signed here, with this file's own few
//! lines of SHA256withRSA (the merchant's side), and answers verified with
//! the platform's public key the way a client must.

use super::*;
use crate::platform::form_encode;
use base64::Engine;
use payonce_testclient::{encode_request, Connection, RecvError, Response};
use rsa::pkcs1v15::{Signature, SigningKey, VerifyingKey};
use rsa::pkcs8::DecodePublicKey;
use rsa::signature::{SignatureEncoding, Signer, Verifier};
use serde_json::json;
use sha2::Sha256;
use std::sync::OnceLock;
use std::time::Instant;

pub(super) const MERCHANT_SERIAL: &str = "5157F09EFDC096DE15EBE81A47057A7232F1B8E1";
const SECOND: Duration = Duration::from_secs(1);

pub(super) struct TestKeys {
    /// The merchant's WeChat Pay API key (payonce's `--wechatpay-merchant-key`).
    merchant: RsaPrivateKey,
    /// The merchant's Alipay app key (`--alipay-app-private-key`).
    pub(super) app: RsaPrivateKey,
    pub(super) wechatpay_platform: RsaPrivateKey,
    pub(super) alipay_platform: RsaPrivateKey,
}

/// Made once per test run, side by side: unoptimised keygen is slow.
pub(super) fn keys() -> &'static TestKeys {
    static KEYS: OnceLock<TestKeys> = OnceLock::new();
    KEYS.get_or_init(|| {
        let make = || std::thread::spawn(|| key_or_throwaway(None).expect("an RSA key"));
        let handles = [make(), make(), make(), make()];
        let [merchant, app, wechatpay_platform, alipay_platform] = handles.map(|h| h.join().expect("keygen"));
        TestKeys { merchant, app, wechatpay_platform, alipay_platform }
    })
}

/// Not the merchant's: the fixture kept for "signed with the wrong key".
fn other_key() -> RsaPrivateKey {
    use rsa::pkcs8::DecodePrivateKey;
    let pem = include_str!("../../../tests/fixtures/TEST_ONLY_merchant_other_private.pem");
    RsaPrivateKey::from_pkcs8_pem(pem).expect("the fixture key")
}

fn wechatpay() -> PlatformApi {
    let keys = keys();
    let config = WechatpayApiConfig {
        platform_key: Some(keys.wechatpay_platform.clone()),
        ..WechatpayApiConfig::new(MERCHANT_SERIAL, keys.merchant.to_public_key())
    };
    PlatformApi::start_wechatpay(config).expect("WeChat Pay starts")
}

fn alipay() -> PlatformApi {
    let keys = keys();
    let config = AlipayApiConfig {
        alipay_key: Some(keys.alipay_platform.clone()),
        ..AlipayApiConfig::new(keys.app.to_public_key())
    };
    PlatformApi::start_alipay(config).expect("Alipay starts")
}

pub(super) fn connect(api: &PlatformApi) -> Connection {
    Connection::connect(api.addr(), SECOND, 5 * SECOND).expect("connect")
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn sign(key: &RsaPrivateKey, message: &[u8]) -> String {
    b64(&SigningKey::<Sha256>::new(key.clone()).sign(message).to_bytes())
}

fn verifies(key: &RsaPublicKey, message: &[u8], signature: &str) -> bool {
    let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(signature) else { return false };
    let Ok(signature) = Signature::try_from(bytes.as_slice()) else { return false };
    VerifyingKey::<Sha256>::new(key.clone()).verify(message, &signature).is_ok()
}

// ---- WeChat Pay: the merchant's side ----

/// How a test request is signed (what it gets wrong, if anything).
pub(super) struct WxSigner<'a> {
    pub(super) key: &'a RsaPrivateKey,
    pub(super) mchid: &'a str,
    pub(super) serial: &'a str,
    pub(super) timestamp: i64,
}

impl WxSigner<'_> {
    fn merchant() -> WxSigner<'static> {
        WxSigner { key: &keys().merchant, mchid: WECHATPAY_MCHID, serial: MERCHANT_SERIAL, timestamp: crate::now_s() }
    }

    pub(super) fn request(&self, api: &PlatformApi, method: &str, target: &str, body: &str) -> Vec<u8> {
        let nonce = crate::platform::random_text(32).expect("a nonce");
        let ts = self.timestamp;
        let signature = sign(self.key, format!("{method}\n{target}\n{ts}\n{nonce}\n{body}\n").as_bytes());
        let authorization = format!(
            "WECHATPAY2-SHA256-RSA2048 mchid=\"{}\",nonce_str=\"{nonce}\",signature=\"{signature}\",timestamp=\"{ts}\",serial_no=\"{}\"",
            self.mchid, self.serial
        );
        let mut headers = vec![
            ("Authorization", authorization.as_str()),
            ("Accept", "application/json"),
            ("User-Agent", "payonce-test"),
        ];
        if method == "POST" {
            headers.push(("Content-Type", "application/json"));
        }
        encode_request(method, &api.addr().to_string(), target, &headers, body.as_bytes())
    }
}

fn wx(api: &PlatformApi, conn: &mut Connection, method: &str, target: &str, body: &Value) -> Response {
    let body = if body.is_null() { String::new() } else { body.to_string() };
    let request = WxSigner::merchant().request(api, method, target, &body);
    conn.exchange(&request).expect("an answer")
}

/// The answer is signed by the platform key, as a client must check it.
pub(super) fn wx_verified(api: &PlatformApi, answer: &Response) -> bool {
    let header = |name: &str| answer.header(name).unwrap_or_default().to_owned();
    let (timestamp, nonce) = (header("Wechatpay-Timestamp"), header("Wechatpay-Nonce"));
    let mut message = format!("{timestamp}\n{nonce}\n").into_bytes();
    message.extend_from_slice(&answer.body);
    message.push(b'\n');
    let fresh = timestamp.parse::<i64>().is_ok_and(|t| (crate::now_s() - t).abs() <= 300);
    Some(header("Wechatpay-Serial").as_str()) == api.platform_serial()
        && fresh
        && verifies(api.platform_public_key(), &message, &header("Wechatpay-Signature"))
}

pub(super) fn json_of(answer: &Response) -> Value {
    serde_json::from_slice(&answer.body).unwrap_or(Value::Null)
}

fn query_target(no: &str) -> String {
    format!("/v3/pay/transactions/out-trade-no/{no}?mchid={WECHATPAY_MCHID}")
}

fn close_target(no: &str) -> String {
    format!("/v3/pay/transactions/out-trade-no/{no}/close")
}

const REFUNDS: &str = "/v3/refund/domestic/refunds";

fn refund_body(out_trade_no: &str, out_refund_no: &str, refund: i64, total: i64) -> Value {
    json!({
        "out_trade_no": out_trade_no, "out_refund_no": out_refund_no, "reason": "测试退款",
        "notify_url": "https://merchant.example/v1/callbacks/wechatpay/refund",
        "amount": {"refund": refund, "total": total, "currency": "CNY"},
    })
}

#[test]
fn wechatpay_refunds_are_idempotent_per_out_refund_no() {
    let api = wechatpay();
    api.open_trade("ORDER-W-0004", 1000).expect("open");
    api.open_trade("ORDER-W-0005", 1000).expect("open");
    let mut conn = connect(&api);
    let unpaid = wx(&api, &mut conn, "POST", REFUNDS, &refund_body("ORDER-W-0004", "REFUND-W-0040", 1000, 1000));
    assert_eq!((unpaid.status, json_of(&unpaid)["code"].as_str()), (400, Some("INVALID_REQUEST")));
    let unknown = wx(&api, &mut conn, "POST", REFUNDS, &refund_body("ORDER-W-NONE", "REFUND-W-0041", 1000, 1000));
    assert_eq!(unknown.status, 404);
    api.buyer_pays("ORDER-W-0004").expect("paid");
    api.buyer_pays("ORDER-W-0005").expect("paid");

    // The same refund, submitted from four connections at once and again:
    // one refund, one refund_id.
    let ids: Vec<String> = std::thread::scope(|scope| {
        let submit = || {
            scope.spawn(|| {
                let mut conn = connect(&api);
                let answer =
                    wx(&api, &mut conn, "POST", REFUNDS, &refund_body("ORDER-W-0004", "REFUND-W-0042", 600, 1000));
                assert_eq!(answer.status, 200, "{}", answer.text());
                json_of(&answer)["refund_id"].as_str().map(str::to_owned).unwrap_or_default()
            })
        };
        let handles = [submit(), submit(), submit(), submit()];
        handles.into_iter().map(|h| h.join().expect("submitted")).collect()
    });
    let again =
        json_of(&wx(&api, &mut conn, "POST", REFUNDS, &refund_body("ORDER-W-0004", "REFUND-W-0042", 600, 1000)));
    assert!(ids.iter().all(|id| *id == ids[0]) && again["refund_id"] == ids[0].as_str(), "{ids:?} {again}");
    let refunds = api.refunds();
    assert_eq!(refunds.len(), 1, "{refunds:?}");
    assert_eq!((refunds[0].amount, refunds[0].status), (600, RefundStatus::Processing));
    let submissions =
        api.calls().iter().filter(|c| c.api == REFUNDS && c.body["out_refund_no"] == "REFUND-W-0042").count();
    assert_eq!(submissions, 5);

    // The number is the refund's: another amount or trade under it is refused.
    for body in [
        refund_body("ORDER-W-0004", "REFUND-W-0042", 500, 1000),
        refund_body("ORDER-W-0005", "REFUND-W-0042", 600, 1000),
    ] {
        let answer = wx(&api, &mut conn, "POST", REFUNDS, &body);
        assert_eq!((answer.status, json_of(&answer)["code"].as_str()), (400, Some("INVALID_REQUEST")), "{body}");
    }
    // More than is left, or the wrong order total.
    let above = wx(&api, &mut conn, "POST", REFUNDS, &refund_body("ORDER-W-0004", "REFUND-W-0043", 401, 1000));
    assert_eq!((above.status, json_of(&above)["code"].as_str()), (400, Some("INVALID_REQUEST")));
    let total = wx(&api, &mut conn, "POST", REFUNDS, &refund_body("ORDER-W-0004", "REFUND-W-0044", 400, 999));
    assert_eq!(total.status, 400);
    let rest = wx(&api, &mut conn, "POST", REFUNDS, &refund_body("ORDER-W-0004", "REFUND-W-0045", 400, 1000));
    assert_eq!(rest.status, 200);
    // A closed refund gives its amount back.
    assert!(api.settle_refund("REFUND-W-0045", RefundStatus::Closed));
    let retry = wx(&api, &mut conn, "POST", REFUNDS, &refund_body("ORDER-W-0004", "REFUND-W-0046", 400, 1000));
    assert_eq!(retry.status, 200);
    assert_eq!(api.refunds().len(), 3);
}

/// One trade of 10.03 yuan refunded in parts, each refund its own
/// out_refund_no and amount: 3.00, 2.00 and 4.00 yuan, then 1.04 yuan when
/// 1.03 is left, refused as WeChat refuses a refund past what is left
/// (`INVALID_REQUEST`; its `NOT_ENOUGH` is the merchant's balance, not the
/// trade's), then the 1.03 yuan left. Each answer and query names its own
/// refund's amount and the trade's total.
#[test]
fn wechatpay_refunds_a_trade_in_parts_and_refuses_past_what_is_left() {
    let api = wechatpay();
    api.open_trade("ORDER-W-0090", 1_003).expect("open");
    let pay_no = api.buyer_pays("ORDER-W-0090").expect("paid");
    let mut conn = connect(&api);
    let mut submit = |no: &str, refund: i64| {
        let answer = wx(&api, &mut conn, "POST", REFUNDS, &refund_body("ORDER-W-0090", no, refund, 1_003));
        assert!(wx_verified(&api, &answer), "{}", answer.text());
        (answer.status, json_of(&answer))
    };
    for (no, refund) in [("REFUND-W-0091", 300), ("REFUND-W-0092", 200), ("REFUND-W-0093", 400)] {
        let (status, answer) = submit(no, refund);
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["out_refund_no"], no);
        assert_eq!(answer["transaction_id"].as_str(), Some(pay_no.as_str()));
        assert_eq!(
            (answer["amount"]["refund"].as_i64(), answer["amount"]["total"].as_i64()),
            (Some(refund), Some(1_003))
        );
    }
    let (status, over) = submit("REFUND-W-0094", 104);
    assert_eq!((status, over["code"].as_str()), (400, Some("INVALID_REQUEST")), "{over}");
    let (status, rest) = submit("REFUND-W-0095", 103);
    assert_eq!((status, rest["amount"]["refund"].as_i64()), (200, Some(103)), "{rest}");
    let (status, nothing_left) = submit("REFUND-W-0096", 1);
    assert_eq!((status, nothing_left["code"].as_str()), (400, Some("INVALID_REQUEST")), "{nothing_left}");
    let held: Vec<(String, i64)> = api.refunds().into_iter().map(|r| (r.out_refund_no, r.amount)).collect();
    let want = [("REFUND-W-0091", 300), ("REFUND-W-0092", 200), ("REFUND-W-0093", 400), ("REFUND-W-0095", 103)];
    assert_eq!(held, want.map(|(no, amount)| (no.to_owned(), amount)), "the refused ones are not held");

    // Settled in turn: each query still names its own refund; the trade's
    // refunded total grows to the whole amount.
    assert_eq!(api.refunded_total("ORDER-W-0090"), 0);
    for (no, refund, total_after) in [
        ("REFUND-W-0091", 300, 300),
        ("REFUND-W-0092", 200, 500),
        ("REFUND-W-0093", 400, 900),
        ("REFUND-W-0095", 103, 1_003),
    ] {
        assert!(api.settle_refund(no, RefundStatus::Success));
        let query = wx(&api, &mut conn, "GET", &format!("{REFUNDS}/{no}"), &Value::Null);
        let answer = json_of(&query);
        assert_eq!((answer["status"].as_str(), answer["amount"]["refund"].as_i64()), (Some("SUCCESS"), Some(refund)));
        assert_eq!(api.refunded_total("ORDER-W-0090"), total_after);
        let notice = api.refund_notice(no).expect("a settled refund's notice");
        assert_eq!(
            (notice.amount, notice.total, notice.refunded_total, notice.success),
            (refund, 1_003, total_after, true)
        );
        assert_eq!((notice.order_no.as_str(), notice.pay_no.as_str()), ("ORDER-W-0090", pay_no.as_str()));
    }
}

/// A refund of the trade WeChat numbered `transaction_id`, with no
/// out_trade_no (how a merchant returns one payment of several): the same
/// refund as one asked by out_trade_no, idempotent per out_refund_no
/// whichever number names the trade; exactly one of the two is taken, and
/// the transaction_id must be one of this merchant's paid trades.
#[test]
fn wechatpay_refunds_a_trade_named_by_its_transaction_id() {
    let api = wechatpay();
    api.open_trade("ORDER-W-0100", 1_003).expect("open");
    api.open_trade("ORDER-W-0101", 500).expect("open");
    let pay_no = api.buyer_pays("ORDER-W-0100").expect("paid");
    let mut conn = connect(&api);
    let by_id = |id: &str, no: &str, refund: i64, total: i64| {
        json!({
            "transaction_id": id, "out_refund_no": no, "reason": "退回多付的款项",
            "notify_url": "https://merchant.example/v1/callbacks/wechatpay/refund",
            "amount": {"refund": refund, "total": total, "currency": "CNY"},
        })
    };
    let mut submit = |body: &Value| {
        let answer = wx(&api, &mut conn, "POST", REFUNDS, body);
        assert!(wx_verified(&api, &answer), "{}", answer.text());
        (answer.status, json_of(&answer))
    };
    let (status, first) = submit(&by_id(&pay_no, "U-W-0100", 1_003, 1_003));
    assert_eq!(status, 200, "{first}");
    assert_eq!(
        (first["out_trade_no"].as_str(), first["transaction_id"].as_str(), first["out_refund_no"].as_str()),
        (Some("ORDER-W-0100"), Some(pay_no.as_str()), Some("U-W-0100"))
    );
    assert_eq!((first["status"].as_str(), first["amount"]["refund"].as_i64()), (Some("PROCESSING"), Some(1_003)));
    // Again by transaction_id, and by out_trade_no: the same refund.
    for body in [by_id(&pay_no, "U-W-0100", 1_003, 1_003), refund_body("ORDER-W-0100", "U-W-0100", 1_003, 1_003)] {
        let (status, again) = submit(&body);
        assert_eq!((status, &again["refund_id"]), (200, &first["refund_id"]), "{body}");
    }
    let held: Vec<(String, String, String, i64)> =
        api.refunds().into_iter().map(|r| (r.out_trade_no, r.pay_no, r.out_refund_no, r.amount)).collect();
    assert_eq!(held, [("ORDER-W-0100".to_owned(), pay_no.clone(), "U-W-0100".to_owned(), 1_003)]);

    // Refused: both numbers, neither, one not of this merchant's trades (or
    // of a trade not paid, which has none yet), the wrong total, a malformed
    // one, a fen past what is left.
    let mut both = by_id(&pay_no, "U-W-0102", 1, 1_003);
    both["out_trade_no"] = json!("ORDER-W-0100");
    let mut neither = by_id(&pay_no, "U-W-0103", 1, 1_003);
    neither.as_object_mut().expect("an object").remove("transaction_id");
    for (body, status, code) in [
        (both, 400, "PARAM_ERROR"),
        (neither, 400, "PARAM_ERROR"),
        (by_id("4200000000000000000000000001", "U-W-0104", 1, 1_003), 404, "RESOURCE_NOT_EXISTS"),
        (by_id(&pay_no, "U-W-0105", 1, 1_000), 400, "INVALID_REQUEST"),
        (by_id("4200-0000", "U-W-0106", 1, 1_003), 400, "PARAM_ERROR"),
        (by_id(&pay_no, "U-W-0107", 1, 1_003), 400, "INVALID_REQUEST"),
    ] {
        let (got, answer) = submit(&body);
        assert_eq!((got, answer["code"].as_str()), (status, Some(code)), "{body}: {answer}");
    }
    assert_eq!(api.refunds().len(), 1, "nothing refused is held");

    // Its query (by out_refund_no, as for any refund) and its notice name
    // the trade by both numbers.
    assert!(api.settle_refund("U-W-0100", RefundStatus::Success));
    let query = json_of(&wx(&api, &mut conn, "GET", &format!("{REFUNDS}/U-W-0100"), &Value::Null));
    assert_eq!((query["status"].as_str(), query["transaction_id"].as_str()), (Some("SUCCESS"), Some(pay_no.as_str())));
    assert_eq!(query["out_trade_no"], "ORDER-W-0100");
    let notice = api.refund_notice("U-W-0100").expect("a settled refund's notice");
    assert_eq!(
        (notice.order_no.as_str(), notice.pay_no.as_str(), notice.refund_no.as_str()),
        ("ORDER-W-0100", pay_no.as_str(), "U-W-0100")
    );
    assert_eq!((notice.amount, notice.total, notice.refunded_total, notice.success), (1_003, 1_003, 1_003, true));
    assert_eq!(api.trade_state("ORDER-W-0100"), Some("REFUND"));
    assert_eq!(api.trade_state("ORDER-W-0101"), Some("NOTPAY"), "the other trade untouched");
}

// ---- Alipay: the app's side ----

/// A signed gateway form: the common parameters, `biz_content`, and `sign`
/// over the sorted non-empty parameters but `sign`.
pub(super) fn ali_form(
    method: &str,
    biz: &Value,
    key: &RsaPrivateKey,
    change: impl FnOnce(&mut Vec<(String, String)>),
) -> String {
    let timestamp = crate::platform::china_time(crate::now_s()).plain();
    let mut params: Vec<(String, String)> = [
        ("app_id", SIM_ALIPAY_APP_ID),
        ("method", method),
        ("format", "JSON"),
        ("charset", "utf-8"),
        ("sign_type", "RSA2"),
        ("timestamp", timestamp.as_str()),
        ("version", "1.0"),
        ("biz_content", biz.to_string().as_str()),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
    .collect();
    change(&mut params);
    let mut sorted: Vec<&(String, String)> = params.iter().filter(|(k, v)| k != "sign" && !v.is_empty()).collect();
    sorted.sort();
    let content = sorted.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&");
    params.push(("sign".into(), sign(key, content.as_bytes())));
    params.iter().map(|(k, v)| format!("{k}={}", form_encode(v))).collect::<Vec<_>>().join("&")
}

pub(super) fn ali_post(api: &PlatformApi, conn: &mut Connection, form: &str) -> Response {
    let headers = [("Content-Type", "application/x-www-form-urlencoded; charset=utf-8")];
    conn.exchange(&encode_request("POST", &api.addr().to_string(), "/gateway.do", &headers, form.as_bytes()))
        .expect("an answer")
}

fn ali(api: &PlatformApi, conn: &mut Connection, method: &str, biz: Value) -> Value {
    let answer = ali_post(api, conn, &ali_form(method, &biz, &keys().app, |_| {}));
    assert_eq!(answer.status, 200, "{}", answer.text());
    ali_response(api, &answer, method).expect("a signed answer")
}

/// The `<method>_response` value, when `sign` verifies over its exact text
/// in the body with the Alipay public key, as a client must check it.
pub(super) fn ali_response(api: &PlatformApi, answer: &Response, method: &str) -> Result<Value, String> {
    let text = std::str::from_utf8(&answer.body).map_err(|e| e.to_string())?;
    let prefix = format!("{{\"{}_response\":", method.replace('.', "_"));
    let signed_end = text.rfind(",\"sign\":\"").ok_or("no sign")?;
    let signed =
        text.get(prefix.len()..signed_end).filter(|_| text.starts_with(&prefix)).ok_or("no _response first")?;
    let whole: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let sign = whole["sign"].as_str().ok_or("sign is not a string")?;
    if !verifies(api.platform_public_key(), signed.as_bytes(), sign) {
        return Err(format!("sign does not verify over {signed}"));
    }
    let response: Value = serde_json::from_str(signed).map_err(|e| e.to_string())?;
    // The signed text is the value the body carries, not something beside it.
    if whole[&prefix[2..prefix.len() - 2]] != response {
        return Err("the signed text is not the body's _response".into());
    }
    Ok(response)
}

/// One trade of 10.03 yuan refunded in parts, each its own out_request_no:
/// every refund answer's `refund_fee` is the trade's refunded total so far,
/// this refund included (a repeat moves no money and says the total as it
/// is); 1.04 yuan when 1.03 is left is refused with Alipay's
/// `ACQ.REFUND_AMT_NOT_EQUAL_TOTAL`; each query names its own request's
/// `refund_amount` and the trade's `total_amount`.
#[test]
fn alipay_refunds_a_trade_in_parts_with_the_running_refund_fee() {
    let api = alipay();
    api.open_trade("ORDER_A_0090", 1_003).expect("open");
    let trade_no = api.buyer_pays("ORDER_A_0090").expect("paid");
    let mut conn = connect(&api);
    let mut refund = |no: &str, yuan: &str| {
        let biz = json!({"out_trade_no": "ORDER_A_0090", "refund_amount": yuan, "out_request_no": no});
        ali(&api, &mut conn, "alipay.trade.refund", biz)
    };
    let answered = |answer: &Value| {
        let text = |name: &str| answer[name].as_str().unwrap_or("-").to_owned();
        (text("code"), text("fund_change"), text("refund_fee"))
    };
    let of = |code: &str, change: &str, fee: &str| (code.to_owned(), change.to_owned(), fee.to_owned());
    for (no, yuan, running) in
        [("REFUND_A_0091", "3.00", "3.00"), ("REFUND_A_0092", "2.00", "5.00"), ("REFUND_A_0093", "4.00", "9.00")]
    {
        let answer = refund(no, yuan);
        assert_eq!(answered(&answer), of("10000", "Y", running), "{answer}");
        assert_eq!(answer["trade_no"].as_str(), Some(trade_no.as_str()));
    }
    let again = refund("REFUND_A_0092", "2.00");
    assert_eq!(answered(&again), of("10000", "N", "9.00"), "{again}");
    let over = refund("REFUND_A_0094", "1.04");
    assert_eq!(
        (over["code"].as_str(), over["sub_code"].as_str()),
        (Some("40004"), Some("ACQ.REFUND_AMT_NOT_EQUAL_TOTAL"))
    );
    let rest = refund("REFUND_A_0095", "1.03");
    assert_eq!(answered(&rest), of("10000", "Y", "10.03"), "{rest}");
    let nothing_left = refund("REFUND_A_0096", "0.01");
    assert_eq!(nothing_left["sub_code"], "ACQ.REFUND_AMT_NOT_EQUAL_TOTAL");
    assert_eq!(api.refunds().len(), 4);

    let mut query = |no: &str| {
        let biz = json!({"out_trade_no": "ORDER_A_0090", "out_request_no": no});
        ali(&api, &mut conn, "alipay.trade.fastpay.refund.query", biz)
    };
    let numbers = [("REFUND_A_0091", "3.00", 300), ("REFUND_A_0092", "2.00", 500), ("REFUND_A_0093", "4.00", 900)];
    for (no, yuan, _) in numbers.iter().chain(&[("REFUND_A_0095", "1.03", 1_003)]) {
        let pending = query(no);
        assert_eq!((pending["refund_amount"].as_str(), pending["total_amount"].as_str()), (Some(*yuan), Some("10.03")));
        assert!(pending.get("refund_status").is_none(), "not settled yet: {pending}");
    }
    // Settled in turn: each notice's refund_fee is the total when it settled.
    for (no, yuan, total_after) in numbers.iter().chain(&[("REFUND_A_0095", "1.03", 1_003)]) {
        assert!(api.settle_refund(no, RefundStatus::Success));
        let settled = query(no);
        assert_eq!(
            (settled["refund_status"].as_str(), settled["refund_amount"].as_str()),
            (Some("REFUND_SUCCESS"), Some(*yuan))
        );
        let notice = api.refund_notice(no).expect("a settled refund's notice");
        assert_eq!(
            (notice.refunded_total, notice.total, notice.pay_no.as_str()),
            (*total_after, 1_003, trade_no.as_str())
        );
    }
    assert_eq!(api.refunded_total("ORDER_A_0090"), 1_003);
    assert_eq!(api.trade_state("ORDER_A_0090"), Some("TRADE_CLOSED"), "refunded in full");
}

/// A refund of the trade Alipay numbered `trade_no`, with no out_trade_no,
/// and its query by `trade_no` + `out_request_no`: the same refund as one
/// asked by out_trade_no (idempotent per out_request_no whichever number
/// names the trade). Both numbers given must be one trade's; a trade_no
/// Alipay never made is `ACQ.TRADE_NOT_EXIST`.
#[test]
fn alipay_refunds_and_queries_a_trade_named_by_its_trade_no() {
    let api = alipay();
    api.open_trade("ORDER_A_0100", 1_003).expect("open");
    api.open_trade("ORDER_A_0101", 500).expect("open");
    let trade_no = api.buyer_pays("ORDER_A_0100").expect("paid");
    let other_no = api.trade("ORDER_A_0101").and_then(|t| t.pay_no).expect("numbered when made");
    let mut conn = connect(&api);
    let mut call = |method: &str, biz: Value| ali(&api, &mut conn, method, biz);
    let refund = |no: &str| json!({"trade_no": trade_no, "refund_amount": "10.03", "out_request_no": no});
    let answer = call("alipay.trade.refund", refund("U_A_0100"));
    assert_eq!((answer["code"].as_str(), answer["fund_change"].as_str()), (Some("10000"), Some("Y")), "{answer}");
    assert_eq!(
        (answer["trade_no"].as_str(), answer["out_trade_no"].as_str(), answer["refund_fee"].as_str()),
        (Some(trade_no.as_str()), Some("ORDER_A_0100"), Some("10.03"))
    );
    let by_out_trade_no =
        json!({"out_trade_no": "ORDER_A_0100", "refund_amount": "10.03", "out_request_no": "U_A_0100"});
    let mut both = refund("U_A_0100");
    both["out_trade_no"] = json!("ORDER_A_0100");
    for biz in [refund("U_A_0100"), by_out_trade_no, both] {
        let again = call("alipay.trade.refund", biz.clone());
        assert_eq!((again["code"].as_str(), again["fund_change"].as_str()), (Some("10000"), Some("N")), "{biz}");
    }
    let held: Vec<(String, String, String, i64)> =
        api.refunds().into_iter().map(|r| (r.out_trade_no, r.pay_no, r.out_refund_no, r.amount)).collect();
    assert_eq!(held, [("ORDER_A_0100".to_owned(), trade_no.clone(), "U_A_0100".to_owned(), 1_003)]);

    let mut mismatched = refund("U_A_0102");
    mismatched["out_trade_no"] = json!("ORDER_A_0101");
    let mut neither = refund("U_A_0103");
    neither.as_object_mut().expect("an object").remove("trade_no");
    let unknown =
        json!({"trade_no": "2099010122001400000000000001", "refund_amount": "0.01", "out_request_no": "U_A_0104"});
    let unpaid = json!({"trade_no": other_no, "refund_amount": "0.01", "out_request_no": "U_A_0105"});
    for (biz, sub_code) in [
        (mismatched, "ACQ.INVALID_PARAMETER"),
        (neither, "ACQ.INVALID_PARAMETER"),
        (unknown, "ACQ.TRADE_NOT_EXIST"),
        (unpaid, "ACQ.TRADE_STATUS_ERROR"),
    ] {
        let refused = call("alipay.trade.refund", biz.clone());
        assert_eq!((refused["code"].as_str(), refused["sub_code"].as_str()), (Some("40004"), Some(sub_code)), "{biz}");
    }
    assert_eq!(api.refunds().len(), 1, "nothing refused is held");

    // The query by trade_no + out_request_no, before and after it settles.
    let query = json!({"trade_no": trade_no, "out_request_no": "U_A_0100"});
    let pending = call("alipay.trade.fastpay.refund.query", query.clone());
    assert_eq!(
        (pending["out_request_no"].as_str(), pending["refund_amount"].as_str(), pending["out_trade_no"].as_str()),
        (Some("U_A_0100"), Some("10.03"), Some("ORDER_A_0100"))
    );
    assert!(pending.get("refund_status").is_none(), "not settled yet: {pending}");
    assert!(api.settle_refund("U_A_0100", RefundStatus::Success));
    let settled = call("alipay.trade.fastpay.refund.query", query);
    assert_eq!(settled["refund_status"], "REFUND_SUCCESS", "{settled}");
    // Another trade's trade_no does not find this refund.
    let elsewhere =
        call("alipay.trade.fastpay.refund.query", json!({"trade_no": other_no, "out_request_no": "U_A_0100"}));
    assert!(elsewhere.get("refund_amount").is_none(), "{elsewhere}");
    // The trade itself is found by trade_no too.
    let trade = call("alipay.trade.query", json!({"trade_no": trade_no}));
    assert_eq!(
        (trade["out_trade_no"].as_str(), trade["trade_status"].as_str()),
        (Some("ORDER_A_0100"), Some("TRADE_CLOSED"))
    );
    let notice = api.refund_notice("U_A_0100").expect("a settled refund's notice");
    assert_eq!(
        (notice.order_no.as_str(), notice.pay_no.as_str(), notice.refund_no.as_str()),
        ("ORDER_A_0100", trade_no.as_str(), "U_A_0100")
    );
    assert_eq!((notice.amount, notice.total, notice.refunded_total, notice.success), (1_003, 1_003, 1_003, true));
}

#[test]
fn alipay_answers_sign_the_exact_response_text() {
    let api = alipay();
    api.open_trade("ORDER_A_0020", 12_345).expect("open");
    let mut conn = connect(&api);
    let answer = ali_post(
        &api,
        &mut conn,
        &ali_form("alipay.trade.query", &json!({"out_trade_no": "ORDER_A_0020"}), &keys().app, |_| {}),
    );
    let text = answer.text();
    let start = "{\"alipay_trade_query_response\":".len();
    let end = text.rfind(",\"sign\":\"").expect("sign");
    let signed = &text[start..end];
    let sign = json_of(&answer)["sign"].as_str().expect("sign").to_owned();
    assert!(verifies(api.platform_public_key(), signed.as_bytes(), &sign));
    assert!(signed.contains("\"total_amount\":\"123.45\""), "{signed}");
    // Nothing but the signed text verifies: not the text with a byte changed,
    // not the whole body.
    let changed = signed.replace("123.45", "123.46");
    assert!(!verifies(api.platform_public_key(), changed.as_bytes(), &sign));
    assert!(!verifies(api.platform_public_key(), text.as_bytes(), &sign));
    // Business refusals carry Chinese text, signed as the UTF-8 it is sent in.
    let refused = ali_post(
        &api,
        &mut conn,
        &ali_form("alipay.trade.close", &json!({"out_trade_no": "ORDER_A_NONE"}), &keys().app, |_| {}),
    );
    let response = ali_response(&api, &refused, "alipay.trade.close").expect("signed");
    assert_eq!(response["sub_msg"], "交易不存在");
    assert!(refused.text().contains("交易不存在"), "sent unescaped: {}", refused.text());
}

// ---- Faults ----

#[test]
fn refused_and_hanging_platforms_answer_nothing_and_do_nothing() {
    let api = wechatpay();
    api.open_trade("ORDER-W-0030", 100).expect("open");
    let close =
        || WxSigner::merchant().request(&api, "POST", &close_target("ORDER-W-0030"), r#"{"mchid":"1900000100"}"#);

    // A connection served before the fault: its next request is read, then dropped.
    let mut early = connect(&api);
    assert_eq!(wx(&api, &mut early, "GET", &query_target("ORDER-W-0030"), &Value::Null).status, 200);
    api.set_fault(Some(Fault::Refuse));
    assert!(matches!(early.exchange(&close()), Err(RecvError::Nothing(_))));
    // A new connection is closed before reading.
    let mut conn = connect(&api);
    assert!(matches!(conn.exchange(&close()), Err(RecvError::Nothing(_))));
    assert_eq!(api.calls().len(), 2, "only the requests that were read are recorded");
    assert_eq!(api.calls()[1].status, None);

    api.set_fault(Some(Fault::Hang));
    let mut conn = connect(&api);
    conn.set_read_timeout(Duration::from_millis(300)).expect("timeout");
    let started = Instant::now();
    assert_eq!(conn.exchange(&close()), Err(RecvError::Timeout));
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!((api.calls().len(), api.calls()[2].status), (3, None));
    assert!(api.calls()[2].verified);
    assert_eq!(api.trade_state("ORDER-W-0030"), Some("NOTPAY"), "neither fault acted on the close");

    // Healthy again: the close happens.
    api.set_fault(None);
    let mut conn = connect(&api);
    assert_eq!(conn.exchange(&close()).expect("an answer").status, 204);
    assert_eq!(api.trade_state("ORDER-W-0030"), Some("CLOSED"));
}

#[test]
fn a_fault_for_the_next_calls_only_then_healthy() {
    let api = alipay();
    api.open_trade("ORDER_A_0040", 100).expect("open");
    let mut conn = connect(&api);
    let close = ali_form("alipay.trade.close", &json!({"out_trade_no": "ORDER_A_0040"}), &keys().app, |_| {});
    api.fail_next(Fault::ServerError, 2);
    for _ in 0..2 {
        let answer = ali_post(&api, &mut conn, &close);
        assert_eq!(answer.status, 500);
        let response = ali_response(&api, &answer, "alipay.trade.close").expect("signed");
        assert_eq!(
            (response["code"].as_str(), response["sub_code"].as_str()),
            (Some("20000"), Some("isp.unknow-error"))
        );
        assert_eq!(api.trade_state("ORDER_A_0040"), Some("WAIT_BUYER_PAY"), "a 500 does nothing");
    }
    let answer = ali_post(&api, &mut conn, &close);
    assert_eq!(ali_response(&api, &answer, "alipay.trade.close").expect("signed")["code"], "10000");
    let statuses: Vec<Option<u16>> = api.calls().iter().map(|c| c.status).collect();
    assert_eq!(statuses, [Some(500), Some(500), Some(200)]);

    // One refused connection, then the retry's connection is served.
    api.fail_next(Fault::Refuse, 1);
    let query = ali_form("alipay.trade.query", &json!({"out_trade_no": "ORDER_A_0040"}), &keys().app, |_| {});
    let mut refused = connect(&api);
    assert!(ali_post_raw(&api, &mut refused, &query).is_err());
    let mut retry = connect(&api);
    assert_eq!(
        ali_response(&api, &ali_post(&api, &mut retry, &query), "alipay.trade.query").expect("signed")["trade_status"],
        "TRADE_CLOSED"
    );
}

fn ali_post_raw(api: &PlatformApi, conn: &mut Connection, form: &str) -> Result<Response, RecvError> {
    let headers = [("Content-Type", "application/x-www-form-urlencoded; charset=utf-8")];
    conn.exchange(&encode_request("POST", &api.addr().to_string(), "/gateway.do", &headers, form.as_bytes()))
}

#[test]
fn slow_answers_come_late_for_calls_that_took_effect() {
    let api = wechatpay();
    api.open_trade("ORDER-W-0050", 100).expect("open");
    api.set_fault(Some(Fault::Slow(Duration::from_millis(400))));
    let mut conn = connect(&api);
    conn.set_read_timeout(Duration::from_millis(100)).expect("timeout");
    let close = WxSigner::merchant().request(&api, "POST", &close_target("ORDER-W-0050"), r#"{"mchid":"1900000100"}"#);
    // The client gives up; the platform has closed the trade all the same.
    assert_eq!(conn.exchange(&close), Err(RecvError::Timeout));
    assert_eq!(api.trade_state("ORDER-W-0050"), Some("CLOSED"));
    // Waiting long enough, the answer arrives.
    conn.set_read_timeout(5 * SECOND).expect("timeout");
    let started = Instant::now();
    let late = conn.receive().expect("the late answer");
    assert_eq!(late.status, 204);
    assert!(started.elapsed() >= Duration::from_millis(200), "{:?}", started.elapsed());
    assert!(wx_verified(&api, &late));
}

#[test]
fn delayed_requests_are_acted_on_only_after_the_delay() {
    let api = wechatpay();
    api.open_trade("ORDER-W-0051", 100).expect("open");
    api.fail_next(Fault::Delay(Duration::from_millis(400)), 1);
    let mut conn = connect(&api);
    conn.set_read_timeout(Duration::from_millis(100)).expect("timeout");
    let close = WxSigner::merchant().request(&api, "POST", &close_target("ORDER-W-0051"), r#"{"mchid":"1900000100"}"#);
    // Unlike a slow answer, nothing has happened yet while it is held.
    assert_eq!(conn.exchange(&close), Err(RecvError::Timeout));
    assert_eq!(api.trade_state("ORDER-W-0051"), Some("NOTPAY"));
    assert!(api.calls().is_empty(), "recorded once answered");
    conn.set_read_timeout(5 * SECOND).expect("timeout");
    let answer = conn.receive().expect("the answer after the delay");
    assert_eq!(answer.status, 204);
    assert!(wx_verified(&api, &answer));
    assert_eq!(api.trade_state("ORDER-W-0051"), Some("CLOSED"));
    // Only the next request was held.
    let started = Instant::now();
    assert_eq!(wx(&api, &mut conn, "GET", &query_target("ORDER-W-0051"), &Value::Null).status, 200);
    assert!(started.elapsed() < Duration::from_millis(400), "{:?}", started.elapsed());
}

#[test]
fn tampered_answers_fail_verification() {
    let api = wechatpay();
    api.open_trade("ORDER-W-0060", 250).expect("open");
    api.open_trade("ORDER-W-0061", 250).expect("open");
    let mut conn = connect(&api);
    api.set_fault(Some(Fault::TamperAnswers));
    let answer = wx(&api, &mut conn, "GET", &query_target("ORDER-W-0060"), &Value::Null);
    assert_eq!(answer.status, 200);
    let body = json_of(&answer);
    assert!(body.is_object(), "still JSON: {}", answer.text());
    assert_ne!(body["amount"]["total"], 250, "an amount was changed");
    assert!(!wx_verified(&api, &answer));
    let closed = wx(&api, &mut conn, "POST", &close_target("ORDER-W-0061"), &json!({"mchid": WECHATPAY_MCHID}));
    assert_eq!(closed.status, 204);
    assert!(!wx_verified(&api, &closed), "a 204's signature is tampered with");
    assert_eq!(api.trade_state("ORDER-W-0061"), Some("CLOSED"), "the close took effect");

    let alipay = alipay();
    alipay.open_trade("ORDER_A_0060", 250).expect("open");
    alipay.set_fault(Some(Fault::TamperAnswers));
    let mut conn = connect(&alipay);
    let form = ali_form("alipay.trade.query", &json!({"out_trade_no": "ORDER_A_0060"}), &keys().app, |_| {});
    let answer = ali_post(&alipay, &mut conn, &form);
    let response = &json_of(&answer)["alipay_trade_query_response"];
    assert_eq!(response["receipt_amount"], "0.01", "the last amount was changed: {}", answer.text());
    assert!(ali_response(&alipay, &answer, "alipay.trade.query").is_err());
}

#[test]
fn answers_about_another_merchant_or_trade_are_correctly_signed() {
    let api = wechatpay();
    api.open_trade("ORDER-W-0070", 100).expect("open");
    api.buyer_pays("ORDER-W-0070").expect("paid");
    let mut conn = connect(&api);
    api.set_fault(Some(Fault::WrongMerchant));
    let answer = wx(&api, &mut conn, "GET", &query_target("ORDER-W-0070"), &Value::Null);
    assert!(wx_verified(&api, &answer));
    let body = json_of(&answer);
    assert!(body["mchid"] != WECHATPAY_MCHID && body["mchid"].is_string(), "{body}");
    assert_eq!(body["out_trade_no"], "ORDER-W-0070");
    api.set_fault(Some(Fault::WrongTrade));
    let answer = wx(&api, &mut conn, "GET", &query_target("ORDER-W-0070"), &Value::Null);
    assert!(wx_verified(&api, &answer));
    let body = json_of(&answer);
    assert_eq!(body["mchid"], WECHATPAY_MCHID);
    assert!(body["out_trade_no"] != "ORDER-W-0070" && body["out_trade_no"].is_string(), "{body}");
    let refund = wx(&api, &mut conn, "POST", REFUNDS, &refund_body("ORDER-W-0070", "REFUND-W-0070", 100, 100));
    assert!(wx_verified(&api, &refund));
    assert_ne!(json_of(&refund)["out_trade_no"], "ORDER-W-0070");

    let alipay = alipay();
    alipay.open_trade("ORDER_A_0070", 100).expect("open");
    alipay.set_fault(Some(Fault::WrongTrade));
    let mut conn = connect(&alipay);
    let answer = ali(&alipay, &mut conn, "alipay.trade.query", json!({"out_trade_no": "ORDER_A_0070"}));
    assert!(answer["out_trade_no"] != "ORDER_A_0070" && answer["out_trade_no"].is_string(), "{answer}");
}

#[test]
fn a_buyer_at_the_cashier_is_userpaying_at_wechat_and_waiting_at_alipay() {
    let (wechat, ali_api) = (wechatpay(), alipay());
    assert_eq!((wechat.platform(), ali_api.platform()), (Platform::Wechatpay, Platform::Alipay));
    wechat.open_trade("ORDER-W-0110", 100).expect("open");
    ali_api.open_trade("ORDER_A_0110", 100).expect("open");
    assert_eq!(wechat.buyer_paying("ORDER-W-0110"), Ok(()));
    assert_eq!(ali_api.buyer_paying("ORDER_A_0110"), Ok(()));
    let answer = wx(&wechat, &mut connect(&wechat), "GET", &query_target("ORDER-W-0110"), &Value::Null);
    assert_eq!(json_of(&answer)["trade_state"], "USERPAYING");
    let answer = ali(&ali_api, &mut connect(&ali_api), "alipay.trade.query", json!({"out_trade_no": "ORDER_A_0110"}));
    assert_eq!(answer["trade_status"], "WAIT_BUYER_PAY");
    let pay_no = wechat.buyer_pays("ORDER-W-0110").expect("paid");
    assert_eq!(wechat.buyer_pays("ORDER-W-0110"), Err(Refused::AlreadyPaid { pay_no }));
    assert_eq!(wechat.buyer_paying("ORDER-W-NONE"), Err(Refused::NoSuchTrade));
    assert!(wechat.finish_trade("ORDER-W-0110").is_err(), "WeChat has no TRADE_FINISHED");
}

// ---- Keys, HTTP, shutdown ----

#[test]
fn a_throwaway_platform_key_is_made_and_published() {
    let api = PlatformApi::start_wechatpay(WechatpayApiConfig::new(MERCHANT_SERIAL, keys().merchant.to_public_key()))
        .expect("starts");
    assert_eq!(api.platform_serial(), Some(SIM_WECHATPAY_SERIAL));
    assert_eq!(api.merchant_id(), WECHATPAY_MCHID);
    let pem = api.platform_public_key_pem().expect("pem");
    assert!(pem.starts_with("-----BEGIN PUBLIC KEY-----"), "{pem}");
    assert_eq!(&RsaPublicKey::from_public_key_pem(&pem).expect("parses"), api.platform_public_key());
    assert_ne!(api.platform_public_key(), &keys().wechatpay_platform.to_public_key());
    // The key it published is the one it signs with.
    api.open_trade("ORDER-W-0080", 1).expect("open");
    let answer = wx(&api, &mut connect(&api), "GET", &query_target("ORDER-W-0080"), &Value::Null);
    assert!(wx_verified(&api, &answer));
    let alipay = alipay();
    assert_eq!((alipay.platform_serial(), alipay.merchant_id()), (None, SIM_ALIPAY_APP_ID));
}

#[test]
fn connection_close_is_honoured_and_numbers_are_checked() {
    let api = wechatpay();
    api.open_trade("ORDER-W-0090", 1).expect("open");
    assert!(api.open_trade("ORDER-W-0090", 1).is_err(), "open already");
    assert!(api.open_trade("SHORT", 1).is_err(), "WeChat needs 6-32 characters");
    assert!(alipay().open_trade("ORDER-A-DASH", 1).is_err(), "Alipay takes [A-Za-z0-9_]");
    let mut conn = connect(&api);
    let mut request =
        String::from_utf8(WxSigner::merchant().request(&api, "GET", &query_target("ORDER-W-0090"), "")).expect("text");
    request = request.replacen("\r\n", "\r\nConnection: close\r\n", 1);
    let answer = conn.exchange(request.as_bytes()).expect("an answer");
    assert!(answer.close && answer.status == 200, "{answer:?}");
    assert!(matches!(conn.exchange(request.as_bytes()), Err(RecvError::Nothing(_))), "closed after the answer");
    // A number WeChat cannot carry is refused before any lookup; one it can
    // carry percent-encoded is found.
    api.open_trade("ORDER|W*0091", 1).expect("open");
    let mut conn = connect(&api);
    let found = wx(&api, &mut conn, "GET", &query_target("ORDER%7CW*0091"), &Value::Null);
    assert_eq!((found.status, json_of(&found)["out_trade_no"].as_str()), (200, Some("ORDER|W*0091")));
    let bad = wx(&api, &mut conn, "GET", &query_target("ORDER.W.0091"), &Value::Null);
    assert_eq!((bad.status, json_of(&bad)["code"].as_str()), (400, Some("PARAM_ERROR")));
    let nowhere = wx(&api, &mut conn, "GET", "/v3/pay/transactions/id/4200?mchid=1900000100", &Value::Null);
    assert_eq!(nowhere.status, 404);
}

#[test]
fn dropping_the_server_ends_its_connections() {
    let api = alipay();
    let addr = api.addr();
    api.set_fault(Some(Fault::Hang));
    let mut conn = connect(&api);
    let form = ali_form("alipay.trade.query", &json!({"out_trade_no": "ORDER_A_0100"}), &keys().app, |_| {});
    conn.send(&encode_request("POST", "h", "/gateway.do", &[], form.as_bytes())).expect("sent");
    while api.calls().is_empty() {
        std::thread::sleep(Duration::from_millis(5));
    }
    let started = Instant::now();
    drop(api);
    assert!(started.elapsed() < 2 * SECOND, "{:?}", started.elapsed());
    assert!(matches!(conn.receive(), Err(RecvError::Nothing(_))));
    assert!(std::net::TcpStream::connect_timeout(&addr, SECOND).is_err(), "no longer listening");
}

// ---- Pieces ----

#[test]
fn yuan_strings_become_fen_exactly() {
    for (text, fen) in
        [("10.00", Some(1000)), ("0.01", Some(1)), ("7", Some(700)), ("0.5", Some(50)), ("123.45", Some(12_345))]
    {
        assert_eq!(yuan_to_fen(text), fen, "{text}");
    }
    for text in ["", ".5", "1.", "1.234", "-1.00", "1,00", "1e3", " 1.00"] {
        assert_eq!(yuan_to_fen(text), None, "{text:?}");
    }
}

#[test]
fn tampering_keeps_the_text_well_formed() {
    let mut text = br#"{"total":250,"currency":"CNY"}"#.to_vec();
    tamper(&mut text);
    assert_eq!(text, br#"{"total":251,"currency":"CNY"}"#);
    let mut letters = br#"{"a":"CNY"}"#.to_vec();
    tamper(&mut letters);
    assert_eq!(letters, br#"{"a":"CNy"}"#);
    assert_eq!(other_trade_no("ORDER-1"), "ORDER-0");
    assert_eq!(other_trade_no("ORDER-0"), "ORDER-1");
}

// ---- The suite's round trip at the wire (suite.rs) ----

/// One answer as the merchant receives it: its status, its JSON (Alipay's:
/// the signed `<method>_response`), whether it verifies with the platform
/// key the way a client must check it, and whether its body was empty.
pub(super) struct Wired {
    pub status: u16,
    pub json: Value,
    pub verified: bool,
    pub empty: bool,
}

/// One platform's merchant API at the wire, each request signed here with
/// this file's own lines, not payonce's: the suite's `wire_round_trip`
/// drives the requests and makes the shared checks; the `expect_*` hooks
/// check what only this platform answers.
pub(super) trait Wire {
    fn query(&mut self, no: &str) -> Wired;
    fn close(&mut self, no: &str) -> Wired;
    fn refund(&mut self, no: &str, refund_no: &str, amount: i64) -> Wired;
    fn refund_query(&mut self, no: &str, refund_no: &str) -> Wired;
    /// The trade's state word, its pay_no, and its amount in fen.
    fn state_of(&self, answer: &Wired) -> Option<String>;
    fn pay_no_of(&self, answer: &Wired) -> Option<String>;
    fn amount_of(&self, answer: &Wired) -> Option<i64>;
    fn expect_unpaid(&self, answer: &Wired);
    fn expect_paid(&self, answer: &Wired, amount: i64);
    /// A close of a paid trade is refused.
    fn expect_close_refused(&self, answer: &Wired);
    /// A refund accepted; `first`: not a retry of the same refund.
    fn expect_refund_accepted(&mut self, answer: &Wired, pay_no: &str, amount: i64, first: bool);
    fn expect_refund_pending(&self, answer: &Wired, amount: i64);
    fn expect_refund_settled(&self, answer: &Wired);
    /// After the refund of the whole amount settled.
    fn expect_refunded(&mut self, no: &str, refund_no: &str);
    fn expect_closed(&self, answer: &Wired, no: &str);
    fn expect_closed_again(&self, answer: &Wired);
    fn expect_unknown_query(&self, answer: &Wired);
    fn expect_unknown_close(&self, answer: &Wired);
    /// What only this platform has.
    fn only_here(&mut self);
    /// How many requests were sent.
    fn sent(&self) -> usize;
    /// The platform's record of the round trip's calls.
    fn expect_calls(&self, calls: &[Call], no: &str, refund_no: &str);
    /// A query of `no` signed the way the merchant does not sign, one per
    /// way (another key, merchant or app, serial, time, ...), with the code
    /// the platform's refusal of it carries.
    fn missigned(&mut self, no: &str) -> Vec<Missigned>;
    /// One of those refusals: says `code`.
    fn expect_missigned(&self, case: &str, answer: &Wired, code: &str);
    /// A request about `no`, well signed, then changed after signing.
    fn changed_after_signing(&mut self, no: &str) -> Wired;
    fn expect_changed_after_signing(&self, answer: &Wired);
    /// What only this platform refuses, then one request of `no` it
    /// verifies, sent last.
    fn signing_only_here(&mut self, no: &str);
}

/// A request the merchant did not sign so, and its answer.
pub(super) struct Missigned {
    pub case: &'static str,
    pub answer: Wired,
    /// What the platform's refusal says (WeChat Pay's `code`, Alipay's `sub_code`).
    pub code: &'static str,
}

/// The suite's WeChat Pay at the wire, signed with `key` under `serial`.
pub(super) struct WxWire<'a> {
    pub api: &'a PlatformApi,
    pub key: RsaPrivateKey,
    pub serial: &'static str,
    pub conn: Connection,
    pub refund_id: Option<String>,
    pub sent: usize,
}

impl WxWire<'_> {
    fn send(&mut self, method: &str, target: &str, body: &Value) -> Wired {
        let body = if body.is_null() { String::new() } else { body.to_string() };
        let request = self.signer().request(self.api, method, target, &body);
        self.exchange(&request)
    }

    /// How this merchant signs, now.
    fn signer(&self) -> WxSigner<'_> {
        WxSigner { key: &self.key, mchid: WECHATPAY_MCHID, serial: self.serial, timestamp: crate::now_s() }
    }

    fn exchange(&mut self, request: &[u8]) -> Wired {
        self.sent += 1;
        let answer = self.conn.exchange(request).expect("an answer");
        Wired {
            status: answer.status,
            json: json_of(&answer),
            verified: wx_verified(self.api, &answer),
            empty: answer.body.is_empty(),
        }
    }
}

fn code_of(answer: &Wired) -> (u16, Option<&str>) {
    (answer.status, answer.json["code"].as_str())
}

impl Wire for WxWire<'_> {
    fn query(&mut self, no: &str) -> Wired {
        self.send("GET", &query_target(no), &Value::Null)
    }

    fn close(&mut self, no: &str) -> Wired {
        self.send("POST", &close_target(no), &json!({"mchid": WECHATPAY_MCHID}))
    }

    fn refund(&mut self, no: &str, refund_no: &str, amount: i64) -> Wired {
        self.send("POST", REFUNDS, &refund_body(no, refund_no, amount, amount))
    }

    fn refund_query(&mut self, _no: &str, refund_no: &str) -> Wired {
        self.send("GET", &format!("{REFUNDS}/{refund_no}"), &Value::Null)
    }

    fn state_of(&self, answer: &Wired) -> Option<String> {
        answer.json["trade_state"].as_str().map(str::to_owned)
    }

    fn pay_no_of(&self, answer: &Wired) -> Option<String> {
        answer.json["transaction_id"].as_str().map(str::to_owned)
    }

    fn amount_of(&self, answer: &Wired) -> Option<i64> {
        answer.json["amount"]["total"].as_i64()
    }

    fn expect_unpaid(&self, answer: &Wired) {
        let body = &answer.json;
        assert_eq!((answer.status, body["mchid"].as_str()), (200, Some(WECHATPAY_MCHID)), "{body}");
        assert!(body.get("transaction_id").is_none() && body.get("success_time").is_none(), "{body}");
    }

    fn expect_paid(&self, answer: &Wired, amount: i64) {
        let paid = &answer.json;
        assert_eq!(paid["trade_type"], "NATIVE");
        assert_eq!(paid["amount"]["payer_total"], amount);
        assert!(paid["success_time"].as_str().is_some_and(|t| t.ends_with("+08:00")), "{paid}");
    }

    fn expect_close_refused(&self, answer: &Wired) {
        assert_eq!(code_of(answer), (400, Some("ORDERPAID")));
    }

    fn expect_refund_accepted(&mut self, answer: &Wired, pay_no: &str, amount: i64, first: bool) {
        let refund = &answer.json;
        assert_eq!(answer.status, 200, "{refund}");
        assert_eq!((refund["status"].as_str(), refund["channel"].as_str()), (Some("PROCESSING"), Some("ORIGINAL")));
        assert_eq!(refund["transaction_id"].as_str(), Some(pay_no));
        assert_eq!(refund["amount"]["refund"], amount);
        let refund_id = refund["refund_id"].as_str().expect("refund_id").to_owned();
        if first {
            self.refund_id = Some(refund_id);
        } else {
            assert_eq!(self.refund_id.as_ref(), Some(&refund_id), "the retry is the same refund");
        }
    }

    fn expect_refund_pending(&self, answer: &Wired, _amount: i64) {
        assert_eq!((answer.status, answer.json["status"].as_str()), (200, Some("PROCESSING")));
    }

    fn expect_refund_settled(&self, answer: &Wired) {
        let settled = &answer.json;
        assert_eq!(
            (settled["status"].as_str(), settled["refund_id"].as_str()),
            (Some("SUCCESS"), self.refund_id.as_deref())
        );
        assert!(settled["success_time"].is_string());
    }

    fn expect_refunded(&mut self, no: &str, refund_no: &str) {
        assert_eq!(self.api.trade_state(no), Some("REFUND"));
        for status in [RefundStatus::Closed, RefundStatus::Abnormal] {
            assert!(self.api.settle_refund(refund_no, status));
            let answer = self.refund_query(no, refund_no);
            assert_eq!(answer.json["status"].as_str(), Some(status.wechatpay()));
        }
    }

    fn expect_closed(&self, answer: &Wired, _no: &str) {
        assert_eq!((answer.status, answer.empty), (204, true), "a 204, signed too");
    }

    fn expect_closed_again(&self, answer: &Wired) {
        assert_eq!(code_of(answer), (400, Some("ORDER_CLOSED")));
    }

    fn expect_unknown_query(&self, answer: &Wired) {
        assert_eq!(code_of(answer), (404, Some("ORDER_NOT_EXIST")));
    }

    fn expect_unknown_close(&self, answer: &Wired) {
        assert_eq!(answer.status, 204);
    }

    /// An unknown refund number, as WeChat answers it.
    fn only_here(&mut self) {
        let refund_unknown = self.refund_query("ORDER-W-NONE", "REFUND-NONE");
        assert!(refund_unknown.verified);
        assert_eq!(code_of(&refund_unknown), (404, Some("RESOURCE_NOT_EXISTS")));
    }

    fn sent(&self) -> usize {
        self.sent
    }

    fn expect_calls(&self, calls: &[Call], no: &str, refund_no: &str) {
        assert_eq!(calls[0].api, query_target(no));
        assert_eq!((calls[2].status, calls[2].code.as_deref()), (Some(400), Some("ORDERPAID")));
        assert_eq!(calls[3].body["out_refund_no"], refund_no);
    }

    fn missigned(&mut self, no: &str) -> Vec<Missigned> {
        let (target, other, now) = (query_target(no), other_key(), crate::now_s());
        let cases = [
            ("another key", WxSigner { key: &other, ..self.signer() }),
            ("another mchid", WxSigner { mchid: "1900000999", ..self.signer() }),
            ("another serial", WxSigner { serial: "NOT-THE-MERCHANT-SERIAL", ..self.signer() }),
            ("6 minutes old", WxSigner { timestamp: now - 360, ..self.signer() }),
            ("6 minutes ahead", WxSigner { timestamp: now + 360, ..self.signer() }),
        ];
        let requests: Vec<(&'static str, Vec<u8>)> =
            cases.iter().map(|(case, signer)| (*case, signer.request(self.api, "GET", &target, ""))).collect();
        requests
            .into_iter()
            .map(|(case, request)| Missigned { case, answer: self.exchange(&request), code: "SIGN_ERROR" })
            .collect()
    }

    fn expect_missigned(&self, case: &str, answer: &Wired, code: &str) {
        assert_eq!(code_of(answer), (401, Some(code)), "{case}");
    }

    /// A close whose body changed after signing: the signature covers the body.
    fn changed_after_signing(&mut self, no: &str) -> Wired {
        let mut request = self.signer().request(self.api, "POST", &close_target(no), r#"{"mchid":"1900000100"}"#);
        let at = request.len() - 3;
        request[at] = b'1';
        self.exchange(&request)
    }

    fn expect_changed_after_signing(&self, answer: &Wired) {
        assert_eq!(answer.status, 401);
    }

    /// The query string is signed too; an unsigned request is refused; one
    /// well signed but without the headers WeChat's gateway requires is a
    /// PARAM_ERROR (verified, the last).
    fn signing_only_here(&mut self, no: &str) {
        let target = query_target(no);
        // Another query string is another request.
        let request = self.signer().request(self.api, "GET", &target, "");
        let text = String::from_utf8(request).expect("text").replacen(&target, &format!("{target}&x=1"), 1);
        assert_eq!(self.exchange(text.as_bytes()).status, 401);
        let unsigned = encode_request("GET", "h", &target, &[("Accept", "*/*"), ("User-Agent", "t")], b"");
        assert_eq!(self.exchange(&unsigned).status, 401);
        // Well signed, but without the headers WeChat's gateway requires.
        let mut bare = String::from_utf8(self.signer().request(self.api, "GET", &target, "")).expect("text");
        bare = bare.replace("User-Agent: payonce-test\r\n", "");
        let answer = self.exchange(bare.as_bytes());
        assert_eq!(code_of(&answer), (400, Some("PARAM_ERROR")));
    }
}

/// The suite's Alipay at the wire, its forms signed with `key`.
pub(super) struct AliWire<'a> {
    pub api: &'a PlatformApi,
    pub key: RsaPrivateKey,
    pub conn: Connection,
    pub sent: usize,
}

impl AliWire<'_> {
    fn send(&mut self, method: &str, biz: &Value) -> Wired {
        let form = ali_form(method, biz, &self.key, |_| {});
        self.post(method, &form)
    }

    /// A form of `method` posted to the gateway.
    fn post(&mut self, method: &str, form: &str) -> Wired {
        self.sent += 1;
        let answer = ali_post(self.api, &mut self.conn, form);
        let response = ali_response(self.api, &answer, method);
        Wired {
            status: answer.status,
            verified: response.is_ok(),
            json: response.unwrap_or(Value::Null),
            empty: answer.body.is_empty(),
        }
    }
}

fn codes_of(answer: &Wired) -> (Option<&str>, Option<&str>) {
    (answer.json["code"].as_str(), answer.json["sub_code"].as_str())
}

impl Wire for AliWire<'_> {
    fn query(&mut self, no: &str) -> Wired {
        self.send("alipay.trade.query", &json!({"out_trade_no": no}))
    }

    fn close(&mut self, no: &str) -> Wired {
        self.send("alipay.trade.close", &json!({"out_trade_no": no}))
    }

    fn refund(&mut self, no: &str, refund_no: &str, amount: i64) -> Wired {
        let yuan = format!("{}.{:02}", amount / 100, amount % 100);
        self.send(
            "alipay.trade.refund",
            &json!({"out_trade_no": no, "refund_amount": yuan, "out_request_no": refund_no}),
        )
    }

    fn refund_query(&mut self, no: &str, refund_no: &str) -> Wired {
        self.send("alipay.trade.fastpay.refund.query", &json!({"out_trade_no": no, "out_request_no": refund_no}))
    }

    fn state_of(&self, answer: &Wired) -> Option<String> {
        answer.json["trade_status"].as_str().map(str::to_owned)
    }

    fn pay_no_of(&self, answer: &Wired) -> Option<String> {
        answer.json["trade_no"].as_str().map(str::to_owned)
    }

    fn amount_of(&self, answer: &Wired) -> Option<i64> {
        answer.json["total_amount"].as_str().and_then(yuan_to_fen)
    }

    fn expect_unpaid(&self, answer: &Wired) {
        let waiting = &answer.json;
        assert_eq!(
            (answer.status, waiting["code"].as_str(), waiting["msg"].as_str()),
            (200, Some("10000"), Some("Success"))
        );
        assert_eq!(waiting["total_amount"].as_str(), Some("10.00"), "in yuan, as Alipay writes it");
    }

    fn expect_paid(&self, answer: &Wired, _amount: i64) {
        assert_eq!(answer.json["buyer_pay_amount"].as_str(), Some("10.00"));
    }

    fn expect_close_refused(&self, answer: &Wired) {
        assert_eq!(codes_of(answer), (Some("40004"), Some("ACQ.TRADE_STATUS_ERROR")));
    }

    fn expect_refund_accepted(&mut self, answer: &Wired, pay_no: &str, _amount: i64, first: bool) {
        let refund = &answer.json;
        assert_eq!(answer.status, 200, "{refund}");
        // A retry of the same request is the same refund; Alipay says no money moved this time.
        let fund_change = if first { "Y" } else { "N" };
        assert_eq!((refund["code"].as_str(), refund["fund_change"].as_str()), (Some("10000"), Some(fund_change)));
        if first {
            assert_eq!((refund["refund_fee"].as_str(), refund["trade_no"].as_str()), (Some("10.00"), Some(pay_no)));
        }
    }

    fn expect_refund_pending(&self, answer: &Wired, _amount: i64) {
        let pending = &answer.json;
        assert_eq!((pending["code"].as_str(), pending["refund_amount"].as_str()), (Some("10000"), Some("10.00")));
        assert!(pending.get("refund_status").is_none(), "not settled: no refund_status: {pending}");
    }

    fn expect_refund_settled(&self, answer: &Wired) {
        assert_eq!(answer.json["refund_status"], "REFUND_SUCCESS");
    }

    /// Refunded in full, the trade is closed at Alipay.
    fn expect_refunded(&mut self, no: &str, _refund_no: &str) {
        let answer = self.query(no);
        assert_eq!(self.state_of(&answer).as_deref(), Some("TRADE_CLOSED"));
    }

    fn expect_closed(&self, answer: &Wired, no: &str) {
        let closed = &answer.json;
        assert_eq!(
            (answer.status, closed["code"].as_str(), closed["out_trade_no"].as_str()),
            (200, Some("10000"), Some(no))
        );
    }

    fn expect_closed_again(&self, answer: &Wired) {
        assert_eq!(codes_of(answer), (Some("40004"), Some("ACQ.TRADE_STATUS_ERROR")));
    }

    fn expect_unknown_query(&self, answer: &Wired) {
        assert_eq!(codes_of(answer), (Some("40004"), Some("ACQ.TRADE_NOT_EXIST")));
    }

    fn expect_unknown_close(&self, answer: &Wired) {
        assert_eq!(codes_of(answer), (Some("40004"), Some("ACQ.TRADE_NOT_EXIST")));
    }

    /// The gateway's one endpoint; a finished trade is paid and refuses
    /// refunds; a refund of an unknown trade is ACQ.TRADE_NOT_EXIST.
    fn only_here(&mut self) {
        assert!(self.api.endpoint().ends_with("/gateway.do"));
        self.api.open_trade("ORDER_A_0003", 500).expect("open");
        self.api.buyer_pays("ORDER_A_0003").expect("paid");
        self.api.finish_trade("ORDER_A_0003").expect("finished");
        assert_eq!(self.api.trade_state("ORDER_A_0003"), Some("TRADE_FINISHED"));
        let late = self.refund("ORDER_A_0003", "REFUND_A_0003", 500);
        assert!(late.verified && late.status == 200);
        assert_eq!(late.json["sub_code"], "ACQ.TRADE_HAS_FINISHED");
        let unknown = self.refund("ORDER_A_NONE", "REFUND_A_NONE", 100);
        assert!(unknown.verified && unknown.status == 200);
        assert_eq!(codes_of(&unknown), (Some("40004"), Some("ACQ.TRADE_NOT_EXIST")));
    }

    fn sent(&self) -> usize {
        self.sent
    }

    fn expect_calls(&self, calls: &[Call], no: &str, _refund_no: &str) {
        assert!(calls.iter().all(|c| c.http_method == "POST" && c.status == Some(200)), "{calls:?}");
        assert_eq!(calls[0].api, "alipay.trade.query");
        assert_eq!(calls[0].body["out_trade_no"], no);
        assert_eq!(calls[2].code.as_deref(), Some("ACQ.TRADE_STATUS_ERROR"));
        assert_eq!(calls[3].code.as_deref(), Some("10000"));
    }

    fn missigned(&mut self, no: &str) -> Vec<Missigned> {
        let biz = json!({"out_trade_no": no});
        let utc = crate::platform::china_time(crate::now_s() - 8 * 3600).plain();
        type Change = Box<dyn FnOnce(&mut Vec<(String, String)>)>;
        let set = |name: &'static str, value: String| -> Change {
            Box::new(move |params| params.iter_mut().filter(|(k, _)| k == name).for_each(|(_, v)| *v = value.clone()))
        };
        let other = other_key();
        let cases: [(&str, &RsaPrivateKey, Change, &str); 5] = [
            ("another key", &other, Box::new(|_| {}), "isv.invalid-signature"),
            ("another app", &self.key, set("app_id", "2021000000000999".into()), "isv.invalid-app-id"),
            ("UTC, not Beijing time", &self.key, set("timestamp", utc), "isv.invalid-timestamp"),
            ("RSA, not RSA2", &self.key, set("sign_type", "RSA".into()), "isv.invalid-signature-type"),
            ("no version", &self.key, set("version", String::new()), "isv.missing-version"),
        ];
        let forms: Vec<(&'static str, String, &'static str)> = cases
            .into_iter()
            .map(|(case, key, change, code)| (case, ali_form("alipay.trade.query", &biz, key, change), code))
            .collect();
        forms
            .into_iter()
            .map(|(case, form, code)| Missigned { case, answer: self.post("alipay.trade.query", &form), code })
            .collect()
    }

    fn expect_missigned(&self, case: &str, answer: &Wired, code: &str) {
        let response = &answer.json;
        assert_eq!(response["sub_code"].as_str(), Some(code), "{case}: {response}");
        assert!(response["code"] == "40002" || response["code"] == "40001", "{case}: {response}");
    }

    /// A query whose out_trade_no changed after signing.
    fn changed_after_signing(&mut self, no: &str) -> Wired {
        let form = ali_form("alipay.trade.query", &json!({"out_trade_no": no}), &self.key, |_| {});
        self.post("alipay.trade.query", &form.replace(no, &format!("{no}1")))
    }

    fn expect_changed_after_signing(&self, answer: &Wired) {
        assert_eq!(answer.json["sub_code"], "isv.invalid-signature");
    }

    /// An unknown method is the gateway's error_response; the common
    /// parameters in the query string and biz_content in the body, as
    /// Alipay's SDKs send them, verify over all of them together (the last).
    fn signing_only_here(&mut self, no: &str) {
        let biz = json!({"out_trade_no": no});
        self.sent += 1;
        let answer = ali_post(self.api, &mut self.conn, &ali_form("alipay.trade.pay.nothing", &biz, &self.key, |_| {}));
        assert!(answer.text().starts_with("{\"error_response\":"), "{}", answer.text());
        assert_eq!(ali_response(self.api, &answer, "error").expect("signed")["sub_code"], "isv.invalid-method");

        let form = ali_form("alipay.trade.query", &biz, &self.key, |_| {});
        let (common, body): (Vec<&str>, Vec<&str>) = form.split('&').partition(|p| !p.starts_with("biz_content="));
        let target = format!("/gateway.do?{}", common.join("&"));
        let headers = [("Content-Type", "application/x-www-form-urlencoded; charset=utf-8")];
        let request = encode_request("POST", "h", &target, &headers, body.join("&").as_bytes());
        self.sent += 1;
        let answer = self.conn.exchange(&request).expect("an answer");
        assert_eq!(ali_response(self.api, &answer, "alipay.trade.query").expect("signed")["code"], "10000");
    }
}
