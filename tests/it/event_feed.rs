//! The event feed never skips (docs/postgres.md): a reader given
//! `next_after = N` never later meets a new event with `seq <= N`, even when
//! two processes commit events out of the order they took their `seq`.
//!
//! The test hook `PAYONCE_TEST_HOLD_AFTER_EVENT_MS` holds one process's
//! transaction open right after its insert into `outbox_event`, while a
//! second process pays another order and a reader polls `/v1/events`. With
//! the outbox lock the second commit waits for the first, so the reader
//! sees both events. On PostgreSQL the test also runs with the lock off
//! (`PAYONCE_TEST_NAIVE_OUTBOX=1`, a plain sequence) and must see the reader
//! skip the held event: the proof that this test can fail.

use crate::engines::{Db, Engine};
use crate::util::{Pay, Server};
use serde_json::json;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

/// How long the first process holds its transaction after its event.
const HOLD_MS: &str = "1500";
/// When the second payment is sent, well inside the hold.
const SECOND_AFTER: Duration = Duration::from_millis(400);
const POLL_EVERY: Duration = Duration::from_millis(20);

fn create(server: &Server, order_no: &str) {
    let response = server.post_json("/v1/orders", &json!({"order_no": order_no, "user_id": "u1", "amount": 100}));
    assert_eq!(response.status, 201, "create {order_no}: {}", response.text());
}

fn events_after(server: &Server, after: i64) -> (Vec<i64>, i64) {
    let response = server.get(&format!("/v1/events?after={after}&limit=100"));
    assert_eq!(response.status, 200, "{}", response.text());
    let page = response.json();
    let seqs = page["events"].as_array().expect("events").iter().map(|e| e["seq"].as_i64().expect("seq")).collect();
    (seqs, page["next_after"].as_i64().expect("next_after"))
}

/// Runs the scenario; returns (the seqs the polling reader saw, every seq).
fn run(db: &Db, naive: bool) -> (Vec<i64>, Vec<i64>) {
    let mut hold_env = vec![("PAYONCE_TEST_HOLD_AFTER_EVENT_MS", HOLD_MS)];
    let mut other_env = Vec::new();
    if naive {
        hold_env.push(("PAYONCE_TEST_NAIVE_OUTBOX", "1"));
        other_env.push(("PAYONCE_TEST_NAIVE_OUTBOX", "1"));
    }
    let holder = db.serve_env(&[], &hold_env);
    let other = db.serve_env(&[], &other_env);
    create(&other, "O-HELD");
    create(&other, "O-QUICK");
    let stop = AtomicBool::new(false);
    let seen = thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let (mut seen, mut cursor) = (Vec::new(), 0);
            while !stop.load(Ordering::SeqCst) {
                let (seqs, next) = events_after(&other, cursor);
                seen.extend(seqs);
                cursor = next;
                thread::sleep(POLL_EVERY);
            }
            seen
        });
        let held =
            scope.spawn(|| Pay { pay_no: "P-HELD", order_no: "O-HELD", amount: 100, status: "SUCCESS" }.send(&holder));
        thread::sleep(SECOND_AFTER);
        let quick = Pay { pay_no: "P-QUICK", order_no: "O-QUICK", amount: 100, status: "SUCCESS" }.send(&other);
        assert_eq!((quick.status, quick.json()["outcome"].clone()), (200, json!("applied")), "{}", quick.text());
        let held = held.join().expect("held payment");
        assert_eq!((held.status, held.json()["outcome"].clone()), (200, json!("applied")), "{}", held.text());
        // Let the reader poll past both commits.
        thread::sleep(Duration::from_millis(300));
        stop.store(true, Ordering::SeqCst);
        reader.join().expect("reader")
    });
    let (all, _) = events_after(&other, 0);
    (seen, all)
}

for_each_engine! {
    fn a_reader_never_skips_an_event_committed_late(db) {
        let (seen, all) = run(db, false);
        assert_eq!(all.len(), 2, "{}: two order.paid events: {all:?}", db.label());
        assert_eq!(seen, all, "{}: the polling reader skipped an event", db.label());
        if db.engine == Engine::Postgres {
            // The same scenario on a plain sequence: the reader must skip.
            let naive = Db::postgres("naive_outbox").expect("a second database");
            let (seen, all) = run(&naive, true);
            assert_eq!(all.len(), 2, "naive: {all:?}");
            assert_ne!(seen, all, "without the outbox lock the reader should have skipped the held event");
            println!("naive sequence: the reader saw {seen:?} of {all:?}");
        }
    }
}
