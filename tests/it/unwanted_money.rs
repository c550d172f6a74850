//! Money payonce did not want, returned once (docs/platforms.md, "Money payonce did not want"): a
//! payment decided `already_paid`, `paid_after_close` or `amount_mismatch`
//! is refunded at the platform that took it, by that platform's own trade
//! number (WeChat Pay `transaction_id`, Alipay `trade_no`), for its whole
//! amount, exactly once: automatically (`refund_unwanted: Auto`, also for a
//! payment decided by a drain) or by `POST /v1/admin/payments/{pay_no}/refund`,
//! every answer of which is checked; eight callers at once through two
//! payonces; duplicate and FAILED results and the next attempt's refund_no;
//! the refund_nos of long pay_nos; an Alipay full-refund notice naming no
//! request; the order, its own refunds and its rewards left alone
//! throughout; and a SIGKILL between the decision and the submission.
//!
//! WeChat Pay and Alipay are played here, on loopback, by [`FakePlatforms`]:
//! their merchant APIs as payonce's real clients call them (answers signed
//! with the TEST-ONLY platform keys of tests/fixtures), with a book of
//! trades and refunds to count, and refund submissions that can be refused
//! (the platform unreachable for them). Not `payonce simulate platforms`
//! (tests/it/platforms.rs): it settles no refund, shows no book by pay_no,
//! and refuses a refund by `transaction_id`. Results reach payonce as the
//! platforms send them: signed refund notices, or payonce's refund query.
//! Every case runs on both engines.

use crate::engines::Db;
use crate::util::{eventually, EVENTUALLY, SECRET};
use parking_lot::Mutex;
use payonce::api::{self, Request};
use payonce::config::RefundUnwanted;
use payonce::platforms::generic::Generic;
use payonce::platforms::{alipay, wechatpay, MerchantKey, Platform, Platforms};
use payonce::{App, Clock, Config, PaymentCallback, PlatformStatus, Rewards};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

// The TEST-ONLY keys of tests/fixtures (tests/it/partial_refunds.rs uses them too).
const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");
const WX_PUBLIC: &str = include_str!("../fixtures/TEST_ONLY_wechatpay_platform_a_public.pem");
const WX_PRIVATE: &str = include_str!("../fixtures/TEST_ONLY_wechatpay_platform_a_private.pem");
const WX_SERIAL: &str = "PUB_KEY_ID_TEST_A";
const APIV3_KEY: &str = "TESTONLYapiv3key0123456789abcdef";
const ALIPAY_PUBLIC: &str = include_str!("../fixtures/TEST_ONLY_alipay_platform_public.pem");
const ALIPAY_PRIVATE: &str = include_str!("../fixtures/TEST_ONLY_alipay_platform_private.pem");
const ALIPAY_APP_ID: &str = "2021000000000001";
const MCHID: &str = "1900000100";
const MERCHANT_KEY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/keys/merchant.pem");

const WECHATPAY: &str = "wechatpay";
const ALIPAY: &str = "alipay";

fn unique() -> u64 {
    static N: AtomicU64 = AtomicU64::new(1);
    N.fetch_add(1, Ordering::SeqCst)
}

/// Fen as yuan, `12.34`.
fn yuan(fen: i64) -> String {
    format!("{}.{:02}", fen / 100, fen % 100)
}

fn fen(yuan: &str) -> Option<i64> {
    let (whole, part) = yuan.split_once('.').unwrap_or((yuan, "0"));
    let part = format!("{part:0<2}");
    Some(whole.parse::<i64>().ok()? * 100 + part.get(..2)?.parse::<i64>().ok()?)
}

/// Lower-case hex SHA-256, computed here (not by payonce).
fn sha256_hex(text: &str) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(text.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// The refund_no docs/platforms.md gives a payment's `attempt`-th refund (1 = the first).
fn expected_refund_no(pay_no: &str, attempt: u32) -> String {
    let suffix = if attempt == 1 { String::new() } else { format!("-{attempt}") };
    let plain = format!("U-{pay_no}{suffix}");
    if plain.chars().count() <= 64 {
        plain
    } else {
        format!("U-{}{suffix}", &sha256_hex(pay_no)[..40])
    }
}

// ---------------------------------------------------------------- the platforms, played here

/// A paid trade a platform holds.
#[derive(Clone, Debug)]
struct Trade {
    channel: &'static str,
    order_no: String,
    pay_no: String,
    amount: i64,
}

/// A refund in a platform's book.
#[derive(Clone, Debug, PartialEq)]
struct BookRefund {
    channel: &'static str,
    refund_no: String,
    pay_no: String,
    amount: i64,
    /// WeChat Pay's words for both: PROCESSING, SUCCESS, CLOSED, ABNORMAL.
    status: String,
}

/// A refund submission as received: WeChat Pay's body, Alipay's biz_content.
#[derive(Clone, Debug)]
struct Submission {
    channel: &'static str,
    body: Value,
    /// The trade it named (by whatever number), when it named one.
    pay_no: Option<String>,
    /// The HTTP status answered (503: refused while the platform is held).
    answered: u16,
}

#[derive(Default)]
struct Book {
    trades: Vec<Trade>,
    refunds: Vec<BookRefund>,
    submissions: Vec<Submission>,
    /// Alipay's refund queries, their biz_content.
    alipay_queries: Vec<Value>,
    /// Refund submissions are answered 503, unsigned: payonce cannot reach
    /// the refund API, so the submission stays queued.
    refusing: bool,
}

impl Book {
    fn trade_by_pay_no(&self, channel: &str, pay_no: &str) -> Option<Trade> {
        self.trades.iter().find(|t| t.channel == channel && t.pay_no == pay_no).cloned()
    }

    fn trade_by_order(&self, channel: &str, order_no: &str) -> Option<Trade> {
        self.trades.iter().find(|t| t.channel == channel && t.order_no == order_no).cloned()
    }

    /// Fen of the trade held by refunds not failed.
    fn committed(&self, trade: &Trade) -> i64 {
        let held = |r: &&BookRefund| r.status == "PROCESSING" || r.status == "SUCCESS";
        self.refunds
            .iter()
            .filter(|r| r.channel == trade.channel && r.pay_no == trade.pay_no)
            .filter(held)
            .map(|r| r.amount)
            .sum()
    }

    /// Takes a refund of `amount` under `refund_no` (the same again: the same
    /// refund), or refuses it in the platform's words.
    fn take_refund(&mut self, trade: &Trade, refund_no: &str, amount: i64) -> Result<BookRefund, &'static str> {
        if let Some(existing) = self.refunds.iter().find(|r| r.channel == trade.channel && r.refund_no == refund_no) {
            if existing.pay_no != trade.pay_no || existing.amount != amount {
                return Err("the refund number is taken by another trade or amount");
            }
            return Ok(existing.clone());
        }
        if amount <= 0 || self.committed(trade) + amount > trade.amount {
            return Err("more than the trade's refundable balance");
        }
        let refund = BookRefund {
            channel: trade.channel,
            refund_no: refund_no.to_owned(),
            pay_no: trade.pay_no.clone(),
            amount,
            status: "PROCESSING".to_owned(),
        };
        self.refunds.push(refund.clone());
        Ok(refund)
    }
}

struct Played {
    book: Mutex<Book>,
    /// The time the answers are signed at: payonce's own clock.
    clock: Clock,
    wechatpay: MerchantKey,
    alipay: MerchantKey,
}

struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Played {
    /// A WeChat Pay answer signed as API v3 signs them.
    fn wx_signed(&self, status: u16, body: String) -> Answer {
        let timestamp = (self.clock.now_ms() / 1000).to_string();
        let nonce = format!("FAKENONCE{:016}", unique());
        let signature =
            self.wechatpay.sign_base64(format!("{timestamp}\n{nonce}\n{body}\n").as_bytes()).expect("sign the answer");
        let headers = vec![
            ("Wechatpay-Serial".to_owned(), WX_SERIAL.to_owned()),
            ("Wechatpay-Timestamp".to_owned(), timestamp),
            ("Wechatpay-Nonce".to_owned(), nonce),
            ("Wechatpay-Signature".to_owned(), signature),
            ("Wechatpay-Signature-Type".to_owned(), "WECHATPAY2-SHA256-RSA2048".to_owned()),
        ];
        Answer { status, headers, body }
    }

    fn wx_json(&self, status: u16, value: &Value) -> Answer {
        self.wx_signed(status, value.to_string())
    }

    fn wx_error(&self, status: u16, code: &str, message: &str) -> Answer {
        self.wx_json(status, &json!({"code": code, "message": message}))
    }

    /// An Alipay answer: `{"<method>_response": {...}, "sign": "..."}`, signed over the member's text.
    fn ali_signed(&self, method: &str, member: &Value) -> Answer {
        let name = format!("{}_response", method.replace('.', "_"));
        let text = member.to_string();
        let sign = self.alipay.sign_base64(text.as_bytes()).expect("sign the answer");
        Answer { status: 200, headers: Vec::new(), body: format!("{{\"{name}\":{text},\"sign\":\"{sign}\"}}") }
    }

    fn ali_error(&self, method: &str, sub_code: &str) -> Answer {
        self.ali_signed(
            method,
            &json!({"code": "40004", "msg": "Business Failed", "sub_code": sub_code, "sub_msg": sub_code}),
        )
    }

    fn answer(&self, method: &str, target: &str, body: &[u8]) -> Answer {
        let path = target.split('?').next().unwrap_or("");
        if path == "/gateway.do" && method == "POST" {
            return self.alipay(body);
        }
        const REFUNDS: &str = "/v3/refund/domestic/refunds";
        if path == REFUNDS && method == "POST" {
            return self.wx_refund(body);
        }
        if let (Some(refund_no), "GET") = (path.strip_prefix("/v3/refund/domestic/refunds/"), method) {
            return self.wx_refund_query(refund_no);
        }
        if let Some(rest) = path.strip_prefix("/v3/pay/transactions/out-trade-no/") {
            if method == "GET" {
                return self.wx_query(rest);
            }
            if let (Some(order_no), "POST") = (rest.strip_suffix("/close"), method) {
                let paid = self.book.lock().trade_by_order(WECHATPAY, order_no).is_some();
                return match paid {
                    true => self.wx_error(400, "ORDERPAID", "订单已支付"),
                    false => self.wx_signed(204, String::new()),
                };
            }
        }
        self.wx_error(404, "NOT_FOUND", "no such API here")
    }

    fn wx_query(&self, order_no: &str) -> Answer {
        let Some(trade) = self.book.lock().trade_by_order(WECHATPAY, order_no) else {
            return self.wx_error(404, "ORDER_NOT_EXIST", "订单不存在");
        };
        self.wx_json(
            200,
            &json!({"mchid": MCHID, "appid": "wx0000000000000001", "out_trade_no": trade.order_no,
                "transaction_id": trade.pay_no, "trade_type": "NATIVE", "trade_state": "SUCCESS",
                "trade_state_desc": "支付成功",
                "success_time": crate::util::utc8_rfc3339(self.clock.now_ms() - 60_000),
                "amount": {"total": trade.amount, "payer_total": trade.amount, "currency": "CNY",
                    "payer_currency": "CNY"}}),
        )
    }

    fn wx_refund_json(&self, refund: &BookRefund, trade: &Trade) -> Value {
        let mut answer = json!({
            "refund_id": format!("50000000{:022}", unique()), "out_refund_no": refund.refund_no,
            "transaction_id": trade.pay_no, "out_trade_no": trade.order_no, "channel": "ORIGINAL",
            "user_received_account": "招商银行信用卡0403", "status": refund.status,
            "create_time": crate::util::utc8_rfc3339(self.clock.now_ms()),
            "amount": {"total": trade.amount, "refund": refund.amount, "payer_total": trade.amount,
                "payer_refund": refund.amount, "settlement_refund": refund.amount, "settlement_total": trade.amount,
                "discount_refund": 0, "currency": "CNY"}
        });
        if refund.status == "SUCCESS" {
            answer["success_time"] = json!(crate::util::utc8_rfc3339(self.clock.now_ms()));
        }
        answer
    }

    /// `POST /v3/refund/domestic/refunds`: by `transaction_id` or `out_trade_no`.
    fn wx_refund(&self, body: &[u8]) -> Answer {
        let json: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let mut book = self.book.lock();
        let trade = match (json["transaction_id"].as_str(), json["out_trade_no"].as_str()) {
            (Some(pay_no), _) => book.trade_by_pay_no(WECHATPAY, pay_no),
            (None, Some(order_no)) => book.trade_by_order(WECHATPAY, order_no),
            (None, None) => None,
        };
        let answer = if book.refusing {
            Answer {
                status: 503, headers: Vec::new(), body: r#"{"code":"SYSTEM_ERROR","message":"系统繁忙"}"#.into()
            }
        } else {
            self.wx_refund_taken(&mut book, &json, trade.as_ref())
        };
        let pay_no = trade.map(|t| t.pay_no);
        book.submissions.push(Submission { channel: WECHATPAY, body: json, pay_no, answered: answer.status });
        answer
    }

    fn wx_refund_taken(&self, book: &mut Book, json: &Value, trade: Option<&Trade>) -> Answer {
        let (Some(refund_no), Some(amount), Some(total)) =
            (json["out_refund_no"].as_str(), json["amount"]["refund"].as_i64(), json["amount"]["total"].as_i64())
        else {
            return self.wx_error(400, "PARAM_ERROR", "out_refund_no, amount.refund, amount.total");
        };
        if json["amount"]["currency"] != "CNY" {
            return self.wx_error(400, "PARAM_ERROR", "amount.currency 须为 CNY");
        }
        let Some(trade) = trade else {
            return self.wx_error(404, "RESOURCE_NOT_EXISTS", "订单不存在");
        };
        if total != trade.amount {
            return self.wx_error(400, "INVALID_REQUEST", "amount.total 与原订单金额不一致");
        }
        match book.take_refund(trade, refund_no, amount) {
            Ok(refund) => self.wx_json(200, &self.wx_refund_json(&refund, trade)),
            Err(why) => self.wx_error(400, "INVALID_REQUEST", why),
        }
    }

    /// `GET /v3/refund/domestic/refunds/{out_refund_no}`.
    fn wx_refund_query(&self, refund_no: &str) -> Answer {
        let book = self.book.lock();
        let found = book.refunds.iter().find(|r| r.channel == WECHATPAY && r.refund_no == refund_no).cloned();
        let Some(refund) = found else {
            return self.wx_error(404, "RESOURCE_NOT_EXISTS", "退款单不存在");
        };
        let trade = book.trade_by_pay_no(WECHATPAY, &refund.pay_no).expect("the refund's trade");
        self.wx_json(200, &self.wx_refund_json(&refund, &trade))
    }

    /// Alipay's gateway: one form, its `method` and `biz_content`.
    fn alipay(&self, body: &[u8]) -> Answer {
        let form = parse_form(&String::from_utf8_lossy(body));
        let field = |name: &str| form.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str()).unwrap_or("");
        let method = field("method");
        let biz: Value = serde_json::from_str(field("biz_content")).unwrap_or(Value::Null);
        let mut book = self.book.lock();
        let trade = match (biz["trade_no"].as_str(), biz["out_trade_no"].as_str()) {
            (Some(pay_no), _) => book.trade_by_pay_no(ALIPAY, pay_no),
            (None, Some(order_no)) => book.trade_by_order(ALIPAY, order_no),
            (None, None) => None,
        };
        match method {
            "alipay.trade.query" => match trade {
                Some(t) => self.ali_signed(
                    method,
                    &json!({"code": "10000", "msg": "Success", "trade_no": t.pay_no, "out_trade_no": t.order_no,
                        "buyer_logon_id": "159****5620", "trade_status": "TRADE_SUCCESS",
                        "total_amount": yuan(t.amount)}),
                ),
                None => self.ali_error(method, "ACQ.TRADE_NOT_EXIST"),
            },
            "alipay.trade.close" => match trade {
                Some(_) => self.ali_error(method, "ACQ.TRADE_STATUS_ERROR"),
                None => self.ali_error(method, "ACQ.TRADE_NOT_EXIST"),
            },
            "alipay.trade.refund" => {
                let answer = if book.refusing {
                    Answer { status: 503, headers: Vec::new(), body: "Service Unavailable".into() }
                } else {
                    self.ali_refund_taken(&mut book, method, &biz, trade.as_ref())
                };
                let pay_no = trade.map(|t| t.pay_no);
                book.submissions.push(Submission { channel: ALIPAY, body: biz, pay_no, answered: answer.status });
                answer
            }
            "alipay.trade.fastpay.refund.query" => {
                book.alipay_queries.push(biz.clone());
                let Some(trade) = trade else {
                    return self.ali_error(method, "ACQ.TRADE_NOT_EXIST");
                };
                let request_no = biz["out_request_no"].as_str().unwrap_or("");
                let mut answer = json!({"code": "10000", "msg": "Success", "trade_no": trade.pay_no,
                    "out_trade_no": trade.order_no, "total_amount": yuan(trade.amount)});
                let refund = book
                    .refunds
                    .iter()
                    .find(|r| r.channel == ALIPAY && r.pay_no == trade.pay_no && r.refund_no == request_no);
                if let Some(refund) = refund {
                    answer["out_request_no"] = json!(refund.refund_no);
                    answer["refund_amount"] = json!(yuan(refund.amount));
                    if refund.status == "SUCCESS" {
                        answer["refund_status"] = json!("REFUND_SUCCESS");
                        answer["gmt_refund_pay"] = json!(crate::util::alipay_time(self.clock.now_ms()));
                    }
                }
                self.ali_signed(method, &answer)
            }
            _ => self.ali_error(method, "ACQ.INVALID_PARAMETER"),
        }
    }

    fn ali_refund_taken(&self, book: &mut Book, method: &str, biz: &Value, trade: Option<&Trade>) -> Answer {
        let (Some(request_no), Some(amount)) =
            (biz["out_request_no"].as_str(), biz["refund_amount"].as_str().and_then(fen))
        else {
            return self.ali_error(method, "ACQ.INVALID_PARAMETER");
        };
        let Some(trade) = trade else {
            return self.ali_error(method, "ACQ.TRADE_NOT_EXIST");
        };
        match book.take_refund(trade, request_no, amount) {
            Ok(_) => {
                let refunded = book.committed(trade);
                self.ali_signed(
                    method,
                    &json!({"code": "10000", "msg": "Success", "trade_no": trade.pay_no, "out_trade_no": trade.order_no,
                        "buyer_logon_id": "159****5620", "fund_change": "Y", "refund_fee": yuan(refunded),
                        "gmt_refund_pay": crate::util::alipay_time(self.clock.now_ms())}),
                )
            }
            Err(_) => self.ali_error(method, "ACQ.REFUND_AMT_NOT_EQUAL_TOTAL"),
        }
    }
}

/// `application/x-www-form-urlencoded`, decoded.
fn parse_form(text: &str) -> Vec<(String, String)> {
    let decode = |s: &str| {
        let bytes = s.as_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            match bytes[i] {
                b'+' => out.push(b' '),
                b'%' if i + 2 < bytes.len() => {
                    let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                    match u8::from_str_radix(hex, 16) {
                        Ok(b) => {
                            out.push(b);
                            i += 2;
                        }
                        Err(_) => out.push(b'%'),
                    }
                }
                b => out.push(b),
            }
            i += 1;
        }
        String::from_utf8_lossy(&out).into_owned()
    };
    text.split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// WeChat Pay's and Alipay's merchant APIs on one loopback port: WeChat
/// Pay's paths under `/v3/`, Alipay's gateway at `/gateway.do`.
struct FakePlatforms {
    addr: SocketAddr,
    played: Arc<Played>,
    stop: Arc<AtomicBool>,
}

impl FakePlatforms {
    /// Signing its answers at `clock`'s time (payonce's own).
    fn start(clock: Clock) -> FakePlatforms {
        let played = Arc::new(Played {
            book: Mutex::new(Book::default()),
            clock,
            wechatpay: MerchantKey::from_pem(WX_PRIVATE).expect("the WeChat Pay platform key"),
            alipay: MerchantKey::from_pem(ALIPAY_PRIVATE).expect("the Alipay platform key"),
        });
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the platforms");
        let addr = listener.local_addr().expect("address");
        let stop = Arc::new(AtomicBool::new(false));
        let (serving, stopping) = (Arc::clone(&played), Arc::clone(&stop));
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                if stopping.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                let played = Arc::clone(&serving);
                std::thread::spawn(move || serve_connection(&played, stream));
            }
        });
        FakePlatforms { addr, played, stop }
    }

    fn wechatpay_base(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn alipay_gateway(&self) -> String {
        format!("http://{}/gateway.do", self.addr)
    }

    /// The buyer paid `order_no` at `channel` as `pay_no`.
    fn paid(&self, channel: &'static str, order_no: &str, pay_no: &str, amount: i64) {
        let trade = Trade { channel, order_no: order_no.into(), pay_no: pay_no.into(), amount };
        self.played.book.lock().trades.push(trade);
    }

    /// Every refund of the trade `pay_no`, at either platform.
    fn refunds_of(&self, pay_no: &str) -> Vec<BookRefund> {
        self.played.book.lock().refunds.iter().filter(|r| r.pay_no == pay_no).cloned().collect()
    }

    fn refund_count(&self) -> usize {
        self.played.book.lock().refunds.len()
    }

    /// Every refund submission naming the trade `pay_no`.
    fn submissions_of(&self, pay_no: &str) -> Vec<Submission> {
        let book = self.played.book.lock();
        book.submissions.iter().filter(|s| s.pay_no.as_deref() == Some(pay_no)).cloned().collect()
    }

    fn submission_count(&self) -> usize {
        self.played.book.lock().submissions.len()
    }

    /// Alipay's refund queries asking about `refund_no`, their biz_content.
    fn alipay_queries_of(&self, refund_no: &str) -> Vec<Value> {
        let book = self.played.book.lock();
        book.alipay_queries.iter().filter(|biz| biz["out_request_no"] == refund_no).cloned().collect()
    }

    /// The platform settles a refund: SUCCESS, CLOSED or ABNORMAL.
    fn settle(&self, refund_no: &str, status: &str) {
        let mut book = self.played.book.lock();
        let refund = book.refunds.iter_mut().find(|r| r.refund_no == refund_no);
        refund.unwrap_or_else(|| panic!("no refund {refund_no} at the platform")).status = status.to_owned();
    }

    fn refuse_refunds(&self, refusing: bool) {
        self.played.book.lock().refusing = refusing;
    }
}

impl Drop for FakePlatforms {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
    }
}

