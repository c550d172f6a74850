//! docs/openapi.yaml stays in step with the router: the set of documented
//! `METHOD /path` pairs equals `payonce::api::ROUTES` exactly, and every
//! documented path is the route template the router's metrics label it with.
//! (Schemathesis checks the bodies, statuses and headers against a live
//! server: `make fuzz-api`.)

use std::collections::BTreeSet;

const METHODS: &[&str] = &["get", "put", "post", "delete", "patch", "head", "options", "trace"];

fn spec_text() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.yaml");
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

/// `METHOD /path` for every operation under the top-level `paths:` key.
/// Line-based: paths are the keys indented by two spaces, operations the
/// method keys indented by four, as the file is written.
fn documented_operations(yaml: &str) -> Vec<String> {
    let mut operations = Vec::new();
    let mut in_paths = false;
    let mut current_path: Option<String> = None;
    for line in yaml.lines() {
        let content = line.trim_end();
        if content.trim_start().starts_with('#') || content.trim().is_empty() {
            continue;
        }
        let indent = content.len() - content.trim_start().len();
        if indent == 0 {
            in_paths = content == "paths:";
            current_path = None;
            continue;
        }
        if !in_paths {
            continue;
        }
        let key = content.trim_start().strip_suffix(':');
        match (indent, key) {
            (2, Some(path)) => {
                let path = path.trim_matches(|c| c == '"' || c == '\'');
                assert!(path.starts_with('/'), "a key under paths: that is not a path: {content:?}");
                current_path = Some(path.to_owned());
            }
            (4, Some(method)) if METHODS.contains(&method) => {
                let path = current_path.as_ref().unwrap_or_else(|| panic!("{method} outside a path"));
                operations.push(format!("{} {path}", method.to_ascii_uppercase()));
            }
            _ => {}
        }
    }
    operations
}

#[test]
fn every_route_is_documented_and_every_documented_route_exists() {
    let yaml = spec_text();
    assert!(yaml.lines().any(|l| l.trim() == "openapi: 3.0.3"), "docs/openapi.yaml is OpenAPI 3.0.3");
    let documented = documented_operations(&yaml);
    let documented_set: BTreeSet<&str> = documented.iter().map(String::as_str).collect();
    assert_eq!(documented.len(), documented_set.len(), "an operation is documented twice: {documented:?}");

    let listed: Vec<String> = payonce::api::routes().map(|r| format!("{} {}", r.method, r.template)).collect();
    let routes: BTreeSet<&str> = listed.iter().map(String::as_str).collect();
    assert_eq!(routes.len(), listed.len(), "the route table lists a route twice");

    let undocumented: Vec<&&str> = routes.difference(&documented_set).collect();
    let unrouted: Vec<&&str> = documented_set.difference(&routes).collect();
    assert!(
        undocumented.is_empty() && unrouted.is_empty(),
        "docs/openapi.yaml and the route table differ\n  routed but not documented: {undocumented:?}\n  documented but not routed: {unrouted:?}"
    );
    println!("openapi: {} operations documented, all routed", documented.len());
}

#[test]
fn documented_paths_are_the_router_templates() {
    let yaml = spec_text();
    for operation in documented_operations(&yaml) {
        let (_, template) = operation.split_once(' ').unwrap_or_default();
        // A concrete path: each {param} replaced by an identifier.
        let concrete: Vec<String> = template
            .split('/')
            .map(|segment| if segment.starts_with('{') { "ID-1".to_owned() } else { segment.to_owned() })
            .collect();
        let concrete = concrete.join("/");
        assert_eq!(payonce::api::route_label(&concrete), template, "{concrete} is labelled as another route");
    }
}

#[test]
fn the_parser_reads_the_paths_section_only() {
    let yaml = "openapi: 3.0.3\npaths:\n  /a/{x}:\n    get:\n      responses: {}\n    post:\n      parameters:\n        - in: query\n  \"/b\":\n    # put:\n    put:\n      x: 1\ncomponents:\n  schemas:\n    get:\n      type: object\n";
    assert_eq!(documented_operations(yaml), vec!["GET /a/{x}", "POST /a/{x}", "PUT /b"]);
}
