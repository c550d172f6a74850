//! What asking the platforms answers: one platform's answer to a query and
//! what `POST /v1/orders/{order_no}/sync` returns. The calls themselves are
//! the `PlatformCalls` service (`src/services/platform_calls.rs`).

use crate::domain::Order;
pub use crate::platforms::Platforms;
use crate::platforms::TradeState;
pub use crate::platforms::SOURCE_QUERY;

/// One platform's answer in `POST /v1/orders/{order_no}/sync`.
#[derive(Clone, Debug)]
pub struct PlatformAnswer {
    pub channel: &'static str,
    pub state: TradeState,
    /// The verified answer, kept as the payment's raw body when it says paid.
    pub answer: String,
    /// Why the answer counts as none, when it does.
    pub distrust: Option<String>,
}

/// `POST /v1/orders/{order_no}/sync`'s result: the order after the sync.
#[derive(Clone, Debug)]
pub struct Synced {
    pub order: Order,
    pub platforms: Vec<PlatformAnswer>,
}

/// A payment created at a platform, as `POST /v1/orders/{order_no}/pay`
/// answers it: the order and the payment object (`channel`, `method`,
/// `created_at`, `expires_at` and the method's keys).
#[derive(Clone, Debug, PartialEq)]
pub struct Paying {
    pub order: Order,
    pub payment: PaymentOffer,
}

/// The payment object, as the JSON text a prepay row keeps, so every
/// request for it answers the same bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PaymentOffer {
    text: String,
}

impl PaymentOffer {
    pub fn from_text(text: &str) -> PaymentOffer {
        PaymentOffer { text: text.to_owned() }
    }

    pub fn text(&self) -> &str {
        &self.text
    }
}
