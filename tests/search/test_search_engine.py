"""Hyperparameter search through the engine: 0.38 ASHA stops trials, `experiment best`, and a
report missing the time metric ends the experiment in ERROR naming the trial and metric."""

from __future__ import annotations

from tests.support.searchkit import ASHA
from tests.support.world import Env

SCRIPT = """\
import os
import determined as det
from determined import core

info = det.get_cluster_info()
lr = info.trial.hparams["lr"]
omit = os.environ.get("OMIT_TIME_METRIC") == "1"
with core.init() as ctx:
    steps = 0
    if info.latest_checkpoint:
        with ctx.checkpoint.restore_path(info.latest_checkpoint) as p:
            steps = int((p / "s").read_text())
    while steps < 16:
        steps += 1
        loss = abs(lr - 0.3) + 1.0 / steps
        if steps % 4 == 0:
            metrics = {"loss": loss} if omit else {"loss": loss, "batches": steps}
            ctx.train.report_validation_metrics(steps_completed=steps, metrics=metrics)
            with ctx.checkpoint.store_path({"steps_completed": steps}) as (p, _):
                (p / "s").write_text(str(steps))
        if ctx.preempt.should_preempt():
            break
"""


def test_adaptive_asha_stops_trials_and_finds_the_best(dl: Env) -> None:
    dl.env["DET_LOCAL_CPU_SLOTS"] = "2"
    cfg, ctx = dl.context(SCRIPT, ASHA)
    r = dl.det("run", "-q", cfg, ctx, timeout=240)
    assert r.rc == 0, r.out + r.err
    trials = dl.json("trial", "list", "1")
    assert len(trials) == 8
    steps = sorted(t["steps_completed"] for t in trials)
    assert steps[0] < 16 and steps[-1] == 16  # some stopped early, the best ran to the end
    best = dl.json("experiment", "best", "1")
    ranked = sorted(
        (t for t in trials if t["best_validation"] is not None),
        key=lambda t: t["best_validation"],
    )
    assert best["trial"]["id"] == ranked[0]["id"]
    assert best["checkpoint"]["steps_completed"] == 16
    described = dl.json("experiment", "describe", "1")
    assert [t["id"] for t in described["trials"]][0] == ranked[0]["id"]
    assert {t["rung"] for t in described["trials"]} >= {0, 2}


def test_missing_time_metric_is_an_error_naming_trial_and_metric(dl: Env) -> None:
    cfg, ctx = dl.context(
        SCRIPT,
        {**ASHA, "environment": {"environment_variables": ["OMIT_TIME_METRIC=1"]}},
    )
    r = dl.det("run", cfg, ctx, timeout=240)
    assert r.rc == 1, r.out + r.err
    exp = dl.json("experiment", "describe", "1")["experiment"]
    assert exp["state"] == "ERROR"
    assert "batches" in exp["message"] and "trial" in exp["message"]
    # what was reported before is kept
    assert dl.json("checkpoint", "list", "1")
