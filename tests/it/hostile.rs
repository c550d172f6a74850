//! Hostile input against the real binary: no input that reaches payonce
//! makes it panic, hang, or lose data it already acknowledged; 4xx for the
//! caller's mistakes, 5xx only for the server's (docs/openapi.yaml).
//! After every batch the server must still answer /healthz and still create
//! and pay an order. Attacks on the HTTP framing itself are in `edge.rs`.

use crate::util::{self, count, read_only, HttpResponse, Rng, Server, SECRET};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

const BODY_MAX: usize = 64 * 1024;
const JSON: (&str, &str) = ("Content-Type", "application/json");

/// The POST routes of docs/openapi.yaml, with a payment/refund target that exists.
const POST_ROUTES: [&str; 5] = [
    "/v1/orders",
    "/v1/orders/H-TARGET/close",
    "/v1/orders/H-TARGET/refund",
    "/v1/callbacks/generic",
    "/v1/callbacks/generic/refund",
];

fn start() -> Server {
    let server = Server::start(&["--coupon", "NEW10", "--points-per-yuan", "1"]);
    let resp = server.post_json("/v1/orders", &json!({"order_no": "H-TARGET", "user_id": "victim", "amount": 500}));
    assert_eq!(resp.status, 201, "{}", resp.text());
    server
}

/// The server answers /healthz and still creates and pays an order exactly once.
fn assert_healthy(server: &Server, after: &str) {
    static N: AtomicU64 = AtomicU64::new(0);
    let health = server.get("/healthz");
    assert_eq!(health.status, 200, "healthz after {after}: {}", health.text());
    assert_eq!(health.json(), json!({"status": "ok"}));
    let n = N.fetch_add(1, Ordering::SeqCst);
    let order_no = format!("HEALTHY-{n}");
    let resp = server.post_json("/v1/orders", &json!({"order_no": order_no, "user_id": "ok-user", "amount": 1234}));
    assert_eq!(resp.status, 201, "create after {after}: {}", resp.text());
    let callback =
        json!({"pay_no": format!("HEALTHY-PAY-{n}"), "order_no": order_no, "amount": 1234, "status": "SUCCESS"});
    for expected in ["applied", "duplicate"] {
        let resp = server.callback("/v1/callbacks/generic", &callback);
        assert_eq!(resp.status, 200, "pay after {after}: {}", resp.text());
        assert_eq!(resp.json()["outcome"], expected, "pay after {after}");
    }
    let detail = server.get(&format!("/v1/orders/{order_no}")).json();
    assert_eq!(detail["status"], "PAID", "after {after}: {detail}");
    assert_eq!(detail["coupons"].as_array().map(Vec::len), Some(1), "after {after}: {detail}");
    assert_eq!(detail["points"].as_array().map(Vec::len), Some(1), "after {after}: {detail}");
}

/// A POST with `body`; callbacks are signed with the test secret when `sign`.
fn post(server: &Server, path: &str, content_type: &str, body: &[u8], sign: bool) -> HttpResponse {
    let signature = util::sign_now(SECRET, body);
    let mut headers = vec![("Content-Type", content_type)];
    if sign {
        headers.push(("Payonce-Signature", signature.as_str()));
    }
    util::request(server.addr, "POST", path, &headers, body)
}

fn is_callback(path: &str) -> bool {
    path.starts_with("/v1/callbacks/")
}

/// A 4xx from payonce itself: the contract's error body.
fn assert_client_error(resp: &HttpResponse, context: &str) {
    assert!((400..500).contains(&resp.status), "{context}: {} {}", resp.status, resp.text());
    let body: Value = serde_json::from_slice(&resp.body)
        .unwrap_or_else(|e| panic!("{context}: error body is not JSON ({e}): {}", resp.text()));
    assert!(body["error"]["code"].as_str().is_some_and(|c| !c.is_empty()), "{context}: {body}");
}

