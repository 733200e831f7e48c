"""The coordinator's fleet page in a real browser (Debian's headless Chromium over WebDriver).

Against `lmcache-rs coordinator` with two `lmcache-rs server`s reporting to it while LMCache's
`lmcache bench server` stores into one: the page lists both servers alive with their L1 use
and directory keys, the directory's size and the event streams; once still, every figure
equals /instances, /instances/usage, /directory/stats and /metrics read at the same moment;
nothing is fetched from elsewhere, no console error, it fits a laptop screen; screenshots saved.

Usage: python fleet_page.py URL BENCH_PID SCREENSHOT_DIR
"""
import os
import sys
import time

from selenium.webdriver.common.by import By

from browser import alive, checks_common, chromium, compare, figures, get, next_poll, prom

url, bench_pid, shots = sys.argv[1], int(sys.argv[2]), sys.argv[3]


driver = chromium()
problems = []
try:
    driver.get(url + "/")
    deadline = time.time() + 20
    while driver.execute_script("return window.lmcacheSnapshot") is None:
        assert time.time() < deadline, "the fleet page showed nothing"
        time.sleep(0.2)
    # Under load: keys arrive.
    while float(figures(driver).get("num_keys") or 0) == 0 and alive(bench_pid):
        time.sleep(0.5)
    time.sleep(6)
    driver.save_screenshot(os.path.join(shots, "fleet-under-load.png"))
    while alive(bench_pid):
        time.sleep(0.5)

    # Still: the directory stops changing (events flush every 0.2 s), then the page polls.
    last = None
    for _ in range(30):
        cur = get(url + "/directory/stats")
        for s in cur.get("streams", []):
            s.pop("seconds_since_last_batch", None)
        if cur == last:
            break
        last = cur
        time.sleep(1)
    next_poll(driver)
    page = figures(driver)
    stats, inst = get(url + "/directory/stats"), get(url + "/instances")
    usage, m = get(url + "/instances/usage"), prom(get(url + "/metrics", text=True))
    want = {k: stats[k] for k in ["num_keys", "l1_count", "l2_count", "l1_size_bytes", "l2_size_bytes"]}
    want["instances"] = len(inst["instances"])
    want["alive"] = len(inst["instances"])
    want["event_entries_total"] = m.get("lmcache_rs_coordinator_event_entries_total", 0)
    want["missing_batches_total"] = m.get("lmcache_rs_coordinator_missing_batches_total", 0)
    for i in inst["instances"]:
        iid = i["instance_id"]
        want[f"inst:{iid}:keys"] = stats["l1_keys_by_instance"].get(iid, 0)
        l1 = [mod for u in usage["instances"] if u["instance_id"] == iid for mod in u["modules"] if mod["tier"] == "l1"]
        want[f"inst:{iid}:l1_used"] = l1[0]["used_bytes"] if l1 else None
    if want["instances"] != 2 or want["num_keys"] == 0:
        problems.append(f"the fleet is not what the test built: {want}")
    compare(page, want, problems)
    servers = driver.find_element(By.ID, "servers").text
    for name in ["server-a", "server-b"]:
        if name not in servers:
            problems.append(f"{name} is not listed: {servers!r}")
    if not driver.find_elements(By.CSS_SELECTOR, "#c-keys polyline"):
        problems.append("the directory chart drew no line")
    driver.save_screenshot(os.path.join(shots, "fleet-still.png"))
    checks_common(driver, url, shots, "fleet", problems)
    print(f"fleet page: {len(want)} figures equal the coordinator's routes; screenshots in {shots}")
finally:
    driver.quit()
if problems:
    print("FAILED:\n  " + "\n  ".join(problems))
    sys.exit(1)
