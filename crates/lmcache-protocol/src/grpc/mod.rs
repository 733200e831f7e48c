//! LMCache 0.5.6's gRPC transport (`--transport grpc`): the same operations as the ZMQ
//! frames, as protobuf messages in package `lmcache.mp` over gRPC.
//!
//! One door: a gRPC request becomes the very parameter list LMCache's ZMQ client would have
//! sent for that operation ([`decode_request`]), so [`Command::decode`](crate::request::Command)
//! checks it field by field exactly as it checks a ZMQ frame; the handler's reply value
//! becomes the method's response message ([`encode_response`]). Nothing here knows sockets.
//!
//! - [`messages`]: the protobuf messages (prost structs whose field numbers are the
//!   contract).
//! - [`METHODS`]: every service method, its HTTP/2 path and its operation.
//! - [`convert`]: protobuf request → msgpack parameters, msgpack reply → protobuf response.

pub mod convert;
pub mod messages;

pub use convert::{decode_request, encode_event_batch, encode_response};

use crate::op::Op;

/// The metadata key LMCache's client identifies itself with (a random 16-byte id per
/// client): its transfers stay in order on one transfer thread, as a ZMQ identity's do.
pub const CLIENT_ID_METADATA: &str = "lmcache-client-id-bin";

/// The protobuf package of every service.
pub const PACKAGE: &str = "lmcache.mp";

/// One service method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Method {
    /// The service (`LookupService`).
    pub service: &'static str,
    /// The method (`Lookup`).
    pub method: &'static str,
    /// The operation it carries.
    pub op: Op,
}

impl Method {
    /// The HTTP/2 path gRPC calls it by: `/lmcache.mp.LookupService/Lookup`.
    pub fn path(&self) -> String {
        format!("/{PACKAGE}.{}/{}", self.service, self.method)
    }

    /// Whether the server answers with a stream of messages (`SubscribeKvEvents`).
    pub fn streaming(&self) -> bool {
        self.op == Op::SubscribeKvEvents
    }
}

const fn m(service: &'static str, method: &'static str, op: Op) -> Method {
    Method { service, method, op }
}

/// Every method of LMCache 0.5.6's nine services, in its .proto order.
pub const METHODS: &[Method] = &[
    m("LMCacheDrivenService", "RegisterKvCache", Op::RegisterKvCache),
    m("LMCacheDrivenService", "UnregisterKvCache", Op::UnregisterKvCache),
    m("LMCacheDrivenService", "Store", Op::Store),
    m("LMCacheDrivenService", "Retrieve", Op::Retrieve),
    m(
        "EngineDrivenService",
        "RegisterKvCacheEngineDrivenContext",
        Op::RegisterKvCacheEngineDrivenContext,
    ),
    m(
        "EngineDrivenService",
        "UnregisterKvCacheEngineDrivenContext",
        Op::UnregisterKvCacheEngineDrivenContext,
    ),
    m("EngineDrivenService", "PrepareStore", Op::PrepareStore),
    m("EngineDrivenService", "CommitStore", Op::CommitStore),
    m("EngineDrivenService", "PrepareRetrieve", Op::PrepareRetrieve),
    m("EngineDrivenService", "CommitRetrieve", Op::CommitRetrieve),
    m("LookupService", "Lookup", Op::Lookup),
    m("LookupService", "QueryPrefetchStatus", Op::QueryPrefetchStatus),
    m("LookupService", "WaitPrefetchStatus", Op::WaitPrefetchStatus),
    m("LookupService", "FreeLookupLocks", Op::FreeLookupLocks),
    m("LookupService", "EndSession", Op::EndSession),
    m("ControllerService", "Clear", Op::Clear),
    m("ControllerService", "GetChunkSize", Op::GetChunkSize),
    m("ControllerService", "GetExperimental", Op::GetExperimental),
    m("ControllerService", "Ping", Op::Ping),
    m("ControllerService", "ServerModuleCall", Op::ServerModuleCall),
    m("DebugService", "Noop", Op::Noop),
    m("ObservabilityService", "ReportBlockAllocation", Op::ReportBlockAllocation),
    m("ObservabilityService", "SubscribeKvEvents", Op::SubscribeKvEvents),
    m("P2PService", "P2PLookupAndLock", Op::P2pLookupAndLock),
    m("P2PService", "P2PQueryLookupResults", Op::P2pQueryLookupResults),
    m("P2PService", "P2PUnlockObjects", Op::P2pUnlockObjects),
    m("QStoreService", "RegisterQCache", Op::RegisterQCache),
    m("QStoreService", "UnregisterQCache", Op::UnregisterQCache),
    m("QStoreService", "StoreQ", Op::StoreQ),
    m("BlendService", "CbProtocolHandshake", Op::CbProtocolHandshake),
    m("BlendService", "CbRegisterRope", Op::CbRegisterRope),
    m("BlendService", "CbUnregisterRope", Op::CbUnregisterRope),
    m("BlendService", "CbRetrievePreComputed", Op::CbRetrievePreComputed),
    m("BlendService", "CbUnifiedLookup", Op::CbUnifiedLookup),
    m("BlendService", "CbReorderPlan", Op::CbReorderPlan),
];

/// The method an HTTP/2 path calls, if any.
pub fn method(path: &str) -> Option<Method> {
    let rest = path.strip_prefix('/')?.strip_prefix(PACKAGE)?.strip_prefix('.')?;
    let (service, name) = rest.split_once('/')?;
    METHODS.iter().copied().find(|m| m.service == service && m.method == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// LMCache's client calls an operation by the snake_case of its method name
    /// (`client_method_name`): every method must carry the operation of that name, and every
    /// operation must have a method.
    #[test]
    fn method_names_are_lmcaches_operation_names() {
        fn snake(name: &str) -> String {
            let mut out = String::new();
            let chars: Vec<char> = name.chars().collect();
            for (i, &c) in chars.iter().enumerate() {
                let prev_lower =
                    i > 0 && (chars[i - 1].is_lowercase() || chars[i - 1].is_numeric());
                let next_lower = chars.get(i + 1).is_some_and(|n| n.is_lowercase());
                if c.is_uppercase() && i > 0 && (prev_lower || next_lower) {
                    out.push('_');
                }
                out.extend(c.to_lowercase());
            }
            out.replace("p2_p", "p2p")
        }
        for m in METHODS {
            assert_eq!(snake(m.method), m.op.name(), "{}", m.path());
            assert_eq!(method(&m.path()), Some(*m));
        }
        for op in Op::all() {
            assert!(METHODS.iter().any(|m| m.op == op), "{} has no gRPC method", op.name());
        }
        assert_eq!(METHODS.len(), Op::all().count());
        assert_eq!(method("/lmcache.mp.LookupService/Nope"), None);
        assert_eq!(method("/other.LookupService/Lookup"), None);
        assert_eq!(method("lmcache.mp.LookupService/Lookup"), None);
    }
}