/// Never a 5xx; a 4xx carries the contract's error body.
fn assert_no_server_error(resp: &HttpResponse, context: &str) {
    assert!(resp.status < 500, "{context}: {} {}", resp.status, resp.text());
    if resp.status >= 400 {
        assert_client_error(resp, context);
    }
}

fn expect(resp: &HttpResponse, status: u16, code: &str, context: &str) {
    assert_eq!(resp.status, status, "{context}: {}", resp.text());
    assert_eq!(resp.error_code(), code, "{context}");
}

/// Raw bytes; if anything came back that parses as HTTP, it is not a 5xx.
fn raw_no_5xx(addr: SocketAddr, bytes: &[u8], context: &str) {
    let answer = util::raw(addr, bytes);
    if let Some(resp) = util::parse_response(&answer) {
        assert!(resp.status < 500, "{context}: {} {}", resp.status, resp.text());
    }
}

fn chunked(path: &str, headers: &str, chunks: &[&[u8]]) -> Vec<u8> {
    let mut bytes =
        format!("POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n{headers}\r\n")
            .into_bytes();
    for chunk in chunks {
        bytes.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        bytes.extend_from_slice(chunk);
        bytes.extend_from_slice(b"\r\n");
    }
    bytes.extend_from_slice(b"0\r\n\r\n");
    bytes
}

#[test]
fn oversized_bodies_are_413_with_content_length_and_chunked() {
    let server = start();
    let big = vec![b' '; BODY_MAX + 1];
    for path in POST_ROUTES {
        for size in [BODY_MAX + 1, BODY_MAX * 4, 1 << 20] {
            let body = vec![b'7'; size];
            expect(
                &post(&server, path, "application/json", &body, true),
                413,
                "payload_too_large",
                &format!("{path} {size}"),
            );
        }
        // Chunked, no declared length: the limit holds while reading.
        let chunk = vec![b' '; 8 * 1024];
        let chunks: Vec<&[u8]> = std::iter::repeat_n(chunk.as_slice(), 9).collect();
        let answer = util::raw(server.addr, &chunked(path, "Content-Type: application/json\r\n", &chunks));
        let resp = util::parse_response(&answer).unwrap_or_else(|| panic!("no answer to chunked {path}"));
        expect(&resp, 413, "payload_too_large", &format!("chunked {path}"));
    }
    // A JSON body padded to exactly 64 KiB is within the limit; one byte more is not.
    let core = json!({"order_no": "H-EXACT", "user_id": "u", "amount": 1}).to_string();
    let mut exact = core.clone().into_bytes();
    exact.resize(BODY_MAX, b' ');
    let resp = post(&server, "/v1/orders", "application/json", &exact, false);
    assert_eq!(resp.status, 201, "a 64 KiB body is allowed: {}", resp.text());
    let mut over = core.into_bytes();
    over.resize(BODY_MAX + 1, b' ');
    expect(&post(&server, "/v1/orders", "application/json", &over, false), 413, "payload_too_large", "64 KiB + 1");
    expect(&post(&server, "/v1/orders", "application/json", &big, false), 413, "payload_too_large", "spaces");
    // A declared length over the limit with a short body: refused before reading.
    let mut lying = b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: 10000000\r\n\r\n".to_vec();
    lying.extend_from_slice(b"{\"order_no\":");
    let resp = util::parse_response(&util::raw(server.addr, &lying)).expect("an answer to a lying Content-Length");
    expect(&resp, 413, "payload_too_large", "declared 10 MB");
    // Chunked and small is an ordinary request.
    let body = json!({"order_no": "H-CHUNKED", "user_id": "u", "amount": 1}).to_string();
    let (a, b) = body.as_bytes().split_at(10);
    let resp = util::parse_response(&util::raw(
        server.addr,
        &chunked("/v1/orders", "Content-Type: application/json\r\n", &[a, b]),
    ))
    .expect("an answer to a small chunked request");
    assert_eq!(resp.status, 201, "{}", resp.text());
    assert_eq!(
        count(&read_only(&server.db), "SELECT count(*) FROM orders", []),
        3,
        "no oversized request created anything"
    );
    assert_healthy(&server, "oversized bodies");
}

