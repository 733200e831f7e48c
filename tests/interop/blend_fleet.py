"""CacheBlend across a fleet: server A stores a prompt, and server B, which never saw it, finds
its document anywhere in another prompt through the coordinator's /directory/blend-lookup,
loads the chunk's KV from the L2 both share, and scatters it into its own engine's blocks at
the new positions, K re-rotated. Driven with LMCache's own client classes (blend_engine.py's
Engine), once with lmcache-rs's coordinator and once with LMCache's.

Checks: B's lookup answers exactly what A's own matcher answers for the same prompt (positions
and hash bytes); B's scatter passes LMCache's re-rotation oracle; B never struck the chunk;
B's metrics count the coordinator's match and the L2 read.

Usage: python blend_fleet.py tcp://SERVER_A tcp://SERVER_B http://A_HTTP http://B_HTTP
"""
import sys
import time

import zmq

from blend_engine import P1, P2, Engine, check_scatter, zero
from prom import metric, metrics  # beside this file


def found(eng, rid, tokens, deadline):
    """B's lookup, asked again with a new request until the fleet has the chunk (the
    coordinator's events and the L2 write-behind are asynchronous)."""
    i = 0
    while True:
        seg, r = eng.lookup(f"{rid}-{i}", tokens)
        if seg[1] or time.monotonic() > deadline:
            return seg, r, f"{rid}-{i}"
        eng.end(f"{rid}-{i}")
        i += 1
        time.sleep(0.2)


def written_to_l2(http, deadline):
    """Waits until the server's L2 write-behind has written everything submitted to it."""
    while True:
        done, asked = metrics(http, "lmcache_mp_l2_store_completed_objects_total",
                              "lmcache_mp_l2_store_submitted_objects_total")
        if asked >= 1 and done >= asked:
            return
        assert time.monotonic() < deadline, f"A's L2 writes: {done} of {asked}"
        time.sleep(0.05)


def main():
    url_a, url_b, http_a, http_b = sys.argv[1:5]
    ctx = zmq.Context()
    a, b = Engine(url_a, ctx), Engine(url_b, ctx)
    for eng in (a, b):
        eng.register_kv()
        assert eng.register_rope(neox=True) is None
    src = list(range(0, 32))
    a.write_prompt(src, neox=True)
    assert a.store("p1", P1, src), "A's store"
    zero(a)
    # B may only look once the chunk is in the L2 they share: a lookup before that finds the
    # coordinator's match but no KV, and counts it stale (as it should).
    written_to_l2(http_a, time.monotonic() + 30)

    # What A's own matcher answers for P2: the truth B must reach through the fleet.
    want, _ = a.lookup("qa", P2)
    a.end("qa")
    assert want[1] and want[1][0][:4] == (256, 512, 300, 556), want

    seg, r, rid = found(b, "qb", P2, time.monotonic() + 30)
    assert seg == want, f"B through the coordinator: {seg}, A locally: {want}"
    table = list(range(40, 90))
    assert b.retrieve(rid, P2, r.non_prefix_segments, table) is True, "B's scatter"
    check_scatter(b, table, neox=True)
    b.end(rid)

    # A prompt with nothing of A's in it: nothing, and nothing struck.
    none, _ = b.lookup("qn", list(range(900_000, 900_600)))
    b.end("qn")
    assert none == (0, [], []), none
    again, _, rid = found(b, "qc", P2, time.monotonic() + 10)
    assert again == want, "the chunk is still found"
    b.end(rid)

    assert metric(http_b, "lmcache_blend_coordinator_matches_total") >= 2
    assert metric(http_b, "lmcache_blend_sparse_prefetch_l2_keys_total") >= 1
    assert metric(http_b, "lmcache_blend_coordinator_match_timeouts_total") == 0
    assert metric(http_b, "lmcache_blend_lookup_stale_chunks_total") == 0
    a.close()
    b.close()
    print("blend fleet: ok (B found A's document through the coordinator, loaded it from the "
          "shared L2 and scattered it past LMCache's oracle)")


if __name__ == "__main__":
    main()
