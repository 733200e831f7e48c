"""CacheBlend, differentially: LMCache 0.5.6's blend server (`lmcache server --engine-type
blend`) and ours get the same calls from LMCache's own client classes (RequestClientFactory,
create_transfer_context(mode="lmcache_driven"), the CPU shm wrapper for the cos/sin cache),
playing the engine connector LMCache does not ship. The answers both can give must be equal:
handshakes, every unified lookup (hash bytes included), the early retrieve outcomes, the
reorder plans. Where LMCache's CPU server cannot scatter, ours must, and an oracle checks it:
LMCache's own CPU re-rotation (rotary_embedding_k_fused) plus RoPE from the raw K.

Scenario (reference notes, blend-p2p-cpu.md A3): fp32 KV of 4 layers [2, NB, 16, 2, 64], chunk
256. P1 = [A | D] is stored; D (chunk 1) is fingerprinted, A (chunk 0) never is.
P2 = [B | 44 filler | D | tail] finds D at 300. Then: the prefix hit, chunk 0 never matching,
overlapping matches (the earlier wins), the retrieve's early outcomes, the scatter (NeoX, and
GPT-J with a YaRN-style scale of 1.2 the server must remove), reorder plans, unregistering.

Where LMCache is wrong, ours is right and this says so: LMCache's fingerprints ignore the cache
salt, so another tenant's lookups strike out D's fingerprint for everyone (two strikes); ours
keeps each tenant's apart, and D is still found afterwards.

Usage: python blend_engine.py tcp://LMCACHE_BLEND_SERVER tcp://LMCACHE_RS_BLEND_SERVER
"""
import sys
import time

import torch
import zmq
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.group_view import EngineGroupInfo
from lmcache.v1.multiprocess.transfer_context.worker_transfer import create_transfer_context
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory
from lmcache.v1.platform import resolve_kv_wrapper_factory
from lmcache.v1.platform.torch_ops.pos_kernels import rotary_embedding_k_fused

BS, NB, LAYERS, NH, HS = 16, 96, 4, 2, 64
CHUNK = 256
MODEL = "blend-model"
IID = 7
MAX_POS = 4096
T = 10.0  # seconds an answer may take
NO_REPLY = "no reply"


def seq(seed, n):
    return [seed * 10_000 + t for t in range(n)]


A, D, B = seq(1, CHUNK), seq(4, CHUNK), seq(2, CHUNK)
FILLER, TAIL = seq(9, 44), seq(8, 200)
P1 = A + D
P2 = B + FILLER + D + TAIL  # D at 300..556
# The GPT-J round's own documents (a store of P1 again would find it resident and keep it).
A2, D2 = seq(11, CHUNK), seq(14, CHUNK)


def cos_sin(scale=1.0):
    """vLLM's layout: [max_pos, rot_dim], cos in the first half, sin in the second."""
    inv = 10_000.0 ** (-torch.arange(0, HS, 2, dtype=torch.float64) / HS)
    ang = torch.arange(MAX_POS, dtype=torch.float64)[:, None] * inv[None, :]
    return (torch.cat([ang.cos(), ang.sin()], dim=1) * scale).to(torch.float32).contiguous()


def rope(k, old, new, neox):
    """LMCache's own CPU re-rotation of K [T, NH, HS] from positions old to new."""
    k = k.clone()
    rotary_embedding_k_fused(torch.tensor(old), torch.tensor(new), k, HS, cos_sin(), neox)
    return k


def key(rid, tokens, worker=None, salt=""):
    return IPCCacheServerKey(model_name=MODEL, world_size=1, worker_id=worker,
                             token_ids=tuple(tokens), start=0, end=len(tokens), request_id=rid,
                             cache_salt=salt, num_kv_readers=1)


def answer(fut, timeout=T):
    """The reply, or NO_REPLY where the server sent none (LMCache raises and stays silent)."""
    try:
        return fut.result(timeout=timeout)
    except TimeoutError:
        return NO_REPLY


