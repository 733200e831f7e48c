//! `--kvcache-shape-spec`, LMCache's grammar: groups separated by `;`, each
//! `(kv_size,NB,BS,NH,HS):dtype:layers` (kv_size 2 for K/V, 1 for MLA; NB blocks of BS tokens;
//! NH heads of HS elements), layers numbered in declaration order.

use lmcache_core::Dtype;

/// One group of layers sharing a geometry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeGroup {
    /// 2 for K and V planes, 1 for MLA's single latent.
    pub kv_size: u64,
    /// Paged blocks.
    pub num_blocks: u64,
    /// Tokens per block.
    pub block_size: u64,
    /// Heads.
    pub num_heads: u64,
    /// Elements per head.
    pub head_size: u64,
    /// Element type.
    pub dtype: Dtype,
    /// Layers of this geometry.
    pub layers: u64,
}

impl ShapeGroup {
    /// Whether the group is MLA (`kv_size` 1).
    pub fn is_mla(&self) -> bool {
        self.kv_size == 1
    }

    /// A layer tensor's shape: `[kv, NB, BS, NH, HS]`, or `[NB, BS, NH*HS]` for MLA (the
    /// rank-3 layout LMCache's bench allocates).
    pub fn tensor_shape(&self) -> Vec<u64> {
        if self.is_mla() {
            vec![self.num_blocks, self.block_size, self.num_heads * self.head_size]
        } else {
            vec![self.kv_size, self.num_blocks, self.block_size, self.num_heads, self.head_size]
        }
    }

    /// Bytes of one block of one plane of one layer.
    pub fn block_bytes(&self) -> u64 {
        self.block_size * self.num_heads * self.head_size * self.dtype.itemsize()
    }

    /// Bytes of one layer tensor.
    pub fn layer_bytes(&self) -> u64 {
        self.kv_size * self.num_blocks * self.block_bytes()
    }

    /// KV bytes per token of the group, all layers.
    pub fn bytes_per_token(&self) -> u64 {
        self.layers * self.kv_size * self.num_heads * self.head_size * self.dtype.itemsize()
    }
}

fn dtype(s: &str) -> Result<Dtype, String> {
    Ok(match s.trim().to_ascii_lowercase().as_str() {
        "float16" | "half" => Dtype::Float16,
        "bfloat16" => Dtype::BFloat16,
        "float32" | "float" => Dtype::Float32,
        "uint8" => Dtype::UInt8,
        other => {
            return Err(format!("unknown dtype {other:?} (float16, bfloat16, float32, uint8)"));
        }
    })
}

/// Parses a spec; every group must share NB and BS (LMCache's rule). An NB or BS of 0 takes
/// the fallback (`--num-blocks`, `--block-size`), as LMCache's spec does; a positive one
/// overrides it, and each such override is returned as a note naming the flag.
pub fn parse_with(
    spec: &str,
    num_blocks: u64,
    block_size: u64,
) -> Result<(Vec<ShapeGroup>, Vec<String>), String> {
    let mut groups = parse_raw(spec)?;
    let mut notes = Vec::new();
    if let Some(first) = groups.first() {
        let (nb, bs) = (first.num_blocks, first.block_size);
        if nb != 0 && nb != num_blocks {
            notes.push(format!("spec nb={nb} overrides --num-blocks={num_blocks}"));
        }
        if bs != 0 && bs != block_size {
            notes.push(format!("spec bs={bs} overrides --block-size={block_size}"));
        }
    }
    for g in &mut groups {
        if g.num_blocks == 0 {
            g.num_blocks = num_blocks;
        }
        if g.block_size == 0 {
            g.block_size = block_size;
        }
        if g.num_blocks == 0 || g.block_size == 0 {
            return Err(
                "NB and BS must be positive (in the spec or by --num-blocks and --block-size)"
                    .into(),
            );
        }
    }
    Ok((groups, notes))
}

/// Parses a spec whose NB and BS are given (the default flags' values fill any 0).
#[cfg(test)]
fn parse(spec: &str) -> Result<Vec<ShapeGroup>, String> {
    parse_with(spec, 1024, 16).map(|(g, _)| g)
}

