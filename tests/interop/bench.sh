#!/usr/bin/env bash
# Interop with LMCache 0.5.6's own clients, from the cached virtualenv:
# - `lmcache bench server --mode cpu` against `lmcache-rs server`, both transfer modes, tp 1
#   and 2, plus an MLA bfloat16 model at tp 2 and two hybrid models (several KV groups: fp16
#   MLA + fp16 K/V, and bf16 K/V + uint8 (FP8) MLA + fp16 K/V) at tp 1 and 2, 10 sequences (INTEROP_SEQUENCES),
#   --interval 0: every cold lookup must miss, every warm lookup must be a full hit, every
#   checksum must match;
# - vLLM's MP adapters (tests/interop/vllm_adapters.py) in both transfer modes, and a hybrid
#   model through them (tests/interop/vllm_hybrid.py), its groups stored apart and together.
# Usage: tests/interop/bench.sh PATH/TO/lmcache-rs
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:?usage: bench.sh PATH/TO/lmcache-rs}
VENV=$(./scripts/lmcache-venv)
N=${INTEROP_SEQUENCES:-10}
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1 PYTHONWARNINGS=ignore
WORK=$(mktemp -d)
# The list case below restarts warm from a named DRAM L1: its file stays in /dev/shm by design.
trap 'rm -rf "$WORK" /dev/shm/lmcache_rs_l2bench_$$ /dev/shm/lmcache_rs_l2bench_$$.lmcache-rs-* || true' EXIT

FREE_PORT="$PWD/scripts/free-port"  # absolute: some calls run after a `cd`
free_port() { "$FREE_PORT" "$WORK/.ports"; }
wait_healthy() { # http_port: at most 10 s for the server's /healthcheck
  for _ in $(seq 100); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$1/healthcheck', timeout=1)" 2>/dev/null && return 0
    sleep 0.1
  done
}

passed=0
failed=0
# name mode tp extra-bench-args: the default fp16 model at tp 1 and 2, and an MLA bf16 model.
CASES=(
  "lmcache_driven-tp1 lmcache_driven 1"
  "lmcache_driven-tp2 lmcache_driven 2"
  "engine_driven-tp1 engine_driven 1"
  "engine_driven-tp2 engine_driven 2"
  "lmcache_driven-mla-tp2 lmcache_driven 2 --use-mla --kvcache-shape-spec (1,1024,16,1,576):bfloat16:8"
  "engine_driven-mla-tp2 engine_driven 2 --use-mla --kvcache-shape-spec (1,1024,16,1,576):bfloat16:8"
  # Hybrid models: several KV groups in one registration (one object per chunk holding all).
  "lmcache_driven-hybrid-tp1 lmcache_driven 1 --kvcache-shape-spec (1,1024,16,1,128):float16:4;(2,1024,16,8,128):float16:12"
  "lmcache_driven-hybrid-tp2 lmcache_driven 2 --kvcache-shape-spec (1,1024,16,1,128):float16:4;(2,1024,16,8,128):float16:12"
  "lmcache_driven-mixed-tp1 lmcache_driven 1 --kvcache-shape-spec (2,1024,16,8,128):bfloat16:6;(1,1024,16,1,576):uint8:2;(2,1024,16,4,64):float16:4"
  "lmcache_driven-mixed-tp2 lmcache_driven 2 --kvcache-shape-spec (2,1024,16,8,128):bfloat16:6;(1,1024,16,1,576):uint8:2;(2,1024,16,4,64):float16:4"
)
for case in "${CASES[@]}"; do
    read -r name mode tp extra <<< "$case"
    # shellcheck disable=SC2086
    set -- $extra
    port=$(free_port); http=$(free_port)
    "$BIN" server --host 127.0.0.1 --port "$port" --http-port "$http" --l1-size-gb 2 \
        --shm-name "lmcache_rs_interop_$$_$name" --max-workers 2 --log-level warn \
        > "$WORK/$name.server.log" 2>&1 &
    pid=$!
    wait_healthy "$http"
    rc=0
    timeout 600 "$VENV/bin/lmcache" bench server --rpc-url "tcp://127.0.0.1:$port" \
        --url "http://127.0.0.1:$http" --mode cpu --transfer-mode "$mode" --tp-size "$tp" \
        --num-tokens 512 --start 0 --end "$N" --interval 0 --format json "$@" \
        --output "$WORK/$name.json" > "$WORK/$name.bench.log" 2>&1 || rc=$?
    kill -TERM "$pid"
    srv_rc=0; wait "$pid" || srv_rc=$?
    if python3 tests/interop/bench_check.py "$WORK/$name.json" "$WORK/$name.bench.log" "$N" "$rc" "$srv_rc"
    then
      echo "interop bench $name: ok ($N sequences: cold misses, warm full hits, checksums match)"
      passed=$((passed + 1))
    else
      echo "interop bench $name: FAILED; bench log tail:"
      tail -20 "$WORK/$name.bench.log" | sed 's/^/    /'
      echo "  server log tail:"; tail -10 "$WORK/$name.server.log" | sed 's/^/    /'
      failed=$((failed + 1))
    fi
