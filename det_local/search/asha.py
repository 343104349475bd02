"""Asynchronous successive halving (Determined's async_halving), rung arithmetic and the 0.38
stopping-based search driven by reported validation metrics.

Rung i of R (0-based) needs ``max(int(L / d**(R-1-i)), 1)`` units of the time metric (L =
max_time, or max_length's value for the <=0.37 kinds in ``asha_legacy``). The search starts
``min(max_concurrent_trials, max_trials)`` trials (``clamp(int(d**(R-1)), 1, max_trials)`` when
max_concurrent_trials is 0); each Stop it decides comes with a replacement while fewer than
max_trials (not counting InvalidHP trials) have been created.

Deliberate differences from Determined 0.38, all for reports Determined never gets in practice:
a trial already told to stop (or that ended early) is not ranked again by later reports, and a
NaN or infinite searcher metric (+inf or -inf, whichever direction is better) ranks as the worst
value rather than corrupting the rung order (or winning it).
"""

from __future__ import annotations

import bisect
import math
import sys
from typing import Any

from det_local.errors import MetricError
from det_local.search.actions import Action, SearchState, Stop
from det_local.search.base import INVALID_HP, NewTrial
from det_local.search.gomath import go_int, go_pow

# A trial that exited early ranks as this (Determined's ashaExitedMetricValue).
EXITED_METRIC = sys.float_info.max


def make_rungs(num_rungs: int, divisor: float, max_length: int) -> list[int]:
    """Units of the time metric each rung needs (Determined's makeRungs)."""
    out = []
    for i in range(num_rungs):
        rate = go_pow(divisor, float(num_rungs - i - 1))
        out.append(max(go_int(float(max_length) / rate), 1))
    return out


def initial_trial_count(
    max_concurrent_trials: int, max_trials: int, divisor: float, num_rungs: int
) -> int:
    """How many trials a (sub-)search starts with: its degree of parallelism."""
    if max_concurrent_trials > 0:
        return min(max_concurrent_trials, max_trials)
    return min(max(1, go_int(go_pow(divisor, float(num_rungs - 1)))), max_trials)


def asha_progress(rung0_count: int, max_trials: int, completed: int, invalid: int) -> float:
    """Rung 0's fill with a 20% allowance, then the share of valid trials that finished."""
    progress = rung0_count / (1.2 * max_trials)
    if rung0_count == max_trials:
        progress = max((completed - invalid) / max_trials, progress)
    return progress


_MISSING = object()


