//! raw_block recovery from any journal and checkpoint contents. The input is structure-aware:
//! journal records and checkpoint entries are written with valid checksums (so the fuzzer
//! reaches replay and index building, not just checksum failures), over a device that holds a
//! few real blobs, plus raw bytes patched anywhere in the metadata area. Opening never panics;
//! every key it then serves verifies.
#![no_main]

use std::os::unix::fs::FileExt;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use lmcache_core::ObjectKey;
use lmcache_l2::config;
use twox_hash::XxHash3_64;

const META: u64 = 64 << 10;
const SLOT: u64 = 8192;
const SLOTS: u64 = 16;

struct Fixture {
    rt: tokio::runtime::Runtime,
    dir: tempfile::TempDir,
    pristine: Vec<u8>,
}

fn key(i: u8) -> ObjectKey {
    ObjectKey::new([i; 32], "m", 1, 0, 0, "").unwrap()
}

fn spec(path: &std::path::Path) -> serde_json::Value {
    serde_json::json!({"type": "raw_block", "device_path": path, "slot_bytes": SLOT,
        "capacity_bytes": META + SLOTS * SLOT, "meta_total_bytes": META, "use_odirect": false})
}

/// A device holding 8 real blobs, formatted once.
fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let dev = dir.path().join("pristine");
        rt.block_on(async {
            let b = config::build(0, &spec(&dev)).await.unwrap();
            for i in 0..8u8 {
                let blob = b.codec.encode(&key(i), bytes::Bytes::from(vec![i; 3000])).unwrap();
                assert!(b.adapter.store(vec![(key(i), blob)]).await[0].is_ok());
            }
            b.adapter.close().await;
        });
        let pristine = std::fs::read(&dev).unwrap();
        Fixture { rt, dir, pristine }
    })
}

fn le(v: u64) -> [u8; 8] {
    v.to_le_bytes()
}

fuzz_target!(|input: (
    u8,
    Vec<(u8, u8, u64, u64)>,
    Vec<(u8, u64, u64, Vec<u8>)>,
    Vec<(u16, u8)>
)| {
    let (epoch, records, entries, patches) = input;
    let f = fixture();
    let mut img = f.pristine.clone();
    // Geometry as raw_block lays it out: superblock, journal (a quarter), two checkpoints.
    let journal_off = 4096u64;
    let journal_len = META / 4;
    let ckpt_len = (META - journal_off - journal_len) / 2;
    let ckpt_off = journal_off + journal_len;
    let epoch = u64::from(epoch % 4);
    // A checkpoint of `epoch` with the fuzzer's entries (valid checksums).
    let mut p = Vec::new();
    for (slot, len, sum, wk) in entries.iter().take(64) {
        p.extend_from_slice(&le(u64::from(*slot)));
        p.extend_from_slice(&le(*len));
        p.extend_from_slice(&le(*sum));
        let wk = if wk.is_empty() {
            // A real wire key now and then, so entries can name stored keys.
            format!(
                "m@00000001@0@{}",
                [*slot % 10; 32].iter().map(|b| format!("{b:02x}")).collect::<String>()
            )
            .into_bytes()
        } else {
            wk.clone()
        };
        p.extend_from_slice(&(wk.len() as u16).to_le_bytes());
        p.extend_from_slice(&wk);
    }
    if !entries.is_empty() && (p.len() as u64) < ckpt_len - 4096 {
        let mut h = vec![0u8; 4096];
        h[0..8].copy_from_slice(b"LMRSCKP1");
        h[8..16].copy_from_slice(&le(epoch));
        h[16..24].copy_from_slice(&le(p.len() as u64));
        h[24..32].copy_from_slice(&le(XxHash3_64::oneshot(&p)));
        let hs = XxHash3_64::oneshot(&h[..32]);
        h[32..40].copy_from_slice(&le(hs));
        let at = (ckpt_off + ckpt_len * u64::from(epoch % 2)) as usize;
        img[at..at + 4096].copy_from_slice(&h);
        img[at + 4096..at + 4096 + p.len()].copy_from_slice(&p);
    }
    // Journal records of that epoch (valid magic, numbering and checksums).
    for (n, (op, slot, len, sum)) in records.iter().take((journal_len / 64) as usize).enumerate() {
        let mut r = [0u8; 64];
        r[0..4].copy_from_slice(&0x4a52_4e31u32.to_le_bytes());
        r[4] = op % 3;
        for (i, v) in [epoch, n as u64, u64::from(*slot), *len, *sum].iter().enumerate() {
            r[8 + i * 8..16 + i * 8].copy_from_slice(&le(*v));
        }
        let s = XxHash3_64::oneshot(&r[..56]);
        r[56..64].copy_from_slice(&le(s));
        let at = journal_off as usize + n * 64;
        img[at..at + 64].copy_from_slice(&r);
    }
    // And raw damage anywhere past the superblock.
    for (at, byte) in patches.iter().take(32) {
        let at = 4096 + (*at as usize) % (img.len() - 4096);
        img[at] ^= byte;
    }
    let dev = f.dir.path().join("fuzzed");
    std::fs::write(&dev, &img).unwrap();
    f.rt.block_on(async {
        let Ok(b) = config::build(0, &spec(&dev)).await else { return };
        let keys: Vec<ObjectKey> = (0..10).map(key).collect();
        for (i, r) in b.adapter.load(&keys).await.into_iter().enumerate() {
            if let Ok(Some(bytes)) = r {
                // Served bytes either verify as this key's blob or are refused by the codec.
                if let Ok(v) = b.codec.decode(&keys[i], &bytes) {
                    assert_eq!(v, vec![i as u8; 3000], "key {i} served wrong bytes");
                }
            }
        }
        // It keeps working: a store, a delete, a reopen.
        let blob = b.codec.encode(&key(9), bytes::Bytes::from(vec![9u8; 100])).unwrap();
        let _ = b.adapter.store(vec![(key(9), blob)]).await;
        let _ = b.adapter.delete(&keys[..3]).await;
        b.adapter.close().await;
        let _ = std::fs::File::open(&dev).map(|f| f.sync_all());
    });
    let _ = std::fs::File::open(&dev).and_then(|f| f.write_at(&[], 0));
});
