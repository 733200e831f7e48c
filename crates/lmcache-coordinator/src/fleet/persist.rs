//! The fleet's checkpoint image (its framing and file are [`crate::checkpoint`]'s) and the
//! restore from it.

use super::*;

/// The checkpoint's JSON header: everything but the directory image.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct CheckpointHeader {
    registry: Vec<InstanceInfo>,
    /// (instance, incarnation, last seq, missing batches)
    cursors: Vec<(String, u64, u64, u64)>,
    /// (instance, incarnation, revision, [(tier, backend, shared, capacity)])
    declarations: Vec<(String, u64, u64, Vec<SavedCompartment>)>,
    /// The last JetStream sequence applied (0 with HTTP).
    #[serde(default)]
    stream_position: u64,
}

/// Keys a checkpoint saves per hold of the views lock (a few milliseconds at most).
pub(crate) const CHECKPOINT_STEP_SLOTS: usize = 16_384;

/// (tier, backend, shared, capacity) of one declared compartment.
type SavedCompartment = (WireTier, String, bool, u64);

impl Fleet {
    /// The checkpoint of this state (see [`crate::checkpoint`]).
    ///
    /// Ingest is not paused for it: the directory is saved in steps of
    /// [`CHECKPOINT_STEP_SLOTS`] keys, the views lock released between them
    /// ([`lmcache_directory::ImageBuilder`]). The stream position and the cursors are taken
    /// when it starts, so what changed during the save comes back after a restore: replayed
    /// from the stream with JetStream, resynced as a gap over HTTP.
    pub(crate) fn checkpoint(&self) -> Vec<u8> {
        let registry = self.instances();
        let (mut builder, cursors, declarations, position) = {
            let mut v = self.views.lock();
            let position = self.stream_position();
            let builder = v.dir.image_builder();
            let cursors = v
                .cursors
                .iter()
                .map(|(id, c)| (id.clone(), c.incarnation, c.last_seq, c.missing))
                .collect();
            let declarations = v
                .declarations
                .iter()
                .map(|(id, d)| {
                    let comps = d
                        .compartments
                        .iter()
                        .map(|((t, b, s), c)| (wire_tier(*t), b.clone(), *s, *c))
                        .collect();
                    (id.clone(), d.stamp.0, d.stamp.1, comps)
                })
                .collect();
            (builder, cursors, declarations, position)
        };
        while !self.views.lock().dir.image_step(&mut builder, CHECKPOINT_STEP_SLOTS) {
            // The lock is free here: batches waiting for it apply between steps.
            std::thread::yield_now();
        }
        let parts = self.views.lock().dir.image_finish(builder);
        // Outside the lock: copying the saved keys into one buffer takes a while.
        let image = parts.concat();
        let header =
            CheckpointHeader { registry, cursors, declarations, stream_position: position };
        let header = serde_json::to_vec(&header).unwrap_or_default();
        crate::checkpoint::frame(&header, &image)
    }

    /// Replaces this (fresh) state with a checkpoint's. Registered instances count as having
    /// just sent a heartbeat; a gap open at checkpoint time shows up again with the next batch.
    pub(crate) fn restore(
        &self,
        bytes: &[u8],
    ) -> Result<RestoreStats, crate::checkpoint::CheckpointError> {
        use crate::checkpoint::CheckpointError::Corrupt;
        let (header, image) = crate::checkpoint::unframe(bytes)?;
        let h: CheckpointHeader =
            serde_json::from_slice(header).map_err(|e| Corrupt(format!("header: {e}")))?;
        let dir = Directory::decode(image, self.config.directory())
            .map_err(|e| Corrupt(format!("directory: {e}")))?;
        let now = Instant::now();
        let stats = RestoreStats {
            instances: h.registry.len(),
            keys: dir.stats().keys,
            placements: dir.stats().l1.count + dir.stats().l2.count,
        };
        {
            let mut v = self.views.lock();
            v.dir = dir;
            v.repairs.clear();
            v.cursors = h
                .cursors
                .into_iter()
                .map(|(id, incarnation, last_seq, missing)| {
                    let c = Cursor {
                        incarnation,
                        last_seq,
                        missing,
                        gap: false,
                        last_admitted: now,
                        repairs: 0,
                        last_repair: None,
                    };
                    (id, c)
                })
                .collect();
            v.declarations = h
                .declarations
                .into_iter()
                .map(|(id, inc, rev, comps)| {
                    let compartments = comps
                        .into_iter()
                        .filter_map(|(t, b, s, c)| Some(((tier_of(t)?, b, s), c)))
                        .collect();
                    (id, Declaration { stamp: (inc, rev), compartments })
                })
                .collect();
        }
        self.set_stream_position(h.stream_position);
        self.registry.replace(h.registry, now);
        Ok(stats)
    }
}

/// What a restore brought back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestoreStats {
    /// Registered instances.
    pub instances: usize,
    /// Keys.
    pub keys: u64,
    /// Placements.
    pub placements: u64,
}

#[cfg(test)]
mod tests {
    use super::super::test_batches::{key, l1_store};
    use super::*;
    use lmcache_protocol::coordinator::EncodedObjectKey;

    fn batch(seq: u64, from: u32, n: u32) -> CacheEventBatch {
        l1_store(seq, (from..from + n).map(|i| key(format!("{i:064x}"), "m", "")))
    }

    /// A checkpoint of several steps taken while batches keep arriving restores every key
    /// stored before it began, and the cursor it saved is the one from its start.
    #[test]
    fn a_checkpoint_in_steps_beside_ingest_restores_what_came_before() {
        let f = Arc::new(Fleet::new(CoordinatorConfig::default()).unwrap());
        let before = 3 * CHECKPOINT_STEP_SLOTS as u32 + 1000;
        let mut seq = 0;
        for from in (0..before).step_by(1000) {
            seq += 1;
            f.ingest(&[batch(seq, from, 1000)]).unwrap();
        }
        let writer = {
            let f = f.clone();
            std::thread::spawn(move || {
                for i in 0..200u32 {
                    f.ingest(&[batch(seq + 1 + u64::from(i), before + i * 10, 10)]).unwrap();
                }
            })
        };
        let image = f.checkpoint();
        writer.join().unwrap();
        let g = Fleet::new(CoordinatorConfig::default()).unwrap();
        let stats = g.restore(&image).unwrap();
        assert!(stats.keys >= u64::from(before), "{stats:?}");
        let asked: Vec<EncodedObjectKey> =
            (0..before).step_by(997).map(|i| batch(0, i, 1).entries[0].key.clone()).collect();
        let found = g.lookup(asked).unwrap();
        assert!(found.iter().all(|r| !r.placements.is_empty()), "a key stored before is missing");
        let v = g.views.lock();
        assert!(v.cursors["s"].last_seq >= seq, "the cursor saved is no older than the start");
    }
}
