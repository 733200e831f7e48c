#!/usr/bin/env bash
# Interop: trace files (.lct), both levels, both directions. LMCache 0.5.6's server and
# `lmcache-rs server` each record a storage-level and an events-level trace of the same
# `lmcache bench server` run; then
#   1. `lmcache-rs trace info` prints LMCache's `lmcache trace info` report byte for byte, on
#      LMCache's files and on ours (so LMCache's reader reads ours);
#   2. `lmcache-rs trace replay` replays LMCache's storage trace (every record, none failed,
#      cold requests miss and warm ones hit: 50 %), and LMCache's `lmcache trace replay`
#      replays ours with the same per-call counts as its own and no errors;
#   3. `trace replay-events` (ours and LMCache's) delivers both servers' event streams to a
#      coordinator (ours and LMCache's): every batch applied, and each coordinator's directory
#      ends with the same keys and placements whichever tool delivered them. The stop marks
#      are cut (as a crash would), so the coordinator keeps what it learned.
# Usage: tests/interop/trace.sh PATH/TO/lmcache-rs
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:?usage: trace.sh PATH/TO/lmcache-rs}
# shellcheck source=tests/interop/common.sh
. tests/interop/common.sh

for kind in lmcache lmcache-rs; do
  for level in storage events; do
    port=$(free_port); http=$(free_port)
    out="$WORK/$kind-$level.lct"
    if [ "$kind" = lmcache-rs ]; then
      "$BIN" server --host 127.0.0.1 --port "$port" --http-port "$http" --l1-size-gb 1 \
          --shm-name "lmcache_rs_tr_$$" --exit-after-seconds 300 \
          --trace-level "$level" --trace-output "$out" > "$WORK/$kind-$level.server.log" 2>&1 &
    else
      timeout 300 "$VENV/bin/lmcache" server --prometheus-port "$(free_port)" --host 127.0.0.1 --port "$port" --http-host 127.0.0.1 \
          --http-port "$http" --l1-size-gb 1 --eviction-policy LRU --supported-transfer-mode auto \
          --shm-name "lmc_tr_$$" --trace-level "$level" --trace-output "$out" \
          > "$WORK/$kind-$level.server.log" 2>&1 &
    fi
    pids+=($!)
    # LMCache's warm lookups hit only once its acknowledged stores became visible: a 2 s
    # settle between cold and warm makes its run (and so its trace) deterministic. Ours
    # needs none: a store is visible when acknowledged.
    settle=0
    [ "$kind" = lmcache ] && settle=2
    bench_then_stop "$port" "$http" 3 "$WORK/$kind-$level" "$settle"
    [ -s "$out" ] || { echo "FAILED: $kind wrote no $level trace"; tail -20 "$WORK/$kind-$level.server.log"; exit 1; }
  done
done

# 1. trace info, line for line.
for f in "$WORK"/*.lct; do
  "$VENV/bin/lmcache" trace info "$f" 2>/dev/null > "$WORK/info-theirs.txt" \
    || { echo "FAILED: LMCache's trace info cannot read $f"; exit 1; }
  "$BIN" trace info "$f" > "$WORK/info-ours.txt"
  grep -q "total_records" "$WORK/info-theirs.txt" || { echo "FAILED: no report for $f"; exit 1; }
  diff "$WORK/info-theirs.txt" "$WORK/info-ours.txt" \
    || { echo "FAILED: trace info of $(basename "$f") differs from LMCache's"; exit 1; }
done
# Ours record the calls LMCache's do (the same kinds, its warm lookups hitting after the
# settle; LMCache's counts still vary: it sometimes reserves a store twice), one per call of the
# 3 cold and 3 warm requests.
ops() { grep -E '^    (lmcache|events)\.' | sed 's/^ *//'; }
"$BIN" trace info "$WORK/lmcache-storage.lct" | ops > "$WORK/ops-theirs.txt"
"$BIN" trace info "$WORK/lmcache-rs-storage.lct" | ops > "$WORK/ops-ours.txt"
diff <(sed 's/: .*//' "$WORK/ops-theirs.txt") <(sed 's/: .*//' "$WORK/ops-ours.txt") \
  || { echo "FAILED: our storage trace records other calls than LMCache's"; exit 1; }
