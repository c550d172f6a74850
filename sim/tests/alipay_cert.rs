//! Alipay's certificate mode end to end (docs/channels.md, "Keys and
//! rotation"): `payonce-sim platforms --key-mode certificate` plays Alipay
//! with a root file (an RSA and an ECDSA root), an Alipay public
//! certificate and the merchant's app certificate made at run time, checks
//! `app_cert_sn` and `alipay_root_cert_sn` on every request and names
//! `alipay_cert_sn` in every answer; a real `payonce serve` started with
//! the three certificate flags it printed pays, queries, closes and refunds
//! there, and takes the notices signed by the key of the Alipay public
//! certificate only. A payonce given another root file is refused by the
//! gateway. The processes: tests/common/serve.rs, which says when these
//! tests skip.

mod common;

use base64::Engine;
use common::platforms_sim::Sim;
use common::serve::{json_of, payonce_binary, Serve, MERCHANT_KEY, PUBLIC_BASE_URL};
use common::TempDir;
use rsa::pkcs1v15::SigningKey;
use rsa::pkcs8::DecodePrivateKey;
use rsa::signature::{SignatureEncoding, Signer};
use serde_json::{json, Value};
use sha2::Sha256;
use std::time::{Duration, Instant};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/");
/// The simulated Alipay signs with it (`--alipay-private-key`), so this
/// test can sign notifications as Alipay.
const ALIPAY_KEY: &str = "TEST_ONLY_alipay_platform_private.pem";
/// A key no certificate holds.
const OTHER_KEY: &str = "TEST_ONLY_merchant_other_private.pem";
const APP_ID: &str = "2021000000000000";

fn fixture(name: &str) -> String {
    format!("{FIXTURES}{name}")
}

fn signing_key(name: &str) -> SigningKey<Sha256> {
    let pem = std::fs::read_to_string(fixture(name)).expect("a key fixture");
    SigningKey::new(rsa::RsaPrivateKey::from_pkcs8_pem(&pem).expect("a PKCS#8 key"))
}

fn beijing_now() -> String {
    let now = time::OffsetDateTime::now_utc().to_offset(time::UtcOffset::from_hms(8, 0, 0).expect("+8"));
    let (date, clock) = (now.date(), now.time());
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}",
        date.year(),
        u8::from(date.month()),
        date.day(),
        clock.hour(),
        clock.minute(),
        clock.second()
    )
}

