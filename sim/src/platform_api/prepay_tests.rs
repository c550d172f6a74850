//! Making trades: payonce's own prepay client (docs/platforms.md, "Paying")
//! against these servers over real sockets, and requests signed here for
//! what payonce's client would never send. Every trade comes from a prepay
//! or a request the buyer opened; none from `open_trade`.

use super::tests::{ali_form, ali_post, ali_response, json_of, keys, wx_verified, WxSigner, MERCHANT_SERIAL};
use super::*;
use payonce::platforms::alipay::AlipayApi;
use payonce::platforms::wechatpay::WechatpayApi;
use payonce::platforms::{Calls, CloseAnswer, MerchantKey, PrepayAnswer, PrepayRequest};
use rsa::pkcs8::DecodePrivateKey;
use serde_json::json;
use std::time::Instant;

/// payonce's merchant key: the 2048-bit fixture (ring signs with no less).
const MERCHANT_KEY_PEM: &str = include_str!("../../../tests/fixtures/keys/merchant.pem");
const TIMEOUT: Duration = Duration::from_millis(1_000);
const NOTIFY_WECHATPAY: &str = "https://shop.example/v1/callbacks/wechatpay";
const NOTIFY_ALIPAY: &str = "https://shop.example/v1/callbacks/alipay";
/// A second appid bound to the simulator's merchant (a mini program beside the web one).
const SECOND_APPID: &str = "wxsimulatorminiprog";

fn merchant_key() -> RsaPrivateKey {
    RsaPrivateKey::from_pkcs8_pem(MERCHANT_KEY_PEM).expect("the fixture key")
}

struct Wx {
    api: PlatformApi,
    client: WechatpayApi,
}

/// A WeChat Pay expecting payonce's notify_url, with two appids, and
/// payonce's client pointed at it.
fn wechatpay() -> Wx {
    let config = WechatpayApiConfig {
        platform_key: Some(keys().wechatpay_platform.clone()),
        appids: vec![WECHATPAY_APPID.to_owned(), SECOND_APPID.to_owned()],
        expected_notify_url: Some(NOTIFY_WECHATPAY.to_owned()),
        ..WechatpayApiConfig::new(MERCHANT_SERIAL, merchant_key().to_public_key())
    };
    let api = PlatformApi::start_wechatpay(config).expect("WeChat Pay starts");
    let key = payonce::platforms::wechatpay::public_key_from_pem(&api.platform_public_key_pem().expect("pem"))
        .expect("WeChat Pay's key");
    let client = WechatpayApi::new(
        api.merchant_id().to_owned(),
        MERCHANT_SERIAL.to_owned(),
        MerchantKey::from_pem(MERCHANT_KEY_PEM).expect("merchant key"),
        &api.base_url(),
        vec![(api.platform_serial().expect("serial").to_owned(), key)],
        TIMEOUT,
    );
    Wx { api, client }
}

struct Ali {
    api: PlatformApi,
    client: AlipayApi,
}

fn alipay() -> Ali {
    let config = AlipayApiConfig {
        alipay_key: Some(keys().alipay_platform.clone()),
        expected_notify_url: Some(NOTIFY_ALIPAY.to_owned()),
        ..AlipayApiConfig::new(merchant_key().to_public_key())
    };
    let api = PlatformApi::start_alipay(config).expect("Alipay starts");
    let key = payonce::platforms::alipay::public_key_from_text(&api.platform_public_key_pem().expect("pem"))
        .expect("Alipay's key");
    let client = AlipayApi::new(
        api.merchant_id().to_owned(),
        MerchantKey::from_pem(MERCHANT_KEY_PEM).expect("merchant key"),
        &api.endpoint(),
        key,
        TIMEOUT,
    );
    Ali { api, client }
}

/// A 9.90 CNY order expiring in 15 minutes, paid by `method`.
fn request<'a>(order_no: &'a str, method: &'a str, notify_url: &'a str) -> PrepayRequest<'a> {
    PrepayRequest {
        order_no,
        amount: 990,
        currency: "CNY",
        description: "Tea",
        expires_at_ms: now_ms() + 15 * 60_000,
        notify_url,
        method,
        appid: Some(WECHATPAY_APPID),
        openid: Some("oBuyerOpenid0001"),
        client_ip: Some("203.0.113.7"),
        return_url: Some("https://shop.example/paid"),
    }
}

fn wx_request<'a>(order_no: &'a str, method: &'a str) -> PrepayRequest<'a> {
    request(order_no, method, NOTIFY_WECHATPAY)
}

fn ali_request<'a>(order_no: &'a str, method: &'a str) -> PrepayRequest<'a> {
    request(order_no, method, NOTIFY_ALIPAY)
}

