//! The HTTP API as a plain function: [`handle`] takes the app and a parsed
//! [`Request`] and returns a [`Response`]. No socket here (`http.rs` owns
//! that), so every route is testable in process.

use crate::app::{sha256_hex, Answer, App, CreateOrder, PAGE_LIMIT_DEFAULT, PAGE_LIMIT_MAX};
use crate::domain::IdempotencySlot;
use crate::domain::{DeliveryStatus, OrderStatus};
use crate::error::{Error, ErrorKind};
use crate::metrics::ScrapeGauges;
use crate::ops::{Compensation, CompensationAction, Mode, StatsWindow};
use crate::platforms::{reply_outcome, Notice, Notices as Channel, Reply};
use crate::recon::{Format, STATEMENT_BYTES_MAX};
use crate::render;
use crate::services::prepays::PayRequest;
/// What an error kind is answered with: its status and its code. The
/// mapping sits in `wire.rs`, below the channels and `render`, which answer
/// errors too; this is where the API names it.
pub use crate::wire::{code_of, status_of};
use crate::wire::{
    json_object, optional_i64, optional_str, parse_query, query_int, query_value, required_i64, required_str,
};
pub use crate::wire::{Request, Response, RETRY_AFTER_S};
use serde_json::json;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Largest request body accepted by the JSON endpoints.
pub const BODY_BYTES_MAX: usize = 64 * 1024;
/// The one route that takes larger bodies: platform statements.
pub const RECONCILIATIONS_PATH: &str = "/v1/reconciliations";

/// The body limit of a path: 16 MiB for statements, 64 KiB for the rest.
pub fn body_bytes_max(path: &str) -> usize {
    if path == RECONCILIATIONS_PATH {
        STATEMENT_BYTES_MAX
    } else {
        BODY_BYTES_MAX
    }
}
/// How long a request waits for another request holding the same
/// Idempotency-Key before it answers 409 `idempotency_key_in_use`.
pub const IDEMPOTENCY_WAIT_MS_MAX: u64 = 5_000;
/// Idempotency-Key length bounds (printable ASCII).
pub const IDEMPOTENCY_KEY_BYTES_MAX: usize = 255;
/// The caller of requests when no API tokens are configured.
pub const CALLER_ANONYMOUS: &str = "anonymous";

/// Serves one request on a worker thread: routes it, turns a panic into a
/// 500, and counts and logs it. This is what the HTTP edge calls.
pub fn serve(app: &App, req: &Request) -> Response {
    let started = std::time::Instant::now();
    let response = catch_unwind(AssertUnwindSafe(|| handle(app, req))).unwrap_or_else(|_| {
        crate::log::error("handler panicked", &[("method", &req.method), ("path", &req.path)]);
        Response::error(&Error::internal("the request failed inside payonce; it was not applied"))
    });
    observe(app, req, &response, started.elapsed());
    response
}

/// Serves one request on the `--metrics-listen` listener: `GET /metrics`
/// without a token (whoever can reach that address may scrape), 405 for
/// another method on it, 404 for every other path. Counted and logged as
/// [`serve`] does.
pub fn serve_metrics(app: &App, req: &Request) -> Response {
    let started = std::time::Instant::now();
    let answer = catch_unwind(AssertUnwindSafe(|| match (req.method.as_str(), req.path.as_str()) {
        ("GET", METRICS_PATH) => metrics(app),
        (_, METRICS_PATH) => Ok(Response::error(&Error::new(
            ErrorKind::MethodNotAllowed,
            format!("{} is not allowed on {METRICS_PATH}; allowed: GET", req.method),
        ))
        .with_header("Allow", "GET")),
        _ => Err(Error::new(ErrorKind::NotFound, format!("this listener serves only GET {METRICS_PATH}"))),
    }));
    let response = match answer {
        Ok(Ok(response)) => response,
        Ok(Err(err)) => Response::error(&err),
        Err(_) => {
            crate::log::error("handler panicked", &[("method", &req.method), ("path", &req.path)]);
            Response::error(&Error::internal("the request failed inside payonce"))
        }
    };
    observe(app, req, &response, started.elapsed());
    response
}

/// The path of the Prometheus exposition.
pub const METRICS_PATH: &str = "/metrics";

/// The answer to a request the HTTP edge refuses itself (413 before reading,
/// 408, ambiguous framing, shutting down), in the protocol of the route:
/// a payment channel answers in its platform's own. Runs on the edge's
/// runtime, so it never touches the store.
pub fn refuse_at_edge(app: &App, req: &Request, err: &Error) -> Response {
    let response = match find_route(&req.method, &req.path) {
        Found::Route(route, params) if route.template.starts_with("/v1/callbacks/") => {
            with_channel(app, params.first().copied().unwrap_or(""), |chosen| {
                chosen.refuse(err).with_outcome(code_of(err.kind))
            })
        }
        _ => Response::error(err),
    };
    observe(app, req, &response, std::time::Duration::ZERO);
    response
}

