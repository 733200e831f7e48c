//! Strict readers over decoded msgpack values (msgspec's decoding rules): a `bool` must be a
//! msgpack bool, `bytes` a bin, `str` a str, integers integers. Maps are keyed by field name;
//! unknown keys are ignored; a missing field is an error unless the caller gives a default.
//! Every error carries the dotted path of the field.

use rmpv::Value;

use crate::error::ProtocolError;

/// Decodes exactly one msgpack value from `bytes` (trailing bytes are an error).
pub fn decode(frame: usize, bytes: &[u8]) -> Result<Value, ProtocolError> {
    let mut rd = bytes;
    let v = rmpv::decode::read_value(&mut rd)
        .map_err(|e| ProtocolError::BadMsgpack { frame, reason: e.to_string() })?;
    if !rd.is_empty() {
        return Err(ProtocolError::BadMsgpack {
            frame,
            reason: format!("{} bytes after the value", rd.len()),
        });
    }
    Ok(v)
}

/// Encodes a value.
pub fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, v);
    out
}

/// Names a msgpack value's type for error messages.
pub fn type_name(v: &Value) -> String {
    match v {
        Value::Nil => "nil".into(),
        Value::Boolean(_) => "bool".into(),
        Value::Integer(_) => "int".into(),
        Value::F32(_) | Value::F64(_) => "float".into(),
        Value::String(_) => "str".into(),
        Value::Binary(_) => "bin".into(),
        Value::Array(a) => format!("array[{}]", a.len()),
        Value::Map(_) => "map".into(),
        Value::Ext(t, _) => format!("ext type {t}"),
    }
}

fn wrong(field: &str, expected: &'static str, got: &Value) -> ProtocolError {
    ProtocolError::WrongType { field: field.to_owned(), expected, got: type_name(got) }
}

/// A signed 64-bit integer.
pub fn int(field: &str, v: &Value) -> Result<i64, ProtocolError> {
    match v {
        Value::Integer(i) => i.as_i64().ok_or_else(|| ProtocolError::OutOfRange {
            field: field.to_owned(),
            reason: format!("{i} does not fit a signed 64-bit integer"),
        }),
        other => Err(wrong(field, "int", other)),
    }
}

/// An unsigned integer that fits `u32`.
pub fn u32_(field: &str, v: &Value) -> Result<u32, ProtocolError> {
    let i = int(field, v)?;
    u32::try_from(i).map_err(|_| ProtocolError::OutOfRange {
        field: field.to_owned(),
        reason: format!("{i} is outside 0..=4294967295"),
    })
}

/// An unsigned integer that fits `u64` (ids are 63-bit but may arrive as uint64).
pub fn u64_(field: &str, v: &Value) -> Result<u64, ProtocolError> {
    match v {
        Value::Integer(i) => i.as_u64().ok_or_else(|| ProtocolError::OutOfRange {
            field: field.to_owned(),
            reason: format!("{i} is negative"),
        }),
        other => Err(wrong(field, "int", other)),
    }
}

/// A boolean. Declared-`bool` parameters are coerced from ints by the Python client, so an
/// integer 0/1 is accepted here too.
pub fn bool_(field: &str, v: &Value) -> Result<bool, ProtocolError> {
    match v {
        Value::Boolean(b) => Ok(*b),
        Value::Integer(i) if i.as_u64() == Some(0) => Ok(false),
        Value::Integer(i) if i.as_u64() == Some(1) => Ok(true),
        other => Err(wrong(field, "bool", other)),
    }
}

/// A float (ints accepted, as Python's `float` parameters are).
pub fn float(field: &str, v: &Value) -> Result<f64, ProtocolError> {
    match v {
        Value::F64(f) => Ok(*f),
        Value::F32(f) => Ok(f64::from(*f)),
        Value::Integer(i) => i.as_f64().ok_or_else(|| wrong(field, "float", v)),
        other => Err(wrong(field, "float", other)),
    }
}

