//! The verdict on one order: every way what payonce answered and shows
//! breaks what payonce's docs prescribe (docs/, docs/openapi.yaml).

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
    /// Refunded in full: coupons FROZEN, points reversed to 0.
    pub refunded: bool,
    /// The order's refunds as `GET /v1/orders/{order_no}` lists them, as a
    /// multiset; `None`: not judged. Its SUCCEEDED ones, in this order, are
    /// the refunds the points reversals follow; `None` with `refunded`: one
    /// refund of the whole order.
    pub refunds: Option<Vec<SeenRefund>>,
    /// The order's `refunded_amount`; `None`: not judged.
    pub refunded_amount: Option<i64>,
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
    /// Each payment with its resolution and its own refunds, as
    /// [`SeenPayment::resolution_label`] writes it, as a multiset; `None`:
    /// not judged.
    pub resolutions: Option<Vec<String>>,
    /// What the simulated platforms and payonce's platform calls must show
    /// of the order (the scenarios that talk to the platforms' APIs), as a
    /// multiset of facts such as `wechatpay trade CLOSED`.
    pub platform: Vec<String>,
}

impl OrderExpect {
    /// The amounts of the refunds that must have succeeded, in the order
    /// they succeed, on an order of `amount` fen.
    pub fn succeeded_refunds(&self, amount: i64) -> Vec<i64> {
        match &self.refunds {
            Some(refunds) => refunds.iter().filter(|r| r.status == "SUCCEEDED").map(|r| r.amount).collect(),
            None if self.refunded => vec![amount],
            None => Vec::new(),
        }
    }
}

/// One refund as `GET /v1/orders/{order_no}` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeenRefund {
    pub refund_no: String,
    /// Fen.
    pub amount: i64,
    /// `REQUESTED`, `SUCCEEDED`, `FAILED`.
    pub status: String,
}

impl SeenRefund {
    pub fn new(refund_no: &str, amount: i64, status: &str) -> SeenRefund {
        SeenRefund { refund_no: refund_no.to_owned(), amount, status: status.to_owned() }
    }

    fn label(&self) -> String {
        format!("{} {} {}", self.refund_no, self.amount, self.status)
    }
}

/// One payment row as `GET /v1/orders/{order_no}` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeenPayment {
    pub pay_no: String,
    pub outcome: String,
    pub state: String,
    /// `callback`, `query`, `reconciliation`.
    pub source: String,
    /// `refunding`, `refunded`, `refunded_externally`, `accepted`; empty
    /// when null (or not shown).
    pub resolution: String,
    /// The payment's own refunds (money it took that payonce returns).
    pub refunds: Vec<SeenRefund>,
}

