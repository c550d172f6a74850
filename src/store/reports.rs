//! What operators read: the inspection, reconciliation's view of payments
//! and refunds, the audit trail, and the settings (mode, rewards).
//!
//! Every finding is built here in Rust from plain columns, so neither
//! engine needs JSON functions in SQL; `render.rs` writes its detail.

use super::{params, ReadTx, Row, WriteTx};
use crate::domain::{
    AuditDetail, AuditRow, Finding, FindingDetail, JsonText, StatsCount, StatsSeries, PLATFORM_TIME_AFTER_MS_MAX,
    PLATFORM_TIME_BEFORE_MS_MAX, POINT_TYPE_ORDER_PAID,
};
use crate::error::Error;
use serde_json::Value;

/// The audit actions that carry a refund_no in their own column.
const REFUND_AUDIT_ACTIONS: [&str; 3] = ["unexpected_refund", "unexpected_refund_resolved", "refund_amount_mismatch"];

fn audit_from_row(r: &Row) -> Result<AuditRow, Error> {
    Ok(AuditRow {
        id: r.int(0)?,
        at: r.text(1)?,
        actor: r.text(2)?,
        action: r.text(3)?,
        order_no: r.opt_text(4)?,
        detail: r.text(5)?,
    })
}

/// `ms` milliseconds after (or, negative, before) the RFC 3339 time `at`.
fn shifted(at: &str, ms: i64) -> Result<String, Error> {
    let base =
        crate::clock::parse_rfc3339_ms(at).ok_or_else(|| Error::internal(format!("unparseable stored time {at:?}")))?;
    Ok(crate::clock::format_ms(base.saturating_add(ms)))
}

