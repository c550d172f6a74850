//! `payonce`: argument parsing and wiring only; everything else is in the library.

use payonce::app::{ApiToken, Config, IDEMPOTENCY_TTL_S_DEFAULT, ORDER_TTL_S_DEFAULT};
use payonce::background::{
    handle_signals, spawn_inspector, spawn_platform_worker, spawn_storage_watch, spawn_sweeper,
    INSPECT_INTERVAL_S_DEFAULT, SWEEP_INTERVAL_S_DEFAULT,
};
use payonce::channel::alipay::{public_key_from_text as alipay_public_key_from_text, AlipayConfig};
use payonce::channel::wechatpay::{public_key_from_pem, WechatpayConfig};
use payonce::domain::{is_identifier, Rewards};
use payonce::http::{Limits, Server, WORKERS_DEFAULT};
use payonce::platform::alipay::AlipayApi;
use payonce::platform::wechatpay::WechatpayApi;
use payonce::platform::MerchantKey;
use payonce::platform_ops::Platforms;
use payonce::recon::Format;
use payonce::relay::spawn_relay;
use payonce::webhook::{parse_endpoint, parse_retry_schedule, parse_secrets, parse_waits, WebhookConfig};
use payonce::{App, Clock};
use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

/// The fixed secret of `--dev`; printed loudly, never for production.
const DEV_CALLBACK_SECRET: &str = "payonce-dev-secret";

const USAGE: &str = "\
payonce: exactly-once orders and payment callbacks on SQLite or PostgreSQL

Usage:
  payonce serve     [--db PATH|:memory:|URL] [--listen ADDR:PORT] [settings]
  payonce simulate  [--target URL] [--channel generic|wechatpay|alipay|all] [--scenario NAME]... [--orders N]
                    [--time-factor F] [--full-schedules]
                    (runs payonce-sim, the payment-platform simulator; exit 0 clean, 1 on any violation)
  payonce inspect   --db PATH|URL         (findings as JSON on stdout; exit 0 clean, 1 findings)
  payonce reconcile --db PATH|URL --statement FILE [--format generic|wechatpay|alipay] [--date YYYY-MM-DD] [--repair]
  payonce backup    --db PATH --to FILE [--force]   (an online, consistent, atomic copy; SQLite)
  payonce sync      --db PATH|URL [the platform settings of serve] ORDER_NO
                    (asks the platforms about the order; exit 0, 1 if a platform could not answer)
  payonce sign      [--callback-secret S | --dev] < BODY
  payonce help

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

const SYNC_USAGE: &str = "\
Usage: payonce sync --db PATH|URL [the platform settings of serve] ORDER_NO

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
finishing requests in flight (bounded); SIGHUP, SIGUSR1 and SIGUSR2 are
logged and ignored.

