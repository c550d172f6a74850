//! The JSON of every answer, in one place: each object (order detail,
//! payment, coupon, points entry, event, finding, reconciliation row) has
//! one renderer here, and each operation's result its [`Answer`] (what the
//! API sends, and what a keyed write stores with its work). The payloads
//! the core stores as JSON (audit details, event data, rewards due: the
//! typed [`JsonText`] payloads of `domain`) are written here too, and so
//! is the inspection's finding detail. `app` and `ops` return types and
//! reach this module only through those traits; only `api` and the webhook
//! relay (whose bodies are the event objects) import it. The error body is
//! `wire::error_body`, which the channels answer with too.

use crate::app::{Answer, OrderDetail};
use crate::domain::{AuditDetail, EventData, FindingDetail, JsonText, Order, Refused, RewardsDue};
use crate::domain::{
    AuditRow, CallbackRecord, CouponRow, DeliveryRow, EventRow, Finding, PlatformCallSummary, PointRow, RefundRecord,
    RefundStatus,
};
use crate::error::Error;
use crate::ops::{
    Compensated, CompensationEffect, DiffRow, DiffRows, Drained, Mode, PaymentRefund, PaymentResolution,
    Reconciliation, RefundRequested, RefundResolution, Repaired, Repairing, DIFF_PIECE_BYTES,
};
use crate::platform_ops::{Paying, Synced};
use crate::platforms::TradeState;
use crate::webhook_ops::{DeliveryPage, EnabledEndpoint, Replayed};
use crate::wire;
use serde_json::{json, Map, Value};

// ---- objects ----

impl Order {
    /// The order object of the API (and of every event): every key
    /// present, unset ones `null`.
    pub fn to_json(&self) -> Value {
        json!({
            "order_no": self.order_no,
            "user_id": self.user_id,
            "amount": self.amount,
            "currency": self.currency,
            "status": self.status.as_str(),
            "pay_no": self.pay_no,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "paid_at": self.paid_at,
            "closed_at": self.closed_at,
            "refund_no": self.refund_no,
            "refunded_at": self.refunded_at,
            "refunded_amount": self.refunded_amount,
            "refunding_amount": self.refunding_amount,
        })
    }
}

/// A payment of an order (`GET /v1/orders/{order_no}`): where it stands
/// (`resolution`) and its own refunds among `refunds` (the order's payment
/// refunds), oldest first.
pub fn payment(p: &CallbackRecord, refunds: &[RefundRecord], order_no: &str) -> Value {
    let own: Vec<Value> = refunds
        .iter()
        .filter(|r| r.pay_no.as_deref() == Some(p.pay_no.as_str()))
        .map(|r| refund(r, order_no))
        .collect();
    json!({
        "pay_no": p.pay_no, "channel": p.channel, "amount": p.amount,
        "outcome": p.outcome.as_str(), "state": if p.decided { "decided" } else { "received" },
        "source": p.source, "received_at": p.received_at,
        "resolution": crate::domain::payment_resolution(p, refunds), "refunds": own,
    })
}

/// A coupon as it belongs to an order.
pub fn coupon(c: &CouponRow) -> Value {
    json!({"coupon_template_id": c.coupon_template_id, "status": c.status, "created_at": c.created_at})
}

/// A points entry as it belongs to an order.
pub fn points_entry(p: &PointRow) -> Value {
    json!({"point_type": p.point_type, "points": p.points, "created_at": p.created_at})
}

/// `object` with `order_no` first: a user's coupon or points entry.
fn of_order(order_no: &str, object: Value) -> Value {
    let mut map = Map::new();
    map.insert("order_no".into(), json!(order_no));
    if let Value::Object(fields) = object {
        map.extend(fields);
    }
    Value::Object(map)
}

pub fn user_coupons(coupons: &[CouponRow]) -> Value {
    let coupons: Vec<Value> = coupons.iter().map(|c| of_order(&c.order_no, coupon(c))).collect();
    json!({"coupons": coupons})
}

pub fn user_points(balance: i64, entries: &[PointRow]) -> Value {
    let entries: Vec<Value> = entries.iter().map(|p| of_order(&p.order_no, points_entry(p))).collect();
    json!({"balance": balance, "entries": entries})
}

/// An `audit_log` row; `detail` is the JSON it was written as.
pub fn audit_entry(a: &AuditRow) -> Value {
    let detail: Value = serde_json::from_str(&a.detail).unwrap_or_else(|_| Value::String(a.detail.clone()));
    json!({"at": a.at, "actor": a.actor, "action": a.action, "detail": detail})
}

pub fn event(e: &EventRow) -> Value {
    json!({"seq": e.seq, "event_id": e.event_id, "type": e.event_type,
           "order_no": e.order_no, "data": e.data, "created_at": e.created_at})
}

pub fn events(rows: &[EventRow], next_after: i64) -> Value {
    let events: Vec<Value> = rows.iter().map(event).collect();
    json!({"events": events, "next_after": next_after})
}

pub fn orders(orders: &[Order], next: Option<i64>) -> Value {
    let orders: Vec<Value> = orders.iter().map(Order::to_json).collect();
    json!({"orders": orders, "next_after": next.map(|n| n.to_string())})
}

pub fn mode(mode: Mode) -> Value {
    json!({"mode": mode.as_str()})
}

