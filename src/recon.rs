//! Platform statements for reconciliation, parsed into one row shape. Pure:
//! bytes in, rows out. Money in yuan is converted to fen exactly, never
//! through a float.
//!
//! - `generic`: CSV with the header `pay_no,order_no,amount,status,paid_at`
//!   (amount in minor units; status SUCCESS or REFUND; for a REFUND row the
//!   `pay_no` column carries the refund_no; paid_at RFC 3339 with offset).
//! - `wechatpay`: WeChat Pay's trade bill: a header row, detail rows whose
//!   values start with a backtick, then a summary block (总交易单数...).
//!   Times are Beijing time; 交易状态 SUCCESS rows are payments, REFUND rows
//!   refunds (商户退款单号, 退款金额).
//! - `alipay`: Alipay's 业务明细 CSV: `#` metadata lines, GBK encoding, values
//!   padded with tabs; 业务类型 交易 rows are payments, 退款 rows refunds
//!   (退款批次号/请求号; negative amounts).

use crate::clock::{format_ms, parse_rfc3339_ms};
use crate::domain::{is_amount, is_identifier};
use crate::error::Error;

/// Largest statement accepted (bytes).
pub const STATEMENT_BYTES_MAX: usize = 16 * 1024 * 1024;
/// Beijing time, the day boundary of WeChat Pay and Alipay statements.
pub const UTC8_OFFSET_MS: i64 = 8 * 3_600_000;

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

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatementRow {
    pub kind: RowKind,
    /// pay_no for payments, refund_no for refunds.
    pub id: String,
    pub order_no: String,
    /// Minor units, positive.
    pub amount: i64,
    pub at_ms: i64,
    /// 1-based line number, for messages.
    pub line: usize,
    /// The row as read, kept as the record's raw body when repaired.
    pub raw: String,
}

pub fn parse(format: Format, bytes: &[u8]) -> Result<Vec<StatementRow>, Error> {
    if bytes.len() > STATEMENT_BYTES_MAX {
        return Err(Error::new(413, "payload_too_large", "a statement is at most 16 MiB"));
    }
    let text = decode(format, bytes)?;
    match format {
        Format::Generic => parse_generic(&text),
        Format::Wechatpay => parse_wechatpay(&text),
        Format::Alipay => parse_alipay(&text),
    }
}

/// UTF-8 (a BOM is dropped); Alipay statements that are not UTF-8 are GBK.
fn decode(format: Format, bytes: &[u8]) -> Result<String, Error> {
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

/// Yuan text to fen, exactly: digits, optionally `.` and one or two digits.
/// A leading `-` is accepted only when `allow_negative` (refund rows), and
/// the result is the absolute value. Signs elsewhere, exponents, spaces
/// inside and more than two decimals are refused.
pub fn yuan_to_fen(text: &str, allow_negative: bool) -> Option<i64> {
    let unsigned = match text.strip_prefix('-') {
        Some(rest) if allow_negative => rest,
        Some(_) => return None,
        None => text,
    };
    let (whole, fraction) = match unsigned.split_once('.') {
        Some((w, f)) => (w, f),
        None => (unsigned, ""),
    };
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || whole.len() > 13 || !digits(whole) || fraction.len() > 2 || !digits(fraction) {
        return None;
    }
    if unsigned.ends_with('.') {
        return None;
    }
    let whole: i64 = whole.parse().ok()?;
    let fraction: i64 = match fraction.len() {
        0 => 0,
        1 => fraction.parse::<i64>().ok()? * 10,
        _ => fraction.parse().ok()?,
    };
    whole.checked_mul(100)?.checked_add(fraction)
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

/// `YYYY-MM-DD HH:MM:SS` in the statement's zone to Unix milliseconds.
pub(crate) fn local_time_ms(text: &str, offset_ms: i64) -> Option<i64> {
    let (date, time) = text.trim().split_once(' ')?;
    Some(parse_rfc3339_ms(&format!("{date}T{time}Z"))? - offset_ms)
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
            Ok(StatementRow { kind, id: pay_no.clone(), order_no: order_no.clone(), amount, at_ms, line, raw })
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

fn parse_wechatpay(text: &str) -> Result<Vec<StatementRow>, Error> {
    let records = csv_records(text);
    let Some(start) = records.iter().position(|(_, f, _)| f.first().is_some_and(|c| c == "交易时间")) else {
        return Err(Error::invalid("a wechatpay trade bill starts with a header row beginning 交易时间"));
    };
    let header = &records[start].1;
    let time_col = column(header, "交易时间", "wechatpay")?;
    let pay_col = column(header, "微信订单号", "wechatpay")?;
    let order_col = column(header, "商户订单号", "wechatpay")?;
    let state_col = column(header, "交易状态", "wechatpay")?;
    let amount_col = column(header, "应结订单金额", "wechatpay")?;
    let refund_no_col = column(header, "商户退款单号", "wechatpay")?;
    let refund_amount_col = column(header, "退款金额", "wechatpay")?;
    let mut rows = Vec::new();
    for (line, fields, raw) in &records[start + 1..] {
        if fields.first().is_some_and(|c| c.starts_with("总")) {
            break; // the summary block
        }
        let value = |i: usize| fields.get(i).map(|v| v.trim_start_matches('`').trim()).unwrap_or("");
        let at_ms = local_time_ms(value(time_col), UTC8_OFFSET_MS)
            .ok_or_else(|| invalid_row(*line, "交易时间 must be YYYY-MM-DD HH:MM:SS"))?;
        let (kind, id, amount_text) = match value(state_col) {
            "SUCCESS" => (RowKind::Payment, value(pay_col), value(amount_col)),
            "REFUND" => (RowKind::Refund, value(refund_no_col), value(refund_amount_col)),
            _ => continue, // NOTPAY, CLOSED, REVOKED...: no money moved
        };
        let order_no = value(order_col);
        check_ids(*line, id, order_no)?;
        let amount = yuan_to_fen(amount_text, false)
            .filter(|a| is_amount(*a))
            .ok_or_else(|| invalid_row(*line, "the amount must be yuan with at most two decimals"))?;
        rows.push(StatementRow {
            kind,
            id: id.to_owned(),
            order_no: order_no.to_owned(),
            amount,
            at_ms,
            line: *line,
            raw: raw.clone(),
        });
    }
    Ok(rows)
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
            at_ms,
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
    fn yuan_converts_to_fen_exactly_or_not_at_all() {
        let check = |text: &str, negative: bool, expected: Option<i64>| {
            assert_eq!(yuan_to_fen(text, negative), expected, "{text:?}");
        };
        check("99.00", false, Some(9900));
        check("99.9", false, Some(9990));
        check("0.01", false, Some(1));
        check("100", false, Some(10000));
        check("0.29", false, Some(29)); // 0.29 * 100 is 28.999999999999996 in floating point
        check("-99.00", true, Some(9900));
        check("-99.00", false, None);
        check("+99.00", false, None);
        check("99.001", false, None);
        check("1e3", false, None);
        check("99.", false, None);
        check(".5", false, None);
        check("", false, None);
        check("9 9", false, None);
        check("１００", false, None);
        check("99999999999999.00", false, None);
    }

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

    #[test]
    fn generic_statement() {
        let text = "pay_no,order_no,amount,status,paid_at\nP1,O1,9900,SUCCESS,2024-01-01T10:00:00+08:00\nR1,O1,9900,REFUND,2024-01-01T12:00:00Z\n";
        let rows = parse(Format::Generic, text.as_bytes()).unwrap_or_default();
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
