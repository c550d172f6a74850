//! Secrets given as files change without a restart (docs/operations.md,
//! "Keys: SIGHUP and expiry"): `SIGHUP` to the real binary reads
//! `--callback-secret-file` and `--api-token-file` again while signed
//! callbacks keep arriving; a broken file keeps the old secret, is named in
//! the log and counted `failed`; a good one replaces the secret at once.

use crate::util::{self, Pay, Server, TempDir};
use serde_json::json;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// In every version of the callback secret file: the load is signed with it.
const STEADY: &str = "steady-callback-secret-0123456789";
const OLD: &str = "old-callback-secret-0123456789abc";
const NEW: &str = "new-callback-secret-0123456789abc";
const TOKEN_OLD: &str = "tok-old-0123456789abcdef";
const TOKEN_NEW: &str = "tok-new-0123456789abcdef";
const WAIT: Duration = Duration::from_secs(30);

/// Replaces `path`'s content at once (a rename), mode 0600 as payonce requires.
fn replace_file(path: &Path, content: &str) {
    let staged = path.with_extension("staged");
    std::fs::write(&staged, content).expect("write the new secret file");
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    std::fs::rename(&staged, path).expect("rename it into place");
}

fn with_token(server: &Server, token: &str, method: &str, path: &str, body: &str) -> util::HttpResponse {
    let bearer = format!("Bearer {token}");
    util::request(
        server.addr,
        method,
        path,
        &[("Authorization", &bearer), ("Content-Type", "application/json")],
        body.as_bytes(),
    )
}

/// A generic callback of `pay` signed with `secret` now, sent to `addr`.
fn callback(addr: std::net::SocketAddr, secret: &str, pay: Pay<'_>) -> util::HttpResponse {
    let body = pay.body().to_string();
    let signature = util::sign_now(secret, body.as_bytes());
    util::request(
        addr,
        "POST",
        "/v1/callbacks/generic",
        &[("Content-Type", "application/json"), ("Payonce-Signature", &signature)],
        body.as_bytes(),
    )
}

/// The value of `series` in `/metrics`, read with whichever token works now.
fn metric(server: &Server, series: &str) -> Option<f64> {
    [TOKEN_OLD, TOKEN_NEW].iter().find_map(|token| {
        let answer = with_token(server, token, "GET", "/metrics", "");
        (answer.status == 200).then(|| util::metric_in(&answer.text(), series))?
    })
}

