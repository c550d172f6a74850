//! payonce's one error type. Each error carries the contract's status code,
//! snake_case code and a message for the caller; `5xx` only for the server's
//! own faults.

use serde_json::json;
use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: u16,
    pub code: &'static str,
    pub message: String,
}

impl Error {
    pub fn new(status: u16, code: &'static str, message: impl Into<String>) -> Error {
        Error { status, code, message: message.into() }
    }

    /// 400 `invalid_request`; the message names the field.
    pub fn invalid(message: impl Into<String>) -> Error {
        Error::new(400, "invalid_request", message)
    }

    pub fn order_not_found(order_no: &str) -> Error {
        Error::new(404, "order_not_found", format!("no order with order_no {order_no:?}"))
    }

    pub fn invalid_transition(message: impl Into<String>) -> Error {
        Error::new(409, "invalid_transition", message)
    }

    pub fn internal(message: impl Into<String>) -> Error {
        Error::new(500, "internal_error", message)
    }

    pub fn database_busy() -> Error {
        Error::new(503, "database_busy", "the database is busy; retry shortly")
    }

    /// 503 `storage_lost`: a path of the database no longer names the file
    /// payonce has open, so nothing it writes can be trusted to be durable.
    /// Only a restart (which opens the paths afresh) fixes it.
    pub fn storage_lost(why: &str) -> Error {
        Error::new(
            503,
            "storage_lost",
            format!("payonce refuses every write: {why}. Restart payonce to fix it (docs/operations.md, \"If payonce says storage_lost\")"),
        )
    }

    /// A business refusal: the work ran and said no. Its transaction commits
    /// (an audit row may record the refusal) and, for a keyed request, the
    /// answer is stored and replayed like a success.
    pub fn is_refusal(&self) -> bool {
        self.status == 404 || (self.status == 409 && matches!(self.code, "order_no_conflict" | "invalid_transition"))
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

impl From<rusqlite::Error> for Error {
    fn from(err: rusqlite::Error) -> Error {
        use rusqlite::ErrorCode::{DatabaseBusy, DatabaseLocked};
        match err.sqlite_error_code() {
            Some(DatabaseBusy) | Some(DatabaseLocked) => Error::database_busy(),
            _ => Error::internal(format!("database error: {err}")),
        }
    }
}

impl From<r2d2::Error> for Error {
    fn from(err: r2d2::Error) -> Error {
        // The pool timed out waiting for a connection: the server is saturated.
        Error::new(503, "database_busy", format!("no database connection available: {err}"))
    }
}
