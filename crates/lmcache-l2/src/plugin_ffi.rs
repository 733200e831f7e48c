//! The native plugin ABI (`include/lmcache_rs_l2_plugin.h`), the only unsafe code of this
//! crate: loading the library, the version handshake, and the calls through its table.
//!
//! Memory safety rests on one rule the header states: every array handed to a `submit_*`
//! call stays valid until that op's completion is drained. [`Plugin`] enforces it here: an
//! [`Op`] owns its arrays (and the heap memory they point into) and sits in [`Plugin`]'s
//! pending map from before the submit call until its completion is drained, or until the
//! plugin is destroyed; a caller that stops waiting (a timeout) never frees them. Lengths
//! are checked before any call: `n` is the length of every array passed with it.

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::os::fd::{BorrowedFd, RawFd};
use std::path::Path;

use bytes::Bytes;
use parking_lot::Mutex;

/// The ABI version this build speaks.
pub const ABI_VERSION: u32 = 1;
/// `exists`/`get` result of an absent key (`LMRS_L2_ABSENT`, `-ENOENT`).
pub const ABSENT: i64 = -(libc::ENOENT as i64);
// The header spells it as a number.
const _: () = assert!(ABSENT == -2);
const SYMBOL: &[u8] = b"lmcache_rs_l2_plugin_v1\0";

#[repr(C)]
struct Key {
    ptr: *const c_char,
    len: usize,
}

#[repr(C)]
struct Value {
    head: *const u8,
    head_len: usize,
    body: *const u8,
    body_len: usize,
}

#[repr(C)]
struct Buffer {
    ptr: *mut u8,
    len: usize,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Completion {
    op_id: u64,
    status: i32,
    reserved: i32,
}

type Submit<T> =
    unsafe extern "C" fn(*mut c_void, u64, usize, *const Key, *const T, *mut i64) -> c_int;

#[repr(C)]
struct Table {
    abi_version: u32,
    api_size: u32,
    name: *const c_char,
    create: Option<unsafe extern "C" fn(*const c_char, *mut c_char, usize) -> *mut c_void>,
    destroy: Option<unsafe extern "C" fn(*mut c_void)>,
    event_fd: Option<unsafe extern "C" fn(*mut c_void) -> c_int>,
    submit_put: Option<Submit<Value>>,
    submit_get: Option<Submit<Buffer>>,
    submit_exists: Option<KeyOp>,
    submit_delete: Option<KeyOp>,
    drain_completions: Option<unsafe extern "C" fn(*mut c_void, *mut Completion, usize) -> usize>,
}

/// Why a plugin could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// dlopen or dlsym failed.
    #[error("cannot load {path}: {reason}")]
    Load {
        /// The library.
        path: String,
        /// What the loader said.
        reason: String,
    },
    /// The handshake failed.
    #[error(
        "plugin {name:?} ({path}) speaks ABI version {found} with a {size}-byte table; lmcache-rs \
         speaks version {ABI_VERSION} with a {want}-byte table"
    )]
    Version {
        /// The library.
        path: String,
        /// Its name.
        name: String,
        /// Its version.
        found: u32,
        /// Its table's size.
        size: u32,
        /// Ours.
        want: usize,
    },
    /// A function is missing from the table.
    #[error("plugin {name:?} ({path}) leaves {function} out of its table")]
    Incomplete {
        /// The library.
        path: String,
        /// Its name.
        name: String,
        /// The missing function.
        function: &'static str,
    },
    /// `create` refused the config.
    #[error("plugin {name:?} refused its config: {reason}")]
    Create {
        /// Its name.
        name: String,
        /// What it said.
        reason: String,
    },
}

/// What an op does, with the memory its arrays point into.
enum Kind {
    Put { _values: Vec<(Bytes, Bytes)>, table: Vec<Value> },
    Get { buffers: Vec<Vec<u8>>, table: Vec<Buffer> },
    Exists,
    Delete,
}

/// One batched operation: its keys, its values or buffers, its per-key results.
pub struct Op {
    _key_text: Vec<String>,
    keys: Vec<Key>,
    kind: Kind,
    results: Vec<i64>,
}

// SAFETY: the raw pointers in `keys` and `kind`'s tables point into heap memory this `Op`
// owns (the strings, the `Bytes`, the buffers), which moves with it and is not shared.
unsafe impl Send for Op {}

impl Op {
    fn with(keys: Vec<String>, kind: Kind) -> Self {
        let table = keys.iter().map(|k| Key { ptr: k.as_ptr().cast(), len: k.len() }).collect();
        let n = keys.len();
        Self { _key_text: keys, keys: table, kind, results: vec![i64::MIN; n] }
    }

    /// Store `values[i]` (a head and a body, stored as one object) under `keys[i]`.
    pub fn put(keys: Vec<String>, values: Vec<(Bytes, Bytes)>) -> Self {
        let table = values
            .iter()
            .map(|(h, b)| Value {
                head: h.as_ptr(),
                head_len: h.len(),
                body: b.as_ptr(),
                body_len: b.len(),
            })
            .collect();
        Self::with(keys, Kind::Put { _values: values, table })
    }

