//! Talking to the payment platforms (docs/platforms.md): payonce asks
//! instead of only listening. Each client signs its requests with the
//! merchant's key (`ring`: the `rsa` crate's private-key operations carry
//! RUSTSEC-2023-0071), calls with an explicit timeout (`ureq`), and trusts
//! an answer only once it verifies with the platform's key and names what
//! was asked; anything else is "no answer" ([`Exchange::unknown`]).
//!
//! The calls of each platform (its folder's `calls.rs`) share what is here.
//! They know neither `App` nor the store: they turn one question
//! into one HTTP exchange and say what it meant. Recording each exchange in
//! `platform_call` and acting on it is `platform_ops.rs`'s.

use rsa::pkcs8::DecodePublicKey;
use rsa::RsaPublicKey;
use std::time::Duration;

pub const PLATFORM_TIMEOUT_MS_DEFAULT: u64 = 10_000;
/// The longest answer kept (and read) of one exchange.
pub const RESPONSE_BYTES_MAX: u64 = 64 * 1024;

/// `--platform-retry-s`: the waits between attempts; the last repeats.
pub const PLATFORM_RETRY_S_DEFAULT: &str = "5,30,120,600,1800,3600";
/// `--close-give-up-s`, counted from the order's `expires_at`.
pub const CLOSE_GIVE_UP_S_DEFAULT: i64 = 86_400;
/// `--refund-query-after-s`.
pub const REFUND_QUERY_AFTER_S_DEFAULT: i64 = 300;
/// `--prepay-reuse-s` [6600]: a created payment is answered again for 110
/// minutes; WeChat Pay's `prepay_id` and `code_url` live two hours.
pub const PREPAY_REUSE_S_DEFAULT: i64 = 6_600;
/// API requests that may wait on the platforms at once (explicit closes);
/// the rest get 503 `platform_unavailable`.
pub const PLATFORM_WAITERS_MAX: usize = 4;

/// Where a payment learnt by asking the platform came from, for `pay_callback_log.source`.
pub const SOURCE_QUERY: &str = "query";

/// What a platform says of an order, in payonce's words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TradeState {
    /// The buyer paid: `pay_no` is the platform's trade number.
    Paid {
        pay_no: String,
        amount: i64,
        /// The currency of `amount`, as the platform states it.
        currency: String,
        paid_at: Option<String>,
    },
    /// Not paid (or no such trade). `paying`: the buyer is paying right now
    /// (WeChat `USERPAYING`), so the order must not be closed in this pass.
    NotPaid {
        paying: bool,
    },
    Closed,
    /// Unreachable, timed out, refused, or an answer that did not verify.
    Unknown,
}

impl TradeState {
    pub fn as_str(&self) -> &'static str {
        match self {
            TradeState::Paid { .. } => "paid",
            TradeState::NotPaid { .. } => "not_paid",
            TradeState::Closed => "closed",
            TradeState::Unknown => "unknown",
        }
    }
}

/// Why a verified "paid" answer cannot be used, if it cannot: its trade
/// number must be a pay_no and its amount an order amount (the identifiers'
/// rules of domain.rs), and a payment time must be RFC 3339. Such an answer
/// is no answer (docs/channels.md): it is not the caller's mistake, so it
/// must never become a 4xx, and a close must still give up on time.
pub(crate) fn unusable(state: &TradeState) -> Option<String> {
    let TradeState::Paid { pay_no, amount, currency, paid_at } = state else {
        return None;
    };
    if !crate::domain::is_identifier(pay_no) {
        return Some(format!("the answer's trade number {pay_no:?} is not 1-64 characters of [A-Za-z0-9_.-]"));
    }
    if !crate::domain::is_amount(*amount) {
        return Some(format!("the answer's amount {amount} is not from 1 to 10^12 minor units"));
    }
    if !crate::domain::is_currency(currency) {
        return Some(format!("the answer's currency {currency:?} is not 3 upper-case letters"));
    }
    if let Some(at) = paid_at.as_deref().filter(|at| crate::clock::parse_rfc3339_ms(at).is_none()) {
        return Some(format!("the answer's payment time {at:?} is not RFC 3339"));
    }
    None
}