Options:
  --db PATH|:memory:|URL    SQLite file, a shared in-memory SQLite database, or a
                            postgres:// (postgresql://) URL; env PAYONCE_DB [default: payonce.db]
  --listen ADDR:PORT        address to bind; port 0 picks a free one [default: 127.0.0.1:8080]
  --callback-secret S,...   HMAC secrets of the generic channel, comma-separated (two during
                            rotation); env PAYONCE_CALLBACK_SECRET. Required unless --dev.
  --dev                     development mode: a fixed, printed callback secret
  --api-token T,...         bearer tokens for /v1 except callbacks, each `name:token` or a bare
                            token; env PAYONCE_API_TOKEN. Unset = no auth, loopback only.
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
  --inspect-interval-s N    how often the inspection runs [default: 300]
  --wechatpay-apiv3-key KEY WeChat Pay APIv3 key (32 bytes); env PAYONCE_WECHATPAY_APIV3_KEY.
                            With --wechatpay-public-key, turns the wechatpay channel on.
  --wechatpay-public-key SERIAL=FILE
                            a WeChat Pay platform public key or certificate (PEM) and its serial
                            or PUB_KEY_ID_...; repeatable (two during rotation)
  --alipay-public-key FILE  Alipay public key (PEM or the console's base64); with
                            --alipay-app-id, turns the alipay channel on
  --alipay-app-id ID        the merchant's Alipay app_id

Webhooks to the merchant's app (Standard Webhooks; docs/webhooks.md):
  --webhook-url URL               an endpoint that receives every event after it was first
                                  configured (repeatable); http:// or https://. Secrets in env
                                  PAYONCE_WEBHOOK_SECRET: comma-separated whsec_<base64>, all sign
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
  --alipay-app-private-key FILE   the app's private key (PEM, PKCS#8 or PKCS#1); needs
                                  --alipay-app-id and --alipay-public-key
  --alipay-gateway URL            [default: https://openapi.alipay.com/gateway.do]
  --platform-timeout-ms N         one platform call's whole HTTP exchange [default: 10000]
  --platform-retry-s LIST         waits between attempts of a close at a platform, seconds; the
                                  last repeats [default: 5,30,120,600,1800,3600]
  --refund-query-after-s N        a submitted refund without a result this long is queried
                                  (then on --platform-retry-s) [default: 300]
  --public-base-url URL           where platforms reach this payonce; WeChat Pay refunds then
                                  carry notify_url = URL/v1/callbacks/wechatpay/refund
  --close-give-up-s N             after this long past expires_at without a platform's
                                  confirmation, close locally and report close_unconfirmed
                                  [default: 86400]

HTTP edge limits (section 7; each holds without a reverse proxy):
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
  -h, --help                      this help
";

struct ServeArgs {
    db: String,
    listen: String,
    callback_secret: Option<String>,
    dev: bool,
    coupons: Vec<String>,
    points_per_yuan: i64,
    order_ttl_s: i64,
    sweep_interval_s: u64,
    store: payonce::store::StoreOptions,
    api_tokens: Option<String>,
    idempotency_ttl_s: i64,
    inspect_interval_s: u64,
    wechatpay_apiv3_key: Option<String>,
    wechatpay_public_keys: Vec<String>,
    alipay_public_key: Option<String>,
    alipay_app_id: Option<String>,
    limits: Limits,
    workers: usize,
    webhooks: WebhookConfig,
    webhook_secret: Option<String>,
    wechatpay_mchid: Option<String>,
    wechatpay_merchant_serial: Option<String>,
    wechatpay_merchant_key: Option<String>,
    wechatpay_api_base: String,
    alipay_app_private_key: Option<String>,
    alipay_gateway: String,
    platform_timeout_ms: u64,
    platform_retry_ms: Vec<u64>,
    close_give_up_s: i64,
    refund_query_after_s: i64,
    public_base_url: Option<String>,
    /// `payonce sync`'s ORDER_NO (serve takes no positional argument).
    positional: Vec<String>,
}

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
        None | Some("help") | Some("-h") | Some("--help") => {
            print!("{USAGE}");
            Ok(ExitCode::SUCCESS)
        }
        Some(other) => Err(format!("unknown command {other:?}\n\n{USAGE}")),
    }
}

