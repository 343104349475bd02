"""The hyperparameter view in a real browser (Debian's chromium, headless, driven by
Playwright), over a real adaptive_asha search run to its end: 14 trials of a Core API script
whose validation loss is a function of lr (log), opt (categorical, one value markup that would
set window.__pwned if it ran) and layers (int). The parallel coordinates hold one line per trial
with a metric (read back from the ECharts instance), the lr axis and the lr scatter are log, a
brush on the lr axis selects exactly the trials in its range (the count and the table say so),
the markup stays text in the table, the axis and the tooltip, a click on a scatter point opens
that trial. A second experiment, followed while it runs: a brush and a zoom survive the page's
refreshes. The console has no errors; screenshots go to tests/artifacts/."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.browser import ARTIFACTS, checked_page, chromium, require, until

require()
from det_local.store.db import Store  # noqa: E402
from det_local.store.paths import Paths  # noqa: E402
from tests.support.dashboard import Server, World, make_world, serve  # noqa: E402
from tests.support.world import wait_for  # noqa: E402

HOSTILE = "<img src=x onerror=window.__pwned=1>"
TRIALS = 14


# a validation every 2 batches (with the time metric); with hparams.gate, it holds after its
# first validation until that file exists
SCRIPT = r"""
import math, os, time
import determined as det

hp = det.get_cluster_info().trial.hparams
penalty = {"sgd": 0.6, "adam": 0.0}.get(hp["opt"], 0.3)
with det.core.init() as core:
    for step in range(1, 9):
        if step % 2 == 0:
            loss = abs(math.log10(hp["lr"]) + 2.5) + penalty + hp["layers"] / 10 + 1 / step
            core.train.report_validation_metrics(step, {"loss": loss, "batches": step})
            deadline = time.monotonic() + 60
            while hp.get("gate") and not os.path.exists(hp["gate"]):
                assert time.monotonic() < deadline, "the test never opened the gate"
                time.sleep(0.05)
        if core.preempt.should_preempt():
            break
