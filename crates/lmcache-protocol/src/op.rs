//! The operation table (LMCache 0.5.6 `transport/zmq_impl/wire.py`). Clients send the legacy
//! integer id when an operation has one, else its name; the server accepts both.

/// An MP operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Op {
    /// 1
    RegisterKvCache,
    /// 2
    UnregisterKvCache,
    /// 3
    RegisterQCache,
    /// 4
    UnregisterQCache,
    /// 5
    StoreQ,
    /// 6
    Store,
    /// 7
    Retrieve,
    /// 8
    Lookup,
    /// 9
    QueryPrefetchStatus,
    /// 10
    WaitPrefetchStatus,
    /// 12
    FreeLookupLocks,
    /// 13
    EndSession,
    /// 14
    RegisterKvCacheEngineDrivenContext,
    /// 15
    UnregisterKvCacheEngineDrivenContext,
    /// 16
    PrepareStore,
    /// 17
    CommitStore,
    /// 18
    PrepareRetrieve,
    /// 19
    CommitRetrieve,
    /// 20
    Clear,
    /// 21
    GetChunkSize,
    /// 22
    Ping,
    /// 23
    ReportBlockAllocation,
    /// 24
    Noop,
    /// 25
    CbRegisterRope,
    /// 26
    CbUnregisterRope,
    /// 27
    CbRetrievePreComputed,
    /// 28
    CbUnifiedLookup,
    /// 29
    P2pLookupAndLock,
    /// 30
    P2pQueryLookupResults,
    /// 31
    P2pUnlockObjects,
    /// 32
    GetExperimental,
    /// 33
    CbProtocolHandshake,
    /// by name only
    CbReorderPlan,
    /// by name only
    SubscribeKvEvents,
    /// by name only
    ServerModuleCall,
}

const TABLE: &[(Op, Option<u64>, &str)] = &[
    (Op::RegisterKvCache, Some(1), "register_kv_cache"),
    (Op::UnregisterKvCache, Some(2), "unregister_kv_cache"),
    (Op::RegisterQCache, Some(3), "register_q_cache"),
    (Op::UnregisterQCache, Some(4), "unregister_q_cache"),
    (Op::StoreQ, Some(5), "store_q"),
    (Op::Store, Some(6), "store"),
    (Op::Retrieve, Some(7), "retrieve"),
    (Op::Lookup, Some(8), "lookup"),
    (Op::QueryPrefetchStatus, Some(9), "query_prefetch_status"),
    (Op::WaitPrefetchStatus, Some(10), "wait_prefetch_status"),
    (Op::FreeLookupLocks, Some(12), "free_lookup_locks"),
    (Op::EndSession, Some(13), "end_session"),
    (Op::RegisterKvCacheEngineDrivenContext, Some(14), "register_kv_cache_engine_driven_context"),
    (
        Op::UnregisterKvCacheEngineDrivenContext,
        Some(15),
        "unregister_kv_cache_engine_driven_context",
    ),
    (Op::PrepareStore, Some(16), "prepare_store"),
    (Op::CommitStore, Some(17), "commit_store"),
    (Op::PrepareRetrieve, Some(18), "prepare_retrieve"),
    (Op::CommitRetrieve, Some(19), "commit_retrieve"),
    (Op::Clear, Some(20), "clear"),
    (Op::GetChunkSize, Some(21), "get_chunk_size"),
    (Op::Ping, Some(22), "ping"),
    (Op::ReportBlockAllocation, Some(23), "report_block_allocation"),
    (Op::Noop, Some(24), "noop"),
    (Op::CbRegisterRope, Some(25), "cb_register_rope"),
    (Op::CbUnregisterRope, Some(26), "cb_unregister_rope"),
    (Op::CbRetrievePreComputed, Some(27), "cb_retrieve_pre_computed"),
    (Op::CbUnifiedLookup, Some(28), "cb_unified_lookup"),
    (Op::P2pLookupAndLock, Some(29), "p2p_lookup_and_lock"),
    (Op::P2pQueryLookupResults, Some(30), "p2p_query_lookup_results"),
    (Op::P2pUnlockObjects, Some(31), "p2p_unlock_objects"),
    (Op::GetExperimental, Some(32), "get_experimental"),
    (Op::CbProtocolHandshake, Some(33), "cb_protocol_handshake"),
    (Op::CbReorderPlan, None, "cb_reorder_plan"),
    (Op::SubscribeKvEvents, None, "subscribe_kv_events"),
    (Op::ServerModuleCall, None, "server_module_call"),
];

impl Op {
    /// The operation with legacy id `id`.
    pub fn from_id(id: u64) -> Option<Op> {
        TABLE.iter().find(|(_, i, _)| *i == Some(id)).map(|(op, _, _)| *op)
    }

    /// The operation named `name`.
    pub fn from_name(name: &str) -> Option<Op> {
        TABLE.iter().find(|(_, _, n)| *n == name).map(|(op, _, _)| *op)
    }

    /// The legacy id, if the operation has one.
    pub fn id(self) -> Option<u64> {
        TABLE.iter().find(|(op, _, _)| *op == self).and_then(|(_, i, _)| *i)
    }

    /// The operation's name.
    pub fn name(self) -> &'static str {
        TABLE.iter().find(|(op, _, _)| *op == self).map_or("?", |(_, _, n)| n)
    }

    /// Every operation.
    pub fn all() -> impl Iterator<Item = Op> {
        TABLE.iter().map(|(op, _, _)| *op)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_names_round_trip() {
        for op in Op::all() {
            assert_eq!(Op::from_name(op.name()), Some(op));
            if let Some(id) = op.id() {
                assert_eq!(Op::from_id(id), Some(op));
            }
        }
        assert_eq!(Op::from_id(21), Some(Op::GetChunkSize));
        assert_eq!(Op::from_id(8), Some(Op::Lookup));
        assert_eq!(Op::from_id(11), None, "11 is retired");
        assert_eq!(Op::from_name("subscribe_kv_events"), Some(Op::SubscribeKvEvents));
        assert_eq!(Op::SubscribeKvEvents.id(), None);
    }
}
