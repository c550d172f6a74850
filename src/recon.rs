//! Platform statements for reconciliation, parsed into one row shape. Pure:
//! bytes in, rows out. Money in yuan is converted to fen exactly, never
//! through a float.
//!
//! A statement's kind is what it declares, never guessed from the rows that
//! happen to be in it ([`Statement::compared`]). Each platform's format
//! (docs/channels.md describes them) is read by its folder's `bill.rs`
//! (`src/platforms/*/bill.rs`), a [`BillFormat`] the registry finds by name;
//! here is what they share: the size and encoding checks, the lines, one
//! line at a time, and the comparison.

use crate::clock::{format_ms, parse_rfc3339_ms};
use crate::domain::is_identifier;
use crate::error::{Error, ErrorKind};
use std::borrow::Cow;

/// Largest statement accepted (bytes).
pub const STATEMENT_BYTES_MAX: usize = 16 * 1024 * 1024;
pub use crate::clock::UTC8_OFFSET_MS;
/// Yuan to fen lives in `money`; re-exported for the library's callers.
pub use crate::money::yuan_to_fen;

/// A statement's format: the name of a platform of the registry
/// (`crate::platforms::LINES`) whose [`BillFormat`] reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Format(&'static str);

#[allow(non_upper_case_globals)]
impl Format {
    /// The formats of the platforms payonce ships, for callers that name
    /// one in code; [`Format::parse`] finds any platform's.
    pub const Generic: Format = Format(crate::platforms::generic::NAME);
    pub const Wechatpay: Format = Format(crate::platforms::wechatpay::NAME);
    pub const Alipay: Format = Format(crate::platforms::alipay::NAME);

    pub fn parse(text: &str) -> Option<Format> {
        crate::platforms::bills(text).map(|(name, _)| Format(name))
    }

    pub fn as_str(self) -> &'static str {
        self.0
    }

    fn bills(self) -> Result<&'static dyn BillFormat, Error> {
        crate::platforms::bills(self.0)
            .map(|(_, bills)| bills)
            .ok_or_else(|| Error::internal(format!("no platform reads {:?} statements", self.0)))
    }

    /// Offset of the statement's calendar days from UTC.
    pub fn day_offset_ms(self) -> i64 {
        self.bills().map_or(0, |bills| bills.day_offset_ms())
    }
}

/// How one platform's statements are read: where the header is and what
/// it declares, then each row, a line at a time.
pub trait BillFormat: Sync {
    /// Offset of the statement's calendar days from UTC.
    fn day_offset_ms(&self) -> i64;
    /// Whether a statement that is not UTF-8 is read as GBK.
    fn may_be_gbk(&self) -> bool {
        false
    }
    /// Finds the header row among the statement's first lines (numbered,
    /// blank ones skipped): what it compares, how its rows are read, and
    /// the header's line.
    fn header<'t>(
        &self,
        lines: &mut dyn Iterator<Item = Result<(usize, Cow<'t, str>), Error>>,
    ) -> Result<Header, Error>;
}

/// What a statement's header declares.
pub struct Header {
    /// What the statement is complete for.
    pub compared: &'static [RowKind],
    /// How the rows after it are read.
    pub rows: Box<dyn BillRows>,
    /// The 1-based line of the header row; 0 when there is none.
    pub line: usize,
}

