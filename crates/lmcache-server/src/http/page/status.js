const hist = { t: [], l1: [], hit: [], look: [], store: [], ret: [], queue: [] };
let prev = null;
function render(st, m, recent, now) {
  const l1 = st.storage_manager.l1, wb = st.storage_manager.l2_write_behind;
  const req = total(m, "lmcache_mp_lookup_requested_tokens_total");
  const hit = total(m, "lmcache_mp_lookup_hit_tokens_total");
  const fig = {
    l1_used_bytes: l1.used_bytes, l1_capacity_bytes: l1.capacity_bytes,
    l1_resident_objects: l1.resident_objects, l1_locked_objects: l1.locked_objects,
    l1_evicted_objects: l1.evicted_objects,
    lookup_requested_tokens_total: req, lookup_hit_tokens_total: hit,
    hit_rate: req > 0 ? hit / req : null,
    lookups_total: total(m, "lmcache_mp_lookups_requests_total"),
    stores_total: total(m, "lmcache_mp_num_finished_stores_total"),
    retrieves_total: total(m, "lmcache_mp_num_finished_retrieves_total"),
    l2_unwritten_objects: wb ? wb.unwritten_objects : null,
    l2_enqueued_keys: wb ? wb.enqueued_keys : null,
    l2_dropped_keys: wb ? wb.dropped_keys : null,
    request_errors_total: total(m, "lmcache_rs_mp_request_errors_total"),
    handler_panics_total: total(m, "lmcache_rs_handler_panics_total"),
    l1_oom_rejections_total: total(m, "lmcache_rs_l1_oom_rejections_total"),
    l1_quota_rejections_total: total(m, "lmcache_rs_l1_quota_rejections_total"),
    refused_registrations_total: total(m, "lmcache_rs_refused_registrations_total"),
    miss_chunks_total: total(m, "lmcache_rs_lookup_miss_chunks_total"),
    registered_instances: st.registered_instances.length,
  };
  setFigures(fig);
  document.getElementById("l1bar").style.width = (100 * (l1.usage || 0)).toFixed(1) + "%";
  document.getElementById("l1policy").textContent = l1.eviction_policy;
  // Several L1s (--l1-manager, repeated): each by its tag, in write order.
  const tiers = st.storage_manager.l1_manager.l1s || [];
  document.getElementById("l1tiers").innerHTML = tiers.length < 2 ? "" : tiers.map(t =>
    `${esc(t.tag)} (${esc(t.type)}): <span data-k="tier:${esc(t.tag)}:used" data-v="${t.used_bytes}">` +
    `${fmt(t.used_bytes, "bytes")}</span> of ${fmt(t.capacity_bytes, "bytes")}, ` +
    `${fmt(t.resident_objects, "count")} objects`).join(" · ");
  document.getElementById("version").textContent = "v" + st.version;
  document.getElementById("uptime").textContent = "up " + Math.round(st.uptime_seconds) + " s";
  document.getElementById("updated").textContent = "updated " + new Date(now).toLocaleTimeString();
  document.getElementById("health").className = "dot " + (st.is_healthy ? "ok" : "bad");

  // Rates over the last interval.
  const cur = { t: now, req, hit, look: fig.lookups_total, store: fig.stores_total,
                ret: fig.retrieves_total, lat: new Map() };
  for (const x of m.get("lmcache_rs_mp_request_seconds_sum") || []) cur.lat.set(x.labels.op, { sum: x.value });
  for (const x of m.get("lmcache_rs_mp_request_seconds_count") || []) { const e = cur.lat.get(x.labels.op); if (e) e.count = x.value; }
  const buckets = new Map();
  for (const x of m.get("lmcache_rs_mp_request_seconds_bucket") || []) {
    if (!buckets.has(x.labels.op)) buckets.set(x.labels.op, []);
    buckets.get(x.labels.op).push([x.labels.le === "+Inf" ? Infinity : Number(x.labels.le), x.value]);
  }
  cur.buckets = buckets;
  push(hist.t, now);
  push(hist.l1, l1.usage || 0);
  push(hist.queue, wb ? wb.unwritten_objects : null);
  if (prev) {
    const dt = (now - prev.t) / 1000, d = (a, b) => Math.max(0, a - b) / dt;
    const dreq = cur.req - prev.req;
    push(hist.hit, dreq > 0 ? (cur.hit - prev.hit) / dreq : null);
    push(hist.look, d(cur.look, prev.look)); push(hist.store, d(cur.store, prev.store)); push(hist.ret, d(cur.ret, prev.ret));
    const rows = [];
    for (const [op, e] of cur.lat) {
      const p = prev.lat.get(op) || { sum: 0, count: 0 };
      const dc = (e.count || 0) - (p.count || 0);
      const pb = prev.buckets.get(op) || [];
      let p99 = null;
      if (dc > 0) {
        for (const [le, c] of cur.buckets.get(op) || []) {
          const before = (pb.find(b => b[0] === le) || [0, 0])[1];
          if (c - before >= 0.99 * dc) { p99 = le; break; }
        }
      }
      // Idle in the interval: the mean since start, marked.
      const mean = dc > 0 ? (1000 * (e.sum - (p.sum || 0)) / dc).toFixed(3)
        : (e.count ? "(" + (1000 * e.sum / e.count).toFixed(3) + ")" : null);
      rows.push({ op, rate: dc / dt, mean,
                  p99: p99 === null ? null : (p99 === Infinity ? "> max" : (1000 * p99).toFixed(2)), total: e.count || 0 });
    }
    rows.sort((a, b) => b.rate - a.rate || b.total - a.total);
    document.getElementById("ops").innerHTML = rows.slice(0, 10).map(r =>
      `<tr><td>${esc(r.op)}</td><td class="n">${r.rate.toFixed(1)}</td><td class="n">${r.mean === null ? "–" : r.mean}</td>` +
      `<td class="n">${r.p99 === null ? "–" : "≤ " + r.p99}</td><td class="n">${fmt(r.total, "count")}</td></tr>`).join("") ||
      `<tr><td colspan="5" class="empty">No requests yet.</td></tr>`;
  } else {
    push(hist.hit, null); push(hist.look, null); push(hist.store, null); push(hist.ret, null);
  }
  prev = cur;
  chart("c-l1", hist.t, [{ values: hist.l1, color: "var(--a)" }], true);
  chart("c-hit", hist.t, [{ values: hist.hit, color: "var(--b)" }], true);
  chart("c-ops", hist.t, [{ values: hist.look, color: "var(--a)" }, { values: hist.store, color: "var(--b)" }, { values: hist.ret, color: "var(--c)" }]);
  document.getElementById("nol2").style.display = wb ? "none" : "block";
  document.getElementById("c-queue").style.display = wb ? "block" : "none";
  if (wb) chart("c-queue", hist.t, [{ values: hist.queue, color: "var(--c)" }]);

  const reasons = (m.get("lmcache_rs_lookup_miss_chunks_total") || []).filter(x => x.value > 0)
    .sort((a, b) => b.value - a.value).map(x => `${esc(x.labels.reason)} ${fmt(x.value, "count")}`);
  document.getElementById("missreasons").textContent = reasons.length ? "by reason: " + reasons.join(", ") : "";
  document.getElementById("refused").innerHTML = (st.refused_instances || []).map(r =>
    `<div class="sub err">refused ${esc(r.model_name)} (instance ${esc(r.instance_id)}): ${esc(r.reason)}</div>`).join("");

  // One row per salt with bytes or a quota in either tier.
  const tenants = new Map();
  for (const t of l1.tenants || []) tenants.set(t.cache_salt, { l1: t });
  for (const t of st.storage_manager.l2_tenants || []) {
    tenants.set(t.cache_salt, Object.assign(tenants.get(t.cache_salt) || {}, { l2: t }));
  }
  const share = (t) => t && t.quota_bytes ? `<div class="bar"><div style="width:${Math.min(100, 100 * t.used_bytes / t.quota_bytes).toFixed(1)}%"></div></div>` : "";
  const quota = (t) => !t ? "–" : (t.quota_bytes === null ? "none" : fmt(t.quota_bytes, "bytes"));
  document.getElementById("tenants").innerHTML = [...tenants].map(([salt, t]) =>
    `<tr><td>${esc(salt)}</td>` +
    `<td class="n" data-k="tenant:${esc(salt)}" data-v="${t.l1 ? t.l1.used_bytes : 0}">${fmt(t.l1 ? t.l1.used_bytes : 0, "bytes")}</td>` +
    `<td class="n">${quota(t.l1)}</td><td>${share(t.l1)}</td>` +
    `<td class="n" data-k="tenant-l2:${esc(salt)}" data-v="${t.l2 ? t.l2.used_bytes : ""}">${t.l2 ? fmt(t.l2.used_bytes, "bytes") : "–"}</td>` +
    `<td class="n">${quota(t.l2)}</td><td>${share(t.l2)}</td></tr>`).join("") ||
    `<tr><td colspan="7" class="empty">No tenant holds anything.</td></tr>`;

  document.getElementById("l2").innerHTML = st.storage_manager.l2_adapters.map(a =>
    `<tr><td>${esc(a.type)}#${a.id}</td><td><span class="dot ${a.healthy ? "ok" : "bad"}"></span> ${a.healthy ? "up" : "down"}</td>` +
    `<td class="n" data-k="l2:${a.id}:used" data-v="${a.used_bytes}">${fmt(a.used_bytes, "bytes")}</td>` +
    `<td class="n">${a.capacity_bytes === null ? "unbounded" : fmt(a.capacity_bytes, "bytes")}</td>` +
    `<td class="n">${fmt(a.keys, "count")}</td><td class="n">${fmt(a.stored_keys, "count")}</td>` +
    `<td class="n">${fmt(a.loaded_keys, "count")}</td><td class="n">${fmt(a.errors + a.corrupt_blobs, "count")}</td>` +
    `<td>${Object.entries(a.usage_bytes_by_salt || {}).map(([k, v]) => esc(k) + " " + fmt(v, "bytes")).join(", ")}</td></tr>`).join("") ||
    `<tr><td colspan="9" class="empty">No L2 adapter configured.</td></tr>`;

  const meta = st.cache_context_meta || {};
  document.getElementById("engines").innerHTML = st.registered_instances.map(i => {
    const layout = (meta[String(i.instance_id)] || {}).kv_cache_layout || {};
    const groups = (layout.object_groups || []).map(o =>
      `${o.object_group_idx}: ${(o.object_shapes || []).map(s => "[" + s.join(",") + "]").join(" ")}` +
      (o.window_chunks ? ` (window ${o.window_chunks})` : "")).join("; ");
    return `<tr><td data-k="engine:${esc(i.instance_id)}">${esc(i.instance_id)}</td><td>${esc(i.transfer_mode)}</td>` +
      `<td>${esc(i.model_name)}</td><td class="n">${i.world_size}</td><td class="sub">${esc(groups || "–")}</td></tr>`;
  }).join("") || `<tr><td colspan="5" class="empty">No engine registered.</td></tr>`;

  document.getElementById("recent").innerHTML = (recent.requests || []).map(r =>
    `<tr><td>${esc(r.request_id)}</td><td class="n">${r.seconds_ago.toFixed(1)}</td><td>${esc(r.model || "–")}</td>` +
    `<td class="n">${r.hit_chunks} / ${r.chunks}</td><td>${r.first_miss ? esc(r.first_miss.reason) + ": " +
    esc(r.first_miss.detail) : (r.pending ? "prefetch running" : "none: full hit")}</td></tr>`).join("") ||
    `<tr><td colspan="5" class="empty">No lookups yet.</td></tr>`;
  window.lmcacheSnapshot = { at: now, figures: fig };
}

