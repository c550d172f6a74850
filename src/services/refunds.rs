//! Refunds: a refund requested (and its submission to the platform queued
//! with it), refund results delivered exactly once per refund_no, and the
//! resolution of an unexpected refund.

use super::{refuse_transition, validate_resolution, Core};
use crate::app::{RefundCallback, ACTOR_SYSTEM};
use crate::domain::{
    is_identifier, payment_refund_no, AuditDetail, CallbackRecord, EventData, EventType, IdempotencySlot, Order,
    OrderStatus, PaymentOutcome, PlatformCallKind, PlatformStatus, RefundOutcome, RefundRecord, RefundStatus, Refused,
};
use crate::error::{Error, ErrorKind};
use crate::keylock::LockKey;
use crate::ops::{PaymentRefund, RefundRequested, RefundResolution};
use crate::store::{NewRefund, WriteTx};
use serde_json::Value;

#[derive(Clone, Copy)]
pub struct Refunds<'a> {
    core: &'a Core,
}

impl<'a> Refunds<'a> {
    pub(crate) fn new(core: &'a Core) -> Refunds<'a> {
        Refunds { core }
    }

    /// `POST /v1/orders/{order_no}/refund`: a refund of the whole balance,
    /// answered with the order as before. The same refund_no again answers
    /// the order; the refusals of a refund by amount that the whole balance
    /// meets (one in flight, none left) are this route's 409
    /// `invalid_transition`, as they always were.
    pub fn request_refund(&self, order_no: &str, refund_no: &str) -> Result<Order, Error> {
        self.request_refund_keyed(order_no, refund_no, None)
    }

    pub fn request_refund_keyed(
        &self,
        order_no: &str,
        refund_no: &str,
        slot: Option<&IdempotencySlot>,
    ) -> Result<Order, Error> {
        let asked = AskedRefund { order_no, refund_no, amount: None, reason: None, whole_route: true };
        Ok(self.request_refund_of(&asked, slot)?.order)
    }

    /// `POST /v1/orders/{order_no}/refunds`: a refund of `amount` (the
    /// whole balance when `None`), PAID→REFUNDING with its `refund` row
    /// REQUESTED and its submission to the platform queued, in one
    /// transaction whose compare-and-set cannot take more than the balance.
    /// The same refund_no with the same order and amount answers the
    /// current order and refund (200).
    pub fn request_refund_amount(
        &self,
        order_no: &str,
        refund_no: &str,
        amount: Option<i64>,
        reason: Option<&str>,
        slot: Option<&IdempotencySlot>,
    ) -> Result<RefundRequested, Error> {
        let asked = AskedRefund { order_no, refund_no, amount, reason, whole_route: false };
        self.request_refund_of(&asked, slot)
    }

    fn request_refund_of(&self, asked: &AskedRefund, slot: Option<&IdempotencySlot>) -> Result<RefundRequested, Error> {
        let AskedRefund { order_no, refund_no, amount, reason, .. } = *asked;
        if !is_identifier(refund_no) {
            return Err(Error::invalid("refund_no must be 1-64 characters of [A-Za-z0-9_.-]"));
        }
        if amount.is_some_and(|a| a < 1) {
            return Err(Error::invalid("amount must be at least 1 (minor units)"));
        }
        if let Some(reason) = reason {
            validate_refund_reason(reason)?;
        }
        // The order's key first: two refunds of one order (different
        // refund_nos) are decided one after the other, so the loser reads the
        // winner's REFUNDING and is told `refund_in_progress` on every engine.
        let order_key = self.core.locks().lock(LockKey::Order(order_no));
        let key = self.core.locks().lock(LockKey::Refund(refund_no));
        let now = self.core.clock().now_text();
        self.core.write_op(&[&order_key, &key], slot, |tx| {
            let order = tx.order_by_no(order_no)?.ok_or_else(|| Error::order_not_found(order_no))?;
            if let Some(existing) = tx.refund_by_no(refund_no)? {
                return replay(tx, asked, &order, existing, &now);
            }
            let detail = Refused::Refund { refund_no };
            let balance = order.amount - order.refunded_amount;
            match order.status {
                OrderStatus::Paid => {}
                OrderStatus::Refunding if !asked.whole_route => {
                    refuse_transition(tx, &order, OrderStatus::Refunding, "refund", &now, detail)?;
                    return Err(Error::new(
                        ErrorKind::RefundInProgress,
                        format!("order {order_no:?} has a refund in flight; ask again once it settles"),
                    ));
                }
                _ => return Err(refuse_transition(tx, &order, OrderStatus::Refunding, "refund", &now, detail)?),
            }
            if tx.refunds_of_order(order.id)?.len() >= REFUNDS_PER_ORDER_MAX {
                return Err(Error::new(
                    ErrorKind::RefundLimitReached,
                    format!("order {order_no:?} has {REFUNDS_PER_ORDER_MAX} refunds, the platforms' limit"),
                ));
            }
            let amount = amount.unwrap_or(balance);
            if amount > balance {
                return Err(Error::new(
                    ErrorKind::RefundExceedsBalance,
                    format!("order {order_no:?} has {balance} left to refund; {amount} is more"),
                ));
            }
            if !tx.cas_order_refunding(order.id, refund_no, amount)? {
                return Err(refuse_transition(tx, &order, OrderStatus::Refunding, "refund", &now, detail)?);
            }
            let new = NewRefund { refund_no, order_id: order.id, amount, reason, pay_no: None, now: &now };
            if !tx.insert_refund(&new)? {
                return Err(Error::internal(format!("refund_no {refund_no} appeared inside its own transaction")));
            }
            // The submission to the platform that took the payment is queued
            // with the request, in its transaction: it cannot be lost.
            let took = tx.callbacks_of_order(order.id)?.into_iter().find(|p| p.outcome == PaymentOutcome::Applied);
            if let Some(channel) = took.map(|p| p.channel).filter(|c| self.calls_configured(c)) {
                tx.enqueue_platform_refund_call(PlatformCallKind::Refund, &channel, order_no, refund_no, &now, &now)?;
            }
            let refunding = tx.order_by_id(order.id)?;
            let refund = tx.refund_by_no(refund_no)?.ok_or_else(|| Error::internal("the refund just written"))?;
            let data = EventData::Refund { order: &refunding, refund_no, status: RefundStatus::Requested, amount };
            tx.emit_event(EventType::OrderRefunding, &format!("{order_no}/{refund_no}"), order_no, &data, &now)?;
            Ok(RefundRequested { order: refunding, refund, created: true, order_only: asked.whole_route })
        })
    }

    /// Whether payonce makes calls to `channel` (refunds among them).
    fn calls_configured(&self, channel: &str) -> bool {
        self.core.config().platforms.channels().contains(&channel)
    }

    // ---- refunds of payments payonce did not want ----

    /// `POST /v1/admin/payments/{pay_no}/refund`: the whole amount of a
    /// refund-required payment returned at the platform that took it, by a
    /// refund of its own (refund_no [`payment_refund_no`]), submitted through
    /// the durable queue. While that refund is REQUESTED or once it
    /// SUCCEEDED, the same request answers it again; after a FAILED one, the
    /// next attempt has the next number.
    pub fn refund_payment(
        &self,
        pay_no: &str,
        reason: &str,
        actor: &str,
        slot: Option<&IdempotencySlot>,
    ) -> Result<PaymentRefund, Error> {
        validate_refund_reason(reason)?;
        // The payment's key: its decision, its resolution and its refunds
        // are decided one after the other.
        let key = self.core.locks().lock(LockKey::Pay(pay_no));
        let now = self.core.clock().now_text();
        self.core.write_op(&[&key], slot, |tx| {
            let payment = tx
                .callback_by_pay_no(pay_no)?
                .ok_or_else(|| Error::new(ErrorKind::PaymentNotFound, format!("no payment with pay_no {pay_no:?}")))?;
            let order = tx.order_by_id(payment.order_id)?;
            let mut refunds = tx.refunds_of_payment(order.id, pay_no)?;
            let standing = refunds.iter().rev().find(|r| r.status != RefundStatus::Failed).cloned();
            let refund = match standing {
                Some(refund) => refund,
                None => {
                    if !payment.outcome.requires_refund() || payment.resolution.is_some() {
                        return Err(Error::invalid_transition(format!(
                            "payment {pay_no} is {}{}, not refund-required",
                            payment.outcome.as_str(),
                            payment.resolution.as_deref().map(|r| format!(" and resolved {r}")).unwrap_or_default(),
                        )));
                    }
                    if !self.calls_configured(&payment.channel) {
                        return Err(Error::new(
                            ErrorKind::ChannelNotConfigured,
                            format!(
                                "payonce makes no calls to {}: refund payment {pay_no} there, then resolve it",
                                payment.channel
                            ),
                        ));
                    }
                    let asked = AskedPaymentRefund { payment: &payment, order_no: &order.order_no, reason, actor };
                    let refund = start_payment_refund(tx, &asked, refunds.len() + 1, &now)?.map_err(|taken| {
                        Error::new(
                            ErrorKind::RefundNoConflict,
                            format!("refund_no {taken:?}, this payment's refund number, is another refund's"),
                        )
                    })?;
                    // A new refund changes nothing of the payment row itself.
                    refunds.push(refund.clone());
                    refund
                }
            };
            Ok(PaymentRefund { payment, refunds, order_no: order.order_no, refund })
        })
    }

    /// With `--refund-unwanted auto`, inside the transaction that decided
    /// `payment` refund-required: its refund requested, when payonce makes
    /// calls to its channel. A refund number already taken (by a merchant's
    /// own refund) leaves it refund-required for an operator.
    pub(crate) fn refund_unwanted_in(
        &self,
        tx: &WriteTx,
        payment: &CallbackRecord,
        order_no: &str,
        now: &str,
    ) -> Result<(), Error> {
        if !self.calls_configured(&payment.channel) {
            return Ok(());
        }
        let attempt = tx.refunds_of_payment(payment.order_id, &payment.pay_no)?.len() + 1;
        let reason = unwanted_reason(payment.outcome);
        let asked = AskedPaymentRefund { payment, order_no, reason, actor: ACTOR_SYSTEM };
        if let Err(taken) = start_payment_refund(tx, &asked, attempt, now)? {
            crate::log::warn(
                "unwanted payment left for an operator",
                &[("pay_no", &payment.pay_no), ("refund_no", &taken), ("why", &"its refund_no is another refund's")],
            );
        }
        Ok(())
    }

    // ---- refund callbacks ----

    /// Delivers a verified refund result, exactly once per refund_no.
    pub fn deliver_refund(&self, cb: &RefundCallback) -> Result<RefundOutcome, Error> {
        self.deliver_refund_of(cb, RefundOf::Named)
    }

    /// Delivers a refund result that names no refund request: it settles
    /// the order's refund in flight, read inside the refund's transaction,
    /// or, when the order has none, is the refund `cb.refund_no`.
    pub fn deliver_refund_in_flight(&self, cb: &RefundCallback) -> Result<RefundOutcome, Error> {
        self.deliver_refund_of(cb, RefundOf::InFlight)
    }

    fn deliver_refund_of(&self, cb: &RefundCallback, of: RefundOf) -> Result<RefundOutcome, Error> {
        let outcome = self.deliver_refund_once(cb, of)?;
        self.core.metrics().observe_callback("refund", outcome.as_str());
        if outcome == RefundOutcome::Duplicate {
            self.core.metrics().observe_duplicate("callback");
        }
        Ok(outcome)
    }

    fn deliver_refund_once(&self, cb: &RefundCallback, of: RefundOf) -> Result<RefundOutcome, Error> {
        validate_refund(cb)?;
        // An in-flight refund's own refund_no is known only inside the
        // transaction; its key is the notice's (the trade's), so re-deliveries
        // of one notice still queue here, and the settle CAS decides the rest.
        let refund_key = self.core.locks().lock(LockKey::Refund(&cb.refund_no));
        let now = self.core.clock().now_text();
        self.core.store().write(&[&refund_key], |tx| {
            let order = tx.order_by_no(&cb.order_no)?.ok_or_else(|| Error::order_not_found(&cb.order_no))?;
            let in_flight;
            // A result naming a trade whose payment has its own refund in
            // flight is that refund's (the trade is that payment's, not the order's).
            let payment_refund = match of {
                RefundOf::InFlight => tx
                    .refunds_of_payment(order.id, &cb.refund_no)?
                    .into_iter()
                    .find(|r| r.status == RefundStatus::Requested),
                RefundOf::Named => None,
            };
            let cb = match (of, order.status, &order.refund_no) {
                _ if payment_refund.is_some() => {
                    let refund_no = payment_refund.map(|r| r.refund_no).unwrap_or_default();
                    in_flight = RefundCallback { refund_no, ..cb.clone() };
                    &in_flight
                }
                (RefundOf::InFlight, OrderStatus::Refunding, Some(refund_no)) => {
                    in_flight = RefundCallback { refund_no: refund_no.clone(), ..cb.clone() };
                    &in_flight
                }
                _ => cb,
            };
            let refund = tx.refund_by_no(&cb.refund_no)?.filter(|r| r.order_id == order.id);
            let Some(refund) = refund else {
                return unexpected_refund(tx, &order, cb, None, &now);
            };
            if let Some(pay_no) = refund.pay_no.as_deref() {
                return settle_payment_refund(tx, &order, cb, &refund, pay_no, &now);
            }
            let (settle_to, outcome) = match settling(tx, &order, cb, &refund, &now)? {
                Ok(settling) => settling,
                Err(answered) => return Ok(answered),
            };
            if settle_to == RefundStatus::Succeeded {
                if let Some(stated) = mismatched_amount(cb, order.refunded_amount, &refund) {
                    return amount_mismatch(tx, &order, cb, &refund, stated, &now);
                }
            }
            // Only a success has a platform settlement time worth keeping.
            let platform_settled_at = cb.settled_at.as_deref().filter(|_| settle_to == RefundStatus::Succeeded);
            if !tx.settle_refund(refund.id, settle_to, &now, platform_settled_at)? {
                return Err(Error::internal(format!("refund {} changed inside its transaction", cb.refund_no)));
            }
            // The database added a success to refunded_amount: read it back.
            let settled = tx.order_by_id(order.id)?;
            let whole = settled.refunded_amount == settled.amount;
            let moved = match outcome {
                RefundOutcome::Applied if whole => tx.cas_order_refunded(order.id, &cb.refund_no, &now)?,
                _ => tx.cas_order_refund_failed(order.id, &cb.refund_no)?,
            };
            if !moved {
                // A REQUESTED refund always has its order REFUNDING (uk_refund_requested,
                // the CAS in request_refund); anything else is a bug: roll back.
                return Err(Error::internal(format!("order {} is not REFUNDING for {}", order.order_no, cb.refund_no)));
            }
            let event_type = match outcome {
                RefundOutcome::Applied => {
                    reverse_points_of(tx, &settled, &refund, whole, &now)?;
                    if whole {
                        tx.freeze_active_coupons(order.id)?;
                        EventType::OrderRefunded
                    } else {
                        EventType::OrderPartiallyRefunded
                    }
                }
                _ => EventType::OrderRefundFailed,
            };
            let current = tx.order_by_id(order.id)?;
            let data = EventData::Refund {
                order: &current,
                refund_no: &cb.refund_no,
                status: settle_to,
                amount: refund.amount,
            };
            let subject = format!("{}/{}", order.order_no, cb.refund_no);
            tx.emit_event(event_type, &subject, &order.order_no, &data, &now)?;
            Ok(outcome)
        })
    }

    /// Marks an `unexpected_refund` as handled, once.
    pub fn resolve_refund(
        &self,
        refund_no: &str,
        resolution: &str,
        reason: &str,
        actor: &str,
        slot: Option<&IdempotencySlot>,
    ) -> Result<RefundResolution, Error> {
        validate_resolution(resolution, reason)?;
        let key = self.core.locks().lock(LockKey::Refund(refund_no));
        let now = self.core.clock().now_text();
        self.core.write_op(&[&key], slot, |tx| {
            let answer = |at: &str, detail: &Value| {
                let text = |name: &str| detail[name].as_str().map(str::to_owned);
                RefundResolution {
                    refund_no: refund_no.to_owned(),
                    resolution: text("resolution"),
                    reason: text("reason"),
                    resolved_at: at.to_owned(),
                }
            };
            if let Some(first) = tx.refund_audit("unexpected_refund_resolved", refund_no)?.first() {
                let detail: Value = serde_json::from_str(&first.detail).unwrap_or(Value::Null);
                return Ok(answer(&first.at, &detail));
            }
            let mut unexpected = tx.refund_audit("unexpected_refund", refund_no)?;
            unexpected.extend(tx.refund_audit("refund_amount_mismatch", refund_no)?);
            unexpected.sort_by_key(|row| row.id);
            let Some(first) = unexpected.first() else {
                if tx.refund_by_no(refund_no)?.is_some() {
                    return Err(Error::invalid_transition(format!(
                        "refund {refund_no} has no unexpected result to resolve"
                    )));
                }
                return Err(Error::new(ErrorKind::RefundNotFound, format!("no refund with refund_no {refund_no:?}")));
            };
            let detail = AuditDetail::UnexpectedRefundResolved { refund_no, resolution, reason };
            tx.audit(&now, actor, "unexpected_refund_resolved", first.order_no.as_deref(), &detail)?;
            let (resolution, reason) = (Some(resolution.to_owned()), Some(reason.to_owned()));
            Ok(RefundResolution { resolution, reason, ..answer(&now, &Value::Null) })
        })
    }
}

/// Which refund a refund result settles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RefundOf {
    /// The one its `refund_no` names.
    Named,
    /// The order's refund in flight, else its `refund_no`.
    InFlight,
}

