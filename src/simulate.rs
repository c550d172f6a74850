//! `payonce simulate`: a payment platform played against payonce.
//!
//! The simulator creates orders, delivers signed callbacks in every
//! real-world duplicate form (concurrent duplicates, a re-delivery 40 ms
//! later, a gateway replay after a lost answer, the platforms' retry
//! schedules, two payments of one order, a payment after close, a refund
//! and its duplicate, a triple-clicked order creation), then reads the
//! results back through payonce's own read API and judges them:
//!
//! - the answers payonce gave (`applied`, `duplicate`, ...) are the ones the
//!   contract prescribes, as a multiset (which of two racing deliveries wins
//!   is not fixed, that exactly one wins is);
//! - `GET /v1/orders/{order_no}`: the final status, one `pay_callback_log`
//!   row per pay_no with the right outcome, at most one coupon per (order,
//!   template), at most one `ORDER_PAID` points entry, reversals and frozen
//!   coupons after a refund;
//! - `GET /v1/events`: exactly the events each order must have caused, once;
//! - `GET /v1/inspections`: payonce's own independent witness (it knows the
//!   rewards that were due), no finding on the simulator's orders except the
//!   `refund_required` each double payment must raise.
//!
//! Nothing is assumed: a verdict comes only from what payonce answered and
//! what its read API shows. Without `--target` the simulator starts a payonce
//! in this process (in-memory database, HTTP on loopback) and then also knows
//! the reward settings, so it expects exact coupon and points counts.
//!
//! Signing is per [`Channel`]: a real platform is one more variant and one
//! more arm in [`Channel::sign_payment`], [`Channel::sign_refund`] and
//! [`Channel::answer`].

use crate::app::{ApiToken, Config};
use crate::clock::Clock;
use crate::domain::Rewards;
use crate::http::{Server, WORKERS_DEFAULT};
use crate::App;
use parking_lot::{Condvar, Mutex};
use serde_json::{json, Value};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::ffi::OsString;
use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub const USAGE: &str = "\
Usage: payonce simulate [--target URL] [options]

Plays a payment platform against payonce and checks that every payment took
effect exactly once. Without --target it starts its own payonce in this
process (in-memory database; coupon template SIM-COUPON and 1 point per yuan
on payment) and talks to it over HTTP on loopback. Each scenario creates its
own orders (order_nos prefixed with a fresh run id, so reruns against one
server never collide), delivers signed callbacks, then reads the results back
(GET /v1/orders/{no}, /v1/events, /v1/inspections) and prints a table on
stdout: scenario, deliveries sent (and what payonce answered), effects
expected, effects observed, verdict. Exit status 0 when every scenario is ok,
1 on any violation, 2 on an error (e.g. the target is unreachable).

Scenarios (default: all, in this order):
  concurrent           K deliveries of one pay_no at the same moment (--concurrency)
  redelivery_40ms      the same callback again 40 ms after the first (the incident)
  gateway_replay       the first answer is lost (the client times out) and the
                       callback is re-sent on a new connection
  retry_schedule       WeChat Pay's (15s 15s 30s 3m 10m 20m 30m 30m 30m 1h 3h 3h 3h
                       6h 6h) and Alipay's (4m 10m 10m 1h 2h 6h 15h) retry schedules,
                       every answer treated as lost so the whole schedule is
                       delivered; compressed by --time-factor
  two_channels         two pay_nos for one order at once: one applied, one
                       already_paid (+ payment.refund_required)
  payment_after_close  the order is closed, then paid: paid_after_close
  refund               pay, request the refund twice, deliver its SUCCESS twice
  triple_click         three concurrent POST /v1/orders with one order_no

Options:
  --target URL            a running payonce, e.g. http://127.0.0.1:8080 (plain HTTP)
  --callback-secret S     generic-channel secret (the first of a comma-separated
                          list); env PAYONCE_CALLBACK_SECRET. Required with --target.
  --api-token T           bearer token for the order, event and inspection endpoints;
                          env PAYONCE_API_TOKEN (a `name:token` entry works too)
  --channel NAME          the channel to sign for [default: generic, the only one so far]
  --scenario NAME         run only this scenario (repeatable, or comma-separated)
  --orders N              orders per scenario [default: 10]
  --concurrency K         simultaneous deliveries in `concurrent` [default: 8]
  --time-factor F         retry schedules run F times faster [default: 1000, which
                          plays the full 24-hour schedules in about 90 s]
  --replay-timeout-ms MS  how long gateway_replay's first attempt waits for the
                          answer before the gateway gives up [default: 0: it gives
                          up at once, so that answer is always lost; with MS > 0
                          a fast payonce may answer in time]
  -h, --help              this help

Against --target the simulator cannot know the server's reward settings: it
then checks at most one coupon per (order, template) and at most one
ORDER_PAID points entry per order, and relies on payonce's inspection
(paid_without_rewards) for rewards that were due but are missing.
";

/// The coupon template and points rate of the in-process payonce.
pub const SIM_COUPON: &str = "SIM-COUPON";
pub const SIM_POINTS_PER_YUAN: i64 = 1;

/// WeChat Pay's notification retry intervals after the first delivery, in seconds.
pub const WECHATPAY_RETRY_S: [u64; 15] =
    [15, 15, 30, 180, 600, 1_200, 1_800, 1_800, 1_800, 3_600, 10_800, 10_800, 10_800, 21_600, 21_600];
/// Alipay's asynchronous-notification retry intervals, in seconds.
pub const ALIPAY_RETRY_S: [u64; 7] = [240, 600, 600, 3_600, 7_200, 21_600, 54_000];

/// The gap of the incident's re-delivery.
const REDELIVERY_GAP: Duration = Duration::from_millis(40);
/// Connections that run orders side by side (the server has 16 workers).
const WORKERS: usize = 8;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const IO_TIMEOUT: Duration = Duration::from_secs(30);
const RESPONSE_BYTES_MAX: usize = 64 << 20;
const HEADER_LINE_BYTES_MAX: u64 = 16 * 1024;
/// How often a 503 `database_busy` is retried (after its Retry-After), as a platform would.
const BUSY_RETRIES: u32 = 5;
/// At most this many violation lines are printed per scenario.
const DETAILS_MAX: usize = 20;

// ---------------------------------------------------------------- scenarios

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    Concurrent,
    Redelivery40ms,
    GatewayReplay,
    RetrySchedule,
    TwoChannels,
    PaymentAfterClose,
    Refund,
    TripleClick,
}

impl Scenario {
    pub const ALL: [Scenario; 8] = [
        Scenario::Concurrent,
        Scenario::Redelivery40ms,
        Scenario::GatewayReplay,
        Scenario::RetrySchedule,
        Scenario::TwoChannels,
        Scenario::PaymentAfterClose,
        Scenario::Refund,
        Scenario::TripleClick,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scenario::Concurrent => "concurrent",
            Scenario::Redelivery40ms => "redelivery_40ms",
            Scenario::GatewayReplay => "gateway_replay",
            Scenario::RetrySchedule => "retry_schedule",
            Scenario::TwoChannels => "two_channels",
            Scenario::PaymentAfterClose => "payment_after_close",
            Scenario::Refund => "refund",
            Scenario::TripleClick => "triple_click",
        }
    }

    /// Two letters in order_nos, so an operator sees which scenario made an order.
    fn tag(self) -> &'static str {
        match self {
            Scenario::Concurrent => "cc",
            Scenario::Redelivery40ms => "rd",
            Scenario::GatewayReplay => "gr",
            Scenario::RetrySchedule => "rs",
            Scenario::TwoChannels => "tc",
            Scenario::PaymentAfterClose => "pc",
            Scenario::Refund => "rf",
            Scenario::TripleClick => "tk",
        }
    }

    pub fn parse(text: &str) -> Option<Scenario> {
        Scenario::ALL.into_iter().find(|s| s.name() == text)
    }
}

// ---------------------------------------------------------------- channels

/// A payment channel the simulator can sign for. A real platform is one
/// more variant here and one more arm in each `match` of this `impl`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Channel {
    Generic,
}

impl Channel {
    pub const ALL: [Channel; 1] = [Channel::Generic];

    pub fn name(self) -> &'static str {
        match self {
            Channel::Generic => "generic",
        }
    }

    pub fn parse(text: &str) -> Option<Channel> {
        Channel::ALL.into_iter().find(|c| c.name() == text)
    }

    /// The signed HTTP request of a payment notification.
    pub fn sign_payment(self, keys: &Keys, notice: &PaymentNotice, now_s: i64) -> Signed {
        match self {
            Channel::Generic => {
                let body = json!({
                    "pay_no": notice.pay_no, "order_no": notice.order_no, "amount": notice.amount,
                    "status": if notice.success { "SUCCESS" } else { "FAILED" },
                });
                generic_signed("/v1/callbacks/generic", &keys.generic_secret, body, now_s)
            }
        }
    }

    /// The signed HTTP request of a refund result.
    pub fn sign_refund(self, keys: &Keys, notice: &RefundNotice, now_s: i64) -> Signed {
        match self {
            Channel::Generic => {
                let body = json!({
                    "refund_no": notice.refund_no, "order_no": notice.order_no,
                    "status": if notice.success { "SUCCESS" } else { "FAILED" },
                });
                generic_signed("/v1/callbacks/generic/refund", &keys.generic_secret, body, now_s)
            }
        }
    }

    /// What payonce's answer, in the channel's protocol, says happened: the
    /// outcome, an unexpected answer as `HTTP <status> <code>`, or `Err` when
    /// the answer shows the simulator is set up wrong (signature refused,
    /// channel not configured).
    pub fn answer(self, reply: &Reply) -> Result<String, String> {
        match self {
            Channel::Generic => {
                let body = reply.json();
                match (reply.status, body["outcome"].as_str()) {
                    (200, Some(outcome)) => Ok(outcome.to_owned()),
                    (401, _) => Err(format!(
                        "payonce refused the callback signature ({}): is the callback secret right, and are the clocks within 300 s?",
                        reply.error_code()
                    )),
                    (404, _) if reply.error_code() == "channel_not_configured" => {
                        Err(format!("the target has no {} channel configured", self.name()))
                    }
                    _ => Ok(reply.summary()),
                }
            }
        }
    }
}

