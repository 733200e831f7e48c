//! Multipart layout (LMCache 0.5.6 `transport/zmq_impl/mq.py`).
//!
//! Request as the ROUTER sees it: `[identity, uid, op, param...]`, every frame after the
//! identity one msgpack value; `op` is an int (legacy id) or a str (name). Stream control from
//! a client: `[identity, uid, b"", b"ack" | b"cancel"]` (raw bytes, not msgpack).
//! Reply: `[identity, uid, op, payload?]`, with `uid` and `op` echoed byte for byte and the
//! payload frame omitted for void replies.

use rmpv::Value;

use crate::error::ProtocolError;
use crate::op::Op;
use crate::value;

/// The frames that identify a request and are echoed in its reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// ROUTER identity of the client.
    pub identity: Vec<u8>,
    /// The uid frame, verbatim.
    pub uid_frame: Vec<u8>,
    /// The op frame, verbatim.
    pub op_frame: Vec<u8>,
    /// The decoded request uid; `None` when the uid frame is not a msgpack unsigned int
    /// (the reply still echoes the frame byte for byte).
    pub uid: Option<u64>,
}

/// A decoded request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Echo frames.
    pub header: Header,
    /// The operation.
    pub op: Op,
    /// One decoded value per parameter frame.
    pub params: Vec<Value>,
}

/// A stream control message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Grants one more batch.
    Ack,
    /// Ends the stream.
    Cancel,
}

/// What a client sent.
#[derive(Debug, Clone, PartialEq)]
pub enum Incoming {
    /// An RPC.
    Request(Request),
    /// Stream flow control for the stream started by request `uid`.
    Control {
        /// Client identity.
        identity: Vec<u8>,
        /// The stream's request uid frame.
        uid_frame: Vec<u8>,
        /// What to do.
        control: Control,
    },
}

/// A message that could not be parsed, with as much of its header as was understood (to
/// answer with a typed failure when the operation is known).
#[derive(Debug, Clone, PartialEq)]
pub struct ParseFailure {
    /// Present when uid and op frames were readable.
    pub header: Option<Box<(Header, Option<Op>)>>,
    /// What was wrong.
    pub error: ProtocolError,
}

/// Parses a multipart message received on the ROUTER socket.
///
/// What cannot be answered, and what is:
/// - fewer than 3 frames (`[identity, uid]` or less): no op frame to echo, so no reply the
///   client could match; a failure without header;
/// - an empty op frame is a stream control message: anything but `ack`/`cancel` after it is
///   a failure without header (there is no request to answer);
/// - an undecodable uid with a known op: a failure *with* header (uid frame echoed verbatim),
///   so the server still sends the op's typed failure;
/// - an unknown op or an undecodable parameter: a failure with header, as above.
pub fn parse(mut frames: Vec<Vec<u8>>) -> Result<Incoming, ParseFailure> {
    let fail = |header, error| ParseFailure { header, error };
    if frames.len() < 3 {
        return Err(fail(None, ProtocolError::TooFewFrames { expected: 3, got: frames.len() }));
    }
    let rest = frames.split_off(3);
    let op_frame = frames.pop().unwrap_or_default();
    let uid_frame = frames.pop().unwrap_or_default();
    let identity = frames.pop().unwrap_or_default();
    let uid = value::decode(0, &uid_frame).and_then(|v| value::u64_("uid", &v));
    if op_frame.is_empty() {
        let control = match rest.first().map(Vec::as_slice) {
            Some(b"ack") => Control::Ack,
            Some(b"cancel") => Control::Cancel,
            _ => {
                return Err(fail(
                    None,
                    ProtocolError::UnknownOp("empty op frame without ack/cancel".into()),
                ));
            }
        };
        return match uid {
            Ok(_) => Ok(Incoming::Control { identity, uid_frame, control }),
            Err(e) => Err(fail(None, e)),
        };
    }
    let header = Header { identity, uid_frame, op_frame, uid: uid.as_ref().ok().copied() };
    let op_value = match value::decode(1, &header.op_frame) {
        Ok(v) => v,
        Err(e) => return Err(fail(Some(Box::new((header, None))), e)),
    };
    let op = match &op_value {
        Value::Integer(i) => i.as_u64().and_then(Op::from_id),
        Value::String(s) => s.as_str().and_then(Op::from_name),
        _ => None,
    };
    let Some(op) = op else {
        return Err(fail(
            Some(Box::new((header, None))),
            ProtocolError::UnknownOp(op_value.to_string()),
        ));
    };
    if let Err(e) = uid {
        return Err(fail(Some(Box::new((header, Some(op)))), e));
    }
    let mut params = Vec::with_capacity(rest.len());
    for (i, f) in rest.iter().enumerate() {
        match value::decode(i + 2, f) {
            Ok(v) => params.push(v),
            Err(e) => return Err(fail(Some(Box::new((header, Some(op)))), e)),
        }
    }
    Ok(Incoming::Request(Request { header, op, params }))
}

