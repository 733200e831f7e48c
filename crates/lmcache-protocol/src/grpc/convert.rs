//! Protobuf ⇄ the msgpack values the ZMQ transport carries.
//!
//! A request becomes the parameter list LMCache's ZMQ client sends for the same call (its
//! structural codec maps each Python parameter onto one field, in order), so one decoder,
//! [`Command::decode`](crate::request::Command::decode), judges both transports. A reply value
//! becomes the method's response message the way LMCache's server writes it: `None` for an
//! optional response is an absent field, a `dict` travels as msgpack bytes (empty: no bytes).

use prost::Message;
use rmpv::Value;

use super::messages as pb;
use crate::error::ProtocolError;
use crate::op::Op;
use crate::value::{self, Fields, map};

fn parse<M: Message + Default>(name: &'static str, body: &[u8]) -> Result<M, ProtocolError> {
    M::decode(body).map_err(|e| ProtocolError::BadProtobuf { message: name, reason: e.to_string() })
}

fn ints(v: &[i64]) -> Value {
    Value::Array(v.iter().map(|&x| Value::from(x)).collect())
}

/// Msgpack bytes of a `dict` field (`encoded_*`): none is the empty dict.
fn msgpack_dict(field: &str, bytes: &[u8]) -> Result<Value, ProtocolError> {
    if bytes.is_empty() {
        return Ok(Value::Map(Vec::new()));
    }
    let v = value::decode(0, bytes).map_err(|e| ProtocolError::OutOfRange {
        field: field.to_owned(),
        reason: format!("not msgpack: {e}"),
    })?;
    match v {
        Value::Map(_) => Ok(v),
        other => Err(ProtocolError::WrongType {
            field: field.to_owned(),
            expected: "msgpack map",
            got: value::type_name(&other),
        }),
    }
}

fn key(k: Option<pb::IpcCacheServerKey>) -> Result<Value, ProtocolError> {
    let k = k.ok_or_else(|| ProtocolError::MissingField { field: "key".into() })?;
    let request_configs = match &k.encoded_request_configs {
        None => Value::Nil,
        Some(b) => msgpack_dict("key.request_configs", b)?,
    };
    Ok(map(vec![
        ("model_name", Value::from(k.model_name)),
        ("world_size", Value::from(k.world_size)),
        ("worker_id", k.worker_id.map_or(Value::Nil, Value::from)),
        ("token_ids", ints(&k.token_ids)),
        ("start", Value::from(k.start)),
        ("end", Value::from(k.end)),
        ("request_id", Value::from(k.request_id)),
        ("cache_salt", Value::from(k.cache_salt)),
        ("request_configs", request_configs),
        ("num_kv_readers", Value::from(k.num_kv_readers)),
    ]))
}

fn blocks(groups: &[pb::BlockIdGroup]) -> Value {
    Value::Array(groups.iter().map(|g| ints(&g.block_ids)).collect())
}

fn wrappers(w: Vec<pb::DeviceIpcWrapper>) -> Value {
    Value::Array(w.into_iter().map(|w| Value::Ext(1, w.pickled_payload)).collect())
}

fn object_keys(keys: Vec<pb::ObjectKey>) -> Value {
    Value::Array(
        keys.into_iter()
            .map(|k| {
                map(vec![
                    ("chunk_hash", Value::Binary(k.chunk_hash)),
                    ("model_name", Value::from(k.model_name)),
                    ("kv_rank", Value::from(k.kv_rank)),
                    ("object_group_id", Value::from(k.object_group_id)),
                    ("cache_salt", Value::from(k.cache_salt)),
                ])
            })
            .collect(),
    )
}

fn matches(m: Vec<pb::CbMatchResult>) -> Value {
    Value::Array(
        m.into_iter()
            .map(|m| {
                map(vec![
                    ("old_st", Value::from(m.old_st)),
                    ("old_ed", Value::from(m.old_ed)),
                    ("cur_st", Value::from(m.cur_st)),
                    ("cur_ed", Value::from(m.cur_ed)),
                    ("hash", Value::Binary(m.hash)),
                ])
            })
            .collect(),
    )
}

