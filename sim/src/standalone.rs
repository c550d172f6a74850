//! `payonce-sim platforms` (`payonce simulate platforms`): the simulated
//! merchant APIs of [`crate::platform_api`] on their own, for a real
//! `payonce serve` to be pointed at in development. It writes the keys
//! payonce needs, prints the `payonce serve` flags that name them, and then
//! serves, driven by a few commands on stdin (a buyer paying, a fault, a
//! trade opened), logging every call on stderr.

use crate::alipay_certs::{AlipayCerts, KeyMode, APP_CERT_FILE, PUBLIC_CERT_FILE, ROOT_CERT_FILE};
use crate::platform::{private_key_from_file, Platform, SIM_RSA_BITS, WECHATPAY_APPID};
use crate::platform_api::{AlipayApiConfig, Call, Fault, PlatformApi, RefundStatus, Refused, WechatpayApiConfig};
use rsa::pkcs8::{EncodePrivateKey, LineEnding};
use rsa::traits::PublicKeyParts;
use rsa::RsaPrivateKey;
use std::ffi::OsString;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

pub const USAGE: &str = "\
Usage: payonce simulate platforms [options]      (the binary: payonce-sim platforms)

Plays WeChat Pay v3's and Alipay's merchant APIs (prepay and precreate,
trade query, close, refund and refund query; Alipay's gateway.do, and the
page, wap and app requests a buyer opens) on 127.0.0.1 for a real
`payonce serve` to call. Requests are verified with the public half of the
merchant's key, answers signed with platform keys made for this run. At
start it writes the key files into DIR, prints on stdout the `payonce serve`
flags that point payonce at these servers, one flag a line, then a line
`ready`. Then it serves until SIGINT/SIGTERM, stdin closing or `quit`,
logging each call on stderr, one line each: platform, HTTP method, path
(WeChat Pay) or method (Alipay), verified or UNVERIFIED, the HTTP status or
`unanswered`, the platform's code. Exit status 0 when stopped, 2 on an error.

  payonce simulate platforms --public-base-url http://127.0.0.1:8080
  payonce serve --dev --db dev.db [the flags it printed]
  curl -X POST localhost:8080/v1/orders -H 'Content-Type: application/json' -d '{\"order_no\":\"ORD_1001\",\"user_id\":\"u1\",\"amount\":9900,\"currency\":\"CNY\"}'
  curl -X POST localhost:8080/v1/orders/ORD_1001/pay -H 'Content-Type: application/json' -d '{\"channel\":\"wechatpay\",\"method\":\"native\"}'
  pay ORD_1001                                            # typed here: the buyer pays
  curl -X POST localhost:8080/v1/orders/ORD_1001/sync    # PAID: a payment with source `query`

The simulator sends no notifications: a payment reaches payonce by its sync
(or close), or by `payonce simulate` delivering notices.

Options:
  --wechatpay-port N       WeChat Pay's port [default: 0, a free one]
  --alipay-port N          Alipay's port [default: 0, a free one]
  --merchant-key FILE      the merchant's private key (PEM, PKCS#8 or PKCS#1; RSA, at
                           least 2048 bits): payonce signs with it on both platforms,
                           its public half verifies those requests [default: a
                           throwaway 2048-bit key, written to DIR/merchant-key.pem]
  --dir DIR                where the key files go: merchant-key.pem (when made),
                           wechatpay-platform.pem (the WeChat Pay platform public key)
                           and alipay-public.pem (the Alipay public key), all PEM
                           [default: a new temporary directory, removed on exit]
  --public-base-url URL    payonce's --public-base-url: the platforms refuse a payment
                           whose notify_url is not URL/v1/callbacks/{wechatpay|alipay},
                           and the flag is printed with the others [default: any
                           http(s) notify_url is taken]
  --trade [PLATFORM:]ORDER_NO=AMOUNT[:paid]
                           a trade payonce did not make (as the merchant's code made
                           them before payonce did), open at PLATFORM (wechatpay, the
                           default, or alipay), AMOUNT in fen; with :paid the buyer has
                           paid and the notification was lost (repeatable)
  --key-mode MODE          how payonce holds Alipay's key: public-key (the flag
                           --alipay-public-key, DIR/alipay-public.pem) or certificate:
                           Alipay plays certificate mode, with a root file of an RSA
                           and an ECDSA root, an Alipay public certificate and the
                           merchant's app certificate made now (DIR/alipay-root-cert.crt,
                           alipay-public-cert.crt, alipay-app-cert.crt, printed as
                           --alipay-root-cert, --alipay-public-cert, --alipay-app-cert);
                           every request must carry their app_cert_sn and
                           alipay_root_cert_sn, every answer names alipay_cert_sn
                           [default: public-key]
  --alipay-private-key FILE
                           Alipay's signing key (PKCS#8 PEM), so a test can sign
                           notifications as Alipay [default: a throwaway key]
  --ignore-stdin           read no commands, only a signal stops it (to run in the
                           background, where stdin is often /dev/null: closed at once)
  -h, --help               this help