/// A refund result payonce did not ask for, or one contradicting a settled
/// refund: recorded in `audit_log` for an operator.
fn unexpected_refund(
    tx: &WriteTx,
    order: &Order,
    cb: &RefundCallback,
    settled: Option<RefundStatus>,
    now: &str,
) -> Result<RefundOutcome, Error> {
    let detail = AuditDetail::UnexpectedRefund {
        refund_no: &cb.refund_no,
        channel: &cb.channel,
        status: cb.status,
        settled_status: settled,
        order_status: order.status,
    };
    tx.audit(now, ACTOR_SYSTEM, "unexpected_refund", Some(&order.order_no), &detail)?;
    Ok(RefundOutcome::UnexpectedRefund)
}

fn validate_refund(cb: &RefundCallback) -> Result<(), Error> {
    if !is_identifier(&cb.refund_no) {
        return Err(Error::invalid("refund_no must be 1-64 characters of [A-Za-z0-9_.-]"));
    }
    if !is_identifier(&cb.order_no) {
        return Err(Error::invalid("order_no must be 1-64 characters of [A-Za-z0-9_.-]"));
    }
    // Stored times sort as text only in payonce's one format.
    if let Some(at) = &cb.settled_at {
        if crate::clock::parse_rfc3339_ms(at).map(crate::clock::format_ms).as_ref() != Some(at) {
            return Err(Error::invalid("a refund's settled_at must be YYYY-MM-DDTHH:MM:SS.sssZ"));
        }
    }
    Ok(())
}

