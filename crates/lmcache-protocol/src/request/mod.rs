//! One typed request per operation: the bytes of a frame become a [`Request`](crate::Request)
//! (op and msgpack values), and that becomes one [`Command`] here, decoded once, at dispatch,
//! every field checked and named on failure. The same types encode what the Rust client, the
//! benches and the tests send, so a request's shape is written once (bytes → frame → command,
//! as mini-redis goes).
//!
//! One module per op family, as the handlers are split:
//! - [`management`]: ping, clear, report_block_allocation (and the parameterless ops);
//! - [`lookup`]: lookup, query/wait_prefetch_status, free_lookup_locks, end_session;
//! - [`engine_driven`]: the engine-driven registration, prepare/commit store and retrieve;
//! - [`lmcache_driven`]: register_kv_cache, store, retrieve;
//! - [`events`]: the KV event stream's subscription (`subscribe_kv_events`);
//! - [`p2p`]: what one server of a fleet asks another about its L1;
//! - [`blend`]: CacheBlend's handshake, rope registration, unified lookup, scatter and reorder plan.

use rmpv::Value;

use crate::error::ProtocolError;
use crate::op::Op;
use crate::types::EngineDrivenRegistration;

pub mod blend;
pub mod engine_driven;
pub mod events;
pub mod lmcache_driven;
pub mod lookup;
pub mod management;
pub mod p2p;

pub use blend::{CbRegisterRope, CbReorderPlan, CbRetrievePreComputed, CbUnifiedLookup};
pub use engine_driven::{CommitStore, KeyAndInstance};
pub use events::SubscribeKvEvents;
pub use lmcache_driven::{RegisterKvCache, Retrieve, Store};
pub use lookup::{FreeLookupLocks, Lookup, WaitPrefetchStatus};
pub use management::{Clear, Ping, ReportBlockAllocation};
pub use p2p::{P2pLookupAndLock, P2pUnlockObjects};

/// A request's parameters: exactly `n` of them, or a [`ProtocolError::ParamCount`].
pub(crate) fn expect(op: Op, params: &[Value], n: usize) -> Result<(), ProtocolError> {
    if params.len() != n {
        return Err(ProtocolError::ParamCount { op: op.name(), expected: n, got: params.len() });
    }
    Ok(())
}

/// Every operation the server serves, decoded.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    /// `get_chunk_size`.
    GetChunkSize,
    /// `get_experimental`.
    GetExperimental,
    /// `noop`.
    Noop,
    /// `ping`.
    Ping(Ping),
    /// `clear`.
    Clear(Clear),
    /// `report_block_allocation`.
    ReportBlockAllocation(ReportBlockAllocation),
    /// `lookup`.
    Lookup(Lookup),
    /// `query_prefetch_status`: its request id.
    QueryPrefetchStatus(String),
    /// `wait_prefetch_status`.
    WaitPrefetchStatus(WaitPrefetchStatus),
    /// `free_lookup_locks`.
    FreeLookupLocks(FreeLookupLocks),
    /// `end_session`: its request id.
    EndSession(String),
    /// `register_kv_cache_engine_driven_context`.
    RegisterEngineDriven(EngineDrivenRegistration),
    /// `unregister_kv_cache_engine_driven_context`: the instance.
    UnregisterEngineDriven(u64),
    /// `prepare_store`.
    PrepareStore(KeyAndInstance),
    /// `commit_store`.
    CommitStore(CommitStore),
    /// `prepare_retrieve`.
    PrepareRetrieve(KeyAndInstance),
    /// `commit_retrieve`.
    CommitRetrieve(KeyAndInstance),
    /// `register_kv_cache`.
    RegisterKvCache(RegisterKvCache),
    /// `unregister_kv_cache`: the instance.
    UnregisterKvCache(u64),
    /// `store`.
    Store(Store),
    /// `retrieve`.
    Retrieve(Retrieve),
    /// `subscribe_kv_events`.
    SubscribeKvEvents(SubscribeKvEvents),
    /// `p2p_lookup_and_lock`.
    P2pLookupAndLock(P2pLookupAndLock),
    /// `p2p_query_lookup_results`: the task id.
    P2pQueryLookupResults(u64),
    /// `p2p_unlock_objects`.
    P2pUnlockObjects(P2pUnlockObjects),
    /// `cb_protocol_handshake`: the client's blend protocol version.
    CbProtocolHandshake(i64),
    /// `cb_register_rope`.
    CbRegisterRope(CbRegisterRope),
    /// `cb_unregister_rope`: the instance.
    CbUnregisterRope(u64),
    /// `cb_unified_lookup`.
    CbUnifiedLookup(CbUnifiedLookup),
    /// `cb_retrieve_pre_computed`.
    CbRetrievePreComputed(CbRetrievePreComputed),
    /// `cb_reorder_plan`.
    CbReorderPlan(CbReorderPlan),
}

