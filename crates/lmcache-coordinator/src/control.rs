//! Operator intent: per-salt L2 quotas (with an optional default) and L2 pins, as LMCache's
//! fleet eviction controller keeps them, plus the metadata document they persist in
//! (`--metadata-path`, LMCache's JSON shape, rewritten before a changing request answers).

use std::collections::BTreeMap;

use lmcache_protocol::coordinator::EncodedObjectKey;
use serde_json::{Value, json};

/// GiB, as LMCache counts quotas.
pub const GIB: f64 = (1u64 << 30) as f64;

#[derive(Debug, Clone, Copy)]
struct Pin {
    count: u64,
    order: u64,
}

/// Quotas and pins.
#[derive(Debug, Default)]
pub struct Control {
    quotas: BTreeMap<String, u64>,
    default_limit: Option<u64>,
    pins: BTreeMap<EncodedObjectKey, Pin>,
    next_order: u64,
}

/// A pin covers every object group of a chunk: its key with the group zeroed.
pub fn pin_key(k: &EncodedObjectKey) -> EncodedObjectKey {
    EncodedObjectKey { object_group_id: 0, ..k.clone() }
}

impl Control {
    /// Sets `salt`'s L2 limit.
    pub fn set_quota(&mut self, salt: &str, bytes: u64) {
        self.quotas.insert(salt.to_string(), bytes);
    }

    /// Removes `salt`'s limit; whether it had one.
    pub fn delete_quota(&mut self, salt: &str) -> bool {
        self.quotas.remove(salt).is_some()
    }

    /// Sets the limit of salts without their own (None: they are exempt).
    pub fn set_default(&mut self, bytes: Option<u64>) {
        self.default_limit = bytes;
    }

    /// The default limit.
    pub fn default_limit(&self) -> Option<u64> {
        self.default_limit
    }

    /// `salt`'s explicit limit.
    pub fn quota(&self, salt: &str) -> Option<u64> {
        self.quotas.get(salt).copied()
    }

    /// Every explicit limit.
    pub fn quotas(&self) -> &BTreeMap<String, u64> {
        &self.quotas
    }

    /// The limit that applies to `salt`: its own, else the default, else none (exempt).
    pub fn limit_for(&self, salt: &str) -> Option<u64> {
        self.quota(salt).or(self.default_limit)
    }

    /// One more pin on each key (deduplicated per call); returns how many keys.
    pub fn pin(&mut self, keys: &[EncodedObjectKey]) -> usize {
        let mut seen = std::collections::BTreeSet::new();
        for k in keys {
            let pk = pin_key(k);
            if !seen.insert(pk.clone()) {
                continue;
            }
            let order = self.next_order;
            let p = self.pins.entry(pk).or_insert_with(|| Pin { count: 0, order });
            if p.count == 0 {
                self.next_order += 1;
            }
            p.count += 1;
        }
        seen.len()
    }

    /// One pin fewer on each pinned key; returns how many keys it affected.
    pub fn unpin(&mut self, keys: &[EncodedObjectKey]) -> usize {
        let mut seen = std::collections::BTreeSet::new();
        let mut n = 0;
        for k in keys {
            let pk = pin_key(k);
            if !seen.insert(pk.clone()) {
                continue;
            }
            if let Some(p) = self.pins.get_mut(&pk) {
                n += 1;
                p.count -= 1;
                if p.count == 0 {
                    self.pins.remove(&pk);
                }
            }
        }
        n
    }

    /// Drops every pin of `keys` (a forced delete).
    pub fn drop_pins(&mut self, keys: &[EncodedObjectKey]) {
        for k in keys {
            self.pins.remove(&pin_key(k));
        }
    }

    /// Whether `key` (any object group) is pinned.
    pub fn is_pinned(&self, key: &EncodedObjectKey) -> bool {
        self.pins.contains_key(&pin_key(key))
    }

