//! How long the inspection takes on a large database. Builds a file
//! database of N paid orders (default 1,000,000) with their payments,
//! coupons and points in bulk SQL (bypassing the API, which would take an
//! fsync per order), plus a few refund-required payments, then times
//! `App::inspect` and prints each query plan's use of indexes.
//!
//! Run: `cargo run --release --example inspect_scale [N]`

use payonce::{App, Clock, Config};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: i64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(1_000_000);
    let dir = std::env::temp_dir().join(format!("payonce-inspect-scale-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let db = dir.join("scale.db").display().to_string();
    let app = App::open(&db, Clock::System, Config::default())?;
    let started = Instant::now();
    {
        let mut conn = app.store().raw_connection()?;
        let tx = conn.transaction()?;
        tx.execute_batch(&format!(
            "WITH RECURSIVE seq(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM seq WHERE i < {n})
             INSERT INTO orders (id, order_no, user_id, amount, currency, status, created_at, expires_at)
             SELECT i, 'O' || i, 'u' || (i % 50000), 9900, 'CNY', 'PENDING',
                    '2024-01-01T00:00:00.000Z', '2024-01-01T00:15:00.000Z' FROM seq;
             UPDATE orders SET status = 'PAID', pay_no = 'P' || id, paid_at = '2024-01-01T00:01:00.000Z';
             INSERT INTO pay_callback_log (pay_no, channel, order_id, amount, status, outcome, state, source, raw_body,
                                           received_at, decided_at, rewards_due)
             SELECT 'P' || id, 'generic', id, 9900, 'SUCCESS', 'applied', 'decided', 'callback', x'7b7d',
                    '2024-01-01T00:01:00.000Z', '2024-01-01T00:01:00.000Z', '{{\"coupons\":[\"NEW10\"],\"points\":99}}'
             FROM orders;
             INSERT INTO user_coupon (user_id, order_id, coupon_template_id, status, created_at)
             SELECT user_id, id, 'NEW10', 'ACTIVE', '2024-01-01T00:01:00.000Z' FROM orders;
             INSERT INTO point_log (user_id, order_id, point_type, points, created_at)
             SELECT user_id, id, 'ORDER_PAID', 99, '2024-01-01T00:01:00.000Z' FROM orders;
             INSERT INTO pay_callback_log (pay_no, channel, order_id, amount, status, outcome, state, source, raw_body,
                                           received_at, decided_at)
             SELECT 'Q' || id, 'generic', id, 9900, 'SUCCESS', 'already_paid', 'decided', 'callback', x'7b7d',
                    '2024-01-01T00:02:00.000Z', '2024-01-01T00:02:00.000Z' FROM orders WHERE id % 100000 = 0;"
        ))?;
        tx.commit()?;
        conn.execute_batch("ANALYZE")?;
    }
    println!("built {n} paid orders in {:.1} s ({db})", started.elapsed().as_secs_f64());
    for run in 1..=3 {
        let t = Instant::now();
        let findings = app.operations().inspect()?;
        println!("inspection run {run}: {:.3} s, {} findings", t.elapsed().as_secs_f64(), findings.len());
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
