#!/usr/bin/env bash
# Restart warm, driven by LMCache 0.5.6's own `lmcache bench server` (lmcache-driven, its
# default model: 32 MiB per 256-token chunk), with L1 in a file (--l1-devdax-path):
#  1. a fresh server stores sequences 0..N (cold misses, warm full hits, checksums match);
#     their digests are the reference; it is killed with SIGKILL once its seals are done;
#  2. a server restarted on the file (--l1-warm-restart) hits every sequence fully on its
#     *cold* lookups, and its warm retrieves hash to the reference, byte for byte;
#  3. SIGTERM, restart, twice: every chunk is adopted each time;
#  4. without --l1-warm-restart the file starts empty;
#  5. SIGKILL in the middle of stores, three times, then a warm restart: whatever was
#     adopted hashes to the reference (a chunk whose write or seal did not finish is dropped,
#     never served) and what was not is stored again;
#  6. vLLM's own adapters keep running across a SIGKILL and restart, and hit again;
#  7. a hot upgrade (--take-over) under those adapters: the old server exits 0, the new one
#     serves its L1 on its ports, the adapters hit;
#  8. the same in shared memory (--shm-name NAME --l1-warm-restart, the L1 file is the segment
#     /dev/shm/NAME) with vLLM's adapters in engine-driven mode (they copy into the segment
#     themselves): across a SIGKILL and restart, and across a hot upgrade, they hit and
#     retrieve byte-exact KV;
#  9. a slab-file L1 (--gds-l1-path, 256 MiB of DRAM staging): SIGKILL in the middle of
#     stores (the slab's writes in flight), three times, then a warm restart: what the slab
#     serves hashes to the reference (a torn slot is a miss, never served).
# A coordinator hears the adopted chunks (they are announced after the restart).
# Usage: tests/interop/restart.sh PATH/TO/lmcache-rs
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:?usage: restart.sh PATH/TO/lmcache-rs}
# shellcheck source=tests/interop/common.sh
source tests/interop/common.sh
N=${RESTART_SEQUENCES:-4}
TOKENS=2048  # 8 chunks of 256 tokens per sequence
CHUNKS=$((N * TOKENS / 256))
FILE="$WORK/l1.dax"

port=$(free_port); http=$(free_port); cport=$(free_port)
report=()  # set once the coordinator runs

l1_flags=(--l1-devdax-path "$FILE" --no-l1-use-lazy)  # the L1 of steps 1-7 (9: a slab)
start() { # log [extra flags...]
  local log=$1; shift
  "$BIN" server --host 127.0.0.1 --port "$port" --http-port "$http" --l1-size-gb 3 \
      "${l1_flags[@]}" --log-level info --instance-id restart-test \
      "${report[@]}" "$@" > "$WORK/$log.server.log" 2>&1 &
  srv=$!
  pids+=("$srv")
  wait_http "http://127.0.0.1:$http/healthcheck" "$WORK/$log.server.log"
}

bench() { # log end [allow-failure]
  local rc=0
  timeout 600 "$VENV/bin/lmcache" bench server --rpc-url "tcp://127.0.0.1:$port" \
      --url "http://127.0.0.1:$http" --mode cpu --transfer-mode lmcache_driven \
      --num-tokens "$TOKENS" --start 0 --end "$2" --interval 0 > "$WORK/$1.bench.log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ] && [ -z "${3:-}" ]; then
    echo "FAILED: bench $1 exited $rc"; tail -20 "$WORK/$1.bench.log"; exit 1
  fi
}

# Ends a background `bench` whose server was killed: its client would otherwise wait out its
# own timeouts. TERM goes to the subshell's children (`timeout`, which passes it on to the
# client). A client ended so leaves its KV segments (/dev/shm/lmcache_kv_<its pid>_<n>): this
# test started it, so they are removed, by that pid only.
end_bench() { # pid
  local c g clients=()
  for c in $(cat /proc/"$1"/task/*/children 2>/dev/null); do
    for g in $(cat /proc/"$c"/task/*/children 2>/dev/null); do clients+=("$g"); done
    kill -TERM "$c" 2>/dev/null || true
  done
  wait "$1" 2>/dev/null || true
  for g in "${clients[@]}"; do
    while kill -0 "$g" 2>/dev/null; do sleep 0.05; done
    rm -f /dev/shm/lmcache_kv_"$g"_*
  done
}