/// A refund as asked, by either route.
#[derive(Clone, Copy)]
struct AskedRefund<'a> {
    order_no: &'a str,
    refund_no: &'a str,
    amount: Option<i64>,
    reason: Option<&'a str>,
    /// The whole-order route (`/refund`), answered as it always was.
    whole_route: bool,
}

/// `reason`: the platforms' limit (WeChat `reason`, Alipay `refund_reason`).
const REASON_CHARS_MAX: usize = 80;

/// A refund's `reason`, which the platform shows the buyer.
fn validate_refund_reason(reason: &str) -> Result<(), Error> {
    if reason.trim().is_empty() || reason.chars().count() > REASON_CHARS_MAX || reason.chars().any(char::is_control) {
        return Err(Error::invalid(format!(
            "reason must be 1-{REASON_CHARS_MAX} characters, without control characters"
        )));
    }
    Ok(())
}

/// The reason payonce gives the buyer when it returns a payment by itself,
/// in the language of the platforms' buyers (the platform shows it with
/// the refund).
fn unwanted_reason(outcome: PaymentOutcome) -> &'static str {
    match outcome {
        PaymentOutcome::PaidAfterClose => "订单已关闭，款项全额退回",
        PaymentOutcome::AmountMismatch => "支付金额与订单不符，款项全额退回",
        _ => "重复支付，款项全额退回",
    }
}

