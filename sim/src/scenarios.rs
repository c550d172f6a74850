//! The scenarios: what each one sends, in which duplicate form, and what it
//! expects of every order; then reading the results back (orders, events,
//! inspections) for the judge.

use crate::client::{Conn, Reply, ReplyExt, Req, Target};
use crate::judge::{OrderExpect, OrderSeen, RewardRule, SeenPayment, SeenRefund};
use crate::platform::{Keys, PaymentNotice, Platform, RefundNotice};
use crate::progress::Progress;
use crate::table::{render_narrow_table, render_table};
use crate::workers::{scoped_workers, Failure};
use crate::{now_s, s};
use parking_lot::Mutex;
use row::build_row;
use serde_json::{json, Value};
use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::io::Write;
use std::process::ExitCode;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

pub(crate) mod platform_calls;
pub(crate) use platform_calls::merchant_key;
mod row;

/// WeChat Pay's notification retry intervals after the first delivery, in seconds.
pub const WECHATPAY_RETRY_S: [u64; 15] =
    [15, 15, 30, 180, 600, 1_200, 1_800, 1_800, 1_800, 3_600, 10_800, 10_800, 10_800, 21_600, 21_600];
/// Alipay's asynchronous-notification retry intervals, in seconds.
pub const ALIPAY_RETRY_S: [u64; 7] = [240, 600, 600, 3_600, 7_200, 21_600, 54_000];

/// Without `--full-schedules`, a retry schedule is played up to this much
/// platform time after the first delivery: the first hour, which holds
/// WeChat Pay's first six retries (15s 15s 30s 3m 10m 20m) and Alipay's first
/// three (4m 10m 10m). At the default --time-factor that is about 2 s per
/// platform instead of about 90 s for the whole 24 hours.
const SCHEDULE_S_DEFAULT: u64 = 3_600;

/// The gap of the incident's re-delivery.
const REDELIVERY_GAP: Duration = Duration::from_millis(40);
/// Connections that run orders side by side (the server has 16 workers).
const WORKERS: usize = 8;
/// How often a 503 `database_busy` is retried (after its Retry-After), as a platform would.
const BUSY_RETRIES: u32 = 5;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    Concurrent,
    Redelivery40ms,
    GatewayReplay,
    RetrySchedule,
    TwoChannels,
    PaymentAfterClose,
    Refund,
    PartialRefunds,
    TripleClick,
    LostNotification,
    CloseRace,
    PlatformDown,
    RefundSubmitted,
    UnwantedMoney,
}

impl Scenario {
    pub const ALL: [Scenario; 14] = [
        Scenario::Concurrent,
        Scenario::Redelivery40ms,
        Scenario::GatewayReplay,
        Scenario::RetrySchedule,
        Scenario::TwoChannels,
        Scenario::PaymentAfterClose,
        Scenario::Refund,
        Scenario::PartialRefunds,
        Scenario::TripleClick,
        Scenario::LostNotification,
        Scenario::CloseRace,
        Scenario::PlatformDown,
        Scenario::RefundSubmitted,
        Scenario::UnwantedMoney,
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
            Scenario::LostNotification => "lost_notification",
            Scenario::CloseRace => "close_race",
            Scenario::PlatformDown => "platform_down",
            Scenario::RefundSubmitted => "refund_submitted",
            Scenario::PartialRefunds => "partial_refunds",
            Scenario::UnwantedMoney => "unwanted_money",
        }
    }

    /// Played against the simulated platforms' merchant APIs, by a payonce
    /// of its own that calls them (docs/platforms.md): in process only,
    /// and on the channels that have such an API.
    pub fn calls_platforms(self) -> bool {
        matches!(
            self,
            Scenario::LostNotification
                | Scenario::CloseRace
                | Scenario::PlatformDown
                | Scenario::RefundSubmitted
                | Scenario::UnwantedMoney
        )
    }

    /// Played on `channel` with the buyer paying at the simulated platform,
    /// against a payonce of its own that makes the payments there: the
    /// triple click of pay requests, and partial_refunds with each refund
    /// submitted to that platform. Against `--target`, and on the generic
    /// channel (no platform to pay at), triple_click is the triple click of
    /// the order's creation instead, and partial_refunds' results come from
    /// the simulator alone.
    pub fn plays_platform_apis(self, channel: Platform, in_process: bool) -> bool {
        matches!(self, Scenario::TripleClick | Scenario::PartialRefunds) && channel != Platform::Generic && in_process
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
            Scenario::LostNotification => "ln",
            Scenario::CloseRace => "cr",
            Scenario::PlatformDown => "pd",
            Scenario::RefundSubmitted => "sb",
            Scenario::PartialRefunds => "pr",
            Scenario::UnwantedMoney => "um",
        }
    }

    pub fn parse(text: &str) -> Option<Scenario> {
        Scenario::ALL.into_iter().find(|s| s.name() == text)
    }
}

#[derive(Clone, Debug)]
pub struct SimOrder {
    pub no: String,
    user: String,
    pub amount: i64,
}

/// What one delivery (with its 503 retries) came to.
struct Delivery {
    label: String,
    sends: usize,
}

/// What a scenario did to one order, and what it expects of it.
pub struct OrderRun {
    pub order: SimOrder,
    pub expect: OrderExpect,
    pub answers: Vec<String>,
    pub lost: usize,
    pub deliveries: usize,
}

/// One run per order: its creation's answer first, then the answers and
/// delivery count its scenario recorded; nothing lost.
fn order_runs(
    orders: Vec<SimOrder>,
    created: Vec<String>,
    runs: Vec<(Vec<String>, usize)>,
    expect: &OrderExpect,
) -> Vec<OrderRun> {
    orders
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
        .collect()
}

pub struct ScenarioRun {
    pub scenario: Scenario,
    pub channel: Platform,
    pub orders: Vec<OrderRun>,
    /// Read back already, by a scenario that ran on a payonce of its own
    /// (one per order, in order); `None`: read from the target at the end.
    pub seen: Option<Vec<OrderSeen>>,
    /// Why the scenario does not apply to this channel (or run); nothing was sent.
    pub skipped: Option<&'static str>,
    /// Lines printed under the table (the before/after comparisons).
    pub notes: Vec<String>,
}

