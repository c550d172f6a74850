//! The JSON of every answer, in one place: each object (order detail,
//! payment, coupon, points entry, event, finding, reconciliation row) has
//! one renderer here, and each operation's result its [`Answer`] (what the
//! API sends, and what a keyed write stores with its work). The order
//! object itself is [`Order::to_json`] in `domain`, because the outbox
//! events carry it too. `app` and `ops` return types; only `api` and the
//! webhook relay (whose bodies are the event objects) import this module.

use crate::app::{Answer, OrderDetail};
use crate::domain::Order;
use crate::domain::{AuditRow, CallbackRecord, CouponRow, DeliveryRow, EventRow, Finding, PointRow};
use crate::error::Error;
use crate::ops::{
    Compensated, CompensationEffect, DiffRow, Drained, Mode, PaymentResolution, Reconciliation, RefundResolution,
    Repaired,
};
use crate::platform::TradeState;
use crate::platform_ops::Synced;
use crate::webhook_ops::{DeliveryPage, EnabledEndpoint, Replayed};
use serde_json::{json, Map, Value};

// ---- objects ----

/// A payment of an order (`GET /v1/orders/{order_no}`).
pub fn payment(p: &CallbackRecord) -> Value {
    json!({
        "pay_no": p.pay_no, "channel": p.channel, "amount": p.amount,
        "outcome": p.outcome.as_str(), "state": if p.decided { "decided" } else { "received" },
        "source": p.source, "received_at": p.received_at,
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

/// The inspection's answer: `{"ok":bool,"findings":[{"kind","order_no","detail"}]}`
/// (the API and `payonce inspect` print the same).
pub fn inspection(findings: &[Finding]) -> Value {
    let list: Vec<Value> =
        findings.iter().map(|f| json!({"kind": f.kind, "order_no": f.order_no, "detail": f.detail})).collect();
    json!({"ok": findings.is_empty(), "findings": list})
}

impl DiffRow {
    pub fn to_json(&self) -> Value {
        let mut value = json!({"kind": self.kind.as_str(), "pay_no": self.pay_no, "order_no": self.order_no,
                               "amount_platform": self.amount_platform, "amount_local": self.amount_local});
        if let (Some(coupon), Value::Object(map)) = (self.coupon_amount, &mut value) {
            map.insert("coupon_amount".into(), json!(coupon));
        }
        value
    }
}

fn diff_rows(rows: &[DiffRow]) -> Vec<Value> {
    rows.iter().map(DiffRow::to_json).collect()
}

impl Repaired {
    pub fn to_json(&self) -> Value {
        match &self.outcome {
            Ok(outcome) => json!({"pay_no": self.pay_no, "order_no": self.order_no, "outcome": outcome}),
            Err(e) => json!({"pay_no": self.pay_no, "order_no": self.order_no, "error": error_object(e)}),
        }
    }
}

/// The `{"code","message"}` inside the contract's error shape.
fn error_object(e: &Error) -> Value {
    json!({"code": e.code, "message": e.message})
}

impl Reconciliation {
    /// The reconciliation's answer (the API and `payonce reconcile` print the same).
    pub fn to_json(&self) -> Value {
        let mut value = json!({
            "period": self.period, "compared": self.compared, "matched": self.matched,
            "missing_local": diff_rows(&self.missing_local),
            "missing_remote": diff_rows(&self.missing_remote), "amount_mismatch": diff_rows(&self.amount_mismatch),
        });
        if let (Some(repaired), Value::Object(map)) = (&self.repaired, &mut value) {
            let repaired: Vec<Value> = repaired.iter().map(Repaired::to_json).collect();
            map.insert("repaired".into(), Value::Array(repaired));
        }
        value
    }
}

impl OrderDetail {
    /// The order with its payments, coupons, points, events and audit rows.
    pub fn to_json(&self) -> Value {
        let mut value = self.order.to_json();
        if let Value::Object(map) = &mut value {
            map.insert("payments".into(), self.payments.iter().map(payment).collect());
            map.insert("coupons".into(), self.coupons.iter().map(coupon).collect());
            map.insert("points".into(), self.points.iter().map(points_entry).collect());
            map.insert("events".into(), self.events.iter().map(event).collect());
            map.insert("audit".into(), self.audit.iter().map(audit_entry).collect());
        }
        value
    }
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

    /// The same bytes as `to_json().to_string()`, written row by row: a
    /// statement of 16 MiB can list a quarter of a million rows, and a
    /// `Value` of them costs several times the text (docs/performance.md).
    fn answer_body(&self) -> (u16, Vec<u8>) {
        (200, self.to_json_bytes())
    }
}

impl Reconciliation {
    /// [`Reconciliation::to_json`], serialized, without building it whole.
    pub fn to_json_bytes(&self) -> Vec<u8> {
        fn rows(out: &mut Vec<u8>, name: &str, values: impl Iterator<Item = Value>) {
            out.extend_from_slice(format!(",{}:[", Value::from(name)).as_bytes());
            for (i, value) in values.enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(value.to_string().as_bytes());
            }
            out.push(b']');
        }
        let head = json!({"period": self.period, "compared": self.compared, "matched": self.matched}).to_string();
        let mut out = Vec::with_capacity(head.len() + 128 * self.row_count());
        out.extend_from_slice(head.strip_suffix('}').unwrap_or(&head).as_bytes());
        rows(&mut out, "missing_local", self.missing_local.iter().map(DiffRow::to_json));
        rows(&mut out, "missing_remote", self.missing_remote.iter().map(DiffRow::to_json));
        rows(&mut out, "amount_mismatch", self.amount_mismatch.iter().map(DiffRow::to_json));
        if let Some(repaired) = &self.repaired {
            rows(&mut out, "repaired", repaired.iter().map(Repaired::to_json));
        }
        out.push(b'}');
        out
    }

    fn row_count(&self) -> usize {
        self.missing_local.len()
            + self.missing_remote.len()
            + self.amount_mismatch.len()
            + self.repaired.as_ref().map_or(0, Vec::len)
    }
}