/// A refund of a refund-required payment, as asked.
struct AskedPaymentRefund<'a> {
    payment: &'a CallbackRecord,
    order_no: &'a str,
    reason: &'a str,
    actor: &'a str,
}

/// Requests attempt `attempt` of returning `asked.payment`, in the caller's
/// transaction: its refund REQUESTED (the database checks it returns an
/// unresolved refund-required payment of that order, whole, and that no
/// other refund of it is in flight or succeeded), its submission queued,
/// its audit row written. `Ok(Err(refund_no))` when that number is taken.
fn start_payment_refund(
    tx: &WriteTx,
    asked: &AskedPaymentRefund,
    attempt: usize,
    now: &str,
) -> Result<Result<RefundRecord, String>, Error> {
    let payment = asked.payment;
    let refund_no = payment_refund_no(&payment.pay_no, attempt);
    if tx.refund_by_no(&refund_no)?.is_some() {
        return Ok(Err(refund_no));
    }
    let new = NewRefund {
        refund_no: &refund_no,
        order_id: payment.order_id,
        amount: payment.amount,
        reason: Some(asked.reason),
        pay_no: Some(&payment.pay_no),
        now,
    };
    if !tx.insert_refund(&new)? {
        return Err(tx.stale_read(&format!("refund_no {refund_no} was taken by a concurrent transaction")));
    }
    tx.enqueue_platform_refund_call(PlatformCallKind::Refund, &payment.channel, asked.order_no, &refund_no, now, now)?;
    let detail = AuditDetail::PaymentRefundRequested {
        pay_no: &payment.pay_no,
        refund_no: &refund_no,
        amount: payment.amount,
        reason: asked.reason,
    };
    tx.audit(now, asked.actor, "payment_refund_requested", Some(asked.order_no), &detail)?;
    let refund = tx.refund_by_no(&refund_no)?.ok_or_else(|| Error::internal("the refund just written"))?;
    Ok(Ok(refund))
}

