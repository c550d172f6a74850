//! unwanted_money: money payonce did not want, returned once.
//!
//! A payment recorded `already_paid`, `paid_after_close` or
//! `amount_mismatch` took the buyer's money for nothing. With
//! `--refund-unwanted auto` payonce asks for its refund in the transaction
//! that records it, submits it to the platform that took it, naming that
//! payment by the platform's own number (WeChat Pay `transaction_id`,
//! Alipay `trade_no`), under refund_no `U-{pay_no}`, for the payment's whole
//! amount; the platform's notice or payonce's query settles it, and the
//! payment reads `resolution: refunded`. The order and its applied payment
//! stay as they were.
//!
//! The buyers, order `i` by [`Way::of`]: paid at both platforms (the
//! channel's notice first, or the partner's), paid at the channel's
//! platform while payonce could not reach it to close the expired order
//! (payonce gives up, closes it here, and the notice that follows is
//! `paid_after_close`), or paid on a trade the merchant's own code made
//! at another amount (`amount_mismatch`). payonce stops between the
//! refunds' requests and their submission (the platforms unreachable for
//! its first try, so nothing reached them) and starts again on its
//! database next to a second payonce process: each refund reaches its
//! platform once. The same buyers against the same payonce with
//! `--refund-unwanted manual` are the "before": every such payment left to
//! the operator, nothing refunded.

use super::{
    api_label, observe, payments_made, round, sim_on, sim_orders, sweep, trade, Call, DbFile, Fault, Kind, OrderRun,
    Pace, PlatformApi, Played, RefundStatus, Scenario, Sim, SimOrder, World, EXPIRES_IN_S, GIVE_UP_MS, PAST_EXPIRY_MS,
    REFUND_QUERY_AFTER_MS,
};
use crate::client::{Conn, ReplyExt, Req};
use crate::judge::{OrderExpect, OrderSeen, SeenRefund};
use crate::local::LocalServer;
use crate::platform::{PaymentNotice, Platform, RefundNotice};
use crate::s;
use payonce::app::Config;
use payonce::config::RefundUnwanted;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::thread;

/// What the buyer of an [`Way::OtherAmount`] order paid beyond the order's
/// amount: a yuan (the price the merchant's own code still had).
const OTHER_AMOUNT_EXTRA: i64 = 100;

/// How an unwanted_money order comes by the payment payonce did not want.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    /// Paid at both platforms, the channel's notice first: the partner's
    /// payment is `already_paid`.
    PartnerSecond,
    /// Paid at the channel's platform while payonce could not reach it to
    /// close the expired order: payonce closes at the partner, gives up on
    /// the channel and closes here; the notice that follows is
    /// `paid_after_close`.
    AfterClose,
    /// Paid at both platforms, the partner's notice first: the channel's
    /// payment is `already_paid`.
    ChannelSecond,
    /// Paid at the channel's platform on a trade the merchant's own code
    /// made at another amount: `amount_mismatch`.
    OtherAmount,
}

impl Way {
    fn of(i: usize) -> Way {
        [Way::PartnerSecond, Way::AfterClose, Way::ChannelSecond, Way::OtherAmount][i % 4]
    }

    fn expires_in_s(self) -> i64 {
        if self == Way::AfterClose {
            EXPIRES_IN_S
        } else {
            3_600
        }
    }
}

/// Whether order `i`'s refund result reaches payonce by the platform's
/// notice first (else by payonce's query, the notice coming late); the
/// orders alternate, and each [`Way`] gets both over eight orders.
fn notified_first(i: usize) -> bool {
    (i + i / 4) % 2 == 0
}

/// One payment of an order: where, its number and amount, and what payonce
/// must decide of it.
#[derive(Clone, Debug)]
struct Paid {
    platform: Platform,
    pay_no: String,
    /// Fen.
    amount: i64,
    outcome: &'static str,
}

impl Paid {
    fn wanted(&self) -> bool {
        self.outcome == "applied"
    }
}

/// One buyer of a pass: the order, how it came by its unwanted payment,
/// its payments in the order their notices arrived, and what payonce
/// answered so far beside what it must have answered.
struct Bought {
    order: SimOrder,
    way: Way,
    payments: Vec<Paid>,
    answers: Vec<String>,
    expected: Vec<String>,
    deliveries: usize,
}

