//! The self-checking blob every byte-storing adapter writes.
//!
//! ```text
//!  0  magic "LMRSBLB1"        8 bytes
//!  8  version                 u16 (1)
//! 10  codec id                u8
//! 11  flags                   u8 (0)
//! 12  key length              u16   (the wire key that follows the fixed part)
//! 14  reserved                u16 (0)
//! 16  payload length          u64   (encoded bytes after the header)
//! 24  raw length              u64   (bytes after decoding)
//! 32  payload checksum        u64   (xxh3-64 of the encoded payload)
//! 40  reserved                16 bytes (0)
//! 56  header checksum         u64   (xxh3-64 of bytes 0..56 and the key)
//! 64  wire key                key length bytes
//!     payload                 payload length bytes
//! ```
//! All integers are little-endian. A reader checks, in order: length, magic, version, header
//! checksum, that the stored key is the key asked for, codec, payload length and payload
//! checksum. Any mismatch is a [`BlobError`], which every caller turns into a miss.

use std::sync::{Arc, OnceLock};

use bytes::{Bytes, BytesMut};
use lmcache_core::ObjectKey;
use twox_hash::XxHash3_64;

use crate::wire_key;

/// xxh3-64 (seed 0) with the SIMD level picked at run time (AVX2 where the CPU has it).
pub(crate) fn xxh3_64(bytes: &[u8]) -> u64 {
    XxHash3_64::oneshot(bytes)
}

/// A payload's xxh3-64 over the pieces a reader fills (or a writer writes) one after the
/// other: each piece is hashed right beside its copy, while it is still in the CPU's cache,
/// instead of in a second pass over the whole payload from memory. The result equals
/// `xxh3_64` of the pieces joined.
pub struct PieceHasher(XxHash3_64);

impl PieceHasher {
    /// Bytes a reader fills before it hashes them: well within a core's L2 cache.
    pub const PIECE: usize = 256 << 10;

    /// A hasher over nothing yet.
    pub fn new() -> Self {
        Self(XxHash3_64::with_seed(0))
    }

    /// Hashes the next piece.
    pub fn piece(&mut self, bytes: &[u8]) {
        std::hash::Hasher::write(&mut self.0, bytes);
    }

    /// The hash of every piece so far, in order.
    pub fn finish(&self) -> u64 {
        std::hash::Hasher::finish(&self.0)
    }

    /// Fills `dest` a piece at a time, `fill(offset, piece)` writing each piece in place, and
    /// hashes each piece right after it lands; returns the hash of `dest`.
    pub fn fill<E>(
        dest: &mut [u8],
        mut fill: impl FnMut(usize, &mut [u8]) -> Result<(), E>,
    ) -> Result<u64, E> {
        let mut h = Self::new();
        for (i, piece) in dest.chunks_mut(Self::PIECE).enumerate() {
            fill(i * Self::PIECE, piece)?;
            h.piece(piece);
        }
        Ok(h.finish())
    }

    /// Copies `src` into `dest` (equal lengths) a piece at a time, hashing each piece of
    /// `dest` right after it is written; returns the hash of `dest`.
    pub fn copy(dest: &mut [u8], src: &[u8]) -> u64 {
        let filled = Self::fill(dest, |at, piece| {
            piece.copy_from_slice(&src[at..at + piece.len()]);
            Ok::<(), std::convert::Infallible>(())
        });
        match filled {
            Ok(h) => h,
        }
    }
}

impl Default for PieceHasher {
    fn default() -> Self {
        Self::new()
    }
}

/// The blob magic.
pub const MAGIC: &[u8; 8] = b"LMRSBLB1";
/// The blob format version.
pub const VERSION: u16 = 1;
/// Size of the fixed part of the header.
pub const FIXED_HEADER: usize = 64;