/// The rows after a header, one line's fields at a time.
pub trait BillRows: Send + Sync {
    /// What line `line` (its fields, trimmed) is.
    fn read(&self, line: usize, fields: &[String]) -> Result<Read, Error>;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
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

/// A statement checked whole (size, compression, encoding) and read up to
/// its header: what it declares it lists, and its rows, read one line at a
/// time as often as the caller asks ([`Statement::rows`]). Nothing holds a
/// decoded or parsed copy of the whole statement: a 16 MiB statement is
/// compared in a few times its size of memory (docs/performance.md).
pub struct Statement<'a> {
    /// What the statement is complete for. A kind it does not list is not
    /// compared: payonce's payments are not `missing_remote` from a refund bill.
    pub compared: &'static [RowKind],
    text: Text<'a>,
    rows: Box<dyn BillRows>,
    /// The 1-based line of the header row; the rows follow it.
    header_line: usize,
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

/// The statement's text: borrowed from the body when it is UTF-8, decoded
/// line by line when it is GBK.
enum Text<'a> {
    Utf8(&'a str),
    /// Checked to decode without errors; decoded one line at a time. A line
    /// break is a line break in GBK too: 0x0A and 0x0D are never part of a
    /// GBK (GB18030) multi-byte sequence, so each line decodes on its own
    /// exactly as it does inside the whole.
    Gbk(&'a [u8]),
    /// A non-UTF-8 Alipay statement beginning with a byte order mark, which
    /// names the encoding it is decoded from: decoded whole, as a BOM says.
    Decoded(String),
}

impl<'a> Statement<'a> {
    /// Checks the statement's size and encoding and reads its header.
    pub fn read(format: Format, bytes: &'a [u8]) -> Result<Statement<'a>, Error> {
        if bytes.len() > STATEMENT_BYTES_MAX {
            return Err(Error::new(ErrorKind::PayloadTooLarge, "a statement is at most 16 MiB"));
        }
        let bills = format.bills()?;
        let text = decode(bills, bytes)?;
        let Header { compared, rows, line } = bills.header(&mut lines(&text))?;
        Ok(Statement { compared, text, rows, header_line: line })
    }

    /// The statement's rows, in order, read from the start again on every
    /// call; the first bad row ends them with its error.
    pub fn rows(&self) -> Rows<'_> {
        Rows { statement: self, lines: lines(&self.text), done: false }
    }
}

/// The rows of a [`Statement`]: payments and refunds that moved money.
pub struct Rows<'s> {
    statement: &'s Statement<'s>,
    lines: Lines<'s>,
    done: bool,
}

impl Iterator for Rows<'_> {
    type Item = Result<StatementRow, Error>;

    fn next(&mut self) -> Option<Self::Item> {
        while !self.done {
            let (line, text) = match self.lines.next()? {
                Ok((line, _)) if line <= self.statement.header_line => continue,
                Ok(next) => next,
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            };
            match read_row(self.statement.rows.as_ref(), line, &text) {
                Ok(Read::Row(row)) => return Some(Ok(row)),
                Ok(Read::Skip) => {}
                Ok(Read::End) => self.done = true,
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
        }
        None
    }
}

/// What one line after the header is.
pub enum Read {
    Row(StatementRow),
    /// A line that moved no money, or is not a detail row.
    Skip,
    /// The end of the detail rows (a WeChat bill's summary block).
    End,
}

/// UTF-8 (a BOM is dropped); Alipay statements that are not UTF-8 are GBK.
/// The platforms hand their files out compressed (WeChat's `tar_type=GZIP`,
/// Alipay's zip of 业务明细 and 汇总): those are refused with that said.
fn decode<'a>(bills: &dyn BillFormat, bytes: &'a [u8]) -> Result<Text<'a>, Error> {
    if bytes.starts_with(b"\x1f\x8b") {
        return Err(Error::invalid("the statement is gzip-compressed; send the decompressed bill"));
    }
    if bytes.starts_with(b"PK\x03\x04") {
        return Err(Error::invalid("the statement is a zip archive; send the 业务明细 CSV inside it"));
    }
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    let neither = || Error::invalid("the statement is neither UTF-8 nor GBK");
    match std::str::from_utf8(bytes) {
        Ok(text) => Ok(Text::Utf8(text)),
        Err(_) if bills.may_be_gbk() => {
            if encoding_rs::Encoding::for_bom(bytes).is_some() {
                let (text, _, had_errors) = encoding_rs::GBK.decode(bytes);
                return if had_errors { Err(neither()) } else { Ok(Text::Decoded(text.into_owned())) };
            }
            if !is_gbk(bytes.chunks(GBK_CHECK_PIECE_BYTES)) {
                return Err(neither());
            }
            Ok(Text::Gbk(bytes))
        }
        Err(_) => Err(Error::invalid("the statement is not UTF-8")),
    }
}

