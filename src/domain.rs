//! The vocabulary of payonce: order states and their legal edges, callback
//! outcomes, identifiers and money limits. Pure data and pure functions; no I/O.

use serde_json::Value;

/// Smallest and largest amount in minor units.
pub const AMOUNT_MIN: i64 = 1;
pub const AMOUNT_MAX: i64 = 1_000_000_000_000;
/// Identifiers are 1..=64 characters of `[A-Za-z0-9_.-]`.
pub const IDENTIFIER_BYTES_MAX: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OrderStatus {
    Pending,
    Paid,
    Closed,
    Refunding,
    Refunded,
}

/// The only legal edges of the order state machine. `schema.sql` holds the
/// same table as a trigger, so the database refuses what this table refuses,
/// and each compare-and-set in `store/orders.rs` asserts its edge against
/// this table at compile time (`can_move_to` in a `const` block).
pub const LEGAL_TRANSITIONS: [(OrderStatus, OrderStatus); 5] = [
    (OrderStatus::Pending, OrderStatus::Paid), // payment callback (the only way in)
    (OrderStatus::Pending, OrderStatus::Closed), // expiry or explicit close
    (OrderStatus::Paid, OrderStatus::Refunding), // refund requested
    (OrderStatus::Refunding, OrderStatus::Refunded), // refund callback SUCCESS
    (OrderStatus::Refunding, OrderStatus::Paid), // refund callback FAILED
];

impl OrderStatus {
    pub const ALL: [OrderStatus; 5] =
        [OrderStatus::Pending, OrderStatus::Paid, OrderStatus::Closed, OrderStatus::Refunding, OrderStatus::Refunded];

    pub fn as_str(self) -> &'static str {
        match self {
            OrderStatus::Pending => "PENDING",
            OrderStatus::Paid => "PAID",
            OrderStatus::Closed => "CLOSED",
            OrderStatus::Refunding => "REFUNDING",
            OrderStatus::Refunded => "REFUNDED",
        }
    }

    pub fn parse(text: &str) -> Option<OrderStatus> {
        OrderStatus::ALL.into_iter().find(|s| s.as_str() == text)
    }

    /// Whether `self → to` is one of [`LEGAL_TRANSITIONS`]. `const`, so each
    /// compare-and-set of `store/orders.rs` checks its own edge against the
    /// table when it is compiled.
    pub const fn can_move_to(self, to: OrderStatus) -> bool {
        let mut i = 0;
        while i < LEGAL_TRANSITIONS.len() {
            let (from, into) = LEGAL_TRANSITIONS[i];
            if from as u8 == self as u8 && into as u8 == to as u8 {
                return true;
            }
            i += 1;
        }
        false
    }
}

/// What a payment callback did, decided in the order of precedence of docs/channels.md.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PaymentOutcome {
    /// Waiting in record-only mode; decided later.
    Recorded,
    PaymentFailed,
    PaidAfterClose,
    AlreadyPaid,
    AmountMismatch,
    Applied,
}

impl PaymentOutcome {
    pub const ALL: [PaymentOutcome; 6] = [
        PaymentOutcome::Recorded,
        PaymentOutcome::PaymentFailed,
        PaymentOutcome::PaidAfterClose,
        PaymentOutcome::AlreadyPaid,
        PaymentOutcome::AmountMismatch,
        PaymentOutcome::Applied,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PaymentOutcome::Recorded => "recorded",
            PaymentOutcome::PaymentFailed => "payment_failed",
            PaymentOutcome::PaidAfterClose => "paid_after_close",
            PaymentOutcome::AlreadyPaid => "already_paid",
            PaymentOutcome::AmountMismatch => "amount_mismatch",
            PaymentOutcome::Applied => "applied",
        }
    }

    pub fn parse(text: &str) -> Option<PaymentOutcome> {
        PaymentOutcome::ALL.into_iter().find(|o| o.as_str() == text)
    }

    /// Money moved to the merchant but the order did not take it: the
    /// buyer must get it back (event `payment.refund_required`).
    pub fn requires_refund(self) -> bool {
        matches!(self, PaymentOutcome::PaidAfterClose | PaymentOutcome::AlreadyPaid | PaymentOutcome::AmountMismatch)
    }
}

/// What the platform says happened to a payment or a refund.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlatformStatus {
    Success,
    Failed,
}

