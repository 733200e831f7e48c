"""The CacheBlend benches' shared workload (benches/blend_lmcache.py for LMCache's coordinator
index, benches/blend_matcher_lmcache.py for its server matcher; the Rust benches draw the same
distributions): N stored chunks of 256 random tokens, then queries of Q tokens holding K
stored chunks at random unaligned positions among unstored tokens.
"""
import numpy as np

CS = 256
WARMUP = 20


def params(argv):
    """`[chunks] [query_tokens] [hits] [queries]`, defaults 100000 8192 8 2000."""
    args = [int(a) for a in argv]
    return (args + [100_000, 8192, 8, 2000][len(args):])[:4]


def contents(rng, chunks):
    """The stored chunks' tokens, one row each."""
    return rng.integers(0, 150_000, size=(chunks, CS), dtype=np.uint32)


def queries(rng, stored, qlen, hits, n):
    """`n` queries after WARMUP uncounted ones: (counted, tokens), each holding `hits` stored
    chunks, one per slot of `qlen // hits` tokens."""
    slot = qlen // hits
    for i in range(n + WARMUP):
        q = rng.integers(150_000, 300_000, size=qlen, dtype=np.uint32)
        for h in range(hits):
            at = h * slot + int(rng.integers(0, slot - CS))
            q[at:at + CS] = stored[int(rng.integers(0, len(stored)))]
        yield i >= WARMUP, q


def percentiles(lat):
    """p50 and p99 of latencies."""
    lat = sorted(lat)
    return lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]
