//! The one unsafe module: NIXL's C API (`libnixl_capi.so`, as the nixl-cu12 1.5.1 wheel ships
//! it), loaded with `dlopen` and called through a table of function pointers.
//!
//! The declarations follow the C API's header for NIXL 1.5.1 (the one the `nixl-sys` crate
//! compiles into that library), written here for the calls we make. Every handle the library
//! gives is owned by exactly one Rust value below and freed once, by its `Drop`. Calls on one
//! agent are serialized by the caller (`agent.rs` holds a mutex): the agent is created with
//! NIXL's `thread_sync: NONE`, as LMCache's Python agent is.

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::path::Path;
use std::ptr;

use crate::NixlError;
use crate::serdes::DescList;

type Handle = *mut c_void;

/// `nixl_capi_agent_config_t` (C layout).
#[repr(C)]
struct AgentConfig {
    enable_prog_thread: bool,
    enable_listen_thread: bool,
    listen_port: c_int,
    thread_sync: c_int,
    num_workers: c_uint,
    pthr_delay_us: u64,
    lthr_delay_us: u64,
    capture_telemetry: bool,
}

/// The progress thread's pause between rounds, in microseconds.
const PROGRESS_NAP_US: u64 = 200;

const SUCCESS: c_int = 0;
const IN_PROG: c_int = 1;
const MEM_DRAM: c_int = 0;
const OP_READ: c_int = 0;

/// The C API's status codes, by name.
fn status_name(s: c_int) -> &'static str {
    match s {
        -1 => "INVALID_PARAM",
        -2 => "BACKEND",
        -3 => "INVALID_STATE",
        -4 => "EXCEPTION",
        -5 => "NO_TELEMETRY",
        -6 => "NOT_FOUND",
        _ => "UNKNOWN",
    }
}

fn check(call: &'static str, s: c_int) -> Result<(), NixlError> {
    if s == SUCCESS {
        Ok(())
    } else {
        Err(NixlError::Call { call, status: s, name: status_name(s) })
    }
}

macro_rules! api {
    ($($field:ident = $sym:literal : fn($($arg:ty),*) -> $ret:ty;)*) => {
        /// The loaded library and the functions we call in it.
        pub(crate) struct Api {
            // Never unloaded: NIXL and UCX keep threads and statics for the process's life.
            _lib: &'static libloading::Library,
            $($field: unsafe extern "C" fn($($arg),*) -> $ret,)*
        }

        impl Api {
            fn resolve(lib: &'static libloading::Library) -> Result<Self, NixlError> {
                Ok(Self {
                    _lib: lib,
                    $($field: {
                        // SAFETY: the symbol is the C API function of that name, whose C
                        // signature (NIXL 1.5.1's header) is the type written beside it.
                        let f = unsafe { lib.get::<unsafe extern "C" fn($($arg),*) -> $ret>($sym) }
                            .map_err(|e| NixlError::Load {
                                path: String::from_utf8_lossy(&$sym[..$sym.len() - 1]).into_owned(),
                                reason: e.to_string(),
                            })?;
                        *f
                    },)*
                })
            }
        }
    };
}

