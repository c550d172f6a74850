//! `make bench`: payonce against the physical limit, in one run, on loopback.
//!
//! Measures, on file databases in one fresh directory:
//!
//! - the disk: append 4 KiB to a file and fsync it (bundled SQLite syncs its
//!   WAL with fsync, once per commit at `synchronous=FULL`);
//! - (a) the bare SQLite limit: the apply path's SQL (find the order, claim
//!   the pay_no, CAS the order, coupon, points, outbox event, decide) in
//!   `BEGIN IMMEDIATE` transactions with payonce's PRAGMAs, one connection,
//!   sequential, no HTTP, no locks — at `synchronous=FULL`, and once at
//!   `NORMAL` for reference;
//! - (b) payonce over HTTP, in process, with C concurrent keep-alive
//!   clients: order creation, applied callbacks (one per created order), and
//!   duplicate callbacks (re-deliveries of the applied pay_nos, re-signed);
//! - (c) a trivial handler on the same HTTP stack (`Server::serve_fn`), the
//!   same clients sending the same duplicate-callback requests.
//!
//! The shared disk and the two cores are noisy, so the pairs that make a
//! ratio run interleaved, in rounds: fsync / (a) / applied, then duplicates
//! / trivial; each figure is the total over its rounds. The fsync probe and
//! (a) also run with one thread spinning (`with_cpu_awake`), and the SQLite
//! limit is the better of the two.
//!
//! Targets: applied ≥ 0.7 × (a) at FULL, duplicates ≥ 0.5 × (c), peak RSS
//! (VmHWM) < 64 MiB through ≥ 100,000 requests, an empty keyed-lock map
//! afterwards. The server runs inside this process, so VmHWM covers server
//! and clients together.
//!
//! Run: `cargo run --release --example bench -- [--quick] [--clients N]
//! [--requests N] [--writes N] [--rounds N] [--dir PATH] [--phase-timeout-s N]`.
//! Request logging is set to `warn` unless `PAYONCE_LOG` is set.

use payonce::api::Response;
use payonce::http::{Server, WORKERS_DEFAULT};
use payonce::store::SCHEMA_SQL;
use payonce::{App, Clock, Config, Rewards};
use payonce_testclient as client;
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use serde_json::json;
use std::io::Write;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

const SECRET: &[u8] = b"bench-secret-0123456789abcdef";
const AMOUNT: i64 = 9900;
const COUPON: &str = "NEW10";
/// A client waits at most this long for one response.
const CLIENT_IO_TIMEOUT: Duration = Duration::from_secs(30);
const MIB: f64 = 1024.0 * 1024.0;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Clone, Debug)]
struct Options {
    clients: usize,
    /// Requests of the duplicate and trivial-handler phases (the long run).
    requests: usize,
    /// Transactions of (a), orders created and payments applied in (b).
    writes: usize,
    fsyncs: usize,
    rounds: usize,
    dir: PathBuf,
    /// Wall-time budget of each measured phase, over all its rounds.
    phase_timeout: Duration,
}

const USAGE: &str = "usage: bench [--quick] [--clients N (16)] [--requests N (100000)] [--writes N (5000)]
             [--rounds N (10)] [--dir PATH (temp dir)] [--phase-timeout-s N (120)]";

fn parse_options() -> Result<Options, String> {
    let mut options = Options {
        clients: 16,
        requests: 100_000,
        writes: 5_000,
        fsyncs: 500,
        rounds: 10,
        dir: std::env::temp_dir(),
        phase_timeout: Duration::from_secs(120),
    };
    let mut args = std::env::args().skip(1);
    let number = |value: Option<String>, flag: &str| -> Result<usize, String> {
        value
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("{flag} takes a positive integer"))
    };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => {
                options.requests = 5_000;
                options.writes = 300;
                options.fsyncs = 60;
                options.rounds = 3;
                options.phase_timeout = Duration::from_secs(30);
            }
            "--clients" => options.clients = number(args.next(), "--clients")?.min(256),
            "--requests" => options.requests = number(args.next(), "--requests")?,
            "--writes" => options.writes = number(args.next(), "--writes")?,
            "--rounds" => options.rounds = number(args.next(), "--rounds")?.min(100),
            "--phase-timeout-s" => {
                let seconds = number(args.next(), "--phase-timeout-s")?;
                options.phase_timeout = Duration::from_secs(u64::try_from(seconds).unwrap_or(u64::MAX));
            }
            "--dir" => options.dir = PathBuf::from(args.next().ok_or("--dir takes a directory")?),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    options.dir = options.dir.join(format!("payonce-bench-{}", std::process::id()));
    Ok(options)
}

