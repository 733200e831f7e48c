"""P2P across a mixed fleet, through vLLM's LMCache MP adapters: a prompt stored on server
STORE (through its worker adapter) is looked up and retrieved on server READ, which never
stored it, and the retrieved KV must equal the stored KV byte for byte. READ finds it in
STORE's L1 over the P2P channel (NIXL between LMCache and lmcache-rs).

Usage: python p2p_mixed.py tcp://STORE tcp://READ SEED [--layers L --heads H --head-size D
       --tokens N --rounds R --json]   (scripts/bench-p2p times LMCache's default shape)
"""
import argparse
import json
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

BS = 16
CHUNK = 256
MODEL = "p2p-mixed-model"


def adapters(url, ctx, seed, shape):
    layers, heads, head, blocks = shape
    ps = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1,
                          pp_size=1, n_servers=1)
    torch.manual_seed(seed)
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(2, blocks, BS, heads, head, dtype=torch.float16)
          for i in range(layers)}
    worker = LMCacheMPWorkerAdapter(url, ctx, MODEL, BS, ps, mq_timeout=30.0,
                                    heartbeat_interval=1.0)
    worker.register_kv_caches(kv)
    sched = LMCacheMPSchedulerAdapter([url], ctx, MODEL, BS, ps, mq_timeout=30.0,
                                      heartbeat_interval=1.0)
    return worker, sched, kv


def poll(what, fn):
    """wait_for, asking every 0.5 ms so the timings measure the server, not the polling."""
    return wait_for(what, fn, timeout=60.0, pause=0.0005)


def transfer(store_url, read_url, seed, shape, tokens_per_round, rounds):
    """Each round stores a new prompt on STORE and looks it up and retrieves it on READ;
    returns [(lookups, lookup_s, retrieve_s)] and checks every byte."""
    ctx = zmq.Context()
    n = tokens_per_round // BS
    src, dst = list(range(0, n)), list(range(n, 2 * n))
    worker_a, sched_a, kv_a = adapters(store_url, ctx, seed, shape)
    # The reader, with the same KV in its source blocks (same seed) and zeros where it loads.
    worker_b, sched_b, kv_b = adapters(read_url, ctx, seed, shape)
    out = []
    for r in range(rounds):
        tokens = list(range((seed * 100 + r) * 10_000, (seed * 100 + r) * 10_000 + tokens_per_round))
        op = LoadStoreOp(token_ids=tokens, block_ids=[src], start=0, end=len(tokens))
        worker_a.submit_store_request(f"store-{r}", op, worker_a.create_recorded_event())
        poll("store", lambda: (worker_a.get_finished({f"store-{r}"})[0] or set()) & {f"store-{r}"} or None)
        sched_a.end_session(f"store-{r}")
        time.sleep(1)  # LMCache acknowledges a store before its chunks are visible
        for t in kv_b.values():
            t[:, dst[0]:dst[-1] + 1].zero_()
        hit = 0
        for attempt in range(40):  # peers are found within a heartbeat or two
            rid = f"lookup-{r}-{attempt}"
            t0 = time.perf_counter()
            sched_b.maybe_submit_lookup_request(rid, tokens)
            hit = poll("lookup", lambda: sched_b.check_lookup_result(rid))
            lookup_s = time.perf_counter() - t0
            if hit >= len(tokens) - 1:
                break
            sched_b.end_session(rid)
            time.sleep(0.5)
        assert hit >= len(tokens) - 1, f"the reader found only {hit} tokens of {len(tokens)}"
        op = LoadStoreOp(token_ids=tokens, block_ids=[dst], start=0, end=len(tokens))
        t0 = time.perf_counter()
        worker_b.submit_retrieve_request(rid, op, worker_b.create_recorded_event())
        poll("retrieve", lambda: (worker_b.get_finished({rid})[1] or set()) & {rid} or None)
        retrieve_s = time.perf_counter() - t0
        sched_b.end_session(rid)
        for name, t in kv_b.items():
            if not torch.equal(kv_a[name][:, src], t[:, dst]):
                raise AssertionError(f"{name}: KV read from the peer differs from the stored KV")
        out.append((attempt + 1, lookup_s, retrieve_s))
    for a in (worker_a, sched_a, worker_b, sched_b):
        a.shutdown()
    return out


def miss(read_url, seed, shape, n_tokens):
    """A prompt nobody stored, looked up on READ: must miss; returns its request id."""
    ctx = zmq.Context()
    worker, sched, _ = adapters(read_url, ctx, seed, shape)
    tokens = list(range(seed * 1_000_000, seed * 1_000_000 + n_tokens))
    rid = f"miss-{seed}"
    sched.maybe_submit_lookup_request(rid, tokens)
    hit = poll("lookup", lambda: sched.check_lookup_result(rid))
    sched.end_session(rid)
    for a in (worker, sched):
        a.shutdown()
    assert hit == 0, f"a prompt nobody stored hit {hit} tokens"
    return rid


def main():
    p = argparse.ArgumentParser()
    p.add_argument("store_url")
    p.add_argument("read_url")
    p.add_argument("seed", type=int)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--tokens", type=int, default=3 * CHUNK)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the timings as JSON")
    p.add_argument("--miss-only", action="store_true",
                   help="only look a never-stored prompt up on READ (STORE unused); print its request id")
    a = p.parse_args()
    shape = (a.layers, a.heads, a.head_size, 2 * a.tokens // BS)
    if a.miss_only:
        print(miss(a.read_url, a.seed, shape, a.tokens))
        return
    res = transfer(a.store_url, a.read_url, a.seed, shape, a.tokens, a.rounds)
    if a.json:
        print(json.dumps([{"lookups": n, "lookup_s": l, "retrieve_s": r} for n, l, r in res]))
    else:
        n, l, r = res[-1]
        print(f"p2p {a.store_url} -> {a.read_url}: {a.tokens} tokens found on the peer after "
              f"{n} lookup(s), {a.layers} layers byte-identical ({a.rounds} round(s))")


if __name__ == "__main__":
    main()
