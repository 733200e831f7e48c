//! Kernel groups and object groups of an lmcache-driven registration, as LMCache builds them
//! (`KVLayerGroupsManager`).
//!
//! A *kernel group* is the layers that share one copy loop: the same planes, heads, head size,
//! block size, dtype and layout, in the same engine group (a paged-block address space: block
//! ids mean nothing across engine groups). Kernel groups are ordered by their first layer; the
//! request's `block_ids` carry one list per kernel group in that order. When the client sends
//! `EngineGroupInfo`s they must describe exactly these groups, one each, in order; layers no
//! group names are left out (LMCache's KV-sharing layers).
//!
//! An *object group* is what one stored object holds: by default every kernel group (one
//! full-attention object per chunk, object group 0). With `--separate-object-groups` kernel
//! groups are bucketed by (extra tag, recurrent state, sliding window in chunks), regular
//! buckets first: each bucket is its own object per chunk, keyed by its `object_group_id`, and
//! a sliding-window or recurrent bucket needs only its last chunks for a prefix hit.

use std::collections::BTreeMap;

use lmcache_core::Dtype;
use lmcache_protocol::types::EngineGroupInfo;

use crate::registry::{KernelGroup, LayerTensor, ObjectGroup, ObjectLayout, ObjectShape};
use crate::transfer::{PagedGeometry, geometry};

/// What a registration's tensors and groups work out to.
#[derive(Debug)]
pub struct Groups {
    /// Kernel groups, by first layer.
    pub kernel_groups: Vec<KernelGroup>,
    /// Object groups, by `object_group_id`.
    pub object_groups: Vec<ObjectGroup>,
    /// Each object group's stored object.
    pub objects: Vec<ObjectShape>,
}

/// An object-group bucket: (extra tag, recurrent state, window in chunks).
type Bucket = (i64, bool, Option<u64>);

/// The copy identity of a layer: (planes, heads, head size, block size, engine group, dtype,
/// MLA).
type Identity = (u64, u64, u64, u64, i64, Dtype, bool);

fn identity(layer: &LayerTensor, engine_group: i64) -> Result<(Identity, PagedGeometry), String> {
    let shape = &layer.meta.shape;
    let mla = shape.len() == 3;
    let g = geometry(layer, mla)?;
    let (heads, head) = if mla { (1, g.hidden) } else { (shape[3], shape[4]) };
    Ok(((g.kv, heads, head, g.block_size, engine_group, g.dtype, mla), g))
}