impl Bought {
    fn unwanted(&self) -> &Paid {
        // Every way has exactly one (see `buy`).
        self.payments.iter().find(|p| !p.wanted()).unwrap_or(&self.payments[0])
    }

    fn applied(&self) -> Option<&Paid> {
        self.payments.iter().find(|p| p.wanted())
    }
}

/// The refund_no payonce gives the refund of payment `pay_no`: `U-` and the
/// pay_no, or `U-` and the first 40 hex digits of its SHA-256 when that
/// would be longer than 64 characters.
pub(super) fn unwanted_refund_no(pay_no: &str) -> String {
    let whole = format!("U-{pay_no}");
    if whole.chars().count() <= 64 {
        return whole;
    }
    let digest = Sha256::digest(pay_no.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("U-{}", &hex[..40])
}

impl World {
    /// The simulated platform `platform` is.
    fn at(&self, platform: Platform) -> &Arc<PlatformApi> {
        match platform {
            Platform::Alipay => &self.alipay,
            _ => &self.wechatpay,
        }
    }

    fn set_faults(&self, fault: Option<Fault>) {
        self.wechatpay.set_fault(fault.clone());
        self.alipay.set_fault(fault);
    }
}

/// How these payonces pace their calls: the close given up 3 s after
/// expires_at, a refund's result asked 3 s after its submission.
fn pace() -> Pace {
    Pace { give_up_ms: GIVE_UP_MS, refund_query_after_ms: REFUND_QUERY_AFTER_MS, ..Pace::healthy() }
}

fn config_with(sim: &Sim, world: &World, refund_unwanted: RefundUnwanted) -> Result<Config, String> {
    Ok(Config { refund_unwanted, ..world.config(sim, &pace())? })
}

/// The buyers of one pass up to their payments' notices reaching payonce
/// (served by `here`, its sweeper and pool `app`'s): the orders made, each
/// payment made through payonce at both platforms (but the other-amount
/// ones, made by the merchant's own code at the channel's), the buyers
/// paying, the expired orders closed (given up at the unreachable
/// channel), and the notices.
fn buy(world: &World, here: &Sim, app: &payonce::App, orders: Vec<SimOrder>) -> Result<Vec<Bought>, String> {
    let (api, partner) = (world.api(), world.partner());
    let (channel, partner_platform) = (world.channel, partner.platform());
    let ways: Vec<Way> = (0..orders.len()).map(Way::of).collect();
    let created = here.par_orders(orders.len(), |conn, i| {
        Ok(api_label("create", &here.create_expiring(conn, &orders[i], ways[i].expires_in_s())?))
    })?;
    let through: Vec<SimOrder> =
        orders.iter().zip(&ways).filter(|(_, w)| **w != Way::OtherAmount).map(|(o, _)| o.clone()).collect();
    let mut made = world.create_payments(here, &through)?.into_iter().enumerate();
    let mut bought = Vec::new();
    for ((order, way), created) in orders.into_iter().zip(ways).zip(created) {
        let mut answers = vec![created];
        let mut expected = vec![Sim::created()];
        if way == Way::OtherAmount {
            api.open_trade(&order.no, order.amount + OTHER_AMOUNT_EXTRA)?;
        } else {
            let (k, labels) = made.next().ok_or("a payment made for every order but the other-amount ones")?;
            answers.extend(labels);
            expected.extend(payments_made(channel, partner_platform, k));
        }
        let pays = |at: &PlatformApi, amount: i64, outcome: &'static str| -> Result<Paid, String> {
            let pay_no = at
                .buyer_pays(&order.no)
                .map_err(|e| format!("{}: the buyer could not pay {}: {e:?}", at.platform().name(), order.no))?;
            Ok(Paid { platform: at.platform(), pay_no, amount, outcome })
        };
        let amount = order.amount;
        let payments = match way {
            Way::PartnerSecond => vec![pays(api, amount, "applied")?, pays(partner, amount, "already_paid")?],
            Way::ChannelSecond => vec![pays(partner, amount, "applied")?, pays(api, amount, "already_paid")?],
            Way::AfterClose => vec![pays(api, amount, "paid_after_close")?],
            Way::OtherAmount => vec![pays(api, amount + OTHER_AMOUNT_EXTRA, "amount_mismatch")?],
        };
        bought.push(Bought { order, way, payments, answers, expected, deliveries: 0 });
    }
    if bought.iter().any(|b| b.way == Way::AfterClose) {
        // Expired while the channel's platform is unreachable: payonce closes
        // at the partner, retries the channel, and past the give-up closes here.
        world.clock.advance_ms(PAST_EXPIRY_MS);
        api.set_fault(Some(Fault::Refuse));
        let closed = sweep(app).and_then(|_| round(app)).and_then(|_| {
            world.clock.advance_ms(GIVE_UP_MS);
            round(app)
        });
        api.set_fault(None);
        closed?;
    }
    let notified = here.par_orders(bought.len(), |conn, i| {
        let (mut labels, mut sends) = (Vec::new(), 0);
        for paid in &bought[i].payments {
            let notice = PaymentNotice {
                pay_no: paid.pay_no.clone(),
                order_no: bought[i].order.no.clone(),
                amount: paid.amount,
                success: true,
                attempt: 0,
            };
            let delivery = here.deliver_payment_via(conn, paid.platform, &notice, None)?;
            labels.push(delivery.label);
            sends += delivery.sends;
        }
        Ok((labels, sends))
    })?;
    for (b, (labels, sends)) in bought.iter_mut().zip(notified) {
        b.answers.extend(labels);
        b.expected.extend(b.payments.iter().map(|p| p.platform.label(p.outcome)));
        b.deliveries += sends;
    }
    Ok(bought)
}

