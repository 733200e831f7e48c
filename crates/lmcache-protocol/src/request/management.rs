//! `ping`, `clear`, `report_block_allocation`.

use rmpv::Value;

use super::expect;
use crate::error::ProtocolError;
use crate::op::Op;
use crate::value;

/// `ping(instance_id | nil)`: a worker's heartbeat (nil: the scheduler's).
#[derive(Debug, Clone, PartialEq)]
pub struct Ping {
    /// The worker, or `None` for the scheduler.
    pub instance_id: Option<u64>,
}

impl Ping {
    /// From the request's parameters.
    pub fn decode(params: &[Value]) -> Result<Self, ProtocolError> {
        expect(Op::Ping, params, 1)?;
        Ok(Self { instance_id: value::opt(&params[0], |v| value::u64_("instance_id", v))? })
    }

    /// The parameters.
    pub fn encode(&self) -> Vec<Value> {
        vec![self.instance_id.map_or(Value::Nil, Value::from)]
    }
}

/// `clear(force)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Clear {
    /// Also objects that are locked or being written.
    pub force: bool,
}

impl Clear {
    /// From the request's parameters.
    pub fn decode(params: &[Value]) -> Result<Self, ProtocolError> {
        expect(Op::Clear, params, 1)?;
        Ok(Self { force: value::bool_("force", &params[0])? })
    }

    /// The parameters.
    pub fn encode(&self) -> Vec<Value> {
        vec![Value::Boolean(self.force)]
    }
}

/// `report_block_allocation(instance_id, model_name, records)`: checked, answered, not kept.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportBlockAllocation {
    /// The scheduler's pid.
    pub instance_id: u64,
    /// The model.
    pub model_name: String,
    /// LMCache's allocation records, as sent.
    pub records: Vec<Value>,
}

impl ReportBlockAllocation {
    /// From the request's parameters.
    pub fn decode(params: &[Value]) -> Result<Self, ProtocolError> {
        expect(Op::ReportBlockAllocation, params, 3)?;
        Ok(Self {
            instance_id: value::u64_("instance_id", &params[0])?,
            model_name: value::str_("model_name", &params[1])?.to_owned(),
            records: value::array("records", &params[2])?.to_vec(),
        })
    }

    /// The parameters.
    pub fn encode(&self) -> Vec<Value> {
        vec![
            Value::from(self.instance_id),
            Value::from(self.model_name.as_str()),
            Value::Array(self.records.clone()),
        ]
    }
}