fn observe(app: &App, req: &Request, response: &Response, latency: std::time::Duration) {
    let route = route_label(&req.path);
    app.metrics().observe_request(&req.method, route, response.status, latency);
    if crate::log::enabled(crate::log::Level::Info) {
        let latency_ms = format!("{:.3}", latency.as_secs_f64() * 1000.0);
        crate::log::info(
            "request",
            &[
                ("method", &req.method),
                ("route", &route),
                ("status", &response.status),
                ("outcome", &response.outcome.unwrap_or("-")),
                ("latency_ms", &latency_ms),
            ],
        );
    }
}

/// Routes one request. Never panics on any input ([`serve`] still turns a
/// panic into a 500, as a last resort).
pub fn handle(app: &App, req: &Request) -> Response {
    match route(app, req) {
        Ok(response) => response,
        Err(err) => {
            if err.is_server_error() {
                crate::log::error("request failed", &[("method", &req.method), ("path", &req.path), ("error", &err)]);
            }
            Response::error(&err)
        }
    }
}

/// What a handler gets: the request, its path parameters in template order,
/// the caller, and the Idempotency-Key slot its work stores its answer in.
struct Call<'a> {
    app: &'a App,
    req: &'a Request,
    params: &'a [&'a str],
    caller: &'a str,
    slot: Option<&'a IdempotencySlot>,
}

impl Call<'_> {
    fn param(&self, index: usize) -> &str {
        self.params.get(index).copied().unwrap_or("")
    }
}

/// One row of the route table. The table alone decides dispatch, 405s,
/// authentication, Idempotency-Key handling and the metrics label (the
/// template), so no spelling of a path reaches a protected handler without
/// a token.
struct Route {
    method: &'static str,
    template: &'static str,
    needs_token: bool,
    /// Honours `Idempotency-Key` (every POST and PUT under /v1 but callbacks).
    keyed: bool,
    handler: fn(&Call) -> Result<Response, Error>,
}

const fn open(method: &'static str, template: &'static str, handler: fn(&Call) -> Result<Response, Error>) -> Route {
    Route { method, template, needs_token: false, keyed: false, handler }
}

/// A token-protected route; its POSTs and PUTs honour Idempotency-Key.
const fn protected(
    method: &'static str,
    template: &'static str,
    handler: fn(&Call) -> Result<Response, Error>,
) -> Route {
    let keyed = matches!(method.as_bytes(), b"POST" | b"PUT");
    Route { method, template, needs_token: true, keyed, handler }
}

/// A token-protected route that ignores Idempotency-Key.
const fn protected_unkeyed(
    method: &'static str,
    template: &'static str,
    handler: fn(&Call) -> Result<Response, Error>,
) -> Route {
    Route { method, template, needs_token: true, keyed: false, handler }
}

static ROUTE_TABLE: &[Route] = &[
    open("GET", "/healthz", |c| healthz(c.app)),
    // Behind the API token when tokens are configured; `--metrics-listen`
    // serves it without one on a listener of its own ([`serve_metrics`]).
    protected_unkeyed("GET", "/metrics", |c| metrics(c.app)),
    open("GET", "/console", |_| Ok(crate::console::page())),
    open("GET", "/console/console.js", |_| Ok(crate::console::script())),
    open("GET", "/console/console.css", |_| Ok(crate::console::stylesheet())),
    protected("POST", "/v1/orders", |c| create_order(c.app, c.req, c.slot)),
    protected("GET", "/v1/orders", |c| list_orders(c.app, c.req)),
    protected("GET", "/v1/orders/{order_no}", |c| get_order(c.app, c.param(0))),
    protected("POST", "/v1/orders/{order_no}/close", |c| close_order(c.app, c.req, c.param(0), c.slot)),
    protected("POST", "/v1/orders/{order_no}/refund", |c| request_refund(c.app, c.req, c.param(0), c.slot)),
    protected("POST", "/v1/orders/{order_no}/pay", |c| pay_order(c.app, c.req, c.param(0), c.slot)),
    protected("POST", "/v1/orders/{order_no}/refunds", |c| request_refund_amount(c.app, c.req, c.param(0), c.slot)),
    // Never stored under an Idempotency-Key: a replay would repeat a stale platform state.
    protected_unkeyed("POST", "/v1/orders/{order_no}/sync", |c| sync_order(c.app, c.req, c.param(0))),
    protected("GET", "/v1/users/{user_id}/coupons", |c| user_coupons(c.app, c.param(0))),
    protected("GET", "/v1/users/{user_id}/points", |c| user_points(c.app, c.param(0))),
    protected("GET", "/v1/events", |c| events(c.app, c.req)),
    open("POST", "/v1/callbacks/{channel}", |c| Ok(callback(c.app, c.req, c.param(0), false))),
    open("POST", "/v1/callbacks/{channel}/refund", |c| Ok(callback(c.app, c.req, c.param(0), true))),
    protected("GET", "/v1/admin/mode", |c| get_mode(c.app)),
    protected("PUT", "/v1/admin/mode", |c| put_mode(c.app, c.req, c.caller, c.slot)),
    protected("POST", "/v1/admin/drain", |c| drain(c.app, c.req, c.slot)),
    protected("GET", "/v1/inspections", |c| inspections(c.app)),
    protected("GET", "/v1/admin/stats", |c| stats(c.app, c.req)),
    protected("POST", "/v1/admin/payments/{pay_no}/resolve", |c| {
        resolve_payment(c.app, c.req, c.param(0), c.caller, c.slot)
    }),
    protected("POST", "/v1/admin/payments/{pay_no}/refund", |c| {
        refund_payment(c.app, c.req, c.param(0), c.caller, c.slot)
    }),
    protected("POST", "/v1/admin/refunds/{refund_no}/resolve", |c| {
        resolve_refund(c.app, c.req, c.param(0), c.caller, c.slot)
    }),
    protected("POST", "/v1/admin/orders/{order_no}/resolve-close", |c| {
        resolve_close(c.app, c.req, c.param(0), c.caller, c.slot)
    }),
    protected("POST", "/v1/reconciliations", |c| reconciliations(c.app, c.req, c.slot)),
    protected("POST", "/v1/compensations", |c| compensations(c.app, c.req, c.caller, c.slot)),
    protected("GET", "/v1/webhooks/deliveries", |c| webhook_deliveries(c.app, c.req)),
    protected("POST", "/v1/webhooks/deliveries/{id}/retry", |c| {
        retry_webhook_delivery(c.app, c.req, c.param(0), c.caller, c.slot)
    }),
    protected("POST", "/v1/webhooks/endpoints/enable", |c| enable_webhook_endpoint(c.app, c.req, c.caller, c.slot)),
    protected("POST", "/v1/webhooks/replay", |c| replay_webhooks(c.app, c.req, c.caller, c.slot)),
];

