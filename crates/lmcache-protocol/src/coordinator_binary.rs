//! Cache-event batches in a binary layout, for the NATS JetStream feed, where lmcache-rs owns
//! both ends (LMCache's coordinator only speaks JSON over HTTP, which stays as it is).
//!
//! A message is `LMRSEVB1`, a batch count, then per batch: its header (instance id,
//! incarnation, seq, event type, tier, backend, shared, ts, capacity, capacity revision), a
//! table of the namespaces its entries use (model, packed kv_rank, object group, cache salt),
//! and its entries: the raw 32-byte chunk hash, a namespace index, bytes, token offset and the
//! tokens. Integers are little-endian; strings are a `u32` length and UTF-8. An entry without
//! tokens is 54 bytes where LMCache's JSON takes about 190, and decoding it allocates nothing
//! ([`BinaryBatch`] borrows the message; only tokens are gathered into one vector per batch).
//!
//! [`decode`] checks every count against the bytes left, every index against its table, every
//! enum tag and string, and refuses trailing bytes; it never panics on any input (fuzzed by
//! `fuzz/fuzz_targets/event_batch_binary.rs`). The checks [`CacheEventBatch::validate`] makes
//! on JSON batches apply here too ([`BinaryBatch::validate`]).

use std::ops::Range;

use lmcache_core::le_reader::{LeReader, Truncated};

use crate::coordinator::{
    CacheEventBatch, CacheEventEntry, CacheEventType, EncodedObjectKey, KeyNamespace, WireTier,
};

/// The first bytes of a binary message; a JSON message starts with `{`.
pub const MAGIC: &[u8; 8] = b"LMRSEVB1";

/// Why bytes are not a binary event message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BinaryError {
    /// Not this layout (or another version).
    #[error("not a binary cache-event message (bad magic)")]
    Magic,
    /// The bytes end early.
    #[error("truncated at byte {0}")]
    Truncated(usize),
    /// A value out of range: an enum tag, an index, a count, a string.
    #[error("invalid {what} at byte {at}")]
    Invalid {
        /// What.
        what: &'static str,
        /// Where.
        at: usize,
    },
    /// Bytes after the last batch.
    #[error("{0} trailing bytes")]
    Trailing(usize),
}

/// One entry: the chunk hash, its namespace (an index into the batch's table), bytes, the
/// token offset and where its tokens sit in the batch's token vector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BinaryEntry {
    /// The chunk hash.
    pub hash: [u8; 32],
    /// Index into [`BinaryBatch::namespaces`] (checked by [`decode`]).
    pub ns: u16,
    /// Bytes (store only).
    pub size_bytes: u64,
    /// Position of the chunk's first token; -1 when unknown.
    pub token_offset: i64,
    /// The chunk's tokens in [`BinaryBatch::tokens`].
    pub tokens: Range<usize>,
}

/// One decoded batch, borrowing its strings from the message.
#[derive(Debug, Clone, PartialEq)]
pub struct BinaryBatch<'a> {
    /// Emitter id.
    pub instance_id: &'a str,
    /// Emitter restart counter.
    pub incarnation: u64,
    /// Per (instance, incarnation) batch counter from 1.
    pub seq: u64,
    /// What happened.
    pub event_type: CacheEventType,
    /// `l1` or `l2`.
    pub tier: WireTier,
    /// Backend.
    pub backend: &'a str,
    /// Whether the backend is a pool several instances mount.
    pub shared: bool,
    /// Emitter wall-clock seconds.
    pub ts: f64,
    /// Config only: the compartment's capacity.
    pub capacity_bytes: u64,
    /// Config only: which declaration this batch belongs to.
    pub capacity_revision: u64,
    /// The namespaces the entries name.
    pub namespaces: Vec<KeyNamespace<'a>>,
    /// The keys.
    pub entries: Vec<BinaryEntry>,
    /// Every entry's tokens, one after another.
    pub tokens: Vec<u32>,
}

fn event_tag(t: CacheEventType) -> u8 {
    match t {
        CacheEventType::Store => 0,
        CacheEventType::Delete => 1,
        CacheEventType::Access => 2,
        CacheEventType::Config => 3,
    }
}

