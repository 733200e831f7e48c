//! Moving KV between an engine's paged cache and L1 objects, on the CPU.
//!
//! The engine's cache is one tensor per layer, `[2, NB, BS, NH, HS]` (or `[NB, BS, D]` for
//! MLA), living in shared-memory segments the client registered. An object holds one chunk
//! as `[kv, L, T, H]`: element `[p, l, t, :]` is layer `l`'s plane `p` at block
//! `blocks[t / BS]`, slot `t % BS`. Each block of a plane is one contiguous run of
//! `BS * H` elements in both places, so a chunk moves as `kv * L * blocks_per_chunk` copies.
//!
//! Every block id is checked against the layer's block count before any copy, and every copy
//! is bounds-checked by [`ForeignSegment`](lmcache_memory::ForeignSegment): a bad id is a
//! failed request, never a read or write outside a segment. [`KvTransfer`] is the seam where a
//! GPU backend plugs in later.

use md5::{Digest, Md5};
use thiserror::Error;

use crate::registry::LayerTensor;
use lmcache_core::Dtype;
use lmcache_memory::AllocError;

/// Why a transfer failed.
#[derive(Debug, Error)]
pub enum TransferError {
    /// A block id beyond the layer's blocks.
    #[error("block id {block} is outside the {num_blocks} blocks of the registered KV cache")]
    BlockOutOfRange {
        /// The id.
        block: u64,
        /// Blocks per layer.
        num_blocks: u64,
    },
    /// The object buffer does not match the layout.
    #[error("object of {got} bytes, the layout needs {expected}")]
    ObjectSize {
        /// Needed.
        expected: u64,
        /// Given.
        got: u64,
    },
    /// A copy fell outside a segment (a layout inconsistency caught before touching memory).
    #[error(transparent)]
    Bounds(#[from] AllocError),
    /// A copy thread panicked.
    #[error("a copy thread panicked")]
    Panicked,
}

/// Geometry of a registered paged KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedGeometry {
    /// Planes (2, or 1 for MLA).
    pub kv: u64,
    /// Blocks per layer.
    pub num_blocks: u64,
    /// Tokens per block.
    pub block_size: u64,
    /// Elements per token (heads x head size, or D).
    pub hidden: u64,
    /// Element type.
    pub dtype: Dtype,
}

impl PagedGeometry {
    /// Bytes of one block of one plane of one layer. [`geometry`] checked that a block lies
    /// inside its segment, so this cannot overflow for a validated geometry; it saturates
    /// rather than wrap for any other.
    pub fn block_bytes(&self) -> u64 {
        self.block_size.saturating_mul(self.hidden).saturating_mul(self.dtype.itemsize())
    }
}

/// Validates a layer tensor and returns its geometry. The inner block (`[BS, NH, HS]` or
/// `[BS, D]`) must be contiguous, and the farthest element must lie inside the mapping.
pub fn geometry(layer: &LayerTensor, mla: bool) -> Result<PagedGeometry, String> {
    let m = &layer.meta;
    if m.stride.len() != m.shape.len() {
        return Err(format!("{} dims but {} strides", m.shape.len(), m.stride.len()));
    }
    // Every product of wire numbers is checked: a shape from a client may be anything.
    let mul = |a: u64, b: u64| a.checked_mul(b).ok_or_else(|| "shape overflow".to_owned());
    let (kv, nb, bs, hidden, inner_ok, block_stride_ok) = match (mla, m.shape.as_slice()) {
        (false, [2, nb, bs, nh, hs]) => {
            let s = &m.stride;
            let hidden = mul(*nh, *hs)?;
            let block = mul(*bs, hidden)?;
            let ok = s[4] == 1 && s[3] == *hs && s[2] == hidden;
            (2, *nb, *bs, hidden, ok, s[1] >= block)
        }
        (true, [nb, bs, d]) => {
            let s = &m.stride;
            (1, *nb, *bs, *d, s[2] == 1 && s[1] == *d, s[0] >= mul(*bs, *d)?)
        }
        _ => {
            return Err(format!(
                "unsupported KV tensor shape {:?} (expected [2, NB, BS, NH, HS]{})",
                m.shape,
                if mla { " or MLA [NB, BS, D]" } else { "" }
            ));
        }
    };
    if !inner_ok || !block_stride_ok {
        return Err(format!("KV tensor blocks are not contiguous (strides {:?})", m.stride));
    }
    // Last element offset, with overflow checks.
    let mut last = m.storage_offset;
    for (d, s) in m.shape.iter().zip(&m.stride) {
        let add = d.checked_sub(1).and_then(|x| x.checked_mul(*s)).ok_or("shape overflow")?;
        last = last.checked_add(add).ok_or("shape overflow")?;
    }
    let end = last
        .checked_add(1)
        .and_then(|e| e.checked_mul(m.dtype.itemsize()))
        .ok_or("shape overflow")?;
    if end > layer.segment.len() {
        return Err(format!(
            "KV tensor needs {end} bytes but its segment maps {}",
            layer.segment.len()
        ));
    }
    Ok(PagedGeometry { kv, num_blocks: nb, block_size: bs, hidden, dtype: m.dtype })
}

