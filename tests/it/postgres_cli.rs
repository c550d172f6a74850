//! The command line on a PostgreSQL URL: a password in it is never printed,
//! `backup` names pg_dump, and `inspect` and `reconcile` work on the URL.

use crate::util::payonce_cli;

#[test]
fn a_password_in_a_postgres_url_is_never_printed() {
    // Port 1 on loopback: nothing listens, the connection is refused at once.
    let url = "postgres://payonce:S3cretPassw0rd@127.0.0.1:1/payonce";
    let dir = crate::util::TempDir::new("pg-cli");
    let statement = dir.path("statement.csv");
    std::fs::write(&statement, "pay_no,order_no,amount,status,paid_at\n").expect("statement");
    let statement = statement.display().to_string();
    for args in [
        vec!["inspect", "--db", url],
        vec!["reconcile", "--db", url, "--statement", &statement],
        vec!["backup", "--db", url, "--to", "/tmp/never.db"],
    ] {
        let (code, stdout, stderr) = payonce_cli(&args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(
            !stdout.contains("S3cretPassw0rd") && !stderr.contains("S3cretPassw0rd"),
            "{args:?} printed the password: {stderr}"
        );
        assert!(stderr.contains("payonce:***@127.0.0.1:1"), "{args:?}: the URL is shown redacted: {stderr}");
    }
    let (_, _, stderr) = payonce_cli(&["backup", "--db", url, "--to", "/tmp/never.db"]);
    assert!(stderr.contains("pg_dump"), "backup on PostgreSQL names pg_dump: {stderr}");
}

#[test]
fn serve_refuses_an_unreachable_postgres_at_once_without_the_password() {
    let started = std::time::Instant::now();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_payonce"))
        .args(["serve", "--listen", "127.0.0.1:0", "--dev"])
        .env("PAYONCE_DB", "postgresql://payonce:S3cretPassw0rd@127.0.0.1:1/payonce")
        .output()
        .expect("run payonce serve");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(!stderr.contains("S3cretPassw0rd"), "{stderr}");
    assert!(stderr.contains("cannot connect to postgresql://payonce:***@127.0.0.1:1/payonce"), "{stderr}");
    assert!(String::from_utf8_lossy(&output.stdout).is_empty(), "nothing listened");
    assert!(started.elapsed() < std::time::Duration::from_secs(5), "refused at once, not after the pool's wait");
}

/// libpq's key-value form and the multi-host URL are PostgreSQL, never a
/// SQLite file of that name: payonce tries each host (both refuse here),
/// answers exit 2 naming them, prints no password and creates no file.
#[test]
fn the_key_value_form_and_several_hosts_are_postgres_never_a_file() {
    let dir = crate::util::TempDir::new("pg-kv");
    for db in [
        "host=127.0.0.1,127.0.0.1 port=1,2 dbname=payonce user=payonce password='S3cret Passw0rd' \
         target_session_attrs=read-write",
        "postgres://payonce:S3cretPassw0rd@127.0.0.1:1,127.0.0.1:2/payonce?target_session_attrs=read-write",
    ] {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_payonce"))
            .args(["serve", "--listen", "127.0.0.1:0", "--dev", "--db-connect-timeout-ms", "500"])
            .env("PAYONCE_DB", db)
            .current_dir(dir.path(""))
            .output()
            .expect("run payonce serve");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{db}: {stderr}");
        assert!(!stderr.contains("S3cret"), "{db}: {stderr}");
        assert!(stderr.contains("cannot connect to ") && stderr.contains("***"), "{db}: {stderr}");
        let files: Vec<_> = std::fs::read_dir(dir.path("")).expect("read the directory").collect();
        assert!(files.is_empty(), "{db}: a file was created: {files:?}");
    }
}

#[test]
fn the_database_timeouts_are_checked_settings() {
    for flag in ["--db-connect-timeout-ms", "--db-statement-timeout-ms"] {
        for bad in ["0", "-1", "soon"] {
            let (code, _, stderr) = payonce_cli(&["serve", "--dev", "--db", ":memory:", flag, bad]);
            assert_eq!(code, Some(2), "{flag} {bad}: {stderr}");
            assert!(stderr.contains(flag), "{flag} {bad}: the refusal names the flag: {stderr}");
        }
    }
}

for_each_engine! {
    /// `payonce inspect` and `reconcile` read the same database `serve` wrote, on either engine.
    fn offline_commands_work_on_the_database(db) {
        let server = db.serve(&[]);
        let resp = server.post_json("/v1/orders", &serde_json::json!({"order_no": "CLI-1", "user_id": "u1", "amount": 100}));
        assert_eq!(resp.status, 201, "{}", resp.text());
        let resp = crate::util::Pay { pay_no: "CLI-P1", order_no: "CLI-1", amount: 100, status: "SUCCESS" }.send(&server);
        assert_eq!(resp.status, 200, "{}", resp.text());
        let paid_at = server.get("/v1/orders/CLI-1").json()["paid_at"].as_str().expect("paid_at").to_owned();
        drop(server);
        let (code, stdout, stderr) = payonce_cli(&["inspect", "--db", &db.spec]);
        assert_eq!(code, Some(0), "{}: inspect: {stderr}", db.label());
        assert!(stdout.contains(r#""ok":true"#), "{}: {stdout}", db.label());
        let statement = db.dir.path("statement.csv");
        std::fs::write(&statement, format!("pay_no,order_no,amount,status,paid_at\nCLI-P1,CLI-1,100,SUCCESS,{paid_at}\n")).expect("statement");
        let statement = statement.display().to_string();
        let (code, stdout, stderr) = payonce_cli(&["reconcile", "--db", &db.spec, "--statement", &statement]);
        assert_eq!(code, Some(0), "{}: reconcile: {stdout} {stderr}", db.label());
    }
}

/// A throwaway cluster with TLS on (`scripts/pg-cluster start --ssl`), stopped on drop.
struct TlsCluster {
    dir: std::path::PathBuf,
    port: u16,
}

impl TlsCluster {
    /// `None` when PostgreSQL's server binaries are not on this machine
    /// (then a `PAYONCE_REQUIRE_PG=1` run fails instead).
    fn start() -> Option<TlsCluster> {
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/pg-cluster");
        let found = std::process::Command::new(&script).arg("bindir").output().is_ok_and(|o| o.status.success());
        if !found {
            assert!(
                std::env::var("PAYONCE_REQUIRE_PG").as_deref() != Ok("1"),
                "PAYONCE_REQUIRE_PG=1 but initdb is not on this machine: the TLS test cannot start its cluster"
            );
            eprintln!("=== initdb not found: the PostgreSQL TLS test is SKIPPED ===");
            return None;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port").local_addr().expect("addr").port();
        let dir = std::env::temp_dir().join(format!("payonce-pg-tls-{}-{port}", std::process::id()));
        let out = std::process::Command::new(&script)
            .args(["start", &dir.display().to_string(), &port.to_string(), "--ssl"])
            .output()
            .expect("run pg-cluster");
        assert!(out.status.success(), "pg-cluster start --ssl: {}", String::from_utf8_lossy(&out.stderr));
        Some(TlsCluster { dir, port })
    }

    fn url(&self, database: &str, query: &str) -> String {
        format!("postgres://payonce_test@127.0.0.1:{}/{database}{query}", self.port)
    }
}

impl Drop for TlsCluster {
    fn drop(&mut self) {
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/pg-cluster");
        let _ = std::process::Command::new(script).args(["stop", &self.dir.display().to_string()]).output();
    }
}

#[test]
fn sslmode_require_encrypts_and_verifies_the_server_certificate() {
    let Some(cluster) = TlsCluster::start() else { return };
    let mut admin = postgres::Client::connect(&cluster.url("postgres", ""), postgres::NoTls).expect("admin");
    admin.batch_execute("CREATE DATABASE tls").expect("create database");
    let ca = cluster.dir.join("ca.crt").display().to_string();
    let url = cluster.url("tls", "?sslmode=require");

    // Without the cluster's CA the certificate does not verify: refused, saying why.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_payonce"))
        .args(["inspect", "--db", &url])
        .env_remove("PAYONCE_DB_CA_FILE")
        .output()
        .expect("run inspect");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("invalid peer certificate"), "{stderr}");

    // With it, payonce serves over TLS: every connection it holds is encrypted.
    let dir = crate::util::TempDir::new("pg-tls");
    let log = std::fs::File::create(dir.path("serve.log")).expect("log");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_payonce"))
        .args(["serve", "--listen", "127.0.0.1:0", "--dev"])
        .env("PAYONCE_DB", &url)
        .env("PAYONCE_DB_CA_FILE", &ca)
        .stdout(std::process::Stdio::piped())
        .stderr(log)
        .spawn()
        .expect("spawn serve");
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().expect("stdout")), &mut line)
        .expect("first line");
    let addr: std::net::SocketAddr =
        line.trim().strip_prefix("listening on http://").expect(&line).parse().expect("addr");
    let resp = crate::util::request(
        addr,
        "POST",
        "/v1/orders",
        &[("Content-Type", "application/json")],
        br#"{"order_no":"TLS-1","user_id":"u1","amount":100}"#,
    );
    assert_eq!(resp.status, 201, "{}", resp.text());
    let rows = admin
        .query(
            "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
             WHERE a.application_name = 'payonce' AND a.datname = 'tls'",
            &[],
        )
        .expect("pg_stat_ssl");
    let _ = child.kill();
    let _ = child.wait();
    assert!(!rows.is_empty(), "payonce holds connections to the database");
    assert!(rows.iter().all(|r| r.get::<_, bool>(0)), "every payonce connection is TLS");
}

/// PostgreSQL re-runs a whole write body after a serialization failure (a
/// real `40001` raised by the server after the body ran), at most 5 times,
/// then answers 503 `database_busy` with nothing written.
#[test]
fn a_serialization_failure_reruns_the_whole_body_at_most_five_times() {
    let Some(db) = crate::engines::Db::postgres("retry") else { return };
    let store = db.store();
    store.fail_next_writes_serializing(2);
    // The body counts its runs through an atomic: `Fn` lets a body change
    // nothing it captured except on purpose, as here.
    let runs = std::sync::atomic::AtomicUsize::new(0);
    let created = store
        .write(&[], |tx| {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tx.insert_order(&crate::util::new_order("RETRY-1")).map(|r| r.is_ok())
        })
        .expect("the third attempt commits");
    assert!(created, "each attempt starts from nothing: the first two were rolled back");
    assert_eq!(runs.into_inner(), 3, "the body ran once per attempt");

    store.fail_next_writes_serializing(5);
    let runs = std::sync::atomic::AtomicUsize::new(0);
    let err = store
        .write(&[], |tx| {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tx.insert_order(&crate::util::new_order("RETRY-2")).map(|r| r.is_ok())
        })
        .expect_err("five failures in a row");
    assert_eq!(runs.into_inner(), 5, "at most 5 attempts");
    assert_eq!((payonce::api::status_of(err.kind), payonce::api::code_of(err.kind)), (503, "database_busy"), "{err}");
    assert_eq!(db.count(&store, "SELECT count(*) FROM orders WHERE order_no = 'RETRY-1'"), 1);
    assert_eq!(db.count(&store, "SELECT count(*) FROM orders WHERE order_no = 'RETRY-2'"), 0, "nothing written");
}
