"""L2 through LMCache's own vLLM adapters: L1 far smaller than the working set.

Stores SEQS two-chunk sequences through vLLM's LMCacheMPWorkerAdapter into a server whose L1
holds only a few chunks, waiting after each store until the server reports the chunks written
to L2. The first sequences are then long gone from L1. Each is looked up again (the scheduler
adapter polls until the L2 prefetch finishes), retrieved into other blocks and compared byte
for byte with what was stored; the server's metrics must show the hits came from L2.

Usage: python l2_offload.py tcp://127.0.0.1:PORT http://127.0.0.1:HTTP
"""
import os
import sys

import torch
import zmq
from lmcache.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
    ParallelStrategy,
)

from prom import metric  # beside this file
from vllm_adapters import wait_for  # beside this file

BS, LAYERS, HEADS, HEAD = 16, 4, 2, 64
CHUNK_TOKENS = 256
SEQS = int(os.environ.get("L2_SEQS", "12"))
BLOCKS_PER_SEQ = 2 * CHUNK_TOKENS // BS
NB = (SEQS + 1) * BLOCKS_PER_SEQ
TIMEOUT = 30.0


def main():
    url, http = sys.argv[1], sys.argv[2]
    mode = os.environ.get("LMCACHE_MP_TRANSFER_MODE", "auto")
    ctx = zmq.Context()
    ps = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1,
                          pp_size=1, n_servers=1)
    torch.manual_seed(1)
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(2, NB, BS, HEADS, HEAD, dtype=torch.float16)
          for i in range(LAYERS)}
    worker = LMCacheMPWorkerAdapter(url, ctx, "l2-model", BS, ps, mq_timeout=TIMEOUT,
                                    heartbeat_interval=1.0)
    worker.register_kv_caches(kv)
    sched = LMCacheMPSchedulerAdapter([url], ctx, "l2-model", BS, ps, mq_timeout=TIMEOUT,
                                      heartbeat_interval=1.0)

    def tokens(i):
        return [i + 1] + list(range(10_000 * (i + 1), 10_000 * (i + 1) + 2 * CHUNK_TOKENS))

    def blocks(i):
        return list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ))

    for i in range(SEQS):
        rid = f"store-{i}"
        sched.maybe_submit_lookup_request(rid, tokens(i))
        hit = wait_for("cold lookup", lambda: sched.check_lookup_result(rid))
        assert hit == 0, f"sequence {i}: cold lookup hit {hit} tokens"
        op = LoadStoreOp(token_ids=tokens(i), block_ids=[blocks(i)], start=0, end=2 * CHUNK_TOKENS)
        worker.submit_store_request(rid, op, worker.create_recorded_event())
        wait_for("store", lambda: (worker.get_finished({rid})[0] or set()) & {rid} or None)
        sched.end_session(rid)
        want = 2 * (i + 1)
        wait_for("L2 write-behind",
                 lambda: True if metric(http, "lmcache_mp_l2_store_completed_objects_total") >= want else None)

    l2_tokens_before = metric(http, "lmcache_mp_lookup_hit_l2_tokens_total")
    dst = list(range(SEQS * BLOCKS_PER_SEQ, NB))
    checked = 0
    for i in range(min(3, SEQS)):
        rid = f"load-{i}"
        sched.maybe_submit_lookup_request(rid, tokens(i))
        hit = wait_for("warm lookup", lambda: sched.check_lookup_result(rid))
        assert hit >= 2 * CHUNK_TOKENS - 1, f"sequence {i}: lookup hit only {hit} tokens"
        for t in kv.values():
            t[:, dst].zero_()
        op = LoadStoreOp(token_ids=tokens(i), block_ids=[dst], start=0, end=2 * CHUNK_TOKENS)
        worker.submit_retrieve_request(rid, op, worker.create_recorded_event())
        wait_for("retrieve", lambda: (worker.get_finished({rid})[1] or set()) & {rid} or None)
        sched.end_session(rid)
        for name, t in kv.items():
            if not torch.equal(t[:, blocks(i)], t[:, dst]):
                raise AssertionError(f"sequence {i} {name}: KV from L2 differs from stored KV")
        checked += 1
    from_l2 = metric(http, "lmcache_mp_lookup_hit_l2_tokens_total") - l2_tokens_before
    assert from_l2 >= 2 * CHUNK_TOKENS, f"only {from_l2} hit tokens came from L2"
    print(f"l2 offload ({mode}): {SEQS} sequences stored past a small L1, {checked} read back "
          f"with {int(from_l2)} tokens from L2: bytes equal")
    worker.shutdown()
    sched.shutdown()


if __name__ == "__main__":
    main()
