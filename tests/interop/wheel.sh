#!/usr/bin/env bash
# The PyPI wheel: scripts/build-wheel builds it (auditwheel-checked), it installs with pip into
# a fresh virtualenv with nothing else in it, puts `lmcache-rs` on that virtualenv's PATH with
# the same version `pip show` reports, needs nothing beyond glibc, and the server it starts
# passes LMCache 0.5.6's `lmcache bench server` (every warm lookup a hit, checksums right).
# Usage: tests/interop/wheel.sh [--profile dev|release]   (CI: dev, the unoptimised build)
set -euo pipefail
cd "$(dirname "$0")/../.."
profile=dev
[ "${1:-}" = --profile ] && profile=${2:?--profile needs a name}
# shellcheck source=tests/interop/common.sh
. tests/interop/common.sh

wheel=$(scripts/build-wheel --profile "$profile" --out "$WORK/dist")
case "$(basename "$wheel")" in
  lmcache_rs-*-py3-none-manylinux_*_x86_64.whl) ;;
  *) echo "FAILED: unexpected wheel name $wheel"; exit 1 ;;
esac

python3 -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q --no-index "$wheel"
bin="$WORK/venv/bin/lmcache-rs"
[ -x "$bin" ] || { echo "FAILED: pip install put no lmcache-rs in the virtualenv's bin/"; exit 1; }
# On PATH once the virtualenv is active, as in vLLM's.
# shellcheck disable=SC1091
found=$(. "$WORK/venv/bin/activate" && command -v lmcache-rs)
[ "$found" = "$bin" ] || { echo "FAILED: lmcache-rs on PATH is $found, not $bin"; exit 1; }

pip_version=$("$WORK/venv/bin/pip" show lmcache-rs | sed -n 's/^Version: //p')
bin_version=$("$bin" --version | awk '{print $2}')
[ -n "$pip_version" ] && [ "$pip_version" = "$bin_version" ] \
  || { echo "FAILED: pip show says '$pip_version', lmcache-rs --version says '$bin_version'"; exit 1; }

# Nothing beyond glibc and libgcc_s: libstdc++ (libzmq's runtime) is linked in.
if ldd "$bin" | grep -v -E 'linux-vdso|ld-linux|libc\.so|libm\.so|libgcc_s\.so|libpthread|libdl\.so|librt\.so' | grep -q '=>'; then
  echo "FAILED: the wheel's binary links more than glibc:"; ldd "$bin"; exit 1
fi

port=$(free_port); http=$(free_port)
"$bin" server --host 127.0.0.1 --port "$port" --http-port "$http" --l1-size-gb 2 \
    --shm-name "lmcache_rs_wheel_$$" --max-workers 2 --exit-after-seconds 300 \
    > "$WORK/server.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$http/healthcheck" "$WORK/server.log"
N=8
rc=0
timeout 300 "$VENV/bin/lmcache" bench server --rpc-url "tcp://127.0.0.1:$port" \
    --url "http://127.0.0.1:$http" --mode cpu --transfer-mode lmcache_driven --num-tokens 1024 \
    --start 0 --end "$N" --interval 0 --format json --output "$WORK/bench.json" \
    > "$WORK/bench.log" 2>&1 || rc=$?
"$VENV/bin/python" - "$WORK/bench.json" "$WORK/bench.log" "$N" "$rc" <<'PY'
import json, re, sys
path, log, n, rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
assert rc == 0, f"bench exited {rc}: {open(log).read()[-2000:]}"
r = json.load(open(path))["metrics"]["results"]
assert r.get("total_requests") == n and r.get("checksum_ok") == n and r.get("checksum_fail") == 0, r
text = open(log).read()
warm = re.findall(r"/warm\] LOOKUP: (\d+)/(\d+) chunks hit", text)
assert len(warm) == n and all(a == b != "0" for a, b in warm), warm
PY
echo "wheel: ok ($(basename "$wheel"), version $pip_version; LMCache's bench: $N warm full hits, checksums match)"
