//! Reconciliation (docs/operations.md: `POST /v1/reconciliations` and
//! `payonce reconcile`) on fixture statements built here, one per
//! format, following the published layouts:
//!
//! - `generic`: `pay_no,order_no,amount,status,paid_at`, minor units;
//! - `wechatpay`: WeChat Pay's trade bill: a header row beginning 交易时间,
//!   detail rows whose values start with a backtick, then the 总交易单数
//!   summary block; amounts in yuan; Beijing time;
//! - `alipay`: Alipay's 业务明细 CSV, GBK-encoded: `#` metadata lines, values
//!   padded with tabs, refund rows (业务类型 退款) negative; Beijing time.
//!
//! Every format sees the same local payments and the same logical statement,
//! so the expected differences are the same except where the day boundary
//! (UTC for generic, UTC+8 for the platforms) says otherwise.
//!
//! Local payments are made by signed callbacks carrying `paid_at` on an app
//! with a manual clock set a minute after each paid time, so every paid time
//! is deterministic and inside the platform-time window (docs/decisions.md).

use crate::util::{self, count, footprint, payonce_cli, read_only, Footprint, Server, TempDir, SECRET};
use payonce::api::{self, Request};
use payonce::clock::{format_ms, parse_rfc3339_ms};
use payonce::recon::Format;
use payonce::{App, Clock, Config, Rewards};
use serde_json::{json, Value};
use std::path::Path;

const REWARDS: [&str; 4] = ["--coupon", "NEW10", "--points-per-yuan", "1"];
/// The statement's day.
const DAY: &str = "2024-01-02";
/// payonce's clock while the fixtures are made: inside DAY in UTC and in UTC+8.
const SEED_CLOCK: &str = "2024-01-02T06:00:00Z";
const BEIJING_MS: i64 = 8 * 3_600_000;

fn ms(text: &str) -> i64 {
    parse_rfc3339_ms(text).unwrap_or_else(|| panic!("bad time {text}"))
}

fn config() -> Config {
    Config {
        rewards: Rewards { coupon_templates: vec!["NEW10".into()], points_per_yuan: 1 },
        platforms: payonce::platforms::Platforms::with([payonce::platforms::Platform::notices(
            payonce::platforms::generic::Generic::new(vec![SECRET.as_bytes().to_vec()]),
        )]),
        ..Config::default()
    }
}

fn open_app(db: &Path) -> App {
    App::open(&db.display().to_string(), Clock::manual(ms(SEED_CLOCK)), config()).expect("open app")
}

fn handle(app: &App, method: &str, target: &str, headers: &[(&str, &str)], body: Vec<u8>) -> (u16, Value) {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let headers = headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
    let resp =
        api::handle(app, &Request { method: method.into(), path: path.into(), query: query.into(), headers, body });
    let value = serde_json::from_slice(&resp.body)
        .unwrap_or_else(|e| panic!("{method} {target}: not JSON ({e}): {}", String::from_utf8_lossy(&resp.body)));
    (resp.status, value)
}

fn post_json(app: &App, path: &str, body: &Value) -> (u16, Value) {
    handle(app, "POST", path, &[("Content-Type", "application/json")], body.to_string().into_bytes())
}

fn signed(app: &App, path: &str, body: &Value) -> (u16, Value) {
    let bytes = body.to_string().into_bytes();
    let signature = payonce::signature::sign(SECRET.as_bytes(), app.clock().now_ms().div_euclid(1000), &bytes);
    handle(app, "POST", path, &[("Content-Type", "application/json"), ("Payonce-Signature", &signature)], bytes)
}

// ---- the local side ----

/// (order_no, amount)
const ORDERS: [(&str, i64); 8] = [
    ("RC-M1", 9900),
    ("RC-M2", 5000),
    ("RC-L1", 1234),
    ("RC-R1", 2000),
    ("RC-X1", 3000),
    ("RC-E1", 4100),
    ("RC-E2", 4200),
    ("RC-OUT", 4300),
];

/// (pay_no, order_no, amount, paid_at as the platform sent it, outcome)
const PAYMENTS: [(&str, &str, i64, &str, &str); 9] = [
    ("P-M1", "RC-M1", 9900, "2024-01-02T11:00:00+08:00", "applied"),
    ("P-M1b", "RC-M1", 9900, "2024-01-02T11:05:00+08:00", "already_paid"),
    ("P-M2", "RC-M2", 5000, "2024-01-02T04:00:00Z", "applied"),
    ("P-R1", "RC-R1", 2000, "2024-01-02T05:00:00Z", "applied"),
    ("P-X1", "RC-X1", 3000, "2024-01-02T07:00:00Z", "applied"),
    // A second payment of RC-X1 the platform does not list: not applied, so never missing_remote.
    ("P-X1b", "RC-X1", 3000, "2024-01-02T07:01:00Z", "already_paid"),
    // 2024-01-02 00:30 in Beijing, 2024-01-01 in UTC.
    ("P-E1", "RC-E1", 4100, "2024-01-01T16:30:00Z", "applied"),
    // 2024-01-03 00:30 in Beijing, 2024-01-02 in UTC.
    ("P-E2", "RC-E2", 4200, "2024-01-02T16:30:00Z", "applied"),
    // Outside every period except an explicit date=2024-01-05.
    ("P-OUT", "RC-OUT", 4300, "2024-01-05T11:00:00+08:00", "applied"),
];

/// Orders, payments (with paid_at) and one refund settled inside DAY, on a
/// file database, all through `channel`: the platform whose statement the
/// test compares (a statement compares its own platform's money only).
/// Generic payments arrive as signed callbacks; another platform's through
/// the library, as its verified notices would.
fn seed(db: &Path, channel: &str) {
    let app = open_app(db);
    for (order_no, amount) in ORDERS {
        let (status, body) =
            post_json(&app, "/v1/orders", &json!({"order_no": order_no, "user_id": "u-rc", "amount": amount}));
        assert_eq!(status, 201, "{order_no}: {body}");
    }
    for (pay_no, order_no, amount, paid_at, outcome) in PAYMENTS {
        assert_eq!(deliver(&app, channel, pay_no, order_no, amount, paid_at), outcome, "{pay_no}");
    }
    app.clock().set_ms(ms(SEED_CLOCK));
    refund_whole(&app, channel, "RC-R1", "RF-R1");
}

/// A payment's outcome, delivered through `channel` a minute after it was
/// paid at `paid_at`: within the platform-time window, so the platform's
/// time is the one reconciliation dates it by.
fn deliver(app: &App, channel: &str, pay_no: &str, order_no: &str, amount: i64, paid_at: &str) -> String {
    let body =
        json!({"pay_no": pay_no, "order_no": order_no, "amount": amount, "status": "SUCCESS", "paid_at": paid_at});
    app.clock().set_ms(ms(paid_at) + 60_000);
    if channel == "generic" {
        let (status, answer) = signed(app, "/v1/callbacks/generic", &body);
        assert_eq!(status, 200, "{pay_no}: {answer}");
        return answer["outcome"].as_str().unwrap_or_default().to_owned();
    }
    let callback = payonce::PaymentCallback {
        channel: channel.into(),
        pay_no: pay_no.into(),
        order_no: order_no.into(),
        amount,
        currency: None,
        status: payonce::PlatformStatus::Success,
        paid_at: Some(format_ms(ms(paid_at))),
        raw_body: body.to_string().into_bytes(),
    };
    app.payments().deliver_payment(&callback).expect("deliver").outcome_str().to_owned()
}

