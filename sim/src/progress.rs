//! A one-line progress bar on stderr, for terminals and long runs.

use parking_lot::Mutex;

/// A one-line progress bar on stderr, redrawn at most every 1%.
pub struct Progress {
    /// Draw the bar (a terminal, or a long run); off, nothing is drawn.
    pub bar: bool,
    state: Mutex<ProgressState>,
}
struct ProgressState {
    label: &'static str,
    done: usize,
    total: usize,
    last_percent: Option<usize>,
    drawn: bool,
}

impl Progress {
    const WIDTH: usize = 40;

    pub fn new(bar: bool) -> Progress {
        Progress {
            bar,
            state: Mutex::new(ProgressState { label: "", done: 0, total: 0, last_percent: None, drawn: false }),
        }
    }

    pub fn start(&self, label: &'static str, total: usize) {
        *self.state.lock() = ProgressState { label, done: 0, total, last_percent: None, drawn: false };
        self.tick_by(0);
    }

    pub fn tick(&self) {
        self.tick_by(1);
    }

    fn tick_by(&self, n: usize) {
        if !self.bar {
            return;
        }
        let mut s = self.state.lock();
        s.done += n;
        let percent = (s.done.min(s.total) * 100).checked_div(s.total).unwrap_or(100);
        if s.last_percent == Some(percent) {
            return;
        }
        s.last_percent = Some(percent);
        let filled = percent * Self::WIDTH / 100;
        eprint!(
            "\r{:<20} [{}{}] {percent:>3}% {}/{} deliveries",
            s.label,
            "#".repeat(filled),
            "-".repeat(Self::WIDTH - filled),
            s.done.min(s.total),
            s.total
        );
        s.drawn = true;
    }

    pub fn finish(&self) {
        let mut s = self.state.lock();
        if s.drawn {
            eprintln!();
            s.drawn = false;
        }
    }
}