/// `PAYONCE_DB`: the database when `--db` is not given, so a PostgreSQL
/// password need not appear on a command line.
fn db_from_env() -> Option<String> {
    std::env::var("PAYONCE_DB").ok().filter(|db| !db.is_empty())
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

fn parse_serve(parser: lexopt::Parser) -> Result<ServeArgs, String> {
    parse_serve_like(parser, false, SERVE_USAGE)
}

/// `serve`'s settings; `payonce sync` takes the same plus its ORDER_NO.
fn parse_serve_like(mut parser: lexopt::Parser, accept_positional: bool, usage: &str) -> Result<ServeArgs, String> {
    use lexopt::prelude::*;
    let mut args = ServeArgs {
        db: db_from_env().unwrap_or_else(|| "payonce.db".into()),
        listen: "127.0.0.1:8080".into(),
        callback_secret: std::env::var("PAYONCE_CALLBACK_SECRET").ok().filter(|s| !s.is_empty()),
        dev: false,
        coupons: Vec::new(),
        points_per_yuan: 0,
        order_ttl_s: ORDER_TTL_S_DEFAULT,
        sweep_interval_s: SWEEP_INTERVAL_S_DEFAULT,
        store: payonce::store::StoreOptions::default(),
        api_tokens: std::env::var("PAYONCE_API_TOKEN").ok().filter(|s| !s.is_empty()),
        idempotency_ttl_s: IDEMPOTENCY_TTL_S_DEFAULT,
        inspect_interval_s: INSPECT_INTERVAL_S_DEFAULT,
        wechatpay_apiv3_key: std::env::var("PAYONCE_WECHATPAY_APIV3_KEY").ok().filter(|s| !s.is_empty()),
        wechatpay_public_keys: Vec::new(),
        alipay_public_key: None,
        alipay_app_id: None,
        limits: Limits::default(),
        workers: WORKERS_DEFAULT,
        webhooks: WebhookConfig::default(),
        webhook_secret: std::env::var("PAYONCE_WEBHOOK_SECRET").ok().filter(|s| !s.trim().is_empty()),
        wechatpay_mchid: None,
        wechatpay_merchant_serial: None,
        wechatpay_merchant_key: None,
        wechatpay_api_base: payonce::platform::wechatpay::API_BASE_DEFAULT.to_owned(),
        alipay_app_private_key: None,
        alipay_gateway: payonce::platform::alipay::GATEWAY_DEFAULT.to_owned(),
        platform_timeout_ms: payonce::platform::PLATFORM_TIMEOUT_MS_DEFAULT,
        platform_retry_ms: parse_waits("--platform-retry-s", payonce::platform::PLATFORM_RETRY_S_DEFAULT)?,
        close_give_up_s: payonce::platform::CLOSE_GIVE_UP_S_DEFAULT,
        refund_query_after_s: payonce::platform::REFUND_QUERY_AFTER_S_DEFAULT,
        public_base_url: None,
        positional: Vec::new(),
    };
    while let Some(arg) = parser.next().map_err(|e| e.to_string())? {
        match arg {
            Long("db") => args.db = string_value(&mut parser)?,
            Long("listen") => args.listen = string_value(&mut parser)?,
            Long("callback-secret") => args.callback_secret = Some(string_value(&mut parser)?),
            Long("dev") => args.dev = true,
            Long("api-token") => args.api_tokens = Some(string_value(&mut parser)?),
            Long("idempotency-ttl-s") => {
                args.idempotency_ttl_s = int_value(&mut parser, "--idempotency-ttl-s", 1, 365 * 86_400)?
            }
            Long("coupon") => {
                let template = string_value(&mut parser)?;
                if !is_identifier(&template) {
                    return Err(format!("--coupon {template:?}: 1-64 characters of [A-Za-z0-9_.-]"));
                }
                args.coupons.push(template);
            }
            Long("points-per-yuan") => {
                args.points_per_yuan = int_value(&mut parser, "--points-per-yuan", 0, 1_000_000)?
            }
            Long("order-ttl-s") => args.order_ttl_s = int_value(&mut parser, "--order-ttl-s", 1, 86_400)?,
            Long("wechatpay-apiv3-key") => args.wechatpay_apiv3_key = Some(string_value(&mut parser)?),
            Long("wechatpay-public-key") => args.wechatpay_public_keys.push(string_value(&mut parser)?),
            Long("alipay-public-key") => args.alipay_public_key = Some(string_value(&mut parser)?),
            Long("alipay-app-id") => args.alipay_app_id = Some(string_value(&mut parser)?),
            Long("inspect-interval-s") => {
                args.inspect_interval_s = int_value(&mut parser, "--inspect-interval-s", 1, 86_400)?.unsigned_abs()
            }
            Long("db-pool-size") => {
                args.store.pool_size = int_value(&mut parser, "--db-pool-size", 2, 1_000)?.unsigned_abs() as u32
            }
            Long("group-commit-max") => {
                args.store.group_commit_max =
                    int_value(&mut parser, "--group-commit-max", 1, 10_000)?.unsigned_abs() as usize
            }
            Long("group-commit-wait-us") => {
                args.store.group_commit_wait_us =
                    int_value(&mut parser, "--group-commit-wait-us", 0, 1_000_000)?.unsigned_abs()
            }
            Long("db-busy-timeout-ms") => {
                args.store.busy_timeout_ms = int_value(&mut parser, "--db-busy-timeout-ms", 1, 600_000)?.unsigned_abs()
            }
            Long("sweep-interval-s") => {
                args.sweep_interval_s = int_value(&mut parser, "--sweep-interval-s", 1, 86_400)?.unsigned_abs()
            }
            Long("max-connections") => {
                args.limits.max_connections = positive(&mut parser, "--max-connections", 1_000_000)? as usize
            }
            Long("header-read-timeout-ms") => {
                args.limits.header_read_timeout_ms = positive(&mut parser, "--header-read-timeout-ms", TIMEOUT_MS_MAX)?
            }
            Long("body-read-timeout-ms") => {
                args.limits.body_read_timeout_ms = positive(&mut parser, "--body-read-timeout-ms", TIMEOUT_MS_MAX)?
            }
            Long("keep-alive-idle-ms") => {
                args.limits.keep_alive_idle_ms = positive(&mut parser, "--keep-alive-idle-ms", TIMEOUT_MS_MAX)?
            }
            Long("response-write-timeout-ms") => {
                args.limits.response_write_timeout_ms =
                    positive(&mut parser, "--response-write-timeout-ms", TIMEOUT_MS_MAX)?
            }
            Long("fd-reserve") => {
                args.limits.fd_reserve = int_value(&mut parser, "--fd-reserve", 0, 1_000_000)?.unsigned_abs()
            }
            Long("shutdown-grace-ms") => {
                args.limits.shutdown_grace_ms = positive(&mut parser, "--shutdown-grace-ms", TIMEOUT_MS_MAX)?
            }
            Long("workers") => args.workers = positive(&mut parser, "--workers", 1024)? as usize,
            Long("webhook-url") => {
                let endpoint = parse_endpoint(&string_value(&mut parser)?)?;
                if !args.webhooks.endpoints.contains(&endpoint) {
                    args.webhooks.endpoints.push(endpoint);
                }
            }
            Long("webhook-timeout-ms") => {
                args.webhooks.timeout_ms = positive(&mut parser, "--webhook-timeout-ms", TIMEOUT_MS_MAX)?
            }
            Long("webhook-retry-s") => {
                args.webhooks.retry_schedule_ms = parse_retry_schedule(&string_value(&mut parser)?)?
            }
            Long("webhook-concurrency") => {
                args.webhooks.concurrency = positive(&mut parser, "--webhook-concurrency", 256)? as usize
            }
            Long("webhook-poll-ms") => args.webhooks.poll_ms = positive(&mut parser, "--webhook-poll-ms", 60_000)?,
            Long("wechatpay-mchid") => args.wechatpay_mchid = Some(string_value(&mut parser)?),
            Long("wechatpay-merchant-serial") => args.wechatpay_merchant_serial = Some(string_value(&mut parser)?),
            Long("wechatpay-merchant-key") => args.wechatpay_merchant_key = Some(string_value(&mut parser)?),
            Long("wechatpay-api-base") => args.wechatpay_api_base = http_url(&mut parser, "--wechatpay-api-base")?,
            Long("alipay-app-private-key") => args.alipay_app_private_key = Some(string_value(&mut parser)?),
            Long("alipay-gateway") => args.alipay_gateway = http_url(&mut parser, "--alipay-gateway")?,
            Long("platform-retry-s") => {
                args.platform_retry_ms = parse_waits("--platform-retry-s", &string_value(&mut parser)?)?
            }
            Long("refund-query-after-s") => {
                args.refund_query_after_s = int_value(&mut parser, "--refund-query-after-s", 1, 30 * 86_400)?
            }
            Long("public-base-url") => args.public_base_url = Some(http_url(&mut parser, "--public-base-url")?),
            Long("close-give-up-s") => {
                args.close_give_up_s = int_value(&mut parser, "--close-give-up-s", 1, 365 * 86_400)?
            }
            Long("platform-timeout-ms") => {
                args.platform_timeout_ms = positive(&mut parser, "--platform-timeout-ms", TIMEOUT_MS_MAX)?
            }
            Value(value) if accept_positional => {
                args.positional.push(value.into_string().map_err(|v| format!("{v:?} is not UTF-8"))?)
            }
            Short('h') | Long("help") => {
                print!("{usage}");
                std::process::exit(0);
            }
            other => return Err(format!("{}\n\n{usage}", other.unexpected())),
        }
    }
    Ok(args)
}

/// An `http://` or `https://` base URL.
fn http_url(parser: &mut lexopt::Parser, flag: &str) -> Result<String, String> {
    let url = string_value(parser)?;
    if url.starts_with("http://") || url.starts_with("https://") {
        Ok(url)
    } else {
        Err(format!("{flag} {url:?}: expected an http:// or https:// URL"))
    }
}

fn string_value(parser: &mut lexopt::Parser) -> Result<String, String> {
    parser.value().map_err(|e| e.to_string())?.into_string().map_err(|v| format!("{v:?} is not UTF-8"))
}

fn int_value(parser: &mut lexopt::Parser, flag: &str, min: i64, max: i64) -> Result<i64, String> {
    let text = string_value(parser)?;
    match text.parse::<i64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(format!("{flag} {text:?}: expected an integer from {min} to {max}")),
    }
}

