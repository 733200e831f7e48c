//! `/status`, `/version`, `/config`, `/config/adapters`, `/metrics` and `/metrics/reset`.

use super::*;

pub(super) async fn status(State(s): State<Shared>) -> Json<Value> {
    let (u, per_l1) = s.l1().usage_by_member();
    let arena = s.l1().memory().arena();
    let instances: Vec<Value> = s
        .registry
        .list()
        .into_iter()
        .map(|(fam, id, model, ws)| {
            json!({
                "instance_id": id,
                "transfer_mode": fam.as_str(),
                "model_name": model,
                "world_size": ws,
            })
        })
        .collect();
    // Registrations refused as unservable: the worker cannot tell from the void reply.
    let refused: Vec<Value> = s
        .registry
        .refusals()
        .into_iter()
        .map(|(fam, id, r)| {
            json!({
                "instance_id": id,
                "transfer_mode": fam.as_str(),
                "model_name": r.model,
                "world_size": r.world_size,
                "reason": r.reason,
                "refused_at_unix": r.at_unix,
            })
        })
        .collect();
    // LMCache's `cache_context_meta`, per registered worker: what `lmcache describe kvcache`
    // prints per model.
    let mut meta = serde_json::Map::new();
    for (_, id, inst) in s.registry.snapshot() {
        let layout = kv_cache_layout(&inst, s.chunk_size() as u64);
        meta.insert(
            id.to_string(),
            json!({"model_name": inst.model.as_str(), "world_size": inst.world_size, "kv_cache_layout": layout}),
        );
    }
    let p2p = s.channels.reporter.as_ref().and_then(|r| r.peers());
    // Every tenant with bytes in L1 or a quota: its usage and its limit.
    let quotas = s.l1().quotas();
    let mut tenants: Vec<(lmcache_core::CacheSalt, u64, Option<u64>)> =
        u.by_salt.iter().map(|(salt, used)| (salt.clone(), *used, None)).collect();
    for (salt, limit) in quotas {
        match tenants.iter_mut().find(|(s, _, _)| *s == salt) {
            Some(t) => t.2 = Some(limit),
            None => tenants.push((salt, 0, Some(limit))),
        }
    }
    let tenants: Vec<Value> = tenants
        .iter()
        .map(|(salt, used, limit)| {
            json!({"cache_salt": quota::salt_name(salt), "used_bytes": used, "quota_bytes": limit})
        })
        .collect();
    let l2_tenants = l2_tenants(&s);
    Json(json!({
        "cache_context_meta": meta,
        "is_healthy": true,
        "engine_type": if s.blend.is_some() { "blend" } else { "default" },
        "blend": s.blend.as_ref().map(|b| b.status()),
        "server": "lmcache-rs",
        "version": env!("CARGO_PKG_VERSION"),
        "chunk_size": s.chunk_size(),
        "hash_algorithm": "blake3",
        "active_sessions": s.sessions.len(),
        "uptime_seconds": s.started.elapsed().as_secs_f64(),
        "registered_instances": instances,
        "p2p_enabled": p2p.is_some(),
        "p2p_state": p2p.map(|p| p.state()),
        "p2p_peers": p2p.map(|p| p.peers()).unwrap_or_default(),
        "refused_instances": refused,
        "storage_manager": {
            "l1_manager": {
                "memory_total_bytes": u.capacity,
                "memory_used_bytes": u.used_bytes,
                "memory_usage_ratio": u.usage_fraction(),
                "total_object_count": u.resident_objects,
                "l1s": l1_members(&s, &per_l1),
            },
            "eviction_controller": {"eviction_policy": s.l1().config().eviction_policy.as_str()},
            "l2_adapters": l2_status(&s),
            "l2_tenants": l2_tenants,
            "l2_write_behind": s.storage.l2_stats().map(|t| json!({
                "unwritten_objects": s.l1().unwritten(),
                "enqueued_keys": t.store_enqueued.load(std::sync::atomic::Ordering::Relaxed),
                "dropped_keys": t.store_dropped.load(std::sync::atomic::Ordering::Relaxed),
                "prefetch_in_flight": t.prefetch_in_flight.load(std::sync::atomic::Ordering::Relaxed),
            })),
            "l1": {
                "capacity_bytes": u.capacity,
                "used_bytes": u.used_bytes,
                "usage": u.usage_fraction(),
                "resident_objects": u.resident_objects,
                "staged_objects": u.staged_objects,
                "locked_objects": u.locked_objects,
                "eviction_policy": s.l1().config().eviction_policy.as_str(),
                "backing": arena.kind().as_str(),
                "shm_name": arena.shm_name(),
                "evicted_objects": u.stats.evicted_objects,
                "tenants": tenants,
                "devdax_path": arena.file_path().map(|p| p.display().to_string()),
                "restart": restart_status(&s),
            }
        }
    }))
}

