"""A hybrid model through vLLM's own LMCache MP adapters (LMCache 0.5.6), lmcache-driven on
the CPU: the worker registers four layers in three engine groups with their EngineGroupInfos
(full attention, a one-chunk sliding window, recurrent state whose window is one block),
stores prompts, looks them up through the scheduler adapter and retrieves them into *other*
(zeroed) blocks. Then, per layer and block, the bytes must equal the stored ones exactly where
the server's fold promised them, and stay zero everywhere else.

MODE=separate (the server runs with --separate-object-groups): each group is its own object
group. A sliding-window group needs only the last chunk of a hit and restores only that; the
recurrent group restores only its state block. Prompt A stores every group: a full hit.
Prompt B has no sliding-window blocks in its last chunk (null blocks, as an engine that freed
them sends): the hit must stop a chunk short, where the window is still there.

MODE=merged (default server): one object per chunk holds every group, served as full
attention; the window of 256 tokens is a whole chunk, so every chunk of every layer comes
back, except the recurrent group's blocks outside its one-block window, which are never
stored.

Usage: python vllm_hybrid.py tcp://127.0.0.1:PORT separate|merged
"""
import sys

import torch
import zmq
from lmcache.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
    ParallelStrategy,
)
from lmcache.v1.multiprocess.group_view import EngineGroupInfo

from vllm_adapters import TIMEOUT, wait_for  # beside this file

BS, NB, CHUNK = 16, 200, 256
CHUNKS = 3
PER_CHUNK = CHUNK // BS
# layer -> (engine group, shape after [2, NB, BS])
LAYERS = {0: (0, (2, 64)), 1: (0, (2, 64)), 2: (1, (1, 64)), 3: (2, (1, 32))}
FULL, WINDOW, RECURRENT = 0, 1, 2


def main():
    url, mode = sys.argv[1], sys.argv[2]
    ctx = zmq.Context()
    ps = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1,
                          pp_size=1, n_servers=1)
    torch.manual_seed(0)
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(2, NB, BS, *shape, dtype=torch.float16)
          for i, (_, shape) in LAYERS.items()}
    infos = [
        EngineGroupInfo(engine_group_id=0, layer_indices=(0, 1), tokens_per_block=BS),
        EngineGroupInfo(engine_group_id=1, layer_indices=(2,), tokens_per_block=BS,
                        sw_size_tokens=CHUNK),
        EngineGroupInfo(engine_group_id=2, layer_indices=(3,), tokens_per_block=BS,
                        sw_size_tokens=BS, recurrent_state=True),
    ]
    worker = LMCacheMPWorkerAdapter(url, ctx, "hybrid-model", BS, ps, mq_timeout=TIMEOUT,
                                    heartbeat_interval=1.0)
    worker.register_kv_caches(kv, engine_group_infos=infos)
    sched = LMCacheMPSchedulerAdapter([url], ctx, "hybrid-model", BS, ps, mq_timeout=TIMEOUT,
                                      heartbeat_interval=1.0)
    names = list(kv)
    checked = 0

    def run(prompt, tokens, null_window_tail, want_chunks):
        nonlocal checked
        n = CHUNKS * PER_CHUNK
        base = 1 + prompt * 2 * n  # block 0 is the null block
        src = [list(range(base, base + n)) for _ in infos]
        dst = [list(range(base + n, base + 2 * n)) for _ in infos]
        if null_window_tail:
            src[WINDOW][-PER_CHUNK:] = [0] * PER_CHUNK
        rid = f"store-{prompt}"
        sched.maybe_submit_lookup_request(rid, tokens)
        assert wait_for("cold lookup", lambda: sched.check_lookup_result(rid)) == 0
        op = LoadStoreOp(token_ids=tokens, block_ids=src, start=0, end=CHUNKS * CHUNK)
        worker.submit_store_request(rid, op, worker.create_recorded_event())
        wait_for("store", lambda: (worker.get_finished({rid})[0] or set()) & {rid} or None)
        sched.end_session(rid)

        rid = f"load-{prompt}"
        sched.maybe_submit_lookup_request(rid, tokens)
        hit = wait_for("warm lookup", lambda: sched.check_lookup_result(rid))
        # vLLM recomputes the last token of a full-prompt hit.
        assert hit // CHUNK == want_chunks or (hit + 1) // CHUNK == want_chunks, \
            f"prompt {prompt}: hit {hit} tokens, want {want_chunks} chunks"
        end = want_chunks * CHUNK
        for t in kv.values():
            # A slice, not a list index: `t[:, list]` would zero a copy.
            t[:, dst[0][0]:dst[0][-1] + 1].zero_()
            assert not t[:, dst[0][0]:dst[0][-1] + 1].any()
        op = LoadStoreOp(token_ids=tokens, block_ids=[d[:end // BS] for d in dst], start=0,
                         end=end)
        worker.submit_retrieve_request(rid, op, worker.create_recorded_event())
        wait_for("retrieve", lambda: (worker.get_finished({rid})[1] or set()) & {rid} or None)
        sched.end_session(rid)

        for layer, (group, _) in LAYERS.items():
            t = kv[names[layer]]
            for j in range(n):
                chunk, in_chunk = divmod(j, PER_CHUNK)
                if chunk >= want_chunks:
                    restored = False
                elif group == FULL:
                    restored = True
                elif group == WINDOW:
                    restored = mode == "merged" or chunk == want_chunks - 1
                else:  # recurrent: only the state block, of the last chunk when separate
                    restored = in_chunk == PER_CHUNK - 1 and (
                        mode == "merged" or chunk == want_chunks - 1)
                got = t[:, dst[0][j]]
                if restored:
                    assert torch.equal(got, t[:, src[group][j]]), \
                        f"prompt {prompt} layer {layer} block {j}: not restored"
                else:
                    assert not got.any(), \
                        f"prompt {prompt} layer {layer} block {j}: written, not promised"
                checked += 1

    tokens_a = [7] + list(range(1000, 1000 + CHUNKS * CHUNK))
    tokens_b = [9] + list(range(5000, 5000 + CHUNKS * CHUNK))
    run(0, tokens_a, False, CHUNKS)
    run(1, tokens_b, True, CHUNKS - 1 if mode == "separate" else CHUNKS)
    print(f"vllm hybrid ({mode}): 3 engine groups, 2 prompts, {checked} blocks checked: "
          f"bytes equal where the fold promised them, zero elsewhere")
    worker.shutdown()
    sched.shutdown()


if __name__ == "__main__":
    main()
