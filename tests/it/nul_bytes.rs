//! A NUL byte in anything a caller sends (path segments, query parameters,
//! JSON string fields, a statement) is 400 `invalid_request` naming where it
//! was, before it reaches the store: PostgreSQL's text refuses 0x00, and the
//! answer is the same on SQLite. The walk covers every route of the table
//! (`payonce::api::routes()`); a route missing from [`CASES`] fails it.

use crate::util::{request, sign_now, HttpResponse, Server, SECRET};
use serde_json::{json, Value};

/// What a caller controls on one route, besides its path parameters: the
/// query parameters it reads, and its JSON body (valid, so each field can
/// be spoiled alone) with the string fields in it.
struct Case {
    method: &'static str,
    template: &'static str,
    query: &'static [&'static str],
    body: Option<fn() -> Value>,
}

const fn case(method: &'static str, template: &'static str, query: &'static [&'static str]) -> Case {
    Case { method, template, query, body: None }
}

const fn with_body(method: &'static str, template: &'static str, body: fn() -> Value) -> Case {
    Case { method, template, query: &[], body: Some(body) }
}

const PAGE: &[&str] = &["after", "limit"];

const CASES: &[Case] = &[
    case("GET", "/healthz", &[]),
    case("GET", "/metrics", &[]),
    case("GET", "/console", &[]),
    case("GET", "/console/console.js", &[]),
    case("GET", "/console/console.css", &[]),
    with_body("POST", "/v1/orders", || json!({"order_no": "N-1", "user_id": "u1", "amount": 100, "currency": "CNY"})),
    case("GET", "/v1/orders", &["user_id", "status", "after", "limit"]),
    case("GET", "/v1/orders/{order_no}", &[]),
    case("POST", "/v1/orders/{order_no}/close", &[]),
    with_body("POST", "/v1/orders/{order_no}/refund", || json!({"refund_no": "R-1"})),
    with_body("POST", "/v1/orders/{order_no}/refunds", || json!({"refund_no": "R-1", "amount": 1, "reason": "why"})),
    with_body("POST", "/v1/orders/{order_no}/pay", || {
        json!({"channel": "wechatpay", "method": "jsapi", "appid": "wx1", "openid": "o1", "client_ip": "203.0.113.7",
               "return_url": "https://shop.example/", "description": "tea"})
    }),
    case("POST", "/v1/orders/{order_no}/sync", &[]),
    case("GET", "/v1/users/{user_id}/coupons", &[]),
    case("GET", "/v1/users/{user_id}/points", &[]),
    case("GET", "/v1/events", PAGE),
    with_body("POST", "/v1/callbacks/{channel}", payment_notice),
    with_body(
        "POST",
        "/v1/callbacks/{channel}/refund",
        || json!({"refund_no": "R-1", "order_no": "N-1", "status": "SUCCESS"}),
    ),
    case("GET", "/v1/admin/mode", &[]),
    with_body("PUT", "/v1/admin/mode", || json!({"mode": "normal"})),
    case("POST", "/v1/admin/drain", &[]),
    case("GET", "/v1/inspections", &[]),
    case("GET", "/v1/admin/stats", &["window"]),
    with_body("POST", "/v1/admin/payments/{pay_no}/resolve", || json!({"resolution": "refund", "reason": "why"})),
    with_body("POST", "/v1/admin/payments/{pay_no}/refund", || json!({"reason": "why"})),
    with_body("POST", "/v1/admin/refunds/{refund_no}/resolve", || json!({"resolution": "succeeded", "reason": "why"})),
    with_body("POST", "/v1/admin/orders/{order_no}/resolve-close", || json!({"reason": "why"})),
    case("POST", "/v1/reconciliations", &["format", "date", "repair"]),
    with_body(
        "POST",
        "/v1/compensations",
        || json!({"order_no": "N-1", "action": "freeze_coupon", "coupon_template_id": "T-1", "reason": "why"}),
    ),
    case("GET", "/v1/webhooks/deliveries", &["status", "after", "limit"]),
    case("POST", "/v1/webhooks/deliveries/{id}/retry", &[]),
    with_body("POST", "/v1/webhooks/endpoints/enable", || json!({"endpoint": "http://127.0.0.1:9/hook"})),
    with_body("POST", "/v1/webhooks/replay", || json!({"endpoint": "http://127.0.0.1:9/hook", "after_seq": 0})),
];

/// The generic channel's payment notification, every field valid.
fn payment_notice() -> Value {
    let paid_at = "2026-01-01T00:00:00Z";
    json!({"pay_no": "P-1", "order_no": "N-1", "amount": 100, "status": "SUCCESS", "paid_at": paid_at})
}

/// A payonce with every route live: the generic channel, a webhook endpoint.
fn serve(db: &crate::engines::Db) -> Server {
    db.serve_env(&["--webhook-url", "http://127.0.0.1:9/hook"], &[("PAYONCE_WEBHOOK_SECRET", crate::receiver::SECRETS)])
}