/// The parameters LMCache's ZMQ client sends for `op`, from the protobuf request of its
/// gRPC method. An operation lmcache-rs does not serve is [`ProtocolError::UnsupportedOp`]
/// (LMCache answers it `UNIMPLEMENTED`).
pub fn decode_request(op: Op, body: &[u8]) -> Result<Vec<Value>, ProtocolError> {
    let instance = |name| -> Result<Vec<Value>, ProtocolError> {
        let r: pb::InstanceRequest = parse(name, body)?;
        Ok(vec![Value::from(r.instance_id)])
    };
    let key_instance = |name| -> Result<Vec<Value>, ProtocolError> {
        let r: pb::KeyAndInstanceRequest = parse(name, body)?;
        Ok(vec![key(r.key)?, Value::from(r.instance_id)])
    };
    let key_tp = |name| -> Result<Vec<Value>, ProtocolError> {
        let r: pb::KeyAndTpRequest = parse(name, body)?;
        Ok(vec![key(r.key)?, Value::from(r.tp_size)])
    };
    let request_id = |name| -> Result<Vec<Value>, ProtocolError> {
        let r: pb::RequestIdRequest = parse(name, body)?;
        Ok(vec![Value::from(r.request_id)])
    };
    let none = |name| -> Result<Vec<Value>, ProtocolError> {
        let _: pb::Empty = parse(name, body)?;
        Ok(Vec::new())
    };
    Ok(match op {
        Op::RegisterKvCache => {
            let r: pb::RegisterKvCacheRequest = parse("RegisterKvCacheRequest", body)?;
            let groups = r
                .engine_group_infos
                .into_iter()
                .map(|g| {
                    map(vec![
                        ("engine_group_id", Value::from(g.engine_group_id)),
                        ("layer_indices", ints(&g.layer_indices)),
                        ("tokens_per_block", Value::from(g.tokens_per_block)),
                        ("sw_size_tokens", Value::from(g.sw_size_tokens)),
                        ("extra_object_group_tag", Value::from(g.extra_object_group_tag)),
                        ("recurrent_state", Value::Boolean(g.recurrent_state)),
                    ])
                })
                .collect();
            vec![
                Value::from(r.instance_id),
                wrappers(r.kv_cache),
                Value::from(r.model_name),
                Value::from(r.world_size),
                Value::from(r.engine_type),
                msgpack_dict("layout_hints", &r.encoded_layout_hints)?,
                Value::Array(groups),
            ]
        }
        Op::UnregisterKvCache => instance("UnregisterKvCacheRequest")?,
        Op::Store => {
            let r: pb::StoreRequest = parse("StoreRequest", body)?;
            vec![
                key(r.key)?,
                Value::from(r.instance_id),
                blocks(&r.gpu_block_ids),
                Value::Binary(r.event_ipc_handle),
            ]
        }
        Op::Retrieve => {
            let r: pb::RetrieveRequest = parse("RetrieveRequest", body)?;
            vec![
                key(r.key)?,
                Value::from(r.instance_id),
                blocks(&r.gpu_block_ids),
                Value::Binary(r.event_ipc_handle),
                Value::from(r.skip_first_n_tokens),
            ]
        }
        Op::RegisterKvCacheEngineDrivenContext => {
            let r: pb::RegisterKvCacheEngineDrivenContextRequest =
                parse("RegisterKvCacheEngineDrivenContextRequest", body)?;
            vec![map(vec![
                ("instance_id", Value::from(r.instance_id)),
                ("model_name", Value::from(r.model_name)),
                ("world_size", Value::from(r.world_size)),
                ("block_size", Value::from(r.block_size)),
                ("num_layers", Value::from(r.num_layers)),
                ("hidden_dim_size", Value::from(r.hidden_dim_size)),
                ("dtype_str", Value::from(r.dtype_str)),
                ("use_mla", Value::Boolean(r.use_mla)),
                ("num_physical_slots", r.num_physical_slots.map_or(Value::Nil, Value::from)),
            ])]
        }
        Op::UnregisterKvCacheEngineDrivenContext => {
            instance("UnregisterKvCacheEngineDrivenContextRequest")?
        }
        Op::PrepareStore => key_instance("PrepareStoreRequest")?,
        Op::CommitStore => {
            let r: pb::CommitStoreRequest = parse("CommitStoreRequest", body)?;
            vec![key(r.key)?, Value::from(r.instance_id), Value::Binary(r.data)]
        }
        Op::PrepareRetrieve => key_instance("PrepareRetrieveRequest")?,
        Op::CommitRetrieve => key_instance("CommitRetrieveRequest")?,
        Op::Lookup => key_tp("LookupRequest")?,
        Op::QueryPrefetchStatus => request_id("QueryPrefetchStatusRequest")?,
        Op::WaitPrefetchStatus => {
            let r: pb::WaitPrefetchStatusRequest = parse("WaitPrefetchStatusRequest", body)?;
            vec![Value::from(r.request_id), Value::F64(r.timeout)]
        }
        Op::FreeLookupLocks => key_tp("FreeLookupLocksRequest")?,
        Op::EndSession => request_id("EndSessionRequest")?,
        Op::Clear => {
            let r: pb::ClearRequest = parse("ClearRequest", body)?;
            vec![Value::Boolean(r.force.unwrap_or(false))]
        }
        Op::ServerModuleCall => {
            let r: pb::ServerModuleCallRequest = parse("ServerModuleCallRequest", body)?;
            vec![map(vec![
                ("method", Value::from(r.method)),
                ("payload", Value::Binary(r.payload)),
            ])]
        }
        Op::GetChunkSize => none("GetChunkSizeRequest")?,
        Op::GetExperimental => none("GetExperimentalRequest")?,
        Op::Noop => none("NoopRequest")?,
        Op::Ping => {
            let r: pb::PingRequest = parse("PingRequest", body)?;
            vec![r.instance_id.map_or(Value::Nil, Value::from)]
        }
        Op::ReportBlockAllocation => {
            let r: pb::ReportBlockAllocationRequest = parse("ReportBlockAllocationRequest", body)?;
            let records = r
                .records
                .into_iter()
                .map(|x| {
                    map(vec![
                        ("req_id", Value::from(x.req_id)),
                        ("new_block_ids", ints(&x.new_block_ids)),
                        ("new_token_ids", ints(&x.new_token_ids)),
                    ])
                })
                .collect();
            vec![Value::from(r.instance_id), Value::from(r.model_name), Value::Array(records)]
        }
        Op::SubscribeKvEvents => {
            let r: pb::SubscribeKvEventsRequest = parse("SubscribeKvEventsRequest", body)?;
            vec![
                Value::from(r.instance_id),
                Value::from(r.model_name),
                Value::from(r.cursor),
                Value::from(r.max_events),
            ]
        }
        Op::P2pLookupAndLock => {
            let r: pb::P2pLookupAndLockRequest = parse("P2pLookupAndLockRequest", body)?;
            // A map arrives in any order; the group ids keep the client's meaning.
            let mut descs: Vec<_> = r.group_layout_descs.into_iter().collect();
            descs.sort_by_key(|(id, _)| *id);
            let descs = descs
                .into_iter()
                .map(|(id, d)| {
                    let shapes = d.shapes.iter().map(|s| ints(&s.dims)).collect();
                    let dtypes = d.dtypes.into_iter().map(Value::from).collect();
                    let layout = map(vec![
                        ("shapes", Value::Array(shapes)),
                        ("dtypes", Value::Array(dtypes)),
                    ]);
                    (Value::from(id), layout)
                })
                .collect();
            vec![object_keys(r.keys), Value::Map(descs)]
        }
        Op::P2pQueryLookupResults => {
            let r: pb::TaskId = parse("P2pQueryLookupResultsRequest", body)?;
            vec![Value::from(r.task_id)]
        }
        Op::P2pUnlockObjects => {
            let r: pb::P2pUnlockObjectsRequest = parse("P2pUnlockObjectsRequest", body)?;
            vec![object_keys(r.keys)]
        }
        Op::CbProtocolHandshake => {
            let r: pb::CbProtocolHandshakeRequest = parse("CbProtocolHandshakeRequest", body)?;
            vec![Value::from(r.client_version)]
        }
        Op::CbRegisterRope => {
            let r: pb::CbRegisterRopeRequest = parse("CbRegisterRopeRequest", body)?;
            vec![
                Value::from(r.instance_id),
                wrappers(r.cos_sin_caches_ipc),
                Value::from(r.head_size),
                Value::Boolean(r.is_neox_style),
                ints(&r.group_to_cache),
                Value::Array(r.group_rot.iter().map(|w| ints(&w.values)).collect()),
                ints(&r.group_head_size),
                Value::from(r.kv_quant),
            ]
        }
        Op::CbUnregisterRope => instance("CbUnregisterRopeRequest")?,
        Op::CbRetrievePreComputed => {
            let r: pb::CbRetrievePreComputedRequest = parse("CbRetrievePreComputedRequest", body)?;
            vec![
                key(r.key)?,
                matches(r.cb_match_result),
                blocks(&r.gpu_block_ids),
                Value::from(r.instance_id),
                Value::Binary(r.event_ipc_handle),
            ]
        }
        Op::CbUnifiedLookup => key_tp("CbUnifiedLookupRequest")?,
        Op::CbReorderPlan => {
            let r: pb::CbReorderPlanRequest = parse("CbReorderPlanRequest", body)?;
            vec![key(r.key)?, Value::from(r.keep_prefix), Value::from(r.budget_ms)]
        }
        other => return Err(ProtocolError::UnsupportedOp(other.name())),
    })
}

