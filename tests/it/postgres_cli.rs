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
