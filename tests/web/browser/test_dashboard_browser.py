"""The dashboard in a real browser: Debian's chromium, headless, driven by Playwright (its own
browser download is not used). The experiments page lists a finished experiment; the
experiment page's learning curve holds its points (uPlot's data, read in the page); a running
trial's page receives a new log line live (as text: its markup stays inert) and new metric
points without losing the chart's zoom; the console has no errors. Screenshots go to
tests/artifacts/ (git-ignored; CI keeps them)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import paths
from tests.support.browser import ARTIFACTS, chromium, console_errors, require, until

require()
from tests.support.dashboard import Server, World, finished_experiment, make_world, serve  # noqa: E402
from tests.support.world import wait_for  # noqa: E402

REPO = paths.REPO


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return make_world(tmp_path_factory.mktemp("browser"), dict(os.environ))


@pytest.fixture(scope="module")
def server(world: World) -> Iterator[Server]:
    finished_experiment(world, batches=400)
    yield from serve(world)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


def test_dashboard_in_chromium(world: World, server: Server, browser: Any) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems = console_errors(page)
    page.set_default_timeout(30_000)

    # the experiments page lists the finished experiment (its name as text)
    server.open(page, "/")
    row = page.locator("#experiments tbody tr").first
    assert "COMPLETED" in row.inner_text()
    assert '<script>alert("name")</script> digits' in row.inner_text()
    page.screenshot(path=str(ARTIFACTS / "dashboard-experiments.png"), full_page=True)

    # the experiment page's learning curve has the trial's validation points
    page.locator("#experiments tbody tr a").first.click()
    until(
        page,
        "window.detCharts && window.detCharts.size > 0 && "
        "[...window.detCharts.values()][0].plot.data.length > 1",
    )
    data = page.evaluate(
        "[...window.detCharts.values()].map(c => [c.box.dataset.metric, c.plot.data])"
    )
    metric, (xs, ys) = data[0]
    assert metric == "val_loss"
    assert xs == [100, 200, 300, 400] and all(isinstance(y, float) for y in ys), data
    page.screenshot(path=str(ARTIFACTS / "dashboard-experiment.png"), full_page=True)

    # a running trial: its page follows the log live, and new points keep the chart's zoom
    gate = world.tmp / "gate"
    cfg, ctx = world.context("live", {"batches": 8, "lr": 0.1, "wait_for": str(gate)})
    run = world.start_run(cfg, ctx)
    try:

        def waiting_trial() -> int | None:
            exps = server.json("/api/experiments")
            if len(exps) < 2:
                return None
            trials = server.json(f"/api/experiments/{exps[-1]['id']}")["trials"]
            if not trials:
                return None
            tid = int(trials[0]["id"])
            lines = server.json(f"/api/trials/{tid}/logs")["lines"]
            return tid if any("waiting for" in ln for ln in lines) else None

        tid = wait_for(waiting_trial, timeout=60, what="the trial to wait at its gate")
        server.open(page, f"/trials/{tid}")
        until(page, "document.getElementById('log-status').textContent === 'live'")
        assert "waiting for" in page.inner_text("#log")
        loss = "window.detCharts.get('training: loss').plot"
        until(page, f"window.detCharts.has('training: loss') && {loss}.data[0].length == 2")
        page.evaluate(f"{loss}.setScale('x', {{min: 1, max: 1.5}})")  # the user zooms in
        gate.write_text("go")
        until(page, "document.getElementById('log').textContent.includes('RELEASED <b>bold</b>')")
        assert page.locator("#log b").count() == 0  # the line's markup is text
        until(page, f"{loss}.data[0].length >= 8")
        scale = page.evaluate(f"[{loss}.scales.x.min, {loss}.scales.x.max]")
        assert scale == [1, 1.5], scale  # appending data kept the zoom
        until(page, "document.getElementById('log-status').textContent.includes('COMPLETED')")
        page.screenshot(path=str(ARTIFACTS / "dashboard-trial.png"), full_page=True)
        assert run.wait(60) == 0
    finally:
        run.kill()
        run.wait()
    assert problems == []
    page.close()


def test_the_digits_core_example_in_chromium(world: World, server: Server, browser: Any) -> None:
    """The Quickstart's example itself (examples/digits_core, real torch on scikit-learn's
    digits), run to its end: listed COMPLETED, its learning curve holds its 3 validations."""
    example = world.tmp / "digits_core"
    shutil.copytree(
        REPO / "examples" / "digits_core", example, ignore=shutil.ignore_patterns("__pycache__")
    )
    r = world.det("run", example / "const.yaml", example)
    assert r.returncode == 0, r
    exp_id = int(world.json("experiment", "list", "--all")[-1]["id"])

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems = console_errors(page)
    page.set_default_timeout(30_000)
    server.open(page, "/")
    row = page.locator("#experiments tbody tr", has_text="digits-core-const")
    assert row.count() == 1
    assert "COMPLETED" in row.inner_text()
    page.screenshot(path=str(ARTIFACTS / "dashboard-digits-core.png"), full_page=True)

    row.locator(f"a[href='/experiments/{exp_id}']").first.click()
    until(page, "window.detCharts && window.detCharts.has('validation_loss')")
    xs, ys = page.evaluate("window.detCharts.get('validation_loss').plot.data")
    assert xs == [100, 200, 300], xs
    assert all(isinstance(y, float) and y > 0 for y in ys), ys
    page.screenshot(path=str(ARTIFACTS / "dashboard-digits-core-experiment.png"), full_page=True)
    page.close()
    assert problems == []


def test_login_kept_for_the_dashboards_origin_alone(server: Server, browser: Any) -> None:
    """The login (web/guard.py, issue 34): without it a page is the one line; the login address
    keeps the token in the origin's storage, not in a cookie; the service worker sends it on
    pages, a reload that bypassed the worker (Shift+Reload) comes back through it, and the raw
    log downloads through it."""
    page = browser.new_page()
    page.set_default_timeout(30_000)
    first = page.goto(server.base + "/")
    assert first is not None and first.status == 401
    assert "needs its access token (no access token)" in page.inner_text("#login-status")
    server.open(page, "/")
    assert page.locator("#experiments tbody tr").count() >= 1  # (other tests add theirs)
    assert not [c for c in page.context.cookies() if server.token in c["value"]]
    assert server.token not in page.evaluate("document.cookie")
    # a reload that bypasses the worker is refused, then retried once through it
    answers: list[tuple[str, int, bool]] = []
    page.on("response", lambda r: answers.append((r.url, r.status, r.from_service_worker)))
    page.context.new_cdp_session(page).send("Page.reload", {"ignoreCache": True})
    until(page, "document.title.startsWith('Experiments')")
    pages = [(status, worker) for url, status, worker in answers if url == server.base + "/"]
    assert pages[0] == (401, False) and pages[-1] == (200, True), answers
    # the raw log: fetched by the page through the worker, saved from memory
    trial = server.json("/api/experiments/1")["trials"][0]["id"]
    page.goto(f"{server.base}/trials/{trial}")
    with page.expect_download() as download:
        page.click("#log-raw")
    assert download.value.suggested_filename == f"experiment-1-trial-{trial}.log"
    assert "done" in Path(download.value.path()).read_text()
    page.close()