impl ScenarioRun {
    fn skipped(scenario: Scenario, channel: Platform, why: &'static str) -> ScenarioRun {
        ScenarioRun { scenario, channel, orders: Vec::new(), seen: None, skipped: Some(why), notes: Vec::new() }
    }
}

/// One run against one target, for one channel (see [`Sim::for_channel`]).
pub struct Sim {
    pub target: Arc<Target>,
    pub keys: Arc<Keys>,
    /// The channel every delivery goes through...
    pub channel: Platform,
    /// ...except two_channels' second payment, which goes through this one
    /// (the next selected channel; the same one when only one is selected).
    pub partner: Platform,
    pub run_id: String,
    pub orders: usize,
    pub concurrency: usize,
    pub time_factor: f64,
    /// Every retry of the platforms' schedules, not only the first hour's.
    pub full_schedules: bool,
    pub replay_timeout_ms: u64,
    /// The whole table (`--verbose`), not the one that fits 100 columns.
    pub verbose: bool,
    pub progress: Progress,
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

/// The label of a `POST /v1/orders/{order_no}/refunds` answer, which
/// carries the order and the refund: `api:refunds 201 REFUNDING`,
/// `api:refunds 409 refund_exceeds_balance`.
fn refunds_label(reply: &Reply) -> String {
    let body = reply.json();
    match body["order"]["status"].as_str() {
        Some(status) if (200..300).contains(&reply.status) => format!("api:refunds {} {status}", reply.status),
        _ => format!("api:refunds {} {}", reply.status, reply.error_code()),
    }
}

/// partial_refunds' refunds of one order, in the order they are asked for:
/// 30 % of the amount, 20 % (first under a number whose result is FAILED
/// where the channel can say so, then again under a new one) and the rest,
/// asked without an amount; the first one's result is delivered twice.
/// Besides, one refund is asked while the first is in flight and one for
/// a fen more than the first left: both refused, neither a refund.
pub(crate) struct RefundPlan {
    order_no: String,
    pay_no: String,
    amount: i64,
    pub refunds: Vec<PlannedRefund>,
    busy_no: String,
    over_no: String,
}

#[derive(Clone, Debug)]
pub(crate) struct PlannedRefund {
    pub refund_no: String,
    /// Fen.
    pub amount: i64,
    /// Asked without `amount`: whatever is left.
    rest: bool,
    /// Its result is FAILED.
    pub fails: bool,
    /// Its result is delivered twice.
    duplicated: bool,
}

/// The three refunds' amounts: 30 % and 20 % of `amount`, a fen more each,
/// and the rest. The fen keeps every share of the points off a whole
/// number, so each reversal is a floor and the last one differs from its own.
pub(crate) fn refund_shares(amount: i64) -> [i64; 3] {
    let first = amount * 3 / 10 + 1;
    let second = amount / 5 + 1;
    [first, second, amount - first - second]
}

/// Whether the channel tells of a failed refund: Alipay has no notice of one
/// (see [`Platform::sign_refund`]) and its refund query no failed state, so
/// there a refund cannot fail, only wait.
pub(crate) fn refund_can_fail(channel: Platform) -> bool {
    channel != Platform::Alipay
}

impl RefundPlan {
    /// `sep` joins the order_no and each refund's suffix (Alipay's
    /// out_request_no and the notices' numbers take `_`, not `-`, in the
    /// scenarios that call the platforms).
    pub fn new(order: &SimOrder, pay_no: &str, sep: char, channel: Platform) -> RefundPlan {
        let no = |suffix: &str| format!("{}{sep}{suffix}", order.no);
        let [first, second, rest] = refund_shares(order.amount);
        let refund = |suffix: &str, amount: i64| PlannedRefund {
            refund_no: no(suffix),
            amount,
            rest: false,
            fails: false,
            duplicated: false,
        };
        let mut refunds = vec![PlannedRefund { duplicated: true, ..refund("R1", first) }];
        if refund_can_fail(channel) {
            refunds.push(PlannedRefund { fails: true, ..refund("R2", second) });
        }
        refunds.push(refund("R2b", second));
        refunds.push(PlannedRefund { rest: true, ..refund("R3", rest) });
        RefundPlan {
            order_no: order.no.clone(),
            pay_no: pay_no.to_owned(),
            amount: order.amount,
            refunds,
            busy_no: no("Rbusy"),
            over_no: no("Rover"),
        }
    }

    fn path(&self) -> String {
        format!("/v1/orders/{}/refunds", self.order_no)
    }

    fn body(refund_no: &str, amount: Option<i64>) -> Value {
        match amount {
            Some(amount) => json!({"refund_no": refund_no, "amount": amount, "reason": "payonce simulate"}),
            None => json!({"refund_no": refund_no}),
        }
    }

    /// The body of refund `k`'s request.
    fn request_body(&self, k: usize) -> Value {
        let refund = &self.refunds[k];
        RefundPlan::body(&refund.refund_no, (!refund.rest).then_some(refund.amount))
    }

    /// The refunds that succeed, before refund `k`, in fen.
    fn refunded_before(&self, k: usize) -> i64 {
        self.refunds[..k].iter().filter(|r| !r.fails).map(|r| r.amount).sum()
    }

    /// The notice of refund `k`'s result, as the simulator signs it.
    pub fn notice(&self, k: usize) -> RefundNotice {
        let refund = &self.refunds[k];
        let this = if refund.fails { 0 } else { refund.amount };
        RefundNotice {
            refund_no: refund.refund_no.clone(),
            order_no: self.order_no.clone(),
            pay_no: self.pay_no.clone(),
            amount: refund.amount,
            total: self.amount,
            refunded_total: self.refunded_before(k) + this,
            success: !refund.fails,
        }
    }

