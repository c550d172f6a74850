//! What payonce makes of a platform's answers when the platform (or whoever
//! controls its URL or the path to it) is hostile: a scripted gateway on a
//! loopback socket answers each call with the body a test chose, signed with
//! the platform key payonce trusts. docs/channels.md states the rules: an
//! Alipay answer is read only from the one top-level `*_response` member
//! its signature covers; currency is part of the amount; an answer payonce
//! cannot use is no answer, never a 4xx for the caller.

use crate::util::{Server, TempDir};
use base64::Engine as _;
use payonce::platforms::{Calls, RefundRequest};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MERCHANT_KEY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/keys/merchant.pem");
/// The platform's signing key in these tests (payonce is given its public half).
const PLATFORM_KEY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/keys/platform.pem");

/// One request the gateway received.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub target: String,
    /// The form's parameters, decoded (Alipay); empty otherwise.
    pub params: Vec<(String, String)>,
    pub body: String,
    /// The `Authorization` header, if any (WeChat Pay's signed requests).
    pub authorization: Option<String>,
}

impl Seen {
    pub fn param(&self, name: &str) -> Option<&str> {
        self.params.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// Alipay's `method` parameter.
    pub fn alipay_method(&self) -> &str {
        self.param("method").unwrap_or_default()
    }

    /// Alipay's `biz_content`, parsed.
    pub fn biz(&self) -> Value {
        self.param("biz_content").and_then(|b| serde_json::from_str(b).ok()).unwrap_or(Value::Null)
    }
}

/// (HTTP status, headers, body).
pub type Reply = (u16, Vec<(String, String)>, String);
type Script = dyn Fn(&Seen) -> Reply + Send + Sync;

/// A platform on a loopback socket that answers what its script says; one
/// thread per connection, `Connection: close` on every answer.
pub struct Gateway {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
}

impl Gateway {
    pub fn start(script: impl Fn(&Seen) -> Reply + Send + Sync + 'static) -> Gateway {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let script: Arc<Script> = Arc::new(script);
        let (seen2, stop2) = (Arc::clone(&seen), Arc::clone(&stop));
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                if stop2.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                let (script, seen) = (Arc::clone(&script), Arc::clone(&seen2));
                std::thread::spawn(move || serve_one(stream, &*script, &seen));
            }
        });
        Gateway { addr, seen, stop }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("seen").clone()
    }

    /// Waits until `count` requests matching `what` arrived.
    pub fn wait_for(&self, what: impl Fn(&Seen) -> bool, count: usize, within: Duration) {
        let deadline = Instant::now() + within;
        while self.seen().iter().filter(|s| what(s)).count() < count {
            assert!(Instant::now() < deadline, "the platform was never called so: {:#?}", self.seen());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
    }
}

fn serve_one(stream: TcpStream, script: &Script, seen: &Mutex<Vec<Seen>>) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    let mut words = line.split_whitespace();
    let (method, target) = (words.next().unwrap_or("").to_owned(), words.next().unwrap_or("").to_owned());
    let mut length = 0usize;
    let mut authorization = None;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).unwrap_or(0) == 0 || header.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            if name.trim().eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().unwrap_or(0);
            }
            if name.trim().eq_ignore_ascii_case("authorization") {
                authorization = Some(value.trim().to_owned());
            }
        }
    }
    let mut body = vec![0u8; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let body = String::from_utf8_lossy(&body).into_owned();
    let params = if method == "POST" && !body.starts_with('{') { form(&body) } else { Vec::new() };
    let request = Seen { method, target, params, body, authorization };
    let (status, headers, answer) = script(&request);
    seen.lock().expect("seen").push(request);
    let mut head = format!("HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n", answer.len());
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    let mut stream = reader.into_inner();
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(answer.as_bytes());
}

/// `application/x-www-form-urlencoded`, decoded.
fn form(body: &str) -> Vec<(String, String)> {
    let decode = |text: &str| {
        let bytes = text.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            match bytes[i] {
                b'+' => out.push(b' '),
                b'%' => {
                    let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
                    match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                        Some(byte) => {
                            out.push(byte);
                            i += 2;
                        }
                        None => out.push(b'%'),
                    }
                }
                other => out.push(other),
            }
            i += 1;
        }
        String::from_utf8_lossy(&out).into_owned()
    };
    body.split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (decode(k), decode(v))
        })
        .collect()
}

