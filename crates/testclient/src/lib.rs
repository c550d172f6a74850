//! The HTTP/1.1 client of payonce's simulator (`sim/`), `examples/bench.rs`
//! and the integration tests (`tests/it/util.rs`): one place that writes
//! requests and reads answers, std only.
//!
//! - [`request`]: one request on a fresh connection (`Connection: close`);
//! - [`Connection`]: a keep-alive connection, one request at a time;
//! - [`raw`]: any bytes, hostile ones too, and everything the server answers;
//! - [`parse_response`] / [`read_response`]: Content-Length, chunked and
//!   read-to-close bodies, within [`RESPONSE_BYTES_MAX`].
//!
//! A test and development tool: it trusts the server enough to be small,
//! but bounds what it reads, so a broken server fails a test instead of
//! hanging it or exhausting memory.

use std::fmt;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::Duration;

/// Largest answer body read (payonce's largest answers, event pages and
/// inspections, stay far below).
pub const RESPONSE_BYTES_MAX: usize = 64 << 20;
/// Longest status or header line read.
pub const HEADER_LINE_BYTES_MAX: u64 = 16 * 1024;
/// Most header lines read in one answer.
pub const RESPONSE_HEADERS_MAX: usize = 200;

/// An HTTP answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// The server closes the connection after this answer (`Connection:
    /// close`, HTTP/1.0 without keep-alive, or a body read to the close).
    pub close: bool,
}

impl Response {
    /// The first header of that name (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Why no answer was read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecvError {
    /// Nothing arrived: the connection was closed or failed before the first byte.
    Nothing(String),
    /// The read timeout passed.
    Timeout,
    /// Part of an answer arrived, or bytes that are not one.
    Failed(String),
}

impl fmt::Display for RecvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecvError::Nothing(e) => write!(f, "no answer ({e})"),
            RecvError::Timeout => write!(f, "no answer within the timeout"),
            RecvError::Failed(e) => write!(f, "a broken answer ({e})"),
        }
    }
}

impl std::error::Error for RecvError {}

/// The bytes of one request: request line, `Host`, `headers` in order,
/// `Content-Length` (always, also 0) and the body.
pub fn encode_request(method: &str, host: &str, target: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut head = format!("{method} {target} HTTP/1.1\r\nHost: {host}\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

/// One request on its own connection, with `Connection: close`; `timeout`
/// bounds the connect and each read and write.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<Response, String> {
    let mut all: Vec<(&str, &str)> = vec![("Connection", "close")];
    all.extend_from_slice(headers);
    let bytes = encode_request(method, &addr.to_string(), path, &all, body);
    let answer = raw(addr, &bytes, timeout).map_err(|e| format!("cannot connect to {addr}: {e}"))?;
    parse_response(&answer).ok_or_else(|| format!("no HTTP answer to {method} {path} from {addr}"))
}

/// Sends `bytes`, half-closes, and returns everything the server answered
/// until it closed (or the timeout passed). `Err` only when no connection
/// could be made: a server that stops reading or answering early is what
/// hostile-input tests look at, so write and read errors end the exchange
/// with what arrived.
pub fn raw(addr: SocketAddr, bytes: &[u8], timeout: Duration) -> std::io::Result<Vec<u8>> {
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let _ = stream.write_all(bytes);
    let _ = stream.shutdown(Shutdown::Write);
    let mut out = Vec::new();
    let _ = stream.take(RESPONSE_BYTES_MAX as u64).read_to_end(&mut out);
    Ok(out)
}

/// Parses the first answer in `bytes`, leniently: a body shorter than its
/// Content-Length (a HEAD answer, a truncated one) is kept as it is, and
/// without Content-Length or chunking the body is the rest of `bytes`.
pub fn parse_response(bytes: &[u8]) -> Option<Response> {
    let split = bytes.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&bytes[..split]).ok()?;
    let mut lines = head.split("\r\n");
    let (version, status) = status_line(lines.next()?)?;
    let headers: Vec<(String, String)> = lines.filter_map(header_line).collect();
    let mut response = Response { status, headers, body: bytes[split + 4..].to_vec(), close: false };
    response.close = closes(&version, &response);
    match framing(&response) {
        Ok(Framing::Chunked) => response.body = dechunk(&response.body)?,
        Ok(Framing::Length(length)) => response.body.truncate(length),
        Ok(Framing::ToClose) => response.close = true,
        // A malformed Content-Length: the body as it came.
        Ok(Framing::None) | Err(_) => {}
    }
    Some(response)
}

