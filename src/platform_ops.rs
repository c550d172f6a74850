//! What payonce does with the platforms' answers (PRODUCT.md section 11):
//! `sync` asks every configured platform about an order and applies a paid
//! answer through the same exactly-once path as a callback, with source
//! `query`. Each call is a `platform_call` row before it is made and is
//! completed after it; no transaction spans a call.

use crate::app::{App, PaymentCallback};
use crate::clock::format_ms;
use crate::domain::{Order, PlatformStatus};
use crate::error::Error;
use crate::platform::alipay::AlipayApi;
use crate::platform::wechatpay::WechatpayApi;
use crate::platform::{Exchange, TradeState};
use crate::store::NewPlatformCall;
use std::sync::Arc;

/// Where a payment learnt by asking the platform came from, for `pay_callback_log.source`.
pub const SOURCE_QUERY: &str = "query";

/// The platforms whose outgoing settings are complete.
#[derive(Clone, Default)]
pub struct Platforms {
    pub wechatpay: Option<Arc<WechatpayApi>>,
    pub alipay: Option<Arc<AlipayApi>>,
    pub timeout_ms: u64,
}

impl std::fmt::Debug for Platforms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Platforms")
            .field("wechatpay", &self.wechatpay.as_ref().map(|w| &w.api_base))
            .field("alipay", &self.alipay.as_ref().map(|a| &a.gateway))
            .finish()
    }
}

impl Platforms {
    pub fn is_empty(&self) -> bool {
        self.wechatpay.is_none() && self.alipay.is_none()
    }
}

/// One platform's answer in `POST /v1/orders/{order_no}/sync`.
#[derive(Clone, Debug)]
pub struct PlatformAnswer {
    pub channel: &'static str,
    pub state: TradeState,
    /// The verified answer, kept as the payment's raw body when it says paid.
    pub answer: String,
}

/// `POST /v1/orders/{order_no}/sync`'s result: the order after the sync.
#[derive(Clone, Debug)]
pub struct Synced {
    pub order: Order,
    pub platforms: Vec<PlatformAnswer>,
}

impl App {
    /// Asks every configured platform about `order_no`, at once, each call
    /// bounded by `--platform-timeout-ms`; a paid answer is delivered as a
    /// payment with source `query` (a later callback of that pay_no is a
    /// duplicate). 404 `order_not_found` for an unknown order.
    pub fn sync_order(&self, order_no: &str) -> Result<Synced, Error> {
        self.order(order_no)?;
        let platforms = &self.config.platforms;
        let asked: Vec<PlatformAnswer> = std::thread::scope(|scope| {
            let mut calls = Vec::new();
            if let Some(api) = &platforms.wechatpay {
                calls.push(scope.spawn(move || self.ask("wechatpay", order_no, |now| api.query(order_no, now))));
            }
            if let Some(api) = &platforms.alipay {
                calls.push(scope.spawn(move || self.ask("alipay", order_no, |now| api.query(order_no, now))));
            }
            calls
                .into_iter()
                .map(|c| c.join().unwrap_or_else(|_| Err(Error::internal("a platform query panicked"))))
                .collect::<Result<Vec<_>, Error>>()
        })?;
        for answer in &asked {
            if let TradeState::Paid { pay_no, amount, paid_at } = answer.state.clone() {
                let payment = PaymentCallback {
                    channel: answer.channel.to_owned(),
                    pay_no,
                    order_no: order_no.to_owned(),
                    amount,
                    status: PlatformStatus::Success,
                    paid_at,
                    raw_body: answer.answer.clone().into_bytes(),
                };
                self.deliver_payment_from(&payment, SOURCE_QUERY)?;
            }
        }
        Ok(Synced { order: self.order(order_no)?.order, platforms: asked })
    }

    /// One query to one platform, recorded in `platform_call` before and after.
    fn ask(
        &self,
        channel: &'static str,
        order_no: &str,
        query: impl FnOnce(i64) -> Exchange<TradeState>,
    ) -> Result<PlatformAnswer, Error> {
        let now_ms = self.clock.now_ms();
        let now = format_ms(now_ms);
        let timeout_ms = i64::try_from(self.config.platforms.timeout_ms).unwrap_or(i64::MAX);
        let lease_until = format_ms(now_ms.saturating_add(timeout_ms));
        let request = format!("query {order_no}");
        let call = NewPlatformCall {
            channel,
            kind: "query",
            order_no,
            refund_no: None,
            request: &request,
            now: &now,
            lease_until: &lease_until,
        };
        let id = self.store.write(|tx| tx.insert_platform_call(&call))?;
        let exchange = query(now_ms);
        let recorded = match &exchange.distrust {
            None => exchange.response.clone(),
            Some(why) => format!("{why}\n{}", exchange.response),
        };
        let finished = self.clock.now_text();
        self.store.write(|tx| {
            tx.finish_platform_call(id, exchange.distrust.is_none(), exchange.http_status, &recorded, &finished)
        })?;
        if let Some(why) = &exchange.distrust {
            crate::log::warn(
                "platform query unanswered",
                &[("channel", &channel), ("order_no", &order_no), ("why", why)],
            );
        }
        Ok(PlatformAnswer { channel, state: exchange.meaning, answer: exchange.response })
    }
}