/// The refunds the platform holds of payment `paid`, as
/// `U-... 1000 fen Success`.
fn held(world: &World, paid: &Paid) -> Vec<String> {
    let refunds = world.at(paid.platform).refunds();
    let of = refunds.iter().filter(|r| r.pay_no == paid.pay_no);
    of.map(|r| format!("{} {} fen {:?}", r.out_refund_no, r.amount, r.status)).collect()
}

/// How a merchant call names the trade: its `out_trade_no`, and the
/// platform's number (WeChat `transaction_id`, Alipay `trade_no`) as the
/// payment's own or another.
fn naming(platform: Platform, call: &Call, pay_no: &str) -> String {
    let number = if platform == Platform::Alipay { "trade_no" } else { "transaction_id" };
    let mut names = Vec::new();
    if call.body.get("out_trade_no").is_some() {
        names.push(s("out_trade_no"));
    }
    match call.body.get(number).and_then(Value::as_str) {
        Some(no) if no == pay_no => names.push(number.to_owned()),
        Some(_) => names.push(format!("{number} of another payment")),
        None => {}
    }
    if names.is_empty() {
        s("nothing")
    } else {
        names.join(" and ")
    }
}

/// The merchant calls of `kind` about refund `refund_no` at `platform`.
fn calls_of(world: &World, platform: Platform, kind: Kind, refund_no: &str) -> Vec<Call> {
    let calls = world.at(platform).calls();
    let about = |c: &Call| super::classify(platform, c).is_some_and(|(k, no)| k == kind && no == refund_no);
    calls.into_iter().filter(about).collect()
}

/// What the platform did with the refund of `paid`: the submissions it
/// acted on and how they named the trade; at Alipay, how payonce's refund
/// queries named it too (WeChat's query names only the refund).
fn submissions(world: &World, paid: &Paid) -> Vec<String> {
    let no = unwanted_refund_no(&paid.pay_no);
    let accepted: Vec<Call> = calls_of(world, paid.platform, Kind::Refund, &no)
        .into_iter()
        .filter(|c| c.status.is_some_and(|st| st < 500))
        .collect();
    let names: BTreeSet<String> = accepted.iter().map(|c| naming(paid.platform, c, &paid.pay_no)).collect();
    let mut facts = vec![format!(
        "{} acted on {} submissions of its refund, naming the trade by {names:?}",
        paid.platform.name(),
        accepted.len()
    )];
    if paid.platform == Platform::Alipay {
        let queries = calls_of(world, paid.platform, Kind::RefundQuery, &no);
        let names: BTreeSet<String> = queries.iter().map(|c| naming(paid.platform, c, &paid.pay_no)).collect();
        facts.push(format!("alipay's refund queries of it name the trade by {names:?}"));
    }
    facts
}