api! {
    create_configured_agent = b"nixl_capi_create_configured_agent\0": fn(*const c_char, *const AgentConfig, *mut Handle) -> c_int;
    destroy_agent = b"nixl_capi_destroy_agent\0": fn(Handle) -> c_int;
    create_params = b"nixl_capi_create_params\0": fn(*mut Handle) -> c_int;
    destroy_params = b"nixl_capi_destroy_params\0": fn(Handle) -> c_int;
    create_backend = b"nixl_capi_create_backend\0": fn(Handle, *const c_char, Handle, *mut Handle) -> c_int;
    destroy_backend = b"nixl_capi_destroy_backend\0": fn(Handle) -> c_int;
    get_local_md = b"nixl_capi_get_local_md\0": fn(Handle, *mut *mut c_void, *mut usize) -> c_int;
    load_remote_md = b"nixl_capi_load_remote_md\0": fn(Handle, *const c_void, usize, *mut *mut c_char) -> c_int;
    invalidate_remote_md = b"nixl_capi_invalidate_remote_md\0": fn(Handle, *const c_char) -> c_int;
    create_reg_dlist = b"nixl_capi_create_reg_dlist\0": fn(c_int, *mut Handle) -> c_int;
    reg_dlist_add_desc = b"nixl_capi_reg_dlist_add_desc\0": fn(Handle, usize, usize, u64, *const c_void, usize) -> c_int;
    destroy_reg_dlist = b"nixl_capi_destroy_reg_dlist\0": fn(Handle) -> c_int;
    register_mem = b"nixl_capi_register_mem\0": fn(Handle, Handle, Handle) -> c_int;
    deregister_mem = b"nixl_capi_deregister_mem\0": fn(Handle, Handle, Handle) -> c_int;
    create_xfer_dlist = b"nixl_capi_create_xfer_dlist\0": fn(c_int, *mut Handle) -> c_int;
    xfer_dlist_add_desc = b"nixl_capi_xfer_dlist_add_desc\0": fn(Handle, usize, usize, u64) -> c_int;
    destroy_xfer_dlist = b"nixl_capi_destroy_xfer_dlist\0": fn(Handle) -> c_int;
    prep_xfer_dlist = b"nixl_capi_prep_xfer_dlist\0": fn(Handle, *const c_char, Handle, *mut Handle, Handle) -> c_int;
    release_xfer_dlist_handle = b"nixl_capi_release_xfer_dlist_handle\0": fn(Handle, Handle) -> c_int;
    make_xfer_req = b"nixl_capi_make_xfer_req\0": fn(Handle, c_int, Handle, *const c_int, usize, Handle, *const c_int, usize, *mut Handle, Handle) -> c_int;
    post_xfer_req = b"nixl_capi_post_xfer_req\0": fn(Handle, Handle, Handle) -> c_int;
    get_xfer_status = b"nixl_capi_get_xfer_status\0": fn(Handle, Handle) -> c_int;
    release_xfer_req = b"nixl_capi_release_xfer_req\0": fn(Handle, Handle) -> c_int;
    destroy_xfer_req = b"nixl_capi_destroy_xfer_req\0": fn(Handle) -> c_int;
    is_stub = b"nixl_capi_is_stub\0": fn() -> bool;
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Api(libnixl_capi)")
    }
}

/// Loads `libnixl_capi.so` from `path` (its own dependencies and NIXL's plugins are found
/// beside it, as the wheel lays them out).
pub(crate) fn load(path: &Path) -> Result<Api, NixlError> {
    let load_err = |reason: String| NixlError::Load { path: path.display().to_string(), reason };
    // SAFETY: loading runs the library's initializers; NIXL's are its C++ statics, which
    // have no preconditions on the loading process.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| load_err(e.to_string()))?;
    let api = Api::resolve(Box::leak(Box::new(lib)))?;
    // SAFETY: takes no arguments and returns a flag.
    if unsafe { (api.is_stub)() } {
        return Err(load_err("a stub build of NIXL (it moves no data)".into()));
    }
    Ok(api)
}

fn cstring(what: &str, s: &str) -> Result<CString, NixlError> {
    CString::new(s).map_err(|_| NixlError::Invalid(format!("{what} {s:?} holds a NUL byte")))
}

/// An agent handle with its UCX backend. Not `Sync`: `agent.rs` serializes every call.
pub(crate) struct RawAgent {
    api: &'static Api,
    agent: Handle,
    backend: Handle,
}

// SAFETY: the handle is a heap object of the library with no thread affinity; calls on it
// are serialized by the caller's mutex.
unsafe impl Send for RawAgent {}

