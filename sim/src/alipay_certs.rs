//! Alipay's certificate mode, the platform's side: the certificates Alipay
//! hands a merchant, made at run time (rcgen): a root file with an RSA root
//! and an ECDSA P-256 root (Alipay's real root file has non-RSA roots too),
//! the Alipay public certificate of Alipay's signing key and the app
//! certificate of the merchant's key, both issued by the RSA root; and
//! their SNs, which the simulated gateway checks on every request
//! (`app_cert_sn`, `alipay_root_cert_sn`) and names in every answer
//! (`alipay_cert_sn`).
//!
//! The SNs are computed here from what the simulator put in the
//! certificates, never by reading them back with payonce's code: MD5 of the
//! issuer's DN written as Alipay's SDKs write it (its attributes from the
//! last to the first, `SHORT=value` joined with `,`) followed by the serial
//! in decimal; the root's SN joins the SNs of its RSA-signed roots with `_`.

use md5::{Digest, Md5};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, SerialNumber};
use rsa::pkcs1::EncodeRsaPublicKey;
use rsa::pkcs8::{EncodePrivateKey, LineEnding};
use rsa::{RsaPrivateKey, RsaPublicKey};
use std::sync::Arc;
use std::time::Duration;

/// How the simulated platforms sign and payonce holds their keys
/// (`--key-mode`): WeChat Pay under a public key payonce is configured with,
/// or a platform certificate payonce downloads; Alipay's bare public key, or
/// the three certificates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KeyMode {
    #[default]
    PublicKey,
    Certificate,
}

impl KeyMode {
    pub fn parse(text: &str) -> Result<KeyMode, String> {
        match text {
            "public-key" => Ok(KeyMode::PublicKey),
            "certificate" => Ok(KeyMode::Certificate),
            other => Err(format!("--key-mode {other:?}: expected public-key or certificate")),
        }
    }
}

/// The certificate files' names, as `payonce serve`'s flags name them.
pub const APP_CERT_FILE: &str = "alipay-app-cert.crt";
pub const PUBLIC_CERT_FILE: &str = "alipay-public-cert.crt";
pub const ROOT_CERT_FILE: &str = "alipay-root-cert.crt";

/// The three SNs of certificate mode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertSns {
    pub app_cert_sn: String,
    pub alipay_root_cert_sn: String,
    pub alipay_cert_sn: String,
}

/// The certificates as files hold them, and their SNs.
#[derive(Clone, Debug)]
pub struct AlipayCerts {
    pub app_cert_pem: String,
    pub alipay_cert_pem: String,
    pub root_pem: String,
    pub sns: CertSns,
}

/// A DN: (type, short name as the SDK writes it, value), in the order written.
type Dn = [(DnType, &'static str, &'static str)];

const RSA_ROOT: &Dn = &[
    (DnType::CountryName, "C", "CN"),
    (DnType::OrganizationName, "O", "Simulated Ant Financial (payonce-sim, TEST ONLY)"),
    (DnType::OrganizationalUnitName, "OU", "Certification Authority"),
    (DnType::CommonName, "CN", "Simulated Ant Financial Certification Authority R1"),
];
const ECDSA_ROOT: &Dn = &[
    (DnType::CountryName, "C", "CN"),
    (DnType::OrganizationName, "O", "Simulated Ant Financial (payonce-sim, TEST ONLY)"),
    (DnType::CommonName, "CN", "Simulated Ant Financial Certification Authority E1"),
];
const ALIPAY: &Dn = &[
    (DnType::CountryName, "C", "CN"),
    (DnType::OrganizationName, "O", "Simulated Alipay (payonce-sim, TEST ONLY)"),
    (DnType::CommonName, "CN", "Simulated Alipay public key certificate"),
];
const APP: &Dn = &[
    (DnType::CountryName, "C", "CN"),
    (DnType::OrganizationName, "O", "Simulated merchant (payonce-sim, TEST ONLY)"),
    (DnType::CommonName, "CN", "2021000000000000"),
];

/// The DN as Alipay's SDKs write it: last attribute first.
fn sdk_dn(dn: &Dn) -> String {
    dn.iter().rev().map(|(_, short, value)| format!("{short}={value}")).collect::<Vec<_>>().join(",")
}