/// The one text field of a created payment, or a panic naming what came instead.
fn created(answer: &PrepayAnswer, key: &str) -> String {
    match answer {
        PrepayAnswer::Created(payment) => payment.fields[key].as_str().expect(key).to_owned(),
        other => panic!("not created: {other:?}"),
    }
}

fn refused(answer: &PrepayAnswer) -> (String, String) {
    match answer {
        PrepayAnswer::Refused { code, message } => (code.clone(), message.clone()),
        other => panic!("not refused: {other:?}"),
    }
}

// ---- WeChat Pay ----

#[test]
fn every_wechatpay_method_makes_its_trade_and_hands_over_its_key() {
    let wx = wechatpay();
    let cases = [
        ("native", "ORD_WX_NATIVE", "code_url", "weixin://wxpay/bizpayurl?pr=", "NATIVE"),
        ("jsapi", "ORD_WX_JSAPI", "prepay_id", "wx", "JSAPI"),
        ("h5", "ORD_WX_H5", "h5_url", "https://wx.tenpay.com/cgi-bin/mmpayweb-bin/checkmweb?prepay_id=wx", "H5"),
        ("app", "ORD_WX_APP", "prepay_id", "wx", "APP"),
    ];
    for (i, (method, no, key, prefix, trade_type)) in cases.into_iter().enumerate() {
        let exchange = wx.client.prepay(&wx_request(no, method), now_ms());
        let value = created(&exchange.meaning, key);
        assert!(value.starts_with(prefix) && value.len() > prefix.len() + 8, "{method}: {value}");
        if key == "prepay_id" {
            assert_eq!(value.len(), 36, "wx, 14 digits of Beijing time, 20 digits: {value}");
            assert!(value[2..].bytes().all(|b| b.is_ascii_digit()), "{value}");
        }
        assert_eq!(exchange.http_status, Some(200));
        assert_eq!((wx.api.trades(), wx.api.prepay_calls()), (i + 1, i + 1), "{method}");
        assert_eq!(wx.api.trade_state(no), Some("NOTPAY"));
        let call = wx.api.calls().last().cloned().expect("a call");
        assert_eq!(
            (call.http_method.as_str(), call.api.as_str(), call.verified, call.status, call.code),
            ("POST", format!("/v3/pay/transactions/{method}").as_str(), true, Some(200), None)
        );
        assert_eq!(call.body["notify_url"], NOTIFY_WECHATPAY);
        let made = wx.api.trade(no).expect("the trade");
        let expires_at_ms = call.body["time_expire"]
            .as_str()
            .and_then(|t| super::beijing_unix(t.strip_suffix("+08:00")?, b'T').map(|s| s * 1000));
        assert_eq!(
            made,
            TradeRecord {
                out_trade_no: no.to_owned(),
                amount: 990,
                trade_type: trade_type.to_owned(),
                expires_at_ms,
                notify_url: Some(NOTIFY_WECHATPAY.to_owned()),
                appid: Some(WECHATPAY_APPID.to_owned()),
                description: Some("Tea".to_owned()),
                pay_no: None,
                payment: Some(value.clone()),
            }
        );
        assert!(expires_at_ms.is_some_and(|at| at > now_ms() + 14 * 60_000), "{expires_at_ms:?}");
        // The trade is the one made: its type and appid, as the query tells.
        let mut conn = super::tests::connect(&wx.api);
        let target = format!("/v3/pay/transactions/out-trade-no/{no}?mchid={WECHATPAY_MCHID}");
        let answer = conn.exchange(&signer().request(&wx.api, "GET", &target, "")).expect("an answer");
        let trade = json_of(&answer);
        assert_eq!(
            (trade["trade_type"].as_str(), trade["appid"].as_str(), trade["amount"]["total"].as_i64()),
            (Some(trade_type), Some(WECHATPAY_APPID), Some(990))
        );
    }
    // jsapi and app: the prepay_id signed by payonce for the client.
    let jsapi = wx.client.prepay(&wx_request("ORD_WX_JSAPI", "jsapi"), now_ms());
    let PrepayAnswer::Created(payment) = &jsapi.meaning else { panic!("{jsapi:?}") };
    assert_eq!(
        payment.fields["client_params"]["package"].as_str(),
        Some(format!("prepay_id={}", created(&jsapi.meaning, "prepay_id")).as_str())
    );
    assert_eq!(wx.api.trades(), 4, "the repeat made none");
}

