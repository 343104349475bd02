"""The learning-curve controls, checkpoint markers, the log's rank filter and compare, in a real
browser (Debian's chromium driven by Playwright, as test_dashboard_browser.py). A grid search
of four trials (global_batch_size 4, records_per_epoch 16, checkpoints at batches 4 and 8, a
validation metric that goes to 0 and below); switching x to records, epochs and time changes
the charts' x data (read back from the uPlot instances); log y leaves the values <= 0 out with
a note; top 3 draws three series thick, best first. A trial whose two ranks print through
`determined.launch.wrap_rank` filters by rank (with the search). Compare draws both
experiments' lines, its legend one entry per experiment. The frictions of issue 27: a chart's
legend is one compact line of names (no "trial N: --" rows; grey trials left out), progress
counters (batches, epochs) are not drawn as curves, and checkpoints that checkpoint GC deleted
get no marker and no download command. The console stays clean; screenshots go to
tests/artifacts/."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.browser import ARTIFACTS, checked_page, chromium, require, until

require()
from tests.support.dashboard import Server, World, make_world, serve  # noqa: E402
from tests.support.world import wait_for  # noqa: E402

# training loss every batch; validations every 2 (val_gap: 0.25, 0, -0.25, -0.5); a
# checkpoint every 4 batches. hparams.ranks: two workers print through wrap_rank instead.
SCRIPT = r"""
import subprocess, sys
import determined as det

hp = det.get_cluster_info().trial.hparams
if hp.get("ranks"):
    code = "for i in range(3): print(f'line {i} of worker %d', flush=True)"
    procs = [
        subprocess.Popen([sys.executable, "-m", "determined.launch.wrap_rank", str(r), "--",
                          sys.executable, "-c", code % r])
        for r in (0, 1)
    ]
    sys.exit(max(p.wait() for p in procs))

with det.core.init() as core:
    n = int(hp["batches"])
    for step in range(1, n + 1):
        # batches and epochs: progress counters, as Determined's trainers report them
        progress = {"batches": step, "epochs": step * 4 / 16}
        core.train.report_training_metrics(step, {"loss": hp["lr"] / step, **progress})
        if step % 2 == 0:
            core.train.report_validation_metrics(
                step, {"val_loss": hp["lr"] * 10 / step, "val_gap": 0.5 - step / n}
            )
        if step % 4 == 0:
            with core.checkpoint.store_path({"steps_completed": step}) as (path, _):
                (path / "w").write_text("1")
