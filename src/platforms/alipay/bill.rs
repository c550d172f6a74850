//! Alipay's statement, the 业务明细 CSV: `#` metadata lines, GBK encoding
//! (or UTF-8), values padded with tabs; 业务类型 交易 rows are payments, 退款
//! rows refunds (退款批次号/请求号; negative amounts), dated by 完成时间 in
//! Beijing time. It declares no kind, so it always compares both.

use super::CURRENCY;
use crate::clock::{local_time_ms, UTC8_OFFSET_MS};
use crate::domain::is_amount;
use crate::error::Error;
use crate::money::yuan_to_fen;
use crate::recon::{
    check_ids, column, header_row, invalid_row, BillFormat, BillRows, Header, Read, RowKind, StatementRow, BOTH_KINDS,
};
use std::borrow::Cow;

/// Alipay's statement format.
pub struct Bill;

impl BillFormat for Bill {
    fn day_offset_ms(&self) -> i64 {
        UTC8_OFFSET_MS
    }

    fn may_be_gbk(&self) -> bool {
        true
    }

    fn header<'t>(
        &self,
        lines: &mut dyn Iterator<Item = Result<(usize, Cow<'t, str>), Error>>,
    ) -> Result<Header, Error> {
        let (line, header) = header_row(lines, "支付宝交易号")?
            .ok_or_else(|| Error::invalid("an alipay statement has a header row beginning 支付宝交易号"))?;
        Ok(Header { compared: BOTH_KINDS, rows: Box::new(AlipayColumns::of(&header)?), line })
    }
}

impl BillRows for AlipayColumns {
    fn read(&self, line: usize, fields: &[String]) -> Result<Read, Error> {
        Ok(match row(self, line, fields)? {
            Some(row) => Read::Row(row),
            None => Read::Skip,
        })
    }
}

/// The columns an Alipay 业务明细 is read by.
struct AlipayColumns {
    trade: usize,
    order: usize,
    kind: usize,
    done: usize,
    amount: usize,
    refund: usize,
}

impl AlipayColumns {
    fn of(header: &[String]) -> Result<AlipayColumns, Error> {
        Ok(AlipayColumns {
            trade: column(header, "支付宝交易号", "alipay")?,
            order: column(header, "商户订单号", "alipay")?,
            kind: column(header, "业务类型", "alipay")?,
            done: column(header, "完成时间", "alipay")?,
            amount: column(header, "订单金额（元）", "alipay")?,
            refund: column(header, "退款批次号/请求号", "alipay")?,
        })
    }
}

/// One row of an Alipay 业务明细, or `None` for a `#` metadata line or a
/// row of another 业务类型.
fn row(columns: &AlipayColumns, line: usize, fields: &[String]) -> Result<Option<StatementRow>, Error> {
    if fields.first().is_some_and(|c| c.starts_with('#')) {
        return Ok(None);
    }
    let value = |i: usize| fields.get(i).map(|v| v.trim()).unwrap_or("");
    let (kind, id, negative) = match value(columns.kind) {
        "交易" => (RowKind::Payment, value(columns.trade), false),
        "退款" => (RowKind::Refund, value(columns.refund), true),
        _ => return Ok(None),
    };
    let at_ms = local_time_ms(value(columns.done), UTC8_OFFSET_MS)
        .ok_or_else(|| invalid_row(line, "完成时间 must be YYYY-MM-DD HH:MM:SS"))?;
    let order_no = value(columns.order);
    check_ids(line, id, order_no)?;
    let amount = yuan_to_fen(value(columns.amount), negative)
        .filter(|a| is_amount(*a))
        .ok_or_else(|| invalid_row(line, "订单金额（元） must be yuan with at most two decimals"))?;
    Ok(Some(StatementRow {
        kind,
        id: id.to_owned(),
        order_no: order_no.to_owned(),
        amount,
        at_ms: Some(at_ms),
        coupon_amount: None,
        // Alipay's statements are in yuan, as its notices (docs/channels.md).
        currency: Some(CURRENCY.to_owned()),
        line,
        raw: String::new(),
    }))
}
