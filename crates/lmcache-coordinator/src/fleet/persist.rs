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

/// (tier, backend, shared, capacity) of one declared compartment.
type SavedCompartment = (WireTier, String, bool, u64);

impl Fleet {
    /// The checkpoint of this state (see [`crate::checkpoint`]). The directory is encoded
    /// under the views lock, so it is one consistent moment of the event streams.
    pub(crate) fn checkpoint(&self) -> Vec<u8> {
        let registry = self.instances();
        let mut image = Vec::new();
        let (cursors, declarations, position) = {
            let v = self.views.lock();
            // Read under the views lock: the image and the position are one moment.
            let position = self.stream_position();
            v.dir.encode(&mut image);
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
            (cursors, declarations, position)
        };
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