/// A route of the table as the outside sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteInfo {
    pub method: &'static str,
    /// `/v1/orders/{order_no}`; also the route's metrics label.
    pub template: &'static str,
    pub needs_token: bool,
    /// Takes an `Idempotency-Key` (stores its answer under it).
    pub keyed: bool,
}

/// Every route, in table order.
pub fn routes() -> impl Iterator<Item = RouteInfo> {
    ROUTE_TABLE.iter().map(|r| RouteInfo {
        method: r.method,
        template: r.template,
        needs_token: r.needs_token,
        keyed: r.keyed,
    })
}

/// Canonical paths only: a leading `/`, no empty, `.` or `..` segment, and
/// no percent-encoded `/`, `.` or `%` (which another component could decode
/// into a different path than the one routed).
fn is_canonical(path: &str) -> bool {
    let Some(rest) = path.strip_prefix('/') else {
        return false;
    };
    rest.split('/').all(|segment| {
        let lower = segment.to_ascii_lowercase();
        !segment.is_empty()
            && segment != "."
            && segment != ".."
            && !lower.contains("%2f")
            && !lower.contains("%2e")
            && !lower.contains("%25")
    })
}

/// What the route table says of a method and path.
enum Found<'p> {
    Route(&'static Route, Vec<&'p str>),
    /// The path is routed, for these methods only.
    MethodNotAllowed(Vec<&'static str>),
    /// An unknown or non-canonical path.
    Nothing,
}

fn find_route<'p>(method: &str, path: &'p str) -> Found<'p> {
    if !is_canonical(path) {
        return Found::Nothing;
    }
    let segments: Vec<&str> = path[1..].split('/').collect();
    let mut allowed = Vec::new();
    for route in ROUTE_TABLE {
        let Some(params) = match_template(route.template, &segments) else {
            continue;
        };
        if route.method == method {
            return Found::Route(route, params);
        }
        allowed.push(route.method);
    }
    if allowed.is_empty() {
        Found::Nothing
    } else {
        Found::MethodNotAllowed(allowed)
    }
}

fn match_template<'p>(template: &str, segments: &[&'p str]) -> Option<Vec<&'p str>> {
    let parts: Vec<&str> = template[1..].split('/').collect();
    if parts.len() != segments.len() {
        return None;
    }
    let mut params = Vec::new();
    for (part, segment) in parts.iter().zip(segments) {
        if part.starts_with('{') {
            params.push(*segment);
        } else if part != segment {
            return None;
        }
    }
    Some(params)
}

/// Authentication and the access-layer Idempotency-Key, both decided by the
/// matched route.
fn route(app: &App, req: &Request) -> Result<Response, Error> {
    let (route, params) = match find_route(&req.method, &req.path) {
        Found::Route(route, params) => (route, params),
        Found::MethodNotAllowed(allowed) => {
            let allowed = allowed.join(", ");
            let message = format!("{} is not allowed on {}; allowed: {allowed}", req.method, req.path);
            return Ok(
                Response::error(&Error::new(ErrorKind::MethodNotAllowed, message)).with_header("Allow", &allowed)
            );
        }
        Found::Nothing => return Err(Error::new(ErrorKind::NotFound, format!("no route for {}", req.path))),
    };
    let caller = if route.needs_token { authenticate(app, req)? } else { CALLER_ANONYMOUS.to_owned() };
    refuse_nul_in_path(route, &params)?;
    if let Err(err) = refuse_nul_bytes(route, req) {
        // A payment channel answers in its platform's own protocol.
        if route.template.starts_with("/v1/callbacks/") {
            let channel = params.first().copied().unwrap_or("");
            return Ok(with_channel(app, channel, |chosen| chosen.refuse(&err).with_outcome(code_of(err.kind))));
        }
        return Err(err);
    }
    let call =
        |slot: Option<&IdempotencySlot>| (route.handler)(&Call { app, req, params: &params, caller: &caller, slot });
    match req.header("Idempotency-Key") {
        Some(raw_key) if route.keyed => with_idempotency_key(app, req, &caller, raw_key, call),
        _ => call(None),
    }
}

