//! The access-layer Idempotency-Key: a stored answer per (scope, key)
//! (`uk_scope_key`), written in the same transaction as the work it answers.

use super::{one_row, params, ReadTx, WriteTx};
use crate::domain::{IdempotencySlot, StoredResponse};
use crate::error::Error;

impl ReadTx<'_> {
    /// The stored response of (scope, key) unless it expired by `now`.
    pub fn stored_response(&self, scope: &str, key: &str, now: &str) -> Result<Option<StoredResponse>, Error> {
        self.optional(
            "SELECT fingerprint, status_code, response_body FROM idempotency_key
             WHERE scope = ?1 AND key = ?2 AND expires_at > ?3",
            params![scope, key, now],
            |r| {
                let status = r.int(1)?;
                Ok(StoredResponse {
                    fingerprint: r.text(0)?,
                    status_code: u16::try_from(status)
                        .map_err(|_| Error::internal(format!("stored status code {status} out of range")))?,
                    body: r.blob(2)?,
                })
            },
        )
    }
}

impl WriteTx<'_> {
    /// Stores the response of (scope, key) in the caller's transaction, over
    /// an expired one if any. `false` when a live response is already stored
    /// (another process won the key): the caller must roll back its work.
    pub fn store_response(&self, slot: &IdempotencySlot, status_code: u16, body: &[u8]) -> Result<bool, Error> {
        let changed = self.execute(
            "INSERT INTO idempotency_key (scope, key, fingerprint, status_code, response_body, created_at, expires_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
             ON CONFLICT (scope, key) DO UPDATE SET
                 fingerprint = excluded.fingerprint, status_code = excluded.status_code,
                 response_body = excluded.response_body, created_at = excluded.created_at,
                 expires_at = excluded.expires_at
             WHERE idempotency_key.expires_at <= excluded.created_at",
            params![&slot.scope, &slot.key, &slot.fingerprint, status_code, body, &slot.created_at, &slot.expires_at],
        )?;
        one_row(changed, "store idempotent response")
    }

    /// Removes up to `limit` expired stored responses (the table is not a
    /// ledger; only expired keys are ever removed). Returns how many.
    pub fn purge_expired_responses(&self, now: &str, limit: usize) -> Result<usize, Error> {
        self.execute(
            "DELETE FROM idempotency_key WHERE (scope, key) IN
                 (SELECT scope, key FROM idempotency_key WHERE expires_at <= ?1 LIMIT ?2)",
            params![now, super::limit_param(limit)],
        )
    }
}
