//! The table the simulator prints: one row per scenario (and channel), the
//! violations under it.

use crate::judge::{counted, judge, multiset, points_due, OrderExpect, OrderSeen, RewardRule};
use crate::s;
use crate::scenarios::{OrderRun, ScenarioRun};
use std::collections::BTreeMap;

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

fn push_item(items: &mut Vec<String>, n: usize, what: &str) {
    items.push(format!("{n} {what}"));
}

fn expected_effects(runs: &[OrderRun], rewards: &RewardRule) -> String {
    let expects: Vec<&OrderExpect> = runs.iter().map(|r| &r.expect).collect();
    let mut items = Vec::new();
    for (status, n) in multiset(&expects.iter().map(|e| e.status.clone()).collect::<Vec<_>>()) {
        push_item(&mut items, n, &status);
    }
    push_item(&mut items, expects.iter().map(|e| e.payments.len()).sum(), "payments");
    let paid = expects.iter().filter(|e| e.paid).count();
    let refunded = expects.iter().filter(|e| e.refunded).count();
    let coupon = if refunded > 0 { "frozen coupons" } else { "coupons" };
    match rewards {
        RewardRule::Known(rules) => {
            push_item(&mut items, paid * rules.coupon_templates.len(), coupon);
            let points = runs.iter().filter(|r| r.expect.paid && points_due(rules, r.order.amount) > 0).count();
            push_item(&mut items, points, "points");
            if refunded > 0 {
                push_item(&mut items, refunded, "reversals");
            }
        }
        RewardRule::Unknown if paid > 0 => {
            items.push(format!("<=1 {coupon}/template/order"));
            items.push(s("<=1 points/order"));
            if refunded > 0 {
                items.push(s("1 reversal per points"));
            }
        }
        RewardRule::Unknown => {
            push_item(&mut items, 0, "coupons");
            push_item(&mut items, 0, "points");
        }
    }
    let mut events: BTreeMap<&str, usize> = BTreeMap::new();
    let mut findings: BTreeMap<&str, usize> = BTreeMap::new();
    for e in &expects {
        for (kind, n) in &e.events {
            *events.entry(kind).or_default() += n;
        }
        for (kind, n) in &e.findings {
            *findings.entry(kind).or_default() += n;
        }
    }
    for (kind, n) in events {
        push_item(&mut items, n, kind);
    }
    for (kind, n) in findings {
        push_item(&mut items, n, &format!("{kind} findings"));
    }
    let users: Vec<usize> = expects.iter().filter_map(|e| e.orders_of_user).collect();
    if !users.is_empty() {
        push_item(&mut items, users.iter().sum(), "orders (1 per user)");
    }
    items.join(", ")
}

fn observed_effects(seen: &[OrderSeen]) -> String {
    let mut items = Vec::new();
    let statuses: Vec<String> = seen.iter().map(|o| o.status.clone().unwrap_or_else(|| s("missing"))).collect();
    for (status, n) in multiset(&statuses) {
        push_item(&mut items, n, &status);
    }
    push_item(&mut items, seen.iter().map(|o| o.payments.len()).sum(), "payments");
    let coupon_statuses: Vec<String> = seen.iter().flat_map(|o| o.coupons.iter().map(|(_, st)| st.clone())).collect();
    if coupon_statuses.is_empty() {
        push_item(&mut items, 0, "coupons");
    }
    for (status, n) in multiset(&coupon_statuses) {
        let what = match status.as_str() {
            "ACTIVE" => s("coupons"),
            other => format!("{} coupons", other.to_ascii_lowercase()),
        };
        push_item(&mut items, n, &what);
    }
    let point_types: Vec<String> = seen.iter().flat_map(|o| o.points.iter().map(|(t, _)| t.clone())).collect();
    if point_types.is_empty() {
        push_item(&mut items, 0, "points");
    }
    for (kind, n) in multiset(&point_types) {
        let what = match kind.as_str() {
            "ORDER_PAID" => s("points"),
            "ORDER_PAID_REVERSAL" => s("reversals"),
            other => other.to_owned(),
        };
        push_item(&mut items, n, &what);
    }
    let mut events: BTreeMap<&str, usize> = BTreeMap::new();
    let mut findings: BTreeMap<&str, usize> = BTreeMap::new();
    for o in seen {
        for (kind, n) in &o.events {
            *events.entry(kind).or_default() += n;
        }
        for (kind, n) in &o.findings {
            *findings.entry(kind).or_default() += n;
        }
    }
    for (kind, n) in events {
        push_item(&mut items, n, kind);
    }
    for (kind, n) in findings {
        push_item(&mut items, n, &format!("{kind} findings"));
    }
    let users: Vec<usize> = seen.iter().filter_map(|o| o.orders_of_user).collect();
    if !users.is_empty() {
        let per_user = if users.iter().all(|n| *n == 1) { "orders (1 per user)" } else { "orders" };
        push_item(&mut items, users.iter().sum(), per_user);
    }
    items.join(", ")
}

fn deliveries_cell(run: &ScenarioRun) -> String {
    let sent: usize = run.orders.iter().map(|o| o.deliveries).sum();
    let shown: Vec<String> =
        run.orders.iter().flat_map(|o| o.answers.iter().filter(|a| !a.starts_with("api:")).cloned()).collect();
    let mut answers = multiset(&shown);
    // In the order the scenario tells its story (applied before duplicate); surprises last.
    let story: Vec<&String> = run.orders.iter().flat_map(|o| &o.expect.answers).collect();
    answers.sort_by_key(|(label, _)| story.iter().position(|a| *a == label).unwrap_or(usize::MAX));
    let lost: usize = run.orders.iter().map(|o| o.lost).sum();
    if lost > 0 {
        answers.push((s("lost"), lost));
    }
    format!("{sent}: {}", counted(&answers))
}

pub fn build_row(run: &ScenarioRun, seen: &[OrderSeen], rewards: &RewardRule) -> Row {
    if let Some(why) = run.skipped {
        return Row {
            scenario: run.scenario.name().to_owned(),
            channel: run.channel.name().to_owned(),
            deliveries: s("-"),
            expected: why.to_owned(),
            observed: s("-"),
            violations: Vec::new(),
            skipped: true,
        };
    }
    let violations = run
        .orders
        .iter()
        .zip(seen)
        .flat_map(|(r, o)| judge(&r.expect, rewards, o).into_iter().map(move |v| format!("{}: {v}", o.order_no)))
        .collect();
    Row {
        scenario: run.scenario.name().to_owned(),
        channel: run.channel.name().to_owned(),
        deliveries: deliveries_cell(run),
        expected: expected_effects(&run.orders, rewards),
        observed: observed_effects(seen),
        violations,
        skipped: false,
    }
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
