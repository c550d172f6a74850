//! Platform statements for reconciliation, parsed into one row shape. Pure:
//! bytes in, rows out. Money in yuan is converted to fen exactly, never
//! through a float.
//!
//! A statement's kind is what it declares, never guessed from the rows that
//! happen to be in it ([`Statement::compared`]):
//!
//! - `generic`: CSV with the header `pay_no,order_no,amount,status,paid_at`
//!   (amount in minor units; status SUCCESS or REFUND; for a REFUND row the
//!   `pay_no` column carries the refund_no; paid_at RFC 3339 with offset).
//!   Compares payments and refunds.
//! - `wechatpay`: WeChat Pay's trade bill (交易账单): a header row, detail
//!   rows whose values start with a backtick, then a summary block
//!   (总交易单数...). Times are Beijing time. Its header declares its
//!   `bill_type`: with 退款申请时间/退款成功时间 it is a REFUND bill (退款账单:
//!   every row a refund, dated by its own refund time), with refund columns
//!   but no refund times an ALL bill (payments are 交易状态 SUCCESS rows,
//!   refunds REFUND rows, whose 交易时间 is the payment's, so they carry no
//!   time of their own), without refund columns a SUCCESS bill (支付账单:
//!   payments only). Payments are compared on 订单金额 (the order amount,
//!   which a notification's `amount.total` is; 应结订单金额 is that minus
//!   non-recharge coupons), with a non-zero 代金券金额 reported; refunds on
//!   申请退款金额 where the bill has it (退款金额 excludes coupons), else
//!   退款金额. Refund rows whose 退款状态 is not SUCCESS moved no money yet.
//! - `alipay`: Alipay's 业务明细 CSV: `#` metadata lines, GBK encoding, values
//!   padded with tabs; 业务类型 交易 rows are payments, 退款 rows refunds
//!   (退款批次号/请求号; negative amounts), dated by 完成时间. It declares no
//!   kind, so it always compares both.

use crate::clock::{format_ms, local_time_ms, parse_rfc3339_ms};
use crate::domain::{is_amount, is_currency, is_identifier};
use crate::error::{Error, ErrorKind};

/// Largest statement accepted (bytes).
pub const STATEMENT_BYTES_MAX: usize = 16 * 1024 * 1024;
pub use crate::clock::UTC8_OFFSET_MS;
/// Yuan to fen lives in `money`; re-exported for the library's callers.
pub use crate::money::yuan_to_fen;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Generic,
    Wechatpay,
    Alipay,
}

impl Format {
    pub fn parse(text: &str) -> Option<Format> {
        match text {
            "generic" => Some(Format::Generic),
            "wechatpay" => Some(Format::Wechatpay),
            "alipay" => Some(Format::Alipay),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Format::Generic => "generic",
            Format::Wechatpay => "wechatpay",
            Format::Alipay => "alipay",
        }
    }

