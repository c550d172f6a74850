//! Orders: create, close (here, or at the platforms first), expire, and
//! read them with everything they caused; the event feed and a user's
//! coupons and points.

use super::{close_in_tx, refuse_transition, Core};
use crate::app::{CreateOrder, OrderDetail, EXPIRES_IN_S_MAX, PAGE_LIMIT_MAX};
use crate::domain::{is_amount, is_currency, is_identifier, Order, OrderStatus, Refused};
use crate::domain::{CouponRow, EventRow, IdempotencySlot, NewOrder, PointRow};
use crate::error::{Error, ErrorKind};
use crate::keylock::LockKey;

#[derive(Clone, Copy)]
pub struct Orders<'a> {
    core: &'a Core,
}

impl<'a> Orders<'a> {
    pub(crate) fn new(core: &'a Core) -> Orders<'a> {
        Orders { core }
    }

    /// Creates the order once per order_no: `(order, true)` when created,
    /// `(stored, false)` when the same order was created before, 409
    /// `order_no_conflict` when the order_no holds a different order.
    pub fn create_order(&self, req: &CreateOrder) -> Result<(Order, bool), Error> {
        self.create_order_keyed(req, None)
    }

    /// [`Orders::create_order`], storing the API's answer in `slot` in the same
    /// transaction as the order.
    pub fn create_order_keyed(
        &self,
        req: &CreateOrder,
        slot: Option<&IdempotencySlot>,
    ) -> Result<(Order, bool), Error> {
        validate_create_order(req)?;
        let expires_in_s = req.expires_in_s.unwrap_or(self.core.config().order_ttl_s);
        let key = self.core.locks().lock(LockKey::Order(&req.order_no));
        let now_ms = self.core.clock().now_ms();
        let new = NewOrder {
            order_no: req.order_no.clone(),
            user_id: req.user_id.clone(),
            amount: req.amount,
            currency: req.currency.clone(),
            created_at: crate::clock::format_ms(now_ms),
            expires_at: crate::clock::format_ms(now_ms.saturating_add(expires_in_s.saturating_mul(1000))),
        };
        self.core.write_op(&[&key], slot, |tx| match tx.insert_order(&new)? {
            Ok(order) => Ok((order, true)),
            Err(existing)
                if existing.user_id == req.user_id
                    && existing.amount == req.amount
                    && existing.currency == req.currency =>
            {
                Ok((existing, false))
            }
            Err(_) => Err(Error::new(
                ErrorKind::OrderNoConflict,
                format!("order_no {:?} already holds an order with other user_id, amount or currency", req.order_no),
            )),
        })
    }

    /// A new order_no for a keyed request without one: `ORD`, the creation
    /// time in Unix milliseconds (so they sort by time) and 64 random bits
    /// (so processes never collide): 32 characters, within WeChat Pay's
    /// 6-32 for `out_trade_no`.
    pub fn generate_order_no(&self) -> Result<String, Error> {
        let mut random = [0u8; 8];
        getrandom::fill(&mut random).map_err(|e| Error::internal(format!("no OS randomness: {e}")))?;
        let ms = self.core.clock().now_ms().clamp(0, 9_999_999_999_999);
        Ok(format!("ORD{ms:013}{:016x}", u64::from_be_bytes(random)))
    }

    pub fn order(&self, order_no: &str) -> Result<OrderDetail, Error> {
        self.core.store().read(|tx| {
            let order = tx.order_by_no(order_no)?.ok_or_else(|| Error::order_not_found(order_no))?;
            Ok(OrderDetail {
                payments: tx.callbacks_of_order(order.id)?,
                coupons: tx.coupons_of_order(order.id)?,
                points: tx.points_of_order(order.id)?,
                events: tx.events_of_order(order_no)?,
                audit: tx.audit_of_order(order_no)?,
                platform_calls: tx.platform_calls_of_order(order_no)?,
                webhook_deliveries: tx.webhook_deliveries_of_order(order_no)?,
                refunds: tx.refunds_of_order(order.id)?,
                payment_refunds: tx.payment_refunds_of_order(order.id)?,
                order,
            })
        })
    }

    /// Newest first; the cursor is the last order's position, opaque to callers.
    pub fn list_orders(
        &self,
        user_id: Option<&str>,
        status: Option<OrderStatus>,
        after: Option<i64>,
        limit: usize,
    ) -> Result<(Vec<Order>, Option<i64>), Error> {
        let limit = limit.clamp(1, PAGE_LIMIT_MAX);
        // One extra row tells whether another page exists.
        let mut orders = self.core.store().read(|tx| tx.list_orders(user_id, status, after, limit + 1))?;
        let next = if orders.len() > limit {
            orders.truncate(limit);
            orders.last().map(|o| o.id)
        } else {
            None
        };
        Ok((orders, next))
    }

    /// PENDING→CLOSED; an already CLOSED order is answered as it is.
    pub fn close_order(&self, order_no: &str) -> Result<Order, Error> {
        self.close_order_keyed(order_no, None)
    }

    /// Closes a PENDING order. With platforms configured (docs/platforms.md)
    /// it closes at each platform first
    /// ([`PlatformCalls::close_order_at_platforms`](super::PlatformCalls::close_order_at_platforms)).
    pub fn close_order_keyed(&self, order_no: &str, slot: Option<&IdempotencySlot>) -> Result<Order, Error> {
        if self.core.config().platforms.is_empty() {
            self.close_order_locally(order_no, slot)
        } else {
            self.core.platform_calls().close_order_at_platforms(order_no, slot)
        }
    }

    /// PENDING → CLOSED here; CLOSED answers the order; any other state is 409.
    pub(crate) fn close_order_locally(&self, order_no: &str, slot: Option<&IdempotencySlot>) -> Result<Order, Error> {
        let key = self.core.locks().lock(LockKey::Order(order_no));
        let now = self.core.clock().now_text();
        self.core.write_op(&[&key], slot, |tx| {
            let order = tx.order_by_no(order_no)?.ok_or_else(|| Error::order_not_found(order_no))?;
            if let Some(closed) = close_in_tx(tx, &order, &now)? {
                return Ok(closed);
            }
            if order.status == OrderStatus::Closed {
                return Ok(order);
            }
            Err(refuse_transition(tx, &order, OrderStatus::Closed, "close", &now, Refused::Order)?)
        })
    }

    /// Closes up to `batch` PENDING orders whose `expires_at` has passed, one
    /// transaction each (a payment racing the sweeper waits at most one
    /// order's close). Returns how many it closed.
    ///
    /// With platforms configured it closes nothing itself: it queues the
    /// close at each platform ([`PlatformCalls::queue_platform_closes`]) and returns
    /// how many orders it queued.
    pub fn close_expired(&self, batch: usize) -> Result<usize, Error> {
        if !self.core.config().platforms.is_empty() {
            return self.core.platform_calls().queue_platform_closes(batch);
        }
        let now = self.core.clock().now_text();
        let due = self.core.store().read(|tx| tx.expired_pending_orders(&now, batch))?;
        let mut closed = 0;
        for order_no in due {
            let key = self.core.locks().lock(LockKey::Order(&order_no));
            let did_close = self.core.store().write(&[&key], |tx| {
                let Some(order) = tx.order_by_no(&order_no)? else {
                    return Ok(false);
                };
                // Re-judged inside the write transaction: a payment may have won meanwhile.
                if order.expires_at > now {
                    return Ok(false);
                }
                Ok(close_in_tx(tx, &order, &now)?.is_some())
            })?;
            closed += usize::from(did_close);
        }
        Ok(closed)
    }

    // ---- reads ----

    pub fn events(&self, after: i64, limit: usize) -> Result<Vec<EventRow>, Error> {
        self.core.store().read(|tx| tx.events_after(after, limit.clamp(1, PAGE_LIMIT_MAX)))
    }

    pub fn user_coupons(&self, user_id: &str) -> Result<Vec<CouponRow>, Error> {
        self.core.store().read(|tx| tx.coupons_of_user(user_id))
    }

    /// The user's points balance and entries.
    pub fn user_points(&self, user_id: &str) -> Result<(i64, Vec<PointRow>), Error> {
        let entries = self.core.store().read(|tx| tx.points_of_user(user_id))?;
        let balance = entries.iter().map(|e| e.points).sum();
        Ok((balance, entries))
    }
}

fn validate_create_order(req: &CreateOrder) -> Result<(), Error> {
    if !is_identifier(&req.order_no) {
        return Err(Error::invalid("order_no must be 1-64 characters of [A-Za-z0-9_.-]"));
    }
    if !is_identifier(&req.user_id) {
        return Err(Error::invalid("user_id must be 1-64 characters of [A-Za-z0-9_.-]"));
    }
    if !is_amount(req.amount) {
        return Err(Error::invalid("amount must be an integer from 1 to 1000000000000 (minor units)"));
    }
    if !is_currency(&req.currency) {
        return Err(Error::invalid("currency must be 3 upper-case letters"));
    }
    if let Some(s) = req.expires_in_s {
        if !(1..=EXPIRES_IN_S_MAX).contains(&s) {
            return Err(Error::invalid("expires_in_s must be an integer from 1 to 86400"));
        }
    }
    Ok(())
}
