//! Operator tools, on the same exactly-once paths as the API: record-only
//! mode and drain, inspection, resolutions, compensation, reconciliation and
//! backup. The incident runbook in docs/operations.md walks through them.

use crate::app::{
    refuse_transition, App, DecisionRow, Delivery, PaymentCallback, MODE_NORMAL, MODE_RECORD_ONLY, SETTING_MODE,
    SOURCE_RECONCILIATION,
};
use crate::domain::{
    is_identifier, PaymentOutcome, PlatformStatus, POINT_TYPE_ORDER_PAID, POINT_TYPE_ORDER_PAID_REVERSAL,
};
use crate::domain::{AuditDetail, CouponRow, Finding, IdempotencySlot, PointRow, Refused};
use crate::error::{Error, ErrorKind};
use crate::keylock::LockKey;
use crate::recon::{self, Format, Listed, LocalMoney, RowKind, Statement, StatementRow, Verdict};
use crate::store::{ReadTx, WriteTx};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Records decided per drain look-up.
pub const DRAIN_BATCH_MAX: usize = 100;
/// A record-only record older than this, while the mode is normal, is a finding.
pub const RECEIVED_STALE_MS: i64 = 10 * 60 * 1000;
/// Bounds of an operator's free-text reason.
pub const REASON_BYTES_MAX: usize = 1_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Normal,
    RecordOnly,
}

impl Mode {
    pub fn parse(text: &str) -> Option<Mode> {
        match text {
            MODE_NORMAL => Some(Mode::Normal),
            MODE_RECORD_ONLY => Some(Mode::RecordOnly),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Normal => MODE_NORMAL,
            Mode::RecordOnly => MODE_RECORD_ONLY,
        }
    }
}

/// A compensation request (`POST /v1/compensations`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compensation {
    pub order_no: String,
    pub action: CompensationAction,
    pub reason: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CompensationAction {
    FreezeCoupon { coupon_template_id: String },
    ReversePoints,
}

/// What a compensation did (or had done): the coupon frozen or the points
/// reversed, as they stand now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compensated {
    pub order_no: String,
    pub effect: CompensationEffect,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CompensationEffect {
    CouponFrozen(CouponRow),
    PointsReversed(PointRow),
}

/// A refund-required payment's resolution (the first one, on a repeat).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PaymentResolution {
    pub pay_no: String,
    pub order_no: String,
    pub outcome: PaymentOutcome,
    pub resolution: String,
    pub reason: String,
    pub resolved_at: String,
}

/// An unexpected refund's resolution (the first one, on a repeat); the
/// resolution and reason as its audit row recorded them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefundResolution {
    pub refund_no: String,
    pub resolution: Option<String>,
    pub reason: Option<String>,
    pub resolved_at: String,
}

/// What a keyed drain decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Drained {
    pub applied: usize,
    /// Each decision's outcome, counted in the metrics once committed. The
    /// write body returns them: a body that pushed into a list outside it
    /// counted a rolled-back attempt too when PostgreSQL re-ran it.
    outcomes: Vec<PaymentOutcome>,
}

/// What a reconciliation found (and repaired).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reconciliation {
    pub period: Vec<String>,
    /// The kinds the statement declares it lists ("payment", "refund").
    pub compared: Vec<&'static str>,
    pub matched: usize,
    pub missing_local: DiffRows,
    pub missing_remote: DiffRows,
    pub amount_mismatch: DiffRows,
    /// With repair: what each missing_local payment became.
    pub repaired: Option<Vec<Repaired>>,
}

/// A payment or refund the platform and payonce disagree on, as judged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiffRow<'a> {
    pub kind: RowKind,
    /// The pay_no, or the refund_no of a refund.
    pub pay_no: &'a str,
    pub order_no: &'a str,
    pub amount_platform: Option<i64>,
    pub amount_local: Option<i64>,
    /// A WeChat Pay payment's non-zero 代金券金额.
    pub coupon_amount: Option<i64>,
}

