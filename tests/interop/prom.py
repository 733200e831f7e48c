"""A server's Prometheus metrics, as the interop scripts read them."""
import re
import urllib.request


def metric(http, name):
    """The sum over every label set of metric `name` at `http`/metrics; 0 when it has none."""
    text = urllib.request.urlopen(f"{http}/metrics", timeout=10).read().decode()
    series = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return sum(float(v) for v in series)
