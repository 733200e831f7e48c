"""A fleet's cache events, seen as vLLM KV events: subscribes to the coordinator's vLLM
KV-event socket, decodes every message with vLLM 0.34.0's `KVEventBatch`, and once STOP_FILE
appears checks, per server, that the blocks announced on its topics (stored minus removed,
medium CPU) are exactly the L1 keys the coordinator's directory holds for it.

Usage: PYTHONPATH=... python vllm_events_fleet.py PUB_PORT COORDINATOR_URL READY_FILE STOP_FILE NAME...
"""
import json
import os
import sys
import time
import urllib.request

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

PUB, URL, READY, STOP, NAMES = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
decoder = msgspec.msgpack.Decoder(KVEventBatch)
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.connect(f"tcp://127.0.0.1:{PUB}")
sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
sub.setsockopt(zmq.RCVTIMEO, 100)
time.sleep(0.5)
open(READY, "w").write("1")
held = {n: set() for n in NAMES}
seen_l2, messages, last_seq = 0, 0, None
deadline = time.time() + 280
while not os.path.exists(STOP):
    assert time.time() < deadline, "never told to stop"
    try:
        topic, seq, payload = sub.recv_multipart()
    except zmq.Again:
        continue
    seq = int.from_bytes(seq, "big")
    assert last_seq is None or seq == last_seq + 1, f"sequence jumped: {last_seq} -> {seq}"
    last_seq = seq
    messages += 1
    _, instance, model = topic.decode().split("@", 2)
    batch = decoder.decode(payload)
    for e in batch.events:
        if isinstance(e, BlockStored) and e.medium == "CPU":
            held[instance].update(e.block_hashes)
        elif isinstance(e, BlockRemoved) and e.medium == "CPU":
            held[instance].difference_update(e.block_hashes)
        elif isinstance(e, AllBlocksCleared):
            held[instance].clear()
        elif isinstance(e, BlockStored):
            seen_l2 += 1
for name in NAMES:
    with urllib.request.urlopen(f"{URL}/directory/keys?tier=l1&instance_id={name}&limit=10000", timeout=10) as r:
        d = json.load(r)
    want = {bytes.fromhex(k["key"]["chunk_hash_hex"]) for k in d["keys"]}
    assert want, f"{name}: the directory holds nothing"
    assert held[name] == want, f"{name}: vLLM events announce {len(held[name])} blocks, the directory holds {len(want)}"
    print(f"{name}: {len(want)} L1 blocks, as announced in vLLM's format")
print(f"{messages} messages decoded by vLLM 0.34.0's KVEventBatch")