status() { # python expression over d = /status's storage_manager.l1.restart
  python3 - "http://127.0.0.1:$http/status" "$1" <<'PY'
import json, sys, urllib.request
d = json.load(urllib.request.urlopen(sys.argv[1], timeout=5))["storage_manager"]["l1"]["restart"]
print(eval(sys.argv[2], {"d": d}))
PY
}

wait_sealed() {
  for _ in $(seq 300); do
    [ "$(status 'd["seal_pending"]')" = 0 ] && return 0
    sleep 0.2
  done
  echo "FAILED: seals never drained"; exit 1
}

stop() { # signal
  kill "-$1" "$srv"; wait "$srv" 2>/dev/null || true
}

# SIGTERM to a server this shell did not start (a restart script's), and wait until it is gone.
stop_pid() { # pid
  kill -TERM "$1" 2>/dev/null || true
  for _ in $(seq 600); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.1; done
  echo "FAILED: server $1 did not stop"; exit 1
}

# digests LOG KIND: "seq digest" lines of the bench's per-sequence checksums of that pass.
digests() {
  grep -oE "\[seq [0-9]+/$2\] CHECKSUM: [0-9a-f]+" "$WORK/$1.bench.log" \
    | sed -E 's/\[seq ([0-9]+)\/[a-z]+\] CHECKSUM: /\1 /' | sort -n
}
cold_hits() { grep -cE "/cold\] LOOKUP: ([0-9]+)/\1 chunks hit" "$WORK/$1.bench.log" | tr -d ' ' || true; }

# unexplained_mismatches LOG: the sequences whose "CHECKSUM MISMATCH" is not LMCache's bench
# comparing two different ranges. On a partial cold hit (k of n chunks) the bench checksums
# only the n - k chunks it stores, then compares that list with the warm pass's n chunks: a
# MISMATCH by construction. Such a sequence is explained when its cold checksum covers
# exactly n - k chunks (its bytes are judged by the warm digests against the reference);
# any other MISMATCH is printed.
unexplained_mismatches() { # file
  python3 - "$1" <<'PY'
import re, sys
lookup, cold_sums, bad = {}, {}, []
for line in open(sys.argv[1], errors="replace"):
    if m := re.search(r"\[seq (\d+)/cold\] LOOKUP: (\d+)/(\d+) chunks hit", line):
        lookup[m[1]] = (int(m[2]), int(m[3]))
    elif m := re.search(r"\[seq (\d+)/cold\] CHECKSUM: \w+ \((\d+) chunks\)", line):
        cold_sums[m[1]] = int(m[2])
    elif m := re.search(r"\[seq (\d+)\] CHECKSUM MISMATCH", line):
        hit, n = lookup.get(m[1], (0, 0))
        if not (0 < hit < n and cold_sums.get(m[1]) == n - hit):
            bad.append(m[1])
print(" ".join(bad))
PY
}
# The check itself can fail: a mismatch after a full cold miss is unexplained, one after a
# partial hit whose cold checksum covers the missed chunks is not.
printf '%s\n' "  [seq 0/cold] LOOKUP: 0/8 chunks hit (1.0 ms)" "  [seq 0/cold] CHECKSUM: ab (8 chunks)" \
    "  [seq 0] CHECKSUM MISMATCH!" "  [seq 1/cold] LOOKUP: 3/8 chunks hit (1.0 ms)" \
    "  [seq 1/cold] CHECKSUM: cd (5 chunks)" "  [seq 1] CHECKSUM MISMATCH!" > "$WORK/selfcheck.bench.log"