/// The GBK check reads the statement in pieces of this many bytes.
const GBK_CHECK_PIECE_BYTES: usize = 64 * 1024;

/// Whether `pieces`, one after the other, are GBK without a malformed
/// sequence: decoded incrementally (a character may straddle two pieces)
/// into a small buffer that is thrown away.
fn is_gbk<'p>(pieces: impl Iterator<Item = &'p [u8]>) -> bool {
    let mut decoder = encoding_rs::GBK.new_decoder_without_bom_handling();
    let mut scratch = vec![0u8; 16 * 1024];
    let mut pieces = pieces.peekable();
    loop {
        let mut piece = pieces.next().unwrap_or_default();
        let last = pieces.peek().is_none();
        loop {
            let (result, read, _) = decoder.decode_to_utf8_without_replacement(piece, &mut scratch, last);
            piece = piece.get(read..).unwrap_or_default();
            match result {
                encoding_rs::DecoderResult::InputEmpty => break,
                encoding_rs::DecoderResult::OutputFull => {}
                encoding_rs::DecoderResult::Malformed(..) => return false,
            }
        }
        if last {
            return true;
        }
    }
}

/// The lines of a statement as `str::lines` splits them (a `\r` before a
/// `\n` is dropped), numbered from 1, blank lines skipped.
struct Lines<'a> {
    rest: &'a [u8],
    gbk: bool,
    number: usize,
}

fn lines<'a>(text: &'a Text<'_>) -> Lines<'a> {
    let (rest, gbk) = match text {
        Text::Utf8(text) => (text.as_bytes(), false),
        Text::Gbk(bytes) => (*bytes, true),
        Text::Decoded(text) => (text.as_bytes(), false),
    };
    Lines { rest, gbk, number: 0 }
}

impl<'a> Iterator for Lines<'a> {
    type Item = Result<(usize, Cow<'a, str>), Error>;

    fn next(&mut self) -> Option<Self::Item> {
        while !self.rest.is_empty() {
            let line = match self.rest.iter().position(|b| *b == b'\n') {
                Some(end) => {
                    let line = &self.rest[..end];
                    self.rest = &self.rest[end + 1..];
                    line.strip_suffix(b"\r").unwrap_or(line)
                }
                None => std::mem::take(&mut self.rest),
            };
            self.number += 1;
            let text = if self.gbk {
                encoding_rs::GBK.decode_without_bom_handling_and_without_replacement(line)
            } else {
                std::str::from_utf8(line).ok().map(Cow::Borrowed)
            };
            match text {
                Some(text) if text.trim().is_empty() => {}
                Some(text) => return Some(Ok((self.number, text))),
                None => {
                    self.rest = &[];
                    return Some(Err(invalid_row(self.number, "not UTF-8 or GBK")));
                }
            }
        }
        None
    }
}

/// The fields of one line, trimmed. Each physical line is read on its own:
/// the platforms' files have no multi-line fields, and summary blocks
/// change the column count. A line that is not CSV has no fields.
pub(crate) fn fields_of(line: &str) -> Vec<String> {
    let mut reader = csv::ReaderBuilder::new().has_headers(false).flexible(true).from_reader(line.as_bytes());
    reader
        .records()
        .next()
        .and_then(Result::ok)
        .map(|r| r.iter().map(|f| f.trim().to_owned()).collect())
        .unwrap_or_default()
}

/// The first line whose first field is `first`, as (its line number, its
/// fields): a platform bill's header row, under the lines the platform puts
/// above it. `None` when no line has it.
pub(crate) fn header_row<'t>(
    lines: &mut dyn Iterator<Item = Result<(usize, Cow<'t, str>), Error>>,
    first: &str,
) -> Result<Option<(usize, Vec<String>)>, Error> {
    for next in lines {
        let (line, text) = next?;
        let fields = fields_of(&text);
        if fields.first().is_some_and(|c| c == first) {
            return Ok(Some((line, fields)));
        }
    }
    Ok(None)
}

fn read_row(rows: &dyn BillRows, line: usize, text: &str) -> Result<Read, Error> {
    Ok(match rows.read(line, &fields_of(text))? {
        Read::Row(row) => Read::Row(StatementRow { raw: text.to_owned(), ..row }),
        other => other,
    })
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

pub(crate) fn invalid_row(line: usize, what: &str) -> Error {
    Error::invalid(format!("statement line {line}: {what}"))
}

pub(crate) fn check_ids(line: usize, id: &str, order_no: &str) -> Result<(), Error> {
    if !is_identifier(id) {
        return Err(invalid_row(line, "the pay_no/refund_no is not 1-64 characters of [A-Za-z0-9_.-]"));
    }
    if !is_identifier(order_no) {
        return Err(invalid_row(line, "the order_no is not 1-64 characters of [A-Za-z0-9_.-]"));
    }
    Ok(())
}

/// Finds a column by its header name.
pub(crate) fn column(header: &[String], name: &str, format: &str) -> Result<usize, Error> {
    header
        .iter()
        .position(|h| h == name)
        .ok_or_else(|| Error::invalid(format!("the {format} statement has no column {name}")))
}

/// What one compared statement row is against payonce's record of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Matched,
    AmountMismatch,
    /// payonce has no record of it.
    MissingLocal,
}

/// What payonce recorded of a statement row's payment or refund: its
/// amount, in its order's currency.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalMoney {
    pub amount: i64,
    pub currency: String,
}

