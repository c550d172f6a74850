//! Alipay (OpenAPI): its notices (`notices.rs`), its calls (`calls.rs`),
//! its statements (`bill.rs`) and its keys (`keys.rs`; certificate mode's
//! SNs: `certs.rs`).

mod bill;
mod calls;
pub mod certs;
mod keys;
mod notices;

pub use bill::Bill;
pub use calls::{can_carry, AlipayApi, GATEWAY_DEFAULT};
pub use keys::{public_key_from_text, CertMode, CertSn, HeldKeys, Keys};
pub use notices::{Alipay, AlipayConfig, FORM_FIELDS_MAX};

use super::{Parts, Platform, PlatformSettings};
use std::sync::Arc;

pub const NAME: &str = "alipay";
/// The field of a payment notice that carries the payment time.
pub const PAID_TIME_FIELD: &str = "gmt_payment";
/// The currency of every Alipay amount payonce reads (notices, answers,
/// statements): the domestic API quotes yuan, and payonce reads no
/// `trans_currency` (docs/channels.md).
pub const CURRENCY: &str = "CNY";

/// Alipay's settings, as given (docs/settings.md).
#[derive(Clone, Debug, Default)]
pub struct Settings {
    /// `--alipay-public-key FILE`.
    pub public_key: Option<String>,
    /// Certificate mode: `--alipay-app-cert FILE`, `--alipay-public-cert
    /// FILE`, `--alipay-root-cert FILE`, all three instead of `public_key`.
    pub app_cert: Option<String>,
    pub public_cert: Option<String>,
    pub root_cert: Option<String>,
    pub app_id: Option<String>,
    /// `--alipay-app-private-key FILE`: the outgoing calls are on with it.
    pub app_private_key: Option<String>,
    /// `--alipay-gateway`.
    pub gateway: String,
}

/// Where Alipay's key comes from: `--alipay-public-key`, or the three
/// certificates together; `None` when neither is given. Mixing the modes,
/// or giving some of the certificates only, is refused.
fn key_source(own: &Settings) -> Result<Option<keys::Source>, String> {
    let certs = [
        ("--alipay-app-cert", &own.app_cert),
        ("--alipay-public-cert", &own.public_cert),
        ("--alipay-root-cert", &own.root_cert),
    ];
    let given: Vec<&str> = certs.iter().filter(|(_, v)| v.is_some()).map(|(flag, _)| *flag).collect();
    if given.is_empty() {
        return Ok(own.public_key.clone().map(keys::Source::PublicKey));
    }
    if own.public_key.is_some() {
        return Err(format!(
            "--alipay-public-key (public-key mode) and {} (certificate mode) exclude each other: give one mode",
            given.join(", ")
        ));
    }
    let missing: Vec<&str> = certs.iter().filter(|(_, v)| v.is_none()).map(|(flag, _)| *flag).collect();
    if !missing.is_empty() {
        return Err(format!(
            "Alipay's certificate mode needs --alipay-app-cert, --alipay-public-cert and --alipay-root-cert together; missing {}",
            missing.join(", ")
        ));
    }
    let file = |v: &Option<String>| v.clone().unwrap_or_default();
    Ok(Some(keys::Source::Certificates {
        app: file(&own.app_cert),
        public: file(&own.public_cert),
        root: file(&own.root_cert),
    }))
}

