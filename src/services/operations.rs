//! Operator tools, on the same exactly-once paths as the API: record-only
//! mode and drain, inspection, compensation, reconciliation and backup
//! (the incident runbook in docs/operations.md walks through them); the
//! Idempotency-Key results and the health check.

use super::payments::{DecisionRow, Delivery};
use super::{refuse_transition, validate_reason, Core};
use crate::app::{PaymentCallback, SETTING_MODE, SOURCE_RECONCILIATION};
use crate::domain::KEY_EXPIRING_WITHIN_MS;
use crate::domain::{is_identifier, PaymentOutcome, PlatformStatus, POINT_TYPE_ORDER_PAID};
use crate::domain::{AuditDetail, Finding, FindingDetail, IdempotencySlot, Refused, StoredResponse};
use crate::error::{Error, ErrorKind};
use crate::keylock::{KeyGuard, LockKey};
use crate::ops::{
    Compensated, Compensation, CompensationAction, CompensationEffect, DiffRow, DiffRows, Drained, Mode,
    Reconciliation, Repaired, Repairing, BACKUP_PARTIAL_SUFFIX, COMPARE_BATCH_ROWS, DRAIN_BATCH_MAX, RECEIVED_STALE_MS,
};
use crate::platforms::KeyFileFailure;
use crate::recon::{self, Format, Listed, LocalMoney, RowKind, Statement, StatementRow, Verdict};
use crate::store::WalRescue;
use crate::store::{ReadTx, WriteTx};
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What one reconciliation compares: a statement of a format over the days
/// of its period.
#[derive(Clone, Copy)]
struct Compared<'a> {
    format: Format,
    statement: &'a Statement<'a>,
    period: &'a BTreeSet<String>,
}

#[derive(Clone, Copy)]
pub struct Operations<'a> {
    core: &'a Core,
}

impl<'a> Operations<'a> {
    pub(crate) fn new(core: &'a Core) -> Operations<'a> {
        Operations { core }
    }

    /// Whether the storage still takes writes (the storage watch says why not).
    pub fn storage_writable(&self) -> bool {
        self.core.store().check_storage().is_ok()
    }

    /// Why the storage is lost and the state of its rescue checkpoint, once
    /// it is (the storage watch logs it).
    pub fn storage_lost_state(&self) -> Option<(String, WalRescue)> {
        self.core.store().storage_lost_state()
    }

    /// Key locks held or awaited now (a gauge of `/metrics`).
    pub fn key_locks_held(&self) -> usize {
        self.core.locks().len()
    }

    /// The group committer's (batches, operations) so far, on SQLite.
    pub fn group_commit_totals(&self) -> Option<(u64, u64)> {
        self.core.store().group_commit_totals()
    }

    /// Batches run again with savepoints after an operation failed, for `/metrics`.
    pub fn group_commit_reruns(&self) -> u64 {
        self.core.store().group_commit_reruns()
    }

    /// Takes an Idempotency-Key's lock, waiting at most `wait`; `None` when
    /// another request holds it that long.
    pub(crate) fn lock_idempotency_key(&self, scope: &str, key: &str, wait: Duration) -> Option<KeyGuard<'a>> {
        self.core.locks().lock_for(LockKey::IdempotencyKey { scope, key }, wait)
    }

    /// The live stored response of (scope, key), if any.
    pub fn stored_response(&self, scope: &str, key: &str) -> Result<Option<StoredResponse>, Error> {
        // A replay vouches for work that may live only in a deleted -wal.
        self.core.store().check_storage()?;
        let now = self.core.clock().now_text();
        self.core.store().read(|tx| tx.stored_response(scope, key, &now))
    }

    /// A slot for a keyed request arriving now.
    pub fn idempotency_slot(&self, scope: String, key: String, fingerprint: String) -> IdempotencySlot {
        let now_ms = self.core.clock().now_ms();
        IdempotencySlot {
            scope,
            key,
            fingerprint,
            created_at: crate::clock::format_ms(now_ms),
            expires_at: crate::clock::format_ms(
                now_ms.saturating_add(self.core.config().idempotency_ttl_s.saturating_mul(1000)),
            ),
        }
    }

    /// Removes up to `batch` expired Idempotency-Key results.
    pub fn purge_expired_responses(&self, batch: usize) -> Result<usize, Error> {
        let now = self.core.clock().now_text();
        self.core.store().write(&[], |tx| tx.purge_expired_responses(&now, batch))
    }

    /// Healthy when the database's paths name the files payonce has open
    /// and a fresh connection reads the schema version and a page of
    /// `orders`. Every failure is a 503: the service cannot serve.
    pub fn health(&self) -> Result<(), Error> {
        self.core.store().check_health().map_err(|e| match e.kind.is_unavailable() {
            true => e,
            false => Error::new(ErrorKind::DatabaseUnavailable, format!("the database cannot be read: {}", e.message)),
        })
    }

