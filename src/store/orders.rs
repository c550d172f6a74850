//! Orders: creation under `uk_order_no`, lookups, and the CAS edges of the
//! state machine. Refund rows live here too: they exist to move an order.

use super::{bad_value, limit_param, one_row, params, ReadTx, Row, WriteTx};
use crate::domain::{
    NewOrder, Order, OrderStatus, PlatformCallKind, PlatformCallStatus, PlatformCallSummary, RefundRecord, RefundStatus,
};
use crate::error::Error;

/// The columns `order_from_row` reads, in its order. The order's latest
/// refund_no, the time of its latest succeeded refund and the amount in
/// flight come from `refund` rows, asked only where the order's own columns
/// cannot say (a PENDING or CLOSED order has none; a REFUNDING or REFUNDED
/// one names its latest in `refund_no`): the payment path reads orders that
/// never had a refund, and pays nothing for them.
macro_rules! order_columns {
    () => {
        "id, order_no, user_id, amount, currency, status, pay_no, created_at, \
         expires_at, paid_at, closed_at, \
         CASE WHEN status = 'PENDING' OR status = 'CLOSED' THEN NULL \
              WHEN status = 'REFUNDING' OR status = 'REFUNDED' THEN refund_no \
              ELSE (SELECT r.refund_no FROM refund r WHERE r.order_id = orders.id AND r.pay_no IS NULL \
                    ORDER BY r.id DESC LIMIT 1) END, \
         CASE WHEN refunded_amount = 0 THEN NULL \
              WHEN status = 'REFUNDED' THEN refunded_at \
              ELSE (SELECT r.settled_at FROM refund r WHERE r.order_id = orders.id AND r.pay_no IS NULL \
                    AND r.status = 'SUCCEEDED' ORDER BY r.id DESC LIMIT 1) END, \
         refunded_amount, \
         CASE WHEN status = 'REFUNDING' \
              THEN coalesce((SELECT r.amount FROM refund r WHERE r.order_id = orders.id AND r.pay_no IS NULL \
                             AND r.status = 'REQUESTED'), 0) \
              ELSE 0 END"
    };
}

fn order_from_row(row: &Row) -> Result<Order, Error> {
    let status = row.text(5)?;
    Ok(Order {
        id: row.int(0)?,
        order_no: row.text(1)?,
        user_id: row.text(2)?,
        amount: row.int(3)?,
        currency: row.text(4)?,
        status: OrderStatus::parse(&status).ok_or_else(|| bad_value("order status", &status))?,
        pay_no: row.opt_text(6)?,
        created_at: row.text(7)?,
        expires_at: row.text(8)?,
        paid_at: row.opt_text(9)?,
        closed_at: row.opt_text(10)?,
        refund_no: row.opt_text(11)?,
        refunded_at: row.opt_text(12)?,
        refunded_amount: row.int(13)?,
        refunding_amount: row.int(14)?,
    })
}

/// The columns `refund_from_row` reads, in its order.
macro_rules! refund_columns {
    () => {
        "id, refund_no, order_id, status, requested_at, settled_at, amount, reason, pay_no"
    };
}

fn refund_from_row(row: &Row) -> Result<RefundRecord, Error> {
    let status = row.text(3)?;
    Ok(RefundRecord {
        id: row.int(0)?,
        refund_no: row.text(1)?,
        order_id: row.int(2)?,
        status: RefundStatus::parse(&status).ok_or_else(|| bad_value("refund status", &status))?,
        requested_at: row.text(4)?,
        settled_at: row.opt_text(5)?,
        amount: row.int(6)?,
        reason: row.opt_text(7)?,
        pay_no: row.opt_text(8)?,
    })
}

