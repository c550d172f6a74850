//! Alipay's certificate mode: the certificates' SNs as Alipay's SDKs
//! compute them, the key of the Alipay public certificate, and the ends of
//! validity payonce reports (docs/channels.md, "Keys and rotation").
//!
//! A certificate's SN is the lowercase hex MD5 of its issuer's DN, written
//! as the SDKs write it, followed by its serial in decimal. The DN is the
//! issuer's attributes from the last to the first, each `SHORT=value`,
//! joined with `,` and nothing else (no escaping, no spaces); the short
//! names are `CN, C, L, ST, O, OU, E`, and any other attribute type has an
//! empty one (`=value`); every value is its bytes read as UTF-8, whatever
//! its string type. The serial is the unsigned number of its DER bytes when
//! it has more than 6 of them, and the signed (two's complement) one
//! otherwise. The root file's SN joins, with `_`, the SNs of its
//! certificates signed with an RSA algorithm (an OID under
//! 1.2.840.113549.1.1: sha1WithRSA, sha256WithRSA ...), in the file's
//! order; its ECDSA and SM2 roots are left out. This is Alipay's Node.js SDK
//! (`alipay-sdk`, `antcertutil`), and `tests/clients/alipay_sn.cjs` proves
//! payonce's values equal that SDK's for the certificates of
//! `tests/fixtures/alipay-cert/`.

use md5::{Digest, Md5};
use rsa::pkcs8::DecodePublicKey;
use rsa::RsaPublicKey;
use x509_cert::der::{DecodePem, Encode};
use x509_cert::Certificate;

/// The signature algorithms whose roots count in `alipay_root_cert_sn`:
/// PKCS#1's arc (RSA).
const RSA_SIGNATURE_ARC: &str = "1.2.840.113549.1.1.";

/// The short names the SDK writes in a DN, by attribute type.
const SHORT_NAMES: &[(&str, &str)] = &[
    ("2.5.4.3", "CN"),
    ("2.5.4.6", "C"),
    ("2.5.4.7", "L"),
    ("2.5.4.8", "ST"),
    ("2.5.4.10", "O"),
    ("2.5.4.11", "OU"),
    ("1.2.840.113549.1.9.1", "E"),
];

/// One certificate file read: its SN, its notAfter (Unix ms) and, for the
/// Alipay public certificate, its key.
#[derive(Clone, Debug)]
pub struct CertFile {
    pub sn: String,
    pub not_after_ms: i64,
    pub public_key: Option<RsaPublicKey>,
}

/// The issuer's DN as the SDK writes it.
fn issuer_dn(cert: &Certificate) -> String {
    let mut attributes = Vec::new();
    for rdn in &cert.tbs_certificate.issuer.0 {
        for atv in rdn.0.iter() {
            let oid = atv.oid.to_string();
            let short = SHORT_NAMES.iter().find(|(o, _)| *o == oid).map_or("", |(_, s)| *s);
            attributes.push(format!("{short}={}", String::from_utf8_lossy(atv.value.value())));
        }
    }
    attributes.reverse();
    attributes.join(",")
}

/// The decimal text of a big-endian unsigned number.
fn decimal(bytes: &[u8]) -> String {
    let mut number: Vec<u8> = bytes.iter().copied().skip_while(|b| *b == 0).collect();
    let mut digits = Vec::new();
    while !number.is_empty() {
        let mut remainder = 0u32;
        for byte in number.iter_mut() {
            let value = (remainder << 8) | u32::from(*byte);
            *byte = u8::try_from(value / 10).unwrap_or(0);
            remainder = value % 10;
        }
        digits.push(char::from(b'0' + u8::try_from(remainder).unwrap_or(0)));
        number = number.into_iter().skip_while(|b| *b == 0).collect();
    }
    if digits.is_empty() {
        return "0".to_owned();
    }
    digits.iter().rev().collect()
}

/// The serial in decimal as the SDK reads it (see the module's comment).
fn serial_decimal(der: &[u8]) -> String {
    if der.len() > 6 || der.first().is_none_or(|b| b & 0x80 == 0) {
        return decimal(der);
    }
    // Six bytes or fewer with the sign bit set: a negative number.
    let mut magnitude: Vec<u8> = der.iter().map(|b| !b).collect();
    for byte in magnitude.iter_mut().rev() {
        let (sum, carry) = byte.overflowing_add(1);
        *byte = sum;
        if !carry {
            break;
        }
    }
    format!("-{}", decimal(&magnitude))
}

