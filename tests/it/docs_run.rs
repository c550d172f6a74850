//! The README's five-minute tour runs as written: its shell block is taken
//! from README.md, pointed at a `payonce serve` started the way the README
//! says (dev mode, the coupon and points its comments speak of), and every
//! answer the tour's comments promise is in what it printed.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};

/// The first ```sh block after `heading` in `text`.
fn shell_block<'t>(text: &'t str, heading: &str) -> &'t str {
    let section = text.split(heading).nth(1).unwrap_or_else(|| panic!("no {heading:?}"));
    let block = section.split("```sh\n").nth(1).unwrap_or_else(|| panic!("no sh block under {heading:?}"));
    block.split("\n```").next().unwrap_or_default()
}

#[test]
fn the_readme_tour_runs_as_written() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).expect("README.md");
    let tour = shell_block(&readme, "## A five-minute tour");
    assert!(tour.contains("A=http://127.0.0.1:8080") && tour.contains("./target/release/payonce sign --dev"), "{tour}");
    let mut serve = Command::new(env!("CARGO_BIN_EXE_payonce"))
        .args(["serve", "--dev", "--coupon", "NEW10", "--points-per-yuan", "1", "--db", ":memory:"])
        .args(["--listen", "127.0.0.1:0"])
        .env_remove("PAYONCE_CALLBACK_SECRET")
        .env_remove("PAYONCE_API_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn payonce serve");
    let mut first = String::new();
    BufReader::new(serve.stdout.take().expect("stdout")).read_line(&mut first).expect("the listening line");
    let base = first.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("{first}")).to_owned();
    // The tour as written, on this server's port and this build's binary.
    let script = tour
        .replace("A=http://127.0.0.1:8080", &format!("A={base}"))
        .replace("./target/release/payonce", env!("CARGO_BIN_EXE_payonce"));
    let mut run = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("bash");
    let mut out = String::new();
    run.stdout.take().expect("stdout").read_to_string(&mut out).expect("read the tour's output");
    let mut err = String::new();
    run.stderr.take().expect("stderr").read_to_string(&mut err).expect("read stderr");
    let status = run.wait().expect("the tour ends");
    let _ = serve.kill();
    let _ = serve.wait();
    assert!(status.success(), "the tour failed: {err}\n{out}");
    // What the comments promise, in order.
    let promised = [
        r#""order_no":"ORD-1""#,
        r#"{"code":"SUCCESS","outcome":"applied"}"#,
        r#"{"code":"SUCCESS","outcome":"duplicate","original":"applied"}"#,
        r#"{"code":"SUCCESS","outcome":"already_paid"}"#,
        r#""coupon_template_id":"NEW10""#,
        r#""type":"order.paid""#,
        r#""code":"invalid_signature""#,
        r#""status":"REFUNDING""#,
        r#""outcome":"applied""#,
        r#""point_type":"ORDER_PAID_REVERSAL","points":-99"#,
    ];
    let mut from = 0;
    for text in promised {
        let at = out[from..].find(text).unwrap_or_else(|| panic!("{text} after byte {from} of:\n{out}"));
        from += at + text.len();
    }
}
