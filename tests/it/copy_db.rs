//! `payonce copy-db` (docs/postgres.md, "Moving from SQLite"): a SQLite
//! ledger with rows in many states, copied into an empty PostgreSQL
//! database, then served there by two payonce processes; and the copies it
//! refuses.

use crate::util::{payonce_cli, request, Pay, Server, TempDir};
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

const WEBHOOK_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

fn ok(resp: &crate::util::HttpResponse, what: &str) -> Value {
    assert!(resp.status == 200 || resp.status == 201, "{what}: {} {}", resp.status, resp.text());
    resp.json()
}

/// Orders PENDING, PAID, CLOSED, REFUNDING and REFUNDED (one partly); payments
/// applied, already_paid, paid_after_close, amount_mismatch and recorded
/// (record-only mode, then back); refunds succeeded, failed and in flight; a
/// frozen coupon and reversed points; audit rows; an answer kept under an
/// Idempotency-Key; webhook deliveries to an endpoint that refuses them.
/// The API's reads that must answer alike before and after the copy.
const SNAPSHOT_READS: [&str; 9] = [
    "/v1/orders/C-1",
    "/v1/orders/C-2",
    "/v1/orders/C-3",
    "/v1/orders/C-4",
    "/v1/orders/C-5",
    "/v1/orders/C-6",
    "/v1/orders/C-7",
    "/v1/events?limit=1000",
    "/v1/users/u1/coupons",
];

