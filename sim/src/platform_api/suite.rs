//! The shared platform suite: `for_each_platform!` runs each case over every
//! platform with a merchant API, payonce's own `Calls` (src/platforms/)
//! against this crate's simulated server of that platform, over real
//! sockets. A case becomes `<case>::wechatpay` and `<case>::alipay`; a new
//! platform is one more line in the macro (docs/platforms.md).

use super::tests::{connect, AliWire, Missigned, Wire, WxWire};
use super::*;
use payonce::platforms::alipay::AlipayApi;
use payonce::platforms::wechatpay::WechatpayApi;
use payonce::platforms::{Calls, CloseAnswer, MerchantKey, RefundAnswer, RefundRequest, RefundState, TradeState};
use payonce::{Clock, PlatformStatus};
use rsa::pkcs8::DecodePrivateKey;

/// payonce's merchant key: the 2048-bit fixture (ring signs with no less).
const MERCHANT_KEY_PEM: &str = include_str!("../../../tests/fixtures/keys/merchant.pem");
const MERCHANT_SERIAL: &str = "3A1F0C2B9D8E7F6A5B4C3D2E1F0A9B8C7D6E5F4A";
const TIMEOUT: Duration = Duration::from_millis(1_500);

/// One platform's simulated server and payonce's calls to it.
struct Pair {
    api: PlatformApi,
    calls: Box<dyn Calls>,
    /// An order number the platform can carry, unique in the test.
    order: fn(&str) -> String,
    /// The merchant's requests at the wire, signed by tests.rs's own lines.
    wire: for<'a> fn(&'a PlatformApi) -> Box<dyn Wire + 'a>,
}

fn merchant_key() -> MerchantKey {
    MerchantKey::from_pem(MERCHANT_KEY_PEM).expect("merchant key")
}

fn merchant_private_key() -> RsaPrivateKey {
    RsaPrivateKey::from_pkcs8_pem(MERCHANT_KEY_PEM).expect("the fixture key")
}

fn merchant_public_key() -> RsaPublicKey {
    merchant_private_key().to_public_key()
}

fn wechatpay(timeout: Duration) -> Pair {
    let api = PlatformApi::start_wechatpay(WechatpayApiConfig::new(MERCHANT_SERIAL, merchant_public_key()))
        .expect("the WeChat Pay API");
    let key = (api.platform_serial().expect("serial").to_owned(), api.platform_public_key().clone());
    let calls = WechatpayApi::new(
        api.merchant_id().to_owned(),
        MERCHANT_SERIAL.to_owned(),
        merchant_key(),
        &api.base_url(),
        vec![key],
        timeout,
    );
    Pair { api, calls: Box::new(calls), order: |n| format!("ORDER-{n}"), wire: wechatpay_wire }
}

fn wechatpay_wire(api: &PlatformApi) -> Box<dyn Wire + '_> {
    let conn = connect(api);
    Box::new(WxWire { api, key: merchant_private_key(), serial: MERCHANT_SERIAL, conn, refund_id: None, sent: 0 })
}

fn alipay(timeout: Duration) -> Pair {
    let api = PlatformApi::start_alipay(AlipayApiConfig::new(merchant_public_key())).expect("the Alipay API");
    let calls = AlipayApi::new(
        api.merchant_id().to_owned(),
        merchant_key(),
        &api.endpoint(),
        api.platform_public_key().clone(),
        timeout,
    );
    Pair { api, calls: Box::new(calls), order: |n| format!("ORDER_{n}"), wire: alipay_wire }
}

fn alipay_wire(api: &PlatformApi) -> Box<dyn Wire + '_> {
    Box::new(AliWire { api, key: merchant_private_key(), conn: connect(api), sent: 0 })
}

