"""What the status-page tests share: Debian's headless Chromium over WebDriver, the figures a
page shows (`data-k` / `data-v`), Prometheus text, and waiting for a page's next poll."""
import json
import os
import re
import time
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.service import Service


def chromium(width=1366, height=768):
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    # Without the background-networking flags Chromium keeps calling hosts this machine cannot
    # reach; a laptop-sized window by default.
    for flag in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--window-size={width},{height}", "--disable-dev-shm-usage"]:
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)


def get(url, token=None, text=False):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10).read().decode()
    return body if text else json.loads(body)


def prom(text):
    """Metric name -> the sum over its label sets."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def figures(driver):
    return driver.execute_script(
        "const o = {}; for (const e of document.querySelectorAll('[data-k]')) o[e.dataset.k] = e.dataset.v; return o;")


def next_poll(driver, timeout=15):
    """Waits until the page has polled again after now."""
    t0 = time.time() * 1000
    deadline = time.time() + timeout
    while (driver.execute_script("return window.lmcacheSnapshot && window.lmcacheSnapshot.at") or 0) < t0 + 100:
        assert time.time() < deadline, "the page stopped polling"
        time.sleep(0.2)


def compare(page, want, problems):
    for k, v in want.items():
        if k not in page:
            problems.append(f"the page lacks {k}")
        elif v is not None and float(page[k] or "nan") != float(v):
            problems.append(f"{k}: the page says {page[k]}, the server {v}")


def checks_common(driver, url, shots, name, problems):
    """A laptop screen, a full-page screenshot, no console error, nothing fetched elsewhere."""
    width = driver.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")
    if width[0] > width[1]:
        problems.append(f"the page is wider than the window: {width}")
    for entry in driver.get_log("browser"):
        if entry["level"] in ("SEVERE", "ERROR") and "401" not in entry["message"]:
            problems.append(f"console: {entry['message']}")
    hosts = driver.execute_script(
        "return performance.getEntriesByType('resource').map(e => new URL(e.name).host)")
    here = url.split("//", 1)[1]
    if any(h != here for h in hosts):
        problems.append(f"the page fetched from elsewhere: {set(hosts)}")
    tall = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1366, tall + 140)
    time.sleep(0.5)
    driver.save_screenshot(f"{shots}/{name}-full-page.png")


def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
