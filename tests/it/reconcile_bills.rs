//! Reconciliation against the platforms' real bill types (docs/channels.md,
//! docs/operations.md; issue 16), with the fixture bills of `tests/fixtures/bills/`, written
//! for payonce from the formats as WeChat Pay and Alipay document them:
//!
//! - `wechatpay_all_2024-03-04.csv`: an ALL bill (交易账单, `bill_type=ALL`)
//!   with a coupon-funded order (订单金额 100.00, 代金券金额 10.00, 应结订单金额
//!   90.00) and the refund of an order paid the day before, whose row carries
//!   the payment's 交易时间;
//! - `wechatpay_success_2024-03-04.csv`: the SUCCESS bill (支付账单) of that
//!   day: no refund columns at all;
//! - `wechatpay_refund_2024-03-05.csv`: a REFUND bill (退款账单): the coupon
//!   order's refund, accepted (退款申请时间) and succeeded (退款成功时间) on the
//!   day after the payment, 申请退款金额 100.00 against 退款金额 90.00;
//! - `alipay_refunds_only_2024-03-05.csv`: an Alipay 业务明细 (GBK) that lists
//!   one refund and no payment.
//!
//! Each is reconciled against orders paid and refunded through signed
//! notifications (WeChat Pay v3 and Alipay, with the TEST-ONLY keys), on an
//! in-process App with a manual clock that follows the story, so every
//! platform time is a few minutes from payonce's own: a clean match in
//! process and `payonce reconcile` exiting 0. Then the cases where the kind
//! of statement or the dating decides: what a refund bill leaves out, what
//! an Alipay file that lists no payment still catches.

use crate::util::{TempDir, SECRET};
use aes_gcm::aead::{Aead, Payload};
use aes_gcm::{Aes256Gcm, KeyInit, Nonce};
use base64::Engine;
use payonce::api::{self, Request, Response};
use payonce::clock::parse_rfc3339_ms;
use payonce::platforms::alipay::{self, Alipay, AlipayConfig};
use payonce::platforms::generic::Generic;
use payonce::platforms::wechatpay::{self, Wechatpay, WechatpayConfig};
use payonce::platforms::{Platform, Platforms};
use payonce::recon::Format;
use payonce::{App, Clock, Config, Rewards};
use rsa::pkcs1v15::SigningKey;
use rsa::pkcs8::DecodePrivateKey;
use rsa::signature::{SignatureEncoding, Signer};
use rusqlite::{Connection, OpenFlags};
use serde_json::{json, Value};
use sha2::Sha256;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};

const WX_PUBLIC: &str = include_str!("../fixtures/TEST_ONLY_wechatpay_platform_a_public.pem");
const WX_PRIVATE: &str = include_str!("../fixtures/TEST_ONLY_wechatpay_platform_a_private.pem");
const ALIPAY_PUBLIC: &str = include_str!("../fixtures/TEST_ONLY_alipay_platform_public.pem");
const ALIPAY_PRIVATE: &str = include_str!("../fixtures/TEST_ONLY_alipay_platform_private.pem");
const WX_SERIAL: &str = "PUB_KEY_ID_TEST_BILLS";
const APIV3_KEY: &str = "TESTONLYapiv3key0123456789abcdef";
const ALIPAY_APP_ID: &str = "2021000000000016";

const WX_ALL: &str = "wechatpay_all_2024-03-04.csv";
const WX_SUCCESS: &str = "wechatpay_success_2024-03-04.csv";
const WX_REFUND: &str = "wechatpay_refund_2024-03-05.csv";
const ALIPAY_REFUNDS: &str = "alipay_refunds_only_2024-03-05.csv";

fn bill_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bills").join(name)
}