/// The whole of `order_no` refunded as `refund_no`, its success told by `channel`.
fn refund_whole(app: &App, channel: &str, order_no: &str, refund_no: &str) {
    let (status, body) = post_json(app, &format!("/v1/orders/{order_no}/refund"), &json!({"refund_no": refund_no}));
    assert_eq!(status, 200, "{body}");
    let refund = payonce::RefundCallback {
        channel: channel.into(),
        refund_no: refund_no.into(),
        order_no: order_no.into(),
        status: payonce::PlatformStatus::Success,
        settled_at: None,
        amount: None,
        refunded_total: None,
    };
    assert_eq!(app.refunds().deliver_refund(&refund).expect("deliver refund").as_str(), "applied");
}

// ---- the platform side ----

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Payment,
    Refund,
}

/// One statement row: for a refund, `id` is the refund_no and `pay_no` the
/// payment it refunds; `order_amount` is the order's amount in yuan columns
/// that are not the refund amount.
struct Row {
    kind: Kind,
    id: &'static str,
    pay_no: &'static str,
    order_no: &'static str,
    fen: i64,
    order_amount: i64,
    utc: &'static str,
}

/// What the platform says happened on DAY.
fn statement_rows() -> Vec<Row> {
    let pay =
        |id, order_no, fen, utc| Row { kind: Kind::Payment, id, pay_no: id, order_no, fen, order_amount: fen, utc };
    vec![
        pay("P-M1", "RC-M1", 9900, "2024-01-02T03:00:00Z"),
        pay("P-M1b", "RC-M1", 9900, "2024-01-02T03:05:00Z"),
        // The platform moved 60.00; payonce recorded 50.00.
        pay("P-M2", "RC-M2", 6000, "2024-01-02T04:00:00Z"),
        // Never delivered to payonce (漏单).
        pay("P-L1", "RC-L1", 1234, "2024-01-02T08:00:00Z"),
        pay("P-R1", "RC-R1", 2000, "2024-01-02T05:00:00Z"),
        Row {
            kind: Kind::Refund,
            id: "RF-R1",
            pay_no: "P-R1",
            order_no: "RC-R1",
            fen: 2000,
            order_amount: 2000,
            utc: "2024-01-02T06:30:00Z",
        },
        // A refund payonce never asked for.
        Row {
            kind: Kind::Refund,
            id: "RF-GONE",
            pay_no: "P-M1",
            order_no: "RC-M1",
            fen: 500,
            order_amount: 9900,
            utc: "2024-01-02T07:30:00Z",
        },
    ]
}

fn yuan(fen: i64) -> String {
    format!("{}.{:02}", fen / 100, fen % 100)
}

/// `YYYY-MM-DD HH:MM:SS` in Beijing time.
fn beijing(utc: &str) -> String {
    format_ms(ms(utc) + BEIJING_MS)[..19].replace('T', " ")
}

fn generic_statement(rows: &[Row]) -> Vec<u8> {
    let mut out = String::from("pay_no,order_no,amount,status,paid_at\n");
    for (i, r) in rows.iter().enumerate() {
        let status = if r.kind == Kind::Payment { "SUCCESS" } else { "REFUND" };
        // Offsets vary: the same instant in UTC+8 or in Z.
        let paid_at = if i % 2 == 0 { format!("{}+08:00", beijing(r.utc).replace(' ', "T")) } else { r.utc.to_owned() };
        out.push_str(&format!("{},{},{},{status},{paid_at}\n", r.id, r.order_no, r.fen));
    }
    out.into_bytes()
}

const WECHAT_HEADER: &str = "交易时间,公众账号ID,商户号,特约商户号,设备号,微信订单号,商户订单号,用户标识,交易类型,交易状态,付款银行,货币种类,应结订单金额,代金券金额,微信退款单号,商户退款单号,退款金额,充值券退款金额,退款类型,退款状态,商品名称,商户数据包,手续费,费率,订单金额,申请退款金额,费率备注";

fn wechat_row(r: &Row) -> String {
    let (state, refund_id, refund_no, refund_amount, refund_state) = match r.kind {
        Kind::Payment => ("SUCCESS", "0".to_owned(), "0", "0.00".to_owned(), ""),
        Kind::Refund => ("REFUND", format!("50300{}", r.id.len()), r.id, yuan(r.fen), "SUCCESS"),
    };
    let order_amount = yuan(r.order_amount);
    let fields = [
        beijing(r.utc),
        "wx2421b1c4370ec43b".into(),
        "10000100".into(),
        "0".into(),
        "".into(),
        r.pay_no.into(),
        r.order_no.into(),
        "oUpF8uMuAJO_M2pxb1Q9zNjWeS6o".into(),
        "JSAPI".into(),
        state.into(),
        "CMC".into(),
        "CNY".into(),
        order_amount.clone(),
        "0.00".into(),
        refund_id,
        refund_no.into(),
        refund_amount.clone(),
        "0.00".into(),
        if r.kind == Kind::Refund { "ORIGINAL".into() } else { "".into() },
        refund_state.into(),
        "payonce test goods".into(),
        "".into(),
        "0.01000".into(),
        "0.60%".into(),
        order_amount,
        refund_amount,
        "".into(),
    ];
    fields.iter().map(|f| format!("`{f}")).collect::<Vec<_>>().join(",")
}

/// A WeChat Pay trade bill (ALL): BOM, header, backticked detail rows, summary.
fn wechat_statement(rows: &[Row]) -> Vec<u8> {
    let mut lines = vec![format!("\u{feff}{WECHAT_HEADER}")];
    lines.extend(rows.iter().map(wechat_row));
    let paid: i64 = rows.iter().filter(|r| r.kind == Kind::Payment).map(|r| r.fen).sum();
    let refunded: i64 = rows.iter().filter(|r| r.kind == Kind::Refund).map(|r| r.fen).sum();
    lines.push("总交易单数,应结订单总金额,退款总金额,充值券退款总金额,手续费总金额,订单总金额,申请退款总金额".into());
    lines.push(format!(
        "`{},`{},`{},`0.00,`0.07,`{},`{}",
        rows.len(),
        yuan(paid),
        yuan(refunded),
        yuan(paid),
        yuan(refunded)
    ));
    (lines.join("\r\n") + "\r\n").into_bytes()
}

const ALIPAY_HEADER: &str = "支付宝交易号,商户订单号,业务类型,商品名称,创建时间,完成时间,门店编号,门店名称,操作员,终端号,对方账户,订单金额（元）,商家实收（元）,支付宝红包（元）,集分宝（元）,支付宝优惠（元）,商家优惠（元）,券核销金额（元）,券名称,商家红包消费金额（元）,卡消费金额（元）,退款批次号/请求号,服务费（元）,分润（元）,备注";

/// Lines before the column header (`#` metadata).
const ALIPAY_PREAMBLE: [&str; 4] = [
    "#支付宝业务明细查询",
    "#账号：[20880000000000000156]",
    "#起始日期：[2024年01月02日 00:00:00]   终止日期：[2024年01月03日 00:00:00]",
    "#-----------------------------------------业务明细列表----------------------------------------",
];

