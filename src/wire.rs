//! The wire formats payonce reads, and the plain HTTP messages they come
//! in: [`Request`] and [`Response`] (no socket; `http.rs` owns that), JSON
//! bodies, query strings and `application/x-www-form-urlencoded` forms;
//! and how an [`Error`] goes on the wire: its status, code and body.
//! Used by `api`, `render` and the channels; knows nothing of routes or the
//! store.

use crate::error::{Error, ErrorKind};
use serde_json::{json, Map, Value};
use std::fmt;

/// How long a client is told to wait after a 503 or a 409 `idempotency_key_in_use`.
pub const RETRY_AFTER_S: u32 = 1;
#[derive(Clone, Debug, Default)]
pub struct Request {
    pub method: String,
    /// The path without the query string, e.g. `/v1/orders/ORD-1`.
    pub path: String,
    /// The raw query string without `?`, possibly empty.
    pub query: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    /// The first header of that name, compared case-insensitively.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// The outcome or error code, for the request log (never re-parsed
    /// from the body).
    pub outcome: Option<&'static str>,
}

impl Response {
    pub fn json(status: u16, value: &Value) -> Response {
        Response {
            status,
            headers: vec![("Content-Type".into(), "application/json".into())],
            body: value.to_string().into_bytes(),
            outcome: None,
        }
    }

    /// The API's answer to `err`: [`status_of`] its kind, the body
    /// [`error_body`], the code as the logged outcome, and `Retry-After`
    /// when the kind asks for it.
    pub fn error(err: &Error) -> Response {
        let kind = err.kind;
        let mut response = Response::json(status_of(kind), &error_body(err)).with_outcome(code_of(kind));
        if kind.retry_after() {
            response.headers.push(("Retry-After".into(), RETRY_AFTER_S.to_string()));
        }
        response
    }

    pub fn with_outcome(mut self, outcome: &'static str) -> Response {
        self.outcome = Some(outcome);
        self
    }

    /// The connection is closed after this answer (its framing or body
    /// cannot be trusted, or the server is stopping).
    pub fn closing(self) -> Response {
        self.with_header("Connection", "close")
    }

    pub fn with_header(mut self, name: &str, value: &str) -> Response {
        self.headers.push((name.into(), value.into()));
        self
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

// ---- errors on the wire ----

/// The HTTP status an error of this kind is answered with. `5xx` only for
/// the server's own faults ([`ErrorKind::is_server_fault`]).
pub fn status_of(kind: ErrorKind) -> u16 {
    use ErrorKind::*;
    match kind {
        InvalidRequest | InvalidJson | InvalidIdempotencyKey | IdempotencyKeyRequired => 400,
        Unauthorized | InvalidSignature | SignatureExpired => 401,
        NotFound | ChannelNotConfigured | OrderNotFound | PaymentNotFound | RefundNotFound | CouponNotFound
        | PointsNotFound | DeliveryNotFound | EndpointNotFound => 404,
        MethodNotAllowed => 405,
        RequestTimeout => 408,
        OrderNoConflict | InvalidTransition | IdempotencyKeyInUse | OrderExpired | PaymentInProgress
        | PaymentConflict | RefundNoConflict | RefundInProgress | RefundExceedsBalance | RefundLimitReached => 409,
        PayloadTooLarge => 413,
        UnsupportedMediaType => 415,
        IdempotencyKeyReused => 422,
        Internal => 500,
        PlatformRefused => 502,
        DatabaseBusy | DatabaseUnavailable | StorageLost | ShuttingDown | PlatformUnavailable => 503,
    }
}

/// The snake_case code of the API's error body (and of the request
/// log's outcome).
pub fn code_of(kind: ErrorKind) -> &'static str {
    use ErrorKind::*;
    match kind {
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
        OrderExpired => "order_expired",
        PaymentInProgress => "payment_in_progress",
        PaymentConflict => "payment_conflict",
        RefundNoConflict => "refund_no_conflict",
        RefundInProgress => "refund_in_progress",
        RefundExceedsBalance => "refund_exceeds_balance",
        RefundLimitReached => "refund_limit_reached",
        PayloadTooLarge => "payload_too_large",
        UnsupportedMediaType => "unsupported_media_type",
        IdempotencyKeyReused => "idempotency_key_reused",
        Internal => "internal_error",
        PlatformRefused => "platform_refused",
        DatabaseBusy => "database_busy",
        DatabaseUnavailable => "database_unavailable",
        StorageLost => "storage_lost",
        ShuttingDown => "shutting_down",
        PlatformUnavailable => "platform_unavailable",
    }
}

/// `{"code":..,"message":..}`, the object inside the API's error body
/// (a failed repair of a reconciliation lists it as it is).
pub fn error_object(err: &Error) -> Value {
    json!({"code": code_of(err.kind), "message": err.message})
}

/// The API's error body (docs/openapi.yaml): `{"error":{"code":..,"message":..}}`.
pub fn error_body(err: &Error) -> Value {
    json!({"error": error_object(err)})
}

/// "status code: message", as log lines and recorded attempts print an
/// error (written here, beside the mapping, so `error.rs` knows no status).
impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", status_of(self.kind), code_of(self.kind), self.message)
    }
}

