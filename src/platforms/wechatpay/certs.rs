//! WeChat Pay's platform certificates, downloaded (`--wechatpay-platform-certs
//! auto`, docs/channels.md "Keys and rotation"): `GET /v3/certificates`,
//! signed like every call (`calls.rs`); each `encrypt_certificate`
//! decrypted (AEAD_AES_256_GCM with the APIv3 key, its `nonce` and
//! `associated_data`) into an X.509 PEM whose serial must be the one
//! listed. The whole download is refused unless the answer's signature
//! verifies with a certificate it lists (or a key already trusted).
//!
//! Each certificate is kept until its `expire_time` (or its notAfter, if
//! earlier), whether later downloads list it or not. Downloads happen at
//! start, every `--wechatpay-cert-refresh-s` (the background's key refresh,
//! [`Downloads::refresh_if_due`]), and when a notice or an answer names a
//! serial payonce does not know ([`Downloads::learn`]: at most once every
//! `--wechatpay-cert-unknown-serial-interval-s`). A download runs on the
//! thread that asked for it, holding no lock another request needs; the
//! keys are swapped at once ([`super::HeldKeys`]), and a request in flight
//! keeps the set it started with.

use super::calls::WechatpayApi;
use super::keys::{is_public_key_id, Downloaded, HeldKeys};
use super::notices::verify_signed;
use crate::log;
use aes_gcm::aead::{Aead, Payload};
use aes_gcm::{Aes256Gcm, KeyInit, Nonce};
use base64::Engine;
use serde_json::Value;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// `--wechatpay-cert-refresh-s` by default: twice a day.
pub const CERT_REFRESH_S_DEFAULT: u64 = 43_200;
/// `--wechatpay-cert-unknown-serial-interval-s` by default: once a minute.
pub const CERT_UNKNOWN_SERIAL_INTERVAL_S_DEFAULT: u64 = 60;
/// The path of the download.
pub const CERTIFICATES_PATH: &str = "/v3/certificates";

/// Why a serial payonce did not know is still unknown after [`Downloads::learn`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotLearned {
    /// The download failed (no answer, or one refused): a transient
    /// failure, answered so that WeChat Pay delivers again.
    Failed(String),
    /// A download ran (or one ran too recently to ask again) and does not list it.
    NotListed,
}

/// The state of the downloads, under one short lock.
#[derive(Default)]
struct State {
    /// A download is running (on some thread); others wait for it.
    running: bool,
    /// Downloads finished so far.
    generation: u64,
    /// The last download's result: `None` for success.
    last_failure: Option<String>,
    /// When the last download started, Unix ms.
    last_started_ms: Option<i64>,
    /// When a download for an unknown serial was last started, Unix ms.
    last_unknown_ms: Option<i64>,
}

/// The downloads of one merchant's platform certificates into `held`.
pub struct Downloads {
    /// Signs `GET /v3/certificates` with the merchant's key.
    api: WechatpayApi,
    apiv3_key: super::HeldApiv3Key,
    held: HeldKeys,
    refresh_ms: i64,
    unknown_interval_ms: i64,
    /// How long a request waits for a download another thread runs.
    wait: Duration,
    state: parking_lot::Mutex<State>,
    finished: parking_lot::Condvar,
    ok: AtomicU64,
    failed: AtomicU64,
}

impl Downloads {
    pub(super) fn new(
        api: WechatpayApi,
        apiv3_key: super::HeldApiv3Key,
        held: HeldKeys,
        refresh: Duration,
        unknown_interval: Duration,
        timeout: Duration,
    ) -> Downloads {
        let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Downloads {
            api,
            apiv3_key,
            held,
            refresh_ms: ms(refresh),
            unknown_interval_ms: ms(unknown_interval),
            wait: timeout + Duration::from_secs(1),
            state: parking_lot::Mutex::new(State::default()),
            finished: parking_lot::Condvar::new(),
            ok: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        }
    }

    /// Downloads so far: (ok, failed).
    pub fn counts(&self) -> (u64, u64) {
        (self.ok.load(Ordering::Relaxed), self.failed.load(Ordering::Relaxed))
    }

    /// One download now (at start): `Err` says why it failed.
    pub fn download(&self, now_ms: i64, why: &str) -> Result<(), String> {
        let generation = {
            let mut state = self.state.lock();
            state.last_started_ms = Some(now_ms);
            state.generation
        };
        match self.run_or_wait(now_ms, why, generation) {
            None => Ok(()),
            Some(failure) => Err(failure),
        }
    }

