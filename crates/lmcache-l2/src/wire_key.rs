//! The string form of an [`ObjectKey`] used as an object name by the portable adapters:
//! `<model>@<kv_rank 8 hex>@<group hex>@<hash hex>[@<salt>]`, LMCache's wire key. Model names
//! and salts may not contain `@` (LMCache refuses them too), so the form splits unambiguously.

use lmcache_core::{CacheSalt, ChunkHash, KvRank, ModelName, ObjectKey};

/// `key` as a wire key.
pub fn encode(key: &ObjectKey) -> String {
    let mut s = format!(
        "{}@{:08x}@{:x}@{}",
        key.model_name,
        key.kv_rank.packed(),
        key.object_group_id,
        key.chunk_hash.to_hex()
    );
    if !key.cache_salt.is_empty() {
        s.push('@');
        s.push_str(key.cache_salt.as_str());
    }
    s
}

/// Parses a wire key; `None` when it is not one.
pub fn decode(s: &str) -> Option<ObjectKey> {
    let mut parts = s.split('@');
    let model = parts.next()?;
    let rank = u32::from_str_radix(parts.next()?, 16).ok()?;
    let group = u32::from_str_radix(parts.next()?, 16).ok()?;
    let hash_hex = parts.next()?;
    let salt = parts.next().unwrap_or("");
    if parts.next().is_some() || hash_hex.len() != 64 {
        return None;
    }
    let mut hash = [0u8; 32];
    for (i, b) in hash.iter_mut().enumerate() {
        *b = u8::from_str_radix(hash_hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(ObjectKey {
        chunk_hash: ChunkHash(hash),
        model_name: ModelName::new(model).ok()?,
        kv_rank: KvRank::from_packed(rank).ok()?,
        object_group_id: group,
        cache_salt: CacheSalt::new(salt).ok()?,
    })
}

/// Undoes `%XX` escapes (object names as stores list them); `None` if malformed.
pub fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            out.push(u8::from_str_radix(s.get(i + 1..i + 3)?, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_with_and_without_salt() {
        for salt in ["", "tenant-a"] {
            let k = ObjectKey::new([0xab; 32], "org/model-7b", 2, 1, 3, salt).unwrap();
            let s = encode(&k);
            assert!(s.starts_with("org/model-7b@02010201@3@abab"), "{s}");
            assert_eq!(decode(&s), Some(k));
        }
    }

    #[test]
    fn rejects_malformed() {
        for s in ["", "m", "m@1@0@zz", "m@02010201@0@ab", "m@x@0@00", "m@1@0@00@s@extra"] {
            assert_eq!(decode(s), None, "{s}");
        }
    }
}
