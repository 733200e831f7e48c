//! Why a message could not be understood.

use thiserror::Error;

/// A malformed frame or payload. Every variant names what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// Fewer frames than the layout needs.
    #[error("expected at least {expected} frames, got {got}")]
    TooFewFrames {
        /// Minimum count.
        expected: usize,
        /// Frames received.
        got: usize,
    },
    /// A frame is not valid msgpack, or has bytes after its value.
    #[error("frame {frame} is not a single msgpack value: {reason}")]
    BadMsgpack {
        /// Frame index (after the identity frame).
        frame: usize,
        /// Decoder message.
        reason: String,
    },
    /// A gRPC message that is not the protobuf its method takes.
    #[error("{message}: not a valid protobuf message: {reason}")]
    BadProtobuf {
        /// The protobuf message expected.
        message: &'static str,
        /// The decoder's message.
        reason: String,
    },
    /// The operation frame names no known operation.
    #[error("unknown operation {0}")]
    UnknownOp(String),
    /// An operation that exists in LMCache but is not served here.
    #[error("operation {0} is not supported by lmcache-rs")]
    UnsupportedOp(&'static str),
    /// A parameter count that does not match the operation.
    #[error("{op} takes {expected} parameters, got {got}")]
    ParamCount {
        /// The operation.
        op: &'static str,
        /// Its parameter count.
        expected: usize,
        /// Parameters received.
        got: usize,
    },
    /// A value of the wrong msgpack type.
    #[error("{field}: expected {expected}, got {got}")]
    WrongType {
        /// Dotted path of the field.
        field: String,
        /// What the contract says.
        expected: &'static str,
        /// What arrived.
        got: String,
    },
    /// A required field is absent from a map.
    #[error("{field}: missing")]
    MissingField {
        /// Dotted path of the field.
        field: String,
    },
    /// A value of the right type but outside its range.
    #[error("{field}: {reason}")]
    OutOfRange {
        /// Dotted path of the field.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A worker whose registration was refused (or that cannot be served) sent an operation.
    #[error("instance {instance_id}: {reason}")]
    NotServable {
        /// The worker's instance id.
        instance_id: u64,
        /// Why it cannot be served, with what to do about it.
        reason: String,
    },
    /// A handler failed internally (a panic that was caught); the request got its failure
    /// reply and the worker kept serving.
    #[error("internal error handling {op}: {reason}")]
    Internal {
        /// The operation.
        op: &'static str,
        /// The panic message.
        reason: String,
    },
}

impl ProtocolError {
    /// A short stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::TooFewFrames { .. } => "too_few_frames",
            Self::BadMsgpack { .. } => "bad_msgpack",
            Self::BadProtobuf { .. } => "bad_protobuf",
            Self::UnknownOp(_) => "unknown_op",
            Self::UnsupportedOp(_) => "unsupported_op",
            Self::ParamCount { .. } => "param_count",
            Self::WrongType { .. } => "wrong_type",
            Self::MissingField { .. } => "missing_field",
            Self::OutOfRange { .. } => "out_of_range",
            Self::NotServable { .. } => "not_servable",
            Self::Internal { .. } => "panic",
        }
    }
}