/// Builds the groups of `layers` (in registration order) for `chunk` tokens per chunk.
/// Errors name the field and what is wrong.
pub fn build(
    layers: &[LayerTensor],
    infos: &[EngineGroupInfo],
    chunk: u64,
    separate_object_groups: bool,
) -> Result<Groups, (String, String)> {
    let bad = |field: &str, reason: String| (field.to_owned(), reason);
    // Which engine group each layer belongs to (None: left out).
    let mut engine_group: Vec<Option<i64>> =
        if infos.is_empty() { vec![Some(0); layers.len()] } else { vec![None; layers.len()] };
    for (i, info) in infos.iter().enumerate() {
        for &l in &info.layer_indices {
            let slot =
                usize::try_from(l).ok().and_then(|l| engine_group.get_mut(l)).ok_or_else(|| {
                    bad(
                        &format!("engine_group_infos[{i}].layer_indices"),
                        format!(
                            "names layer {l}, but {} registered KV tensors (layers 0..{})",
                            layers.len(),
                            layers.len()
                        ),
                    )
                })?;
            *slot = Some(info.engine_group_id);
        }
    }
    // Bucket layers by identity, keeping first-appearance order.
    let mut order: Vec<Identity> = Vec::new();
    let mut members: BTreeMap<usize, (Vec<usize>, PagedGeometry)> = BTreeMap::new();
    for (idx, layer) in layers.iter().enumerate() {
        let Some(eg) = engine_group[idx] else { continue };
        let (id, g) = identity(layer, eg).map_err(|e| bad(&format!("kv_cache[{idx}]"), e))?;
        let at = match order.iter().position(|x| *x == id) {
            Some(at) => at,
            None => {
                order.push(id);
                order.len() - 1
            }
        };
        let entry = members.entry(at).or_insert_with(|| (Vec::new(), g));
        if entry.1 != g {
            return Err(bad(
                &format!("kv_cache[{idx}]"),
                format!(
                    "{} blocks where layer {} of the same group has {}",
                    g.num_blocks, entry.0[0], entry.1.num_blocks
                ),
            ));
        }
        entry.0.push(idx);
    }
    if members.is_empty() {
        return Err(bad("engine_group_infos", "no layer belongs to any group".into()));
    }
    if !infos.is_empty() && infos.len() != members.len() {
        return Err(bad(
            "engine_group_infos",
            format!(
                "{} groups, but the registered tensors form {} kernel group(s) (layers of one \
                 engine group with one shape and dtype); expecting one info per kernel group",
                infos.len(),
                members.len()
            ),
        ));
    }
    let mut kernel_groups = Vec::with_capacity(members.len());
    for (g, (_, (indices, geo))) in members.into_iter().enumerate() {
        let info = infos.get(g);
        if let Some(info) = info
            && !indices.iter().map(|&i| i as u64).eq(info.layer_indices.iter().copied())
        {
            return Err(bad(
                &format!("engine_group_infos[{g}].layer_indices"),
                format!(
                    "covers layers {:?}, but kernel group {g} is layers {indices:?}",
                    info.layer_indices
                ),
            ));
        }
        let bs = geo.block_size;
        let tpb = info.map_or(0, |i| i.tokens_per_block);
        let tpb = if tpb > 0 { tpb } else { bs };
        let sw = info.map_or(-1, |i| i.sw_size_tokens);
        let field = format!("engine_group_infos[{g}]");
        if bs == 0 || tpb % bs != 0 {
            return Err(bad(
                &field,
                format!(
                    "tokens_per_block {tpb} is not a multiple of the tensors' {bs} slots per block"
                ),
            ));
        }
        if chunk % tpb != 0 {
            return Err(bad(
                &field,
                format!("chunk size {chunk} is not a multiple of tokens_per_block {tpb}"),
            ));
        }
        let sub_window = sw > 0 && (sw as u64) < chunk;
        if sub_window && sw as u64 % tpb != 0 {
            return Err(bad(
                &field,
                format!(
                    "sliding window of {sw} tokens is not a multiple of tokens_per_block {tpb}"
                ),
            ));
        }
        let blocks_per_chunk = (chunk / tpb) as usize;
        let kept_blocks = if sub_window { (sw as u64 / tpb) as usize } else { blocks_per_chunk };
        let (kv, _, _, _, eg, _, mla) = order[g];
        kernel_groups.push(KernelGroup {
            layers: indices.iter().map(|&i| layers[i].clone()).collect(),
            layer_indices: indices,
            geometry: geo,
            mla,
            view: g,
            tokens_per_block: tpb,
            blocks_per_chunk,
            kept_blocks,
            engine_group: eg,
            sw_size_tokens: sw,
            recurrent: info.is_some_and(|i| i.recurrent_state),
            extra_tag: info.map_or(0, |i| i.extra_object_group_tag),
        });
        let _ = kv;
    }
    // Object groups.
    let window_chunks = |k: &KernelGroup| {
        (k.sw_size_tokens >= 0).then(|| (k.sw_size_tokens as u64).div_ceil(chunk).max(1))
    };
    let buckets: Vec<(Vec<usize>, Option<u64>, bool)> = if separate_object_groups {
        // (extra tag, recurrent, window) → kernel groups; regular buckets first, then by
        // their first kernel group.
        let mut by: Vec<(Bucket, Vec<usize>)> = Vec::new();
        for (i, k) in kernel_groups.iter().enumerate() {
            let b = (k.extra_tag, k.recurrent, window_chunks(k));
            match by.iter_mut().find(|(x, _)| *x == b) {
                Some((_, v)) => v.push(i),
                None => by.push((b, vec![i])),
            }
        }
        by.sort_by_key(|((tag, _, _), v)| (*tag != 0, v[0]));
        by.into_iter().map(|((_, rec, w), v)| (v, w, rec)).collect()
    } else {
        vec![((0..kernel_groups.len()).collect(), None, false)]
    };
    let mut object_groups = Vec::with_capacity(buckets.len());
    let mut objects = Vec::with_capacity(buckets.len());
    for (members, window, recurrent) in buckets {
        let parts = members
            .iter()
            .map(|&k| {
                let kg = &kernel_groups[k];
                ObjectLayout {
                    kv: kg.geometry.kv,
                    layers: kg.layers.len() as u64,
                    slots: kg.kept_blocks as u64 * kg.geometry.block_size,
                    hidden: kg.geometry.hidden,
                    dtype: kg.geometry.dtype,
                }
            })
            .collect();
        objects.push(ObjectShape { parts, window_chunks: window, recurrent });
        object_groups.push(ObjectGroup { kernel_groups: members });
    }
    Ok(Groups { kernel_groups, object_groups, objects })
}

