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
//! - **L_batch** and **A_batch**: the same statements, 64 payments per
//!   COMMIT (each in its own SAVEPOINT, as payonce's group commit runs
//!   them), `synchronous=FULL`, on the minimal schema (only the tables and
//!   unique keys the SQL needs) and on payonce's own schema; with the CPU
//!   per payment and the WAL frames (pages) each payment writes;
//! - (b) payonce over HTTP, in process (16 workers, as `payonce serve`),
//!   with C concurrent keep-alive clients: order creation, applied callbacks
//!   (one per created order), and duplicate callbacks (re-deliveries of the
//!   applied pay_nos, re-signed); applied callbacks also at 64 clients,
//!   through a second server on the same `App` with 64 workers (with 16, no
//!   batch could hold more than 16); for both, the writer's CPU per payment
//!   (examples/support/watch.rs), the worker and edge threads' CPU and
//!   wake-ups per payment, the mean batch and the WAL pages;
//! - (c) a trivial handler on the same HTTP stack (`Server::serve_fn`), the
//!   same clients sending the same duplicate-callback requests.
//!
//! The shared disk and the two cores are noisy, so the pairs that make a
//! ratio run interleaved, in rounds: fsync / (a) / applied at 16 clients,
//! then duplicates / trivial, then L_batch / A_batch / applied at 64
//! clients; each figure is the total over its rounds. The fsync probe, (a),
//! L_batch and A_batch also run with one thread spinning
//! (`with_cpu_awake`), and each limit is the better of the two.
//!
//! Targets: applied ≥ 0.7 × (a) at FULL; applied at 64 clients ≥ 0.25 ×
//! L_batch; A_batch ≥ 0.5 × L_batch; duplicates ≥ 0.5 × (c); p99 of applied
//! at 16 clients ≤ 10 ms; peak RSS (VmHWM) < 64 MiB through ≥ 100,000
//! requests; an empty keyed-lock map afterwards. The server runs inside
//! this process, so VmHWM covers server and clients together; it is read
//! after the duplicates, before the batched databases and the 64 workers
//! of the last rounds add theirs (the end's VmHWM is printed beside it).
//!
//! `--statement-profile` adds the thread CPU of each SQL statement on
//! payonce's writer (at 64 clients) and in L_batch / A_batch (it slows what
//! it watches); `--schema-costs` runs A_batch again on variants of
//! payonce's schema with one part taken away at a time; `--only` picks
//! phases (for `perf record`, docs/performance.md).
//!
//! Run: `cargo run --release --example bench -- [--quick] [--clients N]
//! [--clients-high N] [--workers N] [--workers-high N] [--requests N] [--writes N] [--batched N]
//! [--rounds N] [--dir PATH] [--phase-timeout-s N] [--only PHASES]
//! [--statement-profile] [--schema-costs]`.
//! Request logging is set to `warn` unless `PAYONCE_LOG` is set.

#[path = "support/mod.rs"]
mod support;
#[path = "support/watch.rs"]
mod watch;

use payonce::api::Response;
use payonce::http::{Server, WORKERS_DEFAULT};
use payonce::store::{StoreOptions, SCHEMA_SQL};
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
use support::MINIMAL_SCHEMA;
use watch::{ThreadTotals, Watch, WatchTotals};

const SECRET: &[u8] = b"bench-secret-0123456789abcdef";
const AMOUNT: i64 = 9900;
const COUPON: &str = "NEW10";
/// A client waits at most this long for one response.
const CLIENT_IO_TIMEOUT: Duration = Duration::from_secs(30);
const MIB: f64 = 1024.0 * 1024.0;

