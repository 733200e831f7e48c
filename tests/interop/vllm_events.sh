#!/usr/bin/env bash
# Interop: the coordinator's cache events re-published in vLLM's KV-event format, decoded by
# vLLM 0.34.0's own classes (vllm.distributed.kv_events), live and replayed (vllm_events.py).
# Usage: tests/interop/vllm_events.sh PATH/TO/lmcache-rs
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:?usage: vllm_events.sh PATH/TO/lmcache-rs}
# shellcheck source=tests/interop/common.sh
. tests/interop/common.sh
PKGS=$(./scripts/vllm-events-pkgs)
PYTHONPATH="$PKGS" timeout 300 "$VENV/bin/python" tests/interop/vllm_events.py "$BIN" \
    "$(free_port)" "$(free_port)" "$(free_port)" "$WORK/coordinator.log" \
  || { echo "FAILED: vLLM KV events"; tail -30 "$WORK/coordinator.log"; exit 1; }
echo "ok: vLLM KV events (posted batches, live and replayed)"

# A fleet: LMCache 0.5.6's server and ours report to our coordinator while LMCache's bench
# stores into each; a subscriber sees both servers' L1 through vLLM's format.
cport=$(free_port); pub=$(free_port)
"$BIN" coordinator --host 127.0.0.1 --port "$cport" --health-check-interval 0 \
    --eviction-check-interval 0 --vllm-kv-events-endpoint "tcp://127.0.0.1:$pub" \
    --exit-after-seconds 300 > "$WORK/fleet-coordinator.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$cport/healthz" "$WORK/fleet-coordinator.log"
PYTHONPATH="$PKGS" timeout 300 "$VENV/bin/python" tests/interop/vllm_events_fleet.py "$pub" \
    "http://127.0.0.1:$cport" "$WORK/ready" "$WORK/stop" "lmcache-$$" "lmcache-rs-$$" \
    > "$WORK/subscriber.log" 2>&1 &
subscriber=$!
for _ in $(seq 100); do [ -f "$WORK/ready" ] && break; sleep 0.1; done
for kind in lmcache lmcache-rs; do
  name="$kind-$$"
  start_reporting_server "$kind" "$name" "$cport" vllmev 300
  timeout 300 "$VENV/bin/lmcache" bench server --rpc-url "tcp://127.0.0.1:$srv_port" \
      --url "http://127.0.0.1:$srv_http" --mode cpu --transfer-mode lmcache_driven --num-tokens 1024 \
      --start 0 --end 3 > "$WORK/$name.bench.log" 2>&1 \
    || { echo "FAILED: bench ($name)"; tail -20 "$WORK/$name.bench.log"; exit 1; }
done
sleep 2  # two event flushes
touch "$WORK/stop"
wait "$subscriber" || { echo "FAILED: vLLM KV events of a fleet"; tail -30 "$WORK/subscriber.log";
                        tail -20 "$WORK/fleet-coordinator.log"; exit 1; }
cat "$WORK/subscriber.log"
echo "ok: vLLM KV events of a fleet"