/// Why stored bytes were refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum BlobError {
    /// Fewer bytes than the header or the header's lengths say.
    #[error("truncated: {got} bytes, {need} needed")]
    Truncated {
        /// Bytes present.
        got: usize,
        /// Bytes the header implies.
        need: usize,
    },
    /// More bytes than the header says (a stale tail, or not our blob).
    #[error("{extra} unexpected trailing bytes")]
    Trailing {
        /// Bytes beyond the payload.
        extra: usize,
    },
    /// Not a blob of ours.
    #[error("bad magic {got:02x?}, expected {:02x?}", MAGIC)]
    Magic {
        /// The first 8 bytes found.
        got: [u8; 8],
    },
    /// A format version this build does not read.
    #[error("unsupported version {got}, this build reads {expected}")]
    Version {
        /// Version in the blob.
        got: u16,
        /// The version this build reads.
        expected: u16,
    },
    /// The header does not match its checksum.
    #[error("header checksum {got:#018x}, expected {expected:#018x}")]
    HeaderChecksum {
        /// Checksum recorded in the header.
        expected: u64,
        /// Checksum of the header as read.
        got: u64,
    },
    /// The blob belongs to another key (misplaced or a hash-slot collision).
    #[error("blob is for key {found}, not {expected}")]
    WrongKey {
        /// The key asked for (wire form).
        expected: String,
        /// The key recorded in the blob.
        found: String,
    },
    /// The payload does not match its checksum.
    #[error("payload checksum {got:#018x}, expected {expected:#018x}")]
    PayloadChecksum {
        /// Checksum recorded in the header.
        expected: u64,
        /// Checksum of the payload as read.
        got: u64,
    },
    /// The blob was written with a codec this adapter is not configured for.
    #[error("codec {found} in blob, adapter uses {expected}")]
    Codec {
        /// Codec id found.
        found: u8,
        /// Codec id expected.
        expected: u8,
    },
    /// The codec could not decode the payload (includes failed authentication).
    #[error("decode failed: {0}")]
    Decode(String),
    /// The decoded object is not the size the reader expects.
    #[error("raw length {found}, expected {expected}")]
    RawLength {
        /// Length in the blob.
        found: u64,
        /// Length expected.
        expected: u64,
    },
}

/// An encoded object: the header (with the key) and the payload, kept apart so that a store
/// can write the payload straight from L1 memory.
///
/// The header is sealed lazily: its payload checksum is an xxh3 pass over the payload, which
/// a writer that copies the payload anyway can compute piece by piece as it writes
/// (`Blob::seal_with`), while each piece is in cache, instead of a separate pass from memory
/// before the write. Every other reader of [`Blob::header`] seals it on first use. Clones
/// share the sealed header.
#[derive(Debug, Clone)]
pub struct Blob {
    /// The header with its two checksums still zero: fixed part plus key.
    unsealed: Bytes,
    sealed: Arc<OnceLock<Bytes>>,
    /// Encoded payload.
    pub payload: Bytes,
}

impl Blob {
    /// The blob of an encoded `payload` of `key` (`raw_len` bytes decoded).
    pub fn new(key: &ObjectKey, codec: u8, payload: Bytes, raw_len: u64) -> Self {
        Self {
            unsealed: unsealed_header(key, codec, payload.len() as u64, raw_len),
            sealed: Arc::default(),
            payload,
        }
    }

    /// A blob from a header as given (tests of adapters that only move bytes).
    #[cfg(test)]
    pub(crate) fn from_parts(header: Bytes, payload: Bytes) -> Self {
        Self { unsealed: header.clone(), sealed: Arc::new(OnceLock::from(header)), payload }
    }

    /// The header, sealed (its payload checksum computed) on first use.
    pub fn header(&self) -> &Bytes {
        self.sealed.get_or_init(|| seal(&self.unsealed, xxh3_64(&self.payload)))
    }

    /// The header if it is sealed already.
    pub fn sealed_header(&self) -> Option<&Bytes> {
        self.sealed.get()
    }

    /// The header's length (known before it is sealed).
    pub fn header_len(&self) -> usize {
        self.unsealed.len()
    }

    /// The header sealed with `payload_xxh3`, which the caller computed over exactly
    /// [`Blob::payload`] as it wrote it ([`PieceHasher`]). Only this crate's writers call it.
    pub(crate) fn seal_with(&self, payload_xxh3: u64) -> Bytes {
        let h = seal(&self.unsealed, payload_xxh3);
        // A concurrent sealer computed the same bytes from the same payload.
        let _ = self.sealed.set(h.clone());
        h
    }

    /// Writes the whole blob into `buf` ([`Blob::len`] bytes): the payload, hashed piece by
    /// piece as it is copied when the header is not sealed yet, then the header.
    pub(crate) fn write_into(&self, buf: &mut [u8]) {
        let (h, p) = (self.header_len(), self.payload.len());
        let header = match self.sealed_header() {
            Some(sealed) => {
                buf[h..h + p].copy_from_slice(&self.payload);
                sealed.clone()
            }
            None => self.seal_with(PieceHasher::copy(&mut buf[h..h + p], &self.payload)),
        };
        buf[..h].copy_from_slice(&header);
    }