#[test]
fn malformed_and_deeply_nested_json_are_400() {
    let server = start();
    let deep_arrays = "[".repeat(60_000);
    let deep_objects = "{\"a\":".repeat(10_000);
    let deep_closed = format!("{}{}", "[".repeat(5_000), "]".repeat(5_000));
    let deep_in_field =
        format!("{{\"order_no\":\"H-D\",\"user_id\":\"u\",\"amount\":{}1{}}}", "[".repeat(20_000), "]".repeat(20_000));
    let malformed: Vec<(&str, Vec<u8>)> = vec![
        ("empty", b"".to_vec()),
        ("open brace", b"{".to_vec()),
        ("missing value", b"{\"a\":}".to_vec()),
        ("single quotes", b"{'order_no':'x'}".to_vec()),
        ("trailing garbage", b"{} x".to_vec()),
        ("trailing comma", b"{\"a\":1,}".to_vec()),
        ("bare word", b"nul".to_vec()),
        ("NaN", b"{\"amount\":NaN}".to_vec()),
        ("Infinity", b"{\"amount\":Infinity}".to_vec()),
        ("hex number", b"{\"amount\":0x10}".to_vec()),
        ("leading zeros", b"{\"amount\":0100}".to_vec()),
        ("invalid UTF-8", b"{\"order_no\":\"\xff\xfe\"}".to_vec()),
        ("lone surrogate", b"{\"order_no\":\"\\ud800\"}".to_vec()),
        ("raw NUL in string", b"{\"order_no\":\"a\x00b\"}".to_vec()),
        ("raw newline in string", b"{\"order_no\":\"a\nb\"}".to_vec()),
        ("BOM", b"\xef\xbb\xbf{}".to_vec()),
        ("comment", b"{/* */}".to_vec()),
        ("two objects", b"{}{}".to_vec()),
        ("deep arrays", deep_arrays.into_bytes()),
        ("deep objects", deep_objects.into_bytes()),
        ("deep but closed", deep_closed.into_bytes()),
        ("deep inside a field", deep_in_field.into_bytes()),
    ];
    for path in POST_ROUTES {
        for (what, body) in &malformed {
            if *what == "empty" && path.ends_with("/close") {
                continue; // close takes no body: an empty one is an ordinary close
            }
            let resp = post(&server, path, "application/json", body, true);
            let context = format!("{path} {what}");
            assert_eq!(resp.status, 400, "{context}: {}", resp.text());
            assert_client_error(&resp, &context);
        }
        // Nesting past the body limit is refused by size instead.
        let deeper = "[".repeat(100_000);
        assert_client_error(
            &post(&server, path, "application/json", deeper.as_bytes(), true),
            &format!("{path} 100000 ["),
        );
    }
    for (what, body) in &malformed[..18] {
        let resp = post(&server, "/v1/orders", "application/json", body, false);
        if *what != "empty" {
            assert_eq!(resp.error_code(), "invalid_json", "{what}");
        }
    }
    assert_eq!(count(&read_only(&server.db), "SELECT count(*) FROM pay_callback_log", []), 0);
    assert_eq!(count(&read_only(&server.db), "SELECT count(*) FROM refund", []), 0);
    assert_eq!(count(&read_only(&server.db), "SELECT count(*) FROM orders", []), 1);
    assert_healthy(&server, "malformed JSON");
}

/// A valid body for each route, to mutate.
fn valid_body(path: &str) -> Value {
    match path {
        "/v1/orders" => {
            json!({"order_no": "H-NEW", "user_id": "u1", "amount": 500, "currency": "CNY", "expires_in_s": 60})
        }
        p if p.ends_with("/close") => json!({}),
        "/v1/callbacks/generic" => {
            let paid_at = payonce::clock::format_ms(util::now_ms() - 60_000);
            json!({"pay_no": "H-PAY", "order_no": "H-TARGET", "amount": 500, "status": "SUCCESS", "paid_at": paid_at})
        }
        "/v1/callbacks/generic/refund" => json!({"refund_no": "H-REF", "order_no": "H-TARGET", "status": "SUCCESS"}),
        _ => json!({"refund_no": "H-REF"}),
    }
}

