//! Real `payonce serve` processes pointed at a running `payonce-sim
//! platforms` (tests/prepay.rs, tests/unwanted.rs): the `payonce` binary
//! beside `payonce-sim`, started with every flag the simulator printed,
//! SIGKILLed when asked (and on drop).
//!
//! The `payonce` binary belongs to another package: `cargo test -p
//! payonce-sim` does not build it, `make test` (`cargo test --workspace`)
//! does. The tests use the one beside `payonce-sim`, and skip, loudly,
//! when it is missing or older than the service's sources (in CI they
//! fail instead).

use super::platforms_sim::Sim;
use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, SystemTime};

/// payonce's merchant key fixture (2048 bits: ring signs with no less):
/// given, so the simulator makes no merchant key, which an unoptimised
/// build takes seconds for.
pub const MERCHANT_KEY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/keys/merchant.pem");
pub const PUBLIC_BASE_URL: &str = "https://shop.example";
const HTTP_TIMEOUT: Duration = Duration::from_secs(30);

/// The `payonce` binary beside `payonce-sim`, when it is there and built
/// after every source it is made of was last changed; else why not.
pub fn find_payonce() -> Result<PathBuf, String> {
    let exe =
        Path::new(env!("CARGO_BIN_EXE_payonce-sim")).with_file_name(format!("payonce{}", std::env::consts::EXE_SUFFIX));
    let built =
        std::fs::metadata(&exe).and_then(|m| m.modified()).map_err(|_| format!("{} is not built", exe.display()))?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let root = std::fs::canonicalize(&root).unwrap_or(root);
    let mut newest: Option<(SystemTime, PathBuf)> = None;
    let mut pending: Vec<PathBuf> = ["src", "migrations", "console", "Cargo.toml", "Cargo.lock"]
        .iter()
        .map(|p| root.join(p))
        .chain(["schema.sql", "schema.postgres.sql"].iter().map(|p| root.join(p)))
        .collect();
    while let Some(path) = pending.pop() {
        let Ok(meta) = std::fs::metadata(&path) else { continue };
        if meta.is_dir() {
            let entries = std::fs::read_dir(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            pending.extend(entries.filter_map(|e| e.ok()).map(|e| e.path()));
        } else if let Ok(modified) = meta.modified() {
            if newest.as_ref().is_none_or(|(at, _)| modified > *at) {
                newest = Some((modified, path));
            }
        }
    }
    match newest {
        Some((at, path)) if at > built => {
            Err(format!("{} is older than {}: a stale build", exe.display(), path.display()))
        }
        _ => Ok(exe),
    }
}

/// [`find_payonce`], once; `None` (said on stderr) means skip, outside CI.
pub fn payonce_binary() -> Option<PathBuf> {
    static FOUND: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match FOUND.get_or_init(find_payonce) {
        Ok(exe) => Some(exe.clone()),
        Err(why) => {
            assert!(std::env::var_os("CI").is_none(), "{why}; CI builds it (cargo test --workspace)");
            // Straight to fd 2: the harness captures eprintln! of a test that passes.
            let _ = writeln!(
                std::io::stderr(),
                "=== {why}: the `payonce serve` tests of sim/tests (prepay.rs, unwanted.rs) are SKIPPED \
                 (make test, or cargo build --bin payonce first) ==="
            );
            None
        }
    }
}

/// The simulated platforms, expecting payonce's notify_urls under
/// [`PUBLIC_BASE_URL`], which they print among the flags.
pub fn platforms() -> Sim {
    let sim = Sim::start(&["--merchant-key", MERCHANT_KEY, "--public-base-url", PUBLIC_BASE_URL]);
    assert_eq!(sim.flag("--public-base-url"), PUBLIC_BASE_URL);
    assert_eq!(sim.flag("--wechatpay-appid"), "wxsimulatorpayonce");
    sim
}

/// A `payonce serve` on `db`, configured with every flag `sim` printed;
/// SIGKILLed on drop, its stderr shown if the test failed.
pub struct Serve {
    child: Child,
    pub addr: SocketAddr,
    log: PathBuf,
}

impl Serve {
    pub fn start(exe: &Path, db: &Path, sim: &Sim, extra: &[&str], env: &[(&str, &str)]) -> Serve {
        Serve::start_flags(exe, db, &sim.flags, extra, env)
    }

    /// [`Serve::start`] with these flags instead of the simulator's.
    pub fn start_flags(
        exe: &Path,
        db: &Path,
        flags: &[(String, String)],
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Serve {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let log = db.with_file_name(format!("serve-{n}.log"));
        let mut command = Command::new(exe);
        command.args(["serve", "--listen", "127.0.0.1:0", "--callback-secret", "test-secret", "--db"]).arg(db);
        for (flag, value) in flags {
            command.args([flag, value]);
        }
        let mut child = command
            .args(extra)
            .env_remove("PAYONCE_TEST_HOLD_AFTER_PREPAY_MS")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(std::fs::File::create(&log).expect("the log file")))
            .spawn()
            .expect("start payonce serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("its first line");
        let Some(addr) = line.trim().strip_prefix("listening on http://").and_then(|a| a.parse().ok()) else {
            let _ = child.kill();
            let stderr = std::fs::read_to_string(&log).unwrap_or_default();
            panic!("payonce serve did not start: {line:?}\n{stderr}");
        };
        Serve { child, addr, log }
    }

    pub fn call(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Vec<u8>) {
        request(self.addr, method, path, body).unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    /// What it logged so far (its stderr).
    #[allow(dead_code)]
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.kill();
        if thread::panicking() {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            eprintln!("---- payonce serve stderr ({}) ----\n{text}---- end ----", self.log.display());
        }
    }
}

pub fn request(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> Result<(u16, Vec<u8>), String> {
    let text = body.map(Value::to_string).unwrap_or_default();
    let headers: &[(&str, &str)] = if body.is_some() { &[("Content-Type", "application/json")] } else { &[] };
    let reply = payonce_testclient::request(addr, method, path, headers, text.as_bytes(), HTTP_TIMEOUT)
        .map_err(|e| e.to_string())?;
    Ok((reply.status, reply.body))
}

pub fn json_of(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(bytes)))
}
