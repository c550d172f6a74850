//! Keys that change without a restart (docs/channels.md, "Keys and
//! rotation"): `SIGHUP` to the real binary re-reads every key file while
//! signed WeChat Pay notifications keep arriving, and the certificates'
//! expiry in `/metrics` and the inspection (`key_expiring`).

use crate::util::{self, metric, wait_for_metric, Server, TempDir};
use base64::Engine;
use rsa::pkcs1v15::SigningKey;
use rsa::pkcs8::{DecodePrivateKey, EncodePublicKey, LineEnding};
use rsa::signature::{SignatureEncoding, Signer};
use serde_json::{json, Value};
use sha2::Sha256;
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const WX_A_PRIVATE: &str = include_str!("../fixtures/TEST_ONLY_wechatpay_platform_a_private.pem");
const WX_B_PRIVATE: &str = include_str!("../fixtures/TEST_ONLY_wechatpay_platform_b_private.pem");
const OTHER_PRIVATE: &str = include_str!("../fixtures/TEST_ONLY_merchant_other_private.pem");
const WX_A_PRIVATE_PATH: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/TEST_ONLY_wechatpay_platform_a_private.pem");
const APIV3_KEY: &str = "TESTONLYapiv3key0123456789abcdef";
/// Never changes: the load is signed with it.
const SERIAL_STEADY: &str = "PUB_KEY_ID_STEADY";
/// Its file is rewritten: first the "other" key, then platform key B.
const SERIAL_ROTATED: &str = "PUB_KEY_ID_ROTATED";
/// Parallel senders of the load.
const SENDERS: usize = 3;
/// How long the test waits for a reload to show in `/metrics`.
const WAIT: Duration = Duration::from_secs(30);

/// A notification as sent: its headers and its body.
type Signed = (Vec<(String, String)>, Vec<u8>);

fn signing_key(pem: &str) -> SigningKey<Sha256> {
    SigningKey::new(rsa::RsaPrivateKey::from_pkcs8_pem(pem).expect("test private key"))
}

/// The public half of a private key, as `--wechatpay-public-key` reads it.
fn public_pem(private: &str) -> String {
    let key = rsa::RsaPrivateKey::from_pkcs8_pem(private).expect("test private key");
    key.to_public_key().to_public_key_pem(LineEnding::LF).expect("pem")
}

/// Replaces `path`'s content at once (a rename), as an operator's deploy does.
fn replace_file(path: &Path, content: &str) {
    let staged = path.with_extension("staged");
    std::fs::write(&staged, content).expect("write the new key file");
    std::fs::rename(&staged, path).expect("rename it into place");
}

/// A WeChat Pay payment notification of `order_no` (9900 fen), encrypted
/// with the APIv3 key and signed by `key` under `serial` now: (headers, body).
fn notice(order_no: &str, key: &SigningKey<Sha256>, serial: &str) -> Signed {
    notice_encrypted_with(APIV3_KEY, order_no, key, serial)
}

/// [`notice`], its resource encrypted with `apiv3_key`.
fn notice_encrypted_with(apiv3_key: &str, order_no: &str, key: &SigningKey<Sha256>, serial: &str) -> Signed {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::SeqCst);
    let body = util::wechatpay_payment_body(apiv3_key, order_no);
    let timestamp = (util::now_ms() / 1000).to_string();
    let sign_nonce = format!("KEYSRELOADNONCE{n:08}");
    let mut message = format!("{timestamp}\n{sign_nonce}\n").into_bytes();
    message.extend_from_slice(&body);
    message.push(b'\n');
    let signature = base64::engine::general_purpose::STANDARD.encode(key.sign(&message).to_bytes());
    let headers = vec![
        ("Content-Type".to_owned(), "application/json".to_owned()),
        ("Wechatpay-Serial".to_owned(), serial.to_owned()),
        ("Wechatpay-Timestamp".to_owned(), timestamp),
        ("Wechatpay-Nonce".to_owned(), sign_nonce),
        ("Wechatpay-Signature".to_owned(), signature),
        ("Wechatpay-Signature-Type".to_owned(), "WECHATPAY2-SHA256-RSA2048".to_owned()),
    ];
    (headers, body)
}

fn send(server_addr: std::net::SocketAddr, (headers, body): &Signed) -> util::HttpResponse {
    let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    util::request(server_addr, "POST", "/v1/callbacks/wechatpay", &headers, body)
}