#[test]
fn random_and_mutated_bodies_never_5xx() {
    let server = start();
    let mut rng = Rng::new(0x5eed_0001);
    let interesting: &[&[u8]] = &[
        b"\"",
        b"{",
        b"}",
        b"[",
        b"]",
        b":",
        b",",
        b"\\",
        b"\\u0000",
        b"-",
        b"1e999",
        b"null",
        b"\xff",
        b"\x00",
        b"9999999999999999999999",
    ];
    for path in POST_ROUTES {
        let sign = is_callback(path);
        // Pure random bytes of random lengths.
        for i in 0..150 {
            let len = 1 + rng.below(600) as usize;
            let body: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
            let resp = post(&server, path, "application/json", &body, sign && i % 4 != 0);
            assert_no_server_error(&resp, &format!("{path} random #{i} {:?}", String::from_utf8_lossy(&body)));
            assert!(resp.status >= 400, "{path} random #{i} accepted: {}", resp.text());
        }
        // A valid body with random bytes flipped, inserted or deleted.
        let base = valid_body(path).to_string().into_bytes();
        for i in 0..150 {
            let mut body = base.clone();
            for _ in 0..=rng.below(4) {
                let at = rng.below(body.len() as u64 + 1) as usize;
                match rng.below(4) {
                    0 if at < body.len() => body[at] = rng.next_u64() as u8,
                    1 if at < body.len() => {
                        body.remove(at);
                    }
                    2 => {
                        let piece = interesting[rng.below(interesting.len() as u64) as usize];
                        body.splice(at..at, piece.iter().copied());
                    }
                    _ => body.insert(at, rng.next_u64() as u8),
                }
            }
            let resp = post(&server, path, "application/json", &body, sign);
            assert_no_server_error(&resp, &format!("{path} mutated #{i} {:?}", String::from_utf8_lossy(&body)));
        }
    }
    // Unsigned random callbacks never get past authentication.
    for path in ["/v1/callbacks/generic", "/v1/callbacks/generic/refund"] {
        let body = valid_body(path).to_string();
        expect(&post(&server, path, "application/json", body.as_bytes(), false), 401, "invalid_signature", path);
    }
    // The victim order went through at most legal states and events still read.
    let events = server.get("/v1/events?limit=1000");
    assert_eq!(events.status, 200, "{}", events.text());
    let victim = server.get("/v1/orders/H-TARGET").json();
    assert!(victim["status"].is_string(), "{victim}");
    for list in ["/v1/orders?limit=1000", "/v1/users/u1/coupons", "/v1/users/victim/points"] {
        assert_eq!(server.get(list).status, 200, "{list}");
    }
    assert_healthy(&server, "random bodies");
}

