//! Interned names: namespaces, instances, backends and placement sites.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use crate::DirectoryError;

/// The tier a placement lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// CPU memory of one server.
    L1,
    /// Storage below L1 (disk, Redis, S3, ...), private or shared.
    L2,
}

impl Tier {
    /// LMCache's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::L1 => "l1",
            Tier::L2 => "l2",
        }
    }
}

/// Everything of an object key but its chunk hash: model, packed kv rank, object group and
/// cache salt. Interned as an [`NsId`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Namespace {
    /// Model name.
    pub model: Arc<str>,
    /// LMCache's packed kv_rank (`world_size<<24 | rank<<16 | local_world<<8 | local_rank`).
    pub kv_rank: u32,
    /// Object group (hybrid models); 0 otherwise.
    pub object_group: u32,
    /// Tenant salt; empty for none.
    pub cache_salt: Arc<str>,
}

impl Namespace {
    /// The world size packed in the kv rank.
    pub fn world_size(&self) -> u32 {
        self.kv_rank >> 24
    }
}

/// An interned [`Namespace`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NsId(pub(crate) u32);

/// An interned instance id (a server's name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InstanceId(pub(crate) u32);

impl InstanceId {
    /// The raw index (dense from 0, in first-seen order).
    pub fn index(self) -> u32 {
        self.0
    }
}

/// Where a placement lives: a tier and backend, owned by one instance or shared.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Site {
    /// Tier.
    pub tier: Tier,
    /// Backend within the tier (`dram`, `fs`, `s3`, ...).
    pub backend: Arc<str>,
    /// The owning instance; `None` for a shared pool.
    pub owner: Option<InstanceId>,
}

/// An interned [`Site`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SiteId(pub(crate) u32);

/// A key as the directory stores it: the 32-byte chunk hash and its interned namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirKey {
    /// The chunk hash (a BLAKE3 prefix chain from LMCache's clients; nothing here relies on
    /// it being uniform).
    pub hash: [u8; 32],
    /// Its namespace.
    pub ns: NsId,
}

impl Hash for DirKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // All 32 bytes: chunk hashes come from clients, and a table hash over part of them
        // lets a client that varies only the rest put every key in one bucket chain (keys
        // that differ only in their last bytes made one table probe scan every key).
        state.write(&self.hash);
        state.write_u32(self.ns.0);
    }
}

/// A name ↔ dense id table.
#[derive(Debug)]
pub(crate) struct Interner<T: Eq + Hash + Clone> {
    ids: std::collections::HashMap<T, u32, foldhash::fast::RandomState>,
    names: Vec<T>,
    what: &'static str,
}

impl<T: Eq + Hash + Clone> Interner<T> {
    pub(crate) fn new(what: &'static str) -> Self {
        Self { ids: Default::default(), names: Vec::new(), what }
    }

    pub(crate) fn intern(&mut self, name: &T) -> Result<u32, DirectoryError> {
        if let Some(&id) = self.ids.get(name) {
            return Ok(id);
        }
        let id =
            u32::try_from(self.names.len()).map_err(|_| DirectoryError::Exhausted(self.what))?;
        self.ids.insert(name.clone(), id);
        self.names.push(name.clone());
        Ok(id)
    }

    pub(crate) fn find(&self, name: &T) -> Option<u32> {
        self.ids.get(name).copied()
    }

    pub(crate) fn get(&self, id: u32) -> Result<&T, DirectoryError> {
        self.names.get(id as usize).ok_or(DirectoryError::UnknownId { what: self.what, id })
    }

    pub(crate) fn len(&self) -> usize {
        self.names.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher as _;

    #[test]
    fn keys_differing_only_in_their_last_bytes_hash_apart() {
        let h = foldhash::fast::FixedState::with_seed(7);
        let hashes: std::collections::HashSet<u64> = (0..1000u64)
            .map(|i| {
                let mut hash = [0u8; 32];
                hash[24..].copy_from_slice(&i.to_be_bytes());
                h.hash_one(DirKey { hash, ns: NsId(0) })
            })
            .collect();
        assert_eq!(hashes.len(), 1000);
        let ns: std::collections::HashSet<u64> =
            (0..100).map(|n| h.hash_one(DirKey { hash: [0; 32], ns: NsId(n) })).collect();
        assert_eq!(ns.len(), 100, "namespaces hash apart too");
    }
}
