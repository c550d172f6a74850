//! What the operator tools answer: the mode, compensations, resolutions,
//! drains and reconciliations, and their limits. The tools themselves are
//! the `Operations` service (`src/services/operations.rs`) and the
//! resolutions of `Payments` and `Refunds`.

use crate::app::{MODE_NORMAL, MODE_RECORD_ONLY};
use crate::domain::{CouponRow, PaymentOutcome, PointRow};
use crate::error::Error;
use crate::recon::RowKind;

/// Records decided per drain look-up.
pub const DRAIN_BATCH_MAX: usize = 100;
/// A record-only record older than this, while the mode is normal, is a finding.
pub const RECEIVED_STALE_MS: i64 = 10 * 60 * 1000;
/// Bounds of an operator's free-text reason.
pub const REASON_BYTES_MAX: usize = 1_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Normal,
    RecordOnly,
}

impl Mode {
    pub fn parse(text: &str) -> Option<Mode> {
        match text {
            MODE_NORMAL => Some(Mode::Normal),
            MODE_RECORD_ONLY => Some(Mode::RecordOnly),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Normal => MODE_NORMAL,
            Mode::RecordOnly => MODE_RECORD_ONLY,
        }
    }
}

/// A compensation request (`POST /v1/compensations`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compensation {
    pub order_no: String,
    pub action: CompensationAction,
    pub reason: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CompensationAction {
    FreezeCoupon { coupon_template_id: String },
    ReversePoints,
}

/// What a compensation did (or had done): the coupon frozen or the points
/// reversed, as they stand now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compensated {
    pub order_no: String,
    pub effect: CompensationEffect,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CompensationEffect {
    CouponFrozen(CouponRow),
    PointsReversed(PointRow),
}

/// A refund-required payment's resolution (the first one, on a repeat).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PaymentResolution {
    pub pay_no: String,
    pub order_no: String,
    pub outcome: PaymentOutcome,
    pub resolution: String,
    pub reason: String,
    pub resolved_at: String,
}

/// A refund of a refund-required payment, as requested (or found, on a
/// repeat): the payment, its refunds (this one among them) and this one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PaymentRefund {
    pub order_no: String,
    pub payment: crate::domain::CallbackRecord,
    pub refunds: Vec<crate::domain::RefundRecord>,
    pub refund: crate::domain::RefundRecord,
}

/// An unexpected refund's resolution (the first one, on a repeat); the
/// resolution and reason as its audit row recorded them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefundResolution {
    pub refund_no: String,
    pub resolution: Option<String>,
    pub reason: Option<String>,
    pub resolved_at: String,
}

/// A refund requested by amount: the order after it, the refund, and
/// whether this request made it (201) or found it (200).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefundRequested {
    pub order: crate::domain::Order,
    pub refund: crate::domain::RefundRecord,
    pub created: bool,
    /// Asked on the whole-order route (`/refund`), answered with the order
    /// alone, 200, as that route always was.
    pub order_only: bool,
}

/// What a keyed drain decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Drained {
    pub applied: usize,
    /// Each decision's outcome, counted in the metrics once committed. The
    /// write body returns them: a body that pushed into a list outside it
    /// counted a rolled-back attempt too when PostgreSQL re-ran it.
    pub(crate) outcomes: Vec<PaymentOutcome>,
}

/// What a reconciliation found (and repaired).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reconciliation {
    /// The platform whose statement it is: only its payments and refunds
    /// are compared.
    pub channel: &'static str,
    pub period: Vec<String>,
    /// The kinds the statement declares it lists ("payment", "refund").
    pub compared: Vec<&'static str>,
    pub matched: usize,
    pub missing_local: DiffRows,
    pub missing_remote: DiffRows,
    pub amount_mismatch: DiffRows,
    /// With repair: what each missing_local payment became.
    pub repaired: Option<Vec<Repaired>>,
}

/// A payment or refund the platform and payonce disagree on, as judged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiffRow<'a> {
    pub kind: RowKind,
    /// The platform it was paid or refunded through (the statement's).
    pub channel: &'a str,
    /// The pay_no, or the refund_no of a refund.
    pub pay_no: &'a str,
    pub order_no: &'a str,
    pub amount_platform: Option<i64>,
    pub amount_local: Option<i64>,
    /// A WeChat Pay payment's non-zero 代金券金额.
    pub coupon_amount: Option<i64>,
}

