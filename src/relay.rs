//! The webhook relay (PRODUCT.md section 10): pushes the outbox to each
//! configured endpoint, at least once, signed per Standard Webhooks,
//! ordered per order.
//!
//! Every outgoing call is a row first. The relay
//! 1. queues: for each enabled endpoint, a `webhook_delivery` row for every
//!    event past the endpoint's cursor, and moves the cursor (the outbox is
//!    durable, so an event committed is an event relayed, whenever the relay
//!    gets to it);
//! 2. claims, in the same transaction: the due deliveries (each the earliest
//!    pending event of its order at its endpoint), each attempt by a CAS on
//!    `next_attempt_at`, moving it past the call's timeout (the lease), with
//!    `attempts + 1`; then commits: several processes on one database make
//!    one attempt at a time, and a process that dies mid-call leaves the
//!    delivery to be retried when its lease runs out;
//! 3. calls, outside any transaction, signed afresh for this attempt;
//! 4. records the result by a CAS on the claimed attempt number.
//!
//! Threads: one dispatcher (steps 1 and 2; it sleeps on the store's outbox
//! signal, so an event of this process is relayed at once, and polls for the
//! rest) and `--webhook-concurrency` senders (steps 3 and 4), so a hanging
//! endpoint call holds one sender and only its own order.

use crate::app::App;
use crate::clock::format_ms;
use crate::domain::{AttemptResult, DeliveryRow, EventRow};
use crate::error::Error;
use crate::log;
use crate::render;
use crate::store::escape_foreign_text;
use crate::webhook::{next_wait_ms, random_unit, retry_after_ms, signature_header, ERROR_TEXT_MAX};
use std::io::Read;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// Events queued per endpoint per round; the next round queues more.
const QUEUE_BATCH_MAX: usize = 1_000;

/// One claimed attempt: the delivery as claimed, its attempt number and the event.
pub struct Attempt {
    pub delivery: DeliveryRow,
    pub attempt: i64,
    pub event: EventRow,
}

pub struct Relay {
    app: Arc<App>,
    agent: ureq::Agent,
    /// Attempts claimed and not yet recorded.
    in_flight: AtomicUsize,
}

