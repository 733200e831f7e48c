//! The instance registry: registration, heartbeats, deregistration, the health sweep.

use super::*;

impl Fleet {
    // ---- registry -------------------------------------------------------------------------

    /// `POST /instances`.
    pub fn register(&self, mut req: RegisterRequest) -> Result<RegisterResponse, FleetError> {
        req.validate().map_err(FleetError::Invalid)?;
        let instance_id =
            if req.instance_id.is_empty() { fresh_instance_id() } else { req.instance_id.clone() };
        let info = InstanceInfo {
            instance_id: instance_id.clone(),
            ip: req.ip,
            http_port: req.http_port,
            registration_time: wall_clock(),
            metadata: req.metadata,
            p2p_advertised_url: req.p2p_advertised_url,
            mq_port: req.mq_port,
        };
        let re_registered = self
            .registry
            .lock()
            .insert(instance_id.clone(), Registration { info, last_heartbeat: Instant::now() })
            .is_some();
        tracing::info!(instance = %instance_id, re_registered, "instance registered");
        self.metrics.registrations.inc();
        Ok(RegisterResponse { instance_id, re_registered })
    }

    /// `PUT /instances/{id}/heartbeat`: false when the instance is unknown.
    pub(crate) fn heartbeat(&self, id: &str) -> bool {
        match self.registry.lock().get_mut(id) {
            Some(r) => {
                r.last_heartbeat = Instant::now();
                true
            }
            None => false,
        }
    }

    /// `DELETE /instances/{id}`: forgets it, fences its L1 placements and its stream, and its
    /// capacity declaration. Idempotent.
    pub(crate) fn deregister(&self, id: &str) {
        let known = self.registry.lock().remove(id).is_some();
        tracing::info!(instance = %id, known, "instance deregistered");
        self.drop_instance(id);
        self.views.lock().declarations.remove(id);
    }

    /// Registered instances, in registration order.
    pub fn instances(&self) -> Vec<InstanceInfo> {
        let mut v: Vec<InstanceInfo> =
            self.registry.lock().values().map(|r| r.info.clone()).collect();
        v.sort_by(|a, b| {
            a.registration_time
                .total_cmp(&b.registration_time)
                .then(a.instance_id.cmp(&b.instance_id))
        });
        v
    }

    /// Drops instances silent for longer than the instance timeout (their L1 placements and
    /// stream cursor go; capacity declarations stay, as in LMCache). Returns their ids.
    pub(crate) fn sweep(&self, now: Instant) -> Vec<String> {
        let timeout = self.config.instance_timeout;
        let dead: Vec<String> = {
            let mut reg = self.registry.lock();
            let dead: Vec<String> = reg
                .iter()
                .filter(|(_, r)| now.saturating_duration_since(r.last_heartbeat) > timeout)
                .map(|(id, _)| id.clone())
                .collect();
            for id in &dead {
                reg.remove(id);
            }
            dead
        };
        for id in &dead {
            tracing::warn!(instance = %id, timeout_s = timeout.as_secs_f64(), "instance missed its heartbeats; dropped");
            self.metrics.expired_instances.inc();
            self.drop_instance(id);
        }
        dead
    }

    fn drop_instance(&self, id: &str) {
        let mut v = self.views.lock();
        self.fence(&mut v, id);
        v.cursors.remove(id);
        v.repairs.remove(id);
    }

    /// Drops `id`'s L1 placements, counted; returns how many.
    pub(super) fn fence(&self, v: &mut Views, id: &str) -> u64 {
        let n = v.dir.find_instance(id).map_or(0, |inst| v.dir.fence_l1(inst));
        self.metrics.fenced_placements.inc_by(n);
        n
    }
}
