//! One integration-test binary, a module per area (ripgrep's layout).

mod util;
#[macro_use]
mod engines;
mod pg;
mod platforms;
mod prepay;

mod api_http;
mod auth;
mod channels;
mod cli;
mod crash;
mod docs_run;
mod edge;
mod event_feed;
mod expiry;
mod grafana;
mod group_commit;
mod hostile;
mod http_pool;
mod idempotency;
mod incident;
mod ledger;
mod metrics_access;
mod nul_bytes;
mod openapi;
mod ops_admin;
mod partial_refunds;
mod payment_edges;
mod pg_faults;
mod platform_answers;
mod platform_bytes;
mod postgres_cli;
mod reads;
mod receiver;
mod reconcile;
mod reconcile_bills;
mod registry;
mod reruns;
mod schema;
mod simulate;
mod stats;
mod storm;
mod unwanted_money;
mod webhooks;