class Engine:
    """One worker of the absent blend connector: paged KV in shm, registered lmcache-driven."""

    def __init__(self, url, ctx):
        self.client = RequestClientFactory.create(url, context=ctx)
        torch.manual_seed(0)
        self.kv = {f"layer.{i}": torch.zeros(2, NB, BS, NH, HS, dtype=torch.float32)
                   for i in range(LAYERS)}
        self.raw_k = torch.randn(LAYERS, len(P1), NH, HS)
        self.v = torch.randn(LAYERS, len(P1), NH, HS)
        self.tc = create_transfer_context(self.kv, mode="lmcache_driven", instance_id=IID,
                                          req_client=self.client)
        self.wrap = resolve_kv_wrapper_factory("cpu")

    def register_kv(self):
        group = EngineGroupInfo(engine_group_id=0, layer_indices=tuple(range(LAYERS)),
                                tokens_per_block=BS)
        self.tc.register(self.kv, MODEL, 1, CHUNK // BS, T, layout_hints={"kv_layout": "NHD"},
                         engine_group_infos=[group])

    def register_rope(self, neox=True, scale=1.0):
        # The tensor is kept alive: its shm segment is unlinked when it is collected.
        self.cache_tensor = cos_sin(scale)
        self.cache = self.wrap(self.cache_tensor)
        return answer(self.client.cb_register_rope(IID, [self.cache], HS, neox, [], [], [], ""))

    def write_prompt(self, blocks, neox):  # the same KV whichever tokens are stored
        """P1's KV into `blocks`: K = RoPE(raw K, position), V random."""
        pos = list(range(len(P1)))
        for layer in range(LAYERS):
            k = rope(self.raw_k[layer], [0] * len(pos), pos, neox)
            t = self.kv[f"layer.{layer}"]
            for p in pos:
                b, s = blocks[p // BS], p % BS
                t[0, b, s] = k[p]
                t[1, b, s] = self.v[layer, p]

    def store(self, rid, tokens, blocks):
        fut = self.tc.submit_store(rid, key(rid, tokens, worker=0), self.kv, [blocks],
                                   self.tc.create_recorded_event(), CHUNK // BS)
        ok = fut.result(timeout=T)
        self.client.end_session(rid).result(timeout=T)
        return bool(ok)

    def lookup(self, rid, tokens, salt=""):
        k = key(rid, tokens, salt=salt)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r = answer(self.client.cb_unified_lookup(k, 1))
            if r is not None:
                assert r != NO_REPLY, f"cb_unified_lookup {rid}: no reply"
                seg = lambda m: (m.old_st, m.old_ed, m.cur_st, m.cur_ed, bytes(m.hash).hex())
                return (r.prefix_coverage_tokens, [seg(m) for m in r.non_prefix_segments],
                        [seg(m) for m in r.segmented_prefix_segments]), r
            time.sleep(0.01)
        raise AssertionError(f"cb_unified_lookup {rid} never answered")

    def retrieve(self, rid, tokens, matches, blocks, instance=IID):
        r = answer(self.client.cb_retrieve_pre_computed(key(rid, tokens, worker=0), matches,
                                                        [blocks], instance, b""))
        return r if r == NO_REPLY else bool(r[1])

    def end(self, rid):
        self.client.end_session(rid).result(timeout=T)

    def close(self):
        self.tc.close()
        self.client.close()


def check_scatter(eng, table, neox):
    """D's KV at 300.. of `table`: V as stored, K rotated 256+t -> 300+t (LMCache's oracle,
    and RoPE from the raw K); every other slot untouched (zero)."""
    t = torch.arange(CHUNK)
    old, new = (256 + t).tolist(), (300 + t).tolist()
    slots = {(table[p // BS], p % BS) for p in new}
    for layer in range(LAYERS):
        kv = eng.kv[f"layer.{layer}"]
        stored_k = rope(eng.raw_k[layer, 256:512], [0] * CHUNK, old, neox)
        want_k = rope(stored_k, old, new, neox)  # LMCache's re-rotation
        fresh_k = rope(eng.raw_k[layer, 256:512], [0] * CHUNK, new, neox)  # from raw K
        got_k = torch.stack([kv[0, table[p // BS], p % BS] for p in new])
        got_v = torch.stack([kv[1, table[p // BS], p % BS] for p in new])
        assert torch.equal(got_v, eng.v[layer, 256:512]), f"layer {layer}: V differs"
        err = (got_k - want_k).abs().max().item()
        err_raw = (got_k - fresh_k).abs().max().item()
        assert err < 1e-4 and err_raw < 1e-4, f"layer {layer}: K off by {err} / {err_raw}"
        mask = torch.ones(NB, BS, dtype=torch.bool)
        for b, s in slots:
            mask[b, s] = False
        assert kv[:, mask].abs().max().item() == 0, f"layer {layer}: a slot outside was written"
    return True


def zero(eng):
    for t in eng.kv.values():
        t.zero_()


def scenario(url, ctx, ours):
    out, eng = {}, Engine(url, ctx)
    c = eng.client
    out["handshake"] = [list(answer(c.cb_protocol_handshake(v))) for v in (1, 2)]
    # Before register_kv_cache: LMCache raises (no reply); ours replies void. Not compared.
    early_tensor = cos_sin()
    early = eng.wrap(early_tensor)
    out_norope = answer(c.cb_register_rope(IID, [early], HS, True, [], [], [], ""), 3)
    eng.register_kv()
    out["rope"] = eng.register_rope(neox=True)
    src = list(range(0, 32))
    eng.write_prompt(src, neox=True)
    out["store_p1"] = eng.store("p1", P1, src)
    time.sleep(0.5)  # LMCache fingerprints 5 ms after a store's reply, from a thread
    zero(eng)

    out["p2"], r2 = eng.lookup("q2", P2)
    # The prefix hit, then D past it at 512.
    p3 = A + seq(5, CHUNK) + D + TAIL
    out["p3"], _ = eng.lookup("q3", p3)
    eng.end("q3")
    # A (chunk 0 of a store from token 0) is never fingerprinted.
    out["chunk0"], _ = eng.lookup("q0", FILLER + A + TAIL)
    eng.end("q0")

    # Retrieve of q2's match: the early outcomes, then the scatter.
    table = list(range(40, 90))  # 800 tokens
    matches = r2.non_prefix_segments
    out["beyond"] = eng.retrieve("q2", P2, matches, table[:18])  # ends at 288 < 300
    out["straddle"] = eng.retrieve("q2", P2, matches, table[:26])  # ends at 416
    assert all(v.abs().max().item() == 0 for v in eng.kv.values()), "an early outcome wrote"
    full = eng.retrieve("q2", P2, matches, table)
    if ours:
        assert full is True, f"our scatter: {full}"
        check_scatter(eng, table, neox=True)
        zero(eng)
        assert eng.retrieve("q2", P2, matches, table) is True, "repeat"
        assert all(v.abs().max().item() == 0 for v in eng.kv.values()), "applied twice"
    else:
        # LMCache's CPU server has no scatter kernel: it answers false and writes nothing.
        assert full is False, f"LMCache's CPU scatter: {full}"
        assert all(v.abs().max().item() == 0 for v in eng.kv.values())
    eng.end("q2")

    # GPT-J, with a YaRN-style scale baked into the cache: removed before rotating.
    out["rope_gptj"] = eng.register_rope(neox=False, scale=1.2)
    eng.write_prompt(src, neox=False)
    out["store_p1b"] = eng.store("p1b", A2 + D2, src)
    time.sleep(0.5)
    zero(eng)
    p2b = B + FILLER + D2 + TAIL
    out["p2b"], r = eng.lookup("q2b", p2b)
    full = eng.retrieve("q2b", p2b, r.non_prefix_segments, table)
    if ours:
        assert full is True
        check_scatter(eng, table, neox=False)
        zero(eng)
    eng.end("q2b")

    # Overlap: F stored as chunk 1 of P4 starts inside D's range in P2 (at 428): D wins.
    f = P2[428:428 + CHUNK]
    out["store_p4"] = eng.store("p4", seq(6, CHUNK) + f, list(range(32, 64)))
    time.sleep(0.5)
    out["overlap"], _ = eng.lookup("q2c", P2)
    eng.end("q2c")

    # Reorder (both started with --enable-blend-reorder): P1's documents in another order are
    # served as P1's copy, then the question; a prompt already in order is kept.
    question = seq(7, 40)
    plans = []
    for tokens, keep in ((D + A + question, 0), (A + D + question, 0), (D + A + question, 300)):
        plan = answer(c.cb_reorder_plan(key("plan", tokens), keep, 5000))
        plans.append(list(plan))
    out["reorder"] = plans
    assert plans[0] == A + D + question, "the plan serves P1's order"
    assert plans[1] == [] and plans[2] == []

    # Unregistered rope: LMCache raises (no reply); ours refuses with (b"", false).
    out["unregister"] = answer(c.cb_unregister_rope(IID))
    _, r = eng.lookup("q2d", P2)
    after = answer(c.cb_retrieve_pre_computed(key("q2d", P2, worker=0), r.non_prefix_segments,
                                              [table], IID, b""), 3)
    after = after if after == NO_REPLY else bool(after[1])
    eng.end("q2d")
    assert after in (NO_REPLY, False), after
    assert all(v.abs().max().item() == 0 for v in eng.kv.values())

    # Another tenant's prompt with D in it: nothing found for it, on both.
    out["salted"] = [eng.lookup(f"s{i}", P2, salt="tenant-b")[0] for i in range(2)]
    for i in range(2):
        eng.end(f"s{i}")
    # LMCache struck D out for everyone after those two; ours still finds it.
    wrong_or_right, _ = eng.lookup("q2e", P2)
    eng.end("q2e")
    eng.close()
    return out, out_norope, wrong_or_right


def main():
    ctx = zmq.Context()
    theirs, norope_theirs, after_salt_theirs = scenario(sys.argv[1], ctx, ours=False)
    ours, norope_ours, after_salt_ours = scenario(sys.argv[2], ctx, ours=True)
    for name in theirs:
        assert theirs[name] == ours[name], f"{name}: LMCache {theirs[name]!r}, lmcache-rs {ours[name]!r}"
    h = theirs["p2"][1][0][4] if theirs["p2"][1] else None
    assert theirs["handshake"] == [[1, True], [1, False]], theirs["handshake"]
    assert theirs["p2"] == (0, [(256, 512, 300, 556, h)], []), theirs["p2"]
    assert theirs["p3"] == (256, [(256, 512, 512, 768, h)], []), theirs["p3"]
    assert theirs["chunk0"] == (0, [], []), theirs["chunk0"]
    assert theirs["overlap"] == theirs["p2"], theirs["overlap"]
    assert (theirs["beyond"], theirs["straddle"]) == (True, False)
    assert theirs["salted"] == [(0, [], [])] * 2
    # The conformance table's differences, asserted so a change in either is noticed.
    assert norope_theirs == NO_REPLY and norope_ours is None, (norope_theirs, norope_ours)
    assert after_salt_theirs == (0, [], []), f"LMCache kept D after the strikes: {after_salt_theirs}"
    assert after_salt_ours == theirs["p2"], f"ours lost D to another tenant: {after_salt_ours}"
    print(f"blend engine: ok (same answers as LMCache: {sorted(theirs)}; our scatter passed "
          "LMCache's re-rotation oracle, NeoX and GPT-J with a YaRN scale)")


if __name__ == "__main__":
    main()
