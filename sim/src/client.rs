//! Where payonce is, and the simulator's keep-alive connections to it, over
//! the workspace's one HTTP client (`payonce-testclient`).

use crate::s;
use payonce_testclient::{encode_request, Connection, RecvError, Response};
use serde_json::Value;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// Where payonce is: a socket address, the Host header and an optional path prefix.
pub struct Target {
    pub addr: SocketAddr,
    authority: String,
    prefix: String,
    token: Option<String>,
    pub url: String,
}

impl Target {
    pub fn parse(url: &str, token: Option<String>) -> Result<Target, String> {
        let lower = url.to_ascii_lowercase();
        if lower.starts_with("https://") {
            return Err(format!(
                "--target {url}: https is not supported; point the simulator at payonce's plain-HTTP address"
            ));
        }
        let rest = if lower.starts_with("http://") { &url[7..] } else { url };
        let (authority, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        if authority.is_empty() {
            return Err(format!("--target {url:?}: expected http://HOST:PORT"));
        }
        let with_port = if authority.rsplit_once(':').is_some_and(|(_, p)| p.bytes().all(|b| b.is_ascii_digit()))
            && !authority.ends_with(']')
        {
            authority.to_owned()
        } else {
            format!("{authority}:80")
        };
        let addr = with_port
            .to_socket_addrs()
            .map_err(|e| format!("--target {url}: cannot resolve {authority}: {e}"))?
            .next()
            .ok_or_else(|| format!("--target {url}: {authority} has no address"))?;
        Ok(Target { addr, authority: authority.to_owned(), prefix: prefix.to_owned(), token, url: url.to_owned() })
    }

    pub fn local(addr: SocketAddr) -> Target {
        Target { addr, authority: addr.to_string(), prefix: String::new(), token: None, url: format!("http://{addr}") }
    }
}

/// One HTTP request to send.
#[derive(Clone, Debug)]
pub struct Req {
    pub method: &'static str,
    pub path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Req {
    pub fn get(path: String) -> Req {
        Req { method: "GET", path, headers: Vec::new(), body: Vec::new() }
    }

    pub fn post_json(path: String, body: &Value) -> Req {
        Req {
            method: "POST",
            path,
            headers: vec![("Content-Type".into(), "application/json".into())],
            body: body.to_string().into_bytes(),
        }
    }

    pub fn signed(path: String, headers: Vec<(String, String)>, body: Vec<u8>) -> Req {
        Req { method: "POST", path, headers, body }
    }

    /// The bytes on the wire: the target's path prefix and Host, the API
    /// token on everything but callbacks.
    pub fn encode(&self, target: &Target) -> Vec<u8> {
        let mut headers: Vec<(&str, &str)> = self.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        let bearer = target
            .token
            .as_deref()
            .filter(|_| !self.path.starts_with("/v1/callbacks/"))
            .map(|token| format!("Bearer {token}"));
        if let Some(bearer) = &bearer {
            headers.push(("Authorization", bearer));
        }
        let path = format!("{}{}", target.prefix, self.path);
        encode_request(self.method, &target.authority, &path, &headers, &self.body)
    }
}

/// An HTTP answer.
pub type Reply = Response;

/// What the simulator reads in an answer.
pub trait ReplyExt {
    /// The body as JSON; `Null` when it is not JSON.
    fn json(&self) -> Value;
    /// The API's error code, `-` when there is none.
    fn error_code(&self) -> String;
    /// `HTTP 409 invalid_transition`, for answers no scenario expects.
    fn summary(&self) -> String;
}

impl ReplyExt for Response {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    fn error_code(&self) -> String {
        self.json()["error"]["code"].as_str().unwrap_or("-").to_owned()
    }

    fn summary(&self) -> String {
        format!("HTTP {} {}", self.status, self.error_code())
    }
}

/// A keep-alive connection to the target, opened when needed and reopened
/// after the server closed it. `writes` counts requests written (deliveries).
pub struct Conn {
    target: Arc<Target>,
    stream: Option<Connection>,
    answered_on_stream: usize,
    pub writes: usize,
}

impl Conn {
    pub fn new(target: &Arc<Target>) -> Conn {
        Conn { target: Arc::clone(target), stream: None, answered_on_stream: 0, writes: 0 }
    }

    /// A fresh connection to `target`.
    pub fn open(target: &Target) -> Result<Connection, String> {
        Connection::connect(target.addr, CONNECT_TIMEOUT, IO_TIMEOUT)
            .map_err(|e| format!("cannot connect to {}: {e}", target.url))
    }

    /// Connects ahead of time and proves the connection is served (`GET
    /// /healthz`), so deliveries released together start together instead
    /// of racing their own connects and the server's accept.
    pub fn warm(&mut self) -> Result<(), String> {
        if self.stream.is_some() {
            return Ok(());
        }
        let mut stream = Conn::open(&self.target)?;
        let reply = stream
            .exchange(&Req::get(s("/healthz")).encode(&self.target))
            .map_err(|e| format!("GET /healthz on a new connection: {e} from {}", self.target.url))?;
        if reply.close {
            return Err(format!("{} closed a keep-alive connection after GET /healthz", self.target.url));
        }
        self.stream = Some(stream);
        self.answered_on_stream = 1;
        Ok(())
    }

    pub fn send(&mut self, req: &Req) -> Result<(), String> {
        if self.stream.is_none() {
            self.stream = Some(Conn::open(&self.target)?);
            self.answered_on_stream = 0;
        }
        let Some(stream) = self.stream.as_mut() else {
            return Err("no connection".into());
        };
        match stream.send(&req.encode(&self.target)) {
            Ok(()) => {
                self.writes += 1;
                Ok(())
            }
            Err(e) => {
                self.stream = None;
                Err(format!("cannot send {} {}: {e}", req.method, req.path))
            }
        }
    }

    pub fn receive(&mut self) -> Result<Reply, RecvError> {
        let Some(stream) = self.stream.as_mut() else {
            return Err(RecvError::Nothing("not connected".into()));
        };
        match stream.receive() {
            Ok(reply) => {
                if reply.close {
                    self.stream = None;
                } else {
                    self.answered_on_stream += 1;
                }
                Ok(reply)
            }
            Err(e) => {
                self.stream = None;
                Err(e)
            }
        }
    }

    /// Sends and reads the answer. A keep-alive connection the server closed
    /// while idle is reopened once (the request is then sent again: a real
    /// delivery, counted in `writes`).
    pub fn request(&mut self, req: &Req) -> Result<Reply, String> {
        for attempt in 0..2 {
            let reused = self.stream.is_some() && self.answered_on_stream > 0;
            let result = match self.send(req) {
                Ok(()) => self.receive(),
                Err(e) if reused => Err(RecvError::Nothing(e)),
                Err(e) => return Err(e),
            };
            match result {
                Ok(reply) => return Ok(reply),
                Err(RecvError::Nothing(_)) if reused && attempt == 0 => {}
                Err(e) => return Err(format!("{} {}: {e} from {}", req.method, req.path, self.target.url)),
            }
        }
        Err(format!("{} {}: no answer from {}", req.method, req.path, self.target.url))
    }
}
