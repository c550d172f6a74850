//! payonce's one error type. Each error has an [`ErrorKind`], which alone
//! decides the contract's status code, its snake_case code and whether the
//! work that refused commits; the message is for the caller. `5xx` only
//! for the server's own faults.

use serde_json::json;
use std::fmt;

/// Every refusal payonce answers. Adding one means answering three
/// questions in the exhaustive matches below: its status, its code, and
/// whether its transaction commits ([`ErrorKind::commits`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    // 400
    InvalidRequest,
    InvalidJson,
    InvalidIdempotencyKey,
    IdempotencyKeyRequired,
    // 401
    Unauthorized,
    InvalidSignature,
    SignatureExpired,
    // 404
    NotFound,
    ChannelNotConfigured,
    OrderNotFound,
    PaymentNotFound,
    RefundNotFound,
    CouponNotFound,
    PointsNotFound,
    DeliveryNotFound,
    EndpointNotFound,
    // 405, 408
    MethodNotAllowed,
    RequestTimeout,
    // 409
    OrderNoConflict,
    InvalidTransition,
    IdempotencyKeyInUse,
    // 413, 415, 422
    PayloadTooLarge,
    UnsupportedMediaType,
    IdempotencyKeyReused,
    // 500
    Internal,
    // 503
    DatabaseBusy,
    DatabaseUnavailable,
    StorageLost,
    ShuttingDown,
    PlatformUnavailable,
}

impl ErrorKind {
    pub fn status(self) -> u16 {
        use ErrorKind::*;
        match self {
            InvalidRequest | InvalidJson | InvalidIdempotencyKey | IdempotencyKeyRequired => 400,
            Unauthorized | InvalidSignature | SignatureExpired => 401,
            NotFound | ChannelNotConfigured | OrderNotFound | PaymentNotFound | RefundNotFound | CouponNotFound
            | PointsNotFound | DeliveryNotFound | EndpointNotFound => 404,
            MethodNotAllowed => 405,
            RequestTimeout => 408,
            OrderNoConflict | InvalidTransition | IdempotencyKeyInUse => 409,
            PayloadTooLarge => 413,
            UnsupportedMediaType => 415,
            IdempotencyKeyReused => 422,
            Internal => 500,
            DatabaseBusy | DatabaseUnavailable | StorageLost | ShuttingDown | PlatformUnavailable => 503,
        }
    }

    pub fn code(self) -> &'static str {
        use ErrorKind::*;
        match self {
            InvalidRequest => "invalid_request",
            InvalidJson => "invalid_json",
            InvalidIdempotencyKey => "invalid_idempotency_key",
            IdempotencyKeyRequired => "idempotency_key_required",
            Unauthorized => "unauthorized",
            InvalidSignature => "invalid_signature",
            SignatureExpired => "signature_expired",
            NotFound => "not_found",
            ChannelNotConfigured => "channel_not_configured",
            OrderNotFound => "order_not_found",
            PaymentNotFound => "payment_not_found",
            RefundNotFound => "refund_not_found",
            CouponNotFound => "coupon_not_found",
            PointsNotFound => "points_not_found",
            DeliveryNotFound => "delivery_not_found",
            EndpointNotFound => "endpoint_not_found",
            MethodNotAllowed => "method_not_allowed",
            RequestTimeout => "request_timeout",
            OrderNoConflict => "order_no_conflict",
            InvalidTransition => "invalid_transition",
            IdempotencyKeyInUse => "idempotency_key_in_use",
            PayloadTooLarge => "payload_too_large",
            UnsupportedMediaType => "unsupported_media_type",
            IdempotencyKeyReused => "idempotency_key_reused",
            Internal => "internal_error",
            DatabaseBusy => "database_busy",
            DatabaseUnavailable => "database_unavailable",
            StorageLost => "storage_lost",
            ShuttingDown => "shutting_down",
            PlatformUnavailable => "platform_unavailable",
        }
    }

    /// A business refusal: the work ran and said no. Its transaction
    /// commits (an audit row may record the refusal) and, for a keyed
    /// request, the answer is stored and replayed like a success. Every
    /// other error rolls the work back and stores nothing.
    pub fn commits(self) -> bool {
        use ErrorKind::*;
        match self {
            // The thing asked for is not there; the work wrote nothing but may audit.
            NotFound | ChannelNotConfigured | OrderNotFound | PaymentNotFound | RefundNotFound | CouponNotFound
            | PointsNotFound | DeliveryNotFound | EndpointNotFound => true,
            // The refusal is the answer, and its audit row must stay.
            OrderNoConflict | InvalidTransition => true,
            // Refused before or beside the work: nothing of it may stay.
            InvalidRequest
            | InvalidJson
            | InvalidIdempotencyKey
            | IdempotencyKeyRequired
            | Unauthorized
            | InvalidSignature
            | SignatureExpired
            | MethodNotAllowed
            | RequestTimeout
            | IdempotencyKeyInUse
            | PayloadTooLarge
            | UnsupportedMediaType
            | IdempotencyKeyReused => false,
            // The server's own faults: roll back.
            Internal | DatabaseBusy | DatabaseUnavailable | StorageLost | ShuttingDown | PlatformUnavailable => false,
        }
    }

    /// 503 and 409 `idempotency_key_in_use` tell the client when to retry.
    pub fn retry_after(self) -> bool {
        self.status() == 503 || self == ErrorKind::IdempotencyKeyInUse
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub kind: ErrorKind,
    /// `kind.status()`, kept beside it for callers that read the field.
    pub status: u16,
    /// `kind.code()`.
    pub code: &'static str,
    pub message: String,
}

