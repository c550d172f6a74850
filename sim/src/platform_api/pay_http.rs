//! `POST /v1/orders/{order_no}/pay` over payonce's own HTTP edge, in this
//! process, against these servers over real sockets (docs/platforms.md,
//! "Paying"): a triple click is one prepay call and one trade, answered
//! alike; the JSAPI and app signatures verify with the merchant's public
//! key as WeChat's client SDKs verify them; a payment is answered again
//! within `--prepay-reuse-s` and refreshed once after it, by the same
//! request for the same trade. Across processes and through a SIGKILL:
//! sim/tests/prepay.rs.

use super::tests::keys;
use super::*;
use crate::local::LocalServer;
use base64::Engine;
use payonce::platform_ops::Platforms;
use payonce::platforms::alipay::AlipayApi;
use payonce::platforms::wechatpay::WechatpayApi;
use payonce::platforms::{MerchantKey, Platform as Parts, Registry};
use payonce::{App, Clock, Config};
use rsa::pkcs1v15::{Signature, VerifyingKey};
use rsa::pkcs8::DecodePrivateKey;
use rsa::signature::Verifier;
use serde_json::{json, Value};
use sha2::Sha256;
use std::sync::Barrier;
use std::time::Instant;

/// The merchant's key: the 2048-bit fixture (ring signs with no less), a
/// private key; its public half is derived here, as the platform holds it.
const MERCHANT_KEY_PEM: &str = include_str!("../../../tests/fixtures/keys/merchant.pem");
const MERCHANT_SERIAL: &str = "SIMULATOR-MERCHANT";
const PUBLIC_BASE_URL: &str = "https://shop.example";
const TIMEOUT: Duration = Duration::from_secs(5);
const HTTP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the platform holds the one call the three clicks meet.
const HELD: Duration = Duration::from_millis(400);

fn merchant_public_key() -> RsaPublicKey {
    RsaPrivateKey::from_pkcs8_pem(MERCHANT_KEY_PEM).expect("the fixture key").to_public_key()
}

/// payonce on `:memory:` behind its HTTP edge, paying at a simulated WeChat
/// Pay and Alipay that expect its notify_urls, as `payonce serve
/// --public-base-url https://shop.example --wechatpay-appid ...` would.
struct Shop {
    payonce: LocalServer,
    wechatpay: PlatformApi,
    alipay: PlatformApi,
}

fn shop(clock: Clock, prepay_reuse_ms: i64) -> Shop {
    let wechatpay = PlatformApi::start_wechatpay(WechatpayApiConfig {
        platform_key: Some(keys().wechatpay_platform.clone()),
        expected_notify_url: Some(format!("{PUBLIC_BASE_URL}/v1/callbacks/wechatpay")),
        ..WechatpayApiConfig::new(MERCHANT_SERIAL, merchant_public_key())
    })
    .expect("WeChat Pay starts");
    let alipay = PlatformApi::start_alipay(AlipayApiConfig {
        alipay_key: Some(keys().alipay_platform.clone()),
        expected_notify_url: Some(format!("{PUBLIC_BASE_URL}/v1/callbacks/alipay")),
        ..AlipayApiConfig::new(merchant_public_key())
    })
    .expect("Alipay starts");
    let key = || MerchantKey::from_pem(MERCHANT_KEY_PEM).expect("the merchant key");
    let mut wechatpay_client = WechatpayApi::new(
        wechatpay.merchant_id().to_owned(),
        MERCHANT_SERIAL.to_owned(),
        key(),
        &wechatpay.endpoint(),
        vec![(wechatpay.platform_serial().expect("serial").to_owned(), wechatpay.platform_public_key().clone())],
        TIMEOUT,
    );
    wechatpay_client.appids = vec![WECHATPAY_APPID.to_owned()];
    let alipay_client = AlipayApi::new(
        alipay.merchant_id().to_owned(),
        key(),
        &alipay.endpoint(),
        alipay.platform_public_key().clone(),
        TIMEOUT,
    );
    let platforms = Platforms {
        registry: Registry::with([Parts::calls(wechatpay_client), Parts::calls(alipay_client)]),
        timeout_ms: u64::try_from(TIMEOUT.as_millis()).expect("ms"),
        public_base_url: Some(PUBLIC_BASE_URL.to_owned()),
        prepay_reuse_ms,
        ..Platforms::default()
    };
    let app = App::open(":memory:", clock, Config { platforms, ..Config::default() }).expect("payonce");
    let payonce = LocalServer::serve(Arc::new(app)).expect("payonce serves");
    Shop { payonce, wechatpay, alipay }
}

impl Shop {
    fn call(&self, method: &str, path: &str, body: &Value) -> (u16, Vec<u8>) {
        let text = body.to_string();
        let headers = [("Content-Type", "application/json")];
        let reply =
            payonce_testclient::request(self.payonce.addr, method, path, &headers, text.as_bytes(), HTTP_TIMEOUT)
                .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        (reply.status, reply.body)
    }