impl ReadTx<'_> {
    /// `close_unconfirmed`: orders payonce closed locally after giving up on
    /// a platform's confirmation, until an operator resolves them.
    fn unconfirmed_closes(&self, findings: &mut Vec<Finding>) -> Result<(), Error> {
        let mut by_order: Vec<(String, Vec<String>, String)> = Vec::new();
        for r in self.rows(
            "SELECT c.order_no, c.channel, c.updated_at FROM platform_call c
             WHERE c.kind = 'close' AND c.status = 'given_up'
               AND NOT EXISTS (SELECT 1 FROM audit_log a WHERE a.order_no = c.order_no AND a.action = 'close_resolved')
             ORDER BY c.order_no, c.id",
            params![],
        )? {
            let (order_no, channel, at) = (r.text(0)?, r.text(1)?, r.text(2)?);
            match by_order.last_mut() {
                Some((last, channels, _)) if *last == order_no => channels.push(channel),
                _ => by_order.push((order_no, vec![channel], at)),
            }
        }
        for (order_no, channels, given_up_at) in by_order {
            findings.push(Finding {
                kind: "close_unconfirmed",
                order_no,
                detail: FindingDetail::CloseUnconfirmed { platforms: channels, given_up_at },
            });
        }
        Ok(())
    }

    /// Whether an operator resolved an order's unconfirmed close.
    pub fn close_resolution(&self, order_no: &str) -> Result<Option<AuditRow>, Error> {
        Ok(self.audit_of_order(order_no)?.into_iter().find(|a| a.action == "close_resolved"))
    }

    /// Every `audit_log` row about an order, oldest first.
    pub fn audit_of_order(&self, order_no: &str) -> Result<Vec<AuditRow>, Error> {
        self.all(
            "SELECT id, at, actor, action, order_no, detail FROM audit_log WHERE order_no = ?1 ORDER BY id",
            params![order_no],
            audit_from_row,
        )
    }

    /// `audit_log` rows of one action about one refund_no, oldest first.
    pub fn refund_audit(&self, action: &str, refund_no: &str) -> Result<Vec<AuditRow>, Error> {
        self.all(
            "SELECT id, at, actor, action, order_no, detail FROM audit_log
             WHERE refund_no = ?2 AND action = ?1
             ORDER BY id",
            params![action, refund_no],
            audit_from_row,
        )
    }

    pub fn setting(&self, name: &str) -> Result<Option<String>, Error> {
        self.optional("SELECT value FROM settings WHERE name = ?1", params![name], |r| r.text(0))
    }

    // ---- inspection: every query is served by an index ----

    /// Runs every inspection query; `received_before` (now minus
    /// `ops::RECEIVED_STALE_MS`) bounds `received_not_applied`.
    pub fn inspect(&self, received_before: &str) -> Result<Vec<Finding>, Error> {
        let mut findings = Vec::new();
        self.duplicate_rewards(&mut findings)?;
        self.paid_without_rewards(&mut findings)?;
        self.applied_but_not_paid(&mut findings)?;
        self.refunds_required(&mut findings)?;
        self.unexpected_refunds(&mut findings)?;
        self.unconfirmed_closes(&mut findings)?;
        self.received_not_applied(&mut findings, received_before)?;
        Ok(findings)
    }

    /// A coupon template or a points type granted twice for one order.
    fn duplicate_rewards(&self, findings: &mut Vec<Finding>) -> Result<(), Error> {
        for r in self.rows(
            "SELECT o.order_no, d.coupon_template_id, d.n
             FROM (SELECT order_id, coupon_template_id, count(*) AS n FROM user_coupon
                   GROUP BY order_id, coupon_template_id HAVING count(*) > 1) d
             JOIN orders o ON o.id = d.order_id",
            params![],
        )? {
            findings.push(Finding {
                kind: "duplicate_coupon",
                order_no: r.text(0)?,
                detail: FindingDetail::DuplicateCoupon { coupon_template_id: r.text(1)?, rows: r.int(2)? },
            });
        }
        for r in self.rows(
            "SELECT o.order_no, d.point_type, d.n
             FROM (SELECT order_id, point_type, count(*) AS n FROM point_log
                   GROUP BY order_id, point_type, coalesce(refund_no, '') HAVING count(*) > 1) d
             JOIN orders o ON o.id = d.order_id",
            params![],
        )? {
            findings.push(Finding {
                kind: "duplicate_points",
                order_no: r.text(0)?,
                detail: FindingDetail::DuplicatePoints { point_type: r.text(1)?, rows: r.int(2)? },
            });
        }
        Ok(())
    }

    /// An applied payment whose order is not paid by it.
    fn applied_but_not_paid(&self, findings: &mut Vec<Finding>) -> Result<(), Error> {
        for r in self.rows(
            "SELECT o.order_no, p.pay_no, o.status, o.pay_no
             FROM pay_callback_log p JOIN orders o ON o.id = p.order_id
             WHERE p.outcome = 'applied'
               AND (o.status NOT IN ('PAID', 'REFUNDING', 'REFUNDED') OR o.pay_no IS DISTINCT FROM p.pay_no)",
            params![],
        )? {
            let (pay_no, order_status, order_pay_no) = (r.text(1)?, r.text(2)?, r.opt_text(3)?);
            findings.push(Finding {
                kind: "applied_callback_order_not_paid",
                order_no: r.text(0)?,
                detail: FindingDetail::AppliedCallbackOrderNotPaid { pay_no, order_status, order_pay_no },
            });
        }
        Ok(())
    }

    /// Money taken that payonce did not want and nobody resolved yet.
    fn refunds_required(&self, findings: &mut Vec<Finding>) -> Result<(), Error> {
        for r in self.rows(
            "SELECT o.order_no, p.pay_no, p.outcome, p.amount, p.channel, p.decided_at, p.order_id
             FROM pay_callback_log p JOIN orders o ON o.id = p.order_id
             WHERE p.outcome IN ('paid_after_close', 'already_paid', 'amount_mismatch') AND p.resolution IS NULL
             ORDER BY p.id",
            params![],
        )? {
            let (pay_no, outcome, amount) = (r.text(1)?, r.text(2)?, r.int(3)?);
            let (channel, decided_at) = (r.text(4)?, r.opt_text(5)?);
            // Its own refund, when one was asked: in flight, or the failure
            // that left it refund-required again.
            let refund = self.refunds_of_payment(r.int(6)?, &pay_no)?.pop();
            findings.push(Finding {
                kind: "refund_required",
                order_no: r.text(0)?,
                detail: FindingDetail::RefundRequired { pay_no, outcome, amount, channel, decided_at, refund },
            });
        }
        Ok(())
    }

    /// Records received in record-only mode, still undecided in normal mode
    /// since before `received_before`.
    fn received_not_applied(&self, findings: &mut Vec<Finding>, received_before: &str) -> Result<(), Error> {
        for r in self.rows(
            "SELECT o.order_no, p.pay_no, p.received_at
             FROM pay_callback_log p JOIN orders o ON o.id = p.order_id
             WHERE p.state = 'received' AND p.received_at < ?1
               AND (SELECT value FROM settings WHERE name = 'mode') = 'normal'
             ORDER BY p.id",
            params![received_before],
        )? {
            findings.push(Finding {
                kind: "received_not_applied",
                order_no: r.text(0)?,
                detail: FindingDetail::ReceivedNotApplied { pay_no: r.text(1)?, received_at: r.text(2)? },
            });
        }
        Ok(())
    }

    /// Applied payments whose rewards (recorded in `rewards_due` when they
    /// were applied) are not all in the ledgers. One pass over the applied
    /// payments with their coupons beside them, grouped here by payment.
    fn paid_without_rewards(&self, findings: &mut Vec<Finding>) -> Result<(), Error> {
        struct Applied {
            id: i64,
            order_no: String,
            pay_no: String,
            rewards_due: String,
            has_points: bool,
            coupons: Vec<String>,
        }
        fn judge(p: Applied, findings: &mut Vec<Finding>) -> Result<(), Error> {
            let rewards_due: Value = serde_json::from_str(&p.rewards_due)
                .map_err(|e| Error::internal(format!("rewards_due of {} is not JSON: {e}", p.pay_no)))?;
            let missing_coupons: Vec<Value> = rewards_due
                .get("coupons")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter(|t| t.as_str().is_none_or(|t| !p.coupons.iter().any(|c| c == t)))
                .cloned()
                .collect();
            let missing_points = rewards_due.get("points").and_then(Value::as_i64).unwrap_or(0) > 0 && !p.has_points;
            if !missing_coupons.is_empty() || missing_points {
                let pay_no = p.pay_no;
                findings.push(Finding {
                    kind: "paid_without_rewards",
                    order_no: p.order_no,
                    detail: FindingDetail::PaidWithoutRewards { pay_no, rewards_due, missing_coupons, missing_points },
                });
            }
            Ok(())
        }
        let mut current: Option<Applied> = None;
        self.conn.query_each(
            "SELECT p.id, o.order_no, p.pay_no, p.rewards_due,
                    EXISTS (SELECT 1 FROM point_log l WHERE l.order_id = p.order_id AND l.point_type = ?1),
                    c.coupon_template_id
             FROM pay_callback_log p JOIN orders o ON o.id = p.order_id
             LEFT JOIN user_coupon c ON c.order_id = p.order_id
             WHERE p.outcome = 'applied'
             ORDER BY p.id",
            params![POINT_TYPE_ORDER_PAID],
            &mut |r| {
                let id = r.int(0)?;
                if current.as_ref().is_none_or(|c| c.id != id) {
                    if let Some(done) = current.take() {
                        judge(done, findings)?;
                    }
                    current = Some(Applied {
                        id,
                        order_no: r.text(1)?,
                        pay_no: r.text(2)?,
                        rewards_due: r.text(3)?,
                        has_points: r.flag(4)?,
                        coupons: Vec::new(),
                    });
                }
                if let (Some(c), Some(template)) = (current.as_mut(), r.opt_text(5)?) {
                    c.coupons.push(template);
                }
                Ok(())
            },
        )?;
        match current {
            Some(done) => judge(done, findings),
            None => Ok(()),
        }
    }

    /// Unexpected refund results not yet resolved, one finding per
    /// (refund_no, order_no): how many deliveries, the first one's time and
    /// the status it reported.
    fn unexpected_refunds(&self, findings: &mut Vec<Finding>) -> Result<(), Error> {
        for r in self.rows(
            "SELECT g.refund_no, g.order_no, g.deliveries, g.first_at, f.detail
             FROM (SELECT a.refund_no, a.order_no, count(*) AS deliveries, min(a.at) AS first_at,
                          min(a.id) AS first_id
                   FROM audit_log a
                   WHERE a.action IN ('unexpected_refund', 'refund_amount_mismatch') AND a.refund_no IS NOT NULL
                     AND NOT EXISTS (SELECT 1 FROM audit_log r WHERE r.refund_no = a.refund_no
                                     AND r.action = 'unexpected_refund_resolved')
                   GROUP BY a.refund_no, a.order_no) g
             JOIN audit_log f ON f.id = g.first_id
             ORDER BY g.first_id",
            params![],
        )? {
            // The status the first delivery reported.
            let detail: Value = serde_json::from_str(&r.text(4)?).unwrap_or(Value::Null);
            let status = detail.get("status").cloned().unwrap_or(Value::Null);
            findings.push(Finding {
                kind: "unexpected_refund",
                order_no: r.opt_text(1)?.unwrap_or_default(),
                detail: FindingDetail::UnexpectedRefund {
                    refund_no: r.text(0)?,
                    status,
                    deliveries: r.int(2)?,
                    first_at: r.text(3)?,
                },
            });
        }
        Ok(())
    }

    // ---- reconciliation ----

    /// A payment whose money moved (or that waits, recorded, with a
    /// SUCCESS), by pay_no, for matching a platform's SUCCESS row: (its
    /// amount, its order's currency).
    pub fn money_moved_payment(&self, pay_no: &str) -> Result<Option<(i64, String)>, Error> {
        self.optional(
            "SELECT p.amount, o.currency
             FROM pay_callback_log p JOIN orders o ON o.id = p.order_id
             WHERE p.pay_no = ?1 AND p.status = 'SUCCESS'
               AND p.outcome IN ('recorded', 'applied', 'already_paid', 'paid_after_close', 'amount_mismatch')",
            params![pay_no],
            |r| Ok((r.int(0)?, r.text(1)?)),
        )
    }

    /// Applied payments whose paid time is in [from, to). The paid time is
    /// the platform's when it lies within [decided_at − 72 h, decided_at +
    /// 5 min], else `decided_at`: a platform time outside that window (one
    /// recorded before payonce windowed notifications, or by a repair) must
    /// not date an applied payment out of `missing_remote`'s reach. Either
    /// way the paid time lies in that window, so the query reads only the
    /// payments decided within [from − 5 min, to + 72 h) (the index
    /// `ix_pay_callback_log_decided`) and the window is applied here.
    ///
    /// Only the payments of `channel` whose pay_no `wanted` accepts are returned: the
    /// rows are read one at a time, so a period of many payments costs the
    /// memory of the few wanted (reconciliation wants those its statement
    /// does not list), and those are kept compactly ([`PlacedPayments`]).
    /// The sort is stable, so they come in the order they would have among
    /// all.
    pub fn applied_payments_between(
        &self,
        from: &str,
        to: &str,
        channel: &str,
        wanted: &dyn Fn(&str) -> bool,
    ) -> Result<PlacedPayments, Error> {
        let decided_from = shifted(from, -PLATFORM_TIME_AFTER_MS_MAX)?;
        let decided_to = shifted(to, PLATFORM_TIME_BEFORE_MS_MAX)?;
        let mut placed = PlacedPayments::default();
        self.conn.query_each(
            "SELECT p.pay_no, o.order_no, p.amount, p.paid_at, p.decided_at
             FROM pay_callback_log p JOIN orders o ON o.id = p.order_id
             WHERE p.outcome = 'applied' AND p.decided_at >= ?1 AND p.decided_at < ?2 AND p.channel = ?3",
            params![&decided_from, &decided_to, channel],
            &mut |r| {
                let decided_at = r.text(4)?;
                let earliest = shifted(&decided_at, -PLATFORM_TIME_BEFORE_MS_MAX)?;
                let latest = shifted(&decided_at, PLATFORM_TIME_AFTER_MS_MAX)?;
                let paid_time = match r.opt_text(3)? {
                    Some(paid_at) if paid_at >= earliest && paid_at <= latest => paid_at,
                    _ => decided_at,
                };
                let pay_no = r.text(0)?;
                if paid_time.as_str() >= from && paid_time.as_str() < to && wanted(&pay_no) {
                    placed.push(&paid_time, &pay_no, &r.text(1)?, r.int(2)?)?;
                }
                Ok(())
            },
        )?;
        placed.sort();
        Ok(placed)
    }

    /// A SUCCEEDED refund by refund_no: (its own amount, the order's
    /// currency).
    pub fn succeeded_refund(&self, refund_no: &str) -> Result<Option<(i64, String)>, Error> {
        self.optional(
            "SELECT r.amount, o.currency FROM refund r JOIN orders o ON o.id = r.order_id
             WHERE r.refund_no = ?1 AND r.status = 'SUCCEEDED'",
            params![refund_no],
            |r| Ok((r.int(0)?, r.text(1)?)),
        )
    }

    /// SUCCEEDED refunds of `channel` settled in [from, to), by the platform's refund time
    /// when its notice carried one, else by when payonce settled them: each
    /// whose refund_no `wanted` accepts is handed to `each` as (refund_no,
    /// order_no, amount), in that order, as it is read (like
    /// [`ReadTx::applied_payments_between`], a period of many refunds costs
    /// the memory of what `each` keeps).
    pub fn refunds_settled_between(
        &self,
        from: &str,
        to: &str,
        channel: &str,
        wanted: &dyn Fn(&str) -> bool,
        each: &mut dyn FnMut(&str, &str, i64) -> Result<(), Error>,
    ) -> Result<(), Error> {
        // A refund goes back through the platform of the payment it returns:
        // its own payment's (a payment's refund), else its order's applied one.
        self.conn.query_each(
            "SELECT r.refund_no, o.order_no, r.amount FROM refund r JOIN orders o ON o.id = r.order_id
             JOIN pay_callback_log p ON p.pay_no = coalesce(r.pay_no, o.pay_no)
             WHERE r.status = 'SUCCEEDED'
               AND coalesce(r.platform_settled_at, r.settled_at) >= ?1
               AND coalesce(r.platform_settled_at, r.settled_at) < ?2
               AND p.channel = ?3
             ORDER BY coalesce(r.platform_settled_at, r.settled_at)",
            params![from, to, channel],
            &mut |r| {
                let refund_no = r.text(0)?;
                if wanted(&refund_no) {
                    each(&refund_no, &r.text(1)?, r.int(2)?)?;
                }
                Ok(())
            },
        )
    }
}

