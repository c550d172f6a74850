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
pub mod platform_ops;
pub mod platforms;
pub mod recon;
pub mod relay;
pub mod render;
pub mod signature;
pub mod store;
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
    /// What a platform's folder may not name: it knows neither `App` nor the
    /// store, and `platform_ops.rs` and the relay use it, not it them.
    const PLATFORMS_MAY_NOT_NAME: &[&str] = &["app", "ops", "api", "render", "http", "store", "platform_ops", "relay"];

    /// (module, its source, the modules above it it may not name)
    const RULES: &[(&str, &str, &[&str])] = &[
        ("render", include_str!("render.rs"), &["api", "http"]),
        ("ops", include_str!("ops.rs"), &["api", "render", "http"]),
        ("app", include_str!("app.rs"), &["ops", "api", "render", "http"]),
        ("platforms", include_str!("platforms/mod.rs"), PLATFORMS_MAY_NOT_NAME),
        ("platforms::calls", include_str!("platforms/calls.rs"), PLATFORMS_MAY_NOT_NAME),
        ("platforms::generic", include_str!("platforms/generic/mod.rs"), PLATFORMS_MAY_NOT_NAME),
        ("platforms::generic::notices", include_str!("platforms/generic/notices.rs"), PLATFORMS_MAY_NOT_NAME),
        ("platforms::generic::bill", include_str!("platforms/generic/bill.rs"), PLATFORMS_MAY_NOT_NAME),
        ("platforms::wechatpay", include_str!("platforms/wechatpay/mod.rs"), PLATFORMS_MAY_NOT_NAME),
        ("platforms::wechatpay::notices", include_str!("platforms/wechatpay/notices.rs"), PLATFORMS_MAY_NOT_NAME),
        ("platforms::wechatpay::calls", include_str!("platforms/wechatpay/calls.rs"), PLATFORMS_MAY_NOT_NAME),
        ("platforms::wechatpay::bill", include_str!("platforms/wechatpay/bill.rs"), PLATFORMS_MAY_NOT_NAME),
        ("platforms::wechatpay::keys", include_str!("platforms/wechatpay/keys.rs"), PLATFORMS_MAY_NOT_NAME),
        ("platforms::alipay", include_str!("platforms/alipay/mod.rs"), PLATFORMS_MAY_NOT_NAME),
        ("platforms::alipay::notices", include_str!("platforms/alipay/notices.rs"), PLATFORMS_MAY_NOT_NAME),
        ("platforms::alipay::calls", include_str!("platforms/alipay/calls.rs"), PLATFORMS_MAY_NOT_NAME),
        ("platforms::alipay::bill", include_str!("platforms/alipay/bill.rs"), PLATFORMS_MAY_NOT_NAME),
        ("platforms::alipay::keys", include_str!("platforms/alipay/keys.rs"), PLATFORMS_MAY_NOT_NAME),
        ("recon", include_str!("recon.rs"), &["app", "ops", "api", "render", "http", "store", "platform_ops"]),
        ("wire", include_str!("wire.rs"), &["app", "ops", "api", "render", "http", "platforms", "store"]),
        ("money", include_str!("money.rs"), &["app", "ops", "api", "render", "http", "platforms", "store"]),
        ("domain", include_str!("domain.rs"), &["app", "ops", "api", "render", "http", "platforms", "store"]),
        ("error", include_str!("error.rs"), &["app", "ops", "api", "render", "http", "platforms", "store"]),
        ("relay", include_str!("relay.rs"), &["api", "http"]),
        ("platform_ops", include_str!("platform_ops.rs"), &["api", "render", "http", "relay"]),
        ("console", include_str!("console.rs"), &["app", "ops", "api", "render", "http", "store", "relay"]),
        ("webhook_ops", include_str!("webhook_ops.rs"), &["api", "render", "http", "relay"]),
        (
            "webhook",
            include_str!("webhook.rs"),
            &["app", "ops", "api", "render", "http", "platforms", "store", "relay"],
        ),
        ("keylock", include_str!("keylock.rs"), &["app", "ops", "api", "render", "http", "platforms", "store"]),
    ];

    /// Every module above the store, whose source may name no engine.
    const ABOVE_THE_STORE: &[(&str, &str)] = &[
        ("api", include_str!("api.rs")),
        ("app", include_str!("app.rs")),
        ("background", include_str!("background.rs")),
        ("platforms", include_str!("platforms/mod.rs")),
        ("platforms::calls", include_str!("platforms/calls.rs")),
        ("platforms::generic", include_str!("platforms/generic/mod.rs")),
        ("platforms::generic::notices", include_str!("platforms/generic/notices.rs")),
        ("platforms::generic::bill", include_str!("platforms/generic/bill.rs")),
        ("platforms::wechatpay", include_str!("platforms/wechatpay/mod.rs")),
        ("platforms::wechatpay::notices", include_str!("platforms/wechatpay/notices.rs")),
        ("platforms::wechatpay::calls", include_str!("platforms/wechatpay/calls.rs")),
        ("platforms::wechatpay::bill", include_str!("platforms/wechatpay/bill.rs")),
        ("platforms::wechatpay::keys", include_str!("platforms/wechatpay/keys.rs")),
        ("platforms::alipay", include_str!("platforms/alipay/mod.rs")),
        ("platforms::alipay::notices", include_str!("platforms/alipay/notices.rs")),
        ("platforms::alipay::calls", include_str!("platforms/alipay/calls.rs")),
        ("platforms::alipay::bill", include_str!("platforms/alipay/bill.rs")),
        ("platforms::alipay::keys", include_str!("platforms/alipay/keys.rs")),
        ("console", include_str!("console.rs")),
        ("domain", include_str!("domain.rs")),
        ("error", include_str!("error.rs")),
        ("http", include_str!("http.rs")),
        ("metrics", include_str!("metrics.rs")),
        ("ops", include_str!("ops.rs")),
        ("platform_ops", include_str!("platform_ops.rs")),
        ("recon", include_str!("recon.rs")),
        ("relay", include_str!("relay.rs")),
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

    /// The platforms build their outgoing bodies with typed structs or
    /// `serde_json::Map`: JSON is shaped by hand only in render, api and wire.
    #[test]
    fn no_json_macro_in_the_platforms() {
        for (module, source, _) in RULES.iter().filter(|(module, _, _)| module.starts_with("platforms")) {
            assert!(!source.contains(concat!("json", "!")), "{module} shapes JSON with the json macro");
        }
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
