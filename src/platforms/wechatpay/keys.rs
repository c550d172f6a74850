//! WeChat Pay's keys: the platform's public keys (bare, or in the platform
//! certificates, whose ends of validity are kept), read from
//! `--wechatpay-public-key SERIAL=FILE` once each and shared by the notices
//! and the calls, and the merchant's API private key.

use crate::clock::Clock;
use crate::platforms::{public_key_from_pem, read_key_file, MerchantKey};
use rsa::RsaPublicKey;

/// WeChat Pay platform public keys by serial (or `PUB_KEY_ID_...`); two during rotation.
pub type PlatformKeys = Vec<(String, RsaPublicKey)>;
/// When a platform key given as a certificate stops being valid: (serial,
/// the certificate's notAfter in Unix ms). Bare public keys never expire.
pub type KeyExpiries = Vec<(String, i64)>;

/// The notAfter of an X.509 certificate PEM, in Unix ms; `None` for a bare public key.
pub fn certificate_not_after_ms(pem: &str) -> Option<i64> {
    use x509_cert::der::DecodePem;
    if !pem.contains("-----BEGIN CERTIFICATE-----") {
        return None;
    }
    let cert = x509_cert::Certificate::from_pem(pem.as_bytes()).ok()?;
    let not_after = cert.tbs_certificate.validity.not_after.to_unix_duration();
    i64::try_from(not_after.as_millis()).ok()
}

/// The `--wechatpay-public-key SERIAL=FILE` keys, each file read once, and
/// when those given as certificates expire (what an expired one signs is
/// refused; it is warned about at start).
pub(super) fn platform_keys(
    entries: &[String],
    warnings: &mut Vec<String>,
) -> Result<(PlatformKeys, KeyExpiries), String> {
    let mut expiries = Vec::new();
    let mut platform_keys = Vec::new();
    for entry in entries {
        let (serial, file) = entry.split_once('=').ok_or("--wechatpay-public-key takes SERIAL=FILE")?;
        let pem = read_key_file(file)?;
        let public_key = public_key_from_pem(&pem).map_err(|e| format!("{file}: {e}"))?;
        if let Some(not_after) = certificate_not_after_ms(&pem) {
            if not_after < Clock::System.now_ms() {
                warnings.push(format!("the WeChat Pay platform certificate {file} expired; what it signs is refused"));
            }
            expiries.push((serial.trim().to_owned(), not_after));
        }
        platform_keys.push((serial.trim().to_owned(), public_key));
    }
    Ok((platform_keys, expiries))
}

/// The merchant's API private key of `--wechatpay-merchant-key FILE`.
pub(super) fn merchant_key(file: &str) -> Result<MerchantKey, String> {
    MerchantKey::from_pem(&read_key_file(file)?).map_err(|e| format!("--wechatpay-merchant-key {file}: {e}"))
}
