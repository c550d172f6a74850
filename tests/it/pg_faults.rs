//! PostgreSQL going away under a callback storm (docs/postgres.md, "When
//! the database goes away"): an operator's fast restart, an immediate
//! restart (`pg_ctl restart -m immediate`: no checkpoint, crash recovery),
//! terminated backends, every connection slot taken by another client, and
//! the server SIGKILLed and restarted. Each test runs a cluster of its own (it is
//! restarted and killed, so never the shared one of `pg.rs`), one `payonce
//! serve` on it, and a few clients that create fresh orders and pay each
//! with a signed generic callback, re-sending anything not acknowledged.
//! The fault lands mid-storm; then:
//!
//! - no answer is a 500: each is 2xx, or 503 `database_unavailable` with
//!   `Retry-After`;
//! - the storm recovers: payments are acknowledged again after the fault;
//! - every acknowledged payment is in the database exactly once, with its
//!   coupons, points and `order.paid` event, and nothing else is.

use crate::util::{sign_now, TempDir, SECRET};
use payonce_testclient as http;
use postgres::error::SqlState;
use postgres::{Client, NoTls};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

/// Client threads of the storm, each with one request in flight at a time.
const CLIENTS: usize = 6;
pub(crate) const COUPONS: [&str; 2] = ["NEW10", "VIP5"];
/// Every order's amount, in fen; with one point per yuan it earns 10 points.
pub(crate) const AMOUNT: i64 = 1_000;
/// The storm runs this long before the fault.
const BEFORE_FAULT: Duration = Duration::from_millis(800);
/// After the fault the storm must acknowledge this many more payments ...
const PAYMENTS_AFTER_FAULT_MIN: usize = 30;
/// ... within this.
const RECOVERY_MAX: Duration = Duration::from_secs(12);
/// A request unanswered this long is a hang, not a 503.
const IO_TIMEOUT: Duration = Duration::from_secs(20);
/// A re-send after a 503 waits this long, as a platform would (shorter
/// than `Retry-After`, to keep the test short).
const RESEND_PAUSE: Duration = Duration::from_millis(30);

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/pg-cluster")
}

/// A throwaway cluster of this test's own, stopped and removed on drop
/// (and by `pg.rs`'s watchdog if this process dies first).
struct Cluster {
    dir: PathBuf,
    /// The superuser's URL, database `postgres`.
    url: String,
}

impl Cluster {
    /// `None` (the test skips, loudly) when no PostgreSQL server binaries
    /// are installed, unless `PAYONCE_REQUIRE_PG=1`.
    fn start(options: &[&str]) -> Option<Cluster> {
        let found = Command::new(script()).arg("bindir").stdin(Stdio::null()).output();
        if !found.is_ok_and(|out| out.status.success()) {
            assert!(!crate::pg::required(), "PAYONCE_REQUIRE_PG=1 but no initdb was found for a cluster of its own");
            eprintln!("=== no initdb: the PostgreSQL fault test is SKIPPED ===");
            return None;
        }
        let mut why = String::new();
        for attempt in 0..3 {
            let dir = crate::pg::cluster_dir(100 + attempt);
            let port = crate::pg::free_port().unwrap_or_else(|e| panic!("{e}"));
            crate::pg::spawn_watchdog(&script(), &dir).unwrap_or_else(|e| panic!("{e}"));
            let out = Command::new(script())
                .arg("start")
                .arg(&dir)
                .arg(port.to_string())
                .args(options)
                .stdin(Stdio::null())
                .output()
                .expect("run scripts/pg-cluster");
            if out.status.success() {
                let url = String::from_utf8_lossy(&out.stdout).trim().to_owned();
                return Some(Cluster { dir, url });
            }
            why = String::from_utf8_lossy(&out.stderr).into_owned();
            let _ = Command::new(script()).arg("stop").arg(&dir).stdin(Stdio::null()).output();
        }
        panic!("scripts/pg-cluster start failed three times: {why}");
    }

    fn admin(&self) -> Client {
        Client::connect(&self.url, NoTls).unwrap_or_else(|e| panic!("connect {}: {e}", self.url))
    }

    /// A new database for payonce, and its URL.
    fn database(&self, name: &str) -> String {
        self.admin().batch_execute(&format!("CREATE DATABASE {name}")).expect("CREATE DATABASE");
        format!("{}{name}", self.url.trim_end_matches("postgres"))
    }

