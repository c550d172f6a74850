//! API tokens (docs/settings.md, docs/openapi.yaml): `--api-token` / env
//! `PAYONCE_API_TOKEN`, each `name:token` or a bare token, required as
//! `Authorization: Bearer` on every `/v1` endpoint except callbacks; 401
//! `unauthorized` otherwise. The caller the token names scopes Idempotency-
//! Keys, and a raw token is never stored. Without tokens `serve` refuses a
//! non-loopback listen address.

use crate::util::{self, footprint, order_states, read_only, Footprint, HttpResponse, Server, TempDir, SECRET};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const TOKENS: &str = "alice:tok-a,tok-bare";
const ALICE: &str = "Bearer tok-a";
const BARE: &str = "Bearer tok-bare";
const JSON: (&str, &str) = ("Content-Type", "application/json");
/// How long a spawned `payonce serve` may take to start or to exit.
const PROCESS_WAIT: Duration = Duration::from_secs(10);

/// `Authorization` values that must not pass (None = no header).
const REFUSED: [(&str, Option<&str>); 12] = [
    ("no header", None),
    ("wrong token", Some("Bearer wrong")),
    ("empty bearer", Some("Bearer ")),
    ("scheme only", Some("Bearer")),
    ("no scheme", Some("tok-a")),
    ("basic scheme", Some("Basic tok-a")),
    ("the whole name:token entry", Some("Bearer alice:tok-a")),
    ("the token's name", Some("Bearer alice")),
    ("a prefix of a token", Some("Bearer tok-")),
    ("a token with a suffix", Some("Bearer tok-a2")),
    ("another case", Some("Bearer TOK-A")),
    ("the bare token's caller name", Some("Bearer token-")),
];

fn send(
    server: &Server,
    method: &str,
    path: &str,
    auth: Option<&str>,
    extra: &[(&str, &str)],
    body: &str,
) -> HttpResponse {
    let mut headers: Vec<(&str, &str)> = vec![JSON];
    if let Some(auth) = auth {
        headers.push(("Authorization", auth));
    }
    headers.extend_from_slice(extra);
    util::request(server.addr, method, path, &headers, body.as_bytes())
}

fn expect_error(resp: &HttpResponse, status: u16, code: &str, context: &str) {
    assert_eq!(resp.status, status, "{context}: {}", resp.text());
    let v = resp.json();
    assert_eq!(v["error"]["code"], code, "{context}: {}", resp.text());
    assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{context}: a message");
    assert_eq!(v.as_object().map(|o| o.len()), Some(1), "{context}: only `error`: {}", resp.text());
}

/// Every table's row count and every order's state: what any request could have changed.
fn snapshot(db: &Path) -> (Footprint, Vec<String>) {
    let conn = read_only(db);
    (footprint(&conn), order_states(&conn))
}

fn scopes(db: &Path, key: &str) -> Vec<String> {
    let conn = read_only(db);
    let mut stmt = conn.prepare("SELECT scope FROM idempotency_key WHERE key = ?1 ORDER BY scope").expect("prepare");
    let rows = stmt.query_map([key], |r| r.get(0)).expect("query");
    rows.collect::<Result<_, _>>().expect("rows")
}

fn pay_callback(server: &Server, pay_no: &str, order_no: &str, amount: i64, auth: Option<&str>) -> HttpResponse {
    let body = json!({"pay_no": pay_no, "order_no": order_no, "amount": amount, "status": "SUCCESS"}).to_string();
    let signature = util::sign_now(SECRET, body.as_bytes());
    send(server, "POST", "/v1/callbacks/generic", auth, &[("Payonce-Signature", &signature)], &body)
}

/// A protected route of the route table with its parameters filled, the body it
/// takes, and the status a caller with a valid token gets (None for routes
/// this module does not exercise further: any answer but 401 or a 5xx).
struct Target {
    method: String,
    path: String,
    body: String,
    ok_status: Option<u16>,
}

