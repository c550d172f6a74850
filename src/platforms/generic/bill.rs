//! The generic statement: CSV with the header
//! `pay_no,order_no,amount,status,paid_at` (amount in minor units; status
//! SUCCESS or REFUND; for a REFUND row the `pay_no` column carries the
//! refund_no; paid_at RFC 3339 with offset). Compares payments and refunds;
//! its days are UTC's.

use crate::clock::parse_rfc3339_ms;
use crate::domain::is_amount;
use crate::error::Error;
use crate::recon::BOTH_KINDS;
use crate::recon::{check_ids, fields_of, invalid_row, BillFormat, BillRows, Header, Read, RowKind, StatementRow};
use std::borrow::Cow;

/// The generic statement format.
pub struct Bill;

impl BillFormat for Bill {
    fn day_offset_ms(&self) -> i64 {
        0
    }

    fn header<'t>(
        &self,
        lines: &mut dyn Iterator<Item = Result<(usize, Cow<'t, str>), Error>>,
    ) -> Result<Header, Error> {
        let Some((line, text)) = lines.next().transpose()? else {
            return Ok(Header { compared: BOTH_KINDS, rows: Box::new(Rows), line: 0 });
        };
        if fields_of(&text) != ["pay_no", "order_no", "amount", "status", "paid_at"] {
            return Err(Error::invalid(
                "a generic statement starts with the header pay_no,order_no,amount,status,paid_at",
            ));
        }
        Ok(Header { compared: BOTH_KINDS, rows: Box::new(Rows), line })
    }
}

struct Rows;

impl BillRows for Rows {
    fn read(&self, line: usize, fields: &[String]) -> Result<Read, Error> {
        let [pay_no, order_no, amount, status, paid_at] = fields else {
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
        let at_ms =
            parse_rfc3339_ms(paid_at).ok_or_else(|| invalid_row(line, "paid_at must be RFC 3339 with an offset"))?;
        Ok(Read::Row(StatementRow {
            kind,
            id: pay_no.clone(),
            order_no: order_no.clone(),
            amount,
            at_ms: Some(at_ms),
            coupon_amount: None,
            currency: None,
            line,
            raw: String::new(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use crate::recon::{parse, Format, RowKind};

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