/// What a reply value could not be written as: only a bug of ours (handlers write these
/// values), named so.
fn reply_err(op: Op, what: impl std::fmt::Display) -> ProtocolError {
    ProtocolError::Internal { op: op.name(), reason: format!("reply is not its response: {what}") }
}

fn int_of(op: Op, v: &Value) -> Result<i64, ProtocolError> {
    // u64 ids beyond i64 (a failed lookup-and-lock's u64::MAX task id) keep their bits.
    v.as_i64().or_else(|| v.as_u64().map(|u| u as i64)).ok_or_else(|| reply_err(op, v))
}

fn dict_bytes(op: Op, v: Option<&Value>) -> Result<Vec<u8>, ProtocolError> {
    match v {
        None | Some(Value::Nil) => Ok(Vec::new()),
        Some(Value::Map(m)) if m.is_empty() => Ok(Vec::new()),
        Some(v @ Value::Map(_)) => Ok(value::encode(v)),
        Some(other) => Err(reply_err(op, other)),
    }
}

fn match_results(op: Op, v: Option<&Value>) -> Result<Vec<pb::CbMatchResult>, ProtocolError> {
    let Some(v) = v else { return Ok(Vec::new()) };
    value::array("segments", v)?
        .iter()
        .map(|m| {
            let f = Fields::of("segment", m)?;
            let n = |name| f.req(name).and_then(|v| int_of(op, v));
            Ok(pb::CbMatchResult {
                old_st: n("old_st")?,
                old_ed: n("old_ed")?,
                cur_st: n("cur_st")?,
                cur_ed: n("cur_ed")?,
                hash: value::bin("hash", f.req("hash")?)?.to_vec(),
            })
        })
        .collect()
}

