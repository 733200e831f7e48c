//! `p2p_lookup_and_lock`, `p2p_query_lookup_results`, `p2p_unlock_objects`: what one
//! server of a fleet asks another about its L1 (LMCache's `P2PController` RPCs).

use rmpv::Value;

use super::expect;
use crate::error::ProtocolError;
use crate::op::Op;
use crate::types::p2p::{LayoutDesc, WireObjectKey, decode_keys};
use crate::value::{self, Fields};

/// `p2p_lookup_and_lock(keys, group_layout_descs)`: read-lock every key resident in L1.
#[derive(Debug, Clone, PartialEq)]
pub struct P2pLookupAndLock {
    /// The keys, in request order (`None`: a key no object of ours can have).
    pub keys: Vec<WireObjectKey>,
    /// Per object group id, its layout.
    pub group_layout_descs: Vec<(u32, LayoutDesc)>,
}

impl P2pLookupAndLock {
    /// From the request's parameters.
    pub fn decode(params: &[Value]) -> Result<Self, ProtocolError> {
        expect(Op::P2pLookupAndLock, params, 2)?;
        let keys = decode_keys("keys", &params[0])?;
        let descs = Fields::of("group_layout_descs", &params[1])?;
        let mut group_layout_descs = Vec::new();
        for (k, v) in descs.entries() {
            let id = value::u32_("group_layout_descs key", k)?;
            let path = format!("group_layout_descs[{id}]");
            group_layout_descs.push((id, LayoutDesc::decode(&path, v)?));
        }
        Ok(Self { keys, group_layout_descs })
    }

    /// The parameters (keys that decoded to `None` cannot be sent again: they are left out).
    pub fn encode(&self) -> Vec<Value> {
        let keys =
            self.keys.iter().filter_map(|k| k.0.as_ref()).map(WireObjectKey::encode).collect();
        let descs =
            self.group_layout_descs.iter().map(|(id, d)| (Value::from(*id), d.encode())).collect();
        vec![Value::Array(keys), Value::Map(descs)]
    }
}

/// `p2p_unlock_objects(keys)`: one read lock per key goes.
#[derive(Debug, Clone, PartialEq)]
pub struct P2pUnlockObjects {
    /// The keys.
    pub keys: Vec<WireObjectKey>,
}

impl P2pUnlockObjects {
    /// From the request's parameters.
    pub fn decode(params: &[Value]) -> Result<Self, ProtocolError> {
        expect(Op::P2pUnlockObjects, params, 1)?;
        Ok(Self { keys: decode_keys("keys", &params[0])? })
    }

    /// The parameters.
    pub fn encode(&self) -> Vec<Value> {
        let keys =
            self.keys.iter().filter_map(|k| k.0.as_ref()).map(WireObjectKey::encode).collect();
        vec![Value::Array(keys)]
    }
}
