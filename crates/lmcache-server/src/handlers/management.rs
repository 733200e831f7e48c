//! get_chunk_size, get_experimental, ping, noop, clear, report_block_allocation.

use lmcache_protocol::{Op, ProtocolError, Request, value};
use rmpv::Value;

use crate::state::ServerState;

/// What `get_experimental` advertises.
pub(super) fn capabilities(state: &ServerState) -> Value {
    let caps = if state.events.enabled() { vec![Value::from("kv_event_stream")] } else { vec![] };
    Value::Array(caps)
}

pub(super) fn handle(state: &ServerState, req: &Request) -> Result<Option<Value>, ProtocolError> {
    match req.op {
        Op::GetChunkSize => {
            req.expect_params(0)?;
            Ok(Some(Value::from(state.chunk_size() as u64)))
        }
        // "kv_event_stream": vLLM's router then takes block hashes from our event stream.
        Op::GetExperimental => {
            req.expect_params(0)?;
            Ok(Some(capabilities(state)))
        }
        Op::Ping => {
            req.expect_params(1)?;
            if let Some(id) = value::opt(&req.params[0], |v| value::u64_("instance_id", v))? {
                state.registry.ping(id);
            }
            Ok(Some(Value::Boolean(true)))
        }
        Op::Noop => {
            req.expect_params(0)?;
            Ok(Some(Value::from("OK")))
        }
        Op::Clear => {
            req.expect_params(1)?;
            let force = value::bool_("force", &req.params[0])?;
            let r = state.l1().clear(force);
            tracing::info!(force, removed = r.removed, skipped = r.skipped, "cache cleared");
            Ok(None)
        }
        Op::ReportBlockAllocation => {
            req.expect_params(3)?;
            value::u64_("instance_id", &req.params[0])?;
            value::str_("model_name", &req.params[1])?;
            value::array("records", &req.params[2])?;
            Ok(None)
        }
        other => Err(ProtocolError::UnsupportedOp(other.name())),
    }
}
