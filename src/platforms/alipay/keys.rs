//! Alipay's keys: Alipay's public key (`--alipay-public-key FILE`, PEM or
//! the bare base64 the Alipay console shows), read once and shared by the
//! notices and the calls, and the app's private key.

use crate::platforms::{public_key_from_pem, read_key_file, MerchantKey};
use base64::Engine;
use rsa::pkcs8::DecodePublicKey;
use rsa::RsaPublicKey;

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
