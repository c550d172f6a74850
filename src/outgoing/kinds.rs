//! The two kinds of leased call: webhook deliveries (`webhook_delivery`,
//! typed by [`DeliveryStatus`], an attempt ending in an [`AttemptResult`])
//! and platform calls (`platform_call`, typed by [`PlatformCallStatus`], an
//! attempt ending in a [`PlatformAttempt`]). Each says which columns its
//! finish writes; the claim and the finish CAS are the mechanism's.

use super::{finish_cas, CallStatus, Claimed, Leased, Settle};
use crate::domain::{AttemptResult, DeliveryRow, DeliveryStatus, PlatformCallStatus};
use crate::error::Error;
use crate::store::{escape_foreign_text, params, LeasedTable, PlatformCallRow, WriteTx};
use crate::store::{PLATFORM_CALLS, WEBHOOK_DELIVERIES};

impl CallStatus for DeliveryStatus {
    const PENDING: DeliveryStatus = DeliveryStatus::Pending;
    fn as_str(self) -> &'static str {
        DeliveryStatus::as_str(self)
    }
}

impl CallStatus for PlatformCallStatus {
    const PENDING: PlatformCallStatus = PlatformCallStatus::Pending;
    fn as_str(self) -> &'static str {
        PlatformCallStatus::as_str(self)
    }
}

impl Leased for DeliveryRow {
    type Status = DeliveryStatus;
    type Outcome = AttemptResult;
    const TABLE: &'static LeasedTable = &WEBHOOK_DELIVERIES;

    fn id(&self) -> i64 {
        self.id
    }
    fn status(&self) -> DeliveryStatus {
        self.status
    }
    fn attempts(&self) -> i64 {
        self.attempts
    }
    fn next_attempt_at(&self) -> Option<&str> {
        self.next_attempt_at.as_deref()
    }

    /// `last_status` and `last_error` (escaped); a 410 disables the
    /// delivery, then its endpoint with every other pending delivery to it.
    fn record(tx: &WriteTx, claimed: &Claimed<DeliveryRow>, outcome: &AttemptResult, now: &str) -> Result<bool, Error> {
        let (settle, status, error) = match outcome {
            AttemptResult::Delivered { status } => (Settle::Final(DeliveryStatus::Delivered), Some(*status), None),
            AttemptResult::Retry { status, error, next_attempt_at } => {
                (Settle::Retry { at: next_attempt_at.clone() }, *status, Some(error.as_str()))
            }
            AttemptResult::Failed { status, error } => {
                (Settle::Final(DeliveryStatus::Failed), *status, Some(error.as_str()))
            }
            AttemptResult::Gone => {
                (Settle::Final(DeliveryStatus::Disabled), Some(410), Some("endpoint answered 410 Gone"))
            }
        };
        let error = error.map(escape_foreign_text);
        let recorded = finish_cas(tx, claimed, &settle, params![status, error.as_deref()])?;
        if recorded && *outcome == AttemptResult::Gone {
            tx.disable_webhook_endpoint(&claimed.row.endpoint, now)?;
        }
        Ok(recorded)
    }
}

/// How one attempt of a platform call ended: the call's next state, what
/// was sent (its signature left out) and what came back. The texts hold
/// the platform's bytes, so they are stored escaped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlatformAttempt {
    pub settle: Settle<PlatformCallStatus>,
    pub request: String,
    pub http_status: Option<u16>,
    pub response: String,
}

impl Leased for PlatformCallRow {
    type Status = PlatformCallStatus;
    type Outcome = PlatformAttempt;
    const TABLE: &'static LeasedTable = &PLATFORM_CALLS;

    fn id(&self) -> i64 {
        self.id
    }
    fn status(&self) -> PlatformCallStatus {
        self.status
    }
    fn attempts(&self) -> i64 {
        self.attempts
    }
    fn next_attempt_at(&self) -> Option<&str> {
        self.next_attempt_at.as_deref()
    }

    /// `request`, `http_status`, `response` and `updated_at`.
    fn record(
        tx: &WriteTx,
        claimed: &Claimed<PlatformCallRow>,
        outcome: &PlatformAttempt,
        now: &str,
    ) -> Result<bool, Error> {
        let request = escape_foreign_text(&outcome.request);
        let response = escape_foreign_text(&outcome.response);
        finish_cas(tx, claimed, &outcome.settle, params![request.as_ref(), outcome.http_status, response.as_ref(), now])
    }
}
