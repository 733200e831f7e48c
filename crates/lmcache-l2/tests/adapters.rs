//! Every adapter against its real backend: the same conformance checks for fs, raw_block,
//! gds_slab, mock, Redis (single node and cluster) and S3. Redis and S3 need servers on loopback, which
//! `scripts/test` starts and names in `LMCACHE_RS_TEST_REDIS`, `LMCACHE_RS_TEST_REDIS_CLUSTER`
//! and `LMCACHE_RS_TEST_S3`; without them those tests say so and pass, unless
//! `LMCACHE_RS_REQUIRE_SERVICES=1` (set by scripts/test), which makes a missing one a failure.
#![allow(missing_docs, clippy::allow_attributes)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use lmcache_core::ObjectKey;
use lmcache_l2::config::{self, BuiltAdapter};
use lmcache_l2::{KeyFilter, L2Adapter, Stored};
use serde_json::{Value, json};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn key(i: u32, salt: &str) -> ObjectKey {
    let mut h = [0u8; 32];
    h[..4].copy_from_slice(&i.to_le_bytes());
    h[31] = 0x5a;
    ObjectKey::new(h, "org/model-7b", 2, 1, 0, salt).unwrap()
}

fn payload(i: u32, len: usize) -> Vec<u8> {
    (0..len).map(|j| (j as u32 ^ i.wrapping_mul(2654435761)) as u8).collect()
}

fn external(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Some(v),
        _ if std::env::var("LMCACHE_RS_REQUIRE_SERVICES").is_ok_and(|v| v == "1") => {
            panic!(
                "{var} is not set, but LMCACHE_RS_REQUIRE_SERVICES=1: start scripts/test-services"
            )
        }
        _ => {
            eprintln!("{var} not set: skipping (scripts/test starts the server and sets it)");
            None
        }
    }
}

async fn build(spec: Value) -> BuiltAdapter {
    config::build(0, &spec).await.unwrap_or_else(|e| panic!("{spec}: {e}"))
}

/// The checks every adapter must pass.
async fn conformance(b: &BuiltAdapter, sizes: &[usize]) {
    let a: &Arc<dyn L2Adapter> = &b.adapter;
    let n = sizes.len() as u32;
    let keys: Vec<ObjectKey> =
        (0..n).map(|i| key(i, if i % 2 == 0 { "" } else { "tenant" })).collect();
    let _ = a.delete(&keys).await; // a shared backend may hold keys of an earlier run
    assert_eq!(
        a.lookup(&keys).await.unwrap(),
        vec![false; keys.len()],
        "{}: fresh keys found",
        a.kind()
    );
    let items: Vec<(ObjectKey, lmcache_l2::Blob)> = keys
        .iter()
        .zip(sizes)
        .enumerate()
        .map(|(i, (k, &len))| {
            (k.clone(), b.codec.encode(k, Bytes::from(payload(i as u32, len))).unwrap())
        })
        .collect();
    for r in a.store(items.clone()).await {
        assert!(matches!(r, Ok(Stored::Written(_))), "{}: store failed: {r:?}", a.kind());
    }
    assert_eq!(
        a.lookup(&keys).await.unwrap(),
        vec![true; keys.len()],
        "{}: stored keys missing",
        a.kind()
    );
    for (i, (k, r)) in keys.iter().zip(a.load(&keys).await).enumerate() {
        let bytes = r.unwrap().unwrap_or_else(|| panic!("{}: key {i} not loaded", a.kind()));
        assert_eq!(
            b.codec.decode(k, &bytes).unwrap(),
            payload(i as u32, sizes[i]),
            "{}: key {i}",
            a.kind()
        );
    }
    direct_loads(b, &keys, &items).await;
    // Salt isolation in the key space: the same chunks under another salt are other objects,
    // neither found nor loaded.
    let intruder: Vec<ObjectKey> = (0..n).map(|i| key(i, "intruder")).collect();
    assert_eq!(
        a.lookup(&intruder).await.unwrap(),
        vec![false; keys.len()],
        "{}: another salt's objects found",
        a.kind()
    );
    assert!(
        a.load(&intruder).await.into_iter().all(|r| matches!(r, Ok(None))),
        "{}: another salt's object loaded",
        a.kind()
    );
    // A blob loaded for the wrong key is refused.
    let other = a.load(&keys[..1]).await.pop().unwrap().unwrap().unwrap();
    assert!(b.codec.decode(&keys[1], &other).is_err(), "{}: misplaced blob accepted", a.kind());
    // Storing again never duplicates or corrupts.
    for r in a.store(items[..2].to_vec()).await {
        assert!(r.is_ok(), "{}: re-store failed: {r:?}", a.kind());
    }
    // Delete half; the rest stays.
    let half: Vec<ObjectKey> = keys.iter().step_by(2).cloned().collect();
    assert_eq!(a.delete(&half).await.unwrap(), half.len() as u64, "{}: delete count", a.kind());
    let found = a.lookup(&keys).await.unwrap();
    for (i, f) in found.iter().enumerate() {
        assert_eq!(*f, i % 2 == 1, "{}: key {i} after delete", a.kind());
    }
    assert!(
        a.load(&half).await.into_iter().all(|r| matches!(r, Ok(None))),
        "{}: deleted key loaded",
        a.kind()
    );
    match a.list(&KeyFilter::model("org/model-7b"), None, 1000).await {
        Ok(page) => {
            let listed: Vec<&ObjectKey> = page.keys.iter().map(|(k, _)| k).collect();
            for k in keys.iter().skip(1).step_by(2) {
                assert!(listed.contains(&k), "{}: {k} not listed", a.kind());
            }
            // A tenant's listing shows its own salt only.
            let salt = |s: &str| KeyFilter { model: None, cache_salt: Some(s.into()) };
            let page = a.list(&salt("tenant"), None, 1000).await.unwrap();
            assert!(page.keys.iter().all(|(k, _)| k.cache_salt.as_str() == "tenant"));
            for k in keys.iter().skip(1).step_by(2) {
                assert!(page.keys.iter().any(|(x, _)| x == k), "{}: {k} not listed", a.kind());
            }
            let page = a.list(&salt("intruder"), None, 1000).await.unwrap();
            assert!(page.keys.is_empty(), "{}: another salt's keys listed", a.kind());
        }
        Err(lmcache_l2::L2Error::Unsupported { .. }) => {}
        Err(e) => panic!("{}: list: {e}", a.kind()),
    }
    let _ = a.delete(&keys).await;
}

