//! `payonce serve`'s settings: one table of every setting (its flag, whether
//! it takes a value, where the value goes and how it is checked), the
//! defaults and environment variables under them, the `--config` TOML file
//! read through the same table ([`Settings::assemble`]: flag > file >
//! environment > default), the secrets read from their `*-file` settings,
//! and [`Settings::check`], which reads each key file once and builds the
//! checked [`Config`] with the rest of what `serve` wires. `main.rs` only
//! lexes the command line (docs/settings.md lists every setting).

use crate::app::{ApiToken, Config, IDEMPOTENCY_TTL_S_DEFAULT, ORDER_TTL_S_DEFAULT};
use crate::background::{INSPECT_INTERVAL_S_DEFAULT, SWEEP_INTERVAL_S_DEFAULT};
use crate::domain::{is_identifier, Rewards};
use crate::held::{Held, ReloadSecret, SecretFile};
use crate::http::{Limits, WORKERS_DEFAULT};
use crate::platform_ops::Platforms;
use crate::platforms::{alipay, wechatpay, Parts, PlatformSettings, Registry};
use crate::store::StoreOptions;
use crate::webhook::{parse_endpoint, parse_retry_schedule, parse_secrets, parse_waits, WebhookConfig};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

mod file;

/// `--refund-unwanted auto|manual`, as [`Config::refund_unwanted`] holds it.
pub use crate::domain::RefundUnwanted;

/// The fixed secret of `--dev`; printed loudly, never for production.
pub const DEV_CALLBACK_SECRET: &str = "payonce-dev-secret";

/// The longest timeout a setting takes: one day.
const TIMEOUT_MS_MAX: u64 = 86_400_000;

