//! payonce's one error type. Each error has an [`ErrorKind`], which alone
//! decides whether the work that refused commits and whether it is the
//! server's own fault; the message is for the caller. Its status code and
//! snake_case code on the wire are `wire.rs`'s (`wire::status_of`,
//! `wire::code_of`, re-exported by `api`): the core speaks kinds.

/// Declares [`ErrorKind`] and its [`ErrorKind::ALL`] from one list.
macro_rules! error_kinds {
    ($(#[$meta:meta])* { $($kind:ident,)* }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum ErrorKind {
            $($kind,)*
        }

        impl ErrorKind {
            /// Every kind, in declaration order (for tests that walk them all).
            pub const ALL: &'static [ErrorKind] = &[$(ErrorKind::$kind,)*];
        }
    };
}

error_kinds! {
    /// Every refusal payonce answers. Adding one means answering the
    /// exhaustive matches: here, whether its transaction commits
    /// ([`ErrorKind::commits`]) and whether it is the server's fault
    /// ([`ErrorKind::is_server_fault`]); in `wire.rs`, its status and its code.
    /// The status each group of variants is answered with heads it.
    {
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
        OrderExpired,
        PaymentInProgress,
        PaymentConflict,
        RefundNoConflict,
        RefundInProgress,
        RefundExceedsBalance,
        RefundLimitReached,
        // 413, 415, 422
        PayloadTooLarge,
        UnsupportedMediaType,
        IdempotencyKeyReused,
        // 500, 502
        Internal,
        PlatformRefused,
        // 503
        DatabaseBusy,
        DatabaseUnavailable,
        StorageLost,
        ShuttingDown,
        PlatformUnavailable,
    }
}

/// What an error means for the work that raised it, the one question every
/// kind answers (by exhaustive `match`, in [`ErrorKind::disposition`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Disposition {
    /// A business refusal: the work ran and said no. Its transaction
    /// commits (an audit row may record the refusal) and, for a keyed
    /// request, the answer is stored and replayed like a success.
    Refusal,
    /// Refused before or beside the work: nothing of it may stay.
    Rejected,
    /// The server's own fault, never the caller's: logged, rolled back, and
    /// answered as one (`wire::status_of` gives each a 5xx).
    ServerFault,
}

impl ErrorKind {
    pub fn disposition(self) -> Disposition {
        use ErrorKind::*;
        match self {
            // The thing asked for is not there; the work wrote nothing but may audit.
            NotFound | ChannelNotConfigured | OrderNotFound | PaymentNotFound | RefundNotFound | CouponNotFound
            | PointsNotFound | DeliveryNotFound | EndpointNotFound => Disposition::Refusal,
            // The refusal is the answer, and its audit row must stay.
            OrderNoConflict | InvalidTransition | OrderExpired | PaymentConflict | RefundNoConflict
            | RefundInProgress | RefundExceedsBalance | RefundLimitReached => Disposition::Refusal,
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
            | PaymentInProgress
            | PayloadTooLarge
            | UnsupportedMediaType
            | IdempotencyKeyReused => Disposition::Rejected,
            // A platform's refusal is not the caller's fault either, and is
            // never kept: the next request asks the platform again.
            Internal | PlatformRefused | DatabaseBusy | DatabaseUnavailable | StorageLost | ShuttingDown
            | PlatformUnavailable => Disposition::ServerFault,
        }
    }

    /// A business refusal ([`Disposition::Refusal`]): its transaction
    /// commits and a keyed request stores its answer. Every other error
    /// rolls the work back and stores nothing.
    pub fn commits(self) -> bool {
        self.disposition() == Disposition::Refusal
    }

    /// [`Disposition::ServerFault`].
    pub fn is_server_fault(self) -> bool {
        self.disposition() == Disposition::ServerFault
    }

    /// The same request is worth sending again shortly, and the client is
    /// told when: the server is unavailable ([`ErrorKind::is_unavailable`]),
    /// or a key (or a payment's creation) another request still holds.
    pub fn retry_after(self) -> bool {
        self.is_unavailable() || matches!(self, ErrorKind::IdempotencyKeyInUse | ErrorKind::PaymentInProgress)
    }

    /// The server cannot serve now (every server fault but `Internal`,
    /// its bug, and a platform's refusal, its answer): the database or a
    /// platform is busy or gone, the storage lost, or payonce is stopping.
    pub fn is_unavailable(self) -> bool {
        self.is_server_fault() && !matches!(self, ErrorKind::Internal | ErrorKind::PlatformRefused)
    }
}

/// A kind and a message for the caller. How it goes on the wire (status,
/// code, the JSON body, and its `Display`: "status code: message", the
/// form of the log lines) is `wire.rs`'s.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub kind: ErrorKind,
    pub message: String,
}

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error { kind, message: message.into() }
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

    /// [`ErrorKind::is_server_fault`].
    pub fn is_server_error(&self) -> bool {
        self.kind.is_server_fault()
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
        assert_eq!((err.kind, err.message.as_str()), (ErrorKind::PaymentNotFound, "x"));
    }
}