The merchant is WeChat Pay mchid 1900000100 with certificate serial
SIMULATOR-MERCHANT and the one appid wxsimulatorpayonce, and Alipay app_id
2021000000000000; WeChat Pay's platform key has the id PUB_KEY_ID_SIMULATOR.
A trade exists once payonce's payment made it (POST /v1/orders/{no}/pay) or
the buyer opened a signed Alipay request (`open-url`), or `open`/--trade made
it; the buyer pays it only unexpired and open. A trade the platform does not
have is `ORDER_NOT_EXIST` / `ACQ.TRADE_NOT_EXIST` there, which payonce reads
as not paid.

Commands on stdin, one a line; each answers one line on stdout unless said:
  open-url SIGNED                   the buyer opens what payonce answered for an Alipay
                                    page, wap or app payment (its `url` or `order_string`),
                                    which makes the trade: the out_trade_no, or `refused: ...`
  open [PLATFORM] ORDER_NO AMOUNT   an unpaid trade payonce did not make, AMOUNT in fen,
                                    at PLATFORM (default wechatpay): `ok`, or `error: ...`
  pay [PLATFORM] ORDER_NO           the buyer pays: the pay_no (WeChat Pay's
                                    transaction_id, Alipay's trade_no), or `refused: ...`;
                                    PLATFORM defaults to the one that has the trade
  fault PLATFORM FAULT              every request to PLATFORM (wechatpay, alipay) from now
                                    on: refuse (closed unanswered), hang (never answered),
                                    5xx (a signed system error), slow MS (acted on, answered
                                    MS ms late), delay MS (held MS ms, then acted on and
                                    answered), tamper (a byte of the signed answer changed),
                                    wrong-merchant, wrong-trade (another mchid or out_trade_no
                                    in a signed answer), none (healthy again): `ok`
  state ORDER_NO                    `wechatpay=STATE alipay=STATE` in the platforms' words
                                    (NOTPAY, SUCCESS, CLOSED, WAIT_BUYER_PAY, TRADE_SUCCESS,
                                    ...; `none`: no such trade there)
  trade PLATFORM ORDER_NO           what the trade was made with, one JSON line (trade_type,
                                    amount, expires_at_ms, notify_url, appid, description,
                                    pay_no, and `payment`: the code_url, prepay_id, h5_url or
                                    qr_code handed over), or `none`
  prepays ORDER_NO                  every call that asked to make ORDER_NO's payment, at either
                                    platform, one a line: the platform and the request body as
                                    JSON (Alipay's biz_content), then `end`
  refunds                           every refund the platforms hold, one a line, in the order
                                    requested: platform, out_trade_no, pay_no (the refunded
                                    trade's transaction_id or trade_no), out_refund_no (Alipay's
                                    out_request_no), fen, status (Processing, Success, Closed,
                                    Abnormal), then `end`
  settle REFUND_NO STATUS           the refund of that number reaches its result: success,
                                    closed or abnormal (Alipay shows only success): `ok`, or
                                    `error: ...` (no such refund)
  calls                             every call so far as logged, one a line, then `end`
  help                              this list of commands
  quit                              stop, as closing stdin does
Empty lines and lines starting with # are skipped.
";

/// The serial payonce is told to name in WeChat Pay's `serial_no`. A real
/// one is the hex serial of the merchant's API certificate; this one cannot
/// be mistaken for it.
pub(crate) const MERCHANT_SERIAL: &str = "SIMULATOR-MERCHANT";
/// ring, which payonce signs with, takes no smaller RSA key.
pub(crate) const MERCHANT_KEY_BITS_MIN: usize = 2048;
const MERCHANT_KEY_FILE: &str = "merchant-key.pem";
const WECHATPAY_KEY_FILE: &str = "wechatpay-platform.pem";
const ALIPAY_KEY_FILE: &str = "alipay-public.pem";
/// How often the command loop looks at the signal flag.
const POLL: Duration = Duration::from_millis(100);

/// One `--trade`.
#[derive(Debug)]
struct TradeSpec {
    platform: Platform,
    order_no: String,
    amount: i64,
    paid: bool,
}

struct Options {
    wechatpay_port: u16,
    alipay_port: u16,
    merchant_key: Option<PathBuf>,
    dir: Option<PathBuf>,
    public_base_url: Option<String>,
    trades: Vec<TradeSpec>,
    ignore_stdin: bool,
    key_mode: KeyMode,
    alipay_key: Option<PathBuf>,
}

fn parse_args(args: impl Iterator<Item = OsString>) -> Result<Option<Options>, String> {
    use lexopt::prelude::*;
    let mut opts = Options {
        wechatpay_port: 0,
        alipay_port: 0,
        merchant_key: None,
        dir: None,
        public_base_url: None,
        trades: Vec::new(),
        ignore_stdin: false,
        key_mode: KeyMode::PublicKey,
        alipay_key: None,
    };
    let mut parser = lexopt::Parser::from_args(args);
    let port = |parser: &mut lexopt::Parser, flag: &str| -> Result<u16, String> {
        let text = crate::string_value(parser)?;
        text.parse::<u16>().map_err(|_| format!("{flag} {text:?}: expected a port from 0 to 65535"))
    };
    while let Some(arg) = parser.next().map_err(|e| e.to_string())? {
        match arg {
            Long("wechatpay-port") => opts.wechatpay_port = port(&mut parser, "--wechatpay-port")?,
            Long("alipay-port") => opts.alipay_port = port(&mut parser, "--alipay-port")?,
            Long("merchant-key") => opts.merchant_key = Some(parser.value().map_err(|e| e.to_string())?.into()),
            Long("dir") => opts.dir = Some(parser.value().map_err(|e| e.to_string())?.into()),
            Long("public-base-url") => opts.public_base_url = Some(parse_base_url(&crate::string_value(&mut parser)?)?),
            Long("trade") => opts.trades.push(parse_trade(&crate::string_value(&mut parser)?)?),
            Long("ignore-stdin") => opts.ignore_stdin = true,
            Long("key-mode") => opts.key_mode = KeyMode::parse(&crate::string_value(&mut parser)?)?,
            Long("alipay-private-key") => opts.alipay_key = Some(parser.value().map_err(|e| e.to_string())?.into()),
            Short('h') | Long("help") => {
                print!("{USAGE}");
                return Ok(None);
            }
            other => return Err(format!("{}\n\n{USAGE}", other.unexpected())),
        }
    }
    Ok(Some(opts))
}

/// An http(s) URL with a host and nothing a shell or a platform would
/// split, without its trailing `/` (payonce appends `/v1/callbacks/...`).
fn parse_base_url(text: &str) -> Result<String, String> {
    let rest = text.strip_prefix("https://").or_else(|| text.strip_prefix("http://"));
    let host = rest.map(|r| r.split(['/', '?', '#']).next().unwrap_or(""));
    let plain = text.bytes().all(|b| b.is_ascii_graphic() && !b"'\"\\?#".contains(&b));
    if host.is_none_or(str::is_empty) || !plain {
        return Err(format!(
            "--public-base-url {text:?}: expected an http:// or https:// URL, e.g. http://127.0.0.1:8080"
        ));
    }
    Ok(text.trim_end_matches('/').to_owned())
}

/// `[PLATFORM:]ORDER_NO=AMOUNT[:paid]`. Neither platform's out_trade_no
/// can hold `:` or `=`, so both separate unambiguously.
fn parse_trade(text: &str) -> Result<TradeSpec, String> {
    let wrong = || format!("--trade {text:?}: expected [wechatpay:|alipay:]ORDER_NO=AMOUNT[:paid], AMOUNT in fen");
    let (platform, rest) = match text.split_once(':') {
        Some((name, rest)) if !name.contains('=') => (platform_named(name).ok_or_else(wrong)?, rest),
        _ => (Platform::Wechatpay, text),
    };
    let (order_no, amount) = rest.split_once('=').ok_or_else(wrong)?;
    let (amount, paid) = match amount.split_once(':') {
        Some((amount, "paid")) => (amount, true),
        Some(_) => return Err(wrong()),
        None => (amount, false),
    };
    let amount = parse_amount(amount).ok_or_else(wrong)?;
    if order_no.is_empty() {
        return Err(wrong());
    }
    Ok(TradeSpec { platform, order_no: order_no.to_owned(), amount, paid })
}

fn platform_named(name: &str) -> Option<Platform> {
    match name {
        "wechatpay" => Some(Platform::Wechatpay),
        "alipay" => Some(Platform::Alipay),
        _ => None,
    }
}

/// Fen, positive.
fn parse_amount(text: &str) -> Option<i64> {
    text.parse::<i64>().ok().filter(|fen| *fen > 0)
}

/// Where the files go, and whether it is ours to remove at the end.
struct Dir {
    path: PathBuf,
    temporary: bool,
}

impl Dir {
    fn new(given: Option<&Path>) -> Result<Dir, String> {
        let (path, temporary) = match given {
            Some(path) => {
                std::fs::create_dir_all(path).map_err(|e| format!("--dir {}: {e}", path.display()))?;
                (path.to_owned(), false)
            }
            None => {
                let mut random = [0u8; 8];
                getrandom::fill(&mut random).map_err(|e| format!("no randomness from the OS: {e}"))?;
                let name: String = random.iter().map(|b| format!("{b:02x}")).collect();
                let path = std::env::temp_dir().join(format!("payonce-sim-platforms-{name}"));
                let mut builder = std::fs::DirBuilder::new();
                // It holds a private key.
                #[cfg(unix)]
                std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
                builder.create(&path).map_err(|e| format!("cannot create {}: {e}", path.display()))?;
                (path, true)
            }
        };
        // The printed flags must work from whatever directory payonce runs in.
        let path = std::fs::canonicalize(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Dir { path, temporary })
    }

    fn write(&self, name: &str, text: &str, private: bool) -> Result<PathBuf, String> {
        let path = self.path.join(name);
        let failed = |e: std::io::Error| format!("cannot write {}: {e}", path.display());
        // A fresh file, so an old one's permissions do not carry over.
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(failed(e)),
            _ => {}
        }
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        if private {
            std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        }
        #[cfg(not(unix))]
        let _ = private;
        let mut file = options.open(&path).map_err(failed)?;
        file.write_all(text.as_bytes()).map_err(failed)?;
        Ok(path)
    }
}

fn new_key(bits: usize) -> Result<RsaPrivateKey, String> {
    RsaPrivateKey::new(&mut rsa::rand_core::OsRng, bits).map_err(|e| format!("cannot generate an RSA key: {e}"))
}

struct Keys {
    merchant: RsaPrivateKey,
    /// Made for this run rather than given.
    merchant_generated: bool,
    wechatpay: RsaPrivateKey,
    alipay: RsaPrivateKey,
}

/// The merchant's key (given, or made) and the two platforms' keys, made
/// side by side: an unoptimised build takes seconds per 2048-bit key.
fn make_keys(given: Option<&Path>, alipay_given: Option<&Path>) -> Result<Keys, String> {
    let alipay_given =
        alipay_given.map(|path| private_key_from_file("--alipay-private-key", &path.to_string_lossy())).transpose()?;
    let given = match given {
        Some(path) => {
            let key = private_key_from_file("--merchant-key", &path.to_string_lossy())?;
            let bits = key.size() * 8;
            if bits < MERCHANT_KEY_BITS_MIN {
                return Err(format!(
                    "--merchant-key {}: a {bits}-bit key; payonce signs with RSA keys of {MERCHANT_KEY_BITS_MIN} bits or more",
                    path.display()
                ));
            }
            Some(key)
        }
        None => None,
    };
    let merchant_generated = given.is_none();
    let join = |handle: thread::ScopedJoinHandle<'_, Result<RsaPrivateKey, String>>| {
        handle.join().map_err(|_| "RSA key generation failed".to_owned())?
    };
    thread::scope(|scope| {
        let merchant = scope.spawn(move || given.map_or_else(|| new_key(MERCHANT_KEY_BITS_MIN), Ok));
        let wechatpay = scope.spawn(|| new_key(SIM_RSA_BITS));
        let alipay = alipay_given.map_or_else(|| new_key(SIM_RSA_BITS), Ok);
        Ok(Keys { merchant: join(merchant)?, merchant_generated, wechatpay: join(wechatpay)?, alipay: alipay? })
    })
}