#[test]
fn hostile_amounts_are_400_and_store_nothing() {
    let server = start();
    let amounts = [
        "0",
        "-1",
        "-0",
        "-9900",
        "99.5",
        "99.0",
        "1e3",
        "1E2",
        "1.0e2",
        "\"9900\"",
        "\"\"",
        "true",
        "null",
        "[]",
        "{}",
        "1000000000001",
        "9223372036854775807",
        "9223372036854775808",
        "-9223372036854775809",
        "18446744073709551616",
        "123456789012345678901234567890",
        "1e400",
        "-1e400",
        "0.0000001",
        "4.9e-324",
    ];
    for amount in amounts {
        let order = format!("{{\"order_no\":\"H-AMT\",\"user_id\":\"u\",\"amount\":{amount}}}");
        let resp = post(&server, "/v1/orders", "application/json", order.as_bytes(), false);
        assert_eq!(resp.status, 400, "order amount {amount}: {}", resp.text());
        assert_client_error(&resp, amount);
        let payment = format!(
            "{{\"pay_no\":\"H-AMT-PAY\",\"order_no\":\"H-TARGET\",\"amount\":{amount},\"status\":\"SUCCESS\"}}"
        );
        let resp = post(&server, "/v1/callbacks/generic", "application/json", payment.as_bytes(), true);
        assert_eq!(resp.status, 400, "callback amount {amount}: {}", resp.text());
        assert_client_error(&resp, amount);
    }
    for expires in ["0", "-1", "86401", "1.5", "\"60\"", "1e9", "99999999999999999999"] {
        let order = format!("{{\"order_no\":\"H-EXP\",\"user_id\":\"u\",\"amount\":1,\"expires_in_s\":{expires}}}");
        let resp = post(&server, "/v1/orders", "application/json", order.as_bytes(), false);
        assert_eq!(resp.status, 400, "expires_in_s {expires}: {}", resp.text());
    }
    assert_eq!(count(&read_only(&server.db), "SELECT count(*) FROM orders", []), 1, "no order with a hostile amount");
    assert_eq!(
        count(&read_only(&server.db), "SELECT count(*) FROM pay_callback_log", []),
        0,
        "no callback with a hostile amount"
    );
    assert_eq!(server.get("/v1/orders/H-TARGET").json()["status"], "PENDING");
    assert_healthy(&server, "hostile amounts");
}

