"""Make the README's dashboard pictures from a real run: examples/digits_pytorch's adaptive ASHA
search (adaptive.yaml, 16 trials) on 2 CPU slots in a throwaway home, then `det-local dashboard`
over it, photographed in Debian's headless chromium (Playwright): docs/dashboard.png (the
experiment page's learning curves) and docs/dashboard-hparams.png (the hyperparameter views).

Usage: python docs/screenshots.py   (about a minute; needs the test extra and chromium)
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "digits_pytorch"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync"]


def det(env: dict[str, str], *argv: str) -> None:
    cmd = [sys.executable, "-m", "det_local.cli.main", *argv]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def until(page: object, expression: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not page.evaluate(expression):  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise SystemExit(f"the page never showed {expression}")
        time.sleep(0.2)


@contextlib.contextmanager
def dashboard(env: dict[str, str]) -> Iterator[tuple[str, str]]:
    """`det-local dashboard` over env's home on a free port, answering: (its address, token)."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "det_local.cli.main", "dashboard", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        assert server.stdout is not None
        # its first line: "det-local dashboard of HOME: http://127.0.0.1:PORT/?token=TOKEN"
        token = server.stdout.readline().strip().rpartition("?token=")[2]
        if not token:
            raise SystemExit("the dashboard printed no login address")
        auth = {"Authorization": f"Bearer {token}"}
        deadline = time.monotonic() + 30
        while True:
            try:
                req = urllib.request.Request(base + "/api/", headers=auth)
                urllib.request.urlopen(req, timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("the dashboard did not answer") from None
                time.sleep(0.1)
        yield base, token
    finally:
        server.terminate()
        server.wait(timeout=10)


@contextlib.contextmanager
def chromium_page(width: int, height: int) -> Iterator[Any]:
    """A page of Debian's headless chromium (Playwright), closed at the end."""
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS, headless=True)
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()


def main() -> None:
    with tempfile.TemporaryDirectory() as home:
        env = {
            **os.environ,
            "DET_LOCAL_HOME": home,
            "DET_LOCAL_CPU_SLOTS": "2",
            "DET_LOCAL_METRIC_LINES": "0",
        }
        det(env, "run", str(EXAMPLE / "adaptive.yaml"), str(EXAMPLE))
        with dashboard(env) as (base, token), chromium_page(1280, 860) as page:
            page.goto(f"{base}/experiments/1?token={token}")  # the login page (web/guard.py)
            page.wait_for_url(lambda url: "token=" not in url, wait_until="load")
            until(page, "window.detCharts && window.detCharts.size > 0")
            page.locator("#charts").scroll_into_view_if_needed()
            page.evaluate("window.scrollBy(0, -240)")  # the trials table's end, then charts
            page.screenshot(path=str(ROOT / "docs" / "dashboard.png"))
            page.goto(base + "/experiments/1/hparams")
            until(page, "document.querySelectorAll('canvas').length > 1")
            time.sleep(1)  # ECharts' entry animation
            page.screenshot(path=str(ROOT / "docs" / "dashboard-hparams.png"))


if __name__ == "__main__":
    main()
