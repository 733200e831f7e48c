//! The fleet's cache events re-published in vLLM's KV-event format, so that routers which
//! consume vLLM's events (llm-d's KV-cache manager, Dynamo's router) see every server's L1 and
//! L2 as they see an engine's GPU blocks.
//!
//! Wire, as vLLM's `ZmqEventPublisher`: a PUB socket sends `[topic, seq, payload]`, `seq` an
//! 8-byte big-endian counter from 0 and `payload` a msgpack `KVEventBatch` (`[ts, events,
//! data_parallel_rank]`, each event a map tagged by `type`: `BlockStored`, `BlockRemoved`,
//! `AllBlocksCleared`). A ROUTER socket, when configured, answers a replay request (an 8-byte
//! big-endian start sequence) with every buffered `[seq, payload]` from there and then
//! `[-1, ""]`. The topic is `kv@<instance_id>@<model>`, as LMCache's coordinator proposal
//! (LMCache PR #4768) names it.
//!
//! What is published, for every admitted batch (after the event gate: no replays, no stale
//! incarnations):
//! - a store: `BlockStored` per run of consecutive chunks (by token offsets), with the chunk
//!   hashes as `block_hashes`, the chunks' tokens when the server sent them, `block_size` the
//!   tokens per chunk, and `medium` `CPU` for L1 or `L2:<backend>` for an L2 backend;
//! - a delete: one `BlockRemoved` of its chunk hashes, same mediums;
//! - a fence (the instance restarted, expired, or its stream could not be repaired): an
//!   `AllBlocksCleared` on each topic of the instance. The fence drops only its L1
//!   placements here, so a consumer that clears L2 too under-credits until the next events,
//!   never over-credits.
//!
//! Publishing never blocks ingest: the events go through a bounded queue to the publisher
//! thread, and a full queue drops them (counted, and logged once per burst).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::time::Duration;

use rmpv::Value;

/// Where the publisher binds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VllmEventsConfig {
    /// The PUB socket's endpoint, bound (`tcp://127.0.0.1:5557`).
    pub endpoint: String,
    /// The ROUTER socket's endpoint for replays, bound; `None`: no replay.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay (vLLM's `buffer_steps`, 10,000).
    pub buffer_steps: usize,
}

/// Batches waiting for the publisher thread at most; beyond this they are dropped.
const QUEUE: usize = 65_536;

/// One vLLM KV event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VllmEvent {
    /// Blocks became available at `medium`: consecutive chunks, `parent` the chunk before
    /// the first when known.
    Stored {
        /// The chunk hashes, in order.
        hashes: Vec<Vec<u8>>,
        /// The hash of the chunk before the first.
        parent: Option<Vec<u8>>,
        /// The chunks' tokens, concatenated (empty when the server did not send them).
        tokens: Vec<u32>,
        /// Tokens per chunk.
        block_size: u32,
        /// `CPU` (L1) or `L2:<backend>`.
        medium: String,
    },
    /// Blocks left `medium`.
    Removed {
        /// The chunk hashes.
        hashes: Vec<Vec<u8>>,
        /// `CPU` (L1) or `L2:<backend>`.
        medium: String,
    },
    /// Everything the topic's instance held is gone.
    AllCleared,
}

fn s(x: &str) -> Value {
    Value::String(x.into())
}

fn bin_list(hashes: &[Vec<u8>]) -> Value {
    Value::Array(hashes.iter().map(|h| Value::Binary(h.clone())).collect())
}

impl VllmEvent {
    fn to_value(&self) -> Value {
        let pairs = match self {
            VllmEvent::Stored { hashes, parent, tokens, block_size, medium } => vec![
                (s("type"), s("BlockStored")),
                (s("block_hashes"), bin_list(hashes)),
                (s("parent_block_hash"), parent.clone().map_or(Value::Nil, Value::Binary)),
                (s("token_ids"), Value::Array(tokens.iter().map(|&t| Value::from(t)).collect())),
                (s("block_size"), Value::from(*block_size)),
                (s("lora_id"), Value::Nil),
                (s("medium"), s(medium)),
                (s("lora_name"), Value::Nil),
            ],
            VllmEvent::Removed { hashes, medium } => vec![
                (s("type"), s("BlockRemoved")),
                (s("block_hashes"), bin_list(hashes)),
                (s("medium"), s(medium)),
            ],
            VllmEvent::AllCleared => vec![(s("type"), s("AllBlocksCleared"))],
        };
        Value::Map(pairs)
    }
}

