//! Lookup-hash log lines (`lookup_hashes_*.jsonl`, one per lookup), as LMCache's server and
//! `lmcache-rs server --lookup-hash-log-dir` write them.

use serde::Deserialize;

/// One lookup, as a log line has it (absent fields take LMCache's defaults).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct LookupLine {
    /// Unix seconds.
    #[serde(default)]
    pub timestamp: f64,
    /// The request.
    #[serde(default)]
    pub request_id: String,
    /// The model.
    #[serde(default)]
    pub model_name: String,
    /// Tokens per chunk.
    #[serde(default = "one")]
    pub chunk_size: u64,
    /// Tokens of the request, with its partial last chunk.
    #[serde(default)]
    pub seq_len: u64,
    /// Dtype of each stored part.
    #[serde(default)]
    pub dtypes: Vec<String>,
    /// Shape of each stored part.
    #[serde(default)]
    pub shapes: Vec<Vec<u64>>,
    /// The request's chunk hashes, in prefix order.
    #[serde(default)]
    pub chunk_hashes: Vec<String>,
}

fn one() -> u64 {
    1
}

/// A line that is not a lookup event.
#[derive(Debug, thiserror::Error)]
#[error("{source_name}:{line}: {error}")]
pub struct ParseError {
    /// Which input.
    pub source_name: String,
    /// 1-based line number.
    pub line: usize,
    /// What was wrong.
    pub error: String,
}

/// The events of one file's text (blank lines skipped), filtered to `model` when given.
pub fn parse_lines(
    source_name: &str,
    text: &str,
    model: Option<&str>,
) -> Result<Vec<LookupLine>, ParseError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let e: LookupLine = serde_json::from_str(line).map_err(|e| ParseError {
            source_name: source_name.to_owned(),
            line: i + 1,
            error: e.to_string(),
        })?;
        if model.is_none_or(|m| m == e.model_name) {
            out.push(e);
        }
    }
    Ok(out)
}

/// Bytes per element of a dtype name, with or without torch's `torch.` prefix.
pub fn dtype_bytes(name: &str) -> Option<u64> {
    let bare = name.strip_prefix("torch.").unwrap_or(name);
    Some(match bare {
        "float64" | "double" | "int64" | "long" => 8,
        "float32" | "float" | "int32" | "int" => 4,
        "float16" | "half" | "bfloat16" | "int16" | "short" => 2,
        "float8_e4m3fn" | "float8_e5m2" | "float8_e4m3fnuz" | "float8_e5m2fnuz" | "uint8"
        | "int8" | "bool" => 1,
        _ => return None,
    })
}

/// KV bytes one chunk occupies: the sum over the event's stored parts of elements × element
/// size. `None` when it names no parts or a dtype this does not know.
pub fn kv_bytes_per_chunk(e: &LookupLine) -> Option<u64> {
    if e.shapes.is_empty() || e.dtypes.is_empty() {
        return None;
    }
    e.shapes.iter().zip(&e.dtypes).try_fold(0u64, |acc, (shape, dt)| {
        let elems = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
        acc.checked_add(elems.checked_mul(dtype_bytes(dt)?)?)
    })
}

/// A test event: model `m`, chunks of `chunk_size` tokens named `hashes`, `seq_len` tokens.
#[cfg(test)]
pub(crate) fn test_event(chunk_size: u64, hashes: Vec<String>, seq_len: u64) -> LookupLine {
    LookupLine {
        timestamp: 0.0,
        request_id: String::new(),
        model_name: "m".into(),
        chunk_size,
        seq_len,
        dtypes: Vec::new(),
        shapes: Vec::new(),
        chunk_hashes: hashes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse_with_defaults_and_both_dtype_spellings_size_a_chunk() {
        let text = r#"{"timestamp": 1.5, "request_id": "a", "model_name": "m", "chunk_size": 256, "seq_len": 513, "dtypes": ["torch.float16"], "shapes": [[2, 32, 256, 1024]], "chunk_hashes": ["0x01", "0x02"]}

{"model_name": "other", "chunk_hashes": []}"#;
        let all = parse_lines("f", text, None).unwrap();
        assert_eq!(all.len(), 2);
        assert_eq!(kv_bytes_per_chunk(&all[0]), Some(2 * 32 * 256 * 1024 * 2));
        assert_eq!(all[1].chunk_size, 1, "LMCache's default");
        assert_eq!(parse_lines("f", text, Some("m")).unwrap().len(), 1);
        let mut e = all[0].clone();
        e.dtypes = vec!["bfloat16".into()];
        assert_eq!(kv_bytes_per_chunk(&e), Some(2 * 32 * 256 * 1024 * 2));
        e.dtypes = vec!["complex32".into()];
        assert_eq!(kv_bytes_per_chunk(&e), None);
        let err = parse_lines("f.jsonl", "{\"seq_len\": \"x\"}", None).unwrap_err();
        assert!(err.to_string().starts_with("f.jsonl:1:"), "{err}");
    }
}
