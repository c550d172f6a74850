//! The simulated WeChat Pay's platform certificates against payonce's own
//! download (`--wechatpay-platform-certs auto`, through the library's
//! `wechatpay::configure`, as `serve` builds it): the download is served
//! and its request's signature checked; a rotation, an expired certificate
//! and the move to a WeChat Pay public key are each followed by payonce's
//! calls without a restart.

use super::tests::{keys, MERCHANT_SERIAL};
use super::*;
use payonce::platforms::wechatpay::{self as wx, Settings};
use payonce::platforms::{Parts, PlatformSettings, Registry, TradeState};
use rsa::pkcs8::{DecodePrivateKey, EncodePublicKey};

const APIV3_KEY: &str = "SIMTESTapiv3key0123456789abcdefg";
const PUBLIC_KEY_ID: &str = "PUB_KEY_ID_0114232026120500000000000000000009";
const DAY_MS: i64 = 86_400_000;
/// payonce signs with ring, which takes 2048-bit keys and more: the fixture.
const MERCHANT_PEM: &str = include_str!("../../../tests/fixtures/keys/merchant.pem");

/// A file of `text` under a fresh temporary directory (removed by the caller's guard).
struct Files(std::path::PathBuf);

impl Files {
    fn new() -> Files {
        let dir = std::env::temp_dir().join(format!("payonce-sim-certs-{}", unique_digits(12)));
        std::fs::create_dir_all(&dir).expect("temp dir");
        Files(dir)
    }

    fn write(&self, name: &str, text: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, text).expect("write");
        path.display().to_string()
    }
}

impl Drop for Files {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The trade's state as payonce's WeChat Pay calls see it: `None` when the answer did not verify.
fn query(registry: &Registry, out_trade_no: &str) -> Option<TradeState> {
    let exchange = registry.calls(wx::NAME).expect("calls on").query(out_trade_no, now_ms());
    match exchange.meaning {
        TradeState::Unknown => None,
        meaning => Some(meaning),
    }
}

fn held(registry: &Registry) -> Vec<String> {
    registry.certificates().into_iter().filter(|c| c.not_after_ms > now_ms()).map(|c| c.id).collect()
}

#[test]
fn payonce_follows_a_rotation_an_expiry_and_the_move_to_a_public_key() {
    let keys = keys();
    let merchant = RsaPrivateKey::from_pkcs8_pem(MERCHANT_PEM).expect("the merchant fixture");
    let files = Files::new();
    let first = new_serial();
    let api = PlatformApi::start_wechatpay(WechatpayApiConfig {
        platform_key: Some(keys.wechatpay_platform.clone()),
        platform_serial: first.clone(),
        apiv3_key: Some(APIV3_KEY.as_bytes().to_vec()),
        certificate_valid_ms: Some(365 * DAY_MS),
        ..WechatpayApiConfig::new(MERCHANT_SERIAL, merchant.to_public_key())
    })
    .expect("the simulated WeChat Pay");
    // The public key the merchant moves to later, configured from the start.
    let public = keys.alipay_platform.clone();
    let public_pem = public.to_public_key().to_public_key_pem(rsa::pkcs8::LineEnding::LF).expect("pem");
    let settings = PlatformSettings {
        wechatpay: Settings {
            apiv3_key: Some(APIV3_KEY.into()),
            public_keys: vec![format!("{PUBLIC_KEY_ID}={}", files.write("pub.pem", &public_pem))],
            mchid: Some(api.merchant_id().to_owned()),
            merchant_serial: Some(MERCHANT_SERIAL.into()),
            merchant_key: Some(files.write("merchant.pem", MERCHANT_PEM)),
            api_base: api.endpoint(),
            platform_certs: true,
            cert_unknown_serial_interval_s: 0,
            ..Settings::default()
        },
        timeout: Duration::from_secs(10),
        ..PlatformSettings::default()
    };
    let platform = wx::configure(&settings, Parts::CallsOnly, &mut Vec::new()).expect("payonce's WeChat Pay");
    let registry = Registry::with([platform]);
    assert_eq!(api.certificate_downloads(), 1, "downloaded at start");
    assert!(api.calls().iter().all(|c| c.verified), "payonce's requests are the merchant's: {:?}", api.calls());
    assert_eq!(held(&registry), vec![first.clone()]);
    api.open_trade("SIMCERT-0001", 100).expect("a trade");
    assert_eq!(query(&registry, "SIMCERT-0001"), Some(TradeState::NotPaid { paying: false }));

    // A rotation: the new certificate listed beside the old, then signing.
    let second = api.rotate_certificate(365 * DAY_MS).expect("rotated");
    assert_eq!(api.listed_certificates().len(), 2);
    assert_eq!(query(&registry, "SIMCERT-0001"), Some(TradeState::NotPaid { paying: false }), "after the rotation");
    assert_eq!(api.certificate_downloads(), 2, "the unknown serial made payonce download once");
    assert_eq!(held(&registry), vec![first.clone(), second.clone()]);

    // The first certificate expires; the next download says so and payonce drops it.
    assert!(api.expire_certificate(&first));
    let third = api.rotate_certificate(365 * DAY_MS).expect("rotated again");
    assert_eq!(query(&registry, "SIMCERT-0001"), Some(TradeState::NotPaid { paying: false }));
    assert_eq!(api.certificate_downloads(), 3);
    assert_eq!(held(&registry), vec![second.clone(), third.clone()], "the expired one is no longer held");

    // The move to the public key: answers signed under PUB_KEY_ID_..., no download needed.
    api.switch_to_public_key(PUBLIC_KEY_ID, public).expect("switched");
    assert_eq!(api.signing_now().map(|(serial, _)| serial).as_deref(), Some(PUBLIC_KEY_ID));
    assert_eq!(query(&registry, "SIMCERT-0001"), Some(TradeState::NotPaid { paying: false }), "the public key");
    assert_eq!(api.certificate_downloads(), 3);
    // A certificate it no longer lists (and did not expire) is still held.
    assert!(api.unlist_certificate(&second));
    let fourth = api.rotate_certificate(DAY_MS).expect("a last rotation");
    assert_eq!(query(&registry, "SIMCERT-0001"), Some(TradeState::NotPaid { paying: false }));
    let now_held = held(&registry);
    assert!(now_held.contains(&second) && now_held.contains(&fourth), "{now_held:?}");
}

#[test]
fn without_the_apiv3_key_there_is_no_certificate_to_download() {
    let keys = keys();
    let refused = PlatformApi::start_wechatpay(WechatpayApiConfig {
        certificate_valid_ms: Some(DAY_MS),
        ..WechatpayApiConfig::new(MERCHANT_SERIAL, keys.app.to_public_key())
    });
    assert!(refused.is_err_and(|e| e.contains("APIv3")));
}
