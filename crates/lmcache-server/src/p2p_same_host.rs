//! The native channel's same-host path: when a peer's L1 pool is a shared-memory segment on
//! this host, the reader copies the objects the peer locked straight out of that segment into
//! its own L1 reservations, one copy and no socket.
//!
//! A server whose L1 is a segment lmcache-rs created registers it with the coordinator in its
//! metadata (`p2p_shm`: the name; `p2p_shm_id`: this kernel's boot id, the segment's device
//! and inode). A reader maps a peer's segment only when every check holds:
//! - the name carries lmcache-rs's ownership marker (never a segment we did not create);
//! - the boot id is this kernel's;
//! - the file under that name is the advertised device and inode, checked again before every
//!   fetch (a peer that restarted has a new segment under the same name: the old mapping is
//!   dropped, never read).
//!
//! Otherwise, or when a copy fails, the fetch goes over TCP ([`crate::p2p_channel`]). The
//! copies are bounds-checked against the mapping ([`ForeignSegment::read`]), and a segment
//! its owner shrank faults into a miss, not a crash. No checksum is computed: no transport
//! stands between the bytes the peer locked and the reservation (the TCP path's checksum
//! guards a socket), and peers are trusted for their own KV as MP clients are.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;
use std::sync::Arc;

use lmcache_l1::WriteReservation;
use lmcache_memory::{ArenaAllocator, ForeignSegment};
use lmcache_protocol::types::TransferAddress;
use parking_lot::Mutex;

use crate::p2p_channel::ChannelError;
use crate::p2p_peers::Peer;

/// The metadata key of the segment's name.
pub const SHM_KEY: &str = "p2p_shm";
/// The metadata key of its identity: `<boot id>:<device>:<inode>`.
pub const SHM_ID_KEY: &str = "p2p_shm_id";

/// This kernel's boot id (`None` where /proc does not say).
fn boot_id() -> Option<String> {
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    Some(id.trim().to_owned()).filter(|s| !s.is_empty())
}

/// What a server registers for its L1 pool: `(name, identity)`, when the pool is a segment
/// lmcache-rs created.
pub fn advertised(memory: &ArenaAllocator) -> Option<(String, String)> {
    let arena = memory.arena();
    let name = arena.shm_name()?;
    let (dev, ino) = arena.shm_file_id()?;
    if !lmcache_memory::shm::is_ours(name) {
        return None;
    }
    Some((name.to_owned(), format!("{}:{dev}:{ino}", boot_id()?)))
}

/// A peer's pool, mapped.
struct Mapped {
    seg: ForeignSegment,
    /// The identity it was checked against.
    id: String,
}

/// The reader's mappings of its same-host peers' pools, by instance id.
pub struct SameHost {
    boot_id: Option<String>,
    mapped: Mutex<HashMap<String, Arc<Mapped>>>,
}

impl std::fmt::Debug for SameHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SameHost").field("peers", &self.mapped.lock().len()).finish()
    }
}

impl SameHost {
    /// No mappings yet; `on: false` (`--p2p-same-host false`) sends every fetch over TCP.
    pub fn new(on: bool) -> Self {
        Self { boot_id: boot_id().filter(|_| on), mapped: Mutex::default() }
    }

    /// `peer`'s pool, when it is on this host and passes every check (see the module docs).
    fn segment(&self, peer: &Peer) -> Option<Arc<Mapped>> {
        let (name, id) = peer.shm.as_ref()?;
        let mut parts = id.rsplitn(3, ':');
        let (ino, dev, boot) = (parts.next()?, parts.next()?, parts.next()?);
        let want: (u64, u64) = (dev.parse().ok()?, ino.parse().ok()?);
        if self.boot_id.as_deref() != Some(boot) || !lmcache_memory::shm::is_ours(name) {
            return None;
        }
        // The file under the name now: the advertised one, or the mapping is stale.
        let meta = std::fs::metadata(Path::new(lmcache_memory::shm::SHM_DIR).join(name)).ok()?;
        let current = (meta.dev(), meta.ino()) == want;
        let mut mapped = self.mapped.lock();
        match mapped.get(&peer.instance_id) {
            Some(m) if current && &m.id == id && m.seg.file_id() == want => {
                return Some(Arc::clone(m));
            }
            _ => {
                mapped.remove(&peer.instance_id);
            }
        }
        if !current {
            return None;
        }
        let seg = ForeignSegment::open(name, meta.len())
            .inspect_err(
                |e| tracing::debug!(peer = %peer.instance_id, error = %e, "peer pool not mapped"),
            )
            .ok()?;
        if seg.file_id() != want {
            return None;
        }
        let m = Arc::new(Mapped { seg, id: id.clone() });
        mapped.insert(peer.instance_id.clone(), Arc::clone(&m));
        tracing::info!(peer = %peer.instance_id, segment = %name, "P2P peer on this host: reading its pool directly");
        Some(m)
    }

