//! Registry and metadata changes sent to the other replicas and applied from them
//! ([`crate::replication`] carries them over NATS).

use crate::replication::Change;

use super::*;

fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl Fleet {
    /// Installs the replication queue (the service's replication task reads it).
    pub(crate) fn set_replicator(&self, tx: tokio::sync::mpsc::UnboundedSender<Change>) {
        *self.replicate.lock() = Some(tx);
    }

    /// This replica's id in replicated records.
    pub(crate) fn replica_id(&self) -> u64 {
        self.replica_id
    }

    /// Sends `c` to the other replicas (nothing without replication).
    pub(super) fn replicate(&self, c: Change) {
        if let Some(tx) = self.replicate.lock().as_ref() {
            let _ = tx.send(c);
        }
    }

    /// `id` registered or sent a heartbeat here.
    pub(super) fn replicate_instance(&self, id: &str) {
        if self.replicate.lock().is_none() {
            return;
        }
        if let Some(info) = self.registry.info(id) {
            self.replicate(Change::Instance { info, heartbeat_ms: wall_ms() });
        }
    }

    /// Applies a change another replica made.
    pub(crate) fn apply_replicated(&self, c: Change) {
        match c {
            Change::Instance { info, heartbeat_ms } => {
                let silent = Duration::from_millis(wall_ms().saturating_sub(heartbeat_ms));
                let now = Instant::now();
                let at = now.checked_sub(silent).unwrap_or(now);
                let id = info.instance_id.clone();
                if self.registry.adopt(info, at) {
                    tracing::info!(instance = %id, "instance registered at another replica");
                }
            }
            Change::Gone { id } => {
                if self.registry.remove(&id) {
                    tracing::info!(instance = %id, "instance dropped at another replica");
                    self.drop_instance(&id);
                    self.views.lock().declarations.remove(&id);
                }
            }
            Change::Metadata { doc } => match crate::control::Control::from_metadata(&doc) {
                Ok(c) => {
                    *self.control.lock() = c;
                    if let Some(path) = &self.config.metadata_path {
                        let bytes = serde_json::to_vec_pretty(&doc).unwrap_or_default();
                        if let Err(e) = crate::checkpoint::write_atomic(path, &bytes) {
                            tracing::warn!(path = %path.display(), error = %e,
                                "could not save the replicated metadata document");
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "a replicated metadata document was refused");
                    self.metrics.invalid_requests.inc();
                }
            },
        }
    }
}