    /// The scheduled download, when `--wechatpay-cert-refresh-s` has passed
    /// since the last one started (after a failure: the unknown-serial
    /// interval, so a failed refresh is soon retried).
    pub fn refresh_if_due(&self, now_ms: i64) {
        let generation = {
            let mut state = self.state.lock();
            let wait = if state.last_failure.is_some() { self.unknown_interval_ms } else { self.refresh_ms };
            let due = state.last_started_ms.is_none_or(|at| now_ms.saturating_sub(at) >= wait);
            if state.running || !due {
                return;
            }
            state.last_started_ms = Some(now_ms);
            state.generation
        };
        let _ = self.run_or_wait(now_ms, "scheduled", generation);
    }

    /// Makes `serial` known if a download lists it: one download when none
    /// ran for an unknown serial within the interval; while one runs (on
    /// any thread), its end is awaited instead.
    pub fn learn(&self, serial: &str, now_ms: i64) -> Result<(), NotLearned> {
        if is_public_key_id(serial) {
            // Public keys are configured, never downloaded.
            return Err(NotLearned::NotListed);
        }
        let generation = {
            let mut state = self.state.lock();
            if !state.running {
                let recent =
                    state.last_unknown_ms.is_some_and(|at| now_ms.saturating_sub(at) < self.unknown_interval_ms);
                if recent {
                    return if self.held.current().lookup(serial).is_some() {
                        Ok(())
                    } else {
                        Err(NotLearned::NotListed)
                    };
                }
                state.last_unknown_ms = Some(now_ms);
                state.last_started_ms = Some(now_ms);
            }
            state.generation
        };
        let why = format!("unknown serial {}", crate::platforms::printable(serial));
        let failure = self.run_or_wait(now_ms, &why, generation);
        if self.held.current().lookup(serial).is_some() {
            return Ok(());
        }
        Err(failure.map_or(NotLearned::NotListed, NotLearned::Failed))
    }

    /// Runs a download, or, when one is running, waits for it to finish
    /// (at most the call's timeout and a second): its failure, if any. A
    /// download finished since `generation` was read counts as this one.
    fn run_or_wait(&self, now_ms: i64, why: &str, generation: u64) -> Option<String> {
        let mut state = self.state.lock();
        if state.generation != generation {
            return state.last_failure.clone();
        }
        if state.running {
            let _ = self.finished.wait_while_for(&mut state, |s| s.generation == generation, self.wait);
            return if state.generation == generation {
                Some("a certificate download is still running".into())
            } else {
                state.last_failure.clone()
            };
        }
        state.running = true;
        drop(state);
        let result = self.download_once(now_ms);
        match &result {
            Ok(()) => {
                self.ok.fetch_add(1, Ordering::Relaxed);
            }
            Err(failure) => {
                self.failed.fetch_add(1, Ordering::Relaxed);
                log::warn(
                    "WeChat Pay certificate download refused; the certificates held stay in use",
                    &[("reason", &why), ("why", failure)],
                );
            }
        }
        let mut state = self.state.lock();
        state.running = false;
        state.generation += 1;
        state.last_failure = result.err();
        let failure = state.last_failure.clone();
        drop(state);
        self.finished.notify_all();
        failure
    }

