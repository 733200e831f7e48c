//! The calls the coordinator makes to registered servers' HTTP APIs (snapshot pages for
//! repairs, prefetch and delete relays, fleet eviction orders), with the servers' bearer
//! token when they run with `--http-auth-token`.

use std::time::Duration;

use ureq::RequestBuilder;
use ureq::typestate::{WithBody, WithoutBody};

/// An HTTP client for servers: one agent, and the `Authorization` every request carries.
#[derive(Clone)]
pub(crate) struct ServerClient {
    agent: ureq::Agent,
    authorization: Option<String>,
}

impl ServerClient {
    /// A client whose requests give up after `timeout`, sending `token` as a bearer token.
    pub(crate) fn new(timeout: Duration, token: Option<&str>) -> Self {
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .http_status_as_error(false)
            .build()
            .into();
        Self { agent, authorization: token.map(|t| format!("Bearer {t}")) }
    }

    fn auth<B>(&self, r: RequestBuilder<B>) -> RequestBuilder<B> {
        match &self.authorization {
            Some(a) => r.header("Authorization", a),
            None => r,
        }
    }

    pub(crate) fn get(&self, url: &str) -> RequestBuilder<WithoutBody> {
        self.auth(self.agent.get(url))
    }

    pub(crate) fn post(&self, url: &str) -> RequestBuilder<WithBody> {
        self.auth(self.agent.post(url))
    }

    pub(crate) fn delete(&self, url: &str) -> RequestBuilder<WithoutBody> {
        self.auth(self.agent.delete(url))
    }
}