/// The template with `{spoiled}` holding a percent-encoded NUL and every
/// other parameter a valid identifier (`generic` for a channel).
fn path_of(template: &str, spoiled: Option<&str>) -> String {
    template
        .split('/')
        .map(|segment| match segment.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
            Some(name) if Some(name) == spoiled => "A%00B".to_owned(),
            Some("channel") => "generic".to_owned(),
            Some("id") => "1".to_owned(),
            Some(_) => "ID-1".to_owned(),
            None => segment.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("/")
}

fn send(server: &Server, method: &str, path: &str, body: &[u8]) -> HttpResponse {
    let signature = sign_now(SECRET, body);
    let mut headers = vec![("Payonce-Signature", signature.as_str())];
    if !body.is_empty() && !path.starts_with("/v1/reconciliations") {
        headers.push(("Content-Type", "application/json"));
    }
    request(server.addr, method, path, &headers, body)
}

/// 400 `invalid_request` whose message names `field`.
fn assert_refused(response: &HttpResponse, what: &str, field: &str) {
    assert!(response.status < 500, "{what}: a {} ({})", response.status, response.text());
    assert_eq!(response.status, 400, "{what}: {}", response.text());
    let error = &response.json()["error"];
    assert_eq!(error["code"], "invalid_request", "{what}: {error}");
    let message = error["message"].as_str().unwrap_or_default();
    assert!(message.contains(field) && message.contains("NUL"), "{what}: the message names {field}: {message}");
}

/// Every string field of a JSON object, as a path of keys.
fn string_fields(value: &Value) -> Vec<String> {
    value.as_object().into_iter().flatten().filter(|(_, v)| v.is_string()).map(|(k, _)| k.clone()).collect()
}

for_each_engine! {
    fn every_route_refuses_a_nul_in_each_string_it_takes(db) {
        let listed: Vec<(String, String)> =
            payonce::api::routes().map(|r| (r.method.to_owned(), r.template.to_owned())).collect();
        for (method, template) in &listed {
            assert!(
                CASES.iter().any(|c| c.method == method && c.template == template),
                "{method} {template} is routed but has no NUL case here"
            );
        }
        assert_eq!(CASES.len(), listed.len(), "a case names a route that is not in the table");
        let server = serve(db);
        let mut checked = 0;
        for case in CASES {
            let body = case.body.map(|b| b().to_string()).unwrap_or_default();
            let params = case.template.split('/').filter_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}')));
            for param in params {
                let path = path_of(case.template, Some(param));
                let what = format!("{} {path}", case.method);
                assert_refused(&send(&server, case.method, &path, body.as_bytes()), &what, param);
                checked += 1;
            }
            // The parameters the route reads, and one it does not.
            for name in case.query.iter().copied().chain(["note"]) {
                let path = format!("{}?{name}=A%00B", path_of(case.template, None));
                let what = format!("{} {path}", case.method);
                assert_refused(&send(&server, case.method, &path, body.as_bytes()), &what, name);
                checked += 1;
            }
            if let Some(valid) = case.body {
                for field in string_fields(&valid()) {
                    let mut spoiled = valid();
                    spoiled[&field] = json!(format!("A\u{0}B"));
                    let path = path_of(case.template, None);
                    let what = format!("{} {path} with a NUL in {field}", case.method);
                    assert_refused(&send(&server, case.method, &path, spoiled.to_string().as_bytes()), &what, &field);
                    checked += 1;
                }
            }
        }
        // A statement (the one body that is not JSON) with a NUL in a row.
        let statement = "pay_no,order_no,amount,status,paid_at\nP\u{0}1,N-1,100,SUCCESS,2026-01-01T00:00:00Z\n";
        let refused = request(
            server.addr,
            "POST",
            "/v1/reconciliations?format=generic",
            &[("Content-Type", "text/csv")],
            statement.as_bytes(),
        );
        assert_refused(&refused, "a statement with a NUL", "statement");
        assert!(checked > 60, "{checked} checks");
        assert_eq!(server.get("/healthz").status, 200, "{}: still serving", db.label());
    }

    /// The reported cases, by name: each a 400 where PostgreSQL answered 500.
    fn the_reported_nul_cases_are_400(db) {
        let server = serve(db);
        let created = server.post_json("/v1/orders", &json!({"order_no": "N-1", "user_id": "u1", "amount": 100}));
        assert_eq!(created.status, 201, "{}", created.text());
        assert_refused(&server.get("/v1/orders?user_id=%00"), "GET /v1/orders?user_id=%00", "user_id");
        let compensation = json!({"order_no": "N\u{0}1", "action": "reverse_points", "reason": "why"});
        assert_refused(&server.post_json("/v1/compensations", &compensation), "compensations order_no", "order_no");
        let resolution = json!({"resolution": "refund", "reason": "why\u{0}"});
        assert_refused(
            &server.post_json("/v1/admin/payments/P-1/resolve", &resolution),
            "payment resolution reason",
            "reason",
        );
        let endpoint = json!({"endpoint": "http://127.0.0.1:9/\u{0}"});
        assert_refused(&server.post_json("/v1/webhooks/endpoints/enable", &endpoint), "endpoint", "endpoint");
        let keyed = request(
            server.addr,
            "POST",
            "/v1/orders",
            &[("Content-Type", "application/json"), ("Idempotency-Key", "k-1")],
            json!({"user_id": "u\u{0}1", "amount": 100}).to_string().as_bytes(),
        );
        assert_refused(&keyed, "a keyed create with a NUL in user_id", "user_id");
        // Nothing of them was stored.
        let orders = server.get("/v1/orders").json();
        assert_eq!(orders["orders"].as_array().map(Vec::len), Some(1), "{orders}");
    }
}
