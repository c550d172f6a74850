//! WeChat Pay's keys: the platform's public keys (bare, or in the platform
//! certificates, whose ends of validity are kept), read from
//! `--wechatpay-public-key SERIAL=FILE`, and the merchant's API private
//! key, and the platform certificates downloaded from WeChat Pay
//! (`certs.rs`, `--wechatpay-platform-certs auto`). One [`HeldKeys`] is
//! shared by the notices and the calls; `SIGHUP` re-reads every file
//! ([`KeyFiles`]) and swaps the whole set at once, keeping what was downloaded.

use super::NAME;
use crate::clock::Clock;
use crate::platforms::{
    public_key_from_pem, read_key_file, reload_or_keep, Held, HeldCertificate, KeyFileFailure, MerchantKey,
};
use rsa::RsaPublicKey;
use std::sync::Arc;

/// WeChat Pay platform public keys by serial (or `PUB_KEY_ID_...`); two during rotation.
pub type PlatformKeys = Vec<(String, RsaPublicKey)>;
/// When a platform key given as a certificate stops being valid: (serial,
/// the certificate's notAfter in Unix ms). Bare public keys never expire.
pub type KeyExpiries = Vec<(String, i64)>;

/// A platform certificate downloaded from `GET /v3/certificates`: its
/// serial, its key, and when it stops being used (its `expire_time`, or
/// the certificate's notAfter if that is earlier), Unix ms.
#[derive(Clone, Debug)]
pub struct Downloaded {
    pub serial: String,
    pub key: RsaPublicKey,
    pub not_after_ms: i64,
}

/// The keys in use at one moment: what a notice is verified with, what a
/// call is signed with and its answer verified with.
pub struct Keys {
    pub platform: PlatformKeys,
    pub expiries: KeyExpiries,
    /// The merchant's API private key, when the calls are on.
    pub merchant: Option<Arc<MerchantKey>>,
    /// The platform certificates downloaded (`--wechatpay-platform-certs
    /// auto`), each kept until it expires, listed or not by later downloads.
    pub downloaded: Vec<Downloaded>,
}

/// The prefix of a WeChat Pay public key's id: such a serial names a
/// configured `--wechatpay-public-key`, never a downloaded certificate.
pub const PUBLIC_KEY_ID_PREFIX: &str = "PUB_KEY_ID_";

/// Whether `serial` is a WeChat Pay public key's id (`PUB_KEY_ID_...`).
pub fn is_public_key_id(serial: &str) -> bool {
    serial.get(..PUBLIC_KEY_ID_PREFIX.len()).is_some_and(|p| p.eq_ignore_ascii_case(PUBLIC_KEY_ID_PREFIX))
}

impl Keys {
    /// Keys without any downloaded certificate.
    pub fn configured(platform: PlatformKeys, expiries: KeyExpiries, merchant: Option<Arc<MerchantKey>>) -> Keys {
        Keys { platform, expiries, merchant, downloaded: Vec::new() }
    }

    /// The key `serial` names (compared case-insensitively: serials are hex
    /// or `PUB_KEY_ID_...`, and SDKs differ in their case) and when it
    /// stops being valid: a `PUB_KEY_ID_` serial picks a configured public
    /// key; any other a configured key or certificate, else a downloaded
    /// certificate. A merchant mid-migration is served by both.
    pub fn lookup(&self, serial: &str) -> Option<(&RsaPublicKey, Option<i64>)> {
        let configured = self.platform.iter().find(|(s, _)| s.eq_ignore_ascii_case(serial)).map(|(_, key)| {
            let not_after = self.expiries.iter().find(|(s, _)| s.eq_ignore_ascii_case(serial)).map(|(_, at)| *at);
            (key, not_after)
        });
        if configured.is_some() || is_public_key_id(serial) {
            return configured;
        }
        self.downloaded.iter().find(|d| d.serial.eq_ignore_ascii_case(serial)).map(|d| (&d.key, Some(d.not_after_ms)))
    }

