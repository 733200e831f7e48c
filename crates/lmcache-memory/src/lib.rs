//! Raw memory for the L1 tier: the only crate of lmcache-rs with `unsafe` code.
//!
//! # Motivation
//! L1 is one large region of CPU memory that an inference engine may also map (POSIX shared
//! memory), carved into KV objects of a few fixed sizes. Everything that touches raw pointers
//! lives here, behind a safe API whose soundness rests on one allocator invariant: live
//! allocations never overlap. Crates above reach bytes only through [`Allocation`].
//!
//! # Components
//! - [`arena`]: the mapping ([`Arena`]): anonymous, named shared memory, or 2 MiB huge pages,
//!   committed lazily, optionally `mlock`ed; [`shm`] holds the segment guard and stale-segment
//!   cleanup.
//! - [`allocator`]: the offset allocator ([`Allocator`]): aligned, best-fit with coalescing,
//!   exact-size bins that make same-size allocation O(1), all-or-nothing batches. Pure logic,
//!   no pointers.
//! - [`foreign`]: [`ForeignSegment`], another process's shm segment, reached only by
//!   bounds-checked raw copies; [`fault_guard`] turns the SIGBUS of a segment its owner
//!   shrank under us into a failed copy.
//! - [`file_arena`]: an arena in a device or file that outlives the process
//!   (`--l1-devdax-path`), with a checksummed catalog of its objects ([`FileBacking`];
//!   [`Allocation::persist`] records one, [`ArenaAllocator::take_adopted`] hands back what a
//!   restarted process verified).
//! - [`file_region`]: [`FileRegion`], a range of a file we own mapped shared and written by
//!   bounds-checked copies (raw_block's journal appends).
//! - [`dax_device`]: [`DaxDevice`], a /dev/dax device's size and mapping alignment from
//!   sysfs, which every mapping of a character device keeps.
//! - [`allocation`]: [`ArenaAllocator`] joins the two; an [`Allocation`] owns a range of the
//!   arena, gives `&[u8]`/`&mut [u8]` to it, and returns it to the allocator on drop.
//! - [`error`]: [`MemoryError`], naming the operation and the OS error.
//! - [`stream_copy`]: bulk copies with non-temporal stores (no cache pollution, no
//!   read-for-ownership), used by [`ForeignSegment`]'s copies.

pub mod allocation;
pub mod allocator;
pub mod arena;
pub mod dax_device;
pub mod error;
pub mod fault_guard;
pub mod file_arena;
pub mod file_region;
pub mod foreign;
pub mod shm;
pub mod stream_copy;

pub use allocation::{AdoptReport, Adopted, Allocation, ArenaAllocator, MemoryUsage, Prefaulter};
pub use allocator::{AllocError, Allocator, AllocatorStats, Block, DEFAULT_ALIGN};
pub use arena::{Arena, ArenaBacking, ArenaConfig, BackingKind, EngineSegment};
pub use dax_device::DaxDevice;
pub use error::MemoryError;
pub use file_arena::{FileBacking, PersistError};
pub use file_region::FileRegion;
pub use foreign::ForeignSegment;
