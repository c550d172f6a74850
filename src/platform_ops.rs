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
