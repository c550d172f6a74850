//! WeChat Pay (API v3): its notices (`notices.rs`), its calls (`calls.rs`),
//! its trade bills (`bill.rs`) and its keys (`keys.rs`).

mod bill;
mod calls;
mod keys;
mod notices;

pub use crate::platforms::public_key_from_pem;
pub use bill::Bill;
pub use calls::{can_carry, WechatpayApi, API_BASE_DEFAULT};
pub use keys::{certificate_not_after_ms, HeldKeys, KeyExpiries, Keys, PlatformKeys};
pub use notices::{verify_signed, Wechatpay, WechatpayConfig, APIV3_KEY_BYTES, TIMESTAMP_TOLERANCE_S};

use super::{Parts, Platform, PlatformSettings};
use std::sync::Arc;

pub const NAME: &str = "wechatpay";
/// The field of a payment notice that carries the payment time.
pub const PAID_TIME_FIELD: &str = "success_time";

/// WeChat Pay's settings, as given (docs/settings.md).
#[derive(Clone, Debug, Default)]
pub struct Settings {
    /// `--wechatpay-apiv3-key` (or `PAYONCE_WECHATPAY_APIV3_KEY`).
    pub apiv3_key: Option<String>,
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
pub fn configure(settings: &PlatformSettings, parts: Parts, warnings: &mut Vec<String>) -> Result<Platform, String> {
    let own = &settings.wechatpay;
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
    let held = HeldKeys::new(Keys { platform, expiries, merchant });
    let files = keys::Files::new(&own.public_keys, own.merchant_key.clone().filter(|_| outgoing), held.clone())?;
    Ok(Platform {
        notices: notices.map(|n| Arc::new(Wechatpay::with_keys(n, held.clone())) as Arc<dyn super::Notices>),
        calls: outgoing.then(|| Arc::new(api(settings, held.clone())) as Arc<dyn super::Calls>),
        keys: Some(Arc::new(files)),
    })
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
            ("--wechatpay-public-key (to verify the answers)", own.public_keys.is_empty()),
        ],
    )?;
    keys::merchant_key(own.merchant_key.as_deref().unwrap_or_default())
}

/// The outgoing calls, signing and verifying with `held`.
fn api(settings: &PlatformSettings, held: HeldKeys) -> WechatpayApi {
    let own = &settings.wechatpay;
    let mut api = WechatpayApi::with_keys(
        own.mchid.clone().unwrap_or_default(),
        own.merchant_serial.clone().unwrap_or_default(),
        &own.api_base,
        held,
        settings.timeout,
    );
    api.appids = own.appids.clone();
    api.refund_notify_url = settings
        .public_base_url
        .as_ref()
        .map(|base| format!("{}/v1/callbacks/{NAME}/refund", base.trim_end_matches('/')));
    api
}
