//! The operator console (docs/console.md): four static files (the page,
//! its stylesheet, and its script made of console/i18n.js and
//! console/console.js), embedded in the binary, served at `/console`. The page reads and writes
//! only through the public `/v1` API with the operator's token; this module
//! only hands out the files, with headers that forbid everything the page
//! does not need (no inline script, no eval, no framing, nothing fetched
//! from another origin).

use crate::wire::Response;

const INDEX_HTML: &str = include_str!("../console/index.html");
/// The words of both languages (console/i18n.js) come first in the one script.
const CONSOLE_JS: &str = concat!(include_str!("../console/i18n.js"), include_str!("../console/console.js"));
const CONSOLE_CSS: &str = include_str!("../console/console.css");

/// Scripts and styles from this origin's files only; API calls to this
/// origin only; no plugin, frame, form target or base URL.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'";

fn file(content_type: &str, body: &str) -> Response {
    Response {
        status: 200,
        headers: vec![
            ("Content-Type".into(), content_type.into()),
            ("Content-Security-Policy".into(), CONTENT_SECURITY_POLICY.into()),
            ("X-Content-Type-Options".into(), "nosniff".into()),
            ("X-Frame-Options".into(), "DENY".into()),
            ("Referrer-Policy".into(), "no-referrer".into()),
            // The files change only with the binary; a restart after an upgrade must not show a stale page.
            ("Cache-Control".into(), "no-cache".into()),
        ],
        body: body.as_bytes().to_vec(),
        outcome: None,
    }
}

pub fn page() -> Response {
    file("text/html; charset=utf-8", INDEX_HTML)
}

pub fn script() -> Response {
    file("text/javascript; charset=utf-8", CONSOLE_JS)
}

pub fn stylesheet() -> Response {
    file("text/css; charset=utf-8", CONSOLE_CSS)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The policy holds only if the page keeps its side: no inline script or
    /// style, no handler attributes, nothing from another origin.
    #[test]
    fn the_page_needs_nothing_the_policy_forbids() {
        for needle in ["<script>", "style=", "onclick", "onload", "http://", "https://", "<style"] {
            assert!(!INDEX_HTML.contains(needle), "index.html contains {needle:?}");
        }
        for needle in ["innerHTML", "outerHTML", "insertAdjacentHTML", "eval(", "new Function", "document.write"] {
            assert!(!CONSOLE_JS.contains(needle), "console.js uses {needle:?}");
        }
        assert!(!CONSOLE_CSS.contains("@import") && !CONSOLE_CSS.contains("url("), "console.css loads nothing");
        // A style attribute is inline style: the charts and every element are styled by class.
        for needle in ["'style'", "\"style\"", ".style.", "cssText"] {
            assert!(!CONSOLE_JS.contains(needle), "console.js sets an inline style through {needle:?}");
        }
        assert!(CONSOLE_JS.contains("PAYONCE_STRINGS = {"), "the script starts with the words of both languages");
        assert!(CONTENT_SECURITY_POLICY.contains("script-src 'self'"));
        assert!(!CONTENT_SECURITY_POLICY.contains("unsafe"));
    }
}