    /// The same database in libpq's key-value form, with two hosts: first
    /// a port where nothing listens (refused at once), then the server.
    /// payonce connects to whichever accepts writes.
    fn key_value(&self, name: &str) -> String {
        let port = self.url.rsplit(':').next().and_then(|p| p.split('/').next()).expect("the cluster's port");
        let dead = crate::pg::free_port().unwrap_or_else(|e| panic!("{e}"));
        format!(
            "host=127.0.0.1,127.0.0.1 port={dead},{port} dbname={name} user=payonce_test \
             target_session_attrs=read-write"
        )
    }

    /// `scripts/pg-cluster restart|crash [options]`, returning how long it took.
    fn run(&self, mode: &str, options: &[&str]) -> Duration {
        let started = Instant::now();
        let out = Command::new(script())
            .arg(mode)
            .arg(&self.dir)
            .args(options)
            .stdin(Stdio::null())
            .output()
            .expect("pg-cluster");
        assert!(out.status.success(), "pg-cluster {mode}: {}", String::from_utf8_lossy(&out.stderr));
        started.elapsed()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(script()).arg("stop").arg(&self.dir).stdin(Stdio::null()).output();
    }
}

/// What the clients saw.
#[derive(Default)]
struct Tally {
    /// order_no → pay_no of every payment answered `applied` (or a
    /// duplicate of `applied`, when the first answer was lost).
    paid: Mutex<BTreeMap<String, String>>,
    violations: Mutex<Vec<String>>,
    /// 503 `database_unavailable` answers.
    unavailable: AtomicUsize,
    /// Requests that got no answer at all (payonce itself never stops here).
    unanswered: AtomicUsize,
}

impl Tally {
    fn violation(&self, what: String) {
        self.violations.lock().expect("violations").push(what);
    }

    fn paid_count(&self) -> usize {
        self.paid.lock().expect("paid").len()
    }
}

/// Sends one request until it is acknowledged (2xx) and returns the answer.
/// Every other answer must be 503 `database_unavailable` with
/// `Retry-After`; anything else is recorded as a violation (and re-sent,
/// so the storm goes on). `None` once `deadline` passes unacknowledged.
fn until_acknowledged(
    addr: SocketAddr,
    path: &str,
    body: &Value,
    tally: &Tally,
    deadline: Instant,
) -> Option<(u16, Value)> {
    let body = body.to_string();
    while Instant::now() < deadline {
        let signature = sign_now(SECRET, body.as_bytes());
        let headers = [("Content-Type", "application/json"), ("Payonce-Signature", signature.as_str())];
        let response = match http::request(addr, "POST", path, &headers, body.as_bytes(), IO_TIMEOUT) {
            Ok(response) => response,
            Err(e) => {
                tally.unanswered.fetch_add(1, Ordering::SeqCst);
                tally.violation(format!("POST {path} {body}: no answer: {e}"));
                thread::sleep(RESEND_PAUSE);
                continue;
            }
        };
        let text = String::from_utf8_lossy(&response.body).into_owned();
        let json: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        if (200..300).contains(&response.status) {
            return Some((response.status, json));
        }
        let code = json["error"]["code"].as_str().unwrap_or_default();
        let retry_after = response.headers.iter().any(|(n, v)| n.eq_ignore_ascii_case("retry-after") && !v.is_empty());
        if response.status == 503 && code == "database_unavailable" && retry_after {
            tally.unavailable.fetch_add(1, Ordering::SeqCst);
        } else {
            tally.violation(format!("POST {path} {body}: {} (Retry-After: {retry_after}) {text}", response.status));
        }
        thread::sleep(RESEND_PAUSE);
    }
    None
}

