//! `GET /`: the fleet's page for a browser (`Accept: text/html`): instances and their liveness,
//! per-server L1 usage and directory keys, event streams (time since the last batch, gaps,
//! missing batches), the directory's size; anything else gets a JSON greeting. Built from
//! [`lmcache_http::page`]'s kit and this page's body (`page/fleet.html`) and script
//! (`page/fleet.js`), which polls the coordinator's read routes every two seconds.

use axum::http::HeaderMap;
use axum::response::Response;
use lmcache_http::page::Page;
use serde_json::json;

static PAGE: Page = Page::new(
    "lmcache-rs coordinator",
    include_str!("page/fleet.html"),
    include_str!("page/fleet.js"),
);

pub(super) async fn root(headers: HeaderMap) -> Response {
    PAGE.answer(&headers, json!({"status": "ok", "service": "lmcache-rs coordinator"}))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_page_loads_nothing_from_elsewhere() {
        let page = super::PAGE.html();
        assert_eq!(lmcache_http::page::outside_refs(page), Vec::<&str>::new());
        assert!(page.contains("startPolling(tick)") && page.contains("id=\"servers\""));
    }
}
