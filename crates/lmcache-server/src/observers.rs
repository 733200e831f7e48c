//! The side channels, as subscribers of storage's events ([`lmcache_storage::StorageEvent`]):
//! the handlers call storage and nothing else, and what a request did reaches the metrics,
//! the event bus, the KV event log, the coordinator reporter, the storage trace and the
//! lookup-hash log from here. Each runs on the request's thread and never blocks: counters,
//! non-blocking queues.
//!
//! L1 removals and L2 events come through storage's other observers
//! ([`crate::event_bus::TierEvents`], [`crate::event_bus::L1Events`]).

use std::sync::Arc;

use lmcache_storage::{RequestContext, StorageEvent, StorageSubscriber};

use crate::event_bus::{Event, Publisher};
use crate::metrics::Metrics;

/// The request counters and hit, copy and throughput figures.
#[derive(Debug)]
pub struct MetricsSubscriber {
    /// The server's metrics.
    pub metrics: Arc<Metrics>,
    /// Tokens per chunk.
    pub chunk_size: usize,
}

impl StorageSubscriber for MetricsSubscriber {
    fn on_event(&self, event: &StorageEvent<'_>) {
        let m = &self.metrics;
        let c = self.chunk_size as u64;
        match event {
            StorageEvent::LookupAsked { chunks, .. } => {
                m.lookups.inc();
                m.lookup_requested_tokens.inc_by(*chunks as u64 * c);
            }
            StorageEvent::LookedUp { shards, l1_hits, .. } => {
                let tokens = *l1_hits as u64 * c;
                m.lookup_hit_tokens.inc_by(tokens);
                m.lookup_hit_l1_tokens.inc_by(tokens);
                m.lookup_hit_l1_keys.inc_by((*l1_hits * *shards) as u64);
            }
            StorageEvent::LookupSettled { settled, .. } => {
                m.lookup_hit_tokens.inc_by(settled.l2_hits as u64 * c);
                m.lookup_hit_l2_tokens.inc_by(settled.l2_hits as u64 * c);
                m.lookup_hit_l2_keys.inc_by(settled.loaded_keys as u64);
            }
            StorageEvent::StoreStarted { .. } => {
                m.submitted_stores.inc();
            }
            StorageEvent::Committed { results, .. } => {
                m.l1_write_chunks.inc_by(results.iter().filter(|r| r.is_ok()).count() as u64);
            }
            StorageEvent::StoreFinished { bytes, copy_time, .. } => {
                m.finished_stores.inc();
                if let Some(t) = copy_time {
                    Metrics::copy_throughput(&m.store_throughput, *bytes, t.as_secs_f64());
                }
            }
            StorageEvent::RetrieveStarted { .. } => {
                m.submitted_retrieves.inc();
            }
            StorageEvent::RetrieveFinished { chunks, bytes, copy_time, .. } => {
                m.l1_read_chunks.inc_by(*chunks as u64);
                m.chunks_loaded.inc_by(*chunks as u64);
                m.finished_retrieves.inc();
                if let Some(t) = copy_time {
                    Metrics::copy_throughput(&m.load_throughput, *bytes, t.as_secs_f64());
                }
            }
            StorageEvent::PeerLocked { keys, found } => {
                m.p2p_served_keys.inc_by(*keys as u64);
                m.p2p_served_hits.inc_by(*found as u64);
            }
            StorageEvent::PeerFetched { keys, bytes, failed, same_host } => {
                m.p2p_fetched_keys.inc_by(*keys as u64);
                m.p2p_fetched_same_host_keys.inc_by(*same_host as u64);
                m.p2p_fetched_bytes.inc_by(*bytes);
                m.p2p_fetch_failures.inc_by(*failed as u64);
            }
            StorageEvent::PeerUnlocked { released, expired } => {
                m.p2p_unlocked_keys.inc_by(*released as u64);
                m.p2p_unlock_expired.inc_by(*expired as u64);
            }
            _ => {}
        }
    }
}