    /// Total stored length.
    pub fn len(&self) -> usize {
        self.header_len() + self.payload.len()
    }

    /// Whether the blob is empty (never true for a well-formed blob).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Header and payload in one buffer (one copy), for stores that need contiguous bytes.
    pub fn to_contiguous(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(self.len());
        b.extend_from_slice(self.header());
        b.extend_from_slice(&self.payload);
        b.freeze()
    }
}

/// The parsed, verified header of a blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Codec id.
    pub codec: u8,
    /// Length of the header including the key.
    pub header_len: usize,
    /// Encoded payload length.
    pub payload_len: u64,
    /// Decoded length.
    pub raw_len: u64,
    /// xxh3-64 of the payload.
    pub payload_checksum: u64,
    /// The key the blob was written for.
    pub wire_key: String,
}

impl Header {
    /// Total blob length the header implies.
    pub fn blob_len(&self) -> u64 {
        self.header_len as u64 + self.payload_len
    }
}

/// Builds the header of an encoded payload.
pub fn header(key: &ObjectKey, codec: u8, payload: &[u8], raw_len: u64) -> Bytes {
    seal(&unsealed_header(key, codec, payload.len() as u64, raw_len), xxh3_64(payload))
}

/// A header with both checksums zero.
fn unsealed_header(key: &ObjectKey, codec: u8, payload_len: u64, raw_len: u64) -> Bytes {
    let wk = wire_key::encode(key);
    let key_len = u16::try_from(wk.len()).unwrap_or(u16::MAX);
    let wk = &wk.as_bytes()[..key_len as usize];
    let mut h = BytesMut::zeroed(FIXED_HEADER + wk.len());
    h[0..8].copy_from_slice(MAGIC);
    h[8..10].copy_from_slice(&VERSION.to_le_bytes());
    h[10] = codec;
    h[12..14].copy_from_slice(&key_len.to_le_bytes());
    h[16..24].copy_from_slice(&payload_len.to_le_bytes());
    h[24..32].copy_from_slice(&raw_len.to_le_bytes());
    h[FIXED_HEADER..].copy_from_slice(wk);
    h.freeze()
}

/// `unsealed` with the payload checksum `payload_xxh3` and its header checksum filled in.
fn seal(unsealed: &[u8], payload_xxh3: u64) -> Bytes {
    let mut h = BytesMut::from(unsealed);
    h[32..40].copy_from_slice(&payload_xxh3.to_le_bytes());
    let sum = header_checksum(&h[..56], &unsealed[FIXED_HEADER..]);
    h[56..64].copy_from_slice(&sum.to_le_bytes());
    h.freeze()
}

