//! The KV event log behind `subscribe_kv_events` (LMCache 0.5.6 `modules/kv_events.py`).
//!
//! Records are appended when chunks of shard 0 become resident ("stored", one record per
//! chunk, with its tokens and its parent chunk's hash) and when resident objects leave L1
//! ("removed", the chunk hashes of one model). The log is bounded; a subscriber whose cursor
//! fell off its start is told `lost` and must withdraw earlier announcements, as is one that
//! comes back to a different `incarnation` (a restarted server).

use std::collections::VecDeque;
use std::time::{SystemTime, UNIX_EPOCH};

use lmcache_core::{ChunkHash, ObjectKey};
use lmcache_l1::L1Listener;
use lmcache_protocol::value::map;
use parking_lot::Mutex;
use rmpv::Value;

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Chunks became resident.
    Stored,
    /// Chunks left.
    Removed,
}

/// One record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Sequence number, from 1.
    pub seq: u64,
    /// What happened.
    pub kind: Kind,
    /// The model.
    pub model: String,
    /// The chunk hashes.
    pub hashes: Vec<ChunkHash>,
    /// The preceding chunk's hash (stored records; `None` for a sequence's first chunk).
    pub parent: Option<ChunkHash>,
    /// The chunk's tokens (stored records).
    pub tokens: Vec<u32>,
}

/// One page of records for a subscriber.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// False when the channel is off (ends the stream).
    pub enabled: bool,
    /// Changes when the server restarts.
    pub incarnation: u64,
    /// Cursor to resume from.
    pub next_cursor: u64,
    /// Records were lost between the cursor and this batch.
    pub lost: bool,
    /// The records.
    pub events: Vec<Record>,
}

impl Batch {
    /// `KVEventBatch` as msgpack.
    pub fn to_value(&self) -> Value {
        let events = self
            .events
            .iter()
            .map(|r| {
                map(vec![
                    ("seq", Value::from(r.seq)),
                    (
                        "kind",
                        Value::from(if r.kind == Kind::Stored { "stored" } else { "removed" }),
                    ),
                    ("medium", Value::from("CPU")),
                    ("model_name", Value::from(r.model.as_str())),
                    (
                        "block_hashes",
                        Value::Array(
                            r.hashes.iter().map(|h| Value::Binary(h.0.to_vec())).collect(),
                        ),
                    ),
                    (
                        "parent_block_hash",
                        r.parent.map_or(Value::Nil, |h| Value::Binary(h.0.to_vec())),
                    ),
                    ("token_ids", Value::Array(r.tokens.iter().map(|&t| Value::from(t)).collect())),
                ])
            })
            .collect();
        map(vec![
            ("enabled", Value::Boolean(self.enabled)),
            ("incarnation", Value::from(self.incarnation)),
            ("next_cursor", Value::from(self.next_cursor)),
            ("lost", Value::Boolean(self.lost)),
            ("events", Value::Array(events)),
        ])
    }
}

#[derive(Debug)]
struct Inner {
    log: VecDeque<Record>,
    next_seq: u64,
}

/// The bounded event log.
#[derive(Debug)]
pub struct KvEventLog {
    capacity: usize,
    incarnation: u64,
    inner: Mutex<Inner>,
}

impl KvEventLog {
    /// A log keeping the last `capacity` records (0 disables the channel).
    pub fn new(capacity: usize) -> Self {
        let incarnation =
            SystemTime::now().duration_since(UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
        Self {
            capacity,
            incarnation,
            inner: Mutex::new(Inner { log: VecDeque::new(), next_seq: 1 }),
        }
    }

    /// True when records are kept.
    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    fn append(
        &self,
        kind: Kind,
        model: &str,
        hashes: Vec<ChunkHash>,
        parent: Option<ChunkHash>,
        tokens: Vec<u32>,
    ) {
        if !self.enabled() {
            return;
        }
        let mut g = self.inner.lock();
        let seq = g.next_seq;
        g.next_seq += 1;
        if g.log.len() == self.capacity {
            g.log.pop_front();
        }
        g.log.push_back(Record { seq, kind, model: model.to_owned(), hashes, parent, tokens });
    }

    /// A chunk of shard 0 became resident.
    pub fn stored(&self, model: &str, hash: ChunkHash, parent: Option<ChunkHash>, tokens: &[u32]) {
        self.append(Kind::Stored, model, vec![hash], parent, tokens.to_vec());
    }

    /// Records after `cursor` for `model`, at most `max`.
    pub fn read(&self, model: &str, cursor: u64, max: usize) -> Batch {
        let mut batch = Batch {
            enabled: self.enabled(),
            incarnation: self.incarnation,
            next_cursor: 0,
            lost: false,
            events: Vec::new(),
        };
        if !self.enabled() {
            return batch;
        }
        let g = self.inner.lock();
        let last = g.next_seq - 1;
        let first = g.log.front().map_or(last + 1, |r| r.seq);
        // The cursor comes from the wire: any u64, including u64::MAX.
        let after = cursor.saturating_add(1);
        batch.lost = after < first || cursor > last;
        batch.next_cursor = cursor.min(last);
        let skip = usize::try_from(after.saturating_sub(first)).unwrap_or(usize::MAX);
        for r in g.log.iter().skip(skip) {
            batch.next_cursor = r.seq;
            if r.model == model {
                batch.events.push(r.clone());
                if batch.events.len() == max {
                    break;
                }
            }
        }
        batch
    }

    /// Records kept.
    pub fn len(&self) -> usize {
        self.inner.lock().log.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl L1Listener for KvEventLog {
    fn removed(&self, key: &ObjectKey) {
        self.append(Kind::Removed, key.model_name.as_str(), vec![key.chunk_hash], None, Vec::new());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> ChunkHash {
        ChunkHash([i; 32])
    }

    #[test]
    fn reads_page_filter_and_report_loss() {
        let log = KvEventLog::new(3);
        log.stored("m", h(1), None, &[1, 2]);
        log.stored("other", h(2), None, &[3]);
        log.stored("m", h(3), Some(h(1)), &[4]);
        let b = log.read("m", 0, 10);
        assert!(!b.lost);
        assert_eq!(b.events.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!(b.next_cursor, 3);
        assert_eq!(log.read("m", 0, 1).next_cursor, 1, "a page stops at max");
        assert!(log.read("m", 3, 10).events.is_empty());
        log.stored("m", h(4), Some(h(3)), &[5]);
        log.stored("m", h(5), Some(h(4)), &[6]);
        // Record 2 fell off the start: a reader at cursor 1 lost some.
        let b = log.read("m", 1, 10);
        assert!(b.lost);
        assert!(log.read("m", 99, 10).lost, "a cursor from the future means a restart");
        // The largest cursor the wire can carry (this overflowed, panicking the socket thread
        // in debug builds).
        let b = log.read("m", u64::MAX, 10);
        assert!(b.lost && b.events.is_empty());
        assert_eq!(b.next_cursor, 5);
    }

    #[test]
    fn batch_encodes_like_lmcache() {
        let log = KvEventLog::new(8);
        log.stored("m", h(1), None, &[7]);
        let v = log.read("m", 0, 8).to_value();
        let text = v.to_string();
        for field in [
            "enabled",
            "incarnation",
            "next_cursor",
            "lost",
            "block_hashes",
            "parent_block_hash",
            "\"stored\"",
            "\"CPU\"",
        ] {
            assert!(text.contains(field), "{field} missing in {text}");
        }
        assert!(!KvEventLog::new(0).read("m", 0, 8).enabled);
    }
}
