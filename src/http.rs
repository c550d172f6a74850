//! The HTTP edge: sockets, framing, limits and timeouts, and nothing else.
//!
//! hyper (HTTP/1.1) runs on a small tokio runtime that exists only in this
//! module. For each request the edge reads the head and the whole body,
//! within their limits and timeouts, then hands a plain [`Request`] to a fixed
//! pool of ordinary worker threads and writes back the [`Response`] they
//! return. Everything from `api::handle` down (key locks, `BEGIN IMMEDIATE`,
//! blocking SQLite calls) runs on those workers: no runtime thread ever
//! touches the store, and no worker ever waits on a client's socket, so slow
//! or hostile clients cannot hold the pool.
//!
//! What holds here without a reverse proxy (docs/deployment.md):
//! - at most `max_connections` connections are served; more wait in the
//!   kernel's backlog;
//! - a head must arrive within `header_read_timeout_ms`, be at most
//!   [`HEAD_BYTES_MAX`] with at most [`HEADERS_COUNT_MAX`] headers (else
//!   431), a body within `body_read_timeout_ms` and its route's byte limit
//!   (a larger declared length is refused before a byte is read);
//! - an idle keep-alive connection is closed after `keep_alive_idle_ms`,
//!   counted from the end of a response to the first byte of the next
//!   request; a client that does not read its answer loses the connection
//!   after `response_write_timeout_ms`;
//! - ambiguous framing (Content-Length with Transfer-Encoding, duplicate
//!   Content-Lengths, any Transfer-Encoding but `chunked`) is refused with
//!   400 and the connection closed, so no body is ever run as a request;
//! - pipelined requests of one connection run one after another, in order;
//! - accept errors (`EMFILE` …) back off and are logged at most once a
//!   second; the server accepts again once descriptors are free.

use crate::api::{self, Request, Response};
use crate::app::App;
use crate::error::{Error, ErrorKind};
use crate::log;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderName, HeaderValue, CONTENT_LENGTH, TRANSFER_ENCODING};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::thread;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{oneshot, watch, OwnedSemaphorePermit, Semaphore};

/// Worker threads that run requests (the pool is fixed).
pub const WORKERS_DEFAULT: usize = 16;
/// Runtime threads that drive sockets; they never run a request.
const IO_THREADS: usize = 2;
/// How long shutdown waits for requests in flight.
pub const SHUTDOWN_GRACE_MS: u64 = 10_000;
/// How long shutdown still waits, after the grace period, for the requests
/// a worker had already begun: their work may commit, and a committed
/// request is answered before its connection closes. Their own timeouts
/// (busy timeout, platform timeout, key waits) end them well before.
const SHUTDOWN_RUNNING_WAIT_MS_MAX: u64 = 60_000;
/// How often the runtime looks at the shutdown flag the signal handler sets.
const SHUTDOWN_POLL_MS: u64 = 50;

pub const MAX_CONNECTIONS_DEFAULT: usize = 1024;
pub const HEADER_READ_TIMEOUT_MS_DEFAULT: u64 = 10_000;
pub const BODY_READ_TIMEOUT_MS_DEFAULT: u64 = 30_000;
pub const KEEP_ALIVE_IDLE_MS_DEFAULT: u64 = 60_000;
pub const RESPONSE_WRITE_TIMEOUT_MS_DEFAULT: u64 = 30_000;
/// Descriptors kept free for everything but client connections: the
/// database pool (a file, `-wal` and `-shm` per connection), the listener,
/// the runtime's epoll, stdio, backups and outgoing calls.
pub const FD_RESERVE_DEFAULT: u64 = 128;
/// The fewest connections served however low the descriptor limit is.
const MAX_CONNECTIONS_MIN: usize = 8;

/// Request line plus headers, in bytes (else 431).
pub const HEAD_BYTES_MAX: usize = 16 * 1024;
/// Header fields in one request (else 431).
pub const HEADERS_COUNT_MAX: usize = 100;
/// hyper's read buffer: bounds what one connection holds in memory at once.
const READ_BUFFER_BYTES_MAX: usize = 64 * 1024;
/// The kernel's queue of connections not yet accepted.
const LISTEN_BACKLOG: u32 = 1024;
/// After a failed accept (e.g. `EMFILE`), wait this long before the next.
const ACCEPT_BACKOFF_MS: u64 = 50;
/// Accept errors are logged at most this often.
const ACCEPT_ERROR_LOG_INTERVAL_MS: u64 = 1_000;

/// Every limit of the edge, each a `serve` setting (docs/settings.md), so tests can
/// shrink them.
#[derive(Clone, Debug)]
pub struct Limits {
    pub max_connections: usize,
    pub header_read_timeout_ms: u64,
    pub body_read_timeout_ms: u64,
    pub keep_alive_idle_ms: u64,
    pub response_write_timeout_ms: u64,
    pub fd_reserve: u64,
    pub shutdown_grace_ms: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: MAX_CONNECTIONS_DEFAULT,
            header_read_timeout_ms: HEADER_READ_TIMEOUT_MS_DEFAULT,
            body_read_timeout_ms: BODY_READ_TIMEOUT_MS_DEFAULT,
            keep_alive_idle_ms: KEEP_ALIVE_IDLE_MS_DEFAULT,
            response_write_timeout_ms: RESPONSE_WRITE_TIMEOUT_MS_DEFAULT,
            fd_reserve: FD_RESERVE_DEFAULT,
            shutdown_grace_ms: SHUTDOWN_GRACE_MS,
        }
    }
}