/// The payment time of an answer in payonce's own text (UTC, milliseconds),
/// as notifications keep it; an unreadable one is left for [`unusable`].
pub(crate) fn normalised_time(at: &str) -> String {
    crate::clock::parse_rfc3339_ms(at).map_or_else(|| at.to_owned(), crate::clock::format_ms)
}

/// What a platform says to "close this trade".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseAnswer {
    /// Closed now, closed before, or no such trade: the buyer can no longer pay it there.
    Closed,
    /// The platform refused because the trade is paid: query again and apply.
    Paid,
    /// Unreachable, timed out, refused otherwise, or unverified.
    Unknown,
}

/// What a platform says to a refund submission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefundAnswer {
    /// Accepted (now or before: the refund_no is the platform's idempotency key).
    Accepted,
    /// Not accepted, or no trusted answer: submit again later.
    Unknown,
    /// Not sent, and never will be: the platform cannot refund this order
    /// (Alipay refunds CNY only); an operator refunds it by other means.
    NotSendable,
}

/// What a platform says of a refund it accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefundState {
    /// Settled: SUCCESS, or FAILED (WeChat CLOSED / ABNORMAL).
    Settled(crate::domain::PlatformStatus),
    /// Not settled yet.
    NotYet,
    Unknown,
}

/// What the platform gives the buyer to pay with: exactly the keys of its
/// method (docs/platforms.md, "Paying"): `code_url`; `prepay_id` and
/// `client_params`; `h5_url`; `qr_code`; `url`; `order_string`.
#[derive(Clone, Debug, PartialEq)]
pub struct Payment {
    pub fields: serde_json::Map<String, serde_json::Value>,
}

impl Payment {
    /// A payment of these keys and text values, in this order.
    pub fn of(fields: &[(&str, &str)]) -> Payment {
        let fields = fields.iter().map(|(k, v)| ((*k).to_owned(), serde_json::Value::from(*v))).collect();
        Payment { fields }
    }
}

/// What a platform says to "create the payment of this order".
#[derive(Clone, Debug, PartialEq)]
pub enum PrepayAnswer {
    /// Created (or, for a request the buyer opens, signed and ready).
    Created(Payment),
    /// The platform says the trade is paid (WeChat `ORDERPAID`, Alipay
    /// `ACQ.TRADE_HAS_SUCCESS`): query and apply.
    Paid,
    /// The platform says the trade is closed.
    Closed,
    /// Any other refusal, in the platform's words.
    Refused { code: String, message: String },
    /// Not sent, and never will be as asked: why (an order_no the channel
    /// cannot carry, a currency it does not take, a method it lacks).
    NotSendable(String),
    /// Unreachable, timed out, unverified, or an answer about another
    /// trade or merchant.
    Unknown,
}

impl Exchange<PrepayAnswer> {
    /// No call made: payonce cannot send this request, for `why`.
    pub fn not_sendable(request: String, why: String) -> Exchange<PrepayAnswer> {
        Exchange {
            request,
            http_status: None,
            response: format!("not sent: {why}"),
            meaning: PrepayAnswer::NotSendable(why),
            distrust: None,
        }
    }
}

/// `yyyy-MM-ddTHH:mm:ss+08:00`: Unix milliseconds in Beijing time, to the second.
pub(crate) fn beijing_rfc3339(unix_ms: i64) -> String {
    let local = crate::clock::format_ms(unix_ms.saturating_add(crate::clock::UTC8_OFFSET_MS));
    format!("{}+08:00", &local[..19])
}

/// `yyyy-MM-dd HH:mm:ss`: Unix milliseconds in Beijing time, to the second.
pub(crate) fn beijing_plain(unix_ms: i64) -> String {
    let local = crate::clock::format_ms(unix_ms.saturating_add(crate::clock::UTC8_OFFSET_MS));
    format!("{} {}", &local[..10], &local[11..19])
}

/// One HTTP exchange with a platform, as `platform_call` keeps it, and what it meant.
#[derive(Clone, Debug)]
pub struct Exchange<T> {
    /// What was sent (the URL and body; never a signature or a key).
    pub request: String,
    pub http_status: Option<u16>,
    /// The answer's body, or the client's error when there was none.
    pub response: String,
    pub meaning: T,
    /// Why the answer counts as no answer, when it does.
    pub distrust: Option<String>,
}

