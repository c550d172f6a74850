//! Payments: a payment callback delivered exactly once per pay_no (the
//! incident's path), its decision, the rewards of an applied payment, and
//! the resolution of a refund-required payment.

use super::{log_suppressed, validate_resolution, Core};
use crate::app::{
    PaymentCallback, PaymentReply, PaymentReplyOutcome, ACTOR_SYSTEM, MODE_RECORD_ONLY, SETTING_MODE, SOURCE_CALLBACK,
};
use crate::domain::{is_amount, is_currency, is_identifier};
use crate::domain::{
    AuditDetail, CallbackRecord, EventData, EventType, IdempotencySlot, JsonText, NewCallback, Order, OrderStatus,
    PaymentOutcome, PlatformStatus, RefundUnwanted, RewardsDue,
};
use crate::error::{Error, ErrorKind};
use crate::keylock::LockKey;
use crate::ops::PaymentResolution;
use crate::platforms::Notices;
use crate::store::WriteTx;

/// A payment to decide: what the decision needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Delivery {
    pub pay_no: String,
    pub channel: String,
    pub amount: i64,
    /// `None`: the order's currency (a generic notice without one, or a
    /// record from before schema version 9).
    pub currency: Option<String>,
    pub status: PlatformStatus,
    pub paid_at: Option<String>,
}

/// Where a decision is written: the `received` row of a recorded payment
/// (record-only mode, drain, a superseded FAILED), or a delivery seen for the
/// first time, inserted already decided. Either happens in the transaction
/// that makes the decision's effects, so nobody ever sees the second kind
/// `received`: recording and deciding it in one INSERT writes the row and
/// its indexes once instead of twice.
#[derive(Clone, Copy)]
pub(crate) enum DecisionRow<'a> {
    Received(i64),
    New(&'a NewCallback<'a>),
}

impl Delivery {
    /// A `received` record read back (record-only mode, drain).
    pub(crate) fn from_record(record: &CallbackRecord) -> Delivery {
        assert!(!record.decided, "deciding a callback twice");
        Delivery {
            pay_no: record.pay_no.clone(),
            channel: record.channel.clone(),
            amount: record.amount,
            currency: record.currency.clone(),
            status: record.status,
            paid_at: record.paid_at.clone(),
        }
    }
}

#[derive(Clone, Copy)]
pub struct Payments<'a> {
    core: &'a Core,
}

impl<'a> Payments<'a> {
    pub(crate) fn new(core: &'a Core) -> Payments<'a> {
        Payments { core }
    }

    /// The configured channel of that name (`generic` only with a secret):
    /// its notices, through which a callback is verified and answered.
    pub fn channel(&self, name: &str) -> Option<&'a dyn Notices> {
        self.core.config().platforms.registry.notices(name)
    }

    // ---- payment callbacks: the incident's path ----

    /// Delivers a verified payment callback, exactly once per pay_no.
    pub fn deliver_payment(&self, cb: &PaymentCallback) -> Result<PaymentReply, Error> {
        let reply = self.deliver_payment_from(cb, SOURCE_CALLBACK)?;
        self.core.metrics().observe_callback("payment", reply.outcome_str());
        if matches!(reply.outcome, PaymentReplyOutcome::Duplicate { .. }) {
            self.core.metrics().observe_duplicate("callback");
        }
        Ok(reply)
    }

