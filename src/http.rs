//! Every tiny_http detail lives here: binding, the fixed worker pool, body
//! limits, turning a panic into a 500, and shutdown.
//!
//! tiny_http 0.12 has no socket timeouts, no header-size limit and one
//! thread per connection, and on a request dropped unread it allocates the
//! whole declared body: payonce therefore binds loopback by default and is
//! meant to sit behind a TLS reverse proxy that enforces body size, header
//! size and timeouts (see README, "Deployment").

use crate::api::{self, Request, Response};
use crate::app::App;
use crate::error::Error;
use crate::log;
use std::io::Read;
use std::net::SocketAddr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

/// Worker threads that run requests (the pool is fixed; connections beyond
/// it queue inside tiny_http).
pub const WORKERS_DEFAULT: usize = 16;
/// How often an idle worker looks at the shutdown flag.
const POLL_INTERVAL_MS: u64 = 100;
/// How long shutdown waits for requests in flight.
pub const SHUTDOWN_GRACE_MS: u64 = 10_000;

pub struct Server {
    inner: Arc<tiny_http::Server>,
    addr: SocketAddr,
}

impl Server {
    pub fn bind(listen: &str) -> Result<Server, Error> {
        let inner =
            tiny_http::Server::http(listen).map_err(|e| Error::internal(format!("cannot listen on {listen}: {e}")))?;
        let addr =
            inner.server_addr().to_ip().ok_or_else(|| Error::internal(format!("{listen} is not an IP address")))?;
        Ok(Server { inner: Arc::new(inner), addr })
    }

    /// The bound address (the real port when asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves until `shutdown` is set, then waits up to `SHUTDOWN_GRACE_MS`
    /// for requests in flight. Returns whether every worker finished in time.
    pub fn serve(self, app: Arc<App>, shutdown: Arc<AtomicBool>, workers: usize) -> bool {
        self.serve_with(move |raw| serve_one(&app, raw), shutdown, workers)
    }

    /// Serves every request with `handler` on the same worker pool: for
    /// measuring the HTTP stack alone (the benchmark's trivial handler).
    pub fn serve_fn(
        self,
        handler: impl Fn(&Request) -> Response + Send + Sync + 'static,
        shutdown: Arc<AtomicBool>,
        workers: usize,
    ) -> bool {
        self.serve_with(
            move |mut raw| {
                let response = match read_request(&mut raw) {
                    Ok(request) => handler(&request),
                    Err(err) => Response::error(&err),
                };
                respond(raw, response);
            },
            shutdown,
            workers,
        )
    }

    fn serve_with(
        self,
        serve_request: impl Fn(tiny_http::Request) + Send + Sync + 'static,
        shutdown: Arc<AtomicBool>,
        workers: usize,
    ) -> bool {
        let serve_request = Arc::new(serve_request);
        let handles: Vec<_> = (0..workers.max(1))
            .map(|i| {
                let (server, serve_request, shutdown) =
                    (Arc::clone(&self.inner), Arc::clone(&serve_request), Arc::clone(&shutdown));
                thread::Builder::new()
                    .name(format!("payonce-http-{i}"))
                    .spawn(move || worker_loop(&server, &*serve_request, &shutdown))
            })
            .filter_map(Result::ok)
            .collect();
        while !shutdown.load(Ordering::SeqCst) {
            thread::sleep(Duration::from_millis(POLL_INTERVAL_MS));
        }
        let deadline = Instant::now() + Duration::from_millis(SHUTDOWN_GRACE_MS);
        while Instant::now() < deadline && handles.iter().any(|h| !h.is_finished()) {
            thread::sleep(Duration::from_millis(10));
        }
        handles.iter().all(|h| h.is_finished())
    }
}

fn worker_loop(server: &tiny_http::Server, serve_request: &dyn Fn(tiny_http::Request), shutdown: &AtomicBool) {
    while !shutdown.load(Ordering::SeqCst) {
        match server.recv_timeout(Duration::from_millis(POLL_INTERVAL_MS)) {
            Ok(Some(request)) => serve_request(request),
            Ok(None) => {}
            Err(e) => {
                log::warn("accepting a request failed", &[("error", &e)]);
                thread::sleep(Duration::from_millis(POLL_INTERVAL_MS));
            }
        }
    }
}

fn serve_one(app: &App, mut raw: tiny_http::Request) {
    let started = Instant::now();
    let method = raw.method().as_str().to_owned();
    let route = api::route_label(raw.url().split('?').next().unwrap_or(""));
    let response = match read_request(&mut raw) {
        Ok(request) => match catch_unwind(AssertUnwindSafe(|| api::handle(app, &request))) {
            Ok(response) => response,
            Err(_) => {
                log::error("handler panicked", &[("method", &method), ("route", &route)]);
                Response::error(&Error::internal("the request failed inside payonce; it was not applied"))
            }
        },
        Err(err) => Response::error(&err),
    };
    let latency = started.elapsed();
    app.metrics.observe_request(&method, route, response.status, latency);
    log_request(&method, route, &response, latency);
    respond(raw, response);
}

fn respond(raw: tiny_http::Request, response: Response) {
    let mut out = tiny_http::Response::from_data(response.body).with_status_code(response.status);
    for (name, value) in &response.headers {
        if let Ok(header) = tiny_http::Header::from_bytes(name.as_bytes(), value.as_bytes()) {
            out.add_header(header);
        }
    }
    // A client that went away cannot be answered; the work is committed or not by now.
    let _ = raw.respond(out);
}

/// One line per request: route, status, the outcome or error code, latency.
fn log_request(method: &str, route: &str, response: &Response, latency: Duration) {
    if !log::enabled(log::Level::Info) {
        return;
    }
    let outcome = serde_json::from_slice::<serde_json::Value>(&response.body)
        .ok()
        .and_then(|v| v.get("outcome").or_else(|| v.pointer("/error/code")).and_then(|o| o.as_str()).map(str::to_owned))
        .unwrap_or_else(|| "-".to_owned());
    let latency_ms = format!("{:.3}", latency.as_secs_f64() * 1000.0);
    log::info(
        "request",
        &[
            ("method", &method),
            ("route", &route),
            ("status", &response.status),
            ("outcome", &outcome),
            ("latency_ms", &latency_ms),
        ],
    );
}

/// Copies what the API needs out of tiny_http, enforcing the body limit
/// before reading (declared length) and while reading (actual bytes).
fn read_request(raw: &mut tiny_http::Request) -> Result<Request, Error> {
    let url = raw.url().to_owned();
    let (path, query) = match url.split_once('?') {
        Some((p, q)) => (p.to_owned(), q.to_owned()),
        None => (url, String::new()),
    };
    let headers: Vec<(String, String)> =
        raw.headers().iter().map(|h| (h.field.as_str().as_str().to_owned(), h.value.as_str().to_owned())).collect();
    let body_bytes_max = api::body_bytes_max(&path);
    let too_large = || Error::new(413, "payload_too_large", format!("the body exceeds {body_bytes_max} bytes"));
    if raw.body_length().is_some_and(|n| n > body_bytes_max) {
        return Err(too_large());
    }
    let mut body = Vec::new();
    let limit = u64::try_from(body_bytes_max + 1).unwrap_or(u64::MAX);
    raw.as_reader()
        .take(limit)
        .read_to_end(&mut body)
        .map_err(|e| Error::invalid(format!("could not read the body: {e}")))?;
    if body.len() > body_bytes_max {
        return Err(too_large());
    }
    Ok(Request { method: raw.method().as_str().to_owned(), path, query, headers, body })
}
