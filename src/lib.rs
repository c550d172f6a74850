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
//! app.orders().create_order(&CreateOrder {
//!     order_no: "ORD-1".into(), user_id: "u1".into(), amount: 9900,
//!     currency: "CNY".into(), expires_in_s: None,
//! }).unwrap();
//! let callback = PaymentCallback {
//!     channel: "generic".into(), pay_no: "PAY-1".into(), order_no: "ORD-1".into(),
//!     amount: 9900, currency: None, status: PlatformStatus::Success, paid_at: None, raw_body: b"{}".to_vec(),
//! };
//! assert_eq!(app.payments().deliver_payment(&callback).unwrap().outcome_str(), "applied");
//! assert_eq!(app.payments().deliver_payment(&callback).unwrap().outcome_str(), "duplicate");
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
pub mod held;
pub mod http;
pub mod keylock;
pub mod log;
pub mod metrics;
pub mod money;
pub mod ops;
pub mod outgoing;
pub mod platform_ops;
pub mod platforms;
pub mod recent;
pub mod recon;
pub mod relay;
pub mod render;
pub mod services;
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

/// ARCHITECTURE.md's layers, kept true for every file under src/, found at
/// test time (a new file or directory is covered without being listed): no
/// module names a layer above it, only src/store/ names an engine, and only
/// the edge writes JSON with `json!`.
#[cfg(test)]
mod layering {
    use std::path::Path;

    /// The layers of ARCHITECTURE.md, top first, by top-level module (a file
    /// of src/, or a directory). A module may name its own layer and those
    /// below it; `main`, `lib` and `config` are the wiring, above them all.
    const LAYERS: &[&[&str]] = &[
        &["main", "lib", "config"],
        &["http"],
        &["api", "console"],
        &["relay", "background"],
        &["render"],
        // App owns the core and hands out the services; ops, webhook_ops and
        // platform_ops hold the types the services answer (render names them).
        &["services", "app", "ops", "webhook_ops", "platform_ops"],
        // A platform's folder: its notices, calls, bills and keys; recon reads bills through it.
        &["platforms", "recon"],
        // The leased-call mechanism knows the store and the rows, never who drives it.
        &["outgoing"],
        &["store"],
        &[
            "domain",
            "wire",
            "money",
            "clock",
            "signature",
            "webhook",
            "keylock",
            "recent",
            "metrics",
            "log",
            "error",
            "filewatch",
            "held",
            "test_hooks",
        ],
    ];

    /// Arrows the layers would allow and the architecture still refuses:
    /// channels and platform clients never touch the store, statements are
    /// parsed without it, and the console is a client of the API only.
    const ALSO_REFUSED: &[(&str, &[&str])] = &[
        ("platforms", &["store", "outgoing"]),
        ("recon", &["store"]),
        ("console", &["app", "ops", "render", "store", "relay"]),
    ];

    /// What only src/store/ may name: the engines' crates and modules.
    const ENGINE_NAMES: &[&str] =
        &["rusqlite", "r2d2", "postgres::", "r2d2_postgres", "store::sqlite", "store::postgres::PostgresEngine"];

    /// The files that may write JSON with the macro: the edge.
    const JSON_AT_THE_EDGE: &[&str] = &["render.rs", "api.rs", "wire.rs"];

    /// Every `.rs` file under src/ as (its path under src/, its text), read
    /// now. lib.rs is read up to this module, which spells what it seeks.
    fn sources() -> Vec<(String, String)> {
        let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src"));
        let mut dirs = vec![root.to_path_buf()];
        let mut files = Vec::new();
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).expect("a directory of src/") {
                let path = entry.expect("a directory entry").path();
                if path.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|ext| ext == "rs") {
                    let mut text = std::fs::read_to_string(&path).expect("a source file");
                    let name = path.strip_prefix(root).expect("under src/").to_string_lossy().replace('\\', "/");
                    if name == "lib.rs" {
                        text.truncate(text.find("mod layering").unwrap_or(text.len()));
                    }
                    files.push((name, text));
                }
            }
        }
        files.sort();
        // The walk goes down every directory.
        assert!(files.iter().any(|(name, _)| name == "store/sqlite/group_commit.rs"), "{files:?}");
        files
    }

    /// The top-level module a file belongs to: `store` for store/sqlite.rs.
    fn module_of(name: &str) -> &str {
        let first = name.split('/').next().unwrap_or(name);
        first.strip_suffix(".rs").unwrap_or(first)
    }

    /// The modules `module` may not name; a module in no layer fails here,
    /// so a new one is placed before it is checked.
    fn refused_to(module: &str) -> Vec<&'static str> {
        let layer = LAYERS.iter().position(|layer| layer.contains(&module));
        let layer = layer.unwrap_or_else(|| panic!("{module} is in no layer: add it to LAYERS (ARCHITECTURE.md)"));
        let also = ALSO_REFUSED.iter().filter(|(m, _)| *m == module).flat_map(|(_, refused)| refused.iter());
        LAYERS[..layer].iter().flat_map(|above| above.iter()).chain(also).copied().collect()
    }

    #[test]
    fn no_module_names_a_layer_above_it() {
        for (name, source) in sources() {
            let module = module_of(&name);
            for upper in refused_to(module) {
                for spelling in [format!("crate::{upper}::"), format!("crate::{upper};")] {
                    assert!(!source.contains(&spelling), "src/{name} ({module}) names {upper} ({spelling}), above it");
                }
            }
        }
    }

    #[test]
    fn no_engine_type_above_the_store() {
        for (name, source) in sources().iter().filter(|(name, _)| module_of(name) != "store") {
            for engine in ENGINE_NAMES {
                assert!(!source.contains(engine), "src/{name} names {engine}: only src/store/ knows the engines");
            }
        }
    }

    /// The core speaks typed payloads; render.rs, api.rs and wire.rs turn
    /// them into JSON.
    #[test]
    fn json_is_written_at_the_edge_only() {
        let macro_call = concat!("json", "!(");
        for (name, source) in sources() {
            let allowed = JSON_AT_THE_EDGE.contains(&name.as_str());
            assert!(
                allowed || !source.contains(macro_call),
                "src/{name} calls {macro_call}..): only render.rs, api.rs and wire.rs write JSON"
            );
        }
    }

    /// Async code exists only at the edge: hyper and tokio are named in
    /// http.rs alone. The one other name is the PostgreSQL client's TLS
    /// connector (`tokio_postgres_rustls`, in store/postgres.rs), a type the
    /// synchronous `postgres` client takes; payonce's own code never awaits.
    #[test]
    fn async_code_only_at_the_edge() {
        for (name, source) in sources().iter().filter(|(name, _)| name != "http.rs") {
            let without_tls = source.replace("tokio_postgres_rustls", "");
            for runtime in ["tokio", "hyper", "async fn", ".await"] {
                assert!(!without_tls.contains(runtime), "src/{name} names {runtime}: async code lives in http.rs");
            }
        }
    }

    /// Only the services reach the store: `App` keeps it in its core, and
    /// every module outside src/services/ and src/store/ asks a service
    /// (`App::store` is a test hatch that returns it, never uses it).
    #[test]
    fn only_the_services_reach_the_store() {
        for (name, source) in sources() {
            if matches!(module_of(&name), "services" | "store") {
                continue;
            }
            for reach in ["app.store", ".store()."] {
                assert!(!source.contains(reach), "src/{name} reaches into the store ({reach})");
            }
        }
    }
}
