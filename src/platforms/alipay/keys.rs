//! Alipay's keys: Alipay's public key (`--alipay-public-key FILE`, PEM or
//! the bare base64 the Alipay console shows) and the app's private key,
//! held once ([`HeldKeys`]) for the notices and the calls; `SIGHUP`
//! re-reads both files ([`Files`]) and swaps the pair at once.

use super::NAME;
use crate::platforms::{public_key_from_pem, read_key_file, Held, HeldCertificate, KeyFileFailure, MerchantKey};
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

/// The keys in use at one moment.
pub struct Keys {
    /// What Alipay's notices and answers are verified with.
    pub public_key: RsaPublicKey,
    /// What requests are signed with, when the calls are on.
    pub app_private: Option<Arc<MerchantKey>>,
}

/// Alipay's keys as a reload replaces them.
pub type HeldKeys = Held<Keys>;

/// Alipay's key files as the settings named them, and the keys they hold now.
pub(super) struct Files {
    pub(super) public_key: String,
    pub(super) app_private: Option<String>,
    pub(super) held: HeldKeys,
    /// One reload at a time.
    pub(super) reloading: parking_lot::Mutex<()>,
}

impl crate::platforms::KeyFiles for Files {
    fn name(&self) -> &'static str {
        NAME
    }

    fn reload(&self) -> Vec<KeyFileFailure> {
        let _one_at_a_time = self.reloading.lock();
        let old = self.held.current();
        let mut failures = Vec::new();
        let public_key = public_key(&self.public_key).unwrap_or_else(|why| {
            failures.push(KeyFileFailure { file: self.public_key.clone(), why });
            old.public_key.clone()
        });
        let app_private = match &self.app_private {
            None => old.app_private.clone(),
            Some(file) => match app_private_key(file) {
                Ok(key) => Some(Arc::new(key)),
                Err(why) => {
                    failures.push(KeyFileFailure { file: file.clone(), why });
                    old.app_private.clone()
                }
            },
        };
        self.held.replace(Keys { public_key, app_private });
        failures
    }

    /// Public-key mode holds no certificate.
    fn certificates(&self) -> Vec<HeldCertificate> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::{Files, HeldKeys, Keys};
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
        let held = HeldKeys::new(Keys { public_key: old.public.clone(), app_private: None });
        let files = Files {
            public_key: public_file.display().to_string(),
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
}
