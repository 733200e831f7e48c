#!/usr/bin/env bash
# The benches' live display, in a real terminal: `lmcache-rs bench server` and `bench l2` run
# inside tmux; capture-pane snapshots taken while they run must show one progress block
# redrawn in place (one progress line, its count moving between snapshots), and the screen
# at the end must hold the final table with the progress at its total. Piped (not a
# terminal) or with -q, the display must be absent.
# Usage: tests/terminal/live_display.sh PATH/TO/lmcache-rs
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=$(realpath "${1:?usage: live_display.sh PATH/TO/lmcache-rs}")
if ! command -v tmux >/dev/null; then
  echo "installing tmux from Debian's packages" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tmux >&2
fi
WORK=$(mktemp -d)
session="lmcrs_live_$$"
server_pid=""
cleanup() {
  tmux kill-session -t "$session" 2>/dev/null || true
  [ -n "$server_pid" ] && kill -TERM "$server_pid" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$WORK" || true
}
trap cleanup EXIT
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$BIN" server --host 127.0.0.1 --port "$port" --http-port 0 --l1-size-gb 1 \
    --shm-name "lmcache_rs_live_$$" --exit-after-seconds 120 > "$WORK/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 100); do [ -e "/dev/shm/lmcache_rs_live_$$" ] && break; sleep 0.1; done

# Runs CMD in a fresh tmux pane; snapshots the pane every 0.7 s until CMD prints DONE.
watch_pane() { # name cmd...
  local name=$1; shift
  tmux new-session -d -s "$session" -x 110 -y 50 "$* ; echo DONE; sleep 60"
  local i=0
  while :; do
    sleep 0.7; i=$((i + 1))
    tmux capture-pane -p -S - -t "$session" > "$WORK/$name.$i.txt"
    grep -q '^DONE' "$WORK/$name.$i.txt" && break
    [ "$i" -lt 120 ] || { echo "FAILED: $name never finished"; cat "$WORK/$name.$i.txt"; exit 1; }
  done
  tmux kill-session -t "$session"
  echo "$i"
}

check() { # name last-snapshot progress-regex final-regex
  local name=$1 last=$2 progress=$3 final=$4 counts=()
  for f in $(seq 1 $((last - 1))); do
    local snap="$WORK/$name.$f.txt" n
    n=$(grep -cE "$progress" "$snap" || true)
    [ "$n" -le 1 ] || { echo "FAILED: $name: $n progress lines on one screen (appended, not redrawn)"; cat "$snap"; exit 1; }
    [ "$n" -eq 1 ] && counts+=("$(grep -oE "$progress" "$snap" | head -1)")
  done
  local distinct
  distinct=$(printf '%s\n' "${counts[@]}" | sort -u | wc -l)
  [ "${#counts[@]}" -ge 2 ] && [ "$distinct" -ge 2 ] \
    || { echo "FAILED: $name: the display did not redraw while running (${counts[*]:-none})"; exit 1; }
  grep -qE "$final" "$WORK/$name.$last.txt" \
    || { echo "FAILED: $name: the final screen lacks $final"; cat "$WORK/$name.$last.txt"; exit 1; }
  [ "$(grep -cE "$progress" "$WORK/$name.$last.txt")" -eq 1 ] \
    || { echo "FAILED: $name: the final screen has not exactly one progress line"; cat "$WORK/$name.$last.txt"; exit 1; }
  echo "live display ($name): redrawn in place over ${#counts[@]} snapshots ($distinct distinct), ends with the table"
}

last=$(watch_pane server "$BIN" bench server --rpc-url "tcp://127.0.0.1:$port" --end 10 --interval 0.4 \
    --kvcache-shape-spec "'(2,64,16,2,64):float16:4'" --num-tokens 512)
check server "$last" '\] [0-9]+/10 requests' '^=+ Server Bench Result =+$'
grep -q '\] 10/10 requests' "$WORK/server.$last.txt" || { echo "FAILED: final progress not 10/10"; exit 1; }

last=$(watch_pane l2 "$BIN" bench l2 --l2-adapter "'{\"type\":\"mock\",\"max_size_gb\":1,\"mock_bandwidth_gb\":0.05,\"latency_ms\":20}'" --rounds 6 \
    --warmup-rounds 0 --num-keys 8 --in-flight 2 --data-size-kb 1024)
check l2 "$last" '\] [0-9]+/18 rounds' 'L2 Adapter Benchmark Result'

# Not a terminal: no display (stderr piped), and -q: nothing at all.
"$BIN" bench server --rpc-url "tcp://127.0.0.1:$port" --start 100 --end 102 \
    --kvcache-shape-spec '(2,64,16,2,64):float16:4' 2> "$WORK/piped.err" > "$WORK/piped.out"
if grep -q 'requests' "$WORK/piped.err"; then echo "FAILED: live display drawn into a pipe"; cat "$WORK/piped.err"; exit 1; fi
grep -q 'Server Bench Result' "$WORK/piped.out" || { echo "FAILED: no table when piped"; exit 1; }
"$BIN" bench server --rpc-url "tcp://127.0.0.1:$port" --start 200 --end 202 -q \
    --kvcache-shape-spec '(2,64,16,2,64):float16:4' > "$WORK/quiet.out" 2>&1
[ ! -s "$WORK/quiet.out" ] || { echo "FAILED: -q printed"; cat "$WORK/quiet.out"; exit 1; }
echo "live display: absent when piped and with -q"
