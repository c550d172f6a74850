//! The table the simulator prints: one row per scenario (and channel), the
//! violations under it.

/// At most this many violation lines are printed per scenario.
const DETAILS_MAX: usize = 20;

/// One row of the table.
pub struct Row {
    pub scenario: String,
    /// Shown as a column when the rows are of more than one channel.
    pub channel: String,
    pub deliveries: String,
    pub expected: String,
    pub observed: String,
    pub violations: Vec<String>,
    /// Not played on this channel (or run): `expected` says why.
    pub skipped: bool,
}

/// The table, and the violations under it.
pub fn render_table(rows: &[Row]) -> String {
    let with_channel = rows.iter().any(|r| r.channel != rows[0].channel);
    let mut header = vec!["scenario", "deliveries", "effects expected", "effects observed", "verdict"];
    if with_channel {
        header.insert(1, "channel");
    }
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let verdict = match (r.skipped, r.violations.is_empty()) {
                (true, _) => "skipped",
                (false, true) => "ok",
                (false, false) => "VIOLATION",
            };
            let mut row = vec![
                r.scenario.clone(),
                r.deliveries.clone(),
                r.expected.clone(),
                r.observed.clone(),
                verdict.to_owned(),
            ];
            if with_channel {
                row.insert(1, r.channel.clone());
            }
            row
        })
        .collect();
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in &cells {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |row: &[String]| -> String {
        let padded: Vec<String> = row.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        padded.join("  ").trim_end().to_owned() + "\n"
    };
    let mut out = line(&header.iter().map(|h| (*h).to_owned()).collect::<Vec<_>>());
    out.push_str(&line(&widths.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>()));
    for row in &cells {
        out.push_str(&line(row));
    }
    for r in rows.iter().filter(|r| !r.violations.is_empty()) {
        let which = if with_channel { format!("{} ({})", r.scenario, r.channel) } else { r.scenario.clone() };
        out.push_str(&format!("\nVIOLATION in {which} ({} finding(s)):\n", r.violations.len()));
        for v in r.violations.iter().take(DETAILS_MAX) {
            out.push_str(&format!("  {v}\n"));
        }
        if r.violations.len() > DETAILS_MAX {
            out.push_str(&format!("  ... and {} more\n", r.violations.len() - DETAILS_MAX));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::judge::judge;
    use crate::judge::tests::{known, paid_expect, twice_seen};

    fn row(channel: &str, violations: Vec<String>) -> Row {
        Row {
            scenario: "concurrent".into(),
            channel: channel.into(),
            deliveries: "2: 2 applied".into(),
            expected: "1 PAID".into(),
            observed: "1 PAID".into(),
            violations,
            skipped: false,
        }
    }

    #[test]
    fn violations_are_listed_under_the_table() {
        let violations = judge(&paid_expect(), &known(), &twice_seen());
        let table = render_table(&[row("generic", violations.clone())]);
        assert!(table.contains("VIOLATION"), "{table}");
        assert!(!table.contains("channel"), "one channel, no channel column: {table}");
        let table = render_table(&[row("generic", vec![]), row("wechatpay", violations)]);
        let header: Vec<&str> = table.lines().next().unwrap_or_default().split_whitespace().collect();
        assert_eq!(header[..2], ["scenario", "channel"], "{table}");
        assert!(table.contains("VIOLATION in concurrent (wechatpay)"), "{table}");
    }
}
