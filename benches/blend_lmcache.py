"""LMCache 0.5.6's coordinator BlendIndex on the workload of
`cargo bench -p lmcache-directory --bench blend`: N stored chunks of 256 random tokens, then
fragment queries of Q tokens holding K stored chunks at random unaligned positions.
Same parameters and distributions, its own random draw. Reports the indexing rate and
query latency p50/p99 (the first queries warm numba's kernels and are not counted).

Usage: python benches/blend_lmcache.py [chunks] [query_tokens] [hits] [queries]
(the LMCache virtualenv: scripts/lmcache-venv)
"""
import sys
import time

import numpy as np
from lmcache.v1.mp_coordinator.api import BlendNamespace
from lmcache.v1.mp_coordinator.blend_index import BlendIndex

from blend_workload import CS, contents, params, percentiles, queries


def main():
    chunks, qlen, hits, n = params(sys.argv[1:])
    rng = np.random.default_rng(7)
    stored = contents(rng, chunks)
    ns = BlendNamespace(model_name="m", cache_salt="", world_size=1)
    ix = BlendIndex(chunk_size=CS, probe_stride=1)
    ix.add(stored[0], b"warm", 0, ns)  # compile the kernels outside the timing
    ix.remove_claim(stored[0], b"warm", ns)
    t = time.perf_counter()
    for k in range(chunks):
        ix.add(stored[k], k.to_bytes(32, "little"), (k % 64) * CS, ns)
    index_s = time.perf_counter() - t
    lat, found = [], 0
    for counted, q in queries(rng, stored, qlen, hits, n):
        t = time.perf_counter()
        m = ix.match(q, ns)
        if counted:
            lat.append((time.perf_counter() - t) * 1e6)
            found += len(m)
    p50, p99 = percentiles(lat)
    print(f"LMCache BlendIndex index: {chunks} chunks in {index_s:.3f} s = "
          f"{chunks / index_s:.0f} chunks/s")
    print(f"LMCache BlendIndex match: {n} queries of {qlen} tokens with {hits} stored "
          f"chunks each: p50 {p50:.1f} us, p99 {p99:.1f} us; found {found} of {n * hits}")


if __name__ == "__main__":
    main()