impl RawAgent {
    /// An agent as LMCache's Python channel makes one (progress thread on, no listen
    /// thread, no internal locking, a UCX backend with default parameters), except that its
    /// progress thread naps between rounds instead of spinning.
    pub(crate) fn new(api: &'static Api, name: &str) -> Result<Self, NixlError> {
        let cname = cstring("agent name", name)?;
        let cfg = AgentConfig {
            enable_prog_thread: true,
            enable_listen_thread: false,
            listen_port: 0,
            thread_sync: 0,
            num_workers: 0,
            // LMCache's agent spins its progress thread (0 µs): a whole core per idle server,
            // measured here; a 200 µs nap between rounds frees it (docs/ARCHITECTURE.md).
            pthr_delay_us: PROGRESS_NAP_US,
            lthr_delay_us: 100_000,
            capture_telemetry: false,
        };
        let mut agent: Handle = ptr::null_mut();
        // SAFETY: the name and config outlive the call; `agent` is written on success only.
        check("create_configured_agent", unsafe {
            (api.create_configured_agent)(cname.as_ptr(), &cfg, &mut agent)
        })?;
        let mut this = Self { api, agent, backend: ptr::null_mut() };
        let mut params: Handle = ptr::null_mut();
        // SAFETY: writes a new empty parameter map on success.
        check("create_params", unsafe { (api.create_params)(&mut params) })?;
        let ucx = c"UCX";
        let mut backend: Handle = ptr::null_mut();
        // SAFETY: agent and params are live handles; the plugin name is a C string.
        let made = unsafe { (api.create_backend)(this.agent, ucx.as_ptr(), params, &mut backend) };
        // SAFETY: params is ours and freed once; createBackend copied what it needed.
        unsafe { (api.destroy_params)(params) };
        check("create_backend(UCX)", made)?;
        this.backend = backend;
        Ok(this)
    }

