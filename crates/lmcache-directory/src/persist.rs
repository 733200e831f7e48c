//! The directory as bytes, for the coordinator's checkpoint: a compact little-endian layout
//! (a key with one placement is 58 bytes) that restores at memory speed. Decoding checks every
//! id against the tables before it and never panics on any input; derived state (totals,
//! per-site and per-namespace bytes, token references) is recomputed, not trusted.
//!
//! Layout: `LMRSDIR2`, the table's hash seed (so keys restore in bucket order), then namespaces, instances, epochs, sites (with mounts), keys with
//! their placements, token bindings. Strings are `u32` length + UTF-8.

use std::sync::Arc;

use lmcache_core::le_reader::{LeReader, Truncated};

use crate::directory::{Directory, DirectoryConfig};
use crate::ids::{DirKey, InstanceId, Namespace, NsId, Site, SiteId, Tier};

const MAGIC: &[u8; 8] = b"LMRSDIR2";

/// Why bytes are not a directory.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    /// Not written by [`Directory::encode`] (or another version).
    #[error("not a directory image (bad magic)")]
    Magic,
    /// The bytes end early.
    #[error("truncated at byte {0}")]
    Truncated(usize),
    /// A name is not UTF-8.
    #[error("invalid UTF-8 at byte {0}")]
    Utf8(usize),
    /// An id refers past its table, or a value is out of range.
    #[error("invalid {what} at byte {at}")]
    Invalid {
        /// What.
        what: &'static str,
        /// Where.
        at: usize,
    },
    /// Bytes after the end.
    #[error("{0} trailing bytes")]
    Trailing(usize),
}

impl From<Truncated> for DecodeError {
    fn from(t: Truncated) -> Self {
        DecodeError::Truncated(t.0)
    }
}

/// What the image reads beyond [`LeReader`]'s integers.
trait ReadExt {
    /// A `u32` length and that many bytes of UTF-8.
    fn str(&mut self) -> Result<Arc<str>, DecodeError>;
    /// A `u64` count whose items take at least `min` bytes each: refused when the rest cannot
    /// hold them (so a forged count cannot make us reserve gigabytes).
    fn count(&mut self, min: usize) -> Result<usize, DecodeError>;
}