impl Exchange<TradeState> {
    /// No call made: the platform cannot carry this order_no, so there is no
    /// such trade there (docs/platforms.md).
    pub fn not_carried(request: String, platform: &str) -> Exchange<TradeState> {
        Exchange::not_sent(request, platform, TradeState::NotPaid { paying: false })
    }
}

impl Exchange<CloseAnswer> {
    /// No call made: no such trade there, which counts as closed.
    pub fn not_carried(request: String, platform: &str) -> Exchange<CloseAnswer> {
        Exchange::not_sent(request, platform, CloseAnswer::Closed)
    }
}

impl<T> Exchange<T> {
    /// What `platform_call.response` keeps of the exchange: why it is not
    /// trusted, when it is not, then what was received.
    pub fn recorded_response(&self) -> String {
        match &self.distrust {
            None => self.response.clone(),
            Some(why) => format!("{why}\n{}", self.response),
        }
    }

    fn not_sent(request: String, platform: &str, meaning: T) -> Exchange<T> {
        Exchange {
            request,
            http_status: None,
            response: format!("not sent: {platform} cannot carry this order_no (no such trade there)"),
            meaning,
            distrust: None,
        }
    }

    /// An exchange whose answer counts as none (unreachable, unverified ...).
    pub fn unknown(
        request: String,
        http_status: Option<u16>,
        response: String,
        why: String,
        meaning: T,
    ) -> Exchange<T> {
        Exchange { request, http_status, response, meaning, distrust: Some(why) }
    }
}

/// The merchant's API private key (PEM: PKCS#8 `PRIVATE KEY` or PKCS#1 `RSA
/// PRIVATE KEY`), for SHA256withRSA request signatures.
pub struct MerchantKey {
    pair: ring::signature::RsaKeyPair,
}

impl std::fmt::Debug for MerchantKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MerchantKey(..)")
    }
}

impl MerchantKey {
    pub fn from_pem(pem: &str) -> Result<MerchantKey, String> {
        use rustls_pemfile::Item;
        let mut reader = std::io::BufReader::new(pem.as_bytes());
        loop {
            match rustls_pemfile::read_one(&mut reader) {
                Ok(Some(Item::Pkcs8Key(der))) => {
                    return ring::signature::RsaKeyPair::from_pkcs8(der.secret_pkcs8_der())
                        .map(|pair| MerchantKey { pair })
                        .map_err(|e| format!("not an RSA private key: {e}"));
                }
                Ok(Some(Item::Pkcs1Key(der))) => {
                    return ring::signature::RsaKeyPair::from_der(der.secret_pkcs1_der())
                        .map(|pair| MerchantKey { pair })
                        .map_err(|e| format!("not an RSA private key: {e}"));
                }
                Ok(Some(_)) => continue,
                Ok(None) => return Err("no PRIVATE KEY or RSA PRIVATE KEY block in the PEM".into()),
                Err(e) => return Err(format!("unreadable PEM: {e}")),
            }
        }
    }

    /// base64 SHA256withRSA (PKCS#1 v1.5) of `message`.
    pub fn sign_base64(&self, message: &[u8]) -> Result<String, String> {
        use base64::Engine as _;
        let mut signature = vec![0u8; self.pair.public().modulus_len()];
        self.pair
            .sign(&ring::signature::RSA_PKCS1_SHA256, &ring::rand::SystemRandom::new(), message, &mut signature)
            .map_err(|_| "RSA signing failed".to_owned())?;
        Ok(base64::engine::general_purpose::STANDARD.encode(signature))
    }
}