    fn order(&self, order_no: &str) {
        let body =
            json!({"order_no": order_no, "user_id": "u1", "amount": 990, "currency": "CNY", "expires_in_s": 3600});
        let (status, answer) = self.call("POST", "/v1/orders", &body);
        assert_eq!(status, 201, "{}", String::from_utf8_lossy(&answer));
    }

    /// `POST /v1/orders/{order_no}/pay`: the status and the exact bytes answered.
    fn pay(&self, order_no: &str, body: &Value) -> (u16, Vec<u8>) {
        self.call("POST", &format!("/v1/orders/{order_no}/pay"), body)
    }

    /// The order's platform calls of kind `prepay`: (channel, status, attempts).
    fn prepay_rows(&self, order_no: &str) -> Vec<(String, String, i64)> {
        let detail = self.payonce.app.orders().order(order_no).expect("the order");
        let prepays = detail.platform_calls.iter().filter(|c| c.kind.as_str() == "prepay");
        prepays.map(|c| (c.channel.clone(), c.status.as_str().to_owned(), c.attempts)).collect()
    }
}

fn json_of(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(bytes)))
}

/// Three pay requests released at once; each one's status, bytes and time taken.
fn triple_click(shop: &Shop, order_no: &str, body: &Value) -> Vec<(u16, Vec<u8>, Duration)> {
    let barrier = Barrier::new(3);
    std::thread::scope(|scope| {
        let clicks: Vec<_> = (0..3)
            .map(|_| {
                scope.spawn(|| {
                    barrier.wait();
                    let started = Instant::now();
                    let (status, bytes) = shop.pay(order_no, body);
                    (status, bytes, started.elapsed())
                })
            })
            .collect();
        clicks.into_iter().map(|c| c.join().expect("a click")).collect()
    })
}

/// The bodies of the prepay calls the platform received, in order.
fn prepay_bodies(api: &PlatformApi, is_prepay: impl Fn(&Call) -> bool) -> Vec<Value> {
    api.calls().into_iter().filter(|c| is_prepay(c)).map(|c| c.body).collect()
}

fn assert_one_call_three_alike(api: &PlatformApi, clicks: &[(u16, Vec<u8>, Duration)], key: &str) {
    for (status, bytes, took) in clicks {
        assert_eq!(*status, 200, "{}", String::from_utf8_lossy(bytes));
        // Each click met the one call in flight: none answered before the platform did.
        assert!(*took >= HELD - Duration::from_millis(50), "answered in {took:?}, before the held call ended");
    }
    assert!(clicks.iter().all(|(_, bytes, _)| *bytes == clicks[0].1), "three identical bodies");
    assert_eq!((api.prepay_calls(), api.trades()), (1, 1), "one call reached the platform, one trade");
    let payment = &json_of(&clicks[0].1)["payment"];
    assert!(payment[key].as_str().is_some_and(|v| !v.is_empty()), "{payment}");
}

#[test]
fn a_triple_click_is_one_wechatpay_prepay_and_three_identical_answers() {
    let shop = shop(Clock::System, 60_000);
    shop.order("ORD_TRIPLE_WX");
    shop.wechatpay.fail_next(Fault::Delay(HELD), 1);
    let clicks = triple_click(&shop, "ORD_TRIPLE_WX", &json!({"channel": "wechatpay", "method": "native"}));
    assert_one_call_three_alike(&shop.wechatpay, &clicks, "code_url");
    let trade = shop.wechatpay.trade("ORD_TRIPLE_WX").expect("the trade");
    assert_eq!((trade.trade_type.as_str(), trade.amount), ("NATIVE", 990));
    assert_eq!(trade.notify_url.as_deref(), Some("https://shop.example/v1/callbacks/wechatpay"));
    assert_eq!(trade.appid.as_deref(), Some(WECHATPAY_APPID));
    assert_eq!(shop.prepay_rows("ORD_TRIPLE_WX"), [("wechatpay".to_owned(), "done".to_owned(), 1)]);
    assert_eq!(shop.alipay.calls().len(), 0, "Alipay is not asked");
}

#[test]
fn a_triple_click_is_one_alipay_precreate_and_three_identical_answers() {
    let shop = shop(Clock::System, 60_000);
    shop.order("ORD_TRIPLE_ALI");
    shop.alipay.fail_next(Fault::Delay(HELD), 1);
    let clicks = triple_click(&shop, "ORD_TRIPLE_ALI", &json!({"channel": "alipay", "method": "precreate"}));
    assert_one_call_three_alike(&shop.alipay, &clicks, "qr_code");
    let trade = shop.alipay.trade("ORD_TRIPLE_ALI").expect("the trade");
    assert_eq!((trade.trade_type.as_str(), trade.amount), ("alipay.trade.precreate", 990));
    assert_eq!(shop.prepay_rows("ORD_TRIPLE_ALI"), [("alipay".to_owned(), "done".to_owned(), 1)]);
    assert_eq!(shop.wechatpay.calls().len(), 0, "WeChat Pay is not asked");
}