/// A reply ready to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// Echo frames of the request.
    pub header: Header,
    /// The encoded payload, `None` for void replies.
    pub payload: Option<Vec<u8>>,
}

impl Reply {
    /// A reply carrying `v`.
    pub fn value(header: Header, v: &Value) -> Self {
        Self { header, payload: Some(value::encode(v)) }
    }

    /// A void reply (no payload frame).
    pub fn void(header: Header) -> Self {
        Self { header, payload: None }
    }

    /// The frames to send on the ROUTER: identity, uid, op, payload?
    pub fn into_frames(self) -> Vec<Vec<u8>> {
        let mut f = vec![self.header.identity, self.header.uid_frame, self.header.op_frame];
        if let Some(p) = self.payload {
            f.push(p);
        }
        f
    }
}

impl Request {
    /// Checks the parameter count.
    pub fn expect_params(&self, n: usize) -> Result<(), ProtocolError> {
        if self.params.len() != n {
            return Err(ProtocolError::ParamCount {
                op: self.op.name(),
                expected: n,
                got: self.params.len(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(frames: &[&[u8]]) -> Result<Incoming, ParseFailure> {
        parse(frames.iter().map(|f| f.to_vec()).collect())
    }

    /// Appendix A: `get_chunk_size` from a fresh client: uid 0, op 21.
    #[test]
    fn get_chunk_size_request_and_reply_bytes() {
        let Incoming::Request(r) = req(&[b"id", &[0x00], &[0x15]]).unwrap() else { panic!() };
        assert_eq!(r.op, Op::GetChunkSize);
        assert!(r.params.is_empty());
        let reply = Reply::value(r.header, &Value::from(256));
        assert_eq!(
            reply.into_frames(),
            vec![b"id".to_vec(), vec![0x00], vec![0x15], vec![0xcd, 0x01, 0x00]]
        );
    }

    #[test]
    fn string_ops_and_control_frames() {
        let mut op = vec![0xb3];
        op.extend_from_slice(b"subscribe_kv_events");
        let Incoming::Request(r) = req(&[b"i", &[0x07], &op]).unwrap() else { panic!() };
        assert_eq!(r.op, Op::SubscribeKvEvents);
        assert_eq!(r.header.op_frame, op, "op frame must be echoed verbatim");
        let c = req(&[b"i", &[0x07], b"", b"ack"]).unwrap();
        assert_eq!(
            c,
            Incoming::Control {
                identity: b"i".to_vec(),
                uid_frame: vec![7],
                control: Control::Ack
            }
        );
    }

    #[test]
    fn malformed_messages_are_named() {
        assert!(matches!(req(&[b"i", &[0]]), Err(ParseFailure { header: None, .. })));
        let e = req(&[b"i", &[0x00], &[0x0b]]).unwrap_err();
        assert!(matches!(e.error, ProtocolError::UnknownOp(_)), "{e:?}");
        assert!(e.header.is_some(), "uid/op header should survive an unknown op");
        let e = req(&[b"i", &[0x00], &[0x16], &[0xdc, 0xff]]).unwrap_err();
        assert!(matches!(e.error, ProtocolError::BadMsgpack { frame: 2, .. }));
        assert_eq!(e.header.unwrap().1, Some(Op::Ping));
        // A str uid: refused, but with the header kept (uid frame verbatim) so the op's typed
        // failure can still be sent.
        let e = req(&[b"i", b"\xa1x", &[0x16]]).unwrap_err();
        assert!(matches!(e.error, ProtocolError::WrongType { .. }), "str uid accepted");
        let (h, op) = *e.header.unwrap();
        assert_eq!((h.uid_frame.as_slice(), h.uid, op), (&b"\xa1x"[..], None, Some(Op::Ping)));
        // Not msgpack at all, as a uid: the same.
        let e = req(&[b"i", &[0xc1], &[0x06]]).unwrap_err();
        assert_eq!(e.header.unwrap().1, Some(Op::Store));
        // An op frame that is not msgpack: header kept, op unknown.
        let e = req(&[b"i", &[0x01], &[0xdc, 0xff]]).unwrap_err();
        assert!(matches!(e.error, ProtocolError::BadMsgpack { frame: 1, .. }));
        assert_eq!(e.header.unwrap().1, None);
        // Control messages: only ack/cancel, and only with a readable uid.
        assert!(req(&[b"i", &[0x01], b""]).unwrap_err().header.is_none());
        assert!(req(&[b"i", &[0x01], b"", b"nack"]).unwrap_err().header.is_none());
        assert!(req(&[b"i", &[0xc1], b"", b"ack"]).unwrap_err().header.is_none());
        assert!(matches!(req(&[]).unwrap_err().error, ProtocolError::TooFewFrames { got: 0, .. }));
    }
}