"""

CHART = "window.detCharts.get('{}').plot"


def run(world: World, name: str, hparams: dict[str, Any], **config: Any) -> int:
    cfg, ctx = world.context(name, hparams, **config)
    (ctx / "train.py").write_text(SCRIPT)
    r = world.det("run", cfg, ctx)
    assert r.returncode == 0, r
    return int(world.json("experiment", "list", "--all")[-1]["id"])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return make_world(tmp_path_factory.mktemp("curves-browser"), dict(os.environ))


@pytest.fixture(scope="module")
def exps(world: World) -> dict[str, int]:
    grid = run(
        world,
        "grid",
        {
            "batches": 8,
            "global_batch_size": 4,
            "lr": {"type": "categorical", "vals": [0.3, 0.1, 0.4, 0.2]},
        },
        searcher={"name": "grid", "metric": "val_loss", "max_length": {"batches": 8}},
        records_per_epoch=16,
    )
    single = run(world, "single", {"batches": 8, "lr": 0.5})
    ranks = run(world, "ranks", {"batches": 8, "lr": 0.5, "ranks": True})
    return {"grid": grid, "single": single, "ranks": ranks}


@pytest.fixture(scope="module")
def server(world: World, exps: dict[str, int]) -> Iterator[Server]:
    yield from serve(world)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    with checked_page(browser) as page:
        yield page


def x_data(page: Any, metric: str) -> list[float]:
    return list(page.evaluate(f"{CHART.format(metric)}.data[0]"))


def test_curve_controls(server: Server, exps: dict[str, int], page: Any) -> None:
    exp = exps["grid"]
    curves = server.json(f"/api/experiments/{exp}/metrics")
    trials = curves["trials"]
    assert len(trials) == 4
    server.open(page, f"/experiments/{exp}")
    until(
        page,
        f"window.detCharts && window.detCharts.has('val_loss') && "
        f"{CHART.format('val_loss')}.data[0].length > 0",
    )
    assert x_data(page, "val_loss") == [2, 4, 6, 8]  # batches
    # legend best first: the API's order (lr 0.1 first); all four highlighted (top 5)
    labels = page.evaluate(f"{CHART.format('val_loss')}.series.slice(1).map(s => s.label)")
    assert labels == [f"trial {t['trial_id']}" for t in trials]
    widths = page.evaluate(f"{CHART.format('val_loss')}.series.slice(1).map(s => s.width)")
    assert widths == [2.5] * 4

    page.select_option("#x-unit", "records")  # x 4 records a batch
    until(page, f"{CHART.format('val_loss')}.data[0][0] === 8")
    assert x_data(page, "val_loss") == [8, 16, 24, 32]
    assert page.evaluate(f"{CHART.format('val_loss')}.axes[0].label") == "records"
    page.select_option("#x-unit", "epochs")  # 16 records an epoch
    until(page, f"{CHART.format('val_loss')}.data[0][0] === 0.5")
    assert x_data(page, "val_loss") == [0.5, 1, 1.5, 2]
    page.select_option("#x-unit", "time")  # seconds from each trial's start
    until(page, f"{CHART.format('val_loss')}.data[0].length > 4")
    want = sorted({r["time"] - t["started_at"] for t in trials for r in t["reports"]})
    got = x_data(page, "val_loss")
    assert len(got) == len(want) and all(abs(a - b) < 1e-6 for a, b in zip(got, want, strict=True))
    assert all(x > 0 for x in got)

    # log y: val_gap's values <= 0 (three a trial) are left out, with a note
    page.select_option("#x-unit", "batches")
    page.check("#log-y")
    gap = CHART.format("val_gap")
    until(page, f"{gap}.scales.y.distr === 3")
    assert (
        page.evaluate(f"{gap}.data.slice(1).map(ys => ys.filter(y => y !== null))") == [[0.25]] * 4
    )
    note = page.locator(".chart[data-metric='val_gap'] .chart-note").inner_text()
    assert note == "12 value(s) <= 0 left out on the log scale"
    assert page.evaluate(f"{CHART.format('val_loss')}.scales.y.distr") == 3

    # top 3: three thick coloured series (the three best), the fourth thin grey
    page.select_option("#top-n", "3")
    until(page, f"{CHART.format('val_loss')}.series[4].width === 1")
    widths = page.evaluate(f"{CHART.format('val_loss')}.series.slice(1).map(s => s.width)")
    assert widths == [2.5, 2.5, 2.5, 1]
    assert page.evaluate(f"{CHART.format('val_loss')}.scales.y.distr") == 3  # log y kept
    # an experiment without records_per_epoch: epochs is disabled, its title says why
    page.screenshot(path=str(ARTIFACTS / "curves-experiment.png"), full_page=True)
    server.open(page, f"/experiments/{exps['single']}")
    until(page, "window.detCharts && window.detCharts.has('val_loss')")
    title = page.evaluate("document.querySelector('#x-unit option[value=epochs]').title")
    assert page.evaluate("document.querySelector('#x-unit option[value=epochs]').disabled")
    assert "records_per_epoch" in title


def test_checkpoint_markers(server: Server, exps: dict[str, int], page: Any) -> None:
    trial = server.json(f"/api/experiments/{exps['grid']}")["trials"][0]
    ckpts = server.json(f"/api/trials/{trial['id']}")["checkpoints"]
    assert sorted(c["steps_completed"] for c in ckpts) == [4, 8]
    kept = [c for c in ckpts if c["state"] != "DELETED"]
    assert [c["steps_completed"] for c in kept] == [8], ckpts  # GC kept the best and latest
    server.open(page, f"/trials/{trial['id']}")
    until(page, "window.detCharts && window.detCharts.has('validation: val_loss')")
    until(page, "document.querySelectorAll('.chart .ckpt-marker').length >= 2")
    for metric in ("training: loss", "validation: val_loss"):
        titles = page.evaluate(
            f"[...document.querySelectorAll(\".chart[data-metric='{metric}'] .ckpt-marker\")]"
            ".map(m => m.title)"
        )
        # a deleted checkpoint has no marker: nothing to go back to
        assert titles == [
            f"checkpoint {c['uuid']} at {c['steps_completed']} batches ({c['state']})" for c in kept
        ], (metric, titles)
    page.screenshot(path=str(ARTIFACTS / "curves-trial.png"), full_page=True)


def test_deleted_checkpoints_offer_no_download(server: Server, exps: dict[str, int]) -> None:
    d = server.json(f"/api/experiments/{exps['grid']}")
    deleted = [c for c in d["checkpoints"] if c["state"] == "DELETED"]
    kept = [c for c in d["checkpoints"] if c["state"] != "DELETED"]
    assert deleted and kept
    status, body, _ = server.get(f"/experiments/{exps['grid']}")
    html = body.decode()
    assert status == 200
    for c in kept:
        assert f"det-local checkpoint download {c['uuid']}" in html
    for c in deleted:
        assert c["uuid"] not in html
    assert html.count("deleted (its files are gone)") == len(deleted)


def test_progress_counters_are_not_curves(server: Server, exps: dict[str, int], page: Any) -> None:
    exp = exps["grid"]
    trial = server.json(f"/api/experiments/{exp}")["trials"][0]
    reported = server.json(f"/api/trials/{trial['id']}/metrics?group=training")[0]["metrics"]
    assert {"batches", "epochs", "loss"} <= set(reported)
    server.open(page, f"/experiments/{exp}")
    until(page, "window.detCharts && window.detCharts.has('val_loss')")
    page.click(".groups button[data-group=training]")
    until(page, "window.detCharts.has('loss')")
    assert sorted(page.evaluate("[...window.detCharts.keys()]")) == ["loss"]
    server.open(page, f"/trials/{trial['id']}")
    until(page, "window.detCharts && window.detCharts.has('training: loss')")
    charts = page.evaluate("[...window.detCharts.keys()]")
    assert sorted(charts) == ["training: loss", "validation: val_gap", "validation: val_loss"]


def legend_entries(page: Any, chart: str) -> list[str]:
    """The names a chart's legend shows (hidden rows left out)."""
    return list(
        page.evaluate(
            f'[...document.querySelectorAll("{chart} .u-legend .u-series")]'
            ".filter(r => r.offsetParent !== null).map(r => r.textContent.trim())"
        )
    )