/// A word a POSIX shell reads back unchanged: as is when it has nothing the
/// shell treats specially, else single-quoted.
fn shell_word(text: &str) -> String {
    let plain = !text.is_empty() && text.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:@%+,".contains(c));
    if plain {
        text.to_owned()
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

/// One line of the call log (and of `calls`).
fn call_line(platform: Platform, call: &Call) -> String {
    let api = if call.api.is_empty() { "-" } else { call.api.as_str() };
    let verified = if call.verified { "verified" } else { "UNVERIFIED" };
    let status = call.status.map_or_else(|| "unanswered".to_owned(), |s| s.to_string());
    let code = call.code.as_deref().map(|c| format!(" {c}")).unwrap_or_default();
    format!("{} {} {api} {verified} {status}{code}", platform.name(), call.http_method)
}

/// The two servers and what the commands do to them.
struct Platforms {
    wechatpay: PlatformApi,
    alipay: PlatformApi,
}

impl Platforms {
    fn get(&self, platform: Platform) -> &PlatformApi {
        match platform {
            Platform::Alipay => &self.alipay,
            _ => &self.wechatpay,
        }
    }

    fn both(&self) -> [&PlatformApi; 2] {
        [&self.wechatpay, &self.alipay]
    }

    /// A trade made out of band. Kept although payonce now makes its own
    /// trades (`POST /v1/orders/{order_no}/pay`): a merchant's account also
    /// holds trades payonce never made (made by the merchant's code before
    /// payonce made payments, or by another system on the same account),
    /// and payonce's sync, close and refund must handle those too; `--trade
    /// ORD=AMOUNT:paid` is also the shortest way to show a sync finding a
    /// payment whose notification was lost.
    fn open(&self, platform: Platform, order_no: &str, amount: i64) -> Result<(), String> {
        self.get(platform).open_trade(order_no, amount)
    }

    /// The pay_no, or why not: `refused: ...` when the platform refused the
    /// payment, `error: ...` when the command cannot say which platform.
    fn pay(&self, platform: Option<Platform>, order_no: &str) -> Result<String, String> {
        let platform = match platform {
            Some(platform) => platform,
            None => {
                let holding: Vec<&PlatformApi> =
                    self.both().into_iter().filter(|api| api.trade_state(order_no).is_some()).collect();
                match holding[..] {
                    [api] => api.platform(),
                    [] => return Err("refused: no such trade".into()),
                    _ => return Err("error: both platforms have the trade: pay wechatpay|alipay ORDER_NO".into()),
                }
            }
        };
        self.get(platform).buyer_pays(order_no).map_err(|refused| match refused {
            Refused::NoSuchTrade => "refused: no such trade".to_owned(),
            Refused::Closed => "refused: the trade is closed".to_owned(),
            Refused::AlreadyPaid { pay_no } => format!("refused: already paid ({pay_no})"),
            Refused::Expired => "refused: the trade has expired".to_owned(),
        })
    }

    fn state(&self, order_no: &str) -> String {
        let states: Vec<String> = self
            .both()
            .iter()
            .map(|api| format!("{}={}", api.platform().name(), api.trade_state(order_no).unwrap_or("none")))
            .collect();
        states.join(" ")
    }

    /// `trade PLATFORM ORDER_NO`'s line.
    fn trade(&self, platform: Platform, order_no: &str) -> String {
        let Some(trade) = self.get(platform).trade(order_no) else {
            return "none".to_owned();
        };
        let fields = serde_json::json!({
            "platform": platform.name(),
            "out_trade_no": trade.out_trade_no,
            "trade_type": trade.trade_type,
            "amount": trade.amount,
            "expires_at_ms": trade.expires_at_ms,
            "notify_url": trade.notify_url,
            "appid": trade.appid,
            "description": trade.description,
            "pay_no": trade.pay_no,
            "payment": trade.payment,
        });
        fields.to_string()
    }

    /// `prepays ORDER_NO`'s lines: `wechatpay {...}`, one per call.
    fn prepays(&self, order_no: &str) -> Vec<String> {
        let mut lines = Vec::new();
        for api in self.both() {
            let about = api.prepays().into_iter().filter(|call| call.body["out_trade_no"] == order_no);
            lines.extend(about.map(|call| format!("{} {}", api.platform().name(), call.body)));
        }
        lines
    }

    /// `refunds`' lines: `alipay ORD_1 2026... U-2026... 990 Success`.
    fn refunds(&self) -> Vec<String> {
        let mut lines = Vec::new();
        for api in self.both() {
            lines.extend(api.refunds().into_iter().map(|r| {
                let name = api.platform().name();
                format!("{name} {} {} {} {} {:?}", r.out_trade_no, r.pay_no, r.out_refund_no, r.amount, r.status)
            }));
        }
        lines
    }

    /// `settle REFUND_NO STATUS`'s answer.
    fn settle(&self, refund_no: &str, status: &str) -> String {
        let status = match status {
            "success" => RefundStatus::Success,
            "closed" => RefundStatus::Closed,
            "abnormal" => RefundStatus::Abnormal,
            other => return format!("error: status {other:?}: success, closed or abnormal"),
        };
        let holding = self.both().into_iter().find(|api| api.refunds().iter().any(|r| r.out_refund_no == refund_no));
        match holding {
            Some(api) if api.settle_refund(refund_no, status) => "ok".to_owned(),
            _ => format!("error: no refund {refund_no}"),
        }
    }

    fn calls(&self) -> Vec<String> {
        let mut lines = Vec::new();
        for api in self.both() {
            lines.extend(api.calls().iter().map(|call| call_line(api.platform(), call)));
        }
        lines
    }
}

/// What a command line asks for after it is answered.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    Continue,
    Quit,
}

/// Runs one command line, writing its answer to `out`.
fn command(platforms: &Platforms, line: &str, out: &mut impl Write) -> std::io::Result<Next> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let answer = match words[..] {
        [] => return Ok(Next::Continue),
        [first, ..] if first.starts_with('#') => return Ok(Next::Continue),
        ["open", order_no, amount] => open(platforms, Platform::Wechatpay, order_no, amount),
        ["open", platform, order_no, amount] => match platform_named(platform) {
            Some(platform) => open(platforms, platform, order_no, amount),
            None => format!("error: unknown platform {platform:?} (wechatpay, alipay)"),
        },
        ["open-url", signed] => match platforms.alipay.buyer_opens(signed) {
            Ok(out_trade_no) => out_trade_no,
            Err(e) => format!("refused: {e}"),
        },
        ["pay", order_no] => platforms.pay(None, order_no).unwrap_or_else(|e| e),
        ["pay", platform, order_no] => match platform_named(platform) {
            Some(platform) => platforms.pay(Some(platform), order_no).unwrap_or_else(|e| e),
            None => format!("error: unknown platform {platform:?} (wechatpay, alipay)"),
        },
        ["fault", platform, ref fault @ ..] => match (platform_named(platform), parse_fault(fault)) {
            (None, _) => format!("error: unknown platform {platform:?} (wechatpay, alipay)"),
            (_, Err(e)) => format!("error: {e}"),
            (Some(platform), Ok(fault)) => {
                platforms.get(platform).set_fault(fault);
                "ok".to_owned()
            }
        },
        ["state", order_no] => platforms.state(order_no),
        ["trade", platform, order_no] => match platform_named(platform) {
            Some(platform) => platforms.trade(platform, order_no),
            None => format!("error: unknown platform {platform:?} (wechatpay, alipay)"),
        },
        ["prepays", order_no] => {
            for line in platforms.prepays(order_no) {
                writeln!(out, "{line}")?;
            }
            "end".to_owned()
        }
        ["refunds"] => {
            for line in platforms.refunds() {
                writeln!(out, "{line}")?;
            }
            "end".to_owned()
        }
        ["settle", refund_no, status] => platforms.settle(refund_no, status),
        ["calls"] => {
            for line in platforms.calls() {
                writeln!(out, "{line}")?;
            }
            "end".to_owned()
        }
        ["help"] => USAGE.find("Commands on stdin").map_or(USAGE, |at| &USAGE[at..]).trim_end().to_owned(),
        ["quit"] | ["exit"] => return Ok(Next::Quit),
        [name, ..] => match name {
            "open" => "error: usage: open [wechatpay|alipay] ORDER_NO AMOUNT".to_owned(),
            "open-url" => "error: usage: open-url URL|ORDER_STRING".to_owned(),
            "pay" => "error: usage: pay [wechatpay|alipay] ORDER_NO".to_owned(),
            "fault" => "error: usage: fault wechatpay|alipay FAULT".to_owned(),
            "state" => "error: usage: state ORDER_NO".to_owned(),
            "trade" => "error: usage: trade wechatpay|alipay ORDER_NO".to_owned(),
            "prepays" => "error: usage: prepays ORDER_NO".to_owned(),
            "settle" => "error: usage: settle REFUND_NO success|closed|abnormal".to_owned(),
            "refunds" | "calls" | "help" | "quit" | "exit" => format!("error: {name} takes no arguments"),
            _ => format!("error: unknown command {name:?}; `help` lists them"),
        },
    };
    writeln!(out, "{answer}")?;
    out.flush()?;
    Ok(Next::Continue)
}