impl PlatformStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            PlatformStatus::Success => "SUCCESS",
            PlatformStatus::Failed => "FAILED",
        }
    }

    pub fn parse(text: &str) -> Option<PlatformStatus> {
        match text {
            "SUCCESS" => Some(PlatformStatus::Success),
            "FAILED" => Some(PlatformStatus::Failed),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefundOutcome {
    Applied,
    RefundFailed,
    Duplicate,
    UnexpectedRefund,
}

impl RefundOutcome {
    pub const ALL: [RefundOutcome; 4] = [
        RefundOutcome::Applied,
        RefundOutcome::RefundFailed,
        RefundOutcome::Duplicate,
        RefundOutcome::UnexpectedRefund,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RefundOutcome::Applied => "applied",
            RefundOutcome::RefundFailed => "refund_failed",
            RefundOutcome::Duplicate => "duplicate",
            RefundOutcome::UnexpectedRefund => "unexpected_refund",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefundStatus {
    Requested,
    Succeeded,
    Failed,
}

impl RefundStatus {
    pub const ALL: [RefundStatus; 3] = [RefundStatus::Requested, RefundStatus::Succeeded, RefundStatus::Failed];

    pub fn as_str(self) -> &'static str {
        match self {
            RefundStatus::Requested => "REQUESTED",
            RefundStatus::Succeeded => "SUCCEEDED",
            RefundStatus::Failed => "FAILED",
        }
    }

    pub fn parse(text: &str) -> Option<RefundStatus> {
        match text {
            "REQUESTED" => Some(RefundStatus::Requested),
            "SUCCEEDED" => Some(RefundStatus::Succeeded),
            "FAILED" => Some(RefundStatus::Failed),
            _ => None,
        }
    }
}

/// Event types of the outbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    OrderPaid,
    OrderClosed,
    OrderRefunding,
    OrderRefunded,
    OrderPartiallyRefunded,
    OrderRefundFailed,
    PaymentRefundRequired,
    PaymentRefunded,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::OrderPaid => "order.paid",
            EventType::OrderClosed => "order.closed",
            EventType::OrderRefunding => "order.refunding",
            EventType::OrderRefunded => "order.refunded",
            EventType::OrderPartiallyRefunded => "order.partially_refunded",
            EventType::OrderRefundFailed => "order.refund_failed",
            EventType::PaymentRefundRequired => "payment.refund_required",
            EventType::PaymentRefunded => "payment.refunded",
        }
    }

    /// `"{type}:{subject}"`, the event's idempotency key.
    pub fn event_id(self, subject: &str) -> String {
        format!("{}:{subject}", self.as_str())
    }
}

pub const POINT_TYPE_ORDER_PAID: &str = "ORDER_PAID";
pub const POINT_TYPE_ORDER_PAID_REVERSAL: &str = "ORDER_PAID_REVERSAL";

/// An order as stored and as returned by the API.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Order {
    pub id: i64,
    pub order_no: String,
    pub user_id: String,
    pub amount: i64,
    pub currency: String,
    pub status: OrderStatus,
    pub pay_no: Option<String>,
    pub created_at: String,
    pub expires_at: String,
    pub paid_at: Option<String>,
    pub closed_at: Option<String>,
    pub refund_no: Option<String>,
    pub refunded_at: Option<String>,
    /// The sum of its succeeded refunds (minor units), kept by the database.
    pub refunded_amount: i64,
    /// The amount of its refund in flight (REQUESTED), else 0.
    pub refunding_amount: i64,
}

/// Rewards a payment earns, fixed when it is applied.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rewards {
    pub coupon_templates: Vec<String>,
    pub points_per_yuan: i64,
}

impl Rewards {
    /// points = floor(amount × N / 100), in i128 so no amount overflows.
    pub fn points_for(&self, amount: i64) -> i64 {
        let points = i128::from(amount) * i128::from(self.points_per_yuan) / 100;
        i64::try_from(points).unwrap_or(i64::MAX)
    }
}