fn alipay_row(r: &Row) -> String {
    let (kind, amount, refund_no, fee) = match r.kind {
        Kind::Payment => ("交易", yuan(r.fen), "", "-0.01"),
        Kind::Refund => ("退款", format!("-{}", yuan(r.fen)), r.id, "0.01"),
    };
    let created = beijing(&format_ms(ms(r.utc) - 60_000));
    let fields = [
        r.pay_no.to_owned(),
        r.order_no.into(),
        kind.into(),
        "payonce test goods".into(),
        created,
        beijing(r.utc),
        "".into(),
        "".into(),
        "".into(),
        "".into(),
        "buy***@example.com".into(),
        amount.clone(),
        amount,
        "0.00".into(),
        "0.00".into(),
        "0.00".into(),
        "0.00".into(),
        "0.00".into(),
        "".into(),
        "0.00".into(),
        "0.00".into(),
        refund_no.into(),
        fee.into(),
        "0.00".into(),
        "".into(),
    ];
    // Alipay pads every value with a tab.
    fields.iter().map(|f| format!("{f}\t")).collect::<Vec<_>>().join(",")
}

fn alipay_text(rows: &[Row]) -> String {
    let mut lines: Vec<String> = ALIPAY_PREAMBLE.iter().map(|l| l.to_string()).collect();
    lines.push(ALIPAY_HEADER.into());
    lines.extend(rows.iter().map(alipay_row));
    let payments = rows.iter().filter(|r| r.kind == Kind::Payment).count();
    lines.push("#-----------------------------------------业务明细列表结束------------------------------------".into());
    lines.push(format!("#交易合计：{payments}笔，退款合计：{}笔", rows.len() - payments));
    lines.push("#导出时间：[2024年01月03日 09:00:00]".into());
    lines.join("\r\n") + "\r\n"
}

fn gbk(text: &str) -> Vec<u8> {
    let (bytes, _, unmappable) = encoding_rs::GBK.encode(text);
    assert!(!unmappable, "the fixture is GBK-encodable");
    assert!(std::str::from_utf8(&bytes).is_err(), "the fixture really is GBK, not UTF-8");
    bytes.into_owned()
}

fn alipay_statement(rows: &[Row]) -> Vec<u8> {
    gbk(&alipay_text(rows))
}

fn statement(format: Format, rows: &[Row]) -> Vec<u8> {
    match format {
        Format::Generic => generic_statement(rows),
        Format::Wechatpay => wechat_statement(rows),
        Format::Alipay => alipay_statement(rows),
        other => panic!("no fixture in the {} format", other.as_str()),
    }
}

fn content_type(format: Format) -> &'static str {
    match format {
        Format::Generic => "text/csv",
        Format::Wechatpay => "text/csv; charset=utf-8",
        Format::Alipay => "text/plain; charset=GBK",
        other => panic!("no fixture in the {} format", other.as_str()),
    }
}

// ---- expectations ----

/// (pay_no, order_no, amount_platform, amount_local) of a difference list, sorted.
type Diff = (String, String, Option<i64>, Option<i64>);

/// null, or an integer number of minor units (never a float or a string).
fn minor_units(value: &Value) -> Option<i64> {
    match value {
        Value::Null => None,
        v => Some(v.as_i64().unwrap_or_else(|| panic!("an amount is an integer of minor units or null: {v}"))),
    }
}

fn diffs(list: &Value) -> Vec<Diff> {
    let mut rows: Vec<Diff> = list
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {list}"))
        .iter()
        .map(|r| {
            for key in ["pay_no", "order_no", "amount_platform", "amount_local"] {
                assert!(r.get(key).is_some(), "row without {key}: {r}");
            }
            (
                r["pay_no"].as_str().unwrap_or_default().to_owned(),
                r["order_no"].as_str().unwrap_or_default().to_owned(),
                minor_units(&r["amount_platform"]),
                minor_units(&r["amount_local"]),
            )
        })
        .collect();
    rows.sort();
    rows
}

fn diff(pay_no: &str, order_no: &str, platform: Option<i64>, local: Option<i64>) -> Diff {
    (pay_no.to_owned(), order_no.to_owned(), platform, local)
}

struct Expected {
    period: Vec<&'static str>,
    matched: u64,
    missing_local: Vec<Diff>,
    missing_remote: Vec<Diff>,
    amount_mismatch: Vec<Diff>,
}

fn check(result: &Value, expected: &Expected, context: &str) {
    assert_eq!(result["period"], json!(expected.period), "{context}: period: {result}");
    // Every row is of the statement's platform, as the answer says.
    let channel = &result["channel"];
    assert!(channel.is_string(), "{context}: channel: {result}");
    for list in ["missing_local", "missing_remote", "amount_mismatch"] {
        for row in result[list].as_array().into_iter().flatten() {
            assert_eq!(&row["channel"], channel, "{context}: {list}: {row}");
        }
    }
    assert_eq!(result["matched"].as_u64(), Some(expected.matched), "{context}: matched: {result}");
    assert_eq!(diffs(&result["missing_local"]), expected.missing_local, "{context}: missing_local: {result}");
    assert_eq!(diffs(&result["missing_remote"]), expected.missing_remote, "{context}: missing_remote: {result}");
    assert_eq!(diffs(&result["amount_mismatch"]), expected.amount_mismatch, "{context}: amount_mismatch: {result}");
}

/// The differences of the fixture statement against the seeded payments,
/// before any repair.
fn expected_before_repair(format: Format) -> Expected {
    // The day boundary decides which edge payment is inside DAY.
    let edge = match format {
        Format::Generic => diff("P-E2", "RC-E2", None, Some(4200)),
        Format::Wechatpay | Format::Alipay => diff("P-E1", "RC-E1", None, Some(4100)),
        other => panic!("no fixture in the {} format", other.as_str()),
    };
    let mut missing_remote = vec![edge, diff("P-X1", "RC-X1", None, Some(3000))];
    missing_remote.sort();
    Expected {
        period: vec![DAY],
        // P-M1, P-M1b (already_paid: money moved), P-R1, and the refund RF-R1.
        matched: 4,
        missing_local: vec![diff("P-L1", "RC-L1", Some(1234), None), diff("RF-GONE", "RC-M1", Some(500), None)],
        missing_remote,
        amount_mismatch: vec![diff("P-M2", "RC-M2", Some(6000), Some(5000))],
    }
}

/// After P-L1 was repaired: it is matched, the rest is unchanged.
fn expected_after_repair(format: Format) -> Expected {
    let mut expected = expected_before_repair(format);
    expected.matched += 1;
    expected.missing_local.retain(|d| d.0 != "P-L1");
    expected
}

/// `date=` moves the period: only payments paid on that day are compared.
fn date_overrides(format: Format) -> Vec<(&'static str, Vec<Diff>)> {
    let out = diff("P-OUT", "RC-OUT", None, Some(4300));
    match format {
        Format::Generic => {
            vec![("2024-01-05", vec![out]), ("2024-01-01", vec![diff("P-E1", "RC-E1", None, Some(4100))])]
        }
        Format::Wechatpay | Format::Alipay => {
            vec![("2024-01-05", vec![out]), ("2024-01-03", vec![diff("P-E2", "RC-E2", None, Some(4200))])]
        }
        other => panic!("no fixture in the {} format", other.as_str()),
    }
}

fn reconcile_in_process(app: &App, format: Format, bytes: &[u8], date: Option<&str>, repair: bool) -> Value {
    let result = app
        .operations()
        .reconcile(format, bytes, date, repair, &mut |_, _| {})
        .unwrap_or_else(|e| panic!("reconcile {format:?}: {e:?}"));
    result.to_json()
}

