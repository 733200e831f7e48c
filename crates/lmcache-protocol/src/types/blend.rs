//! CacheBlend's payload types: a fingerprint match and the unified lookup's answer.

use rmpv::Value;

use crate::error::ProtocolError;
use crate::value::{self, Fields};

/// LMCache's `CBMatchResult`: a stored chunk found in the request, `[old_st, old_ed)` where it
/// sat when stored and `[cur_st, cur_ed)` where the same tokens are now; `hash` is its chunk
/// hash (the stored request's prefix-chain hash, the object key's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CbMatch {
    /// First stored position.
    pub old_st: u64,
    /// End of the stored range.
    pub old_ed: u64,
    /// First position in the request.
    pub cur_st: u64,
    /// End of the range in the request.
    pub cur_ed: u64,
    /// The chunk hash.
    pub hash: Vec<u8>,
}

impl CbMatch {
    /// Decodes one match map.
    pub fn decode(field: &str, v: &Value) -> Result<Self, ProtocolError> {
        let f = Fields::of(field, v)?;
        let pos = |name: &str| value::u64_(&f.path(name), f.req(name)?);
        Ok(Self {
            old_st: pos("old_st")?,
            old_ed: pos("old_ed")?,
            cur_st: pos("cur_st")?,
            cur_ed: pos("cur_ed")?,
            hash: value::bin(&f.path("hash"), f.req("hash")?)?.to_vec(),
        })
    }

    /// The map, keys in LMCache's order.
    pub fn encode(&self) -> Value {
        value::map(vec![
            ("old_st", Value::from(self.old_st)),
            ("old_ed", Value::from(self.old_ed)),
            ("cur_st", Value::from(self.cur_st)),
            ("cur_ed", Value::from(self.cur_ed)),
            ("hash", Value::Binary(self.hash.clone())),
        ])
    }
}

/// A list of matches.
pub fn decode_matches(field: &str, v: &Value) -> Result<Vec<CbMatch>, ProtocolError> {
    value::array(field, v)?
        .iter()
        .enumerate()
        .map(|(i, m)| CbMatch::decode(&format!("{field}[{i}]"), m))
        .collect()
}

/// LMCache's `CBUnifiedLookupResult`: the prefix the cache covers, the matches beyond it
/// (ascending, not overlapping) and, with segmented prefixes, the chunks kept past a gap.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CbUnifiedLookupResult {
    /// Leading tokens served as a prefix.
    pub prefix_coverage_tokens: u64,
    /// Matches outside the prefix.
    pub non_prefix_segments: Vec<CbMatch>,
    /// Chunks past a gap in the prefix, at their own positions.
    pub segmented_prefix_segments: Vec<CbMatch>,
}

impl CbUnifiedLookupResult {
    /// The map.
    pub fn encode(&self) -> Value {
        let list = |m: &[CbMatch]| Value::Array(m.iter().map(CbMatch::encode).collect());
        value::map(vec![
            ("prefix_coverage_tokens", Value::from(self.prefix_coverage_tokens)),
            ("non_prefix_segments", list(&self.non_prefix_segments)),
            ("segmented_prefix_segments", list(&self.segmented_prefix_segments)),
        ])
    }

    /// Decodes the map (the client's side).
    pub fn decode(field: &str, v: &Value) -> Result<Self, ProtocolError> {
        let f = Fields::of(field, v)?;
        Ok(Self {
            prefix_coverage_tokens: value::u64_(
                &f.path("prefix_coverage_tokens"),
                f.req("prefix_coverage_tokens")?,
            )?,
            non_prefix_segments: decode_matches(
                &f.path("non_prefix_segments"),
                f.req("non_prefix_segments")?,
            )?,
            segmented_prefix_segments: decode_matches(
                &f.path("segmented_prefix_segments"),
                f.req("segmented_prefix_segments")?,
            )?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_match_is_lmcaches_map_byte_for_byte() {
        // LMCache 0.5.6's encoding of CBMatchResult(256, 512, 300, 556, b"\x01\x02").
        let lmcache = "85a66f6c645f7374cd0100a66f6c645f6564cd0200a66375725f7374cd012ca66375725f6564cd022ca468617368c4020102";
        let m = CbMatch { old_st: 256, old_ed: 512, cur_st: 300, cur_ed: 556, hash: vec![1, 2] };
        let bytes = value::encode(&m.encode());
        assert_eq!(hex::encode(&bytes), lmcache);
        assert_eq!(CbMatch::decode("m", &value::decode(0, &bytes).unwrap()).unwrap(), m);
        let bad = value::map(vec![("old_st", Value::from(-1))]);
        assert!(CbMatch::decode("m", &bad).unwrap_err().to_string().contains("m.old_st"));
    }
}
