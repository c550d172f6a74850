//! payonce: exactly-once orders and payment callbacks for a small merchant,
//! on SQLite or PostgreSQL.
//!
//! Use it as a service (`payonce serve`) or as a library in a merchant's own
//! tests: open an [`App`] on `":memory:"` with a [`Clock::manual`] clock and
//! call the same operations the HTTP API offers.
//!
//! ```
//! use payonce::{App, Clock, Config, CreateOrder, PaymentCallback, PlatformStatus};
//!
//! let app = App::open(":memory:", Clock::manual(1_700_000_000_000), Config::default()).unwrap();
//! app.create_order(&CreateOrder {
//!     order_no: "ORD-1".into(), user_id: "u1".into(), amount: 9900,
//!     currency: "CNY".into(), expires_in_s: None,
//! }).unwrap();
//! let callback = PaymentCallback {
//!     channel: "generic".into(), pay_no: "PAY-1".into(), order_no: "ORD-1".into(),
//!     amount: 9900, currency: None, status: PlatformStatus::Success, paid_at: None, raw_body: b"{}".to_vec(),
//! };
//! assert_eq!(app.deliver_payment(&callback).unwrap().outcome_str(), "applied");
//! assert_eq!(app.deliver_payment(&callback).unwrap().outcome_str(), "duplicate");
//! ```

pub mod api;
pub mod app;
pub mod background;
pub mod channel;
pub mod clock;
pub mod config;
pub mod console;
pub mod domain;
pub mod error;
pub mod filewatch;
pub mod http;
pub mod keylock;
pub mod log;
pub mod metrics;
pub mod money;
pub mod ops;
pub mod outgoing;
pub mod platform;
pub mod platform_ops;
pub mod recon;
pub mod relay;
pub mod render;
pub mod signature;
pub mod store;
mod test_hooks;
pub mod webhook;
pub mod webhook_ops;
pub mod wire;

pub use app::{App, Config, CreateOrder, PaymentCallback, PaymentReply, RefundCallback};
pub use clock::Clock;
pub use domain::{OrderStatus, PaymentOutcome, PlatformStatus, RefundOutcome, Rewards};
pub use error::Error;

/// ARCHITECTURE.md's layers, kept true: no module names one above it.
#[cfg(test)]
mod layering {
    /// What the leased-call mechanism may not name: it knows the store and
    /// the rows, never who drives it.
    const OUTGOING_BELOW: &[&str] = &["app", "ops", "api", "render", "http", "relay", "platform_ops"];

    /// (module, its source, the modules above it it may not name)
    const RULES: &[(&str, &str, &[&str])] = &[
        ("render", include_str!("render.rs"), &["api", "http"]),
        ("ops", include_str!("ops.rs"), &["api", "render", "http"]),
        ("app", include_str!("app.rs"), &["ops", "api", "render", "http"]),
        ("channel", include_str!("channel/mod.rs"), &["app", "ops", "api", "render", "http", "store"]),
        ("channel::generic", include_str!("channel/generic.rs"), &["app", "ops", "api", "render", "http", "store"]),
        ("channel::wechatpay", include_str!("channel/wechatpay.rs"), &["app", "ops", "api", "render", "http", "store"]),
        ("channel::alipay", include_str!("channel/alipay.rs"), &["app", "ops", "api", "render", "http", "store"]),
        ("recon", include_str!("recon.rs"), &["app", "ops", "api", "render", "http", "channel", "store"]),
        ("wire", include_str!("wire.rs"), &["app", "ops", "api", "render", "http", "channel", "store"]),
        ("money", include_str!("money.rs"), &["app", "ops", "api", "render", "http", "channel", "store"]),
        ("domain", include_str!("domain.rs"), &["app", "ops", "api", "render", "http", "channel", "store"]),
        ("error", include_str!("error.rs"), &["app", "ops", "api", "render", "http", "channel", "store"]),
        ("relay", include_str!("relay.rs"), &["api", "http"]),
        ("outgoing", include_str!("outgoing/mod.rs"), OUTGOING_BELOW),
        ("outgoing::schedule", include_str!("outgoing/schedule.rs"), OUTGOING_BELOW),
        ("outgoing::worker", include_str!("outgoing/worker.rs"), OUTGOING_BELOW),
        ("outgoing::kinds", include_str!("outgoing/kinds.rs"), OUTGOING_BELOW),
        (
            "platform",
            include_str!("platform/mod.rs"),
            &["app", "ops", "api", "render", "http", "store", "platform_ops"],
        ),
        (
            "platform::wechatpay",
            include_str!("platform/wechatpay.rs"),
            &["app", "ops", "api", "render", "http", "store", "platform_ops"],
        ),
        (
            "platform::alipay",
            include_str!("platform/alipay.rs"),
            &["app", "ops", "api", "render", "http", "store", "platform_ops"],
        ),
        ("platform_ops", include_str!("platform_ops.rs"), &["api", "render", "http", "relay"]),
        ("console", include_str!("console.rs"), &["app", "ops", "api", "render", "http", "store", "relay"]),
        ("webhook_ops", include_str!("webhook_ops.rs"), &["api", "render", "http", "relay"]),
        (
            "webhook",
            include_str!("webhook.rs"),
            &["app", "ops", "api", "render", "http", "channel", "store", "relay", "outgoing"],
        ),
        ("keylock", include_str!("keylock.rs"), &["app", "ops", "api", "render", "http", "channel", "store"]),
    ];

