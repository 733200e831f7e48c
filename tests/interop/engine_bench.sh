#!/usr/bin/env bash
# `lmcache-rs bench engine` and LMCache 0.5.6's `lmcache bench engine`, each against the engine
# simulator (benches/engine_simulator: OpenAI's streaming API in front of a paged KV cache it
# moves through `lmcache-rs server` with vLLM's MP adapters; not an engine), one fresh server
# and simulator per run, same flags:
# - all six workloads: long-doc-qa, multi-round-chat, random-prefill, and the three that
#   size prompts with the model's tokenizer (long-doc-permutator, prefix-suffix-tuner,
#   rag-qa-quality over a small MuSiQue-shaped file written here); both benches load the
#   simulator's tokenizer directory as --model, from the work directory;
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
# A QA file in MuSiQue's shape: passages, a question, answers (the simulator answers filler,
# so nothing parses: the point is the passages' reuse and the run's bookkeeping).
python3 - "$WORK/qa.jsonl" <<'PY'
import json, random, sys
rng = random.Random(7)
words = "river mountain city history music science garden ocean market library".split()
def passage(i):
    return {"title": f"Topic {i}", "paragraph_text": " ".join(rng.choice(words) for _ in range(60 + 7 * i)),
            "is_supporting": i % 2 == 0}
docs = [passage(i) for i in range(6)]
with open(sys.argv[1], "w") as f:
    for q in range(4):
        f.write(json.dumps({"id": f"q{q}", "question": f"What is topic {q} about?",
                            "answer": words[q], "answer_aliases": [],
                            "paragraphs": [docs[q], docs[q + 1], docs[(q + 3) % 6]]}) + "\n")
PY

passed=0
failed=0

# --export-config files are interchangeable, for every workload: ours writes what LMCache's
# writes for the same flags, and LMCache's export replayed by ours (--config) exports the same
# JSON again. (LMCache's own --config ignores --export-config and runs, so the replay is
# checked one way; equal files read alike.)
cfg_ok=1
pushd "$WORK" > /dev/null  # whatever a bench writes lands in the work directory
for w in long-doc-qa multi-round-chat random-prefill long-doc-permutator prefix-suffix-tuner rag-qa-quality; do
  common=(--engine-url http://127.0.0.1:1 --tokens-per-gb-kvcache 1000)
  flags=(--model m --workload "$w" --ldp-context-length 700 --mrc-qps 2.5 --psf-thrash 3 --rag-dataset qa.jsonl --ignore-eos)
  "$VENV/bin/lmcache" bench engine "${common[@]}" "${flags[@]}" --export-config "$WORK/cfg-lmc-$w.json" > /dev/null 2>&1 || { echo "  LMCache's export of $w failed"; cfg_ok=0; continue; }
  "$BIN" bench engine "${common[@]}" --config "$WORK/cfg-lmc-$w.json" --export-config "$WORK/cfg-ours-$w.json" > /dev/null || { echo "  ours replaying LMCache's $w failed"; cfg_ok=0; continue; }
  "$BIN" bench engine "${common[@]}" "${flags[@]}" --export-config "$WORK/cfg-ours2-$w.json" > /dev/null
  python3 - "$WORK" "$w" <<'PY' || cfg_ok=0
import json, sys
d, w = sys.argv[1], sys.argv[2]
load = lambda n: json.load(open(f"{d}/{n}-{w}.json"))
a, b, c = load("cfg-lmc"), load("cfg-ours"), load("cfg-ours2")
for x, y, what in ((a, c, "the two exports"), (a, b, "LMCache's export replayed by ours")):
    if x != y:
        print(f"  {w}: {what} differ: " + str({k: (x.get(k), y.get(k)) for k in set(x) | set(y) if x.get(k) != y.get(k)}))
        sys.exit(1)
PY
done
popd > /dev/null
if [ "$cfg_ok" = 1 ]; then echo "interop engine bench configs: ok (six workloads: exports identical, LMCache's replayed by ours)"; passed=$((passed + 1)); else echo "interop engine bench configs: FAILED"; failed=$((failed + 1)); fi

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
  "long-doc-permutator --ldp-num-contexts 3 --ldp-context-length 700 --ldp-system-prompt-length 300 --ldp-num-permutations 4 --ldp-num-inflight-requests 2 --ldp-max-output-length 8"
  "prefix-suffix-tuner --psf-context-length 1200 --psf-prefix-ratio 0.5 --psf-thrash 0.015"
  "rag-qa-quality --rag-dataset qa.jsonl --rag-num-samples 4 --rag-max-output-length 16"
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
      (cd "$WORK" && timeout 300 "$BIN" bench engine --engine-url "http://127.0.0.1:$sim" \
          --lmcache-url "http://127.0.0.1:$http" --model "$MODEL" --workload "$name" $flags \
          --no-interactive --json --quiet --output-dir "$out" --plot "$out/plot.png") \
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
# The tokenizer workloads promise exact prompt lengths: the engine's counts must agree.
if os.path.basename(ours).startswith(("long-doc-permutator", "rag-qa-quality")) and r1.get("total_input_tokens") != r2.get("total_input_tokens"):
    problems.append(f"prompt tokens: {r1.get('total_input_tokens')} under LMCache's bench, {r2.get('total_input_tokens')} under ours")
if os.path.basename(ours).startswith("rag-qa-quality"):
    q1 = json.load(open(f"{lmc}/rag_qa_quality.json"))
    q2 = json.load(open(f"{ours}/rag_qa_quality.json"))
    ids = lambda q: [s["sample_id"] for s in q["per_sample"]]
    if ids(q1) != ids(q2):
        problems.append(f"per-sample results: {ids(q1)} from LMCache's bench, {ids(q2)} from ours")
    s2q = json.load(open(f"{ours}/bench_summary.json")).get("quality", {})
    if s2q.get("samples") != len(ids(q1)):
        problems.append(f"ours' summary has no quality section: {s2q}")
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