[ "$(unexplained_mismatches "$WORK/selfcheck.bench.log")" = 0 ] \
  || { echo "FAILED: unexplained_mismatches misjudges its own example"; exit 1; }

# 1. Fresh: cold misses, stores, warm full hits; the reference digests.
start fresh --l1-warm-restart
bench fresh "$N"
digests fresh warm > "$WORK/ref"
[ "$(wc -l < "$WORK/ref")" -eq "$N" ] || { echo "FAILED: $(wc -l < "$WORK/ref") reference digests"; exit 1; }
[ "$(digests fresh cold)" = "$(cat "$WORK/ref")" ] || { echo "FAILED: cold and warm digests differ"; exit 1; }
[ "$(cold_hits fresh)" -eq 0 ] || { echo "FAILED: a fresh file hit"; exit 1; }
wait_sealed
[ "$(status 'd["sealed_objects"]')" -eq "$CHUNKS" ] || { echo "FAILED: sealed $(status 'd')"; exit 1; }
stop KILL
echo "restart: fresh server stored $N sequences ($CHUNKS chunks of 32 MiB), killed with SIGKILL"

# 2. Warm after SIGKILL: cold lookups are full hits; retrieves hash to the reference. A
#    coordinator started only now learns the chunks from the restarted server's announcement.
"$BIN" coordinator --host 127.0.0.1 --port "$cport" --log-level warn > "$WORK/coord.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$cport/healthz" "$WORK/coord.log"
report=(--coordinator-url "http://127.0.0.1:$cport" --coordinator-event-reporting)
start warm1 --l1-warm-restart
[ "$(status 'd["adopted_objects"]')" -eq "$CHUNKS" ] || { echo "FAILED: adopted $(status 'd')"; exit 1; }
python3 - "http://127.0.0.1:$cport" "$CHUNKS" <<'PY' || exit 1
import json, sys, time, urllib.request
base, want = sys.argv[1], int(sys.argv[2])
for _ in range(100):
    stats = json.load(urllib.request.urlopen(base + "/directory/stats", timeout=5))
    if stats.get("l1_keys_by_instance", {}).get("restart-test", 0) >= want:
        sys.exit(0)
    time.sleep(0.1)
print("FAILED: the coordinator does not hold the adopted chunks:", stats)
sys.exit(1)
PY
bench warm1 "$N"
[ "$(cold_hits warm1)" -eq "$N" ] || { echo "FAILED: $(cold_hits warm1) of $N cold lookups hit after SIGKILL"; exit 1; }
[ "$(digests warm1 warm)" = "$(cat "$WORK/ref")" ] || { echo "FAILED: digests after SIGKILL differ"; diff <(digests warm1 warm) "$WORK/ref"; exit 1; }
echo "restart: after SIGKILL all $N cold lookups hit fully, retrieves byte-exact (LMCache's digests), the coordinator holds the chunks"

# 3. SIGTERM, twice.
for round in 1 2; do
  stop TERM
  start "term$round" --l1-warm-restart
  got=$(status 'd["adopted_objects"]')
  [ "$got" -eq "$CHUNKS" ] || { echo "FAILED: SIGTERM round $round adopted $got of $CHUNKS"; exit 1; }
done
bench term "$N"
[ "$(cold_hits term)" -eq "$N" ] && [ "$(digests term warm)" = "$(cat "$WORK/ref")" ] \
  || { echo "FAILED: after SIGTERM"; exit 1; }
echo "restart: SIGTERM twice, every chunk adopted each time, retrieves byte-exact"

# 4. Without the flag the file starts empty.
stop TERM
start cold
[ "$(status 'd["adopted_objects"]')" -eq 0 ] || { echo "FAILED: a cold start adopted"; exit 1; }
python3 -c "
import json, urllib.request
d = json.load(urllib.request.urlopen('http://127.0.0.1:$http/status'))
assert d['storage_manager']['l1']['resident_objects'] == 0, d
"
echo "restart: without --l1-warm-restart the file starts empty"

