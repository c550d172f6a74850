//! A platform whose answers hold NUL bytes or invalid UTF-8 (docs/operations.md,
//! "Someone else's bytes, and NUL bytes"): `/sync` still answers, each call
//! is recorded with the bytes escaped, and an expired order's close still
//! gives up on time.
//! The platform is a raw socket here, so the answer is exactly the bytes
//! written, on both engines.

use crate::engines::{Db, Engine};
use crate::util::TempDir;
use serde_json::json;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MERCHANT_KEY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/keys/merchant.pem");

/// An HTTP server answering every request `200` with `body`, byte for
/// byte; it counts the requests. Lives as long as the test process.
struct RawPlatform {
    addr: SocketAddr,
    calls: Arc<AtomicUsize>,
}

impl RawPlatform {
    fn start(body: &'static [u8]) -> RawPlatform {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&calls);
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                counted.fetch_add(1, Ordering::SeqCst);
                std::thread::spawn(move || answer(stream, body));
            }
        });
        RawPlatform { addr, calls }
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

/// Reads the request's head (and whatever body came with it), then answers.
fn answer(mut stream: TcpStream, body: &[u8]) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
        }
    }
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(body);
    let _ = stream.flush();
}

/// The public half of a fixture key, as `--wechatpay-public-key` takes it.
fn public_pem(dir: &TempDir) -> String {
    use rsa::pkcs8::{DecodePrivateKey, EncodePublicKey, LineEnding};
    let private = rsa::RsaPrivateKey::from_pkcs8_pem(&std::fs::read_to_string(MERCHANT_KEY).expect("fixture"))
        .expect("a PKCS#8 key");
    let path = dir.path("platform-public.pem");
    std::fs::write(&path, private.to_public_key().to_public_key_pem(LineEnding::LF).expect("pem")).expect("write");
    format!("S1={}", path.display())
}

/// WeChat Pay's outgoing settings with its API at `platform`.
fn wechatpay_at(platform: &RawPlatform, public_key: &str) -> Vec<String> {
    [
        "--wechatpay-mchid",
        "1900000100",
        "--wechatpay-merchant-serial",
        "M1",
        "--wechatpay-merchant-key",
        MERCHANT_KEY,
        "--wechatpay-public-key",
        public_key,
        "--wechatpay-api-base",
        &format!("http://{}", platform.addr),
        "--platform-timeout-ms",
        "2000",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// An answer with NUL bytes in otherwise valid UTF-8 (it does not verify).
const NUL_ANSWER: &[u8] = b"{\"trade_state\":\"SUCCESS\",\"note\":\"a\x00b\x00\"}";
/// An answer that is not UTF-8 at all, with a NUL too.
const NOT_UTF8_ANSWER: &[u8] = b"{\"trade_state\":\"SUCCESS\",\"note\":\"\xff\xfe\x00\"}";

/// The rows of `platform_call` whose recorded response holds a raw NUL
/// (SQLite keeps one; PostgreSQL cannot, so 0 there by construction).
fn raw_nul_responses(db: &Db, store: &payonce::store::Store) -> i64 {
    match db.engine {
        Engine::Sqlite => db.count(store, "SELECT count(*) FROM platform_call WHERE instr(response, char(0)) > 0"),
        Engine::Postgres => 0,
    }
}

for_each_engine! {
    /// `/sync` against a platform answering NUL bytes or invalid UTF-8:
    /// 200 with the platform `unknown`, the call recorded escaped.
    fn sync_records_a_platforms_nul_bytes_escaped(db) {
        let dir = TempDir::new("platform-bytes");
        let key = public_pem(&dir);
        for (label, body) in [("nul", NUL_ANSWER), ("not-utf8", NOT_UTF8_ANSWER)] {
            let platform = RawPlatform::start(body);
            let flags = wechatpay_at(&platform, &key);
            let args: Vec<&str> = flags.iter().map(String::as_str).collect();
            let server = db.serve(&args);
            let order_no = format!("ORD-BYTES-{label}");
            let order = json!({"order_no": order_no, "user_id": "u1", "amount": 100});
            let created = server.post_json("/v1/orders", &order);
            assert_eq!(created.status, 201, "{}", created.text());
            let synced = server.post_json(&format!("/v1/orders/{order_no}/sync"), &json!({}));
            assert_eq!(synced.status, 200, "{label}: {}", synced.text());
            assert_eq!(synced.json()["platforms"][0]["state"], "unknown", "{label}");
            assert_eq!(synced.json()["order"]["status"], "PENDING", "{label}");
            assert_eq!(platform.calls(), 1, "{label}");
        }
        let store = db.store();
        let recorded = |sql: &str| db.count(&store, sql);
        assert_eq!(recorded("SELECT count(*) FROM platform_call WHERE kind = 'query' AND status = 'failed'"), 2);
        assert_eq!(raw_nul_responses(db, &store), 0, "{}: no raw NUL recorded", db.label());
        assert_eq!(
            recorded("SELECT count(*) FROM platform_call WHERE kind = 'query' AND response LIKE '%a_u0000b_u0000%'"),
            1,
            "{}: the NULs recorded as \\u0000",
            db.label()
        );
    }

    /// An expired order whose platform answers NUL bytes to every query is
    /// still closed when `--close-give-up-s` has passed.
    fn a_close_gives_up_on_time_when_the_platform_answers_nul_bytes(db) {
        let dir = TempDir::new("platform-bytes-close");
        let platform = RawPlatform::start(NUL_ANSWER);
        let mut flags = wechatpay_at(&platform, &public_pem(&dir));
        let pace = ["--sweep-interval-s", "1", "--platform-retry-s", "0.2", "--close-give-up-s", "1"];
        flags.extend(pace.map(String::from));
        let args: Vec<&str> = flags.iter().map(String::as_str).collect();
        let server = db.serve(&args);
        let created = server.post_json(
            "/v1/orders",
            &json!({"order_no": "ORD-BYTES-CLOSE", "user_id": "u1", "amount": 100, "expires_in_s": 1}),
        );
        assert_eq!(created.status, 201, "{}", created.text());
        let deadline = Instant::now() + Duration::from_secs(12);
        loop {
            let detail = server.get("/v1/orders/ORD-BYTES-CLOSE").json();
            if detail["status"] == "CLOSED" {
                let audit = detail["audit"].as_array().cloned().unwrap_or_default();
                let given_up = audit.iter().any(|a| a["action"] == "close_given_up");
                assert!(given_up, "closed by giving up: {detail}");
                break;
            }
            assert!(Instant::now() < deadline, "{}: never gave up ({} calls): {detail}", db.label(), platform.calls());
            std::thread::sleep(Duration::from_millis(100));
        }
        let store = db.store();
        let given_up = "SELECT count(*) FROM platform_call WHERE kind = 'close' AND status = 'given_up'";
        assert_eq!(db.count(&store, given_up), 1);
        assert_eq!(raw_nul_responses(db, &store), 0, "{}: no raw NUL recorded", db.label());
    }
}
