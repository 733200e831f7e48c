//! CacheBlend for lmcache-rs: reusing the KV of chunks that are not a prefix of the prompt.
//!
//! # Modules
//! - `elements`: [`KFormat`], the element formats a re-rotated K row is read from and
//!   written back to (`f32`, `f16`, `bf16`, vLLM's fp8 flavours).
//! - `index`: [`BlendIndex`], the chunk-fingerprint index: every stored chunk found anywhere
//!   in a query, each match verified token by token, per blend namespace. The coordinator's
//!   directory keeps one for the fleet.
//! - `matcher`: [`Matcher`], a server's own matcher over its stores, with LMCache's rules
//!   (which chunks are fingerprinted, first positions, newest or deduplicated contents, stale
//!   strikes) and namespaces LMCache's matcher lacks.
//! - `reorder`: the reorder planner ([`plan`], [`PromptStore`]): a prompt served in an order
//!   that starts with an exact copy of a stored prompt's beginning, as LMCache's planner
//!   orders it.
//! - `rope`: re-rotating a reused chunk's K from its stored positions to its new ones
//!   ([`CosSinCache`], [`Delta`]; NeoX and GPT-J pairs, partial and offset windows, YaRN
//!   scales removed), in `f32` over any [`KFormat`]; [`rotate_rows`] for a scatter's runs.
//! - `simd`: half-precision runs rotated with the CPU's half-float and AVX2 instructions,
//!   chosen at run time (the crate's one `unsafe`: the call into that kernel).
#![deny(unsafe_code)]

mod elements;
mod index;
mod matcher;
mod reorder;
mod rope;
#[expect(
    unsafe_code,
    reason = "the one unsafe call: into the vector kernel, once the CPU was seen to have its features"
)]
mod simd;

pub use elements::KFormat;
pub use index::{
    BlendConfig, BlendIndex, BlendMatch, BlendNs, BlendStats, MAX_CONTENTS_PER_FINGERPRINT,
};
pub use matcher::{Found, Matcher, Namespace, STALE_STRIKES, StoredRun};
pub use reorder::{GLUE, LMIN, PROMPT_STORE_TOKENS, PromptStore, plan};
pub use rope::{CosSinCache, Delta, KRow, MSCALE_TOLERANCE, RopeError, RopeStyle, rotate_rows};
