//! The two statements of a leased outgoing call (`src/outgoing/`), written
//! once for both tables that hold such calls (`webhook_delivery`,
//! `platform_call`): the claim, a CAS on `next_attempt_at` that moves it to
//! the lease's end with `attempts + 1`, and the finish, a CAS on the claimed
//! attempt number that sets the status, the next attempt and the kind's own
//! columns. Both decide by their affected-row count.

use super::{one_row, Param, WriteTx};
use crate::error::Error;

/// A table of leased calls: its claim and finish statements, each one
/// literal (statements are cached by their text).
#[derive(Debug)]
pub struct LeasedTable {
    /// The table's name, for errors.
    pub name: &'static str,
    /// `?1` id, `?2` the `next_attempt_at` read, `?3` the lease's end, `?4` now.
    claim: &'static str,
    /// `?1` id, `?2` the claimed attempt, `?3` status, `?4` next_attempt_at,
    /// then the kind's own columns from `?5`.
    finish: &'static str,
}

/// A [`LeasedTable`] for `$table`, whose claim also sets `$touched` to now
/// and whose finish also sets `$columns` (placeholders from `?5`).
macro_rules! leased_table {
    ($table:literal, touched: $touched:literal, columns: $columns:literal) => {
        $crate::store::LeasedTable::new(
            $table,
            concat!(
                "UPDATE ",
                $table,
                " SET next_attempt_at = ?3, attempts = attempts + 1, ",
                $touched,
                " = ?4 WHERE id = ?1 AND status = 'pending' AND next_attempt_at = ?2"
            ),
            concat!(
                "UPDATE ",
                $table,
                " SET status = ?3, next_attempt_at = ?4, ",
                $columns,
                " WHERE id = ?1 AND attempts = ?2 AND status = 'pending'"
            ),
        )
    };
}
pub(crate) use leased_table;

impl LeasedTable {
    pub(crate) const fn new(name: &'static str, claim: &'static str, finish: &'static str) -> LeasedTable {
        LeasedTable { name, claim, finish }
    }
}

impl WriteTx<'_> {
    /// Claims the next attempt of the pending call `id` read with
    /// `seen_next_attempt_at`: true when this caller owns it, until `lease_until`.
    pub fn claim_leased(
        &self,
        table: &LeasedTable,
        id: i64,
        seen_next_attempt_at: &str,
        lease_until: &str,
        now: &str,
    ) -> Result<bool, Error> {
        let changed = self.execute(table.claim, super::params![id, seen_next_attempt_at, lease_until, now])?;
        one_row(changed, table.name)
    }

    /// Records how the claimed attempt `attempt` of call `id` ended: its
    /// `status`, `next_attempt_at` (a retry's, `None` once settled) and the
    /// table's own `columns`. False when the call moved on meanwhile (its
    /// lease ran out and another attempt was claimed, or it left `pending`),
    /// which then changes nothing.
    pub(crate) fn finish_leased(
        &self,
        table: &LeasedTable,
        id: i64,
        attempt: i64,
        status: &str,
        next_attempt_at: Option<&str>,
        columns: &[Param],
    ) -> Result<bool, Error> {
        let mut all: Vec<Param> = vec![id.into(), attempt.into(), status.into(), next_attempt_at.into()];
        all.extend_from_slice(columns);
        let changed = self.execute(table.finish, &all)?;
        one_row(changed, table.name)
    }
}
