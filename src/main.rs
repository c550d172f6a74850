//! `payonce`: argument parsing and wiring only; everything else is in the library.

use payonce::app::{ApiToken, Config, IDEMPOTENCY_TTL_S_DEFAULT, ORDER_TTL_S_DEFAULT};
use payonce::background::{spawn_sweeper, SWEEP_INTERVAL_S_DEFAULT};
use payonce::domain::{is_identifier, Rewards};
use payonce::http::{Server, WORKERS_DEFAULT};
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
payonce: exactly-once orders and payment callbacks on SQLite

Usage:
  payonce serve [--db PATH|:memory:] [--listen ADDR:PORT] [settings]
  payonce sign  [--callback-secret S | --dev] < BODY
  payonce help

Run `payonce serve --help` for the settings.
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
logs and warnings go to stderr. Exits 0 on SIGINT/SIGTERM after finishing
requests in flight (bounded).

Options:
  --db PATH|:memory:        database file, or a shared in-memory database [default: payonce.db]
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
  -h, --help                this help
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
    api_tokens: Option<String>,
    idempotency_ttl_s: i64,
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
        None | Some("help") | Some("-h") | Some("--help") => {
            print!("{USAGE}");
            Ok(ExitCode::SUCCESS)
        }
        Some(other) => Err(format!("unknown command {other:?}\n\n{USAGE}")),
    }
}

fn parse_serve(mut parser: lexopt::Parser) -> Result<ServeArgs, String> {
    use lexopt::prelude::*;
    let mut args = ServeArgs {
        db: "payonce.db".into(),
        listen: "127.0.0.1:8080".into(),
        callback_secret: std::env::var("PAYONCE_CALLBACK_SECRET").ok().filter(|s| !s.is_empty()),
        dev: false,
        coupons: Vec::new(),
        points_per_yuan: 0,
        order_ttl_s: ORDER_TTL_S_DEFAULT,
        sweep_interval_s: SWEEP_INTERVAL_S_DEFAULT,
        api_tokens: std::env::var("PAYONCE_API_TOKEN").ok().filter(|s| !s.is_empty()),
        idempotency_ttl_s: IDEMPOTENCY_TTL_S_DEFAULT,
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
            Long("points-per-yuan") => args.points_per_yuan = int_value(&mut parser, "--points-per-yuan", 0, 1_000_000)?,
            Long("order-ttl-s") => args.order_ttl_s = int_value(&mut parser, "--order-ttl-s", 1, 86_400)?,
            Long("sweep-interval-s") => {
                args.sweep_interval_s = int_value(&mut parser, "--sweep-interval-s", 1, 86_400)?.unsigned_abs()
            }
            Short('h') | Long("help") => {
                print!("{SERVE_USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("{}\n\n{SERVE_USAGE}", other.unexpected())),
        }
    }
    Ok(args)
}

fn string_value(parser: &mut lexopt::Parser) -> Result<String, String> {
    parser
        .value()
        .map_err(|e| e.to_string())?
        .into_string()
        .map_err(|v| format!("{v:?} is not UTF-8"))
}

fn int_value(parser: &mut lexopt::Parser, flag: &str, min: i64, max: i64) -> Result<i64, String> {
    let text = string_value(parser)?;
    match text.parse::<i64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(format!("{flag} {text:?}: expected an integer from {min} to {max}")),
    }
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
        eprintln!("payonce: warning: no API token configured: /v1 is open to anyone who can reach {listen} (loopback only)");
    }
    let server = Server::bind(&args.listen).map_err(|e| e.message)?;
    let addr = server.local_addr();
    let app = App::open(&args.db, Clock::System, config).map_err(|e| e.message)?;
    let shutdown = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&shutdown)).map_err(|e| format!("cannot handle signals: {e}"))?;
    }
    println!("listening on http://{addr}");
    let _ = std::io::stdout().flush();
    if args.dev {
        print_tour(addr);
    }
    let app = Arc::new(app);
    let sweeper = spawn_sweeper(Arc::clone(&app), Duration::from_secs(args.sweep_interval_s), Arc::clone(&shutdown))
        .map_err(|e| format!("cannot start the expiry sweeper: {e}"))?;
    let finished = server.serve(app, shutdown, WORKERS_DEFAULT);
    let _ = sweeper.join();
    if !finished {
        eprintln!("payonce: warning: shutdown grace period ended with requests still in flight");
    }
    eprintln!("payonce: stopped");
    Ok(ExitCode::SUCCESS)
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

fn print_tour(addr: SocketAddr) {
    eprintln!(
        "\npayonce: dev mode. Try, in another terminal (README.md, 'A five-minute tour'):\n\
         \x20 curl -s -X POST http://{addr}/v1/orders -H 'Content-Type: application/json' \\\n\
         \x20      -d '{{\"order_no\":\"ORD-1\",\"user_id\":\"u1\",\"amount\":9900}}'\n\
         \x20 BODY='{{\"pay_no\":\"PAY-1\",\"order_no\":\"ORD-1\",\"amount\":9900,\"status\":\"SUCCESS\"}}'\n\
         \x20 SIG=$(printf %s \"$BODY\" | ./target/release/payonce sign --dev)\n\
         \x20 curl -s -X POST http://{addr}/v1/callbacks/generic -H 'Content-Type: application/json' \\\n\
         \x20      -H \"Payonce-Signature: $SIG\" -d \"$BODY\"     # run it twice: applied, then duplicate\n\
         \x20 curl -s http://{addr}/v1/orders/ORD-1\n"
    );
}
