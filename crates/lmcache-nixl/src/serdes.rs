//! NIXL's transfer-descriptor lists as bytes, both ways, and the pickle envelope LMCache's
//! NIXL channel wraps them in.
//!
//! NIXL's serializer (`nixlSerDes`) writes the intro `nixlSerDes|`, then entries of a tag, a
//! little-endian `u64` length, the value and a `|`. A transfer-descriptor list (NIXL 1.5.1) is
//! four entries: `nixlDList` = `nixlBDList`, `t` = the memory type (`u32`), `n` = the count
//! (`u64`), and an untagged entry holding `n` descriptors of 24 bytes each (address, length,
//! device id; little-endian `u64`s).
//!
//! LMCache's channel sends `nixl_agent.get_serialized_descs(descs)`, which is
//! `pickle.dumps(descs)`: a protocol-4 pickle that rebuilds `<module>.nixlXferDList` from
//! those bytes. We write exactly that shape and read back only that shape: nothing in a
//! received pickle is ever executed, and anything else is refused by name.

use crate::NixlError;

const INTRO: &[u8] = b"nixlSerDes|";
const DLIST_TAG: &[u8] = b"nixlDList";
const DLIST_KIND: &[u8] = b"nixlBDList";
const DESC_BYTES: usize = 24;
/// The most descriptors a received list may hold (a 1 TiB arena in 4 KiB pages).
pub const MAX_DESCS: usize = 1 << 28;

/// NIXL's memory types (`nixl_mem_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum MemType {
    /// Host memory: what L1 is.
    Dram = 0,
    /// GPU memory.
    Vram = 1,
    /// A block device.
    Block = 2,
    /// An object store.
    Object = 3,
    /// A file.
    File = 4,
}

impl MemType {
    fn from_u32(v: u32) -> Result<Self, NixlError> {
        Ok(match v {
            0 => Self::Dram,
            1 => Self::Vram,
            2 => Self::Block,
            3 => Self::Object,
            4 => Self::File,
            other => return Err(NixlError::descriptors(format!("memory type {other}"))),
        })
    }
}

/// One descriptor: `len` bytes at `addr` on device `dev`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    /// Address in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Device id (0 for DRAM).
    pub dev: u64,
}

/// A transfer-descriptor list, owned on our side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescList {
    /// Where the descriptors point.
    pub mem: MemType,
    /// The descriptors, in order (a prepped list is indexed by position).
    pub descs: Vec<Desc>,
}

impl DescList {
    /// `[base, base + size)` cut into `page`-byte descriptors, as LMCache's channel lists the
    /// whole L1 (a last partial page is cut short, as Python's `range` gives it).
    pub fn pages(base: u64, size: u64, page: u64) -> Result<Self, NixlError> {
        if page == 0 {
            return Err(NixlError::descriptors("a page of 0 bytes".into()));
        }
        let count = size.div_ceil(page);
        if count > MAX_DESCS as u64 {
            return Err(NixlError::descriptors(format!("{count} pages, more than {MAX_DESCS}")));
        }
        let descs = (0..count)
            .map(|i| Desc { addr: base + i * page, len: page.min(size - i * page), dev: 0 })
            .collect();
        Ok(Self { mem: MemType::Dram, descs })
    }

    /// NIXL's serialized form.
    pub fn to_serdes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(INTRO.len() + 64 + self.descs.len() * DESC_BYTES);
        out.extend_from_slice(INTRO);
        entry(&mut out, DLIST_TAG, DLIST_KIND);
        entry(&mut out, b"t", &(self.mem as u32).to_le_bytes());
        entry(&mut out, b"n", &(self.descs.len() as u64).to_le_bytes());
        let mut raw = Vec::with_capacity(self.descs.len() * DESC_BYTES);
        for d in &self.descs {
            raw.extend_from_slice(&d.addr.to_le_bytes());
            raw.extend_from_slice(&d.len.to_le_bytes());
            raw.extend_from_slice(&d.dev.to_le_bytes());
        }
        entry(&mut out, b"", &raw);
        out
    }

    /// Reads NIXL's serialized form; every length is checked against what is left.
    pub fn from_serdes(bytes: &[u8]) -> Result<Self, NixlError> {
        let mut r = Reader {
            rest: bytes
                .strip_prefix(INTRO)
                .ok_or_else(|| NixlError::descriptors("no nixlSerDes intro".into()))?,
        };
        if r.entry(DLIST_TAG)? != DLIST_KIND {
            return Err(NixlError::descriptors("not a descriptor list (nixlBDList)".into()));
        }
        let mem = MemType::from_u32(u32::from_le_bytes(fixed(r.entry(b"t")?, "t")?))?;
        let count = u64::from_le_bytes(fixed(r.entry(b"n")?, "n")?);
        let raw = r.entry(b"")?;
        if count > MAX_DESCS as u64 || raw.len() as u64 != count * DESC_BYTES as u64 {
            return Err(NixlError::descriptors(format!(
                "{count} descriptors in {} bytes",
                raw.len()
            )));
        }
        let descs = raw
            .chunks_exact(DESC_BYTES)
            .map(|c| {
                let word = |i: usize| {
                    let mut w = [0u8; 8];
                    w.copy_from_slice(&c[i * 8..i * 8 + 8]);
                    u64::from_le_bytes(w)
                };
                Desc { addr: word(0), len: word(1), dev: word(2) }
            })
            .collect();
        Ok(Self { mem, descs })
    }

    /// The pickle LMCache's channel sends for this list: `module` is the NIXL package the
    /// reading side imports (`nixl_cu12._bindings` for the nixl-cu12 wheel).
    pub fn to_pickle(&self, module: &str) -> Vec<u8> {
        pickle::wrap(module, &self.to_serdes())
    }

    /// Reads a list from LMCache's pickle; returns it with the module the pickle named.
    pub fn from_pickle(bytes: &[u8]) -> Result<(Self, String), NixlError> {
        let (module, state) = pickle::unwrap(bytes)?;
        Ok((Self::from_serdes(state)?, module))
    }
}

