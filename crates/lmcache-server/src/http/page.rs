//! `GET /`: the status page an operator keeps open, for a browser (`Accept: text/html`); any
//! other client gets LMCache's JSON answer. The page is one embedded file (no CDN, no external
//! font): its script polls `/status`, `/metrics`, `/cache/requests` every two seconds with the
//! bearer token the operator types in (kept in the tab's sessionStorage), and draws the last ten
//! minutes. The shell itself holds no data, so it is served without the token.

use axum::http::{HeaderMap, HeaderValue, header};

use super::*;

/// The page, embedded at build time.
const PAGE: &str = include_str!("page/status.html");

/// What the page may load: itself, and fetches to this server; nothing from elsewhere.
const CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                   img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; \
                   frame-ancestors 'none'";

/// Whether the client asked for HTML (a browser).
pub(super) fn wants_html(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.split(',').any(|t| t.trim().starts_with("text/html")))
}

pub(super) async fn root(headers: HeaderMap) -> Response {
    if !wants_html(&headers) {
        return Json(json!({"status": "ok", "service": "LMCache HTTP API"})).into_response();
    }
    let mut r = axum::response::Html(PAGE).into_response();
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
    fn browsers_get_the_page_and_everything_else_json() {
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
    fn the_page_loads_nothing_from_elsewhere() {
        for needle in ["http://", "https://", "//cdn", "@import", "<link", "src=\""] {
            assert!(!PAGE.contains(needle), "the page refers outside itself: {needle}");
        }
    }
}