    /// Offset of the statement's calendar days from UTC.
    pub fn day_offset_ms(self) -> i64 {
        match self {
            Format::Generic => 0,
            Format::Wechatpay | Format::Alipay => UTC8_OFFSET_MS,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowKind {
    Payment,
    Refund,
}

impl RowKind {
    pub fn as_str(self) -> &'static str {
        match self {
            RowKind::Payment => "payment",
            RowKind::Refund => "refund",
        }
    }
}

/// Both kinds, as the answer's `compared` lists them.
pub const BOTH_KINDS: &[RowKind] = &[RowKind::Payment, RowKind::Refund];

/// A parsed statement: the kinds it declares it lists, and its rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Statement {
    /// What the statement is complete for. A kind it does not list is not
    /// compared: payonce's payments are not `missing_remote` from a refund bill.
    pub compared: &'static [RowKind],
    pub rows: Vec<StatementRow>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatementRow {
    pub kind: RowKind,
    /// pay_no for payments, refund_no for refunds.
    pub id: String,
    pub order_no: String,
    /// Minor units, positive: what is compared with payonce's amount.
    pub amount: i64,
    /// The row's own time; `None` for a row dated by something else (a
    /// refund row of a WeChat ALL bill carries the payment's 交易时间). A row
    /// without a time of its own is compared, but never widens the period.
    pub at_ms: Option<i64>,
    /// The coupon share of a payment's amount (WeChat 代金券金额), when non-zero.
    pub coupon_amount: Option<i64>,
    /// The currency of `amount`: WeChat's 货币种类 (CNY when the bill has
    /// none), CNY for Alipay; `None` for the generic format, whose amounts
    /// are in each order's own currency. Part of the amount compared.
    pub currency: Option<String>,
    /// 1-based line number, for messages.
    pub line: usize,
    /// The row as read, kept as the record's raw body when repaired.
    pub raw: String,
}

pub fn parse(format: Format, bytes: &[u8]) -> Result<Statement, Error> {
    if bytes.len() > STATEMENT_BYTES_MAX {
        return Err(Error::new(ErrorKind::PayloadTooLarge, "a statement is at most 16 MiB"));
    }
    let text = decode(format, bytes)?;
    match format {
        Format::Generic => Ok(Statement { compared: BOTH_KINDS, rows: parse_generic(&text)? }),
        Format::Wechatpay => parse_wechatpay(&text),
        Format::Alipay => Ok(Statement { compared: BOTH_KINDS, rows: parse_alipay(&text)? }),
    }
}

/// UTF-8 (a BOM is dropped); Alipay statements that are not UTF-8 are GBK.
/// The platforms hand their files out compressed (WeChat's `tar_type=GZIP`,
/// Alipay's zip of 业务明细 and 汇总): those are refused with that said.
fn decode(format: Format, bytes: &[u8]) -> Result<String, Error> {
    if bytes.starts_with(b"\x1f\x8b") {
        return Err(Error::invalid("the statement is gzip-compressed; send the decompressed bill"));
    }
    if bytes.starts_with(b"PK\x03\x04") {
        return Err(Error::invalid("the statement is a zip archive; send the 业务明细 CSV inside it"));
    }
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    match std::str::from_utf8(bytes) {
        Ok(text) => Ok(text.to_owned()),
        Err(_) if format == Format::Alipay => {
            let (text, _, had_errors) = encoding_rs::GBK.decode(bytes);
            if had_errors {
                return Err(Error::invalid("the statement is neither UTF-8 nor GBK"));
            }
            Ok(text.into_owned())
        }
        Err(_) => Err(Error::invalid("the statement is not UTF-8")),
    }
}

/// The calendar day (`YYYY-MM-DD`) of an instant at a UTC offset.
pub fn day_of(at_ms: i64, offset_ms: i64) -> String {
    format_ms(at_ms + offset_ms)[..10].to_owned()
}

/// The UTC text bounds [from, to) of a calendar day at an offset.
pub fn day_bounds(day: &str, offset_ms: i64) -> Option<(String, String)> {
    let midnight = parse_rfc3339_ms(&format!("{day}T00:00:00Z"))?;
    if day.len() != 10 || day_of(midnight, 0) != day {
        return None;
    }
    let start = midnight - offset_ms;
    Some((format_ms(start), format_ms(start + 86_400_000)))
}

fn invalid_row(line: usize, what: &str) -> Error {
    Error::invalid(format!("statement line {line}: {what}"))
}

fn check_ids(line: usize, id: &str, order_no: &str) -> Result<(), Error> {
    if !is_identifier(id) {
        return Err(invalid_row(line, "the pay_no/refund_no is not 1-64 characters of [A-Za-z0-9_.-]"));
    }
    if !is_identifier(order_no) {
        return Err(invalid_row(line, "the order_no is not 1-64 characters of [A-Za-z0-9_.-]"));
    }
    Ok(())
}

fn csv_records(text: &str) -> Vec<(usize, Vec<String>, String)> {
    // Each physical line is read on its own: the platforms' files have no
    // multi-line fields, and summary blocks change the column count.
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, line)| {
            let mut reader = csv::ReaderBuilder::new().has_headers(false).flexible(true).from_reader(line.as_bytes());
            let fields = reader
                .records()
                .next()
                .and_then(Result::ok)
                .map(|r| r.iter().map(|f| f.trim().to_owned()).collect())
                .unwrap_or_default();
            (i + 1, fields, line.to_owned())
        })
        .collect()
}