fn create_order(server: &Server, order_no: &str) {
    let created = server.post_json("/v1/orders", &json!({"order_no": order_no, "user_id": "u1", "amount": 9900}));
    assert_eq!(created.status, 201, "{order_no}: {}", created.text());
}

/// Signed notifications of the steady key, sent by [`SENDERS`] threads
/// until stopped: every answer's status is kept.
struct Load {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    statuses: Arc<Mutex<Vec<u16>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    /// Re-deliveries of these pre-signed notices (each a genuine
    /// notification, answered 204 as applied or duplicate).
    fn start(addr: std::net::SocketAddr, notices: Vec<Signed>) -> Load {
        let (stop, sent) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let statuses: Arc<Mutex<Vec<u16>>> = Arc::default();
        let notices = Arc::new(notices);
        let threads = (0..SENDERS)
            .map(|t| {
                let (stop, sent, statuses, notices) =
                    (Arc::clone(&stop), Arc::clone(&sent), Arc::clone(&statuses), Arc::clone(&notices));
                std::thread::spawn(move || {
                    let mut i = t;
                    while !stop.load(Ordering::SeqCst) {
                        let status = send(addr, &notices[i % notices.len()]).status;
                        statuses.lock().expect("statuses").push(status);
                        sent.fetch_add(1, Ordering::SeqCst);
                        i += SENDERS;
                    }
                })
            })
            .collect();
        Load { stop, sent, statuses, threads }
    }

