//! WeChat Pay's keys: the platform's public keys (bare, or in the platform
//! certificates, whose ends of validity are kept), read from
//! `--wechatpay-public-key SERIAL=FILE`, and the merchant's API private
//! key. One [`HeldKeys`] is shared by the notices and the calls; `SIGHUP`
//! re-reads every file ([`KeyFiles`]) and swaps the whole set at once.

use super::NAME;
use crate::clock::Clock;
use crate::platforms::{public_key_from_pem, read_key_file, Held, HeldCertificate, KeyFileFailure, MerchantKey};
use rsa::RsaPublicKey;
use std::sync::Arc;

/// WeChat Pay platform public keys by serial (or `PUB_KEY_ID_...`); two during rotation.
pub type PlatformKeys = Vec<(String, RsaPublicKey)>;
/// When a platform key given as a certificate stops being valid: (serial,
/// the certificate's notAfter in Unix ms). Bare public keys never expire.
pub type KeyExpiries = Vec<(String, i64)>;

/// The keys in use at one moment: what a notice is verified with, what a
/// call is signed with and its answer verified with.
pub struct Keys {
    pub platform: PlatformKeys,
    pub expiries: KeyExpiries,
    /// The merchant's API private key, when the calls are on.
    pub merchant: Option<Arc<MerchantKey>>,
}

/// WeChat Pay's keys as a reload replaces them.
pub type HeldKeys = Held<Keys>;

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

/// One `SERIAL=FILE` entry: its serial and its file.
fn entry(entry: &str) -> Result<(String, String), String> {
    let (serial, file) = entry.split_once('=').ok_or("--wechatpay-public-key takes SERIAL=FILE")?;
    Ok((serial.trim().to_owned(), file.to_owned()))
}

/// The platform key of one file, and its notAfter when it is a certificate.
fn platform_key(file: &str) -> Result<(RsaPublicKey, Option<i64>), String> {
    let pem = read_key_file(file)?;
    let public_key = public_key_from_pem(&pem).map_err(|e| format!("{file}: {e}"))?;
    Ok((public_key, certificate_not_after_ms(&pem)))
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
    for given in entries {
        let (serial, file) = entry(given)?;
        let (public_key, not_after) = platform_key(&file)?;
        if let Some(not_after) = not_after {
            if not_after < Clock::System.now_ms() {
                warnings.push(format!("the WeChat Pay platform certificate {file} expired; what it signs is refused"));
            }
            expiries.push((serial.clone(), not_after));
        }
        platform_keys.push((serial, public_key));
    }
    Ok((platform_keys, expiries))
}

/// The merchant's API private key of `--wechatpay-merchant-key FILE`.
pub(super) fn merchant_key(file: &str) -> Result<MerchantKey, String> {
    MerchantKey::from_pem(&read_key_file(file)?).map_err(|e| format!("--wechatpay-merchant-key {file}: {e}"))
}

/// WeChat Pay's key files as the settings named them, and the keys they
/// hold now.
pub(super) struct Files {
    /// (serial, file) of each `--wechatpay-public-key`.
    platform: Vec<(String, String)>,
    /// `--wechatpay-merchant-key`, when the calls are on.
    merchant: Option<String>,
    held: HeldKeys,
    /// One reload at a time (two `SIGHUP`s in a row read the files twice, in turn).
    reloading: parking_lot::Mutex<()>,
}

impl Files {
    pub(super) fn new(entries: &[String], merchant: Option<String>, held: HeldKeys) -> Result<Files, String> {
        let platform = entries.iter().map(|e| entry(e)).collect::<Result<_, _>>()?;
        Ok(Files { platform, merchant, held, reloading: parking_lot::Mutex::new(()) })
    }
}

impl crate::platforms::KeyFiles for Files {
    fn name(&self) -> &'static str {
        NAME
    }

    fn reload(&self) -> Vec<KeyFileFailure> {
        let _one_at_a_time = self.reloading.lock();
        let old = self.held.current();
        let mut failures = Vec::new();
        let (mut platform, mut expiries) = (Vec::new(), Vec::new());
        for (serial, file) in &self.platform {
            match platform_key(file) {
                Ok((key, not_after)) => {
                    platform.push((serial.clone(), key));
                    expiries.extend(not_after.map(|at| (serial.clone(), at)));
                }
                Err(why) => {
                    failures.push(KeyFileFailure { file: file.clone(), why });
                    platform.extend(old.platform.iter().filter(|(s, _)| s == serial).cloned());
                    expiries.extend(old.expiries.iter().filter(|(s, _)| s == serial).cloned());
                }
            }
        }
        let merchant = match &self.merchant {
            None => old.merchant.clone(),
            Some(file) => match merchant_key(file) {
                Ok(key) => Some(Arc::new(key)),
                Err(why) => {
                    failures.push(KeyFileFailure { file: file.clone(), why });
                    old.merchant.clone()
                }
            },
        };
        self.held.replace(Keys { platform, expiries, merchant });
        failures
    }

    fn certificates(&self) -> Vec<HeldCertificate> {
        let keys = self.held.current();
        keys.expiries
            .iter()
            .map(|(serial, not_after)| HeldCertificate { platform: NAME, id: serial.clone(), not_after_ms: *not_after })
            .collect()
    }
}
