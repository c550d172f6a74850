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

/// The default table's width: a terminal's, a CI log's.
pub const NARROW_WIDTH: usize = 100;

/// The table that fits [`NARROW_WIDTH`] columns: the scenario, its channel,
/// how many deliveries, the verdict, then what it observed (or why it was
/// skipped), cut with `…` where the line would pass the width. The
/// violations under it as in [`render_table`]; `--verbose` prints that one.
pub fn render_narrow_table(rows: &[Row]) -> String {
    let header = ["scenario", "deliveries", "verdict", "effects observed (--verbose: all)"];
    render(rows, &header, Some(NARROW_WIDTH), |r| {
        let count = r.deliveries.split(':').next().unwrap_or_default().trim().to_owned();
        let summary = if r.skipped { r.expected.clone() } else { r.observed.clone() };
        vec![r.scenario.clone(), count, verdict_of(r).to_owned(), summary]
    })
}

/// The whole table (`--verbose`), and the violations under it.
pub fn render_table(rows: &[Row]) -> String {
    let header = ["scenario", "deliveries", "effects expected", "effects observed", "verdict"];
    render(rows, &header, None, |r| {
        vec![r.scenario.clone(), r.deliveries.clone(), r.expected.clone(), r.observed.clone(), verdict_of(r).to_owned()]
    })
}

/// A table of `header` and one row of `cells_of` per row (a channel column
/// second when the rows are of more than one channel), each column as wide
/// as its widest cell; with `fit`, the last column is cut so that a line is
/// at most `fit` characters. Then the violations under it.
fn render(rows: &[Row], header: &[&str], fit: Option<usize>, cells_of: impl Fn(&Row) -> Vec<String>) -> String {
    let with_channel = rows.iter().any(|r| r.channel != rows[0].channel);
    let mut header: Vec<String> = header.iter().map(|h| (*h).to_owned()).collect();
    if with_channel {
        header.insert(1, "channel".to_owned());
    }
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let mut row = cells_of(r);
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
    if let Some(fit) = fit {
        let last = widths.len() - 1;
        let room = fit.saturating_sub(widths[..last].iter().map(|w| w + 2).sum::<usize>()).max(8);
        widths[last] = widths[last].min(room);
    }
    let line = |row: &[String]| -> String {
        let padded: Vec<String> = row.iter().zip(&widths).map(|(c, w)| format!("{:<w$}", cut(c, *w))).collect();
        padded.join("  ").trim_end().to_owned() + "\n"
    };
    let mut out = line(&header);
    out.push_str(&line(&widths.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>()));
    for row in &cells {
        out.push_str(&line(row));
    }
    out.push_str(&violations_under(rows, with_channel));
    out
}

/// `text` in lines of at most `width` characters (a longer word alone on its
/// line), the first after `first`, the others after `rest`.
pub fn wrap(text: &str, width: usize, first: &str, rest: &str) -> String {
    let mut out = String::new();
    let mut line = first.to_owned();
    let mut empty = true;
    for word in text.split_whitespace() {
        let len = line.chars().count();
        if !empty && len + 1 + word.chars().count() > width {
            out.push_str(&line);
            out.push('\n');
            line = rest.to_owned();
            empty = true;
        }
        if !empty {
            line.push(' ');
        }
        line.push_str(word);
        empty = false;
    }
    out.push_str(&line);
    out.push('\n');
    out
}

/// `text`, or its first `room - 1` characters and `…`.
fn cut(text: &str, room: usize) -> String {
    if text.chars().count() <= room {
        text.to_owned()
    } else {
        text.chars().take(room.saturating_sub(1)).collect::<String>() + "…"
    }
}

fn verdict_of(r: &Row) -> &'static str {
    match (r.skipped, r.violations.is_empty()) {
        (true, _) => "skipped",
        (false, true) => "ok",
        (false, false) => "VIOLATION",
    }
}

/// Each violated scenario's findings, at most [`DETAILS_MAX`] each.
fn violations_under(rows: &[Row], with_channel: bool) -> String {
    let mut out = String::new();
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

    #[test]
    fn the_default_table_fits_100_columns_and_cuts_only_the_last_one() {
        let long = "10 REFUNDED, 10 payments, 10 frozen coupons, 10 points, 30 reversals, 10 order.paid, 20 order.partially_refunded";
        let mut wide = row("wechatpay", vec!["a finding".into()]);
        wide.scenario = "payment_after_close".into();
        wide.deliveries = "60: 10 applied, 30 refund applied, 10 refund duplicate, 10 refund refund_failed".into();
        wide.observed = long.into();
        let skipped =
            Row { skipped: true, expected: "(generic has no platform API to ask)".into(), ..row("generic", vec![]) };
        let table = render_narrow_table(&[wide, skipped]);
        for line in table.lines() {
            assert!(line.chars().count() <= NARROW_WIDTH, "{} columns: {line}", line.chars().count());
        }
        let first_row = table.lines().nth(2).unwrap_or_default();
        let words: Vec<&str> = first_row.split_whitespace().collect();
        assert_eq!(words[..4], ["payment_after_close", "wechatpay", "60", "VIOLATION"], "{table}");
        assert!(first_row.ends_with('…'), "the observed effects are cut: {first_row}");
        let skipped_row = table.lines().nth(3).unwrap_or_default();
        assert!(
            skipped_row.contains("skipped") && skipped_row.ends_with("(generic has no platform API to ask)"),
            "{table}"
        );
        assert!(table.contains("VIOLATION in payment_after_close (wechatpay)"), "{table}");
        let wrapped = wrap(long, 40, "  ", "    ");
        assert!(wrapped.lines().all(|l| l.chars().count() <= 40), "{wrapped}");
        assert_eq!(wrapped.split_whitespace().collect::<Vec<_>>(), long.split_whitespace().collect::<Vec<_>>());
        let verbose = render_table(&[row("generic", vec![])]);
        assert!(verbose.contains("effects expected"), "{verbose}");
    }
}