/// Direct loads (the header into a buffer, the payload into a sink of the stored payload's
/// length), pipelined in one batch: every stored key comes back verified; a sink of another
/// length is never filled and leaves the batch's later keys intact; a missing key is a miss.
async fn direct_loads(
    b: &BuiltAdapter,
    keys: &[ObjectKey],
    items: &[(ObjectKey, lmcache_l2::Blob)],
) {
    let a = &b.adapter;
    let absent = key(9999, "");
    let mut batch: Vec<lmcache_l2::DirectItem> = Vec::new();
    let hlen = |k: &ObjectKey| lmcache_l2::blob::header_len(k);
    // First a wrong-length sink for key 0, then every key, then one never stored.
    batch.push((
        keys[0].clone(),
        hlen(&keys[0]),
        Box::new(vec![0u8; items[0].1.payload.len() + 1]),
    ));
    for (k, blob) in items {
        batch.push((k.clone(), hlen(k), Box::new(vec![0u8; blob.payload.len()])));
    }
    batch.push((absent.clone(), hlen(&absent), Box::new(vec![0u8; 16])));
    let out = a.load_direct(batch).await;
    assert_eq!(out.len(), items.len() + 2, "{}: one result per item", a.kind());
    let mut out = out.into_iter();
    let (_, wrong) = out.next().unwrap();
    assert!(!matches!(wrong, Ok(Some(_))), "{}: a sink of another length was filled", a.kind());
    for (k, blob) in items {
        let (sink, r) = out.next().unwrap();
        let header = r.unwrap_or_else(|e| panic!("{}: direct load of {k}: {e}", a.kind()));
        let header = header.unwrap_or_else(|| panic!("{}: direct load of {k} missed", a.kind()));
        let payload = *sink.into_any().downcast::<Vec<u8>>().unwrap();
        lmcache_l2::blob::verify_parts(k, &header.bytes, &payload)
            .unwrap_or_else(|e| panic!("{}: direct load of {k} does not verify: {e}", a.kind()));
        // A payload hash the adapter computed while reading must be the payload's own.
        lmcache_l2::blob::verify_parts_hashed(k, &header.bytes, &payload, header.payload_xxh3)
            .unwrap_or_else(|e| panic!("{}: the hash read with {k} is wrong: {e}", a.kind()));
        assert_eq!(&payload[..], &blob.payload[..], "{}: {k}", a.kind());
    }
    let (_, missing) = out.next().unwrap();
    assert!(matches!(missing, Ok(None)), "{}: absent key: {missing:?}", a.kind());
}

const SIZES: &[usize] = &[0, 1, 4096, 256 * 1024, 1 << 20, 300_001];

#[test]
fn mock_conforms() {
    rt().block_on(async {
        conformance(&build(json!({"type": "mock", "max_size_gb": 1})).await, SIZES).await
    });
}

#[test]
fn fs_conforms_with_each_codec_and_odirect() {
    let dir = tempfile::tempdir().unwrap();
    let kp = dir.path().join("master.key");
    std::fs::write(&kp, "ab".repeat(32)).unwrap();
    rt().block_on(async {
        for (i, serde) in [json!(null), json!({"type": "lz4"}), json!({"type": "zstd", "level": 3}),
                           json!({"type": "aesgcm", "master_key_path": kp})].into_iter().enumerate() {
            let mut spec = json!({"type": "fs", "base_path": dir.path().join(format!("c{i}")), "fsync": "file"});
            if !serde.is_null() {
                spec["serde"] = serde;
            }
            conformance(&build(spec).await, SIZES).await;
        }
        let spec = json!({"type": "fs", "base_path": dir.path().join("odirect"), "use_odirect": true});
        conformance(&build(spec).await, SIZES).await;
        // LMCache's relative_tmp_dir: temporaries go there, and none stay.
        let spec = json!({"type": "fs", "base_path": dir.path().join("rel"), "relative_tmp_dir": "tmpx"});
        conformance(&build(spec).await, SIZES).await;
        assert_eq!(std::fs::read_dir(dir.path().join("rel/tmpx")).unwrap().count(), 0);
    });
}

