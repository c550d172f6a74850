//! WeChat Pay (API v3): its notices (`notices.rs`), its calls (`calls.rs`),
//! its trade bills (`bill.rs`), its keys (`keys.rs`) and the platform
//! certificates it downloads (`certs.rs`).

mod bill;
mod calls;
mod certs;
mod keys;
mod notices;

pub use crate::platforms::public_key_from_pem;
pub use bill::Bill;
pub use calls::{can_carry, WechatpayApi, API_BASE_DEFAULT};
pub use certs::{CERTIFICATES_PATH, CERT_REFRESH_S_DEFAULT, CERT_UNKNOWN_SERIAL_INTERVAL_S_DEFAULT};
pub use keys::{
    certificate_not_after_ms, is_public_key_id, Downloaded, HeldApiv3Key, HeldKeys, KeyExpiries, Keys, PlatformKeys,
};
pub use notices::{verify_signed, Wechatpay, WechatpayConfig, APIV3_KEY_BYTES, TIMESTAMP_TOLERANCE_S};

use super::{Parts, Platform, PlatformSettings};
use std::sync::Arc;
use std::time::Duration;

pub const NAME: &str = "wechatpay";
/// The field of a payment notice that carries the payment time.
pub const PAID_TIME_FIELD: &str = "success_time";

/// WeChat Pay's settings, as given (docs/settings.md).
#[derive(Clone, Debug)]
pub struct Settings {
    /// `--wechatpay-apiv3-key` (or `PAYONCE_WECHATPAY_APIV3_KEY`).
    pub apiv3_key: Option<String>,
    /// `--wechatpay-apiv3-key-file`, when the key came from it: `SIGHUP`
    /// reads it again.
    pub apiv3_key_file: Option<String>,
    /// `--wechatpay-public-key SERIAL=FILE`, repeated.
    pub public_keys: Vec<String>,
    pub mchid: Option<String>,
    pub merchant_serial: Option<String>,
    /// `--wechatpay-merchant-key FILE`.
    pub merchant_key: Option<String>,
    /// `--wechatpay-api-base`.
    pub api_base: String,
    /// `--wechatpay-appid`, repeated.
    pub appids: Vec<String>,
    /// `--wechatpay-platform-certs auto`: the platform certificates are downloaded.
    pub platform_certs: bool,
    /// `--wechatpay-cert-refresh-s`.
    pub cert_refresh_s: u64,
    /// `--wechatpay-cert-unknown-serial-interval-s`.
    pub cert_unknown_serial_interval_s: u64,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            apiv3_key: None,
            apiv3_key_file: None,
            public_keys: Vec::new(),
            mchid: None,
            merchant_serial: None,
            merchant_key: None,
            api_base: String::new(),
            appids: Vec::new(),
            platform_certs: false,
            cert_refresh_s: CERT_REFRESH_S_DEFAULT,
            cert_unknown_serial_interval_s: CERT_UNKNOWN_SERIAL_INTERVAL_S_DEFAULT,
        }
    }
}

impl Settings {
    /// The outgoing calls are on once any outgoing-only setting is given.
    fn outgoing(&self) -> bool {
        self.mchid.is_some() || self.merchant_serial.is_some() || self.merchant_key.is_some()
    }
}

/// WeChat Pay as its settings turn it on: the platform keys and the
/// merchant key read once, held for both the notices and the calls, and
/// their files kept for a reload.
/// With `--wechatpay-platform-certs auto` the certificates are downloaded
/// once here, before `serve` starts (see [`first_download`]).
pub fn configure(settings: &PlatformSettings, parts: Parts, warnings: &mut Vec<String>) -> Result<Platform, String> {
    let own = &settings.wechatpay;
    if own.platform_certs {
        super::require(
            "--wechatpay-platform-certs auto (the download is a signed call, its certificates encrypted with the APIv3 key)",
            &[
                ("--wechatpay-mchid", own.mchid.is_none()),
                ("--wechatpay-merchant-serial", own.merchant_serial.is_none()),
                ("--wechatpay-merchant-key", own.merchant_key.is_none()),
                ("--wechatpay-apiv3-key", own.apiv3_key.is_none()),
            ],
        )?;
    }
    let (platform, expiries) = keys::platform_keys(&own.public_keys, warnings)?;
    let notices = match parts {
        Parts::NoticesAndCalls => notices_config(own, &platform)?,
        Parts::CallsOnly => None,
    };
    let merchant = if own.outgoing() { Some(Arc::new(merchant_key(own)?)) } else { None };
    let outgoing = merchant.is_some();
    if notices.is_none() && !outgoing {
        return Ok(Platform::default());
    }
    let held = HeldKeys::new(Keys::configured(platform, expiries, merchant));
    let apiv3 = HeldApiv3Key::new(own.apiv3_key.as_deref().unwrap_or_default().as_bytes().to_vec());
    let downloads = match (own.platform_certs, &own.apiv3_key) {
        (true, Some(_)) => Some(Arc::new(certs::Downloads::new(
            api(settings, held.clone(), None),
            apiv3.clone(),
            held.clone(),
            Duration::from_secs(own.cert_refresh_s),
            Duration::from_secs(own.cert_unknown_serial_interval_s),
            settings.timeout,
        ))),
        _ => None,
    };
    if let Some(downloads) = &downloads {
        first_download(downloads, own, warnings)?;
    }
    let files = keys::Files::new(
        &own.public_keys,
        own.merchant_key.clone().filter(|_| outgoing),
        own.apiv3_key_file.clone().map(|file| (file, apiv3.clone())),
        held.clone(),
        downloads.clone(),
    )?;
    Ok(Platform {
        notices: notices.map(|_| {
            Arc::new(Wechatpay::with_keys(apiv3.clone(), held.clone(), downloads.clone())) as Arc<dyn super::Notices>
        }),
        calls: outgoing.then(|| Arc::new(api(settings, held.clone(), downloads.clone())) as Arc<dyn super::Calls>),
        keys: Some(Arc::new(files)),
    })
}