/// A path parameter holding a NUL byte, percent-encoded (`%00`) or raw, is
/// 400. Paths are routed undecoded, but a proxy or a later reader may
/// decode it, and PostgreSQL's text refuses 0x00 (docs/operations.md,
/// "Someone else's bytes, and NUL bytes").
fn refuse_nul_in_path(route: &Route, params: &[&str]) -> Result<(), Error> {
    let names = route.template.split('/').filter_map(|part| part.strip_prefix('{').and_then(|p| p.strip_suffix('}')));
    match names.zip(params).find(|(_, value)| value.contains("%00") || value.contains('\0')) {
        Some((name, _)) => Err(Error::invalid(format!("{name} in the path must not contain a NUL byte (%00)"))),
        None => Ok(()),
    }
}

/// A NUL byte in a query parameter, a header or a statement is 400 before
/// any handler runs, on every route, so none reaches the store; JSON bodies
/// are checked where they are parsed (`wire::parse_object`).
fn refuse_nul_bytes(route: &Route, req: &Request) -> Result<(), Error> {
    if let Some(name) = crate::wire::query_param_with_nul(&req.query) {
        return Err(Error::invalid(format!("query parameter {name} must not contain a NUL byte")));
    }
    if let Some((name, _)) = req.headers.iter().find(|(_, value)| value.contains('\0')) {
        return Err(Error::invalid(format!("header {} must not contain a NUL byte", name.escape_debug())));
    }
    if route.template == RECONCILIATIONS_PATH && req.body.contains(&0) {
        return Err(Error::invalid("the statement must not contain a NUL byte"));
    }
    Ok(())
}

/// The caller's name from `Authorization: Bearer <token>` (the scheme is
/// case-insensitive, RFC 9110), compared in constant time with every
/// configured token; `anonymous` without tokens.
fn authenticate(app: &App, req: &Request) -> Result<String, Error> {
    use subtle::ConstantTimeEq;
    let tokens = app.config().api_tokens.current();
    if tokens.is_empty() {
        return Ok(CALLER_ANONYMOUS.to_owned());
    }
    let presented = req
        .header("Authorization")
        .and_then(|h| h.trim_start().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim())
        .unwrap_or("");
    // Compare digests, so the comparison is constant-time whatever the lengths.
    let presented_digest = sha256_hex(presented.as_bytes());
    let mut caller = None;
    for token in tokens.iter() {
        let matches = sha256_hex(token.token.as_bytes()).as_bytes().ct_eq(presented_digest.as_bytes());
        if bool::from(matches) && !presented.is_empty() {
            caller = Some(token.caller.clone());
        }
    }
    caller.ok_or_else(|| {
        Error::new(ErrorKind::Unauthorized, "send Authorization: Bearer <token> with a configured API token")
    })
}

/// First use runs the request and stores its answer with its work; a
/// repeat with the same body replays it; another body is 422; a repeat
/// while the first runs waits for it (bounded) and then replays it.
fn with_idempotency_key(
    app: &App,
    req: &Request,
    caller: &str,
    raw_key: &str,
    run: impl Fn(Option<&IdempotencySlot>) -> Result<Response, Error>,
) -> Result<Response, Error> {
    let key = parse_idempotency_key(raw_key)?;
    let path = if req.query.is_empty() { req.path.clone() } else { format!("{}?{}", req.path, req.query) };
    let scope = format!("{caller} {} {path}", req.method);
    let fingerprint = sha256_hex(&req.body);
    let wait = std::time::Duration::from_millis(IDEMPOTENCY_WAIT_MS_MAX);
    let Some(_key_guard) = app.operations().lock_idempotency_key(&scope, &key, wait) else {
        return Err(key_in_use());
    };
    if let Some(response) = replay(app, &scope, &key, &fingerprint)? {
        return Ok(response);
    }
    let slot = app.operations().idempotency_slot(scope.clone(), key.clone(), fingerprint.clone());
    match run(Some(&slot)) {
        // Another process stored this key between our look-up and our commit.
        Err(e) if e.kind == ErrorKind::IdempotencyKeyInUse => replay(app, &scope, &key, &fingerprint)?.ok_or(e),
        other => other,
    }
}

fn replay(app: &App, scope: &str, key: &str, fingerprint: &str) -> Result<Option<Response>, Error> {
    let Some(stored) = app.operations().stored_response(scope, key)? else {
        return Ok(None);
    };
    if stored.fingerprint != fingerprint {
        return Err(Error::new(
            ErrorKind::IdempotencyKeyReused,
            "this Idempotency-Key was used with a different request body",
        ));
    }
    app.metrics().observe_duplicate("idempotency_key");
    Ok(Some(Response {
        status: stored.status_code,
        headers: vec![
            ("Content-Type".into(), "application/json".into()),
            ("Idempotent-Replayed".into(), "true".into()),
        ],
        body: stored.body,
        outcome: Some("replayed"),
    }))
}

