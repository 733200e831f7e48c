//! get_chunk_size, get_experimental, ping, noop, clear, report_block_allocation.

use lmcache_protocol::ProtocolError;
use lmcache_protocol::request::{Clear, Command};
use rmpv::Value;

use crate::state::RequestState;

/// What `get_experimental` advertises.
pub(super) fn capabilities(state: &RequestState) -> Value {
    let caps = if state.config.kv_event_log_size > 0 {
        vec![Value::from("kv_event_stream")]
    } else {
        vec![]
    };
    Value::Array(caps)
}

pub(super) fn handle(state: &RequestState, cmd: Command) -> Result<Option<Value>, ProtocolError> {
    match cmd {
        Command::GetChunkSize => Ok(Some(Value::from(state.chunk_size() as u64))),
        // "kv_event_stream": vLLM's router then takes block hashes from our event stream.
        Command::GetExperimental => Ok(Some(capabilities(state))),
        Command::Ping(p) => {
            // An unknown worker is told once (see `Registry::ping`): LMCache's adapter then
            // registers again, as after any restart it notices.
            let ok = p.instance_id.is_none_or(|id| state.registry.ping(id));
            if !ok {
                tracing::info!(
                    instance_id = p.instance_id,
                    "ping from an unregistered worker: answered false once, so that it registers again"
                );
            }
            Ok(Some(Value::Boolean(ok)))
        }
        Command::Noop => Ok(Some(Value::from("OK"))),
        Command::Clear(Clear { force }) => {
            let r = state.l1().clear(force);
            tracing::info!(force, removed = r.removed, skipped = r.skipped, "cache cleared");
            Ok(None)
        }
        // Checked when decoded; LMCache's server only publishes it.
        Command::ReportBlockAllocation(_) => Ok(None),
        other => Err(ProtocolError::UnsupportedOp(other.encode().0.name())),
    }
}