/// A request's milestones as [`Event`]s on the bus (logging subscribers).
#[derive(Debug)]
pub struct BusSubscriber(pub Publisher);

impl StorageSubscriber for BusSubscriber {
    fn on_event(&self, event: &StorageEvent<'_>) {
        let e = match event {
            StorageEvent::LookedUp { ctx, l1_hits, pending: false, .. } => Event::Lookup {
                request_id: ctx.request_id.to_owned(),
                chunks: ctx.hashes.len(),
                hits: *l1_hits,
            },
            StorageEvent::LookupSettled { ctx, chunks, settled } => Event::Lookup {
                request_id: ctx.request_id.to_owned(),
                chunks: *chunks,
                hits: settled.hits,
            },
            StorageEvent::WriteRefused { ctx, error, .. } => Event::L1WriteRefused {
                request_id: ctx.request_id.to_owned(),
                reason: error.to_string(),
            },
            StorageEvent::StoreFinished { ctx, committed, bytes, .. } => Event::Stored {
                request_id: ctx.request_id.to_owned(),
                chunks: committed.len(),
                bytes: *bytes,
            },
            StorageEvent::RetrieveFinished { request_id, chunks, .. } => {
                Event::Retrieved { request_id: (*request_id).to_owned(), chunks: *chunks }
            }
            StorageEvent::SessionEnded { request_id, .. } => {
                Event::SessionEnded { request_id: (*request_id).to_owned() }
            }
            _ => return,
        };
        self.0.publish(e);
    }
}

/// The chunks of the range an event made resident in L1 (indexes into `ctx.hashes`): those a
/// store committed, or those a lookup's prefetch brought in from L2 or the fleet's peers
/// (P2P), which a router should see on this server like any store.
fn made_resident<'e>(
    event: &'e StorageEvent<'_>,
) -> Option<(&'e RequestContext<'e>, impl Iterator<Item = usize> + 'e)> {
    let (ctx, listed, range): (_, &[usize], _) = match event {
        StorageEvent::StoreFinished { ctx, committed, .. } => (ctx, committed, 0..0),
        StorageEvent::LookupSettled { ctx, settled, .. } if settled.l2_hits > 0 => {
            (ctx, &[], settled.hits - settled.l2_hits..settled.hits)
        }
        _ => return None,
    };
    Some((*ctx, listed.iter().copied().chain(range)))
}

/// Chunks of shard 0 newly resident in L1 (stored, or brought in by a lookup from L2 or a
/// peer) as KV events (`subscribe_kv_events`), with their tokens and parent hash.
#[derive(Debug)]
pub struct KvEventsSubscriber(pub Arc<crate::kv_events::KvEventLog>);

impl StorageSubscriber for KvEventsSubscriber {
    fn on_event(&self, event: &StorageEvent<'_>) {
        let Some((ctx, chunks)) = made_resident(event) else { return };
        if ctx.shard != 0 || !self.0.enabled() {
            return;
        }
        for j in chunks {
            if let (Some(h), Some(tokens)) = (ctx.hashes.get(j), ctx.chunk_tokens(j)) {
                self.0.stored(ctx.model.as_str(), *h, ctx.parent_of(j), tokens);
            }
        }
    }
}

/// Chunks newly resident in an L1 that restarts warm: their tokens, for the next start to
/// announce ([`crate::chunk_tokens_file`]).
#[derive(Debug)]
pub struct ChunkTokensSubscriber {
    /// The file.
    pub file: Arc<crate::chunk_tokens_file::ChunkTokensFile>,
    /// The L1 whose resident chunks a compaction keeps.
    pub l1: lmcache_l1::L1Cache,
}

