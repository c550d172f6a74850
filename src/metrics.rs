//! In-process counters, rendered as Prometheus text exposition (every name
//! prefixed `payonce_`). Gauges that live in the database (mode, records
//! waiting) are read at scrape time by the caller.

use crate::domain::{PaymentOutcome, PlatformCallKind, RefundOutcome, FINDING_KINDS};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Upper bounds of the latency histogram, in seconds.
pub const LATENCY_BUCKETS_S: [f64; 12] = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5];

/// How a platform call's attempt ended, as `payonce_platform_calls_total`
/// labels it: due again (`retried`), or settled in its final status.
pub const PLATFORM_CALL_RESULTS: [&str; 4] = ["done", "retried", "failed", "given_up"];

/// Where a repeat is answered without its work: a callback's `duplicate`,
/// and an Idempotency-Key's stored answer.
pub const DUPLICATE_LAYERS: [&str; 2] = ["callback", "idempotency_key"];

#[derive(Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, String, u16), u64>>,
    latency_buckets: [AtomicU64; LATENCY_BUCKETS_S.len()],
    latency_count: AtomicU64,
    latency_sum_us: AtomicU64,
    callback_outcomes: Mutex<BTreeMap<(String, String), u64>>,
    duplicates_suppressed: Mutex<BTreeMap<&'static str, u64>>,
    inspection_findings: Mutex<BTreeMap<String, u64>>,
    inspection_last: Mutex<BTreeMap<String, u64>>,
    webhook_results: Mutex<BTreeMap<&'static str, u64>>,
    platform_calls: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    /// Key reloads (`SIGHUP`) by result: `ok`, `failed`.
    keys_reloads: Mutex<BTreeMap<&'static str, u64>>,
    /// The store's flag: false once a database path names another file
    /// than the one open (`None`: nothing watched, e.g. `:memory:`).
    storage_ok: Option<Arc<AtomicBool>>,
}

/// Values read from elsewhere at scrape time.
pub struct ScrapeGauges {
    pub record_only: bool,
    pub received_waiting: i64,
    pub key_locks: usize,
    /// (batches, operations) the SQLite group committer committed; zeros on PostgreSQL.
    pub group_commit: (u64, u64),
    /// Batches run again with savepoints after an operation failed.
    pub group_commit_reruns: u64,
    /// Webhook deliveries pending, and the age of the oldest in seconds.
    pub webhook_pending: i64,
    pub webhook_oldest_pending_s: f64,
    /// Platform calls pending in the database (all processes).
    pub platform_calls_pending: i64,
    /// Every certificate payonce holds: (platform, id, seconds until its
    /// notAfter, negative once past).
    pub key_expires_in_s: Vec<(&'static str, String, i64)>,
    /// WeChat Pay's platform certificate downloads so far: (ok, failed).
    pub wechatpay_cert_downloads: (u64, u64),
}

/// How a key reload ended, as `payonce_keys_reload_total` labels it.
pub const KEYS_RELOAD_RESULTS: [&str; 2] = ["ok", "failed"];

impl Metrics {
    /// Metrics whose `payonce_storage_ok` follows `storage_ok`.
    pub fn with_storage_flag(storage_ok: Arc<AtomicBool>) -> Metrics {
        Metrics { storage_ok: Some(storage_ok), ..Metrics::default() }
    }

