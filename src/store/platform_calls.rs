//! `platform_call` (PRODUCT.md section 11): a row written before each call
//! to a platform's API and completed after it, outside any transaction that
//! spans the call. Never deleted.

use super::{one_row, params, WriteTx};
use crate::error::Error;

/// A call about to be made.
pub struct NewPlatformCall<'a> {
    pub channel: &'a str,
    pub kind: &'a str,
    pub order_no: &'a str,
    pub refund_no: Option<&'a str>,
    pub request: &'a str,
    pub now: &'a str,
    /// Until when the call may run (its timeout): the row's `next_attempt_at`
    /// while it is pending.
    pub lease_until: &'a str,
}

impl WriteTx<'_> {
    /// The row of a call about to be made, pending with its first attempt
    /// in flight; returns its id.
    pub fn insert_platform_call(&self, call: &NewPlatformCall) -> Result<i64, Error> {
        self.one(
            "INSERT INTO platform_call (channel, kind, order_no, refund_no, status, attempts, next_attempt_at,
                                        request, created_at, updated_at)
             VALUES (?1, ?2, ?3, ?4, 'pending', 1, ?5, ?6, ?7, ?7)
             RETURNING id",
            params![call.channel, call.kind, call.order_no, call.refund_no, call.lease_until, call.request, call.now],
            |r| r.int(0),
        )
    }

    /// Completes a call made: `done` (it was answered and the answer is
    /// trusted) or `failed` (no answer, or one that does not verify).
    pub fn finish_platform_call(
        &self,
        id: i64,
        done: bool,
        http_status: Option<u16>,
        response: &str,
        now: &str,
    ) -> Result<bool, Error> {
        let status = if done { "done" } else { "failed" };
        let changed = self.execute(
            "UPDATE platform_call SET status = ?2, next_attempt_at = NULL, http_status = ?3, response = ?4, updated_at = ?5
             WHERE id = ?1 AND status = 'pending'",
            params![id, status, http_status, response, now],
        )?;
        one_row(changed, "finish platform call")
    }
}
