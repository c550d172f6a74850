//! Alipay's keys: Alipay's public key (`--alipay-public-key FILE`, PEM or
//! the bare base64 the Alipay console shows) or, in certificate mode, the
//! three certificates (`--alipay-app-cert`, `--alipay-public-cert`,
//! `--alipay-root-cert`: the key of the Alipay public certificate and the
//! SNs of `certs.rs`), and the app's private key, held once ([`HeldKeys`])
//! for the notices and the calls; `SIGHUP` re-reads every file ([`Files`])
//! and swaps the set at once, a failing file keeping what it gave before.

use super::{certs, NAME};
use crate::platforms::{
    public_key_from_pem, read_key_file, reload_or_keep, Held, HeldCertificate, KeyFileFailure, MerchantKey,
};
use base64::Engine;
use rsa::pkcs8::DecodePublicKey;
use rsa::RsaPublicKey;
use std::sync::Arc;

/// Alipay's public key as PEM, or as the bare base64 the Alipay console shows.
pub fn public_key_from_text(text: &str) -> Result<RsaPublicKey, String> {
    let text = text.trim();
    if text.contains("-----BEGIN") {
        return public_key_from_pem(text);
    }
    let der = base64::engine::general_purpose::STANDARD
        .decode(text.split_whitespace().collect::<String>())
        .map_err(|e| format!("not PEM and not base64: {e}"))?;
    RsaPublicKey::from_public_key_der(&der).map_err(|e| format!("not an RSA public key: {e}"))
}

/// Alipay's public key from the file `file`.
pub(super) fn public_key(file: &str) -> Result<RsaPublicKey, String> {
    public_key_from_text(&read_key_file(file)?).map_err(|e| format!("{file}: {e}"))
}

/// The app's private key of `--alipay-app-private-key FILE`.
pub(super) fn app_private_key(file: &str) -> Result<MerchantKey, String> {
    MerchantKey::from_pem(&read_key_file(file)?).map_err(|e| format!("--alipay-app-private-key {file}: {e}"))
}

/// The SN and the end of validity of one certificate file of certificate mode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertSn {
    pub sn: String,
    pub not_after_ms: i64,
}

/// Certificate mode's SNs: what every request carries (`app_cert_sn`,
/// `alipay_root_cert_sn`), what Alipay's answers name (`alipay_cert_sn`),
/// and the certificates' ends of validity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertMode {
    pub app: CertSn,
    pub alipay: CertSn,
    /// `alipay_root_cert_sn`.
    pub root_sn: String,
    /// Each RSA root of the root file: its own SN and notAfter.
    pub roots: Vec<CertSn>,
}

/// The keys in use at one moment.
pub struct Keys {
    /// What Alipay's notices and answers are verified with: the public key,
    /// or the key of the Alipay public certificate.
    pub public_key: RsaPublicKey,
    /// What requests are signed with, when the calls are on.
    pub app_private: Option<Arc<MerchantKey>>,
    /// Certificate mode's SNs; `None` in public-key mode.
    pub certs: Option<CertMode>,
}

/// Alipay's keys as a reload replaces them.
pub type HeldKeys = Held<Keys>;

/// Where Alipay's key comes from, as the settings named the files.
#[derive(Clone, Debug)]
pub(super) enum Source {
    /// `--alipay-public-key FILE`.
    PublicKey(String),
    /// `--alipay-app-cert`, `--alipay-public-cert`, `--alipay-root-cert`.
    Certificates { app: String, public: String, root: String },
}

/// The app certificate of `--alipay-app-cert FILE`.
pub(super) fn app_cert(file: &str) -> Result<CertSn, String> {
    let read = certs::read_cert(&read_key_file(file)?, false).map_err(|e| format!("{file}: {e}"))?;
    Ok(CertSn { sn: read.sn, not_after_ms: read.not_after_ms })
}