/// 1-64 characters of `[A-Za-z0-9_.-]`, and not `.` or `..` (which a path
/// segment, a file name or a URL could read as a directory step).
pub fn is_identifier(text: &str) -> bool {
    !text.is_empty()
        && text != "."
        && text != ".."
        && text.len() <= IDENTIFIER_BYTES_MAX
        && text.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

pub fn is_currency(text: &str) -> bool {
    text.len() == 3 && text.bytes().all(|b| b.is_ascii_uppercase())
}

pub fn is_amount(amount: i64) -> bool {
    (AMOUNT_MIN..=AMOUNT_MAX).contains(&amount)
}

/// How long before payonce receives a payment notification the platform may
/// say it was paid. The platforms retry for about 25 h at most; an older
/// date on a pay_no payonce never saw is a forged or broken one (it would
/// date the payment out of reconciliation's reach).
pub const PLATFORM_TIME_BEFORE_MS_MAX: i64 = 72 * 3_600_000;
/// How long after: the platform's clock may run ahead of payonce's.
pub const PLATFORM_TIME_AFTER_MS_MAX: i64 = 5 * 60_000;
/// Platform times are refused outside these years outright, whatever the window.
pub const PLATFORM_YEAR_FIRST: i64 = 2000;
pub const PLATFORM_YEAR_LAST: i64 = 2199;
/// The same in Unix ms: 2000-01-01T00:00:00Z and 2200-01-01T00:00:00Z.
pub const PLATFORM_TIME_MS_MIN: i64 = 946_684_800_000;
pub const PLATFORM_TIME_MS_END: i64 = 7_258_118_400_000;

/// Whether a platform's time `platform_ms` is believable for a payment
/// payonce sees first at `reference_ms`: within [reference − 72 h,
/// reference + 5 min] and in the years 2000-2199. Reconciliation asks the
/// same of a recorded platform time against `decided_at`.
pub fn platform_time_plausible(platform_ms: i64, reference_ms: i64) -> bool {
    let window = reference_ms.saturating_sub(PLATFORM_TIME_BEFORE_MS_MAX)
        ..=reference_ms.saturating_add(PLATFORM_TIME_AFTER_MS_MAX);
    window.contains(&platform_ms) && (PLATFORM_TIME_MS_MIN..PLATFORM_TIME_MS_END).contains(&platform_ms)
}

#[cfg(test)]
mod tests {
    /// A payment's refund numbers: `U-` + pay_no, `-N` from the second
    /// attempt, the pay_no's SHA-256 (40 hex digits) once that passes 64.
    #[test]
    fn payment_refund_numbers() {
        use super::payment_refund_no;
        assert_eq!(payment_refund_no("4200001234", 1), "U-4200001234");
        assert_eq!(payment_refund_no("4200001234", 2), "U-4200001234-2");
        assert_eq!(payment_refund_no("4200001234", 13), "U-4200001234-13");
        let fits = "P".repeat(62);
        assert_eq!(payment_refund_no(&fits, 1), format!("U-{fits}"));
        // SHA-256("PPP…P" × 62), independently: `printf 'P%.0s' $(seq 62) | sha256sum`.
        assert_eq!(payment_refund_no(&fits, 2), "U-8f8203c4a5138321170ff4771ffccb18f1659073-2");
        let long = "9".repeat(64);
        let first = payment_refund_no(&long, 1);
        assert_eq!(first.len(), 42);
        assert_eq!(&first[2..], &payment_refund_no(&long, 3)[2..42], "one digest per payment");
        assert!(first[2..].bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert!(super::is_identifier(&first) && super::is_identifier(&payment_refund_no(&long, 50)));
    }

    /// The typed kinds and states of a platform call are exactly what the
    /// schema's CHECKs allow, on both engines.
    #[test]
    fn platform_call_kinds_and_states_are_the_schemas() {
        for schema in [include_str!("../schema.sql"), include_str!("../schema.postgres.sql")] {
            let table = &schema[schema.find("CREATE TABLE platform_call").expect("the table")..];
            let table = &table[..table.find(");").expect("its end")];
            for kind in PlatformCallKind::ALL {
                assert_eq!(PlatformCallKind::parse(kind.as_str()), Some(kind));
                assert!(table.contains(&format!("'{}'", kind.as_str())), "{kind:?} in the kind CHECK");
            }
            for status in PlatformCallStatus::ALL {
                assert_eq!(PlatformCallStatus::parse(status.as_str()), Some(status));
                assert!(table.contains(&format!("'{}'", status.as_str())), "{status:?} in the status CHECK");
            }
        }
        assert_eq!(PlatformCallKind::parse("refund_status"), None);
    }

    use super::*;

    #[test]
    fn every_state_pair_is_legal_only_along_the_five_edges() {
        let legal = [
            ("PENDING", "PAID"),
            ("PENDING", "CLOSED"),
            ("PAID", "REFUNDING"),
            ("REFUNDING", "REFUNDED"),
            ("REFUNDING", "PAID"),
        ];
        for from in OrderStatus::ALL {
            for to in OrderStatus::ALL {
                let expected = legal.contains(&(from.as_str(), to.as_str()));
                assert_eq!(from.can_move_to(to), expected, "{from:?} -> {to:?}");
            }
        }
    }

    #[test]
    fn identifiers() {
        let check = |text: &str, ok: bool| assert_eq!(is_identifier(text), ok, "{text:?}");
        check("ORD-2024.01_x", true);
        check(&"a".repeat(64), true);
        check(&"a".repeat(65), false);
        check("", false);
        check("has space", false);
        check("订单", false);
        check("a/b", false);
        check("a\0", false);
    }

    #[test]
    fn currencies_and_amounts() {
        assert!(is_currency("CNY"));
        assert!(!is_currency("cny"));
        assert!(!is_currency("CNYY"));
        assert!(is_amount(1) && is_amount(AMOUNT_MAX));
        assert!(!is_amount(0) && !is_amount(-5) && !is_amount(AMOUNT_MAX + 1));
    }

    #[test]
    fn points_are_floored_and_never_overflow() {
        let r = Rewards { coupon_templates: vec![], points_per_yuan: 3 };
        assert_eq!(r.points_for(9_999), 299);
        let big = Rewards { coupon_templates: vec![], points_per_yuan: i64::MAX };
        assert_eq!(big.points_for(AMOUNT_MAX), i64::MAX);
    }

    #[test]
    fn platform_times_within_the_window_and_the_years() {
        let now = 1_700_000_000_000;
        let check = |at: i64, ok: bool| assert_eq!(platform_time_plausible(at, now), ok, "{at} against {now}");
        check(now, true);
        check(now - PLATFORM_TIME_BEFORE_MS_MAX, true);
        check(now - PLATFORM_TIME_BEFORE_MS_MAX - 1, false);
        check(now + PLATFORM_TIME_AFTER_MS_MAX, true);
        check(now + PLATFORM_TIME_AFTER_MS_MAX + 1, false);
        check(PLATFORM_TIME_MS_MIN, false);
        check(i64::MIN, false);
        check(i64::MAX, false);
        // The years alone, with a reference at their edges.
        assert!(platform_time_plausible(PLATFORM_TIME_MS_MIN, PLATFORM_TIME_MS_MIN));
        assert!(!platform_time_plausible(PLATFORM_TIME_MS_MIN - 1, PLATFORM_TIME_MS_MIN));
        assert!(platform_time_plausible(PLATFORM_TIME_MS_END - 1, PLATFORM_TIME_MS_END - 1));
        assert!(!platform_time_plausible(PLATFORM_TIME_MS_END, PLATFORM_TIME_MS_END));
        assert_eq!(crate::clock::format_ms(PLATFORM_TIME_MS_MIN), "2000-01-01T00:00:00.000Z");
        assert_eq!(crate::clock::format_ms(PLATFORM_TIME_MS_END), "2200-01-01T00:00:00.000Z");
    }

    #[test]
    fn outcome_names_round_trip() {
        for o in PaymentOutcome::ALL {
            assert_eq!(PaymentOutcome::parse(o.as_str()), Some(o));
        }
    }
}

// ---- the commands a channel maps a notification onto ----

/// A payment notification, verified by its channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PaymentCallback {
    pub channel: String,
    pub pay_no: String,
    pub order_no: String,
    pub amount: i64,
    /// The currency of `amount` (3 upper-case letters) as the platform
    /// states it; `None`: the order's own (a generic notice without one).
    /// Another currency than the order's is `amount_mismatch`.
    pub currency: Option<String>,
    pub status: PlatformStatus,
    /// The platform's payment time, normalised to payonce's UTC text.
    pub paid_at: Option<String>,
    /// The exact bytes received, kept in `pay_callback_log.raw_body`.
    pub raw_body: Vec<u8>,
}

/// A refund result, verified by its channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefundCallback {
    pub channel: String,
    pub refund_no: String,
    pub order_no: String,
    pub status: PlatformStatus,
    /// The platform's own time of a successful refund (WeChat Pay
    /// `success_time`, Alipay `gmt_refund`), normalised to payonce's UTC
    /// text; kept as `refund.platform_settled_at`.
    pub settled_at: Option<String>,
    /// The refund's own amount as the platform states it (WeChat Pay
    /// `amount.refund`, the generic `amount`), minor units; `None` when it
    /// states none. Checked against the refund's amount before it settles.
    pub amount: Option<i64>,
    /// The trade's refunded total after this refund (Alipay `refund_fee`, a
    /// running total), minor units; checked against the order's refunded
    /// amount plus this refund's.
    pub refunded_total: Option<i64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PaymentReply {
    pub outcome: PaymentReplyOutcome,
}

/// What the platform is told: a fresh outcome, or `duplicate` with the
/// outcome recorded first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PaymentReplyOutcome {
    Decided(PaymentOutcome),
    Duplicate { original: PaymentOutcome },
}