/// Moves chunks between paged layer tensors and objects.
pub trait KvTransfer: Send + Sync {
    /// Copies `blocks` of every layer into `object` (`[kv, L, T, H]`).
    fn gather(&self, blocks: &[u64], object: &mut [u8]) -> Result<(), TransferError>;
    /// Copies `object` into `blocks`, leaving the first `skip_blocks` blocks untouched.
    fn scatter(
        &self,
        blocks: &[u64],
        skip_blocks: usize,
        object: &[u8],
    ) -> Result<(), TransferError>;
}

/// The CPU backend over shared-memory layer tensors.
#[derive(Debug)]
pub struct CpuTransfer<'a> {
    /// The layers, in order.
    pub layers: &'a [LayerTensor],
    /// Their common geometry.
    pub geometry: PagedGeometry,
    /// Copy threads for large copies (`--copy-threads`; 1 copies on the calling thread).
    pub threads: usize,
}

impl<'a> CpuTransfer<'a> {
    /// Byte offset of block `b` of plane `p` in layer `l`'s segment.
    fn block_offset(&self, l: usize, p: u64, b: u64) -> Result<u64, TransferError> {
        let g = &self.geometry;
        if b >= g.num_blocks {
            return Err(TransferError::BlockOutOfRange { block: b, num_blocks: g.num_blocks });
        }
        let m = &self.layers[l].meta;
        // Within the extent `geometry` checked, so these cannot overflow; checked anyway, as
        // the segment copy is the last line of defence, not the first.
        let elem = if g.kv == 2 {
            p.checked_mul(m.stride[0])
                .zip(b.checked_mul(m.stride[1]))
                .and_then(|(a, c)| m.storage_offset.checked_add(a)?.checked_add(c))
        } else {
            b.checked_mul(m.stride[0]).and_then(|a| m.storage_offset.checked_add(a))
        };
        elem.and_then(|e| e.checked_mul(g.dtype.itemsize()))
            .ok_or(TransferError::BlockOutOfRange { block: b, num_blocks: g.num_blocks })
    }

    fn check_object(&self, blocks: &[u64], len: usize) -> Result<u64, TransferError> {
        let g = &self.geometry;
        let run = g.block_bytes();
        let expected =
            g.kv.checked_mul(self.layers.len() as u64)
                .and_then(|x| x.checked_mul(blocks.len() as u64))
                .and_then(|x| x.checked_mul(run))
                .unwrap_or(u64::MAX);
        if len as u64 != expected {
            return Err(TransferError::ObjectSize { expected, got: len as u64 });
        }
        for &b in blocks {
            if b >= g.num_blocks {
                return Err(TransferError::BlockOutOfRange { block: b, num_blocks: g.num_blocks });
            }
        }
        Ok(run)
    }
}

impl CpuTransfer<'_> {
    /// Writes consecutive tokens' rows (`hidden` elements each) of plane `p` of layer `l` into
    /// slots `in_block..` of block `block` (CacheBlend's scatter lands a match's tokens
    /// wherever its new positions fall, one block's run at a time). The block is checked
    /// against the tensor and the slots against the block before the write, and the segment
    /// write is bounds-checked again.
    pub fn write_token_rows(
        &self,
        l: usize,
        p: u64,
        block: u64,
        in_block: u64,
        rows: &[u8],
    ) -> Result<(), TransferError> {
        let g = &self.geometry;
        let row_bytes = g.hidden.saturating_mul(g.dtype.itemsize());
        let len = rows.len() as u64;
        let n = len.checked_div(row_bytes).unwrap_or(0);
        if n == 0
            || len % row_bytes != 0
            || in_block.checked_add(n).is_none_or(|end| end > g.block_size)
            || l >= self.layers.len()
        {
            return Err(TransferError::ObjectSize {
                expected: row_bytes * (g.block_size.saturating_sub(in_block)),
                got: len,
            });
        }
        let at = self.block_offset(l, p, block)? + in_block * row_bytes;
        self.layers[l].segment.write(at, rows)?;
        Ok(())
    }
}