#[test]
fn a_wechatpay_repeat_gets_the_same_answer_and_other_parameters_are_refused() {
    let wx = wechatpay();
    let first = created(&wx.client.prepay(&wx_request("ORD_WX_REPEAT", "native"), now_ms()).meaning, "code_url");
    let again = created(&wx.client.prepay(&wx_request("ORD_WX_REPEAT", "native"), now_ms()).meaning, "code_url");
    assert_eq!(again, first, "the same code_url for the same request");
    assert_eq!((wx.api.trades(), wx.api.prepay_calls()), (1, 2));

    let other_type = wx.client.prepay(&wx_request("ORD_WX_REPEAT", "jsapi"), now_ms());
    let (code, message) = refused(&other_type.meaning);
    assert_eq!(code, "INVALID_REQUEST");
    assert!(message.contains("out_trade_no used with other parameters"), "{message}");
    assert!(message.contains("trade_type NATIVE"), "{message}");
    let other_amount =
        wx.client.prepay(&PrepayRequest { amount: 991, ..wx_request("ORD_WX_REPEAT", "native") }, now_ms());
    let (code, message) = refused(&other_amount.meaning);
    assert_eq!((code.as_str(), message.contains("amount.total 990")), ("INVALID_REQUEST", true), "{message}");
    let other_appid = wx
        .client
        .prepay(&PrepayRequest { appid: Some(SECOND_APPID), ..wx_request("ORD_WX_REPEAT", "native") }, now_ms());
    assert_eq!(refused(&other_appid.meaning).0, "INVALID_REQUEST");
    assert_eq!(wx.api.trade_state("ORD_WX_REPEAT"), Some("NOTPAY"));

    // The second appid makes trades of its own; an appid not bound to the merchant none.
    let second =
        wx.client.prepay(&PrepayRequest { appid: Some(SECOND_APPID), ..wx_request("ORD_WX_MINI", "jsapi") }, now_ms());
    assert!(created(&second.meaning, "prepay_id").starts_with("wx"));
    let unknown = wx
        .client
        .prepay(&PrepayRequest { appid: Some("wxnotours"), ..wx_request("ORD_WX_NOTOURS", "native") }, now_ms());
    let (code, message) = refused(&unknown.meaning);
    assert_eq!(code, "APPID_MCHID_NOT_MATCH");
    assert!(message.contains("wxnotours"), "{message}");
    assert_eq!(wx.api.trade_state("ORD_WX_NOTOURS"), None);
    assert_eq!((wx.api.trades(), wx.api.prepay_calls()), (2, 7));
}

#[test]
fn a_paid_or_closed_wechatpay_trade_is_answered_as_such() {
    let wx = wechatpay();
    created(&wx.client.prepay(&wx_request("ORD_WX_PAID", "h5"), now_ms()).meaning, "h5_url");
    wx.api.buyer_pays("ORD_WX_PAID").expect("paid");
    assert_eq!(wx.client.prepay(&wx_request("ORD_WX_PAID", "h5"), now_ms()).meaning, PrepayAnswer::Paid);
    assert_eq!(wx.api.calls().last().and_then(|c| c.code.clone()).as_deref(), Some("ORDERPAID"));

    created(&wx.client.prepay(&wx_request("ORD_WX_CLOSED", "app"), now_ms()).meaning, "prepay_id");
    assert_eq!(wx.client.close("ORD_WX_CLOSED", now_ms()).meaning, CloseAnswer::Closed);
    assert_eq!(wx.client.prepay(&wx_request("ORD_WX_CLOSED", "app"), now_ms()).meaning, PrepayAnswer::Closed);
    assert_eq!(wx.api.calls().last().and_then(|c| c.code.clone()).as_deref(), Some("ORDER_CLOSED"));
    assert_eq!(wx.api.buyer_pays("ORD_WX_CLOSED"), Err(Refused::Closed));
    assert_eq!(wx.api.trades(), 2);
}

/// Signs as payonce does, with payonce's key, for bodies payonce's client would not send.
fn signer() -> WxSigner<'static> {
    static KEY: std::sync::OnceLock<RsaPrivateKey> = std::sync::OnceLock::new();
    WxSigner {
        key: KEY.get_or_init(merchant_key),
        mchid: WECHATPAY_MCHID,
        serial: MERCHANT_SERIAL,
        timestamp: crate::now_s(),
    }
}