/// A platform public key from PEM: `PUBLIC KEY` (SubjectPublicKeyInfo),
/// `RSA PUBLIC KEY` (PKCS#1) or an X.509 `CERTIFICATE`.
pub fn public_key_from_pem(pem: &str) -> Result<RsaPublicKey, String> {
    if pem.contains("-----BEGIN CERTIFICATE-----") {
        use x509_cert::der::{DecodePem, Encode};
        let cert =
            x509_cert::Certificate::from_pem(pem.as_bytes()).map_err(|e| format!("not an X.509 certificate: {e}"))?;
        let spki =
            cert.tbs_certificate.subject_public_key_info.to_der().map_err(|e| format!("bad certificate key: {e}"))?;
        return RsaPublicKey::from_public_key_der(&spki).map_err(|e| format!("the certificate's key is not RSA: {e}"));
    }
    if pem.contains("-----BEGIN RSA PUBLIC KEY-----") {
        use rsa::pkcs1::DecodeRsaPublicKey;
        return RsaPublicKey::from_pkcs1_pem(pem).map_err(|e| format!("not a PKCS#1 RSA public key: {e}"));
    }
    RsaPublicKey::from_public_key_pem(pem.trim()).map_err(|e| format!("not an RSA public key PEM: {e}"))
}

/// The text of the key file `file` (read once by the platform that names it).
pub(crate) fn read_key_file(file: &str) -> Result<String, String> {
    std::fs::read_to_string(file).map_err(|e| format!("cannot read {file}: {e}"))
}

/// Err naming every flag of `what` that is missing.
pub(crate) fn require(what: &str, flags: &[(&str, bool)]) -> Result<(), String> {
    let missing: Vec<&str> = flags.iter().filter_map(|(flag, absent)| absent.then_some(*flag)).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!("{what} also need {}", missing.join(", ")))
    }
}

/// The HTTP client of payonce's outgoing calls (the platforms, the webhook
/// relay): the whole call within `timeout`,
/// a 4xx or 5xx an answer to read, no redirect followed, no proxy.
pub fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        .max_redirects(0)
        .max_redirects_will_error(false)
        .proxy(None)
        .user_agent(format!("payonce/{}", env!("CARGO_PKG_VERSION")))
        .build()
        .into()
}

/// Reads at most [`RESPONSE_BYTES_MAX`] of an answer's body as text.
pub(crate) fn body_text(answer: &mut ureq::http::Response<ureq::Body>) -> Result<String, String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    answer
        .body_mut()
        .as_reader()
        .take(RESPONSE_BYTES_MAX)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("reading the answer failed: {e}"))?;
    String::from_utf8(bytes).map_err(|_| "the answer is not UTF-8".to_owned())
}

/// A fresh random nonce: 32 hex characters.
pub(crate) fn nonce() -> String {
    let mut bytes = [0u8; 16];
    let _ = getrandom::fill(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn beijing_times() {
        assert_eq!(super::beijing_rfc3339(1_700_000_000_999), "2023-11-15T06:13:20+08:00");
        assert_eq!(super::beijing_plain(1_700_000_000_000), "2023-11-15 06:13:20");
    }
}

#[cfg(test)]
pub(crate) mod test_keys {
    //! Two fixed 2048-bit RSA keys for the clients' unit tests
    //! (tests/fixtures/keys/, made with `openssl genpkey`; ring refuses
    //! smaller ones, and generating 2048-bit keys in a debug build is slow).
    use rsa::pkcs8::DecodePrivateKey;

    pub struct Pair {
        pub private: rsa::RsaPrivateKey,
        pub private_pem: &'static str,
        pub public: rsa::RsaPublicKey,
    }

    fn pair_of(private_pem: &'static str) -> Pair {
        let private = rsa::RsaPrivateKey::from_pkcs8_pem(private_pem).expect("a PKCS#8 test key");
        Pair { public: private.to_public_key(), private, private_pem }
    }

    pub fn merchant() -> Pair {
        pair_of(include_str!("../../tests/fixtures/keys/merchant.pem"))
    }

    pub fn platform() -> Pair {
        pair_of(include_str!("../../tests/fixtures/keys/platform.pem"))
    }

    /// base64 SHA256withRSA by `private` (the platform's side in tests).
    pub fn sign(private: &rsa::RsaPrivateKey, message: &[u8]) -> String {
        use base64::Engine as _;
        use rsa::signature::{SignatureEncoding, Signer};
        let key = rsa::pkcs1v15::SigningKey::<sha2::Sha256>::new(private.clone());
        base64::engine::general_purpose::STANDARD.encode(key.sign(message).to_vec())
    }
}
