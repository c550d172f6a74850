//! WeChat Pay's platform certificates downloaded (`--wechatpay-platform-certs
//! auto`, docs/channels.md "Keys and rotation"), against the real binary on
//! real sockets: a scripted WeChat Pay (`platform_answers::Gateway`) serves
//! `GET /v3/certificates` from a state the test changes while it runs (it
//! rotates its certificate, moves the merchant to a public key, lets a
//! certificate expire, forges its answers), checks payonce's request
//! signature, and counts the downloads. The PyPI SDK `wechatpayv3` checks
//! the same notices and downloads, and signs notices payonce must accept.

use crate::platform_answers::{Gateway, Reply, Seen};
use crate::util::{self, metric, Server, TempDir};
use aes_gcm::aead::{Aead, Payload};
use aes_gcm::{Aes256Gcm, KeyInit, Nonce};
use base64::Engine;
use rsa::pkcs1v15::{Signature, SigningKey, VerifyingKey};
use rsa::pkcs8::{DecodePrivateKey, EncodePublicKey, LineEnding};
use rsa::signature::{SignatureEncoding, Signer, Verifier};
use serde_json::{json, Value};
use sha2::Sha256;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");
const APIV3_KEY: &str = "TESTONLYapiv3key0123456789abcdef";
const MCHID: &str = "1900000100";
const MERCHANT_SERIAL: &str = "MERCHANTSERIAL0001";
/// The first platform certificate (key A) and the one it rotates to (key B).
const SERIAL_1: &str = "5A3B1C0000000000000000000000000000000001";
const SERIAL_2: &str = "5A3B1C0000000000000000000000000000000002";
/// A short-lived certificate (the "other" key).
const SERIAL_SHORT: &str = "5A3B1C0000000000000000000000000000000003";
/// The WeChat Pay public key the merchant moves to (configured from the start).
const PUBLIC_KEY_ID: &str = "PUB_KEY_ID_0114232026120400000000000000000001";
/// How long the test waits for what must eventually happen.
const WAIT: Duration = Duration::from_secs(60);
/// Parallel senders of the storm.
const SENDERS: usize = 4;

fn private(name: &str) -> rsa::RsaPrivateKey {
    let pem = std::fs::read_to_string(format!("{FIXTURES}/{name}")).expect("fixture");
    rsa::RsaPrivateKey::from_pkcs8_pem(&pem).expect("PKCS#8 test key")
}

fn signer(name: &str) -> SigningKey<Sha256> {
    SigningKey::new(private(name))
}

const KEY_A: &str = "TEST_ONLY_wechatpay_platform_a_private.pem";
const KEY_B: &str = "TEST_ONLY_wechatpay_platform_b_private.pem";
const KEY_OTHER: &str = "TEST_ONLY_merchant_other_private.pem";
/// The key behind [`PUBLIC_KEY_ID`].
const KEY_PUBLIC: &str = "keys/platform.pem";
/// A key WeChat Pay never had: what a forger signs with.
const KEY_FORGER: &str = "TEST_ONLY_alipay_platform_private.pem";

fn base64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// A self-signed certificate of `key` with serial `serial` (openssl, as WeChat's are X.509 PEMs).
fn certificate(dir: &TempDir, key: &str, serial: &str) -> String {
    let path = dir.path(&format!("cert-{serial}.pem"));
    let out = std::process::Command::new("openssl")
        .args(["req", "-x509", "-key", &format!("{FIXTURES}/{key}"), "-days", "365", "-subj", "/CN=Tenpay.com Root CA"])
        .args(["-set_serial", &format!("0x{serial}"), "-out", &path.display().to_string()])
        .output()
        .expect("openssl");
    assert!(out.status.success(), "openssl: {}", String::from_utf8_lossy(&out.stderr));
    std::fs::read_to_string(path).expect("certificate")
}

/// One listed certificate: its serial, its PEM, until when it is listed as valid.
#[derive(Clone)]
struct Listed {
    serial: String,
    pem: String,
    expire_ms: i64,
}

/// How the scripted WeChat Pay answers a download.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Forgery {
    None,
    /// Signed by a key that is not WeChat Pay's, under a listed serial.
    ForeignSignature,
    /// Signed correctly by a certificate that the answer does not list.
    SignerNotListed,
    /// One byte of an encrypted certificate changed (the signature is over the changed body).
    TamperedCertificate,
}

