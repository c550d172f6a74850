//! payonce's platform clients against these servers, over real sockets:
//! `App::sync_order` asks the simulated WeChat Pay and Alipay about an
//! order (docs/platforms.md), with payonce's own signing and
//! verification on one side and this crate's oracle on the other.

use super::*;
use payonce::domain::OrderStatus;
use payonce::platform_ops::Platforms;
use payonce::platforms::alipay::AlipayApi;
use payonce::platforms::wechatpay::WechatpayApi;
use payonce::platforms::{Calls, MerchantKey, TradeState};
use payonce::{App, Clock, Config, CreateOrder};
use rsa::pkcs8::DecodePrivateKey;

/// payonce's merchant key: the 2048-bit fixture (ring signs with no less).
const MERCHANT_KEY_PEM: &str = include_str!("../../../tests/fixtures/keys/merchant.pem");
const MERCHANT_SERIAL: &str = "3A1F0C2B9D8E7F6A5B4C3D2E1F0A9B8C7D6E5F4A";
const TIMEOUT: Duration = Duration::from_millis(1_500);
/// `--close-give-up-s` of these tests: two minutes (the platforms' answers
/// carry the real time, which payonce's clock must stay within 5 minutes of).
const GIVE_UP_MS: i64 = 120_000;
/// `--refund-query-after-s` of these tests: 10 s.
const REFUND_QUERY_AFTER_MS: i64 = 10_000;

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
    setup_with(Clock::System)
}

fn setup_with(clock: Clock) -> Setup {
    let wechatpay = PlatformApi::start_wechatpay(WechatpayApiConfig::new(MERCHANT_SERIAL, merchant_public_key()))
        .expect("the WeChat Pay API");
    let alipay = PlatformApi::start_alipay(AlipayApiConfig::new(merchant_public_key())).expect("the Alipay API");
    let wechatpay_key =
        payonce::platforms::wechatpay::public_key_from_pem(&wechatpay.platform_public_key_pem().expect("pem"))
            .expect("WeChat Pay's key");
    let alipay_key = payonce::platforms::alipay::public_key_from_text(&alipay.platform_public_key_pem().expect("pem"))
        .expect("Alipay's key");
    let platforms = Platforms {
        registry: payonce::platforms::Registry::with([
            payonce::platforms::Platform::calls(WechatpayApi::new(
                wechatpay.merchant_id().to_owned(),
                MERCHANT_SERIAL.to_owned(),
                MerchantKey::from_pem(MERCHANT_KEY_PEM).expect("merchant key"),
                &wechatpay.base_url(),
                vec![(wechatpay.platform_serial().expect("serial").to_owned(), wechatpay_key)],
                TIMEOUT,
            )),
            payonce::platforms::Platform::calls(AlipayApi::new(
                alipay.merchant_id().to_owned(),
                MerchantKey::from_pem(MERCHANT_KEY_PEM).expect("merchant key"),
                &alipay.endpoint(),
                alipay_key,
                TIMEOUT,
            )),
        ]),
        timeout_ms: TIMEOUT.as_millis() as u64,
        retry_schedule_ms: vec![1_000, 2_000],
        close_give_up_ms: GIVE_UP_MS,
        refund_query_after_ms: REFUND_QUERY_AFTER_MS,
        ..Platforms::default()
    };
    let config = Config { platforms, ..Config::default() };
    let app = App::open(":memory:", clock, config).expect("payonce");
    Setup { app, wechatpay, alipay }
}

fn order(app: &App, order_no: &str) {
    order_expiring(app, order_no, None);
}

fn order_expiring(app: &App, order_no: &str, expires_in_s: Option<i64>) {
    app.orders()
        .create_order(&CreateOrder {
            order_no: order_no.into(),
            user_id: "u1".into(),
            amount: 1000,
            currency: "CNY".into(),
            expires_in_s,
        })
        .expect("order");
}