/// Fills the route table for one caller (`who` makes created ids unique per
/// caller): the protected targets, and the open routes as listed.
fn targets(who: &str) -> (Vec<Target>, Vec<String>) {
    let mut protected = Vec::new();
    let mut open = Vec::new();
    for route in payonce::api::routes() {
        let (method, template) = (route.method, route.template);
        // The contract's rule, checked against the table's own flag.
        // `/metrics` too (docs/settings.md, `--metrics-listen`).
        let is_protected =
            (template.starts_with("/v1/") && !template.starts_with("/v1/callbacks/")) || template == "/metrics";
        assert_eq!(route.needs_token, is_protected, "{method} {template}");
        if !is_protected {
            open.push(format!("{method} {template}"));
            continue;
        }
        // Close the open order; refund and read the paid one.
        let order_no = if template.ends_with("/close") { "ORD-AUTH-OPEN" } else { "ORD-AUTH-PAID" };
        let mut path = template
            .replace("{order_no}", order_no)
            .replace("{user_id}", "u-auth")
            .replace("{pay_no}", "PAY-AUTH")
            .replace("{refund_no}", "RF-AUTH");
        // Any parameter a later route adds.
        while let (Some(open_at), Some(close_at)) = (path.find('{'), path.find('}')) {
            path.replace_range(open_at..=close_at, "x-auth");
        }
        if template == "/v1/admin/stats" {
            path.push_str("?window=1h");
        }
        let (body, ok_status) = match (method, template) {
            ("POST", "/v1/orders") => (
                json!({"order_no": format!("ORD-AUTH-{who}"), "user_id": "u-auth", "amount": 100}).to_string(),
                Some(201),
            ),
            ("POST", "/v1/orders/{order_no}/refund") => (json!({"refund_no": "RF-AUTH"}).to_string(), Some(200)),
            ("POST", "/v1/orders/{order_no}/close") => ("{}".to_owned(), Some(200)),
            ("PUT", "/v1/admin/mode") => (json!({"mode": "normal"}).to_string(), Some(200)),
            ("GET", _) => (String::new(), Some(200)),
            _ => ("{}".to_owned(), None),
        };
        protected.push(Target { method: method.to_owned(), path, body, ok_status });
    }
    (protected, open)
}

#[test]
fn every_protected_route_needs_a_configured_token() {
    let server = Server::start(&["--api-token", TOKENS]);
    // Set-up with a valid token; the payment by callback, without one.
    for order_no in ["ORD-AUTH-OPEN", "ORD-AUTH-PAID"] {
        let body = json!({"order_no": order_no, "user_id": "u-auth", "amount": 100}).to_string();
        assert_eq!(send(&server, "POST", "/v1/orders", Some(ALICE), &[], &body).status, 201);
    }
    let paid = pay_callback(&server, "PAY-AUTH", "ORD-AUTH-PAID", 100, None);
    assert_eq!(paid.status, 200, "a signed callback needs no token: {}", paid.text());
    assert_eq!(paid.json()["outcome"], "applied");

    let (protected, open) = targets("x");
    let methods: Vec<&str> = protected.iter().map(|t| t.method.as_str()).collect();
    assert!(
        protected.len() >= 8 && methods.contains(&"GET") && methods.contains(&"POST"),
        "the route table lists the protected routes: {methods:?}"
    );
    assert!(
        open.iter().any(|r| r.contains("/v1/callbacks/")) && open.iter().any(|r| r.contains("/healthz")),
        "{open:?}"
    );

    // Refused: every protected route, every bad Authorization, keyed or not; nothing changes.
    let before = snapshot(&server.db);
    for t in &protected {
        for (name, auth) in REFUSED {
            let context = format!("{} {} with {name}", t.method, t.path);
            expect_error(&send(&server, &t.method, &t.path, auth, &[], &t.body), 401, "unauthorized", &context);
            let keyed = send(&server, &t.method, &t.path, auth, &[("Idempotency-Key", "auth-k")], &t.body);
            expect_error(&keyed, 401, "unauthorized", &format!("{context}, keyed"));
            assert!(keyed.header("Idempotent-Replayed").is_none(), "{context}");
        }
    }
    assert_eq!(snapshot(&server.db), before, "no refused request changed anything or stored a key");

    // Accepted: the named token and the bare token, on every protected route.
    for (who, auth) in [("alice", ALICE), ("bare", BARE)] {
        let (protected, _) = targets(who);
        for t in &protected {
            let resp = send(&server, &t.method, &t.path, Some(auth), &[], &t.body);
            let context = format!("{} {} as {who}: {}", t.method, t.path, resp.text());
            match t.ok_status {
                Some(status) => assert_eq!(resp.status, status, "{context}"),
                None => assert!(resp.status != 401 && resp.status < 500, "{context}"),
            }
        }
    }
    assert_eq!(send(&server, "GET", "/v1/orders/ORD-AUTH-OPEN", Some(BARE), &[], "").json()["status"], "CLOSED");
    assert_eq!(send(&server, "GET", "/v1/orders/ORD-AUTH-PAID", Some(ALICE), &[], "").json()["status"], "REFUNDING");

    // Not protected: /healthz and callbacks, with no token or a wrong one.
    for auth in [None, Some("Bearer wrong")] {
        let health = send(&server, "GET", "/healthz", auth, &[], "");
        assert_eq!((health.status, health.json()["status"].clone()), (200, json!("ok")), "healthz with {auth:?}");
        let again = pay_callback(&server, "PAY-AUTH", "ORD-AUTH-PAID", 100, auth);
        assert_eq!(again.status, 200, "callback with {auth:?}: {}", again.text());
        assert_eq!(again.json()["outcome"], "duplicate", "the callback was processed");
    }
    let body =
        json!({"pay_no": "PAY-AUTH-2", "order_no": "ORD-AUTH-OPEN", "amount": 100, "status": "SUCCESS"}).to_string();
    let refund_cb = json!({"refund_no": "RF-AUTH", "order_no": "ORD-AUTH-PAID", "status": "SUCCESS"}).to_string();
    for (path, body) in [("/v1/callbacks/generic", body), ("/v1/callbacks/generic/refund", refund_cb)] {
        let signature = util::sign_now(SECRET, body.as_bytes());
        let resp = send(&server, "POST", path, None, &[("Payonce-Signature", &signature)], &body);
        assert_eq!(resp.status, 200, "{path} without a token: {}", resp.text());
        assert_ne!(resp.json()["code"], Value::Null, "{path}: the channel's answer, not a 401");
    }
    assert_eq!(send(&server, "GET", "/v1/orders/ORD-AUTH-PAID", Some(ALICE), &[], "").json()["status"], "REFUNDED");
    // An unsigned callback is still refused by its signature, not by a token.
    let unsigned = send(&server, "POST", "/v1/callbacks/generic", Some(ALICE), &[], "{}");
    expect_error(&unsigned, 401, "invalid_signature", "unsigned callback");
}