fn entry(out: &mut Vec<u8>, tag: &[u8], value: &[u8]) {
    out.extend_from_slice(tag);
    out.extend_from_slice(&(value.len() as u64).to_le_bytes());
    out.extend_from_slice(value);
    out.push(b'|');
}

fn fixed<const N: usize>(v: &[u8], tag: &str) -> Result<[u8; N], NixlError> {
    v.try_into().map_err(|_| NixlError::descriptors(format!("entry {tag:?} of {} bytes", v.len())))
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn entry(&mut self, tag: &[u8]) -> Result<&'a [u8], NixlError> {
        let show = String::from_utf8_lossy(tag).into_owned();
        let body = self
            .rest
            .strip_prefix(tag)
            .ok_or_else(|| NixlError::descriptors(format!("entry {show:?} missing")))?;
        let (len, body) = body
            .split_first_chunk::<8>()
            .ok_or_else(|| NixlError::descriptors(format!("entry {show:?} cut short")))?;
        let len =
            usize::try_from(u64::from_le_bytes(*len)).ok().filter(|&l| l < body.len()).ok_or_else(
                || NixlError::descriptors(format!("entry {show:?} longer than the list")),
            )?;
        let (value, after) = body.split_at(len);
        self.rest = after
            .strip_prefix(b"|")
            .ok_or_else(|| NixlError::descriptors(format!("entry {show:?} not closed by '|'")))?;
        Ok(value)
    }
}

/// The one pickle shape: `PROTO 4`, `FRAME`, `SHORT_BINUNICODE module`, `MEMOIZE`,
/// `SHORT_BINUNICODE nixlXferDList`, `MEMOIZE`, `STACK_GLOBAL`, `MEMOIZE`, `EMPTY_TUPLE`,
/// `NEWOBJ`, `MEMOIZE`, the state as `SHORT_BINBYTES`/`BINBYTES`/`BINBYTES8`, `MEMOIZE`,
/// `BUILD`, `STOP` (what CPython 3.11's `pickle.dumps` writes for the bound class).
mod pickle {
    use crate::NixlError;

    const CLASS: &str = "nixlXferDList";
    const PROTO: u8 = 0x80;
    const FRAME: u8 = 0x95;
    const SHORT_BINUNICODE: u8 = 0x8c;
    const MEMOIZE: u8 = 0x94;
    const STACK_GLOBAL: u8 = 0x93;
    const EMPTY_TUPLE: u8 = b')';
    const NEWOBJ: u8 = 0x81;
    const SHORT_BINBYTES: u8 = b'C';
    const BINBYTES: u8 = b'B';
    const BINBYTES8: u8 = 0x8e;
    const BUILD: u8 = b'b';
    const STOP: u8 = b'.';
    /// CPython frames only pickles of at least this size.
    const FRAME_MIN: usize = 4;

    fn err(what: &str) -> NixlError {
        NixlError::descriptors(format!("not a pickled nixlXferDList: {what}"))
    }

