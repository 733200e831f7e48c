"""The coordinator's re-published cache events, decoded by vLLM 0.34.0's own classes.

`lmcache-rs coordinator --vllm-kv-events-endpoint ... --vllm-kv-events-replay-endpoint ...`
gets cache-event batches over `POST /events` (as servers send them): stores in L1 with tokens
and offsets, an L2 store, a delete, a replay of an applied batch, a restart. A ZMQ SUB socket
(as llm-d's and Dynamo's subscribers) receives `[topic, seq, payload]`, and every payload is
decoded with `msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)`. Then the
replay socket is asked from a sequence, as vLLM's subscriber asks its publisher.

Usage: PYTHONPATH=$(scripts/vllm-events-pkgs) LMCACHE-VENV/bin/python vllm_events.py BIN PORT PUB REPLAY LOG
"""
import hashlib
import json
import subprocess
import sys
import time
import urllib.request

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from prom import metric  # beside this file

BIN, PORT, PUB, REPLAY, LOG = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
URL = f"http://127.0.0.1:{PORT}"
DECODE = msgspec.msgpack.Decoder(KVEventBatch)


def h(i):
    return hashlib.blake2b(b"chunk-%d" % i, digest_size=32).digest()


def key(i, model="m1"):
    return {"chunk_hash_hex": h(i).hex(), "model_name": model, "kv_rank": 0x01000100}


def batch(inst, inc, seq, kind, tier, backend, entries):
    return {"instance_id": inst, "incarnation": inc, "seq": seq, "event_type": kind, "tier": tier,
            "backend": backend, "shared": False, "ts": 1000.0 + seq, "entries": entries}


def post(*batches):
    req = urllib.request.Request(f"{URL}/events", data=json.dumps({"batches": list(batches)}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def main():
    proc = subprocess.Popen([BIN, "coordinator", "--host", "127.0.0.1", "--port", str(PORT), "--chunk-size", "4",
                             "--health-check-interval", "0", "--eviction-check-interval", "0",
                             "--vllm-kv-events-endpoint", f"tcp://127.0.0.1:{PUB}",
                             "--vllm-kv-events-replay-endpoint", f"tcp://127.0.0.1:{REPLAY}",
                             "--exit-after-seconds", "120"], stdout=open(LOG, "w"), stderr=subprocess.STDOUT)
    try:
        run()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def recv(sub):
    topic, seq, payload = sub.recv_multipart()
    return topic.decode(), int.from_bytes(seq, "big"), payload, DECODE.decode(payload)


def run():
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{URL}/healthz", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{PUB}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.RCVTIMEO, 200)
    # A SUB socket joins late: post a warm-up instance's stores until one arrives.
    warm = None
    for s in range(1, 200):
        post(batch("warm-up", 1, s, "store", "l1", "dram", [{"key": key(10_000 + s), "size_bytes": 1}]))
        try:
            warm = recv(sub)
            break
        except zmq.Again:
            pass
    assert warm is not None, "no vLLM KV event arrived"
    last = warm[1]
    while True:  # drain the rest of the warm-up
        try:
            last = recv(sub)[1]
        except zmq.Again:
            break
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    start = last + 1

    tok = lambda i: list(range(4 * i, 4 * i + 4))
    r = post(
        # Three chained L1 chunks of m1 with their tokens, one of m2 without.
        batch("srv-a", 1, 1, "store", "l1", "dram",
              [{"key": key(1), "size_bytes": 8, "token_ids": tok(0), "token_offset": 0},
               {"key": key(2), "size_bytes": 8, "token_ids": tok(1), "token_offset": 4},
               {"key": key(3), "size_bytes": 8, "token_ids": tok(2), "token_offset": 8},
               {"key": key(4, "m2"), "size_bytes": 8}]),
        # Two chunks written to an L2 backend, offsets unknown.
        batch("srv-a", 1, 2, "store", "l2", "fs", [{"key": key(5), "size_bytes": 8}, {"key": key(6), "size_bytes": 8}]),
        # One L1 chunk evicted.
        batch("srv-a", 1, 3, "delete", "l1", "dram", [{"key": key(1)}]),
        # A replay of seq 2: dropped by the gate, never re-published.
        batch("srv-a", 1, 2, "store", "l2", "fs", [{"key": key(7), "size_bytes": 8}]),
    )
    assert r == {"applied": 3, "duplicates": 1, "stale": 0}, r
    # srv-a restarted: its L1 placements are fenced, then its new store applies.
    r = post(batch("srv-a", 2, 1, "store", "l1", "dram", [{"key": key(8), "size_bytes": 8}]))
    assert r["applied"] == 1, r

    got = [recv(sub) for _ in range(7)]
    for i, (_, seq, _, _) in enumerate(got):
        assert seq == start + i, (seq, start + i)
    topics = [g[0] for g in got]
    assert topics == ["kv@srv-a@m1", "kv@srv-a@m2", "kv@srv-a@m1", "kv@srv-a@m1",
                      "kv@srv-a@m1", "kv@srv-a@m2", "kv@srv-a@m1"], topics
    b = [g[3] for g in got]
    assert all(isinstance(x, KVEventBatch) for x in b)
    assert b[0].ts == 1001.0 and b[0].events == [BlockStored(
        block_hashes=[h(1), h(2), h(3)], parent_block_hash=None, token_ids=tok(0) + tok(1) + tok(2),
        block_size=4, lora_id=None, medium="CPU", lora_name=None)], b[0]
    assert b[1].events == [BlockStored(block_hashes=[h(4)], parent_block_hash=None, token_ids=[],
                                       block_size=4, lora_id=None, medium="CPU", lora_name=None)], b[1]
    # Without offsets each L2 chunk is its own chain.
    assert [e.block_hashes for e in b[2].events] == [[h(5)], [h(6)]], b[2]
    assert all(isinstance(e, BlockStored) and e.medium == "L2:fs" for e in b[2].events), b[2]
    assert b[3].events == [BlockRemoved(block_hashes=[h(1)], medium="CPU")], b[3]
    assert b[4].events == [AllBlocksCleared()] and b[5].events == [AllBlocksCleared()], (b[4], b[5])
    assert [e.block_hashes for e in b[6].events] == [[h(8)]] and b[6].events[0].medium == "CPU", b[6]
    try:
        extra = recv(sub)
        raise AssertionError(f"an extra message (the replayed batch?): {extra[0]} {extra[3]}")
    except zmq.Again:
        pass

    # Replay from the first of them, as vLLM's subscriber asks: [start_seq] to the ROUTER.
    rep = ctx.socket(zmq.DEALER)
    rep.connect(f"tcp://127.0.0.1:{REPLAY}")
    rep.setsockopt(zmq.RCVTIMEO, 5000)
    rep.send_multipart([b"", start.to_bytes(8, "big")])
    replayed = []
    while True:
        _, seq, payload = rep.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            assert payload == b""
            break
        replayed.append((int.from_bytes(seq, "big"), payload))
    assert replayed == [(g[1], g[2]) for g in got], [s for s, _ in replayed]

    # Queued: srv-a's 4 batches (one per model) and its fence, then its store; the warm-up's.
    queued = metric(URL, "lmcache_rs_coordinator_vllm_kv_event_batches_queued_total")
    assert queued >= 6 + 1, queued
    print(f"vLLM KV events: {len(got)} batches decoded by vLLM 0.34.0's KVEventBatch, "
          f"replay of {len(replayed)} from seq {start}")


if __name__ == "__main__":
    main()