pub fn check_json_media_type(req: &Request) -> Result<(), Error> {
    let Some(content_type) = req.header("Content-Type") else {
        return Ok(());
    };
    let media_type = content_type.split(';').next().unwrap_or("").trim();
    if media_type.eq_ignore_ascii_case("application/json") {
        Ok(())
    } else {
        Err(Error::new(ErrorKind::UnsupportedMediaType, format!("expected application/json, got {media_type:?}")))
    }
}

/// The body as a JSON object with no fields outside `allowed`.
pub fn json_object(req: &Request, allowed: &[&str]) -> Result<Map<String, Value>, Error> {
    check_json_media_type(req)?;
    let body = parse_object(&req.body)?;
    if let Some(unknown) = body.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(Error::invalid(format!("unknown field {unknown:?}")));
    }
    Ok(body)
}

pub fn parse_object(body: &[u8]) -> Result<Map<String, Value>, Error> {
    // serde_json refuses nesting deeper than 128, so hostile depth is a 400, not a stack overflow.
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => {
            for (key, value) in &map {
                refuse_nul_in_json(key, value)?;
            }
            Ok(map)
        }
        Ok(_) => Err(Error::invalid("the body must be a JSON object")),
        Err(e) => Err(Error::new(ErrorKind::InvalidJson, format!("the body is not valid JSON: {e}"))),
    }
}

/// A NUL byte (`\u0000`) in any string or key of a body is refused here,
/// before any field is read: PostgreSQL's text refuses it, so it would
/// otherwise turn into a 500 wherever the string reaches the store
/// (docs/operations.md, "Someone else's bytes, and NUL bytes").
fn refuse_nul_in_json(field: &str, value: &Value) -> Result<(), Error> {
    let refused = || Error::invalid(format!("{} must not contain a NUL byte", field.escape_debug()));
    if field.contains('\0') {
        return Err(refused());
    }
    match value {
        Value::String(text) if text.contains('\0') => Err(refused()),
        Value::Array(items) => {
            items.iter().enumerate().try_for_each(|(n, item)| refuse_nul_in_json(&format!("{field}[{n}]"), item))
        }
        Value::Object(map) => {
            map.iter().try_for_each(|(key, item)| refuse_nul_in_json(&format!("{field}.{key}"), item))
        }
        _ => Ok(()),
    }
}

/// The first query parameter whose decoded name or value holds a NUL byte,
/// by its name (escaped). Pairs whose percent-encoding is malformed are
/// left to the handler that reads them.
pub fn query_param_with_nul(query: &str) -> Option<String> {
    query.split('&').filter(|pair| !pair.is_empty()).find_map(|pair| {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let key = form_decode(key.as_bytes())?;
        let value = form_decode(value.as_bytes())?;
        (key.contains(&0) || value.contains(&0)).then(|| String::from_utf8_lossy(&key).escape_debug().to_string())
    })
}

pub fn required_str(body: &Map<String, Value>, field: &str) -> Result<String, Error> {
    optional_str(body, field)?.ok_or_else(|| Error::invalid(format!("{field} is required")))
}

pub fn optional_str(body: &Map<String, Value>, field: &str) -> Result<Option<String>, Error> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(Error::invalid(format!("{field} must be a string"))),
    }
}

pub fn required_i64(body: &Map<String, Value>, field: &str) -> Result<i64, Error> {
    optional_i64(body, field)?.ok_or_else(|| Error::invalid(format!("{field} is required")))
}

/// Integers only: `99.0`, `"99"`, `1e3` and out-of-range numbers are refused.
pub fn optional_i64(body: &Map<String, Value>, field: &str) -> Result<Option<i64>, Error> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n
            .as_i64()
            .map(Some)
            .ok_or_else(|| Error::invalid(format!("{field} must be an integer (minor units for money)"))),
        Some(_) => Err(Error::invalid(format!("{field} must be an integer (minor units for money)"))),
    }
}

pub fn parse_query(query: &str) -> Result<Vec<(String, String)>, Error> {
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            Ok((percent_decode(key)?, percent_decode(value)?))
        })
        .collect()
}

pub fn query_value<'q>(query: &'q [(String, String)], name: &str) -> Option<&'q str> {
    query.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str()).filter(|v| !v.is_empty())
}

pub fn query_int(query: &[(String, String)], name: &str, min: i64, max: i64) -> Result<Option<i64>, Error> {
    match query_value(query, name) {
        None => Ok(None),
        Some(text) => match text.parse::<i64>() {
            Ok(n) if (min..=max).contains(&n) => Ok(Some(n)),
            _ => Err(Error::invalid(format!("{name} must be an integer from {min} to {max}"))),
        },
    }
}

fn percent_decode(text: &str) -> Result<String, Error> {
    let bytes =
        form_decode(text.as_bytes()).ok_or_else(|| Error::invalid("malformed percent-encoding in the query string"))?;
    String::from_utf8(bytes).map_err(|_| Error::invalid("the query string is not UTF-8"))
}