#[test]
fn wechatpay_refuses_a_prepay_it_would_not_take_naming_the_field() {
    let wx = wechatpay();
    // Through payonce's client: a notify_url not the merchant's, a past time_expire.
    let other_url = request("ORD_WX_URL", "native", "https://elsewhere.example/cb");
    let (code, message) = refused(&wx.client.prepay(&other_url, now_ms()).meaning);
    assert_eq!(code, "PARAM_ERROR");
    assert!(message.contains("notify_url") && message.contains(NOTIFY_WECHATPAY), "{message}");
    let past = PrepayRequest { expires_at_ms: now_ms() - 60_000, ..wx_request("ORD_WX_PAST", "native") };
    let (code, message) = refused(&wx.client.prepay(&past, now_ms()).meaning);
    assert_eq!((code.as_str(), message.contains("time_expire")), ("PARAM_ERROR", true), "{message}");

    // Signed here: each body one change away from one that is taken.
    let expire = crate::platform::china_time(crate::now_s() + 900).rfc3339();
    let valid = |no: &str| {
        json!({
            "appid": WECHATPAY_APPID, "mchid": WECHATPAY_MCHID, "description": "Tea", "out_trade_no": no,
            "time_expire": expire, "notify_url": NOTIFY_WECHATPAY, "amount": {"total": 990, "currency": "CNY"},
            "payer": {"openid": "oBuyer"}, "scene_info": {"payer_client_ip": "203.0.113.7", "h5_info": {"type": "Wap"}},
        })
    };
    type Change = fn(&mut Value);
    let cases: [(&str, &str, &str, Change); 13] = [
        ("jsapi", "PARAM_ERROR", "payer.openid", |b| b["payer"] = json!({})),
        ("h5", "PARAM_ERROR", "scene_info.payer_client_ip", |b| b["scene_info"]["payer_client_ip"] = json!("")),
        ("h5", "PARAM_ERROR", "scene_info.h5_info.type", |b| b["scene_info"]["h5_info"] = json!({})),
        ("native", "PARAM_ERROR", "description", |b| b["description"] = json!("茶".repeat(128))),
        ("native", "PARAM_ERROR", "amount.total", |b| b["amount"]["total"] = json!(0)),
        ("native", "PARAM_ERROR", "amount.currency", |b| b["amount"]["currency"] = json!("USD")),
        ("native", "PARAM_ERROR", "time_expire", |b| b["time_expire"] = json!("2099-01-01T00:00:00Z")),
        ("native", "PARAM_ERROR", "time_expire", |b| b["time_expire"] = json!("2099-01-01 00:00:00")),
        ("app", "PARAM_ERROR", "notify_url", |b| b["notify_url"] = json!("ftp://shop.example/cb")),
        ("app", "PARAM_ERROR", "notify_url", |b| remove(b, "notify_url")),
        ("native", "PARAM_ERROR", "mchid", |b| b["mchid"] = json!("1900009999")),
        ("native", "PARAM_ERROR", "out_trade_no", |b| b["out_trade_no"] = json!("ORD1")),
        ("native", "PARAM_ERROR", "appid", |b| remove(b, "appid")),
    ];
    let mut conn = super::tests::connect(&wx.api);
    for (i, (method, code, field, change)) in cases.into_iter().enumerate() {
        let mut body = valid(&format!("ORD_WX_BAD_{i}"));
        change(&mut body);
        let target = format!("/v3/pay/transactions/{method}");
        let answer = conn.exchange(&signer().request(&wx.api, "POST", &target, &body.to_string())).expect("an answer");
        let json = json_of(&answer);
        assert_eq!((answer.status, json["code"].as_str()), (400, Some(code)), "{field}: {json}");
        assert!(json["message"].as_str().is_some_and(|m| m.contains(field)), "names {field}: {json}");
        assert!(wx_verified(&wx.api, &answer), "a refusal is signed too");
    }
    assert_eq!(wx.api.trades(), 0, "none of them made a trade");
    // The same body unchanged is taken: each refusal above is its change's.
    for method in ["native", "jsapi", "h5", "app"] {
        let body = valid(&format!("ORD_WX_OK_{method}"));
        let target = format!("/v3/pay/transactions/{method}");
        let answer = conn.exchange(&signer().request(&wx.api, "POST", &target, &body.to_string())).expect("an answer");
        assert_eq!(answer.status, 200, "{method}: {}", answer.text());
    }
    assert_eq!((wx.api.trades(), wx.api.prepay_calls()), (4, 2 + 13 + 4));
}

fn remove(body: &mut Value, name: &str) {
    if let Some(object) = body.as_object_mut() {
        object.remove(name);
    }
}

// ---- Alipay ----