    /// Read `keys[i]` into a buffer of `lens[i]` bytes.
    pub fn get(keys: Vec<String>, lens: &[usize]) -> Self {
        let mut buffers: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0u8; n]).collect();
        let table =
            buffers.iter_mut().map(|b| Buffer { ptr: b.as_mut_ptr(), len: b.len() }).collect();
        Self::with(keys, Kind::Get { buffers, table })
    }

    /// Whether each key is stored, and its length.
    pub fn exists(keys: Vec<String>) -> Self {
        Self::with(keys, Kind::Exists)
    }

    /// Delete each key.
    pub fn delete(keys: Vec<String>) -> Self {
        Self::with(keys, Kind::Delete)
    }

    /// The per-key results (`i64::MIN` where the plugin wrote none).
    pub fn results(&self) -> &[i64] {
        &self.results
    }

    /// A get's buffers with their results.
    pub fn into_buffers(self) -> Vec<(i64, Vec<u8>)> {
        match self.kind {
            Kind::Get { buffers, .. } => self.results.into_iter().zip(buffers).collect(),
            _ => Vec::new(),
        }
    }
}

type Done = Box<dyn FnOnce(i32, Box<Op>) + Send>;
type KeyOp = unsafe extern "C" fn(*mut c_void, u64, usize, *const Key, *mut i64) -> c_int;

/// The table's functions, each checked present at load.
struct Fns {
    destroy: unsafe extern "C" fn(*mut c_void),
    submit_put: Submit<Value>,
    submit_get: Submit<Buffer>,
    submit_exists: KeyOp,
    submit_delete: KeyOp,
    drain: unsafe extern "C" fn(*mut c_void, *mut Completion, usize) -> usize,
}

/// A loaded plugin instance.
pub struct Plugin {
    fns: Fns,
    handle: *mut c_void,
    name: String,
    event_fd: RawFd,
    pending: Mutex<HashMap<u64, (Box<Op>, Done)>>,
}

// SAFETY: the header requires a plugin's functions to be callable from any thread,
// concurrently; `handle` is only passed back to them.
unsafe impl Send for Plugin {}
// SAFETY: as above; the pending map is behind a mutex.
unsafe impl Sync for Plugin {}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin").field("name", &self.name).finish()
    }
}