/// One request on a connection, answered, then the connection closed.
fn serve_connection(played: &Played, mut stream: TcpStream) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut request_line = lines.next().unwrap_or("").split(' ');
    let (method, target) = (request_line.next().unwrap_or("").to_owned(), request_line.next().unwrap_or("").to_owned());
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let header = |name: &str| headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let mut body = buf[head_end..].to_vec();
    if header("transfer-encoding").is_some_and(|v| v.to_ascii_lowercase().contains("chunked")) {
        while !body.windows(5).any(|w| w == b"0\r\n\r\n") {
            match stream.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => body.extend_from_slice(&chunk[..n]),
            }
        }
        body = dechunk(&body);
    } else {
        let length: usize = header("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
        while body.len() < length {
            match stream.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => body.extend_from_slice(&chunk[..n]),
            }
        }
    }
    let answer = played.answer(&method, &target, &body);
    let mut out = format!("HTTP/1.1 {} X\r\nConnection: close\r\n", answer.status);
    if answer.status != 204 {
        out.push_str(&format!(
            "Content-Type: application/json;charset=utf-8\r\nContent-Length: {}\r\n",
            answer.body.len()
        ));
    }
    for (name, value) in &answer.headers {
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    out.push_str("\r\n");
    out.push_str(&answer.body);
    let _ = stream.write_all(out.as_bytes());
    let _ = stream.flush();
}

fn dechunk(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = bytes;
    loop {
        let Some(end) = rest.windows(2).position(|w| w == b"\r\n") else { return out };
        let size =
            usize::from_str_radix(String::from_utf8_lossy(&rest[..end]).split(';').next().unwrap_or("").trim(), 16)
                .unwrap_or(0);
        rest = &rest[end + 2..];
        if size == 0 || rest.len() < size {
            return out;
        }
        out.extend_from_slice(&rest[..size]);
        rest = &rest[(size + 2).min(rest.len())..];
    }
}

// ---------------------------------------------------------------- payonce in this process

/// How long after its submission an unsettled refund is queried, and the
/// wait before a failed platform call is tried again.
const QUERY_AFTER_MS: i64 = 1_000;
const RETRY_MS: u64 = 1_000;

/// One payonce in this process on `db`, answering through `api::handle`,
/// its platform calls worked when the test says ([`Shop::pump`]).
struct Shop {
    app: App,
    clock: Clock,
}

fn config(fake: &FakePlatforms, unwanted: RefundUnwanted) -> Config {
    let timeout = Duration::from_millis(2_000);
    let merchant = || MerchantKey::from_pem(&std::fs::read_to_string(MERCHANT_KEY).expect("fixture")).expect("key");
    let wx_key = wechatpay::public_key_from_pem(WX_PUBLIC).expect("WeChat Pay platform key");
    let wx_keys = vec![(WX_SERIAL.to_owned(), wx_key)];
    let wx_notices =
        wechatpay::Wechatpay::new(wechatpay::WechatpayConfig::new(APIV3_KEY, wx_keys.clone()).expect("settings"));
    let wx_calls =
        wechatpay::WechatpayApi::new(MCHID.into(), "M1".into(), merchant(), &fake.wechatpay_base(), wx_keys, timeout);
    let ali_key = alipay::public_key_from_text(ALIPAY_PUBLIC).expect("Alipay public key");
    let ali_notices =
        alipay::Alipay::new(alipay::AlipayConfig { public_key: ali_key.clone(), app_id: ALIPAY_APP_ID.into() });
    let ali_calls = alipay::AlipayApi::new(ALIPAY_APP_ID.into(), merchant(), &fake.alipay_gateway(), ali_key, timeout);
    let platforms = Platforms {
        timeout_ms: 2_000,
        retry_schedule_ms: vec![RETRY_MS],
        refund_query_after_ms: QUERY_AFTER_MS,
        ..Platforms::with([
            Platform::notices(Generic::new(vec![SECRET.as_bytes().to_vec()])),
            Platform::both(wx_notices, wx_calls),
            Platform::both(ali_notices, ali_calls),
        ])
    };
    Config {
        rewards: Rewards { coupon_templates: vec!["NEW10".into()], points_per_yuan: 1 },
        platforms,
        refund_unwanted: unwanted,
        ..Config::default()
    }
}

impl Shop {
    fn open(db: &Db, fake: &FakePlatforms, clock: &Clock, unwanted: RefundUnwanted) -> Shop {
        let app = App::open(&db.spec, clock.clone(), config(fake, unwanted))
            .unwrap_or_else(|e| panic!("{}: open: {e}", db.label()));
        Shop { app, clock: clock.clone() }
    }

    fn call(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> (u16, Value, Vec<(String, String)>) {
        let request = Request {
            method: method.into(),
            path: path.into(),
            query: String::new(),
            headers: headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            body: body.to_vec(),
        };
        let resp = api::handle(&self.app, &request);
        let value = serde_json::from_slice(&resp.body).unwrap_or_else(|_| json!(String::from_utf8_lossy(&resp.body)));
        (resp.status, value, resp.headers)
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, value, _) =
            self.call("POST", path, &[("Content-Type", "application/json")], body.to_string().as_bytes());
        (status, value)
    }

    fn detail(&self, order_no: &str) -> Value {
        let (status, value, _) = self.call("GET", &format!("/v1/orders/{order_no}"), &[], b"");
        assert_eq!(status, 200, "GET {order_no}: {value}");
        value
    }

    fn create(&self, order_no: &str, amount: i64) {
        let (status, body) =
            self.post("/v1/orders", &json!({"order_no": order_no, "user_id": "u-um", "amount": amount}));
        assert_eq!(status, 201, "create {order_no}: {body}");
    }

    /// The buyer pays `order_no` at `channel` (the platform's book holds the
    /// trade) and payonce hears of it: the outcome.
    fn pay(&self, fake: &FakePlatforms, channel: &'static str, order_no: &str, pay_no: &str, amount: i64) -> String {
        if channel != "generic" {
            fake.paid(channel, order_no, pay_no, amount);
        }
        let reply = self
            .app
            .payments()
            .deliver_payment(&PaymentCallback {
                channel: channel.into(),
                pay_no: pay_no.into(),
                order_no: order_no.into(),
                amount,
                currency: Some("CNY".into()),
                status: PlatformStatus::Success,
                paid_at: None,
                raw_body: b"{}".to_vec(),
            })
            .unwrap_or_else(|e| panic!("pay {order_no} as {pay_no}: {e}"));
        reply.outcome_str().to_owned()
    }

    fn admin_refund(&self, pay_no: &str, body: &Value) -> (u16, Value) {
        self.post(&format!("/v1/admin/payments/{pay_no}/refund"), body)
    }

    fn resolve(&self, pay_no: &str, resolution: &str) -> (u16, Value) {
        let body = json!({"resolution": resolution, "reason": "the operator's word"});
        self.post(&format!("/v1/admin/payments/{pay_no}/resolve"), &body)
    }

    /// Works every due platform call until none is left.
    fn pump(&self) {
        for _ in 0..20 {
            let worked = self.app.platform_calls().run_platform_calls_once(8).expect("the platform-call pool");
            if worked == 0 {
                return;
            }
        }
        panic!("the platform calls never ran out");
    }

    /// Time passes until the refund queries are due, and they are made.
    fn query_results(&self) {
        self.clock.advance_ms(QUERY_AFTER_MS + 500);
        self.pump();
    }

    /// The `refund_required` findings, by pay_no: their `detail`.
    fn refunds_required(&self) -> Vec<Value> {
        let (status, body, _) = self.call("GET", "/v1/inspections", &[], b"");
        assert_eq!(status, 200, "{body}");
        let findings = body["findings"].as_array().cloned().unwrap_or_default();
        findings.into_iter().filter(|f| f["kind"] == "refund_required").map(|f| f["detail"].clone()).collect()
    }

    /// Every finding about `order_no`, whatever its kind.
    fn findings_of_order(&self, order_no: &str) -> Vec<Value> {
        let (status, body, _) = self.call("GET", "/v1/inspections", &[], b"");
        assert_eq!(status, 200, "{body}");
        let findings = body["findings"].as_array().cloned().unwrap_or_default();
        findings.into_iter().filter(|f| f["order_no"] == order_no).collect()
    }

    fn finding_of(&self, pay_no: &str) -> Option<Value> {
        self.refunds_required().into_iter().find(|d| d["pay_no"] == pay_no)
    }

    /// A WeChat Pay refund notice (`REFUND.{status}`), encrypted and signed
    /// as WeChat Pay v3 sends them: (HTTP status, body).
    fn wx_refund_notice(
        &self,
        order_no: &str,
        pay_no: &str,
        refund_no: &str,
        status: &str,
        amount: i64,
    ) -> (u16, Value) {
        use aes_gcm::aead::{Aead, Payload};
        use aes_gcm::{Aes256Gcm, KeyInit, Nonce};
        use base64::Engine;
        let mut plain = json!({
            "mchid": MCHID, "out_trade_no": order_no, "transaction_id": pay_no,
            "out_refund_no": refund_no, "refund_id": format!("5000{:020}", unique()), "refund_status": status,
            "user_received_account": "招商银行信用卡0403",
            "amount": {"total": amount, "refund": amount, "payer_total": amount, "payer_refund": amount}
        });
        if status == "SUCCESS" {
            plain["success_time"] = json!(crate::util::utc8_rfc3339(self.clock.now_ms()));
        }
        let nonce = format!("rn{:010}", unique());
        let cipher = Aes256Gcm::new_from_slice(APIV3_KEY.as_bytes()).expect("32-byte key");
        let sealed = cipher
            .encrypt(Nonce::from_slice(nonce.as_bytes()), Payload { msg: plain.to_string().as_bytes(), aad: b"refund" })
            .expect("encrypt");
        let body = json!({
            "id": format!("EV-{:012}", unique()), "create_time": crate::util::utc8_rfc3339(self.clock.now_ms()),
            "resource_type": "encrypt-resource", "event_type": format!("REFUND.{status}"), "summary": "退款结果",
            "resource": {"original_type": "refund", "algorithm": "AEAD_AES_256_GCM",
                "ciphertext": base64::engine::general_purpose::STANDARD.encode(sealed),
                "associated_data": "refund", "nonce": nonce}
        })
        .to_string();
        let timestamp = (self.clock.now_ms() / 1000).to_string();
        let signing_nonce = format!("5K8264ILTKCH16CQ2502SI8Z{:08}", unique());
        let key = MerchantKey::from_pem(WX_PRIVATE).expect("key");
        let signature = key.sign_base64(format!("{timestamp}\n{signing_nonce}\n{body}\n").as_bytes()).expect("sign");
        let headers = [
            ("Content-Type", "application/json"),
            ("Wechatpay-Serial", WX_SERIAL),
            ("Wechatpay-Timestamp", timestamp.as_str()),
            ("Wechatpay-Nonce", signing_nonce.as_str()),
            ("Wechatpay-Signature", signature.as_str()),
            ("Wechatpay-Signature-Type", "WECHATPAY2-SHA256-RSA2048"),
        ];
        let (code, answer, _) = self.call("POST", "/v1/callbacks/wechatpay/refund", &headers, body.as_bytes());
        (code, answer)
    }