/// The longest timeout a setting takes: one day.
const TIMEOUT_MS_MAX: u64 = 86_400_000;

/// An integer from 1 to `max`.
fn positive(parser: &mut lexopt::Parser, flag: &str, max: u64) -> Result<u64, String> {
    let max = i64::try_from(max).unwrap_or(i64::MAX);
    Ok(int_value(parser, flag, 1, max)?.unsigned_abs())
}

fn serve(args: ServeArgs) -> Result<ExitCode, String> {
    let secrets = callback_secrets(&args)?;
    let api_tokens = api_tokens(args.api_tokens.as_deref())?;
    let config = Config {
        rewards: Rewards { coupon_templates: args.coupons.clone(), points_per_yuan: args.points_per_yuan },
        order_ttl_s: args.order_ttl_s,
        callback_secrets: secrets,
        idempotency_ttl_s: args.idempotency_ttl_s,
        api_tokens,
        wechatpay: wechatpay_config(&args)?,
        alipay: alipay_config(&args)?,
        webhooks: webhook_config(&args)?,
        platforms: platforms_config(&args)?,
    };
    let listen_addrs: Vec<SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(args.listen.as_str())
        .map_err(|e| format!("--listen {:?}: expected ADDR:PORT ({e})", args.listen))?
        .collect();
    let listen = &args.listen;
    if config.api_tokens.is_empty() {
        if listen_addrs.is_empty() || !listen_addrs.iter().all(|a| a.ip().is_loopback()) {
            return Err(format!(
                "refusing to serve /v1 without authentication on non-loopback address {listen}: set --api-token or PAYONCE_API_TOKEN"
            ));
        }
        eprintln!(
            "payonce: warning: no API token configured: /v1 is open to anyone who can reach {listen} (loopback only)"
        );
    }
    // The database first: a refused start (a bad file) exits before the port is taken.
    let app = App::open_with(&args.db, Clock::System, config, &args.store).map_err(|e| e.message)?;
    let server = Server::bind_with(&args.listen, args.limits.clone()).map_err(|e| e.message)?;
    let addr = server.local_addr();
    let shutdown = Arc::new(AtomicBool::new(false));
    handle_signals(&shutdown).map_err(|e| format!("cannot handle signals: {e}"))?;
    println!("listening on http://{addr}");
    let _ = std::io::stdout().flush();
    if args.dev {
        print_tour(addr);
    }
    let app = Arc::new(app);
    let sweeper = spawn_sweeper(Arc::clone(&app), Duration::from_secs(args.sweep_interval_s), Arc::clone(&shutdown))
        .map_err(|e| format!("cannot start the expiry sweeper: {e}"))?;
    let inspector =
        spawn_inspector(Arc::clone(&app), Duration::from_secs(args.inspect_interval_s), Arc::clone(&shutdown))
            .map_err(|e| format!("cannot start the inspector: {e}"))?;
    let storage_watch = spawn_storage_watch(Arc::clone(&app), Arc::clone(&shutdown))
        .map_err(|e| format!("cannot start the storage watch: {e}"))?;
    let relay = spawn_relay(Arc::clone(&app), Arc::clone(&shutdown))
        .map_err(|e| format!("cannot start the webhook relay: {}", e.message))?;
    let platform_worker = if app.config.platforms.is_empty() {
        None
    } else {
        let interval = Duration::from_secs(args.sweep_interval_s);
        Some(
            spawn_platform_worker(Arc::clone(&app), interval, Arc::clone(&shutdown))
                .map_err(|e| format!("cannot start the platform calls: {e}"))?,
        )
    };
    let finished = server.serve(app, shutdown, args.workers);
    let _ = sweeper.join();
    let _ = inspector.join();
    let _ = storage_watch.join();
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

/// The relay's settings; `PAYONCE_WEBHOOK_SECRET` is required once an
/// endpoint is configured and refused when malformed.
fn webhook_config(args: &ServeArgs) -> Result<WebhookConfig, String> {
    let mut config = args.webhooks.clone();
    match (&args.webhook_secret, config.endpoints.is_empty()) {
        (None, true) => {}
        (Some(secrets), _) => config.secrets = parse_secrets(secrets)?,
        (None, false) => return Err(parse_secrets("").unwrap_err()),
    }
    Ok(config)
}

/// The `--wechatpay-public-key SERIAL=FILE` keys.
/// The keys, and when those given as certificates expire (an answer or a
/// notification signed by an expired one is refused); an expired one is
/// warned about at start.
fn wechatpay_platform_keys_and_expiries(
    args: &ServeArgs,
) -> Result<(payonce::channel::wechatpay::PlatformKeys, payonce::channel::wechatpay::KeyExpiries), String> {
    let mut expiries = Vec::new();
    let mut platform_keys = Vec::new();
    for entry in &args.wechatpay_public_keys {
        let (serial, file) = entry.split_once('=').ok_or("--wechatpay-public-key takes SERIAL=FILE")?;
        let pem = std::fs::read_to_string(file).map_err(|e| format!("cannot read {file}: {e}"))?;
        let public_key = public_key_from_pem(&pem).map_err(|e| format!("{file}: {e}"))?;
        if let Some(not_after) = payonce::channel::wechatpay::certificate_not_after_ms(&pem) {
            if not_after < Clock::System.now_ms() {
                eprintln!(
                    "payonce: warning: the WeChat Pay platform certificate {file} expired; what it signs is refused"
                );
            }
            expiries.push((serial.trim().to_owned(), not_after));
        }
        platform_keys.push((serial.trim().to_owned(), public_key));
    }
    Ok((platform_keys, expiries))
}

/// WeChat Pay's outgoing calls are on once any outgoing-only setting is given.
fn wechatpay_outgoing(args: &ServeArgs) -> bool {
    args.wechatpay_mchid.is_some() || args.wechatpay_merchant_serial.is_some() || args.wechatpay_merchant_key.is_some()
}

/// The notification channel: the APIv3 key and at least one platform key.
/// With outgoing calls on, platform keys without an APIv3 key are valid:
/// they verify the API's answers only.
fn wechatpay_config(args: &ServeArgs) -> Result<Option<WechatpayConfig>, String> {
    let (key, pems) = (&args.wechatpay_apiv3_key, &args.wechatpay_public_keys);
    if key.is_none() && (pems.is_empty() || wechatpay_outgoing(args)) {
        return Ok(None);
    }
    let key =
        key.as_deref().ok_or("--wechatpay-public-key needs --wechatpay-apiv3-key (or PAYONCE_WECHATPAY_APIV3_KEY)")?;
    let (keys, expiries) = wechatpay_platform_keys_and_expiries(args)?;
    let mut config = WechatpayConfig::new(key, keys)?;
    config.expiries = expiries;
    Ok(Some(config))
}

/// The platforms whose outgoing settings are given: all of a platform's are
/// then required, or `serve` stops naming what is missing.
fn platforms_config(args: &ServeArgs) -> Result<Platforms, String> {
    let timeout = Duration::from_millis(args.platform_timeout_ms);
    let mut platforms = Platforms {
        timeout_ms: args.platform_timeout_ms,
        retry_schedule_ms: args.platform_retry_ms.clone(),
        close_give_up_ms: args.close_give_up_s.saturating_mul(1000),
        refund_query_after_ms: args.refund_query_after_s.saturating_mul(1000),
        ..Platforms::default()
    };
    if wechatpay_outgoing(args) {
        let missing: Vec<&str> = [
            ("--wechatpay-mchid", args.wechatpay_mchid.is_none()),
            ("--wechatpay-merchant-serial", args.wechatpay_merchant_serial.is_none()),
            ("--wechatpay-merchant-key", args.wechatpay_merchant_key.is_none()),
            ("--wechatpay-public-key (to verify the answers)", args.wechatpay_public_keys.is_empty()),
        ]
        .into_iter()
        .filter_map(|(flag, absent)| absent.then_some(flag))
        .collect();
        if !missing.is_empty() {
            return Err(format!("WeChat Pay's outgoing calls also need {}", missing.join(", ")));
        }
        let file = args.wechatpay_merchant_key.as_deref().unwrap_or_default();
        let pem = std::fs::read_to_string(file).map_err(|e| format!("cannot read {file}: {e}"))?;
        let key = MerchantKey::from_pem(&pem).map_err(|e| format!("--wechatpay-merchant-key {file}: {e}"))?;
        let (keys, expiries) = wechatpay_platform_keys_and_expiries(args)?;
        let mut api = WechatpayApi::new(
            args.wechatpay_mchid.clone().unwrap_or_default(),
            args.wechatpay_merchant_serial.clone().unwrap_or_default(),
            key,
            &args.wechatpay_api_base,
            keys,
            timeout,
        );
        api.certificate_expiries = expiries;
        api.refund_notify_url = args
            .public_base_url
            .as_ref()
            .map(|base| format!("{}/v1/callbacks/wechatpay/refund", base.trim_end_matches('/')));
        platforms.wechatpay = Some(Arc::new(api));
    }
    if let Some(file) = &args.alipay_app_private_key {
        let missing: Vec<&str> = [
            ("--alipay-app-id", args.alipay_app_id.is_none()),
            ("--alipay-public-key (to verify the answers)", args.alipay_public_key.is_none()),
        ]
        .into_iter()
        .filter_map(|(flag, absent)| absent.then_some(flag))
        .collect();
        if !missing.is_empty() {
            return Err(format!("Alipay's outgoing calls also need {}", missing.join(", ")));
        }
        let pem = std::fs::read_to_string(file).map_err(|e| format!("cannot read {file}: {e}"))?;
        let key = MerchantKey::from_pem(&pem).map_err(|e| format!("--alipay-app-private-key {file}: {e}"))?;
        let public_file = args.alipay_public_key.as_deref().unwrap_or_default();
        let text = std::fs::read_to_string(public_file).map_err(|e| format!("cannot read {public_file}: {e}"))?;
        let alipay_key = alipay_public_key_from_text(&text).map_err(|e| format!("{public_file}: {e}"))?;
        platforms.alipay = Some(Arc::new(AlipayApi::new(
            args.alipay_app_id.clone().unwrap_or_default(),
            key,
            &args.alipay_gateway,
            alipay_key,
            timeout,
        )));
    }
    Ok(platforms)
}

fn alipay_config(args: &ServeArgs) -> Result<Option<AlipayConfig>, String> {
    match (&args.alipay_public_key, &args.alipay_app_id) {
        (None, None) => Ok(None),
        (Some(file), Some(app_id)) => {
            let text = std::fs::read_to_string(file).map_err(|e| format!("cannot read {file}: {e}"))?;
            let public_key = alipay_public_key_from_text(&text).map_err(|e| format!("{file}: {e}"))?;
            Ok(Some(AlipayConfig { public_key, app_id: app_id.clone() }))
        }
        _ => Err("the alipay channel needs both --alipay-public-key and --alipay-app-id".into()),
    }
}

fn api_tokens(raw: Option<&str>) -> Result<Vec<ApiToken>, String> {
    let Some(raw) = raw else {
        return Ok(Vec::new());
    };
    raw.split(',')
        .filter(|entry| !entry.trim().is_empty())
        .map(|entry| {
            ApiToken::parse(entry).ok_or_else(|| {
                "--api-token: each entry is `name:token` or a bare token; names are 1-64 characters of [A-Za-z0-9_.-], tokens printable ASCII without spaces".to_owned()
            })
        })
        .collect()
}

fn callback_secrets(args: &ServeArgs) -> Result<Vec<Vec<u8>>, String> {
    let configured = args.callback_secret.as_deref().map(|s| {
        s.split(',').map(str::trim).filter(|s| !s.is_empty()).map(|s| s.as_bytes().to_vec()).collect::<Vec<_>>()
    });
    match configured {
        Some(secrets) if !secrets.is_empty() => Ok(secrets),
        _ if args.dev => {
            eprintln!("payonce: WARNING: --dev: the generic channel accepts callbacks signed with the PUBLIC dev secret {DEV_CALLBACK_SECRET:?}.");
            eprintln!("payonce: WARNING: --dev: anyone can forge a payment. Never use --dev with real money.");
            Ok(vec![DEV_CALLBACK_SECRET.as_bytes().to_vec()])
        }
        _ => Err("serve needs --callback-secret (or PAYONCE_CALLBACK_SECRET); use --dev for local development".into()),
    }
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
            other => return Err(format!("{}\n\n{SIGN_USAGE}", other.unexpected())),
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
            return Err(format!("{}\n\n{usage}", arg.unexpected()));
        }
        match name {
            "db" => args.db = Some(string_value(&mut parser)?),
            "statement" => args.statement = Some(string_value(&mut parser)?),
            "format" => args.format = Some(string_value(&mut parser)?),
            "date" => args.date = Some(string_value(&mut parser)?),
            "to" => args.to = Some(string_value(&mut parser)?),
            "repair" => args.repair = true,
            "force" => args.force = true,
            _ => return Err(format!("{}\n\n{usage}", arg.unexpected())),
        }
    }
    Ok(Some(args))
}

