//! Asking the platforms: `sync` (every configured platform about an order,
//! a paid answer applied through the same exactly-once path as a callback,
//! source `query`); closing at the platform first (queued by the sweeper
//! or made at once by an explicit close, the local close once every
//! platform confirmed, the give-up and its resolution); refund submissions
//! and queries. This service is the platform-call pool's `Queue`
//! (`background.rs` runs its worker). Each call is a `platform_call` row
//! before it is made and is completed after it; no transaction spans a call.

use super::{close_in_tx, Core};
use crate::app::{PaymentCallback, RefundCallback, ACTOR_SYSTEM};
use crate::clock::{format_ms, parse_rfc3339_ms};
use crate::domain::AuditDetail;
use crate::domain::{
    IdempotencySlot, Order, OrderStatus, PlatformCallKind, PlatformCallStatus, PlatformStatus, RefundRecord,
    RefundStatus,
};
use crate::error::{Error, ErrorKind};
use crate::keylock::LockKey;
use crate::ops::Mode;
use crate::outgoing::{self, Claimed, Lease, PlatformAttempt, Queue, Schedule, Settle, Spent};
use crate::platform_ops::{PlatformAnswer, Synced};
use crate::platforms::SOURCE_QUERY;
use crate::platforms::{
    CloseAnswer, Exchange, RefundAnswer, RefundRequest, RefundState, TradeState, PLATFORM_WAITERS_MAX,
};
use crate::store::{NewPlatformCall, PlatformCallRow};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The most platform calls one pool job makes (a close: query, close, query).
const CALLS_PER_JOB_MAX: u64 = 3;
/// What a lease adds to its calls' timeouts, for the recording around them.
const LEASE_MARGIN_MS: u64 = 1_000;

#[derive(Clone, Copy)]
pub struct PlatformCalls<'a> {
    core: &'a Core,
}

/// Holds one of the [`PLATFORM_WAITERS_MAX`] places of API requests waiting on platforms.
pub(crate) struct WaitingPlace(Arc<AtomicUsize>);

impl WaitingPlace {
    pub(crate) fn take(waiting: &Arc<AtomicUsize>) -> Option<WaitingPlace> {
        waiting
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < PLATFORM_WAITERS_MAX).then_some(n + 1))
            .ok()
            .map(|_| WaitingPlace(Arc::clone(waiting)))
    }
}

impl Drop for WaitingPlace {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How one platform's part of a close ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CloseStep {
    /// The platform confirmed: closed, or no such trade.
    Confirmed,
    /// The platform said paid, and the payment was applied.
    Paid,
    /// Nothing confirmed: unreachable, unverified, or the buyer is paying right now.
    Unconfirmed,
}

fn platform_unavailable(order_no: &str) -> Error {
    Error::new(
        ErrorKind::PlatformUnavailable,
        format!("the payment platforms could not confirm the close of {order_no:?}; it stays PENDING and payonce keeps trying"),
    )
}

