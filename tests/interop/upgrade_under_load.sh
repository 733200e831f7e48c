#!/usr/bin/env bash
# Hot upgrade under LMCache 0.5.6's own `lmcache bench server` (lmcache-driven, its default
# model: 32 MiB per 256-token chunk). The bench runs sequences 0..N against a server whose L1
# is a file (--l1-devdax-path --l1-warm-restart); while it runs, UPGRADES new servers start
# with --take-over, one after another. LMCache's bench client registers its KV caches once
# and has no retry, so:
#  - every request of the bench succeeds (no timeout, no failed store or retrieve), every
#    warm lookup hits fully and every retrieve hashes to its sequence's stored digest;
#  - every old server exits 0 and every new one took back the bench's registration and
#    serves on the old one's listening sockets (handed over, not bound afresh);
#  - nothing stored is lost: a second bench over the same sequences, on the last server,
#    hits every cold lookup fully and retrieves the same digests.
# Prints the pause of each upgrade (from the SIGTERM to the new server serving).
# With UPGRADE_L1=gds the L1 is a slab file instead (--gds-l1-path, 512 MiB of DRAM staging
# under the 1.5 GiB the bench stores): each old server first writes its staging to the slab,
# and the new one serves the bench's chunks from the slab.
# Usage: tests/interop/upgrade_under_load.sh PATH/TO/lmcache-rs
# (env: UPGRADE_SEQUENCES=12, UPGRADES=3, UPGRADE_L1_GB=3, UPGRADE_INTERVAL=0.3 s,
#  UPGRADE_L1=file|gds)
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:?usage: upgrade_under_load.sh PATH/TO/lmcache-rs}
# shellcheck source=tests/interop/common.sh
source tests/interop/common.sh
N=${UPGRADE_SEQUENCES:-12}
UPGRADES=${UPGRADES:-3}
L1_GB=${UPGRADE_L1_GB:-3}
INTERVAL=${UPGRADE_INTERVAL:-0.3}  # the bench's pause between a sequence's cold and warm pass
TOKENS=1024  # 4 chunks of 256 tokens per sequence
FILE="$WORK/l1.dax"
case "${UPGRADE_L1:-file}" in
  file) l1_flags=(--l1-devdax-path "$FILE" --no-l1-use-lazy) ;;
  gds) mkdir -p "$WORK/slab"; l1_flags=(--gds-l1-path "$WORK/slab" --gds-l1-staging-gb 0.5) ;;
  *) echo "UPGRADE_L1=$UPGRADE_L1: expected file or gds"; exit 2 ;;
esac
port=$(free_port); http=$(free_port)

server() { # log [extra flags...]: a server on the L1 file; its pid in $srv
  local log=$1; shift
  "$BIN" server --host 127.0.0.1 --port "$port" --http-port "$http" --l1-size-gb "$L1_GB" \
      "${l1_flags[@]}" --l1-warm-restart --log-level info \
      "$@" > "$WORK/$log.server.log" 2>&1 &
  srv=$!
  pids+=("$srv")
}

bench() { # log
  PYTHONUNBUFFERED=1 timeout 900 "$VENV/bin/lmcache" bench server --rpc-url "tcp://127.0.0.1:$port" \
      --url "http://127.0.0.1:$http" --mode cpu --transfer-mode lmcache_driven \
      --num-tokens "$TOKENS" --start 0 --end "$N" --interval "$INTERVAL" > "$WORK/$1.bench.log" 2>&1
}

# digests LOG KIND: "seq digest" lines of the bench's per-sequence checksums of that pass.
digests() {
  grep -oE "\[seq [0-9]+/$2\] CHECKSUM: [0-9a-f]+" "$WORK/$1.bench.log" \
    | sed -E 's/\[seq ([0-9]+)\/[a-z]+\] CHECKSUM: /\1 /' | sort -n
}
lookups() { grep -cE "/$2\] LOOKUP: ([0-9]+)/\1 chunks hit" "$WORK/$1.bench.log" | tr -d ' ' || true; }
# Lines of the bench that name a failure (a timeout, a failed transfer, a checksum mismatch).
failures() { grep -iE "timeout|failed|mismatch|error" "$WORK/$1.bench.log" || true; }

