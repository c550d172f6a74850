//! WeChat Pay's platform certificates as the simulated WeChat Pay holds
//! them: each an X.509 certificate of one of its signing keys, under a hex
//! serial, listed by `GET /v3/certificates` (encrypted with the merchant's
//! APIv3 key) until the platform stops listing it. Made here with the
//! RustCrypto types, self-signed: payonce trusts a downloaded certificate
//! for the APIv3 key it decrypts with and the signature of the answer that
//! lists it, not for a chain.

use rsa::pkcs1v15::SigningKey;
use rsa::pkcs8::EncodePublicKey;
use rsa::signature::{SignatureEncoding, Signer};
use rsa::RsaPrivateKey;
use sha2::Sha256;
use std::str::FromStr;
use std::time::Duration;
use x509_cert::der::asn1::{BitString, GeneralizedTime};
use x509_cert::der::{Decode, Encode, EncodePem};
use x509_cert::spki::{AlgorithmIdentifierOwned, ObjectIdentifier, SubjectPublicKeyInfoOwned};
use x509_cert::time::{Time, Validity};

/// sha256WithRSAEncryption.
const SHA256_WITH_RSA: &str = "1.2.840.113549.1.1.11";

/// One platform certificate: its serial (upper-case hex), its PEM and its
/// `expire_time` (Unix ms) as the platform lists it.
#[derive(Clone, Debug)]
pub struct PlatformCertificate {
    pub serial: String,
    pub pem: String,
    pub expire_ms: i64,
}

/// A self-signed certificate of `key` under `serial` (hex), valid from a day
/// ago until `expire_ms`, as a PEM.
pub fn certificate_pem(key: &RsaPrivateKey, serial: &str, expire_ms: i64) -> Result<String, String> {
    let serial_bytes = hex_bytes(serial).ok_or_else(|| format!("serial {serial:?} is not hex"))?;
    let time = |ms: i64| -> Result<Time, String> {
        let duration = Duration::from_millis(u64::try_from(ms.max(0)).unwrap_or(0));
        GeneralizedTime::from_unix_duration(duration).map(Time::GeneralTime).map_err(|e| e.to_string())
    };
    let now_ms = super::now_ms();
    let algorithm = AlgorithmIdentifierOwned {
        oid: ObjectIdentifier::new(SHA256_WITH_RSA).map_err(|e| e.to_string())?,
        parameters: Some(x509_cert::der::Any::null()),
    };
    let spki_der = key.to_public_key().to_public_key_der().map_err(|e| e.to_string())?;
    let name =
        x509_cert::name::Name::from_str("CN=Tenpay.com sim,O=payonce simulator,C=CN").map_err(|e| e.to_string())?;
    let tbs = x509_cert::TbsCertificate {
        version: x509_cert::Version::V3,
        serial_number: x509_cert::serial_number::SerialNumber::new(&serial_bytes).map_err(|e| e.to_string())?,
        signature: algorithm.clone(),
        issuer: name.clone(),
        validity: Validity { not_before: time(now_ms - 86_400_000)?, not_after: time(expire_ms)? },
        subject: name,
        subject_public_key_info: SubjectPublicKeyInfoOwned::from_der(spki_der.as_bytes()).map_err(|e| e.to_string())?,
        issuer_unique_id: None,
        subject_unique_id: None,
        extensions: None,
    };
    let signed = tbs.to_der().map_err(|e| e.to_string())?;
    let signature = SigningKey::<Sha256>::new(key.clone()).try_sign(&signed).map_err(|e| e.to_string())?;
    let cert = x509_cert::Certificate {
        tbs_certificate: tbs,
        signature_algorithm: algorithm,
        signature: BitString::from_bytes(&signature.to_bytes()).map_err(|e| e.to_string())?,
    };
    cert.to_pem(rsa::pkcs8::LineEnding::LF).map_err(|e| e.to_string())
}

/// The bytes of a hex serial (an odd length gets a leading zero).
fn hex_bytes(serial: &str) -> Option<Vec<u8>> {
    let padded = if serial.len() % 2 == 1 { format!("0{serial}") } else { serial.to_owned() };
    (0..padded.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(padded.get(i..i + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()
        .filter(|bytes| !bytes.is_empty())
}

/// A fresh 40-digit hex serial, like WeChat Pay's.
pub fn new_serial() -> String {
    let digits = super::unique_digits(38);
    format!("5A{digits}")
}