/// payonce's own connections: the writer's transactions, WAL frames, statements.
static PAYONCE: Watch = Watch::new();

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The phases `--only` can pick (order creation runs whenever an applied
/// phase does; duplicates re-deliver the payments applied at 16 clients).
const PHASE_KEYS: [&str; 9] =
    ["fsync", "a", "normal", "l-batch", "a-batch", "applied16", "applied64", "duplicates", "trivial"];

#[derive(Clone, Debug)]
struct Options {
    clients: usize,
    /// Clients of the second applied phase, against L_batch.
    clients_high: usize,
    /// Worker threads of payonce's server and of the trivial one.
    workers: usize,
    /// Worker threads of the payonce server the higher client count drives.
    workers_high: usize,
    /// Requests of the duplicate and trivial-handler phases (the long run).
    requests: usize,
    /// Transactions of (a), orders created and payments applied in (b), per client count.
    writes: usize,
    /// Payments of L_batch and A_batch.
    batched: usize,
    fsyncs: usize,
    rounds: usize,
    dir: PathBuf,
    /// Wall-time budget of each measured phase, over all its rounds.
    phase_timeout: Duration,
    /// `None`: every phase.
    only: Option<Vec<String>>,
    /// Thread CPU per SQL statement on payonce's writer (applied at the
    /// higher client count) and in L_batch / A_batch: slows what it watches.
    statement_profile: bool,
    /// A_batch again with parts of payonce's schema taken away, one at a time.
    schema_costs: bool,
}

impl Options {
    fn runs(&self, key: &str) -> bool {
        self.only.as_ref().is_none_or(|only| only.iter().any(|k| k == key))
    }
}

const USAGE: &str =
    "usage: bench [--quick] [--clients N (16)] [--clients-high N (64)] [--workers N (16)] [--workers-high N (64)]
             [--requests N (100000)] [--writes N (5000)] [--batched N (4 x writes)] [--rounds N (10)]
             [--dir PATH (temp dir)] [--phase-timeout-s N (120)]
             [--only PHASE,... (fsync a normal l-batch a-batch applied16 applied64 duplicates trivial)]
             [--statement-profile] [--schema-costs]";

fn parse_options() -> Result<Options, String> {
    let mut options = Options {
        clients: 16,
        clients_high: 64,
        workers: WORKERS_DEFAULT,
        workers_high: 64,
        requests: 100_000,
        writes: 5_000,
        batched: 0,
        fsyncs: 500,
        rounds: 10,
        dir: std::env::temp_dir(),
        phase_timeout: Duration::from_secs(120),
        only: None,
        statement_profile: false,
        schema_costs: false,
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
            "--clients-high" => options.clients_high = number(args.next(), "--clients-high")?.min(256),
            "--workers" => options.workers = number(args.next(), "--workers")?.min(1024),
            "--workers-high" => options.workers_high = number(args.next(), "--workers-high")?.min(1024),
            "--requests" => options.requests = number(args.next(), "--requests")?,
            "--writes" => options.writes = number(args.next(), "--writes")?,
            "--batched" => options.batched = number(args.next(), "--batched")?,
            "--rounds" => options.rounds = number(args.next(), "--rounds")?.min(100),
            "--phase-timeout-s" => {
                let seconds = number(args.next(), "--phase-timeout-s")?;
                options.phase_timeout = Duration::from_secs(u64::try_from(seconds).unwrap_or(u64::MAX));
            }
            "--dir" => options.dir = PathBuf::from(args.next().ok_or("--dir takes a directory")?),
            "--only" => {
                let list = args.next().ok_or("--only takes a comma-separated list of phases")?;
                let keys: Vec<String> =
                    list.split(',').map(|k| k.trim().to_owned()).filter(|k| !k.is_empty()).collect();
                if let Some(unknown) = keys.iter().find(|k| !PHASE_KEYS.contains(&k.as_str())) {
                    return Err(format!("--only: unknown phase {unknown:?}\n{USAGE}"));
                }
                options.only = Some(keys);
            }
            "--statement-profile" => options.statement_profile = true,
            "--schema-costs" => options.schema_costs = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if options.batched == 0 {
        options.batched = 4 * options.writes;
    }
    if options.runs("duplicates") && !options.runs("applied16") {
        return Err("--only: duplicates re-deliver the payments of applied16; pick both".into());
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
    /// The apply SQL run natively: CPU of the thread running it, WAL.
    sql: Option<SqlStats>,
    /// payonce applying payments: its writer and threads.
    writer: Option<WriterStats>,
    /// CPU time of the HTTP client threads, ns.
    clients_cpu_ns: u64,
}

/// The apply SQL run natively on one connection.
#[derive(Clone, Copy, Default)]
struct SqlStats {
    /// CPU time of the thread that ran the SQL, ns.
    cpu_ns: u64,
    wal: WatchTotals,
}

/// payonce's writer and threads during an applied phase.
#[derive(Clone, Copy, Default)]
struct WriterStats {
    /// Group-committed operations and batches (payonce's own counters).
    operations: u64,
    batches: u64,
    /// The writer's transactions: thread CPU from BEGIN IMMEDIATE to COMMIT, WAL.
    watch: WatchTotals,
    threads: ThreadTotals,
}

impl WriterStats {
    fn add(&mut self, other: WriterStats) {
        self.operations += other.operations;
        self.batches += other.batches;
        self.watch.add(other.watch);
        self.threads.add(other.threads);
    }
}

/// What a [`WriterStats`] is the difference of.
struct WriterReading {
    group_commit: (u64, u64),
    watch: WatchTotals,
    threads: ThreadTotals,
}

impl WriterReading {
    fn now(app: &App) -> WriterReading {
        WriterReading {
            group_commit: app.store().group_commit_totals().unwrap_or((0, 0)),
            watch: PAYONCE.totals(),
            threads: ThreadTotals::now(),
        }
    }

    fn since(before: &WriterReading, app: &App) -> WriterStats {
        let after = WriterReading::now(app);
        WriterStats {
            operations: after.group_commit.1 - before.group_commit.1,
            batches: after.group_commit.0 - before.group_commit.0,
            watch: after.watch.since(before.watch),
            threads: after.threads.since(before.threads),
        }
    }
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
            sql: None,
            writer: None,
            clients_cpu_ns: 0,
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
        if let Some(sql) = round.sql {
            let mine = self.sql.get_or_insert_with(SqlStats::default);
            mine.cpu_ns += sql.cpu_ns;
            mine.wal.add(sql.wal);
        }
        if let Some(writer) = round.writer {
            self.writer.get_or_insert_with(WriterStats::default).add(writer);
        }
        self.clients_cpu_ns += round.clients_cpu_ns;
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

    fn ran(&self) -> bool {
        self.count > 0
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

    /// Microseconds per payment of `ns` nanoseconds spent over the phase.
    fn per_payment_us(&self, ns: u64) -> f64 {
        ns as f64 / 1000.0 / self.count.max(1) as f64
    }
}

fn main() {
    // As payonce's store does before its first connection: every phase here,
    // L_batch and A_batch included, runs SQLite as payonce runs it.
    payonce::store::prepare_sqlite_library();
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
        "payonce bench · {} · {cores} cores, {:.0} GiB RAM · {} · {} clients ({} workers) and {} ({} workers), \
         {} writes, {} batched, {} requests, {} rounds · PAYONCE_LOG={}",
        Clock::System.now_text(),
        mem_total_gib(),
        options.dir.display(),
        options.clients,
        options.workers,
        options.clients_high,
        options.workers_high,
        options.writes,
        options.batched,
        options.requests,
        options.rounds,
        std::env::var("PAYONCE_LOG").unwrap_or_default(),
    );
    if let Some(only) = &options.only {
        println!("only: {}", only.join(", "));
    }

    // payonce, in process, and the trivial handler, each on its own port.
    // SQLite names a database by its absolute path: the hooks find payonce's by it.
    let db_path = std::fs::canonicalize(&options.dir)?.join("payonce.db").display().to_string();
    watch::watch_connections_to(&db_path, &PAYONCE)?;
    let config = Config {
        platforms: payonce::platforms::Platforms::with([payonce::platforms::Platform::notices(
            payonce::platforms::generic::Generic::new(vec![SECRET.to_vec()]),
        )]),
        rewards: Rewards { coupon_templates: vec![COUPON.into()], points_per_yuan: 1 },
        ..Default::default()
    };
    let app = Arc::new(App::open(&db_path, Clock::System, config)?);
    let server = Server::bind("127.0.0.1:0")?;
    let addr = server.local_addr();
    let shutdown = Arc::new(AtomicBool::new(false));
    let workers = options.workers;
    let serving = {
        let (app, shutdown) = (Arc::clone(&app), Arc::clone(&shutdown));
        thread::spawn(move || server.serve(app, shutdown, workers))
    };
    let trivial_server = Server::bind("127.0.0.1:0")?;
    let trivial_addr = trivial_server.local_addr();
    let trivial_serving = {
        let shutdown = Arc::clone(&shutdown);
        thread::spawn(move || {
            trivial_server.serve_fn(|_req| Response::json(200, &json!({"code": "SUCCESS"})), shutdown, workers)
        })
    };
    let mut servers = vec![serving, trivial_serving];
    let outcome = measure(options, &app, addr, trivial_addr, &shutdown, &mut servers);
    shutdown.store(true, Ordering::SeqCst);
    // Every server is joined, whatever the others answered.
    let drained = servers.into_iter().map(|s| s.join().unwrap_or(false)).collect::<Vec<_>>().into_iter().all(|ok| ok);
    let clean = outcome?;
    if !drained {
        println!("a server did not finish its requests within its shutdown grace period");
    }
    let costs_clean = if options.schema_costs { schema_costs(options)? } else { true };
    Ok(clean && drained && costs_clean)
}

fn measure(
    options: &Options,
    app: &Arc<App>,
    addr: SocketAddr,
    trivial_addr: SocketAddr,
    shutdown: &Arc<AtomicBool>,
    servers: &mut Vec<thread::JoinHandle<bool>>,
) -> Result<bool, BoxError> {
    let budget = options.phase_timeout;
    let clients = options.clients;
    let payonce_host = addr.to_string();
    let trivial_host = trivial_addr.to_string();
    let (run_low, run_high) = (options.runs("applied16"), options.runs("applied64"));

    // Orders 0..writes are paid at `clients` clients, writes..2*writes at `clients_high`.
    let mut orders = Phase::new("(b) order creation, POST /v1/orders");
    if run_low || run_high {
        progress("(b) order creation");
        let host = payonce_host.clone();
        let round = http_round(
            addr,
            clients,
            0..2 * options.writes,
            budget,
            None,
            move |i| create_order_request(&host, i),
            |status, _| status == 201,
        )?;
        orders.merge(round);
    }
    let (created_low, created_high) = (orders.count.min(options.writes), orders.count.saturating_sub(options.writes));

    // Each disk-bound measurement runs twice per round: as is, and with one
    // thread spinning so a vCPU stays awake (see `with_cpu_awake`).
    let mut fsync = Phase::new("disk: append 4 KiB + fsync");
    let mut fsync_awake = Phase::new("disk: append 4 KiB + fsync, CPU kept awake");
    let mut bare_full = Phase::new("(a) bare SQLite apply SQL, synchronous=FULL");
    let mut bare_awake = Phase::new("(a) the same, CPU kept awake");
    let mut applied = Phase::new(&format!("(b) applied callbacks, {clients} clients"));
    // (a): orders 0..n as is, n..2n kept awake.
    let bare_orders = if options.runs("a") { 2 * options.writes } else { 0 };
    let mut bare = BareSqlite::open(&options.dir.join("bare-full.db"), &BareSetup::new(SCHEMA_SQL, 1, bare_orders))?;
    let probe_path = options.dir.join("fsync-probe");
    let mut probe = std::fs::OpenOptions::new().create(true).truncate(true).write(true).open(&probe_path)?;
    for round in 0..options.rounds {
        if !options.runs("fsync") && !options.runs("a") && !run_low {
            break;
        }
        progress(&format!(
            "round {}/{}: fsync, (a) bare SQLite FULL (as is, CPU kept awake), (b) applied callbacks",
            round + 1,
            options.rounds
        ));
        if options.runs("fsync") {
            let fsyncs = slice(options.fsyncs, options.rounds, round).len();
            if let Some(left) = fsync.budget_left(budget) {
                fsync.merge(measure_fsync(&mut probe, fsyncs, left)?);
            }
            if let Some(left) = fsync_awake.budget_left(budget) {
                fsync_awake.merge(with_cpu_awake(|| measure_fsync(&mut probe, fsyncs, left))?);
            }
        }
        if options.runs("a") {
            let range = slice(options.writes, options.rounds, round);
            if let Some(left) = bare_full.budget_left(budget) {
                bare_full.merge(bare.apply(range.clone(), left));
            }
            if let Some(left) = bare_awake.budget_left(budget) {
                let shifted = (range.start + options.writes)..(range.end + options.writes);
                bare_awake.merge(with_cpu_awake(|| bare.apply(shifted, left)));
            }
        }
        if run_low {
            if let Some(left) = applied.budget_left(budget) {
                let range = slice(created_low, options.rounds, round);
                applied.merge(http_round(
                    addr,
                    clients,
                    range.clone(),
                    left,
                    Some(app),
                    presigned_callbacks(&payonce_host, range),
                    |status, body| status == 200 && contains(body, br#""outcome":"applied""#),
                )?);
            }
        }
    }
    drop(probe);
    let _ = std::fs::remove_file(&probe_path);
    drop(bare);

    let mut bare_normal = Phase::new("(a) bare SQLite apply SQL, synchronous=NORMAL");
    if options.runs("normal") {
        progress("(a) bare SQLite, synchronous=NORMAL");
        let setup = BareSetup { synchronous: "NORMAL", ..BareSetup::new(SCHEMA_SQL, 1, options.writes) };
        let mut normal = BareSqlite::open(&options.dir.join("bare-normal.db"), &setup)?;
        bare_normal.merge(normal.apply(0..options.writes, budget));
    }

    let paid = applied.count.max(1);
    let mut duplicates = Phase::new("(b) duplicate callbacks");
    let mut trivial = Phase::new("(c) trivial handler, same requests");
    for round in 0..options.rounds {
        if !options.runs("duplicates") && !options.runs("trivial") {
            break;
        }
        progress(&format!("round {}/{}: (b) duplicate callbacks, (c) trivial handler", round + 1, options.rounds));
        let range = slice(options.requests, options.rounds, round);
        if options.runs("duplicates") {
            if let Some(left) = duplicates.budget_left(budget) {
                let host = payonce_host.clone();
                duplicates.merge(http_round(
                    addr,
                    clients,
                    range.clone(),
                    left,
                    None,
                    move |i| callback_request(&host, i % paid),
                    |status, body| status == 200 && contains(body, br#""outcome":"duplicate""#),
                )?);
            }
        }
        if options.runs("trivial") {
            if let Some(left) = trivial.budget_left(budget) {
                let host = trivial_host.clone();
                trivial.merge(http_round(
                    trivial_addr,
                    clients,
                    range,
                    left,
                    None,
                    move |i| callback_request(&host, i % paid),
                    |status, _| status == 200,
                )?);
            }
        }
    }
    // The peak RSS of the target: payonce as `payonce serve` runs it, through
    // the requests above, before the 64 workers and the batched databases
    // below add theirs.
    let lock_map_len = app.locks().len();
    let (peak_rss, rss_now) = memory_status();
    let payonce_requests = orders.count + applied.count + duplicates.count;
    let all_requests = payonce_requests + trivial.count;

    // The batching limit's rounds: L_batch and A_batch (as is, CPU kept awake) and
    // payonce at the higher client count, behind its own server with more
    // workers on the same App.
    let mut l_batch = Phase::new("L_batch: minimal schema, 64 per COMMIT");
    let mut l_batch_awake = Phase::new("L_batch, CPU kept awake");
    let mut a_batch = Phase::new("A_batch: payonce's schema, 64 per COMMIT");
    let mut a_batch_awake = Phase::new("A_batch, CPU kept awake");
    let mut applied_high = Phase::new(&format!("(b) applied callbacks, {} clients", options.clients_high));
    let batch = StoreOptions::default().group_commit_max;
    let profile = options.statement_profile;
    // L_batch and A_batch: orders 0..n as is, n..2n kept awake.
    let batched_orders = 2 * options.batched;
    let mut minimal = options
        .runs("l-batch")
        .then(|| {
            let setup = BareSetup { trace: profile, ..BareSetup::new(MINIMAL_SCHEMA, batch, batched_orders) };
            BareSqlite::open(&options.dir.join("l-batch.db"), &setup)
        })
        .transpose()?;
    let mut full = options
        .runs("a-batch")
        .then(|| {
            let setup = BareSetup { trace: profile, ..BareSetup::new(SCHEMA_SQL, batch, batched_orders) };
            BareSqlite::open(&options.dir.join("a-batch.db"), &setup)
        })
        .transpose()?;
    let addr_high = if run_high {
        let server = Server::bind("127.0.0.1:0")?;
        let addr_high = server.local_addr();
        let (app, shutdown, workers) = (Arc::clone(app), Arc::clone(shutdown), options.workers_high);
        servers.push(thread::spawn(move || server.serve(app, shutdown, workers)));
        Some(addr_high)
    } else {
        None
    };
    for round in 0..options.rounds {
        if minimal.is_none() && full.is_none() && !run_high {
            break;
        }
        progress(&format!(
            "round {}/{}: L_batch, A_batch (as is, CPU kept awake), (b) applied callbacks at {} clients",
            round + 1,
            options.rounds,
            options.clients_high
        ));
        let range = slice(options.batched, options.rounds, round);
        let shifted = (range.start + options.batched)..(range.end + options.batched);
        for (db, as_is, awake) in
            [(&mut minimal, &mut l_batch, &mut l_batch_awake), (&mut full, &mut a_batch, &mut a_batch_awake)]
        {
            let Some(db) = db else { continue };
            if let Some(left) = as_is.budget_left(budget) {
                as_is.merge(db.apply(range.clone(), left));
            }
            if let Some(left) = awake.budget_left(budget) {
                awake.merge(with_cpu_awake(|| db.apply(shifted.clone(), left)));
            }
        }
        if let Some(addr_high) = addr_high {
            // The statement profile slows the writer: only here, when asked.
            PAYONCE.profile(profile);
            if let Some(left) = applied_high.budget_left(budget) {
                let range = slice(created_high, options.rounds, round);
                let range = (options.writes + range.start)..(options.writes + range.end);
                applied_high.merge(http_round(
                    addr_high,
                    options.clients_high,
                    range.clone(),
                    left,
                    Some(app),
                    presigned_callbacks(&addr_high.to_string(), range),
                    |status, body| status == 200 && contains(body, br#""outcome":"applied""#),
                )?);
            }
            PAYONCE.profile(false);
        }
    }
    let sql_cpu = |phases: [&Phase; 2]| phases.iter().filter_map(|p| p.sql.map(|s| s.cpu_ns)).sum::<u64>();
    let statement_profiles = [
        (
            format!("payonce's writer, applied at {} clients", options.clients_high),
            PAYONCE.take_profile(),
            applied_high.count,
            applied_high.writer.map_or(0, |w| w.watch.batch_cpu_ns),
        ),
        (
            "L_batch, as is and CPU kept awake".to_owned(),
            minimal.as_ref().map(|db| db.watch.take_profile()).unwrap_or_default(),
            l_batch.count + l_batch_awake.count,
            sql_cpu([&l_batch, &l_batch_awake]),
        ),
        (
            "A_batch, as is and CPU kept awake".to_owned(),
            full.as_ref().map(|db| db.watch.take_profile()).unwrap_or_default(),
            a_batch.count + a_batch_awake.count,
            sql_cpu([&a_batch, &a_batch_awake]),
        ),
    ];
    drop(minimal);
    drop(full);
    let peak_at_end = memory_status().0;

    let mut phases = [
        fsync,
        fsync_awake,
        bare_full,
        bare_awake,
        bare_normal,
        l_batch,
        l_batch_awake,
        a_batch,
        a_batch_awake,
        orders,
        applied,
        applied_high,
        duplicates,
        trivial,
    ];
    phases.iter_mut().for_each(Phase::finish);
    print_table(phases.iter().filter(|p| p.ran() || p.errors > 0));
    let [fsync, fsync_awake, bare_full, bare_awake, bare_normal, l_batch, l_batch_awake, a_batch, a_batch_awake, _orders, applied, applied_high, duplicates, trivial] =
        &phases;

    // Each SQLite limit is the better of the two ways of measuring it.
    let limit = better(bare_full, bare_awake).rate();
    let (l_batch, a_batch) = (better(l_batch, l_batch_awake), better(a_batch, a_batch_awake));
    println!();
    if fsync.ran() || bare_full.ran() {
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
    }
    print_batching(l_batch, a_batch, &[applied, applied_high]);
    for (what, profile, payments, cpu_ns) in &statement_profiles {
        if !profile.statements.is_empty() {
            print_statement_profile(what, profile, *payments, *cpu_ns);
        }
    }
    println!(
        "peak RSS {:.1} MiB (VmHWM of this one process: payonce behind {} workers, the trivial server and {clients} \
         client threads), VmRSS {:.1} MiB, after {payonce_requests} requests to payonce and {all_requests} in all",
        peak_rss / MIB,
        options.workers,
        rss_now / MIB
    );
    println!(
        "(VmHWM after the rounds of L_batch, A_batch and {} clients behind {} more workers: {:.1} MiB; not the target's)",
        options.clients_high,
        options.workers_high,
        peak_at_end / MIB
    );
    println!();
    println!("{:<52} {:>10} {:>10}  verdict", "target", "measured", "target");
    let rss_verdict = if payonce_requests >= 100_000 {
        (if peak_rss < 64.0 * MIB { "met" } else { "MISSED" }).to_owned()
    } else {
        format!("{} (but fewer than 100,000 requests)", if peak_rss < 64.0 * MIB { "met" } else { "MISSED" })
    };
    let ratio = |a: &Phase, b: &Phase| a.rate() / b.rate().max(1e-9);
    let p99 = applied.percentile_ms(0.99);
    // (name, ran, measured, target, met)
    let judged = [
        (
            "applied callbacks / (a) SQLite limit at FULL".to_owned(),
            applied.ran() && bare_full.ran(),
            applied.rate() / limit.max(1e-9),
            ">= 0.700",
            0.7,
        ),
        (
            format!("applied at {} clients / L_batch", options.clients_high),
            applied_high.ran() && l_batch.ran(),
            ratio(applied_high, l_batch),
            ">= 0.250",
            0.25,
        ),
        ("A_batch / L_batch".to_owned(), a_batch.ran() && l_batch.ran(), ratio(a_batch, l_batch), ">= 0.500", 0.5),
        (
            "duplicate callbacks / (c) trivial handler".to_owned(),
            duplicates.ran() && trivial.ran(),
            ratio(duplicates, trivial),
            ">= 0.500",
            0.5,
        ),
    ];
    let mut rows: Vec<(String, String, &str, String)> = judged
        .into_iter()
        .map(|(name, ran, measured, target, floor)| {
            if ran {
                (name, format!("{measured:.3}"), target, (if measured >= floor { "met" } else { "MISSED" }).to_owned())
            } else {
                (name, "-".to_owned(), target, "not run".to_owned())
            }
        })
        .collect();
    rows.push(if applied.ran() {
        (
            format!("p99 of applied callbacks at {clients} clients"),
            format!("{p99:.2} ms"),
            "<= 10 ms",
            (if p99 <= 10.0 { "met" } else { "MISSED" }).to_owned(),
        )
    } else {
        (format!("p99 of applied callbacks at {clients} clients"), "-".to_owned(), "<= 10 ms", "not run".to_owned())
    });
    rows.push(("peak RSS (VmHWM)".to_owned(), format!("{:.1} MiB", peak_rss / MIB), "< 64 MiB", rss_verdict));
    rows.push((
        "keyed-lock map entries after the run".to_owned(),
        lock_map_len.to_string(),
        "0",
        (if lock_map_len == 0 { "met" } else { "MISSED" }).to_owned(),
    ));
    for (name, measured, target, verdict) in rows {
        println!("{name:<52} {measured:>10} {target:>10}  {verdict}");
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

/// The faster of two ways of measuring one limit.
fn better<'p>(a: &'p Phase, b: &'p Phase) -> &'p Phase {
    if b.rate() > a.rate() {
        b
    } else {
        a
    }
}

fn progress(step: &str) {
    eprintln!("bench: {step} ...");
}

fn print_table<'p>(phases: impl Iterator<Item = &'p Phase>) {
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
    println!("(the batched rows' latencies are per COMMIT of 64 payments)");
}

/// The batching limit's figures: the batched limits beside payonce, per payment.
fn print_batching(l_batch: &Phase, a_batch: &Phase, applied: &[&Phase]) {
    println!();
    println!(
        "Per payment (the better of as-is and CPU-kept-awake for L_batch and A_batch; WAL frames from a WAL hook):"
    );
    println!("{:<44} {:>9} {:>10} {:>10} {:>10}", "the apply SQL, natively", "per s", "CPU µs", "WAL pages", "COMMITs");
    for p in [l_batch, a_batch] {
        let Some(sql) = &p.sql else { continue };
        println!(
            "{:<44} {:>9.0} {:>10.1} {:>10.2} {:>10}",
            p.name,
            p.rate(),
            p.per_payment_us(sql.cpu_ns),
            sql.wal.wal_frames as f64 / p.count.max(1) as f64,
            sql.wal.wal_commits
        );
    }
    println!(
        "{:<32} {:>7} {:>7} {:>7} {:>6} {:>8} {:>8} {:>7} {:>8} {:>7} {:>8} {:>7} {:>6}",
        "payonce over HTTP",
        "per s",
        "p50 ms",
        "p99 ms",
        "batch",
        "writer",
        "workers",
        "edge",
        "clients",
        "other",
        "process",
        "wakeups",
        "WAL"
    );
    for p in applied {
        let Some(w) = &p.writer else { continue };
        let t = &w.threads;
        let other = t.process_ns.saturating_sub(t.workers_ns + t.edge_ns + p.clients_cpu_ns);
        println!(
            "{:<32} {:>7.0} {:>7.2} {:>7.2} {:>6.1} {:>8.1} {:>8.1} {:>7.1} {:>8.1} {:>7.1} {:>8.1} {:>7.2} {:>6.2}",
            p.name.trim_start_matches("(b) "),
            p.rate(),
            p.percentile_ms(0.5),
            p.percentile_ms(0.99),
            w.operations as f64 / w.batches.max(1) as f64,
            p.per_payment_us(w.watch.batch_cpu_ns),
            p.per_payment_us(t.workers_ns),
            p.per_payment_us(t.edge_ns),
            p.per_payment_us(p.clients_cpu_ns),
            p.per_payment_us(other),
            p.per_payment_us(t.process_ns),
            (t.workers_switches + t.edge_switches) as f64 / p.count.max(1) as f64,
            w.watch.wal_frames as f64 / p.count.max(1) as f64,
        );
    }
    println!(
        "(µs of CPU per payment. writer: the leading worker's thread CPU from BEGIN IMMEDIATE to the end of COMMIT; \
         workers: all worker threads, the writer included; edge: the payonce-io runtime threads; clients: the \
         bench's HTTP clients (requests signed before the round); other: the rest of this process (the threads that \
         accept connections); wakeups: voluntary context switches of workers and edge; WAL: pages appended per \
         payment)"
    );
}

/// Thread CPU per statement inside `BEGIN IMMEDIATE` transactions.
/// `cpu_ns`: the thread CPU of the transactions (payonce) or of the whole
/// loop that ran them (L_batch, A_batch).
fn print_statement_profile(what: &str, profile: &watch::Profile, count: usize, cpu_ns: u64) {
    let (statements, triggers) = (&profile.statements, &profile.triggers);
    let payments = count.max(1) as f64;
    let total: u64 = statements.iter().map(|(_, c)| c.cpu_ns).sum();
    println!();
    println!(
        "Statement profile, {what} ({count} payments; thread CPU per statement, read around each one, which slows it):"
    );
    println!("{:>8} {:>9} {:>6}  statement", "runs/pay", "µs/pay", "share");
    let mut sorted: Vec<_> = statements.iter().collect();
    sorted.sort_by_key(|(_, c)| std::cmp::Reverse(c.cpu_ns));
    for (sql, cost) in sorted {
        let mut shown: String = sql.chars().take(110).collect();
        if shown.len() < sql.len() {
            shown.push('…');
        }
        println!(
            "{:>8.2} {:>9.2} {:>5.1}%  {shown}",
            cost.runs as f64 / payments,
            cost.cpu_ns as f64 / 1000.0 / payments,
            100.0 * cost.cpu_ns as f64 / total.max(1) as f64
        );
    }
    println!(
        "{:>8} {:>9.2}         all statements; in all {:.2} µs/pay, so {:.2} µs/pay ran between statements",
        "",
        total as f64 / 1000.0 / payments,
        cpu_ns as f64 / 1000.0 / payments,
        cpu_ns.saturating_sub(total) as f64 / 1000.0 / payments
    );
    if !triggers.is_empty() {
        let fired: Vec<String> = triggers
            .iter()
            .map(|(name, n)| format!("{} {:.2}", name.trim_start_matches("-- "), *n as f64 / payments))
            .collect();
        println!("triggers fired per payment: {}", fired.join(", "));
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

// ---- the apply SQL natively: (a), L_batch, A_batch ----

/// How a bare database is made and driven.
struct BareSetup<'s> {
    schema: &'s str,
    synchronous: &'static str,
    /// PENDING orders to create.
    orders: usize,
    /// Payments per COMMIT: 1 is one `BEGIN IMMEDIATE ... COMMIT` each, as
    /// (a) always ran; more run each payment in its own SAVEPOINT inside
    /// one transaction, as payonce's group commit does.
    batch: usize,
    savepoints: bool,
    /// Per-statement thread CPU (slows the run; `--statement-profile`).
    trace: bool,
    /// PRAGMAs set after the schema and the orders (schema-cost variants).
    pragmas: &'s [(&'static str, &'static str)],
    /// Schema objects taken away before the orders are created: every
    /// trigger, and every non-unique (`ix_`) index of these tables or of
    /// these names.
    drop_triggers: bool,
    drop_indexes_of: &'s [&'s str],
}

impl<'s> BareSetup<'s> {
    fn new(schema: &'s str, batch: usize, orders: usize) -> BareSetup<'s> {
        BareSetup {
            schema,
            synchronous: "FULL",
            orders,
            batch,
            savepoints: true,
            trace: false,
            pragmas: &[],
            drop_triggers: false,
            drop_indexes_of: &[],
        }
    }
}

/// One connection with payonce's PRAGMAs on a database from `schema`,
/// holding PENDING orders.
struct BareSqlite {
    conn: Connection,
    rewards_due: String,
    batch: usize,
    savepoints: bool,
    /// WAL frames of its COMMITs (and statements when traced).
    watch: &'static Watch,
}

impl BareSqlite {
    /// Makes the database at `path` as `setup` says and opens it.
    fn open(path: &Path, setup: &BareSetup<'_>) -> Result<BareSqlite, BoxError> {
        let mut conn = BareSqlite::connect(path, setup)?;
        BareSqlite::create(&mut conn, setup)?;
        BareSqlite::ready(conn, setup)
    }

    /// Opens a database `open` made before, with the same `setup`.
    fn reopen(path: &Path, setup: &BareSetup<'_>) -> Result<BareSqlite, BoxError> {
        BareSqlite::ready(BareSqlite::connect(path, setup)?, setup)
    }

    /// A connection with payonce's PRAGMAs.
    fn connect(path: &Path, setup: &BareSetup<'_>) -> Result<Connection, BoxError> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(Duration::from_millis(payonce::store::BUSY_TIMEOUT_MS))?;
        let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(format!("journal_mode stayed {mode}").into());
        }
        conn.pragma_update(None, "synchronous", setup.synchronous)?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.pragma_update(None, "temp_store", "MEMORY")?;
        Ok(conn)
    }

    /// The schema, less what `setup` takes away, and the PENDING orders.
    fn create(conn: &mut Connection, setup: &BareSetup<'_>) -> Result<(), BoxError> {
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.execute_batch(setup.schema)?;
        let mut removals: Vec<String> = Vec::new();
        if setup.drop_triggers {
            removals.extend(
                tx.prepare("SELECT 'DROP TRIGGER ' || name FROM sqlite_master WHERE type = 'trigger'")?
                    .query_map([], |r| r.get::<_, String>(0))?
                    .collect::<Result<Vec<_>, _>>()?,
            );
        }
        for table in setup.drop_indexes_of {
            removals.extend(
                tx.prepare(
                    "SELECT 'DROP INDEX ' || name FROM sqlite_master
                     WHERE type = 'index' AND (tbl_name = ?1 OR name = ?1) AND name LIKE 'ix\\_%' ESCAPE '\\'",
                )?
                .query_map([table], |r| r.get::<_, String>(0))?
                .collect::<Result<Vec<_>, _>>()?,
            );
        }
        for removal in removals {
            tx.execute_batch(&removal)?;
        }
        let now = Clock::System.now_text();
        let expires = payonce::clock::format_ms(Clock::System.now_ms() + 3_600_000);
        {
            let mut insert = tx.prepare(
                "INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at)
                 VALUES (?1, ?2, ?3, 'CNY', 'PENDING', ?4, ?5)",
            )?;
            for i in 0..setup.orders {
                insert.execute(params![order_no(i), user_id(i), AMOUNT, now, expires])?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    /// `setup`'s own PRAGMAs, an empty WAL, the hooks.
    fn ready(conn: Connection, setup: &BareSetup<'_>) -> Result<BareSqlite, BoxError> {
        for (name, value) in setup.pragmas {
            conn.pragma_update(None, name, value)?;
        }
        // Start the measured run with an empty WAL.
        conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
        let watch: &'static Watch = Box::leak(Box::new(Watch::new()));
        watch::watch_connection(&conn, watch, setup.trace);
        watch.profile(setup.trace);
        let rewards_due = json!({"coupons": [COUPON], "points": AMOUNT / 100}).to_string();
        Ok(BareSqlite { conn, rewards_due, batch: setup.batch.max(1), savepoints: setup.savepoints, watch })
    }

    /// Applies payments `range`, `batch` per COMMIT, for at most `budget`.
    fn apply(&mut self, range: Range<usize>, budget: Duration) -> Phase {
        let mut phase = Phase::new("bare");
        let started = Instant::now();
        let cpu = process_cpu();
        let (thread_cpu, wal) = (watch::thread_cpu_ns(), self.watch.totals());
        let mut next = range.start;
        while next < range.end {
            if started.elapsed() >= budget {
                phase.timed_out = true;
                break;
            }
            let chunk = next..(next + self.batch).min(range.end);
            next = chunk.end;
            let t = Instant::now();
            let n = chunk.len();
            let result = if self.batch == 1 { self.apply_one(chunk.start) } else { self.apply_batch(chunk.clone()) };
            phase.latencies.push(t.elapsed());
            phase.count += n;
            match result {
                Ok(failed) => {
                    for (i, e) in failed {
                        phase.note_error(format!("payment {i}: {e}"));
                    }
                }
                Err(e) => {
                    for i in chunk {
                        phase.note_error(format!("payment {i}: {e}"));
                    }
                }
            }
        }
        phase.elapsed = started.elapsed();
        phase.cpu = process_cpu().saturating_sub(cpu);
        phase.sql = Some(SqlStats {
            cpu_ns: watch::thread_cpu_ns().saturating_sub(thread_cpu),
            wal: self.watch.totals().since(wal),
        });
        phase
    }

    /// One payment in its own `BEGIN IMMEDIATE ... COMMIT`, as (a) runs it.
    fn apply_one(&mut self, i: usize) -> Result<Vec<(usize, BoxError)>, BoxError> {
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        apply_statements(&tx, i, &self.rewards_due)?;
        tx.commit()?;
        Ok(Vec::new())
    }

    /// `range`'s payments in one `BEGIN IMMEDIATE ... COMMIT`, each in its
    /// own SAVEPOINT (unless the setup said not), through the statement
    /// cache as payonce's group commit runs them; the payments that failed.
    fn apply_batch(&mut self, range: Range<usize>) -> Result<Vec<(usize, BoxError)>, BoxError> {
        let conn = &self.conn;
        conn.prepare_cached("BEGIN IMMEDIATE")?.execute([])?;
        let mut failed = Vec::new();
        for i in range {
            if self.savepoints {
                conn.prepare_cached("SAVEPOINT op")?.execute([])?;
            }
            match apply_statements(conn, i, &self.rewards_due) {
                Ok(()) if self.savepoints => {
                    conn.prepare_cached("RELEASE op")?.execute([])?;
                }
                Ok(()) => {}
                Err(e) => {
                    if self.savepoints {
                        conn.execute_batch("ROLLBACK TO op; RELEASE op")?;
                    }
                    failed.push((i, e));
                }
            }
        }
        conn.prepare_cached("COMMIT")?.execute([])?;
        Ok(failed)
    }
}

/// The apply path's statements, as `Tx` runs them for an applied payment.
fn apply_statements(tx: &Connection, i: usize, rewards_due: &str) -> Result<(), BoxError> {
    let now = Clock::System.now_text();
    let (order_no, pay_no) = (order_no(i), pay_no(i));
    let body = callback_body(i);
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
    .execute(params![pay_no, order_id, AMOUNT, body, now, rewards_due])?;
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
    Ok(())
}

// ---- what parts of payonce's schema cost (`--schema-costs`) ----

/// The tables an applied payment writes.
const WRITTEN_TABLES: [&str; 5] = ["orders", "pay_callback_log", "user_coupon", "point_log", "outbox_event"];

/// A_batch again, on variants of payonce's schema with one part taken away
/// at a time, interleaved in rounds, with the CPU kept awake: what each
/// part costs per payment. Not a schema payonce may run: a measurement.
fn schema_costs(options: &Options) -> Result<bool, BoxError> {
    let batch = StoreOptions::default().group_commit_max;
    let without = |pattern: &str| SCHEMA_SQL.contains(pattern).then(|| SCHEMA_SQL.replace(pattern, ""));
    let json_free = without("CHECK (json_valid(data))")
        .and_then(|s| s.contains("CHECK (rewards_due IS NULL OR json_valid(rewards_due))").then_some(s))
        .map(|s| s.replace("CHECK (rewards_due IS NULL OR json_valid(rewards_due))", ""));
    let autoincrement_free = SCHEMA_SQL
        .contains("seq        INTEGER PRIMARY KEY AUTOINCREMENT")
        .then(|| SCHEMA_SQL.replace("seq        INTEGER PRIMARY KEY AUTOINCREMENT", "seq        INTEGER PRIMARY KEY"));
    let other_tables = ["orders", "user_coupon", "point_log", "outbox_event"];
    // The one index keyed by user_id left (a user's coupons and points are
    // found through it since migration 13).
    let by_user = ["ix_orders_user"];
    let no_checks: &[(&str, &str)] = &[("ignore_check_constraints", "ON")];
    let no_fk: &[(&str, &str)] = &[("foreign_keys", "OFF")];
    let all_off: &[(&str, &str)] = &[("ignore_check_constraints", "ON"), ("foreign_keys", "OFF")];
    let base = |schema| BareSetup::new(schema, batch, 2 * options.batched);
    let mut variants: Vec<(String, BareSetup<'_>)> = vec![
        ("L_batch: the minimal schema".into(), base(MINIMAL_SCHEMA)),
        (
            "the minimal schema, no SAVEPOINT per payment".into(),
            BareSetup { savepoints: false, ..base(MINIMAL_SCHEMA) },
        ),
        ("A_batch: payonce's schema".into(), base(SCHEMA_SQL)),
        ("payonce's, no SAVEPOINT per payment".into(), BareSetup { savepoints: false, ..base(SCHEMA_SQL) }),
        ("payonce's, CHECKs not checked".into(), BareSetup { pragmas: no_checks, ..base(SCHEMA_SQL) }),
        ("payonce's, foreign_keys=OFF".into(), BareSetup { pragmas: no_fk, ..base(SCHEMA_SQL) }),
        ("payonce's, no triggers".into(), BareSetup { drop_triggers: true, ..base(SCHEMA_SQL) }),
        (
            "payonce's, no ix_ index on pay_callback_log".into(),
            BareSetup { drop_indexes_of: &["pay_callback_log"], ..base(SCHEMA_SQL) },
        ),
        (
            "payonce's, no ix_ index on the 4 other tables".into(),
            BareSetup { drop_indexes_of: &other_tables, ..base(SCHEMA_SQL) },
        ),
        ("payonce's, no ix_orders_user".into(), BareSetup { drop_indexes_of: &by_user, ..base(SCHEMA_SQL) }),
    ];
    let mut missing = Vec::new();
    match &json_free {
        Some(schema) => variants.push(("payonce's, no json_valid CHECK".into(), base(schema))),
        None => missing.push("json_valid CHECKs"),
    }
    match &autoincrement_free {
        Some(schema) => variants.push(("payonce's, outbox seq not AUTOINCREMENT".into(), base(schema))),
        None => missing.push("outbox_event's AUTOINCREMENT"),
    }
    variants.push((
        "payonce's, no CHECK, FK, trigger, ix_ index".into(),
        BareSetup { pragmas: all_off, drop_triggers: true, drop_indexes_of: &WRITTEN_TABLES, ..base(SCHEMA_SQL) },
    ));
    let dir = options.dir.join("schema-costs");
    std::fs::create_dir_all(&dir)?;
    let mut dbs = Vec::new();
    for (n, (name, setup)) in variants.iter().enumerate() {
        progress(&format!("schema costs: preparing {name}"));
        let path = dir.join(format!("variant-{n}.db"));
        drop(BareSqlite::open(&path, setup)?);
        dbs.push((name.clone(), path, setup, Phase::new(name), Vec::new()));
    }
    // One variant's connection open at a time (SQLite's page caches share
    // one pool in this build: open side by side, they evict each other's
    // pages), and each round starts one variant further on.
    let rounds = options.rounds.clamp(2, 8);
    for round in 0..rounds {
        progress(&format!("schema costs: round {}/{rounds}", round + 1));
        let range = slice(options.batched, rounds, round);
        let count = dbs.len();
        for k in 0..count {
            let (_, path, setup, phase, per_round) = &mut dbs[(round + k) % count];
            if let Some(left) = phase.budget_left(options.phase_timeout) {
                let mut db = BareSqlite::reopen(path, setup)?;
                let measured = with_cpu_awake(|| db.apply(range.clone(), left));
                per_round.push(measured.per_payment_us(measured.sql.unwrap_or_default().cpu_ns));
                phase.merge(measured);
            }
        }
    }
    let median = |values: &[f64]| {
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let reference = dbs.iter().find(|(name, ..)| name.starts_with("A_batch")).map(|(.., per_round)| median(per_round));
    println!();
    println!(
        "What parts of payonce's schema cost: the apply SQL, {batch} per COMMIT, synchronous=FULL, CPU kept awake, \
         {rounds} rounds of {} payments, one variant's connection open at a time; thread CPU µs per payment, median \
         and lowest of the rounds",
        options.batched / rounds
    );
    println!(
        "{:<52} {:>9} {:>9} {:>9} {:>12} {:>10}",
        "schema", "per s", "µs med", "µs min", "vs A_batch", "WAL pages"
    );
    let mut errors = 0;
    for (name, _, _, phase, per_round) in &dbs {
        let sql = phase.sql.unwrap_or_default();
        let us = median(per_round);
        let lowest = per_round.iter().copied().fold(f64::INFINITY, f64::min);
        println!(
            "{name:<52} {:>9.0} {:>9.1} {:>9.1} {:>12} {:>10.2}",
            phase.rate(),
            us,
            lowest,
            reference.map_or("-".into(), |r| format!("{:+.1}", us - r)),
            sql.wal.wal_frames as f64 / phase.count.max(1) as f64
        );
        if let Some(e) = &phase.first_error {
            println!("    first error: {e}");
        }
        errors += phase.errors;
    }
    if !missing.is_empty() {
        println!("(not measured, their text is no longer in schema.sql: {})", missing.join(", "));
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(errors == 0)
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

/// `range`'s callbacks, signed now, for a round of applied callbacks: the
/// clients only send them (signing is not the clients' CPU during the round).
fn presigned_callbacks(host: &str, range: Range<usize>) -> impl Fn(usize) -> Vec<u8> + Send + Sync + 'static {
    let start = range.start;
    let requests: Vec<Vec<u8>> = range.map(|i| callback_request(host, i)).collect();
    move |i| requests[i - start].clone()
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
/// at most `budget`; with `app`, its writer and threads are read before and
/// after (`Phase::writer`).
fn http_round(
    addr: SocketAddr,
    clients: usize,
    range: Range<usize>,
    budget: Duration,
    app: Option<&App>,
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
    let reading = app.map(WriterReading::now);
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
                mine.clients_cpu_ns = watch::thread_cpu_ns();
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
    if let (Some(app), Some(reading)) = (app, reading) {
        phase.writer = Some(WriterReading::since(&reading, app));
    }
    Ok(phase)
}

// ---- memory and CPU ----

/// CPU time (user + system) of every thread of this process so far.
fn process_cpu() -> Duration {
    Duration::from_nanos(watch::process_cpu_ns())
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