/// A payonce on a manual clock at the real time, with `order_no` expired
/// (1 s lifetime, the clock moved 2 s) and its trade opened at both platforms.
fn expired(order_no: &str) -> (Setup, Clock) {
    let clock = Clock::manual(Clock::System.now_ms());
    let s = setup_with(clock.clone());
    order_expiring(&s.app, order_no, Some(1));
    s.wechatpay.open_trade(order_no, 1000).expect("trade");
    s.alipay.open_trade(order_no, 1000).expect("trade");
    clock.advance_ms(2_000);
    (s, clock)
}

fn audit_actions(app: &App, order_no: &str) -> Vec<String> {
    app.orders().order(order_no).expect("detail").audit.into_iter().map(|a| a.action).collect()
}

fn apis_called(api: &PlatformApi) -> Vec<String> {
    api.calls().into_iter().map(|c| c.api).collect()
}

fn states(synced: &payonce::platform_ops::Synced) -> Vec<(&'static str, TradeState)> {
    synced.platforms.iter().map(|p| (p.channel, p.state.clone())).collect()
}

/// The order's query calls in `status`, as `GET /v1/orders/{order_no}` shows them.
fn calls(app: &App, order_no: &str, status: &str) -> usize {
    let detail = app.orders().order(order_no).expect("detail");
    detail.platform_calls.iter().filter(|c| c.kind.as_str() == "query" && c.status.as_str() == status).count()
}

#[test]
fn a_payment_whose_notification_never_came_is_applied_once_through_the_query() {
    let s = setup();
    order(&s.app, "ORD_SYNC_1");
    s.wechatpay.open_trade("ORD_SYNC_1", 1000).expect("trade");
    s.alipay.open_trade("ORD_SYNC_1", 1000).expect("trade");
    let pay_no = s.wechatpay.buyer_pays("ORD_SYNC_1").expect("paid at WeChat Pay");

    let synced = s.app.platform_calls().sync_order("ORD_SYNC_1").expect("sync");
    assert_eq!(synced.order.status, OrderStatus::Paid);
    assert_eq!(
        states(&synced),
        [
            (
                "wechatpay",
                TradeState::Paid {
                    pay_no: pay_no.clone(),
                    amount: 1000,
                    currency: "CNY".into(),
                    paid_at: synced_paid_at(&synced)
                }
            ),
            ("alipay", TradeState::NotPaid { paying: false })
        ]
    );
    let detail = s.app.orders().order("ORD_SYNC_1").expect("detail");
    assert_eq!(detail.payments.len(), 1);
    assert_eq!(detail.payments[0].pay_no, pay_no);
    assert_eq!(detail.payments[0].source, "query");
    assert_eq!(calls(&s.app, "ORD_SYNC_1", "done"), 2, "each call kept, answered");
    assert!(
        s.wechatpay.calls().iter().chain(s.alipay.calls().iter()).all(|c| c.verified),
        "payonce signs as the platforms check"
    );

    // Asking again changes nothing: the payment is a duplicate.
    let again = s.app.platform_calls().sync_order("ORD_SYNC_1").expect("sync again");
    assert_eq!(again.order.status, OrderStatus::Paid);
    assert_eq!(s.app.orders().order("ORD_SYNC_1").expect("detail").payments.len(), 1);
    assert_eq!(
        s.app.orders().order("ORD_SYNC_1").expect("detail").coupons.len(),
        0,
        "no rewards configured, none issued"
    );
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

    let paid = s.app.platform_calls().sync_order("ORD_ALI_PAID").expect("sync");
    assert_eq!(
        paid.platforms[1].state,
        TradeState::Paid { pay_no, amount: 1000, currency: "CNY".into(), paid_at: None }
    );
    assert_eq!(paid.order.status, OrderStatus::Paid);
    let open = s.app.platform_calls().sync_order("ORD_ALI_OPEN").expect("sync");
    assert_eq!(open.platforms[1].state, TradeState::NotPaid { paying: false });
    assert_eq!(open.order.status, OrderStatus::Pending);
    let none = s.app.platform_calls().sync_order("ORD_ALI_NONE").expect("sync");
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
        let synced = s.app.platform_calls().sync_order("ORD_TAMPER").expect("sync");
        assert_eq!(
            states(&synced),
            [("wechatpay", TradeState::Unknown), ("alipay", TradeState::Unknown)],
            "{what} counts as no answer"
        );
        assert_eq!(synced.order.status, OrderStatus::Pending, "{what}: nothing applied");
    }
    assert_eq!(calls(&s.app, "ORD_TAMPER", "failed"), 12, "every unanswered call kept as failed");
    s.wechatpay.set_fault(None);
    s.alipay.set_fault(None);
    let synced = s.app.platform_calls().sync_order("ORD_TAMPER").expect("sync");
    assert_eq!(synced.order.status, OrderStatus::Paid);
    let detail = s.app.orders().order("ORD_TAMPER").expect("detail");
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
    let dash = s.app.platform_calls().sync_order("ORD-DASH-1").expect("sync");
    assert_eq!(
        states(&dash),
        [("wechatpay", TradeState::NotPaid { paying: false }), ("alipay", TradeState::NotPaid { paying: false })]
    );
    assert_eq!(s.alipay.calls().len(), 0, "no call for an out_trade_no Alipay cannot carry");
    assert_eq!(s.wechatpay.calls().len(), 1);
    s.app.platform_calls().sync_order("ORD.DOT.1").expect("sync");
    assert_eq!(s.wechatpay.calls().len(), 1, "nor one WeChat Pay cannot carry");
    assert!(s
        .app
        .platform_calls()
        .sync_order("NO-SUCH-ORDER")
        .is_err_and(|e| payonce::api::code_of(e.kind) == "order_not_found"));
}