impl PaymentReply {
    pub fn outcome_str(&self) -> &'static str {
        match self.outcome {
            PaymentReplyOutcome::Decided(o) => o.as_str(),
            PaymentReplyOutcome::Duplicate { .. } => "duplicate",
        }
    }
}

// ---- the rows payonce reads and writes (the store fills them; nothing here knows an engine) ----

/// A new order, validated.
#[derive(Clone, Debug)]
pub struct NewOrder {
    pub order_no: String,
    pub user_id: String,
    pub amount: i64,
    pub currency: String,
    pub created_at: String,
    pub expires_at: String,
}

/// A row of `pay_callback_log`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallbackRecord {
    pub id: i64,
    pub pay_no: String,
    pub channel: String,
    pub order_id: i64,
    pub amount: i64,
    /// The currency the delivery stated for `amount`; `None`: the order's
    /// own (a generic notice without one, or a row recorded before schema
    /// version 9).
    pub currency: Option<String>,
    pub status: PlatformStatus,
    pub outcome: PaymentOutcome,
    pub decided: bool,
    pub source: String,
    pub paid_at: Option<String>,
    pub received_at: String,
    pub decided_at: Option<String>,
    /// How a refund-required payment was resolved (`refunded_externally`,
    /// `accepted`, or `refunded` by its own refund), as stored.
    pub resolution: Option<String>,
}