/// What the edge serves: the body limit of a path and the refusals it
/// decides itself run on the runtime (they must not touch the store);
/// `handle` runs on a worker thread.
pub trait Handler: Send + Sync + 'static {
    fn body_bytes_max(&self, path: &str) -> usize;
    fn handle(&self, request: &Request) -> Response;
    /// An answer to a request the edge refuses before any worker sees it
    /// (413, 408, framing errors, shutting down).
    fn refuse(&self, request: &Request, err: &Error) -> Response;
}

/// payonce's API: `api::serve` on the workers, each channel's own protocol
/// for refusals at the edge.
struct ApiHandler(Arc<App>);

impl Handler for ApiHandler {
    fn body_bytes_max(&self, path: &str) -> usize {
        api::body_bytes_max(path)
    }
    fn handle(&self, request: &Request) -> Response {
        api::serve(&self.0, request)
    }
    fn refuse(&self, request: &Request, err: &Error) -> Response {
        api::refuse_at_edge(&self.0, request, err)
    }
}

/// The `--metrics-listen` listener: `GET /metrics` only, no token.
struct MetricsHandler(Arc<App>);

impl Handler for MetricsHandler {
    fn body_bytes_max(&self, _path: &str) -> usize {
        api::BODY_BYTES_MAX
    }
    fn handle(&self, request: &Request) -> Response {
        api::serve_metrics(&self.0, request)
    }
    fn refuse(&self, _request: &Request, err: &Error) -> Response {
        Response::error(err)
    }
}

/// A plain function on the same stack (the benchmark's trivial handler).
struct FnHandler<F>(F);

impl<F: Fn(&Request) -> Response + Send + Sync + 'static> Handler for FnHandler<F> {
    fn body_bytes_max(&self, _path: &str) -> usize {
        api::BODY_BYTES_MAX
    }
    fn handle(&self, request: &Request) -> Response {
        (self.0)(request)
    }
    fn refuse(&self, _request: &Request, err: &Error) -> Response {
        Response::error(err)
    }
}

pub struct Server {
    runtime: tokio::runtime::Runtime,
    listener: TcpListener,
    addr: SocketAddr,
    limits: Limits,
}

impl Server {
    /// Binds `listen` with the default limits.
    pub fn bind(listen: &str) -> Result<Server, Error> {
        Server::bind_with(listen, Limits::default())
    }

    /// Binds `listen`. Raises this process's `RLIMIT_NOFILE` soft limit to
    /// the hard limit and clamps `max_connections` below it (with a warning).
    pub fn bind_with(listen: &str, mut limits: Limits) -> Result<Server, Error> {
        let cannot = |e: io::Error| Error::internal(format!("cannot listen on {listen}: {e}"));
        limits.max_connections = clamp_connections(limits.max_connections, raise_nofile_limit(), limits.fd_reserve);
        let addr = std::net::ToSocketAddrs::to_socket_addrs(listen)
            .map_err(cannot)?
            .next()
            .ok_or_else(|| Error::internal(format!("{listen} names no address")))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(IO_THREADS)
            .thread_name("payonce-io")
            .enable_io()
            .enable_time()
            .build()
            .map_err(cannot)?;
        let listener = runtime
            .block_on(async {
                let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
                socket.set_reuseaddr(true)?;
                socket.bind(addr)?;
                socket.listen(LISTEN_BACKLOG)
            })
            .map_err(cannot)?;
        let addr = listener.local_addr().map_err(cannot)?;
        Ok(Server { runtime, listener, addr, limits })
    }

    /// The bound address (the real port when asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The limits in force (after clamping `max_connections`).
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Serves until `shutdown` is set, then stops accepting, finishes the
    /// requests in flight (bounded by the grace period) and returns whether
    /// every one finished in time.
    pub fn serve(self, app: Arc<App>, shutdown: Arc<AtomicBool>, workers: usize) -> bool {
        self.serve_with(Arc::new(ApiHandler(app)), shutdown, workers)
    }

    /// Serves `GET /metrics` only, without a token (`--metrics-listen`),
    /// on `workers` workers of its own, until `shutdown` is set.
    pub fn serve_metrics(self, app: Arc<App>, shutdown: Arc<AtomicBool>, workers: usize) -> bool {
        self.serve_with(Arc::new(MetricsHandler(app)), shutdown, workers)
    }

    /// Serves every request with `handler` on the same stack and worker
    /// pool: for measuring the HTTP stack alone (the benchmark's trivial
    /// handler).
    pub fn serve_fn(
        self,
        handler: impl Fn(&Request) -> Response + Send + Sync + 'static,
        shutdown: Arc<AtomicBool>,
        workers: usize,
    ) -> bool {
        self.serve_with(Arc::new(FnHandler(handler)), shutdown, workers)
    }