#[test]
fn alipay_precreate_makes_the_trade_once_and_answers_as_alipay() {
    let ali = alipay();
    let first = created(&ali.client.prepay(&ali_request("ORD_ALI_QR", "precreate"), now_ms()).meaning, "qr_code");
    assert!(first.starts_with("https://qr.alipay.com/") && first.len() == 22 + 24, "{first}");
    let again = created(&ali.client.prepay(&ali_request("ORD_ALI_QR", "precreate"), now_ms()).meaning, "qr_code");
    assert_eq!(again, first);
    assert_eq!((ali.api.trades(), ali.api.prepay_calls()), (1, 2));
    assert_eq!(ali.api.trade_state("ORD_ALI_QR"), Some("WAIT_BUYER_PAY"));
    let call = ali.api.calls()[0].clone();
    assert_eq!(
        (call.api.as_str(), call.verified, call.code.as_deref()),
        ("alipay.trade.precreate", true, Some("10000"))
    );
    assert!(call.params.contains(&("notify_url".to_owned(), NOTIFY_ALIPAY.to_owned())));
    let made = ali.api.trade("ORD_ALI_QR").expect("the trade");
    assert_eq!(
        (made.trade_type.as_str(), made.notify_url.as_deref(), made.description.as_deref(), made.appid),
        ("alipay.trade.precreate", Some(NOTIFY_ALIPAY), Some("Tea"), None)
    );
    assert_eq!(made.pay_no.as_ref().map(String::len), Some(28), "Alipay numbers the trade when it is made");
    let expire = call.body["time_expire"].as_str().expect("time_expire");
    assert_eq!(made.expires_at_ms, super::beijing_unix(expire, b' ').map(|s| s * 1000));

    let other_amount =
        ali.client.prepay(&PrepayRequest { amount: 1000, ..ali_request("ORD_ALI_QR", "precreate") }, now_ms());
    let (code, message) = refused(&other_amount.meaning);
    assert_eq!(code, "ACQ.CONTEXT_INCONSISTENT");
    assert!(message.contains("10.00") && message.contains("9.90"), "{message}");

    let pay_no = ali.api.buyer_pays("ORD_ALI_QR").expect("paid");
    assert_eq!(pay_no.len(), 28);
    assert_eq!(ali.client.prepay(&ali_request("ORD_ALI_QR", "precreate"), now_ms()).meaning, PrepayAnswer::Paid);

    created(&ali.client.prepay(&ali_request("ORD_ALI_SHUT", "precreate"), now_ms()).meaning, "qr_code");
    assert_eq!(ali.client.close("ORD_ALI_SHUT", now_ms()).meaning, CloseAnswer::Closed);
    assert_eq!(ali.client.prepay(&ali_request("ORD_ALI_SHUT", "precreate"), now_ms()).meaning, PrepayAnswer::Closed);
    assert_eq!(ali.api.trades(), 2);

    let other_url = request("ORD_ALI_URL", "precreate", "https://elsewhere.example/cb");
    let (code, message) = refused(&ali.client.prepay(&other_url, now_ms()).meaning);
    assert_eq!(code, "ACQ.INVALID_PARAMETER");
    assert!(message.contains("notify_url"), "{message}");
    let past = PrepayRequest { expires_at_ms: now_ms() - 60_000, ..ali_request("ORD_ALI_PAST", "precreate") };
    let (code, message) = refused(&ali.client.prepay(&past, now_ms()).meaning);
    assert_eq!((code.as_str(), message.contains("time_expire")), ("ACQ.INVALID_PARAMETER", true), "{message}");
    assert_eq!(ali.api.trades(), 2, "refusals make no trade");
}