/// A payment delivery to record: what the platform said, byte for byte.
#[derive(Clone, Debug)]
pub struct NewCallback<'a> {
    pub pay_no: &'a str,
    pub channel: &'a str,
    pub order_id: i64,
    pub amount: i64,
    /// Kept with the row, so a record decided later (drain) is judged in it.
    pub currency: Option<&'a str>,
    pub status: PlatformStatus,
    pub source: &'a str,
    pub raw_body: &'a [u8],
    pub paid_at: Option<&'a str>,
    pub received_at: &'a str,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefundRecord {
    pub id: i64,
    pub refund_no: String,
    pub order_id: i64,
    pub status: RefundStatus,
    pub requested_at: String,
    pub settled_at: Option<String>,
    /// What it returns, minor units.
    pub amount: i64,
    pub reason: Option<String>,
    /// The payment it returns, when it refunds one payment rather than the order.
    pub pay_no: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CouponRow {
    pub order_no: String,
    pub coupon_template_id: String,
    pub status: String,
    pub created_at: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PointRow {
    pub order_no: String,
    pub point_type: String,
    pub points: i64,
    pub created_at: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct EventRow {
    pub seq: i64,
    pub event_id: String,
    pub event_type: String,
    pub order_no: String,
    pub data: Value,
    pub created_at: String,
}

/// Where a keyed request's response is stored, with the work, in one transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdempotencySlot {
    pub scope: String,
    pub key: String,
    /// Hex SHA-256 of the raw request body.
    pub fingerprint: String,
    pub created_at: String,
    pub expires_at: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    pub fingerprint: String,
    pub status_code: u16,
    pub body: Vec<u8>,
}

/// One finding of the inspection.
#[derive(Clone, Debug, PartialEq)]
pub struct Finding {
    pub kind: &'static str,
    pub order_no: String,
    pub detail: FindingDetail,
}

/// What a finding of the inspection says beside its kind and order
/// (`render::finding_detail` writes it as the `detail` object, keys in the
/// order listed). Values read back from stored JSON stay JSON.
#[derive(Clone, Debug, PartialEq)]
pub enum FindingDetail {
    DuplicateCoupon {
        coupon_template_id: String,
        rows: i64,
    },
    DuplicatePoints {
        point_type: String,
        rows: i64,
    },
    /// `rewards_due` as recorded with the payment; `missing_coupons` its
    /// coupons not in the ledger.
    PaidWithoutRewards {
        pay_no: String,
        rewards_due: Value,
        missing_coupons: Vec<Value>,
        missing_points: bool,
    },
    AppliedCallbackOrderNotPaid {
        pay_no: String,
        order_status: String,
        order_pay_no: Option<String>,
    },
    RefundRequired {
        pay_no: String,
        outcome: String,
        amount: i64,
        channel: String,
        decided_at: Option<String>,
        /// The payment's latest refund: in flight (`resolution` `refunding`)
        /// or FAILED (the payment is refund-required again).
        refund: Option<RefundRecord>,
    },
    /// `status` as the first delivery's audit row recorded it.
    UnexpectedRefund {
        refund_no: String,
        status: Value,
        deliveries: i64,
        first_at: String,
    },
    CloseUnconfirmed {
        platforms: Vec<String>,
        given_up_at: String,
    },
    ReceivedNotApplied {
        pay_no: String,
        received_at: String,
    },
    /// A certificate payonce holds expires within
    /// [`KEY_EXPIRING_WITHIN_MS`] (or has expired): its platform, its id
    /// (WeChat Pay's serial) and when.
    KeyExpiring {
        platform: String,
        id: String,
        expires_at: String,
    },
}

/// How far ahead the inspection reports a certificate's expiry (`key_expiring`): 30 days.
pub const KEY_EXPIRING_WITHIN_MS: i64 = 30 * 24 * 3_600_000;

// ---- payloads stored as JSON text ----

/// A payload payonce stores as JSON text: an audit row's detail, an outbox
/// event's data, a payment's rewards due, the reward settings. Typed here;
/// only `render.rs` implements it (the one place JSON is shaped), so the
/// store writes the text it is given, key for key what the rows have
/// always held.
pub trait JsonText {
    fn json_text(&self) -> String;
}

/// An outbox event's `data` (`render.rs` writes it; every event carries
/// the order object).
#[derive(Clone, Copy, Debug)]
pub enum EventData<'a> {
    /// `order.paid` and `payment.refund_required`: the order and the payment.
    Payment { order: &'a Order, pay_no: &'a str, channel: &'a str, amount: i64, outcome: PaymentOutcome },
    /// `order.refunding`, `order.refunded`, `order.refund_failed`: the order and the refund.
    Refund { order: &'a Order, refund_no: &'a str, status: RefundStatus, amount: i64 },
    /// `order.closed`: the order.
    Closed { order: &'a Order },
    /// `payment.refunded`: the order, the payment and the refund that returned it.
    PaymentRefunded { order: &'a Order, payment: &'a CallbackRecord, refund_no: &'a str },
}

/// What a payment applied was due, recorded with it (`rewards_due`) so the
/// inspection can tell rewards that never reached the ledgers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RewardsDue {
    pub coupons: Vec<String>,
    pub points: i64,
}

/// What an order's refused transition was asked about, recorded before its
/// `from`, `to` and `request`.
#[derive(Clone, Copy, Debug)]
pub enum Refused<'a> {
    /// The order itself (a close).
    Order,
    /// A refund of it.
    Refund { refund_no: &'a str },
    /// A compensation freezing one of its coupons, already used.
    CouponFreeze { coupon_template_id: &'a str },
}

/// An `audit_log` row's detail, one variant per kind of row, fields in the
/// order `render.rs` writes them (the stored text).
#[derive(Clone, Copy, Debug)]
pub enum AuditDetail<'a> {
    TransitionRefused {
        about: Refused<'a>,
        from: OrderStatus,
        to: OrderStatus,
        request: &'a str,
    },
    /// A FAILED payment superseded by a SUCCESS: the `prior` FAILED record
    /// (`superseded_*`) and its acknowledged bytes, in base64.
    PaymentFailedSuperseded {
        pay_no: &'a str,
        prior: &'a CallbackRecord,
        failed_body: &'a str,
    },
    UnexpectedRefund {
        refund_no: &'a str,
        channel: &'a str,
        status: PlatformStatus,
        settled_status: Option<RefundStatus>,
        order_status: OrderStatus,
    },
    /// A refund's success whose amount disagrees with the refund: `stated`
    /// is the refund's amount as the result says it, or, with
    /// `refunded_total`, the trade's refunded total (Alipay's running
    /// `refund_fee`).
    RefundAmountMismatch {
        refund_no: &'a str,
        channel: &'a str,
        amount: i64,
        stated: i64,
        refunded_total: bool,
    },
    UnexpectedRefundResolved {
        refund_no: &'a str,
        resolution: &'a str,
        reason: &'a str,
    },
    ModeChanged {
        from: Option<&'a str>,
        to: &'a str,
    },
    ResolutionRefused {
        pay_no: &'a str,
        outcome: PaymentOutcome,
    },
    PaymentResolved {
        pay_no: &'a str,
        resolution: &'a str,
        reason: &'a str,
    },
    /// A refund of a refund-required payment requested: by an operator, or
    /// by payonce itself (`--refund-unwanted auto`).
    PaymentRefundRequested {
        pay_no: &'a str,
        refund_no: &'a str,
        amount: i64,
        reason: &'a str,
    },
    /// That refund settled: SUCCEEDED (`payment_refunded`) or FAILED
    /// (`payment_refund_failed`).
    PaymentRefundSettled {
        pay_no: &'a str,
        refund_no: &'a str,
        amount: i64,
    },
    CouponFrozen {
        coupon_template_id: &'a str,
        reason: &'a str,
    },
    PointsReversed {
        reason: &'a str,
    },
    PlatformClosed {
        platforms: &'a [&'a str],
    },
    CloseGivenUp {
        unconfirmed: &'a [&'a str],
    },
    CloseResolved {
        reason: &'a str,
    },
    WebhookDeliveryRetried {
        delivery_id: i64,
        endpoint: &'a str,
        event_id: &'a str,
        from: DeliveryStatus,
    },
    WebhookEndpointEnabled {
        endpoint: &'a str,
        disabled_at: Option<&'a str>,
        resumed: usize,
    },
    WebhookReplayed {
        endpoint: &'a str,
        after_seq: i64,
        until_seq: Option<i64>,
        queued: usize,
        next_after: Option<i64>,
    },
}