/// What the submissions must have been (see [`submissions`]): one, by the
/// platform's number; at Alipay, its queries by trade_no.
fn submitted_once(paid: &Paid) -> Vec<String> {
    let number = if paid.platform == Platform::Alipay { "trade_no" } else { "transaction_id" };
    let mut facts = vec![format!(
        "{} acted on 1 submissions of its refund, naming the trade by {{{number:?}}}",
        paid.platform.name()
    )];
    if paid.platform == Platform::Alipay {
        facts.push(s("alipay's refund queries of it name the trade by {\"trade_no\"}"));
    }
    facts
}

/// payonce's view of payment `paid` of `order_no`, of its call to the
/// platform, and of its inspection finding: `the payment refunding, its
/// refund call attempts 0 pending, its refund_required finding refunding
/// with refund REQUESTED`.
fn payonce_view(here: &Sim, conn: &mut Conn, order_no: &str, paid: &Paid, findings: &Value) -> Result<String, String> {
    let detail = here.api(conn, Req::get(format!("/v1/orders/{order_no}")))?.json();
    let list = |key: &str| detail[key].as_array().cloned().unwrap_or_default();
    let resolution = |v: &Value| v.as_str().unwrap_or("unresolved").to_owned();
    let payment = match list("payments").iter().find(|p| p["pay_no"] == paid.pay_no.as_str()) {
        Some(p) => format!("the payment {}", resolution(&p["resolution"])),
        None => s("no such payment"),
    };
    let refund_calls: Vec<String> = list("platform_calls")
        .iter()
        .filter(|c| c["kind"] == "refund" && c["channel"] == paid.platform.name())
        .map(|c| format!("attempts {} {}", c["attempts"], c["status"].as_str().unwrap_or("-")))
        .collect();
    let of_it = |f: &&Value| f["kind"] == "refund_required" && f["detail"]["pay_no"] == paid.pay_no.as_str();
    let finding = match findings["findings"].as_array().into_iter().flatten().find(of_it) {
        None => s("no refund_required finding"),
        Some(f) => {
            let refund =
                f["detail"]["refund"]["status"].as_str().map_or_else(|| s("no refund"), |st| format!("refund {st}"));
            format!("its refund_required finding {} with {refund}", resolution(&f["detail"]["resolution"]))
        }
    };
    Ok(format!("{payment}, its refund calls {refund_calls:?}, {finding}"))
}

/// For each order, the refunds of its unwanted payment at the platform
/// and what payonce shows of it (see [`payonce_view`]).
fn window(world: &World, here: &Sim, bought: &[Bought], when: &str) -> Result<Vec<String>, String> {
    let mut conn = Conn::new(&here.target);
    let findings = here.api(&mut conn, Req::get(s("/v1/inspections")))?.json();
    here.par_orders(bought.len(), |conn, i| {
        let paid = bought[i].unwanted();
        let view = payonce_view(here, conn, &bought[i].order.no, paid, &findings)?;
        Ok(format!("{when}: {} refunds of it at {}, {view}", held(world, paid).len(), paid.platform.name()))
    })
}

/// What [`window`] must see: requested, in flight, reported, not at the
/// platform, `attempts` tries made.
fn window_expected(paid: &Paid, when: &str, attempts: u32) -> String {
    format!(
        "{when}: 0 refunds of it at {}, the payment refunding, its refund calls [\"attempts {attempts} pending\"], \
         its refund_required finding refunding with refund REQUESTED",
        paid.platform.name()
    )
}

/// The trade states the order must end with at each platform it has one
/// (`partner`: the one the buyers of [`Way::AfterClose`] did not pay at).
fn trades_expected(b: &Bought, partner: Platform) -> Vec<String> {
    let refunded = |p: Platform| if p == Platform::Alipay { "TRADE_CLOSED" } else { "REFUND" };
    let paid = |p: Platform| if p == Platform::Alipay { "TRADE_SUCCESS" } else { "SUCCESS" };
    let closed = |p: Platform| if p == Platform::Alipay { "TRADE_CLOSED" } else { "CLOSED" };
    let mut facts: Vec<String> = b
        .payments
        .iter()
        .map(|p| {
            format!("{} trade {}", p.platform.name(), if p.wanted() { paid(p.platform) } else { refunded(p.platform) })
        })
        .collect();
    if b.way == Way::AfterClose {
        facts.push(format!("{} trade {}", partner.name(), closed(partner)));
    }
    facts
}