    /// One download: fetched, decrypted, verified, and the certificates
    /// merged into the keys held; or why it was refused (nothing learned).
    fn download_once(&self, now_ms: i64) -> Result<(), String> {
        let (status, body, headers) = self.api.fetch_unverified(CERTIFICATES_PATH, now_ms)?;
        if status != 200 {
            return Err(format!("HTTP {status}: {}", crate::platforms::printable(&body)));
        }
        let listed = self.decrypt_all(&body)?;
        // The answer must verify with a certificate it lists, or a key
        // already trusted; an expired one verifies nothing.
        let current = self.held.current();
        let mut trusted = current.downloaded.clone();
        trusted.retain(|d| !listed.iter().any(|l| l.serial.eq_ignore_ascii_case(&d.serial)));
        trusted.extend(listed.iter().cloned());
        let candidate = current.with_downloaded(trusted);
        let header = |name: &str| headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.clone());
        verify_signed(&candidate, now_ms, &header, body.as_bytes())
            .map_err(|e| format!("the answer does not verify: {}", e.message))?;
        self.keep(listed, now_ms);
        Ok(())
    }

    /// Every listed certificate, decrypted and parsed: one that fails
    /// refuses the whole download.
    fn decrypt_all(&self, body: &str) -> Result<Vec<Downloaded>, String> {
        let json: Value = serde_json::from_str(body).map_err(|_| "the answer is not JSON".to_owned())?;
        let data = json["data"].as_array().ok_or("the answer has no data array")?;
        let mut listed = Vec::with_capacity(data.len());
        for entry in data {
            listed.push(self.certificate(entry).map_err(|why| {
                let serial = entry["serial_no"].as_str().unwrap_or_default();
                format!("certificate {}: {why}", crate::platforms::printable(serial))
            })?);
        }
        if listed.is_empty() {
            return Err("the answer lists no certificate".into());
        }
        Ok(listed)
    }

    /// One `data` entry: its certificate, checked to carry the serial listed.
    fn certificate(&self, entry: &Value) -> Result<Downloaded, String> {
        let serial = entry["serial_no"].as_str().filter(|s| !s.is_empty()).ok_or("no serial_no")?;
        let expire_time = entry["expire_time"].as_str().ok_or("no expire_time")?;
        let expire_ms = crate::clock::parse_rfc3339_ms(expire_time).ok_or("expire_time is not RFC 3339")?;
        let encrypted = &entry["encrypt_certificate"];
        let text =
            |name: &str| encrypted[name].as_str().ok_or_else(|| format!("encrypt_certificate.{name} is missing"));
        if text("algorithm")? != "AEAD_AES_256_GCM" {
            return Err("encrypt_certificate.algorithm must be AEAD_AES_256_GCM".into());
        }
        let nonce = text("nonce")?.as_bytes();
        if nonce.len() != 12 {
            return Err("encrypt_certificate.nonce must be 12 bytes".into());
        }
        let aad = encrypted["associated_data"].as_str().unwrap_or("").as_bytes();
        let ciphertext = base64::engine::general_purpose::STANDARD
            .decode(text("ciphertext")?)
            .map_err(|_| "encrypt_certificate.ciphertext is not base64".to_owned())?;
        let cipher =
            Aes256Gcm::new_from_slice(&self.apiv3_key.current()).map_err(|_| "the APIv3 key is not 32 bytes")?;
        let plain = cipher
            .decrypt(Nonce::from_slice(nonce), Payload { msg: &ciphertext, aad })
            .map_err(|_| "does not decrypt with the APIv3 key (tampered, or another merchant's)".to_owned())?;
        let pem = String::from_utf8(plain).map_err(|_| "the decrypted certificate is not text")?;
        let (cert_serial, not_after_ms) = certificate_facts(&pem)?;
        if !same_serial(&cert_serial, serial) {
            return Err(format!("the certificate's serial is {cert_serial}, not the one listed"));
        }
        let key = crate::platforms::public_key_from_pem(&pem)?;
        Ok(Downloaded { serial: serial.to_owned(), key, not_after_ms: not_after_ms.min(expire_ms) })
    }

    /// Keeps `listed` (unexpired) and every certificate held before that is
    /// not expired, listed or not; logs each serial learned.
    fn keep(&self, listed: Vec<Downloaded>, now_ms: i64) {
        let mut learned = Vec::new();
        self.held.update(|keys| {
            let mut kept: Vec<Downloaded> = keys
                .downloaded
                .iter()
                .filter(|d| d.not_after_ms > now_ms)
                .filter(|d| !listed.iter().any(|l| l.serial.eq_ignore_ascii_case(&d.serial)))
                .cloned()
                .collect();
            for cert in &listed {
                if cert.not_after_ms <= now_ms {
                    continue;
                }
                if !keys.downloaded.iter().any(|d| d.serial.eq_ignore_ascii_case(&cert.serial)) {
                    learned.push((cert.serial.clone(), cert.not_after_ms));
                }
                kept.push(cert.clone());
            }
            keys.with_downloaded(kept)
        });
        for (serial, not_after_ms) in learned {
            log::info(
                "learned a WeChat Pay platform certificate",
                &[("serial", &serial), ("expires", &crate::clock::format_ms(not_after_ms))],
            );
        }
    }
}

/// The serial number (upper-case hex) and the notAfter (Unix ms) of an X.509 PEM.
fn certificate_facts(pem: &str) -> Result<(String, i64), String> {
    use x509_cert::der::DecodePem;
    let cert =
        x509_cert::Certificate::from_pem(pem.as_bytes()).map_err(|e| format!("not an X.509 certificate: {e}"))?;
    let serial: String = cert.tbs_certificate.serial_number.as_bytes().iter().map(|b| format!("{b:02X}")).collect();
    let not_after = cert.tbs_certificate.validity.not_after.to_unix_duration();
    Ok((serial, i64::try_from(not_after.as_millis()).unwrap_or(i64::MAX)))
}

/// Two hex serials name the same number: case and leading zeros aside.
fn same_serial(a: &str, b: &str) -> bool {
    let trim = |s: &str| s.trim_start_matches('0').to_ascii_uppercase();
    !a.is_empty() && trim(a) == trim(b)
}

#[cfg(test)]
mod tests {
    use super::same_serial;

    #[test]
    fn serials_compare_as_hex_numbers() {
        assert!(same_serial("00A1B2", "a1b2"));
        assert!(same_serial("5F3A", "5f3a"));
        assert!(!same_serial("5F3A", "5F3B"));
        assert!(!same_serial("", ""));
    }
}