fn tier_tag(t: WireTier) -> u8 {
    match t {
        WireTier::L1 => 0,
        WireTier::L2 => 1,
        WireTier::All => 2,
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Why a batch cannot be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// A key's chunk hash is not 64 hex digits.
    #[error("batch {batch} entry {entry}: {message}")]
    Key {
        /// Batch index.
        batch: usize,
        /// Entry index.
        entry: usize,
        /// What is wrong.
        message: String,
    },
    /// More than 65,536 namespaces in one batch.
    #[error("batch {0} names more than 65,536 namespaces")]
    Namespaces(usize),
}

/// Encodes `batches` as one message.
pub fn encode(batches: &[CacheEventBatch]) -> Result<Vec<u8>, EncodeError> {
    let mut out =
        Vec::with_capacity(16 + batches.iter().map(|b| 128 + b.entries.len() * 58).sum::<usize>());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(batches.len() as u32).to_le_bytes());
    for (bi, b) in batches.iter().enumerate() {
        put_str(&mut out, &b.instance_id);
        out.extend_from_slice(&b.incarnation.to_le_bytes());
        out.extend_from_slice(&b.seq.to_le_bytes());
        out.push(event_tag(b.event_type));
        out.push(tier_tag(b.tier));
        put_str(&mut out, &b.backend);
        out.push(u8::from(b.shared));
        out.extend_from_slice(&b.ts.to_le_bytes());
        out.extend_from_slice(&b.capacity_bytes.to_le_bytes());
        out.extend_from_slice(&b.capacity_revision.to_le_bytes());
        // The namespace table, in first-use order (a batch rarely names more than one).
        let mut table: Vec<KeyNamespace<'_>> = Vec::new();
        let mut index: Vec<u16> = Vec::with_capacity(b.entries.len());
        for e in &b.entries {
            let ns = e.key.namespace();
            let at = match table.iter().rposition(|t| *t == ns) {
                Some(at) => at,
                None => {
                    table.push(ns);
                    table.len() - 1
                }
            };
            index.push(u16::try_from(at).map_err(|_| EncodeError::Namespaces(bi))?);
        }
        out.extend_from_slice(&(table.len() as u16).to_le_bytes());
        for k in &table {
            put_str(&mut out, k.model_name);
            out.extend_from_slice(&k.kv_rank.to_le_bytes());
            out.extend_from_slice(&k.object_group_id.to_le_bytes());
            put_str(&mut out, k.cache_salt);
        }
        out.extend_from_slice(&(b.entries.len() as u32).to_le_bytes());
        for (ei, (e, ns)) in b.entries.iter().zip(&index).enumerate() {
            let hash = e.key.chunk_hash().map_err(|message| EncodeError::Key {
                batch: bi,
                entry: ei,
                message,
            })?;
            out.extend_from_slice(&hash);
            out.extend_from_slice(&ns.to_le_bytes());
            out.extend_from_slice(&e.size_bytes.to_le_bytes());
            out.extend_from_slice(&e.token_offset.to_le_bytes());
            out.extend_from_slice(&(e.token_ids.len() as u32).to_le_bytes());
            for t in &e.token_ids {
                out.extend_from_slice(&t.to_le_bytes());
            }
        }
    }
    Ok(out)
}

impl From<Truncated> for BinaryError {
    fn from(t: Truncated) -> Self {
        BinaryError::Truncated(t.0)
    }
}

/// What this layout reads beyond [`LeReader`]'s integers.
trait ReadExt<'a> {
    /// A `u32` length and that many bytes of UTF-8, borrowed.
    fn str(&mut self) -> Result<&'a str, BinaryError>;
    /// A count of items of at least `min` bytes each, read at `at`: refused when the rest
    /// cannot hold them (so a forged count cannot make us reserve memory).
    fn fits(&self, n: usize, min: usize, at: usize) -> Result<(), BinaryError>;
}

impl<'a> ReadExt<'a> for LeReader<'a> {
    fn str(&mut self) -> Result<&'a str, BinaryError> {
        let n = self.u32()? as usize;
        let at = self.at();
        std::str::from_utf8(self.take(n)?).map_err(|_| BinaryError::Invalid { what: "string", at })
    }
    fn fits(&self, n: usize, min: usize, at: usize) -> Result<(), BinaryError> {
        if self.holds(n, min) { Ok(()) } else { Err(BinaryError::Invalid { what: "count", at }) }
    }
}

