//! Alipay's certificate mode and `SIGHUP` (docs/channels.md, "Keys and
//! rotation"), over the real binary with certificates openssl makes as an
//! operator's test CA would: a new Alipay public certificate swapped in
//! (its key verifies from then on, the old one no longer), a broken one
//! kept out (the old certificate stays, the log names the file), and each
//! certificate's expiry under its SN in `/metrics` and the inspection's
//! `key_expiring`.

use crate::util::{self, metric, wait_for_metric, Server, TempDir};
use base64::Engine;
use payonce::platforms::alipay::certs::read_cert;
use rsa::pkcs1v15::SigningKey;
use rsa::pkcs8::DecodePrivateKey;
use rsa::signature::{SignatureEncoding, Signer};
use serde_json::{json, Value};
use sha2::Sha256;
use std::path::Path;
use std::process::Stdio;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/");
/// Alipay's key of the first certificate, then the second's.
const KEY_A: &str = "TEST_ONLY_alipay_platform_private.pem";
const KEY_B: &str = "TEST_ONLY_wechatpay_platform_b_private.pem";
/// The test CA's key (and the app certificate's).
const CA_KEY: &str = "TEST_ONLY_merchant_other_private.pem";
const APP_ID: &str = "2021000000000042";

fn fixture(name: &str) -> String {
    format!("{FIXTURES}{name}")
}