    fn serve_with(self, handler: Arc<dyn Handler>, shutdown: Arc<AtomicBool>, workers: usize) -> bool {
        let Server { runtime, listener, limits, .. } = self;
        let grace = Duration::from_millis(limits.shutdown_grace_ms);
        let (jobs, queue) = crossbeam_channel::unbounded::<Job>();
        let pool = WorkerPool::start(Arc::clone(&handler), queue, workers);
        let (stop_tx, stop) = watch::channel(false);
        let edge = Arc::new(Edge { handler, jobs: Mutex::new(Some(jobs)), limits, stop: stop.clone() });
        let connections_done = runtime.block_on(async {
            tokio::spawn(watch_shutdown_flag(shutdown, stop_tx));
            let permits = Arc::new(Semaphore::new(edge.limits.max_connections));
            accept_until_stopped(&listener, &permits, &edge, stop).await;
            drop(listener);
            // Every connection holds one permit until it closes.
            let all = u32::try_from(edge.limits.max_connections).unwrap_or(u32::MAX);
            if tokio::time::timeout(grace, permits.acquire_many(all)).await.is_ok() {
                return true;
            }
            // The grace period is over: what no worker has begun is refused
            // from now on, never run, and what a worker is running may
            // commit, so its connection stays open until its answer is
            // written (bounded: the work has its own timeouts).
            pool.refuse_queued();
            let running_wait = Duration::from_millis(SHUTDOWN_RUNNING_WAIT_MS_MAX);
            let _ = tokio::time::timeout(running_wait, permits.acquire_many(all)).await;
            false
        });
        // Nothing is queued after this; the workers finish what is and exit.
        edge.jobs.lock().take();
        runtime.shutdown_timeout(Duration::from_millis(100));
        let workers_done = pool.join(Instant::now() + grace);
        connections_done && workers_done
    }
}

/// What every connection shares.
struct Edge {
    handler: Arc<dyn Handler>,
    /// The workers' queue; `None` once shutdown has drained the connections.
    jobs: Mutex<Option<crossbeam_channel::Sender<Job>>>,
    limits: Limits,
    stop: watch::Receiver<bool>,
}

impl Edge {
    fn stopping(&self) -> bool {
        *self.stop.borrow()
    }
}

struct Job {
    request: Request,
    reply: oneshot::Sender<Response>,
}

/// The fixed pool of synchronous worker threads.
struct WorkerPool {
    handles: Vec<thread::JoinHandle<()>>,
    /// Set when shutdown's grace period ends: a job taken from the queue
    /// after that is answered 503 without running.
    refusing: Arc<AtomicBool>,
}

impl WorkerPool {
    fn start(handler: Arc<dyn Handler>, queue: crossbeam_channel::Receiver<Job>, workers: usize) -> WorkerPool {
        let refusing = Arc::new(AtomicBool::new(false));
        let handles = (0..workers.max(1))
            .filter_map(|i| {
                let (handler, queue, refusing) = (Arc::clone(&handler), queue.clone(), Arc::clone(&refusing));
                thread::Builder::new()
                    .name(format!("payonce-worker-{i}"))
                    .spawn(move || work(&*handler, &queue, &refusing))
                    .ok()
            })
            .collect();
        WorkerPool { handles, refusing }
    }

    fn refuse_queued(&self) {
        self.refusing.store(true, Ordering::SeqCst);
    }

    /// Waits for every worker until `deadline`; whether all finished.
    fn join(self, deadline: Instant) -> bool {
        while Instant::now() < deadline && self.handles.iter().any(|h| !h.is_finished()) {
            thread::sleep(Duration::from_millis(10));
        }
        self.handles.iter().all(|h| h.is_finished())
    }
}

fn work(handler: &dyn Handler, queue: &crossbeam_channel::Receiver<Job>, refusing: &AtomicBool) {
    loop {
        let job = queue.recv();
        let Ok(Job { request, reply }) = job else {
            return;
        };
        if refusing.load(Ordering::SeqCst) {
            let err = Error::new(ErrorKind::ShuttingDown, "payonce is shutting down; retry shortly");
            let _ = reply.send(handler.refuse(&request, &err).closing());
            continue;
        }
        // `api::serve` guards itself; this is the last resort for any handler.
        let response = catch_unwind(AssertUnwindSafe(|| handler.handle(&request))).unwrap_or_else(|_| {
            log::error("handler panicked", &[("method", &request.method), ("path", &request.path)]);
            Response::error(&Error::internal("the request failed inside payonce; it was not applied"))
        });
        // The connection may be gone; the work is committed or not by now.
        let _ = reply.send(response);
    }
}

/// Turns the flag the signal handler sets into a watch the runtime awaits.
async fn watch_shutdown_flag(shutdown: Arc<AtomicBool>, stop: watch::Sender<bool>) {
    while !shutdown.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(SHUTDOWN_POLL_MS)).await;
    }
    let _ = stop.send(true);
}

async fn accept_until_stopped(
    listener: &TcpListener,
    permits: &Arc<Semaphore>,
    edge: &Arc<Edge>,
    stop: watch::Receiver<bool>,
) {
    let mut accept_errors = RateLimitedLog::new(Duration::from_millis(ACCEPT_ERROR_LOG_INTERVAL_MS));
    loop {
        // Beyond max_connections, new connections wait in the kernel's backlog.
        let permit = tokio::select! {
            permit = Arc::clone(permits).acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return,
            },
            () = stopped(stop.clone()) => return,
        };
        let stream = loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => break stream,
                    Err(e) => {
                        // EMFILE, ENFILE, ENOMEM…: the pending connection stays in
                        // the backlog, so back off instead of spinning on it.
                        accept_errors.error("accepting a connection failed; retrying", &e);
                        tokio::time::sleep(Duration::from_millis(ACCEPT_BACKOFF_MS)).await;
                    }
                },
                () = stopped(stop.clone()) => return,
            }
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(serve_connection(stream, permit, Arc::clone(edge)));
    }
}

