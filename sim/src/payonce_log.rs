//! The in-process payonce's log, each kind of line once: a scenario that
//! takes a platform down makes payonce warn once per unanswered call (dozens
//! of identical lines); the first of each kind is shown as it happens, and
//! the counts of the repeats come after the table.

use payonce::log::Level;
use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Mutex;

/// (level, msg) → how many lines payonce logged with them.
static SEEN: Mutex<BTreeMap<(&'static str, String), u64>> = Mutex::new(BTreeMap::new());

/// Routes this process's payonce log through the counter. Called before the
/// in-process payonce starts.
pub fn aggregate() {
    payonce::log::set_sink(Box::new(|level: Level, msg: &str, line: &str| {
        let first = {
            let mut seen = SEEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let count = seen.entry((level.as_str(), msg.to_owned())).or_insert(0);
            *count += 1;
            *count == 1
        };
        if first {
            let _ = std::io::stderr().lock().write_all(line.as_bytes());
        }
    }));
}

/// One line per kind logged more than once, or `None`.
pub fn repeats() -> Option<String> {
    let seen = SEEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let repeated: Vec<String> = seen
        .iter()
        .filter(|(_, count)| **count > 1)
        .map(|((level, msg), count)| format!("  {count} × {level} \"{msg}\" (the first shown above)"))
        .collect();
    (!repeated.is_empty()).then(|| format!("the in-process payonce logged, in all:\n{}", repeated.join("\n")))
}

#[cfg(test)]
mod tests {
    #[test]
    fn repeats_are_counted_and_shown_once() {
        super::aggregate();
        for _ in 0..3 {
            payonce::log::warn("platform query unanswered", &[("channel", &"alipay")]);
        }
        payonce::log::warn("another warning", &[]);
        let summary = super::repeats().unwrap_or_default();
        assert!(summary.contains("3 × warn \"platform query unanswered\""), "{summary}");
        assert!(!summary.contains("another warning"), "a kind logged once is not repeated: {summary}");
    }
}