    /// An Alipay refund notice of `refund_no`, the trade `pay_no` fully
    /// refunded (`refund_fee`, the trade's refunded total, is its amount),
    /// signed RSA2: (HTTP status, body).
    fn alipay_refund_notice(&self, order_no: &str, pay_no: &str, refund_no: &str, amount: i64) -> (u16, Value) {
        self.alipay_full_refund_notice(order_no, pay_no, Some(refund_no), amount)
    }

    /// The same, naming the refund request (`out_biz_no`) or, as Alipay may
    /// for a full refund, none.
    fn alipay_full_refund_notice(
        &self,
        order_no: &str,
        pay_no: &str,
        out_biz_no: Option<&str>,
        amount: i64,
    ) -> (u16, Value) {
        let mut params: Vec<(String, String)> = [
            ("app_id", ALIPAY_APP_ID.to_owned()),
            ("charset", "utf-8".to_owned()),
            ("notify_type", "trade_status_sync".to_owned()),
            ("notify_time", crate::util::alipay_time(self.clock.now_ms())),
            ("notify_id", format!("ac05099524730693a8b330c5ecf7{:08}", unique())),
            ("version", "1.0".to_owned()),
            ("trade_status", "TRADE_CLOSED".to_owned()),
            ("trade_no", pay_no.to_owned()),
            ("out_trade_no", order_no.to_owned()),
            ("out_biz_no", out_biz_no.unwrap_or_default().to_owned()),
            ("total_amount", yuan(amount)),
            ("refund_fee", yuan(amount)),
            ("gmt_refund", format!("{}.123", crate::util::alipay_time(self.clock.now_ms()))),
        ]
        .into_iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        params.sort();
        let content = params.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&");
        let key = MerchantKey::from_pem(ALIPAY_PRIVATE).expect("key");
        params.push(("sign".into(), key.sign_base64(content.as_bytes()).expect("sign")));
        params.push(("sign_type".into(), "RSA2".into()));
        let encode = crate::util::form_encode;
        let body = params.iter().map(|(k, v)| format!("{k}={}", encode(v))).collect::<Vec<_>>().join("&");
        let headers = [("Content-Type", "application/x-www-form-urlencoded; charset=utf-8")];
        let (code, answer, _) = self.call("POST", "/v1/callbacks/alipay", &headers, body.as_bytes());
        (code, answer)
    }
}

/// The integer `sql` selects, on either engine.
fn int(db: &Db, sql: &str) -> i64 {
    db.count(&db.store(), sql)
}

/// Refund rows of the payment `pay_no`.
fn refund_rows(db: &Db, pay_no: &str) -> i64 {
    int(db, &format!("SELECT count(*) FROM refund WHERE pay_no = '{pay_no}'"))
}

/// audit_log rows of `action` about `order_no`.
fn audits(db: &Db, order_no: &str, action: &str) -> i64 {
    int(db, &format!("SELECT count(*) FROM audit_log WHERE order_no = '{order_no}' AND action = '{action}'"))
}

/// The payment `pay_no` of the order, as `GET /v1/orders/{order_no}` lists it.
fn payment_of(order: &Value, pay_no: &str) -> Value {
    let payments = order["payments"].as_array().cloned().unwrap_or_default();
    payments.into_iter().find(|p| p["pay_no"] == pay_no).unwrap_or_else(|| panic!("no payment {pay_no}: {order}"))
}

/// A refund as a `refund_required` finding shows it: the refund object
/// without `order_no` and `pay_no`, which the finding states itself (the
/// interface said the whole refund object; payonce shows these fields).
fn as_in_finding(refund: &Value) -> Value {
    let mut shown = refund.clone();
    if let Some(fields) = shown.as_object_mut() {
        fields.remove("order_no");
        fields.remove("pay_no");
    }
    shown
}

/// The names of an object's members.
fn key_set(value: &Value) -> BTreeSet<&str> {
    value.as_object().map(|o| o.keys().map(String::as_str).collect()).unwrap_or_default()
}

/// The order's own state and rewards: what no payment's refund may touch.
fn own_state(order: &Value) -> Value {
    let keys = [
        "status",
        "pay_no",
        "paid_at",
        "amount",
        "refunded_amount",
        "refunding_amount",
        "refund_no",
        "refunded_at",
        "coupons",
        "points",
        "refunds",
    ];
    Value::Object(keys.iter().map(|k| ((*k).to_owned(), order[*k].clone())).collect())
}

/// The order's events of `kind`, by event_id.
fn events_of(order: &Value, kind: &str) -> Vec<String> {
    let events = order["events"].as_array().cloned().unwrap_or_default();
    events.iter().filter(|e| e["type"] == kind).map(|e| e["event_id"].as_str().unwrap_or("").to_owned()).collect()
}

/// `YYYY-MM-DDTHH:MM:SS.sssZ`, payonce's one time format.
fn is_time(value: &Value) -> bool {
    value.as_str().and_then(payonce::clock::parse_rfc3339_ms).map(payonce::clock::format_ms).as_deref()
        == value.as_str()
}

#[track_caller]
fn refused(answer: &(u16, Value), status: u16, code: &str, what: &str) {
    assert_eq!((answer.0, answer.1["error"]["code"].as_str().unwrap_or("")), (status, code), "{what}: {}", answer.1);
}

/// The one submission the platform accepted for `pay_no`, checked to name
/// the trade by the platform's own number, never by out_trade_no, for the
/// payment's whole amount (WeChat Pay: of a trade of that amount).
#[track_caller]
fn accepted_submission(fake: &FakePlatforms, channel: &str, pay_no: &str, refund_no: &str, amount: i64) -> Value {
    let accepted: Vec<Submission> = fake.submissions_of(pay_no).into_iter().filter(|s| s.answered == 200).collect();
    let numbers: Vec<&str> = accepted
        .iter()
        .map(|s| s.body[if s.channel == WECHATPAY { "out_refund_no" } else { "out_request_no" }].as_str().unwrap_or(""))
        .filter(|n| *n == refund_no)
        .collect();
    assert_eq!(numbers.len(), 1, "one submission of {refund_no} accepted: {accepted:?}");
    let sent = accepted
        .iter()
        .find(|s| s.body[if s.channel == WECHATPAY { "out_refund_no" } else { "out_request_no" }] == refund_no)
        .expect("it")
        .clone();
    assert_eq!(sent.channel, channel, "{refund_no} went to the platform that took {pay_no}");
    let body = &sent.body;
    assert!(body.get("out_trade_no").is_none(), "{refund_no} names the trade by its number, not out_trade_no: {body}");
    match channel {
        WECHATPAY => {
            assert_eq!(body["transaction_id"], pay_no, "{body}");
            assert_eq!(body["amount"]["refund"], amount, "the whole payment: {body}");
            assert_eq!(body["amount"]["total"], amount, "the payment's amount as the total: {body}");
            assert_eq!(body["amount"]["currency"], "CNY", "{body}");
        }
        _ => {
            assert_eq!(body["trade_no"], pay_no, "{body}");
            assert_eq!(body["refund_amount"], yuan(amount), "the whole payment, in yuan: {body}");
        }
    }
    body.clone()
}

/// After its refund SUCCEEDED: the payment `refunded`, audited and
/// announced once, its finding gone, and the platform holding exactly one
/// successful refund of the whole payment.
#[track_caller]
fn assert_refunded(
    db: &Db,
    shop: &Shop,
    fake: &FakePlatforms,
    order_no: &str,
    pay_no: &str,
    amount: i64,
    refund_no: &str,
) {
    let what = format!("{}: {pay_no}", db.label());
    let order = shop.detail(order_no);
    let payment = payment_of(&order, pay_no);
    assert_eq!(payment["resolution"], "refunded", "{what}: {payment}");
    let refunds = payment["refunds"].as_array().cloned().unwrap_or_default();
    let last = refunds.last().cloned().unwrap_or_default();
    assert_eq!(
        (&last["refund_no"], &last["status"], &last["amount"], &last["pay_no"]),
        (&json!(refund_no), &json!("SUCCEEDED"), &json!(amount), &json!(pay_no)),
        "{what}: {payment}"
    );
    assert!(is_time(&last["settled_at"]), "{what}: {payment}");
    assert_eq!(audits(db, order_no, "payment_refunded"), 1, "{what}: audited once");
    assert_eq!(events_of(&order, "payment.refunded"), [format!("payment.refunded:{pay_no}")], "{what}: announced once");
    let events = order["events"].as_array().cloned().unwrap_or_default();
    let event = events.iter().find(|e| e["type"] == "payment.refunded").cloned().unwrap_or_default();
    let told = (
        &event["data"]["refund"]["refund_no"],
        &event["data"]["refund"]["amount"],
        &event["data"]["payment"]["pay_no"],
    );
    assert_eq!(told, (&json!(refund_no), &json!(amount), &json!(pay_no)), "{what}: {event}");
    assert_eq!(shop.finding_of(pay_no), None, "{what}: no refund_required finding left");
    let left = shop.findings_of_order(order_no);
    assert_eq!(left, Vec::<Value>::new(), "{what}: no finding of any kind about the order");
    let at_platform = fake.refunds_of(pay_no);
    let succeeded: Vec<&BookRefund> = at_platform.iter().filter(|r| r.status == "SUCCESS").collect();
    assert_eq!(succeeded.len(), 1, "{what}: one refund at the platform: {at_platform:?}");
    assert_eq!((succeeded[0].refund_no.as_str(), succeeded[0].amount), (refund_no, amount), "{what}");
}

// ---------------------------------------------------------------- refunded automatically

/// How the payment came to be unwanted.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Unwanted {
    /// The other platform's payment paid the order first.
    AlreadyPaid,
    /// The order was closed (at both platforms) before.
    PaidAfterClose,
    /// A pending order paid one fen short.
    AmountMismatch,
}

/// How the refund's result reaches payonce.
#[derive(Clone, Copy, Debug, PartialEq)]
enum ResultBy {
    Notice,
    Query,
}

