//! Workload tools over LMCache's lookup-hash logs (`lookup_hashes_*.jsonl`, one line per
//! lookup; written by LMCache's server and by `lmcache-rs server --lookup-hash-log-dir`).
//!
//! - [`lookup_log`]: the lines, parsed; KV bytes per chunk from their shapes and dtypes (also the
//!   `torch.float16` spelling LMCache's own server writes and its simulator cannot read).
//! - [`simulate`]: LMCache's simulator replay (an LRU keyed by chunk hash; a request hits the
//!   leading run of cached chunks; tokens past the last whole chunk always miss), with its
//!   aggregate and per-request figures.
//! - [`sweep`]: the hit rate at many capacities in one pass: each chunk's LRU stack distance
//!   (distinct chunks referenced since its last use) decides at once every capacity it hits in.
//!
//! - [`tiered`]: replays through any of the server's own eviction policies, and through an
//!   L1 + L2 pair.
//! - [`trace`]: LMCache's `.lct` trace files (storage calls and cache-event streams): read,
//!   written, summed up.
//!
//! No file IO: callers hand in the text of the files, or a reader or writer.
#![forbid(unsafe_code)]

pub mod lookup_log;
pub mod simulate;
pub mod sweep;
pub mod tiered;
pub mod trace;

pub use lookup_log::{LookupLine, kv_bytes_per_chunk, parse_lines};
pub use simulate::{Simulation, simulate};
pub use sweep::{capacity_range_bytes, sweep};
