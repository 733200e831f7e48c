#!/usr/bin/env bash
# `lmcache-rs server --transport grpc` against LMCache 0.5.6's own gRPC client
# (GrpcMultiprocessClient, chosen by a grpc:// URL), from the cached virtualenv:
# - `lmcache bench server --rpc-url grpc://…` in both CPU transfer modes, tp 1 and 2 (the
#   default model: 32 MiB chunks), 10 sequences (INTEROP_SEQUENCES): every cold lookup misses, every warm lookup is
#   a full hit, every checksum matches, and the server exits 0 on SIGTERM;
# - vLLM's MP adapters over gRPC in both transfer modes, with their KV event stream (the
#   server-streaming SubscribeKvEvents): miss, store, store events, full hit, bytes equal;
# - several clients on the same keys: the bench reads stored sequences again while 8 clients
#   look them up, every lookup a full hit (tests/interop/grpc_edges.py concurrent);
# - bad input (tests/interop/grpc_edges.py edges): a body that is not its protobuf, unknown
#   and unserved methods, a bad key range; the server answers on and counts the refusals.
# Usage: tests/interop/grpc.sh PATH/TO/lmcache-rs
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:?usage: grpc.sh PATH/TO/lmcache-rs}
N=${INTEROP_SEQUENCES:-10}
. tests/interop/common.sh

passed=0
failed=0
ok() { echo "interop grpc $1: ok ($2)"; passed=$((passed + 1)); }
fail() { # name log...
  echo "interop grpc $1: FAILED"; shift
  for log in "$@"; do grep -v INFO "$log" | tail -15 | sed 's/^/    /'; done
  failed=$((failed + 1))
}

# Starts a gRPC server named NAME; sets $port, $http and $pid.
start_server() { # name [flags...]
  local name=$1; shift
  port=$(free_port); http=$(free_port)
  "$BIN" server --transport grpc --host 127.0.0.1 --port "$port" --http-port "$http" \
      --l1-size-gb 2 --shm-name "lmcache_rs_grpc_$$_$name" --max-workers 2 --log-level info "$@" \
      > "$WORK/$name.server.log" 2>&1 &
  pid=$!
  pids+=("$pid")
  wait_http "http://127.0.0.1:$http/healthcheck" "$WORK/$name.server.log"
  grep -q "serving.*grpc://127.0.0.1:$port" "$WORK/$name.server.log" \
    || { echo "the server does not say it serves grpc://127.0.0.1:$port"; exit 1; }
}

bench() { # name mode tp start end [interval]
  timeout 600 "$VENV/bin/lmcache" bench server --rpc-url "grpc://127.0.0.1:$port" \
      --url "http://127.0.0.1:$http" --mode cpu --transfer-mode "$2" --tp-size "$3" \
      --num-tokens 512 --start "$4" --end "$5" --interval "${6:-0}" --format json \
      --output "$WORK/$1.json" > "$WORK/$1.bench.log" 2>&1
}

for case in "lmcache_driven 1" "lmcache_driven 2" "engine_driven 1" "engine_driven 2"; do
  read -r mode tp <<< "$case"
  name="bench-$mode-tp$tp"
  start_server "$name"
  rc=0; bench "$name" "$mode" "$tp" 0 "$N" || rc=$?
  kill -TERM "$pid"; srv_rc=0; wait "$pid" || srv_rc=$?
  if python3 tests/interop/bench_check.py "$WORK/$name.json" "$WORK/$name.bench.log" "$N" "$rc" "$srv_rc"; then
    ok "$name" "$N sequences: cold misses, warm full hits, checksums match, clean SIGTERM"
  else
    fail "$name" "$WORK/$name.bench.log" "$WORK/$name.server.log"
  fi
done

for mode in engine_driven lmcache_driven; do
  name="adapters-$mode"
  start_server "$name"
  rc=0
  LMCACHE_MP_TRANSFER_MODE=$mode timeout 300 "$VENV/bin/python" tests/interop/vllm_adapters.py \
      "grpc://127.0.0.1:$port" > "$WORK/$name.log" 2>&1 || rc=$?
  kill -TERM "$pid"; wait "$pid" || rc=$?
  if [ "$rc" -eq 0 ] && grep -q "2 KV store events.*bytes equal" "$WORK/$name.log"; then
    ok "vllm $name" "miss, store, 2 KV store events over the stream, full hit, bytes equal"
  else
    fail "vllm $name" "$WORK/$name.log" "$WORK/$name.server.log"
  fi