#[test]
fn fs_stores_a_blob_sealed_by_another_tier_in_pieces_and_loads_it_back() {
    // A blob another tier wrote first arrives with its header sealed; fs then writes the
    // payload unhashed, a piece at a time, and the header last. Sizes around and past the
    // 256 KiB piece, and a 32 MiB chunk of LMCache's default shape.
    let dir = tempfile::tempdir().unwrap();
    let sizes = [0usize, 1, 256 << 10, (256 << 10) + 1, (1 << 20) + 7, 32 << 20];
    rt().block_on(async {
        let b = build(json!({"type": "fs", "base_path": dir.path()})).await;
        let keys: Vec<ObjectKey> = (0..sizes.len() as u32).map(|i| key(i, "sealed")).collect();
        let items: Vec<(ObjectKey, lmcache_l2::Blob)> = keys
            .iter()
            .zip(sizes)
            .enumerate()
            .map(|(i, (k, len))| {
                let blob = b.codec.encode(k, Bytes::from(payload(i as u32, len))).unwrap();
                let _ = blob.header();
                assert!(blob.sealed_header().is_some());
                (k.clone(), blob)
            })
            .collect();
        for r in b.adapter.store(items.clone()).await {
            assert!(matches!(r, Ok(Stored::Written(_))), "store failed: {r:?}");
        }
        for (i, (k, r)) in keys.iter().zip(b.adapter.load(&keys).await).enumerate() {
            let bytes = r.unwrap().unwrap_or_else(|| panic!("key {i} not loaded"));
            assert_eq!(bytes.len(), items[i].1.len(), "key {i}: the file is the blob's length");
            assert_eq!(b.codec.decode(k, &bytes).unwrap(), payload(i as u32, sizes[i]), "key {i}");
        }
        direct_loads(&b, &keys, &items).await;
    });
}

