//! The status pages' kit, shared by the server's page and the coordinator's: one HTML document
//! per page, assembled from the shared stylesheet and script (token form, polling, a Prometheus
//! text parser, number formats, SVG line charts) and the page's own body and script, all
//! embedded in the binary: nothing is fetched from elsewhere, and [`CSP`] says so to the
//! browser.
//!
//! A page's shell holds no data: its script fetches every figure from the guarded JSON routes
//! with the bearer token the operator types in (kept in the tab's sessionStorage), so the shell
//! is served to a browser without the token.

use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{Html, IntoResponse, Response};

const COMMON_CSS: &str = include_str!("page/common.css");
const COMMON_JS: &str = include_str!("page/common.js");

/// What a page may load: itself, and fetches to the server that served it.
pub const CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                       img-src 'self' data:; connect-src 'self'; base-uri 'none'; \
                       form-action 'none'; frame-ancestors 'none'";

/// Whether the client asked for HTML (a browser does; API clients do not).
pub fn wants_html(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.split(',').any(|t| t.trim().starts_with("text/html")))
}

/// The whole document of a page: `body` (its `<header>` and `<main>`; the shared script expects
/// an `#auth` form with a `#token` input) and `script` (its own code, which calls
/// `startPolling(tick)`).
pub fn assemble(title: &str, body: &str, script: &str) -> String {
    format!(
        "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>{title}</title>\n<link rel=\"icon\" href=\"data:,\">\n<style>\n{COMMON_CSS}</style>\n</head>\n<body>\n{body}\
         <script>\n{COMMON_JS}\n{script}</script>\n</body>\n</html>\n"
    )
}

/// A service's page: its title, body and script, assembled once on first use.
#[derive(Debug)]
pub struct Page {
    title: &'static str,
    body: &'static str,
    script: &'static str,
    html: std::sync::OnceLock<String>,
}

impl Page {
    /// A page (for a `static`): nothing is assembled until it is first served.
    pub const fn new(title: &'static str, body: &'static str, script: &'static str) -> Self {
        Self { title, body, script, html: std::sync::OnceLock::new() }
    }

    /// The whole document.
    pub fn html(&self) -> &str {
        self.html.get_or_init(|| assemble(self.title, self.body, self.script))
    }

    /// `GET /` of a service with a page: the page for a browser, `json` for anything else.
    pub fn answer(&self, headers: &HeaderMap, json: serde_json::Value) -> Response {
        if wants_html(headers) { respond(self.html()) } else { axum::Json(json).into_response() }
    }
}

/// What in `page` would load from elsewhere (empty for a self-contained page). The one link
/// allowed is the empty icon, so the browser asks for no favicon.
pub fn outside_refs(page: &str) -> Vec<&'static str> {
    ["http://", "https://", "//cdn", "@import", "src=\"", "url(", "href=\"/"]
        .into_iter()
        .filter(|needle| page.contains(needle))
        .collect()
}

/// A page as the answer: HTML under [`CSP`], never cached.
pub fn respond(page: &str) -> Response {
    let mut r = Html(page.to_owned()).into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn browsers_get_pages_and_api_clients_do_not() {
        let mut h = HeaderMap::new();
        assert!(!wants_html(&h));
        h.insert(header::ACCEPT, HeaderValue::from_static("application/json"));
        assert!(!wants_html(&h));
        h.insert(
            header::ACCEPT,
            HeaderValue::from_static("text/html,application/xhtml+xml,*/*;q=0.8"),
        );
        assert!(wants_html(&h));
    }

    #[test]
    fn the_kit_refers_to_nothing_outside_the_page() {
        let page = assemble("t", "<main></main>", "startPolling(() => {});");
        assert_eq!(outside_refs(&page), Vec::<&str>::new());
        assert_eq!(
            outside_refs("<script src=\"https://cdn.x/y.js\">"),
            ["https://", "//cdn", "src=\""]
        );
        assert!(page.starts_with("<!doctype html>") && page.contains("function startPolling"));
    }
}
