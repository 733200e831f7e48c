//! The protobuf messages of LMCache 0.5.6's gRPC transport (package `lmcache.mp`), written
//! as prost structs: field numbers and types are the wire contract of LMCache's
//! `grpc_impl/protos/*.proto`, so LMCache's generated client reads and writes them unchanged.
//!
//! LMCache's structural codec maps its Python payload types onto these field by field; where
//! a Python value has no protobuf shape it travels as msgpack bytes: a field named
//! `encoded_x` (`layout_hints`, `request_configs`, a transfer `context`), and a device IPC
//! wrapper's `pickled_payload` (the same msgpack descriptor the ZMQ transport sends as ext
//! type 1).

// The derive writes the accessors; every field is the .proto's, documented there.
#![allow(missing_docs)]

use std::collections::HashMap;

// ---- common.proto -----------------------------------------------------------------------

/// `IPCCacheServerKey`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct IpcCacheServerKey {
    #[prost(string, tag = "1")]
    pub model_name: String,
    #[prost(int64, tag = "2")]
    pub world_size: i64,
    #[prost(int64, optional, tag = "3")]
    pub worker_id: Option<i64>,
    #[prost(int64, repeated, tag = "4")]
    pub token_ids: Vec<i64>,
    #[prost(int64, tag = "5")]
    pub start: i64,
    #[prost(int64, tag = "6")]
    pub end: i64,
    #[prost(string, tag = "7")]
    pub request_id: String,
    #[prost(string, tag = "8")]
    pub cache_salt: String,
    #[prost(bytes = "vec", optional, tag = "9")]
    pub encoded_request_configs: Option<Vec<u8>>,
    #[prost(int64, tag = "10")]
    pub num_kv_readers: i64,
}

/// `tuple[bytes, bool]` of store, retrieve and the CacheBlend scatter.
#[derive(Clone, PartialEq, prost::Message)]
pub struct EventIpcHandleResult {
    #[prost(bytes = "vec", tag = "1")]
    pub event_ipc_handle: Vec<u8>,
    #[prost(bool, tag = "2")]
    pub success: bool,
}

/// One KV group's block ids.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BlockIdGroup {
    #[prost(int64, repeated, tag = "1")]
    pub block_ids: Vec<i64>,
}

/// A device IPC wrapper: msgpack descriptor bytes (ZMQ's ext type 1 payload).
#[derive(Clone, PartialEq, prost::Message)]
pub struct DeviceIpcWrapper {
    #[prost(bytes = "vec", tag = "1")]
    pub pickled_payload: Vec<u8>,
}

/// `EngineGroupInfo`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct EngineGroupInfo {
    #[prost(int64, tag = "1")]
    pub engine_group_id: i64,
    #[prost(int64, repeated, tag = "2")]
    pub layer_indices: Vec<i64>,
    #[prost(int64, tag = "3")]
    pub tokens_per_block: i64,
    #[prost(int64, tag = "4")]
    pub sw_size_tokens: i64,
    #[prost(int64, tag = "5")]
    pub extra_object_group_tag: i64,
    #[prost(bool, tag = "6")]
    pub recurrent_state: bool,
}

/// A response with no fields (and a request with none).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Empty {}

// ---- lmcache_driven_service.proto --------------------------------------------------------

#[derive(Clone, PartialEq, prost::Message)]
pub struct RegisterKvCacheRequest {
    #[prost(int64, tag = "1")]
    pub instance_id: i64,
    #[prost(message, repeated, tag = "2")]
    pub kv_cache: Vec<DeviceIpcWrapper>,
    #[prost(string, tag = "3")]
    pub model_name: String,
    #[prost(int64, tag = "4")]
    pub world_size: i64,
    #[prost(string, tag = "5")]
    pub engine_type: String,
    #[prost(bytes = "vec", tag = "6")]
    pub encoded_layout_hints: Vec<u8>,
    #[prost(message, repeated, tag = "7")]
    pub engine_group_infos: Vec<EngineGroupInfo>,
}

