//! The RPCs a P2P peer serves, over real ZMQ: addresses that point at the stored bytes, locks
//! that hold what a peer is reading, exactly-once answers, and unlocks that release.

use std::time::Duration;

use lmcache_client::{CacheKey, Client};
use lmcache_core::{ModelName, ObjectKey, TokenHasher};
use lmcache_memory::{ArenaBacking, ArenaConfig, ForeignSegment};
use lmcache_protocol::request::{Clear, Command, P2pLookupAndLock, P2pUnlockObjects};
use lmcache_protocol::types::{LayoutDesc, TransferAddress, WireObjectKey};
use lmcache_server::{Server, ServerConfig};
use rmpv::Value;

mod common;

const CHUNK: usize = 16;
const CHUNKS: usize = 3;
/// `[2, 2 layers, 16 slots, 32]` float16.
const OBJECT: u64 = 2 * 2 * 16 * 32 * 2;

fn layout() -> Vec<(u32, LayoutDesc)> {
    vec![(0, LayoutDesc { shapes: vec![vec![2, 2, 16, 32]], dtypes: vec!["float16".into()] })]
}

fn wire(keys: &[ObjectKey]) -> Vec<WireObjectKey> {
    keys.iter().cloned().map(|k| WireObjectKey(Some(k))).collect()
}

fn lookup(c: &mut Client, keys: &[ObjectKey], groups: Vec<(u32, LayoutDesc)>) -> u64 {
    let req = P2pLookupAndLock { keys: wire(keys), group_layout_descs: groups };
    let v = c.send(&Command::P2pLookupAndLock(req)).unwrap().expect("a task id");
    v.as_u64().expect("an int task id")
}

fn answer(c: &mut Client, task: u64) -> Option<Vec<TransferAddress>> {
    match c.send(&Command::P2pQueryLookupResults(task)).unwrap() {
        Some(Value::Nil) | None => None,
        Some(Value::Array(a)) => {
            Some(a.iter().map(|v| TransferAddress::decode("a", v).unwrap()).collect())
        }
        other => panic!("unexpected answer {other:?}"),
    }
}

fn unlock(c: &mut Client, keys: &[ObjectKey]) {
    let cmd = Command::P2pUnlockObjects(P2pUnlockObjects { keys: wire(keys) });
    assert_eq!(c.send(&cmd).unwrap(), None, "unlock is void");
}

#[test]
fn a_peer_reads_locked_objects_at_their_addresses_and_unlocks_them() {
    let server = Server::start(config("reads", false)).unwrap();
    let mut c = Client::connect(server.endpoint(), Duration::from_secs(5)).unwrap();
    let reg = common::small_registration(7, "m", lmcache_core::Dtype::Float16);
    let pool = c.register_engine_driven(&reg).unwrap();
    let pool = ForeignSegment::open(&pool.shm_name, pool.pool_size).unwrap();
    let tokens: Vec<u32> = (0..(CHUNKS * CHUNK) as u32).collect();
    let key = CacheKey::whole(ModelName::new("m").unwrap(), "w", tokens.clone(), CHUNK);
    for (i, s) in c.prepare_store(&key, 7).unwrap() {
        pool.write(s.offset, &vec![0x40 + i as u8; s.length as usize]).unwrap();
    }
    assert!(c.commit_store(&key, 7).unwrap());
    c.end_session("w").unwrap();

    let hashes = TokenHasher::new(CHUNK).unwrap().hash_tokens(&tokens);
    let keys: Vec<ObjectKey> =
        hashes.iter().map(|h| ObjectKey::new(h.0, "m", 1, 0, 0, "").unwrap()).collect();
    let absent = ObjectKey::new([0xee; 32], "m", 1, 0, 0, "").unwrap();

    // Chunks 0 and 2, one absent key, chunk 0 again: sparse, in request order.
    let asked = [keys[0].clone(), absent.clone(), keys[2].clone(), keys[0].clone()];
    let task = lookup(&mut c, &asked, layout());
    let got = answer(&mut c, task).expect("answered");
    assert_eq!(answer(&mut c, task), None, "answered exactly once");
    assert_eq!(answer(&mut c, task + 1000), None, "an unknown task is nil");
    assert_eq!(got.len(), 4);
    assert_eq!(got[1], TransferAddress::MISS);
    for (i, chunk) in [(0, 0u8), (2, 2), (3, 0)] {
        let a = got[i];
        assert!(a.is_hit() && a.size == OBJECT, "{i}: {a:?}");
        // The address is an offset in the pool the peer reads: the stored bytes are there.
        let mut buf = vec![0u8; a.size as usize];
        pool.read(a.offset as u64, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0x40 + chunk), "{i}: not chunk {chunk}'s bytes");
    }

    // What the peer locked survives a clear; the unlocked chunk 1 goes.
    assert_eq!(c.send(&Command::Clear(Clear { force: false })).unwrap(), None);
    let t = lookup(&mut c, &keys, layout());
    let after = answer(&mut c, t).unwrap();
    assert_eq!(after.iter().map(TransferAddress::is_hit).collect::<Vec<_>>(), [true, false, true]);
    unlock(&mut c, &[keys[0].clone(), keys[2].clone()]); // this lookup's own locks

    // Released: one lock per key named, then nothing is left to keep them.
    unlock(&mut c, &asked);
    assert_eq!(c.send(&Command::Clear(Clear { force: false })).unwrap(), None);
    let t = lookup(&mut c, &keys, layout());
    assert!(answer(&mut c, t).unwrap().iter().all(|a| !a.is_hit()), "all released and cleared");

    // Object groups with unequal key counts, or without a layout: every key a miss.
    let other = ObjectKey { object_group_id: 1, ..keys[0].clone() };
    let t = lookup(&mut c, &[keys[0].clone(), keys[1].clone(), other], layout());
    assert_eq!(answer(&mut c, t).unwrap(), vec![TransferAddress::MISS; 3]);
    let t = lookup(&mut c, &[keys[0].clone()], Vec::new());
    assert_eq!(answer(&mut c, t).unwrap(), vec![TransferAddress::MISS]);

    let m = &server.state().metrics;
    assert_eq!(m.p2p_served_keys.get(), 4 + 3 + 3 + 3 + 1);
    assert_eq!(m.p2p_served_hits.get(), 3 + 2);
    assert_eq!(m.p2p_unlocked_keys.get(), 2 + 3);
}

