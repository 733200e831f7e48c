"""Writes a synthetic lookup-hash log in LMCache's format: N requests over 200 shared
"system prompts" of 1-8 chunks (Zipf-like popularity), each followed by 0-6 unique chunks and a
partial tail; hashes are prefix-chained (a chunk's hash covers its whole prefix).

Usage: python gen_lookup_log.py DIR N [SEED]
"""
import hashlib
import json
import os
import random
import sys


def main():
    out, n = sys.argv[1], int(sys.argv[2])
    rng = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 7)
    os.makedirs(out, exist_ok=True)
    prompts = [rng.randint(1, 8) for _ in range(200)]
    weights = [1 / (i + 1) for i in range(len(prompts))]
    path = os.path.join(out, "lookup_hashes_20261201_000000_000000.jsonl")
    with open(path, "w") as f:
        for r in range(n):
            p = rng.choices(range(len(prompts)), weights)[0]
            parts = [f"p{p}:{i}" for i in range(prompts[p])]
            parts += [f"r{r}:{i}" for i in range(rng.randint(0, 6))]
            h, hashes = hashlib.blake2b(digest_size=32), []
            for part in parts:
                h.update(part.encode())
                hashes.append("0x" + h.copy().hexdigest())
            seq_len = len(hashes) * 256 + rng.randint(0, 255)
            f.write(json.dumps({"timestamp": 1.7e9 + r * 0.01, "request_id": f"req-{r}",
                                "model_name": "gen-model", "chunk_size": 256, "seq_len": seq_len,
                                "dtypes": ["torch.float16"], "shapes": [[2, 32, 256, 1024]],
                                "chunk_hashes": hashes}) + "\n")


if __name__ == "__main__":
    main()
