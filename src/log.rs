//! Structured logs on stderr, one logfmt line per event:
//! `ts=... level=info msg=request method=POST route=/v1/orders status=201 latency_ms=1.234`.
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
    fn as_str(self) -> &'static str {
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

/// Writes one line: `msg` and `key=value` fields, values quoted when needed.
pub fn event(level: Level, msg: &str, fields: &[(&str, &dyn std::fmt::Display)]) {
    if !enabled(level) {
        return;
    }
    let mut line = format!("ts={} level={} msg={}", crate::clock::Clock::System.now_text(), level.as_str(), quote(msg));
    for (key, value) in fields {
        line.push(' ');
        line.push_str(key);
        line.push('=');
        line.push_str(&quote(&value.to_string()));
    }
    line.push('\n');
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

fn quote(value: &str) -> String {
    let plain =
        !value.is_empty() && value.bytes().all(|b| b.is_ascii_graphic() && b != b'"' && b != b'=' && b != b'\\');
    if plain {
        value.to_owned()
    } else {
        format!("{value:?}")
    }
}