    /// This agent's metadata (connection info and registered memory keys) for a peer.
    pub(crate) fn local_md(&mut self) -> Result<Vec<u8>, NixlError> {
        let mut data: *mut c_void = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: the agent is live; on success `data` is a malloc'd buffer of `len` bytes.
        check("get_local_md", unsafe { (self.api.get_local_md)(self.agent, &mut data, &mut len) })?;
        if data.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: `data` points to `len` initialized bytes that the library gave us to free.
        let out = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }.to_vec();
        // SAFETY: allocated by malloc in the library; freed once, here.
        unsafe { libc::free(data) };
        Ok(out)
    }

    /// Loads a peer's metadata; returns the peer agent's name.
    pub(crate) fn load_remote_md(&mut self, md: &[u8]) -> Result<String, NixlError> {
        let mut name: *mut c_char = ptr::null_mut();
        // SAFETY: `md` is readable for its length during the call (the library copies it).
        check("load_remote_md", unsafe {
            (self.api.load_remote_md)(self.agent, md.as_ptr().cast(), md.len(), &mut name)
        })?;
        if name.is_null() {
            return Err(NixlError::Invalid("load_remote_md gave no agent name".into()));
        }
        // SAFETY: a NUL-terminated strdup'd string, ours to free.
        let out = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
        // SAFETY: allocated by strdup in the library; freed once, here.
        unsafe { libc::free(name.cast()) };
        Ok(out)
    }

    /// Forgets a peer's metadata (its connection and keys).
    pub(crate) fn invalidate_remote_md(&mut self, name: &str) -> Result<(), NixlError> {
        let cname = cstring("agent name", name)?;
        // SAFETY: live agent, C string valid for the call.
        check("invalidate_remote_md", unsafe {
            (self.api.invalidate_remote_md)(self.agent, cname.as_ptr())
        })
    }

    /// Registers `[addr, addr + len)` as DRAM with the UCX backend.
    ///
    /// # Safety
    /// The range must stay mapped until [`RawAgent::deregister`] is called on the returned
    /// list (peers may read it at any time meanwhile).
    pub(crate) unsafe fn register(
        &mut self,
        addr: usize,
        len: usize,
    ) -> Result<RawRegList, NixlError> {
        let mut list: Handle = ptr::null_mut();
        // SAFETY: writes a new list on success.
        check("create_reg_dlist", unsafe { (self.api.create_reg_dlist)(MEM_DRAM, &mut list) })?;
        let list = RawRegList { api: self.api, list };
        // SAFETY: a live list; no metadata (null, 0), as LMCache passes "".
        check("reg_dlist_add_desc", unsafe {
            (self.api.reg_dlist_add_desc)(list.list, addr, len, 0, ptr::null(), 0)
        })?;
        // SAFETY: live agent and list; the caller keeps the range mapped (this fn's contract).
        check("register_mem", unsafe {
            (self.api.register_mem)(self.agent, list.list, ptr::null_mut())
        })?;
        Ok(list)
    }

    /// Undoes [`RawAgent::register`].
    pub(crate) fn deregister(&mut self, list: &RawRegList) -> Result<(), NixlError> {
        // SAFETY: live agent and a list this agent registered.
        check("deregister_mem", unsafe {
            (self.api.deregister_mem)(self.agent, list.list, ptr::null_mut())
        })
    }

    /// Prepares `descs` for indexed transfers: ours with `agent == ""`, a peer's by its name.
    pub(crate) fn prep(&mut self, agent: &str, descs: &DescList) -> Result<RawPrepped, NixlError> {
        let cname = cstring("agent name", agent)?;
        let mut list: Handle = ptr::null_mut();
        // SAFETY: writes a new list on success.
        check("create_xfer_dlist", unsafe {
            (self.api.create_xfer_dlist)(descs.mem as c_int, &mut list)
        })?;
        let list = RawXferList { api: self.api, list };
        for d in &descs.descs {
            let (addr, len) = (usize::try_from(d.addr), usize::try_from(d.len));
            let (Ok(addr), Ok(len)) = (addr, len) else {
                return Err(NixlError::descriptors(format!("descriptor {d:?} beyond usize")));
            };
            // SAFETY: a live list; plain values.
            check("xfer_dlist_add_desc", unsafe {
                (self.api.xfer_dlist_add_desc)(list.list, addr, len, d.dev)
            })?;
        }
        let mut handle: Handle = ptr::null_mut();
        // SAFETY: live agent and list; the name is a C string valid for the call.
        check("prep_xfer_dlist", unsafe {
            (self.api.prep_xfer_dlist)(
                self.agent,
                cname.as_ptr(),
                list.list,
                &mut handle,
                ptr::null_mut(),
            )
        })?;
        Ok(RawPrepped { handle, _list: list, len: descs.descs.len() })
    }

    /// Releases a prepped list.
    pub(crate) fn release_prepped(&mut self, p: RawPrepped) {
        // SAFETY: a handle this agent prepped, released once (the value is consumed).
        let s = unsafe { (self.api.release_xfer_dlist_handle)(self.agent, p.handle) };
        if s != SUCCESS {
            tracing::warn!(status = status_name(s), "NIXL: releasing a prepped list failed");
        }
    }

    /// Makes and posts a READ of `remote[remote_idx]` into `local[local_idx]`.
    ///
    /// # Safety
    /// The local memory the indices name must stay valid, and must not be read as settled,
    /// until the transfer reports done or failed, or [`RawAgent::release_xfer`] succeeds.
    pub(crate) unsafe fn read(
        &mut self,
        local: &RawPrepped,
        local_idx: &[c_int],
        remote: &RawPrepped,
        remote_idx: &[c_int],
    ) -> Result<RawXfer, NixlError> {
        let in_range = |idx: &[c_int], p: &RawPrepped| {
            idx.iter().all(|&i| usize::try_from(i).is_ok_and(|i| i < p.len))
        };
        if local_idx.len() != remote_idx.len()
            || !in_range(local_idx, local)
            || !in_range(remote_idx, remote)
        {
            return Err(NixlError::Invalid("transfer indices out of the prepped lists".into()));
        }
        let mut req: Handle = ptr::null_mut();
        // SAFETY: live agent and handles; the index slices are valid for the call (NIXL
        // copies the selected descriptors into the request).
        check("make_xfer_req", unsafe {
            (self.api.make_xfer_req)(
                self.agent,
                OP_READ,
                local.handle,
                local_idx.as_ptr(),
                local_idx.len(),
                remote.handle,
                remote_idx.as_ptr(),
                remote_idx.len(),
                &mut req,
                ptr::null_mut(),
            )
        })?;
        let xfer = RawXfer { req };
        // SAFETY: a request this agent just made.
        let s = unsafe { (self.api.post_xfer_req)(self.agent, xfer.req, ptr::null_mut()) };
        if s != SUCCESS && s != IN_PROG {
            // Nothing was posted: releasing cannot fail on an idle request.
            let _ = self.release_xfer(xfer);
            return Err(NixlError::Call { call: "post_xfer_req", status: s, name: status_name(s) });
        }
        Ok(xfer)
    }

    /// `Ok(true)` done, `Ok(false)` in progress, `Err` failed.
    pub(crate) fn xfer_status(&mut self, x: &RawXfer) -> Result<bool, NixlError> {
        // SAFETY: live agent and request.
        match unsafe { (self.api.get_xfer_status)(self.agent, x.req) } {
            SUCCESS => Ok(true),
            IN_PROG => Ok(false),
            s => Err(NixlError::Call { call: "get_xfer_status", status: s, name: status_name(s) }),
        }
    }

    /// Releases a transfer (aborting it if still in progress). On failure the request is
    /// handed back: its memory may still be written to.
    pub(crate) fn release_xfer(&mut self, x: RawXfer) -> Result<(), RawXfer> {
        // SAFETY: live agent and request, released at most once (success consumes it).
        let s = unsafe { (self.api.release_xfer_req)(self.agent, x.req) };
        if s != SUCCESS {
            return Err(x);
        }
        // SAFETY: released, so the wrapper is idle and ours to free, once.
        unsafe { (self.api.destroy_xfer_req)(x.req) };
        Ok(())
    }
}

