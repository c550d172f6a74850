//! Real payment platforms (docs/channels.md): WeChat Pay v3 and Alipay
//! notifications, built and signed here the way the platforms document
//! them, with the TEST-ONLY keys of `tests/fixtures`. Most cases run in process on `:memory:` with a manual
//! clock; one end-to-end test per platform runs the real binary with its
//! command-line flags.
//!
//! Every refusal is checked the same way: the platform's own failure answer
//! (WeChat: 4xx `{"code":"FAIL","message":..}`; Alipay: 4xx text `failure`)
//! and *nothing recorded* — the ledgers are byte-for-byte what they were and
//! the order is still PENDING — and then the genuine notification still
//! applies, so each refusal was for the reason under test.

use crate::util::{self, Server};
use aes_gcm::aead::{Aead, Payload};
use aes_gcm::{Aes256Gcm, KeyInit, Nonce};
use base64::Engine;
use payonce::api::{self, Request, Response};
use payonce::platforms::alipay::{self, Alipay, AlipayConfig};
use payonce::platforms::generic::Generic;
use payonce::platforms::wechatpay::{self, Wechatpay, WechatpayConfig};
use payonce::platforms::{Platform, Platforms};
use payonce::recon::yuan_to_fen;
use payonce::{App, Clock, Config, Rewards};
use rsa::pkcs1v15::SigningKey;
use rsa::pkcs8::DecodePrivateKey;
use rsa::signature::{SignatureEncoding, Signer};
use serde_json::{json, Value};
use sha2::Sha256;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

// ---------------------------------------------------------------- fixtures

const WX_A_PUBLIC: &str = include_str!("../fixtures/TEST_ONLY_wechatpay_platform_a_public.pem");
const WX_A_PRIVATE: &str = include_str!("../fixtures/TEST_ONLY_wechatpay_platform_a_private.pem");
const WX_B_CERT: &str = include_str!("../fixtures/TEST_ONLY_wechatpay_platform_b_cert.pem");
const WX_B_PRIVATE: &str = include_str!("../fixtures/TEST_ONLY_wechatpay_platform_b_private.pem");
const ALIPAY_PUBLIC: &str = include_str!("../fixtures/TEST_ONLY_alipay_platform_public.pem");
const ALIPAY_PRIVATE: &str = include_str!("../fixtures/TEST_ONLY_alipay_platform_private.pem");
const OTHER_PRIVATE: &str = include_str!("../fixtures/TEST_ONLY_merchant_other_private.pem");

const WX_A_PUBLIC_PATH: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/TEST_ONLY_wechatpay_platform_a_public.pem");
const WX_B_CERT_PATH: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/TEST_ONLY_wechatpay_platform_b_cert.pem");
const ALIPAY_PUBLIC_PATH: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/TEST_ONLY_alipay_platform_public.pem");

/// The serial payonce is told for platform key a (a bare public key).
const SERIAL_A: &str = "PUB_KEY_ID_TEST_A";
/// Platform b is configured as an X.509 certificate; this is its serial.
const SERIAL_B: &str = "1A0F9C4F76E5434E14E0ADBD9DD8784FD3136266";
/// The APIv3 key (32 bytes) payonce is configured with, and another one.
const APIV3_KEY: &str = "TESTONLYapiv3key0123456789abcdef";
const OTHER_APIV3_KEY: &str = "TESTONLYotherkey0123456789abcdef";
const ALIPAY_APP_ID: &str = "2021000000000001";
const GENERIC_SECRET: &[u8] = b"s";

/// 2023-11-14T22:13:20Z = 2023-11-15 06:13:20 in UTC+8.
const T0_MS: i64 = 1_700_000_000_000;
const T0_S: i64 = T0_MS / 1000;

struct Keys {
    wx_a: SigningKey<Sha256>,
    wx_b: SigningKey<Sha256>,
    alipay: SigningKey<Sha256>,
    other: SigningKey<Sha256>,
}

fn keys() -> &'static Keys {
    static KEYS: OnceLock<Keys> = OnceLock::new();
    KEYS.get_or_init(|| {
        let load =
            |pem: &str| SigningKey::<Sha256>::new(rsa::RsaPrivateKey::from_pkcs8_pem(pem).expect("test private key"));
        Keys {
            wx_a: load(WX_A_PRIVATE),
            wx_b: load(WX_B_PRIVATE),
            alipay: load(ALIPAY_PRIVATE),
            other: load(OTHER_PRIVATE),
        }
    })
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn rsa_sign(key: &SigningKey<Sha256>, message: &[u8]) -> String {
    b64(&key.sign(message).to_bytes())
}

fn unique() -> u64 {
    static N: AtomicU64 = AtomicU64::new(1);
    N.fetch_add(1, Ordering::SeqCst)
}

// ---------------------------------------------------------------- the app in process

fn config_with(wechatpay: bool, alipay: bool) -> Config {
    let wx = WechatpayConfig::new(
        APIV3_KEY,
        vec![
            (SERIAL_A.into(), wechatpay::public_key_from_pem(WX_A_PUBLIC).expect("platform a public key")),
            (SERIAL_B.into(), wechatpay::public_key_from_pem(WX_B_CERT).expect("platform b certificate")),
        ],
    )
    .expect("wechatpay config");
    let ali = AlipayConfig {
        public_key: alipay::public_key_from_text(ALIPAY_PUBLIC).expect("alipay public key"),
        app_id: ALIPAY_APP_ID.into(),
    };
    let mut platforms = vec![Platform::notices(Generic::new(vec![GENERIC_SECRET.to_vec()]))];
    if wechatpay {
        platforms.push(Platform::notices(Wechatpay::new(wx)));
    }
    if alipay {
        platforms.push(Platform::notices(Alipay::new(ali)));
    }
    Config {
        platforms: Platforms::with(platforms),
        rewards: Rewards { coupon_templates: vec!["NEW10".into()], points_per_yuan: 1 },
        ..Config::default()
    }
}

fn app() -> App {
    App::open(":memory:", Clock::manual(T0_MS), config_with(true, true)).expect("open app")
}

fn call(app: &App, method: &str, path: &str, headers: &[(String, String)], body: &[u8]) -> Response {
    let (path, query) = path.split_once('?').unwrap_or((path, ""));
    api::handle(
        app,
        &Request {
            method: method.into(),
            path: path.into(),
            query: query.into(),
            headers: headers.to_vec(),
            body: body.to_vec(),
        },
    )
}

fn json_headers() -> Vec<(String, String)> {
    vec![("Content-Type".into(), "application/json".into())]
}

fn body_json(resp: &Response) -> Value {
    serde_json::from_slice(&resp.body)
        .unwrap_or_else(|e| panic!("not JSON ({e}), status {}: {:?}", resp.status, String::from_utf8_lossy(&resp.body)))
}

fn body_text(resp: &Response) -> String {
    String::from_utf8_lossy(&resp.body).into_owned()
}

fn create_order(app: &App, order_no: &str, amount: i64) {
    let body = json!({"order_no": order_no, "user_id": "buyer-1", "amount": amount, "currency": "CNY"});
    let resp = call(app, "POST", "/v1/orders", &json_headers(), body.to_string().as_bytes());
    assert_eq!(resp.status, 201, "create {order_no}: {}", body_text(&resp));
}

fn order(app: &App, order_no: &str) -> Value {
    let resp = call(app, "GET", &format!("/v1/orders/{order_no}"), &[], b"");
    assert_eq!(resp.status, 200, "GET order {order_no}: {}", body_text(&resp));
    body_json(&resp)
}

fn status_of(app: &App, order_no: &str) -> String {
    order(app, order_no)["status"].as_str().unwrap_or_default().to_owned()
}

fn request_refund(app: &App, order_no: &str, refund_no: &str) {
    let body = json!({ "refund_no": refund_no });
    let resp =
        call(app, "POST", &format!("/v1/orders/{order_no}/refund"), &json_headers(), body.to_string().as_bytes());
    assert_eq!(resp.status, 200, "refund {order_no}/{refund_no}: {}", body_text(&resp));
    assert_eq!(body_json(&resp)["status"], "REFUNDING");
}

/// The outbox events of one order, oldest first.
fn events_of(app: &App, order_no: &str) -> Vec<Value> {
    let resp = call(app, "GET", "/v1/events?after=0&limit=1000", &[], b"");
    assert_eq!(resp.status, 200);
    body_json(&resp)["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["order_no"] == order_no)
        .cloned()
        .collect()
}

fn event_types(app: &App, order_no: &str) -> Vec<String> {
    events_of(app, order_no).iter().map(|e| e["type"].as_str().unwrap_or_default().to_owned()).collect()
}

#[derive(Debug, Clone, PartialEq)]
struct CallbackRow {
    pay_no: String,
    channel: String,
    order_no: String,
    amount: i64,
    outcome: String,
    source: String,
    raw_body: Vec<u8>,
}

fn callback_rows(app: &App) -> Vec<CallbackRow> {
    let conn = app.store().raw_connection().expect("raw connection");
    let mut stmt = conn
        .prepare(
            "SELECT c.pay_no, c.channel, o.order_no, c.amount, c.outcome, c.source, c.raw_body
             FROM pay_callback_log c JOIN orders o ON o.id = c.order_id ORDER BY c.id",
        )
        .expect("prepare");
    let rows = stmt
        .query_map([], |r| {
            Ok(CallbackRow {
                pay_no: r.get(0)?,
                channel: r.get(1)?,
                order_no: r.get(2)?,
                amount: r.get(3)?,
                outcome: r.get(4)?,
                source: r.get(5)?,
                raw_body: r.get(6)?,
            })
        })
        .expect("query")
        .collect::<Result<Vec<_>, _>>()
        .expect("rows");
    rows
}

/// Everything a callback could have written, for "nothing recorded".
#[derive(Debug, PartialEq)]
struct Ledgers {
    callbacks: Vec<CallbackRow>,
    orders: Vec<(String, String)>,
    refunds: Vec<(String, String)>,
    events: i64,
    coupons: Vec<(i64, String)>,
    points: i64,
    audit: i64,
}

fn ledgers(app: &App) -> Ledgers {
    let conn = app.store().raw_connection().expect("raw connection");
    let pairs = |sql: &str| -> Vec<(String, String)> {
        let mut stmt = conn.prepare(sql).expect("prepare");
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).expect("query").collect::<Result<Vec<_>, _>>();
        rows.expect("rows")
    };
    let count = |sql: &str| -> i64 { conn.query_row(sql, [], |r| r.get(0)).expect("count") };
    let coupons = {
        let mut stmt = conn.prepare("SELECT order_id, status FROM user_coupon ORDER BY id").expect("prepare");
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).expect("query").collect::<Result<Vec<_>, _>>();
        rows.expect("rows")
    };
    Ledgers {
        callbacks: callback_rows(app),
        orders: pairs("SELECT order_no, status FROM orders ORDER BY id"),
        refunds: pairs("SELECT refund_no, status FROM refund ORDER BY id"),
        events: count("SELECT count(*) FROM outbox_event"),
        coupons,
        points: count("SELECT count(*) FROM point_log"),
        audit: count("SELECT count(*) FROM audit_log"),
    }
}

fn audit_actions(app: &App) -> Vec<String> {
    let conn = app.store().raw_connection().expect("raw connection");
    let mut stmt = conn.prepare("SELECT action FROM audit_log ORDER BY id").expect("prepare");
    let rows = stmt.query_map([], |r| r.get(0)).expect("query").collect::<Result<Vec<String>, _>>();
    rows.expect("rows")
}

fn refund_status(app: &App, refund_no: &str) -> String {
    let conn = app.store().raw_connection().expect("raw connection");
    conn.query_row("SELECT status FROM refund WHERE refund_no = ?1", [refund_no], |r| r.get(0)).expect("refund row")
}

/// An order paid through `channel` and applied: coupon, points, order.paid.
fn assert_applied(app: &App, order_no: &str, pay_no: &str, channel: &str, amount: i64) {
    let detail = order(app, order_no);
    assert_eq!(detail["status"], "PAID", "{order_no}: {detail}");
    assert_eq!(detail["pay_no"], pay_no, "{order_no}: {detail}");
    assert_eq!(detail["amount"], amount);
    let payments = detail["payments"].as_array().expect("payments");
    assert_eq!(payments.len(), 1, "{order_no}: {detail}");
    assert_eq!(payments[0]["pay_no"], pay_no);
    assert_eq!(payments[0]["channel"], channel);
    assert_eq!(payments[0]["amount"], amount);
    assert_eq!(payments[0]["outcome"], "applied");
    assert_eq!(payments[0]["source"], "callback");
    let coupons = detail["coupons"].as_array().expect("coupons");
    assert_eq!(coupons.len(), 1, "{order_no}: {detail}");
    assert_eq!(coupons[0]["coupon_template_id"], "NEW10");
    assert_eq!(coupons[0]["status"], "ACTIVE");
    let points = detail["points"].as_array().expect("points");
    let expected_points = amount / 100;
    if expected_points > 0 {
        assert_eq!(points.len(), 1, "{order_no}: {detail}");
        assert_eq!(points[0]["point_type"], "ORDER_PAID");
        assert_eq!(points[0]["points"], expected_points);
    } else {
        assert!(points.is_empty(), "{order_no}: {detail}");
    }
    let paid: Vec<Value> = events_of(app, order_no).into_iter().filter(|e| e["type"] == "order.paid").collect();
    assert_eq!(paid.len(), 1, "{order_no}: one order.paid event");
    assert_eq!(paid[0]["event_id"], format!("order.paid:{order_no}"));
    assert_eq!(paid[0]["data"]["payment"]["pay_no"], pay_no);
    assert_eq!(paid[0]["data"]["payment"]["channel"], channel);
    assert_eq!(paid[0]["data"]["payment"]["amount"], amount);
    assert_eq!(paid[0]["data"]["payment"]["outcome"], "applied");
}

fn assert_pending_untouched(app: &App, order_no: &str) {
    let detail = order(app, order_no);
    assert_eq!(detail["status"], "PENDING", "{order_no}: {detail}");
    assert!(detail["payments"].as_array().expect("payments").is_empty(), "{order_no}: {detail}");
    assert!(detail["coupons"].as_array().expect("coupons").is_empty(), "{order_no}: {detail}");
    assert!(detail["points"].as_array().expect("points").is_empty(), "{order_no}: {detail}");
    assert!(events_of(app, order_no).is_empty(), "{order_no}: no events");
}

// ---------------------------------------------------------------- WeChat Pay v3

