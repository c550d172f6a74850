//! payonce's platform clients against these servers, over real sockets:
//! `App::sync_order` asks the simulated WeChat Pay and Alipay about an
//! order (PRODUCT.md section 11), with payonce's own signing and
//! verification on one side and this crate's oracle on the other.

use super::*;
use payonce::domain::OrderStatus;
use payonce::platform::alipay::AlipayApi;
use payonce::platform::wechatpay::WechatpayApi;
use payonce::platform::{MerchantKey, TradeState};
use payonce::platform_ops::Platforms;
use payonce::{App, Clock, Config, CreateOrder};
use rsa::pkcs8::DecodePrivateKey;

/// payonce's merchant key: the 2048-bit fixture (ring signs with no less).
const MERCHANT_KEY_PEM: &str = include_str!("../../../tests/fixtures/keys/merchant.pem");
const MERCHANT_SERIAL: &str = "3A1F0C2B9D8E7F6A5B4C3D2E1F0A9B8C7D6E5F4A";
const TIMEOUT: Duration = Duration::from_millis(1_500);

struct Setup {
    app: App,
    wechatpay: PlatformApi,
    alipay: PlatformApi,
}

fn merchant_public_key() -> RsaPublicKey {
    RsaPrivateKey::from_pkcs8_pem(MERCHANT_KEY_PEM).expect("the fixture key").to_public_key()
}

/// A payonce on a fresh in-memory database whose outgoing calls go to a
/// simulated WeChat Pay and Alipay, the same merchant key on both.
fn setup() -> Setup {
    let wechatpay = PlatformApi::start_wechatpay(WechatpayApiConfig::new(MERCHANT_SERIAL, merchant_public_key()))
        .expect("the WeChat Pay API");
    let alipay = PlatformApi::start_alipay(AlipayApiConfig::new(merchant_public_key())).expect("the Alipay API");
    let wechatpay_key =
        payonce::channel::wechatpay::public_key_from_pem(&wechatpay.platform_public_key_pem().expect("pem"))
            .expect("WeChat Pay's key");
    let alipay_key = payonce::channel::alipay::public_key_from_text(&alipay.platform_public_key_pem().expect("pem"))
        .expect("Alipay's key");
    let platforms = Platforms {
        wechatpay: Some(Arc::new(WechatpayApi::new(
            wechatpay.merchant_id().to_owned(),
            MERCHANT_SERIAL.to_owned(),
            MerchantKey::from_pem(MERCHANT_KEY_PEM).expect("merchant key"),
            &wechatpay.base_url(),
            vec![(wechatpay.platform_serial().expect("serial").to_owned(), wechatpay_key)],
            TIMEOUT,
        ))),
        alipay: Some(Arc::new(AlipayApi::new(
            alipay.merchant_id().to_owned(),
            MerchantKey::from_pem(MERCHANT_KEY_PEM).expect("merchant key"),
            &alipay.endpoint(),
            alipay_key,
            TIMEOUT,
        ))),
        timeout_ms: TIMEOUT.as_millis() as u64,
    };
    let config = Config { platforms, ..Config::default() };
    let app = App::open(":memory:", Clock::System, config).expect("payonce");
    Setup { app, wechatpay, alipay }
}

fn order(app: &App, order_no: &str) {
    app.create_order(&CreateOrder {
        order_no: order_no.into(),
        user_id: "u1".into(),
        amount: 1000,
        currency: "CNY".into(),
        expires_in_s: None,
    })
    .expect("order");
}

fn states(synced: &payonce::platform_ops::Synced) -> Vec<(&'static str, TradeState)> {
    synced.platforms.iter().map(|p| (p.channel, p.state.clone())).collect()
}

fn calls(app: &App, status: &str) -> i64 {
    app.store
        .count_raw(&format!("SELECT count(*) FROM platform_call WHERE kind = 'query' AND status = '{status}'"))
        .expect("count")
}

#[test]
fn a_payment_whose_notification_never_came_is_applied_once_through_the_query() {
    let s = setup();
    order(&s.app, "ORD_SYNC_1");
    s.wechatpay.open_trade("ORD_SYNC_1", 1000).expect("trade");
    s.alipay.open_trade("ORD_SYNC_1", 1000).expect("trade");
    let pay_no = s.wechatpay.buyer_pays("ORD_SYNC_1").expect("paid at WeChat Pay");

    let synced = s.app.sync_order("ORD_SYNC_1").expect("sync");
    assert_eq!(synced.order.status, OrderStatus::Paid);
    assert_eq!(
        states(&synced),
        [
            ("wechatpay", TradeState::Paid { pay_no: pay_no.clone(), amount: 1000, paid_at: synced_paid_at(&synced) }),
            ("alipay", TradeState::NotPaid { paying: false })
        ]
    );
    let detail = s.app.order("ORD_SYNC_1").expect("detail");
    assert_eq!(detail.payments.len(), 1);
    assert_eq!(detail.payments[0].pay_no, pay_no);
    assert_eq!(detail.payments[0].source, "query");
    assert_eq!(calls(&s.app, "done"), 2, "each call kept, answered");
    assert!(
        s.wechatpay.calls().iter().chain(s.alipay.calls().iter()).all(|c| c.verified),
        "payonce signs as the platforms check"
    );

    // Asking again changes nothing: the payment is a duplicate.
    let again = s.app.sync_order("ORD_SYNC_1").expect("sync again");
    assert_eq!(again.order.status, OrderStatus::Paid);
    assert_eq!(s.app.order("ORD_SYNC_1").expect("detail").payments.len(), 1);
    assert_eq!(s.app.order("ORD_SYNC_1").expect("detail").coupons.len(), 0, "no rewards configured, none issued");
}