/// With `refund_unwanted: Auto`, the unwanted payment at `channel` is
/// refunded in the transaction that records it: submitted once by the
/// platform's trade number, for its whole amount; in flight it cannot be
/// resolved otherwise; its result (delivered twice) resolves it `refunded`
/// once; the order and its rewards never move.
fn refunded_automatically(db: &Db, channel: &'static str, unwanted: Unwanted, result: ResultBy) {
    let clock = Clock::manual(crate::util::now_ms());
    let fake = FakePlatforms::start(clock.clone());
    let shop = Shop::open(db, &fake, &clock, RefundUnwanted::Auto);
    let other = if channel == WECHATPAY { ALIPAY } else { WECHATPAY };
    let tag = format!("{}_{}", &channel[..2].to_uppercase(), unique());
    let order_no = format!("UM_A_{tag}");
    let pay_no = format!("UNW_{tag}");
    let what = format!("{} {channel} {unwanted:?} {result:?}", db.label());
    shop.create(&order_no, 10_000);
    let (outcome, amount) = match unwanted {
        Unwanted::AlreadyPaid => {
            assert_eq!(shop.pay(&fake, other, &order_no, &format!("OK_{tag}"), 10_000), "applied", "{what}");
            ("already_paid", 10_000)
        }
        Unwanted::PaidAfterClose => {
            let (status, closed) = shop.post(&format!("/v1/orders/{order_no}/close"), &json!({}));
            assert_eq!((status, &closed["status"]), (200, &json!("CLOSED")), "{what}: {closed}");
            ("paid_after_close", 10_000)
        }
        Unwanted::AmountMismatch => ("amount_mismatch", 9_999),
    };
    let before = own_state(&shop.detail(&order_no));
    if unwanted == Unwanted::AlreadyPaid {
        assert_eq!(before["status"], "PAID", "{what}");
        assert_eq!(before["coupons"].as_array().map(Vec::len), Some(1), "{what}: the order earned a coupon");
        assert_eq!(before["points"].as_array().map(Vec::len), Some(1), "{what}: and points");
    }

    // Recorded and refunded in one transaction: REQUESTED, queued, audited.
    assert_eq!(shop.pay(&fake, channel, &order_no, &pay_no, amount), outcome, "{what}");
    let refund_no = expected_refund_no(&pay_no, 1);
    assert_eq!(refund_no, format!("U-{pay_no}"), "the case's own arithmetic");
    assert_eq!(refund_rows(db, &pay_no), 1, "{what}: the refund requested with the decision");
    let queued = format!("SELECT count(*) FROM platform_call WHERE kind = 'refund' AND refund_no = '{refund_no}'");
    assert_eq!(int(db, &format!("{queued} AND channel = '{channel}' AND status = 'pending'")), 1, "{what}");
    assert_eq!(audits(db, &order_no, "payment_refund_requested"), 1, "{what}");
    assert_eq!(fake.submission_count(), 0, "{what}: nothing sent before the pool runs");
    let order = shop.detail(&order_no);
    let payment = payment_of(&order, &pay_no);
    assert_eq!(
        (&payment["outcome"], &payment["resolution"]),
        (&json!(outcome), &json!("refunding")),
        "{what}: {payment}"
    );
    let listed = payment["refunds"].as_array().cloned().unwrap_or_default();
    assert_eq!(listed.len(), 1, "{what}: {payment}");
    let requested = json!({"refund_no": refund_no, "order_no": order_no, "pay_no": pay_no, "amount": amount,
        "status": "REQUESTED", "reason": listed[0]["reason"], "requested_at": listed[0]["requested_at"],
        "settled_at": null});
    assert_eq!(listed[0], requested, "{what}");
    assert!(listed[0]["reason"].as_str().is_some_and(|r| (1..=80).contains(&r.chars().count())), "{what}: {payment}");
    assert!(is_time(&listed[0]["requested_at"]), "{what}: {payment}");
    assert_eq!(own_state(&order), before, "{what}: the order untouched by the decision");
    // In flight, still reported, and not to be resolved another way.
    let finding = shop.finding_of(&pay_no).unwrap_or_else(|| panic!("{what}: reported while refunding"));
    assert_eq!(
        (&finding["resolution"], &finding["refund"]),
        (&json!("refunding"), &as_in_finding(&requested)),
        "{what}: {finding}"
    );
    refused(&shop.resolve(&pay_no, "refunded_externally"), 409, "invalid_transition", &what);
    refused(&shop.resolve(&pay_no, "accepted"), 409, "invalid_transition", &what);
    // The admin route names the same refund.
    let (status, again) = shop.admin_refund(&pay_no, &json!({"reason": "asked again by hand"}));
    assert_eq!((status, &again["refund"]), (200, &requested), "{what}: {again}");
    assert_eq!(refund_rows(db, &pay_no), 1, "{what}");

    // Submitted once, to the platform that took it.
    shop.pump();
    accepted_submission(&fake, channel, &pay_no, &refund_no, amount);
    assert_eq!(fake.refunds_of(&pay_no).len(), 1, "{what}");
    assert_eq!(fake.refund_count(), 1, "{what}: nothing refunded at {other}");
    assert_eq!(int(db, &format!("{queued} AND status = 'done'")), 1, "{what}");
    shop.pump();
    assert_eq!(fake.submission_count(), 1, "{what}: and never again");
    assert_eq!(payment_of(&shop.detail(&order_no), &pay_no)["resolution"], "refunding", "{what}");

    // The result, twice.
    fake.settle(&refund_no, "SUCCESS");
    let notice = || match channel {
        WECHATPAY => shop.wx_refund_notice(&order_no, &pay_no, &refund_no, "SUCCESS", amount),
        _ => shop.alipay_refund_notice(&order_no, &pay_no, &refund_no, amount),
    };
    let taken = if channel == WECHATPAY { 204 } else { 200 };
    match result {
        ResultBy::Notice => assert_eq!(notice().0, taken, "{what}"),
        ResultBy::Query => {
            shop.query_results();
            if channel == ALIPAY {
                let asked = fake.alipay_queries_of(&refund_no);
                assert_eq!(asked.len(), 1, "{what}: one refund query: {asked:?}");
                assert_eq!(asked[0]["trade_no"], pay_no.as_str(), "{what}: by the payment's trade_no: {asked:?}");
                assert!(asked[0].get("out_trade_no").is_none(), "{what}: without out_trade_no: {asked:?}");
            }
        }
    }
    assert_refunded(db, &shop, &fake, &order_no, &pay_no, amount, &refund_no);
    let (code, body) = notice();
    assert_eq!(code, taken, "{what}: a repeat is acknowledged: {body}");
    shop.query_results();
    assert_refunded(db, &shop, &fake, &order_no, &pay_no, amount, &refund_no);
    assert_eq!(fake.submission_count(), 1, "{what}");
    assert_eq!(audits(db, &order_no, "payment_refund_requested"), 1, "{what}");
    let (status, after) = shop.admin_refund(&pay_no, &json!({"reason": "once more"}));
    assert_eq!(
        (status, &after["refund"]["refund_no"], &after["refund"]["status"]),
        (200, &json!(refund_no), &json!("SUCCEEDED")),
        "{what}: {after}"
    );
    assert_eq!(own_state(&shop.detail(&order_no)), before, "{what}: the order untouched throughout");
    assert_eq!(refund_rows(db, &pay_no), 1, "{what}");
}

for_each_engine! {
    /// WeChat Pay's payment paid the order; Alipay's, the second, is refunded at Alipay.
    fn auto_already_paid_at_alipay(db) {
        refunded_automatically(db, ALIPAY, Unwanted::AlreadyPaid, ResultBy::Notice);
    }

    /// Alipay's payment paid the order; WeChat Pay's, the second, is refunded at WeChat Pay.
    fn auto_already_paid_at_wechatpay(db) {
        refunded_automatically(db, WECHATPAY, Unwanted::AlreadyPaid, ResultBy::Query);
    }

    fn auto_paid_after_close_at_wechatpay(db) {
        refunded_automatically(db, WECHATPAY, Unwanted::PaidAfterClose, ResultBy::Notice);
    }

    fn auto_paid_after_close_at_alipay(db) {
        refunded_automatically(db, ALIPAY, Unwanted::PaidAfterClose, ResultBy::Query);
    }

    fn auto_amount_mismatch_at_wechatpay(db) {
        refunded_automatically(db, WECHATPAY, Unwanted::AmountMismatch, ResultBy::Query);
    }

    fn auto_amount_mismatch_at_alipay(db) {
        refunded_automatically(db, ALIPAY, Unwanted::AmountMismatch, ResultBy::Notice);
    }

    /// Auto mode leaves alone what it cannot refund (the generic channel has
    /// no outgoing settings) and what was wanted: no refund, still reported.
    fn auto_refunds_only_unwanted_money_it_can_return(db) {
        let clock = Clock::manual(crate::util::now_ms());
        let fake = FakePlatforms::start(clock.clone());
        let shop = Shop::open(db, &fake, &clock, RefundUnwanted::Auto);
        shop.create("UM_G_1", 500);
        assert_eq!(shop.pay(&fake, "generic", "UM_G_1", "G_1A", 500), "applied");
        assert_eq!(shop.pay(&fake, "generic", "UM_G_1", "G_1B", 500), "already_paid");
        assert_eq!(shop.pay(&fake, WECHATPAY, "UM_G_1", "WX_G1C", 500), "already_paid");
        shop.pump();
        assert_eq!(refund_rows(db, "G_1A") + refund_rows(db, "G_1B"), 0, "{}", db.label());
        assert_eq!(refund_rows(db, "WX_G1C"), 1, "{}", db.label());
        let order = shop.detail("UM_G_1");
        assert_eq!(payment_of(&order, "G_1A")["resolution"], Value::Null, "{order}");
        assert_eq!(payment_of(&order, "G_1B")["resolution"], Value::Null, "{order}");
        assert_eq!(payment_of(&order, "G_1A")["refunds"], json!([]), "{order}");
        let finding = shop.finding_of("G_1B").unwrap_or_else(|| panic!("{}: G_1B still to be refunded", db.label()));
        assert_eq!((&finding["resolution"], &finding["refund"]), (&Value::Null, &Value::Null), "{finding}");
        assert_eq!(shop.finding_of("G_1A"), None);
        assert_eq!(fake.submissions_of("WX_G1C").len(), 1, "{}", db.label());
        assert_eq!(fake.submission_count(), 1, "{}: only the WeChat Pay payment", db.label());
        refused(&shop.admin_refund("G_1B", &json!({"reason": "by hand"})), 404, "channel_not_configured", db.label());
    }
}

for_each_engine! {
    /// A payment's refund is not the order's: while Alipay returns the
    /// second payment, the order (paid by WeChat Pay) is refunded in full
    /// by the merchant; neither refund counts against the other's balance
    /// or in-flight rule, each goes to its own platform, and the order's
    /// `refunds` list holds its own refund only.
    fn the_order_refunds_itself_beside_a_payment_refund(db) {
        let clock = Clock::manual(crate::util::now_ms());
        let fake = FakePlatforms::start(clock.clone());
        let shop = Shop::open(db, &fake, &clock, RefundUnwanted::Auto);
        let label = db.label();
        shop.create("UM_O_1", 10_000);
        assert_eq!(shop.pay(&fake, WECHATPAY, "UM_O_1", "WX_O1", 10_000), "applied");
        assert_eq!(shop.pay(&fake, ALIPAY, "UM_O_1", "ALI_O2", 10_000), "already_paid");
        assert_eq!(payment_of(&shop.detail("UM_O_1"), "ALI_O2")["resolution"], "refunding");
        let (status, asked) = shop.post("/v1/orders/UM_O_1/refunds", &json!({"refund_no": "R-O-1"}));
        assert_eq!(status, 201, "{label}: not refund_in_progress: {asked}");
        assert_eq!((&asked["refund"]["amount"], &asked["refund"]["pay_no"]), (&json!(10_000), &Value::Null), "{asked}");
        let order = &asked["order"];
        assert_eq!((&order["status"], &order["refunding_amount"]), (&json!("REFUNDING"), &json!(10_000)), "{asked}");
        let listed: Vec<Value> = shop.detail("UM_O_1")["refunds"].as_array().cloned().unwrap_or_default().iter()
            .map(|r| r["refund_no"].clone()).collect();
        assert_eq!(listed, [json!("R-O-1")], "{label}: the order's refunds only");
        shop.pump();
        accepted_submission(&fake, ALIPAY, "ALI_O2", "U-ALI_O2", 10_000);
        let order_refund: Vec<BookRefund> = fake.refunds_of("WX_O1");
        assert_eq!(order_refund.len(), 1, "{label}: {order_refund:?}");
        assert_eq!((order_refund[0].refund_no.as_str(), order_refund[0].amount), ("R-O-1", 10_000), "{label}");

        fake.settle("R-O-1", "SUCCESS");
        assert_eq!(shop.wx_refund_notice("UM_O_1", "WX_O1", "R-O-1", "SUCCESS", 10_000).0, 204);
        let order = shop.detail("UM_O_1");
        assert_eq!((&order["status"], &order["refunded_amount"]), (&json!("REFUNDED"), &json!(10_000)), "{order}");
        assert_eq!(payment_of(&order, "ALI_O2")["resolution"], "refunding", "{label}: the payment's refund is its own");
        fake.settle("U-ALI_O2", "SUCCESS");
        assert_eq!(shop.alipay_refund_notice("UM_O_1", "ALI_O2", "U-ALI_O2", 10_000).0, 200);
        assert_refunded(db, &shop, &fake, "UM_O_1", "ALI_O2", 10_000, "U-ALI_O2");
        let order = shop.detail("UM_O_1");
        assert_eq!((&order["status"], &order["refunded_amount"]), (&json!("REFUNDED"), &json!(10_000)), "{order}");
        assert_eq!(payment_of(&order, "WX_O1")["resolution"], Value::Null, "{label}: {order}");
        assert_eq!(events_of(&order, "order.refunded"), ["order.refunded:UM_O_1/R-O-1"], "{label}");
        assert_eq!(fake.submission_count(), 2, "{label}");
    }
}

