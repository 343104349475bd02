"""Helpers for the searcher tests: configs, searchers and Determined's own test drivers
(re-derived from master/pkg/searcher/util_test.go at 0.37.0 and 0.38)."""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from det_local.config import ExperimentConfig, parse_config
from det_local.search import make_searcher
from det_local.search.actions import Action, Close, Create, Shutdown, Stop, ValidateAfter
from det_local.search.base import Searcher

INT_X = {"x": {"type": "int", "minval": 0, "maxval": 10, "count": 3}}


def config(searcher: dict[str, Any], hparams: dict[str, Any] | None = None, seed: int = 7):
    raw = {
        "name": "search-test",
        "entrypoint": "python3 train.py",
        "searcher": {"metric": "loss", **searcher},
        "hyperparameters": INT_X if hparams is None else hparams,
        "reproducibility": {"experiment_seed": seed},
    }
    return parse_config(raw, source="test")


def searcher(searcher_cfg: dict[str, Any], hparams: dict[str, Any] | None = None, seed: int = 7):
    return make_searcher(config(searcher_cfg, hparams, seed))


def reloaded(cfg: ExperimentConfig, s: Searcher) -> Searcher:
    """A fresh searcher restored from a JSON round trip of `s`'s snapshot."""
    fresh = make_searcher(cfg)
    fresh.restore(json.loads(json.dumps(s.snapshot())))
    return fresh


def creates(actions: list[Action]) -> list[Create]:
    return [a for a in actions if isinstance(a, Create)]


# ---------------------------------------------------------------------- 0.38 TestSearchRunner
@dataclass
class RunnerTrial:
    request_id: str
    hparams: dict[str, Any]
    stopped: bool = False
    stopped_at: int = -1
    completed: bool = False


@dataclass
class Runner:
    """Determined's TestSearchRunner: trials run one after another; each reports a metric that
    grows (or shrinks) by one with every report, every `val_period` units up to `max_units`."""

    s: Searcher
    time_metric: str = "batches"
    trials: list[RunnerTrial] = field(default_factory=list)
    shutdowns: int = 0

    def handle(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Create):
                self.trials.append(RunnerTrial(a.request_id, a.hparams))
            elif isinstance(a, Stop):
                self.get(a.request_id).stopped = True
            elif isinstance(a, Shutdown):
                self.shutdowns += 1

    def get(self, request_id: str) -> RunnerTrial:
        return next(t for t in self.trials if t.request_id == request_id)

    def run(self, max_units: int, val_period: int, increasing: bool) -> None:
        metric = 0.0
        self.handle(self.s.initial_actions())
        i = 0
        while i < len(self.trials):
            trial = self.trials[i]
            for j in range(0, max_units + 1, val_period):
                metric += 1 if increasing else -1
                self.handle(
                    self.s.on_validation(trial.request_id, {"loss": metric, self.time_metric: j})
                )
                if trial.stopped:
                    trial.stopped_at = j
                    break
            trial.completed = True
            self.handle(self.s.on_trial_exited(trial.request_id))
            i += 1


# ---------------------------------------------------------------------- 0.37 value simulation
@dataclass
class Predefined:
    """Determined's predefinedTrial: the operation lengths a trial must get, its metric for
    each, and (optionally) the operation index at which it exits early."""

    ops: list[int]
    metric: float
    early_exit: int | None = None


def constant(ops: str, metric: float) -> Predefined:
    return Predefined([int(x) for x in ops.split()], metric)


def early(ops: str, metric: float) -> Predefined:
    lengths = [int(x) for x in ops.split()]
    return Predefined(lengths, metric, len(lengths) - 1)