/// One list of [`DiffRow`]s, each kept as its answer JSON from the moment
/// it is judged ([`DiffRows::push`] in `render`): a statement no row of
/// which payonce knows lists every row here, and the text of a row is a
/// fraction of a struct of owned strings. The text is kept in pieces of
/// [`DIFF_PIECE_BYTES`], so a long list never reallocates (and briefly
/// doubles) one large buffer, and the answer is written from the pieces,
/// each freed once copied (docs/performance.md, "Reconciliation memory").
#[derive(Clone, Default, PartialEq, Eq)]
pub struct DiffRows {
    /// The rows' JSON objects, comma-separated, without the brackets: the
    /// pieces one after the other (a row is never split between two).
    pub(crate) pieces: Vec<Vec<u8>>,
    pub(crate) len: usize,
}

/// A [`DiffRows`] piece's capacity, in bytes.
pub const DIFF_PIECE_BYTES: usize = 256 * 1024;

impl DiffRows {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A keyed repair's answer while its transaction runs: the comparison and
/// the repairs of this attempt, rendered as one [`Reconciliation`].
pub(crate) struct Repairing<'r> {
    pub(crate) result: &'r Reconciliation,
    pub(crate) repaired: Vec<Repaired>,
}

/// What a repair made of a missing_local payment: its outcome, or the refusal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Repaired {
    pub pay_no: String,
    pub order_no: String,
    pub outcome: Result<&'static str, Error>,
}

impl Reconciliation {
    pub fn is_clean(&self) -> bool {
        self.missing_local.is_empty() && self.missing_remote.is_empty() && self.amount_mismatch.is_empty()
    }
}

impl App {
    // ---- record-only mode ----

    pub fn mode(&self) -> Result<Mode, Error> {
        let mode = self.store.read(|tx| tx.setting(SETTING_MODE))?;
        mode.as_deref().and_then(Mode::parse).ok_or_else(|| Error::internal("the mode setting is missing"))
    }

    /// Sets the mode for every process on the database; audited when it changes.
    pub fn set_mode(&self, mode: Mode, actor: &str, slot: Option<&IdempotencySlot>) -> Result<Mode, Error> {
        let key = self.locks.lock(LockKey::Mode);
        let now = self.clock.now_text();
        self.write_op(&[&key], slot, |tx| {
            let before = tx.setting(SETTING_MODE)?;
            if before.as_deref() != Some(mode.as_str()) {
                tx.put_setting(SETTING_MODE, mode.as_str())?;
                let detail = AuditDetail::ModeChanged { from: before.as_deref(), to: mode.as_str() };
                tx.audit(&now, actor, "mode_changed", None, &detail)?;
            }
            Ok(mode)
        })
    }

    /// Decides every record waiting in record-only mode, in arrival order,
    /// whatever the mode. Each record is decided in its own transaction
    /// under its pay_no lock, by a CAS from `received`, so a crash midway
    /// loses nothing and decides nothing twice. Returns how many it decided.
    pub fn drain(&self) -> Result<usize, Error> {
        let mut decided = 0;
        loop {
            let batch = self.store.read(|tx| tx.received_callbacks(DRAIN_BATCH_MAX))?;
            let mut progressed = false;
            for (id, pay_no) in &batch {
                if self.decide_received(*id, pay_no)?.is_some() {
                    decided += 1;
                    progressed = true;
                }
            }
            if batch.len() < DRAIN_BATCH_MAX || !progressed {
                return Ok(decided);
            }
        }
    }