/// Each L1 in write order (LMCache's tagged L1s; one unless `--l1-manager` lists several):
/// its tag, medium and occupancy.
fn l1_members(s: &Shared, usage: &[(&str, lmcache_l1::L1Usage)]) -> Vec<Value> {
    s.l1()
        .members()
        .zip(usage)
        .map(|((tag, m), (_, u))| {
            let arena = m.memory().arena();
            json!({
                "tag": tag,
                "type": if arena.file_path().is_some() { "DEVDAX" } else { "DRAM" },
                "backing": arena.kind().as_str(),
                "path": arena.file_path().map(|p| p.display().to_string()),
                "capacity_bytes": u.capacity,
                "used_bytes": u.used_bytes,
                "usage": u.usage_fraction(),
                "resident_objects": u.resident_objects,
                "evicted_objects": u.stats.evicted_objects,
                "demoted_objects": u.stats.demoted_objects,
                "eviction_policy": m.config().eviction_policy.as_str(),
            })
        })
        .collect()
}

/// Every tenant with bytes in L2 (any adapter) or an L2 quota: its usage and its limit (`null`
/// without L2).
fn l2_tenants(s: &Shared) -> Value {
    use lmcache_storage::TierName;
    if !s.storage.has_l2() {
        return Value::Null;
    }
    let mut salts: Vec<lmcache_core::CacheSalt> = s
        .storage
        .describe_l2()
        .iter()
        .flat_map(|a| a.usage.by_salt.iter().map(|(salt, _)| salt.clone()))
        .chain(s.storage.quotas(TierName::L2).unwrap_or_default().into_iter().map(|(salt, _)| salt))
        .collect();
    salts.sort();
    salts.dedup();
    let rows: Vec<Value> = salts
        .iter()
        .map(|salt| {
            json!({
                "cache_salt": quota::salt_name(salt),
                "used_bytes": s.storage.usage_of(TierName::L2, salt).unwrap_or(0),
                "quota_bytes": s.storage.quota(TierName::L2, salt).unwrap_or(None),
            })
        })
        .collect();
    json!(rows)
}

/// An L1 file's sealing and what the last start adopted (`null` for other arenas).
fn restart_status(s: &Shared) -> Value {
    let memory = s.l1().memory();
    let Some((records_used, records)) = memory.catalog_usage() else { return Value::Null };
    let p = s.l1().persist_stats();
    let report = memory.adopt_report();
    json!({
        "warm_restart": report.is_some(),
        "catalog_records": records,
        "catalog_records_used": records_used,
        "sealed_objects": p.sealed,
        "seal_pending": p.pending,
        "seal_failed": p.seal_failed,
        "adopted_objects": p.adopted,
        "adopted_bytes": p.adopted_bytes,
        "adopt_refused": p.adopt_refused,
        "adopt_corrupt": report.map(|r| r.corrupt),
        "adopt_misplaced": report.map(|r| r.misplaced),
    })
}

pub(super) async fn version() -> Json<Value> {
    Json(
        json!({"version": env!("CARGO_PKG_VERSION"), "server": "lmcache-rs", "protocol": "lmcache-mp-0.5.6"}),
    )
}