    /// The exactly-once path for a payment from `source` (`callback` or
    /// `reconciliation`).
    pub fn deliver_payment_from(&self, cb: &PaymentCallback, source: &str) -> Result<PaymentReply, Error> {
        validate_payment(cb)?;
        // 1. The key is the payment's own serial number, not the order: two
        //    payments of one order are not serialised here; the database decides.
        let pay_key = self.core.locks().lock(LockKey::Pay(&cb.pay_no));
        // A re-delivery of a decided pay_no is answered from a read snapshot,
        // without queueing for the writer: a decided outcome is final (trigger
        // pay_callback_log_outcome_final), except payment_failed, which a
        // SUCCESS may supersede; that case, and everything else, takes the
        // write path (whose storage checks come before and after its commit).
        // Nothing is written on this path. Only a pay_no this process saw
        // lately is looked up first: a first delivery would find nothing and
        // pay for a read it does not need, and a pay_no it does not remember
        // (another process's, or from before a restart) is answered alike by
        // the writer, which reads the record under uk_pay_no itself.
        let recent = self.core.recent_pay_nos();
        if recent.contains(&cb.pay_no) {
            if let Some(original) = self.settled_outcome(cb)? {
                // Not even a duplicate is acknowledged once the files are
                // lost: the record it vouches for may live only in a deleted
                // -wal, and a platform that hears 2xx stops retrying.
                self.core.store().check_storage()?;
                return Ok(PaymentReply { outcome: PaymentReplyOutcome::Duplicate { original } });
            }
        }
        let now = self.core.clock().now_text();
        // 2. BEGIN IMMEDIATE ... 7. COMMIT, inside `write`.
        let reply = self.core.store().write(&[&pay_key], |tx| self.record_and_decide(tx, cb, source, &now))?;
        // Remembered while the key is held: the next delivery of this pay_no,
        // waiting for the key, takes the read path.
        recent.insert(&cb.pay_no);
        Ok(reply)
        // 8. `_pay_key` drops here, after the commit.
    }

    /// The final outcome already recorded for this delivery's pay_no, if
    /// the delivery cannot change it. An unknown order answers `None`, so
    /// the write path refuses it exactly as before.
    fn settled_outcome(&self, cb: &PaymentCallback) -> Result<Option<PaymentOutcome>, Error> {
        self.core.store().read(|tx| {
            if tx.order_by_no(&cb.order_no)?.is_none() {
                return Ok(None);
            }
            let prior = tx.callback_by_pay_no(&cb.pay_no)?;
            Ok(prior
                .filter(|p| p.decided)
                .filter(|p| !(p.outcome == PaymentOutcome::PaymentFailed && cb.status == PlatformStatus::Success))
                .map(|p| p.outcome))
        })
    }

    /// Steps 3-6 of the pipeline inside the caller's IMMEDIATE transaction:
    /// record the delivery under uk_pay_no, then decide it. A refusal (an
    /// unknown order) happens before the first write.
    pub(crate) fn record_and_decide(
        &self,
        tx: &WriteTx,
        cb: &PaymentCallback,
        source: &str,
        now: &str,
    ) -> Result<PaymentReply, Error> {
        check_platform_time(tx, cb, source, now, &self.core.config().platforms.registry)?;
        let order = tx.order_by_no(&cb.order_no)?.ok_or_else(|| Error::order_not_found(&cb.order_no))?;
        let new = NewCallback {
            pay_no: &cb.pay_no,
            channel: &cb.channel,
            order_id: order.id,
            amount: cb.amount,
            currency: cb.currency.as_deref(),
            status: cb.status,
            source,
            raw_body: &cb.raw_body,
            paid_at: cb.paid_at.as_deref(),
            received_at: now,
        };
        // 3. The record that already holds this pay_no (uk_pay_no), read
        //    inside the writer's transaction, so nothing can claim the pay_no
        //    between this read and the INSERT below.
        let row = match tx.callback_by_pay_no(&cb.pay_no)? {
            None if tx.setting(SETTING_MODE)?.as_deref() == Some(MODE_RECORD_ONLY) => {
                // Record-only mode (a setting every process on the file
                // obeys): the record waits, `received`, to be decided later by `drain`.
                tx.record_received(&new)?;
                return Ok(PaymentReply { outcome: PaymentReplyOutcome::Decided(PaymentOutcome::Recorded) });
            }
            None => DecisionRow::New(&new),
            Some(prior) => {
                // A FAILED of this pay_no — decided `payment_failed`, or still
                // waiting in record-only mode — may be superseded once by a
                // SUCCESS for the same order. A pay_no never moves to another order.
                let supersedes = prior.status == PlatformStatus::Failed
                    && cb.status == PlatformStatus::Success
                    && prior.order_id == order.id;
                // The FAILED delivery was acknowledged: its exact bytes move to the audit row.
                let failed_body = if supersedes { Some(tx.raw_body_of(prior.id)?) } else { None };
                if !(supersedes && tx.supersede_failed_payment(prior.id, &new)?) {
                    return Ok(PaymentReply { outcome: PaymentReplyOutcome::Duplicate { original: prior.outcome } });
                }
                use base64::Engine;
                let failed_body = base64::engine::general_purpose::STANDARD.encode(failed_body.unwrap_or_default());
                let detail = AuditDetail::PaymentFailedSuperseded {
                    pay_no: &cb.pay_no,
                    prior: &prior,
                    failed_body: &failed_body,
                };
                tx.audit(now, ACTOR_SYSTEM, "payment_failed_superseded", Some(&order.order_no), &detail)?;
                if tx.setting(SETTING_MODE)?.as_deref() == Some(MODE_RECORD_ONLY) {
                    return Ok(PaymentReply { outcome: PaymentReplyOutcome::Decided(PaymentOutcome::Recorded) });
                }
                DecisionRow::Received(prior.id)
            }
        };
        // 4-6. Decide: CAS, side effects, event, and the record's outcome.
        let delivery = Delivery {
            pay_no: cb.pay_no.clone(),
            channel: cb.channel.clone(),
            amount: cb.amount,
            currency: cb.currency.clone(),
            status: cb.status,
            paid_at: cb.paid_at.clone(),
        };
        let outcome = self.decide_payment(tx, &delivery, row, &order, now)?;
        Ok(PaymentReply { outcome: PaymentReplyOutcome::Decided(outcome) })
    }