fn open(platforms: &Platforms, platform: Platform, order_no: &str, amount: &str) -> String {
    let Some(amount) = parse_amount(amount) else {
        return format!("error: amount {amount:?}: a positive integer of fen");
    };
    match platforms.open(platform, order_no, amount) {
        Ok(()) => "ok".to_owned(),
        Err(e) => format!("error: {e}"),
    }
}

fn parse_fault(words: &[&str]) -> Result<Option<Fault>, String> {
    Ok(Some(match words {
        ["none"] => return Ok(None),
        ["refuse"] => Fault::Refuse,
        ["hang"] => Fault::Hang,
        ["5xx"] => Fault::ServerError,
        ["slow", ms] => match ms.parse::<u64>() {
            Ok(ms) if ms <= 600_000 => Fault::Slow(Duration::from_millis(ms)),
            _ => return Err(format!("slow {ms:?}: milliseconds from 0 to 600000")),
        },
        ["delay", ms] => match ms.parse::<u64>() {
            Ok(ms) if ms <= 600_000 => Fault::Delay(Duration::from_millis(ms)),
            _ => return Err(format!("delay {ms:?}: milliseconds from 0 to 600000")),
        },
        ["tamper"] => Fault::TamperAnswers,
        ["wrong-merchant"] => Fault::WrongMerchant,
        ["wrong-trade"] => Fault::WrongTrade,
        _ => {
            return Err(format!(
                "fault {:?}: one of refuse, hang, 5xx, slow MS, delay MS, tamper, wrong-merchant, wrong-trade, none",
                words.join(" ")
            ))
        }
    }))
}

