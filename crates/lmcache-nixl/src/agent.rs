//! Safe NIXL: an agent (one per server), its DRAM registration, prepped descriptor lists and
//! READ transfers, each an RAII value that releases what it holds on drop.

use std::ffi::c_int;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use lmcache_l1::{L1Cache, WriteReservation};

use crate::NixlError;
use crate::ffi::{Api, RawAgent, RawPrepped, RawRegList, RawXfer};
use crate::serdes::DescList;

/// The NIXL library, loaded once per process.
#[derive(Debug, Clone, Copy)]
pub struct Nixl {
    api: &'static Api,
}

impl Nixl {
    /// Loads `libnixl_capi.so` from `path` (the first load wins for the process: a library
    /// is never unloaded).
    pub fn load(path: &std::path::Path) -> Result<Self, NixlError> {
        static LOADED: std::sync::OnceLock<&'static Api> = std::sync::OnceLock::new();
        if let Some(api) = LOADED.get() {
            return Ok(Self { api });
        }
        let api: &'static Api = Box::leak(Box::new(crate::ffi::load(path)?));
        Ok(Self { api: LOADED.get_or_init(|| api) })
    }

    /// A new agent named `name`, with the UCX backend.
    pub fn agent(&self, name: &str) -> Result<Arc<Agent>, NixlError> {
        let raw = RawAgent::new(self.api, name)?;
        Ok(Arc::new(Agent { raw: Mutex::new(raw), name: name.to_owned() }))
    }
}

/// A NIXL agent. Every call goes through one mutex (NIXL's own locking is off, as in
/// LMCache's agent); its progress thread moves the bytes.
pub struct Agent {
    raw: Mutex<RawAgent>,
    name: String,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent").field("name", &self.name).finish()
    }
}

impl Agent {
    /// Its name, as peers know it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its metadata for a peer (`InitReq`/`InitResp`'s `agent_meta`).
    pub fn metadata(&self) -> Result<Vec<u8>, NixlError> {
        self.raw.lock().local_md()
    }

    /// Loads a peer's metadata; returns the peer agent's name.
    pub fn add_remote(&self, metadata: &[u8]) -> Result<String, NixlError> {
        self.raw.lock().load_remote_md(metadata)
    }

    /// Forgets a peer.
    pub fn remove_remote(&self, name: &str) {
        if let Err(e) = self.raw.lock().invalidate_remote_md(name) {
            tracing::debug!(peer = name, error = %e, "NIXL: forgetting a peer failed");
        }
    }

    /// Registers `[base, base + len)` as DRAM, for peers to read.
    ///
    /// # Safety
    /// The range must stay mapped while the returned [`Registration`] lives: any peer that
    /// loaded this agent's metadata may read it at any time.
    pub unsafe fn register_dram(
        self: &Arc<Self>,
        base: usize,
        len: usize,
    ) -> Result<Registration, NixlError> {
        // SAFETY: forwarded contract: the range outlives the registration.
        let list = unsafe { self.raw.lock().register(base, len)? };
        Ok(Registration { agent: Arc::clone(self), list })
    }

    /// Registers `l1`'s whole arena and prepares it as pages of the L1 alignment
    /// (`--l1-align-bytes`), as LMCache's channel lists its L1 for peers.
    pub fn register_l1(self: &Arc<Self>, l1: &L1Cache) -> Result<L1Registration, NixlError> {
        let arena = l1.memory().arena();
        let (base, len) = (arena.base_address(), arena.len());
        let page = l1.memory().align();
        let len_usize =
            usize::try_from(len).map_err(|_| NixlError::Invalid("an arena beyond usize".into()))?;
        // SAFETY: the arena stays mapped while an `L1Cache` clone lives, and the
        // registration holds one, dropped after the registration itself.
        let registration = unsafe { self.register_dram(base, len_usize)? };
        let list = DescList::pages(base as u64, len, page)?;
        let local = self.prep_local(&list)?;
        Ok(L1Registration { local, _registration: registration, list, page, _l1: l1.clone() })
    }