/// Every setting as given, before the key files it names are read (the
/// secret files are read by [`Settings::assemble`]). `Debug` prints secrets:
/// it is for tests comparing two ways of giving the same settings.
#[derive(Debug)]
pub struct Settings {
    pub db: String,
    pub listen: String,
    /// `--metrics-listen`: a listener of its own for `GET /metrics`, without a token.
    pub metrics_listen: Option<String>,
    callback_secret: Option<String>,
    pub dev: bool,
    coupons: Vec<String>,
    points_per_yuan: i64,
    order_ttl_s: i64,
    pub sweep_interval_s: u64,
    pub store: StoreOptions,
    api_tokens: Option<String>,
    idempotency_ttl_s: i64,
    pub inspect_interval_s: u64,
    wechatpay_apiv3_key: Option<String>,
    wechatpay_public_keys: Vec<String>,
    alipay_public_key: Option<String>,
    alipay_app_cert: Option<String>,
    alipay_public_cert: Option<String>,
    alipay_root_cert: Option<String>,
    alipay_app_id: Option<String>,
    pub limits: Limits,
    pub workers: usize,
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
    wechatpay_appids: Vec<String>,
    wechatpay_platform_certs: bool,
    wechatpay_cert_refresh_s: u64,
    wechatpay_cert_unknown_serial_interval_s: u64,
    prepay_reuse_s: i64,
    refund_unwanted: RefundUnwanted,
    /// `--log-format`: `main` sets it before anything logs.
    pub log_format: crate::log::LogFormat,
    /// The secrets given as values (flag or config key), by setting name.
    secret_values: Vec<&'static str>,
    /// The `*-file` settings given: (the secret's setting name, the path).
    secret_files: Vec<(&'static str, String)>,
    /// The same, once read: what `SIGHUP` reads again.
    secret_files_read: Vec<(&'static Secret, String)>,
}

/// One setting: its flag without `--` (also its key in the `--config`
/// file), whether it takes a value, whether it may be given several times
/// (a list in the file), and what it does with the value (`""` for a switch).
pub struct Setting {
    pub name: &'static str,
    pub takes_value: bool,
    pub repeatable: bool,
    set: fn(&mut Settings, &str) -> Result<(), String>,
}

impl Setting {
    /// Applies `value` (`""` for a switch), or says why it is refused,
    /// naming the flag.
    pub fn apply(&self, settings: &mut Settings, value: &str) -> Result<(), String> {
        (self.set)(settings, value)
    }
}

const fn setting(name: &'static str, set: fn(&mut Settings, &str) -> Result<(), String>) -> Setting {
    Setting { name, takes_value: true, repeatable: false, set }
}

/// A setting given once per value (`--coupon A --coupon B`; `coupon = ["A", "B"]`).
const fn list(name: &'static str, set: fn(&mut Settings, &str) -> Result<(), String>) -> Setting {
    Setting { name, takes_value: true, repeatable: true, set }
}

const fn switch(name: &'static str, set: fn(&mut Settings, &str) -> Result<(), String>) -> Setting {
    Setting { name, takes_value: false, repeatable: false, set }
}

/// Every setting of `serve` (and of `sync`, which takes the same).
pub const SETTINGS: &[Setting] = &[
    setting("db", |s, v| text(&mut s.db, v)),
    setting("listen", |s, v| text(&mut s.listen, v)),
    setting("metrics-listen", |s, v| some(&mut s.metrics_listen, v)),
    setting("callback-secret", |s, v| secret(s, "callback-secret", v)),
    setting("callback-secret-file", |s, v| secret_file(s, "callback-secret", v)),
    switch("dev", |s, _| {
        s.dev = true;
        Ok(())
    }),
    setting("api-token", |s, v| secret(s, "api-token", v)),
    setting("api-token-file", |s, v| secret_file(s, "api-token", v)),
    setting("idempotency-ttl-s", |s, v| int_into(&mut s.idempotency_ttl_s, "idempotency-ttl-s", v, 1, 365 * 86_400)),
    list("coupon", |s, v| {
        if !is_identifier(v) {
            return Err(format!("--coupon {v:?}: 1-64 characters of [A-Za-z0-9_.-]"));
        }
        s.coupons.push(v.to_owned());
        Ok(())
    }),
    setting("points-per-yuan", |s, v| int_into(&mut s.points_per_yuan, "points-per-yuan", v, 0, 1_000_000)),
    setting("order-ttl-s", |s, v| int_into(&mut s.order_ttl_s, "order-ttl-s", v, 1, 86_400)),
    setting("wechatpay-apiv3-key", |s, v| secret(s, "wechatpay-apiv3-key", v)),
    setting("wechatpay-apiv3-key-file", |s, v| secret_file(s, "wechatpay-apiv3-key", v)),
    // No `--webhook-secret`: its value is PAYONCE_WEBHOOK_SECRET or this file.
    setting("webhook-secret-file", |s, v| secret_file(s, "webhook-secret", v)),
    list("wechatpay-public-key", |s, v| {
        s.wechatpay_public_keys.push(v.to_owned());
        Ok(())
    }),
    setting("alipay-public-key", |s, v| some(&mut s.alipay_public_key, v)),
    setting("alipay-app-cert", |s, v| some(&mut s.alipay_app_cert, v)),
    setting("alipay-public-cert", |s, v| some(&mut s.alipay_public_cert, v)),
    setting("alipay-root-cert", |s, v| some(&mut s.alipay_root_cert, v)),
    setting("alipay-app-id", |s, v| some(&mut s.alipay_app_id, v)),
    setting("inspect-interval-s", |s, v| unsigned(&mut s.inspect_interval_s, "inspect-interval-s", v, 1, 86_400)),
    setting("db-pool-size", |s, v| {
        s.store.pool_size = u32::try_from(int("db-pool-size", v, 2, 1_000)?).unwrap_or(u32::MAX);
        Ok(())
    }),
    setting("group-commit-max", |s, v| {
        s.store.group_commit_max = usize::try_from(int("group-commit-max", v, 1, 10_000)?).unwrap_or(usize::MAX);
        Ok(())
    }),
    setting("group-commit-wait-us", |s, v| {
        unsigned(&mut s.store.group_commit_wait_us, "group-commit-wait-us", v, 0, 1_000_000)
    }),
    setting("db-busy-timeout-ms", |s, v| unsigned(&mut s.store.busy_timeout_ms, "db-busy-timeout-ms", v, 1, 600_000)),
    setting("db-connect-timeout-ms", |s, v| {
        unsigned(&mut s.store.connect_timeout_ms, "db-connect-timeout-ms", v, 1, 600_000)
    }),
    setting("db-statement-timeout-ms", |s, v| {
        unsigned(&mut s.store.statement_timeout_ms, "db-statement-timeout-ms", v, 1, 86_400_000)
    }),
    setting("sweep-interval-s", |s, v| unsigned(&mut s.sweep_interval_s, "sweep-interval-s", v, 1, 86_400)),
    setting("max-connections", |s, v| {
        s.limits.max_connections = usize::try_from(positive("max-connections", v, 1_000_000)?).unwrap_or(usize::MAX);
        Ok(())
    }),
    setting("header-read-timeout-ms", |s, v| {
        timeout(&mut s.limits.header_read_timeout_ms, "header-read-timeout-ms", v)
    }),
    setting("body-read-timeout-ms", |s, v| timeout(&mut s.limits.body_read_timeout_ms, "body-read-timeout-ms", v)),
    setting("keep-alive-idle-ms", |s, v| timeout(&mut s.limits.keep_alive_idle_ms, "keep-alive-idle-ms", v)),
    setting("response-write-timeout-ms", |s, v| {
        timeout(&mut s.limits.response_write_timeout_ms, "response-write-timeout-ms", v)
    }),
    setting("fd-reserve", |s, v| unsigned(&mut s.limits.fd_reserve, "fd-reserve", v, 0, 1_000_000)),
    setting("shutdown-grace-ms", |s, v| timeout(&mut s.limits.shutdown_grace_ms, "shutdown-grace-ms", v)),
    setting("workers", |s, v| {
        s.workers = usize::try_from(positive("workers", v, 1024)?).unwrap_or(usize::MAX);
        Ok(())
    }),
    list("webhook-url", |s, v| {
        let endpoint = parse_endpoint(v)?;
        if !s.webhooks.endpoints.contains(&endpoint) {
            s.webhooks.endpoints.push(endpoint);
        }
        Ok(())
    }),
    setting("webhook-timeout-ms", |s, v| timeout(&mut s.webhooks.timeout_ms, "webhook-timeout-ms", v)),
    setting("webhook-retry-s", |s, v| {
        s.webhooks.retry_schedule_ms = parse_retry_schedule(v)?;
        Ok(())
    }),
    setting("webhook-concurrency", |s, v| {
        s.webhooks.concurrency = usize::try_from(positive("webhook-concurrency", v, 256)?).unwrap_or(usize::MAX);
        Ok(())
    }),
    setting("webhook-poll-ms", |s, v| {
        s.webhooks.poll_ms = positive("webhook-poll-ms", v, 60_000)?;
        Ok(())
    }),
    setting("wechatpay-mchid", |s, v| some(&mut s.wechatpay_mchid, v)),
    setting("wechatpay-merchant-serial", |s, v| some(&mut s.wechatpay_merchant_serial, v)),
    setting("wechatpay-merchant-key", |s, v| some(&mut s.wechatpay_merchant_key, v)),
    setting("wechatpay-platform-certs", |s, v| {
        s.wechatpay_platform_certs = match v {
            "auto" => true,
            "off" => false,
            _ => return Err(format!("--wechatpay-platform-certs {v:?}: expected auto or off")),
        };
        Ok(())
    }),
    setting("wechatpay-cert-refresh-s", |s, v| {
        unsigned(&mut s.wechatpay_cert_refresh_s, "wechatpay-cert-refresh-s", v, 1, 30 * 86_400)
    }),
    setting("wechatpay-cert-unknown-serial-interval-s", |s, v| {
        unsigned(
            &mut s.wechatpay_cert_unknown_serial_interval_s,
            "wechatpay-cert-unknown-serial-interval-s",
            v,
            0,
            86_400,
        )
    }),
    setting("wechatpay-api-base", |s, v| {
        s.wechatpay_api_base = http_url("wechatpay-api-base", v)?;
        Ok(())
    }),
    setting("alipay-app-private-key", |s, v| some(&mut s.alipay_app_private_key, v)),
    setting("alipay-gateway", |s, v| {
        s.alipay_gateway = http_url("alipay-gateway", v)?;
        Ok(())
    }),
    setting("platform-retry-s", |s, v| {
        s.platform_retry_ms = parse_waits("--platform-retry-s", v)?;
        Ok(())
    }),
    setting("refund-query-after-s", |s, v| {
        int_into(&mut s.refund_query_after_s, "refund-query-after-s", v, 1, 30 * 86_400)
    }),
    setting("public-base-url", |s, v| {
        s.public_base_url = Some(http_url("public-base-url", v)?);
        Ok(())
    }),
    setting("close-give-up-s", |s, v| int_into(&mut s.close_give_up_s, "close-give-up-s", v, 1, 365 * 86_400)),
    setting("platform-timeout-ms", |s, v| timeout(&mut s.platform_timeout_ms, "platform-timeout-ms", v)),
    setting("log-format", |s, v| {
        s.log_format = crate::log::LogFormat::parse(v).ok_or_else(|| format!("--log-format {v:?}: logfmt or json"))?;
        Ok(())
    }),
    setting("refund-unwanted", |s, v| {
        s.refund_unwanted =
            RefundUnwanted::parse(v).ok_or_else(|| format!("--refund-unwanted {v:?}: auto or manual"))?;
        Ok(())
    }),
    list("wechatpay-appid", |s, v| {
        // WeChat's appids are `wx` and 16 hex digits; payonce checks only
        // that it can send one, and WeChat Pay refuses an appid not bound
        // to the mchid (APPID_MCHID_NOT_MATCH, answered as platform_refused).
        if v.is_empty() || v.len() > 32 || !v.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Err(format!("--wechatpay-appid {v:?}: 1-32 characters of [A-Za-z0-9]"));
        }
        if !s.wechatpay_appids.iter().any(|a| a == v) {
            s.wechatpay_appids.push(v.to_owned());
        }
        Ok(())
    }),
    // At most 7000: WeChat's prepay_id lives 7200 s from its creation, and
    // an answer handed out near the end leaves the buyer no time to pay.
    setting("prepay-reuse-s", |s, v| int_into(&mut s.prepay_reuse_s, "prepay-reuse-s", v, 0, 7_000)),
];

/// The setting whose flag is `--name`.
pub fn setting_named(name: &str) -> Option<&'static Setting> {
    SETTINGS.iter().find(|s| s.name == name)
}