fn key_in_use() -> Error {
    Error::new(
        ErrorKind::IdempotencyKeyInUse,
        format!("a request with this Idempotency-Key is still running after {IDEMPOTENCY_WAIT_MS_MAX} ms; retry later"),
    )
}

/// 1-255 printable ASCII characters; the structured-field string form
/// `"..."` is the same key. Inside the quotes a `"` or `\` would need
/// sf-string escaping, which payonce does not take: such a quoted key is
/// refused rather than guessed at. Unquoted, every printable character is a
/// key character.
pub fn parse_idempotency_key(raw: &str) -> Result<String, Error> {
    let raw = raw.trim_matches(|c| c == ' ' || c == '\t');
    let quoted = raw.len() >= 2 && raw.starts_with('"') && raw.ends_with('"');
    let key = if quoted { &raw[1..raw.len() - 1] } else { raw };
    let printable = key.bytes().all(|b| (0x20..=0x7e).contains(&b));
    let escapes_needed = quoted && (key.contains('"') || key.contains('\\'));
    if key.is_empty() || key.len() > IDEMPOTENCY_KEY_BYTES_MAX || !printable || escapes_needed {
        return Err(Error::new(
            ErrorKind::InvalidIdempotencyKey,
            format!("Idempotency-Key must be 1-{IDEMPOTENCY_KEY_BYTES_MAX} printable ASCII characters (optionally in double quotes)"),
        ));
    }
    Ok(key.to_owned())
}

/// The route template a path matches (`/v1/orders/{order_no}`), for
/// metrics and logs; `other` for unknown paths (bounded label values).
pub fn route_label(path: &str) -> &'static str {
    if !is_canonical(path) {
        return "other";
    }
    let segments: Vec<&str> = path[1..].split('/').collect();
    ROUTE_TABLE.iter().find(|r| match_template(r.template, &segments).is_some()).map_or("other", |r| r.template)
}

// ---- handlers ----

/// An operation's result as the API answers it: the same [`Answer`] a keyed
/// write stored with its work.
fn answered(result: &impl Answer) -> Response {
    let (status, body) = result.answer();
    Response::json(status, &body)
}

fn healthz(app: &App) -> Result<Response, Error> {
    app.operations().health()?;
    Ok(Response::json(200, &json!({"status": "ok"})))
}

fn create_order(app: &App, req: &Request, slot: Option<&IdempotencySlot>) -> Result<Response, Error> {
    let body = json_object(req, &["order_no", "user_id", "amount", "currency", "expires_in_s"])?;
    let order_no = match (optional_str(&body, "order_no")?, slot) {
        (Some(order_no), _) => order_no,
        // The stored answer makes a server-generated order_no exactly-once per key.
        (None, Some(_)) => app.orders().generate_order_no()?,
        (None, None) => {
            return Err(Error::new(
                ErrorKind::IdempotencyKeyRequired,
                "send an order_no or an Idempotency-Key header: the back end never relies on the front end to stop a double click",
            ))
        }
    };
    let create = CreateOrder {
        order_no,
        user_id: required_str(&body, "user_id")?,
        amount: required_i64(&body, "amount")?,
        currency: optional_str(&body, "currency")?.unwrap_or_else(|| "CNY".to_owned()),
        expires_in_s: optional_i64(&body, "expires_in_s")?,
    };
    let result = app.orders().create_order_keyed(&create, slot)?;
    let response = answered(&result);
    Ok(if result.1 { response } else { response.with_header("Idempotent-Replayed", "true") })
}

fn get_order(app: &App, order_no: &str) -> Result<Response, Error> {
    Ok(Response::json(200, &app.orders().order(order_no)?.to_json()))
}

fn list_orders(app: &App, req: &Request) -> Result<Response, Error> {
    let query = parse_query(&req.query)?;
    let user_id = query_value(&query, "user_id");
    let status = match query_value(&query, "status") {
        None => None,
        Some(s) => Some(
            OrderStatus::parse(s)
                .ok_or_else(|| Error::invalid("status must be one of PENDING, PAID, CLOSED, REFUNDING, REFUNDED"))?,
        ),
    };
    let after = query_int(&query, "after", 0, i64::MAX)?;
    let limit = page_limit(&query)?;
    let (orders, next) = app.orders().list_orders(user_id, status, after, limit)?;
    Ok(Response::json(200, &render::orders(&orders, next)))
}

fn close_order(app: &App, req: &Request, order_no: &str, slot: Option<&IdempotencySlot>) -> Result<Response, Error> {
    if !req.body.is_empty() {
        json_object(req, &[])?;
    }
    Ok(answered(&app.orders().close_order_keyed(order_no, slot)?))
}

