//! The generic channel's signature: `Payonce-Signature: t=<unix seconds>,v1=<hex>`
//! where `<hex>` is HMAC-SHA256(secret, "<t>.<raw body>"). Several `v1=` may
//! appear and several secrets may be configured (rotation): any pair that
//! matches verifies. Comparison is constant-time (`hmac`'s `verify_slice`).

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// How far `t` may be from now, either way.
pub const SIGNATURE_TOLERANCE_S: i64 = 300;
/// A header longer than this is malformed (bounds the work per request).
pub const SIGNATURE_HEADER_BYTES_MAX: usize = 2_048;
/// At most this many `v1=` entries are tried.
pub const SIGNATURE_ENTRIES_MAX: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignatureError {
    /// Missing, malformed or matching no secret.
    Invalid,
    /// Authentic, but `t` is too far from now.
    Expired,
}

/// Computes the header value for `body` at `t` (for the simulator, tests
/// and the README's tour).
pub fn sign(secret: &[u8], t: i64, body: &[u8]) -> String {
    format!("t={t},v1={}", hex(&mac(secret, t, body).finalize().into_bytes()))
}

/// Verifies `header` over `body` against any of `secrets` at `now_s`.
pub fn verify(header: Option<&str>, body: &[u8], secrets: &[Vec<u8>], now_s: i64) -> Result<(), SignatureError> {
    let header = header.ok_or(SignatureError::Invalid)?;
    if header.len() > SIGNATURE_HEADER_BYTES_MAX {
        return Err(SignatureError::Invalid);
    }
    let (t, candidates) = parse_header(header).ok_or(SignatureError::Invalid)?;
    let authentic = secrets
        .iter()
        .any(|secret| candidates.iter().any(|candidate| mac(secret, t, body).verify_slice(candidate).is_ok()));
    if !authentic {
        return Err(SignatureError::Invalid);
    }
    if (now_s - t).abs() > SIGNATURE_TOLERANCE_S {
        return Err(SignatureError::Expired);
    }
    Ok(())
}

fn mac(secret: &[u8], t: i64, body: &[u8]) -> HmacSha256 {
    // HMAC accepts keys of any length; new_from_slice cannot fail for it.
    let mut mac = match HmacSha256::new_from_slice(secret) {
        Ok(mac) => mac,
        Err(_) => unreachable!("HMAC takes keys of any length"),
    };
    mac.update(t.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// `t=<digits>` exactly once and one or more `v1=<64 hex>`; other keys are
/// ignored (room for future schemes).
fn parse_header(header: &str) -> Option<(i64, Vec<Vec<u8>>)> {
    let mut t = None;
    let mut candidates = Vec::new();
    for part in header.split(',') {
        let (key, value) = part.trim().split_once('=')?;
        match key {
            "t" => {
                if t.is_some() || value.is_empty() || value.len() > 12 || !value.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                t = Some(value.parse::<i64>().ok()?);
            }
            "v1" => {
                if candidates.len() == SIGNATURE_ENTRIES_MAX {
                    return None;
                }
                candidates.push(unhex(value)?);
            }
            _ => {}
        }
    }
    if candidates.is_empty() {
        return None;
    }
    Some((t?, candidates))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if text.len() != 64 {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_700_000_000;

    fn check(header: Option<&str>, body: &[u8], secrets: &[&str], expected: Result<(), SignatureError>) {
        let secrets: Vec<Vec<u8>> = secrets.iter().map(|s| s.as_bytes().to_vec()).collect();
        assert_eq!(verify(header, body, &secrets, NOW), expected, "header {header:?}");
    }

    #[test]
    fn good_signature_verifies() {
        let header = sign(b"s1", NOW, b"{}");
        check(Some(&header), b"{}", &["s1"], Ok(()));
        // Rotation: either configured secret verifies.
        check(Some(&header), b"{}", &["s0", "s1"], Ok(()));
        // Several v1 entries: any one matching verifies.
        let other = sign(b"zz", NOW, b"{}");
        let both = format!("{},{}", header, other.split(',').nth(1).unwrap_or_default());
        check(Some(&both), b"{}", &["zz"], Ok(()));
    }

    #[test]
    fn wrong_secret_and_tampered_body_are_invalid() {
        let header = sign(b"s1", NOW, b"{\"amount\":1}");
        check(Some(&header), b"{\"amount\":1}", &["s2"], Err(SignatureError::Invalid));
        check(Some(&header), b"{\"amount\":2}", &["s1"], Err(SignatureError::Invalid));
        check(Some(&header), b"{\"amount\":1} ", &["s1"], Err(SignatureError::Invalid));
        check(Some(&header), b"{\"amount\":1}", &[], Err(SignatureError::Invalid));
    }

    #[test]
    fn stale_and_future_timestamps_expire() {
        for t in [NOW - 301, NOW + 301] {
            check(Some(&sign(b"s", t, b"x")), b"x", &["s"], Err(SignatureError::Expired));
        }
        for t in [NOW - 300, NOW + 300] {
            check(Some(&sign(b"s", t, b"x")), b"x", &["s"], Ok(()));
        }
    }

    #[test]
    fn malformed_headers_are_invalid() {
        let good = sign(b"s", NOW, b"x");
        let v1 = good.split(',').nth(1).unwrap_or_default().to_owned();
        let cases = [
            None,
            Some(String::new()),
            Some("garbage".to_owned()),
            Some(format!("t={NOW}")),
            Some(v1.clone()),
            Some(format!("t=-5,{v1}")),
            Some(format!("t=abc,{v1}")),
            Some(format!("t={NOW},t={NOW},{v1}")),
            Some(format!("t={NOW},v1=zz")),
            Some(format!("t={NOW},v1={}", "g".repeat(64))),
            Some(format!("t={NOW},v1=é{}", "a".repeat(62))),
            Some(format!("t={NOW},{}", [v1.as_str(); 9].join(","))),
            Some(format!("t=99999999999999999999,{v1}")),
        ];
        for header in cases {
            check(header.as_deref(), b"x", &["s"], Err(SignatureError::Invalid));
        }
    }
}