/// Applied payments placed in a period ([`ReadTx::applied_payments_between`]):
/// (pay_no, order_no, amount) by paid time. Every payment of a day can be
/// wanted (a statement listing none of them), so a payment is one entry of
/// 24 bytes and its texts side by side in one string, not a struct of
/// owned strings (docs/performance.md, "Reconciliation memory").
#[derive(Default)]
pub struct PlacedPayments {
    /// Each payment's paid time, pay_no and order_no, one after the other.
    text: String,
    /// (start in `text`, paid time length, pay_no length, order_no length,
    /// amount); sorted by paid time once all are read.
    entries: Vec<(u32, u16, u16, u32, i64)>,
}

impl PlacedPayments {
    fn push(&mut self, paid_time: &str, pay_no: &str, order_no: &str, amount: i64) -> Result<(), Error> {
        let too_large = || Error::internal("a period's payments exceed what reconciliation can list");
        let start = u32::try_from(self.text.len()).map_err(|_| too_large())?;
        let time_len = u16::try_from(paid_time.len()).map_err(|_| too_large())?;
        let pay_no_len = u16::try_from(pay_no.len()).map_err(|_| too_large())?;
        let order_no_len = u32::try_from(order_no.len()).map_err(|_| too_large())?;
        self.text.push_str(paid_time);
        self.text.push_str(pay_no);
        self.text.push_str(order_no);
        self.entries.push((start, time_len, pay_no_len, order_no_len, amount));
        Ok(())
    }