fn wx_transaction(order_no: &str, transaction_id: &str, total: Value) -> Value {
    json!({
        "mchid": "1900000100",
        "appid": "wxd678efh567hg6787",
        "out_trade_no": order_no,
        "transaction_id": transaction_id,
        "trade_type": "JSAPI",
        "trade_state": "SUCCESS",
        "trade_state_desc": "支付成功",
        "bank_type": "CMC",
        "attach": "",
        "success_time": "2023-11-15T06:13:10+08:00",
        "payer": {"openid": "oUpF8uMuAJO_M2pxb1Q9zNjWeS6o"},
        "amount": {"total": total, "payer_total": total, "currency": "CNY", "payer_currency": "CNY"}
    })
}

fn wx_refund(order_no: &str, transaction_id: &str, refund_no: &str, refund_status: &str) -> Value {
    json!({
        "mchid": "1900000100",
        "out_trade_no": order_no,
        "transaction_id": transaction_id,
        "out_refund_no": refund_no,
        "refund_id": "50000000382019052709732678859",
        "refund_status": refund_status,
        "success_time": "2023-11-15T06:20:00+08:00",
        "user_received_account": "招商银行信用卡0403",
        "amount": {"total": 9900, "refund": 9900, "payer_total": 9900, "payer_refund": 9900}
    })
}

/// AEAD_AES_256_GCM as WeChat Pay v3 documents it: base64(ct || 16-byte tag).
fn wx_encrypt(apiv3_key: &str, nonce: &str, aad: &str, plaintext: &[u8]) -> String {
    let cipher = Aes256Gcm::new_from_slice(apiv3_key.as_bytes()).expect("32-byte key");
    let ct = cipher
        .encrypt(Nonce::from_slice(nonce.as_bytes()), Payload { msg: plaintext, aad: aad.as_bytes() })
        .expect("encrypt");
    b64(&ct)
}

/// The notification envelope; `aad_sent` may differ from the one encrypted with.
fn wx_envelope_with(apiv3_key: &str, event_type: &str, plain: &Value, aad_sent: Option<&str>) -> Value {
    let (original_type, summary) = match event_type.starts_with("REFUND.") {
        true => ("refund", "退款成功"),
        false => ("transaction", "支付成功"),
    };
    let nonce = format!("rn{:010}", unique());
    let ciphertext = wx_encrypt(apiv3_key, &nonce, original_type, plain.to_string().as_bytes());
    json!({
        "id": format!("EV-2018022511223320{:06}", unique()),
        "create_time": "2023-11-15T06:13:20+08:00",
        "resource_type": "encrypt-resource",
        "event_type": event_type,
        "summary": summary,
        "resource": {
            "original_type": original_type,
            "algorithm": "AEAD_AES_256_GCM",
            "ciphertext": ciphertext,
            "associated_data": aad_sent.unwrap_or(original_type),
            "nonce": nonce
        }
    })
}

fn wx_body(event_type: &str, plain: &Value) -> Vec<u8> {
    wx_envelope_with(APIV3_KEY, event_type, plain, None).to_string().into_bytes()
}

#[derive(Clone, Debug)]
struct WxNote {
    body: Vec<u8>,
    serial: String,
    timestamp: String,
    nonce: String,
    signature: String,
}

impl WxNote {
    fn headers(&self) -> Vec<(String, String)> {
        vec![
            ("Content-Type".into(), "application/json".into()),
            ("Wechatpay-Serial".into(), self.serial.clone()),
            ("Wechatpay-Timestamp".into(), self.timestamp.clone()),
            ("Wechatpay-Nonce".into(), self.nonce.clone()),
            ("Wechatpay-Signature".into(), self.signature.clone()),
            ("Wechatpay-Signature-Type".into(), "WECHATPAY2-SHA256-RSA2048".into()),
        ]
    }
}

fn wx_message(timestamp: &str, nonce: &str, body: &[u8]) -> Vec<u8> {
    let mut message = format!("{timestamp}\n{nonce}\n").into_bytes();
    message.extend_from_slice(body);
    message.push(b'\n');
    message
}

/// A notification signed by `key` at `timestamp` (unix seconds).
fn wx_sign(key: &SigningKey<Sha256>, serial: &str, timestamp: i64, body: Vec<u8>) -> WxNote {
    let timestamp = timestamp.to_string();
    let nonce = format!("5K8264ILTKCH16CQ2502SI8Z{:08}", unique());
    let signature = rsa_sign(key, &wx_message(&timestamp, &nonce, &body));
    WxNote { body, serial: serial.into(), timestamp, nonce, signature }
}

fn wx_post(app: &App, path: &str, note: &WxNote) -> Response {
    call(app, "POST", path, &note.headers(), &note.body)
}

fn assert_wx_ok(resp: &Response, what: &str) {
    assert_eq!(resp.status, 204, "{what}: {}", body_text(resp));
    assert!(resp.body.is_empty(), "{what}: 204 has an empty body, got {:?}", body_text(resp));
}

