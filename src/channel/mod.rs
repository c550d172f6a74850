//! Payment channels. A channel verifies a platform's raw notification,
//! maps it onto the same payment or refund command (the exactly-once path
//! in `app.rs` is shared and untouched), and answers in the platform's own
//! protocol. Adding a platform is one module here and one arm in [`handle`].
//!
//! A notification that fails verification is refused in the platform's
//! protocol and records nothing: verification happens before the first write.

pub mod alipay;
pub mod generic;
pub mod wechatpay;

use crate::api::{Request, Response};
use crate::app::{App, PaymentCallback, PaymentReply, RefundCallback};
use crate::domain::RefundOutcome;
use crate::error::{Error, ErrorKind};

/// What a verified notification asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Notice {
    Payment(PaymentCallback),
    Refund(RefundCallback),
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

pub trait Channel {
    /// Verifies the request and maps it; `refund_route` is true for
    /// `/v1/callbacks/{channel}/refund`.
    fn parse(&self, app: &App, req: &Request, refund_route: bool) -> Result<Notice, Error>;
    /// The platform's success answer (2xx tells it to stop retrying).
    fn acknowledge(&self, reply: &Reply) -> Response;
    /// The platform's failure answer (it will retry).
    fn refuse(&self, err: &Error) -> Response;
}

/// `POST /v1/callbacks/{channel}` and `/v1/callbacks/{channel}/refund`.
pub fn handle(app: &App, req: &Request, channel: &str, refund_route: bool) -> Response {
    with_channel(app, channel, |chosen| {
        match chosen.parse(app, req, refund_route).and_then(|notice| deliver(app, notice)) {
            Ok(reply) => chosen.acknowledge(&reply).with_outcome(reply_outcome(&reply)),
            Err(err) => {
                if err.is_server_error() {
                    crate::log::error("callback failed", &[("channel", &channel), ("error", &err)]);
                }
                chosen.refuse(&err).with_outcome(err.code)
            }
        }
    })
}

/// A refusal decided before the notification is read (e.g. 413 at the HTTP
/// edge), in the channel's own protocol. Touches no store.
pub fn refuse(app: &App, channel: &str, err: &Error) -> Response {
    with_channel(app, channel, |chosen| chosen.refuse(err).with_outcome(err.code))
}

/// Runs `f` with the configured channel of that name; 404
/// `channel_not_configured` otherwise.
fn with_channel(app: &App, channel: &str, f: impl FnOnce(&dyn Channel) -> Response) -> Response {
    let generic = generic::Generic;
    let wechatpay = app.config.wechatpay.as_ref().map(wechatpay::Wechatpay::new);
    let alipay = app.config.alipay.as_ref().map(alipay::Alipay::new);
    let chosen: Option<&dyn Channel> = match channel {
        "generic" if !app.config.callback_secrets.is_empty() => Some(&generic),
        "wechatpay" => wechatpay.as_ref().map(|c| c as &dyn Channel),
        "alipay" => alipay.as_ref().map(|c| c as &dyn Channel),
        _ => None,
    };
    match chosen {
        Some(chosen) => f(chosen),
        None => Response::error(&Error::new(
            ErrorKind::ChannelNotConfigured,
            format!("payment channel {channel:?} is not configured"),
        )),
    }
}

fn deliver(app: &App, notice: Notice) -> Result<Reply, Error> {
    Ok(match notice {
        Notice::Payment(cb) => Reply::Payment(app.deliver_payment(&cb)?),
        Notice::Refund(cb) => Reply::Refund(app.deliver_refund(&cb)?),
        Notice::Ignored(_) => Reply::Ignored,
    })
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