impl<'a> PlatformCalls<'a> {
    pub(crate) fn new(core: &'a Core) -> PlatformCalls<'a> {
        PlatformCalls { core }
    }

    /// Asks every configured platform about `order_no`, at once, each call
    /// bounded by `--platform-timeout-ms`; a paid answer is delivered as a
    /// payment with source `query` (a later callback of that pay_no is a
    /// duplicate). 404 `order_not_found` for an unknown order.
    pub fn sync_order(&self, order_no: &str) -> Result<Synced, Error> {
        self.core.orders().order(order_no)?;
        let platforms = &self.core.config().platforms;
        let mut asked: Vec<PlatformAnswer> = std::thread::scope(|scope| {
            let calls: Vec<_> = platforms
                .registry
                .callers()
                .map(|api| scope.spawn(move || self.ask(api.name(), order_no, |now| api.query(order_no, now))))
                .collect();
            calls
                .into_iter()
                .map(|c| c.join().unwrap_or_else(|_| Err(Error::internal("a platform query panicked"))))
                .collect::<Result<Vec<_>, Error>>()
        })?;
        for answer in &mut asked {
            // A platform's answer never makes payonce answer 4xx: an answer
            // the payment path refuses is no answer (docs/channels.md).
            if let Err(e) = self.apply_queried(answer, order_no) {
                let why = no_answer_if_refused(e)?;
                warn_unusable(answer.channel, order_no, &why);
                answer.state = TradeState::Unknown;
                answer.distrust = Some(why);
            }
        }
        Ok(Synced { order: self.core.orders().order(order_no)?.order, platforms: asked })
    }

    /// Why a close at `channel` cannot be confirmed yet, though the platform
    /// may say it has no trade: a payment's creation is in flight (it may
    /// make the trade after the close found none), or a request was signed
    /// for the buyer, who can open it, and so make the trade, until the
    /// order's `expires_at` (its `time_expire`: the platform refuses it
    /// after that, so the sweeper's close is never held; a platform clock
    /// behind payonce's by s seconds could still take a payment s seconds
    /// after the close, recorded as `paid_after_close`). services/prepays.rs
    /// writes both rows.
    fn payment_may_yet_be_created(
        &self,
        channel: &str,
        order_no: &str,
        now_ms: i64,
    ) -> Result<Option<&'static str>, Error> {
        let now = format_ms(now_ms);
        let (row, order) =
            self.core.store().read(|tx| Ok((tx.prepay_row(channel, order_no)?, tx.order_by_no(order_no)?)))?;
        let Some(row) = row else {
            return Ok(None);
        };
        if row.in_flight(&now) {
            return Ok(Some("a payment is being created at the platform"));
        }
        let signed_only = self
            .core
            .config()
            .platforms
            .registry
            .calls(channel)
            .is_some_and(|api| api.prepay_is_signed_only(&row.method));
        let payable_until = order.and_then(|o| parse_rfc3339_ms(&o.expires_at)).unwrap_or(0);
        if signed_only && now_ms < payable_until {
            return Ok(Some("a payment request signed for the buyer can still be opened until expires_at"));
        }
        Ok(None)
    }

    /// Asks `channel` about `order_no` and applies a paid answer (source
    /// `query`), as [`PlatformCalls::sync_order`] does for every platform:
    /// the order after it. For a payment's creation the platform refused
    /// because the trade is paid.
    pub(crate) fn sync_at(&self, channel: &'static str, order_no: &str) -> Result<Order, Error> {
        let platforms = &self.core.config().platforms;
        let answer = self.ask(channel, order_no, |now| {
            platforms.query(channel, order_no, now).unwrap_or_else(|| not_configured(channel))
        })?;
        if let Err(e) = self.apply_queried(&answer, order_no) {
            warn_unusable(channel, order_no, &no_answer_if_refused(e)?);
        }
        Ok(self.core.orders().order(order_no)?.order)
    }

    /// Queues the close at every configured platform of up to `batch`
    /// expired PENDING orders not queued yet (the sweeper's part when
    /// platforms are configured: it never waits on a platform). Returns how
    /// many orders it queued.
    pub fn queue_platform_closes(&self, batch: usize) -> Result<usize, Error> {
        let now = self.core.clock().now_text();
        let channels = self.core.config().platforms.channels();
        let due = self.core.store().read(|tx| tx.expired_pending_orders_unqueued(&now, batch))?;
        for order_no in &due {
            // Under the order's key, as a payment's creation begins: one of
            // the two comes first (services/prepays.rs).
            let key = self.core.locks().lock(LockKey::Order(order_no));
            self.core.store().write(&[&key], |tx| {
                for channel in &channels {
                    tx.enqueue_platform_close(channel, order_no, &now)?;
                }
                Ok(())
            })?;
        }
        Ok(due.len())
    }

    /// The platform-call pool's round: claims up to `limit` due calls and
    /// works each (at once, one thread each), a close then closing locally
    /// the orders every platform confirmed. Returns how many it worked.
    pub fn run_platform_calls_once(&self, limit: usize) -> Result<usize, Error> {
        Ok(outgoing::run_once(self, limit)?.len())
    }