/// One client: order after order, each created and then paid, until `stop`.
fn client(c: usize, addr: SocketAddr, tally: &Tally, stop: &AtomicBool, deadline: Instant) {
    for k in 0.. {
        if stop.load(Ordering::SeqCst) || Instant::now() >= deadline {
            return;
        }
        let order_no = format!("F{c}-{k:05}");
        let pay_no = format!("P{c}-{k:05}");
        let order = json!({"order_no": order_no, "user_id": format!("u{c}"), "amount": AMOUNT});
        let Some((status, created)) = until_acknowledged(addr, "/v1/orders", &order, tally, deadline) else {
            tally.violation(format!("{order_no}: creation never acknowledged"));
            return;
        };
        if !(status == 201 || status == 200) || created["order_no"] != order_no.as_str() {
            tally.violation(format!("{order_no}: created as {status} {created}"));
        }
        let payment = json!({"pay_no": pay_no, "order_no": order_no, "amount": AMOUNT, "status": "SUCCESS"});
        let Some((_, answer)) = until_acknowledged(addr, "/v1/callbacks/generic", &payment, tally, deadline) else {
            tally.violation(format!("{pay_no}: payment never acknowledged"));
            return;
        };
        let outcome = answer["outcome"].as_str().unwrap_or_default();
        // A lost answer to an applied payment is settled by the re-send: a duplicate of it.
        let applied = outcome == "applied" || (outcome == "duplicate" && answer["original"] == "applied");
        if answer["code"] != "SUCCESS" || !applied {
            tally.violation(format!("{pay_no}: answered {answer}"));
            continue;
        }
        tally.paid.lock().expect("paid").insert(order_no, pay_no);
    }
}

/// Starts the storm on `cluster`, runs `fault` mid-storm, waits for the
/// storm to recover, and checks the answers and the database.
fn storm_through(label: &str, cluster: &Cluster, fault: impl FnOnce()) {
    storm_on(label, cluster, false, fault);
}

/// [`storm_through`], payonce given the database in libpq's key-value form
/// with two hosts when `key_value`.
fn storm_on(label: &str, cluster: &Cluster, key_value: bool, fault: impl FnOnce()) {
    let started = Instant::now();
    let url = cluster.database("payonce");
    let db = if key_value { cluster.key_value("payonce") } else { url.clone() };
    let logs = TempDir::new("pg-faults");
    let log = logs.path("serve.stderr.log");
    let file = std::fs::File::create(&log).expect("create the server's log");
    let points = "1".to_owned();
    // Short database timeouts: a call on a connection the fault broke ends
    // soon, whichever way the server went.
    let flags = [
        "--coupon",
        COUPONS[0],
        "--coupon",
        COUPONS[1],
        "--points-per-yuan",
        &points,
        "--db-connect-timeout-ms",
        "2000",
        "--db-statement-timeout-ms",
        "4000",
    ];
    let mut server = crate::util::Server::start_logged_env(Path::new(&db), &flags, Stdio::from(file), &[]);
    server.set_stderr_log(log);
    let addr = server.addr;

    let tally = Tally::default();
    let stop = AtomicBool::new(false);
    let deadline = Instant::now() + BEFORE_FAULT + RECOVERY_MAX + Duration::from_secs(20);
    let (fault_took, paid_at_fault, recovered_in) = thread::scope(|s| {
        for c in 0..CLIENTS {
            let (tally, stop) = (&tally, &stop);
            s.spawn(move || client(c, addr, tally, stop, deadline));
        }
        thread::sleep(BEFORE_FAULT);
        assert!(tally.paid_count() > 0, "{label}: no payment acknowledged before the fault");
        let fault_started = Instant::now();
        fault();
        let fault_took = fault_started.elapsed();
        let paid_at_fault = tally.paid_count();
        let recovery_started = Instant::now();
        while tally.paid_count() < paid_at_fault + PAYMENTS_AFTER_FAULT_MIN && recovery_started.elapsed() < RECOVERY_MAX
        {
            thread::sleep(Duration::from_millis(20));
        }
        let recovered_in = recovery_started.elapsed();
        stop.store(true, Ordering::SeqCst);
        (fault_took, paid_at_fault, recovered_in)
    });
    let paid = tally.paid.lock().expect("paid").clone();
    let violations = tally.violations.lock().expect("violations").clone();
    println!(
        "{label}: fault took {fault_took:?}; {} payments acknowledged ({paid_at_fault} before the fault ended), \
         {} answers 503 database_unavailable, {} unanswered, recovered in {recovered_in:?}; {} violations",
        paid.len(),
        tally.unavailable.load(Ordering::SeqCst),
        tally.unanswered.load(Ordering::SeqCst),
        violations.len()
    );
    assert!(
        violations.is_empty(),
        "{label}: {} answers break the contract (first 10):\n{}",
        violations.len(),
        violations.iter().take(10).cloned().collect::<Vec<_>>().join("\n")
    );
    assert!(
        paid.len() >= paid_at_fault + PAYMENTS_AFTER_FAULT_MIN,
        "{label}: the storm did not recover: {} payments acknowledged after the fault in {recovered_in:?}",
        paid.len() - paid_at_fault
    );
    drop(server);
    check_database(label, &url, &paid);
    println!("{label}: {:.1}s in all", started.elapsed().as_secs_f64());
}