fn text(into: &mut String, value: &str) -> Result<(), String> {
    value.clone_into(into);
    Ok(())
}

/// A secret given as a value: where it goes, and that it was given so a
/// `*-file` form of the same secret is refused beside it.
fn secret(s: &mut Settings, name: &'static str, value: &str) -> Result<(), String> {
    if let Some(known) = SECRETS.iter().find(|x| x.name == name) {
        *(known.field)(s) = Some(value.to_owned());
    }
    if !s.secret_values.contains(&name) {
        s.secret_values.push(name);
    }
    Ok(())
}

/// A secret's `*-file` setting: the path, read by [`Settings::assemble`]
/// once every source is applied (a later one replaces an earlier one).
fn secret_file(s: &mut Settings, name: &'static str, path: &str) -> Result<(), String> {
    if path.is_empty() {
        return Err(format!("--{name}-file: expected a file name"));
    }
    s.secret_files.retain(|(n, _)| *n != name);
    s.secret_files.push((name, path.to_owned()));
    Ok(())
}

/// A secret payonce takes from a value, its environment variable or a file.
#[derive(Debug)]
struct Secret {
    name: &'static str,
    /// The setting that gives it as a file.
    file_setting: &'static str,
    /// Several entries (comma-separated in the value; one per line or
    /// comma-separated in the file), or one.
    list: bool,
    field: fn(&mut Settings) -> &mut Option<String>,
}

