//! docs/channels.md's example of the simulated platform APIs runs as
//! written: its shell block is read from the page, the simulator started as
//! its first line says prints the flags the page lists, `payonce serve` takes
//! them, and each `curl` line (pointed at that server) answers what its
//! comment promises, with the buyer's `pay` typed into the simulator between
//! them. The processes: tests/common/serve.rs, which says when this skips.

mod common;

use common::platforms_sim::Sim;
use common::serve::{payonce_binary, Serve};
use common::TempDir;
use std::process::Command;

/// The first ```sh block after `heading` in `text`.
fn shell_block<'t>(text: &'t str, heading: &str) -> &'t str {
    let section = text.split(heading).nth(1).unwrap_or_else(|| panic!("no {heading:?}"));
    let block = section.split("```sh\n").nth(1).unwrap_or_else(|| panic!("no sh block under {heading:?}"));
    block.split("\n```").next().unwrap_or_default()
}

#[test]
fn the_simulated_platforms_example_runs_as_written() {
    let Some(exe) = payonce_binary() else { return };
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/channels.md")).expect("page");
    let block = shell_block(&page, "## The simulated platform APIs");
    let lines: Vec<&str> = block.lines().collect();

    // 1. The simulator, started as the page says, prints the flags it lists.
    let start = lines[0];
    let args: Vec<&str> = start
        .strip_prefix("payonce simulate platforms ")
        .unwrap_or_else(|| panic!("the block starts with the simulator: {start}"))
        .split_whitespace()
        .collect();
    let mut sim = Sim::start(&args);
    let listed: Vec<&str> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("# --"))
        .map(|l| l.split_whitespace().next().unwrap_or_default())
        .collect();
    let printed: Vec<&str> = sim.flags.iter().map(|(flag, _)| flag.trim_start_matches("--")).collect();
    assert_eq!(listed, printed, "the page lists the flags the simulator prints, in order");
    assert!(lines.contains(&"# ready"), "{block}");

    // 2. payonce serve with those flags.
    let serve_line = lines.iter().find(|l| l.starts_with("payonce serve")).expect("a serve line");
    assert!(serve_line.starts_with("payonce serve --dev --db dev.db"), "{serve_line}");
    let dir = TempDir::new("docs-channels");
    let server = Serve::start(&exe, &dir.0.join("dev.db"), &sim, &["--dev"], &[]);

    // 3. The curls and the buyer's pay, in the page's order.
    let base = format!("http://{}", server.addr);
    let mut answers = Vec::new();
    for line in lines.iter().skip_while(|l| !l.starts_with("payonce serve")).skip(1) {
        let (command, comment) = line.split_once('#').map_or((*line, ""), |(c, m)| (c.trim(), m.trim()));
        if command.starts_with("curl ") {
            let script = command.replace("localhost:8080", &base);
            let out = Command::new("bash").args(["-euo", "pipefail", "-c", &format!("{script} -sS")]).output();
            let out = out.expect("bash");
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            assert!(out.status.success(), "{script}: {}\n{text}", String::from_utf8_lossy(&out.stderr));
            answers.push((command.to_owned(), comment.to_owned(), text));
        } else if let Some(order) = command.strip_prefix("pay ") {
            let answer = sim.command(&format!("pay {order}"));
            assert!(!answer.is_empty(), "the simulator answers the buyer's pay");
        } else if !command.is_empty() {
            panic!("a line this test does not know how to run: {line}");
        }
    }
    assert_eq!(answers.len(), 3, "{answers:?}");
    let (_, _, created) = &answers[0];
    assert!(created.contains(r#""order_no":"ORD_1001""#) && created.contains(r#""status":"PENDING""#), "{created}");
    let (_, comment, paid) = &answers[1];
    assert!(comment.contains("code_url") && paid.contains(r#""code_url""#), "{comment}: {paid}");
    let (_, comment, synced) = &answers[2];
    assert!(comment.contains("PAID") && comment.contains("query"), "{comment}");
    let (status, detail) = server.call("GET", "/v1/orders/ORD_1001", None);
    let detail = common::serve::json_of(&detail);
    assert_eq!((status, detail["status"].as_str()), (200, Some("PAID")), "after the sync: {synced}\n{detail}");
    let sources: Vec<&str> =
        detail["payments"].as_array().into_iter().flatten().filter_map(|p| p["source"].as_str()).collect();
    assert_eq!(sources, ["query"], "{detail}");
}