#[test]
fn an_expired_order_whose_notification_was_lost_is_applied_not_closed() {
    let (s, _clock) = expired("ORD_LOST_1");
    let pay_no = s.wechatpay.buyer_pays("ORD_LOST_1").expect("paid at WeChat Pay");
    assert_eq!(s.app.orders().close_expired(100).expect("sweep"), 1, "queued, not closed");
    assert_eq!(s.app.orders().order("ORD_LOST_1").expect("detail").order.status, OrderStatus::Pending);
    assert_eq!(s.app.orders().close_expired(100).expect("sweep"), 0, "queued once");
    assert_eq!(s.app.platform_calls().run_platform_calls_once(8).expect("pool"), 2, "one close row per platform");
    let detail = s.app.orders().order("ORD_LOST_1").expect("detail");
    assert_eq!(detail.order.status, OrderStatus::Paid);
    assert_eq!(detail.payments.len(), 1);
    assert_eq!((detail.payments[0].pay_no.as_str(), detail.payments[0].source.as_str()), (pay_no.as_str(), "query"));
    assert!(!apis_called(&s.wechatpay).iter().any(|a| a.ends_with("/close")), "a paid trade is not closed");
    assert!(!audit_actions(&s.app, "ORD_LOST_1").contains(&"platform_closed".to_owned()));
    assert_eq!(s.app.platform_calls().run_platform_calls_once(8).expect("pool"), 0, "nothing left to do");
}

#[test]
fn an_expired_unpaid_order_is_closed_at_every_platform_then_here_once() {
    let (s, _clock) = expired("ORD_CLOSE_1");
    s.app.orders().close_expired(100).expect("sweep");
    s.app.platform_calls().run_platform_calls_once(8).expect("pool");
    assert_eq!(s.app.orders().order("ORD_CLOSE_1").expect("detail").order.status, OrderStatus::Closed);
    assert_eq!(audit_actions(&s.app, "ORD_CLOSE_1"), ["platform_closed"]);
    assert!(apis_called(&s.wechatpay).iter().any(|a| a.ends_with("ORD_CLOSE_1/close")));
    assert!(apis_called(&s.alipay).contains(&"alipay.trade.close".to_owned()));
    // After the platform's close, the buyer can no longer pay there: no paid_after_close.
    assert!(s.wechatpay.buyer_pays("ORD_CLOSE_1").is_err());
    assert!(s.alipay.buyer_pays("ORD_CLOSE_1").is_err());
    s.app.platform_calls().run_platform_calls_once(8).expect("pool");
    assert_eq!(audit_actions(&s.app, "ORD_CLOSE_1"), ["platform_closed"], "one audit row");
}