/// SHA256withRSA by the merchant's key, checked with its public half only.
fn merchant_signed(message: &str, signature: &str) -> bool {
    let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(signature) else { return false };
    let Ok(signature) = Signature::try_from(bytes.as_slice()) else { return false };
    VerifyingKey::<Sha256>::new(merchant_public_key()).verify(message.as_bytes(), &signature).is_ok()
}

#[test]
fn the_jsapi_pay_sign_and_the_app_sign_verify_with_the_merchant_public_key() {
    let shop = shop(Clock::System, 60_000);
    shop.order("ORD_JSAPI_SIGN");
    let (status, bytes) =
        shop.pay("ORD_JSAPI_SIGN", &json!({"channel": "wechatpay", "method": "jsapi", "openid": "oBuyer0001"}));
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let payment = &json_of(&bytes)["payment"];
    let prepay_id = payment["prepay_id"].as_str().expect("prepay_id");
    let p = &payment["client_params"];
    let field = |name: &str| p[name].as_str().unwrap_or_else(|| panic!("{name} in {p}")).to_owned();
    assert_eq!(field("appId"), WECHATPAY_APPID);
    assert_eq!(field("package"), format!("prepay_id={prepay_id}"));
    assert_eq!(field("signType"), "RSA");
    let message = format!("{}\n{}\n{}\n{}\n", field("appId"), field("timeStamp"), field("nonceStr"), field("package"));
    assert!(merchant_signed(&message, &field("paySign")), "paySign over {message:?}");
    assert!(!merchant_signed(&message.replace("prepay_id=", "prepay_id=x"), &field("paySign")), "it can fail");
    let jsapi = shop.wechatpay.calls().into_iter().find(|c| c.api == "/v3/pay/transactions/jsapi").expect("called");
    assert_eq!(jsapi.body["payer"]["openid"], "oBuyer0001");

    shop.order("ORD_APP_SIGN");
    let (status, bytes) = shop.pay("ORD_APP_SIGN", &json!({"channel": "wechatpay", "method": "app"}));
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let payment = &json_of(&bytes)["payment"];
    let p = &payment["client_params"];
    let field = |name: &str| p[name].as_str().unwrap_or_else(|| panic!("{name} in {p}")).to_owned();
    assert_eq!(field("prepayid"), payment["prepay_id"].as_str().expect("prepay_id"));
    assert_eq!(
        (field("appid"), field("partnerid"), field("package")),
        (WECHATPAY_APPID.into(), "1900000100".into(), "Sign=WXPay".into())
    );
    let message = format!("{}\n{}\n{}\n{}\n", field("appid"), field("timestamp"), field("noncestr"), field("prepayid"));
    assert!(merchant_signed(&message, &field("sign")), "sign over {message:?}");
    assert!(!merchant_signed(&message.replacen('\n', "\n0", 1), &field("sign")), "it can fail");
    assert_eq!((shop.wechatpay.prepay_calls(), shop.wechatpay.trades()), (2, 2));
}

#[test]
fn a_payment_is_reused_within_prepay_reuse_and_refreshed_after_it_with_the_same_request() {
    let clock = Clock::manual(Clock::System.now_ms());
    let reuse_ms = 60_000;
    let shop = shop(clock.clone(), reuse_ms);
    shop.order("ORD_REUSE");
    let body = json!({"channel": "wechatpay", "method": "native"});
    let (status, first) = shop.pay("ORD_REUSE", &body);
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&first));
    clock.advance_ms(reuse_ms - 1_000);
    let (status, again) = shop.pay("ORD_REUSE", &body);
    assert_eq!((status, &again), (200, &first), "within --prepay-reuse-s: the same bytes, no call");
    assert_eq!(shop.wechatpay.prepay_calls(), 1);

    clock.advance_ms(2_000);
    let (status, refreshed) = shop.pay("ORD_REUSE", &body);
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&refreshed));
    assert_eq!(shop.wechatpay.prepay_calls(), 2, "past it: one call refreshes the payment");
    let bodies = prepay_bodies(&shop.wechatpay, |c| c.api == "/v3/pay/transactions/native");
    assert_eq!(bodies.len(), 2);
    assert_eq!(bodies[0]["out_trade_no"], "ORD_REUSE");
    assert_eq!(bodies[1], bodies[0], "the same request: every body field alike, time_expire included");
    assert_eq!(shop.wechatpay.trades(), 1, "one trade");
    let (first, refreshed) = (json_of(&first)["payment"].clone(), json_of(&refreshed)["payment"].clone());
    assert_eq!(refreshed["code_url"], first["code_url"], "the platform answers its trade's code_url again");
    assert!(refreshed["created_at"].as_str() > first["created_at"].as_str(), "{first} then {refreshed}");
    assert_eq!(refreshed["expires_at"], first["expires_at"]);
    assert_eq!(shop.prepay_rows("ORD_REUSE"), [("wechatpay".to_owned(), "done".to_owned(), 2)]);
    let (status, reused) = shop.pay("ORD_REUSE", &body);
    assert_eq!((status, json_of(&reused)["payment"].clone()), (200, refreshed), "the refreshed one is reused");
    assert_eq!(shop.wechatpay.prepay_calls(), 2);
}
