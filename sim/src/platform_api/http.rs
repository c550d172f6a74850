//! The platforms' HTTP/1.1 side: a std listener on loopback, a thread per
//! connection, keep-alive with Content-Length bodies, and the transport
//! faults (a refused connection, an answer that never comes, a late one,
//! a request held before it is acted on).
//! What a request means and what it is answered is the [`Api`]'s.
//!
//! Small on purpose: its only clients are payonce and the tests, on
//! loopback, so it bounds what it reads but speaks just enough HTTP/1.1.

use super::{Call, Fault};
use parking_lot::{Condvar, Mutex};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Longest request line or header line read.
const LINE_BYTES_MAX: u64 = 16 * 1024;
const HEADERS_MAX: usize = 100;
/// Largest request body read: the merchant APIs' bodies are a few hundred bytes.
const BODY_BYTES_MAX: usize = 1 << 20;

/// One request as it arrived.
#[derive(Clone, Debug)]
pub(super) struct Request {
    pub method: String,
    /// Path and query exactly as sent (what WeChat Pay signs).
    pub target: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// The client asked to close after this answer.
    close: bool,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// The path, still percent-encoded.
    pub fn path(&self) -> &str {
        self.target.split_once('?').map_or(self.target.as_str(), |(path, _)| path)
    }

    /// The query string, still percent-encoded ("" without one).
    pub fn query(&self) -> &str {
        self.target.split_once('?').map_or("", |(_, query)| query)
    }
}

/// A signed answer, ready to write.
pub(super) struct Answer {
    pub status: u16,
    /// Content-Type included; never Content-Length or Connection (the server's).
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// The platform's code in the answer, for the record.
    pub code: Option<String>,
}

/// A platform's merchant API behind the server.
pub(super) trait Api: Send + Sync + 'static {
    /// What [`Api::check`] learnt that [`Api::answer`] acts on.
    type Checked;
    /// Parses and authenticates a request without acting on it: the record
    /// of a request that is never answered is this.
    fn check(&self, request: &Request) -> (Call, Self::Checked);
    /// Acts on a checked request and answers it. `fault` is the fault in
    /// force for this request; the transport ones (refuse, hang, slow) are
    /// the server's, the others change what is answered.
    fn answer(&self, request: &Request, checked: Self::Checked, fault: Option<&Fault>) -> Answer;
}

/// The fault in force, for how many more requests.
#[derive(Default)]
struct FaultState {
    fault: Option<Fault>,
    /// `None`: until changed.
    remaining: Option<usize>,
}

impl FaultState {
    /// The fault this request (or, `refuse_only`, this new connection) gets,
    /// counted against a limited one.
    fn take(&mut self, refuse_only: bool) -> Option<Fault> {
        let fault = self.fault.clone()?;
        if refuse_only && fault != Fault::Refuse {
            return None;
        }
        if let Some(remaining) = self.remaining.as_mut() {
            *remaining = remaining.saturating_sub(1);
            if *remaining == 0 {
                self.fault = None;
                self.remaining = None;
            }
        }
        Some(fault)
    }
}

/// What the server's threads and its owner share.
#[derive(Default)]
struct Shared {
    stopping: Mutex<bool>,
    /// Wakes the sleeps of slow answers when the server stops.
    stopped: Condvar,
    fault: Mutex<FaultState>,
    calls: Mutex<Vec<Call>>,
    /// Told of each call as it is recorded (the standalone mode's log).
    observer: Mutex<Option<Observer>>,
    /// The open connections (a handle to shut each down) and their threads.
    connections: Mutex<Vec<(TcpStream, JoinHandle<()>)>>,
}

/// See [`Server::on_call`].
pub(super) type Observer = Arc<dyn Fn(&Call) + Send + Sync>;

impl Shared {
    fn record(&self, call: Call) {
        // A clone, so a slow observer holds neither lock.
        let observer = self.observer.lock().clone();
        if let Some(observer) = observer {
            observer(&call);
        }
        self.calls.lock().push(call);
    }

    fn is_stopping(&self) -> bool {
        *self.stopping.lock()
    }

    /// Waits `duration`; `false` when the server stopped meanwhile.
    fn sleep(&self, duration: Duration) -> bool {
        let deadline = Instant::now() + duration;
        let mut stopping = self.stopping.lock();
        while !*stopping {
            if self.stopped.wait_until(&mut stopping, deadline).timed_out() {
                return true;
            }
        }
        false
    }
}