impl Plugin {
    /// Loads the library at `path`, checks its ABI version, and creates an instance with
    /// `config_json`. The library is never unloaded (its threads may outlive an instance).
    pub fn load(path: &Path, config_json: &str) -> Result<Self, PluginError> {
        let shown = path.display().to_string();
        let load_err = |reason: String| PluginError::Load { path: shown.clone(), reason };
        // SAFETY: loading runs the library's initializers; the operator named this library
        // as an lmcache-rs plugin (only at start, from the command line).
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| load_err(e.to_string()))?;
        let lib: &'static libloading::Library = Box::leak(Box::new(lib));
        // SAFETY: the symbol is the header's entry point, a function taking nothing and
        // returning a pointer to the table.
        let entry = unsafe { lib.get::<unsafe extern "C" fn() -> *const Table>(SYMBOL) }
            .map_err(|e| load_err(e.to_string()))?;
        // SAFETY: the entry point takes no arguments.
        let table = unsafe { entry() };
        if table.is_null() {
            return Err(load_err("its entry point returned no table".into()));
        }
        // Only the two leading u32s are read before the size is checked.
        // SAFETY: every version of the table starts with abi_version and api_size.
        let (found, size) = unsafe { ((*table).abi_version, (*table).api_size) };
        let name_of = |t: *const Table| -> String {
            // SAFETY: called only once the size check passed: `name` is in the table, and
            // is null or a NUL-terminated string the plugin keeps for its life.
            let p = unsafe { (*t).name };
            if p.is_null() {
                "unnamed".into()
            } else {
                // SAFETY: as above.
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        let want = std::mem::size_of::<Table>();
        if found != ABI_VERSION || (size as usize) < want {
            let name = if (size as usize) >= want { name_of(table) } else { "unknown".into() };
            return Err(PluginError::Version { path: shown, name, found, size, want });
        }
        // SAFETY: the version and size match: the whole table is there, and the plugin keeps
        // it for its life (the library is never unloaded).
        let table: &'static Table = unsafe { &*table };
        let name = name_of(table);
        let missing = |function| PluginError::Incomplete {
            path: shown.clone(),
            name: name.clone(),
            function,
        };
        let create = table.create.ok_or_else(|| missing("create"))?;
        let event_fd = table.event_fd.ok_or_else(|| missing("event_fd"))?;
        let fns = Fns {
            destroy: table.destroy.ok_or_else(|| missing("destroy"))?,
            submit_put: table.submit_put.ok_or_else(|| missing("submit_put"))?,
            submit_get: table.submit_get.ok_or_else(|| missing("submit_get"))?,
            submit_exists: table.submit_exists.ok_or_else(|| missing("submit_exists"))?,
            submit_delete: table.submit_delete.ok_or_else(|| missing("submit_delete"))?,
            drain: table.drain_completions.ok_or_else(|| missing("drain_completions"))?,
        };
        let config = CString::new(config_json).map_err(|_| PluginError::Create {
            name: name.clone(),
            reason: "the config holds a NUL byte".into(),
        })?;
        let mut error = vec![0 as c_char; 512];
        // SAFETY: `config` is NUL-terminated; `error` is writable for its length.
        let handle = unsafe { create(config.as_ptr(), error.as_mut_ptr(), error.len()) };
        if handle.is_null() {
            if let Some(last) = error.last_mut() {
                *last = 0;
            }
            // SAFETY: `error` is NUL-terminated (its last byte was just zeroed).
            let reason = unsafe { CStr::from_ptr(error.as_ptr()) }.to_string_lossy().into_owned();
            return Err(PluginError::Create { name, reason });
        }
        // SAFETY: `handle` is a live instance.
        let fd = unsafe { event_fd(handle) };
        let plugin = Self { fns, handle, name, event_fd: fd, pending: Mutex::new(HashMap::new()) };
        if fd < 0 {
            return Err(PluginError::Create {
                name: plugin.name.clone(),
                reason: format!("event_fd returned {fd}"),
            });
        }
        Ok(plugin)
    }

    /// The plugin's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Submits `op` as `op_id`; `done` is called with its status once its completion is
    /// drained. On refusal, the plugin's negative errno (the op is dropped: no completion
    /// follows a refusal, so its arrays are free).
    pub fn submit(&self, op_id: u64, op: Op, done: Done) -> Result<(), i32> {
        let mut op = Box::new(op);
        let n = op.keys.len();
        let keys = op.keys.as_ptr();
        let results = op.results.as_mut_ptr();
        if op.results.len() != n {
            return Err(-libc::EINVAL);
        }
        // The op is pending before the call: its completion may be drained before the call
        // returns. Its arrays do not move when the box moves into the map (heap memory).
        let kind_ptrs = match &op.kind {
            Kind::Put { table, .. } if table.len() == n => (table.as_ptr().cast::<c_void>(), 0),
            Kind::Get { table, .. } if table.len() == n => (table.as_ptr().cast::<c_void>(), 1),
            Kind::Exists => (std::ptr::null(), 2),
            Kind::Delete => (std::ptr::null(), 3),
            _ => return Err(-libc::EINVAL),
        };
        self.pending.lock().insert(op_id, (op, done));
        let h = self.handle;
        let f = &self.fns;
        // SAFETY: `keys`, the value or buffer table and `results` each hold `n` entries and
        // live in the pending op until its completion is drained (or the plugin destroyed).
        let rc = unsafe {
            match kind_ptrs.1 {
                0 => (f.submit_put)(h, op_id, n, keys, kind_ptrs.0.cast(), results),
                1 => (f.submit_get)(h, op_id, n, keys, kind_ptrs.0.cast(), results),
                2 => (f.submit_exists)(h, op_id, n, keys, results),
                _ => (f.submit_delete)(h, op_id, n, keys, results),
            }
        };
        if rc != 0 {
            // Refused: the header promises no completion, so the arrays are ours again.
            let entry = self.pending.lock().remove(&op_id);
            if entry.is_some() {
                return Err(rc);
            }
        }
        Ok(())
    }

    /// Waits at most `timeout_ms` for the event fd, then drains every completion and calls
    /// their callbacks. Returns how many completed.
    pub fn poll(&self, timeout_ms: u16) -> usize {
        // SAFETY: the fd belongs to the instance, which outlives this borrow.
        let fd = unsafe { BorrowedFd::borrow_raw(self.event_fd) };
        let mut fds = [nix::poll::PollFd::new(fd, nix::poll::PollFlags::POLLIN)];
        if let Ok(n) = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(timeout_ms))
            && n > 0
        {
            let mut counter = [0u8; 8];
            let _ = nix::unistd::read(self.event_fd, &mut counter);
        }
        let mut out = [Completion::default(); 64];
        let mut total = 0;
        loop {
            // SAFETY: `out` is writable for its length; the function never blocks.
            let got = unsafe { (self.fns.drain)(self.handle, out.as_mut_ptr(), out.len()) }
                .min(out.len());
            for c in &out[..got] {
                let entry = self.pending.lock().remove(&c.op_id);
                if let Some((op, done)) = entry {
                    done(c.status, op);
                }
            }
            total += got;
            if got < out.len() {
                return total;
            }
        }
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        // SAFETY: called once, last; after it returns the plugin touches none of the
        // pending ops' arrays, which are freed below.
        unsafe { (self.fns.destroy)(self.handle) };
        self.pending.lock().clear();
    }
}