#[test]
fn alipay_precreate_signed_here_needs_its_amount_subject_and_notify_url() {
    let ali = alipay();
    let key = merchant_key();
    let mut conn = super::tests::connect(&ali.api);
    let expire = crate::platform::china_time(crate::now_s() + 900).plain();
    let biz = |no: &str| json!({"out_trade_no": no, "total_amount": "9.90", "subject": "Tea", "time_expire": expire});
    let with_notify = |params: &mut Vec<(String, String)>| params.push(("notify_url".into(), NOTIFY_ALIPAY.into()));
    let cases: [(&str, Value); 6] = [
        ("total_amount", json!({"total_amount": "0.00"})),
        ("total_amount", json!({"total_amount": "9.999"})),
        ("subject", json!({"subject": ""})),
        ("time_expire", json!({"time_expire": "2099-01-01T00:00:00+08:00"})),
        ("out_trade_no", json!({"out_trade_no": "ORD-DASHED"})),
        ("time_expire", json!({"time_expire": Value::Null})),
    ];
    for (i, (field, change)) in cases.into_iter().enumerate() {
        let mut body = biz(&format!("ORD_ALI_BAD_{i}"));
        for (k, v) in change.as_object().expect("object") {
            body[k] = v.clone();
        }
        let form = ali_form("alipay.trade.precreate", &body, &key, with_notify);
        let response =
            ali_response(&ali.api, &ali_post(&ali.api, &mut conn, &form), "alipay.trade.precreate").expect("signed");
        assert_eq!(response["sub_code"], "ACQ.INVALID_PARAMETER", "{field}: {response}");
        assert!(response["sub_msg"].as_str().is_some_and(|m| m.contains(field)), "{field}: {response}");
    }
    let no_notify = ali_form("alipay.trade.precreate", &biz("ORD_ALI_NO_URL"), &key, |_| {});
    let response =
        ali_response(&ali.api, &ali_post(&ali.api, &mut conn, &no_notify), "alipay.trade.precreate").expect("signed");
    assert!(response["sub_msg"].as_str().is_some_and(|m| m.contains("notify_url")), "{response}");
    assert_eq!(ali.api.trades(), 0);
    let taken = ali_form("alipay.trade.precreate", &biz("ORD_ALI_TAKEN"), &key, with_notify);
    let response =
        ali_response(&ali.api, &ali_post(&ali.api, &mut conn, &taken), "alipay.trade.precreate").expect("signed");
    assert_eq!((response["code"].as_str(), response["out_trade_no"].as_str()), (Some("10000"), Some("ORD_ALI_TAKEN")));
    // Signed by another key: the gateway refuses it before anything else.
    let forged = ali_form("alipay.trade.precreate", &biz("ORD_ALI_FORGED"), &keys().app, with_notify);
    let response =
        ali_response(&ali.api, &ali_post(&ali.api, &mut conn, &forged), "alipay.trade.precreate").expect("signed");
    assert_eq!(response["sub_code"], "isv.invalid-signature");
    assert_eq!((ali.api.trades(), ali.api.prepay_calls()), (1, 9));
}

#[test]
fn alipay_requests_the_buyer_opens_make_the_trade() {
    let ali = alipay();
    let signed = |no: &str, method: &str| -> String {
        let key = if method == "app" { "order_string" } else { "url" };
        created(&ali.client.prepay(&ali_request(no, method), now_ms()).meaning, key)
    };
    let page = signed("ORD_ALI_PAGE", "page");
    assert!(page.starts_with(&format!("{}?", ali.api.endpoint())), "{page}");
    assert!(ali.api.calls().is_empty(), "payonce signed it without a call");
    assert_eq!(ali.api.buyer_opens(&page), Ok("ORD_ALI_PAGE".to_owned()));
    assert_eq!(ali.api.trade_state("ORD_ALI_PAGE"), Some("WAIT_BUYER_PAY"));
    assert_eq!(ali.api.buyer_opens(&page), Ok("ORD_ALI_PAGE".to_owned()), "opened twice, one trade");
    assert_eq!((ali.api.trades(), ali.api.prepay_calls()), (1, 0));
    let call = ali.api.calls()[0].clone();
    assert_eq!(
        (call.http_method.as_str(), call.api.as_str(), call.verified, call.status, call.code.as_deref()),
        ("GET", "alipay.trade.page.pay", true, Some(200), Some("10000"))
    );
    assert_eq!(call.body["product_code"], "FAST_INSTANT_TRADE_PAY");
    let made = ali.api.trade("ORD_ALI_PAGE").expect("the trade");
    assert_eq!((made.trade_type.as_str(), made.notify_url.as_deref()), ("alipay.trade.page.pay", Some(NOTIFY_ALIPAY)));

    let wap = signed("ORD_ALI_WAP", "wap");
    assert_eq!(ali.api.buyer_opens(&wap), Ok("ORD_ALI_WAP".to_owned()));
    let app = signed("ORD_ALI_APP", "app");
    assert!(!app.contains('?'), "an order string is the form alone");
    assert_eq!(ali.api.buyer_opens(&app), Ok("ORD_ALI_APP".to_owned()));
    assert_eq!(
        ali.api.calls().last().map(|c| (c.http_method.clone(), c.api.clone())),
        Some(("APP".into(), "alipay.trade.app.pay".into()))
    );
    assert_eq!(ali.api.trades(), 3);

    // An app request opened as a page, and a page request handed to the app.
    let as_url = format!("{}?{app}", ali.api.endpoint());
    assert!(ali.api.buyer_opens(&as_url).is_err_and(|e| e.starts_with("isv.invalid-method")));
    let form_only = page.split_once('?').expect("a query").1.to_owned();
    assert!(ali.api.buyer_opens(&form_only).is_err_and(|e| e.starts_with("isv.invalid-method")));
    // Another gateway's URL does not reach this one.
    let elsewhere = page.replace(&ali.api.endpoint(), "https://openapi.alipay.com/gateway.do");
    assert!(ali.api.buyer_opens(&elsewhere).is_err_and(|e| e.contains("is not this gateway")));

    // The amount changed in the URL: the signature no longer holds, no trade.
    let tampered = signed("ORD_ALI_TAMPER", "page");
    let amount = "%22total_amount%22%3A%229.90%22";
    assert!(tampered.contains(amount), "{tampered}");
    let tampered = tampered.replace(amount, "%22total_amount%22%3A%220.01%22");
    let refusal = ali.api.buyer_opens(&tampered).expect_err("tampered");
    assert!(refusal.starts_with("isv.invalid-signature"), "{refusal}");
    assert_eq!(ali.api.trade_state("ORD_ALI_TAMPER"), None);
    let call = ali.api.calls().last().cloned().expect("recorded");
    assert_eq!((call.verified, call.code.as_deref()), (false, Some("isv.invalid-signature")));

    // A paid trade is not opened again; nor one of another amount.
    ali.api.buyer_pays("ORD_ALI_WAP").expect("paid");
    assert!(ali.api.buyer_opens(&wap).is_err_and(|e| e.starts_with("ACQ.TRADE_HAS_SUCCESS")));
    let dearer = PrepayRequest { amount: 1990, ..ali_request("ORD_ALI_PAGE", "page") };
    let dearer = created(&ali.client.prepay(&dearer, now_ms()).meaning, "url");
    assert!(ali.api.buyer_opens(&dearer).is_err_and(|e| e.starts_with("ACQ.CONTEXT_INCONSISTENT")));
    // Checked like a precreate: the notify_url and time_expire.
    let other_url = created(
        &ali.client.prepay(&request("ORD_ALI_URL2", "page", "https://elsewhere.example/cb"), now_ms()).meaning,
        "url",
    );
    assert!(ali.api.buyer_opens(&other_url).is_err_and(|e| e.contains("notify_url")));
    let past = PrepayRequest { expires_at_ms: now_ms() - 60_000, ..ali_request("ORD_ALI_PAST2", "wap") };
    let past = created(&ali.client.prepay(&past, now_ms()).meaning, "url");
    assert!(ali.api.buyer_opens(&past).is_err_and(|e| e.contains("time_expire")));
    assert_eq!((ali.api.trades(), ali.api.prepay_calls()), (3, 0));

    // WeChat Pay has nothing for a buyer to open.
    assert!(wechatpay().api.buyer_opens(&page).is_err());
}