fn parse_raw(spec: &str) -> Result<Vec<ShapeGroup>, String> {
    if spec.trim().is_empty() {
        return Err("the KV shape specification cannot be empty".into());
    }
    let mut out: Vec<ShapeGroup> = Vec::new();
    for g in spec.split(';') {
        let g = g.trim();
        let bad =
            |why: &str| format!("group {g:?}: {why}; expected (kv_size,NB,BS,NH,HS):dtype:layers");
        let rest = g.strip_prefix('(').ok_or_else(|| bad("no '('"))?;
        let (dims, tail) = rest.split_once(')').ok_or_else(|| bad("no ')'"))?;
        let dims: Vec<u64> = dims
            .split(',')
            .map(|d| d.trim().parse::<u64>().map_err(|_| bad(&format!("{d:?} is not a number"))))
            .collect::<Result<_, _>>()?;
        let [kv_size, num_blocks, block_size, num_heads, head_size] = dims[..] else {
            return Err(bad(&format!("{} dimensions", dims.len())));
        };
        let mut parts =
            tail.strip_prefix(':').ok_or_else(|| bad("no ':' after the shape"))?.split(':');
        let dt = dtype(parts.next().unwrap_or(""))?;
        let layers: u64 = parts
            .next()
            .and_then(|l| l.trim().parse().ok())
            .filter(|&l| l > 0)
            .ok_or_else(|| bad("no positive layer count"))?;
        if parts.next().is_some() {
            return Err(bad("extra fields"));
        }
        if !(kv_size == 1 || kv_size == 2) {
            return Err(bad("kv_size must be 1 (MLA) or 2"));
        }
        if [num_heads, head_size].contains(&0) {
            return Err(bad("NH and HS must be positive"));
        }
        if let Some(first) = out.first()
            && (first.num_blocks != num_blocks || first.block_size != block_size)
        {
            return Err(bad("every group must share NB and BS"));
        }
        out.push(ShapeGroup {
            kv_size,
            num_blocks,
            block_size,
            num_heads,
            head_size,
            dtype: dt,
            layers,
        });
    }
    Ok(out)
}

/// LMCache's default shape: 32 layers of K/V, 8 heads of 128, fp16, 1024 blocks of 16.
pub const DEFAULT: &str = "(2,1024,16,8,128):float16:32";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lmcaches_examples_parse() {
        let g = parse(DEFAULT).unwrap();
        assert_eq!(g.len(), 1);
        assert_eq!(g[0].tensor_shape(), vec![2, 1024, 16, 8, 128]);
        // A 256-token chunk of the default model is 32 MiB.
        assert_eq!(g[0].bytes_per_token() * 256, 32 << 20);
        let g = parse("(2,1024,16,8,128):float16:30;(1,1024,16,4,64):bfloat16:2").unwrap();
        assert_eq!((g[1].is_mla(), g[1].tensor_shape()), (true, vec![1024, 16, 256]));
        assert_eq!(parse("(2,1024,16,8,128):uint8:32").unwrap()[0].dtype, Dtype::UInt8);
    }

    #[test]
    fn bad_specs_name_what_is_wrong() {
        for (spec, want) in [
            ("", "empty"),
            ("(2,1024,16,8):float16:32", "4 dimensions"),
            ("(2,1024,16,8,128):int4:32", "unknown dtype"),
            ("(2,1024,16,8,128):float16:0", "layer count"),
            ("(3,1024,16,8,128):float16:1", "kv_size"),
            ("(2,1024,16,8,128):float16:1;(2,512,16,8,128):float16:1", "share NB and BS"),
            ("2,1024,16,8,128:float16:1", "no '('"),
        ] {
            let e = parse(spec).unwrap_err();
            assert!(e.contains(want), "{spec:?}: {e}");
        }
    }

    #[test]
    fn nb_and_bs_flags_fill_a_zero_and_are_named_when_overridden() {
        let (g, notes) = parse_with("(2,0,0,8,128):float16:2", 512, 32).unwrap();
        assert_eq!((g[0].num_blocks, g[0].block_size), (512, 32));
        assert!(notes.is_empty(), "{notes:?}");
        let (g, notes) = parse_with("(2,1024,16,8,128):float16:2", 512, 16).unwrap();
        assert_eq!(g[0].num_blocks, 1024);
        assert_eq!(notes, vec!["spec nb=1024 overrides --num-blocks=512".to_string()]);
        assert!(parse_with("(2,0,16,8,128):float16:2", 0, 16).is_err());
        assert!(parse_with("(2,16,16,0,128):float16:2", 16, 16).is_err());
    }
}
