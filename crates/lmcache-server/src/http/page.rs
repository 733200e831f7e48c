//! `GET /`: the status page an operator keeps open, for a browser (`Accept: text/html`); any
//! other client gets LMCache's JSON answer. Built from [`lmcache_http::page`]'s kit and this
//! page's body (`page/status.html`) and script (`page/status.js`): its script polls
//! `/status`, `/status/history`, `/metrics` and `/cache/requests` every two seconds and draws
//! the last minutes.

use axum::http::HeaderMap;
use lmcache_http::page::Page;

use super::*;

pub(super) use lmcache_http::page::wants_html;

static PAGE: Page =
    Page::new("lmcache-rs", include_str!("page/status.html"), include_str!("page/status.js"));

pub(super) async fn root(headers: HeaderMap) -> Response {
    PAGE.answer(&headers, json!({"status": "ok", "service": "LMCache HTTP API"}))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_page_loads_nothing_from_elsewhere() {
        let page = super::PAGE.html();
        assert_eq!(lmcache_http::page::outside_refs(page), Vec::<&str>::new());
        assert!(page.contains("startPolling(tick)") && page.contains("id=\"auth\""));
    }
}