/// Decodes a whole chunked body; `None` when it is malformed or incomplete.
pub fn dechunk(mut bytes: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = bytes.windows(2).position(|w| w == b"\r\n")?;
        let size = chunk_size(std::str::from_utf8(&bytes[..line_end]).ok()?)?;
        bytes = &bytes[line_end + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(bytes.get(..size)?);
        bytes = bytes.get(size + 2..)?;
    }
}

/// Reads one answer from a stream: Content-Length, chunked, or (without
/// either) up to the close.
pub fn read_response(reader: &mut impl BufRead) -> Result<Response, RecvError> {
    let mut line = String::new();
    match read_line(reader, &mut line) {
        Ok(0) => return Err(RecvError::Nothing("connection closed".into())),
        Ok(_) => {}
        Err(e) => return Err(recv_error(e, true)),
    }
    let (version, status) = status_line(line.trim_end_matches(['\r', '\n']))
        .ok_or_else(|| RecvError::Failed(format!("not an HTTP status line: {:?}", line.trim_end())))?;
    let mut headers = Vec::new();
    loop {
        match read_line(reader, &mut line) {
            Ok(0) => return Err(RecvError::Failed("connection closed inside the headers".into())),
            Ok(_) => {}
            Err(e) => return Err(recv_error(e, false)),
        }
        let trimmed = line.trim_end_matches(['\r', '\n']);
        if trimmed.is_empty() {
            break;
        }
        if headers.len() >= RESPONSE_HEADERS_MAX {
            return Err(RecvError::Failed(format!("more than {RESPONSE_HEADERS_MAX} headers")));
        }
        headers.extend(header_line(trimmed));
    }
    let mut response = Response { status, headers, body: Vec::new(), close: false };
    response.close = closes(&version, &response);
    match framing(&response).map_err(RecvError::Failed)? {
        Framing::Chunked => response.body = read_chunked(reader)?,
        Framing::Length(length) => {
            if length > RESPONSE_BYTES_MAX {
                return Err(RecvError::Failed(format!("a {length}-byte answer")));
            }
            response.body = vec![0; length];
            reader.read_exact(&mut response.body).map_err(|e| recv_error(e, false))?;
        }
        Framing::None => {}
        Framing::ToClose => {
            reader.take(RESPONSE_BYTES_MAX as u64).read_to_end(&mut response.body).map_err(|e| recv_error(e, false))?;
            response.close = true;
        }
    }
    Ok(response)
}

/// A keep-alive HTTP/1.1 connection: one request at a time, in order.
pub struct Connection {
    reader: BufReader<TcpStream>,
}

impl Connection {
    /// Connects within `connect_timeout`; every later read and write waits
    /// at most `io_timeout`. Nagle is off, so a request leaves at once.
    pub fn connect(addr: SocketAddr, connect_timeout: Duration, io_timeout: Duration) -> std::io::Result<Connection> {
        let stream = TcpStream::connect_timeout(&addr, connect_timeout)?;
        stream.set_read_timeout(Some(io_timeout))?;
        stream.set_write_timeout(Some(io_timeout))?;
        stream.set_nodelay(true)?;
        Ok(Connection { reader: BufReader::new(stream) })
    }

    /// How long a read waits from now on.
    pub fn set_read_timeout(&self, timeout: Duration) -> std::io::Result<()> {
        self.reader.get_ref().set_read_timeout(Some(timeout))
    }

    /// Writes a whole request (see [`encode_request`]) without reading.
    pub fn send(&mut self, request: &[u8]) -> std::io::Result<()> {
        self.reader.get_mut().write_all(request)
    }

    /// Reads the next answer.
    pub fn receive(&mut self) -> Result<Response, RecvError> {
        read_response(&mut self.reader)
    }

    /// [`send`](Connection::send), then [`receive`](Connection::receive).
    pub fn exchange(&mut self, request: &[u8]) -> Result<Response, RecvError> {
        self.send(request).map_err(|e| RecvError::Nothing(format!("cannot send: {e}")))?;
        self.receive()
    }
}

enum Framing {
    Chunked,
    Length(usize),
    /// No body by definition (1xx, 204, 304).
    None,
    ToClose,
}