fn wait_for(server: &Server, series: &str, value: f64) {
    let deadline = Instant::now() + WAIT;
    while metric(server, series) != Some(value) {
        assert!(Instant::now() < deadline, "{series} never read {value}: {:?}", metric(server, series));
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sighup_reads_the_secret_files_again_keeping_the_old_secret_for_a_broken_file() {
    let dir = TempDir::new("secret-reload");
    let (secret_file, token_file) = (dir.path("callback-secret"), dir.path("api-tokens"));
    replace_file(&secret_file, &format!("{STEADY}\n{OLD}\n"));
    replace_file(&token_file, &format!("ops:{TOKEN_OLD}\n"));
    let log = dir.path("serve.log");
    let mut server = Server::start_without_secret(
        &dir.path("payonce.db"),
        &[
            "--callback-secret-file",
            &secret_file.display().to_string(),
            "--api-token-file",
            &token_file.display().to_string(),
        ],
        Stdio::from(std::fs::File::create(&log).expect("log file")),
        &[("PAYONCE_API_TOKEN", "")],
    );
    server.set_stderr_log(log.clone());
    let (ok, failed) = ("payonce_keys_reload_total{result=\"ok\"}", "payonce_keys_reload_total{result=\"failed\"}");
    assert_eq!((metric(&server, ok), metric(&server, failed)), (Some(0.0), Some(0.0)));

    let orders: Vec<String> = (0..8).map(|i| format!("SECRET-LOAD-{i}")).collect();
    let named = ["SECRET-OLD-1", "SECRET-OLD-2", "SECRET-NEW-1", "SECRET-NEW-2"];
    for order_no in orders.iter().map(String::as_str).chain(named) {
        let body = json!({"order_no": order_no, "user_id": "u1", "amount": 500}).to_string();
        let created = with_token(&server, TOKEN_OLD, "POST", "/v1/orders", &body);
        assert_eq!(created.status, 201, "{order_no}: {}", created.text());
    }

    // The load: callbacks signed with the secret every version of the file keeps.
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let statuses = Arc::new(Mutex::new(Vec::new()));
    let senders: Vec<_> = (0..3)
        .map(|t| {
            let (stop, sent, statuses, orders) =
                (Arc::clone(&stop), Arc::clone(&sent), Arc::clone(&statuses), orders.clone());
            let addr = server.addr;
            std::thread::spawn(move || {
                let mut i = t;
                while !stop.load(Ordering::SeqCst) {
                    let order_no = &orders[i % orders.len()];
                    let pay_no = format!("PAY-{order_no}");
                    let pay = Pay { pay_no: &pay_no, order_no, amount: 500, status: "SUCCESS" };
                    let answer = callback(addr, STEADY, pay);
                    statuses.lock().expect("statuses").push(answer.status);
                    sent.fetch_add(1, Ordering::SeqCst);
                    i += 3;
                }
            })
        })
        .collect();
    let wait_more = |n: u64| {
        let target = sent.load(Ordering::SeqCst) + n;
        let deadline = Instant::now() + WAIT;
        while sent.load(Ordering::SeqCst) < target {
            assert!(Instant::now() < deadline, "the load stalled");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    wait_more(20);
    let pay = |pay_no, order_no| Pay { pay_no, order_no, amount: 500, status: "SUCCESS" };
    assert_eq!(callback(server.addr, OLD, pay("P-OLD-1", "SECRET-OLD-1")).status, 200, "the old secret before");

    // Broken files: an empty callback secret file, a token file with a bad entry.
    replace_file(&secret_file, "\n");
    replace_file(&token_file, "ops:has a space\n");
    server.signal(1);
    wait_for(&server, failed, 1.0);
    assert_eq!(metric(&server, ok), Some(0.0));
    wait_more(20);
    assert_eq!(callback(server.addr, OLD, pay("P-OLD-2", "SECRET-OLD-2")).status, 200, "the old secret kept");
    assert_eq!(with_token(&server, TOKEN_OLD, "GET", "/v1/orders/SECRET-OLD-2", "").status, 200, "old token kept");
    let logged = std::fs::read_to_string(&log).expect("log");
    for file in [&secret_file, &token_file] {
        let name = file.display().to_string();
        assert!(
            logged.lines().any(|l| l.contains("failed to load") && l.contains(&name)),
            "a line names {name}: {logged}"
        );
    }
    assert!(!logged.contains(TOKEN_OLD) && !logged.contains(OLD), "no secret in the log");

    // Good files: the new secret and token work from the reload on, the old ones no longer.
    replace_file(&secret_file, &format!("{STEADY},{NEW}\n"));
    replace_file(&token_file, &format!("ops:{TOKEN_NEW}\n"));
    server.signal(1);
    wait_for(&server, ok, 1.0);
    assert_eq!(metric(&server, failed), Some(1.0));
    wait_more(20);
    assert_eq!(callback(server.addr, NEW, pay("P-NEW-1", "SECRET-NEW-1")).status, 200, "the new secret after");
    let refused = callback(server.addr, OLD, pay("P-NEW-2", "SECRET-NEW-2"));
    assert_eq!(refused.status, 401, "the removed secret no longer verifies: {}", refused.text());
    assert_eq!(with_token(&server, TOKEN_OLD, "GET", "/v1/orders/SECRET-NEW-1", "").status, 401, "old token gone");
    let order = with_token(&server, TOKEN_NEW, "GET", "/v1/orders/SECRET-NEW-1", "");
    assert_eq!(order.json()["status"], "PAID", "{}", order.text());

    stop.store(true, Ordering::SeqCst);
    for sender in senders {
        sender.join().expect("sender");
    }
    let statuses = statuses.lock().expect("statuses").clone();
    assert!(statuses.len() >= 60, "{} callbacks sent", statuses.len());
    assert!(statuses.iter().all(|s| *s == 200), "every callback of the steady secret was accepted: {statuses:?}");
    for order_no in &orders {
        let order = with_token(&server, TOKEN_NEW, "GET", &format!("/v1/orders/{order_no}"), "").json();
        assert_eq!(order["status"], "PAID", "{order_no}: {order}");
    }
    let unpaid = with_token(&server, TOKEN_NEW, "GET", "/v1/orders/SECRET-NEW-2", "").json();
    assert_eq!(unpaid["status"], "PENDING");
}
