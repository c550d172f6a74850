//! `serve --config FILE` and the secrets given as files: every setting of
//! the one table settable from the file with the same result as its flag,
//! the precedence (flag over file over environment over default), and each
//! refusal, in one line over the real binary, naming the key and its line.

use crate::util::TempDir;
use payonce::config::{Setting, Settings, SETTINGS};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A value for each setting that differs from its default, as the flag
/// takes it (`None` for a switch). A setting of the table missing here
/// fails `every_setting_is_settable_from_the_file`.
fn sample(name: &str, secrets: &Path) -> Option<Option<String>> {
    let file = |n: &str| secrets.join(n).display().to_string();
    let value = match name {
        "dev" => return Some(None),
        "db" => "other.db".into(),
        "listen" => "127.0.0.1:9".into(),
        "metrics-listen" => "127.0.0.1:9464".into(),
        "callback-secret" => "s1,s2".into(),
        "callback-secret-file" => file("callback-secret"),
        "api-token" => "shop:t1".into(),
        "api-token-file" => file("api-token"),
        "idempotency-ttl-s" => "600".into(),
        "coupon" => "NEW10".into(),
        "points-per-yuan" => "7".into(),
        "order-ttl-s" => "60".into(),
        "wechatpay-apiv3-key" => "0123456789abcdef0123456789abcdef".into(),
        "wechatpay-apiv3-key-file" => file("apiv3-key"),
        "webhook-secret-file" => file("webhook-secret"),
        "wechatpay-public-key" => "PUB_KEY_ID_1=/k.pem".into(),
        "alipay-public-key" => "/alipay.pem".into(),
        "alipay-app-cert" => "/appCertPublicKey.crt".into(),
        "alipay-public-cert" => "/alipayCertPublicKey_RSA2.crt".into(),
        "alipay-root-cert" => "/alipayRootCert.crt".into(),
        "alipay-app-id" => "2021000".into(),
        "inspect-interval-s" => "30".into(),
        "db-pool-size" => "3".into(),
        "group-commit-max" => "2".into(),
        "group-commit-wait-us" => "5".into(),
        "db-busy-timeout-ms" => "11".into(),
        "db-connect-timeout-ms" => "12".into(),
        "db-statement-timeout-ms" => "13".into(),
        "sweep-interval-s" => "9".into(),
        "max-connections" => "14".into(),
        "header-read-timeout-ms" => "15".into(),
        "body-read-timeout-ms" => "16".into(),
        "keep-alive-idle-ms" => "17".into(),
        "response-write-timeout-ms" => "18".into(),
        "fd-reserve" => "19".into(),
        "shutdown-grace-ms" => "20".into(),
        "workers" => "3".into(),
        "webhook-url" => "http://127.0.0.1:9/hook".into(),
        "webhook-timeout-ms" => "21".into(),
        "webhook-retry-s" => "1,2".into(),
        "webhook-concurrency" => "2".into(),
        "webhook-poll-ms" => "22".into(),
        "wechatpay-mchid" => "1900000".into(),
        "wechatpay-merchant-serial" => "ABC".into(),
        "wechatpay-merchant-key" => "/merchant.pem".into(),
        "wechatpay-api-base" => "http://127.0.0.1:9".into(),
        "wechatpay-platform-certs" => "auto".into(),
        "wechatpay-cert-refresh-s" => "27".into(),
        "wechatpay-cert-unknown-serial-interval-s" => "28".into(),
        "alipay-app-private-key" => "/app.pem".into(),
        "alipay-gateway" => "http://127.0.0.1:9/gateway.do".into(),
        "platform-retry-s" => "1,2,3".into(),
        "refund-query-after-s" => "23".into(),
        "public-base-url" => "https://pay.example.com".into(),
        "close-give-up-s" => "24".into(),
        "platform-timeout-ms" => "25".into(),
        "log-format" => "json".into(),
        "refund-unwanted" => "auto".into(),
        "wechatpay-appid" => "wx0123456789abcdef".into(),
        "prepay-reuse-s" => "26".into(),
        _ => return None,
    };
    Some(Some(value))
}

