//! CacheBlend's operations (`--engine-type blend`): the handshake, and the rope state a
//! scatter re-rotates K with. The unified lookup, the scatter and the reorder plan are not
//! served yet (see [`crate::blend`]).

use lmcache_protocol::ProtocolError;
use lmcache_protocol::request::{CbRegisterRope, Command};
use lmcache_protocol::types::IpcDescriptor;
use rmpv::Value;

use crate::blend::BlendEngine;
use crate::registry::{Family, Registration};
use crate::state::RequestState;

pub(super) fn handle(state: &RequestState, cmd: Command) -> Result<Option<Value>, ProtocolError> {
    let Some(engine) = state.blend.as_deref() else {
        return Err(ProtocolError::UnsupportedOp(cmd.encode().0.name()));
    };
    match cmd {
        Command::CbProtocolHandshake(v) => Ok(Some(BlendEngine::handshake(v))),
        Command::CbRegisterRope(req) => register_rope(state, engine, &req).map(|()| None),
        Command::CbUnregisterRope(id) => {
            if !engine.unregister_rope(id) {
                tracing::warn!(instance_id = id, "cb_unregister_rope: no rope state registered");
            }
            Ok(None)
        }
        other => Err(ProtocolError::UnsupportedOp(other.encode().0.name())),
    }
}

fn bad(field: &str, reason: impl Into<String>) -> ProtocolError {
    ProtocolError::OutOfRange { field: field.to_owned(), reason: reason.into() }
}

fn register_rope(
    state: &RequestState,
    engine: &BlendEngine,
    req: &CbRegisterRope,
) -> Result<(), ProtocolError> {
    let id = req.instance_id;
    let max_engine_group = match state.registry.get(Family::LmcacheDriven, id) {
        Some(inst) => match inst.registration {
            Registration::LmcacheDriven { kernel_groups, .. } => {
                kernel_groups.iter().map(|g| g.engine_group).max().unwrap_or(-1)
            }
            Registration::EngineDriven => -1,
        },
        None => {
            return Err(bad(
                "instance_id",
                format!(
                    "instance {id} has no paged KV cache registered; send register_kv_cache \
                     before cb_register_rope"
                ),
            ));
        }
    };
    let mut caches = Vec::with_capacity(req.cos_sin_caches.len());
    for (i, d) in req.cos_sin_caches.iter().enumerate() {
        let field = format!("cos_sin_caches_ipc[{i}]");
        let IpcDescriptor::CpuShm { shm_name, nbytes, meta } = d else {
            return Err(bad(&field, "device memory needs a GPU backend; send a cpu_shm tensor"));
        };
        let seg = super::lmcache_driven::open_client_segment(state, shm_name, *nbytes)
            .map_err(|r| bad(&field, r))?;
        caches.push(crate::blend::read_cos_sin(&seg, meta).map_err(|r| bad(&field, r))?);
    }
    engine.register_rope(req, max_engine_group, caches).map_err(|r| bad("cb_register_rope", r))
}