for_each_engine! {
    /// Alipay's notice of a full refund may name no request (TRADE_CLOSED
    /// with gmt_refund, no out_biz_no): for the unwanted payment's trade it
    /// settles that payment's refund, and leaves the order's own refund
    /// (at WeChat Pay, in flight at the same time) alone.
    fn an_alipay_notice_naming_no_request_settles_the_payments_refund(db) {
        let clock = Clock::manual(crate::util::now_ms());
        let fake = FakePlatforms::start(clock.clone());
        let shop = Shop::open(db, &fake, &clock, RefundUnwanted::Auto);
        let label = db.label();
        shop.create("UM_I_1", 6_000);
        assert_eq!(shop.pay(&fake, WECHATPAY, "UM_I_1", "WX_I1", 6_000), "applied");
        assert_eq!(shop.pay(&fake, ALIPAY, "UM_I_1", "ALI_I2", 6_000), "already_paid");
        let (status, asked) = shop.post("/v1/orders/UM_I_1/refunds", &json!({"refund_no": "R-I-1", "amount": 1_000}));
        assert_eq!(status, 201, "{label}: {asked}");
        shop.pump();
        accepted_submission(&fake, ALIPAY, "ALI_I2", "U-ALI_I2", 6_000);
        assert_eq!(fake.refunds_of("WX_I1").len(), 1, "{label}: the order's refund at WeChat Pay");
        fake.settle("U-ALI_I2", "SUCCESS");
        let (code, body) = shop.alipay_full_refund_notice("UM_I_1", "ALI_I2", None, 6_000);
        assert_eq!((code, body), (200, json!("success")), "{label}");
        assert_refunded(db, &shop, &fake, "UM_I_1", "ALI_I2", 6_000, "U-ALI_I2");
        let order = shop.detail("UM_I_1");
        let own = (&order["status"], &order["refunding_amount"], &order["refund_no"], &order["refunds"][0]["status"]);
        assert_eq!(own, (&json!("REFUNDING"), &json!(1_000), &json!("R-I-1"), &json!("REQUESTED")), "{label}: {order}");
        fake.settle("R-I-1", "SUCCESS");
        assert_eq!(shop.wx_refund_notice("UM_I_1", "WX_I1", "R-I-1", "SUCCESS", 1_000).0, 204);
        let order = shop.detail("UM_I_1");
        assert_eq!((&order["status"], &order["refunded_amount"]), (&json!("PAID"), &json!(1_000)), "{label}: {order}");
        assert_refunded(db, &shop, &fake, "UM_I_1", "ALI_I2", 6_000, "U-ALI_I2");
    }

    /// A payment recorded while payonce only records (`record_only`) is
    /// decided by the drain: decided unwanted, its refund is requested with
    /// that decision, not before.
    fn a_drained_payment_is_refunded_with_its_decision(db) {
        let clock = Clock::manual(crate::util::now_ms());
        let fake = FakePlatforms::start(clock.clone());
        let shop = Shop::open(db, &fake, &clock, RefundUnwanted::Auto);
        let label = db.label();
        let mode = |mode: &str| {
            let body = json!({"mode": mode}).to_string();
            let (status, answer, _) =
                shop.call("PUT", "/v1/admin/mode", &[("Content-Type", "application/json")], body.as_bytes());
            assert_eq!(status, 200, "{label}: {answer}");
        };
        shop.create("UM_D_1", 2_000);
        assert_eq!(shop.pay(&fake, WECHATPAY, "UM_D_1", "WX_D1", 2_000), "applied");
        mode("record_only");
        assert_eq!(shop.pay(&fake, ALIPAY, "UM_D_1", "ALI_D2", 2_000), "recorded");
        shop.pump();
        assert_eq!((refund_rows(db, "ALI_D2"), fake.submission_count()), (0, 0), "{label}: nothing decided yet");
        assert_eq!(payment_of(&shop.detail("UM_D_1"), "ALI_D2")["refunds"], json!([]), "{label}");
        mode("normal");
        let (status, drained) = shop.post("/v1/admin/drain", &json!({}));
        assert_eq!(status, 200, "{label}: {drained}");
        let payment = payment_of(&shop.detail("UM_D_1"), "ALI_D2");
        let decided = (&payment["outcome"], &payment["resolution"]);
        assert_eq!(decided, (&json!("already_paid"), &json!("refunding")), "{label}: {payment}");
        assert_eq!(audits(db, "UM_D_1", "payment_refund_requested"), 1, "{label}");
        shop.pump();
        accepted_submission(&fake, ALIPAY, "ALI_D2", "U-ALI_D2", 2_000);
        assert_eq!(fake.submission_count(), 1, "{label}");
    }
}

// ---------------------------------------------------------------- asked by the operator

