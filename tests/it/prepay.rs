//! `POST /v1/orders/{order_no}/pay` against a scripted platform in this
//! process, on both engines: one platform call per order and channel however
//! many requests arrive, the bounded wait, the reuse window, and every
//! refusal (docs/platforms.md, "Paying"). The same over real sockets
//! against the simulated WeChat Pay and Alipay, across two processes and
//! through a SIGKILL, is sim/tests/prepay.rs.
//!
//! The fake takes the name `wechatpay`: the schema's CHECKs name the
//! channels payonce ships.

use parking_lot::Mutex;
use payonce::api::{self, Request, Response};
use payonce::platforms::{
    CloseAnswer, Exchange, Payment, Platform, Platforms, PrepayAnswer, PrepayRequest, RefundAnswer, RefundRequest,
    RefundState, Registry, TradeState,
};
use payonce::{App, Clock, Config, CreateOrder, OrderStatus};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

const T0_MS: i64 = 1_700_000_000_000;
const NAME: &str = "wechatpay";
const APPID: &str = "wx0000000000000001";
const TIMEOUT_MS: u64 = 400;
const REUSE_MS: i64 = 60_000;

/// What the scripted platform answers the next payment creations.
#[derive(Clone, Debug, PartialEq)]
enum Script {
    Create,
    Paid,
    Closed,
    Refused,
    Unknown,
}

/// What the platform saw and how it answers, shared with the test.
#[derive(Default)]
struct Seen {
    prepays: AtomicUsize,
    delay_ms: AtomicU64,
    script: Mutex<Option<Script>>,
    /// What each call sent.
    requests: Mutex<Vec<Sent>>,
    /// The trade is paid at the platform (its query says so).
    paid_amount: Mutex<Option<i64>>,
}

/// One payment creation as the platform received it.
#[derive(Clone, Debug, PartialEq)]
struct Sent {
    out_trade_no: String,
    method: String,
    appid: Option<String>,
    openid: Option<String>,
    description: String,
    notify_url: String,
    expires_at_ms: i64,
}

struct Scripted(Arc<Seen>);

impl payonce::platforms::Calls for Scripted {
    fn name(&self) -> &'static str {
        NAME
    }

    fn endpoint(&self) -> &str {
        "in-process"
    }

    fn query(&self, order_no: &str, _now_ms: i64) -> Exchange<TradeState> {
        let state = match *self.0.paid_amount.lock() {
            Some(amount) => {
                TradeState::Paid { pay_no: format!("TX-{order_no}"), amount, currency: "CNY".into(), paid_at: None }
            }
            None => TradeState::NotPaid { paying: false },
        };
        Exchange {
            request: format!("query {order_no}"),
            http_status: Some(200),
            response: "{}".into(),
            meaning: state,
            distrust: None,
        }
    }

    fn close(&self, order_no: &str, _now_ms: i64) -> Exchange<CloseAnswer> {
        Exchange {
            request: format!("close {order_no}"),
            http_status: Some(204),
            response: String::new(),
            meaning: CloseAnswer::Closed,
            distrust: None,
        }
    }

    fn refund(&self, _: &RefundRequest<'_>, _: i64) -> Exchange<RefundAnswer> {
        unreachable!("no refund here")
    }

    fn refund_query(&self, _: &str, _: &str, _: Option<&str>, _: i64) -> Exchange<RefundState> {
        unreachable!("no refund here")
    }

    fn prepay_methods(&self) -> &'static [&'static str] {
        &["native", "jsapi"]
    }

    fn prepay_appids(&self) -> Option<&[String]> {
        static APPIDS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
        Some(APPIDS.get_or_init(|| vec![APPID.to_owned(), "wx0000000000000002".to_owned()]))
    }

    fn prepay_check(&self, request: &PrepayRequest<'_>) -> Result<(), String> {
        if request.order_no.len() < 6 {
            return Err("the platform cannot carry this order_no (6-32 characters)".into());
        }
        if request.method == "jsapi" && request.openid.is_none() {
            return Err("a jsapi payment needs the payer's openid".into());
        }
        Ok(())
    }

    fn prepay(&self, request: &PrepayRequest<'_>, _now_ms: i64) -> Exchange<PrepayAnswer> {
        let n = self.0.prepays.fetch_add(1, Ordering::SeqCst) + 1;
        self.0.requests.lock().push(Sent {
            out_trade_no: request.order_no.to_owned(),
            method: request.method.to_owned(),
            appid: request.appid.map(str::to_owned),
            openid: request.openid.map(str::to_owned),
            description: request.description.to_owned(),
            notify_url: request.notify_url.to_owned(),
            expires_at_ms: request.expires_at_ms,
        });
        std::thread::sleep(Duration::from_millis(self.0.delay_ms.load(Ordering::SeqCst)));
        let script = self.0.script.lock().clone().unwrap_or(Script::Create);
        let (meaning, distrust) = match script {
            Script::Create => {
                let code_url = format!("weixin://wxpay/bizpayurl?pr={}-{n}", request.order_no);
                (PrepayAnswer::Created(Payment::of(&[("code_url", &code_url)])), None)
            }
            Script::Paid => (PrepayAnswer::Paid, None),
            Script::Closed => (PrepayAnswer::Closed, None),
            Script::Refused => {
                (PrepayAnswer::Refused { code: "NOAUTH".into(), message: "no such permission".into() }, None)
            }
            Script::Unknown => (PrepayAnswer::Unknown, Some("timed out".to_owned())),
        };
        Exchange {
            request: format!("prepay {}", request.order_no),
            http_status: Some(200),
            response: "{}".into(),
            meaning,
            distrust,
        }
    }
}