/// `GET /v1/admin/stats` (docs/operations.md, "Counts over time"): every
/// known outcome, status and finding kind is present, 0 when none.
pub fn stats(stats: &crate::ops::Stats) -> Value {
    let counts = |pairs: &[(&str, i64)]| -> Value {
        Value::Object(pairs.iter().map(|(key, n)| ((*key).to_owned(), json!(n))).collect())
    };
    let buckets: Vec<Value> = stats
        .buckets
        .iter()
        .map(|b| {
            json!({"start": b.start, "payments": counts(&b.payments), "refunds": counts(&b.refunds),
                   "webhook_deliveries": counts(&b.webhook_deliveries)})
        })
        .collect();
    json!({
        "window": stats.window.as_str(),
        "bucket_s": stats.window.bucket_s(),
        "buckets": buckets,
        "now": {
            "webhook_pending": stats.now.webhook_pending,
            "webhook_oldest_pending_s": stats.now.webhook_oldest_pending_s,
            "findings": counts(&stats.now.findings),
        },
    })
}

/// The inspection's answer: `{"ok":bool,"findings":[{"kind","order_no","detail"}]}`
/// (the API and `payonce inspect` print the same).
pub fn inspection(findings: &[Finding]) -> Value {
    let list: Vec<Value> = findings
        .iter()
        .map(|f| json!({"kind": f.kind, "order_no": f.order_no, "detail": finding_detail(&f.detail)}))
        .collect();
    json!({"ok": findings.is_empty(), "findings": list})
}

/// A finding's `detail` object.
pub fn finding_detail(detail: &FindingDetail) -> Value {
    match detail {
        FindingDetail::DuplicateCoupon { coupon_template_id, rows } => {
            json!({"coupon_template_id": coupon_template_id, "rows": rows})
        }
        FindingDetail::DuplicatePoints { point_type, rows } => json!({"point_type": point_type, "rows": rows}),
        FindingDetail::PaidWithoutRewards { pay_no, rewards_due, missing_coupons, missing_points } => json!({
            "pay_no": pay_no, "rewards_due": rewards_due,
            "missing_coupons": missing_coupons, "missing_points": missing_points,
        }),
        FindingDetail::AppliedCallbackOrderNotPaid { pay_no, order_status, order_pay_no } => {
            json!({"pay_no": pay_no, "order_status": order_status, "order_pay_no": order_pay_no})
        }
        FindingDetail::RefundRequired { pay_no, outcome, amount, channel, decided_at, refund } => {
            let in_flight = refund.as_ref().is_some_and(|r| r.status == RefundStatus::Requested);
            json!({
                "pay_no": pay_no, "outcome": outcome, "amount": amount,
                "channel": channel, "decided_at": decided_at,
                "resolution": if in_flight { Some("refunding") } else { None },
                "refund": refund.as_ref().map(|r| json!({
                    "refund_no": r.refund_no, "status": r.status.as_str(), "amount": r.amount,
                    "reason": r.reason, "requested_at": r.requested_at, "settled_at": r.settled_at,
                })),
            })
        }
        FindingDetail::UnexpectedRefund { refund_no, status, deliveries, first_at } => {
            json!({"refund_no": refund_no, "status": status, "deliveries": deliveries, "first_at": first_at})
        }
        FindingDetail::CloseUnconfirmed { platforms, given_up_at } => {
            json!({"platforms": platforms, "given_up_at": given_up_at})
        }
        FindingDetail::ReceivedNotApplied { pay_no, received_at } => {
            json!({"pay_no": pay_no, "received_at": received_at})
        }
        FindingDetail::KeyExpiring { platform, id, expires_at } => {
            json!({"platform": platform, "id": id, "expires_at": expires_at})
        }
    }
}

/// The detail as JSON text, as the inspector's log line prints it.
impl std::fmt::Display for FindingDetail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        finding_detail(self).fmt(f)
    }
}

// ---- payloads stored as JSON text ----

impl JsonText for EventData<'_> {
    fn json_text(&self) -> String {
        let data = match self {
            EventData::Payment { order, pay_no, channel, amount, outcome } => json!({
                "order": order.to_json(),
                "payment": {"pay_no": pay_no, "channel": channel, "amount": amount, "outcome": outcome.as_str()},
            }),
            EventData::Refund { order, refund_no, status, amount } => json!({
                "order": order.to_json(),
                "refund": {"refund_no": refund_no, "status": status.as_str(), "amount": amount},
            }),
            EventData::Closed { order } => json!({"order": order.to_json()}),
            EventData::PaymentRefunded { order, payment, refund_no } => json!({
                "order": order.to_json(),
                "payment": {"pay_no": payment.pay_no, "channel": payment.channel, "amount": payment.amount,
                            "outcome": payment.outcome.as_str(), "resolution": "refunded"},
                "refund": {"refund_no": refund_no, "status": RefundStatus::Succeeded.as_str(), "amount": payment.amount},
            }),
        };
        data.to_string()
    }
}

impl JsonText for RewardsDue {
    fn json_text(&self) -> String {
        json!({"coupons": self.coupons, "points": self.points}).to_string()
    }
}

/// A list of names as a JSON array: the reward settings' coupon templates.
impl JsonText for [String] {
    fn json_text(&self) -> String {
        json!(self).to_string()
    }
}

impl JsonText for AuditDetail<'_> {
    fn json_text(&self) -> String {
        audit_detail(self).to_string()
    }
}