done

# vLLM's own MP adapters (scheduler + worker), one fresh server per transfer mode.
for mode in engine_driven lmcache_driven; do
  port=$(free_port)
  "$BIN" server --host 127.0.0.1 --port "$port" --http-port 0 --l1-size-gb 1 \
      --shm-name "lmcache_rs_adapters_$$_$mode" --max-workers 2 --log-level info \
      > "$WORK/adapters-$mode.server.log" 2>&1 &
  pid=$!
  rc=0
  LMCACHE_MP_TRANSFER_MODE=$mode timeout 300 "$VENV/bin/python" tests/interop/vllm_adapters.py \
      "tcp://127.0.0.1:$port" > "$WORK/adapters-$mode.log" 2>&1 || rc=$?
  kill -TERM "$pid"; wait "$pid" || rc=$?
  want="lmcache-driven worker registered"
  [ "$mode" = engine_driven ] && want="engine-driven worker registered"
  if [ "$rc" -eq 0 ] && grep -q "bytes equal" "$WORK/adapters-$mode.log" \
      && grep -q "$want" "$WORK/adapters-$mode.server.log"; then
    echo "interop vllm adapters $mode: ok (miss, store, full hit, retrieve into other blocks, bytes equal)"
    passed=$((passed + 1))
  else
    echo "interop vllm adapters $mode: FAILED"
    grep -v INFO "$WORK/adapters-$mode.log" | tail -20 | sed 's/^/    /'
    failed=$((failed + 1))
  fi
done

# A hybrid model (full attention, a sliding window, recurrent state) through vLLM's adapters,
# lmcache-driven, with the groups stored apart (--separate-object-groups) and together.
for mode in separate merged; do
  port=$(free_port)
  flags=()
  [ "$mode" = separate ] && flags=(--separate-object-groups)
  "$BIN" server --host 127.0.0.1 --port "$port" --http-port 0 --l1-size-gb 1 \
      --shm-name "lmcache_rs_hybrid_$$_$mode" --max-workers 2 --log-level info "${flags[@]}" \
      > "$WORK/hybrid-$mode.server.log" 2>&1 &
  pid=$!
  rc=0
  LMCACHE_MP_TRANSFER_MODE=lmcache_driven timeout 300 "$VENV/bin/python" tests/interop/vllm_hybrid.py \
      "tcp://127.0.0.1:$port" "$mode" > "$WORK/hybrid-$mode.log" 2>&1 || rc=$?
  kill -TERM "$pid"; wait "$pid" || rc=$?
  if [ "$rc" -eq 0 ] && grep -q "bytes equal where the fold promised" "$WORK/hybrid-$mode.log"; then
    echo "interop vllm hybrid $mode: ok ($(grep -o '[0-9]* blocks checked' "$WORK/hybrid-$mode.log"))"
    passed=$((passed + 1))
  else
    echo "interop vllm hybrid $mode: FAILED"
    grep -v INFO "$WORK/hybrid-$mode.log" | tail -20 | sed 's/^/    /'
    tail -10 "$WORK/hybrid-$mode.server.log" | sed 's/^/    /'
    failed=$((failed + 1))
  fi
done

