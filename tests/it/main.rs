//! One integration-test binary, a module per area (ripgrep's layout).

mod util;

mod api_http;
mod ops_admin;
mod reconcile;
mod auth;
mod channels;
mod expiry;
mod hostile;
mod http_pool;
mod idempotency;
mod incident;
mod schema;
mod storm;
mod openapi;
mod payment_edges;
mod crash;
mod simulate;