"""


def config(searcher: dict[str, Any], **hparams: Any) -> dict[str, Any]:
    return {
        "name": f"asha {HOSTILE}",
        "entrypoint": "python3 train.py",
        "hyperparameters": {
            "lr": {"type": "log", "minval": -4, "maxval": -1, "base": 10},
            "opt": {"type": "categorical", "vals": ["sgd", "adam", HOSTILE]},
            "layers": {"type": "int", "minval": 1, "maxval": 4},
            "model": {"width": 32},
            **hparams,
        },
        "searcher": {"metric": "loss", **searcher},
        "reproducibility": {"experiment_seed": 5},
        "max_restarts": 0,
    }


ASHA = {
    "name": "adaptive_asha",
    "time_metric": "batches",
    "max_time": 8,
    "max_trials": TRIALS,
    "max_concurrent_trials": 4,
    "mode": "aggressive",
    "divisor": 2,
    "max_rungs": 3,
}


def context(world: World, name: str, cfg: dict[str, Any]) -> tuple[Path, Path]:
    ctx = world.tmp / name
    ctx.mkdir()
    (ctx / "train.py").write_text(SCRIPT)
    (ctx / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return ctx / "config.yaml", ctx


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return make_world(tmp_path_factory.mktemp("hpbrowser"), dict(os.environ))


@pytest.fixture(scope="module")
def exp_id(world: World) -> int:
    cfg, ctx = context(world, "asha", config(ASHA))
    r = world.det("run", cfg, ctx)
    assert r.returncode == 0, r
    return int(world.json("experiment", "list", "--all")[-1]["id"])


@pytest.fixture(scope="module")
def server(world: World, exp_id: int) -> Iterator[Server]:
    yield from serve(world)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    with checked_page(browser, 1400, 1000) as pg:
        yield pg
        assert pg.evaluate("window.__pwned") is None


PARALLEL = "echarts.getInstanceByDom(document.getElementById('hp-parallel'))"


def scatter(name: str) -> str:
    return f"echarts.getInstanceByDom(document.querySelector('[data-hparam=\"{name}\"]'))"


def count_text(page: Any) -> str:
    return str(page.inner_text("#hp-count"))


def test_hparams_view_of_an_asha_search(
    world: World, exp_id: int, server: Server, page: Any
) -> None:
    api = server.json(f"/api/experiments/{exp_id}/hparams")
    scored = [t for t in api["trials"] if t["metric"] is not None]
    assert len(api["trials"]) == TRIALS and len(scored) == TRIALS, api["trials"]
    assert any(t["hparams"]["opt"] == HOSTILE for t in scored)  # the seed gives it a trial

    # from the experiment page's link
    server.open(page, f"/experiments/{exp_id}")
    page.click("text=Hyperparameter views")
    page.wait_for_url(f"**/experiments/{exp_id}/hparams")
    until(page, "document.getElementById('hp-count').textContent.includes('selected')")

    # one line per trial with a metric; an axis per varying hyperparameter, then the metric
    option = page.evaluate(
        f"(() => {{ const o = {PARALLEL}.getOption(); return {{"
        "axes: o.parallelAxis.map(a => [a.name, a.type, a.data || null]),"
        "lines: o.series[0].data.map(d => [d.name, d.value]) }; })()"
    )
    assert sorted(n for n, _ in option["lines"]) == sorted(f"trial {t['trial_id']}" for t in scored)
    axes = {name: (kind, data) for name, kind, data in option["axes"]}
    assert list(axes) == ["lr", "opt", "layers", "loss"]  # model.width is fixed
    assert axes["lr"][0] == "log" and axes["layers"][0] == "value" and axes["loss"][0] == "value"
    assert axes["opt"] == ("category", ["sgd", "adam", HOSTILE])
    by_name = {f"trial {t['trial_id']}": t for t in scored}
    for name, value in option["lines"]:
        t = by_name[name]
        assert value == [
            t["hparams"]["lr"],
            t["hparams"]["opt"],
            t["hparams"]["layers"],
            t["metric"],
        ]
    assert "model.width = 32" in page.inner_text("#hp-fixed")
    assert page.inner_text("#hp-note") == ""  # every trial has a metric

    # a scatter per varying hyperparameter; log x for lr
    kinds = page.evaluate(
        "[...document.querySelectorAll('#hp-scatters [data-hparam]')].map(e => "
        "[e.dataset.hparam, echarts.getInstanceByDom(e).getOption().xAxis[0].type, "
        "echarts.getInstanceByDom(e).getOption().series[0].data.length])"
    )
    assert kinds == [
        ["lr", "log", TRIALS],
        ["opt", "category", TRIALS],
        ["layers", "value", TRIALS],
    ]

    # everything is selected; a brush on lr selects the trials inside it
    assert count_text(page) == f"{TRIALS} of {TRIALS} trials selected"
    lrs = sorted(t["hparams"]["lr"] for t in scored)
    lo, hi = math.sqrt(lrs[2] * lrs[3]), math.sqrt(lrs[8] * lrs[9])
    inside = {t["trial_id"] for t in scored if lo <= t["hparams"]["lr"] <= hi}
    assert len(inside) == 6
    page.evaluate(
        f"{PARALLEL}.dispatchAction({{type: 'axisAreaSelect', parallelAxisId: 'ax:lr', "
        f"intervals: [[{lo}, {hi}]]}})"
    )
    until(page, f"document.getElementById('hp-count').textContent.startsWith('6 of {TRIALS}')")
    rows = page.evaluate(
        "[...document.querySelectorAll('#hp-selected tbody tr')].map(r => "
        "[Number(r.dataset.trial), r.querySelector('a').getAttribute('href')])"
    )
    assert {tid for tid, _ in rows} == inside
    assert all(href == f"/trials/{tid}" for tid, href in rows)
    assert [tid for tid, _ in rows] == [t["trial_id"] for t in scored if t["trial_id"] in inside]
    page.screenshot(path=str(ARTIFACTS / "dashboard-hparams-brushed.png"), full_page=True)

    # cleared: all of them again, the hostile value among the table's cells, as text
    page.evaluate(
        f"{PARALLEL}.dispatchAction({{type: 'axisAreaSelect', parallelAxisId: 'ax:lr', "
        "intervals: []})"
    )
    until(page, f"document.getElementById('hp-count').textContent.startsWith('{TRIALS} of')")
    cells = page.evaluate(
        "[...document.querySelectorAll('#hp-selected td')].map(c => c.textContent)"
    )
    assert HOSTILE in cells
    assert page.locator("main img").count() == 0

    # the tooltip of a point with the hostile value: text in the tooltip box, no element
    opt = scatter("opt")
    index = page.evaluate(f"{opt}.getOption().series[0].data.findIndex(d => d[0] === {HOSTILE!r})")
    assert index >= 0
    page.evaluate(f"{opt}.dispatchAction({{type: 'showTip', seriesIndex: 0, dataIndex: {index}}})")
    box = "document.querySelector('[data-hparam=\"opt\"]')"
    until(page, f"{box}.textContent.includes({HOSTILE!r})")
    assert page.evaluate(f"{box}.querySelectorAll('img, script').length") == 0
    page.screenshot(path=str(ARTIFACTS / "dashboard-hparams.png"), full_page=True)

    # a click on a scatter point (the one farthest from the others) opens its trial
    lr_chart = scatter("lr")
    page.evaluate(f"{lr_chart}.getDom().scrollIntoView()")
    x, y, tid = page.evaluate(
        f"""(() => {{
        const c = {lr_chart}, box = c.getDom().getBoundingClientRect();
        const pts = c.getOption().series[0].data.map(d =>
            [...c.convertToPixel({{seriesIndex: 0}}, [d[0], d[1]]), d[2]]);
        const gap = p => Math.min(...pts.filter(q => q !== p).map(q =>
            Math.hypot(p[0] - q[0], p[1] - q[1])));
        const far = pts.reduce((a, b) => gap(a) >= gap(b) ? a : b);
        return [box.left + far[0], box.top + far[1], far[2]];
        }})()"""
    )
    page.mouse.click(x, y)
    page.wait_for_url(f"**/trials/{tid}")


def test_refresh_keeps_the_brush_and_the_zoom(
    world: World, exp_id: int, server: Server, page: Any
) -> None:
    """A random search followed while it runs (two trials at a time, the first two holding at
    a gate after their first validation; only lr varies): a brush around the first trial's lr
    and a zoom on the lr scatter survive the refreshes that bring the other two trials."""
    gate = world.tmp / "gate"
    search = {"name": "random", "max_trials": 4, "max_concurrent_trials": 2, "max_length": 8}
    cfg, ctx = context(world, "live", config(search, gate=str(gate), opt="adam", layers=2))
    run = world.start_run(cfg, ctx, DET_LOCAL_FAKE_GPUS="0", DET_LOCAL_CPU_SLOTS="2")
    try:
        exp = wait_for(
            lambda: [e["id"] for e in server.json("/api/experiments") if e["id"] != exp_id],
            what="the second experiment",
        )[0]

        def first_two() -> Any:
            d = server.json(f"/api/experiments/{exp}/hparams")
            scored = [t for t in d["trials"] if t["metric"] is not None]
            return scored if len(scored) == 2 else None

        scored = wait_for(first_two, timeout=60, what="the first two trials' validations")
        server.open(page, f"/experiments/{exp}/hparams")
        until(page, "document.getElementById('hp-count').textContent === '2 of 2 trials selected'")
        lr = scored[0]["hparams"]["lr"]
        page.evaluate(
            f"{PARALLEL}.dispatchAction({{type: 'axisAreaSelect', parallelAxisId: 'ax:lr', "
            f"intervals: [[{lr * 0.999}, {lr * 1.001}]]}})"
        )
        until(page, "document.getElementById('hp-count').textContent === '1 of 2 trials selected'")
        lr_chart = scatter("lr")
        page.evaluate(
            f"{lr_chart}.dispatchAction({{type: 'dataZoom', dataZoomIndex: 0, start: 20, end: 70}})"
        )
        gate.write_text("go")
        wait_for(lambda: run.poll() is not None, timeout=60, what="the search to end")
        assert run.returncode == 0
        d = server.json(f"/api/experiments/{exp}/hparams")
        assert d["state"] == "COMPLETED" and len(d["trials"]) == 4
        assert [h["name"] for h in d["hyperparameters"] if h["varies"]] == ["lr"]
        # the page catches up by itself (it refreshes every few seconds), the brush still on lr
        until(page, f"{PARALLEL}.getOption().series[0].data.length === 4", timeout=20)
        until(page, "document.getElementById('hp-count').textContent === '1 of 4 trials selected'")
        rows = page.evaluate(
            "[...document.querySelectorAll('#hp-selected tbody tr')].map(r => r.dataset.trial)"
        )
        assert rows == [str(scored[0]["trial_id"])]
        zoom = page.evaluate(f"(z => [z.start, z.end])({lr_chart}.getOption().dataZoom[0])")
        assert zoom == [20, 70]
        assert page.evaluate(f"{lr_chart}.getOption().series[0].data.length") == 4
        page.screenshot(path=str(ARTIFACTS / "dashboard-hparams-live.png"), full_page=True)
    finally:
        run.kill()
        run.wait()


def test_notes_for_trials_without_a_metric(world: World, server: Server, page: Any) -> None:
    """An experiment whose trials have not started (written to the store as the daemon would
    when it submits one), then gets a trial without a validation and one with: the page says
    so in one line, then draws the one line it can, without a reload (it is still ACTIVE)."""
    store = Store(Paths(world.home).db)
    try:
        exp = store.create_experiment(name="pending", config=config(ASHA))
        server.open(page, f"/experiments/{exp}/hparams")
        until(page, "document.getElementById('hp-note').textContent !== ''")
        assert page.inner_text("#hp-note") == "This experiment has no trials yet."
        assert page.inner_text("#hp-parallel") == "no trial has a validation metric yet"
        assert page.inner_text("#hp-count") == ""
        hps = [
            {"lr": 0.01, "opt": "adam", "layers": 1, "model": {"width": 32}},
            {"lr": 0.001, "opt": HOSTILE, "layers": 2, "model": {"width": 32}},
        ]
        ids = [store.create_trial(exp, hparams=hp, seed=0) for hp in hps]
        until(page, "document.getElementById('hp-note').textContent.startsWith('2 trials')")
        assert page.inner_text("#hp-note") == "2 trials have no validation metric yet."
        store.set_best_validation(ids[1], 0.5)
        until(page, "document.getElementById('hp-note').textContent.startsWith('1 trial has')")
        until(page, f"{PARALLEL} && {PARALLEL}.getOption().series[0].data.length === 1")
        assert page.inner_text("#hp-count") == "1 of 1 trials selected"
        assert HOSTILE in page.inner_text("#hp-selected")
        page.screenshot(path=str(ARTIFACTS / "dashboard-hparams-pending.png"), full_page=True)
    finally:
        store.close()