    /// Claims the next attempt of a pending call, like every worker of it
    /// does (so the pool and an explicit close never work one row at once):
    /// the claim, or `None` when another holds it or it moved on.
    fn claim(&self, row: &PlatformCallRow) -> Result<Option<Claimed<PlatformCallRow>>, Error> {
        // A job makes at most three calls (a close: a query, the close, and a
        // query again after a "paid" refusal), each bounded by the timeout;
        // the lease outlasts them all, so no worker claims a row whose call
        // is still being made.
        let timeout_ms = self.core.config().platforms.timeout_ms;
        let lease_ms = timeout_ms.saturating_mul(CALLS_PER_JOB_MAX).saturating_add(LEASE_MARGIN_MS);
        let lease = Lease::new(self.core.clock().now_ms(), lease_ms);
        outgoing::claim(self.core.store(), row, &lease)
    }

    /// When a call whose attempt `attempt` did not settle is due again
    /// (`--platform-retry-s`, its last wait repeating; no jitter).
    fn retry_after_attempt(&self, attempt: i64, now_ms: i64) -> Settle<PlatformCallStatus> {
        let schedule = Schedule::new(&self.core.config().platforms.retry_schedule_ms, 0.0, Spent::RepeatLast);
        let at = schedule.next_attempt_at(now_ms, attempt, 0.0, None);
        Settle::Retry { at: at.unwrap_or_else(|| format_ms(now_ms)) }
    }

    /// The refund, while it still waits for its result here.
    fn unsettled_refund(&self, refund_no: &str) -> Result<Option<RefundRecord>, Error> {
        Ok(self.core.store().read(|tx| tx.refund_by_no(refund_no))?.filter(|r| r.status == RefundStatus::Requested))
    }

    /// One claimed refund submission: retried until the platform accepts it
    /// (the refund_no is its idempotency key there); once accepted, its
    /// query is queued for `--refund-query-after-s` later.
    fn work_refund(&self, call: &Claimed<PlatformCallRow>) -> Result<(), Error> {
        let row = &call.row;
        let refund_no = row.refund_no.clone().unwrap_or_default();
        // The refund, its order and, for a payment's refund, that payment,
        // read together: a payment's refund returns that payment, whole, in
        // the currency it came in, named by the platform's number for it.
        let read = self.core.store().read(|tx| {
            let Some(asked) = tx.refund_by_no(&refund_no)?.filter(|r| r.status == RefundStatus::Requested) else {
                return Ok(None);
            };
            let order = tx.order_by_id(asked.order_id)?;
            let payment = match asked.pay_no.as_deref() {
                Some(pay_no) => Some(
                    tx.callback_by_pay_no(pay_no)?
                        .ok_or_else(|| Error::internal(format!("refund {refund_no:?} names no payment {pay_no:?}")))?,
                ),
                None => None,
            };
            Ok(Some((asked, order, payment)))
        })?;
        let Some((asked, order, payment)) = read else {
            return self.record_attempt(call, DONE, "settled already".into(), None, "");
        };
        let now_ms = self.core.clock().now_ms();
        let platforms = &self.core.config().platforms;
        let refund = RefundRequest {
            order_no: &row.order_no,
            refund_no: &refund_no,
            amount: asked.amount,
            total: payment.as_ref().map_or(order.amount, |p| p.amount),
            currency: payment.as_ref().and_then(|p| p.currency.as_deref()).unwrap_or(&order.currency),
            reason: asked.reason.as_deref(),
            pay_no: asked.pay_no.as_deref(),
        };
        let Some(exchange) = platforms.refund(&row.channel, &refund, now_ms) else {
            return Ok(());
        };
        if exchange.meaning == RefundAnswer::NotSendable {
            // Failed for an operator to see: retrying cannot make it sendable.
            return self.record_exchange(call, Settle::Final(PlatformCallStatus::Failed), &exchange);
        }
        if exchange.meaning == RefundAnswer::Accepted {
            self.record_exchange(call, DONE, &exchange)?;
            let now = format_ms(now_ms);
            let query_at = format_ms(now_ms.saturating_add(platforms.refund_query_after_ms));
            self.core.store().write(&[], |tx| {
                tx.enqueue_platform_refund_call(
                    PlatformCallKind::RefundQuery,
                    &row.channel,
                    &row.order_no,
                    &refund_no,
                    &query_at,
                    &now,
                )
            })?;
            return Ok(());
        }
        self.record_exchange(call, self.retry_after_attempt(call.attempt, now_ms), &exchange)
    }