sm=lmcache.v1.distributed.storage_manager.StorageManager
printf '%s\n' "$sm.finish_read_prefetched: 3" "$sm.finish_write: 3" "$sm.reserve_write: 3" \
    "$sm.submit_prefetch_task: 6" | diff - "$WORK/ops-ours.txt" \
  || { echo "FAILED: our storage trace does not hold one record per call"; exit 1; }
# ... and our event stream has every kind of batch LMCache's has (access, store; ours adds config).
kinds() { awk '/batches \(type/ {on = 1; next} /^    [a-z]/ {on = 0} on {sub(/:.*/, ""); gsub(/ /, ""); print}' | sort; }
"$BIN" trace info "$WORK/lmcache-events.lct" | kinds > "$WORK/kinds-theirs.txt"
"$BIN" trace info "$WORK/lmcache-rs-events.lct" | kinds > "$WORK/kinds-ours.txt"
[ -s "$WORK/kinds-theirs.txt" ] || { echo "FAILED: no batch kinds in LMCache's events trace"; exit 1; }
missing=$(comm -23 "$WORK/kinds-theirs.txt" "$WORK/kinds-ours.txt")
[ -z "$missing" ] || { echo "FAILED: our events trace lacks LMCache's batch kinds: $missing"; exit 1; }
echo "trace info: ours prints LMCache's report on all four files; our storage trace holds LMCache's calls ($(tr '\n' ' ' < "$WORK/ops-ours.txt" | sed 's/lmcache.v1.distributed.storage_manager.StorageManager.//g'))"

# 2. Storage replay, both ways.
for kind in lmcache lmcache-rs; do
  "$BIN" trace replay "$WORK/$kind-storage.lct" --l1-size-gb 1 --speed 0 --format json --no-csv \
      --output-dir "$WORK/rep" > "$WORK/replay-$kind.json"
  "$BIN" trace info "$WORK/$kind-storage.lct" --format json > "$WORK/info-$kind.json"
done
"$VENV/bin/python" - "$WORK" <<'PY'
import json, sys
work = sys.argv[1]
for kind in ("lmcache", "lmcache-rs"):
    d = json.load(open(f"{work}/replay-{kind}.json"))
    info = json.load(open(f"{work}/info-{kind}.json"))
    r, s = d["records"], d["storage"]
    # Every record replayed, none failed; every lock the recording released was held here
    # (wherever the recorded lookup hit, the replayed one did).
    assert r == {"replayed": info["total_records"], "skipped": 0, "failed": 0}, (kind, r)
    submits = info["ops"]["lmcache.v1.distributed.storage_manager.StorageManager.submit_prefetch_task"]
    assert s["lookups"] == submits and s["locks_not_held"] == 0, (kind, s)
    assert 0 < s["hit_rate"] < 1, (kind, s)
    print(f"trace replay: ours replays {kind}'s storage trace: {r['replayed']} records, hit rate {s['hit_rate']:.0%}, every released lock held")
# Ours is deterministic: 3 cold requests that miss, 3 warm ones that hit, 4 chunks each.
s = json.load(open(f"{work}/replay-lmcache-rs.json"))["storage"]
assert (s["lookup_chunks"], s["l1_hit_chunks"], s["committed"], s["locks_released"]) == (24, 12, 12, 12), s
PY
for kind in lmcache lmcache-rs; do
  (cd "$WORK" && timeout 120 "$VENV/bin/lmcache" trace replay "$kind-storage.lct" --prometheus-port "$(free_port)" --l1-size-gb 1 \
      --eviction-policy LRU --output-dir "lrep-$kind" --json > "lrep-$kind.log" 2>&1) \
    || { echo "FAILED: LMCache's trace replay of the $kind trace"; tail -20 "$WORK/lrep-$kind.log"; exit 1; }
done
"$VENV/bin/python" - "$WORK" <<'PY'
import json, sys
work = sys.argv[1]
for kind in ("lmcache", "lmcache-rs"):
    replayed = json.load(open(f"{work}/lrep-{kind}/trace_replay_summary.json"))["ops"]
    recorded = json.load(open(f"{work}/info-{kind}.json"))["ops"]
    got = {q: v["count"] for q, v in replayed.items()}
    assert got == recorded, (kind, got, recorded)
    assert all(v["errors"] == 0 for v in replayed.values()), (kind, replayed)