fn framing(response: &Response) -> Result<Framing, String> {
    let chunked = response.header("Transfer-Encoding").is_some_and(|t| t.to_ascii_lowercase().contains("chunked"));
    if chunked {
        return Ok(Framing::Chunked);
    }
    if let Some(length) = response.header("Content-Length") {
        return length.parse().map(Framing::Length).map_err(|_| format!("a malformed Content-Length {length:?}"));
    }
    let status = response.status;
    Ok(if status == 204 || status == 304 || (100..200).contains(&status) { Framing::None } else { Framing::ToClose })
}

fn closes(version: &str, response: &Response) -> bool {
    let connection = response.header("Connection").unwrap_or("").to_ascii_lowercase();
    connection.contains("close") || (version == "HTTP/1.0" && !connection.contains("keep-alive"))
}

/// `HTTP/1.1 200 OK` → (`HTTP/1.1`, 200).
fn status_line(line: &str) -> Option<(String, u16)> {
    let mut parts = line.split_whitespace();
    let version = parts.next().filter(|v| v.starts_with("HTTP/1."))?;
    let status = parts.next()?.parse().ok()?;
    Some((version.to_owned(), status))
}

fn header_line(line: &str) -> Option<(String, String)> {
    line.split_once(':').map(|(name, value)| (name.trim().to_owned(), value.trim().to_owned()))
}

fn chunk_size(line: &str) -> Option<usize> {
    usize::from_str_radix(line.split(';').next()?.trim(), 16).ok()
}

fn read_line(reader: &mut impl BufRead, line: &mut String) -> std::io::Result<usize> {
    line.clear();
    reader.take(HEADER_LINE_BYTES_MAX).read_line(line)
}

fn recv_error(e: std::io::Error, nothing_yet: bool) -> RecvError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => RecvError::Timeout,
        _ if nothing_yet => RecvError::Nothing(e.to_string()),
        _ => RecvError::Failed(e.to_string()),
    }
}

fn read_chunked(reader: &mut impl BufRead) -> Result<Vec<u8>, RecvError> {
    let mut body = Vec::new();
    let mut line = String::new();
    loop {
        read_line(reader, &mut line).map_err(|e| recv_error(e, false))?;
        let size = chunk_size(&line)
            .ok_or_else(|| RecvError::Failed(format!("a malformed chunk size {:?}", line.trim_end())))?;
        if size == 0 {
            // Trailers, up to the empty line.
            while read_line(reader, &mut line).map_err(|e| recv_error(e, false))? > 0 && !line.trim().is_empty() {}
            return Ok(body);
        }
        if body.len() + size > RESPONSE_BYTES_MAX {
            return Err(RecvError::Failed("an oversized chunked answer".into()));
        }
        let start = body.len();
        body.resize(start + size, 0);
        reader.read_exact(&mut body[start..]).map_err(|e| recv_error(e, false))?;
        read_line(reader, &mut line).map_err(|e| recv_error(e, false))?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(bytes: &[u8], status: u16, body: &[u8], close: bool) {
        let parsed = parse_response(bytes).expect("parsed");
        assert_eq!((parsed.status, parsed.body.as_slice(), parsed.close), (status, body, close));
        let streamed = read_response(&mut &bytes[..]).expect("read");
        assert_eq!(streamed, parsed);
    }

    #[test]
    fn bodies_are_framed_by_length_chunks_or_close() {
        check(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi", 200, b"hi", false);
        check(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;x=1\r\nhi\r\n1\r\n!\r\n0\r\n\r\n",
            200,
            b"hi!",
            false,
        );
        check(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nrest", 200, b"rest", true);
        check(b"HTTP/1.0 204 No Content\r\n\r\n", 204, b"", true);
        check(b"HTTP/1.1 204 No Content\r\n\r\n", 204, b"", false);
    }

    #[test]
    fn parse_is_lenient_where_read_is_strict() {
        // A HEAD answer: the length of a body that is not there.
        let head = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n";
        assert_eq!(parse_response(head).map(|r| r.body), Some(Vec::new()));
        assert!(matches!(read_response(&mut &head[..]), Err(RecvError::Failed(_))));
        assert_eq!(read_response(&mut &b""[..]), Err(RecvError::Nothing("connection closed".into())));
        assert!(parse_response(b"garbage\r\n\r\n").is_none());
        assert!(dechunk(b"zz\r\n").is_none());
    }

    #[test]
    fn requests_always_carry_their_length() {
        let bytes = encode_request("GET", "h:1", "/x", &[("A", "b")], b"");
        assert_eq!(bytes, b"GET /x HTTP/1.1\r\nHost: h:1\r\nA: b\r\nContent-Length: 0\r\n\r\n");
    }
}