/// A UTF-8 string.
pub fn str_<'a>(field: &str, v: &'a Value) -> Result<&'a str, ProtocolError> {
    match v {
        Value::String(s) => s.as_str().ok_or_else(|| ProtocolError::WrongType {
            field: field.to_owned(),
            expected: "str",
            got: "invalid UTF-8".into(),
        }),
        other => Err(wrong(field, "str", other)),
    }
}

/// A byte string (msgpack bin).
pub fn bin<'a>(field: &str, v: &'a Value) -> Result<&'a [u8], ProtocolError> {
    match v {
        Value::Binary(b) => Ok(b),
        other => Err(wrong(field, "bin", other)),
    }
}

/// An array.
pub fn array<'a>(field: &str, v: &'a Value) -> Result<&'a [Value], ProtocolError> {
    match v {
        Value::Array(a) => Ok(a),
        other => Err(wrong(field, "array", other)),
    }
}

/// An optional value: nil → `None`.
pub fn opt<'a, T>(
    v: &'a Value,
    f: impl FnOnce(&'a Value) -> Result<T, ProtocolError>,
) -> Result<Option<T>, ProtocolError> {
    if v.is_nil() { Ok(None) } else { f(v).map(Some) }
}

/// A map keyed by field names.
#[derive(Debug, Clone, Copy)]
pub struct Fields<'a> {
    path: &'a str,
    entries: &'a [(Value, Value)],
}

impl<'a> Fields<'a> {
    /// Views `v` as a struct map.
    pub fn of(path: &'a str, v: &'a Value) -> Result<Self, ProtocolError> {
        match v {
            Value::Map(entries) => Ok(Self { path, entries }),
            other => Err(wrong(path, "map", other)),
        }
    }

    /// The dotted path of field `name`.
    pub fn path(&self, name: &str) -> String {
        if self.path.is_empty() { name.to_owned() } else { format!("{}.{name}", self.path) }
    }

    /// Field `name`, if present.
    pub fn get(&self, name: &str) -> Option<&'a Value> {
        self.entries.iter().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v)
    }

    /// Every entry, in order (a map keyed by something other than field names).
    pub fn entries(&self) -> &'a [(Value, Value)] {
        self.entries
    }

    /// Field `name`, required.
    pub fn req(&self, name: &str) -> Result<&'a Value, ProtocolError> {
        self.get(name).ok_or_else(|| ProtocolError::MissingField { field: self.path(name) })
    }
}

/// Builds a struct map in field order.
pub fn map(fields: Vec<(&str, Value)>) -> Value {
    Value::Map(fields.into_iter().map(|(k, v)| (Value::from(k), v)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_types_name_the_field() {
        let v = Value::from("x");
        let e = int("key.start", &v).unwrap_err();
        assert_eq!(e.to_string(), "key.start: expected int, got str");
        assert!(bin("data", &Value::from("abc")).is_err(), "str accepted as bytes");
        assert!(str_("name", &Value::Binary(b"abc".to_vec())).is_err(), "bin accepted as str");
        assert!(bool_("force", &Value::from(2)).is_err());
        assert!(bool_("force", &Value::from(true)).unwrap());
        assert!(u32_("n", &Value::from(-1)).is_err());
        assert!(u64_("id", &Value::from(u64::MAX)).is_ok());
    }

    #[test]
    fn decode_refuses_trailing_bytes_and_garbage() {
        assert!(decode(0, &[0x01]).is_ok());
        assert!(matches!(
            decode(2, &[0x01, 0x02]),
            Err(ProtocolError::BadMsgpack { frame: 2, .. })
        ));
        assert!(decode(0, &[]).is_err());
        assert!(decode(0, &[0xdc, 0xff, 0xff]).is_err(), "truncated array accepted");
    }

    #[test]
    fn fields_find_and_report_missing() {
        let v = map(vec![("a", Value::from(1)), ("b", Value::Nil)]);
        let f = Fields::of("key", &v).unwrap();
        assert_eq!(int("x", f.req("a").unwrap()).unwrap(), 1);
        assert!(f.get("zz").is_none());
        assert_eq!(f.req("zz").unwrap_err().to_string(), "key.zz: missing");
    }
}