/// One list of [`DiffRow`]s, each kept as its answer JSON from the moment
/// it is judged ([`DiffRows::push`] in `render`): a statement no row of
/// which payonce knows lists every row here, and the text of a row is a
/// fraction of a struct of owned strings. The text is kept in pieces of
/// [`DIFF_PIECE_BYTES`], so a long list never reallocates (and briefly
/// doubles) one large buffer, and the answer is written from the pieces,
/// each freed once copied (docs/performance.md, "Reconciliation memory").
#[derive(Clone, Default, PartialEq, Eq)]
pub struct DiffRows {
    /// The rows' JSON objects, comma-separated, without the brackets: the
    /// pieces one after the other (a row is never split between two).
    pub(crate) pieces: Vec<Vec<u8>>,
    pub(crate) len: usize,
}

/// A [`DiffRows`] piece's capacity, in bytes.
pub const DIFF_PIECE_BYTES: usize = 256 * 1024;

impl DiffRows {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A keyed repair's answer while its transaction runs: the comparison and
/// the repairs of this attempt, rendered as one [`Reconciliation`].
pub(crate) struct Repairing<'r> {
    pub(crate) result: &'r Reconciliation,
    pub(crate) repaired: Vec<Repaired>,
}

/// What a repair made of a missing_local payment: its outcome, or the refusal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Repaired {
    pub pay_no: String,
    pub order_no: String,
    pub outcome: Result<&'static str, Error>,
}

impl Reconciliation {
    pub fn is_clean(&self) -> bool {
        self.missing_local.is_empty() && self.missing_remote.is_empty() && self.amount_mismatch.is_empty()
    }
}

/// The temporary file's suffix: whatever is left after a kill ends in it
/// (or in `.partial-wal`/`.partial-shm` during the integrity check).
pub const BACKUP_PARTIAL_SUFFIX: &str = ".partial";

/// Statement rows compared per read transaction.
pub const COMPARE_BATCH_ROWS: usize = 512;

/// The window of `GET /v1/admin/stats`: the last hour in 1-minute buckets
/// or the last day in 15-minute buckets (docs/operations.md, "Counts over
/// time").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatsWindow {
    Hour,
    Day,
}

impl StatsWindow {
    pub const ALL: [StatsWindow; 2] = [StatsWindow::Hour, StatsWindow::Day];

    pub fn parse(text: &str) -> Option<StatsWindow> {
        StatsWindow::ALL.into_iter().find(|w| w.as_str() == text)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            StatsWindow::Hour => "1h",
            StatsWindow::Day => "24h",
        }
    }

    /// The length of one bucket, in seconds.
    pub fn bucket_s(self) -> i64 {
        match self {
            StatsWindow::Hour => 60,
            StatsWindow::Day => 15 * 60,
        }
    }

    /// How many buckets the window holds (the newest one holds now).
    pub fn buckets(self) -> usize {
        match self {
            StatsWindow::Hour => 60,
            StatsWindow::Day => 96,
        }
    }

    /// The start of the first bucket, in Unix ms, for a window ending in
    /// the bucket that holds `now_ms`: buckets are aligned to their size in
    /// UTC.
    pub fn first_start_ms(self, now_ms: i64) -> i64 {
        let bucket_ms = self.bucket_s() * 1000;
        let newest = now_ms.div_euclid(bucket_ms) * bucket_ms;
        newest - (self.buckets() as i64 - 1) * bucket_ms
    }
}

/// One bucket of `GET /v1/admin/stats`: every known key, 0 when none.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatsBucket {
    /// RFC 3339 UTC.
    pub start: String,
    pub payments: Vec<(&'static str, i64)>,
    pub refunds: Vec<(&'static str, i64)>,
    pub webhook_deliveries: Vec<(&'static str, i64)>,
}

/// The state at the moment of the answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatsNow {
    pub webhook_pending: i64,
    /// Whole seconds since the oldest pending delivery was queued; `None` with none pending.
    pub webhook_oldest_pending_s: Option<i64>,
    /// The inspection's findings by kind, every kind (0 when none).
    pub findings: Vec<(&'static str, i64)>,
}

/// `GET /v1/admin/stats?window=`: counts from the database, oldest bucket first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stats {
    pub window: StatsWindow,
    pub buckets: Vec<StatsBucket>,
    pub now: StatsNow,
}