/// A result of a payment's own refund: SUCCEEDED resolves the payment
/// `refunded` (audit `payment_refunded`, event `payment.refunded`); FAILED
/// leaves it refund-required, the failure on the refund and in the audit.
/// The order, its balance and its rewards are not touched.
fn settle_payment_refund(
    tx: &WriteTx,
    order: &Order,
    cb: &RefundCallback,
    refund: &RefundRecord,
    pay_no: &str,
    now: &str,
) -> Result<RefundOutcome, Error> {
    let (settle_to, outcome) = match settling(tx, order, cb, refund, now)? {
        Ok(settling) => settling,
        Err(answered) => return Ok(answered),
    };
    // The payment's trade is refunded by this refund alone: nothing was
    // refunded of it before (Alipay's running refund_fee is this refund's amount).
    let stated = mismatched_amount(cb, 0, refund);
    if let (RefundStatus::Succeeded, Some(stated)) = (settle_to, stated) {
        return amount_mismatch(tx, order, cb, refund, stated, now);
    }
    let platform_settled_at = cb.settled_at.as_deref().filter(|_| settle_to == RefundStatus::Succeeded);
    if !tx.settle_refund(refund.id, settle_to, now, platform_settled_at)? {
        return Err(Error::internal(format!("refund {} changed inside its transaction", refund.refund_no)));
    }
    let payment = tx
        .callback_by_pay_no(pay_no)?
        .ok_or_else(|| Error::internal(format!("refund {} names no payment {pay_no}", refund.refund_no)))?;
    let detail = AuditDetail::PaymentRefundSettled { pay_no, refund_no: &refund.refund_no, amount: refund.amount };
    if settle_to == RefundStatus::Failed {
        tx.audit(now, ACTOR_SYSTEM, "payment_refund_failed", Some(&order.order_no), &detail)?;
        return Ok(outcome);
    }
    let reason = refund.reason.as_deref().unwrap_or("refunded");
    // Nobody resolves a payment while its refund is in flight (resolve
    // refuses it); the CAS keeps a resolution that came first all the same.
    if tx.resolve_payment(payment.id, "refunded", reason, now)? {
        let data = EventData::PaymentRefunded { order, payment: &payment, refund_no: &refund.refund_no };
        tx.emit_event(EventType::PaymentRefunded, pay_no, &order.order_no, &data, now)?;
    }
    tx.audit(now, ACTOR_SYSTEM, "payment_refunded", Some(&order.order_no), &detail)?;
    Ok(outcome)
}
/// Refunds per order, every refund_no counted (WeChat Pay's limit is 50).
const REFUNDS_PER_ORDER_MAX: usize = 50;

