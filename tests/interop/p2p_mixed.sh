#!/usr/bin/env bash
# Interop: P2P in a fleet of one LMCache 0.5.6 server and one lmcache-rs server, both on NIXL
# (LMCache's default channel; nixl-cu12 1.5.1 in LMCache's virtualenv, whose libnixl_capi.so
# ours loads), registered with LMCache's coordinator and then with ours. Each way round a
# prompt stored on one server is looked up and retrieved on the other (tests/interop/
# p2p_mixed.py) at LMCache's default shape (32 MiB objects), byte for byte; our metrics must
# show the objects fetched and served, and `explain` must put the chunks ours read down to the
# peer. Then LMCache's server is killed: a lookup on ours must miss, explained as a peer that
# did not answer.
# Usage: tests/interop/p2p_mixed.sh PATH/TO/lmcache-rs
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:?usage: p2p_mixed.sh PATH/TO/lmcache-rs}
# shellcheck source=tests/interop/common.sh
. tests/interop/common.sh

run_case() { # coordinator-kind
  local kind=$1 cport lm lm_http rs rs_http lm_p2p rs_p2p
  cport=$(free_port); lm=$(free_port); lm_http=$(free_port); rs=$(free_port)
  rs_http=$(free_port); lm_p2p=$(free_port); rs_p2p=$(free_port)
  if [ "$kind" = ours ]; then
    # LMCache's servers send no token: an operator opens registration to them explicitly.
    "$BIN" coordinator --host 127.0.0.1 --port "$cport" --allow-unauthenticated-registration \
        --exit-after-seconds 300 > "$WORK/coordinator-$kind.log" 2>&1 &
  else
    timeout 300 "$VENV/bin/lmcache" coordinator --host 127.0.0.1 --port "$cport" \
        > "$WORK/coordinator-$kind.log" 2>&1 &
  fi
  pids+=($!)
  wait_http "http://127.0.0.1:$cport/healthz" "$WORK/coordinator-$kind.log"
  local fleet=(--coordinator-url "http://127.0.0.1:$cport" --coordinator-advertise-ip 127.0.0.1
               --coordinator-heartbeat-interval 1 --p2p-transfer-engine nixl)
  local lm_pid
  timeout 300 "$VENV/bin/lmcache" server --instance-id "lmcache-$kind" --host 127.0.0.1 \
      --port "$lm" --http-host 127.0.0.1 --http-port "$lm_http" --prometheus-port "$(free_port)" \
      --l1-size-gb 1 --no-l1-use-lazy --eviction-policy LRU --supported-transfer-mode auto \
      --shm-name "lmc_p2p_mixed_$$" --p2p-advertise-url "127.0.0.1:$lm_p2p" "${fleet[@]}" \
      > "$WORK/lmcache-$kind.log" 2>&1 &
  lm_pid=$!
  pids+=($!)
  # Ours finds the wheel through the python3 on its PATH (LMCache's virtualenv).
  PATH="$VENV/bin:$PATH" "$BIN" server --instance-id "lmcache-rs-$kind" --host 127.0.0.1 \
      --port "$rs" --http-port "$rs_http" --l1-size-gb 1 --shm-name "lmcache_rs_p2p_mixed_$$" \
      --p2p-advertise-url "127.0.0.1:$rs_p2p" "${fleet[@]}" --exit-after-seconds 300 \
      --p2p-lookup-timeout 3 \
      > "$WORK/lmcache-rs-$kind.log" 2>&1 &
  pids+=($!)
  wait_http "http://127.0.0.1:$lm_http/healthcheck" "$WORK/lmcache-$kind.log"
  wait_http "http://127.0.0.1:$rs_http/healthcheck" "$WORK/lmcache-rs-$kind.log"
  fail() { echo "FAILED: $1 ($kind coordinator)"; for l in lmcache lmcache-rs; do echo "--- $l"; tail -25 "$WORK/$l-$kind.log"; done; exit 1; }
  # LMCache's default bench shape: 1024 tokens of 32 layers, 8 heads, head size 128, fp16,
  # four 32 MiB objects a prompt.
  local shape=(--tokens 1024 --layers 32 --heads 8 --head-size 128)
  (cd tests/interop && timeout 120 "$VENV/bin/python" p2p_mixed.py "tcp://127.0.0.1:$lm" \
      "tcp://127.0.0.1:$rs" 1 "${shape[@]}") || fail "LMCache stores, lmcache-rs reads"
  (cd tests/interop && timeout 120 "$VENV/bin/python" p2p_mixed.py "tcp://127.0.0.1:$rs" \
      "tcp://127.0.0.1:$lm" 2 "${shape[@]}") || fail "lmcache-rs stores, LMCache reads"
  python3 - "http://127.0.0.1:$rs_http" <<'PY' || fail "metrics"
import json, re, sys, urllib.request
base = sys.argv[1]
text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
def m(name):
    return sum(float(x) for x in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
assert m("lmcache_rs_p2p_handshakes_refused_total") == 0, m("lmcache_rs_p2p_handshakes_refused_total")
assert m("lmcache_rs_p2p_fetched_keys_total") >= 3, m("lmcache_rs_p2p_fetched_keys_total")
assert m("lmcache_rs_p2p_fetch_failures_total") == 0, m("lmcache_rs_p2p_fetch_failures_total")
assert m("lmcache_rs_p2p_served_hits_total") >= 3, m("lmcache_rs_p2p_served_hits_total")
status = json.load(urllib.request.urlopen(base + "/status", timeout=5))
assert status["p2p_state"] == "registered", status["p2p_state"]
peers = [p["instance_id"] for p in status["p2p_peers"]]
assert len(peers) == 1 and peers[0].startswith("lmcache-") and not peers[0].startswith("lmcache-rs"), peers
# What ours read from the peer is explained as loaded, not as L1's.
reqs = json.load(urllib.request.urlopen(base + "/cache/requests?limit=200", timeout=5))["requests"]
read = [r for r in reqs if r["request_id"].startswith("lookup-0-") and r["hit_chunks"] == r["chunks"] > 0]
assert read, reqs
x = json.load(urllib.request.urlopen(base + f"/cache/requests/{read[0]['request_id']}/explain", timeout=5))
assert x["loaded_chunks"] == x["chunks"] == 4, x
assert [(r["outcome"], r["tier"]) for r in x["runs"]] == [("hit", "L2 or peer")], x
print("p2p metrics, status and explain: ok")
PY
  # The peer dies (its coordinator still lists it): a lookup misses, and says why.
  pkill -KILL -P "$lm_pid" 2>/dev/null || true
  kill -KILL "$lm_pid" 2>/dev/null || true
  local rid
  rid=$(cd tests/interop && timeout 120 "$VENV/bin/python" p2p_mixed.py - "tcp://127.0.0.1:$rs" 7 \
      --miss-only "${shape[@]}" | tail -1) || fail "a lookup with the peer dead"
  python3 - "http://127.0.0.1:$rs_http" "$rid" <<'PY' || fail "explain after the peer died"
import json, sys, urllib.request
x = json.load(urllib.request.urlopen(f"{sys.argv[1]}/cache/requests/{sys.argv[2]}/explain", timeout=5))
m = x["first_miss"]
assert m and m["reason"] == "peer_failed" and m["chunk"] == 0, x
assert "lmcache-" in m["detail"], m
print("explain, peer dead:", m["detail"])
PY
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  pids=()
  # The killed LMCache server could not remove the segment this script named for it.
  rm -f "/dev/shm/lmc_p2p_mixed_$$"
  echo "interop p2p mixed fleet ($kind coordinator): ok"
}

run_case lmcache
run_case ours
echo "interop p2p mixed: ok"