/// What the simulator signs with; each channel takes what it needs.
#[derive(Clone, Debug)]
pub struct Keys {
    pub generic_secret: Vec<u8>,
}

#[derive(Clone, Debug)]
pub struct PaymentNotice {
    pub pay_no: String,
    pub order_no: String,
    pub amount: i64,
    pub success: bool,
}

#[derive(Clone, Debug)]
pub struct RefundNotice {
    pub refund_no: String,
    pub order_no: String,
    pub success: bool,
}

/// A signed notification, ready to POST.
#[derive(Clone, Debug)]
pub struct Signed {
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

fn generic_signed(path: &str, secret: &[u8], body: Value, now_s: i64) -> Signed {
    let body = body.to_string().into_bytes();
    let signature = crate::signature::sign(secret, now_s, &body);
    Signed {
        path: path.to_owned(),
        headers: vec![("Content-Type".into(), "application/json".into()), ("Payonce-Signature".into(), signature)],
        body,
    }
}

// ---------------------------------------------------------------- judging

/// What the simulator knows about the rewards a payment earns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RewardRule {
    /// The in-process payonce: exact counts are expected.
    Known(Rewards),
    /// An external target: only "at most once" can be judged here; payonce's
    /// inspection (`paid_without_rewards`) witnesses missing rewards.
    Unknown,
}

/// What must be true of one order at the end of its scenario.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OrderExpect {
    pub status: String,
    /// Every answer payonce must give, as a multiset (`applied`, `duplicate`,
    /// `refund applied`, `api:create 201 PENDING`, ...). Labels starting with
    /// `api:` are the order API's answers; the rest are shown as deliveries.
    pub answers: Vec<String>,
    /// The outcomes of the order's `pay_callback_log` rows, as a multiset.
    pub payments: Vec<String>,
    /// Rewards were earned (one applied payment).
    pub paid: bool,
    /// Refunded: coupons FROZEN, points reversed.
    pub refunded: bool,
    /// Exact count of each event type for the order; types not listed: none.
    pub events: Vec<(String, usize)>,
    /// Exact count of each inspection finding kind; kinds not listed: none.
    pub findings: Vec<(String, usize)>,
    /// How many orders the order's user must have (triple_click).
    pub orders_of_user: Option<usize>,
}

/// One payment row as `GET /v1/orders/{order_no}` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeenPayment {
    pub pay_no: String,
    pub outcome: String,
    pub state: String,
}

/// What the simulator saw of one order: the answers to its deliveries and
/// the read API's view afterwards.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OrderSeen {
    pub order_no: String,
    pub amount: i64,
    /// `None`: the order does not exist (404).
    pub status: Option<String>,
    pub pay_no: Option<String>,
    pub payments: Vec<SeenPayment>,
    /// (coupon_template_id, status)
    pub coupons: Vec<(String, String)>,
    /// (point_type, points)
    pub points: Vec<(String, i64)>,
    pub events: BTreeMap<String, usize>,
    pub findings: BTreeMap<String, usize>,
    pub answers: Vec<String>,
    /// Answers the simulator never received (the gateway timed out).
    pub lost: usize,
    pub orders_of_user: Option<usize>,
}

/// Every way `seen` breaks `expect`; empty means exactly once, as promised.
pub fn judge(expect: &OrderExpect, rewards: &RewardRule, seen: &OrderSeen) -> Vec<String> {
    let mut bad = Vec::new();
    // Answers: nothing unexpected; whatever is missing was lost in transit.
    let (missing, extra) = multiset_diff(&expect.answers, &seen.answers);
    if !extra.is_empty() {
        bad.push(format!("answered {} (expected {})", counted(&extra), counted(&multiset(&expect.answers))));
    }
    let missing_n: usize = missing.iter().map(|(_, n)| n).sum();
    if missing_n != seen.lost {
        bad.push(format!("{} answer(s) not seen ({}) but {} lost in transit", missing_n, counted(&missing), seen.lost));
    }
    let Some(status) = &seen.status else {
        bad.push("the order does not exist".into());
        return bad;
    };
    if *status != expect.status {
        bad.push(format!("status {status}, expected {}", expect.status));
    }
    // Payments: one row per pay_no, with the prescribed outcomes, decided.
    let mut rows_per_pay_no: BTreeMap<&str, usize> = BTreeMap::new();
    for p in &seen.payments {
        *rows_per_pay_no.entry(p.pay_no.as_str()).or_default() += 1;
        if p.state != "decided" {
            bad.push(format!("payment {} is in state {}, not decided", p.pay_no, p.state));
        }
    }
    for (pay_no, n) in rows_per_pay_no.iter().filter(|(_, n)| **n > 1) {
        bad.push(format!("pay_no {pay_no} has {n} payment rows"));
    }
    let outcomes: Vec<String> = seen.payments.iter().map(|p| p.outcome.clone()).collect();
    let (missing, extra) = multiset_diff(&expect.payments, &outcomes);
    if !missing.is_empty() || !extra.is_empty() {
        bad.push(format!(
            "payment rows {}, expected {}",
            counted(&multiset(&outcomes)),
            counted(&multiset(&expect.payments))
        ));
    }
    if expect.paid {
        let applied: Vec<&SeenPayment> = seen.payments.iter().filter(|p| p.outcome == "applied").collect();
        if let [one] = applied.as_slice() {
            if seen.pay_no.as_deref() != Some(one.pay_no.as_str()) {
                bad.push(format!("order pay_no {:?} is not the applied payment {}", seen.pay_no, one.pay_no));
            }
        }
    }
    judge_coupons(expect, rewards, seen, &mut bad);
    judge_points(expect, rewards, seen, &mut bad);
    exact_counts("event", &expect.events, &seen.events, &mut bad);
    exact_counts("inspection finding", &expect.findings, &seen.findings, &mut bad);
    if let Some(want) = expect.orders_of_user {
        if seen.orders_of_user != Some(want) {
            bad.push(format!("the user has {:?} orders, expected {want}", seen.orders_of_user));
        }
    }
    bad
}

fn judge_coupons(expect: &OrderExpect, rewards: &RewardRule, seen: &OrderSeen, bad: &mut Vec<String>) {
    let mut per_template: BTreeMap<&str, usize> = BTreeMap::new();
    for (template, _) in &seen.coupons {
        *per_template.entry(template.as_str()).or_default() += 1;
    }
    for (template, n) in per_template.iter().filter(|(_, n)| **n > 1) {
        bad.push(format!("{n} coupons of template {template} (at most 1 per order)"));
    }
    match rewards {
        RewardRule::Known(rules) if expect.paid => {
            let want: Vec<&str> = rules.coupon_templates.iter().map(String::as_str).collect();
            let have: Vec<&str> = per_template.keys().copied().collect();
            let mut want_sorted = want.clone();
            want_sorted.sort_unstable();
            if have != want_sorted {
                bad.push(format!("coupon templates {have:?}, expected {want_sorted:?}"));
            }
        }
        _ if !expect.paid && !seen.coupons.is_empty() => {
            bad.push(format!("{} coupon(s) on an order that earned none", seen.coupons.len()));
        }
        _ => {}
    }
    let want_status = if expect.refunded { "FROZEN" } else { "ACTIVE" };
    for (template, status) in seen.coupons.iter().filter(|(_, s)| s != want_status) {
        bad.push(format!("coupon {template} is {status}, expected {want_status}"));
    }
}

fn judge_points(expect: &OrderExpect, rewards: &RewardRule, seen: &OrderSeen, bad: &mut Vec<String>) {
    let paid: Vec<i64> = seen.points.iter().filter(|(t, _)| t == "ORDER_PAID").map(|(_, p)| *p).collect();
    let reversed: Vec<i64> = seen.points.iter().filter(|(t, _)| t == "ORDER_PAID_REVERSAL").map(|(_, p)| *p).collect();
    for (point_type, _) in seen.points.iter().filter(|(t, _)| t != "ORDER_PAID" && t != "ORDER_PAID_REVERSAL") {
        bad.push(format!("unexpected points entry of type {point_type}"));
    }
    if paid.len() > 1 {
        bad.push(format!("{} ORDER_PAID points entries (at most 1 per order)", paid.len()));
    }
    if reversed.len() > 1 {
        bad.push(format!("{} ORDER_PAID_REVERSAL points entries (at most 1 per order)", reversed.len()));
    }
    match rewards {
        RewardRule::Known(rules) => {
            let due = if expect.paid { rules.points_for(seen.amount) } else { 0 };
            let want: Vec<i64> = if due > 0 { vec![due] } else { vec![] };
            if paid != want {
                bad.push(format!("ORDER_PAID points {paid:?}, expected {want:?}"));
            }
        }
        RewardRule::Unknown if !expect.paid && !paid.is_empty() => {
            bad.push("points on an order that earned none".into());
        }
        RewardRule::Unknown => {}
    }
    if expect.refunded {
        let net: i64 = paid.iter().chain(&reversed).sum();
        if reversed.len() != paid.len() || net != 0 {
            bad.push(format!("points {paid:?} reversed by {reversed:?}: expected one reversal to 0"));
        }
    } else if !reversed.is_empty() {
        bad.push(format!("points reversed by {reversed:?} without a refund"));
    }
}

fn exact_counts(what: &str, want: &[(String, usize)], have: &BTreeMap<String, usize>, bad: &mut Vec<String>) {
    let want: BTreeMap<&str, usize> = want.iter().map(|(k, n)| (k.as_str(), *n)).collect();
    let mut keys: Vec<&str> = want.keys().copied().chain(have.keys().map(String::as_str)).collect();
    keys.sort_unstable();
    keys.dedup();
    for key in keys {
        let (w, h) = (want.get(key).copied().unwrap_or(0), have.get(key).copied().unwrap_or(0));
        if w != h {
            bad.push(format!("{h} {what}(s) {key}, expected {w}"));
        }
    }
}

fn multiset(items: &[String]) -> Vec<(String, usize)> {
    let mut counts: Vec<(String, usize)> = Vec::new();
    for item in items {
        match counts.iter_mut().find(|(k, _)| k == item) {
            Some((_, n)) => *n += 1,
            None => counts.push((item.clone(), 1)),
        }
    }
    counts
}