fn parse_generic(text: &str) -> Result<Vec<StatementRow>, Error> {
    let mut records = csv_records(text).into_iter();
    let Some((_, header, _)) = records.next() else {
        return Ok(Vec::new());
    };
    if header != ["pay_no", "order_no", "amount", "status", "paid_at"] {
        return Err(Error::invalid("a generic statement starts with the header pay_no,order_no,amount,status,paid_at"));
    }
    records
        .map(|(line, fields, raw)| {
            let [pay_no, order_no, amount, status, paid_at] = fields.as_slice() else {
                return Err(invalid_row(line, "expected 5 columns"));
            };
            check_ids(line, pay_no, order_no)?;
            let amount = amount.parse::<i64>().ok().filter(|a| is_amount(*a));
            let amount =
                amount.ok_or_else(|| invalid_row(line, "amount must be an integer from 1 to 10^12 (minor units)"))?;
            let kind = match status.as_str() {
                "SUCCESS" => RowKind::Payment,
                "REFUND" => RowKind::Refund,
                _ => return Err(invalid_row(line, "status must be SUCCESS or REFUND")),
            };
            let at_ms = parse_rfc3339_ms(paid_at)
                .ok_or_else(|| invalid_row(line, "paid_at must be RFC 3339 with an offset"))?;
            Ok(StatementRow {
                kind,
                id: pay_no.clone(),
                order_no: order_no.clone(),
                amount,
                at_ms: Some(at_ms),
                coupon_amount: None,
                currency: None,
                line,
                raw,
            })
        })
        .collect()
}

/// Finds a column by its header name.
fn column(header: &[String], name: &str, format: &str) -> Result<usize, Error> {
    header
        .iter()
        .position(|h| h == name)
        .ok_or_else(|| Error::invalid(format!("the {format} statement has no column {name}")))
}

/// WeChat Pay's `bill_type`, as its header declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BillType {
    /// 支付账单: payments only; no refund columns.
    Success,
    /// 退款账单: refunds only; refund columns and the refund's own times.
    Refund,
    /// Payments and refunds; refund columns without the refund's times.
    All,
}

impl BillType {
    fn of_header(header: &[String]) -> BillType {
        let has = |name: &str| header.iter().any(|h| h == name);
        if has("退款申请时间") || has("退款成功时间") {
            BillType::Refund
        } else if has("商户退款单号") {
            BillType::All
        } else {
            BillType::Success
        }
    }

    fn compared(self) -> &'static [RowKind] {
        match self {
            BillType::Success => &[RowKind::Payment],
            BillType::Refund => &[RowKind::Refund],
            BillType::All => BOTH_KINDS,
        }
    }
}

/// The columns a WeChat bill of one type is read by.
struct WechatColumns {
    time: usize,
    pay_no: usize,
    order_no: usize,
    state: usize,
    order_amount: usize,
    coupon: Option<usize>,
    currency: Option<usize>,
    /// (商户退款单号, the refund amount compared, 退款状态), in ALL and REFUND bills.
    refund: Option<(usize, usize, Option<usize>)>,
    /// (退款成功时间, 退款申请时间), in REFUND bills.
    refund_times: (Option<usize>, Option<usize>),
}

impl WechatColumns {
    fn of(header: &[String], bill: BillType) -> Result<WechatColumns, Error> {
        let find = |name: &str| header.iter().position(|h| h == name);
        let need = |name: &str| column(header, name, "wechatpay");
        let refund = match bill {
            BillType::Success => None,
            BillType::Refund | BillType::All => {
                let amount = match find("申请退款金额") {
                    Some(i) => i,
                    None => need("退款金额")?,
                };
                Some((need("商户退款单号")?, amount, find("退款状态")))
            }
        };
        Ok(WechatColumns {
            time: need("交易时间")?,
            pay_no: need("微信订单号")?,
            order_no: need("商户订单号")?,
            state: need("交易状态")?,
            order_amount: need("订单金额")?,
            coupon: find("代金券金额"),
            currency: find("货币种类"),
            refund,
            refund_times: (find("退款成功时间"), find("退款申请时间")),
        })
    }
}