/// The same refund_no again: the current order and refund when it names
/// this order's refund of the same amount (an omitted amount is the one the
/// first request took), else 409 `refund_no_conflict`.
fn replay(
    tx: &WriteTx,
    asked: &AskedRefund,
    order: &Order,
    existing: RefundRecord,
    now: &str,
) -> Result<RefundRequested, Error> {
    let same = existing.order_id == order.id
        && existing.pay_no.is_none()
        && asked.amount.is_none_or(|amount| amount == existing.amount);
    if same && !(asked.whole_route && existing.status == RefundStatus::Failed) {
        return Ok(RefundRequested {
            order: order.clone(),
            refund: existing,
            created: false,
            order_only: asked.whole_route,
        });
    }
    if asked.whole_route {
        // The whole-order route's answer to a refund_no it cannot take.
        let detail = Refused::Refund { refund_no: asked.refund_no };
        return Err(refuse_transition(tx, order, OrderStatus::Refunding, "refund", now, detail)?);
    }
    Err(Error::new(
        ErrorKind::RefundNoConflict,
        format!("refund_no {:?} is a refund of {} of another order or amount", asked.refund_no, existing.amount),
    ))
}

/// The amount a result states when it disagrees with the refund: WeChat's
/// `amount.refund` or the generic `amount` against the refund's; Alipay's
/// running `refund_fee` against what its trade had refunded before
/// (`refunded_before`) plus this one.
fn mismatched_amount(cb: &RefundCallback, refunded_before: i64, refund: &RefundRecord) -> Option<i64> {
    if let Some(stated) = cb.amount.filter(|stated| *stated != refund.amount) {
        return Some(stated);
    }
    cb.refunded_total.filter(|total| *total != refunded_before + refund.amount)
}

