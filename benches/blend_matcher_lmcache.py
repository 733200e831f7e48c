"""LMCache 0.5.6's server-side CacheBlend matcher (`BlendTokenRangeMatcher`, what its
cb_unified_lookup matches with) on the workload of `cargo bench -p lmcache-blend --bench
matcher`: N stored chunks of 256 random tokens fingerprinted, then queries of Q tokens holding
K stored chunks at random unaligned positions. Same parameters and distributions, its own
random draw. Reports the fingerprinting rate and `match_sub_sequence` latency p50/p99 (the
first queries warm numba's kernels and are not counted).

Usage: python benches/blend_matcher_lmcache.py [chunks] [query_tokens] [hits] [queries]
(the LMCache virtualenv: scripts/lmcache-venv)
"""
import sys
import time

import numpy as np
from lmcache.v1.multiprocess.modules.blend.matcher import BlendTokenRangeMatcher

CS = 256


def main():
    args = [int(a) for a in sys.argv[1:]]
    chunks, qlen, hits, queries = (args + [100_000, 8192, 8, 2000][len(args):])[:4]
    rng = np.random.default_rng(7)
    contents = rng.integers(0, 150_000, size=(chunks, CS), dtype=np.uint32)
    m = BlendTokenRangeMatcher(CS)
    m.match_sub_sequence([0] * CS)  # compile the kernels outside the timing
    t = time.perf_counter()
    for n in range(chunks):
        m.on_new_token_hashes(contents[n].tolist(), [n.to_bytes(32, "little")], 0,
                              (n % 64) * CS)
    index_s = time.perf_counter() - t
    lat, found = [], 0
    slot = qlen // hits
    for i in range(queries + 20):
        q = rng.integers(150_000, 300_000, size=qlen, dtype=np.uint32)
        for h in range(hits):
            at = h * slot + int(rng.integers(0, slot - CS))
            q[at:at + CS] = contents[int(rng.integers(0, chunks))]
        tokens = q.tolist()  # the server gets the key's token list
        t = time.perf_counter()
        r = m.match_sub_sequence(tokens)
        if i >= 20:
            lat.append((time.perf_counter() - t) * 1e6)
            found += len(r)
    lat.sort()
    p50, p99 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]
    print(f"LMCache BlendTokenRangeMatcher index: {chunks} chunks in {index_s:.3f} s = "
          f"{chunks / index_s:.0f} chunks/s")
    print(f"LMCache BlendTokenRangeMatcher match: {queries} queries of {qlen} tokens with {hits} "
          f"stored chunks each: p50 {p50:.1f} us, p99 {p99:.1f} us; found {found} of "
          f"{queries * hits}")


if __name__ == "__main__":
    main()