#[test]
fn a_buyer_paying_right_now_is_not_closed_in_this_pass() {
    let (s, clock) = expired("ORD_PAYING_1");
    s.wechatpay.buyer_paying("ORD_PAYING_1").expect("paying");
    s.app.orders().close_expired(100).expect("sweep");
    s.app.platform_calls().run_platform_calls_once(8).expect("pool");
    assert_eq!(s.app.orders().order("ORD_PAYING_1").expect("detail").order.status, OrderStatus::Pending);
    assert!(!apis_called(&s.wechatpay).iter().any(|a| a.ends_with("/close")));
    s.wechatpay.buyer_pays("ORD_PAYING_1").expect("paid");
    clock.advance_ms(1_000);
    s.app.platform_calls().run_platform_calls_once(8).expect("pool");
    assert_eq!(s.app.orders().order("ORD_PAYING_1").expect("detail").order.status, OrderStatus::Paid);
}

#[test]
fn a_platform_down_keeps_the_order_pending_then_payonce_gives_up_and_says_so() {
    let (s, clock) = expired("ORD_DOWN_1");
    s.wechatpay.set_fault(Some(Fault::Refuse));
    s.app.orders().close_expired(100).expect("sweep");
    s.app.platform_calls().run_platform_calls_once(8).expect("pool");
    assert_eq!(
        s.app.orders().order("ORD_DOWN_1").expect("detail").order.status,
        OrderStatus::Pending,
        "Alipay alone cannot close it"
    );
    assert_eq!(s.app.platform_calls().run_platform_calls_once(8).expect("pool"), 0, "the retry waits for its back-off");
    clock.advance_ms(1_000);
    assert_eq!(s.app.platform_calls().run_platform_calls_once(8).expect("pool"), 1, "retried after the first wait");
    assert_eq!(s.app.orders().order("ORD_DOWN_1").expect("detail").order.status, OrderStatus::Pending);
    assert!(s.app.operations().inspect().expect("inspect").iter().all(|f| f.kind != "close_unconfirmed"));
    clock.advance_ms(GIVE_UP_MS);
    s.app.platform_calls().run_platform_calls_once(8).expect("pool");
    assert_eq!(
        s.app.orders().order("ORD_DOWN_1").expect("detail").order.status,
        OrderStatus::Closed,
        "closed here after giving up"
    );
    let findings = s.app.operations().inspect().expect("inspect");
    let unconfirmed: Vec<_> = findings.iter().filter(|f| f.kind == "close_unconfirmed").collect();
    assert_eq!(unconfirmed.len(), 1, "{findings:?}");
    assert_eq!(payonce::render::finding_detail(&unconfirmed[0].detail)["platforms"], serde_json::json!(["wechatpay"]));
    assert!(s.app.platform_calls().resolve_close("ORD_DOWN_1", "  ", "ops", None).is_err(), "a reason is required");
    s.app
        .platform_calls()
        .resolve_close("ORD_DOWN_1", "checked the WeChat Pay console: never paid", "ops", None)
        .expect("resolved");
    s.app.platform_calls().resolve_close("ORD_DOWN_1", "again", "ops", None).expect("a repeat answers the order");
    assert!(s.app.operations().inspect().expect("inspect").iter().all(|f| f.kind != "close_unconfirmed"));
    let actions = audit_actions(&s.app, "ORD_DOWN_1");
    assert_eq!(actions.iter().filter(|a| *a == "close_resolved").count(), 1, "{actions:?}");
    assert!(s
        .app
        .platform_calls()
        .resolve_close("ORD_NOTHING", "x", "ops", None)
        .is_err_and(|e| payonce::api::code_of(e.kind) == "order_not_found"));
}