    // ---- record-only mode ----

    pub fn mode(&self) -> Result<Mode, Error> {
        let mode = self.core.store().read(|tx| tx.setting(SETTING_MODE))?;
        mode.as_deref().and_then(Mode::parse).ok_or_else(|| Error::internal("the mode setting is missing"))
    }

    /// Sets the mode for every process on the database; audited when it changes.
    pub fn set_mode(&self, mode: Mode, actor: &str, slot: Option<&IdempotencySlot>) -> Result<Mode, Error> {
        let key = self.core.locks().lock(LockKey::Mode);
        let now = self.core.clock().now_text();
        self.core.write_op(&[&key], slot, |tx| {
            let before = tx.setting(SETTING_MODE)?;
            if before.as_deref() != Some(mode.as_str()) {
                tx.put_setting(SETTING_MODE, mode.as_str())?;
                let detail = AuditDetail::ModeChanged { from: before.as_deref(), to: mode.as_str() };
                tx.audit(&now, actor, "mode_changed", None, &detail)?;
            }
            Ok(mode)
        })
    }

    /// Decides every record waiting in record-only mode, in arrival order,
    /// whatever the mode. Each record is decided in its own transaction
    /// under its pay_no lock, by a CAS from `received`, so a crash midway
    /// loses nothing and decides nothing twice. Returns how many it decided.
    pub fn drain(&self) -> Result<usize, Error> {
        let mut decided = 0;
        loop {
            let batch = self.core.store().read(|tx| tx.received_callbacks(DRAIN_BATCH_MAX))?;
            let mut progressed = false;
            for (id, pay_no) in &batch {
                if self.decide_received(*id, pay_no)?.is_some() {
                    decided += 1;
                    progressed = true;
                }
            }
            if batch.len() < DRAIN_BATCH_MAX || !progressed {
                return Ok(decided);
            }
        }
    }

    /// [`Operations::drain`] answering `{"applied": N}`. With an Idempotency-Key,
    /// every waiting record is decided in ONE transaction with the stored
    /// answer, so a crash leaves both or neither. The transaction first
    /// takes every waiting record's pay_no key, in the database (where other
    /// processes wait for it), in arrival order; only then does it decide
    /// any. Deciding writes an event, and an event takes the outbox lock:
    /// another process's drain or sweeper holds one pay_no key and then
    /// wants that lock, so taking a key after it would deadlock them
    /// ([`WriteTx::hold_key`] refuses to). The CAS from `received` keeps
    /// each record exactly-once; one decided elsewhere meanwhile is skipped.
    pub fn drain_keyed(&self, slot: Option<&IdempotencySlot>) -> Result<Drained, Error> {
        let Some(slot) = slot else {
            return Ok(Drained { applied: self.drain()?, outcomes: Vec::new() });
        };
        let now = self.core.clock().now_text();
        let decided = self.core.write_op(&[], Some(slot), |tx| {
            let waiting = hold_every_waiting_key(tx)?;
            let mut outcomes = Vec::new();
            for id in waiting {
                let record = tx.callback_by_id(id)?;
                if record.decided {
                    continue; // decided by another process before its key was ours
                }
                let order = tx.order_by_id(record.order_id)?;
                let delivery = Delivery::from_record(&record);
                outcomes.push(self.core.payments().decide_payment(
                    tx,
                    &delivery,
                    DecisionRow::Received(record.id),
                    &order,
                    &now,
                )?);
            }
            Ok(Drained { applied: outcomes.len(), outcomes })
        })?;
        for outcome in &decided.outcomes {
            self.core.metrics().observe_callback("payment", outcome.as_str());
        }
        Ok(decided)
    }

    fn decide_received(&self, id: i64, pay_no: &str) -> Result<Option<PaymentOutcome>, Error> {
        let pay_key = self.core.locks().lock(LockKey::Pay(pay_no));
        let now = self.core.clock().now_text();
        let outcome = self.core.store().write(&[&pay_key], |tx| {
            let record = tx.callback_by_id(id)?;
            if record.decided {
                return Ok(None); // decided by another process meanwhile
            }
            let order = tx.order_by_id(record.order_id)?;
            Ok(Some(self.core.payments().decide_payment(
                tx,
                &Delivery::from_record(&record),
                DecisionRow::Received(record.id),
                &order,
                &now,
            )?))
        })?;
        if let Some(outcome) = outcome {
            self.core.metrics().observe_callback("payment", outcome.as_str());
        }
        Ok(outcome)
    }

    /// Records waiting to be decided.
    pub fn received_waiting(&self) -> Result<i64, Error> {
        self.core.store().read(|tx| tx.count_received())
    }

    // ---- inspection ----

