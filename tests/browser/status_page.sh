#!/usr/bin/env bash
# The status pages (GET /) in headless Chromium from Debian's packages, driven over WebDriver
# (selenium, from PyPI, in a virtualenv cached outside the repo), each under LMCache's
# `lmcache bench server`: the server's (with --http-auth-token; status_page.py), then the
# coordinator's fleet page with two servers reporting (fleet_page.py). The server runs two L1s
# (--l1-manager twice), so the page shows each by its tag.
# Usage: tests/browser/status_page.sh PATH/TO/lmcache-rs [SCREENSHOT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:?usage: status_page.sh PATH/TO/lmcache-rs [SCREENSHOT_DIR]}
SHOTS=${2:-target/browser}
mkdir -p "$SHOTS"
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  echo "installing Debian's chromium and chromium-driver" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >&2
fi
SEL="${LMCACHE_RS_BROWSER_VENV:-/var/tmp/lmcache-rs-browser-venv}"
if [ ! -f "$SEL/.lmcache-rs-ready-selenium-4.51.0" ]; then
  if [ -e "$SEL" ] && [ ! -f "$SEL/.lmcache-rs-owned" ]; then
    echo "$SEL exists and was not made by this script: set LMCACHE_RS_BROWSER_VENV" >&2; exit 1
  fi
  rm -rf "$SEL"; mkdir -p "$SEL"; touch "$SEL/.lmcache-rs-owned"
  python3 -m venv "$SEL"
  "$SEL/bin/pip" install -q "selenium==4.51.0" >&2
  touch "$SEL/.lmcache-rs-ready-selenium-4.51.0"
fi
# shellcheck source=tests/interop/common.sh
. tests/interop/common.sh
port=$(free_port); http=$(free_port)
token="page-test-$$-$RANDOM"
"$BIN" server --host 127.0.0.1 --port "$port" --http-port "$http" \
    --l1-manager '{"type": "DRAM", "tag": "dram", "size_gb": 0.5}' \
    --l1-manager '{"type": "DRAM", "tag": "overflow", "size_gb": 0.5}' \
    --shm-name "lmcache_rs_page_$$" --max-workers 2 --exit-after-seconds 300 \
    --http-auth-token "$token" \
    --l2-adapter "{\"type\": \"fs\", \"base_path\": \"$WORK/l2\"}" > "$WORK/server.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$http/healthcheck" "$WORK/server.log"
# A tenant with quotas in both tiers, for the tenants table.
python3 - "$http" "$token" <<'PY'
import sys, urllib.request
for tier, gb in (("l1", b"0.5"), ("l2", b"2")):
    req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/quota/tenant-a?tier={tier}", method="PUT",
                                 data=b'{"limit_gb": ' + gb + b'}',
                                 headers={"Authorization": f"Bearer {sys.argv[2]}", "Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10)
PY
# LMCache's bench, 16 sequences, a pause between each cold and warm request: ~20 s of load.
timeout 240 "$VENV/bin/lmcache" bench server --rpc-url "tcp://127.0.0.1:$port" \
    --url "http://127.0.0.1:$http" --mode cpu --transfer-mode lmcache_driven --num-tokens 1024 \
    --start 0 --end 16 --interval 1 > "$WORK/bench.log" 2>&1 &
bench=$!
"$SEL/bin/python" tests/browser/status_page.py "http://127.0.0.1:$http" "$token" "$bench" "$SHOTS"
wait "$bench" || { echo "FAILED: LMCache's bench"; tail -20 "$WORK/bench.log"; exit 1; }
echo "status page: ok"

# The fleet page: a coordinator, two servers reporting, LMCache's bench storing into one.
cport=$(free_port)
"$BIN" coordinator --host 127.0.0.1 --port "$cport" > "$WORK/coordinator.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$cport/healthz" "$WORK/coordinator.log"
start_reporting_server lmcache-rs server-b "$cport" page 300
start_reporting_server lmcache-rs server-a "$cport" page 300
timeout 240 "$VENV/bin/lmcache" bench server --rpc-url "tcp://127.0.0.1:$srv_port" \
    --url "http://127.0.0.1:$srv_http" --mode cpu --transfer-mode lmcache_driven \
    --num-tokens 1024 --start 0 --end 10 --interval 1 > "$WORK/fleet-bench.log" 2>&1 &
bench=$!
"$SEL/bin/python" tests/browser/fleet_page.py "http://127.0.0.1:$cport" "$bench" "$SHOTS"
wait "$bench" || { echo "FAILED: LMCache's bench (fleet)"; tail -20 "$WORK/fleet-bench.log"; exit 1; }
echo "fleet page: ok"
