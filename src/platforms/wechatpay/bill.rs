//! WeChat Pay's trade bill (交易账单): a header row, detail rows whose
//! values start with a backtick, then a summary block (总交易单数...). Times
//! are Beijing time. Its header declares its `bill_type`: with
//! 退款申请时间/退款成功时间 it is a REFUND bill (退款账单: every row a refund,
//! dated by its own refund time), with refund columns but no refund times an
//! ALL bill (payments are 交易状态 SUCCESS rows, refunds REFUND rows, whose
//! 交易时间 is the payment's, so they carry no time of their own), without
//! refund columns a SUCCESS bill (支付账单: payments only). Payments are
//! compared on 订单金额 (the order amount, which a notification's
//! `amount.total` is; 应结订单金额 is that minus non-recharge coupons), with a
//! non-zero 代金券金额 reported; refunds on 申请退款金额 where the bill has it
//! (退款金额 excludes coupons), else 退款金额. Refund rows whose 退款状态 is not
//! SUCCESS moved no money yet.

use crate::clock::{local_time_ms, UTC8_OFFSET_MS};
use crate::domain::{is_amount, is_currency};
use crate::error::Error;
use crate::money::yuan_to_fen;
use crate::recon::{
    check_ids, column, header_row, invalid_row, BillFormat, BillRows, Header, Read, RowKind, StatementRow, BOTH_KINDS,
};
use std::borrow::Cow;

/// WeChat Pay's trade bill format.
pub struct Bill;

impl BillFormat for Bill {
    fn day_offset_ms(&self) -> i64 {
        UTC8_OFFSET_MS
    }

    fn header<'t>(
        &self,
        lines: &mut dyn Iterator<Item = Result<(usize, Cow<'t, str>), Error>>,
    ) -> Result<Header, Error> {
        let (line, header) = header_row(lines, "交易时间")?
            .ok_or_else(|| Error::invalid("a wechatpay trade bill starts with a header row beginning 交易时间"))?;
        let bill = BillType::of_header(&header);
        let columns = WechatColumns::of(&header, bill)?;
        Ok(Header { compared: bill.compared(), rows: Box::new(Rows { bill, columns }), line })
    }
}

/// The detail rows of a bill of one type, up to its summary block.
struct Rows {
    bill: BillType,
    columns: WechatColumns,
}

impl BillRows for Rows {
    fn read(&self, line: usize, fields: &[String]) -> Result<Read, Error> {
        if fields.first().is_some_and(|c| c.starts_with("总")) {
            return Ok(Read::End); // the summary block
        }
        Ok(match row(self.bill, &self.columns, line, fields)? {
            Some(row) => Read::Row(row),
            None => Read::Skip,
        })
    }
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

/// One detail row of a WeChat bill, or `None` for a row that moved no money
/// (NOTPAY, CLOSED, REVOKED..., a refund still PROCESSING).
fn row(bill: BillType, columns: &WechatColumns, line: usize, fields: &[String]) -> Result<Option<StatementRow>, Error> {
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
        (RowKind::Refund, None) => return Err(Error::internal("a bill with refund rows has refund columns")),
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

#[cfg(test)]
mod tests {
    use crate::clock::{local_time_ms, UTC8_OFFSET_MS};
    use crate::recon::{parse, Format, Parsed, RowKind};

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
        let summary = |s: Parsed| -> (Vec<&'static str>, Vec<Row>) {
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
}