/// One measured phase, possibly summed over rounds.
struct Phase {
    name: String,
    count: usize,
    errors: usize,
    first_error: Option<String>,
    elapsed: Duration,
    /// CPU time of the whole process (all threads) during the phase.
    cpu: Duration,
    latencies: Vec<Duration>,
    timed_out: bool,
    /// Fewest requests one client completed in one round (HTTP phases).
    client_min: Option<usize>,
    reconnects: usize,
    /// Throughput of each round merged into this phase.
    round_rates: Vec<f64>,
}

impl Phase {
    fn new(name: &str) -> Phase {
        Phase {
            name: name.to_owned(),
            count: 0,
            errors: 0,
            first_error: None,
            elapsed: Duration::ZERO,
            cpu: Duration::ZERO,
            latencies: Vec::new(),
            timed_out: false,
            client_min: None,
            reconnects: 0,
            round_rates: Vec::new(),
        }
    }

    fn note_error(&mut self, message: String) {
        self.errors += 1;
        self.first_error.get_or_insert(message);
    }

    fn merge(&mut self, round: Phase) {
        self.round_rates.push(round.rate());
        self.count += round.count;
        self.errors += round.errors;
        if self.first_error.is_none() {
            self.first_error = round.first_error;
        }
        self.elapsed += round.elapsed;
        self.cpu += round.cpu;
        self.latencies.extend(round.latencies);
        self.timed_out |= round.timed_out;
        self.client_min = match (self.client_min, round.client_min) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.reconnects += round.reconnects;
    }

    /// What is left of `budget` for further rounds; `None` (and marked
    /// timed out) when it is spent.
    fn budget_left(&mut self, budget: Duration) -> Option<Duration> {
        let left = budget.checked_sub(self.elapsed).filter(|d| !d.is_zero());
        if left.is_none() {
            self.timed_out = true;
        }
        left
    }

    fn finish(&mut self) {
        self.latencies.sort_unstable();
    }

    fn rate(&self) -> f64 {
        self.count as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Nearest-rank percentile of the sorted latencies, in ms.
    fn percentile_ms(&self, p: f64) -> f64 {
        if self.latencies.is_empty() {
            return 0.0;
        }
        let rank = ((self.latencies.len() as f64 * p).ceil() as usize).clamp(1, self.latencies.len());
        self.latencies[rank - 1].as_secs_f64() * 1000.0
    }
}

fn main() {
    if std::env::var_os("PAYONCE_LOG").is_none() {
        // payonce logs one info line per request on stderr by default; the
        // benchmark measures the service, not the terminal (docs/performance.md).
        std::env::set_var("PAYONCE_LOG", "warn");
    }
    let options = match parse_options() {
        Ok(options) => options,
        Err(message) => {
            eprintln!("bench: {message}");
            std::process::exit(2);
        }
    };
    let result = run(&options);
    let _ = std::fs::remove_dir_all(&options.dir);
    match result {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("bench: {e}");
            std::process::exit(1);
        }
    }
}

/// The slice of `0..total` that round `round` of `rounds` covers.
fn slice(total: usize, rounds: usize, round: usize) -> Range<usize> {
    (total * round / rounds)..(total * (round + 1) / rounds)
}