fn bill(name: &str) -> Vec<u8> {
    let path = bill_path(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn ms(text: &str) -> i64 {
    parse_rfc3339_ms(text).unwrap_or_else(|| panic!("bad time {text}"))
}

fn signing_key(pem: &str) -> SigningKey<Sha256> {
    SigningKey::<Sha256>::new(rsa::RsaPrivateKey::from_pkcs8_pem(pem).expect("test private key"))
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn config() -> Config {
    let wx = WechatpayConfig::new(
        APIV3_KEY,
        vec![(WX_SERIAL.into(), wechatpay::public_key_from_pem(WX_PUBLIC).expect("platform public key"))],
    )
    .expect("wechatpay config");
    let ali = AlipayConfig {
        public_key: alipay::public_key_from_text(ALIPAY_PUBLIC).expect("alipay public key"),
        app_id: ALIPAY_APP_ID.into(),
    };
    Config {
        platforms: Platforms::with([
            Platform::notices(Generic::new(vec![SECRET.as_bytes().to_vec()])),
            Platform::notices(Wechatpay::new(wx)),
            Platform::notices(Alipay::new(ali)),
        ]),
        rewards: Rewards { coupon_templates: vec!["NEW10".into()], points_per_yuan: 1 },
        ..Config::default()
    }
}

/// An App on a file database whose manual clock starts at `now` (UTC).
fn open_app(db: &Path, now: &str) -> App {
    App::open(&db.display().to_string(), Clock::manual(ms(now)), config()).expect("open app")
}

fn set_clock(app: &App, now: &str) {
    assert!(app.clock().set_ms(ms(now)), "a manual clock");
}

fn call(app: &App, method: &str, target: &str, headers: &[(&str, &str)], body: &[u8]) -> Response {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let headers = headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
    api::handle(
        app,
        &Request { method: method.into(), path: path.into(), query: query.into(), headers, body: body.to_vec() },
    )
}

fn text(resp: &Response) -> String {
    String::from_utf8_lossy(&resp.body).into_owned()
}

fn create_order(app: &App, order_no: &str, amount: i64) {
    let body = json!({"order_no": order_no, "user_id": "u-bills", "amount": amount}).to_string();
    let resp = call(app, "POST", "/v1/orders", &[("Content-Type", "application/json")], body.as_bytes());
    assert_eq!(resp.status, 201, "create {order_no}: {}", text(&resp));
}

fn request_refund(app: &App, order_no: &str, refund_no: &str) {
    let body = json!({ "refund_no": refund_no }).to_string();
    let path = format!("/v1/orders/{order_no}/refund");
    let resp = call(app, "POST", &path, &[("Content-Type", "application/json")], body.as_bytes());
    assert_eq!(resp.status, 200, "refund {order_no}: {}", text(&resp));
}

// ---- WeChat Pay v3 notifications, as documented: AEAD_AES_256_GCM resource, SHA256-RSA ----

fn wx_notify(app: &App, path: &str, event_type: &str, resource: &Value) {
    static N: AtomicU64 = AtomicU64::new(0);
    let aad = if event_type.starts_with("REFUND.") { "refund" } else { "transaction" };
    let nonce = format!("bills{:07}", N.fetch_add(1, Ordering::SeqCst));
    let cipher = Aes256Gcm::new_from_slice(APIV3_KEY.as_bytes()).expect("32-byte key");
    let plaintext = resource.to_string();
    let ciphertext = cipher
        .encrypt(Nonce::from_slice(nonce.as_bytes()), Payload { msg: plaintext.as_bytes(), aad: aad.as_bytes() })
        .expect("encrypt");
    let body = json!({
        "id": format!("EV-{event_type}-{}", resource["out_trade_no"].as_str().unwrap_or_default()),
        "create_time": "2024-03-04T10:00:00+08:00",
        "resource_type": "encrypt-resource",
        "event_type": event_type,
        "summary": "payonce bills",
        "resource": {"original_type": aad, "algorithm": "AEAD_AES_256_GCM", "ciphertext": b64(&ciphertext),
                     "associated_data": aad, "nonce": nonce}
    })
    .to_string();
    let timestamp = app.clock().now_ms().div_euclid(1000).to_string();
    let sign_nonce = "BILLS5K8264ILTKCH16CQ2502SI8Z";
    let message = format!("{timestamp}\n{sign_nonce}\n{body}\n");
    let signature = b64(&signing_key(WX_PRIVATE).sign(message.as_bytes()).to_bytes());
    let headers = [
        ("Content-Type", "application/json"),
        ("Wechatpay-Serial", WX_SERIAL),
        ("Wechatpay-Timestamp", timestamp.as_str()),
        ("Wechatpay-Nonce", sign_nonce),
        ("Wechatpay-Signature", signature.as_str()),
        ("Wechatpay-Signature-Type", "WECHATPAY2-SHA256-RSA2048"),
    ];
    let resp = call(app, "POST", path, &headers, body.as_bytes());
    assert_eq!(resp.status, 204, "{event_type} {resource}: {}", text(&resp));
}

/// A successful payment; `payer_total` below `total` when a coupon paid the rest.
fn wx_pay(app: &App, order_no: &str, transaction_id: &str, total: i64, payer_total: i64, success_time: &str) {
    let mut resource = json!({
        "mchid": "1900000109", "appid": "wx2421b1c4370ec43b", "out_trade_no": order_no,
        "transaction_id": transaction_id, "trade_type": "JSAPI", "trade_state": "SUCCESS",
        "trade_state_desc": "支付成功", "bank_type": "CMB_CREDIT", "attach": "", "success_time": success_time,
        "payer": {"openid": "oUpF8uMuAJO_M2pxb1Q9zNjWeS6o"},
        "amount": {"total": total, "payer_total": payer_total, "currency": "CNY", "payer_currency": "CNY"}
    });
    if payer_total < total {
        // A merchant-funded (免充值, NOCASH) coupon: settled amount = total - coupon.
        resource["promotion_detail"] = json!([{"coupon_id": "109519", "name": "payonce coupon", "scope": "GLOBALSCOPE",
            "type": "NOCASH", "amount": total - payer_total, "stock_id": "931386", "wechatpay_contribute": 0,
            "merchant_contribute": total - payer_total, "other_contribute": 0, "currency": "CNY"}]);
    }
    wx_notify(app, "/v1/callbacks/wechatpay", "TRANSACTION.SUCCESS", &resource);
}

fn wx_refunded(app: &App, order_no: &str, transaction_id: &str, refund_no: &str, total: i64, success_time: &str) {
    let resource = json!({
        "mchid": "1900000109", "out_trade_no": order_no, "transaction_id": transaction_id,
        "out_refund_no": refund_no, "refund_id": "50300509302024030400000000009", "refund_status": "SUCCESS",
        "success_time": success_time, "user_received_account": "招商银行信用卡0403",
        "amount": {"total": total, "refund": total, "payer_total": total, "payer_refund": total}
    });
    wx_notify(app, "/v1/callbacks/wechatpay/refund", "REFUND.SUCCESS", &resource);
}

// ---- Alipay notices, signed the Java SDK's way: empty values kept as `k=` ----

fn ali_notify(app: &App, params: &[(&str, &str)]) {
    let mut sorted: Vec<&(&str, &str)> = params.iter().filter(|(k, _)| *k != "sign" && *k != "sign_type").collect();
    sorted.sort();
    let content = sorted.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&");
    assert!(content.contains("passback_params=&"), "an empty value is signed: {content}");
    let sign = b64(&signing_key(ALIPAY_PRIVATE).sign(content.as_bytes()).to_bytes());
    let encode = crate::util::form_encode;
    let mut body: Vec<String> = params.iter().map(|(k, v)| format!("{k}={}", encode(v))).collect();
    body.push(format!("sign={}", encode(&sign)));
    let headers = [("Content-Type", "application/x-www-form-urlencoded; charset=utf-8")];
    let resp = call(app, "POST", "/v1/callbacks/alipay", &headers, body.join("&").as_bytes());
    assert_eq!((resp.status, text(&resp)), (200, "success".to_owned()), "{params:?}");
}

fn ali_params<'a>(trade_no: &'a str, order_no: &'a str, amount: &'a str, status: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("gmt_create", "2024-03-04 13:59:50"),
        ("charset", "utf-8"),
        ("subject", "payonce alipay order"),
        ("buyer_id", "2088102122524333"),
        ("notify_type", "trade_status_sync"),
        ("notify_id", "ac05099524730693a8b330c5ecf72da9786"),
        ("trade_status", status),
        ("app_id", ALIPAY_APP_ID),
        ("sign_type", "RSA2"),
        ("seller_id", "2088101106499364"),
        ("gmt_payment", "2024-03-04 14:00:00"),
        ("passback_params", ""),
        ("version", "1.0"),
        ("out_trade_no", order_no),
        ("total_amount", amount),
        ("trade_no", trade_no),
        ("auth_app_id", ALIPAY_APP_ID),
    ]
}

// ---- reconciling ----

fn reconcile(app: &App, format: Format, bytes: &[u8], date: Option<&str>) -> Value {
    app.operations()
        .reconcile(format, bytes, date, false, &mut |_, _| {})
        .unwrap_or_else(|e| panic!("reconcile {format:?}: {e:?}"))
        .to_json()
}

/// `payonce reconcile` on a fixture bill: (exit code, its JSON).
fn reconcile_cli(db: &Path, name: &str, format: Format, date: Option<&str>) -> (Option<i32>, Value) {
    let (db, statement) = (db.display().to_string(), bill_path(name).display().to_string());
    let mut args = vec!["reconcile", "--db", &db, "--statement", &statement, "--format", format.as_str()];
    if let Some(date) = date {
        args.extend(["--date", date]);
    }
    let out = Command::new(env!("CARGO_BIN_EXE_payonce"))
        .args(&args)
        .env_remove("PAYONCE_CALLBACK_SECRET")
        .stdin(Stdio::null())
        .output()
        .expect("run payonce reconcile");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let result = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!("reconcile printed no JSON ({e}): {stdout:?}, stderr {:?}", String::from_utf8_lossy(&out.stderr))
    });
    (out.status.code(), result)
}