/// One statement row against payonce's record for its pay_no / refund_no
/// (`None`: payonce recorded no such payment or refund). Currency is part
/// of the amount (docs/channels.md): a row in another currency than its
/// order's does not match; a row that names none (the generic format) is in
/// the order's own.
pub fn judge(row: &StatementRow, local: Option<&LocalMoney>) -> Verdict {
    match local {
        Some(local) if local.amount == row.amount && row.currency.as_ref().is_none_or(|c| *c == local.currency) => {
            Verdict::Matched
        }
        Some(_) => Verdict::AmountMismatch,
        None => Verdict::MissingLocal,
    }
}

/// The pay_nos and refund_nos a statement lists, for asking of every
/// payment payonce applied in the period whether the platform knows it
/// (`missing_remote`). Compact, because it is the one thing kept for every
/// row: the ids side by side in one string and a sorted index of 12 bytes an
/// id, instead of the rows or a hash set of owned strings.
#[derive(Default)]
pub struct Listed {
    text: String,
    /// (start in `text`, length, kind); sorted by (kind, id) once sealed.
    ids: Vec<(u32, u32, RowKind)>,
}

impl Listed {
    pub fn insert(&mut self, kind: RowKind, id: &str) -> Result<(), Error> {
        let too_many = || Error::internal("a statement's ids exceed 4 GiB");
        let start = u32::try_from(self.text.len()).map_err(|_| too_many())?;
        let len = u32::try_from(id.len()).map_err(|_| too_many())?;
        self.text.push_str(id);
        self.ids.push((start, len, kind));
        Ok(())
    }

    /// Sorts the index; [`Listed::contains`] answers only after this.
    pub fn seal(mut self) -> Listed {
        let text = &self.text;
        self.ids.sort_unstable_by(|a, b| (a.2, id_at(text, a)).cmp(&(b.2, id_at(text, b))));
        self.text.shrink_to_fit();
        self.ids.shrink_to_fit();
        self
    }

    pub fn contains(&self, kind: RowKind, id: &str) -> bool {
        self.ids.binary_search_by(|e| (e.2, id_at(&self.text, e)).cmp(&(kind, id))).is_ok()
    }
}

fn id_at<'t>(text: &'t str, (start, len, _): &(u32, u32, RowKind)) -> &'t str {
    let (start, len) = (*start as usize, *len as usize);
    text.get(start..start + len).unwrap_or_default()
}

