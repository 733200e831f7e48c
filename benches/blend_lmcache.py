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

CS = 256


def main():
    args = [int(a) for a in sys.argv[1:]]
    chunks, qlen, hits, queries = (args + [100_000, 8192, 8, 2000][len(args):])[:4]
    rng = np.random.default_rng(7)
    contents = rng.integers(0, 150_000, size=(chunks, CS), dtype=np.uint32)
    ns = BlendNamespace(model_name="m", cache_salt="", world_size=1)
    ix = BlendIndex(chunk_size=CS, probe_stride=1)
    ix.add(contents[0], b"warm", 0, ns)  # compile the kernels outside the timing
    ix.remove_claim(contents[0], b"warm", ns)
    t = time.perf_counter()
    for n in range(chunks):
        ix.add(contents[n], n.to_bytes(32, "little"), (n % 64) * CS, ns)
    index_s = time.perf_counter() - t
    lat, found = [], 0
    slot = qlen // hits
    for i in range(queries + 20):
        q = rng.integers(150_000, 300_000, size=qlen, dtype=np.uint32)
        for h in range(hits):
            at = h * slot + int(rng.integers(0, slot - CS))
            q[at:at + CS] = contents[int(rng.integers(0, chunks))]
        t = time.perf_counter()
        m = ix.match(q, ns)
        if i >= 20:
            lat.append((time.perf_counter() - t) * 1e6)
            found += len(m)
    lat.sort()
    p50, p99 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]
    print(f"LMCache BlendIndex index: {chunks} chunks in {index_s:.3f} s = "
          f"{chunks / index_s:.0f} chunks/s")
    print(f"LMCache BlendIndex match: {queries} queries of {qlen} tokens with {hits} stored "
          f"chunks each: p50 {p50:.1f} us, p99 {p99:.1f} us; found {found} of {queries * hits}")


if __name__ == "__main__":
    main()
