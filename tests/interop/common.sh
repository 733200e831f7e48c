# Sourced by the interop scripts (after `cd` to the repository root): LMCache's environment,
# a work directory that goes at exit with every process listed in `pids`, and helpers.
VENV=$(./scripts/lmcache-venv)
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1 PYTHONWARNINGS=ignore
WORK=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ -n "${KEEP_WORK:-}" ] || rm -rf "$WORK" || true
}
trap cleanup EXIT

# A free TCP port on 127.0.0.1, never one this run handed out before (scripts/free-port: bind(0)
# can give two calls in a row the same port). LMCache's server and trace replay also bind a Prometheus port
# (9090 unless told): every script gives them a free one, so nothing else on the machine (a
# real Prometheus, another test) can make them fail.
FREE_PORT="$PWD/scripts/free-port"  # absolute: some calls run after a `cd`
free_port() { "$FREE_PORT" "$WORK/.ports"; }

# Runs LMCache's `lmcache bench server` (lmcache-driven, 1024 tokens, sequences 0..END) against
# the server just started (the last of `pids`) once its HTTP answers, then stops that server.
# INTERVAL (default 0) is the bench's pause between a sequence's cold and warm request: LMCache's
# own server acknowledges a lmcache-driven store before the chunks are visible, so a script
# that needs its warm lookups to hit gives it a settle (ours is visible at reply: 0).
bench_then_stop() { # port http_port end log_prefix [interval]
  wait_http "http://127.0.0.1:$2/healthcheck" "$4.server.log"
  timeout 300 "$VENV/bin/lmcache" bench server --rpc-url "tcp://127.0.0.1:$1" \
      --url "http://127.0.0.1:$2" --mode cpu --transfer-mode lmcache_driven --num-tokens 1024 \
      --start 0 --end "$3" --interval "${5:-0}" > "$4.bench.log" 2>&1 \
    || { echo "FAILED: bench ($4)"; tail -20 "$4.bench.log"; exit 1; }
  kill -TERM "${pids[-1]}"; wait "${pids[-1]}" 2>/dev/null || true
}

# Waits (60 s at most) until URL answers; else prints the tail of LOG and fails.
wait_http() { # url log
  for _ in $(seq 300); do
    python3 -c "import urllib.request; urllib.request.urlopen('$1', timeout=1)" 2>/dev/null && return 0
    sleep 0.2
  done
  echo "not up: $1"; tail -30 "$2"; return 1
}

# Starts a cache server of KIND (lmcache-rs or lmcache, LMCache 0.5.6's) named NAME that
# reports to the coordinator on CPORT, stopping itself after SECONDS, its shared memory
# named after TAG; waits until its HTTP answers. Sets $srv_port (ZMQ) and $srv_http.
start_reporting_server() { # kind name cport tag seconds
  local kind=$1 name=$2 cport=$3 tag=$4 secs=$5
  srv_port=$(free_port); srv_http=$(free_port)
  local report=(--instance-id "$name" --coordinator-url "http://127.0.0.1:$cport"
                --coordinator-event-reporting --coordinator-event-flush-interval 0.2
                --coordinator-heartbeat-interval 1 --coordinator-advertise-ip 127.0.0.1)
  if [ "$kind" = lmcache-rs ]; then
    "$BIN" server --host 127.0.0.1 --port "$srv_port" --http-port "$srv_http" --l1-size-gb 1 \
        --shm-name "lmcache_rs_${tag}_$$_$name" --max-workers 2 --exit-after-seconds "$secs" \
        "${report[@]}" > "$WORK/$name.log" 2>&1 &
  else
    timeout "$secs" "$VENV/bin/lmcache" server --prometheus-port "$(free_port)" --host 127.0.0.1 \
        --port "$srv_port" --http-host 127.0.0.1 --http-port "$srv_http" --l1-size-gb 1 \
        --eviction-policy LRU --supported-transfer-mode auto --shm-name "lmc_${tag}_$$_$name" \
        "${report[@]}" > "$WORK/$name.log" 2>&1 &
  fi
  pids+=($!)
  wait_http "http://127.0.0.1:$srv_http/healthcheck" "$WORK/$name.log"
}
