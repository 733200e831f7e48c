//! The `.lct` file: frames of a 4-byte big-endian length and a msgpack body. The first frame
//! is the [`Header`] (a map tagged `"type": "header"`, as msgspec writes LMCache's tagged
//! struct), every later one a [`Record`] (`"type": "record"`).
//!
//! Reading is as forgiving as LMCache's reader where it must be and stricter where it helps:
//! - the header must be whole, with magic `LMCT`, format version 1 and trace schema 1;
//! - a torn last frame (a recorder killed mid-write) ends the records, noted in
//!   [`TraceReader::truncated`];
//! - a frame that does not decode as a record is skipped and counted
//!   ([`TraceReader::malformed`]);
//! - a length past [`MAX_FRAME`] is taken as damage (no allocation of what a bad prefix says).

use std::io::{self, Read, Write};

use rmpv::Value;

/// The magic bytes of every trace file's header.
pub const MAGIC: &[u8; 4] = b"LMCT";
/// The framing version LMCache 0.5.6 writes and reads.
pub const FORMAT_VERSION: i64 = 1;
/// The captured-API version LMCache 0.5.6 writes and reads.
pub const TRACE_SCHEMA_VERSION: i64 = 1;
/// Largest frame read (LMCache's prefix allows 4 GiB; no real record comes near this).
pub const MAX_FRAME: u32 = 256 << 20;

/// What a trace file records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// Storage-manager calls (`reserve_write`, `submit_prefetch_task`, ...), for `trace replay`.
    Storage,
    /// The cache-event stream a server sends its coordinator, for `trace replay-events`.
    Events,
}

impl Level {
    /// LMCache's name of the level.
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Storage => "storage",
            Level::Events => "events",
        }
    }

    /// Parses LMCache's name of a level.
    pub fn parse(s: &str) -> Option<Level> {
        match s {
            "storage" => Some(Level::Storage),
            "events" => Some(Level::Events),
            _ => None,
        }
    }
}

/// The header frame.
#[derive(Debug, Clone, PartialEq)]
pub struct Header {
    /// The level as written (LMCache's reader accepts any; replays check it).
    pub level: String,
    /// `time.monotonic()` of the recorder's start; record times are relative to it.
    pub t_mono_start: f64,
    /// Unix seconds of the recorder's start.
    pub t_wall_start: f64,
    /// The recording side's storage configuration as JSON, or empty.
    pub sm_config_json: String,
    /// SHA-256 (hex) of `sm_config_json`, or empty.
    pub sm_config_digest: String,
    /// Level metadata (events: `instance_id`, `cache_event_schema_version`,
    /// `lmcache_version`), in file order.
    pub level_meta: Vec<(String, Value)>,
}

/// One recorded call or event.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// Seconds since the header's `t_mono_start`.
    pub t_mono: f64,
    /// Unix seconds when it happened.
    pub t_wall: f64,
    /// What it is: a storage-manager method's qualified name, `events.batch` or
    /// `events.lifecycle`.
    pub qualname: String,
    /// Its arguments, codec-encoded (a msgpack map; see [`super::codec`]).
    pub args: Value,
}

impl Record {
    /// The argument `name`, if the args are a map holding it.
    pub fn arg(&self, name: &str) -> Option<&Value> {
        map_get(&self.args, name)
    }
}

/// Why a trace file cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// Reading failed.
    #[error("cannot read the trace: {0}")]
    Io(#[from] io::Error),
    /// The file holds no header frame.
    #[error("the trace is empty (no header frame)")]
    Empty,
    /// The header frame is cut short.
    #[error("the trace's header frame is truncated: {0}")]
    TruncatedHeader(String),
    /// The header frame does not decode.
    #[error("the trace's header does not decode: {0}")]
    BadHeader(String),
    /// Not a trace file.
    #[error("bad magic {0:?} (expected \"LMCT\"): not an LMCache trace file")]
    BadMagic(String),
    /// A format version this build does not read.
    #[error("unsupported format_version {0} (this build reads {FORMAT_VERSION})")]
    FormatVersion(i64),
    /// A schema version this build does not read.
    #[error("unsupported trace_schema_version {0} (this build reads {TRACE_SCHEMA_VERSION})")]
    SchemaVersion(i64),
}

/// The value of `key` in `map`, if `map` is a map with a string key `key`.
pub fn map_get<'a>(map: &'a Value, key: &str) -> Option<&'a Value> {
    match map {
        Value::Map(entries) => {
            entries.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
        }
        _ => None,
    }
}