// The minutes before the page was opened, from the server's own samples.
async function seed() {
  const h = await api("/status/history");
  let p = null;
  for (const s of h.samples) {
    push(hist.t, s.t);
    push(hist.l1, s.l1_capacity_bytes ? s.l1_used_bytes / s.l1_capacity_bytes : 0);
    push(hist.queue, s.l2_unwritten_objects);
    if (p) {
      const dt = (s.t - p.t) / 1000, dreq = s.lookup_requested_tokens - p.lookup_requested_tokens;
      push(hist.hit, dreq > 0 ? (s.lookup_hit_tokens - p.lookup_hit_tokens) / dreq : null);
      push(hist.look, Math.max(0, s.lookups - p.lookups) / dt);
      push(hist.store, Math.max(0, s.stores - p.stores) / dt);
      push(hist.ret, Math.max(0, s.retrieves - p.retrieves) / dt);
    } else {
      push(hist.hit, null); push(hist.look, null); push(hist.store, null); push(hist.ret, null);
    }
    p = s;
  }
}
let seeded = false;

async function tick() {
  try {
    if (!seeded) { await seed(); seeded = true; }
    const [st, text, recent] = await Promise.all([api("/status"), api("/metrics", true),
      api("/cache/requests?limit=12").catch(() => ({ requests: [] }))]);
    document.getElementById("auth").style.display = "none";
    render(st, parseProm(text), recent, Date.now());
  } catch (e) {
    document.getElementById("health").className = "dot bad";
    document.getElementById("updated").textContent = "not reachable: " + e.message;
  }
}
startPolling(tick);