fn header_checksum(fixed: &[u8], key: &[u8]) -> u64 {
    use std::hash::Hasher;
    let mut x = XxHash3_64::new();
    x.write(fixed);
    x.write(key);
    x.finish()
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Parses and checks a header at the start of `bytes` (which may hold only the header):
/// magic, version and header checksum. The key is not compared here.
pub fn parse_header(bytes: &[u8]) -> Result<Header, BlobError> {
    if bytes.len() < FIXED_HEADER {
        return Err(BlobError::Truncated { got: bytes.len(), need: FIXED_HEADER });
    }
    if &bytes[0..8] != MAGIC {
        let mut got = [0u8; 8];
        got.copy_from_slice(&bytes[0..8]);
        return Err(BlobError::Magic { got });
    }
    let version = u16::from_le_bytes([bytes[8], bytes[9]]);
    if version != VERSION {
        return Err(BlobError::Version { got: version, expected: VERSION });
    }
    let key_len = u16::from_le_bytes([bytes[12], bytes[13]]) as usize;
    let header_len = FIXED_HEADER + key_len;
    if bytes.len() < header_len {
        return Err(BlobError::Truncated { got: bytes.len(), need: header_len });
    }
    let key = &bytes[FIXED_HEADER..header_len];
    let (expected, got) = (u64_at(bytes, 56), header_checksum(&bytes[..56], key));
    if got != expected {
        return Err(BlobError::HeaderChecksum { expected, got });
    }
    Ok(Header {
        codec: bytes[10],
        header_len,
        payload_len: u64_at(bytes, 16),
        raw_len: u64_at(bytes, 24),
        payload_checksum: u64_at(bytes, 32),
        wire_key: String::from_utf8_lossy(key).into_owned(),
    })
}

/// Length of the header of any blob for `key` (the fixed part plus the wire key).
pub fn header_len(key: &ObjectKey) -> usize {
    FIXED_HEADER + wire_key::encode(key).len().min(u16::MAX as usize)
}

/// Verifies a blob read back in two parts (header, payload) for `key`: the same checks as
/// [`verify`].
pub fn verify_parts(key: &ObjectKey, header: &[u8], payload: &[u8]) -> Result<Header, BlobError> {
    verify_parts_hashed(key, header, payload, None)
}

/// [`verify_parts`], where `payload_xxh3`, when given, is the payload's xxh3-64 as the reader
/// computed it over the bytes in `payload` while filling them ([`PieceHasher`]): the payload
/// is then not read again.
pub fn verify_parts_hashed(
    key: &ObjectKey,
    header: &[u8],
    payload: &[u8],
    payload_xxh3: Option<u64>,
) -> Result<Header, BlobError> {
    let h = parse_header(header)?;
    let expected = wire_key::encode(key);
    if h.wire_key.as_bytes() != &expected.as_bytes()[..expected.len().min(u16::MAX as usize)] {
        return Err(BlobError::WrongKey { expected, found: h.wire_key });
    }
    if header.len() != h.header_len {
        return Err(BlobError::Truncated { got: header.len(), need: h.header_len });
    }
    if payload.len() as u64 != h.payload_len {
        return Err(BlobError::RawLength { found: payload.len() as u64, expected: h.payload_len });
    }
    let got = payload_xxh3.unwrap_or_else(|| xxh3_64(payload));
    if got != h.payload_checksum {
        return Err(BlobError::PayloadChecksum { expected: h.payload_checksum, got });
    }
    Ok(h)
}

/// Verifies a whole blob read back for `key`; returns the header and the (still encoded)
/// payload slice.
pub fn verify<'a>(key: &ObjectKey, bytes: &'a [u8]) -> Result<(Header, &'a [u8]), BlobError> {
    let h = parse_header(bytes)?;
    let expected = wire_key::encode(key);
    if h.wire_key.as_bytes() != &expected.as_bytes()[..expected.len().min(u16::MAX as usize)] {
        return Err(BlobError::WrongKey { expected, found: h.wire_key });
    }
    let need = usize::try_from(h.blob_len()).unwrap_or(usize::MAX);
    if bytes.len() < need {
        return Err(BlobError::Truncated { got: bytes.len(), need });
    }
    if bytes.len() > need {
        return Err(BlobError::Trailing { extra: bytes.len() - need });
    }
    let payload = &bytes[h.header_len..];
    let got = xxh3_64(payload);
    if got != h.payload_checksum {
        return Err(BlobError::PayloadChecksum { expected: h.payload_checksum, got });
    }
    Ok((h, payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_is_xxh3_64_bit_for_bit_so_blobs_of_earlier_builds_still_verify() {
        assert_eq!(xxh3_64(b""), 0x2D06_8005_38D3_94C2); // the reference empty-input vector
        let data: Vec<u8> =
            (0..(3 << 20) + 7).map(|i: u32| i.wrapping_mul(2_654_435_761) as u8).collect();
        for len in [0, 1, 3, 16, 17, 128, 129, 240, 241, 1024, 4096, 65_536, 1 << 20, data.len()] {
            assert_eq!(xxh3_64(&data[..len]), xxhash_rust::xxh3::xxh3_64(&data[..len]), "{len}");
        }
        let mut x = xxhash_rust::xxh3::Xxh3::new();
        x.update(&data[..56]);
        x.update(&data[56..130]);
        assert_eq!(header_checksum(&data[..56], &data[56..130]), x.digest());
    }

    #[test]
    fn pieces_hash_as_the_whole_payload_and_a_wrong_hash_is_refused() {
        let data: Vec<u8> =
            (0..(1 << 20) + 13).map(|i: u32| i.wrapping_mul(2_654_435_761) as u8).collect();
        for len in [0, 1, 240, 241, PieceHasher::PIECE, PieceHasher::PIECE + 1, data.len()] {
            for piece in [1000, PieceHasher::PIECE] {
                let mut h = PieceHasher::new();
                data[..len].chunks(piece).for_each(|p| h.piece(p));
                assert_eq!(h.finish(), xxh3_64(&data[..len]), "{len} in pieces of {piece}");
            }
        }
        let k = key("");
        let b = blob(&k, &data);
        let hl = header_len(&k);
        let (hdr, payload) = (&b[..hl], &b[hl..]);
        assert!(verify_parts_hashed(&k, hdr, payload, Some(xxh3_64(payload))).is_ok());
        // A reader's hash that differs from the header's is a checksum failure, whatever the
        // payload bytes say.
        assert!(matches!(
            verify_parts_hashed(&k, hdr, payload, Some(xxh3_64(payload) ^ 1)),
            Err(BlobError::PayloadChecksum { .. })
        ));
    }

    #[test]
    fn a_header_sealed_late_or_by_a_writer_is_the_header_sealed_at_once() {
        let k = key("s");
        let payload = Bytes::from((0..300_000u32).map(|i| i as u8).collect::<Vec<u8>>());
        let want = header(&k, 2, &payload, 7);
        let b = Blob::new(&k, 2, payload.clone(), 7);
        assert_eq!(b.header_len(), want.len());
        assert_eq!(b.len(), want.len() + payload.len());
        assert!(b.sealed_header().is_none(), "nothing hashed before a reader asks");
        let twin = b.clone();
        assert_eq!(b.header(), &want);
        assert_eq!(twin.sealed_header(), Some(&want), "clones share the sealed header");
        // A writer's piecewise hash seals the same header.
        let w = Blob::new(&k, 2, payload.clone(), 7);
        let mut h = PieceHasher::new();
        payload.chunks(PieceHasher::PIECE / 3).for_each(|p| h.piece(p));
        assert_eq!(w.seal_with(h.finish()), want);
        assert_eq!(w.header(), &want);
        let mut whole = want.to_vec();
        whole.extend_from_slice(&payload);
        assert!(verify(&k, &whole).is_ok());
        // Written whole into a buffer: the same bytes whether the copy seals the header or it
        // was sealed before.
        for blob in [Blob::new(&k, 2, payload.clone(), 7), w] {
            let mut buf = vec![0u8; blob.len()];
            blob.write_into(&mut buf);
            assert_eq!(buf, whole);
            assert_eq!(blob.sealed_header(), Some(&want));
        }
    }

    fn key(salt: &str) -> ObjectKey {
        ObjectKey::new([7; 32], "m", 1, 0, 0, salt).unwrap()
    }

    fn blob(k: &ObjectKey, payload: &[u8]) -> Vec<u8> {
        let mut v = header(k, 0, payload, payload.len() as u64).to_vec();
        v.extend_from_slice(payload);
        v
    }

    #[test]
    fn round_trip() {
        let k = key("");
        let b = blob(&k, b"hello kv");
        let (h, p) = verify(&k, &b).unwrap();
        assert_eq!(p, b"hello kv");
        assert_eq!(h.raw_len, 8);
        assert_eq!(h.blob_len() as usize, b.len());
    }

    #[test]
    fn every_single_bit_flip_is_refused() {
        let k = key("s");
        let b = blob(&k, &[0x5a; 40]);
        for i in 0..b.len() {
            for bit in 0..8 {
                let mut c = b.clone();
                c[i] ^= 1 << bit;
                assert!(verify(&k, &c).is_err(), "flip at byte {i} bit {bit} accepted");
            }
        }
    }

    #[test]
    fn split_verification_matches_whole_verification() {
        let k = key("t");
        let b = blob(&k, &[3; 500]);
        let hl = header_len(&k);
        assert!(verify_parts(&k, &b[..hl], &b[hl..]).is_ok());
        for i in 0..b.len() {
            let mut c = b.clone();
            c[i] ^= 0x40;
            assert!(verify_parts(&k, &c[..hl], &c[hl..]).is_err(), "flip at {i} accepted");
        }
        assert!(verify_parts(&k, &b[..hl], &b[hl..b.len() - 1]).is_err());
        assert!(verify_parts(&key("u"), &b[..hl], &b[hl..]).is_err());
    }

    #[test]
    fn torn_stale_foreign_and_misplaced_are_refused() {
        let k = key("");
        let b = blob(&k, &[1; 100]);
        for cut in [0, 10, 63, 64 + 10, b.len() - 1] {
            assert!(matches!(verify(&k, &b[..cut]), Err(BlobError::Truncated { .. })), "{cut}");
        }
        let mut longer = b.clone();
        longer.push(0);
        assert_eq!(verify(&k, &longer).unwrap_err(), BlobError::Trailing { extra: 1 });
        assert_eq!(verify(&k, &[0u8; 200]).unwrap_err(), BlobError::Magic { got: [0; 8] });
        assert!(matches!(verify(&key("other"), &b), Err(BlobError::WrongKey { .. })));
    }
}