#[cfg(test)]
mod tests {
    use super::*;
    use lmcache_memory::ForeignSegment;
    use lmcache_memory::shm::ShmSegment;
    use lmcache_protocol::types::TensorMeta;
    use std::sync::Arc;

    struct Seg {
        _owner: ShmSegment,
        seg: Arc<ForeignSegment>,
    }

    fn seg(tag: &str, bytes: u64) -> Seg {
        let name = format!("lmrs_kvg_{tag}_{}", std::process::id());
        let owner = ShmSegment::create(&name, bytes).unwrap();
        Seg { _owner: owner, seg: Arc::new(ForeignSegment::open(&name, bytes).unwrap()) }
    }

    fn kv(s: &Seg, nb: u64, bs: u64, nh: u64, hs: u64, dtype: Dtype) -> LayerTensor {
        LayerTensor {
            segment: s.seg.clone(),
            meta: TensorMeta {
                dtype,
                shape: vec![2, nb, bs, nh, hs],
                stride: vec![nb * bs * nh * hs, bs * nh * hs, nh * hs, hs, 1],
                storage_offset: 0,
                device_uuid: "cpu".into(),
            },
        }
    }

    fn mla(s: &Seg, nb: u64, bs: u64, d: u64, dtype: Dtype) -> LayerTensor {
        LayerTensor {
            segment: s.seg.clone(),
            meta: TensorMeta {
                dtype,
                shape: vec![nb, bs, d],
                stride: vec![bs * d, d, 1],
                storage_offset: 0,
                device_uuid: "cpu".into(),
            },
        }
    }

    #[test]
    fn layers_bucket_into_kernel_groups_and_one_object_by_default() {
        let s = seg("a", 1 << 20);
        // 0, 2: fp16 K/V; 1: uint8 MLA; 3: bf16 K/V; each its own engine group.
        let layers = vec![
            kv(&s, 4, 16, 2, 8, Dtype::Float16),
            mla(&s, 4, 16, 64, Dtype::UInt8),
            kv(&s, 4, 16, 2, 8, Dtype::Float16),
            kv(&s, 4, 16, 2, 8, Dtype::BFloat16),
        ];
        let infos = vec![
            EngineGroupInfo::full(0, vec![0, 2], 16),
            EngineGroupInfo::full(1, vec![1], 16),
            EngineGroupInfo::full(2, vec![3], 16),
        ];
        let g = build(&layers, &infos, 64, false).unwrap();
        let got: Vec<Vec<usize>> =
            g.kernel_groups.iter().map(|k| k.layer_indices.clone()).collect();
        assert_eq!(got, vec![vec![0, 2], vec![1], vec![3]]);
        assert!(g.kernel_groups[1].mla);
        assert_eq!(g.object_groups.len(), 1);
        let o = &g.objects[0];
        assert_eq!(o.parts.len(), 3);
        assert_eq!(
            o.parts[1],
            ObjectLayout { kv: 1, layers: 1, slots: 64, hidden: 64, dtype: Dtype::UInt8 }
        );
        // 2*2*64*16*2 + 64*64 + 2*64*16*2
        assert_eq!(o.bytes(), Some(8192 + 4096 + 4096));
        assert_eq!(o.window_chunks, None);
    }