impl AuditDetail<'_> {
    /// The refund_no the row is about, for `audit_log.refund_no`.
    pub fn refund_no(&self) -> Option<&str> {
        match self {
            AuditDetail::UnexpectedRefund { refund_no, .. }
            | AuditDetail::RefundAmountMismatch { refund_no, .. }
            | AuditDetail::UnexpectedRefundResolved { refund_no, .. }
            | AuditDetail::PaymentRefundRequested { refund_no, .. }
            | AuditDetail::PaymentRefundSettled { refund_no, .. } => Some(refund_no),
            AuditDetail::TransitionRefused { about: Refused::Refund { refund_no }, .. } => Some(refund_no),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditRow {
    pub id: i64,
    pub at: String,
    pub actor: String,
    pub action: String,
    pub order_no: Option<String>,
    pub detail: String,
}

/// What a `platform_call` row asks of a platform (its `kind` column).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlatformCallKind {
    /// Close the trade (the pool works it, then the order closes here).
    Close,
    /// Submit a refund (the pool works it until accepted).
    Refund,
    /// Ask for a submitted refund's late result (the pool works it).
    RefundQuery,
    /// A query made at once for `/sync` or `payonce sync`: recorded, never
    /// queued, so the pool never sees one.
    Query,
    /// The creation of the platform's payment for an order, once per order
    /// and channel (`uk_platform_call_prepay`): made at once by the pay
    /// request that wins the row, never queued, so the pool never sees one.
    Prepay,
}

impl PlatformCallKind {
    pub const ALL: [PlatformCallKind; 5] = [
        PlatformCallKind::Close,
        PlatformCallKind::Refund,
        PlatformCallKind::RefundQuery,
        PlatformCallKind::Query,
        PlatformCallKind::Prepay,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PlatformCallKind::Close => "close",
            PlatformCallKind::Refund => "refund",
            PlatformCallKind::RefundQuery => "refund_query",
            PlatformCallKind::Query => "query",
            PlatformCallKind::Prepay => "prepay",
        }
    }

    pub fn parse(text: &str) -> Option<PlatformCallKind> {
        PlatformCallKind::ALL.into_iter().find(|k| k.as_str() == text)
    }
}