/// Copies below this size stay on one thread (spawning costs more than it saves).
const PARALLEL_MIN_BYTES: usize = 8 << 20;

impl CpuTransfer<'_> {
    /// Threads for a copy of `bytes`: one for small copies, else the configured count.
    fn threads(&self, bytes: usize) -> usize {
        if bytes < PARALLEL_MIN_BYTES { 1 } else { self.threads.max(1) }
    }

    /// Runs `f(plane, layer, slab)` for every `[plane, layer]` slab of `object`, spread over
    /// threads. Slabs are disjoint `chunks_mut` of the object, so no two threads share bytes.
    fn for_each_slab<F>(
        &self,
        object: &mut [u8],
        slab_len: usize,
        f: F,
    ) -> Result<(), TransferError>
    where
        F: Fn(u64, usize, &mut [u8]) -> Result<(), TransferError> + Sync,
    {
        let layers = self.layers.len();
        let threads = self.threads(object.len());
        let slabs: Vec<(usize, &mut [u8])> = object.chunks_mut(slab_len).enumerate().collect();
        if threads <= 1 {
            for (i, slab) in slabs {
                f((i / layers) as u64, i % layers, slab)?;
            }
            return Ok(());
        }
        let per = slabs.len().div_ceil(threads);
        let mut groups: Vec<Vec<(usize, &mut [u8])>> = Vec::new();
        let mut it = slabs.into_iter().peekable();
        while it.peek().is_some() {
            groups.push(it.by_ref().take(per).collect());
        }
        std::thread::scope(|scope| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|group| {
                    let f = &f;
                    scope.spawn(move || {
                        for (i, slab) in group {
                            f((i / layers) as u64, i % layers, slab)?;
                        }
                        Ok::<(), TransferError>(())
                    })
                })
                .collect();
            handles.into_iter().try_for_each(|h| h.join().unwrap_or(Err(TransferError::Panicked)))
        })
    }
}

impl KvTransfer for CpuTransfer<'_> {
    fn gather(&self, blocks: &[u64], object: &mut [u8]) -> Result<(), TransferError> {
        let run = self.check_object(blocks, object.len())? as usize;
        self.for_each_slab(object, run * blocks.len(), |p, l, slab| {
            for (j, &b) in blocks.iter().enumerate() {
                let src = self.block_offset(l, p, b)?;
                self.layers[l].segment.read(src, &mut slab[j * run..(j + 1) * run])?;
            }
            Ok(())
        })
    }

    fn scatter(
        &self,
        blocks: &[u64],
        skip_blocks: usize,
        object: &[u8],
    ) -> Result<(), TransferError> {
        let run = self.check_object(blocks, object.len())? as usize;
        let slab_len = run * blocks.len();
        let layers = self.layers.len();
        let work = |i: usize, slab: &[u8]| -> Result<(), TransferError> {
            let (p, l) = ((i / layers) as u64, i % layers);
            for (j, &b) in blocks.iter().enumerate().skip(skip_blocks) {
                let dst = self.block_offset(l, p, b)?;
                self.layers[l].segment.write(dst, &slab[j * run..(j + 1) * run])?;
            }
            Ok(())
        };
        let slabs: Vec<(usize, &[u8])> = object.chunks(slab_len).enumerate().collect();
        let threads = self.threads(object.len());
        if threads <= 1 {
            return slabs.into_iter().try_for_each(|(i, slab)| work(i, slab));
        }
        let per = slabs.len().div_ceil(threads);
        std::thread::scope(|scope| {
            let handles: Vec<_> = slabs
                .chunks(per)
                .map(|group| {
                    let work = &work;
                    scope.spawn(move || group.iter().try_for_each(|&(i, slab)| work(i, slab)))
                })
                .collect();
            handles.into_iter().try_for_each(|h| h.join().unwrap_or(Err(TransferError::Panicked)))
        })
    }
}

/// For each registered layer, in order: (kernel group, position in it).
pub type LayerOrder = Vec<(usize, usize)>;

