"""Real tools in the loop, for the HTTP front's tests: a headless Chromium (the distribution's package, driven by
Selenium) and the distribution's Prometheus server. Each returns None with the reason when the tool is missing, so
a test can skip saying what to install (ops/setup.sh installs both on a fresh CI machine)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
CHROMEDRIVER = ("chromedriver",)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _which(names: tuple[str, ...]) -> str | None:
    return next((p for p in map(shutil.which, names) if p), None)


def chromium_missing() -> str | None:
    """Why the browser test cannot run here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    if _which(CHROMIUM) is None or _which(CHROMEDRIVER) is None:
        return "no chromium/chromedriver on PATH (apt-get install -y chromium chromium-driver; ops/setup.sh)"
    return None


@contextmanager
def headless_chromium(width: int = 1280, height: int = 1000):
    """A Selenium WebDriver on the system's headless Chromium, with the browser console log readable."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = _which(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(_which(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def prometheus_missing() -> str | None:
    if shutil.which("prometheus") is None:
        return "no prometheus on PATH (apt-get install -y prometheus; ops/setup.sh)"
    return None


class Prometheus:
    """The distribution's `prometheus` scraping `targets` every second, with its data in `folder`."""

    def __init__(self, targets: list[str], folder: Path):
        self.port = free_port()
        config = folder / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": targets}]}],
        }))
        self.log = folder / "prometheus.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"], stdout=log, stderr=subprocess.STDOUT)

    def api(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> list[dict]:
        """An instant query's vector: [{"metric": {labels}, "value": [t, "v"]}]."""
        return self.api("query", query=promql)["result"]

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=5)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"prometheus did not start: {self.log.read_text()[-2000:]}") from None
                time.sleep(0.3)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
