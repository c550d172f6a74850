//! What the webhook admin operations and the relay's reads answer: a page
//! of deliveries, an enabled endpoint, a replay, a claimed attempt. The
//! operations themselves are the `Webhooks` service
//! (`src/services/webhooks.rs`).

use crate::domain::{DeliveryRow, EndpointRow, EventRow};
use crate::error::{Error, ErrorKind};
use crate::outgoing::Claimed;

/// One page of `GET /v1/webhooks/deliveries`.
#[derive(Clone, Debug)]
pub struct DeliveryPage {
    pub deliveries: Vec<DeliveryRow>,
    /// The cursor of the next page; `None` when this one was the last.
    pub next_after: Option<i64>,
}

/// `POST /v1/webhooks/endpoints/enable`'s result.
#[derive(Clone, Debug)]
pub struct EnabledEndpoint {
    pub endpoint: EndpointRow,
    /// Disabled deliveries that are pending again.
    pub resumed: usize,
}

/// `POST /v1/webhooks/replay`'s result.
#[derive(Clone, Debug)]
pub struct Replayed {
    pub queued: usize,
    /// When the range held more than [`crate::store::REPLAY_EVENTS_MAX`]
    /// events: the seq of the last one queued, to replay the rest after it.
    pub next_after: Option<i64>,
}

/// One claimed webhook attempt: the delivery as read with the attempt
/// number it owns, and the event it carries.
#[derive(Clone, Debug)]
pub struct Attempt {
    pub delivery: Claimed<DeliveryRow>,
    pub event: EventRow,
}

pub fn endpoint_not_found(endpoint: &str) -> Error {
    Error::new(
        ErrorKind::EndpointNotFound,
        format!("{endpoint:?} is not a configured webhook endpoint (--webhook-url)"),
    )
}
