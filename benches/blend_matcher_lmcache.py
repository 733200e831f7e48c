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

from blend_workload import CS, contents, params, percentiles, queries


def main():
    chunks, qlen, hits, n = params(sys.argv[1:])
    rng = np.random.default_rng(7)
    stored = contents(rng, chunks)
    m = BlendTokenRangeMatcher(CS)
    m.match_sub_sequence([0] * CS)  # compile the kernels outside the timing
    t = time.perf_counter()
    for k in range(chunks):
        m.on_new_token_hashes(stored[k].tolist(), [k.to_bytes(32, "little")], 0, (k % 64) * CS)
    index_s = time.perf_counter() - t
    lat, found = [], 0
    for counted, q in queries(rng, stored, qlen, hits, n):
        tokens = q.tolist()  # the server gets the key's token list
        t = time.perf_counter()
        r = m.match_sub_sequence(tokens)
        if counted:
            lat.append((time.perf_counter() - t) * 1e6)
            found += len(r)
    p50, p99 = percentiles(lat)
    print(f"LMCache BlendTokenRangeMatcher index: {chunks} chunks in {index_s:.3f} s = "
          f"{chunks / index_s:.0f} chunks/s")
    print(f"LMCache BlendTokenRangeMatcher match: {n} queries of {qlen} tokens with {hits} "
          f"stored chunks each: p50 {p50:.1f} us, p99 {p99:.1f} us; found {found} of "
          f"{n * hits}")


if __name__ == "__main__":
    main()