/// One `platform_call` row as `GET /v1/orders/{order_no}` shows it: what
/// was asked of which platform and how it went, never the request or the
/// answer (they may carry the merchant's account names).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlatformCallSummary {
    pub channel: String,
    pub kind: PlatformCallKind,
    pub status: PlatformCallStatus,
    pub attempts: i64,
    /// The HTTP status of the last attempt's answer; `None` before an
    /// attempt, or when none came (timeout, refused connection).
    pub http_status: Option<i64>,
    pub created_at: String,
    /// The refund it is about (`refund`, `refund_query`), else `None`.
    pub refund_no: Option<String>,
    /// When it last changed: its last attempt's end, or its creation.
    pub updated_at: String,
    /// Pending only: when its next attempt may start.
    pub next_attempt_at: Option<String>,
}

/// Where a `platform_call` row stands (its `status` column).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlatformCallStatus {
    /// Waiting for its next attempt, or with an attempt in flight.
    Pending,
    /// The platform answered what was asked.
    Done,
    /// A close past `--close-give-up-s` without the platform's confirmation.
    GivenUp,
    /// Cannot be made or was refused for good (recorded with its reason).
    Failed,
}

impl PlatformCallStatus {
    pub const ALL: [PlatformCallStatus; 4] = [
        PlatformCallStatus::Pending,
        PlatformCallStatus::Done,
        PlatformCallStatus::GivenUp,
        PlatformCallStatus::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PlatformCallStatus::Pending => "pending",
            PlatformCallStatus::Done => "done",
            PlatformCallStatus::GivenUp => "given_up",
            PlatformCallStatus::Failed => "failed",
        }
    }

    pub fn parse(text: &str) -> Option<PlatformCallStatus> {
        PlatformCallStatus::ALL.into_iter().find(|s| s.as_str() == text)
    }
}

// ---- webhooks (docs/webhooks.md) ----

/// Where one delivery (an event to one endpoint) stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeliveryStatus {
    /// Waiting for its next attempt, or with an attempt in flight.
    Pending,
    /// An attempt got a 2xx.
    Delivered,
    /// The last attempt of the schedule failed: a dead letter.
    Failed,
    /// Stopped because its endpoint answered 410 Gone.
    Disabled,
}

impl DeliveryStatus {
    pub const ALL: [DeliveryStatus; 4] =
        [DeliveryStatus::Pending, DeliveryStatus::Delivered, DeliveryStatus::Failed, DeliveryStatus::Disabled];

    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryStatus::Pending => "pending",
            DeliveryStatus::Delivered => "delivered",
            DeliveryStatus::Failed => "failed",
            DeliveryStatus::Disabled => "disabled",
        }
    }

    pub fn parse(text: &str) -> Option<DeliveryStatus> {
        DeliveryStatus::ALL.into_iter().find(|s| s.as_str() == text)
    }
}

