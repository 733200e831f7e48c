const hist = { t: [], keys: [], ev: [], miss: [] };
let prev = null;
function render(inst, live, usage, stats, m, now) {
  const ages = new Map(live.instances.map(i => [i.instance_id, i.seconds_since_heartbeat]));
  const streams = new Map((stats.streams || []).map(s => [s.instance_id, s]));
  const used = new Map(usage.instances.map(u => [u.instance_id, u]));
  const lags = (stats.streams || []).map(s => s.seconds_since_last_batch).filter(x => x !== null);
  const fig = {
    instances: inst.instances.length,
    alive: live.instances.filter(i => i.seconds_since_heartbeat < 3).length,
    max_heartbeat_age: live.instances.length ? Math.max(...live.instances.map(i => i.seconds_since_heartbeat)) : null,
    num_keys: stats.num_keys, l1_count: stats.l1_count, l2_count: stats.l2_count,
    l1_size_bytes: stats.l1_size_bytes, l2_size_bytes: stats.l2_size_bytes,
    event_batches_total: total(m, "lmcache_rs_coordinator_event_batches_total", l => l.result === "applied"),
    event_entries_total: total(m, "lmcache_rs_coordinator_event_entries_total"),
    max_event_lag: lags.length ? Math.max(...lags) : null,
    expired_instances_total: total(m, "lmcache_rs_coordinator_expired_instances_total"),
    invalid_requests_total: total(m, "lmcache_rs_coordinator_invalid_requests_total"),
    missing_batches_total: total(m, "lmcache_rs_coordinator_missing_batches_total"),
    handler_panics_total: total(m, "lmcache_rs_coordinator_handler_panics_total"),
    transport_errors_total: total(m, "lmcache_rs_coordinator_transport_errors_total"),
  };
  setFigures(fig);
  document.getElementById("timeout").textContent = live.instance_timeout_seconds;
  document.getElementById("updated").textContent = "updated " + new Date(now).toLocaleTimeString();
  document.getElementById("health").className = "dot ok";
  push(hist.t, now); push(hist.keys, stats.num_keys);
  push(hist.miss, fig.missing_batches_total);
  push(hist.ev, prev ? Math.max(0, fig.event_entries_total - prev.entries) / ((now - prev.t) / 1000) : null);
  prev = { t: now, entries: fig.event_entries_total };
  chart("c-keys", hist.t, [{ values: hist.keys, color: "var(--a)" }]);
  chart("c-events", hist.t, [{ values: hist.ev, color: "var(--b)" }, { values: hist.miss, color: "var(--d)" }]);

  document.getElementById("servers").innerHTML = inst.instances.map(i => {
    const id = i.instance_id, age = ages.get(id), s = streams.get(id) || {};
    const l1 = ((used.get(id) || {}).modules || []).find(x => x.tier === "l1") || {};
    const keys = (stats.l1_keys_by_instance || {})[id] || 0;
    const ok = age !== undefined && age < 3;
    const ratio = l1.capacity_bytes ? l1.used_bytes / l1.capacity_bytes : null;
    return `<tr><td>${esc(id)}</td><td>${esc(i.ip)}:${i.http_port}</td>` +
      `<td><span class="dot ${ok ? "ok" : "bad"}"></span> ${age === undefined ? "–" : age.toFixed(1) + " s ago"}</td>` +
      `<td class="n" data-k="inst:${esc(id)}:l1_used" data-v="${l1.used_bytes ?? ""}">${fmt(l1.used_bytes, "bytes")}</td>` +
      `<td>${ratio === null ? "" : `<div class="bar"><div style="width:${(100 * ratio).toFixed(1)}%"></div></div>`}</td>` +
      `<td class="n" data-k="inst:${esc(id)}:keys" data-v="${keys}">${fmt(keys, "count")}</td>` +
      `<td class="n">${s.last_seq ?? "–"}</td><td class="n">${s.seconds_since_last_batch == null ? "–" : s.seconds_since_last_batch.toFixed(1) + " s"}</td>` +
      `<td>${s.gap_detected ? '<span class="err">gap</span>' : "in order"}${s.repairing ? ", repairing" : ""}` +
      `${s.missing_batches ? `, ${s.missing_batches} missing` : ""}</td></tr>`;
  }).join("") || `<tr><td colspan="9" class="empty">No server registered.</td></tr>`;

  document.getElementById("shared").innerHTML = (usage.shared_modules || []).map(s => {
    const ratio = s.capacity_bytes ? s.used_bytes / s.capacity_bytes : null;
    return `<tr><td>${esc(s.backend || s.name || JSON.stringify(s))}</td><td class="n">${fmt(s.used_bytes, "bytes")}</td>` +
      `<td class="n">${s.capacity_bytes == null ? "–" : fmt(s.capacity_bytes, "bytes")}</td>` +
      `<td>${ratio === null ? "" : `<div class="bar"><div style="width:${(100 * ratio).toFixed(1)}%"></div></div>`}</td></tr>`;
  }).join("") || `<tr><td colspan="4" class="empty">No shared module declared.</td></tr>`;
  window.lmcacheSnapshot = { at: now, figures: fig };
}

async function tick() {
  try {
    const [inst, live, usage, stats, text] = await Promise.all([api("/instances"), api("/instances/liveness"),
      api("/instances/usage"), api("/directory/stats"), api("/metrics", true)]);
    document.getElementById("auth").style.display = "none";
    render(inst, live, usage, stats, parseProm(text), Date.now());
  } catch (e) {
    document.getElementById("health").className = "dot bad";
    document.getElementById("updated").textContent = "not reachable: " + e.message;
  }
}
startPolling(tick);
