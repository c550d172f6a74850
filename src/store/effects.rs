//! Side effects, each under its own UNIQUE key: coupons (`uk_order_tpl`),
//! points (`uk_order_type`) and outbox events (`uk_event_id`), with the
//! compensation that freezes and reverses them.

use super::{limit_param, one_row, params, ReadTx, Row, WriteTx};
use crate::domain::{
    CouponRow, EventData, EventRow, EventType, JsonText, PointRow, POINT_TYPE_ORDER_PAID,
    POINT_TYPE_ORDER_PAID_REVERSAL,
};
use crate::error::Error;

macro_rules! coupons_where {
    ($filter:literal) => {
        concat!(
            "SELECT o.order_no, c.coupon_template_id, c.status, c.created_at
             FROM user_coupon c JOIN orders o ON o.id = c.order_id WHERE ",
            $filter,
            " ORDER BY c.id"
        )
    };
}

macro_rules! points_where {
    ($filter:literal) => {
        concat!(
            "SELECT o.order_no, p.point_type, p.points, p.created_at
             FROM point_log p JOIN orders o ON o.id = p.order_id WHERE ",
            $filter,
            " ORDER BY p.id"
        )
    };
}

fn coupon_from_row(row: &Row) -> Result<CouponRow, Error> {
    Ok(CouponRow {
        order_no: row.text(0)?,
        coupon_template_id: row.text(1)?,
        status: row.text(2)?,
        created_at: row.text(3)?,
    })
}

fn point_from_row(row: &Row) -> Result<PointRow, Error> {
    Ok(PointRow { order_no: row.text(0)?, point_type: row.text(1)?, points: row.int(2)?, created_at: row.text(3)? })
}

impl ReadTx<'_> {
    pub fn coupons_of_order(&self, order_id: i64) -> Result<Vec<CouponRow>, Error> {
        self.all(coupons_where!("c.order_id = ?1"), params![order_id], coupon_from_row)
    }

    /// Found through the user's orders (`ix_orders_user`, then
    /// `uk_order_tpl` by order): a coupon's user is its order's, so it needs
    /// no user_id index of its own to keep up on every payment.
    pub fn coupons_of_user(&self, user_id: &str) -> Result<Vec<CouponRow>, Error> {
        self.all(coupons_where!("o.user_id = ?1 AND c.user_id = ?1"), params![user_id], coupon_from_row)
    }

    /// One coupon of an order, with its status (at most one: uk_order_tpl).
    pub fn coupon_of_order(&self, order_id: i64, template: &str) -> Result<Option<CouponRow>, Error> {
        self.optional(
            coupons_where!("c.order_id = ?1 AND c.coupon_template_id = ?2"),
            params![order_id, template],
            coupon_from_row,
        )
    }

    pub fn points_of_order(&self, order_id: i64) -> Result<Vec<PointRow>, Error> {
        self.all(points_where!("p.order_id = ?1"), params![order_id], point_from_row)
    }

    /// Found through the user's orders (`ix_orders_user`, then
    /// `uk_order_type` by order), as [`ReadTx::coupons_of_user`].
    pub fn points_of_user(&self, user_id: &str) -> Result<Vec<PointRow>, Error> {
        self.all(points_where!("o.user_id = ?1 AND p.user_id = ?1"), params![user_id], point_from_row)
    }

    /// One points entry of an order by type (at most one: uk_order_type).
    pub fn points_entry(&self, order_id: i64, point_type: &str) -> Result<Option<PointRow>, Error> {
        self.optional(
            points_where!("p.order_id = ?1 AND p.point_type = ?2"),
            params![order_id, point_type],
            point_from_row,
        )
    }

    /// The order's last points reversal: compensation's own (no refund_no)
    /// when there is one, else the last refund's.
    pub fn last_points_reversal(&self, order_id: i64) -> Result<Option<PointRow>, Error> {
        let reversals = self.all(
            points_where!("p.order_id = ?1 AND p.point_type = ?2"),
            params![order_id, POINT_TYPE_ORDER_PAID_REVERSAL],
            point_from_row,
        )?;
        let own = self.optional(
            points_where!("p.order_id = ?1 AND p.point_type = ?2 AND p.refund_no IS NULL"),
            params![order_id, POINT_TYPE_ORDER_PAID_REVERSAL],
            point_from_row,
        )?;
        Ok(own.or_else(|| reversals.into_iter().last()))
    }

    /// The seq of the last event, 0 when there is none.
    pub fn last_event_seq(&self) -> Result<i64, Error> {
        self.one("SELECT coalesce(max(seq), 0) FROM outbox_event", params![], |r| r.int(0))
    }

    /// Every event of an order, in seq order.
    pub fn events_of_order(&self, order_no: &str) -> Result<Vec<EventRow>, Error> {
        self.all(
            "SELECT seq, event_id, type, order_no, data, created_at FROM outbox_event WHERE order_no = ?1 ORDER BY seq",
            params![order_no],
            event_from_row,
        )
    }

    /// The event of `seq`.
    pub fn event(&self, seq: i64) -> Result<Option<EventRow>, Error> {
        self.optional(
            "SELECT seq, event_id, type, order_no, data, created_at FROM outbox_event WHERE seq = ?1",
            params![seq],
            event_from_row,
        )
    }

    pub fn events_after(&self, after_seq: i64, limit: usize) -> Result<Vec<EventRow>, Error> {
        self.all(
            "SELECT seq, event_id, type, order_no, data, created_at FROM outbox_event
             WHERE seq > ?1 ORDER BY seq LIMIT ?2",
            params![after_seq, limit_param(limit)],
            event_from_row,
        )
    }
}