    /// Every module above the store, whose source may name no engine.
    const ABOVE_THE_STORE: &[(&str, &str)] = &[
        ("api", include_str!("api.rs")),
        ("app", include_str!("app.rs")),
        ("background", include_str!("background.rs")),
        ("channel", include_str!("channel/mod.rs")),
        ("console", include_str!("console.rs")),
        ("channel::generic", include_str!("channel/generic.rs")),
        ("channel::wechatpay", include_str!("channel/wechatpay.rs")),
        ("channel::alipay", include_str!("channel/alipay.rs")),
        ("domain", include_str!("domain.rs")),
        ("error", include_str!("error.rs")),
        ("http", include_str!("http.rs")),
        ("metrics", include_str!("metrics.rs")),
        ("ops", include_str!("ops.rs")),
        ("platform", include_str!("platform/mod.rs")),
        ("platform::wechatpay", include_str!("platform/wechatpay.rs")),
        ("platform::alipay", include_str!("platform/alipay.rs")),
        ("platform_ops", include_str!("platform_ops.rs")),
        ("recon", include_str!("recon.rs")),
        ("relay", include_str!("relay.rs")),
        ("outgoing", include_str!("outgoing/mod.rs")),
        ("outgoing::schedule", include_str!("outgoing/schedule.rs")),
        ("outgoing::worker", include_str!("outgoing/worker.rs")),
        ("outgoing::kinds", include_str!("outgoing/kinds.rs")),
        ("webhook", include_str!("webhook.rs")),
        ("webhook_ops", include_str!("webhook_ops.rs")),
        ("render", include_str!("render.rs")),
        ("main", include_str!("main.rs")),
    ];
    /// What only src/store/ may name: the engines' crates and modules.
    const ENGINE_NAMES: &[&str] =
        &["rusqlite", "r2d2", "postgres::", "r2d2_postgres", "store::sqlite", "store::postgres::PostgresEngine"];

    #[test]
    fn no_engine_type_above_the_store() {
        for (module, source) in ABOVE_THE_STORE {
            for name in ENGINE_NAMES {
                assert!(!source.contains(name), "{module} names {name}: only src/store/ knows the engines");
            }
        }
    }

    /// The relay makes calls; what it reads and writes goes through `App`
    /// (`webhook_ops.rs`) and the leased-call mechanism (`outgoing/`).
    #[test]
    fn the_relay_never_names_the_store_of_app() {
        let relay = include_str!("relay.rs");
        assert!(!relay.contains(".store."), "relay.rs reaches into app.store");
    }

    #[test]
    fn no_module_names_a_layer_above_it() {
        for (module, source, above) in RULES {
            for upper in *above {
                for spelling in [format!("crate::{upper}::"), format!("crate::{upper};")] {
                    assert!(!source.contains(&spelling), "{module} names {upper} ({spelling}), a layer above it");
                }
            }
        }
    }
}
