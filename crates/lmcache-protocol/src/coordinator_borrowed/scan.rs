//! One pass over a `POST /events` body in the shape servers send it, straight into
//! [`CacheEventsBody`]: each field name compared once, strings borrowed, numbers read as
//! digits, each chunk hash decoded from hex where it lies.
//!
//! It reads only what it is sure of: the fields of these types (in any order, any JSON
//! whitespace), strings without escapes, integers as digits. Anything else (an escape, an
//! unknown or repeated field, `null`, an exponent, a syntax error) is `None`, and the caller
//! decodes the body with serde instead, which is authoritative for every answer and every
//! error text. So a body this reads gets exactly the value serde would give it (a property
//! test and the `events_body` fuzz target check this), and a body it does not read loses only
//! speed.

use std::borrow::Cow;

use super::{CacheEventBatchRef, CacheEventEntryRef, CacheEventsBody, ChunkHashHex, ObjectKeyRef};
use crate::coordinator::{CacheEventType, WireTier, chunk_hash_of};

/// `text` read as a `POST /events` body, or `None` where serde must decide.
pub(super) fn scan(text: &str) -> Option<CacheEventsBody<'_>> {
    let mut c = Cursor { text, at: 0, last_entries: 0 };
    let mut batches = Vec::new();
    let mut seen = Seen::default();
    c.object(|c, field| match field {
        "batches" => {
            seen.first(0, Some(()))?;
            c.array(|c| {
                batches.push(c.batch()?);
                Some(())
            })
        }
        _ => None,
    })?;
    c.end()?;
    Some(CacheEventsBody { batches })
}

struct Cursor<'a> {
    text: &'a str,
    at: usize,
    /// Entries in the last batch read.
    last_entries: usize,
}