/// Resolves once shutdown has begun (or the runtime is going away).
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|stopped| *stopped).await;
}

/// Logs at most once per interval, counting what it left out.
struct RateLimitedLog {
    interval: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimitedLog {
    fn new(interval: Duration) -> RateLimitedLog {
        RateLimitedLog { interval, last: None, suppressed: 0 }
    }

    fn error(&mut self, message: &str, err: &io::Error) {
        let now = Instant::now();
        if self.last.is_some_and(|last| now.duration_since(last) < self.interval) {
            self.suppressed += 1;
            return;
        }
        log::error(message, &[("error", err), ("suppressed", &self.suppressed)]);
        self.last = Some(now);
        self.suppressed = 0;
    }
}

async fn serve_connection(stream: TcpStream, _permit: OwnedSemaphorePermit, edge: Arc<Edge>) {
    let state = Arc::new(Mutex::new(ConnState::new()));
    let io = TokioIo::new(TimedIo::new(stream, Arc::clone(&state), &edge.limits));
    let service_edge = Arc::clone(&edge);
    let service = service_fn(move |req| serve_request(req, Arc::clone(&service_edge), Arc::clone(&state)));
    let mut builder = http1::Builder::new();
    builder
        .keep_alive(true)
        // A client may half-close after sending its request and still read the answer.
        .half_close(true)
        .max_headers(HEADERS_COUNT_MAX)
        .max_header_size(HEAD_BYTES_MAX)
        .max_buf_size(READ_BUFFER_BYTES_MAX)
        // The head and idle timeouts are TimedIo's: hyper's one timer would
        // also cut a keep-alive connection that is merely idle.
        .header_read_timeout(None)
        // hyper's pipeline_flush skips every flush, the final one before
        // close included, while unparsed bytes wait in its read buffer: a 431
        // or a refusal of smuggled framing would never be written.
        .pipeline_flush(false);
    let connection = builder.serve_connection(io, service);
    let mut connection = std::pin::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => {}
        () = stopped(edge.stop.clone()) => {
            // Finish the request in flight, then close.
            connection.as_mut().graceful_shutdown();
            let _ = connection.await;
        }
    }
}

type HyperResponse = hyper::Response<Full<Bytes>>;

/// One request: framing checks, the body within its limit and timeout, then
/// a worker. Requests of one connection come here one at a time, in order.
async fn serve_request(
    req: hyper::Request<Incoming>,
    edge: Arc<Edge>,
    state: Arc<Mutex<ConnState>>,
) -> Result<HyperResponse, Infallible> {
    let ambiguous_framing = state.lock().begin_request();
    let response = answer(req, &edge, ambiguous_framing).await;
    state.lock().phase = Phase::Responding { since: Instant::now() };
    Ok(to_hyper(response))
}

async fn answer(req: hyper::Request<Incoming>, edge: &Edge, ambiguous_framing: Option<&'static str>) -> Response {
    let (head, body) = req.into_parts();
    let mut request = Request {
        method: head.method.as_str().to_owned(),
        path: head.uri.path().to_owned(),
        query: head.uri.query().unwrap_or("").to_owned(),
        // Header values are bytes; a non-ASCII byte becomes U+FFFD, which
        // no header payonce reads accepts, so it meets payonce's own 400.
        headers: head
            .headers
            .iter()
            .map(|(name, value)| (name.as_str().to_owned(), String::from_utf8_lossy(value.as_bytes()).into_owned()))
            .collect(),
        body: Vec::new(),
    };
    if let Err(err) = check_framing(&head.headers, ambiguous_framing) {
        return edge.handler.refuse(&request, &err).closing();
    }
    if edge.stopping() {
        let err = Error::new(ErrorKind::ShuttingDown, "payonce is shutting down; retry on another instance or shortly");
        return edge.handler.refuse(&request, &err).closing();
    }
    let body_bytes_max = edge.handler.body_bytes_max(&request.path);
    let too_large = || Error::new(ErrorKind::PayloadTooLarge, format!("the body exceeds {body_bytes_max} bytes"));
    let declared = head.headers.get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > body_bytes_max as u64) {
        // Refused before a byte of it is read or a byte allocated for it.
        return edge.handler.refuse(&request, &too_large()).closing();
    }
    let timeout = Duration::from_millis(edge.limits.body_read_timeout_ms);
    match tokio::time::timeout(timeout, Limited::new(body, body_bytes_max).collect()).await {
        // Vec::from takes over the collected buffer instead of copying it: a
        // statement of 16 MiB is held once (docs/performance.md).
        Ok(Ok(collected)) => request.body = Vec::from(collected.to_bytes()),
        Ok(Err(e)) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
            return edge.handler.refuse(&request, &too_large()).closing();
        }
        Ok(Err(e)) => {
            let err = Error::invalid(format!("could not read the body: {e}"));
            return edge.handler.refuse(&request, &err).closing();
        }
        Err(_) => {
            let err = Error::new(
                ErrorKind::RequestTimeout,
                format!("the body did not arrive within {} ms", edge.limits.body_read_timeout_ms),
            );
            return edge.handler.refuse(&request, &err).closing();
        }
    }
    run_on_worker(edge, request).await
}