#[test]
fn locks_a_peer_never_releases_expire_and_a_late_unlock_is_counted() {
    let mut config = config("ttl", false);
    config.l1.read_ttl = Duration::from_millis(300);
    let server = Server::start(config).unwrap();
    let mut c = Client::connect(server.endpoint(), Duration::from_secs(5)).unwrap();
    let reg = common::small_registration(7, "m", lmcache_core::Dtype::Float16);
    c.register_engine_driven(&reg).unwrap();
    let tokens: Vec<u32> = (0..CHUNK as u32).collect();
    let key = CacheKey::whole(ModelName::new("m").unwrap(), "w", tokens.clone(), CHUNK);
    assert_eq!(c.prepare_store(&key, 7).unwrap().len(), 1);
    assert!(c.commit_store(&key, 7).unwrap());
    let hash = TokenHasher::new(CHUNK).unwrap().hash_tokens(&tokens)[0];
    let k = ObjectKey::new(hash.0, "m", 1, 0, 0, "").unwrap();
    let t = lookup(&mut c, std::slice::from_ref(&k), layout());
    assert!(answer(&mut c, t).unwrap()[0].is_hit());
    // The peer goes silent past the read TTL: L1's maintenance (every second) expires the
    // lock, and a clear then finds the object free.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while server.state().l1().usage().stats.expired_read_leases == 0 {
        assert!(std::time::Instant::now() < deadline, "the peer's lock never expired");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(c.send(&Command::Clear(Clear { force: false })).unwrap(), None);
    let t = lookup(&mut c, std::slice::from_ref(&k), layout());
    assert!(!answer(&mut c, t).unwrap()[0].is_hit(), "an expired lock kept the object");
    unlock(&mut c, std::slice::from_ref(&k));
    let m = &server.state().metrics;
    assert_eq!((m.p2p_unlocked_keys.get(), m.p2p_unlock_expired.get()), (0, 1));
}

/// A server's config over a 32 MiB shm pool named by `tag`, with the native P2P channel on
/// when `channel`.
fn config(tag: &str, channel: bool) -> ServerConfig {
    let arena = ArenaConfig {
        size: 32 << 20,
        backing: ArenaBacking::SharedMemory {
            name: format!("lmcache_rs_mp_p2p_{tag}_{}", std::process::id()),
        },
        mlock: false,
    };
    ServerConfig {
        chunk_size: CHUNK,
        p2p_channel: channel.then(|| "127.0.0.1:0".parse().unwrap()),
        ..ServerConfig::local(arena)
    }
}

/// A server with the native P2P channel on, over a shm pool named by `tag`.
fn channel_server(tag: &str) -> Server {
    Server::start(config(tag, true)).unwrap()
}

/// Reservations on `reader`'s L1 for `keys`, one object each.
fn reserve(reader: &Server, keys: &[ObjectKey]) -> Vec<lmcache_l1::WriteReservation> {
    let reqs: Vec<_> =
        keys.iter().map(|k| lmcache_l1::WriteRequest::new(k.clone(), OBJECT)).collect();
    reader.state().l1().reserve_write(&reqs).into_iter().map(Result::unwrap).collect()
}