/// (in `want` but not in `have`, in `have` but not in `want`), with counts.
/// Labels with their counts, in order of first appearance.
type Counts = Vec<(String, usize)>;

fn multiset_diff(want: &[String], have: &[String]) -> (Counts, Counts) {
    let (want, have) = (multiset(want), multiset(have));
    let count = |set: &[(String, usize)], key: &str| set.iter().find(|(k, _)| k == key).map_or(0, |(_, n)| *n);
    let missing = want
        .iter()
        .filter_map(|(k, n)| n.checked_sub(count(&have, k)).filter(|d| *d > 0).map(|d| (k.clone(), d)))
        .collect();
    let extra = have
        .iter()
        .filter_map(|(k, n)| n.checked_sub(count(&want, k)).filter(|d| *d > 0).map(|d| (k.clone(), d)))
        .collect();
    (missing, extra)
}

fn counted(items: &[(String, usize)]) -> String {
    if items.is_empty() {
        return "nothing".into();
    }
    items.iter().map(|(k, n)| format!("{n} {k}")).collect::<Vec<_>>().join(", ")
}

// ---------------------------------------------------------------- HTTP client

/// Where payonce is: a socket address, the Host header and an optional path prefix.
struct Target {
    addr: SocketAddr,
    authority: String,
    prefix: String,
    token: Option<String>,
    url: String,
}

impl Target {
    fn parse(url: &str, token: Option<String>) -> Result<Target, String> {
        let lower = url.to_ascii_lowercase();
        if lower.starts_with("https://") {
            return Err(format!(
                "--target {url}: https is not supported; point the simulator at payonce's plain-HTTP address"
            ));
        }
        let rest = if lower.starts_with("http://") { &url[7..] } else { url };
        let (authority, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        if authority.is_empty() {
            return Err(format!("--target {url:?}: expected http://HOST:PORT"));
        }
        let with_port = if authority.rsplit_once(':').is_some_and(|(_, p)| p.bytes().all(|b| b.is_ascii_digit()))
            && !authority.ends_with(']')
        {
            authority.to_owned()
        } else {
            format!("{authority}:80")
        };
        let addr = with_port
            .to_socket_addrs()
            .map_err(|e| format!("--target {url}: cannot resolve {authority}: {e}"))?
            .next()
            .ok_or_else(|| format!("--target {url}: {authority} has no address"))?;
        Ok(Target { addr, authority: authority.to_owned(), prefix: prefix.to_owned(), token, url: url.to_owned() })
    }

    fn local(addr: SocketAddr) -> Target {
        Target { addr, authority: addr.to_string(), prefix: String::new(), token: None, url: format!("http://{addr}") }
    }
}

/// One HTTP request to send.
#[derive(Clone, Debug)]
struct Req {
    method: &'static str,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Req {
    fn get(path: String) -> Req {
        Req { method: "GET", path, headers: Vec::new(), body: Vec::new() }
    }

    fn post_json(path: String, body: &Value) -> Req {
        Req {
            method: "POST",
            path,
            headers: vec![("Content-Type".into(), "application/json".into())],
            body: body.to_string().into_bytes(),
        }
    }

    fn signed(signed: Signed) -> Req {
        Req { method: "POST", path: signed.path, headers: signed.headers, body: signed.body }
    }

    fn encode(&self, target: &Target) -> Vec<u8> {
        let mut head =
            format!("{} {}{} HTTP/1.1\r\nHost: {}\r\n", self.method, target.prefix, self.path, target.authority);
        for (name, value) in &self.headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        if let Some(token) = target.token.as_deref().filter(|_| !self.path.starts_with("/v1/callbacks/")) {
            head.push_str(&format!("Authorization: Bearer {token}\r\n"));
        }
        head.push_str(&format!("Content-Length: {}\r\n\r\n", self.body.len()));
        let mut bytes = head.into_bytes();
        bytes.extend_from_slice(&self.body);
        bytes
    }
}

/// An HTTP response.
#[derive(Clone, Debug, Default)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    close: bool,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn error_code(&self) -> String {
        self.json()["error"]["code"].as_str().unwrap_or("-").to_owned()
    }

    /// `HTTP 409 invalid_transition`, for answers no scenario expects.
    fn summary(&self) -> String {
        format!("HTTP {} {}", self.status, self.error_code())
    }
}

enum RecvError {
    /// Nothing arrived: the connection was closed or failed before the first byte.
    Nothing(String),
    Timeout,
    Failed(String),
}

impl RecvError {
    fn describe(&self) -> String {
        match self {
            RecvError::Nothing(e) => format!("no answer ({e})"),
            RecvError::Timeout => "no answer within the timeout".into(),
            RecvError::Failed(e) => format!("a broken answer ({e})"),
        }
    }
}

/// A keep-alive HTTP/1.1 connection over `std::net::TcpStream`, reopened
/// when needed. `writes` counts requests written (deliveries).
struct Conn {
    target: Arc<Target>,
    stream: Option<BufReader<TcpStream>>,
    answered_on_stream: usize,
    writes: usize,
}

impl Conn {
    fn new(target: &Arc<Target>) -> Conn {
        Conn { target: Arc::clone(target), stream: None, answered_on_stream: 0, writes: 0 }
    }

    /// Opens a connection and proves it is served (`GET /healthz`) before
    /// the next one opens. tiny_http 0.12 hands each connection to a pool
    /// thread for its whole life and counts threads it already woke as idle:
    /// when several connections open at once, one of them can sit unread
    /// until another connection closes (with keep-alive clients: forever).
    /// Opening one at a time keeps the simulator's own bursts out of that
    /// trap; the deliveries themselves stay as concurrent as the scenario says.
    fn open(target: &Target, read_timeout: Option<Duration>) -> Result<BufReader<TcpStream>, String> {
        static OPENING: Mutex<()> = parking_lot::const_mutex(());
        let _one_at_a_time = OPENING.lock();
        let stream = TcpStream::connect_timeout(&target.addr, CONNECT_TIMEOUT)
            .map_err(|e| format!("cannot connect to {}: {e}", target.url))?;
        let setup = stream
            .set_read_timeout(Some(IO_TIMEOUT))
            .and_then(|()| stream.set_write_timeout(Some(IO_TIMEOUT)))
            .and_then(|()| stream.set_nodelay(true));
        setup.map_err(|e| format!("cannot set up a connection to {}: {e}", target.url))?;
        let mut reader = BufReader::new(stream);
        let probe = Req::get(s("/healthz")).encode(target);
        reader.get_mut().write_all(&probe).map_err(|e| format!("cannot send to {}: {e}", target.url))?;
        let reply = read_reply(&mut reader)
            .map_err(|e| format!("GET /healthz on a new connection: {} from {}", e.describe(), target.url))?;
        if reply.close {
            return Err(format!("{} closed a keep-alive connection after GET /healthz", target.url));
        }
        if let Some(timeout) = read_timeout {
            reader
                .get_ref()
                .set_read_timeout(Some(timeout))
                .map_err(|e| format!("cannot set up a connection to {}: {e}", target.url))?;
        }
        Ok(reader)
    }

    /// Connects ahead of time, so concurrent deliveries start together.
    fn warm(&mut self) {
        if self.stream.is_none() {
            self.stream = Conn::open(&self.target, None).ok();
            self.answered_on_stream = 0;
        }
    }

    fn send(&mut self, req: &Req) -> Result<(), String> {
        if self.stream.is_none() {
            self.stream = Some(Conn::open(&self.target, None)?);
            self.answered_on_stream = 0;
        }
        let Some(stream) = self.stream.as_mut() else {
            return Err("no connection".into());
        };
        match stream.get_mut().write_all(&req.encode(&self.target)) {
            Ok(()) => {
                self.writes += 1;
                Ok(())
            }
            Err(e) => {
                self.stream = None;
                Err(format!("cannot send {} {}: {e}", req.method, req.path))
            }
        }
    }

    fn receive(&mut self) -> Result<Reply, RecvError> {
        let Some(stream) = self.stream.as_mut() else {
            return Err(RecvError::Nothing("not connected".into()));
        };
        match read_reply(stream) {
            Ok(reply) => {
                if reply.close {
                    self.stream = None;
                } else {
                    self.answered_on_stream += 1;
                }
                Ok(reply)
            }
            Err(e) => {
                self.stream = None;
                Err(e)
            }
        }
    }

    /// Sends and reads the answer. A keep-alive connection the server closed
    /// while idle is reopened once (the request is then sent again: a real
    /// delivery, counted in `writes`).
    fn request(&mut self, req: &Req) -> Result<Reply, String> {
        for attempt in 0..2 {
            let reused = self.stream.is_some() && self.answered_on_stream > 0;
            let result = match self.send(req) {
                Ok(()) => self.receive(),
                Err(e) if reused => Err(RecvError::Nothing(e)),
                Err(e) => return Err(e),
            };
            match result {
                Ok(reply) => return Ok(reply),
                Err(RecvError::Nothing(_)) if reused && attempt == 0 => {}
                Err(e) => {
                    return Err(format!("{} {}: {} from {}", req.method, req.path, e.describe(), self.target.url))
                }
            }
        }
        Err(format!("{} {}: no answer from {}", req.method, req.path, self.target.url))
    }
}

fn read_line(reader: &mut BufReader<TcpStream>, line: &mut String) -> std::io::Result<usize> {
    line.clear();
    reader.by_ref().take(HEADER_LINE_BYTES_MAX).read_line(line)
}

fn recv_error(e: std::io::Error, nothing_yet: bool) -> RecvError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => RecvError::Timeout,
        _ if nothing_yet => RecvError::Nothing(e.to_string()),
        _ => RecvError::Failed(e.to_string()),
    }
}

