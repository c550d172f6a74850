//! The HTTP layer answers every connection of a burst, even when the
//! clients keep their connections open (keep-alive, as a reverse proxy or a
//! load generator does). tiny_http 0.12, the first server payonce used, left
//! a connection of such a burst unread until another connection closed.

use payonce::api::Response;
use payonce::http::Server;
use serde_json::json;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

const CONNECTIONS: usize = 12;
const ROUNDS: usize = 10;
/// Far above a loopback round trip; the stall this guards against lasted
/// until another connection closed, i.e. forever for keep-alive clients.
const ANSWER_WAIT: Duration = Duration::from_secs(3);

/// Sends one keep-alive request and reads one response (Content-Length framing).
fn round_trip(stream: &mut TcpStream) -> std::io::Result<u16> {
    stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut status_line = String::new();
    reader.read_line(&mut status_line)?;
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        if line.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body)?;
    Ok(status_line.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0))
}

#[test]
fn every_connection_of_a_keep_alive_burst_is_answered() {
    for round in 0..ROUNDS {
        let server = Server::bind("127.0.0.1:0").expect("bind");
        let addr = server.local_addr();
        let shutdown = Arc::new(AtomicBool::new(false));
        let serving = {
            let shutdown = Arc::clone(&shutdown);
            thread::spawn(move || server.serve_fn(|_| Response::json(200, &json!({"status": "ok"})), shutdown, 4))
        };
        let start = Arc::new(Barrier::new(CONNECTIONS));
        let done = Arc::new(Barrier::new(CONNECTIONS));
        let clients: Vec<_> = (0..CONNECTIONS)
            .map(|_| {
                let (start, done) = (Arc::clone(&start), Arc::clone(&done));
                thread::spawn(move || {
                    // All connect at once: the burst is what the task pool mishandled.
                    start.wait();
                    let mut stream = TcpStream::connect(addr).expect("connect");
                    stream.set_read_timeout(Some(ANSWER_WAIT)).expect("timeout");
                    let answered = round_trip(&mut stream).map_err(|e| e.to_string());
                    // Keep every connection open until all were answered or
                    // timed out, as keep-alive clients do.
                    done.wait();
                    drop(stream);
                    answered
                })
            })
            .collect();
        let answers: Vec<_> = clients.into_iter().map(|c| c.join().expect("client thread")).collect();
        shutdown.store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = serving.join();
        let unanswered = answers.iter().filter(|a| !matches!(a, Ok(200))).count();
        assert_eq!(
            unanswered, 0,
            "round {round}: {unanswered} of {CONNECTIONS} connections got no answer: {answers:?}"
        );
    }
}
