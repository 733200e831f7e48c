"""Checks one run of LMCache's `lmcache bench server` (its --format json output and its log):
the bench and the server exited 0, every request's checksum matched, every cold lookup missed
and every warm lookup was a full hit. With --warm-cold the sequences were stored before: every
cold lookup must hit fully (the bench then retrieves rather than stores, so it has no
checksums to compare) and no checksum may fail.

Usage: bench_check.py RESULT.json BENCH.log SEQUENCES BENCH_RC SERVER_RC [--warm-cold]
"""
import json, re, sys
path, log, n, rc, srv_rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
stored_before = "--warm-cold" in sys.argv[6:]
problems = []
if rc != 0: problems.append(f"bench exited {rc}")
if srv_rc != 0: problems.append(f"server exited {srv_rc} on SIGTERM")
text = open(log).read()
try:
    r = json.load(open(path))["metrics"]["results"]
    if r.get("total_requests") != n: problems.append(f"total_requests {r.get('total_requests')} != {n}")
    # A sequence stored before is retrieved, not stored, on its cold pass: no checksum pair.
    if not stored_before and r.get("checksum_ok") != n: problems.append(f"checksum_ok {r.get('checksum_ok')} != {n}")
    if r.get("checksum_fail") != 0: problems.append(f"checksum_fail {r.get('checksum_fail')}")
except Exception as e:
    problems.append(f"no result JSON: {e}")
cold_pattern = r"/cold\] LOOKUP: (\d+)/\1 chunks hit" if stored_before else r"/cold\] LOOKUP: 0/(\d+) chunks hit"
cold = len(re.findall(cold_pattern, text))
warm = [m for m in re.findall(r"/warm\] LOOKUP: (\d+)/(\d+) chunks hit", text)]
full = sum(1 for a, b in warm if a == b and a != "0")
if cold != n: problems.append(f"{cold} of {n} cold lookups " + ("hit fully" if stored_before else "missed fully"))
if full != n: problems.append(f"{full} of {n} warm lookups were full hits")
if problems:
    print("  " + "\n  ".join(problems))
    sys.exit(1)