/// A statement read whole, for the parsers' tests: what it declares it
/// compares and its rows (`src/platforms/*/bill.rs`).
#[cfg(test)]
pub(crate) struct Parsed {
    pub compared: &'static [RowKind],
    pub rows: Vec<StatementRow>,
}

#[cfg(test)]
pub(crate) fn parse(format: Format, bytes: &[u8]) -> Result<Parsed, Error> {
    let statement = Statement::read(format, bytes)?;
    let rows = statement.rows().collect::<Result<Vec<_>, _>>()?;
    Ok(Parsed { compared: statement.compared, rows })
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

    /// The GBK check reads in pieces, and a character may straddle two:
    /// every piece size gives whole decoding's verdict, and the rows read
    /// line by line from GBK are the rows of the same text read as UTF-8.
    #[test]
    fn gbk_in_pieces_decodes_as_whole() {
        let text =
            "#支付宝业务明细查询\r\n支付宝交易号,商户订单号,业务类型,完成时间,订单金额（元）,退款批次号/请求号\r\n\
                    T1\t,O1\t,交易\t,2024-01-02 10:00:00\t,12.34\t,\t\r\n\
                    T1\t,O1\t,退款\t,2024-01-02 11:00:00\t,-2.00\t,R1\t\r\n\
                    #导出时间：[2024年01月03日 09:00:00]\r\n";
        let (bytes, _, unmappable) = encoding_rs::GBK.encode(text);
        assert!(!unmappable && std::str::from_utf8(&bytes).is_err());
        let mut malformed = bytes.to_vec();
        malformed.insert(40, 0x81);
        let mut truncated = bytes.to_vec();
        truncated.push(0x81);
        for (input, whole_ok) in [(&bytes[..], true), (&malformed[..], false), (&truncated[..], false)] {
            assert_eq!(!encoding_rs::GBK.decode(input).2, whole_ok);
            for piece in 1..=7 {
                assert_eq!(is_gbk(input.chunks(piece)), whole_ok, "pieces of {piece} bytes");
            }
        }
        let from_gbk = parse(Format::Alipay, &bytes).map(|p| p.rows);
        let from_utf8 = parse(Format::Alipay, text.as_bytes()).map(|p| p.rows);
        assert_eq!(from_gbk.as_ref().map(Vec::len).ok(), Some(2));
        assert_eq!(from_gbk, from_utf8);
        assert!(parse(Format::Alipay, &malformed).is_err());
    }

    /// Lines split as `str::lines` splits them.
    #[test]
    fn lines_split_as_str_lines() {
        for text in ["a\r", "a\r\nb\r", "a\n\rb", "\r\n", "a\n", "", "\n\nx\n \ny", "a\r\n\r\nb"] {
            let ours: Vec<(usize, String)> = lines(&Text::Utf8(text))
                .map(|l| l.map(|(n, t)| (n, t.into_owned())))
                .collect::<Result<_, _>>()
                .unwrap_or_default();
            let std: Vec<(usize, String)> = text
                .lines()
                .enumerate()
                .filter(|(_, l)| !l.trim().is_empty())
                .map(|(i, l)| (i + 1, l.to_owned()))
                .collect();
            assert_eq!(ours, std, "{text:?}");
        }
    }

    #[test]
    fn listed_ids_by_kind() {
        let mut listed = Listed::default();
        for (kind, id) in
            [(RowKind::Payment, "P2"), (RowKind::Refund, "P1"), (RowKind::Payment, "P10"), (RowKind::Payment, "P2")]
        {
            assert!(listed.insert(kind, id).is_ok());
        }
        let listed = listed.seal();
        assert!(listed.contains(RowKind::Payment, "P2") && listed.contains(RowKind::Payment, "P10"));
        assert!(listed.contains(RowKind::Refund, "P1"));
        assert!(!listed.contains(RowKind::Payment, "P1") && !listed.contains(RowKind::Payment, "P"));
    }
}