#[test]
fn an_explicit_close_asks_the_platforms_first() {
    let s = setup();
    for order_no in ["ORD_EXP_PAID", "ORD_EXP_DOWN", "ORD_EXP_OK"] {
        order(&s.app, order_no);
        s.wechatpay.open_trade(order_no, 1000).expect("trade");
        s.alipay.open_trade(order_no, 1000).expect("trade");
    }
    s.alipay.buyer_pays("ORD_EXP_PAID").expect("paid");
    let refused = s.app.orders().close_order("ORD_EXP_PAID").expect_err("paid at Alipay");
    assert_eq!(
        (payonce::api::status_of(refused.kind), payonce::api::code_of(refused.kind)),
        (409, "invalid_transition")
    );
    assert!(refused.message.contains("PAID"), "{}", refused.message);
    assert_eq!(s.app.orders().order("ORD_EXP_PAID").expect("detail").order.status, OrderStatus::Paid);

    s.wechatpay.set_fault(Some(Fault::ServerError));
    let down = s.app.orders().close_order("ORD_EXP_DOWN").expect_err("WeChat Pay cannot confirm");
    assert_eq!((payonce::api::status_of(down.kind), payonce::api::code_of(down.kind)), (503, "platform_unavailable"));
    assert_eq!(s.app.orders().order("ORD_EXP_DOWN").expect("detail").order.status, OrderStatus::Pending);
    s.wechatpay.set_fault(None);

    let closed = s.app.orders().close_order("ORD_EXP_OK").expect("closed everywhere");
    assert_eq!(closed.status, OrderStatus::Closed);
    assert_eq!(audit_actions(&s.app, "ORD_EXP_OK"), ["platform_closed"]);
    assert_eq!(
        s.app.orders().close_order("ORD_EXP_OK").expect("again").status,
        OrderStatus::Closed,
        "a repeat answers the order"
    );
}

/// A crash between the platform's close and the local one: the row stays
/// pending with its lease; once the lease runs out the pool asks again,
/// hears "closed", and closes here, once.
#[test]
fn a_close_interrupted_after_the_platform_closed_finishes_once() {
    let (s, clock) = expired("ORD_CRASH_1");
    s.app.orders().close_expired(100).expect("sweep");
    // What a killed process leaves: both rows claimed (attempt 1, leased),
    // both trades closed at the platforms, nothing recorded, the order PENDING.
    let now = payonce::clock::format_ms(clock.now_ms());
    let lease = payonce::clock::format_ms(clock.now_ms() + 3_000);
    s.app
        .store()
        .execute_raw(&format!(
        "UPDATE platform_call SET attempts = 1, next_attempt_at = '{lease}', updated_at = '{now}' WHERE kind = 'close'"
    ))
        .expect("leased");
    let wechat = s.app.config().platforms.registry.calls("wechatpay").expect("wechatpay");
    let alipay = s.app.config().platforms.registry.calls("alipay").expect("alipay");
    assert_eq!(wechat.close("ORD_CRASH_1", clock.now_ms()).meaning, payonce::platforms::CloseAnswer::Closed);
    assert_eq!(alipay.close("ORD_CRASH_1", clock.now_ms()).meaning, payonce::platforms::CloseAnswer::Closed);
    assert_eq!(s.app.platform_calls().run_platform_calls_once(8).expect("pool"), 0, "leased: nobody else takes it");
    clock.advance_ms(3_001);
    assert_eq!(s.app.platform_calls().run_platform_calls_once(8).expect("pool"), 2);
    assert_eq!(s.app.orders().order("ORD_CRASH_1").expect("detail").order.status, OrderStatus::Closed);
    assert_eq!(audit_actions(&s.app, "ORD_CRASH_1"), ["platform_closed"]);
}