    /// Stable: payments of the same paid time keep the order they were read in.
    fn sort(&mut self) {
        let text = &self.text;
        self.entries.sort_by(|a, b| Self::texts(text, a).0.cmp(Self::texts(text, b).0));
    }

    /// (paid time, pay_no, order_no) of an entry.
    fn texts<'t>(
        text: &'t str,
        &(start, time, pay_no, order_no, _): &(u32, u16, u16, u32, i64),
    ) -> (&'t str, &'t str, &'t str) {
        let at = |from: usize, len: usize| text.get(from..from + len).unwrap_or_default();
        let (start, time, pay_no, order_no) =
            (start as usize, usize::from(time), usize::from(pay_no), order_no as usize);
        (at(start, time), at(start + time, pay_no), at(start + time + pay_no, order_no))
    }

    /// (pay_no, order_no, amount) by paid time.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str, i64)> + '_ {
        self.entries.iter().map(|entry| {
            let (_, pay_no, order_no) = Self::texts(&self.text, entry);
            (pay_no, order_no, entry.4)
        })
    }
}

/// The statements of `GET /v1/admin/stats`, each counting one series per
/// (key, minute) in [?1, ?2) (RFC 3339 text compares in time order), in
/// SQL both engines accept: `substr` of the stored text is the minute, and
/// the buckets are summed from the minutes in `services/operations.rs`.
/// Which index each reads (`tests/it/stats.rs` checks SQLite's plans):
///
/// - decided payments: `ix_pay_callback_log_decided (outcome, decided_at)`,
///   covering, one range per outcome;
/// - payments waiting in record-only mode: the same index, on `recorded`
///   only (only the waiting records);
/// - refunds still REQUESTED: the partial indexes of refunds in flight
///   (`uk_refund_requested`, `uk_refund_payment_in_flight`);
/// - settled refunds (at `settled_at`) and finished webhook deliveries (at
///   `last_attempt_at`): `ix_refund_settled_at` and
///   `ix_webhook_delivery_finished` (migration 14).
pub const STATS_STATEMENTS: [&str; 6] = [
    STATS_PAYMENTS_DECIDED,
    STATS_PAYMENTS_WAITING,
    STATS_REFUNDS_SETTLED,
    STATS_ORDER_REFUNDS_REQUESTED,
    STATS_PAYMENT_REFUNDS_REQUESTED,
    STATS_DELIVERIES_FINISHED,
];

