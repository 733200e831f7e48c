#!/usr/bin/env bash
# Interop: CacheBlend. LMCache 0.5.6's blend server (`lmcache server --engine-type blend
# --supported-transfer-mode lmcache_driven`) and `lmcache-rs server --engine-type blend` get
# the same calls from LMCache's own client classes (tests/interop/blend_engine.py): equal
# handshakes, unified lookups (hash bytes included), early retrieve outcomes and reorder
# plans; our scatter checked against LMCache's own CPU re-rotation. Then our metrics and
# /status must show the blend state. Then a fleet of two lmcache-rs servers sharing an fs L2,
# reporting to a coordinator (ours, then LMCache's): what A stores, B reuses anywhere in a
# prompt through the coordinator's /directory/blend-lookup (tests/interop/blend_fleet.py).
# Usage: tests/interop/blend.sh PATH/TO/lmcache-rs
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:?usage: blend.sh PATH/TO/lmcache-rs}
# shellcheck source=tests/interop/common.sh
. tests/interop/common.sh
theirs=$(free_port); theirs_http=$(free_port); ours=$(free_port); ours_http=$(free_port)
timeout 300 "$VENV/bin/lmcache" server --prometheus-port "$(free_port)" --host 127.0.0.1 \
    --port "$theirs" --http-host 127.0.0.1 --http-port "$theirs_http" --l1-size-gb 1 \
    --eviction-policy LRU --engine-type blend --supported-transfer-mode lmcache_driven \
    --enable-blend-reorder --shm-name "lmc_blend_$$" > "$WORK/lmcache.server.log" 2>&1 &
pids+=($!)
"$BIN" server --host 127.0.0.1 --port "$ours" --http-port "$ours_http" --l1-size-gb 1 \
    --engine-type blend --enable-blend-reorder --shm-name "lmcache_rs_blend_$$" \
    --max-workers 2 --exit-after-seconds 300 > "$WORK/lmcache-rs.server.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$theirs_http/healthcheck" "$WORK/lmcache.server.log"
wait_http "http://127.0.0.1:$ours_http/healthcheck" "$WORK/lmcache-rs.server.log"
fail() { echo "FAILED: $1"; for l in lmcache lmcache-rs; do echo "--- $l"; tail -25 "$WORK/$l.server.log"; done; exit 1; }
(cd tests/interop && timeout 240 "$VENV/bin/python" blend_engine.py "tcp://127.0.0.1:$theirs" \
    "tcp://127.0.0.1:$ours") || fail "blend engine"