# L2 through vLLM's adapters: an L1 of 2 MB under a working set of 24 chunks (6 MB), with the
# fs adapter in both transfer modes and Redis (when scripts/test started one) in one.
L2_CASES=("fs engine_driven" "fs lmcache_driven")
[ -n "${LMCACHE_RS_TEST_REDIS:-}" ] && L2_CASES+=("redis lmcache_driven")
for case in "${L2_CASES[@]}"; do
  read -r kind mode <<< "$case"
  port=$(free_port); http=$(free_port)
  if [ "$kind" = fs ]; then
    spec="{\"type\": \"fs\", \"base_path\": \"$WORK/l2-$mode\"}"
  else
    spec="{\"type\": \"redis\", \"host\": \"${LMCACHE_RS_TEST_REDIS%:*}\", \"port\": ${LMCACHE_RS_TEST_REDIS##*:}, \"key_prefix\": \"interop-$$\"}"
  fi
  "$BIN" server --host 127.0.0.1 --port "$port" --http-port "$http" --l1-size-gb 0.002 \
      --shm-name "lmcache_rs_l2_$$_${kind}_$mode" --max-workers 2 --log-level info \
      --l2-adapter "$spec" > "$WORK/l2-$kind-$mode.server.log" 2>&1 &
  pid=$!
  rc=0
  LMCACHE_MP_TRANSFER_MODE=$mode timeout 300 "$VENV/bin/python" tests/interop/l2_offload.py \
      "tcp://127.0.0.1:$port" "http://127.0.0.1:$http" > "$WORK/l2-$kind-$mode.log" 2>&1 || rc=$?
  kill -TERM "$pid"; wait "$pid" || rc=$?
  if [ "$rc" -eq 0 ] && grep -q "bytes equal" "$WORK/l2-$kind-$mode.log"; then
    echo "interop L2 $kind $mode: ok ($(grep -o '[0-9]* sequences stored.*' "$WORK/l2-$kind-$mode.log"))"
    passed=$((passed + 1))
  else
    echo "interop L2 $kind $mode: FAILED"
    grep -v INFO "$WORK/l2-$kind-$mode.log" | tail -20 | sed 's/^/    /'
    tail -10 "$WORK/l2-$kind-$mode.server.log" | sed 's/^/    /'
    failed=$((failed + 1))
  fi
done

# LMCache's own bench past a 200 MB L1: 10 sequences of 2 x 32 MiB chunks (640 MiB) pass
# with matching checksums; a second pass over the first three, long evicted from DRAM, must
# find them (cold lookups full hits), retrieve the bytes the first pass stored (same digests)
# and the server must report the hit tokens as coming from below DRAM. With the fs
# adapter under a DRAM L1, and with a slab-file L1 (--gds-l1-path, O_DIRECT) whose DRAM
# staging area is the 200 MB; that server is then killed with SIGKILL and restarted with
# --l1-warm-restart, and the three sequences come back from the slab once more. A third time
# as LMCache's tagged list: a 200 MB DRAM L1, then a GDS entry whose slab sits behind it.
for below in fs gds list; do
port=$(free_port); http=$(free_port)
if [ "$below" = fs ]; then
  tier=(--l1-size-gb 0.2 --l2-adapter "{\"type\": \"fs\", \"base_path\": \"$WORK/l2-bench\"}")
elif [ "$below" = gds ]; then
  mkdir -p "$WORK/gds-slab"
  tier=(--l1-size-gb 1 --gds-l1-staging-gb 0.2 --gds-l1-path "$WORK/gds-slab")
else
  mkdir -p "$WORK/gds-list"
  tier=(--l1-manager '{"type": "DRAM", "tag": "dram", "size_gb": 0.2}'
        --l1-manager "{\"type\": \"GDS\", \"tag\": \"slab\", \"size_gb\": 1, \"path\": \"$WORK/gds-list\"}")
