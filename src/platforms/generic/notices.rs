//! The generic channel's notices: payonce's own signed format, JSON
//! bodies under a `Payonce-Signature` HMAC.

use super::NAME;
use crate::clock::{format_ms, parse_rfc3339_ms};
use crate::domain::PlatformStatus;
use crate::domain::{PaymentCallback, PaymentReply, PaymentReplyOutcome, RefundCallback};
use crate::error::{Error, ErrorKind};
use crate::platforms::{Held, Notice, Notices, Reply};
use crate::signature::{self, SignatureError};
use crate::wire::{self, Request, Response};
use serde_json::{Map, Value};

/// The generic channel with its HMAC secrets (two during rotation), which a
/// reload of `--callback-secret-file` replaces.
pub struct Generic {
    secrets: Held<Vec<Vec<u8>>>,
}

impl Generic {
    pub fn new(secrets: Vec<Vec<u8>>) -> Generic {
        Generic::held(Held::new(secrets))
    }

    /// The channel verifying with whatever `secrets` holds at each notice.
    pub fn held(secrets: Held<Vec<Vec<u8>>>) -> Generic {
        Generic { secrets }
    }
}

impl Notices for Generic {
    fn name(&self) -> &'static str {
        NAME
    }

    fn describe(&self) -> String {
        format!("{} HMAC secret(s)", self.secrets.current().len())
    }

    fn parse(&self, now_ms: i64, req: &Request, refund_route: bool) -> Result<Notice, Error> {
        verify(&self.secrets.current(), now_ms, req)?;
        wire::check_json_media_type(req)?;
        let body = wire::parse_object(&req.body)?;
        if refund_route {
            return Ok(Notice::Refund(RefundCallback {
                channel: NAME.to_owned(),
                refund_no: wire::required_str(&body, "refund_no")?,
                order_no: wire::required_str(&body, "order_no")?,
                status: platform_status(&body)?,
                // The generic refund result carries no time of its own.
                settled_at: None,
                amount: wire::optional_i64(&body, "amount")?,
                refunded_total: None,
            }));
        }
        let paid_at = match wire::optional_str(&body, "paid_at")? {
            None => None,
            Some(text) => Some(format_ms(
                parse_rfc3339_ms(&text)
                    .ok_or_else(|| Error::invalid("paid_at must be an RFC 3339 timestamp with an offset"))?,
            )),
        };
        Ok(Notice::Payment(PaymentCallback {
            channel: NAME.to_owned(),
            pay_no: wire::required_str(&body, "pay_no")?,
            order_no: wire::required_str(&body, "order_no")?,
            amount: wire::required_i64(&body, "amount")?,
            // Optional: a v1 notice has none, and its amount is in the
            // order's own currency (docs/channels.md).
            currency: wire::optional_str(&body, "currency")?,
            status: platform_status(&body)?,
            paid_at,
            raw_body: req.body.clone(),
        }))
    }

    fn acknowledge(&self, reply: &Reply) -> Response {
        let body = match reply {
            Reply::Payment(p) => p.to_json(),
            Reply::Refund(r) => success(r.as_str(), None),
            Reply::Ignored => success("ignored", None),
        };
        Response::json(200, &body)
    }

    fn refuse(&self, err: &Error) -> Response {
        Response::error(err)
    }
}

/// Nothing is read from the body, let alone recorded, before this passes.
fn verify(secrets: &[Vec<u8>], now_ms: i64, req: &Request) -> Result<(), Error> {
    let now_s = now_ms.div_euclid(1000);
    match signature::verify(req.header("Payonce-Signature"), &req.body, secrets, now_s) {
        Ok(()) => Ok(()),
        Err(SignatureError::Invalid) => Err(Error::new(
            ErrorKind::InvalidSignature,
            "Payonce-Signature is missing, malformed or matches no configured secret",
        )),
        Err(SignatureError::Expired) => Err(Error::new(
            ErrorKind::SignatureExpired,
            format!("Payonce-Signature t is more than {} s from now", signature::SIGNATURE_TOLERANCE_S),
        )),
    }
}

fn platform_status(body: &Map<String, Value>) -> Result<PlatformStatus, Error> {
    let status = wire::required_str(body, "status")?;
    PlatformStatus::parse(&status).ok_or_else(|| Error::invalid("status must be SUCCESS or FAILED"))
}

impl PaymentReply {
    /// The generic channel's answer to a payment: `{"code":"SUCCESS","outcome":..}`,
    /// with `original` for a duplicate.
    pub fn to_json(&self) -> Value {
        match self.outcome {
            PaymentReplyOutcome::Decided(o) => success(o.as_str(), None),
            PaymentReplyOutcome::Duplicate { original } => success("duplicate", Some(original.as_str())),
        }
    }
}

/// `{"code":"SUCCESS","outcome":..}`, with `original` when given.
fn success(outcome: &str, original: Option<&str>) -> Value {
    let mut body = Map::new();
    body.insert("code".into(), "SUCCESS".into());
    body.insert("outcome".into(), outcome.into());
    if let Some(original) = original {
        body.insert("original".into(), original.into());
    }
    Value::Object(body)
}