for_each_engine! {
    /// `POST /v1/admin/payments/{pay_no}/refund` in manual mode: every answer
    /// of the interface, what each writes, and the refund it makes at Alipay.
    fn every_answer_of_the_admin_refund_route(db) {
        let clock = Clock::manual(crate::util::now_ms());
        let fake = FakePlatforms::start(clock.clone());
        let shop = Shop::open(db, &fake, &clock, RefundUnwanted::Manual);
        let label = db.label();
        shop.create("UM_M_1", 10_000);
        assert_eq!(shop.pay(&fake, WECHATPAY, "UM_M_1", "WX_M1", 10_000), "applied");
        let before = own_state(&shop.detail("UM_M_1"));
        assert_eq!(shop.pay(&fake, ALIPAY, "UM_M_1", "ALI_M1", 10_000), "already_paid");
        shop.create("UM_M_G", 500);
        assert_eq!(shop.pay(&fake, "generic", "UM_M_G", "G_M1", 500), "applied");
        assert_eq!(shop.pay(&fake, "generic", "UM_M_G", "G_M2", 500), "already_paid");
        shop.create("UM_M_ACC", 700);
        assert_eq!(shop.pay(&fake, WECHATPAY, "UM_M_ACC", "WX_MA1", 700), "applied");
        assert_eq!(shop.pay(&fake, ALIPAY, "UM_M_ACC", "ALI_MA2", 700), "already_paid");
        assert_eq!(shop.resolve("ALI_MA2", "accepted").0, 200);
        // Manual: nothing refunded until asked.
        shop.pump();
        assert_eq!((refund_rows(db, "ALI_M1"), fake.submission_count()), (0, 0), "{label}");
        assert_eq!(payment_of(&shop.detail("UM_M_1"), "ALI_M1")["resolution"], Value::Null);
        let finding = shop.finding_of("ALI_M1").unwrap_or_else(|| panic!("{label}: reported"));
        assert_eq!(finding["resolution"], Value::Null, "{finding}");

        // 400: the reason is required, 1-80 characters, no control characters.
        let bad = [
            (json!({}), "no reason"),
            (json!({"reason": ""}), "empty reason"),
            (json!({"reason": "退".repeat(81)}), "81 characters"),
            (json!({"reason": "a".repeat(81)}), "81 ASCII characters"),
            (json!({"reason": "line\nbreak"}), "a control character"),
            (json!({"reason": 5}), "not a string"),
            (json!({"reason": null}), "null"),
        ];
        for (body, what) in &bad {
            refused(&shop.admin_refund("ALI_M1", body), 400, "invalid_request", what);
        }
        let json_type = [("Content-Type", "application/json")];
        let (status, _, _) = shop.call("POST", "/v1/admin/payments/ALI_M1/refund", &json_type, b"{not json");
        assert_eq!(status, 400, "{label}: not JSON");
        assert_eq!(refund_rows(db, "ALI_M1"), 0, "{label}: a 400 writes no refund");
        assert_eq!(audits(db, "UM_M_1", "payment_refund_requested"), 0, "{label}");

        let reason = json!({"reason": "paid twice: returned to the buyer"});
        refused(&shop.admin_refund("NO_SUCH_PAY", &reason), 404, "payment_not_found", "unknown pay_no");
        refused(&shop.admin_refund("WX_M1", &reason), 409, "invalid_transition", "the applied payment");
        refused(&shop.admin_refund("G_M2", &reason), 404, "channel_not_configured", "a generic payment");
        refused(&shop.admin_refund("ALI_MA2", &reason), 409, "invalid_transition", "resolved accepted");
        assert_eq!(refund_rows(db, "WX_M1") + refund_rows(db, "G_M2") + refund_rows(db, "ALI_MA2"), 0, "{label}");

        // 200, with an 80-character reason (characters, not bytes).
        let reason80 = "退".repeat(80);
        let (status, first) = shop.admin_refund("ALI_M1", &json!({"reason": reason80}));
        assert_eq!(status, 200, "{label}: {first}");
        let keys = key_set(&first);
        assert_eq!(keys, BTreeSet::from(["payment", "refund"]), "{first}");
        let refund = &first["refund"];
        assert!(is_time(&refund["requested_at"]), "{refund}");
        let expected = json!({"refund_no": "U-ALI_M1", "order_no": "UM_M_1", "pay_no": "ALI_M1", "amount": 10_000,
            "status": "REQUESTED", "reason": reason80, "requested_at": refund["requested_at"], "settled_at": null});
        assert_eq!(refund, &expected, "{label}");
        let payment = &first["payment"];
        let keys = key_set(payment);
        let wanted: BTreeSet<&str> = ["order_no", "pay_no", "channel", "amount", "outcome", "state", "source",
            "received_at", "resolution", "refunds"].into_iter().collect();
        assert_eq!(keys, wanted, "{payment}");
        assert_eq!(
            (&payment["order_no"], &payment["pay_no"], &payment["channel"], &payment["amount"], &payment["outcome"]),
            (&json!("UM_M_1"), &json!("ALI_M1"), &json!("alipay"), &json!(10_000), &json!("already_paid")),
            "{payment}"
        );
        let in_flight = (&payment["resolution"], &payment["refunds"]);
        assert_eq!(in_flight, (&json!("refunding"), &json!([expected])), "{payment}");
        // The payment object is the order's, plus its order_no.
        let mut listed = payment_of(&shop.detail("UM_M_1"), "ALI_M1");
        listed["order_no"] = json!("UM_M_1");
        assert_eq!(payment, &listed, "{label}");

        // A repeat answers the same refund, whatever its reason.
        clock.advance_ms(1_000);
        let (status, again) = shop.admin_refund("ALI_M1", &json!({"reason": reason80}));
        assert_eq!((status, &again), (200, &first), "{label}");
        let (status, other) = shop.admin_refund("ALI_M1", &json!({"reason": "another reason"}));
        assert_eq!((status, &other["refund"]), (200, &expected), "{label}: {other}");
        // Idempotency-Key, as every admin write.
        let keyed = |key: &str| {
            let body = json!({"reason": "keyed"}).to_string();
            let headers = [("Content-Type", "application/json"), ("Idempotency-Key", key)];
            shop.call("POST", "/v1/admin/payments/ALI_M1/refund", &headers, body.as_bytes())
        };
        let (status, keyed_first, _) = keyed("um-key-1");
        assert_eq!((status, &keyed_first["refund"]), (200, &expected), "{label}: {keyed_first}");
        let (status, keyed_again, headers) = keyed("um-key-1");
        assert_eq!((status, &keyed_again), (200, &keyed_first), "{label}");
        let replayed = headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("Idempotent-Replayed") && v == "true");
        assert!(replayed, "{label}: the keyed repeat is a replay: {headers:?}");
        assert_eq!(refund_rows(db, "ALI_M1"), 1, "{label}: one refund however often asked");
        assert_eq!(audits(db, "UM_M_1", "payment_refund_requested"), 1, "{label}");
        // In flight: not to be resolved another way.
        refused(&shop.resolve("ALI_M1", "refunded_externally"), 409, "invalid_transition", "resolve while refunding");
        let finding = shop.finding_of("ALI_M1").unwrap_or_else(|| panic!("{label}: reported while refunding"));
        let shown = (&finding["resolution"], &finding["refund"]);
        assert_eq!(shown, (&json!("refunding"), &as_in_finding(&expected)), "{finding}");

        // One submission, by Alipay's trade_no, the reason passed on.
        shop.pump();
        let biz = accepted_submission(&fake, ALIPAY, "ALI_M1", "U-ALI_M1", 10_000);
        assert_eq!(biz["refund_reason"], reason80.as_str(), "{label}: {biz}");
        assert_eq!(fake.submission_count(), 1, "{label}");
        assert_eq!(fake.refunds_of("WX_M1"), [], "{label}: nothing refunded of the applied payment");

        // Alipay's notice settles it.
        fake.settle("U-ALI_M1", "SUCCESS");
        let (code, body) = shop.alipay_refund_notice("UM_M_1", "ALI_M1", "U-ALI_M1", 10_000);
        assert_eq!((code, body), (200, json!("success")), "{label}");
        assert_refunded(db, &shop, &fake, "UM_M_1", "ALI_M1", 10_000, "U-ALI_M1");
        let (status, settled) = shop.admin_refund("ALI_M1", &reason);
        assert_eq!(status, 200, "{label}: {settled}");
        let refund = &settled["refund"];
        assert_eq!((&refund["refund_no"], &refund["status"]), (&json!("U-ALI_M1"), &json!("SUCCEEDED")), "{settled}");
        assert_eq!(settled["payment"]["resolution"], "refunded", "{settled}");
        refused(&shop.admin_refund("WX_M1", &reason), 409, "invalid_transition", "still the applied payment");
        assert_eq!(fake.submission_count(), 1, "{label}");
        assert_eq!(own_state(&shop.detail("UM_M_1")), before, "{label}: the order untouched");
        assert_eq!(refund_rows(db, "ALI_M1"), 1, "{label}");
    }

    /// A FAILED result (twice) makes the payment refund-required again, the
    /// finding showing the failed refund; the next request is `-2`, a second
    /// refund at WeChat Pay, whose SUCCESS (twice) resolves it once.
    fn a_failed_refund_is_asked_again_as_dash_2(db) {
        let clock = Clock::manual(crate::util::now_ms());
        let fake = FakePlatforms::start(clock.clone());
        let shop = Shop::open(db, &fake, &clock, RefundUnwanted::Manual);
        let label = db.label();
        shop.create("UM_F_1", 3_000);
        assert_eq!(shop.pay(&fake, ALIPAY, "UM_F_1", "ALI_F1", 3_000), "applied");
        let before = own_state(&shop.detail("UM_F_1"));
        assert_eq!(shop.pay(&fake, WECHATPAY, "UM_F_1", "WX_F2", 3_000), "already_paid");
        let reason = json!({"reason": "paid twice"});
        let (status, first) = shop.admin_refund("WX_F2", &reason);
        assert_eq!((status, &first["refund"]["refund_no"]), (200, &json!("U-WX_F2")), "{label}: {first}");
        shop.pump();
        accepted_submission(&fake, WECHATPAY, "WX_F2", "U-WX_F2", 3_000);

        fake.settle("U-WX_F2", "ABNORMAL");
        for delivery in 1..=2 {
            let (code, body) = shop.wx_refund_notice("UM_F_1", "WX_F2", "U-WX_F2", "ABNORMAL", 3_000);
            assert_eq!(code, 204, "{label}: FAILED #{delivery}: {body}");
        }
        let payment = payment_of(&shop.detail("UM_F_1"), "WX_F2");
        assert_eq!(payment["resolution"], Value::Null, "{label}: refund-required again: {payment}");
        let failed = payment["refunds"][0].clone();
        assert_eq!((&failed["refund_no"], &failed["status"]), (&json!("U-WX_F2"), &json!("FAILED")), "{payment}");
        assert!(is_time(&failed["settled_at"]), "{payment}");
        let finding = shop.finding_of("WX_F2").unwrap_or_else(|| panic!("{label}: reported again"));
        let shown = (&finding["resolution"], &finding["refund"]);
        assert_eq!(shown, (&Value::Null, &as_in_finding(&failed)), "{label}: {finding}");
        assert_eq!(audits(db, "UM_F_1", "payment_refunded"), 0, "{label}");
        assert_eq!(events_of(&shop.detail("UM_F_1"), "payment.refunded"), Vec::<String>::new());
        assert_eq!(own_state(&shop.detail("UM_F_1")), before, "{label}: a failure moves no order");

        // The next attempt: a new refund_no, so a new refund at the platform.
        let (status, second) = shop.admin_refund("WX_F2", &reason);
        assert_eq!(status, 200, "{label}: {second}");
        assert_eq!((&second["refund"]["refund_no"], &second["refund"]["status"]),
            (&json!("U-WX_F2-2"), &json!("REQUESTED")), "{second}");
        assert_eq!(second["payment"]["resolution"], "refunding", "{second}");
        let numbers: Vec<Value> = second["payment"]["refunds"].as_array().cloned().unwrap_or_default().iter()
            .map(|r| json!([r["refund_no"], r["status"]])).collect();
        assert_eq!(numbers, [json!(["U-WX_F2", "FAILED"]), json!(["U-WX_F2-2", "REQUESTED"])], "{second}");
        let (status, repeat) = shop.admin_refund("WX_F2", &reason);
        assert_eq!((status, &repeat["refund"]), (200, &second["refund"]), "{label}: the repeat names -2");
        assert_eq!(audits(db, "UM_F_1", "payment_refund_requested"), 2, "{label}: once per refund");
        refused(&shop.resolve("WX_F2", "refunded_externally"), 409, "invalid_transition", "while -2 is in flight");
        shop.pump();
        accepted_submission(&fake, WECHATPAY, "WX_F2", "U-WX_F2-2", 3_000);
        assert_eq!(fake.refunds_of("WX_F2").len(), 2, "{label}");

        fake.settle("U-WX_F2-2", "SUCCESS");
        for delivery in 1..=2 {
            let (code, body) = shop.wx_refund_notice("UM_F_1", "WX_F2", "U-WX_F2-2", "SUCCESS", 3_000);
            assert_eq!(code, 204, "{label}: SUCCESS #{delivery}: {body}");
        }
        assert_refunded(db, &shop, &fake, "UM_F_1", "WX_F2", 3_000, "U-WX_F2-2");
        let payment = payment_of(&shop.detail("UM_F_1"), "WX_F2");
        let statuses: Vec<Value> = payment["refunds"].as_array().cloned().unwrap_or_default().iter()
            .map(|r| r["status"].clone()).collect();
        assert_eq!(statuses, [json!("FAILED"), json!("SUCCEEDED")], "{payment}");
        assert_eq!(own_state(&shop.detail("UM_F_1")), before, "{label}: the order untouched throughout");
        assert_eq!(fake.submission_count(), 2, "{label}");

        // After a FAILED refund the operator may return the money another
        // way and say so; then payonce refunds nothing more of it.
        shop.create("UM_F_3", 800);
        assert_eq!(shop.pay(&fake, ALIPAY, "UM_F_3", "ALI_F3", 800), "applied");
        assert_eq!(shop.pay(&fake, WECHATPAY, "UM_F_3", "WX_F3", 800), "already_paid");
        assert_eq!(shop.admin_refund("WX_F3", &reason).0, 200, "{label}");
        shop.pump();
        fake.settle("U-WX_F3", "CLOSED");
        shop.query_results();
        assert_eq!(payment_of(&shop.detail("UM_F_3"), "WX_F3")["refunds"][0]["status"], "FAILED", "{label}");
        let (status, resolved) = shop.resolve("WX_F3", "refunded_externally");
        assert_eq!(status, 200, "{label}: a failed refund leaves the payment to resolve: {resolved}");
        refused(&shop.admin_refund("WX_F3", &reason), 409, "invalid_transition", "resolved refunded_externally");
        let payment = payment_of(&shop.detail("UM_F_3"), "WX_F3");
        assert_eq!(payment["resolution"], "refunded_externally", "{label}: {payment}");
        assert_eq!(shop.finding_of("WX_F3"), None, "{label}");
        assert_eq!((refund_rows(db, "WX_F3"), fake.submissions_of("WX_F3").len()), (1, 1), "{label}");
    }

    /// `U-` + pay_no up to 64 characters, else `U-` + 40 hex digits of its
    /// SHA-256; the attempts after a failure `-2`, `-3`, shortened the same
    /// way: a 62-character pay_no's first refund_no is plain and its second
    /// hashed, a 63-character one's both hashed. Each failure here comes by
    /// the refund query (WeChat Pay CLOSED).
    fn refund_nos_of_long_pay_nos_and_later_attempts(db) {
        let clock = Clock::manual(crate::util::now_ms());
        let fake = FakePlatforms::start(clock.clone());
        let shop = Shop::open(db, &fake, &clock, RefundUnwanted::Manual);
        let label = db.label();
        let pay62 = format!("TX62{}", "1".repeat(58));
        let pay63 = format!("TX63{}", "2".repeat(59));
        assert_eq!((pay62.len(), pay63.len()), (62, 63));
        let hash62 = &sha256_hex(&pay62)[..40];
        let hash63 = &sha256_hex(&pay63)[..40];
        let cases: [(&str, &str, Vec<String>); 3] = [
            ("UM_L_62", &pay62, vec![format!("U-{pay62}"), format!("U-{hash62}-2")]),
            ("UM_L_63", &pay63, vec![format!("U-{hash63}"), format!("U-{hash63}-2")]),
            ("UM_L_S", "WX_LS", vec!["U-WX_LS".into(), "U-WX_LS-2".into(), "U-WX_LS-3".into()]),
        ];
        for (order_no, pay_no, numbers) in &cases {
            for (i, number) in numbers.iter().enumerate() {
                assert_eq!(number, &expected_refund_no(pay_no, i as u32 + 1), "the case's own arithmetic");
                assert!(number.len() <= 64, "{number}");
            }
            shop.create(order_no, 2_500);
            assert_eq!(shop.pay(&fake, ALIPAY, order_no, &format!("ALI_{order_no}"), 2_500), "applied");
            assert_eq!(shop.pay(&fake, WECHATPAY, order_no, pay_no, 2_500), "already_paid");
            for (i, number) in numbers.iter().enumerate() {
                let (status, asked) = shop.admin_refund(pay_no, &json!({"reason": "paid twice"}));
                let attempt = i + 1;
                let named = (status, &asked["refund"]["refund_no"]);
                assert_eq!(named, (200, &json!(number)), "{label}: #{attempt}: {asked}");
                shop.pump();
                accepted_submission(&fake, WECHATPAY, pay_no, number, 2_500);
                let last = i + 1 == numbers.len();
                fake.settle(number, if last { "SUCCESS" } else { "CLOSED" });
                shop.query_results();
                let payment = payment_of(&shop.detail(order_no), pay_no);
                let status = &payment["refunds"][i]["status"];
                if last {
                    assert_eq!(status, "SUCCEEDED", "{label}: {payment}");
                } else {
                    let failed = (status, &payment["resolution"]);
                    assert_eq!(failed, (&json!("FAILED"), &Value::Null), "{label}: {payment}");
                    let finding = shop.finding_of(pay_no).unwrap_or_else(|| panic!("{label}: {pay_no} reported"));
                    assert_eq!(finding["refund"]["refund_no"], number.as_str(), "{label}: {finding}");
                    assert_eq!(finding["refund"]["status"], "FAILED", "{label}: {finding}");
                }
            }
            assert_refunded(db, &shop, &fake, order_no, pay_no, 2_500, numbers.last().expect("one"));
            let at_platform: Vec<String> = fake.refunds_of(pay_no).iter().map(|r| r.refund_no.clone()).collect();
            assert_eq!(&at_platform, numbers, "{label}: one refund at the platform per attempt");
            assert_eq!(refund_rows(db, pay_no), numbers.len() as i64, "{label}");
        }
    }

    /// Eight operators ask at once, through two payonces on one database
    /// (as two processes): one refund, every answer naming it, one
    /// submission at the platform.
    fn eight_concurrent_requests_make_one_refund(db) {
        use std::sync::Barrier;
        let clock = Clock::manual(crate::util::now_ms());
        let fake = FakePlatforms::start(clock.clone());
        let shops = [
            Shop::open(db, &fake, &clock, RefundUnwanted::Manual),
            Shop::open(db, &fake, &clock, RefundUnwanted::Manual),
        ];
        let label = db.label();
        for round in 0..3 {
            let (order_no, pay_no) = (format!("UM_C_{round}"), format!("WX_C{round}"));
            shops[0].create(&order_no, 1_000);
            assert_eq!(shops[0].pay(&fake, ALIPAY, &order_no, &format!("ALI_C{round}"), 1_000), "applied");
            assert_eq!(shops[1].pay(&fake, WECHATPAY, &order_no, &pay_no, 1_000), "already_paid");
            let barrier = Barrier::new(8);
            let answers: Vec<(u16, Value)> = std::thread::scope(|scope| {
                let callers: Vec<_> = (0..8)
                    .map(|t| {
                        let (shop, barrier, pay_no) = (&shops[t % 2], &barrier, &pay_no);
                        scope.spawn(move || {
                            barrier.wait();
                            shop.admin_refund(pay_no, &json!({"reason": format!("operator {t}")}))
                        })
                    })
                    .collect();
                callers.into_iter().map(|c| c.join().expect("a caller")).collect()
            });
            let numbers: BTreeSet<String> = answers
                .iter()
                .map(|(status, body)| {
                    assert_eq!(*status, 200, "{label} round {round}: {body}");
                    body["refund"]["refund_no"].as_str().unwrap_or("").to_owned()
                })
                .collect();
            assert_eq!(numbers, BTreeSet::from([format!("U-{pay_no}")]), "{label} round {round}");
            let reasons: BTreeSet<String> =
                answers.iter().map(|(_, b)| b["refund"]["reason"].as_str().unwrap_or("").to_owned()).collect();
            assert_eq!(reasons.len(), 1, "{label} round {round}: every answer is the one refund: {reasons:?}");
            assert_eq!(refund_rows(db, &pay_no), 1, "{label} round {round}");
            assert_eq!(audits(db, &order_no, "payment_refund_requested"), 1, "{label} round {round}");
            let queued =
                format!("SELECT count(*) FROM platform_call WHERE kind = 'refund' AND refund_no = 'U-{pay_no}'");
            assert_eq!(int(db, &queued), 1, "{label} round {round}: queued once");
            std::thread::scope(|scope| {
                for shop in &shops {
                    scope.spawn(move || shop.pump());
                }
            });
            accepted_submission(&fake, WECHATPAY, &pay_no, &format!("U-{pay_no}"), 1_000);
            assert_eq!(fake.submissions_of(&pay_no).len(), 1, "{label} round {round}: submitted once");
            assert_eq!(fake.refunds_of(&pay_no).len(), 1, "{label} round {round}");
        }
        assert_eq!(fake.submission_count(), 3, "{label}");
    }
}

