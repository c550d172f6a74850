//! What the command line answers before it serves anything: its version, a
//! refused flag in one line, a `--db` of another database refused by name, a
//! start that cannot listen leaving no database file behind, and a secret
//! given as a flag warned about.

use crate::util::{payonce_cli, TempDir};
use std::net::TcpListener;
use std::process::{Command, Stdio};

#[test]
fn version_is_the_packages() {
    for flag in ["--version", "-V", "version"] {
        let (code, out, err) = payonce_cli(&[flag]);
        assert_eq!(code, Some(0), "{flag}: {err}");
        assert_eq!(out, format!("payonce {}\n", env!("CARGO_PKG_VERSION")), "{flag}");
    }
}

#[test]
fn a_refused_flag_or_command_is_one_line_pointing_at_the_help() {
    for (args, names) in [
        (&["serve", "--no-such-flag"][..], "--no-such-flag"),
        (&["inspect", "--no-such-flag"][..], "--no-such-flag"),
        (&["sign", "--no-such-flag"][..], "--no-such-flag"),
        (&["frobnicate"][..], "frobnicate"),
    ] {
        let (code, out, err) = payonce_cli(args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?}: nothing on stdout: {out}");
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 1, "{args:?}: one line: {err}");
        assert!(lines[0].contains(names) && lines[0].contains("help"), "{args:?}: {err}");
    }
}