/// A listening platform; stops, and ends its connections, when dropped.
pub(super) struct Server {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl Server {
    /// On `127.0.0.1:port`; port 0 picks a free one.
    pub fn start<A: Api>(name: &str, port: u16, api: Arc<A>) -> Result<Server, String> {
        let listener = TcpListener::bind(("127.0.0.1", port))
            .map_err(|e| format!("{name}: cannot listen on 127.0.0.1:{port}: {e}"))?;
        let addr = listener.local_addr().map_err(|e| format!("{name}: {e}"))?;
        let shared = Arc::new(Shared::default());
        let for_acceptor = Arc::clone(&shared);
        let thread_name = format!("{name}-api");
        let acceptor = thread::Builder::new()
            .name(thread_name.clone())
            .spawn(move || accept(listener, api, for_acceptor, thread_name))
            .map_err(|e| format!("{name}: cannot start the server thread: {e}"))?;
        Ok(Server { addr, shared, acceptor: Some(acceptor) })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn set_fault(&self, fault: Option<Fault>, count: Option<usize>) {
        let mut state = self.shared.fault.lock();
        // Zero requests of a fault is no fault.
        let none = fault.is_none() || count == Some(0);
        *state = if none { FaultState::default() } else { FaultState { fault, remaining: count } };
    }

    pub fn calls(&self) -> Vec<Call> {
        self.shared.calls.lock().clone()
    }

    /// Keeps what reached the platform without a request to this server
    /// (a request the buyer opened), as if it had been one.
    pub fn record(&self, call: Call) {
        self.shared.record(call);
    }

    /// `observer` is told of every call from now on, when it is recorded:
    /// an unanswered one (refused, hanging) as it arrives.
    pub fn on_call(&self, observer: Observer) {
        *self.shared.observer.lock() = Some(observer);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        *self.shared.stopping.lock() = true;
        self.shared.stopped.notify_all();
        // The acceptor sits in accept(): a connection of our own wakes it to
        // see the flag. If none can be made, the listener is gone already.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
        // Shutting a socket down wakes its thread from any read or write
        // (a hanging answer, an idle keep-alive), so every one ends now.
        let connections = std::mem::take(&mut *self.shared.connections.lock());
        for (stream, _) in &connections {
            let _ = stream.shutdown(Shutdown::Both);
        }
        for (_, handle) in connections {
            let _ = handle.join();
        }
    }
}

fn accept<A: Api>(listener: TcpListener, api: Arc<A>, shared: Arc<Shared>, thread_name: String) {
    for stream in listener.incoming() {
        if shared.is_stopping() {
            return;
        }
        let stream = match stream {
            Ok(stream) => stream,
            // Out of descriptors or the like: let the client retry.
            Err(_) => {
                thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if shared.fault.lock().take(true).is_some() {
            // Refused: closed before a byte is read.
            drop(stream);
            continue;
        }
        let Ok(handle_copy) = stream.try_clone() else { continue };
        let (api, for_connection) = (Arc::clone(&api), Arc::clone(&shared));
        let spawned =
            thread::Builder::new().name(thread_name.clone()).spawn(move || serve(stream, &*api, &for_connection));
        if let Ok(handle) = spawned {
            let mut connections = shared.connections.lock();
            // Finished threads' entries go here, so a long run keeps no more
            // than its open connections (and their descriptors).
            connections.retain(|(_, handle)| !handle.is_finished());
            connections.push((handle_copy, handle));
        }
    }
}

/// One connection: requests in turn until the client closes, asks to, or a
/// fault ends it.
fn serve<A: Api>(stream: TcpStream, api: &A, shared: &Shared) {
    let _ = stream.set_nodelay(true);
    let Ok(reading) = stream.try_clone() else { return };
    let mut reader = BufReader::new(reading);
    let mut writer = stream;
    loop {
        let request = match read_request(&mut reader, &mut writer) {
            Ok(Some(request)) => request,
            Ok(None) => break,
            Err((status, message)) => {
                let _ = write_plain(&mut writer, status, &message);
                break;
            }
        };
        if shared.is_stopping() {
            break;
        }
        let fault = shared.fault.lock().take(false);
        let (mut call, checked) = api.check(&request);
        match fault {
            Some(Fault::Refuse) => {
                // Read, not acted on, never answered: the connection just ends.
                shared.record(call);
                break;
            }
            Some(Fault::Hang) => {
                shared.record(call);
                // Held open, unanswered, until the client gives up (or the
                // server stops); whatever else it sends is ignored.
                let mut sink = [0u8; 4096];
                while matches!(reader.read(&mut sink), Ok(n) if n > 0) {}
                break;
            }
            // Unlike Slow, held before it is acted on.
            Some(Fault::Delay(delay)) if !shared.sleep(delay) => break,
            _ => {}
        }
        let answer = api.answer(&request, checked, fault.as_ref());
        call.status = Some(answer.status);
        call.code = answer.code.clone();
        shared.record(call);
        if let Some(Fault::Slow(delay)) = fault {
            // Acted on already: only the answer is late.
            if !shared.sleep(delay) {
                break;
            }
        }
        if write_answer(&mut writer, &answer, request.close).is_err() || request.close {
            break;
        }
    }
    let _ = writer.shutdown(Shutdown::Both);
}

/// The next request; `Ok(None)` when the client closed between requests,
/// `Err((status, message))` for one that cannot be served (then closed).
fn read_request(reader: &mut impl BufRead, writer: &mut impl Write) -> Result<Option<Request>, (u16, String)> {
    let mut line = String::new();
    match read_line(reader, &mut line) {
        Ok(0) | Err(_) => return Ok(None),
        Ok(_) => {}
    }
    let request_line = line.trim_end_matches(['\r', '\n']).to_owned();
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err((400, format!("not an HTTP request line: {request_line:?}")));
    };
    if !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return Err((400, format!("not an HTTP/1.x origin-form request: {request_line:?}")));
    }
    let mut headers = Vec::new();
    loop {
        match read_line(reader, &mut line) {
            Ok(0) | Err(_) => return Ok(None),
            Ok(_) => {}
        }
        let header = line.trim_end_matches(['\r', '\n']);
        if header.is_empty() {
            break;
        }
        if headers.len() == HEADERS_MAX {
            return Err((431, format!("more than {HEADERS_MAX} header lines")));
        }
        let Some((name, value)) = header.split_once(':') else {
            return Err((400, format!("not a header line: {header:?}")));
        };
        headers.push((name.trim().to_owned(), value.trim().to_owned()));
    }
    let header = |name: &str| headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str());
    if header("Transfer-Encoding").is_some() {
        return Err((501, "the simulated platform reads Content-Length bodies only".into()));
    }
    let length = match header("Content-Length") {
        None => 0,
        Some(text) => text.parse::<usize>().map_err(|_| (400, format!("Content-Length {text:?}")))?,
    };
    if length > BODY_BYTES_MAX {
        return Err((413, format!("a {length}-byte body")));
    }
    let connection = header("Connection").unwrap_or("").to_ascii_lowercase();
    let close = connection.contains("close") || (version == "HTTP/1.0" && !connection.contains("keep-alive"));
    if length > 0 && header("Expect").is_some_and(|e| e.eq_ignore_ascii_case("100-continue")) {
        writer.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").map_err(|e| (400, e.to_string()))?;
    }
    let mut body = vec![0; length];
    if reader.read_exact(&mut body).is_err() {
        return Ok(None);
    }
    Ok(Some(Request { method: method.to_owned(), target: target.to_owned(), headers, body, close }))
}

fn read_line(reader: &mut impl BufRead, line: &mut String) -> std::io::Result<usize> {
    line.clear();
    reader.take(LINE_BYTES_MAX).read_line(line)
}

fn write_answer(writer: &mut impl Write, answer: &Answer, close: bool) -> std::io::Result<()> {
    let mut head = format!("HTTP/1.1 {} {}\r\n", answer.status, reason(answer.status));
    for (name, value) in &answer.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    // A 204 has no body, and RFC 9110 forbids it a Content-Length.
    if answer.status != 204 {
        head.push_str(&format!("Content-Length: {}\r\n", answer.body.len()));
    }
    if close {
        head.push_str("Connection: close\r\n");
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(&answer.body);
    writer.write_all(&bytes)?;
    writer.flush()
}

/// An answer below the platform (malformed HTTP): plain text, unsigned, then closed.
fn write_plain(writer: &mut impl Write, status: u16, message: &str) -> std::io::Result<()> {
    let answer = Answer {
        status,
        headers: vec![("Content-Type".into(), "text/plain; charset=utf-8".into())],
        body: message.as_bytes().to_vec(),
        code: None,
    };
    write_answer(writer, &answer, true)
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        204 => "No Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        _ => "Unknown",
    }
}

/// `%XX` and (in forms) `+` decoded; `None` for a malformed escape or bytes
/// that are not UTF-8.
pub(super) fn percent_decode(text: &str, plus_is_space: bool) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' if plus_is_space => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// `a=1&b=2` decoded into pairs, in order; `None` if any part is malformed.
pub(super) fn parse_form(text: &str) -> Option<Vec<(String, String)>> {
    text.split('&')
        .filter(|part| !part.is_empty())
        .map(|part| {
            let (name, value) = part.split_once('=').unwrap_or((part, ""));
            Some((percent_decode(name, true)?, percent_decode(value, true)?))
        })
        .collect()
}