/// `application/x-www-form-urlencoded` decoding to bytes: `%XX` (exactly two
/// hex digits) and `+` for space; `None` on a malformed escape. Shared by
/// query strings and Alipay's form bodies.
pub fn form_decode(bytes: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes.get(i + 1..i + 3).filter(|h| h.iter().all(u8::is_ascii_hexdigit))?;
                out.push(u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    Some(out)
}

/// The media type of `Content-Type` (before any `;`), trimmed; `None` without the header.
pub fn media_type(req: &Request) -> Option<&str> {
    req.header("Content-Type").map(|content_type| content_type.split(';').next().unwrap_or("").trim())
}

/// `k=v&k=v` into (key, percent-decoded value bytes), at most `fields_max`
/// pairs; keys are `[A-Za-z0-9_]`. Alipay's notices.
pub fn split_form(body: &[u8], fields_max: usize) -> Result<Vec<(String, Vec<u8>)>, Error> {
    let pairs: Vec<&[u8]> = body.split(|b| *b == b'&').filter(|p| !p.is_empty()).collect();
    if pairs.len() > fields_max {
        return Err(Error::invalid(format!("more than {fields_max} parameters")));
    }
    let decode =
        |bytes: &[u8]| form_decode(bytes).ok_or_else(|| Error::invalid("malformed percent-encoding in the form"));
    pairs
        .into_iter()
        .map(|pair| {
            let (key, value) = match pair.iter().position(|b| *b == b'=') {
                Some(i) => (&pair[..i], &pair[i + 1..]),
                None => (pair, &b""[..]),
            };
            let key = String::from_utf8(decode(key)?)
                .ok()
                .filter(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
                .ok_or_else(|| Error::invalid("a form parameter name is not [A-Za-z0-9_]"))?;
            Ok((key, decode(value)?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kinds' own questions agree with the statuses they are answered
    /// with: a server fault is exactly a 5xx, and `Retry-After` goes with
    /// every 503 and the 409s `idempotency_key_in_use` and `payment_in_progress`.
    #[test]
    fn kinds_agree_with_their_statuses() {
        use ErrorKind::*;
        for &kind in ErrorKind::ALL {
            assert_eq!(kind.is_server_fault(), status_of(kind) >= 500, "{kind:?}");
            let held = matches!(kind, IdempotencyKeyInUse | PaymentInProgress);
            assert_eq!(kind.retry_after(), status_of(kind) == 503 || held, "{kind:?}");
        }
        let err = Error::new(PaymentNotFound, "no payment");
        assert_eq!((status_of(err.kind), code_of(err.kind)), (404, "payment_not_found"));
        assert_eq!(err.to_string(), "404 payment_not_found: no payment");
        assert_eq!(error_body(&err).to_string(), r#"{"error":{"code":"payment_not_found","message":"no payment"}}"#);
    }

    #[test]
    fn query_strings_decode() {
        let q = parse_query("user_id=u%2D1&status=PAID&flag&x=a+b").unwrap_or_default();
        assert_eq!(query_value(&q, "user_id"), Some("u-1"));
        assert_eq!(query_value(&q, "status"), Some("PAID"));
        assert_eq!(query_value(&q, "flag"), None);
        assert_eq!(query_value(&q, "x"), Some("a b"));
        assert!(parse_query("a=%zz").is_err());
        assert!(parse_query("a=%ff").is_err());
        assert!(parse_query("a=%4").is_err());
        assert!(parse_query("a=%+f").is_err());
    }

    #[test]
    fn nul_bytes_are_found_wherever_a_caller_put_them() {
        let refused = |body: &str| parse_object(body.as_bytes()).err().map(|e| e.message);
        assert_eq!(refused(r#"{"reason":"a\u0000b"}"#).as_deref(), Some("reason must not contain a NUL byte"));
        assert_eq!(refused(r#"{"a":{"b":["x","\u0000"]}}"#).as_deref(), Some("a.b[1] must not contain a NUL byte"));
        assert_eq!(refused(r#"{"k\u0000":1}"#).as_deref(), Some("k\\0 must not contain a NUL byte"));
        assert_eq!(refused(r#"{"reason":"\\u0000 is six characters"}"#), None);
        assert_eq!(query_param_with_nul("a=1&user_id=%00"), Some("user_id".to_owned()));
        assert_eq!(query_param_with_nul("a%00b=1"), Some("a\\0b".to_owned()));
        assert_eq!(query_param_with_nul("a=%zz&b=%2500"), None);
    }

    #[test]
    fn integers_are_strict() {
        let check = |body: &str, ok: Option<i64>| {
            let map = parse_object(body.as_bytes()).unwrap_or_default();
            assert_eq!(optional_i64(&map, "amount").ok().flatten(), ok, "{body}");
        };
        check(r#"{"amount":9900}"#, Some(9900));
        check(r#"{"amount":99.0}"#, None);
        check(r#"{"amount":"9900"}"#, None);
        check(r#"{"amount":1e3}"#, None);
        check(r#"{"amount":18446744073709551615}"#, None);
        check(r#"{"amount":true}"#, None);
    }
}
