//! The environment hooks the tests set on a `payonce serve` they start, to
//! stop it at an exact point (and SIGKILL it there) or to run a design
//! payonce rejected, for comparison. Each is read once per process; unset,
//! each does nothing. They are environment variables rather than Rust
//! functions because the process under test is a separate binary.

use std::sync::OnceLock;
use std::time::Duration;

/// Every hook, named once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EnvHook {
    /// `PAYONCE_TEST_HOLD_AFTER_EVENT_MS`: both engines hold the write
    /// transaction this long right after an insert into `outbox_event`
    /// (tests/it/event_feed.rs).
    HoldAfterEventMs,
    /// `PAYONCE_TEST_HOLD_AFTER_PLATFORM_CLOSE_MS`: the platform-call pool
    /// waits this long between a platform's confirmed close and recording it
    /// (tests/it/platforms.rs).
    HoldAfterPlatformCloseMs,
    /// `PAYONCE_TEST_HOLD_AFTER_PREPAY_MS`: a pay request waits this long
    /// between the platform's answer to the payment's creation and storing
    /// it (the SIGKILL test of the prepay, sim/tests/prepay.rs).
    HoldAfterPrepayMs,
    /// `PAYONCE_TEST_NAIVE_OUTBOX=1`: PostgreSQL numbers events with a plain
    /// sequence, whose feed can skip (examples/bench_processes.rs compares).
    NaiveOutbox,
}

impl EnvHook {
    const ALL: [EnvHook; 4] = [
        EnvHook::HoldAfterEventMs,
        EnvHook::HoldAfterPlatformCloseMs,
        EnvHook::HoldAfterPrepayMs,
        EnvHook::NaiveOutbox,
    ];

    pub(crate) fn variable(self) -> &'static str {
        match self {
            EnvHook::HoldAfterEventMs => "PAYONCE_TEST_HOLD_AFTER_EVENT_MS",
            EnvHook::HoldAfterPlatformCloseMs => "PAYONCE_TEST_HOLD_AFTER_PLATFORM_CLOSE_MS",
            EnvHook::HoldAfterPrepayMs => "PAYONCE_TEST_HOLD_AFTER_PREPAY_MS",
            EnvHook::NaiveOutbox => "PAYONCE_TEST_NAIVE_OUTBOX",
        }
    }

    /// The variable's value, read once per process; empty counts as unset.
    fn value(self) -> Option<&'static str> {
        static VALUES: OnceLock<Vec<Option<String>>> = OnceLock::new();
        let values = VALUES.get_or_init(|| {
            EnvHook::ALL.iter().map(|h| std::env::var(h.variable()).ok().filter(|v| !v.is_empty())).collect()
        });
        let index = EnvHook::ALL.iter().position(|h| *h == self)?;
        values.get(index)?.as_deref()
    }

    /// A hold in milliseconds: `None` unset, zero or not a number.
    pub(crate) fn hold(self) -> Option<Duration> {
        self.value()?.parse::<u64>().ok().filter(|ms| *ms > 0).map(Duration::from_millis)
    }

    /// Sleeps for the hold, if set.
    pub(crate) fn sleep(self) {
        if let Some(hold) = self.hold() {
            std::thread::sleep(hold);
        }
    }

    /// A switch: on when set to `1`.
    pub(crate) fn is_on(self) -> bool {
        self.value() == Some("1")
    }
}

#[cfg(test)]
mod tests {
    use super::EnvHook;

    #[test]
    fn every_hook_has_its_own_variable() {
        let mut names: Vec<&str> = EnvHook::ALL.iter().map(|h| h.variable()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), EnvHook::ALL.len());
        assert!(names.iter().all(|n| n.starts_with("PAYONCE_TEST_")));
    }
}