fn pay_order(app: &App, req: &Request, order_no: &str, slot: Option<&IdempotencySlot>) -> Result<Response, Error> {
    let fields = ["channel", "method", "appid", "openid", "client_ip", "return_url", "description"];
    let body = json_object(req, &fields)?;
    let request = PayRequest {
        channel: required_str(&body, "channel")?,
        method: required_str(&body, "method")?,
        appid: optional_str(&body, "appid")?,
        openid: optional_str(&body, "openid")?,
        client_ip: optional_str(&body, "client_ip")?,
        return_url: optional_str(&body, "return_url")?,
        description: optional_str(&body, "description")?,
    };
    Ok(answered(&app.prepays().pay(order_no, &request, slot)?))
}

fn request_refund_amount(
    app: &App,
    req: &Request,
    order_no: &str,
    slot: Option<&IdempotencySlot>,
) -> Result<Response, Error> {
    let body = json_object(req, &["refund_no", "amount", "reason"])?;
    let refund_no = required_str(&body, "refund_no")?;
    let amount = optional_i64(&body, "amount")?;
    let reason = optional_str(&body, "reason")?;
    let asked = app.refunds().request_refund_amount(order_no, &refund_no, amount, reason.as_deref(), slot)?;
    Ok(answered(&asked))
}

fn request_refund(app: &App, req: &Request, order_no: &str, slot: Option<&IdempotencySlot>) -> Result<Response, Error> {
    let body = json_object(req, &["refund_no"])?;
    let refund_no = required_str(&body, "refund_no")?;
    Ok(answered(&app.refunds().request_refund_keyed(order_no, &refund_no, slot)?))
}

fn resolve_close(
    app: &App,
    req: &Request,
    order_no: &str,
    caller: &str,
    slot: Option<&IdempotencySlot>,
) -> Result<Response, Error> {
    let reason = reason_body(req)?;
    Ok(answered(&app.platform_calls().resolve_close(order_no, &reason, caller, slot)?))
}

fn sync_order(app: &App, req: &Request, order_no: &str) -> Result<Response, Error> {
    if !req.body.is_empty() {
        json_object(req, &[])?;
    }
    Ok(Response::json(200, &render::synced(&app.platform_calls().sync_order(order_no)?)))
}

/// A path segment that must be an identifier, e.g. `{user_id}`.
fn path_identifier<'a>(value: &'a str, name: &str) -> Result<&'a str, Error> {
    if crate::domain::is_identifier(value) {
        Ok(value)
    } else {
        Err(Error::invalid(format!("{name} in the path must be 1-64 characters of [A-Za-z0-9_.-]")))
    }
}

fn user_coupons(app: &App, user_id: &str) -> Result<Response, Error> {
    let user_id = path_identifier(user_id, "user_id")?;
    Ok(Response::json(200, &render::user_coupons(&app.orders().user_coupons(user_id)?)))
}

fn user_points(app: &App, user_id: &str) -> Result<Response, Error> {
    let user_id = path_identifier(user_id, "user_id")?;
    let (balance, entries) = app.orders().user_points(user_id)?;
    Ok(Response::json(200, &render::user_points(balance, &entries)))
}

fn events(app: &App, req: &Request) -> Result<Response, Error> {
    let query = parse_query(&req.query)?;
    let after = query_int(&query, "after", 0, i64::MAX)?.unwrap_or(0);
    let limit = page_limit(&query)?;
    let rows = app.orders().events(after, limit)?;
    let next_after = rows.last().map_or(after, |e| e.seq);
    Ok(Response::json(200, &render::events(&rows, next_after)))
}

// ---- payment channels ----

/// `POST /v1/callbacks/{channel}` and `/v1/callbacks/{channel}/refund`: the
/// channel verifies and maps the notification, the app delivers it, the
/// channel answers in its platform's protocol.
fn callback(app: &App, req: &Request, channel: &str, refund_route: bool) -> Response {
    with_channel(app, channel, |chosen| {
        match chosen.parse(app.clock().now_ms(), req, refund_route).and_then(|notice| deliver(app, notice)) {
            Ok(reply) => chosen.acknowledge(&reply).with_outcome(reply_outcome(&reply)),
            Err(err) => {
                if err.is_server_error() {
                    crate::log::error("callback failed", &[("channel", &channel), ("error", &err)]);
                }
                chosen.refuse(&err).with_outcome(code_of(err.kind))
            }
        }
    })
}

/// Runs `f` with the configured channel of that name; 404
/// `channel_not_configured` otherwise.
fn with_channel(app: &App, channel: &str, f: impl FnOnce(&dyn Channel) -> Response) -> Response {
    match app.payments().channel(channel) {
        Some(chosen) => f(chosen),
        None => Response::error(&Error::new(
            ErrorKind::ChannelNotConfigured,
            format!("payment channel {channel:?} is not configured"),
        )),
    }
}

fn deliver(app: &App, notice: Notice) -> Result<Reply, Error> {
    Ok(match notice {
        Notice::Payment(cb) => Reply::Payment(app.payments().deliver_payment(&cb)?),
        Notice::Refund(cb) => Reply::Refund(app.refunds().deliver_refund(&cb)?),
        Notice::RefundInFlight(cb) => Reply::Refund(app.refunds().deliver_refund_in_flight(&cb)?),
        Notice::Ignored(_) => Reply::Ignored,
    })
}

// ---- operations ----