    pub fn observe_request(&self, method: &str, route: &str, status: u16, latency: Duration) {
        // Label values stay bounded whatever a client sends as its method.
        let method = match method {
            "GET" | "POST" | "PUT" | "DELETE" | "PATCH" | "HEAD" | "OPTIONS" => method,
            _ => "other",
        };
        *self.requests.lock().entry((method.to_owned(), route.to_owned(), status)).or_default() += 1;
        let seconds = latency.as_secs_f64();
        for (bucket, bound) in self.latency_buckets.iter().zip(LATENCY_BUCKETS_S) {
            if seconds <= bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.latency_count.fetch_add(1, Ordering::Relaxed);
        let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.latency_sum_us.fetch_add(micros, Ordering::Relaxed);
    }

    /// A callback's answer, by kind (`payment`, `refund`) and outcome.
    pub fn observe_callback(&self, kind: &str, outcome: &str) {
        *self.callback_outcomes.lock().entry((kind.to_owned(), outcome.to_owned())).or_default() += 1;
    }

    /// A repeat that did no work: a `duplicate` callback or a replayed
    /// Idempotency-Key (`layer` says which, one of [`DUPLICATE_LAYERS`]).
    pub fn observe_duplicate(&self, layer: &'static str) {
        *self.duplicates_suppressed.lock().entry(layer).or_default() += 1;
    }

    /// A webhook attempt's recorded result: `delivered`, `retried`,
    /// `failed` (a dead letter) or `disabled` (410 Gone).
    pub fn observe_webhook(&self, result: &'static str) {
        *self.webhook_results.lock().entry(result).or_default() += 1;
    }

    /// A platform call's attempt recorded: its kind and how it ended (one
    /// of [`PLATFORM_CALL_RESULTS`]).
    pub fn observe_platform_call(&self, kind: PlatformCallKind, result: &'static str) {
        *self.platform_calls.lock().entry((kind.as_str(), result)).or_default() += 1;
    }

    /// A key reload: `ok` when every file loaded, `failed` when one kept its old key.
    pub fn observe_keys_reload(&self, ok: bool) {
        *self.keys_reloads.lock().entry(if ok { "ok" } else { "failed" }).or_default() += 1;
    }

    /// One inspection run's findings by kind (counted, and kept as the last run).
    pub fn observe_inspection(&self, kinds: &[&str]) {
        let mut last = BTreeMap::new();
        for kind in kinds {
            *last.entry((*kind).to_owned()).or_insert(0) += 1;
        }
        let mut total = self.inspection_findings.lock();
        for (kind, n) in &last {
            *total.entry(kind.clone()).or_default() += n;
        }
        *self.inspection_last.lock() = last;
    }

    /// The Prometheus text of every series: this process's counters, then
    /// the gauges read at this scrape, then the webhook series.
    pub fn render(&self, gauges: &ScrapeGauges) -> String {
        let mut out = String::new();
        self.render_requests(&mut out);
        self.render_outcomes(&mut out);
        self.render_state(&mut out, gauges);
        self.render_webhooks(&mut out, gauges);
        out
    }

    /// Requests by route and status, and their latency histogram.
    fn render_requests(&self, out: &mut String) {
        header(out, "payonce_http_requests_total", "counter", "HTTP requests by method, route and status.");
        for ((method, route, status), n) in self.requests.lock().iter() {
            let status = status.to_string();
            sample(out, "payonce_http_requests_total", &[("method", method), ("route", route), ("status", &status)], n);
        }
        header(out, "payonce_http_request_duration_seconds", "histogram", "HTTP request latency.");
        for (bucket, bound) in self.latency_buckets.iter().zip(LATENCY_BUCKETS_S) {
            let _ = writeln!(
                out,
                "payonce_http_request_duration_seconds_bucket{{le=\"{bound}\"}} {}",
                bucket.load(Ordering::Relaxed)
            );
        }
        let count = self.latency_count.load(Ordering::Relaxed);
        let _ = writeln!(out, "payonce_http_request_duration_seconds_bucket{{le=\"+Inf\"}} {count}");
        let sum = self.latency_sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "payonce_http_request_duration_seconds_sum {sum}");
        let _ = writeln!(out, "payonce_http_request_duration_seconds_count {count}");
    }

