"""Drives vLLM's LMCache MP adapters (the scheduler and worker halves of LMCache 0.5.6's vLLM
connector) against a running server, as vLLM does for one request pair: lookup (miss), store,
end_session, the KV events the worker receives for it; lookup (full hit), retrieve into
*other* blocks, end_session; then compares the retrieved KV bytes with the stored ones. The transfer mode comes from LMCACHE_MP_TRANSFER_MODE.

Usage: python vllm_adapters.py tcp://127.0.0.1:PORT
"""
import os
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

BS, NB, LAYERS, HEADS, HEAD = 16, 96, 4, 2, 64
CHUNK_TOKENS = 256
TIMEOUT = 30.0


def wait_for(what, fn, timeout=TIMEOUT, pause=0.01):
    """fn()'s first value that is not None, asked every `pause` seconds for `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v is not None:
            return v
        time.sleep(pause)
    raise TimeoutError(what)


def main():
    url = sys.argv[1]
    mode = os.environ.get("LMCACHE_MP_TRANSFER_MODE", "auto")
    ctx = zmq.Context()
    ps = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1,
                          pp_size=1, n_servers=1)
    torch.manual_seed(0)
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(2, NB, BS, HEADS, HEAD, dtype=torch.float16)
          for i in range(LAYERS)}
    worker = LMCacheMPWorkerAdapter(url, ctx, "test-model", BS, ps, mq_timeout=TIMEOUT,
                                    heartbeat_interval=1.0, enable_kv_events=True)
    worker.register_kv_caches(kv)
    sched = LMCacheMPSchedulerAdapter([url], ctx, "test-model", BS, ps, mq_timeout=TIMEOUT,
                                      heartbeat_interval=1.0)
    tokens = [7] + list(range(1000, 1000 + 2 * CHUNK_TOKENS))  # 513 tokens: 2 whole chunks
    n_blocks = 2 * CHUNK_TOKENS // BS
    src, dst = list(range(0, n_blocks)), list(range(n_blocks, 2 * n_blocks))

    sched.maybe_submit_lookup_request("req-cold", tokens)
    cold = wait_for("cold lookup", lambda: sched.check_lookup_result("req-cold"))
    assert cold == 0, f"cold lookup hit {cold} tokens"
    store = LoadStoreOp(token_ids=tokens, block_ids=[src], start=0, end=2 * CHUNK_TOKENS)
    worker.submit_store_request("req-cold", store, worker.create_recorded_event())
    wait_for("store", lambda: (worker.get_finished({"req-cold"})[0] or set()) & {"req-cold"} or None)
    sched.end_session("req-cold")

    # The server advertises "kv_event_stream": the worker subscribes and must see both chunks
    # stored, chained by parent hash, with their tokens.
    stored = []
    def two_stored():
        stored.extend(e for e in worker.get_kv_events() if type(e).__name__ == "CacheStoreEvent")
        return stored if len(stored) >= 2 else None
    wait_for("kv events", two_stored)
    first, second = stored[0], stored[1]
    assert first.parent_block_hash is None, first
    assert second.parent_block_hash == first.block_hashes[0], (first, second)
    assert list(first.token_ids) == tokens[:CHUNK_TOKENS], "event tokens differ"
    assert list(second.token_ids) == tokens[CHUNK_TOKENS:2 * CHUNK_TOKENS]

    sched.maybe_submit_lookup_request("req-warm", tokens)
    warm = wait_for("warm lookup", lambda: sched.check_lookup_result("req-warm"))
    assert warm >= 2 * CHUNK_TOKENS - 1, f"warm lookup hit only {warm} tokens"
    for t in kv.values():
        t[:, dst[0]:dst[-1] + 1].zero_()  # a slice: `t[:, list]` would zero a copy
    retrieve = LoadStoreOp(token_ids=tokens, block_ids=[dst], start=0, end=2 * CHUNK_TOKENS)
    worker.submit_retrieve_request("req-warm", retrieve, worker.create_recorded_event())
    wait_for("retrieve", lambda: (worker.get_finished({"req-warm"})[1] or set()) & {"req-warm"} or None)
    sched.end_session("req-warm")

    for name, t in kv.items():
        if not torch.equal(t[:, src], t[:, dst]):
            raise AssertionError(f"{name}: retrieved KV differs from stored KV")
    print(f"vllm adapters ({mode}): miss, store, {len(stored)} KV store events, full hit "
          f"({warm} tokens), retrieve: bytes equal")
    worker.shutdown()
    sched.shutdown()


if __name__ == "__main__":
    main()