fn pct(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => char::from(b).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A TRADE_SUCCESS notice of `order_no` paid as `trade_no`, as Alipay sends
/// it in certificate mode (the same fields as in public-key mode), signed
/// with `key`: the form body.
fn notice(order_no: &str, trade_no: &str, total: &str, key: &SigningKey<Sha256>) -> Vec<u8> {
    let now = beijing_now();
    let mut params = vec![
        ("app_id", APP_ID.to_owned()),
        ("auth_app_id", APP_ID.to_owned()),
        ("buyer_id", "2088000000000000".to_owned()),
        ("charset", "utf-8".to_owned()),
        ("gmt_create", now.clone()),
        ("gmt_payment", now.clone()),
        ("notify_id", format!("cert{trade_no}")),
        ("notify_time", now),
        ("notify_type", "trade_status_sync".to_owned()),
        ("out_trade_no", order_no.to_owned()),
        ("receipt_amount", total.to_owned()),
        ("seller_id", "2088101106499364".to_owned()),
        ("total_amount", total.to_owned()),
        ("trade_no", trade_no.to_owned()),
        ("trade_status", "TRADE_SUCCESS".to_owned()),
        ("version", "1.0".to_owned()),
    ];
    params.sort();
    let content = params.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&");
    let sign = base64::engine::general_purpose::STANDARD.encode(key.sign(content.as_bytes()).to_bytes());
    params.push(("sign_type", "RSA2".to_owned()));
    params.push(("sign", sign));
    params.iter().map(|(k, v)| format!("{k}={}", pct(v))).collect::<Vec<_>>().join("&").into_bytes()
}

fn post_notice(serve: &Serve, body: &[u8]) -> (u16, String) {
    let headers = [("Content-Type", "application/x-www-form-urlencoded")];
    let reply = payonce_testclient::request(
        serve.addr,
        "POST",
        "/v1/callbacks/alipay",
        &headers,
        body,
        Duration::from_secs(30),
    )
    .expect("the notice");
    (reply.status, String::from_utf8_lossy(&reply.body).into_owned())
}

fn call(serve: &Serve, method: &str, path: &str, body: Option<&Value>) -> Value {
    let (status, answer) = serve.call(method, path, body);
    assert!((200..300).contains(&status), "{method} {path}: {status} {}", String::from_utf8_lossy(&answer));
    json_of(&answer)
}

fn order(serve: &Serve, order_no: &str) {
    let body = json!({"order_no": order_no, "user_id": "u1", "amount": 990, "currency": "CNY"});
    call(serve, "POST", "/v1/orders", Some(&body));
}

/// The order's payment made at Alipay (a precreate): its qr_code.
fn precreate(serve: &Serve, order_no: &str) -> Value {
    let body = json!({"channel": "alipay", "method": "precreate"});
    call(serve, "POST", &format!("/v1/orders/{order_no}/pay"), Some(&body))
}

fn status(serve: &Serve, order_no: &str) -> String {
    call(serve, "GET", &format!("/v1/orders/{order_no}"), None)["status"].as_str().unwrap_or_default().to_owned()
}

fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !check() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn cert_mode_sim() -> Sim {
    let alipay_key = fixture(ALIPAY_KEY);
    Sim::start(&[
        "--merchant-key",
        MERCHANT_KEY,
        "--public-base-url",
        PUBLIC_BASE_URL,
        "--key-mode",
        "certificate",
        "--alipay-private-key",
        &alipay_key,
    ])
}

#[test]
fn certificate_mode_pays_queries_closes_refunds_and_takes_only_the_certificates_notices() {
    let Some(exe) = payonce_binary() else { return };
    let mut sim = cert_mode_sim();
    let printed: Vec<&str> = sim.flags.iter().map(|(flag, _)| flag.as_str()).collect();
    for flag in ["--alipay-app-cert", "--alipay-public-cert", "--alipay-root-cert"] {
        assert!(printed.contains(&flag), "{flag} printed: {printed:?}");
    }
    assert!(!printed.contains(&"--alipay-public-key"), "{printed:?}");
    let root = std::fs::read_to_string(sim.flag("--alipay-root-cert")).expect("the root file");
    assert_eq!(root.matches("BEGIN CERTIFICATE").count(), 2, "an RSA and an ECDSA root");
    let dir = TempDir::new("alipay-cert");
    let serve = Serve::start(&exe, &dir.0.join("payonce.db"), &sim, &[], &[]);

    // A notice signed by the key of the Alipay public certificate: accepted.
    order(&serve, "ORD_CERT_NOTICE");
    let answer = precreate(&serve, "ORD_CERT_NOTICE");
    assert!(answer.to_string().contains("qr_code"), "{answer}");
    let trade_no = sim.command("pay alipay ORD_CERT_NOTICE");
    let (code, text) = post_notice(&serve, &notice("ORD_CERT_NOTICE", &trade_no, "9.90", &signing_key(ALIPAY_KEY)));
    assert_eq!((code, text.as_str()), (200, "success"));
    assert_eq!(status(&serve, "ORD_CERT_NOTICE"), "PAID");

    // Signed by a key in no certificate: refused, nothing recorded.
    order(&serve, "ORD_CERT_FORGED");
    precreate(&serve, "ORD_CERT_FORGED");
    let forged_no = sim.command("pay alipay ORD_CERT_FORGED");
    let (code, text) = post_notice(&serve, &notice("ORD_CERT_FORGED", &forged_no, "9.90", &signing_key(OTHER_KEY)));
    assert_eq!((code, text.as_str()), (401, "failure"));
    assert_eq!(status(&serve, "ORD_CERT_FORGED"), "PENDING");

    // The query (the forged notice's payment is real: the sync finds it).
    let synced = call(&serve, "POST", "/v1/orders/ORD_CERT_FORGED/sync", None);
    assert_eq!(synced["order"]["status"], "PAID", "{synced}");

    // The close.
    order(&serve, "ORD_CERT_CLOSE");
    precreate(&serve, "ORD_CERT_CLOSE");
    call(&serve, "POST", "/v1/orders/ORD_CERT_CLOSE/close", None);
    eventually("the trade closed at Alipay", || {
        sim.command("state ORD_CERT_CLOSE") == "wechatpay=none alipay=TRADE_CLOSED"
    });
    eventually("the order closed", || status(&serve, "ORD_CERT_CLOSE") == "CLOSED");

    // The refund.
    let refund = json!({"refund_no": "RF_CERT_1", "amount": 300});
    call(&serve, "POST", "/v1/orders/ORD_CERT_NOTICE/refunds", Some(&refund));
    eventually("the refund at Alipay", || sim.listing("refunds").iter().any(|r| r.contains("RF_CERT_1")));

    // Every request carried the right SNs: Alipay verified each.
    eventually("the refund call logged", || sim.calls().iter().any(|c| c.contains("alipay.trade.refund")));
    let calls = sim.calls();
    let alipay: Vec<&String> = calls.iter().filter(|c| c.starts_with("alipay ")).collect();
    assert!(alipay.iter().all(|c| c.contains(" verified ") && !c.contains("cert-sn")), "{alipay:?}");
}

/// The simulator's flags with `flag`'s file replaced by `file`.
fn flags_with(sim: &Sim, flag: &str, file: &str) -> Vec<(String, String)> {
    sim.flags
        .iter()
        .map(|(name, value)| (name.clone(), if name == flag { file.to_owned() } else { value.clone() }))
        .collect()
}

/// payonce holds another Alipay public certificate of the same key (the
/// fixture's): Alipay's answers name a certificate payonce does not hold;
/// they still verify with the key it holds, and the rotation is logged once.
#[test]
fn an_answer_naming_another_alipay_cert_sn_is_logged_once_and_still_verified() {
    let Some(exe) = payonce_binary() else { return };
    let mut sim = cert_mode_sim();
    let held = fixture("alipay-cert/TEST_ONLY_alipay_public_cert.crt");
    let flags = flags_with(&sim, "--alipay-public-cert", &held);
    let dir = TempDir::new("alipay-cert-rotation");
    let serve = Serve::start_flags(&exe, &dir.0.join("payonce.db"), &flags, &[], &[]);
    for order_no in ["ORD_CERT_ROT1", "ORD_CERT_ROT2"] {
        order(&serve, order_no);
        sim.command(&format!("open alipay {order_no} 990"));
        sim.command(&format!("pay alipay {order_no}"));
        let synced = call(&serve, "POST", &format!("/v1/orders/{order_no}/sync"), None);
        assert_eq!(synced["order"]["status"], "PAID", "verified with the key held: {synced}");
    }
    let log = serve.log();
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains("names another alipay_cert_sn")).collect();
    assert_eq!(warnings.len(), 1, "once per SN: {log}");
    assert!(warnings[0].contains("configured=fda53341ce3541f3df35ba3379c1d54e"), "{}", warnings[0]);
    assert!(warnings[0].contains("verified_with_held_key=yes"), "{}", warnings[0]);
}

