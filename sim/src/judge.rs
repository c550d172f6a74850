//! The verdict on one order: every way what payonce answered and shows
//! breaks what the contract prescribes.

use payonce::domain::Rewards;
use std::collections::BTreeMap;

/// What the simulator knows about the rewards a payment earns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RewardRule {
    /// The in-process payonce: exact counts are expected.
    Known(Rewards),
    /// An external target: only "at most once" can be judged here; payonce's
    /// inspection (`paid_without_rewards`) witnesses missing rewards.
    Unknown,
}

/// What must be true of one order at the end of its scenario.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OrderExpect {
    pub status: String,
    /// Every answer payonce must give, as a multiset (`applied`, `duplicate`,
    /// `refund applied`, `api:create 201 PENDING`, ...). Labels starting with
    /// `api:` are the order API's answers; the rest are shown as deliveries.
    pub answers: Vec<String>,
    /// The outcomes of the order's `pay_callback_log` rows, as a multiset.
    pub payments: Vec<String>,
    /// Rewards were earned (one applied payment).
    pub paid: bool,
    /// Refunded: coupons FROZEN, points reversed.
    pub refunded: bool,
    /// Exact count of each event type for the order; types not listed: none.
    pub events: Vec<(String, usize)>,
    /// Exact count of each inspection finding kind; kinds not listed: none.
    pub findings: Vec<(String, usize)>,
    /// How many orders the order's user must have (triple_click).
    pub orders_of_user: Option<usize>,
    /// The pay_no the order must be paid by, when an answer said which one
    /// won (two_channels).
    pub pay_no: Option<String>,
    /// Where the payment rows came from (`callback`, `query`), as a
    /// multiset; `None`: not judged.
    pub sources: Option<Vec<String>>,
    /// The order's `audit_log` actions (`platform_closed`, ...), as a
    /// multiset; `None`: not judged.
    pub audit: Option<Vec<String>>,
    /// What the simulated platforms and payonce's platform calls must show
    /// of the order (the scenarios that talk to the platforms' APIs), as a
    /// multiset of facts such as `wechatpay trade CLOSED`.
    pub platform: Vec<String>,
}

/// One payment row as `GET /v1/orders/{order_no}` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeenPayment {
    pub pay_no: String,
    pub outcome: String,
    pub state: String,
    /// `callback`, `query`, `reconciliation`.
    pub source: String,
}

/// What the simulator saw of one order: the answers to its deliveries and
/// the read API's view afterwards.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OrderSeen {
    pub order_no: String,
    pub amount: i64,
    /// `None`: the order does not exist (404).
    pub status: Option<String>,
    pub pay_no: Option<String>,
    pub payments: Vec<SeenPayment>,
    /// (coupon_template_id, status)
    pub coupons: Vec<(String, String)>,
    /// (point_type, points)
    pub points: Vec<(String, i64)>,
    pub events: BTreeMap<String, usize>,
    pub findings: BTreeMap<String, usize>,
    pub answers: Vec<String>,
    /// Answers the simulator never received (the gateway timed out).
    pub lost: usize,
    pub orders_of_user: Option<usize>,
    /// The order's `audit_log` actions, oldest first.
    pub audit: Vec<String>,
    /// The facts the scenario saw at the platforms (see [`OrderExpect::platform`]).
    pub platform: Vec<String>,
}

