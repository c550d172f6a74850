//! Webhooks: the admin operations (list deliveries, retry one, re-enable
//! an endpoint, replay a range of events; each change a CAS in one
//! transaction with its audit row) and the relay's reads and writes
//! (`relay.rs` makes the attempts between them, each a leased call of
//! `src/outgoing/`).

use super::Core;
use crate::domain::{AttemptResult, AuditDetail, DeliveryRow, DeliveryStatus, EndpointRow, IdempotencySlot};
use crate::error::{Error, ErrorKind};
use crate::log;
use crate::outgoing::{self, Lease};
use crate::store::{escape_foreign_text, Signal};
use crate::webhook::ERROR_TEXT_MAX;
use crate::webhook_ops::{endpoint_not_found, Attempt, DeliveryPage, EnabledEndpoint, Replayed};
use std::sync::Arc;

#[derive(Clone, Copy)]
pub struct Webhooks<'a> {
    core: &'a Core,
}

/// Events queued per endpoint per round; the next round queues more.
const QUEUE_BATCH_MAX: usize = 1_000;

impl<'a> Webhooks<'a> {
    pub(crate) fn new(core: &'a Core) -> Webhooks<'a> {
        Webhooks { core }
    }

    /// (deliveries pending, seconds since the oldest of them was queued).
    pub fn webhook_pending(&self) -> Result<(i64, f64), Error> {
        let (pending, oldest) = self.core.store().read(|tx| tx.webhook_pending())?;
        let age_ms = oldest
            .as_deref()
            .and_then(crate::clock::parse_rfc3339_ms)
            .map_or(0, |queued| self.core.clock().now_ms().saturating_sub(queued).max(0));
        Ok((pending, age_ms as f64 / 1000.0))
    }

    pub fn webhook_deliveries(
        &self,
        status: Option<DeliveryStatus>,
        after: i64,
        limit: usize,
    ) -> Result<DeliveryPage, Error> {
        let mut deliveries =
            self.core.store().read(|tx| tx.webhook_deliveries(status, after, limit.saturating_add(1)))?;
        let more = deliveries.len() > limit;
        deliveries.truncate(limit);
        let next_after = if more { deliveries.last().map(|d| d.id) } else { None };
        Ok(DeliveryPage { deliveries, next_after })
    }

    /// A failed or disabled delivery back to pending, due now, with the
    /// whole retry schedule ahead (the same `webhook-id`).
    pub fn retry_webhook_delivery(
        &self,
        id: i64,
        actor: &str,
        slot: Option<&IdempotencySlot>,
    ) -> Result<DeliveryRow, Error> {
        let now = self.core.clock().now_text();
        self.core.write_op(&[], slot, |tx| {
            let delivery = tx.webhook_delivery(id)?.ok_or_else(|| delivery_not_found(id))?;
            let endpoint_enabled = tx.webhook_endpoint(&delivery.endpoint)?.is_some_and(|e| e.enabled);
            if !matches!(delivery.status, DeliveryStatus::Failed | DeliveryStatus::Disabled) {
                return Err(Error::invalid_transition(format!(
                    "delivery {id} is {}: only a failed or disabled delivery can be retried",
                    delivery.status.as_str()
                )));
            }
            if !endpoint_enabled {
                return Err(Error::invalid_transition(format!(
                    "the endpoint of delivery {id} is disabled: POST /v1/webhooks/endpoints/enable first"
                )));
            }
            if !tx.retry_webhook_delivery(id, &now)? {
                return Err(Error::invalid_transition(format!("delivery {id} changed meanwhile; read it again")));
            }
            let detail = AuditDetail::WebhookDeliveryRetried {
                delivery_id: id,
                endpoint: &delivery.endpoint,
                event_id: &delivery.event_id,
                from: delivery.status,
            };
            tx.audit(&now, actor, "webhook_delivery_retried", Some(&delivery.order_no), &detail)?;
            tx.webhook_delivery(id)?.ok_or_else(|| delivery_not_found(id))
        })
    }

    /// Enables an endpoint (after a 410 disabled it); its disabled
    /// deliveries are pending again, due now, in their order.
    pub fn enable_webhook_endpoint(
        &self,
        endpoint: &str,
        actor: &str,
        slot: Option<&IdempotencySlot>,
    ) -> Result<EnabledEndpoint, Error> {
        let now = self.core.clock().now_text();
        let configured = self.core.config().webhooks.is_configured(endpoint);
        self.core.write_op(&[], slot, |tx| {
            let before = match tx.webhook_endpoint(endpoint)? {
                Some(row) => row,
                None if configured => tx.ensure_webhook_endpoint(endpoint, &now)?,
                None => return Err(endpoint_not_found(endpoint)),
            };
            let resumed = tx.enable_webhook_endpoint(endpoint, &now)?;
            if !before.enabled {
                let detail = AuditDetail::WebhookEndpointEnabled {
                    endpoint,
                    disabled_at: before.disabled_at.as_deref(),
                    resumed,
                };
                tx.audit(&now, actor, "webhook_endpoint_enabled", None, &detail)?;
            }
            let endpoint = tx.webhook_endpoint(endpoint)?.ok_or_else(|| endpoint_not_found(endpoint))?;
            Ok(EnabledEndpoint { endpoint, resumed })
        })
    }

    /// Queues the events in (after_seq, until_seq] to a configured endpoint
    /// again, at most [`crate::store::REPLAY_EVENTS_MAX`] from the first.
    pub fn replay_webhooks(
        &self,
        endpoint: &str,
        after_seq: i64,
        until_seq: Option<i64>,
        actor: &str,
        slot: Option<&IdempotencySlot>,
    ) -> Result<Replayed, Error> {
        if after_seq < 0 {
            return Err(Error::invalid("after_seq must be 0 or more"));
        }
        if let Some(until_seq) = until_seq.filter(|until| *until < after_seq) {
            return Err(Error::invalid(format!(
                "after_seq ({after_seq}) must not be greater than until_seq ({until_seq})"
            )));
        }
        if !self.core.config().webhooks.is_configured(endpoint) {
            return Err(endpoint_not_found(endpoint));
        }
        let now = self.core.clock().now_text();
        self.core.write_op(&[], slot, |tx| {
            if !tx.ensure_webhook_endpoint(endpoint, &now)?.enabled {
                return Err(Error::invalid_transition(format!(
                    "endpoint {endpoint:?} is disabled: POST /v1/webhooks/endpoints/enable first"
                )));
            }
            let (queued, next_after) =
                tx.replay_webhook_deliveries(endpoint, after_seq, until_seq.unwrap_or(i64::MAX), &now)?;
            let detail = AuditDetail::WebhookReplayed { endpoint, after_seq, until_seq, queued, next_after };
            tx.audit(&now, actor, "webhook_replayed", None, &detail)?;
            Ok(Replayed { queued, next_after })
        })
    }

    // ---- the relay's reads and writes (`relay.rs` makes the calls between them) ----

    /// Registers a configured endpoint once (a new one starts after the
    /// outbox's last seq now); the row, new or as it was.
    pub fn register_webhook_endpoint(&self, endpoint: &str) -> Result<EndpointRow, Error> {
        let now = self.core.clock().now_text();
        self.core.store().write(&[], |tx| tx.ensure_webhook_endpoint(endpoint, &now))
    }

    /// The relay's steps 1 and 2 for one endpoint, in one transaction:
    /// queues a delivery for every event past its cursor (a batch at a
    /// time), then claims up to `limit` due attempts. A read first, so an
    /// idle relay never takes the writer.
    pub fn claim_webhook_attempts(&self, endpoint: &str, limit: usize) -> Result<Vec<Attempt>, Error> {
        let lease = Lease::new(self.core.clock().now_ms(), self.core.config().webhooks.lease_ms());
        let now = &lease.now;
        let work = self.core.store().read(|tx| match tx.webhook_endpoint(endpoint)? {
            Some(row) if row.enabled => {
                Ok(tx.last_event_seq()? > row.relayed_seq || !tx.due_webhook_deliveries(endpoint, now, 1)?.is_empty())
            }
            _ => Ok(false),
        })?;
        if !work {
            return Ok(Vec::new());
        }
        self.core.store().write(&[], |tx| {
            let mut won = Vec::new();
            let Some(row) = tx.webhook_endpoint(endpoint)?.filter(|row| row.enabled) else {
                return Ok(won);
            };
            tx.queue_webhook_deliveries(&row, now, QUEUE_BATCH_MAX)?;
            for due in tx.due_webhook_deliveries(endpoint, now, limit)? {
                if let Some(delivery) = outgoing::claim_in(tx, &due, &lease)? {
                    let event = tx
                        .event(due.event_seq)?
                        .ok_or_else(|| Error::internal(format!("delivery {} names a missing event", due.id)))?;
                    won.push(Attempt { delivery, event });
                }
            }
            Ok(won)
        })
    }

    /// The relay's step 4: true when this attempt's result was recorded.
    /// When the receiver's text cannot be stored, the same state change is
    /// recorded with payonce's own words instead (`outgoing::finish`).
    pub fn finish_webhook_attempt(
        &self,
        claimed: &Attempt,
        result: &AttemptResult,
        now_ms: i64,
    ) -> Result<bool, Error> {
        let now = crate::clock::format_ms(now_ms);
        let delivery = &claimed.delivery;
        outgoing::finish(self.core.store(), delivery, result, &now, |e| {
            let why = format!("the receiver's answer could not be recorded: {e}");
            let why: String = escape_foreign_text(&why).chars().take(ERROR_TEXT_MAX).collect();
            let fallback = match result {
                AttemptResult::Retry { status, next_attempt_at, .. } => {
                    AttemptResult::Retry { status: *status, error: why, next_attempt_at: next_attempt_at.clone() }
                }
                AttemptResult::Failed { status, .. } => AttemptResult::Failed { status: *status, error: why },
                // Nothing of the receiver's is in these: the first error was the database's.
                AttemptResult::Delivered { .. } | AttemptResult::Gone => return None,
            };
            log::warn(
                "a webhook attempt's result could not be recorded as received; recording it without the receiver's text",
                &[("delivery", &delivery.row.id), ("attempt", &delivery.attempt), ("error", e)],
            );
            Some(fallback)
        })
    }

    /// Rung after each commit of this process that wrote an outbox event:
    /// the relay sleeps on it.
    pub fn outbox_signal(&self) -> Arc<Signal> {
        self.core.store().outbox_signal()
    }
}

fn delivery_not_found(id: i64) -> Error {
    Error::new(ErrorKind::DeliveryNotFound, format!("no webhook delivery with id {id}"))
}