    /// Copies the objects at `from` (the peer's answer for each reservation) out of `peer`'s
    /// pool into `into`. `Err(into)` when the peer is not readable here (go over TCP).
    pub fn fetch(
        &self,
        peer: &Peer,
        into: Vec<WriteReservation>,
        from: &[TransferAddress],
    ) -> Result<Vec<Result<WriteReservation, ChannelError>>, Vec<WriteReservation>> {
        let Some(m) = self.segment(peer) else { return Err(into) };
        Ok(into
            .into_iter()
            .zip(from)
            .map(|(mut w, a)| {
                let offset = u64::try_from(a.offset).map_err(|_| ChannelError::NotServed)?;
                if a.size != w.len() {
                    return Err(ChannelError::Length { expected: w.len(), got: a.size });
                }
                m.seg
                    .read(offset, w.as_mut_slice())
                    .map_err(|e| ChannelError::Io(e.to_string()))?;
                Ok(w)
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lmcache_core::ObjectKey;
    use lmcache_l1::{L1Cache, L1Config, WriteRequest};
    use lmcache_memory::ArenaAllocator;
    use lmcache_memory::{Arena, ArenaBacking, ArenaConfig};

    fn l1(tag: &str) -> L1Cache {
        let arena = Arena::create(&ArenaConfig {
            size: 8 << 20,
            backing: ArenaBacking::SharedMemory {
                name: format!("lmcache_rs_test_same_host_{tag}_{}", std::process::id()),
            },
            mlock: false,
        })
        .unwrap();
        L1Cache::new(L1Config::default(), ArenaAllocator::new(arena, 4096).unwrap()).unwrap()
    }

    fn key(i: u8) -> ObjectKey {
        ObjectKey::new([i; 32], "m", 1, 0, 0, "").unwrap()
    }

    fn peer(shm: Option<(String, String)>) -> Peer {
        Peer {
            instance_id: "holder".into(),
            mq_url: "tcp://127.0.0.1:1".into(),
            p2p_advertised_url: "127.0.0.1:2".into(),
            missed_polls: 0,
            native: true,
            ip: "127.0.0.1".into(),
            shm,
        }
    }

    #[test]
    fn a_same_host_peers_pool_is_read_only_when_every_check_holds() {
        let holder = l1("holder");
        let reader = l1("reader");
        let mut w =
            holder.reserve_write(&[WriteRequest::new(key(1), 4096)]).pop().unwrap().unwrap();
        w.as_mut_slice().iter_mut().enumerate().for_each(|(i, b)| *b = (i * 7) as u8);
        let lease = w.commit_and_read_lock(1).unwrap();
        let at = TransferAddress { offset: lease.offset() as i64, size: 4096 };
        let (name, id) = advertised(holder.memory()).expect("an lmcache-rs segment is advertised");
        let reserve = |k: u8| {
            reader.reserve_write(&[WriteRequest::new(key(k), 4096)]).pop().unwrap().unwrap()
        };
        let same = SameHost::new(true);
        let off = SameHost::new(false);

        // The advertised segment: read byte for byte.
        let got = same.fetch(&peer(Some((name.clone(), id.clone()))), vec![reserve(1)], &[at]);
        let w = got.ok().unwrap().pop().unwrap().unwrap();
        assert_eq!(w.as_slice(), lease.bytes());
        drop(w);
        let ok = Some((name.clone(), id.clone()));
        assert!(off.fetch(&peer(ok), vec![reserve(1)], &[at]).is_err(), "turned off: TCP");

        // Another inode under the name, another kernel, no metadata: not read here.
        let (boot, rest) = id.split_once(':').unwrap();
        let (dev, ino) = rest.split_once(':').unwrap();
        let other_ino = format!("{boot}:{dev}:{}", ino.parse::<u64>().unwrap() + 1);
        let other_boot = format!("00000000-0000-0000-0000-000000000000:{rest}");
        for bad in [Some((name.clone(), other_ino)), Some((name.clone(), other_boot)), None] {
            assert!(same.fetch(&peer(bad), vec![reserve(2)], &[at]).is_err());
        }
        // A segment we did not create (no ownership marker) is never mapped.
        let foreign = format!("not_ours_{}", std::process::id());
        let seg = lmcache_memory::shm::ShmSegment::create(&foreign, 8192).unwrap();
        let marker = Path::new(lmcache_memory::shm::SHM_DIR)
            .join(format!("{}{foreign}", lmcache_memory::shm::OWNER_MARKER_PREFIX));
        std::fs::remove_file(&marker).unwrap();
        let meta =
            std::fs::metadata(Path::new(lmcache_memory::shm::SHM_DIR).join(&foreign)).unwrap();
        let fid = format!("{boot}:{}:{}", meta.dev(), meta.ino());
        assert!(same.fetch(&peer(Some((foreign.clone(), fid))), vec![reserve(3)], &[at]).is_err());
        std::fs::File::create(&marker).unwrap();
        drop(seg);

        // Out of the pool's bounds, or a size that is not the reservation's: refused alone.
        let ok = Some((name, id));
        let past = TransferAddress { offset: 8 << 20, size: 4096 };
        let short = TransferAddress { offset: at.offset, size: 100 };
        let got = same.fetch(&peer(ok), vec![reserve(4), reserve(5)], &[past, short]).ok().unwrap();
        assert!(matches!(got[0], Err(ChannelError::Io(_))), "{:?}", got[0]);
        assert!(matches!(got[1], Err(ChannelError::Length { .. })), "{:?}", got[1]);
    }
}