    /// A page of pins in first-pinned order, filtered by salt and model ("" = any model).
    pub fn list_pins(
        &self,
        salt: &str,
        model: &str,
        offset: usize,
        limit: usize,
    ) -> (usize, Vec<(EncodedObjectKey, u64)>) {
        let mut all: Vec<(&EncodedObjectKey, &Pin)> = self
            .pins
            .iter()
            .filter(|(k, _)| k.cache_salt == salt && (model.is_empty() || k.model_name == model))
            .collect();
        all.sort_by_key(|(_, p)| p.order);
        let total = all.len();
        (
            total,
            all.into_iter().skip(offset).take(limit).map(|(k, p)| (k.clone(), p.count)).collect(),
        )
    }

    /// LMCache's metadata document.
    pub fn metadata(&self, saved_at: f64) -> Value {
        let mut pins: Vec<(&EncodedObjectKey, &Pin)> = self.pins.iter().collect();
        pins.sort_by_key(|(_, p)| p.order);
        json!({
            "version": 1,
            "saved_at": saved_at,
            "components": {
                "pins": {"entries": pins.into_iter().map(|(k, p)| json!({"key": k, "count": p.count})).collect::<Vec<_>>()},
                "quotas": {"limits": self.quotas, "default_limit_bytes": self.default_limit},
            }
        })
    }

    /// State from a metadata document, or what is wrong with it.
    pub fn from_metadata(doc: &Value) -> Result<Self, String> {
        if doc["version"] != 1 {
            return Err(format!("version {} is not 1", doc["version"]));
        }
        let mut c = Control::default();
        let q = &doc["components"]["quotas"];
        if let Some(limits) = q["limits"].as_object() {
            for (salt, v) in limits {
                c.quotas.insert(
                    salt.clone(),
                    v.as_u64().ok_or_else(|| format!("quota of {salt:?} is not a byte count"))?,
                );
            }
        }
        c.default_limit = match &q["default_limit_bytes"] {
            Value::Null => None,
            v => Some(v.as_u64().ok_or("default_limit_bytes is not a byte count")?),
        };
        for e in doc["components"]["pins"]["entries"].as_array().into_iter().flatten() {
            let key: EncodedObjectKey =
                serde_json::from_value(e["key"].clone()).map_err(|e| format!("pin key: {e}"))?;
            key.validate()?;
            let count = e["count"]
                .as_u64()
                .filter(|&n| n > 0)
                .ok_or("pin count is not a positive integer")?;
            let order = c.next_order;
            c.next_order += 1;
            c.pins.insert(pin_key(&key), Pin { count, order });
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8, group: u32) -> EncodedObjectKey {
        EncodedObjectKey {
            chunk_hash_hex: format!("{b:02x}").repeat(32),
            model_name: "m".into(),
            kv_rank: 0x0100_0100,
            object_group_id: group,
            cache_salt: "t".into(),
        }
    }

    #[test]
    fn pins_count_per_chunk_across_groups_and_round_trip() {
        let mut c = Control::default();
        assert_eq!(c.pin(&[key(1, 0), key(1, 3), key(2, 0)]), 2, "groups of one chunk are one pin");
        c.pin(&[key(1, 0)]);
        assert!(c.is_pinned(&key(1, 7)));
        assert_eq!(c.unpin(&[key(1, 0)]), 1);
        assert!(c.is_pinned(&key(1, 0)), "pinned twice, unpinned once");
        c.set_quota("t", 5 << 30);
        c.set_default(Some(1));
        let back = Control::from_metadata(&c.metadata(1.0)).unwrap();
        assert_eq!(back.list_pins("t", "", 0, 10), c.list_pins("t", "", 0, 10));
        assert_eq!((back.quota("t"), back.default_limit()), (Some(5 << 30), Some(1)));
        assert_eq!(back.limit_for("other"), Some(1));
        assert!(Control::from_metadata(&json!({"version": 2})).is_err());
        c.drop_pins(&[key(1, 2), key(2, 0)]);
        assert_eq!(c.list_pins("t", "", 0, 10).0, 0);
    }
}