    /// Runs every inspection query now, and looks at the certificates the
    /// platforms hold; counts the findings in metrics.
    pub fn inspect(&self) -> Result<Vec<Finding>, Error> {
        let now_ms = self.core.clock().now_ms();
        let received_before = crate::clock::format_ms(now_ms - RECEIVED_STALE_MS);
        let mut findings = self.core.store().read(|tx| tx.inspect(&received_before))?;
        findings.extend(self.keys_expiring(now_ms));
        let kinds: Vec<&str> = findings.iter().map(|f| f.kind).collect();
        self.core.metrics().observe_inspection(&kinds);
        Ok(findings)
    }

    /// `key_expiring`: each certificate the platforms hold that expires
    /// within [`KEY_EXPIRING_WITHIN_MS`] of `now_ms`, or has expired. Not in
    /// the database: the platforms hold their keys (`platforms::KeyFiles`).
    fn keys_expiring(&self, now_ms: i64) -> Vec<Finding> {
        self.core
            .config()
            .platforms
            .registry
            .certificates()
            .into_iter()
            .filter(|cert| cert.not_after_ms - now_ms < KEY_EXPIRING_WITHIN_MS)
            .map(|cert| Finding {
                kind: "key_expiring",
                order_no: String::new(),
                detail: FindingDetail::KeyExpiring {
                    platform: cert.platform.to_owned(),
                    id: cert.id,
                    expires_at: crate::clock::format_ms(cert.not_after_ms),
                },
            })
            .collect()
    }

    // ---- keys ----

    /// `SIGHUP`: every platform re-reads its key and certificate files and
    /// swaps them at once for later requests, and every secret given as a
    /// file is read again; a file that fails keeps its old key or secret
    /// and is answered (file, why). Counted in `payonce_keys_reload_total`.
    pub fn reload_keys(&self) -> Vec<KeyFileFailure> {
        let config = self.core.config();
        let mut failures = config.platforms.registry.reload_keys();
        for secret in &config.secret_files {
            let mut warnings = Vec::new();
            if let Err(why) = (secret.reload)(&mut warnings) {
                failures.push(KeyFileFailure { file: secret.path.clone(), why });
            }
            for warning in &warnings {
                crate::log::warn("a secret file reloaded with a warning", &[("warning", warning)]);
            }
        }
        self.core.metrics().observe_keys_reload(failures.is_empty());
        failures
    }

    /// The platforms' scheduled certificate downloads, when due (the
    /// background's key refresh, about once a second).
    pub fn refresh_keys(&self) {
        let now_ms = self.core.clock().now_ms();
        self.core.config().platforms.registry.refresh_keys(now_ms);
    }

    /// WeChat Pay's platform certificate downloads so far, (ok, failed), for `/metrics`.
    pub fn wechatpay_cert_downloads(&self) -> (u64, u64) {
        self.core.config().platforms.registry.certificate_downloads(crate::platforms::wechatpay::NAME)
    }

    /// Seconds until each held certificate expires, for `/metrics`.
    pub fn key_expires_in_s(&self) -> Vec<(&'static str, String, i64)> {
        let now_ms = self.core.clock().now_ms();
        let certificates = self.core.config().platforms.registry.certificates();
        certificates.into_iter().map(|c| (c.platform, c.id, (c.not_after_ms - now_ms).div_euclid(1000))).collect()
    }

    // ---- counts over time ----