const STATS_PAYMENTS_DECIDED: &str = "SELECT outcome, substr(decided_at, 1, 16), count(*) FROM pay_callback_log
     WHERE outcome IN ('payment_failed', 'paid_after_close', 'already_paid', 'amount_mismatch', 'applied')
       AND decided_at >= ?1 AND decided_at < ?2
     GROUP BY 1, 2";
const STATS_PAYMENTS_WAITING: &str = "SELECT outcome, substr(received_at, 1, 16), count(*) FROM pay_callback_log
     WHERE outcome = 'recorded' AND state = 'received' AND received_at >= ?1 AND received_at < ?2
     GROUP BY 1, 2";
const STATS_REFUNDS_SETTLED: &str = "SELECT status, substr(settled_at, 1, 16), count(*) FROM refund
     WHERE settled_at >= ?1 AND settled_at < ?2
     GROUP BY 1, 2";
const STATS_ORDER_REFUNDS_REQUESTED: &str = "SELECT status, substr(requested_at, 1, 16), count(*) FROM refund
     WHERE status = 'REQUESTED' AND pay_no IS NULL AND requested_at >= ?1 AND requested_at < ?2
     GROUP BY 1, 2";
const STATS_PAYMENT_REFUNDS_REQUESTED: &str = "SELECT status, substr(requested_at, 1, 16), count(*) FROM refund
     WHERE status = 'REQUESTED' AND pay_no IS NOT NULL AND requested_at >= ?1 AND requested_at < ?2
     GROUP BY 1, 2";