    /// Waits until `n` more notices were answered.
    fn wait_more(&self, n: u64) {
        let target = self.sent.load(Ordering::SeqCst) + n;
        let deadline = Instant::now() + WAIT;
        while self.sent.load(Ordering::SeqCst) < target {
            assert!(Instant::now() < deadline, "the load stalled");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn finish(self) -> Vec<u16> {
        self.stop.store(true, Ordering::SeqCst);
        for thread in self.threads {
            thread.join().expect("a sender");
        }
        let statuses = self.statuses.lock().expect("statuses").clone();
        statuses
    }
}

#[test]
fn sighup_keeps_the_old_key_for_a_broken_file_and_swaps_a_good_one_under_load() {
    let dir = TempDir::new("key-reload");
    let steady_file = dir.path("wechatpay-steady.pem");
    let rotated_file = dir.path("wechatpay-rotated.pem");
    std::fs::write(&steady_file, public_pem(WX_A_PRIVATE)).expect("write");
    std::fs::write(&rotated_file, public_pem(OTHER_PRIVATE)).expect("write");
    let (steady, old, new) = (signing_key(WX_A_PRIVATE), signing_key(OTHER_PRIVATE), signing_key(WX_B_PRIVATE));
    let log = dir.path("serve.log");
    let steady_flag = format!("{SERIAL_STEADY}={}", steady_file.display());
    let rotated_flag = format!("{SERIAL_ROTATED}={}", rotated_file.display());
    let mut server = Server::start_logged(
        &dir.path("payonce.db"),
        &[
            "--wechatpay-apiv3-key",
            APIV3_KEY,
            "--wechatpay-public-key",
            &steady_flag,
            "--wechatpay-public-key",
            &rotated_flag,
        ],
        Stdio::from(std::fs::File::create(&log).expect("log file")),
    );
    server.set_stderr_log(log.clone());
    let (ok, failed) = ("payonce_keys_reload_total{result=\"ok\"}", "payonce_keys_reload_total{result=\"failed\"}");
    assert_eq!((metric(&server, ok), metric(&server, failed)), (Some(0.0), Some(0.0)), "present at 0 from the start");

    let orders: Vec<String> = (0..12).map(|i| format!("KEYS-LOAD-{i:03}")).collect();
    for order_no in &orders {
        create_order(&server, order_no);
    }
    for order_no in ["KEYS-OLD-1", "KEYS-OLD-2", "KEYS-NEW-1", "KEYS-NEW-2"] {
        create_order(&server, order_no);
    }
    let load = Load::start(server.addr, orders.iter().map(|o| notice(o, &steady, SERIAL_STEADY)).collect());
    load.wait_more(20);
    assert_eq!(send(server.addr, &notice("KEYS-OLD-1", &old, SERIAL_ROTATED)).status, 204, "the old key before");

    // A broken file: the old key stays in use, the log names the file, the counter says failed.
    replace_file(&rotated_file, "-----BEGIN PUBLIC KEY-----\nnot a key\n-----END PUBLIC KEY-----\n");
    server.signal(1);
    wait_for_metric(&server, failed, 1.0);
    assert_eq!(metric(&server, ok), Some(0.0));
    load.wait_more(20);
    assert_eq!(send(server.addr, &notice("KEYS-OLD-2", &old, SERIAL_ROTATED)).status, 204, "the old key kept");
    let logged = std::fs::read_to_string(&log).expect("log");
    let line = logged
        .lines()
        .find(|l| l.contains("failed to load"))
        .unwrap_or_else(|| panic!("no line says a file failed: {logged}"));
    assert!(line.contains(&rotated_file.display().to_string()), "the line names the file: {line}");
    assert!(!line.contains(&steady_file.display().to_string()), "only the broken file is named: {line}");

    // A good file: the new key verifies from the reload on, the old one no longer.
    replace_file(&rotated_file, &public_pem(WX_B_PRIVATE));
    server.signal(1);
    wait_for_metric(&server, ok, 1.0);
    assert_eq!(metric(&server, failed), Some(1.0));
    load.wait_more(20);
    assert_eq!(send(server.addr, &notice("KEYS-NEW-1", &new, SERIAL_ROTATED)).status, 204, "the new key after");
    let refused = send(server.addr, &notice("KEYS-NEW-2", &old, SERIAL_ROTATED));
    assert_eq!(refused.status, 401, "the replaced key no longer verifies: {}", refused.text());
    let statuses = load.finish();
    assert!(statuses.len() >= 60, "{} notices sent", statuses.len());
    assert!(statuses.iter().all(|s| *s == 204), "every notice of the steady key was accepted: {statuses:?}");
    for order_no in orders.iter().map(String::as_str).chain(["KEYS-OLD-1", "KEYS-NEW-1"]) {
        let order = server.get(&format!("/v1/orders/{order_no}")).json();
        assert_eq!(order["status"], "PAID", "{order_no}: {order}");
    }
    assert_eq!(server.get("/v1/orders/KEYS-NEW-2").json()["status"], "PENDING");
    assert!(std::fs::read_to_string(&log).expect("log").contains("keys reloaded"));
}

/// A certificate for the platform key A, valid from now for `days` days (openssl, as an operator makes one).
#[test]
fn sighup_reads_the_apiv3_key_file_again_and_keeps_the_old_key_for_a_broken_one() {
    use std::os::unix::fs::PermissionsExt;
    const NEW_APIV3_KEY: &str = "TESTONLYnewapiv3key456789abcdefX";
    let dir = TempDir::new("apiv3-reload");
    let (key_file, apiv3_file) = (dir.path("wechatpay-steady.pem"), dir.path("apiv3-key"));
    std::fs::write(&key_file, public_pem(WX_A_PRIVATE)).expect("write");
    let write_apiv3 = |text: &str| {
        replace_file(&apiv3_file, text);
        std::fs::set_permissions(&apiv3_file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    };
    write_apiv3(&format!("{APIV3_KEY}\n"));
    let log = dir.path("serve.log");
    let key_flag = format!("{SERIAL_STEADY}={}", key_file.display());
    let apiv3_flag = apiv3_file.display().to_string();
    let mut server = Server::start_logged(
        &dir.path("payonce.db"),
        &["--wechatpay-apiv3-key-file", &apiv3_flag, "--wechatpay-public-key", &key_flag],
        Stdio::from(std::fs::File::create(&log).expect("log file")),
    );
    server.set_stderr_log(log.clone());
    let platform = signing_key(WX_A_PRIVATE);
    for order_no in ["APIV3-1", "APIV3-2", "APIV3-3", "APIV3-4"] {
        create_order(&server, order_no);
    }
    let (ok, failed) = ("payonce_keys_reload_total{result=\"ok\"}", "payonce_keys_reload_total{result=\"failed\"}");
    let under = |apiv3: &str, order_no: &str| {
        send(server.addr, &notice_encrypted_with(apiv3, order_no, &platform, SERIAL_STEADY))
    };
    assert_eq!(under(APIV3_KEY, "APIV3-1").status, 204, "the first key at start");

    // 31 bytes: refused, the old key kept and the file named.
    write_apiv3(&format!("{}\n", &NEW_APIV3_KEY[..31]));
    server.signal(1);
    wait_for_metric(&server, failed, 1.0);
    assert_eq!(under(APIV3_KEY, "APIV3-2").status, 204, "the old key kept");
    let logged = std::fs::read_to_string(&log).expect("log");
    assert!(
        logged.lines().any(|l| l.contains("failed to load") && l.contains(&apiv3_flag) && l.contains("32 bytes")),
        "a line names the APIv3 key file and why: {logged}"
    );
    assert!(!logged.contains(&NEW_APIV3_KEY[..31]) && !logged.contains(APIV3_KEY), "no key in the log");

    // The new key: what it encrypts decrypts from the reload on, the old one's no longer.
    write_apiv3(&format!("{NEW_APIV3_KEY}\n"));
    server.signal(1);
    wait_for_metric(&server, ok, 1.0);
    assert_eq!(under(NEW_APIV3_KEY, "APIV3-3").status, 204, "the new key after");
    let refused = under(APIV3_KEY, "APIV3-4");
    assert_eq!(refused.status, 400, "the replaced key no longer decrypts: {}", refused.text());
    for (order_no, status) in [("APIV3-1", "PAID"), ("APIV3-2", "PAID"), ("APIV3-3", "PAID"), ("APIV3-4", "PENDING")] {
        assert_eq!(server.get(&format!("/v1/orders/{order_no}")).json()["status"], status, "{order_no}");
    }
}

fn certificate(dir: &TempDir, days: u32) -> String {
    let path = dir.path(&format!("platform-{days}d.pem"));
    let out = std::process::Command::new("openssl")
        .args(["req", "-x509", "-key", WX_A_PRIVATE_PATH, "-days", &days.to_string(), "-subj", "/CN=payonce test"])
        .args(["-out", &path.display().to_string()])
        .output()
        .expect("openssl");
    assert!(out.status.success(), "openssl: {}", String::from_utf8_lossy(&out.stderr));
    path.display().to_string()
}

#[test]
fn a_certificate_29_days_from_expiry_is_key_expiring_and_31_days_is_not() {
    let dir = TempDir::new("key-expiry");
    let (soon, later) = (certificate(&dir, 29), certificate(&dir, 31));
    let made_ms = util::now_ms();
    let (soon_flag, later_flag) = (format!("SERIAL29D={soon}"), format!("SERIAL31D={later}"));
    let server = Server::start_on(
        &dir.path("payonce.db"),
        &[
            "--wechatpay-apiv3-key",
            APIV3_KEY,
            "--wechatpay-public-key",
            &soon_flag,
            "--wechatpay-public-key",
            &later_flag,
        ],
    );
    let day_s = 86_400.0;
    for (id, days) in [("SERIAL29D", 29.0), ("SERIAL31D", 31.0)] {
        let series = format!("payonce_key_expires_in_seconds{{platform=\"wechatpay\",id=\"{id}\"}}");
        let seconds = metric(&server, &series).unwrap_or_else(|| panic!("{series} missing"));
        let expected = days * day_s - (util::now_ms() - made_ms) as f64 / 1000.0;
        assert!((seconds - expected).abs() < 10.0, "{id}: {seconds} s, expected about {expected}");
    }
    let inspection = server.get("/v1/inspections").json();
    let expiring: Vec<&Value> =
        inspection["findings"].as_array().expect("findings").iter().filter(|f| f["kind"] == "key_expiring").collect();
    assert_eq!(expiring.len(), 1, "{inspection}");
    let detail = &expiring[0]["detail"];
    assert_eq!((detail["platform"].as_str(), detail["id"].as_str()), (Some("wechatpay"), Some("SERIAL29D")));
    let expires_ms =
        payonce::clock::parse_rfc3339_ms(detail["expires_at"].as_str().expect("expires_at")).expect("a time");
    assert!((expires_ms - (made_ms + 29 * 86_400_000)).abs() < 10_000, "{detail}");
    assert_eq!(expiring[0]["order_no"], "");
    assert_eq!(inspection["ok"], false);
    assert_eq!(metric(&server, "payonce_inspection_last_findings{kind=\"key_expiring\"}"), Some(1.0));
    let stats = server.get("/v1/admin/stats?window=1h").json();
    assert_eq!(stats["now"]["findings"]["key_expiring"], 1, "{}", stats["now"]);
}