#[test]
fn hostile_identifiers_in_bodies_and_paths() {
    let server = start();
    let long = "x".repeat(10_000);
    let identifiers: Vec<String> = vec![
        "订单".into(),
        "ORD-ü".into(),
        "ORD\u{202e}1".into(),
        "ORD\u{0000}1".into(),
        "\u{0000}".into(),
        "ORD 1".into(),
        "ORD/1".into(),
        "ORD%2F1".into(),
        "../../etc/passwd".into(),
        "ORD'; DROP TABLE orders; --".into(),
        "ORD\"1".into(),
        "ORD\n1".into(),
        "a".repeat(65),
        long.clone(),
        "".into(),
        "😀".into(),
    ];
    for id in &identifiers {
        let short: String = id.chars().take(40).collect();
        let bodies = [
            ("/v1/orders", json!({"order_no": id, "user_id": "u", "amount": 1}), false),
            ("/v1/orders", json!({"order_no": "H-ID", "user_id": id, "amount": 1}), false),
            ("/v1/orders", json!({"order_no": "H-ID", "user_id": "u", "amount": 1, "currency": id}), false),
            ("/v1/orders/H-TARGET/refund", json!({"refund_no": id}), false),
            (
                "/v1/callbacks/generic",
                json!({"pay_no": id, "order_no": "H-TARGET", "amount": 500, "status": "SUCCESS"}),
                true,
            ),
            (
                "/v1/callbacks/generic",
                json!({"pay_no": "H-ID-PAY", "order_no": id, "amount": 500, "status": "SUCCESS"}),
                true,
            ),
            (
                "/v1/callbacks/generic",
                json!({"pay_no": "H-ID-PAY", "order_no": "H-TARGET", "amount": 500, "status": id}),
                true,
            ),
            (
                "/v1/callbacks/generic/refund",
                json!({"refund_no": id, "order_no": "H-TARGET", "status": "SUCCESS"}),
                true,
            ),
            ("/v1/callbacks/generic/refund", json!({"refund_no": "H-R", "order_no": id, "status": "SUCCESS"}), true),
        ];
        for (path, body, sign) in bodies {
            let resp = post(&server, path, "application/json", body.to_string().as_bytes(), sign);
            let context = format!("{path} {short:?}");
            assert_eq!(resp.status, 400, "{context}: {}", resp.text());
            assert_eq!(resp.error_code(), "invalid_request", "{context}");
        }
    }
    // The same identifiers in paths (percent-encoded, as a client would send them).
    let encode = |s: &str| -> String {
        s.bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() || b"-_.".contains(&b) {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect()
    };
    for id in &identifiers {
        let id = encode(id);
        let short: String = id.chars().take(40).collect();
        for path in [format!("/v1/orders/{id}"), format!("/v1/users/{id}/coupons"), format!("/v1/users/{id}/points")] {
            assert_no_server_error(&server.get(&path), &format!("GET {short}"));
        }
        for path in [format!("/v1/orders/{id}/close"), format!("/v1/orders/{id}/refund")] {
            let resp = util::request(server.addr, "POST", &path, &[JSON], br#"{"refund_no":"H-R1"}"#);
            assert_no_server_error(&resp, &format!("POST {short}"));
            assert!(resp.status >= 400, "POST {short}: {}", resp.text());
        }
        let resp = util::request(server.addr, "GET", &format!("/v1/orders?user_id={id}&status=PAID"), &[], b"");
        assert_no_server_error(&resp, &format!("list {short}"));
    }
    // Raw UTF-8 and NUL bytes in the request line itself.
    for path in ["/v1/orders/订单", "/v1/orders/a\u{0}b", "/v1/users/😀/points", "/v1/orders/\u{202e}x/close"] {
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        raw_no_5xx(server.addr, request.as_bytes(), path);
    }
    assert_eq!(count(&read_only(&server.db), "SELECT count(*) FROM orders", []), 1);
    assert_eq!(count(&read_only(&server.db), "SELECT count(*) FROM pay_callback_log", []), 0);
    assert_eq!(count(&read_only(&server.db), "SELECT count(*) FROM refund", []), 0);
    assert_healthy(&server, "hostile identifiers");
}

#[test]
fn odd_paths_and_queries() {
    let server = start();
    let long_path = format!("/v1/orders/{}", "a".repeat(30_000));
    let paths = [
        "/v1/orders/..",
        "/v1/orders/../healthz",
        "/v1/orders/%2e%2e/close",
        "//v1//orders",
        "/v1/orders/",
        "/v1/orders//close",
        "/v1/orders/H-TARGET/",
        "/%",
        "/%00",
        "/v1/orders/%00",
        "/v1/orders/%ZZ",
        "/v1/orders?status=%",
        "/v1/orders?limit=99999999999999999999999",
        "/v1/orders?after=99999999999999999999999",
        "/v1/orders?&&&=&=",
        "/v1/orders?user_id=%FF%FE",
        "/v1/events?after=9223372036854775807",
        "/v1/events?limit=9223372036854775807",
        "/v1/events?after=-9223372036854775808",
        "/v1/callbacks/generic/refund/extra",
        "/v1/callbacks/%00",
        "/healthz?x=1",
        "/v1/orders/H-TARGET?x=%",
        long_path.as_str(),
        "*",
        "http://example.com/healthz",
    ];
    for method in ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "BREW"] {
        for path in paths {
            let request = format!(
                "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}"
            );
            raw_no_5xx(server.addr, request.as_bytes(), &format!("{method} {}", &path[..path.len().min(60)]));
        }
    }
    // The query parameters are validated, not trusted.
    for query in ["?limit=99999999999999999999999", "?after=99999999999999999999999", "?status=%", "?user_id=%FF%FE"] {
        let resp = server.get(&format!("/v1/orders{query}"));
        expect(&resp, 400, "invalid_request", query);
    }
    assert_healthy(&server, "odd paths");
}

#[test]
fn garbage_requests_do_not_kill_the_server() {
    let server = start();
    let many_headers: String = (0..500).map(|i| format!("X-H-{i}: {i}\r\n")).collect();
    let fixed: Vec<Vec<u8>> = vec![
        b"GARBAGE\r\n\r\n".to_vec(),
        b"\x00\x01\x02\x03\r\n\r\n".to_vec(),
        b"\r\n\r\n\r\n".to_vec(),
        b"GET\r\n\r\n".to_vec(),
        b"GET /healthz\r\n\r\n".to_vec(),
        b"GET /healthz HTTP/9.9\r\n\r\n".to_vec(),
        b"GET /healthz HTTP/1.1 extra\r\n\r\n".to_vec(),
        b"GET /healthz FOO/1.1\r\n\r\n".to_vec(),
        b"GET  /healthz  HTTP/1.1\r\n\r\n".to_vec(),
        b"GET /healthz HTTP/1.1\r\nno colon here\r\n\r\n".to_vec(),
        b"GET /healthz HTTP/1.1\r\n: empty name\r\n\r\n".to_vec(),
        b"GET /healthz HTTP/1.1\r\nX-Bin: \xff\xfe\x00\r\n\r\n".to_vec(),
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n".to_vec(),
        b"GET /healthz HTTP/1.1\nHost: x\n\n".to_vec(),
        b"GET /healthz HTTP/1.0\r\n\r\n".to_vec(),
        b"POST /v1/orders HTTP/1.1\r\nContent-Length: abc\r\n\r\n{}".to_vec(),
        b"POST /v1/orders HTTP/1.1\r\nContent-Length: -1\r\n\r\n{}".to_vec(),
        b"POST /v1/orders HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 5\r\n\r\n{}".to_vec(),
        b"POST /v1/orders HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n{}".to_vec(),
        b"POST /v1/orders HTTP/1.1\r\nContent-Length: 1000\r\nContent-Type: application/json\r\n\r\n{\"order_no\""
            .to_vec(),
        b"POST /v1/orders HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n{}".to_vec(),
        b"POST /v1/orders HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n".to_vec(),
        b"POST /v1/orders HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffff\r\n{}".to_vec(),
        b"POST /v1/orders HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
            .to_vec(),
        b"POST /v1/orders HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n{}".to_vec(),
        b"POST /v1/orders HTTP/1.1\r\nExpect: teapot\r\nContent-Length: 2\r\n\r\n{}".to_vec(),
        b"POST /v1/callbacks/generic HTTP/1.1\r\nPayonce-Signature: \xff\r\nContent-Length: 2\r\n\r\n{}".to_vec(),
        format!("GET /healthz HTTP/1.1\r\n{many_headers}\r\n").into_bytes(),
        format!("GET /healthz HTTP/1.1\r\nX-Long: {}\r\n\r\n", "v".repeat(32_000)).into_bytes(),
        format!("GET /{} HTTP/1.1\r\n\r\n", "p".repeat(60_000)).into_bytes(),
        // Pipelined requests, the second one garbage.
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGARBAGE\r\n\r\n".to_vec(),
    ];
    for (i, bytes) in fixed.iter().enumerate() {
        raw_no_5xx(
            server.addr,
            bytes,
            &format!("fixed #{i} {:?}", String::from_utf8_lossy(&bytes[..bytes.len().min(60)])),
        );
    }
    assert_healthy(&server, "fixed garbage");

    let mut rng = Rng::new(0x5eed_0002);
    for i in 0..200 {
        let len = 1 + rng.below(300) as usize;
        let mut bytes: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
        if i % 2 == 0 {
            // Plausible start, garbage after.
            let prefix: &[u8] = [
                b"GET /".as_slice(),
                b"POST /v1/orders HTTP/1.1\r\n",
                b"POST /v1/callbacks/generic HTTP/1.1\r\nContent-Length: 3\r\n",
            ][rng.below(3) as usize];
            bytes.splice(0..0, prefix.iter().copied());
        }
        bytes.extend_from_slice(b"\r\n\r\n");
        raw_no_5xx(server.addr, &bytes, &format!("random #{i}"));
    }
    // Connections opened and dropped without a byte, or mid-request.
    for _ in 0..20 {
        drop(std::net::TcpStream::connect(server.addr).expect("connect"));
        let mut stream = std::net::TcpStream::connect(server.addr).expect("connect");
        let _ = std::io::Write::write_all(&mut stream, b"POST /v1/orders HTTP/1.1\r\nContent-Length: 50\r\n\r\n{\"or");
        drop(stream);
    }
    assert_healthy(&server, "random garbage");
}