/// Each case, once per platform: `fn case(start: fn(Duration) -> Pair)`.
macro_rules! for_each_platform {
    ($($(#[$meta:meta])* fn $case:ident($start:ident: fn(Duration) -> Pair) $body:block)*) => {
        $(
            mod $case {
                use super::*;

                $(#[$meta])*
                fn case($start: fn(Duration) -> Pair) $body

                #[test]
                fn wechatpay() {
                    case(super::wechatpay)
                }

                #[test]
                fn alipay() {
                    case(super::alipay)
                }
            }
        )*
    };
}

/// The platform's word for a closed trade.
fn closed_state(api: &PlatformApi) -> &'static str {
    if api.platform() == Platform::Alipay {
        "TRADE_CLOSED"
    } else {
        "CLOSED"
    }
}

/// The platform's word for a paid trade.
fn paid_state(api: &PlatformApi) -> &'static str {
    if api.platform() == Platform::Alipay {
        "TRADE_SUCCESS"
    } else {
        "SUCCESS"
    }
}

/// The platform's word for a trade waiting for its buyer.
fn unpaid_state(api: &PlatformApi) -> &'static str {
    if api.platform() == Platform::Alipay {
        "WAIT_BUYER_PAY"
    } else {
        "NOTPAY"
    }
}

fn now() -> i64 {
    Clock::System.now_ms()
}