impl Error {
    /// The one constructor: status and code always follow the kind.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error { kind, status: kind.status(), code: kind.code(), message: message.into() }
    }

    /// 400 `invalid_request`; the message names the field.
    pub fn invalid(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidRequest, message)
    }

    pub fn order_not_found(order_no: &str) -> Error {
        Error::new(ErrorKind::OrderNotFound, format!("no order with order_no {order_no:?}"))
    }

    pub fn invalid_transition(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidTransition, message)
    }

    pub fn internal(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Internal, message)
    }

    pub fn database_busy() -> Error {
        Error::new(ErrorKind::DatabaseBusy, "the database is busy; retry shortly")
    }

    /// 503 `storage_lost`: a path of the database no longer names the file
    /// payonce has open, so nothing it writes can be trusted to be durable.
    /// Only a restart (which opens the paths afresh) fixes it.
    pub fn storage_lost(why: &str) -> Error {
        Error::new(
            ErrorKind::StorageLost,
            format!("payonce refuses every write: {why}. Restart payonce to fix it (docs/operations.md, \"If payonce says storage_lost\")"),
        )
    }

    /// A business refusal, whose transaction commits: [`ErrorKind::commits`].
    pub fn is_refusal(&self) -> bool {
        self.kind.commits()
    }

    pub fn is_server_error(&self) -> bool {
        self.status >= 500
    }

    /// `{"error":{"code":..,"message":..}}`
    pub fn to_json(&self) -> serde_json::Value {
        json!({"error": {"code": self.code, "message": self.message}})
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.status, self.code, self.message)
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::*;

    /// What today's contract says commits: every 404 and the two business
    /// 409s; `idempotency_key_in_use` is the one 409 that rolls back.
    #[test]
    fn refusals_that_commit() {
        let commits = |kind: ErrorKind| Error::new(kind, "").is_refusal();
        assert!(commits(ErrorKind::OrderNotFound));
        assert!(commits(ErrorKind::InvalidTransition));
        assert!(commits(ErrorKind::OrderNoConflict));
        assert!(!commits(ErrorKind::IdempotencyKeyInUse));
        assert!(!commits(ErrorKind::InvalidRequest));
        assert!(!commits(ErrorKind::Internal));
        assert!(!commits(ErrorKind::StorageLost));
        let err = Error::new(ErrorKind::PaymentNotFound, "x");
        assert_eq!((err.status, err.code), (404, "payment_not_found"));
    }
}
