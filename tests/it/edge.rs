//! The HTTP edge against hostile clients, over real sockets, with no proxy
//! in front (docs/deployment.md). Each test is one attack that worked
//! against the first server payonce used; each shrinks the limit it tests
//! through `serve`'s own settings, so it runs in seconds.

use crate::util::{self, HttpResponse, TempDir, SECRET};
use serde_json::json;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TOKEN: &str = "edge-token";
const AUTH: (&str, &str) = ("Authorization", "Bearer edge-token");
/// How long a well-behaved client may wait for an answer while the server
/// is under attack (generous for a loaded 2-core CI machine).
const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// `payonce serve` with its stderr kept in a file, optionally with a lower
/// hard `RLIMIT_NOFILE` (payonce raises its soft limit to the hard one).
struct Edge {
    addr: SocketAddr,
    child: Child,
    stderr: PathBuf,
    db: PathBuf,
    _dir: TempDir,
}

impl Edge {
    fn start(extra: &[&str]) -> Edge {
        Edge::start_with_nofile(extra, None)
    }

    fn start_with_nofile(extra: &[&str], nofile: Option<u64>) -> Edge {
        let dir = TempDir::new("edge");
        let db = dir.path("payonce.db");
        let stderr = dir.path("stderr.log");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_payonce"));
        cmd.args(["serve", "--db"])
            .arg(&db)
            .args(["--listen", "127.0.0.1:0", "--callback-secret", SECRET, "--api-token", TOKEN])
            .args(extra)
            .env_remove("PAYONCE_CALLBACK_SECRET")
            .env_remove("PAYONCE_API_TOKEN")
            .env("PAYONCE_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).expect("stderr file"));
        if let Some(limit) = nofile {
            use std::os::unix::process::CommandExt;
            // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    let rlimit = libc::rlimit { rlim_cur: limit, rlim_max: limit };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &rlimit) == 0 {
                        Ok(())
                    } else {
                        Err(std::io::Error::last_os_error())
                    }
                });
            }
        }
        let mut child = cmd.spawn().expect("spawn payonce serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("first line");
        let addr = line
            .trim()
            .strip_prefix("listening on http://")
            .unwrap_or_else(|| {
                panic!(
                    "unexpected first line {line:?}; stderr: {}",
                    std::fs::read_to_string(&stderr).unwrap_or_default()
                )
            })
            .parse()
            .expect("address");
        Edge { addr, child, stderr, db, _dir: dir }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    fn get(&self, path: &str) -> HttpResponse {
        util::request(self.addr, "GET", path, &[AUTH], b"")
    }

    fn mode(&self) -> String {
        self.get("/v1/admin/mode").json()["mode"].as_str().unwrap_or_default().to_owned()
    }

    fn orders(&self) -> i64 {
        let conn = rusqlite::Connection::open(&self.db).expect("open db");
        conn.query_row("SELECT count(*) FROM orders", [], |r| r.get(0)).expect("count")
    }

    fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    }

    /// A well-behaved client: one GET /healthz on a new connection, within `ANSWER_WITHIN`.
    fn healthy_within_deadline(&self) -> bool {
        let Ok(mut stream) = TcpStream::connect_timeout(&self.addr, ANSWER_WITHIN) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(ANSWER_WITHIN));
        let request = format!("GET /healthz HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n", self.addr);
        if stream.write_all(request.as_bytes()).is_err() {
            return false;
        }
        let mut out = Vec::new();
        let _ = stream.read_to_end(&mut out);
        util::parse_response(&out).is_some_and(|r| r.status == 200)
    }
}

impl Drop for Edge {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
    stream.set_write_timeout(Some(Duration::from_secs(20))).expect("timeout");
    stream
}

