"""scripts/free-port never hands a run the same port twice, even when bind(0) does."""
import importlib.machinery
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATH = os.path.join(ROOT, "scripts", "free-port")
loader = importlib.machinery.SourceFileLoader("free_port", PATH)
spec = importlib.util.spec_from_loader("free_port", loader)
fp = importlib.util.module_from_spec(spec)
loader.exec_module(fp)

# The OS offers the same port twice in a row, as it did to trace.sh: the second pick skips it.
offers = iter([5000, 5000, 5000, 5001])
used = set()
first = fp.pick(used, source=lambda: next(offers))
used.add(first)
second = fp.pick(used, source=lambda: next(offers))
assert (first, second) == (5000, 5001), (first, second)

# Through the command and its file: 50 ports in a row, all distinct.
with tempfile.TemporaryDirectory() as d:
    f = os.path.join(d, "ports")
    ports = [int(subprocess.check_output([sys.executable, PATH, f])) for _ in range(50)]
    assert len(set(ports)) == 50, ports
    assert sorted(map(int, open(f).read().split())) == sorted(ports)
print("free-port: ok (a port offered twice is handed out once)")

# Ports come from below the ephemeral range, where bind(0) of other processes never lands.
start = fp.ephemeral_start()
for _ in range(50):
    p = fp.bound_port()
    assert fp.LOW <= p < start, (p, start)
    assert fp.is_free(p)
busy = socket.socket()
busy.bind(("127.0.0.1", 0))
assert not fp.is_free(busy.getsockname()[1])
busy.close()
print(f"free-port: ok (ports in [{fp.LOW}, {start}), outside bind(0)'s range)")

# The interop scripts' free_port works after a `cd` (trace.sh asks for one inside the work
# directory): common.sh keeps the helper's absolute path.
with tempfile.TemporaryDirectory() as d:
    script = f"""
set -euo pipefail
cd {ROOT}
WORK={d}
eval "$(grep -E '^(FREE_PORT=|free_port\\(\\))' tests/interop/common.sh)"
cd /
a=$(free_port); b=$(free_port)
[ -n "$a" ] && [ -n "$b" ] && [ "$a" != "$b" ] && echo "$a $b"
"""
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert out.returncode == 0 and len(out.stdout.split()) == 2, (out.stdout, out.stderr)
print("free-port: ok after a cd too")
