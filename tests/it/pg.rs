//! PostgreSQL for the tests (docs/postgres.md, 'Tests'): where the PostgreSQL
//! half of the conformance suite gets its databases.
//!
//! The server is `PAYONCE_TEST_PG` (a `postgres://` URL of a server where
//! the tests may create databases) when it is set. Otherwise, when initdb is
//! found, the first caller starts one throwaway cluster for this test
//! process with `scripts/pg-cluster` (as a non-root user when run as root),
//! and a watchdog removes it once the process has exited, however it exits.
//! Without either, the PostgreSQL tests skip with one loud line on stderr,
//! unless `PAYONCE_REQUIRE_PG=1` (CI), which turns the skip into a panic.
//!
//! Every call to [`fresh_database`] is a new, empty database: the engine
//! under test applies `schema.postgres.sql` itself, as in production. On a
//! `PAYONCE_TEST_PG` server the databases stay behind for inspection, all
//! named `payonce_t_...`.

use postgres::error::SqlState;
use postgres::{Client, NoTls};
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// Whether the PostgreSQL tests can run. With `PAYONCE_REQUIRE_PG=1` the
/// answer is never "no": it panics instead, so a test that asks first cannot
/// skip silently in CI.
pub fn available() -> bool {
    server().is_some()
}

/// The URL of a brand-new empty database on the test server, or `None`
/// when PostgreSQL is unavailable (see the module documentation).
pub fn fresh_database(label: &str) -> Option<String> {
    let server = server()?;
    static N: AtomicU64 = AtomicU64::new(0);
    let mut admin = Client::connect(server, NoTls)
        .unwrap_or_else(|e| panic!("connecting to the test PostgreSQL at {}: {e}", redact(server)));
    loop {
        let name = database_name(label, N.fetch_add(1, Ordering::SeqCst));
        // A name left by an earlier process with the same pid is skipped, not reused.
        match admin.batch_execute(&format!("CREATE DATABASE {name}")) {
            Ok(()) => return Some(with_database(server, &name)),
            Err(e) if e.code() == Some(&SqlState::DUPLICATE_DATABASE) => continue,
            Err(e) => panic!("CREATE DATABASE {name} on {}: {e}", redact(server)),
        }
    }
}

pub(crate) fn required() -> bool {
    std::env::var("PAYONCE_REQUIRE_PG").is_ok_and(|v| v == "1")
}

/// The server's URL, found once per test process.
fn server() -> Option<&'static str> {
    static SERVER: OnceLock<Result<String, String>> = OnceLock::new();
    let found = SERVER.get_or_init(|| {
        let found = find_server();
        if let Err(why) = &found {
            if !required() {
                // Straight to fd 2: eprintln! would be captured by the test
                // harness and never shown for a test that passes by skipping.
                let _ = writeln!(
                    std::io::stderr(),
                    "=== PostgreSQL unavailable ({why}): the PostgreSQL half of the conformance suite is SKIPPED ==="
                );
            }
        }
        found
    });
    match found {
        Ok(url) => Some(url),
        Err(why) if required() => panic!("PAYONCE_REQUIRE_PG=1 but PostgreSQL is unavailable: {why}"),
        Err(_) => None,
    }
}

fn find_server() -> Result<String, String> {
    match std::env::var("PAYONCE_TEST_PG") {
        Ok(url) if !url.is_empty() => return Ok(url),
        _ => {}
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/pg-cluster");
    let found = Command::new(&script).arg("bindir").stdin(Stdio::null()).output();
    if !found.is_ok_and(|out| out.status.success()) {
        return Err("PAYONCE_TEST_PG unset and no initdb found".into());
    }
    let mut why = String::new();
    // A free port can be taken by someone else before the server binds it.
    for attempt in 0..3 {
        let dir = cluster_dir(attempt);
        let port = free_port()?;
        // The watchdog comes first, so no moment exists in which this process
        // could die leaving a running cluster without one.
        spawn_watchdog(&script, &dir)?;
        let out = Command::new(&script)
            .arg("start")
            .arg(&dir)
            .arg(port.to_string())
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("running {}: {e}", script.display()))?;
        if out.status.success() {
            return Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned());
        }
        why = format!("scripts/pg-cluster start failed: {}", String::from_utf8_lossy(&out.stderr).trim());
        let _ = Command::new(&script).arg("stop").arg(&dir).stdin(Stdio::null()).output();
    }
    Err(why)
}