/// The token's caller scopes keys; the raw token is stored nowhere; a 401
/// is not stored.
#[test]
fn tokens_scope_keys_and_the_raw_token_is_never_stored() {
    let server = Server::start(&["--api-token", TOKENS]);
    let body = json!({"user_id": "u-tok", "amount": 100}).to_string();
    let keyed = |auth: &str, key: &str, body: &str| {
        send(&server, "POST", "/v1/orders", Some(auth), &[("Idempotency-Key", key)], body)
    };

    // One key, two callers: two first uses, two orders; each replays its own.
    let a = keyed(ALICE, "k-tok", &body);
    let b = keyed(BARE, "k-tok", &body);
    for (who, r) in [("alice", &a), ("bare", &b)] {
        assert_eq!((r.status, r.header("Idempotent-Replayed")), (201, None), "{who}: a first use: {}", r.text());
    }
    assert_ne!(a.json()["order_no"], b.json()["order_no"], "another caller's key is another key");
    for (auth, first) in [(ALICE, &a), (BARE, &b), (BARE, &b)] {
        let again = keyed(auth, "\"k-tok\"", &body);
        assert_eq!((again.status, again.header("Idempotent-Replayed")), (201, Some("true")), "{}", again.text());
        assert_eq!(again.body, first.body, "each caller replays its own answer");
    }
    // Another body from the other caller under the same key: its own first use, not 422.
    let other = keyed(BARE, "k-tok-2", &body);
    assert_eq!(other.status, 201);
    let alice_other = keyed(ALICE, "k-tok-2", &json!({"user_id": "u-tok", "amount": 200}).to_string());
    assert_eq!((alice_other.status, alice_other.header("Idempotent-Replayed")), (201, None), "{}", alice_other.text());

    // A 401 is not stored: the same key then runs for a valid caller, whatever the body.
    expect_error(&keyed("Bearer wrong", "k-401", &body), 401, "unauthorized", "wrong token, keyed");
    assert!(scopes(&server.db, "k-401").is_empty(), "a 401 stores nothing");
    let after = keyed(ALICE, "k-401", &json!({"user_id": "u-tok", "amount": 300}).to_string());
    assert_eq!((after.status, after.header("Idempotent-Replayed")), (201, None), "{}", after.text());

    let all = scopes(&server.db, "k-tok");
    assert_eq!(all.len(), 2, "{all:?}");
    assert!(all.iter().any(|s| s.starts_with("alice ")), "the named token's caller is its name: {all:?}");
    let bare_scope = all
        .iter()
        .find(|s| s.starts_with("token-"))
        .unwrap_or_else(|| panic!("the bare token's caller is token-<hash>: {all:?}"));
    let bare_caller = bare_scope.split(' ').next().unwrap_or_default();
    assert!(bare_caller.len() > "token-".len(), "a hash follows: {bare_caller:?}");

    // The raw tokens appear in no column and in no byte of the database files.
    let conn = read_only(&server.db);
    let mut stmt = conn.prepare("SELECT scope FROM idempotency_key").expect("prepare");
    let every_scope: Vec<String> =
        stmt.query_map([], |r| r.get(0)).expect("query").collect::<Result<_, _>>().expect("rows");
    assert!(every_scope.len() >= 5, "{every_scope:?}");
    for scope in &every_scope {
        assert!(!scope.contains("tok-a") && !scope.contains("tok-bare"), "a raw token in scope {scope:?}");
    }
    let dir = server.db.parent().expect("db dir");
    for entry in std::fs::read_dir(dir).expect("read db dir") {
        let path = entry.expect("entry").path();
        let bytes = std::fs::read(&path).unwrap_or_default();
        for token in ["tok-a", "tok-bare"] {
            assert!(
                !bytes.windows(token.len()).any(|w| w == token.as_bytes()),
                "raw token {token:?} found in {}",
                path.display()
            );
        }
    }
}

