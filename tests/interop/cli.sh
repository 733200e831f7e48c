#!/usr/bin/env bash
# Interop: LMCache 0.5.6's own operator CLI (`lmcache ping kvcache`, `describe kvcache`,
# `kvcache clear`, `quota set|get|list|delete`) against `lmcache-rs server`'s HTTP API; and
# `lmcache-rs explain` on the lookups LMCache's `lmcache bench server` made (a cold lookup never
# stored, a warm one a hit, a cold one after `lmcache kvcache clear` cleared from L1).
# Usage: tests/interop/cli.sh PATH/TO/lmcache-rs
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:?usage: cli.sh PATH/TO/lmcache-rs}
VENV=$(./scripts/lmcache-venv)
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1 PYTHONWARNINGS=ignore
WORK=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
http=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$BIN" server --host 127.0.0.1 --port "$port" --http-port "$http" --l1-size-gb 1 \
    --shm-name "lmcache_rs_cli_interop_$$" --log-level warn > "$WORK/server.log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$WORK" || true' EXIT
url="http://127.0.0.1:$http"
for _ in $(seq 100); do
  python3 -c "import urllib.request; urllib.request.urlopen('$url/healthcheck', timeout=1)" 2>/dev/null && break
  sleep 0.1
done
passed=0; failed=0
check() { # name, expected text, command...
  local name=$1 want=$2; shift 2
  local out rc=0
  out=$("$@" 2>&1) || rc=$?
  if [ "$rc" -eq 0 ] && grep -qi -- "$want" <<< "$out"; then
    echo "interop lmcache cli $name: ok"; passed=$((passed + 1))
  else
    echo "interop lmcache cli $name: FAILED (rc=$rc, wanted '$want')"; sed 's/^/    /' <<< "$out" | tail -15
    failed=$((failed + 1))
  fi
}
L="$VENV/bin/lmcache"
bench() { # end
  timeout 120 "$L" bench server --rpc-url "tcp://127.0.0.1:$port" --url "$url" --mode cpu \
      --transfer-mode lmcache_driven --num-tokens 1024 --start 0 --end "$1" --interval 0 \
      > "$WORK/bench.log" 2>&1 || { echo "FAILED: bench"; tail -20 "$WORK/bench.log"; exit 1; }
}
bench 2
check "lmcache-rs explain (cold)" "miss \[never_stored\]: never stored" "$BIN" explain req-1-cold --url "$url"
check "lmcache-rs explain (warm)" "chunks 0-3, tokens 0-1024: *hit (L1)" "$BIN" explain req-1-warm --url "$url"
check "lmcache-rs explain --format json" '"reason": "never_stored"' "$BIN" explain req-0-cold --url "$url" --format json
check "lmcache-rs explain (unknown request)" "no lookup of" bash -c "! '$BIN' explain nobody --url '$url'"
check "ping kvcache" "OK" "$L" ping kvcache --url "$url"
check "describe kvcache" "Chunk size" "$L" describe kvcache --url "$url"
check "describe kvcache (policy)" "LRU" "$L" describe kvcache --url "$url"
check "kvcache clear" "ok" "$L" kvcache clear --url "$url"
bench 1
check "lmcache-rs explain (after a clear)" "cleared from L1" "$BIN" explain req-0-cold --url "$url"
check "lmcache_rs_lookup_miss_chunks_total by reason" 'reason="deleted"} 4' \
    python3 -c "import urllib.request; print(urllib.request.urlopen('$url/metrics').read().decode())"
check "quota set" "ok" "$L" quota set tenant-x --limit-gb 2 --url "$url"
check "quota get" "tenant-x" "$L" quota get tenant-x --url "$url"
check "quota list" "tenant-x" "$L" quota list --url "$url"
check "quota delete" "removed" "$L" quota delete tenant-x --url "$url"
echo "interop cli: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