/// The effective configuration (the token itself is never shown).
pub(super) async fn config(State(s): State<Shared>) -> Json<Value> {
    let c = &s.config;
    let arena = s.l1().memory().arena();
    Json(json!({
        "mp": {
            "host": c.host, "port": c.port, "chunk_size": c.chunk_size,
            "max_cpu_workers": c.max_cpu_workers, "max_gpu_workers": c.max_gpu_workers,
            "worker_reap_timeout_seconds": c.worker_reap_timeout.as_secs_f64(),
            "worker_registration_grace_seconds": c.worker_registration_grace.as_secs_f64(),
            "session_ttl_seconds": c.session_ttl.as_secs_f64(),
            "null_block_id": c.null_block_id, "copy_threads": c.copy_threads,
            "kv_event_log_size": c.kv_event_log_size, "hash_algorithm": "blake3",
            "supported_transfer_modes": ["lmcache_driven", "engine_driven"],
        },
        "storage_manager": {
            "l1_size_bytes": arena.len(), "l1_backing": arena.kind().as_str(),
            "shm_name": arena.shm_name(), "l1_align_bytes": c.align, "l1_mlock": arena.is_locked(),
            "eviction_policy": c.l1.eviction_policy.as_str(),
            "eviction_trigger_watermark": c.l1.trigger_watermark, "eviction_ratio": c.l1.eviction_ratio,
            "l1_read_ttl_seconds": c.l1.read_ttl.as_secs_f64(),
            "l1_write_ttl_seconds": c.l1.write_ttl.as_secs_f64(),
            "l2_adapters": l2_specs(&s),
        },
        "http": {"http_host": c.http_host, "http_port": c.http_port, "auth": c.http_auth_token.is_some()},
    }))
}

/// Each adapter's state for /status: LMCache's `type` and `is_healthy`, then our detail.
pub(super) fn l2_status(s: &ServerState) -> Vec<Value> {
    s.storage.describe_l2().iter().map(adapter_json).collect()
}

fn adapter_json(a: &lmcache_storage::AdapterInfo) -> Value {
    let u = &a.usage;
    let c = &a.counters;
    let by_salt: serde_json::Map<String, Value> =
        u.by_salt.iter().map(|(k, v)| (quota::salt_name(k), json!(v))).collect();
    json!({
        "id": a.id,
        "type": a.kind,
        "healthy": a.healthy,
        "is_healthy": a.healthy,
        "last_error": a.last_error,
        "codec": a.codec,
        "config": a.spec,
        "adapter": a.backend,
        "capacity_bytes": a.capacity,
        "used_bytes": u.used,
        "reserved_bytes": u.reserved,
        "keys": u.keys,
        "usage_fraction": a.capacity.map(|cap| u.used as f64 / cap.max(1) as f64),
        "usage_bytes_by_salt": by_salt,
        "usage_seeded": a.seeded,
        "eviction": a.eviction.map(|e| json!({
            "eviction_policy": e.policy.as_str(),
            "trigger_watermark": e.trigger_watermark,
            "eviction_ratio": e.eviction_ratio,
        })),
        "evicted_keys": c.evicted_keys,
        "evicted_bytes": c.evicted_bytes,
        "quota_rejections": c.quota_rejections,
        "capacity_rejections": c.capacity_rejections,
        "seeded_keys": c.seeded_keys,
        "stored_keys": c.stored_keys,
        "stored_bytes": c.stored_bytes,
        "skipped_keys": c.skipped_keys,
        "store_failures": c.store_failures,
        "lookup_keys": c.lookup_keys,
        "lookup_hits": c.lookup_hits,
        "loaded_keys": c.loaded_keys,
        "loaded_bytes": c.loaded_bytes,
        "load_failures": c.load_failures,
        "corrupt_blobs": c.corrupt_blobs,
        "errors": c.errors,
        "ping_failures": c.ping_failures,
        "marked_down": c.marked_down,
    })
}

/// The adapters' configurations (secrets masked), for /config.
pub(super) fn l2_specs(s: &ServerState) -> Vec<Value> {
    s.storage.describe_l2().into_iter().map(|a| a.spec).collect()
}

pub(super) async fn config_adapters(State(s): State<Shared>) -> Json<Value> {
    let list: Vec<Value> = s
        .storage
        .describe_l2()
        .iter()
        .enumerate()
        .map(|(i, a)| {
            json!({"index": a.id, "type_name": a.kind, "tier": "l2",
                   "primary": i == 0, "reconfigurable": true})
        })
        .collect();
    Json(json!({"adapters": list}))
}

/// `POST /metrics/reset`: clears the per-operation request, refusal and latency series (the
/// lmcache_mp counters are cumulative, as Prometheus expects, and are not reset).
pub(super) async fn metrics_reset(State(s): State<Shared>) -> Json<Value> {
    s.metrics.requests.clear();
    s.metrics.errors.clear();
    s.metrics.latency.clear();
    Json(json!({"status": "ok"}))
}