/// The Alipay public certificate of `--alipay-public-cert FILE`: its key and SN.
pub(super) fn public_cert(file: &str) -> Result<(RsaPublicKey, CertSn), String> {
    let read = certs::read_cert(&read_key_file(file)?, true).map_err(|e| format!("{file}: {e}"))?;
    let key = read.public_key.ok_or_else(|| format!("{file}: no RSA key"))?;
    Ok((key, CertSn { sn: read.sn, not_after_ms: read.not_after_ms }))
}

/// The root file of `--alipay-root-cert FILE`: `alipay_root_cert_sn` and its RSA roots.
pub(super) fn root_cert(file: &str) -> Result<(String, Vec<CertSn>), String> {
    let (sn, roots) = certs::read_root(&read_key_file(file)?).map_err(|e| format!("{file}: {e}"))?;
    Ok((sn, roots.into_iter().map(|(sn, not_after_ms)| CertSn { sn, not_after_ms }).collect()))
}

/// Alipay's key, and certificate mode's SNs, read from `source` once.
pub(super) fn alipay_key(source: &Source) -> Result<(RsaPublicKey, Option<CertMode>), String> {
    match source {
        Source::PublicKey(file) => Ok((public_key(file)?, None)),
        Source::Certificates { app, public, root } => {
            let app = app_cert(app)?;
            let (key, alipay) = public_cert(public)?;
            let (root_sn, roots) = root_cert(root)?;
            Ok((key, Some(CertMode { app, alipay, root_sn, roots })))
        }
    }
}

/// Alipay's key files as the settings named them, and the keys they hold now.
pub(super) struct Files {
    pub(super) source: Source,
    pub(super) app_private: Option<String>,
    pub(super) held: HeldKeys,
    /// One reload at a time.
    pub(super) reloading: parking_lot::Mutex<()>,
}

impl Files {
    /// Alipay's key and SNs re-read file by file: a file that fails keeps
    /// what it gave before, and is added to `failures`.
    fn reload_alipay(&self, old: &Keys, failures: &mut Vec<KeyFileFailure>) -> (RsaPublicKey, Option<CertMode>) {
        match (&self.source, &old.certs) {
            (Source::Certificates { app, public, root }, Some(before)) => {
                let app = reload_or_keep(app, app_cert, || before.app.clone(), failures);
                let (key, alipay) =
                    reload_or_keep(public, public_cert, || (old.public_key.clone(), before.alipay.clone()), failures);
                let (root_sn, roots) =
                    reload_or_keep(root, root_cert, || (before.root_sn.clone(), before.roots.clone()), failures);
                (key, Some(CertMode { app, alipay, root_sn, roots }))
            }
            // Public-key mode holds no certificates, before or after.
            (Source::PublicKey(file), _) => {
                (reload_or_keep(file, public_key, || old.public_key.clone(), failures), None)
            }
            // Not reached: the mode is the settings', and so are the keys held.
            (Source::Certificates { .. }, None) => (old.public_key.clone(), None),
        }
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
        let (public_key, certs) = self.reload_alipay(&old, &mut failures);
        let app_private = match &self.app_private {
            None => old.app_private.clone(),
            Some(file) => reload_or_keep(
                file,
                |file| app_private_key(file).map(|key| Some(Arc::new(key))),
                || old.app_private.clone(),
                &mut failures,
            ),
        };
        self.held.replace(Keys { public_key, app_private, certs });
        failures
    }

