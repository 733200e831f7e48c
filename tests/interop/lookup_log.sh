#!/usr/bin/env bash
# Interop: lookup-hash logs. LMCache 0.5.6's server and `lmcache-rs server`, each with
# --lookup-hash-log-dir, serve the same `lmcache bench server` run; then
#   1. every line of ours equals LMCache's line for the same request (fields, seq_len, dtypes,
#      shapes, chunk hashes), and the file names follow its pattern;
#   2. LMCache's own `lmcache tool cache-simulator simulate` reads our files and reports the
#      same aggregate numbers as on LMCache's files;
#   3. `lmcache-rs tool cache-simulator simulate|sweep` on LMCache's logs prints LMCache's own
#      report sections and sweep table.
# Usage: tests/interop/lookup_log.sh PATH/TO/lmcache-rs
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:?usage: lookup_log.sh PATH/TO/lmcache-rs}
# shellcheck source=tests/interop/common.sh
. tests/interop/common.sh
for kind in lmcache lmcache-rs; do
  port=$(free_port); http=$(free_port)
  mkdir -p "$WORK/$kind"
  if [ "$kind" = lmcache-rs ]; then
    "$BIN" server --host 127.0.0.1 --port "$port" --http-port "$http" --l1-size-gb 1 \
        --shm-name "lmcache_rs_lhl_$$" --max-workers 2 --exit-after-seconds 300 \
        --lookup-hash-log-dir "$WORK/$kind" > "$WORK/$kind.server.log" 2>&1 &
  else
    timeout 300 "$VENV/bin/lmcache" server --host 127.0.0.1 --port "$port" --http-host 127.0.0.1 \
        --http-port "$http" --l1-size-gb 1 --eviction-policy LRU --supported-transfer-mode auto \
        --shm-name "lmc_lhl_$$" --lookup-hash-log-dir "$WORK/$kind" > "$WORK/$kind.server.log" 2>&1 &
  fi
  pids+=($!)
  bench_then_stop "$port" "$http" 6 "$WORK/$kind"
done
"$VENV/bin/python" - "$WORK/lmcache" "$WORK/lmcache-rs" <<'PY'
import glob, json, os, re, sys
theirs_dir, ours_dir = sys.argv[1], sys.argv[2]
def load(d):
    files = sorted(glob.glob(os.path.join(d, "*")))
    assert files, f"no files in {d}"
    for f in files:
        assert re.fullmatch(r"lookup_hashes_\d{8}_\d{6}_\d{6}\.jsonl", os.path.basename(f)), f
    lines = [json.loads(l) for f in files for l in open(f)]
    return {l["request_id"]: l for l in lines}
theirs, ours = load(theirs_dir), load(ours_dir)
assert set(ours) == set(theirs), (sorted(ours), sorted(theirs))
for rid, t in theirs.items():
    o = ours[rid]
    assert list(o) == list(t), f"fields {list(o)} != {list(t)}"
    for k in ("model_name", "chunk_size", "seq_len", "dtypes", "shapes", "chunk_hashes"):
        assert o[k] == t[k], f"{rid} {k}: ours {o[k]!r} theirs {t[k]!r}"
print(f"lookup-hash log: {len(ours)} lines equal LMCache's, field for field")
PY
# Its report comes before its plot, which needs matplotlib (not installed with LMCache): the
# exit status is its plot's, so the report's lines are what is checked. The bytes per chunk are
# given because it cannot parse the dtype spelling its own server writes ("torch.float16").
sim() {
  (cd "$WORK" && { "$VENV/bin/lmcache" tool cache-simulator simulate -i "$1" --cache-capacity-gib 0.2 \
      --kv-bytes-per-chunk 33554432 -o "$1.png" 2>&1 || true; } \
      | grep -E "Requests processed|Total tokens|Hit tokens|Token hit rate|Cache occupancy")
}
sim "$WORK/lmcache" > "$WORK/sim-lmcache.txt"
sim "$WORK/lmcache-rs" > "$WORK/sim-lmcache-rs.txt"
if ! diff "$WORK/sim-lmcache.txt" "$WORK/sim-lmcache-rs.txt"; then
  echo "FAILED: LMCache's simulator reports differently on our log"; exit 1
fi
[ "$(wc -l < "$WORK/sim-lmcache-rs.txt")" -eq 5 ] || { echo "FAILED: simulator report incomplete"; cat "$WORK/sim-lmcache-rs.txt"; exit 1; }
echo "lookup-hash log: LMCache's cache-simulator reads ours: $(grep 'Token hit rate' "$WORK/sim-lmcache-rs.txt" | tr -s ' '), as on its own"

# 3. Our simulator on LMCache's own logs (a larger, generated one too) gives LMCache's report,
#    section for section, and its sweep table row for row.
"$VENV/bin/python" tests/interop/gen_lookup_log.py "$WORK/gen" 3000
report() { # the lines of a simulate report's first three sections (Aggregate, Stat 1, Stat 2)
  awk '/^Aggregate$/ {on = 1} /^(Stat [3-9]|Traceback)/ {on = 0} on && (/^  / || /^(Aggregate|Stat)/)'
}
table() { grep -E '^ +[0-9.]+ +[0-9.]+%$'; }
for logs in "$WORK/lmcache" "$WORK/gen"; do
  for cap in 0.05 0.2 1; do
    (cd "$WORK" && { "$VENV/bin/lmcache" tool cache-simulator simulate -i "$logs" --cache-capacity-gib "$cap" \
        --kv-bytes-per-chunk 33554432 -o x.png 2>&1 || true; }) | report > "$WORK/theirs.txt"
    "$BIN" tool cache-simulator simulate -i "$logs" --cache-capacity-gib "$cap" \
        --kv-bytes-per-chunk 33554432 | report > "$WORK/ours.txt"
    [ -s "$WORK/ours.txt" ] || { echo "FAILED: our simulate printed no report"; exit 1; }
    diff "$WORK/theirs.txt" "$WORK/ours.txt" \
      || { echo "FAILED: simulate $logs at $cap GiB differs from LMCache's"; exit 1; }
  done
  (cd "$WORK" && { "$VENV/bin/lmcache" tool cache-simulator sweep -i "$logs" --min-capacity-gib 0.03 \
      --max-capacity-gib 50 --points 30 --kv-bytes-per-chunk 33554432 -o y.png 2>&1 || true; }) | table > "$WORK/theirs.txt"
  "$BIN" tool cache-simulator sweep -i "$logs" --min-capacity-gib 0.03 --max-capacity-gib 50 \
      --points 30 --kv-bytes-per-chunk 33554432 2>/dev/null | table > "$WORK/ours.txt"
  [ "$(wc -l < "$WORK/ours.txt")" -eq 30 ] || { echo "FAILED: our sweep table"; cat "$WORK/ours.txt"; exit 1; }
  diff "$WORK/theirs.txt" "$WORK/ours.txt" || { echo "FAILED: sweep of $logs differs from LMCache's"; exit 1; }
done
echo "cache simulator: ours equals LMCache's on its logs (simulate at 3 capacities, sweep of 30, on a bench log and a generated 3000-request log)"