def test_legends_are_compact(server: Server, exps: dict[str, int], page: Any) -> None:
    exp = exps["grid"]
    server.open(page, f"/experiments/{exp}")
    chart = ".chart[data-metric='val_loss']"
    until(page, f'document.querySelectorAll("{chart} .u-legend .u-series").length === 4')
    legend = page.locator(f"{chart} .u-legend")
    text = legend.inner_text()
    assert "--" not in text and "batches" not in text, text  # no values, no x entry
    trials = server.json(f"/api/experiments/{exp}/metrics")["trials"]
    assert legend_entries(page, chart) == [f"trial {t['trial_id']}" for t in trials]
    box = legend.bounding_box()
    assert box is not None and box["height"] <= 24, box  # one line under the chart
    # top 1: the three grey trials leave the legend
    page.select_option("#top-n", "1")
    until(page, f"{CHART.format('val_loss')}.series[4].width === 1")
    visible = legend_entries(page, chart)
    assert visible == [f"trial {trials[0]['trial_id']}"], visible
    page.screenshot(path=str(ARTIFACTS / "curves-legend.png"), full_page=True)


def test_log_rank_filter(server: Server, exps: dict[str, int], page: Any) -> None:
    trial = server.json(f"/api/experiments/{exps['ranks']}")["trials"][0]
    server.open(page, f"/trials/{trial['id']}")
    until(page, "document.querySelectorAll('#log-rank option').length === 3")
    options = page.evaluate("[...document.querySelectorAll('#log-rank option')].map(o => o.value)")
    assert options == ["", "0", "1"]
    shown = (
        "[...document.querySelectorAll('#log div')].filter(d => !d.hidden).map(d => d.textContent)"
    )
    assert len([ln for ln in page.evaluate(shown) if ln.startswith("[rank=")]) == 6
    page.select_option("#log-rank", "1")
    lines = page.evaluate(shown)
    assert lines == [f"[rank=1] line {i} of worker 1" for i in range(3)], lines
    page.fill("#log-search", "line 2")  # with the search: both must match
    assert page.evaluate(shown) == ["[rank=1] line 2 of worker 1"]
    page.select_option("#log-rank", "")
    assert sorted(page.evaluate(shown)) == [
        "[rank=0] line 2 of worker 0",
        "[rank=1] line 2 of worker 1",
    ]
    page.screenshot(path=str(ARTIFACTS / "curves-ranks.png"), full_page=True)