fn audit_detail(detail: &AuditDetail) -> Value {
    match *detail {
        AuditDetail::TransitionRefused { about, from, to, request } => {
            let mut value = match about {
                Refused::Order => json!({}),
                Refused::Refund { refund_no } => json!({"refund_no": refund_no}),
                Refused::CouponFreeze { coupon_template_id } => {
                    json!({"compensation": "freeze_coupon", "coupon_template_id": coupon_template_id})
                }
            };
            if let Value::Object(map) = &mut value {
                map.insert("from".into(), json!(from.as_str()));
                map.insert("to".into(), json!(to.as_str()));
                map.insert("request".into(), json!(request));
            }
            value
        }
        AuditDetail::PaymentFailedSuperseded { pay_no, prior, failed_body } => {
            json!({"pay_no": pay_no, "superseded_outcome": prior.outcome.as_str(),
                   "superseded_received_at": prior.received_at, "superseded_source": prior.source,
                   "superseded_amount": prior.amount, "superseded_currency": prior.currency,
                   "superseded_raw_body_base64": failed_body})
        }
        AuditDetail::UnexpectedRefund { refund_no, channel, status, settled_status, order_status } => {
            json!({"refund_no": refund_no, "channel": channel, "status": status.as_str(),
                   "settled_status": settled_status.map(|s| s.as_str()), "order_status": order_status.as_str()})
        }
        AuditDetail::RefundAmountMismatch { refund_no, channel, amount, stated, refunded_total } => {
            let stated_as = if refunded_total { "refunded_total" } else { "amount" };
            json!({"refund_no": refund_no, "channel": channel, "status": "SUCCESS", "amount": amount,
                   "stated": stated, "stated_as": stated_as})
        }
        AuditDetail::UnexpectedRefundResolved { refund_no, resolution, reason } => {
            json!({"refund_no": refund_no, "resolution": resolution, "reason": reason})
        }
        AuditDetail::ModeChanged { from, to } => json!({"from": from, "to": to}),
        AuditDetail::ResolutionRefused { pay_no, outcome } => json!({"pay_no": pay_no, "outcome": outcome.as_str()}),
        AuditDetail::PaymentResolved { pay_no, resolution, reason } => {
            json!({"pay_no": pay_no, "resolution": resolution, "reason": reason})
        }
        AuditDetail::PaymentRefundRequested { pay_no, refund_no, amount, reason } => {
            json!({"pay_no": pay_no, "refund_no": refund_no, "amount": amount, "reason": reason})
        }
        AuditDetail::PaymentRefundSettled { pay_no, refund_no, amount } => {
            json!({"pay_no": pay_no, "refund_no": refund_no, "amount": amount})
        }
        AuditDetail::CouponFrozen { coupon_template_id, reason } => {
            json!({"action": "freeze_coupon", "coupon_template_id": coupon_template_id, "reason": reason})
        }
        AuditDetail::PointsReversed { reason } => json!({"action": "reverse_points", "reason": reason}),
        AuditDetail::PlatformClosed { platforms } => json!({"platforms": platforms}),
        AuditDetail::CloseGivenUp { unconfirmed } => json!({"unconfirmed": unconfirmed}),
        AuditDetail::CloseResolved { reason } => json!({"reason": reason}),
        AuditDetail::WebhookDeliveryRetried { delivery_id, endpoint, event_id, from } => {
            json!({"delivery_id": delivery_id, "endpoint": endpoint, "event_id": event_id, "from": from.as_str()})
        }
        AuditDetail::WebhookEndpointEnabled { endpoint, disabled_at, resumed } => {
            json!({"endpoint": endpoint, "disabled_at": disabled_at, "resumed": resumed})
        }
        AuditDetail::WebhookReplayed { endpoint, after_seq, until_seq, queued, next_after } => {
            json!({"endpoint": endpoint, "after_seq": after_seq, "until_seq": until_seq,
                   "queued": queued, "next_after": next_after})
        }
    }
}

impl DiffRows {
    /// Appends one row as the JSON object the answer lists it as:
    /// `{"kind","channel","pay_no","order_no","amount_platform","amount_local"}`, and
    /// `"coupon_amount"` last when the row has one.
    pub fn push(&mut self, row: &DiffRow) -> Result<(), Error> {
        // A new piece when this one may not hold another row (a row is far
        // smaller than this room; a longer one only grows its piece).
        if self.pieces.last().is_none_or(|piece| piece.len() + DIFF_ROW_ROOM_BYTES > DIFF_PIECE_BYTES) {
            self.pieces.push(Vec::with_capacity(DIFF_PIECE_BYTES));
        }
        let Some(out) = self.pieces.last_mut() else {
            return Err(Error::internal("a difference list without a piece"));
        };
        if self.len > 0 {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"kind\":");
        put(out, row.kind.as_str())?;
        out.extend_from_slice(b",\"channel\":");
        put(out, row.channel)?;
        out.extend_from_slice(b",\"pay_no\":");
        put(out, row.pay_no)?;
        out.extend_from_slice(b",\"order_no\":");
        put(out, row.order_no)?;
        out.extend_from_slice(b",\"amount_platform\":");
        put(out, &row.amount_platform)?;
        out.extend_from_slice(b",\"amount_local\":");
        put(out, &row.amount_local)?;
        if let Some(coupon) = row.coupon_amount {
            out.extend_from_slice(b",\"coupon_amount\":");
            put(out, &coupon)?;
        }
        out.push(b'}');
        self.len += 1;
        Ok(())
    }

    /// Moves `other`'s rows after these.
    pub fn append(&mut self, mut other: DiffRows) {
        if other.len == 0 {
            return;
        }
        if self.len > 0 {
            self.pieces.push(b",".to_vec());
        }
        self.pieces.append(&mut other.pieces);
        self.len += other.len;
    }

    /// The rows as JSON values, in order (the answer itself is written from
    /// the bytes, never through these).
    pub fn iter(&self) -> impl Iterator<Item = DiffRowJson> {
        let mut list = b"[".to_vec();
        for piece in &self.pieces {
            list.extend_from_slice(piece);
        }
        list.push(b']');
        // The bytes are this module's own serialization of each row.
        let rows: Vec<Value> = serde_json::from_slice(&list).unwrap_or_default();
        rows.into_iter().map(DiffRowJson)
    }
}