pub(super) fn refresh_l2_metrics(s: &ServerState) {
    use crate::metrics::{L2Label, StateLabel, advance};
    use std::sync::atomic::Ordering::Relaxed;
    let m = &s.metrics.l2;
    let adapters = s.storage.describe_l2();
    let n = adapters.len() as i64;
    let active = StateLabel { state: "active".into() };
    m.store_adapters.get_or_create(&active).set(n);
    m.prefetch_adapters.get_or_create(&active).set(n);
    let Some(ts) = s.storage.l2_stats() else { return };
    advance(&m.store_submitted_objects, ts.store_enqueued.load(Relaxed));
    advance(&m.store_dropped_objects, ts.store_dropped.load(Relaxed));
    advance(&m.prefetch_requests, ts.prefetch_requests.load(Relaxed));
    advance(&m.prefetch_expired, ts.prefetch_expired.load(Relaxed));
    s.metrics.active_prefetch_jobs.set(ts.prefetch_in_flight.load(Relaxed) as i64);
    // The same snapshot /status shows.
    for a in adapters {
        let l = L2Label { l2_name: a.kind.clone(), adapter_index: a.id.to_string() };
        let c = &a.counters;
        m.usage_bytes.get_or_create(&l).set(a.usage.used as i64);
        m.capacity_bytes.get_or_create(&l).set(a.capacity.map_or(-1, |cap| cap as i64));
        m.keys.get_or_create(&l).set(a.usage.keys as i64);
        m.healthy.get_or_create(&l).set(i64::from(a.healthy));
        for (counter, value) in [
            (&m.evicted_objects, c.evicted_keys),
            (&m.evicted_bytes, c.evicted_bytes),
            (&m.quota_rejections, c.quota_rejections),
            (&m.capacity_rejections, c.capacity_rejections),
            (&m.store_completed_objects, c.stored_keys),
            (&m.stored_bytes, c.stored_bytes),
            (&m.store_skipped_objects, c.skipped_keys),
            (&m.store_failures, c.store_failures),
            (&m.loaded_objects, c.loaded_keys),
            (&m.loaded_bytes, c.loaded_bytes),
            (&m.load_failures, c.load_failures),
            (&m.corrupt_blobs, c.corrupt_blobs),
            (&m.errors, c.errors),
        ] {
            advance(&counter.get_or_create(&l), value);
        }
    }
}

