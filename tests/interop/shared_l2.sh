#!/usr/bin/env bash
# Interop: two lmcache-rs servers share one L2, driven by LMCache 0.5.6's own
# `lmcache bench server` at its default model shape (a 256-token chunk is 32 MiB):
#   1. the bench stores 4 requests of 1024 tokens (16 chunks, 512 MiB) through server A;
#   2. once A reports all 16 written to L2, the same bench runs against server B, which never
#      saw the stores: every cold lookup must be a full hit (loaded from L2 and verified against
#      the blob checksums), every retrieve must succeed, B must count the tokens as L2 hits, and
#      B's adapter must still be healthy. (The bench checksums only what its cold run stored,
#      and B's cold run stores nothing; byte equality across two servers at 32 MiB is checked
#      for every adapter by crates/lmcache-storage/tests/shared.rs.)
# Backends: Redis, a directory both servers use (fs) and S3 (moto), from scripts/test-services.
# Usage: tests/interop/shared_l2.sh PATH/TO/lmcache-rs   (needs LMCACHE_RS_TEST_REDIS and
#        LMCACHE_RS_TEST_S3; fails if they are missing)
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:?usage: shared_l2.sh PATH/TO/lmcache-rs}
: "${LMCACHE_RS_TEST_REDIS:?start scripts/test-services first}"
: "${LMCACHE_RS_TEST_S3:?start scripts/test-services first}"
VENV=$(./scripts/lmcache-venv)
REQS=${SHARED_L2_REQUESTS:-4}
TOKENS=${SHARED_L2_TOKENS:-1024}
CHUNKS=$((REQS * TOKENS / 256))
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1 PYTHONWARNINGS=ignore
WORK=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait 2>/dev/null; [ -n "${KEEP_WORK:-}" ] || rm -rf "$WORK"' EXIT

FREE_PORT="$PWD/scripts/free-port"  # absolute: some calls run after a `cd`
free_port() { "$FREE_PORT" "$WORK/.ports"; }
metric() { # http-url name: the sum of a metric's samples
  python3 - "$1" "$2" <<'PY'
import re, sys, urllib.request
text = urllib.request.urlopen(f"{sys.argv[1]}/metrics", timeout=5).read().decode()
print(int(sum(float(m.group(1)) for m in re.finditer(rf"^{sys.argv[2]}(?:{{[^}}]*}})? (\S+)$", text, re.M))))
PY
}
start_server() { # name spec -> sets $port and $http (not in a subshell: $pids must see it)
  local name=$1 spec=$2
  port=$(free_port); http=$(free_port)
  # --exit-after-seconds: the server stops by itself even if this script is killed.
  "$BIN" server --host 127.0.0.1 --port "$port" --http-port "$http" --l1-size-gb 1 \
      --shm-name "lmcache_rs_shared_$$_$name" --max-workers 2 --log-level info \
      --exit-after-seconds 900 --l2-adapter "$spec" > "$WORK/$name.server.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$http/healthcheck', timeout=1)" 2>/dev/null && break
    sleep 0.1
  done
}
bench() { # port http output
  timeout 600 "$VENV/bin/lmcache" bench server --rpc-url "tcp://127.0.0.1:$1" \
      --url "http://127.0.0.1:$2" --mode cpu --transfer-mode lmcache_driven \
      --num-tokens "$TOKENS" --start 0 --end "$REQS" --interval 0 --format json \
      --output "$WORK/$3.json" > "$WORK/$3.log" 2>&1
}

passed=0; failed=0
tag="shared-$$-$(date +%s)"
CASES=(
  "redis {\"type\": \"redis\", \"host\": \"${LMCACHE_RS_TEST_REDIS%:*}\", \"port\": ${LMCACHE_RS_TEST_REDIS##*:}, \"key_prefix\": \"$tag\"}"
  "fs {\"type\": \"fs\", \"base_path\": \"$WORK/shared-fs\"}"
  "s3 {\"type\": \"s3\", \"endpoint_url\": \"$LMCACHE_RS_TEST_S3\", \"bucket\": \"lmcache-rs-test\", \"aws_access_key_id\": \"test\", \"aws_secret_access_key\": \"test\", \"s3_prefix\": \"$tag\"}"
)
for case in "${CASES[@]}"; do
  kind=${case%% *}; spec=${case#* }
  [ -n "${SHARED_L2_ONLY:-}" ] && [ "$kind" != "$SHARED_L2_ONLY" ] && continue
  rc=0
  start_server "$kind-a" "$spec"; pa=$port; ha=$http
  start_server "$kind-b" "$spec"; pb=$port; hb=$http
  bench "$pa" "$ha" "$kind-a" || rc=$?
  # Wait for A's write-behind to put every chunk in L2.
  for _ in $(seq 600); do
    [ "$(metric "http://127.0.0.1:$ha" lmcache_mp_l2_store_completed_objects_total)" -ge "$CHUNKS" ] && break
    sleep 0.1
  done
  bench "$pb" "$hb" "$kind-b" || rc=$?
  healthy=$(metric "http://127.0.0.1:$hb" lmcache_rs_l2_healthy)
  from_l2=$(metric "http://127.0.0.1:$hb" lmcache_mp_lookup_hit_l2_tokens_total)
  if [ "$rc" -eq 0 ] && python3 - "$WORK/$kind-a.json" "$WORK/$kind-b.json" "$WORK/$kind-b.log" \
      "$REQS" "$healthy" "$from_l2" "$((REQS * TOKENS))" <<'PY'
import json, re, sys
a, b, blog, reqs, healthy, from_l2, tokens = sys.argv[1:]
reqs = int(reqs)
r = json.load(open(a))["metrics"]["results"]
assert r.get("checksum_ok") == reqs and r.get("checksum_fail") == 0, ("A", r)
r = json.load(open(b))["metrics"]["results"]
assert r.get("checksum_fail") == 0, ("B", r)
log = open(blog).read()
assert "FAIL" not in log.replace("checksum_fail", ""), "B's bench reported a failure"
cold = re.findall(r"/cold\] LOOKUP: (\d+)/(\d+) chunks hit", log)
assert len(cold) == reqs and all(x == y and x != "0" for x, y in cold), f"B's cold lookups: {cold}"
assert healthy == "1", f"B's adapter is not healthy ({healthy})"
assert int(from_l2) >= int(tokens) - reqs, f"B counted {from_l2} hit tokens from L2"
PY
  then
    echo "interop shared L2 $kind: ok ($REQS x $TOKENS tokens at 32 MiB a chunk stored through A, checksums match; all $CHUNKS chunks served by B from L2)"
    passed=$((passed + 1))
  else
    echo "interop shared L2 $kind: FAILED"
    tail -8 "$WORK/$kind-b.log" | sed 's/^/    B bench: /'
    { grep -iE "warn|error" "$WORK/$kind-b.server.log" || true; } | tail -5 | sed 's/^/    B server: /'
    failed=$((failed + 1))
  fi
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait "${pids[@]}" 2>/dev/null || true
  pids=()
done
echo "interop shared L2: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
