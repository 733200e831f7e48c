//! Safe NIXL: an agent (one per server), its DRAM registration, prepped descriptor lists and
//! READ transfers, each an RAII value that releases what it holds on drop.

use std::ffi::c_int;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

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