/// A paid order whose payment was taken by `channel` (its notification
/// delivered), the trade paid at that platform.
fn paid_by(s: &Setup, channel: &str, order_no: &str) {
    order(&s.app, order_no);
    let api = if channel == "wechatpay" { &s.wechatpay } else { &s.alipay };
    api.open_trade(order_no, 1000).expect("trade");
    let pay_no = api.buyer_pays(order_no).expect("paid");
    let reply = s
        .app
        .payments()
        .deliver_payment(&payonce::PaymentCallback {
            channel: channel.into(),
            pay_no,
            order_no: order_no.into(),
            amount: 1000,
            currency: None,
            status: payonce::PlatformStatus::Success,
            paid_at: None,
            raw_body: b"{}".to_vec(),
        })
        .expect("payment");
    assert_eq!(reply.outcome_str(), "applied");
}

/// refund_submitted: one submission per refund_no across retries and
/// rounds (a restart is a new round on the same rows); the late result is
/// fetched by the refund query and settled through deliver_refund.
#[test]
fn a_refund_is_submitted_once_retried_until_accepted_and_its_late_result_queried() {
    let clock = Clock::manual(Clock::System.now_ms());
    let s = setup_with(clock.clone());
    paid_by(&s, "wechatpay", "ORD_REFUND_1");
    s.wechatpay.set_fault(Some(Fault::ServerError));
    s.app.refunds().request_refund("ORD_REFUND_1", "RF_1").expect("refund requested");
    s.app.refunds().request_refund("ORD_REFUND_1", "RF_1").expect("the same request again changes nothing");
    assert_eq!(s.app.platform_calls().run_platform_calls_once(8).expect("pool"), 1);
    assert!(s.wechatpay.refunds().is_empty(), "not accepted while WeChat Pay fails");
    s.wechatpay.set_fault(None);
    assert_eq!(s.app.platform_calls().run_platform_calls_once(8).expect("pool"), 0, "the retry waits");
    clock.advance_ms(1_000);
    assert_eq!(s.app.platform_calls().run_platform_calls_once(8).expect("pool"), 1);
    assert_eq!(s.app.platform_calls().run_platform_calls_once(8).expect("pool"), 0, "accepted: never submitted again");
    let refunds = s.wechatpay.refunds();
    assert_eq!(refunds.len(), 1, "one refund at the platform");
    assert_eq!((refunds[0].out_refund_no.as_str(), refunds[0].amount), ("RF_1", 1000));
    let submissions = s.wechatpay.calls().into_iter().filter(|c| c.api == "/v3/refund/domestic/refunds").count();
    assert_eq!(submissions, 2, "the failed attempt and the accepted one, both with out_refund_no RF_1");

    // The result notification is late: after --refund-query-after-s the query asks.
    clock.advance_ms(REFUND_QUERY_AFTER_MS - 1_000);
    assert_eq!(s.app.platform_calls().run_platform_calls_once(8).expect("pool"), 0, "not before the query is due");
    clock.advance_ms(1_000);
    assert_eq!(s.app.platform_calls().run_platform_calls_once(8).expect("pool"), 1, "queried: still PROCESSING");
    assert_eq!(s.app.orders().order("ORD_REFUND_1").expect("detail").order.status, OrderStatus::Refunding);
    assert!(s.wechatpay.settle_refund("RF_1", RefundStatus::Success));
    clock.advance_ms(1_000);
    assert_eq!(s.app.platform_calls().run_platform_calls_once(8).expect("pool"), 1);
    assert_eq!(s.app.orders().order("ORD_REFUND_1").expect("detail").order.status, OrderStatus::Refunded);
    assert_eq!(s.wechatpay.refunds().len(), 1);
}

