"""Metric reports as compact lines in a trial's output, through the real `det-local run`:
validation lines before the summary (Core API, PyTorch, the digits_core quickstart), training
lines throttled under a tight loop, the `[trial N]` prefix of a search, the off switch, only the
chief printing, and checkpoint GC's tally kept off the run's terminal."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from det_local.store.states import State
from det_local.trial.core._metric_lines import INTERVAL_S
from tests.support.paths import REPO
from tests.support.trials.pytorch import TRAIN as PYTORCH_TRAIN
from tests.support.trials.pytorch import config as pytorch_config
from tests.support.world import Env


@pytest.fixture(autouse=True)
def metric_lines_on(dl: Env) -> None:
    """conftest turns them off for the other tests."""
    dl.env.pop("DET_LOCAL_METRIC_LINES", None)


LINE = re.compile(r"^(\[trial (\d+)\] )?steps (\d+) (\w+): (.*)$")

CORE = """
import json, time
from determined import core

with core.init() as ctx:
    t0 = time.monotonic()
    for i in range(1, {n} + 1):
        ctx.train.report_training_metrics(steps_completed=i, metrics={{"loss": 1.0 / i}})
        if i % {every} == 0:
            ctx.train.report_validation_metrics(
                steps_completed=i, metrics={{"accuracy": 0.9581234, "loss": 0.1123456}}
            )
    with open("{out}", "w") as f:
        json.dump({{"loop_s": time.monotonic() - t0}}, f)
    print("trial done", flush=True)
"""


def metric_lines(text: str) -> list[tuple[str | None, int, str, str]]:
    """(trial prefix, steps, group, values) of each metric line in `text`."""
    found = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            found.append((m.group(2), int(m.group(3)), m.group(4), m.group(5)))
    return found


def core_context(dl: Env, n: int, every: int, **config: object) -> tuple[Path, Path, Path]:
    out = dl.tmp / "loop.json"
    cfg, ctx = dl.context(CORE.format(n=n, every=every, out=out), dict(config))
    return cfg, ctx, out


def test_core_api_run_shows_validation_lines_before_its_summary(dl: Env) -> None:
    cfg, ctx, _ = core_context(dl, n=30, every=10)
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    lines = r.out.splitlines()
    summary = next(i for i, line in enumerate(lines) if line.startswith("Experiment 1 "))
    shown = metric_lines("\n".join(lines[:summary]))
    validation = [(s, v) for _, s, g, v in shown if g == "validation"]
    # every validation, 3-4 significant digits, in report order
    assert validation == [(s, "accuracy=0.9581 loss=0.1123") for s in (10, 20, 30)], r.out
    assert shown[0] == (None, 1, "training", "loss=1"), r.out  # the first at once
    # the trial's log holds the same lines (`trial logs`, `experiment logs`)
    logs = dl.det("trial", "logs", 1)
    assert logs.rc == 0, logs
    assert metric_lines(logs.out) == shown
    assert not [line for line in lines if line.startswith("[trial")]  # one trial: no prefix


def test_a_tight_loop_of_10000_reports_prints_a_bounded_number_of_lines(dl: Env) -> None:
    cfg, ctx, out = core_context(dl, n=10_000, every=5_000)
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    loop_s = json.loads(out.read_text())["loop_s"]
    shown = metric_lines(dl.log(1, 1))
    training = [s for _, s, g, _ in shown if g == "training"]
    validation = [s for _, s, g, _ in shown if g == "validation"]
    assert validation == [5000, 10000]  # always shown
    # at most one per interval, plus the one held back before each validation and at the end
    assert len(training) <= loop_s / INTERVAL_S + 1 + len(validation) + 1, (loop_s, training)
    assert training[0] == 1 and training[-1] == 10000, training  # the first, and the last
    assert training == sorted(training)
    assert len(dl.metrics(1, "training")) == 10_000  # every report is stored all the same


def test_metric_lines_off_by_config_or_by_the_submitting_shell(dl: Env) -> None:
    env_vars = {"environment": {"environment_variables": ["DET_LOCAL_METRIC_LINES=0"]}}
    cfg, ctx, _ = core_context(dl, n=20, every=10, **env_vars)
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0 and "trial done" in r.out, r
    assert metric_lines(r.out) == [] and metric_lines(dl.log(1, 1)) == [], r.out
    assert len(dl.metrics(1, "validation")) == 2

    cfg, ctx, _ = core_context(dl, n=20, every=10)
    dl.env["DET_LOCAL_METRIC_LINES"] = "off"
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0 and "trial done" in r.out, r
    assert metric_lines(r.out) == [], r.out


def test_a_search_prefixes_each_trials_lines(dl: Env) -> None:
    script = """
