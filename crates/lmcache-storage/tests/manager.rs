//! StorageManager as the one owner of both tiers: lookups (ready or pending on a prefetch),
//! the leases a retrieve spends, and deletes, listings and quotas across tiers.
#![allow(missing_docs, clippy::allow_attributes)]

use std::time::{Duration, Instant};

use lmcache_core::{CacheSalt, ObjectKey};
use lmcache_l1::{L1Cache, WriteRequest};
use lmcache_storage::{
    DeleteScope, Lookup, LookupRequest, StorageError, StorageManager, TierConfig, TierName,
};
use serde_json::json;

mod common;

const OBJ: u64 = 16 * 1024;

fn key(shard: u32, i: u32) -> ObjectKey {
    let mut h = [0u8; 32];
    h[..4].copy_from_slice(&i.to_le_bytes());
    ObjectKey::new(h, "test/model", 2, shard, 0, "").unwrap()
}

fn put(m: &StorageManager, k: &ObjectKey, fill: u8) {
    let mut w = m.reserve_write(&[WriteRequest::new(k.clone(), OBJ)]).pop().unwrap().unwrap();
    w.as_mut_slice().fill(fill);
    assert!(m.commit(vec![w]).pop().unwrap().is_ok());
}

fn request(chunks: u32, readers: u32) -> LookupRequest {
    LookupRequest {
        shards: (0..2).map(|w| (w, (0..chunks).map(|i| key(w, i)).collect())).collect(),
        world_size: 2,
        readers,
    }
}

fn manager_with_l2(l1: &L1Cache) -> StorageManager {
    let tier = lmcache_storage::L2Tier::start(
        l1.clone(),
        &[json!({"type": "mock", "max_size_gb": 1, "latency_ms": 100})],
        TierConfig::default(),
    )
    .unwrap();
    StorageManager::new(l1.clone(), Some(tier))
}

#[test]
fn an_l1_lookup_is_ready_with_the_common_prefix_locked_per_shard() {
    let l1 = common::l1(8 << 20);
    let m = StorageManager::new(l1.clone(), None);
    for i in 0..3 {
        put(&m, &key(0, i), i as u8);
    }
    for i in 0..2 {
        put(&m, &key(1, i), 0x10 + i as u8);
    }
    let mut lookup = m.lookup(&request(4, 2));
    assert_eq!(lookup.hits(), Some(2), "a chunk counts only when every shard holds it");
    assert!(!lookup.is_pending() && lookup.settle().is_none());
    assert_eq!(l1.usage().locked_objects, 4, "shard 0's third chunk must not stay locked");
    let leases = lookup.leases_mut();
    assert_eq!((leases.held(0), leases.held(1)), (2, 2));

    // Each reader spends one of the two locks; a third take finds none.
    let first = leases.take_one(1, 0..2);
    assert!(first.iter().all(|l| l.as_ref().is_some_and(|l| l.count() == 1)));
    drop(first);
    assert_eq!(l1.usage().locked_objects, 4, "one lock of two is still held");
    drop(leases.take_one(1, 0..2));
    assert_eq!(leases.held(1), 0);
    assert!(leases.take_one(1, 0..2).iter().all(Option::is_none));
    drop(lookup);
    assert_eq!(l1.usage().locked_objects, 0, "dropping the lookup releases shard 0's locks");
}