/// Decodes a message [`encode`] wrote.
pub fn decode(bytes: &[u8]) -> Result<Vec<BinaryBatch<'_>>, BinaryError> {
    let mut r = LeReader::new(bytes);
    if r.take(8).ok() != Some(&MAGIC[..]) {
        return Err(BinaryError::Magic);
    }
    let at = r.at();
    let n = r.u32()? as usize;
    r.fits(n, 60, at)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let instance_id = r.str()?;
        let incarnation = r.u64()?;
        let seq = r.u64()?;
        let at = r.at();
        let event_type = match r.u8()? {
            0 => CacheEventType::Store,
            1 => CacheEventType::Delete,
            2 => CacheEventType::Access,
            3 => CacheEventType::Config,
            _ => return Err(BinaryError::Invalid { what: "event type", at }),
        };
        let at = r.at();
        let tier = match r.u8()? {
            0 => WireTier::L1,
            1 => WireTier::L2,
            2 => WireTier::All,
            _ => return Err(BinaryError::Invalid { what: "tier", at }),
        };
        let backend = r.str()?;
        let at = r.at();
        let shared = match r.u8()? {
            0 => false,
            1 => true,
            _ => return Err(BinaryError::Invalid { what: "shared flag", at }),
        };
        let ts = f64::from_le_bytes(r.array()?);
        let capacity_bytes = r.u64()?;
        let capacity_revision = r.u64()?;
        let at = r.at();
        let n_ns = r.u16()? as usize;
        r.fits(n_ns, 16, at)?;
        let mut namespaces = Vec::with_capacity(n_ns);
        for _ in 0..n_ns {
            namespaces.push(KeyNamespace {
                model_name: r.str()?,
                kv_rank: r.u32()?,
                object_group_id: r.u32()?,
                cache_salt: r.str()?,
            });
        }
        let at = r.at();
        let n_entries = r.u32()? as usize;
        r.fits(n_entries, 54, at)?;
        let mut entries = Vec::with_capacity(n_entries);
        let mut tokens = Vec::new();
        for _ in 0..n_entries {
            let hash = r.array()?;
            let at = r.at();
            let ns = r.u16()?;
            if usize::from(ns) >= n_ns {
                return Err(BinaryError::Invalid { what: "namespace index", at });
            }
            let size_bytes = r.u64()?;
            let token_offset = r.u64()? as i64;
            let at = r.at();
            let n_tokens = r.u32()? as usize;
            r.fits(n_tokens, 4, at)?;
            let start = tokens.len();
            tokens.extend(r.take(n_tokens * 4)?.chunks_exact(4).map(|c| {
                let mut w = [0u8; 4];
                w.copy_from_slice(c);
                u32::from_le_bytes(w)
            }));
            entries.push(BinaryEntry {
                hash,
                ns,
                size_bytes,
                token_offset,
                tokens: start..tokens.len(),
            });
        }
        out.push(BinaryBatch {
            instance_id,
            incarnation,
            seq,
            event_type,
            tier,
            backend,
            shared,
            ts,
            capacity_bytes,
            capacity_revision,
            namespaces,
            entries,
            tokens,
        });
    }
    if r.remaining() > 0 {
        return Err(BinaryError::Trailing(r.remaining()));
    }
    Ok(out)
}