/// Alipay as its settings turn it on: its public key (or its three
/// certificates) and the app key read once, held for both the notices and
/// the calls, and their files kept for a reload.
pub fn configure(settings: &PlatformSettings, parts: Parts, warnings: &mut Vec<String>) -> Result<Platform, String> {
    let own = &settings.alipay;
    let source = key_source(own)?;
    let notices_on = parts == Parts::NoticesAndCalls && (source.is_some() || own.app_id.is_some());
    if notices_on && (source.is_none() || own.app_id.is_none()) {
        return Err("the alipay channel needs --alipay-app-id and --alipay-public-key (or, in certificate mode, \
                    --alipay-app-cert, --alipay-public-cert and --alipay-root-cert)"
            .into());
    }
    let calls_on = own.app_private_key.is_some();
    if calls_on {
        super::require(
            "Alipay's outgoing calls",
            &[
                ("--alipay-app-id", own.app_id.is_none()),
                ("--alipay-public-key or the certificates (to verify the answers)", source.is_none()),
            ],
        )?;
    }
    let Some(source) = source.filter(|_| notices_on || calls_on) else {
        return Ok(Platform::default());
    };
    let (public_key, certs) = keys::alipay_key(&source)?;
    if let (Some(certs), keys::Source::Certificates { app, public, root }) = (&certs, &source) {
        warn_expired(certs, [app.as_str(), public.as_str(), root.as_str()], warnings);
    }
    let app_id = own.app_id.clone().unwrap_or_default();
    let app_private = match &own.app_private_key {
        Some(file) if calls_on => Some(Arc::new(keys::app_private_key(file)?)),
        _ => None,
    };
    let held = HeldKeys::new(Keys { public_key, app_private, certs });
    let files = keys::Files {
        source,
        app_private: own.app_private_key.clone().filter(|_| calls_on),
        held: held.clone(),
        reloading: parking_lot::Mutex::new(()),
    };
    let notices = notices_on.then(|| Alipay::with_keys(app_id.clone(), held.clone()));
    let calls = calls_on.then(|| AlipayApi::with_keys(app_id, &own.gateway, held.clone(), settings.timeout));
    Ok(Platform {
        notices: notices.map(|n| Arc::new(n) as Arc<dyn super::Notices>),
        calls: calls.map(|c| Arc::new(c) as Arc<dyn super::Calls>),
        keys: Some(Arc::new(files)),
    })
}

/// One warning at start per certificate already past its notAfter, naming
/// its file and SN: payonce starts (the file may be replaced and SIGHUP
/// sent), but an expired Alipay public certificate's key is Alipay's no
/// longer, and Alipay refuses requests naming an expired app certificate.
fn warn_expired(certs: &keys::CertMode, [app, public, root]: [&str; 3], warnings: &mut Vec<String>) {
    let now_ms = crate::clock::Clock::System.now_ms();
    let named = [(app, &certs.app), (public, &certs.alipay)].into_iter().chain(certs.roots.iter().map(|r| (root, r)));
    for (file, cert) in named.filter(|(_, cert)| cert.not_after_ms < now_ms) {
        warnings.push(format!(
            "the Alipay certificate {} in {file} expired at {}; replace it and send SIGHUP",
            cert.sn,
            crate::clock::format_ms(cert.not_after_ms)
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::{configure, Settings};
    use crate::platforms::{Parts, PlatformSettings};

    fn configured(alipay: Settings) -> Result<(), String> {
        let settings = PlatformSettings { alipay, ..PlatformSettings::default() };
        configure(&settings, Parts::NoticesAndCalls, &mut Vec::new()).map(|_| ())
    }

    #[test]
    fn the_modes_exclude_each_other_and_the_certificates_come_together() {
        let file = |name: &str| Some(format!("{}/tests/fixtures/alipay-cert/{name}", env!("CARGO_MANIFEST_DIR")));
        let certificates = Settings {
            app_id: Some("2021000000000000".into()),
            app_cert: file("TEST_ONLY_app_cert.crt"),
            public_cert: file("TEST_ONLY_alipay_public_cert.crt"),
            root_cert: file("TEST_ONLY_alipay_root_cert.crt"),
            ..Settings::default()
        };
        assert_eq!(configured(certificates.clone()), Ok(()));
        let mixed = Settings { public_key: Some("/alipay.pem".into()), ..certificates.clone() };
        let why = configured(mixed).expect_err("mixed modes");
        assert!(why.contains("exclude each other") && !why.contains('\n'), "{why}");
        let partial = Settings { root_cert: None, ..certificates };
        let why = configured(partial).expect_err("two of three");
        assert!(why.contains("missing --alipay-root-cert") && !why.contains('\n'), "{why}");
    }

    #[test]
    fn an_expired_certificate_is_warned_about_at_start_naming_its_file_and_sn() {
        use super::keys::{CertMode, CertSn};
        let now_ms = crate::clock::Clock::System.now_ms();
        let cert = |sn: &str, days: i64| CertSn { sn: sn.to_owned(), not_after_ms: now_ms + days * 86_400_000 };
        let certs = CertMode {
            app: cert("app-sn", 300),
            alipay: cert("alipay-sn", -1),
            root_sn: "root-a_root-b".into(),
            roots: vec![cert("root-a", 3000), cert("root-b", -30)],
        };
        let mut warnings = Vec::new();
        super::warn_expired(&certs, ["app.crt", "alipay.crt", "root.crt"], &mut warnings);
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(warnings[0].contains("alipay-sn") && warnings[0].contains("alipay.crt"), "{warnings:?}");
        assert!(warnings[1].contains("root-b") && warnings[1].contains("root.crt"), "{warnings:?}");
    }
}
