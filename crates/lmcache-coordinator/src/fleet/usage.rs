//! Fleet memory usage per instance and shared pool, from the declared capacities.

use super::*;

impl Fleet {
    // ---- usage ----------------------------------------------------------------------------

    /// `GET /instances/usage`.
    pub fn usage(&self) -> FleetMemoryResponse {
        let registered: Vec<String> = self.registered_ids();
        let v = self.views.lock();
        let mut private: BTreeMap<String, BTreeMap<(Tier, String), u64>> = BTreeMap::new();
        let mut shared: BTreeMap<(Tier, String), u64> = BTreeMap::new();
        for (id, site) in v.dir.sites() {
            let used = v.dir.site_stats(id).bytes;
            match site.owner {
                Some(owner) => {
                    if let (Ok(name), true) = (v.dir.instance_name(owner), used > 0) {
                        private
                            .entry(name.to_string())
                            .or_default()
                            .insert((site.tier, site.backend.to_string()), used);
                    }
                }
                None => {
                    shared.insert((site.tier, site.backend.to_string()), used);
                }
            }
        }
        let mut names: std::collections::BTreeSet<String> = registered.iter().cloned().collect();
        names.extend(private.keys().cloned());
        names.extend(
            v.declarations
                .iter()
                .filter(|(_, d)| d.compartments.values().any(|&c| c > 0))
                .map(|(k, _)| k.clone()),
        );
        let module =
            |tier: Tier, backend: &str, shared: bool, used: u64, cap: u64| ModuleMemoryStatus {
                tier: wire_tier(tier),
                backend: backend.to_string(),
                shared,
                used_bytes: used,
                capacity_bytes: cap,
                usage_ratio: (cap > 0).then(|| used as f64 / cap as f64),
            };
        let instances = names
            .into_iter()
            .map(|name| {
                let decl = v.declarations.get(&name);
                let mut mods: BTreeMap<(Tier, String), (u64, u64)> = BTreeMap::new();
                for ((t, b), used) in private.get(&name).into_iter().flatten() {
                    mods.entry((*t, b.clone())).or_default().0 = *used;
                }
                for ((t, b, s), cap) in decl.map(|d| &d.compartments).into_iter().flatten() {
                    if !*s && *cap > 0 {
                        mods.entry((*t, b.clone())).or_default().1 = *cap;
                    }
                }
                InstanceMemoryStatus {
                    registered: registered.contains(&name),
                    declared_capacity: decl
                        .is_some_and(|d| d.compartments.values().any(|&c| c > 0)),
                    modules: mods
                        .into_iter()
                        .map(|((t, b), (u, c))| module(t, &b, false, u, c))
                        .collect(),
                    instance_id: name,
                }
            })
            .collect();
        let mut shared_caps: BTreeMap<(Tier, String), Option<u64>> = BTreeMap::new();
        for d in v.declarations.values() {
            for ((t, b, s), cap) in &d.compartments {
                if *s && *cap > 0 {
                    let e = shared_caps.entry((*t, b.clone())).or_insert(Some(*cap));
                    if *e != Some(*cap) {
                        *e = None; // declarers disagree: undeclared
                    }
                    shared.entry((*t, b.clone())).or_insert(0);
                }
            }
        }
        let shared_modules = shared
            .into_iter()
            .map(|((t, b), used)| {
                let cap = shared_caps.get(&(t, b.clone())).copied().flatten().unwrap_or(0);
                module(t, &b, true, used, cap)
            })
            .collect();
        FleetMemoryResponse { instances, shared_modules }
    }

    /// How long the health sweep waits between passes (None: disabled).
    pub(crate) fn sweep_period(&self) -> Option<Duration> {
        (!self.config.health_check_interval.is_zero()).then_some(self.config.health_check_interval)
    }
}
