#!/usr/bin/env bash
# Interop: fleets of cache servers reporting to a coordinator, checked by coordinator.py
# through vLLM's own LMCache MP adapters (LMCache 0.5.6 from the cached virtualenv):
#   1. LMCache's `lmcache server` reports into `lmcache-rs coordinator`;
#   2. `lmcache-rs server` reports into LMCache's `lmcache coordinator`;
#   3. a mixed fleet (one of each) reports into `lmcache-rs coordinator`;
# and each time every stored chunk must be placed on the server that stored it, and those an
# lmcache-rs server stored found by CacheBlend's /directory/blend-lookup (both coordinators run
# with --enable-blend-lookup); LMCache's own `lmcache query coordinator` reads ours. Then both coordinators get the same cache events and
# must answer every CacheBlend /directory/blend-lookup identically (blend_parity.py).
# Usage: tests/interop/coordinator.sh PATH/TO/lmcache-rs
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:?usage: coordinator.sh PATH/TO/lmcache-rs}
# shellcheck source=tests/interop/common.sh
. tests/interop/common.sh
start_coordinator() { # kind -> $cport
  cport=$(free_port)
  if [ "$1" = lmcache-rs ]; then
    "$BIN" coordinator --host 127.0.0.1 --port "$cport" --exit-after-seconds 600 --enable-blend-lookup \
        > "$WORK/coordinator-$cport.log" 2>&1 &
  else
    timeout 600 "$VENV/bin/lmcache" coordinator --host 127.0.0.1 --port "$cport" --enable-blend-lookup \
        > "$WORK/coordinator-$cport.log" 2>&1 &
  fi
  pids+=($!)
  wait_http "http://127.0.0.1:$cport/healthz" "$WORK/coordinator-$cport.log"
}
start_server() { # kind name -> appends "name=tcp://..=http://.." to $fleet
  start_reporting_server "$1" "$2" "$cport" coord 600
  fleet+=("$2=tcp://127.0.0.1:$srv_port=http://127.0.0.1:$srv_http")
}
run_case() { # title coordinator-kind server-kinds...
  local title=$1 ckind=$2; shift 2
  echo "== $title"
  start_coordinator "$ckind"
  fleet=()
  local n=0
  for k in "$@"; do n=$((n + 1)); start_server "$k" "$k-$n-$$"; done
  if ! (cd tests/interop && LMCACHE_LOG_LEVEL=WARNING "$VENV/bin/python" coordinator.py \
          "http://127.0.0.1:$cport" "$ckind" "${fleet[@]}") > "$WORK/check-$cport.log" 2>&1; then
    echo "FAILED: $title"; tail -30 "$WORK/check-$cport.log"
    echo "-- coordinator"; tail -20 "$WORK/coordinator-$cport.log"
    for f in "$WORK"/*-"$$".log; do echo "-- $f"; tail -20 "$f"; done
    exit 1
  fi
  tail -1 "$WORK/check-$cport.log"
  if [ "$ckind" = lmcache-rs ]; then
    # LMCache's own CLI reads our coordinator.
    for api in health instances usage directory keys metrics; do
      if ! timeout 120 "$VENV/bin/lmcache" query coordinator --api "$api" --url "http://127.0.0.1:$cport" \
          > "$WORK/query-$api.log" 2>&1; then
        echo "FAILED: lmcache query coordinator --api $api"; tail -20 "$WORK/query-$api.log"; exit 1
      fi
    done
    grep -q "${fleet[0]%%=*}" "$WORK/query-instances.log" || { echo "FAILED: instances lack ${fleet[0]%%=*}"; cat "$WORK/query-instances.log"; exit 1; }
    echo "lmcache query coordinator --api health|instances|usage|directory|keys|metrics: ok"
  fi
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  pids=()
}

run_case "LMCache's server into lmcache-rs coordinator" lmcache-rs lmcache
run_case "lmcache-rs server into LMCache's coordinator" lmcache lmcache-rs
run_case "mixed fleet into lmcache-rs coordinator" lmcache-rs lmcache lmcache-rs
echo "== CacheBlend blend-lookup: LMCache's coordinator and lmcache-rs on the same events"
bports=()
for kind in lmcache lmcache-rs; do
  p=$(free_port); bports+=("$p")
  if [ "$kind" = lmcache-rs ]; then
    "$BIN" coordinator --host 127.0.0.1 --port "$p" --chunk-size 4 --enable-blend-lookup \
        --exit-after-seconds 600 > "$WORK/blend-$kind.log" 2>&1 &
  else
    timeout 600 "$VENV/bin/lmcache" coordinator --host 127.0.0.1 --port "$p" --chunk-size 4 \
        --enable-blend-lookup > "$WORK/blend-$kind.log" 2>&1 &
  fi
  pids+=($!)
  wait_http "http://127.0.0.1:$p/healthz" "$WORK/blend-$kind.log"
done
if ! "$VENV/bin/python" tests/interop/blend_parity.py "http://127.0.0.1:${bports[0]}" \
    "http://127.0.0.1:${bports[1]}" > "$WORK/blend-check.log" 2>&1; then
  echo "FAILED: blend parity"; tail -20 "$WORK/blend-check.log"; exit 1
fi
tail -1 "$WORK/blend-check.log"
echo "coordinator interop: 4 passed"