#[test]
fn retrieve_leases_spend_what_matches_and_lock_the_rest() {
    let l1 = common::l1(8 << 20);
    let m = StorageManager::new(l1.clone(), None);
    for i in 0..3 {
        put(&m, &key(0, i), i as u8);
    }
    let mut lookup = m.lookup(&LookupRequest {
        shards: vec![(0, (0..3).map(|i| key(0, i)).collect())],
        world_size: 2,
        readers: 1,
    });
    assert_eq!(lookup.hits(), Some(3));
    let spent = lookup.leases_mut().take_one(0, 0..3);
    // A lease on another key (a stale range) is not served for this one: chunk 1 gets a new
    // lock of its own key, chunk 2 one of a key that is not there.
    let mut spent = spent;
    spent.swap(1, 2);
    let keys = [key(0, 0), key(0, 1), key(0, 9)];
    let got = m.retrieve_leases(spent, &keys);
    assert_eq!(got[0].as_ref().unwrap().key(), &keys[0]);
    assert_eq!(got[0].as_ref().unwrap().bytes()[0], 0);
    assert_eq!(got[1].as_ref().unwrap().key(), &keys[1]);
    assert_eq!(got[1].as_ref().unwrap().bytes()[0], 1);
    assert!(got[2].is_err(), "a key L1 lacks is a miss, never another key's bytes");
    drop(got);
    assert_eq!(l1.usage().locked_objects, 0, "every lease was spent or released");
}

#[test]
fn a_short_lookup_is_pending_until_l2_fills_it_then_settles_once() {
    let l1 = common::l1(8 << 20);
    let m = manager_with_l2(&l1);
    for w in 0..2 {
        for i in 0..3 {
            put(&m, &key(w, i), i as u8);
        }
    }
    assert_eq!(m.flush(Duration::from_secs(10)), 0);
    // Only the first chunk stays in L1.
    let gone: Vec<ObjectKey> = (0..2).flat_map(|w| (1..3).map(move |i| key(w, i))).collect();
    assert!(l1.delete(&gone, false).iter().all(Result::is_ok));
    let mut lookup = m.lookup(&request(3, 1));
    assert!(lookup.is_pending() && lookup.hits().is_none());
    assert_eq!(lookup.l1_hit(), 1);
    let waiter = lookup.waiter().expect("a pending lookup has a waiter");
    assert!(waiter.wait(Duration::from_secs(5)), "the prefetch did not end");
    let settled = lookup.settle().expect("settles once the prefetch ended");
    assert_eq!((settled.hits, settled.l2_hits, settled.loaded_keys), (3, 2, 4));
    assert!(lookup.settle().is_none(), "settled exactly once");
    assert!(matches!(lookup, Lookup::Ready { hits: 3, .. }));
    assert_eq!(lookup.leases_mut().held(1), 3, "L1 and L2 leases joined per shard");

    // An abandoned pending lookup leaves no lease once its prefetch ends.
    assert!(l1.delete(&gone, true).iter().all(Result::is_ok));
    drop(lookup);
    let abandoned = m.lookup(&request(3, 1));
    assert!(abandoned.is_pending());
    drop(abandoned);
    let t0 = Instant::now();
    while l1.usage().locked_objects > 0 {
        assert!(t0.elapsed() < Duration::from_secs(5), "an abandoned prefetch kept its leases");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn deletes_listings_and_quotas_go_through_the_manager() {
    let l1 = common::l1(8 << 20);
    let bare = StorageManager::new(l1.clone(), None);
    assert!(matches!(bare.quotas(TierName::L2), Err(StorageError::NoL2)));
    assert!(bare.quotas(TierName::L1).unwrap().is_empty());
    drop(bare);

    let m = manager_with_l2(&l1);
    let keys: Vec<ObjectKey> = (0..4).map(|i| key(0, i)).collect();
    for k in &keys {
        put(&m, k, 1);
    }
    assert_eq!(m.flush(Duration::from_secs(10)), 0);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let page = m.list_l2(None, lmcache_l2::KeyFilter::ALL, None, 100).await.unwrap();
        assert_eq!(page.page.keys.len(), 4);
        assert!(matches!(
            m.list_l2(Some(7), lmcache_l2::KeyFilter::ALL, None, 100).await,
            Err(StorageError::NoSuchAdapter { id: 7 })
        ));
        // L1 only: L2 keeps them.
        let r = m.delete(DeleteScope::L1, None, keys[..2].to_vec(), false).await.unwrap();
        assert_eq!((r.deleted, r.skipped), (2, 0));
        assert_eq!(
            m.list_l2(None, lmcache_l2::KeyFilter::ALL, None, 100).await.unwrap().page.keys.len(),
            4
        );
        // Both tiers: two L1 objects and four L2 keys... of the two asked, both tiers count.
        let r = m.delete(DeleteScope::All, None, keys[2..].to_vec(), false).await.unwrap();
        assert_eq!((r.deleted, r.skipped), (4, 0));
        assert_eq!(
            m.list_l2(None, lmcache_l2::KeyFilter::ALL, None, 100).await.unwrap().page.keys.len(),
            2
        );
        assert!(matches!(
            m.delete(DeleteScope::L2, Some(9), keys.clone(), false).await,
            Err(StorageError::NoSuchAdapter { id: 9 })
        ));
        // Adapters attach and detach through the manager, off the caller's runtime.
        let id = m.add_adapter(json!({"type": "mock", "max_size_gb": 1})).await.unwrap();
        assert_eq!(m.describe_l2().len(), 2);
        m.remove_adapter(id).await.unwrap();
        assert!(matches!(m.remove_adapter(id).await, Err(StorageError::NoSuchAdapter { .. })));
        assert!(matches!(
            m.add_adapter(json!({"type": "nope"})).await,
            Err(StorageError::Config(_))
        ));
        // A native plugin runs a library's code: never added at run time (over HTTP), even
        // nested, and refused before anything is loaded.
        for spec in [
            json!({"type": "native_plugin", "path": "/tmp/libx.so"}),
            json!({"type": "fault_inject", "inner": {"type": "native_plugin", "path": "/tmp/libx.so"}}),
        ] {
            let e = m.add_adapter(spec).await.unwrap_err().to_string();
            assert!(e.contains("loaded only at start"), "{e}");
        }
        assert_eq!(m.describe_l2().len(), 1);
    });
    let salt = CacheSalt::new("tenant").unwrap();
    m.set_quota(TierName::L2, &salt, Some(1 << 20)).unwrap();
    assert_eq!(m.quota(TierName::L2, &salt).unwrap(), Some(1 << 20));
    assert_eq!(m.quota(TierName::L1, &salt).unwrap(), None, "tiers keep their own quotas");
    m.set_quota(TierName::L2, &salt, None).unwrap();
    assert!(m.quotas(TierName::L2).unwrap().is_empty());
}