/// `payonce-sim platforms ARGS`: exit 0 once stopped; `Err` (exit 2) on errors.
pub fn run(args: impl Iterator<Item = OsString>) -> Result<ExitCode, String> {
    let Some(opts) = parse_args(args)? else {
        return Ok(ExitCode::SUCCESS);
    };
    let stop = Arc::new(AtomicBool::new(false));
    // From the start, so a Ctrl-C while the keys are made still removes the
    // temporary directory.
    payonce::background::handle_signals(&stop, None).map_err(|e| format!("cannot handle signals: {e}"))?;
    // Before the keys, which take a while: a bad --dir fails at once.
    let dir = Dir::new(opts.dir.as_deref())?;
    let result = serve(&opts, &dir, &stop);
    if dir.temporary {
        let _ = std::fs::remove_dir_all(&dir.path);
    }
    result
}

fn serve(opts: &Options, dir: &Dir, stop: &AtomicBool) -> Result<ExitCode, String> {
    let started = Instant::now();
    let keys = make_keys(opts.merchant_key.as_deref(), opts.alipay_key.as_deref())?;
    let keys_s = started.elapsed().as_secs_f64();
    if stop.load(Ordering::SeqCst) {
        eprintln!("payonce-sim platforms: stopping (a signal)");
        return Ok(ExitCode::SUCCESS);
    }
    let merchant_public = keys.merchant.to_public_key();
    let notify_url = |platform: Platform| {
        opts.public_base_url.as_ref().map(|base| format!("{base}/v1/callbacks/{}", platform.name()))
    };
    let wechatpay = PlatformApi::start_wechatpay(WechatpayApiConfig {
        platform_key: Some(keys.wechatpay),
        port: opts.wechatpay_port,
        expected_notify_url: notify_url(Platform::Wechatpay),
        ..WechatpayApiConfig::new(MERCHANT_SERIAL, merchant_public.clone())
    })?;
    let certificates = match opts.key_mode {
        KeyMode::PublicKey => None,
        KeyMode::Certificate => {
            Some(AlipayCerts::make(&keys.alipay.to_public_key(), &merchant_public, &keys.merchant)?)
        }
    };
    let alipay = PlatformApi::start_alipay(AlipayApiConfig {
        alipay_key: Some(keys.alipay),
        port: opts.alipay_port,
        expected_notify_url: notify_url(Platform::Alipay),
        certificates: certificates.as_ref().map(|c| c.sns.clone()),
        ..AlipayApiConfig::new(merchant_public)
    })?;
    let merchant_file = match &opts.merchant_key {
        Some(path) => std::fs::canonicalize(path).map_err(|e| format!("--merchant-key {}: {e}", path.display()))?,
        None => {
            let pem = keys.merchant.to_pkcs8_pem(LineEnding::LF).map_err(|e| format!("cannot encode the key: {e}"))?;
            dir.write(MERCHANT_KEY_FILE, &pem, true)?
        }
    };
    let wechatpay_file = dir.write(WECHATPAY_KEY_FILE, &wechatpay.platform_public_key_pem()?, false)?;
    // Alipay's key: its public key, or (certificate mode) the three certificates.
    let path = |p: &Path| shell_word(&p.to_string_lossy());
    let alipay_flags = match &certificates {
        None => {
            vec![("--alipay-public-key", path(&dir.write(ALIPAY_KEY_FILE, &alipay.platform_public_key_pem()?, false)?))]
        }
        Some(certs) => vec![
            ("--alipay-app-cert", path(&dir.write(APP_CERT_FILE, &certs.app_cert_pem, false)?)),
            ("--alipay-public-cert", path(&dir.write(PUBLIC_CERT_FILE, &certs.alipay_cert_pem, false)?)),
            ("--alipay-root-cert", path(&dir.write(ROOT_CERT_FILE, &certs.root_pem, false)?)),
        ],
    };

    let platforms = Platforms { wechatpay, alipay };
    for trade in &opts.trades {
        platforms.open(trade.platform, &trade.order_no, trade.amount).map_err(|e| format!("--trade: {e}"))?;
        let paid = if trade.paid {
            let pay_no = platforms.pay(Some(trade.platform), &trade.order_no).map_err(|e| format!("--trade: {e}"))?;
            format!(", paid as {pay_no}")
        } else {
            String::new()
        };
        eprintln!("{}: trade {} of {} fen{paid}", trade.platform.name(), trade.order_no, trade.amount);
    }
    for api in platforms.both() {
        let platform = api.platform();
        api.on_call(move |call| eprintln!("{}", call_line(platform, call)));
    }

    let serial = platforms.wechatpay.platform_serial().unwrap_or_default();
    let mut flags = vec![
        ("--wechatpay-mchid", shell_word(platforms.wechatpay.merchant_id())),
        ("--wechatpay-merchant-serial", shell_word(MERCHANT_SERIAL)),
        ("--wechatpay-merchant-key", path(&merchant_file)),
        ("--wechatpay-public-key", shell_word(&format!("{serial}={}", wechatpay_file.to_string_lossy()))),
        ("--wechatpay-api-base", platforms.wechatpay.endpoint()),
        // The app bound to the simulated merchant: payonce makes no WeChat
        // Pay payment without one.
        ("--wechatpay-appid", shell_word(WECHATPAY_APPID)),
        ("--alipay-app-id", shell_word(platforms.alipay.merchant_id())),
        ("--alipay-app-private-key", path(&merchant_file)),
    ];
    flags.extend(alipay_flags);
    flags.push(("--alipay-gateway", platforms.alipay.endpoint()));
    if let Some(base) = &opts.public_base_url {
        flags.push(("--public-base-url", shell_word(base)));
    }
    let mut out = std::io::stdout().lock();
    for (flag, value) in &flags {
        writeln!(out, "{flag} {value}").map_err(|e| format!("stdout: {e}"))?;
    }
    writeln!(out, "ready").and_then(|()| out.flush()).map_err(|e| format!("stdout: {e}"))?;
    drop(out);
    let made = if keys.merchant_generated { "the merchant key and " } else { "" };
    eprintln!(
        "payonce-sim platforms: WeChat Pay on {}, Alipay on {}; {made}the platform keys in {} ({keys_s:.1} s)",
        platforms.wechatpay.base_url(),
        platforms.alipay.endpoint(),
        dir.path.display()
    );

    let (lines, commands) = mpsc::channel::<String>();
    // Kept here when stdin is ignored, so the channel never reports it closed.
    let _kept = if opts.ignore_stdin {
        Some(lines)
    } else {
        thread::Builder::new()
            .name("commands".into())
            .spawn(move || {
                // Bytes, not `lines()`: a stray non-UTF-8 byte is a bad
                // command, not the end of stdin.
                for line in std::io::stdin().lock().split(b'\n') {
                    let Ok(line) = line else { break };
                    if lines.send(String::from_utf8_lossy(&line).into_owned()).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| format!("cannot start the command reader: {e}"))?;
        None
    };
    let why = loop {
        if stop.load(Ordering::SeqCst) {
            break "a signal";
        }
        match commands.recv_timeout(POLL) {
            Ok(line) => {
                let next = command(&platforms, &line, &mut std::io::stdout().lock());
                match next {
                    Ok(Next::Continue) => {}
                    Ok(Next::Quit) => break "quit",
                    // Nobody reads the answers any more.
                    Err(_) => break "stdout closed",
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break "stdin closed",
        }
    };
    eprintln!("payonce-sim platforms: stopping ({why})");
    drop(platforms);
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trades_name_their_platform_amount_and_payment() {
        let t = parse_trade("ORD_T1=1000:paid").expect("trade");
        assert_eq!((t.platform, t.order_no.as_str(), t.amount, t.paid), (Platform::Wechatpay, "ORD_T1", 1000, true));
        let t = parse_trade("alipay:ORD_2=5").expect("trade");
        assert_eq!((t.platform, t.order_no.as_str(), t.amount, t.paid), (Platform::Alipay, "ORD_2", 5, false));
        let t = parse_trade("wechatpay:ORD-3=7:paid").expect("trade");
        assert_eq!((t.platform, t.amount, t.paid), (Platform::Wechatpay, 7, true));
        for bad in ["ORD", "ORD=", "ORD=0", "ORD=-5", "ORD=1:unpaid", "paypal:ORD=1", "=100", "ORD=1.5"] {
            assert!(parse_trade(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_public_base_url_is_an_http_url_without_its_trailing_slash() {
        assert_eq!(parse_base_url("http://127.0.0.1:8080/"), Ok("http://127.0.0.1:8080".to_owned()));
        assert_eq!(parse_base_url("https://shop.example/pay"), Ok("https://shop.example/pay".to_owned()));
        for bad in ["127.0.0.1:8080", "ftp://shop", "http://", "https:///x", "http://a b", "http://a?x=1", "http://a'"]
        {
            assert!(parse_base_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn flag_values_survive_a_shell() {
        assert_eq!(shell_word("/tmp/a/merchant-key.pem"), "/tmp/a/merchant-key.pem");
        assert_eq!(shell_word("PUB_KEY_ID_SIMULATOR=/tmp/x.pem"), "PUB_KEY_ID_SIMULATOR=/tmp/x.pem");
        assert_eq!(shell_word("/tmp/my keys/k.pem"), "'/tmp/my keys/k.pem'");
        assert_eq!(shell_word("/tmp/it's"), r"'/tmp/it'\''s'");
    }

    #[test]
    fn faults_are_named_as_in_the_help() {
        assert_eq!(parse_fault(&["none"]), Ok(None));
        assert_eq!(parse_fault(&["5xx"]), Ok(Some(Fault::ServerError)));
        assert_eq!(parse_fault(&["slow", "250"]), Ok(Some(Fault::Slow(Duration::from_millis(250)))));
        assert!(parse_fault(&["slow"]).is_err());
        assert!(parse_fault(&["slow", "soon"]).is_err());
        assert!(parse_fault(&["broken"]).is_err());
        assert_eq!(parse_fault(&["delay", "250"]), Ok(Some(Fault::Delay(Duration::from_millis(250)))));
        assert!(parse_fault(&["delay", "600001"]).is_err());
        for word in ["refuse", "hang", "5xx", "slow MS", "delay MS", "tamper", "wrong-merchant", "wrong-trade", "none"]
        {
            assert!(USAGE.contains(word), "{word} documented");
        }
    }
}