#[test]
fn an_alipay_refund_settles_through_its_query_and_a_notification_first_stops_the_query() {
    let clock = Clock::manual(Clock::System.now_ms());
    let s = setup_with(clock.clone());
    paid_by(&s, "alipay", "ORD_REFUND_2");
    paid_by(&s, "alipay", "ORD_REFUND_3");
    s.app.refunds().request_refund("ORD_REFUND_2", "RF_2").expect("refund");
    s.app.refunds().request_refund("ORD_REFUND_3", "RF_3").expect("refund");
    assert_eq!(s.app.platform_calls().run_platform_calls_once(8).expect("pool"), 2, "both submitted");
    assert_eq!(s.alipay.refunds().len(), 2);
    assert!(s.wechatpay.calls().is_empty(), "a refund goes only to the platform that took the payment");
    // RF_3's notification arrives before its query is due: the query then asks nothing.
    let settled = s
        .app
        .refunds()
        .deliver_refund(&payonce::RefundCallback {
            channel: "alipay".into(),
            refund_no: "RF_3".into(),
            order_no: "ORD_REFUND_3".into(),
            status: payonce::PlatformStatus::Success,
            settled_at: None,
            amount: None,
            refunded_total: None,
        })
        .expect("notification");
    assert_eq!(format!("{settled:?}"), format!("{:?}", payonce::RefundOutcome::Applied));
    assert!(s.alipay.settle_refund("RF_2", RefundStatus::Success));
    clock.advance_ms(REFUND_QUERY_AFTER_MS);
    let before = s.alipay.calls().len();
    assert_eq!(s.app.platform_calls().run_platform_calls_once(8).expect("pool"), 2);
    assert_eq!(s.alipay.calls().len(), before + 1, "only RF_2 is queried");
    assert_eq!(s.app.orders().order("ORD_REFUND_2").expect("detail").order.status, OrderStatus::Refunded);
}

/// WeChat Pay answers signed with the key of an expired platform
/// certificate count as no answer; the same key in a valid certificate verifies.
#[test]
fn an_expired_platform_certificate_is_refused() {
    let platform_key_pem = include_str!("../../../tests/fixtures/keys/platform.pem");
    let expired_pem = include_str!("../../../tests/fixtures/keys/platform-cert-expired.pem");
    let valid_pem = include_str!("../../../tests/fixtures/keys/platform-cert-valid.pem");
    let mut config = WechatpayApiConfig::new(MERCHANT_SERIAL, merchant_public_key());
    config.platform_key = Some(RsaPrivateKey::from_pkcs8_pem(platform_key_pem).expect("fixture"));
    let wechatpay = PlatformApi::start_wechatpay(config).expect("the WeChat Pay API");
    wechatpay.open_trade("ORD_CERT_1", 1000).expect("trade");
    wechatpay.buyer_pays("ORD_CERT_1").expect("paid");
    let serial = wechatpay.platform_serial().expect("serial").to_owned();
    let client = |certificate: &str| {
        let mut api = WechatpayApi::new(
            wechatpay.merchant_id().to_owned(),
            MERCHANT_SERIAL.to_owned(),
            MerchantKey::from_pem(MERCHANT_KEY_PEM).expect("merchant key"),
            &wechatpay.base_url(),
            vec![(serial.clone(), payonce::platforms::wechatpay::public_key_from_pem(certificate).expect("key"))],
            TIMEOUT,
        );
        api.set_certificate_expiries(
            payonce::platforms::wechatpay::certificate_not_after_ms(certificate)
                .map(|not_after| vec![(serial.clone(), not_after)])
                .unwrap_or_default(),
        );
        api
    };
    let now = Clock::System.now_ms();
    let refused = client(expired_pem).query("ORD_CERT_1", now);
    assert_eq!(refused.meaning, TradeState::Unknown);
    assert!(refused.distrust.as_deref().is_some_and(|why| why.contains("expired")), "{:?}", refused.distrust);
    let trusted = client(valid_pem).query("ORD_CERT_1", now);
    assert!(matches!(trusted.meaning, TradeState::Paid { .. }), "{:?}", trusted.distrust);
}

