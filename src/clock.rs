//! Time, injected. Production uses the system clock; tests and library users
//! use a [`Clock::manual`] clock they can set and advance, so expiry and
//! retention are deterministic.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// A source of "now" in Unix milliseconds.
#[derive(Clone, Debug)]
pub enum Clock {
    System,
    Manual(Arc<AtomicI64>),
}

impl Clock {
    /// A clock that starts at `unix_ms` and moves only when told to.
    pub fn manual(unix_ms: i64) -> Clock {
        Clock::Manual(Arc::new(AtomicI64::new(unix_ms)))
    }

    pub fn now_ms(&self) -> i64 {
        match self {
            Clock::System => match SystemTime::now().duration_since(UNIX_EPOCH) {
                Ok(d) => i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
                Err(_) => 0,
            },
            Clock::Manual(ms) => ms.load(Ordering::SeqCst),
        }
    }

    /// Sets a manual clock; a system clock ignores it (returns false).
    pub fn set_ms(&self, unix_ms: i64) -> bool {
        match self {
            Clock::System => false,
            Clock::Manual(ms) => {
                ms.store(unix_ms, Ordering::SeqCst);
                true
            }
        }
    }

    /// Advances a manual clock; a system clock ignores it (returns false).
    pub fn advance_ms(&self, delta_ms: i64) -> bool {
        match self {
            Clock::System => false,
            Clock::Manual(ms) => {
                ms.fetch_add(delta_ms, Ordering::SeqCst);
                true
            }
        }
    }

    /// Now as stored and returned everywhere: `YYYY-MM-DDTHH:MM:SS.sssZ`.
    pub fn now_text(&self) -> String {
        format_ms(self.now_ms())
    }
}

/// Formats Unix milliseconds as RFC 3339 UTC text with milliseconds.
/// Out-of-range values are clamped to the years 0000..=9999 so the text
/// always sorts.
pub fn format_ms(unix_ms: i64) -> String {
    const MS_MIN: i64 = -62_167_219_200_000; // 0000-01-01T00:00:00.000Z
    const MS_MAX: i64 = 253_402_300_799_999; // 9999-12-31T23:59:59.999Z
    let ms = unix_ms.clamp(MS_MIN, MS_MAX);
    let secs = ms.div_euclid(1000);
    let millis = ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z", sod / 3600, (sod % 3600) / 60, sod % 60)
}

/// Parses an RFC 3339 timestamp with any offset into Unix milliseconds.
/// Sub-millisecond digits are truncated.
pub fn parse_rfc3339_ms(text: &str) -> Option<i64> {
    let t = time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339).ok()?;
    i64::try_from(t.unix_timestamp_nanos().div_euclid(1_000_000)).ok()
}

/// Days since 1970-01-01 to a proleptic Gregorian (year, month, day)
/// (H. Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Beijing time, the zone of WeChat Pay's and Alipay's local times and statement days.
pub const UTC8_OFFSET_MS: i64 = 8 * 3_600_000;

/// `YYYY-MM-DD HH:MM:SS` at a UTC offset (a platform's local time) to Unix milliseconds.
pub fn local_time_ms(text: &str, offset_ms: i64) -> Option<i64> {
    let (date, time) = text.trim().split_once(' ')?;
    Some(parse_rfc3339_ms(&format!("{date}T{time}Z"))? - offset_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_and_parses_round_trip() {
        let cases = [
            (0, "1970-01-01T00:00:00.000Z"),
            (1_700_000_000_123, "2023-11-14T22:13:20.123Z"),
            (951_782_400_000, "2000-02-29T00:00:00.000Z"),
            (-1, "1969-12-31T23:59:59.999Z"),
        ];
        for (ms, text) in cases {
            assert_eq!(format_ms(ms), text);
            assert_eq!(parse_rfc3339_ms(text), Some(ms), "{text}");
        }
    }

    #[test]
    fn parses_offsets_to_utc() {
        assert_eq!(parse_rfc3339_ms("2023-11-15T06:13:20.123+08:00"), Some(1_700_000_000_123));
        assert_eq!(parse_rfc3339_ms("2023-11-15 06:13:20"), None);
        assert_eq!(parse_rfc3339_ms("yesterday"), None);
    }

    #[test]
    fn manual_clock_moves_only_when_told() {
        let clock = Clock::manual(1_000);
        assert!(clock.advance_ms(500));
        assert_eq!(clock.now_ms(), 1_500);
        assert!(clock.set_ms(10));
        assert_eq!(clock.now_text(), "1970-01-01T00:00:00.010Z");
        assert!(!Clock::System.set_ms(0));
    }
}