fn synced_paid_at(synced: &payonce::platform_ops::Synced) -> Option<String> {
    match &synced.platforms[0].state {
        TradeState::Paid { paid_at, .. } => paid_at.clone(),
        _ => None,
    }
}

#[test]
fn alipay_paid_closed_and_unknown_trades() {
    let s = setup();
    for order_no in ["ORD_ALI_PAID", "ORD_ALI_OPEN", "ORD_ALI_NONE"] {
        order(&s.app, order_no);
    }
    s.alipay.open_trade("ORD_ALI_PAID", 1000).expect("trade");
    let pay_no = s.alipay.buyer_pays("ORD_ALI_PAID").expect("paid");
    s.alipay.open_trade("ORD_ALI_OPEN", 1000).expect("trade");

    let paid = s.app.sync_order("ORD_ALI_PAID").expect("sync");
    assert_eq!(paid.platforms[1].state, TradeState::Paid { pay_no, amount: 1000, paid_at: None });
    assert_eq!(paid.order.status, OrderStatus::Paid);
    let open = s.app.sync_order("ORD_ALI_OPEN").expect("sync");
    assert_eq!(open.platforms[1].state, TradeState::NotPaid { paying: false });
    assert_eq!(open.order.status, OrderStatus::Pending);
    let none = s.app.sync_order("ORD_ALI_NONE").expect("sync");
    assert_eq!(
        states(&none),
        [("wechatpay", TradeState::NotPaid { paying: false }), ("alipay", TradeState::NotPaid { paying: false })]
    );
}

#[test]
fn an_answer_that_does_not_verify_or_names_another_trade_is_no_answer() {
    let s = setup();
    order(&s.app, "ORD_TAMPER");
    for api in [&s.wechatpay, &s.alipay] {
        api.open_trade("ORD_TAMPER", 1000).expect("trade");
        api.buyer_pays("ORD_TAMPER").expect("paid");
    }
    for (fault, what) in [
        (Fault::TamperAnswers, "a tampered answer"),
        (Fault::WrongMerchant, "another mchid"),
        (Fault::WrongTrade, "another out_trade_no"),
        (Fault::ServerError, "a 5xx"),
        (Fault::Refuse, "a refused connection"),
        (Fault::Slow(TIMEOUT + Duration::from_millis(500)), "a timeout"),
    ] {
        s.wechatpay.set_fault(Some(fault.clone()));
        // WrongMerchant changes nothing on Alipay (its answers name no merchant).
        let alipay_fault = if fault == Fault::WrongMerchant { Fault::WrongTrade } else { fault.clone() };
        s.alipay.set_fault(Some(alipay_fault));
        let synced = s.app.sync_order("ORD_TAMPER").expect("sync");
        assert_eq!(
            states(&synced),
            [("wechatpay", TradeState::Unknown), ("alipay", TradeState::Unknown)],
            "{what} counts as no answer"
        );
        assert_eq!(synced.order.status, OrderStatus::Pending, "{what}: nothing applied");
    }
    assert_eq!(calls(&s.app, "failed"), 12, "every unanswered call kept as failed");
    s.wechatpay.set_fault(None);
    s.alipay.set_fault(None);
    let synced = s.app.sync_order("ORD_TAMPER").expect("sync");
    assert_eq!(synced.order.status, OrderStatus::Paid);
    let detail = s.app.order("ORD_TAMPER").expect("detail");
    assert_eq!(detail.payments.len(), 2, "both platforms took the money: one applied, one refund-required");
    let outcomes: Vec<&str> = detail.payments.iter().map(|p| p.outcome.as_str()).collect();
    assert!(outcomes.contains(&"applied") && outcomes.contains(&"already_paid"), "{outcomes:?}");
}

#[test]
fn an_order_no_a_platform_cannot_carry_is_no_such_trade_there_and_no_call_is_made() {
    let s = setup();
    // `-` is not Alipay's; `.` is neither's.
    for order_no in ["ORD-DASH-1", "ORD.DOT.1"] {
        order(&s.app, order_no);
    }
    let dash = s.app.sync_order("ORD-DASH-1").expect("sync");
    assert_eq!(
        states(&dash),
        [("wechatpay", TradeState::NotPaid { paying: false }), ("alipay", TradeState::NotPaid { paying: false })]
    );
    assert_eq!(s.alipay.calls().len(), 0, "no call for an out_trade_no Alipay cannot carry");
    assert_eq!(s.wechatpay.calls().len(), 1);
    s.app.sync_order("ORD.DOT.1").expect("sync");
    assert_eq!(s.wechatpay.calls().len(), 1, "nor one WeChat Pay cannot carry");
    assert!(s.app.sync_order("NO-SUCH-ORDER").is_err_and(|e| e.code == "order_not_found"));
}