/// `payonce serve ARGS` run in `dir` until it exits: (exit code, stderr).
fn serve_in(dir: &std::path::Path, args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_payonce"))
        .arg("serve")
        .args(args)
        .current_dir(dir)
        .env_remove("PAYONCE_CALLBACK_SECRET")
        .env_remove("PAYONCE_DB")
        .stdin(Stdio::null())
        .output()
        .expect("run payonce serve");
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn entries(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("read the directory")
        .map(|e| e.expect("an entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_db_of_another_database_is_refused_by_name_and_makes_no_file() {
    let dir = TempDir::new("cli-db-scheme");
    for db in ["mysql://shop:pw@db.example/pay", "sqlite:///var/lib/payonce.db", "redis://localhost"] {
        let (code, err) = serve_in(dir.path("").as_path(), &["--dev", "--listen", "127.0.0.1:0", "--db", db]);
        let scheme = db.split("://").next().unwrap_or_default();
        assert_eq!(code, Some(2), "{db}: {err}");
        assert!(err.contains(&format!("not {scheme}")) && err.contains("postgres://"), "{db}: {err}");
        assert!(!err.contains("pw"), "{db}: the URL's password is not repeated: {err}");
    }
    assert_eq!(entries(dir.path("").as_path()), Vec::<String>::new(), "no file named after a URL");
}

#[test]
fn a_start_that_cannot_listen_leaves_no_database_file() {
    let dir = TempDir::new("cli-busy-port");
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind a port");
    let addr = taken.local_addr().expect("its address").to_string();
    let (code, err) = serve_in(dir.path("").as_path(), &["--dev", "--listen", &addr, "--db", "ledger.db"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("cannot listen"), "{err}");
    assert_eq!(entries(dir.path("").as_path()), Vec::<String>::new(), "no ledger.db, -wal or -shm left behind");
}

#[test]
fn a_secret_given_as_a_flag_is_warned_about_naming_its_variable() {
    let dir = TempDir::new("cli-secret-flag");
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind a port");
    let addr = taken.local_addr().expect("its address").to_string();
    for (flag, value, env) in [
        ("--callback-secret", "s3cret-of-the-generic-channel", "PAYONCE_CALLBACK_SECRET"),
        ("--api-token", "ops:t0ken-value", "PAYONCE_API_TOKEN"),
    ] {
        // The port is taken, so the start ends right after the warnings.
        let (code, err) = serve_in(dir.path("").as_path(), &["--dev", "--listen", &addr, flag, value]);
        assert_eq!(code, Some(2), "{flag}: {err}");
        let warning = err.lines().find(|l| l.contains(flag)).unwrap_or_else(|| panic!("{flag}: no warning: {err}"));
        assert!(warning.contains("warning") && warning.contains(env), "{flag}: {warning}");
        assert!(!err.contains(value), "{flag}: the secret itself is never printed: {err}");
    }
    let (_, err) = serve_in(dir.path("").as_path(), &["--dev", "--listen", &addr]);
    assert!(!err.contains("visible to every user"), "no secret flag, no warning: {err}");
}

#[test]
fn log_format_json_writes_one_object_per_line() {
    use std::io::{BufRead, BufReader, Read};
    let mut child = Command::new(env!("CARGO_BIN_EXE_payonce"))
        .args(["serve", "--db", ":memory:", "--listen", "127.0.0.1:0", "--log-format", "json"])
        .env("PAYONCE_CALLBACK_SECRET", "a-secret-of-the-generic-channel")
        .env_remove("PAYONCE_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn payonce serve");
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
    let mut first = String::new();
    stdout.read_line(&mut first).expect("the listening line");
    let addr: std::net::SocketAddr = first
        .trim()
        .strip_prefix("listening on http://")
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("first line: {first}"));
    let body = br#"{"order_no":"LOG-1","user_id":"u","amount":100}"#;
    let created = crate::util::request(addr, "POST", "/v1/orders", &[("Content-Type", "application/json")], body);
    assert_eq!(created.status, 201);
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let mut stderr = String::new();
    child.stderr.take().expect("stderr").read_to_string(&mut stderr).expect("read stderr");
    assert_eq!(child.wait().expect("exit").code(), Some(0), "{stderr}");
    let logs: Vec<serde_json::Value> = stderr
        .lines()
        // `payonce: …` lines are the start's and stop's words, not log events.
        .filter(|line| !line.starts_with("payonce: "))
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not one JSON object: {line}: {e}")))
        .collect();
    assert!(logs.iter().all(|l| l["ts"].is_string() && l["level"].is_string() && l["msg"].is_string()), "{stderr}");
    let request = logs
        .iter()
        .find(|l| l["msg"] == "request" && l["route"] == "/v1/orders")
        .unwrap_or_else(|| panic!("the request's line: {stderr}"));
    assert_eq!((&request["method"], &request["status"]), (&serde_json::json!("POST"), &serde_json::json!("201")));
}

#[test]
fn the_start_names_each_channels_keys() {
    let dir = TempDir::new("cli-keys-named");
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind a port");
    let addr = taken.local_addr().expect("its address").to_string();
    let key = format!(
        "PUB_KEY_ID_TEST_A={}/tests/fixtures/TEST_ONLY_wechatpay_platform_a_public.pem",
        env!("CARGO_MANIFEST_DIR")
    );
    let out = Command::new(env!("CARGO_BIN_EXE_payonce"))
        .args(["serve", "--listen", &addr, "--wechatpay-public-key", &key])
        .current_dir(dir.path(""))
        .env("PAYONCE_CALLBACK_SECRET", "one-secret,another-secret")
        .env("PAYONCE_WECHATPAY_APIV3_KEY", "TESTONLYapiv3key0123456789abcdef")
        .env_remove("PAYONCE_DB")
        .stdin(Stdio::null())
        .output()
        .expect("run payonce serve");
    // The port is taken: the start stops right after naming what it loaded.
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let line = |prefix: &str| err.lines().find(|l| l.starts_with(prefix)).map(str::to_owned);
    assert_eq!(line("payonce: channel generic"), Some("payonce: channel generic: 2 HMAC secret(s)".into()), "{err}");
    let wechat = line("payonce: channel wechatpay").unwrap_or_else(|| panic!("no wechatpay line: {err}"));
    assert!(wechat.contains("PUB_KEY_ID_TEST_A (no expiry)"), "{wechat}");
    assert!(!err.contains("one-secret") && !err.contains("TESTONLYapiv3key"), "no secret is printed: {err}");
}

#[test]
fn alipay_certificate_mode_is_all_three_certificates_or_none_and_never_beside_the_public_key() {
    let dir = TempDir::new("cli-alipay-certs");
    let fixture = |name: &str| format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    let (app, public, root) = (
        fixture("alipay-cert/TEST_ONLY_app_cert.crt"),
        fixture("alipay-cert/TEST_ONLY_alipay_public_cert.crt"),
        fixture("alipay-cert/TEST_ONLY_alipay_root_cert.crt"),
    );
    let cases: [(&[&str], &str); 2] = [
        (
            &["--alipay-app-id", "2021", "--alipay-app-cert", &app, "--alipay-public-cert", &public],
            "missing --alipay-root-cert",
        ),
        (
            &[
                "--alipay-app-id",
                "2021",
                "--alipay-public-key",
                &fixture("TEST_ONLY_alipay_platform_public.pem"),
                "--alipay-app-cert",
                &app,
                "--alipay-public-cert",
                &public,
                "--alipay-root-cert",
                &root,
            ],
            "exclude each other",
        ),
    ];
    for (args, why) in cases {
        let args = [&["--callback-secret", "TEST-ONLY-secret"][..], args].concat();
        let (code, err) = serve_in(&dir.path(""), &args);
        assert_eq!(code, Some(2), "{err}");
        let lines: Vec<&str> = err.lines().filter(|l| l.contains("alipay")).collect();
        assert_eq!(lines.len(), 1, "one line: {err}");
        assert!(lines[0].contains(why), "{err}");
    }
}