// ---------------------------------------------------------------- SIGKILL between the decision and the submission

/// `payonce serve`'s flags for both platforms, outgoing calls only, at `fake`.
fn serve_flags(fake: &FakePlatforms) -> Vec<String> {
    let wx_public = format!("{WX_SERIAL}={FIXTURES}/TEST_ONLY_wechatpay_platform_a_public.pem");
    let ali_public = format!("{FIXTURES}/TEST_ONLY_alipay_platform_public.pem");
    [
        ["--wechatpay-mchid", MCHID],
        ["--wechatpay-merchant-serial", "M1"],
        ["--wechatpay-merchant-key", MERCHANT_KEY],
        ["--wechatpay-public-key", &wx_public],
        ["--wechatpay-api-base", &fake.wechatpay_base()],
        ["--alipay-app-id", ALIPAY_APP_ID],
        ["--alipay-app-private-key", MERCHANT_KEY],
        ["--alipay-public-key", &ali_public],
        ["--alipay-gateway", &fake.alipay_gateway()],
        ["--refund-unwanted", "auto"],
        ["--sweep-interval-s", "1"],
        ["--platform-timeout-ms", "2000"],
        ["--platform-retry-s", "0.2"],
        ["--refund-query-after-s", "3600"],
    ]
    .iter()
    .flat_map(|pair| pair.iter().map(|s| s.to_string()))
    .collect()
}

for_each_engine! {
    /// `payonce serve --refund-unwanted auto` learns (by its sync) that both
    /// platforms took the order's money; the refund of the unwanted payment
    /// is decided with it, but its platform refuses refund submissions, so
    /// it is still queued when payonce is SIGKILLed. The payonce started
    /// next submits it once the platform answers again, and a third start
    /// sends nothing more: the platform's book holds one refund of it.
    fn sigkill_between_the_decision_and_the_submission(db) {
        const ORDER: &str = "UM_KILL_1";
        let fake = FakePlatforms::start(Clock::System);
        fake.paid(WECHATPAY, ORDER, "WX_KILL_1", 10_000);
        fake.paid(ALIPAY, ORDER, "ALI_KILL_1", 10_000);
        fake.refuse_refunds(true);
        let flags = serve_flags(&fake);
        let args: Vec<&str> = flags.iter().map(String::as_str).collect();
        let label = db.label();

        let mut first = db.serve(&args);
        let created = first.post_json("/v1/orders", &json!({"order_no": ORDER, "user_id": "u1", "amount": 10_000}));
        assert_eq!(created.status, 201, "{}", created.text());
        let synced = first.post_json(&format!("/v1/orders/{ORDER}/sync"), &json!({}));
        assert_eq!((synced.status, &synced.json()["order"]["status"]), (200, &json!("PAID")), "{}", synced.text());
        let order = first.get(&format!("/v1/orders/{ORDER}")).json();
        let outcomes: BTreeSet<(String, String)> = order["payments"].as_array().cloned().unwrap_or_default().iter()
            .map(|p| (p["outcome"].as_str().unwrap_or("").to_owned(), p["pay_no"].as_str().unwrap_or("").to_owned()))
            .collect();
        let unwanted = outcomes.iter().find(|(o, _)| o == "already_paid").map(|(_, p)| p.clone())
            .unwrap_or_else(|| panic!("{label}: one payment already_paid: {order}"));
        let wanted = if unwanted == "WX_KILL_1" { "ALI_KILL_1" } else { "WX_KILL_1" };
        assert_eq!(outcomes.len(), 2, "{label}: {order}");
        let channel = if unwanted.starts_with("WX") { WECHATPAY } else { ALIPAY };
        let refund_no = format!("U-{unwanted}");
        // The pool tries, the platform refuses: still queued.
        eventually(EVENTUALLY, "a refused submission", || !fake.submissions_of(&unwanted).is_empty());
        let before = own_state(&first.get(&format!("/v1/orders/{ORDER}")).json());
        first.kill();

        assert_eq!(fake.refund_count(), 0, "{label}: nothing refunded before the kill");
        assert!(fake.submissions_of(&unwanted).iter().all(|s| s.answered == 503), "{label}");
        let store = db.store();
        let count = |sql: &str| db.count(&store, sql);
        let calls = format!("SELECT count(*) FROM platform_call WHERE kind = 'refund' AND refund_no = '{refund_no}'");
        assert_eq!(count(&format!("{calls} AND status = 'pending' AND channel = '{channel}'")), 1, "{label}: queued");
        assert_eq!(count(&format!("SELECT count(*) FROM refund WHERE refund_no = '{refund_no}' AND status = 'REQUESTED'
            AND pay_no = '{unwanted}' AND amount = 10000")), 1, "{label}");

        // The platform answers again; the next payonce submits it.
        fake.refuse_refunds(false);
        let mut second = db.serve(&args);
        eventually(EVENTUALLY, "the refund submitted after the restart", || count(&format!("{calls} AND status = 'done'")) == 1);
        accepted_submission(&fake, channel, &unwanted, &refund_no, 10_000);
        std::thread::sleep(Duration::from_millis(1_000));
        let detail = second.get(&format!("/v1/orders/{ORDER}")).json();
        assert_eq!(payment_of(&detail, &unwanted)["resolution"], "refunding", "{label}: {detail}");
        assert_eq!(own_state(&detail), before, "{label}: the order untouched");
        second.kill();

        let third = db.serve(&args);
        std::thread::sleep(Duration::from_millis(1_500));
        let accepted = fake.submissions_of(&unwanted).into_iter().filter(|s| s.answered == 200).count();
        assert_eq!(accepted, 1, "{label}: submitted once in all");
        let book: Vec<(String, i64)> =
            fake.refunds_of(&unwanted).into_iter().map(|r| (r.refund_no, r.amount)).collect();
        assert_eq!(book, [(refund_no.clone(), 10_000)], "{label}: one refund of the payment at {channel}");
        assert_eq!(fake.refunds_of(wanted), [], "{label}: nothing of the payment that paid the order");
        assert_eq!(count(&calls), 1, "{label}: one submission row");
        assert_eq!(refund_rows(db, &unwanted), 1, "{label}");
        let detail = third.get(&format!("/v1/orders/{ORDER}")).json();
        assert_eq!(own_state(&detail), before, "{label}: the order untouched");
    }
}
