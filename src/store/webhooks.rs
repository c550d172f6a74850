//! The webhook relay's queries (docs/webhooks.md): endpoints, their
//! cursor over the outbox, deliveries, disable/enable/retry/replay.
//!
//! Every change of a delivery is a compare-and-set whose affected-row count
//! decides. An attempt is a leased call (`src/outgoing/`): it is claimed and
//! finished by the statements of [`WEBHOOK_DELIVERIES`] (`store/leases.rs`),
//! so a stale finisher (a lease that expired and was claimed again) changes
//! nothing.

use super::leases::{leased_table, LeasedTable};
use super::{limit_param, one_row, params, ReadTx, Row, WriteTx};
use crate::domain::{DeliveryRow, DeliveryStatus, EndpointRow};
use crate::error::Error;

/// `webhook_delivery` as a table of leased calls: a claim stamps
/// `last_attempt_at`; a finish sets `last_status` (`?5`) and `last_error` (`?6`).
pub const WEBHOOK_DELIVERIES: LeasedTable =
    leased_table!("webhook_delivery", touched: "last_attempt_at", columns: "last_status = ?5, last_error = ?6");

fn endpoint_from_row(r: &Row) -> Result<EndpointRow, Error> {
    let status = r.text(1)?;
    Ok(EndpointRow {
        endpoint: r.text(0)?,
        enabled: match status.as_str() {
            "enabled" => true,
            "disabled" => false,
            other => return Err(super::bad_value("webhook_endpoint.status", other)),
        },
        from_seq: r.int(2)?,
        relayed_seq: r.int(3)?,
        disabled_at: r.opt_text(4)?,
    })
}

fn delivery_from_row(r: &Row) -> Result<DeliveryRow, Error> {
    let status = r.text(5)?;
    Ok(DeliveryRow {
        id: r.int(0)?,
        endpoint: r.text(1)?,
        event_seq: r.int(2)?,
        event_id: r.text(3)?,
        order_no: r.text(4)?,
        status: DeliveryStatus::parse(&status).ok_or_else(|| super::bad_value("webhook_delivery.status", &status))?,
        attempts: r.int(6)?,
        next_attempt_at: r.opt_text(7)?,
        last_attempt_at: r.opt_text(8)?,
        last_status: r.opt_int(9)?,
        last_error: r.opt_text(10)?,
        queued_at: r.text(11)?,
    })
}

/// `SELECT` the columns [`delivery_from_row`] reads `FROM webhook_delivery d`
/// followed by `$rest`, as one literal (statements are cached by their text).
macro_rules! select_deliveries {
    ($rest:literal) => {
        concat!(
            "SELECT d.id, d.endpoint, d.event_seq, d.event_id, d.order_no, d.status, d.attempts, d.next_attempt_at,
                    d.last_attempt_at, d.last_status, d.last_error, d.queued_at
             FROM webhook_delivery d ",
            $rest
        )
    };
}

/// Replay queues at most this many events per call.
pub const REPLAY_EVENTS_MAX: usize = 10_000;

