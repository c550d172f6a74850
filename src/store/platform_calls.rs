//! `platform_call` (docs/platforms.md): a row written before each call
//! to a platform's API and completed after it, outside any transaction that
//! spans the call. Never deleted. A queued call is a leased call
//! (`src/outgoing/`), claimed and finished by the statements of
//! [`PLATFORM_CALLS`] (`store/leases.rs`). A `prepay` row is not queued:
//! the pay requests make and finish it with CASes of their own (below).

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
    /// Calls pending, every process's (`/metrics`): the partial index
    /// `ix_platform_call_due` holds exactly those.
    pub fn platform_calls_pending(&self) -> Result<i64, Error> {
        self.one("SELECT count(*) FROM platform_call WHERE status = 'pending'", params![], |r| r.int(0))
    }

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
    /// queries) whose next attempt may start at `now`. Never a `query` or a
    /// `prepay`: those are made at once by the request that needs them, and
    /// a pending prepay whose lease ran out waits for the next pay request
    /// (`reclaim_prepay`), not for the pool.
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

// ---- the prepay row: the platform's payment created once per order ----
//
// One `platform_call` row of kind `prepay` per (channel, order_no)
// (`uk_platform_call_prepay`), made at once by the pay request that wins
// it and never queued (`due_platform_calls` leaves it out). `attempts`
// counts its calls; while one is in flight the row is `pending` and
// `next_attempt_at` is that call's lease. A request signed for the buyer
// (no call) is a row `done` with no attempt. Each write below is a
// compare-and-set decided by its affected-row count, so concurrent
// requests, in one process or several on one database, make one call.

/// The first request of a prepay row.
pub struct NewPrepay<'a> {
    pub channel: &'a str,
    pub order_no: &'a str,
    pub method: &'a str,
    /// The appid the payment is created under; `None` where the platform
    /// has none.
    pub appid: Option<&'a str>,
    /// The request's other parameters (JSON text: openid, client_ip,
    /// description), sent again as they are by every later call of the row.
    pub params: &'a str,
    pub now: &'a str,
    /// `Some(lease)`: a call is about to be made, pending until the lease
    /// ends (past it, another request may take the row). `None`: a request
    /// signed for the buyer, no call: the row is done, and the trade may
    /// exist from now on (the buyer can open the request any time).
    pub lease_until: Option<&'a str>,
}

/// What a new call of a row sends, when a request with other parameters
/// replaces those of a row whose attempts cannot have made a trade.
pub struct PrepayParams<'a> {
    pub method: &'a str,
    pub appid: Option<&'a str>,
    pub params: &'a str,
}

/// How a prepay attempt ended.
pub struct PrepayFinish<'a> {
    /// [`PlatformCallStatus::Done`] (a payment to answer) or
    /// [`PlatformCallStatus::Failed`] (an error answered once, not kept).
    pub status: PlatformCallStatus,
    /// What was sent, as the platform received it (its signature left out).
    pub request: &'a str,
    /// The answer's HTTP status; `None` when none came.
    pub http_status: Option<u16>,
    pub response: &'a str,
    /// What payonce answered (JSON text): the payment object, or the error
    /// object, for the requests that waited on this call.
    pub answer: &'a str,
    /// The attempt may have made the trade (created, paid, closed, or no
    /// answer): the row keeps its parameters from then on.
    pub trade_may_exist: bool,
    pub now: &'a str,
}

/// The prepay row of an order at one platform, as the pay requests read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrepayRow {
    pub id: i64,
    pub method: String,
    pub appid: Option<String>,
    /// The first request's other parameters, JSON text.
    pub params: String,
    pub status: PlatformCallStatus,
    pub attempts: i64,
    /// The lease of the call in flight while `pending`; `None` once finished.
    pub next_attempt_at: Option<String>,
    /// What the last finished attempt answered, JSON text.
    pub answer: Option<String>,
    pub trade_may_exist: bool,
    pub updated_at: String,
}

impl PrepayRow {
    /// A call of the row is being made now: pending, its lease not ended by `now`.
    pub fn in_flight(&self, now: &str) -> bool {
        self.status == PlatformCallStatus::Pending && self.next_attempt_at.as_deref().is_some_and(|lease| lease > now)
    }
}

fn prepay_from_row(r: &Row) -> Result<PrepayRow, Error> {
    Ok(PrepayRow {
        id: r.int(0)?,
        method: r.text(1)?,
        appid: r.opt_text(2)?,
        params: r.text(3)?,
        status: {
            let status = r.text(4)?;
            PlatformCallStatus::parse(&status).ok_or_else(|| bad_value("platform_call status", &status))?
        },
        attempts: r.int(5)?,
        next_attempt_at: r.opt_text(6)?,
        answer: r.opt_text(7)?,
        trade_may_exist: r.int(8)? == 1,
        updated_at: r.text(9)?,
    })
}

impl ReadTx<'_> {
    /// The prepay row of `order_no` at `channel`, if a pay request made one.
    pub fn prepay_row(&self, channel: &str, order_no: &str) -> Result<Option<PrepayRow>, Error> {
        self.optional(
            "SELECT id, method, appid, params, status, attempts, next_attempt_at, answer, trade_may_exist, updated_at
             FROM platform_call WHERE channel = ?1 AND order_no = ?2 AND kind = 'prepay'",
            params![channel, order_no],
            prepay_from_row,
        )
    }
}