/// The response message of `op`'s method for a handler's reply (`None`: a void reply).
pub fn encode_response(op: Op, reply: Option<&Value>) -> Result<Vec<u8>, ProtocolError> {
    let need = || reply.ok_or_else(|| reply_err(op, "no value"));
    let fields = |v: &'static str| -> Result<Fields<'_>, ProtocolError> {
        Fields::of(v, reply.ok_or_else(|| reply_err(op, "no value"))?)
    };
    Ok(match op {
        Op::Store | Op::Retrieve | Op::StoreQ | Op::CbRetrievePreComputed => {
            let pair = value::array("result", need()?)?;
            let [handle, ok] = pair else { return Err(reply_err(op, "not a pair")) };
            pb::TransferResponse {
                result: Some(pb::EventIpcHandleResult {
                    event_ipc_handle: value::bin("result[0]", handle)?.to_vec(),
                    success: value::bool_("result[1]", ok)?,
                }),
            }
            .encode_to_vec()
        }
        Op::QueryPrefetchStatus | Op::WaitPrefetchStatus => pb::ChunkCountResponse {
            chunk_count: match reply {
                None | Some(Value::Nil) => None,
                Some(v) => Some(int_of(op, v)?),
            },
        }
        .encode_to_vec(),
        Op::RegisterKvCacheEngineDrivenContext => {
            let f = fields("response")?;
            pb::RegisterKvCacheEngineDrivenContextResponse {
                shm_name: value::str_("shm_name", f.req("shm_name")?)?.to_owned(),
                pool_size: int_of(op, f.req("pool_size")?)?,
            }
            .encode_to_vec()
        }
        Op::PrepareStore => {
            let f = fields("response")?;
            pb::PrepareStoreResponse { encoded_context: dict_bytes(op, f.get("context"))? }
                .encode_to_vec()
        }
        Op::PrepareRetrieve => {
            let f = fields("response")?;
            pb::PrepareRetrieveResponse {
                success: value::bool_("success", f.req("success")?)?,
                data: match f.get("data") {
                    None => Vec::new(),
                    Some(d) => value::bin("data", d)?.to_vec(),
                },
                encoded_context: dict_bytes(op, f.get("context"))?,
            }
            .encode_to_vec()
        }
        Op::CommitStore | Op::CommitRetrieve | Op::Ping => {
            pb::BoolResponse { value: value::bool_("reply", need()?)? }.encode_to_vec()
        }
        Op::GetChunkSize => {
            pb::ChunkSizeResponse { chunk_size: int_of(op, need()?)? }.encode_to_vec()
        }
        Op::GetExperimental => pb::NamesResponse {
            names: value::array("names", need()?)?
                .iter()
                .map(|n| value::str_("names", n).map(str::to_owned))
                .collect::<Result<_, _>>()?,
        }
        .encode_to_vec(),
        Op::Noop => pb::MessageResponse { message: value::str_("message", need()?)?.to_owned() }
            .encode_to_vec(),
        Op::ServerModuleCall => {
            let f = fields("response")?;
            pb::ServerModuleCallResponse {
                success: value::bool_("success", f.req("success")?)?,
                payload: value::bin("payload", f.req("payload")?)?.to_vec(),
                error: value::str_("error", f.req("error")?)?.to_owned(),
            }
            .encode_to_vec()
        }
        Op::P2pLookupAndLock => pb::TaskId { task_id: int_of(op, need()?)? }.encode_to_vec(),
        Op::P2pQueryLookupResults => pb::P2pQueryLookupResultsResponse {
            addresses: match reply {
                None | Some(Value::Nil) => None,
                Some(list) => Some(pb::TransferChannelAddressList {
                    addresses: value::array("addresses", list)?
                        .iter()
                        .map(|a| {
                            let f = Fields::of("address", a)?;
                            Ok(pb::TransferChannelAddress {
                                offset: int_of(op, f.req("offset")?)?,
                                size: int_of(op, f.req("size")?)?,
                            })
                        })
                        .collect::<Result<_, ProtocolError>>()?,
                }),
            },
        }
        .encode_to_vec(),
        Op::CbProtocolHandshake => {
            let pair = value::array("handshake", need()?)?;
            let [version, ok] = pair else { return Err(reply_err(op, "not a pair")) };
            pb::CbProtocolHandshakeResponse {
                server_version: int_of(op, version)?,
                client_compatible: value::bool_("client_compatible", ok)?,
            }
            .encode_to_vec()
        }
        // A void reply means "still loading, ask again": no payload.
        Op::CbUnifiedLookup => pb::CbUnifiedLookupResponse {
            payload: match reply {
                None | Some(Value::Nil) => None,
                Some(v) => {
                    let f = Fields::of("result", v)?;
                    Some(pb::CbUnifiedLookupPayload {
                        prefix_coverage_tokens: int_of(op, f.req("prefix_coverage_tokens")?)?,
                        non_prefix_segments: match_results(op, f.get("non_prefix_segments"))?,
                        segmented_prefix_segments: match_results(
                            op,
                            f.get("segmented_prefix_segments"),
                        )?,
                    })
                }
            },
        }
        .encode_to_vec(),
        Op::CbReorderPlan => pb::TokenIds {
            token_ids: value::array("token_ids", need()?)?
                .iter()
                .map(|t| int_of(op, t))
                .collect::<Result<_, _>>()?,
        }
        .encode_to_vec(),
        // Every other response is empty.
        _ => Vec::new(),
    })
}

