//! Refunds: a refund requested (and its submission to the platform queued
//! with it), refund results delivered exactly once per refund_no, and the
//! resolution of an unexpected refund.

use super::{refuse_transition, validate_resolution, Core};
use crate::app::{RefundCallback, ACTOR_SYSTEM};
use crate::domain::{
    is_identifier, AuditDetail, EventData, EventType, IdempotencySlot, Order, OrderStatus, PaymentOutcome,
    PlatformStatus, RefundOutcome, RefundStatus, Refused,
};
use crate::error::{Error, ErrorKind};
use crate::keylock::LockKey;
use crate::ops::RefundResolution;
use crate::store::WriteTx;
use serde_json::Value;

#[derive(Clone, Copy)]
pub struct Refunds<'a> {
    core: &'a Core,
}

impl<'a> Refunds<'a> {
    pub(crate) fn new(core: &'a Core) -> Refunds<'a> {
        Refunds { core }
    }

    /// PAID→REFUNDING with a `refund` row REQUESTED. The same refund_no again
    /// while REFUNDING or REFUNDED answers the order.
    pub fn request_refund(&self, order_no: &str, refund_no: &str) -> Result<Order, Error> {
        self.request_refund_keyed(order_no, refund_no, None)
    }

    pub fn request_refund_keyed(
        &self,
        order_no: &str,
        refund_no: &str,
        slot: Option<&IdempotencySlot>,
    ) -> Result<Order, Error> {
        if !is_identifier(refund_no) {
            return Err(Error::invalid("refund_no must be 1-64 characters of [A-Za-z0-9_.-]"));
        }
        let key = self.core.locks().lock(LockKey::Refund(refund_no));
        let now = self.core.clock().now_text();
        self.core.write_op(&[&key], slot, |tx| {
            let order = tx.order_by_no(order_no)?.ok_or_else(|| Error::order_not_found(order_no))?;
            let detail = Refused::Refund { refund_no };
            if let Some(existing) = tx.refund_by_no(refund_no)? {
                if existing.order_id == order.id && existing.status != RefundStatus::Failed {
                    return Ok(order);
                }
                return Err(refuse_transition(tx, &order, OrderStatus::Refunding, "refund", &now, detail)?);
            }
            if !tx.cas_order_refunding(order.id, refund_no)? {
                return Err(refuse_transition(tx, &order, OrderStatus::Refunding, "refund", &now, detail)?);
            }
            let inserted = tx.insert_refund(refund_no, order.id, &now)?;
            assert!(inserted, "refund_no {refund_no} appeared inside its own transaction");
            // The submission to the platform that took the payment is queued
            // with the request, in its transaction: it cannot be lost.
            let took = tx.callbacks_of_order(order.id)?.into_iter().find(|p| p.outcome == PaymentOutcome::Applied);
            if let Some(channel) =
                took.map(|p| p.channel).filter(|c| self.core.config().platforms.channels().contains(&c.as_str()))
            {
                tx.enqueue_platform_refund_call(
                    crate::domain::PlatformCallKind::Refund,
                    &channel,
                    order_no,
                    refund_no,
                    &now,
                    &now,
                )?;
            }
            let refunding = tx.order_by_id(order.id)?;
            let data = EventData::Refund { order: &refunding, refund_no, status: RefundStatus::Requested };
            tx.emit_event(EventType::OrderRefunding, &format!("{order_no}/{refund_no}"), order_no, &data, &now)?;
            Ok(refunding)
        })
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
            let cb = match (of, &order.refund_no) {
                (RefundOf::InFlight, Some(refund_no)) => {
                    in_flight = RefundCallback { refund_no: refund_no.clone(), ..cb.clone() };
                    &in_flight
                }
                _ => cb,
            };
            let refund = tx.refund_by_no(&cb.refund_no)?.filter(|r| r.order_id == order.id);
            let Some(refund) = refund else {
                return unexpected_refund(tx, &order, cb, None, &now);
            };
            let (settle_to, outcome) = match (refund.status, cb.status) {
                (RefundStatus::Requested, PlatformStatus::Success) => (RefundStatus::Succeeded, RefundOutcome::Applied),
                (RefundStatus::Requested, PlatformStatus::Failed) => {
                    (RefundStatus::Failed, RefundOutcome::RefundFailed)
                }
                (RefundStatus::Succeeded, PlatformStatus::Success) | (RefundStatus::Failed, PlatformStatus::Failed) => {
                    return Ok(RefundOutcome::Duplicate)
                }
                (settled, _) => return unexpected_refund(tx, &order, cb, Some(settled), &now),
            };
            // Only a success has a platform settlement time worth keeping.
            let platform_settled_at = cb.settled_at.as_deref().filter(|_| settle_to == RefundStatus::Succeeded);
            if !tx.settle_refund(refund.id, settle_to, &now, platform_settled_at)? {
                return Err(Error::internal(format!("refund {} changed inside its transaction", cb.refund_no)));
            }
            let moved = match outcome {
                RefundOutcome::Applied => tx.cas_order_refunded(order.id, &cb.refund_no, &now)?,
                _ => tx.cas_order_refund_failed(order.id, &cb.refund_no)?,
            };
            if !moved {
                // A REQUESTED refund always has its order REFUNDING (uk_refund_requested,
                // the CAS in request_refund); anything else is a bug: roll back.
                return Err(Error::internal(format!("order {} is not REFUNDING for {}", order.order_no, cb.refund_no)));
            }
            let event_type = if outcome == RefundOutcome::Applied {
                tx.reverse_order_points(order.id, &now)?;
                tx.freeze_active_coupons(order.id)?;
                EventType::OrderRefunded
            } else {
                EventType::OrderRefundFailed
            };
            let current = tx.order_by_id(order.id)?;
            let data = EventData::Refund { order: &current, refund_no: &cb.refund_no, status: settle_to };
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
            let unexpected = tx.refund_audit("unexpected_refund", refund_no)?;
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