async fn run_on_worker(edge: &Edge, request: Request) -> Response {
    let (reply, answer) = oneshot::channel();
    let queued = edge.jobs.lock().as_ref().is_some_and(|jobs| jobs.send(Job { request, reply }).is_ok());
    let unavailable =
        || Response::error(&Error::new(ErrorKind::ShuttingDown, "payonce is shutting down; retry shortly")).closing();
    if !queued {
        return unavailable();
    }
    answer.await.unwrap_or_else(|_| unavailable())
}

/// The edge's framing rules (docs/deployment.md), stricter than hyper's own: hyper lets
/// Content-Length with Transfer-Encoding, equal duplicate Content-Lengths and
/// `identity, chunked` through, and any of them can smuggle a second request
/// past a proxy that reads the framing differently. hyper drops the extra
/// Content-Lengths from the headers it hands over, so those two cases come
/// from the [`FramingScanner`]'s reading of the raw head.
fn check_framing(headers: &hyper::HeaderMap, scanned: Option<&'static str>) -> Result<(), Error> {
    let lengths: Vec<&HeaderValue> = headers.get_all(CONTENT_LENGTH).iter().collect();
    let codings: Vec<&HeaderValue> = headers.get_all(TRANSFER_ENCODING).iter().collect();
    let refuse = |why: &str| Err(Error::new(ErrorKind::InvalidRequest, format!("ambiguous message framing: {why}")));
    if let Some(why) = scanned {
        return refuse(why);
    }
    if !lengths.is_empty() && !codings.is_empty() {
        return refuse("Content-Length together with Transfer-Encoding");
    }
    if lengths.len() > 1 {
        return refuse("more than one Content-Length");
    }
    if lengths.first().is_some_and(|v| v.is_empty() || !v.as_bytes().iter().all(u8::is_ascii_digit)) {
        return refuse("Content-Length is not a decimal number");
    }
    if codings.len() > 1 || codings.first().is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"chunked")) {
        return refuse("the only Transfer-Encoding accepted is chunked");
    }
    Ok(())
}