done

# Several clients on the same keys: store 10 sequences, then run the bench over them again (its
# cold lookups hit, so it retrieves) while 8 clients look them all up three times over (the
# second pass pauses 2 s inside each sequence, so its worker stays registered while the
# clients look up: a lookup needs a registered layout).
name=concurrent
start_server "$name"
rc=0
bench "$name-1" lmcache_driven 1 0 10 || rc=$?
bench "$name-2" lmcache_driven 1 0 10 2 &
bench_pid=$!
timeout 300 "$VENV/bin/python" tests/interop/grpc_edges.py concurrent "grpc://127.0.0.1:$port" 10 \
    > "$WORK/$name.log" 2>&1 || rc=$?
wait "$bench_pid" || rc=$?
kill -TERM "$pid"; srv_rc=0; wait "$pid" || srv_rc=$?
if [ "$rc" -eq 0 ] \
    && python3 tests/interop/bench_check.py "$WORK/$name-1.json" "$WORK/$name-1.bench.log" 10 0 "$srv_rc" \
    && python3 tests/interop/bench_check.py "$WORK/$name-2.json" "$WORK/$name-2.bench.log" 10 0 "$srv_rc" --warm-cold \
    && grep -q "all full hits" "$WORK/$name.log"; then
  ok "$name" "$(grep -o '[0-9]* lookups from 8 clients' "$WORK/$name.log") during a second bench pass, all full hits"
else
  fail "$name" "$WORK/$name.log" "$WORK/$name-2.bench.log" "$WORK/$name.server.log"
fi

name=edges
start_server "$name"
rc=0
timeout 120 "$VENV/bin/python" tests/interop/grpc_edges.py edges "grpc://127.0.0.1:$port" \
    > "$WORK/$name.log" 2>&1 || rc=$?
metrics=$(python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$http/metrics', timeout=5).read().decode())")
kill -TERM "$pid"; wait "$pid" || rc=$?
if [ "$rc" -eq 0 ] && grep -q "grpc edges:.*ok" "$WORK/$name.log" \
    && grep -q 'kind="bad_protobuf"' <<< "$metrics" && grep -q 'kind="unsupported_op"' <<< "$metrics"; then
  ok "$name" "bad protobuf, unknown and unserved methods, bad range refused and counted; served on"
else
  fail "$name" "$WORK/$name.log" "$WORK/$name.server.log"
  grep 'request_errors' <<< "$metrics" | head -10 | sed 's/^/    /'
fi

# A server stopping with an event stream open: the stream ends, and the server exits promptly
# (well inside its 10 s drain deadline) and cleanly.
name=stream
start_server "$name"
"$VENV/bin/python" tests/interop/grpc_edges.py stream "grpc://127.0.0.1:$port" > "$WORK/$name.log" 2>&1 &
sub=$!
for _ in $(seq 300); do grep -q "first batch" "$WORK/$name.log" && break; sleep 0.1; done
t0=$(date +%s.%N)
kill -TERM "$pid"; srv_rc=0; wait "$pid" || srv_rc=$?
secs=$(python3 -c "import time; print(f'{time.time() - $t0:.1f}')")
rc=0; timeout 30 tail --pid="$sub" -f /dev/null || rc=$?; wait "$sub" || rc=$?
if [ "$srv_rc" -eq 0 ] && [ "$rc" -eq 0 ] && grep -q "ended by the server" "$WORK/$name.log" \
    && python3 -c "import sys; sys.exit(0 if $secs < 5 else 1)"; then
  ok "$name" "an open SubscribeKvEvents stream ended on SIGTERM; the server exited 0 in $secs s"
else
  fail "$name" "$WORK/$name.log" "$WORK/$name.server.log"
  echo "    server exit $srv_rc after $secs s"
fi

echo "interop grpc: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
