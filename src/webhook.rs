//! Webhooks to the merchant's app, the pure part (docs/webhooks.md):
//! the settings and their parsing, the Standard Webhooks signature, the
//! retry schedule's waits and jitter fraction, and `Retry-After`. The relay
//! that sends them is `relay.rs`, a leased call of `src/outgoing/` (whose
//! `Schedule` applies the jitter); the rows are `store/webhooks.rs`'s.

use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

pub const WEBHOOK_TIMEOUT_MS_DEFAULT: u64 = 15_000;
pub const WEBHOOK_CONCURRENCY_DEFAULT: usize = 8;
/// How often the relay looks for work it was not woken for (events of other
/// processes on the database, retries falling due).
pub const WEBHOOK_POLL_MS_DEFAULT: u64 = 200;
/// `--webhook-retry-s`: the waits before each retry, in seconds.
pub const WEBHOOK_RETRY_S_DEFAULT: &str = "5,300,1800,7200,18000,36000,36000";
/// Each wait of the schedule is stretched or shrunk by up to this fraction
/// (`outgoing::Schedule`).
pub const JITTER_FRACTION: f64 = 0.2;
/// A `Retry-After` stretches a wait up to this, never further.
pub const RETRY_AFTER_MS_MAX: u64 = 3_600_000;
/// An attempt's lease outlives its call's timeout by this much, so the
/// result is written before another process may claim the next attempt.
pub const LEASE_MARGIN_MS: u64 = 2_000;
/// The longest `last_error` kept from an answer's body.
pub const ERROR_TEXT_MAX: usize = 200;

/// The relay's settings; no endpoint means no relay.
#[derive(Clone, Debug)]
pub struct WebhookConfig {
    /// Each `--webhook-url`, as given: the endpoint's name in the database.
    pub endpoints: Vec<String>,
    /// The decoded keys of `PAYONCE_WEBHOOK_SECRET`; each signs every
    /// attempt. A reload of `--webhook-secret-file` replaces them.
    pub secrets: crate::held::Held<Vec<Vec<u8>>>,
    pub timeout_ms: u64,
    /// The waits before the 1st, 2nd, ... retry; after the last, a dead letter.
    pub retry_schedule_ms: Vec<u64>,
    pub concurrency: usize,
    pub poll_ms: u64,
}

impl Default for WebhookConfig {
    fn default() -> WebhookConfig {
        WebhookConfig {
            endpoints: Vec::new(),
            secrets: crate::held::Held::default(),
            timeout_ms: WEBHOOK_TIMEOUT_MS_DEFAULT,
            retry_schedule_ms: parse_retry_schedule(WEBHOOK_RETRY_S_DEFAULT).unwrap_or_default(),
            concurrency: WEBHOOK_CONCURRENCY_DEFAULT,
            poll_ms: WEBHOOK_POLL_MS_DEFAULT,
        }
    }
}

impl WebhookConfig {
    pub fn is_configured(&self, endpoint: &str) -> bool {
        self.endpoints.iter().any(|e| e == endpoint)
    }

    /// How long an attempt is claimed for.
    pub fn lease_ms(&self) -> u64 {
        self.timeout_ms.saturating_add(LEASE_MARGIN_MS)
    }
}

/// A `--webhook-url`: an absolute `http://` or `https://` URL with a host.
pub fn parse_endpoint(url: &str) -> Result<String, String> {
    let url = url.trim();
    let lower = url.to_ascii_lowercase();
    let rest = lower.strip_prefix("https://").or_else(|| lower.strip_prefix("http://"));
    let host = rest.map(|r| r.split(['/', '?', '#']).next().unwrap_or(""));
    let parsed = ureq::http::Uri::try_from(url).ok();
    match (host, parsed) {
        (Some(host), Some(uri)) if !host.is_empty() && uri.host().is_some_and(|h| !h.is_empty()) => Ok(url.to_owned()),
        _ => Err(format!("--webhook-url {url:?}: expected an http:// or https:// URL with a host")),
    }
}

/// `PAYONCE_WEBHOOK_SECRET`: comma-separated `whsec_<base64>`; all of them
/// sign during a rotation.
pub fn parse_secrets(text: &str) -> Result<Vec<Vec<u8>>, String> {
    let secrets: Vec<Vec<u8>> = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            let key = s
                .strip_prefix("whsec_")
                .and_then(|b64| base64::engine::general_purpose::STANDARD.decode(b64).ok())
                .filter(|key| !key.is_empty());
            key.ok_or_else(|| {
                "PAYONCE_WEBHOOK_SECRET (or --webhook-secret-file): each secret is `whsec_` followed by base64 (e.g. from `openssl rand -base64 32`)"
                    .to_owned()
            })
        })
        .collect::<Result<_, _>>()?;
    if secrets.is_empty() {
        return Err("--webhook-url needs --webhook-secret-file or PAYONCE_WEBHOOK_SECRET (whsec_<base64>, comma-separated or one a line in the file)".into());
    }
    Ok(secrets)
}

