//! Alipay (OpenAPI): its notices (`notices.rs`), its calls (`calls.rs`),
//! its statements (`bill.rs`) and its keys (`keys.rs`).

mod bill;
mod calls;
mod keys;
mod notices;

pub use bill::Bill;
pub use calls::{can_carry, AlipayApi, GATEWAY_DEFAULT};
pub use keys::{public_key_from_text, HeldKeys, Keys};
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
    pub app_id: Option<String>,
    /// `--alipay-app-private-key FILE`: the outgoing calls are on with it.
    pub app_private_key: Option<String>,
    /// `--alipay-gateway`.
    pub gateway: String,
}

/// Alipay as its settings turn it on: its public key and the app key read
/// once, held for both the notices and the calls, and their files kept
/// for a reload.
pub fn configure(settings: &PlatformSettings, parts: Parts, _warnings: &mut Vec<String>) -> Result<Platform, String> {
    let own = &settings.alipay;
    let notices_on = parts == Parts::NoticesAndCalls && (own.public_key.is_some() || own.app_id.is_some());
    if notices_on && (own.public_key.is_none() || own.app_id.is_none()) {
        return Err("the alipay channel needs both --alipay-public-key and --alipay-app-id".into());
    }
    let calls_on = own.app_private_key.is_some();
    if calls_on {
        super::require(
            "Alipay's outgoing calls",
            &[
                ("--alipay-app-id", own.app_id.is_none()),
                ("--alipay-public-key (to verify the answers)", own.public_key.is_none()),
            ],
        )?;
    }
    if !notices_on && !calls_on {
        return Ok(Platform::default());
    }
    let public_key = keys::public_key(own.public_key.as_deref().unwrap_or_default())?;
    let app_id = own.app_id.clone().unwrap_or_default();
    let app_private = match &own.app_private_key {
        Some(file) if calls_on => Some(Arc::new(keys::app_private_key(file)?)),
        _ => None,
    };
    let held = HeldKeys::new(Keys { public_key, app_private });
    let files = keys::Files {
        public_key: own.public_key.clone().unwrap_or_default(),
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