/// The copy loops of a worker's kernel groups, and for each registered layer in registration
/// order its (kernel group, position in it); `None` unless it registered for lmcache-driven
/// transfer. Layers no group holds are left out.
pub fn kernel_transfers(
    inst: &crate::registry::Instance,
    threads: usize,
) -> Option<(Vec<CpuTransfer<'_>>, LayerOrder)> {
    let crate::registry::Registration::LmcacheDriven { kernel_groups, .. } = &inst.registration
    else {
        return None;
    };
    let transfers = kernel_groups
        .iter()
        .map(|k| CpuTransfer { layers: &k.layers, geometry: k.geometry, threads })
        .collect();
    let mut order: Vec<(usize, usize, usize)> = kernel_groups
        .iter()
        .enumerate()
        .flat_map(|(g, k)| k.layer_indices.iter().enumerate().map(move |(j, &l)| (l, g, j)))
        .collect();
    order.sort_unstable();
    Some((transfers, order.into_iter().map(|(_, g, j)| (g, j)).collect()))
}

/// LMCache's `POST /cache/checksums`: for each group of `chunk_blocks` blocks, one MD5 over
/// every layer's gathered blocks (registration order, plane-major within a layer, each layer
/// in its own kernel group's geometry), bfloat16 upcast to float32. MD5 is a serial hash of
/// about 600 MB/s, so the chunks (independent digests) are hashed on every core at once.
pub fn checksums(
    groups: &[CpuTransfer<'_>],
    layers: &[(usize, usize)],
    blocks: &[u64],
    chunk_blocks: usize,
    layerwise: bool,
) -> Result<Vec<Vec<String>>, TransferError> {
    let chunks: Vec<&[u64]> = blocks.chunks(chunk_blocks.max(1)).collect();
    let n_out = if layerwise { layers.len() } else { 1 };
    // One chunk's digests: one, or one per layer.
    let digest = |chunk: &[u64]| -> Result<Vec<String>, TransferError> {
        let (mut buf, mut upcast) = (Vec::new(), Vec::new());
        let mut md5s = vec![Md5::new(); n_out];
        for (li, &(g, l)) in layers.iter().enumerate() {
            let Some(t) = groups.get(g) else { continue };
            let geo = t.geometry;
            buf.resize(geo.block_bytes() as usize, 0);
            let h = &mut md5s[if layerwise { li } else { 0 }];
            for p in 0..geo.kv {
                for &b in chunk {
                    let off = t.block_offset(l, p, b)?;
                    t.layers[l].segment.read(off, &mut buf)?;
                    if geo.dtype == Dtype::BFloat16 {
                        upcast.clear();
                        for pair in buf.chunks_exact(2) {
                            upcast.extend_from_slice(&[0, 0, pair[0], pair[1]]);
                        }
                        h.update(&upcast);
                    } else {
                        h.update(&buf);
                    }
                }
            }
        }
        Ok(md5s.into_iter().map(|h| format!("{:x}", h.finalize())).collect())
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(chunks.len());
    let per_chunk: Vec<Vec<String>> = if threads <= 1 {
        chunks.iter().map(|c| digest(c)).collect::<Result<_, _>>()?
    } else {
        // Chunk i on thread i % threads; answers put back in chunk order.
        let mut slots: Vec<Option<Result<Vec<String>, TransferError>>> =
            (0..chunks.len()).map(|_| None).collect();
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|th| {
                    let (chunks, digest) = (&chunks, &digest);
                    scope.spawn(move || {
                        (th..chunks.len())
                            .step_by(threads)
                            .map(|i| (i, digest(chunks[i])))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            for h in handles {
                match h.join() {
                    Ok(done) => done.into_iter().for_each(|(i, r)| slots[i] = Some(r)),
                    Err(_) => slots.iter_mut().for_each(|s| {
                        s.get_or_insert(Err(TransferError::Panicked));
                    }),
                }
            }
        });
        slots
            .into_iter()
            .map(|s| s.unwrap_or(Err(TransferError::Panicked)))
            .collect::<Result<_, _>>()?
    };
    // Per output (the whole chunk, or each layer), one digest per chunk.
    let mut out = vec![Vec::with_capacity(chunks.len()); n_out];
    for digests in per_chunk {
        for (o, d) in out.iter_mut().zip(digests) {
            o.push(d);
        }
    }
    Ok(out)
}

/// LMCache's `compress_slot_mapping`: runs of 3+ consecutive ids become `[first, last]`.
pub fn compress_ranges(ids: &[u64]) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < ids.len() {
        let mut j = i;
        while j + 1 < ids.len() && ids[j].checked_add(1) == Some(ids[j + 1]) {
            j += 1;
        }
        if j - i >= 2 {
            out.push(serde_json::json!([ids[i], ids[j]]));
        } else {
            for id in &ids[i..=j] {
                out.push(serde_json::json!(id));
            }
        }
        i = j + 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use lmcache_memory::ForeignSegment;
    use lmcache_memory::shm::ShmSegment;
    use lmcache_protocol::types::TensorMeta;
    use std::sync::Arc;

    fn layer(name: &str, nb: u64, bs: u64, nh: u64, hs: u64) -> (ShmSegment, LayerTensor) {
        let bytes = 2 * nb * bs * nh * hs * 2;
        let owner = ShmSegment::create(name, bytes).unwrap();
        let seg = Arc::new(ForeignSegment::open(name, bytes).unwrap());
        let meta = TensorMeta {
            dtype: Dtype::Float16,
            shape: vec![2, nb, bs, nh, hs],
            stride: vec![nb * bs * nh * hs, bs * nh * hs, nh * hs, hs, 1],
            storage_offset: 0,
            device_uuid: "cpu".into(),
        };
        (owner, LayerTensor { segment: seg, meta })
    }

    #[test]
    fn gather_then_scatter_round_trips_and_skips() {
        let pid = std::process::id();
        let (_o1, l1) = layer(&format!("lmrs_t_l1_{pid}"), 8, 4, 2, 8);
        let (_o2, l2) = layer(&format!("lmrs_t_l2_{pid}"), 8, 4, 2, 8);
        for (i, l) in [&l1, &l2].iter().enumerate() {
            // Not periodic in the block size, so no two blocks hold the same bytes.
            let data: Vec<u8> = (0..l.segment.len())
                .map(|x| ((x.wrapping_mul(2_654_435_761) >> 13) as u8).wrapping_add(i as u8))
                .collect();
            l.segment.write(0, &data).unwrap();
        }
        let layers = vec![l1, l2];
        let g = geometry(&layers[0], false).unwrap();
        let t = CpuTransfer { layers: &layers, geometry: g, threads: 1 };
        let blocks = [5, 2];
        let mut obj = vec![0u8; (2 * 2 * 2 * g.block_bytes()) as usize];
        t.gather(&blocks, &mut obj).unwrap();
        // Object element [p=1, l=1, t=0] is layer 1, plane 1, block 5.
        let run = g.block_bytes() as usize;
        let want_off = t.block_offset(1, 1, 5).unwrap();
        let mut want = vec![0u8; run];
        layers[1].segment.read(want_off, &mut want).unwrap();
        assert_eq!(&obj[3 * 2 * run..3 * 2 * run + run], &want[..]);
        // Scatter into other blocks, skipping the first: block 6 stays as it was.
        let mut before6 = vec![0u8; run];
        layers[0].segment.read(t.block_offset(0, 0, 6).unwrap(), &mut before6).unwrap();
        t.scatter(&[6, 7], 1, &obj).unwrap();
        let mut after6 = vec![0u8; run];
        layers[0].segment.read(t.block_offset(0, 0, 6).unwrap(), &mut after6).unwrap();
        assert_eq!(before6, after6, "skipped block was written");
        let mut back = vec![0u8; obj.len()];
        t.gather(&[5, 7], &mut back).unwrap();
        assert_eq!(back, obj, "block 7 must now equal block 2's data");
        // Bad ids and sizes fail before any copy.
        assert!(matches!(t.gather(&[8, 0], &mut obj), Err(TransferError::BlockOutOfRange { .. })));
        assert!(t.scatter(&[u64::MAX, 0], 0, &obj).is_err());
        assert!(matches!(t.gather(&[1], &mut obj), Err(TransferError::ObjectSize { .. })));
        // Checksums: one per group, stable.
        let order = [(0, 0), (0, 1)];
        let c = checksums(std::slice::from_ref(&t), &order, &[5, 7], 2, false).unwrap();
        assert_eq!(c[0].len(), 1);
        assert_eq!(c, checksums(std::slice::from_ref(&t), &order, &[5, 7], 2, false).unwrap());
        assert_ne!(c, checksums(std::slice::from_ref(&t), &order, &[5, 6], 2, false).unwrap());
    }

    #[test]
    fn parallel_copies_match_the_single_threaded_ones() {
        // 2 layers x 64 blocks x 64 KiB per block-plane: 16 MiB objects take the threaded path.
        let pid = std::process::id();
        let (_o1, l1) = layer(&format!("lmrs_t_pl1_{pid}"), 64, 16, 16, 128);
        let (_o2, l2) = layer(&format!("lmrs_t_pl2_{pid}"), 64, 16, 16, 128);
        for (i, l) in [&l1, &l2].iter().enumerate() {
            let data: Vec<u8> = (0..l.segment.len())
                .map(|x| ((x.wrapping_mul(2_654_435_761) >> 11) as u8) ^ i as u8)
                .collect();
            l.segment.write(0, &data).unwrap();
        }
        let layers = vec![l1, l2];
        let g = geometry(&layers[0], false).unwrap();
        let t = CpuTransfer { layers: &layers, geometry: g, threads: 2 };
        let blocks: Vec<u64> = (0..32).collect();
        let mut obj = vec![0u8; (2 * 2 * 32 * g.block_bytes()) as usize];
        assert!(obj.len() >= PARALLEL_MIN_BYTES, "test must exercise the threaded path");
        t.gather(&blocks, &mut obj).unwrap();
        // Same bytes as one block copied at a time.
        let run = g.block_bytes() as usize;
        let mut want = vec![0u8; run];
        for (slab, (p, l)) in [(0, 0), (0, 1), (1, 0), (1, 1)].into_iter().enumerate() {
            for (j, &b) in blocks.iter().enumerate() {
                layers[l].segment.read(t.block_offset(l, p, b).unwrap(), &mut want).unwrap();
                let at = (slab * blocks.len() + j) * run;
                assert_eq!(&obj[at..at + run], &want[..], "slab {slab} block {j}");
            }
        }
        let dst: Vec<u64> = (32..64).collect();
        t.scatter(&dst, 3, &obj).unwrap();
        let mut back = vec![0u8; obj.len()];
        t.gather(&dst, &mut back).unwrap();
        // The first 3 blocks of each slab were skipped; the rest round-trip.
        for slab in 0..4 {
            let from = (slab * 32 + 3) * run;
            let to = (slab + 1) * 32 * run;
            assert_eq!(&back[from..to], &obj[from..to], "slab {slab}");
        }
    }

    #[test]
    fn geometry_refuses_bad_layouts() {
        let pid = std::process::id();
        let (_o, mut l) = layer(&format!("lmrs_t_geo_{pid}"), 4, 4, 2, 8);
        assert!(geometry(&l, false).is_ok());
        l.meta.shape[1] = 1000;
        assert!(geometry(&l, false).unwrap_err().contains("segment maps"));
        l.meta.shape[1] = 4;
        l.meta.stride[4] = 2;
        assert!(geometry(&l, false).unwrap_err().contains("contiguous"));
        l.meta.shape = vec![4, 4];
        assert!(geometry(&l, false).is_err());
        // Products of wire numbers that overflow u64 are refused, not wrapped or panicking
        // (debug builds check overflow).
        let big = 1u64 << 40;
        l.meta.shape = vec![2, 4, big, big, big];
        l.meta.stride = vec![1, 1, 1, big, 1];
        assert_eq!(geometry(&l, false).unwrap_err(), "shape overflow");
        l.meta.shape = vec![4, big, big];
        l.meta.stride = vec![1, big, 1];
        assert_eq!(geometry(&l, true).unwrap_err(), "shape overflow");
        l.meta.shape = vec![2, 4, 4, 2, 8];
        l.meta.stride = vec![u64::MAX, u64::MAX, 16, 8, 1];
        assert!(geometry(&l, false).unwrap_err().contains("overflow"));
        l.meta.stride = vec![1, 2, 3];
        assert!(geometry(&l, false).unwrap_err().contains("strides"));
    }

    #[test]
    fn ranges_compress_like_lmcache() {
        let j = |v: &[u64]| serde_json::to_string(&compress_ranges(v)).unwrap();
        assert_eq!(j(&[1, 2, 3, 4, 5, 9, 10, 11, 12]), "[[1,5],[9,12]]");
        assert_eq!(j(&[5, 3, 1, 2, 4]), "[5,3,1,2,4]");
        assert_eq!(j(&[1, 2, 3, 4, 5, 7, 8]), "[[1,5],7,8]");
        assert_eq!(j(&[]), "[]");
        assert_eq!(j(&[u64::MAX - 1, u64::MAX, 0]), format!("[{},{},0]", u64::MAX - 1, u64::MAX));
    }
}
