//! The registry and the operator's intent, replicated between coordinator replicas that read
//! one JetStream cache-event stream (`--event-transport jetstream`). The directory converges
//! from the stream itself; this carries what the stream does not: registrations and
//! heartbeats (which arrive over HTTP at one replica), deregistrations and expiries, and the
//! metadata document (quotas and pins).
//!
//! Each replica writes what happens at it to the JetStream stream `<stream>_REGISTRY`, used
//! as a key-value bucket: one subject per key (`<bucket>.instance.<hex of its id>`,
//! `<bucket>.metadata`), the last message of each kept. It reads the stream from each key's
//! last value, then every change, applying what other replicas wrote. So a replica that takes over answers `/instances`, `/quota` and the
//! pins like the one it replaces, and one started later learns them at once.
//!
//! Trust does not travel: an instance registered with the coordinator's token at one replica
//! is untrusted at the others until it registers with them itself (as a checkpoint restore
//! treats it; a NATS record is not a credential). A heartbeat carries the sender's wall clock;
//! the receiving replica counts silence from there, so replicas expire an instance at about
//! the same moment.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use lmcache_protocol::coordinator::InstanceInfo;
use serde::{Deserialize, Serialize};

use crate::fleet::Fleet;

/// One replicated change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Change {
    /// `info` is registered; its last heartbeat was at `heartbeat_ms` (Unix milliseconds).
    Instance {
        /// The registration.
        info: InstanceInfo,
        /// The last heartbeat, wall clock.
        heartbeat_ms: u64,
    },
    /// Instance `id` deregistered or expired.
    Gone {
        /// The instance.
        id: String,
    },
    /// The metadata document (quotas and pins) as it now is.
    Metadata {
        /// LMCache's JSON shape.
        doc: serde_json::Value,
    },
}

impl Change {
    /// The bucket key this change is kept under.
    fn key(&self) -> String {
        match self {
            Change::Instance { info, .. } => format!("instance.{}", hex::encode(&info.instance_id)),
            Change::Gone { id } => format!("instance.{}", hex::encode(id)),
            Change::Metadata { .. } => "metadata".into(),
        }
    }
}

/// A change as stored: which replica made it.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    origin: u64,
    #[serde(flatten)]
    change: Change,
}

/// The bucket of stream `stream`.
pub fn bucket_name(stream: &str) -> String {
    format!("{stream}_REGISTRY")
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Writes `rx`'s changes and applies other replicas' until `stop` changes; reconnects after
/// any failure (changes made meanwhile wait in the channel).
pub(crate) async fn run(
    url: String,
    stream: String,
    fleet: Arc<Fleet>,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Change>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let origin = fleet.replica_id();
    loop {
        tokio::select! {
            r = session(&url, &stream, &fleet, &mut rx, origin) => {
                if let Err(e) = r {
                    tracing::warn!(url = %url, bucket = %bucket_name(&stream), error = %e,
                        "registry replication stopped; retrying");
                    fleet.metrics.transport_errors.inc();
                }
            }
            _ = stop.changed() => return,
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = stop.changed() => return,
        }
    }
}

async fn session(
    url: &str,
    stream: &str,
    fleet: &Arc<Fleet>,
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Change>,
    origin: u64,
) -> Result<(), BoxError> {
    let js = async_nats::jetstream::new(async_nats::connect(url).await?);
    let bucket = bucket_name(stream);
    // A key-value bucket on a plain stream: one subject per key, the last message of each
    // kept (what NATS's KV API builds too, without needing its newer server features).
    let config = async_nats::jetstream::stream::Config {
        name: bucket.clone(),
        subjects: vec![format!("{bucket}.>")],
        max_messages_per_subject: 1,
        storage: async_nats::jetstream::stream::StorageType::File,
        ..Default::default()
    };
    let st = js.get_or_create_stream(config).await?;
    let consumer = st
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
            deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::LastPerSubject,
            filter_subject: format!("{bucket}.>"),
            ..Default::default()
        })
        .await?;
    let mut watch = consumer.messages().await?;
    tracing::info!(url, bucket = %bucket, "replicating the registry");
    loop {
        tokio::select! {
            change = rx.recv() => {
                let Some(change) = change else { return Ok(()) };
                let subject = format!("{bucket}.{}", change.key());
                let body = serde_json::to_vec(&Record { origin, change })?;
                js.publish(subject, body.into()).await?.await?;
            }
            msg = watch.next() => {
                let Some(msg) = msg else { return Err("the registry stream's consumer ended".into()) };
                let msg = msg?;
                match serde_json::from_slice::<Record>(&msg.payload) {
                    Ok(r) if r.origin == origin => {}
                    Ok(r) => {
                        let f = Arc::clone(fleet);
                        tokio::task::spawn_blocking(move || f.apply_replicated(r.change)).await?;
                    }
                    Err(e) => {
                        tracing::warn!(subject = %msg.subject, error = %e, "an undecodable registry record; skipped");
                        fleet.metrics.invalid_requests.inc();
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_have_one_key_per_instance_and_round_trip() {
        let info = InstanceInfo {
            instance_id: "a b/c".into(),
            ip: "127.0.0.1".into(),
            http_port: 1,
            registration_time: 1.0,
            metadata: Default::default(),
            p2p_advertised_url: String::new(),
            mq_port: 0,
        };
        let up = Change::Instance { info, heartbeat_ms: 5 };
        let gone = Change::Gone { id: "a b/c".into() };
        assert_eq!(up.key(), gone.key(), "a deregistration replaces the registration's record");
        assert_eq!(up.key(), format!("instance.{}", hex::encode("a b/c")));
        for c in [up, gone, Change::Metadata { doc: serde_json::json!({"components": {}}) }] {
            let bytes = serde_json::to_vec(&Record { origin: 7, change: c.clone() }).unwrap();
            let back: Record = serde_json::from_slice(&bytes).unwrap();
            assert_eq!((back.origin, back.change), (7, c));
        }
    }
}