/// `util::request` (which also decodes chunked bodies).
fn request(server: &Server, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> util::HttpResponse {
    util::request(server.addr, method, path, headers, body)
}

fn reconcile_http(server: &Server, format: Format, bytes: &[u8], repair: bool) -> Value {
    let path = format!("/v1/reconciliations?format={}&repair={repair}", format.as_str());
    let resp = request(server, "POST", &path, &[("Content-Type", content_type(format))], bytes);
    assert_eq!(resp.status, 200, "{path}: {}", resp.text());
    resp.json()
}

/// The repaired payment: applied from reconciliation, with the rewards of a callback.
fn check_repaired(db: &Path, format: Format, context: &str) {
    let conn = read_only(db);
    let (outcome, source, channel, paid_at): (String, String, String, Option<String>) = conn
        .query_row("SELECT outcome, source, channel, paid_at FROM pay_callback_log WHERE pay_no = 'P-L1'", [], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
        })
        .unwrap_or_else(|e| panic!("{context}: P-L1 recorded: {e}"));
    assert_eq!((outcome.as_str(), source.as_str()), ("applied", "reconciliation"), "{context}");
    assert!(["generic", format.as_str()].contains(&channel.as_str()), "{context}: channel {channel}");
    assert_eq!(paid_at.as_deref(), Some("2024-01-02T08:00:00.000Z"), "{context}: the platform's paid time");
    let (status, pay_no): (String, Option<String>) = conn
        .query_row("SELECT status, pay_no FROM orders WHERE order_no = 'RC-L1'", [], |r| Ok((r.get(0)?, r.get(1)?)))
        .expect("order");
    assert_eq!((status.as_str(), pay_no.as_deref()), ("PAID", Some("P-L1")), "{context}");
    let of_order = |sql: &str| count(&conn, sql, ["RC-L1"]);
    assert_eq!(
        of_order("SELECT count(*) FROM user_coupon c JOIN orders o ON o.id = c.order_id WHERE o.order_no = ?1 AND c.coupon_template_id = 'NEW10' AND c.status = 'ACTIVE'"),
        1,
        "{context}: the coupon"
    );
    assert_eq!(
        of_order("SELECT coalesce(sum(points), 0) FROM point_log l JOIN orders o ON o.id = l.order_id WHERE o.order_no = ?1 AND l.point_type = 'ORDER_PAID'"),
        12,
        "{context}: floor(1234 x 1 / 100) points"
    );
    assert_eq!(
        of_order("SELECT count(*) FROM outbox_event WHERE order_no = ?1 AND event_id = 'order.paid:' || ?1"),
        1,
        "{context}"
    );
}

/// What the first repair adds: one record, one coupon, one points entry, one event; no order, no refund.
fn check_first_repair_footprint(before: &Footprint, after: &Footprint, context: &str) {
    for (table, added) in [
        ("orders", 0),
        ("refund", 0),
        ("pay_callback_log", 1),
        ("user_coupon", 1),
        ("point_log", 1),
        ("outbox_event", 1),
    ] {
        assert_eq!(after[table] - before[table], added, "{context}: rows added to {table}");
    }
}

fn reconcile_cli(db: &Path, statement: &Path, format: Format, repair: bool) -> (Option<i32>, Value) {
    let (db, statement) = (db.display().to_string(), statement.display().to_string());
    let mut args = vec!["reconcile", "--db", &db, "--statement", &statement, "--format", format.as_str()];
    if repair {
        args.push("--repair");
    }
    let (code, stdout, stderr) = payonce_cli(&args);
    let result = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("reconcile printed no JSON ({e}): stdout {stdout:?}, stderr {stderr:?}"));
    (code, result)
}

// ---- one test per format ----

#[test]
fn generic_statement_in_process_over_http_repaired_twice_and_by_cli() {
    let format = Format::Generic;
    let dir = TempDir::new("recon-generic");
    let db = dir.path("generic.db");
    seed(&db, format.as_str());
    let bytes = statement(format, &statement_rows());

    {
        let app = open_app(&db);
        check(&reconcile_in_process(&app, format, &bytes, None, false), &expected_before_repair(format), "in process");
        for (date, missing_remote) in date_overrides(format) {
            let result = reconcile_in_process(&app, format, &bytes, Some(date), false);
            assert_eq!(result["period"], json!([date]), "date={date}: {result}");
            assert_eq!(diffs(&result["missing_remote"]), missing_remote, "date={date}: {result}");
        }
        // The same through the route, in process, with the date as a query parameter.
        let (status, result) = handle(
            &app,
            "POST",
            "/v1/reconciliations?format=generic&date=2024-01-05",
            &[("Content-Type", "text/csv")],
            bytes.clone(),
        );
        assert_eq!(status, 200, "{result}");
        assert_eq!(
            (result["period"].clone(), diffs(&result["missing_remote"])),
            (json!(["2024-01-05"]), vec![diff("P-OUT", "RC-OUT", None, Some(4300))])
        );
    }

    let server = Server::start_on(&db, &REWARDS);
    check(&reconcile_http(&server, format, &bytes, false), &expected_before_repair(format), "HTTP, no repair");
    let before = footprint(&read_only(&db));
    reconcile_http(&server, format, &bytes, true);
    let after_first = footprint(&read_only(&db));
    check_first_repair_footprint(&before, &after_first, "HTTP repair");
    check_repaired(&db, format, "HTTP repair");
    let second = reconcile_http(&server, format, &bytes, true);
    assert_eq!(footprint(&read_only(&db)), after_first, "the second repair changes nothing");
    check(&second, &expected_after_repair(format), "HTTP, second repair");

    // The CLI: JSON on stdout; exit 1 with differences, 0 when clean.
    let file = dir.path("statement.csv");
    std::fs::write(&file, &bytes).expect("write statement");
    let (code, result) = reconcile_cli(&db, &file, format, false);
    assert_eq!(code, Some(1), "differences: exit 1: {result}");
    check(&result, &expected_after_repair(format), "CLI");
    // A statement that agrees with every payment and refund payonce has on DAY (UTC).
    let pay =
        |id, order_no, fen, utc| Row { kind: Kind::Payment, id, pay_no: id, order_no, fen, order_amount: fen, utc };
    let clean = [
        pay("P-M1", "RC-M1", 9900, "2024-01-02T03:00:00Z"),
        pay("P-M2", "RC-M2", 5000, "2024-01-02T04:00:00Z"),
        pay("P-L1", "RC-L1", 1234, "2024-01-02T08:00:00Z"),
        pay("P-R1", "RC-R1", 2000, "2024-01-02T05:00:00Z"),
        pay("P-X1", "RC-X1", 3000, "2024-01-02T07:00:00Z"),
        pay("P-E2", "RC-E2", 4200, "2024-01-02T16:30:00Z"),
        Row {
            kind: Kind::Refund,
            id: "RF-R1",
            pay_no: "P-R1",
            order_no: "RC-R1",
            fen: 2000,
            order_amount: 2000,
            utc: "2024-01-02T06:30:00Z",
        },
    ];
    let clean_file = dir.path("clean.csv");
    std::fs::write(&clean_file, generic_statement(&clean)).expect("write statement");
    let (code, result) = reconcile_cli(&db, &clean_file, format, false);
    let expected = Expected {
        period: vec![DAY],
        matched: 7,
        missing_local: vec![],
        missing_remote: vec![],
        amount_mismatch: vec![],
    };
    check(&result, &expected, "CLI, clean statement");
    assert_eq!(code, Some(0), "clean: exit 0: {result}");
}