    /// Decides a recorded payment in the order of precedence of docs/channels.md. The
    /// CAS's affected-row count decides `applied`; only when it changed
    /// nothing is the order read to say why.
    pub(crate) fn decide_payment(
        &self,
        tx: &WriteTx,
        record: &Delivery,
        row: DecisionRow<'_>,
        order: &Order,
        now: &str,
    ) -> Result<PaymentOutcome, Error> {
        let (outcome, current) = judge_payment(tx, record, order, now)?;
        let rewards_due = if outcome == PaymentOutcome::Applied {
            Some(self.apply_rewards(tx, order, record.amount, now)?)
        } else {
            None
        };
        let rewards_due = rewards_due.as_ref().map(JsonText::json_text);
        record_decision(tx, row, outcome, now, rewards_due.as_deref())?;
        if let (Some(current), true) = (current, outcome == PaymentOutcome::Applied || outcome.requires_refund()) {
            emit_payment_event(tx, record, order, &current, outcome, now)?;
        }
        if outcome.requires_refund() && self.core.config().refund_unwanted == RefundUnwanted::Auto {
            // In this transaction: a crash cannot lose the refund of money
            // payonce just recorded that it did not want.
            let payment = tx
                .callback_by_pay_no(&record.pay_no)?
                .ok_or_else(|| Error::internal(format!("payment {} decided in this transaction", record.pay_no)))?;
            self.core.refunds().refund_unwanted_in(tx, &payment, &order.order_no, now)?;
        }
        Ok(outcome)
    }

    /// Issues the configured coupons and points, each under its own UNIQUE
    /// key, and returns the rewards due as recorded with the payment.
    fn apply_rewards(&self, tx: &WriteTx, order: &Order, amount: i64, now: &str) -> Result<RewardsDue, Error> {
        let rewards = &self.core.config().rewards;
        for template in &rewards.coupon_templates {
            if !tx.issue_coupon(&order.user_id, order.id, template, now)? {
                log_suppressed("user_coupon", &format!("{}/{template}", order.order_no));
            }
        }
        let points = rewards.points_for(amount);
        if points > 0 && !tx.add_order_points(&order.user_id, order.id, points, now)? {
            log_suppressed("point_log", &format!("{}/ORDER_PAID", order.order_no));
        }
        Ok(RewardsDue { coupons: rewards.coupon_templates.clone(), points })
    }

    // ---- resolutions ----