    /// One claimed refund query, for a refund whose result notification is
    /// late: a settled answer goes through `deliver_refund`, like the
    /// notification would; "not yet" is asked again on the schedule.
    fn work_refund_query(&self, call: &Claimed<PlatformCallRow>) -> Result<(), Error> {
        let row = &call.row;
        let refund_no = row.refund_no.clone().unwrap_or_default();
        let Some(asked) = self.unsettled_refund(&refund_no)? else {
            return self.record_attempt(call, DONE, "settled already".into(), None, "");
        };
        let now_ms = self.core.clock().now_ms();
        let platforms = &self.core.config().platforms;
        let pay_no = asked.pay_no.as_deref();
        let Some(exchange) = platforms.refund_query(&row.channel, &row.order_no, &refund_no, pay_no, now_ms) else {
            return Ok(());
        };
        if let RefundState::Settled(status) = exchange.meaning {
            self.core.refunds().deliver_refund(&RefundCallback {
                channel: row.channel.clone(),
                refund_no: refund_no.clone(),
                order_no: row.order_no.clone(),
                status,
                settled_at: None,
                amount: None,
                refunded_total: None,
            })?;
            return self.record_exchange(call, DONE, &exchange);
        }
        self.record_exchange(call, self.retry_after_attempt(call.attempt, now_ms), &exchange)
    }

    /// One claimed close row: ask, then apply or close at the platform, and
    /// record the attempt; then the local close once every platform
    /// confirmed, or, with `may_give_up`, once payonce gave up (an explicit
    /// close never gives up: it answers 503 instead).
    fn work_close(&self, call: &Claimed<PlatformCallRow>, may_give_up: bool) -> Result<CloseStep, Error> {
        let row = &call.row;
        let Some(order) = self.core.store().read(|tx| tx.order_by_no(&row.order_no))? else {
            self.record_attempt(call, DONE, "no such order".into(), None, "")?;
            return Ok(CloseStep::Confirmed);
        };
        // An order paid meanwhile (at another platform, or by a late
        // notification) is still closed at this platform: its trade there
        // stays open otherwise, and the buyer could pay it a second time.
        // The local close below acts on a PENDING order only.
        // A paid answer the payment path refuses counts as no answer: the
        // attempt is still recorded, with why, and the give-up still comes
        // on time. Only payonce's own failures (5xx) leave it to the lease.
        let (step, request, http_status, response) = match self.close_at(row.channel.as_str(), &row.order_no) {
            Ok(closed) => closed,
            Err(e) => {
                let why = no_answer_if_refused(e)?;
                warn_unusable(&row.channel, &row.order_no, &why);
                (CloseStep::Unconfirmed, format!("query {}", row.order_no), None, why)
            }
        };
        if step == CloseStep::Confirmed {
            crate::test_hooks::EnvHook::HoldAfterPlatformCloseMs.sleep();
        }
        match step {
            CloseStep::Confirmed | CloseStep::Paid => {
                self.record_attempt(call, DONE, response, http_status, &request)?;
                if step == CloseStep::Confirmed {
                    self.close_locally_if_confirmed(&row.order_no)?;
                }
            }
            CloseStep::Unconfirmed => {
                let now_ms = self.core.clock().now_ms();
                let expires_ms = parse_rfc3339_ms(&order.expires_at).unwrap_or(now_ms);
                if may_give_up && now_ms >= expires_ms.saturating_add(self.core.config().platforms.close_give_up_ms) {
                    let given_up = Settle::Final(PlatformCallStatus::GivenUp);
                    self.record_attempt(call, given_up, response, http_status, &request)?;
                    self.close_locally_given_up(&row.order_no)?;
                } else {
                    let retry = self.retry_after_attempt(call.attempt, now_ms);
                    self.record_attempt(call, retry, response, http_status, &request)?;
                }
            }
        }
        Ok(step)
    }