impl StorageSubscriber for ChunkTokensSubscriber {
    fn on_event(&self, event: &StorageEvent<'_>) {
        let Some((ctx, chunks)) = made_resident(event) else { return };
        let chunks = chunks.filter_map(|j| {
            Some(crate::chunk_tokens_file::ChunkTokens {
                model: ctx.model.as_str().to_owned(),
                hash: *ctx.hashes.get(j)?,
                parent: ctx.parent_of(j),
                position: ((ctx.first_chunk + j) * ctx.chunk_size) as u64,
                tokens: ctx.chunk_tokens(j)?.to_vec(),
            })
        });
        self.file.record(chunks, || {
            let keys = self.l1.resident_keys().into_iter();
            keys.map(|(k, _)| (k.model_name.as_str().to_owned(), k.chunk_hash)).collect()
        });
    }
}

/// What the coordinator hears of requests: the tokens behind stored hashes (for its
/// routing by tokens) and the keys a finished request used.
#[derive(Debug)]
pub struct ReporterSubscriber(pub Arc<crate::fleet_report::Reporter>);

impl StorageSubscriber for ReporterSubscriber {
    fn on_event(&self, event: &StorageEvent<'_>) {
        match event {
            StorageEvent::SessionEnded { touched, .. } => self.0.l1_accessed(touched),
            _ => {
                let Some((ctx, chunks)) = made_resident(event) else { return };
                for j in chunks {
                    if let (Some(h), Some(tokens)) = (ctx.hashes.get(j), ctx.chunk_tokens(j)) {
                        self.0.bind_tokens(h, tokens, (ctx.first_chunk + j) * ctx.chunk_size);
                    }
                }
            }
        }
    }
}

/// `--trace-level storage`: the storage calls a request makes, as LMCache's storage manager
/// names them ([`crate::trace_record`]).
#[derive(Debug)]
pub struct TraceSubscriber(pub Arc<crate::trace_record::TraceRecorder>);

impl StorageSubscriber for TraceSubscriber {
    fn on_event(&self, event: &StorageEvent<'_>) {
        let t = &self.0;
        match event {
            // LMCache's submit_prefetch_task: one key group per object group, each listing
            // every shard's keys.
            StorageEvent::LookupStarted { ctx, request } => {
                let groups = request
                    .groups
                    .iter()
                    .enumerate()
                    .map(|(og, (_, shards))| {
                        let keys = shards.iter().flat_map(|(_, ks)| ks.iter().cloned()).collect();
                        crate::trace_record::key_group(og as u32, keys, ctx.objects.get(og))
                    })
                    .collect();
                t.submit_prefetch(ctx.request_id, groups, request.readers);
            }
            StorageEvent::WriteReserving { ctx, object_group, keys } => {
                t.reserve_write(keys, ctx.objects.get(*object_group as usize));
            }
            StorageEvent::Committed { keys, .. } => t.finish_write(keys),
            StorageEvent::ReadLeased { keys, .. } => t.finish_read(keys, 1),
            _ => {}
        }
    }
}

/// `--lookup-hash-log-dir`: one line per lookup, in LMCache's format.
#[derive(Debug)]
pub struct LookupLogSubscriber(pub Arc<crate::lookup_log::LookupHashLog>);

impl StorageSubscriber for LookupLogSubscriber {
    fn on_event(&self, event: &StorageEvent<'_>) {
        let StorageEvent::LookupStarted { ctx, .. } = event else { return };
        let layout = crate::trace_record::layout_desc(ctx.objects.first());
        self.0.record(crate::lookup_log::LookupLine {
            timestamp: crate::lookup_log::now_unix(),
            request_id: ctx.request_id.to_owned(),
            model_name: ctx.model.to_string(),
            chunk_size: ctx.chunk_size,
            seq_len: ctx.tokens.len(),
            dtypes: layout.dtypes,
            shapes: layout.shapes,
            chunk_hashes: ctx.hashes.iter().map(|h| format!("0x{}", h.to_hex())).collect(),
        });
    }
}
