//! A running `payonce-sim platforms` for the tests that point a payonce at
//! it (tests/platforms.rs, tests/prepay.rs): its printed flags, its stdin
//! commands and their answers.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// Unoptimised builds take seconds per 2048-bit key.
const START_TIMEOUT: Duration = Duration::from_secs(120);
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// A running `payonce-sim platforms`: its printed flags, its stdin for
/// commands, its answers line by line. Killed on drop if still running, so
/// a failed test leaves no server behind.
pub struct Sim {
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    stderr: Option<thread::JoinHandle<String>>,
    pub flags: Vec<(String, String)>,
}

impl Sim {
    pub fn start(args: &[&str]) -> Sim {
        let mut child = Command::new(env!("CARGO_BIN_EXE_payonce-sim"))
            .arg("platforms")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run payonce-sim platforms");
        let stdout = child.stdout.take().expect("stdout");
        let (send, lines) = mpsc::channel();
        // A reader thread, so a silent simulator fails the test instead of hanging it.
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        let mut stderr = child.stderr.take().expect("stderr");
        let stderr = thread::spawn(move || {
            let mut text = String::new();
            let _ = std::io::Read::read_to_string(&mut stderr, &mut text);
            text
        });
        let stdin = child.stdin.take();
        let mut sim = Sim { child, stdin, lines, stderr: Some(stderr), flags: Vec::new() };
        loop {
            let line = sim.line(START_TIMEOUT);
            if line == "ready" {
                break;
            }
            let (flag, value) = line.split_once(' ').unwrap_or_else(|| panic!("not a flag line: {line:?}"));
            sim.flags.push((flag.to_owned(), unquote(value)));
        }
        sim
    }

    pub fn line(&mut self, timeout: Duration) -> String {
        match self.lines.recv_timeout(timeout) {
            Ok(line) => line,
            Err(e) => {
                let _ = self.child.kill();
                let stderr = self.stderr.take().map(|h| h.join().unwrap_or_default()).unwrap_or_default();
                panic!("no line from payonce-sim platforms ({e}); stderr:\n{stderr}");
            }
        }
    }

    pub fn flag(&self, name: &str) -> &str {
        self.flags.iter().find(|(flag, _)| flag == name).map(|(_, v)| v.as_str()).unwrap_or_else(|| {
            panic!("{name} not printed: {:?}", self.flags);
        })
    }

    pub fn send(&mut self, command: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{command}").and_then(|()| stdin.flush()).expect("write a command");
    }

    /// A command's one-line answer.
    pub fn command(&mut self, command: &str) -> String {
        self.send(command);
        self.line(ANSWER_TIMEOUT)
    }

    /// `calls`: the lines before `end`.
    pub fn calls(&mut self) -> Vec<String> {
        self.listing("calls")
    }

    /// A command answered by lines, then `end`: the lines before it.
    pub fn listing(&mut self, command: &str) -> Vec<String> {
        self.send(command);
        let mut lines = Vec::new();
        loop {
            match self.line(ANSWER_TIMEOUT) {
                end if end == "end" => return lines,
                line => lines.push(line),
            }
        }
    }

    /// Waits for the exit (stdin closed first); the status and all of stderr.
    pub fn finish(mut self) -> (ExitStatus, String) {
        drop(self.stdin.take());
        let deadline = Instant::now() + ANSWER_TIMEOUT;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                break status;
            }
            assert!(Instant::now() < deadline, "payonce-sim platforms did not stop");
            thread::sleep(Duration::from_millis(50));
        };
        let stderr = self.stderr.take().map(|h| h.join().expect("stderr")).unwrap_or_default();
        (status, stderr)
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The printed value as a POSIX shell reads it.
fn unquote(value: &str) -> String {
    match value.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')) {
        Some(quoted) => quoted.replace(r"'\''", "'"),
        None => value.to_owned(),
    }
}

pub fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"))
}