/// Every request that names only a worker (`unregister_*`, `cb_unregister_rope`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct InstanceRequest {
    #[prost(int64, tag = "1")]
    pub instance_id: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct StoreRequest {
    #[prost(message, optional, tag = "1")]
    pub key: Option<IpcCacheServerKey>,
    #[prost(int64, tag = "2")]
    pub instance_id: i64,
    #[prost(message, repeated, tag = "3")]
    pub gpu_block_ids: Vec<BlockIdGroup>,
    #[prost(bytes = "vec", tag = "4")]
    pub event_ipc_handle: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RetrieveRequest {
    #[prost(message, optional, tag = "1")]
    pub key: Option<IpcCacheServerKey>,
    #[prost(int64, tag = "2")]
    pub instance_id: i64,
    #[prost(message, repeated, tag = "3")]
    pub gpu_block_ids: Vec<BlockIdGroup>,
    #[prost(bytes = "vec", tag = "4")]
    pub event_ipc_handle: Vec<u8>,
    #[prost(int64, tag = "5")]
    pub skip_first_n_tokens: i64,
}

/// `StoreResponse`, `RetrieveResponse`, `CbRetrievePreComputedResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TransferResponse {
    #[prost(message, optional, tag = "1")]
    pub result: Option<EventIpcHandleResult>,
}

// ---- engine_driven_service.proto ---------------------------------------------------------

#[derive(Clone, PartialEq, prost::Message)]
pub struct RegisterKvCacheEngineDrivenContextRequest {
    #[prost(int64, tag = "1")]
    pub instance_id: i64,
    #[prost(string, tag = "2")]
    pub model_name: String,
    #[prost(int64, tag = "3")]
    pub world_size: i64,
    #[prost(int64, tag = "4")]
    pub block_size: i64,
    #[prost(int64, tag = "5")]
    pub num_layers: i64,
    #[prost(int64, tag = "6")]
    pub hidden_dim_size: i64,
    #[prost(string, tag = "7")]
    pub dtype_str: String,
    #[prost(bool, tag = "8")]
    pub use_mla: bool,
    #[prost(int64, optional, tag = "9")]
    pub num_physical_slots: Option<i64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RegisterKvCacheEngineDrivenContextResponse {
    #[prost(string, tag = "1")]
    pub shm_name: String,
    #[prost(int64, tag = "2")]
    pub pool_size: i64,
}

/// `PrepareStoreRequest`, `PrepareRetrieveRequest`, `CommitRetrieveRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyAndInstanceRequest {
    #[prost(message, optional, tag = "1")]
    pub key: Option<IpcCacheServerKey>,
    #[prost(int64, tag = "2")]
    pub instance_id: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PrepareStoreResponse {
    #[prost(bytes = "vec", tag = "1")]
    pub encoded_context: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CommitStoreRequest {
    #[prost(message, optional, tag = "1")]
    pub key: Option<IpcCacheServerKey>,
    #[prost(int64, tag = "2")]
    pub instance_id: i64,
    #[prost(bytes = "vec", tag = "3")]
    pub data: Vec<u8>,
}

/// `CommitStoreResponse`, `CommitRetrieveResponse`, `PingResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BoolResponse {
    #[prost(bool, tag = "1")]
    pub value: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PrepareRetrieveResponse {
    #[prost(bool, tag = "1")]
    pub success: bool,
    #[prost(bytes = "vec", tag = "2")]
    pub data: Vec<u8>,
    #[prost(bytes = "vec", tag = "3")]
    pub encoded_context: Vec<u8>,
}

// ---- lookup_service.proto ----------------------------------------------------------------

/// `LookupRequest`, `FreeLookupLocksRequest`, `CbUnifiedLookupRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyAndTpRequest {
    #[prost(message, optional, tag = "1")]
    pub key: Option<IpcCacheServerKey>,
    #[prost(int64, tag = "2")]
    pub tp_size: i64,
}

/// `QueryPrefetchStatusRequest`, `EndSessionRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RequestIdRequest {
    #[prost(string, tag = "1")]
    pub request_id: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WaitPrefetchStatusRequest {
    #[prost(string, tag = "1")]
    pub request_id: String,
    #[prost(double, tag = "2")]
    pub timeout: f64,
}

/// `QueryPrefetchStatusResponse`, `WaitPrefetchStatusResponse`: absent while loading.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ChunkCountResponse {
    #[prost(int64, optional, tag = "1")]
    pub chunk_count: Option<i64>,
}

