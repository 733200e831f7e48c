//! LMCache's trace files (`.lct`, format 1, trace schema 1), at both levels:
//!
//! - [`format`]: the frames, the header and records, a reader that survives a torn tail and
//!   a writer that emits one frame per write;
//! - [`codec`]: LMCache's tagged argument values (`ObjectKey`, `MemoryLayoutDesc`,
//!   `PrefetchTaskSpec`, ...) and the qualified names of the recorded calls;
//! - [`info`]: `trace info`'s summary, printed as LMCache prints it;
//! - [`stats`]: a replay's per-operation latency figures and LMCache's CSV/JSON files.

pub mod codec;
pub mod format;
pub mod info;
pub mod stats;

pub use format::{Header, Level, Record, TraceError, TraceReader, TraceWriter};