// ---- the serve command ----

fn payonce() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_payonce"));
    cmd.env_remove("PAYONCE_CALLBACK_SECRET").env_remove("PAYONCE_API_TOKEN").stdin(Stdio::null());
    cmd
}

fn wait_with_timeout(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

/// A spawned `payonce serve`, killed on drop.
struct Spawned {
    child: Child,
    stderr: mpsc::Receiver<String>,
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Spawns `payonce serve ARGS` with `env`; stdout's first line (within
/// PROCESS_WAIT) or None when the process wrote none.
fn spawn_serve(args: &[&str], env: &[(&str, &str)]) -> (Spawned, Option<String>) {
    let mut cmd = payonce();
    cmd.arg("serve").args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    for (name, value) in env {
        cmd.env(name, value);
    }
    let mut child = cmd.spawn().expect("spawn payonce serve");
    let stdout = child.stdout.take().expect("stdout");
    let stderr = child.stderr.take().expect("stderr");
    let (line_tx, line_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = line_tx.send(line);
    });
    let (err_tx, err_rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if err_tx.send(line).is_err() {
                return;
            }
        }
    });
    let first = line_rx.recv_timeout(PROCESS_WAIT).ok().filter(|l| !l.is_empty());
    (Spawned { child, stderr: err_rx }, first)
}

/// The address in `listening on http://ADDR`, reached through loopback.
fn reachable(line: &str) -> SocketAddr {
    let addr: SocketAddr = line
        .trim()
        .strip_prefix("listening on http://")
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("first line {line:?}"));
    assert_ne!(addr.port(), 0);
    SocketAddr::from(([127, 0, 0, 1], addr.port()))
}

/// stderr lines received within `wait`.
fn stderr_lines(spawned: &Spawned, wait: Duration) -> Vec<String> {
    let deadline = Instant::now() + wait;
    let mut lines = Vec::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match spawned.stderr.recv_timeout(left) {
            Ok(line) => lines.push(line),
            Err(_) => break,
        }
    }
    lines
}