/// A `KVEventBatch` as vLLM's msgspec encodes it: `[ts, events, data_parallel_rank]`.
pub fn encode_batch(ts: f64, events: &[VllmEvent]) -> Vec<u8> {
    let v = Value::Array(vec![
        Value::F64(ts),
        Value::Array(events.iter().map(VllmEvent::to_value).collect()),
        Value::Nil,
    ]);
    let mut out = Vec::with_capacity(64 + 48 * events.len());
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &v);
    out
}

/// What the publisher thread is asked to do.
#[derive(Debug)]
pub(crate) enum Outgoing {
    /// Publish `payload` (an encoded batch) on `kv@<instance>@<model>`.
    Batch { instance: String, model: String, payload: Vec<u8> },
    /// Publish `AllBlocksCleared` on every topic `instance` has published on.
    Cleared { instance: String },
}

/// The sending side, held by the fleet.
#[derive(Debug)]
pub(crate) struct Publisher {
    tx: SyncSender<Outgoing>,
    /// The endpoints as bound (a `*` port resolved).
    endpoint: String,
    replay_endpoint: Option<String>,
}

/// The endpoint `s` is bound to (its port resolved when bound to `*`), or `asked`.
fn bound_endpoint(s: &zmq::Socket, asked: &str) -> String {
    match s.get_last_endpoint() {
        Ok(Ok(ep)) => ep,
        _ => asked.to_string(),
    }
}

impl Publisher {
    /// The PUB endpoint and the replay endpoint as bound.
    pub(crate) fn endpoints(&self) -> (&str, Option<&str>) {
        (&self.endpoint, self.replay_endpoint.as_deref())
    }

    /// Queues `o`; false when the queue is full or the thread is gone (the batch is dropped).
    pub(crate) fn send(&self, o: Outgoing) -> bool {
        match self.tx.try_send(o) {
            Ok(()) => true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => false,
        }
    }
}

/// Binds the sockets (so that a bad endpoint fails the coordinator's start, naming it) and
/// returns the sending side and the thread's body, which runs until every sender is gone.
pub(crate) fn bind(
    config: &VllmEventsConfig,
) -> Result<(Publisher, impl FnOnce() + Send + 'static), String> {
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).map_err(|e| format!("PUB socket: {e}"))?;
    publisher.set_sndhwm(100_000).map_err(|e| format!("PUB socket: {e}"))?;
    publisher.set_linger(0).map_err(|e| format!("PUB socket: {e}"))?;
    publisher
        .bind(&config.endpoint)
        .map_err(|e| format!("--vllm-kv-events-endpoint {}: {e}", config.endpoint))?;
    let replay = match &config.replay_endpoint {
        Some(ep) => {
            let r = ctx.socket(zmq::ROUTER).map_err(|e| format!("ROUTER socket: {e}"))?;
            r.set_linger(0).map_err(|e| format!("ROUTER socket: {e}"))?;
            r.bind(ep).map_err(|e| format!("--vllm-kv-events-replay-endpoint {ep}: {e}"))?;
            Some(r)
        }
        None => None,
    };
    let endpoint = bound_endpoint(&publisher, &config.endpoint);
    let replay_endpoint =
        replay.as_ref().zip(config.replay_endpoint.as_deref()).map(|(r, ep)| bound_endpoint(r, ep));
    let (tx, rx) = std::sync::mpsc::sync_channel(QUEUE);
    let steps = config.buffer_steps.max(1);
    let run = move || {
        let _ctx = ctx;
        let mut t = Thread {
            publisher,
            replay,
            buffer: VecDeque::new(),
            steps,
            seq: 0,
            topics: HashMap::new(),
        };
        t.run(&rx);
    };
    Ok((Publisher { tx, endpoint, replay_endpoint }, run))
}

struct Thread {
    publisher: zmq::Socket,
    replay: Option<zmq::Socket>,
    /// The last `steps` published `(seq, payload)`, for replays.
    buffer: VecDeque<(u64, Vec<u8>)>,
    steps: usize,
    seq: u64,
    /// The models each instance has published on.
    topics: HashMap<String, BTreeSet<String>>,
}