const SECRETS: &[Secret] = &[
    Secret {
        name: "callback-secret",
        file_setting: "callback-secret-file",
        list: true,
        field: |s| &mut s.callback_secret,
    },
    Secret { name: "api-token", file_setting: "api-token-file", list: true, field: |s| &mut s.api_tokens },
    Secret {
        name: "wechatpay-apiv3-key",
        file_setting: "wechatpay-apiv3-key-file",
        list: false,
        field: |s| &mut s.wechatpay_apiv3_key,
    },
    Secret {
        name: "webhook-secret",
        file_setting: "webhook-secret-file",
        list: true,
        field: |s| &mut s.webhook_secret,
    },
];

/// The secrets given as values, by setting name: the `--config` file that
/// holds one is checked like a secret file.
fn is_secret_value(name: &str) -> bool {
    SECRETS.iter().any(|s| s.name == name)
}

/// A secret's file, read and checked as `crate::held::read_secret_file` says.
fn read_secret_file(secret: &Secret, path: &str, warnings: &mut Vec<String>) -> Result<String, String> {
    crate::held::read_secret_file(secret.file_setting, path, secret.list, warnings)
}

fn some(into: &mut Option<String>, value: &str) -> Result<(), String> {
    *into = Some(value.to_owned());
    Ok(())
}