    /// What the work decided: callback outcomes, suppressed repeats, inspection findings.
    /// Every label value payonce knows is there from the first scrape, at 0:
    /// Prometheus' `increase()` over a series that appears with its first
    /// event reads 0, and an alert on the first `duplicate_coupon` would
    /// never fire.
    fn render_outcomes(&self, out: &mut String) {
        header(out, "payonce_callback_outcomes_total", "counter", "Callback answers by kind and outcome.");
        let mut outcomes = self.callback_outcomes.lock();
        let payments = PaymentOutcome::ALL.iter().map(|o| o.as_str()).chain(["duplicate"]).map(|o| ("payment", o));
        let refunds = RefundOutcome::ALL.iter().map(|o| ("refund", o.as_str()));
        for (kind, outcome) in payments.chain(refunds) {
            outcomes.entry((kind.to_owned(), outcome.to_owned())).or_default();
        }
        for ((kind, outcome), n) in outcomes.iter() {
            sample(out, "payonce_callback_outcomes_total", &[("kind", kind), ("outcome", outcome)], n);
        }
        drop(outcomes);
        header(out, "payonce_duplicates_suppressed_total", "counter", "Repeats answered without doing the work again.");
        let mut duplicates = self.duplicates_suppressed.lock();
        for layer in DUPLICATE_LAYERS {
            duplicates.entry(layer).or_default();
        }
        for (layer, n) in duplicates.iter() {
            sample(out, "payonce_duplicates_suppressed_total", &[("layer", layer)], n);
        }
        drop(duplicates);
        header(out, "payonce_inspection_findings_total", "counter", "Inspection findings by kind, over all runs.");
        let mut findings = self.inspection_findings.lock();
        for kind in FINDING_KINDS {
            findings.entry(kind.to_owned()).or_default();
        }
        for (kind, n) in findings.iter() {
            sample(out, "payonce_inspection_findings_total", &[("kind", kind)], n);
        }
        drop(findings);
        header(out, "payonce_inspection_last_findings", "gauge", "Findings of the last inspection run, by kind.");
        // A kind the last run did not find had 0 findings in it.
        let mut last = self.inspection_last.lock();
        for kind in FINDING_KINDS {
            last.entry(kind.to_owned()).or_default();
        }
        for (kind, n) in last.iter() {
            sample(out, "payonce_inspection_last_findings", &[("kind", kind)], n);
        }
        drop(last);
    }

    /// The mode, the waiting records, the key locks, the storage check and group commit.
    fn render_state(&self, out: &mut String, gauges: &ScrapeGauges) {
        header(out, "payonce_mode", "gauge", "Current mode: 1 for the mode in force.");
        let _ = writeln!(out, "payonce_mode{{mode=\"normal\"}} {}", u8::from(!gauges.record_only));
        let _ = writeln!(out, "payonce_mode{{mode=\"record_only\"}} {}", u8::from(gauges.record_only));
        single(
            out,
            "payonce_received_waiting",
            "gauge",
            "Callbacks recorded in record-only mode, waiting to be decided.",
            gauges.received_waiting,
        );
        single(
            out,
            "payonce_key_locks",
            "gauge",
            "Entries in the keyed-lock map (held or awaited keys).",
            gauges.key_locks,
        );
        header(
            out,
            "payonce_storage_ok",
            "gauge",
            "1 while the database paths name the files payonce has open; 0: writes refused until a restart.",
        );
        let storage_ok = self.storage_ok.as_ref().is_none_or(|f| f.load(Ordering::Acquire));
        let _ = writeln!(out, "payonce_storage_ok {}", u8::from(storage_ok));
        header(
            out,
            "payonce_keys_reload_total",
            "counter",
            "Key and certificate reloads (SIGHUP) by result: ok, failed (a file kept its old key).",
        );
        {
            let reloads = self.keys_reloads.lock();
            for result in KEYS_RELOAD_RESULTS {
                let n = reloads.get(result).copied().unwrap_or(0);
                sample(out, "payonce_keys_reload_total", &[("result", result)], n);
            }
        }
        header(
            out,
            "payonce_key_expires_in_seconds",
            "gauge",
            "Seconds until each certificate payonce holds expires (id: WeChat Pay's serial); negative once expired.",
        );
        for (platform, id, seconds) in &gauges.key_expires_in_s {
            sample(out, "payonce_key_expires_in_seconds", &[("platform", platform), ("id", id)], seconds);
        }
        header(
            out,
            "payonce_wechatpay_cert_downloads_total",
            "counter",
            "WeChat Pay platform certificate downloads (--wechatpay-platform-certs auto) by result: ok, failed (refused; nothing learned).",
        );
        let (ok, failed) = gauges.wechatpay_cert_downloads;
        sample(out, "payonce_wechatpay_cert_downloads_total", &[("result", "ok")], ok);
        sample(out, "payonce_wechatpay_cert_downloads_total", &[("result", "failed")], failed);
        single(out, "payonce_group_commit_batches_total", "counter", "SQLite write transactions the group committer ended (committed or failed); each carried one or more operations.", gauges.group_commit.0);
        single(
            out,
            "payonce_group_commit_operations_total",
            "counter",
            "Write operations in those transactions: operations / batches is the mean batch size.",
            gauges.group_commit.1,
        );
        single(
            out,
            "payonce_group_commit_reruns_total",
            "counter",
            "SQLite batches rolled back and run again with a savepoint per operation because one failed (each failing write costs its batch one such run).",
            gauges.group_commit_reruns,
        );
    }