from determined import core
import determined as det
info = det.get_cluster_info()
with core.init() as ctx:
    x = info.trial.hparams["x"]
    ctx.train.report_validation_metrics(steps_completed=5, metrics={"loss": x / 3})
"""
    cfg, ctx = dl.context(
        script,
        {
            "hyperparameters": {"x": {"type": "categorical", "vals": [1, 2]}},
            "searcher": {"name": "grid", "metric": "loss", "max_length": 5},
        },
    )
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    shown = metric_lines(r.out)
    by_trial = {t: v for t, _, g, v in shown if g == "validation"}
    assert sorted(by_trial.values()) == ["loss=0.3333", "loss=0.6667"], r.out
    for trial in dl.trials(1):  # each line under the trial that reported it
        assert by_trial[str(trial.id)] == f"loss={trial.hparams['x'] / 3:.4g}", r.out


def test_pytorch_trial_prints_its_reduced_metrics(dl: Env) -> None:
    cfg, ctx = dl.context(PYTORCH_TRAIN, pytorch_config("lines", {"batches": 8}))
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    shown = metric_lines(r.out)
    validation = [(s, v) for _, s, g, v in shown if g == "validation"]
    stored = dl.metrics(1, "validation")
    assert [s for s, _ in validation] == [m.steps_completed for m in stored] == [4, 8], r.out
    for (_, values), m in zip(validation, stored, strict=True):
        # the averaged val_loss, and epochs; batches is the steps already shown
        assert values == f"val_loss={m.metrics['val_loss']:.4g} epochs={m.metrics['epochs']}"
    training = [(s, v) for _, s, g, v in shown if g == "training"]
    assert training and training[-1][0] == 8 and training[-1][1].startswith("loss="), r.out


def test_only_the_chief_prints(dl: Env) -> None:
    script = """
from determined import core
dist = core.DistributedContext.from_torch_distributed()
with core.init(distributed=dist) as ctx:
    ctx.train.report_metrics("ranks", 1, {"rank": dist.rank})
    print(f"rank {dist.rank} done", flush=True)
"""
    cfg, ctx = dl.context(
        script,
        {
            "entrypoint": "python3 -m determined.launch.torch_distributed python3 train.py",
            "resources": {"slots_per_trial": 2},
        },
    )
    dl.env.update(DET_LOCAL_FAKE_GPUS="0", DET_LOCAL_CPU_SLOTS="2")
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    log = dl.log(1, 1)
    assert "rank 0 done" in log and "rank 1 done" in log, log
    assert [line for line in log.splitlines() if "steps 1 ranks:" in line] == [
        "[rank=0] steps 1 ranks: rank=0"
    ], log


def test_digits_core_quickstart_shows_its_learning_before_the_summary(dl: Env) -> None:
    example = dl.tmp / "digits_core"
    shutil.copytree(
        REPO / "examples" / "digits_core", example, ignore=shutil.ignore_patterns("__pycache__")
    )
    config = yaml.safe_load((example / "const.yaml").read_text())
    config["searcher"]["max_length"] = {"batches": 100}  # fast: validations at 50 and 100
    config["hyperparameters"]["validation_every"] = 50
    (example / "const.yaml").write_text(yaml.safe_dump(config))
    r = dl.det("run", example / "const.yaml", example)
    assert r.rc == 0, r
    lines = r.out.splitlines()
    assert lines[0] == "Created experiment 1", r.out
    summary = next(i for i, line in enumerate(lines) if line.startswith("Experiment 1 "))
    shown = metric_lines("\n".join(lines[1:summary]))
    assert [s for _, s, g, _ in shown if g == "validation"] == [50, 100], r.out
    assert re.fullmatch(
        r"validation_loss=[0-9.]+ validation_accuracy=0\.\d{1,4}",
        next(v for _, _, g, v in shown if g == "validation"),
    ), r.out
    # how the trial started (warm or cold, issue 18), then its learning, from the start
    assert re.fullmatch(r"det-local: trial 1 started cold in [0-9.]+s", lines[1]), r.out
    assert lines[2].startswith("steps 10 training: loss="), r.out
    # checkpoint GC's tally is an event (`experiment events`), not the run's first words
    assert "checkpoint GC" not in r.err, r.err
    assert dl.experiment(1).state == State.COMPLETED
    events = dl.det("experiment", "events", 1)
    assert "checkpoint GC deleted 1 checkpoint, kept 1" in events.out, events
