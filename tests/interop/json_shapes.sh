#!/usr/bin/env bash
# Interop: the JSON our benches print has every field LMCache's prints, at the same place, so
# a script written for LMCache's output reads ours. Both `bench l2` (fs adapter, same flags)
# and `bench server` (both against an lmcache-rs server) run with --format json; every key of
# LMCache's document, recursively, must be in ours (ours may add fields).
# Usage: tests/interop/json_shapes.sh PATH/TO/lmcache-rs
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:?usage: json_shapes.sh PATH/TO/lmcache-rs}
# shellcheck source=tests/interop/common.sh
. tests/interop/common.sh
L2=(--num-keys 4 --in-flight 2 --data-size-kb 64 --rounds 2 --warmup-rounds 1 --format json)
for hit in 0.0 0.5; do
  mkdir -p "$WORK/l2-theirs-$hit" "$WORK/l2-ours-$hit"
  timeout 300 "$VENV/bin/lmcache" bench l2 --l2-adapter "{\"type\": \"fs\", \"base_path\": \"$WORK/l2-theirs-$hit\"}" \
      "${L2[@]}" --lookup-max-hit-rate "$hit" > "$WORK/l2-$hit-theirs.json" 2> "$WORK/l2-theirs.err" \
    || { echo "FAILED: LMCache's bench l2"; tail "$WORK/l2-theirs.err"; exit 1; }
  "$BIN" bench l2 --l2-adapter "{\"type\": \"fs\", \"base_path\": \"$WORK/l2-ours-$hit\"}" \
      "${L2[@]}" --lookup-max-hit-rate "$hit" > "$WORK/l2-$hit-ours.json" 2> "$WORK/l2-ours.err" \
    || { echo "FAILED: our bench l2"; tail "$WORK/l2-ours.err"; exit 1; }
done
port=$(free_port); http=$(free_port)
"$BIN" server --host 127.0.0.1 --port "$port" --http-port "$http" --l1-size-gb 1 \
    --shm-name "lmcache_rs_js_$$" --exit-after-seconds 300 > "$WORK/server.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$http/healthcheck" "$WORK/server.log"
timeout 300 "$VENV/bin/lmcache" bench server --rpc-url "tcp://127.0.0.1:$port" --url "http://127.0.0.1:$http" \
    --mode cpu --num-tokens 512 --start 0 --end 3 --interval 0 --format json \
    > "$WORK/server-theirs.json" 2> "$WORK/server-theirs.err" \
  || { echo "FAILED: LMCache's bench server"; tail "$WORK/server-theirs.err"; exit 1; }
"$BIN" bench server --rpc-url "tcp://127.0.0.1:$port" --url "http://127.0.0.1:$http" --num-tokens 512 \
    --start 100 --end 103 --format json > "$WORK/server-ours.json" 2> "$WORK/server-ours.err" \
  || { echo "FAILED: our bench server"; tail "$WORK/server-ours.err"; exit 1; }
"$VENV/bin/python" - "$WORK" <<'PY'
import json, sys
work = sys.argv[1]
def load(path):
    # LMCache prints its progress on stdout before the document.
    s = open(path).read()
    start = 0 if s.startswith("{") else s.index("\n{") + 1
    return json.JSONDecoder().raw_decode(s[start:])[0]
def missing(theirs, ours, path=""):
    out = []
    if isinstance(theirs, dict):
        if not isinstance(ours, dict):
            return [f"{path} (ours is not an object)"]
        for k, v in theirs.items():
            out += [f"{path}.{k}"] if k not in ours else missing(v, ours[k], f"{path}.{k}")
    return out
fields = 0
for name in ["l2-0.0", "l2-0.5", "server"]:
    theirs, ours = load(f"{work}/{name}-theirs.json"), load(f"{work}/{name}-ours.json")
    gone = missing(theirs, ours)
    assert not gone, f"bench {name}: our JSON lacks LMCache's {gone}"
    for k, sec in theirs["metrics"].items():
        fields += len(sec) if isinstance(sec, dict) else 1
        if isinstance(sec, dict) and "operation" in sec:
            assert ours["metrics"][k]["operation"] == sec["operation"], (name, k)
            if name.startswith("l2"):
                # Same flags, so the same counts: every key succeeds, lookups hit as the
                # hit rate says, warm-up rounds not counted.
                for f in ("total_keys", "total_success"):
                    assert ours["metrics"][k][f] == sec[f], (name, sec["operation"], f, ours["metrics"][k][f], sec[f])
print(f"JSON shapes: our bench l2 and bench server documents carry every one of LMCache's {fields} fields")
PY
