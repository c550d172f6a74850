//! The one worker shape of leased calls: a dispatcher thread claims due
//! calls of a [`Queue`] while a sender is free, and `concurrency` sender
//! threads make them, so a hanging call holds one sender only. The
//! dispatcher sleeps on a [`Signal`] (rung by each finished call, and by
//! whatever else the queue's work depends on) or until its poll interval
//! passed. Once shutdown is set it claims nothing more and its senders
//! start no claimed call (those are left to their lease). What happens to
//! the calls being made is the queue's choice ([`AtShutdown`]).

use crate::error::Error;
use crate::log;
use crate::store::Signal;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How often a waiting dispatcher looks at the shutdown flag.
const SHUTDOWN_POLL_MS: u64 = 100;

/// A kind of leased call as a worker drains it.
pub trait Queue: Send + Sync {
    /// One claimed call.
    type Job: Send + Sync;
    /// What making one call returns.
    type Done: Send;
    /// The warning logged when a round of claims fails.
    const ROUND_FAILED: &'static str;
    /// Whether calls may be claimed now (the storage is writable, the mode allows it).
    fn ready(&self) -> bool;
    /// Claims up to `limit` due calls.
    fn claim_due(&self, limit: usize) -> Result<Vec<Self::Job>, Error>;
    /// Makes one claimed call and records how it ended.
    fn work(&self, job: &Self::Job) -> Self::Done;
}

/// What a stopping worker does with the calls its senders are making.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtShutdown {
    /// The dispatcher ends once each sender finished its call (the
    /// platform-call pool: a close between the platform's answer and the
    /// local close is finished, as the pool's rounds always were).
    FinishCalls,
    /// The dispatcher ends at once and leaves the calls in flight to the
    /// process's exit: one it interrupted is made again when its lease runs
    /// out (the webhook relay: a receiver that never answers must not hold
    /// the exit past `--shutdown-grace-ms`).
    LeaveCalls,
}

/// A worker's threads and when its dispatcher wakes.
pub struct Shape {
    /// The dispatcher's thread name; the senders' are `{name}-{n}`.
    pub name: &'static str,
    pub sender_name: &'static str,
    /// Calls in flight at most (at least 1).
    pub concurrency: usize,
    /// Rung when there may be work; each finished call rings it too.
    pub wake: Arc<Signal>,
    /// The longest sleep between two rounds without a ring.
    pub poll: Duration,
    pub at_shutdown: AtShutdown,
}

/// One round by hand (tests, tools, the explicit drain of a pool): claims
/// up to `limit` calls, makes them at once, one thread each, and waits for
/// all. Returns what each returned.
pub fn run_once<Q: Queue>(queue: &Q, limit: usize) -> Result<Vec<Q::Done>, Error> {
    let jobs = queue.claim_due(limit)?;
    Ok(thread::scope(|scope| {
        let calls: Vec<_> = jobs.iter().map(|job| scope.spawn(move || queue.work(job))).collect();
        calls.into_iter().filter_map(|call| call.join().ok()).collect()
    }))
}

/// Starts a worker for `queue`; returns its dispatcher, which ends once
/// `shutdown` is set (and, with [`AtShutdown::FinishCalls`], every sender
/// finished its call).
pub fn spawn<Q>(queue: Arc<Q>, shape: Shape, shutdown: Arc<AtomicBool>) -> std::io::Result<JoinHandle<()>>
where
    Q: Queue + 'static,
    Q::Job: 'static,
{
    let concurrency = shape.concurrency.max(1);
    let in_flight = Arc::new(AtomicUsize::new(0));
    let (jobs, inbox) = crossbeam_channel::bounded::<Q::Job>(concurrency);
    let mut senders = Vec::with_capacity(concurrency);
    for n in 0..concurrency {
        let (queue, inbox, wake) = (Arc::clone(&queue), inbox.clone(), Arc::clone(&shape.wake));
        let (in_flight, shutdown) = (Arc::clone(&in_flight), Arc::clone(&shutdown));
        senders.push(thread::Builder::new().name(format!("{}-{n}", shape.sender_name)).spawn(move || {
            for job in inbox {
                if !shutdown.load(Ordering::SeqCst) {
                    queue.work(&job);
                }
                in_flight.fetch_sub(1, Ordering::SeqCst);
                wake.ring();
            }
        })?);
    }
    thread::Builder::new().name(shape.name.into()).spawn(move || {
        while !shutdown.load(Ordering::SeqCst) {
            let seen = shape.wake.count();
            if let Err(e) = dispatch(&*queue, &jobs, &in_flight, concurrency) {
                log::warn(Q::ROUND_FAILED, &[("error", &e)]);
            }
            wait(&shape.wake, seen, shape.poll, &shutdown);
        }
        drop(jobs);
        if shape.at_shutdown == AtShutdown::FinishCalls {
            for sender in senders {
                let _ = sender.join();
            }
        }
    })
}

/// Claims as many calls as senders are free and hands them over.
fn dispatch<Q: Queue>(
    queue: &Q,
    jobs: &crossbeam_channel::Sender<Q::Job>,
    in_flight: &AtomicUsize,
    concurrency: usize,
) -> Result<(), Error> {
    if !queue.ready() {
        return Ok(());
    }
    let free = concurrency.saturating_sub(in_flight.load(Ordering::SeqCst));
    if free == 0 {
        return Ok(());
    }
    for job in queue.claim_due(free)? {
        in_flight.fetch_add(1, Ordering::SeqCst);
        if jobs.send(job).is_err() {
            in_flight.fetch_sub(1, Ordering::SeqCst);
        }
    }
    Ok(())
}

/// Sleeps until `wake` moves past `seen`, `poll` passed or shutdown is set.
fn wait(wake: &Signal, seen: u64, poll: Duration, shutdown: &AtomicBool) {
    // A zero poll would spin.
    let deadline = Instant::now() + poll.max(Duration::from_millis(1));
    loop {
        let now = Instant::now();
        if now >= deadline || shutdown.load(Ordering::SeqCst) || wake.count() != seen {
            return;
        }
        wake.wait_past(seen, (deadline - now).min(Duration::from_millis(SHUTDOWN_POLL_MS)));
    }
}