/// One `KVEventBatch` of the `SubscribeKvEvents` stream, from the batch value the ZMQ stream
/// sends.
pub fn encode_event_batch(batch: &Value) -> Result<Vec<u8>, ProtocolError> {
    let op = Op::SubscribeKvEvents;
    let f = Fields::of("batch", batch)?;
    let events = value::array("events", f.req("events")?)?
        .iter()
        .map(|e| {
            let r = Fields::of("event", e)?;
            Ok(pb::KvEventRecord {
                seq: int_of(op, r.req("seq")?)?,
                kind: value::str_("kind", r.req("kind")?)?.to_owned(),
                medium: value::str_("medium", r.req("medium")?)?.to_owned(),
                model_name: value::str_("model_name", r.req("model_name")?)?.to_owned(),
                block_hashes: value::array("block_hashes", r.req("block_hashes")?)?
                    .iter()
                    .map(|h| value::bin("block_hashes", h).map(<[u8]>::to_vec))
                    .collect::<Result<_, _>>()?,
                parent_block_hash: match r.get("parent_block_hash") {
                    None | Some(Value::Nil) => None,
                    Some(h) => Some(value::bin("parent_block_hash", h)?.to_vec()),
                },
                token_ids: value::array("token_ids", r.req("token_ids")?)?
                    .iter()
                    .map(|t| int_of(op, t))
                    .collect::<Result<_, _>>()?,
            })
        })
        .collect::<Result<_, ProtocolError>>()?;
    Ok(pb::KvEventBatch {
        enabled: value::bool_("enabled", f.req("enabled")?)?,
        incarnation: int_of(op, f.req("incarnation")?)?,
        next_cursor: int_of(op, f.req("next_cursor")?)?,
        lost: value::bool_("lost", f.req("lost")?)?,
        events,
    }
    .encode_to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{Command, tests::samples};
    use crate::types::{CacheKey, EngineDrivenRegistration};

    fn pkey(k: &CacheKey) -> Option<pb::IpcCacheServerKey> {
        Some(pb::IpcCacheServerKey {
            model_name: k.model_name.as_str().into(),
            world_size: k.world_size.into(),
            worker_id: k.worker_id.map(i64::from),
            token_ids: k.token_ids.iter().map(|&t| i64::from(t)).collect(),
            start: k.start as i64,
            end: k.end as i64,
            request_id: k.request_id.clone(),
            cache_salt: k.cache_salt.as_str().into(),
            encoded_request_configs: None,
            num_kv_readers: k.num_kv_readers.into(),
        })
    }

    fn groups(ids: &[Vec<u64>]) -> Vec<pb::BlockIdGroup> {
        ids.iter()
            .map(|g| pb::BlockIdGroup { block_ids: g.iter().map(|&b| b as i64).collect() })
            .collect()
    }

    fn wrapper(d: &crate::types::IpcDescriptor) -> pb::DeviceIpcWrapper {
        let Value::Ext(1, payload) = d.encode() else { panic!("not ext 1") };
        pb::DeviceIpcWrapper { pickled_payload: payload }
    }

    fn ikey(k: &crate::types::WireObjectKey) -> pb::ObjectKey {
        let k = k.0.as_ref().unwrap();
        pb::ObjectKey {
            chunk_hash: k.chunk_hash.as_bytes().to_vec(),
            model_name: k.model_name.as_str().into(),
            kv_rank: k.kv_rank.packed().into(),
            object_group_id: k.object_group_id.into(),
            cache_salt: k.cache_salt.as_str().into(),
        }
    }

    fn int_list(v: &[Value]) -> Vec<i64> {
        v.iter().map(|x| x.as_i64().unwrap()).collect()
    }

    /// What LMCache's client sends over gRPC for `c`, written from the typed command.
    fn proto(c: &Command) -> Vec<u8> {
        match c {
            Command::GetChunkSize | Command::GetExperimental | Command::Noop => Vec::new(),
            Command::Ping(p) => {
                pb::PingRequest { instance_id: p.instance_id.map(|i| i as i64) }.encode_to_vec()
            }
            Command::Clear(x) => pb::ClearRequest { force: Some(x.force) }.encode_to_vec(),
            Command::ReportBlockAllocation(r) => pb::ReportBlockAllocationRequest {
                instance_id: r.instance_id as i64,
                model_name: r.model_name.clone(),
                records: r
                    .records
                    .iter()
                    .map(|v| {
                        let f = Fields::of("r", v).unwrap();
                        pb::BlockAllocationRecord {
                            req_id: f.get("req_id").unwrap().as_str().unwrap().into(),
                            new_block_ids: int_list(
                                f.get("new_block_ids").unwrap().as_array().unwrap(),
                            ),
                            new_token_ids: int_list(
                                f.get("new_token_ids").unwrap().as_array().unwrap(),
                            ),
                        }
                    })
                    .collect(),
            }
            .encode_to_vec(),
            Command::Lookup(l) => {
                pb::KeyAndTpRequest { key: pkey(&l.key), tp_size: l.tp_size.as_i64().unwrap() }
                    .encode_to_vec()
            }
            Command::FreeLookupLocks(l) => {
                pb::KeyAndTpRequest { key: pkey(&l.key), tp_size: l.tp_size.as_i64().unwrap() }
                    .encode_to_vec()
            }
            Command::CbUnifiedLookup(l) => {
                pb::KeyAndTpRequest { key: pkey(&l.key), tp_size: l.tp_size.into() }.encode_to_vec()
            }
            Command::QueryPrefetchStatus(id) | Command::EndSession(id) => {
                pb::RequestIdRequest { request_id: id.clone() }.encode_to_vec()
            }
            Command::WaitPrefetchStatus(w) => pb::WaitPrefetchStatusRequest {
                request_id: w.request_id.clone(),
                timeout: w.timeout,
            }
            .encode_to_vec(),
            Command::RegisterEngineDriven(r) => pb::RegisterKvCacheEngineDrivenContextRequest {
                instance_id: r.instance_id as i64,
                model_name: r.model_name.as_str().into(),
                world_size: r.world_size.into(),
                block_size: r.block_size as i64,
                num_layers: r.num_layers as i64,
                hidden_dim_size: r.hidden_dim_size as i64,
                dtype_str: r.dtype.as_str().into(),
                use_mla: r.use_mla,
                num_physical_slots: r.num_physical_slots.map(|n| n as i64),
            }
            .encode_to_vec(),
            Command::UnregisterEngineDriven(id)
            | Command::UnregisterKvCache(id)
            | Command::CbUnregisterRope(id) => {
                pb::InstanceRequest { instance_id: *id as i64 }.encode_to_vec()
            }
            Command::PrepareStore(k) | Command::PrepareRetrieve(k) | Command::CommitRetrieve(k) => {
                pb::KeyAndInstanceRequest { key: pkey(&k.key), instance_id: k.instance_id as i64 }
                    .encode_to_vec()
            }
            Command::CommitStore(c) => pb::CommitStoreRequest {
                key: pkey(&c.key),
                instance_id: c.instance_id as i64,
                data: c.data.clone(),
            }
            .encode_to_vec(),
            Command::RegisterKvCache(r) => pb::RegisterKvCacheRequest {
                instance_id: r.instance_id as i64,
                kv_cache: r.kv_cache.iter().map(wrapper).collect(),
                model_name: r.model_name.clone(),
                world_size: r.world_size.into(),
                engine_type: r.engine_type.clone(),
                encoded_layout_hints: dict_bytes(Op::RegisterKvCache, Some(&r.extra)).unwrap(),
                engine_group_infos: r
                    .engine_group_infos
                    .iter()
                    .map(|g| pb::EngineGroupInfo {
                        engine_group_id: g.engine_group_id,
                        layer_indices: g.layer_indices.iter().map(|&l| l as i64).collect(),
                        tokens_per_block: g.tokens_per_block as i64,
                        sw_size_tokens: g.sw_size_tokens,
                        extra_object_group_tag: g.extra_object_group_tag,
                        recurrent_state: g.recurrent_state,
                    })
                    .collect(),
            }
            .encode_to_vec(),
            Command::Store(s) => pb::StoreRequest {
                key: pkey(&s.key),
                instance_id: s.instance_id as i64,
                gpu_block_ids: groups(&s.block_ids),
                event_ipc_handle: s.event_ipc_handle.clone(),
            }
            .encode_to_vec(),
            Command::Retrieve(r) => pb::RetrieveRequest {
                key: pkey(&r.key),
                instance_id: r.instance_id as i64,
                gpu_block_ids: groups(&r.block_ids),
                event_ipc_handle: r.event_ipc_handle.clone(),
                skip_first_n_tokens: r.skip_first_n_tokens as i64,
            }
            .encode_to_vec(),
            Command::SubscribeKvEvents(s) => pb::SubscribeKvEventsRequest {
                instance_id: s.instance_id as i64,
                model_name: s.model_name.clone(),
                cursor: s.cursor as i64,
                max_events: s.max_events as i64,
            }
            .encode_to_vec(),
            Command::P2pLookupAndLock(l) => pb::P2pLookupAndLockRequest {
                keys: l.keys.iter().map(ikey).collect(),
                group_layout_descs: l
                    .group_layout_descs
                    .iter()
                    .map(|(id, d)| {
                        let desc = pb::MemoryLayoutDesc {
                            shapes: d
                                .shapes
                                .iter()
                                .map(|s| pb::TensorShape {
                                    dims: s.iter().map(|&x| x as i64).collect(),
                                })
                                .collect(),
                            dtypes: d.dtypes.clone(),
                        };
                        (i64::from(*id), desc)
                    })
                    .collect(),
            }
            .encode_to_vec(),
            Command::P2pQueryLookupResults(id) => {
                pb::TaskId { task_id: *id as i64 }.encode_to_vec()
            }
            Command::P2pUnlockObjects(u) => {
                pb::P2pUnlockObjectsRequest { keys: u.keys.iter().map(ikey).collect() }
                    .encode_to_vec()
            }
            Command::CbProtocolHandshake(v) => {
                pb::CbProtocolHandshakeRequest { client_version: *v }.encode_to_vec()
            }
            Command::CbRegisterRope(r) => pb::CbRegisterRopeRequest {
                instance_id: r.instance_id as i64,
                cos_sin_caches_ipc: r.cos_sin_caches.iter().map(wrapper).collect(),
                head_size: r.head_size.into(),
                is_neox_style: r.is_neox_style,
                group_to_cache: r.group_to_cache.clone(),
                group_rot: r
                    .group_rot
                    .iter()
                    .map(|w| pb::RopeWindow { values: w.clone() })
                    .collect(),
                group_head_size: r.group_head_size.iter().map(|&h| h as i64).collect(),
                kv_quant: r.kv_quant.clone(),
            }
            .encode_to_vec(),
            Command::CbRetrievePreComputed(r) => pb::CbRetrievePreComputedRequest {
                key: pkey(&r.key),
                cb_match_result: r
                    .match_results
                    .iter()
                    .map(|m| pb::CbMatchResult {
                        old_st: m.old_st as i64,
                        old_ed: m.old_ed as i64,
                        cur_st: m.cur_st as i64,
                        cur_ed: m.cur_ed as i64,
                        hash: m.hash.clone(),
                    })
                    .collect(),
                gpu_block_ids: groups(&r.block_ids),
                instance_id: r.instance_id as i64,
                event_ipc_handle: r.event_ipc_handle.clone(),
            }
            .encode_to_vec(),
            Command::CbReorderPlan(p) => pb::CbReorderPlanRequest {
                key: pkey(&p.key),
                keep_prefix: p.keep_prefix as i64,
                budget_ms: p.budget_ms as i64,
            }
            .encode_to_vec(),
        }
    }

    /// Every command, sent as LMCache's gRPC client sends it, decodes to the very command the
    /// ZMQ frames carry: the two transports share one decoder.
    #[test]
    fn every_command_over_grpc_is_the_command_over_zmq() {
        let mut all = samples();
        all.push(Command::RegisterEngineDriven(EngineDrivenRegistration {
            instance_id: 9,
            model_name: lmcache_core::ModelName::new("m").unwrap(),
            world_size: 2,
            block_size: 16,
            num_layers: 4,
            hidden_dim_size: 1024,
            dtype: lmcache_core::Dtype::BFloat16,
            use_mla: false,
            num_physical_slots: Some(256),
        }));
        for c in all {
            let (op, zmq_params) = c.encode();
            let params = decode_request(op, &proto(&c)).unwrap_or_else(|e| panic!("{op:?}: {e}"));
            assert_eq!(Command::decode(op, &params).unwrap(), c, "{op:?}");
            assert_eq!(params.len(), zmq_params.len(), "{op:?}");
        }
    }

    #[test]
    fn bad_requests_are_named() {
        // Not the method's message: field 1 of a LookupRequest must be a message.
        let e = decode_request(Op::Lookup, &[0x08, 0x01]).unwrap_err();
        assert!(matches!(e, ProtocolError::BadProtobuf { message: "LookupRequest", .. }), "{e}");
        // A key is required.
        let e = decode_request(Op::Lookup, &[]).unwrap_err();
        assert_eq!(e, ProtocolError::MissingField { field: "key".into() });
        // Layout hints that are not a msgpack map.
        let r =
            pb::RegisterKvCacheRequest { encoded_layout_hints: vec![0x01], ..Default::default() };
        let e = decode_request(Op::RegisterKvCache, &r.encode_to_vec()).unwrap_err();
        assert!(e.to_string().contains("layout_hints"), "{e}");
        // A negative instance id reaches the command decoder, which names it.
        let params = decode_request(
            Op::UnregisterKvCache,
            &pb::InstanceRequest { instance_id: -3 }.encode_to_vec(),
        )
        .unwrap();
        let e = Command::decode(Op::UnregisterKvCache, &params).unwrap_err();
        assert!(e.to_string().contains("instance_id"), "{e}");
        for op in [Op::StoreQ, Op::RegisterQCache, Op::UnregisterQCache] {
            assert!(matches!(decode_request(op, &[]), Err(ProtocolError::UnsupportedOp(_))));
        }
    }

    /// Each reply value becomes the response LMCache's client decodes to the same Python
    /// value: optional responses absent for `None`, dicts as msgpack bytes (none when empty).
    #[test]
    fn replies_become_their_responses() {
        let transfer = encode_response(Op::Store, Some(&crate::types::transfer_result(true)));
        let r = pb::TransferResponse::decode(transfer.unwrap().as_slice()).unwrap();
        assert_eq!(
            r.result,
            Some(pb::EventIpcHandleResult { event_ipc_handle: vec![], success: true })
        );

        let none = encode_response(Op::QueryPrefetchStatus, None).unwrap();
        assert_eq!(pb::ChunkCountResponse::decode(none.as_slice()).unwrap().chunk_count, None);
        let two = encode_response(Op::WaitPrefetchStatus, Some(&Value::from(2))).unwrap();
        assert_eq!(pb::ChunkCountResponse::decode(two.as_slice()).unwrap().chunk_count, Some(2));
        // Zero is present (LMCache's client reads 0, not None, from a present field).
        let zero = encode_response(Op::QueryPrefetchStatus, Some(&Value::from(0))).unwrap();
        assert_eq!(pb::ChunkCountResponse::decode(zero.as_slice()).unwrap().chunk_count, Some(0));

        let prepared = crate::types::PrepareStoreResponse { slots: vec![], chunk_indices: vec![] };
        let bytes = encode_response(Op::PrepareStore, Some(&prepared.encode())).unwrap();
        let ctx = pb::PrepareStoreResponse::decode(bytes.as_slice()).unwrap().encoded_context;
        let back = value::decode(0, &ctx).unwrap();
        assert_eq!(Some(&back), Fields::of("r", &prepared.encode()).unwrap().get("context"));
        let failed = crate::types::PrepareRetrieveResponse::FAILED.encode();
        let bytes = encode_response(Op::PrepareRetrieve, Some(&failed)).unwrap();
        let r = pb::PrepareRetrieveResponse::decode(bytes.as_slice()).unwrap();
        assert!(!r.success && r.data.is_empty() && r.encoded_context.is_empty());

        let id = encode_response(Op::P2pLookupAndLock, Some(&Value::from(u64::MAX))).unwrap();
        assert_eq!(pb::TaskId::decode(id.as_slice()).unwrap().task_id, -1);
        let miss = encode_response(Op::P2pQueryLookupResults, Some(&Value::Nil)).unwrap();
        assert_eq!(
            pb::P2pQueryLookupResultsResponse::decode(miss.as_slice()).unwrap().addresses,
            None
        );
        let addr = crate::types::p2p::TransferAddress { offset: 4096, size: 1 << 20 };
        let list = Value::Array(vec![addr.encode()]);
        let got = encode_response(Op::P2pQueryLookupResults, Some(&list)).unwrap();
        let got = pb::P2pQueryLookupResultsResponse::decode(got.as_slice()).unwrap();
        assert_eq!(
            got.addresses.unwrap().addresses,
            vec![pb::TransferChannelAddress { offset: 4096, size: 1 << 20 }]
        );

        let loading = encode_response(Op::CbUnifiedLookup, None).unwrap();
        assert_eq!(pb::CbUnifiedLookupResponse::decode(loading.as_slice()).unwrap().payload, None);
        let hs = Value::Array(vec![Value::from(3), Value::Boolean(true)]);
        let hs = encode_response(Op::CbProtocolHandshake, Some(&hs)).unwrap();
        let hs = pb::CbProtocolHandshakeResponse::decode(hs.as_slice()).unwrap();
        assert_eq!((hs.server_version, hs.client_compatible), (3, true));

        // A void reply to a void method is the empty message; a value where one is due,
        // missing, is our bug and named so.
        assert_eq!(encode_response(Op::Lookup, None).unwrap(), Vec::<u8>::new());
        let e = encode_response(Op::GetChunkSize, None).unwrap_err();
        assert!(matches!(e, ProtocolError::Internal { op: "get_chunk_size", .. }), "{e}");
    }

    #[test]
    fn event_batches_keep_every_field() {
        let record = map(vec![
            ("seq", Value::from(7)),
            ("kind", Value::from("stored")),
            ("medium", Value::from("CPU")),
            ("model_name", Value::from("m")),
            ("block_hashes", Value::Array(vec![Value::Binary(vec![1; 32])])),
            ("parent_block_hash", Value::Nil),
            ("token_ids", Value::Array(vec![Value::from(5), Value::from(6)])),
        ]);
        let batch = map(vec![
            ("enabled", Value::Boolean(true)),
            ("incarnation", Value::from(42)),
            ("next_cursor", Value::from(8)),
            ("lost", Value::Boolean(false)),
            ("events", Value::Array(vec![record])),
        ]);
        let b = pb::KvEventBatch::decode(encode_event_batch(&batch).unwrap().as_slice()).unwrap();
        assert_eq!((b.enabled, b.incarnation, b.next_cursor, b.lost), (true, 42, 8, false));
        let e = &b.events[0];
        assert_eq!((e.seq, e.kind.as_str(), e.medium.as_str()), (7, "stored", "CPU"));
        assert_eq!(
            (e.block_hashes.clone(), e.parent_block_hash.clone()),
            (vec![vec![1; 32]], None)
        );
        assert_eq!(e.token_ids, vec![5, 6]);
    }
}
