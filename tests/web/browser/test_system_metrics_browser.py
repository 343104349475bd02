"""A trial's system metrics charted on the dashboard's trial page, a command's on its page, and
/usage's chart per user, in the real browser (Debian's chromium, headless, Playwright): a daemon
on fake GPUs whose utilisation the test scripts samples a running trial and a command. The
trial page's screenshot goes to tests/artifacts/system-metrics.png (the README's picture is
made the same way: docs/system_screenshot.py)."""

from __future__ import annotations

import json
from typing import Any

from tests.support.browser import ARTIFACTS, checked_page, chromium, require, until

require()
from tests.support.dashboard import World, serve  # noqa: E402
from tests.support.world import Env, wait_for  # noqa: E402


def _samples(dl: Env, **key: int) -> int:
    store = dl.store()
    try:
        return len(store.usage.samples(**key))
    finally:
        store.close()


def test_system_metrics_charts_in_chromium(dl: Env) -> None:
    usage = dl.tmp / "gpu-usage.json"
    usage.write_text(json.dumps({"devices": {"0": {"util": 73, "mem_mb": 3000}, "1": {"util": 0}}}))
    dl.daemon_start(
        {"system_metrics": {"interval": 0.25}},
        DET_LOCAL_FAKE_GPUS="2",
        DET_LOCAL_FAKE_GPU_USAGE=str(usage),
    )
    cfg, ctx = dl.trainer({"batches": 2000, "delay": 0.05})
    r = dl.det("run", "--detach", cfg, ctx)
    assert r.rc == 0, r
    trial = wait_for(lambda: dl.trials(1), what="the trial")[0].id
    job = dl.cmd("sleep", "300", slots=1)
    wait_for(lambda: _samples(dl, trial_id=trial) >= 6, timeout=90, what="trial samples")
    wait_for(lambda: _samples(dl, job_id=job) >= 3, timeout=90, what="command samples")
    world = World(dl.home, dl.tmp, {**dl.env})
    server_gen = serve(world)
    server = next(server_gen)
    try:
        with chromium() as browser, checked_page(browser) as page:
            server.open(page, f"/trials/{trial}")
            until(page, "window.detSystemCharts && window.detSystemCharts.size >= 4")
            gpu: Any = until(
                page,
                "(() => { const p = window.detSystemCharts.get('GPU utilisation (%)');"
                " return p && p.data[0].length >= 6 && p.data; })()",
            )
            # the trial holds slot 0 (the first free): its line is the scripted 73 %
            assert set(gpu[1]) == {73}, gpu[1]
            titles = page.evaluate("[...window.detSystemCharts.keys()]")
            assert titles[:4] == [
                "GPU utilisation (%)",
                "GPU memory (MiB)",
                "CPU (% of one core)",
                "Memory RSS (MiB)",
            ]
            cpu = page.evaluate("window.detSystemCharts.get('CPU (% of one core)').data[1]")
            assert any(v is not None and v > 0 for v in cpu), cpu
            page.locator("#system-charts").scroll_into_view_if_needed()
            page.locator("#system-charts").screenshot(path=str(ARTIFACTS / "system-metrics.png"))

            server.open(page, f"/commands/{job}")
            until(page, "window.detSystemCharts && window.detSystemCharts.size >= 3")
            mem = page.evaluate("window.detSystemCharts.get('GPU memory (MiB)').data")
            assert mem[0] and all(v == 0 for v in mem[1]), mem  # slot 1: nothing scripted

            server.open(page, "/usage?since=1d")
            until(page, "window.detUsageCharts && window.detUsageCharts.length >= 1")
            assert page.locator("#usage tbody tr").first.inner_text().startswith("root")
            title = page.evaluate(
                "window.detUsageCharts[0].root.querySelector('.u-title').textContent"
            )
            assert title.startswith("user root: ") and "slot-hours" in title
    finally:
        server_gen.close()
        dl.det("experiment", "kill", 1)
        dl.det("cmd", "kill", job)