#[test]
fn a_payonce_with_another_root_file_is_refused_by_the_gateway() {
    let Some(exe) = payonce_binary() else { return };
    let mut sim = cert_mode_sim();
    // The same app certificate and Alipay certificate, another root file.
    let other_root = fixture("alipay-cert/TEST_ONLY_alipay_root_cert.crt");
    let flags = flags_with(&sim, "--alipay-root-cert", &other_root);
    let dir = TempDir::new("alipay-cert-root");
    let serve = Serve::start_flags(&exe, &dir.0.join("payonce.db"), &flags, &[], &[]);
    order(&serve, "ORD_CERT_ROOT");
    sim.command("open alipay ORD_CERT_ROOT 990");
    let synced = call(&serve, "POST", "/v1/orders/ORD_CERT_ROOT/sync", None);
    assert_eq!(synced["order"]["status"], "PENDING", "{synced}");
    let alipay = synced["platforms"].as_array().expect("platforms").iter().find(|p| p["channel"] == "alipay").cloned();
    assert_eq!(alipay.as_ref().map(|p| p["state"].clone()), Some(json!("unknown")), "{synced}");
    let calls = sim.calls();
    assert!(
        calls.iter().any(|c| c.contains("alipay.trade.query") && c.ends_with("isv.invalid-root-cert-sn")),
        "{calls:?}"
    );
}
