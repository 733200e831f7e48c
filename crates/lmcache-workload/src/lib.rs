//! Workload tools over LMCache's lookup-hash logs (`lookup_hashes_*.jsonl`, one line per
//! lookup; written by LMCache's server and by `lmcache-rs server --lookup-hash-log-dir`).
//!
//! - [`events`]: the lines, parsed; KV bytes per chunk from their shapes and dtypes (also the
//!   `torch.float16` spelling LMCache's own server writes and its simulator cannot read).
//! - [`simulate`]: LMCache's simulator replay (an LRU keyed by chunk hash; a request hits the
//!   leading run of cached chunks; tokens past the last whole chunk always miss), with its
//!   aggregate and per-request figures.
//! - [`sweep`]: the hit rate at many capacities in one pass: each chunk's LRU stack distance
//!   (distinct chunks referenced since its last use) decides at once every capacity it hits in.
//!
//! - [`trace`]: LMCache's `.lct` trace files (storage calls and cache-event streams): read,
//!   written, summed up.
//!
//! No file IO: callers hand in the text of the files, or a reader or writer.

pub mod events;
pub mod simulate;
pub mod sweep;
pub mod tiered;
pub mod trace;

pub use events::{LookupEvent, kv_bytes_per_chunk, parse_lines};
pub use simulate::{Simulation, simulate};
pub use sweep::{capacity_range_bytes, sweep};
