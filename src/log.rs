//! Structured logs on stderr, one line per event: logfmt
//! `ts=... level=info msg=request method=POST route=/v1/orders status=201 latency_ms=1.234`,
//! or, with `--log-format json` ([`set_format`]), one JSON object per line
//! with the same keys in the same order, every value a string.
//! The level comes from `PAYONCE_LOG` (`error`, `warn`, `info`, `debug`;
//! default `info`), read once.

use std::io::Write;
use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Error,
    Warn,
    Info,
    Debug,
}

impl Level {
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Error => "error",
            Level::Warn => "warn",
            Level::Info => "info",
            Level::Debug => "debug",
        }
    }
}

/// The configured level.
pub fn max_level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| match std::env::var("PAYONCE_LOG").as_deref().map(str::to_ascii_lowercase).as_deref() {
        Ok("error") => Level::Error,
        Ok("warn") | Ok("warning") => Level::Warn,
        Ok("debug") | Ok("trace") => Level::Debug,
        _ => Level::Info,
    })
}

pub fn enabled(level: Level) -> bool {
    level <= max_level()
}

/// How a line is written (`--log-format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// `key=value` pairs, values quoted when needed.
    #[default]
    Logfmt,
    /// One JSON object per line: what most log pipelines ingest as is.
    Json,
}

impl LogFormat {
    pub fn parse(text: &str) -> Option<LogFormat> {
        match text {
            "logfmt" => Some(LogFormat::Logfmt),
            "json" => Some(LogFormat::Json),
            _ => None,
        }
    }
}

static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// Where lines go instead of stderr: `(level, msg, the whole line)`.
pub type Sink = Box<dyn Fn(Level, &str, &str) + Send + Sync>;

static SINK: OnceLock<Sink> = OnceLock::new();

/// Sends every line from now on to `sink` instead of stderr; the first call
/// wins. For a program that embeds payonce and reports its log its own way
/// (the simulator counts its in-process payonce's warnings and prints each
/// kind once).
pub fn set_sink(sink: Sink) {
    let _ = SINK.set(sink);
}

/// Sets the format of every line from now on; the first call wins (`serve`
/// makes it before it logs anything).
pub fn set_format(format: LogFormat) {
    let _ = FORMAT.set(format);
}

/// Writes one line: `msg` and its fields, in the configured format.
pub fn event(level: Level, msg: &str, fields: &[(&str, &dyn std::fmt::Display)]) {
    if !enabled(level) {
        return;
    }
    let ts = crate::clock::Clock::System.now_text();
    let line = match FORMAT.get().copied().unwrap_or_default() {
        LogFormat::Logfmt => logfmt_line(&ts, level, msg, fields),
        LogFormat::Json => json_line(&ts, level, msg, fields),
    };
    if let Some(sink) = SINK.get() {
        sink(level, msg, &line);
        return;
    }
    // One write call per line keeps lines whole between threads.
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

pub fn error(msg: &str, fields: &[(&str, &dyn std::fmt::Display)]) {
    event(Level::Error, msg, fields);
}

pub fn warn(msg: &str, fields: &[(&str, &dyn std::fmt::Display)]) {
    event(Level::Warn, msg, fields);
}

pub fn debug(msg: &str, fields: &[(&str, &dyn std::fmt::Display)]) {
    event(Level::Debug, msg, fields);
}

pub fn info(msg: &str, fields: &[(&str, &dyn std::fmt::Display)]) {
    event(Level::Info, msg, fields);
}

fn logfmt_line(ts: &str, level: Level, msg: &str, fields: &[(&str, &dyn std::fmt::Display)]) -> String {
    let mut line = format!("ts={ts} level={} msg={}", level.as_str(), quote(msg));
    for (key, value) in fields {
        line.push(' ');
        line.push_str(key);
        line.push('=');
        line.push_str(&quote(&value.to_string()));
    }
    line.push('\n');
    line
}

/// `{"ts":..,"level":..,"msg":..,KEY:VALUE..}`, every value a string (a
/// field keeps one type however it reads: a pay_no of digits stays text).
fn json_line(ts: &str, level: Level, msg: &str, fields: &[(&str, &dyn std::fmt::Display)]) -> String {
    let text = |value: &str| serde_json::to_string(value).unwrap_or_else(|_| "\"\"".to_owned());
    let mut line = format!("{{\"ts\":{},\"level\":{},\"msg\":{}", text(ts), text(level.as_str()), text(msg));
    for (key, value) in fields {
        line.push(',');
        line.push_str(&text(key));
        line.push(':');
        line.push_str(&text(&value.to_string()));
    }
    line.push_str("}\n");
    line
}

fn quote(value: &str) -> String {
    let plain =
        !value.is_empty() && value.bytes().all(|b| b.is_ascii_graphic() && b != b'"' && b != b'=' && b != b'\\');
    if plain {
        value.to_owned()
    } else {
        format!("{value:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::{json_line, logfmt_line, Level};

    #[test]
    fn a_line_in_each_format_says_the_same() {
        let fields: [(&str, &dyn std::fmt::Display); 3] =
            [("status", &201), ("route", &"/v1/orders"), ("error", &"a \"quoted\" message\nand a line")];
        let logfmt = logfmt_line("2026-01-01T00:00:00.000Z", Level::Warn, "request failed", &fields);
        assert_eq!(
            logfmt,
            "ts=2026-01-01T00:00:00.000Z level=warn msg=\"request failed\" status=201 route=/v1/orders \
             error=\"a \\\"quoted\\\" message\\nand a line\"\n"
        );
        let json = json_line("2026-01-01T00:00:00.000Z", Level::Warn, "request failed", &fields);
        assert!(json.ends_with('\n') && !json.trim_end().contains('\n'), "one line: {json}");
        let value: serde_json::Value = serde_json::from_str(&json).expect("a JSON object");
        let keys: Vec<&str> = value.as_object().map(|o| o.keys().map(String::as_str).collect()).unwrap_or_default();
        assert_eq!(keys, ["ts", "level", "msg", "status", "route", "error"]);
        assert_eq!(value["status"], "201");
        assert_eq!(value["error"], "a \"quoted\" message\nand a line");
        assert_eq!(value["level"], "warn");
    }
}
