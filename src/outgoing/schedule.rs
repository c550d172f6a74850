//! The retry schedule of a kind of leased call: the waits before the 1st,
//! 2nd, ... retry, each stretched or shrunk by up to a jitter fraction, and
//! what happens once they are spent.

/// What a [`Schedule`] does after its last wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spent {
    /// No more retries: the call settles as failed (webhooks' dead letter).
    GiveUp,
    /// The last wait repeats for ever (platform calls).
    RepeatLast,
}

/// A retry schedule over waits in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Schedule<'a> {
    waits_ms: &'a [u64],
    /// Each wait is stretched or shrunk by up to this fraction (0: exact).
    jitter: f64,
    spent: Spent,
}

impl<'a> Schedule<'a> {
    /// The wait of a [`Spent::RepeatLast`] schedule without waits.
    pub const EMPTY_REPEAT_MS: u64 = 5_000;

    pub fn new(waits_ms: &'a [u64], jitter: f64, spent: Spent) -> Schedule<'a> {
        Schedule { waits_ms, jitter: jitter.clamp(0.0, 1.0), spent }
    }

    /// The wait before the next attempt once attempt `attempt` (from 1)
    /// failed, jittered by `unit` (uniform in [0, 1)) and stretched to at
    /// least `at_least_ms` (a `Retry-After`); `None` once the schedule is
    /// spent and gives up.
    pub fn wait_ms(&self, attempt: i64, unit: f64, at_least_ms: Option<u64>) -> Option<u64> {
        let index = usize::try_from(attempt.saturating_sub(1)).ok();
        let wait = match self.spent {
            Spent::GiveUp => *self.waits_ms.get(index?)?,
            Spent::RepeatLast => {
                let index = index.unwrap_or(0);
                self.waits_ms.get(index).or(self.waits_ms.last()).copied().unwrap_or(Self::EMPTY_REPEAT_MS)
            }
        };
        Some(self.jittered(wait, unit).max(at_least_ms.unwrap_or(0)))
    }

    /// [`Schedule::wait_ms`] after `now_ms`: when the next attempt may start.
    pub fn next_attempt_at(&self, now_ms: i64, attempt: i64, unit: f64, at_least_ms: Option<u64>) -> Option<String> {
        let wait_ms = self.wait_ms(attempt, unit, at_least_ms)?;
        Some(crate::clock::format_ms(now_ms.saturating_add(i64::try_from(wait_ms).unwrap_or(i64::MAX))))
    }

    /// `wait_ms` stretched or shrunk by up to the jitter fraction.
    fn jittered(&self, wait_ms: u64, unit: f64) -> u64 {
        if self.jitter == 0.0 {
            return wait_ms;
        }
        let factor = 1.0 - self.jitter + 2.0 * self.jitter * unit.clamp(0.0, 1.0);
        (wait_ms as f64 * factor).round() as u64
    }
}

/// A uniform number in [0, 1) from the OS.
pub fn random_unit() -> f64 {
    let mut bytes = [0u8; 8];
    if getrandom::fill(&mut bytes).is_err() {
        return 0.5;
    }
    (u64::from_be_bytes(bytes) >> 11) as f64 / (1u64 << 53) as f64
}