# 5. SIGKILL in the middle of stores, three times, then verify everything.
# Each kill lands once the server holds a few more chunks than it adopted: while the bench is
# storing (the next chunks being copied) and the sealer is behind.
resident() {
  python3 -c "
import json, urllib.request
print(json.load(urllib.request.urlopen('http://127.0.0.1:$http/status'))['storage_manager']['l1']['resident_objects'])"
}
for round in 1 2 3; do
  before=$(resident)
  bench "kill$round" "$N" allow-failure &
  b=$!
  for _ in $(seq 3000); do
    [ "$(resident)" -ge "$((before + 4 * round))" ] && break
    sleep 0.02
  done
  stop KILL
  end_bench "$b"
  start "afterkill$round" --l1-warm-restart
  adopted=$(status 'd["adopted_objects"]')
  echo "restart: SIGKILL mid-store round $round (holding $before + $((4 * round)) chunks): adopted $adopted, dropped as corrupt $(status 'd["adopt_corrupt"]')"
  # What was adopted before stays (the bench only adds); the newest chunks may be unsealed.
  [ "$adopted" -ge "$before" ] || { echo "FAILED: chunks adopted earlier were lost"; exit 1; }
  [ "$adopted" -gt "$before" ] && grew=1
done
[ -n "${grew:-}" ] || { echo "FAILED: no chunk stored between kills was ever adopted"; exit 1; }
bench final "$N"
[ "$(digests final warm)" = "$(cat "$WORK/ref")" ] \
  || { echo "FAILED: digests after SIGKILLs mid-store differ"; diff <(digests final warm) "$WORK/ref"; exit 1; }
bad=$(unexplained_mismatches "$WORK/final.bench.log")
[ -z "$bad" ] || { echo "FAILED: a checksum mismatch, sequences $bad"; exit 1; }
echo "restart: after 3 SIGKILLs mid-store, $(cold_hits final) of $N sequences hit fully on the cold lookup; every retrieve byte-exact"
stop TERM

# 6. vLLM's own adapters (scheduler and worker, lmcache-driven) stay up across a SIGKILL and
#    restart of the server: the new server takes back the worker's registration, and it hits.
cat > "$WORK/restart-server" <<EOF
#!/usr/bin/env bash
kill -KILL \$(cat "$WORK/srv.pid"); sleep 0.2
"$BIN" server --host 127.0.0.1 --port "$port" --http-port "$http" --l1-size-gb 3 \\
    --l1-devdax-path "$FILE" --l1-warm-restart --log-level info >> "$WORK/vllm.server.log" 2>&1 &
echo \$! > "$WORK/srv.pid"
for _ in \$(seq 300); do
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$http/healthcheck', timeout=1)" 2>/dev/null && exit 0
  sleep 0.1
done
exit 1
EOF
chmod +x "$WORK/restart-server"
start vllm --l1-warm-restart
echo "$srv" > "$WORK/srv.pid"
rc=0
LMCACHE_MP_TRANSFER_MODE=lmcache_driven timeout 300 "$VENV/bin/python" tests/interop/vllm_restart.py \
    "tcp://127.0.0.1:$port" "$WORK/restart-server" > "$WORK/vllm.log" 2>&1 || rc=$?
pids+=("$(cat "$WORK/srv.pid")")
stop_pid "$(cat "$WORK/srv.pid")"
if [ "$rc" -ne 0 ] || ! grep -q "retrieve bytes equal" "$WORK/vllm.log"; then
  echo "FAILED: vLLM's adapters across a restart"; grep -v INFO "$WORK/vllm.log" | tail -20; exit 1
fi
echo "restart: $(grep -o 'vllm restart:.*' "$WORK/vllm.log")"

# 7. Hot upgrade: a second server started with --take-over (the "new binary") stops the
#    running one with SIGTERM, adopts its L1 file and takes its ports, while vLLM's adapters
#    keep their connections: their registrations are taken back and they hit what the old
#    server stored.
cat > "$WORK/take-over" <<EOF
#!/usr/bin/env bash
"$BIN" server --host 127.0.0.1 --port "$port" --http-port "$http" --l1-size-gb 3 \\
    --l1-devdax-path "$FILE" --l1-warm-restart --take-over --log-level info \\
    > "$WORK/upgraded.server.log" 2>&1 &
