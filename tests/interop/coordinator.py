"""A fleet of cache servers reporting to one coordinator, driven by vLLM's own LMCache MP
adapters.

Each server stores SEQS two-chunk sequences of its own (distinct tokens) through
LMCacheMPWorkerAdapter. Then, within a deadline, the coordinator must:
  - list every server under GET /instances;
  - place every chunk of every sequence (the token form of POST /directory/lookup, which the
    coordinator hashes itself) in L1 on the server that stored it, and on no other server;
  - show each server's L1 bytes in GET /instances/usage;
  - with KIND=lmcache-rs, name the storing server as the best instance of POST
    /directory/route with the whole sequence in its L1;
  - find, through CacheBlend's POST /directory/blend-lookup (the coordinator runs with
    --enable-blend-lookup), two chunks an lmcache-rs server stored inside an unrelated query:
    each at its position in the query and with the position it was stored at, and nothing
    under another cache_salt. (LMCache's server sends a chunk's tokens only from its
    lmcache_driven store path, which these adapters do not take.)
Finally one server's sequences are deleted over its HTTP API (POST /cache/clear) and the
coordinator must forget them (delete events), while the other servers' stay placed.

Usage: python coordinator.py COORDINATOR_URL KIND NAME=tcp://HOST:PORT=http://HOST:PORT ...
"""
import base64
import json
import struct
import sys
import time
import urllib.request

import torch
import zmq
from lmcache.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
    ParallelStrategy,
)

from vllm_adapters import wait_for  # beside this file

BS, LAYERS, HEADS, HEAD = 16, 2, 2, 64
CHUNK = 256
SEQS = 3
BLOCKS_PER_SEQ = 2 * CHUNK // BS
MODEL = "coord-model"
DEADLINE = 20.0


def call(url, body=None, method=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data else "GET"),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read() or b"null")


def tokens(server, i):
    base = 1_000_000 * (server + 1) + 10_000 * i
    return list(range(base, base + 2 * CHUNK))


def store_all(name, url, server):
    ctx = zmq.Context()
    ps = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1,
                          pp_size=1, n_servers=1)
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(2, SEQS * BLOCKS_PER_SEQ, BS, HEADS, HEAD,
                                                          dtype=torch.float16)
          for i in range(LAYERS)}
    worker = LMCacheMPWorkerAdapter(url, ctx, MODEL, BS, ps, mq_timeout=30.0, heartbeat_interval=1.0)
    worker.register_kv_caches(kv)
    sched = LMCacheMPSchedulerAdapter([url], ctx, MODEL, BS, ps, mq_timeout=30.0, heartbeat_interval=1.0)
    for i in range(SEQS):
        rid = f"{name}-store-{i}"
        sched.maybe_submit_lookup_request(rid, tokens(server, i))
        wait_for("cold lookup", lambda: sched.check_lookup_result(rid))
        blocks = list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ))
        op = LoadStoreOp(token_ids=tokens(server, i), block_ids=[blocks], start=0, end=2 * CHUNK)
        worker.submit_store_request(rid, op, worker.create_recorded_event())
        wait_for("store", lambda: (worker.get_finished({rid})[0] or set()) & {rid} or None)
        sched.end_session(rid)
    worker.shutdown()
    sched.shutdown()


def placed(coord, server, i):
    r = call(f"{coord}/directory/lookup", {"token_ids": tokens(server, i), "model_name": MODEL,
                                           "world_size": 1})
    assert r["chunks"] == 2, r
    return [{p["instance_id"] for p in res["placements"] if p["tier"] == "l1"} for res in r["results"]]


def chunk_hashes(coord, server, i):
    r = call(f"{coord}/directory/lookup", {"token_ids": tokens(server, i), "model_name": MODEL,
                                           "world_size": 1})
    return [res["key"]["chunk_hash_hex"] for res in r["results"]]


def blend(coord, query, salt=""):
    b64 = base64.b64encode(struct.pack(f"<{len(query)}I", *query)).decode()
    r = call(f"{coord}/directory/blend-lookup", {"tokens_b64": b64, "model_name": MODEL,
                                                 "world_size": 1, "cache_salt": salt})
    return sorted((m["chunk_hash"], m["old_st"], m["cur_st"]) for m in r["matches"])


def until(what, fn):
    deadline = time.monotonic() + DEADLINE
    last = None
    while time.monotonic() < deadline:
        ok, last = fn()
        if ok:
            return last
        time.sleep(0.2)
    raise AssertionError(f"{what}: not true within {DEADLINE} s; last seen: {last}")


def main():
    coord, kind = sys.argv[1], sys.argv[2]
    servers = []
    for arg in sys.argv[3:]:
        name, mp, http = arg.split("=", 2)
        servers.append((name, mp, http))
    until("every server registered",
          lambda: (lambda ids: ({n for n, _, _ in servers} <= ids, ids))(
              {i["instance_id"] for i in call(f"{coord}/instances")["instances"]}))
    for s, (name, mp, _) in enumerate(servers):
        store_all(name, mp, s)
    for s, (name, _, _) in enumerate(servers):
        for i in range(SEQS):
            until(f"{name} sequence {i} placed on {name} only",
                  lambda: (lambda p: (p == [{name}, {name}], p))(placed(coord, s, i)))
    usage = call(f"{coord}/instances/usage")
    for name, _, _ in servers:
        inst = [x for x in usage["instances"] if x["instance_id"] == name]
        assert inst and inst[0]["registered"], usage
        l1 = [m for m in inst[0]["modules"] if m["tier"] == "l1"]
        assert l1 and l1[0]["used_bytes"] > 0, inst
    if kind == "lmcache-rs":
        for s, (name, _, _) in enumerate(servers):
            r = call(f"{coord}/directory/route", {"token_ids": tokens(s, 0), "model_name": MODEL})
            assert r["best"] == name and r["instances"][0]["l1_chunks"] == 2, r
    blended = 0
    for s, (name, _, _) in enumerate(servers):
        if not name.startswith("lmcache-rs"):
            continue  # LMCache's server reports tokens only for lmcache_driven stores
        # Seq 0's second chunk, then seq 1's first, behind 5 unrelated tokens.
        query = [7, 7, 7, 7, 7] + tokens(s, 0)[CHUNK:] + tokens(s, 1)[:CHUNK] + [8] * 10
        want = sorted([(chunk_hashes(coord, s, 0)[1], CHUNK, 5),
                       (chunk_hashes(coord, s, 1)[0], 0, 5 + CHUNK)])
        got = blend(coord, query)
        assert got == want, f"{name}: blend-lookup {got}, want {want}"
        assert blend(coord, query, salt="other") == [], "another salt must match nothing"
        blended += 1
    # One server clears its L1: the coordinator forgets its placements, keeps the others'.
    name0, _, http0 = servers[0]
    call(f"{http0}/cache/clear", {})
    for i in range(SEQS):
        until(f"{name0} sequence {i} gone after its clear",
              lambda: (lambda p: (p == [set(), set()], p))(placed(coord, 0, i)))
    for s, (name, _, _) in enumerate(servers[1:], start=1):
        assert placed(coord, s, 0) == [{name}, {name}], f"{name} lost its placements"
    print(f"coordinator ({kind}): {len(servers)} server(s) x {SEQS} sequences placed on the "
          f"servers that stored them ({blended} checked by blend-lookup); a clear was forgotten")


if __name__ == "__main__":
    main()