    /// [`App::drain`] answering `{"applied": N}`. With an Idempotency-Key,
    /// every waiting record is decided in ONE transaction with the stored
    /// answer, so a crash leaves both or neither. The transaction first
    /// takes every waiting record's pay_no key, in the database (where other
    /// processes wait for it), in arrival order; only then does it decide
    /// any. Deciding writes an event, and an event takes the outbox lock:
    /// another process's drain or sweeper holds one pay_no key and then
    /// wants that lock, so taking a key after it would deadlock them
    /// ([`WriteTx::hold_key`] refuses to). The CAS from `received` keeps
    /// each record exactly-once; one decided elsewhere meanwhile is skipped.
    pub fn drain_keyed(&self, slot: Option<&IdempotencySlot>) -> Result<Drained, Error> {
        let Some(slot) = slot else {
            return Ok(Drained { applied: self.drain()?, outcomes: Vec::new() });
        };
        let now = self.clock.now_text();
        let decided = self.write_op(&[], Some(slot), |tx| {
            let waiting = hold_every_waiting_key(tx)?;
            let mut outcomes = Vec::new();
            for id in waiting {
                let record = tx.callback_by_id(id)?;
                if record.decided {
                    continue; // decided by another process before its key was ours
                }
                let order = tx.order_by_id(record.order_id)?;
                let delivery = Delivery::from_record(&record);
                outcomes.push(self.decide_payment(tx, &delivery, DecisionRow::Received(record.id), &order, &now)?);
            }
            Ok(Drained { applied: outcomes.len(), outcomes })
        })?;
        for outcome in &decided.outcomes {
            self.metrics.observe_callback("payment", outcome.as_str());
        }
        Ok(decided)
    }

    fn decide_received(&self, id: i64, pay_no: &str) -> Result<Option<PaymentOutcome>, Error> {
        let pay_key = self.locks.lock(LockKey::Pay(pay_no));
        let now = self.clock.now_text();
        let outcome = self.store.write(&[&pay_key], |tx| {
            let record = tx.callback_by_id(id)?;
            if record.decided {
                return Ok(None); // decided by another process meanwhile
            }
            let order = tx.order_by_id(record.order_id)?;
            Ok(Some(self.decide_payment(
                tx,
                &Delivery::from_record(&record),
                DecisionRow::Received(record.id),
                &order,
                &now,
            )?))
        })?;
        if let Some(outcome) = outcome {
            self.metrics.observe_callback("payment", outcome.as_str());
        }
        Ok(outcome)
    }

    /// Records waiting to be decided.
    pub fn received_waiting(&self) -> Result<i64, Error> {
        self.store.read(|tx| tx.count_received())
    }

    // ---- inspection ----