fn to_hyper(response: Response) -> HyperResponse {
    let mut out = hyper::Response::new(Full::new(Bytes::from(response.body)));
    *out.status_mut() =
        hyper::StatusCode::from_u16(response.status).unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
    for (name, value) in &response.headers {
        if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_str(value)) {
            out.headers_mut().append(name, value);
        }
    }
    // Answers carry orders, payments and tokens' results: no browser or
    // proxy keeps them (an operator's console would otherwise leave payment
    // data in its disk cache), and none is sniffed into another type. Set
    // here, once, so no route and no refusal of the edge can forget them; a
    // handler that chose its own caching (the console's files) keeps it.
    let headers = out.headers_mut();
    if !headers.contains_key(hyper::header::CACHE_CONTROL) {
        headers.insert(hyper::header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    if !headers.contains_key(hyper::header::X_CONTENT_TYPE_OPTIONS) {
        headers.insert(hyper::header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    }
    out
}

/// What the socket wrapper and the service of one connection share.
struct ConnState {
    phase: Phase,
    /// Requests the service has begun, numbered from 0 like the scanner's.
    requests_begun: u64,
    scanner: FramingScanner,
}

impl ConnState {
    fn new() -> ConnState {
        ConnState { phase: Phase::Head { since: Instant::now() }, requests_begun: 0, scanner: FramingScanner::new() }
    }

    /// The service has a new request: its framing verdict from the raw head.
    fn begin_request(&mut self) -> Option<&'static str> {
        self.phase = Phase::Request;
        let index = self.requests_begun;
        self.requests_begun += 1;
        self.scanner.ambiguous.filter(|(at, _)| *at == index).map(|(_, why)| why)
    }
}

/// Follows the raw request stream as it is read, message by message (head,
/// then a Content-Length or chunked body), to find the framing hyper
/// normalises away: Content-Length beside Transfer-Encoding, and more than
/// one Content-Length. It only observes; hyper parses. The first ambiguous
/// message's number is kept, and the scanner stops there (that request is
/// refused and the connection closed). On bytes it cannot follow it stops
/// too: hyper refuses those itself.
struct FramingScanner {
    state: ScanState,
    /// The current head, up to [`HEAD_BYTES_MAX`].
    head: Vec<u8>,
    /// The number of the message being read.
    message: u64,
    ambiguous: Option<(u64, &'static str)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ScanState {
    Head,
    Body {
        remaining: u64,
    },
    ChunkSize {
        line_bytes: usize,
        size: u64,
        in_extension: bool,
    },
    ChunkData {
        remaining: u64,
    },
    /// The CRLF after a chunk's data.
    ChunkEnd {
        remaining: u8,
    },
    /// Trailer lines after the last chunk; `line_bytes` of the current one.
    Trailers {
        line_bytes: usize,
    },
    Stopped,
}

/// A chunk-size line longer than this cannot be followed (hyper refuses it).
const CHUNK_LINE_BYTES_MAX: usize = 4096;

impl FramingScanner {
    fn new() -> FramingScanner {
        FramingScanner { state: ScanState::Head, head: Vec::new(), message: 0, ambiguous: None }
    }

    fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let used = match self.state {
                ScanState::Stopped => return,
                ScanState::Head => self.feed_head(bytes),
                ScanState::Body { remaining } => {
                    let used = usize::try_from(remaining).unwrap_or(usize::MAX).min(bytes.len());
                    self.state = ScanState::Body { remaining: remaining - used as u64 };
                    if remaining == used as u64 {
                        self.end_message();
                    }
                    used
                }
                ScanState::ChunkSize { line_bytes, size, in_extension } => {
                    self.feed_chunk_size(bytes[0], line_bytes, size, in_extension);
                    1
                }
                ScanState::ChunkData { remaining } => {
                    let used = usize::try_from(remaining).unwrap_or(usize::MAX).min(bytes.len());
                    self.state = if remaining == used as u64 {
                        ScanState::ChunkEnd { remaining: 2 }
                    } else {
                        ScanState::ChunkData { remaining: remaining - used as u64 }
                    };
                    used
                }
                ScanState::ChunkEnd { remaining } => {
                    self.state = if remaining == 1 {
                        ScanState::ChunkSize { line_bytes: 0, size: 0, in_extension: false }
                    } else {
                        ScanState::ChunkEnd { remaining: remaining - 1 }
                    };
                    1
                }
                ScanState::Trailers { line_bytes } => {
                    self.state = match bytes[0] {
                        b'\n' if line_bytes == 0 => {
                            self.end_message();
                            self.state
                        }
                        b'\n' => ScanState::Trailers { line_bytes: 0 },
                        b'\r' => ScanState::Trailers { line_bytes },
                        _ if line_bytes >= HEAD_BYTES_MAX => ScanState::Stopped,
                        _ => ScanState::Trailers { line_bytes: line_bytes + 1 },
                    };
                    1
                }
            };
            bytes = &bytes[used..];
        }
    }

    /// Collects a head; returns how many bytes of `bytes` it took.
    fn feed_head(&mut self, bytes: &[u8]) -> usize {
        // Empty lines before a request line are allowed (RFC 9112 section 2.2).
        if self.head.is_empty() && matches!(bytes[0], b'\r' | b'\n') {
            return 1;
        }
        let search_from = self.head.len().saturating_sub(3);
        let take = bytes.len().min(HEAD_BYTES_MAX + 4 - self.head.len().min(HEAD_BYTES_MAX + 4));
        self.head.extend_from_slice(&bytes[..take]);
        let Some(end) = self.head[search_from..].windows(4).position(|w| w == b"\r\n\r\n") else {
            if self.head.len() >= HEAD_BYTES_MAX + 4 {
                self.state = ScanState::Stopped;
            }
            return take;
        };
        let head_len = search_from + end + 4;
        let unused = self.head.len() - head_len;
        self.head.truncate(head_len);
        self.read_framing();
        self.head.clear();
        take - unused
    }

    fn read_framing(&mut self) {
        let mut headers = [httparse::EMPTY_HEADER; HEADERS_COUNT_MAX];
        let mut request = httparse::Request::new(&mut headers);
        if !matches!(request.parse(&self.head), Ok(httparse::Status::Complete(_))) {
            self.state = ScanState::Stopped;
            return;
        }
        let lengths: Vec<&[u8]> =
            request.headers.iter().filter(|h| h.name.eq_ignore_ascii_case("content-length")).map(|h| h.value).collect();
        let codings: Vec<&[u8]> = request
            .headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case("transfer-encoding"))
            .map(|h| h.value)
            .collect();
        let why = if !lengths.is_empty() && !codings.is_empty() {
            Some("Content-Length together with Transfer-Encoding")
        } else if lengths.len() > 1 {
            Some("more than one Content-Length")
        } else {
            None
        };
        if let Some(why) = why {
            self.ambiguous = Some((self.message, why));
            self.state = ScanState::Stopped;
            return;
        }
        let chunked = codings.last().is_some_and(|v| {
            v.rsplit(|b| *b == b',').next().is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"))
        });
        let length = lengths.first().and_then(|v| std::str::from_utf8(v).ok()).map(|v| v.trim().parse::<u64>());
        self.state = match (chunked, length) {
            (true, _) => ScanState::ChunkSize { line_bytes: 0, size: 0, in_extension: false },
            (false, Some(Ok(0))) | (false, None) if codings.is_empty() => {
                self.end_message();
                return;
            }
            (false, Some(Ok(n))) => ScanState::Body { remaining: n },
            _ => ScanState::Stopped,
        };
    }

    fn feed_chunk_size(&mut self, byte: u8, line_bytes: usize, size: u64, in_extension: bool) {
        if line_bytes >= CHUNK_LINE_BYTES_MAX {
            self.state = ScanState::Stopped;
            return;
        }
        let next = |size, in_extension| ScanState::ChunkSize { line_bytes: line_bytes + 1, size, in_extension };
        self.state = match byte {
            b'\n' if size == 0 => ScanState::Trailers { line_bytes: 0 },
            b'\n' => ScanState::ChunkData { remaining: size },
            _ if in_extension => next(size, true),
            b';' => next(size, true),
            b'\r' | b' ' | b'\t' => next(size, in_extension),
            _ => match (byte as char).to_digit(16) {
                Some(digit) => match size.checked_mul(16).and_then(|s| s.checked_add(u64::from(digit))) {
                    Some(size) => next(size, false),
                    None => ScanState::Stopped,
                },
                None => ScanState::Stopped,
            },
        };
    }

    fn end_message(&mut self) {
        self.message += 1;
        self.state = ScanState::Head;
    }
}

