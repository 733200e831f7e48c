//! `trace info`: what a trace file holds, printed line for line as LMCache's
//! `lmcache trace info` prints it (so the two can be diffed), or as JSON.

use std::collections::{BTreeMap, BTreeSet};

use rmpv::Value;

use super::format::{Header, Record, map_get};

/// Label column width of LMCache's report (fits `cache_event_schema_version`).
const LABEL_WIDTH: usize = 28;

/// A trace file, summed up.
#[derive(Debug, Clone, Default)]
pub struct TraceInfo {
    /// The header's level.
    pub level: String,
    /// The header's config digest (empty: none).
    pub sm_config_digest: String,
    /// The header's level metadata, sorted by key.
    pub level_meta: BTreeMap<String, Value>,
    /// The largest record `t_mono` (seconds).
    pub duration_s: f64,
    /// Records per qualname.
    pub ops: BTreeMap<String, u64>,
    /// Events-level detail (only for an `events` file).
    pub events: Option<EventsInfo>,
    /// Frames skipped as malformed.
    pub malformed: u64,
    /// Why the records ended early, for a torn file.
    pub truncated: Option<String>,
}

/// What an events-level file holds.
#[derive(Debug, Clone, Default)]
pub struct EventsInfo {
    /// Incarnations seen per instance.
    pub incarnations: BTreeMap<String, BTreeSet<i64>>,
    /// Batches per (event type, tier, backend, shared).
    pub batches: BTreeMap<(String, String, String, bool), u64>,
    /// Entries per event type.
    pub entries: BTreeMap<String, u64>,
    /// Bytes of every store entry.
    pub store_bytes: u64,
    /// Store entries that carry their tokens.
    pub entries_with_tokens: u64,
    /// Lifecycle marks per phase.
    pub lifecycle: BTreeMap<String, u64>,
}

/// Python's `str()` of a msgpack-decoded value, as LMCache's report prints one.
pub fn py_str(v: &Value) -> String {
    match v {
        Value::String(s) => s.as_str().unwrap_or("").to_owned(),
        other => py_repr(other),
    }
}

fn py_float(f: f64) -> String {
    if f.is_nan() {
        "nan".into()
    } else if f.is_infinite() {
        if f > 0.0 { "inf".into() } else { "-inf".into() }
    } else if f == f.trunc() && f.abs() < 1e16 {
        format!("{f:.1}")
    } else {
        format!("{f}")
    }
}

