//! `subscribe_kv_events`.

use rmpv::Value;

use super::expect;
use crate::error::ProtocolError;
use crate::op::Op;
use crate::value;

/// `subscribe_kv_events(instance_id, model_name, cursor, max_events)`.
#[derive(Debug, Clone, PartialEq)]
pub struct SubscribeKvEvents {
    /// The worker whose events are wanted.
    pub instance_id: u64,
    /// Its model.
    pub model_name: String,
    /// The first event sequence wanted.
    pub cursor: u64,
    /// Events per batch at most (the server accepts 1..=1024).
    pub max_events: u64,
}

impl SubscribeKvEvents {
    /// From the request's parameters.
    pub fn decode(params: &[Value]) -> Result<Self, ProtocolError> {
        expect(Op::SubscribeKvEvents, params, 4)?;
        Ok(Self {
            instance_id: value::u64_("instance_id", &params[0])?,
            model_name: value::str_("model_name", &params[1])?.to_owned(),
            cursor: value::u64_("cursor", &params[2])?,
            max_events: value::u64_("max_events", &params[3])?,
        })
    }

    /// The parameters.
    pub fn encode(&self) -> Vec<Value> {
        vec![
            Value::from(self.instance_id),
            Value::from(self.model_name.as_str()),
            Value::from(self.cursor),
            Value::from(self.max_events),
        ]
    }
}