impl Command {
    /// Decodes the parameters of `op`. An operation this server does not serve is
    /// [`ProtocolError::UnsupportedOp`].
    pub fn decode(op: Op, params: &[Value]) -> Result<Self, ProtocolError> {
        let none = |c: Command| expect(op, params, 0).map(|()| c);
        let id = |name: &str| -> Result<String, ProtocolError> {
            expect(op, params, 1)?;
            Ok(crate::value::str_(name, &params[0])?.to_owned())
        };
        let instance = || -> Result<u64, ProtocolError> {
            expect(op, params, 1)?;
            crate::value::u64_("instance_id", &params[0])
        };
        Ok(match op {
            Op::GetChunkSize => none(Self::GetChunkSize)?,
            Op::GetExperimental => none(Self::GetExperimental)?,
            Op::Noop => none(Self::Noop)?,
            Op::Ping => Self::Ping(Ping::decode(params)?),
            Op::Clear => Self::Clear(Clear::decode(params)?),
            Op::ReportBlockAllocation => {
                Self::ReportBlockAllocation(ReportBlockAllocation::decode(params)?)
            }
            Op::Lookup => Self::Lookup(Lookup::decode(params)?),
            Op::QueryPrefetchStatus => Self::QueryPrefetchStatus(id("request_id")?),
            Op::WaitPrefetchStatus => Self::WaitPrefetchStatus(WaitPrefetchStatus::decode(params)?),
            Op::FreeLookupLocks => Self::FreeLookupLocks(FreeLookupLocks::decode(params)?),
            Op::EndSession => Self::EndSession(id("request_id")?),
            Op::RegisterKvCacheEngineDrivenContext => {
                expect(op, params, 1)?;
                Self::RegisterEngineDriven(EngineDrivenRegistration::decode("payload", &params[0])?)
            }
            Op::UnregisterKvCacheEngineDrivenContext => Self::UnregisterEngineDriven(instance()?),
            Op::PrepareStore => Self::PrepareStore(KeyAndInstance::decode(op, params)?),
            Op::CommitStore => Self::CommitStore(CommitStore::decode(params)?),
            Op::PrepareRetrieve => Self::PrepareRetrieve(KeyAndInstance::decode(op, params)?),
            Op::CommitRetrieve => Self::CommitRetrieve(KeyAndInstance::decode(op, params)?),
            Op::RegisterKvCache => Self::RegisterKvCache(RegisterKvCache::decode(params)?),
            Op::UnregisterKvCache => Self::UnregisterKvCache(instance()?),
            Op::Store => Self::Store(Store::decode(params)?),
            Op::Retrieve => Self::Retrieve(Retrieve::decode(params)?),
            Op::SubscribeKvEvents => Self::SubscribeKvEvents(SubscribeKvEvents::decode(params)?),
            Op::P2pLookupAndLock => Self::P2pLookupAndLock(P2pLookupAndLock::decode(params)?),
            Op::P2pQueryLookupResults => {
                expect(op, params, 1)?;
                Self::P2pQueryLookupResults(crate::value::u64_("task_id", &params[0])?)
            }
            Op::P2pUnlockObjects => Self::P2pUnlockObjects(P2pUnlockObjects::decode(params)?),
            Op::CbProtocolHandshake => {
                expect(op, params, 1)?;
                Self::CbProtocolHandshake(crate::value::int("client_version", &params[0])?)
            }
            Op::CbRegisterRope => Self::CbRegisterRope(CbRegisterRope::decode(params)?),
            Op::CbUnregisterRope => Self::CbUnregisterRope(instance()?),
            Op::CbUnifiedLookup => Self::CbUnifiedLookup(CbUnifiedLookup::decode(params)?),
            Op::CbRetrievePreComputed => {
                Self::CbRetrievePreComputed(CbRetrievePreComputed::decode(params)?)
            }
            Op::CbReorderPlan => Self::CbReorderPlan(CbReorderPlan::decode(params)?),
            other => return Err(ProtocolError::UnsupportedOp(other.name())),
        })
    }