fn int(flag: &str, value: &str, min: i64, max: i64) -> Result<i64, String> {
    match value.parse::<i64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(format!("--{flag} {value:?}: expected an integer from {min} to {max}")),
    }
}

fn int_into(into: &mut i64, flag: &str, value: &str, min: i64, max: i64) -> Result<(), String> {
    *into = int(flag, value, min, max)?;
    Ok(())
}

fn unsigned(into: &mut u64, flag: &str, value: &str, min: i64, max: i64) -> Result<(), String> {
    *into = int(flag, value, min, max)?.unsigned_abs();
    Ok(())
}

/// An integer from 1 to `max`.
fn positive(flag: &str, value: &str, max: u64) -> Result<u64, String> {
    Ok(int(flag, value, 1, i64::try_from(max).unwrap_or(i64::MAX))?.unsigned_abs())
}

fn timeout(into: &mut u64, flag: &str, value: &str) -> Result<(), String> {
    *into = positive(flag, value, TIMEOUT_MS_MAX)?;
    Ok(())
}

/// An `http://` or `https://` base URL.
fn http_url(flag: &str, url: &str) -> Result<String, String> {
    if url.starts_with("http://") || url.starts_with("https://") {
        Ok(url.to_owned())
    } else {
        Err(format!("--{flag} {url:?}: expected an http:// or https:// URL"))
    }
}

/// A non-empty environment variable.
fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// `PAYONCE_DB`: the database when `--db` is not given, so a PostgreSQL
/// password need not appear on a command line.
pub fn db_from_env() -> Option<String> {
    env("PAYONCE_DB")
}

impl Settings {
    /// The defaults, with the secrets and the database taken from the
    /// environment where set (a flag given later wins).
    pub fn from_env() -> Result<Settings, String> {
        Settings::defaults_with(&env)
    }