// ---- Paying, faults ----

#[test]
fn a_buyer_pays_only_a_trade_that_exists_unexpired_and_open() {
    let (wx, ali) = (wechatpay(), alipay());
    for api in [&wx.api, &ali.api] {
        assert_eq!(api.buyer_pays("ORD_NOWHERE"), Err(Refused::NoSuchTrade));
        assert_eq!(api.buyer_paying("ORD_NOWHERE"), Err(Refused::NoSuchTrade));
    }
    // time_expire is to the second: these trades expire two to three seconds from now.
    let expires_at_ms = (now_ms() + 3_000).div_euclid(1000) * 1000;
    let soon = |method| PrepayRequest { expires_at_ms, ..request("ORD_SOON", method, "") };
    let wx_soon = PrepayRequest { notify_url: NOTIFY_WECHATPAY, ..soon("native") };
    created(&wx.client.prepay(&wx_soon, now_ms()).meaning, "code_url");
    let ali_soon = PrepayRequest { notify_url: NOTIFY_ALIPAY, ..soon("precreate") };
    created(&ali.client.prepay(&ali_soon, now_ms()).meaning, "qr_code");
    assert_eq!(wx.api.buyer_paying("ORD_SOON"), Ok(()), "not expired yet");
    std::thread::sleep(Duration::from_millis(u64::try_from(expires_at_ms - now_ms()).unwrap_or(0) + 100));
    for api in [&wx.api, &ali.api] {
        assert_eq!(api.buyer_paying("ORD_SOON"), Err(Refused::Expired));
        assert_eq!(api.buyer_pays("ORD_SOON"), Err(Refused::Expired));
    }
    assert_eq!(wx.api.trade_state("ORD_SOON"), Some("USERPAYING"), "expired, not closed by the platform");
    // Asked again with a time_expire still ahead: the trade is past its life.
    let later = now_ms() + 15 * 60_000;
    let wx_again = PrepayRequest { expires_at_ms: later, ..wx_soon };
    assert_eq!(wx.client.prepay(&wx_again, now_ms()).meaning, PrepayAnswer::Closed);
    let ali_again = PrepayRequest { expires_at_ms: later, ..ali_soon };
    assert_eq!(ali.client.prepay(&ali_again, now_ms()).meaning, PrepayAnswer::Closed);

    created(&wx.client.prepay(&wx_request("ORD_WX_SHUT", "native"), now_ms()).meaning, "code_url");
    assert_eq!(wx.client.close("ORD_WX_SHUT", now_ms()).meaning, CloseAnswer::Closed);
    assert_eq!(wx.api.buyer_pays("ORD_WX_SHUT"), Err(Refused::Closed));
    assert_eq!(wx.api.buyer_paying("ORD_WX_SHUT"), Err(Refused::Closed));
    created(&wx.client.prepay(&wx_request("ORD_WX_OPEN", "native"), now_ms()).meaning, "code_url");
    let pay_no = wx.api.buyer_pays("ORD_WX_OPEN").expect("an open, unexpired trade is paid");
    assert_eq!(wx.api.buyer_pays("ORD_WX_OPEN"), Err(Refused::AlreadyPaid { pay_no }));
}