    /// The operation and the parameters a client sends; [`Self::decode`] of them gives back
    /// `self`.
    pub fn encode(&self) -> (Op, Vec<Value>) {
        match self {
            Self::GetChunkSize => (Op::GetChunkSize, vec![]),
            Self::GetExperimental => (Op::GetExperimental, vec![]),
            Self::Noop => (Op::Noop, vec![]),
            Self::Ping(p) => (Op::Ping, p.encode()),
            Self::Clear(c) => (Op::Clear, c.encode()),
            Self::ReportBlockAllocation(r) => (Op::ReportBlockAllocation, r.encode()),
            Self::Lookup(l) => (Op::Lookup, l.encode()),
            Self::QueryPrefetchStatus(id) => {
                (Op::QueryPrefetchStatus, vec![Value::from(id.as_str())])
            }
            Self::WaitPrefetchStatus(w) => (Op::WaitPrefetchStatus, w.encode()),
            Self::FreeLookupLocks(f) => (Op::FreeLookupLocks, f.encode()),
            Self::EndSession(id) => (Op::EndSession, vec![Value::from(id.as_str())]),
            Self::RegisterEngineDriven(r) => {
                (Op::RegisterKvCacheEngineDrivenContext, vec![r.encode()])
            }
            Self::UnregisterEngineDriven(id) => {
                (Op::UnregisterKvCacheEngineDrivenContext, vec![Value::from(*id)])
            }
            Self::PrepareStore(k) => (Op::PrepareStore, k.encode()),
            Self::CommitStore(c) => (Op::CommitStore, c.encode()),
            Self::PrepareRetrieve(k) => (Op::PrepareRetrieve, k.encode()),
            Self::CommitRetrieve(k) => (Op::CommitRetrieve, k.encode()),
            Self::RegisterKvCache(r) => (Op::RegisterKvCache, r.encode()),
            Self::UnregisterKvCache(id) => (Op::UnregisterKvCache, vec![Value::from(*id)]),
            Self::Store(s) => (Op::Store, s.encode()),
            Self::Retrieve(r) => (Op::Retrieve, r.encode()),
            Self::SubscribeKvEvents(s) => (Op::SubscribeKvEvents, s.encode()),
            Self::P2pLookupAndLock(l) => (Op::P2pLookupAndLock, l.encode()),
            Self::P2pQueryLookupResults(id) => (Op::P2pQueryLookupResults, vec![Value::from(*id)]),
            Self::P2pUnlockObjects(u) => (Op::P2pUnlockObjects, u.encode()),
            Self::CbProtocolHandshake(v) => (Op::CbProtocolHandshake, vec![Value::from(*v)]),
            Self::CbRegisterRope(r) => (Op::CbRegisterRope, r.encode()),
            Self::CbUnregisterRope(id) => (Op::CbUnregisterRope, vec![Value::from(*id)]),
            Self::CbUnifiedLookup(l) => (Op::CbUnifiedLookup, l.encode()),
            Self::CbRetrievePreComputed(r) => (Op::CbRetrievePreComputed, r.encode()),
            Self::CbReorderPlan(p) => (Op::CbReorderPlan, p.encode()),
        }
    }