    /// The answers to the refunds' requests and results, after the payment's.
    pub fn answers(&self, said: &dyn Fn(&str) -> String) -> Vec<String> {
        let mut answers = Vec::new();
        for (k, refund) in self.refunds.iter().enumerate() {
            answers.push(s("api:refunds 201 REFUNDING"));
            if k == 0 {
                answers.push(s("api:refunds 409 refund_in_progress"));
            }
            answers.push(format!("refund {}", said(if refund.fails { "refund_failed" } else { "applied" })));
            if refund.duplicated {
                answers.push(format!("refund {}", said("duplicate")));
            }
            if k == 0 {
                answers.push(s("api:refunds 409 refund_exceeds_balance"));
            }
        }
        answers
    }

    /// The order's refunds once all are settled.
    pub fn rows(&self) -> Vec<SeenRefund> {
        let status = |r: &PlannedRefund| if r.fails { "FAILED" } else { "SUCCEEDED" };
        self.refunds.iter().map(|r| SeenRefund::new(&r.refund_no, r.amount, status(r))).collect()
    }

    /// Every event of the order: paid, each refund asked, each result.
    pub fn events(&self) -> Vec<(String, usize)> {
        let failed = self.refunds.iter().filter(|r| r.fails).count();
        let succeeded = self.refunds.len() - failed;
        let mut events = vec![
            (s("order.paid"), 1),
            (s("order.refunding"), self.refunds.len()),
            (s("order.partially_refunded"), succeeded - 1),
            (s("order.refunded"), 1),
        ];
        if failed > 0 {
            events.push((s("order.refund_failed"), failed));
        }
        events
    }

    /// What must be true of the order in the end (the answers after its creation's).
    pub fn expect(&self, answers: Vec<String>) -> OrderExpect {
        OrderExpect {
            status: s("REFUNDED"),
            answers,
            payments: vec![s("applied")],
            paid: true,
            refunded: true,
            refunds: Some(self.rows()),
            refunded_amount: Some(self.amount),
            events: self.events(),
            ..OrderExpect::default()
        }
    }
}

impl Sim {
    /// The same run (target, keys, run id, settings) for another channel.
    fn for_channel(&self, channel: Platform, partner: Platform) -> Sim {
        Sim {
            target: Arc::clone(&self.target),
            keys: Arc::clone(&self.keys),
            channel,
            partner,
            run_id: self.run_id.clone(),
            orders: self.orders,
            concurrency: self.concurrency,
            time_factor: self.time_factor,
            full_schedules: self.full_schedules,
            replay_timeout_ms: self.replay_timeout_ms,
            verbose: self.verbose,
            progress: Progress::new(self.progress.bar),
        }
    }

    /// `{run_id}-{scenario}{channel}-{i}`: at most 22 characters for up to
    /// 100,000 orders, within WeChat Pay's 6-32 for out_trade_no.
    fn order(&self, scenario: Scenario, i: usize) -> SimOrder {
        let no = format!("{}-{}{}-{i}", self.run_id, scenario.tag(), self.channel.tag());
        SimOrder { user: format!("{no}-u"), no, amount: Sim::order_amount(i) }
    }

    /// Order `i`'s amount: not round, and at least 10 yuan, so points are never 0.
    fn order_amount(i: usize) -> i64 {
        1_000 + i64::try_from(i % 90).unwrap_or(0) * 100 + i64::try_from(i % 7).unwrap_or(0)
    }

    /// Payment `k` of `order`, its delivery number `attempt` (0: the first).
    fn payment(&self, order: &SimOrder, k: usize, attempt: usize) -> PaymentNotice {
        PaymentNotice {
            pay_no: format!("{}-P{k}", order.no),
            order_no: order.no.clone(),
            amount: order.amount,
            success: true,
            attempt,
        }
    }

    fn sign_payment(&self, channel: Platform, notice: &PaymentNotice) -> Result<Req, String> {
        Ok(channel.sign_payment(&self.keys, notice, now_s())?.into())
    }