/// A delete across adapters where one fails: the error names that adapter (id and type, not
/// "adapter 0"), and the other adapters' copies are deleted anyway.
#[test]
fn a_failed_l2_delete_names_its_adapter_and_the_others_still_delete() {
    let l1 = common::l1(8 << 20);
    let tier = lmcache_storage::L2Tier::start(
        l1.clone(),
        &[
            json!({"type": "mock", "max_size_gb": 1}),
            json!({"type": "fault_inject", "rate": 1.0, "mode": "fail", "ops": ["delete"],
                   "inner": {"type": "mock", "max_size_gb": 1}}),
            json!({"type": "mock", "max_size_gb": 1}),
        ],
        TierConfig::default(),
    )
    .unwrap();
    let m = StorageManager::new(l1.clone(), Some(tier));
    let keys: Vec<ObjectKey> = (0..3).map(|i| key(0, i)).collect();
    for k in &keys {
        put(&m, k, 1);
    }
    assert_eq!(m.flush(Duration::from_secs(10)), 0);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        match m.delete(DeleteScope::L2, None, keys.clone(), false).await {
            Err(StorageError::Adapter { id, kind, .. }) => {
                assert_eq!((id, kind.as_str()), (1, "fault_inject"));
            }
            other => panic!("expected the fault_inject adapter's failure, got {other:?}"),
        }
        for id in [0, 2] {
            let left = m.list_l2(Some(id), lmcache_l2::KeyFilter::ALL, None, 100).await.unwrap();
            assert!(left.page.keys.is_empty(), "adapter {id} kept keys after the delete");
        }
        let kept = m.list_l2(Some(1), lmcache_l2::KeyFilter::ALL, None, 100).await.unwrap();
        assert_eq!(kept.page.keys.len(), 3, "the failing adapter lost keys");
    });
}

