//! Where cache events come from. Exactly one source feeds the gate:
//!
//! - [`EventTransport::Http`]: servers `POST /events` (LMCache's default; not replayable, so
//!   losses are repaired from server snapshots);
//! - [`EventTransport::JetStream`]: servers publish each batch to NATS JetStream
//!   (`lmcache.cache_events.<instance>` in stream `LMCACHE_CACHE_EVENTS`); every coordinator
//!   replica reads the whole stream with its own ordered consumer, starting after the stream
//!   sequence its checkpoint holds, so a restarted replica resumes with nothing lost and
//!   replicas converge (compare `/directory/digest`). `POST /events` answers 404.
//!
//! A source is a [`CacheEventSource`]; Kafka (LMCache's other transport) would be one more.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use lmcache_protocol::coordinator::jetstream_subjects;
use lmcache_protocol::coordinator_borrowed::CacheEventBatchRef;

use crate::FleetError;
use crate::fleet::Fleet;

/// Where events arrive.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum EventTransport {
    /// `POST /events`.
    #[default]
    Http,
    /// A NATS JetStream stream.
    JetStream {
        /// `nats://host:port`.
        url: String,
        /// Stream name (default [`lmcache_protocol::coordinator::JETSTREAM_STREAM`]).
        stream: String,
    },
}

/// A source of cache-event batches that runs until told to stop.
pub trait CacheEventSource: Send + 'static {
    /// Feeds `fleet` until `stop` changes.
    fn run(
        self: Box<Self>,
        fleet: Arc<Fleet>,
        stop: tokio::sync::watch::Receiver<bool>,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>>;
}

/// Messages the consumer hands to the gate in one blocking hop at most.
const MAX_MESSAGES_PER_HOP: usize = 256;

/// Applies one JetStream message: lmcache-rs servers publish the binary layout; a JSON batch
/// (an older server, a hand-made one) is taken as well. A refused message is logged, counted
/// and skipped.
fn apply_message(fleet: &Fleet, seq: u64, payload: &[u8]) {
    let result = if payload.starts_with(lmcache_protocol::coordinator_binary::MAGIC) {
        fleet.ingest_binary(payload).map(drop)
    } else {
        match serde_json::from_slice::<CacheEventBatchRef<'_>>(payload) {
            Ok(batch) => fleet.ingest_borrowed(std::slice::from_ref(&batch)).map(drop),
            Err(e) => Err(FleetError::Invalid(format!("undecodable JSON batch: {e}"))),
        }
    };
    if let Err(e) = result {
        tracing::warn!(seq, error = %e, "refused a cache-event message from JetStream; skipped");
        fleet.metrics.invalid_requests.inc();
    }
}

/// The JetStream consumer.
#[derive(Debug, Clone)]
pub struct JetStreamSource {
    /// Server URL.
    pub url: String,
    /// Stream name.
    pub stream: String,
}

impl CacheEventSource for JetStreamSource {
    fn run(
        self: Box<Self>,
        fleet: Arc<Fleet>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            // Reconnect (from the last applied sequence) whenever the consumer ends or fails.
            loop {
                tokio::select! {
                    r = consume(&self, &fleet) => {
                        if let Err(e) = r {
                            tracing::warn!(url = %self.url, stream = %self.stream, error = %e, "JetStream consumer stopped; retrying");
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
        })
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Creates the stream when missing (the same settings every party uses).
pub async fn ensure_stream(
    js: &async_nats::jetstream::Context,
    name: &str,
) -> Result<async_nats::jetstream::stream::Stream, BoxError> {
    let config = async_nats::jetstream::stream::Config {
        name: name.to_string(),
        subjects: vec![jetstream_subjects(name)],
        storage: async_nats::jetstream::stream::StorageType::File,
        ..Default::default()
    };
    Ok(js.get_or_create_stream(config).await?)
}

async fn consume(src: &JetStreamSource, fleet: &Arc<Fleet>) -> Result<(), BoxError> {
    let client = async_nats::connect(&src.url).await?;
    let js = async_nats::jetstream::new(client);
    let stream = ensure_stream(&js, &src.stream).await?;
    let start = fleet.stream_position() + 1;
    let deliver_policy = if start > 1 {
        async_nats::jetstream::consumer::DeliverPolicy::ByStartSequence { start_sequence: start }
    } else {
        async_nats::jetstream::consumer::DeliverPolicy::All
    };
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
            deliver_policy,
            ..Default::default()
        })
        .await?;
    tracing::info!(url = %src.url, stream = %src.stream, from = start, "consuming cache events from JetStream");
    // Every message already delivered goes to the gate in one blocking hop (a hop per
    // message cost more than applying its 64 events), in stream order.
    let mut messages = consumer.messages().await?.ready_chunks(MAX_MESSAGES_PER_HOP);
    while let Some(chunk) = messages.next().await {
        let mut got = Vec::with_capacity(chunk.len());
        for msg in chunk {
            let msg = msg?;
            let seq = msg.info()?.stream_sequence;
            got.push((seq, msg.payload.clone()));
        }
        let f = Arc::clone(fleet);
        tokio::task::spawn_blocking(move || {
            for (seq, payload) in got {
                apply_message(&f, seq, &payload);
                f.set_stream_position(seq);
            }
        })
        .await?;
    }
    Ok(())
}