/// At most four API requests wait on the platforms at once; the rest are
/// 503 `platform_unavailable` at once, not a fifth thread held up.
#[test]
fn at_most_four_explicit_closes_wait_on_the_platforms() {
    let s = setup();
    for n in 0..5 {
        order(&s.app, &format!("ORD_WAIT_{n}"));
    }
    s.wechatpay.set_fault(Some(Fault::Hang));
    let app = &s.app;
    let answers: Vec<Result<payonce::domain::Order, payonce::Error>> = std::thread::scope(|scope| {
        let waiting: Vec<_> =
            (0..4).map(|n| scope.spawn(move || app.orders().close_order(&format!("ORD_WAIT_{n}")))).collect();
        // The four are inside their platform calls (each bounded by the timeout).
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while s.wechatpay.calls().iter().filter(|c| c.status.is_none()).count() < 4 {
            assert!(std::time::Instant::now() < deadline, "the four closes never reached WeChat Pay");
            std::thread::sleep(Duration::from_millis(10));
        }
        let started = std::time::Instant::now();
        let fifth = app.orders().close_order("ORD_WAIT_4");
        assert!(started.elapsed() < Duration::from_millis(500), "the fifth is refused at once");
        let mut answers: Vec<_> = waiting.into_iter().map(|h| h.join().expect("close")).collect();
        answers.push(fifth);
        answers
    });
    for answer in &answers {
        let e = answer.as_ref().expect_err("no platform confirmed");
        assert_eq!((payonce::api::status_of(e.kind), payonce::api::code_of(e.kind)), (503, "platform_unavailable"));
    }
    for n in 0..5 {
        assert_eq!(s.app.orders().order(&format!("ORD_WAIT_{n}")).expect("detail").order.status, OrderStatus::Pending);
    }
}

/// Paid at one platform while its close was queued: the other platform's
/// trade is closed all the same, so the buyer cannot pay the order twice.
#[test]
fn an_order_paid_at_one_platform_is_still_closed_at_the_other() {
    let (s, _clock) = expired("ORD_OTHER_1");
    s.wechatpay.buyer_pays("ORD_OTHER_1").expect("paid at WeChat Pay");
    s.app.orders().close_expired(100).expect("sweep");
    // One row a round: WeChat Pay's first (it was queued first), which applies the payment.
    assert_eq!(s.app.platform_calls().run_platform_calls_once(1).expect("pool"), 1);
    assert_eq!(s.app.orders().order("ORD_OTHER_1").expect("detail").order.status, OrderStatus::Paid);
    assert_eq!(s.app.platform_calls().run_platform_calls_once(1).expect("pool"), 1);
    assert_eq!(s.alipay.trade_state("ORD_OTHER_1"), Some("TRADE_CLOSED"), "closed at Alipay too");
    assert!(s.alipay.buyer_pays("ORD_OTHER_1").is_err(), "no second payment there");
    assert_eq!(s.app.orders().order("ORD_OTHER_1").expect("detail").order.status, OrderStatus::Paid);
    assert!(!audit_actions(&s.app, "ORD_OTHER_1").contains(&"platform_closed".to_owned()));
}

#[test]
fn a_payment_answered_in_another_currency_is_amount_mismatch_not_paid() {
    let s = setup();
    order(&s.app, "ORD_CURRENCY_1");
    s.wechatpay.open_trade("ORD_CURRENCY_1", 1000).expect("trade");
    let pay_no = s.wechatpay.buyer_pays("ORD_CURRENCY_1").expect("paid at WeChat Pay");
    s.wechatpay.set_fault(Some(Fault::Currency("USD".into())));

    let synced = s.app.platform_calls().sync_order("ORD_CURRENCY_1").expect("sync");
    assert!(
        matches!(&synced.platforms[0].state, TradeState::Paid { currency, .. } if currency == "USD"),
        "{:?}",
        synced.platforms[0].state
    );
    assert_eq!(synced.order.status, OrderStatus::Pending, "1000 USD does not pay 1000 CNY");
    let detail = s.app.orders().order("ORD_CURRENCY_1").expect("detail");
    assert_eq!(detail.payments.len(), 1);
    assert_eq!(
        (detail.payments[0].pay_no.as_str(), detail.payments[0].outcome.as_str()),
        (pay_no.as_str(), "amount_mismatch")
    );
}