/// Records what it hears, one line per event.
#[derive(Debug, Default)]
struct Heard(parking_lot::Mutex<Vec<String>>);

impl lmcache_storage::StorageSubscriber for Heard {
    fn on_event(&self, e: &lmcache_storage::StorageEvent<'_>) {
        use lmcache_storage::StorageEvent as E;
        let line = match e {
            E::LookupStarted { ctx, request } => {
                format!("lookup {} groups={}", ctx.request_id, request.groups.len())
            }
            E::LookedUp { l1_hits, shards, pending, .. } => {
                format!("looked-up hits={l1_hits} shards={shards} pending={pending}")
            }
            E::WriteReserving { keys, object_group, .. } => {
                format!("reserving {} og={object_group}", keys.len())
            }
            E::WriteRefused { error, .. } => format!("refused {error}"),
            E::Committed { results, .. } => {
                format!(
                    "committed {}/{}",
                    results.iter().filter(|r| r.is_ok()).count(),
                    results.len()
                )
            }
            E::ReadLeased { keys, .. } => format!("read {}", keys.len()),
            E::StoreFinished { committed, .. } => format!("stored {committed:?}"),
            E::LookupSettled { settled, .. } => format!("settled hits={}", settled.hits),
            E::SessionEnded { touched, .. } => format!("ended touched={}", touched.len()),
            other => format!("{other:?}"),
        };
        self.0.lock().push(line);
    }
}

#[test]
fn a_request_scope_announces_every_call_with_its_outcome() {
    let l1 = common::l1(8 << 20);
    let m = StorageManager::new(l1.clone(), None);
    let heard = std::sync::Arc::new(Heard::default());
    assert!(m.subscribe(vec![heard.clone()]));
    assert!(!m.subscribe(vec![heard.clone()]), "subscribers are installed once");
    let model = lmcache_core::ModelName::new("test/model").unwrap();
    let hashes: Vec<lmcache_core::ChunkHash> = (0..2).map(|i| key(0, i).chunk_hash).collect();
    let ctx = lmcache_storage::RequestContext {
        request_id: "r",
        model: &model,
        shard: 0,
        chunk_size: 256,
        first_chunk: 0,
        hashes: &hashes,
        parent: None,
        tokens: &[],
        objects: &[],
    };
    let scope = m.scope(&ctx);
    // Two chunks fit, a third of the whole L1's size is refused.
    let reqs = vec![
        WriteRequest::new(key(0, 0), OBJ),
        WriteRequest::new(key(0, 1), OBJ),
        WriteRequest::new(key(0, 2), 64 << 20),
    ];
    let writes: Vec<_> = scope
        .reserve_for_store(0, &reqs)
        .into_iter()
        .filter_map(|s| match s {
            lmcache_storage::StoreSlot::Write(w) => Some(w),
            _ => None,
        })
        .collect();
    assert!(scope.commit(writes).iter().all(Result::is_ok));
    scope.store_finished(&[0, 1], 2 * OBJ, None);
    let lookup = scope.lookup(&lmcache_storage::GroupLookupRequest {
        groups: vec![(None, vec![(0, vec![key(0, 0), key(0, 1)])])],
        world_size: 1,
        readers: 1,
    });
    assert_eq!(lookup.hits(), Some(2));
    let leases = scope.retrieve_leases(Vec::new(), &[key(0, 0)]);
    assert!(leases[0].is_ok());
    m.end_session("r", &[key(0, 0)]);
    let heard = heard.0.lock().clone();
    assert_eq!(heard.len(), 8, "{heard:#?}");
    assert_eq!(heard[0], "reserving 3 og=0");
    assert!(heard[1].starts_with("refused "), "{heard:#?}");
    assert_eq!(
        heard[2..],
        [
            "committed 2/2",
            "stored [0, 1]",
            "lookup r groups=1",
            "looked-up hits=2 shards=1 pending=false",
            "read 1",
            "ended touched=1",
        ]
        .map(str::to_owned)
    );
}

