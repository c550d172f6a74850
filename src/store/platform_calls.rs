//! `platform_call` (docs/platforms.md): a row written before each call
//! to a platform's API and completed after it, outside any transaction that
//! spans the call. Never deleted. A queued call is a leased call
//! (`src/outgoing/`), claimed and finished by the statements of
//! [`PLATFORM_CALLS`] (`store/leases.rs`).

use super::leases::{leased_table, LeasedTable};
use super::{bad_value, escape_foreign_text, limit_param, one_row, params, ReadTx, Row, WriteTx};
use crate::domain::{PlatformCallKind, PlatformCallStatus};
use crate::error::Error;

/// `platform_call` as a table of leased calls: a claim stamps `updated_at`;
/// a finish sets `request` (`?5`), `http_status` (`?6`), `response` (`?7`)
/// and `updated_at` (`?8`).
pub const PLATFORM_CALLS: LeasedTable = leased_table!(
    "platform_call",
    touched: "updated_at",
    columns: "request = ?5, http_status = ?6, response = ?7, updated_at = ?8"
);

/// A call about to be made.
pub struct NewPlatformCall<'a> {
    pub channel: &'a str,
    pub kind: PlatformCallKind,
    pub order_no: &'a str,
    pub refund_no: Option<&'a str>,
    pub request: &'a str,
    pub now: &'a str,
    /// Until when the call may run (its timeout): the row's `next_attempt_at`
    /// while it is pending.
    pub lease_until: &'a str,
}

/// A `platform_call` row as the platform-call pool works on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlatformCallRow {
    pub id: i64,
    pub channel: String,
    pub kind: PlatformCallKind,
    pub order_no: String,
    pub refund_no: Option<String>,
    pub status: PlatformCallStatus,
    pub attempts: i64,
    pub next_attempt_at: Option<String>,
}

fn call_from_row(r: &Row) -> Result<PlatformCallRow, Error> {
    Ok(PlatformCallRow {
        id: r.int(0)?,
        channel: r.text(1)?,
        kind: {
            let kind = r.text(2)?;
            PlatformCallKind::parse(&kind).ok_or_else(|| bad_value("platform_call kind", &kind))?
        },
        order_no: r.text(3)?,
        refund_no: r.opt_text(7)?,
        status: {
            let status = r.text(4)?;
            PlatformCallStatus::parse(&status).ok_or_else(|| bad_value("platform_call status", &status))?
        },
        attempts: r.int(5)?,
        next_attempt_at: r.opt_text(6)?,
    })
}

impl ReadTx<'_> {
    /// PENDING orders past `expires_at` with no close queued yet, oldest first.
    pub fn expired_pending_orders_unqueued(&self, now: &str, limit: usize) -> Result<Vec<String>, Error> {
        self.all(
            "SELECT o.order_no FROM orders o
             WHERE o.status = 'PENDING' AND o.expires_at <= ?1
               AND NOT EXISTS (SELECT 1 FROM platform_call c WHERE c.order_no = o.order_no AND c.kind = 'close')
             ORDER BY o.expires_at LIMIT ?2",
            params![now, limit_param(limit)],
            |r| r.text(0),
        )
    }

    /// Pending calls of the pool (closes, refund submissions, refund
    /// queries) whose next attempt may start at `now`.
    pub fn due_platform_calls(&self, now: &str, limit: usize) -> Result<Vec<PlatformCallRow>, Error> {
        self.all(
            "SELECT id, channel, kind, order_no, status, attempts, next_attempt_at, refund_no FROM platform_call
             WHERE status = 'pending' AND next_attempt_at <= ?1 AND kind IN ('close', 'refund', 'refund_query')
             ORDER BY next_attempt_at, id LIMIT ?2",
            params![now, limit_param(limit)],
            call_from_row,
        )
    }

    /// The close rows of an order, one per platform asked.
    pub fn platform_closes_of_order(&self, order_no: &str) -> Result<Vec<PlatformCallRow>, Error> {
        self.all(
            "SELECT id, channel, kind, order_no, status, attempts, next_attempt_at, refund_no FROM platform_call
             WHERE order_no = ?1 AND kind = 'close' ORDER BY id",
            params![order_no],
            call_from_row,
        )
    }
}

impl WriteTx<'_> {
    /// Queues the close of `order_no` at `channel`, due now; nothing if one
    /// is queued or made already (`uk_platform_call`).
    pub fn enqueue_platform_close(&self, channel: &str, order_no: &str, now: &str) -> Result<bool, Error> {
        let changed = self.execute(
            "INSERT INTO platform_call (channel, kind, order_no, refund_no, status, attempts, next_attempt_at,
                                        created_at, updated_at)
             VALUES (?1, 'close', ?2, NULL, 'pending', 0, ?3, ?3, ?3)
             ON CONFLICT DO NOTHING",
            params![channel, order_no, now],
        )?;
        one_row(changed, "enqueue platform close")
    }

    /// Queues a refund's submission (`kind` `refund`) or, once accepted, its
    /// query (`refund_query`), due at `due_at`; a submission only once per
    /// refund_no and platform (`uk_platform_call`).
    pub fn enqueue_platform_refund_call(
        &self,
        kind: PlatformCallKind,
        channel: &str,
        order_no: &str,
        refund_no: &str,
        due_at: &str,
        now: &str,
    ) -> Result<bool, Error> {
        let changed = self.execute(
            "INSERT INTO platform_call (channel, kind, order_no, refund_no, status, attempts, next_attempt_at,
                                        created_at, updated_at)
             VALUES (?1, ?2, ?3, ?4, 'pending', 0, ?5, ?6, ?6)
             ON CONFLICT DO NOTHING",
            params![channel, kind.as_str(), order_no, refund_no, due_at, now],
        )?;
        one_row(changed, "enqueue platform refund call")
    }

    /// The row of a call about to be made, pending with its first attempt
    /// in flight; returns its id.
    pub fn insert_platform_call(&self, call: &NewPlatformCall) -> Result<i64, Error> {
        self.one(
            "INSERT INTO platform_call (channel, kind, order_no, refund_no, status, attempts, next_attempt_at,
                                        request, created_at, updated_at)
             VALUES (?1, ?2, ?3, ?4, 'pending', 1, ?5, ?6, ?7, ?7)
             RETURNING id",
            params![
                call.channel,
                call.kind.as_str(),
                call.order_no,
                call.refund_no,
                call.lease_until,
                escape_foreign_text(call.request).as_ref(),
                call.now
            ],
            |r| r.int(0),
        )
    }
}