#[test]
fn faults_leave_a_prepay_without_an_answer() {
    let (wx, ali) = (wechatpay(), alipay());
    let platforms: [(&PlatformApi, &dyn Calls, &str, &str); 2] =
        [(&wx.api, &wx.client, "native", "code_url"), (&ali.api, &ali.client, "precreate", "qr_code")];
    for (api, client, method, key) in platforms {
        let notify = if method == "native" { NOTIFY_WECHATPAY } else { NOTIFY_ALIPAY };
        for (i, fault) in [Fault::Refuse, Fault::Hang, Fault::ServerError].into_iter().enumerate() {
            let no = format!("ORD_FAULT_{i}");
            api.fail_next(fault.clone(), 1);
            let exchange = client.prepay(&request(&no, method, notify), now_ms());
            assert_eq!(exchange.meaning, PrepayAnswer::Unknown, "{fault:?}: {exchange:?}");
            assert_eq!(api.trade_state(&no), None, "{fault:?} is not acted on");
        }
        assert_eq!(api.trades(), 0);
        // Tampered: acted on, answered unverifiably; the retry gets the payment.
        api.fail_next(Fault::TamperAnswers, 1);
        let exchange = client.prepay(&request("ORD_FAULT_TAMPER", method, notify), now_ms());
        assert_eq!(exchange.meaning, PrepayAnswer::Unknown, "{exchange:?}");
        assert!(exchange.distrust.as_deref().is_some_and(|why| why.contains("verify")), "{exchange:?}");
        assert_eq!(api.trades(), 1, "the tampered call took effect");
        let retry = client.prepay(&request("ORD_FAULT_TAMPER", method, notify), now_ms());
        assert!(!created(&retry.meaning, key).is_empty());
        assert_eq!(api.trades(), 1);
    }
    // Alipay's answer names the trade: one about another is no answer.
    ali.api.fail_next(Fault::WrongTrade, 1);
    let exchange = ali.client.prepay(&ali_request("ORD_FAULT_OTHER", "precreate"), now_ms());
    assert_eq!(exchange.meaning, PrepayAnswer::Unknown, "{exchange:?}");
    // WeChat's prepay answer names neither merchant nor trade: unchanged.
    wx.api.fail_next(Fault::WrongMerchant, 1);
    let exchange = wx.client.prepay(&wx_request("ORD_FAULT_OTHER", "native"), now_ms());
    assert!(created(&exchange.meaning, "code_url").starts_with("weixin://"));
}

#[test]
fn a_delayed_prepay_holds_the_first_call_while_two_more_arrive() {
    let wx = wechatpay();
    let delay = Duration::from_millis(600);
    wx.api.fail_next(Fault::Delay(delay), 1);
    let prepay = || {
        let started = Instant::now();
        let answer = wx.client.prepay(&wx_request("ORD_WX_HELD", "native"), now_ms()).meaning;
        (created(&answer, "code_url"), started.elapsed())
    };
    let (first, second, third) = std::thread::scope(|scope| {
        let first = scope.spawn(prepay);
        std::thread::sleep(Duration::from_millis(150));
        assert_eq!(wx.api.trades(), 0, "the first call is held before it is acted on");
        let (second, third) = (scope.spawn(prepay), scope.spawn(prepay));
        let [first, second, third] = [first, second, third].map(|h| h.join().expect("a prepay"));
        (first, second, third)
    });
    assert!(first.1 >= delay, "held {:?}", first.1);
    assert!(second.1 < delay && third.1 < delay, "not held: {:?} {:?}", second.1, third.1);
    assert_eq!((second.0 == first.0, third.0 == first.0), (true, true), "one trade, one code_url");
    assert_eq!((wx.api.trades(), wx.api.prepay_calls()), (1, 3));
}
