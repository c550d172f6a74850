//! `payonce`: argument parsing and wiring only; everything else is in the library.

use payonce::background::{
    handle_signals, spawn_inspector, spawn_key_refresh, spawn_platform_worker, spawn_storage_watch, spawn_sweeper,
};
use payonce::config::{self, db_from_env, Checked, Settings, DEV_CALLBACK_SECRET};
use payonce::http::Server;
use payonce::recon::Format;
use payonce::relay::spawn_relay;
use payonce::{App, Clock};
use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

const USAGE: &str = "\
payonce: exactly-once orders and payment callbacks on SQLite or PostgreSQL

Usage:
  payonce serve     [--db PATH|:memory:|URL] [--listen ADDR:PORT] [settings]
  payonce simulate  [--target URL] [--channel generic|wechatpay|alipay|all] [--scenario NAME]... [--orders N]
                    [--time-factor F] [--full-schedules] [--key-mode public-key|certificate]
                    (runs payonce-sim, the payment-platform simulator; exit 0 clean, 1 on any violation)
  payonce inspect   --db PATH|URL         (findings as JSON on stdout; exit 0 clean, 1 findings)
  payonce reconcile --db PATH|URL --statement FILE [--format generic|wechatpay|alipay] [--date YYYY-MM-DD] [--repair]
  payonce backup    --db PATH --to FILE [--force]   (an online, consistent, atomic copy; SQLite)
  payonce copy-db   --from FILE.db --to postgres://...   (a SQLite ledger into an empty PostgreSQL database)
  payonce sync      --db PATH|URL [the platform settings of serve] ORDER_NO
                    (asks the platforms about the order; exit 0, 1 if a platform could not answer)
  payonce sign      [--callback-secret S | --dev] < BODY
  payonce help
  payonce --version

Run `payonce COMMAND --help` for a command's options.
";

const INSPECT_USAGE: &str = "\
Usage: payonce inspect --db PATH

Runs the inspection on the database (safe while serve runs) and prints
{\"ok\":bool,\"findings\":[...]} on stdout. Exit status 0 when clean, 1 when
there are findings, 2 on an error.
";

const RECONCILE_USAGE: &str = "\
Usage: payonce reconcile --db PATH --statement FILE [--format generic|wechatpay|alipay]
                         [--date YYYY-MM-DD] [--repair]

Compares a platform statement with the payments payonce recorded in the
statement's period (its rows' calendar days, UTC+8 for wechatpay and alipay,
UTC for generic; or --date). Prints the result as JSON on stdout and a
progress bar on stderr. With --repair, payments the platform has and payonce
never recorded are applied through the exactly-once path, with the reward
settings serve recorded in the database. Exit status 0 when everything
matched, 1 when there are differences, 2 on an error.
";

const BACKUP_USAGE: &str = "\
Usage: payonce backup --db PATH --to FILE [--force]

Copies the database to FILE with SQLite's online backup API: one consistent
snapshot, taken while serve keeps running. The copy is written to
FILE.<pid>.partial beside FILE, checked with PRAGMA integrity_check, synced,
and only then renamed to FILE: a kill or a full disk leaves no FILE or a
complete, checked one (remove a leftover *.partial by hand). FILE must not
exist unless --force, which replaces it atomically; it may never name the
live database or its -wal, -shm or -journal.
";

const COPY_DB_USAGE: &str = "\
Usage: payonce copy-db --from FILE.db --to postgres://USER@HOST/DB

Copies a SQLite ledger into an empty PostgreSQL database: every row of every
table with its id, state, timestamps and the outbox's seqs, in one
transaction, each table checked by its row count and a SHA-256 of its rows
read back; the identities continue after the copied ids. Stop payonce (or
take a `payonce backup` and copy that) first: rows written after the copy's
snapshot stay behind. FILE.db is only read; one at an older schema version
is migrated on a temporary copy. Refused: a target that holds any row, a
source newer than this payonce. docs/postgres.md, 'Moving from SQLite'.
";

const SYNC_USAGE: &str = "\
Usage: payonce sync --db PATH|URL [--config FILE] [the platform settings of serve] ORDER_NO

Asks every platform whose outgoing settings are given (--wechatpay-mchid,
--wechatpay-merchant-serial, --wechatpay-merchant-key and --wechatpay-public-key;
--alipay-app-private-key, --alipay-app-id and --alipay-public-key) about the
order, as POST /v1/orders/{order_no}/sync does: a paid answer is applied
through the exactly-once path with source `query`. Prints
{\"order\":..,\"platforms\":[{\"channel\",\"state\",\"pay_no\",\"amount\"}]} on stdout.
Exit status 0, 1 when a platform's state is unknown (unreachable, timed out,
or an answer that did not verify), 2 on an error.
";

