//! The instance registry: registration, heartbeats, deregistration, the health sweep.
//! [`Instances`] is the table (its own lock, a small surface); `Fleet`'s methods here add
//! what registration means to the rest of the state (fencing, metrics).

use super::*;

/// The registered instances, by id. Never held while taking the views lock, nor the other
/// way round.
#[derive(Debug, Default)]
pub(crate) struct Instances(Mutex<HashMap<String, Registration>>);

impl Instances {
    /// Records `info` as registered now; true when it replaced a registration.
    fn insert(&self, info: InstanceInfo, now: Instant, trusted: bool) -> bool {
        let id = info.instance_id.clone();
        self.0.lock().insert(id, Registration { info, last_heartbeat: now, trusted }).is_some()
    }

    /// Takes another replica's registration of `info`, heard from at `at`: a newer
    /// registration replaces this one untrusted, the same one only moves its heartbeat
    /// forward, an older one is ignored. True when it was not registered here.
    pub(super) fn adopt(&self, info: InstanceInfo, at: Instant) -> bool {
        let mut reg = self.0.lock();
        match reg.get_mut(&info.instance_id) {
            Some(r) if r.info.registration_time > info.registration_time => false,
            Some(r) if r.info.registration_time == info.registration_time && r.info == info => {
                r.last_heartbeat = r.last_heartbeat.max(at);
                false
            }
            _ => {
                let id = info.instance_id.clone();
                reg.insert(id, Registration { info, last_heartbeat: at, trusted: false }).is_none()
            }
        }
    }

    /// A heartbeat of `id`; false when it is not registered.
    fn beat(&self, id: &str, now: Instant) -> bool {
        self.0.lock().get_mut(id).map(|r| r.last_heartbeat = now).is_some()
    }

    /// Forgets `id`; true when it was registered.
    pub(super) fn remove(&self, id: &str) -> bool {
        self.0.lock().remove(id).is_some()
    }

    /// Removes and returns the instances silent for longer than `timeout` at `now`.
    fn expire(&self, now: Instant, timeout: Duration) -> Vec<String> {
        let mut reg = self.0.lock();
        let dead: Vec<String> = reg
            .iter()
            .filter(|(_, r)| now.saturating_duration_since(r.last_heartbeat) > timeout)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &dead {
            reg.remove(id);
        }
        dead
    }

    /// Registered instances, in registration order.
    /// Each instance's id and the time since its last heartbeat (or registration).
    fn ages(&self, now: Instant) -> Vec<(String, Duration)> {
        let mut v: Vec<(String, Duration)> = self
            .0
            .lock()
            .iter()
            .map(|(id, r)| (id.clone(), now.saturating_duration_since(r.last_heartbeat)))
            .collect();
        v.sort();
        v
    }

    pub(crate) fn infos(&self) -> Vec<InstanceInfo> {
        let mut v: Vec<InstanceInfo> = self.0.lock().values().map(|r| r.info.clone()).collect();
        v.sort_by(|a, b| {
            a.registration_time
                .total_cmp(&b.registration_time)
                .then(a.instance_id.cmp(&b.instance_id))
        });
        v
    }

    /// `id`'s registration, if any.
    pub(crate) fn info(&self, id: &str) -> Option<InstanceInfo> {
        self.0.lock().get(id).map(|r| r.info.clone())
    }

    /// Where to call `id`, if registered.
    pub(crate) fn endpoint(&self, id: &str) -> Option<Endpoint> {
        self.0
            .lock()
            .get(id)
            .map(|r| Endpoint { base_url: base_url_of(&r.info), trusted: r.trusted })
    }

    /// The registered ids.
    pub(crate) fn ids(&self) -> Vec<String> {
        self.0.lock().keys().cloned().collect()
    }

    /// Replaces the table with `infos`, each as having just sent a heartbeat (a restore).
    /// Trust is not restored: a checkpoint file is not a credential, so each instance is
    /// trusted again once it registers again with the token (a server re-registers within
    /// a heartbeat when the coordinator does not know its id).
    pub(crate) fn replace(&self, infos: Vec<InstanceInfo>, now: Instant) {
        *self.0.lock() = infos
            .into_iter()
            .map(|info| {
                let r = Registration { info, last_heartbeat: now, trusted: false };
                (r.info.instance_id.clone(), r)
            })
            .collect();
    }
}

impl Fleet {
    // ---- registry -------------------------------------------------------------------------

    /// `POST /instances`; `trusted` when the call carried the coordinator's own token (see
    /// [`Endpoint::trusted`]). A registration replaces the id's earlier one, trust included.
    pub fn register(
        &self,
        mut req: RegisterRequest,
        trusted: bool,
    ) -> Result<RegisterResponse, FleetError> {
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
        let re_registered = self.registry.insert(info, Instant::now(), trusted);
        tracing::info!(instance = %instance_id, re_registered, trusted, "instance registered");
        self.metrics.registrations.inc();
        self.replicate_instance(&instance_id);
        Ok(RegisterResponse { instance_id, re_registered })
    }

    /// `PUT /instances/{id}/heartbeat`: false when the instance is unknown.
    pub(crate) fn heartbeat(&self, id: &str) -> bool {
        let known = self.registry.beat(id, Instant::now());
        if known {
            self.replicate_instance(id);
        }
        known
    }

    /// `DELETE /instances/{id}`: forgets it, fences its L1 placements and its stream, and its
    /// capacity declaration. Idempotent.
    pub(crate) fn deregister(&self, id: &str) {
        let known = self.registry.remove(id);
        tracing::info!(instance = %id, known, "instance deregistered");
        self.drop_instance(id);
        self.views.lock().declarations.remove(id);
        self.replicate(crate::replication::Change::Gone { id: id.to_string() });
    }

    /// Registered instances, in registration order.
    pub fn instances(&self) -> Vec<InstanceInfo> {
        self.registry.infos()
    }

    /// `GET /instances/liveness`: each instance's seconds since its last heartbeat, by id,
    /// and the timeout past which it is dropped.
    pub fn liveness(&self) -> (Vec<(String, f64)>, f64) {
        let ages = self.registry.ages(Instant::now());
        let ages = ages.into_iter().map(|(id, d)| (id, d.as_secs_f64())).collect();
        (ages, self.config.instance_timeout.as_secs_f64())
    }

    /// Drops instances silent for longer than the instance timeout (their L1 placements and
    /// stream cursor go; capacity declarations stay, as in LMCache). Returns their ids.
    pub(crate) fn sweep(&self, now: Instant) -> Vec<String> {
        let timeout = self.config.instance_timeout;
        let dead = self.registry.expire(now, timeout);
        for id in &dead {
            tracing::warn!(instance = %id, timeout_s = timeout.as_secs_f64(), "instance missed its heartbeats; dropped");
            self.metrics.expired_instances.inc();
            self.drop_instance(id);
            self.replicate(crate::replication::Change::Gone { id: id.clone() });
        }
        dead
    }

    pub(super) fn drop_instance(&self, id: &str) {
        let mut v = self.views.lock();
        self.fence(&mut v, id);
        v.cursors.remove(id);
        v.repairs.remove(id);
    }

    /// Drops `id`'s L1 placements, counted; returns how many.
    pub(super) fn fence(&self, v: &mut Views, id: &str) -> u64 {
        let n = v.dir.find_instance(id).map_or(0, |inst| v.dir.fence_l1(inst));
        self.metrics.fenced_placements.inc_by(n);
        self.publish_vllm_cleared(id);
        n
    }
}