for_each_platform! {
    /// Query, close, refund and refund query, each answer verified and read.
    fn round_trip(start: fn(Duration) -> Pair) {
        let Pair { api, calls, order, .. } = start(TIMEOUT);
        let (paid_no, closed_no) = (order("RT1"), order("RT2"));
        api.open_trade(&paid_no, 990).expect("open");
        assert_eq!(calls.query(&paid_no, now()).meaning, TradeState::NotPaid { paying: false });
        let pay_no = api.buyer_pays(&paid_no).expect("paid");
        let paid = calls.query(&paid_no, now());
        assert!(
            matches!(&paid.meaning, TradeState::Paid { pay_no: p, amount: 990, currency, .. } if *p == pay_no && currency == "CNY"),
            "{paid:?}"
        );
        assert_eq!(calls.close(&paid_no, now()).meaning, CloseAnswer::Paid, "a paid trade does not close");
        let refund_no = order("RF1");
        assert_eq!(calls.refund(&refund(&paid_no, &refund_no, 990), now()).meaning, RefundAnswer::Accepted);
        assert_eq!(calls.refund(&refund(&paid_no, &refund_no, 990), now()).meaning, RefundAnswer::Accepted, "a retry");
        assert_eq!(api.refunds().len(), 1, "one refund for one refund_no");
        assert_eq!(calls.refund_query(&paid_no, &refund_no, None, now()).meaning, RefundState::NotYet);
        assert!(api.settle_refund(&refund_no, RefundStatus::Success));
        assert_eq!(
            calls.refund_query(&paid_no, &refund_no, None, now()).meaning,
            RefundState::Settled(PlatformStatus::Success)
        );
        api.open_trade(&closed_no, 100).expect("open");
        assert_eq!(calls.close(&closed_no, now()).meaning, CloseAnswer::Closed);
        assert_eq!(api.buyer_pays(&closed_no), Err(Refused::Closed));
        assert_eq!(calls.query(&closed_no, now()).meaning, TradeState::Closed);
        // Closed again: WeChat Pay says ORDER_CLOSED, Alipay ACQ.TRADE_STATUS_ERROR
        // (query again and decide); either way an answer.
        assert_ne!(calls.close(&closed_no, now()).meaning, CloseAnswer::Unknown, "closed again");
        let unknown = order("NONE");
        assert_eq!(calls.query(&unknown, now()).meaning, TradeState::NotPaid { paying: false });
        assert_eq!(calls.close(&unknown, now()).meaning, CloseAnswer::Closed, "no such trade counts as closed");
        assert!(api.calls().iter().all(|c| c.verified), "every request verified at the platform");
    }

    /// A tampered answer is no answer, though the call took effect.
    fn tampered_answer(start: fn(Duration) -> Pair) {
        let Pair { api, calls, order, .. } = start(TIMEOUT);
        let (queried, closed) = (order("TA1"), order("TA2"));
        api.open_trade(&queried, 250).expect("open");
        api.buyer_pays(&queried).expect("paid");
        api.open_trade(&closed, 250).expect("open");
        api.set_fault(Some(Fault::TamperAnswers));
        let answer = calls.query(&queried, now());
        assert_eq!(answer.meaning, TradeState::Unknown);
        assert!(answer.distrust.as_deref().is_some_and(|why| why.contains("verify")), "{:?}", answer.distrust);
        assert_eq!(calls.close(&closed, now()).meaning, CloseAnswer::Unknown);
        assert_eq!(api.trade_state(&closed), Some(closed_state(&api)), "the close took effect");
    }

    /// A correctly signed answer about another merchant or trade is no answer:
    /// a query's, and a refund's.
    fn wrong_merchant_or_trade(start: fn(Duration) -> Pair) {
        let Pair { api, calls, order, .. } = start(TIMEOUT);
        let no = order("WM1");
        api.open_trade(&no, 100).expect("open");
        api.buyer_pays(&no).expect("paid");
        for fault in [Fault::WrongMerchant, Fault::WrongTrade] {
            api.set_fault(Some(fault.clone()));
            let answer = calls.query(&no, now());
            // Alipay's answers name no merchant: WrongMerchant leaves them as they are.
            let expect_unknown = fault == Fault::WrongTrade || api.platform() == Platform::Wechatpay;
            assert_eq!(answer.meaning == TradeState::Unknown, expect_unknown, "{fault:?}: {answer:?}");
        }
        // A refund answer about another trade is no answer, as a tampered
        // one is, though the refund took effect.
        api.set_fault(Some(Fault::WrongTrade));
        let refund_no = order("WMR1");
        let answer = calls.refund(&refund(&no, &refund_no, 100), now());
        assert_eq!(answer.meaning, RefundAnswer::Unknown, "{answer:?}");
        assert_eq!(api.refunds().len(), 1, "refunded at the platform all the same");
        api.set_fault(None);
        assert_eq!(calls.refund(&refund(&no, &refund_no, 100), now()).meaning, RefundAnswer::Accepted, "the retry");
    }

    /// A call that outlives the timeout has no answer; the call took effect.
    fn timeout(start: fn(Duration) -> Pair) {
        let Pair { api, calls, order, .. } = start(Duration::from_millis(200));
        let no = order("TO1");
        api.open_trade(&no, 100).expect("open");
        api.set_fault(Some(Fault::Slow(Duration::from_millis(600))));
        let answer = calls.close(&no, now());
        assert_eq!(answer.meaning, CloseAnswer::Unknown);
        assert_eq!(answer.http_status, None, "{answer:?}");
        assert_eq!(api.trade_state(&no), Some(closed_state(&api)), "closed at the platform all the same");
        api.set_fault(None);
        assert_eq!(calls.query(&no, now()).meaning, TradeState::Closed);
    }

    /// A 5xx is no answer and does nothing; the next call is served.
    fn server_error(start: fn(Duration) -> Pair) {
        let Pair { api, calls, order, .. } = start(TIMEOUT);
        let no = order("SE1");
        api.open_trade(&no, 100).expect("open");
        api.fail_next(Fault::ServerError, 2);
        for _ in 0..2 {
            let answer = calls.close(&no, now());
            assert_eq!((answer.meaning, answer.http_status), (CloseAnswer::Unknown, Some(500)));
            assert_eq!(api.trade_state(&no), Some(unpaid_state(&api)), "a 500 does nothing");
        }
        assert_eq!(calls.close(&no, now()).meaning, CloseAnswer::Closed);
        let statuses: Vec<Option<u16>> = api.calls().iter().map(|c| c.status).collect();
        let closed = if api.platform() == Platform::Alipay { 200 } else { 204 };
        assert_eq!(statuses, [Some(500), Some(500), Some(closed)]);
    }

    /// Every answer at the wire, each request signed by tests.rs's own lines
    /// (not payonce's): the steps, states, numbers and signatures here, what
    /// only one platform answers in its `Wire` hooks.
    fn wire_round_trip(start: fn(Duration) -> Pair) {
        let pair = start(TIMEOUT);
        let (api, order) = (&pair.api, pair.order);
        let mut wire = (pair.wire)(api);
        let (no, closed_no, unknown, refund_no) = (order("W1"), order("W2"), order("NONE"), order("RF1"));
        let amount = 1000;
        api.open_trade(&no, amount).expect("open");
        let unpaid = wire.query(&no);
        assert!(unpaid.verified);
        assert_eq!(wire.state_of(&unpaid).as_deref(), Some(unpaid_state(api)), "{}", unpaid.json);
        assert_eq!((unpaid.json["out_trade_no"].as_str(), wire.amount_of(&unpaid)), (Some(no.as_str()), Some(amount)));
        wire.expect_unpaid(&unpaid);
        let pay_no = api.buyer_pays(&no).expect("paid");
        let paid = wire.query(&no);
        assert!(paid.verified);
        assert_eq!(wire.state_of(&paid).as_deref(), Some(paid_state(api)), "{}", paid.json);
        assert_eq!((wire.pay_no_of(&paid), paid.json["out_trade_no"].as_str()), (Some(pay_no.clone()), Some(no.as_str())));
        wire.expect_paid(&paid, amount);
        let refused = wire.close(&no);
        assert!(refused.verified, "a paid trade does not close, signed");
        wire.expect_close_refused(&refused);
        for first in [true, false] {
            let refund = wire.refund(&no, &refund_no, amount);
            assert!(refund.verified);
            wire.expect_refund_accepted(&refund, &pay_no, amount, first);
        }
        assert_eq!(api.refunds().len(), 1, "one refund for one refund number");
        let pending = wire.refund_query(&no, &refund_no);
        assert!(pending.verified);
        wire.expect_refund_pending(&pending, amount);
        assert!(api.settle_refund(&refund_no, RefundStatus::Success));
        let settled = wire.refund_query(&no, &refund_no);
        assert!(settled.verified);
        wire.expect_refund_settled(&settled);
        wire.expect_refunded(&no, &refund_no);
        // Close, then the buyer is refused; closed again is still an answer.
        api.open_trade(&closed_no, 1).expect("open");
        let closed = wire.close(&closed_no);
        assert!(closed.verified);
        wire.expect_closed(&closed, &closed_no);
        assert_eq!(api.buyer_pays(&closed_no), Err(Refused::Closed));
        let status = wire.query(&closed_no);
        assert_eq!((wire.state_of(&status).as_deref(), wire.amount_of(&status)), (Some(closed_state(api)), Some(1)));
        let again = wire.close(&closed_no);
        assert!(again.verified);
        wire.expect_closed_again(&again);
        // Unknown numbers, as each platform answers them.
        let (query, close) = (wire.query(&unknown), wire.close(&unknown));
        assert!(query.verified && close.verified);
        wire.expect_unknown_query(&query);
        wire.expect_unknown_close(&close);
        wire.only_here();
        // Every request recorded, over the one keep-alive connection, verified.
        let calls = api.calls();
        assert_eq!(calls.len(), wire.sent());
        assert!(calls.iter().all(|c| c.verified), "{calls:?}");
        wire.expect_calls(&calls, &no, &refund_no);
    }

    /// A request the merchant did not sign as it signs is refused with an
    /// answer signed all the same, and nothing refused is acted on; what
    /// only one platform refuses is in its `Wire` hooks (tests.rs).
    fn refuses_requests_the_merchant_did_not_sign(start: fn(Duration) -> Pair) {
        let pair = start(TIMEOUT);
        let (api, order) = (&pair.api, pair.order);
        let mut wire = (pair.wire)(api);
        let no = order("NS1");
        api.open_trade(&no, 100).expect("open");
        for Missigned { case, answer, code } in wire.missigned(&no) {
            assert!(answer.verified, "{case}: refusals are signed too");
            wire.expect_missigned(case, &answer, code);
        }
        // The signature covers the request: changed after signing, refused.
        let changed = wire.changed_after_signing(&no);
        assert!(changed.verified, "signed too");
        wire.expect_changed_after_signing(&changed);
        wire.signing_only_here(&no);
        // Every request refused at verification but the last one.
        let calls = api.calls();
        let verified: Vec<bool> = calls.iter().map(|c| c.verified).collect();
        let mut expected = vec![false; wire.sent() - 1];
        expected.push(true);
        assert_eq!(verified, expected, "{calls:?}");
        assert_eq!(api.trade_state(&no), Some(unpaid_state(api)), "nothing refused was acted on");
    }
}

/// A refund of `amount` fen of `order_no` under `refund_no`.
fn refund<'a>(order_no: &'a str, refund_no: &'a str, amount: i64) -> RefundRequest<'a> {
    RefundRequest { order_no, refund_no, amount, total: amount, currency: "CNY", reason: None, pay_no: None }
}