/// Reads one response: Content-Length or chunked bodies, or up to close.
fn read_reply(reader: &mut BufReader<TcpStream>) -> Result<Reply, RecvError> {
    let mut line = String::new();
    match read_line(reader, &mut line) {
        Ok(0) => return Err(RecvError::Nothing("connection closed".into())),
        Ok(_) => {}
        Err(e) => return Err(recv_error(e, true)),
    }
    let mut parts = line.split_whitespace();
    let version = parts.next().unwrap_or("").to_owned();
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .filter(|_| version.starts_with("HTTP/1."))
        .ok_or_else(|| RecvError::Failed(format!("not an HTTP status line: {:?}", line.trim_end())))?;
    let mut headers = Vec::new();
    loop {
        match read_line(reader, &mut line) {
            Ok(0) => return Err(RecvError::Failed("connection closed inside the headers".into())),
            Ok(_) => {}
            Err(e) => return Err(recv_error(e, false)),
        }
        let trimmed = line.trim_end_matches(['\r', '\n']);
        if trimmed.is_empty() {
            break;
        }
        if headers.len() > 200 {
            return Err(RecvError::Failed("too many headers".into()));
        }
        if let Some((name, value)) = trimmed.split_once(':') {
            headers.push((name.trim().to_owned(), value.trim().to_owned()));
        }
    }
    let mut reply = Reply { status, headers, body: Vec::new(), close: false };
    let connection = reply.header("Connection").unwrap_or("").to_ascii_lowercase();
    reply.close = connection.contains("close") || (version == "HTTP/1.0" && !connection.contains("keep-alive"));
    let chunked = reply.header("Transfer-Encoding").is_some_and(|t| t.to_ascii_lowercase().contains("chunked"));
    let length = reply.header("Content-Length").map(|v| v.parse::<usize>());
    if chunked {
        reply.body = read_chunked(reader)?;
    } else if let Some(length) = length {
        let length = length.map_err(|_| RecvError::Failed("a malformed Content-Length".into()))?;
        if length > RESPONSE_BYTES_MAX {
            return Err(RecvError::Failed(format!("a {length}-byte answer")));
        }
        reply.body = vec![0; length];
        reader.read_exact(&mut reply.body).map_err(|e| recv_error(e, false))?;
    } else if !(status == 204 || status == 304 || (100..200).contains(&status)) {
        reader
            .by_ref()
            .take(RESPONSE_BYTES_MAX as u64)
            .read_to_end(&mut reply.body)
            .map_err(|e| recv_error(e, false))?;
        reply.close = true;
    }
    Ok(reply)
}

fn read_chunked(reader: &mut BufReader<TcpStream>) -> Result<Vec<u8>, RecvError> {
    let mut body = Vec::new();
    let mut line = String::new();
    loop {
        read_line(reader, &mut line).map_err(|e| recv_error(e, false))?;
        let size_text = line.trim().split(';').next().unwrap_or("");
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| RecvError::Failed(format!("a malformed chunk size {size_text:?}")))?;
        if size == 0 {
            // Trailers, up to the empty line.
            while read_line(reader, &mut line).map_err(|e| recv_error(e, false))? > 0 && !line.trim().is_empty() {}
            return Ok(body);
        }
        if body.len() + size > RESPONSE_BYTES_MAX {
            return Err(RecvError::Failed("an oversized chunked answer".into()));
        }
        let start = body.len();
        body.resize(start + size, 0);
        reader.read_exact(&mut body[start..]).map_err(|e| recv_error(e, false))?;
        read_line(reader, &mut line).map_err(|e| recv_error(e, false))?;
    }
}

// ---------------------------------------------------------------- threads

/// A start signal: workers begin only once all of them exist, so a failed
/// spawn never leaves the others waiting at a barrier.
struct Gate {
    go: Mutex<Option<bool>>,
    cond: Condvar,
}

impl Gate {
    fn new() -> Gate {
        Gate { go: Mutex::new(None), cond: Condvar::new() }
    }

    fn open(&self, go: bool) {
        *self.go.lock() = Some(go);
        self.cond.notify_all();
    }

    fn wait(&self) -> bool {
        let mut go = self.go.lock();
        loop {
            if let Some(go) = *go {
                return go;
            }
            self.cond.wait(&mut go);
        }
    }
}

/// Runs `work(worker)` on `count` scoped threads that start together.
fn scoped_workers(count: usize, work: impl Fn(usize) + Sync) -> Result<(), String> {
    let gate = Gate::new();
    let mut spawn_error = None;
    thread::scope(|scope| {
        for w in 0..count {
            let (gate, work) = (&gate, &work);
            let spawned = thread::Builder::new().name(format!("payonce-simulate-{w}")).spawn_scoped(scope, move || {
                if gate.wait() {
                    work(w);
                }
            });
            if let Err(e) = spawned {
                spawn_error = Some(format!("cannot start a simulator thread: {e}"));
                break;
            }
        }
        gate.open(spawn_error.is_none());
    });
    spawn_error.map_or(Ok(()), Err)
}

/// The first error of several threads, and a flag that tells the others to stop.
struct Failure {
    failed: AtomicBool,
    first: Mutex<Option<String>>,
}

impl Failure {
    fn new() -> Failure {
        Failure { failed: AtomicBool::new(false), first: Mutex::new(None) }
    }

    fn set(&self, error: String) {
        self.failed.store(true, Ordering::SeqCst);
        self.first.lock().get_or_insert(error);
    }

    fn is_set(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    fn into_result(self) -> Result<(), String> {
        self.first.into_inner().map_or(Ok(()), Err)
    }
}

/// A one-line progress bar on stderr, redrawn at most every 1%.
struct Progress {
    enabled: bool,
    state: Mutex<ProgressState>,
}

struct ProgressState {
    label: &'static str,
    done: usize,
    total: usize,
    last_percent: Option<usize>,
    drawn: bool,
}

impl Progress {
    const WIDTH: usize = 40;

    fn new(enabled: bool) -> Progress {
        Progress {
            enabled,
            state: Mutex::new(ProgressState { label: "", done: 0, total: 0, last_percent: None, drawn: false }),
        }
    }

    fn start(&self, label: &'static str, total: usize) {
        *self.state.lock() = ProgressState { label, done: 0, total, last_percent: None, drawn: false };
        self.tick_by(0);
    }

    fn tick(&self) {
        self.tick_by(1);
    }

    fn tick_by(&self, n: usize) {
        if !self.enabled {
            return;
        }
        let mut s = self.state.lock();
        s.done += n;
        let percent = (s.done.min(s.total) * 100).checked_div(s.total).unwrap_or(100);
        if s.last_percent == Some(percent) {
            return;
        }
        s.last_percent = Some(percent);
        let filled = percent * Self::WIDTH / 100;
        eprint!(
            "\r{:<20} [{}{}] {percent:>3}% {}/{} deliveries",
            s.label,
            "#".repeat(filled),
            "-".repeat(Self::WIDTH - filled),
            s.done.min(s.total),
            s.total
        );
        s.drawn = true;
    }

    fn finish(&self) {
        let mut s = self.state.lock();
        if s.drawn {
            eprintln!();
            s.drawn = false;
        }
    }
}

// ---------------------------------------------------------------- the simulator

#[derive(Clone, Debug)]
struct SimOrder {
    no: String,
    user: String,
    amount: i64,
}

/// What one delivery (with its 503 retries) came to.
struct Delivery {
    label: String,
    sends: usize,
}

/// What a scenario did to one order, and what it expects of it.
struct OrderRun {
    order: SimOrder,
    expect: OrderExpect,
    answers: Vec<String>,
    lost: usize,
    deliveries: usize,
}

struct ScenarioRun {
    scenario: Scenario,
    orders: Vec<OrderRun>,
}

struct Sim {
    target: Arc<Target>,
    keys: Keys,
    channel: Channel,
    run_id: String,
    orders: usize,
    concurrency: usize,
    time_factor: f64,
    replay_timeout_ms: u64,
    progress: Progress,
}

fn now_s() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

fn s(text: &str) -> String {
    text.to_owned()
}

/// The label of an order-API answer: `api:create 201 PENDING`, `api:close 409 invalid_transition`.
fn api_label(what: &str, reply: &Reply) -> String {
    let body = reply.json();
    let detail = match body["status"].as_str() {
        Some(status) if (200..300).contains(&reply.status) => status.to_owned(),
        _ => reply.error_code(),
    };
    format!("api:{what} {} {detail}", reply.status)
}

impl Sim {
    fn order(&self, scenario: Scenario, i: usize) -> SimOrder {
        let no = format!("{}-{}-{i}", self.run_id, scenario.tag());
        // Not round, and at least 10 yuan, so points are never 0.
        let amount = 1_000 + i64::try_from(i % 90).unwrap_or(0) * 100 + i64::try_from(i % 7).unwrap_or(0);
        SimOrder { user: format!("{no}-u"), no, amount }
    }

    fn payment(&self, order: &SimOrder, k: usize) -> PaymentNotice {
        PaymentNotice {
            pay_no: format!("{}-P{k}", order.no),
            order_no: order.no.clone(),
            amount: order.amount,
            success: true,
        }
    }

    /// Sends `build()` (rebuilt each time, so signatures stay fresh) and
    /// retries a 503 after its Retry-After, as a platform would.
    fn send_retrying(&self, conn: &mut Conn, build: &dyn Fn() -> Req) -> Result<(Reply, usize), String> {
        let before = conn.writes;
        let mut tries = 0;
        loop {
            let reply = conn.request(&build())?;
            if reply.status == 503 && tries < BUSY_RETRIES {
                tries += 1;
                let wait_s = reply.header("Retry-After").and_then(|v| v.parse::<u64>().ok()).unwrap_or(1).clamp(1, 5);
                thread::sleep(Duration::from_secs(wait_s));
                continue;
            }
            return Ok((reply, conn.writes - before));
        }
    }

    fn deliver_payment(&self, conn: &mut Conn, notice: &PaymentNotice) -> Result<Delivery, String> {
        let (reply, sends) =
            self.send_retrying(conn, &|| Req::signed(self.channel.sign_payment(&self.keys, notice, now_s())))?;
        Ok(Delivery { label: self.channel.answer(&reply)?, sends })
    }

    fn deliver_refund(&self, conn: &mut Conn, notice: &RefundNotice) -> Result<Delivery, String> {
        let (reply, sends) =
            self.send_retrying(conn, &|| Req::signed(self.channel.sign_refund(&self.keys, notice, now_s())))?;
        Ok(Delivery { label: format!("refund {}", self.channel.answer(&reply)?), sends })
    }