impl BinaryBatch<'_> {
    /// Entry `e`'s namespace.
    pub fn namespace(&self, e: &BinaryEntry) -> KeyNamespace<'_> {
        // `decode` checked every index against the table.
        self.namespaces[usize::from(e.ns)]
    }

    /// Entry `e`'s tokens.
    pub fn tokens_of(&self, e: &BinaryEntry) -> &[u32] {
        self.tokens.get(e.tokens.clone()).unwrap_or_default()
    }

    /// The checks [`CacheEventBatch::validate`] makes, on this layout.
    pub fn validate(&self) -> Result<(), String> {
        crate::coordinator::validate_batch(
            crate::coordinator::BatchHeader {
                instance_id: self.instance_id,
                backend: self.backend,
                event_type: self.event_type,
                entries: self.entries.len(),
                seq: self.seq,
                tier: self.tier,
                ts: self.ts,
            },
            self.entries.iter().map(|e| e.token_offset),
        )?;
        for (i, ns) in self.namespaces.iter().enumerate() {
            if ns.model_name.is_empty() {
                return Err(format!("namespaces[{i}].model_name must be non-empty"));
            }
            if ns.kv_rank >> 24 == 0 {
                return Err(format!(
                    "namespaces[{i}]: kv_rank {:#x} packs world size 0",
                    ns.kv_rank
                ));
            }
        }
        Ok(())
    }

    /// The same batch in the JSON contract's types (hex keys, owned strings).
    pub fn to_owned_batch(&self) -> CacheEventBatch {
        CacheEventBatch {
            instance_id: self.instance_id.to_string(),
            incarnation: self.incarnation,
            seq: self.seq,
            event_type: self.event_type,
            tier: self.tier,
            backend: self.backend.to_string(),
            entries: self
                .entries
                .iter()
                .map(|e| {
                    let ns = self.namespace(e);
                    CacheEventEntry {
                        key: EncodedObjectKey {
                            chunk_hash_hex: hex::encode(e.hash),
                            model_name: ns.model_name.to_string(),
                            kv_rank: ns.kv_rank,
                            object_group_id: ns.object_group_id,
                            cache_salt: ns.cache_salt.to_string(),
                        },
                        size_bytes: e.size_bytes,
                        token_ids: self.tokens_of(e).to_vec(),
                        token_offset: e.token_offset,
                    }
                })
                .collect(),
            shared: self.shared,
            ts: self.ts,
            capacity_bytes: self.capacity_bytes,
            capacity_revision: self.capacity_revision,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8, model: &str, salt: &str, group: u32) -> EncodedObjectKey {
        EncodedObjectKey {
            chunk_hash_hex: format!("{b:02x}").repeat(32),
            model_name: model.into(),
            kv_rank: 0x0200_0201,
            object_group_id: group,
            cache_salt: salt.into(),
        }
    }

    fn batches() -> Vec<CacheEventBatch> {
        let entry = |k, size, tokens: Vec<u32>, off| CacheEventEntry {
            key: k,
            size_bytes: size,
            token_ids: tokens,
            token_offset: off,
        };
        vec![
            CacheEventBatch {
                instance_id: "srv-1".into(),
                incarnation: 7,
                seq: 3,
                event_type: CacheEventType::Store,
                tier: WireTier::L2,
                backend: "fs".into(),
                entries: vec![
                    entry(key(1, "m", "", 0), 32 << 20, vec![1, 2, 3], 0),
                    entry(key(2, "m", "t", 0), 5, vec![], -1),
                    entry(key(3, "m", "", 1), u64::MAX, vec![9; 256], 256),
                    entry(key(4, "m", "", 0), 0, vec![], -1),
                ],
                shared: true,
                ts: 12.5,
                capacity_bytes: 0,
                capacity_revision: 0,
            },
            CacheEventBatch {
                instance_id: "srv-1".into(),
                incarnation: 7,
                seq: 4,
                event_type: CacheEventType::Config,
                tier: WireTier::L1,
                backend: "dram".into(),
                entries: vec![],
                shared: false,
                ts: 13.0,
                capacity_bytes: 1 << 30,
                capacity_revision: 2,
            },
        ]
    }

    #[test]
    fn a_message_round_trips_with_one_table_entry_per_namespace() {
        let b = batches();
        let bytes = encode(&b).unwrap();
        let d = decode(&bytes).unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].namespaces.len(), 3, "(m,''), (m,'t'), group 1");
        assert_eq!(d.iter().map(BinaryBatch::to_owned_batch).collect::<Vec<_>>(), b);
        assert!(d.iter().all(|x| x.validate().is_ok()));
        // 54 bytes per entry without tokens.
        let one = |tokens: usize| {
            let mut b = batches();
            b.truncate(1);
            b[0].entries.truncate(1);
            b[0].entries[0].token_ids = vec![0; tokens];
            encode(&b).unwrap().len()
        };
        assert_eq!(one(1) - one(0), 4);
    }

    #[test]
    fn damage_is_refused_by_name() {
        let bytes = encode(&batches()).unwrap();
        assert_eq!(decode(b"{\"batches\": []}"), Err(BinaryError::Magic));
        assert!(matches!(decode(&bytes[..bytes.len() - 1]), Err(BinaryError::Truncated(_))));
        let mut long = bytes.clone();
        long.push(0);
        assert_eq!(decode(&long), Err(BinaryError::Trailing(1)));
        // The first batch's event type tag sits after magic, count, id, incarnation and seq.
        let mut bad = bytes.clone();
        bad[8 + 4 + 4 + 5 + 16] = 9;
        assert!(matches!(decode(&bad), Err(BinaryError::Invalid { what: "event type", .. })));
        // A batch count no message could hold.
        let mut huge = bytes;
        huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(decode(&huge), Err(BinaryError::Invalid { what: "count", .. })));
    }

    #[test]
    fn a_bad_chunk_hash_is_refused_when_encoding() {
        let mut b = batches();
        b[0].entries[1].key.chunk_hash_hex = "zz".into();
        assert!(matches!(encode(&b), Err(EncodeError::Key { batch: 0, entry: 1, .. })));
    }

    proptest::proptest! {
        #[test]
        fn no_input_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..600), cut in 0usize..600) {
            let _ = decode(&bytes);
            let mut real = encode(&batches()).unwrap();
            let i = cut % real.len();
            real[i] ^= bytes.first().copied().unwrap_or(1) | 1;
            if let Ok(d) = decode(&real) {
                for b in &d {
                    let _ = b.validate();
                    let _ = b.to_owned_batch();
                }
            }
        }
    }
}