fn event_from_row(row: &Row) -> Result<EventRow, Error> {
    let data = row.text(4)?;
    Ok(EventRow {
        seq: row.int(0)?,
        event_id: row.text(1)?,
        event_type: row.text(2)?,
        order_no: row.text(3)?,
        data: serde_json::from_str(&data)
            .map_err(|e| Error::internal(format!("outbox_event.data is not JSON: {e}")))?,
        created_at: row.text(5)?,
    })
}

impl WriteTx<'_> {
    /// Issues a coupon under `uk_order_tpl`; `false` if it was issued before.
    pub fn issue_coupon(&self, user_id: &str, order_id: i64, template: &str, now: &str) -> Result<bool, Error> {
        let changed = self.execute(
            "INSERT INTO user_coupon (user_id, order_id, coupon_template_id, status, created_at)
             VALUES (?1, ?2, ?3, 'ACTIVE', ?4)
             ON CONFLICT (order_id, coupon_template_id) DO NOTHING",
            params![user_id, order_id, template, now],
        )?;
        one_row(changed, "issue coupon")
    }

    /// Adds the order's points under `uk_order_type`; `false` if added before.
    pub fn add_order_points(&self, user_id: &str, order_id: i64, points: i64, now: &str) -> Result<bool, Error> {
        let changed = self.execute(
            "INSERT INTO point_log (user_id, order_id, point_type, points, created_at)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (order_id, point_type, coalesce(refund_no, '')) DO NOTHING",
            params![user_id, order_id, POINT_TYPE_ORDER_PAID, points, now],
        )?;
        one_row(changed, "add points")
    }

    /// Reverses what is left of the order's `ORDER_PAID` points (refunds
    /// may have reversed part) by one negative entry without a refund_no,
    /// under `uk_order_type`; `false` when nothing is left or it was
    /// reversed before.
    pub fn reverse_order_points(&self, order_id: i64, now: &str) -> Result<bool, Error> {
        let changed = self.execute(
            "INSERT INTO point_log (user_id, order_id, point_type, points, created_at)
             SELECT p.user_id, p.order_id, ?2, -rest.points, ?3
             FROM point_log p, (SELECT CAST(coalesce(sum(points), 0) AS BIGINT) AS points
                                FROM point_log WHERE order_id = ?1) rest
             WHERE p.order_id = ?1 AND p.point_type = ?4 AND rest.points > 0
             ON CONFLICT (order_id, point_type, coalesce(refund_no, '')) DO NOTHING",
            params![order_id, POINT_TYPE_ORDER_PAID_REVERSAL, now, POINT_TYPE_ORDER_PAID],
        )?;
        one_row(changed, "reverse points")
    }

    /// The order's ORDER_PAID points, and what is left of them after every
    /// reversal so far.
    pub fn points_paid_and_left(&self, order_id: i64) -> Result<(i64, i64), Error> {
        self.one(
            "SELECT CAST(coalesce(sum(CASE WHEN point_type = ?2 THEN points ELSE 0 END), 0) AS BIGINT),
                    CAST(coalesce(sum(points), 0) AS BIGINT)
             FROM point_log WHERE order_id = ?1",
            params![order_id, POINT_TYPE_ORDER_PAID],
            |r| Ok((r.int(0)?, r.int(1)?)),
        )
    }

    /// Reverses `points` (> 0) of the order's ORDER_PAID points for refund
    /// `refund_no`, one entry under `uk_order_type`; `false` when this
    /// refund's reversal exists already.
    pub fn reverse_points_of_refund(
        &self,
        order_id: i64,
        refund_no: &str,
        points: i64,
        now: &str,
    ) -> Result<bool, Error> {
        let changed = self.execute(
            "INSERT INTO point_log (user_id, order_id, point_type, points, created_at, refund_no)
             SELECT user_id, order_id, ?2, 0 - CAST(?3 AS BIGINT), ?4, ?5 FROM point_log
             WHERE order_id = ?1 AND point_type = ?6
             ON CONFLICT (order_id, point_type, coalesce(refund_no, '')) DO NOTHING",
            params![order_id, POINT_TYPE_ORDER_PAID_REVERSAL, points, now, refund_no, POINT_TYPE_ORDER_PAID],
        )?;
        one_row(changed, "reverse points of a refund")
    }

    /// Freezes the order's ACTIVE coupons; returns how many.
    pub fn freeze_active_coupons(&self, order_id: i64) -> Result<usize, Error> {
        self.execute(
            "UPDATE user_coupon SET status = 'FROZEN' WHERE order_id = ?1 AND status = 'ACTIVE'",
            params![order_id],
        )
    }

    /// CAS ACTIVE→FROZEN for one coupon.
    pub fn freeze_coupon(&self, order_id: i64, template: &str) -> Result<bool, Error> {
        let changed = self.execute(
            "UPDATE user_coupon SET status = 'FROZEN'
             WHERE order_id = ?1 AND coupon_template_id = ?2 AND status = 'ACTIVE'",
            params![order_id, template],
        )?;
        one_row(changed, "freeze coupon")
    }

    /// Writes an outbox event under `uk_event_id`; `false` if it exists.
    /// The engine is told just before the insert: on PostgreSQL that is
    /// where the outbox lock is taken, so commits of events happen in `seq`
    /// order and a reader's cursor never skips one.
    pub fn emit_event(
        &self,
        event_type: EventType,
        subject: &str,
        order_no: &str,
        data: &EventData,
        now: &str,
    ) -> Result<bool, Error> {
        self.read.conn.before_event_insert()?;
        let changed = self.execute(
            "INSERT INTO outbox_event (event_id, type, order_no, data, created_at)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (event_id) DO NOTHING",
            params![&event_type.event_id(subject), event_type.as_str(), order_no, &data.json_text(), now],
        )?;
        self.read.conn.after_event_insert();
        if changed > 0 {
            self.emitted.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        one_row(changed, "emit event")
    }
}