    /// What a registration that failed to decode says about its sender (instance id, model
    /// name, world size), so its refusal can be logged and listed against the worker.
    pub fn registration_identity(
        op: Op,
        params: &[Value],
    ) -> Option<(u64, Option<String>, Option<u32>)> {
        let s = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_owned);
        let w = |v: Option<&Value>| v.and_then(Value::as_u64).and_then(|w| u32::try_from(w).ok());
        match op {
            Op::RegisterKvCache => {
                let id = params.first().and_then(Value::as_u64)?;
                Some((id, s(params.get(2)), w(params.get(3))))
            }
            Op::RegisterKvCacheEngineDrivenContext => {
                let f = crate::value::Fields::of("payload", params.first()?).ok()?;
                let id = f.get("instance_id").and_then(Value::as_u64)?;
                Some((id, s(f.get("model_name")), w(f.get("world_size"))))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::types::{CacheKey, EngineGroupInfo, IpcDescriptor, TensorMeta};
    use lmcache_core::{Dtype, ModelName};

    fn key() -> CacheKey {
        CacheKey::whole(ModelName::new("m").unwrap(), "r", (0..512).collect(), 256)
    }

    /// One command of every served operation, every optional field set somewhere.
    pub(crate) fn samples() -> Vec<Command> {
        let k = key();
        let desc = IpcDescriptor::CpuShm {
            shm_name: "seg".into(),
            nbytes: 4096,
            meta: TensorMeta {
                dtype: Dtype::Float16,
                shape: vec![2, 4, 4, 2, 4],
                stride: vec![128, 32, 8, 4, 1],
                storage_offset: 0,
                device_uuid: "cpu".into(),
            },
        };
        let commands = vec![
            Command::GetChunkSize,
            Command::GetExperimental,
            Command::Noop,
            Command::Ping(Ping { instance_id: Some(3) }),
            Command::Ping(Ping { instance_id: None }),
            Command::Clear(Clear { force: true }),
            Command::ReportBlockAllocation(ReportBlockAllocation {
                instance_id: 1,
                model_name: "m".into(),
                records: vec![crate::value::map(vec![
                    ("req_id", Value::from("r")),
                    ("new_block_ids", Value::Array(vec![Value::from(3)])),
                    ("new_token_ids", Value::Array(vec![Value::from(7), Value::from(8)])),
                ])],
            }),
            Command::Lookup(Lookup { key: k.clone(), tp_size: Value::from(1) }),
            Command::QueryPrefetchStatus("r".into()),
            Command::WaitPrefetchStatus(WaitPrefetchStatus {
                request_id: "r".into(),
                timeout: 0.5,
            }),
            Command::FreeLookupLocks(FreeLookupLocks { key: k.clone(), tp_size: Value::from(1) }),
            Command::EndSession("r".into()),
            Command::UnregisterEngineDriven(4),
            Command::PrepareStore(KeyAndInstance { key: k.for_worker(0), instance_id: 4 }),
            Command::CommitStore(CommitStore {
                key: k.for_worker(0),
                instance_id: 4,
                data: Vec::new(),
            }),
            Command::PrepareRetrieve(KeyAndInstance { key: k.for_worker(0), instance_id: 4 }),
            Command::CommitRetrieve(KeyAndInstance { key: k.for_worker(0), instance_id: 4 }),
            Command::RegisterKvCache(RegisterKvCache {
                instance_id: 5,
                kv_cache: vec![desc],
                model_name: "m".into(),
                world_size: 1,
                engine_type: "vllm".into(),
                extra: Value::Map(Vec::new()),
                engine_group_infos: vec![EngineGroupInfo::full(0, vec![0], 4)],
            }),
            Command::UnregisterKvCache(5),
            Command::Store(Store {
                key: k.for_worker(0),
                instance_id: 5,
                block_ids: vec![vec![1, 2, 3]],
                event_ipc_handle: Vec::new(),
            }),
            Command::Retrieve(Retrieve {
                key: k.for_worker(0),
                instance_id: 5,
                block_ids: vec![vec![1, 2, 3]],
                event_ipc_handle: Vec::new(),
                skip_first_n_tokens: 16,
            }),
            Command::SubscribeKvEvents(SubscribeKvEvents {
                instance_id: 5,
                model_name: "m".into(),
                cursor: 0,
                max_events: 64,
            }),
            Command::P2pLookupAndLock(P2pLookupAndLock {
                keys: vec![crate::types::WireObjectKey(Some(
                    lmcache_core::ObjectKey::new([1; 32], "m", 1, 0, 0, "").unwrap(),
                ))],
                group_layout_descs: vec![(
                    0,
                    crate::types::LayoutDesc {
                        shapes: vec![vec![2, 4, 256, 64]],
                        dtypes: vec!["float16".into()],
                    },
                )],
            }),
            Command::P2pQueryLookupResults(7),
            Command::P2pUnlockObjects(P2pUnlockObjects {
                keys: vec![crate::types::WireObjectKey(Some(
                    lmcache_core::ObjectKey::new([1; 32], "m", 1, 0, 0, "").unwrap(),
                ))],
            }),
            Command::CbProtocolHandshake(1),
            Command::CbUnregisterRope(3),
            Command::CbRegisterRope(CbRegisterRope {
                instance_id: 3,
                cos_sin_caches: Vec::new(),
                head_size: 64,
                is_neox_style: true,
                group_to_cache: vec![0, -1],
                group_rot: vec![vec![0, 64], vec![]],
                group_head_size: vec![64, 64],
                kv_quant: String::new(),
            }),
            Command::CbUnifiedLookup(CbUnifiedLookup { key: key(), tp_size: 1 }),
            Command::CbReorderPlan(CbReorderPlan { key: key(), keep_prefix: 4, budget_ms: 50 }),
            Command::CbRetrievePreComputed(CbRetrievePreComputed {
                key: key().for_worker(0),
                match_results: vec![crate::types::blend::CbMatch {
                    old_st: 0,
                    old_ed: 16,
                    cur_st: 5,
                    cur_ed: 21,
                    hash: vec![7; 32],
                }],
                block_ids: vec![vec![1, 2]],
                instance_id: 3,
                event_ipc_handle: Vec::new(),
            }),
        ];
        commands
    }

    #[test]
    fn every_command_decodes_what_it_encodes() {
        for c in samples() {
            let (op, params) = c.encode();
            assert_eq!(Command::decode(op, &params).unwrap(), c, "{op:?}");
            // One parameter too many is named.
            let mut more = params.clone();
            more.push(Value::Nil);
            let e = Command::decode(op, &more).unwrap_err();
            assert!(matches!(e, ProtocolError::ParamCount { .. }), "{op:?}: {e}");
        }
    }

    #[test]
    fn bad_fields_are_named_and_unserved_ops_refused() {
        let k = key().for_worker(0).encode();
        let e = Command::decode(Op::Store, &[k.clone(), Value::from("x"), Value::Nil, Value::Nil])
            .unwrap_err();
        assert!(e.to_string().contains("instance_id"), "{e}");
        let e = Command::decode(Op::CommitStore, &[k, Value::from(1), Value::from(3)]).unwrap_err();
        assert!(e.to_string().contains("data"), "{e}");
        assert!(matches!(
            Command::decode(Op::ServerModuleCall, &[]),
            Err(ProtocolError::UnsupportedOp(_))
        ));
    }
}