/// An Alipay-named platform whose `page` payments are requests signed for
/// the buyer (no call), as Alipay's are.
struct Signed;

impl payonce::platforms::Calls for Signed {
    fn name(&self) -> &'static str {
        "alipay"
    }

    fn endpoint(&self) -> &str {
        "in-process"
    }

    fn query(&self, order_no: &str, _now_ms: i64) -> Exchange<TradeState> {
        let meaning = TradeState::NotPaid { paying: false };
        Exchange {
            request: format!("query {order_no}"),
            http_status: Some(200),
            response: "{}".into(),
            meaning,
            distrust: None,
        }
    }

    fn close(&self, order_no: &str, _now_ms: i64) -> Exchange<CloseAnswer> {
        // No trade yet: the platform has nothing to close, and says so.
        let meaning = CloseAnswer::Closed;
        Exchange {
            request: format!("close {order_no}"),
            http_status: Some(200),
            response: "{}".into(),
            meaning,
            distrust: None,
        }
    }

    fn refund(&self, _: &RefundRequest<'_>, _: i64) -> Exchange<RefundAnswer> {
        unreachable!("no refund here")
    }

    fn refund_query(&self, _: &str, _: &str, _: Option<&str>, _: i64) -> Exchange<RefundState> {
        unreachable!("no refund here")
    }

    fn prepay_methods(&self) -> &'static [&'static str] {
        &["precreate", "page"]
    }

    fn prepay_is_signed_only(&self, method: &str) -> bool {
        method == "page"
    }

    fn prepay_check(&self, _: &PrepayRequest<'_>) -> Result<(), String> {
        Ok(())
    }

    fn prepay(&self, request: &PrepayRequest<'_>, _now_ms: i64) -> Exchange<PrepayAnswer> {
        let url = format!("https://gateway.example/?out_trade_no={}", request.order_no);
        let meaning = PrepayAnswer::Created(Payment::of(&[("url", &url)]));
        Exchange { request: String::new(), http_status: None, response: String::new(), meaning, distrust: None }
    }
}

struct Shop {
    app: App,
    seen: Arc<Seen>,
    clock: Clock,
}

fn shop_on(spec: &str, public_base_url: Option<&str>) -> Shop {
    let seen = Arc::new(Seen::default());
    let clock = Clock::manual(T0_MS);
    let platforms = Platforms {
        registry: Registry::with([Platform::calls(Scripted(Arc::clone(&seen))), Platform::calls(Signed)]),
        timeout_ms: TIMEOUT_MS,
        public_base_url: public_base_url.map(str::to_owned),
        prepay_reuse_ms: REUSE_MS,
        ..Platforms::default()
    };
    let app = App::open(spec, clock.clone(), Config { platforms, ..Config::default() }).expect("open");
    Shop { app, seen, clock }
}

