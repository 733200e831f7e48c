#!/usr/bin/env bash
# Interop: LMCache 0.5.6's own operator CLI (`lmcache ping kvcache`, `describe kvcache`,
# `kvcache clear`, `quota set|get|list|delete`) against `lmcache-rs server`'s HTTP API.
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
check "ping kvcache" "OK" "$L" ping kvcache --url "$url"
check "describe kvcache" "Chunk size" "$L" describe kvcache --url "$url"
check "describe kvcache (policy)" "LRU" "$L" describe kvcache --url "$url"
check "kvcache clear" "ok" "$L" kvcache clear --url "$url"
check "quota set" "ok" "$L" quota set tenant-x --limit-gb 2 --url "$url"
check "quota get" "tenant-x" "$L" quota get tenant-x --url "$url"
check "quota list" "tenant-x" "$L" quota list --url "$url"
check "quota delete" "removed" "$L" quota delete tenant-x --url "$url"
echo "interop cli: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