    /// Webhook attempts by result, and the pending deliveries of the database.
    fn render_webhooks(&self, out: &mut String, gauges: &ScrapeGauges) {
        header(
            out,
            "payonce_webhook_deliveries_total",
            "counter",
            "Webhook attempts of this process by result: delivered, retried, failed (dead letter), disabled (410 Gone).",
        );
        {
            let results = self.webhook_results.lock();
            for result in ["delivered", "retried", "failed", "disabled"] {
                let n = results.get(result).copied().unwrap_or(0);
                let _ = writeln!(out, "payonce_webhook_deliveries_total{{result=\"{result}\"}} {n}");
            }
        }
        single(
            out,
            "payonce_webhook_pending",
            "gauge",
            "Webhook deliveries pending in the database (all processes).",
            gauges.webhook_pending,
        );
        single(
            out,
            "payonce_webhook_oldest_pending_seconds",
            "gauge",
            "Age of the oldest pending webhook delivery since it was queued; 0 when none is pending.",
            gauges.webhook_oldest_pending_s,
        );
        header(
            out,
            "payonce_platform_calls_total",
            "counter",
            "Platform call attempts of this process by kind and result: done, retried, failed, given_up.",
        );
        {
            let calls = self.platform_calls.lock();
            for kind in PlatformCallKind::ALL {
                for result in PLATFORM_CALL_RESULTS {
                    let n = calls.get(&(kind.as_str(), result)).copied().unwrap_or(0);
                    sample(out, "payonce_platform_calls_total", &[("kind", kind.as_str()), ("result", result)], n);
                }
            }
        }
        single(
            out,
            "payonce_platform_calls_pending",
            "gauge",
            "Platform calls pending in the database (all processes): due, or with an attempt in flight.",
            gauges.platform_calls_pending,
        );
    }
}

/// A series of one sample without labels, with its HELP and TYPE.
fn single(out: &mut String, name: &str, kind: &str, help: &str, value: impl std::fmt::Display) {
    header(out, name, kind, help);
    let _ = writeln!(out, "{name} {value}");
}

/// One sample line: `name{label="value",...} value`, the label values escaped.
fn sample(out: &mut String, name: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
    let labels: Vec<String> = labels.iter().map(|(label, v)| format!("{label}=\"{}\"", escape(v))).collect();
    let _ = writeln!(out, "{name}{{{}}} {value}", labels.join(","));
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Label values escape backslash, quote and newline.
fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}
