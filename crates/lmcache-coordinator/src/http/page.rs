//! `GET /`: the fleet's page for a browser (`Accept: text/html`): instances and their liveness,
//! per-server L1 usage and directory keys, event streams (lag, gaps, missing batches), the
//! directory's size; anything else gets a JSON greeting. Built from [`lmcache_http::page`]'s
//! kit and this page's body (`page/fleet.html`) and script (`page/fleet.js`), which polls the
//! coordinator's read routes every two seconds.

use std::sync::OnceLock;

use axum::extract::Json;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::json;

fn page() -> &'static str {
    static PAGE: OnceLock<String> = OnceLock::new();
    PAGE.get_or_init(|| {
        lmcache_http::page::assemble(
            "lmcache-rs coordinator",
            include_str!("page/fleet.html"),
            include_str!("page/fleet.js"),
        )
    })
}

pub(super) async fn root(headers: HeaderMap) -> Response {
    if !lmcache_http::page::wants_html(&headers) {
        return Json(json!({"status": "ok", "service": "lmcache-rs coordinator"})).into_response();
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
        assert!(page.contains("startPolling(tick)") && page.contains("id=\"servers\""));
    }
}