server first
wait_http "http://127.0.0.1:$http/healthcheck" "$WORK/first.server.log"
bench load &
bench_pid=$!
olds=()
for u in $(seq "$UPGRADES"); do
  # Upgrade once the bench is well into sequence (u * N / (UPGRADES + 1)).
  at=$((u * N / (UPGRADES + 1)))
  for _ in $(seq 1200); do
    grep -qE "\[seq $at/" "$WORK/load.bench.log" 2>/dev/null && break
    kill -0 "$bench_pid" 2>/dev/null || break
    sleep 0.05
  done
  kill -0 "$bench_pid" 2>/dev/null \
    || { echo "FAILED: the bench ended before upgrade $u"; tail -5 "$WORK/load.bench.log"; exit 1; }
  olds+=("$srv")
  server "up$u" --take-over
  for _ in $(seq 600); do
    grep -q "took over" "$WORK/up$u.server.log" && break
    sleep 0.05
  done
  grep -q "took over" "$WORK/up$u.server.log" \
    || { echo "FAILED: upgrade $u did not take over"; tail -20 "$WORK/up$u.server.log"; exit 1; }
  pause=$(sed 's/\x1b\[[0-9;]*m//g' "$WORK/up$u.server.log" | { grep -o 'pause_ms=[0-9]*' || true; } | head -1)
  taken=$(sed 's/\x1b\[[0-9;]*m//g' "$WORK/up$u.server.log" | { grep -o 'taken=[0-9]*' || true; } | head -1)
  ports=$(sed 's/\x1b\[[0-9;]*m//g' "$WORK/up$u.server.log" | { grep -o 'ports_handed_over=\[[A-Za-z, ]*\]' || true; } | head -1)
  echo "upgrade: $u at sequence $at: $pause, registrations $taken, $ports"
  [ "$taken" = "taken=1" ] || { echo "FAILED: upgrade $u took back $taken registrations"; exit 1; }
  # The new server serves on the old one's sockets (a connection made during the pause
  # waits in their listen queue instead of being refused).
  [ "$ports" = "ports_handed_over=[Transport, Http]" ] \
    || { echo "FAILED: upgrade $u did not receive the old server's ports ($ports)"; exit 1; }
done
rc=0; wait "$bench_pid" || rc=$?
for o in "${olds[@]}"; do
  wait "$o" 2>/dev/null && orc=0 || orc=$?
  [ "$orc" -eq 0 ] || { echo "FAILED: an old server exited $orc"; exit 1; }
done
[ "$rc" -eq 0 ] || { echo "FAILED: the bench under upgrades exited $rc"; tail -20 "$WORK/load.bench.log"; exit 1; }
bad=$(failures load)
[ -z "$bad" ] || { echo "FAILED: the bench saw failures across the upgrades:"; echo "$bad" | head; exit 1; }
[ "$(lookups load warm)" -eq "$N" ] || { echo "FAILED: $(lookups load warm) of $N warm lookups hit fully"; exit 1; }
digests load warm > "$WORK/ref"
[ "$(wc -l < "$WORK/ref")" -eq "$N" ] || { echo "FAILED: $(wc -l < "$WORK/ref") digests"; exit 1; }
[ "$(digests load cold)" = "$(cat "$WORK/ref")" ] || { echo "FAILED: stored and retrieved digests differ"; exit 1; }
echo "upgrade: the bench ran $N sequences across $UPGRADES upgrades: no failed request, every warm lookup hit, every retrieve byte-exact"
# The bench's requests as its log times them: the slowest ones spanned an upgrade.
python3 - "$WORK/load.bench.log" <<'PY'
import re, statistics, sys
t = {}
for line in open(sys.argv[1]):
    m = re.search(r"\] (LOOKUP|STORE|RETRIEVE): .*?([0-9.]+) ms", line)
    if m:
        t.setdefault(m[1], []).append(float(m[2]))
print("upgrade: bench request times (ms), median / slowest: " + ", ".join(
    f"{k.lower()} {statistics.median(v):.1f} / {max(v):.1f}" for k, v in sorted(t.items())))
PY

# Nothing stored is lost: the last server serves every sequence on its cold lookup.
bench again
[ -z "$(failures again)" ] || { echo "FAILED: the second bench saw failures"; failures again | head; exit 1; }
[ "$(lookups again cold)" -eq "$N" ] || { echo "FAILED: $(lookups again cold) of $N cold lookups hit after the upgrades"; exit 1; }
[ "$(digests again warm)" = "$(cat "$WORK/ref")" ] || { echo "FAILED: digests after the upgrades differ"; exit 1; }
echo "upgrade: after the upgrades all $N cold lookups hit fully, retrieves byte-exact"
echo "upgrade (${UPGRADE_L1:-file} L1): ok"
