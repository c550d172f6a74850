//! The generic platform: payonce's own signed format for whatever sits in
//! front of a payment provider. Notices only (HMAC-signed JSON, its
//! secrets from `--callback-secret`); it takes no calls; its statement is
//! payonce's own CSV.

mod bill;
mod notices;

pub use bill::Bill;
pub use notices::Generic;

use super::{Parts, Platform, PlatformSettings};

pub const NAME: &str = "generic";
/// The field of a payment notice that carries the payment time.
pub const PAID_TIME_FIELD: &str = "paid_at";

/// The generic channel when it has a secret (`--callback-secret`, or
/// `--dev`'s); it makes no calls.
pub fn configure(settings: &PlatformSettings, parts: Parts, _warnings: &mut Vec<String>) -> Result<Platform, String> {
    if parts == Parts::CallsOnly || settings.callback_secrets.current().is_empty() {
        return Ok(Platform::default());
    }
    Ok(Platform::notices(Generic::held(settings.callback_secrets.clone())))
}
