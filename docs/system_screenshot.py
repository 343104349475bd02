"""Make the README's picture of a trial's system metrics (docs/system-metrics.png) from a real
run: examples/digits_pytorch's const.yaml under a daemon on a throwaway home, sampled every
0.5 s, then `det-local dashboard` over it, photographed in Debian's headless chromium
(Playwright). CPU, memory and disk are the trial's own; the machine has no GPU, so the daemon
runs on 1 fake GPU (DET_LOCAL_FAKE_GPUS=1) whose utilisation and memory this script scripts
(DET_LOCAL_FAKE_GPU_USAGE: a ramp while the trial trains), the hardware edge the tests fake too.

Usage: python docs/system_screenshot.py   (about a minute; needs the test extra and chromium)
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "digits_pytorch"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from screenshots import chromium_page, dashboard, det, until  # noqa: E402


def script_gpu(path: Path, stop: threading.Event) -> None:
    t0 = time.monotonic()
    while not stop.is_set():
        t = time.monotonic() - t0
        util = 85 + 10 * math.sin(t / 3) if t > 4 else 20 * t
        mem = min(9000.0, 1500 + 800 * t)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"devices": {"0": {"util": round(util), "mem_mb": mem}}}))
        os.replace(tmp, path)
        stop.wait(0.25)


def main() -> None:
    with tempfile.TemporaryDirectory() as home:
        usage = Path(home) / "gpu-usage.json"
        env = {
            **os.environ,
            "DET_LOCAL_HOME": home,
            "DET_LOCAL_FAKE_GPUS": "1",
            "DET_LOCAL_FAKE_GPU_USAGE": str(usage),
            "DET_LOCAL_METRIC_LINES": "0",
        }
        Path(home, "daemon.yaml").write_text("system_metrics: {interval: 0.5}\n")
        stop = threading.Event()
        ramp = threading.Thread(target=script_gpu, args=(usage, stop), daemon=True)
        ramp.start()
        det(env, "daemon", "start")
        try:
            det(env, "run", str(EXAMPLE / "const.yaml"), str(EXAMPLE))
            with dashboard(env) as (base, token), chromium_page(1240, 900) as page:
                page.goto(f"{base}/trials/1?token={token}")  # the login page (web/guard.py)
                page.wait_for_url(lambda url: "token=" not in url, wait_until="load")
                until(page, "window.detSystemCharts && window.detSystemCharts.size >= 4")
                page.locator("#system-charts").screenshot(
                    path=str(ROOT / "docs" / "system-metrics.png")
                )
        finally:
            stop.set()
            det(env, "daemon", "stop")


if __name__ == "__main__":
    main()