fn metrics(app: &App) -> Result<Response, Error> {
    let (webhook_pending, webhook_oldest_pending_s) = app.webhooks().webhook_pending()?;
    let gauges = ScrapeGauges {
        record_only: app.operations().mode()? == Mode::RecordOnly,
        received_waiting: app.operations().received_waiting()?,
        key_locks: app.operations().key_locks_held(),
        group_commit: app.operations().group_commit_totals().unwrap_or((0, 0)),
        group_commit_reruns: app.operations().group_commit_reruns(),
        webhook_pending,
        webhook_oldest_pending_s,
        platform_calls_pending: app.platform_calls().pending()?,
        key_expires_in_s: app.operations().key_expires_in_s(),
        wechatpay_cert_downloads: app.operations().wechatpay_cert_downloads(),
    };
    Ok(Response {
        status: 200,
        headers: vec![("Content-Type".into(), "text/plain; version=0.0.4; charset=utf-8".into())],
        body: app.metrics().render(&gauges).into_bytes(),
        outcome: None,
    })
}

fn get_mode(app: &App) -> Result<Response, Error> {
    Ok(Response::json(200, &render::mode(app.operations().mode()?)))
}

fn put_mode(app: &App, req: &Request, caller: &str, slot: Option<&IdempotencySlot>) -> Result<Response, Error> {
    let body = json_object(req, &["mode"])?;
    let mode = required_str(&body, "mode")?;
    let mode = Mode::parse(&mode).ok_or_else(|| Error::invalid("mode must be normal or record_only"))?;
    Ok(answered(&app.operations().set_mode(mode, caller, slot)?))
}

fn drain(app: &App, req: &Request, slot: Option<&IdempotencySlot>) -> Result<Response, Error> {
    if !req.body.is_empty() {
        json_object(req, &[])?;
    }
    Ok(answered(&app.operations().drain_keyed(slot)?))
}

// ---- webhooks ----

fn webhook_deliveries(app: &App, req: &Request) -> Result<Response, Error> {
    let query = parse_query(&req.query)?;
    let status = match query_value(&query, "status") {
        None => None,
        Some(s) => Some(
            DeliveryStatus::parse(s)
                .ok_or_else(|| Error::invalid("status must be one of pending, delivered, failed, disabled"))?,
        ),
    };
    let after = query_int(&query, "after", 0, i64::MAX)?.unwrap_or(0);
    let limit = page_limit(&query)?;
    Ok(Response::json(200, &render::deliveries(&app.webhooks().webhook_deliveries(status, after, limit)?)))
}

fn retry_webhook_delivery(
    app: &App,
    req: &Request,
    id: &str,
    caller: &str,
    slot: Option<&IdempotencySlot>,
) -> Result<Response, Error> {
    if !req.body.is_empty() {
        json_object(req, &[])?;
    }
    // Ids are positive integers; any other spelling names no delivery.
    let id = id
        .parse::<i64>()
        .ok()
        .filter(|parsed| *parsed > 0 && parsed.to_string() == id)
        .ok_or_else(|| Error::new(ErrorKind::DeliveryNotFound, format!("no webhook delivery with id {id:?}")))?;
    Ok(answered(&app.webhooks().retry_webhook_delivery(id, caller, slot)?))
}

fn enable_webhook_endpoint(
    app: &App,
    req: &Request,
    caller: &str,
    slot: Option<&IdempotencySlot>,
) -> Result<Response, Error> {
    let body = json_object(req, &["endpoint"])?;
    let endpoint = required_str(&body, "endpoint")?;
    Ok(answered(&app.webhooks().enable_webhook_endpoint(&endpoint, caller, slot)?))
}

fn replay_webhooks(app: &App, req: &Request, caller: &str, slot: Option<&IdempotencySlot>) -> Result<Response, Error> {
    let body = json_object(req, &["endpoint", "after_seq", "until_seq"])?;
    let endpoint = required_str(&body, "endpoint")?;
    let after_seq = required_i64(&body, "after_seq")?;
    let until_seq = optional_i64(&body, "until_seq")?;
    Ok(answered(&app.webhooks().replay_webhooks(&endpoint, after_seq, until_seq, caller, slot)?))
}

/// `?window=1h|24h`, required.
fn stats(app: &App, req: &Request) -> Result<Response, Error> {
    let query = parse_query(&req.query)?;
    let given = query.iter().filter(|(name, _)| name == "window").count();
    let window = query_value(&query, "window")
        .filter(|_| given == 1)
        .and_then(StatsWindow::parse)
        .ok_or_else(|| Error::invalid("window must be given once, as 1h or 24h"))?;
    Ok(Response::json(200, &render::stats(&app.operations().stats(window)?)))
}

fn inspections(app: &App) -> Result<Response, Error> {
    Ok(Response::json(200, &render::inspection(&app.operations().inspect()?)))
}

/// `{"reason"}` of resolve-close and of a payment's refund.
fn reason_body(req: &Request) -> Result<String, Error> {
    required_str(&json_object(req, &["reason"])?, "reason")
}

/// `{"resolution","reason"}` of both resolve endpoints.
fn resolution_body(req: &Request) -> Result<(String, String), Error> {
    let body = json_object(req, &["resolution", "reason"])?;
    Ok((required_str(&body, "resolution")?, required_str(&body, "reason")?))
}