def value_simulation(
    cfg: ExperimentConfig, expected: list[Predefined], *, reload: bool = True
) -> Searcher:
    """Determined's checkValueSimulation: a FIFO of actions; Create takes the next predefined
    trial, ValidateAfter completes that operation (or exits early, reason ERRORED), Close ends
    the trial. Checks every trial got exactly its operations. With `reload`, the searcher is
    rebuilt from its snapshot after every operation (Determined's saveAndReload)."""
    s = make_searcher(cfg)
    pending: deque[Action] = deque(s.initial_actions())
    trial_of: dict[str, int] = {}
    op_index: dict[str, int] = {}
    exited: set[str] = set()
    shutdowns = 0
    while pending:
        action = pending.popleft()
        ops: list[Action] = []
        if isinstance(action, Create):
            assert len(trial_of) < len(expected), "the search created too many trials"
            trial_of[action.request_id] = len(trial_of)
            op_index[action.request_id] = 0
        elif isinstance(action, ValidateAfter):
            rid = action.request_id
            if rid in exited:
                continue
            trial = expected[trial_of[rid]]
            i = op_index[rid]
            assert i < len(trial.ops), f"trial {trial_of[rid] + 1} ran out of expected ops"
            assert action.length == trial.ops[i], (
                f"trial {trial_of[rid] + 1}: wanted {trial.ops[i]}, got {action.length}"
            )
            if trial.early_exit is not None and i == trial.early_exit:
                exited.add(rid)
                ops = s.on_trial_exited_early(rid, "ERRORED")
            else:
                ops = s.on_op_completed(rid, action.length, trial.metric)
            op_index[rid] = i + 1
            if reload:
                s = reloaded(cfg, s)
        elif isinstance(action, Close):
            rid = action.request_id
            trial = expected[trial_of[rid]]
            assert op_index[rid] == len(trial.ops), (
                f"trial {trial_of[rid] + 1} closed with ops {trial.ops[op_index[rid] :]} left"
            )
            exited.add(rid)
            ops = s.on_trial_exited(rid)
        elif isinstance(action, Shutdown):
            shutdowns += 1
        pending.extend(ops)
    for rid, n in trial_of.items():
        assert op_index[rid] == len(expected[n].ops), f"trial {n + 1} incomplete"
    assert len(trial_of) == len(expected), f"{len(trial_of)} trials, wanted {len(expected)}"
    assert shutdowns == 1
    return s


ASHA = {
    "hyperparameters": {"lr": {"type": "double", "minval": 0.0, "maxval": 1.0}},
    "searcher": {
        "name": "adaptive_asha",
        "metric": "loss",
        "time_metric": "batches",
        "max_time": 16,
        "max_trials": 8,
        "max_concurrent_trials": 2,
        "mode": "aggressive",
        "divisor": 2,
        "max_rungs": 3,
    },
    "reproducibility": {"experiment_seed": 3},
}


GATED_SCRIPT = """\
import json
import os
import pathlib
import time

import determined as det
from determined import core

info = det.get_cluster_info()
lr = info.trial.hparams["lr"]
gate = pathlib.Path(info.trial.hparams["gate"])
run_id = int(os.environ["DET_TRIAL_RUN_ID"])
with core.init() as ctx:
    steps = 0
    if info.latest_checkpoint:
        with ctx.checkpoint.restore_path(info.latest_checkpoint) as p:
            steps = int((p / "s").read_text())
    with open(info.trial.hparams["record"], "a") as f:
        f.write(json.dumps({"trial": info.trial.trial_id, "run": run_id, "start": steps,
                            "latest": info.latest_checkpoint}) + "\\n")
    while steps < 8:
        steps += 1
        if steps % 2 == 0:
            ctx.train.report_validation_metrics(
                steps_completed=steps,
                metrics={"loss": abs(lr - 0.3) + 1.0 / steps, "batches": steps},
            )
        with ctx.checkpoint.store_path({"steps_completed": steps}) as (p, _):
            (p / "s").write_text(str(steps))
        if steps == 1 and run_id == 1:  # hold until the test says go, or a pause
            deadline = time.monotonic() + 60
            while not gate.exists() and time.monotonic() < deadline:
                if ctx.preempt.should_preempt():
                    break
                time.sleep(0.01)
        if ctx.preempt.should_preempt():
            break
"""