fn run(options: &Options) -> Result<bool, BoxError> {
    let _ = std::fs::remove_dir_all(&options.dir);
    std::fs::create_dir_all(&options.dir)?;
    let cores = cores();
    println!(
        "payonce bench · {} · {cores} cores, {:.0} GiB RAM · {} · {} clients, {} writes, {} requests, {} rounds · PAYONCE_LOG={}",
        Clock::System.now_text(),
        mem_total_gib(),
        options.dir.display(),
        options.clients,
        options.writes,
        options.requests,
        options.rounds,
        std::env::var("PAYONCE_LOG").unwrap_or_default(),
    );
    let budget = options.phase_timeout;

    // payonce, in process, and the trivial handler, each on its own port.
    let db = options.dir.join("payonce.db").display().to_string();
    let config = Config {
        platforms: payonce::platforms::Platforms::with([payonce::platforms::Platform::notices(
            payonce::platforms::generic::Generic::new(vec![SECRET.to_vec()]),
        )]),
        rewards: Rewards { coupon_templates: vec![COUPON.into()], points_per_yuan: 1 },
        ..Default::default()
    };
    let app = Arc::new(App::open(&db, Clock::System, config)?);
    let server = Server::bind("127.0.0.1:0")?;
    let addr = server.local_addr();
    let shutdown = Arc::new(AtomicBool::new(false));
    let serving = {
        let (app, shutdown) = (Arc::clone(&app), Arc::clone(&shutdown));
        thread::spawn(move || server.serve(app, shutdown, WORKERS_DEFAULT))
    };
    let trivial_server = Server::bind("127.0.0.1:0")?;
    let trivial_addr = trivial_server.local_addr();
    let trivial_serving = {
        let shutdown = Arc::clone(&shutdown);
        thread::spawn(move || {
            trivial_server.serve_fn(|_req| Response::json(200, &json!({"code": "SUCCESS"})), shutdown, WORKERS_DEFAULT)
        })
    };
    let outcome = measure(options, &app, addr, trivial_addr, budget);
    shutdown.store(true, Ordering::SeqCst);
    let drained = serving.join().unwrap_or(false) && trivial_serving.join().unwrap_or(false);
    let clean = outcome?;
    if !drained {
        println!("a server did not finish its requests within its shutdown grace period");
    }
    Ok(clean && drained)
}

