//! Payment deliveries: one `pay_callback_log` row per pay_no (`uk_pay_no`),
//! inserted decided, or `received` → `decided` by CAS, and the operator's
//! resolutions.

use super::{bad_value, limit_param, one_row, params, ReadTx, Row, WriteTx};
use crate::domain::{CallbackRecord, NewCallback, PaymentOutcome, PlatformStatus};
use crate::error::Error;

macro_rules! callback_columns {
    () => {
        "id, pay_no, channel, order_id, amount, status, outcome, state, \
         source, paid_at, received_at, decided_at, currency, resolution"
    };
}

fn callback_from_row(row: &Row) -> Result<CallbackRecord, Error> {
    let status = row.text(5)?;
    let outcome = row.text(6)?;
    let state = row.text(7)?;
    // Pair assertion with the CHECKs of the schema: read back what was written.
    let outcome = PaymentOutcome::parse(&outcome).ok_or_else(|| bad_value("outcome", &outcome))?;
    let decided = match state.as_str() {
        "received" => false,
        "decided" => true,
        _ => return Err(bad_value("callback state", &state)),
    };
    assert_eq!(decided, outcome != PaymentOutcome::Recorded, "callback state/outcome disagree");
    Ok(CallbackRecord {
        id: row.int(0)?,
        pay_no: row.text(1)?,
        channel: row.text(2)?,
        order_id: row.int(3)?,
        amount: row.int(4)?,
        currency: row.opt_text(12)?,
        status: PlatformStatus::parse(&status).ok_or_else(|| bad_value("platform status", &status))?,
        outcome,
        decided,
        source: row.text(8)?,
        paid_at: row.opt_text(9)?,
        received_at: row.text(10)?,
        decided_at: row.opt_text(11)?,
        resolution: row.opt_text(13)?,
    })
}

impl ReadTx<'_> {
    pub fn callback_by_id(&self, id: i64) -> Result<CallbackRecord, Error> {
        self.one(
            concat!("SELECT ", callback_columns!(), " FROM pay_callback_log WHERE id = ?1"),
            params![id],
            callback_from_row,
        )
    }

    pub fn callback_by_pay_no(&self, pay_no: &str) -> Result<Option<CallbackRecord>, Error> {
        self.optional(
            concat!("SELECT ", callback_columns!(), " FROM pay_callback_log WHERE pay_no = ?1"),
            params![pay_no],
            callback_from_row,
        )
    }

    pub fn raw_body_of(&self, id: i64) -> Result<Vec<u8>, Error> {
        self.one("SELECT raw_body FROM pay_callback_log WHERE id = ?1", params![id], |r| r.blob(0))
    }

    pub fn callbacks_of_order(&self, order_id: i64) -> Result<Vec<CallbackRecord>, Error> {
        self.all(
            concat!("SELECT ", callback_columns!(), " FROM pay_callback_log WHERE order_id = ?1 ORDER BY id"),
            params![order_id],
            callback_from_row,
        )
    }

    /// Records waiting in record-only mode, in arrival order.
    pub fn received_callbacks(&self, limit: usize) -> Result<Vec<(i64, String)>, Error> {
        self.all(
            "SELECT id, pay_no FROM pay_callback_log WHERE state = 'received' ORDER BY id LIMIT ?1",
            params![limit_param(limit)],
            |r| Ok((r.int(0)?, r.text(1)?)),
        )
    }

    /// Records waiting in record-only mode after the record `after_id`,
    /// in arrival order: a cursor that pages the whole list even while no
    /// record of it is decided yet.
    pub fn received_callbacks_after(&self, after_id: i64, limit: usize) -> Result<Vec<(i64, String)>, Error> {
        self.all(
            "SELECT id, pay_no FROM pay_callback_log WHERE state = 'received' AND id > ?1 ORDER BY id LIMIT ?2",
            params![after_id, limit_param(limit)],
            |r| Ok((r.int(0)?, r.text(1)?)),
        )
    }

    pub fn count_received(&self) -> Result<i64, Error> {
        self.one("SELECT count(*) FROM pay_callback_log WHERE state = 'received'", params![], |r| r.int(0))
    }

    /// The resolution of a payment: (resolution, reason, resolved_at).
    pub fn payment_resolution(&self, id: i64) -> Result<Option<(String, String, String)>, Error> {
        self.one(
            "SELECT resolution, resolution_reason, resolved_at FROM pay_callback_log WHERE id = ?1",
            params![id],
            |r| {
                Ok(match r.opt_text(0)? {
                    Some(resolution) => Some((resolution, r.text(1)?, r.text(2)?)),
                    None => None,
                })
            },
        )
    }
}