/// A second payonce on the same database and the same platform: its own
/// core, key locks and pool, as another process has.
fn twin_of(first: &Shop, spec: &str) -> Shop {
    let platforms = Platforms {
        registry: Registry::with([Platform::calls(Scripted(Arc::clone(&first.seen)))]),
        timeout_ms: TIMEOUT_MS,
        public_base_url: Some("https://shop.example/".to_owned()),
        prepay_reuse_ms: REUSE_MS,
        ..Platforms::default()
    };
    let app = App::open(spec, first.clock.clone(), Config { platforms, ..Config::default() }).expect("open the twin");
    Shop { app, seen: Arc::clone(&first.seen), clock: first.clock.clone() }
}

fn shop(spec: &str) -> Shop {
    shop_on(spec, Some("https://shop.example/"))
}

impl Shop {
    fn order(&self, order_no: &str) {
        let order = CreateOrder {
            order_no: order_no.into(),
            user_id: "u1".into(),
            amount: 990,
            currency: "CNY".into(),
            expires_in_s: Some(900),
        };
        self.app.orders().create_order(&order).expect("order");
    }

    fn post(&self, path: &str, body: &Value, headers: &[(&str, &str)]) -> Response {
        let request = Request {
            method: "POST".into(),
            path: path.into(),
            query: String::new(),
            headers: std::iter::once(("Content-Type", "application/json"))
                .chain(headers.iter().copied())
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
            body: body.to_string().into_bytes(),
        };
        api::handle(&self.app, &request)
    }

    fn pay(&self, order_no: &str, body: Value) -> Response {
        self.post(&format!("/v1/orders/{order_no}/pay"), &body, &[])
    }

    fn calls(&self) -> usize {
        self.seen.prepays.load(Ordering::SeqCst)
    }

    fn script(&self, script: Script) {
        *self.seen.script.lock() = Some(script);
    }

    /// The order's prepay rows as the order detail shows them.
    fn prepay_rows(&self, order_no: &str) -> Vec<Value> {
        let request = Request {
            method: "GET".into(),
            path: format!("/v1/orders/{order_no}"),
            query: String::new(),
            headers: Vec::new(),
            body: Vec::new(),
        };
        let detail = json_of(&api::handle(&self.app, &request));
        let calls = detail["platform_calls"].as_array().cloned().unwrap_or_default();
        calls.into_iter().filter(|c| c["kind"] == "prepay").collect()
    }
}

fn json_of(response: &Response) -> Value {
    serde_json::from_slice(&response.body).unwrap_or(Value::Null)
}

fn native() -> Value {
    json!({"channel": NAME, "method": "native", "appid": APPID})
}