/// Room left in a [`DiffRows`] piece for one more row, in bytes: a row with
/// two identifiers of 64 characters and a coupon is under 300.
const DIFF_ROW_ROOM_BYTES: usize = 1024;

/// One row of a [`DiffRows`], read back.
#[derive(Clone, Debug, PartialEq)]
pub struct DiffRowJson(Value);

impl DiffRowJson {
    pub fn to_json(&self) -> Value {
        self.0.clone()
    }
}

impl std::fmt::Debug for DiffRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter().map(|row| row.0)).finish()
    }
}

/// `value` serialized onto `out`.
fn put<T: serde::Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) -> Result<(), Error> {
    serde_json::to_writer(out, value).map_err(|e| Error::internal(format!("serializing an answer: {e}")))
}

impl Repaired {
    pub fn to_json(&self) -> Value {
        match &self.outcome {
            Ok(outcome) => json!({"pay_no": self.pay_no, "order_no": self.order_no, "outcome": outcome}),
            Err(e) => json!({"pay_no": self.pay_no, "order_no": self.order_no, "error": wire::error_object(e)}),
        }
    }
}

/// A refusal of a keyed write, as stored with its work and replayed: the
/// contract's error answer (`wire::error_body`).
impl Answer for Error {
    fn answer(&self) -> (u16, Value) {
        (wire::status_of(self.kind), wire::error_body(self))
    }
}

impl Reconciliation {
    /// The reconciliation's answer (the API and `payonce reconcile` print
    /// the same): [`Reconciliation::to_json_bytes`], read back.
    pub fn to_json(&self) -> Value {
        // The bytes are this module's own serialization.
        serde_json::from_slice(&self.to_json_bytes()).unwrap_or_default()
    }
}

impl OrderDetail {
    /// The order with its payments, coupons, points, events and audit rows.
    pub fn to_json(&self) -> Value {
        let mut value = self.order.to_json();
        if let Value::Object(map) = &mut value {
            let order_no = &self.order.order_no;
            let payments = self.payments.iter().map(|p| payment(p, &self.payment_refunds, order_no)).collect();
            map.insert("payments".into(), payments);
            map.insert("coupons".into(), self.coupons.iter().map(coupon).collect());
            map.insert("points".into(), self.points.iter().map(points_entry).collect());
            map.insert("events".into(), self.events.iter().map(event).collect());
            map.insert("audit".into(), self.audit.iter().map(audit_entry).collect());
            map.insert("platform_calls".into(), self.platform_calls.iter().map(platform_call).collect());
            map.insert("webhook_deliveries".into(), self.webhook_deliveries.iter().map(delivery).collect());
            map.insert("refunds".into(), self.refunds.iter().map(|r| refund(r, &self.order.order_no)).collect());
        }
        value
    }
}

/// A `platform_call` row of an order: never its request or answer.
fn platform_call(call: &PlatformCallSummary) -> Value {
    json!({"channel": call.channel, "kind": call.kind.as_str(), "status": call.status.as_str(),
           "attempts": call.attempts, "http_status": call.http_status, "created_at": call.created_at,
           "refund_no": call.refund_no, "updated_at": call.updated_at, "next_attempt_at": call.next_attempt_at})
}

// ---- answers ----

pub fn delivery(d: &DeliveryRow) -> Value {
    json!({"id": d.id, "endpoint": d.endpoint, "event_id": d.event_id, "event_seq": d.event_seq,
           "order_no": d.order_no, "status": d.status.as_str(), "attempts": d.attempts,
           "next_attempt_at": d.next_attempt_at, "last_attempt_at": d.last_attempt_at,
           "last_status": d.last_status, "last_error": d.last_error})
}

pub fn deliveries(page: &DeliveryPage) -> Value {
    let deliveries: Vec<Value> = page.deliveries.iter().map(delivery).collect();
    json!({"deliveries": deliveries, "next_after": page.next_after.map(|n| n.to_string())})
}

/// `POST /v1/orders/{order_no}/sync` (and `payonce sync`).
pub fn synced(synced: &Synced) -> Value {
    let platforms: Vec<Value> = synced
        .platforms
        .iter()
        .map(|p| {
            let (pay_no, amount) = match &p.state {
                TradeState::Paid { pay_no, amount, .. } => (Some(pay_no.clone()), Some(*amount)),
                _ => (None, None),
            };
            json!({"channel": p.channel, "state": p.state.as_str(), "pay_no": pay_no, "amount": amount})
        })
        .collect();
    json!({"order": synced.order.to_json(), "platforms": platforms})
}

impl Answer for DeliveryRow {
    fn answer(&self) -> (u16, Value) {
        (200, delivery(self))
    }
}

impl Answer for EnabledEndpoint {
    fn answer(&self) -> (u16, Value) {
        let e = &self.endpoint;
        let status = if e.enabled { "enabled" } else { "disabled" };
        (
            200,
            json!({"endpoint": e.endpoint, "status": status, "from_seq": e.from_seq,
                     "disabled_at": e.disabled_at, "resumed": self.resumed}),
        )
    }
}

impl Answer for Replayed {
    fn answer(&self) -> (u16, Value) {
        (200, json!({"queued": self.queued, "next_after": self.next_after}))
    }
}

/// An order creation: 201 when created, 200 when the same order existed.
impl Answer for (Order, bool) {
    fn answer(&self) -> (u16, Value) {
        (if self.1 { 201 } else { 200 }, self.0.to_json())
    }
}