/// Reads HTTP/1.1 responses (Content-Length framed, as payonce sends them)
/// from a connection until `n` arrived or the server closed it.
fn read_responses(stream: &mut TcpStream, n: usize) -> (Vec<HttpResponse>, bool) {
    let mut buf = Vec::new();
    let mut responses = Vec::new();
    let mut chunk = [0u8; 64 * 1024];
    let mut closed = false;
    while responses.len() < n {
        if let Some((response, used)) = split_response(&buf) {
            responses.push(response);
            buf.drain(..used);
            continue;
        }
        match stream.read(&mut chunk) {
            Ok(0) => {
                closed = true;
                break;
            }
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {
                closed = true;
                break;
            }
            Err(e) => panic!("reading responses: {e} after {} responses", responses.len()),
        }
    }
    (responses, closed)
}

fn split_response(buf: &[u8]) -> Option<(HttpResponse, usize)> {
    let head_end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = std::str::from_utf8(&buf[..head_end]).ok()?;
    let length = head
        .lines()
        .find_map(|l| l.split_once(':').filter(|(n, _)| n.eq_ignore_ascii_case("content-length")))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    let end = head_end + length;
    if buf.len() < end {
        return None;
    }
    Some((util::parse_response(&buf[..end])?, end))
}

/// Whether the server has closed `stream` (EOF or reset) within `within`.
fn closed_by_server(stream: &mut TcpStream, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    let mut sink = [0u8; 64 * 1024];
    while Instant::now() < deadline {
        let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
        match stream.read(&mut sink) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return true,
        }
    }
    false
}

// ---- routing decides authentication ----

/// Spellings of a path that must never reach a protected handler without a token.
fn spellings(path: &str, addr: SocketAddr) -> Vec<String> {
    let rest = &path[1..];
    let (first, tail) = rest.split_once('/').unwrap_or((rest, ""));
    let join = |sep: &str| if tail.is_empty() { format!("/{first}{sep}") } else { format!("/{first}{sep}{tail}") };
    vec![
        format!("/{path}"),
        format!("//{path}"),
        format!("/.{path}"),
        format!("/x/..{path}"),
        join("/./"),
        join("/x/../"),
        join("%2F"),
        join("%2f"),
        join("/%2e/"),
        join("/%2e%2e/"),
        join("/%2E%2E/"),
        join("/%252e/"),
        format!("{path}/"),
        format!("{path};x"),
        format!("{path}%2F"),
        path.to_ascii_uppercase(),
        format!("/V1/{}", &path[4..]),
        format!("http://{addr}/{path}"),
        format!("http://{addr}//{path}"),
    ]
}

