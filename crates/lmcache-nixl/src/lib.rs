//! NIXL for lmcache-rs, loaded at run time: LMCache 0.5.6's default P2P channel moves L1
//! objects between servers with NIXL (UCX backend, DRAM), so a fleet that mixes LMCache's
//! servers with ours needs NIXL on our side too.
//!
//! The `nixl-cu12` wheel LMCache's users install ships NIXL's C API (`libnixl_capi.so`) but
//! no headers; we declare the calls we make ourselves and `dlopen` the wheel's library, so
//! nothing NIXL is needed to build lmcache-rs and a server without P2P never loads it.
//!
//! - `ffi`: the C API's declarations, the loaded function table and owning wrappers of its
//!   handles; every unsafe block of the crate but the two `agent` forwards is here.
//! - `agent`: [`Nixl`] → [`Agent`] (UCX, progress thread) → [`L1Registration`] of the L1
//!   arena (safe: it holds the L1; READs land only in L1 reservations it owns meanwhile),
//!   [`Prepped`] descriptor lists (ours and a peer's), [`Transfer`] (a posted READ;
//!   [`Finished`]).
//! - `serdes`: [`DescList`], the page-granular descriptor lists LMCache's channel exchanges,
//!   as NIXL's serializer writes them inside Python's pickle (written and read without
//!   Python; a received pickle is parsed, never run).
//! - `locate`: [`locate`] finds the library in a Python environment's site-packages.

mod agent;
mod ffi;
mod locate;
mod serdes;

pub use agent::{Agent, Finished, L1Registration, Nixl, Prepped, Registration, Transfer};
pub use locate::{LIBRARY, locate};
pub use serdes::{Desc, DescList, MAX_DESCS, MemType};

/// What went wrong with NIXL.
#[derive(Debug, thiserror::Error)]
pub enum NixlError {
    /// The library (or one of its symbols) could not be loaded.
    #[error("cannot load NIXL from {path}: {reason}")]
    Load {
        /// The library or symbol.
        path: String,
        /// The loader's reason.
        reason: String,
    },
    /// A C API call failed.
    #[error("NIXL {call} failed: {name} ({status})")]
    Call {
        /// The call.
        call: &'static str,
        /// Its status code.
        status: i32,
        /// The code's name.
        name: &'static str,
    },
    /// A descriptor list (or its pickle) is malformed.
    #[error("bad NIXL descriptor list: {0}")]
    Descriptors(String),
    /// An argument we refused before calling NIXL.
    #[error("{0}")]
    Invalid(String),
    /// A transfer did not finish in time.
    #[error("the NIXL transfer timed out")]
    Timeout,
    /// No library was found.
    #[error("{0}")]
    NotFound(String),
}

impl NixlError {
    pub(crate) fn descriptors(why: String) -> Self {
        Self::Descriptors(why)
    }
}