#[test]
fn wechatpay_trade_bill_over_http_and_repaired_twice_in_process() {
    let format = Format::Wechatpay;
    let dir = TempDir::new("recon-wechat");
    let db = dir.path("wechat.db");
    seed(&db, format.as_str());
    let bytes = statement(format, &statement_rows());
    {
        let app = open_app(&db);
        check(&reconcile_in_process(&app, format, &bytes, None, false), &expected_before_repair(format), "in process");
        for (date, missing_remote) in date_overrides(format) {
            let result = reconcile_in_process(&app, format, &bytes, Some(date), false);
            assert_eq!(result["period"], json!([date]), "date={date}: {result}");
            assert_eq!(diffs(&result["missing_remote"]), missing_remote, "date={date}: {result}");
        }
    }
    {
        let server = Server::start_on(&db, &REWARDS);
        check(&reconcile_http(&server, format, &bytes, false), &expected_before_repair(format), "HTTP");
    }

    let app = open_app(&db);
    let before = footprint(&read_only(&db));
    let first = reconcile_in_process(&app, format, &bytes, None, true);
    assert!(
        diffs(&first["missing_local"]).iter().any(|d| d.0 == "P-L1"),
        "the first repair found P-L1 missing: {first}"
    );
    let after_first = footprint(&read_only(&db));
    check_first_repair_footprint(&before, &after_first, "in-process repair");
    check_repaired(&db, format, "in-process repair");
    let second = reconcile_in_process(&app, format, &bytes, None, true);
    assert_eq!(footprint(&read_only(&db)), after_first, "the second repair changes nothing");
    check(&second, &expected_after_repair(format), "second repair");
}

#[test]
fn alipay_gbk_statement_over_http_and_repaired_twice_by_cli() {
    let format = Format::Alipay;
    let dir = TempDir::new("recon-alipay");
    let db = dir.path("alipay.db");
    seed(&db, format.as_str());
    let bytes = statement(format, &statement_rows());
    {
        let app = open_app(&db);
        check(&reconcile_in_process(&app, format, &bytes, None, false), &expected_before_repair(format), "in process");
        for (date, missing_remote) in date_overrides(format) {
            let result = reconcile_in_process(&app, format, &bytes, Some(date), false);
            assert_eq!(result["period"], json!([date]), "date={date}: {result}");
            assert_eq!(diffs(&result["missing_remote"]), missing_remote, "date={date}: {result}");
        }
        // The same statement saved as UTF-8 reads the same.
        let utf8 = alipay_text(&statement_rows()).into_bytes();
        check(&reconcile_in_process(&app, format, &utf8, None, false), &expected_before_repair(format), "UTF-8 alipay");
    }
    {
        let server = Server::start_on(&db, &REWARDS);
        check(&reconcile_http(&server, format, &bytes, false), &expected_before_repair(format), "HTTP");
    }

    // Offline repair applies the rewards serve recorded in the database.
    let file = dir.path("alipay.csv");
    std::fs::write(&file, &bytes).expect("write statement");
    let before = footprint(&read_only(&db));
    let (code, first) = reconcile_cli(&db, &file, format, true);
    assert_eq!(code, Some(1), "differences: exit 1: {first}");
    let after_first = footprint(&read_only(&db));
    check_first_repair_footprint(&before, &after_first, "CLI repair");
    check_repaired(&db, format, "CLI repair");
    let (code, second) = reconcile_cli(&db, &file, format, true);
    assert_eq!(code, Some(1), "RF-GONE and the rest remain: {second}");
    assert_eq!(footprint(&read_only(&db)), after_first, "the second repair changes nothing");
    check(&second, &expected_after_repair(format), "CLI, second repair");
}

// ---- refused statements ----

/// A valid generic header and `rows` after it.
fn generic_with(rows: &[&str]) -> Vec<u8> {
    let mut text = String::from("pay_no,order_no,amount,status,paid_at\n");
    for r in rows {
        text.push_str(r);
        text.push('\n');
    }
    text.into_bytes()
}

fn wechat_with(detail: &str) -> Vec<u8> {
    format!("{WECHAT_HEADER}\n{detail}\n总交易单数,应结订单总金额\n`1,`99.00\n").into_bytes()
}

/// The fixture's alipay row for `r` with one field replaced (0-based column).
fn alipay_with(r: &Row, column: usize, value: &str) -> Vec<u8> {
    let mut fields: Vec<String> = alipay_row(r).split(',').map(str::to_owned).collect();
    fields[column] = format!("{value}\t");
    let mut lines: Vec<String> = ALIPAY_PREAMBLE.iter().map(|l| l.to_string()).collect();
    lines.push(ALIPAY_HEADER.into());
    lines.push(fields.join(","));
    gbk(&(lines.join("\r\n") + "\r\n"))
}

