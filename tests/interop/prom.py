"""A server's Prometheus metrics, as the interop scripts read them."""
import re
import urllib.request


def metrics(http, *names):
    """For each metric in `names`, the sum over its label sets (0 when it has none), all from
    one read of `http`/metrics."""
    text = urllib.request.urlopen(f"{http}/metrics", timeout=10).read().decode()
    def total(name):
        series = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        return sum(float(v) for v in series)
    return tuple(total(name) for name in names)


def metric(http, name):
    """The sum over every label set of metric `name` at `http`/metrics; 0 when it has none."""
    (value,) = metrics(http, name)
    return value