    /// An order-API call; 401 is a setup error (the token), not a verdict.
    fn api(&self, conn: &mut Conn, req: Req) -> Result<Reply, String> {
        let (method, path) = (req.method, req.path.clone());
        let (reply, _) = self.send_retrying(conn, &|| req.clone())?;
        if reply.status == 401 {
            return Err(format!(
                "{method} {path}: 401 {}: the target needs an API token (PAYONCE_API_TOKEN or --api-token)",
                reply.error_code()
            ));
        }
        Ok(reply)
    }

    fn create(&self, conn: &mut Conn, order: &SimOrder) -> Result<Reply, String> {
        let body = json!({"order_no": order.no, "user_id": order.user, "amount": order.amount, "expires_in_s": 3600});
        self.api(conn, Req::post_json(s("/v1/orders"), &body))
    }

    /// `work(conn, i)` for every order, on up to `WORKERS` keep-alive connections.
    fn par_orders<T: Send>(
        &self,
        n: usize,
        work: impl Fn(&mut Conn, usize) -> Result<T, String> + Sync,
    ) -> Result<Vec<T>, String> {
        let next = Mutex::new(0usize);
        let results: Mutex<Vec<Option<T>>> = Mutex::new((0..n).map(|_| None).collect());
        let failure = Failure::new();
        scoped_workers(n.clamp(1, WORKERS), |_| {
            let mut conn = Conn::new(&self.target);
            loop {
                let i = {
                    let mut next = next.lock();
                    *next += 1;
                    *next - 1
                };
                if i >= n || failure.is_set() {
                    return;
                }
                match work(&mut conn, i) {
                    Ok(value) => results.lock()[i] = Some(value),
                    Err(e) => failure.set(e),
                }
            }
        })?;
        failure.into_result()?;
        results.into_inner().into_iter().map(|r| r.ok_or_else(|| s("a worker stopped early"))).collect()
    }

    /// For each order in turn, `work(conn, i, t)` on `k` threads released at
    /// the same moment (each thread its own keep-alive connection).
    fn rounds<T: Send>(
        &self,
        n: usize,
        k: usize,
        work: impl Fn(&mut Conn, usize, usize) -> Result<T, String> + Sync,
    ) -> Result<Vec<Vec<T>>, String> {
        let barrier = Barrier::new(k);
        let results: Mutex<Vec<Vec<Option<T>>>> = Mutex::new((0..n).map(|_| (0..k).map(|_| None).collect()).collect());
        let failure = Failure::new();
        scoped_workers(k, |t| {
            let mut conn = Conn::new(&self.target);
            conn.warm();
            for i in 0..n {
                barrier.wait();
                if failure.is_set() {
                    continue;
                }
                match work(&mut conn, i, t) {
                    Ok(value) => results.lock()[i][t] = Some(value),
                    Err(e) => failure.set(e),
                }
            }
        })?;
        failure.into_result()?;
        results
            .into_inner()
            .into_iter()
            .map(|row| row.into_iter().map(|r| r.ok_or_else(|| s("a worker stopped early"))).collect())
            .collect()
    }

    /// Creates every order of a scenario (201 expected, checked by the judge).
    fn create_all(&self, orders: &[SimOrder]) -> Result<Vec<String>, String> {
        self.par_orders(orders.len(), |conn, i| Ok(api_label("create", &self.create(conn, &orders[i])?)))
    }

    fn run_scenario(&self, scenario: Scenario) -> Result<ScenarioRun, String> {
        let orders: Vec<SimOrder> = (0..self.orders).map(|i| self.order(scenario, i)).collect();
        let runs = match scenario {
            Scenario::Concurrent => self.concurrent(orders)?,
            Scenario::Redelivery40ms => self.redelivery(orders)?,
            Scenario::GatewayReplay => self.gateway_replay(orders)?,
            Scenario::RetrySchedule => self.retry_schedule(orders)?,
            Scenario::TwoChannels => self.two_channels(orders)?,
            Scenario::PaymentAfterClose => self.payment_after_close(orders)?,
            Scenario::Refund => self.refund(orders)?,
            Scenario::TripleClick => self.triple_click(orders)?,
        };
        self.progress.finish();
        Ok(ScenarioRun { scenario, orders: runs })
    }

    fn paid_expect(answers: Vec<String>) -> OrderExpect {
        OrderExpect {
            status: s("PAID"),
            answers,
            payments: vec![s("applied")],
            paid: true,
            events: vec![(s("order.paid"), 1)],
            ..OrderExpect::default()
        }
    }

    fn created() -> String {
        s("api:create 201 PENDING")
    }

    fn concurrent(&self, orders: Vec<SimOrder>) -> Result<Vec<OrderRun>, String> {
        let k = self.concurrency;
        let created = self.create_all(&orders)?;
        self.progress.start("concurrent", orders.len() * k);
        let rounds = self.rounds(orders.len(), k, |conn, i, _| {
            let delivery = self.deliver_payment(conn, &self.payment(&orders[i], 1));
            self.progress.tick();
            delivery
        })?;
        let mut expected = vec![Sim::created(), s("applied")];
        expected.extend((1..k).map(|_| s("duplicate")));
        Ok(orders
            .into_iter()
            .zip(created)
            .zip(rounds)
            .map(|((order, created), deliveries)| OrderRun {
                order,
                expect: Sim::paid_expect(expected.clone()),
                deliveries: deliveries.iter().map(|d| d.sends).sum(),
                answers: std::iter::once(created).chain(deliveries.into_iter().map(|d| d.label)).collect(),
                lost: 0,
            })
            .collect())
    }

    /// A second answer read after a 503 is retried on the same connection.
    fn settle(&self, conn: &mut Conn, reply: Reply, notice: &PaymentNotice) -> Result<Delivery, String> {
        if reply.status == 503 {
            let retry = self.deliver_payment(conn, notice)?;
            return Ok(Delivery { label: retry.label, sends: retry.sends + 1 });
        }
        Ok(Delivery { label: self.channel.answer(&reply)?, sends: 1 })
    }

    fn redelivery(&self, orders: Vec<SimOrder>) -> Result<Vec<OrderRun>, String> {
        let created = self.create_all(&orders)?;
        self.progress.start("redelivery_40ms", orders.len() * 2);
        let runs = self.par_orders(orders.len(), |_, i| {
            let notice = self.payment(&orders[i], 1);
            let (mut first, mut second) = (Conn::new(&self.target), Conn::new(&self.target));
            first.send(&Req::signed(self.channel.sign_payment(&self.keys, &notice, now_s())))?;
            let sent_at = Instant::now();
            thread::sleep(REDELIVERY_GAP.saturating_sub(sent_at.elapsed()));
            second.send(&Req::signed(self.channel.sign_payment(&self.keys, &notice, now_s())))?;
            let mut answers = Vec::new();
            let mut deliveries = 0;
            for conn in [&mut first, &mut second] {
                let reply = conn
                    .receive()
                    .map_err(|e| format!("redelivery_40ms: {} from {}", e.describe(), self.target.url))?;
                let delivery = self.settle(conn, reply, &notice)?;
                answers.push(delivery.label);
                deliveries += delivery.sends;
                self.progress.tick();
            }
            Ok((answers, deliveries))
        })?;
        let expect = Sim::paid_expect(vec![Sim::created(), s("applied"), s("duplicate")]);
        Ok(orders
            .into_iter()
            .zip(created)
            .zip(runs)
            .map(|((order, created), (answers, deliveries))| OrderRun {
                order,
                expect: expect.clone(),
                answers: std::iter::once(created).chain(answers).collect(),
                lost: 0,
                deliveries,
            })
            .collect())
    }

    /// The first attempt of a gateway replay: a fresh connection, the
    /// request, a read timeout of `--replay-timeout-ms` (0: no wait at all),
    /// then the connection is dropped, as a gateway that timed out drops it.
    /// `Some(label)` when the answer arrived in time anyway.
    fn deliver_abandoned(&self, notice: &PaymentNotice) -> Result<Option<String>, String> {
        let timeout = Duration::from_millis(self.replay_timeout_ms.max(1));
        let mut reader = Conn::open(&self.target, Some(timeout))?;
        let req = Req::signed(self.channel.sign_payment(&self.keys, notice, now_s()));
        reader
            .get_mut()
            .write_all(&req.encode(&self.target))
            .map_err(|e| format!("gateway_replay: cannot send to {}: {e}", self.target.url))?;
        if self.replay_timeout_ms == 0 {
            return Ok(None);
        }
        match read_reply(&mut reader) {
            Ok(reply) => Ok(Some(self.channel.answer(&reply)?)),
            Err(_) => Ok(None),
        }
    }

    fn gateway_replay(&self, orders: Vec<SimOrder>) -> Result<Vec<OrderRun>, String> {
        let created = self.create_all(&orders)?;
        self.progress.start("gateway_replay", orders.len() * 2);
        let runs = self.par_orders(orders.len(), |_, i| {
            let notice = self.payment(&orders[i], 1);
            let first = self.deliver_abandoned(&notice)?;
            self.progress.tick();
            // The platform saw no answer (or too late for its gateway): re-send on a new connection.
            let mut fresh = Conn::new(&self.target);
            let replay = self.deliver_payment(&mut fresh, &notice)?;
            self.progress.tick();
            Ok((first, replay))
        })?;
        let expect = Sim::paid_expect(vec![Sim::created(), s("applied"), s("duplicate")]);
        Ok(orders
            .into_iter()
            .zip(created)
            .zip(runs)
            .map(|((order, created), (first, replay))| OrderRun {
                order,
                expect: expect.clone(),
                lost: usize::from(first.is_none()),
                deliveries: 1 + replay.sends,
                answers: [Some(created), first, Some(replay.label)].into_iter().flatten().collect(),
            })
            .collect())
    }