#[test]
fn bad_statements_are_refused_naming_the_line_and_change_nothing() {
    let dir = TempDir::new("recon-bad");
    let db = dir.path("bad.db");
    seed(&db, "generic");
    let app = open_app(&db);
    let good_wechat = wechat_row(&statement_rows()[0]);
    let rows = statement_rows();
    let refund = rows.iter().find(|r| r.id == "RF-R1").expect("refund row");
    let payment = &rows[0];
    // (case, query, body, message must contain)
    let cases: Vec<(&str, &str, Vec<u8>, &str)> = vec![
        (
            "generic: bad header",
            "format=generic",
            b"pay_no,order_no,amount,status\nP-1,RC-M1,9900,SUCCESS\n".to_vec(),
            "header",
        ),
        (
            "generic: yuan in minor units",
            "format=generic",
            generic_with(&[
                "P-M1,RC-M1,9900,SUCCESS,2024-01-02T03:00:00Z",
                "P-M2,RC-M2,99.5,SUCCESS,2024-01-02T04:00:00Z",
            ]),
            "line 3",
        ),
        (
            "generic: float-looking 99.00",
            "format=generic",
            generic_with(&["P-M1,RC-M1,9900.00,SUCCESS,2024-01-02T03:00:00Z"]),
            "line 2",
        ),
        (
            "generic: exponent",
            "format=generic",
            generic_with(&["P-M1,RC-M1,1e3,SUCCESS,2024-01-02T03:00:00Z"]),
            "line 2",
        ),
        ("generic: zero", "format=generic", generic_with(&["P-M1,RC-M1,0,SUCCESS,2024-01-02T03:00:00Z"]), "line 2"),
        ("generic: status", "format=generic", generic_with(&["P-M1,RC-M1,9900,PAID,2024-01-02T03:00:00Z"]), "line 2"),
        (
            "generic: paid_at without offset",
            "format=generic",
            generic_with(&["P-M1,RC-M1,9900,SUCCESS,2024-01-02T03:00:00"]),
            "line 2",
        ),
        ("generic: columns", "format=generic", generic_with(&["P-M1,RC-M1,9900,SUCCESS"]), "line 2"),
        (
            "generic: identifier",
            "format=generic",
            generic_with(&["P M1,RC-M1,9900,SUCCESS,2024-01-02T03:00:00Z"]),
            "line 2",
        ),
        (
            "generic: not UTF-8",
            "format=generic",
            b"pay_no,order_no,amount,status,paid_at\n\xff\xfe,O,1,SUCCESS,2024-01-02T03:00:00Z\n".to_vec(),
            "",
        ),
        ("wechatpay: no header row", "format=wechatpay", good_wechat.clone().into_bytes(), "header"),
        (
            "wechatpay: 3-decimal yuan",
            "format=wechatpay",
            wechat_with(&good_wechat.replace("`99.00", "`99.001")),
            "line 2",
        ),
        ("wechatpay: float words", "format=wechatpay", wechat_with(&good_wechat.replace("`99.00", "`1e2")), "line 2"),
        (
            "wechatpay: time",
            "format=wechatpay",
            wechat_with(&good_wechat.replace("`2024-01-02 11:00:00", "`2024/01/02 11:00")),
            "line 2",
        ),
        ("alipay: no header row", "format=alipay", gbk("#支付宝业务明细查询\n"), "header"),
        ("alipay: 3-decimal refund", "format=alipay", alipay_with(refund, 11, "-20.001"), "line 6"),
        ("alipay: negative payment", "format=alipay", alipay_with(payment, 11, "-99.00"), "line 6"),
        ("alipay: unit in the amount", "format=alipay", alipay_with(payment, 11, "99.00元"), "line 6"),
        ("unknown format", "format=paypal", generic_with(&[]), "format"),
        ("repair not a boolean", "format=generic&repair=yes", generic_with(&[]), "repair"),
        ("impossible date", "format=generic&date=2024-02-30", generic_with(&[]), "date"),
        ("date without dashes", "format=generic&date=20240102", generic_with(&[]), "date"),
    ];
    let before = footprint(&read_only(&db));
    for (case, query, body, needle) in &cases {
        // repair=true wherever the case is not about repair: a refusal must repair nothing.
        let query = if query.contains("repair=") { query.to_string() } else { format!("{query}&repair=true") };
        let (status, answer) = handle(
            &app,
            "POST",
            &format!("/v1/reconciliations?{query}"),
            &[("Content-Type", "text/csv")],
            body.clone(),
        );
        assert_eq!(status, 400, "{case}: {answer}");
        assert_eq!(answer["error"]["code"], "invalid_request", "{case}: {answer}");
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(needle), "{case}: the message names {needle:?}: {message:?}");
    }
    assert_eq!(footprint(&read_only(&db)), before, "a refused statement repairs nothing");

    // Over 16 MiB: 413 in process and over the wire; a statement over 64 KiB is fine.
    let huge = vec![b'#'; 16 * 1024 * 1024 + 1];
    let (status, answer) =
        handle(&app, "POST", "/v1/reconciliations?format=generic", &[("Content-Type", "text/csv")], huge.clone());
    assert_eq!((status, answer["error"]["code"].as_str()), (413, Some("payload_too_large")), "{answer}");
    drop(app);

    // No sweep while this runs: the fixture's unpaid RC-L1 expired long ago
    // by the real clock, and closing it would be a write this test never made.
    let server = Server::start_on(&db, &[&REWARDS[..], &["--sweep-interval-s", "3600"]].concat());
    let resp = util::request(
        server.addr,
        "POST",
        "/v1/reconciliations?format=generic",
        &[("Content-Type", "text/csv")],
        &huge,
    );
    assert_eq!((resp.status, resp.error_code()), (413, "payload_too_large".to_owned()));
    let large: Vec<String> =
        (0..2_000).map(|i| format!("PX-{i:05},RC-X{i:05},{},SUCCESS,2024-01-02T10:00:00Z", 100 + i)).collect();
    let large: Vec<&str> = large.iter().map(String::as_str).collect();
    let body = generic_with(&large);
    assert!(body.len() > 64 * 1024);
    let resp = request(&server, "POST", "/v1/reconciliations?format=generic", &[("Content-Type", "text/csv")], &body);
    assert_eq!(resp.status, 200, "a statement over 64 KiB is accepted: {}", resp.text());
    assert_eq!(resp.json()["missing_local"].as_array().map(Vec::len), Some(2_000));
    // The real route refuses like the in-process one.
    for (case, query, body, needle) in cases
        .iter()
        .filter(|c| c.0.contains("bad header") || c.0.contains("unknown format") || c.0.contains("3-decimal"))
    {
        let resp = util::request(
            server.addr,
            "POST",
            &format!("/v1/reconciliations?{query}"),
            &[("Content-Type", "text/csv")],
            body,
        );
        assert_eq!(
            (resp.status, resp.error_code()),
            (400, "invalid_request".to_owned()),
            "{case} over HTTP: {}",
            resp.text()
        );
        assert!(
            resp.json()["error"]["message"].as_str().unwrap_or_default().contains(needle),
            "{case}: {}",
            resp.text()
        );
    }
    assert_eq!(footprint(&read_only(&db)), before, "nothing was written");
}