    pub(super) fn wrap(module: &str, state: &[u8]) -> Vec<u8> {
        let mut body = Vec::with_capacity(state.len() + 64);
        for name in [module, CLASS] {
            body.push(SHORT_BINUNICODE);
            // Module names are short; a longer one is cut (never written as another opcode).
            let name = &name.as_bytes()[..name.len().min(255)];
            body.push(name.len() as u8);
            body.extend_from_slice(name);
            body.push(MEMOIZE);
        }
        body.extend_from_slice(&[STACK_GLOBAL, MEMOIZE, EMPTY_TUPLE, NEWOBJ, MEMOIZE]);
        let big = state.len() > u32::MAX as usize;
        if state.len() < 256 {
            body.push(SHORT_BINBYTES);
            body.push(state.len() as u8);
        } else if !big {
            body.push(BINBYTES);
            body.extend_from_slice(&(state.len() as u32).to_le_bytes());
        } else {
            body.push(BINBYTES8);
            body.extend_from_slice(&(state.len() as u64).to_le_bytes());
        }
        // CPython closes the frame before a large bytes object and writes it unframed.
        let framed_len = body.len();
        body.extend_from_slice(state);
        body.extend_from_slice(&[MEMOIZE, BUILD, STOP]);
        let mut out = Vec::with_capacity(body.len() + 11);
        out.extend_from_slice(&[PROTO, 4]);
        let framed = if state.len() < 64 * 1024 { body.len() } else { framed_len };
        if framed >= FRAME_MIN {
            out.push(FRAME);
            out.extend_from_slice(&(framed as u64).to_le_bytes());
        }
        out.extend_from_slice(&body);
        out
    }

    pub(super) fn unwrap(bytes: &[u8]) -> Result<(String, &[u8]), NixlError> {
        let mut r = Ops { rest: bytes };
        r.expect(PROTO, "no PROTO")?;
        let proto = r.byte()?;
        if !(2..=5).contains(&proto) {
            return Err(err(&format!("protocol {proto}")));
        }
        let module = r.unicode()?;
        let class = r.unicode()?;
        if class != CLASS || !module.ends_with("._bindings") {
            return Err(err(&format!("class {module}.{class}")));
        }
        r.expect(STACK_GLOBAL, "no STACK_GLOBAL")?;
        r.skip_memo();
        r.expect(EMPTY_TUPLE, "no EMPTY_TUPLE")?;
        r.expect(NEWOBJ, "no NEWOBJ")?;
        r.skip_memo();
        let state = r.bytes()?;
        r.skip_memo();
        r.expect(BUILD, "no BUILD")?;
        r.expect(STOP, "no STOP")?;
        if !r.rest.is_empty() {
            return Err(err("bytes after STOP"));
        }
        Ok((module, state))
    }

