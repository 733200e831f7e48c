#!/usr/bin/env bash
# The scripts never remove a path they did not make, whatever the environment names: a
# virtualenv path (LMCACHE_VENV, MOTO_VENV) that holds someone else's files is refused, loudly,
# and left exactly as it was.
# Usage: tests/scripts/never_touch.sh   (after scripts/test-services installed its tools)
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
check() { # name dir command...
  local name=$1 dir=$2; shift 2
  mkdir -p "$dir"
  echo "precious" > "$dir/their-file"
  if "$@" > "$WORK/$name.log" 2>&1; then
    echo "FAILED: $name accepted a directory it did not make"; cat "$WORK/$name.log"; exit 1
  fi
  grep -q "not made by this script" "$WORK/$name.log" \
    || { echo "FAILED: $name did not say why"; cat "$WORK/$name.log"; exit 1; }
  [ "$(cat "$dir/their-file")" = precious ] || { echo "FAILED: $name touched $dir"; exit 1; }
  echo "$name: refused $dir, left it as it was"
}
check lmcache-venv "$WORK/venv" env LMCACHE_VENV="$WORK/venv" ./scripts/lmcache-venv
check test-services "$WORK/moto" env MOTO_VENV="$WORK/moto" ./scripts/test-services start "$WORK/svc"
