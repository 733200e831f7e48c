"""CacheBlend's fleet fragment lookup, differentially: the same cache-event batches go to
LMCache's coordinator and to ours (both with --enable-blend-lookup --chunk-size 4), then
random queries built from stored and unstored windows must get identical
/directory/blend-lookup answers from both, for every namespace (two salts, two world sizes).

The trace: several rounds of stores (chunks with tokens over a small alphabet, so windows
repeat across chunks and one content is held by several chunk hashes, some without a known
position), deletes of some keys (one rank of a two-rank chunk, then the other), and queries
after every round.

Usage: python blend_parity.py LMCACHE_COORDINATOR_URL LMCACHE_RS_COORDINATOR_URL
"""
import base64
import json
import random
import struct
import sys
import urllib.request

CS = 4


def call(url, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read() or b"null")


def main():
    urls = sys.argv[1:3]
    rng = random.Random(20261201)
    for u in urls:
        call(f"{u}/instances", {"instance_id": "a", "ip": "127.0.0.1", "http_port": 1})
    seq = 0
    namespaces = [("s", 1), ("s", 2), ("t", 1)]
    live = {}  # (hash, salt, ws, rank) -> tokens
    contents = [[rng.randint(1, 3) for _ in range(CS)] for _ in range(12)]
    queries = 0
    offsets = {}
    matches = 0

    def send(event_type, entries):
        nonlocal seq
        seq += 1
        batch = {"instance_id": "a", "incarnation": 1, "seq": seq, "event_type": event_type,
                 "tier": "l1", "backend": "dram", "entries": entries}
        for u in urls:
            call(f"{u}/events", {"batches": [batch]})

    def key(h, salt, ws, rank):
        return {"chunk_hash_hex": h, "model_name": "m", "cache_salt": salt,
                "kv_rank": ws << 24 | rank << 16 | ws << 8 | rank}

    for rnd in range(8):
        entries = []
        for _ in range(10):
            h = f"{rng.randrange(40):064x}"
            salt, ws = rng.choice(namespaces)
            tokens = rng.choice(contents)
            # A chunk hash implies its position (the prefix chain), so each keeps one offset;
            # a quarter are reported without it.
            offset = offsets.setdefault(h, rng.choice([-1, CS * rng.randrange(8),
                                                       CS * rng.randrange(8), CS * rng.randrange(8)]))
            if any(k[0] == h for k in live):
                # Re-stores of a known chunk keep its content (a content change under one hash
                # is where the two indexes differ on purpose: see the module docstring).
                tokens = next(t for k, t in live.items() if k[0] == h)
            for rank in range(ws):
                live[(h, salt, ws, rank)] = tokens
                entries.append({"key": key(h, salt, ws, rank), "size_bytes": 1,
                                "token_ids": tokens, "token_offset": offset})
        send("store", entries)
        gone = rng.sample(sorted(live), min(len(live), 4))
        send("delete", [{"key": key(*k), "size_bytes": 0} for k in gone])
        for k in gone:
            del live[k]
        for _ in range(30):
            q = []
            while len(q) < 24:
                q += rng.choice(contents) if rng.random() < 0.7 else [rng.randint(1, 3)]
            b64 = base64.b64encode(struct.pack(f"<{len(q)}I", *q)).decode()
            for salt, ws in namespaces + [("u", 1)]:
                body = {"tokens_b64": b64, "model_name": "m", "world_size": ws,
                        "cache_salt": salt}
                a, b = (call(f"{u}/directory/blend-lookup", body)["matches"] for u in urls)
                assert a == b, f"round {rnd} query {q} {salt}/{ws}:\n LMCache {a}\n ours    {b}"
                queries += 1
                matches += len(a)
    assert matches > queries, f"the trace must exercise matches: {matches} in {queries} queries"
    print(f"blend parity: {queries} queries ({matches} matches) over 8 rounds of stores and "
          f"deletes answered identically by LMCache's coordinator and ours")


if __name__ == "__main__":
    main()