impl ReadExt for LeReader<'_> {
    fn str(&mut self) -> Result<Arc<str>, DecodeError> {
        let n = self.u32()? as usize;
        let at = self.at();
        let s = self.take(n)?;
        std::str::from_utf8(s).map(Arc::from).map_err(|_| DecodeError::Utf8(at))
    }
    fn count(&mut self, min: usize) -> Result<usize, DecodeError> {
        let at = self.at();
        let n = self.u64()? as usize;
        if !self.holds(n, min) {
            return Err(DecodeError::Invalid { what: "count", at });
        }
        Ok(n)
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// An image built a step at a time, so the coordinator can release its lock between steps
/// and events keep applying while a large directory is saved.
///
/// The image is *fuzzy*: each key is saved as it was when its step ran. Keys the events
/// changed during the build may be saved before or after the change, keys stored during it
/// may be missing; none is saved twice (a key's slot is visited once, and new keys go past
/// the slots the build visits). Every placement is a last-writer-wins register per (key,
/// site), so replaying the events from the build's start onto the decoded image gives the
/// directory the events give (the coordinator's JetStream replay does this; over HTTP, the
/// cursors saved at the start make the servers' next batches a gap, which is resynced).
#[derive(Debug)]
pub struct ImageBuilder {
    /// The first slot not yet visited, and the end of the slots that existed at the start.
    next: u32,
    end: u32,
    count: u64,
    records: Vec<u8>,
    /// The bound keys saved (their bindings are written at the end).
    bound: Vec<DirKey>,
    id: u64,
}

/// A finished image in three parts, concatenated outside any lock ([`ImageParts::concat`]).
#[derive(Debug)]
pub struct ImageParts {
    head: Vec<u8>,
    records: Vec<u8>,
    tail: Vec<u8>,
}

impl ImageParts {
    /// The image, as [`Directory::decode`] reads it.
    pub fn concat(self) -> Vec<u8> {
        let mut out = self.head;
        out.reserve(self.records.len() + self.tail.len());
        out.extend_from_slice(&self.records);
        out.extend_from_slice(&self.tail);
        out
    }
}

fn put_record(
    out: &mut Vec<u8>,
    key: &DirKey,
    placements: &[(SiteId, u32, u64)],
    ac: u32,
    la: u32,
) {
    out.extend_from_slice(&key.hash);
    out.extend_from_slice(&key.ns.0.to_le_bytes());
    out.extend_from_slice(&ac.to_le_bytes());
    out.extend_from_slice(&la.to_le_bytes());
    out.push(placements.len().min(255) as u8);
    for (site, epoch, size) in placements.iter().take(255) {
        out.extend_from_slice(&site.0.to_le_bytes());
        out.extend_from_slice(&epoch.to_le_bytes());
        out.extend_from_slice(&size.to_le_bytes());
    }
}

impl Directory {
    /// Appends this directory's image to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        self.put_head(out, self.stats().keys);
        self.for_each_record(|key, placements, ac, la| put_record(out, key, placements, ac, la));
        self.put_bindings(out, self.bindings_list());
    }

    /// Starts an image built in steps ([`Directory::image_step`], [`Directory::image_finish`];
    /// see [`ImageBuilder`]). Until it finishes, freed slots are not reused (new keys append),
    /// so no key can move into a slot the build has yet to visit. Starting another build
    /// abandons this one.
    pub fn image_builder(&mut self) -> ImageBuilder {
        self.builds += 1;
        let id = self.builds;
        self.keys_pause_reuse(true);
        ImageBuilder {
            next: 0,
            end: self.slot_count(),
            count: 0,
            // A key with one placement saves 58 bytes: reserved up front, so no step pays
            // for copying the buffer to a larger one.
            records: Vec::with_capacity(usize::try_from(self.stats().keys).unwrap_or(0) * 58),
            bound: Vec::new(),
            id,
        }
    }

    /// Saves up to `max_slots` more slots of the build; true when none is left.
    pub fn image_step(&self, b: &mut ImageBuilder, max_slots: usize) -> bool {
        let to = b.next.saturating_add(u32::try_from(max_slots).unwrap_or(u32::MAX)).min(b.end);
        self.for_each_record_in(b.next, to, |key, placements, ac, la, bound| {
            put_record(&mut b.records, key, placements, ac, la);
            b.count += 1;
            if bound {
                b.bound.push(*key);
            }
        });
        b.next = to;
        b.next >= b.end
    }

    /// Saves what the steps left, then the tables (as they are now: ids only grow, so every
    /// id a saved placement names is in them) and the token bindings of the saved keys, and
    /// lets freed slots be reused again.
    pub fn image_finish(&mut self, mut b: ImageBuilder) -> ImageParts {
        self.image_step(&mut b, usize::MAX);
        if b.id == self.builds {
            self.keys_pause_reuse(false);
        }
        let mut head = Vec::new();
        self.put_head(&mut head, b.count);
        let mut tail = Vec::new();
        self.put_bindings(&mut tail, self.bindings_of(&b.bound));
        ImageParts { head, records: b.records, tail }
    }

    fn put_head(&self, out: &mut Vec<u8>, keys: u64) {
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.seed().to_le_bytes());
        let p = self.parts();
        out.extend_from_slice(&(p.namespaces.len() as u64).to_le_bytes());
        for ns in p.namespaces {
            put_str(out, &ns.model);
            out.extend_from_slice(&ns.kv_rank.to_le_bytes());
            out.extend_from_slice(&ns.object_group.to_le_bytes());
            put_str(out, &ns.cache_salt);
        }
        out.extend_from_slice(&(p.instances.len() as u64).to_le_bytes());
        for i in p.instances {
            put_str(out, i);
        }
        out.extend_from_slice(&(p.epochs.len() as u64).to_le_bytes());
        for (inst, inc) in p.epochs {
            out.extend_from_slice(&inst.0.to_le_bytes());
            out.extend_from_slice(&inc.to_le_bytes());
        }
        out.extend_from_slice(&(p.sites.len() as u64).to_le_bytes());
        for (site, mounts) in p.sites.iter().zip(p.mounts) {
            out.push(site.tier as u8);
            put_str(out, &site.backend);
            match site.owner {
                Some(o) => {
                    out.push(1);
                    out.extend_from_slice(&o.0.to_le_bytes());
                }
                None => out.push(0),
            }
            out.extend_from_slice(&(mounts.len() as u64).to_le_bytes());
            for m in mounts {
                out.extend_from_slice(&m.0.to_le_bytes());
            }
        }
        out.extend_from_slice(&keys.to_le_bytes());
    }

    fn put_bindings(&self, out: &mut Vec<u8>, bindings: Vec<crate::directory::SavedBinding>) {
        out.extend_from_slice(&(bindings.len() as u64).to_le_bytes());
        for (hash, offset, tokens, holders) in bindings {
            out.extend_from_slice(&hash);
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
            for t in tokens {
                out.extend_from_slice(&t.to_le_bytes());
            }
            out.extend_from_slice(&(holders.len() as u32).to_le_bytes());
            for ns in holders {
                out.extend_from_slice(&ns.0.to_le_bytes());
            }
        }
    }

    /// A directory from an image [`Directory::encode`] wrote.
    pub fn decode(bytes: &[u8], config: DirectoryConfig) -> Result<Directory, DecodeError> {
        let mut r = LeReader::new(bytes);
        if r.take(8)? != MAGIC {
            return Err(DecodeError::Magic);
        }
        let seed = r.u64()?;
        let mut d = Directory::with_seed(config, seed);
        let n = r.count(16)?;
        for _ in 0..n {
            let ns = Namespace {
                model: r.str()?,
                kv_rank: r.u32()?,
                object_group: r.u32()?,
                cache_salt: r.str()?,
            };
            let at = r.at();
            if ns.world_size() == 0 {
                return Err(DecodeError::Invalid { what: "kv_rank", at });
            }
            let id =
                d.namespace(&ns).map_err(|_| DecodeError::Invalid { what: "namespace", at })?;
            if id.0 as usize + 1 != d.namespace_count() {
                return Err(DecodeError::Invalid { what: "duplicate namespace", at });
            }
        }
        let n_ns = d.namespace_count();
        let n = r.count(4)?;
        for _ in 0..n {
            let at = r.at();
            let name = r.str()?;
            let id =
                d.instance(&name).map_err(|_| DecodeError::Invalid { what: "instance", at })?;
            if id.0 as usize + 1 != d.instance_count() {
                return Err(DecodeError::Invalid { what: "duplicate instance", at });
            }
        }
        let n_inst = d.instance_count() as u32;
        let n = r.count(12)?;
        let mut epochs = Vec::with_capacity(n);
        for _ in 0..n {
            let at = r.at();
            let inst = r.u32()?;
            let inc = r.u64()?;
            if inst >= n_inst {
                return Err(DecodeError::Invalid { what: "epoch instance", at });
            }
            epochs.push((InstanceId(inst), inc));
        }
        let n = r.count(14)?;
        let mut sites = Vec::with_capacity(n);
        for _ in 0..n {
            let at = r.at();
            let tier = match r.u8()? {
                0 => Tier::L1,
                1 => Tier::L2,
                _ => return Err(DecodeError::Invalid { what: "tier", at }),
            };
            let backend = r.str()?;
            let owner = match r.u8()? {
                0 => None,
                1 => {
                    let o = r.u32()?;
                    if o >= n_inst {
                        return Err(DecodeError::Invalid { what: "site owner", at });
                    }
                    Some(InstanceId(o))
                }
                _ => return Err(DecodeError::Invalid { what: "site owner flag", at }),
            };
            let m = r.count(4)?;
            let mut mounts = Vec::with_capacity(m);
            for _ in 0..m {
                let at = r.at();
                let i = r.u32()?;
                if i >= n_inst {
                    return Err(DecodeError::Invalid { what: "mount", at });
                }
                mounts.push(InstanceId(i));
            }
            sites.push((Site { tier, backend, owner }, mounts));
        }
        d.restore_tables(epochs, sites)
            .map_err(|_| DecodeError::Invalid { what: "site table", at: r.at() })?;
        let n_sites = d.sites().count() as u32;
        let n_epochs = d.epoch_count() as u32;
        let n = r.count(45)?;
        d.reserve(n);
        let mut placements = Vec::new();
        for _ in 0..n {
            let at = r.at();
            let hash = r.array()?;
            let ns = r.u32()?;
            if ns as usize >= n_ns {
                return Err(DecodeError::Invalid { what: "key namespace", at });
            }
            let access_count = r.u32()?;
            let last_access = r.u32()?;
            let k = r.u8()? as usize;
            if k == 0 {
                return Err(DecodeError::Invalid { what: "key without placements", at });
            }
            placements.clear();
            for _ in 0..k {
                let at = r.at();
                let (site, epoch, size) = (r.u32()?, r.u32()?, r.u64()?);
                if site >= n_sites || epoch >= n_epochs {
                    return Err(DecodeError::Invalid { what: "placement", at });
                }
                placements.push((SiteId(site), epoch, size));
            }
            if !d.restore_record(
                DirKey { hash, ns: NsId(ns) },
                &placements,
                access_count,
                last_access,
            ) {
                return Err(DecodeError::Invalid { what: "duplicate key or placement", at });
            }
        }
        if !d.index_restored() {
            return Err(DecodeError::Invalid { what: "duplicate key", at: r.at() });
        }
        let n = r.count(48)?;
        for _ in 0..n {
            let hash = r.array()?;
            let offset = r.u64()? as i64;
            let at = r.at();
            let t = r.u32()? as usize;
            if t == 0 || !r.holds(t, 4) {
                return Err(DecodeError::Invalid { what: "token count", at });
            }
            let tokens: Vec<u32> = (0..t).map(|_| r.u32()).collect::<Result<_, _>>()?;
            let at = r.at();
            let h = r.u32()? as usize;
            if h == 0 || !r.holds(h, 4) {
                return Err(DecodeError::Invalid { what: "binding holders", at });
            }
            let holders: Vec<NsId> = (0..h).map(|_| r.u32().map(NsId)).collect::<Result<_, _>>()?;
            if !d.restore_binding(&hash, &tokens, offset, &holders) {
                return Err(DecodeError::Invalid { what: "binding", at });
            }
        }
        if r.remaining() > 0 {
            return Err(DecodeError::Trailing(r.remaining()));
        }
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DirectoryConfig, Entry, EventKind};

    #[test]
    fn an_image_naming_a_key_twice_is_refused() {
        let mut d = Directory::new(DirectoryConfig::default());
        let ns = d
            .namespace(&Namespace {
                model: "m".into(),
                kv_rank: 0x0100_0100,
                object_group: 0,
                cache_salt: "".into(),
            })
            .unwrap();
        let a = d.instance("a").unwrap();
        let l1 = d.site(a, Tier::L1, "dram", false).unwrap();
        let e = |b: u8| Entry {
            key: DirKey { hash: [b; 32], ns },
            size: 1,
            tokens: &[],
            token_offset: -1,
        };
        d.apply(a, 1, EventKind::Store, l1, 0.0, &[e(0xa1), e(0xb2)]).unwrap();
        let mut image = Vec::new();
        d.encode(&mut image);
        assert!(Directory::decode(&image, DirectoryConfig::default()).is_ok());
        let at = image.windows(32).position(|w| w == [0xb2; 32]).unwrap();
        image[at..at + 32].copy_from_slice(&[0xa1; 32]);
        let err = Directory::decode(&image, DirectoryConfig::default()).unwrap_err();
        assert!(matches!(err, DecodeError::Invalid { what: "duplicate key", .. }), "{err:?}");
    }
}
