//! Element types of KV tensors, named as PyTorch names them on the wire (`"float16"`,
//! `"bfloat16"`, ... without the `torch.` prefix), and the shapes of stored objects
//! ([`ObjectLayout`], [`ObjectShape`]).

use std::fmt;
use std::str::FromStr;

/// A tensor element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// IEEE half.
    Float16,
    /// bfloat16.
    BFloat16,
    /// IEEE single.
    Float32,
    /// IEEE double.
    Float64,
    /// fp8 e4m3 (finite-only variant).
    Float8E4M3Fn,
    /// fp8 e5m2.
    Float8E5M2,
    /// signed byte.
    Int8,
    /// unsigned byte.
    UInt8,
    /// 16-bit int.
    Int16,
    /// 32-bit int.
    Int32,
    /// 64-bit int.
    Int64,
}

const NAMES: &[(Dtype, &str, u64)] = &[
    (Dtype::Float16, "float16", 2),
    (Dtype::BFloat16, "bfloat16", 2),
    (Dtype::Float32, "float32", 4),
    (Dtype::Float64, "float64", 8),
    (Dtype::Float8E4M3Fn, "float8_e4m3fn", 1),
    (Dtype::Float8E5M2, "float8_e5m2", 1),
    (Dtype::Int8, "int8", 1),
    (Dtype::UInt8, "uint8", 1),
    (Dtype::Int16, "int16", 2),
    (Dtype::Int32, "int32", 4),
    (Dtype::Int64, "int64", 8),
];

impl Dtype {
    /// Bytes per element.
    pub fn itemsize(self) -> u64 {
        NAMES.iter().find(|(d, _, _)| *d == self).map_or(1, |(_, _, s)| *s)
    }

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        NAMES.iter().find(|(d, _, _)| *d == self).map_or("?", |(_, n, _)| n)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown dtype name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown dtype {0:?}")]
pub struct UnknownDtype(pub String);

impl FromStr for Dtype {
    type Err = UnknownDtype;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let name = s.strip_prefix("torch.").unwrap_or(s);
        let name = match name {
            "half" => "float16",
            "float" => "float32",
            "double" => "float64",
            other => other,
        };
        NAMES
            .iter()
            .find(|(_, n, _)| *n == name)
            .map(|(d, _, _)| *d)
            .ok_or_else(|| UnknownDtype(s.to_owned()))
    }
}

/// Shape of one stored object: `[kv, layers, slots, hidden]` (`kv` = 2, or 1 for MLA).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectLayout {
    /// K and V planes (2) or one (MLA).
    pub kv: u64,
    /// Layers.
    pub layers: u64,
    /// Token slots per chunk.
    pub slots: u64,
    /// Elements per token per layer (heads x head size).
    pub hidden: u64,
    /// Element type.
    pub dtype: Dtype,
}

impl ObjectLayout {
    /// Bytes of one object; `None` on overflow.
    pub fn bytes(&self) -> Option<u64> {
        self.kv
            .checked_mul(self.layers)?
            .checked_mul(self.slots)?
            .checked_mul(self.hidden)?
            .checked_mul(self.dtype.itemsize())
    }

    /// The object's tensor shape as the wire describes it.
    pub fn shape(&self) -> Vec<u64> {
        if self.kv == 1 {
            vec![self.layers, self.slots, self.hidden]
        } else {
            vec![self.kv, self.layers, self.slots, self.hidden]
        }
    }
}

/// One stored object of an object group: its kernel groups' parts back to back, each a
/// dense `[kv, layers, slots, hidden]` tensor of its own dtype, in kernel-group order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectShape {
    /// The parts (never empty).
    pub parts: Vec<ObjectLayout>,
    /// Chunks a prefix needs from this group: `None` for full attention (all of them),
    /// `Some(w)` for a sliding window of `w` chunks (1 for recurrent state).
    pub window_chunks: Option<u64>,
    /// Whether the group holds recurrent state (Mamba, linear attention).
    pub recurrent: bool,
}

impl ObjectShape {
    /// One full-attention part.
    pub fn single(layout: ObjectLayout) -> Self {
        Self { parts: vec![layout], window_chunks: None, recurrent: false }
    }

    /// Bytes of one object; `None` on overflow.
    pub fn bytes(&self) -> Option<u64> {
        self.parts.iter().try_fold(0u64, |acc, p| acc.checked_add(p.bytes()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_with_and_without_prefix() {
        assert_eq!("float16".parse::<Dtype>().unwrap(), Dtype::Float16);
        assert_eq!("torch.bfloat16".parse::<Dtype>().unwrap(), Dtype::BFloat16);
        assert_eq!("half".parse::<Dtype>().unwrap().itemsize(), 2);
        assert!("complex64".parse::<Dtype>().is_err());
        for (d, n, _) in NAMES {
            assert_eq!(n.parse::<Dtype>().unwrap(), *d);
        }
    }
}