/// The trade states at each platform the order has a trade at.
fn trades_seen(world: &World, b: &Bought, partner: Platform) -> Vec<String> {
    let mut at: Vec<Platform> = b.payments.iter().map(|p| p.platform).collect();
    if b.way == Way::AfterClose {
        at.push(partner);
    }
    at.into_iter().map(|p| trade(world.at(p), &b.order.no)).collect()
}

/// Every unwanted payment paid at both platforms, after close or at another
/// amount, refunded with `--refund-unwanted auto` across a stop of payonce
/// between the refunds' requests and their submission; then the same buyers
/// against `--refund-unwanted manual`, noted beside.
pub(super) fn unwanted_money(sim: &Sim, world: &World) -> Result<Played, String> {
    eprintln!(
        "unwanted_money ({}): payonce's warnings of unanswered calls are this scenario's faults",
        sim.channel.name()
    );
    let db = DbFile::new(sim, Scenario::UnwantedMoney);
    let config = config_with(sim, world, RefundUnwanted::Auto)?;
    let first = LocalServer::open(db.path()?, world.clock.clone(), config.clone())?;
    let here = sim_on(sim, &first);
    let mut bought = buy(world, &here, &first.app, sim_orders(sim, Scenario::UnwantedMoney, ""))?;
    let mut facts: Vec<Vec<String>> =
        window(world, &here, &bought, "requested")?.into_iter().map(|f| vec![f]).collect();
    // The pool's first try finds both platforms unreachable (nothing
    // reaches them), and payonce stops there, its refunds still to submit.
    world.set_faults(Some(Fault::Refuse));
    let refused = round(&first.app);
    world.set_faults(None);
    refused?;
    for (facts, seen) in facts.iter_mut().zip(window(world, &here, &bought, "unreachable, then stopped")?) {
        facts.push(seen);
    }
    drop(first);
    // Started again on its database, next to a second payonce process: both
    // work the next round at once, then the second stops.
    let second = LocalServer::open(db.path()?, world.clock.clone(), config.clone())?;
    let other = LocalServer::open(db.path()?, world.clock.clone(), config)?;
    world.clock.advance_ms(super::retry_ms());
    let rounds: Result<Vec<usize>, String> = thread::scope(|scope| {
        let one = scope.spawn(|| round(&second.app));
        let two = scope.spawn(|| round(&other.app));
        [one, two].into_iter().map(|r| r.join().unwrap_or_else(|_| Err(s("a pool round panicked")))).collect()
    });
    rounds?;
    drop(other);
    let here = sim_on(sim, &second);
    // Asked after --refund-query-after-s: still processing there.
    world.clock.advance_ms(REFUND_QUERY_AFTER_MS);
    round(&second.app)?;
    for b in &bought {
        let paid = b.unwanted();
        let no = unwanted_refund_no(&paid.pay_no);
        if !world.at(paid.platform).settle_refund(&no, RefundStatus::Success) {
            return Err(format!("{}: no refund {no} of {} to settle", paid.platform.name(), b.order.no));
        }
    }
    // Settled: the platform's notice reaches payonce first for half the
    // orders; for the others payonce's query finds it, and the notice that
    // comes late is a duplicate.
    let mut notify = |late: bool| -> Result<(), String> {
        let sent = here.par_orders(bought.len(), |conn, i| {
            if notified_first(i) == late {
                return Ok(None);
            }
            let paid = bought[i].unwanted();
            let at = world.at(paid.platform);
            let notice: RefundNotice = at
                .refund_notice(&unwanted_refund_no(&paid.pay_no))
                .ok_or_else(|| format!("{}: no notice of {}'s refund", paid.platform.name(), paid.pay_no))?;
            Ok(Some((here.deliver_refund_via(conn, paid.platform, &notice)?, paid.platform)))
        })?;
        for (b, sent) in bought.iter_mut().zip(sent) {
            if let Some((delivery, platform)) = sent {
                b.answers.push(delivery.label);
                b.expected.push(format!("refund {}", platform.label(if late { "duplicate" } else { "applied" })));
                b.deliveries += delivery.sends;
            }
        }
        Ok(())
    };
    notify(false)?;
    world.clock.advance_ms(super::retry_ms());
    round(&second.app)?;
    notify(true)?;
    // Nothing more to do: a last round submits nothing again.
    world.clock.advance_ms(super::retry_ms() * 5);
    round(&second.app)?;
    for (facts, seen) in facts.iter_mut().zip(window(world, &here, &bought, "in the end")?) {
        facts.push(seen);
    }

    let partner = world.partner().platform();
    let mut runs = Vec::new();
    for (b, facts) in bought.iter().zip(facts.iter_mut()) {
        let paid = b.unwanted();
        let refund_no = unwanted_refund_no(&paid.pay_no);
        facts.push(format!(
            "{} refunds of the {} payment: {:?}",
            paid.platform.name(),
            paid.outcome,
            held(world, paid)
        ));
        facts.extend(submissions(world, paid));
        if let Some(applied) = b.applied() {
            facts.push(format!(
                "{} refunds of the applied payment: {:?}",
                applied.platform.name(),
                held(world, applied)
            ));
        }
        facts.extend(trades_seen(world, b, partner));
        let mut platform = vec![
            window_expected(paid, "requested", 0),
            window_expected(paid, "unreachable, then stopped", 1),
            format!(
                "in the end: 1 refunds of it at {}, the payment refunded, its refund calls [\"attempts 2 done\"], no \
                 refund_required finding",
                paid.platform.name()
            ),
            format!(
                "{} refunds of the {} payment: {:?}",
                paid.platform.name(),
                paid.outcome,
                [format!("{refund_no} {} fen Success", paid.amount)]
            ),
        ];
        platform.extend(submitted_once(paid));
        if let Some(applied) = b.applied() {
            platform.push(format!("{} refunds of the applied payment: []", applied.platform.name()));
        }
        platform.extend(trades_expected(b, partner));
        let resolutions = b
            .payments
            .iter()
            .map(|p| {
                let refunds = if p.wanted() {
                    Vec::new()
                } else {
                    vec![SeenRefund::new(&unwanted_refund_no(&p.pay_no), p.amount, "SUCCEEDED")]
                };
                let seen = crate::judge::SeenPayment {
                    pay_no: p.pay_no.clone(),
                    outcome: p.outcome.to_owned(),
                    resolution: if p.wanted() { String::new() } else { s("refunded") },
                    refunds,
                    ..crate::judge::SeenPayment::default()
                };
                seen.resolution_label()
            })
            .collect();
        let refunded = [(s("payment.refund_required"), 1), (s("payment.refunded"), 1)];
        let mut audit = vec![s("payment_refund_requested"), s("payment_refunded")];
        let (status, events, findings) = match b.way {
            Way::PartnerSecond | Way::ChannelSecond => ("PAID", vec![(s("order.paid"), 1)], Vec::new()),
            Way::AfterClose => {
                audit.push(s("close_given_up"));
                ("CLOSED", vec![(s("order.closed"), 1)], vec![(s("close_unconfirmed"), 1)])
            }
            Way::OtherAmount => ("PENDING", Vec::new(), Vec::new()),
        };
        runs.push(OrderRun {
            order: b.order.clone(),
            expect: OrderExpect {
                status: s(status),
                answers: b.expected.clone(),
                payments: b.payments.iter().map(|p| s(p.outcome)).collect(),
                paid: b.applied().is_some(),
                refunds: Some(Vec::new()),
                refunded_amount: Some(0),
                events: events.into_iter().chain(refunded).collect(),
                findings,
                pay_no: b.applied().map(|p| p.pay_no.clone()),
                sources: Some(b.payments.iter().map(|_| s("callback")).collect()),
                audit: Some(audit),
                resolutions: Some(resolutions),
                platform,
                ..OrderExpect::default()
            },
            answers: b.answers.clone(),
            lost: 0,
            deliveries: b.deliveries,
        });
    }
    let seen = observe(&here, Scenario::UnwantedMoney, &runs, facts)?;
    drop(second);
    drop(db);

    let before = left_to_the_operator(sim, world)?;
    let after = tally(world, &bought, &seen);
    let ways: BTreeMap<&str, usize> = bought.iter().fold(BTreeMap::new(), |mut n, b| {
        *n.entry(b.unwanted().outcome).or_default() += 1;
        n
    });
    let ways: Vec<String> = ways.iter().map(|(outcome, n)| format!("{n} {outcome}")).collect();
    let note = format!(
        "unwanted_money ({}): {} orders, a payment payonce did not want on each ({}). Before (--refund-unwanted \
         manual): {before}. After (--refund-unwanted auto, payonce stopped between the refunds' requests and their \
         submission and started again): {after}",
        sim.channel.name(),
        bought.len(),
        ways.join(", "),
    );
    Ok((runs, seen, vec![note]))
}