fn py_repr(v: &Value) -> String {
    match v {
        Value::Nil => "None".into(),
        Value::Boolean(true) => "True".into(),
        Value::Boolean(false) => "False".into(),
        Value::Integer(i) => i.to_string(),
        Value::F32(f) => py_float(f64::from(*f)),
        Value::F64(f) => py_float(*f),
        Value::String(s) => {
            format!("'{}'", s.as_str().unwrap_or("").replace('\\', "\\\\").replace('\'', "\\'"))
        }
        Value::Binary(b) => {
            format!("b'{}'", b.iter().map(|c| format!("\\x{c:02x}")).collect::<String>())
        }
        Value::Array(a) => format!("[{}]", a.iter().map(py_repr).collect::<Vec<_>>().join(", ")),
        Value::Map(m) => format!(
            "{{{}}}",
            m.iter()
                .map(|(k, v)| format!("{}: {}", py_repr(k), py_repr(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Value::Ext(t, _) => format!("ExtType(code={t})"),
    }
}

fn text(v: Option<&Value>, default: &str) -> String {
    v.map_or_else(|| default.to_owned(), py_str)
}

impl EventsInfo {
    fn add(&mut self, r: &Record) {
        if r.qualname == super::codec::EVENTS_LIFECYCLE {
            *self.lifecycle.entry(text(r.arg("phase"), "?")).or_default() += 1;
            return;
        }
        if r.qualname != super::codec::EVENTS_BATCH {
            return;
        }
        let instance = text(r.arg("instance_id"), "?");
        let inc = r.arg("incarnation").and_then(Value::as_i64).unwrap_or(0);
        self.incarnations.entry(instance).or_default().insert(inc);
        let event_type = text(r.arg("event_type"), "?");
        let entries: &[Value] = match r.arg("entries") {
            Some(Value::Array(a)) => a,
            _ => &[],
        };
        let shared = matches!(r.arg("shared"), Some(Value::Boolean(true)));
        let k = (event_type.clone(), text(r.arg("tier"), "?"), text(r.arg("backend"), ""), shared);
        *self.batches.entry(k).or_default() += 1;
        *self.entries.entry(event_type.clone()).or_default() += entries.len() as u64;
        if event_type == "store" {
            for e in entries {
                self.store_bytes += map_get(e, "size_bytes").and_then(Value::as_u64).unwrap_or(0);
                let has_tokens = match map_get(e, "token_ids") {
                    Some(Value::Array(a)) => !a.is_empty(),
                    Some(Value::Nil) | None => false,
                    Some(_) => true,
                };
                self.entries_with_tokens += u64::from(has_tokens);
            }
        }
    }
}

impl TraceInfo {
    /// Starts a summary of a file with `header`.
    pub fn new(header: &Header) -> Self {
        Self {
            level: header.level.clone(),
            sm_config_digest: header.sm_config_digest.clone(),
            level_meta: header.level_meta.iter().cloned().collect(),
            events: (header.level == "events").then(EventsInfo::default),
            ..Self::default()
        }
    }

    /// Folds one record in.
    pub fn add(&mut self, r: &Record) {
        *self.ops.entry(r.qualname.clone()).or_default() += 1;
        if r.t_mono > self.duration_s {
            self.duration_s = r.t_mono;
        }
        if let Some(e) = &mut self.events {
            e.add(r);
        }
    }

    /// Records in all.
    pub fn total_records(&self) -> u64 {
        self.ops.values().sum()
    }

    /// LMCache's report, line for line.
    pub fn render_text(&self, path: &str) -> String {
        let mut out = format!("Trace file: {path}\n");
        let line = |out: &mut String, label: &str, value: &str, indent: usize| {
            let label = format!("{label}:");
            out.push_str(&format!("{}{label:<LABEL_WIDTH$}{value}\n", " ".repeat(indent)));
        };
        line(&mut out, "level", &self.level, 2);
        line(&mut out, "format_version", &super::format::FORMAT_VERSION.to_string(), 2);
        line(&mut out, "trace_schema_version", &super::format::TRACE_SCHEMA_VERSION.to_string(), 2);
        line(&mut out, "duration", &format!("{:.3}s", self.duration_s), 2);
        let digest =
            if self.sm_config_digest.is_empty() { "(none)" } else { &self.sm_config_digest };
        line(&mut out, "sm_config_digest", digest, 2);
        for (k, v) in &self.level_meta {
            line(&mut out, k, &py_str(v), 2);
        }
        line(&mut out, "total_records", &self.total_records().to_string(), 2);
        if self.ops.is_empty() {
            out.push_str("  ops: (none)\n");
        } else {
            out.push_str("  ops:\n");
            for (q, n) in &self.ops {
                out.push_str(&format!("    {q}: {n}\n"));
            }
        }
        if let Some(e) = &self.events {
            out.push_str("  events:\n");
            line(&mut out, "instances", &e.incarnations.len().to_string(), 4);
            for (instance, incs) in &e.incarnations {
                let list: Vec<String> = incs.iter().map(i64::to_string).collect();
                out.push_str(&format!(
                    "      {instance}: incarnations=[{}] restarts={}\n",
                    list.join(", "),
                    incs.len().saturating_sub(1)
                ));
            }
            out.push_str("    batches (type/tier/backend/shared):\n");
            for ((t, tier, backend, shared), n) in &e.batches {
                let backend = if backend.is_empty() { "-" } else { backend };
                let scope = if *shared { "shared" } else { "local" };
                out.push_str(&format!("      {t}/{tier}/{backend}/{scope}: {n}\n"));
            }
            out.push_str("    entries:\n");
            for (t, n) in &e.entries {
                out.push_str(&format!("      {t}: {n}\n"));
            }
            line(&mut out, "store_bytes", &e.store_bytes.to_string(), 4);
            line(&mut out, "entries_with_tokens", &e.entries_with_tokens.to_string(), 4);
            if !e.lifecycle.is_empty() {
                let marks: Vec<String> =
                    e.lifecycle.iter().map(|(k, v)| format!("{k}={v}")).collect();
                line(&mut out, "lifecycle", &marks.join(", "), 4);
            }
        }
        out
    }

    /// The same, as JSON (with what LMCache's report leaves out: malformed frames and a torn
    /// tail).
    pub fn to_json(&self, path: &str) -> serde_json::Value {
        let events = self.events.as_ref().map(|e| {
            serde_json::json!({
                "instances": e.incarnations.iter().map(|(i, incs)| (i.clone(), serde_json::json!({
                    "incarnations": incs.iter().collect::<Vec<_>>(),
                    "restarts": incs.len().saturating_sub(1),
                }))).collect::<serde_json::Map<_, _>>(),
                "batches": e.batches.iter().map(|((t, tier, b, sh), n)| serde_json::json!({
                    "event_type": t, "tier": tier, "backend": b, "shared": sh, "count": n,
                })).collect::<Vec<_>>(),
                "entries": e.entries,
                "store_bytes": e.store_bytes,
                "entries_with_tokens": e.entries_with_tokens,
                "lifecycle": e.lifecycle,
            })
        });
        serde_json::json!({
            "path": path,
            "level": self.level,
            "format_version": super::format::FORMAT_VERSION,
            "trace_schema_version": super::format::TRACE_SCHEMA_VERSION,
            "duration_s": self.duration_s,
            "sm_config_digest": self.sm_config_digest,
            "level_meta": self.level_meta.iter().map(|(k, v)| (k.clone(), super::codec::to_json(v))).collect::<serde_json::Map<_, _>>(),
            "total_records": self.total_records(),
            "ops": self.ops,
            "events": events,
            "malformed_frames": self.malformed,
            "truncated": self.truncated,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::codec::{EVENTS_BATCH, EVENTS_LIFECYCLE, args, from_json};
    use crate::trace::format::Level;

    #[test]
    fn python_str_of_values() {
        assert_eq!(py_str(&Value::from("x")), "x");
        assert_eq!(py_str(&Value::from(3)), "3");
        assert_eq!(py_str(&Value::F64(2.0)), "2.0");
        assert_eq!(py_str(&Value::F64(0.25)), "0.25");
        assert_eq!(py_str(&Value::Array(vec![Value::from("a"), Value::Nil])), "['a', None]");
    }

    #[test]
    fn an_events_file_reads_as_lmcache_prints_it() {
        let mut h = Header::new(Level::Events, 0.0, 0.0);
        h.level_meta = vec![
            ("lmcache_version".into(), Value::from("0.5.6")),
            ("instance_id".into(), Value::from("srv")),
            ("cache_event_schema_version".into(), Value::from(1)),
        ];
        let mut info = TraceInfo::new(&h);
        let rec = |q: &str, a: Value, t: f64| Record {
            t_mono: t,
            t_wall: t,
            qualname: q.into(),
            args: a,
        };
        info.add(&rec(EVENTS_LIFECYCLE, args(vec![("phase", Value::from("start"))]), 0.0));
        let batch = serde_json::json!({"instance_id": "srv", "incarnation": 5, "event_type": "store",
            "tier": "L1", "backend": "", "shared": false,
            "entries": [{"size_bytes": 10, "token_ids": [1, 2]}, {"size_bytes": 5, "token_ids": null}]});
        info.add(&rec(EVENTS_BATCH, from_json(&batch), 1.25));
        let text = info.render_text("f.lct");
        let want = "\
Trace file: f.lct
  level:                      events
  format_version:             1
  trace_schema_version:       1
  duration:                   1.250s
  sm_config_digest:           (none)
  cache_event_schema_version: 1
  instance_id:                srv
  lmcache_version:            0.5.6
  total_records:              2
  ops:
    events.batch: 1
    events.lifecycle: 1
  events:
    instances:                  1
      srv: incarnations=[5] restarts=0
    batches (type/tier/backend/shared):
      store/L1/-/local: 1
    entries:
      store: 2
    store_bytes:                15
    entries_with_tokens:        1
    lifecycle:                  start=1
";
        assert_eq!(text, want);
        assert_eq!(info.to_json("f.lct")["events"]["store_bytes"], 15);
    }
}
