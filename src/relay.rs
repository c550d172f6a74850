//! The webhook relay (docs/webhooks.md): pushes the outbox to each
//! configured endpoint, at least once, signed per Standard Webhooks,
//! ordered per order.
//!
//! Every delivery is a leased call (`src/outgoing/`). The relay
//! 1. queues: for each enabled endpoint, a `webhook_delivery` row for every
//!    event past the endpoint's cursor, and moves the cursor (the outbox is
//!    durable, so an event committed is an event relayed, whenever the relay
//!    gets to it);
//! 2. claims, in the same transaction: the due deliveries (each the earliest
//!    pending event of its order at its endpoint), each attempt by the
//!    mechanism's CAS on `next_attempt_at` (`Webhooks::claim_webhook_attempts`);
//! 3. calls, outside any transaction, signed afresh for this attempt;
//! 4. records the result by the CAS on the claimed attempt number
//!    (`Webhooks::finish_webhook_attempt`); a failure waits on the jittered
//!    `--webhook-retry-s` schedule, stretched by a `Retry-After`.
//!
//! Threads: the mechanism's worker (`outgoing::spawn`), one dispatcher
//! (steps 1 and 2; it sleeps on the store's outbox signal, so an event of
//! this process is relayed at once, and polls for the rest) and
//! `--webhook-concurrency` senders (steps 3 and 4), so a hanging endpoint
//! call holds one sender and only its own order.

use crate::app::App;
use crate::domain::AttemptResult;
use crate::error::Error;
use crate::log;
use crate::outgoing::{self, random_unit, AtShutdown, Queue, Schedule, Shape, Spent};
use crate::render;
use crate::store::escape_foreign_text;
use crate::webhook::{retry_after_ms, signature_header, ERROR_TEXT_MAX, JITTER_FRACTION};
pub use crate::webhook_ops::Attempt;
use std::io::Read;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

pub struct Relay {
    app: Arc<App>,
    agent: ureq::Agent,
}

impl Relay {
    /// A relay for `app`'s configured endpoints, registering each (a new one
    /// starts after the outbox's last seq now).
    pub fn new(app: Arc<App>) -> Result<Relay, Error> {
        let settings = &app.config().webhooks;
        for endpoint in &settings.endpoints {
            let row = app.webhooks().register_webhook_endpoint(endpoint)?;
            log::info(
                "webhook endpoint",
                &[
                    ("endpoint", &row.endpoint),
                    ("status", &if row.enabled { "enabled" } else { "disabled" }),
                    ("from_seq", &row.from_seq),
                    ("relayed_seq", &row.relayed_seq),
                ],
            );
        }
        // The whole call within the timeout, a 4xx or 5xx an answer to
        // record, a redirect a failed attempt, the configured URL called directly.
        let agent = crate::platforms::agent(Duration::from_millis(settings.timeout_ms));
        Ok(Relay { agent, app })
    }