/// `POST /v1/orders/{order_no}/pay`: the order and the payment object, whose
/// text is the one every request for the payment answers.
impl Answer for Paying {
    fn answer(&self) -> (u16, Value) {
        let payment: Value = serde_json::from_str(self.payment.text()).unwrap_or_default();
        (200, json!({"order": self.order.to_json(), "payment": payment}))
    }
}

/// A refund requested by amount: 201 when this request made it, 200 when
/// it found it; `{"order", "refund"}`, or the order alone on the
/// whole-order route.
impl Answer for RefundRequested {
    fn answer(&self) -> (u16, Value) {
        if self.order_only {
            return (200, self.order.to_json());
        }
        let status = if self.created { 201 } else { 200 };
        (status, json!({"order": self.order.to_json(), "refund": refund(&self.refund, &self.order.order_no)}))
    }
}

/// A refund object of an order.
pub fn refund(r: &RefundRecord, order_no: &str) -> Value {
    json!({"refund_no": r.refund_no, "order_no": order_no, "pay_no": r.pay_no, "amount": r.amount,
           "status": r.status.as_str(), "reason": r.reason, "requested_at": r.requested_at,
           "settled_at": r.settled_at})
}

impl Answer for Order {
    fn answer(&self) -> (u16, Value) {
        (200, self.to_json())
    }
}

impl Answer for Mode {
    fn answer(&self) -> (u16, Value) {
        (200, mode(*self))
    }
}

impl Answer for Drained {
    fn answer(&self) -> (u16, Value) {
        (200, json!({"applied": self.applied}))
    }
}

/// `POST /v1/admin/payments/{pay_no}/refund`: the payment (with its
/// `order_no`) and the refund that returns it.
impl Answer for PaymentRefund {
    fn answer(&self) -> (u16, Value) {
        let mut payment = payment(&self.payment, &self.refunds, &self.order_no);
        if let Value::Object(map) = &mut payment {
            let mut with_order = Map::new();
            with_order.insert("order_no".into(), json!(self.order_no));
            with_order.extend(std::mem::take(map));
            *map = with_order;
        }
        (200, json!({"payment": payment, "refund": refund(&self.refund, &self.order_no)}))
    }
}

impl Answer for PaymentResolution {
    fn answer(&self) -> (u16, Value) {
        let body = json!({"pay_no": self.pay_no, "order_no": self.order_no, "outcome": self.outcome.as_str(),
                          "resolution": self.resolution, "reason": self.reason, "resolved_at": self.resolved_at});
        (200, body)
    }
}

impl Answer for RefundResolution {
    fn answer(&self) -> (u16, Value) {
        let body = json!({"refund_no": self.refund_no, "resolution": self.resolution, "reason": self.reason,
                          "resolved_at": self.resolved_at});
        (200, body)
    }
}

impl Answer for Compensated {
    fn answer(&self) -> (u16, Value) {
        let body = match &self.effect {
            CompensationEffect::CouponFrozen(c) => json!({"order_no": self.order_no, "action": "freeze_coupon",
                                                          "coupon_template_id": c.coupon_template_id,
                                                          "coupon": coupon(c)}),
            CompensationEffect::PointsReversed(p) => {
                json!({"order_no": self.order_no, "action": "reverse_points", "points": points_entry(p)})
            }
        };
        (200, body)
    }
}

impl Answer for Reconciliation {
    fn answer(&self) -> (u16, Value) {
        (200, self.to_json())
    }

    /// The same bytes as `to_json().to_string()`, written from each list's
    /// bytes: a statement of 16 MiB can list a quarter of a million rows,
    /// and a `Value` of them costs several times the text
    /// (docs/performance.md).
    fn answer_body(&self) -> (u16, Vec<u8>) {
        (200, self.to_json_bytes())
    }
}

impl Answer for Repairing<'_> {
    fn answer(&self) -> (u16, Value) {
        let body = answer_pieces(self.result, self.repaired.as_slice().into()).concat();
        (200, serde_json::from_slice(&body).unwrap_or_default())
    }

    fn answer_body(&self) -> (u16, Vec<u8>) {
        (200, answer_pieces(self.result, self.repaired.as_slice().into()).concat())
    }
}

/// The answer's text in order: the head up to `"missing_local":[`, then
/// missing_local's rows, `],"missing_remote":[`, its rows,
/// `],"amount_mismatch":[`, its rows, and the tail (`]`, the repairs, `}`).
/// The three lists are borrowed; the glue is a few bytes (and the repairs).
struct Pieces<'r> {
    head: Vec<u8>,
    lists: [&'r DiffRows; 3],
    tail: Vec<u8>,
}

const LIST_JOINTS: [&[u8]; 3] = [b"", b"],\"missing_remote\":[", b"],\"amount_mismatch\":["];

impl Pieces<'_> {
    fn len(&self) -> usize {
        let lists: usize = self.lists.iter().flat_map(|list| &list.pieces).map(Vec::len).sum();
        self.head.len() + lists + LIST_JOINTS.iter().map(|j| j.len()).sum::<usize>() + self.tail.len()
    }

    fn concat(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len());
        out.extend_from_slice(&self.head);
        for (joint, list) in LIST_JOINTS.iter().zip(self.lists) {
            out.extend_from_slice(joint);
            for piece in &list.pieces {
                out.extend_from_slice(piece);
            }
        }
        out.extend_from_slice(&self.tail);
        out
    }
}

/// The repairs an answer lists: none (no `"repaired"` member), or these.
enum RepairedList<'r> {
    Absent,
    Listed(&'r [Repaired]),
}

