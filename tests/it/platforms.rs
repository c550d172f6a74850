//! Section 11's settings and `POST /v1/orders/{order_no}/sync` over HTTP
//! (the clients against the simulated platforms: sim/src/platform_api/payonce_sync.rs).

use crate::util::{payonce_cli, Server, TempDir};
use serde_json::json;

const MERCHANT_KEY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/keys/merchant.pem");

/// The public half of a fixture key, as `--wechatpay-public-key` and `--alipay-public-key` take it.
fn public_pem(dir: &TempDir) -> String {
    use rsa::pkcs8::{DecodePrivateKey, EncodePublicKey, LineEnding};
    let private = rsa::RsaPrivateKey::from_pkcs8_pem(&std::fs::read_to_string(MERCHANT_KEY).expect("fixture"))
        .expect("a PKCS#8 key");
    let path = dir.path("platform-public.pem");
    std::fs::write(&path, private.to_public_key().to_public_key_pem(LineEnding::LF).expect("pem")).expect("write");
    path.display().to_string()
}

#[test]
fn outgoing_settings_come_whole_or_serve_names_what_is_missing() {
    let dir = TempDir::new("platform-flags");
    let db = dir.path("payonce.db").display().to_string();
    let public = public_pem(&dir);
    let serve = |extra: &[&str]| {
        let mut args = vec!["serve", "--db", &db, "--listen", "127.0.0.1:0", "--dev"];
        args.extend(extra);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_payonce")).args(&args).output().expect("serve");
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, stderr) = serve(&["--wechatpay-mchid", "1900000100"]);
    assert_eq!(code, Some(2), "{stderr}");
    for missing in ["--wechatpay-merchant-serial", "--wechatpay-merchant-key", "--wechatpay-public-key"] {
        assert!(stderr.contains(missing), "names {missing}: {stderr}");
    }
    let (code, stderr) = serve(&["--alipay-app-private-key", MERCHANT_KEY]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--alipay-app-id") && stderr.contains("--alipay-public-key"), "{stderr}");
    let (code, stderr) = serve(&["--wechatpay-api-base", "ftp://example/"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--wechatpay-api-base"), "{stderr}");
    // v1's notification-only settings start exactly as before: a platform key needs the APIv3 key.
    let (code, stderr) = serve(&["--wechatpay-public-key", &format!("S1={public}")]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--wechatpay-apiv3-key"), "{stderr}");
}

#[test]
fn sync_asks_the_configured_platforms_and_says_when_one_cannot_answer() {
    let dir = TempDir::new("platform-sync");
    let public = public_pem(&dir);
    let key = format!("S1={public}");
    // Nothing listens on port 9: every platform call fails at once.
    let server = Server::start_on(
        &dir.path("payonce.db"),
        &[
            "--wechatpay-mchid",
            "1900000100",
            "--wechatpay-merchant-serial",
            "M1",
            "--wechatpay-merchant-key",
            MERCHANT_KEY,
            "--wechatpay-public-key",
            &key,
            "--wechatpay-api-base",
            "http://127.0.0.1:9",
            "--platform-timeout-ms",
            "2000",
        ],
    );
    let created = server.post_json("/v1/orders", &json!({"order_no": "ORD-SYNC-HTTP", "user_id": "u1", "amount": 100}));
    assert_eq!(created.status, 201);
    let synced = server.post_json("/v1/orders/ORD-SYNC-HTTP/sync", &json!({}));
    assert_eq!(synced.status, 200, "{}", synced.text());
    let body = synced.json();
    assert_eq!(body["order"]["status"], "PENDING");
    assert_eq!(
        body["platforms"],
        json!([{"channel": "wechatpay", "state": "unknown", "pay_no": null, "amount": null}])
    );
    // Never stored under an Idempotency-Key: the same key asks again.
    let keyed = crate::util::request(
        server.addr,
        "POST",
        "/v1/orders/ORD-SYNC-HTTP/sync",
        &[("Content-Type", "application/json"), ("Idempotency-Key", "k-1")],
        b"{}",
    );
    assert_eq!(keyed.status, 200);
    assert_eq!(keyed.header("Idempotent-Replayed"), None);
    let missing = server.post_json("/v1/orders/NO-SUCH/sync", &json!({}));
    assert_eq!((missing.status, missing.error_code().as_str()), (404, "order_not_found"));
    let db = server.db.display().to_string();
    drop(server);
    let conn = rusqlite::Connection::open(&db).expect("db");
    let failed: i64 = conn
        .query_row("SELECT count(*) FROM platform_call WHERE kind = 'query' AND status = 'failed'", [], |r| r.get(0))
        .expect("count");
    assert_eq!(failed, 2, "each call kept");

    // payonce sync: the same, offline; exit 1 because a platform could not answer.
    let (code, stdout, stderr) = payonce_cli(&[
        "sync",
        "--db",
        &db,
        "--wechatpay-mchid",
        "1900000100",
        "--wechatpay-merchant-serial",
        "M1",
        "--wechatpay-merchant-key",
        MERCHANT_KEY,
        "--wechatpay-public-key",
        &key,
        "--wechatpay-api-base",
        "http://127.0.0.1:9",
        "ORD-SYNC-HTTP",
    ]);
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    let printed: serde_json::Value = serde_json::from_str(&stdout).expect("JSON on stdout");
    assert_eq!(printed["platforms"][0]["state"], "unknown");
    let (code, _, stderr) = payonce_cli(&["sync", "--db", &db, "ORD-SYNC-HTTP"]);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("outgoing settings"), "{stderr}");
}
