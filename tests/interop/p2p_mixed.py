"""P2P across a mixed fleet, through vLLM's LMCache MP adapters: a prompt stored on server
STORE (through its worker adapter) is looked up and retrieved on server READ, which never
stored it, and the retrieved KV must equal the stored KV byte for byte. READ finds it in
STORE's L1 over the P2P channel (NIXL between LMCache and lmcache-rs).

Usage: python p2p_mixed.py tcp://STORE tcp://READ SEED
"""
import sys
import time

import torch
import zmq
from lmcache.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
    ParallelStrategy,
)

from vllm_adapters import wait_for  # beside this file

BS, NB, LAYERS, HEADS, HEAD = 16, 96, 4, 2, 64
CHUNK = 256
MODEL = "p2p-mixed-model"


def adapters(url, ctx, seed):
    ps = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1,
                          pp_size=1, n_servers=1)
    torch.manual_seed(seed)
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(2, NB, BS, HEADS, HEAD, dtype=torch.float16)
          for i in range(LAYERS)}
    worker = LMCacheMPWorkerAdapter(url, ctx, MODEL, BS, ps, mq_timeout=30.0,
                                    heartbeat_interval=1.0)
    worker.register_kv_caches(kv)
    sched = LMCacheMPSchedulerAdapter([url], ctx, MODEL, BS, ps, mq_timeout=30.0,
                                      heartbeat_interval=1.0)
    return worker, sched, kv


def main():
    store_url, read_url, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ctx = zmq.Context()
    tokens = list(range(seed * 10_000, seed * 10_000 + 3 * CHUNK))  # 3 whole chunks
    n = 3 * CHUNK // BS
    src, dst = list(range(0, n)), list(range(n, 2 * n))

    worker_a, sched_a, kv_a = adapters(store_url, ctx, seed)
    op = LoadStoreOp(token_ids=tokens, block_ids=[src], start=0, end=len(tokens))
    worker_a.submit_store_request("store", op, worker_a.create_recorded_event())
    wait_for("store", lambda: (worker_a.get_finished({"store"})[0] or set()) & {"store"} or None)
    sched_a.end_session("store")
    time.sleep(1)  # LMCache acknowledges a store before its chunks are visible

    # The reader, with the same KV in its source blocks (same seed) and zeros where it loads.
    worker_b, sched_b, kv_b = adapters(read_url, ctx, seed)
    for t in kv_b.values():
        t[:, dst[0]:dst[-1] + 1].zero_()
    hit = 0
    for attempt in range(20):  # peers are found within a heartbeat or two
        rid = f"lookup-{attempt}"
        sched_b.maybe_submit_lookup_request(rid, tokens)
        hit = wait_for("lookup", lambda: sched_b.check_lookup_result(rid))
        if hit >= len(tokens) - 1:
            break
        sched_b.end_session(rid)
        time.sleep(0.5)
    assert hit >= len(tokens) - 1, f"the reader found only {hit} tokens of {len(tokens)}"
    op = LoadStoreOp(token_ids=tokens, block_ids=[dst], start=0, end=len(tokens))
    worker_b.submit_retrieve_request(rid, op, worker_b.create_recorded_event())
    wait_for("retrieve", lambda: (worker_b.get_finished({rid})[1] or set()) & {rid} or None)
    sched_b.end_session(rid)
    for name, t in kv_b.items():
        if not torch.equal(kv_a[name][:, src], t[:, dst]):
            raise AssertionError(f"{name}: KV read from the peer differs from the stored KV")
    print(f"p2p {store_url} -> {read_url}: {hit} tokens found on the peer, "
          f"{len(kv_b)} layers byte-identical after {attempt + 1} lookup(s)")
    for a in (worker_a, sched_a, worker_b, sched_b):
        a.shutdown()


if __name__ == "__main__":
    main()