#[test]
fn no_spelling_of_a_path_reaches_a_protected_handler_without_a_token() {
    let edge = Edge::start(&[]);
    let before = edge.orders();
    let mut tried = 0;
    for route in payonce::api::routes().filter(|r| r.needs_token) {
        let path = route.template.replace(['{', '}'], "");
        let body = match (route.method, route.template) {
            ("POST", "/v1/orders") => json!({"order_no": "SPELL-1", "user_id": "u", "amount": 1}).to_string(),
            ("PUT", "/v1/admin/mode") => json!({"mode": "record_only"}).to_string(),
            _ => "{}".to_owned(),
        };
        let mut targets = spellings(&path, edge.addr);
        targets.push(path.clone());
        for target in &targets {
            let headers = [("Content-Type", "application/json")];
            let resp = util::request(edge.addr, route.method, target, &headers, body.as_bytes());
            assert!(
                !(200..300).contains(&resp.status),
                "{} {target} without a token answered {}: {}",
                route.method,
                resp.status,
                resp.text()
            );
            tried += 1;
        }
        // The canonical spelling is the route itself: 401, in the error shape.
        let resp =
            util::request(edge.addr, route.method, &path, &[("Content-Type", "application/json")], body.as_bytes());
        assert_eq!((resp.status, resp.error_code().as_str()), (401, "unauthorized"), "{} {path}", route.method);
    }
    assert!(tried > 200, "{tried} spellings tried");
    // The incident's own requests: the double slash is 404 and changes nothing.
    let resp = util::request(edge.addr, "PUT", "//v1/admin/mode", &[], br#"{"mode":"record_only"}"#);
    assert_eq!((resp.status, resp.error_code().as_str()), (404, "not_found"), "{}", resp.text());
    let statement = "pay_no,order_no,amount,status,paid_at\nFORGED-1,NO-SUCH,100,SUCCESS,2026-01-01T00:00:00Z\n";
    let resp = util::request(
        edge.addr,
        "POST",
        "//v1/reconciliations?repair=true",
        &[("Content-Type", "text/csv")],
        statement.as_bytes(),
    );
    assert_eq!(resp.status, 404, "{}", resp.text());
    assert_eq!(edge.mode(), "normal");
    assert_eq!(edge.orders(), before, "no order was created by any spelling");
    println!("edge: {tried} non-canonical spellings, none reached a handler");
}

#[test]
fn the_bearer_scheme_is_case_insensitive() {
    let edge = Edge::start(&[]);
    for auth in ["Bearer edge-token", "bearer edge-token", "BEARER edge-token", "BeArEr   edge-token"] {
        let resp = util::request(edge.addr, "GET", "/v1/admin/mode", &[("Authorization", auth)], b"");
        assert_eq!(resp.status, 200, "{auth:?}: {}", resp.text());
    }
    for auth in ["Basic edge-token", "Bearer", "Bearer wrong", "edge-token", "Beareredge-token"] {
        let resp = util::request(edge.addr, "GET", "/v1/admin/mode", &[("Authorization", auth)], b"");
        assert_eq!(resp.status, 401, "{auth:?}: {}", resp.text());
    }
}

// ---- framing ----

#[test]
fn pipelined_requests_run_in_order() {
    let edge = Edge::start(&[]);
    let mut stream = connect(edge.addr);
    let pairs = 100;
    let mut bytes = Vec::new();
    for i in 0..pairs {
        let body = json!({"order_no": format!("PIPE-{i}"), "user_id": "u-pipe", "amount": 100}).to_string();
        bytes.extend_from_slice(
            format!(
                "POST /v1/orders HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        );
        bytes.extend_from_slice(
            format!("GET /v1/orders/PIPE-{i} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n").as_bytes(),
        );
    }
    stream.write_all(&bytes).expect("write the pipeline");
    let (responses, _) = read_responses(&mut stream, pairs * 2);
    assert_eq!(responses.len(), pairs * 2, "every pipelined request answered");
    for (i, pair) in responses.chunks(2).enumerate() {
        assert_eq!(pair[0].status, 201, "POST {i}: {}", pair[0].text());
        assert_eq!(pair[1].status, 200, "GET {i} sees its POST: {}", pair[1].text());
        assert_eq!(pair[1].json()["order_no"], format!("PIPE-{i}"));
    }
}

/// A request hidden in a body: if any framing lets it run, the mode flips.
const SMUGGLED: &str = "PUT /v1/admin/mode HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer edge-token\r\nContent-Type: application/json\r\nContent-Length: 22\r\n\r\n{\"mode\":\"record_only\"}";

#[test]
fn ambiguous_framing_is_400_closes_the_connection_and_runs_no_hidden_request() {
    let edge = Edge::start(&[]);
    let chunked_then_smuggled = format!("0\r\n\r\n{SMUGGLED}");
    let framings: Vec<(&str, String, String)> = vec![
        ("CL+TE", "Content-Length: 5\r\nTransfer-Encoding: chunked".into(), chunked_then_smuggled.clone()),
        ("TE+CL", "Transfer-Encoding: chunked\r\nContent-Length: 300".into(), chunked_then_smuggled.clone()),
        ("TE gzip", "Transfer-Encoding: gzip".into(), chunked_then_smuggled.clone()),
        ("TE identity", "Transfer-Encoding: identity".into(), chunked_then_smuggled.clone()),
        ("TE xchunked", "Transfer-Encoding: xchunked".into(), chunked_then_smuggled.clone()),
        ("TE chunked, identity", "Transfer-Encoding: chunked, identity".into(), chunked_then_smuggled.clone()),
        ("TE identity, chunked", "Transfer-Encoding: identity, chunked".into(), chunked_then_smuggled.clone()),
        ("TE twice", "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked".into(), chunked_then_smuggled.clone()),
        ("CL twice, equal", "Content-Length: 2\r\nContent-Length: 2".into(), format!("{{}}{SMUGGLED}")),
        ("CL twice, different", "Content-Length: 2\r\nContent-Length: 200".into(), format!("{{}}{SMUGGLED}")),
        ("CL 0x0", "Content-Length: 0x0".into(), SMUGGLED.to_owned()),
        ("CL -1", "Content-Length: -1".into(), SMUGGLED.to_owned()),
        ("CL 0, 0", "Content-Length: 0, 0".into(), SMUGGLED.to_owned()),
        ("CL 23 digits", "Content-Length: 99999999999999999999999".into(), SMUGGLED.to_owned()),
    ];
    for (name, framing, body) in &framings {
        let mut stream = connect(edge.addr);
        let request = format!(
            "POST /v1/orders HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n{framing}\r\n\r\n{body}"
        );
        let _ = stream.write_all(request.as_bytes());
        let (responses, closed) = read_responses(&mut stream, 2);
        assert_eq!(responses.len(), 1, "{name}: exactly one answer, then the connection closes");
        // 400 in the error shape when payonce decides; hyper's own parser
        // answers some of these itself with a bare 400 or 431.
        assert!(matches!(responses[0].status, 400 | 431), "{name}: {} {}", responses[0].status, responses[0].text());
        assert!(closed, "{name}: the connection is closed after the refusal");
        assert_eq!(edge.mode(), "normal", "{name}: the request hidden in the body never ran");
    }
    assert_eq!(edge.orders(), 0, "no framing created an order");
}

// ---- sizes ----

#[test]
fn a_huge_content_length_is_413_at_once_and_allocates_nothing() {
    let edge = Edge::start(&[]);
    assert!(edge.healthy_within_deadline());
    let rss_before = edge.rss_kib();
    for length in ["1000000000000", "68719476736", "16777217"] {
        for path in ["/v1/orders", "/v1/callbacks/generic", "/v1/reconciliations"] {
            let mut stream = connect(edge.addr);
            let head = format!(
                "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: {length}\r\n\r\n"
            );
            stream.write_all(head.as_bytes()).expect("head");
            let (responses, _) = read_responses(&mut stream, 1);
            assert_eq!(responses.len(), 1, "{path} {length}: answered without a body");
            assert_eq!(responses[0].status, 413, "{path} {length}: {}", responses[0].text());
            assert_eq!(responses[0].error_code(), "payload_too_large");
        }
    }
    // Past u64's range the parser itself refuses (hyper: 431, the head cannot be held).
    let resp = util::parse_response(&util::raw(
        edge.addr,
        b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nContent-Length: 18446744073709551616\r\n\r\n",
    ));
    assert!(resp.is_some_and(|r| (400..500).contains(&r.status)));
    let rss_after = edge.rss_kib();
    assert!(rss_after < rss_before + 16 * 1024, "RSS {rss_before} KiB -> {rss_after} KiB");
    assert!(edge.healthy_within_deadline(), "the server lives on");
    println!("edge: huge Content-Length x9, RSS {rss_before} KiB -> {rss_after} KiB");
}

#[test]
fn a_wechatpay_notification_over_the_limit_is_refused_in_wechats_protocol() {
    let key = format!(
        "PUB_KEY_ID_TEST_A={}/tests/fixtures/TEST_ONLY_wechatpay_platform_a_public.pem",
        env!("CARGO_MANIFEST_DIR")
    );
    let edge =
        Edge::start(&["--wechatpay-apiv3-key", "TESTONLYapiv3key0123456789abcdef", "--wechatpay-public-key", &key]);
    let body = vec![b'x'; 70 * 1024];
    for chunked in [false, true] {
        let mut stream = connect(edge.addr);
        let framing =
            if chunked { "Transfer-Encoding: chunked".to_owned() } else { format!("Content-Length: {}", body.len()) };
        let mut request = format!(
            "POST /v1/callbacks/wechatpay HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{framing}\r\n\r\n"
        )
        .into_bytes();
        if chunked {
            request.extend_from_slice(format!("{:x}\r\n", body.len()).as_bytes());
            request.extend_from_slice(&body);
            request.extend_from_slice(b"\r\n0\r\n\r\n");
        } else {
            request.extend_from_slice(&body);
        }
        let _ = stream.write_all(&request);
        let (responses, _) = read_responses(&mut stream, 1);
        assert_eq!(responses[0].status, 413, "chunked={chunked}");
        let answer = responses[0].json();
        assert_eq!(answer["code"], "FAIL", "WeChat's own failure shape: {answer}");
    }
}

#[test]
fn heads_over_16_kib_or_100_headers_are_431_and_memory_is_given_back() {
    let edge = Edge::start(&[]);
    let request_with = |extra: &str| format!("GET /healthz HTTP/1.1\r\nHost: x\r\n{extra}Connection: close\r\n\r\n");
    let status_of = |bytes: &[u8]| util::parse_response(&util::raw(edge.addr, bytes)).map(|r| r.status);
    let big = format!("X-Big: {}\r\n", "a".repeat(17 * 1024));
    let refused = util::parse_response(&util::raw(edge.addr, request_with(&big).as_bytes()));
    assert_eq!(refused.as_ref().map(|r| r.status), Some(431));
    assert_eq!(refused.as_ref().and_then(|r| r.header("Connection")), Some("close"), "the parser's own refusal closes");
    let ninety_seven: String = (0..97).map(|i| format!("X-H{i}: v\r\n")).collect();
    assert_eq!(status_of(request_with(&ninety_seven).as_bytes()), Some(200), "100 headers are allowed");
    let one_hundred_one: String = (0..99).map(|i| format!("X-H{i}: v\r\n")).collect();
    assert_eq!(status_of(request_with(&one_hundred_one).as_bytes()), Some(431), "101 headers are not");

    // Eight concurrent 16 MiB headers, six rounds: the server reads 16 KiB of each.
    let rss_before = edge.rss_kib();
    let header = format!("GET /healthz HTTP/1.1\r\nHost: x\r\nX-Huge: {}", "h".repeat(16 * 1024 * 1024));
    for _ in 0..6 {
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (addr, header) = (edge.addr, header.clone());
                std::thread::spawn(move || {
                    let mut stream = connect(addr);
                    let _ = stream.write_all(header.as_bytes());
                    let mut out = Vec::new();
                    let _ = stream.read_to_end(&mut out);
                    util::parse_response(&out).map(|r| r.status)
                })
            })
            .collect();
        for t in threads {
            let status = t.join().expect("client thread");
            assert!(matches!(status, Some(431) | None), "{status:?}");
        }
    }
    let rss_after = edge.rss_kib();
    assert!(rss_after < rss_before + 32 * 1024, "RSS {rss_before} KiB -> {rss_after} KiB");
    assert!(edge.healthy_within_deadline());
    println!("edge: 48 x 16 MiB headers, RSS {rss_before} KiB -> {rss_after} KiB");
}

// ---- slow clients ----

#[test]
fn slowloris_is_cut_at_the_header_timeout_and_starves_nobody() {
    let edge = Edge::start(&["--header-read-timeout-ms", "2000"]);
    let mut slow: Vec<TcpStream> = (0..200).map(|_| connect(edge.addr)).collect();
    for stream in &mut slow {
        stream.write_all(b"GET /healthz HTTP/1.1\r\nX-Slow: ").expect("start a head");
    }
    let started = Instant::now();
    let mut answered = 0;
    // One header byte a second on every slow connection, while a normal client is served.
    while started.elapsed() < Duration::from_secs(4) {
        for stream in &mut slow {
            let _ = stream.write_all(b"a");
        }
        assert!(edge.healthy_within_deadline(), "a normal client is answered at {:?}", started.elapsed());
        answered += 1;
        std::thread::sleep(Duration::from_millis(1000));
    }
    let closed = slow.iter_mut().map(|s| closed_by_server(s, Duration::from_secs(2))).filter(|c| *c).count();
    assert_eq!(closed, 200, "every slow head was cut at the header timeout");
    println!("edge: slowloris x200 cut; {answered} normal requests answered meanwhile");
}

#[test]
fn a_body_that_never_ends_is_cut_and_holds_no_worker() {
    let edge = Edge::start(&["--body-read-timeout-ms", "1500", "--workers", "2"]);
    let head = |framing: &str| {
        format!("POST /v1/orders HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n{framing}\r\n\r\n")
    };
    let mut stalled = Vec::new();
    for i in 0..24 {
        let mut stream = connect(edge.addr);
        let request = match i % 3 {
            0 => format!("{}4\r\n{{\"a\"\r\n", head("Transfer-Encoding: chunked")),
            1 => format!("{}{{\"order_no\"", head("Content-Length: 1000")),
            _ => format!("{}{{", head("Content-Length: 65536\r\nConnection: Upgrade\r\nUpgrade: websocket")),
        };
        stream.write_all(request.as_bytes()).expect("write");
        stalled.push(stream);
    }
    // Two workers, 24 stalled bodies: a normal client still creates an order at once.
    let resp = util::request(
        edge.addr,
        "POST",
        "/v1/orders",
        &[AUTH, ("Content-Type", "application/json")],
        br#"{"order_no":"BODY-OK","user_id":"u","amount":1}"#,
    );
    assert_eq!(resp.status, 201, "{}", resp.text());
    for (i, stream) in stalled.iter_mut().enumerate() {
        let (responses, closed) = read_responses(stream, 1);
        assert_eq!(responses.first().map(|r| r.status), Some(408), "stalled body {i}");
        assert_eq!(responses[0].error_code(), "request_timeout");
        assert!(closed || closed_by_server(stream, Duration::from_secs(2)), "stalled body {i}: connection closed");
    }
    assert_eq!(edge.orders(), 1, "no stalled body became an order");
}

#[test]
fn keep_alive_idle_runs_from_the_end_of_a_response() {
    let edge = Edge::start(&["--keep-alive-idle-ms", "1500", "--header-read-timeout-ms", "600"]);
    let mut stream = connect(edge.addr);
    let get = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
    stream.write_all(get).expect("first request");
    assert_eq!(read_responses(&mut stream, 1).0[0].status, 200);
    // Idle longer than the header timeout, shorter than keep-alive: still open.
    std::thread::sleep(Duration::from_millis(1000));
    stream.write_all(get).expect("second request");
    assert_eq!(read_responses(&mut stream, 1).0[0].status, 200, "idle time is not header time");
    // Then idle past keep-alive: the server closes it.
    let idle_from = Instant::now();
    assert!(closed_by_server(&mut stream, Duration::from_secs(4)), "idle connection closed");
    let idle = idle_from.elapsed();
    assert!(idle >= Duration::from_millis(1200), "closed after {idle:?}, not before the keep-alive idle time");
}

#[test]
fn a_client_that_never_reads_its_answers_loses_the_connection() {
    let edge = Edge::start(&["--response-write-timeout-ms", "1000"]);
    let mut stream = connect(edge.addr);
    // A small receive window, so the server's writes stall quickly.
    // SAFETY: setsockopt on a socket this test owns, with a valid int.
    unsafe {
        use std::os::fd::AsRawFd;
        let size: libc::c_int = 4096;
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&size as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
    let requests = 4000;
    let pipeline =
        format!("GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n").repeat(requests);
    let mut writer = stream.try_clone().expect("clone");
    let writing = std::thread::spawn(move || {
        let _ = writer.write_all(pipeline.as_bytes());
    });
    // Never read; meanwhile others are served.
    std::thread::sleep(Duration::from_millis(3000));
    assert!(edge.healthy_within_deadline());
    stream.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let (responses, closed) = read_responses(&mut stream, requests);
    assert!(closed, "the server closed the connection");
    assert!(responses.len() < requests, "{} of {requests} answers were written", responses.len());
    let _ = writing.join();
}

// ---- descriptors ----

#[test]
fn after_emfile_the_server_backs_off_and_accepts_again() {
    let mut edge = Edge::start_with_nofile(
        &["--fd-reserve", "0", "--max-connections", "1000", "--header-read-timeout-ms", "60000"],
        Some(64),
    );
    assert!(edge.stderr().contains("clamped"), "--max-connections is clamped: {}", edge.stderr());
    // More idle connections than descriptors: accept fails with EMFILE.
    let idle: Vec<TcpStream> = (0..90).map(|_| connect(edge.addr)).collect();
    let exhausted_at = Instant::now();
    std::thread::sleep(Duration::from_millis(2500));
    let log = edge.stderr();
    let accept_errors = log.lines().filter(|l| l.contains("accepting a connection failed")).count();
    assert!(accept_errors >= 1, "the accept error is logged: {log}");
    let seconds = exhausted_at.elapsed().as_secs() as usize + 2;
    assert!(accept_errors <= seconds, "{accept_errors} accept errors logged in ~{seconds} s: at most one a second");
    drop(idle);
    // Descriptors are free again: a new client is answered.
    let started = Instant::now();
    let mut recovered = false;
    while started.elapsed() < Duration::from_secs(10) && !recovered {
        recovered = edge.healthy_within_deadline();
    }
    assert!(recovered, "the server accepts again once descriptors are free");
    assert!(edge.child.try_wait().ok().flatten().is_none(), "the process lives");
}

// ---- shutdown ----

#[test]
fn requests_caught_by_sigterm_get_503_with_the_error_shape_never_an_empty_500() {
    let mut edge = Edge::start(&[]);
    let addr = edge.addr;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients: Vec<_> = (0..8)
        .map(|c| {
            let stop = std::sync::Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut statuses = Vec::new();
                let mut n = 0;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) && n < 5000 {
                    let Ok(mut stream) = TcpStream::connect(addr) else { break };
                    let _ = stream.set_read_timeout(Some(Duration::from_secs(20)));
                    let mut burst = Vec::new();
                    for _ in 0..10 {
                        let body = json!({"order_no": format!("TERM-{c}-{n}"), "user_id": "u", "amount": 1}).to_string();
                        n += 1;
                        burst.extend_from_slice(
                            format!(
                                "POST /v1/orders HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                                body.len()
                            )
                            .as_bytes(),
                        );
                    }
                    if stream.write_all(&burst).is_err() {
                        break;
                    }
                    let (responses, _) = read_responses(&mut stream, 10);
                    statuses.extend(responses);
                }
                statuses
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(700));
    let _ = Command::new("kill").arg("-TERM").arg(edge.child.id().to_string()).status();
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let responses: Vec<HttpResponse> = clients.into_iter().flat_map(|c| c.join().expect("client")).collect();
    let refused = responses.iter().filter(|r| r.status == 503).count();
    for r in &responses {
        match r.status {
            201 => {}
            503 => {
                assert_eq!(r.error_code(), "shutting_down", "{}", r.text());
                assert!(r.header("Retry-After").is_some(), "503 carries Retry-After");
            }
            other => panic!("during shutdown: {other} {}", r.text()),
        }
    }
    let status = edge.child.wait().expect("wait");
    assert_eq!(status.code(), Some(0), "exit 0 after SIGTERM");
    let created = responses.iter().filter(|r| r.status == 201).count() as i64;
    // Every order created was answered 201 before its connection closed.
    let orders = edge.orders();
    assert_eq!(orders, created, "{orders} orders, {created} answered 201");
    println!("edge: SIGTERM in a burst: {created} created, {refused} refused with 503");
}

/// Requests queued behind busy workers at SIGTERM: each one a worker runs
/// is answered before its connection closes, so a committed callback is
/// never left unacknowledged, and one no worker began by the end of the
/// grace period is refused (503) rather than run unanswered. Two `/sync`
/// calls to a platform that never answers hold both workers past the grace
/// period; five callbacks, each on its own keep-alive connection, wait in
/// the queue when SIGTERM comes.
#[test]
fn requests_queued_behind_busy_workers_at_sigterm_are_answered_before_close() {
    const QUEUED: usize = 5;
    // A platform that accepts and never answers: each /sync waits out --platform-timeout-ms.
    let silent_platform = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let platform_base = format!("http://{}", silent_platform.local_addr().expect("addr"));
    let held = std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in silent_platform.incoming().take(2).flatten() {
            held.push(stream);
        }
        std::thread::sleep(Duration::from_secs(10));
        drop(held);
    });
    let key = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/keys/merchant.pem");
    let public = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/TEST_ONLY_wechatpay_platform_a_public.pem");
    let public = format!("S1={public}");
    let mut edge = Edge::start(&[
        "--workers",
        "2",
        // Shorter than the busy requests: the grace period ends with work queued.
        "--shutdown-grace-ms",
        "500",
        "--platform-timeout-ms",
        "1500",
        "--wechatpay-mchid",
        "1900000100",
        "--wechatpay-merchant-serial",
        "M1",
        "--wechatpay-merchant-key",
        key,
        "--wechatpay-public-key",
        &public,
        "--wechatpay-api-base",
        &platform_base,
    ]);
    let addr = edge.addr;
    for i in 0..QUEUED + 2 {
        let body = json!({"order_no": format!("QUEUE{i}"), "user_id": "u", "amount": 100}).to_string();
        let created =
            util::request(addr, "POST", "/v1/orders", &[AUTH, ("Content-Type", "application/json")], body.as_bytes());
        assert_eq!(created.status, 201, "{}", created.text());
    }
    let busy: Vec<_> = (0..2)
        .map(|i| {
            std::thread::spawn(move || {
                let path = format!("/v1/orders/QUEUE{}/sync", QUEUED + i);
                let headers = [AUTH, ("Content-Type", "application/json")];
                payonce_testclient::request(addr, "POST", &path, &headers, b"{}", Duration::from_secs(20)).ok()
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let queued: Vec<_> = (0..QUEUED)
        .map(|i| {
            std::thread::spawn(move || {
                let body =
                    json!({"pay_no": format!("QP-{i}"), "order_no": format!("QUEUE{i}"), "amount": 100, "status": "SUCCESS"})
                        .to_string();
                let sig = util::sign_now(SECRET, body.as_bytes());
                let mut stream = connect(addr);
                stream.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
                let request = format!(
                    "POST /v1/callbacks/generic HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                     Payonce-Signature: {sig}\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                stream.write_all(request.as_bytes()).expect("send");
                let (responses, _) = read_responses(&mut stream, 1);
                responses.into_iter().next()
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let _ = Command::new("kill").arg("-TERM").arg(edge.child.id().to_string()).status();
    let answers: Vec<Option<HttpResponse>> = queued.into_iter().map(|t| t.join().expect("client")).collect();
    for t in busy {
        let answer = t.join().expect("sync client").expect("the /sync a worker ran at SIGTERM is answered");
        assert_eq!(answer.status, 200, "the /sync in flight at SIGTERM is answered: {}", answer.text());
    }
    let status = edge.child.wait().expect("wait");
    assert_eq!(status.code(), Some(0), "exit 0 after SIGTERM");
    let conn = rusqlite::Connection::open(&edge.db).expect("open db");
    for (i, answer) in answers.iter().enumerate() {
        let recorded: i64 = conn
            .query_row("SELECT count(*) FROM pay_callback_log WHERE pay_no = ?1", [format!("QP-{i}")], |r| r.get(0))
            .expect("count");
        match answer {
            Some(a) if a.status == 200 => {
                assert_eq!(recorded, 1, "QP-{i} was acknowledged: {}", a.text());
            }
            Some(a) if a.status == 503 => {
                assert_eq!(a.error_code(), "shutting_down", "{}", a.text());
                assert_eq!(recorded, 0, "QP-{i} was refused, so it must not be recorded");
            }
            Some(a) => panic!("QP-{i}: {} {}", a.status, a.text()),
            None => panic!("QP-{i} got no answer (recorded {recorded} times): a committed request must be answered"),
        }
    }
    drop(held);
}