impl Relay {
    /// A relay for `app`'s configured endpoints, registering each (a new one
    /// starts after the outbox's last seq now).
    pub fn new(app: Arc<App>) -> Result<Relay, Error> {
        let settings = &app.config.webhooks;
        let now = app.clock.now_text();
        for endpoint in &settings.endpoints {
            let row = app.store.write(&[], |tx| tx.ensure_webhook_endpoint(endpoint, &now))?;
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
        Ok(Relay { agent, app, in_flight: AtomicUsize::new(0) })
    }

    /// Steps 1 and 2, in one transaction per endpoint: queues a delivery
    /// for every event past the endpoint's cursor (a batch at a time), then
    /// claims up to `limit` due attempts across the enabled endpoints.
    pub fn claim_due(&self, limit: usize) -> Result<Vec<Attempt>, Error> {
        let settings = &self.app.config.webhooks;
        let mut claimed = Vec::new();
        for endpoint in &settings.endpoints {
            let want = limit.saturating_sub(claimed.len());
            if want == 0 {
                break;
            }
            let now_ms = self.app.clock.now_ms();
            let now = format_ms(now_ms);
            let lease_until = format_ms(now_ms.saturating_add(i64::try_from(settings.lease_ms()).unwrap_or(i64::MAX)));
            // A read first, so an idle relay never takes the writer.
            let work =
                self.app.store.read(|tx| match tx.webhook_endpoint(endpoint)? {
                    Some(row) if row.enabled => Ok(tx.last_event_seq()? > row.relayed_seq
                        || !tx.due_webhook_deliveries(endpoint, &now, 1)?.is_empty()),
                    _ => Ok(false),
                })?;
            if !work {
                continue;
            }
            let won = self.app.store.write(&[], |tx| {
                let mut won = Vec::new();
                let Some(row) = tx.webhook_endpoint(endpoint)?.filter(|row| row.enabled) else {
                    return Ok(won);
                };
                tx.queue_webhook_deliveries(&row, &now, QUEUE_BATCH_MAX)?;
                for delivery in tx.due_webhook_deliveries(endpoint, &now, want)? {
                    let seen = delivery.next_attempt_at.as_deref().unwrap_or_default();
                    if tx.claim_webhook_attempt(delivery.id, seen, &lease_until, &now)? {
                        let event = tx.event(delivery.event_seq)?.ok_or_else(|| {
                            Error::internal(format!("delivery {} names a missing event", delivery.id))
                        })?;
                        let attempt = delivery.attempts + 1;
                        won.push(Attempt { delivery, attempt, event });
                    }
                }
                Ok(won)
            })?;
            claimed.extend(won);
        }
        Ok(claimed)
    }

    /// Steps 3 and 4: makes one claimed attempt and records how it ended.
    pub fn attempt(&self, claimed: &Attempt) -> AttemptResult {
        let settings = &self.app.config.webhooks;
        let delivery = &claimed.delivery;
        let body = render::event(&claimed.event).to_string();
        let timestamp_s = self.app.clock.now_ms().div_euclid(1000);
        let signature = signature_header(&settings.secrets, &delivery.event_id, timestamp_s, body.as_bytes());
        let sent = self
            .agent
            .post(&delivery.endpoint)
            .header("content-type", "application/json")
            .header("webhook-id", &delivery.event_id)
            .header("webhook-timestamp", &timestamp_s.to_string())
            .header("webhook-signature", &signature)
            .send(body.as_bytes());
        let now_ms = self.app.clock.now_ms();
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
        let result = match next_wait_ms(&settings.retry_schedule_ms, claimed.attempt, retry_after, random_unit()) {
            Some(wait_ms) => AttemptResult::Retry {
                status,
                error,
                next_attempt_at: format_ms(now_ms.saturating_add(i64::try_from(wait_ms).unwrap_or(i64::MAX))),
            },
            None => AttemptResult::Failed { status, error },
        };
        self.record(claimed, result, now_ms)
    }

    fn record(&self, claimed: &Attempt, result: AttemptResult, now_ms: i64) -> AttemptResult {
        let delivery = &claimed.delivery;
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
            ("attempt", &claimed.attempt),
        ];
        let recorded = match self.finish(claimed, &result, now_ms) {
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
        self.app.metrics.observe_webhook(label);
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

    /// Step 4's write: true when this attempt's result was recorded. When
    /// the receiver's text cannot be stored, a second write records the
    /// same state change with payonce's own words instead, so the schedule
    /// moves on whatever the receiver sent (docs/operations.md, "Someone
    /// else's bytes, and NUL bytes").
    fn finish(&self, claimed: &Attempt, result: &AttemptResult, now_ms: i64) -> Result<bool, Error> {
        let now = format_ms(now_ms);
        let delivery = &claimed.delivery;
        let first = self.app.store.write(&[], |tx| tx.finish_webhook_attempt(delivery, claimed.attempt, result, &now));
        let Err(e) = first else {
            return first;
        };
        let why = format!("the receiver's answer could not be recorded: {e}");
        let why: String = escape_foreign_text(&why).chars().take(ERROR_TEXT_MAX).collect();
        let fallback = match result {
            AttemptResult::Retry { status, next_attempt_at, .. } => {
                AttemptResult::Retry { status: *status, error: why, next_attempt_at: next_attempt_at.clone() }
            }
            AttemptResult::Failed { status, .. } => AttemptResult::Failed { status: *status, error: why },
            // Nothing of the receiver's is in these: the first error was the database's.
            AttemptResult::Delivered { .. } | AttemptResult::Gone => return Err(e),
        };
        log::warn(
            "a webhook attempt's result could not be recorded as received; recording it without the receiver's text",
            &[("delivery", &delivery.id), ("attempt", &claimed.attempt), ("error", &e)],
        );
        self.app.store.write(&[], |tx| tx.finish_webhook_attempt(delivery, claimed.attempt, &fallback, &now))
    }

    /// One whole round, for tests and tools that drive the relay by hand:
    /// queues, claims up to `--webhook-concurrency` attempts, makes them
    /// concurrently and waits for all. Returns the results.
    pub fn run_once(&self) -> Result<Vec<AttemptResult>, Error> {
        let claimed = self.claim_due(self.app.config.webhooks.concurrency)?;
        Ok(thread::scope(|scope| {
            let calls: Vec<_> = claimed.iter().map(|c| scope.spawn(|| self.attempt(c))).collect();
            calls.into_iter().filter_map(|call| call.join().ok()).collect()
        }))
    }
}

/// Starts the relay's dispatcher and senders; returns the dispatcher, which
/// ends when `shutdown` is set (the senders end with their current call).
pub fn spawn_relay(app: Arc<App>, shutdown: Arc<AtomicBool>) -> Result<Option<JoinHandle<()>>, Error> {
    if app.config.webhooks.endpoints.is_empty() {
        return Ok(None);
    }
    let relay = Arc::new(Relay::new(Arc::clone(&app))?);
    let concurrency = app.config.webhooks.concurrency.max(1);
    let poll = Duration::from_millis(app.config.webhooks.poll_ms.max(1));
    let signal = app.store.outbox_signal();
    let (jobs, queue) = crossbeam_channel::bounded::<Attempt>(concurrency);
    for n in 0..concurrency {
        let (relay, queue, signal) = (Arc::clone(&relay), queue.clone(), Arc::clone(&signal));
        thread::Builder::new()
            .name(format!("payonce-webhook-{n}"))
            .spawn(move || {
                for claimed in queue {
                    relay.attempt(&claimed);
                    relay.in_flight.fetch_sub(1, Ordering::SeqCst);
                    // A delivered event may free the next event of its order.
                    signal.ring();
                }
            })
            .map_err(|e| Error::internal(format!("cannot start a webhook sender: {e}")))?;
    }
    let dispatcher = thread::Builder::new()
        .name("payonce-webhook-relay".into())
        .spawn(move || {
            while !shutdown.load(Ordering::SeqCst) {
                let seen = signal.count();
                if let Err(e) = dispatch(&relay, &jobs, concurrency) {
                    log::warn("webhook relay round failed, will retry", &[("error", &e)]);
                }
                signal.wait_past(seen, poll);
            }
        })
        .map_err(|e| Error::internal(format!("cannot start the webhook relay: {e}")))?;
    Ok(Some(dispatcher))
}

fn dispatch(relay: &Relay, jobs: &crossbeam_channel::Sender<Attempt>, concurrency: usize) -> Result<(), Error> {
    // Every write would be refused; the storage watch says so.
    if relay.app.store.check_storage().is_err() {
        return Ok(());
    }
    let free = concurrency.saturating_sub(relay.in_flight.load(Ordering::SeqCst));
    if free == 0 {
        return Ok(());
    }
    for claimed in relay.claim_due(free)? {
        relay.in_flight.fetch_add(1, Ordering::SeqCst);
        if jobs.send(claimed).is_err() {
            relay.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
    }
    Ok(())
}