fn list(result: &Value, key: &str) -> Vec<Value> {
    result[key].as_array().unwrap_or_else(|| panic!("{key} is a list: {result}")).clone()
}

/// A clean match: `matched` rows, nothing missing, no mismatch.
fn assert_clean(result: &Value, period: &[&str], compared: &[&str], matched: u64, context: &str) {
    assert_eq!(result["period"], json!(period), "{context}: period: {result}");
    assert_eq!(result["compared"], json!(compared), "{context}: compared: {result}");
    for key in ["missing_local", "missing_remote", "amount_mismatch"] {
        assert!(list(result, key).is_empty(), "{context}: {key} is empty: {result}");
    }
    assert_eq!(result["matched"].as_u64(), Some(matched), "{context}: matched: {result}");
}

fn read_only(db: &Path) -> Connection {
    Connection::open_with_flags(db, OpenFlags::SQLITE_OPEN_READ_ONLY).expect("open db read-only")
}

/// (settled_at, platform_settled_at) of a refund.
fn refund_times(db: &Path, refund_no: &str) -> (String, Option<String>) {
    read_only(db)
        .query_row(
            "SELECT settled_at, platform_settled_at FROM refund WHERE refund_no = ?1 AND status = 'SUCCEEDED'",
            [refund_no],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap_or_else(|e| panic!("refund {refund_no} succeeded: {e}"))
}

// ---- WeChat Pay: the three bill types ----

const A_TXN: &str = "4200002201202403041111111111";
const B_TXN: &str = "4200002201202403042222222222";
const C_TXN: &str = "4200002201202403033333333333";
const E_TXN: &str = "4200002201202403054444444444";

/// The local side of the WeChat bills, in Beijing time:
/// - C (30.00) paid 2024-03-03 21:59, refunded 2024-03-04 10:59 (RF-WX-C);
/// - A (100.00, of which a 10.00 coupon) paid 2024-03-04 09:59:30, and its
///   refund RF-WX-A succeeded at the platform 2024-03-05 23:55, a notice
///   payonce receives after midnight, 2024-03-06 00:05;
/// - B (25.00) paid 2024-03-04 10:00;
/// - E (12.34) paid 2024-03-05 11:59, in no bill here but the ALL bill of
///   its own day.
fn seed_wechat(db: &Path) -> App {
    let app = open_app(db, "2024-03-03T14:00:00Z");
    for (order_no, amount) in [("BILL-WX-A", 10_000), ("BILL-WX-B", 2_500), ("BILL-WX-C", 3_000), ("BILL-WX-E", 1_234)]
    {
        create_order(&app, order_no, amount);
    }
    wx_pay(&app, "BILL-WX-C", C_TXN, 3_000, 3_000, "2024-03-03T21:59:00+08:00");
    set_clock(&app, "2024-03-04T02:00:30Z");
    wx_pay(&app, "BILL-WX-A", A_TXN, 10_000, 9_000, "2024-03-04T09:59:30+08:00");
    wx_pay(&app, "BILL-WX-B", B_TXN, 2_500, 2_500, "2024-03-04T10:00:00+08:00");
    set_clock(&app, "2024-03-04T02:58:00Z");
    request_refund(&app, "BILL-WX-C", "RF-WX-C");
    set_clock(&app, "2024-03-04T02:59:20Z");
    wx_refunded(&app, "BILL-WX-C", C_TXN, "RF-WX-C", 3_000, "2024-03-04T10:59:00+08:00");
    set_clock(&app, "2024-03-05T04:00:00Z");
    wx_pay(&app, "BILL-WX-E", E_TXN, 1_234, 1_234, "2024-03-05T11:59:00+08:00");
    set_clock(&app, "2024-03-05T15:40:00Z");
    request_refund(&app, "BILL-WX-A", "RF-WX-A");
    set_clock(&app, "2024-03-05T16:05:00Z");
    wx_refunded(&app, "BILL-WX-A", A_TXN, "RF-WX-A", 10_000, "2024-03-05T23:55:00+08:00");
    app
}

#[test]
fn wechatpay_all_success_and_refund_bills_match_cleanly() {
    let dir = TempDir::new("bills-wx");
    let db = dir.path("wx.db");
    let app = seed_wechat(&db);

    // The platform's refund time is kept beside payonce's own.
    assert_eq!(
        refund_times(&db, "RF-WX-A"),
        ("2024-03-05T16:05:00.000Z".to_owned(), Some("2024-03-05T15:55:00.000Z".to_owned())),
        "settled_at is when payonce learnt it; platform_settled_at is WeChat's success_time"
    );

    // ALL: A on 订单金额 100.00 (not the 90.00 settled), B, and C's refund,
    // whose 交易时间 (the payment's, 2024-03-03) does not pull C's payment in.
    let all = reconcile(&app, Format::Wechatpay, &bill(WX_ALL), None);
    assert_clean(&all, &["2024-03-04"], &["payment", "refund"], 3, "ALL bill");

    // SUCCESS: no refund columns; C's refund on that day is not compared.
    let success = reconcile(&app, Format::Wechatpay, &bill(WX_SUCCESS), None);
    assert_clean(&success, &["2024-03-04"], &["payment"], 2, "SUCCESS bill");

    // REFUND: dated by 退款成功时间 (2024-03-05), compared on 申请退款金额
    // (100.00, not the 90.00 退款金额); E, paid that day, is not compared.
    let refund = reconcile(&app, Format::Wechatpay, &bill(WX_REFUND), None);
    assert_clean(&refund, &["2024-03-05"], &["refund"], 1, "REFUND bill");

    // payonce received RF-WX-A's notice on 2024-03-06 (Beijing); dated by
    // WeChat's success_time, it belongs to 2024-03-05, so the next day's
    // refund bill does not miss it.
    let next_day = reconcile(&app, Format::Wechatpay, &bill(WX_REFUND), Some("2024-03-06"));
    assert_clean(&next_day, &["2024-03-06"], &["refund"], 0, "REFUND bill, date=2024-03-06");

    for (name, period) in [(WX_ALL, "2024-03-04"), (WX_SUCCESS, "2024-03-04"), (WX_REFUND, "2024-03-05")] {
        let (exit, result) = reconcile_cli(&db, name, Format::Wechatpay, None);
        assert_eq!(exit, Some(0), "payonce reconcile {name}: a clean match exits 0: {result}");
        assert_eq!(result["period"], json!([period]), "{name}: {result}");
    }
}

/// What the bill's kind and its columns decide, each shown by a difference
/// payonce must (or must not) report.
#[test]
fn wechatpay_bill_kinds_decide_what_is_compared_and_coupons_are_reported() {
    let dir = TempDir::new("bills-wx-kinds");
    let db = dir.path("wx.db");
    let app = seed_wechat(&db);

    // The ALL bill of E's day, with E left out: E is missing_remote; the
    // refund bill of that day says nothing about payments.
    let header = String::from_utf8(bill(WX_ALL)).expect("UTF-8").lines().next().unwrap_or_default().to_owned();
    let empty_all = format!("{header}\r\n总交易单数,应结订单总金额,退款总金额,充值券退款总金额,手续费总金额,订单总金额,申请退款总金额\r\n`0,`0.00,`0.00,`0.00,`0.00,`0.00,`0.00\r\n");
    let result = reconcile(&app, Format::Wechatpay, empty_all.as_bytes(), Some("2024-03-05"));
    let missing = list(&result, "missing_remote");
    let mut ids: Vec<&str> = missing.iter().filter_map(|r| r["pay_no"].as_str()).collect();
    ids.sort();
    assert_eq!(ids, [E_TXN, "RF-WX-A"], "an empty ALL bill misses E and A's refund: {result}");
    assert_eq!(result["compared"], json!(["payment", "refund"]));

    // A coupon-funded order the platform has and payonce does not: reported
    // with its order amount and the coupon's share.
    let all = String::from_utf8(bill(WX_ALL)).expect("UTF-8");
    let foreign = all.replace("BILL-WX-A", "BILL-WX-Z").replace(A_TXN, "4200002201202403049999999999");
    let result = reconcile(&app, Format::Wechatpay, foreign.as_bytes(), None);
    let missing_local = list(&result, "missing_local");
    assert_eq!(missing_local.len(), 1, "{result}");
    assert_eq!(
        missing_local[0],
        json!({"kind": "payment", "channel": "wechatpay", "pay_no": "4200002201202403049999999999", "order_no": "BILL-WX-Z",
               "amount_platform": 10_000, "amount_local": null, "coupon_amount": 1_000}),
        "{result}"
    );
    // A's own row now unlisted: missing_remote (the bill is ALL).
    assert!(list(&result, "missing_remote").iter().any(|r| r["pay_no"] == A_TXN), "{result}");
    // A row without a coupon carries no coupon_amount.
    let plain = all.replace(B_TXN, "4200002201202403048888888888");
    let result = reconcile(&app, Format::Wechatpay, plain.as_bytes(), None);
    let row = &list(&result, "missing_local")[0];
    assert!(row.get("coupon_amount").is_none(), "no coupon, no coupon_amount: {row}");

    // A refund still PROCESSING at the platform moved no money yet.
    let processing =
        String::from_utf8(bill(WX_REFUND)).expect("UTF-8").replace("`ORIGINAL,`SUCCESS,", "`ORIGINAL,`PROCESSING,");
    let result = reconcile(&app, Format::Wechatpay, processing.as_bytes(), Some("2024-03-05"));
    assert_eq!(result["matched"], 0, "{result}");
    assert!(list(&result, "missing_local").is_empty(), "{result}");
    assert_eq!(list(&result, "missing_remote").len(), 1, "payonce's settled RF-WX-A is not in it: {result}");

    // A refund bill that only has 退款金额 (no 申请退款金额) is compared on it:
    // the coupon share makes A's refund differ.
    let refund = String::from_utf8(bill(WX_REFUND)).expect("UTF-8");
    let without: Vec<String> = refund
        .lines()
        .map(|line| {
            let mut fields: Vec<&str> = line.split(',').collect();
            if fields.len() == 29 {
                fields.remove(27); // 申请退款金额
            }
            fields.join(",")
        })
        .collect();
    let result = reconcile(&app, Format::Wechatpay, without.join("\r\n").as_bytes(), None);
    assert_eq!(
        list(&result, "amount_mismatch"),
        [
            json!({"kind": "refund", "channel": "wechatpay", "pay_no": "RF-WX-A", "order_no": "BILL-WX-A", "amount_platform": 9_000,
                "amount_local": 10_000})
        ],
        "{result}"
    );

    // A SUCCESS bill that lists a refund contradicts itself.
    let success = String::from_utf8(bill(WX_SUCCESS)).expect("UTF-8").replacen("`SUCCESS,", "`REFUND,", 1);
    let err = app
        .operations()
        .reconcile(Format::Wechatpay, success.as_bytes(), None, false, &mut |_, _| {})
        .expect_err("refused");
    assert!(err.message.contains("line 2"), "{err:?}");

    // Compressed downloads are named as such.
    for (bytes, word) in [(&b"\x1f\x8b\x08\x00rest"[..], "gzip"), (&b"PK\x03\x04rest"[..], "zip")] {
        let err =
            app.operations().reconcile(Format::Wechatpay, bytes, None, false, &mut |_, _| {}).expect_err("refused");
        assert!(err.message.contains(word), "{err:?}");
    }
}

// ---- Alipay: 业务明细 declares no kind ----

const F_TRADE: &str = "2024030422001400001111111111";

#[test]
fn alipay_refunds_only_file_matches_and_still_compares_payments() {
    let dir = TempDir::new("bills-alipay");
    let db = dir.path("alipay.db");
    let app = open_app(&db, "2024-03-04T06:00:05Z");
    create_order(&app, "BILL-AL-F", 5_880);
    create_order(&app, "BILL-AL-G", 1_990);
    ali_notify(&app, &ali_params(F_TRADE, "BILL-AL-F", "58.80", "TRADE_SUCCESS"));
    set_clock(&app, "2024-03-05T15:50:00Z");
    request_refund(&app, "BILL-AL-F", "RF-AL-F");
    // Alipay's refund notice: refund_fee, out_biz_no, and gmt_refund with
    // milliseconds, 2024-03-05 23:58 Beijing; payonce receives it after midnight.
    set_clock(&app, "2024-03-05T16:03:00Z");
    let mut refund = ali_params(F_TRADE, "BILL-AL-F", "58.80", "TRADE_CLOSED");
    refund.extend([("refund_fee", "58.80"), ("out_biz_no", "RF-AL-F"), ("gmt_refund", "2024-03-05 23:58:00.456")]);
    ali_notify(&app, &refund);
    assert_eq!(
        refund_times(&db, "RF-AL-F"),
        ("2024-03-05T16:03:00.000Z".to_owned(), Some("2024-03-05T15:58:00.456Z".to_owned())),
        "gmt_refund is kept as the refund's platform time"
    );

    let file = bill(ALIPAY_REFUNDS);
    let result = reconcile(&app, Format::Alipay, &file, None);
    assert_clean(&result, &["2024-03-05"], &["payment", "refund"], 1, "refunds-only 业务明细");
    // The refund belongs to 2024-03-05 by gmt_refund, not to the day payonce heard of it.
    let next_day = reconcile(&app, Format::Alipay, &file, Some("2024-03-06"));
    assert_clean(&next_day, &["2024-03-06"], &["payment", "refund"], 0, "date=2024-03-06");
    let (exit, cli) = reconcile_cli(&db, ALIPAY_REFUNDS, Format::Alipay, None);
    assert_eq!(exit, Some(0), "payonce reconcile on the refunds-only file: {cli}");

    // A generic payment of that day is another platform's money: an Alipay
    // statement does not list it and does not report it.
    set_clock(&app, "2024-03-05T16:10:00Z");
    let body = json!({"pay_no": "FORGED-G", "order_no": "BILL-AL-G", "amount": 1_990, "status": "SUCCESS",
                      "paid_at": "2024-03-05T23:59:00+08:00"})
    .to_string();
    let signature = payonce::signature::sign(SECRET.as_bytes(), app.clock().now_ms().div_euclid(1000), body.as_bytes());
    let headers = [("Content-Type", "application/json"), ("Payonce-Signature", signature.as_str())];
    let resp = call(&app, "POST", "/v1/callbacks/generic", &headers, body.as_bytes());
    assert_eq!(resp.status, 200, "{}", text(&resp));
    let result = reconcile(&app, Format::Alipay, &file, None);
    assert_clean(&result, &["2024-03-05"], &["payment", "refund"], 1, "a generic payment is not Alipay's");
    // An Alipay payment the platform never made, applied on that day (a
    // forged notice, dated 23:59): the file lists no payment, yet it
    // declares no kind, so payments are compared and it is missing_remote.
    create_order(&app, "BILL-AL-H", 1_990);
    let mut forged = ali_params("2024030522001499990000000001", "BILL-AL-H", "19.90", "TRADE_SUCCESS");
    for param in forged.iter_mut().filter(|(name, _)| *name == "gmt_payment") {
        param.1 = "2024-03-05 23:59:00";
    }
    ali_notify(&app, &forged);
    let result = reconcile(&app, Format::Alipay, &file, None);
    assert_eq!(
        list(&result, "missing_remote"),
        [json!({"kind": "payment", "channel": "alipay", "pay_no": "2024030522001499990000000001",
                "order_no": "BILL-AL-H", "amount_platform": null, "amount_local": 1_990})],
        "{result}"
    );
    assert_eq!(result["matched"], 1, "{result}");
    let (exit, cli) = reconcile_cli(&db, ALIPAY_REFUNDS, Format::Alipay, None);
    assert_eq!(exit, Some(1), "a difference: exit 1: {cli}");
}

/// Currency is part of the amount compared (docs/channels.md): a WeChat
/// bill row in USD for a CNY payment is `amount_mismatch`, and repairing a
/// USD row for a CNY order records `amount_mismatch`, never a payment.
#[test]
fn a_statement_row_in_another_currency_is_amount_mismatch() {
    let server = crate::util::Server::start(&[]);
    let now_ms = crate::util::now_ms();
    let day = crate::util::utc8_rfc3339(now_ms);
    let (date, time) = (&day[..10], &day[11..19]);
    for order_no in ["BILL-CUR-A", "BILL-CUR-B"] {
        let body = serde_json::json!({"order_no": order_no, "user_id": "u1", "amount": 2500});
        assert_eq!(server.post_json("/v1/orders", &body).status, 201);
    }
    let paid = server.callback(
        "/v1/callbacks/generic",
        &serde_json::json!({"pay_no": "4200002201202403049999999991", "order_no": "BILL-CUR-A", "amount": 2500,
                            "status": "SUCCESS"}),
    );
    assert_eq!(paid.json()["outcome"], "applied", "{}", paid.text());
    let header = "交易时间,公众账号ID,商户号,特约商户号,设备号,微信订单号,商户订单号,用户标识,交易类型,交易状态,付款银行,货币种类,应结订单金额,代金券金额,商品名称,商户数据包,手续费,费率,订单金额,费率备注";
    let row = |pay_no: &str, order_no: &str, currency: &str| {
        format!(
            "`{date} {time},`wx2421b1c4370ec43b,`1900000109,`0,`,`{pay_no},`{order_no},`oUpF8u,`JSAPI,`SUCCESS,`OTHERS,`{currency},`25.00,`0.00,`order,`,`0.15,`0.60%,`25.00,`"
        )
    };
    let statement = |currency: &str| {
        format!(
            "{header}\n{}\n{}\n",
            row("4200002201202403049999999991", "BILL-CUR-A", currency),
            row("4200002201202403049999999992", "BILL-CUR-B", currency)
        )
    };
    let post = |query: &str, text: &str| {
        let answer = crate::util::request(
            server.addr,
            "POST",
            &format!("/v1/reconciliations?format=wechatpay&date={date}{query}"),
            &[("Content-Type", "text/csv")],
            text.as_bytes(),
        );
        assert_eq!(answer.status, 200, "{}", answer.text());
        answer.json()
    };
    let same = post("", &statement("CNY"));
    assert_eq!(same["matched"], 1, "{same}");
    let other = post("&repair=true", &statement("USD"));
    assert_eq!(other["matched"], 0, "{other}");
    let mismatched: Vec<&str> =
        other["amount_mismatch"].as_array().into_iter().flatten().filter_map(|r| r["pay_no"].as_str()).collect();
    assert_eq!(mismatched, ["4200002201202403049999999991"], "{other}");
    assert_eq!(other["repaired"][0]["outcome"], "amount_mismatch", "25.00 USD never pays 25.00 CNY: {other}");
    assert_eq!(server.get("/v1/orders/BILL-CUR-B").json()["status"], "PENDING");
}