    fn retry_schedule(&self, orders: Vec<SimOrder>) -> Result<Vec<OrderRun>, String> {
        let n = orders.len();
        let schedule = |i: usize| -> &'static [u64] {
            if i % 2 == 0 {
                &WECHATPAY_RETRY_S
            } else {
                &ALIPAY_RETRY_S
            }
        };
        let offsets: Vec<Vec<Duration>> = (0..n)
            .map(|i| {
                let mut at = 0u64;
                std::iter::once(Ok(Duration::ZERO))
                    .chain(schedule(i).iter().map(|interval| {
                        at += interval;
                        Duration::try_from_secs_f64(at as f64 / self.time_factor)
                            .map_err(|e| format!("--time-factor {}: {e}", self.time_factor))
                    }))
                    .collect::<Result<Vec<Duration>, String>>()
            })
            .collect::<Result<_, _>>()?;
        let created = self.create_all(&orders)?;
        self.progress.start("retry_schedule", offsets.iter().map(Vec::len).sum());
        let workers = n.clamp(1, WORKERS);
        let results: Mutex<Vec<Vec<Delivery>>> = Mutex::new((0..n).map(|_| Vec::new()).collect());
        let failure = Failure::new();
        let start = Instant::now();
        scoped_workers(workers, |w| {
            let mut conn = Conn::new(&self.target);
            let mut due: BinaryHeap<Reverse<(Duration, usize, usize)>> =
                (w..n).step_by(workers).map(|i| Reverse((Duration::ZERO, i, 0))).collect();
            while let Some(Reverse((at, i, attempt))) = due.pop() {
                // Sleep in slices so another worker's failure stops this one soon.
                while !failure.is_set() {
                    let left = (start + at).saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    thread::sleep(left.min(Duration::from_millis(100)));
                }
                if failure.is_set() {
                    return;
                }
                match self.deliver_payment(&mut conn, &self.payment(&orders[i], 1)) {
                    Ok(delivery) => results.lock()[i].push(delivery),
                    Err(e) => return failure.set(e),
                }
                self.progress.tick();
                if let Some(next) = offsets[i].get(attempt + 1) {
                    due.push(Reverse((*next, i, attempt + 1)));
                }
            }
        })?;
        failure.into_result()?;
        Ok(orders
            .into_iter()
            .zip(created)
            .zip(results.into_inner())
            .enumerate()
            .map(|(i, ((order, created), deliveries))| {
                let mut expected = vec![Sim::created(), s("applied")];
                expected.extend((1..offsets[i].len()).map(|_| s("duplicate")));
                OrderRun {
                    order,
                    expect: Sim::paid_expect(expected),
                    deliveries: deliveries.iter().map(|d| d.sends).sum(),
                    answers: std::iter::once(created).chain(deliveries.into_iter().map(|d| d.label)).collect(),
                    lost: 0,
                }
            })
            .collect())
    }

    fn two_channels(&self, orders: Vec<SimOrder>) -> Result<Vec<OrderRun>, String> {
        let created = self.create_all(&orders)?;
        self.progress.start("two_channels", orders.len() * 2);
        // Two independent payments of one order, at the same moment. With more
        // channels, the second would go through another channel.
        let rounds = self.rounds(orders.len(), 2, |conn, i, t| {
            let delivery = self.deliver_payment(conn, &self.payment(&orders[i], t + 1));
            self.progress.tick();
            delivery
        })?;
        let expect = OrderExpect {
            status: s("PAID"),
            answers: vec![Sim::created(), s("applied"), s("already_paid")],
            payments: vec![s("applied"), s("already_paid")],
            paid: true,
            events: vec![(s("order.paid"), 1), (s("payment.refund_required"), 1)],
            findings: vec![(s("refund_required"), 1)],
            ..OrderExpect::default()
        };
        Ok(orders
            .into_iter()
            .zip(created)
            .zip(rounds)
            .map(|((order, created), deliveries)| OrderRun {
                order,
                expect: expect.clone(),
                deliveries: deliveries.iter().map(|d| d.sends).sum(),
                answers: std::iter::once(created).chain(deliveries.into_iter().map(|d| d.label)).collect(),
                lost: 0,
            })
            .collect())
    }

    fn payment_after_close(&self, orders: Vec<SimOrder>) -> Result<Vec<OrderRun>, String> {
        let created = self.create_all(&orders)?;
        self.progress.start("payment_after_close", orders.len() * 2);
        let runs = self.par_orders(orders.len(), |conn, i| {
            let close = self.api(conn, Req::post_json(format!("/v1/orders/{}/close", orders[i].no), &json!({})))?;
            let mut answers = vec![api_label("close", &close)];
            let mut deliveries = 0;
            for _ in 0..2 {
                let delivery = self.deliver_payment(conn, &self.payment(&orders[i], 1))?;
                answers.push(delivery.label);
                deliveries += delivery.sends;
                self.progress.tick();
            }
            Ok((answers, deliveries))
        })?;
        let expect = OrderExpect {
            status: s("CLOSED"),
            answers: vec![Sim::created(), s("api:close 200 CLOSED"), s("paid_after_close"), s("duplicate")],
            payments: vec![s("paid_after_close")],
            events: vec![(s("order.closed"), 1), (s("payment.refund_required"), 1)],
            findings: vec![(s("refund_required"), 1)],
            ..OrderExpect::default()
        };
        Ok(orders
            .into_iter()
            .zip(created)
            .zip(runs)
            .map(|((order, created), (answers, deliveries))| OrderRun {
                order,
                expect: expect.clone(),
                answers: std::iter::once(created).chain(answers).collect(),
                lost: 0,
                deliveries,
            })
            .collect())
    }

    fn refund(&self, orders: Vec<SimOrder>) -> Result<Vec<OrderRun>, String> {
        let created = self.create_all(&orders)?;
        self.progress.start("refund", orders.len() * 3);
        let runs = self.par_orders(orders.len(), |conn, i| {
            let order = &orders[i];
            let paid = self.deliver_payment(conn, &self.payment(order, 1))?;
            self.progress.tick();
            let mut answers = vec![paid.label];
            let mut deliveries = paid.sends;
            let refund_no = format!("{}-R1", order.no);
            for _ in 0..2 {
                let path = format!("/v1/orders/{}/refund", order.no);
                let reply = self.api(conn, Req::post_json(path, &json!({"refund_no": refund_no})))?;
                answers.push(api_label("refund", &reply));
            }
            let notice = RefundNotice { refund_no, order_no: order.no.clone(), success: true };
            for _ in 0..2 {
                let delivery = self.deliver_refund(conn, &notice)?;
                answers.push(delivery.label);
                deliveries += delivery.sends;
                self.progress.tick();
            }
            Ok((answers, deliveries))
        })?;
        let expect = OrderExpect {
            status: s("REFUNDED"),
            answers: vec![
                Sim::created(),
                s("applied"),
                s("api:refund 200 REFUNDING"),
                s("api:refund 200 REFUNDING"),
                s("refund applied"),
                s("refund duplicate"),
            ],
            payments: vec![s("applied")],
            paid: true,
            refunded: true,
            events: vec![(s("order.paid"), 1), (s("order.refunding"), 1), (s("order.refunded"), 1)],
            ..OrderExpect::default()
        };
        Ok(orders
            .into_iter()
            .zip(created)
            .zip(runs)
            .map(|((order, created), (answers, deliveries))| OrderRun {
                order,
                expect: expect.clone(),
                answers: std::iter::once(created).chain(answers).collect(),
                lost: 0,
                deliveries,
            })
            .collect())
    }

    fn triple_click(&self, orders: Vec<SimOrder>) -> Result<Vec<OrderRun>, String> {
        self.progress.start("triple_click", orders.len() * 3);
        let rounds = self.rounds(orders.len(), 3, |conn, i, _| {
            let reply = self.create(conn, &orders[i])?;
            self.progress.tick();
            Ok(match (reply.status, reply.header("Idempotent-Replayed")) {
                (201, None) => s("created"),
                (200, Some("true")) => s("replayed"),
                _ => format!("create {}", reply.summary()),
            })
        })?;
        let expect = OrderExpect {
            status: s("PENDING"),
            answers: vec![s("created"), s("replayed"), s("replayed")],
            orders_of_user: Some(1),
            ..OrderExpect::default()
        };
        Ok(orders
            .into_iter()
            .zip(rounds)
            .map(|(order, answers)| OrderRun { order, expect: expect.clone(), answers, lost: 0, deliveries: 3 })
            .collect())
    }

    // ---- reading results back ----

