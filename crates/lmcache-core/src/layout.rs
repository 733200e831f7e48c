//! Element types of KV tensors, named as PyTorch names them on the wire (`"float16"`,
//! `"bfloat16"`, ... without the `torch.` prefix).

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