    /// Every serial held, configured first, for a log line.
    pub fn serials(&self) -> Vec<&str> {
        let configured = self.platform.iter().map(|(s, _)| s.as_str());
        let downloaded = self.downloaded.iter().map(|d| d.serial.as_str());
        configured.chain(downloaded).collect()
    }

    /// The same keys with `downloaded` instead.
    pub fn with_downloaded(&self, downloaded: Vec<Downloaded>) -> Keys {
        Keys {
            platform: self.platform.clone(),
            expiries: self.expiries.clone(),
            merchant: self.merchant.clone(),
            downloaded,
        }
    }
}

/// WeChat Pay's keys as a reload replaces them.
pub type HeldKeys = Held<Keys>;
/// The APIv3 key (32 bytes) that decrypts notices and downloaded
/// certificates, replaced by a reload of `--wechatpay-apiv3-key-file`.
pub type HeldApiv3Key = Held<Vec<u8>>;

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

/// The APIv3 key of `--wechatpay-apiv3-key-file`, read and checked as at
/// start (`crate::held::read_secret_file`), and 32 bytes.
fn apiv3_key(file: &str) -> Result<Vec<u8>, String> {
    let mut warnings = Vec::new();
    let key = crate::held::read_secret_file("wechatpay-apiv3-key-file", file, false, &mut warnings)?;
    for warning in &warnings {
        crate::log::warn("a secret file reloaded with a warning", &[("warning", warning)]);
    }
    if key.len() != super::APIV3_KEY_BYTES {
        return Err(format!(
            "--wechatpay-apiv3-key-file {file:?}: the APIv3 key must be {} bytes, got {}",
            super::APIV3_KEY_BYTES,
            key.len()
        ));
    }
    Ok(key.into_bytes())
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
    /// The certificate downloads, with `--wechatpay-platform-certs auto`.
    downloads: Option<Arc<super::certs::Downloads>>,
    /// `--wechatpay-apiv3-key-file` and the key it gave, when given as a file.
    apiv3: Option<(String, HeldApiv3Key)>,
}

impl Files {
    pub(super) fn new(
        entries: &[String],
        merchant: Option<String>,
        apiv3: Option<(String, HeldApiv3Key)>,
        held: HeldKeys,
        downloads: Option<Arc<super::certs::Downloads>>,
    ) -> Result<Files, String> {
        let platform = entries.iter().map(|e| entry(e)).collect::<Result<_, _>>()?;
        Ok(Files { platform, merchant, held, reloading: parking_lot::Mutex::new(()), downloads, apiv3 })
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
            Some(file) => reload_or_keep(
                file,
                |file| merchant_key(file).map(|key| Some(Arc::new(key))),
                || old.merchant.clone(),
                &mut failures,
            ),
        };
        // The downloaded certificates are not files: a download meanwhile stays.
        self.held.update(|now| Keys { platform, expiries, merchant, downloaded: now.downloaded.clone() });
        if let Some((file, held)) = &self.apiv3 {
            match apiv3_key(file) {
                Ok(key) => held.replace(key),
                Err(why) => failures.push(KeyFileFailure { file: file.clone(), why }),
            }
        }
        failures
    }

    fn certificates(&self) -> Vec<HeldCertificate> {
        held_certificates(&self.held.current())
    }

    fn refresh(&self, now_ms: i64) {
        if let Some(downloads) = &self.downloads {
            downloads.refresh_if_due(now_ms);
        }
    }

    fn downloads(&self) -> Option<(u64, u64)> {
        self.downloads.as_ref().map(|d| d.counts())
    }
}

/// Every certificate `keys` hold, configured and downloaded, once per serial.
fn held_certificates(keys: &Keys) -> Vec<HeldCertificate> {
    let configured = keys.expiries.iter().map(|(serial, at)| (serial, *at));
    let downloaded = keys
        .downloaded
        .iter()
        .filter(|d| !keys.expiries.iter().any(|(s, _)| s.eq_ignore_ascii_case(&d.serial)))
        .map(|d| (&d.serial, d.not_after_ms));
    configured
        .chain(downloaded)
        .map(|(serial, not_after_ms)| HeldCertificate { platform: NAME, id: serial.clone(), not_after_ms })
        .collect()
}