/// Every acknowledged payment is there once with its effects, and nothing
/// else is: each order a client sent was paid (clients stop only between
/// orders), so the database holds exactly the acknowledged payments.
pub(crate) fn check_database(label: &str, url: &str, paid: &BTreeMap<String, String>) {
    let mut db = Client::connect(url, NoTls).unwrap_or_else(|e| panic!("{label}: connect {url}: {e}"));
    let mut per_order = |sql: &str| -> BTreeMap<String, i64> {
        let rows = db.query(sql, &[]).unwrap_or_else(|e| panic!("{label}: {sql}: {e}"));
        rows.iter().map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1))).collect()
    };
    let expect = |n: i64| -> BTreeMap<String, i64> { paid.keys().map(|o| (o.clone(), n)).collect() };
    let coupons = COUPONS.len() as i64;
    assert_eq!(per_order("SELECT order_no, count(*) FROM orders GROUP BY 1"), expect(1), "{label}: orders");
    let by_pay_no =
        per_order("SELECT o.order_no || ' ' || o.pay_no, count(*) FROM orders o WHERE o.status = 'PAID' GROUP BY 1");
    let expected: BTreeMap<String, i64> = paid.iter().map(|(o, p)| (format!("{o} {p}"), 1)).collect();
    assert_eq!(by_pay_no, expected, "{label}: PAID orders, each by its acknowledged pay_no");
    let callbacks = per_order(
        "SELECT o.order_no, count(*) FROM pay_callback_log p JOIN orders o ON o.id = p.order_id \
         WHERE p.outcome = 'applied' AND p.state = 'decided' AND p.pay_no = o.pay_no GROUP BY 1",
    );
    assert_eq!(callbacks, expect(1), "{label}: applied callbacks");
    let coupon_rows = per_order(
        "SELECT o.order_no, count(*) FROM user_coupon c JOIN orders o ON o.id = c.order_id \
         WHERE c.status = 'ACTIVE' GROUP BY 1",
    );
    assert_eq!(coupon_rows, expect(coupons), "{label}: coupons");
    let points = per_order(
        "SELECT o.order_no, count(*) FROM point_log p JOIN orders o ON o.id = p.order_id \
         WHERE p.point_type = 'ORDER_PAID' AND p.points = 10 GROUP BY 1",
    );
    assert_eq!(points, expect(1), "{label}: points");
    let events = per_order("SELECT order_no, count(*) FROM outbox_event WHERE type = 'order.paid' GROUP BY 1");
    assert_eq!(events, expect(1), "{label}: order.paid events");
    // Nothing beyond those: no stray callback, coupon, points or event row.
    let totals = per_order(
        "SELECT 'rows', (SELECT count(*) FROM pay_callback_log) + (SELECT count(*) FROM user_coupon) \
         + (SELECT count(*) FROM point_log) + (SELECT count(*) FROM outbox_event)",
    );
    assert_eq!(totals.get("rows").copied(), Some(paid.len() as i64 * (coupons + 3)), "{label}: rows in all");
}

/// Terminates every backend of payonce's, as `pg_terminate_backend` from
/// an operator's session.
fn terminate_payonce_backends(admin: &mut Client) -> u64 {
    admin
        .query_one(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = 'payonce' AND pid <> pg_backend_pid()) AS t",
            &[],
        )
        .map(|r| r.get::<_, i64>(0) as u64)
        .expect("pg_terminate_backend")
}

#[test]
fn a_fast_restart_answers_503_never_500() {
    let Some(cluster) = Cluster::start(&[]) else { return };
    storm_through("pg_ctl restart -m fast", &cluster, || {
        cluster.run("restart", &[]);
    });
}

#[test]
fn an_immediate_restart_answers_503_never_500() {
    // --durable: an immediate shutdown skips the checkpoint, so only WAL
    // flushed at each commit brings the acknowledged payments back.
    let Some(cluster) = Cluster::start(&["--durable"]) else { return };
    // On the key-value form with a refusing first host: payonce follows it
    // to the server after the restart as at the start.
    storm_on("pg_ctl restart -m immediate", &cluster, true, || {
        cluster.run("restart", &["--immediate"]);
    });
}

