//! One integration-test binary, a module per area (ripgrep's layout).

mod util;

mod api_http;
mod auth;
mod channels;
mod crash;
mod edge;
mod expiry;
mod hostile;
mod http_pool;
mod idempotency;
mod incident;
mod ledger;
mod openapi;
mod ops_admin;
mod payment_edges;
mod pg;
mod reconcile;
mod reconcile_bills;
mod schema;
mod simulate;
mod storm;
