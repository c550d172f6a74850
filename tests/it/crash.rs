//! Crash test: a storm of signed callbacks from a platform that re-delivers
//! anything not acknowledged, while the server is killed with SIGKILL at
//! random moments (seeded) and restarted on the same database file. At the
//! end every acknowledged callback's effects are present exactly once,
//! every order is in the right state, and `PRAGMA integrity_check` is ok.
//!
//! The storm: `ORDERS` orders are created (an order_no re-sent until
//! acknowledged), each is paid by pay_no `P-{i}-a` delivered twice at once
//! (concurrent duplicates) and, for every third order, by a second channel's
//! pay_no `P-{i}-b` (twice, after `P-{i}-a` was acknowledged: it must be
//! `already_paid`, refund-required). While kills remain, acknowledged
//! payments are re-delivered again (a platform's re-delivery after a lost
//! answer), so the server is always under load when it dies. Anything not
//! answered 2xx (connection refused or reset, 503, no answer) goes back in
//! the queue and is re-delivered after a short, random pause.
//!
//! Replay a run with PAYONCE_CRASH_SEED=<seed printed by the test>.

use crate::engines::Db;
use crate::util::{parse_response, sign_now, HttpResponse, Rng, Server, SECRET};
use rusqlite::{Connection, OpenFlags};
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

const ORDERS: usize = 600;
/// Orders arrive this far apart, so the storm spans the kills.
const ARRIVAL_SPREAD: Duration = Duration::from_millis(8);
/// Every `SECOND_CHANNEL_EVERY`-th order is also paid through a second channel.
const SECOND_CHANNEL_EVERY: usize = 3;
const KILLS_MIN: usize = 15;
const CLIENTS: usize = 8;
const COUPONS: [&str; 2] = ["NEW10", "VIP5"];
const POINTS_PER_YUAN: i64 = 1;
/// The whole test, storm and checks, stays under this.
const DEADLINE: Duration = Duration::from_secs(55);
const IO_TIMEOUT: Duration = Duration::from_secs(5);

fn order_no(i: usize) -> String {
    format!("CRASH-{i:04}")
}

fn amount(i: usize) -> i64 {
    1_000 + i as i64
}

fn user_id(i: usize) -> String {
    format!("u-{}", i % 7)
}

fn pay_no(i: usize, channel: Channel) -> String {
    match channel {
        Channel::First => format!("P-{i:04}-a"),
        Channel::Second => format!("P-{i:04}-b"),
    }
}

