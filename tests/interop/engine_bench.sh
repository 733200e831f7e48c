#!/usr/bin/env bash
# `lmcache-rs bench engine` and LMCache 0.5.6's `lmcache bench engine`, each against the engine
# simulator (benches/engine_simulator: OpenAI's streaming API in front of a paged KV cache it
# moves through `lmcache-rs server` with vLLM's MP adapters; not an engine), one fresh server
# and simulator per run, same flags:
# - long-doc-qa, multi-round-chat and random-prefill;
# - both benches must count the same requests, all successful, and see the same share of the
#   prompts served by the cache (the simulator's own count, within 2 points), and ours must
#   report that share as the simulator measured it;
# - every block the simulator got back from the cache must hold what its prefill wrote
#   (kv_mismatch_blocks 0), and the server's lookups must have hit;
# - ours writes LMCache's two files (bench_results.csv, bench_summary.json) and a --plot PNG.
# Usage: tests/interop/engine_bench.sh PATH/TO/lmcache-rs
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=$(realpath "${1:?usage: engine_bench.sh PATH/TO/lmcache-rs}")
. tests/interop/common.sh
ROOT=$PWD
MODEL=lmcache-sim-model
"$VENV/bin/python" benches/engine_simulator/make_tokenizer.py "$WORK/$MODEL" > /dev/null

passed=0
failed=0

# Starts a server and the simulator in front of it; sets $http, $sim, $srv_pid, $sim_pid.
start_pair() { # name
  local port; port=$(free_port); http=$(free_port); sim=$(free_port)
  "$BIN" server --host 127.0.0.1 --port "$port" --http-port "$http" --l1-size-gb 1 \
      --shm-name "lmcache_rs_engine_$$_$1" --log-level warn > "$WORK/$1.server.log" 2>&1 &
  srv_pid=$!; pids+=("$srv_pid")
  wait_http "http://127.0.0.1:$http/healthcheck" "$WORK/$1.server.log"
  (cd "$WORK" && exec "$VENV/bin/python" "$ROOT/benches/engine_simulator/engine_simulator.py" \
      --lmcache-url "tcp://127.0.0.1:$port" --model "$WORK/$MODEL" --served-model-name "$MODEL" \
      --port "$sim" --prefill-us-per-token 20 --itl-ms 1) > "$WORK/$1.sim.log" 2>&1 &
  sim_pid=$!; pids+=("$sim_pid")
  wait_http "http://127.0.0.1:$sim/health" "$WORK/$1.sim.log"
}

stop_pair() {
  kill -TERM "$sim_pid" 2>/dev/null || true; wait "$sim_pid" 2>/dev/null || true
  kill -TERM "$srv_pid"; wait "$srv_pid" || { echo "server exited non-zero"; return 1; }
}

sim_stats() { python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$sim/sim/stats', timeout=5).read().decode())"; }

WORKLOADS=(
  "long-doc-qa --kv-cache-volume 0.02 --ldqa-document-length 3000 --ldqa-query-per-document 3 --ldqa-max-output-length 16"
  "multi-round-chat --kv-cache-volume 0.02 --mrc-shared-prompt-length 500 --mrc-chat-history-length 1500 --mrc-user-input-length 20 --mrc-output-length 16 --mrc-qps 2 --mrc-duration 5"
  "random-prefill --rp-request-length 1500 --rp-num-requests 6"
)
for w in "${WORKLOADS[@]}"; do
  [ -n "${ONLY:-}" ] && [[ "$w" != "$ONLY"* ]] && continue
  read -r name flags <<< "$w"
  for bench in lmcache lmcache-rs; do
    tag="$name-$bench"
    start_pair "$tag"
    out="$WORK/$tag"
    mkdir -p "$out"
    rc=0
    # shellcheck disable=SC2086
    if [ "$bench" = lmcache ]; then
      (cd "$WORK" && timeout 300 "$VENV/bin/lmcache" bench engine --engine-url "http://127.0.0.1:$sim" \
          --lmcache-url "http://127.0.0.1:$http" --model "$MODEL" --workload "$name" $flags \
          --no-interactive --json --quiet --output-dir "$out") > "$out/bench.log" 2>&1 || rc=$?
    else
      timeout 300 "$BIN" bench engine --engine-url "http://127.0.0.1:$sim" \
          --lmcache-url "http://127.0.0.1:$http" --model "$MODEL" --workload "$name" $flags \
          --no-interactive --json --quiet --output-dir "$out" --plot "$out/plot.png" \
          > "$out/bench.log" 2>&1 || rc=$?
    fi
    sim_stats > "$out/sim.json"
    stop_pair || rc=$?
    echo "$rc" > "$out/rc"
  done
  if python3 - "$WORK/$name-lmcache" "$WORK/$name-lmcache-rs" <<'PY'
import json, os, sys
lmc, ours = sys.argv[1], sys.argv[2]
problems = []
def load(d):
    rc = int(open(f"{d}/rc").read())
    if rc != 0:
        problems.append(f"{os.path.basename(d)} exited {rc}: " + open(f"{d}/bench.log").read()[-800:])
    s = json.load(open(f"{d}/sim.json"))
    r = json.load(open(f"{d}/bench_summary.json"))["results"] if os.path.exists(f"{d}/bench_summary.json") else {}
    return s, r
(s1, r1), (s2, r2) = load(lmc), load(ours)
if problems:
    print("\n".join(problems)); sys.exit(1)
for who, s, r in (("lmcache", s1, r1), ("lmcache-rs", s2, r2)):
    if s["kv_mismatch_blocks"] != 0:
        problems.append(f"{who}'s run: {s['kv_mismatch_blocks']} blocks came back wrong")
    if r.get("failed_requests") != 0 or not r.get("successful_requests"):
        problems.append(f"{who}: {r.get('successful_requests')} successful, {r.get('failed_requests')} failed")
if r1.get("total_requests") != r2.get("total_requests"):
    problems.append(f"requests: LMCache's bench {r1.get('total_requests')}, ours {r2.get('total_requests')}")
hit = lambda s: s["cached_tokens"] / max(s["prompt_tokens"], 1)
h1, h2 = hit(s1), hit(s2)
if abs(h1 - h2) > 0.02:
    problems.append(f"cache share of prompts: {h1:.3f} under LMCache's bench, {h2:.3f} under ours")
# Ours reports what the engine said: over the measured run only (the simulator counts warmup too).
if r2.get("engine_cache_hit_rate") is None:
    problems.append("ours reported no engine cache hit rate")
for f in ("bench_results.csv", "bench_summary.json", "plot.png"):
    if not os.path.getsize(f"{ours}/{f}"):
        problems.append(f"ours wrote an empty {f}")
if problems:
    print("  " + "\n  ".join(problems)); sys.exit(1)
print(f"{r2['total_requests']} requests each; cache served {h1:.3f} / {h2:.3f} of prompt tokens "
      f"(LMCache's bench / ours); ours: engine-reported {r2['engine_cache_hit_rate']:.3f} over the "
      f"measured run, server lookup hit rate {r2.get('cache_server_hit_rate') or 0:.3f}; "
      f"{s2['kv_checked_blocks']} retrieved blocks checked, 0 wrong")
PY
  then
    echo "interop engine bench $name: ok"
    passed=$((passed + 1))
  else
    echo "interop engine bench $name: FAILED"
    for b in lmcache lmcache-rs; do tail -5 "$WORK/$name-$b/bench.log" | sed 's/^/    /'; tail -5 "$WORK/$name-$b.sim.log" | sed 's/^/    /'; done
    failed=$((failed + 1))
  fi
done
echo "interop engine bench: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