impl ReadTx<'_> {
    pub fn order_by_no(&self, order_no: &str) -> Result<Option<Order>, Error> {
        self.optional(
            concat!("SELECT ", order_columns!(), " FROM orders WHERE order_no = ?1"),
            params![order_no],
            order_from_row,
        )
    }

    /// `/healthz`'s read: one API page of the newest orders, every row
    /// parsed, so a damaged page or a value the CHECKs should have refused
    /// fails the check.
    pub(super) fn read_health_page(&self) -> Result<(), Error> {
        const HEALTH_ORDERS_ROWS: i64 = 100;
        self.all(
            concat!("SELECT ", order_columns!(), " FROM orders ORDER BY id DESC LIMIT ?1"),
            params![HEALTH_ORDERS_ROWS],
            order_from_row,
        )
        .map(drop)
    }

    /// The order's `platform_call` rows, oldest first (served by
    /// `ix_platform_call_order`); their requests and answers stay out.
    pub fn platform_calls_of_order(&self, order_no: &str) -> Result<Vec<PlatformCallSummary>, Error> {
        self.all(
            "SELECT channel, kind, status, attempts, http_status, created_at, refund_no, updated_at, next_attempt_at
             FROM platform_call WHERE order_no = ?1 ORDER BY id",
            params![order_no],
            |r| {
                let (kind, status) = (r.text(1)?, r.text(2)?);
                Ok(PlatformCallSummary {
                    channel: r.text(0)?,
                    kind: PlatformCallKind::parse(&kind).ok_or_else(|| bad_value("platform_call kind", &kind))?,
                    status: PlatformCallStatus::parse(&status)
                        .ok_or_else(|| bad_value("platform_call status", &status))?,
                    attempts: r.int(3)?,
                    http_status: r.opt_int(4)?,
                    created_at: r.text(5)?,
                    refund_no: r.opt_text(6)?,
                    updated_at: r.text(7)?,
                    next_attempt_at: r.opt_text(8)?,
                })
            },
        )
    }

    pub fn order_by_id(&self, id: i64) -> Result<Order, Error> {
        self.one(concat!("SELECT ", order_columns!(), " FROM orders WHERE id = ?1"), params![id], order_from_row)
    }

    /// Newest first, filtered, after the cursor (an order id). The CASTs
    /// give PostgreSQL each optional parameter's type where it is first used.
    pub fn list_orders(
        &self,
        user_id: Option<&str>,
        status: Option<OrderStatus>,
        before_id: Option<i64>,
        limit: usize,
    ) -> Result<Vec<Order>, Error> {
        self.all(
            concat!(
                "SELECT ",
                order_columns!(),
                " FROM orders
                 WHERE (CAST(?1 AS TEXT) IS NULL OR user_id = ?1) AND (CAST(?2 AS TEXT) IS NULL OR status = ?2)
                   AND (CAST(?3 AS BIGINT) IS NULL OR id < ?3)
                 ORDER BY id DESC LIMIT ?4"
            ),
            params![user_id, status.map(OrderStatus::as_str), before_id, limit_param(limit)],
            order_from_row,
        )
    }

    /// PENDING orders whose `expires_at` is not after `now`, oldest first
    /// (served by the partial index `ix_orders_pending_expiry`).
    pub fn expired_pending_orders(&self, now: &str, limit: usize) -> Result<Vec<String>, Error> {
        self.all(
            "SELECT order_no FROM orders WHERE status = 'PENDING' AND expires_at <= ?1 ORDER BY expires_at LIMIT ?2",
            params![now, limit_param(limit)],
            |r| r.text(0),
        )
    }

    pub fn refund_by_no(&self, refund_no: &str) -> Result<Option<RefundRecord>, Error> {
        self.optional(
            concat!("SELECT ", refund_columns!(), " FROM refund WHERE refund_no = ?1"),
            params![refund_no],
            refund_from_row,
        )
    }

    /// The refunds of the order's refund-required payments (each names its
    /// pay_no), oldest first.
    pub fn payment_refunds_of_order(&self, order_id: i64) -> Result<Vec<RefundRecord>, Error> {
        self.all(
            concat!(
                "SELECT ",
                refund_columns!(),
                " FROM refund WHERE order_id = ?1 AND pay_no IS NOT NULL ORDER BY id"
            ),
            params![order_id],
            refund_from_row,
        )
    }

    /// The refunds of one payment of the order, oldest first: each attempt
    /// to return it (a FAILED one is followed by the next).
    pub fn refunds_of_payment(&self, order_id: i64, pay_no: &str) -> Result<Vec<RefundRecord>, Error> {
        self.all(
            concat!("SELECT ", refund_columns!(), " FROM refund WHERE order_id = ?1 AND pay_no = ?2 ORDER BY id"),
            params![order_id, pay_no],
            refund_from_row,
        )
    }

    /// The order's own refunds (not its payments'), oldest first.
    pub fn refunds_of_order(&self, order_id: i64) -> Result<Vec<RefundRecord>, Error> {
        self.all(
            concat!("SELECT ", refund_columns!(), " FROM refund WHERE order_id = ?1 AND pay_no IS NULL ORDER BY id"),
            params![order_id],
            refund_from_row,
        )
    }
}

/// A refund of an order, or of one of its payments (`pay_no`), as requested.
pub struct NewRefund<'a> {
    pub refund_no: &'a str,
    pub order_id: i64,
    pub amount: i64,
    pub reason: Option<&'a str>,
    pub pay_no: Option<&'a str>,
    pub now: &'a str,
}