/// The SN of one certificate, as Alipay's SDKs compute it.
pub fn cert_sn(cert: &Certificate) -> String {
    let text = format!("{}{}", issuer_dn(cert), serial_decimal(cert.tbs_certificate.serial_number.as_bytes()));
    Md5::digest(text.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// The SN of a root file: the SNs of its RSA-signed certificates joined with `_`.
pub fn root_cert_sn(certs: &[Certificate]) -> String {
    certs
        .iter()
        .filter(|cert| cert.signature_algorithm.oid.to_string().starts_with(RSA_SIGNATURE_ARC))
        .map(cert_sn)
        .collect::<Vec<_>>()
        .join("_")
}

fn not_after_ms(cert: &Certificate) -> i64 {
    i64::try_from(cert.tbs_certificate.validity.not_after.to_unix_duration().as_millis()).unwrap_or(i64::MAX)
}

/// One certificate from PEM text (the first of the file).
pub fn parse_cert(pem: &str) -> Result<Certificate, String> {
    Certificate::from_pem(pem.trim().as_bytes()).map_err(|e| format!("not an X.509 certificate PEM: {e}"))
}

/// The app certificate or the Alipay public certificate (`with_key`: its
/// RSA key is read too).
pub fn read_cert(pem: &str, with_key: bool) -> Result<CertFile, String> {
    let cert = parse_cert(pem)?;
    let public_key = if with_key {
        let spki =
            cert.tbs_certificate.subject_public_key_info.to_der().map_err(|e| format!("bad certificate key: {e}"))?;
        Some(RsaPublicKey::from_public_key_der(&spki).map_err(|e| format!("the certificate's key is not RSA: {e}"))?)
    } else {
        None
    };
    Ok(CertFile { sn: cert_sn(&cert), not_after_ms: not_after_ms(&cert), public_key })
}

/// The root file: its SN and the notAfter of each RSA root that counts in
/// it (by that root's own SN), refused when it holds no RSA root.
pub fn read_root(pem: &str) -> Result<(String, Vec<(String, i64)>), String> {
    let certs = Certificate::load_pem_chain(pem.trim().as_bytes())
        .map_err(|e| format!("not a file of X.509 certificate PEMs: {e}"))?;
    let sn = root_cert_sn(&certs);
    if sn.is_empty() {
        return Err("holds no RSA-signed root certificate".into());
    }
    let expiries = certs
        .iter()
        .filter(|cert| cert.signature_algorithm.oid.to_string().starts_with(RSA_SIGNATURE_ARC))
        .map(|cert| (cert_sn(cert), not_after_ms(cert)))
        .collect();
    Ok((sn, expiries))
}

#[cfg(test)]
mod tests {
    use super::{decimal, read_cert, read_root, serial_decimal};

    const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/alipay-cert/");

    fn fixture(name: &str) -> String {
        std::fs::read_to_string(format!("{DIR}{name}")).expect("fixture")
    }

    /// The SNs `tests/clients/alipay_sn.cjs` checks against Alipay's Node.js SDK.
    fn expected(name: &str) -> String {
        let text = fixture("expected_sn.txt");
        let line = text.lines().find_map(|l| l.strip_prefix(&format!("{name}="))).expect("an expected SN");
        line.to_owned()
    }

    #[test]
    fn the_sns_are_those_of_alipays_sdk() {
        let app = read_cert(&fixture("TEST_ONLY_app_cert.crt"), false).expect("app cert");
        assert_eq!(app.sn, expected("app_cert_sn"));
        let alipay = read_cert(&fixture("TEST_ONLY_alipay_public_cert.crt"), true).expect("alipay cert");
        assert_eq!(alipay.sn, expected("alipay_cert_sn"));
        assert!(alipay.public_key.is_some());
        let (root, expiries) = read_root(&fixture("TEST_ONLY_alipay_root_cert.crt")).expect("root");
        assert_eq!(root, expected("alipay_root_cert_sn"));
        assert_eq!(expiries.len(), 2, "the ECDSA root is left out: {expiries:?}");
    }

    #[test]
    fn a_root_file_without_an_rsa_root_and_a_non_certificate_are_refused() {
        let root = fixture("TEST_ONLY_alipay_root_cert.crt");
        let ecdsa_only: String = root.split_inclusive("-----END CERTIFICATE-----\n").nth(1).expect("2nd").to_owned();
        assert!(read_root(&ecdsa_only).expect_err("no RSA root").contains("no RSA"));
        assert!(read_cert("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n", true).is_err());
        assert!(read_root("not a certificate").is_err());
    }

    #[test]
    fn serials_read_as_the_sdk_reads_them() {
        assert_eq!(decimal(&[0xc0, 0xff, 0xee]), "12648430");
        assert_eq!(decimal(&[0]), "0");
        assert_eq!(serial_decimal(&[0x00, 0xc0, 0xff, 0xee]), "12648430");
        assert_eq!(serial_decimal(&[0xff]), "-1", "six bytes or fewer are signed");
        assert_eq!(serial_decimal(&[0x80, 0, 0, 0, 0, 0, 0]), "36028797018963968", "more are unsigned");
        let big = [0x5a, 0x3d, 0x8f, 0x0c, 0x21, 0xe7, 0x4b, 0x9f, 0x86, 0xc0, 0xa1, 0xd2, 0xe3, 0xf4, 0x05, 0x17];
        assert_eq!(serial_decimal(&big), "119950151074816949715389499555009791255");
    }
}