python3 - "http://127.0.0.1:$ours_http" <<'PY' || fail "blend metrics and status"
import json, re, sys, urllib.request
base = sys.argv[1]
text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
def m(name):
    return sum(float(x) for x in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
def noops(reason):
    return m(rf'lmcache_blend_retrieve_noops_total\{{reason="{reason}"\}}')
# LMCache's blend metric names (its blend metrics subscriber), counted as LMCache counts them.
assert m("lmcache_blend_lookup_requests_total") == 9, m("lmcache_blend_lookup_requests_total")
assert m("lmcache_blend_fingerprints_registered_total") == 3
assert m("lmcache_blend_lookup_storage_hits_total") >= 6, m("lmcache_blend_lookup_storage_hits_total")
assert m("lmcache_blend_lookup_non_prefix_hit_tokens_total") >= 6 * 256
assert m("lmcache_blend_lookup_prefix_hit_tokens_total") == 256
assert m("lmcache_blend_retrieve_requests_total") == 2, m("lmcache_blend_retrieve_requests_total")
assert m("lmcache_blend_retrieve_failures_total") == 0
assert m("lmcache_blend_scatter_shifted_chunks_total") == 2
assert m("lmcache_blend_scatter_tokens_total") == 512, m("lmcache_blend_scatter_tokens_total")
assert m("lmcache_blend_scatter_duration_milliseconds_count") == 2
assert noops("matches_beyond_alloc") == 1 and noops("matches_straddle_alloc") == 1
assert noops("already_applied") == 1
assert m("lmcache_blend_reorder_plans_total") == 1, m("lmcache_blend_reorder_plans_total")
assert m("lmcache_rs_mp_handler_panics_total") == 0
status = json.load(urllib.request.urlopen(base + "/status", timeout=5))
assert status["engine_type"] == "blend", status["engine_type"]
b = status["blend"]
assert b["registered_cb_rope_instances"] == [] and b["fingerprinted_chunks"] >= 3, b
assert b["reorder"] is True and b["reorder_prompts"] == 3, b
print("blend metrics and status: ok")
PY
# The operator's view: `describe kvcache` shows the blend state.
desc=$("$BIN" describe kvcache --url "http://127.0.0.1:$ours_http") || fail "describe kvcache"
for want in "Blend fingerprints" "3 chunks" "Blend rope workers" "reorder on (3 prompts)"; do
  grep -qF "$want" <<< "$desc" || { echo "$desc"; fail "describe kvcache lacks '$want'"; }
done
echo "describe kvcache shows the blend state: ok"

# The fleet: A stores, B finds A's document through the coordinator (ours, then LMCache's) and
# loads it from the L2 they share.
for ckind in lmcache-rs lmcache; do
  cport=$(free_port)
  if [ "$ckind" = lmcache-rs ]; then
    "$BIN" coordinator --host 127.0.0.1 --port "$cport" --enable-blend-lookup \
        --exit-after-seconds 300 > "$WORK/coord-$ckind.log" 2>&1 &
  else
    timeout 300 "$VENV/bin/lmcache" coordinator --host 127.0.0.1 --port "$cport" \
        --enable-blend-lookup > "$WORK/coord-$ckind.log" 2>&1 &
  fi
  pids+=($!)
  wait_http "http://127.0.0.1:$cport/healthz" "$WORK/coord-$ckind.log"
  l2="$WORK/l2-$ckind"; mkdir -p "$l2"
  urls=(); https=()
  for name in a b; do
    port=$(free_port); http=$(free_port)
    # A's L2 writes take a second: the coordinator hears of A's chunk before the L2 holds
    # it, every run (B must not look, and count the chunk stale, before then).
    adapter="{\"type\": \"fs\", \"base_path\": \"$l2\"}"
    [ "$name" = b ] || adapter="{\"type\": \"fault_inject\", \"rate\": 1.0, \"mode\": \"delay\", \"delay_ms\": 1000, \"ops\": [\"store\"], \"inner\": $adapter}"
    "$BIN" server --host 127.0.0.1 --port "$port" --http-port "$http" --l1-size-gb 1 \
        --engine-type blend --shm-name "lmcache_rs_bf_$$_${ckind}_$name" --max-workers 2 \
        --l2-adapter "$adapter" \
        --instance-id "blend-$name" --coordinator-url "http://127.0.0.1:$cport" \
        --coordinator-event-reporting --coordinator-event-flush-interval 0.1 \
        --coordinator-heartbeat-interval 1 --coordinator-advertise-ip 127.0.0.1 \
        --exit-after-seconds 300 > "$WORK/fleet-$ckind-$name.log" 2>&1 &
    pids+=($!)
    wait_http "http://127.0.0.1:$http/healthcheck" "$WORK/fleet-$ckind-$name.log"
    urls+=("tcp://127.0.0.1:$port"); https+=("http://127.0.0.1:$http")
  done
  (cd tests/interop && timeout 240 "$VENV/bin/python" blend_fleet.py "${urls[0]}" "${urls[1]}" \
      "${https[0]}" "${https[1]}") || {
    echo "FAILED: blend fleet ($ckind coordinator)"
    for l in "coord-$ckind" "fleet-$ckind-a" "fleet-$ckind-b"; do echo "--- $l"; tail -25 "$WORK/$l.log"; done
    exit 1
  }
  echo "blend fleet through the $ckind coordinator: ok"
done
echo "interop blend: ok"