/// The secret files `sample` names, 0600.
fn secret_files(dir: &Path) {
    for (name, text) in [
        ("callback-secret", "s1\ns2\n"),
        ("api-token", "shop:t1\n"),
        ("apiv3-key", "0123456789abcdef0123456789abcdef\n"),
        ("webhook-secret", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\n"),
    ] {
        write_mode(&dir.join(name), text, 0o600);
    }
}

fn write_mode(path: &Path, text: &str, mode: u32) -> PathBuf {
    std::fs::write(path, text).expect("write a file");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    path.to_path_buf()
}

/// A TOML basic string.
fn quoted(value: &str) -> String {
    format!("\"{}\"", value.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The file's line setting `setting` to `value` as the file takes it: a
/// list for a repeatable setting, an integer where the value is one, true
/// for a switch.
fn line(setting: &Setting, value: &Option<String>) -> String {
    let toml = match value {
        None => "true".to_owned(),
        Some(v) if setting.repeatable => format!("[{}]", quoted(v)),
        Some(v) if v.parse::<i64>().is_ok() => v.clone(),
        Some(v) => quoted(v),
    };
    format!("{} = {toml}\n", setting.name)
}

fn no_env(_: &str) -> Option<String> {
    None
}

fn assemble(
    env: &dyn Fn(&str) -> Option<String>,
    config: Option<&Path>,
    flags: &[(&'static Setting, String)],
) -> Result<Settings, String> {
    Settings::assemble(env, config, flags).map(|(settings, _)| settings)
}

fn named(name: &str) -> &'static Setting {
    payonce::config::setting_named(name).expect("a setting of the table")
}

#[test]
fn every_setting_is_settable_from_the_file() {
    let dir = TempDir::new("config-every");
    secret_files(&dir.0);
    let defaults = format!("{:?}", assemble(&no_env, None, &[]).expect("defaults"));
    let config = dir.0.join("payonce.toml");
    for setting in SETTINGS {
        let value = sample(setting.name, &dir.0)
            .unwrap_or_else(|| panic!("no sample value for the setting {:?}: add one", setting.name));
        write_mode(&config, &line(setting, &value), 0o600);
        let from_file = assemble(&no_env, Some(&config), &[]).unwrap_or_else(|e| panic!("{}: {e}", setting.name));
        let from_flag = assemble(&no_env, None, &[(setting, value.clone().unwrap_or_default())])
            .unwrap_or_else(|e| panic!("{}: {e}", setting.name));
        let (from_file, from_flag) = (format!("{from_file:?}"), format!("{from_flag:?}"));
        assert_eq!(from_file, from_flag, "{}: the file and the flag differ", setting.name);
        assert_ne!(from_file, defaults, "{}: the sample changed nothing", setting.name);
    }
    // All at once: every setting but the secrets' values (given here as
    // files, and refused beside them), then those values alone.
    let is_value_of_a_file = |s: &Setting| SETTINGS.iter().any(|f| f.name == format!("{}-file", s.name));
    for part in [false, true] {
        let chosen: Vec<&'static Setting> = SETTINGS.iter().filter(|s| is_value_of_a_file(s) == part).collect();
        let mut text = String::new();
        let mut flags = Vec::new();
        for setting in &chosen {
            let value = sample(setting.name, &dir.0).expect("a sample");
            text.push_str(&line(setting, &value));
            flags.push((*setting, value.unwrap_or_default()));
        }
        write_mode(&config, &text, 0o600);
        let from_file = format!("{:?}", assemble(&no_env, Some(&config), &[]).expect("the whole file"));
        let from_flags = format!("{:?}", assemble(&no_env, None, &flags).expect("every flag"));
        assert_eq!(from_file, from_flags, "{text}");
    }
}

#[test]
fn a_flag_wins_over_the_file_and_the_file_over_the_environment() {
    let dir = TempDir::new("config-precedence");
    let config = write_mode(
        &dir.0.join("payonce.toml"),
        "db = \"file.db\"\nworkers = 4\ncoupon = [\"FILE1\", \"FILE2\"]\n",
        0o600,
    );
    let env = |name: &str| (name == "PAYONCE_DB").then(|| "env.db".to_owned());
    assert_eq!(assemble(&env, None, &[]).expect("env").db, "env.db");
    let file = assemble(&env, Some(&config), &[]).expect("file");
    assert_eq!((file.db.as_str(), file.workers), ("file.db", 4));
    let flags = [(named("db"), "flag.db".to_owned()), (named("coupon"), "FLAG".to_owned())];
    let flagged = assemble(&env, Some(&config), &flags).expect("flags");
    assert_eq!((flagged.db.as_str(), flagged.workers), ("flag.db", 4), "the file's other keys stay");
    // A repeatable flag replaces the file's whole list.
    let coupons = format!("{flagged:?}");
    assert!(coupons.contains("coupons: [\"FLAG\"]"), "{coupons}");
    // A secret from the environment gives way to its file.
    write_mode(&dir.0.join("secret"), "from-file\n", 0o600);
    let env = |name: &str| (name == "PAYONCE_CALLBACK_SECRET").then(|| "from-env".to_owned());
    let flags = [(named("callback-secret-file"), dir.0.join("secret").display().to_string())];
    let settings = format!("{:?}", assemble(&env, None, &flags).expect("a secret file"));
    assert!(settings.contains("from-file") && !settings.contains("from-env"), "{settings}");
}

#[test]
fn a_secret_file_keeps_its_lines_and_refuses_two_for_one_secret() {
    let dir = TempDir::new("config-secret-lines");
    let tokens = write_mode(&dir.0.join("tokens"), "shop:t1\n\nops:t2\r\n", 0o600);
    let settings =
        assemble(&no_env, None, &[(named("api-token-file"), tokens.display().to_string())]).expect("two tokens");
    let debug = format!("{settings:?}");
    assert!(debug.contains("\"shop:t1,ops:t2\""), "{debug}");
    let key = write_mode(&dir.0.join("key"), "one\ntwo\n", 0o600);
    let refused = assemble(&no_env, None, &[(named("wechatpay-apiv3-key-file"), key.display().to_string())])
        .expect_err("two lines for one key");
    assert!(refused.contains("one line"), "{refused}");
}

/// `payonce serve ARGS` in `dir` with no secret in its environment, until it
/// exits: (exit code, stdout, stderr).
fn serve(dir: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_payonce"))
        .arg("serve")
        .args(args)
        .current_dir(dir)
        .env_remove("PAYONCE_CALLBACK_SECRET")
        .env_remove("PAYONCE_API_TOKEN")
        .env_remove("PAYONCE_DB")
        .stdin(Stdio::null())
        .output()
        .expect("run payonce serve");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `serve ARGS` stops with exit 2 and one line on stderr holding each of `words`.
fn refused_in_one_line(dir: &Path, args: &[&str], words: &[&str]) {
    let (code, out, err) = serve(dir, args);
    assert_eq!(code, Some(2), "{args:?}: {err}");
    assert!(out.is_empty(), "{args:?}: nothing on stdout: {out}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "{args:?}: one line: {err}");
    for word in words {
        assert!(lines[0].contains(word), "{args:?}: {word:?} missing from {err}");
    }
}

#[test]
fn each_refusal_is_one_line_naming_the_key_and_its_line() {
    let dir = TempDir::new("config-refusals");
    let d = &dir.0;
    write_mode(&d.join("unknown.toml"), "dev = true\n\n# the port\nwrokers = 3\n", 0o600);
    refused_in_one_line(d, &["--config", "unknown.toml"], &["unknown.toml line 4", "\"wrokers\"", "unknown key"]);
    write_mode(&d.join("type.toml"), "dev = true\nworkers = \"4\"\ncoupon = [\"A\"]\nlisten = 8080\ndb = [1]\n", 0o600);
    refused_in_one_line(d, &["--config", "type.toml"], &["type.toml line 5", "db", "found array"]);
    write_mode(&d.join("switch.toml"), "listen = \"127.0.0.1:0\"\ndev = \"yes\"\n", 0o600);
    refused_in_one_line(d, &["--config", "switch.toml"], &["switch.toml line 2", "dev", "true or false"]);
    write_mode(&d.join("range.toml"), "dev = true\n\nworkers = 0\n", 0o600);
    refused_in_one_line(d, &["--config", "range.toml"], &["range.toml line 3", "--workers \"0\""]);
    write_mode(&d.join("broken.toml"), "dev = true\nlisten = \n", 0o600);
    refused_in_one_line(d, &["--config", "broken.toml"], &["broken.toml line 2", "not TOML"]);
    refused_in_one_line(d, &["--config", "missing.toml"], &["--config missing.toml", "cannot read"]);
    refused_in_one_line(d, &["--config", "."], &["--config .", "not a file"]);
    // The secret files.
    refused_in_one_line(
        d,
        &["--callback-secret-file", "absent"],
        &["--callback-secret-file \"absent\"", "cannot read"],
    );
    write_mode(&d.join("empty"), "\n\n", 0o600);
    refused_in_one_line(d, &["--api-token-file", "empty"], &["--api-token-file \"empty\"", "empty"]);
    write_mode(&d.join("open"), "s3cret\n", 0o644);
    refused_in_one_line(d, &["--callback-secret-file", "open"], &["--callback-secret-file \"open\"", "mode 0644"]);
    write_mode(&d.join("s"), "s3cret\n", 0o600);
    write_mode(&d.join("both.toml"), "callback-secret-file = \"s\"\n", 0o600);
    let (code, _, err) = serve(d, &["--config", "both.toml", "--callback-secret", "x"]);
    assert_eq!(code, Some(2), "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(last.contains("--callback-secret and --callback-secret-file"), "{err}");
    // A config file that holds a secret's value is a file of secrets.
    write_mode(&d.join("open.toml"), "callback-secret = \"s3cret\"\n", 0o604);
    refused_in_one_line(d, &["--config", "open.toml"], &["--config", "open.toml", "mode 0604"]);
}

#[test]
fn serve_starts_from_the_file_and_a_flag_wins() {
    let dir = TempDir::new("config-serve");
    let d = &dir.0;
    write_mode(&d.join("secret"), "s3cret\n", 0o600);
    // The file's port is in use: the flag's port 0 is the one served.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let text = format!(
        "db = \":memory:\"\nlisten = \"{}\"\ncallback-secret-file = \"secret\"\nworkers = 2\n",
        taken.local_addr().expect("its address")
    );
    write_mode(&d.join("payonce.toml"), &text, 0o600);
    let mut child = Command::new(env!("CARGO_BIN_EXE_payonce"))
        .args(["serve", "--config", "payonce.toml", "--listen", "127.0.0.1:0"])
        .current_dir(d)
        .env_remove("PAYONCE_CALLBACK_SECRET")
        .env_remove("PAYONCE_DB")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start payonce serve");
    let mut first = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().expect("stdout")), &mut first)
        .expect("read its first line");
    let _ = child.kill();
    let out = child.wait_with_output().expect("wait");
    let err = String::from_utf8_lossy(&out.stderr);
    let port = first.trim().strip_prefix("listening on http://127.0.0.1:").and_then(|p| p.parse::<u16>().ok());
    assert!(port.is_some(), "{first}{err}");
    assert_ne!(port, Some(taken.local_addr().expect("its address").port()), "{first}");
    assert!(err.contains("channel generic: 1 HMAC secret"), "{err}");
}

/// `text` with `/etc/payonce/` pointed at `dir` and, with `uncomment`,
/// every commented-out `key = value` line of it made a line of the file.
fn shipped(text: &str, dir: &Path, uncomment: bool) -> String {
    let text = text.replace("/etc/payonce/", &format!("{}/", dir.display()));
    text.lines()
        .map(|line| match line.strip_prefix('#') {
            Some(rest) if uncomment && rest.contains(" = ") && !rest.starts_with(' ') => rest,
            _ => line,
        })
        .map(|line| format!("{line}\n"))
        .collect()
}

/// The first ```toml block of README.md.
fn readme_toml() -> String {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).expect("README.md");
    let block = readme.split("```toml\n").nth(1).expect("a toml block in the README");
    block.split("\n```").next().unwrap_or_default().to_owned()
}

#[test]
fn the_shipped_file_and_the_readmes_are_read_whole() {
    let dir = TempDir::new("config-shipped");
    let d = &dir.0;
    let example = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/payonce.toml.example"))
        .expect("deploy/payonce.toml.example");
    for (name, text) in [
        ("as-shipped.toml", shipped(&example, d, false)),
        ("everything.toml", shipped(&example, d, true)),
        ("readme.toml", shipped(&readme_toml(), d, false)),
    ] {
        assert!(text.contains("callback-secret-file"), "{name}: {text}");
        write_mode(&d.join(name), &text, 0o640);
        // Every key known and typed: the refusal is the first secret file's,
        // which is read after the whole file was applied.
        let missing = format!("--callback-secret-file \"{}/callback-secret\": cannot read", d.display());
        refused_in_one_line(d, &["--config", name], &[&missing]);
    }
}

#[test]
fn every_setting_is_in_the_help_and_in_docs_settings() {
    let docs =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/settings.md")).expect("docs/settings.md");
    let out = Command::new(env!("CARGO_BIN_EXE_payonce")).args(["serve", "--help"]).output().expect("serve --help");
    let help = String::from_utf8_lossy(&out.stdout);
    for name in SETTINGS.iter().map(|s| s.name).chain(["config"]) {
        let flag = format!("--{name} ");
        assert!(help.contains(&flag) || help.contains(&format!("--{name}\n")), "serve --help lacks --{name}");
        assert!(
            docs.contains(&format!("`--{name} ")) || docs.contains(&format!("`--{name}`")),
            "docs/settings.md lacks `--{name}`"
        );
    }
}
