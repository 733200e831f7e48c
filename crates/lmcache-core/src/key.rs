//! Object keys: the identity of one stored KV object.
//!
//! An [`ObjectKey`] names one chunk of one model's KV cache, for one shard (`kv_rank`), one
//! object group (hybrid models) and one tenant (`cache_salt`). Its parts are validated when
//! they are built, so a key that exists is a valid key: the string parts are newtypes
//! ([`ModelName`], [`CacheSalt`]) that can only be made through their checks.
//!
//! The string parts are reference counted (`Arc<str>`), so cloning a key, which the L1 index
//! and the eviction policies do on every admission, costs two counter increments and no
//! allocation.

use std::fmt;
use std::sync::Arc;

use crate::error::KeyError;

/// Longest `cache_salt` LMCache accepts, in characters.
pub const MAX_CACHE_SALT_LEN: usize = 128;

/// The 32-byte BLAKE3 hash of a token chunk and its whole prefix.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkHash(pub [u8; 32]);

impl ChunkHash {
    /// Builds a hash from a byte slice of exactly 32 bytes.
    pub fn from_slice(bytes: &[u8]) -> Result<Self, KeyError> {
        let arr: [u8; 32] = bytes
            .try_into()
            .map_err(|_| KeyError::ChunkHashLength { expected: 32, got: bytes.len() })?;
        Ok(Self(arr))
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lower-case hex, 64 characters.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The first 8 bytes as a little-endian integer: a well-mixed value for sharding and
    /// ghost lists (the hash is already uniformly distributed).
    pub fn short(&self) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.0[..8]);
        u64::from_le_bytes(b)
    }
}

impl fmt::Debug for ChunkHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkHash({})", &self.to_hex()[..16])
    }
}

impl fmt::Display for ChunkHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// A model name: non-empty, without `@`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelName(Arc<str>);

impl ModelName {
    /// Validates and wraps a model name.
    pub fn new(name: &str) -> Result<Self, KeyError> {
        if name.is_empty() {
            return Err(KeyError::EmptyModelName);
        }
        if name.contains('@') {
            return Err(KeyError::ModelNameContainsAt { model_name: name.to_owned() });
        }
        Ok(Self(Arc::from(name)))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ModelName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for ModelName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A tenant isolation label: at most 128 characters, none of `@ / \ NUL`. Empty is the
/// default tenant (shown as `_default` by the HTTP API).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct CacheSalt(Option<Arc<str>>);

impl CacheSalt {
    /// The empty salt of the default tenant.
    pub const EMPTY: CacheSalt = CacheSalt(None);

    /// Validates and wraps a salt.
    pub fn new(salt: &str) -> Result<Self, KeyError> {
        if salt.is_empty() {
            return Ok(Self::EMPTY);
        }
        let len = salt.chars().count();
        if len > MAX_CACHE_SALT_LEN {
            return Err(KeyError::CacheSaltTooLong { len, max: MAX_CACHE_SALT_LEN });
        }
        if let Some(ch) = salt.chars().find(|c| matches!(c, '@' | '/' | '\\' | '\0')) {
            return Err(KeyError::CacheSaltForbiddenChar { cache_salt: salt.to_owned(), ch });
        }
        Ok(Self(Some(Arc::from(salt))))
    }

    /// The salt, `""` for the default tenant.
    pub fn as_str(&self) -> &str {
        self.0.as_deref().unwrap_or("")
    }

    /// True for the default tenant.
    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }
}

impl fmt::Debug for CacheSalt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for CacheSalt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The packed parallelism descriptor of a KV shard:
/// `world_size<<24 | worker_id<<16 | world_size<<8 | worker_id`, one byte each.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct KvRank(u32);

impl KvRank {
    /// Packs a rank; `world_size` in `1..=255`, `worker_id < world_size`.
    pub fn new(world_size: u32, worker_id: u32) -> Result<Self, KeyError> {
        if world_size == 0 || world_size > 255 {
            return Err(KeyError::WorldSizeOutOfRange { world_size });
        }
        if worker_id >= world_size {
            return Err(KeyError::WorkerIdOutOfRange { worker_id, world_size });
        }
        Ok(Self(world_size << 24 | worker_id << 16 | world_size << 8 | worker_id))
    }

    /// Interprets an already packed value (as found in L2 key encodings). The global and
    /// local bytes may differ in LMCache's general form, so only the world size byte is
    /// checked.
    pub fn from_packed(packed: u32) -> Result<Self, KeyError> {
        let world_size = packed >> 24;
        if world_size == 0 {
            return Err(KeyError::WorldSizeOutOfRange { world_size });
        }
        let worker_id = (packed >> 16) & 0xff;
        if worker_id >= world_size {
            return Err(KeyError::WorkerIdOutOfRange { worker_id, world_size });
        }
        Ok(Self(packed))
    }

    /// The packed value.
    pub fn packed(self) -> u32 {
        self.0
    }

    /// The world size (top byte).
    pub fn world_size(self) -> u32 {
        self.0 >> 24
    }

    /// The global worker id (second byte).
    pub fn worker_id(self) -> u32 {
        (self.0 >> 16) & 0xff
    }