impl ReadTx<'_> {
    pub fn webhook_endpoint(&self, endpoint: &str) -> Result<Option<EndpointRow>, Error> {
        self.optional(
            "SELECT endpoint, status, from_seq, relayed_seq, disabled_at FROM webhook_endpoint WHERE endpoint = ?1",
            params![endpoint],
            endpoint_from_row,
        )
    }

    pub fn webhook_delivery(&self, id: i64) -> Result<Option<DeliveryRow>, Error> {
        self.optional(select_deliveries!("WHERE d.id = ?1"), params![id], delivery_from_row)
    }

    /// Every delivery of an order's events, to every endpoint, by event then
    /// endpoint: the order's events by `ix_outbox_event_order`, each
    /// probed at each endpoint by `uk_endpoint_event` (no index holds
    /// `webhook_delivery.order_no` beyond the pending rows).
    pub fn webhook_deliveries_of_order(&self, order_no: &str) -> Result<Vec<DeliveryRow>, Error> {
        self.all(
            select_deliveries!(
                ", outbox_event e
                 WHERE e.order_no = ?1 AND d.endpoint IN (SELECT endpoint FROM webhook_endpoint)
                   AND d.event_id = e.event_id
                 ORDER BY e.seq, d.endpoint"
            ),
            params![order_no],
            delivery_from_row,
        )
    }

    /// One page of deliveries by id, after `after`, of one status or all.
    pub fn webhook_deliveries(
        &self,
        status: Option<DeliveryStatus>,
        after: i64,
        limit: usize,
    ) -> Result<Vec<DeliveryRow>, Error> {
        match status {
            None => self.all(
                select_deliveries!("WHERE d.id > ?1 ORDER BY d.id LIMIT ?2"),
                params![after, limit_param(limit)],
                delivery_from_row,
            ),
            Some(status) => self.all(
                select_deliveries!("WHERE d.status = ?1 AND d.id > ?2 ORDER BY d.id LIMIT ?3"),
                params![status.as_str(), after, limit_param(limit)],
                delivery_from_row,
            ),
        }
    }

    /// The deliveries to `endpoint` whose attempt may start at `now`, each
    /// the earliest pending event of its order there (a later event of an
    /// order waits until the earlier ones were delivered or failed; other
    /// orders do not wait for it), soonest due first.
    pub fn due_webhook_deliveries(&self, endpoint: &str, now: &str, limit: usize) -> Result<Vec<DeliveryRow>, Error> {
        self.all(
            select_deliveries!(
                "WHERE d.status = 'pending' AND d.next_attempt_at <= ?2 AND d.endpoint = ?1
                   AND NOT EXISTS (SELECT 1 FROM webhook_delivery e
                                   WHERE e.endpoint = d.endpoint AND e.order_no = d.order_no
                                     AND e.status = 'pending' AND e.event_seq < d.event_seq)
                 ORDER BY d.next_attempt_at, d.id LIMIT ?3"
            ),
            params![endpoint, now, limit_param(limit)],
            delivery_from_row,
        )
    }

    /// (pending deliveries, the `queued_at` of the oldest), for `/metrics`.
    pub fn webhook_pending(&self) -> Result<(i64, Option<String>), Error> {
        self.one("SELECT count(*), min(queued_at) FROM webhook_delivery WHERE status = 'pending'", params![], |r| {
            Ok((r.int(0)?, r.opt_text(1)?))
        })
    }
}