impl SeenPayment {
    /// `PAY-1 already_paid refunded, refunds [U-PAY-1 990 SUCCEEDED]`;
    /// `unresolved` for a null resolution.
    pub fn resolution_label(&self) -> String {
        let resolution = if self.resolution.is_empty() { "unresolved" } else { self.resolution.as_str() };
        let refunds: Vec<String> = self.refunds.iter().map(SeenRefund::label).collect();
        format!("{} {} {resolution}, refunds [{}]", self.pay_no, self.outcome, refunds.join(", "))
    }
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
    /// `None`: the order does not show it.
    pub refunded_amount: Option<i64>,
    pub refunds: Vec<SeenRefund>,
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
    if let Some(want) = &expect.resolutions {
        let have: Vec<String> = seen.payments.iter().map(SeenPayment::resolution_label).collect();
        let (missing, extra) = multiset_diff(want, &have);
        if !missing.is_empty() || !extra.is_empty() {
            bad.push(format!("payments {}, expected {}", counted(&multiset(&have)), counted(&multiset(want))));
        }
    }
    if let Some(want) = expect.refunded_amount {
        if seen.refunded_amount != Some(want) {
            bad.push(format!("refunded_amount {:?}, expected {want}", seen.refunded_amount));
        }
    }
    if let Some(want) = &expect.refunds {
        let want: Vec<String> = want.iter().map(SeenRefund::label).collect();
        let have: Vec<String> = seen.refunds.iter().map(SeenRefund::label).collect();
        let (missing, extra) = multiset_diff(&want, &have);
        if !missing.is_empty() || !extra.is_empty() {
            bad.push(format!("refunds {}, expected {}", counted(&multiset(&have)), counted(&multiset(&want))));
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
    let earned = match rewards {
        RewardRule::Known(rules) => {
            let due = if expect.paid { points_due(rules, seen.amount) } else { 0 };
            let want: Vec<i64> = if due > 0 { vec![due] } else { vec![] };
            if paid != want {
                bad.push(format!("ORDER_PAID points {paid:?}, expected {want:?}"));
            }
            due
        }
        RewardRule::Unknown if !expect.paid && !paid.is_empty() => {
            bad.push("points on an order that earned none".into());
            0
        }
        // Unknown rewards: the reversals must follow the points it shows.
        RewardRule::Unknown => paid.first().copied().unwrap_or(0),
    };
    let succeeded = expect.succeeded_refunds(seen.amount);
    if succeeded.is_empty() {
        if !reversed.is_empty() {
            bad.push(format!("points reversed by {reversed:?} without a refund"));
        }
        return;
    }
    // An entry of 0 points reverses nothing: neither required nor refused.
    let nonzero = |entries: Vec<i64>| -> Vec<i64> {
        let mut entries: Vec<i64> = entries.into_iter().filter(|p| *p != 0).collect();
        entries.sort_unstable();
        entries
    };
    let want = nonzero(reversals(earned, seen.amount, &succeeded));
    if nonzero(reversed.clone()) != want {
        bad.push(format!(
            "points {paid:?} reversed by {reversed:?}, expected {want:?} (refunds of {succeeded:?} of {})",
            seen.amount
        ));
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

/// The points a payment of `amount` fen earns, as docs/platforms.md has it:
/// floor(amount × points_per_yuan / 100). Computed here, not with the
/// service's own arithmetic, so the judge is a second opinion.
pub fn points_due(rules: &Rewards, amount: i64) -> i64 {
    let points = i128::from(amount) * i128::from(rules.points_per_yuan) / 100;
    i64::try_from(points).unwrap_or(i64::MAX)
}

/// The points entries with which refunds of `refunds` fen (in the order
/// they succeed) take back `points` earned by an order of `amount` fen, as
/// docs/platforms.md has them: each floor(points × refund / amount), and the one
/// that leaves nothing to refund whatever is still unreversed, so an order
/// refunded in full reverses exactly what it earned. Negative, as
/// `point_log` holds them; computed here, not with the service's code.
pub fn reversals(points: i64, amount: i64, refunds: &[i64]) -> Vec<i64> {
    let (mut refunded, mut reversed) = (0i64, 0i64);
    refunds
        .iter()
        .map(|&refund| {
            refunded = refunded.saturating_add(refund);
            let back = if refunded >= amount {
                points - reversed
            } else {
                let share = i128::from(points) * i128::from(refund) / i128::from(amount.max(1));
                i64::try_from(share).unwrap_or(i64::MAX)
            };
            reversed += back;
            -back
        })
        .collect()
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
                ..SeenPayment::default()
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

    /// A payment payonce did not want: its resolution and its own refunds
    /// are judged when expected, the order's refunds apart.
    #[test]
    fn a_payments_resolution_and_refunds_are_judged_when_expected() {
        let refunded = |resolution: &str, status: &str| SeenPayment {
            pay_no: "PAY-2".into(),
            outcome: "already_paid".into(),
            state: "decided".into(),
            source: "callback".into(),
            resolution: resolution.into(),
            refunds: vec![SeenRefund::new("U-PAY-2", 9_900, status)],
        };
        assert_eq!(
            refunded("refunded", "SUCCEEDED").resolution_label(),
            "PAY-2 already_paid refunded, refunds [U-PAY-2 9900 SUCCEEDED]"
        );
        assert_eq!(exactly_once_seen().payments[0].resolution_label(), "PAY-1 applied unresolved, refunds []");
        let expect = OrderExpect {
            payments: vec!["applied".into(), "already_paid".into()],
            resolutions: Some(vec![
                "PAY-1 applied unresolved, refunds []".into(),
                "PAY-2 already_paid refunded, refunds [U-PAY-2 9900 SUCCEEDED]".into(),
            ]),
            refunds: Some(Vec::new()),
            ..paid_expect()
        };
        let mut seen = exactly_once_seen();
        seen.payments.push(refunded("refunded", "SUCCEEDED"));
        assert_eq!(judge(&expect, &known(), &seen), Vec::<String>::new());
        let mut refunding = exactly_once_seen();
        refunding.payments.push(refunded("refunding", "REQUESTED"));
        let all = judge(&expect, &known(), &refunding).join("\n");
        assert!(
            all.contains("payments 1 PAY-1 applied unresolved, refunds [], 1 PAY-2 already_paid refunding"),
            "{all}"
        );
        // A payment's refund in the order's own list is the order's refund.
        let mut listed = seen;
        listed.refunds.push(SeenRefund::new("U-PAY-2", 9_900, "SUCCEEDED"));
        assert!(judge(&expect, &known(), &listed)
            .join("\n")
            .contains("refunds 1 U-PAY-2 9900 SUCCEEDED, expected nothing"));
    }

    #[test]
    fn reversals_follow_each_refund_and_the_last_takes_what_is_left() {
        // 10 points on 10.03 yuan: 3.00 yuan is 2.99 points, floored to 2;
        // 2.00 is 1.99, floored to 1; the 5.03 that empties the order takes
        // the 7 left, not its floor of 5.01.
        assert_eq!(reversals(10, 1_003, &[300, 200, 503]), [-2, -1, -7]);
        assert_eq!(reversals(99, 9_906, &[2_971, 1_981, 4_954]), [-29, -19, -51]);
        assert_eq!(reversals(7, 1_000, &[500, 500]), [-3, -4], "3.5 is 3; the rest is 4");
        // Not refunded in full: floors only, points stay.
        assert_eq!(reversals(10, 1_003, &[300, 200]), [-2, -1]);
        // One refund of the whole order reverses all of it.
        assert_eq!(reversals(10, 1_003, &[1_003]), [-10]);
        assert_eq!(reversals(0, 1_003, &[300, 703]), [0, 0]);
        assert_eq!(reversals(10, 1_003, &[]), Vec::<i64>::new());
        assert_eq!(reversals(i64::MAX, i64::MAX, &[i64::MAX - 1, 1]), [-(i64::MAX - 1), -1]);
        for amount in [1_000, 1_003, 4_567, 9_906] {
            for points in [0, 1, 10, 45, 99] {
                let parts = [amount * 30 / 100, amount * 20 / 100, amount - amount * 30 / 100 - amount * 20 / 100];
                let entries = reversals(points, amount, &parts);
                assert_eq!(entries.iter().sum::<i64>(), -points, "{amount} {points} {entries:?}");
                assert!(entries.iter().all(|p| *p <= 0), "{entries:?}");
            }
        }
    }

    /// Three refunds of one order, one failed on the way, the last emptying it.
    fn partly_refunded(amount: i64) -> (OrderExpect, OrderSeen) {
        let refunds = vec![
            SeenRefund::new("R1", 300, "SUCCEEDED"),
            SeenRefund::new("R2", 200, "FAILED"),
            SeenRefund::new("R3", 200, "SUCCEEDED"),
            SeenRefund::new("R4", amount - 500, "SUCCEEDED"),
        ];
        let expect = OrderExpect {
            status: "REFUNDED".into(),
            answers: vec!["applied".into()],
            refunded: true,
            refunds: Some(refunds.clone()),
            refunded_amount: Some(amount),
            ..paid_expect()
        };
        let seen = OrderSeen {
            amount,
            status: Some("REFUNDED".into()),
            coupons: vec![("SIM-COUPON".into(), "FROZEN".into())],
            points: vec![
                ("ORDER_PAID".into(), 10),
                ("ORDER_PAID_REVERSAL".into(), -2),
                ("ORDER_PAID_REVERSAL".into(), -1),
                ("ORDER_PAID_REVERSAL".into(), -7),
            ],
            answers: vec!["applied".into()],
            refunded_amount: Some(amount),
            refunds,
            ..exactly_once_seen()
        };
        (expect, seen)
    }

    #[test]
    fn partial_refunds_are_judged_by_their_rows_the_refunded_amount_and_each_reversal() {
        let (expect, seen) = partly_refunded(1_003);
        assert_eq!(expect.succeeded_refunds(1_003), [300, 200, 503]);
        for rewards in [known(), RewardRule::Unknown] {
            assert_eq!(judge(&expect, &rewards, &seen), Vec::<String>::new());
        }

        // Reversals rounded to the nearest (3, 2, 5) are not payonce's rule (docs/platforms.md).
        let mut rounded = seen.clone();
        rounded.points.truncate(1);
        rounded.points.extend([-3, -2, -5].map(|p| ("ORDER_PAID_REVERSAL".to_owned(), p)));
        let all = judge(&expect, &known(), &rounded).join("\n");
        assert!(all.contains("reversed by [-3, -2, -5], expected [-7, -2, -1]"), "{all}");
        // One reversal of the whole, as a full refund would have it.
        let mut once = seen.clone();
        once.points = vec![("ORDER_PAID".into(), 10), ("ORDER_PAID_REVERSAL".into(), -10)];
        assert!(judge(&expect, &RewardRule::Unknown, &once).join("\n").contains("expected [-7, -2, -1]"));
        // The failed refund missing, the balance short.
        let mut short = seen.clone();
        short.refunds.remove(1);
        short.refunded_amount = Some(700);
        let all = judge(&expect, &known(), &short).join("\n");
        assert!(all.contains("refunded_amount Some(700), expected 1003"), "{all}");
        assert!(all.contains("refunds 1 R1 300 SUCCEEDED, 1 R3 200 SUCCEEDED, 1 R4 503 SUCCEEDED, expected"), "{all}");
        // An order without refunded_amount (a payonce before it) is not one that has it.
        let mut older = seen;
        older.refunded_amount = None;
        assert_eq!(judge(&expect, &known(), &older), ["refunded_amount None, expected 1003"]);

        // Nothing expected of them: not judged; a full refund reverses all.
        let full = OrderExpect { refunds: None, refunded_amount: None, ..expect };
        let mut whole = once;
        whole.refunds.clear();
        assert_eq!(judge(&full, &known(), &whole), Vec::<String>::new());
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