    struct Ops<'a> {
        rest: &'a [u8],
    }

    impl<'a> Ops<'a> {
        /// The next opcode, frames skipped (a frame only announces a length).
        fn byte(&mut self) -> Result<u8, NixlError> {
            let (&b, rest) = self.rest.split_first().ok_or_else(|| err("cut short"))?;
            self.rest = rest;
            Ok(b)
        }
        fn op(&mut self) -> Result<u8, NixlError> {
            loop {
                let b = self.byte()?;
                if b != FRAME {
                    return Ok(b);
                }
                self.take(8)?;
            }
        }
        fn expect(&mut self, want: u8, what: &str) -> Result<(), NixlError> {
            if self.op()? == want { Ok(()) } else { Err(err(what)) }
        }
        fn skip_memo(&mut self) {
            let mut probe = Ops { rest: self.rest };
            if probe.op().ok() == Some(MEMOIZE) {
                self.rest = probe.rest;
            }
        }
        fn take(&mut self, n: usize) -> Result<&'a [u8], NixlError> {
            if n > self.rest.len() {
                return Err(err("a length beyond the end"));
            }
            let (head, rest) = self.rest.split_at(n);
            self.rest = rest;
            Ok(head)
        }
        fn unicode(&mut self) -> Result<String, NixlError> {
            if self.op()? != SHORT_BINUNICODE {
                return Err(err("no class name"));
            }
            let n = self.byte()? as usize;
            let s = std::str::from_utf8(self.take(n)?).map_err(|_| err("a name not UTF-8"))?;
            let s = s.to_owned();
            self.skip_memo();
            Ok(s)
        }
        fn bytes(&mut self) -> Result<&'a [u8], NixlError> {
            let n = match self.op()? {
                SHORT_BINBYTES => self.byte()? as u64,
                BINBYTES => {
                    let mut w = [0u8; 4];
                    w.copy_from_slice(self.take(4)?);
                    u64::from(u32::from_le_bytes(w))
                }
                BINBYTES8 => {
                    let mut w = [0u8; 8];
                    w.copy_from_slice(self.take(8)?);
                    u64::from_le_bytes(w)
                }
                _ => return Err(err("no state bytes")),
            };
            self.take(usize::try_from(n).map_err(|_| err("a length beyond the end"))?)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What nixl-cu12 1.5.1's `get_serialized_descs` gave (CPython 3.11) for four 4 KiB pages
    /// at 0x55ef51ba3b80 (captured once from the wheel; the interop test checks it live).
    fn captured() -> Vec<u8> {
        let mut state = b"nixlSerDes|nixlDList\n\0\0\0\0\0\0\0nixlBDList|t\x04\0\0\0\0\0\0\0\0\0\0\0|n\x08\0\0\0\0\0\0\0\x04\0\0\0\0\0\0\0|`\0\0\0\0\0\0\0".to_vec();
        for i in 0..4u64 {
            state.extend_from_slice(&(0x55ef_51ba_3b80 + i * 4096).to_le_bytes());
            state.extend_from_slice(&4096u64.to_le_bytes());
            state.extend_from_slice(&0u64.to_le_bytes());
        }
        state.push(b'|');
        let mut p = vec![0x80, 4, 0x95];
        let mut body = vec![0x8c, 19];
        body.extend_from_slice(b"nixl_cu12._bindings");
        body.extend_from_slice(&[0x94, 0x8c, 13]);
        body.extend_from_slice(b"nixlXferDList");
        body.extend_from_slice(&[0x94, 0x93, 0x94, b')', 0x81, 0x94, b'C', state.len() as u8]);
        body.extend_from_slice(&state);
        body.extend_from_slice(&[0x94, b'b', b'.']);
        p.extend_from_slice(&(body.len() as u64).to_le_bytes());
        p.extend_from_slice(&body);
        p
    }

    #[test]
    fn writes_what_the_wheel_writes() {
        let list = DescList::pages(0x55ef_51ba_3b80, 4 * 4096, 4096).unwrap();
        let bytes = list.to_pickle("nixl_cu12._bindings");
        assert_eq!(bytes.len(), 235, "the wheel's pickle of four pages is 235 bytes");
        assert_eq!(bytes, captured());
        let (back, module) = DescList::from_pickle(&bytes).unwrap();
        assert_eq!(module, "nixl_cu12._bindings");
        assert_eq!(back, list);
    }

    #[test]
    fn a_last_partial_page_is_cut_short() {
        let l = DescList::pages(4096, 10_000, 4096).unwrap();
        assert_eq!(l.descs.len(), 3);
        assert_eq!(l.descs[2], Desc { addr: 4096 + 8192, len: 10_000 - 8192, dev: 0 });
    }

    #[test]
    fn refuses_other_pickles_by_name() {
        let mut evil = captured();
        // Another class in the same module (os.system would be spelt the same way).
        let at = evil.windows(13).position(|w| w == b"nixlXferDList").unwrap();
        evil[at..at + 13].copy_from_slice(b"nixlRegDListX");
        let e = DescList::from_pickle(&evil).unwrap_err().to_string();
        assert!(e.contains("class nixl_cu12._bindings.nixlRegDListX"), "{e}");
        assert!(DescList::from_pickle(b"\x80\x04cos\nsystem\n.").is_err());
        assert!(DescList::from_pickle(&captured()[..100]).is_err());
    }

    #[test]
    fn refuses_lying_lengths() {
        let list = DescList::pages(0, 3 * 4096, 4096).unwrap();
        let mut s = list.to_serdes();
        // Claim 4 descriptors in the bytes of 3.
        let at = s.windows(2).position(|w| w == b"n\x08").unwrap() + 9;
        s[at] = 4;
        let e = DescList::from_serdes(&s).unwrap_err().to_string();
        assert!(e.contains("4 descriptors in 72 bytes"), "{e}");
    }

    #[test]
    fn large_lists_round_trip_through_binbytes() {
        let list = DescList::pages(1 << 40, 4096 * 5000, 4096).unwrap();
        let bytes = list.to_pickle("nixl._bindings");
        assert_eq!(DescList::from_pickle(&bytes).unwrap(), (list, "nixl._bindings".into()));
    }

    proptest! {
        #[test]
        fn never_panics_on_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = DescList::from_pickle(&bytes);
            let _ = DescList::from_serdes(&bytes);
        }

        #[test]
        fn any_list_round_trips(descs in proptest::collection::vec((any::<u64>(), any::<u64>(), any::<u64>()), 0..200)) {
            let list = DescList { mem: MemType::Dram, descs: descs.into_iter().map(|(addr, len, dev)| Desc { addr, len, dev }).collect() };
            prop_assert_eq!(DescList::from_serdes(&list.to_serdes()).unwrap(), list.clone());
            prop_assert_eq!(DescList::from_pickle(&list.to_pickle("nixl_cu12._bindings")).unwrap().0, list);
        }
    }
}