fn seed_sqlite(db: &Path) -> Vec<Value> {
    let server = Server::start_logged_env(
        db,
        &[
            "--coupon",
            "NEW10",
            "--points-per-yuan",
            "1",
            "--webhook-url",
            "http://127.0.0.1:9/refused",
            "--webhook-retry-s",
            "0.05,0.05",
            "--webhook-poll-ms",
            "20",
        ],
        std::process::Stdio::null(),
        &[("PAYONCE_WEBHOOK_SECRET", WEBHOOK_SECRET)],
    );
    let create = |order_no: &str, amount: i64| {
        ok(&server.post_json("/v1/orders", &json!({"order_no": order_no, "user_id": "u1", "amount": amount})), order_no)
    };
    let pay = |pay_no: &str, order_no: &str, amount: i64| {
        let resp = Pay { pay_no, order_no, amount, status: "SUCCESS" }.send(&server);
        assert_eq!(resp.status, 200, "{pay_no}: {}", resp.text());
        resp.json()["outcome"].as_str().unwrap_or_default().to_owned()
    };
    for (order_no, amount) in [("C-1", 1000), ("C-2", 2000), ("C-3", 3000), ("C-4", 4000), ("C-5", 500), ("C-6", 600)] {
        create(order_no, amount);
    }
    create("C-7", 700); // stays PENDING
    assert_eq!(pay("CP-1", "C-1", 1000), "applied");
    assert_eq!(pay("CP-1b", "C-1", 1000), "already_paid");
    assert_eq!(pay("CP-2", "C-2", 2000), "applied");
    assert_eq!(pay("CP-3", "C-3", 3000), "applied");
    assert_eq!(pay("CP-4", "C-4", 4100), "amount_mismatch");
    ok(&server.post_json("/v1/orders/C-5/close", &json!({})), "close C-5");
    assert_eq!(pay("CP-5", "C-5", 500), "paid_after_close");
    // C-2 refunded whole; C-3 partly, then a failed refund; another in flight.
    ok(&server.post_json("/v1/orders/C-2/refund", &json!({"refund_no": "CR-2"})), "refund C-2");
    let settle = |refund_no: &str, order_no: &str, status: &str| {
        let resp = server.callback(
            "/v1/callbacks/generic/refund",
            &json!({"refund_no": refund_no, "order_no": order_no, "status": status}),
        );
        assert_eq!(resp.status, 200, "{refund_no}: {}", resp.text());
    };
    settle("CR-2", "C-2", "SUCCESS");
    ok(&server.post_json("/v1/orders/C-3/refunds", &json!({"refund_no": "CR-3a", "amount": 1000})), "part of C-3");
    let resp = server.callback(
        "/v1/callbacks/generic/refund",
        &json!({"refund_no": "CR-3a", "order_no": "C-3", "status": "SUCCESS", "amount": 1000}),
    );
    assert_eq!(resp.status, 200, "{}", resp.text());
    ok(&server.post_json("/v1/orders/C-3/refunds", &json!({"refund_no": "CR-3b", "amount": 500})), "C-3 again");
    settle("CR-3b", "C-3", "FAILED");
    ok(&server.post_json("/v1/orders/C-3/refunds", &json!({"refund_no": "CR-3c", "amount": 700})), "in flight");
    // An operator's compensation and resolution.
    ok(
        &server.post_json(
            "/v1/compensations",
            &json!({"order_no": "C-1", "action": "freeze_coupon", "coupon_template_id": "NEW10", "reason": "copied"}),
        ),
        "freeze",
    );
    ok(
        &server.post_json(
            "/v1/admin/payments/CP-1b/resolve",
            &json!({"resolution": "refunded_externally", "reason": "returned by hand"}),
        ),
        "resolve",
    );
    // Record-only: C-6's payment waits, recorded.
    let keyed = request(
        server.addr,
        "PUT",
        "/v1/admin/mode",
        &[("Content-Type", "application/json"), ("Idempotency-Key", "copy-db-mode-1")],
        br#"{"mode":"record_only"}"#,
    );
    assert_eq!(keyed.status, 200, "{}", keyed.text());
    assert_eq!(pay("CP-6", "C-6", 600), "recorded");
    // The relay has tried (and failed) at least one delivery.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let deliveries = server.get("/v1/webhooks/deliveries?status=failed").json();
        if deliveries["deliveries"].as_array().is_some_and(|d| !d.is_empty()) {
            break;
        }
        assert!(Instant::now() < deadline, "no failed webhook delivery: {deliveries}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let snapshot = SNAPSHOT_READS.iter().map(|path| settled(ok(&server.get(path), path))).collect();
    drop(server);
    snapshot
}

/// An answer without its webhook deliveries, which the relay moves on (an
/// attempt, a retry) until the server stops; their rows are compared by the
/// copy's own checksum.
fn settled(mut answer: Value) -> Value {
    if let Some(object) = answer.as_object_mut() {
        object.remove("webhook_deliveries");
    }
    answer
}

/// Every table of the SQLite file, as JSON rows in key order.
fn sqlite_rows(db: &Path, table: &str) -> Vec<String> {
    let conn = crate::util::read_only(db);
    let key = if table == "outbox_event" {
        "seq"
    } else if table == "settings" {
        "name"
    } else if table == "webhook_endpoint" {
        "endpoint"
    } else if table == "idempotency_key" {
        "scope, key"
    } else {
        "id"
    };
    let mut statement = conn.prepare(&format!("SELECT * FROM {table} ORDER BY {key}")).expect("select");
    let columns = statement.column_count();
    statement
        .query_map([], |row| {
            let mut cells = Vec::new();
            for i in 0..columns {
                cells.push(match row.get_ref(i)? {
                    rusqlite::types::ValueRef::Null => "null".to_owned(),
                    rusqlite::types::ValueRef::Integer(v) => v.to_string(),
                    rusqlite::types::ValueRef::Text(t) | rusqlite::types::ValueRef::Blob(t) => {
                        String::from_utf8_lossy(t).into_owned()
                    }
                    rusqlite::types::ValueRef::Real(v) => v.to_string(),
                });
            }
            Ok(cells.join("|"))
        })
        .expect("rows")
        .collect::<Result<_, _>>()
        .expect("rows")
}

#[test]
fn a_sqlite_ledger_is_copied_whole_and_served_on_postgresql() {
    let Some(url) = crate::pg::fresh_database("copydb") else { return };
    let dir = TempDir::new("copydb");
    let db = dir.path("ledger.db");
    let before = seed_sqlite(&db);
    let counts: Vec<(&str, usize)> =
        payonce::store::COPIED_TABLES.iter().map(|t| (*t, sqlite_rows(&db, t).len())).collect();
    for (table, rows) in &counts {
        if *table != "platform_call" {
            assert!(*rows > 0, "the seed leaves rows in {table}: {counts:?}");
        }
    }

    let (code, out, err) = payonce_cli(&["copy-db", "--from", &db.display().to_string(), "--to", &url]);
    assert_eq!(code, Some(0), "copy-db: {out}\n{err}");
    let total: usize = counts.iter().map(|(_, n)| n).sum();
    assert!(out.contains(&format!("copied {total} rows in 12 tables")), "{out}");
    for (table, rows) in &counts {
        assert!(
            err.lines().any(|l| l.split_whitespace().take(2).eq([*table, &rows.to_string()].iter().map(|s| &**s))),
            "progress names {table} with {rows} rows: {err}"
        );
    }

    // Every row as it was, read back by PostgreSQL's own text of it.
    let mut pg = postgres::Client::connect(&url, postgres::NoTls).expect("connect");
    for (table, rows) in &counts {
        let n: i64 = pg.query_one(&format!("SELECT count(*) FROM {table}"), &[]).expect("count").get(0);
        assert_eq!(n as usize, *rows, "{table}");
    }
    let disabled: i64 = pg
        .query_one("SELECT count(*) FROM pg_trigger WHERE NOT tgisinternal AND tgenabled <> 'O'", &[])
        .expect("triggers")
        .get(0);
    assert_eq!(disabled, 0, "every trigger enabled after the copy");
    // The guards hold: an order is still born PENDING, a ledger refuses DELETE.
    let refused = pg.batch_execute(
        "INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at)
         VALUES ('X-1', 'u', 1, 'CNY', 'PAID', '2026-01-01T00:00:00.000Z', '2026-01-01T00:00:00.000Z')",
    );
    assert!(refused.is_err(), "an order inserted PAID is refused after the copy");
    assert!(pg.batch_execute("DELETE FROM audit_log").is_err(), "audit_log still refuses DELETE");
    let last_seq: i64 = pg.query_one("SELECT max(seq) FROM outbox_event", &[]).expect("seq").get(0);
    drop(pg);

    // Two payonce processes on the copy.
    let target = Path::new(&url);
    let flags = ["--coupon", "NEW10", "--points-per-yuan", "1"];
    let a = Server::start_logged(target, &flags, std::process::Stdio::inherit());
    let b = Server::start_logged(target, &flags, std::process::Stdio::inherit());
    for (path, was) in SNAPSHOT_READS.iter().zip(&before) {
        assert_eq!(&settled(ok(&b.get(path), path)), was, "{path} answers on PostgreSQL as it did on SQLite");
    }
    let detail = a.get("/v1/orders/C-3").json();
    assert_eq!(detail["status"], "REFUNDING", "{detail}");
    assert_eq!(detail["refunds"].as_array().map(Vec::len), Some(3), "{detail}");
    let detail = b.get("/v1/orders/C-1").json();
    assert_eq!(detail["coupons"][0]["status"], "FROZEN", "{detail}");
    assert_eq!(b.get("/v1/orders/C-7").json()["status"], "PENDING");
    assert_eq!(a.get("/v1/admin/mode").json()["mode"], "record_only", "the mode is copied");
    // A re-delivered callback is a duplicate; the keyed answer is replayed.
    let resp = Pay { pay_no: "CP-1", order_no: "C-1", amount: 1000, status: "SUCCESS" }.send(&b);
    assert_eq!(resp.json()["outcome"], "duplicate", "{}", resp.text());
    let replay = request(
        a.addr,
        "PUT",
        "/v1/admin/mode",
        &[("Content-Type", "application/json"), ("Idempotency-Key", "copy-db-mode-1")],
        br#"{"mode":"record_only"}"#,
    );
    assert_eq!(replay.status, 200, "{}", replay.text());
    // Back to normal; the recorded payment is drained and the feed goes on
    // after the last copied seq.
    let resp =
        request(a.addr, "PUT", "/v1/admin/mode", &[("Content-Type", "application/json")], br#"{"mode":"normal"}"#);
    assert_eq!(resp.status, 200, "{}", resp.text());
    ok(&b.post_json("/v1/admin/drain", &json!({})), "drain");
    assert_eq!(a.get("/v1/orders/C-6").json()["status"], "PAID");
    ok(&a.post_json("/v1/orders", &json!({"order_no": "C-8", "user_id": "u2", "amount": 800})), "C-8");
    let resp = Pay { pay_no: "CP-8", order_no: "C-8", amount: 800, status: "SUCCESS" }.send(&a);
    assert_eq!(resp.json()["outcome"], "applied", "{}", resp.text());
    let events = b.get(&format!("/v1/events?after={last_seq}")).json();
    let seqs: Vec<i64> =
        events["events"].as_array().expect("events").iter().filter_map(|e| e["seq"].as_i64()).collect();
    assert!(!seqs.is_empty() && seqs[0] == last_seq + 1, "the feed continues after {last_seq}: {events}");
    let points = a.get("/v1/users/u1/points").json();
    assert!(points["entries"].as_array().is_some_and(|e| e.len() >= 3), "the copied points are the user's: {points}");
}

#[test]
fn copy_db_refuses_a_target_with_rows_a_newer_source_and_other_urls() {
    let Some(url) = crate::pg::fresh_database("copydbno") else { return };
    let dir = TempDir::new("copydbno");
    let db = dir.path("ledger.db");
    {
        let server = Server::start_on(&db, &[]);
        ok(&server.post_json("/v1/orders", &json!({"order_no": "N-1", "user_id": "u1", "amount": 100})), "N-1");
    }
    let from = db.display().to_string();
    let (code, _, err) = payonce_cli(&["copy-db", "--from", &from, "--to", "mysql://h/db"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("postgres://"), "{err}");
    let (code, _, err) = payonce_cli(&["copy-db", "--from", &dir.path("none.db").display().to_string(), "--to", &url]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("no such file"), "{err}");

    // The first copy fills it; a second one finds rows and changes nothing.
    let (code, out, err) = payonce_cli(&["copy-db", "--from", &from, "--to", &url]);
    assert_eq!(code, Some(0), "{out}{err}");
    let (code, _, err) = payonce_cli(&["copy-db", "--from", &from, "--to", &url]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("not empty") && err.contains("orders has 1 rows"), "{err}");

    // A database holding another application's table is refused, and left
    // exactly as it was: no payonce table appears in it.
    let Some(other) = crate::pg::fresh_database("copydbother") else { return };
    let mut pg = postgres::Client::connect(&other, postgres::NoTls).expect("connect");
    pg.batch_execute("CREATE TABLE invoices (id BIGINT PRIMARY KEY)").expect("another app's table");
    let (code, _, err) = payonce_cli(&["copy-db", "--from", &from, "--to", &other]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("not empty") && err.contains("invoices"), "{err}");
    let tables: i64 =
        pg.query_one("SELECT count(*) FROM pg_tables WHERE schemaname = current_schema()", &[]).expect("tables").get(0);
    assert_eq!(tables, 1, "nothing written to a refused target");

    // A source from a newer payonce.
    let newer = dir.path("newer.db");
    // The file and its WAL, where the schema and the rows still are.
    std::fs::copy(&db, &newer).expect("copy");
    std::fs::copy(dir.path("ledger.db-wal"), dir.path("newer.db-wal")).expect("copy the WAL");
    {
        let conn = rusqlite::Connection::open(&newer).expect("open");
        conn.pragma_update(None, "user_version", payonce::store::SCHEMA_VERSION + 1).expect("user_version");
    }
    let Some(empty) = crate::pg::fresh_database("copydbnew") else { return };
    let (code, _, err) = payonce_cli(&["copy-db", "--from", &newer.display().to_string(), "--to", &empty]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("newer than this payonce"), "{err}");
}

#[test]
fn a_v1_ledger_is_migrated_on_a_copy_and_the_file_is_left_as_it_was() {
    let Some(url) = crate::pg::fresh_database("copydbv1") else { return };
    let dir = TempDir::new("copydbv1");
    let old = dir.path("v1.db");
    crate::schema::v1_database(&old);
    let bytes_before = std::fs::read(&old).expect("read v1");
    let (code, out, err) = payonce_cli(&["copy-db", "--from", &old.display().to_string(), "--to", &url]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(std::fs::read(&old).expect("read v1"), bytes_before, "the source file is only read");
    let conn = crate::util::read_only(&old);
    let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0)).expect("version");
    assert_eq!(version, 1, "the source stays at v1");
    let orders: i64 = conn.query_row("SELECT count(*) FROM orders", [], |r| r.get(0)).expect("orders");
    let mut pg = postgres::Client::connect(&url, postgres::NoTls).expect("connect");
    let copied: i64 = pg.query_one("SELECT count(*) FROM orders", &[]).expect("count").get(0);
    assert!(orders > 0 && copied == orders, "{copied} of {orders} orders");
    let version: i64 = pg.query_one("SELECT max(version) FROM payonce_schema_version", &[]).expect("v").get(0);
    assert_eq!(version, payonce::store::SCHEMA_VERSION);
}