    /// READs each object from the peer's page list `remote` at its byte offset (page-aligned,
    /// as `p2p_query_lookup_results` answered it) into its L1 reservation, in one transfer
    /// bounded by `deadline`. Gives the reservations back filled, or an error (they are then
    /// dropped: nothing stays staged). A transfer NIXL could not abort keeps its
    /// reservations forever: the memory it may still write is never reused.
    pub fn read_into(
        self: &Arc<Self>,
        l1: &L1Registration,
        remote: &Prepped,
        objects: Vec<(WriteReservation, u64)>,
        deadline: Instant,
    ) -> Result<Vec<WriteReservation>, NixlError> {
        let mut local_idx: Vec<c_int> = Vec::new();
        let mut remote_idx: Vec<c_int> = Vec::new();
        for (w, remote_off) in &objects {
            let count = w.len().div_ceil(l1.page).max(1);
            let bad = |why: &str| {
                NixlError::Invalid(format!("object at peer offset {remote_off}: {why}"))
            };
            if remote_off % l1.page != 0 || w.offset() % l1.page != 0 {
                return Err(bad("not page-aligned"));
            }
            let pages = |start: u64, limit: usize| -> Result<std::ops::Range<c_int>, NixlError> {
                let s = start / l1.page;
                let e = s
                    .checked_add(count)
                    .filter(|&e| e <= limit as u64)
                    .ok_or_else(|| bad("beyond the page list"))?;
                Ok(c_int::try_from(s).map_err(|_| bad("beyond c_int"))?
                    ..c_int::try_from(e).map_err(|_| bad("beyond c_int"))?)
            };
            // The reservation owns `count` whole pages: the allocator aligns sizes to them.
            local_idx.extend(pages(w.offset(), l1.local.len())?);
            remote_idx.extend(pages(*remote_off, remote.len())?);
        }
        let reservations: Vec<WriteReservation> = objects.into_iter().map(|(w, _)| w).collect();
        if reservations.is_empty() {
            return Ok(reservations);
        }
        // SAFETY: every local index lies in a page of a reservation in `reservations`, which
        // we hold, unread, until the transfer ends; on `Abandoned` they are never released.
        let x = unsafe { self.read(&l1.local, &local_idx, remote, &remote_idx)? };
        match x.wait(deadline) {
            Finished::Done => Ok(reservations),
            Finished::Failed(e) => Err(e),
            Finished::Abandoned => {
                std::mem::forget(reservations);
                Err(NixlError::Invalid(
                    "a READ NIXL could not abort: its L1 space is retired".into(),
                ))
            }
        }
    }

    /// Prepares our own descriptors (those a registration covers) for indexed transfers.
    pub fn prep_local(self: &Arc<Self>, descs: &DescList) -> Result<Prepped, NixlError> {
        self.prep("", descs)
    }

    /// Prepares a peer's descriptors (received in `MemRegReq`/`MemRegResp`).
    pub fn prep_remote(
        self: &Arc<Self>,
        peer: &str,
        descs: &DescList,
    ) -> Result<Prepped, NixlError> {
        if peer.is_empty() {
            return Err(NixlError::Invalid("a peer agent with no name".into()));
        }
        self.prep(peer, descs)
    }

    fn prep(self: &Arc<Self>, agent: &str, descs: &DescList) -> Result<Prepped, NixlError> {
        let raw = self.raw.lock().prep(agent, descs)?;
        Ok(Prepped { agent: Arc::clone(self), raw: Some(raw) })
    }