    /// The defaults, with the secrets and the database from `env` (the
    /// process's environment, or a test's).
    pub fn defaults_with(env: &dyn Fn(&str) -> Option<String>) -> Result<Settings, String> {
        let env = |name: &str| env(name).filter(|v| !v.trim().is_empty());
        Ok(Settings {
            db: env("PAYONCE_DB").unwrap_or_else(|| "payonce.db".into()),
            listen: "127.0.0.1:8080".into(),
            metrics_listen: None,
            callback_secret: env("PAYONCE_CALLBACK_SECRET"),
            dev: false,
            coupons: Vec::new(),
            points_per_yuan: 0,
            order_ttl_s: ORDER_TTL_S_DEFAULT,
            sweep_interval_s: SWEEP_INTERVAL_S_DEFAULT,
            store: StoreOptions::default(),
            api_tokens: env("PAYONCE_API_TOKEN"),
            idempotency_ttl_s: IDEMPOTENCY_TTL_S_DEFAULT,
            inspect_interval_s: INSPECT_INTERVAL_S_DEFAULT,
            wechatpay_apiv3_key: env("PAYONCE_WECHATPAY_APIV3_KEY"),
            wechatpay_public_keys: Vec::new(),
            alipay_public_key: None,
            alipay_app_cert: None,
            alipay_public_cert: None,
            alipay_root_cert: None,
            alipay_app_id: None,
            limits: Limits::default(),
            workers: WORKERS_DEFAULT,
            webhooks: WebhookConfig::default(),
            webhook_secret: env("PAYONCE_WEBHOOK_SECRET"),
            wechatpay_mchid: None,
            wechatpay_merchant_serial: None,
            wechatpay_merchant_key: None,
            wechatpay_api_base: wechatpay::API_BASE_DEFAULT.to_owned(),
            alipay_app_private_key: None,
            alipay_gateway: alipay::GATEWAY_DEFAULT.to_owned(),
            platform_timeout_ms: crate::platforms::PLATFORM_TIMEOUT_MS_DEFAULT,
            platform_retry_ms: parse_waits("--platform-retry-s", crate::platforms::PLATFORM_RETRY_S_DEFAULT)?,
            close_give_up_s: crate::platforms::CLOSE_GIVE_UP_S_DEFAULT,
            refund_query_after_s: crate::platforms::REFUND_QUERY_AFTER_S_DEFAULT,
            public_base_url: None,
            wechatpay_appids: Vec::new(),
            wechatpay_platform_certs: false,
            wechatpay_cert_refresh_s: wechatpay::CERT_REFRESH_S_DEFAULT,
            wechatpay_cert_unknown_serial_interval_s: wechatpay::CERT_UNKNOWN_SERIAL_INTERVAL_S_DEFAULT,
            prepay_reuse_s: crate::platforms::PREPAY_REUSE_S_DEFAULT,
            refund_unwanted: RefundUnwanted::Manual,
            log_format: crate::log::LogFormat::Logfmt,
            secret_values: Vec::new(),
            secret_files: Vec::new(),
            secret_files_read: Vec::new(),
        })
    }