impl WriteTx<'_> {
    /// Records a delivery seen for the first time as `received`, to be
    /// decided later (record-only mode). The caller read, inside this
    /// transaction, that no record holds the pay_no; `uk_pay_no` refuses a
    /// second one all the same.
    pub fn record_received(&self, cb: &NewCallback) -> Result<(), Error> {
        self.insert_callback(cb, PaymentOutcome::Recorded, None, None)
    }

    /// Records a delivery seen for the first time together with its
    /// decision, in the transaction that made the decision's effects: one
    /// INSERT where a `received` row and its decision would be two writes
    /// of the row and of each of its indexes.
    pub fn record_decided(
        &self,
        cb: &NewCallback,
        outcome: PaymentOutcome,
        decided_at: &str,
        rewards_due: Option<&str>,
    ) -> Result<(), Error> {
        assert!(outcome != PaymentOutcome::Recorded, "deciding a callback as recorded");
        assert_eq!(outcome == PaymentOutcome::Applied, rewards_due.is_some());
        self.insert_callback(cb, outcome, Some(decided_at), rewards_due)
    }

    /// The one INSERT of a pay_no's record: `received` without a decision
    /// time, `decided` with one.
    fn insert_callback(
        &self,
        cb: &NewCallback,
        outcome: PaymentOutcome,
        decided_at: Option<&str>,
        rewards_due: Option<&str>,
    ) -> Result<(), Error> {
        let state = if decided_at.is_some() { "decided" } else { "received" };
        let applied_at = decided_at.filter(|_| outcome == PaymentOutcome::Applied);
        let changed = self.execute(
            "INSERT INTO pay_callback_log
                 (pay_no, channel, order_id, amount, status, outcome, state, source, raw_body, paid_at, received_at,
                  decided_at, applied_at, rewards_due, currency)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)
             ON CONFLICT (pay_no) DO NOTHING",
            params![
                cb.pay_no,
                cb.channel,
                cb.order_id,
                cb.amount,
                cb.status.as_str(),
                outcome.as_str(),
                state,
                cb.source,
                cb.raw_body,
                cb.paid_at,
                cb.received_at,
                decided_at,
                applied_at,
                rewards_due,
                cb.currency
            ],
        )?;
        self.claimed(changed, cb.pay_no)
    }

    /// One row inserted, or the pay_no was claimed by a transaction this one
    /// could not see when it read: a write that takes no pay_no lock (a
    /// keyed reconciliation repair on PostgreSQL) meeting a callback that
    /// committed meanwhile. Its decision was made on a stale read, so the
    /// whole body runs again, where it sees the record (PostgreSQL re-runs
    /// it; on SQLite, one writer at a time, it cannot happen).
    fn claimed(&self, changed: usize, pay_no: &str) -> Result<(), Error> {
        match changed {
            1 => Ok(()),
            0 => Err(self.read.conn.stale_read(&format!("pay_no {pay_no} was recorded by a concurrent transaction"))),
            n => Err(Error::internal(format!("recording pay_no {pay_no} inserted {n} rows"))),
        }
    }

    /// A SUCCESS of a pay_no recorded FAILED (decided `payment_failed`, or
    /// still `received` in record-only mode) supersedes it, once: the row is
    /// `received` again, carrying the new delivery. `false` when the row is
    /// not (or no longer) a FAILED.
    pub fn supersede_failed_payment(&self, id: i64, cb: &NewCallback) -> Result<bool, Error> {
        let changed = self.execute(
            "UPDATE pay_callback_log
             SET status = 'SUCCESS', outcome = 'recorded', state = 'received', decided_at = NULL,
                 amount = ?2, raw_body = ?3, paid_at = ?4, source = ?5, currency = ?6
             WHERE id = ?1 AND status = 'FAILED' AND outcome IN ('payment_failed', 'recorded')",
            params![id, cb.amount, cb.raw_body, cb.paid_at, cb.source, cb.currency],
        )?;
        one_row(changed, "supersede failed payment")
    }

    /// CAS received→decided. `rewards_due` is set exactly for `applied`.
    pub fn decide_callback(
        &self,
        id: i64,
        outcome: PaymentOutcome,
        decided_at: &str,
        rewards_due: Option<&str>,
    ) -> Result<bool, Error> {
        assert!(outcome != PaymentOutcome::Recorded, "deciding a callback as recorded");
        assert_eq!(outcome == PaymentOutcome::Applied, rewards_due.is_some());
        let applied_at = (outcome == PaymentOutcome::Applied).then_some(decided_at);
        let changed = self.execute(
            "UPDATE pay_callback_log SET outcome = ?2, state = 'decided', decided_at = ?3, rewards_due = ?4,
                 applied_at = ?5
             WHERE id = ?1 AND state = 'received'",
            params![id, outcome.as_str(), decided_at, rewards_due, applied_at],
        )?;
        one_row(changed, "decide callback")
    }

    /// CAS unresolved → resolved, for refund-required payments only
    /// (`refunded` only with the payment's own succeeded refund: trigger
    /// pay_callback_log_refunded_by_its_refund).
    pub fn resolve_payment(&self, id: i64, resolution: &str, reason: &str, now: &str) -> Result<bool, Error> {
        let changed = self.execute(
            "UPDATE pay_callback_log SET resolution = ?2, resolution_reason = ?3, resolved_at = ?4
             WHERE id = ?1 AND resolution IS NULL
               AND outcome IN ('paid_after_close', 'already_paid', 'amount_mismatch')",
            params![id, resolution, reason, now],
        )?;
        one_row(changed, "resolve payment")
    }
}