    /// `GET /v1/admin/stats`: the window's counts from the database, per
    /// bucket, oldest first, every known key present (0 when none), and the
    /// state now: the webhook backlog and the open findings by kind. One
    /// read snapshot, so the buckets and `now` agree; the inspection is the
    /// same queries as [`Operations::inspect`], not counted in `/metrics`
    /// (a console polling this must not inflate the findings counter).
    pub fn stats(&self, window: crate::ops::StatsWindow) -> Result<crate::ops::Stats, Error> {
        use crate::domain::{DeliveryStatus, RefundStatus, StatsSeries, FINDING_KINDS};
        use crate::ops::{Stats, StatsBucket, StatsNow};
        let now_ms = self.core.clock().now_ms();
        let bucket_ms = window.bucket_s() * 1000;
        let first_ms = window.first_start_ms(now_ms);
        let end_ms = first_ms + bucket_ms * window.buckets() as i64;
        let (from, to) = (crate::clock::format_ms(first_ms), crate::clock::format_ms(end_ms));
        let received_before = crate::clock::format_ms(now_ms - RECEIVED_STALE_MS);
        let (counts, (pending, oldest), mut findings) = self
            .core
            .store()
            .read(|tx| Ok((tx.stats_counts(&from, &to)?, tx.webhook_pending()?, tx.inspect(&received_before)?)))?;
        findings.extend(self.keys_expiring(now_ms));
        let zeros = |keys: &[&'static str]| keys.iter().map(|k| (*k, 0)).collect::<Vec<_>>();
        let outcomes: Vec<&'static str> = PaymentOutcome::ALL.iter().map(|o| o.as_str()).collect();
        let statuses: Vec<&'static str> = RefundStatus::ALL.iter().map(|s| s.as_str()).collect();
        let deliveries = [DeliveryStatus::Delivered.as_str(), DeliveryStatus::Failed.as_str()];
        let mut buckets: Vec<StatsBucket> = (0..window.buckets())
            .map(|i| StatsBucket {
                start: crate::clock::format_ms(first_ms + bucket_ms * i as i64),
                payments: zeros(&outcomes),
                refunds: zeros(&statuses),
                webhook_deliveries: zeros(&deliveries),
            })
            .collect();
        for count in counts {
            let minute_ms = crate::clock::parse_rfc3339_ms(&format!("{}:00.000Z", count.minute))
                .ok_or_else(|| Error::internal(format!("unparseable stored minute {:?}", count.minute)))?;
            let Some(bucket) =
                usize::try_from((minute_ms - first_ms).div_euclid(bucket_ms)).ok().and_then(|i| buckets.get_mut(i))
            else {
                continue;
            };
            let series = match count.series {
                StatsSeries::Payments => &mut bucket.payments,
                StatsSeries::Refunds => &mut bucket.refunds,
                StatsSeries::WebhookDeliveries => &mut bucket.webhook_deliveries,
            };
            match series.iter_mut().find(|(key, _)| *key == count.key) {
                Some((_, n)) => *n += count.n,
                None => return Err(Error::internal(format!("unknown stored value {:?}", count.key))),
            }
        }
        let mut by_kind = zeros(&FINDING_KINDS);
        for finding in &findings {
            match by_kind.iter_mut().find(|(kind, _)| *kind == finding.kind) {
                Some((_, n)) => *n += 1,
                None => by_kind.push((finding.kind, 1)),
            }
        }
        let oldest_s = oldest
            .as_deref()
            .and_then(crate::clock::parse_rfc3339_ms)
            .map(|queued| now_ms.saturating_sub(queued).max(0) / 1000);
        let now = StatsNow { webhook_pending: pending, webhook_oldest_pending_s: oldest_s, findings: by_kind };
        Ok(Stats { window, buckets, now })
    }

    // ---- compensation: freeze and reverse, never delete ----

    /// Idempotent by (order, action, target): the effect and its one audit
    /// row happen once; every request answers the resulting state.
    pub fn compensate(
        &self,
        req: &Compensation,
        actor: &str,
        slot: Option<&IdempotencySlot>,
    ) -> Result<Compensated, Error> {
        validate_reason(&req.reason)?;
        if let CompensationAction::FreezeCoupon { coupon_template_id } = &req.action {
            if !is_identifier(coupon_template_id) {
                return Err(Error::invalid("coupon_template_id must be 1-64 characters of [A-Za-z0-9_.-]"));
            }
        }
        let key = self.core.locks().lock(LockKey::Order(&req.order_no));
        let now = self.core.clock().now_text();
        self.core.write_op(&[&key], slot, |tx| {
            let order = tx.order_by_no(&req.order_no)?.ok_or_else(|| Error::order_not_found(&req.order_no))?;
            match &req.action {
                CompensationAction::FreezeCoupon { coupon_template_id: tpl } => {
                    let coupon = tx.coupon_of_order(order.id, tpl)?.ok_or_else(|| {
                        Error::new(ErrorKind::CouponNotFound, format!("order {} has no coupon {tpl:?}", order.order_no))
                    })?;
                    if coupon.status == "USED" {
                        let detail = Refused::CouponFreeze { coupon_template_id: tpl };
                        return Err(refuse_transition(
                            tx,
                            &order,
                            order.status,
                            "freeze a used coupon of",
                            &now,
                            detail,
                        )?);
                    }
                    if tx.freeze_coupon(order.id, tpl)? {
                        let detail = AuditDetail::CouponFrozen { coupon_template_id: tpl, reason: &req.reason };
                        tx.audit(&now, actor, "compensation", Some(&order.order_no), &detail)?;
                    }
                    let coupon =
                        tx.coupon_of_order(order.id, tpl)?.ok_or_else(|| Error::internal("coupon vanished"))?;
                    Ok(Compensated { order_no: order.order_no, effect: CompensationEffect::CouponFrozen(coupon) })
                }
                CompensationAction::ReversePoints => {
                    if tx.points_entry(order.id, POINT_TYPE_ORDER_PAID)?.is_none() {
                        return Err(Error::new(
                            ErrorKind::PointsNotFound,
                            format!("order {} has no {POINT_TYPE_ORDER_PAID} points to reverse", order.order_no),
                        ));
                    }
                    // Shares uk_order_type with the refund's reversal: whichever comes first reverses.
                    if tx.reverse_order_points(order.id, &now)? {
                        let detail = AuditDetail::PointsReversed { reason: &req.reason };
                        tx.audit(&now, actor, "compensation", Some(&order.order_no), &detail)?;
                    }
                    let entry =
                        tx.last_points_reversal(order.id)?.ok_or_else(|| Error::internal("reversal vanished"))?;
                    Ok(Compensated { order_no: order.order_no, effect: CompensationEffect::PointsReversed(entry) })
                }
            }
        })
    }

    // ---- reconciliation ----

    /// Compares a platform statement with the payments and refunds payonce
    /// recorded in the statement's period; with `repair`, applies the
    /// platform's payments payonce never recorded, through the exactly-once
    /// path (`source` = reconciliation). `progress` is told rows done / total.
    pub fn reconcile(
        &self,
        format: Format,
        statement: &[u8],
        date: Option<&str>,
        repair: bool,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Reconciliation, Error> {
        let statement = Statement::read(format, statement)?;
        let (mut result, missing) = self.compare(format, &statement, date, repair, progress)?;
        if repair {
            result.repaired = Some(self.repair_missing(format, &statement, &missing)?);
        }
        Ok(result)
    }

    /// The comparison of [`Operations::reconcile`], reading only, and (with
    /// `keep_missing`) the lines of the payment rows payonce has no record
    /// of (what a repair would apply). The statement is read twice, row by
    /// row: first to check every row and find the period, then to compare
    /// rows in batches of [`COMPARE_BATCH_ROWS`], one read transaction a
    /// batch; only the ids it lists are kept for `missing_remote`.
    fn compare(
        &self,
        format: Format,
        statement: &Statement,
        date: Option<&str>,
        keep_missing: bool,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(Reconciliation, Vec<usize>), Error> {
        let (period, total) = statement_period(format, statement, date)?;
        let mut result = Reconciliation {
            channel: format.as_str(),
            period: period.iter().cloned().collect(),
            compared: statement.compared.iter().map(|k| k.as_str()).collect(),
            ..Reconciliation::default()
        };
        let compared = Compared { format, statement, period: &period };
        let (listed, missing) = self.compare_rows(&compared, keep_missing, total, progress, &mut result)?;
        self.local_only(&compared, listed, &mut result)?;
        Ok((result, missing))
    }

    /// The comparison's second step: each compared row of the period against
    /// payonce's amount, in batches of [`COMPARE_BATCH_ROWS`], one read
    /// transaction a batch. Returns the ids the statement lists and (with
    /// `keep_missing`) the lines of the payment rows payonce has no record of.
    fn compare_rows(
        &self,
        compared: &Compared<'_>,
        keep_missing: bool,
        total: usize,
        progress: &mut dyn FnMut(usize, usize),
        result: &mut Reconciliation,
    ) -> Result<(Listed, Vec<usize>), Error> {
        let Compared { format, statement, period } = *compared;
        let offset = format.day_offset_ms();
        let compares = |kind: RowKind| statement.compared.contains(&kind);
        let day = |r: &StatementRow| r.at_ms.map(|at| recon::day_of(at, offset));
        let mut listed = Listed::default();
        let mut missing = Vec::new();
        let mut batch = Vec::with_capacity(COMPARE_BATCH_ROWS);
        let mut done = 0;
        let mut rows = statement.rows();
        loop {
            let next = rows.next().transpose()?;
            let end = next.is_none();
            if let Some(row) = next.filter(|r| compares(r.kind) && day(r).is_none_or(|d| period.contains(&d))) {
                listed.insert(row.kind, &row.id)?;
                batch.push(row);
            }
            if batch.len() == COMPARE_BATCH_ROWS || (end && !batch.is_empty()) {
                let locals: Vec<Option<LocalMoney>> =
                    self.core.store().read(|tx| batch.iter().map(|row| local_money(tx, row)).collect())?;
                for (row, local) in batch.drain(..).zip(locals) {
                    match recon::judge(&row, local.as_ref()) {
                        Verdict::Matched => result.matched += 1,
                        Verdict::AmountMismatch => {
                            result.amount_mismatch.push(&diff_row(format, &row, local.map(|l| l.amount)))?
                        }
                        Verdict::MissingLocal => {
                            result.missing_local.push(&diff_row(format, &row, None))?;
                            if keep_missing && row.kind == RowKind::Payment {
                                missing.push(row.line);
                            }
                        }
                    }
                    done += 1;
                    progress(done, total);
                }
            }
            if end {
                break;
            }
        }
        Ok((listed, missing))
    }

    /// The comparison's last step: what payonce recorded in the period that
    /// the statement does not list, into `missing_remote`.
    fn local_only(&self, compared: &Compared<'_>, listed: Listed, result: &mut Reconciliation) -> Result<(), Error> {
        let Compared { format, statement, period } = *compared;
        let offset = format.day_offset_ms();
        let compares = |kind: RowKind| statement.compared.contains(&kind);
        // Only this platform's: a merchant taking several is sent one
        // statement per platform, and each lists its own money alone.
        let channel = format.as_str();
        // What payonce recorded in the period that the statement does not
        // list: read for every day while the listed ids are held, then
        // written out once they are freed.
        let listed = listed.seal();
        let mut local_only = Vec::with_capacity(period.len());
        for day in period {
            let (from, to) = recon::day_bounds(day, offset).ok_or_else(|| Error::internal("bad period day"))?;
            let unlisted = |pay_no: &str| !listed.contains(RowKind::Payment, pay_no);
            let payments = if compares(RowKind::Payment) {
                Some(self.core.store().read(|tx| tx.applied_payments_between(&from, &to, channel, &unlisted))?)
            } else {
                None
            };
            let mut refunds = DiffRows::default();
            if compares(RowKind::Refund) {
                let unlisted = |refund_no: &str| !listed.contains(RowKind::Refund, refund_no);
                self.core.store().read(|tx| {
                    tx.refunds_settled_between(&from, &to, channel, &unlisted, &mut |refund_no, order_no, amount| {
                        refunds.push(&local_only_row(RowKind::Refund, channel, refund_no, order_no, amount))
                    })
                })?;
            }
            local_only.push((payments, refunds));
        }
        drop(listed);
        for (payments, refunds) in local_only {
            for (pay_no, order_no, amount) in payments.iter().flat_map(|p| p.iter()) {
                result.missing_remote.push(&local_only_row(RowKind::Payment, channel, pay_no, order_no, amount))?;
            }
            drop(payments);
            result.missing_remote.append(refunds);
        }
        Ok(())
    }

    /// [`Operations::reconcile`] for the API. With an Idempotency-Key and `repair`,
    /// the repairs and the stored answer commit in ONE transaction (the
    /// comparison before it only reads).
    pub fn reconcile_keyed(
        &self,
        format: Format,
        statement: &[u8],
        date: Option<&str>,
        repair: bool,
        slot: Option<&IdempotencySlot>,
    ) -> Result<Reconciliation, Error> {
        if slot.is_none() || !repair {
            let result = self.reconcile(format, statement, date, repair, &mut |_, _| {})?;
            // Stored by reference: a large answer is never copied.
            self.core.write_op(&[], slot, |_| Ok(&result))?;
            return Ok(result);
        }
        let statement = Statement::read(format, statement)?;
        let (mut result, missing) = self.compare(format, &statement, date, true, &mut |_, _| {})?;
        let now = self.core.clock().now_text();
        let repaired = self.core.write_op(&[], slot, |tx| {
            let mut repaired = Vec::new();
            for row in missing_rows(&statement, &missing) {
                let row = row?;
                let callback = repair_callback(format, &row);
                repaired.push(
                    match self.core.payments().record_and_decide(tx, &callback, SOURCE_RECONCILIATION, &now) {
                        Ok(reply) => repaired_row(&row, Ok(reply.outcome_str())),
                        // A refusal (unknown order) wrote nothing; anything else rolls back every repair.
                        Err(e) if e.is_refusal() => repaired_row(&row, Err(e)),
                        Err(e) => return Err(e),
                    },
                );
            }
            // The comparison by reference and this attempt's repairs: the
            // body may run again (PostgreSQL), and a large answer is never
            // copied for it.
            Ok(Repairing { result: &result, repaired })
        })?;
        result.repaired = Some(repaired.repaired);
        Ok(result)
    }

    fn repair_missing(&self, format: Format, statement: &Statement, missing: &[usize]) -> Result<Vec<Repaired>, Error> {
        missing_rows(statement, missing)
            .map(|row| {
                let row = row?;
                Ok(
                    match self
                        .core
                        .payments()
                        .deliver_payment_from(&repair_callback(format, &row), SOURCE_RECONCILIATION)
                    {
                        Ok(reply) => repaired_row(&row, Ok(reply.outcome_str())),
                        Err(e) => repaired_row(&row, Err(e)),
                    },
                )
            })
            .collect()
    }

    // ---- backup ----

    /// An online, consistent copy of the database at `to`, atomically: the
    /// copy is written to `{to}.{pid}.partial` in the same directory,
    /// checked (`integrity_check`), synced, and only then given the name
    /// `to`, and the directory is synced. A kill or a full disk at any moment
    /// leaves no file at `to` (or the previous one, with `force`) or a
    /// complete, checked copy. `to` must not exist unless `force`; it may
    /// never name the live database or one of its journal files.
    pub fn backup(&self, to: &Path, force: bool) -> Result<(), Error> {
        let db = self
            .core
            .store()
            .database_path()
            .ok_or_else(|| Error::invalid("an in-memory database has no file to back up"))?;
        let to = backup_target(db, to, force)?;
        let partial = partial_path(&to);
        let result = self.write_backup(&partial, &to, force);
        if result.is_err() {
            remove_partial(&partial);
        }
        result
    }

    fn write_backup(&self, partial: &Path, to: &Path, force: bool) -> Result<(), Error> {
        let io = |what: &str, e: std::io::Error| Error::internal(format!("backup: {what}: {e}"));
        self.core.store().backup_into(partial)?;
        std::fs::File::open(partial).and_then(|f| f.sync_all()).map_err(|e| io("syncing the copy", e))?;
        if force {
            std::fs::rename(partial, to).map_err(|e| io("renaming the copy into place", e))?;
        } else {
            // A hard link gives the name only if no file took it meanwhile.
            std::fs::hard_link(partial, to).map_err(|e| match e.kind() {
                std::io::ErrorKind::AlreadyExists => {
                    Error::invalid(format!("{} exists; use --force to replace it", to.display()))
                }
                _ => io("naming the copy", e),
            })?;
            std::fs::remove_file(partial).map_err(|e| io("removing the temporary name", e))?;
        }
        let dir = to.parent().ok_or_else(|| Error::internal("backup: the target has no directory"))?;
        std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io("syncing the directory", e))?;
        Ok(())
    }
}

/// `to` as an absolute path in a canonical directory, refused when it names
/// the live database or one of its journal files in any spelling (relative,
/// `./`, `..`, a symlink to it, a hard link to it), or when it exists and
/// `force` is not given, or when a journal of an older file at `to` would be
/// applied to the new copy when it is opened.
fn backup_target(db: &Path, to: &Path, force: bool) -> Result<PathBuf, Error> {
    let name = to.file_name().ok_or_else(|| Error::invalid(format!("--to {}: not a file name", to.display())))?;
    let parent = to.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let dir =
        parent.canonicalize().map_err(|e| Error::invalid(format!("--to {}: its directory: {e}", to.display())))?;
    let target = dir.join(name);
    let resolved = follow_links(&target);
    let live = live_names(db);
    let refuse = || {
        Error::invalid(format!(
            "--to {} names the live database {} or one of its -wal, -shm, -journal files",
            to.display(),
            db.display()
        ))
    };
    if live.iter().any(|p| *p == target || *p == resolved) {
        return Err(refuse());
    }
    if let Ok(meta) = std::fs::metadata(&target) {
        let same_file =
            |p: &PathBuf| std::fs::metadata(p).is_ok_and(|m| m.dev() == meta.dev() && m.ino() == meta.ino());
        if live.iter().any(same_file) {
            return Err(refuse());
        }
    }
    if std::fs::symlink_metadata(&target).is_ok() && !force {
        return Err(Error::invalid(format!("{} exists; use --force to replace it", to.display())));
    }
    for suffix in ["-wal", "-journal"] {
        let journal = with_suffix(&target, suffix);
        if std::fs::symlink_metadata(&journal).is_ok() {
            return Err(Error::invalid(format!(
                "{} exists: SQLite would apply it to the new copy; close what has {} open, or remove it",
                journal.display(),
                to.display()
            )));
        }
    }
    Ok(target)
}

/// Where `path` leads through symlinks, even to a file that does not exist
/// yet (a link to the database's `-journal`): at most `LINKS_FOLLOWED_MAX` links.
fn follow_links(path: &Path) -> PathBuf {
    const LINKS_FOLLOWED_MAX: usize = 40;
    let mut current = path.to_path_buf();
    for _ in 0..LINKS_FOLLOWED_MAX {
        let Ok(next) = std::fs::read_link(&current) else {
            break;
        };
        let next = match current.parent() {
            Some(dir) if next.is_relative() => dir.join(next),
            _ => next,
        };
        // The directory part made canonical, the last name kept.
        current = match (next.parent().and_then(|d| d.canonicalize().ok()), next.file_name()) {
            (Some(dir), Some(name)) => dir.join(name),
            _ => next,
        };
    }
    current.canonicalize().unwrap_or(current)
}

/// Every name of the live database's files: as SQLite opened it and as
/// canonicalized (they differ when a directory on the way is a symlink).
fn live_names(db: &Path) -> Vec<PathBuf> {
    let mut bases = vec![db.to_path_buf()];
    if let Ok(canonical) = db.canonicalize() {
        bases.push(canonical);
    }
    bases.iter().flat_map(|b| ["", "-wal", "-shm", "-journal"].map(|s| with_suffix(b, s))).collect()
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// `{to}.{pid}.partial`: one per process, so two backups to one name never
/// write into the same temporary file.
fn partial_path(to: &Path) -> PathBuf {
    with_suffix(to, &format!(".{}{BACKUP_PARTIAL_SUFFIX}", std::process::id()))
}

/// Removes the temporary file and what SQLite may have made beside it.
fn remove_partial(partial: &Path) {
    for suffix in ["", "-journal", "-wal", "-shm"] {
        let _ = std::fs::remove_file(with_suffix(partial, suffix));
    }
}

/// The comparison's first step: every row read once to check it and find
/// its day; the period (`date`, else the days of the rows that have a time
/// of their own) and how many rows of it will be compared.
fn statement_period(
    format: Format,
    statement: &Statement,
    date: Option<&str>,
) -> Result<(BTreeSet<String>, usize), Error> {
    let offset = format.day_offset_ms();
    let compares = |kind: RowKind| statement.compared.contains(&kind);
    let day = |r: &StatementRow| r.at_ms.map(|at| recon::day_of(at, offset));
    // Every row's day, and how many rows of a compared kind each day has.
    let mut days = BTreeSet::new();
    let mut compared_on: BTreeMap<String, usize> = BTreeMap::new();
    let mut compared_untimed = 0;
    for row in statement.rows() {
        let row = row?;
        match day(&row) {
            Some(d) if compares(row.kind) => *compared_on.entry(d.clone()).or_default() += 1,
            None if compares(row.kind) => compared_untimed += 1,
            _ => {}
        }
        days.extend(day(&row));
    }
    // The period: `date=`, else the days of the rows that have a time of
    // their own (a row dated by something else never widens it).
    let period: BTreeSet<String> = match date {
        Some(day) => {
            recon::day_bounds(day, offset).ok_or_else(|| Error::invalid("date must be YYYY-MM-DD"))?;
            BTreeSet::from([day.to_owned()])
        }
        None => days,
    };
    // Compared: the rows of a declared kind inside the period, and the
    // rows without a time of their own (they belong to the statement).
    let total = compared_untimed + period.iter().filter_map(|d| compared_on.get(d)).sum::<usize>();
    Ok((period, total))
}

/// payonce's amount, in its order's currency, for a statement row's pay_no
/// or refund_no, if it has one (one query: the order comes with it).
fn local_money(tx: &ReadTx, row: &StatementRow) -> Result<Option<LocalMoney>, Error> {
    let local = match row.kind {
        RowKind::Payment => tx.money_moved_payment(&row.id)?,
        RowKind::Refund => tx.succeeded_refund(&row.id)?,
    };
    Ok(local.map(|(amount, currency)| LocalMoney { amount, currency }))
}

/// The statement's rows at `lines` (ascending), read again.
fn missing_rows<'s>(
    statement: &'s Statement,
    lines: &'s [usize],
) -> impl Iterator<Item = Result<StatementRow, Error>> + 's {
    statement.rows().filter(move |row| row.as_ref().map_or(true, |r| lines.binary_search(&r.line).is_ok()))
}

/// A platform's payment as the exactly-once path takes it, from reconciliation.
fn repair_callback(format: Format, row: &StatementRow) -> PaymentCallback {
    PaymentCallback {
        channel: format.as_str().to_owned(),
        pay_no: row.id.clone(),
        order_no: row.order_no.clone(),
        amount: row.amount,
        currency: row.currency.clone(),
        status: PlatformStatus::Success,
        paid_at: row.at_ms.map(crate::clock::format_ms),
        raw_body: row.raw.clone().into_bytes(),
    }
}

fn repaired_row(row: &StatementRow, outcome: Result<&'static str, Error>) -> Repaired {
    Repaired { pay_no: row.id.clone(), order_no: row.order_no.clone(), outcome }
}

/// A `missing_remote` row: payonce has it, the platform does not.
fn local_only_row<'a>(kind: RowKind, channel: &'a str, id: &'a str, order_no: &'a str, amount: i64) -> DiffRow<'a> {
    DiffRow {
        kind,
        channel,
        pay_no: id,
        order_no,
        amount_platform: None,
        amount_local: Some(amount),
        coupon_amount: None,
    }
}

/// A statement row against payonce's amount (`None`: payonce has no record).
fn diff_row(format: Format, row: &StatementRow, local: Option<i64>) -> DiffRow<'_> {
    DiffRow {
        kind: row.kind,
        channel: format.as_str(),
        pay_no: &row.id,
        order_no: &row.order_no,
        amount_platform: Some(row.amount),
        amount_local: local,
        coupon_amount: row.coupon_amount,
    }
}

/// Takes the pay_no key of every record waiting in record-only mode, in
/// arrival order, and returns their ids: the keyed drain's first phase.
fn hold_every_waiting_key(tx: &WriteTx) -> Result<Vec<i64>, Error> {
    let mut ids = Vec::new();
    let mut after = 0;
    loop {
        let page = tx.received_callbacks_after(after, DRAIN_BATCH_MAX)?;
        for (id, pay_no) in &page {
            tx.hold_key(LockKey::Pay(pay_no))?;
            ids.push(*id);
            after = *id;
        }
        if page.len() < DRAIN_BATCH_MAX {
            return Ok(ids);
        }
    }
}
