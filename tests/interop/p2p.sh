#!/usr/bin/env bash
# Interop: the RPCs a P2P peer serves (p2p_lookup_and_lock, p2p_query_lookup_results,
# p2p_unlock_objects). LMCache 0.5.6's server and `lmcache-rs server` get the same stores
# through vLLM's LMCache MP worker adapter; LMCache's own request client then asks both the
# same questions, and tests/interop/p2p_rpcs.py compares the answers.
# Usage: tests/interop/p2p.sh PATH/TO/lmcache-rs
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:?usage: p2p.sh PATH/TO/lmcache-rs}
# shellcheck source=tests/interop/common.sh
. tests/interop/common.sh
theirs=$(free_port); theirs_http=$(free_port); ours=$(free_port); ours_http=$(free_port)
timeout 300 "$VENV/bin/lmcache" server --prometheus-port "$(free_port)" --host 127.0.0.1 \
    --port "$theirs" --http-host 127.0.0.1 --http-port "$theirs_http" --l1-size-gb 1 \
    --eviction-policy LRU --supported-transfer-mode auto --shm-name "lmc_p2p_$$" \
    > "$WORK/lmcache.server.log" 2>&1 &
pids+=($!)
"$BIN" server --host 127.0.0.1 --port "$ours" --http-port "$ours_http" --l1-size-gb 1 \
    --shm-name "lmcache_rs_p2p_$$" --max-workers 2 --exit-after-seconds 300 \
    > "$WORK/lmcache-rs.server.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$theirs_http/healthcheck" "$WORK/lmcache.server.log"
wait_http "http://127.0.0.1:$ours_http/healthcheck" "$WORK/lmcache-rs.server.log"
(cd tests/interop && timeout 300 "$VENV/bin/python" p2p_rpcs.py "tcp://127.0.0.1:$theirs" \
    "tcp://127.0.0.1:$ours") || { echo "FAILED: p2p rpcs"; tail -20 "$WORK/lmcache-rs.server.log"; exit 1; }
# Every lock the questions took was unlocked or expires with the read TTL; the served counts
# are exported.
python3 - "http://127.0.0.1:$ours_http/metrics" <<'PY'
import re, sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
def m(name):
    return sum(float(x) for x in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
assert m("lmcache_rs_p2p_served_keys_total") == 10, m("lmcache_rs_p2p_served_keys_total")
assert m("lmcache_rs_p2p_served_hits_total") == 4, m("lmcache_rs_p2p_served_hits_total")
assert m("lmcache_rs_p2p_unlocked_keys_total") == 4, m("lmcache_rs_p2p_unlocked_keys_total")
assert m("lmcache_mp_active_p2p_lookup_jobs") == 0
print("p2p metrics: ok")
PY
echo "interop p2p: ok"