const STATS_DELIVERIES_FINISHED: &str = "SELECT status, substr(last_attempt_at, 1, 16), count(*) FROM webhook_delivery
     WHERE status IN ('delivered', 'failed') AND last_attempt_at >= ?1 AND last_attempt_at < ?2
     GROUP BY 1, 2";

impl ReadTx<'_> {
    /// The counts of `GET /v1/admin/stats` per series, key and minute in
    /// [from, to) ([`STATS_STATEMENTS`]).
    pub fn stats_counts(&self, from: &str, to: &str) -> Result<Vec<StatsCount>, Error> {
        let statements = [
            (StatsSeries::Payments, STATS_PAYMENTS_DECIDED),
            (StatsSeries::Payments, STATS_PAYMENTS_WAITING),
            (StatsSeries::Refunds, STATS_REFUNDS_SETTLED),
            (StatsSeries::Refunds, STATS_ORDER_REFUNDS_REQUESTED),
            (StatsSeries::Refunds, STATS_PAYMENT_REFUNDS_REQUESTED),
            (StatsSeries::WebhookDeliveries, STATS_DELIVERIES_FINISHED),
        ];
        let mut counts = Vec::new();
        for (series, sql) in statements {
            for r in self.rows(sql, params![from, to])? {
                counts.push(StatsCount { series, key: r.text(0)?, minute: r.text(1)?, n: r.int(2)? });
            }
        }
        Ok(counts)
    }
}

impl WriteTx<'_> {
    /// One `audit_log` row. The refund_no of an unexpected refund result (or
    /// of its resolution) goes in its own column too, so it is found by index.
    pub fn audit(
        &self,
        at: &str,
        actor: &str,
        action: &str,
        order_no: Option<&str>,
        detail: &AuditDetail,
    ) -> Result<(), Error> {
        let refund_no = if REFUND_AUDIT_ACTIONS.contains(&action) { detail.refund_no() } else { None };
        self.execute(
            "INSERT INTO audit_log (at, actor, action, order_no, refund_no, detail) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![at, actor, action, order_no, refund_no, &detail.json_text()],
        )?;
        Ok(())
    }

    pub fn put_setting(&self, name: &str, value: &str) -> Result<(), Error> {
        self.execute(
            "INSERT INTO settings (name, value) VALUES (?1, ?2)
             ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            params![name, value],
        )?;
        Ok(())
    }
}