    /// Every rank of a world of `world_size` workers, as a lookup without a `worker_id`
    /// fans out.
    pub fn all(world_size: u32) -> Result<impl Iterator<Item = KvRank>, KeyError> {
        KvRank::new(world_size, 0)?;
        Ok((0..world_size).map(move |w| KvRank(world_size << 24 | w << 16 | world_size << 8 | w)))
    }
}

/// The identity of one stored object. Equality and hashing cover all five fields.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct ObjectKey {
    /// Hash of the chunk's tokens and its whole prefix.
    pub chunk_hash: ChunkHash,
    /// The model.
    pub model_name: ModelName,
    /// Which shard of the KV.
    pub kv_rank: KvRank,
    /// Which object group (hybrid models); 0 for plain models.
    pub object_group_id: u32,
    /// The tenant.
    pub cache_salt: CacheSalt,
}

impl ObjectKey {
    /// Builds a key from raw parts, validating each.
    pub fn new(
        chunk_hash: [u8; 32],
        model_name: &str,
        world_size: u32,
        worker_id: u32,
        object_group_id: u32,
        cache_salt: &str,
    ) -> Result<Self, KeyError> {
        Ok(Self {
            chunk_hash: ChunkHash(chunk_hash),
            model_name: ModelName::new(model_name)?,
            kv_rank: KvRank::new(world_size, worker_id)?,
            object_group_id,
            cache_salt: CacheSalt::new(cache_salt)?,
        })
    }
}

impl fmt::Display for ObjectKey {
    /// `model@kv_rank@group@hash_hex[@salt]`, the field order of LMCache's key strings.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}@{}@{}@{}",
            self.model_name,
            self.kv_rank.packed(),
            self.object_group_id,
            self.chunk_hash
        )?;
        if !self.cache_salt.is_empty() {
            write!(f, "@{}", self.cache_salt)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_rank_packs_like_lmcache() {
        let r = KvRank::new(2, 1).unwrap();
        assert_eq!(r.packed(), 0x0201_0201);
        assert_eq!(r.world_size(), 2);
        assert_eq!(r.worker_id(), 1);
        assert_eq!(KvRank::new(1, 0).unwrap().packed(), 0x0100_0100);
        assert_eq!(KvRank::from_packed(0x0201_0201).unwrap(), r);
    }

    #[test]
    fn kv_rank_rejects_bad_values() {
        assert_eq!(KvRank::new(0, 0), Err(KeyError::WorldSizeOutOfRange { world_size: 0 }));
        assert_eq!(KvRank::new(256, 0), Err(KeyError::WorldSizeOutOfRange { world_size: 256 }));
        assert_eq!(
            KvRank::new(2, 2),
            Err(KeyError::WorkerIdOutOfRange { worker_id: 2, world_size: 2 })
        );
        assert!(KvRank::from_packed(0).is_err());
        assert!(KvRank::from_packed(0x0105_0000).is_err());
    }

    #[test]
    fn kv_rank_fan_out_covers_every_worker() {
        let ranks: Vec<_> = KvRank::all(4).unwrap().map(|r| r.worker_id()).collect();
        assert_eq!(ranks, vec![0, 1, 2, 3]);
        assert!(KvRank::all(0).is_err());
    }

    #[test]
    fn model_name_validation() {
        assert!(ModelName::new("meta-llama/Llama-3-8B").is_ok());
        assert_eq!(ModelName::new(""), Err(KeyError::EmptyModelName));
        assert!(matches!(ModelName::new("a@b"), Err(KeyError::ModelNameContainsAt { .. })));
    }

    #[test]
    fn cache_salt_validation() {
        assert!(CacheSalt::new("").unwrap().is_empty());
        assert_eq!(CacheSalt::new("tenant-1").unwrap().as_str(), "tenant-1");
        assert!(CacheSalt::new(&"x".repeat(128)).is_ok());
        assert_eq!(
            CacheSalt::new(&"x".repeat(129)),
            Err(KeyError::CacheSaltTooLong { len: 129, max: 128 })
        );
        // Length counts characters, not bytes.
        assert!(CacheSalt::new(&"é".repeat(128)).is_ok());
        for bad in ["a@b", "a/b", "a\\b", "a\0b"] {
            assert!(
                matches!(CacheSalt::new(bad), Err(KeyError::CacheSaltForbiddenChar { .. })),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn keys_differ_by_every_field() {
        let base = ObjectKey::new([1; 32], "m", 2, 0, 0, "").unwrap();
        let variants = [
            ObjectKey::new([2; 32], "m", 2, 0, 0, "").unwrap(),
            ObjectKey::new([1; 32], "n", 2, 0, 0, "").unwrap(),
            ObjectKey::new([1; 32], "m", 2, 1, 0, "").unwrap(),
            ObjectKey::new([1; 32], "m", 2, 0, 1, "").unwrap(),
            ObjectKey::new([1; 32], "m", 2, 0, 0, "s").unwrap(),
        ];
        for v in &variants {
            assert_ne!(&base, v);
        }
        assert_eq!(base, base.clone());
    }

    #[test]
    fn display_is_lmcache_field_order() {
        let k = ObjectKey::new([0xab; 32], "m", 1, 0, 3, "t").unwrap();
        let s = k.to_string();
        assert!(s.starts_with("m@16777472@3@abab"), "{s}");
        assert!(s.ends_with("@t"));
        let k = ObjectKey::new([0xab; 32], "m", 1, 0, 3, "").unwrap();
        assert!(!k.to_string().ends_with('@'));
    }

    #[test]
    fn chunk_hash_from_slice_checks_length() {
        assert!(ChunkHash::from_slice(&[0; 32]).is_ok());
        assert_eq!(
            ChunkHash::from_slice(&[0; 31]),
            Err(KeyError::ChunkHashLength { expected: 32, got: 31 })
        );
    }
}