def test_compare_two_experiments(server: Server, exps: dict[str, int], page: Any) -> None:
    grid, single = exps["grid"], exps["single"]
    server.open(page, "/")
    page.check(f"input[name=ids][value='{grid}']")
    page.check(f"input[name=ids][value='{single}']")
    page.screenshot(path=str(ARTIFACTS / "curves-experiments.png"), full_page=True)
    page.click("#compare-form button")
    page.wait_for_url("**/compare?*")
    chart = CHART.format("validation: val_loss")
    until(
        page,
        f"window.detCharts && window.detCharts.has('validation: val_loss') && "
        f"{chart}.data.length > 1",
    )
    labels = page.evaluate(f"{chart}.series.slice(1).map(s => s.label)")
    assert sum(lb.startswith(f"exp {grid}") for lb in labels) == 4, labels
    assert sum(lb.startswith(f"exp {single}") for lb in labels) == 1, labels
    # the legend: each experiment once (lines are coloured by experiment)
    entries = legend_entries(page, ".chart[data-metric='validation: val_loss']")
    assert sorted(entries) == sorted([f"exp {grid}", f"exp {single}"]), entries
    # validation first, then training
    titles = page.evaluate("[...document.querySelectorAll('.chart')].map(c => c.dataset.metric)")
    assert titles[0] == "validation: val_loss" and titles[-1] == "training: loss", titles
    page.select_option("#x-unit", "time")
    until(page, f"{chart}.axes[0].label === 'seconds since the trial started'")
    # records: the single experiment has no global_batch_size, so it is disabled
    assert page.evaluate("document.querySelector('#x-unit option[value=records]').disabled")
    assert page.locator("#compare").inner_text().count("COMPLETED") == 2
    page.screenshot(path=str(ARTIFACTS / "curves-compare.png"), full_page=True)


def test_experiment_curves_follow_a_running_experiment(
    world: World, server: Server, exps: dict[str, int], page: Any
) -> None:
    """The experiment page polls its progress while it runs: new points arrive (within a few
    seconds) on the chosen x unit, without resetting a zoom."""
    gate = world.tmp / "live-gate"
    cfg, ctx = world.context("live", {"batches": 8, "lr": 0.1, "wait_for": str(gate)})
    run = world.start_run(cfg, ctx)
    try:

        def waiting() -> int | None:
            exp = server.json("/api/experiments")[-1]
            if exp["id"] in exps.values():
                return None
            trials = server.json(f"/api/experiments/{exp['id']}")["trials"]
            if not trials:
                return None
            lines = server.json(f"/api/trials/{trials[0]['id']}/logs")["lines"]
            return int(exp["id"]) if any("waiting for" in ln for ln in lines) else None

        exp_id = wait_for(waiting, timeout=60, what="the trial to wait at its gate")
        server.open(page, f"/experiments/{exp_id}")
        page.click(".groups button[data-group=training]")
        loss = CHART.format("loss")
        until(page, f"window.detCharts.has('loss') && {loss}.data[0].length === 2")
        page.select_option("#x-unit", "time")
        until(page, f"{loss}.axes[0].label === 'seconds since the trial started'")
        page.evaluate(f"{loss}.setScale('x', {{min: 0, max: 0.001}})")  # the user zooms in
        gate.write_text("go")
        until(page, f"{loss}.data[0].length >= 8", timeout=30)
        assert page.evaluate(f"[{loss}.scales.x.min, {loss}.scales.x.max]") == [0, 0.001]
        assert run.wait(60) == 0
    finally:
        run.kill()
        run.wait()