/// What a result does to `refund`, by the one table of a refund's
/// transitions: `Ok((to, outcome))` settles it (REQUESTED → SUCCEEDED |
/// FAILED); `Err(answer)` leaves it as it is, the same result again being a
/// `duplicate` and a contradicting one recorded as an `unexpected_refund`.
fn settling(
    tx: &WriteTx,
    order: &Order,
    cb: &RefundCallback,
    refund: &RefundRecord,
    now: &str,
) -> Result<Result<(RefundStatus, RefundOutcome), RefundOutcome>, Error> {
    Ok(match (refund.status, cb.status) {
        (RefundStatus::Requested, PlatformStatus::Success) => Ok((RefundStatus::Succeeded, RefundOutcome::Applied)),
        (RefundStatus::Requested, PlatformStatus::Failed) => Ok((RefundStatus::Failed, RefundOutcome::RefundFailed)),
        (RefundStatus::Succeeded, PlatformStatus::Success) | (RefundStatus::Failed, PlatformStatus::Failed) => {
            Err(RefundOutcome::Duplicate)
        }
        (settled, _) => Err(unexpected_refund(tx, order, cb, Some(settled), now)?),
    })
}

/// A success whose amount disagrees: recorded for an operator (the
/// inspection reports it as `unexpected_refund`), the refund left REQUESTED.
fn amount_mismatch(
    tx: &WriteTx,
    order: &Order,
    cb: &RefundCallback,
    refund: &RefundRecord,
    stated: i64,
    now: &str,
) -> Result<RefundOutcome, Error> {
    let detail = AuditDetail::RefundAmountMismatch {
        refund_no: &cb.refund_no,
        channel: &cb.channel,
        amount: refund.amount,
        stated,
        refunded_total: cb.refunded_total.is_some(),
    };
    tx.audit(now, ACTOR_SYSTEM, "refund_amount_mismatch", Some(&order.order_no), &detail)?;
    Ok(RefundOutcome::UnexpectedRefund)
}

/// A successful refund's points reversal: its share of the ORDER_PAID
/// points, floor(points × refund / amount); the refund that empties the
/// balance reverses what is left, so the reversals sum to the points
/// exactly; never more than is left (compensation may have reversed some).
fn reverse_points_of(tx: &WriteTx, order: &Order, refund: &RefundRecord, whole: bool, now: &str) -> Result<(), Error> {
    let (paid, left) = tx.points_paid_and_left(order.id)?;
    let share = i64::try_from(i128::from(paid) * i128::from(refund.amount) / i128::from(order.amount.max(1)))
        .unwrap_or(i64::MAX);
    let due = if whole { left } else { share.min(left) };
    if due > 0 {
        tx.reverse_points_of_refund(order.id, &refund.refund_no, due, now)?;
    }
    Ok(())
}