def _as_number(value: Any) -> float | None:
    """A JSON number as a float; None for anything else (bools, strings, None)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class AshaStopping:
    """0.38 async_halving: early-stops trials whose reported metric ranks outside the top
    1/divisor of a rung they reached. One instance is also one bracket of adaptive_asha."""

    def __init__(
        self,
        *,
        num_rungs: int,
        max_trials: int,
        divisor: float,
        max_time: int,
        time_metric: str,
        metric: str,
        smaller_is_better: bool = True,
        max_concurrent_trials: int = 16,
    ) -> None:
        self.num_rungs = num_rungs
        self.max_trials = max_trials
        self.divisor = float(divisor)
        self.time_metric = time_metric
        self.metric = metric
        self.smaller_is_better = smaller_is_better
        self.max_concurrent_trials = max_concurrent_trials
        self.units = make_rungs(num_rungs, self.divisor, max_time)
        # rung i's metrics in ascending order, and the request ids in the same order
        self.values: list[list[float]] = [[] for _ in range(num_rungs)]
        self.ids: list[list[str]] = [[] for _ in range(num_rungs)]
        self.trial_rungs: dict[str, int] = {}
        self.early_exit: set[str] = set()
        self.stopped: set[str] = set()
        self.trials_completed = 0
        self.invalid = 0

    # ------------------------------------------------------------------ helpers
    def _create(self, new_trial: NewTrial) -> Action:
        create = new_trial()
        self.trial_rungs[create.request_id] = 0
        return create

    def _budget_left(self) -> bool:
        return len(self.trial_rungs) - self.invalid < self.max_trials

    def _insert(self, rung: int, request_id: str, value: float) -> int:
        """Insert before equal values; returns the index (Determined's insertMetric)."""
        values = self.values[rung]
        i = bisect.bisect_left(values, value)
        values.insert(i, value)
        self.ids[rung].insert(i, request_id)
        return i

    def read_report(self, request_id: str, metrics: dict[str, Any]) -> tuple[int, float]:
        """(time, signed metric) from a validation report, or MetricError naming what's wrong."""
        value = _as_number(metrics.get(self.metric))
        if value is None:
            raw = metrics.get(self.metric, _MISSING)
            found = "no such key" if raw is _MISSING else repr(raw)
            raise MetricError(
                f"trial request {request_id}: the validation report has no number for the "
                f"searcher metric '{self.metric}' ({found}); reported: {_shown(metrics)}. "
                f"Report '{self.metric}' with every validation (searcher.metric)"
            )
        when = _as_number(metrics.get(self.time_metric))
        if when is None or when != when or when < 0 or math.isinf(when):
            raw = metrics.get(self.time_metric, _MISSING)
            found = "no such key" if raw is _MISSING else repr(raw)
            raise MetricError(
                f"trial request {request_id}: the validation report has no usable value for the "
                f"time metric '{self.time_metric}' ({found}); reported: {_shown(metrics)}. "
                f"ASHA needs '{self.time_metric}' (a number >= 0, e.g. batches trained) in "
                "every validation report (searcher.time_metric)"
            )
        if not math.isfinite(value):  # NaN, +inf or -inf: the worst, whichever is better
            value = EXITED_METRIC
        elif not self.smaller_is_better:
            value = -value
        return int(when), value

    def early_stopping(self, request_id: str, time: int, value: float) -> list[Action]:
        """Record a report in every rung it qualifies for; Stop the trial when it ranks
        outside the top 1/divisor of one (or reaches the top rung)."""
        for r in range(self.trial_rungs[request_id], self.num_rungs):
            self.trial_rungs[request_id] = r
            if time < self.units[r]:
                return []
            index = self._insert(r, request_id, value)
            if r == self.num_rungs - 1:
                return [Stop(request_id)]
            keep = max(go_int(float(len(self.values[r])) / self.divisor), 1)
            if index >= keep:
                return [Stop(request_id)]
        return []

    # ------------------------------------------------------------------ events
    def initial_actions(self, new_trial: NewTrial) -> list[Action]:
        n = initial_trial_count(
            self.max_concurrent_trials, self.max_trials, self.divisor, self.num_rungs
        )
        return [self._create(new_trial) for _ in range(n)]

    def on_validation(
        self, request_id: str, metrics: dict[str, Any], new_trial: NewTrial
    ) -> list[Action]:
        if request_id not in self.trial_rungs:
            return []
        if request_id in self.stopped or request_id in self.early_exit:
            return []
        time, value = self.read_report(request_id, metrics)
        actions = self.early_stopping(request_id, time, value)
        if actions:
            self.stopped.add(request_id)
            if self._budget_left():
                actions.append(self._create(new_trial))
        return actions

    def on_op_completed(
        self, request_id: str, length: int, metric: float, new_trial: NewTrial
    ) -> list[Action]:
        return []

    def on_trial_exited(self, request_id: str, new_trial: NewTrial) -> list[Action]:
        if request_id in self.trial_rungs:
            self.trials_completed += 1
        return []

    def on_trial_exited_early(
        self, request_id: str, reason: str, new_trial: NewTrial
    ) -> list[Action]:
        if request_id not in self.trial_rungs:
            return []
        self.trials_completed += 1  # Determined's trialExited follows trialExitedEarly
        if reason == INVALID_HP:
            self.early_exit.add(request_id)
            self.invalid += 1
            for r in range(self.trial_rungs[request_id] + 1):
                if request_id in self.ids[r]:
                    i = self.ids[r].index(request_id)
                    del self.ids[r][i]
                    del self.values[r][i]
            return [Stop(request_id), self._create(new_trial)]
        already_done = request_id in self.stopped or request_id in self.early_exit
        self.early_exit.add(request_id)
        if already_done:
            return []  # ranked (and replaced) when it was stopped
        self._insert(self.trial_rungs[request_id], request_id, EXITED_METRIC)
        return [self._create(new_trial)] if self._budget_left() else []

    # ------------------------------------------------------------------ reading
    def progress(self, state: SearchState) -> float:
        return asha_progress(
            len(self.values[0]), self.max_trials, self.trials_completed, self.invalid
        )

    def rung_of(self, request_id: str) -> int | None:
        return self.trial_rungs.get(request_id)

    def rung_metrics(self, rung: int) -> list[tuple[str, float]]:
        """(request id, signed metric) in rung order: what Determined's Rungs[i].Metrics holds."""
        return list(zip(self.ids[rung], self.values[rung], strict=True))

    def snapshot(self) -> dict[str, Any]:
        return {
            "kind": "asha_stopping",
            "rungs": [
                {"units_needed": u, "metrics": [[i, v] for i, v in zip(ids, vals, strict=True)]}
                for u, ids, vals in zip(self.units, self.ids, self.values, strict=True)
            ],
            "trial_rungs": dict(self.trial_rungs),
            "early_exit_trials": sorted(self.early_exit),
            "stopped_trials": sorted(self.stopped),
            "trials_completed": self.trials_completed,
            "invalid_trials": self.invalid,
        }

    def restore(self, data: dict[str, Any]) -> None:
        rungs = data["rungs"]
        self.units = [int(r["units_needed"]) for r in rungs]
        self.ids = [[str(m[0]) for m in r["metrics"]] for r in rungs]
        self.values = [[float(m[1]) for m in r["metrics"]] for r in rungs]
        self.trial_rungs = {str(k): int(v) for k, v in data["trial_rungs"].items()}
        self.early_exit = set(data["early_exit_trials"])
        self.stopped = set(data.get("stopped_trials", ()))
        self.trials_completed = int(data["trials_completed"])
        self.invalid = int(data["invalid_trials"])


def _shown(metrics: dict[str, Any], limit: int = 300) -> str:
    text = "{" + ", ".join(f"{k!r}: {v!r}" for k, v in sorted(metrics.items(), key=str)) + "}"
    return text if len(text) <= limit else text[: limit - 4] + " ...}"