/// WeChat's failure answer: 4xx with `{"code":"FAIL","message":"..."}`.
fn assert_wx_fail(resp: &Response, status: Option<u16>, what: &str) {
    match status {
        Some(s) => assert_eq!(resp.status, s, "{what}: {}", body_text(resp)),
        None => assert!((400..500).contains(&resp.status), "{what}: want 4xx, got {} {}", resp.status, body_text(resp)),
    }
    let body = body_json(resp);
    assert_eq!(body["code"], "FAIL", "{what}: {body}");
    assert!(body["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: a message: {body}");
}

// ---------------------------------------------------------------- Alipay

type Params = Vec<(String, String)>;

#[derive(Clone, Copy, Debug)]
enum Enc {
    /// Java URLEncoder style: `A-Za-z0-9-_.*` raw, space as `+`, upper-case hex.
    Standard,
    /// Every byte percent-encoded (`%41` for `A`).
    AllPercent,
    /// Space as `%20` instead of `+`.
    Space20,
    /// Lower-case hex digits (`%e6`).
    LowerHex,
}

fn pct(bytes: &[u8], enc: Enc) -> String {
    let mut out = String::new();
    for &b in bytes {
        let unreserved = b.is_ascii_alphanumeric() || b"-_.*".contains(&b);
        match enc {
            Enc::AllPercent => out.push_str(&format!("%{b:02X}")),
            _ if unreserved => out.push(b as char),
            Enc::Standard | Enc::LowerHex if b == b' ' => out.push('+'),
            Enc::LowerHex => out.push_str(&format!("%{b:02x}")),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

fn is_gbk(params: &Params) -> bool {
    get(params, "charset").is_some_and(|c| c.eq_ignore_ascii_case("gbk"))
}

fn in_charset(text: &str, gbk: bool) -> Vec<u8> {
    if gbk {
        let (bytes, _, unmappable) = encoding_rs::GBK.encode(text);
        assert!(!unmappable, "{text:?} is not GBK");
        bytes.into_owned()
    } else {
        text.as_bytes().to_vec()
    }
}

fn get<'a>(params: &'a Params, key: &str) -> Option<&'a str> {
    params.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

fn set(params: &mut Params, key: &str, value: &str) {
    match params.iter_mut().find(|(k, _)| k == key) {
        Some(pair) => pair.1 = value.into(),
        None => params.push((key.into(), value.into())),
    }
}

fn remove(params: &mut Params, key: &str) {
    params.retain(|(k, _)| k != key);
}

/// Alipay's string to sign: sorted non-empty `k=v` except sign and sign_type.
fn ali_content(params: &Params) -> String {
    let mut pairs: Vec<&(String, String)> =
        params.iter().filter(|(k, v)| !v.is_empty() && k != "sign" && k != "sign_type").collect();
    pairs.sort();
    pairs.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&")
}

/// `params` with a fresh `sign` by `key`, over the notice's charset.
fn ali_signed_by(key: &SigningKey<Sha256>, params: &Params) -> Params {
    let mut params = params.clone();
    remove(&mut params, "sign");
    let sign = rsa_sign(key, &in_charset(&ali_content(&params), is_gbk(&params)));
    // Alipay puts sign between the other fields; order does not matter.
    let at = params.len().min(6);
    params.insert(at, ("sign".into(), sign));
    params
}

fn ali_signed(params: &Params) -> Params {
    ali_signed_by(&keys().alipay, params)
}

fn ali_encode(params: &Params, enc: Enc) -> Vec<u8> {
    let gbk = is_gbk(params);
    params
        .iter()
        .map(|(k, v)| format!("{k}={}", pct(&in_charset(v, gbk), enc)))
        .collect::<Vec<_>>()
        .join("&")
        .into_bytes()
}

/// A trade notice as Alipay sends it (utf-8; unsigned).
fn ali_notice(trade_no: &str, order_no: &str, total_amount: &str, trade_status: &str) -> Params {
    let pairs = [
        ("gmt_create", "2023-11-15 06:13:05"),
        ("charset", "utf-8"),
        ("seller_email", "zhuzhanghu@alitest.com"),
        ("subject", "测试商品 Test Goods"),
        ("body", "测试商品描述"),
        ("buyer_id", "2088102122524333"),
        ("invoice_amount", total_amount),
        ("notify_id", "ac05099524730693a8b330c5ecf72da9786"),
        ("fund_bill_list", "[{\"amount\":\"99.00\",\"fundChannel\":\"ALIPAYACCOUNT\"}]"),
        ("notify_type", "trade_status_sync"),
        ("trade_status", trade_status),
        ("receipt_amount", total_amount),
        ("buyer_pay_amount", total_amount),
        ("app_id", ALIPAY_APP_ID),
        ("sign_type", "RSA2"),
        ("seller_id", "2088101106499364"),
        ("gmt_payment", "2023-11-15 06:13:10"),
        ("notify_time", "2023-11-15 06:13:20"),
        ("passback_params", "order%3D1&x=y"),
        ("version", "1.0"),
        ("out_trade_no", order_no),
        ("total_amount", total_amount),
        ("trade_no", trade_no),
        ("auth_app_id", ALIPAY_APP_ID),
        ("buyer_logon_id", "159****5620"),
        ("point_amount", "0.00"),
    ];
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// A refund notice: `refund_fee` plus `out_biz_no` (TRADE_SUCCESS) or
/// `gmt_refund` (TRADE_CLOSED of a full refund).
fn ali_refund_notice(trade_no: &str, order_no: &str, trade_status: &str, out_biz_no: Option<&str>) -> Params {
    let mut params = ali_notice(trade_no, order_no, "99.00", trade_status);
    set(&mut params, "refund_fee", "99.00");
    set(&mut params, "gmt_refund", "2023-11-15 06:20:00.123");
    if let Some(out_biz_no) = out_biz_no {
        set(&mut params, "out_biz_no", out_biz_no);
    }
    params
}

fn ali_post_bytes(app: &App, body: &[u8]) -> Response {
    let headers = vec![("Content-Type".to_owned(), "application/x-www-form-urlencoded; charset=utf-8".to_owned())];
    call(app, "POST", "/v1/callbacks/alipay", &headers, body)
}

fn ali_post(app: &App, params: &Params) -> Response {
    ali_post_bytes(app, &ali_encode(params, Enc::Standard))
}

fn assert_ali_ok(resp: &Response, what: &str) {
    assert_eq!(resp.status, 200, "{what}: {}", body_text(resp));
    assert_eq!(body_text(resp), "success", "{what}");
}

/// Alipay's failure answer: the text `failure` and a 4xx.
fn assert_ali_fail(resp: &Response, status: Option<u16>, what: &str) {
    match status {
        Some(s) => assert_eq!(resp.status, s, "{what}: {}", body_text(resp)),
        None => assert!((400..500).contains(&resp.status), "{what}: want 4xx, got {} {}", resp.status, body_text(resp)),
    }
    assert_eq!(body_text(resp), "failure", "{what}");
}

// ---------------------------------------------------------------- generic

fn generic_post(app: &App, path: &str, body: &Value) -> Response {
    let body = body.to_string();
    let now_s = app.clock().now_ms().div_euclid(1000);
    let mut headers = json_headers();
    headers.push(("Payonce-Signature".into(), payonce::signature::sign(GENERIC_SECRET, now_s, body.as_bytes())));
    call(app, "POST", path, &headers, body.as_bytes())
}

// ================================================================ amounts

#[test]
fn yuan_strings_convert_to_fen_exactly_or_are_refused() {
    let table: &[(&str, Option<i64>)] = &[
        ("0.01", Some(1)),
        ("0.1", Some(10)),
        ("0.10", Some(10)),
        ("1", Some(100)),
        ("1.5", Some(150)),
        ("1.50", Some(150)),
        ("99.00", Some(9900)),
        ("99.99", Some(9999)),
        ("0.29", Some(29)),  // 0.29 * 100 = 28.999999999999996 as a float
        ("1.15", Some(115)), // 114.99999999999999 as a float
        ("19.99", Some(1999)),
        ("0", Some(0)),
        ("0.00", Some(0)),
        ("10000000000", Some(1_000_000_000_000)),
        ("10000000000.00", Some(1_000_000_000_000)),
        ("9999999999.99", Some(999_999_999_999)),
        // refused: more than two decimals, signs, exponents, anything not plain digits
        ("1.001", None),
        ("99.000", None),
        ("0.005", None),
        ("-1", None),
        ("-0.01", None),
        ("+1", None),
        ("+1.00", None),
        ("1e2", None),
        ("1E2", None),
        ("9.9e1", None),
        ("1.0e0", None),
        ("", None),
        (".", None),
        (".5", None),
        ("1.", None),
        ("1..0", None),
        ("1.0.0", None),
        (" 1", None),
        ("1 ", None),
        ("1,00", None),
        ("1,000.00", None),
        ("0x10", None),
        ("NaN", None),
        ("inf", None),
        ("Infinity", None),
        ("１", None),
        ("1.０", None),
        ("¥1", None),
        ("1元", None),
        ("99999999999999999999", None),
        ("9223372036854775807", None),
    ];
    for (text, want) in table {
        assert_eq!(yuan_to_fen(text, false), *want, "yuan_to_fen({text:?}, false)");
    }
    // A leading minus only where asked for (statements' refund rows), and
    // then the absolute value (as documented at src/recon.rs); a plus never.
    assert_eq!(yuan_to_fen("-1.50", true), Some(150));
    assert_eq!(yuan_to_fen("-0.01", true), Some(1));
    assert_eq!(yuan_to_fen("1.50", true), Some(150));
    assert_eq!(yuan_to_fen("+1.50", true), None);
    assert_eq!(yuan_to_fen("--1", true), None);
    assert_eq!(yuan_to_fen("-1.001", true), None);
}

#[test]
fn alipay_total_amount_is_converted_exactly_or_refused_end_to_end() {
    let app = app();
    // Accepted: each pays an order of exactly that many fen.
    let accepted: &[(&str, i64)] =
        &[("99", 9900), ("99.0", 9900), ("99.00", 9900), ("0.01", 1), ("0.29", 29), ("1.15", 115)];
    for (i, (text, fen)) in accepted.iter().enumerate() {
        let order_no = format!("ALAMT-OK-{i}");
        let trade_no = format!("2023111522001400{i:04}");
        create_order(&app, &order_no, *fen);
        let resp = ali_post(&app, &ali_signed(&ali_notice(&trade_no, &order_no, text, "TRADE_SUCCESS")));
        assert_ali_ok(&resp, &format!("total_amount {text:?}"));
        assert_applied(&app, &order_no, &trade_no, "alipay", *fen);
    }
    // Refused with a *valid* signature over the bad amount: 400 failure, nothing recorded.
    create_order(&app, "ALAMT-BAD", 9900);
    let before = ledgers(&app);
    for text in [
        "99.000",
        "99.001",
        "9.9e1",
        "9.9E1",
        "99e0",
        "+99.00",
        "-99.00",
        "-0.01",
        "0.00",
        "0",
        " 99.00",
        "99.00 ",
        "99,00",
        "9,900",
        "0x26AC",
        "NaN",
        "Infinity",
        "９９",
        "99.",
        ".99",
        "99.0.0",
        "10000000000.01",
        "99999999999999999999",
    ] {
        let resp = ali_post(&app, &ali_signed(&ali_notice("2023111522001499999", "ALAMT-BAD", text, "TRADE_SUCCESS")));
        assert_ali_fail(&resp, Some(400), &format!("total_amount {text:?}"));
        assert_eq!(ledgers(&app), before, "total_amount {text:?} recorded nothing");
    }
    assert_pending_untouched(&app, "ALAMT-BAD");
    // A raw `+` in a form is a space: "+99.00" sent unencoded is " 99.00", also refused.
    let signed = ali_signed(&ali_notice("2023111522001499999", "ALAMT-BAD", " 99.00", "TRADE_SUCCESS"));
    let body = String::from_utf8(ali_encode(&signed, Enc::Standard)).unwrap();
    assert!(body.contains("total_amount=+99.00"), "{body}");
    assert_ali_fail(&ali_post_bytes(&app, body.as_bytes()), Some(400), "raw +99.00");
    assert_eq!(ledgers(&app), before);
    // The genuine amount still pays it.
    let resp = ali_post(&app, &ali_signed(&ali_notice("2023111522001499999", "ALAMT-BAD", "99.00", "TRADE_SUCCESS")));
    assert_ali_ok(&resp, "genuine");
    assert_applied(&app, "ALAMT-BAD", "2023111522001499999", "alipay", 9900);
}

// ================================================================ WeChat Pay

#[test]
fn wechatpay_timestamps_more_than_five_minutes_off_are_refused() {
    let app = app();
    let order_no = "WXCLOCK0001";
    let txn = "4200000001202311150003";
    create_order(&app, order_no, 9900);
    let body = wx_body("TRANSACTION.SUCCESS", &wx_transaction(order_no, txn, json!(9900)));
    let before = ledgers(&app);
    // Signed (correctly) 301 s in the past or the future.
    for offset in [-301, 301, -3600, 86_400] {
        let note = wx_sign(&keys().wx_a, SERIAL_A, T0_S + offset, body.clone());
        assert_wx_fail(&wx_post(&app, "/v1/callbacks/wechatpay", &note), Some(401), &format!("timestamp {offset:+} s"));
        assert_eq!(ledgers(&app), before, "timestamp {offset:+} s: nothing recorded");
    }
    // Signed now, delivered 5 min + 1 s later (either way), by the manual clock.
    let note = wx_sign(&keys().wx_a, SERIAL_A, T0_S, body.clone());
    for shift in [301_000, -301_000] {
        app.clock().set_ms(T0_MS + shift);
        assert_wx_fail(&wx_post(&app, "/v1/callbacks/wechatpay", &note), Some(401), &format!("clock {shift:+} ms"));
        assert_eq!(ledgers(&app), before, "clock {shift:+} ms: nothing recorded");
    }
    app.clock().set_ms(T0_MS);
    assert_pending_untouched(&app, order_no);

    // Exactly 5 minutes off is still in tolerance.
    app.clock().set_ms(T0_MS + 300_000);
    assert_wx_ok(&wx_post(&app, "/v1/callbacks/wechatpay", &note), "300 s late");
    assert_applied(&app, order_no, txn, "wechatpay", 9900);
    app.clock().set_ms(T0_MS);
    create_order(&app, "WXCLOCK0002", 9900);
    let body = wx_body("TRANSACTION.SUCCESS", &wx_transaction("WXCLOCK0002", "4200000001202311150004", json!(9900)));
    let early = wx_sign(&keys().wx_a, SERIAL_A, T0_S + 300, body);
    assert_wx_ok(&wx_post(&app, "/v1/callbacks/wechatpay", &early), "300 s early");
    assert_applied(&app, "WXCLOCK0002", "4200000001202311150004", "wechatpay", 9900);
}

#[test]
fn wechatpay_key_rotation_either_configured_serial_verifies() {
    let app = app();
    for (order_no, txn, key, serial) in [
        ("WXROTATE0001", "4200000001202311150010", &keys().wx_a, SERIAL_A),
        ("WXROTATE0002", "4200000001202311150011", &keys().wx_b, SERIAL_B),
    ] {
        create_order(&app, order_no, 1999);
        let note =
            wx_sign(key, serial, T0_S, wx_body("TRANSACTION.SUCCESS", &wx_transaction(order_no, txn, json!(1999))));
        assert_wx_ok(&wx_post(&app, "/v1/callbacks/wechatpay", &note), serial);
        assert_applied(&app, order_no, txn, "wechatpay", 1999);
    }
    // Each key answers only to its own serial.
    create_order(&app, "WXROTATE0003", 1999);
    let body = wx_body("TRANSACTION.SUCCESS", &wx_transaction("WXROTATE0003", "4200000001202311150012", json!(1999)));
    let before = ledgers(&app);
    let crossed = wx_sign(&keys().wx_b, SERIAL_A, T0_S, body.clone());
    assert_wx_fail(&wx_post(&app, "/v1/callbacks/wechatpay", &crossed), Some(401), "b's signature, a's serial");
    let crossed = wx_sign(&keys().wx_a, SERIAL_B, T0_S, body.clone());
    assert_wx_fail(&wx_post(&app, "/v1/callbacks/wechatpay", &crossed), Some(401), "a's signature, b's serial");
    assert_eq!(ledgers(&app), before);
    assert_wx_ok(&wx_post(&app, "/v1/callbacks/wechatpay", &wx_sign(&keys().wx_b, SERIAL_B, T0_S, body)), "b over b");
    assert_applied(&app, "WXROTATE0003", "4200000001202311150012", "wechatpay", 1999);
}

#[test]
fn wechatpay_amounts_that_are_not_integer_fen_are_refused() {
    let app = app();
    create_order(&app, "WXAMOUNT0001", 9900);
    let before = ledgers(&app);
    for total in [
        json!(9900.0),
        json!(99.0),
        json!("9900"),
        json!(-9900),
        json!(0),
        json!(1_000_000_000_001_i64),
        json!(null),
        json!(9.9e3),
    ] {
        let note = wx_sign(
            &keys().wx_a,
            SERIAL_A,
            T0_S,
            wx_body("TRANSACTION.SUCCESS", &wx_transaction("WXAMOUNT0001", "4200000001202311150020", total.clone())),
        );
        assert_wx_fail(&wx_post(&app, "/v1/callbacks/wechatpay", &note), Some(400), &format!("amount.total {total}"));
        assert_eq!(ledgers(&app), before, "amount.total {total}: nothing recorded");
    }
    assert_pending_untouched(&app, "WXAMOUNT0001");
}

/// An order paid through WeChat with a refund requested.
fn wx_paid_and_refunding(app: &App, order_no: &str, txn: &str, refund_no: &str) {
    create_order(app, order_no, 9900);
    let note = wx_sign(
        &keys().wx_a,
        SERIAL_A,
        T0_S,
        wx_body("TRANSACTION.SUCCESS", &wx_transaction(order_no, txn, json!(9900))),
    );
    assert_wx_ok(&wx_post(app, "/v1/callbacks/wechatpay", &note), "payment");
    assert_applied(app, order_no, txn, "wechatpay", 9900);
    request_refund(app, order_no, refund_no);
}

fn wx_refund_note(order_no: &str, txn: &str, refund_no: &str, event: &str, status: &str) -> WxNote {
    wx_sign(&keys().wx_b, SERIAL_B, T0_S, wx_body(event, &wx_refund(order_no, txn, refund_no, status)))
}

#[test]
fn wechatpay_refund_success_settles_the_refund() {
    let app = app();
    wx_paid_and_refunding(&app, "WXREFUND0001", "4200000001202311150030", "WXR-0001");
    // A forged refund result first: refused, nothing changes.
    let before = ledgers(&app);
    let forged = wx_sign(
        &keys().other,
        SERIAL_B,
        T0_S,
        wx_body("REFUND.SUCCESS", &wx_refund("WXREFUND0001", "4200000001202311150030", "WXR-0001", "SUCCESS")),
    );
    assert_wx_fail(&wx_post(&app, "/v1/callbacks/wechatpay/refund", &forged), Some(401), "forged refund");
    assert_eq!(ledgers(&app), before);
    assert_eq!(refund_status(&app, "WXR-0001"), "REQUESTED");

    let note = wx_refund_note("WXREFUND0001", "4200000001202311150030", "WXR-0001", "REFUND.SUCCESS", "SUCCESS");
    assert_wx_ok(&wx_post(&app, "/v1/callbacks/wechatpay/refund", &note), "REFUND.SUCCESS");
    let detail = order(&app, "WXREFUND0001");
    assert_eq!(detail["status"], "REFUNDED", "{detail}");
    assert_eq!(detail["refund_no"], "WXR-0001");
    assert_eq!(refund_status(&app, "WXR-0001"), "SUCCEEDED");
    assert_eq!(detail["coupons"][0]["status"], "FROZEN", "{detail}");
    let points: Vec<(String, i64)> = detail["points"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["point_type"].as_str().unwrap().to_owned(), p["points"].as_i64().unwrap()))
        .collect();
    assert_eq!(points, vec![("ORDER_PAID".to_owned(), 99), ("ORDER_PAID_REVERSAL".to_owned(), -99)]);
    assert_eq!(event_types(&app, "WXREFUND0001"), ["order.paid", "order.refunding", "order.refunded"]);
    // The refund notice is not a payment.
    assert_eq!(callback_rows(&app).len(), 1);
    // WeChat retries: the same result again is a duplicate, still 204.
    let before = ledgers(&app);
    assert_wx_ok(&wx_post(&app, "/v1/callbacks/wechatpay/refund", &note), "redelivered REFUND.SUCCESS");
    assert_eq!(ledgers(&app), before);
}

#[test]
fn wechatpay_refund_closed_or_abnormal_fails_the_refund_and_the_order_is_paid_again() {
    let app = app();
    let (order_no, txn) = ("WXREFUND0002", "4200000001202311150031");
    wx_paid_and_refunding(&app, order_no, txn, "WXR-0002");
    let note = wx_refund_note(order_no, txn, "WXR-0002", "REFUND.CLOSED", "CLOSED");
    assert_wx_ok(&wx_post(&app, "/v1/callbacks/wechatpay/refund", &note), "REFUND.CLOSED");
    assert_eq!(status_of(&app, order_no), "PAID");
    assert_eq!(refund_status(&app, "WXR-0002"), "FAILED");
    assert_eq!(event_types(&app, order_no), ["order.paid", "order.refunding", "order.refund_failed"]);
    let detail = order(&app, order_no);
    assert_eq!(detail["coupons"][0]["status"], "ACTIVE", "rewards kept: {detail}");
    assert_eq!(detail["points"].as_array().unwrap().len(), 1, "{detail}");
    // A redelivery is a duplicate.
    let before = ledgers(&app);
    assert_wx_ok(&wx_post(&app, "/v1/callbacks/wechatpay/refund", &note), "redelivered REFUND.CLOSED");
    assert_eq!(ledgers(&app), before);

    // A new refund_no is accepted; REFUND.ABNORMAL fails it the same way.
    request_refund(&app, order_no, "WXR-0003");
    let note = wx_refund_note(order_no, txn, "WXR-0003", "REFUND.ABNORMAL", "ABNORMAL");
    assert_wx_ok(&wx_post(&app, "/v1/callbacks/wechatpay/refund", &note), "REFUND.ABNORMAL");
    assert_eq!(status_of(&app, order_no), "PAID");
    assert_eq!(refund_status(&app, "WXR-0003"), "FAILED");
    assert_eq!(refund_status(&app, "WXR-0002"), "FAILED", "the first failed refund stays FAILED");

    // And a third one can still succeed.
    request_refund(&app, order_no, "WXR-0004");
    let note = wx_refund_note(order_no, txn, "WXR-0004", "REFUND.SUCCESS", "SUCCESS");
    assert_wx_ok(&wx_post(&app, "/v1/callbacks/wechatpay/refund", &note), "REFUND.SUCCESS");
    assert_eq!(status_of(&app, order_no), "REFUNDED");
}

// ================================================================ Alipay

#[test]
fn alipay_harmless_variations_still_verify() {
    let app = app();
    let mut n = 0;
    let mut check = |what: &str, build: &dyn Fn(&str, &str) -> Vec<u8>| {
        n += 1;
        let order_no = format!("ALVARY{n:04}");
        let trade_no = format!("20231115220014000001{n:02}");
        create_order(&app, &order_no, 9900);
        let body = build(&trade_no, &order_no);
        let resp = ali_post_bytes(&app, &body);
        assert_ali_ok(&resp, what);
        assert_applied(&app, &order_no, &trade_no, "alipay", 9900);
        let row = callback_rows(&app).into_iter().find(|r| r.pay_no == trade_no).expect("recorded");
        assert_eq!(row.raw_body, body, "{what}: raw_body is the bytes received");
    };
    check("fields in another order", &|t, o| {
        let mut p = ali_signed(&ali_notice(t, o, "99.00", "TRADE_SUCCESS"));
        p.reverse();
        ali_encode(&p, Enc::Standard)
    });
    check("fields sorted by key", &|t, o| {
        let mut p = ali_signed(&ali_notice(t, o, "99.00", "TRADE_SUCCESS"));
        p.sort();
        ali_encode(&p, Enc::Standard)
    });
    check("every byte percent-encoded (%41 for A)", &|t, o| {
        ali_encode(&ali_signed(&ali_notice(t, o, "99.00", "TRADE_SUCCESS")), Enc::AllPercent)
    });
    check("keys percent-encoded too", &|t, o| {
        let p = ali_signed(&ali_notice(t, o, "99.00", "TRADE_SUCCESS"));
        let body = p
            .iter()
            .map(|(k, v)| format!("{}={}", pct(k.as_bytes(), Enc::AllPercent), pct(v.as_bytes(), Enc::Standard)))
            .collect::<Vec<_>>()
            .join("&");
        body.into_bytes()
    });
    check("space as %20 instead of +", &|t, o| {
        ali_encode(&ali_signed(&ali_notice(t, o, "99.00", "TRADE_SUCCESS")), Enc::Space20)
    });
    check("lower-case hex", &|t, o| {
        ali_encode(&ali_signed(&ali_notice(t, o, "99.00", "TRADE_SUCCESS")), Enc::LowerHex)
    });
    check("sign's / and = left unencoded", &|t, o| {
        let p = ali_signed(&ali_notice(t, o, "99.00", "TRADE_SUCCESS"));
        let sign = get(&p, "sign").unwrap().to_owned();
        let mut body = String::from_utf8(ali_encode(&p, Enc::Standard)).unwrap();
        let encoded = pct(sign.as_bytes(), Enc::Standard);
        let partly = encoded.replace("%2F", "/").replace("%3D", "=");
        body = body.replace(&format!("sign={encoded}"), &format!("sign={partly}"));
        body.into_bytes()
    });
    check("empty fields present (not signed)", &|t, o| {
        let mut p = ali_notice(t, o, "99.00", "TRADE_SUCCESS");
        set(&mut p, "voucher_detail_list", "");
        set(&mut p, "passback_params", "");
        set(&mut p, "out_biz_no", "");
        set(&mut p, "refund_fee", "");
        ali_encode(&ali_signed(&p), Enc::Standard)
    });
    check("empty fields added after signing", &|t, o| {
        let mut body = ali_encode(&ali_signed(&ali_notice(t, o, "99.00", "TRADE_SUCCESS")), Enc::Standard);
        body.extend_from_slice(b"&discount=&gmt_close=");
        body
    });
    check("an empty field removed after signing", &|t, o| {
        let mut p = ali_notice(t, o, "99.00", "TRADE_SUCCESS");
        set(&mut p, "passback_params", "");
        let mut p = ali_signed(&p);
        remove(&mut p, "passback_params");
        ali_encode(&p, Enc::Standard)
    });
    check("charset=gbk with 测试商品", &|t, o| {
        let mut p = ali_notice(t, o, "99.00", "TRADE_SUCCESS");
        set(&mut p, "charset", "gbk");
        let body = ali_encode(&ali_signed(&p), Enc::Standard);
        // GBK bytes on the wire: 测 is D6 A8... in GBK, not E6 B5 8B as in UTF-8.
        let text = String::from_utf8(body.clone()).unwrap();
        assert!(text.contains(&pct(&in_charset("测试商品", true), Enc::Standard)), "{text}");
        assert!(!text.contains(&pct("测试商品".as_bytes(), Enc::Standard)), "{text}");
        body
    });
    check("charset=GBK, every byte percent-encoded, lower-case", &|t, o| {
        let mut p = ali_notice(t, o, "99.00", "TRADE_SUCCESS");
        set(&mut p, "charset", "GBK");
        let body = ali_encode(&ali_signed(&p), Enc::AllPercent);
        String::from_utf8(body).unwrap().to_ascii_lowercase().into_bytes()
    });
    check("charset=utf-8 with 测试商品 every byte percent-encoded", &|t, o| {
        ali_encode(&ali_signed(&ali_notice(t, o, "99.00", "TRADE_SUCCESS")), Enc::AllPercent)
    });
}

#[test]
fn alipay_trade_success_and_trade_finished_are_one_payment() {
    let app = app();
    for (order_no, trade_no, first, second) in [
        ("ALFINISH0001", "2023111522001400000101", "TRADE_SUCCESS", "TRADE_FINISHED"),
        ("ALFINISH0002", "2023111522001400000102", "TRADE_FINISHED", "TRADE_SUCCESS"),
    ] {
        create_order(&app, order_no, 9900);
        let resp = ali_post(&app, &ali_signed(&ali_notice(trade_no, order_no, "99.00", first)));
        assert_ali_ok(&resp, first);
        assert_applied(&app, order_no, trade_no, "alipay", 9900);
        let before = ledgers(&app);
        let resp = ali_post(&app, &ali_signed(&ali_notice(trade_no, order_no, "99.00", second)));
        assert_ali_ok(&resp, second);
        assert_eq!(ledgers(&app), before, "{first} then {second}: one payment");
        assert_applied(&app, order_no, trade_no, "alipay", 9900);
    }
}

/// An order paid through Alipay with `refund_no` requested.
fn ali_paid_and_refunding(app: &App, order_no: &str, trade_no: &str, refund_no: &str) {
    create_order(app, order_no, 9900);
    assert_ali_ok(&ali_post(app, &ali_signed(&ali_notice(trade_no, order_no, "99.00", "TRADE_SUCCESS"))), "payment");
    assert_applied(app, order_no, trade_no, "alipay", 9900);
    request_refund(app, order_no, refund_no);
}

fn assert_refunded(app: &App, order_no: &str, refund_no: &str) {
    let detail = order(app, order_no);
    assert_eq!(detail["status"], "REFUNDED", "{detail}");
    assert_eq!(detail["refund_no"], refund_no, "{detail}");
    assert_eq!(refund_status(app, refund_no), "SUCCEEDED");
    assert_eq!(detail["coupons"][0]["status"], "FROZEN", "{detail}");
    assert_eq!(detail["points"].as_array().unwrap().len(), 2, "ORDER_PAID and its reversal: {detail}");
    assert_eq!(event_types(app, order_no), ["order.paid", "order.refunding", "order.refunded"]);
    let payments = detail["payments"].as_array().unwrap();
    assert_eq!(payments.len(), 1, "the refund notice is not a second payment: {detail}");
    assert_eq!(payments[0]["outcome"], "applied");
}

#[test]
fn alipay_refund_notices_settle_the_refunding_order_before_the_duplicate_check() {
    let app = app();
    // A partial-refund style notice: TRADE_SUCCESS + refund_fee + out_biz_no,
    // same trade_no as the payment (so a duplicate check first would swallow it).
    let (order_no, trade_no) = ("ALREFUND0001", "2023111522001400000201");
    ali_paid_and_refunding(&app, order_no, trade_no, "ALR-0001");
    let notice = ali_signed(&ali_refund_notice(trade_no, order_no, "TRADE_SUCCESS", Some("ALR-0001")));
    assert_ali_ok(&ali_post(&app, &notice), "refund_fee + out_biz_no");
    assert_refunded(&app, order_no, "ALR-0001");
    let before = ledgers(&app);
    assert_ali_ok(&ali_post(&app, &notice), "redelivered refund notice");
    assert_eq!(ledgers(&app), before, "a redelivered refund result changes nothing");

    // A full refund: TRADE_CLOSED + gmt_refund + refund_fee, no out_biz_no.
    let (order_no, trade_no) = ("ALREFUND0002", "2023111522001400000202");
    ali_paid_and_refunding(&app, order_no, trade_no, "ALR-0002");
    let notice = ali_refund_notice(trade_no, order_no, "TRADE_CLOSED", None);
    assert!(get(&notice, "out_biz_no").is_none());
    assert_ali_ok(&ali_post(&app, &ali_signed(&notice)), "TRADE_CLOSED + gmt_refund + refund_fee");
    assert_refunded(&app, order_no, "ALR-0002");

    // A refund notice is verified like any other: tampered, it changes nothing.
    let (order_no, trade_no) = ("ALREFUND0003", "2023111522001400000203");
    ali_paid_and_refunding(&app, order_no, trade_no, "ALR-0003");
    let before = ledgers(&app);
    let mut forged = ali_signed(&ali_refund_notice(trade_no, order_no, "TRADE_SUCCESS", Some("ALR-0003")));
    set(&mut forged, "refund_fee", "9.90");
    assert_ali_fail(&ali_post(&app, &forged), None, "tampered refund_fee");
    let forged =
        ali_signed_by(&keys().other, &ali_refund_notice(trade_no, order_no, "TRADE_SUCCESS", Some("ALR-0003")));
    assert_ali_fail(&ali_post(&app, &forged), None, "refund notice signed by merchant_other");
    let bad_fee = {
        let mut p = ali_refund_notice(trade_no, order_no, "TRADE_SUCCESS", Some("ALR-0003"));
        set(&mut p, "refund_fee", "99.001");
        ali_signed(&p)
    };
    assert_ali_fail(&ali_post(&app, &bad_fee), Some(400), "refund_fee with three decimals");
    assert_eq!(ledgers(&app), before);
    assert_eq!(status_of(&app, order_no), "REFUNDING");
    assert_eq!(refund_status(&app, "ALR-0003"), "REQUESTED");
}

#[test]
fn alipay_trade_closed_without_refund_fee_changes_nothing() {
    let app = app();
    // An unpaid trade closed: the order is untouched (not closed, not paid).
    create_order(&app, "ALCLOSED0001", 9900);
    let before = ledgers(&app);
    let closed = ali_signed(&ali_notice("2023111522001400000301", "ALCLOSED0001", "99.00", "TRADE_CLOSED"));
    assert_ali_ok(&ali_post(&app, &closed), "TRADE_CLOSED of an unpaid trade");
    assert_eq!(ledgers(&app), before);
    assert_pending_untouched(&app, "ALCLOSED0001");
    // The trade can still be paid afterwards (nothing was recorded under its trade_no).
    let paid = ali_signed(&ali_notice("2023111522001400000301", "ALCLOSED0001", "99.00", "TRADE_SUCCESS"));
    assert_ali_ok(&ali_post(&app, &paid), "then paid");
    assert_applied(&app, "ALCLOSED0001", "2023111522001400000301", "alipay", 9900);
    // TRADE_CLOSED of a paid trade without refund_fee changes nothing either.
    let before = ledgers(&app);
    assert_ali_ok(&ali_post(&app, &closed), "TRADE_CLOSED without refund_fee of a paid trade");
    assert_eq!(ledgers(&app), before);
    assert_eq!(status_of(&app, "ALCLOSED0001"), "PAID");
}

// ================================================================ across channels

#[test]
fn the_same_pay_no_on_the_generic_and_a_real_channel_is_one_payment() {
    let app = app();
    // Generic first, then Alipay with trade_no = the same pay_no.
    create_order(&app, "XCHAN0001", 9900);
    let resp = generic_post(
        &app,
        "/v1/callbacks/generic",
        &json!({"pay_no": "2023111522001400000401", "order_no": "XCHAN0001", "amount": 9900, "status": "SUCCESS"}),
    );
    assert_eq!(resp.status, 200, "{}", body_text(&resp));
    assert_eq!(body_json(&resp)["outcome"], "applied");
    let before = ledgers(&app);
    let resp =
        ali_post(&app, &ali_signed(&ali_notice("2023111522001400000401", "XCHAN0001", "99.00", "TRADE_SUCCESS")));
    assert_ali_ok(&resp, "alipay after generic");
    assert_eq!(ledgers(&app), before, "alipay after generic: a duplicate");
    assert_applied(&app, "XCHAN0001", "2023111522001400000401", "generic", 9900);

    // Generic first, then WeChat with transaction_id = the same pay_no.
    create_order(&app, "XCHAN0002", 9900);
    let resp = generic_post(
        &app,
        "/v1/callbacks/generic",
        &json!({"pay_no": "4200000001202311150401", "order_no": "XCHAN0002", "amount": 9900, "status": "SUCCESS"}),
    );
    assert_eq!(body_json(&resp)["outcome"], "applied");
    let before = ledgers(&app);
    let note = wx_sign(
        &keys().wx_a,
        SERIAL_A,
        T0_S,
        wx_body("TRANSACTION.SUCCESS", &wx_transaction("XCHAN0002", "4200000001202311150401", json!(9900))),
    );
    assert_wx_ok(&wx_post(&app, "/v1/callbacks/wechatpay", &note), "wechatpay after generic");
    assert_eq!(ledgers(&app), before, "wechatpay after generic: a duplicate");
    assert_applied(&app, "XCHAN0002", "4200000001202311150401", "generic", 9900);

    // WeChat first, then generic: the generic answer says duplicate of applied.
    create_order(&app, "XCHAN0003", 9900);
    let note = wx_sign(
        &keys().wx_b,
        SERIAL_B,
        T0_S,
        wx_body("TRANSACTION.SUCCESS", &wx_transaction("XCHAN0003", "4200000001202311150402", json!(9900))),
    );
    assert_wx_ok(&wx_post(&app, "/v1/callbacks/wechatpay", &note), "wechatpay first");
    let before = ledgers(&app);
    let resp = generic_post(
        &app,
        "/v1/callbacks/generic",
        &json!({"pay_no": "4200000001202311150402", "order_no": "XCHAN0003", "amount": 9900, "status": "SUCCESS"}),
    );
    assert_eq!(resp.status, 200);
    assert_eq!(body_json(&resp), json!({"code": "SUCCESS", "outcome": "duplicate", "original": "applied"}));
    assert_eq!(ledgers(&app), before);
    assert_applied(&app, "XCHAN0003", "4200000001202311150402", "wechatpay", 9900);

    // Alipay first, then generic.
    create_order(&app, "XCHAN0004", 9900);
    assert_ali_ok(
        &ali_post(&app, &ali_signed(&ali_notice("2023111522001400000402", "XCHAN0004", "99.00", "TRADE_FINISHED"))),
        "alipay first",
    );
    let before = ledgers(&app);
    let resp = generic_post(
        &app,
        "/v1/callbacks/generic",
        &json!({"pay_no": "2023111522001400000402", "order_no": "XCHAN0004", "amount": 9900, "status": "SUCCESS"}),
    );
    assert_eq!(body_json(&resp), json!({"code": "SUCCESS", "outcome": "duplicate", "original": "applied"}));
    assert_eq!(ledgers(&app), before);
    assert_applied(&app, "XCHAN0004", "2023111522001400000402", "alipay", 9900);
}

#[test]
fn unknown_orders_are_404_and_recorded_nowhere_so_a_retry_succeeds() {
    let app = app();
    let before = ledgers(&app);
    // WeChat payment.
    let wx = wx_sign(
        &keys().wx_a,
        SERIAL_A,
        T0_S,
        wx_body("TRANSACTION.SUCCESS", &wx_transaction("WXLATE0001", "4200000001202311150501", json!(9900))),
    );
    assert_wx_fail(&wx_post(&app, "/v1/callbacks/wechatpay", &wx), Some(404), "wechatpay, unknown order");
    // WeChat refund.
    let wx_r = wx_refund_note("WXLATE0002", "4200000001202311150502", "WXR-LATE", "REFUND.SUCCESS", "SUCCESS");
    assert_wx_fail(
        &wx_post(&app, "/v1/callbacks/wechatpay/refund", &wx_r),
        Some(404),
        "wechatpay refund, unknown order",
    );
    // Alipay payment and refunds.
    let ali = ali_signed(&ali_notice("2023111522001400000501", "ALLATE0001", "99.00", "TRADE_SUCCESS"));
    assert_ali_fail(&ali_post(&app, &ali), Some(404), "alipay, unknown order");
    let ali_r =
        ali_signed(&ali_refund_notice("2023111522001400000502", "ALLATE0002", "TRADE_SUCCESS", Some("ALR-LATE")));
    assert_ali_fail(&ali_post(&app, &ali_r), Some(404), "alipay refund, unknown order");
    let ali_full = ali_signed(&ali_refund_notice("2023111522001400000503", "ALLATE0003", "TRADE_CLOSED", None));
    assert_ali_fail(&ali_post(&app, &ali_full), Some(404), "alipay full refund, unknown order");
    assert_eq!(ledgers(&app), before, "nothing recorded for unknown orders");
    assert!(audit_actions(&app).is_empty());

    // The order appears (e.g. written late); the platform's retry succeeds.
    create_order(&app, "WXLATE0001", 9900);
    create_order(&app, "ALLATE0001", 9900);
    assert_wx_ok(&wx_post(&app, "/v1/callbacks/wechatpay", &wx), "wechatpay retry");
    assert_applied(&app, "WXLATE0001", "4200000001202311150501", "wechatpay", 9900);
    assert_ali_ok(&ali_post(&app, &ali), "alipay retry");
    assert_applied(&app, "ALLATE0001", "2023111522001400000501", "alipay", 9900);
}

#[test]
fn unconfigured_channels_answer_channel_not_configured() {
    let only_generic = App::open(":memory:", Clock::manual(T0_MS), config_with(false, false)).expect("open");
    create_order(&only_generic, "WXNOCONF0001", 9900);
    let wx = wx_sign(
        &keys().wx_a,
        SERIAL_A,
        T0_S,
        wx_body("TRANSACTION.SUCCESS", &wx_transaction("WXNOCONF0001", "4200000001202311150601", json!(9900))),
    );
    let ali = ali_encode(
        &ali_signed(&ali_notice("2023111522001400000601", "WXNOCONF0001", "99.00", "TRADE_SUCCESS")),
        Enc::Standard,
    );
    let before = ledgers(&only_generic);
    for (path, headers, body) in [
        ("/v1/callbacks/wechatpay", wx.headers(), wx.body.clone()),
        ("/v1/callbacks/wechatpay/refund", wx.headers(), wx.body.clone()),
        (
            "/v1/callbacks/alipay",
            vec![("Content-Type".to_owned(), "application/x-www-form-urlencoded".to_owned())],
            ali.clone(),
        ),
        (
            "/v1/callbacks/alipay/refund",
            vec![("Content-Type".to_owned(), "application/x-www-form-urlencoded".to_owned())],
            ali.clone(),
        ),
    ] {
        let resp = call(&only_generic, "POST", path, &headers, &body);
        assert_eq!(resp.status, 404, "{path}: {}", body_text(&resp));
        assert_eq!(body_json(&resp)["error"]["code"], "channel_not_configured", "{path}");
    }
    assert_eq!(ledgers(&only_generic), before);

    // Nothing configured at all: the generic channel answers the same way.
    let bare = App::open(":memory:", Clock::manual(T0_MS), Config::default()).expect("open");
    let resp = generic_post(
        &bare,
        "/v1/callbacks/generic",
        &json!({"pay_no": "P-1", "order_no": "O-1", "amount": 1, "status": "SUCCESS"}),
    );
    assert_eq!(resp.status, 404, "{}", body_text(&resp));
    assert_eq!(body_json(&resp)["error"]["code"], "channel_not_configured");

    // One platform configured does not configure the other.
    let only_alipay = App::open(":memory:", Clock::manual(T0_MS), config_with(false, true)).expect("open");
    let resp = call(&only_alipay, "POST", "/v1/callbacks/wechatpay", &wx.headers(), &wx.body);
    assert_eq!(resp.status, 404);
    assert_eq!(body_json(&resp)["error"]["code"], "channel_not_configured");
    let only_wechatpay = App::open(":memory:", Clock::manual(T0_MS), config_with(true, false)).expect("open");
    let resp = ali_post_bytes(&only_wechatpay, &ali);
    assert_eq!(resp.status, 404);
    assert_eq!(body_json(&resp)["error"]["code"], "channel_not_configured");
}

// ================================================================ end to end (the real binary)

fn now_s() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs() as i64
}

fn http_create_order(server: &Server, order_no: &str, amount: i64) {
    let resp = server.post_json("/v1/orders", &json!({"order_no": order_no, "user_id": "buyer-1", "amount": amount}));
    assert_eq!(resp.status, 201, "{}", resp.text());
}

fn raw_bodies(server: &Server) -> Vec<(String, String, Vec<u8>)> {
    let conn =
        rusqlite::Connection::open_with_flags(&server.db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).expect("open db");
    let mut stmt = conn.prepare("SELECT pay_no, channel, raw_body FROM pay_callback_log ORDER BY id").expect("prepare");
    let rows =
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).expect("query").collect::<Result<Vec<_>, _>>();
    rows.expect("rows")
}

/// One notification as sent over HTTP: its headers and its exact bytes.
struct Sent {
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Sent {
    fn post(&self, server: &Server, path: &str) -> util::HttpResponse {
        let headers: Vec<(&str, &str)> = self.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        util::request(server.addr, "POST", path, &headers, &self.body)
    }
}

impl Sent {
    /// Posted to the app in process.
    fn handle(&self, app: &App, path: &str) -> Response {
        call(app, "POST", path, &self.headers, &self.body)
    }
}

impl From<&WxNote> for Sent {
    fn from(note: &WxNote) -> Sent {
        Sent { headers: note.headers(), body: note.body.clone() }
    }
}

/// An Alipay form as the in-process cases post it (`ali_post_bytes`).
fn ali_utf8_sent(body: Vec<u8>) -> Sent {
    let content_type = "application/x-www-form-urlencoded; charset=utf-8";
    Sent { headers: vec![("Content-Type".into(), content_type.into())], body }
}

/// An Alipay notice as the platform posts it: GBK-declared form, signed.
fn ali_sent(params: &Params) -> Sent {
    let content_type = "application/x-www-form-urlencoded; charset=GBK";
    Sent { headers: vec![("Content-Type".into(), content_type.into())], body: ali_encode(params, Enc::Standard) }
}

/// A genuine payment notification, paid ten seconds ago by the system
/// clock serve runs on (inside the platform-time window, docs/decisions.md).
struct Genuine {
    order_no: &'static str,
    amount: i64,
    pay_no: &'static str,
    sent: Sent,
    /// What the platform says of it, for messages.
    what: &'static str,
}

/// A notification the binary refuses, recording nothing.
struct Refusal {
    what: &'static str,
    sent: Sent,
    status: std::ops::RangeInclusive<u16>,
    /// What only this refusal's answer says.
    check: fn(&util::HttpResponse),
}

/// One platform's side of the shared cases: how the real binary is
/// configured for it alone, its notifications, and its answers, over HTTP
/// and in process (`app()`, its manual clock at T0).
trait EndToEnd {
    const NAME: &'static str;
    /// The callback path of the platform that is not configured, and a body for it.
    const OTHER: (&'static str, &'static str, &'static [u8]);
    fn flags() -> Vec<String>;
    fn genuine() -> Vec<Genuine>;
    /// More notices of a paid trade that answer success and change nothing.
    fn repeats(server: &Server, genuine: &[Genuine]);
    /// Notices of `order_no` (amount 9900) that are refused.
    fn refusals(order_no: &str) -> Vec<Refusal>;
    fn refused_order() -> &'static str;
    fn expect_accepted(resp: &util::HttpResponse, what: &str);
    fn expect_refused(resp: &util::HttpResponse, what: &str);
    /// The platform's success answer in process.
    fn expect_ok(resp: &Response, what: &str);
    /// Its failure answer in process: `status`, or any 4xx.
    fn expect_fail(resp: &Response, status: Option<u16>, what: &str);
    /// The order and pay_no of `valid_notification_is_verified_and_applied`.
    const VALID: (&'static str, &'static str);
    /// A genuine notification of `order_no` paid as `pay_no` (9900 fen).
    fn valid(order_no: &str, pay_no: &str) -> Sent;
    /// What only this platform's answer to it carries.
    fn expect_valid_answer(resp: &Response);
    /// Fresh deliveries of the same payment (other bytes), as the platform retries.
    fn fresh_deliveries(order_no: &str, pay_no: &str) -> Vec<(&'static str, Sent)>;
    /// The order and pay_no of `tampering_is_refused_and_records_nothing`.
    const TAMPERED: (&'static str, &'static str);
    /// A genuine notification of `order_no` paid as `pay_no` (9900 fen), and
    /// it tampered with or signed otherwise: (what, notification, status).
    fn tamperings(order_no: &str, pay_no: &str) -> (Sent, Vec<(String, Sent, Option<u16>)>);
    /// Where refund results are posted.
    const REFUND_PATH: &'static str;
    /// (order_no, pay_no, refund_no) of `refund_time_is_kept_as_the_platform_settlement_time`:
    /// the refund settled, and the one whose time is not a time.
    const REFUND_TIMED: [(&'static str, &'static str, &'static str); 2];
    /// An order paid (9900 fen) with `refund_no` requested.
    fn paid_and_refunding(app: &App, order_no: &str, pay_no: &str, refund_no: &str);
    /// The refund's success with a time of the platform's own, as `app`
    /// receives it: (what, notification, [settled_at, platform_settled_at]).
    fn refund_settled(
        app: &App,
        order_no: &str,
        pay_no: &str,
        refund_no: &str,
    ) -> (&'static str, Sent, [&'static str; 2]);
    /// A refund result whose platform time is not a time.
    fn refund_time_not_a_time(order_no: &str, pay_no: &str, refund_no: &str) -> (&'static str, Sent);
    /// What only this platform keeps of refund times; `refused` is the
    /// refund of `refund_time_not_a_time`.
    fn refund_times_only_here(app: &App, refused: (&str, &str, &str));
}

struct WxEndToEnd;

fn wx_paid_note(order_no: &str, txn: &str, key: &SigningKey<Sha256>, serial: &str, paid_ago_ms: i64) -> WxNote {
    let mut transaction = wx_transaction(order_no, txn, json!(9900));
    transaction["success_time"] = json!(util::utc8_rfc3339(util::now_ms() - paid_ago_ms));
    wx_sign(key, serial, now_s(), wx_body("TRANSACTION.SUCCESS", &transaction))
}

impl EndToEnd for WxEndToEnd {
    const NAME: &'static str = "wechatpay";
    const OTHER: (&'static str, &'static str, &'static [u8]) =
        ("/v1/callbacks/alipay", "application/x-www-form-urlencoded", b"a=b");

    /// Both platform keys (rotation): a bare public key and a certificate.
    fn flags() -> Vec<String> {
        let (key_a, key_b) = (format!("{SERIAL_A}={WX_A_PUBLIC_PATH}"), format!("{SERIAL_B}={WX_B_CERT_PATH}"));
        ["--wechatpay-apiv3-key", APIV3_KEY, "--wechatpay-public-key", &key_a, "--wechatpay-public-key", &key_b]
            .map(str::to_owned)
            .to_vec()
    }

    /// Signed by either platform key: both verify and apply.
    fn genuine() -> Vec<Genuine> {
        [
            ("WXE2E00001", "4200000001202311150701", &keys().wx_a, SERIAL_A),
            ("WXE2E00002", "4200000001202311150702", &keys().wx_b, SERIAL_B),
        ]
        .into_iter()
        .map(|(order_no, pay_no, key, serial)| Genuine {
            order_no,
            amount: 9900,
            pay_no,
            sent: Sent::from(&wx_paid_note(order_no, pay_no, key, serial, 10_000)),
            what: serial,
        })
        .collect()
    }

    fn repeats(_: &Server, _: &[Genuine]) {}

    fn refused_order() -> &'static str {
        "WXE2E00003"
    }

    fn refusals(order_no: &str) -> Vec<Refusal> {
        let txn = "4200000001202311150703";
        let note = |timestamp| {
            wx_sign(
                &keys().wx_a,
                SERIAL_A,
                timestamp,
                wx_body("TRANSACTION.SUCCESS", &wx_transaction(order_no, txn, json!(9900))),
            )
        };
        // Paid 73 hours ago by its success_time (past the platform-time window).
        let stale = wx_paid_note(order_no, txn, &keys().wx_a, SERIAL_A, 73 * 3_600_000);
        let mut tampered = note(now_s());
        tampered.body[10] ^= 0x01;
        let mut probe = note(now_s());
        probe.signature = format!("WECHATPAY/SIGNTEST/{}", probe.signature);
        let expired = note(now_s() - 400);
        let no_check: fn(&util::HttpResponse) = |_| {};
        vec![
            Refusal {
                what: "paid 73 hours ago",
                sent: Sent::from(&stale),
                status: 400..=400,
                check: |resp| {
                    let message = resp.json()["message"].as_str().map(str::to_owned).unwrap_or_default();
                    assert!(message.contains("success_time"), "{}", resp.text());
                },
            },
            Refusal {
                what: "tampered",
                sent: Sent::from(&tampered),
                status: 401..=401,
                check: |resp| assert!(resp.json()["message"].as_str().is_some_and(|m| !m.is_empty())),
            },
            Refusal { what: "a signature probe", sent: Sent::from(&probe), status: 401..=401, check: no_check },
            Refusal { what: "400 s old", sent: Sent::from(&expired), status: 401..=401, check: no_check },
        ]
    }

    fn expect_accepted(resp: &util::HttpResponse, what: &str) {
        assert_eq!(resp.status, 204, "{what}: {}", resp.text());
        assert!(resp.body.is_empty(), "{what}: empty body");
    }

    /// `{"code":"FAIL"}` over HTTP.
    fn expect_refused(resp: &util::HttpResponse, what: &str) {
        assert_eq!(resp.json()["code"], "FAIL", "{what}: {}", resp.text());
    }

    fn expect_ok(resp: &Response, what: &str) {
        assert_wx_ok(resp, what);
    }

    fn expect_fail(resp: &Response, status: Option<u16>, what: &str) {
        assert_wx_fail(resp, status, what);
    }

    const VALID: (&'static str, &'static str) = ("WXORDER0001", "4200000001202311150001");

    /// Pretty-printed: the bytes signed and recorded are the bytes received,
    /// never a re-serialisation.
    fn valid(order_no: &str, pay_no: &str) -> Sent {
        let envelope =
            wx_envelope_with(APIV3_KEY, "TRANSACTION.SUCCESS", &wx_transaction(order_no, pay_no, json!(9900)), None);
        let body = serde_json::to_vec_pretty(&envelope).unwrap();
        Sent::from(&wx_sign(&keys().wx_a, SERIAL_A, T0_S, body))
    }

    /// The 204's empty body is `expect_ok`'s.
    fn expect_valid_answer(_: &Response) {}

    /// A new envelope, a new signature, the same transaction.
    fn fresh_deliveries(order_no: &str, pay_no: &str) -> Vec<(&'static str, Sent)> {
        let again = wx_sign(
            &keys().wx_a,
            SERIAL_A,
            T0_S,
            wx_body("TRANSACTION.SUCCESS", &wx_transaction(order_no, pay_no, json!(9900))),
        );
        vec![("second delivery", Sent::from(&again))]
    }

    const TAMPERED: (&'static str, &'static str) = ("WXTAMPER0001", "4200000001202311150002");

    /// Bytes, headers and keys; authentic signatures over resources payonce
    /// cannot read (4xx); each header missing.
    fn tamperings(order_no: &str, txn: &str) -> (Sent, Vec<(String, Sent, Option<u16>)>) {
        let plain = wx_transaction(order_no, txn, json!(9900));
        let body = wx_body("TRANSACTION.SUCCESS", &plain);
        let good = wx_sign(&keys().wx_a, SERIAL_A, T0_S, body.clone());
        let mut cases: Vec<(&str, WxNote, Option<u16>)> = Vec::new();
        let text = String::from_utf8(body.clone()).unwrap();
        let mut changed = good.clone();
        changed.body = text.replacen("\"EV-2018", "\"EV-2019", 1).into_bytes();
        assert_ne!(changed.body, good.body);
        cases.push(("a changed body byte (id)", changed, Some(401)));
        let mut changed = good.clone();
        changed.body = text.replacen("支付成功", "支付失败", 1).into_bytes();
        cases.push(("a changed body byte (summary)", changed, Some(401)));
        let mut changed = good.clone();
        let ct_at = text.find("\"ciphertext\":\"").unwrap() + 14;
        changed.body[ct_at] = if changed.body[ct_at] == b'A' { b'B' } else { b'A' };
        cases.push(("a changed ciphertext byte", changed, Some(401)));
        let mut changed = good.clone();
        changed.body.push(b'\n');
        cases.push(("a trailing newline added", changed, Some(401)));
        let mut changed = good.clone();
        changed.body = serde_json::to_vec_pretty(&serde_json::from_slice::<Value>(&body).unwrap()).unwrap();
        cases.push(("the same JSON re-serialised", changed, Some(401)));
        let mut changed = good.clone();
        changed.timestamp = (T0_S + 1).to_string();
        cases.push(("a changed Wechatpay-Timestamp", changed, Some(401)));
        let mut changed = good.clone();
        changed.nonce = format!("{}X", &good.nonce[..good.nonce.len() - 1]);
        cases.push(("a changed Wechatpay-Nonce", changed, Some(401)));
        let mut changed = good.clone();
        changed.serial = SERIAL_B.into();
        cases.push(("signed by a, serial of b", changed, Some(401)));
        let mut changed = good.clone();
        changed.serial = "PUB_KEY_ID_0000000000000000000000000000".into();
        cases.push(("an unknown serial", changed, Some(401)));
        let mut changed = good.clone();
        changed.serial = String::new();
        cases.push(("an empty serial", changed, Some(401)));
        let mut changed = good.clone();
        changed.signature = String::new();
        cases.push(("an empty signature", changed, Some(401)));
        let mut changed = good.clone();
        changed.signature = "not base64!".into();
        cases.push(("a signature that is not base64", changed, Some(401)));
        cases.push((
            "signed by platform b, serial of a",
            wx_sign(&keys().wx_b, SERIAL_A, T0_S, body.clone()),
            Some(401),
        ));
        cases.push(("signed by merchant_other", wx_sign(&keys().other, SERIAL_A, T0_S, body.clone()), Some(401)));
        cases.push((
            "signed by the alipay platform key",
            wx_sign(&keys().alipay, SERIAL_A, T0_S, body.clone()),
            Some(401),
        ));
        let mut probe = good.clone();
        probe.signature = format!("WECHATPAY/SIGNTEST/{}", good.signature);
        cases.push(("a WECHATPAY/SIGNTEST/ probe", probe, Some(401)));
        let mut probe = good.clone();
        probe.signature = "WECHATPAY/SIGNTEST/AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA".into();
        cases.push(("a WECHATPAY/SIGNTEST/ probe (random)", probe, Some(401)));
        // Authentic signatures over resources payonce cannot read.
        let other_key = wx_envelope_with(OTHER_APIV3_KEY, "TRANSACTION.SUCCESS", &plain, None).to_string().into_bytes();
        cases.push((
            "a resource encrypted with another APIv3 key",
            wx_sign(&keys().wx_a, SERIAL_A, T0_S, other_key),
            None,
        ));
        let other_aad =
            wx_envelope_with(APIV3_KEY, "TRANSACTION.SUCCESS", &plain, Some("refund")).to_string().into_bytes();
        cases.push((
            "associated_data not the one encrypted with",
            wx_sign(&keys().wx_a, SERIAL_A, T0_S, other_aad),
            None,
        ));
        let mut cases: Vec<(String, Sent, Option<u16>)> =
            cases.iter().map(|(what, note, status)| ((*what).to_owned(), Sent::from(note), *status)).collect();
        // Headers missing altogether.
        for missing in ["Wechatpay-Serial", "Wechatpay-Timestamp", "Wechatpay-Nonce", "Wechatpay-Signature"] {
            let headers: Vec<(String, String)> = good.headers().into_iter().filter(|(n, _)| n != missing).collect();
            cases.push((format!("without {missing}"), Sent { headers, body: good.body.clone() }, Some(401)));
        }
        (Sent::from(&good), cases)
    }

    const REFUND_PATH: &'static str = "/v1/callbacks/wechatpay/refund";
    const REFUND_TIMED: [(&'static str, &'static str, &'static str); 2] =
        [("WXRTIME001", "4200000001202311150041", "WXRT-0001"), ("WXRTIME003", "4200000001202311150043", "WXRT-0003")];

    fn paid_and_refunding(app: &App, order_no: &str, txn: &str, refund_no: &str) {
        wx_paid_and_refunding(app, order_no, txn, refund_no);
    }

    /// A minute after T0 by payonce's clock; WeChat's success_time 25 s before it.
    fn refund_settled(
        app: &App,
        order_no: &str,
        txn: &str,
        refund_no: &str,
    ) -> (&'static str, Sent, [&'static str; 2]) {
        app.clock().advance_ms(60_000);
        let mut refund = wx_refund(order_no, txn, refund_no, "SUCCESS");
        refund["success_time"] = json!("2023-11-15T06:13:55+08:00");
        let note = wx_sign(&keys().wx_b, SERIAL_B, T0_S + 60, wx_body("REFUND.SUCCESS", &refund));
        ("REFUND.SUCCESS", Sent::from(&note), ["2023-11-14T22:14:20.000Z", "2023-11-14T22:13:55.000Z"])
    }

    fn refund_time_not_a_time(order_no: &str, txn: &str, refund_no: &str) -> (&'static str, Sent) {
        let mut refund = wx_refund(order_no, txn, refund_no, "SUCCESS");
        refund["success_time"] = json!("2023-11-15 06:20:00");
        let note = wx_sign(&keys().wx_b, SERIAL_B, T0_S + 60, wx_body("REFUND.SUCCESS", &refund));
        ("success_time not RFC 3339", Sent::from(&note))
    }

    /// A failed refund has no platform settlement time, whatever the resource carries.
    fn refund_times_only_here(app: &App, _: (&str, &str, &str)) {
        wx_paid_and_refunding(app, "WXRTIME002", "4200000001202311150042", "WXRT-0002");
        let note = wx_refund_note("WXRTIME002", "4200000001202311150042", "WXRT-0002", "REFUND.CLOSED", "CLOSED");
        assert_wx_ok(&wx_post(app, "/v1/callbacks/wechatpay/refund", &note), "REFUND.CLOSED");
        assert_eq!(refund_times(app, "WXRT-0002").1, None);
    }
}

struct AliEndToEnd;

fn ali_paid_notice(order_no: &str, pay_no: &str, yuan: &str) -> Params {
    let mut notice = ali_notice(pay_no, order_no, yuan, "TRADE_SUCCESS");
    set(&mut notice, "gmt_payment", &util::alipay_time(util::now_ms() - 10_000));
    notice
}

impl EndToEnd for AliEndToEnd {
    const NAME: &'static str = "alipay";
    const OTHER: (&'static str, &'static str, &'static [u8]) = ("/v1/callbacks/wechatpay", "application/json", b"{}");

    fn flags() -> Vec<String> {
        ["--alipay-public-key", ALIPAY_PUBLIC_PATH, "--alipay-app-id", ALIPAY_APP_ID].map(str::to_owned).to_vec()
    }

    /// A GBK notice with a Chinese subject.
    fn genuine() -> Vec<Genuine> {
        let mut notice = ali_paid_notice("ALE2E00001", "2023111522001400000801", "123.45");
        set(&mut notice, "charset", "gbk");
        let sent = ali_sent(&ali_signed(&notice));
        vec![Genuine { order_no: "ALE2E00001", amount: 12345, pay_no: "2023111522001400000801", sent, what: "GBK" }]
    }

    /// TRADE_FINISHED of the same trade: one payment.
    fn repeats(server: &Server, genuine: &[Genuine]) {
        let mut finished = ali_paid_notice(genuine[0].order_no, genuine[0].pay_no, "123.45");
        set(&mut finished, "charset", "gbk");
        set(&mut finished, "trade_status", "TRADE_FINISHED");
        let resp = ali_sent(&ali_signed(&finished)).post(server, "/v1/callbacks/alipay");
        assert_eq!((resp.status, resp.text()), (200, "success".to_owned()));
    }

    fn refused_order() -> &'static str {
        "ALE2E00002"
    }

    /// A valid signature over a bad time or amount (400), a wrong app_id
    /// and a tampered value (4xx).
    fn refusals(order_no: &str) -> Vec<Refusal> {
        let pay_no = "2023111522001400000802";
        let mut ahead = ali_notice(pay_no, order_no, "99.00", "TRADE_SUCCESS");
        set(&mut ahead, "gmt_payment", &util::alipay_time(util::now_ms() + 10 * 60_000));
        let bad_amount = ali_notice(pay_no, order_no, "99.001", "TRADE_SUCCESS");
        let mut other_app = ali_notice(pay_no, order_no, "99.00", "TRADE_SUCCESS");
        set(&mut other_app, "app_id", "2021000000000002");
        let mut tampered = ali_signed(&ali_notice(pay_no, order_no, "99.00", "TRADE_SUCCESS"));
        set(&mut tampered, "total_amount", "0.01");
        let no_check: fn(&util::HttpResponse) = |_| {};
        vec![
            Refusal {
                what: "gmt_payment 10 min ahead",
                sent: ali_sent(&ali_signed(&ahead)),
                status: 400..=400,
                check: no_check,
            },
            Refusal { what: "99.001", sent: ali_sent(&ali_signed(&bad_amount)), status: 400..=400, check: no_check },
            Refusal {
                what: "another app_id",
                sent: ali_sent(&ali_signed(&other_app)),
                status: 400..=499,
                check: no_check,
            },
            Refusal { what: "tampered", sent: ali_sent(&tampered), status: 400..=499, check: no_check },
        ]
    }

    fn expect_accepted(resp: &util::HttpResponse, what: &str) {
        assert_eq!((resp.status, resp.text()), (200, "success".to_owned()), "{what}");
    }

    fn expect_refused(resp: &util::HttpResponse, what: &str) {
        assert_eq!(resp.text(), "failure", "{what}");
    }

    fn expect_ok(resp: &Response, what: &str) {
        assert_ali_ok(resp, what);
    }

    fn expect_fail(resp: &Response, status: Option<u16>, what: &str) {
        assert_ali_fail(resp, status, what);
    }

    const VALID: (&'static str, &'static str) = ("ALORDER0001", "2023111522001400000001");

    fn valid(order_no: &str, pay_no: &str) -> Sent {
        let signed = ali_signed(&ali_notice(pay_no, order_no, "99.00", "TRADE_SUCCESS"));
        ali_utf8_sent(ali_encode(&signed, Enc::Standard))
    }

    /// `success` in plain text.
    fn expect_valid_answer(resp: &Response) {
        assert!(
            resp.headers.iter().any(|(n, v)| n.eq_ignore_ascii_case("Content-Type") && v.starts_with("text/plain")),
            "plain text: {:?}",
            resp.headers
        );
    }

    /// Alipay retries with the same bytes until it reads `success`.
    fn fresh_deliveries(_: &str, _: &str) -> Vec<(&'static str, Sent)> {
        Vec::new()
    }

    const TAMPERED: (&'static str, &'static str) = ("ALTAMPER0001", "2023111522001400000002");

    /// Fields changed after signing; validly signed, but not for this
    /// merchant or not by Alipay; GBK signed over UTF-8 (each a 4xx).
    fn tamperings(order_no: &str, trade_no: &str) -> (Sent, Vec<(String, Sent, Option<u16>)>) {
        let notice = ali_notice(trade_no, order_no, "99.00", "TRADE_SUCCESS");
        let good = ali_signed(&notice);
        let mut cases: Vec<(&str, Vec<u8>, Option<u16>)> = Vec::new();
        let after_signing = |f: &dyn Fn(&mut Params)| {
            let mut p = good.clone();
            f(&mut p);
            ali_encode(&p, Enc::Standard)
        };
        cases.push(("total_amount changed", after_signing(&|p| set(p, "total_amount", "0.01")), None));
        cases.push(("receipt_amount changed", after_signing(&|p| set(p, "receipt_amount", "0.01")), None));
        cases.push(("subject changed", after_signing(&|p| set(p, "subject", "测试商品 Test Good")), None));
        cases.push(("out_trade_no changed", after_signing(&|p| set(p, "out_trade_no", "ALTAMPER0002")), None));
        cases.push(("trade_status changed", after_signing(&|p| set(p, "trade_status", "TRADE_FINISHED")), None));
        cases.push(("charset changed", after_signing(&|p| set(p, "charset", "gbk")), None));
        cases.push(("a field added", after_signing(&|p| set(p, "hb_fq_num", "3")), None));
        cases.push(("a field removed", after_signing(&|p| remove(p, "buyer_id")), None));
        cases.push(("a field emptied", after_signing(&|p| set(p, "buyer_id", "")), None));
        cases.push(("refund_fee added", after_signing(&|p| set(p, "refund_fee", "99.00")), None));
        cases.push(("app_id changed after signing", after_signing(&|p| set(p, "app_id", "2021000000000002")), None));
        cases.push(("sign removed", after_signing(&|p| remove(p, "sign")), None));
        cases.push((
            "sign corrupted",
            after_signing(&|p| {
                let s = get(p, "sign").unwrap().to_owned();
                let first = if s.as_bytes()[0] == b'A' { "B" } else { "A" };
                let flipped = format!("{first}{}", &s[1..]);
                set(p, "sign", &flipped)
            }),
            None,
        ));
        cases.push(("sign not base64", after_signing(&|p| set(p, "sign", "not base64!")), None));
        cases.push(("sign_type RSA", after_signing(&|p| set(p, "sign_type", "RSA")), None));
        let mut twice = ali_encode(&good, Enc::Standard);
        twice.extend_from_slice(b"&total_amount=0.01");
        cases.push(("total_amount twice", twice, None));
        // Signed correctly, but not for this merchant / not by Alipay.
        let mut other_app = notice.clone();
        set(&mut other_app, "app_id", "2021000000000002");
        set(&mut other_app, "auth_app_id", "2021000000000002");
        cases.push(("wrong app_id, validly signed", ali_encode(&ali_signed(&other_app), Enc::Standard), None));
        let mut no_app = notice.clone();
        remove(&mut no_app, "app_id");
        cases.push(("no app_id, validly signed", ali_encode(&ali_signed(&no_app), Enc::Standard), None));
        cases.push((
            "signed by merchant_other",
            ali_encode(&ali_signed_by(&keys().other, &notice), Enc::Standard),
            None,
        ));
        cases.push((
            "signed by a wechatpay key",
            ali_encode(&ali_signed_by(&keys().wx_a, &notice), Enc::Standard),
            None,
        ));
        // A GBK notice whose signature was computed over the UTF-8 bytes.
        let mut gbk = notice.clone();
        set(&mut gbk, "charset", "gbk");
        let utf8_sign = rsa_sign(&keys().alipay, ali_content(&gbk).as_bytes());
        let mut wrong_charset = gbk.clone();
        set(&mut wrong_charset, "sign", &utf8_sign);
        cases.push(("gbk notice signed over UTF-8 bytes", ali_encode(&wrong_charset, Enc::Standard), None));
        let cases =
            cases.into_iter().map(|(what, body, status)| (what.to_owned(), ali_utf8_sent(body), status)).collect();
        (ali_utf8_sent(ali_encode(&good, Enc::Standard)), cases)
    }

    const REFUND_PATH: &'static str = "/v1/callbacks/alipay";
    const REFUND_TIMED: [(&'static str, &'static str, &'static str); 2] = [
        ("ALRTIME0001", "2023111522001400001101", "ALRT-0001"),
        ("ALRTIME0002", "2023111522001400001102", "ALRT-0002"),
    ];

    fn paid_and_refunding(app: &App, order_no: &str, trade_no: &str, refund_no: &str) {
        ali_paid_and_refunding(app, order_no, trade_no, refund_no);
    }

    /// ali_refund_notice carries gmt_refund 2023-11-15 06:20:00.123 (Beijing), with milliseconds.
    fn refund_settled(
        _: &App,
        order_no: &str,
        trade_no: &str,
        refund_no: &str,
    ) -> (&'static str, Sent, [&'static str; 2]) {
        let notice = ali_signed(&ali_refund_notice(trade_no, order_no, "TRADE_SUCCESS", Some(refund_no)));
        (
            "refund notice",
            ali_utf8_sent(ali_encode(&notice, Enc::Standard)),
            ["2023-11-14T22:13:20.000Z", "2023-11-14T22:20:00.123Z"],
        )
    }

    fn refund_time_not_a_time(order_no: &str, trade_no: &str, _: &str) -> (&'static str, Sent) {
        let mut p = ali_refund_notice(trade_no, order_no, "TRADE_CLOSED", None);
        set(&mut p, "gmt_refund", "2023/11/15 06:20");
        ("gmt_refund not a time", ali_utf8_sent(ali_encode(&ali_signed(&p), Enc::Standard)))
    }

    /// Without milliseconds too: the refused refund, its gmt_refund a time.
    fn refund_times_only_here(app: &App, (order_no, trade_no, refund_no): (&str, &str, &str)) {
        let mut p = ali_refund_notice(trade_no, order_no, "TRADE_CLOSED", None);
        set(&mut p, "gmt_refund", "2023-11-15 06:21:00");
        assert_ali_ok(&ali_post(app, &ali_signed(&p)), "gmt_refund without milliseconds");
        assert_eq!(refund_times(app, refund_no).1.as_deref(), Some("2023-11-14T22:21:00.000Z"));
    }
}

/// Each case over every platform: `<case>::wechatpay`, `<case>::alipay`.
macro_rules! for_each_platform {
    ($($case:ident),*) => {
        $(
            mod $case {
                #[test]
                fn wechatpay() {
                    super::$case::<super::WxEndToEnd>()
                }

                #[test]
                fn alipay() {
                    super::$case::<super::AliEndToEnd>()
                }
            }
        )*
    };
}

for_each_platform!(
    through_the_binary,
    valid_notification_is_verified_and_applied,
    tampering_is_refused_and_records_nothing,
    refund_time_is_kept_as_the_platform_settlement_time
);

/// The real binary configured for one platform: genuine notifications are
/// applied once (coupon, points), refused ones record nothing and leave the
/// order PENDING, the log holds the exact bytes of the genuine ones, and
/// the other platform is not configured.
fn through_the_binary<P: EndToEnd>() {
    let mut flags = P::flags();
    flags.extend(["--coupon", "NEW10", "--points-per-yuan", "1"].map(str::to_owned));
    let server = Server::start(&flags.iter().map(String::as_str).collect::<Vec<_>>());
    let path = format!("/v1/callbacks/{}", P::NAME);
    let genuine = P::genuine();
    for paid in &genuine {
        http_create_order(&server, paid.order_no, paid.amount);
        P::expect_accepted(&paid.sent.post(&server, &path), paid.what);
        let detail = server.get(&format!("/v1/orders/{}", paid.order_no)).json();
        assert_eq!(detail["status"], "PAID", "{detail}");
        let payment = &detail["payments"][0];
        assert_eq!((&payment["channel"], &payment["outcome"]), (&json!(P::NAME), &json!("applied")), "{detail}");
        assert_eq!(payment["amount"], paid.amount, "{detail}");
        assert_eq!(detail["coupons"].as_array().map(Vec::len), Some(1), "{detail}");
        assert_eq!(detail["points"][0]["points"], paid.amount / 100, "{detail}");
    }
    P::repeats(&server, &genuine);
    let refused = P::refused_order();
    http_create_order(&server, refused, 9900);
    for refusal in P::refusals(refused) {
        let resp = refusal.sent.post(&server, &path);
        assert!(refusal.status.contains(&resp.status), "{}: {} {}", refusal.what, resp.status, resp.text());
        P::expect_refused(&resp, refusal.what);
        (refusal.check)(&resp);
    }
    assert_eq!(server.get(&format!("/v1/orders/{refused}")).json()["status"], "PENDING");
    let logged: Vec<(String, String, Vec<u8>)> =
        genuine.iter().map(|g| (g.pay_no.to_owned(), P::NAME.to_owned(), g.sent.body.clone())).collect();
    assert_eq!(raw_bodies(&server), logged, "the exact bytes of the genuine notifications, nothing else");
    let (other, content_type, body) = P::OTHER;
    let resp = util::request(server.addr, "POST", other, &[("Content-Type", content_type)], body);
    assert_eq!(resp.status, 404);
    assert_eq!(resp.error_code(), "channel_not_configured");
}

/// In process: a genuine notification is verified and applied, its exact
/// bytes recorded; the same notification again, or delivered afresh, is a
/// duplicate that still answers success.
fn valid_notification_is_verified_and_applied<P: EndToEnd>() {
    let app = app();
    let path = format!("/v1/callbacks/{}", P::NAME);
    let (order_no, pay_no) = P::VALID;
    create_order(&app, order_no, 9900);
    let sent = P::valid(order_no, pay_no);
    let resp = sent.handle(&app, &path);
    P::expect_ok(&resp, "valid notification");
    P::expect_valid_answer(&resp);
    assert_applied(&app, order_no, pay_no, P::NAME, 9900);
    let rows = callback_rows(&app);
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].channel.as_str(), rows[0].pay_no.as_str()), (P::NAME, pay_no));
    assert_eq!((rows[0].amount, rows[0].outcome.as_str()), (9900, "applied"));
    assert_eq!(rows[0].raw_body, sent.body, "raw_body is the exact bytes received");
    // The platform retries: a redelivery is a duplicate, still a success.
    let before = ledgers(&app);
    P::expect_ok(&sent.handle(&app, &path), "redelivery");
    for (what, fresh) in P::fresh_deliveries(order_no, pay_no) {
        P::expect_ok(&fresh.handle(&app, &path), what);
    }
    assert_eq!(ledgers(&app), before, "duplicates change nothing");
}

/// In process: each tampered or otherwise signed notification is refused
/// with the platform's failure answer and records nothing; the genuine one
/// then still verifies and applies.
fn tampering_is_refused_and_records_nothing<P: EndToEnd>() {
    let app = app();
    let path = format!("/v1/callbacks/{}", P::NAME);
    let (order_no, pay_no) = P::TAMPERED;
    create_order(&app, order_no, 9900);
    let (good, cases) = P::tamperings(order_no, pay_no);
    let before = ledgers(&app);
    for (what, sent, status) in &cases {
        P::expect_fail(&sent.handle(&app, &path), *status, what);
        assert_eq!(ledgers(&app), before, "{what}: nothing recorded");
    }
    assert_pending_untouched(&app, order_no);
    // The genuine notification still verifies and applies.
    P::expect_ok(&good.handle(&app, &path), "genuine");
    assert_applied(&app, order_no, pay_no, P::NAME, 9900);
}

/// In process: a refund result's own time is kept as the refund's platform
/// settlement time beside payonce's settled_at; one that is not a time is
/// refused and changes nothing.
fn refund_time_is_kept_as_the_platform_settlement_time<P: EndToEnd>() {
    let app = app();
    let [settled, refused] = P::REFUND_TIMED;
    let (order_no, pay_no, refund_no) = settled;
    P::paid_and_refunding(&app, order_no, pay_no, refund_no);
    let (what, sent, [settled_at, platform_settled_at]) = P::refund_settled(&app, order_no, pay_no, refund_no);
    P::expect_ok(&sent.handle(&app, P::REFUND_PATH), what);
    assert_refunded(&app, order_no, refund_no);
    assert_eq!(
        refund_times(&app, refund_no),
        (Some(settled_at.to_owned()), Some(platform_settled_at.to_owned())),
        "settled_at is payonce's clock, platform_settled_at the platform's own time"
    );
    let (order_no, pay_no, refund_no) = refused;
    P::paid_and_refunding(&app, order_no, pay_no, refund_no);
    let before = ledgers(&app);
    let (what, sent) = P::refund_time_not_a_time(order_no, pay_no, refund_no);
    P::expect_fail(&sent.handle(&app, P::REFUND_PATH), Some(400), what);
    assert_eq!(ledgers(&app), before);
    P::refund_times_only_here(&app, refused);
}

// ================================================================ platform times (docs/decisions.md)

#[test]
fn wechatpay_and_alipay_payment_times_are_windowed_and_refund_notices_are_not() {
    use payonce::domain::{PLATFORM_TIME_AFTER_MS_MAX, PLATFORM_TIME_BEFORE_MS_MAX};
    let app = app();
    let (earliest, latest) = (T0_MS - PLATFORM_TIME_BEFORE_MS_MAX, T0_MS + PLATFORM_TIME_AFTER_MS_MAX);

    // WeChat Pay: success_time a second outside [received - 72 h, received + 5 min].
    let (order_no, txn) = ("WXWINDOW001", "4200000001202311159001");
    create_order(&app, order_no, 9900);
    let paid_at = |ms: i64| {
        let mut transaction = wx_transaction(order_no, txn, json!(9900));
        transaction["success_time"] = json!(util::utc8_rfc3339(ms));
        wx_sign(&keys().wx_a, SERIAL_A, T0_S, wx_body("TRANSACTION.SUCCESS", &transaction))
    };
    for outside in [earliest - 1000, latest + 1000] {
        let resp = wx_post(&app, "/v1/callbacks/wechatpay", &paid_at(outside));
        assert_wx_fail(&resp, Some(400), "success_time outside the window");
        let message = body_json(&resp)["message"].as_str().unwrap_or_default().to_owned();
        assert!(message.contains("success_time"), "names the field: {message}");
        assert_pending_untouched(&app, order_no);
    }
    assert_wx_ok(&wx_post(&app, "/v1/callbacks/wechatpay", &paid_at(earliest)), "72 h before, to the second");
    assert_applied(&app, order_no, txn, "wechatpay", 9900);
    // Its refund notice carries a time of its own, not windowed.
    request_refund(&app, order_no, "WXWR-001");
    let mut refund = wx_refund(order_no, txn, "WXWR-001", "SUCCESS");
    refund["success_time"] = json!("2001-01-01T00:00:00+08:00");
    let note = wx_sign(&keys().wx_b, SERIAL_B, T0_S, wx_body("REFUND.SUCCESS", &refund));
    assert_wx_ok(&wx_post(&app, "/v1/callbacks/wechatpay/refund", &note), "an old refund success_time");
    assert_eq!(refund_status(&app, "WXWR-001"), "SUCCEEDED");

    // Alipay: gmt_payment likewise; the refund notice carries the original
    // payment's gmt_payment and is not windowed.
    let (order_no, trade_no) = ("ALWINDOW001", "2023111522001400009001");
    create_order(&app, order_no, 9900);
    let notice = |ms: i64| {
        let mut notice = ali_notice(trade_no, order_no, "99.00", "TRADE_SUCCESS");
        set(&mut notice, "gmt_payment", &util::alipay_time(ms));
        ali_signed(&notice)
    };
    for outside in [earliest - 1000, latest + 1000] {
        assert_ali_fail(&ali_post(&app, &notice(outside)), Some(400), "gmt_payment outside the window");
        assert_pending_untouched(&app, order_no);
    }
    assert_ali_ok(&ali_post(&app, &notice(latest)), "5 min after, to the second");
    assert_applied(&app, order_no, trade_no, "alipay", 9900);
    request_refund(&app, order_no, "ALWR-001");
    let mut refund = ali_refund_notice(trade_no, order_no, "TRADE_SUCCESS", Some("ALWR-001"));
    set(&mut refund, "gmt_payment", "2001-01-01 00:00:00");
    assert_ali_ok(&ali_post(&app, &ali_signed(&refund)), "a refund notice with an old gmt_payment");
    assert_refunded(&app, order_no, "ALWR-001");
}

// ================================================================ issue 16: serials, empty values, refund times

/// (settled_at, platform_settled_at) of a refund row.
fn refund_times(app: &App, refund_no: &str) -> (Option<String>, Option<String>) {
    let conn = app.store().raw_connection().expect("raw connection");
    conn.query_row("SELECT settled_at, platform_settled_at FROM refund WHERE refund_no = ?1", [refund_no], |r| {
        Ok((r.get(0)?, r.get(1)?))
    })
    .expect("refund row")
}

/// `wechatpayv3` compares serials as numbers and may send them in lower
/// case; the serial's case carries nothing.
#[test]
fn wechatpay_serials_match_in_any_case() {
    let app = app();
    let cases = [
        (&keys().wx_b, SERIAL_B.to_ascii_lowercase(), "a certificate serial in lower case"),
        (&keys().wx_a, SERIAL_A.to_ascii_lowercase(), "a PUB_KEY_ID_ in lower case"),
        (&keys().wx_b, format!("{}{}", &SERIAL_B[..20].to_ascii_lowercase(), &SERIAL_B[20..]), "mixed case"),
    ];
    for (n, (key, serial, what)) in cases.into_iter().enumerate() {
        let (order_no, txn) = (format!("WXCASE{n:04}"), format!("42000000012023111500{n:02}"));
        create_order(&app, &order_no, 9900);
        let note =
            wx_sign(key, &serial, T0_S, wx_body("TRANSACTION.SUCCESS", &wx_transaction(&order_no, &txn, json!(9900))));
        assert_wx_ok(&wx_post(&app, "/v1/callbacks/wechatpay", &note), what);
        assert_applied(&app, &order_no, &txn, "wechatpay", 9900);
    }
    // Case is all that is forgiven: another serial, or the right serial with
    // the other platform's key, is still refused.
    create_order(&app, "WXCASE0099", 9900);
    let body = || wx_body("TRANSACTION.SUCCESS", &wx_transaction("WXCASE0099", "4200000001202311150099", json!(9900)));
    let before = ledgers(&app);
    let unknown_serial = SERIAL_B.replace('A', "B").to_ascii_lowercase();
    let unknown = wx_sign(&keys().wx_b, &unknown_serial, T0_S, body());
    let refused = wx_post(&app, "/v1/callbacks/wechatpay", &unknown);
    assert_wx_fail(&refused, Some(401), "an unknown serial");
    // The answer (and the log line) name the serial that arrived: the
    // operator's way to a key given under the wrong serial.
    let message = body_json(&refused)["message"].as_str().unwrap_or_default().to_owned();
    assert!(message.contains(&unknown_serial), "the unknown serial is named: {message}");
    let crossed = wx_sign(&keys().wx_a, &SERIAL_B.to_ascii_lowercase(), T0_S, body());
    assert_wx_fail(&wx_post(&app, "/v1/callbacks/wechatpay", &crossed), Some(401), "serial b, key a");
    assert_eq!(ledgers(&app), before);
    assert_pending_untouched(&app, "WXCASE0099");
}

/// Alipay's string to sign as its Java SDK (`getSignCheckContentV1`) and
/// python-alipay-sdk build it: sorted `k=v` except sign and sign_type, empty
/// values kept as `k=`.
fn ali_content_keeping_empty(params: &Params) -> String {
    let mut pairs: Vec<&(String, String)> = params.iter().filter(|(k, _)| k != "sign" && k != "sign_type").collect();
    pairs.sort();
    pairs.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&")
}

fn ali_signed_keeping_empty(params: &Params) -> Params {
    let mut params = params.clone();
    remove(&mut params, "sign");
    let content = ali_content_keeping_empty(&params);
    let sign = rsa_sign(&keys().alipay, &in_charset(&content, is_gbk(&params)));
    params.push(("sign".into(), sign));
    params
}

#[test]
fn alipay_notices_verify_with_empty_values_kept_or_skipped() {
    let app = app();
    let mut n = 0;
    let mut notice = |empty: &[&str]| {
        n += 1;
        let (order_no, trade_no) = (format!("ALEMPTY{n:04}"), format!("20231115220014000009{n:02}"));
        create_order(&app, &order_no, 9900);
        let mut p = ali_notice(&trade_no, &order_no, "99.00", "TRADE_SUCCESS");
        for key in empty {
            set(&mut p, key, "");
        }
        (order_no, trade_no, p)
    };
    // Signed with the empty values kept (Java SDK): refused before issue 16.
    for charset in ["utf-8", "gbk"] {
        let (order_no, trade_no, mut p) = notice(&["passback_params", "voucher_detail_list"]);
        set(&mut p, "charset", charset);
        let signed = ali_signed_keeping_empty(&p);
        assert!(ali_content_keeping_empty(&signed).contains("passback_params=&"), "the empty value is signed");
        assert_ali_ok(&ali_post(&app, &signed), &format!("{charset}: empty values kept in the signed string"));
        assert_applied(&app, &order_no, &trade_no, "alipay", 9900);
    }
    // Signed with them left out (PHP SDK), as before.
    let (order_no, trade_no, p) = notice(&["passback_params", "voucher_detail_list"]);
    assert_ali_ok(&ali_post(&app, &ali_signed(&p)), "empty values left out of the signed string");
    assert_applied(&app, &order_no, &trade_no, "alipay", 9900);

    // Neither string is a loophole: tampered or signed by another key, refused.
    let (order_no, _, p) = notice(&["passback_params"]);
    let before = ledgers(&app);
    let mut tampered = ali_signed_keeping_empty(&p);
    set(&mut tampered, "total_amount", "0.01");
    assert_ali_fail(&ali_post(&app, &tampered), Some(401), "an amount changed after a keep-empty signature");
    let mut filled = ali_signed_keeping_empty(&p);
    set(&mut filled, "passback_params", "x");
    assert_ali_fail(&ali_post(&app, &filled), Some(401), "an empty value filled in after signing");
    let mut dropped = ali_signed_keeping_empty(&p);
    remove(&mut dropped, "passback_params");
    assert_ali_fail(&ali_post(&app, &dropped), Some(401), "an empty value dropped after a keep-empty signature");
    let mut other = p.clone();
    remove(&mut other, "sign");
    let sign = rsa_sign(&keys().other, ali_content_keeping_empty(&other).as_bytes());
    other.push(("sign".into(), sign));
    assert_ali_fail(&ali_post(&app, &other), Some(401), "keep-empty string signed by merchant_other");
    assert_eq!(ledgers(&app), before);
    assert_pending_untouched(&app, &order_no);
}

/// An empty value is an absent one: `refund_fee=`, `out_biz_no=` and
/// `gmt_refund=` never make a notice a refund, however it was signed.
#[test]
fn alipay_empty_refund_fields_are_absent() {
    let app = app();
    for (n, keep_empty) in [(1, true), (2, false)] {
        let (order_no, trade_no) = (format!("ALABSENT{n:04}"), format!("20231115220014000010{n:02}"));
        create_order(&app, &order_no, 9900);
        let sign = |p: &Params| if keep_empty { ali_signed_keeping_empty(p) } else { ali_signed(p) };
        let mut p = ali_notice(&trade_no, &order_no, "99.00", "TRADE_SUCCESS");
        for key in ["refund_fee", "out_biz_no", "gmt_refund"] {
            set(&mut p, key, "");
        }
        assert_ali_ok(&ali_post(&app, &sign(&p)), "a payment with empty refund fields");
        assert_applied(&app, &order_no, &trade_no, "alipay", 9900);
        // TRADE_CLOSED with empty refund fields is an unpaid close: nothing changes.
        request_refund(&app, &order_no, &format!("ALABR-{n:04}"));
        let before = ledgers(&app);
        set(&mut p, "trade_status", "TRADE_CLOSED");
        assert_ali_ok(&ali_post(&app, &sign(&p)), "TRADE_CLOSED with empty refund fields");
        assert_eq!(ledgers(&app), before, "not a refund result");
        assert_eq!(status_of(&app, &order_no), "REFUNDING");
        // A real refund result with an empty out_biz_no settles the refund in
        // flight; an empty gmt_refund leaves no platform time.
        set(&mut p, "refund_fee", "99.00");
        assert_ali_ok(&ali_post(&app, &sign(&p)), "refund_fee with empty out_biz_no and gmt_refund");
        assert_eq!(status_of(&app, &order_no), "REFUNDED");
        let times = refund_times(&app, &format!("ALABR-{n:04}"));
        assert!(times.0.is_some() && times.1.is_none(), "{times:?}");
    }
}

// ---------------------------------------------------------------- currency, over sockets

/// Currency is part of the amount (docs/channels.md): a WeChat Pay
/// notification of 9900 USD does not pay a CNY order of 9900, nor 9900 CNY
/// a USD order; a generic notice naming another currency is refused alike,
/// and one naming none is in the order's currency (v1).
#[test]
fn a_payment_in_another_currency_is_amount_mismatch() {
    use crate::util::{request, Server};
    let apiv3 = format!("--wechatpay-apiv3-key={APIV3_KEY}");
    let server = Server::start(&[
        "--wechatpay-public-key",
        &format!("{SERIAL_A}={WX_A_PUBLIC_PATH}"),
        &apiv3,
        "--coupon",
        "NEW10",
    ]);
    let now_ms = crate::util::now_ms();
    let create = |order_no: &str, currency: &str| {
        let body = json!({"order_no": order_no, "user_id": "u1", "amount": 9900, "currency": currency});
        let created = server.post_json("/v1/orders", &body);
        assert_eq!(created.status, 201, "{}", created.text());
    };
    let wechatpay = |order_no: &str, transaction_id: &str, currency: &str| {
        let mut plain = wx_transaction(order_no, transaction_id, json!(9900));
        plain["amount"]["currency"] = json!(currency);
        plain["success_time"] = json!(crate::util::utc8_rfc3339(now_ms));
        let note = wx_sign(&keys().wx_a, SERIAL_A, now_ms / 1000, wx_body("TRANSACTION.SUCCESS", &plain));
        let headers = note.headers();
        let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        let answer = request(server.addr, "POST", "/v1/callbacks/wechatpay", &headers, &note.body);
        assert_eq!(answer.status, 204, "{}", answer.text());
    };
    let outcome_of = |order_no: &str| {
        let detail = server.get(&format!("/v1/orders/{order_no}")).json();
        (detail["status"].as_str().unwrap_or_default().to_owned(), detail["payments"][0]["outcome"].clone(), detail)
    };

    create("ORD-CNY-1", "CNY");
    wechatpay("ORD-CNY-1", "4200000001202401010000000001", "USD");
    let (status, outcome, detail) = outcome_of("ORD-CNY-1");
    assert_eq!((status.as_str(), outcome), ("PENDING", json!("amount_mismatch")), "9900 USD for 9900 CNY: {detail}");
    assert_eq!(detail["coupons"], json!([]), "{detail}");

    create("ORD-USD-1", "USD");
    wechatpay("ORD-USD-1", "4200000001202401010000000002", "CNY");
    let (status, outcome, detail) = outcome_of("ORD-USD-1");
    assert_eq!((status.as_str(), outcome), ("PENDING", json!("amount_mismatch")), "9900 CNY for 9900 USD: {detail}");
    wechatpay("ORD-USD-1", "4200000001202401010000000003", "USD");
    assert_eq!(outcome_of("ORD-USD-1").0, "PAID", "its own currency pays it");

    create("ORD-GEN-1", "CNY");
    let generic = |order_no: &str, pay_no: &str, currency: Option<&str>| {
        let mut body = json!({"pay_no": pay_no, "order_no": order_no, "amount": 9900, "status": "SUCCESS"});
        if let Some(currency) = currency {
            body["currency"] = json!(currency);
        }
        server.callback("/v1/callbacks/generic", &body)
    };
    assert_eq!(generic("ORD-GEN-1", "GEN-PAY-1", Some("USD")).json()["outcome"], "amount_mismatch");
    let refused = generic("ORD-GEN-1", "GEN-PAY-2", Some("cny"));
    assert_eq!((refused.status, refused.error_code().as_str()), (400, "invalid_request"), "{}", refused.text());
    assert_eq!(generic("ORD-GEN-1", "GEN-PAY-3", None).json()["outcome"], "applied", "v1: none named is the order's");
    create("ORD-GEN-2", "USD");
    assert_eq!(generic("ORD-GEN-2", "GEN-PAY-4", Some("USD")).json()["outcome"], "applied");
}