    /// Asks `channel` about the order and, unless it is paid (then applied)
    /// or the buyer is paying, closes it there. Returns how that ended and
    /// the close exchange (or the query's, when no close was sent).
    fn close_at(&self, channel: &str, order_no: &str) -> Result<(CloseStep, String, Option<u16>, String), Error> {
        let platforms = &self.core.config().platforms;
        let now_ms = self.core.clock().now_ms();
        let channel = platforms
            .registry
            .known(channel)
            .ok_or_else(|| Error::internal(format!("platform_call names an unknown channel {channel:?}")))?;
        if let Some(why) = self.payment_may_yet_be_created(channel, order_no, now_ms)? {
            return Ok((CloseStep::Unconfirmed, format!("query {order_no}"), None, why.to_owned()));
        }
        let answer = self.ask(channel, order_no, |now| {
            platforms.query(channel, order_no, now).unwrap_or_else(|| not_configured(channel))
        })?;
        match answer.state {
            TradeState::Paid { .. } => {
                self.apply_queried(&answer, order_no)?;
                return Ok((CloseStep::Paid, format!("query {order_no}"), None, "paid: applied".into()));
            }
            TradeState::Closed => {
                return Ok((CloseStep::Confirmed, format!("query {order_no}"), None, "closed".into()))
            }
            TradeState::NotPaid { paying: true } => {
                return Ok((CloseStep::Unconfirmed, format!("query {order_no}"), None, "the buyer is paying".into()))
            }
            TradeState::Unknown => {
                let why = answer.distrust.as_deref().unwrap_or("no answer");
                return Ok((
                    CloseStep::Unconfirmed,
                    format!("query {order_no}"),
                    None,
                    format!("the query got no answer: {why}"),
                ));
            }
            TradeState::NotPaid { paying: false } => {}
        }
        let exchange = platforms.close(channel, order_no, now_ms).unwrap_or_else(|| Exchange {
            request: String::new(),
            http_status: None,
            response: String::new(),
            meaning: CloseAnswer::Unknown,
            distrust: Some(format!("{channel} is not configured")),
        });
        let response = exchange.recorded_response();
        let step = match exchange.meaning {
            CloseAnswer::Closed => CloseStep::Confirmed,
            // Paid meanwhile: the next attempt queries again and applies it.
            CloseAnswer::Paid | CloseAnswer::Unknown => CloseStep::Unconfirmed,
        };
        if step == CloseStep::Unconfirmed && exchange.meaning == CloseAnswer::Paid {
            let again = self.ask(channel, order_no, |now| {
                platforms.query(channel, order_no, now).unwrap_or_else(|| not_configured(channel))
            })?;
            if matches!(again.state, TradeState::Paid { .. }) {
                self.apply_queried(&again, order_no)?;
                return Ok((CloseStep::Paid, exchange.request, exchange.http_status, response));
            }
        }
        Ok((step, exchange.request, exchange.http_status, response))
    }

    fn apply_queried(&self, answer: &PlatformAnswer, order_no: &str) -> Result<(), Error> {
        if let TradeState::Paid { pay_no, amount, currency, paid_at } = answer.state.clone() {
            let payment = PaymentCallback {
                channel: answer.channel.to_owned(),
                pay_no,
                order_no: order_no.to_owned(),
                amount,
                currency: Some(currency),
                status: PlatformStatus::Success,
                paid_at,
                raw_body: answer.answer.clone().into_bytes(),
            };
            self.core.payments().deliver_payment_from(&payment, SOURCE_QUERY)?;
        }
        Ok(())
    }

    /// [`PlatformCalls::record_attempt`] of a call's exchange: its request, status and
    /// answer (prefixed with why it is no answer, when it is none).
    fn record_exchange<T>(
        &self,
        call: &Claimed<PlatformCallRow>,
        settle: Settle<PlatformCallStatus>,
        exchange: &Exchange<T>,
    ) -> Result<(), Error> {
        let response = exchange.recorded_response();
        self.record_attempt(call, settle, response, exchange.http_status, &exchange.request)
    }