// ---- controller_service.proto, debug_service.proto ---------------------------------------

#[derive(Clone, PartialEq, prost::Message)]
pub struct ClearRequest {
    #[prost(bool, optional, tag = "1")]
    pub force: Option<bool>,
}

/// `GetChunkSizeResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ChunkSizeResponse {
    #[prost(int64, tag = "1")]
    pub chunk_size: i64,
}

/// `GetExperimentalResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NamesResponse {
    #[prost(string, repeated, tag = "1")]
    pub names: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PingRequest {
    #[prost(int64, optional, tag = "1")]
    pub instance_id: Option<i64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ServerModuleCallRequest {
    #[prost(string, tag = "1")]
    pub method: String,
    #[prost(bytes = "vec", tag = "2")]
    pub payload: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ServerModuleCallResponse {
    #[prost(bool, tag = "1")]
    pub success: bool,
    #[prost(bytes = "vec", tag = "2")]
    pub payload: Vec<u8>,
    #[prost(string, tag = "3")]
    pub error: String,
}

/// `NoopResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct MessageResponse {
    #[prost(string, tag = "1")]
    pub message: String,
}

// ---- observability_service.proto ---------------------------------------------------------

#[derive(Clone, PartialEq, prost::Message)]
pub struct BlockAllocationRecord {
    #[prost(string, tag = "1")]
    pub req_id: String,
    #[prost(int64, repeated, tag = "2")]
    pub new_block_ids: Vec<i64>,
    #[prost(int64, repeated, tag = "3")]
    pub new_token_ids: Vec<i64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ReportBlockAllocationRequest {
    #[prost(int64, tag = "1")]
    pub instance_id: i64,
    #[prost(string, tag = "2")]
    pub model_name: String,
    #[prost(message, repeated, tag = "3")]
    pub records: Vec<BlockAllocationRecord>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SubscribeKvEventsRequest {
    #[prost(int64, tag = "1")]
    pub instance_id: i64,
    #[prost(string, tag = "2")]
    pub model_name: String,
    #[prost(int64, tag = "3")]
    pub cursor: i64,
    #[prost(int64, tag = "4")]
    pub max_events: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct KvEventRecord {
    #[prost(int64, tag = "1")]
    pub seq: i64,
    #[prost(string, tag = "2")]
    pub kind: String,
    #[prost(string, tag = "3")]
    pub medium: String,
    #[prost(string, tag = "4")]
    pub model_name: String,
    #[prost(bytes = "vec", repeated, tag = "5")]
    pub block_hashes: Vec<Vec<u8>>,
    #[prost(bytes = "vec", optional, tag = "6")]
    pub parent_block_hash: Option<Vec<u8>>,
    #[prost(int64, repeated, tag = "7")]
    pub token_ids: Vec<i64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct KvEventBatch {
    #[prost(bool, tag = "1")]
    pub enabled: bool,
    #[prost(int64, tag = "2")]
    pub incarnation: i64,
    #[prost(int64, tag = "3")]
    pub next_cursor: i64,
    #[prost(bool, tag = "4")]
    pub lost: bool,
    #[prost(message, repeated, tag = "5")]
    pub events: Vec<KvEventRecord>,
}

// ---- p2p_service.proto -------------------------------------------------------------------

#[derive(Clone, PartialEq, prost::Message)]
pub struct ObjectKey {
    #[prost(bytes = "vec", tag = "1")]
    pub chunk_hash: Vec<u8>,
    #[prost(string, tag = "2")]
    pub model_name: String,
    #[prost(int64, tag = "3")]
    pub kv_rank: i64,
    #[prost(int64, tag = "4")]
    pub object_group_id: i64,
    #[prost(string, tag = "5")]
    pub cache_salt: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorShape {
    #[prost(int64, repeated, tag = "1")]
    pub dims: Vec<i64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct MemoryLayoutDesc {
    #[prost(message, repeated, tag = "1")]
    pub shapes: Vec<TensorShape>,
    #[prost(string, repeated, tag = "2")]
    pub dtypes: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TransferChannelAddress {
    #[prost(int64, tag = "1")]
    pub offset: i64,
    #[prost(int64, tag = "2")]
    pub size: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct P2pLookupAndLockRequest {
    #[prost(message, repeated, tag = "1")]
    pub keys: Vec<ObjectKey>,
    #[prost(map = "int64, message", tag = "2")]
    pub group_layout_descs: HashMap<i64, MemoryLayoutDesc>,
}

/// `P2pLookupAndLockResponse`, `P2pQueryLookupResultsRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TaskId {
    #[prost(int64, tag = "1")]
    pub task_id: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TransferChannelAddressList {
    #[prost(message, repeated, tag = "1")]
    pub addresses: Vec<TransferChannelAddress>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct P2pQueryLookupResultsResponse {
    #[prost(message, optional, tag = "1")]
    pub addresses: Option<TransferChannelAddressList>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct P2pUnlockObjectsRequest {
    #[prost(message, repeated, tag = "1")]
    pub keys: Vec<ObjectKey>,
}

// ---- blend_service.proto -----------------------------------------------------------------

#[derive(Clone, PartialEq, prost::Message)]
pub struct CbMatchResult {
    #[prost(int64, tag = "1")]
    pub old_st: i64,
    #[prost(int64, tag = "2")]
    pub old_ed: i64,
    #[prost(int64, tag = "3")]
    pub cur_st: i64,
    #[prost(int64, tag = "4")]
    pub cur_ed: i64,
    #[prost(bytes = "vec", tag = "5")]
    pub hash: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CbProtocolHandshakeRequest {
    #[prost(int64, tag = "1")]
    pub client_version: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CbProtocolHandshakeResponse {
    #[prost(int64, tag = "1")]
    pub server_version: i64,
    #[prost(bool, tag = "2")]
    pub client_compatible: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CbRetrievePreComputedRequest {
    #[prost(message, optional, tag = "1")]
    pub key: Option<IpcCacheServerKey>,
    #[prost(message, repeated, tag = "2")]
    pub cb_match_result: Vec<CbMatchResult>,
    #[prost(message, repeated, tag = "3")]
    pub gpu_block_ids: Vec<BlockIdGroup>,
    #[prost(int64, tag = "4")]
    pub instance_id: i64,
    #[prost(bytes = "vec", tag = "5")]
    pub event_ipc_handle: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CbUnifiedLookupPayload {
    #[prost(int64, tag = "1")]
    pub prefix_coverage_tokens: i64,
    #[prost(message, repeated, tag = "2")]
    pub non_prefix_segments: Vec<CbMatchResult>,
    #[prost(message, repeated, tag = "3")]
    pub segmented_prefix_segments: Vec<CbMatchResult>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CbUnifiedLookupResponse {
    #[prost(message, optional, tag = "1")]
    pub payload: Option<CbUnifiedLookupPayload>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CbReorderPlanRequest {
    #[prost(message, optional, tag = "1")]
    pub key: Option<IpcCacheServerKey>,
    #[prost(int64, tag = "2")]
    pub keep_prefix: i64,
    #[prost(int64, tag = "3")]
    pub budget_ms: i64,
}

/// `CbReorderPlanResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TokenIds {
    #[prost(int64, repeated, tag = "1")]
    pub token_ids: Vec<i64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RopeWindow {
    #[prost(int64, repeated, tag = "1")]
    pub values: Vec<i64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CbRegisterRopeRequest {
    #[prost(int64, tag = "1")]
    pub instance_id: i64,
    #[prost(message, repeated, tag = "2")]
    pub cos_sin_caches_ipc: Vec<DeviceIpcWrapper>,
    #[prost(int64, tag = "3")]
    pub head_size: i64,
    #[prost(bool, tag = "4")]
    pub is_neox_style: bool,
    #[prost(int64, repeated, tag = "5")]
    pub group_to_cache: Vec<i64>,
    #[prost(message, repeated, tag = "6")]
    pub group_rot: Vec<RopeWindow>,
    #[prost(int64, repeated, tag = "7")]
    pub group_head_size: Vec<i64>,
    #[prost(string, tag = "8")]
    pub kv_quant: String,
}