    #[test]
    fn separate_object_groups_bucket_windows_and_recurrent_state() {
        let s = seg("b", 1 << 20);
        let layers = vec![
            kv(&s, 4, 16, 2, 8, Dtype::Float16),
            kv(&s, 4, 16, 2, 4, Dtype::Float16),
            kv(&s, 4, 16, 1, 8, Dtype::Float16),
        ];
        let mut sw = EngineGroupInfo::full(1, vec![1], 16);
        sw.sw_size_tokens = 100;
        let mut rec = EngineGroupInfo::full(2, vec![2], 16);
        rec.recurrent_state = true;
        rec.sw_size_tokens = 16;
        let infos = vec![EngineGroupInfo::full(0, vec![0], 16), sw, rec];
        let g = build(&layers, &infos, 64, true).unwrap();
        assert_eq!(g.object_groups.len(), 3);
        let w: Vec<(Option<u64>, bool)> =
            g.objects.iter().map(|o| (o.window_chunks, o.recurrent)).collect();
        assert_eq!(w, vec![(None, false), (Some(2), false), (Some(1), true)]);
        // A window inside one chunk keeps only its last blocks.
        let mut small = EngineGroupInfo::full(1, vec![1], 16);
        small.sw_size_tokens = 32;
        let infos = vec![
            EngineGroupInfo::full(0, vec![0], 16),
            small,
            EngineGroupInfo::full(2, vec![2], 16),
        ];
        let g = build(&layers, &infos, 64, true).unwrap();
        assert_eq!(g.kernel_groups[1].kept_blocks, 2);
        assert_eq!(g.objects[1].parts[0].slots, 32);
    }

    #[test]
    fn bytes_per_token_divide_a_compressed_slot_by_the_tokens_it_holds() {
        let s = seg("bpt", 1 << 20);
        // Two layers of 16-slot blocks, 2 heads x 8 dims, float16: 2 x 2 x 16 x 2 = 128 bytes
        // per slot for the group.
        let layers = vec![kv(&s, 4, 16, 2, 8, Dtype::Float16), kv(&s, 4, 16, 2, 8, Dtype::Float16)];
        let plain = build(&layers, &[EngineGroupInfo::full(0, vec![0, 1], 16)], 64, false).unwrap();
        assert_eq!(plain.kernel_groups[0].bytes_per_token(), 128);
        // 64 tokens per 16-slot block: each slot holds 4 tokens (LMCache's compress ratio).
        let packed =
            build(&layers, &[EngineGroupInfo::full(0, vec![0, 1], 64)], 64, false).unwrap();
        assert_eq!(packed.kernel_groups[0].bytes_per_token(), 32);
    }

    #[test]
    fn groups_that_disagree_with_the_tensors_are_refused_by_name() {
        let s = seg("c", 1 << 20);
        let layers = vec![kv(&s, 4, 16, 2, 8, Dtype::Float16), kv(&s, 4, 16, 2, 8, Dtype::Float16)];
        let e = build(&layers, &[EngineGroupInfo::full(0, vec![0, 5], 16)], 64, false).unwrap_err();
        assert!(e.1.contains("layer 5"), "{e:?}");
        // Two infos for what is one kernel group (same engine group and shape).
        let infos = [EngineGroupInfo::full(0, vec![0], 16), EngineGroupInfo::full(0, vec![1], 16)];
        let e = build(&layers, &infos, 64, false).unwrap_err();
        assert!(e.1.contains("1 kernel group"), "{e:?}");
        // Layer lists out of step with the kernel groups.
        let layers3 =
            vec![kv(&s, 4, 16, 2, 8, Dtype::Float16), kv(&s, 4, 16, 2, 8, Dtype::BFloat16)];
        let infos = [EngineGroupInfo::full(0, vec![0], 16), EngineGroupInfo::full(0, vec![1], 16)];
        assert!(build(&layers3, &infos, 64, false).is_ok());
        let e = build(&layers, &[EngineGroupInfo::full(0, vec![0, 1], 48)], 64, false).unwrap_err();
        assert!(e.1.contains("not a multiple of tokens_per_block 48"), "{e:?}");
        let mut sw = EngineGroupInfo::full(0, vec![0, 1], 16);
        sw.sw_size_tokens = 24;
        let e = build(&layers, &[sw], 64, false).unwrap_err();
        assert!(e.1.contains("sliding window of 24"), "{e:?}");
        // Layers no group names are left out.
        let g = build(&layers, &[EngineGroupInfo::full(0, vec![1], 16)], 64, false).unwrap();
        assert_eq!(g.kernel_groups[0].layer_indices, vec![1]);
    }
}