const SIGN_USAGE: &str = "\
Usage: payonce sign [--callback-secret S | --dev] < BODY

Prints the Payonce-Signature header value (t=<now>,v1=<hex>) for the body on
stdin, signed with the first generic-channel secret (--callback-secret, env
PAYONCE_CALLBACK_SECRET, or the public dev secret with --dev). For trying
payonce with curl and for testing a merchant's own integration.
";

const SERVE_USAGE: &str = "\
Usage: payonce serve [options]

Serves the HTTP API. Prints `listening on http://HOST:PORT` first on stdout;
logs and warnings go to stderr. Exits 0 on SIGINT/SIGTERM/SIGQUIT after
finishing requests in flight (bounded); SIGHUP re-reads every key and
certificate file (a file that fails keeps its old key); SIGUSR1 and SIGUSR2
are logged and ignored.

Options:
  --config FILE             a TOML file of these settings, keys named as the flags without --
                            (lists for repeatable ones, true for --dev); a flag given here wins
                            over the file, the file over the environment (docs/settings.md)
  --db PATH|:memory:|URL    SQLite file, a shared in-memory SQLite database, or PostgreSQL: a
                            postgres:// (postgresql://) URL, several hosts allowed
                            (h1:5432,h2:5432 with target_session_attrs=read-write), or
                            libpq's key-value form (host=h1,h2 dbname=...); env PAYONCE_DB
                            [default: payonce.db]
  --listen ADDR:PORT        address to bind; port 0 picks a free one [default: 127.0.0.1:8080]
  --metrics-listen ADDR:PORT
                            also serve GET /metrics, without a token, on this address (for
                            Prometheus on a loopback or private port); /metrics on --listen
                            then still needs the token when tokens are configured
  --callback-secret S,...   HMAC secrets of the generic channel, comma-separated (two during
                            rotation); env PAYONCE_CALLBACK_SECRET. Required unless --dev.
  --callback-secret-file FILE
                            the same from a file (one secret a line, or comma-separated)
  --dev                     development mode: a fixed, printed callback secret
  --api-token T,...         bearer tokens for /v1 except callbacks, each `name:token` or a bare
                            token; env PAYONCE_API_TOKEN. Unset = no auth, loopback only.
  --api-token-file FILE     the same from a file (one token a line, or comma-separated)
  --idempotency-ttl-s N     how long Idempotency-Key results are kept [default: 86400]
  --coupon TEMPLATE         coupon template issued on payment (repeatable)
  --points-per-yuan N       points = floor(amount x N / 100); no entry when 0 [default: 0]
  --order-ttl-s N           default PENDING lifetime in seconds [default: 900]
  --sweep-interval-s N      how often expired PENDING orders are closed [default: 1]
  --db-pool-size N          database connections of this process (PostgreSQL: size
                            max_connections for every process's pool) [default: 20]
  --group-commit-max N      SQLite: write operations committed together in one transaction,
                            one fsync; 1 turns batching off [default: 64]
  --group-commit-wait-us N  SQLite: how long a committer holding operations waits for more;
                            0 commits whatever is queued, never waits [default: 0]
  --db-busy-timeout-ms N    how long a write waits for another process's lock (SQLite's
                            busy handler, PostgreSQL's lock_timeout) before 503
                            database_busy [default: 5000]
  --db-connect-timeout-ms N PostgreSQL: one attempt to connect to one host, and the longest
                            wait for a pooled connection [default: 5000]
  --db-statement-timeout-ms N
                            PostgreSQL: the server's statement_timeout, and how long a call
                            waits on a host that stopped answering (TCP keepalives,
                            TCP_USER_TIMEOUT) before 503 database_unavailable [default: 10000]
  --inspect-interval-s N    how often the inspection runs [default: 300]
  --wechatpay-apiv3-key KEY WeChat Pay APIv3 key (32 bytes); env PAYONCE_WECHATPAY_APIV3_KEY.
                            With --wechatpay-public-key, turns the wechatpay channel on.
  --wechatpay-apiv3-key-file FILE
                            the same from a file (one line)
  --wechatpay-public-key SERIAL=FILE
                            a WeChat Pay platform public key or certificate (PEM) and its serial
                            or PUB_KEY_ID_...; repeatable (two during rotation)
  --alipay-public-key FILE  Alipay public key (PEM or the console's base64); with
                            --alipay-app-id, turns the alipay channel on
  --alipay-app-id ID        the merchant's Alipay app_id
  --alipay-app-cert FILE    Alipay certificate mode, instead of --alipay-public-key: the
                            app's public key certificate (appCertPublicKey_*.crt); requests
                            carry its SN as app_cert_sn
  --alipay-public-cert FILE the Alipay public key certificate (alipayCertPublicKey_RSA2.crt):
                            notices and answers are verified with its key
  --alipay-root-cert FILE   Alipay's root certificates (alipayRootCert.crt): requests carry
                            alipay_root_cert_sn. The three go together; SIGHUP re-reads them

Webhooks to the merchant's app (Standard Webhooks; docs/webhooks.md):
  --webhook-url URL               an endpoint that receives every event after it was first
                                  configured (repeatable); http:// or https://. Secrets in env
                                  PAYONCE_WEBHOOK_SECRET: comma-separated whsec_<base64>, all sign
  --webhook-secret-file FILE      those secrets from a file (one a line, or comma-separated)
  --webhook-timeout-ms N          one attempt's whole call [default: 15000]
  --webhook-retry-s LIST          the waits before each retry, seconds, each jittered +-20%;
                                  after the last, the delivery fails (dead letter)
                                  [default: 5,300,1800,7200,18000,36000,36000]
  --webhook-concurrency N         attempts in flight at once [default: 8]
  --webhook-poll-ms N             how often the relay looks for due retries and other processes'
                                  events (this process's events wake it at once) [default: 200]

Talking to the platforms (query; docs/platforms.md). A platform's outgoing
calls are on when any of its outgoing-only settings is given; then all are required:
  --wechatpay-mchid ID            the merchant's WeChat Pay mchid
  --wechatpay-merchant-serial S   the serial of the merchant's API certificate
  --wechatpay-merchant-key FILE   the merchant's API private key (PEM); answers are verified
                                  with --wechatpay-public-key (no APIv3 key needed for that)
  --wechatpay-api-base URL        [default: https://api.mch.weixin.qq.com]
  --wechatpay-platform-certs auto|off
                                  auto: download the platform certificates (GET /v3/certificates)
                                  at start, on a schedule and on an unknown serial; needs the
                                  calls' settings and the APIv3 key [default: off]
  --wechatpay-cert-refresh-s N    how often they are downloaded again [default: 43200]
  --wechatpay-cert-unknown-serial-interval-s N
                                  at most one download this often for a serial payonce does not
                                  hold (and the retry after a failed one) [default: 60]
  --alipay-app-private-key FILE   the app's private key (PEM, PKCS#8 or PKCS#1); needs
                                  --alipay-app-id and --alipay-public-key (or the three
                                  certificates)
  --alipay-gateway URL            [default: https://openapi.alipay.com/gateway.do]
  --platform-timeout-ms N         one platform call's whole HTTP exchange [default: 10000]
  --platform-retry-s LIST         waits between attempts of a close at a platform, seconds; the
                                  last repeats [default: 5,30,120,600,1800,3600]
  --refund-query-after-s N        a submitted refund without a result this long is queried
                                  (then on --platform-retry-s) [default: 300]
  --refund-unwanted auto|manual   auto: a payment recorded already_paid, paid_after_close or
                                  amount_mismatch has its refund requested at its platform in
                                  the transaction that records it [default: manual]
  --public-base-url URL           where platforms reach this payonce; WeChat Pay refunds then
                                  carry notify_url = URL/v1/callbacks/wechatpay/refund, and
                                  payments created by POST /v1/orders/{order_no}/pay carry
                                  notify_url = URL/v1/callbacks/{channel}
  --wechatpay-appid APPID         an official account, mini program or app WeChat Pay payments
                                  are created under (repeatable; a request picks one by appid)
  --prepay-reuse-s N              a created payment is answered again without a call this long;
                                  then one call refreshes it [default: 6600, at most 7000]
  --close-give-up-s N             after this long past expires_at without a platform's
                                  confirmation, close locally and report close_unconfirmed
                                  [default: 86400]

HTTP edge limits (each holds without a reverse proxy; docs/deployment.md):
  --max-connections N             connections served at once; more wait in the kernel's backlog.
                                  Clamped to RLIMIT_NOFILE minus --fd-reserve [default: 1024]
  --header-read-timeout-ms N      a request head must arrive within this [default: 10000]
  --body-read-timeout-ms N        the whole body must arrive within this [default: 30000]
  --keep-alive-idle-ms N          an idle keep-alive connection is closed after this, counted from
                                  the end of a response [default: 60000]
  --response-write-timeout-ms N   a client that does not read its answer loses the connection
                                  after this [default: 30000]
  --fd-reserve N                  descriptors kept for the database, logs and outgoing calls
                                  [default: 128]
  --workers N                     worker threads that run requests [default: 16]
  --shutdown-grace-ms N           how long shutdown waits for requests in flight [default: 10000]
  --log-format logfmt|json        stderr's log lines: logfmt, or one JSON object per line
                                  (every value a string) [default: logfmt]
  -h, --help                      this help
";

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(message) => {
            eprintln!("payonce: error: {message}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<ExitCode, String> {
    let mut args = std::env::args_os().skip(1);
    let command = args.next().map(|c| c.to_string_lossy().into_owned());
    match command.as_deref() {
        Some("serve") => serve(parse_serve(lexopt::Parser::from_args(args))?),
        Some("sign") => sign(lexopt::Parser::from_args(args)),
        Some("simulate") => simulate(args),
        Some("inspect") => inspect(lexopt::Parser::from_args(args)),
        Some("reconcile") => reconcile(lexopt::Parser::from_args(args)),
        Some("sync") => sync(lexopt::Parser::from_args(args)),
        Some("backup") => backup(lexopt::Parser::from_args(args)),
        Some("copy-db") => copy_db(lexopt::Parser::from_args(args)),
        None | Some("help") | Some("-h") | Some("--help") => {
            print!("{USAGE}");
            Ok(ExitCode::SUCCESS)
        }
        Some("--version") | Some("-V") | Some("version") => {
            println!("payonce {}", env!("CARGO_PKG_VERSION"));
            Ok(ExitCode::SUCCESS)
        }
        Some(other) => Err(format!("unknown command {other:?}; see `payonce help`")),
    }
}

/// The simulator's binary, which `payonce simulate` runs from this binary's directory.
const SIM_BINARY: &str = "payonce-sim";

/// `payonce simulate ARGS`: the simulator is its own crate (sim/, which
/// depends on this library, so this binary cannot link it), so this runs
/// `payonce-sim ARGS` from the directory this binary is in, passing its exit
/// status through (on Unix it replaces this process).
fn simulate(args: impl Iterator<Item = std::ffi::OsString>) -> Result<ExitCode, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the payonce binary's directory: {e}"))?;
    let sim = exe.with_file_name(format!("{SIM_BINARY}{}", std::env::consts::EXE_SUFFIX));
    if !sim.is_file() {
        return Err(format!(
            "{SIM_BINARY} not found next to payonce (looked for {}); build it with `cargo build --workspace` \
             (or `cargo build --release -p payonce-sim`), which puts both binaries in one directory",
            sim.display()
        ));
    }
    let mut command = std::process::Command::new(&sim);
    command.args(args);
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        // Only returns on failure.
        let error = command.exec();
        Err(format!("cannot run {}: {error}", sim.display()))
    }
    #[cfg(not(unix))]
    {
        let status = command.status().map_err(|e| format!("cannot run {}: {e}", sim.display()))?;
        Ok(match status.code() {
            Some(code) => ExitCode::from(u8::try_from(code).unwrap_or(2)),
            None => ExitCode::from(2),
        })
    }
}

fn parse_serve(parser: lexopt::Parser) -> Result<Settings, String> {
    Ok(parse_settings(parser, false, SERVE_USAGE)?.0)
}

/// `serve`'s settings from the command line, through the one table of
/// `payonce::config`, over the `--config` file and the environment;
/// `payonce sync` takes the same plus its ORDER_NO (the positional
/// arguments, returned beside the settings). Warnings go to stderr here.
fn parse_settings(
    mut parser: lexopt::Parser,
    accept_positional: bool,
    usage: &str,
) -> Result<(Settings, Vec<String>), String> {
    use lexopt::prelude::*;
    let mut command_line = Vec::new();
    let mut config_file = None;
    let mut positional = Vec::new();
    while let Some(arg) = parser.next().map_err(|e| e.to_string())? {
        match arg {
            Short('h') | Long("help") => {
                print!("{usage}");
                std::process::exit(0);
            }
            Long("config") => config_file = Some(std::path::PathBuf::from(parser.value().map_err(|e| e.to_string())?)),
            Long(name) => {
                let Some(setting) = config::setting_named(name) else {
                    return Err(one_line(Long(name).unexpected()));
                };
                let secret = SECRET_FLAGS.iter().find(|(flag, _)| *flag == name);
                let value = if setting.takes_value { string_value(&mut parser)? } else { String::new() };
                if let Some((flag, env)) = secret {
                    eprintln!(
                        "payonce: warning: --{flag} on the command line is visible to every user of this host \
                         (ps, /proc); give it as --{flag}-file FILE (or {env}) instead"
                    );
                }
                command_line.push((setting, value));
            }
            Value(value) if accept_positional => {
                positional.push(value.into_string().map_err(|v| format!("{v:?} is not UTF-8"))?)
            }
            other => return Err(one_line(other.unexpected())),
        }
    }
    let env = |name: &str| std::env::var(name).ok();
    let (settings, warnings) = Settings::assemble(&env, config_file.as_deref(), &command_line)?;
    for warning in warnings {
        eprintln!("payonce: warning: {warning}");
    }
    Ok((settings, positional))
}

/// The SQLite files opening `db` would create: none when it is not a file
/// path (`:memory:`, a `file:` URI, a PostgreSQL URL) or the file exists.
fn files_a_start_would_create(db: &str) -> Vec<std::path::PathBuf> {
    if db == ":memory:" || db.starts_with("file:") || db.contains("://") || std::path::Path::new(db).exists() {
        return Vec::new();
    }
    ["", "-wal", "-shm", "-journal"].iter().map(|suffix| std::path::PathBuf::from(format!("{db}{suffix}"))).collect()
}

fn remove_files(paths: &[std::path::PathBuf]) {
    for path in paths {
        let _ = std::fs::remove_file(path);
    }
}

/// A refused argument as one line, pointing at the help rather than
/// burying the line under it.
fn one_line(refused: lexopt::Error) -> String {
    format!("{refused}; see --help")
}

/// The flags whose values are secrets: visible to every user of the host
/// in `ps` and /proc when given on the command line.
const SECRET_FLAGS: &[(&str, &str)] = &[
    ("callback-secret", "PAYONCE_CALLBACK_SECRET"),
    ("api-token", "PAYONCE_API_TOKEN"),
    ("wechatpay-apiv3-key", "PAYONCE_WECHATPAY_APIV3_KEY"),
];

fn string_value(parser: &mut lexopt::Parser) -> Result<String, String> {
    parser.value().map_err(|e| e.to_string())?.into_string().map_err(|v| format!("{v:?} is not UTF-8"))
}

/// Workers of the `--metrics-listen` listener: a scrape is one read.
const METRICS_WORKERS: usize = 1;

fn serve(args: Settings) -> Result<ExitCode, String> {
    payonce::log::set_format(args.log_format);
    let Checked { config, warnings } = args.check()?;
    for warning in &warnings {
        eprintln!("payonce: {warning}");
    }
    for line in config.platforms.registry.describe() {
        eprintln!("payonce: {line}");
    }
    let listen_addrs: Vec<SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(args.listen.as_str())
        .map_err(|e| format!("--listen {:?}: expected ADDR:PORT ({e})", args.listen))?
        .collect();
    let listen = &args.listen;
    if config.api_tokens.current().is_empty() {
        if listen_addrs.is_empty() || !listen_addrs.iter().all(|a| a.ip().is_loopback()) {
            return Err(format!(
                "refusing to serve /v1 without authentication on non-loopback address {listen}: set --api-token or PAYONCE_API_TOKEN"
            ));
        }
        eprintln!(
            "payonce: warning: no API token configured: /v1 is open to anyone who can reach {listen} (loopback only)"
        );
    }
    // The database first: a refused start (a bad file) exits before the port
    // is taken. A start that then cannot listen removes the files the open
    // created, so a failed start leaves no new file behind.
    let new_files = files_a_start_would_create(&args.db);
    let app = App::open_with(&args.db, Clock::System, config, &args.store).map_err(|e| {
        remove_files(&new_files);
        e.message
    })?;
    let server = match Server::bind_with(&args.listen, args.limits.clone()) {
        Ok(server) => server,
        Err(e) => {
            drop(app);
            remove_files(&new_files);
            return Err(e.message);
        }
    };
    // The metrics listener, when asked for: bound before the start is
    // announced, so an unusable address stops the start like --listen's.
    let metrics_server = match args.metrics_listen.as_deref().map(|m| (m, Server::bind_with(m, args.limits.clone()))) {
        None => None,
        Some((_, Ok(metrics_server))) => Some(metrics_server),
        Some((listen, Err(e))) => {
            drop(server);
            drop(app);
            remove_files(&new_files);
            return Err(format!("--metrics-listen {listen:?}: {}", e.message));
        }
    };
    let addr = server.local_addr();
    let shutdown = Arc::new(AtomicBool::new(false));
    let app = Arc::new(app);
    handle_signals(&shutdown, Some(Arc::clone(&app))).map_err(|e| format!("cannot handle signals: {e}"))?;
    if let Some(metrics_server) = &metrics_server {
        eprintln!("payonce: metrics on http://{}/metrics (no token)", metrics_server.local_addr());
    }
    println!("listening on http://{addr}");
    let _ = std::io::stdout().flush();
    if args.dev {
        print_tour(addr);
    }
    let sweeper = spawn_sweeper(Arc::clone(&app), Duration::from_secs(args.sweep_interval_s), Arc::clone(&shutdown))
        .map_err(|e| format!("cannot start the expiry sweeper: {e}"))?;
    let inspector =
        spawn_inspector(Arc::clone(&app), Duration::from_secs(args.inspect_interval_s), Arc::clone(&shutdown))
            .map_err(|e| format!("cannot start the inspector: {e}"))?;
    let storage_watch = spawn_storage_watch(Arc::clone(&app), Arc::clone(&shutdown))
        .map_err(|e| format!("cannot start the storage watch: {e}"))?;
    let key_refresh = spawn_key_refresh(Arc::clone(&app), Arc::clone(&shutdown))
        .map_err(|e| format!("cannot start the key refresh: {e}"))?;
    let relay = spawn_relay(Arc::clone(&app), Arc::clone(&shutdown))
        .map_err(|e| format!("cannot start the webhook relay: {}", e.message))?;
    let platform_worker = if app.config().platforms.is_empty() {
        None
    } else {
        let interval = Duration::from_secs(args.sweep_interval_s);
        Some(
            spawn_platform_worker(Arc::clone(&app), interval, Arc::clone(&shutdown))
                .map_err(|e| format!("cannot start the platform calls: {e}"))?,
        )
    };
    let metrics_thread = match metrics_server {
        None => None,
        Some(metrics_server) => {
            let (app, shutdown) = (Arc::clone(&app), Arc::clone(&shutdown));
            Some(
                std::thread::Builder::new()
                    .name("payonce-metrics".into())
                    .spawn(move || metrics_server.serve_metrics(app, shutdown, METRICS_WORKERS))
                    .map_err(|e| format!("cannot start the metrics listener: {e}"))?,
            )
        }
    };
    let finished = server.serve(app, shutdown, args.workers);
    if let Some(metrics_thread) = metrics_thread {
        let _ = metrics_thread.join();
    }
    let _ = sweeper.join();
    let _ = inspector.join();
    let _ = storage_watch.join();
    let _ = key_refresh.join();
    if let Some(relay) = relay {
        let _ = relay.join();
    }
    if let Some(worker) = platform_worker {
        let _ = worker.join();
    }
    if !finished {
        eprintln!("payonce: warning: shutdown grace period ended with requests still in flight");
    }
    eprintln!("payonce: stopped");
    Ok(ExitCode::SUCCESS)
}

fn sign(mut parser: lexopt::Parser) -> Result<ExitCode, String> {
    use lexopt::prelude::*;
    let mut secret = std::env::var("PAYONCE_CALLBACK_SECRET").ok().filter(|s| !s.is_empty());
    while let Some(arg) = parser.next().map_err(|e| e.to_string())? {
        match arg {
            Long("callback-secret") => secret = Some(string_value(&mut parser)?),
            Long("dev") => secret = Some(DEV_CALLBACK_SECRET.to_owned()),
            Short('h') | Long("help") => {
                print!("{SIGN_USAGE}");
                return Ok(ExitCode::SUCCESS);
            }
            other => return Err(one_line(other.unexpected())),
        }
    }
    let secret = secret
        .as_deref()
        .and_then(|s| s.split(',').map(str::trim).find(|s| !s.is_empty()))
        .ok_or("sign needs --callback-secret, PAYONCE_CALLBACK_SECRET or --dev")?
        .to_owned();
    let mut body = Vec::new();
    std::io::Read::read_to_end(&mut std::io::stdin(), &mut body).map_err(|e| format!("cannot read stdin: {e}"))?;
    let now_s = Clock::System.now_ms().div_euclid(1000);
    println!("{}", payonce::signature::sign(secret.as_bytes(), now_s, &body));
    Ok(ExitCode::SUCCESS)
}

/// Options shared by the offline commands.
#[derive(Default)]
struct OfflineArgs {
    db: Option<String>,
    statement: Option<String>,
    format: Option<String>,
    date: Option<String>,
    repair: bool,
    to: Option<String>,
    force: bool,
    from: Option<String>,
}

fn parse_offline(mut parser: lexopt::Parser, usage: &str, allowed: &[&str]) -> Result<Option<OfflineArgs>, String> {
    use lexopt::prelude::*;
    let mut args = OfflineArgs::default();
    while let Some(arg) = parser.next().map_err(|e| e.to_string())? {
        let name = match &arg {
            Long(name) => *name,
            Short('h') => "help",
            _ => "",
        };
        if name == "help" {
            print!("{usage}");
            return Ok(None);
        }
        if !allowed.contains(&name) {
            return Err(one_line(arg.unexpected()));
        }
        match name {
            "db" => args.db = Some(string_value(&mut parser)?),
            "statement" => args.statement = Some(string_value(&mut parser)?),
            "format" => args.format = Some(string_value(&mut parser)?),
            "date" => args.date = Some(string_value(&mut parser)?),
            "to" => args.to = Some(string_value(&mut parser)?),
            "from" => args.from = Some(string_value(&mut parser)?),
            "repair" => args.repair = true,
            "force" => args.force = true,
            _ => return Err(one_line(arg.unexpected())),
        }
    }
    Ok(Some(args))
}

fn sync(parser: lexopt::Parser) -> Result<ExitCode, String> {
    let (args, positional) = parse_settings(parser, true, SYNC_USAGE)?;
    let [order_no] = positional.as_slice() else {
        return Err(format!("sync takes one ORDER_NO\n\n{SYNC_USAGE}"));
    };
    let platforms = args.platforms()?;
    if platforms.is_empty() {
        return Err(format!("sync needs the outgoing settings of at least one platform\n\n{SYNC_USAGE}"));
    }
    let app = App::open_existing(&args.db, Clock::System).map_err(|e| e.message)?.with_platforms(platforms);
    let synced = app.platform_calls().sync_order(order_no).map_err(|e| e.to_string())?;
    println!("{}", payonce::render::synced(&synced));
    let unknown = synced.platforms.iter().any(|p| p.state == payonce::platforms::TradeState::Unknown);
    Ok(if unknown { ExitCode::from(1) } else { ExitCode::SUCCESS })
}

fn inspect(parser: lexopt::Parser) -> Result<ExitCode, String> {
    let Some(args) = parse_offline(parser, INSPECT_USAGE, &["db"])? else {
        return Ok(ExitCode::SUCCESS);
    };
    let db = args.db.or_else(db_from_env).ok_or("inspect needs --db PATH|URL (or PAYONCE_DB)")?;
    let app = App::open_existing(&db, Clock::System).map_err(|e| e.message)?;
    let findings = app.operations().inspect().map_err(|e| e.message)?;
    println!("{}", payonce::render::inspection(&findings));
    Ok(if findings.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

fn reconcile(parser: lexopt::Parser) -> Result<ExitCode, String> {
    let Some(args) = parse_offline(parser, RECONCILE_USAGE, &["db", "statement", "format", "date", "repair"])? else {
        return Ok(ExitCode::SUCCESS);
    };
    let db = args.db.or_else(db_from_env).ok_or("reconcile needs --db PATH|URL (or PAYONCE_DB)")?;
    let path = args.statement.ok_or("reconcile needs --statement FILE")?;
    let format = match args.format.as_deref() {
        None => Format::Generic,
        Some(f) => Format::parse(f).ok_or("--format must be generic, wechatpay or alipay")?,
    };
    let statement = std::fs::read(&path).map_err(|e| format!("cannot read {path}: {e}"))?;
    let app = App::open_existing(&db, Clock::System).map_err(|e| e.message)?;
    let mut bar = ProgressBar::new("reconcile");
    let result = app
        .operations()
        .reconcile(format, &statement, args.date.as_deref(), args.repair, &mut |done, total| bar.update(done, total))
        .map_err(|e| e.message)?;
    bar.finish();
    println!("{}", result.to_json());
    Ok(if result.is_clean() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

fn backup(parser: lexopt::Parser) -> Result<ExitCode, String> {
    let Some(args) = parse_offline(parser, BACKUP_USAGE, &["db", "to", "force"])? else {
        return Ok(ExitCode::SUCCESS);
    };
    let db = args.db.or_else(db_from_env).ok_or("backup needs --db PATH (or PAYONCE_DB)")?;
    if payonce::store::is_postgres(&db) {
        return Err(format!(
            "backup copies a SQLite file; {} is PostgreSQL: back it up with pg_dump (or the server's point-in-time recovery), see docs/postgres.md",
            payonce::store::shown_db(&db)
        ));
    }
    let to = args.to.ok_or("backup needs --to FILE")?;
    let app = App::open_existing(&db, Clock::System).map_err(|e| e.message)?;
    app.operations().backup(std::path::Path::new(&to), args.force).map_err(|e| e.message)?;
    eprintln!("payonce: backup of {db} written to {to} (integrity_check ok)");
    Ok(ExitCode::SUCCESS)
}

fn copy_db(parser: lexopt::Parser) -> Result<ExitCode, String> {
    let Some(args) = parse_offline(parser, COPY_DB_USAGE, &["from", "to"])? else {
        return Ok(ExitCode::SUCCESS);
    };
    let from = args.from.ok_or("copy-db needs --from FILE.db (a SQLite ledger)")?;
    let to = args.to.ok_or("copy-db needs --to postgres://... (an empty PostgreSQL database)")?;
    if !payonce::store::is_postgres(&to) {
        return Err(format!(
            "copy-db --to takes a PostgreSQL database (a postgres:// or postgresql:// URL, or libpq key-value settings), not {to:?}"
        ));
    }
    if payonce::store::is_postgres(&from) {
        return Err(format!("copy-db --from takes a SQLite file, not {}", payonce::store::shown_db(&from)));
    }
    let shown = payonce::store::shown_db(&to);
    eprintln!("payonce: copying {from} into {shown}");
    let report = payonce::store::copy_sqlite_to_postgres(
        std::path::Path::new(&from),
        &to,
        &payonce::store::StoreOptions::default(),
        &mut |table| eprintln!("  {:<18} {:>10} rows  sha256 {}", table.table, table.rows, table.checksum),
    )
    .map_err(|e| e.message)?;
    let rows: u64 = report.tables.iter().map(|t| t.rows).sum();
    println!(
        "copied {rows} rows in {} tables into {shown} (schema version {}); counts and checksums equal; {} triggers enabled",
        report.tables.len(),
        report.schema_version,
        report.triggers_enabled
    );
    Ok(ExitCode::SUCCESS)
}

/// A one-line progress bar on stderr, redrawn at most every 1%.
struct ProgressBar {
    label: &'static str,
    last_percent: Option<usize>,
    drawn: bool,
}

impl ProgressBar {
    const WIDTH: usize = 40;

    fn new(label: &'static str) -> ProgressBar {
        ProgressBar { label, last_percent: None, drawn: false }
    }

    fn update(&mut self, done: usize, total: usize) {
        let percent = (done * 100).checked_div(total).unwrap_or(100);
        if self.last_percent == Some(percent) {
            return;
        }
        self.last_percent = Some(percent);
        let filled = percent * Self::WIDTH / 100;
        eprint!(
            "\r{} [{}{}] {percent:>3}% {done}/{total} rows",
            self.label,
            "#".repeat(filled),
            "-".repeat(Self::WIDTH - filled)
        );
        self.drawn = true;
    }

    fn finish(&self) {
        if self.drawn {
            eprintln!();
        }
    }
}

fn print_tour(addr: SocketAddr) {
    eprintln!(
        "\npayonce: dev mode. Try, in another terminal (README.md, 'A five-minute tour'):\n\
         \x20 curl -s -X POST http://{addr}/v1/orders -H 'Content-Type: application/json' \\\n\
         \x20      -d '{{\"order_no\":\"ORD-1\",\"user_id\":\"u1\",\"amount\":9900}}'\n\
         \x20 BODY='{{\"pay_no\":\"PAY-1\",\"order_no\":\"ORD-1\",\"amount\":9900,\"status\":\"SUCCESS\"}}'\n\
         \x20 SIG=$(printf %s \"$BODY\" | ./target/release/payonce sign --dev)\n\
         \x20 curl -s -X POST http://{addr}/v1/callbacks/generic -H 'Content-Type: application/json' \\\n\
         \x20      -H \"Payonce-Signature: $SIG\" -d \"$BODY\"     # run it twice: applied, then duplicate\n\
         \x20 curl -s http://{addr}/v1/orders/ORD-1\n\
         \x20 and the operator console: http://{addr}/console (no token in dev mode without --api-token: leave it empty)\n"
    );
}