impl<'r> From<&'r [Repaired]> for RepairedList<'r> {
    fn from(repaired: &'r [Repaired]) -> Self {
        RepairedList::Listed(repaired)
    }
}

fn answer_pieces<'r>(result: &'r Reconciliation, repaired: RepairedList<'_>) -> Pieces<'r> {
    let head = json!({"channel": result.channel, "period": result.period, "compared": result.compared,
                      "matched": result.matched})
    .to_string();
    let mut head = head.strip_suffix('}').unwrap_or(&head).as_bytes().to_vec();
    head.extend_from_slice(b",\"missing_local\":[");
    let mut tail = b"]".to_vec();
    if let RepairedList::Listed(repaired) = repaired {
        tail.extend_from_slice(b",\"repaired\":[");
        for (i, row) in repaired.iter().enumerate() {
            if i > 0 {
                tail.push(b',');
            }
            tail.extend_from_slice(row.to_json().to_string().as_bytes());
        }
        tail.push(b']');
    }
    tail.push(b'}');
    let lists = [&result.missing_local, &result.missing_remote, &result.amount_mismatch];
    Pieces { head, lists, tail }
}

impl Reconciliation {
    fn pieces(&self) -> Pieces<'_> {
        let repaired = self.repaired.as_deref().map_or(RepairedList::Absent, RepairedList::from);
        answer_pieces(self, repaired)
    }

    /// [`Reconciliation::to_json`], serialized, without building it whole.
    pub fn to_json_bytes(&self) -> Vec<u8> {
        self.pieces().concat()
    }

    /// [`Answer::answer_body`], consuming the reconciliation: each piece
    /// of a list is freed as soon as it is copied, and `release` (which
    /// gives freed memory back to the system) is called after every
    /// [`RELEASE_EVERY_BYTES`] of them, so the answer to a statement no row
    /// of which payonce knows (every row missing_local, every payment of the
    /// period missing_remote) is never held twice (docs/performance.md,
    /// "Reconciliation memory"). An allocator keeps small freed blocks for
    /// reuse, and the answer, one large block, cannot reuse them.
    pub fn into_answer_body(mut self, release: &mut dyn FnMut()) -> (u16, Vec<u8>) {
        let (head, tail, total) = {
            let pieces = self.pieces();
            let total = pieces.len();
            (pieces.head, pieces.tail, total)
        };
        let mut out = Vec::with_capacity(total);
        out.extend_from_slice(&head);
        let mut freed = 0;
        let lists = [&mut self.missing_local, &mut self.missing_remote, &mut self.amount_mismatch];
        for (joint, list) in LIST_JOINTS.iter().zip(lists) {
            out.extend_from_slice(joint);
            for piece in std::mem::take(&mut list.pieces) {
                out.extend_from_slice(&piece);
                freed += piece.capacity();
                drop(piece);
                if freed >= RELEASE_EVERY_BYTES {
                    release();
                    freed = 0;
                }
            }
        }
        out.extend_from_slice(&tail);
        (200, out)
    }
}