/// A `webhook_endpoint` row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointRow {
    pub endpoint: String,
    pub enabled: bool,
    /// Events after this seq are the endpoint's; older ones reach it by replay only.
    pub from_seq: i64,
    /// A delivery row exists for every event up to this seq.
    pub relayed_seq: i64,
    pub disabled_at: Option<String>,
}

/// A `webhook_delivery` row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeliveryRow {
    pub id: i64,
    pub endpoint: String,
    pub event_seq: i64,
    pub event_id: String,
    pub order_no: String,
    pub status: DeliveryStatus,
    pub attempts: i64,
    pub next_attempt_at: Option<String>,
    pub last_attempt_at: Option<String>,
    pub last_status: Option<i64>,
    pub last_error: Option<String>,
    pub queued_at: String,
}

/// How an attempt ended, as the delivery row records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttemptResult {
    /// A 2xx.
    Delivered { status: u16 },
    /// Anything else, a timeout or a refused connection, with the schedule
    /// not yet spent: the next attempt may start at `next_attempt_at`.
    Retry { status: Option<u16>, error: String, next_attempt_at: String },
    /// The same after the last wait of the schedule: a dead letter.
    Failed { status: Option<u16>, error: String },
    /// 410 Gone: the endpoint is disabled with every pending delivery to it.
    Gone,
}

/// What payonce does with money it did not want (`--refund-unwanted`): a
/// payment decided `already_paid`, `paid_after_close` or `amount_mismatch`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RefundUnwanted {
    /// Recorded and reported; an operator refunds it
    /// (`POST /v1/admin/payments/{pay_no}/refund`) or resolves it.
    #[default]
    Manual,
    /// Its refund is requested in the transaction that records it.
    Auto,
}

impl RefundUnwanted {
    pub fn parse(text: &str) -> Option<RefundUnwanted> {
        match text {
            "manual" => Some(RefundUnwanted::Manual),
            "auto" => Some(RefundUnwanted::Auto),
            _ => None,
        }
    }
}

/// Where a refund-required payment stands, as `GET /v1/orders/{order_no}`
/// shows it: its stored resolution, else `refunding` while its own refund
/// is in flight, else none (refund-required, or not such a payment).
pub fn payment_resolution<'a>(payment: &'a CallbackRecord, refunds: &[RefundRecord]) -> Option<&'a str> {
    if let Some(resolution) = payment.resolution.as_deref() {
        return Some(resolution);
    }
    refunds
        .iter()
        .any(|r| r.pay_no.as_deref() == Some(payment.pay_no.as_str()) && r.status == RefundStatus::Requested)
        .then_some("refunding")
}

/// The refund_no of a payment's refund, attempt `attempt` (1 first): `U-` +
/// pay_no, `-N` after it from the second attempt on; when that is longer
/// than 64 characters, the pay_no is replaced by the first 40 hex digits of
/// its SHA-256. The same payment and attempt always get the same number, so
/// the platform, which refunds a refund number once, refunds the payment once
/// per attempt.
pub fn payment_refund_no(pay_no: &str, attempt: usize) -> String {
    let suffix = if attempt <= 1 { String::new() } else { format!("-{attempt}") };
    let plain = format!("U-{pay_no}{suffix}");
    if plain.len() <= 64 {
        return plain;
    }
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(pay_no.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("U-{}{suffix}", &hex[..40])
}

/// Every kind of inspection finding (`GET /v1/inspections`), as `/metrics`
/// labels them from the start.
pub const FINDING_KINDS: [&str; 9] = [
    "duplicate_coupon",
    "duplicate_points",
    "paid_without_rewards",
    "applied_callback_order_not_paid",
    "refund_required",
    "unexpected_refund",
    "received_not_applied",
    "close_unconfirmed",
    "key_expiring",
];

/// Which counts a [`StatsCount`] adds to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatsSeries {
    /// Payments by outcome, at `decided_at` (waiting records as `recorded` at `received_at`).
    Payments,
    /// Refunds by status, at `settled_at` (REQUESTED at `requested_at`).
    Refunds,
    /// Webhook deliveries by final status (`delivered`, `failed`), at their last attempt.
    WebhookDeliveries,
}

/// One row of the store's stats query: `n` rows of `series` with this
/// `key` (an outcome, a status) in the minute starting at `minute`
/// (`YYYY-MM-DDTHH:MM`, UTC).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatsCount {
    pub series: StatsSeries,
    pub key: String,
    pub minute: String,
    pub n: i64,
}