fn has_second_channel(i: usize) -> bool {
    i % SECOND_CHANNEL_EVERY == 0
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Channel {
    First,
    Second,
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Create,
    Pay(Channel),
}

#[derive(Clone, Copy, Debug)]
struct Delivery {
    order: usize,
    kind: Kind,
    not_before: Instant,
}

#[derive(Default)]
struct Storm {
    queue: VecDeque<Delivery>,
    /// Deliveries that still need an acknowledgement (queued or in flight).
    outstanding: usize,
    created: Vec<bool>,
    first_paid: Vec<bool>,
    /// Sends that were not acknowledged and went back in the queue.
    redeliveries: usize,
    /// Acknowledged payments sent again on purpose while kills remained.
    extra_duplicates: usize,
    sends: usize,
    /// Refused connections: the server was down.
    refused: usize,
    /// Requests sent and then cut (reset, or no complete answer): killed in flight.
    cut_in_flight: usize,
    status_503: usize,
    /// "applied" answers per pay_no: more than one would be a double payment.
    applied_answers: HashMap<String, usize>,
    /// Every acknowledged answer that is not what the contract says.
    violations: Vec<String>,
}

impl Storm {
    fn push(&mut self, order: usize, kind: Kind, delay: Duration) {
        self.queue.push_back(Delivery { order, kind, not_before: Instant::now() + delay });
        self.outstanding += 1;
    }
}

/// One HTTP/1.1 request on its own connection; `Err` on any connection
/// failure or an unparsable answer (util::request panics on those).
#[derive(Debug)]
enum SendError {
    /// No connection: nothing was sent.
    Refused,
    /// Sent (maybe partly), then the connection failed before a complete answer.
    Cut,
}

fn try_request(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Result<HttpResponse, SendError> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(|_| SendError::Refused)?;
    stream.set_read_timeout(Some(IO_TIMEOUT)).map_err(|_| SendError::Cut)?;
    stream.set_write_timeout(Some(IO_TIMEOUT)).map_err(|_| SendError::Cut)?;
    let mut head =
        format!("POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body);
    stream.write_all(&bytes).map_err(|_| SendError::Cut)?;
    let mut out = Vec::new();
    stream.read_to_end(&mut out).map_err(|_| SendError::Cut)?;
    parse_response(&out).ok_or(SendError::Cut)
}

/// A GET over HTTP/1.0, read to the end of the connection.
fn get_json_http10(addr: SocketAddr, path: &str) -> Value {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
    stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).expect("write");
    let mut out = Vec::new();
    stream.read_to_end(&mut out).expect("read");
    let response = parse_response(&out).unwrap_or_else(|| panic!("no answer to GET {path}"));
    assert_eq!(response.status, 200, "GET {path}: {}", response.text());
    response.json()
}

fn send(addr: SocketAddr, delivery: &Delivery) -> Result<HttpResponse, SendError> {
    let i = delivery.order;
    match delivery.kind {
        Kind::Create => {
            let body = json!({"order_no": order_no(i), "user_id": user_id(i), "amount": amount(i)}).to_string();
            try_request(addr, "/v1/orders", &[], body.as_bytes())
        }
        Kind::Pay(channel) => {
            let body = json!({"pay_no": pay_no(i, channel), "order_no": order_no(i), "amount": amount(i),
                              "status": "SUCCESS"})
            .to_string();
            let signature = sign_now(SECRET, body.as_bytes());
            try_request(addr, "/v1/callbacks/generic", &[("Payonce-Signature", &signature)], body.as_bytes())
        }
    }
}

/// What an acknowledged answer must say; `Err` describes a violation.
fn judge(delivery: &Delivery, response: &HttpResponse) -> Result<Option<String>, String> {
    let i = delivery.order;
    let body: Value = serde_json::from_slice(&response.body).map_err(|e| format!("{delivery:?}: not JSON: {e}"))?;
    match delivery.kind {
        Kind::Create => {
            if body["order_no"] != order_no(i) || body["amount"] != amount(i) {
                return Err(format!("{delivery:?}: answered another order: {body}"));
            }
            Ok(None)
        }
        Kind::Pay(channel) => {
            let first = match channel {
                Channel::First => "applied",
                Channel::Second => "already_paid",
            };
            let outcome = body["outcome"].as_str().unwrap_or_default();
            let ok = body["code"] == "SUCCESS"
                && (outcome == first || (outcome == "duplicate" && body["original"] == first));
            if !ok {
                return Err(format!("{} answered {body}, expected {first} or duplicate of it", pay_no(i, channel)));
            }
            Ok((outcome == "applied").then(|| pay_no(i, channel)))
        }
    }
}

fn client(
    storm: Arc<Mutex<Storm>>,
    addrs: Arc<Mutex<Vec<SocketAddr>>>,
    kills_done: Arc<AtomicBool>,
    seed: u64,
    deadline: Instant,
) {
    let mut rng = Rng::new(seed);
    while Instant::now() < deadline {
        let next = {
            let mut s = storm.lock().expect("storm lock");
            let now = Instant::now();
            let ready = s.queue.iter().position(|d| d.not_before <= now);
            let killing = !kills_done.load(Ordering::SeqCst);
            if ready.is_none() && s.outstanding == 0 && !killing {
                return;
            }
            if ready.is_none() && killing && s.outstanding < 2 * CLIENTS {
                // Nothing due: keep the server busy until every kill has
                // happened, as a platform re-delivering a payment whose
                // answer it lost.
                let i = rng.below(ORDERS as u64) as usize;
                if s.first_paid[i] {
                    s.extra_duplicates += 1;
                    s.push(i, Kind::Pay(Channel::First), Duration::ZERO);
                }
            }
            s.queue.iter().position(|d| d.not_before <= now).and_then(|at| s.queue.remove(at))
        };
        let Some(delivery) = next else {
            thread::sleep(Duration::from_millis(2));
            continue;
        };
        // Any process may get any delivery, as behind a load balancer.
        let target = {
            let addrs = addrs.lock().expect("addr lock");
            addrs[rng.below(addrs.len() as u64) as usize]
        };
        let result = send(target, &delivery);
        let mut s = storm.lock().expect("storm lock");
        s.sends += 1;
        let acknowledged = match &result {
            Ok(response) if (200..300).contains(&response.status) => true,
            Ok(response) => {
                if response.status == 503 {
                    s.status_503 += 1;
                } else {
                    // 404 order_not_found cannot happen (payments follow an
                    // acknowledged creation); 500 is a server fault.
                    s.violations.push(format!("{delivery:?}: {} {}", response.status, response.text()));
                }
                false
            }
            Err(SendError::Refused) => {
                s.refused += 1;
                false
            }
            Err(SendError::Cut) => {
                s.cut_in_flight += 1;
                false
            }
        };
        if !acknowledged {
            s.redeliveries += 1;
            let pause = Duration::from_millis(5 + rng.below(50));
            s.queue.push_back(Delivery { not_before: Instant::now() + pause, ..delivery });
            continue;
        }
        s.outstanding -= 1;
        let response = result.expect("acknowledged means answered");
        match judge(&delivery, &response) {
            Ok(Some(applied)) => *s.applied_answers.entry(applied).or_default() += 1,
            Ok(None) => {}
            Err(violation) => s.violations.push(violation),
        }
        let i = delivery.order;
        match delivery.kind {
            Kind::Create if !s.created[i] => {
                s.created[i] = true;
                // Two copies at once: concurrent duplicates.
                s.push(i, Kind::Pay(Channel::First), Duration::ZERO);
                s.push(i, Kind::Pay(Channel::First), Duration::ZERO);
            }
            Kind::Pay(Channel::First) if !s.first_paid[i] => {
                s.first_paid[i] = true;
                if has_second_channel(i) {
                    s.push(i, Kind::Pay(Channel::Second), Duration::ZERO);
                    s.push(i, Kind::Pay(Channel::Second), Duration::from_millis(rng.below(40)));
                }
            }
            _ => {}
        }
    }
}

/// The group-commit counters of `server`, from its `/metrics`.
fn group_commit_totals(server: &Server) -> Option<(u64, u64)> {
    let text = server.get("/metrics").text();
    let value = |name: &str| -> Option<u64> { text.lines().find_map(|l| l.strip_prefix(name)?.trim().parse().ok()) };
    Some((value("payonce_group_commit_batches_total ")?, value("payonce_group_commit_operations_total ")?))
}

fn start(db: &Db) -> Server {
    let points = POINTS_PER_YUAN.to_string();
    db.serve(&["--coupon", COUPONS[0], "--coupon", COUPONS[1], "--points-per-yuan", &points])
}

#[test]
fn sigkill_during_a_callback_storm_loses_and_duplicates_nothing() {
    crash_storm(&Db::sqlite("crash"), 1);
}

for_each_engine! {
    /// Two processes on one database; one of them is SIGKILLed again and again.
    fn sigkill_one_of_two_processes(db) {
        crash_storm(db, 2);
    }

    /// Four processes on one database; one of them is SIGKILLed again and again.
    fn sigkill_one_of_four_processes(db) {
        crash_storm(db, 4);
    }
}

/// The storm on `processes` servers on `db`; the first is SIGKILLed at
/// random moments and restarted on the same database each time, the others
/// keep serving. Then every acknowledged callback must be there exactly once.
fn crash_storm(db: &Db, processes: usize) {
    let started = Instant::now();
    let deadline = started + DEADLINE;
    let seed = std::env::var("PAYONCE_CRASH_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x00C0_FFEE_u64);
    let label = format!("crash ({}, {processes} processes)", db.label());
    println!("{label}: seed {seed} (PAYONCE_CRASH_SEED to replay)");
    let mut rng = Rng::new(seed);
    let mut servers: Vec<Server> = (0..processes).map(|_| start(db)).collect();
    let addrs = Arc::new(Mutex::new(servers.iter().map(|s| s.addr).collect::<Vec<_>>()));

    let mut storm = Storm { created: vec![false; ORDERS], first_paid: vec![false; ORDERS], ..Storm::default() };
    let mut creation_order: Vec<usize> = (0..ORDERS).collect();
    rng.shuffle(&mut creation_order);
    for (k, i) in creation_order.into_iter().enumerate() {
        storm.push(i, Kind::Create, ARRIVAL_SPREAD * k as u32);
    }
    let storm = Arc::new(Mutex::new(storm));
    let kills_done = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (storm, addrs, kills_done) = (Arc::clone(&storm), Arc::clone(&addrs), Arc::clone(&kills_done));
            let client_seed = seed.wrapping_add(1 + c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            thread::spawn(move || client(storm, addrs, kills_done, client_seed, deadline))
        })
        .collect();

    // SIGKILL the first process at random moments, restart it on the same database each time.
    let mut kills = 0;
    // (batches, operations) the killed process group-committed before each kill.
    let mut batched = (0u64, 0u64);
    while kills < KILLS_MIN && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50 + rng.below(350)));
        if let Some((b, o)) = group_commit_totals(&servers[0]) {
            batched = (batched.0 + b, batched.1 + o);
        }
        servers[0].kill();
        kills += 1;
        if rng.below(2) == 0 {
            // Sometimes stay down a while: the platform's retries pile up.
            thread::sleep(Duration::from_millis(rng.below(200)));
        }
        servers[0] = start(db);
        addrs.lock().expect("addr lock")[0] = servers[0].addr;
    }
    kills_done.store(true, Ordering::SeqCst);
    for client in clients {
        client.join().expect("client thread");
    }
    let elapsed_storm = started.elapsed();

    let s = storm.lock().expect("storm lock");
    let answers_lost = (0..ORDERS).filter(|i| !s.applied_answers.contains_key(&pay_no(*i, Channel::First))).count();
    println!(
        "{label}: {kills} SIGKILLs, {} sends, {} re-deliveries of unacknowledged requests ({} cut in flight, {} \
         refused while down, {} 503), {} extra re-deliveries of acknowledged payments, {answers_lost} payments \
         whose `applied` answer was lost (seen only as duplicate), storm {:.1}s",
        s.sends,
        s.redeliveries,
        s.cut_in_flight,
        s.refused,
        s.status_503,
        s.extra_duplicates,
        elapsed_storm.as_secs_f64()
    );
    assert!(kills >= 10, "{label}: only {kills} kills happened before the deadline");
    if db.engine == crate::engines::Engine::Sqlite {
        // The kills landed in a process that batched: operations shared COMMITs.
        println!(
            "{label}: before its kills the first process committed {} operations in {} batches",
            batched.1, batched.0
        );
        assert!(batched.1 > batched.0, "{label}: no batch held more than one operation: {batched:?}");
    }
    assert_eq!(s.outstanding, 0, "{label}: deliveries still unacknowledged at the deadline: {}", s.outstanding);
    assert!(s.violations.is_empty(), "{label}: answers that break the contract:\n{}", s.violations.join("\n"));
    assert!(s.cut_in_flight > 0, "{label}: no request was ever cut in flight: the kills hit nothing");
    let doubled: Vec<_> = s.applied_answers.iter().filter(|(_, n)| **n > 1).collect();
    assert!(doubled.is_empty(), "{label}: pay_nos answered `applied` more than once: {doubled:?}");
    drop(s);

    // One more SIGKILL of every process, then read the database as the crash left it.
    for server in &mut servers {
        server.kill();
    }
    let nb = (0..ORDERS).filter(|i| has_second_channel(*i)).count() as i64;
    if let Some(file) = db.sqlite_file() {
        let conn = Connection::open_with_flags(&file, OpenFlags::SQLITE_OPEN_READ_ONLY).expect("open db read-only");
        let check: String = conn.query_row("PRAGMA integrity_check", [], |r| r.get(0)).expect("integrity_check");
        assert_eq!(check, "ok", "PRAGMA integrity_check");
    }
    {
        let store = db.store();
        let count = |sql: &str| -> i64 { db.count(&store, sql) };
        assert_eq!(count("SELECT count(*) FROM orders"), ORDERS as i64, "{label}: orders");
        assert_eq!(count("SELECT count(*) FROM pay_callback_log"), ORDERS as i64 + nb, "{label}: callback log rows");
        assert_eq!(count("SELECT count(*) FROM user_coupon"), (ORDERS * COUPONS.len()) as i64, "{label}: coupons");
        assert_eq!(count("SELECT count(*) FROM point_log"), ORDERS as i64, "{label}: points rows");
        assert_eq!(count("SELECT count(*) FROM outbox_event"), ORDERS as i64 + nb, "{label}: events");
        assert_eq!(count("SELECT count(*) FROM refund"), 0, "{label}: refunds");

        for i in 0..ORDERS {
            let no = order_no(i);
            let first = pay_no(i, Channel::First);
            let exactly_one = |what: &str, sql: String| {
                assert_eq!(count(&sql), 1, "{label}: {no}: {what} ({sql})");
            };
            exactly_one(
                "PAID by its first payment, with its user and amount",
                format!(
                    "SELECT count(*) FROM orders WHERE order_no = '{no}' AND status = 'PAID' AND pay_no = '{first}' \
                     AND user_id = '{}' AND amount = {}",
                    user_id(i),
                    amount(i)
                ),
            );
            exactly_one(
                "the first payment applied",
                format!(
                    "SELECT count(*) FROM pay_callback_log p JOIN orders o ON o.id = p.order_id \
                     WHERE p.pay_no = '{first}' AND o.order_no = '{no}' AND p.outcome = 'applied' AND p.state = 'decided'"
                ),
            );
            if has_second_channel(i) {
                let second = pay_no(i, Channel::Second);
                exactly_one(
                    "the second payment already_paid",
                    format!(
                        "SELECT count(*) FROM pay_callback_log p JOIN orders o ON o.id = p.order_id \
                         WHERE p.pay_no = '{second}' AND o.order_no = '{no}' AND p.outcome = 'already_paid' \
                         AND p.state = 'decided'"
                    ),
                );
                exactly_one(
                    "payment.refund_required",
                    format!(
                        "SELECT count(*) FROM outbox_event WHERE type = 'payment.refund_required' \
                         AND event_id = 'payment.refund_required:{second}'"
                    ),
                );
            }
            for template in COUPONS {
                exactly_one(
                    "an ACTIVE coupon of each template",
                    format!(
                        "SELECT count(*) FROM user_coupon c JOIN orders o ON o.id = c.order_id \
                         WHERE o.order_no = '{no}' AND c.coupon_template_id = '{template}' AND c.status = 'ACTIVE' \
                         AND c.user_id = '{}'",
                        user_id(i)
                    ),
                );
            }
            exactly_one(
                "ORDER_PAID points",
                format!(
                    "SELECT count(*) FROM point_log p JOIN orders o ON o.id = p.order_id \
                     WHERE o.order_no = '{no}' AND p.point_type = 'ORDER_PAID' AND p.points = {}",
                    amount(i) * POINTS_PER_YUAN / 100
                ),
            );
            exactly_one(
                "order.paid",
                format!(
                    "SELECT count(*) FROM outbox_event WHERE type = 'order.paid' AND event_id = 'order.paid:{no}' \
                     AND order_no = '{no}'"
                ),
            );
        }
    }

    // The restarted service agrees: its own inspection finds nothing but the
    // refund-required second-channel payments, which are expected.
    let server = start(db);
    let inspection = get_json_http10(server.addr, "/v1/inspections");
    let findings = inspection["findings"].as_array().cloned().unwrap_or_default();
    let unexpected: Vec<&Value> = findings.iter().filter(|f| f["kind"] != "refund_required").collect();
    assert!(unexpected.is_empty(), "{label}: inspection findings after the storm: {unexpected:?}");
    assert_eq!(findings.len() as i64, nb, "{label}: refund_required findings: one per second-channel payment");
    assert_eq!(server.get("/healthz").status, 200);
    println!(
        "{label}: all {ORDERS} orders PAID once, {nb} refund-required, in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    assert!(started.elapsed() < Duration::from_secs(60), "{label}: the crash test took {:?}", started.elapsed());
}