/// Every way `seen` breaks `expect`; empty means exactly once, as promised.
pub fn judge(expect: &OrderExpect, rewards: &RewardRule, seen: &OrderSeen) -> Vec<String> {
    let mut bad = Vec::new();
    // Answers: nothing unexpected; whatever is missing was lost in transit.
    let (missing, extra) = multiset_diff(&expect.answers, &seen.answers);
    if !extra.is_empty() {
        bad.push(format!("answered {} (expected {})", counted(&extra), counted(&multiset(&expect.answers))));
    }
    let missing_n: usize = missing.iter().map(|(_, n)| n).sum();
    if missing_n != seen.lost {
        bad.push(format!("{} answer(s) not seen ({}) but {} lost in transit", missing_n, counted(&missing), seen.lost));
    }
    let Some(status) = &seen.status else {
        bad.push("the order does not exist".into());
        return bad;
    };
    if *status != expect.status {
        bad.push(format!("status {status}, expected {}", expect.status));
    }
    // Payments: one row per pay_no, with the prescribed outcomes, decided.
    let mut rows_per_pay_no: BTreeMap<&str, usize> = BTreeMap::new();
    for p in &seen.payments {
        *rows_per_pay_no.entry(p.pay_no.as_str()).or_default() += 1;
        if p.state != "decided" {
            bad.push(format!("payment {} is in state {}, not decided", p.pay_no, p.state));
        }
    }
    for (pay_no, n) in rows_per_pay_no.iter().filter(|(_, n)| **n > 1) {
        bad.push(format!("pay_no {pay_no} has {n} payment rows"));
    }
    let outcomes: Vec<String> = seen.payments.iter().map(|p| p.outcome.clone()).collect();
    let (missing, extra) = multiset_diff(&expect.payments, &outcomes);
    if !missing.is_empty() || !extra.is_empty() {
        bad.push(format!(
            "payment rows {}, expected {}",
            counted(&multiset(&outcomes)),
            counted(&multiset(&expect.payments))
        ));
    }
    if expect.paid {
        let applied: Vec<&SeenPayment> = seen.payments.iter().filter(|p| p.outcome == "applied").collect();
        if let [one] = applied.as_slice() {
            if seen.pay_no.as_deref() != Some(one.pay_no.as_str()) {
                bad.push(format!("order pay_no {:?} is not the applied payment {}", seen.pay_no, one.pay_no));
            }
        }
    }
    judge_coupons(expect, rewards, seen, &mut bad);
    judge_points(expect, rewards, seen, &mut bad);
    exact_counts("event", &expect.events, &seen.events, &mut bad);
    exact_counts("inspection finding", &expect.findings, &seen.findings, &mut bad);
    if let Some(want) = &expect.pay_no {
        if seen.pay_no.as_ref() != Some(want) {
            bad.push(format!("order pay_no {:?}, but the answers said {want} won", seen.pay_no));
        }
    }
    if let Some(want) = expect.orders_of_user {
        if seen.orders_of_user != Some(want) {
            bad.push(format!("the user has {:?} orders, expected {want}", seen.orders_of_user));
        }
    }
    if let Some(want) = &expect.sources {
        let sources: Vec<String> = seen.payments.iter().map(|p| p.source.clone()).collect();
        let (missing, extra) = multiset_diff(want, &sources);
        if !missing.is_empty() || !extra.is_empty() {
            bad.push(format!(
                "payment sources {}, expected {}",
                counted(&multiset(&sources)),
                counted(&multiset(want))
            ));
        }
    }
    if let Some(want) = &expect.audit {
        let (missing, extra) = multiset_diff(want, &seen.audit);
        if !missing.is_empty() || !extra.is_empty() {
            bad.push(format!("audit rows {}, expected {}", counted(&multiset(&seen.audit)), counted(&multiset(want))));
        }
    }
    let (missing, extra) = multiset_diff(&expect.platform, &seen.platform);
    for (fact, n) in missing {
        bad.push(format!("expected {n}x \"{fact}\", not seen"));
    }
    for (fact, n) in extra {
        bad.push(format!("saw {n}x \"{fact}\", not expected"));
    }
    bad
}

fn judge_coupons(expect: &OrderExpect, rewards: &RewardRule, seen: &OrderSeen, bad: &mut Vec<String>) {
    let mut per_template: BTreeMap<&str, usize> = BTreeMap::new();
    for (template, _) in &seen.coupons {
        *per_template.entry(template.as_str()).or_default() += 1;
    }
    for (template, n) in per_template.iter().filter(|(_, n)| **n > 1) {
        bad.push(format!("{n} coupons of template {template} (at most 1 per order)"));
    }
    match rewards {
        RewardRule::Known(rules) if expect.paid => {
            let want: Vec<&str> = rules.coupon_templates.iter().map(String::as_str).collect();
            let have: Vec<&str> = per_template.keys().copied().collect();
            let mut want_sorted = want.clone();
            want_sorted.sort_unstable();
            if have != want_sorted {
                bad.push(format!("coupon templates {have:?}, expected {want_sorted:?}"));
            }
        }
        _ if !expect.paid && !seen.coupons.is_empty() => {
            bad.push(format!("{} coupon(s) on an order that earned none", seen.coupons.len()));
        }
        _ => {}
    }
    let want_status = if expect.refunded { "FROZEN" } else { "ACTIVE" };
    for (template, status) in seen.coupons.iter().filter(|(_, s)| s != want_status) {
        bad.push(format!("coupon {template} is {status}, expected {want_status}"));
    }
}