print(f"trace replay: LMCache's replays ours as it replays its own: every call ({sum(recorded.values())}), no errors")
PY

# 3. Events replay: two servers' streams, stop marks cut, into each coordinator by each tool.
"$VENV/bin/python" - "$WORK" <<'PY'
import struct, sys, msgspec
work = sys.argv[1]
for kind in ("lmcache", "lmcache-rs"):
    data = open(f"{work}/{kind}-events.lct", "rb").read()
    out, off, cut = bytearray(), 0, 0
    while off < len(data):
        (n,) = struct.unpack(">I", data[off:off + 4])
        body = data[off + 4:off + 4 + n]
        frame = msgspec.msgpack.decode(body)
        if frame.get("qualname") == "events.lifecycle" and frame["args"].get("phase") == "stop":
            cut += 1
        else:
            out += data[off:off + 4 + n]
        off += 4 + n
    assert cut == 1, (kind, cut)
    open(f"{work}/{kind}-events-cut.lct", "wb").write(out)
PY
cport=$(free_port)
for coord in lmcache-rs lmcache; do
  for tool in lmcache-rs lmcache; do
    if [ "$coord" = lmcache-rs ]; then
      "$BIN" coordinator --host 127.0.0.1 --port "$cport" > "$WORK/coord.log" 2>&1 &
    else
      timeout 120 "$VENV/bin/lmcache" coordinator --host 127.0.0.1 --port "$cport" > "$WORK/coord.log" 2>&1 &
    fi
    cpid=$!; pids+=($cpid)
    wait_http "http://127.0.0.1:$cport/healthz" "$WORK/coord.log"
    files=("$WORK/lmcache-events-cut.lct" "$WORK/lmcache-rs-events-cut.lct")
    if [ "$tool" = lmcache-rs ]; then
      "$BIN" trace replay-events "${files[@]}" --coordinator-url "http://127.0.0.1:$cport" \
          --heartbeat-interval 1 --format json > "$WORK/rev.json" 2>"$WORK/rev.log" \
        || { echo "FAILED: our replay-events into $coord"; tail "$WORK/rev.log"; exit 1; }
      "$VENV/bin/python" -c "
import json; d = json.load(open('$WORK/rev.json'))
assert d['batches'] > 0 and d['applied'] == d['batches'] and d['starts'] == 2 and d['ended'] == 2, d"
    else
      timeout 120 "$VENV/bin/lmcache" trace replay-events "${files[@]}" \
          --coordinator-url "http://127.0.0.1:$cport" --heartbeat-interval 1 > "$WORK/rev.log" 2>&1 \
        || { echo "FAILED: LMCache's replay-events into $coord"; tail "$WORK/rev.log"; exit 1; }
    fi
    curl -s "http://127.0.0.1:$cport/directory/stats" > "$WORK/stats-$coord-$tool.json"
    kill -TERM "$cpid"; wait "$cpid" 2>/dev/null || true
  done
done
"$VENV/bin/python" - "$WORK" <<'PY'
import json, sys
work = sys.argv[1]
pick = lambda d: (d["num_keys"], d["num_placements"], d["l1_count"], d["l1_size_bytes"])
got = {(c, t): pick(json.load(open(f"{work}/stats-{c}-{t}.json")))
       for c in ("lmcache-rs", "lmcache") for t in ("lmcache-rs", "lmcache")}
for c in ("lmcache-rs", "lmcache"):
    assert got[(c, "lmcache-rs")] == got[(c, "lmcache")], (c, got)
# Both servers stored the same 12 chunks (same bench, same tokens): 12 keys, 24 placements.
assert got[("lmcache-rs", "lmcache-rs")][:3] == (12, 24, 24), got
assert got[("lmcache", "lmcache-rs")][:3] == (12, 24, 24), got
print(f"trace replay-events: both tools deliver both servers' streams to both coordinators alike: keys, placements, L1 count, bytes = {got[('lmcache-rs', 'lmcache-rs')]}")
PY