/// `--webhook-retry-s`: comma-separated waits in seconds (fractions allowed,
/// so tests can shrink the schedule), at least one, each at most 7 days.
pub fn parse_retry_schedule(text: &str) -> Result<Vec<u64>, String> {
    parse_waits("--webhook-retry-s", text)
}

/// A schedule setting (`flag` names it in the error): comma-separated waits
/// in seconds, fractions allowed, at least one, each at most 7 days; in ms.
pub fn parse_waits(flag: &str, text: &str) -> Result<Vec<u64>, String> {
    const WAIT_S_MAX: f64 = 7.0 * 86_400.0;
    let waits: Option<Vec<u64>> = text
        .split(',')
        .map(|w| {
            let seconds: f64 = w.trim().parse().ok()?;
            (seconds.is_finite() && (0.0..=WAIT_S_MAX).contains(&seconds)).then(|| (seconds * 1000.0).round() as u64)
        })
        .collect();
    match waits {
        Some(waits) if !waits.is_empty() => Ok(waits),
        _ => Err(format!("{flag} {text:?}: expected comma-separated waits in seconds, each from 0 to 604800")),
    }
}

/// The `webhook-signature` header: `v1,<base64 HMAC-SHA256(key, "{id}.{ts}.{body}")>`
/// for each secret, space-separated.
pub fn signature_header(secrets: &[Vec<u8>], id: &str, timestamp_s: i64, body: &[u8]) -> String {
    let signed_prefix = format!("{id}.{timestamp_s}.");
    secrets
        .iter()
        .map(|key| {
            // new_from_slice refuses no key length for HMAC.
            let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
            mac.update(signed_prefix.as_bytes());
            mac.update(body);
            format!("v1,{}", base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes()))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The wait a `Retry-After` value asks for (delay-seconds or an HTTP-date,
/// as RFC 9110 defines the header), capped at one hour; `None` if unparseable.
pub fn retry_after_ms(value: &str, now_ms: i64) -> Option<u64> {
    let value = value.trim();
    let wait_ms = if let Ok(seconds) = value.parse::<u64>() {
        seconds.saturating_mul(1000)
    } else {
        let at = time::OffsetDateTime::parse(value, &time::format_description::well_known::Rfc2822).ok()?;
        let at_ms = i64::try_from(at.unix_timestamp_nanos() / 1_000_000).ok()?;
        u64::try_from(at_ms.saturating_sub(now_ms)).unwrap_or(0)
    };
    Some(wait_ms.min(RETRY_AFTER_MS_MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signs_per_standard_webhooks() {
        // The example of the Standard Webhooks specification's test vectors.
        let key = base64::engine::general_purpose::STANDARD.decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = br#"{"test": 2432232314}"#;
        assert_eq!(
            signature_header(&[key], "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn every_secret_signs_during_a_rotation() {
        let header = signature_header(&[b"old".to_vec(), b"new".to_vec()], "id", 1, b"{}");
        let parts: Vec<&str> = header.split(' ').collect();
        assert_eq!(parts.len(), 2);
        assert!(parts.iter().all(|p| p.starts_with("v1,")));
        assert_ne!(parts[0], parts[1]);
    }

    #[test]
    fn secrets_must_be_whsec_base64() {
        assert_eq!(
            parse_secrets("whsec_aGVsbG8=, whsec_d29ybGQ=").unwrap(),
            vec![b"hello".to_vec(), b"world".to_vec()]
        );
        for bad in ["hello", "whsec_", "whsec_not base64!", "", " , "] {
            assert!(parse_secrets(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn endpoints_must_be_http_urls() {
        assert!(parse_endpoint("https://merchant.example/hooks/payonce").is_ok());
        assert!(parse_endpoint("http://127.0.0.1:9000/").is_ok());
        for bad in ["ftp://x/", "merchant.example/hook", "http://", "https:///path", "http://a b/", ""] {
            assert!(parse_endpoint(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn schedule_parses_seconds_with_fractions() {
        assert_eq!(parse_retry_schedule(WEBHOOK_RETRY_S_DEFAULT).unwrap()[..2], [5_000, 300_000]);
        assert_eq!(parse_retry_schedule("0.05, 0.1").unwrap(), vec![50, 100]);
        for bad in ["", "5,,6", "-1", "x", "700000", "NaN"] {
            assert!(parse_retry_schedule(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn retry_after_stretches_up_to_an_hour() {
        assert_eq!(retry_after_ms("120", 0), Some(120_000));
        assert_eq!(retry_after_ms("86400", 0), Some(RETRY_AFTER_MS_MAX));
        let now = crate::clock::parse_rfc3339_ms("2015-10-21T07:27:00Z").unwrap();
        assert_eq!(retry_after_ms("Wed, 21 Oct 2015 07:28:00 GMT", now), Some(60_000));
        assert_eq!(retry_after_ms("Wed, 21 Oct 2015 07:26:00 GMT", now), Some(0));
        assert_eq!(retry_after_ms("soon", 0), None);
    }
}