/// How much of a list [`Reconciliation::into_answer_body`] frees between
/// two calls of its `release`, in bytes.
const RELEASE_EVERY_BYTES: usize = 4 * 1024 * 1024;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recon::RowKind;

    /// A row as the answer listed it when rows were `Value`s: the bytes
    /// [`DiffRows::push`] writes must be these, byte for byte.
    fn as_value(row: &DiffRow) -> Value {
        let mut value = json!({"kind": row.kind.as_str(), "channel": row.channel, "pay_no": row.pay_no, "order_no": row.order_no,
                               "amount_platform": row.amount_platform, "amount_local": row.amount_local});
        if let (Some(coupon), Value::Object(map)) = (row.coupon_amount, &mut value) {
            map.insert("coupon_amount".into(), json!(coupon));
        }
        value
    }

    /// An event's data is the text the outbox rows have always held: the
    /// order object and the keys in the order the core's `json!` literals
    /// once wrote them; so are the rewards due and the reward settings.
    #[test]
    fn stored_event_data_keeps_its_text() {
        use crate::domain::{OrderStatus, PaymentOutcome, RefundStatus};
        let order = Order {
            id: 1,
            order_no: "O-1".into(),
            user_id: "u1".into(),
            amount: 9900,
            currency: "CNY".into(),
            status: OrderStatus::Paid,
            pay_no: Some("P-1".into()),
            created_at: "c".into(),
            expires_at: "e".into(),
            paid_at: Some("p".into()),
            closed_at: None,
            refund_no: None,
            refunded_at: None,
            refunded_amount: 0,
            refunding_amount: 0,
        };
        let o = r#"{"order_no":"O-1","user_id":"u1","amount":9900,"currency":"CNY","status":"PAID","pay_no":"P-1","created_at":"c","expires_at":"e","paid_at":"p","closed_at":null,"refund_no":null,"refunded_at":null,"refunded_amount":0,"refunding_amount":0}"#;
        let (pay_no, channel, amount, outcome) = ("P-1", "generic", 9900, PaymentOutcome::Applied);
        assert_eq!(
            EventData::Payment { order: &order, pay_no, channel, amount, outcome }.json_text(),
            format!(
                r#"{{"order":{o},"payment":{{"pay_no":"P-1","channel":"generic","amount":9900,"outcome":"applied"}}}}"#
            )
        );
        assert_eq!(
            EventData::Refund { order: &order, refund_no: "R-1", status: RefundStatus::Requested, amount: 9900 }
                .json_text(),
            format!(r#"{{"order":{o},"refund":{{"refund_no":"R-1","status":"REQUESTED","amount":9900}}}}"#)
        );
        assert_eq!(EventData::Closed { order: &order }.json_text(), format!(r#"{{"order":{o}}}"#));
        assert_eq!(
            RewardsDue { coupons: vec!["NEW10".into(), "VIP".into()], points: 99 }.json_text(),
            r#"{"coupons":["NEW10","VIP"],"points":99}"#
        );
        assert_eq!(["NEW10".to_owned()].json_text(), r#"["NEW10"]"#);
    }

    /// Every audit detail is the text its rows have always held (keys,
    /// their order, `null`s).
    #[test]
    fn stored_audit_details_keep_their_text() {
        use crate::domain::{OrderStatus, PaymentOutcome, PlatformStatus};
        let prior = CallbackRecord {
            id: 1,
            pay_no: "P-1".into(),
            channel: "generic".into(),
            order_id: 1,
            amount: 5,
            currency: None,
            status: PlatformStatus::Failed,
            outcome: PaymentOutcome::PaymentFailed,
            decided: true,
            source: "callback".into(),
            paid_at: None,
            received_at: "r".into(),
            decided_at: None,
            resolution: None,
        };
        let refused = |about| AuditDetail::TransitionRefused {
            about,
            from: OrderStatus::Paid,
            to: OrderStatus::Closed,
            request: "close",
        };
        let (refund_no, channel, status) = ("R-1", "generic", PlatformStatus::Success);
        let cases = [
            (refused(Refused::Order), r#"{"from":"PAID","to":"CLOSED","request":"close"}"#),
            (
                refused(Refused::Refund { refund_no }),
                r#"{"refund_no":"R-1","from":"PAID","to":"CLOSED","request":"close"}"#,
            ),
            (
                refused(Refused::CouponFreeze { coupon_template_id: "VIP" }),
                r#"{"compensation":"freeze_coupon","coupon_template_id":"VIP","from":"PAID","to":"CLOSED","request":"close"}"#,
            ),
            (
                AuditDetail::PaymentFailedSuperseded { pay_no: "P-2", prior: &prior, failed_body: "e30=" },
                r#"{"pay_no":"P-2","superseded_outcome":"payment_failed","superseded_received_at":"r","superseded_source":"callback","superseded_amount":5,"superseded_currency":null,"superseded_raw_body_base64":"e30="}"#,
            ),
            (
                AuditDetail::UnexpectedRefund {
                    refund_no,
                    channel,
                    status,
                    settled_status: None,
                    order_status: OrderStatus::Paid,
                },
                r#"{"refund_no":"R-1","channel":"generic","status":"SUCCESS","settled_status":null,"order_status":"PAID"}"#,
            ),
            (
                AuditDetail::UnexpectedRefundResolved { refund_no, resolution: "refunded", reason: "x" },
                r#"{"refund_no":"R-1","resolution":"refunded","reason":"x"}"#,
            ),
        ];
        for (detail, expected) in cases {
            assert_eq!(detail.json_text(), expected);
        }
        assert_eq!(refused(Refused::Refund { refund_no }).refund_no(), Some("R-1"));
    }

    /// The same for the operators' and the webhook admin's rows.
    #[test]
    fn stored_operator_details_keep_their_text() {
        use crate::domain::{DeliveryStatus, PaymentOutcome};
        let (webhook, event_id, from) = ("https://h/x", "order.paid:O-1", DeliveryStatus::Failed);
        let cases = [
            (AuditDetail::ModeChanged { from: None, to: "record_only" }, r#"{"from":null,"to":"record_only"}"#),
            (
                AuditDetail::ResolutionRefused { pay_no: "P-1", outcome: PaymentOutcome::Applied },
                r#"{"pay_no":"P-1","outcome":"applied"}"#,
            ),
            (
                AuditDetail::PaymentResolved { pay_no: "P-1", resolution: "refunded", reason: "x" },
                r#"{"pay_no":"P-1","resolution":"refunded","reason":"x"}"#,
            ),
            (
                AuditDetail::CouponFrozen { coupon_template_id: "VIP", reason: "x" },
                r#"{"action":"freeze_coupon","coupon_template_id":"VIP","reason":"x"}"#,
            ),
            (AuditDetail::PointsReversed { reason: "x" }, r#"{"action":"reverse_points","reason":"x"}"#),
            (
                AuditDetail::PlatformClosed { platforms: &["wechatpay", "alipay"] },
                r#"{"platforms":["wechatpay","alipay"]}"#,
            ),
            (AuditDetail::CloseGivenUp { unconfirmed: &["alipay"] }, r#"{"unconfirmed":["alipay"]}"#),
            (AuditDetail::CloseResolved { reason: "x" }, r#"{"reason":"x"}"#),
            (
                AuditDetail::WebhookDeliveryRetried { delivery_id: 7, endpoint: webhook, event_id, from },
                r#"{"delivery_id":7,"endpoint":"https://h/x","event_id":"order.paid:O-1","from":"failed"}"#,
            ),
            (
                AuditDetail::WebhookEndpointEnabled { endpoint: webhook, disabled_at: Some("d"), resumed: 2 },
                r#"{"endpoint":"https://h/x","disabled_at":"d","resumed":2}"#,
            ),
            (
                AuditDetail::WebhookReplayed {
                    endpoint: webhook,
                    after_seq: 0,
                    until_seq: None,
                    queued: 3,
                    next_after: Some(9),
                },
                r#"{"endpoint":"https://h/x","after_seq":0,"until_seq":null,"queued":3,"next_after":9}"#,
            ),
        ];
        for (detail, expected) in cases {
            assert_eq!(detail.json_text(), expected);
        }
    }

    fn rows(rows: &[DiffRow]) -> DiffRows {
        let mut list = DiffRows::default();
        for row in rows {
            assert!(list.push(row).is_ok());
        }
        list
    }

    const A: DiffRow = DiffRow {
        kind: RowKind::Payment,
        channel: "wechatpay",
        pay_no: "P-1",
        order_no: "O-1",
        amount_platform: Some(9900),
        amount_local: None,
        coupon_amount: Some(1000),
    };
    const B: DiffRow = DiffRow {
        kind: RowKind::Refund,
        channel: "al\"ipay",
        pay_no: "R\"\\\u{1}é",
        order_no: "O.2",
        amount_platform: None,
        amount_local: Some(-5),
        coupon_amount: None,
    };
    const C: DiffRow = DiffRow {
        kind: RowKind::Payment,
        channel: "generic",
        pay_no: "P_3",
        order_no: "O-3",
        amount_platform: Some(1),
        amount_local: Some(1_000_000_000_000),
        coupon_amount: None,
    };

    #[test]
    fn diff_rows_are_the_json_of_their_rows() {
        let list = rows(&[A, B, C]);
        let expected: Vec<String> = [A, B, C].iter().map(|r| as_value(r).to_string()).collect();
        assert_eq!(String::from_utf8_lossy(&list.pieces.concat()), expected.join(","));
        assert_eq!(list.len(), 3);
        let read: Vec<Value> = list.iter().map(|r| r.to_json()).collect();
        assert_eq!(read, [A, B, C].iter().map(as_value).collect::<Vec<_>>());
        assert!(DiffRows::default().is_empty() && DiffRows::default().iter().next().is_none());
        // Appended lists, empty ones included, read as one.
        for (first, second) in [(vec![], vec![B]), (vec![A], vec![]), (vec![A, C], vec![B, C]), (vec![], vec![])] {
            let mut list = rows(&first);
            list.append(rows(&second));
            let expected: Vec<String> = first.iter().chain(&second).map(|r| as_value(r).to_string()).collect();
            assert_eq!(String::from_utf8_lossy(&list.pieces.concat()), expected.join(","));
            assert_eq!(list.len(), first.len() + second.len());
            assert!(list.push(&C).is_ok());
            assert_eq!(list.iter().last().map(|r| r.to_json()), Some(as_value(&C)));
        }
        // A long list is kept in many pieces, none of them grown.
        let many: Vec<DiffRow> = (0..10_000).map(|i| if i % 3 == 0 { A } else { C }).collect();
        let list = rows(&many);
        assert!(list.pieces.len() > 3 && list.pieces.iter().all(|p| p.capacity() == DIFF_PIECE_BYTES));
        let expected: Vec<String> = many.iter().map(|r| as_value(r).to_string()).collect();
        assert_eq!(String::from_utf8_lossy(&list.pieces.concat()), expected.join(","));
        let result = Reconciliation { missing_local: list.clone(), missing_remote: list, ..Reconciliation::default() };
        assert_eq!(result.to_json_bytes(), result.clone().into_answer_body(&mut || {}).1);
    }

    /// Every way of writing the answer gives the same bytes, whichever
    /// list is the largest (its buffer becomes the body) and with or
    /// without repairs.
    #[test]
    fn the_answer_is_the_same_bytes_every_way() {
        let lists = [rows(&[]), rows(&[A]), rows(&[A, B, C]), rows(&[C, C, C, C])];
        let repairs = [
            None,
            Some(vec![]),
            Some(vec![
                Repaired { pay_no: "P-1".into(), order_no: "O-1".into(), outcome: Ok("applied") },
                Repaired {
                    pay_no: "P-2".into(),
                    order_no: "O-2".into(),
                    outcome: Err(Error::invalid("no order \"O-2\"")),
                },
            ]),
        ];
        let mut cases = 0;
        for ml in &lists {
            for mr in &lists {
                for am in &lists {
                    for repaired in &repairs {
                        let result = Reconciliation {
                            channel: "alipay",
                            period: vec!["2024-03-04".into()],
                            compared: vec!["payment", "refund"],
                            matched: ml.len() + 7,
                            missing_local: ml.clone(),
                            missing_remote: mr.clone(),
                            amount_mismatch: am.clone(),
                            repaired: repaired.clone(),
                        };
                        let mut expected = json!({
                            "channel": result.channel, "period": result.period, "compared": result.compared, "matched": result.matched,
                            "missing_local": ml.iter().map(|r| r.to_json()).collect::<Vec<_>>(),
                            "missing_remote": mr.iter().map(|r| r.to_json()).collect::<Vec<_>>(),
                            "amount_mismatch": am.iter().map(|r| r.to_json()).collect::<Vec<_>>(),
                        });
                        if let (Some(repaired), Value::Object(map)) = (repaired, &mut expected) {
                            map.insert("repaired".into(), repaired.iter().map(Repaired::to_json).collect());
                        }
                        let expected = expected.to_string().into_bytes();
                        assert_eq!(result.to_json_bytes(), expected);
                        assert_eq!(result.to_json().to_string().into_bytes(), expected);
                        assert_eq!(result.answer_body(), (200, expected.clone()));
                        if let Some(repaired) = repaired {
                            let without = Reconciliation { repaired: None, ..result.clone() };
                            let repairing = Repairing { result: &without, repaired: repaired.clone() };
                            assert_eq!(repairing.answer_body(), (200, expected.clone()));
                            assert_eq!(repairing.answer().1, result.to_json());
                        }
                        assert_eq!(result.into_answer_body(&mut || {}), (200, expected));
                        cases += 1;
                    }
                }
            }
        }
        assert_eq!(cases, 4 * 4 * 4 * 3);
    }
}