/// The SN of a certificate issued by `issuer` under `serial`.
fn sn(issuer: &Dn, serial: &[u8; 12]) -> String {
    let mut wide = [0u8; 16];
    wide[4..].copy_from_slice(serial);
    let text = format!("{}{}", sdk_dn(issuer), u128::from_be_bytes(wide));
    Md5::digest(text.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// A fresh 12-byte serial: positive, its first byte not zero.
fn new_serial() -> Result<[u8; 12], String> {
    let mut serial = [0u8; 12];
    getrandom::fill(&mut serial).map_err(|e| format!("no randomness: {e}"))?;
    serial[0] = (serial[0] & 0x7f) | 0x10;
    Ok(serial)
}

fn params(dn: &Dn, serial: &[u8; 12], days: i64, ca: bool) -> Result<CertificateParams, String> {
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(|e| e.to_string())?;
    let mut name = rcgen::DistinguishedName::new();
    for (ty, _, value) in dn {
        name.push(ty.clone(), *value);
    }
    params.distinguished_name = name;
    params.serial_number = Some(SerialNumber::from_slice(serial));
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::days(1);
    params.not_after = now + time::Duration::days(days);
    if ca {
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    }
    Ok(params)
}

fn rsa_key_pair(key: &RsaPrivateKey) -> Result<KeyPair, String> {
    let pem = key.to_pkcs8_pem(LineEnding::LF).map_err(|e| format!("cannot encode the key: {e}"))?;
    KeyPair::from_pkcs8_pem_and_sign_algo(&pem, &rcgen::PKCS_RSA_SHA256).map_err(|e| format!("rcgen: {e}"))
}

/// An RSA public key as rcgen puts it in a certificate: its PKCS#1 bytes.
struct RsaSubject(Vec<u8>);

impl rcgen::PublicKeyData for RsaSubject {
    fn der_bytes(&self) -> &[u8] {
        &self.0
    }

    fn algorithm(&self) -> &rcgen::SignatureAlgorithm {
        &rcgen::PKCS_RSA_SHA256
    }
}

fn public_key_data(key: &RsaPublicKey) -> Result<RsaSubject, String> {
    let der = key.to_pkcs1_der().map_err(|e| format!("cannot encode the key: {e}"))?;
    Ok(RsaSubject(der.as_bytes().to_vec()))
}

impl AlipayCerts {
    /// Certificates for Alipay's key `alipay` and the merchant's app key
    /// `app` (public halves), issued now by a fresh root that signs with
    /// `root_key` (ring signs with no RSA key under 2048 bits, and the
    /// simulator's platform keys are smaller: the merchant's 2048-bit key
    /// stands in, so no key is made for the root).
    pub fn make(alipay: &RsaPublicKey, app: &RsaPublicKey, root_key: &RsaPrivateKey) -> Result<AlipayCerts, String> {
        let failed = |e: rcgen::Error| format!("cannot make the Alipay certificates: {e}");
        let root_key = rsa_key_pair(root_key)?;
        let root_serial = new_serial()?;
        let root = params(RSA_ROOT, &root_serial, 3650, true)?.self_signed(&root_key).map_err(failed)?;
        let ecdsa_key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(failed)?;
        let ecdsa_root = params(ECDSA_ROOT, &new_serial()?, 3650, true)?.self_signed(&ecdsa_key).map_err(failed)?;
        let alipay_serial = new_serial()?;
        let alipay_cert = params(ALIPAY, &alipay_serial, 365, false)?
            .signed_by(&public_key_data(alipay)?, &root, &root_key)
            .map_err(failed)?;
        let app_serial = new_serial()?;
        let app_cert = params(APP, &app_serial, 365, false)?
            .signed_by(&public_key_data(app)?, &root, &root_key)
            .map_err(failed)?;
        Ok(AlipayCerts {
            app_cert_pem: app_cert.pem(),
            alipay_cert_pem: alipay_cert.pem(),
            // As Alipay's file: the ECDSA root first, then the RSA one.
            root_pem: format!("{}{}", ecdsa_root.pem(), root.pem()),
            sns: CertSns {
                app_cert_sn: sn(RSA_ROOT, &app_serial),
                // A self-signed root is its own issuer; only the RSA one counts.
                alipay_root_cert_sn: sn(RSA_ROOT, &root_serial),
                alipay_cert_sn: sn(RSA_ROOT, &alipay_serial),
            },
        })
    }
}

/// Certificate mode for the in-process payonce: the certificates of one
/// Alipay key, written to files as an operator installs them (and the
/// merchant's key beside them), so payonce is configured from the same
/// three settings as `payonce serve --alipay-app-cert ...`.
pub struct CertSetup {
    pub certs: AlipayCerts,
    pub app_cert: String,
    pub public_cert: String,
    pub root_cert: String,
    pub merchant_key: String,
}

/// The directories [`setup`] wrote, removed by [`remove_files`].
static DIRS: parking_lot::Mutex<Vec<std::path::PathBuf>> = parking_lot::Mutex::new(Vec::new());

/// The setup of the Alipay key `alipay` with the merchant's key `merchant`
/// (`pem`, and its public half in the app certificate): made once per key
/// per run, so the in-process payonce and the simulated Alipay share it.
pub fn setup(alipay: &RsaPublicKey, merchant_pem: &str, merchant: &RsaPrivateKey) -> Result<Arc<CertSetup>, String> {
    type Made = Vec<(RsaPublicKey, Arc<CertSetup>)>;
    static MADE: parking_lot::Mutex<Made> = parking_lot::Mutex::new(Vec::new());
    let public = alipay.clone();
    let mut made = MADE.lock();
    if let Some((_, setup)) = made.iter().find(|(key, _)| *key == public) {
        return Ok(Arc::clone(setup));
    }
    let certs = AlipayCerts::make(alipay, &merchant.to_public_key(), merchant)?;
    let dir = std::env::temp_dir().join(format!("payonce-sim-alipay-certs-{}-{}", std::process::id(), made.len()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    DIRS.lock().push(dir.clone());
    let write = |name: &str, text: &str| -> Result<String, String> {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(path.to_string_lossy().into_owned())
    };
    let setup = Arc::new(CertSetup {
        app_cert: write(APP_CERT_FILE, &certs.app_cert_pem)?,
        public_cert: write(PUBLIC_CERT_FILE, &certs.alipay_cert_pem)?,
        root_cert: write(ROOT_CERT_FILE, &certs.root_pem)?,
        merchant_key: write("merchant-key.pem", merchant_pem)?,
        certs,
    });
    made.push((public, Arc::clone(&setup)));
    Ok(setup)
}

/// Removes the files [`setup`] wrote (at the end of a run).
pub fn remove_files() {
    for dir in DIRS.lock().drain(..) {
        let _ = std::fs::remove_dir_all(dir);
    }
}

impl CertSetup {
    /// payonce's Alipay in certificate mode, as `payonce serve` builds it
    /// from `--alipay-app-id`, the three certificate flags and, with
    /// `calls`, `--alipay-app-private-key` and `--alipay-gateway`.
    pub fn payonce_alipay(
        &self,
        app_id: &str,
        calls: Option<(&str, Duration)>,
    ) -> Result<payonce::platforms::Platform, String> {
        let alipay = payonce::platforms::alipay::Settings {
            app_id: Some(app_id.to_owned()),
            app_cert: Some(self.app_cert.clone()),
            public_cert: Some(self.public_cert.clone()),
            root_cert: Some(self.root_cert.clone()),
            app_private_key: calls.map(|_| self.merchant_key.clone()),
            gateway: calls.map_or_else(String::new, |(gateway, _)| gateway.to_owned()),
            ..payonce::platforms::alipay::Settings::default()
        };
        let settings = payonce::platforms::PlatformSettings {
            alipay,
            timeout: calls.map_or(Duration::from_secs(5), |(_, timeout)| timeout),
            ..payonce::platforms::PlatformSettings::default()
        };
        payonce::platforms::alipay::configure(&settings, payonce::platforms::Parts::NoticesAndCalls, &mut Vec::new())
    }
}

#[cfg(test)]
mod tests {
    use super::{sdk_dn, AlipayCerts, RSA_ROOT};
    use payonce::platforms::alipay::certs::{read_cert, read_root};

    #[test]
    fn the_dn_is_written_last_attribute_first() {
        assert_eq!(
            sdk_dn(RSA_ROOT),
            "CN=Simulated Ant Financial Certification Authority R1,OU=Certification Authority,\
             O=Simulated Ant Financial (payonce-sim, TEST ONLY),C=CN"
        );
    }

    /// The simulator's SNs, from what it put in the certificates, equal
    /// payonce's, read from the certificates: two implementations agree
    /// (payonce's is checked against Alipay's SDK by its own tests).
    #[test]
    fn its_sns_are_those_payonce_reads_from_the_certificates() {
        let alipay = rsa::RsaPrivateKey::new(&mut rsa::rand_core::OsRng, 1024).expect("a key");
        let app = rsa::RsaPrivateKey::new(&mut rsa::rand_core::OsRng, 2048).expect("a key");
        let certs = AlipayCerts::make(&alipay.to_public_key(), &app.to_public_key(), &app).expect("certificates");
        assert_eq!(read_cert(&certs.app_cert_pem, false).expect("app").sn, certs.sns.app_cert_sn);
        let read = read_cert(&certs.alipay_cert_pem, true).expect("alipay");
        assert_eq!(read.sn, certs.sns.alipay_cert_sn);
        assert_eq!(read.public_key, Some(alipay.to_public_key()));
        let (root_sn, roots) = read_root(&certs.root_pem).expect("root");
        assert_eq!(root_sn, certs.sns.alipay_root_cert_sn);
        assert_eq!(roots.len(), 1, "the ECDSA root does not count");
        assert_eq!(certs.root_pem.matches("BEGIN CERTIFICATE").count(), 2);
    }
}