impl Drop for RawAgent {
    fn drop(&mut self) {
        // SAFETY: handles created in `new`, freed once. The backend wrapper only holds a
        // pointer the agent owns, so it goes first; the agent's destructor stops its threads.
        unsafe {
            if !self.backend.is_null() {
                (self.api.destroy_backend)(self.backend);
            }
            (self.api.destroy_agent)(self.agent);
        }
    }
}

/// A registration descriptor list (freed on drop; deregistration is the agent's call).
pub(crate) struct RawRegList {
    api: &'static Api,
    list: Handle,
}

// SAFETY: a plain heap object of the library; every call on it takes the agent's mutex.
unsafe impl Send for RawRegList {}
// SAFETY: as for Send: shared references never call into the library without the mutex.
unsafe impl Sync for RawRegList {}

impl Drop for RawRegList {
    fn drop(&mut self) {
        // SAFETY: created by create_reg_dlist, freed once.
        unsafe { (self.api.destroy_reg_dlist)(self.list) };
    }
}

struct RawXferList {
    api: &'static Api,
    list: Handle,
}

// SAFETY: a heap object of the library, only freed (once) on drop.
unsafe impl Send for RawXferList {}
// SAFETY: never called through a shared reference.
unsafe impl Sync for RawXferList {}

impl Drop for RawXferList {
    fn drop(&mut self) {
        // SAFETY: created by create_xfer_dlist, freed once (after its prepped handle).
        unsafe { (self.api.destroy_xfer_dlist)(self.list) };
    }
}

/// A prepped descriptor list: its handle and the list it was made from.
pub(crate) struct RawPrepped {
    handle: Handle,
    _list: RawXferList,
    len: usize,
}

// SAFETY: plain heap objects of the library; used under the agent's mutex.
unsafe impl Send for RawPrepped {}
// SAFETY: as for Send: shared references only read `len` or call under the mutex.
unsafe impl Sync for RawPrepped {}

impl RawPrepped {
    /// How many descriptors it indexes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

/// A posted transfer request.
pub(crate) struct RawXfer {
    req: Handle,
}

// SAFETY: a heap object of the library; used under the agent's mutex.
unsafe impl Send for RawXfer {}