/// `-1` as vLLM's replay end marker.
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

impl Thread {
    fn run(&mut self, rx: &Receiver<Outgoing>) {
        let tick = if self.replay.is_some() {
            Duration::from_millis(20)
        } else {
            Duration::from_millis(500)
        };
        loop {
            self.serve_replays();
            match rx.recv_timeout(tick) {
                Ok(o) => self.handle(o),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            // Drain what queued meanwhile before looking at replays again.
            while let Ok(o) = rx.try_recv() {
                self.handle(o);
            }
        }
    }

    fn handle(&mut self, o: Outgoing) {
        match o {
            Outgoing::Batch { instance, model, payload } => {
                let topic = format!("kv@{instance}@{model}");
                self.topics.entry(instance).or_default().insert(model);
                self.publish(&topic, payload);
            }
            Outgoing::Cleared { instance } => {
                let Some(models) = self.topics.get(&instance).cloned() else { return };
                let ts = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64());
                for m in models {
                    let payload = encode_batch(ts, &[VllmEvent::AllCleared]);
                    self.publish(&format!("kv@{instance}@{m}"), payload);
                }
            }
        }
    }

    fn publish(&mut self, topic: &str, payload: Vec<u8>) {
        let seq = self.seq;
        self.seq += 1;
        let frames: [&[u8]; 3] = [topic.as_bytes(), &seq.to_be_bytes(), &payload];
        if let Err(e) = self.publisher.send_multipart(frames, 0) {
            tracing::warn!(error = %e, topic, "vLLM KV events: publishing failed");
        }
        if self.buffer.len() == self.steps {
            self.buffer.pop_front();
        }
        self.buffer.push_back((seq, payload));
    }