fn parse_wechatpay(text: &str) -> Result<Statement, Error> {
    let records = csv_records(text);
    let Some(start) = records.iter().position(|(_, f, _)| f.first().is_some_and(|c| c == "交易时间")) else {
        return Err(Error::invalid("a wechatpay trade bill starts with a header row beginning 交易时间"));
    };
    let header = &records[start].1;
    let bill = BillType::of_header(header);
    let columns = WechatColumns::of(header, bill)?;
    let mut rows = Vec::new();
    for (line, fields, raw) in &records[start + 1..] {
        if fields.first().is_some_and(|c| c.starts_with("总")) {
            break; // the summary block
        }
        if let Some(row) = wechat_row(bill, &columns, *line, fields)? {
            rows.push(StatementRow { raw: raw.clone(), ..row });
        }
    }
    Ok(Statement { compared: bill.compared(), rows })
}

/// One detail row of a WeChat bill, or `None` for a row that moved no money
/// (NOTPAY, CLOSED, REVOKED..., a refund still PROCESSING).
fn wechat_row(
    bill: BillType,
    columns: &WechatColumns,
    line: usize,
    fields: &[String],
) -> Result<Option<StatementRow>, Error> {
    let value = |i: usize| fields.get(i).map(|v| v.trim_start_matches('`').trim()).unwrap_or("");
    let time = |i: usize, name: &str| {
        local_time_ms(value(i), UTC8_OFFSET_MS)
            .ok_or_else(|| invalid_row(line, &format!("{name} must be YYYY-MM-DD HH:MM:SS")))
    };
    let paid_at = time(columns.time, "交易时间")?;
    let kind = match (bill, value(columns.state)) {
        (BillType::Refund, _) => RowKind::Refund,
        (BillType::Success | BillType::All, "SUCCESS") => RowKind::Payment,
        (BillType::All, "REFUND") => RowKind::Refund,
        (BillType::Success, other) => {
            return Err(invalid_row(line, &format!("a SUCCESS bill lists successful payments, not {other:?}")))
        }
        (BillType::All, _) => return Ok(None),
    };
    let yuan = |i: usize, name: &str| {
        yuan_to_fen(value(i), false)
            .ok_or_else(|| invalid_row(line, &format!("{name} must be yuan with at most two decimals")))
    };
    let (id, amount, at_ms, coupon_amount) = match (kind, columns.refund) {
        (RowKind::Payment, _) => {
            let coupon = match columns.coupon {
                Some(i) if !value(i).is_empty() => Some(yuan(i, "代金券金额")?).filter(|c| *c != 0),
                _ => None,
            };
            (value(columns.pay_no), yuan(columns.order_amount, "订单金额")?, Some(paid_at), coupon)
        }
        (RowKind::Refund, Some((refund_no, amount, state))) => {
            if state.is_some_and(|i| !matches!(value(i), "" | "SUCCESS")) {
                return Ok(None);
            }
            // A REFUND bill dates the row by the refund: its success, else
            // its acceptance. An ALL bill gives it no time of its own.
            let own = match columns.refund_times {
                (Some(i), _) if !value(i).is_empty() => Some(time(i, "退款成功时间")?),
                (_, Some(i)) if !value(i).is_empty() => Some(time(i, "退款申请时间")?),
                (None, None) => None,
                _ => return Err(invalid_row(line, "a refund bill row has neither 退款成功时间 nor 退款申请时间")),
            };
            (value(refund_no), yuan(amount, "the refund amount")?, own, None)
        }
        (RowKind::Refund, None) => unreachable!("a bill with refund rows has refund columns"),
    };
    let order_no = value(columns.order_no);
    check_ids(line, id, order_no)?;
    if !is_amount(amount) {
        return Err(invalid_row(line, "the amount must be from 0.01 to 10^10 yuan"));
    }
    let currency = match columns.currency.map(value).filter(|c| !c.is_empty()) {
        None => "CNY",
        Some(c) if is_currency(c) => c,
        Some(_) => return Err(invalid_row(line, "货币种类 must be 3 upper-case letters")),
    };
    Ok(Some(StatementRow {
        kind,
        id: id.to_owned(),
        order_no: order_no.to_owned(),
        amount,
        at_ms,
        coupon_amount,
        currency: Some(currency.to_owned()),
        line,
        raw: String::new(),
    }))
}