pub(crate) fn cluster_dir(attempt: u32) -> PathBuf {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    std::env::temp_dir().join(format!("payonce-pg-{}-{nanos}-{attempt}", std::process::id()))
}

pub(crate) fn free_port() -> Result<u16, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("no free port: {e}"))?;
    listener.local_addr().map(|a| a.port()).map_err(|e| format!("no free port: {e}"))
}

/// A shell that outlives this process by a second at most, then stops and
/// removes the cluster. Its own process group and ignored signals keep a
/// Ctrl-C aimed at `cargo test` from killing it before its work is done;
/// no inherited pipe keeps a `| tee` of the test output waiting for it.
pub(crate) fn spawn_watchdog(script: &Path, dir: &Path) -> Result<(), String> {
    Command::new("sh")
        .arg("-c")
        .arg(r#"trap '' INT TERM HUP; while kill -0 "$1" 2>/dev/null; do sleep 1; done; exec "$2" stop "$3""#)
        .arg("payonce-pg-watchdog")
        .arg(std::process::id().to_string())
        .arg(script)
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .map(drop)
        .map_err(|e| format!("starting the cluster's watchdog: {e}"))
}

/// `payonce_t_<label>_<pid>_<n>`: lowercase and a valid unquoted identifier
/// whatever the label, within PostgreSQL's 63 bytes.
fn database_name(label: &str, n: u64) -> String {
    let mut label: String =
        label.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' }).collect();
    label.truncate(24);
    format!("payonce_t_{label}_{}_{n}", std::process::id())
}

/// `server` with its database replaced by `name`, query parameters kept.
fn with_database(server: &str, name: &str) -> String {
    let (base, query) = server.split_at(server.find('?').unwrap_or(server.len()));
    let authority = base.find("://").map_or(0, |i| i + 3);
    let base = match base[authority..].find('/') {
        Some(slash) => &base[..authority + slash],
        None => base,
    };
    format!("{base}/{name}{query}")
}

/// The URL without its password, for messages.
fn redact(url: &str) -> String {
    let authority = url.find("://").map_or(0, |i| i + 3);
    let end = url[authority..].find(['/', '?']).map_or(url.len(), |i| authority + i);
    match url[authority..end].rfind('@') {
        Some(at) => match url[authority..authority + at].find(':') {
            Some(colon) => format!("{}:***{}", &url[..authority + colon], &url[authority + at..]),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

#[test]
fn fresh_databases_are_new_empty_and_accept_connections() {
    if !available() {
        return;
    }
    let a = fresh_database("harness A").expect("a database from an available server");
    let b = fresh_database("harness A").expect("a second database from an available server");
    assert_ne!(a, b);
    let mut names = Vec::new();
    for url in [&a, &b] {
        let mut client = Client::connect(url, NoTls).unwrap_or_else(|e| panic!("connect {}: {e}", redact(url)));
        let row = client
            .query_one(
                "SELECT current_database(),
                        (SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                          WHERE n.nspname = 'public')",
                &[],
            )
            .unwrap();
        let name: String = row.get(0);
        let relations: i64 = row.get(1);
        assert!(url.contains(&format!("/{name}")), "{} is database {name}", redact(url));
        assert!(name.starts_with("payonce_t_harness_a_"), "{name}");
        assert_eq!(relations, 0, "{name} is not empty");
        names.push(name);
    }
    assert_ne!(names[0], names[1]);
}

#[test]
fn database_urls_keep_the_server_and_its_parameters() {
    assert_eq!(with_database("postgres://u@h:5/postgres", "d"), "postgres://u@h:5/d");
    assert_eq!(with_database("postgresql://u:p@h/x?sslmode=disable", "d"), "postgresql://u:p@h/d?sslmode=disable");
    assert_eq!(with_database("postgres://u@h:5", "d"), "postgres://u@h:5/d");
    assert_eq!(redact("postgres://u:s3cret@h:5/db"), "postgres://u:***@h:5/db");
    assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
    assert_eq!(database_name("Storm: 4 procs!", 7), format!("payonce_t_storm__4_procs__{}_7", std::process::id()));
}

/// The two schema files describe one database: the same tables with the same
/// columns in the same order, the same index names, every SQLite trigger with
/// its twin raising the same message, and the ledgers refusing TRUNCATE too.
/// Here because `schema.postgres.sql` has no engine of its own to drift with.
#[test]
fn schema_postgres_sql_is_schema_sql_on_postgres() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let sqlite_sql = std::fs::read_to_string(root.join("schema.sql")).unwrap();
    let pg_sql = std::fs::read_to_string(root.join("schema.postgres.sql")).unwrap();
    let messages: Vec<&str> =
        sqlite_sql.split("RAISE(ABORT, '").skip(1).map(|rest| rest.split("');").next().unwrap()).collect();
    assert!(messages.len() >= 15, "{messages:?}");
    for message in &messages {
        assert!(pg_sql.contains(&format!("RAISE EXCEPTION '{message}';")), "no PostgreSQL twin raises {message:?}");
    }

    let Some(url) = fresh_database("schema") else { return };
    let mut pg = Client::connect(&url, NoTls).unwrap();
    // As the engine applies it: the whole file in one transaction.
    let mut tx = pg.transaction().unwrap();
    tx.batch_execute(&pg_sql).expect("schema.postgres.sql applies in one transaction");
    tx.commit().unwrap();

    let lite = rusqlite::Connection::open_in_memory().unwrap();
    lite.execute_batch(&sqlite_sql).unwrap();
    let lite_names = |sql: &str| -> Vec<String> {
        let mut stmt = lite.prepare(sql).unwrap();
        let names = stmt.query_map([], |r| r.get(0)).unwrap().map(Result::unwrap).collect();
        names
    };
    let mut pg_names = |sql: &str| -> Vec<String> { pg.query(sql, &[]).unwrap().iter().map(|r| r.get(0)).collect() };

    let tables =
        lite_names("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name");
    assert_eq!(tables, pg_names("SELECT tablename::text FROM pg_tables WHERE schemaname = 'public' ORDER BY 1"));
    for table in &tables {
        let columns = lite_names(&format!("SELECT name FROM pragma_table_info('{table}')"));
        let pg_columns = pg_names(&format!(
            "SELECT column_name::text FROM information_schema.columns
              WHERE table_schema = 'public' AND table_name = '{table}' ORDER BY ordinal_position"
        ));
        assert_eq!(columns, pg_columns, "columns of {table}");
    }
    assert_eq!(
        lite_names("SELECT name FROM sqlite_master WHERE type = 'index' AND name NOT LIKE 'sqlite_%' ORDER BY name"),
        pg_names("SELECT indexname::text FROM pg_indexes WHERE schemaname = 'public' AND indexname NOT LIKE '%_pkey' ORDER BY 1")
    );
    let mut triggers = lite_names("SELECT name FROM sqlite_master WHERE type = 'trigger'");
    for ledger in [
        "orders",
        "pay_callback_log",
        "refund",
        "user_coupon",
        "point_log",
        "outbox_event",
        "audit_log",
        "platform_call",
    ] {
        triggers.push(format!("{ledger}_no_truncate"));
    }
    triggers.sort();
    assert_eq!(triggers, pg_names("SELECT tgname::text FROM pg_trigger WHERE NOT tgisinternal ORDER BY 1"));

    // A few refusals through the triggers, each with its SQLite message.
    pg.batch_execute(
        "INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at)
         VALUES ('ORD-1', 'u1', 9900, 'CNY', 'PENDING', '2026-01-01T00:00:00.000Z', '2026-01-01T00:15:00.000Z');
         INSERT INTO audit_log (at, actor, action, order_no, refund_no, detail)
         VALUES ('2026-01-01T00:00:00.000Z', 'system', 'unexpected_refund', 'ORD-1', 'RF-1', '{\"refund_no\":\"RF-1\"}');",
    )
    .unwrap();
    for (sql, message) in [
        ("UPDATE orders SET status = 'REFUNDED', refund_no = 'R', refunded_at = 't'", "illegal order transition"),
        ("UPDATE orders SET amount = 1", "an order's identity, amount and currency never change"),
        ("DELETE FROM orders", "orders are never deleted"),
        ("TRUNCATE orders CASCADE", "orders are never deleted"),
        ("UPDATE audit_log SET actor = 'x'", "audit_log is append-only"),
        ("TRUNCATE audit_log", "audit_log is append-only"),
    ] {
        let e = pg.batch_execute(sql).expect_err(sql);
        let db = e.as_db_error().unwrap_or_else(|| panic!("{sql}: {e}"));
        assert_eq!((db.code(), db.message()), (&SqlState::RAISE_EXCEPTION, message), "{sql}");
    }
    pg.batch_execute("DELETE FROM idempotency_key; DELETE FROM settings WHERE name = 'none'").unwrap();
    let mode: String = pg.query_one("SELECT value FROM settings WHERE name = 'mode'", &[]).unwrap().get(0);
    assert_eq!(mode, "normal");
}