#[track_caller]
fn refused(response: &Response, status: u16, code: &str, says: &str) {
    let body = json_of(response);
    assert_eq!((response.status, body["error"]["code"].as_str()), (status, Some(code)), "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(says), "{message:?} should say {says:?}");
}

for_each_engine! {
    /// The triple click: three requests at once make one platform call and
    /// answer the same bytes; the row keeps one attempt and the answer.
    fn three_requests_at_once_make_one_call(db) {
        let shop = shop(&db.spec);
        shop.order("ORD-TRIPLE");
        shop.seen.delay_ms.store(250, Ordering::SeqCst);
        let answers: Vec<Response> = std::thread::scope(|scope| {
            let clicks: Vec<_> = (0..3).map(|_| scope.spawn(|| shop.pay("ORD-TRIPLE", native()))).collect();
            clicks.into_iter().map(|c| c.join().expect("a click")).collect()
        });
        assert_eq!(shop.calls(), 1, "one platform call for three clicks");
        let first = json_of(&answers[0]);
        for answer in &answers {
            assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
            assert_eq!(json_of(answer)["payment"], first["payment"], "every click answers the same payment");
        }
        let payment = &first["payment"];
        assert_eq!(payment["code_url"], "weixin://wxpay/bizpayurl?pr=ORD-TRIPLE-1");
        assert_eq!((payment["channel"].as_str(), payment["method"].as_str()), (Some(NAME), Some("native")));
        assert_eq!(payment["expires_at"], first["order"]["expires_at"]);
        assert_eq!(first["order"]["status"], "PENDING");
        let rows = shop.prepay_rows("ORD-TRIPLE");
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert_eq!((rows[0]["status"].as_str(), rows[0]["attempts"].as_i64()), (Some("done"), Some(1)));
        // What the platform was sent: the order's number, amount and
        // expiry, the notify URL under --public-base-url, the order_no as
        // the default description.
        let sent = shop.seen.requests.lock()[0].clone();
        let expected = Sent {
            out_trade_no: "ORD-TRIPLE".into(),
            method: "native".into(),
            appid: Some(APPID.into()),
            openid: None,
            description: "ORD-TRIPLE".into(),
            notify_url: "https://shop.example/v1/callbacks/wechatpay".into(),
            expires_at_ms: T0_MS + 900_000,
        };
        assert_eq!(sent, expected);
    }

    /// Two payonce on one database (each its own key locks, as two
    /// processes): six requests split across them make one platform call;
    /// the unique index decides, not a lock.
    fn two_payonce_on_one_database_make_one_call(db) {
        let first = shop(&db.spec);
        let second = twin_of(&first, &db.spec);
        first.order("ORD-TWOPROC");
        first.seen.delay_ms.store(200, Ordering::SeqCst);
        let answers: Vec<Response> = std::thread::scope(|scope| {
            let clicks: Vec<_> = (0..6)
                .map(|i| {
                    let shop = if i % 2 == 0 { &first } else { &second };
                    scope.spawn(move || shop.pay("ORD-TWOPROC", native()))
                })
                .collect();
            clicks.into_iter().map(|c| c.join().expect("a click")).collect()
        });
        assert_eq!(first.calls(), 1, "one platform call across both");
        let payment = json_of(&answers[0])["payment"].clone();
        for answer in &answers {
            assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
            assert_eq!(json_of(answer)["payment"], payment);
        }
        assert_eq!(second.prepay_rows("ORD-TWOPROC").len(), 1);
    }

    /// Eight requests at once on one payonce (more than the places of
    /// requests waiting on platforms): one call, eight identical answers —
    /// only the caller takes a place.
    fn eight_requests_at_once_take_one_place(db) {
        let shop = shop(&db.spec);
        shop.order("ORD-EIGHT1");
        shop.seen.delay_ms.store(250, Ordering::SeqCst);
        let answers: Vec<Response> = std::thread::scope(|scope| {
            let clicks: Vec<_> = (0..8).map(|_| scope.spawn(|| shop.pay("ORD-EIGHT1", native()))).collect();
            clicks.into_iter().map(|c| c.join().expect("a click")).collect()
        });
        assert_eq!(shop.calls(), 1);
        for answer in &answers {
            assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
            assert_eq!(answer.body, answers[0].body);
        }
    }

    /// A request the platform refused made no trade: another openid (or
    /// method) then replaces the parameters and calls again. Once an
    /// attempt may have made the trade (no answer), other parameters
    /// conflict.
    fn parameters_of_refused_attempts_can_be_replaced(db) {
        let shop = shop(&db.spec);
        shop.order("ORD-REPLAC");
        let buyer = |openid: &str| json!({"channel": NAME, "method": "jsapi", "appid": APPID, "openid": openid});
        shop.script(Script::Refused);
        refused(&shop.pay("ORD-REPLAC", buyer("oStale")), 502, "platform_refused", "NOAUTH");
        shop.script(Script::Create);
        let answer = shop.pay("ORD-REPLAC", buyer("oRight"));
        assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
        let sent = shop.seen.requests.lock().clone();
        assert_eq!((sent.len(), sent[1].openid.as_deref()), (2, Some("oRight")));
        refused(&shop.pay("ORD-REPLAC", buyer("oStale")), 409, "payment_conflict", "jsapi");

        shop.order("ORD-UNSURE");
        shop.script(Script::Unknown);
        refused(&shop.pay("ORD-UNSURE", buyer("oFirst")), 503, "platform_unavailable", "timed out");
        refused(&shop.pay("ORD-UNSURE", buyer("oOther")), 409, "payment_conflict", "jsapi");
        assert_eq!(shop.calls(), 3);
    }

    /// A request signed for the buyer (Alipay page) makes no call but is
    /// kept: the buyer may open it until expires_at, so an explicit close
    /// is not confirmed before then (503, PENDING), and is after; a new
    /// request once the close began is refused.
    fn a_signed_request_holds_the_close_until_it_expires(db) {
        let shop = shop(&db.spec);
        shop.order("ORD_SIGNED");
        let page = json!({"channel": "alipay", "method": "page"});
        let first = shop.pay("ORD_SIGNED", page.clone());
        assert_eq!(first.status, 200, "{}", String::from_utf8_lossy(&first.body));
        assert_eq!(json_of(&first)["payment"]["url"], "https://gateway.example/?out_trade_no=ORD_SIGNED");
        assert_eq!(shop.pay("ORD_SIGNED", page.clone()).status, 200, "signed afresh");
        let rows = shop.prepay_rows("ORD_SIGNED");
        assert_eq!((rows.len(), rows[0]["attempts"].as_i64(), rows[0]["status"].as_str()), (1, Some(0), Some("done")));
        refused(&shop.pay("ORD_SIGNED", json!({"channel": "alipay", "method": "precreate"})), 409, "payment_conflict", "page");
        let close = shop.post("/v1/orders/ORD_SIGNED/close", &json!({}), &[]);
        refused(&close, 503, "platform_unavailable", "ORD_SIGNED");
        refused(&shop.pay("ORD_SIGNED", page), 409, "order_expired", "being closed");
        // Past expires_at (the request's time_expire) the link is dead.
        shop.clock.advance_ms(900_000);
        shop.clock.advance_ms(-1);
        assert_eq!(shop.app.platform_calls().run_platform_calls_once(10).expect("a round"), 1);
        let detail = shop.app.orders().order("ORD_SIGNED").expect("order");
        assert_eq!(detail.order.status, OrderStatus::Pending, "a millisecond before expires_at: still held");
        shop.clock.advance_ms(1);
        shop.clock.advance_ms(120_000);
        assert_eq!(shop.app.platform_calls().run_platform_calls_once(10).expect("a round"), 1);
        let detail = shop.app.orders().order("ORD_SIGNED").expect("order");
        assert_eq!(detail.order.status, OrderStatus::Closed);
    }

    /// Past the platform timeout plus a second, a waiting request answers
    /// 409 payment_in_progress with Retry-After; the call still ends once.
    fn the_wait_is_bounded(db) {
        let shop = shop(&db.spec);
        shop.order("ORD-SLOW01");
        shop.seen.delay_ms.store(TIMEOUT_MS + 1_600, Ordering::SeqCst);
        std::thread::scope(|scope| {
            let first = scope.spawn(|| shop.pay("ORD-SLOW01", native()));
            while shop.calls() == 0 {
                std::thread::sleep(Duration::from_millis(5));
            }
            let waiting = shop.pay("ORD-SLOW01", native());
            refused(&waiting, 409, "payment_in_progress", "being created");
            assert!(waiting.header("Retry-After").is_some(), "Retry-After with payment_in_progress");
            assert_eq!(first.join().expect("first").status, 200);
        });
        assert_eq!(shop.calls(), 1);
        assert_eq!(shop.pay("ORD-SLOW01", native()).status, 200, "then answered from the row");
        assert_eq!(shop.calls(), 1);
    }

    /// Within --prepay-reuse-s the stored answer, no call; past it one call
    /// with the same out_trade_no and parameters (attempts 2), the same
    /// description even when the new request names another.
    fn the_answer_is_reused_then_refreshed_once(db) {
        let shop = shop(&db.spec);
        shop.order("ORD-REUSE1");
        let body = json!({"channel": NAME, "method": "jsapi", "appid": APPID, "openid": "oBuyer", "description": "Tea"});
        let first = json_of(&shop.pay("ORD-REUSE1", body.clone()));
        shop.clock.advance_ms(REUSE_MS - 1);
        let again = json_of(&shop.pay("ORD-REUSE1", body.clone()));
        assert_eq!((shop.calls(), &again["payment"]), (1, &first["payment"]), "reused");
        shop.clock.advance_ms(1);
        let other_words = json!({"channel": NAME, "method": "jsapi", "appid": APPID, "openid": "oBuyer", "description": "Cake"});
        let refreshed = json_of(&shop.pay("ORD-REUSE1", other_words));
        assert_eq!(shop.calls(), 2, "refreshed by one call");
        assert_ne!(refreshed["payment"]["created_at"], first["payment"]["created_at"]);
        let requests = shop.seen.requests.lock().clone();
        assert_eq!(requests[0], requests[1], "the same out_trade_no and parameters: {requests:?}");
        let rows = shop.prepay_rows("ORD-REUSE1");
        assert_eq!((rows.len(), rows[0]["attempts"].as_i64()), (1, Some(2)));
        assert_eq!(json_of(&shop.pay("ORD-REUSE1", body))["payment"], refreshed["payment"]);
        assert_eq!(shop.calls(), 2);
    }

    /// Another method, appid or openid for a payment that exists: 409
    /// payment_conflict naming the one in use.
    fn another_method_appid_or_openid_conflicts(db) {
        let shop = shop(&db.spec);
        shop.order("ORD-CONFL1");
        assert_eq!(shop.pay("ORD-CONFL1", native()).status, 200);
        let jsapi = json!({"channel": NAME, "method": "jsapi", "appid": APPID, "openid": "oBuyer"});
        refused(&shop.pay("ORD-CONFL1", jsapi), 409, "payment_conflict", "method native");
        let other_app = json!({"channel": NAME, "method": "native", "appid": "wx0000000000000002"});
        refused(&shop.pay("ORD-CONFL1", other_app), 409, "payment_conflict", APPID);
        shop.order("ORD-CONFL2");
        let buyer = |openid: &str| json!({"channel": NAME, "method": "jsapi", "appid": APPID, "openid": openid});
        assert_eq!(shop.pay("ORD-CONFL2", buyer("oBuyer")).status, 200);
        refused(&shop.pay("ORD-CONFL2", buyer("oSomeoneElse")), 409, "payment_conflict", "jsapi");
        assert_eq!(shop.calls(), 2, "a conflict calls nothing");
    }

    /// The platform says paid: payonce queries, applies the payment (source
    /// query) and answers 409 with the order PAID; the next click too.
    fn a_trade_paid_at_the_platform_is_applied(db) {
        let shop = shop(&db.spec);
        shop.order("ORD-PAIDAT");
        shop.script(Script::Paid);
        *shop.seen.paid_amount.lock() = Some(990);
        refused(&shop.pay("ORD-PAIDAT", native()), 409, "invalid_transition", "PAID");
        let detail = shop.app.orders().order("ORD-PAIDAT").expect("order");
        assert_eq!(detail.order.status, OrderStatus::Paid);
        assert_eq!((detail.payments.len(), detail.payments[0].source.as_str()), (1, "query"));
        refused(&shop.pay("ORD-PAIDAT", native()), 409, "invalid_transition", "paid already");
        assert_eq!(shop.calls(), 1);
    }

    /// Closed at the platform: 409 order_expired. Refused: 502
    /// platform_refused with its code. Unanswered: 503 platform_unavailable
    /// with Retry-After. None is kept: the next request calls again.
    fn refusals_at_the_platform_are_not_kept(db) {
        let shop = shop(&db.spec);
        shop.order("ORD-REFUSE");
        shop.script(Script::Closed);
        refused(&shop.pay("ORD-REFUSE", native()), 409, "order_expired", "closed");
        shop.script(Script::Refused);
        refused(&shop.pay("ORD-REFUSE", native()), 502, "platform_refused", "NOAUTH: no such permission");
        shop.script(Script::Unknown);
        let unavailable = shop.pay("ORD-REFUSE", native());
        refused(&unavailable, 503, "platform_unavailable", "timed out");
        assert!(unavailable.header("Retry-After").is_some());
        shop.script(Script::Create);
        assert_eq!(shop.pay("ORD-REFUSE", native()).status, 200);
        assert_eq!(shop.calls(), 4, "every refusal asked again");
        let rows = shop.prepay_rows("ORD-REFUSE");
        assert_eq!((rows[0]["attempts"].as_i64(), rows[0]["status"].as_str()), (Some(4), Some("done")));
    }

    /// Requests that waited on a call answer what it answered, failure
    /// included: three clicks while the platform is unreachable are one
    /// call and three 503s.
    fn waiters_answer_the_callers_failure(db) {
        let shop = shop(&db.spec);
        shop.order("ORD-WAITF1");
        shop.script(Script::Unknown);
        shop.seen.delay_ms.store(200, Ordering::SeqCst);
        let answers: Vec<Response> = std::thread::scope(|scope| {
            let clicks: Vec<_> = (0..3).map(|_| scope.spawn(|| shop.pay("ORD-WAITF1", native()))).collect();
            clicks.into_iter().map(|c| c.join().expect("a click")).collect()
        });
        for answer in &answers {
            refused(answer, 503, "platform_unavailable", "timed out");
        }
        assert_eq!(shop.calls(), 1);
    }

    /// The order's own state: PAID, CLOSED, past expires_at, or a close
    /// begun at the platforms refuse before any call.
    fn orders_that_cannot_be_paid_are_refused(db) {
        let shop = shop(&db.spec);
        shop.order("ORD-CLOSED");
        assert_eq!(shop.post("/v1/orders/ORD-CLOSED/close", &json!({}), &[]).status, 200);
        refused(&shop.pay("ORD-CLOSED", native()), 409, "invalid_transition", "CLOSED");
        shop.order("ORD-EXPIRE");
        shop.clock.advance_ms(900_000);
        refused(&shop.pay("ORD-EXPIRE", native()), 409, "order_expired", "expired");
        // The sweeper queues the close at the platforms: no new payment,
        // even once the clock is turned back.
        assert_eq!(shop.app.orders().close_expired(10).expect("sweep"), 1);
        shop.clock.set_ms(T0_MS);
        refused(&shop.pay("ORD-EXPIRE", native()), 409, "order_expired", "being closed");
        refused(&shop.pay("ORD-NONE01", native()), 404, "order_not_found", "ORD-NONE01");
        shop.order("SHORT");
        refused(&shop.pay("SHORT", native()), 400, "invalid_request", "order_no");
        assert_eq!(shop.calls(), 0);
    }

    /// A caller that died mid-call leaves its row pending; past the lease
    /// the next request takes it (attempts 2) and calls once.
    fn a_call_whose_caller_died_is_taken_over(db) {
        let shop = shop(&db.spec);
        shop.order("ORD-DIED01");
        let now = payonce::clock::format_ms(T0_MS);
        let lease = payonce::clock::format_ms(T0_MS + 1_000);
        let begun = shop.app.store().write(&[], |tx| {
            tx.begin_prepay(&payonce::store::NewPrepay {
                channel: NAME,
                order_no: "ORD-DIED01",
                method: "native",
                appid: Some(APPID),
                params: r#"{"description":"ORD-DIED01"}"#,
                now: &now,
                lease_until: Some(&lease),
            })
        });
        assert!(begun.expect("begin").is_some());
        shop.clock.advance_ms(1_000);
        let answer = shop.pay("ORD-DIED01", native());
        assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
        assert_eq!(shop.calls(), 1);
        let rows = shop.prepay_rows("ORD-DIED01");
        assert_eq!((rows[0]["attempts"].as_i64(), rows[0]["status"].as_str()), (Some(2), Some("done")));
    }

    /// An explicit close while a payment is being created is not confirmed
    /// (the creation may make the trade after the close found none): 503,
    /// the order still PENDING; once the creation ended the close goes on.
    fn a_close_waits_for_a_creation_in_flight(db) {
        let shop = shop(&db.spec);
        shop.order("ORD-RACE01");
        shop.seen.delay_ms.store(300, Ordering::SeqCst);
        std::thread::scope(|scope| {
            let paying = scope.spawn(|| shop.pay("ORD-RACE01", native()));
            while shop.calls() == 0 {
                std::thread::sleep(Duration::from_millis(5));
            }
            let close = shop.post("/v1/orders/ORD-RACE01/close", &json!({}), &[]);
            refused(&close, 503, "platform_unavailable", "ORD-RACE01");
            assert_eq!(paying.join().expect("pay").status, 200);
        });
        let close = shop.post("/v1/orders/ORD-RACE01/close", &json!({}), &[]);
        assert_eq!((close.status, json_of(&close)["status"].as_str()), (200, Some("CLOSED")));
        refused(&shop.pay("ORD-RACE01", native()), 409, "invalid_transition", "CLOSED");
    }

    /// With an Idempotency-Key the answer is stored like any POST's.
    fn an_idempotency_key_replays_the_answer(db) {
        let shop = shop(&db.spec);
        shop.order("ORD-KEYED1");
        let keyed = |body: &Value| shop.post("/v1/orders/ORD-KEYED1/pay", body, &[("Idempotency-Key", "click-1")]);
        let first = keyed(&native());
        let replay = keyed(&native());
        assert_eq!((first.status, replay.status), (200, 200));
        assert_eq!(replay.header("Idempotent-Replayed"), Some("true"));
        assert_eq!(replay.body, first.body);
        let other = json!({"channel": NAME, "method": "native", "appid": "wx0000000000000002"});
        assert_eq!(keyed(&other).status, 422, "another body under the same key");
        assert_eq!(shop.calls(), 1);
    }
}

/// The body and the settings, each refused by name before anything is
/// kept or called.
#[test]
fn bad_requests_and_missing_settings_are_refused_by_name() {
    let shop = shop(":memory:");
    shop.order("ORD-FIELDS");
    let pay = |body: Value| shop.pay("ORD-FIELDS", body);
    refused(&pay(json!({"channel": "generic", "method": "native"})), 404, "channel_not_configured", "generic");
    refused(&pay(json!({"channel": "paypal", "method": "native"})), 404, "channel_not_configured", "paypal");
    refused(&pay(json!({"channel": "alipay", "method": "page", "appid": APPID})), 400, "invalid_request", "appid");
    refused(&pay(json!({"channel": NAME, "method": "h5"})), 400, "invalid_request", "method");
    refused(&pay(json!({"channel": NAME})), 400, "invalid_request", "method");
    refused(&pay(json!({"method": "native"})), 400, "invalid_request", "channel");
    refused(&pay(json!({"channel": NAME, "method": "native"})), 400, "invalid_request", "appid is required");
    refused(&pay(json!({"channel": NAME, "method": "native", "appid": "wxNOPE"})), 400, "invalid_request", "appid");
    let jsapi = json!({"channel": NAME, "method": "jsapi", "appid": APPID});
    refused(&pay(jsapi), 400, "invalid_request", "openid");
    let long = json!({"channel": NAME, "method": "native", "appid": APPID, "description": "x".repeat(128)});
    refused(&pay(long), 400, "invalid_request", "description");
    let ip = json!({"channel": NAME, "method": "native", "appid": APPID, "client_ip": "not-an-ip"});
    refused(&pay(ip), 400, "invalid_request", "client_ip");
    let url = json!({"channel": NAME, "method": "native", "appid": APPID, "return_url": "javascript:alert(1)"});
    refused(&pay(url), 400, "invalid_request", "return_url");
    let unknown = json!({"channel": NAME, "method": "native", "appid": APPID, "amount": 1});
    refused(&pay(unknown), 400, "invalid_request", "amount");
    refused(&pay(json!({"channel": NAME, "method": 7, "appid": APPID})), 400, "invalid_request", "method");
    assert_eq!(shop.calls(), 0);

    let no_base = shop_on(":memory:", None);
    no_base.order("ORD-NOBASE");
    refused(&no_base.pay("ORD-NOBASE", native()), 404, "channel_not_configured", "--public-base-url");
}