#[test]
fn serve_refuses_a_non_loopback_address_without_a_token() {
    let dir = TempDir::new("auth-cli");
    let db = dir.path("auth.db").display().to_string();
    let base = ["--db", db.as_str(), "--callback-secret", "x"];

    // No token on 0.0.0.0: a non-zero exit and a message, never a listening line.
    let mut child = payonce()
        .arg("serve")
        .args(base)
        .args(["--listen", "0.0.0.0:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let status = wait_with_timeout(&mut child, PROCESS_WAIT).expect("serve without a token on 0.0.0.0 exits by itself");
    assert!(!status.success(), "refuses to start: {status:?}");
    let (mut out, mut err) = (String::new(), String::new());
    let _ = child.stdout.take().expect("stdout").read_to_string(&mut out);
    let _ = child.stderr.take().expect("stderr").read_to_string(&mut err);
    assert!(!out.contains("listening"), "stdout {out:?}");
    assert!(err.to_lowercase().contains("token"), "stderr says a token is needed: {err:?}");

    // With a token, by flag or by environment: it starts on 0.0.0.0 and authenticates.
    #[allow(clippy::type_complexity)]
    let cases: [(&str, Vec<&str>, Vec<(&str, &str)>, &str); 2] = [
        ("--api-token", vec!["--api-token", "alice:tok-a"], vec![], "Bearer tok-a"),
        ("PAYONCE_API_TOKEN", vec![], vec![("PAYONCE_API_TOKEN", "envy:tok-env")], "Bearer tok-env"),
    ];
    for (name, flags, env, auth) in cases {
        let mut args = base.to_vec();
        args.extend(["--listen", "0.0.0.0:0"]);
        args.extend(flags);
        let (spawned, first) = spawn_serve(&args, &env);
        let first = first.unwrap_or_else(|| {
            panic!("{name}: serve on 0.0.0.0 starts (stderr {:?})", stderr_lines(&spawned, Duration::from_millis(200)))
        });
        assert!(first.starts_with("listening on http://0.0.0.0:"), "{name}: {first:?}");
        let addr = reachable(&first);
        let denied = util::request(addr, "GET", "/v1/orders", &[], b"");
        assert_eq!(denied.status, 401, "{name}: {}", denied.text());
        let allowed = util::request(addr, "GET", "/v1/orders", &[("Authorization", auth)], b"");
        assert_eq!(allowed.status, 200, "{name}: {}", allowed.text());
        drop(spawned);
    }

    // No token on loopback: it starts, with a warning on stderr, and /v1 is open.
    let mut args = base.to_vec();
    args.extend(["--listen", "127.0.0.1:0"]);
    let (spawned, first) = spawn_serve(&args, &[]);
    let addr = reachable(&first.expect("serve on loopback without a token starts"));
    assert_eq!(util::request(addr, "GET", "/v1/orders", &[], b"").status, 200);
    let warnings = stderr_lines(&spawned, Duration::from_millis(500));
    assert!(
        warnings.iter().any(|l| l.to_lowercase().contains("warning") && l.to_lowercase().contains("token")),
        "a warning says there is no token: {warnings:?}"
    );
}

/// PAYONCE_API_TOKEN works as the flag does, including the caller name in
/// key scopes, and a listed bare token.
#[test]
fn the_env_token_works_like_the_flag() {
    let dir = TempDir::new("auth-env");
    let db = dir.path("env.db");
    let db_text = db.display().to_string();
    let args = ["--db", db_text.as_str(), "--callback-secret", SECRET, "--listen", "127.0.0.1:0"];
    let (spawned, first) = spawn_serve(&args, &[("PAYONCE_API_TOKEN", "envy:tok-env,tok-env-bare")]);
    let addr = reachable(&first.unwrap_or_else(|| panic!("serve with PAYONCE_API_TOKEN starts")));
    for (name, auth) in REFUSED {
        let resp = util::request(
            addr,
            "GET",
            "/v1/events",
            &auth.map(|a| vec![("Authorization", a)]).unwrap_or_default(),
            b"",
        );
        assert_eq!(resp.status, 401, "{name}: {}", resp.text());
    }
    let body = json!({"user_id": "u-env", "amount": 100}).to_string();
    for auth in ["Bearer tok-env", "Bearer tok-env-bare"] {
        let resp = util::request(
            addr,
            "POST",
            "/v1/orders",
            &[JSON, ("Authorization", auth), ("Idempotency-Key", "k-env")],
            body.as_bytes(),
        );
        assert_eq!(resp.status, 201, "{auth}: {}", resp.text());
    }
    let conn = read_only(&db);
    let mut stmt = conn.prepare("SELECT scope FROM idempotency_key ORDER BY scope").expect("prepare");
    let all: Vec<String> = stmt.query_map([], |r| r.get(0)).expect("query").collect::<Result<_, _>>().expect("rows");
    assert_eq!(all.len(), 2, "{all:?}");
    assert!(all[0].starts_with("envy ") && all[1].starts_with("token-"), "{all:?}");
    assert!(all.iter().all(|s| !s.contains("tok-env")), "{all:?}");
    drop(spawned);
}