    /// Answers every waiting replay request.
    fn serve_replays(&mut self) {
        let Some(r) = &self.replay else { return };
        while let Ok(frames) = r.recv_multipart(zmq::DONTWAIT) {
            // [identity, empty, start_seq]; anything else is ignored, as vLLM ignores it.
            let [id, empty, start] = frames.as_slice() else {
                tracing::warn!(frames = frames.len(), "vLLM KV events: a malformed replay request");
                continue;
            };
            let Ok(start) = <[u8; 8]>::try_from(start.as_slice()) else {
                tracing::warn!("vLLM KV events: a replay request without an 8-byte sequence");
                continue;
            };
            let start = u64::from_be_bytes(start);
            for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
                let frames: [&[u8]; 4] = [id, empty, &seq.to_be_bytes(), payload];
                if r.send_multipart(frames, 0).is_err() {
                    break;
                }
            }
            let _ = r.send_multipart([id.as_slice(), empty.as_slice(), &END_SEQ, b""], 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM 0.34.0's msgspec encoding of the same batch (`KVEventBatch(ts=1.5, events=[
    /// BlockStored(block_hashes=[b'\x01'*4], parent_block_hash=None, token_ids=[1, 2],
    /// block_size=2, lora_id=None, medium='CPU', lora_name=None), BlockRemoved(block_hashes=
    /// [b'\x02'], medium='CPU'), AllBlocksCleared()])`), byte for byte.
    const VLLM: &str = "93cb3ff800000000000093de0008a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c40401010101b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473920102aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3435055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391c40102a66d656469756da343505581a474797065b0416c6c426c6f636b73436c6561726564c0";

    #[test]
    fn batches_encode_as_vllms_msgspec_does() {
        let events = [
            VllmEvent::Stored {
                hashes: vec![vec![1; 4]],
                parent: None,
                tokens: vec![1, 2],
                block_size: 2,
                medium: "CPU".into(),
            },
            VllmEvent::Removed { hashes: vec![vec![2]], medium: "CPU".into() },
            VllmEvent::AllCleared,
        ];
        // msgspec writes the 8-field map with a 16-bit length where we write a fixmap: the
        // same value, which is what a msgpack decoder sees.
        let ours = rmpv::decode::read_value(&mut encode_batch(1.5, &events).as_slice()).unwrap();
        let theirs = rmpv::decode::read_value(&mut hex::decode(VLLM).unwrap().as_slice()).unwrap();
        assert_eq!(ours, theirs);
    }

    #[test]
    fn the_socket_publishes_in_order_and_replays_from_a_sequence() {
        let ctx = zmq::Context::new();
        // Ports the kernel picks as the sockets bind (a port probed free and bound again
        // later raced other tests: "Address already in use").
        let config = VllmEventsConfig {
            endpoint: "tcp://127.0.0.1:*".into(),
            replay_endpoint: Some("tcp://127.0.0.1:*".into()),
            buffer_steps: 2,
        };
        let Err(e) =
            bind(&VllmEventsConfig { endpoint: "tcp://nowhere:x".into(), ..config.clone() })
        else {
            panic!("a bad endpoint binds")
        };
        assert!(e.contains("--vllm-kv-events-endpoint tcp://nowhere:x"), "{e}");
        let (p, run) = bind(&config).unwrap();
        let (ep, replay) = (p.endpoints().0.to_string(), p.endpoints().1.unwrap().to_string());
        assert!(!ep.ends_with(":*") && !replay.ends_with(":*"), "{ep} {replay}");
        let sub = ctx.socket(zmq::SUB).unwrap();
        sub.connect(&ep).unwrap();
        sub.set_subscribe(b"kv@").unwrap();
        sub.set_rcvtimeo(5000).unwrap();
        let thread = std::thread::spawn(run);
        // A PUB socket drops what it sends before the subscription arrives: publish until
        // the first message gets through, then three more.
        let mut first = None;
        for _ in 0..100 {
            assert!(p.send(Outgoing::Batch {
                instance: "a".into(),
                model: "m".into(),
                payload: b"x".to_vec()
            }));
            std::thread::sleep(Duration::from_millis(20));
            sub.set_rcvtimeo(0).unwrap();
            if let Ok(f) = sub.recv_multipart(0) {
                first = Some(f);
                break;
            }
        }
        let first = first.expect("nothing arrived");
        sub.set_rcvtimeo(5000).unwrap();
        let mut last = u64::from_be_bytes(first[1].as_slice().try_into().unwrap());
        // Drain what the warm-up sent after the first one got through.
        while let Ok(f) = {
            sub.set_rcvtimeo(200).unwrap();
            sub.recv_multipart(0)
        } {
            last = u64::from_be_bytes(f[1].as_slice().try_into().unwrap());
        }
        sub.set_rcvtimeo(5000).unwrap();
        p.send(Outgoing::Batch {
            instance: "b".into(),
            model: "m2".into(),
            payload: b"y".to_vec(),
        });
        p.send(Outgoing::Cleared { instance: "a".into() });
        p.send(Outgoing::Cleared { instance: "never-published".into() });
        let f = sub.recv_multipart(0).unwrap();
        assert_eq!(f[0], b"kv@b@m2");
        assert_eq!(u64::from_be_bytes(f[1].as_slice().try_into().unwrap()), last + 1);
        assert_eq!(f[2], b"y");
        let f = sub.recv_multipart(0).unwrap();
        assert_eq!(f[0], b"kv@a@m");
        assert_eq!(u64::from_be_bytes(f[1].as_slice().try_into().unwrap()), last + 2);
        let v = rmpv::decode::read_value(&mut f[2].as_slice()).unwrap();
        assert_eq!(v[1][0]["type"].as_str(), Some("AllBlocksCleared"));
        // Replay from 0 with a buffer of 2: the last two, then the end marker.
        let req = ctx.socket(zmq::REQ).unwrap();
        req.connect(&replay).unwrap();
        req.set_rcvtimeo(5000).unwrap();
        req.send(&0u64.to_be_bytes()[..], 0).unwrap();
        let r = req.recv_multipart(0).unwrap();
        assert_eq!(r[0], (last + 1).to_be_bytes());
        assert_eq!(r[1], b"y");
        drop(req);
        let dealer = ctx.socket(zmq::DEALER).unwrap();
        dealer.connect(&replay).unwrap();
        dealer.set_rcvtimeo(5000).unwrap();
        dealer.send_multipart([&b""[..], &(last + 2).to_be_bytes()], 0).unwrap();
        let r = dealer.recv_multipart(0).unwrap();
        assert_eq!(&r[1..], &[(last + 2).to_be_bytes().to_vec(), f[2].clone()]);
        let r = dealer.recv_multipart(0).unwrap();
        assert_eq!(&r[1..], &[END_SEQ.to_vec(), Vec::new()]);
        drop(p);
        thread.join().unwrap();
    }
}