echo \$! > "$WORK/srv.pid"
for _ in \$(seq 600); do
  grep -q "took over" "$WORK/upgraded.server.log" && exit 0
  sleep 0.05
done
exit 1
EOF
chmod +x "$WORK/take-over"
start old --l1-warm-restart
echo "$srv" > "$WORK/srv.pid"
rc=0
LMCACHE_MP_TRANSFER_MODE=lmcache_driven timeout 300 "$VENV/bin/python" tests/interop/vllm_restart.py \
    "tcp://127.0.0.1:$port" "$WORK/take-over" > "$WORK/upgrade.log" 2>&1 || rc=$?
new=$(cat "$WORK/srv.pid")
pids+=("$new")
if [ "$rc" -ne 0 ] || ! grep -q "retrieve bytes equal" "$WORK/upgrade.log"; then
  echo "FAILED: vLLM's adapters across a hot upgrade"; grep -v INFO "$WORK/upgrade.log" | tail -20
  tail -5 "$WORK/upgraded.server.log"; exit 1
fi
wait "$srv" 2>/dev/null && old_rc=0 || old_rc=$?
[ "$old_rc" -eq 0 ] || { echo "FAILED: the old server exited $old_rc"; exit 1; }
pause=$(sed 's/\x1b\[[0-9;]*m//g' "$WORK/upgraded.server.log" | grep -o 'pause_ms=[0-9]*' | head -1)
stop_pid "$new"
echo "restart: hot upgrade ($pause from SIGTERM to the new server serving): $(grep -o 'vllm restart:.*' "$WORK/upgrade.log")"

# 8. Warm restart in shared memory, engine-driven: the segment outlives each server.
export SHM="lmcache_rs_restart_$$" BIN port http WORK
trap 'rm -f "/dev/shm/$SHM" "/dev/shm/$SHM".lmcache-rs-*; cleanup' EXIT
cat > "$WORK/shm-server" <<'EOF'
#!/usr/bin/env bash
# shm-server LOG [extra flags...]: one server on the segment, its pid in $WORK/srv.pid.
log=$1; shift
"$BIN" server --host 127.0.0.1 --port "$port" --http-port "$http" --l1-size-gb 1 \
    --shm-name "$SHM" --l1-warm-restart --log-level info "$@" >> "$WORK/$log.server.log" 2>&1 &
echo $! > "$WORK/srv.pid"
EOF
cat > "$WORK/shm-restart" <<'EOF'
#!/usr/bin/env bash
kill -KILL "$(cat "$WORK/srv.pid")"; sleep 0.2
"$WORK/shm-server" shm-restarted
for _ in $(seq 300); do
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$http/healthcheck', timeout=1)" 2>/dev/null && exit 0
  sleep 0.1
done
exit 1
EOF
cat > "$WORK/shm-take-over" <<'EOF'
#!/usr/bin/env bash
"$WORK/shm-server" shm-upgraded --take-over
for _ in $(seq 600); do
  grep -q "took over" "$WORK/shm-upgraded.server.log" 2>/dev/null && exit 0
  sleep 0.05
