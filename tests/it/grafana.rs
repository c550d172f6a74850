//! `deploy/grafana-dashboard.json` names only what payonce exports: every
//! `expr` of every panel is checked against a live `/metrics` scrape of an
//! in-process payonce after some traffic (the series it renders, with their
//! label names), not against a list kept by hand.

use crate::util::Pay;
use payonce::api::{self, Request};
use payonce::app::{App, Config};
use payonce::clock::Clock;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};

/// Series name → the label names its samples carry.
type Exported = BTreeMap<String, BTreeSet<String>>;

fn call(app: &App, method: &str, path: &str, body: &Value) -> api::Response {
    let req = Request {
        method: method.into(),
        path: path.into(),
        query: String::new(),
        headers: vec![("Content-Type".into(), "application/json".into())],
        body: if body.is_null() { Vec::new() } else { body.to_string().into_bytes() },
    };
    api::serve(app, &req)
}

/// The series of one exposition: each sample line's name and label names
/// (label values may hold `{`, `}` and `,`: they are read as quoted strings).
fn exported(text: &str) -> Exported {
    let mut series = Exported::new();
    for line in text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let labels = series.entry(line[..name_end].to_owned()).or_default();
        let Some(mut rest) = line[name_end..].strip_prefix('{') else {
            continue;
        };
        while let Some((label, after)) = rest.split_once("=\"") {
            labels.insert(label.trim_start_matches(',').to_owned());
            // Skip the quoted value, honouring backslash escapes.
            let mut escaped = false;
            let end = after
                .char_indices()
                .find(|&(_, c)| {
                    let closes = c == '"' && !escaped;
                    escaped = c == '\\' && !escaped;
                    closes
                })
                .map_or(after.len(), |(i, _)| i + 1);
            rest = &after[end..];
            if rest.starts_with('}') {
                break;
            }
        }
    }
    series
}

/// The `payonce_*` names an expression reads.
fn metric_names(expr: &str) -> Vec<&str> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("payonce_") {
        let tail = &rest[at..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        names.push(&tail[..end]);
        rest = &tail[end..];
    }
    names
}

/// The label names an expression groups by (`by (a, b)`) or selects on (`{a="..."}`).
fn label_names(expr: &str) -> Vec<String> {
    let mut labels = Vec::new();
    for (open, close) in [("by (", ')'), ("{", '}')] {
        let mut rest = expr;
        while let Some(at) = rest.find(open) {
            let inner = &rest[at + open.len()..];
            let end = inner.find(close).unwrap_or(inner.len());
            for part in inner[..end].split(',') {
                let label = part.split(['=', '!', '~']).next().unwrap_or("").trim();
                if !label.is_empty() && !label.starts_with('$') {
                    labels.push(label.to_owned());
                }
            }
            rest = &inner[end..];
        }
    }
    labels
}

/// What is wrong with one expression against the exported series.
fn problems(expr: &str, exported: &Exported) -> Vec<String> {
    let names = metric_names(expr);
    let mut found = Vec::new();
    if names.is_empty() {
        found.push(format!("{expr:?} names no payonce metric"));
    }
    let mut known_labels = BTreeSet::new();
    for name in &names {
        match exported.get(*name) {
            Some(labels) => known_labels.extend(labels.iter().cloned()),
            None => found.push(format!("{expr:?}: payonce exports no {name}")),
        }
    }
    for label in label_names(expr) {
        if !known_labels.contains(&label) {
            found.push(format!("{expr:?}: no series of {names:?} has a label {label:?}"));
        }
    }
    found
}

/// Every `expr` of the dashboard, with its panel's title.
fn dashboard_exprs() -> Vec<(String, String)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/grafana-dashboard.json");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    let dashboard: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path} is not JSON: {e}"));
    let panels = dashboard["panels"].as_array().cloned().unwrap_or_default();
    assert!(!panels.is_empty(), "{path}: no panels");
    let mut exprs = Vec::new();
    for panel in &panels {
        let title = panel["title"].as_str().unwrap_or_default().to_owned();
        let targets = panel["targets"].as_array().cloned().unwrap_or_default();
        assert!(!targets.is_empty(), "panel {title:?} queries nothing");
        for target in targets {
            let expr = target["expr"].as_str().unwrap_or_else(|| panic!("panel {title:?}: a target without expr"));
            exprs.push((title.clone(), expr.to_owned()));
        }
    }
    exprs
}

#[test]
fn every_dashboard_expression_names_only_exported_metrics_and_labels() {
    let app = App::open(":memory:", Clock::System, Config::default()).expect("open app");
    // Some traffic: an order paid, its payment re-delivered, a request refused.
    let created = call(&app, "POST", "/v1/orders", &json!({"order_no": "G-1", "user_id": "u1", "amount": 100}));
    assert_eq!(created.status, 201);
    for _ in 0..2 {
        Pay { pay_no: "GP-1", order_no: "G-1", amount: 100, status: "SUCCESS" }.deliver(&app);
    }
    assert_eq!(call(&app, "GET", "/v1/orders/nope", &Value::Null).status, 404);
    assert_eq!(call(&app, "GET", "/v1/inspections", &Value::Null).status, 200);
    let scrape = call(&app, "GET", "/metrics", &Value::Null);
    assert_eq!(scrape.status, 200);
    let exported = exported(&String::from_utf8_lossy(&scrape.body));
    assert!(exported.len() > 10, "a scrape with series: {exported:?}");
    assert!(exported["payonce_http_requests_total"].contains("route"), "{exported:?}");

    let exprs = dashboard_exprs();
    let wrong: Vec<String> = exprs
        .iter()
        .flat_map(|(title, expr)| problems(expr, &exported).into_iter().map(move |p| format!("{title}: {p}")))
        .collect();
    assert!(wrong.is_empty(), "deploy/grafana-dashboard.json:\n{}", wrong.join("\n"));

    // What the dashboard is for: each of these is on it.
    let named: BTreeSet<&str> = exprs.iter().flat_map(|(_, e)| metric_names(e)).collect();
    for needed in [
        "payonce_callback_outcomes_total",
        "payonce_duplicates_suppressed_total",
        "payonce_webhook_pending",
        "payonce_webhook_oldest_pending_seconds",
        "payonce_inspection_last_findings",
        "payonce_platform_calls_total",
        "payonce_http_request_duration_seconds_bucket",
    ] {
        assert!(named.contains(needed), "the dashboard shows {needed}: {named:?}");
    }

    // The check itself refuses what payonce does not export.
    assert!(!problems("rate(payonce_no_such_total[5m])", &exported).is_empty());
    assert!(!problems("sum by (nope) (rate(payonce_http_requests_total[5m]))", &exported).is_empty());
    assert!(!problems("sum(rate(payonce_callback_outcomes_total{channel=\"x\"}[5m]))", &exported).is_empty());
    assert!(!problems("up", &exported).is_empty());
}