fn judge_points(expect: &OrderExpect, rewards: &RewardRule, seen: &OrderSeen, bad: &mut Vec<String>) {
    let paid: Vec<i64> = seen.points.iter().filter(|(t, _)| t == "ORDER_PAID").map(|(_, p)| *p).collect();
    let reversed: Vec<i64> = seen.points.iter().filter(|(t, _)| t == "ORDER_PAID_REVERSAL").map(|(_, p)| *p).collect();
    for (point_type, _) in seen.points.iter().filter(|(t, _)| t != "ORDER_PAID" && t != "ORDER_PAID_REVERSAL") {
        bad.push(format!("unexpected points entry of type {point_type}"));
    }
    if paid.len() > 1 {
        bad.push(format!("{} ORDER_PAID points entries (at most 1 per order)", paid.len()));
    }
    if reversed.len() > 1 {
        bad.push(format!("{} ORDER_PAID_REVERSAL points entries (at most 1 per order)", reversed.len()));
    }
    match rewards {
        RewardRule::Known(rules) => {
            let due = if expect.paid { points_due(rules, seen.amount) } else { 0 };
            let want: Vec<i64> = if due > 0 { vec![due] } else { vec![] };
            if paid != want {
                bad.push(format!("ORDER_PAID points {paid:?}, expected {want:?}"));
            }
        }
        RewardRule::Unknown if !expect.paid && !paid.is_empty() => {
            bad.push("points on an order that earned none".into());
        }
        RewardRule::Unknown => {}
    }
    if expect.refunded {
        let net: i64 = paid.iter().chain(&reversed).sum();
        if reversed.len() != paid.len() || net != 0 {
            bad.push(format!("points {paid:?} reversed by {reversed:?}: expected one reversal to 0"));
        }
    } else if !reversed.is_empty() {
        bad.push(format!("points reversed by {reversed:?} without a refund"));
    }
}

fn exact_counts(what: &str, want: &[(String, usize)], have: &BTreeMap<String, usize>, bad: &mut Vec<String>) {
    let want: BTreeMap<&str, usize> = want.iter().map(|(k, n)| (k.as_str(), *n)).collect();
    let mut keys: Vec<&str> = want.keys().copied().chain(have.keys().map(String::as_str)).collect();
    keys.sort_unstable();
    keys.dedup();
    for key in keys {
        let (w, h) = (want.get(key).copied().unwrap_or(0), have.get(key).copied().unwrap_or(0));
        if w != h {
            bad.push(format!("{h} {what}(s) {key}, expected {w}"));
        }
    }
}

pub fn multiset(items: &[String]) -> Vec<(String, usize)> {
    let mut counts: Vec<(String, usize)> = Vec::new();
    for item in items {
        match counts.iter_mut().find(|(k, _)| k == item) {
            Some((_, n)) => *n += 1,
            None => counts.push((item.clone(), 1)),
        }
    }
    counts
}

/// (in `want` but not in `have`, in `have` but not in `want`), with counts.
/// Labels with their counts, in order of first appearance.
type Counts = Vec<(String, usize)>;

fn multiset_diff(want: &[String], have: &[String]) -> (Counts, Counts) {
    let (want, have) = (multiset(want), multiset(have));
    let count = |set: &[(String, usize)], key: &str| set.iter().find(|(k, _)| k == key).map_or(0, |(_, n)| *n);
    let missing = want
        .iter()
        .filter_map(|(k, n)| n.checked_sub(count(&have, k)).filter(|d| *d > 0).map(|d| (k.clone(), d)))
        .collect();
    let extra = have
        .iter()
        .filter_map(|(k, n)| n.checked_sub(count(&want, k)).filter(|d| *d > 0).map(|d| (k.clone(), d)))
        .collect();
    (missing, extra)
}

pub fn counted(items: &[(String, usize)]) -> String {
    if items.is_empty() {
        return "nothing".into();
    }
    items.iter().map(|(k, n)| format!("{n} {k}")).collect::<Vec<_>>().join(", ")
}

/// The points a payment of `amount` fen earns, from the contract:
/// floor(amount × points_per_yuan / 100). Computed here, not with the
/// service's own arithmetic, so the judge is a second opinion.
pub fn points_due(rules: &Rewards, amount: i64) -> i64 {
    let points = i128::from(amount) * i128::from(rules.points_per_yuan) / 100;
    i64::try_from(points).unwrap_or(i64::MAX)
}

#[cfg(test)]
pub mod tests {
    use super::*;

    pub fn paid_expect() -> OrderExpect {
        OrderExpect {
            status: "PAID".into(),
            answers: vec!["applied".into(), "duplicate".into()],
            payments: vec!["applied".into()],
            paid: true,
            events: vec![("order.paid".into(), 1)],
            ..OrderExpect::default()
        }
    }

    pub fn exactly_once_seen() -> OrderSeen {
        OrderSeen {
            order_no: "ORD-1".into(),
            amount: 9_900,
            status: Some("PAID".into()),
            pay_no: Some("PAY-1".into()),
            payments: vec![SeenPayment {
                pay_no: "PAY-1".into(),
                outcome: "applied".into(),
                state: "decided".into(),
                source: "callback".into(),
            }],
            coupons: vec![("SIM-COUPON".into(), "ACTIVE".into())],
            points: vec![("ORDER_PAID".into(), 99)],
            events: BTreeMap::from([("order.paid".to_owned(), 1)]),
            answers: vec!["applied".into(), "duplicate".into()],
            ..OrderSeen::default()
        }
    }