    /// Marks a refund-required payment as handled, once; a repeat answers
    /// the first resolution.
    pub fn resolve_payment(
        &self,
        pay_no: &str,
        resolution: &str,
        reason: &str,
        actor: &str,
        slot: Option<&IdempotencySlot>,
    ) -> Result<PaymentResolution, Error> {
        validate_resolution(resolution, reason)?;
        let key = self.core.locks().lock(LockKey::Pay(pay_no));
        let now = self.core.clock().now_text();
        self.core.write_op(&[&key], slot, |tx| {
            let record = tx
                .callback_by_pay_no(pay_no)?
                .ok_or_else(|| Error::new(ErrorKind::PaymentNotFound, format!("no payment with pay_no {pay_no:?}")))?;
            let order = tx.order_by_id(record.order_id)?;
            if !record.outcome.requires_refund() {
                let detail = AuditDetail::ResolutionRefused { pay_no, outcome: record.outcome };
                tx.audit(&now, actor, "resolution_refused", Some(&order.order_no), &detail)?;
                return Err(Error::invalid_transition(format!(
                    "payment {pay_no} is {}, not refund-required",
                    record.outcome.as_str()
                )));
            }
            if record.resolution.is_none() {
                let refunds = tx.refunds_of_payment(record.order_id, pay_no)?;
                if let Some(in_flight) = refunds.iter().find(|r| r.status == crate::domain::RefundStatus::Requested) {
                    return Err(Error::invalid_transition(format!(
                        "payment {pay_no} is being refunded ({}); its result resolves it",
                        in_flight.refund_no
                    )));
                }
            }
            if tx.resolve_payment(record.id, resolution, reason, &now)? {
                let detail = AuditDetail::PaymentResolved { pay_no, resolution, reason };
                tx.audit(&now, actor, "payment_resolved", Some(&order.order_no), &detail)?;
            }
            let (resolution, reason, resolved_at) = tx
                .payment_resolution(record.id)?
                .ok_or_else(|| Error::internal("a resolved payment has no resolution"))?;
            Ok(PaymentResolution {
                pay_no: pay_no.to_owned(),
                order_no: order.order_no,
                outcome: record.outcome,
                resolution,
                reason,
                resolved_at,
            })
        })
    }
}

/// The decision's first step: the CAS PENDING→PAID, and when it changed
/// nothing, why (the order read back). Returns the outcome and the order as
/// it stands after the decision (for the event), known without another read
/// when the CAS moved it.
fn judge_payment(
    tx: &WriteTx,
    record: &Delivery,
    order: &Order,
    now: &str,
) -> Result<(PaymentOutcome, Option<Order>), Error> {
    let paid_at = record.paid_at.clone().unwrap_or_else(|| now.to_owned());
    // Currency is part of the amount: money in another currency never
    // pays the order, whatever the number (docs/channels.md).
    let same_currency = record.currency.as_deref().is_none_or(|c| c == order.currency);
    let decided = if record.status == PlatformStatus::Failed {
        (PaymentOutcome::PaymentFailed, None)
    } else if same_currency && tx.cas_order_paid(order.id, record.amount, &record.pay_no, &paid_at)? {
        let paid = Order {
            status: OrderStatus::Paid,
            pay_no: Some(record.pay_no.clone()),
            paid_at: Some(paid_at.clone()),
            ..order.clone()
        };
        // A read that fails (the connection just went away) proves
        // nothing: the transaction cannot commit either.
        #[cfg(debug_assertions)]
        if let Ok(read) = tx.order_by_id(order.id) {
            assert_eq!(read, paid, "the paid order as computed");
        }
        (PaymentOutcome::Applied, Some(paid))
    } else {
        let current = tx.order_by_id(order.id)?;
        let outcome = match current.status {
            OrderStatus::Closed => PaymentOutcome::PaidAfterClose,
            OrderStatus::Pending => {
                assert!(
                    !same_currency || current.amount != record.amount,
                    "CAS refused a PENDING order at its own amount"
                );
                PaymentOutcome::AmountMismatch
            }
            _ => PaymentOutcome::AlreadyPaid,
        };
        (outcome, Some(current))
    };
    Ok(decided)
}

