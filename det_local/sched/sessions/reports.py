"""What a trial's reports do: metrics recorded (and the best validation kept), progress, the
searcher told of validations and completed operations.

Called by the trial messages (`sched/sessions/trialmessages.py`) through the engine; the searcher's
answers go back to the engine as actions (``apply``), and a searcher that cannot go on ends
the experiment (``fail``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from det_local.errors import DetLocalError, MetricError
from det_local.sched.life.experiments import ExperimentRun, TrialRun, better
from det_local.search.actions import Action
from det_local.store.db import Store


class Reports:
    def __init__(
        self,
        store: Store,
        *,
        note: Callable[..., None],
        apply: Callable[[ExperimentRun, list[Action]], None],
        fail: Callable[[ExperimentRun, int, str], None],
    ) -> None:
        self.store = store
        self.note = note
        self.apply = apply
        self.fail = fail
        self.warned: set[tuple[int, str]] = set()  # (trial, metric) reported non-finite

    def on_metrics(self, run: TrialRun, exp: ExperimentRun, reports: list[list[Any]]) -> None:
        if not isinstance(reports, list):
            raise TypeError("reports must be a list")
        self.store.add_metrics(run.trial_id, run.run_id, reports)
        metric = exp.config.searcher.metric
        sign = 1.0 if exp.config.searcher.smaller_is_better else -1.0
        if reports:
            self.store.set_trial_steps(run.trial_id, max(int(r[1]) for r in reports))
        for group, steps, metrics, _t, _b in reports:
            if group != "validation":
                continue
            value = metrics.get(metric)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if math.isfinite(value):
                    v = sign * float(value)
                    trial = self.store.get_trial(run.trial_id)
                    tb = None if trial.best_validation is None else sign * trial.best_validation
                    if tb is None or v < tb:
                        self.store.set_best_validation(run.trial_id, float(value))
                    exp.best = better(v, exp.best)
                elif (run.trial_id, metric) not in self.warned:
                    self.warned.add((run.trial_id, metric))
                    self.note(
                        f"trial {run.trial_id}: validation metric '{metric}' is {value} at "
                        f"steps_completed={steps}; recorded as reported, it ranks worst (never "
                        "the best) for the searcher and checkpoint GC; check the learning rate "
                        "or the data",
                        experiment_id=exp.id,
                        trial_id=run.trial_id,
                        level="WARNING",
                    )
            try:
                actions = exp.searcher.on_validation(run.request_id, metrics)
            except MetricError as err:  # e.g. ASHA's metric or time_metric missing
                self.fail(exp, run.trial_id, str(err))
                return
            self.apply(exp, actions)

    def on_progress(self, run: TrialRun, exp: ExperimentRun, progress: float) -> None:
        exp.progress[run.trial_id] = progress
        exp.searcher.set_trial_progress(run.request_id, progress)
        self.store.set_experiment_progress(exp.id, exp.searcher.progress())

    def on_op_done(self, run: TrialRun, exp: ExperimentRun, length: int, metric: Any) -> None:
        q = exp.ops.get(run.request_id)
        if not q or q[0] != length:
            raise DetLocalError(
                f"trial {run.trial_id}: report_completed for length {length}, but the current "
                f"operation is {q[0] if q else 'none'}"
            )
        q.popleft()
        if not isinstance(metric, (int, float)) or isinstance(metric, bool):
            raise DetLocalError(
                f"trial {run.trial_id}: op.report_completed() needs a number for searcher metric "
                f"'{exp.config.searcher.metric}', found {metric!r}"
            )
        self.apply(exp, exp.searcher.on_op_completed(run.request_id, length, float(metric)))