/// `3 refund_required findings open, 0 refunds at the platforms (...)`:
/// what a pass came to for the unwanted payments of `bought`.
fn tally(world: &World, bought: &[Bought], seen: &[OrderSeen]) -> String {
    let open: usize = seen.iter().map(|o| o.findings.get("refund_required").copied().unwrap_or(0)).sum();
    let (mut refunds, mut once) = (0, 0);
    for b in bought {
        let paid = b.unwanted();
        let of_it: Vec<_> = world.at(paid.platform).refunds().into_iter().filter(|r| r.pay_no == paid.pay_no).collect();
        refunds += of_it.len();
        once += usize::from(matches!(of_it.as_slice(), [one] if one.amount == paid.amount));
    }
    let resolved = seen.iter().flat_map(|o| &o.payments).filter(|p| p.resolution == "refunded").count();
    format!(
        "{open} refund_required findings open, {refunds} refunds at the platforms ({once} payments refunded once \
         in full), {resolved} payments resolved refunded"
    )
}

/// The same buyers against a payonce with `--refund-unwanted manual` (the
/// default): what its inspection and the platforms show once its pool has
/// run as it would.
fn left_to_the_operator(sim: &Sim, world: &World) -> Result<String, String> {
    let payonce = LocalServer::open(":memory:", world.clock.clone(), config_with(sim, world, RefundUnwanted::Manual)?)?;
    let there = sim_on(sim, &payonce);
    let bought = buy(world, &there, &payonce.app, sim_orders(sim, Scenario::UnwantedMoney, "b"))?;
    for _ in 0..2 {
        world.clock.advance_ms(REFUND_QUERY_AFTER_MS);
        round(&payonce.app)?;
    }
    let mut conn = Conn::new(&there.target);
    let findings = there.findings(&mut conn)?;
    let seen: Vec<OrderSeen> = super::read_back(&there, &bought.iter().map(|b| b.order.clone()).collect::<Vec<_>>())?
        .into_iter()
        .map(|mut o| {
            o.findings = findings.get(&o.order_no).cloned().unwrap_or_default();
            o
        })
        .collect();
    Ok(tally(world, &bought, &seen))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payments_refund_no_is_u_and_its_pay_no_or_a_digest_of_a_long_one() {
        assert_eq!(unwanted_refund_no("4200000000000000000000000001"), "U-4200000000000000000000000001");
        let longest = "9".repeat(62);
        assert_eq!(unwanted_refund_no(&longest), format!("U-{longest}"));
        // One more character: `U-` and 40 hex digits of SHA-256 of the pay_no.
        let long = "9".repeat(63);
        let no = unwanted_refund_no(&long);
        assert_eq!(no.len(), 42);
        assert!(no[2..].bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()), "{no}");
        assert_eq!(unwanted_refund_no(&long), no, "the same payment, the same refund_no");
        assert_ne!(unwanted_refund_no(&"9".repeat(64)), no);
    }

    #[test]
    fn every_way_and_both_ways_of_hearing_the_result_come_in_eight_orders() {
        let ways: Vec<Way> = (0..4).map(Way::of).collect();
        assert_eq!(ways, [Way::PartnerSecond, Way::AfterClose, Way::ChannelSecond, Way::OtherAmount]);
        for way in ways {
            let heard: BTreeSet<bool> = (0..8).filter(|i| Way::of(*i) == way).map(notified_first).collect();
            assert_eq!(heard.len(), 2, "{way:?}");
        }
    }
}