    /// Records how the claimed attempt ended (`outgoing::finish`).
    fn record_attempt(
        &self,
        call: &Claimed<PlatformCallRow>,
        settle: Settle<PlatformCallStatus>,
        response: String,
        http_status: Option<u16>,
        request: &str,
    ) -> Result<(), Error> {
        let now = self.core.clock().now_text();
        let row = &call.row;
        let attempt = PlatformAttempt { settle, request: request.to_owned(), http_status, response };
        // The platform's text must never decide whether the call's schedule
        // moves on: when it cannot be stored, the same state change is
        // recorded with payonce's own words (docs/operations.md, "Someone
        // else's bytes, and NUL bytes").
        let recorded = outgoing::finish(self.core.store(), call, &attempt, &now, |e| {
            crate::log::warn(
                "a platform call's answer could not be recorded as received; recording it without it",
                &[("order_no", &row.order_no), ("channel", &row.channel), ("error", e)],
            );
            let response = format!("the platform's answer could not be recorded: {e}");
            Some(PlatformAttempt { response, ..attempt.clone() })
        })?;
        if !recorded {
            crate::log::warn(
                "a platform call moved on during its call; its result is not recorded",
                &[("order_no", &row.order_no), ("channel", &row.channel)],
            );
            return Ok(());
        }
        let result = match &attempt.settle {
            Settle::Retry { .. } => "retried",
            Settle::Final(status) => status.as_str(),
        };
        self.core.metrics().observe_platform_call(row.kind, result);
        Ok(())
    }

    /// Platform calls pending in the database, every process's (a gauge of `/metrics`).
    pub fn pending(&self) -> Result<i64, Error> {
        self.core.store().read(|tx| tx.platform_calls_pending())
    }

    /// PENDING → CLOSED once every configured platform's close row is done,
    /// with the one `platform_closed` audit row (the CAS decides who writes it).
    fn close_locally_if_confirmed(&self, order_no: &str) -> Result<Option<Order>, Error> {
        let channels = self.core.config().platforms.channels();
        let key = self.core.locks().lock(LockKey::Order(order_no));
        let now = self.core.clock().now_text();
        self.core.store().write(&[&key], |tx| {
            let closes = tx.platform_closes_of_order(order_no)?;
            let confirmed =
                channels.iter().all(|c| closes.iter().any(|r| r.channel == *c && r.status == PlatformCallStatus::Done));
            let Some(order) = tx.order_by_no(order_no)? else {
                return Ok(None);
            };
            if !confirmed || order.status != OrderStatus::Pending {
                return Ok(None);
            }
            let closed = close_in_tx(tx, &order, &now)?;
            if closed.is_some() {
                let detail = AuditDetail::PlatformClosed { platforms: &channels };
                tx.audit(&now, ACTOR_SYSTEM, "platform_closed", Some(order_no), &detail)?;
            }
            Ok(closed)
        })
    }

    /// The local close after giving up on a platform's confirmation; the
    /// inspection reports `close_unconfirmed` until an operator resolves it.
    fn close_locally_given_up(&self, order_no: &str) -> Result<(), Error> {
        let key = self.core.locks().lock(LockKey::Order(order_no));
        let now = self.core.clock().now_text();
        self.core.store().write(&[&key], |tx| {
            let Some(order) = tx.order_by_no(order_no)? else {
                return Ok(());
            };
            if order.status == OrderStatus::Pending && close_in_tx(tx, &order, &now)?.is_some() {
                let closes = tx.platform_closes_of_order(order_no)?;
                let unconfirmed: Vec<&str> = closes
                    .iter()
                    .filter(|r| r.status != PlatformCallStatus::Done)
                    .map(|r| r.channel.as_str())
                    .collect();
                let detail = AuditDetail::CloseGivenUp { unconfirmed: &unconfirmed };
                tx.audit(&now, ACTOR_SYSTEM, "close_given_up", Some(order_no), &detail)?;
            }
            Ok(())
        })
    }

