//! The exactly-once operations, as services over one [`Core`]: each
//! borrows it and is returned by value from `App` (`app.orders()`,
//! `app.payments()` ...). A service calls another through the core
//! (`self.core.payments()`), never through `App`.
//!
//! Every write follows one shape, the corrected sequence of the incident:
//!
//! ```text
//! let key = self.core.locks().lock(LockKey::Pay(pay_no)); // 1. process-local key lock, outside the transaction
//! self.core.store().write(&[&key], |tx| { // 2. BEGIN IMMEDIATE (after the writer queue); PostgreSQL locks `key` too
//!     ...record the request...         // 3. under its UNIQUE key (uk_pay_no, uk_order_no, uk_refund_no)
//!     ...CAS the order...              // 4. UPDATE .. WHERE status = ?; affected rows decide
//!     ...each side effect...           // 5. its own UNIQUE key
//!     ...outbox event...               // 6. uk_event_id
//! })                                   // 7. COMMIT
//! // 8. `key` drops here: after the commit, by scope order
//! ```

mod core;
pub mod operations;
pub mod orders;
pub mod payments;
pub mod platform_calls;
pub mod prepays;
pub mod refunds;
pub mod webhooks;

pub(crate) use self::core::Core;
pub use operations::Operations;
pub use orders::Orders;
pub use payments::Payments;
pub use platform_calls::PlatformCalls;
pub use prepays::Prepays;
pub use refunds::Refunds;
pub use webhooks::Webhooks;

use crate::domain::{AuditDetail, EventData, EventType, Order, OrderStatus, Refused};
use crate::error::Error;
use crate::ops::REASON_BYTES_MAX;
use crate::store::WriteTx;

/// CAS PENDING→CLOSED with its `order.closed` event; `None` when the CAS
/// changed nothing (the order is not PENDING).
pub(crate) fn close_in_tx(tx: &WriteTx, order: &Order, now: &str) -> Result<Option<Order>, Error> {
    if !tx.cas_order_closed(order.id, now)? {
        return Ok(None);
    }
    let closed = tx.order_by_id(order.id)?;
    let data = EventData::Closed { order: &closed };
    tx.emit_event(EventType::OrderClosed, &order.order_no, &order.order_no, &data, now)?;
    Ok(Some(closed))
}

/// Writes the refusal to `audit_log` (committed with the transaction) and
/// returns the 409 for the caller.
pub(crate) fn refuse_transition(
    tx: &WriteTx,
    order: &Order,
    to: OrderStatus,
    action: &str,
    now: &str,
    about: Refused,
) -> Result<Error, Error> {
    let detail = AuditDetail::TransitionRefused { about, from: order.status, to, request: action };
    tx.audit(now, "api", "transition_refused", Some(&order.order_no), &detail)?;
    Ok(Error::invalid_transition(format!("order {} is {}; cannot {action} it", order.order_no, order.status.as_str())))
}

/// A unique key stopped a second side effect that the CAS should have
/// stopped first. Never expected; logged so an operator sees it.
pub(crate) fn log_suppressed(table: &str, key: &str) {
    crate::log::warn("a unique key suppressed a duplicate side effect", &[("table", &table), ("key", &key)]);
}

pub(crate) fn validate_reason(reason: &str) -> Result<(), Error> {
    if reason.trim().is_empty() || reason.len() > REASON_BYTES_MAX {
        return Err(Error::invalid(format!("reason is required, at most {REASON_BYTES_MAX} bytes")));
    }
    Ok(())
}

pub(crate) fn validate_resolution(resolution: &str, reason: &str) -> Result<(), Error> {
    if !matches!(resolution, "refunded_externally" | "accepted") {
        return Err(Error::invalid("resolution must be refunded_externally or accepted"));
    }
    validate_reason(reason)
}