impl WriteTx<'_> {
    /// Inserts the order unless its order_no exists; `Err(existing)` then.
    pub fn insert_order(&self, order: &NewOrder) -> Result<Result<Order, Order>, Error> {
        let inserted = self.execute(
            "INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at)
             VALUES (?1, ?2, ?3, ?4, 'PENDING', ?5, ?6)
             ON CONFLICT (order_no) DO NOTHING",
            params![
                &order.order_no,
                &order.user_id,
                order.amount,
                &order.currency,
                &order.created_at,
                &order.expires_at
            ],
        )?;
        let stored = self
            .order_by_no(&order.order_no)?
            .ok_or_else(|| Error::internal(format!("order {} vanished inside its transaction", order.order_no)))?;
        Ok(if one_row(inserted, "insert order")? { Ok(stored) } else { Err(stored) })
    }

    /// CAS PENDING→PAID, only at the order's own amount. `false` when the
    /// order is not PENDING or the amount differs; the caller reads why.
    pub fn cas_order_paid(&self, order_id: i64, amount: i64, pay_no: &str, paid_at: &str) -> Result<bool, Error> {
        const { assert!(OrderStatus::Pending.can_move_to(OrderStatus::Paid)) };
        let changed = self.execute(
            "UPDATE orders SET status = 'PAID', pay_no = ?3, paid_at = ?4
             WHERE id = ?1 AND status = 'PENDING' AND amount = ?2",
            params![order_id, amount, pay_no, paid_at],
        )?;
        one_row(changed, "pay order")
    }

    /// CAS PENDING→CLOSED.
    pub fn cas_order_closed(&self, order_id: i64, closed_at: &str) -> Result<bool, Error> {
        const { assert!(OrderStatus::Pending.can_move_to(OrderStatus::Closed)) };
        let changed = self.execute(
            "UPDATE orders SET status = 'CLOSED', closed_at = ?2 WHERE id = ?1 AND status = 'PENDING'",
            params![order_id, closed_at],
        )?;
        one_row(changed, "close order")
    }

    /// CAS PAID→REFUNDING for a refund of `amount`, only while the
    /// balance (`amount` − `refunded_amount`) holds it.
    pub fn cas_order_refunding(&self, order_id: i64, refund_no: &str, amount: i64) -> Result<bool, Error> {
        const { assert!(OrderStatus::Paid.can_move_to(OrderStatus::Refunding)) };
        let changed = self.execute(
            "UPDATE orders SET status = 'REFUNDING', refund_no = ?2
             WHERE id = ?1 AND status = 'PAID' AND refunded_amount + ?3 <= amount",
            params![order_id, refund_no, amount],
        )?;
        one_row(changed, "start refund")
    }

    /// CAS REFUNDING→REFUNDED for this refund_no.
    pub fn cas_order_refunded(&self, order_id: i64, refund_no: &str, refunded_at: &str) -> Result<bool, Error> {
        const { assert!(OrderStatus::Refunding.can_move_to(OrderStatus::Refunded)) };
        let changed = self.execute(
            "UPDATE orders SET status = 'REFUNDED', refunded_at = ?3
             WHERE id = ?1 AND status = 'REFUNDING' AND refund_no = ?2",
            params![order_id, refund_no, refunded_at],
        )?;
        one_row(changed, "settle refund")
    }

    /// CAS REFUNDING→PAID for this refund_no: the refund failed, or
    /// returned part of the order; a new one may be asked.
    pub fn cas_order_refund_failed(&self, order_id: i64, refund_no: &str) -> Result<bool, Error> {
        const { assert!(OrderStatus::Refunding.can_move_to(OrderStatus::Paid)) };
        let changed = self.execute(
            "UPDATE orders SET status = 'PAID', refund_no = NULL
             WHERE id = ?1 AND status = 'REFUNDING' AND refund_no = ?2",
            params![order_id, refund_no],
        )?;
        one_row(changed, "fail refund")
    }

    /// Inserts a REQUESTED refund under `uk_refund_no`; `false` if the refund_no exists.
    pub fn insert_refund(&self, refund: &NewRefund) -> Result<bool, Error> {
        let changed = self.execute(
            "INSERT INTO refund (refund_no, order_id, status, requested_at, amount, reason, pay_no)
             VALUES (?1, ?2, 'REQUESTED', ?3, ?4, ?5, ?6)
             ON CONFLICT (refund_no) DO NOTHING",
            params![refund.refund_no, refund.order_id, refund.now, refund.amount, refund.reason, refund.pay_no],
        )?;
        one_row(changed, "request refund")
    }

    /// CAS REQUESTED→`to`; `platform_settled_at` is the platform's own time
    /// of a successful refund, when its notice carried one.
    pub fn settle_refund(
        &self,
        id: i64,
        to: RefundStatus,
        now: &str,
        platform_settled_at: Option<&str>,
    ) -> Result<bool, Error> {
        assert!(to != RefundStatus::Requested, "settling a refund as REQUESTED");
        assert!(platform_settled_at.is_none() || to == RefundStatus::Succeeded, "a platform time on a failed refund");
        let changed = self.execute(
            "UPDATE refund SET status = ?2, settled_at = ?3, platform_settled_at = ?4
             WHERE id = ?1 AND status = 'REQUESTED'",
            params![id, to.as_str(), now, platform_settled_at],
        )?;
        one_row(changed, "settle refund")
    }
}