    /// Sends `build()` (rebuilt each time, so signatures stay fresh) and
    /// retries a 503 after its Retry-After, as a platform would.
    fn send_retrying(
        &self,
        conn: &mut Conn,
        build: &dyn Fn() -> Result<Req, String>,
    ) -> Result<(Reply, usize), String> {
        let before = conn.writes;
        let mut tries = 0;
        loop {
            let reply = conn.request(&build()?)?;
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
        self.deliver_payment_via(conn, self.channel, notice, None)
    }

    /// A payment delivery through `channel`; `presigned` is sent first (signed
    /// ahead of a moment that must be sharp), re-signed for 503 retries.
    fn deliver_payment_via(
        &self,
        conn: &mut Conn,
        channel: Platform,
        notice: &PaymentNotice,
        presigned: Option<Req>,
    ) -> Result<Delivery, String> {
        let presigned = RefCell::new(presigned);
        let build = || match presigned.borrow_mut().take() {
            Some(req) => Ok(req),
            None => self.sign_payment(channel, notice),
        };
        let (reply, sends) = self.send_retrying(conn, &build)?;
        Ok(Delivery { label: channel.answer(&reply)?, sends })
    }

    fn deliver_refund(&self, conn: &mut Conn, notice: &RefundNotice) -> Result<Delivery, String> {
        self.deliver_refund_via(conn, self.channel, notice)
    }

    /// A refund's result delivered through `channel` (the platform that refunded).
    fn deliver_refund_via(
        &self,
        conn: &mut Conn,
        channel: Platform,
        notice: &RefundNotice,
    ) -> Result<Delivery, String> {
        let build = || Ok(channel.sign_refund(&self.keys, notice, now_s())?.into());
        let (reply, sends) = self.send_retrying(conn, &build)?;
        Ok(Delivery { label: format!("refund {}", channel.answer(&reply)?), sends })
    }

    /// The answer a delivery with payonce outcome `outcome` must get here.
    fn said(&self, outcome: &str) -> String {
        self.channel.label(outcome)
    }

    /// An order-API call; 401 is a setup error (the token), not a verdict.
    fn api(&self, conn: &mut Conn, req: Req) -> Result<Reply, String> {
        let (method, path) = (req.method, req.path.clone());
        let (reply, _) = self.send_retrying(conn, &|| Ok(req.clone()))?;
        if reply.status == 401 {
            return Err(format!(
                "{method} {path}: 401 {}: the target needs an API token (PAYONCE_API_TOKEN or --api-token)",
                reply.error_code()
            ));
        }
        Ok(reply)
    }

    fn create(&self, conn: &mut Conn, order: &SimOrder) -> Result<Reply, String> {
        self.create_expiring(conn, order, 3600)
    }

    fn create_expiring(&self, conn: &mut Conn, order: &SimOrder, expires_in_s: i64) -> Result<Reply, String> {
        let body =
            json!({"order_no": order.no, "user_id": order.user, "amount": order.amount, "expires_in_s": expires_in_s});
        self.api(conn, Req::post_json(s("/v1/orders"), &body))
    }

    /// `work(conn, i)` for every order, on up to `WORKERS` keep-alive connections.
    fn par_orders<T: Send>(
        &self,
        n: usize,
        work: impl Fn(&mut Conn, usize) -> Result<T, String> + Sync,
    ) -> Result<Vec<T>, String> {
        self.par_orders_on(n, WORKERS, work)
    }

    /// [`Sim::par_orders`] on up to `workers` connections.
    fn par_orders_on<T: Send>(
        &self,
        n: usize,
        workers: usize,
        work: impl Fn(&mut Conn, usize) -> Result<T, String> + Sync,
    ) -> Result<Vec<T>, String> {
        let next = Mutex::new(0usize);
        let results: Mutex<Vec<Option<T>>> = Mutex::new((0..n).map(|_| None).collect());
        let failure = Failure::new();
        scoped_workers(n.clamp(1, workers.max(1)), |_| {
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

    /// For each order in turn, `prepare(i, t)` (e.g. signing, which is slow
    /// in a debug build) and then `work(conn, i, t, prepared)` on `k` threads
    /// released at the same moment (each thread its own keep-alive connection).
    fn rounds<P, T: Send>(
        &self,
        n: usize,
        k: usize,
        prepare: impl Fn(usize, usize) -> Result<P, String> + Sync,
        work: impl Fn(&mut Conn, usize, usize, P) -> Result<T, String> + Sync,
    ) -> Result<Vec<Vec<T>>, String> {
        let barrier = Barrier::new(k);
        let results: Mutex<Vec<Vec<Option<T>>>> = Mutex::new((0..n).map(|_| (0..k).map(|_| None).collect()).collect());
        let failure = Failure::new();
        scoped_workers(k, |t| {
            let mut conn = Conn::new(&self.target);
            if let Err(e) = conn.warm() {
                failure.set(e);
            }
            for i in 0..n {
                let prepared = if failure.is_set() { None } else { prepare(i, t).map_err(|e| failure.set(e)).ok() };
                barrier.wait();
                let Some(prepared) = prepared.filter(|_| !failure.is_set()) else {
                    continue;
                };
                match work(&mut conn, i, t, prepared) {
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

    /// `in_process`: the simulator runs the payonce it plays against, so it
    /// can start more with the simulated platforms' settings.
    fn run_scenario(&self, scenario: Scenario, in_process: bool) -> Result<ScenarioRun, String> {
        if scenario.plays_platform_apis(self.channel, in_process) {
            let run = platform_calls::run(self, scenario);
            self.progress.finish();
            return run;
        }
        if scenario.calls_platforms() {
            if self.channel == Platform::Generic {
                return Ok(ScenarioRun::skipped(scenario, self.channel, "(generic has no platform API to ask)"));
            }
            let run = platform_calls::run(self, scenario);
            self.progress.finish();
            return run;
        }
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
            Scenario::PartialRefunds => self.partial_refunds(orders)?,
            Scenario::LostNotification
            | Scenario::CloseRace
            | Scenario::PlatformDown
            | Scenario::RefundSubmitted
            | Scenario::UnwantedMoney => {
                return Err(format!("{} runs on a payonce of its own", scenario.name()));
            }
        };
        self.progress.finish();
        Ok(ScenarioRun { scenario, channel: self.channel, orders: runs, seen: None, skipped: None, notes: Vec::new() })
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
        let rounds = self.rounds(
            orders.len(),
            k,
            |i, t| {
                let notice = self.payment(&orders[i], 1, t);
                let req = self.sign_payment(self.channel, &notice)?;
                Ok((notice, req))
            },
            |conn, _, _, (notice, req)| {
                let delivery = self.deliver_payment_via(conn, self.channel, &notice, Some(req));
                self.progress.tick();
                delivery
            },
        )?;
        let mut expected = vec![Sim::created(), self.said("applied")];
        expected.extend((1..k).map(|_| self.said("duplicate")));
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
            let notices = [self.payment(&orders[i], 1, 0), self.payment(&orders[i], 1, 1)];
            // Both signed ahead, so signing time never stretches the 40 ms.
            let reqs = [self.sign_payment(self.channel, &notices[0])?, self.sign_payment(self.channel, &notices[1])?];
            let (mut first, mut second) = (Conn::new(&self.target), Conn::new(&self.target));
            first.send(&reqs[0])?;
            let sent_at = Instant::now();
            thread::sleep(REDELIVERY_GAP.saturating_sub(sent_at.elapsed()));
            second.send(&reqs[1])?;
            let mut answers = Vec::new();
            let mut deliveries = 0;
            for (conn, notice) in [&mut first, &mut second].into_iter().zip(&notices) {
                let reply = conn.receive().map_err(|e| format!("redelivery_40ms: {} from {}", e, self.target.url))?;
                let delivery = self.settle(conn, reply, notice)?;
                answers.push(delivery.label);
                deliveries += delivery.sends;
                self.progress.tick();
            }
            Ok((answers, deliveries))
        })?;
        let expect = Sim::paid_expect(vec![Sim::created(), self.said("applied"), self.said("duplicate")]);
        Ok(order_runs(orders, created, runs, &expect))
    }

    /// The first attempt of a gateway replay: a fresh connection, the
    /// request, a read timeout of `--replay-timeout-ms` (0: no wait at all),
    /// then the connection is dropped, as a gateway that timed out drops it.
    /// `Some(label)` when the answer arrived in time anyway.
    fn deliver_abandoned(&self, notice: &PaymentNotice) -> Result<Option<String>, String> {
        let timeout = Duration::from_millis(self.replay_timeout_ms.max(1));
        let req = self.sign_payment(self.channel, notice)?;
        let mut conn = Conn::open(&self.target)?;
        conn.set_read_timeout(timeout)
            .and_then(|()| conn.send(&req.encode(&self.target)))
            .map_err(|e| format!("gateway_replay: cannot send to {}: {e}", self.target.url))?;
        if self.replay_timeout_ms == 0 {
            return Ok(None);
        }
        match conn.receive() {
            Ok(reply) => Ok(Some(self.channel.answer(&reply)?)),
            Err(_) => Ok(None),
        }
    }

    fn gateway_replay(&self, orders: Vec<SimOrder>) -> Result<Vec<OrderRun>, String> {
        let created = self.create_all(&orders)?;
        self.progress.start("gateway_replay", orders.len() * 2);
        let runs = self.par_orders(orders.len(), |_, i| {
            let first = self.deliver_abandoned(&self.payment(&orders[i], 1, 0))?;
            self.progress.tick();
            // The platform saw no answer (or too late for its gateway): re-send on a new connection.
            let mut fresh = Conn::new(&self.target);
            let replay = self.deliver_payment(&mut fresh, &self.payment(&orders[i], 1, 1))?;
            self.progress.tick();
            Ok((first, replay))
        })?;
        let expect = Sim::paid_expect(vec![Sim::created(), self.said("applied"), self.said("duplicate")]);
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
        // Each platform its own schedule; the generic channel alternates both.
        let schedule = |i: usize| -> &'static [u64] {
            match self.channel {
                Platform::Wechatpay => &WECHATPAY_RETRY_S,
                Platform::Alipay => &ALIPAY_RETRY_S,
                Platform::Generic if i % 2 == 0 => &WECHATPAY_RETRY_S,
                Platform::Generic => &ALIPAY_RETRY_S,
            }
        };
        let played_s = if self.full_schedules { u64::MAX } else { SCHEDULE_S_DEFAULT };
        let offsets: Vec<Vec<Duration>> = (0..n)
            .map(|i| {
                std::iter::once(0)
                    .chain(schedule(i).iter().scan(0u64, |at, interval| {
                        *at += interval;
                        Some(*at)
                    }))
                    .take_while(|at| *at <= played_s)
                    .map(|at| {
                        Duration::try_from_secs_f64(at as f64 / self.time_factor)
                            .map_err(|e| format!("--time-factor {}: {e}", self.time_factor))
                    })
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
                match self.deliver_payment(&mut conn, &self.payment(&orders[i], 1, attempt)) {
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
                let mut expected = vec![Sim::created(), self.said("applied")];
                expected.extend((1..offsets[i].len()).map(|_| self.said("duplicate")));
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
        // Two independent payments of one order, at the same moment: the
        // second through the partner channel (another one when several are
        // selected).
        let channels = [self.channel, self.partner];
        let rounds = self.rounds(
            orders.len(),
            2,
            |i, t| {
                let notice = self.payment(&orders[i], t + 1, 0);
                let req = self.sign_payment(channels[t], &notice)?;
                Ok((notice, req))
            },
            |conn, _, t, (notice, req)| {
                let delivery = self.deliver_payment_via(conn, channels[t], &notice, Some(req));
                self.progress.tick();
                delivery
            },
        )?;
        Ok(orders
            .into_iter()
            .zip(created)
            .zip(rounds)
            .map(|((order, created), deliveries)| {
                let labels: Vec<String> = deliveries.iter().map(|d| d.label.clone()).collect();
                let (answers, pay_no) = two_channels_answers(channels, &labels, &order);
                OrderRun {
                    expect: OrderExpect {
                        status: s("PAID"),
                        answers: std::iter::once(Sim::created()).chain(answers).collect(),
                        payments: vec![s("applied"), s("already_paid")],
                        paid: true,
                        events: vec![(s("order.paid"), 1), (s("payment.refund_required"), 1)],
                        findings: vec![(s("refund_required"), 1)],
                        pay_no,
                        ..OrderExpect::default()
                    },
                    order,
                    deliveries: deliveries.iter().map(|d| d.sends).sum(),
                    answers: std::iter::once(created).chain(labels).collect(),
                    lost: 0,
                }
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
            for attempt in 0..2 {
                let delivery = self.deliver_payment(conn, &self.payment(&orders[i], 1, attempt))?;
                answers.push(delivery.label);
                deliveries += delivery.sends;
                self.progress.tick();
            }
            Ok((answers, deliveries))
        })?;
        let expect = OrderExpect {
            status: s("CLOSED"),
            answers: vec![
                Sim::created(),
                s("api:close 200 CLOSED"),
                self.said("paid_after_close"),
                self.said("duplicate"),
            ],
            payments: vec![s("paid_after_close")],
            events: vec![(s("order.closed"), 1), (s("payment.refund_required"), 1)],
            findings: vec![(s("refund_required"), 1)],
            ..OrderExpect::default()
        };
        Ok(order_runs(orders, created, runs, &expect))
    }

    fn refund(&self, orders: Vec<SimOrder>) -> Result<Vec<OrderRun>, String> {
        let created = self.create_all(&orders)?;
        self.progress.start("refund", orders.len() * 3);
        let runs = self.par_orders(orders.len(), |conn, i| {
            let order = &orders[i];
            let payment = self.payment(order, 1, 0);
            let paid = self.deliver_payment(conn, &payment)?;
            self.progress.tick();
            let mut answers = vec![paid.label];
            let mut deliveries = paid.sends;
            let refund_no = format!("{}-R1", order.no);
            for _ in 0..2 {
                let path = format!("/v1/orders/{}/refund", order.no);
                let reply = self.api(conn, Req::post_json(path, &json!({"refund_no": refund_no})))?;
                answers.push(api_label("refund", &reply));
            }
            let notice = RefundNotice::full(refund_no, order.no.clone(), payment.pay_no, order.amount, true);
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
                self.said("applied"),
                s("api:refund 200 REFUNDING"),
                s("api:refund 200 REFUNDING"),
                format!("refund {}", self.said("applied")),
                format!("refund {}", self.said("duplicate")),
            ],
            payments: vec![s("applied")],
            paid: true,
            refunded: true,
            events: vec![(s("order.paid"), 1), (s("order.refunding"), 1), (s("order.refunded"), 1)],
            ..OrderExpect::default()
        };
        Ok(order_runs(orders, created, runs, &expect))
    }

    /// partial_refunds' refunds of every order in `plans`, one refund at a
    /// time across all orders: each asked, then `submitted()` (a round of
    /// the pool of a payonce that submits it to a platform, or nothing),
    /// then its result: the notice `settle` has from the platform it settled
    /// at, else the one the simulator signs from the plan. The answers and
    /// deliveries sent, per order.
    pub(crate) fn play_refunds(
        &self,
        plans: &[RefundPlan],
        submitted: &dyn Fn() -> Result<(), String>,
        settle: &dyn Fn(&PlannedRefund) -> Option<RefundNotice>,
    ) -> Result<Vec<(Vec<String>, usize)>, String> {
        let mut played: Vec<(Vec<String>, usize)> = plans.iter().map(|_| (Vec::new(), 0)).collect();
        let steps = plans.iter().map(|p| p.refunds.len()).max().unwrap_or(0);
        for k in 0..steps {
            let asked = self.par_orders(plans.len(), |conn, i| {
                let plan = &plans[i];
                let mut labels =
                    vec![refunds_label(&self.api(conn, Req::post_json(plan.path(), &plan.request_body(k)))?)];
                if k == 0 {
                    // One refund in flight at a time.
                    let busy = RefundPlan::body(&plan.busy_no, Some(1));
                    labels.push(refunds_label(&self.api(conn, Req::post_json(plan.path(), &busy))?));
                }
                Ok(labels)
            })?;
            submitted()?;
            let notices: Vec<RefundNotice> =
                plans.iter().map(|plan| settle(&plan.refunds[k]).unwrap_or_else(|| plan.notice(k))).collect();
            let results = self.par_orders(plans.len(), |conn, i| {
                let mut labels = Vec::new();
                let mut sends = 0;
                for _ in 0..if plans[i].refunds[k].duplicated { 2 } else { 1 } {
                    let delivery = self.deliver_refund(conn, &notices[i])?;
                    labels.push(delivery.label);
                    sends += delivery.sends;
                    self.progress.tick();
                }
                if k == 0 {
                    // A fen more than the first refund left.
                    let plan = &plans[i];
                    let over = plan.amount - plan.refunds[0].amount + 1;
                    let body = RefundPlan::body(&plan.over_no, Some(over));
                    labels.push(refunds_label(&self.api(conn, Req::post_json(plan.path(), &body))?));
                }
                Ok((labels, sends))
            })?;
            for ((answers, deliveries), (asked, (results, sends))) in
                played.iter_mut().zip(asked.into_iter().zip(results))
            {
                answers.extend(asked);
                answers.extend(results);
                *deliveries += sends;
            }
        }
        Ok(played)
    }

    /// Pay, then three refunds of each order (see [`RefundPlan`]), their
    /// results signed here: refunded in full, each refund's points reversed.
    fn partial_refunds(&self, orders: Vec<SimOrder>) -> Result<Vec<OrderRun>, String> {
        let created = self.create_all(&orders)?;
        let plans: Vec<RefundPlan> = orders
            .iter()
            .map(|order| RefundPlan::new(order, &self.payment(order, 1, 0).pay_no, '-', self.channel))
            .collect();
        let notices: usize = plans.iter().map(|p| p.refunds.len() + 1).sum();
        self.progress.start("partial_refunds", orders.len() + notices);
        let paid = self.par_orders(orders.len(), |conn, i| {
            let delivery = self.deliver_payment(conn, &self.payment(&orders[i], 1, 0));
            self.progress.tick();
            delivery
        })?;
        let played = self.play_refunds(&plans, &|| Ok(()), &|_| None)?;
        let said = |outcome: &str| self.said(outcome);
        Ok(orders
            .into_iter()
            .zip(created)
            .zip(paid.into_iter().zip(played))
            .zip(&plans)
            .map(|(((order, created), (paid, (refunds, sends))), plan)| {
                let expected = [Sim::created(), self.said("applied")].into_iter().chain(plan.answers(&said)).collect();
                OrderRun {
                    order,
                    expect: plan.expect(expected),
                    answers: [created, paid.label].into_iter().chain(refunds).collect(),
                    lost: 0,
                    deliveries: paid.sends + sends,
                }
            })
            .collect())
    }

    fn triple_click(&self, orders: Vec<SimOrder>) -> Result<Vec<OrderRun>, String> {
        self.progress.start("triple_click", orders.len() * 3);
        let rounds = self.rounds(
            orders.len(),
            3,
            |_, _| Ok(()),
            |conn, i, _, ()| {
                let reply = self.create(conn, &orders[i])?;
                self.progress.tick();
                Ok(match (reply.status, reply.header("Idempotent-Replayed")) {
                    (201, None) => s("created"),
                    (200, Some("true")) => s("replayed"),
                    _ => format!("create {}", reply.summary()),
                })
            },
        )?;
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

/// two_channels' expected answers (after the order's create) and, when an
/// answer said which payment won, its pay_no. Generic answers name the
/// outcome (which of the two is `applied` is the race's); a platform's only
/// says [`PROCESSED`], so with one generic delivery its answer decides.
fn two_channels_answers(channels: [Platform; 2], labels: &[String], order: &SimOrder) -> (Vec<String>, Option<String>) {
    let pay_no = |t: usize| format!("{}-P{}", order.no, t + 1);
    let generic: Vec<usize> = (0..2).filter(|t| channels[*t] == Platform::Generic).collect();
    let answers = if generic.len() == 2 {
        vec![s("applied"), s("already_paid")]
    } else {
        (0..2)
            .map(|t| match channels[t] {
                Platform::Generic if labels.get(t).map(String::as_str) == Some("already_paid") => s("already_paid"),
                channel => channel.label("applied"),
            })
            .collect()
    };
    let winner = generic.iter().find_map(|t| match labels.get(*t).map(String::as_str) {
        Some("applied") => Some(pay_no(*t)),
        Some("already_paid") => Some(pay_no(1 - *t)),
        _ => None,
    });
    (answers, winner)
}

fn read_order_detail(detail: &Value, seen: &mut OrderSeen) {
    let text = |v: &Value, key: &str| v[key].as_str().unwrap_or("").to_owned();
    seen.status = Some(text(detail, "status"));
    seen.pay_no = detail["pay_no"].as_str().map(str::to_owned);
    let list = |key: &str| detail[key].as_array().cloned().unwrap_or_default();
    seen.payments = list("payments")
        .iter()
        .map(|p| SeenPayment {
            pay_no: text(p, "pay_no"),
            outcome: text(p, "outcome"),
            state: text(p, "state"),
            source: text(p, "source"),
            resolution: text(p, "resolution"),
            refunds: p["refunds"].as_array().into_iter().flatten().map(seen_refund).collect(),
        })
        .collect();
    seen.audit = list("audit").iter().map(|a| text(a, "action")).collect();
    seen.coupons = list("coupons").iter().map(|c| (text(c, "coupon_template_id"), text(c, "status"))).collect();
    seen.points = list("points").iter().map(|p| (text(p, "point_type"), p["points"].as_i64().unwrap_or(0))).collect();
    seen.refunded_amount = detail["refunded_amount"].as_i64();
    seen.refunds = list("refunds").iter().map(seen_refund).collect();
}

/// A refund object of `GET /v1/orders/{order_no}` (the order's, or a payment's).
fn seen_refund(refund: &Value) -> SeenRefund {
    let text = |key: &str| refund[key].as_str().unwrap_or("");
    SeenRefund::new(text("refund_no"), refund["amount"].as_i64().unwrap_or(0), text("status"))
}

/// Runs every scenario on every channel, reads the results back, prints the
/// table. Exit 0 when every row is ok, 1 on a violation; `Err` on a setup error.
pub fn simulate(
    sim: &Sim,
    channels: &[Platform],
    scenarios: &[Scenario],
    rewards: &RewardRule,
    in_process: bool,
) -> Result<ExitCode, String> {
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
    let names: Vec<&str> = channels.iter().map(|c| c.name()).collect();
    let heading = format!(
        "payonce simulate: run {} against {}{}, {} channel{}, {} orders per scenario{}, time factor {}, {}",
        sim.run_id,
        sim.target.url,
        if in_process { " (in-process payonce, :memory:)" } else { "" },
        names.join(", "),
        if names.len() > 1 { "s" } else { "" },
        sim.orders,
        if names.len() > 1 { " and channel" } else { "" },
        sim.time_factor,
        if sim.full_schedules {
            "full retry schedules"
        } else {
            "retry schedules' first hour (--full-schedules: 24 h)"
        }
    );
    print!("{}", crate::table::wrap(&heading, crate::table::NARROW_WIDTH, "", "  "));
    let against_target: Vec<&str> =
        scenarios.iter().filter(|s| s.calls_platforms() && !in_process).map(|s| s.name()).collect();
    if !against_target.is_empty() {
        let skipped = format!(
            "payonce simulate: skipped against --target: {} (they need a payonce configured with the simulated \
             platforms' keys and URLs, on a clock the simulator sets; run without --target to play them)",
            against_target.join(", ")
        );
        print!("{}", crate::table::wrap(&skipped, crate::table::NARROW_WIDTH, "", "  "));
    }
    let _ = std::io::stdout().flush();
    // One simulator per channel; each pays two_channels' second payment
    // through the next selected channel.
    let sims: Vec<Sim> = channels
        .iter()
        .enumerate()
        .map(|(i, channel)| sim.for_channel(*channel, channels[(i + 1) % channels.len()]))
        .collect();
    let mut runs = Vec::new();
    for scenario in scenarios.iter().filter(|s| in_process || !s.calls_platforms()) {
        for channel_sim in &sims {
            let started = Instant::now();
            let run = channel_sim.run_scenario(*scenario, in_process);
            channel_sim.progress.finish();
            let run = run?;
            let skipped = run.skipped.is_some();
            runs.push(run);
            if skipped {
                continue;
            }
            // Progress as it goes, one line a scenario (and the bar on a terminal).
            let channel = if sims.len() > 1 { format!(" ({})", channel_sim.channel.name()) } else { String::new() };
            eprintln!(
                "{:<32} done in {:.1} s",
                format!("{}{channel}", scenario.name()),
                started.elapsed().as_secs_f64()
            );
        }
    }
    let events = sim.events_since(&mut conn, first_seq)?;
    let findings = sim.findings(&mut conn)?;
    let mut rows = Vec::new();
    for run in &runs {
        let seen = match &run.seen {
            Some(seen) => seen.clone(),
            None if run.skipped.is_some() => Vec::new(),
            None => sim.observe(run, &events, &findings)?,
        };
        rows.push(build_row(run, &seen, rewards));
    }
    print!("{}", if sim.verbose { render_table(&rows) } else { render_narrow_table(&rows) });
    let notes: Vec<&String> = runs.iter().flat_map(|r| &r.notes).collect();
    if !notes.is_empty() {
        print!(
            "\n{}",
            crate::table::wrap(
                "Before and after (the same buyers; before: for unwanted_money the same payonce with \
                 --refund-unwanted manual, for the others a payonce without platform settings, which closes \
                 expired orders itself, and the merchant's own code making each payment at the platform):",
                crate::table::NARROW_WIDTH,
                "",
                ""
            )
        );
        for note in notes {
            if sim.verbose {
                println!("  {note}");
            } else {
                print!("{}", crate::table::wrap(note, crate::table::NARROW_WIDTH, "  ", "    "));
            }
        }
    }
    // The verdict last, where a reader (and a CI log's tail) looks first.
    let skipped = rows.iter().filter(|r| r.skipped).count();
    let violated = rows.iter().filter(|r| !r.violations.is_empty()).count();
    let ok = rows.len() - skipped - violated;
    println!(
        "\n{} scenario runs: {ok} ok, {violated} with violations, {skipped} skipped ({} violations in all)",
        rows.len(),
        rows.iter().map(|r| r.violations.len()).sum::<usize>()
    );
    let _ = std::io::stdout().flush();
    Ok(if violated == 0 { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::judge::{points_due, reversals};
    use payonce::domain::Rewards;

    fn order(amount: i64) -> SimOrder {
        SimOrder { no: s("RUN-prg-0"), user: s("RUN-prg-0-u"), amount }
    }

    /// The in-process payonce's rule: 1 point per yuan.
    fn points(amount: i64) -> i64 {
        points_due(&Rewards { coupon_templates: vec![], points_per_yuan: 1 }, amount)
    }

    #[test]
    fn partial_refunds_reverse_floors_and_the_last_takes_what_is_left() {
        // 10.03 yuan earns 10 points. 3.01 yuan back is 3.001 points, 2.01
        // is 2.004: floored to 3 and 2. The 5.01 that empties the order would
        // floor to 4 (4.995); it takes the 5 left.
        assert_eq!(refund_shares(1_003), [301, 201, 501]);
        assert_eq!(reversals(points(1_003), 1_003, &refund_shares(1_003)), [-3, -2, -5]);
        assert_eq!(points(1_003) * 501 / 1_003, 4);
        assert_eq!(refund_shares(9_906), [2_972, 1_982, 4_952]);
        assert_eq!(reversals(points(9_906), 9_906, &refund_shares(9_906)), [-29, -19, -51]);

        // Every amount the simulator's orders have: three refunds of at least
        // a fen, three reversals of at least a point, summing to the points
        // earned, none of them a whole share.
        let sim = Sim::order_amount;
        for i in 0..630 {
            let amount = sim(i);
            let shares = refund_shares(amount);
            assert!(shares.iter().all(|fen| *fen > 0) && shares.iter().sum::<i64>() == amount, "{amount}: {shares:?}");
            let entries = reversals(points(amount), amount, &shares);
            assert!(entries.iter().all(|p| *p < 0), "{amount}: {entries:?}");
            assert_eq!(entries.iter().sum::<i64>(), -points(amount), "{amount}: {entries:?}");
            assert!(shares[..2].iter().all(|fen| points(amount) * fen % amount != 0), "{amount}: {shares:?}");
        }
    }

    #[test]
    fn a_refund_plan_is_three_refunds_one_failing_once_where_the_channel_can_say_so() {
        let said = |outcome: &str| s(outcome);
        let generic = RefundPlan::new(&order(1_003), "PAY-1", '-', Platform::Generic);
        let numbered: Vec<(&str, i64, bool)> =
            generic.refunds.iter().map(|r| (r.refund_no.as_str(), r.amount, r.fails)).collect();
        assert_eq!(
            numbered,
            [
                ("RUN-prg-0-R1", 301, false),
                ("RUN-prg-0-R2", 201, true),
                ("RUN-prg-0-R2b", 201, false),
                ("RUN-prg-0-R3", 501, false)
            ]
        );
        // The amount of the last is left out of its request: the whole balance.
        assert_eq!(generic.request_body(3), json!({"refund_no": "RUN-prg-0-R3"}));
        assert_eq!(generic.request_body(0)["amount"], 301);
        assert_eq!(
            generic.answers(&said),
            [
                "api:refunds 201 REFUNDING",
                "api:refunds 409 refund_in_progress",
                "refund applied",
                "refund duplicate",
                "api:refunds 409 refund_exceeds_balance",
                "api:refunds 201 REFUNDING",
                "refund refund_failed",
                "api:refunds 201 REFUNDING",
                "refund applied",
                "api:refunds 201 REFUNDING",
                "refund applied",
            ]
        );
        // Each notice: this refund's amount, the order's, and the running
        // total of the ones that succeeded.
        let notices: Vec<(i64, i64, i64, bool)> =
            (0..4).map(|k| generic.notice(k)).map(|n| (n.amount, n.total, n.refunded_total, n.success)).collect();
        assert_eq!(
            notices,
            [(301, 1_003, 301, true), (201, 1_003, 301, false), (201, 1_003, 502, true), (501, 1_003, 1_003, true)]
        );
        let expect = generic.expect(Vec::new());
        assert_eq!(expect.succeeded_refunds(1_003), [301, 201, 501]);
        assert_eq!((expect.status.as_str(), expect.refunded_amount), ("REFUNDED", Some(1_003)));
        let rows: Vec<String> = generic.rows().iter().map(|r| format!("{} {}", r.amount, r.status)).collect();
        assert_eq!(rows, ["301 SUCCEEDED", "201 FAILED", "201 SUCCEEDED", "501 SUCCEEDED"]);
        let events = |plan: &RefundPlan| -> Vec<(String, usize)> { plan.events() };
        assert_eq!(
            events(&generic),
            [
                (s("order.paid"), 1),
                (s("order.refunding"), 4),
                (s("order.partially_refunded"), 2),
                (s("order.refunded"), 1),
                (s("order.refund_failed"), 1)
            ]
        );

        // Alipay tells of no failed refund: the same refunds but the failing one.
        let alipay = RefundPlan::new(&order(1_003), "2088", '_', Platform::Alipay);
        let numbers: Vec<&str> = alipay.refunds.iter().map(|r| r.refund_no.as_str()).collect();
        assert_eq!(numbers, ["RUN-prg-0_R1", "RUN-prg-0_R2b", "RUN-prg-0_R3"]);
        assert_eq!(alipay.expect(Vec::new()).succeeded_refunds(1_003), [301, 201, 501]);
        assert_eq!(
            events(&alipay),
            [
                (s("order.paid"), 1),
                (s("order.refunding"), 3),
                (s("order.partially_refunded"), 2),
                (s("order.refunded"), 1)
            ]
        );
        assert!(!alipay.answers(&said).iter().any(|a| a.contains("refund_failed")));
        assert_eq!(alipay.notice(2).refunded_total, 1_003);
    }
}
