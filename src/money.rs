//! Money at the boundaries: platforms write yuan as decimal text, payonce
//! keeps integer fen (minor units). Converted exactly, never through a
//! float. Used by the channels and by `recon`.

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

/// Fen to yuan text with two decimals (`1050` is `"10.50"`), as Alipay's
/// `refund_amount` takes it.
pub fn fen_to_yuan(fen: i64) -> String {
    let sign = if fen < 0 { "-" } else { "" };
    let fen = fen.unsigned_abs();
    format!("{sign}{}.{:02}", fen / 100, fen % 100)
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
    fn fen_to_yuan_is_exact() {
        assert_eq!(fen_to_yuan(1050), "10.50");
        assert_eq!(fen_to_yuan(5), "0.05");
        assert_eq!(fen_to_yuan(100), "1.00");
        for fen in [0, 1, 99, 100, 123_456, 1_000_000_000_000] {
            assert_eq!(yuan_to_fen(&fen_to_yuan(fen), false), Some(fen));
        }
    }
}