    /// Runs every inspection query now; counts the findings in metrics.
    pub fn inspect(&self) -> Result<Vec<Finding>, Error> {
        let received_before = crate::clock::format_ms(self.clock.now_ms() - RECEIVED_STALE_MS);
        let findings = self.store.read(|tx| tx.inspect(&received_before))?;
        let kinds: Vec<&str> = findings.iter().map(|f| f.kind).collect();
        self.metrics.observe_inspection(&kinds);
        Ok(findings)
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
        let key = self.locks.lock(LockKey::Pay(pay_no));
        let now = self.clock.now_text();
        self.write_op(&[&key], slot, |tx| {
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
        let key = self.locks.lock(LockKey::Refund(refund_no));
        let now = self.clock.now_text();
        self.write_op(&[&key], slot, |tx| {
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

    // ---- compensation: freeze and reverse, never delete ----

    /// Idempotent by (order, action, target): the effect and its one audit
    /// row happen once; every request answers the resulting state.
    pub fn compensate(
        &self,
        req: &Compensation,
        actor: &str,
        slot: Option<&IdempotencySlot>,
    ) -> Result<Compensated, Error> {
        validate_reason(&req.reason)?;
        if let CompensationAction::FreezeCoupon { coupon_template_id } = &req.action {
            if !is_identifier(coupon_template_id) {
                return Err(Error::invalid("coupon_template_id must be 1-64 characters of [A-Za-z0-9_.-]"));
            }
        }
        let key = self.locks.lock(LockKey::Order(&req.order_no));
        let now = self.clock.now_text();
        self.write_op(&[&key], slot, |tx| {
            let order = tx.order_by_no(&req.order_no)?.ok_or_else(|| Error::order_not_found(&req.order_no))?;
            match &req.action {
                CompensationAction::FreezeCoupon { coupon_template_id: tpl } => {
                    let coupon = tx.coupon_of_order(order.id, tpl)?.ok_or_else(|| {
                        Error::new(ErrorKind::CouponNotFound, format!("order {} has no coupon {tpl:?}", order.order_no))
                    })?;
                    if coupon.status == "USED" {
                        let detail = Refused::CouponFreeze { coupon_template_id: tpl };
                        return Err(refuse_transition(
                            tx,
                            &order,
                            order.status,
                            "freeze a used coupon of",
                            &now,
                            detail,
                        )?);
                    }
                    if tx.freeze_coupon(order.id, tpl)? {
                        let detail = AuditDetail::CouponFrozen { coupon_template_id: tpl, reason: &req.reason };
                        tx.audit(&now, actor, "compensation", Some(&order.order_no), &detail)?;
                    }
                    let coupon =
                        tx.coupon_of_order(order.id, tpl)?.ok_or_else(|| Error::internal("coupon vanished"))?;
                    Ok(Compensated { order_no: order.order_no, effect: CompensationEffect::CouponFrozen(coupon) })
                }
                CompensationAction::ReversePoints => {
                    if tx.points_entry(order.id, POINT_TYPE_ORDER_PAID)?.is_none() {
                        return Err(Error::new(
                            ErrorKind::PointsNotFound,
                            format!("order {} has no {POINT_TYPE_ORDER_PAID} points to reverse", order.order_no),
                        ));
                    }
                    // Shares uk_order_type with the refund's reversal: whichever comes first reverses.
                    if tx.reverse_order_points(order.id, &now)? {
                        let detail = AuditDetail::PointsReversed { reason: &req.reason };
                        tx.audit(&now, actor, "compensation", Some(&order.order_no), &detail)?;
                    }
                    let entry = tx
                        .points_entry(order.id, POINT_TYPE_ORDER_PAID_REVERSAL)?
                        .ok_or_else(|| Error::internal("reversal vanished"))?;
                    Ok(Compensated { order_no: order.order_no, effect: CompensationEffect::PointsReversed(entry) })
                }
            }
        })
    }

    // ---- reconciliation ----

    /// Compares a platform statement with the payments and refunds payonce
    /// recorded in the statement's period; with `repair`, applies the
    /// platform's payments payonce never recorded, through the exactly-once
    /// path (`source` = reconciliation). `progress` is told rows done / total.
    pub fn reconcile(
        &self,
        format: Format,
        statement: &[u8],
        date: Option<&str>,
        repair: bool,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Reconciliation, Error> {
        let statement = Statement::read(format, statement)?;
        let (mut result, missing) = self.compare(format, &statement, date, repair, progress)?;
        if repair {
            result.repaired = Some(self.repair_missing(format, &statement, &missing)?);
        }
        Ok(result)
    }

    /// The comparison of [`App::reconcile`], reading only, and (with
    /// `keep_missing`) the lines of the payment rows payonce has no record
    /// of (what a repair would apply). The statement is read twice, row by
    /// row: first to check every row and find the period, then to compare
    /// rows in batches of [`COMPARE_BATCH_ROWS`], one read transaction a
    /// batch; only the ids it lists are kept for `missing_remote`.
    fn compare(
        &self,
        format: Format,
        statement: &Statement,
        date: Option<&str>,
        keep_missing: bool,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(Reconciliation, Vec<usize>), Error> {
        let offset = format.day_offset_ms();
        let compares = |kind: RowKind| statement.compared.contains(&kind);
        let day = |r: &StatementRow| r.at_ms.map(|at| recon::day_of(at, offset));
        // Every row's day, and how many rows of a compared kind each day has.
        let mut days = BTreeSet::new();
        let mut compared_on: BTreeMap<String, usize> = BTreeMap::new();
        let mut compared_untimed = 0;
        for row in statement.rows() {
            let row = row?;
            match day(&row) {
                Some(d) if compares(row.kind) => *compared_on.entry(d.clone()).or_default() += 1,
                None if compares(row.kind) => compared_untimed += 1,
                _ => {}
            }
            days.extend(day(&row));
        }
        // The period: `date=`, else the days of the rows that have a time of
        // their own (a row dated by something else never widens it).
        let period: BTreeSet<String> = match date {
            Some(day) => {
                recon::day_bounds(day, offset).ok_or_else(|| Error::invalid("date must be YYYY-MM-DD"))?;
                BTreeSet::from([day.to_owned()])
            }
            None => days,
        };
        // Compared: the rows of a declared kind inside the period, and the
        // rows without a time of their own (they belong to the statement).
        let total = compared_untimed + period.iter().filter_map(|d| compared_on.get(d)).sum::<usize>();
        let mut result = Reconciliation {
            period: period.iter().cloned().collect(),
            compared: statement.compared.iter().map(|k| k.as_str()).collect(),
            ..Reconciliation::default()
        };
        let mut listed = Listed::default();
        let mut missing = Vec::new();
        let mut batch = Vec::with_capacity(COMPARE_BATCH_ROWS);
        let mut done = 0;
        let mut rows = statement.rows();
        loop {
            let next = rows.next().transpose()?;
            let end = next.is_none();
            if let Some(row) = next.filter(|r| compares(r.kind) && day(r).is_none_or(|d| period.contains(&d))) {
                listed.insert(row.kind, &row.id)?;
                batch.push(row);
            }
            if batch.len() == COMPARE_BATCH_ROWS || (end && !batch.is_empty()) {
                let locals: Vec<Option<LocalMoney>> =
                    self.store.read(|tx| batch.iter().map(|row| local_money(tx, row)).collect())?;
                for (row, local) in batch.drain(..).zip(locals) {
                    match recon::judge(&row, local.as_ref()) {
                        Verdict::Matched => result.matched += 1,
                        Verdict::AmountMismatch => {
                            result.amount_mismatch.push(&diff_row(&row, local.map(|l| l.amount)))?
                        }
                        Verdict::MissingLocal => {
                            result.missing_local.push(&diff_row(&row, None))?;
                            if keep_missing && row.kind == RowKind::Payment {
                                missing.push(row.line);
                            }
                        }
                    }
                    done += 1;
                    progress(done, total);
                }
            }
            if end {
                break;
            }
        }
        // What payonce recorded in the period that the statement does not
        // list: read for every day while the listed ids are held, then
        // written out once they are freed.
        let listed = listed.seal();
        let mut local_only = Vec::with_capacity(period.len());
        for day in &period {
            let (from, to) = recon::day_bounds(day, offset).ok_or_else(|| Error::internal("bad period day"))?;
            let unlisted = |pay_no: &str| !listed.contains(RowKind::Payment, pay_no);
            let payments = if compares(RowKind::Payment) {
                Some(self.store.read(|tx| tx.applied_payments_between(&from, &to, &unlisted))?)
            } else {
                None
            };
            let mut refunds = DiffRows::default();
            if compares(RowKind::Refund) {
                let unlisted = |refund_no: &str| !listed.contains(RowKind::Refund, refund_no);
                self.store.read(|tx| {
                    tx.refunds_settled_between(&from, &to, &unlisted, &mut |refund_no, order_no, amount| {
                        refunds.push(&local_only_row(RowKind::Refund, refund_no, order_no, amount))
                    })
                })?;
            }
            local_only.push((payments, refunds));
        }
        drop(listed);
        for (payments, refunds) in local_only {
            for (pay_no, order_no, amount) in payments.iter().flat_map(|p| p.iter()) {
                result.missing_remote.push(&local_only_row(RowKind::Payment, pay_no, order_no, amount))?;
            }
            drop(payments);
            result.missing_remote.append(refunds);
        }
        Ok((result, missing))
    }

    /// [`App::reconcile`] for the API. With an Idempotency-Key and `repair`,
    /// the repairs and the stored answer commit in ONE transaction (the
    /// comparison before it only reads).
    pub fn reconcile_keyed(
        &self,
        format: Format,
        statement: &[u8],
        date: Option<&str>,
        repair: bool,
        slot: Option<&IdempotencySlot>,
    ) -> Result<Reconciliation, Error> {
        if slot.is_none() || !repair {
            let result = self.reconcile(format, statement, date, repair, &mut |_, _| {})?;
            // Stored by reference: a large answer is never copied.
            self.write_op(&[], slot, |_| Ok(&result))?;
            return Ok(result);
        }
        let statement = Statement::read(format, statement)?;
        let (mut result, missing) = self.compare(format, &statement, date, true, &mut |_, _| {})?;
        let now = self.clock.now_text();
        let repaired = self.write_op(&[], slot, |tx| {
            let mut repaired = Vec::new();
            for row in missing_rows(&statement, &missing) {
                let row = row?;
                let callback = repair_callback(format, &row);
                repaired.push(match self.record_and_decide(tx, &callback, SOURCE_RECONCILIATION, &now) {
                    Ok(reply) => repaired_row(&row, Ok(reply.outcome_str())),
                    // A refusal (unknown order) wrote nothing; anything else rolls back every repair.
                    Err(e) if e.is_refusal() => repaired_row(&row, Err(e)),
                    Err(e) => return Err(e),
                });
            }
            // The comparison by reference and this attempt's repairs: the
            // body may run again (PostgreSQL), and a large answer is never
            // copied for it.
            Ok(Repairing { result: &result, repaired })
        })?;
        result.repaired = Some(repaired.repaired);
        Ok(result)
    }

    fn repair_missing(&self, format: Format, statement: &Statement, missing: &[usize]) -> Result<Vec<Repaired>, Error> {
        missing_rows(statement, missing)
            .map(|row| {
                let row = row?;
                Ok(match self.deliver_payment_from(&repair_callback(format, &row), SOURCE_RECONCILIATION) {
                    Ok(reply) => repaired_row(&row, Ok(reply.outcome_str())),
                    Err(e) => repaired_row(&row, Err(e)),
                })
            })
            .collect()
    }

    // ---- backup ----

    /// An online, consistent copy of the database at `to`, atomically: the
    /// copy is written to `{to}.{pid}.partial` in the same directory,
    /// checked (`integrity_check`), synced, and only then given the name
    /// `to`, and the directory is synced. A kill or a full disk at any moment
    /// leaves no file at `to` (or the previous one, with `force`) or a
    /// complete, checked copy. `to` must not exist unless `force`; it may
    /// never name the live database or one of its journal files.
    pub fn backup(&self, to: &Path, force: bool) -> Result<(), Error> {
        let db =
            self.store.database_path().ok_or_else(|| Error::invalid("an in-memory database has no file to back up"))?;
        let to = backup_target(db, to, force)?;
        let partial = partial_path(&to);
        let result = self.write_backup(&partial, &to, force);
        if result.is_err() {
            remove_partial(&partial);
        }
        result
    }

    fn write_backup(&self, partial: &Path, to: &Path, force: bool) -> Result<(), Error> {
        let io = |what: &str, e: std::io::Error| Error::internal(format!("backup: {what}: {e}"));
        self.store.backup_into(partial)?;
        std::fs::File::open(partial).and_then(|f| f.sync_all()).map_err(|e| io("syncing the copy", e))?;
        if force {
            std::fs::rename(partial, to).map_err(|e| io("renaming the copy into place", e))?;
        } else {
            // A hard link gives the name only if no file took it meanwhile.
            std::fs::hard_link(partial, to).map_err(|e| match e.kind() {
                std::io::ErrorKind::AlreadyExists => {
                    Error::invalid(format!("{} exists; use --force to replace it", to.display()))
                }
                _ => io("naming the copy", e),
            })?;
            std::fs::remove_file(partial).map_err(|e| io("removing the temporary name", e))?;
        }
        let dir = to.parent().ok_or_else(|| Error::internal("backup: the target has no directory"))?;
        std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io("syncing the directory", e))?;
        Ok(())
    }
}

/// The temporary file's suffix: whatever is left after a kill ends in it
/// (or in `.partial-wal`/`.partial-shm` during the integrity check).
pub const BACKUP_PARTIAL_SUFFIX: &str = ".partial";

/// `to` as an absolute path in a canonical directory, refused when it names
/// the live database or one of its journal files in any spelling (relative,
/// `./`, `..`, a symlink to it, a hard link to it), or when it exists and
/// `force` is not given, or when a journal of an older file at `to` would be
/// applied to the new copy when it is opened.
fn backup_target(db: &Path, to: &Path, force: bool) -> Result<PathBuf, Error> {
    let name = to.file_name().ok_or_else(|| Error::invalid(format!("--to {}: not a file name", to.display())))?;
    let parent = to.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let dir =
        parent.canonicalize().map_err(|e| Error::invalid(format!("--to {}: its directory: {e}", to.display())))?;
    let target = dir.join(name);
    let resolved = follow_links(&target);
    let live = live_names(db);
    let refuse = || {
        Error::invalid(format!(
            "--to {} names the live database {} or one of its -wal, -shm, -journal files",
            to.display(),
            db.display()
        ))
    };
    if live.iter().any(|p| *p == target || *p == resolved) {
        return Err(refuse());
    }
    if let Ok(meta) = std::fs::metadata(&target) {
        let same_file =
            |p: &PathBuf| std::fs::metadata(p).is_ok_and(|m| m.dev() == meta.dev() && m.ino() == meta.ino());
        if live.iter().any(same_file) {
            return Err(refuse());
        }
    }
    if std::fs::symlink_metadata(&target).is_ok() && !force {
        return Err(Error::invalid(format!("{} exists; use --force to replace it", to.display())));
    }
    for suffix in ["-wal", "-journal"] {
        let journal = with_suffix(&target, suffix);
        if std::fs::symlink_metadata(&journal).is_ok() {
            return Err(Error::invalid(format!(
                "{} exists: SQLite would apply it to the new copy; close what has {} open, or remove it",
                journal.display(),
                to.display()
            )));
        }
    }
    Ok(target)
}

/// Where `path` leads through symlinks, even to a file that does not exist
/// yet (a link to the database's `-journal`): at most `LINKS_FOLLOWED_MAX` links.
fn follow_links(path: &Path) -> PathBuf {
    const LINKS_FOLLOWED_MAX: usize = 40;
    let mut current = path.to_path_buf();
    for _ in 0..LINKS_FOLLOWED_MAX {
        let Ok(next) = std::fs::read_link(&current) else {
            break;
        };
        let next = match current.parent() {
            Some(dir) if next.is_relative() => dir.join(next),
            _ => next,
        };
        // The directory part made canonical, the last name kept.
        current = match (next.parent().and_then(|d| d.canonicalize().ok()), next.file_name()) {
            (Some(dir), Some(name)) => dir.join(name),
            _ => next,
        };
    }
    current.canonicalize().unwrap_or(current)
}

/// Every name of the live database's files: as SQLite opened it and as
/// canonicalized (they differ when a directory on the way is a symlink).
fn live_names(db: &Path) -> Vec<PathBuf> {
    let mut bases = vec![db.to_path_buf()];
    if let Ok(canonical) = db.canonicalize() {
        bases.push(canonical);
    }
    bases.iter().flat_map(|b| ["", "-wal", "-shm", "-journal"].map(|s| with_suffix(b, s))).collect()
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// `{to}.{pid}.partial`: one per process, so two backups to one name never
/// write into the same temporary file.
fn partial_path(to: &Path) -> PathBuf {
    with_suffix(to, &format!(".{}{BACKUP_PARTIAL_SUFFIX}", std::process::id()))
}

/// Removes the temporary file and what SQLite may have made beside it.
fn remove_partial(partial: &Path) {
    for suffix in ["", "-journal", "-wal", "-shm"] {
        let _ = std::fs::remove_file(with_suffix(partial, suffix));
    }
}

/// Statement rows compared per read transaction.
pub const COMPARE_BATCH_ROWS: usize = 512;

/// payonce's amount, in its order's currency, for a statement row's pay_no
/// or refund_no, if it has one (one query: the order comes with it).
fn local_money(tx: &ReadTx, row: &StatementRow) -> Result<Option<LocalMoney>, Error> {
    let local = match row.kind {
        RowKind::Payment => tx.money_moved_payment(&row.id)?,
        RowKind::Refund => tx.succeeded_refund(&row.id)?,
    };
    Ok(local.map(|(amount, currency)| LocalMoney { amount, currency }))
}

/// The statement's rows at `lines` (ascending), read again.
fn missing_rows<'s>(
    statement: &'s Statement,
    lines: &'s [usize],
) -> impl Iterator<Item = Result<StatementRow, Error>> + 's {
    statement.rows().filter(move |row| row.as_ref().map_or(true, |r| lines.binary_search(&r.line).is_ok()))
}

/// A platform's payment as the exactly-once path takes it, from reconciliation.
fn repair_callback(format: Format, row: &StatementRow) -> PaymentCallback {
    PaymentCallback {
        channel: format.as_str().to_owned(),
        pay_no: row.id.clone(),
        order_no: row.order_no.clone(),
        amount: row.amount,
        currency: row.currency.clone(),
        status: PlatformStatus::Success,
        paid_at: row.at_ms.map(crate::clock::format_ms),
        raw_body: row.raw.clone().into_bytes(),
    }
}

fn repaired_row(row: &StatementRow, outcome: Result<&'static str, Error>) -> Repaired {
    Repaired { pay_no: row.id.clone(), order_no: row.order_no.clone(), outcome }
}

/// A `missing_remote` row: payonce has it, the platform does not.
fn local_only_row<'a>(kind: RowKind, id: &'a str, order_no: &'a str, amount: i64) -> DiffRow<'a> {
    DiffRow { kind, pay_no: id, order_no, amount_platform: None, amount_local: Some(amount), coupon_amount: None }
}

/// A statement row against payonce's amount (`None`: payonce has no record).
fn diff_row(row: &StatementRow, local: Option<i64>) -> DiffRow<'_> {
    DiffRow {
        kind: row.kind,
        pay_no: &row.id,
        order_no: &row.order_no,
        amount_platform: Some(row.amount),
        amount_local: local,
        coupon_amount: row.coupon_amount,
    }
}

fn validate_reason(reason: &str) -> Result<(), Error> {
    if reason.trim().is_empty() || reason.len() > REASON_BYTES_MAX {
        return Err(Error::invalid(format!("reason is required, at most {REASON_BYTES_MAX} bytes")));
    }
    Ok(())
}

fn validate_resolution(resolution: &str, reason: &str) -> Result<(), Error> {
    if !matches!(resolution, "refunded_externally" | "accepted") {
        return Err(Error::invalid("resolution must be refunded_externally or accepted"));
    }
    validate_reason(reason)
}

/// Takes the pay_no key of every record waiting in record-only mode, in
/// arrival order, and returns their ids: the keyed drain's first phase.
fn hold_every_waiting_key(tx: &WriteTx) -> Result<Vec<i64>, Error> {
    let mut ids = Vec::new();
    let mut after = 0;
    loop {
        let page = tx.received_callbacks_after(after, DRAIN_BATCH_MAX)?;
        for (id, pay_no) in &page {
            tx.hold_key(LockKey::Pay(pay_no))?;
            ids.push(*id);
            after = *id;
        }
        if page.len() < DRAIN_BATCH_MAX {
            return Ok(ids);
        }
    }
}
