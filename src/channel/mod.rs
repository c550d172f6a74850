//! Payment channels. A channel verifies a platform's raw notification,
//! maps it onto the same payment or refund command (the exactly-once path
//! in `app.rs` is shared and untouched), and answers in the platform's own
//! protocol. A channel owns its configuration and knows neither `App` nor
//! the store: `App` holds the configured channels as `dyn Channel`, and
//! `api` delivers what they parse. Adding a platform is one module here and
//! one line in [`configured`].
//!
//! A notification that fails verification is refused in the platform's
//! protocol and records nothing: verification happens before the first write.

pub mod alipay;
pub mod generic;
pub mod wechatpay;

use crate::domain::{PaymentCallback, PaymentReply, RefundCallback, RefundOutcome};
use crate::error::Error;
use crate::wire::{Request, Response};

/// What a verified notification asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Notice {
    Payment(PaymentCallback),
    Refund(RefundCallback),
    /// A refund result that names no refund request (Alipay's full refund,
    /// `TRADE_CLOSED` with `gmt_refund` and no `out_biz_no`): it settles the
    /// order's refund in flight, looked up inside the refund's transaction;
    /// `refund_no` is the one to use when the order has none.
    RefundInFlight(RefundCallback),
    /// Authentic, but changes nothing (e.g. Alipay's TRADE_CLOSED of an unpaid trade).
    Ignored(&'static str),
}

/// What payonce did with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    Payment(PaymentReply),
    Refund(RefundOutcome),
    Ignored,
}

pub trait Channel: Send + Sync {
    /// The `{channel}` of `/v1/callbacks/{channel}`.
    fn name(&self) -> &'static str;
    /// Verifies the request at `now_ms` and maps it; `refund_route` is true
    /// for `/v1/callbacks/{channel}/refund`.
    fn parse(&self, now_ms: i64, req: &Request, refund_route: bool) -> Result<Notice, Error>;
    /// The platform's success answer (2xx tells it to stop retrying).
    fn acknowledge(&self, reply: &Reply) -> Response;
    /// The platform's failure answer (it will retry).
    fn refuse(&self, err: &Error) -> Response;
}

/// The channels these settings configure: generic when it has a secret,
/// WeChat Pay and Alipay when their keys are given.
pub fn configured(
    callback_secrets: &[Vec<u8>],
    wechatpay: Option<&wechatpay::WechatpayConfig>,
    alipay: Option<&alipay::AlipayConfig>,
) -> Vec<Box<dyn Channel>> {
    let mut channels: Vec<Box<dyn Channel>> = Vec::new();
    if !callback_secrets.is_empty() {
        channels.push(Box::new(generic::Generic::new(callback_secrets.to_vec())));
    }
    if let Some(config) = wechatpay {
        channels.push(Box::new(wechatpay::Wechatpay::new(config.clone())));
    }
    if let Some(config) = alipay {
        channels.push(Box::new(alipay::Alipay::new(config.clone())));
    }
    channels
}

/// The field of a channel's payment notification that carries the
/// platform's payment time (`PaymentCallback::paid_at`), for a refusal to name.
pub fn paid_time_field(channel: &str) -> &'static str {
    match channel {
        wechatpay::NAME => "success_time",
        alipay::NAME => "gmt_payment",
        _ => "paid_at",
    }
}

/// The outcome word of a reply, for platforms that carry none in their protocol (logs).
pub fn reply_outcome(reply: &Reply) -> &'static str {
    match reply {
        Reply::Payment(p) => p.outcome_str(),
        Reply::Refund(r) => r.as_str(),
        Reply::Ignored => "ignored",
    }
}