fn platform_private() -> rsa::RsaPrivateKey {
    use rsa::pkcs8::DecodePrivateKey;
    rsa::RsaPrivateKey::from_pkcs8_pem(&std::fs::read_to_string(PLATFORM_KEY).expect("fixture")).expect("PKCS#8")
}

/// base64 SHA256withRSA by the platform's key: what Alipay and WeChat Pay sign with.
pub fn platform_sign(message: &[u8]) -> String {
    use rsa::signature::{SignatureEncoding, Signer};
    let key = rsa::pkcs1v15::SigningKey::<sha2::Sha256>::new(platform_private());
    base64::engine::general_purpose::STANDARD.encode(key.sign(message).to_vec())
}

/// The platform's public key as a PEM file, for `--alipay-public-key` and `--wechatpay-public-key`.
pub fn platform_public_pem(dir: &TempDir) -> String {
    use rsa::pkcs8::{EncodePublicKey, LineEnding};
    let path = dir.path("platform-public.pem");
    let pem = platform_private().to_public_key().to_public_key_pem(LineEnding::LF).expect("pem");
    std::fs::write(&path, pem).expect("write");
    path.display().to_string()
}

// ---- Alipay ----

/// The `*_response` member name of an Alipay method.
fn member_name(method: &str) -> String {
    format!("{}_response", method.replace('.', "_"))
}