    /// Posts a READ of the peer's descriptors `remote_idx` into our `local_idx` (pairwise).
    ///
    /// # Safety
    /// The local memory `local_idx` names must stay valid and unread until the returned
    /// transfer ends ([`Transfer::wait`] says how; on [`Finished::Abandoned`] it must never
    /// be reused).
    pub unsafe fn read(
        self: &Arc<Self>,
        local: &Prepped,
        local_idx: &[c_int],
        remote: &Prepped,
        remote_idx: &[c_int],
    ) -> Result<Transfer, NixlError> {
        let (Some(l), Some(r)) = (&local.raw, &remote.raw) else {
            return Err(NixlError::Invalid("a released descriptor list".into()));
        };
        // SAFETY: forwarded contract.
        let raw = unsafe { self.raw.lock().read(l, local_idx, r, remote_idx)? };
        Ok(Transfer { agent: Arc::clone(self), raw: Some(raw) })
    }
}

/// An L1 arena registered with an agent, with its prepped page list.
pub struct L1Registration {
    // Drop order: the prepped list, the registration, then the L1 (the arena's owner).
    local: Prepped,
    _registration: Registration,
    list: DescList,
    page: u64,
    _l1: L1Cache,
}

impl std::fmt::Debug for L1Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("L1Registration")
            .field("pages", &self.list.descs.len())
            .field("page", &self.page)
            .finish()
    }
}

impl L1Registration {
    /// The page list peers read by (pickle it for LMCache's handshake).
    pub fn pages(&self) -> &DescList {
        &self.list
    }

    /// The page size (the L1 alignment).
    pub fn page(&self) -> u64 {
        self.page
    }
}

/// Registered memory; deregistered on drop.
pub struct Registration {
    agent: Arc<Agent>,
    list: RawRegList,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Registration")
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Err(e) = self.agent.raw.lock().deregister(&self.list) {
            tracing::warn!(error = %e, "NIXL: deregistering memory failed");
        }
    }
}

/// A prepped descriptor list; released on drop.
pub struct Prepped {
    agent: Arc<Agent>,
    raw: Option<RawPrepped>,
}

impl std::fmt::Debug for Prepped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepped").field("len", &self.len()).finish()
    }
}

impl Prepped {
    /// How many descriptors it indexes.
    pub fn len(&self) -> usize {
        self.raw.as_ref().map_or(0, RawPrepped::len)
    }

    /// Whether it indexes none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Prepped {
    fn drop(&mut self) {
        if let Some(raw) = self.raw.take() {
            self.agent.raw.lock().release_prepped(raw);
        }
    }
}

/// How a transfer ended.
#[derive(Debug)]
pub enum Finished {
    /// Every byte arrived.
    Done,
    /// It failed or timed out and was released: the local memory is ours again, its
    /// contents undefined.
    Failed(NixlError),
    /// It could not be released: the local memory may still be written to and must never
    /// be reused.
    Abandoned,
}

/// A posted READ.
pub struct Transfer {
    agent: Arc<Agent>,
    raw: Option<RawXfer>,
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Transfer")
    }
}

impl Transfer {
    /// Polls until done, failed or `deadline` (then aborted).
    pub fn wait(mut self, deadline: Instant) -> Finished {
        let Some(raw) = self.raw.take() else {
            return Finished::Failed(NixlError::Invalid("no request".into()));
        };
        let mut pause = Duration::from_micros(20);
        let failure = loop {
            let status = self.agent.raw.lock().xfer_status(&raw);
            match status {
                Ok(true) => break None,
                Ok(false) if Instant::now() < deadline => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(1));
                }
                Ok(false) => break Some(NixlError::Timeout),
                Err(e) => break Some(e),
            }
        };
        match (self.agent.raw.lock().release_xfer(raw), failure) {
            (Ok(()), None) => Finished::Done,
            (Ok(()), Some(e)) => Finished::Failed(e),
            (Err(_kept), _) => {
                // The request stays with NIXL (never freed): its target memory is retired too.
                tracing::error!("NIXL: a transfer could not be aborted; its memory is retired");
                Finished::Abandoned
            }
        }
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        if let Some(raw) = self.raw.take() {
            if let Err(_kept) = self.agent.raw.lock().release_xfer(raw) {
                tracing::error!("NIXL: a dropped transfer could not be aborted");
            }
        }
    }
}
