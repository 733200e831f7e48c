//! The calls the coordinator makes to registered servers' HTTP APIs (snapshot pages for
//! repairs, prefetch and delete relays, fleet eviction orders), with the servers' bearer
//! token when they run with `--http-auth-token`.

use std::time::Duration;

use ureq::RequestBuilder;
use ureq::typestate::{WithBody, WithoutBody};

use crate::fleet::Endpoint;

/// An HTTP client for servers: one agent, and the servers' bearer token, which goes only to
/// an [`Endpoint`] that registered with the coordinator's own token. A caller names where
/// to call by the registry's endpoint, never by a bare URL, so no forged registration can
/// draw the token out.
#[derive(Clone)]
pub(crate) struct ServerClient {
    agent: ureq::Agent,
    authorization: Option<String>,
}

impl ServerClient {
    /// A client whose requests give up after `timeout`, sending `token` as a bearer token to
    /// trusted endpoints.
    pub(crate) fn new(timeout: Duration, token: Option<&str>) -> Self {
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .http_status_as_error(false)
            .build()
            .into();
        Self { agent, authorization: token.map(|t| format!("Bearer {t}")) }
    }

    fn auth<B>(&self, to: &Endpoint, r: RequestBuilder<B>) -> RequestBuilder<B> {
        match &self.authorization {
            Some(a) if to.trusted => r.header("Authorization", a),
            _ => r,
        }
    }

    /// `GET` of `path` (from `/`, query included) on `to`.
    pub(crate) fn get(&self, to: &Endpoint, path: &str) -> RequestBuilder<WithoutBody> {
        self.auth(to, self.agent.get(format!("{}{path}", to.base_url)))
    }

    /// `POST`.
    pub(crate) fn post(&self, to: &Endpoint, path: &str) -> RequestBuilder<WithBody> {
        self.auth(to, self.agent.post(format!("{}{path}", to.base_url)))
    }

    /// `DELETE`.
    pub(crate) fn delete(&self, to: &Endpoint, path: &str) -> RequestBuilder<WithoutBody> {
        self.auth(to, self.agent.delete(format!("{}{path}", to.base_url)))
    }
}

/// Sends one eviction pass's orders (fire and forget, as LMCache: the coordinator learns of
/// the deletes from the servers' events), in batches of 10,000 keys.
pub(crate) fn send_evictions(
    fleet: &crate::fleet::Fleet,
    orders: Vec<crate::fleet::EvictionOrder>,
) {
    let agent = ServerClient::new(
        std::time::Duration::from_secs(30),
        fleet.config().server_http_auth_token.as_deref(),
    );
    for o in orders {
        for batch in o.keys.chunks(10_000) {
            let body = serde_json::json!({"keys": batch, "tier": "l2", "force": false});
            match agent.delete(&o.endpoint, "/cache/objects").force_send_body().send_json(body) {
                Ok(r) if r.status().is_success() => {
                    fleet.metrics.evictions_requested.inc_by(batch.len() as u64);
                    tracing::info!(instance = %o.instance_id, keys = batch.len(), "fleet L2 eviction sent");
                }
                Ok(r) => {
                    tracing::warn!(instance = %o.instance_id, status = r.status().as_u16(), "fleet L2 eviction refused")
                }
                Err(e) => {
                    tracing::warn!(instance = %o.instance_id, error = %e, "fleet L2 eviction failed")
                }
            }
        }
    }
}
