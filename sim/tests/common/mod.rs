//! What the simulator's integration tests share (`mod common;` in each;
//! Cargo does not build a `tests/` subdirectory as a test of its own).
#![allow(dead_code)]

pub mod platforms_sim;
pub mod serve;

use payonce::http::Server;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;

/// A scratch directory under Cargo's target tmp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// payonce (or any handler) served by the library's own HTTP edge on a
/// thread of this process, its database in `dir`; stopped on drop (the
/// `payonce` binary belongs to another package, so Cargo builds it for its
/// own tests only).
pub struct Payonce {
    pub addr: SocketAddr,
    pub db: PathBuf,
    shutdown: Arc<AtomicBool>,
    serving: Option<thread::JoinHandle<bool>>,
    _dir: TempDir,
}

impl Payonce {
    /// Runs `run(server, shutdown flag)` on a thread.
    pub fn serve(
        server: Server,
        run: impl FnOnce(Server, Arc<AtomicBool>) -> bool + Send + 'static,
        db: PathBuf,
        dir: TempDir,
    ) -> Payonce {
        let addr = server.local_addr();
        let shutdown = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&shutdown);
        let serving = thread::spawn(move || run(server, flag));
        Payonce { addr, db, shutdown, serving: Some(serving), _dir: dir }
    }
}

impl Drop for Payonce {
    fn drop(&mut self) {
        self.shutdown.store(true, Ordering::SeqCst);
        if let Some(serving) = self.serving.take() {
            let _ = serving.join();
        }
    }
}