impl WriteTx<'_> {
    /// The prepay row of a first request: pending with attempt 1 in flight
    /// until its lease, or done without a call for a request signed for the
    /// buyer. Its id, or `None` when another request's row is there already
    /// (`uk_platform_call_prepay`), which the loser then reads.
    pub fn begin_prepay(&self, call: &NewPrepay) -> Result<Option<i64>, Error> {
        let (status, attempts, may_exist): (&str, i64, i64) = match call.lease_until {
            Some(_) => ("pending", 1, 0),
            None => ("done", 0, 1),
        };
        self.optional(
            "INSERT INTO platform_call (channel, kind, order_no, refund_no, status, attempts, next_attempt_at,
                                        created_at, updated_at, method, appid, params, trade_may_exist)
             VALUES (?1, 'prepay', ?2, NULL, ?8, ?9, ?3, ?4, ?4, ?5, ?6, ?7, ?10)
             ON CONFLICT DO NOTHING
             RETURNING id",
            params![
                call.channel,
                call.order_no,
                call.lease_until,
                call.now,
                call.method,
                call.appid,
                call.params,
                status,
                attempts,
                may_exist
            ],
            |r| r.int(0),
        )
    }

    /// Takes prepay row `id` for a new call (`attempts` + 1, pending, leased
    /// until `lease_until`): a refresh after the reuse window, a retry after
    /// a failure, or the call of a caller that died mid-call. With
    /// `replacing`, the call sends other parameters, allowed only while no
    /// attempt may have made a trade. True only when `attempts` is still
    /// `seen_attempts` and no call is in flight (the row is finished, or its
    /// lease ended by `now`); false when another request took it first.
    pub fn reclaim_prepay(
        &self,
        id: i64,
        seen_attempts: i64,
        now: &str,
        lease_until: &str,
        replacing: Option<&PrepayParams>,
    ) -> Result<bool, Error> {
        let changed = match replacing {
            None => self.execute(
                "UPDATE platform_call SET status = 'pending', attempts = attempts + 1, next_attempt_at = ?4,
                                          updated_at = ?3
                 WHERE id = ?1 AND kind = 'prepay' AND attempts = ?2
                   AND (status <> 'pending' OR next_attempt_at <= ?3)",
                params![id, seen_attempts, now, lease_until],
            )?,
            Some(new) => self.execute(
                "UPDATE platform_call SET status = 'pending', attempts = attempts + 1, next_attempt_at = ?4,
                                          updated_at = ?3, method = ?5, appid = ?6, params = ?7
                 WHERE id = ?1 AND kind = 'prepay' AND attempts = ?2 AND trade_may_exist = 0
                   AND (status <> 'pending' OR next_attempt_at <= ?3)",
                params![id, seen_attempts, now, lease_until, new.method, new.appid, new.params],
            )?,
        };
        one_row(changed, "reclaim prepay")
    }

    /// A request signed for the buyer takes over row `id` whose attempts
    /// cannot have made a trade (each was refused): done, no call, the trade
    /// may exist from now on. False when the row moved on meanwhile.
    pub fn sign_over_prepay(&self, id: i64, seen_attempts: i64, new: &PrepayParams, now: &str) -> Result<bool, Error> {
        let changed = self.execute(
            "UPDATE platform_call SET status = 'done', next_attempt_at = NULL, method = ?3, appid = ?4, params = ?5,
                                      answer = NULL, trade_may_exist = 1, updated_at = ?6
             WHERE id = ?1 AND kind = 'prepay' AND attempts = ?2 AND trade_may_exist = 0 AND status <> 'pending'",
            params![id, seen_attempts, new.method, new.appid, new.params, now],
        )?;
        one_row(changed, "sign over prepay")
    }

    /// Records how attempt `attempt` of prepay row `id` ended: its status,
    /// what was sent and answered. False, changing nothing, when the row
    /// moved on meanwhile (its lease ran out and another attempt took it).
    pub fn finish_prepay(&self, id: i64, attempt: i64, end: &PrepayFinish) -> Result<bool, Error> {
        if !matches!(end.status, PlatformCallStatus::Done | PlatformCallStatus::Failed) {
            return Err(Error::internal(format!("a prepay call ends done or failed, not {}", end.status.as_str())));
        }
        let changed = self.execute(
            "UPDATE platform_call SET status = ?3, next_attempt_at = NULL, request = ?4, http_status = ?5,
                                      response = ?6, answer = ?7, updated_at = ?8,
                                      trade_may_exist = CASE WHEN ?9 = 1 THEN 1 ELSE trade_may_exist END
             WHERE id = ?1 AND kind = 'prepay' AND attempts = ?2 AND status = 'pending'",
            params![
                id,
                attempt,
                end.status.as_str(),
                escape_foreign_text(end.request).as_ref(),
                end.http_status,
                escape_foreign_text(end.response).as_ref(),
                end.answer,
                end.now,
                i64::from(end.trade_may_exist)
            ],
        )?;
        one_row(changed, "finish prepay")
    }
}