    /// An explicit close with platforms configured: every platform asked at
    /// once (bounded by the timeout), then the local close. A paid answer is
    /// applied and the close refused (409, the order PAID); a platform that
    /// cannot confirm is 503 `platform_unavailable`, the order still PENDING.
    pub fn close_order_at_platforms(&self, order_no: &str, slot: Option<&IdempotencySlot>) -> Result<Order, Error> {
        let order = self.core.orders().order(order_no)?.order;
        if order.status != OrderStatus::Pending {
            return self.core.orders().close_order_locally(order_no, slot);
        }
        let Some(_place) = WaitingPlace::take(&self.core.config().platforms.waiting) else {
            return Err(platform_unavailable(order_no));
        };
        let now = self.core.clock().now_text();
        let channels = self.core.config().platforms.channels();
        let key = self.core.locks().lock(LockKey::Order(order_no));
        self.core.store().write(&[&key], |tx| {
            for channel in &channels {
                tx.enqueue_platform_close(channel, order_no, &now)?;
            }
            Ok(())
        })?;
        drop(key);
        let closes = self.core.store().read(|tx| tx.platform_closes_of_order(order_no))?;
        let steps: Vec<CloseStep> = std::thread::scope(|scope| {
            let calls: Vec<_> = closes
                .iter()
                .map(|row| {
                    scope.spawn(move || -> Result<CloseStep, Error> {
                        if row.status == PlatformCallStatus::Done {
                            return Ok(CloseStep::Confirmed);
                        }
                        match self.claim(row)? {
                            Some(call) => self.work_close(&call, false),
                            None => Ok(CloseStep::Unconfirmed),
                        }
                    })
                })
                .collect();
            calls
                .into_iter()
                .map(|c| c.join().unwrap_or_else(|_| Err(Error::internal("a platform close panicked"))))
                .collect::<Result<Vec<_>, Error>>()
        })?;
        if steps.contains(&CloseStep::Paid) {
            return self.core.orders().close_order_locally(order_no, slot);
        }
        if steps.iter().all(|s| *s == CloseStep::Confirmed) {
            if let Some(closed) = self.close_locally_if_confirmed(order_no)? {
                return Ok(closed);
            }
            return self.core.orders().close_order_locally(order_no, slot);
        }
        Err(platform_unavailable(order_no))
    }

    /// An operator's word on an order closed without its platforms'
    /// confirmation (`close_unconfirmed`): audited once; a repeat answers 200.
    pub fn resolve_close(
        &self,
        order_no: &str,
        reason: &str,
        actor: &str,
        slot: Option<&IdempotencySlot>,
    ) -> Result<Order, Error> {
        if reason.trim().is_empty() || reason.len() > crate::ops::REASON_BYTES_MAX {
            return Err(Error::invalid(format!("reason is required, at most {} bytes", crate::ops::REASON_BYTES_MAX)));
        }
        let key = self.core.locks().lock(LockKey::Order(order_no));
        let now = self.core.clock().now_text();
        self.core.write_op(&[&key], slot, |tx| {
            let order = tx.order_by_no(order_no)?.ok_or_else(|| Error::order_not_found(order_no))?;
            if tx.close_resolution(order_no)?.is_some() {
                return Ok(order);
            }
            let given_up =
                tx.platform_closes_of_order(order_no)?.into_iter().any(|r| r.status == PlatformCallStatus::GivenUp);
            if !given_up {
                return Err(Error::invalid_transition(format!(
                    "order {order_no:?} has no unconfirmed close to resolve"
                )));
            }
            tx.audit(&now, actor, "close_resolved", Some(order_no), &AuditDetail::CloseResolved { reason })?;
            Ok(order)
        })
    }