impl<'a> Cursor<'a> {
    fn bytes(&self) -> &'a [u8] {
        self.text.as_bytes()
    }

    /// The next byte after JSON whitespace.
    fn peek(&mut self) -> Option<u8> {
        let b = self.bytes();
        while let Some(&x) = b.get(self.at) {
            if !matches!(x, b' ' | b'\n' | b'\r' | b'\t') {
                return Some(x);
            }
            self.at += 1;
        }
        None
    }

    fn eat(&mut self, want: u8) -> Option<()> {
        (self.peek()? == want).then(|| self.at += 1)
    }

    /// Only whitespace left.
    fn end(&mut self) -> Option<()> {
        self.peek().is_none().then_some(())
    }

    /// A string without escapes or control characters, borrowed.
    fn string(&mut self) -> Option<&'a str> {
        self.eat(b'"')?;
        let start = self.at;
        let rest = self.bytes().get(start..)?;
        let len = string_end(rest)?;
        if rest[len] != b'"' {
            return None;
        }
        self.at = start + len + 1;
        // Both ends sit at an ASCII quote, so they are character boundaries.
        self.text.get(start..start + len)
    }

    /// Digits of an unsigned integer (no sign, fraction or exponent; no leading zero).
    fn digits(&mut self) -> Option<u64> {
        self.peek()?;
        let b = self.bytes();
        let start = self.at;
        let mut v: u64 = 0;
        while let Some(&d) = b.get(self.at).filter(|d| d.is_ascii_digit()) {
            v = v.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
            self.at += 1;
        }
        let len = self.at - start;
        let leading_zero = len > 1 && b[start] == b'0';
        let more = b.get(self.at).is_some_and(|x| matches!(x, b'.' | b'e' | b'E'));
        (len > 0 && !leading_zero && !more).then_some(v)
    }

    fn u32(&mut self) -> Option<u32> {
        u32::try_from(self.digits()?).ok()
    }

    fn i64(&mut self) -> Option<i64> {
        if self.peek()? == b'-' {
            self.at += 1;
            // "-" must be followed by the digits at once (no whitespace), as JSON has it.
            if !self.bytes().get(self.at)?.is_ascii_digit() {
                return None;
            }
            // serde_json reads "-0" as the float -0.0, which no integer field takes.
            i64::try_from(self.digits()?).ok().filter(|&v| v != 0).map(|v| -v)
        } else {
            i64::try_from(self.digits()?).ok()
        }
    }

    /// A JSON number as `f64`, parsed by serde_json itself so the value is bit for bit
    /// what serde gives (once per batch: `ts`).
    fn f64(&mut self) -> Option<f64> {
        self.peek()?;
        let b = self.bytes();
        let start = self.at;
        while b
            .get(self.at)
            .is_some_and(|x| matches!(x, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E'))
        {
            self.at += 1;
        }
        serde_json::from_str::<f64>(self.text.get(start..self.at)?).ok()
    }

    fn bool(&mut self) -> Option<bool> {
        self.peek()?;
        let rest = self.bytes().get(self.at..)?;
        let (v, len) = if rest.starts_with(b"true") {
            (true, 4)
        } else if rest.starts_with(b"false") {
            (false, 5)
        } else {
            return None;
        };
        self.at += len;
        Some(v)
    }

    /// `{ "field": value, ... }`, each value read by `field`; a field seen twice is `None`
    /// (serde refuses a duplicate field).
    fn object(&mut self, mut field: impl FnMut(&mut Self, &'a str) -> Option<()>) -> Option<()> {
        self.eat(b'{')?;
        if self.peek()? == b'}' {
            self.at += 1;
            return Some(());
        }
        loop {
            let name = self.string()?;
            self.eat(b':')?;
            field(self, name)?;
            match self.peek()? {
                b',' => self.at += 1,
                b'}' => {
                    self.at += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// `[ item, ... ]`.
    fn array(&mut self, mut item: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.eat(b'[')?;
        if self.peek()? == b']' {
            self.at += 1;
            return Some(());
        }
        loop {
            item(self)?;
            match self.peek()? {
                b',' => self.at += 1,
                b']' => {
                    self.at += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    fn batch(&mut self) -> Option<CacheEventBatchRef<'a>> {
        let mut seen = Seen::default();
        let (mut instance_id, mut incarnation, mut seq, mut event_type, mut tier) =
            (None, None, None, None, None);
        let mut b = CacheEventBatchRef {
            instance_id: Cow::Borrowed(""),
            incarnation: 0,
            seq: 0,
            event_type: CacheEventType::Store,
            tier: WireTier::L1,
            backend: Cow::Borrowed(""),
            // The previous batch's count: a body's batches tend to be alike, and a guess from
            // what was read cannot make a small body allocate much.
            entries: Vec::with_capacity(self.last_entries),
            shared: false,
            ts: 0.0,
            capacity_bytes: 0,
            capacity_revision: 0,
        };
        self.object(|c, field| {
            match field {
                "instance_id" => seen.once(0, &mut instance_id, c.string())?,
                "incarnation" => seen.once(1, &mut incarnation, c.digits())?,
                "seq" => seen.once(2, &mut seq, c.digits())?,
                "event_type" => {
                    seen.once(3, &mut event_type, c.string().and_then(event_type_of))?
                }
                "tier" => seen.once(4, &mut tier, c.string().and_then(tier_of))?,
                "backend" => b.backend = Cow::Borrowed(seen.first(5, c.string())?),
                "entries" => {
                    seen.first(6, Some(()))?;
                    c.array(|c| {
                        b.entries.push(c.entry()?);
                        Some(())
                    })?;
                }
                "shared" => b.shared = seen.first(7, c.bool())?,
                "ts" => b.ts = seen.first(8, c.f64())?,
                "capacity_bytes" => b.capacity_bytes = seen.first(9, c.digits())?,
                "capacity_revision" => b.capacity_revision = seen.first(10, c.digits())?,
                _ => return None,
            }
            Some(())
        })?;
        b.instance_id = Cow::Borrowed(instance_id?);
        b.incarnation = incarnation?;
        b.seq = seq?;
        b.event_type = event_type?;
        b.tier = tier?;
        self.last_entries = b.entries.len();
        Some(b)
    }

    fn entry(&mut self) -> Option<CacheEventEntryRef<'a>> {
        let mut seen = Seen::default();
        let mut key = None;
        let (mut size_bytes, mut token_ids, mut token_offset) = (0, Vec::new(), -1);
        self.object(|c, field| {
            match field {
                "key" => seen.once(0, &mut key, c.key())?,
                "size_bytes" => size_bytes = seen.first(1, c.digits())?,
                "token_ids" => {
                    seen.first(2, Some(()))?;
                    c.array(|c| {
                        token_ids.push(c.u32()?);
                        Some(())
                    })?;
                }
                "token_offset" => token_offset = seen.first(3, c.i64())?,
                _ => return None,
            }
            Some(())
        })?;
        Some(CacheEventEntryRef { key: key?, size_bytes, token_ids, token_offset })
    }

    fn key(&mut self) -> Option<ObjectKeyRef<'a>> {
        let mut seen = Seen::default();
        let (mut hash, mut model_name, mut kv_rank) = (None, None, None);
        let (mut object_group_id, mut cache_salt) = (0, "");
        self.object(|c, field| {
            match field {
                "chunk_hash_hex" => seen.once(0, &mut hash, c.string().map(chunk_hash_of))?,
                "model_name" => seen.once(1, &mut model_name, c.string())?,
                "kv_rank" => seen.once(2, &mut kv_rank, c.u32())?,
                "object_group_id" => object_group_id = seen.first(3, c.u32())?,
                "cache_salt" => cache_salt = seen.first(4, c.string())?,
                _ => return None,
            }
            Some(())
        })?;
        Some(ObjectKeyRef {
            chunk_hash: ChunkHashHex(hash?),
            model_name: Cow::Borrowed(model_name?),
            kv_rank: kv_rank?,
            object_group_id,
            cache_salt: Cow::Borrowed(cache_salt),
        })
    }
}

/// Where the string starting at `rest[0]` stops: the first `"`, `\\` or control character,
/// found eight bytes at a time (the lowest flagged byte of each test below is exact; only
/// bytes above a flagged one can be flagged falsely).
fn string_end(rest: &[u8]) -> Option<usize> {
    const ONES: u64 = u64::from_le_bytes([0x01; 8]);
    const HIGHS: u64 = u64::from_le_bytes([0x80; 8]);
    let zero = |x: u64| x.wrapping_sub(ONES) & !x & HIGHS;
    let mut at = 0;
    while let Some(word) = rest.get(at..at + 8) {
        let mut w = [0u8; 8];
        w.copy_from_slice(word);
        let w = u64::from_le_bytes(w);
        let flagged = zero(w ^ (ONES * u64::from(b'"')))
            | zero(w ^ (ONES * u64::from(b'\\')))
            | (w.wrapping_sub(ONES * 0x20) & !w & HIGHS);
        if flagged != 0 {
            return Some(at + (flagged.trailing_zeros() / 8) as usize);
        }
        at += 8;
    }
    let tail = rest.get(at..)?;
    tail.iter().position(|&x| x == b'"' || x == b'\\' || x < 0x20).map(|n| at + n)
}

/// The fields of one object read so far, by number.
#[derive(Default)]
struct Seen(u32);

impl Seen {
    /// `value` for field `n`, unless `n` was read before.
    fn first<T>(&mut self, n: u32, value: Option<T>) -> Option<T> {
        let bit = 1 << n;
        if self.0 & bit != 0 {
            return None;
        }
        self.0 |= bit;
        value
    }

    /// A required field's `value` into `slot`, unless it was read before.
    fn once<T>(&mut self, n: u32, slot: &mut Option<T>, value: Option<T>) -> Option<()> {
        *slot = Some(self.first(n, value)?);
        Some(())
    }
}

fn event_type_of(s: &str) -> Option<CacheEventType> {
    Some(match s {
        "store" => CacheEventType::Store,
        "delete" => CacheEventType::Delete,
        "access" => CacheEventType::Access,
        "config" => CacheEventType::Config,
        _ => return None,
    })
}

fn tier_of(s: &str) -> Option<WireTier> {
    Some(match s {
        "l1" => WireTier::L1,
        "l2" => WireTier::L2,
        "all" => WireTier::All,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A small deterministic generator for the bodies below.
    struct Gen(u64);

    impl Gen {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        fn one_in(&mut self, n: u64) -> bool {
            self.below(n) == 0
        }
        fn ws(&mut self) -> &'static str {
            ["", "", " ", "\n  ", "\t", "\r\n"][self.below(6) as usize]
        }
    }

    /// A JSON object of `fields` (name, value text) in a shuffled order with random
    /// whitespace; with `odd`, sometimes a field repeated or an unknown one added.
    fn object(g: &mut Gen, mut fields: Vec<(&str, String)>, odd: bool) -> String {
        for i in (1..fields.len()).rev() {
            fields.swap(i, g.below(i as u64 + 1) as usize);
        }
        if odd && g.one_in(12) && !fields.is_empty() {
            let dup = fields[0].clone();
            fields.push(dup);
        }
        if odd && g.one_in(12) {
            fields.push(("unknown", "[1, {\"x\": null}]".into()));
        }
        let body: Vec<String> = fields
            .into_iter()
            .map(|(k, v)| format!("{}\"{k}\"{}:{}{v}{}", g.ws(), g.ws(), g.ws(), g.ws()))
            .collect();
        format!("{{{}{}}}", body.join(","), g.ws())
    }

    fn string(g: &mut Gen, plain: &str, odd: bool) -> String {
        if odd && g.one_in(10) {
            ["\"a\\\"b\"", "\"\\u0041\"", "\"\u{7}\"", "null", "\"é\"", "7"][g.below(6) as usize]
                .into()
        } else {
            format!("\"{plain}\"")
        }
    }

    fn number(g: &mut Gen, v: u64, odd: bool) -> String {
        if odd && g.one_in(10) {
            ["-0", "01", "1e3", "1.0", "18446744073709551616", "4294967296", "-5", "null", "+1"]
                [g.below(9) as usize]
                .into()
        } else {
            v.to_string()
        }
    }

    fn key(g: &mut Gen, odd: bool) -> String {
        let hash: String =
            (0..64).map(|_| b"0123456789abcdefABCDEF"[g.below(22) as usize] as char).collect();
        let hash = if odd && g.one_in(10) { hash[..63].to_string() } else { hash };
        let mut f = vec![
            ("chunk_hash_hex", string(g, &hash, odd)),
            ("model_name", {
                let v = ["m", "meta-llama/Llama-3-8B", ""][g.below(3) as usize];
                string(g, v, odd)
            }),
            ("kv_rank", {
                let v = [16_777_472, 0, 4_294_967_295][g.below(3) as usize];
                number(g, v, odd)
            }),
        ];
        if g.one_in(2) {
            f.push(("object_group_id", {
                let v = g.below(4);
                number(g, v, odd)
            }));
        }
        if g.one_in(2) {
            f.push(("cache_salt", string(g, "tenant", odd)));
        }
        if odd && g.one_in(15) {
            f.remove(g.below(3) as usize);
        }
        object(g, f, odd)
    }

    fn entry(g: &mut Gen, odd: bool) -> String {
        let mut f = vec![("key", key(g, odd))];
        if g.one_in(2) {
            f.push(("size_bytes", number(g, 33_554_432, odd)));
        }
        if g.one_in(3) {
            let n = g.below(4);
            let ids: Vec<String> = (0..n)
                .map(|_| {
                    let v = g.below(1 << 20);
                    number(g, v, odd)
                })
                .collect();
            f.push(("token_ids", format!("[{}]", ids.join(", "))));
        }
        if g.one_in(3) {
            let off = ["256", "-1", "0", "-2", "-9223372036854775808", "-0", "-01", "- 1"]
                [g.below(4 + 4 * u64::from(odd)) as usize];
            f.push(("token_offset", off.to_string()));
        }
        object(g, f, odd)
    }

    fn batch(g: &mut Gen, odd: bool) -> String {
        let entries: Vec<String> = (0..g.below(4)).map(|_| entry(g, odd)).collect();
        let mut f = vec![
            ("instance_id", string(g, "server-1", odd)),
            ("incarnation", {
                let v = g.below(1 << 40);
                number(g, v, odd)
            }),
            ("seq", {
                let v = g.below(5);
                number(g, v, odd)
            }),
            ("event_type", {
                let v = ["store", "delete", "access", "config", "Store"]
                    [g.below(4 + u64::from(odd)) as usize];
                string(g, v, odd)
            }),
            ("tier", {
                let v = ["l1", "l2", "all", "l3"][g.below(3 + u64::from(odd)) as usize];
                string(g, v, odd)
            }),
        ];
        if g.one_in(4) {
            f.push(("backend", string(g, "dram", odd)));
        }
        if !g.one_in(4) {
            f.push(("entries", format!("[{}{}]", entries.join(&format!(",{}", g.ws())), g.ws())));
        }
        if g.one_in(2) {
            f.push(("shared", ["true", "false", "1"][g.below(2 + u64::from(odd)) as usize].into()));
        }
        if g.one_in(2) {
            let ts = ["1.0", "1733370000.123456", "0", "-1.5", "2.5e3", "1E-7", "0.1", "1."];
            f.push(("ts", ts[g.below(7 + u64::from(odd)) as usize].into()));
        }
        if g.one_in(4) {
            f.push(("capacity_bytes", number(g, 1 << 30, odd)));
            f.push(("capacity_revision", number(g, 2, odd)));
        }
        if odd && g.one_in(15) {
            f.remove(g.below(5) as usize);
        }
        object(g, f, odd)
    }

    fn body(g: &mut Gen, odd: bool) -> String {
        let batches: Vec<String> = (0..g.below(4)).map(|_| batch(g, odd)).collect();
        let text = if g.one_in(10) {
            "{}".to_string()
        } else {
            object(g, vec![("batches", format!("[{}]", batches.join(",")))], odd)
        };
        format!("{}{text}{}", g.ws(), g.ws())
    }

    /// Where the pass reads a body, serde reads the same value.
    fn agrees(text: &str) -> Result<bool, TestCaseError> {
        let Some(fast) = scan(text) else { return Ok(false) };
        let serde: Result<CacheEventsBody<'_>, _> = serde_json::from_str(text);
        prop_assert_eq!(Some(&fast), serde.as_ref().ok(), "{}", text);
        Ok(true)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn bodies_in_the_usual_shape_are_read_in_one_pass_as_serde_reads_them(seed in 1u64..) {
            let text = body(&mut Gen(seed), false);
            prop_assert!(agrees(&text)?, "not read in one pass: {}", text);
        }

        #[test]
        fn odd_bodies_are_read_as_serde_reads_them_or_left_to_it(seed in 1u64..) {
            agrees(&body(&mut Gen(seed), true))?;
        }

        #[test]
        fn damaged_bodies_are_read_as_serde_reads_them_or_left_to_it(
            seed in 1u64..,
            cuts in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        ) {
            let mut bytes = body(&mut Gen(seed), false).into_bytes();
            for (at, byte) in cuts {
                if !bytes.is_empty() {
                    let i = at.index(bytes.len());
                    bytes[i] = byte;
                }
            }
            if let Ok(text) = std::str::from_utf8(&bytes) {
                agrees(text)?;
            }
        }
    }

    #[test]
    fn what_pythons_json_dumps_writes_is_read_in_one_pass() {
        // The shape of LMCache's emitter (json.dumps defaults: ", " and ": ").
        let text = r#"{"batches": [{"instance_id": "server-0", "incarnation": 1, "seq": 1, "event_type": "store", "tier": "l1", "backend": "dram", "shared": false, "ts": 1733370000.5, "entries": [{"key": {"chunk_hash_hex": "6d0a5e3ad8b0f3d7c5c4b3a29181706f5e4d3c2b1a09f8e7d6c5b4a392817060", "model_name": "m", "kv_rank": 16777472, "object_group_id": 0, "cache_salt": ""}, "size_bytes": 33554432}]}]}"#;
        assert!(agrees(text).unwrap());
        let b = decode_body_for_test(text);
        assert_eq!(b.batches[0].entries[0].key.chunk_hash.0.as_ref().map(|h| h[0]), Ok(0x6d));
    }

    #[test]
    fn minus_zero_is_left_to_serde_which_refuses_it_as_an_integer() {
        // Found by the damaged-bodies property in CI: the pass read "-0" as 0.
        let key = r#"{"chunk_hash_hex": "6d0a5e3ad8b0f3d7c5c4b3a29181706f5e4d3c2b1a09f8e7d6c5b4a392817060", "model_name": "m", "kv_rank": 0}"#;
        let body = |off: &str| {
            format!(
                r#"{{"batches": [{{"instance_id": "s", "incarnation": 1, "seq": 1, "event_type": "store", "tier": "l1", "entries": [{{"key": {key}, "token_offset": {off}}}]}}]}}"#
            )
        };
        assert!(agrees(&body("-1")).unwrap());
        let text = body("-0");
        assert_eq!(scan(&text), None, "the pass must not read -0");
        assert!(serde_json::from_str::<CacheEventsBody<'_>>(&text).is_err());
    }

    fn decode_body_for_test(text: &str) -> CacheEventsBody<'_> {
        super::super::decode_body(text).unwrap()
    }

    #[test]
    fn a_string_ends_at_its_first_quote_backslash_or_control_character() {
        let slow = |b: &[u8]| b.iter().position(|&x| x == b'"' || x == b'\\' || x < 0x20);
        let mut g = Gen(7);
        for _ in 0..20_000 {
            let len = g.below(40) as usize;
            let text: Vec<u8> = (0..len)
                .map(|_| match g.below(12) {
                    0 => b'"',
                    1 => b'\\',
                    2 => g.below(0x21) as u8,
                    3 => 0x80 | g.below(0x80) as u8,
                    _ => b' ' + g.below(0x5f) as u8,
                })
                .collect();
            assert_eq!(string_end(&text), slow(&text), "{text:?}");
        }
    }

    #[test]
    fn what_the_pass_leaves_serde_decides() {
        for text in [
            r#"{"batches": [], "batches": []}"#,
            r#"{"batches": null}"#,
            r#"{"batches": [{"instance_id": "a\u0062"}]}"#,
            r#"{"batches": []} x"#,
            r#"{"batches": [],}"#,
        ] {
            assert!(scan(text).is_none(), "{text}");
            // The door still answers, as serde does.
            assert_eq!(super::super::decode_body(text).ok(), serde_json::from_str(text).ok());
        }
    }
}