    /// The highest event seq now, found by galloping and bisection over
    /// `GET /v1/events?after=X&limit=1` (no paging through old events).
    fn last_event_seq(&self, conn: &mut Conn) -> Result<u64, String> {
        let mut exists_after = |after: u64| -> Result<bool, String> {
            let reply = self.api(conn, Req::get(format!("/v1/events?after={after}&limit=1")))?;
            if reply.status != 200 {
                return Err(format!("GET /v1/events: {}", reply.summary()));
            }
            Ok(reply.json()["events"].as_array().is_some_and(|e| !e.is_empty()))
        };
        if !exists_after(0)? {
            return Ok(0);
        }
        let (mut lo, mut hi) = (0u64, 1u64);
        while exists_after(hi)? {
            lo = hi;
            hi = hi.checked_mul(2).ok_or("event seq overflow")?;
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if exists_after(mid)? {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Ok(hi)
    }

    /// Event counts by order_no and type, for this run's orders.
    fn events_since(
        &self,
        conn: &mut Conn,
        mut after: u64,
    ) -> Result<BTreeMap<String, BTreeMap<String, usize>>, String> {
        let mut by_order: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
        loop {
            let reply = self.api(conn, Req::get(format!("/v1/events?after={after}&limit=1000")))?;
            if reply.status != 200 {
                return Err(format!("GET /v1/events: {}", reply.summary()));
            }
            let page = reply.json();
            let events = page["events"].as_array().cloned().unwrap_or_default();
            if events.is_empty() {
                return Ok(by_order);
            }
            for event in &events {
                let (Some(order_no), Some(kind)) = (event["order_no"].as_str(), event["type"].as_str()) else {
                    continue;
                };
                if order_no.starts_with(&self.run_id) {
                    *by_order.entry(order_no.to_owned()).or_default().entry(kind.to_owned()).or_default() += 1;
                }
            }
            let next = page["next_after"].as_u64().ok_or("GET /v1/events: no next_after")?;
            if next <= after {
                return Err("GET /v1/events: next_after does not advance".into());
            }
            after = next;
        }
    }

    /// Inspection finding counts by order_no and kind, for this run's orders.
    fn findings(&self, conn: &mut Conn) -> Result<BTreeMap<String, BTreeMap<String, usize>>, String> {
        let reply = self.api(conn, Req::get(s("/v1/inspections")))?;
        if reply.status != 200 {
            return Err(format!("GET /v1/inspections: {}", reply.summary()));
        }
        let mut by_order: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
        for finding in reply.json()["findings"].as_array().into_iter().flatten() {
            let (Some(order_no), Some(kind)) = (finding["order_no"].as_str(), finding["kind"].as_str()) else {
                continue;
            };
            if order_no.starts_with(&self.run_id) {
                *by_order.entry(order_no.to_owned()).or_default().entry(kind.to_owned()).or_default() += 1;
            }
        }
        Ok(by_order)
    }

    fn observe(
        &self,
        run: &ScenarioRun,
        events: &BTreeMap<String, BTreeMap<String, usize>>,
        findings: &BTreeMap<String, BTreeMap<String, usize>>,
    ) -> Result<Vec<OrderSeen>, String> {
        self.par_orders(run.orders.len(), |conn, i| {
            let order_run = &run.orders[i];
            let order = &order_run.order;
            let mut seen = OrderSeen {
                order_no: order.no.clone(),
                amount: order.amount,
                events: events.get(&order.no).cloned().unwrap_or_default(),
                findings: findings.get(&order.no).cloned().unwrap_or_default(),
                answers: order_run.answers.clone(),
                lost: order_run.lost,
                ..OrderSeen::default()
            };
            let reply = self.api(conn, Req::get(format!("/v1/orders/{}", order.no)))?;
            match reply.status {
                200 => read_order_detail(&reply.json(), &mut seen),
                404 => {}
                _ => return Err(format!("GET /v1/orders/{}: {}", order.no, reply.summary())),
            }
            if order_run.expect.orders_of_user.is_some() {
                let reply = self.api(conn, Req::get(format!("/v1/orders?user_id={}&limit=1000", order.user)))?;
                if reply.status != 200 {
                    return Err(format!("GET /v1/orders?user_id={}: {}", order.user, reply.summary()));
                }
                seen.orders_of_user = reply.json()["orders"].as_array().map(Vec::len);
            }
            Ok(seen)
        })
    }
}

fn read_order_detail(detail: &Value, seen: &mut OrderSeen) {
    let text = |v: &Value, key: &str| v[key].as_str().unwrap_or("").to_owned();
    seen.status = Some(text(detail, "status"));
    seen.pay_no = detail["pay_no"].as_str().map(str::to_owned);
    let list = |key: &str| detail[key].as_array().cloned().unwrap_or_default();
    seen.payments = list("payments")
        .iter()
        .map(|p| SeenPayment { pay_no: text(p, "pay_no"), outcome: text(p, "outcome"), state: text(p, "state") })
        .collect();
    seen.coupons = list("coupons").iter().map(|c| (text(c, "coupon_template_id"), text(c, "status"))).collect();
    seen.points = list("points").iter().map(|p| (text(p, "point_type"), p["points"].as_i64().unwrap_or(0))).collect();
}

// ---------------------------------------------------------------- the table

/// One row of the table.
pub struct Row {
    pub scenario: String,
    pub deliveries: String,
    pub expected: String,
    pub observed: String,
    pub violations: Vec<String>,
}

fn push_item(items: &mut Vec<String>, n: usize, what: &str) {
    items.push(format!("{n} {what}"));
}

fn expected_effects(runs: &[OrderRun], rewards: &RewardRule) -> String {
    let expects: Vec<&OrderExpect> = runs.iter().map(|r| &r.expect).collect();
    let mut items = Vec::new();
    for (status, n) in multiset(&expects.iter().map(|e| e.status.clone()).collect::<Vec<_>>()) {
        push_item(&mut items, n, &status);
    }
    push_item(&mut items, expects.iter().map(|e| e.payments.len()).sum(), "payments");
    let paid = expects.iter().filter(|e| e.paid).count();
    let refunded = expects.iter().filter(|e| e.refunded).count();
    let coupon = if refunded > 0 { "frozen coupons" } else { "coupons" };
    match rewards {
        RewardRule::Known(rules) => {
            push_item(&mut items, paid * rules.coupon_templates.len(), coupon);
            let points = runs.iter().filter(|r| r.expect.paid && rules.points_for(r.order.amount) > 0).count();
            push_item(&mut items, points, "points");
            if refunded > 0 {
                push_item(&mut items, refunded, "reversals");
            }
        }
        RewardRule::Unknown if paid > 0 => {
            items.push(format!("<=1 {coupon}/template/order"));
            items.push(s("<=1 points/order"));
            if refunded > 0 {
                items.push(s("1 reversal per points"));
            }
        }
        RewardRule::Unknown => {
            push_item(&mut items, 0, "coupons");
            push_item(&mut items, 0, "points");
        }
    }
    let mut events: BTreeMap<&str, usize> = BTreeMap::new();
    let mut findings: BTreeMap<&str, usize> = BTreeMap::new();
    for e in &expects {
        for (kind, n) in &e.events {
            *events.entry(kind).or_default() += n;
        }
        for (kind, n) in &e.findings {
            *findings.entry(kind).or_default() += n;
        }
    }
    for (kind, n) in events {
        push_item(&mut items, n, kind);
    }
    for (kind, n) in findings {
        push_item(&mut items, n, &format!("{kind} findings"));
    }
    let users: Vec<usize> = expects.iter().filter_map(|e| e.orders_of_user).collect();
    if !users.is_empty() {
        push_item(&mut items, users.iter().sum(), "orders (1 per user)");
    }
    items.join(", ")
}

fn observed_effects(seen: &[OrderSeen]) -> String {
    let mut items = Vec::new();
    let statuses: Vec<String> = seen.iter().map(|o| o.status.clone().unwrap_or_else(|| s("missing"))).collect();
    for (status, n) in multiset(&statuses) {
        push_item(&mut items, n, &status);
    }
    push_item(&mut items, seen.iter().map(|o| o.payments.len()).sum(), "payments");
    let coupon_statuses: Vec<String> = seen.iter().flat_map(|o| o.coupons.iter().map(|(_, st)| st.clone())).collect();
    if coupon_statuses.is_empty() {
        push_item(&mut items, 0, "coupons");
    }
    for (status, n) in multiset(&coupon_statuses) {
        let what = match status.as_str() {
            "ACTIVE" => s("coupons"),
            other => format!("{} coupons", other.to_ascii_lowercase()),
        };
        push_item(&mut items, n, &what);
    }
    let point_types: Vec<String> = seen.iter().flat_map(|o| o.points.iter().map(|(t, _)| t.clone())).collect();
    if point_types.is_empty() {
        push_item(&mut items, 0, "points");
    }
    for (kind, n) in multiset(&point_types) {
        let what = match kind.as_str() {
            "ORDER_PAID" => s("points"),
            "ORDER_PAID_REVERSAL" => s("reversals"),
            other => other.to_owned(),
        };
        push_item(&mut items, n, &what);
    }
    let mut events: BTreeMap<&str, usize> = BTreeMap::new();
    let mut findings: BTreeMap<&str, usize> = BTreeMap::new();
    for o in seen {
        for (kind, n) in &o.events {
            *events.entry(kind).or_default() += n;
        }
        for (kind, n) in &o.findings {
            *findings.entry(kind).or_default() += n;
        }
    }
    for (kind, n) in events {
        push_item(&mut items, n, kind);
    }
    for (kind, n) in findings {
        push_item(&mut items, n, &format!("{kind} findings"));
    }
    let users: Vec<usize> = seen.iter().filter_map(|o| o.orders_of_user).collect();
    if !users.is_empty() {
        let per_user = if users.iter().all(|n| *n == 1) { "orders (1 per user)" } else { "orders" };
        push_item(&mut items, users.iter().sum(), per_user);
    }
    items.join(", ")
}

fn deliveries_cell(run: &ScenarioRun) -> String {
    let sent: usize = run.orders.iter().map(|o| o.deliveries).sum();
    let shown: Vec<String> =
        run.orders.iter().flat_map(|o| o.answers.iter().filter(|a| !a.starts_with("api:")).cloned()).collect();
    let mut answers = multiset(&shown);
    // In the order the scenario tells its story (applied before duplicate); surprises last.
    let story: Vec<&String> = run.orders.iter().flat_map(|o| &o.expect.answers).collect();
    answers.sort_by_key(|(label, _)| story.iter().position(|a| *a == label).unwrap_or(usize::MAX));
    let lost: usize = run.orders.iter().map(|o| o.lost).sum();
    if lost > 0 {
        answers.push((s("lost"), lost));
    }
    format!("{sent}: {}", counted(&answers))
}

fn build_row(run: &ScenarioRun, seen: &[OrderSeen], rewards: &RewardRule) -> Row {
    let violations = run
        .orders
        .iter()
        .zip(seen)
        .flat_map(|(r, o)| judge(&r.expect, rewards, o).into_iter().map(move |v| format!("{}: {v}", o.order_no)))
        .collect();
    Row {
        scenario: run.scenario.name().to_owned(),
        deliveries: deliveries_cell(run),
        expected: expected_effects(&run.orders, rewards),
        observed: observed_effects(seen),
        violations,
    }
}

/// The table, and the violations under it.
pub fn render_table(rows: &[Row]) -> String {
    let header = ["scenario", "deliveries", "effects expected", "effects observed", "verdict"];
    let cells: Vec<[String; 5]> = rows
        .iter()
        .map(|r| {
            let verdict = if r.violations.is_empty() { "ok" } else { "VIOLATION" };
            [r.scenario.clone(), r.deliveries.clone(), r.expected.clone(), r.observed.clone(), verdict.to_owned()]
        })
        .collect();
    let mut widths = header.map(|h| h.chars().count());
    for row in &cells {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |row: &[String]| -> String {
        let padded: Vec<String> = row.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        padded.join("  ").trim_end().to_owned() + "\n"
    };
    let mut out = line(&header.map(str::to_owned));
    out.push_str(&line(&widths.map(|w| "-".repeat(w))));
    for row in &cells {
        out.push_str(&line(row));
    }
    for r in rows.iter().filter(|r| !r.violations.is_empty()) {
        out.push_str(&format!("\nVIOLATION in {} ({} finding(s)):\n", r.scenario, r.violations.len()));
        for v in r.violations.iter().take(DETAILS_MAX) {
            out.push_str(&format!("  {v}\n"));
        }
        if r.violations.len() > DETAILS_MAX {
            out.push_str(&format!("  ... and {} more\n", r.violations.len() - DETAILS_MAX));
        }
    }
    out
}

// ---------------------------------------------------------------- the in-process payonce

struct LocalServer {
    addr: SocketAddr,
    shutdown: Arc<AtomicBool>,
    handle: Option<thread::JoinHandle<bool>>,
}

impl LocalServer {
    fn start(secret: &[u8]) -> Result<LocalServer, String> {
        let config = Config {
            callback_secrets: vec![secret.to_vec()],
            rewards: Rewards { coupon_templates: vec![SIM_COUPON.into()], points_per_yuan: SIM_POINTS_PER_YUAN },
            ..Config::default()
        };
        let app = App::open(":memory:", Clock::System, config).map_err(|e| e.message)?;
        let server = Server::bind("127.0.0.1:0").map_err(|e| e.message)?;
        let addr = server.local_addr();
        let shutdown = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&shutdown);
        let handle = thread::Builder::new()
            .name("payonce-simulated-server".into())
            .spawn(move || server.serve(Arc::new(app), flag, WORKERS_DEFAULT))
            .map_err(|e| format!("cannot start the in-process payonce: {e}"))?;
        Ok(LocalServer { addr, shutdown, handle: Some(handle) })
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        self.shutdown.store(true, Ordering::SeqCst);
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

// ---------------------------------------------------------------- the command

struct Options {
    target: Option<String>,
    callback_secret: Option<String>,
    api_token: Option<String>,
    channel: Channel,
    scenarios: Vec<Scenario>,
    orders: usize,
    concurrency: usize,
    time_factor: f64,
    replay_timeout_ms: u64,
}

fn string_value(parser: &mut lexopt::Parser) -> Result<String, String> {
    parser.value().map_err(|e| e.to_string())?.into_string().map_err(|v| format!("{v:?} is not UTF-8"))
}

fn int_value(parser: &mut lexopt::Parser, flag: &str, min: u64, max: u64) -> Result<u64, String> {
    let text = string_value(parser)?;
    match text.parse::<u64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(format!("{flag} {text:?}: expected an integer from {min} to {max}")),
    }
}

/// `None` when --help was printed.
fn parse_args(args: impl Iterator<Item = OsString>) -> Result<Option<Options>, String> {
    use lexopt::prelude::*;
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let mut opts = Options {
        target: None,
        callback_secret: env("PAYONCE_CALLBACK_SECRET"),
        api_token: env("PAYONCE_API_TOKEN"),
        channel: Channel::Generic,
        scenarios: Vec::new(),
        orders: 10,
        concurrency: 8,
        time_factor: 1000.0,
        replay_timeout_ms: 0,
    };
    let mut parser = lexopt::Parser::from_args(args);
    while let Some(arg) = parser.next().map_err(|e| e.to_string())? {
        match arg {
            Long("target") => opts.target = Some(string_value(&mut parser)?),
            Long("callback-secret") => opts.callback_secret = Some(string_value(&mut parser)?),
            Long("api-token") => opts.api_token = Some(string_value(&mut parser)?),
            Long("channel") => {
                let name = string_value(&mut parser)?;
                opts.channel = Channel::parse(&name).ok_or_else(|| {
                    let known: Vec<&str> = Channel::ALL.iter().map(|c| c.name()).collect();
                    format!("--channel {name:?}: known channels: {}", known.join(", "))
                })?;
            }
            Long("scenario") => {
                for name in string_value(&mut parser)?.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                    let scenario = Scenario::parse(name).ok_or_else(|| {
                        let known: Vec<&str> = Scenario::ALL.iter().map(|s| s.name()).collect();
                        format!("--scenario {name:?}: known scenarios: {}", known.join(", "))
                    })?;
                    if !opts.scenarios.contains(&scenario) {
                        opts.scenarios.push(scenario);
                    }
                }
            }
            Long("orders") => {
                opts.orders = usize::try_from(int_value(&mut parser, "--orders", 1, 100_000)?).unwrap_or(1)
            }
            Long("concurrency") => {
                opts.concurrency = usize::try_from(int_value(&mut parser, "--concurrency", 2, 64)?).unwrap_or(2)
            }
            Long("time-factor") => {
                let text = string_value(&mut parser)?;
                opts.time_factor = match text.parse::<f64>() {
                    Ok(f) if f.is_finite() && (0.001..=1e9).contains(&f) => f,
                    _ => return Err(format!("--time-factor {text:?}: expected a number from 0.001 to 1e9")),
                };
            }
            Long("replay-timeout-ms") => {
                opts.replay_timeout_ms = int_value(&mut parser, "--replay-timeout-ms", 0, 60_000)?
            }
            Short('h') | Long("help") => {
                print!("{USAGE}");
                return Ok(None);
            }
            other => return Err(format!("{}\n\n{USAGE}", other.unexpected())),
        }
    }
    if opts.scenarios.is_empty() {
        opts.scenarios = Scenario::ALL.to_vec();
    } else {
        opts.scenarios.sort_by_key(|s| Scenario::ALL.iter().position(|a| a == s));
    }
    Ok(Some(opts))
}

/// `S` + the time in base 36 + random characters: unique per run, short
/// enough that order_nos stay within WeChat Pay's 32 characters.
fn new_run_id() -> String {
    const DIGITS: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ";
    let base36 = |mut n: u64, width: usize| -> String {
        let mut out = Vec::new();
        while n > 0 || out.len() < width {
            out.push(DIGITS[usize::try_from(n % 36).unwrap_or(0)]);
            n /= 36;
        }
        out.reverse();
        String::from_utf8(out).unwrap_or_default()
    };
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    let mut random = [0u8; 8];
    let entropy = match getrandom::fill(&mut random) {
        Ok(()) => u64::from_le_bytes(random),
        Err(_) => u64::from(now.subsec_nanos()) ^ u64::from(std::process::id()).rotate_left(32),
    };
    let millis = u64::try_from(now.as_millis()).unwrap_or(0);
    format!("S{}{}", base36(millis, 8), base36(entropy % (36 * 36 * 36), 3))
}

fn first_secret(list: &str) -> Option<String> {
    list.split(',').map(str::trim).find(|s| !s.is_empty()).map(str::to_owned)
}

/// `payonce simulate`: parses its flags from `args` (after the command name).
/// Exit 0 when every scenario is ok, 1 on a violation; `Err` (exit 2) on errors.
pub fn run(args: impl Iterator<Item = OsString>) -> Result<ExitCode, String> {
    let Some(opts) = parse_args(args)? else {
        return Ok(ExitCode::SUCCESS);
    };
    let secret = opts.callback_secret.as_deref().and_then(first_secret);
    let (target, local, rewards, secret) = match &opts.target {
        Some(url) => {
            let secret = secret.clone().ok_or("--target needs --callback-secret or PAYONCE_CALLBACK_SECRET")?;
            let token = match opts.api_token.as_deref().and_then(first_secret) {
                Some(entry) => Some(ApiToken::parse(&entry).ok_or("--api-token: not a valid token")?.token),
                None => None,
            };
            (Target::parse(url, token)?, None, RewardRule::Unknown, secret)
        }
        None => {
            let secret = secret.clone().unwrap_or_else(|| format!("sim-{}", new_run_id()));
            let local = LocalServer::start(secret.as_bytes())?;
            let rewards = Rewards { coupon_templates: vec![SIM_COUPON.into()], points_per_yuan: SIM_POINTS_PER_YUAN };
            (Target::local(local.addr), Some(local), RewardRule::Known(rewards), secret)
        }
    };
    let sim = Sim {
        target: Arc::new(target),
        keys: Keys { generic_secret: secret.into_bytes() },
        channel: opts.channel,
        run_id: new_run_id(),
        orders: opts.orders,
        concurrency: opts.concurrency,
        time_factor: opts.time_factor,
        replay_timeout_ms: opts.replay_timeout_ms,
        progress: Progress::new(opts.orders >= 50 || std::io::stderr().is_terminal()),
    };
    let result = simulate(&sim, &opts, &rewards, local.is_some());
    drop(local);
    result
}

fn simulate(sim: &Sim, opts: &Options, rewards: &RewardRule, in_process: bool) -> Result<ExitCode, String> {
    let mut conn = Conn::new(&sim.target);
    let health = conn.request(&Req::get(s("/healthz")))?;
    if health.status != 200 {
        return Err(format!("{} answered GET /healthz with {}", sim.target.url, health.summary()));
    }
    if !in_process {
        let mode = sim.api(&mut conn, Req::get(s("/v1/admin/mode")))?;
        if mode.json()["mode"].as_str() == Some("record_only") {
            return Err(format!(
                "{} is in record_only mode: callbacks would be recorded, not decided; PUT /v1/admin/mode normal first",
                sim.target.url
            ));
        }
    }
    let first_seq = sim.last_event_seq(&mut conn)?;
    println!(
        "payonce simulate: run {} against {}{}, {} channel, {} orders per scenario, time factor {}",
        sim.run_id,
        sim.target.url,
        if in_process { " (in-process payonce, :memory:)" } else { "" },
        sim.channel.name(),
        sim.orders,
        sim.time_factor
    );
    let mut runs = Vec::new();
    for scenario in &opts.scenarios {
        let started = Instant::now();
        let run = sim.run_scenario(*scenario);
        sim.progress.finish();
        runs.push(run?);
        if sim.progress.enabled {
            eprintln!("{:<20} done in {:.1} s", scenario.name(), started.elapsed().as_secs_f64());
        }
    }
    let events = sim.events_since(&mut conn, first_seq)?;
    let findings = sim.findings(&mut conn)?;
    let mut rows = Vec::new();
    for run in &runs {
        let seen = sim.observe(run, &events, &findings)?;
        rows.push(build_row(run, &seen, rewards));
    }
    print!("{}", render_table(&rows));
    let _ = std::io::stdout().flush();
    Ok(if rows.iter().all(|r| r.violations.is_empty()) { ExitCode::SUCCESS } else { ExitCode::from(1) })
}
