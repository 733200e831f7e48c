"use strict";
let token = sessionStorage.getItem("lmcache-rs-token") || "";
window.lmcacheSnapshot = null;

async function api(path, text) {
  const headers = token ? { Authorization: "Bearer " + token } : {};
  const r = await fetch(path, { headers, cache: "no-store" });
  if (r.status === 401) { document.getElementById("auth").style.display = "flex"; throw new Error("401"); }
  if (!r.ok) throw new Error(path + ": HTTP " + r.status);
  return text ? r.text() : r.json();
}

// Prometheus text: name -> [{labels, value}].
function parseProm(text) {
  const out = new Map();
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    if (m[3]) for (const p of m[3].matchAll(/([a-zA-Z_]+)="((?:[^"\\]|\\.)*)"/g)) labels[p[1]] = p[2];
    if (!out.has(m[1])) out.set(m[1], []);
    out.get(m[1]).push({ labels, value: Number(m[4]) });
  }
  return out;
}
const total = (m, name, f) => (m.get(name) || []).filter(x => !f || f(x.labels)).reduce((a, x) => a + x.value, 0);

function fmt(v, kind) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (kind === "bytes") {
    const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
    while (Math.abs(v) >= 1024 && i < u.length - 1) { v /= 1024; i++; }
    return (i ? v.toFixed(2) : String(v)) + " " + u[i];
  }
  if (kind === "pct") return (100 * v).toFixed(1) + " %";
  if (kind === "count") return Math.round(v).toLocaleString("en-US");
  if (kind === "secs") return v.toFixed(1) + " s";
  return String(v);
}
const esc = (s) => String(s).replace(/[&<>"']/g, c => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));

function setFigures(fig) {
  for (const el of document.querySelectorAll("[data-k]")) {
    const k = el.dataset.k;
    if (!(k in fig)) continue;
    el.dataset.v = fig[k] === null ? "" : String(fig[k]);
    el.textContent = fmt(fig[k], el.dataset.fmt);
  }
}

// A line chart of the last minutes: series [{values, color}], y from 0 (or 0..1 for pct).
function chart(id, times, series, pct) {
  const svg = document.getElementById(id), w = 320, h = 120, pad = 22;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  const n = times.length;
  let max = pct ? 1 : 0;
  for (const s of series) for (const v of s.values) if (v !== null && v > max) max = v;
  if (max === 0) max = 1;
  // Placed by time: points sampled apart (history, then live polls) sit where they belong.
  const span = n > 1 ? times[n - 1] - times[0] : 0;
  const x = (i) => pad + (span <= 0 ? 0 : ((times[i] - times[0]) / span) * (w - pad - 4));
  const y = (v) => h - 14 - (v / max) * (h - 24);
  let g = `<line x1="${pad}" y1="${y(0)}" x2="${w - 4}" y2="${y(0)}" stroke="#e4e7ec"/>` +
          `<line x1="${pad}" y1="${y(max)}" x2="${w - 4}" y2="${y(max)}" stroke="#f0f1f3"/>` +
          `<text x="0" y="${y(max) + 4}" font-size="9" fill="#667085">${pct ? "100%" : fmtAxis(max)}</text>` +
          `<text x="0" y="${y(0) + 3}" font-size="9" fill="#667085">0</text>` +
          `<text x="${pad}" y="${h - 2}" font-size="9" fill="#667085">${n > 1 ? Math.round((times[n - 1] - times[0]) / 1000) + " s ago" : ""}</text>` +
          `<text x="${w - 4}" y="${h - 2}" font-size="9" fill="#667085" text-anchor="end">now</text>`;
  for (const s of series) {
    const pts = s.values.map((v, i) => v === null ? null : `${x(i).toFixed(1)},${y(v).toFixed(1)}`).filter(Boolean);
    if (pts.length) g += `<polyline fill="none" stroke="${s.color}" stroke-width="1.8" points="${pts.join(" ")}"/>`;
  }
  svg.innerHTML = g;
}
function fmtAxis(v) { return v >= 1e6 ? (v / 1e6).toFixed(1) + "M" : v >= 1e3 ? (v / 1e3).toFixed(1) + "k" : v.toFixed(v < 10 ? 1 : 0); }
function push(arr, v) { arr.push(v); if (arr.length > 300) arr.shift(); } // ten minutes at 2 s


// Polls every two seconds; the token form retries at once.
function startPolling(tick) {
  document.getElementById("auth").addEventListener("submit", (e) => {
    e.preventDefault();
    token = document.getElementById("token").value;
    sessionStorage.setItem("lmcache-rs-token", token);
    tick();
  });
  tick();
  setInterval(tick, 2000);
}
