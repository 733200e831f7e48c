"""The status page in a real browser (Debian's headless Chromium, driven over WebDriver).

Against `lmcache-rs server` started with --http-auth-token, an fs L2 and a tenant quota, while
LMCache's `lmcache bench server` runs:
  1. the page asks for the token (nothing is shown without it), then shows live figures;
  2. it loads nothing from elsewhere and logs no error in the console;
  3. it fits a laptop screen (1366x768: no horizontal scroll);
  4. once the bench is over and the server still, every figure on the page equals /status and
     /metrics read at the same moment;
  5. screenshots (under load, and still) are saved for a person to look at.

Usage: python status_page.py URL TOKEN BENCH_PID SCREENSHOT_DIR
"""
import json
import os
import sys
import time

from selenium.webdriver.common.by import By

from browser import alive, checks_common, chromium, compare, figures, next_poll, prom
from browser import get as http_get

url, token, bench_pid, shots = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]


def get(path, text=False):
    return http_get(url + path, token, text)


driver = chromium()
problems = []
try:
    driver.set_page_load_timeout(30)
    driver.get(url + "/")
    # 1. Without the token: the form, and no figures.
    deadline = time.time() + 15
    auth = driver.find_element(By.ID, "auth")
    while not auth.is_displayed():
        assert time.time() < deadline, "the page never asked for the token"
        time.sleep(0.2)
    assert driver.execute_script("return window.lmcacheSnapshot") is None, "figures shown without the token"
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "#auth button").click()
    while driver.execute_script("return window.lmcacheSnapshot") is None:
        assert time.time() < deadline + 15, "no figures after the token was given"
        time.sleep(0.2)

    # Under load: the charts move. A screenshot mid-bench, once requests flow.
    figure = "return (document.querySelector('[data-k=lookups_total]').dataset.v || '0')"
    while float(driver.execute_script(figure)) < 4 and alive(bench_pid):
        time.sleep(0.5)
    time.sleep(8)
    driver.save_screenshot(os.path.join(shots, "status-under-load.png"))
    engines = driver.find_element(By.ID, "engines").text
    if "test-model" not in engines:
        problems.append(f"the bench's engine is not listed while it runs: {engines!r}")
    while alive(bench_pid):
        time.sleep(0.5)


    # 4. Still: wait until /status and /metrics stop changing, then for the page's next poll.
    def state():
        st, m = get("/status"), prom(get("/metrics", True))
        st.pop("uptime_seconds", None)
        return st, m
    # (Process figures, the eviction loop's ticks and timings move on their own.)
    moving = ("process_", "ticks", "seconds")
    last = None
    for _ in range(60):
        cur = state()
        cur_cmp = (json.dumps(cur[0], sort_keys=True),
                   {k: v for k, v in cur[1].items() if not any(x in k for x in moving)})
        if cur_cmp == last:
            break
        changed = [] if last is None else [k for k in cur_cmp[1] if cur_cmp[1][k] != last[1].get(k)]
        last = cur_cmp
        time.sleep(1)
    else:
        problems.append(f"the server never went still after the bench: {changed[:10]}")
    next_poll(driver)
    page = figures(driver)
    st, m = get("/status"), prom(get("/metrics", True))
    l1 = st["storage_manager"]["l1"]
    want = {
        "l1_used_bytes": l1["used_bytes"],
        "l1_capacity_bytes": l1["capacity_bytes"],
        "l1_resident_objects": l1["resident_objects"],
        "l1_evicted_objects": l1["evicted_objects"],
        "lookup_requested_tokens_total": m.get("lmcache_mp_lookup_requested_tokens_total", 0),
        "lookup_hit_tokens_total": m.get("lmcache_mp_lookup_hit_tokens_total", 0),
        "lookups_total": m.get("lmcache_mp_lookups_requests_total", 0),
        "stores_total": m.get("lmcache_mp_num_finished_stores_total", 0),
        "retrieves_total": m.get("lmcache_mp_num_finished_retrieves_total", 0),
        "miss_chunks_total": m.get("lmcache_rs_lookup_miss_chunks_total", 0),
        "l1_quota_rejections_total": m.get("lmcache_rs_l1_quota_rejections_total", 0),
        "l2_unwritten_objects": st["storage_manager"]["l2_write_behind"]["unwritten_objects"],
        "l2_enqueued_keys": st["storage_manager"]["l2_write_behind"]["enqueued_keys"],
    }
    for t in l1["tenants"]:
        want[f"tenant:{t['cache_salt']}"] = t["used_bytes"]
    tiers = st["storage_manager"]["l1_manager"]["l1s"]
    if [t["tag"] for t in tiers] != ["dram", "overflow"]:
        problems.append(f"the server's two L1s are not in /status: {tiers}")
    for t in tiers:
        want[f"tier:{t['tag']}:used"] = t["used_bytes"]
    for t in st["storage_manager"]["l2_tenants"]:
        want[f"tenant-l2:{t['cache_salt']}"] = t["used_bytes"]
    if not any(t["quota_bytes"] for t in st["storage_manager"]["l2_tenants"]):
        problems.append("the L2 quota set for the test is not in /status")
    for a in st["storage_manager"]["l2_adapters"]:
        want[f"l2:{a['id']}:used"] = a["used_bytes"]
    for i in st["registered_instances"]:
        want[f"engine:{i['instance_id']}"] = None
    if want["lookups_total"] == 0 or want["stores_total"] == 0 or want["l1_used_bytes"] == 0:
        problems.append(f"the bench left no trace on the server: {want}")
    compare(page, want, problems)
    hit_rate = float(page["hit_rate"])
    if abs(hit_rate - want["lookup_hit_tokens_total"] / want["lookup_requested_tokens_total"]) > 1e-9:
        problems.append(f"hit rate {hit_rate} is not hit/requested tokens")
    if not driver.find_elements(By.CSS_SELECTOR, "#c-ops polyline"):
        problems.append("the request-rate chart drew no line")
    if "No lookups yet" in driver.find_element(By.ID, "recent").text:
        problems.append("recent lookups are empty after the bench")
    driver.save_screenshot(os.path.join(shots, "status-still.png"))
    # A page opened now draws the minutes before it from the server's samples.
    hist = get("/status/history")
    if len(hist["samples"]) < 3:
        problems.append(f"/status/history kept {len(hist['samples'])} samples")
    driver.execute_script("window.open(arguments[0], '_blank')", url + "/")
    driver.switch_to.window(driver.window_handles[-1])
    deadline = time.time() + 15
    while driver.execute_script("return window.lmcacheSnapshot") is None:
        assert time.time() < deadline, "the second page showed nothing"
        time.sleep(0.2)
    points = driver.execute_script("return hist.t.length")
    if points < len(hist["samples"]):
        problems.append(f"a fresh page drew {points} points, the server had {len(hist['samples'])} samples")
    driver.close()
    driver.switch_to.window(driver.window_handles[0])
    # 2, 3: a laptop screen, no console error, nothing fetched from elsewhere.
    checks_common(driver, url, shots, "status", problems)
    print(f"status page: {len(want)} figures equal /status and /metrics; screenshots in {shots}")
finally:
    driver.quit()
if problems:
    print("FAILED:\n  " + "\n  ".join(problems))
    sys.exit(1)