/// Writes the outcome on the record: the `received` row it decides, or the
/// new row inserted already decided.
fn record_decision(
    tx: &WriteTx,
    row: DecisionRow<'_>,
    outcome: PaymentOutcome,
    now: &str,
    rewards_due: Option<&str>,
) -> Result<(), Error> {
    match row {
        DecisionRow::Received(id) => {
            // Under its pay_no lock nobody else decides it; the keyed
            // drain holds none, and on PostgreSQL a callback it read as
            // received may be decided by another process before its CAS.
            if !tx.decide_callback(id, outcome, now, rewards_due)? {
                return Err(tx.stale_read(&format!("callback {id} was decided by a concurrent transaction")));
            }
        }
        DecisionRow::New(new) => tx.record_decided(new, outcome, now, rewards_due)?,
    }
    Ok(())
}

/// The outbox event of an applied or refund-required payment.
fn emit_payment_event(
    tx: &WriteTx,
    record: &Delivery,
    order: &Order,
    current: &Order,
    outcome: PaymentOutcome,
    now: &str,
) -> Result<(), Error> {
    let (pay_no, channel, amount) = (&record.pay_no, &record.channel, record.amount);
    let data = EventData::Payment { order: current, pay_no, channel, amount, outcome };
    let (event_type, subject) = if outcome == PaymentOutcome::Applied {
        (EventType::OrderPaid, order.order_no.as_str())
    } else {
        (EventType::PaymentRefundRequired, record.pay_no.as_str())
    };
    if !tx.emit_event(event_type, subject, &order.order_no, &data, now)? {
        // Impossible while the CAS and uk_pay_no hold; the unique key is the last word.
        log_suppressed("outbox_event", &event_type.event_id(subject));
    }
    Ok(())
}

/// The window of a platform's payment time: a platform notification of a pay_no payonce has
/// not recorded must carry a payment time within [received − 72 h,
/// received + 5 min] and in the years 2000-2199, or it is 400 naming the
/// field and nothing is recorded (the transaction has written nothing yet).
/// Otherwise a forger with the secret could date a payment where
/// reconciliation never looks. A re-delivery of a recorded pay_no is judged
/// by uk_pay_no as always (`duplicate`); reconciliation repairs are the
/// platform's own statement and are not windowed. Refund notices never
/// reach here.
fn check_platform_time(
    tx: &WriteTx,
    cb: &PaymentCallback,
    source: &str,
    now: &str,
    platforms: &crate::platforms::Registry,
) -> Result<(), Error> {
    let Some(paid_at) = cb.paid_at.as_deref().filter(|_| source == SOURCE_CALLBACK) else {
        return Ok(());
    };
    let paid_ms = crate::clock::parse_rfc3339_ms(paid_at);
    let now_ms = crate::clock::parse_rfc3339_ms(now)
        .ok_or_else(|| Error::internal(format!("payonce's own time {now:?} does not parse")))?;
    if paid_ms.is_some_and(|ms| crate::domain::platform_time_plausible(ms, now_ms)) {
        return Ok(());
    }
    // Only an implausible time costs this look-up.
    if tx.callback_by_pay_no(&cb.pay_no)?.is_some() {
        return Ok(());
    }
    let field = platforms.paid_time_field(&cb.channel);
    Err(Error::invalid(format!(
        "{field} {paid_at} is not within {} h before and {} min after payonce received the notification ({now}), \
         or not in the years {}-{}",
        crate::domain::PLATFORM_TIME_BEFORE_MS_MAX / 3_600_000,
        crate::domain::PLATFORM_TIME_AFTER_MS_MAX / 60_000,
        crate::domain::PLATFORM_YEAR_FIRST,
        crate::domain::PLATFORM_YEAR_LAST
    )))
}

fn validate_payment(cb: &PaymentCallback) -> Result<(), Error> {
    if !is_identifier(&cb.pay_no) {
        return Err(Error::invalid("pay_no must be 1-64 characters of [A-Za-z0-9_.-]"));
    }
    if !is_identifier(&cb.order_no) {
        return Err(Error::invalid("order_no must be 1-64 characters of [A-Za-z0-9_.-]"));
    }
    if !is_amount(cb.amount) {
        return Err(Error::invalid("amount must be an integer from 1 to 1000000000000 (minor units)"));
    }
    if cb.currency.as_deref().is_some_and(|c| !is_currency(c)) {
        return Err(Error::invalid("currency must be 3 upper-case letters"));
    }
    Ok(())
}