#[test]
fn terminated_backends_answer_503_never_500() {
    let Some(cluster) = Cluster::start(&[]) else { return };
    let mut admin = cluster.admin();
    storm_through("pg_terminate_backend", &cluster, || {
        // Again and again, so some land on a statement in flight.
        for _ in 0..8 {
            terminate_payonce_backends(&mut admin);
            thread::sleep(Duration::from_millis(120));
        }
    });
}

#[test]
fn max_connections_taken_answers_503_never_500() {
    let Some(cluster) = Cluster::start(&["--max-connections=30"]) else { return };
    storm_through("max_connections reached", &cluster, || {
        // Another client takes every free slot, then payonce loses its
        // connections and must open new ones while none is free.
        let mut hog: Vec<Client> = Vec::new();
        let take_free_slots = |hog: &mut Vec<Client>| loop {
            match Client::connect(&cluster.url, NoTls) {
                Ok(client) => hog.push(client),
                Err(e) if e.code() == Some(&SqlState::TOO_MANY_CONNECTIONS) => break,
                Err(e) => panic!("taking a connection slot: {e}"),
            }
        };
        take_free_slots(&mut hog);
        assert!(!hog.is_empty(), "no free slot to take");
        let terminated = terminate_payonce_backends(&mut hog[0]);
        assert!(terminated > 0, "payonce had no backend to terminate");
        let until = Instant::now() + Duration::from_millis(1_500);
        while Instant::now() < until {
            take_free_slots(&mut hog);
            thread::sleep(Duration::from_millis(5));
        }
        drop(hog);
    });
}

#[test]
fn a_killed_and_restarted_server_answers_503_never_500() {
    // --durable: with synchronous_commit off a commit PostgreSQL
    // acknowledged would die with its processes, and payonce with it.
    let Some(cluster) = Cluster::start(&["--durable"]) else { return };
    storm_through("postmaster SIGKILL and restart", &cluster, || {
        cluster.run("crash", &[]);
    });
}

/// A statement past `--db-statement-timeout-ms` (here held behind another
/// session's table lock) answers 503 `database_busy` with `Retry-After`,
/// and its connection stays in the pool: the session is healthy, so
/// nothing reconnects (the same backends answer after the lock is gone).
#[test]
fn a_statement_past_its_timeout_is_busy_and_keeps_the_pool() {
    let Some(url) = crate::pg::fresh_database("stmt_timeout") else { return };
    let server =
        crate::util::Server::start_logged(Path::new(&url), &["--db-statement-timeout-ms", "300"], Stdio::inherit());
    let created = server.post_json("/v1/orders", &json!({"order_no": "T-1", "user_id": "u1", "amount": 100}));
    assert_eq!(created.status, 201, "{}", created.text());
    let mut admin = Client::connect(&url, NoTls).expect("connect");
    let backends = |admin: &mut Client| -> Vec<i32> {
        admin
            .query("SELECT pid FROM pg_stat_activity WHERE application_name = 'payonce' ORDER BY pid", &[])
            .expect("pg_stat_activity")
            .iter()
            .map(|r| r.get(0))
            .collect()
    };
    let before = backends(&mut admin);
    assert!(!before.is_empty(), "payonce holds connections");
    let mut holder = Client::connect(&url, NoTls).expect("connect");
    let mut lock = holder.transaction().expect("begin");
    lock.batch_execute("LOCK TABLE orders IN ACCESS EXCLUSIVE MODE").expect("lock");
    let started = Instant::now();
    let held = server.get("/v1/orders/T-1");
    assert_eq!((held.status, held.error_code().as_str()), (503, "database_busy"), "{}", held.text());
    assert!(held.header("retry-after").is_some(), "{:?}", held.headers);
    assert!(started.elapsed() < Duration::from_secs(4), "bounded by the statement timeout, not the lock's");
    lock.rollback().expect("release");
    let read = server.get("/v1/orders/T-1");
    assert_eq!(read.status, 200, "{}", read.text());
    let after = backends(&mut admin);
    assert!(before.iter().any(|pid| after.contains(pid)), "the pool kept its connections: {before:?} then {after:?}");
}
