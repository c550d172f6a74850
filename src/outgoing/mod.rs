//! One leased outgoing call, the only way payonce calls out: webhook
//! deliveries (`webhook_delivery`, made by `relay.rs`) and platform calls
//! (`platform_call`, made by `platform_ops.rs`) are its two kinds
//! (`kinds.rs`). A call is a row first, and no transaction spans it:
//!
//! 1. queued: the row is `pending`, its `next_attempt_at` when it is due;
//! 2. claimed: [`claim_in`] is a CAS on the `next_attempt_at` read, moving it
//!    past the call's timeout (the [`Lease`]) with `attempts + 1`; the
//!    claiming transaction commits before the call, so processes on one
//!    database make one attempt at a time, and a process that dies mid-call
//!    leaves the row to be claimed again when its lease runs out;
//! 3. called, outside any transaction;
//! 4. finished: [`finish`] records how the attempt ended (a [`Settle`]: due
//!    again, or settled in the kind's status) by a CAS on the claimed
//!    attempt number, so a stale finisher changes nothing.
//!
//! A retry's wait comes from a [`Schedule`] (`schedule.rs`); a worker
//! (`worker.rs`) claims due calls of a [`Queue`] and makes them with
//! bounded concurrency until shutdown. The statements are the store's
//! (`store/leases.rs`), one per operation for both tables.

mod kinds;
mod schedule;
mod worker;

pub use kinds::PlatformAttempt;
pub use schedule::{random_unit, Schedule, Spent};
pub use worker::{run_once, spawn, AtShutdown, Queue, Shape};

use crate::clock::format_ms;
use crate::error::Error;
use crate::store::{LeasedTable, Param, Store, WriteTx};

/// The status column of a kind of leased call, typed: each kind's own enum.
pub trait CallStatus: Copy + Eq + std::fmt::Debug + Send + Sync + 'static {
    /// Waiting for its next attempt, or with an attempt in flight.
    const PENDING: Self;
    fn as_str(self) -> &'static str;
}

/// A row of a table of leased calls, as read before its claim.
pub trait Leased: Clone + Send + Sync {
    type Status: CallStatus;
    /// How an attempt ended, in the kind's words.
    type Outcome: Send + Sync;
    const TABLE: &'static LeasedTable;
    fn id(&self) -> i64;
    fn status(&self) -> Self::Status;
    fn attempts(&self) -> i64;
    fn next_attempt_at(&self) -> Option<&str>;
    /// Writes `outcome` of the claimed attempt by [`finish_cas`], with
    /// what follows from it in the same transaction; true when recorded.
    fn record(tx: &WriteTx, claimed: &Claimed<Self>, outcome: &Self::Outcome, now: &str) -> Result<bool, Error>;
}

/// An attempt's lease: claimed at `now`, owned until `until`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub now: String,
    pub until: String,
}

impl Lease {
    pub fn new(now_ms: i64, lease_ms: u64) -> Lease {
        let until_ms = now_ms.saturating_add(i64::try_from(lease_ms).unwrap_or(i64::MAX));
        Lease { now: format_ms(now_ms), until: format_ms(until_ms) }
    }
}

/// A claimed attempt: the row as read, and the attempt number it owns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claimed<R> {
    pub row: R,
    pub attempt: i64,
}

/// Where a leased call stands after an attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Settle<S> {
    /// Still pending: the next attempt may start at `at`.
    Retry { at: String },
    /// Settled for good, in the kind's status (never its `PENDING`).
    Final(S),
}

/// Claims the next attempt of `row` inside a write body: the claim when
/// this caller won it, `None` when another holds it or it moved on.
pub fn claim_in<R: Leased>(tx: &WriteTx, row: &R, lease: &Lease) -> Result<Option<Claimed<R>>, Error> {
    if row.status() != R::Status::PENDING {
        return Ok(None);
    }
    let seen = row.next_attempt_at().unwrap_or_default();
    let won = tx.claim_leased(R::TABLE, row.id(), seen, &lease.until, &lease.now)?;
    Ok(won.then(|| Claimed { row: row.clone(), attempt: row.attempts().saturating_add(1) }))
}

/// [`claim_in`] in a transaction of its own.
pub fn claim<R: Leased>(store: &Store, row: &R, lease: &Lease) -> Result<Option<Claimed<R>>, Error> {
    if row.status() != R::Status::PENDING {
        return Ok(None);
    }
    store.write(&[], |tx| claim_in(tx, row, lease))
}

/// The finish CAS every kind's [`Leased::record`] makes: the status and
/// next attempt `settle` says, and the kind's own `columns`, while the
/// row is pending at the claimed attempt. False when it moved on.
pub(crate) fn finish_cas<R: Leased>(
    tx: &WriteTx,
    claimed: &Claimed<R>,
    settle: &Settle<R::Status>,
    columns: &[Param],
) -> Result<bool, Error> {
    let (status, next_attempt_at) = match settle {
        Settle::Retry { at } => (R::Status::PENDING, Some(at.as_str())),
        Settle::Final(status) if *status == R::Status::PENDING => {
            return Err(Error::internal(format!("{}: an attempt cannot settle as pending", R::TABLE.name)))
        }
        Settle::Final(status) => (*status, None),
    };
    tx.finish_leased(R::TABLE, claimed.row.id(), claimed.attempt, status.as_str(), next_attempt_at, columns)
}

/// Records how a claimed attempt ended, in its own transaction; true when
/// recorded, false when the call moved on during it. When the outcome
/// cannot be stored (it holds someone else's bytes), `fallback` may give
/// the same state change in payonce's own words, which is written instead,
/// so the schedule moves on whatever the other side sent
/// (docs/operations.md, "Someone else's bytes, and NUL bytes").
pub fn finish<R: Leased>(
    store: &Store,
    claimed: &Claimed<R>,
    outcome: &R::Outcome,
    now: &str,
    fallback: impl FnOnce(&Error) -> Option<R::Outcome>,
) -> Result<bool, Error> {
    let first = store.write(&[], |tx| R::record(tx, claimed, outcome, now));
    let Err(e) = first else {
        return first;
    };
    match fallback(&e) {
        Some(fallback) => store.write(&[], |tx| R::record(tx, claimed, &fallback, now)),
        None => Err(e),
    }
}

#[cfg(test)]
mod tests;