/// The download at start. When it fails, payonce starts anyway if public
/// keys are configured (a warning; the downloads retry every
/// `--wechatpay-cert-unknown-serial-interval-s`), else it refuses to start.
fn first_download(downloads: &certs::Downloads, own: &Settings, warnings: &mut Vec<String>) -> Result<(), String> {
    let now_ms = crate::clock::Clock::System.now_ms();
    match downloads.download(now_ms, "start") {
        Ok(()) => Ok(()),
        Err(why) if !own.public_keys.is_empty() => {
            warnings.push(format!(
                "the first WeChat Pay platform certificate download failed ({why}); serving with the configured --wechatpay-public-key, retrying every {} s",
                own.cert_unknown_serial_interval_s
            ));
            Ok(())
        }
        Err(why) => Err(format!(
            "--wechatpay-platform-certs auto: the first download of the platform certificates failed: {why} (payonce would have no key to verify WeChat Pay with; configure --wechatpay-public-key to start without it)"
        )),
    }
}

/// The notification channel: the APIv3 key and at least one platform
/// key. With outgoing calls on, platform keys without an APIv3 key are
/// valid: they verify the API's answers only.
fn notices_config(own: &Settings, platform: &PlatformKeys) -> Result<Option<WechatpayConfig>, String> {
    if own.apiv3_key.is_none() && (own.public_keys.is_empty() || own.outgoing()) {
        return Ok(None);
    }
    let key = own
        .apiv3_key
        .as_deref()
        .ok_or("--wechatpay-public-key needs --wechatpay-apiv3-key (or PAYONCE_WECHATPAY_APIV3_KEY)")?;
    // The keys themselves are held apart (`HeldKeys`), shared with the calls.
    if own.platform_certs {
        return WechatpayConfig::downloading(key, platform.clone()).map(Some);
    }
    WechatpayConfig::new(key, platform.clone()).map(Some)
}

/// The outgoing calls' merchant key: all their settings are then required.
fn merchant_key(own: &Settings) -> Result<crate::platforms::MerchantKey, String> {
    super::require(
        "WeChat Pay's outgoing calls",
        &[
            ("--wechatpay-mchid", own.mchid.is_none()),
            ("--wechatpay-merchant-serial", own.merchant_serial.is_none()),
            ("--wechatpay-merchant-key", own.merchant_key.is_none()),
            (
                "--wechatpay-public-key or --wechatpay-platform-certs auto (to verify the answers)",
                own.public_keys.is_empty() && !own.platform_certs,
            ),
        ],
    )?;
    keys::merchant_key(own.merchant_key.as_deref().unwrap_or_default())
}

/// The outgoing calls, signing and verifying with `held` (and what
/// `downloads` brings).
fn api(settings: &PlatformSettings, held: HeldKeys, downloads: Option<Arc<certs::Downloads>>) -> WechatpayApi {
    let own = &settings.wechatpay;
    let mut api = WechatpayApi::with_keys(
        own.mchid.clone().unwrap_or_default(),
        own.merchant_serial.clone().unwrap_or_default(),
        &own.api_base,
        held,
        settings.timeout,
    );
    api.appids = own.appids.clone();
    api.downloads = downloads;
    api.refund_notify_url = settings
        .public_base_url
        .as_ref()
        .map(|base| format!("{}/v1/callbacks/{NAME}/refund", base.trim_end_matches('/')));
    api
}