/// Alipay's answer: `{"<method>_response":<response>,"sign":"<sign over its text>"}`.
pub fn alipay_answer(method: &str, response: &Value) -> Reply {
    let text = response.to_string();
    let body = format!(r#"{{"{}":{text},"sign":"{}"}}"#, member_name(method), platform_sign(text.as_bytes()));
    (200, vec![("Content-Type".into(), "application/json;charset=utf-8".into())], body)
}

fn alipay_reply(body: String) -> Reply {
    (200, vec![("Content-Type".into(), "application/json;charset=utf-8".into())], body)
}

/// The four methods payonce calls, each with the answer that would mean
/// "yes" (paid, closed, accepted, refunded) for `order_no`, and a genuine
/// "no" answer payonce would act on differently.
fn alipay_yes(method: &str, order_no: &str) -> Value {
    match method {
        "alipay.trade.query" => json!({"code": "10000", "msg": "Success", "out_trade_no": order_no,
            "trade_no": "2024010122001400001", "trade_status": "TRADE_SUCCESS", "total_amount": "10.00"}),
        "alipay.trade.fastpay.refund.query" => json!({"code": "10000", "msg": "Success", "out_trade_no": order_no,
            "out_request_no": "RF_1", "refund_status": "REFUND_SUCCESS", "refund_amount": "10.00"}),
        _ => json!({"code": "10000", "msg": "Success", "out_trade_no": order_no, "trade_no": "2024010122001400001",
            "fund_change": "Y", "refund_fee": "10.00"}),
    }
}

fn alipay_no(method: &str, order_no: &str) -> Value {
    match method {
        "alipay.trade.query" => json!({"code": "10000", "msg": "Success", "out_trade_no": order_no,
            "trade_no": "2024010122001400001", "trade_status": "WAIT_BUYER_PAY", "total_amount": "10.00"}),
        "alipay.trade.fastpay.refund.query" => {
            json!({"code": "10000", "msg": "Success", "out_trade_no": order_no, "out_request_no": "RF_1"})
        }
        _ => json!({"code": "40004", "msg": "Business Failed", "sub_code": "ACQ.SYSTEM_ERROR"}),
    }
}

/// The forged answers: each holds a genuinely signed member, and an
/// unsigned "yes" for `order_no` where a careless reader would look.
fn alipay_forgeries(method: &str, order_no: &str) -> Vec<(&'static str, String)> {
    let name = member_name(method);
    let signed = |response: &Value| {
        let text = response.to_string();
        (text.clone(), platform_sign(text.as_bytes()))
    };
    let forged = alipay_yes(method, order_no).to_string();
    let (no, no_sign) = signed(&alipay_no(method, order_no));
    let (other, other_sign) = signed(&alipay_yes(method, "ORD_SOMEONE_ELSE"));
    let (yes, yes_sign) = signed(&alipay_yes(method, order_no));
    vec![
        ("a duplicate member", format!(r#"{{"{name}":{no},"sign":"{no_sign}","{name}":{forged}}}"#)),
        ("a nested copy", format!(r#"{{"envelope":{{"{name}":{no}}},"{name}":{forged},"sign":"{no_sign}"}}"#)),
        (
            "another method's member",
            format!(r#"{{"{name}":{yes},"alipay_trade_cancel_response":{{"code":"10000"}},"sign":"{yes_sign}"}}"#),
        ),
        ("another order's signed member", format!(r#"{{"{name}":{other},"sign":"{other_sign}","{name}":{forged}}}"#)),
    ]
}

const ALIPAY_METHODS: [&str; 4] =
    ["alipay.trade.query", "alipay.trade.close", "alipay.trade.refund", "alipay.trade.fastpay.refund.query"];

/// Alipay's outgoing settings pointing at `gateway`, trusting the platform key.
fn alipay_flags(gateway: &Gateway, public: &str) -> Vec<String> {
    [
        "--alipay-app-id",
        "2021000000000001",
        "--alipay-app-private-key",
        MERCHANT_KEY,
        "--alipay-public-key",
        public,
        "--alipay-gateway",
        &format!("{}/gateway.do", gateway.url()),
    ]
    .map(str::to_owned)
    .to_vec()
}

fn alipay_client(gateway: &Gateway) -> payonce::platforms::alipay::AlipayApi {
    payonce::platforms::alipay::AlipayApi::new(
        "2021000000000001".into(),
        payonce::platforms::MerchantKey::from_pem(&std::fs::read_to_string(MERCHANT_KEY).expect("fixture"))
            .expect("key"),
        &format!("{}/gateway.do", gateway.url()),
        platform_private().to_public_key(),
        Duration::from_secs(5),
    )
}

/// The client of every method against every forgery, over a socket: each is
/// no answer; the same gateway's genuine answers are believed.
#[test]
fn forged_alipay_answers_are_no_answer_for_every_method() {
    use payonce::platforms::{CloseAnswer, RefundAnswer, RefundState, TradeState};
    let next: Arc<Mutex<String>> = Arc::default();
    let body = Arc::clone(&next);
    let gateway = Gateway::start(move |_| alipay_reply(body.lock().expect("body").clone()));
    let api = alipay_client(&gateway);
    let now = crate::util::now_ms();
    // What each method's answer meant: (believed, the "yes" it would act on).
    let ask = |method: &str| -> (bool, bool) {
        match method {
            "alipay.trade.query" => {
                let e = api.query("ORD_A1", now);
                (e.distrust.is_none(), matches!(e.meaning, TradeState::Paid { .. }))
            }
            "alipay.trade.close" => {
                let e = api.close("ORD_A1", now);
                (e.distrust.is_none(), e.meaning == CloseAnswer::Closed)
            }
            "alipay.trade.refund" => {
                let e = api.refund(
                    &RefundRequest {
                        order_no: "ORD_A1",
                        refund_no: "RF_1",
                        amount: 1000,
                        total: 1000,
                        currency: "CNY",
                        reason: None,
                        pay_no: None,
                    },
                    now,
                );
                (e.distrust.is_none(), e.meaning == RefundAnswer::Accepted)
            }
            _ => {
                let e = api.refund_query("ORD_A1", "RF_1", None, now);
                (e.distrust.is_none(), matches!(e.meaning, RefundState::Settled(_)))
            }
        }
    };
    for method in ALIPAY_METHODS {
        let (_, _, genuine) = alipay_answer(method, &alipay_yes(method, "ORD_A1"));
        *next.lock().expect("body") = genuine;
        assert_eq!(ask(method), (true, true), "{method}: the genuine answer is believed");
        for (shape, forged) in alipay_forgeries(method, "ORD_A1") {
            *next.lock().expect("body") = forged;
            let (believed, yes) = ask(method);
            assert!(!believed && !yes, "{method}, {shape}: no answer, got believed={believed} yes={yes}");
        }
    }
}

/// `POST /sync` against a hostile gateway: no forged answer pays the order.
#[test]
fn a_forged_alipay_query_never_pays_an_order_through_sync() {
    let dir = TempDir::new("alipay-forged-sync");
    let public = platform_public_pem(&dir);
    let forgeries: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let table = Arc::clone(&forgeries);
    let gateway = Gateway::start(move |seen| {
        let order_no = seen.biz()["out_trade_no"].as_str().unwrap_or_default().to_owned();
        let table = table.lock().expect("table");
        let body = table.iter().find(|(o, _)| *o == order_no).map(|(_, b)| b.clone()).unwrap_or_default();
        alipay_reply(body)
    });
    let flags = alipay_flags(&gateway, &public);
    let args: Vec<&str> = flags.iter().map(String::as_str).collect();
    let server = Server::start_on(&dir.path("payonce.db"), &[&args[..], &["--coupon", "NEW10"]].concat());
    for i in 0..4 {
        let order_no = format!("ORD_F{i}");
        let (shape, forged) = alipay_forgeries("alipay.trade.query", &order_no).swap_remove(i);
        forgeries.lock().expect("table").push((order_no.clone(), forged));
        let created = server.post_json("/v1/orders", &json!({"order_no": order_no, "user_id": "u1", "amount": 1000}));
        assert_eq!(created.status, 201, "{}", created.text());
        let synced = server.post_json(&format!("/v1/orders/{order_no}/sync"), &json!({}));
        assert_eq!(synced.status, 200, "{shape}: {}", synced.text());
        let body = synced.json();
        assert_eq!(body["platforms"][0]["state"], "unknown", "{shape}: {body}");
        assert_eq!(body["order"]["status"], "PENDING", "{shape}: a forged answer paid the order: {body}");
        let detail = server.get(&format!("/v1/orders/{order_no}")).json();
        assert_eq!(detail["payments"], json!([]), "{shape}: nothing recorded: {detail}");
        assert_eq!(detail["coupons"], json!([]), "{shape}: no coupon: {detail}");
    }
}

/// A REFUNDING order whose refund query is answered with another order's
/// signed member and an unsigned REFUND_SUCCESS stays REFUNDING.
#[test]
fn a_forged_alipay_refund_query_never_settles_a_refund() {
    let dir = TempDir::new("alipay-forged-refund");
    let public = platform_public_pem(&dir);
    let gateway = Gateway::start(|seen| {
        let order_no = seen.biz()["out_trade_no"].as_str().unwrap_or_default().to_owned();
        let method = seen.alipay_method();
        match method {
            "alipay.trade.fastpay.refund.query" => {
                let forged = alipay_forgeries(method, &order_no);
                alipay_reply(forged[3].1.clone())
            }
            _ => alipay_answer(method, &alipay_yes(method, &order_no)),
        }
    });
    let flags = alipay_flags(&gateway, &public);
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    args.extend(["--sweep-interval-s", "1", "--refund-query-after-s", "1", "--platform-retry-s", "60"]);
    args.extend(["--coupon", "NEW10", "--points-per-yuan", "1"]);
    let server = Server::start_on(&dir.path("payonce.db"), &args);
    let created = server.post_json("/v1/orders", &json!({"order_no": "ORD_R1", "user_id": "u1", "amount": 1000}));
    assert_eq!(created.status, 201, "{}", created.text());
    let synced = server.post_json("/v1/orders/ORD_R1/sync", &json!({}));
    assert_eq!(synced.json()["order"]["status"], "PAID", "the genuine answer pays it: {}", synced.text());
    let refund = server.post_json("/v1/orders/ORD_R1/refund", &json!({"refund_no": "RF_1"}));
    assert_eq!(refund.status, 200, "{}", refund.text());
    gateway.wait_for(|s| s.alipay_method() == "alipay.trade.fastpay.refund.query", 1, Duration::from_secs(15));
    std::thread::sleep(Duration::from_millis(500));
    let detail = server.get("/v1/orders/ORD_R1").json();
    assert_eq!(detail["status"], "REFUNDING", "a forged answer settled the refund: {detail}");
    let seen = gateway.seen();
    assert!(seen.iter().all(|s| s.method == "POST" && s.target == "/gateway.do" && !s.body.is_empty()), "{seen:#?}");
}

/// An explicit close whose Alipay close answer is forged: payonce could not
/// confirm it (503), and the order stays PENDING.
#[test]
fn a_forged_alipay_close_answer_never_closes_an_order() {
    let dir = TempDir::new("alipay-forged-close");
    let public = platform_public_pem(&dir);
    let gateway = Gateway::start(|seen| {
        let order_no = seen.biz()["out_trade_no"].as_str().unwrap_or_default().to_owned();
        let method = seen.alipay_method();
        match method {
            "alipay.trade.close" => alipay_reply(alipay_forgeries(method, &order_no)[0].1.clone()),
            _ => alipay_answer(method, &alipay_no(method, &order_no)),
        }
    });
    let flags = alipay_flags(&gateway, &public);
    let args: Vec<&str> = flags.iter().map(String::as_str).collect();
    let server = Server::start_on(&dir.path("payonce.db"), &args);
    let created = server.post_json("/v1/orders", &json!({"order_no": "ORD_C1", "user_id": "u1", "amount": 1000}));
    assert_eq!(created.status, 201, "{}", created.text());
    let closed = server.post_json("/v1/orders/ORD_C1/close", &json!({}));
    assert_eq!((closed.status, closed.error_code().as_str()), (503, "platform_unavailable"), "{}", closed.text());
    assert_eq!(server.get("/v1/orders/ORD_C1").json()["status"], "PENDING");
}

// ---- WeChat Pay ----

const WECHATPAY_MCHID: &str = "1900000100";

/// A WeChat Pay answer signed as the platform signs: SHA256-RSA over
/// `"{timestamp}\n{nonce}\n{body}\n"`, serial `S1`.
pub fn wechatpay_answer(status: u16, body: &str) -> Reply {
    let timestamp = (crate::util::now_ms() / 1000).to_string();
    let nonce = "5K8264ILTKCH16CQ2502SI8ZNMTM67VS".to_owned();
    let signature = platform_sign(format!("{timestamp}\n{nonce}\n{body}\n").as_bytes());
    let headers = [
        ("Content-Type", "application/json".to_owned()),
        ("Wechatpay-Serial", "S1".to_owned()),
        ("Wechatpay-Timestamp", timestamp),
        ("Wechatpay-Nonce", nonce),
        ("Wechatpay-Signature", signature),
    ];
    (status, headers.into_iter().map(|(n, v)| (n.to_owned(), v)).collect(), body.to_owned())
}

/// The out_trade_no of a WeChat Pay trade path (`.../out-trade-no/{no}[/close]?...`).
fn wechatpay_order_no(seen: &Seen) -> String {
    let path = seen.target.split('?').next().unwrap_or_default();
    path.split("/out-trade-no/").nth(1).unwrap_or_default().trim_end_matches("/close").to_owned()
}

/// A signed SUCCESS trade answer for `order_no`.
fn wechatpay_paid(order_no: &str, transaction_id: &str, total: i64, currency: &str) -> String {
    json!({"mchid": WECHATPAY_MCHID, "appid": "wx0000000000000001", "out_trade_no": order_no,
           "transaction_id": transaction_id, "trade_type": "NATIVE", "trade_state": "SUCCESS",
           "success_time": "2024-01-01T10:00:00+08:00",
           "amount": {"total": total, "payer_total": total, "currency": currency, "payer_currency": currency}})
    .to_string()
}

fn wechatpay_flags(gateway: &Gateway, public: &str) -> Vec<String> {
    [
        "--wechatpay-mchid",
        WECHATPAY_MCHID,
        "--wechatpay-merchant-serial",
        "M1",
        "--wechatpay-merchant-key",
        MERCHANT_KEY,
        "--wechatpay-public-key",
        &format!("S1={public}"),
        "--wechatpay-api-base",
        &gateway.url(),
    ]
    .map(str::to_owned)
    .to_vec()
}

/// The (amount, transaction_id) of a signed "paid" answer payonce cannot use.
fn unusable_answers() -> Vec<(i64, String)> {
    let fine = "4200000000202401010000000001".to_owned();
    vec![
        (-1, fine.clone()),
        (0, fine.clone()),
        (1_000_000_000_001, fine),
        (1000, String::new()),
        (1000, "..".into()),
        (1000, "a b".into()),
        (1000, "1".repeat(65)),
    ]
}

fn query_responses(db: &std::path::Path, order_no: &str) -> Vec<(String, String)> {
    let conn = crate::util::read_only(db);
    let mut statement = conn
        .prepare("SELECT status, response FROM platform_call WHERE kind = 'query' AND order_no = ?1 ORDER BY id")
        .expect("prepare");
    let rows = statement.query_map([order_no], |r| Ok((r.get(0)?, r.get(1)?))).expect("query");
    rows.map(|r| r.expect("row")).collect()
}

/// A signed answer with an amount or transaction id outside the identifiers'
/// rules is `unknown` for `/sync` and no answer for `/close` (503): never a
/// 400 blaming the caller; each query is recorded as failed, with why.
#[test]
fn an_unusable_signed_answer_is_no_answer_never_a_4xx() {
    let dir = TempDir::new("wechatpay-unusable");
    let public = platform_public_pem(&dir);
    let table: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let answers = Arc::clone(&table);
    let gateway = Gateway::start(move |seen| {
        let order_no = wechatpay_order_no(seen);
        let answers = answers.lock().expect("table");
        match answers.iter().find(|(o, _)| *o == order_no) {
            Some((_, body)) => wechatpay_answer(200, body),
            None => wechatpay_answer(404, r#"{"code":"ORDER_NOT_EXIST","message":"no such order"}"#),
        }
    });
    let flags = wechatpay_flags(&gateway, &public);
    let args: Vec<&str> = flags.iter().map(String::as_str).collect();
    let server = Server::start_on(&dir.path("payonce.db"), &args);
    for (i, (amount, transaction_id)) in unusable_answers().into_iter().enumerate() {
        let order_no = format!("ORD-UNUSABLE-{i}");
        table
            .lock()
            .expect("table")
            .push((order_no.clone(), wechatpay_paid(&order_no, &transaction_id, amount, "CNY")));
        let case = format!("amount {amount}, transaction_id {transaction_id:?}");
        let created = server.post_json("/v1/orders", &json!({"order_no": order_no, "user_id": "u1", "amount": 1000}));
        assert_eq!(created.status, 201, "{}", created.text());
        let synced = server.post_json(&format!("/v1/orders/{order_no}/sync"), &json!({}));
        assert_eq!(synced.status, 200, "{case}: /sync {}", synced.text());
        assert_eq!(synced.json()["platforms"][0]["state"], "unknown", "{case}: {}", synced.text());
        assert_eq!(synced.json()["order"]["status"], "PENDING", "{case}: {}", synced.text());
        let closed = server.post_json(&format!("/v1/orders/{order_no}/close"), &json!({}));
        assert_eq!((closed.status, closed.error_code().as_str()), (503, "platform_unavailable"), "{case}: /close");
        let recorded = query_responses(&server.db, &order_no);
        assert_eq!(recorded.len(), 2, "{case}: both queries recorded: {recorded:?}");
        assert!(
            recorded.iter().all(|(status, response)| status == "failed" && response.contains("the answer's")),
            "{case}: recorded as failed with why: {recorded:?}"
        );
    }
}

/// An expired order whose platform keeps answering an unusable "paid" still
/// closes when `--close-give-up-s` has passed, and each attempt is recorded.
#[test]
fn an_expired_order_with_an_unusable_paid_answer_gives_up_on_time() {
    let dir = TempDir::new("wechatpay-unusable-expired");
    let public = platform_public_pem(&dir);
    let gateway = Gateway::start(|seen| {
        let order_no = wechatpay_order_no(seen);
        wechatpay_answer(200, &wechatpay_paid(&order_no, "4200000000202401010000000002", -1, "CNY"))
    });
    let flags = wechatpay_flags(&gateway, &public);
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    args.extend(["--sweep-interval-s", "1", "--close-give-up-s", "2", "--platform-retry-s", "0.5"]);
    args.extend(["--platform-timeout-ms", "1000"]);
    let server = Server::start_on(&dir.path("payonce.db"), &args);
    let created = server.post_json(
        "/v1/orders",
        &json!({"order_no": "ORD-GIVE-UP", "user_id": "u1", "amount": 1000, "expires_in_s": 1}),
    );
    assert_eq!(created.status, 201, "{}", created.text());
    let deadline = Instant::now() + Duration::from_secs(12);
    let detail = loop {
        let detail = server.get("/v1/orders/ORD-GIVE-UP").json();
        if detail["status"] != "PENDING" {
            break detail;
        }
        assert!(Instant::now() < deadline, "still PENDING past --close-give-up-s: {detail}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(detail["status"], "CLOSED", "{detail}");
    let actions: Vec<&Value> = detail["audit"].as_array().into_iter().flatten().map(|a| &a["action"]).collect();
    assert_eq!(actions, [&json!("close_given_up")], "{detail}");
    let conn = crate::util::read_only(&server.db);
    let (status, response): (String, String) = conn
        .query_row("SELECT status, response FROM platform_call WHERE kind = 'close'", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .expect("the close row");
    assert_eq!(status, "given_up");
    assert!(response.contains("amount -1"), "the attempt says why: {response}");
}

/// A signed WeChat Pay answer in another currency than the order's is
/// `amount_mismatch`, not a payment; a USD order paid in USD is refunded in USD.
#[test]
fn currency_is_part_of_a_queried_amount_and_refunds_go_in_the_orders_currency() {
    let dir = TempDir::new("wechatpay-currency");
    let public = platform_public_pem(&dir);
    let gateway = Gateway::start(|seen| {
        if seen.target.starts_with("/v3/refund/domestic/refunds") {
            let asked: Value = serde_json::from_str(&seen.body).unwrap_or(Value::Null);
            let body = json!({"out_refund_no": asked["out_refund_no"], "refund_id": "50000000001",
                              "out_trade_no": asked["out_trade_no"], "status": "PROCESSING"});
            return wechatpay_answer(200, &body.to_string());
        }
        let order_no = wechatpay_order_no(seen);
        let transaction_id =
            if order_no.ends_with('C') { "4200000001202401010000000011" } else { "4200000001202401010000000012" };
        wechatpay_answer(200, &wechatpay_paid(&order_no, transaction_id, 1000, "USD"))
    });
    let flags = wechatpay_flags(&gateway, &public);
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    args.extend(["--sweep-interval-s", "1", "--coupon", "NEW10"]);
    let server = Server::start_on(&dir.path("payonce.db"), &args);
    for (order_no, currency) in [("ORD-CUR-C", "CNY"), ("ORD-CUR-U", "USD")] {
        let body = json!({"order_no": order_no, "user_id": "u1", "amount": 1000, "currency": currency});
        assert_eq!(server.post_json("/v1/orders", &body).status, 201);
    }
    let synced = server.post_json("/v1/orders/ORD-CUR-C/sync", &json!({}));
    assert_eq!(synced.status, 200, "{}", synced.text());
    let detail = server.get("/v1/orders/ORD-CUR-C").json();
    assert_eq!(detail["status"], "PENDING", "1000 USD does not pay 1000 CNY: {detail}");
    assert_eq!(detail["payments"][0]["outcome"], "amount_mismatch", "{detail}");
    assert_eq!(detail["coupons"], json!([]), "{detail}");

    let synced = server.post_json("/v1/orders/ORD-CUR-U/sync", &json!({}));
    assert_eq!(synced.json()["order"]["status"], "PAID", "{}", synced.text());
    let refund = server.post_json("/v1/orders/ORD-CUR-U/refund", &json!({"refund_no": "RF-CUR-U"}));
    assert_eq!(refund.status, 200, "{}", refund.text());
    gateway.wait_for(|s| s.target == "/v3/refund/domestic/refunds", 1, Duration::from_secs(10));
    let submitted = gateway.seen().into_iter().find(|s| s.target == "/v3/refund/domestic/refunds").expect("sent");
    let submitted: Value = serde_json::from_str(&submitted.body).expect("JSON");
    assert_eq!(submitted["amount"], json!({"refund": 1000, "total": 1000, "currency": "USD"}), "{submitted}");
}

/// Alipay refunds yuan: a refund of an order in another currency is never
/// sent (it would move the wrong money); the client says so without a call.
#[test]
fn an_alipay_refund_of_a_non_cny_order_is_not_sent() {
    use payonce::platforms::RefundAnswer;
    let gateway = Gateway::start(|seen| alipay_answer(seen.alipay_method(), &alipay_yes(seen.alipay_method(), "X")));
    let api = alipay_client(&gateway);
    let exchange = api.refund(
        &RefundRequest {
            order_no: "ORD_U1",
            refund_no: "RF_U1",
            amount: 1000,
            total: 1000,
            currency: "USD",
            reason: None,
            pay_no: None,
        },
        crate::util::now_ms(),
    );
    assert_eq!(exchange.meaning, RefundAnswer::NotSendable);
    assert!(exchange.distrust.as_deref().is_some_and(|why| why.contains("USD")), "{:?}", exchange.distrust);
    assert!(gateway.seen().is_empty(), "nothing sent");
}