/// Where a connection is between requests, for the timeouts hyper does not
/// keep itself.
#[derive(Clone, Copy, Debug)]
enum Phase {
    /// Between the end of a response and the first byte of the next request.
    Idle { since: Instant },
    /// From the first byte of a head (or the accept) until hyper has parsed it.
    Head { since: Instant },
    /// The service has the request: body (its own timeout) and the worker.
    Request,
    /// The answer is being written.
    Responding { since: Instant },
}

/// The socket with the connection's read and write deadlines. A deadline
/// that passes makes the next read or write fail, and hyper closes the
/// connection.
struct TimedIo {
    stream: TcpStream,
    state: Arc<Mutex<ConnState>>,
    header_read_timeout: Duration,
    keep_alive_idle: Duration,
    response_write_timeout: Duration,
    /// When a write first found the socket full, for writes outside `Responding`.
    write_blocked_since: Option<Instant>,
    /// Set once hyper closes the connection: see `poll_shutdown`.
    lingering: Option<Lingering>,
    timer: Pin<Box<tokio::time::Sleep>>,
}

struct Lingering {
    until: Instant,
    discarded_bytes: usize,
}

/// After the answer that closes a connection, payonce reads and discards
/// what the client still sends for up to this long (or this many bytes)
/// before closing: closing with unread bytes makes the kernel send a reset,
/// which can destroy the answer (413, 431, 400) before the client reads it.
const LINGERING_CLOSE_MS: u64 = 2_000;
const LINGERING_CLOSE_BYTES_MAX: usize = 1024 * 1024;

impl TimedIo {
    fn new(stream: TcpStream, state: Arc<Mutex<ConnState>>, limits: &Limits) -> TimedIo {
        TimedIo {
            stream,
            state,
            header_read_timeout: Duration::from_millis(limits.header_read_timeout_ms),
            keep_alive_idle: Duration::from_millis(limits.keep_alive_idle_ms),
            response_write_timeout: Duration::from_millis(limits.response_write_timeout_ms),
            write_blocked_since: None,
            lingering: None,
            timer: Box::pin(tokio::time::sleep(Duration::from_secs(3600))),
        }
    }

    fn read_deadline(&self) -> Option<Instant> {
        match self.state.lock().phase {
            Phase::Idle { since } => Some(since + self.keep_alive_idle),
            Phase::Head { since } => Some(since + self.header_read_timeout),
            Phase::Request | Phase::Responding { .. } => None,
        }
    }

    fn write_deadline(&self) -> Option<Instant> {
        match self.state.lock().phase {
            Phase::Responding { since } => Some(since + self.response_write_timeout),
            _ => self.write_blocked_since.map(|since| since + self.response_write_timeout),
        }
    }

    /// Ready(error) once `deadline` has passed; otherwise arms the timer so
    /// the task wakes at the deadline even if the socket stays silent.
    fn poll_deadline(&mut self, cx: &mut Context<'_>, deadline: Option<Instant>, what: &str) -> Poll<io::Error> {
        let Some(deadline) = deadline else {
            return Poll::Pending;
        };
        let deadline = tokio::time::Instant::from_std(deadline);
        if self.timer.deadline() != deadline {
            self.timer.as_mut().reset(deadline);
        }
        match self.timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(io::Error::new(io::ErrorKind::TimedOut, format!("{what} timed out"))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for TimedIo {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let deadline = this.read_deadline();
        // Checked on every read, so one byte a second cannot stretch a head.
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "read timed out")));
        }
        let filled_before = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let fresh = &buf.filled()[filled_before..];
                if !fresh.is_empty() {
                    let mut state = this.state.lock();
                    if let Phase::Idle { .. } = state.phase {
                        state.phase = Phase::Head { since: Instant::now() };
                    }
                    state.scanner.feed(fresh);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => match this.poll_deadline(cx, deadline, "reading the request") {
                Poll::Ready(err) => Poll::Ready(Err(err)),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl TimedIo {
    /// One write attempt under the write deadline: a write that finds the
    /// socket full starts the clock, and one that makes progress stops it.
    fn poll_timed_write(
        &mut self,
        cx: &mut Context<'_>,
        write: impl FnOnce(Pin<&mut TcpStream>, &mut Context<'_>) -> Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        let deadline = self.write_deadline();
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "writing the response timed out")));
        }
        match write(Pin::new(&mut self.stream), cx) {
            Poll::Pending => {
                self.write_blocked_since.get_or_insert_with(Instant::now);
                let deadline = self.write_deadline();
                match self.poll_deadline(cx, deadline, "writing the response") {
                    Poll::Ready(err) => Poll::Ready(Err(err)),
                    Poll::Pending => Poll::Pending,
                }
            }
            ready => {
                self.write_blocked_since = None;
                ready
            }
        }
    }
}