fn sync(parser: lexopt::Parser) -> Result<ExitCode, String> {
    let args = parse_serve_like(parser, true, SYNC_USAGE)?;
    let [order_no] = args.positional.as_slice() else {
        return Err(format!("sync takes one ORDER_NO\n\n{SYNC_USAGE}"));
    };
    let platforms = platforms_config(&args)?;
    if platforms.is_empty() {
        return Err(format!("sync needs the outgoing settings of at least one platform\n\n{SYNC_USAGE}"));
    }
    let mut app = App::open_existing(&args.db, Clock::System).map_err(|e| e.message)?;
    app.config.platforms = platforms;
    let synced = app.sync_order(order_no).map_err(|e| e.to_string())?;
    println!("{}", payonce::render::synced(&synced));
    let unknown = synced.platforms.iter().any(|p| p.state == payonce::platform::TradeState::Unknown);
    Ok(if unknown { ExitCode::from(1) } else { ExitCode::SUCCESS })
}

fn inspect(parser: lexopt::Parser) -> Result<ExitCode, String> {
    let Some(args) = parse_offline(parser, INSPECT_USAGE, &["db"])? else {
        return Ok(ExitCode::SUCCESS);
    };
    let db = args.db.or_else(db_from_env).ok_or("inspect needs --db PATH|URL (or PAYONCE_DB)")?;
    let app = App::open_existing(&db, Clock::System).map_err(|e| e.message)?;
    let findings = app.inspect().map_err(|e| e.message)?;
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
    if payonce::store::is_postgres_url(&db) {
        return Err(format!(
            "backup copies a SQLite file; {} is PostgreSQL: back it up with pg_dump (or the server's point-in-time recovery), see docs/postgres.md",
            payonce::store::shown_db(&db)
        ));
    }
    let to = args.to.ok_or("backup needs --to FILE")?;
    let app = App::open_existing(&db, Clock::System).map_err(|e| e.message)?;
    app.backup(std::path::Path::new(&to), args.force).map_err(|e| e.message)?;
    eprintln!("payonce: backup of {db} written to {to} (integrity_check ok)");
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