impl WriteTx<'_> {
    /// Registers a configured endpoint once: a new one starts after the
    /// outbox's last seq now (older events reach it by replay only). Returns
    /// the row, new or as it was.
    pub fn ensure_webhook_endpoint(&self, endpoint: &str, now: &str) -> Result<EndpointRow, Error> {
        self.execute(
            "INSERT INTO webhook_endpoint (endpoint, status, from_seq, relayed_seq, disabled_at, created_at)
             SELECT ?1, 'enabled', last.seq, last.seq, NULL, ?2
             FROM (SELECT coalesce(max(seq), 0) AS seq FROM outbox_event) AS last
             WHERE true
             ON CONFLICT (endpoint) DO NOTHING",
            params![endpoint, now],
        )?;
        self.webhook_endpoint(endpoint)?.ok_or_else(|| Error::internal("webhook endpoint missing after its insert"))
    }

    /// Queues a pending delivery to `endpoint` for each of the next `limit`
    /// events after its cursor and moves the cursor past them. Returns how
    /// many events the cursor passed (fewer than `limit`: caught up).
    pub fn queue_webhook_deliveries(&self, endpoint: &EndpointRow, now: &str, limit: usize) -> Result<usize, Error> {
        let (passed, last) = self.one(
            "SELECT count(*), max(seq) FROM
               (SELECT seq FROM outbox_event WHERE seq > ?1 ORDER BY seq LIMIT ?2) AS next_events",
            params![endpoint.relayed_seq, limit_param(limit)],
            |r| Ok((r.int(0)?, r.opt_int(1)?)),
        )?;
        let Some(last) = last else {
            return Ok(0);
        };
        self.insert_deliveries(&endpoint.endpoint, endpoint.relayed_seq, last, now)?;
        // Another process may have moved the cursor meanwhile; it only ever grows.
        self.execute(
            "UPDATE webhook_endpoint SET relayed_seq = ?2 WHERE endpoint = ?1 AND relayed_seq < ?2",
            params![&endpoint.endpoint, last],
        )?;
        Ok(usize::try_from(passed).unwrap_or(0))
    }

    /// A pending delivery, due now, for every event in (after, until] that
    /// has none to `endpoint` yet.
    fn insert_deliveries(&self, endpoint: &str, after: i64, until: i64, now: &str) -> Result<usize, Error> {
        self.execute(
            "INSERT INTO webhook_delivery (endpoint, event_seq, event_id, order_no, status, attempts,
                                           next_attempt_at, queued_at)
             SELECT ?1, seq, event_id, order_no, 'pending', 0, ?4, ?4
             FROM outbox_event WHERE seq > ?2 AND seq <= ?3 ORDER BY seq
             ON CONFLICT (endpoint, event_id) DO NOTHING",
            params![endpoint, after, until, now],
        )
    }

    /// Disables an endpoint and stops every pending delivery to it.
    pub fn disable_webhook_endpoint(&self, endpoint: &str, now: &str) -> Result<(), Error> {
        self.execute(
            "UPDATE webhook_endpoint SET status = 'disabled', disabled_at = ?2
             WHERE endpoint = ?1 AND status = 'enabled'",
            params![endpoint, now],
        )?;
        self.execute(
            "UPDATE webhook_delivery SET status = 'disabled', next_attempt_at = NULL
             WHERE endpoint = ?1 AND status = 'pending'",
            params![endpoint],
        )?;
        Ok(())
    }

    /// Enables an endpoint; its disabled deliveries are pending again, due
    /// now, with the whole schedule ahead. Returns how many resumed.
    pub fn enable_webhook_endpoint(&self, endpoint: &str, now: &str) -> Result<usize, Error> {
        self.execute(
            "UPDATE webhook_endpoint SET status = 'enabled', disabled_at = NULL
             WHERE endpoint = ?1 AND status = 'disabled'",
            params![endpoint],
        )?;
        self.execute(
            "UPDATE webhook_delivery SET status = 'pending', attempts = 0, next_attempt_at = ?2, queued_at = ?2
             WHERE endpoint = ?1 AND status = 'disabled'",
            params![endpoint, now],
        )
    }

    /// A failed or disabled delivery back to pending, due now, with the
    /// whole schedule ahead; false when it is pending or delivered.
    pub fn retry_webhook_delivery(&self, id: i64, now: &str) -> Result<bool, Error> {
        let changed = self.execute(
            "UPDATE webhook_delivery SET status = 'pending', attempts = 0, next_attempt_at = ?2, queued_at = ?2
             WHERE id = ?1 AND status IN ('failed', 'disabled')",
            params![id, now],
        )?;
        one_row(changed, "retry webhook delivery")
    }

    /// Queues the events in (after_seq, until_seq] again to `endpoint`, at
    /// most [`REPLAY_EVENTS_MAX`] of them from the first: each gets a
    /// delivery if it had none, and a delivered, failed or disabled one is
    /// pending again, due now (the same `webhook-id`); a pending one is left
    /// as it is, so an attempt in flight is never doubled. Returns (events
    /// now pending, the seq of the last one when the range held more).
    pub fn replay_webhook_deliveries(
        &self,
        endpoint: &str,
        after_seq: i64,
        until_seq: i64,
        now: &str,
    ) -> Result<(usize, Option<i64>), Error> {
        let (count, last) = self.one(
            "SELECT count(*), max(seq) FROM
               (SELECT seq FROM outbox_event WHERE seq > ?1 AND seq <= ?2 ORDER BY seq LIMIT ?3) AS replayed",
            params![after_seq, until_seq, limit_param(REPLAY_EVENTS_MAX)],
            |r| Ok((r.int(0)?, r.opt_int(1)?)),
        )?;
        let Some(last) = last else {
            return Ok((0, None));
        };
        self.insert_deliveries(endpoint, after_seq, last, now)?;
        self.execute(
            "UPDATE webhook_delivery SET status = 'pending', attempts = 0, next_attempt_at = ?4, queued_at = ?4
             WHERE endpoint = ?1 AND event_seq > ?2 AND event_seq <= ?3 AND status <> 'pending'",
            params![endpoint, after_seq, last, now],
        )?;
        let count = usize::try_from(count).unwrap_or(0);
        let more = count == REPLAY_EVENTS_MAX
            && self
                .optional(
                    "SELECT seq FROM outbox_event WHERE seq > ?1 AND seq <= ?2 ORDER BY seq LIMIT 1",
                    params![last, until_seq],
                    |r| r.int(0),
                )?
                .is_some();
        Ok((count, more.then_some(last)))
    }
}