#[test]
fn fs_refuses_torn_files_and_cleans_temporaries() {
    let dir = tempfile::tempdir().unwrap();
    let spec = json!({"type": "fs", "base_path": dir.path()});
    rt().block_on(async {
        let b = build(spec.clone()).await;
        let k = key(1, "");
        let blob = b.codec.encode(&k, Bytes::from(payload(1, 100_000))).unwrap();
        b.adapter.store(vec![(k.clone(), blob)]).await;
        let fs = lmcache_l2::adapters::fs::FsAdapter::open(lmcache_l2::adapters::fs::FsConfig {
            base_path: dir.path().into(),
            relative_tmp_dir: None,
            use_odirect: false,
            fsync: lmcache_l2::adapters::fs::FsyncMode::Never,
        })
        .unwrap();
        let path = fs.path_of(&k);
        // A flipped payload bit is caught on the direct path too, where the reader hashes the
        // payload as it reads it.
        let mut bytes = std::fs::read(&path).unwrap();
        let hl = lmcache_l2::blob::header_len(&k);
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let sink: Box<dyn lmcache_l2::PayloadSink> = Box::new(vec![0u8; 100_000]);
        let (sink, r) = b.adapter.load_direct(vec![(k.clone(), hl, sink)]).await.pop().unwrap();
        let header = r.unwrap().unwrap();
        let payload = *sink.into_any().downcast::<Vec<u8>>().unwrap();
        assert!(header.payload_xxh3.is_some(), "fs hashes while it reads");
        assert!(matches!(
            lmcache_l2::blob::verify_parts_hashed(&k, &header.bytes, &payload, header.payload_xxh3),
            Err(lmcache_l2::BlobError::PayloadChecksum { .. })
        ));
        // A torn file (as a crash of a non-atomic writer would leave) is refused.
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(50_000).unwrap();
        let bytes = b.adapter.load(std::slice::from_ref(&k)).await.pop().unwrap().unwrap().unwrap();
        assert!(b.codec.decode(&k, &bytes).is_err(), "torn blob accepted");
        // A store renames its temporary file within the key's shard directory and leaves
        // nothing else behind: no temporary file, no temporary directory.
        let shard = path.parent().unwrap().to_owned();
        let names = |d: &std::path::Path| -> Vec<String> {
            std::fs::read_dir(d)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect()
        };
        assert_eq!(names(&shard), vec![path.file_name().unwrap().to_str().unwrap().to_owned()]);
        assert!(!dir.path().join(".lmcache-rs-tmp").exists(), "no shared temporary directory");
        // Only our own temporaries of an interrupted store, in a shard directory or in the
        // temporary directory earlier versions used, and old enough not to be another
        // server's write in flight, are removed at open (by a background sweep). Files anyone
        // else put there stay, whatever their names.
        let tmp_dir = dir.path().join(".lmcache-rs-tmp");
        std::fs::create_dir(&tmp_dir).unwrap();
        let ours =
            [tmp_dir.join(".lmcache-rs-x.blob.1.1.tmp"), shard.join(".lmcache-rs-z.blob.3.1.tmp")];
        let in_flight = shard.join(".lmcache-rs-y.blob.2.1.tmp");
        let elsewhere = dir.path().join("not-a-shard");
        std::fs::create_dir(&elsewhere).unwrap();
        let foreign = [
            path.with_file_name(".x.blob.1.1.tmp"),
            dir.path().join("notes.tmp"),
            tmp_dir.join("user-file.tmp"),
            // Our pattern, but outside our shard directories.
            elsewhere.join(".lmcache-rs-w.blob.1.1.tmp"),
            dir.path().join(".lmcache-rs-v.blob.1.1.tmp"),
        ];
        for p in foreign.iter().chain(&ours).chain([&in_flight]) {
            std::fs::write(p, b"partial").unwrap();
        }
        let old = std::time::SystemTime::now() - lmcache_l2::adapters::fs::STALE_TMP * 2;
        for p in foreign.iter().chain(&ours) {
            std::fs::File::options().write(true).open(p).unwrap().set_modified(old).unwrap();
        }
        let b = build(spec).await;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while ours.iter().any(|p| p.exists()) {
            assert!(std::time::Instant::now() < deadline, "stale temporary files left behind");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        b.adapter.close().await;
        assert!(in_flight.exists(), "a temporary file young enough to be in flight was removed");
        for p in &foreign {
            assert!(p.exists(), "{} is not ours and was removed", p.display());
        }
    });
}

#[test]
fn raw_block_conforms_with_and_without_odirect() {
    let dir = tempfile::tempdir().unwrap();
    rt().block_on(async {
        for odirect in [false, true] {
            let spec = json!({"type": "raw_block", "device_path": dir.path().join(format!("dev{odirect}")),
                "slot_bytes": 2 << 20, "capacity_bytes": 64 << 20, "meta_total_bytes": 1 << 20,
                "use_odirect": odirect});
            conformance(&build(spec).await, SIZES).await;
        }
    });
}

/// The slab of a CPU GDS L1 (`--gds-l1-path`): formatted at its first store with slots of that
/// batch's largest blob, so the conformance batch fits; with and without O_DIRECT.
#[test]
fn gds_slab_conforms_with_and_without_odirect() {
    let dir = tempfile::tempdir().unwrap();
    rt().block_on(async {
        for odirect in [false, true] {
            let sub = dir.path().join(format!("slab{odirect}"));
            std::fs::create_dir(&sub).unwrap();
            let spec = json!({"type": "gds_slab", "path": sub, "capacity_bytes": 96 << 20,
                "use_odirect": odirect});
            let b = build(spec).await;
            conformance(&b, SIZES).await;
            assert!(sub.join("lmcache-rs-gds-l1.slab").exists());
            assert_eq!(b.adapter.describe()["use_odirect"], odirect);
        }
    });
}

/// The checkpoint area must hold the index of a full device: a geometry where it cannot
/// (even with the shortest keys) is refused up front, naming the size to use; keys longer
/// than that make a checkpoint drop the oldest entries instead of failing every store (and
/// every restart) from then on. (A full 200-slot device with 64 KiB of metadata could not
/// be reopened after a crash.)
#[test]
fn raw_block_checkpoints_always_fit() {
    let dir = tempfile::tempdir().unwrap();
    let spec = |meta: u64, slots: u64, name: &str| {
        json!({"type": "raw_block", "device_path": dir.path().join(name), "slot_bytes": 8192,
            "capacity_bytes": meta + slots * 8192, "meta_total_bytes": meta})
    };
    rt().block_on(async {
        let e = config::build(0, &spec(64 << 10, 200, "small")).await.unwrap_err();
        assert!(e.to_string().contains("use at least"), "{e}");
        assert!(!dir.path().join("small").exists(), "a refused geometry created its file");
        // 64 slots fit 64 KiB of metadata with short keys; 200-character model names do not:
        // the journal (4 KiB records = 256) fills, the checkpoint keeps what fits.
        let b = build(spec(64 << 10, 64, "long")).await;
        let long = "x".repeat(200);
        let k = |i: u32| {
            let mut h = [0u8; 32];
            h[..4].copy_from_slice(&i.to_le_bytes());
            ObjectKey::new(h, &long, 1, 0, 0, "").unwrap()
        };
        for i in 0..600 {
            let blob = b.codec.encode(&k(i), Bytes::from(payload(i, 1000))).unwrap();
            let r = b.adapter.store(vec![(k(i), blob)]).await.pop().unwrap();
            assert!(r.is_ok(), "store {i}: {r:?}");
        }
        b.adapter.close().await;
        let b = build(spec(64 << 10, 64, "long")).await;
        let keys: Vec<ObjectKey> = (0..600).map(k).collect();
        let found = b.adapter.lookup(&keys).await.unwrap();
        let n = found.iter().filter(|&&f| f).count();
        assert!((20..=64).contains(&n), "{n} keys after reopening");
        assert!(found[599], "the newest key was dropped");
        for (i, r) in b.adapter.load(&keys).await.into_iter().enumerate() {
            if let Some(bytes) = r.unwrap() {
                assert_eq!(b.codec.decode(&keys[i], &bytes).unwrap(), payload(i as u32, 1000));
            }
        }
    });
}

#[test]
fn raw_block_evicts_oldest_when_full_and_refuses_foreign_devices() {
    let dir = tempfile::tempdir().unwrap();
    let dev = dir.path().join("dev");
    let spec = json!({"type": "raw_block", "device_path": dev, "slot_bytes": 64 * 1024,
        "capacity_bytes": (1 << 20) + 4 * 64 * 1024, "meta_total_bytes": 1 << 20, "use_odirect": false});
    rt().block_on(async {
        let b = build(spec.clone()).await;
        let keys: Vec<ObjectKey> = (0..6).map(|i| key(i, "")).collect();
        for (i, k) in keys.iter().enumerate() {
            let blob = b.codec.encode(k, Bytes::from(payload(i as u32, 1000))).unwrap();
            assert!(b.adapter.store(vec![(k.clone(), blob)]).await[0].is_ok());
        }
        assert_eq!(
            b.adapter.lookup(&keys).await.unwrap(),
            vec![false, false, true, true, true, true]
        );
        // Another geometry on the same device is refused rather than overwriting it.
        let mut other = spec.clone();
        other["slot_bytes"] = json!(128 * 1024);
        let e = config::build(0, &other).await.unwrap_err();
        assert_eq!(e.field, "device_path", "{e}");
        std::fs::write(dir.path().join("foreign"), vec![7u8; 2 << 20]).unwrap();
        let mut foreign = spec;
        foreign["device_path"] = json!(dir.path().join("foreign"));
        let e = config::build(0, &foreign).await.unwrap_err();
        assert!(e.to_string().contains("not an lmcache-rs raw_block device"), "{e}");
        // Foreign data is refused and left exactly as it was: a file shorter than the
        // capacity is not extended, and one whose first 4 KiB are zeros is not formatted.
        for (name, content) in [
            ("short", vec![7u8; 100 * 1024]),
            ("zero-headed", [vec![0u8; 4096], vec![9u8; 60 * 1024]].concat()),
        ] {
            let p = dir.path().join(name);
            std::fs::write(&p, &content).unwrap();
            let mut s = foreign.clone();
            s["device_path"] = json!(p);
            let e = config::build(0, &s).await.unwrap_err();
            assert!(e.to_string().contains("refusing to touch it"), "{name}: {e}");
            assert_eq!(std::fs::read(&p).unwrap(), content, "{name} was changed");
            // Asked to, it formats it.
            s["format"] = json!(true);
            let b = config::build(0, &s).await.unwrap_or_else(|e| panic!("{name}: {e}"));
            let k = key(77, "");
            let blob = b.codec.encode(&k, Bytes::from(payload(77, 1000))).unwrap();
            assert!(b.adapter.store(vec![(k.clone(), blob)]).await[0].is_ok());
            b.adapter.close().await;
            // Then it is ours: reopened without "format", it keeps what it holds.
            s["format"] = json!(false);
            let b = config::build(0, &s).await.unwrap();
            assert_eq!(b.adapter.lookup(&[k]).await.unwrap(), vec![true], "{name}");
        }
        // A raw_block device of another geometry is still refused, even with "format"
        // unset; with it, it is formatted for the new geometry.
        let mut other_fmt = other;
        other_fmt["format"] = json!(true);
        assert!(config::build(0, &other_fmt).await.is_ok());
    });
}

#[test]
fn redis_single_node_conforms() {
    let Some(addr) = external("LMCACHE_RS_TEST_REDIS") else { return };
    let (host, port) = addr.rsplit_once(':').unwrap();
    rt().block_on(async {
        let spec = json!({"type": "redis", "host": host, "port": port.parse::<u16>().unwrap(),
            "key_prefix": "conformance", "serde": {"type": "lz4"}});
        conformance(&build(spec).await, SIZES).await;
        let spec = json!({"type": "valkey", "startup_nodes": addr, "num_workers": 2});
        conformance(&build(spec).await, SIZES).await;
        // A fixed pipeline depth instead of the byte window: one command at a time.
        let spec = json!({"type": "redis", "host": host, "port": port.parse::<u16>().unwrap(),
            "key_prefix": "depth1", "pipeline_depth": 1});
        conformance(&build(spec).await, SIZES).await;
    });
}

#[test]
fn redis_cluster_conforms() {
    let Some(nodes) = external("LMCACHE_RS_TEST_REDIS_CLUSTER") else { return };
    rt().block_on(async {
        let spec = json!({"type": "valkey", "startup_nodes": nodes, "cluster_mode": true});
        let b = build(spec).await;
        conformance(&b, SIZES).await;
        // Keys spread over every node's slots.
        let many: Vec<ObjectKey> = (100..164).map(|i| key(i, "")).collect();
        let items = many
            .iter()
            .map(|k| (k.clone(), b.codec.encode(k, Bytes::from_static(b"x")).unwrap()))
            .collect();
        assert!(b.adapter.store(items).await.iter().all(Result::is_ok));
        assert_eq!(b.adapter.lookup(&many).await.unwrap(), vec![true; 64]);
        b.adapter.delete(&many).await.unwrap();
    });
}

#[test]
fn bad_redis_and_s3_endpoints_fail_at_start_naming_the_field() {
    rt().block_on(async {
        let e = config::build(
            3,
            &json!({"type": "redis", "host": "127.0.0.1", "port": 1,
            "connection_timeout": 1}),
        )
        .await
        .unwrap_err();
        assert_eq!((e.index, e.field.as_str()), (3, "host"), "{e}");
        assert!(e.to_string().contains("127.0.0.1:1"), "{e}");
        let e = config::build(
            0,
            &json!({"type": "s3", "endpoint_url": "http://127.0.0.1:1",
            "bucket": "b", "connection_timeout": 1, "max_retries": 0}),
        )
        .await
        .unwrap_err();
        assert_eq!(e.field, "bucket", "{e}");
        for (spec, field) in [
            (json!({}), "type"),
            (json!({"type": "nfs"}), "type"),
            (json!({"type": "fs"}), "base_path"),
            (json!({"type": "fs", "base_path": "/tmp/x", "basepath": 1}), "basepath"),
            (json!({"type": "raw_block", "device_path": "/tmp/x"}), "slot_bytes"),
            (json!({"type": "mock"}), "max_size_gb"),
            (json!({"type": "fault_inject", "inner": {"type": "mock"}}), "inner.max_size_gb"),
            (json!({"type": "redis", "port": 6379}), "host"),
        ] {
            let e = config::build(0, &spec).await.unwrap_err();
            assert_eq!(e.field, field, "{spec}: {e}");
        }
    });
}

#[test]
fn s3_conforms_including_multipart_and_listing() {
    let Some(endpoint) = external("LMCACHE_RS_TEST_S3") else { return };
    rt().block_on(async {
        let spec = json!({"type": "s3", "endpoint_url": endpoint, "bucket": "lmcache-rs-test",
            "aws_access_key_id": "test", "aws_secret_access_key": "test",
            "multipart_threshold_bytes": 6 << 20, "part_size_bytes": 5 << 20});
        let b = build(spec).await;
        let mut sizes = SIZES.to_vec();
        sizes.push(12 << 20); // multipart: three parts
        conformance(&b, &sizes).await;
        // Listing pages: every key once, in pages that always move forward, and never an
        // object under a deeper prefix (another adapter's, or someone else's), even one named
        // like a wire key whose model sorts before ours.
        let keys: Vec<ObjectKey> = (200..230).map(|i| key(i, "")).collect();
        let items = keys
            .iter()
            .map(|k| (k.clone(), b.codec.encode(k, Bytes::from_static(b"kv")).unwrap()))
            .collect();
        assert!(b.adapter.store(items).await.iter().all(Result::is_ok));
        let foreign_prefix = format!("foreign-{}", std::process::id());
        let other =
            build(json!({"type": "s3", "endpoint_url": endpoint, "bucket": "lmcache-rs-test",
            "aws_access_key_id": "test", "aws_secret_access_key": "test",
            "s3_prefix": foreign_prefix}))
            .await;
        let foreign: Vec<ObjectKey> = (0..10)
            .map(|i| {
                ObjectKey::new([i as u8 + 1; 32], "meta-llama/Llama-3.1-8B", 1, 0, 0, "").unwrap()
            })
            .collect();
        let items = foreign
            .iter()
            .map(|k| (k.clone(), other.codec.encode(k, Bytes::from_static(b"kv")).unwrap()))
            .collect();
        assert!(other.adapter.store(items).await.iter().all(Result::is_ok));
        let mut seen = Vec::new();
        let mut cursor: Option<String> = None;
        for page_no in 0.. {
            assert!(page_no < 100, "listing does not end: cursor stuck at {cursor:?}");
            let page = b.adapter.list(&KeyFilter::ALL, cursor.as_deref(), 7).await.unwrap();
            assert!(page.keys.len() <= 7);
            seen.extend(page.keys.into_iter().map(|(k, _)| k));
            match page.next {
                Some(c) => {
                    assert!(cursor.as_ref().is_none_or(|old| *old != c), "cursor did not move");
                    cursor = Some(c);
                }
                None => break,
            }
        }
        for k in &keys {
            assert_eq!(seen.iter().filter(|s| *s == k).count(), 1, "{k} listed once");
        }
        assert!(!seen.iter().any(|k| foreign.contains(k)), "listed another prefix's objects");
        let scanned = b.adapter.scan(100_000).await.unwrap();
        assert!(!scanned.iter().any(|(k, _)| foreign.contains(k)), "scanned another prefix");
        let theirs = other.adapter.list(&KeyFilter::ALL, None, 100).await.unwrap();
        assert_eq!(theirs.keys.len(), foreign.len(), "the prefixed adapter lists its own keys");
        b.adapter.delete(&keys).await.unwrap();
        other.adapter.delete(&foreign).await.unwrap();
    });
}

/// A store cancelled in the middle of a multipart upload (its caller gave up) leaves no
/// incomplete upload in the bucket: the upload runs to its end, or is aborted.
#[test]
fn s3_a_cancelled_multipart_upload_leaves_nothing_behind() {
    let Some(endpoint) = external("LMCACHE_RS_TEST_S3") else { return };
    let uploads = || {
        let url = format!("{endpoint}/lmcache-rs-test?uploads");
        ureq::get(&url).call().unwrap().into_body().read_to_string().unwrap()
    };
    rt().block_on(async {
        let spec = json!({"type": "s3", "endpoint_url": endpoint, "bucket": "lmcache-rs-test",
            "aws_access_key_id": "test", "aws_secret_access_key": "test",
            "multipart_threshold_bytes": 6 << 20, "part_size_bytes": 5 << 20});
        let b = build(spec).await;
        for (i, after_ms) in [(4242u32, 5u64), (4243, 60), (4244, 200)] {
            let k = key(i, "");
            let hex = k.chunk_hash.to_hex();
            let blob = b.codec.encode(&k, Bytes::from(payload(i, 24 << 20))).unwrap();
            let store = b.adapter.store(vec![(k.clone(), blob)]);
            let cancelled = tokio::time::timeout(Duration::from_millis(after_ms), store).await;
            let t0 = Instant::now();
            while uploads().contains(&hex) {
                assert!(t0.elapsed() < Duration::from_secs(30), "an incomplete upload was left");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            // Whole or absent, never torn.
            match b.adapter.load(std::slice::from_ref(&k)).await.pop().unwrap().unwrap() {
                Some(bytes) => {
                    assert_eq!(b.codec.decode(&k, &bytes).unwrap(), payload(i, 24 << 20))
                }
                None => assert!(cancelled.is_err(), "a store that returned is missing"),
            }
            let _ = b.adapter.delete(&[k]).await;
        }
    });
}

#[test]
fn redis_with_a_password() {
    let Some(addr) = external("LMCACHE_RS_TEST_REDIS_AUTH") else { return };
    let pw = std::env::var("LMCACHE_RS_TEST_REDIS_PASSWORD").unwrap();
    let (host, port) = addr.rsplit_once(':').unwrap();
    let port: u16 = port.parse().unwrap();
    rt().block_on(async {
        let spec = json!({"type": "redis", "host": host, "port": port, "password": pw});
        let b = build(spec.clone()).await;
        assert_eq!(b.spec["password"], "***", "the password must not be shown");
        conformance(&b, SIZES).await;
        for bad in [
            json!({"type": "redis", "host": host, "port": port}),
            json!({"type": "redis", "host": host, "port": port, "password": "wrong"}),
        ] {
            let e = config::build(0, &bad).await.unwrap_err();
            assert_eq!(e.field, "host", "{e}");
        }
    });
}

/// Builds `plugin-example/memory_plugin.c` with gcc (a fresh machine has it) into `dir`.
fn build_plugin(dir: &std::path::Path, name: &str, extra: &[&str]) -> std::path::PathBuf {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = dir.join(format!("lib{name}.so"));
    let status = std::process::Command::new("gcc")
        .args(["-shared", "-fPIC", "-O2", "-pthread", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(root.join("include"))
        .args(extra)
        .arg("-o")
        .arg(&out)
        .arg(root.join("plugin-example/memory_plugin.c"))
        .status()
        .expect("gcc must be installed to build the example plugin");
    assert!(status.success(), "gcc failed on the example plugin");
    out
}

fn plugin_spec(path: &std::path::Path, config: Value) -> Value {
    json!({"type": "native_plugin", "path": path, "config": config})
}

#[test]
fn native_plugin_conforms_at_realistic_sizes_and_under_concurrency() {
    let dir = tempfile::tempdir().unwrap();
    let lib = build_plugin(dir.path(), "memory_plugin", &[]);
    rt().block_on(async {
        let b = build(plugin_spec(&lib, json!({}))).await;
        assert_eq!(b.adapter.describe()["plugin"], "example-memory");
        conformance(&b, &[0, 1, 4096, 1 << 20, 300_001, 32 << 20]).await;
        // Eight clients store and load the same keys at once: every store lands once, every
        // load verifies.
        let keys: Vec<ObjectKey> = (0..6).map(|i| key(100 + i, "")).collect();
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let (a, codec, keys) = (b.adapter.clone(), b.codec.clone(), keys.clone());
                tokio::spawn(async move {
                    let items = keys
                        .iter()
                        .enumerate()
                        .map(|(i, k)| {
                            (
                                k.clone(),
                                codec.encode(k, Bytes::from(payload(i as u32, 70_000))).unwrap(),
                            )
                        })
                        .collect();
                    for r in a.store(items).await {
                        assert!(r.is_ok(), "{r:?}");
                    }
                    for (i, (k, r)) in keys.iter().zip(a.load(&keys).await).enumerate() {
                        let bytes = r.unwrap().expect("stored by some client");
                        assert_eq!(codec.decode(k, &bytes).unwrap(), payload(i as u32, 70_000));
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(b.adapter.delete(&keys).await.unwrap(), 6);
    });
}

#[test]
fn a_native_plugin_of_another_abi_or_config_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let old = build_plugin(dir.path(), "abi2", &["-DEXAMPLE_ABI_VERSION=2"]);
    let good = build_plugin(dir.path(), "memory_plugin", &[]);
    rt().block_on(async {
        let e = config::build(0, &plugin_spec(&old, json!({}))).await.unwrap_err().to_string();
        assert!(e.contains("\"example-memory\"") && e.contains("ABI version 2"), "{e}");
        let e =
            config::build(0, &plugin_spec(&good, json!({"bad": 1}))).await.unwrap_err().to_string();
        assert!(e.contains("bad: not a setting"), "{e}");
        let e = config::build(0, &plugin_spec(std::path::Path::new("/no/such/lib.so"), json!({})))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("/no/such/lib.so"), "{e}");
        let e = config::build(0, &json!({"type": "native_plugin", "path": "rel/lib.so"}))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("absolute"), "{e}");
    });
}

#[test]
fn a_lying_or_refusing_native_plugin_never_serves_wrong_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let lib = build_plugin(dir.path(), "memory_plugin", &[]);
    rt().block_on(async {
        let b = build(plugin_spec(&lib, json!({"corrupt": true}))).await;
        let k = key(1, "");
        let blob = b.codec.encode(&k, Bytes::from(payload(1, 4096))).unwrap();
        assert!(b.adapter.store(vec![(k.clone(), blob)]).await[0].is_ok());
        let bytes = b.adapter.load(std::slice::from_ref(&k)).await.pop().unwrap().unwrap().unwrap();
        assert!(b.codec.decode(&k, &bytes).is_err(), "a flipped byte must fail the blob checks");
        let r = build(plugin_spec(&lib, json!({"refuse": true}))).await;
        let blob = r.codec.encode(&k, Bytes::from(payload(1, 16))).unwrap();
        let e = r.adapter.store(vec![(k.clone(), blob)]).await.pop().unwrap().unwrap_err();
        assert!(e.to_string().contains("refused"), "{e}");
        assert!(r.adapter.lookup(std::slice::from_ref(&k)).await.is_err());
        // A batch the plugin has not finished when the time runs out fails (transient);
        // the plugin completes it later, into memory the adapter kept for it, and the next
        // batch is served.
        let spec = json!({"type": "native_plugin", "path": lib, "config": {"stall_ms": 400},
                          "timeout_secs": 0.1});
        let slow = build(spec).await;
        let blob = slow.codec.encode(&k, Bytes::from(payload(1, 1 << 20))).unwrap();
        let e = slow.adapter.store(vec![(k.clone(), blob)]).await.pop().unwrap().unwrap_err();
        assert!(e.to_string().contains("did not complete in time"), "{e}");
        tokio::time::sleep(Duration::from_millis(1200)).await;
        drop(slow); // destroy waits for what is queued
    });
}

#[test]
fn dax_conforms_on_a_file_and_never_takes_what_is_not_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let dev = dir.path().join("dax0");
    let spec = |path: &std::path::Path, extra: Value| {
        let mut s = json!({"type": "dax", "device_path": path, "max_dax_size_gb": 0.25,
                           "slot_bytes": 33 << 20});
        if let (Some(o), Value::Object(e)) = (s.as_object_mut(), extra) {
            o.extend(e);
        }
        s
    };
    rt().block_on(async {
        {
            let b = build(spec(&dev, json!({}))).await;
            conformance(&b, &[0, 1, 4096, 1 << 20, 300_001, 32 << 20]).await;
            // Seven 33 MiB slots in 256 MiB after the header: the eighth store is refused.
            let keys: Vec<ObjectKey> = (0..8).map(|i| key(500 + i, "")).collect();
            let items: Vec<_> = keys
                .iter()
                .map(|k| (k.clone(), b.codec.encode(k, Bytes::from(vec![7u8; 1 << 20])).unwrap()))
                .collect();
            let results = b.adapter.store(items).await;
            assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 7, "{results:?}");
            assert!(matches!(results[7], Err(lmcache_l2::L2Error::Full { .. })));
            // While it is open, nobody else (an L1 on the file, another L2) gets the device.
            let e = config::build(0, &spec(&dev, json!({}))).await.unwrap_err().to_string();
            assert!(e.contains("in use"), "{e}");
        }
        // Reopened: ours, so taken (empty: the index is volatile, as LMCache's).
        let b = build(spec(&dev, json!({}))).await;
        assert_eq!(b.adapter.lookup(&[key(500, "")]).await.unwrap(), vec![false]);
        drop(b);
        // Someone else's file is refused and left as it was, unless formatting is asked.
        let foreign = dir.path().join("foreign");
        std::fs::write(&foreign, b"not ours").unwrap();
        let e = config::build(0, &spec(&foreign, json!({}))).await.unwrap_err().to_string();
        assert!(e.contains("left as it was"), "{e}");
        assert_eq!(std::fs::read(&foreign).unwrap(), b"not ours");
        assert!(config::build(0, &spec(&foreign, json!({"format": true}))).await.is_ok());
        let e =
            config::build(0, &spec(&dev, json!({"devices": []}))).await.unwrap_err().to_string();
        assert!(e.contains("one device per dax adapter"), "{e}");
        // A character device that is not device-dax (/dev/zero maps, as shared anonymous
        // memory) is refused by name, formatting asked or not: it used to be taken.
        for extra in [json!({}), json!({"format": true})] {
            let zero = std::path::Path::new("/dev/zero");
            let e = config::build(0, &spec(zero, extra)).await.unwrap_err().to_string();
            assert!(e.contains("is not a device-dax device"), "{e}");
        }
    });
}
