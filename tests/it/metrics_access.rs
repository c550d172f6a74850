//! Who may read `/metrics` (docs/settings.md, `--metrics-listen`), over real
//! sockets: behind the API token when tokens are configured, open without
//! any, and open on a listener of its own that serves nothing else; an
//! address that cannot be bound stops the start in one line.

use crate::util::{request, HttpResponse, Server, TempDir, SECRET};
use std::net::{SocketAddr, TcpListener};
use std::process::{Command, Stdio};

const TOKEN: &str = "scrape-token-1";

fn scrape(addr: SocketAddr, authorization: Option<&str>) -> HttpResponse {
    let headers: Vec<(&str, &str)> = authorization.map(|a| vec![("Authorization", a)]).unwrap_or_default();
    request(addr, "GET", "/metrics", &headers, b"")
}

fn assert_exposition(resp: &HttpResponse, what: &str) {
    assert_eq!(resp.status, 200, "{what}: {}", resp.text());
    assert!(resp.text().contains("payonce_callback_outcomes_total"), "{what}: {}", resp.text());
}

fn assert_refused(resp: &HttpResponse, what: &str) {
    assert_eq!(resp.status, 401, "{what}: {}", resp.text());
    assert_eq!(resp.error_code(), "unauthorized", "{what}");
    assert!(!resp.text().contains("payonce_"), "{what}: no metric leaks: {}", resp.text());
}

/// The address the server announced for its metrics listener on stderr.
fn metrics_addr(log: &std::path::Path) -> SocketAddr {
    let text = std::fs::read_to_string(log).unwrap_or_else(|e| panic!("read {}: {e}", log.display()));
    text.lines()
        .find_map(|l| l.strip_prefix("payonce: metrics on http://"))
        .and_then(|rest| rest.split('/').next())
        .and_then(|addr| addr.parse().ok())
        .unwrap_or_else(|| panic!("no metrics address announced:\n{text}"))
}

#[test]
fn with_a_token_configured_metrics_needs_it_unless_on_its_own_listener() {
    let dir = TempDir::new("metrics-token");
    let db = dir.path("payonce.db");
    let log = dir.path("stderr.log");
    let file = std::fs::File::create(&log).expect("log file");
    let server = Server::start_logged(
        &db,
        &["--api-token", &format!("prom:{TOKEN}"), "--metrics-listen", "127.0.0.1:0"],
        Stdio::from(file),
    );
    // The main listener: 401 without a token and with a wrong one, 200 with it.
    assert_refused(&scrape(server.addr, None), "no token");
    assert_refused(&scrape(server.addr, Some("Bearer not-the-token")), "a wrong token");
    assert_refused(&scrape(server.addr, Some(&format!("Basic {TOKEN}"))), "another scheme");
    assert_exposition(&scrape(server.addr, Some(&format!("Bearer {TOKEN}"))), "the token");

    // The metrics listener: no token needed, and nothing else served there.
    let metrics = metrics_addr(&log);
    assert_ne!(metrics, server.addr);
    assert_exposition(&scrape(metrics, None), "the metrics listener");
    assert_exposition(&scrape(metrics, Some("Bearer anything")), "a token is not looked at there");
    let other = request(metrics, "GET", "/v1/orders", &[], b"");
    assert_eq!(other.status, 404, "{}", other.text());
    assert_eq!(other.error_code(), "not_found");
    let health = request(metrics, "GET", "/healthz", &[], b"");
    assert_eq!(health.status, 404, "only /metrics: {}", health.text());
    let post = request(metrics, "POST", "/metrics", &[], b"");
    assert_eq!(post.status, 405, "{}", post.text());
    assert_eq!(post.header("Allow"), Some("GET"));
    // The scrapes on the metrics listener are counted like any request.
    let text = scrape(metrics, None).text();
    assert!(
        text.lines().any(|l| l.starts_with("payonce_http_requests_total{")
            && l.contains("route=\"/metrics\"")
            && l.contains("status=\"401\"")),
        "the refused scrapes are counted: {text}"
    );
    // And the main listener still refuses without the token.
    assert_refused(&scrape(server.addr, None), "no token, with a metrics listener running");
}

#[test]
fn without_any_token_metrics_stays_open() {
    let server = Server::start(&[]);
    assert_exposition(&scrape(server.addr, None), "no token configured");
}

#[test]
fn a_metrics_address_that_cannot_be_bound_stops_the_start_in_one_line() {
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind a port");
    let busy = taken.local_addr().expect("its address").to_string();
    for bad in [busy.as_str(), "not-an-address", "127.0.0.1:99999"] {
        let dir = TempDir::new("metrics-bad");
        let out = Command::new(env!("CARGO_BIN_EXE_payonce"))
            .args(["serve", "--db", "ledger.db", "--listen", "127.0.0.1:0", "--metrics-listen", bad])
            .current_dir(dir.path(""))
            .env("PAYONCE_CALLBACK_SECRET", SECRET)
            .env_remove("PAYONCE_API_TOKEN")
            .env_remove("PAYONCE_DB")
            .stdin(Stdio::null())
            .output()
            .expect("run payonce serve");
        let (stdout, stderr) =
            (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
        assert_eq!(out.status.code(), Some(2), "{bad}: {stderr}");
        assert!(stdout.is_empty(), "{bad}: never announced as listening: {stdout}");
        // The refusal is one line, the last; the lines before it are the
        // start's own notes (the channels, the missing token).
        let refusals: Vec<&str> = stderr.lines().filter(|l| l.contains("metrics")).collect();
        assert_eq!(refusals.len(), 1, "{bad}: one line: {stderr}");
        assert_eq!(stderr.lines().last(), Some(refusals[0]), "{bad}: {stderr}");
        assert!(refusals[0].contains("--metrics-listen") && refusals[0].contains(bad), "{bad}: {stderr}");
        let left: Vec<_> = std::fs::read_dir(dir.path("")).expect("dir").collect();
        assert!(left.is_empty(), "{bad}: a failed start leaves no database file: {left:?}");
    }
}