fn measure(
    options: &Options,
    app: &App,
    addr: SocketAddr,
    trivial_addr: SocketAddr,
    budget: Duration,
) -> Result<bool, BoxError> {
    let clients = options.clients;
    let payonce_host = addr.to_string();
    let trivial_host = trivial_addr.to_string();

    progress("(b) order creation");
    let mut orders = Phase::new("(b) order creation, POST /v1/orders");
    {
        let host = payonce_host.clone();
        let round = http_round(
            addr,
            clients,
            0..options.writes,
            budget,
            move |i| create_order_request(&host, i),
            |status, _| status == 201,
        )?;
        orders.merge(round);
    }
    let created = orders.count;

    // Each disk-bound measurement runs twice per round: as is, and with one
    // thread spinning so a vCPU stays awake (see `with_cpu_awake`).
    let mut fsync = Phase::new("disk: append 4 KiB + fsync");
    let mut fsync_awake = Phase::new("disk: append 4 KiB + fsync, CPU kept awake");
    let mut bare_full = Phase::new("(a) bare SQLite apply SQL, synchronous=FULL");
    let mut bare_awake = Phase::new("(a) the same, CPU kept awake");
    let mut applied = Phase::new("(b) applied callbacks");
    // Orders 0..created for (a) as is, created..2*created for (a) kept awake.
    let mut bare = BareSqlite::open(&options.dir.join("bare-full.db"), "FULL", 2 * created)?;
    let probe_path = options.dir.join("fsync-probe");
    let mut probe = std::fs::OpenOptions::new().create(true).truncate(true).write(true).open(&probe_path)?;
    for round in 0..options.rounds {
        progress(&format!(
            "round {}/{}: fsync, (a) bare SQLite FULL (as is, CPU kept awake), (b) applied callbacks",
            round + 1,
            options.rounds
        ));
        let fsyncs = slice(options.fsyncs, options.rounds, round).len();
        if let Some(left) = fsync.budget_left(budget) {
            fsync.merge(measure_fsync(&mut probe, fsyncs, left)?);
        }
        if let Some(left) = fsync_awake.budget_left(budget) {
            fsync_awake.merge(with_cpu_awake(|| measure_fsync(&mut probe, fsyncs, left))?);
        }
        let range = slice(created, options.rounds, round);
        if let Some(left) = bare_full.budget_left(budget) {
            bare_full.merge(bare.apply(range.clone(), left));
        }
        if let Some(left) = bare_awake.budget_left(budget) {
            let shifted = (range.start + created)..(range.end + created);
            bare_awake.merge(with_cpu_awake(|| bare.apply(shifted, left)));
        }
        if let Some(left) = applied.budget_left(budget) {
            let host = payonce_host.clone();
            applied.merge(http_round(
                addr,
                clients,
                range,
                left,
                move |i| callback_request(&host, i),
                |status, body| status == 200 && contains(body, br#""outcome":"applied""#),
            )?);
        }
    }
    drop(probe);
    let _ = std::fs::remove_file(&probe_path);
    drop(bare);

    progress("(a) bare SQLite, synchronous=NORMAL");
    let mut bare_normal = Phase::new("(a) bare SQLite apply SQL, synchronous=NORMAL");
    {
        let mut normal = BareSqlite::open(&options.dir.join("bare-normal.db"), "NORMAL", created)?;
        bare_normal.merge(normal.apply(0..created, budget));
    }

    let paid = applied.count.max(1);
    let mut duplicates = Phase::new("(b) duplicate callbacks");
    let mut trivial = Phase::new("(c) trivial handler, same requests");
    for round in 0..options.rounds {
        progress(&format!("round {}/{}: (b) duplicate callbacks, (c) trivial handler", round + 1, options.rounds));
        let range = slice(options.requests, options.rounds, round);
        if let Some(left) = duplicates.budget_left(budget) {
            let host = payonce_host.clone();
            duplicates.merge(http_round(
                addr,
                clients,
                range.clone(),
                left,
                move |i| callback_request(&host, i % paid),
                |status, body| status == 200 && contains(body, br#""outcome":"duplicate""#),
            )?);
        }
        if let Some(left) = trivial.budget_left(budget) {
            let host = trivial_host.clone();
            trivial.merge(http_round(
                trivial_addr,
                clients,
                range,
                left,
                move |i| callback_request(&host, i % paid),
                |status, _| status == 200,
            )?);
        }
    }
    let lock_map_len = app.locks().len();
    let (peak_rss, rss_now) = memory_status();
    // SAFETY: plain reads of SQLite's global memory counters; no arguments to uphold.
    let (sqlite_peak, sqlite_now) =
        unsafe { (rusqlite::ffi::sqlite3_memory_highwater(0) as f64, rusqlite::ffi::sqlite3_memory_used() as f64) };
    let payonce_requests = orders.count + applied.count + duplicates.count;
    let all_requests = payonce_requests + trivial.count;

    let mut phases = [fsync, fsync_awake, bare_full, bare_awake, bare_normal, orders, applied, duplicates, trivial];
    phases.iter_mut().for_each(Phase::finish);
    print_table(&phases);
    let [fsync, fsync_awake, bare_full, bare_awake, bare_normal, _orders, applied, duplicates, trivial] = &phases;

    // The SQLite limit is the better of the two ways of measuring it.
    let limit = bare_awake.rate().max(bare_full.rate());
    let applied_ratio = applied.rate() / limit;
    let duplicate_ratio = duplicates.rate() / trivial.rate();
    println!();
    println!(
        "fsync p50 {:.2} ms as is, {:.2} ms with the CPU kept awake; (a) at FULL: {:.0}/s as is, {:.0}/s kept awake \
         (the SQLite limit is the higher, {:.0}/s); at NORMAL {:.0}/s",
        fsync.percentile_ms(0.5),
        fsync_awake.percentile_ms(0.5),
        bare_full.rate(),
        bare_awake.rate(),
        limit,
        bare_normal.rate()
    );
    println!(
        "peak RSS {:.1} MiB (VmHWM of this one process: payonce, the trivial server and {clients} client threads), \
         VmRSS {:.1} MiB, after {payonce_requests} requests to payonce and {all_requests} in all",
        peak_rss / MIB,
        rss_now / MIB
    );
    println!(
        "of which SQLite's heap (page caches of the pooled connections and of (a)): high-water {:.1} MiB, now {:.1} MiB",
        sqlite_peak / MIB,
        sqlite_now / MIB
    );
    println!();
    println!("{:<44} {:>10} {:>10}  verdict", "target", "measured", "target");
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
    let rss_verdict = if payonce_requests >= 100_000 {
        verdict(peak_rss < 64.0 * MIB).to_owned()
    } else {
        format!("{} (but fewer than 100,000 requests)", verdict(peak_rss < 64.0 * MIB))
    };
    let rows = [
        (
            "applied callbacks / (a) SQLite limit at FULL",
            format!("{applied_ratio:.3}"),
            ">= 0.700",
            verdict(applied_ratio >= 0.7).to_owned(),
        ),
        (
            "duplicate callbacks / (c) trivial handler",
            format!("{duplicate_ratio:.3}"),
            ">= 0.500",
            verdict(duplicate_ratio >= 0.5).to_owned(),
        ),
        ("peak RSS (VmHWM)", format!("{:.1} MiB", peak_rss / MIB), "< 64 MiB", rss_verdict),
        ("keyed-lock map entries after the run", lock_map_len.to_string(), "0", verdict(lock_map_len == 0).to_owned()),
    ];
    for (name, measured, target, verdict) in rows {
        println!("{name:<44} {measured:>10} {target:>10}  {verdict}");
    }

    let timed_out: Vec<&str> = phases.iter().filter(|p| p.timed_out).map(|p| p.name.as_str()).collect();
    if !timed_out.is_empty() {
        println!("stopped at the phase time limit ({} s): {}", budget.as_secs(), timed_out.join("; "));
    }
    let idle: Vec<&str> = phases.iter().filter(|p| p.client_min == Some(0)).map(|p| p.name.as_str()).collect();
    if !idle.is_empty() {
        println!("a client completed no request in some round of: {}", idle.join("; "));
    }
    let errors: usize = phases.iter().map(|p| p.errors).sum();
    if errors > 0 {
        println!("{errors} unexpected answers: the figures above are not valid");
    }
    Ok(errors == 0)
}

fn progress(step: &str) {
    eprintln!("bench: {step} ...");
}

fn print_table(phases: &[Phase]) {
    println!();
    println!(
        "{:<44} {:>8} {:>6} {:>9} {:>8} {:>8} {:>8} {:>7}",
        "phase", "count", "errors", "per s", "p50 ms", "p99 ms", "max ms", "CPU %"
    );
    for p in phases {
        println!(
            "{:<44} {:>8} {:>6} {:>9.0} {:>8.2} {:>8.2} {:>8.2} {:>7.0}",
            p.name,
            p.count,
            p.errors,
            p.rate(),
            p.percentile_ms(0.50),
            p.percentile_ms(0.99),
            p.percentile_ms(1.0),
            100.0 * p.cpu.as_secs_f64() / p.elapsed.as_secs_f64().max(1e-9) / cores() as f64,
        );
        if let Some(e) = &p.first_error {
            println!("    first unexpected answer: {e}");
        }
        if p.round_rates.len() > 1 {
            let rates: Vec<String> = p.round_rates.iter().map(|r| format!("{r:.0}")).collect();
            println!("    per round, per s: {}", rates.join(" "));
        }
        if p.reconnects > 0 {
            println!("    {} reconnections", p.reconnects);
        }
    }
}

// ---- the disk ----

/// Runs `work` while one thread spins, so the machine never goes idle.
///
/// On this VM an idle vCPU is slow to wake: a thread blocked in fsync on an
/// otherwise idle machine can see its completion ~4 ms late, at moments when
/// the host is busy, while the same fsync on a busy machine returns in
/// ~0.2 ms. payonce under load keeps the CPUs busy; a sequential loop does
/// not. Measuring (a) both ways and keeping the better keeps that artefact
/// out of the SQLite limit.
fn with_cpu_awake<T>(work: impl FnOnce() -> T) -> T {
    let stop = Arc::new(AtomicBool::new(false));
    let spinner = {
        let stop = Arc::clone(&stop);
        thread::Builder::new().name("bench-spinner".into()).spawn(move || {
            // Bounded by the flag, and by a minute in case `work` never returns.
            let started = Instant::now();
            while !stop.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(60) {
                std::hint::spin_loop();
            }
        })
    };
    let value = work();
    stop.store(true, Ordering::Relaxed);
    if let Ok(spinner) = spinner {
        let _ = spinner.join();
    }
    value
}

/// Appends 4 KiB to `file` and fsyncs it, `n` times or for at most `budget`.
fn measure_fsync(file: &mut std::fs::File, n: usize, budget: Duration) -> Result<Phase, BoxError> {
    let block = vec![0x5au8; 4096];
    let mut phase = Phase::new("fsync");
    let started = Instant::now();
    let cpu = process_cpu();
    for _ in 0..n {
        if started.elapsed() >= budget {
            phase.timed_out = true;
            break;
        }
        let t = Instant::now();
        file.write_all(&block)?;
        file.sync_all()?;
        phase.latencies.push(t.elapsed());
        phase.count += 1;
    }
    phase.elapsed = started.elapsed();
    phase.cpu = process_cpu().saturating_sub(cpu);
    Ok(phase)
}

// ---- (a) the bare SQLite limit ----

/// One connection with payonce's PRAGMAs on a database from `SCHEMA_SQL`,
/// holding `orders` PENDING orders.
struct BareSqlite {
    conn: Connection,
    rewards_due: String,
}

impl BareSqlite {
    fn open(path: &Path, synchronous: &str, orders: usize) -> Result<BareSqlite, BoxError> {
        let mut conn = Connection::open(path)?;
        conn.busy_timeout(Duration::from_millis(payonce::store::BUSY_TIMEOUT_MS))?;
        let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(format!("journal_mode stayed {mode}").into());
        }
        conn.pragma_update(None, "synchronous", synchronous)?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.execute_batch(SCHEMA_SQL)?;
        let now = Clock::System.now_text();
        let expires = payonce::clock::format_ms(Clock::System.now_ms() + 3_600_000);
        {
            let mut insert = tx.prepare(
                "INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at)
                 VALUES (?1, ?2, ?3, 'CNY', 'PENDING', ?4, ?5)",
            )?;
            for i in 0..orders {
                insert.execute(params![order_no(i), user_id(i), AMOUNT, now, expires])?;
            }
        }
        tx.commit()?;
        let rewards_due = json!({"coupons": [COUPON], "points": AMOUNT / 100}).to_string();
        Ok(BareSqlite { conn, rewards_due })
    }

    /// Applies payments `range`, one transaction each, for at most `budget`.
    fn apply(&mut self, range: Range<usize>, budget: Duration) -> Phase {
        let mut phase = Phase::new("bare");
        let started = Instant::now();
        let cpu = process_cpu();
        for i in range {
            if started.elapsed() >= budget {
                phase.timed_out = true;
                break;
            }
            let t = Instant::now();
            let result = self.apply_one(i);
            phase.latencies.push(t.elapsed());
            phase.count += 1;
            if let Err(e) = result {
                phase.note_error(format!("payment {i}: {e}"));
            }
        }
        phase.elapsed = started.elapsed();
        phase.cpu = process_cpu().saturating_sub(cpu);
        phase
    }

    /// The apply path's statements, as `Tx` runs them for an applied payment.
    fn apply_one(&mut self, i: usize) -> Result<(), BoxError> {
        let now = Clock::System.now_text();
        let (order_no, pay_no) = (order_no(i), pay_no(i));
        let body = callback_body(i);
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let (order_id, user_id): (i64, String) = tx
            .prepare_cached("SELECT id, user_id FROM orders WHERE order_no = ?1")?
            .query_row([&order_no], |r| Ok((r.get(0)?, r.get(1)?)))?;
        // payonce reads the pay_no's record inside the transaction; a new
        // one is inserted further down, already decided.
        let known: Option<i64> = tx
            .prepare_cached("SELECT id FROM pay_callback_log WHERE pay_no = ?1")?
            .query_row([&pay_no], |r| r.get(0))
            .optional()?;
        let paid = tx
            .prepare_cached(
                "UPDATE orders SET status = 'PAID', pay_no = ?3, paid_at = ?4
                 WHERE id = ?1 AND status = 'PENDING' AND amount = ?2",
            )?
            .execute(params![order_id, AMOUNT, pay_no, now])?;
        if known.is_some() || paid != 1 {
            return Err(format!("pay_no known: {}, paid {paid} rows, expected 1", known.is_some()).into());
        }
        tx.prepare_cached(
            "INSERT INTO user_coupon (user_id, order_id, coupon_template_id, status, created_at)
             VALUES (?1, ?2, ?3, 'ACTIVE', ?4)
             ON CONFLICT (order_id, coupon_template_id) DO NOTHING",
        )?
        .execute(params![user_id, order_id, COUPON, now])?;
        tx.prepare_cached(
            "INSERT INTO point_log (user_id, order_id, point_type, points, created_at)
             VALUES (?1, ?2, 'ORDER_PAID', ?3, ?4)
             ON CONFLICT (order_id, point_type, coalesce(refund_no, '')) DO NOTHING",
        )?
        .execute(params![user_id, order_id, AMOUNT / 100, now])?;
        tx.prepare_cached(
            "INSERT INTO pay_callback_log
                 (pay_no, channel, order_id, amount, status, outcome, state, source, raw_body, paid_at, received_at,
                  decided_at, applied_at, rewards_due)
             VALUES (?1, 'generic', ?2, ?3, 'SUCCESS', 'applied', 'decided', 'callback', ?4, NULL, ?5, ?5, ?5, ?6)",
        )?
        .execute(params![pay_no, order_id, AMOUNT, body, now, self.rewards_due])?;
        // The payload payonce writes: the order object and the payment.
        let data = json!({
            "order": {"order_no": order_no, "user_id": user_id, "amount": AMOUNT, "currency": "CNY",
                      "status": "PAID", "pay_no": pay_no, "created_at": now, "expires_at": now,
                      "paid_at": now, "closed_at": null, "refund_no": null, "refunded_at": null},
            "payment": {"pay_no": pay_no, "channel": "generic", "amount": AMOUNT, "outcome": "applied"},
        });
        tx.prepare_cached(
            "INSERT INTO outbox_event (event_id, type, order_no, data, created_at)
             VALUES (?1, 'order.paid', ?2, ?3, ?4)
             ON CONFLICT (event_id) DO NOTHING",
        )?
        .execute(params![format!("order.paid:{order_no}"), order_no, data.to_string(), now])?;
        tx.commit()?;
        Ok(())
    }
}

// ---- requests ----

fn order_no(i: usize) -> String {
    format!("BO{i:08}")
}

fn pay_no(i: usize) -> String {
    format!("BP{i:08}")
}

fn user_id(i: usize) -> String {
    format!("u{}", i % 97)
}

fn callback_body(i: usize) -> Vec<u8> {
    format!(r#"{{"pay_no":"{}","order_no":"{}","amount":{AMOUNT},"status":"SUCCESS"}}"#, pay_no(i), order_no(i))
        .into_bytes()
}

/// A generic-channel callback for payment `i`, signed now (a re-delivery
/// carries the same body with a fresh signature).
fn callback_request(host: &str, i: usize) -> Vec<u8> {
    let body = callback_body(i);
    let now_s = Clock::System.now_ms().div_euclid(1000);
    let signature = payonce::signature::sign(SECRET, now_s, &body);
    http_request("POST", host, "/v1/callbacks/generic", &[("Payonce-Signature", &signature)], &body)
}

fn create_order_request(host: &str, i: usize) -> Vec<u8> {
    let body = format!(r#"{{"order_no":"{}","user_id":"{}","amount":{AMOUNT}}}"#, order_no(i), user_id(i));
    http_request("POST", host, "/v1/orders", &[], body.as_bytes())
}

/// A JSON request: `Content-Type` and `Content-Length` (payonce-testclient
/// writes the length).
fn http_request(method: &str, host: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut all: Vec<(&str, &str)> = vec![("Content-Type", "application/json")];
    all.extend_from_slice(headers);
    client::encode_request(method, host, path, &all, body)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

// ---- (b), (c): keep-alive clients ----

/// A keep-alive client (payonce-testclient's connection): one request at a time.
struct Client {
    connection: client::Connection,
}

impl Client {
    /// Connects and completes one `GET /healthz` before returning, so every
    /// connection is established and served by a server thread before the
    /// clock starts.
    fn connect(addr: SocketAddr) -> Result<Client, BoxError> {
        let connection = client::Connection::connect(addr, CLIENT_IO_TIMEOUT, CLIENT_IO_TIMEOUT)?;
        let mut client = Client { connection };
        client.exchange(&client::encode_request("GET", &addr.to_string(), "/healthz", &[], b""))?;
        Ok(client)
    }

    /// Sends one request and reads its response: (status, body, keep-alive).
    fn exchange(&mut self, request: &[u8]) -> Result<(u16, Vec<u8>, bool), BoxError> {
        let response = self.connection.exchange(request)?;
        Ok((response.status, response.body, !response.close))
    }
}

/// One round of an HTTP phase: requests `range` from `clients` keep-alive
/// connections (request `i` is `make(i)`, `expect` judges each answer), for
/// at most `budget`.
fn http_round(
    addr: SocketAddr,
    clients: usize,
    range: Range<usize>,
    budget: Duration,
    make: impl Fn(usize) -> Vec<u8> + Send + Sync + 'static,
    expect: fn(u16, &[u8]) -> bool,
) -> Result<Phase, BoxError> {
    let make = Arc::new(make);
    let next = Arc::new(AtomicUsize::new(range.start));
    let end = range.end;
    let phase = Arc::new(Mutex::new(Phase::new("http")));
    let mut connections = Vec::with_capacity(clients);
    for _ in 0..clients {
        connections.push(Client::connect(addr)?);
    }
    let started = Instant::now();
    let cpu = process_cpu();
    let deadline = started + budget;
    let handles: Vec<_> = connections
        .into_iter()
        .enumerate()
        .map(|(n, mut client)| {
            let (make, next, phase) = (Arc::clone(&make), Arc::clone(&next), Arc::clone(&phase));
            thread::Builder::new().name(format!("bench-client-{n}")).spawn(move || {
                let mut mine = Phase::new("client");
                loop {
                    if Instant::now() >= deadline {
                        mine.timed_out = true;
                        break;
                    }
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= end {
                        break;
                    }
                    let request = make(i);
                    let t = Instant::now();
                    let answer = client.exchange(&request);
                    mine.latencies.push(t.elapsed());
                    mine.count += 1;
                    let reconnect = match answer {
                        Ok((status, body, keep_alive)) => {
                            if !expect(status, &body) {
                                mine.note_error(format!("request {i}: {status} {}", String::from_utf8_lossy(&body)));
                            }
                            !keep_alive
                        }
                        Err(e) => {
                            mine.note_error(format!("request {i}: {e}"));
                            true
                        }
                    };
                    if reconnect {
                        mine.reconnects += 1;
                        match Client::connect(addr) {
                            Ok(c) => client = c,
                            Err(e) => {
                                mine.note_error(format!("reconnecting: {e}"));
                                break;
                            }
                        }
                    }
                }
                mine.client_min = Some(mine.count);
                if let Ok(mut phase) = phase.lock() {
                    phase.merge(mine);
                }
            })
        })
        .collect::<Result<_, _>>()?;
    for handle in handles {
        handle.join().map_err(|_| "a client thread panicked")?;
    }
    let elapsed = started.elapsed();
    let mut phase = Arc::try_unwrap(phase)
        .map_err(|_| "client threads still hold the round")?
        .into_inner()
        .map_err(|_| "a client thread panicked")?;
    // The clients' latencies summed their own times; the round's time is the wall clock.
    phase.elapsed = elapsed;
    phase.cpu = process_cpu().saturating_sub(cpu);
    Ok(phase)
}

// ---- memory and CPU ----

/// CPU time (user + system) of every thread of this process so far, from
/// `/proc/self/stat` (clock ticks of 10 ms).
fn process_cpu() -> Duration {
    const TICKS_PER_S: u64 = 100;
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let fields: Vec<&str> = stat.rsplit_once(')').map_or(vec![], |(_, rest)| rest.split_whitespace().collect());
    let ticks: u64 = [11, 12].iter().filter_map(|&i| fields.get(i).and_then(|f| f.parse::<u64>().ok())).sum();
    Duration::from_millis(ticks * 1000 / TICKS_PER_S)
}

/// (VmHWM, VmRSS) of this process in bytes.
fn memory_status() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or(f64::NAN, |kib| kib * 1024.0)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

fn cores() -> usize {
    thread::available_parallelism().map_or(1, |n| n.get())
}

fn mem_total_gib() -> f64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0 / 1024.0)
}