    /// One query to one platform, recorded in `platform_call` before and after.
    fn ask(
        &self,
        channel: &'static str,
        order_no: &str,
        query: impl FnOnce(i64) -> Exchange<TradeState>,
    ) -> Result<PlatformAnswer, Error> {
        let now_ms = self.core.clock().now_ms();
        let now = format_ms(now_ms);
        let timeout_ms = i64::try_from(self.core.config().platforms.timeout_ms).unwrap_or(i64::MAX);
        let lease_until = format_ms(now_ms.saturating_add(timeout_ms));
        let request = format!("query {order_no}");
        let call = NewPlatformCall {
            channel,
            kind: PlatformCallKind::Query,
            order_no,
            refund_no: None,
            request: &request,
            now: &now,
            lease_until: &lease_until,
        };
        let id = self.core.store().write(&[], |tx| tx.insert_platform_call(&call))?;
        let exchange = query(now_ms);
        let row = PlatformCallRow {
            id,
            channel: channel.to_owned(),
            kind: PlatformCallKind::Query,
            order_no: order_no.to_owned(),
            refund_no: None,
            status: PlatformCallStatus::Pending,
            attempts: 1,
            next_attempt_at: Some(lease_until.clone()),
        };
        let status = if exchange.distrust.is_none() { PlatformCallStatus::Done } else { PlatformCallStatus::Failed };
        // Inserted with its first attempt in flight: this one.
        self.record_exchange(&Claimed { row, attempt: 1 }, Settle::Final(status), &exchange)?;
        if let Some(why) = &exchange.distrust {
            crate::log::warn(
                "platform query unanswered",
                &[("channel", &channel), ("order_no", &order_no), ("why", why)],
            );
        }
        Ok(PlatformAnswer { channel, state: exchange.meaning, answer: exchange.response, distrust: exchange.distrust })
    }
}

/// The platform-call pool's queue (`background.rs` runs its worker): the
/// due `platform_call` rows of the kinds it works, while the mode is normal.
impl Queue for PlatformCalls<'_> {
    type Job = Claimed<PlatformCallRow>;
    type Done = ();
    const ROUND_FAILED: &'static str = "platform calls failed, will retry";

    fn ready(&self) -> bool {
        self.core.store().check_storage().is_ok() && matches!(self.core.operations().mode(), Ok(Mode::Normal))
    }

    fn claim_due(&self, limit: usize) -> Result<Vec<Claimed<PlatformCallRow>>, Error> {
        let now = self.core.clock().now_text();
        let due = self.core.store().read(|tx| tx.due_platform_calls(&now, limit))?;
        Ok(due.iter().filter_map(|row| self.claim(row).ok().flatten()).collect())
    }

    fn work(&self, call: &Claimed<PlatformCallRow>) {
        let row = &call.row;
        let worked = match row.kind {
            PlatformCallKind::Close => self.work_close(call, true).map(drop),
            PlatformCallKind::Refund => self.work_refund(call),
            PlatformCallKind::RefundQuery => self.work_refund_query(call),
            // Made at once by the request that needs them, recorded, never
            // queued: not the pool's (`due_platform_calls` never returns one).
            PlatformCallKind::Query | PlatformCallKind::Prepay => {
                let why = format!("platform call {} is a {}: never queued", row.id, row.kind.as_str());
                crate::log::error("platform call of a kind the pool never works", &[("why", &why)]);
                Err(Error::internal(why))
            }
        };
        if let Err(e) = worked {
            crate::log::warn(
                "platform call failed, will retry",
                &[("kind", &row.kind.as_str()), ("order_no", &row.order_no), ("channel", &row.channel), ("error", &e)],
            );
        }
    }
}

/// An attempt that settled the call.
const DONE: Settle<PlatformCallStatus> = Settle::Final(PlatformCallStatus::Done);

/// `Ok(why)` for a refusal of the payment path (a 4xx: the answer was
/// unusable), `Err` for payonce's own failure, which keeps its status.
fn no_answer_if_refused(e: Error) -> Result<String, Error> {
    if e.is_server_error() {
        return Err(e);
    }
    Ok(format!("the platform's paid answer is unusable: {}", e.message))
}

fn warn_unusable(channel: &str, order_no: &str, why: &str) {
    crate::log::warn("platform answer unusable", &[("channel", &channel), ("order_no", &order_no), ("why", &why)]);
}

fn not_configured(channel: &str) -> Exchange<TradeState> {
    Exchange::unknown(String::new(), None, String::new(), format!("{channel} is not configured"), TradeState::Unknown)
}
