//! Admitted batches and fences, handed to the vLLM KV-event publisher
//! ([`crate::vllm_events`]) when re-publishing is on.

use super::events::{EntryView, IncomingBatch};
use crate::vllm_events::{Outgoing, Publisher, VllmEvent, encode_batch};

use super::*;

impl Fleet {
    /// Installs the publisher's queue (the service's publisher thread reads it).
    pub(crate) fn set_vllm_publisher(&self, p: Publisher) {
        *self.vllm.lock() = Some(p);
    }

    /// Drops the publisher's queue: its thread sees it closed and ends.
    pub(crate) fn close_vllm_publisher(&self) {
        self.vllm.lock().take();
    }

    fn send_vllm(&self, o: Outgoing) {
        let guard = self.vllm.lock();
        let Some(p) = guard.as_ref() else { return };
        if p.send(o) {
            self.metrics.vllm_batches_queued.inc();
        } else if self.metrics.vllm_batches_dropped.inc() % 1000 == 0 {
            tracing::warn!("vLLM KV events: the publisher's queue is full; batches are dropped");
        }
    }

    /// An admitted store or delete of `b` at `tier`, re-published: one `KVEventBatch` per
    /// model the batch names, in the batch's order. Nothing is read of the batch while no
    /// publisher is installed.
    pub(super) fn publish_vllm<B: IncomingBatch>(&self, b: &B, tier: Tier, kind: EventKind) {
        if kind == EventKind::Access || self.vllm.lock().is_none() {
            return;
        }
        let medium = match tier {
            Tier::L1 => "CPU".to_string(),
            Tier::L2 => format!("L2:{}", b.backend()),
        };
        let all: Vec<EntryView<'_>> = b.entries().collect();
        let mut models: Vec<(&str, Vec<&EntryView<'_>>)> = Vec::new();
        for e in &all {
            match models.iter_mut().find(|(m, _)| *m == e.ns.model_name) {
                Some((_, v)) => v.push(e),
                None => models.push((e.ns.model_name, vec![e])),
            }
        }
        for (model, entries) in models {
            let events = match kind {
                EventKind::Store => stored_runs(&entries, &medium, self.config.chunk_size),
                _ => vec![VllmEvent::Removed { hashes: hashes(&entries), medium: medium.clone() }],
            };
            if events.is_empty() {
                continue;
            }
            self.send_vllm(Outgoing::Batch {
                instance: b.instance_id().to_string(),
                model: model.to_string(),
                payload: encode_batch(b.ts(), &events),
            });
        }
    }

    /// `id`'s placements were fenced: `AllBlocksCleared` on its topics.
    pub(super) fn publish_vllm_cleared(&self, id: &str) {
        if self.vllm.lock().is_some() {
            self.send_vllm(Outgoing::Cleared { instance: id.to_string() });
        }
    }
}

fn hashes(entries: &[&EntryView<'_>]) -> Vec<Vec<u8>> {
    entries.iter().filter_map(|e| e.hash.as_ref().ok()).map(|h| h.to_vec()).collect()
}

/// Stores as `BlockStored` events: one per run of chunks that follow each other (the next
/// starts at the token where the previous ended, both known), with the run's tokens when
/// every chunk of it carried them. A chunk without a token offset is a run of its own: vLLM's
/// consumers read `block_hashes` as a chain, and a chain we cannot vouch for is not sent.
fn stored_runs(entries: &[&EntryView<'_>], medium: &str, chunk_size: usize) -> Vec<VllmEvent> {
    let mut out = Vec::new();
    let mut run: Vec<&EntryView<'_>> = Vec::new();
    let flush = |run: &mut Vec<&EntryView<'_>>, out: &mut Vec<VllmEvent>| {
        if run.is_empty() {
            return;
        }
        let all_tokens = run.iter().all(|e| !e.token_ids.is_empty());
        let tokens: Vec<u32> = if all_tokens {
            run.iter().flat_map(|e| e.token_ids.iter().copied()).collect()
        } else {
            Vec::new()
        };
        let block_size = match run[0].token_ids.len() {
            0 => chunk_size,
            n => n,
        };
        out.push(VllmEvent::Stored {
            hashes: hashes(run),
            parent: None,
            tokens,
            block_size: u32::try_from(block_size).unwrap_or(u32::MAX),
            medium: medium.to_string(),
        });
        run.clear();
    };
    for &e in entries {
        if e.hash.is_err() {
            continue;
        }
        let follows = run.last().is_some_and(|p| {
            p.token_offset >= 0
                && !p.token_ids.is_empty()
                && e.token_offset == p.token_offset + p.token_ids.len() as i64
        });
        if !follows {
            flush(&mut run, &mut out);
        }
        run.push(e);
    }
    flush(&mut run, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(b: u8, offset: i64, tokens: &'static [u32]) -> EntryView<'static> {
        EntryView {
            ns: KeyNamespace {
                model_name: "m",
                kv_rank: 0x0100_0100,
                object_group_id: 0,
                cache_salt: "",
            },
            hash: Ok([b; 32]),
            size_bytes: 1,
            token_ids: tokens,
            token_offset: offset,
        }
    }

    #[test]
    fn consecutive_chunks_are_one_chain_and_the_rest_stand_alone() {
        let e = [
            entry(1, 0, &[1, 2]),
            entry(2, 2, &[3, 4]),
            entry(3, 6, &[5, 6]), // a hole before it: a new run
            entry(4, -1, &[]),    // offset unknown: alone
            entry(5, -1, &[]),
        ];
        let refs: Vec<&EntryView<'_>> = e.iter().collect();
        let runs = stored_runs(&refs, "CPU", 256);
        let got: Vec<(Vec<u8>, Vec<u32>, u32)> = runs
            .iter()
            .map(|r| match r {
                VllmEvent::Stored { hashes, tokens, block_size, .. } => {
                    (hashes.iter().map(|h| h[0]).collect(), tokens.clone(), *block_size)
                }
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (vec![1, 2], vec![1, 2, 3, 4], 2),
                (vec![3], vec![5, 6], 2),
                (vec![4], vec![], 256),
                (vec![5], vec![], 256),
            ]
        );
    }
}