fn openssl(args: &[&str]) {
    let out = std::process::Command::new("openssl").args(args).output().expect("openssl");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// The test CA's root certificate, in `dir`.
fn root(dir: &TempDir) -> String {
    let path = dir.path("root.pem").display().to_string();
    let subj = "/C=CN/O=TEST ONLY payonce CA/CN=TEST ONLY root";
    openssl(&["req", "-x509", "-key", &fixture(CA_KEY), "-days", "3650", "-subj", subj, "-out", &path]);
    path
}

/// A certificate of `key` issued by the root, valid for `days` from now: its path.
fn issued(dir: &TempDir, name: &str, key: &str, days: u32, serial: &str) -> String {
    let (csr, path) = (dir.path(&format!("{name}.csr")), dir.path(&format!("{name}.pem")));
    let (csr, path) = (csr.display().to_string(), path.display().to_string());
    openssl(&["req", "-new", "-key", &fixture(key), "-subj", &format!("/C=CN/O=TEST ONLY/CN={name}"), "-out", &csr]);
    let root = dir.path("root.pem").display().to_string();
    openssl(&[
        "x509",
        "-req",
        "-in",
        &csr,
        "-CA",
        &root,
        "-CAkey",
        &fixture(CA_KEY),
        "-days",
        &days.to_string(),
        "-set_serial",
        serial,
        "-out",
        &path,
    ]);
    path
}

fn sn(path: &str) -> String {
    read_cert(&std::fs::read_to_string(path).expect("a certificate"), false).expect("a certificate").sn
}

fn signing_key(name: &str) -> SigningKey<Sha256> {
    let pem = std::fs::read_to_string(fixture(name)).expect("a key fixture");
    SigningKey::new(rsa::RsaPrivateKey::from_pkcs8_pem(&pem).expect("a PKCS#8 key"))
}

/// A TRADE_SUCCESS notice of `order_no` (99.00), signed with `key`: the form body.
fn notice(order_no: &str, key: &SigningKey<Sha256>) -> Vec<u8> {
    let now = util::alipay_time(util::now_ms() - 1_000);
    let trade_no = format!("2026120422001{:015}", util::now_ms() % 1_000_000_000_000);
    let mut params: Vec<(&str, String)> = vec![
        ("app_id", APP_ID.into()),
        ("charset", "utf-8".into()),
        ("gmt_payment", now.clone()),
        ("notify_id", format!("reload{order_no}")),
        ("notify_time", now),
        ("notify_type", "trade_status_sync".into()),
        ("out_trade_no", order_no.into()),
        ("total_amount", "99.00".into()),
        ("trade_no", trade_no),
        ("trade_status", "TRADE_SUCCESS".into()),
        ("version", "1.0".into()),
    ];
    params.sort();
    let content = params.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&");
    let sign = base64::engine::general_purpose::STANDARD.encode(key.sign(content.as_bytes()).to_bytes());
    params.push(("sign_type", "RSA2".into()));
    params.push(("sign", sign));
    params.iter().map(|(k, v)| format!("{k}={}", util::form_encode(v))).collect::<Vec<_>>().join("&").into_bytes()
}

fn send(server: &Server, order_no: &str, key: &SigningKey<Sha256>) -> (u16, String) {
    let created = server.post_json("/v1/orders", &json!({"order_no": order_no, "user_id": "u1", "amount": 9900}));
    assert_eq!(created.status, 201, "{}", created.text());
    let headers = [("Content-Type", "application/x-www-form-urlencoded")];
    let answer = util::request(server.addr, "POST", "/v1/callbacks/alipay", &headers, &notice(order_no, key));
    (answer.status, answer.text())
}

fn expiry_series(sn: &str) -> String {
    format!("payonce_key_expires_in_seconds{{platform=\"alipay\",id=\"{sn}\"}}")
}

fn replace_file(path: &str, content: &str) {
    let staged = Path::new(path).with_extension("staged");
    std::fs::write(&staged, content).expect("write");
    std::fs::rename(&staged, path).expect("rename into place");
}

fn start(dir: &TempDir, app: &str, public: &str, root: &str) -> Server {
    let log = dir.path("serve.log");
    let mut server = Server::start_logged(
        &dir.path("payonce.db"),
        &[
            "--alipay-app-id",
            APP_ID,
            "--alipay-app-cert",
            app,
            "--alipay-public-cert",
            public,
            "--alipay-root-cert",
            root,
        ],
        Stdio::from(std::fs::File::create(&log).expect("log file")),
    );
    server.set_stderr_log(log);
    server
}

#[test]
fn sighup_swaps_a_new_alipay_public_certificate_and_keeps_the_old_one_for_a_broken_file() {
    let dir = TempDir::new("alipay-cert-reload");
    let root = root(&dir);
    let app = issued(&dir, "app", CA_KEY, 400, "0x0a01");
    let public = issued(&dir, "alipay-public", KEY_A, 400, "0x0a02");
    let new_cert = issued(&dir, "alipay-public-next", KEY_B, 400, "0x0a03");
    let (sn_a, sn_b) = (sn(&public), sn(&new_cert));
    let server = start(&dir, &app, &public, &root);
    let log = || std::fs::read_to_string(dir.path("serve.log")).expect("log");
    assert!(log().contains("channel alipay: app_id 2021000000000042, certificate mode"), "{}", log());
    assert!(metric(&server, &expiry_series(&sn_a)).is_some(), "the Alipay certificate's expiry under its SN");
    assert!(metric(&server, &expiry_series(&sn(&app))).is_some(), "the app certificate's");
    let (key_a, key_b) = (signing_key(KEY_A), signing_key(KEY_B));
    assert_eq!(send(&server, "ALICERT-A1", &key_a), (200, "success".to_owned()), "the certificate's key");
    assert_eq!(send(&server, "ALICERT-B1", &key_b).0, 401, "not yet the next certificate's");

    // A broken file: the old certificate stays, the log names the file.
    let (ok, failed) = ("payonce_keys_reload_total{result=\"ok\"}", "payonce_keys_reload_total{result=\"failed\"}");
    replace_file(&public, "-----BEGIN CERTIFICATE-----\nnot a certificate\n-----END CERTIFICATE-----\n");
    server.signal(1);
    wait_for_metric(&server, failed, 1.0);
    assert_eq!(send(&server, "ALICERT-A2", &key_a), (200, "success".to_owned()), "the old certificate kept");
    let logged = log();
    let line = logged.lines().find(|l| l.contains("failed to load")).unwrap_or_else(|| panic!("{logged}"));
    assert!(line.contains(&public), "the line names the file: {line}");
    assert!(!line.contains(&app) && !line.contains(&root), "only the broken file: {line}");
    assert!(metric(&server, &expiry_series(&sn_a)).is_some());

    // The next certificate: its key verifies, the old one no longer; /metrics follows.
    replace_file(&public, &std::fs::read_to_string(&new_cert).expect("the next certificate"));
    server.signal(1);
    wait_for_metric(&server, ok, 1.0);
    assert_eq!(send(&server, "ALICERT-B2", &key_b), (200, "success".to_owned()), "the new certificate's key");
    assert_eq!(send(&server, "ALICERT-A3", &key_a).0, 401, "the replaced certificate's key");
    assert!(metric(&server, &expiry_series(&sn_b)).is_some(), "the new SN");
    assert_eq!(metric(&server, &expiry_series(&sn_a)), None, "the old SN gone");
    for (order_no, status) in
        [("ALICERT-A1", "PAID"), ("ALICERT-A2", "PAID"), ("ALICERT-B2", "PAID"), ("ALICERT-A3", "PENDING")]
    {
        assert_eq!(server.get(&format!("/v1/orders/{order_no}")).json()["status"], status, "{order_no}");
    }
}

#[test]
fn an_alipay_certificate_29_days_from_expiry_is_key_expiring_under_its_sn() {
    let dir = TempDir::new("alipay-cert-expiry");
    let root = root(&dir);
    let made_ms = util::now_ms();
    let app = issued(&dir, "app", CA_KEY, 29, "0x0b01");
    let public = issued(&dir, "alipay-public", KEY_A, 31, "0x0b02");
    let server = start(&dir, &app, &public, &root);
    let day_s = 86_400.0;
    for (path, days) in [(&app, 29.0), (&public, 31.0)] {
        let series = expiry_series(&sn(path));
        let seconds = metric(&server, &series).unwrap_or_else(|| panic!("{series} missing"));
        let expected = days * day_s - (util::now_ms() - made_ms) as f64 / 1000.0;
        assert!((seconds - expected).abs() < 30.0, "{path}: {seconds} s, expected about {expected}");
    }
    let inspection = server.get("/v1/inspections").json();
    let expiring: Vec<&Value> =
        inspection["findings"].as_array().expect("findings").iter().filter(|f| f["kind"] == "key_expiring").collect();
    assert_eq!(expiring.len(), 1, "{inspection}");
    let detail = &expiring[0]["detail"];
    assert_eq!((detail["platform"].as_str(), detail["id"].as_str()), (Some("alipay"), Some(sn(&app).as_str())));
}