fi
start_l2() { # [extra flags]
  "$BIN" server --host 127.0.0.1 --port "$port" --http-port "$http" "${tier[@]}" "$@" \
      --shm-name "lmcache_rs_l2bench_$$" --max-workers 2 --log-level warn \
      >> "$WORK/l2-bench-$below.server.log" 2>&1 &
  pid=$!
  wait_healthy "$http"
}
start_l2
rc=0
bench_l2() { # start end output
  timeout 300 "$VENV/bin/lmcache" bench server --rpc-url "tcp://127.0.0.1:$port" \
      --url "http://127.0.0.1:$http" --mode cpu --transfer-mode lmcache_driven --num-tokens 512 \
      --start "$1" --end "$2" --interval 0 --format json --output "$WORK/$3.json" > "$WORK/$3.log" 2>&1
}
bench_l2 0 10 "l2-bench-$below-1" || rc=$?
sleep 2 # let the write-behind finish
bench_l2 0 3 "l2-bench-$below-2" || rc=$?
metrics=$(python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$http/metrics', timeout=5).read().decode())")
third=("$WORK/l2-bench-$below-2.log")
if [ "$below" != fs ]; then
  # The slab survives a SIGKILL: restarted with --l1-warm-restart (staging starts empty), the
  # same three sequences come back whole from the slab, with the same digests.
  kill -KILL "$pid"; wait "$pid" 2>/dev/null || true
  start_l2 --l1-warm-restart
  bench_l2 0 3 "l2-bench-$below-3" || rc=$?
  third=("$WORK/l2-bench-$below-3.log")
fi
kill -TERM "$pid"; wait "$pid" || rc=$?
if [ "$rc" -eq 0 ] && python3 - "$WORK/l2-bench-$below-1.json" "$WORK/l2-bench-$below-1.log" \
    "$WORK/l2-bench-$below-2.log" "$metrics" "${third[@]}" <<'PY'
import json, re, sys
r = json.load(open(sys.argv[1]))["metrics"]["results"]
assert r.get("checksum_ok") == 10 and r.get("checksum_fail") == 0, r
second = open(sys.argv[3]).read()
cold = re.findall(r"/cold\] LOOKUP: (\d+)/(\d+) chunks hit", second)
assert len(cold) == 3 and all(a == b and a != "0" for a, b in cold), cold
digests = lambda text: dict(re.findall(r"seq (\d+)/warm\] CHECKSUM: ([0-9a-f]+)", text))
first = digests(open(sys.argv[2]).read())
for log in (sys.argv[3], sys.argv[5]):  # the second pass, and after a SIGKILL (gds) or it again
    text = open(log).read()
    cold = re.findall(r"/cold\] LOOKUP: (\d+)/(\d+) chunks hit", text)
    assert len(cold) == 3 and all(a == b and a != "0" for a, b in cold), (log, cold)
    again = digests(text)
    assert len(again) == 3 and all(first[s] == d for s, d in again.items()), (log, first, again)
m = re.search(r"^lmcache_mp_lookup_hit_l2_tokens_total (\S+)$", sys.argv[4], re.M)
assert m and float(m.group(1)) >= 3 * 512, m and m.group(0)
PY
then
  echo "interop L2 lmcache bench ($below): ok (10 sequences past 200 MB of DRAM, checksums match; the first 3 come back from below, byte-exact$([ "$below" != fs ] && echo ", and again after a SIGKILL and a warm restart"))"
  passed=$((passed + 1))
else
  echo "interop L2 lmcache bench ($below): FAILED"
  tail -5 "$WORK/l2-bench-$below-2.log" | sed 's/^/    /'
  tail -5 "$WORK/l2-bench-$below.server.log" | sed 's/^/    /'
  failed=$((failed + 1))
fi
done

# Several L1s (--l1-manager, repeated, as LMCache's tagged L1s): a 200 MB DRAM L1 first and a
# DEVDAX file second. LMCache's bench stores 10 sequences of 2 x 32 MiB chunks (640 MiB): what
# DRAM cannot hold overflows into the file, and what DRAM's watermark chooses moves down into
# it; nothing is evicted, every warm lookup is a full hit and every checksum matches; /status
# shows each L1 by its tag.
port=$(free_port); http=$(free_port)
"$BIN" server --host 127.0.0.1 --port "$port" --http-port "$http" --no-l1-use-lazy \
    --l1-manager '{"type": "DRAM", "tag": "dram", "size_gb": 0.2}' \
    --l1-manager "{\"type\": \"DEVDAX\", \"tag\": \"dax\", \"size_gb\": 1, \"path\": \"$WORK/dax-l1\"}" \
    --shm-name "lmcache_rs_two_l1_$$" --max-workers 2 --log-level warn > "$WORK/two-l1.server.log" 2>&1 &
pid=$!
wait_healthy "$http"
rc=0
timeout 600 "$VENV/bin/lmcache" bench server --rpc-url "tcp://127.0.0.1:$port" \
    --url "http://127.0.0.1:$http" --mode cpu --transfer-mode lmcache_driven --num-tokens 512 \
    --start 0 --end 10 --interval 0 --format json --output "$WORK/two-l1.json" > "$WORK/two-l1.bench.log" 2>&1 || rc=$?
status=$(python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$http/status', timeout=5).read().decode())" || echo '{}')
kill -TERM "$pid"
srv_rc=0; wait "$pid" || srv_rc=$?
if python3 tests/interop/bench_check.py "$WORK/two-l1.json" "$WORK/two-l1.bench.log" 10 "$rc" "$srv_rc" \
    && python3 - "$status" <<'PY'
import json, sys
l1s = json.loads(sys.argv[1])["storage_manager"]["l1_manager"]["l1s"]
assert [m["tag"] for m in l1s] == ["dram", "dax"], l1s
assert [m["type"] for m in l1s] == ["DRAM", "DEVDAX"], l1s
assert l1s[0]["resident_objects"] > 0 and l1s[1]["resident_objects"] > 0, l1s
assert sum(m["resident_objects"] for m in l1s) == 20, l1s
assert all(m["evicted_objects"] == 0 for m in l1s), l1s
PY
then
  echo "interop two L1s (DRAM then DEVDAX): ok (10 sequences, 640 MiB over a 200 MB DRAM L1, checksums match, nothing evicted)"
  passed=$((passed + 1))
else
  echo "interop two L1s (DRAM then DEVDAX): FAILED"
  tail -10 "$WORK/two-l1.bench.log" | sed 's/^/    /'
  tail -10 "$WORK/two-l1.server.log" | sed 's/^/    /'
  failed=$((failed + 1))
fi

# The other way round: our Rust `lmcache-rs bench server` against LMCache's own server, the
# engine-driven path at tp 1, tp 2 and MLA (every byte checked). The lmcache-driven path is
# not run here: LMCache replies to a lmcache-driven store before the objects are visible, so
# a lookup right after it can miss (LMCache's own bench hides this behind a checksum call).
port=$(free_port); http=$(free_port)
timeout 600 "$VENV/bin/lmcache" server --prometheus-port "$(free_port)" --host 127.0.0.1 --port "$port" --http-host 127.0.0.1 \
    --http-port "$http" --l1-size-gb 2 --eviction-policy LRU --supported-transfer-mode auto \
    --shm-name "lmc_rsbench_$$" > "$WORK/rsbench.server.log" 2>&1 &
lpid=$!
for _ in $(seq 300); do
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$http/healthcheck', timeout=1)" 2>/dev/null && break
  sleep 0.2
done
s=0
for flags in "--tp-size 1" "--tp-size 2" "--tp-size 2 --use-mla --kvcache-shape-spec (1,1024,16,1,576):bfloat16:8"; do
  s=$((s + 100))
  # shellcheck disable=SC2086
  if timeout 300 "$BIN" bench server --rpc-url "tcp://127.0.0.1:$port" --transfer-mode engine_driven \
      --start "$s" --end "$((s + 5))" --num-tokens 512 --format json $flags > "$WORK/rsbench.json" 2> "$WORK/rsbench.err" \
      && python3 -c "import json,sys; d=json.load(open('$WORK/rsbench.json')); sys.exit(0 if d['bytes_match'] == d['warm_full_hit'] == d['cold_full_miss'] == 5 else 1)"; then
    echo "interop lmcache-rs bench against LMCache's server ($flags): ok (5 sequences, every byte checked)"
    passed=$((passed + 1))
  else
    echo "interop lmcache-rs bench against LMCache's server ($flags): FAILED"
    tail -5 "$WORK/rsbench.err" | sed 's/^/    /'
    failed=$((failed + 1))
  fi
done
kill -TERM "$lpid"; wait "$lpid" 2>/dev/null || true

echo "interop: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