    /// Every source of the settings, in order: the defaults, the
    /// environment (`env`), the `--config` file, the command line (each
    /// setting once per value, as given). A setting named on the command
    /// line replaces the file's value, a repeatable one its whole list. Then
    /// the secrets given as files are read. Returns the settings and the
    /// warnings to print before anything else.
    pub fn assemble(
        env: &dyn Fn(&str) -> Option<String>,
        config_file: Option<&Path>,
        command_line: &[(&'static Setting, String)],
    ) -> Result<(Settings, Vec<String>), String> {
        let mut settings = Settings::defaults_with(env)?;
        let mut warnings = Vec::new();
        if let Some(path) = config_file {
            let on_command_line = |name: &str| command_line.iter().any(|(s, _)| s.name == name);
            for entry in file::read(path, &mut warnings)? {
                if on_command_line(entry.setting.name) {
                    continue;
                }
                for value in &entry.values {
                    entry
                        .setting
                        .apply(&mut settings, value)
                        .map_err(|e| format!("{} line {}: {}: {e}", path.display(), entry.line, entry.setting.name))?;
                }
            }
        }
        for (setting, value) in command_line {
            setting.apply(&mut settings, value)?;
        }
        settings.read_secret_files(&mut warnings)?;
        Ok((settings, warnings))
    }

    /// Replaces each secret given as a file by the file's text, refusing a
    /// secret given both ways.
    fn read_secret_files(&mut self, warnings: &mut Vec<String>) -> Result<(), String> {
        for (name, path) in std::mem::take(&mut self.secret_files) {
            let Some(secret) = SECRETS.iter().find(|s| s.name == name) else { continue };
            if self.secret_values.contains(&name) {
                return Err(format!(
                    "--{name} and --{name}-file are both given (flag or config key); give the secret once"
                ));
            }
            let text = read_secret_file(secret, &path, warnings)?;
            *(secret.field)(self) = Some(text);
            self.secret_files_read.push((secret, path));
        }
        Ok(())
    }

    /// How `SIGHUP` reads each secret file again: as at start (the same
    /// checks of the file, the same parsing), replacing what `held` gives
    /// its readers; a file that fails changes nothing. The APIv3 key's file
    /// is read again with WeChat Pay's keys (src/platforms/wechatpay/keys.rs).
    fn secret_file_reloads(&self, held: &HeldSecrets) -> Vec<SecretFile> {
        let mut reloads = Vec::new();
        for (secret, path) in &self.secret_files_read {
            let (secret, file) = (*secret, path.clone());
            let reload: ReloadSecret = match secret.name {
                "callback-secret" => {
                    let held = held.callback.clone();
                    Arc::new(move |warnings| {
                        let secrets = split_callback_secrets(&read_secret_file(secret, &file, warnings)?);
                        if secrets.is_empty() {
                            return Err(format!("--callback-secret-file {file:?}: no secret in it"));
                        }
                        held.replace(secrets);
                        Ok(())
                    })
                }
                "api-token" => {
                    let held = held.api_tokens.clone();
                    Arc::new(move |warnings| {
                        held.replace(api_tokens(Some(&read_secret_file(secret, &file, warnings)?))?);
                        Ok(())
                    })
                }
                "webhook-secret" => {
                    let held = held.webhook.clone();
                    Arc::new(move |warnings| {
                        held.replace(parse_secrets(&read_secret_file(secret, &file, warnings)?)?);
                        Ok(())
                    })
                }
                _ => continue,
            };
            reloads.push(SecretFile { setting: secret.file_setting, path: path.clone(), reload });
        }
        reloads
    }

    /// The checked configuration: every key file read once (by the
    /// platform that names it), every combination of settings checked; and
    /// what `serve` should warn about.
    pub fn check(&self) -> Result<Checked, String> {
        let mut warnings = Vec::new();
        let webhooks = self.webhook_config()?;
        let held = HeldSecrets {
            callback: Held::new(self.callback_secrets(&mut warnings)?),
            api_tokens: Held::new(api_tokens(self.api_tokens.as_deref())?),
            webhook: webhooks.secrets.clone(),
        };
        let registry = Registry::configured(
            &self.platform_settings(held.callback.clone()),
            Parts::NoticesAndCalls,
            &mut warnings,
        )?;
        let config = Config {
            rewards: Rewards { coupon_templates: self.coupons.clone(), points_per_yuan: self.points_per_yuan },
            order_ttl_s: self.order_ttl_s,
            idempotency_ttl_s: self.idempotency_ttl_s,
            api_tokens: held.api_tokens.clone(),
            webhooks,
            platforms: self.platforms_with(registry),
            refund_unwanted: self.refund_unwanted,
            secret_files: self.secret_file_reloads(&held),
        };
        Ok(Checked { config, warnings })
    }

    /// The platforms' outgoing calls alone (`payonce sync`).
    pub fn platforms(&self) -> Result<Platforms, String> {
        let registry =
            Registry::configured(&self.platform_settings(Held::default()), Parts::CallsOnly, &mut Vec::new())?;
        Ok(self.platforms_with(registry))
    }

    /// What the platforms' folders read their settings from.
    fn platform_settings(&self, callback_secrets: Held<Vec<Vec<u8>>>) -> PlatformSettings {
        PlatformSettings {
            callback_secrets,
            wechatpay: wechatpay::Settings {
                apiv3_key: self.wechatpay_apiv3_key.clone(),
                apiv3_key_file: self
                    .secret_files_read
                    .iter()
                    .find(|(secret, _)| secret.name == "wechatpay-apiv3-key")
                    .map(|(_, path)| path.clone()),
                public_keys: self.wechatpay_public_keys.clone(),
                mchid: self.wechatpay_mchid.clone(),
                merchant_serial: self.wechatpay_merchant_serial.clone(),
                merchant_key: self.wechatpay_merchant_key.clone(),
                api_base: self.wechatpay_api_base.clone(),
                appids: self.wechatpay_appids.clone(),
                platform_certs: self.wechatpay_platform_certs,
                cert_refresh_s: self.wechatpay_cert_refresh_s,
                cert_unknown_serial_interval_s: self.wechatpay_cert_unknown_serial_interval_s,
            },
            alipay: alipay::Settings {
                public_key: self.alipay_public_key.clone(),
                app_cert: self.alipay_app_cert.clone(),
                public_cert: self.alipay_public_cert.clone(),
                root_cert: self.alipay_root_cert.clone(),
                app_id: self.alipay_app_id.clone(),
                app_private_key: self.alipay_app_private_key.clone(),
                gateway: self.alipay_gateway.clone(),
            },
            timeout: Duration::from_millis(self.platform_timeout_ms),
            public_base_url: self.public_base_url.clone(),
        }
    }

    /// The relay's settings; `PAYONCE_WEBHOOK_SECRET` is required once an
    /// endpoint is configured and refused when malformed.
    fn webhook_config(&self) -> Result<WebhookConfig, String> {
        let mut config = self.webhooks.clone();
        match (&self.webhook_secret, config.endpoints.is_empty()) {
            (None, true) => {}
            (Some(secrets), _) => config.secrets = Held::new(parse_secrets(secrets)?),
            (None, false) => return Err(parse_secrets("").unwrap_err()),
        }
        Ok(config)
    }

    /// The platforms `registry` holds, paced as the settings say.
    fn platforms_with(&self, registry: Registry) -> Platforms {
        Platforms {
            registry,
            timeout_ms: self.platform_timeout_ms,
            retry_schedule_ms: self.platform_retry_ms.clone(),
            close_give_up_ms: self.close_give_up_s.saturating_mul(1000),
            refund_query_after_ms: self.refund_query_after_s.saturating_mul(1000),
            public_base_url: self.public_base_url.clone(),
            prepay_reuse_ms: self.prepay_reuse_s.saturating_mul(1000),
            ..Platforms::default()
        }
    }

    fn callback_secrets(&self, warnings: &mut Vec<String>) -> Result<Vec<Vec<u8>>, String> {
        let configured = self.callback_secret.as_deref().map(split_callback_secrets);
        match configured {
            Some(secrets) if !secrets.is_empty() => Ok(secrets),
            _ if self.dev => {
                warnings.push(format!(
                    "WARNING: --dev: the generic channel accepts callbacks signed with the PUBLIC dev secret {DEV_CALLBACK_SECRET:?}."
                ));
                warnings.push("WARNING: --dev: anyone can forge a payment. Never use --dev with real money.".into());
                Ok(vec![DEV_CALLBACK_SECRET.as_bytes().to_vec()])
            }
            _ => {
                Err("serve needs --callback-secret-file (or --callback-secret, PAYONCE_CALLBACK_SECRET); use --dev for local development"
                    .into())
            }
        }
    }
}

/// The secrets a reload may replace, as their readers hold them.
struct HeldSecrets {
    callback: Held<Vec<Vec<u8>>>,
    api_tokens: Held<Vec<ApiToken>>,
    webhook: Held<Vec<Vec<u8>>>,
}

/// `--callback-secret`'s comma-separated secrets.
fn split_callback_secrets(text: &str) -> Vec<Vec<u8>> {
    text.split(',').map(str::trim).filter(|s| !s.is_empty()).map(|s| s.as_bytes().to_vec()).collect()
}

/// What [`Settings::check`] built: the library's configuration, and the
/// warnings `serve` prints before it starts.
pub struct Checked {
    pub config: Config,
    pub warnings: Vec<String>,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_flag_is_named_once() {
        let mut names: Vec<&str> = SETTINGS.iter().map(|s| s.name).collect();
        names.sort_unstable();
        let before = names.len();
        names.dedup();
        assert_eq!(names.len(), before, "a flag named twice in the table");
    }

    #[test]
    fn values_are_checked_and_named() {
        let mut settings = Settings::from_env().expect("defaults");
        let apply = |settings: &mut Settings, name: &str, value: &str| {
            setting_named(name).expect("a known setting").apply(settings, value)
        };
        assert_eq!(
            apply(&mut settings, "workers", "0"),
            Err("--workers \"0\": expected an integer from 1 to 1024".to_owned())
        );
        assert!(
            apply(&mut settings, "wechatpay-api-base", "ftp://x").is_err_and(|e| e.contains("--wechatpay-api-base"))
        );
        assert!(apply(&mut settings, "coupon", "a b").is_err());
        apply(&mut settings, "workers", "3").expect("in range");
        apply(&mut settings, "coupon", "NEW10").expect("a template");
        apply(&mut settings, "coupon", "VIP").expect("repeatable");
        assert_eq!((settings.workers, settings.coupons.len()), (3, 2));
        assert!(setting_named("no-such-flag").is_none());
        assert!(!setting_named("dev").expect("dev").takes_value);
    }
}
