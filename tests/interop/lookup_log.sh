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
    timeout 300 "$VENV/bin/lmcache" server --prometheus-port "$(free_port)" --host 127.0.0.1 --port "$port" --http-host 127.0.0.1 \
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
report() { # a simulate report, every section (Aggregate, Stats 1 to 7), up to its chart
  # (blank lines kept only between printed lines: what follows the report differs)
  awk '/^Simulation parameters:$/ {on = 1} /Traceback|LMCache ERROR|Stats plot saved/ {on = 0}
       on && NF {for (; blank > 0; blank--) print ""; print; next} on {blank++}'
}
is_png() { [ "$(head -c 8 "$1" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ]; }
table() { grep -E '^ +[0-9.]+ +[0-9.]+%$'; }
for logs in "$WORK/lmcache" "$WORK/gen"; do
  for cap in 0.05 0.2 1; do
    (cd "$WORK" && { "$VENV/bin/lmcache" tool cache-simulator simulate -i "$logs" --cache-capacity-gib "$cap" \
        --kv-bytes-per-chunk 33554432 -o x.png 2>&1 || true; }) | report > "$WORK/theirs.txt"
    "$BIN" tool cache-simulator simulate -i "$logs" --cache-capacity-gib "$cap" \
        --kv-bytes-per-chunk 33554432 -o "$WORK/ours.png" | report > "$WORK/ours.txt"
    grep -q "^Stat 5 — Evictions" "$WORK/ours.txt" || { echo "FAILED: our simulate printed no full report"; exit 1; }
    is_png "$WORK/ours.png" || { echo "FAILED: simulate wrote no PNG"; exit 1; }
    diff "$WORK/theirs.txt" "$WORK/ours.txt" \
      || { echo "FAILED: simulate $logs at $cap GiB differs from LMCache's"; exit 1; }
  done
  (cd "$WORK" && { "$VENV/bin/lmcache" tool cache-simulator sweep -i "$logs" --min-capacity-gib 0.03 \
      --max-capacity-gib 50 --points 30 --kv-bytes-per-chunk 33554432 -o y.png 2>&1 || true; }) | table > "$WORK/theirs.txt"
  "$BIN" tool cache-simulator sweep -i "$logs" --min-capacity-gib 0.03 --max-capacity-gib 50 \
      --points 30 --kv-bytes-per-chunk 33554432 -o "$WORK/sweep.png" 2>/dev/null | table > "$WORK/ours.txt"
  is_png "$WORK/sweep.png" || { echo "FAILED: sweep wrote no PNG"; exit 1; }
  [ "$(wc -l < "$WORK/ours.txt")" -eq 30 ] || { echo "FAILED: our sweep table"; cat "$WORK/ours.txt"; exit 1; }
  diff "$WORK/theirs.txt" "$WORK/ours.txt" || { echo "FAILED: sweep of $logs differs from LMCache's"; exit 1; }
done
echo "cache simulator: ours equals LMCache's on its logs (simulate's whole report, Stats 1-7, at 3 capacities; sweep of 30; a bench log and a generated 3000-request log) and draws both charts"
# Our policies and an L1 + L2 pair: the shipped policies' own code; an L2 never lowers the rate.
"$BIN" tool cache-simulator simulate -i "$WORK/gen" --cache-capacity-gib 0.5 --kv-bytes-per-chunk 33554432 \
    -o "$WORK/p.png" --eviction-policy S3FIFO --l2-capacity-gib 4 > "$WORK/tiers.txt"
grep -q "lmcache-rs L1 S3FIFO 0.50 GiB over L2 4.00 GiB (LRU)" "$WORK/tiers.txt" \
  || { echo "FAILED: no tier section"; cat "$WORK/tiers.txt"; exit 1; }
"$BIN" tool cache-simulator sweep -i "$WORK/gen" --min-capacity-gib 0.1 --max-capacity-gib 10 --points 5 \
    --kv-bytes-per-chunk 33554432 --compare-policies -o "$WORK/cmp.png" > "$WORK/cmp.txt" 2>/dev/null
[ "$(grep -cE '^ +[0-9.]+( +[0-9.]+%){4}$' "$WORK/cmp.txt")" -eq 5 ] \
  || { echo "FAILED: --compare-policies table"; cat "$WORK/cmp.txt"; exit 1; }
echo "cache simulator: lmcache-rs's LRU, ARC and S3FIFO and an L1 + L2 pair simulated ($(grep 'Token hit rate' "$WORK/tiers.txt" | tail -1 | tr -s ' '))"