fn as_f64(v: &Value) -> Option<f64> {
    match v {
        Value::F64(f) => Some(*f),
        Value::F32(f) => Some(f64::from(*f)),
        Value::Integer(i) => i.as_f64(),
        _ => None,
    }
}

fn as_string(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => s.as_str().map(str::to_owned),
        _ => None,
    }
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
    out
}

fn encode(v: &Value) -> Vec<u8> {
    let mut body = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut body, v);
    body
}

fn s(v: &str) -> Value {
    Value::from(v)
}

impl Header {
    /// A header for a recording that starts now, at `level`.
    pub fn new(level: Level, t_mono_start: f64, t_wall_start: f64) -> Self {
        Self {
            level: level.as_str().to_owned(),
            t_mono_start,
            t_wall_start,
            sm_config_json: String::new(),
            sm_config_digest: String::new(),
            level_meta: Vec::new(),
        }
    }

    /// The frame's msgpack body, fields in LMCache's order (an empty `level_meta` is
    /// omitted, as msgspec's `omit_defaults` does).
    pub fn to_msgpack(&self) -> Vec<u8> {
        let mut m = vec![
            (s("type"), s("header")),
            (s("magic"), Value::Binary(MAGIC.to_vec())),
            (s("format_version"), Value::from(FORMAT_VERSION)),
            (s("level"), s(&self.level)),
            (s("trace_schema_version"), Value::from(TRACE_SCHEMA_VERSION)),
            (s("t_mono_start"), Value::F64(self.t_mono_start)),
            (s("t_wall_start"), Value::F64(self.t_wall_start)),
            (s("sm_config_json"), s(&self.sm_config_json)),
            (s("sm_config_digest"), s(&self.sm_config_digest)),
        ];
        if !self.level_meta.is_empty() {
            let meta = self.level_meta.iter().map(|(k, v)| (s(k), v.clone())).collect();
            m.push((s("level_meta"), Value::Map(meta)));
        }
        encode(&Value::Map(m))
    }

    fn from_value(v: &Value) -> Result<Self, TraceError> {
        let bad = |what: &str| TraceError::BadHeader(what.to_owned());
        if !matches!(v, Value::Map(_)) {
            return Err(bad("the header frame is not a map"));
        }
        match map_get(v, "type").and_then(Value::as_str) {
            Some("header") | None => {}
            Some(other) => return Err(TraceError::BadHeader(format!("frame type {other:?}"))),
        }
        let magic = match map_get(v, "magic") {
            Some(Value::Binary(b)) => b.clone(),
            Some(Value::String(s)) => s.as_bytes().to_vec(),
            _ => return Err(bad("no magic")),
        };
        if magic != MAGIC {
            return Err(TraceError::BadMagic(String::from_utf8_lossy(&magic).into_owned()));
        }
        let int = |name: &str| {
            map_get(v, name)
                .and_then(Value::as_i64)
                .ok_or_else(|| TraceError::BadHeader(format!("no integer {name}")))
        };
        let version = int("format_version")?;
        if version != FORMAT_VERSION {
            return Err(TraceError::FormatVersion(version));
        }
        let schema = int("trace_schema_version")?;
        if schema != TRACE_SCHEMA_VERSION {
            return Err(TraceError::SchemaVersion(schema));
        }
        let float = |name: &str| {
            map_get(v, name)
                .and_then(as_f64)
                .ok_or_else(|| TraceError::BadHeader(format!("no number {name}")))
        };
        let string = |name: &str| {
            map_get(v, name)
                .and_then(as_string)
                .ok_or_else(|| TraceError::BadHeader(format!("no string {name}")))
        };
        let level_meta = match map_get(v, "level_meta") {
            None => Vec::new(),
            Some(Value::Map(entries)) => entries
                .iter()
                .filter_map(|(k, v)| Some((k.as_str()?.to_owned(), v.clone())))
                .collect(),
            Some(_) => return Err(bad("level_meta is not a map")),
        };
        Ok(Self {
            level: string("level")?,
            t_mono_start: float("t_mono_start")?,
            t_wall_start: float("t_wall_start")?,
            sm_config_json: string("sm_config_json")?,
            sm_config_digest: string("sm_config_digest")?,
            level_meta,
        })
    }

    /// The level, when it is one this build knows.
    pub fn known_level(&self) -> Option<Level> {
        Level::parse(&self.level)
    }