/// A fleet of peers in a test: it holds `held` (per key, a fill byte) and serves a fetch's
/// longest prefix held on every shard into the manager's L1, as the server's reader does.
#[derive(Debug)]
struct FakePeers {
    storage: StorageManager,
    held: std::collections::HashMap<ObjectKey, u8>,
    asked: std::sync::Mutex<Vec<usize>>,
}

impl lmcache_storage::PeerSource for FakePeers {
    fn has_peers(&self) -> bool {
        true
    }

    fn start(&self, req: lmcache_storage::PeerFetch, done: lmcache_storage::PeerDone) {
        self.asked.lock().unwrap().push(req.shards.first().map_or(0, Vec::len));
        let chunks = req.shards.first().map_or(0, Vec::len);
        let hits = (0..chunks)
            .take_while(|&i| req.shards.iter().all(|k| self.held.contains_key(&k[i])))
            .count();
        let mut out = lmcache_storage::PrefetchOutcome { hits, ..Default::default() };
        for keys in &req.shards {
            let mut leases = Vec::new();
            for k in &keys[..hits] {
                let reqs = [WriteRequest::new(k.clone(), OBJ)];
                let mut w = self.storage.reserve_write(&reqs).pop().unwrap().unwrap();
                w.as_mut_slice().fill(self.held[k]);
                leases.push(w.commit_and_read_lock(req.readers).unwrap());
                out.loaded_keys += 1;
                out.loaded_bytes += OBJ;
            }
            out.leases.push(leases);
        }
        std::thread::spawn(move || done.complete(out));
    }
}

#[test]
fn peers_are_asked_for_what_l1_and_then_l2_could_not_serve() {
    let l1 = common::l1(8 << 20);
    let m = manager_with_l2(&l1);
    // Chunk 0 in L1, chunk 1 only in L2, chunks 2 and 3 only on a peer, chunk 4 nowhere.
    for w in 0..2 {
        for i in 0..2 {
            put(&m, &key(w, i), i as u8);
        }
    }
    assert_eq!(m.flush(Duration::from_secs(10)), 0);
    let gone: Vec<ObjectKey> = (0..2).map(|w| key(w, 1)).collect();
    assert!(l1.delete(&gone, true).iter().all(Result::is_ok));
    let held = (0..2).flat_map(|w| (2..4).map(move |i| (key(w, i), 0x20 + i as u8))).collect();
    let peers = std::sync::Arc::new(FakePeers {
        storage: m.clone(),
        held,
        asked: std::sync::Mutex::default(),
    });
    assert!(m.set_peer_source(peers.clone()));

    let mut lookup = m.lookup(&request(5, 1));
    assert_eq!(lookup.l1_hit(), 1);
    assert!(lookup.waiter().unwrap().wait(Duration::from_secs(5)), "L2 then peers never ended");
    let settled = lookup.settle().unwrap();
    assert_eq!(settled.hits, 4, "L1 served 1, L2 1, the peers 2; chunk 4 is held nowhere");
    assert_eq!(settled.loaded_keys, 2 + 4, "2 objects from L2, 4 from the peers");
    assert_eq!(*peers.asked.lock().unwrap(), vec![3], "the peers were asked for chunks 2..5");
    let leases = lookup.leases_mut();
    for w in 0..2 {
        let got = leases.take_one(w, 0..4);
        let fills: Vec<u8> = got.iter().map(|l| l.as_ref().unwrap().bytes()[0]).collect();
        assert_eq!(fills, [0, 1, 0x22, 0x23], "shard {w}: every chunk from its own source");
    }
    drop(lookup);
    assert_eq!(l1.usage().locked_objects, 0, "every lease was spent or released");

    // When L1 and L2 serve everything, the peers are not asked.
    let mut lookup = m.lookup(&request(4, 1));
    if lookup.is_pending() {
        assert!(lookup.waiter().unwrap().wait(Duration::from_secs(5)));
        lookup.settle();
    }
    assert!(matches!(lookup, Lookup::Ready { hits: 4, .. }));
    assert_eq!(peers.asked.lock().unwrap().len(), 1, "a full hit asked the peers");
}