fn resolve_payment(
    app: &App,
    req: &Request,
    pay_no: &str,
    caller: &str,
    slot: Option<&IdempotencySlot>,
) -> Result<Response, Error> {
    let (resolution, reason) = resolution_body(req)?;
    Ok(answered(&app.payments().resolve_payment(pay_no, &resolution, &reason, caller, slot)?))
}

/// `{"reason"}`: the whole payment returned at its platform.
fn refund_payment(
    app: &App,
    req: &Request,
    pay_no: &str,
    caller: &str,
    slot: Option<&IdempotencySlot>,
) -> Result<Response, Error> {
    let reason = reason_body(req)?;
    Ok(answered(&app.refunds().refund_payment(pay_no, &reason, caller, slot)?))
}

fn resolve_refund(
    app: &App,
    req: &Request,
    refund_no: &str,
    caller: &str,
    slot: Option<&IdempotencySlot>,
) -> Result<Response, Error> {
    let (resolution, reason) = resolution_body(req)?;
    Ok(answered(&app.refunds().resolve_refund(refund_no, &resolution, &reason, caller, slot)?))
}

fn compensations(app: &App, req: &Request, caller: &str, slot: Option<&IdempotencySlot>) -> Result<Response, Error> {
    let body = json_object(req, &["order_no", "action", "coupon_template_id", "reason"])?;
    let action = match required_str(&body, "action")?.as_str() {
        "freeze_coupon" => {
            CompensationAction::FreezeCoupon { coupon_template_id: required_str(&body, "coupon_template_id")? }
        }
        "reverse_points" => CompensationAction::ReversePoints,
        _ => return Err(Error::invalid("action must be freeze_coupon or reverse_points")),
    };
    let compensation =
        Compensation { order_no: required_str(&body, "order_no")?, action, reason: required_str(&body, "reason")? };
    Ok(answered(&app.operations().compensate(&compensation, caller, slot)?))
}

fn reconciliations(app: &App, req: &Request, slot: Option<&IdempotencySlot>) -> Result<Response, Error> {
    if let Some(media_type) = crate::wire::media_type(req) {
        let media_type = media_type.to_ascii_lowercase();
        if !media_type.starts_with("text/") && media_type != "application/csv" {
            return Err(Error::new(
                ErrorKind::UnsupportedMediaType,
                format!("a statement is sent as a text media type (text/csv), got {media_type:?}"),
            ));
        }
    }
    let query = parse_query(&req.query)?;
    let format = match query_value(&query, "format") {
        None => Format::Generic,
        Some(f) => Format::parse(f).ok_or_else(|| Error::invalid("format must be generic, wechatpay or alipay"))?,
    };
    let repair = match query_value(&query, "repair") {
        None | Some("false") => false,
        Some("true") => true,
        Some(_) => return Err(Error::invalid("repair must be true or false")),
    };
    let date = query_value(&query, "date");
    let (status, body) = app
        .operations()
        .reconcile_keyed(format, &req.body, date, repair, slot)?
        .into_answer_body(&mut release_freed_memory);
    if req.body.len() >= RELEASE_AFTER_STATEMENT_BYTES_MIN {
        release_freed_memory();
    }
    Ok(Response { status, headers: vec![("Content-Type".into(), "application/json".into())], body, outcome: None })
}

/// A statement at least this large is followed by [`release_freed_memory`].
const RELEASE_AFTER_STATEMENT_BYTES_MIN: usize = 1024 * 1024;

/// Gives the memory a large statement's comparison freed back to the
/// system. glibc keeps freed memory in its per-thread arenas for reuse, so
/// without this the peak of the largest statement a worker ever compared
/// stays resident for the life of the process (docs/performance.md,
/// "Reconciliation memory"). `malloc_trim` walks the arenas once, which is
/// negligible next to comparing a statement of a megabyte.
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory of the allocator's own
    // arenas to the kernel; it touches no live allocation.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// `limit`: default 100; values above 1000 are served as 1000.
fn page_limit(query: &[(String, String)]) -> Result<usize, Error> {
    let limit = query_int(query, "limit", 1, i64::MAX)?;
    Ok(limit.map_or(PAGE_LIMIT_DEFAULT, |n| usize::try_from(n).unwrap_or(PAGE_LIMIT_MAX).min(PAGE_LIMIT_MAX)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idempotency_keys() {
        let check = |raw: &str, expected: Option<&str>| {
            assert_eq!(parse_idempotency_key(raw).ok().as_deref(), expected, "{raw:?}");
        };
        check("abc-123", Some("abc-123"));
        check("\"abc-123\"", Some("abc-123"));
        check("has space", Some("has space"));
        check(&"k".repeat(255), Some(&"k".repeat(255)));
        check(&"k".repeat(256), None);
        check("", None);
        check("\"\"", None);
        check("caf\u{e9}", None);
        check("tab\there", None);
        check("\"a\"b\"", None);
        check("\"back\\slash\"", None);
        check("back\\slash", Some("back\\slash"));
        check("a\"b", Some("a\"b"));
    }
}
