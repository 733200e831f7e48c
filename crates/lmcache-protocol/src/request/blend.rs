//! CacheBlend's operations (LMCache's `--engine-type blend`): the handshake, the rope
//! registration, the unified lookup, the scatter of matched chunks and the reorder plan.

use rmpv::Value;

use super::expect;
use crate::error::ProtocolError;
use crate::op::Op;
use crate::types::blend::{CbMatch, decode_matches};
use crate::types::{self, CacheKey, IpcDescriptor};
use crate::value;

/// `cb_register_rope(instance_id, cos_sin_caches_ipc, head_size, is_neox_style,
/// group_to_cache, group_rot, group_head_size, kv_quant)`: the positional-encoding state a
/// scatter re-rotates K with. `kv_quant` may be left out (LMCache's `_v3` alias).
#[derive(Debug, Clone, PartialEq)]
pub struct CbRegisterRope {
    /// The worker, registered with `register_kv_cache` first.
    pub instance_id: u64,
    /// The cos/sin caches (`[max_position, rotary_dim]`: cos, then sin), one per rope.
    pub cos_sin_caches: Vec<IpcDescriptor>,
    /// Rotary head size.
    pub head_size: u32,
    /// NeoX (halves) or GPT-J (interleaved) rotation.
    pub is_neox_style: bool,
    /// Per engine KV group, its cache (`-1`: no rotation); empty: cache 0 for every group.
    pub group_to_cache: Vec<i64>,
    /// Per engine KV group, `[offset, width]` of the rotated elements (`[]`: none); empty:
    /// `head_size` elements from 0. Validated by the server, as LMCache does.
    pub group_rot: Vec<Vec<i64>>,
    /// Per engine KV group, its head size; empty: `head_size` for all.
    pub group_head_size: Vec<u64>,
    /// The KV's fp8 flavour (`"fp8_e4m3"`, `"fp8_e5m2"`) or `""`.
    pub kv_quant: String,
}

fn ints(field: &str, v: &Value) -> Result<Vec<i64>, ProtocolError> {
    value::array(field, v)?
        .iter()
        .enumerate()
        .map(|(i, x)| value::int(&format!("{field}[{i}]"), x))
        .collect()
}

impl CbRegisterRope {
    /// From the request's parameters (7 or 8).
    pub fn decode(params: &[Value]) -> Result<Self, ProtocolError> {
        if params.len() != 7 {
            expect(Op::CbRegisterRope, params, 8)?;
        }
        let cos_sin_caches = value::array("cos_sin_caches_ipc", &params[1])?
            .iter()
            .enumerate()
            .map(|(i, d)| IpcDescriptor::decode(&format!("cos_sin_caches_ipc[{i}]"), d))
            .collect::<Result<_, _>>()?;
        let group_rot = value::array("group_rot", &params[5])?
            .iter()
            .enumerate()
            .map(|(i, r)| match r {
                Value::Nil => Ok(Vec::new()),
                r => ints(&format!("group_rot[{i}]"), r),
            })
            .collect::<Result<_, _>>()?;
        let group_head_size = value::array("group_head_size", &params[6])?
            .iter()
            .enumerate()
            .map(|(i, x)| value::u64_(&format!("group_head_size[{i}]"), x))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            instance_id: value::u64_("instance_id", &params[0])?,
            cos_sin_caches,
            head_size: value::u32_("head_size", &params[2])?,
            is_neox_style: value::bool_("is_neox_style", &params[3])?,
            group_to_cache: ints("group_to_cache", &params[4])?,
            group_rot,
            group_head_size,
            kv_quant: match params.get(7) {
                Some(q) => value::str_("kv_quant", q)?.to_owned(),
                None => String::new(),
            },
        })
    }

    /// The parameters (all eight).
    pub fn encode(&self) -> Vec<Value> {
        let ints = |v: &[i64]| Value::Array(v.iter().map(|&x| Value::from(x)).collect());
        vec![
            Value::from(self.instance_id),
            Value::Array(self.cos_sin_caches.iter().map(IpcDescriptor::encode).collect()),
            Value::from(self.head_size),
            Value::Boolean(self.is_neox_style),
            ints(&self.group_to_cache),
            Value::Array(self.group_rot.iter().map(|r| ints(r)).collect()),
            Value::Array(self.group_head_size.iter().map(|&x| Value::from(x)).collect()),
            Value::from(self.kv_quant.as_str()),
        ]
    }
}

/// `cb_unified_lookup(key, tp_size)`: the prefix and the matches beyond it, answered nil
/// while their KV is still loading (the client asks again).
#[derive(Debug, Clone, PartialEq)]
pub struct CbUnifiedLookup {
    /// Every shard of the request (`worker_id` nil).
    pub key: CacheKey,
    /// Tensor-parallel size.
    pub tp_size: u32,
}

impl CbUnifiedLookup {
    /// From the request's parameters.
    pub fn decode(params: &[Value]) -> Result<Self, ProtocolError> {
        expect(Op::CbUnifiedLookup, params, 2)?;
        Ok(Self {
            key: CacheKey::decode("key", &params[0])?,
            tp_size: value::u32_("tp_size", &params[1])?,
        })
    }

    /// The parameters.
    pub fn encode(&self) -> Vec<Value> {
        vec![self.key.encode(), Value::from(self.tp_size)]
    }
}

/// `cb_retrieve_pre_computed(key, match_results, block_ids, instance_id, event_ipc_handle)`:
/// scatter the matched chunks' KV into the engine's blocks at their new positions.
#[derive(Debug, Clone, PartialEq)]
pub struct CbRetrievePreComputed {
    /// One worker's view of the request.
    pub key: CacheKey,
    /// The matches to scatter (from the unified lookup).
    pub match_results: Vec<CbMatch>,
    /// The paged blocks of each engine KV group.
    pub block_ids: Vec<Vec<u64>>,
    /// The registered worker.
    pub instance_id: u64,
    /// A CUDA event's handle (empty on the CPU).
    pub event_ipc_handle: Vec<u8>,
}

