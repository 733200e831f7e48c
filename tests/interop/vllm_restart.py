"""vLLM's LMCache MP adapters (scheduler and worker, lmcache-driven) across a server restart:
store two chunks, have the server killed and restarted on its L1 file (RESTART, a command that
returns once the new server answers), then, in the same adapter processes, look the tokens up
(a full hit from the adopted L1) and retrieve them into other blocks: the bytes must equal the
stored ones. Then a new prompt is stored and retrieved through the restarted server.

Usage: python vllm_restart.py tcp://127.0.0.1:PORT RESTART-COMMAND
"""
import subprocess
import sys
import time

import torch
import zmq
import vllm_adapters  # beside this file: its wait_for
from lmcache.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
    ParallelStrategy,
)

BS, NB, LAYERS, HEADS, HEAD = 16, 128, 4, 2, 64
CHUNK_TOKENS = 256
TIMEOUT = 60.0


def wait_for(what, fn, timeout=TIMEOUT, pause=0.05):
    return vllm_adapters.wait_for(what, fn, timeout=timeout, pause=pause)


def main():
    url, restart = sys.argv[1], sys.argv[2]
    ctx = zmq.Context()
    ps = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1,
                          pp_size=1, n_servers=1)
    torch.manual_seed(0)
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(2, NB, BS, HEADS, HEAD, dtype=torch.float16)
          for i in range(LAYERS)}
    worker = LMCacheMPWorkerAdapter(url, ctx, "test-model", BS, ps, mq_timeout=TIMEOUT,
                                    heartbeat_interval=1.0)
    worker.register_kv_caches(kv)
    sched = LMCacheMPSchedulerAdapter([url], ctx, "test-model", BS, ps, mq_timeout=TIMEOUT,
                                      heartbeat_interval=1.0)
    n_blocks = 2 * CHUNK_TOKENS // BS

    def store(req, tokens, blocks):
        sched.maybe_submit_lookup_request(req, tokens)
        wait_for("lookup before store", lambda: sched.check_lookup_result(req))
        op = LoadStoreOp(token_ids=tokens, block_ids=[blocks], start=0, end=2 * CHUNK_TOKENS)
        worker.submit_store_request(req, op, worker.create_recorded_event())
        wait_for("store", lambda: (worker.get_finished({req})[0] or set()) & {req} or None)
        sched.end_session(req)

    def hit_and_retrieve(req, tokens, src, dst):
        """Looks up until a full hit (the adapters may be re-registering), then retrieves."""
        attempt = [0]

        def full():
            attempt[0] += 1
            r = f"{req}-probe-{attempt[0]}"  # a fresh request: the adapter keeps one answer per id
            sched.maybe_submit_lookup_request(r, tokens)
            got = wait_for("lookup", lambda: sched.check_lookup_result(r))
            sched.end_session(r)
            print(f"lookup {req}: {got} tokens", flush=True)
            return got if got >= 2 * CHUNK_TOKENS - 1 else None
        hit = wait_for(f"a full hit for {req}", full, pause=0.5)
        sched.maybe_submit_lookup_request(req, tokens)
        wait_for("lookup", lambda: sched.check_lookup_result(req))
        for t in kv.values():
            t[:, dst[0]:dst[-1] + 1].zero_()
        op = LoadStoreOp(token_ids=tokens, block_ids=[dst], start=0, end=2 * CHUNK_TOKENS)
        worker.submit_retrieve_request(req, op, worker.create_recorded_event())
        wait_for("retrieve", lambda: (worker.get_finished({req})[1] or set()) & {req} or None)
        sched.end_session(req)
        for name, t in kv.items():
            if not torch.equal(t[:, src], t[:, dst]):
                raise AssertionError(f"{req} {name}: retrieved KV differs from stored KV")
        return hit

    tokens = [7] + list(range(1000, 1000 + 2 * CHUNK_TOKENS))
    a = list(range(0, n_blocks))
    store("req-a", tokens, a)
    t0 = time.monotonic()
    subprocess.run(restart, shell=True, check=True)
    hit = hit_and_retrieve("req-a-after", tokens, a, list(range(n_blocks, 2 * n_blocks)))
    took = time.monotonic() - t0
    # Stores keep working through the restarted server.
    tokens_b = [8] + list(range(5000, 5000 + 2 * CHUNK_TOKENS))
    b = list(range(2 * n_blocks, 3 * n_blocks))
    store("req-b", tokens_b, b)
    hit_and_retrieve("req-b-warm", tokens_b, b, list(range(3 * n_blocks, 4 * n_blocks)))
    print(f"vllm restart: stored, server restarted, full hit ({hit} tokens) {took:.1f} s after "
          "the restart began, retrieve bytes equal; a new prompt stored and retrieved after it")
    worker.shutdown()
    sched.shutdown()


if __name__ == "__main__":
    main()