    /// Certificate mode's certificates by SN: the app certificate, the
    /// Alipay public certificate and each RSA root; public-key mode holds none.
    fn certificates(&self) -> Vec<HeldCertificate> {
        let keys = self.held.current();
        let Some(certs) = &keys.certs else { return Vec::new() };
        [&certs.app, &certs.alipay]
            .into_iter()
            .chain(certs.roots.iter())
            .map(|cert| HeldCertificate { platform: NAME, id: cert.sn.clone(), not_after_ms: cert.not_after_ms })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::{Files, HeldKeys, Keys, Source};
    use crate::platforms::{test_keys, KeyFiles};
    use rsa::pkcs8::{EncodePublicKey, LineEnding};

    #[test]
    fn a_reload_swaps_both_keys_and_a_failing_file_keeps_its_own() {
        let dir = std::env::temp_dir().join(format!("payonce-alipay-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let (public_file, app_file) = (dir.join("alipay-public.pem"), dir.join("app-private.pem"));
        let (old, new) = (test_keys::platform(), test_keys::merchant());
        std::fs::write(&public_file, new.public.to_public_key_pem(LineEnding::LF).expect("pem")).expect("write");
        std::fs::write(&app_file, new.private_pem).expect("write");
        let held = HeldKeys::new(Keys { public_key: old.public.clone(), app_private: None, certs: None });
        let files = Files {
            source: Source::PublicKey(public_file.display().to_string()),
            app_private: Some(app_file.display().to_string()),
            held: held.clone(),
            reloading: parking_lot::Mutex::new(()),
        };
        let before = held.current();
        assert_eq!(files.reload(), Vec::new());
        assert_eq!(held.current().public_key, new.public, "swapped");
        assert!(held.current().app_private.is_some(), "the app key read");
        assert_eq!(before.public_key, old.public, "a reader that started before keeps its keys");

        std::fs::write(&public_file, "not a key").expect("write");
        let failures = files.reload();
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert_eq!(failures[0].file, public_file.display().to_string());
        assert!(!failures[0].why.is_empty());
        assert_eq!(held.current().public_key, new.public, "the failing file's key stays");
        assert!(held.current().app_private.is_some(), "the other file reloaded");
        assert!(files.certificates().is_empty(), "public-key mode holds no certificate");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn certificate_mode_reloads_file_by_file_and_lists_its_certificates_by_sn() {
        use super::{alipay_key, CertMode};
        let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/alipay-cert/");
        let dir = std::env::temp_dir().join(format!("payonce-alipay-certs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let copy = |name: &str| {
            let to = dir.join(name);
            std::fs::copy(format!("{fixtures}{name}"), &to).expect("copy");
            to.display().to_string()
        };
        let (app, public, root) = (
            copy("TEST_ONLY_app_cert.crt"),
            copy("TEST_ONLY_alipay_public_cert.crt"),
            copy("TEST_ONLY_alipay_root_cert.crt"),
        );
        let source = Source::Certificates { app: app.clone(), public: public.clone(), root: root.clone() };
        let (public_key, certs) = alipay_key(&source).expect("the three certificates");
        let certs: CertMode = certs.expect("certificate mode");
        let expected = std::fs::read_to_string(format!("{fixtures}expected_sn.txt")).expect("expected");
        assert!(expected.contains(&format!("alipay_cert_sn={}\n", certs.alipay.sn)), "{expected}");
        let held =
            HeldKeys::new(Keys { public_key: public_key.clone(), app_private: None, certs: Some(certs.clone()) });
        let files = Files { source, app_private: None, held: held.clone(), reloading: parking_lot::Mutex::new(()) };
        let ids: Vec<String> = files.certificates().into_iter().map(|c| c.id).collect();
        assert_eq!(ids.len(), 4, "app, Alipay public and the two RSA roots: {ids:?}");
        assert_eq!((ids[0].as_str(), ids[1].as_str()), (certs.app.sn.as_str(), certs.alipay.sn.as_str()));

        // A broken Alipay certificate keeps its key and SN; the others reload.
        std::fs::write(&public, "-----BEGIN CERTIFICATE-----\nbroken\n-----END CERTIFICATE-----\n").expect("write");
        let failures = files.reload();
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert_eq!(failures[0].file, public);
        assert_eq!(held.current().certs.as_ref().map(|c| c.alipay.sn.clone()), Some(certs.alipay.sn.clone()));
        assert_eq!(held.current().public_key, public_key);

        // A new Alipay certificate (here: the app's, another key and SN) swaps both.
        std::fs::copy(&app, &public).expect("copy");
        assert_eq!(files.reload(), Vec::new());
        let now = held.current();
        assert_eq!(now.certs.as_ref().map(|c| c.alipay.sn.clone()), Some(certs.app.sn.clone()));
        assert_ne!(now.public_key, public_key);
        assert_eq!(now.certs.as_ref().map(|c| c.root_sn.clone()), Some(certs.root_sn.clone()));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