/// What the simulated WeChat Pay does now.
struct State {
    listed: Vec<Listed>,
    /// The serial and key its answers (and notices) are signed with.
    signer: (String, &'static str),
    forgery: Forgery,
}

/// The simulated WeChat Pay: its state, and the gateway that serves it.
struct Wechat {
    state: Arc<Mutex<State>>,
    gateway: Gateway,
}

impl Wechat {
    fn start(listed: Vec<Listed>, signer: (&str, &'static str)) -> Wechat {
        let state =
            Arc::new(Mutex::new(State { listed, signer: (signer.0.to_owned(), signer.1), forgery: Forgery::None }));
        let merchant = private("keys/merchant.pem").to_public_key();
        let script_state = Arc::clone(&state);
        let gateway = Gateway::start(move |seen: &Seen| {
            if let Err(why) = merchant_signed(seen, &merchant) {
                return (401, Vec::new(), json!({"code": "SIGN_ERROR", "message": why}).to_string());
            }
            if seen.method != "GET" || seen.target != "/v3/certificates" {
                return (404, Vec::new(), json!({"code": "NOT_FOUND", "message": "no such API"}).to_string());
            }
            certificates(&script_state.lock().expect("state"))
        });
        Wechat { state, gateway }
    }

    fn set(&self, change: impl FnOnce(&mut State)) {
        change(&mut self.state.lock().expect("state"));
    }

    /// The downloads payonce made so far.
    fn downloads(&self) -> usize {
        self.gateway.seen().iter().filter(|s| s.target == "/v3/certificates").count()
    }

    /// The key and serial it signs notices with now.
    fn notice_signer(&self) -> (String, &'static str) {
        self.state.lock().expect("state").signer.clone()
    }
}

/// `Ok` when the request carries the merchant's valid `WECHATPAY2-SHA256-RSA2048` signature.
fn merchant_signed(seen: &Seen, merchant: &rsa::RsaPublicKey) -> Result<(), String> {
    let auth = seen.authorization.as_deref().ok_or("no Authorization")?;
    let list = auth.strip_prefix("WECHATPAY2-SHA256-RSA2048 ").ok_or("not WECHATPAY2-SHA256-RSA2048")?;
    let field = |name: &str| {
        list.split(',')
            .find_map(|p| p.trim().strip_prefix(&format!("{name}=\""))?.strip_suffix('"'))
            .ok_or(format!("no {name}"))
    };
    if field("mchid")? != MCHID || field("serial_no")? != MERCHANT_SERIAL {
        return Err("another merchant".into());
    }
    let message =
        format!("{}\n{}\n{}\n{}\n{}\n", seen.method, seen.target, field("timestamp")?, field("nonce_str")?, seen.body);
    let bytes = base64::engine::general_purpose::STANDARD.decode(field("signature")?).map_err(|e| e.to_string())?;
    let signature = Signature::try_from(bytes.as_slice()).map_err(|e| e.to_string())?;
    VerifyingKey::<Sha256>::new(merchant.clone()).verify(message.as_bytes(), &signature).map_err(|e| e.to_string())
}

/// The answer to `GET /v3/certificates` in this state.
fn certificates(state: &State) -> Reply {
    static N: AtomicU64 = AtomicU64::new(0);
    let cipher = Aes256Gcm::new_from_slice(APIV3_KEY.as_bytes()).expect("32 bytes");
    let data: Vec<Value> = state
        .listed
        .iter()
        .map(|cert| {
            let nonce = format!("cn{:010}", N.fetch_add(1, Ordering::SeqCst));
            let mut ciphertext = cipher
                .encrypt(Nonce::from_slice(nonce.as_bytes()), Payload { msg: cert.pem.as_bytes(), aad: b"certificate" })
                .expect("encrypt");
            if state.forgery == Forgery::TamperedCertificate {
                ciphertext[10] ^= 1;
            }
            json!({
                "serial_no": cert.serial,
                "effective_time": util::utc8_rfc3339(util::now_ms() - 86_400_000),
                "expire_time": util::utc8_rfc3339(cert.expire_ms),
                "encrypt_certificate": {
                    "algorithm": "AEAD_AES_256_GCM", "nonce": nonce, "associated_data": "certificate",
                    "ciphertext": base64(&ciphertext)
                }
            })
        })
        .collect();
    let body = json!({ "data": data }).to_string();
    let (serial, key) = match state.forgery {
        Forgery::ForeignSignature => (state.signer.0.clone(), KEY_FORGER),
        Forgery::SignerNotListed => (SERIAL_2.to_owned(), KEY_B),
        _ => state.signer.clone(),
    };
    let mut headers = signed_headers(&signer(key), &serial, body.as_bytes());
    headers.push(("Content-Type".into(), "application/json".into()));
    (200, headers, body)
}

/// `Wechatpay-*` headers of `body` signed by `key` under `serial` now.
fn signed_headers(key: &SigningKey<Sha256>, serial: &str, body: &[u8]) -> Vec<(String, String)> {
    static N: AtomicU64 = AtomicU64::new(0);
    let timestamp = (util::now_ms() / 1000).to_string();
    let nonce = format!("WXCERTSNONCE{:012}", N.fetch_add(1, Ordering::SeqCst));
    let mut message = format!("{timestamp}\n{nonce}\n").into_bytes();
    message.extend_from_slice(body);
    message.push(b'\n');
    vec![
        ("Wechatpay-Serial".into(), serial.to_owned()),
        ("Wechatpay-Timestamp".into(), timestamp),
        ("Wechatpay-Nonce".into(), nonce),
        ("Wechatpay-Signature".into(), base64(&key.sign(&message).to_bytes())),
        ("Wechatpay-Signature-Type".into(), "WECHATPAY2-SHA256-RSA2048".into()),
    ]
}

/// A payment notification of `order_no` (9900 fen), signed by `key` under `serial`: (headers, body).
fn notice(order_no: &str, key: &str, serial: &str) -> (Vec<(String, String)>, Vec<u8>) {
    let body = util::wechatpay_payment_body(APIV3_KEY, order_no);
    let mut headers = signed_headers(&signer(key), serial, &body);
    headers.push(("Content-Type".into(), "application/json".into()));
    (headers, body)
}

fn send(server: &Server, (headers, body): &(Vec<(String, String)>, Vec<u8>)) -> util::HttpResponse {
    let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    util::request(server.addr, "POST", "/v1/callbacks/wechatpay", &headers, body)
}

/// Delivers as WeChat Pay does: again, while the answer is not 2xx (its
/// retries are minutes apart; here a moment). The answers, in order.
fn deliver(server: &Server, key: &str, serial: &str, order_no: &str) -> Vec<u16> {
    let signed = notice(order_no, key, serial);
    let deadline = Instant::now() + WAIT;
    let mut answers = Vec::new();
    loop {
        let status = send(server, &signed).status;
        answers.push(status);
        if status == 204 || Instant::now() > deadline {
            return answers;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn create_order(server: &Server, order_no: &str) {
    let created = server.post_json("/v1/orders", &json!({"order_no": order_no, "user_id": "u1", "amount": 9900}));
    assert_eq!(created.status, 201, "{order_no}: {}", created.text());
}

fn status_of(server: &Server, order_no: &str) -> String {
    server.get(&format!("/v1/orders/{order_no}")).json()["status"].as_str().unwrap_or_default().to_owned()
}

const DOWNLOADS_OK: &str = "payonce_wechatpay_cert_downloads_total{result=\"ok\"}";
const DOWNLOADS_FAILED: &str = "payonce_wechatpay_cert_downloads_total{result=\"failed\"}";

fn expires_series(serial: &str) -> String {
    format!("payonce_key_expires_in_seconds{{platform=\"wechatpay\",id=\"{serial}\"}}")
}

/// The public-key file of [`KEY_PUBLIC`], for `--wechatpay-public-key`.
fn public_key_file(dir: &TempDir) -> String {
    let path = dir.path("pub-key.pem");
    let pem = private(KEY_PUBLIC).to_public_key().to_public_key_pem(LineEnding::LF).expect("pem");
    std::fs::write(&path, pem).expect("write");
    path.display().to_string()
}

/// `serve` with the downloads on against `wechat`, and these flags besides.
fn start(dir: &TempDir, wechat: &Wechat, extra: &[&str]) -> Server {
    let log = dir.path("serve.log");
    let mut args = vec![
        "--wechatpay-apiv3-key".to_owned(),
        APIV3_KEY.to_owned(),
        "--wechatpay-mchid".to_owned(),
        MCHID.to_owned(),
        "--wechatpay-merchant-serial".to_owned(),
        MERCHANT_SERIAL.to_owned(),
        "--wechatpay-merchant-key".to_owned(),
        format!("{FIXTURES}/keys/merchant.pem"),
        "--wechatpay-api-base".to_owned(),
        wechat.gateway.url(),
        "--wechatpay-platform-certs".to_owned(),
        "auto".to_owned(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let file = std::fs::File::create(&log).expect("log");
    let mut server = Server::start_logged(&dir.path("payonce.db"), &args, Stdio::from(file));
    server.set_stderr_log(log);
    server
}

fn far() -> i64 {
    util::now_ms() + 300 * 86_400_000
}

#[test]
fn a_storm_of_notices_survives_a_rotation_and_the_move_to_a_public_key() {
    let dir = TempDir::new("wx-certs-storm");
    let (cert_1, cert_2) = (certificate(&dir, KEY_A, SERIAL_1), certificate(&dir, KEY_B, SERIAL_2));
    let wechat = Wechat::start(
        vec![Listed { serial: SERIAL_1.into(), pem: cert_1.clone(), expire_ms: far() }],
        (SERIAL_1, KEY_A),
    );
    let public_flag = format!("{PUBLIC_KEY_ID}={}", public_key_file(&dir));
    let server = Arc::new(start(
        &dir,
        &wechat,
        &[
            "--wechatpay-public-key",
            &public_flag,
            "--wechatpay-cert-unknown-serial-interval-s",
            "1",
            "--wechatpay-cert-refresh-s",
            "1",
        ],
    ));
    assert_eq!(wechat.downloads(), 1, "one download at start");
    assert_eq!((metric(&server, DOWNLOADS_OK), metric(&server, DOWNLOADS_FAILED)), (Some(1.0), Some(0.0)));
    assert!(metric(&server, &expires_series(SERIAL_1)).is_some_and(|s| s > 86_400.0));

    let genuine: Vec<String> = (0..48).map(|i| format!("CERTS-STORM-{i:03}")).collect();
    let forged: Vec<String> = (0..12).map(|i| format!("CERTS-FORGED-{i:03}")).collect();
    for order_no in genuine.iter().chain(&forged) {
        create_order(&server, order_no);
    }
    let wechat = Arc::new(wechat);
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let refusals_before_acceptance = Arc::new(AtomicU64::new(0));
    let forged_accepted: Arc<Mutex<Vec<String>>> = Arc::default();
    let senders: Vec<_> = (0..SENDERS)
        .map(|t| {
            let (server, wechat, stop, sent) =
                (Arc::clone(&server), Arc::clone(&wechat), Arc::clone(&stop), Arc::clone(&sent));
            let (refused, forged_accepted) = (Arc::clone(&refusals_before_acceptance), Arc::clone(&forged_accepted));
            let (genuine, forged) = (genuine.clone(), forged.clone());
            std::thread::spawn(move || {
                let mut i = t;
                while !stop.load(Ordering::SeqCst) || i < genuine.len() {
                    // Genuine: signed by whatever WeChat Pay signs with now,
                    // delivered again until accepted (a notice not applied is
                    // a duplicate the next times round).
                    let (serial, key) = wechat.notice_signer();
                    let answers = deliver(&server, key, &serial, &genuine[i % genuine.len()]);
                    assert_eq!(answers.last(), Some(&204), "{serial}: a genuine notice never accepted: {answers:?}");
                    refused.fetch_add(answers.len() as u64 - 1, Ordering::SeqCst);
                    // Forged: a key not WeChat Pay's under each kind of serial.
                    let order_no = &forged[i % forged.len()];
                    for serial in [SERIAL_1, SERIAL_2, PUBLIC_KEY_ID, "5A3B1C00000000000000000000000000000000FF"] {
                        let status = send(&server, &notice(order_no, KEY_FORGER, serial)).status;
                        if status / 100 == 2 {
                            forged_accepted
                                .lock()
                                .expect("forged")
                                .push(format!("{order_no} under {serial}: {status}"));
                        }
                    }
                    sent.fetch_add(1, Ordering::SeqCst);
                    i += SENDERS;
                }
            })
        })
        .collect();
    let wait_sent = |more: u64| {
        let target = sent.load(Ordering::SeqCst) + more;
        let deadline = Instant::now() + WAIT;
        while sent.load(Ordering::SeqCst) < target {
            assert!(Instant::now() < deadline, "the storm stalled");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    wait_sent(12);
    // The rotation: the new certificate listed beside the old, learned by
    // the scheduled download (WeChat Pay lists a new certificate well before
    // it signs with it), then signing.
    wechat.set(|s| s.listed.push(Listed { serial: SERIAL_2.into(), pem: cert_2.clone(), expire_ms: far() }));
    util::eventually(WAIT, "the listed certificate downloaded", || {
        metric(&server, &expires_series(SERIAL_2)).is_some()
    });
    wait_sent(4);
    wechat.set(|s| s.signer = (SERIAL_2.into(), KEY_B));
    wait_sent(16);
    // The move to the public key (configured in payonce from the start).
    wechat.set(|s| s.signer = (PUBLIC_KEY_ID.into(), KEY_PUBLIC));
    wait_sent(16);
    stop.store(true, Ordering::SeqCst);
    for sender in senders {
        sender.join().expect("a sender");
    }

    assert_eq!(forged_accepted.lock().expect("forged").as_slice(), &[] as &[String], "no forged notice accepted");
    assert_eq!(refusals_before_acceptance.load(Ordering::SeqCst), 0, "no genuine notice refused, even once");
    for order_no in &genuine {
        assert_eq!(status_of(&server, order_no), "PAID", "{order_no}");
    }
    for order_no in &forged {
        assert_eq!(status_of(&server, order_no), "PENDING", "{order_no}");
    }
    // The old certificate, no longer signing, and the new one are both held; no download failed.
    assert!(metric(&server, &expires_series(SERIAL_2)).is_some(), "the rotated certificate in /metrics");
    assert!(metric(&server, &expires_series(SERIAL_1)).is_some(), "the old one until it expires");
    assert_eq!(metric(&server, DOWNLOADS_FAILED), Some(0.0));
    assert!(metric(&server, DOWNLOADS_OK).is_some_and(|n| n >= 2.0), "the rotation was downloaded");
    let log = std::fs::read_to_string(dir.path("serve.log")).expect("log");
    assert!(
        log.lines().any(|l| l.contains("learned a WeChat Pay platform certificate") && l.contains(SERIAL_2)),
        "{log}"
    );
    drop(server);
}

#[test]
fn a_download_that_does_not_verify_is_refused_and_nothing_is_learned() {
    let dir = TempDir::new("wx-certs-forged");
    let cert_1 = certificate(&dir, KEY_A, SERIAL_1);
    let wechat =
        Wechat::start(vec![Listed { serial: SERIAL_1.into(), pem: cert_1, expire_ms: far() }], (SERIAL_1, KEY_A));
    let public_flag = format!("{PUBLIC_KEY_ID}={}", public_key_file(&dir));
    for (n, forgery) in
        [Forgery::ForeignSignature, Forgery::SignerNotListed, Forgery::TamperedCertificate].into_iter().enumerate()
    {
        wechat.set(|s| s.forgery = forgery);
        let run = TempDir::new(&format!("wx-certs-forged-{n}"));
        // With a public key configured payonce starts anyway, and says so.
        let server = start(
            &run,
            &wechat,
            &["--wechatpay-public-key", &public_flag, "--wechatpay-cert-unknown-serial-interval-s", "0"],
        );
        let order_no = format!("CERTS-FORGED-DL-{n}");
        create_order(&server, &order_no);
        let refused = send(&server, &notice(&order_no, KEY_A, SERIAL_1));
        assert_eq!(refused.status, 503, "a download refused is a transient failure: {}", refused.text());
        assert_eq!(status_of(&server, &order_no), "PENDING");
        assert_eq!(metric(&server, DOWNLOADS_OK), Some(0.0));
        assert!(metric(&server, DOWNLOADS_FAILED).is_some_and(|n| n >= 2.0));
        assert_eq!(metric(&server, &expires_series(SERIAL_1)), None, "nothing learned");
        // The public key still serves.
        assert_eq!(deliver(&server, KEY_PUBLIC, PUBLIC_KEY_ID, &order_no), vec![204]);
        let log = std::fs::read_to_string(run.path("serve.log")).expect("log");
        assert!(log.contains("first WeChat Pay platform certificate download failed"), "{log}");
        assert!(log.lines().any(|l| l.contains("certificate download refused") && l.contains("why=")), "{log}");
    }
    // Without a public key, a first download refused stops `serve` with the reason.
    wechat.set(|s| s.forgery = Forgery::ForeignSignature);
    let (code, _, err) = util::payonce_cli(&[
        "serve",
        "--db",
        &dir.path("refused.db").display().to_string(),
        "--listen",
        "127.0.0.1:0",
        "--callback-secret",
        "s",
        "--wechatpay-apiv3-key",
        APIV3_KEY,
        "--wechatpay-mchid",
        MCHID,
        "--wechatpay-merchant-serial",
        MERCHANT_SERIAL,
        "--wechatpay-merchant-key",
        &format!("{FIXTURES}/keys/merchant.pem"),
        "--wechatpay-api-base",
        &wechat.gateway.url(),
        "--wechatpay-platform-certs",
        "auto",
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("first download of the platform certificates failed") && err.contains("does not verify"),
        "{err}"
    );
    // And `auto` without the calls' settings is refused, naming what is missing.
    let (code, _, err) = util::payonce_cli(&[
        "serve",
        "--db",
        &dir.path("missing.db").display().to_string(),
        "--listen",
        "127.0.0.1:0",
        "--callback-secret",
        "s",
        "--wechatpay-apiv3-key",
        APIV3_KEY,
        "--wechatpay-platform-certs",
        "auto",
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--wechatpay-platform-certs auto") && err.contains("--wechatpay-mchid"), "{err}");
}

#[test]
fn an_unlisted_certificate_serves_until_it_expires_and_an_expired_one_never() {
    let dir = TempDir::new("wx-certs-expiry");
    let (cert_1, cert_2) = (certificate(&dir, KEY_A, SERIAL_1), certificate(&dir, KEY_B, SERIAL_2));
    let cert_short = certificate(&dir, KEY_OTHER, SERIAL_SHORT);
    let short_until = util::now_ms() + 10_000;
    let wechat = Wechat::start(
        vec![
            Listed { serial: SERIAL_1.into(), pem: cert_1, expire_ms: far() },
            Listed { serial: SERIAL_SHORT.into(), pem: cert_short.clone(), expire_ms: short_until },
        ],
        (SERIAL_1, KEY_A),
    );
    let server = start(&dir, &wechat, &["--wechatpay-cert-unknown-serial-interval-s", "0"]);
    for order_no in ["CERTS-EXP-1", "CERTS-EXP-2", "CERTS-EXP-3", "CERTS-EXP-4", "CERTS-EXP-5"] {
        create_order(&server, order_no);
    }
    assert_eq!(send(&server, &notice("CERTS-EXP-1", KEY_OTHER, SERIAL_SHORT)).status, 204, "valid until it expires");
    // A downloaded certificate is watched like a configured one: the short one is key_expiring, the others not.
    let inspection = server.get("/v1/inspections").json();
    let expiring: Vec<&str> = inspection["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .filter(|f| f["kind"] == "key_expiring")
        .filter_map(|f| f["detail"]["id"].as_str())
        .collect();
    assert_eq!(expiring, vec![SERIAL_SHORT], "{inspection}");
    let seconds = metric(&server, &expires_series(SERIAL_SHORT)).expect("the short certificate in /metrics");
    assert!(seconds <= 10.0, "{seconds}");
    // WeChat Pay stops listing certificate 1 and lists 2: a notice of 2 makes payonce download.
    wechat.set(|s| {
        s.listed = vec![
            Listed { serial: SERIAL_2.into(), pem: cert_2, expire_ms: far() },
            Listed { serial: SERIAL_SHORT.into(), pem: cert_short, expire_ms: short_until },
        ];
        s.signer = (SERIAL_2.into(), KEY_B);
    });
    assert_eq!(send(&server, &notice("CERTS-EXP-2", KEY_B, SERIAL_2)).status, 204, "learned on its first notice");
    assert_eq!(wechat.downloads(), 2);
    assert_eq!(send(&server, &notice("CERTS-EXP-3", KEY_A, SERIAL_1)).status, 204, "no longer listed, not expired");
    assert!(metric(&server, &expires_series(SERIAL_1)).is_some());
    // SIGHUP re-reads the files and keeps what was downloaded.
    server.signal(1);
    util::eventually(WAIT, "the reload finished", || {
        metric(&server, "payonce_keys_reload_total{result=\"ok\"}") == Some(1.0)
    });
    assert_eq!(send(&server, &notice("CERTS-EXP-4", KEY_A, SERIAL_1)).status, 204, "kept across SIGHUP");
    // Past its expire_time the short certificate verifies nothing.
    while util::now_ms() <= short_until + 1_000 {
        std::thread::sleep(Duration::from_millis(100));
    }
    let expired = send(&server, &notice("CERTS-EXP-5", KEY_OTHER, SERIAL_SHORT));
    assert_eq!(expired.status, 401, "{}", expired.text());
    assert_eq!(status_of(&server, "CERTS-EXP-5"), "PENDING");
}

#[test]
fn downloads_for_unknown_serials_are_rate_limited() {
    let dir = TempDir::new("wx-certs-rate");
    let cert_1 = certificate(&dir, KEY_A, SERIAL_1);
    let wechat =
        Wechat::start(vec![Listed { serial: SERIAL_1.into(), pem: cert_1, expire_ms: far() }], (SERIAL_1, KEY_A));
    let server = Arc::new(start(&dir, &wechat, &["--wechatpay-cert-unknown-serial-interval-s", "3600"]));
    create_order(&server, "CERTS-RATE-1");
    assert_eq!(wechat.downloads(), 1);
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let server = Arc::clone(&server);
            std::thread::spawn(move || {
                (0..5)
                    .map(|i| {
                        let serial = format!("5A3B1C00000000000000000000000000000{t}{i:04}");
                        send(&server, &notice("CERTS-RATE-1", KEY_FORGER, &serial)).status
                    })
                    .collect::<Vec<u16>>()
            })
        })
        .collect();
    for thread in threads {
        let statuses = thread.join().expect("a sender");
        assert!(statuses.iter().all(|s| *s == 401), "unknown serials refused: {statuses:?}");
    }
    assert_eq!(wechat.downloads(), 2, "twenty unknown serials: one download within the interval");
    assert_eq!(status_of(&server, "CERTS-RATE-1"), "PENDING");
    assert_eq!(deliver(&server, KEY_A, SERIAL_1, "CERTS-RATE-1"), vec![204]);
}

// ---- interop with the PyPI SDK wechatpayv3 (scripts/wechatpay-venv) ----

/// The Python that has `wechatpayv3`: `PAYONCE_WECHATPAY_PYTHON`, else
/// target/wechatpay-venv's (scripts/wechatpay-venv), else `python3`.
fn sdk_python() -> String {
    if let Ok(python) = std::env::var("PAYONCE_WECHATPAY_PYTHON") {
        return python;
    }
    let venv = concat!(env!("CARGO_MANIFEST_DIR"), "/target/wechatpay-venv/bin/python");
    if std::path::Path::new(venv).exists() {
        venv.to_owned()
    } else {
        "python3".to_owned()
    }
}

/// One exchange with tests/wechatpay/sdk.py.
fn sdk(asked: &Value) -> Value {
    use std::io::Write;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/wechatpay/sdk.py");
    let mut child = std::process::Command::new(sdk_python())
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tests/wechatpay/sdk.py (python3)");
    child.stdin.take().expect("stdin").write_all(asked.to_string().as_bytes()).expect("write");
    let out = child.wait_with_output().expect("sdk.py");
    assert!(out.status.success(), "sdk.py: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("sdk.py answers JSON")
}

/// The value of header `name` of a signed notice.
fn header_of<'a>(signed: &'a (Vec<(String, String)>, Vec<u8>), name: &str) -> &'a str {
    signed.0.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str()).unwrap_or_default()
}

#[test]
fn the_wechatpayv3_sdk_and_payonce_agree_on_both_serial_kinds() {
    let probe = sdk(&json!({}));
    if probe["sdk"].is_null() {
        let required = std::env::var("PAYONCE_REQUIRE_WECHATPAY_SDK").is_ok_and(|v| v == "1");
        assert!(!required, "PAYONCE_REQUIRE_WECHATPAY_SDK=1 but wechatpayv3 is not importable by {}", sdk_python());
        eprintln!(
            "=== wechatpayv3 is missing: WeChat Pay interop NOT checked with the SDK (run scripts/wechatpay-venv) ==="
        );
        return;
    }
    let dir = TempDir::new("wx-certs-sdk");
    let cert_1 = certificate(&dir, KEY_A, SERIAL_1);
    let wechat =
        Wechat::start(vec![Listed { serial: SERIAL_1.into(), pem: cert_1, expire_ms: far() }], (SERIAL_1, KEY_A));
    let public_file = public_key_file(&dir);
    let server = start(&dir, &wechat, &["--wechatpay-public-key", &format!("{PUBLIC_KEY_ID}={public_file}")]);
    let pem = |name: &str| std::fs::read_to_string(format!("{FIXTURES}/{name}")).expect("fixture");
    // (serial, key, genuine): both kinds of serial, each also forged.
    let cases = [
        (SERIAL_1, KEY_A, true),
        (PUBLIC_KEY_ID, KEY_PUBLIC, true),
        (SERIAL_1, KEY_FORGER, false),
        (PUBLIC_KEY_ID, KEY_FORGER, false),
    ];
    let mut notices = Vec::new();
    for (i, (serial, key, _)) in cases.iter().enumerate() {
        let order_no = format!("CERTS-SDK-{i}");
        create_order(&server, &order_no);
        notices.push(notice(&order_no, key, serial));
    }
    // The SDK signs each notice's message with the same key: PKCS#1 v1.5 is
    // deterministic, so its signature is the one payonce is sent.
    let messages: Vec<Value> = notices
        .iter()
        .zip(&cases)
        .map(|(signed, (_, key, _))| {
            let message = format!(
                "{}\n{}\n{}\n",
                header_of(signed, "Wechatpay-Timestamp"),
                header_of(signed, "Wechatpay-Nonce"),
                String::from_utf8_lossy(&signed.1)
            );
            json!([message, pem(key)])
        })
        .collect();
    let public_pem = std::fs::read_to_string(&public_file).expect("public key");
    let answer = sdk(&json!({
        "sign": messages,
        "gateway": wechat.gateway.url(),
        "mchid": MCHID,
        "merchant_serial": MERCHANT_SERIAL,
        "merchant_key": pem("keys/merchant.pem"),
        "apiv3_key": APIV3_KEY,
        "public_key_id": PUBLIC_KEY_ID,
        "public_key": public_pem,
        "notices": notices.iter().map(|(headers, body)| json!({
            "headers": headers.iter().map(|(k, v)| (k.clone(), Value::from(v.as_str()))).collect::<serde_json::Map<String, Value>>(),
            "body": String::from_utf8_lossy(body),
        })).collect::<Vec<Value>>(),
    }));
    for (i, signed) in notices.iter().enumerate() {
        assert_eq!(answer["signatures"][i], header_of(signed, "Wechatpay-Signature"), "case {i}: the SDK's signature");
    }
    // The SDK reads the simulated WeChat Pay's download as payonce does.
    assert_eq!(answer["certificates"], json!([SERIAL_1]), "{answer}");
    let expected: Vec<bool> = cases.iter().map(|(_, _, genuine)| *genuine).collect();
    assert_eq!(answer["verdicts"], json!(expected), "the SDK's verdicts: {answer}");
    for (i, signed) in notices.iter().enumerate() {
        let status = send(&server, signed).status;
        assert_eq!(status == 204, expected[i], "case {i}: payonce answered {status}");
        assert_eq!(status_of(&server, &format!("CERTS-SDK-{i}")) == "PAID", expected[i], "case {i}");
    }
}