pub(super) async fn metrics(State(s): State<Shared>) -> Response {
    let (u, per_l1) = s.l1().usage_by_member();
    s.metrics.l1_used_bytes.set(u.used_bytes as i64);
    s.metrics.l1_usage_ratio.set(u.usage_fraction());
    s.metrics.l1_staging_bytes.set(u.staged_bytes as i64);
    s.metrics.l1_capacity_bytes.set(u.capacity as i64);
    for (tag, m) in per_l1 {
        let l = crate::metrics::L1TagLabel { tag: tag.to_owned() };
        s.metrics.l1_tier_used_bytes.get_or_create(&l).set(m.used_bytes as i64);
        s.metrics.l1_tier_capacity_bytes.get_or_create(&l).set(m.capacity as i64);
        s.metrics.l1_tier_objects.get_or_create(&l).set(m.resident_objects as i64);
    }
    s.metrics.kv_events_log_depth.set(s.channels.kv_events.len() as i64);
    s.metrics.active_sessions.set(s.sessions.len() as i64);
    s.metrics.active_p2p_lookup_jobs.set(s.peers.active() as i64);
    s.metrics.process_resident_memory_bytes.set(crate::metrics::process_rss_bytes() as i64);
    s.metrics.event_bus_queue_depth.set(s.bus.depth());
    use crate::metrics::advance;
    let m = &s.metrics;
    advance(&m.event_bus_dropped, s.bus.dropped());
    let st = u.stats;
    advance(&m.l1_eviction_loop_ticks, st.maintenance_passes);
    advance(&m.l1_evicted_objects, st.evicted_objects);
    advance(&m.l1_evicted_bytes, st.evicted_bytes);
    advance(&m.l1_sync_evictions, st.sync_evictions);
    advance(&m.l1_oom_rejections, st.oom_rejections);
    advance(&m.l1_quota_rejections, st.quota_rejections);
    advance(&m.l1_expired_read_leases, st.expired_read_leases);
    advance(&m.l1_expired_write_leases, st.expired_write_leases);
    advance(&m.l1_unwritten_evictions, st.unwritten_evictions);
    m.l1_unwritten_objects.set(s.l1().unwritten() as i64);
    let p = s.l1().persist_stats();
    advance(&m.l1_sealed_objects, p.sealed);
    advance(&m.l1_seal_failures, p.seal_failed);
    m.l1_seal_pending.set(p.pending as i64);
    advance(&m.l1_adopted_objects, p.adopted);
    let dropped = s.l1().memory().adopt_report().map_or(0, |r| r.corrupt + r.misplaced);
    advance(&m.l1_adopt_dropped_objects, dropped + p.adopt_refused);
    if let Some(log) = &s.channels.lookup_log {
        advance(&m.lookup_hash_log_dropped, log.dropped());
    }
    refresh_l2_metrics(&s);
    (
        [(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        s.metrics.encode(),
    )
        .into_response()
}

/// A worker's KV cache layout as LMCache's `report_status` shows it: one entry per kernel
/// group, plus (ours) each object group with its window and object size.
/// `cache_size_per_token` is bytes per *logical* token (LMCache's definition): an
/// engine-driven object of `num_physical_slots` slots holds `chunk_size` tokens, so it is the
/// object's bytes over the chunk's tokens, not a slot's bytes; an lmcache-driven compressed
/// group's slot holds several tokens ([`crate::registry::KernelGroup::bytes_per_token`]).
fn kv_cache_layout(inst: &crate::registry::Instance, chunk_size: u64) -> serde_json::Value {
    use crate::registry::Registration;
    let objects: Vec<serde_json::Value> = inst
        .objects
        .iter()
        .enumerate()
        .map(|(i, o)| {
            json!({
                "object_group_idx": i,
                "window_chunks": o.window_chunks,
                "recurrent_state": o.recurrent,
                "object_bytes": o.bytes(),
                "object_shapes": o.parts.iter().map(|p| p.shape()).collect::<Vec<_>>(),
            })
        })
        .collect();
    match &inst.registration {
        Registration::LmcacheDriven { kernel_groups, object_groups, num_layers } => {
            let og_of = |g: usize| object_groups.iter().position(|o| o.kernel_groups.contains(&g));
            let groups: Vec<serde_json::Value> = kernel_groups
                .iter()
                .enumerate()
                .map(|(g, k)| {
                    json!({
                        "kernel_group_idx": g,
                        "engine_group_idx": k.engine_group,
                        "object_group_idx": og_of(g).unwrap_or(0),
                        "num_layers": k.layers.len(),
                        "layer_indices": k.layer_indices,
                        "tokens_per_block": k.tokens_per_block,
                        "slots_per_block": k.geometry.block_size,
                        "num_blocks": k.geometry.num_blocks,
                        "dtype": k.geometry.dtype.as_str(),
                        "is_mla": k.mla,
                        "sw_size_tokens": k.sw_size_tokens,
                        "recurrent_state": k.recurrent,
                    })
                })
                .collect();
            let per_token: u64 = kernel_groups.iter().map(|k| k.bytes_per_token()).sum();
            json!({
                "num_layers": num_layers,
                "num_blocks": kernel_groups.first().map_or(0, |k| k.geometry.num_blocks),
                "cache_size_per_token": per_token,
                "kernel_groups": groups,
                "object_groups": objects,
            })
        }
        Registration::EngineDriven => {
            let Some(l) = inst.single_layout() else { return json!({"object_groups": objects}) };
            json!({
                "num_layers": l.layers,
                "cache_size_per_token": l.bytes().unwrap_or(0) / chunk_size.max(1),
                "kernel_groups": [{
                    "kernel_group_idx": 0, "engine_group_idx": 0, "object_group_idx": 0,
                    "num_layers": l.layers, "dtype": l.dtype.as_str(), "is_mla": l.kv == 1,
                    "object_shape": l.shape(),
                }],
                "object_groups": objects,
            })
        }
    }
}
