//! A platform from outside the crate, registered through the registry
//! (`Registry::with`): a notice and an outgoing call route through its two
//! trait objects like any shipped platform's (src/platforms/mod.rs).
//!
//! The store's CHECKs name the channels payonce ships (schema.sql:
//! `pay_callback_log.channel`, `platform_call.channel`), so the fake takes
//! the name `wechatpay`, in place of WeChat Pay: every notice and call of
//! that name then goes to the fake's code, none to WeChat Pay's.

use payonce::api::{self, Request, Response};
use payonce::platforms::{Calls, PrepayAnswer, PrepayRequest, RefundRequest};
use payonce::platforms::{
    CloseAnswer, Exchange, Notice, Notices, Platform, Platforms, RefundAnswer, RefundState, Reply, TradeState,
};
use payonce::{App, Clock, Config, CreateOrder, Error, OrderStatus, PaymentCallback, PlatformStatus};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

const T0_MS: i64 = 1_700_000_000_000;
/// The channel the fake answers for.
const NAME: &str = "wechatpay";

/// A platform whose notices are `PAID order_no pay_no amount` in plain
/// text, unsigned (a test's), and whose API says every order is paid.
struct Fake {
    queries: Arc<AtomicUsize>,
}

impl Notices for Fake {
    fn name(&self) -> &'static str {
        NAME
    }

    fn parse(&self, _now_ms: i64, req: &Request, _refund_route: bool) -> Result<Notice, Error> {
        let text = String::from_utf8(req.body.clone()).map_err(|_| Error::invalid("not UTF-8"))?;
        let ["PAID", order_no, pay_no, amount] = text.split(' ').collect::<Vec<_>>()[..] else {
            return Err(Error::invalid("expected PAID order_no pay_no amount"));
        };
        Ok(Notice::Payment(PaymentCallback {
            channel: NAME.into(),
            pay_no: pay_no.into(),
            order_no: order_no.into(),
            amount: amount.parse().map_err(|_| Error::invalid("amount"))?,
            currency: Some("CNY".into()),
            status: PlatformStatus::Success,
            paid_at: None,
            raw_body: req.body.clone(),
        }))
    }

    fn acknowledge(&self, _reply: &Reply) -> Response {
        Response { status: 200, headers: Vec::new(), body: b"fake-ok".to_vec(), outcome: None }
    }

    fn refuse(&self, err: &Error) -> Response {
        Response {
            status: payonce::api::status_of(err.kind),
            headers: Vec::new(),
            body: b"fake-no".to_vec(),
            outcome: None,
        }
    }
}

impl Calls for Fake {
    fn name(&self) -> &'static str {
        NAME
    }

    fn endpoint(&self) -> &str {
        "in-process"
    }

    fn query(&self, order_no: &str, _now_ms: i64) -> Exchange<TradeState> {
        self.queries.fetch_add(1, Ordering::SeqCst);
        let state =
            TradeState::Paid { pay_no: format!("FQ-{order_no}"), amount: 500, currency: "CNY".into(), paid_at: None };
        Exchange {
            request: format!("query {order_no}"),
            http_status: Some(200),
            response: "paid".into(),
            meaning: state,
            distrust: None,
        }
    }

    fn close(&self, _order_no: &str, _now_ms: i64) -> Exchange<CloseAnswer> {
        unreachable!("the test never closes")
    }

    fn refund(&self, _: &RefundRequest<'_>, _: i64) -> Exchange<RefundAnswer> {
        unreachable!("the test never refunds")
    }

    fn refund_query(&self, _: &str, _: &str, _: Option<&str>, _: i64) -> Exchange<RefundState> {
        unreachable!("the test never queries a refund")
    }

    fn prepay_methods(&self) -> &'static [&'static str] {
        unreachable!("the test never pays")
    }

    fn prepay(&self, _: &PrepayRequest<'_>, _: i64) -> Exchange<PrepayAnswer> {
        unreachable!("the test never pays")
    }

    fn prepay_check(&self, _: &PrepayRequest<'_>) -> Result<(), String> {
        unreachable!("the test never pays")
    }
}

fn order(app: &App, order_no: &str) {
    let order = CreateOrder {
        order_no: order_no.into(),
        user_id: "u1".into(),
        amount: 500,
        currency: "CNY".into(),
        expires_in_s: None,
    };
    app.orders().create_order(&order).expect("order");
}

#[test]
fn a_platform_registered_from_outside_takes_notices_and_calls() {
    let queries = Arc::new(AtomicUsize::new(0));
    let fake = || Fake { queries: Arc::clone(&queries) };
    let config = Config { platforms: Platforms::with([Platform::both(fake(), fake())]), ..Config::default() };
    let app = App::open(":memory:", Clock::manual(T0_MS), config).expect("open");
    assert_eq!(app.config().platforms.channels(), [NAME]);

    // A notice: /v1/callbacks/{NAME} routes to its Notices, in its protocol.
    order(&app, "ORD-F1");
    let request = |body: &[u8]| Request {
        method: "POST".into(),
        path: format!("/v1/callbacks/{NAME}"),
        query: String::new(),
        headers: Vec::new(),
        body: body.to_vec(),
    };
    let answer = api::handle(&app, &request(b"PAID ORD-F1 FP-1 500"));
    assert_eq!((answer.status, answer.body.as_slice()), (200, &b"fake-ok"[..]));
    let detail = app.orders().order("ORD-F1").expect("order");
    assert_eq!(detail.order.status, OrderStatus::Paid);
    assert_eq!((detail.payments[0].pay_no.as_str(), detail.payments[0].channel.as_str()), ("FP-1", NAME));
    let refused = api::handle(&app, &request(b"something else"));
    assert_eq!((refused.status, refused.body.as_slice()), (400, &b"fake-no"[..]));

    // An outgoing call: sync asks it through its Calls and applies the answer.
    order(&app, "ORD-F2");
    let synced = app.platform_calls().sync_order("ORD-F2").expect("sync");
    assert_eq!(queries.load(Ordering::SeqCst), 1);
    assert_eq!(synced.platforms.len(), 1);
    assert_eq!(synced.platforms[0].channel, NAME);
    assert_eq!(synced.order.status, OrderStatus::Paid);
    assert_eq!(app.orders().order("ORD-F2").expect("order").payments[0].pay_no, "FQ-ORD-F2");
}