    pub fn known() -> RewardRule {
        RewardRule::Known(Rewards { coupon_templates: vec!["SIM-COUPON".into()], points_per_yuan: 1 })
    }

    /// The incident: the status changed once, the side effects ran twice.
    pub fn twice_seen() -> OrderSeen {
        let mut twice = exactly_once_seen();
        twice.coupons.push(("SIM-COUPON".into(), "ACTIVE".into()));
        twice.points.push(("ORDER_PAID".into(), 99));
        twice.events.insert("order.paid".into(), 2);
        twice.answers = vec!["applied".into(), "applied".into()];
        twice
    }

    #[test]
    fn the_judge_reports_effects_that_are_not_exactly_once() {
        let (known, expect) = (known(), paid_expect());
        assert_eq!(judge(&expect, &known, &exactly_once_seen()), Vec::<String>::new());
        assert_eq!(judge(&expect, &RewardRule::Unknown, &exactly_once_seen()), Vec::<String>::new());

        for rewards in [&known, &RewardRule::Unknown] {
            let all = judge(&expect, rewards, &twice_seen()).join("\n");
            assert!(all.contains("2 coupons of template SIM-COUPON"), "{all}");
            assert!(all.contains("2 ORDER_PAID points entries"), "{all}");
            assert!(all.contains("order.paid"), "{all}");
            assert!(all.contains("answered 1 applied"), "{all}");
        }

        // Missing rewards are visible when the rewards are known.
        let mut missing = exactly_once_seen();
        missing.coupons.clear();
        missing.points.clear();
        assert_eq!(judge(&expect, &known, &missing).len(), 2, "{:?}", judge(&expect, &known, &missing));

        // A lost answer is allowed only when the simulator really lost one.
        let mut lost = exactly_once_seen();
        lost.answers = vec!["duplicate".into()];
        assert!(!judge(&expect, &known, &lost).is_empty());
        lost.lost = 1;
        assert_eq!(judge(&expect, &known, &lost), Vec::<String>::new());

        // A second payment row for one pay_no, and a refund-time reversal without a refund.
        let mut rows = exactly_once_seen();
        rows.payments.push(rows.payments[0].clone());
        rows.points.push(("ORDER_PAID_REVERSAL".into(), -99));
        let all = judge(&expect, &known, &rows).join("\n");
        assert!(all.contains("pay_no PAY-1 has 2 payment rows"), "{all}");
        assert!(all.contains("without a refund"), "{all}");

        // The answers said which of two payments won: the order must be paid by it.
        let expect_won = OrderExpect { pay_no: Some("PAY-2".into()), ..paid_expect() };
        let all = judge(&expect_won, &known, &exactly_once_seen()).join("\n");
        assert!(all.contains("the answers said PAY-2 won"), "{all}");
    }

    /// The checks of the scenarios that talk to the platforms: where the
    /// payment came from, the audit rows, and what the platforms show.
    #[test]
    fn sources_audit_rows_and_platform_facts_are_judged_when_expected() {
        let known = known();
        let expect = OrderExpect {
            sources: Some(vec!["query".into()]),
            audit: Some(Vec::new()),
            platform: vec!["wechatpay trade SUCCESS".into()],
            ..paid_expect()
        };
        let mut seen = exactly_once_seen();
        seen.payments[0].source = "query".into();
        seen.platform = vec!["wechatpay trade SUCCESS".into()];
        assert_eq!(judge(&expect, &known, &seen), Vec::<String>::new());

        let mut wrong = seen.clone();
        wrong.payments[0].source = "callback".into();
        wrong.audit = vec!["platform_closed".into()];
        wrong.platform = vec!["wechatpay trade CLOSED".into()];
        let all = judge(&expect, &known, &wrong).join("\n");
        assert!(all.contains("payment sources 1 callback, expected 1 query"), "{all}");
        assert!(all.contains("audit rows 1 platform_closed, expected nothing"), "{all}");
        assert!(all.contains("expected 1x \"wechatpay trade SUCCESS\", not seen"), "{all}");
        assert!(all.contains("saw 1x \"wechatpay trade CLOSED\", not expected"), "{all}");

        // Not expected, not judged: the other scenarios set none of them.
        assert_eq!(judge(&paid_expect(), &known, &wrong).len(), 1, "only the unexpected platform fact");
    }

    #[test]
    fn points_are_floor_of_amount_times_rate_over_100() {
        let rules = |n| Rewards { coupon_templates: vec![], points_per_yuan: n };
        for (amount, rate, points) in [(9_999, 3, 299), (99, 1, 0), (100, 1, 1), (9_900, 0, 0)] {
            assert_eq!(points_due(&rules(rate), amount), points, "{amount} x {rate}");
        }
        assert_eq!(points_due(&rules(i64::MAX), i64::MAX), i64::MAX);
    }
}