/// A pay_no payonce recorded as `payment_failed` that the platform lists as
/// SUCCESS: the money moved, payonce does not know it (missing_local), and a
/// repair applies it through the exactly-once path, as coming from
/// reconciliation; a second repair changes nothing.
#[test]
fn a_payment_recorded_failed_but_successful_at_the_platform_is_missing_local_and_repaired_once() {
    let dir = TempDir::new("recon-failed");
    let db = dir.path("failed.db");
    let app = open_app(&db);
    let (status, body) = post_json(&app, "/v1/orders", &json!({"order_no": "RC-F1", "user_id": "u-rc", "amount": 800}));
    assert_eq!(status, 201, "{body}");
    let callback = json!({"pay_no": "P-F1", "order_no": "RC-F1", "amount": 800, "status": "FAILED", "paid_at": "2024-01-02T05:00:00Z"});
    let (status, answer) = signed(&app, "/v1/callbacks/generic", &callback);
    assert_eq!((status, answer["outcome"].as_str()), (200, Some("payment_failed")), "{answer}");

    let bytes = generic_with(&["P-F1,RC-F1,800,SUCCESS,2024-01-02T05:00:00Z"]);
    let result = reconcile_in_process(&app, Format::Generic, &bytes, None, false);
    let expected = Expected {
        period: vec![DAY],
        matched: 0,
        missing_local: vec![diff("P-F1", "RC-F1", Some(800), None)],
        missing_remote: vec![],
        amount_mismatch: vec![],
    };
    check(&result, &expected, "a failed record is not money moved");

    reconcile_in_process(&app, Format::Generic, &bytes, None, true);
    let after_first = footprint(&read_only(&db));
    let conn = read_only(&db);
    let (outcome, source): (String, String) = conn
        .query_row("SELECT outcome, source FROM pay_callback_log WHERE pay_no = 'P-F1'", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .expect("P-F1");
    let order_status: String =
        conn.query_row("SELECT status FROM orders WHERE order_no = 'RC-F1'", [], |r| r.get(0)).expect("order");
    assert_eq!((outcome.as_str(), order_status.as_str()), ("applied", "PAID"), "the repair applied it");
    let second = reconcile_in_process(&app, Format::Generic, &bytes, None, true);
    assert_eq!(footprint(&read_only(&db)), after_first, "the second repair changes nothing");
    let expected = Expected {
        period: vec![DAY],
        matched: 1,
        missing_local: vec![],
        missing_remote: vec![],
        amount_mismatch: vec![],
    };
    check(&second, &expected, "after the repair");
    assert_eq!(source, "reconciliation", "a repaired payment is recorded with source = reconciliation");
}

/// A keyed repair applies exactly the `missing_local` rows of the period,
/// like the unkeyed one and the CLI: a statement row outside `date=` is
/// neither compared nor repaired.
#[test]
fn a_keyed_repair_applies_only_the_periods_missing_local_rows() {
    let dir = TempDir::new("recon-keyed-period");
    let db = dir.path("payonce.db");
    let app = open_app(&db);
    for (order_no, amount) in [("RK-IN", 100), ("RK-OUT", 200)] {
        let (status, body) =
            post_json(&app, "/v1/orders", &json!({"order_no": order_no, "user_id": "u-rk", "amount": amount}));
        assert_eq!(status, 201, "{body}");
    }
    let statement = "pay_no,order_no,amount,status,paid_at\n\
                     RKP-IN,RK-IN,100,SUCCESS,2024-01-02T10:00:00Z\n\
                     RKP-OUT,RK-OUT,200,SUCCESS,2024-01-03T10:00:00Z\n";
    let headers = [("Content-Type", "text/csv"), ("Idempotency-Key", "rk-period-1")];
    let target = "/v1/reconciliations?format=generic&repair=true&date=2024-01-02";
    let (status, result) = handle(&app, "POST", target, &headers, statement.as_bytes().to_vec());
    assert_eq!(status, 200, "{result}");
    let missing: Vec<&str> =
        result["missing_local"].as_array().into_iter().flatten().filter_map(|r| r["pay_no"].as_str()).collect();
    assert_eq!(missing, ["RKP-IN"], "{result}");
    let conn = read_only(&db);
    let applied =
        count(&conn, "SELECT count(*) FROM pay_callback_log WHERE pay_no = 'RKP-IN' AND outcome = 'applied'", []);
    let outside = count(&conn, "SELECT count(*) FROM pay_callback_log WHERE pay_no = 'RKP-OUT'", []);
    assert_eq!((applied, outside), (1, 0), "only the period's missing payment is repaired");
    let status_out: String =
        conn.query_row("SELECT status FROM orders WHERE order_no = 'RK-OUT'", [], |r| r.get(0)).expect("order");
    assert_eq!(status_out, "PENDING");
}

/// `request` with room for a debug build comparing a statement of several
/// MiB on a busy machine.
fn request_large(server: &Server, path: &str, headers: &[(&str, &str)], body: &[u8]) -> util::HttpResponse {
    payonce_testclient::request(server.addr, "POST", path, headers, body, std::time::Duration::from_secs(180))
        .map(util::HttpResponse::from)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The fixture's rows followed by `count` payments payonce never recorded,
/// spread over DAY (in UTC and in Beijing time alike).
fn with_generated(count: usize) -> Vec<Row> {
    let mut rows = statement_rows();
    for i in 0..count {
        let leak = |text: String| -> &'static str { Box::leak(text.into_boxed_str()) };
        let id = leak(format!("P-GEN-{i:06}"));
        let fen = 100 + i as i64;
        let utc = leak(format_ms(ms("2024-01-02T00:00:00Z") + i as i64 * 1_000));
        rows.push(Row {
            kind: Kind::Payment,
            id,
            pay_no: id,
            order_no: leak(format!("RC-GEN-{i:06}")),
            fen,
            order_amount: fen,
            utc,
        });
    }
    rows
}

/// The fixture's differences, and every generated row `missing_local`.
fn expected_with_generated(format: Format, count: usize) -> Expected {
    let mut expected = expected_before_repair(format);
    for i in 0..count {
        expected.missing_local.push(diff(
            &format!("P-GEN-{i:06}"),
            &format!("RC-GEN-{i:06}"),
            Some(100 + i as i64),
            None,
        ));
    }
    expected.missing_local.sort();
    expected
}

/// A statement of many comparison batches (about 0.7 MiB; the rows are
/// compared 512 at a time), keyed, over HTTP: every row compared, the
/// differences listed in statement order, the answer exactly its JSON
/// (compact, as every answer), and a replay of the key the same bytes.
#[test]
fn a_statement_of_many_batches_is_compared_whole_and_replayed_over_http() {
    const GENERATED: usize = 12_000;
    let format = Format::Generic;
    let dir = TempDir::new("recon-large");
    let db = dir.path("large.db");
    seed(&db, format.as_str());
    let bytes = statement(format, &with_generated(GENERATED));
    assert!(bytes.len() > 512 * 1024, "a statement of many batches: {} bytes", bytes.len());
    let server = Server::start_on(&db, &REWARDS);
    let headers = [("Content-Type", "text/csv"), ("Idempotency-Key", "large-statement")];
    let first = request_large(&server, "/v1/reconciliations?format=generic", &headers, &bytes);
    assert_eq!(first.status, 200, "{}", String::from_utf8_lossy(&first.body[..first.body.len().min(500)]));
    let result = first.json();
    check(&result, &expected_with_generated(format, GENERATED), "several MiB over HTTP");
    let order: Vec<&str> =
        result["missing_local"].as_array().into_iter().flatten().filter_map(|r| r["pay_no"].as_str()).collect();
    let generated: Vec<String> = (0..GENERATED).map(|i| format!("P-GEN-{i:06}")).collect();
    assert_eq!(order.len(), GENERATED + 2);
    assert_eq!(&order[..2], ["P-L1", "RF-GONE"], "statement order");
    assert!(order[2..].iter().zip(&generated).all(|(a, b)| a == b), "the generated rows in statement order");
    assert_eq!(first.body, serde_json::to_vec(&result).unwrap_or_default(), "the answer is its compact JSON");
    let replay = request_large(&server, "/v1/reconciliations?format=generic", &headers, &bytes);
    assert_eq!((replay.status, replay.header("Idempotent-Replayed")), (200, Some("true")));
    assert!(replay.body == first.body, "a replay answers the same bytes");
}

/// A keyed repair of a statement whose difference lists span many pieces
/// (about 3,000 rows unknown to payonce), over HTTP: the answer is exactly
/// its compact JSON, lists every generated row as missing_local and as
/// repaired (refused: payonce has no such orders), and a replay of the key
/// answers the same bytes.
#[test]
fn a_keyed_repair_of_many_unknown_rows_answers_its_json_and_replays_it() {
    const GENERATED: usize = 3_000;
    let format = Format::Generic;
    let dir = TempDir::new("recon-large-repair");
    let db = dir.path("repair.db");
    seed(&db, format.as_str());
    let bytes = statement(format, &with_generated(GENERATED));
    let server = Server::start_on(&db, &REWARDS);
    let headers = [("Content-Type", "text/csv"), ("Idempotency-Key", "large-repair")];
    let path = "/v1/reconciliations?format=generic&repair=true";
    let first = request_large(&server, path, &headers, &bytes);
    assert_eq!(first.status, 200, "{}", String::from_utf8_lossy(&first.body[..first.body.len().min(500)]));
    let result = first.json();
    assert_eq!(first.body, serde_json::to_vec(&result).unwrap_or_default(), "the answer is its compact JSON");
    let keys: Vec<&str> = result.as_object().map(|o| o.keys().map(String::as_str).collect()).unwrap_or_default();
    assert_eq!(
        keys,
        ["channel", "period", "compared", "matched", "missing_local", "missing_remote", "amount_mismatch", "repaired"]
    );
    let pay_nos = |list: &str| -> Vec<String> {
        result[list].as_array().into_iter().flatten().filter_map(|r| r["pay_no"].as_str().map(str::to_owned)).collect()
    };
    let generated: Vec<String> = (0..GENERATED).map(|i| format!("P-GEN-{i:06}")).collect();
    let (missing, repaired) = (pay_nos("missing_local"), pay_nos("repaired"));
    assert!(missing.ends_with(&generated), "every generated row missing_local, in statement order");
    assert!(repaired.ends_with(&generated), "every generated payment repaired, in statement order");
    let refused = result["repaired"].as_array().into_iter().flatten().filter(|r| r.get("error").is_some()).count();
    assert!(refused >= GENERATED, "payonce has none of the generated orders: {refused} refused");
    let replay = request_large(&server, path, &headers, &bytes);
    assert_eq!((replay.status, replay.header("Idempotent-Replayed")), (200, Some("true")));
    assert!(replay.body == first.body, "a replay answers the same bytes");
}

/// A GBK Alipay statement of many 64 KiB pieces (checked and decoded line by line,
/// never whole) answers exactly what the same statement in UTF-8 answers;
/// a malformed GBK byte at its very end still refuses it whole, naming
/// neither encoding, and changes nothing.
#[test]
fn a_gbk_statement_of_many_pieces_answers_as_its_utf8_text_over_http() {
    const GENERATED: usize = 5_000;
    let format = Format::Alipay;
    let dir = TempDir::new("recon-large-gbk");
    let db = dir.path("gbk.db");
    seed(&db, format.as_str());
    let text = alipay_text(&with_generated(GENERATED));
    let gbk_bytes = gbk(&text);
    assert!(gbk_bytes.len() > 512 * 1024, "a statement of many pieces and batches: {} bytes", gbk_bytes.len());
    let server = Server::start_on(&db, &REWARDS);
    let post = |body: &[u8], content_type: &str| {
        request_large(&server, "/v1/reconciliations?format=alipay", &[("Content-Type", content_type)], body)
    };
    let from_gbk = post(&gbk_bytes, "text/plain; charset=GBK");
    let from_utf8 = post(text.as_bytes(), "text/plain; charset=utf-8");
    assert_eq!(from_gbk.status, 200, "{}", String::from_utf8_lossy(&from_gbk.body[..from_gbk.body.len().min(500)]));
    check(&from_gbk.json(), &expected_with_generated(format, GENERATED), "GBK, several MiB");
    assert!(from_gbk.body == from_utf8.body, "GBK and UTF-8 answer the same bytes");

    let before = footprint(&read_only(&db));
    // 0x81 starts a two-byte GBK character; a line break cannot end it.
    let mut malformed = gbk_bytes.clone();
    malformed.extend_from_slice(b"\x81\n");
    let refused = post(&malformed, "text/plain; charset=GBK");
    assert_eq!(
        (refused.status, refused.error_code(), refused.json()["error"]["message"].as_str()),
        (400, "invalid_request".to_owned(), Some("the statement is neither UTF-8 nor GBK"))
    );
    assert_eq!(footprint(&read_only(&db)), before, "a refused statement changes nothing");
}

/// A partial refund is compared on its own amount: the bill's REFUND row of
/// 30.00 matches a refund of 3000 of a 10000 order; a bill saying 100.00
/// for it is an amount mismatch (docs/decisions.md, "Refunds by amount").
#[test]
fn a_partial_refund_is_reconciled_on_its_own_amount() {
    let dir = TempDir::new("recon-partial");
    let db = dir.path("partial.db");
    let app = open_app(&db);
    let (status, body) =
        post_json(&app, "/v1/orders", &json!({"order_no": "RP-1", "user_id": "u-rc", "amount": 10000}));
    assert_eq!(status, 201, "{body}");
    let paid_at = "2024-01-02T04:00:00Z";
    app.clock().set_ms(ms(paid_at) + 60_000);
    let payment =
        json!({"pay_no": "P-P1", "order_no": "RP-1", "amount": 10000, "status": "SUCCESS", "paid_at": paid_at});
    assert_eq!(signed(&app, "/v1/callbacks/generic", &payment).1["outcome"], "applied");
    app.clock().set_ms(ms(SEED_CLOCK));
    let (status, body) = post_json(&app, "/v1/orders/RP-1/refunds", &json!({"refund_no": "RF-P1", "amount": 3000}));
    assert_eq!(status, 201, "{body}");
    let result = json!({"refund_no": "RF-P1", "order_no": "RP-1", "status": "SUCCESS", "amount": 3000});
    assert_eq!(signed(&app, "/v1/callbacks/generic/refund", &result).1["outcome"], "applied");

    let bill = |refund_fen: i64| {
        generic_with(&[
            "P-P1,RP-1,10000,SUCCESS,2024-01-02T04:00:00Z",
            &format!("RF-P1,RP-1,{refund_fen},REFUND,2024-01-02T06:00:00Z"),
        ])
    };
    let matched = reconcile_in_process(&app, Format::Generic, &bill(3000), Some(DAY), false);
    assert_eq!(matched["matched"], 2, "{matched}");
    assert_eq!(diffs(&matched["amount_mismatch"]), vec![], "{matched}");
    let mismatched = reconcile_in_process(&app, Format::Generic, &bill(10000), Some(DAY), false);
    assert_eq!(
        diffs(&mismatched["amount_mismatch"]),
        vec![diff("RF-P1", "RP-1", Some(10000), Some(3000))],
        "{mismatched}"
    );
}

/// A merchant taking three platforms is sent one statement by each: each
/// compares its own platform's payments and refunds only, so a day on which
/// every platform agrees with payonce is clean in all three (a WeChat Pay
/// bill used to list every Alipay and generic payment as missing_remote).
#[test]
fn a_day_of_three_platforms_is_clean_in_each_platforms_statement() {
    let dir = TempDir::new("recon-three-platforms");
    let db = dir.path("three.db");
    let app = open_app(&db);
    let leak = |text: String| -> &'static str { Box::leak(text.into_boxed_str()) };
    let formats = [Format::Generic, Format::Wechatpay, Format::Alipay];
    let mut statements = Vec::new();
    for (i, format) in formats.into_iter().enumerate() {
        let channel = format.as_str();
        let mut rows = Vec::new();
        for j in 0..3 {
            let order_no = leak(format!("RC3-{channel}-{j}"));
            let pay_no = leak(format!("P3-{channel}-{j}"));
            let fen = 1_000 + 100 * i as i64 + j;
            let paid_at = leak(format!("2024-01-02T03:0{i}:{j}0Z"));
            app.clock().set_ms(ms(SEED_CLOCK));
            let (status, body) =
                post_json(&app, "/v1/orders", &json!({"order_no": order_no, "user_id": "u-rc3", "amount": fen}));
            assert_eq!(status, 201, "{order_no}: {body}");
            assert_eq!(deliver(&app, channel, pay_no, order_no, fen, paid_at), "applied", "{pay_no}");
            rows.push(Row { kind: Kind::Payment, id: pay_no, pay_no, order_no, fen, order_amount: fen, utc: paid_at });
        }
        // The first order of each platform refunded, whole, on the same day.
        app.clock().set_ms(ms(SEED_CLOCK));
        let (order_no, pay_no, fen) = (rows[0].order_no, rows[0].pay_no, rows[0].fen);
        let refund_no = leak(format!("RF3-{channel}"));
        refund_whole(&app, channel, order_no, refund_no);
        let utc = "2024-01-02T06:30:00Z";
        rows.push(Row { kind: Kind::Refund, id: refund_no, pay_no, order_no, fen, order_amount: fen, utc });
        statements.push((format, statement(format, &rows)));
    }
    for (format, bytes) in &statements {
        let result = reconcile_in_process(&app, *format, bytes, None, false);
        let context = format!("{} statement", format.as_str());
        assert_eq!(result["channel"], format.as_str(), "{context}: {result}");
        check(
            &result,
            &Expected {
                period: vec![DAY],
                matched: 4,
                missing_local: vec![],
                missing_remote: vec![],
                amount_mismatch: vec![],
            },
            &context,
        );
    }
    // A generic statement listing nothing: its own platform's money of the
    // day is missing_remote, and none of the other two platforms'.
    let result = reconcile_in_process(&app, Format::Generic, &statement(Format::Generic, &[]), Some(DAY), false);
    let missing: Vec<Diff> = diffs(&result["missing_remote"]);
    assert_eq!(missing.len(), 4, "the generic day, listed by nobody: its 3 payments and 1 refund: {result}");
    assert!(missing.iter().all(|d| d.0.contains("generic")), "{result}");
}