    /// Steps 3 and 4: makes one claimed attempt and records how it ended.
    pub fn attempt(&self, claimed: &Attempt) -> AttemptResult {
        let settings = &self.app.config().webhooks;
        let delivery = &claimed.delivery.row;
        let body = render::event(&claimed.event).to_string();
        let timestamp_s = self.app.clock().now_ms().div_euclid(1000);
        let signature = signature_header(&settings.secrets.current(), &delivery.event_id, timestamp_s, body.as_bytes());
        let sent = self
            .agent
            .post(&delivery.endpoint)
            .header("content-type", "application/json")
            .header("webhook-id", &delivery.event_id)
            .header("webhook-timestamp", &timestamp_s.to_string())
            .header("webhook-signature", &signature)
            .send(body.as_bytes());
        let now_ms = self.app.clock().now_ms();
        let (status, error, retry_after) = match sent {
            Ok(mut answer) => {
                let status = answer.status().as_u16();
                if answer.status().is_success() {
                    return self.record(claimed, AttemptResult::Delivered { status }, now_ms);
                }
                if status == 410 {
                    return self.record(claimed, AttemptResult::Gone, now_ms);
                }
                let retry_after = answer
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| retry_after_ms(v, now_ms));
                let mut text = Vec::new();
                let _ = answer.body_mut().as_reader().take(ERROR_TEXT_MAX as u64).read_to_end(&mut text);
                let text = String::from_utf8_lossy(&text);
                (Some(status), format!("HTTP {status}: {}", text.trim()), retry_after)
            }
            Err(e) => (None, e.to_string(), None),
        };
        // Escaped before it is cut, so what is recorded stays within the limit.
        let error: String = escape_foreign_text(&error).chars().take(ERROR_TEXT_MAX).collect();
        let schedule = Schedule::new(&settings.retry_schedule_ms, JITTER_FRACTION, Spent::GiveUp);
        let result = match schedule.next_attempt_at(now_ms, claimed.delivery.attempt, random_unit(), retry_after) {
            Some(next_attempt_at) => AttemptResult::Retry { status, error, next_attempt_at },
            None => AttemptResult::Failed { status, error },
        };
        self.record(claimed, result, now_ms)
    }

    fn record(&self, claimed: &Attempt, result: AttemptResult, now_ms: i64) -> AttemptResult {
        let delivery = &claimed.delivery.row;
        let label = match &result {
            AttemptResult::Delivered { .. } => "delivered",
            AttemptResult::Retry { .. } => "retried",
            AttemptResult::Failed { .. } => "failed",
            AttemptResult::Gone => "disabled",
        };
        let fields: [(&str, &dyn std::fmt::Display); 4] = [
            ("delivery", &delivery.id),
            ("endpoint", &delivery.endpoint),
            ("event_id", &delivery.event_id),
            ("attempt", &claimed.delivery.attempt),
        ];
        let recorded = match self.app.webhooks().finish_webhook_attempt(claimed, &result, now_ms) {
            Ok(recorded) => recorded,
            // The lease runs out and the attempt is made again: at least once.
            Err(e) => {
                log::warn(
                    "recording a webhook attempt failed; it will be retried when its lease runs out",
                    &[fields[0], fields[1], fields[2], fields[3], ("result", &label), ("error", &e)],
                );
                return result;
            }
        };
        if !recorded {
            // Its lease ran out and another attempt was claimed, or the endpoint was disabled meanwhile.
            log::warn(
                "webhook attempt result not recorded: the delivery moved on during the call",
                &[fields[0], fields[1], fields[2], fields[3], ("result", &label)],
            );
            return result;
        }
        self.app.metrics().observe_webhook(label);
        match &result {
            AttemptResult::Delivered { .. } => log::debug("webhook delivered", &fields),
            AttemptResult::Retry { error, next_attempt_at, .. } => log::warn(
                "webhook attempt failed, will retry",
                &[fields[0], fields[1], fields[2], fields[3], ("error", error), ("next_attempt_at", next_attempt_at)],
            ),
            AttemptResult::Failed { error, .. } => log::error(
                "webhook delivery failed after its last retry (dead letter)",
                &[fields[0], fields[1], fields[2], fields[3], ("error", error)],
            ),
            AttemptResult::Gone => log::error(
                "webhook endpoint answered 410 Gone: disabled with every pending delivery to it; \
                 POST /v1/webhooks/endpoints/enable re-enables it",
                &fields,
            ),
        }
        result
    }

    /// One whole round, for tests and tools that drive the relay by hand:
    /// queues, claims up to `--webhook-concurrency` attempts, makes them
    /// concurrently and waits for all. Returns the results.
    pub fn run_once(&self) -> Result<Vec<AttemptResult>, Error> {
        outgoing::run_once(self, self.app.config().webhooks.concurrency)
    }
}

impl Queue for Relay {
    type Job = Attempt;
    type Done = AttemptResult;
    const ROUND_FAILED: &'static str = "webhook relay round failed, will retry";

    /// Every write would be refused otherwise; the storage watch says so.
    fn ready(&self) -> bool {
        self.app.operations().storage_writable()
    }

    /// Steps 1 and 2, in one transaction per endpoint: up to `limit` due
    /// attempts across the enabled endpoints.
    fn claim_due(&self, limit: usize) -> Result<Vec<Attempt>, Error> {
        let mut claimed = Vec::new();
        for endpoint in &self.app.config().webhooks.endpoints {
            let want = limit.saturating_sub(claimed.len());
            if want == 0 {
                break;
            }
            claimed.extend(self.app.webhooks().claim_webhook_attempts(endpoint, want)?);
        }
        Ok(claimed)
    }

    fn work(&self, claimed: &Attempt) -> AttemptResult {
        self.attempt(claimed)
    }
}

/// Starts the relay's dispatcher and senders; returns the dispatcher, which
/// ends when `shutdown` is set, after the senders' current calls.
pub fn spawn_relay(app: Arc<App>, shutdown: Arc<AtomicBool>) -> Result<Option<JoinHandle<()>>, Error> {
    if app.config().webhooks.endpoints.is_empty() {
        return Ok(None);
    }
    let relay = Arc::new(Relay::new(Arc::clone(&app))?);
    let shape = Shape {
        name: "payonce-webhook-relay",
        sender_name: "payonce-webhook",
        concurrency: app.config().webhooks.concurrency,
        // A delivered event may free the next event of its order: each call rings it too.
        wake: app.webhooks().outbox_signal(),
        poll: Duration::from_millis(app.config().webhooks.poll_ms.max(1)),
        at_shutdown: AtShutdown::LeaveCalls,
    };
    let dispatcher = outgoing::spawn(relay, shape, shutdown)
        .map_err(|e| Error::internal(format!("cannot start the webhook relay: {e}")))?;
    Ok(Some(dispatcher))
}