impl CbRetrievePreComputed {
    /// From the request's parameters.
    pub fn decode(params: &[Value]) -> Result<Self, ProtocolError> {
        expect(Op::CbRetrievePreComputed, params, 5)?;
        Ok(Self {
            key: CacheKey::decode("key", &params[0])?,
            match_results: decode_matches("match_results", &params[1])?,
            block_ids: types::block_ids("block_ids", &params[2])?,
            instance_id: value::u64_("instance_id", &params[3])?,
            event_ipc_handle: value::bin("event_ipc_handle", &params[4])?.to_vec(),
        })
    }

    /// The parameters.
    pub fn encode(&self) -> Vec<Value> {
        vec![
            self.key.encode(),
            Value::Array(self.match_results.iter().map(CbMatch::encode).collect()),
            super::lmcache_driven::blocks(&self.block_ids),
            Value::from(self.instance_id),
            Value::Binary(self.event_ipc_handle.clone()),
        ]
    }
}

/// `cb_reorder_plan(key, keep_prefix, budget_ms)`: an order of the prompt that starts with a
/// cached prompt, or `[]` to keep it.
#[derive(Debug, Clone, PartialEq)]
pub struct CbReorderPlan {
    /// The request.
    pub key: CacheKey,
    /// Leading tokens that stay in place.
    pub keep_prefix: u64,
    /// Planning time allowed.
    pub budget_ms: u64,
}

impl CbReorderPlan {
    /// From the request's parameters.
    pub fn decode(params: &[Value]) -> Result<Self, ProtocolError> {
        expect(Op::CbReorderPlan, params, 3)?;
        Ok(Self {
            key: CacheKey::decode("key", &params[0])?,
            keep_prefix: value::u64_("keep_prefix", &params[1])?,
            budget_ms: value::u64_("budget_ms", &params[2])?,
        })
    }

    /// The parameters.
    pub fn encode(&self) -> Vec<Value> {
        vec![self.key.encode(), Value::from(self.keep_prefix), Value::from(self.budget_ms)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// LMCache 0.5.6's client frames (captured from `RequestClientFactory`'s client), one
    /// msgpack value per parameter.
    fn frames(hex_frames: &[&str]) -> Vec<Value> {
        hex_frames.iter().map(|h| value::decode(0, &hex::decode(h).unwrap()).unwrap()).collect()
    }

    const KEY: &str = "8aaa6d6f64656c5f6e616d65a16daa776f726c645f73697a6501a9776f726b65725f6964c0a9746f6b656e5f69647393010203a5737461727400a3656e6403aa726571756573745f6964a172aa63616368655f73616c74a0af726571756573745f636f6e66696773c0ae6e756d5f6b765f7265616465727301";

    #[test]
    fn lmcaches_blend_requests_decode() {
        // cb_register_rope_v3(7, [], 128, True, [0], [[0, 64]], [128]): kv_quant defaulted.
        let r = CbRegisterRope::decode(&frames(&[
            "07", "90", "cc80", "c3", "9100", "91920040", "91cc80", "a0",
        ]))
        .unwrap();
        assert_eq!(
            (r.instance_id, r.head_size, r.is_neox_style, r.kv_quant.as_str()),
            (7, 128, true, "")
        );
        assert_eq!(
            (r.group_to_cache, r.group_rot, r.group_head_size),
            (vec![0], vec![vec![0, 64]], vec![128])
        );
        let r = CbRegisterRope::decode(&frames(&[
            "07",
            "90",
            "cc80",
            "c2",
            "90",
            "90",
            "90",
            "a86670385f65346d33",
        ]))
        .unwrap();
        assert_eq!(r.kv_quant, "fp8_e4m3");
        assert_eq!(CbRegisterRope::decode(&r.encode()).unwrap(), r);
        let seven = &r.encode()[..7];
        assert_eq!(CbRegisterRope::decode(seven).unwrap().kv_quant, "");

        let l = CbUnifiedLookup::decode(&frames(&[KEY, "02"])).unwrap();
        assert_eq!((l.key.worker_id, l.key.token_ids.clone(), l.tp_size), (None, vec![1, 2, 3], 2));
        assert_eq!(CbUnifiedLookup::decode(&l.encode()).unwrap(), l);

        let p = CbReorderPlan::decode(&frames(&[KEY, "10", "32"])).unwrap();
        assert_eq!((p.keep_prefix, p.budget_ms), (16, 50));

        let m = "9185a66f6c645f7374cd0100a66f6c645f6564cd0200a66375725f7374cd012ca66375725f6564cd022ca468617368c4020102";
        let c =
            CbRetrievePreComputed::decode(&frames(&[KEY, m, "9193010203", "07", "c400"])).unwrap();
        assert_eq!(c.match_results[0].cur_st, 300);
        assert_eq!((c.block_ids.clone(), c.instance_id), (vec![vec![1, 2, 3]], 7));
        assert_eq!(CbRetrievePreComputed::decode(&c.encode()).unwrap(), c);
    }

    #[test]
    fn a_bad_blend_request_names_its_field() {
        let e = CbRegisterRope::decode(&frames(&["07", "90", "cc80", "c3", "91a178", "90", "90"]))
            .unwrap_err();
        assert!(e.to_string().contains("group_to_cache[0]"), "{e}");
        let e = CbUnifiedLookup::decode(&frames(&[KEY])).unwrap_err();
        assert!(e.to_string().contains("cb_unified_lookup"), "{e}");
    }
}
