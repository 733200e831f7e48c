//! `GET /`: the status page an operator keeps open, for a browser (`Accept: text/html`); any
//! other client gets LMCache's JSON answer. Built from [`lmcache_http::page`]'s kit and this
//! page's body (`page/status.html`) and script (`page/status.js`): its script polls
//! `/status`, `/metrics` and `/cache/requests` every two seconds and draws the last ten minutes.

use std::sync::OnceLock;

use axum::http::HeaderMap;

use super::*;

pub(super) use lmcache_http::page::wants_html;

fn page() -> &'static str {
    static PAGE: OnceLock<String> = OnceLock::new();
    PAGE.get_or_init(|| {
        lmcache_http::page::assemble(
            "lmcache-rs",
            include_str!("page/status.html"),
            include_str!("page/status.js"),
        )
    })
}

pub(super) async fn root(headers: HeaderMap) -> Response {
    if !wants_html(&headers) {
        return Json(json!({"status": "ok", "service": "LMCache HTTP API"})).into_response();
    }
    lmcache_http::page::respond(page())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_page_loads_nothing_from_elsewhere() {
        let page = super::page();
        for needle in ["http://", "https://", "//cdn", "@import", "src=\"", "href=\"/"] {
            assert!(!page.contains(needle), "the page refers outside itself: {needle}");
        }
        assert!(page.contains("startPolling(tick)") && page.contains("id=\"auth\""));
    }
}