#[test]
fn the_native_channel_moves_locked_objects_into_a_readers_l1_verified() {
    use lmcache_server::p2p_channel::{ChannelError, fetch};
    let peer = channel_server("src");
    let reader = channel_server("dst");
    let mut c = Client::connect(peer.endpoint(), Duration::from_secs(5)).unwrap();
    let reg = common::small_registration(7, "m", lmcache_core::Dtype::Float16);
    let pool = c.register_engine_driven(&reg).unwrap();
    let pool = ForeignSegment::open(&pool.shm_name, pool.pool_size).unwrap();
    let tokens: Vec<u32> = (0..(CHUNKS * CHUNK) as u32).collect();
    let key = CacheKey::whole(ModelName::new("m").unwrap(), "w", tokens.clone(), CHUNK);
    for (i, s) in c.prepare_store(&key, 7).unwrap() {
        let bytes: Vec<u8> = (0..s.length).map(|j| (j as u8).wrapping_mul(31) ^ i as u8).collect();
        pool.write(s.offset, &bytes).unwrap();
    }
    assert!(c.commit_store(&key, 7).unwrap());
    let hashes = TokenHasher::new(CHUNK).unwrap().hash_tokens(&tokens);
    let keys: Vec<ObjectKey> =
        hashes.iter().map(|h| ObjectKey::new(h.0, "m", 1, 0, 0, "").unwrap()).collect();
    // The peer locks chunks 0 and 1 only.
    let t = lookup(&mut c, &keys[..2], layout());
    let addrs = answer(&mut c, t).unwrap();
    let addr = peer.p2p_channel_addr().unwrap();

    let got = fetch(addr, reserve(&reader, &keys), Duration::from_secs(5));
    assert_eq!(got[2].as_ref().err(), Some(&ChannelError::NotServed), "chunk 2 is not locked");
    let filled: Vec<_> = got.into_iter().take(2).map(Result::unwrap).collect();
    for r in reader.state().l1().commit_batch(filled) {
        r.unwrap();
    }
    // Byte for byte what the peer holds at the addresses it answered.
    for (k, a) in keys[..2].iter().zip(&addrs) {
        let lease = reader.state().l1().read_lock(std::slice::from_ref(k), 1).pop().unwrap();
        let mut want = vec![0u8; a.size as usize];
        pool.read(a.offset as u64, &mut want).unwrap();
        assert!(lease.unwrap().bytes() == want.as_slice(), "the fetched object differs");
    }
    assert_eq!(reader.state().l1().usage().staged_objects, 0, "nothing left staged");
    // Once the peer unlocked them, the channel serves them no more.
    unlock(&mut c, &keys[..2]);
    reader.state().l1().clear(true);
    let again = fetch(addr, reserve(&reader, &keys[..1]), Duration::from_secs(5));
    assert_eq!(again[0].as_ref().err(), Some(&ChannelError::NotServed));
}

/// A fake peer channel: answers one request with `answer` (bytes after the request), then
/// closes.
fn fake_peer(answer: Vec<u8>) -> std::net::SocketAddr {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let mut head = [0u8; 12];
        conn.read_exact(&mut head).unwrap();
        let len = u32::from_be_bytes(head[8..12].try_into().unwrap()) as usize;
        let mut body = vec![0u8; len];
        conn.read_exact(&mut body).unwrap();
        let _ = conn.write_all(&answer);
    });
    addr
}

#[test]
fn a_lying_or_dying_peer_gives_misses_and_leaves_nothing_staged() {
    use lmcache_server::p2p_channel::{ChannelError, fetch};
    let reader = channel_server("liar");
    let keys: Vec<ObjectKey> =
        (0..2u8).map(|i| ObjectKey::new([i; 32], "m", 1, 0, 0, "").unwrap()).collect();
    let object = vec![7u8; OBJECT as usize];
    let header = || {
        let mut h = vec![0u8];
        h.extend_from_slice(&OBJECT.to_be_bytes());
        h
    };
    // Bytes that do not hash to what the peer announced after them.
    let mut lie = header();
    lie.extend_from_slice(&object);
    lie.extend_from_slice(&twox_hash::XxHash3_64::oneshot(b"something else").to_be_bytes());
    let got = fetch(fake_peer(lie), reserve(&reader, &keys), Duration::from_secs(5));
    assert_eq!(got[0].as_ref().err(), Some(&ChannelError::Checksum));
    assert!(got[1].is_err(), "the stream is out of step after a bad object");
    // A peer that dies half-way through the first object.
    let mut half = header();
    half.extend_from_slice(&object[..object.len() / 2]);
    let got = fetch(fake_peer(half), reserve(&reader, &keys), Duration::from_secs(5));
    assert!(got.iter().all(|r| matches!(r, Err(ChannelError::Io(_)))), "{got:?}");
    // A peer that never answers: the timeout ends the read.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let t = std::time::Instant::now();
    let got =
        fetch(silent.local_addr().unwrap(), reserve(&reader, &keys), Duration::from_millis(300));
    assert!(got.iter().all(Result::is_err) && t.elapsed() < Duration::from_secs(3));
    drop(got);
    assert_eq!(reader.state().l1().usage().staged_objects, 0, "no reservation outlived its fetch");
}