done
exit 1
EOF
chmod +x "$WORK/shm-server" "$WORK/shm-restart" "$WORK/shm-take-over"
for step in shm-restart shm-take-over; do
  . "$WORK/shm-server" "first-$step"  # sourced: the first server is this shell's child
  first=$(cat "$WORK/srv.pid")
  pids+=("$first")
  wait_http "http://127.0.0.1:$http/healthcheck" "$WORK/first-$step.server.log"
  rc=0
  LMCACHE_MP_TRANSFER_MODE=engine_driven timeout 300 "$VENV/bin/python" tests/interop/vllm_restart.py \
      "tcp://127.0.0.1:$port" "$WORK/$step" > "$WORK/$step.log" 2>&1 || rc=$?
  pids+=("$(cat "$WORK/srv.pid")")
  if [ "$rc" -ne 0 ] || ! grep -q "retrieve bytes equal" "$WORK/$step.log"; then
    echo "FAILED: engine-driven adapters across $step"; grep -v INFO "$WORK/$step.log" | tail -20
    tail -5 "$WORK"/*shm*.server.log; exit 1
  fi
  grep -q "engine-driven worker registered" "$WORK/first-$step.server.log" \
    || { echo "FAILED: the adapters did not run engine-driven"; exit 1; }
  if [ "$step" = shm-take-over ]; then
    wait "$first" 2>/dev/null && old_rc=0 || old_rc=$?
    [ "$old_rc" -eq 0 ] || { echo "FAILED: the old server exited $old_rc"; exit 1; }
  fi
  stop_pid "$(cat "$WORK/srv.pid")"
  [ -e "/dev/shm/$SHM" ] || { echo "FAILED: the segment did not outlive the server"; exit 1; }
  echo "restart: shared memory, engine-driven, $step: $(grep -o 'vllm restart:.*' "$WORK/$step.log")"
done

# 9. A slab-file L1: SIGKILL while the slab's writes are in flight. The reference of step 1
#    holds: the bench's data depends only on the sequence.
mkdir -p "$WORK/slab"
l1_flags=(--gds-l1-path "$WORK/slab" --gds-l1-staging-gb 0.25)
slab() { # python expression over a = /status's gds_slab adapter
  python3 - "http://127.0.0.1:$http/status" "$1" <<'PY'
import json, sys, urllib.request
d = json.load(urllib.request.urlopen(sys.argv[1], timeout=5))
a = next(x for x in d["storage_manager"]["l2_adapters"] if x["type"] == "gds_slab")
print(eval(sys.argv[2], {"a": a}))
PY
}
for round in 1 2 3; do
  start "slab-kill$round" --l1-warm-restart
  held=$(slab 'a["keys"]')
  bench "slab-kill$round" "$N" allow-failure &
  b=$!
  # Kill once the slab has written a few of this round's chunks: the write-behind has more
  # of them in flight (a sequence stores 8 chunks at once).
  for _ in $(seq 3000); do
    [ "$(slab 'a["stored_keys"]')" -ge 2 ] && break
    sleep 0.02
  done
  stop KILL
  end_bench "$b"
  echo "restart: slab, SIGKILL mid-store round $round: the slab held $held chunks at its start"
done
start slab-final --l1-warm-restart
bench slab-final "$N"
if [ "$(digests slab-final warm)" != "$(cat "$WORK/ref")" ]; then
  echo "FAILED: slab digests after SIGKILLs mid-store differ"
  diff <(digests slab-final warm) "$WORK/ref" || true
  # What it takes to tell a wrong byte served from a bench artefact: both passes' lines of the
  # final bench, the slab's figures, and what each restart adopted or refused.
  grep -E "\[seq [0-9]+/(cold|warm)\]" "$WORK/slab-final.bench.log" | tail -40 || true
  slab 'a' || true
  for f in "$WORK"/slab-*.server.log; do
    echo "-- $f"; grep -iE "adopt|recover|corrupt|slab|checksum|warn|error" "$f" | tail -15 || true
  done
  exit 1
fi
bad=$(unexplained_mismatches "$WORK/slab-final.bench.log")
[ -z "$bad" ] || { echo "FAILED: a checksum mismatch (slab), sequences $bad"; exit 1; }
hits=$(cold_hits slab-final)
[ "$hits" -ge 1 ] || { echo "FAILED: nothing came back from the slab after the kills"; exit 1; }
echo "restart: slab L1 after 3 SIGKILLs mid-store: $hits of $N sequences hit fully on the cold lookup (slab: $(slab '"%d keys loaded, %d corrupt blobs" % (a["loaded_keys"], a["corrupt_blobs"])')), every retrieve byte-exact"
stop TERM
echo "restart: ok"