fn parse_alipay(text: &str) -> Result<Vec<StatementRow>, Error> {
    let records: Vec<_> =
        csv_records(text).into_iter().filter(|(_, f, _)| !f.first().is_some_and(|c| c.starts_with('#'))).collect();
    let Some(start) = records.iter().position(|(_, f, _)| f.first().is_some_and(|c| c == "支付宝交易号")) else {
        return Err(Error::invalid("an alipay statement has a header row beginning 支付宝交易号"));
    };
    let header = &records[start].1;
    let trade_col = column(header, "支付宝交易号", "alipay")?;
    let order_col = column(header, "商户订单号", "alipay")?;
    let type_col = column(header, "业务类型", "alipay")?;
    let done_col = column(header, "完成时间", "alipay")?;
    let amount_col = column(header, "订单金额（元）", "alipay")?;
    let refund_col = column(header, "退款批次号/请求号", "alipay")?;
    let mut rows = Vec::new();
    for (line, fields, raw) in &records[start + 1..] {
        let value = |i: usize| fields.get(i).map(|v| v.trim()).unwrap_or("");
        let (kind, id, negative) = match value(type_col) {
            "交易" => (RowKind::Payment, value(trade_col), false),
            "退款" => (RowKind::Refund, value(refund_col), true),
            _ => continue,
        };
        let at_ms = local_time_ms(value(done_col), UTC8_OFFSET_MS)
            .ok_or_else(|| invalid_row(*line, "完成时间 must be YYYY-MM-DD HH:MM:SS"))?;
        let order_no = value(order_col);
        check_ids(*line, id, order_no)?;
        let amount = yuan_to_fen(value(amount_col), negative)
            .filter(|a| is_amount(*a))
            .ok_or_else(|| invalid_row(*line, "订单金额（元） must be yuan with at most two decimals"))?;
        rows.push(StatementRow {
            kind,
            id: id.to_owned(),
            order_no: order_no.to_owned(),
            amount,
            at_ms: Some(at_ms),
            coupon_amount: None,
            // Alipay's statements are in yuan, as its notices (docs/channels.md).
            currency: Some("CNY".to_owned()),
            line: *line,
            raw: raw.clone(),
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn days_in_beijing_time() {
        // 2024-01-01T16:30:00Z is 2024-01-02 00:30 in UTC+8.
        let at = parse_rfc3339_ms("2024-01-01T16:30:00Z").unwrap_or_default();
        assert_eq!(day_of(at, UTC8_OFFSET_MS), "2024-01-02");
        assert_eq!(day_of(at, 0), "2024-01-01");
        assert_eq!(
            day_bounds("2024-01-02", UTC8_OFFSET_MS),
            Some(("2024-01-01T16:00:00.000Z".to_owned(), "2024-01-02T16:00:00.000Z".to_owned()))
        );
        assert_eq!(day_bounds("2024-02-30", 0), None);
        assert_eq!(day_bounds("yesterday", 0), None);
    }

    /// A WeChat bill's kind comes from its header alone: the same detail
    /// rows read as different kinds under different headers.
    #[test]
    fn wechat_bill_type_is_the_header_s() {
        const ALL: &str = "交易时间,微信订单号,商户订单号,交易状态,应结订单金额,代金券金额,商户退款单号,退款金额,退款状态,订单金额,申请退款金额";
        const SUCCESS: &str = "交易时间,微信订单号,商户订单号,交易状态,应结订单金额,代金券金额,订单金额";
        const REFUND: &str = "交易时间,微信订单号,商户订单号,交易状态,应结订单金额,代金券金额,退款申请时间,退款成功时间,商户退款单号,退款金额,退款状态,订单金额,申请退款金额";
        let read = |header: &str, rows: &[&str]| {
            let text = format!("{header}\n{}\n总交易单数\n`1\n", rows.join("\n"));
            parse(Format::Wechatpay, text.as_bytes())
        };
        // (kind, id, amount, own time, coupon)
        type Row = (RowKind, String, i64, Option<i64>, Option<i64>);
        let summary = |s: Statement| -> (Vec<&'static str>, Vec<Row>) {
            let rows = s.rows.into_iter().map(|r| (r.kind, r.id, r.amount, r.at_ms, r.coupon_amount)).collect();
            (s.compared.iter().map(|k| k.as_str()).collect(), rows)
        };
        let at = |t: &str| local_time_ms(t, UTC8_OFFSET_MS);
        let all = read(
            ALL,
            &[
                "`2024-03-04 09:59:30,`TX1,`O1,`SUCCESS,`90.00,`10.00,`0,`0.00,`,`100.00,`0.00",
                "`2024-03-03 21:59:00,`TX2,`O2,`REFUND,`0.00,`0.00,`R2,`30.00,`SUCCESS,`0.00,`30.00",
                "`2024-03-04 11:00:00,`TX3,`O3,`REFUND,`0.00,`0.00,`R3,`5.00,`PROCESSING,`0.00,`5.00",
                "`2024-03-04 12:00:00,`TX4,`O4,`REVOKED,`0.00,`0.00,`0,`0.00,`,`8.00,`0.00",
            ],
        );
        assert_eq!(
            all.map(summary).ok(),
            Some((
                vec!["payment", "refund"],
                vec![
                    (RowKind::Payment, "TX1".into(), 10_000, at("2024-03-04 09:59:30"), Some(1_000)),
                    (RowKind::Refund, "R2".into(), 3_000, None, None),
                ]
            ))
        );
        let success = read(SUCCESS, &["`2024-03-04 10:00:00,`TX5,`O5,`SUCCESS,`25.00,`0.00,`25.00"]);
        assert_eq!(
            success.map(summary).ok(),
            Some((vec!["payment"], vec![(RowKind::Payment, "TX5".into(), 2_500, at("2024-03-04 10:00:00"), None)]))
        );
        let refund = read(
            REFUND,
            &[
                "`2024-03-04 09:59:30,`TX1,`O1,`REFUND,`0.00,`0.00,`2024-03-05 23:40:00,`2024-03-05 23:55:00,`R1,`90.00,`SUCCESS,`0.00,`100.00",
                "`2024-03-04 09:00:00,`TX6,`O6,`REFUND,`0.00,`0.00,`2024-03-05 08:00:00,`,`R6,`7.00,`,`0.00,`7.00",
            ],
        );
        assert_eq!(
            refund.map(summary).ok(),
            Some((
                vec!["refund"],
                vec![
                    (RowKind::Refund, "R1".into(), 10_000, at("2024-03-05 23:55:00"), None),
                    (RowKind::Refund, "R6".into(), 700, at("2024-03-05 08:00:00"), None),
                ]
            ))
        );
        // Without 订单金额 there is nothing to compare a payment with.
        assert!(read("交易时间,微信订单号,商户订单号,交易状态,应结订单金额", &[]).is_err());
    }

    #[test]
    fn generic_statement() {
        let text = "pay_no,order_no,amount,status,paid_at\nP1,O1,9900,SUCCESS,2024-01-01T10:00:00+08:00\nR1,O1,9900,REFUND,2024-01-01T12:00:00Z\n";
        let rows = parse(Format::Generic, text.as_bytes()).map(|s| s.rows).unwrap_or_default();
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].kind, rows[0].id.as_str(), rows[0].amount), (RowKind::Payment, "P1", 9900));
        assert_eq!((rows[1].kind, rows[1].id.as_str()), (RowKind::Refund, "R1"));
        assert!(parse(Format::Generic, b"pay_no,order_no\n").is_err());
        assert!(parse(
            Format::Generic,
            b"pay_no,order_no,amount,status,paid_at\nP1,O1,99.5,SUCCESS,2024-01-01T10:00:00Z\n"
        )
        .is_err());
    }
}
