//! A scenario's row of the table: what it expected of its orders against
//! what payonce shows of them, and the violations between the two.

use super::{OrderRun, ScenarioRun};
use crate::judge::{counted, judge, multiset, points_due, reversals, OrderExpect, OrderSeen, RewardRule};
use crate::s;
use crate::table::Row;
use std::collections::BTreeMap;

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
    // Succeeded refunds per order that has any.
    let refunds: Vec<usize> =
        runs.iter().map(|r| r.expect.succeeded_refunds(r.order.amount).len()).filter(|n| *n > 0).collect();
    match rewards {
        RewardRule::Known(rules) => {
            push_item(&mut items, paid * rules.coupon_templates.len(), coupon);
            let points = runs.iter().filter(|r| r.expect.paid && points_due(rules, r.order.amount) > 0).count();
            push_item(&mut items, points, "points");
            if !refunds.is_empty() {
                let reversed: usize = runs
                    .iter()
                    .filter(|r| r.expect.paid)
                    .map(|r| {
                        let (amount, succeeded) = (r.order.amount, r.expect.succeeded_refunds(r.order.amount));
                        reversals(points_due(rules, amount), amount, &succeeded).iter().filter(|p| **p != 0).count()
                    })
                    .sum();
                push_item(&mut items, reversed, "reversals");
            }
        }
        RewardRule::Unknown if paid > 0 => {
            items.push(format!("<=1 {coupon}/template/order"));
            items.push(s("<=1 points/order"));
            match refunds.iter().max() {
                None => {}
                Some(1) => items.push(s("1 reversal per points")),
                Some(n) if refunds.iter().all(|k| k == n) => items.push(format!("{n} reversals per points")),
                Some(_) => items.push(s("1 reversal per refund and points")),
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
    let statuses: Vec<String> =
        expects.iter().flat_map(|e| e.refunds.iter().flatten()).map(|r| r.status.clone()).collect();
    refund_items(&mut items, &statuses);
    items.join(", ")
}

/// `9 SUCCEEDED refunds, 3 FAILED refunds`, in the order first seen.
fn refund_items(items: &mut Vec<String>, statuses: &[String]) {
    for (status, n) in multiset(statuses) {
        push_item(items, n, &format!("{status} refunds"));
    }
}

/// `refunds`: the run's expectations list the orders' refunds, so the
/// observed refunds are shown beside them (elsewhere they are not).
fn observed_effects(seen: &[OrderSeen], refunds: bool) -> String {
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
    if refunds {
        let statuses: Vec<String> = seen.iter().flat_map(|o| &o.refunds).map(|r| r.status.clone()).collect();
        refund_items(&mut items, &statuses);
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

pub(super) fn build_row(run: &ScenarioRun, seen: &[OrderSeen], rewards: &RewardRule) -> Row {
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
        observed: observed_effects(seen, run.orders.iter().any(|o| o.expect.refunds.is_some())),
        violations,
        skipped: false,
    }
}
