"""The three RPCs a P2P peer serves, driven by LMCache 0.5.6's own request client against
LMCache's server and against ours, after the same stores through vLLM's LMCache MP worker
adapter. Both servers must give the same answers: found masks and object sizes (offsets are
each server's own), exactly-once results, nil for unknown tasks, all-miss for object groups of
unequal key counts or without a layout, and unlocks that return nothing.

Usage: python p2p_rpcs.py tcp://LMCACHE_SERVER tcp://LMCACHE_RS_SERVER
"""
import sys
import time

import torch
import zmq
from lmcache.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
    ParallelStrategy,
)
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.multiprocess.cache_control.key_resolver import resolve_object_keys
from lmcache.v1.multiprocess.token_hasher import TokenHasher
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

from vllm_adapters import wait_for  # beside this file

BS, NB, LAYERS, HEADS, HEAD = 16, 96, 4, 2, 64
CHUNK = 256
MODEL = "p2p-model"
RPC_TIMEOUT = 10.0


def store(url, ctx, seqs):
    """Stores each token list of `seqs` (whole chunks) through the worker adapter."""
    ps = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1,
                          pp_size=1, n_servers=1)
    torch.manual_seed(0)
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(2, NB, BS, HEADS, HEAD, dtype=torch.float16)
          for i in range(LAYERS)}
    worker = LMCacheMPWorkerAdapter(url, ctx, MODEL, BS, ps, mq_timeout=30.0,
                                    heartbeat_interval=1.0)
    worker.register_kv_caches(kv)
    block = 0
    for i, tokens in enumerate(seqs):
        n = len(tokens) // BS
        rid = f"p2p-store-{i}"
        op = LoadStoreOp(token_ids=tokens, block_ids=[list(range(block, block + n))], start=0,
                         end=len(tokens))
        block += n
        worker.submit_store_request(rid, op, worker.create_recorded_event())
        wait_for("store", lambda: (worker.get_finished({rid})[0] or set()) & {rid} or None)
    # LMCache's server acknowledges a store before its chunks are visible: let them settle.
    time.sleep(2)
    return worker


def ask(client, keys, layouts):
    """lookup_and_lock, then the answer (twice: the second must be nil)."""
    task = client.p2p_lookup_and_lock(keys, layouts).result(timeout=RPC_TIMEOUT)
    assert isinstance(task, int), f"task id {task!r}"
    first = wait_for("p2p answer",
                     lambda: client.p2p_query_lookup_results(task).result(timeout=RPC_TIMEOUT))
    again = client.p2p_query_lookup_results(task).result(timeout=RPC_TIMEOUT)
    assert again is None, f"task {task} answered twice: {again!r}"
    return [(a.offset >= 0, a.size if a.offset >= 0 else 0) for a in first], first


def scenario(url, ctx):
    seq_a = list(range(1000, 1000 + 2 * CHUNK))
    seq_b = list(range(5000, 5000 + CHUNK))
    worker = store(url, ctx, [seq_a, seq_b])
    hasher = TokenHasher(chunk_size=CHUNK)
    keys_a, n = resolve_object_keys(hasher, MODEL, 1, seq_a, "")
    assert n == 2, n
    keys_b, _ = resolve_object_keys(hasher, MODEL, 1, seq_b, "")
    missing, _ = resolve_object_keys(hasher, MODEL, 1, list(range(9000, 9000 + CHUNK)), "")
    layout = MemoryLayoutDesc(shapes=[torch.Size([2, LAYERS, CHUNK, HEADS * HEAD])],
                              dtypes=[torch.float16])
    client = RequestClientFactory.create(url, context=ctx)
    out = {}
    # Hits, a miss, a duplicate, in request order.
    keys = [keys_a[0], missing[0], keys_b[0], keys_a[1], keys_a[0]]
    out["mixed"], addrs = ask(client, keys, {0: layout})
    assert (addrs[0].offset, addrs[0].size) == (addrs[4].offset, addrs[4].size), \
        "a duplicate key gets the same address"
    # Object group 1 with one key, group 0 with two: unequal counts, every key a miss.
    other = ObjectKey(chunk_hash=keys_a[0].chunk_hash, model_name=MODEL, kv_rank=keys_a[0].kv_rank,
                      object_group_id=1, cache_salt="")
    out["unequal"], _ = ask(client, [keys_a[0], keys_a[1], other], {0: layout, 1: layout})
    # A group without a layout: every key a miss.
    out["no_layout"], _ = ask(client, [keys_a[0], keys_a[1]], {1: layout})
    out["empty"], _ = ask(client, [], {0: layout})
    out["unknown_task"] = client.p2p_query_lookup_results(987654).result(timeout=RPC_TIMEOUT)
    out["unlock"] = client.p2p_unlock_objects(keys).result(timeout=RPC_TIMEOUT)
    out["unlock_other"] = client.p2p_unlock_objects([keys_a[0], keys_a[1]]).result(timeout=RPC_TIMEOUT)
    client.close()
    return out


def main():
    ctx = zmq.Context()
    theirs = scenario(sys.argv[1], ctx)
    ours = scenario(sys.argv[2], ctx)
    for name in theirs:
        assert theirs[name] == ours[name], f"{name}: LMCache {theirs[name]!r}, lmcache-rs {ours[name]!r}"
    size = 2 * LAYERS * CHUNK * HEADS * HEAD * 2
    assert theirs["mixed"] == [(True, size), (False, 0), (True, size), (True, size), (True, size)], theirs
    assert theirs["unequal"] == [(False, 0)] * 3 and theirs["no_layout"] == [(False, 0)] * 2
    print(f"p2p rpcs: ok (same answers as LMCache: {sorted(theirs)})")


if __name__ == "__main__":
    main()