impl AsyncWrite for TimedIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.get_mut().poll_timed_write(cx, |stream, cx| stream.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_timed_write(cx, |stream, cx| stream.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let flushed = Pin::new(&mut this.stream).poll_flush(cx);
        if let Poll::Ready(Ok(())) = flushed {
            // hyper flushes once an answer is written: the idle clock starts.
            let mut state = this.state.lock();
            if let Phase::Responding { .. } = state.phase {
                state.phase = Phase::Idle { since: Instant::now() };
            }
        }
        flushed
    }

    /// FIN first, then a lingering close: what the client still sends is
    /// read and discarded until it closes, or for a bounded time and size.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.lingering.is_none() {
            if let Err(e) = std::task::ready!(Pin::new(&mut this.stream).poll_shutdown(cx)) {
                return Poll::Ready(Err(e));
            }
            let until = Instant::now() + Duration::from_millis(LINGERING_CLOSE_MS);
            this.lingering = Some(Lingering { until, discarded_bytes: 0 });
        }
        let mut scratch = [0u8; 8 * 1024];
        loop {
            let Some(lingering) = this.lingering.as_mut() else {
                return Poll::Ready(Ok(()));
            };
            if lingering.discarded_bytes > LINGERING_CLOSE_BYTES_MAX {
                return Poll::Ready(Ok(()));
            }
            let until = lingering.until;
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut this.stream).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if buf.filled().is_empty() => return Poll::Ready(Ok(())),
                Poll::Ready(Ok(())) => lingering.discarded_bytes += buf.filled().len(),
                Poll::Ready(Err(_)) => return Poll::Ready(Ok(())),
                Poll::Pending => {
                    return match this.poll_deadline(cx, Some(until), "lingering close") {
                        Poll::Ready(_) => Poll::Ready(Ok(())),
                        Poll::Pending => Poll::Pending,
                    };
                }
            }
        }
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit; returns the soft limit
/// in force afterwards.
fn raise_nofile_limit() -> u64 {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return u64::MAX;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit.rlim_cur = limit.rlim_max;
            }
        }
    }
    limit.rlim_cur
}

/// `max_connections`, at most the descriptor limit minus the reserve.
fn clamp_connections(max_connections: usize, nofile: u64, fd_reserve: u64) -> usize {
    let available = usize::try_from(nofile.saturating_sub(fd_reserve)).unwrap_or(usize::MAX).max(MAX_CONNECTIONS_MIN);
    if max_connections <= available {
        return max_connections;
    }
    log::warn(
        "--max-connections is above what the descriptor limit allows; clamped",
        &[
            ("max_connections", &max_connections),
            ("clamped_to", &available),
            ("rlimit_nofile", &nofile),
            ("fd_reserve", &fd_reserve),
        ],
    );
    available
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_are_clamped_below_the_descriptor_limit() {
        assert_eq!(clamp_connections(1024, 4096, 128), 1024);
        assert_eq!(clamp_connections(1024, 1024, 128), 896);
        assert_eq!(clamp_connections(1024, 64, 128), MAX_CONNECTIONS_MIN);
        assert_eq!(clamp_connections(4, 64, 128), 4);
    }

    fn scan(stream: &[u8], piece: usize) -> FramingScanner {
        let mut scanner = FramingScanner::new();
        for part in stream.chunks(piece.max(1)) {
            scanner.feed(part);
        }
        scanner
    }

    #[test]
    fn the_scanner_follows_messages_and_finds_the_ambiguous_one() {
        let good = b"POST /a HTTP/1.1\r\nContent-Length: 3\r\n\r\nabcGET /b HTTP/1.1\r\n\r\n\
POST /c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n0\r\nX-T: 1\r\n\r\n";
        for piece in [1, 2, 7, 1000] {
            let scanner = scan(good, piece);
            assert_eq!(
                (scanner.message, scanner.ambiguous, scanner.state),
                (3, None, ScanState::Head),
                "piece {piece}"
            );
        }
        let mut smuggling = good.to_vec();
        smuggling
            .extend_from_slice(b"POST /d HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n");
        for piece in [1, 5, 1000] {
            assert_eq!(scan(&smuggling, piece).ambiguous.map(|(n, _)| n), Some(3), "piece {piece}");
        }
        let twice = b"GET / HTTP/1.1\r\n\r\nPOST / HTTP/1.1\r\nContent-Length: 1\r\ncontent-length: 1\r\n\r\nx";
        assert_eq!(scan(twice, 3).ambiguous, Some((1, "more than one Content-Length")));
        assert_eq!(scan(b"\x00\x01garbage\r\n\r\n", 4).state, ScanState::Stopped);
    }

    #[test]
    fn framing_is_refused_when_ambiguous() {
        let check = |headers: &[(&str, &str)], ok: bool| {
            let mut map = hyper::HeaderMap::new();
            for (name, value) in headers {
                map.append(HeaderName::from_bytes(name.as_bytes()).unwrap(), HeaderValue::from_str(value).unwrap());
            }
            assert_eq!(check_framing(&map, None).is_ok(), ok, "{headers:?}");
        };
        check(&[], true);
        check(&[("content-length", "5")], true);
        check(&[("transfer-encoding", "chunked")], true);
        check(&[("transfer-encoding", "Chunked")], true);
        check(&[("content-length", "5"), ("transfer-encoding", "chunked")], false);
        check(&[("content-length", "5"), ("content-length", "5")], false);
        check(&[("content-length", "0x0")], false);
        check(&[("content-length", "-1")], false);
        check(&[("content-length", "0, 0")], false);
        check(&[("content-length", "")], false);
        check(&[("transfer-encoding", "gzip")], false);
        check(&[("transfer-encoding", "identity")], false);
        check(&[("transfer-encoding", "xchunked")], false);
        check(&[("transfer-encoding", "chunked, identity")], false);
        check(&[("transfer-encoding", "identity, chunked")], false);
        check(&[("transfer-encoding", "chunked"), ("transfer-encoding", "chunked")], false);
    }
}