    /// A level-meta value.
    pub fn meta(&self, key: &str) -> Option<&Value> {
        self.level_meta.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

impl Record {
    /// The frame's msgpack body, in LMCache's field order.
    pub fn to_msgpack(&self) -> Vec<u8> {
        encode(&Value::Map(vec![
            (s("type"), s("record")),
            (s("t_mono"), Value::F64(self.t_mono)),
            (s("t_wall"), Value::F64(self.t_wall)),
            (s("qualname"), s(&self.qualname)),
            (s("args"), self.args.clone()),
        ]))
    }

    fn from_value(v: &Value) -> Option<Self> {
        if map_get(v, "type").and_then(Value::as_str).is_some_and(|t| t != "record") {
            return None;
        }
        let args = map_get(v, "args")?.clone();
        if !matches!(args, Value::Map(_)) {
            return None;
        }
        Some(Self {
            t_mono: map_get(v, "t_mono").and_then(as_f64)?,
            t_wall: map_get(v, "t_wall").and_then(as_f64)?,
            qualname: map_get(v, "qualname").and_then(as_string)?,
            args,
        })
    }
}

/// Writes frames to `W`, each with one `write_all` (LMCache writes each frame with a single
/// write, so concurrent appenders below `PIPE_BUF` cannot interleave).
#[derive(Debug)]
pub struct TraceWriter<W: Write> {
    out: W,
    header_written: bool,
}

impl<W: Write> TraceWriter<W> {
    /// A writer over `out`; nothing is written until [`TraceWriter::write_header`].
    pub fn new(out: W) -> Self {
        Self { out, header_written: false }
    }

    /// Writes the header frame (once; later calls write nothing).
    pub fn write_header(&mut self, header: &Header) -> io::Result<()> {
        if self.header_written {
            return Ok(());
        }
        self.out.write_all(&frame(&header.to_msgpack()))?;
        self.header_written = true;
        Ok(())
    }

    /// Whether the header has been written.
    pub fn header_written(&self) -> bool {
        self.header_written
    }

    /// Appends one record frame (the header must be written first).
    pub fn write_record(&mut self, record: &Record) -> io::Result<()> {
        if !self.header_written {
            return Err(io::Error::other("trace record before the header"));
        }
        self.out.write_all(&frame(&record.to_msgpack()))
    }

    /// Flushes the underlying writer.
    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    /// The underlying writer.
    pub fn into_inner(self) -> W {
        self.out
    }
}

enum Frame {
    Body(Vec<u8>),
    End,
    Torn(String),
}

fn read_frame<R: Read>(r: &mut R, offset: &mut u64) -> io::Result<Frame> {
    let mut prefix = [0u8; 4];
    let got = read_full(r, &mut prefix)?;
    if got == 0 {
        return Ok(Frame::End);
    }
    if got < 4 {
        return Ok(Frame::Torn(format!("truncated frame length prefix at offset {offset}")));
    }
    let len = u32::from_be_bytes(prefix);
    if len > MAX_FRAME {
        return Ok(Frame::Torn(format!(
            "frame length {len} at offset {offset} is past the {MAX_FRAME}-byte limit"
        )));
    }
    let mut body = vec![0u8; len as usize];
    let got = read_full(r, &mut body)?;
    if got < body.len() {
        return Ok(Frame::Torn(format!(
            "truncated frame body at offset {} (got {got} of {len})",
            *offset + 4
        )));
    }
    *offset += 4 + u64::from(len);
    Ok(Frame::Body(body))
}

fn read_full<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Reads a trace: the header at once, then records one frame at a time (no whole-file load).
#[derive(Debug)]
pub struct TraceReader<R: Read> {
    input: R,
    header: Header,
    offset: u64,
    malformed: u64,
    truncated: Option<String>,
    done: bool,
}

impl<R: Read> TraceReader<R> {
    /// Reads and checks the header.
    pub fn new(mut input: R) -> Result<Self, TraceError> {
        let mut offset = 0;
        let body = match read_frame(&mut input, &mut offset)? {
            Frame::Body(b) => b,
            Frame::End => return Err(TraceError::Empty),
            Frame::Torn(why) => return Err(TraceError::TruncatedHeader(why)),
        };
        let value = rmpv::decode::read_value(&mut body.as_slice())
            .map_err(|e| TraceError::BadHeader(e.to_string()))?;
        let header = Header::from_value(&value)?;
        Ok(Self { input, header, offset, malformed: 0, truncated: None, done: false })
    }

    /// The header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Frames skipped because they were not records.
    pub fn malformed(&self) -> u64 {
        self.malformed
    }

    /// Why reading stopped early, when the file ends inside a frame.
    pub fn truncated(&self) -> Option<&str> {
        self.truncated.as_deref()
    }

    /// The next record; `Ok(None)` at the end (or at a torn last frame).
    pub fn next_record(&mut self) -> io::Result<Option<Record>> {
        while !self.done {
            match read_frame(&mut self.input, &mut self.offset)? {
                Frame::End => self.done = true,
                Frame::Torn(why) => {
                    self.truncated = Some(why);
                    self.done = true;
                }
                Frame::Body(body) => {
                    let rec = rmpv::decode::read_value(&mut body.as_slice())
                        .ok()
                        .and_then(|v| Record::from_value(&v));
                    match rec {
                        Some(r) => return Ok(Some(r)),
                        None => self.malformed += 1,
                    }
                }
            }
        }
        Ok(None)
    }

    /// Every remaining record.
    pub fn read_all(&mut self) -> io::Result<Vec<Record>> {
        let mut out = Vec::new();
        while let Some(r) = self.next_record()? {
            out.push(r);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(i: u32) -> Record {
        Record {
            t_mono: f64::from(i) * 0.5,
            t_wall: 1.7e9 + f64::from(i),
            qualname: format!("q{i}"),
            args: Value::Map(vec![(s("n"), Value::from(i))]),
        }
    }

    fn file(n: u32) -> Vec<u8> {
        let mut w = TraceWriter::new(Vec::new());
        let mut h = Header::new(Level::Events, 12.5, 1.7e9);
        h.level_meta.push(("instance_id".into(), s("a")));
        w.write_header(&h).unwrap();
        for i in 0..n {
            w.write_record(&record(i)).unwrap();
        }
        w.into_inner()
    }

    #[test]
    fn round_trip_keeps_header_and_records() {
        let bytes = file(3);
        let mut r = TraceReader::new(bytes.as_slice()).unwrap();
        assert_eq!(r.header().level, "events");
        assert_eq!(r.header().meta("instance_id"), Some(&s("a")));
        assert_eq!(r.header().t_mono_start, 12.5);
        let recs = r.read_all().unwrap();
        assert_eq!(recs, (0..3).map(record).collect::<Vec<_>>());
        assert!(r.truncated().is_none());
        assert_eq!(recs[2].arg("n"), Some(&Value::from(2)));
    }

    #[test]
    fn a_torn_tail_ends_the_records_and_is_reported() {
        let bytes = file(3);
        for cut in 1..8 {
            let torn = &bytes[..bytes.len() - cut];
            let mut r = TraceReader::new(torn).unwrap();
            assert_eq!(r.read_all().unwrap().len(), 2, "cut {cut}");
            assert!(r.truncated().is_some(), "cut {cut}");
        }
    }

    #[test]
    fn a_bad_record_frame_is_skipped_and_counted() {
        let mut bytes = file(1);
        bytes.extend_from_slice(&frame(&encode(&Value::from(7))));
        bytes.extend_from_slice(&frame(&record(9).to_msgpack()));
        let mut r = TraceReader::new(bytes.as_slice()).unwrap();
        let recs = r.read_all().unwrap();
        assert_eq!(recs.len(), 2);
        assert_eq!(r.malformed(), 1);
    }

    #[test]
    fn headers_that_are_not_ours_are_refused_by_name() {
        assert!(matches!(TraceReader::new(&[][..]), Err(TraceError::Empty)));
        assert!(matches!(
            TraceReader::new(&[0, 0, 0, 9, 1][..]),
            Err(TraceError::TruncatedHeader(_))
        ));
        let mut h = Value::Map(vec![
            (s("type"), s("header")),
            (s("magic"), Value::Binary(b"NOPE".to_vec())),
        ]);
        let e = TraceReader::new(frame(&encode(&h)).as_slice()).unwrap_err();
        assert!(matches!(e, TraceError::BadMagic(_)), "{e}");
        if let Value::Map(m) = &mut h {
            m[1].1 = Value::Binary(MAGIC.to_vec());
            m.push((s("format_version"), Value::from(2)));
            m.push((s("trace_schema_version"), Value::from(1)));
        }
        let e = TraceReader::new(frame(&encode(&h)).as_slice()).unwrap_err();
        assert!(matches!(e, TraceError::FormatVersion(2)), "{e}");
        // A length prefix claiming more than the limit is damage, not an allocation.
        let e = TraceReader::new(&[0xff, 0xff, 0xff, 0xff][..]).unwrap_err();
        assert!(matches!(e, TraceError::TruncatedHeader(_)), "{e}");
    }

    #[test]
    fn an_empty_level_meta_is_omitted_as_msgspec_does() {
        let h = Header::new(Level::Storage, 0.0, 0.0);
        let v = rmpv::decode::read_value(&mut h.to_msgpack().as_slice()).unwrap();
        assert!(map_get(&v, "level_meta").is_none());
        assert_eq!(map_get(&v, "type").and_then(Value::as_str), Some("header"));
    }
}
