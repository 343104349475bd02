"""<=0.37 ASHA: operation-driven. Each trial gets ``ValidateAfter(rung length)`` operations and
answers each with ``op.report_completed(metric)``; the searcher decides on those reports only.

* ``AshaPromotion`` (stop_once: false, the default): a trial that ranks in the top 1/divisor
  of its rung is promoted at once (its next operation follows); otherwise it waits, *paused*,
  and may be promoted later as the rung fills (the engine relaunches it from its checkpoint
  with the new operation). When rung 0 holds max_trials results, rungs with no trial still
  training are closed out: their waiting trials get Close.
* ``AshaStopOnce`` (stop_once: true): each trial is decided once per rung, continue or Close;
  nothing is resumed later.

Both send the absolute rung targets (rung lengths from ``asha.make_rungs``) and create a
replacement whenever an event added no training work, until max_trials exist.

Deliberate differences from Determined 0.37, for events Determined never delivers: a repeated
report_completed is ignored; a trial that exits normally while it still owes an operation (code
that never iterates ``searcher.operations()``) ranks as exited early instead of leaving its rung
waiting for ever; a waiting trial the engine reports as ended is treated as exited early when
its turn to be promoted comes.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

from det_local.search.actions import Action, Close, SearchState, ValidateAfter
from det_local.search.asha import EXITED_METRIC, asha_progress, initial_trial_count, make_rungs
from det_local.search.base import INVALID_HP, NewTrial
from det_local.search.gomath import go_int


class _Rung:
    """One rung: its length, its results ([request id, metric, promoted], ascending) and how
    many trials are training towards it."""

    __slots__ = ("units", "metrics", "outstanding")

    def __init__(self, units: int) -> None:
        self.units = units
        self.metrics: list[list[Any]] = []
        self.outstanding = 0

    def keys(self) -> list[float]:
        return [m[1] for m in self.metrics]

    def to_dict(self) -> dict[str, Any]:
        return {
            "units_needed": self.units,
            "metrics": [list(m) for m in self.metrics],
            "outstanding_trials": self.outstanding,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> _Rung:
        rung = cls(int(data["units_needed"]))
        rung.metrics = [[str(m[0]), float(m[1]), bool(m[2])] for m in data["metrics"]]
        rung.outstanding = int(data["outstanding_trials"])
        return rung


class _OperationAsha:
    """What both <=0.37 kinds share: rungs, creation, operations owed, InvalidHP handling."""

    kind = ""

    def __init__(
        self,
        *,
        num_rungs: int,
        max_trials: int,
        divisor: float,
        max_length: int,
        smaller_is_better: bool = True,
        max_concurrent_trials: int = 16,
    ) -> None:
        self.num_rungs = num_rungs
        self.max_trials = max_trials
        self.divisor = float(divisor)
        self.smaller_is_better = smaller_is_better
        self.max_concurrent_trials = max_concurrent_trials
        self.rungs = [_Rung(u) for u in make_rungs(num_rungs, self.divisor, max_length)]
        self.trial_rungs: dict[str, int] = {}
        self.early_exit: set[str] = set()
        self.closed: set[str] = set()
        self.awaiting: dict[str, int] = {}  # request id -> length of the operation it owes
        self.trials_completed = 0
        self.invalid = 0

    # ------------------------------------------------------------------ helpers
    def _create(self, new_trial: NewTrial) -> list[Action]:
        create = new_trial()
        rid = create.request_id
        self.trial_rungs[rid] = 0
        self.rungs[0].outstanding += 1  # Determined counts it in trialCreated
        return [create, self._op(rid, 0)]

    def _op(self, request_id: str, rung: int) -> ValidateAfter:
        length = self.rungs[rung].units
        self.awaiting[request_id] = length
        return ValidateAfter(request_id, length)

    def _budget_left(self) -> bool:
        return len(self.trial_rungs) - self.invalid < self.max_trials

    def _close(self, request_id: str) -> Close:
        self.closed.add(request_id)
        return Close(request_id)

    def _signed(self, metric: float) -> float:
        v = float(metric)
        if not math.isfinite(v):  # NaN, +inf or -inf: the worst, whichever is better
            return EXITED_METRIC
        return v if self.smaller_is_better else -v

    def _decide(self, request_id: str, metric: float, new_trial: NewTrial) -> list[Action]:
        raise NotImplementedError

    # ------------------------------------------------------------------ events
    def initial_actions(self, new_trial: NewTrial) -> list[Action]:
        n = initial_trial_count(
            self.max_concurrent_trials, self.max_trials, self.divisor, self.num_rungs
        )
        actions: list[Action] = []
        for _ in range(n):
            actions.extend(self._create(new_trial))
        return actions

    def on_validation(
        self, request_id: str, metrics: dict[str, Any], new_trial: NewTrial
    ) -> list[Action]:
        return []

    def on_op_completed(
        self, request_id: str, length: int, metric: float, new_trial: NewTrial
    ) -> list[Action]:
        if request_id not in self.awaiting or request_id in self.early_exit:
            return []  # not ours, or a repeated report of a completed operation
        del self.awaiting[request_id]
        return self._decide(request_id, self._signed(metric), new_trial)

    def on_trial_exited(self, request_id: str, new_trial: NewTrial) -> list[Action]:
        if request_id not in self.trial_rungs:
            return []
        self.trials_completed += 1
        if request_id in self.closed or request_id in self.early_exit:
            return []
        # It ended without being closed: it owed an operation, or it was waiting.
        self.early_exit.add(request_id)
        self.closed.add(request_id)
        if request_id in self.awaiting:
            del self.awaiting[request_id]
            return self._decide(request_id, EXITED_METRIC, new_trial)
        return []

    def on_trial_exited_early(
        self, request_id: str, reason: str, new_trial: NewTrial
    ) -> list[Action]:
        if request_id not in self.trial_rungs:
            return []
        self.trials_completed += 1  # Determined's trialClosed follows trialExitedEarly
        owed = self.awaiting.pop(request_id, None) is not None
        if reason == INVALID_HP:
            self.early_exit.add(request_id)
            actions: list[Action] = [self._close(request_id)]
            self.invalid += 1
            top = self.trial_rungs[request_id]
            if owed and self.kind == "promotion":
                self.rungs[top].outstanding -= 1
            for r in range(top + 1):
                metrics = self.rungs[r].metrics
                for i, m in enumerate(metrics):
                    if m[0] == request_id:
                        del metrics[i]
                        break
            actions.extend(self._create(new_trial))
            return actions
        self.early_exit.add(request_id)
        self.closed.add(request_id)
        if not owed:
            return []  # its result for its rung is in already
        return self._decide(request_id, EXITED_METRIC, new_trial)

    # ------------------------------------------------------------------ reading
    def progress(self, state: SearchState) -> float:
        return asha_progress(
            len(self.rungs[0].metrics), self.max_trials, self.trials_completed, self.invalid
        )

    def rung_of(self, request_id: str) -> int | None:
        return self.trial_rungs.get(request_id)

    @property
    def pending(self) -> int:
        """Trials that owe an operation (Determined's PendingTrials)."""
        return len(self.awaiting)

    def snapshot(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "rungs": [r.to_dict() for r in self.rungs],
            "trial_rungs": dict(self.trial_rungs),
            "early_exit_trials": sorted(self.early_exit),
            "closed_trials": sorted(self.closed),
            "awaiting": dict(self.awaiting),
            "trials_completed": self.trials_completed,
            "invalid_trials": self.invalid,
        }

    def restore(self, data: dict[str, Any]) -> None:
        self.rungs = [_Rung.from_dict(r) for r in data["rungs"]]
        self.trial_rungs = {str(k): int(v) for k, v in data["trial_rungs"].items()}
        self.early_exit = set(data["early_exit_trials"])
        self.closed = set(data["closed_trials"])
        self.awaiting = {str(k): int(v) for k, v in data["awaiting"].items()}
        self.trials_completed = int(data["trials_completed"])
        self.invalid = int(data["invalid_trials"])


class AshaPromotion(_OperationAsha):
    """Promotion-based ASHA (Determined <=0.37 asha.go)."""

    kind = "promotion"

    def _promotions(self, rung: _Rung, request_id: str, metric: float) -> list[str]:
        """Insert a result (after equal values) and return who to promote now: this trial if
        it is in the top 1/divisor, else the trial that just entered the top 1/divisor as the
        rung grew, unless it was promoted already."""
        n = len(rung.metrics)
        old = go_int(float(n) / self.divisor)
        new = go_int(float(n + 1) / self.divisor)
        index = bisect.bisect_right(rung.keys(), metric)
        now = index < new
        rung.metrics.insert(index, [request_id, metric, now])
        if now:
            return [request_id]
        if new != old and not rung.metrics[old][2]:
            rung.metrics[old][2] = True
            return [rung.metrics[old][0]]
        return []

    def _decide(self, request_id: str, metric: float, new_trial: NewTrial) -> list[Action]:
        r = self.trial_rungs[request_id]
        rung = self.rungs[r]
        rung.outstanding -= 1
        added = False
        actions: list[Action] = []
        if r == self.num_rungs - 1:
            rung.metrics.append([request_id, metric, False])
            if request_id not in self.early_exit:
                actions.append(self._close(request_id))
        else:
            nxt = self.rungs[r + 1]
            for promoted in self._promotions(rung, request_id, metric):
                self.trial_rungs[promoted] = r + 1
                nxt.outstanding += 1
                if promoted in self.early_exit:
                    # as if it had trained and reported the worst result
                    return self._decide(promoted, EXITED_METRIC, new_trial)
                actions.append(self._op(promoted, r + 1))
                added = True
        if not added and self._budget_left():
            actions.extend(self._create(new_trial))
        if len(self.rungs[0].metrics) == self.max_trials:
            actions.extend(self._close_out_rungs())
        return actions

    def _close_out_rungs(self) -> list[Action]:
        """Close the waiting trials of every settled rung, bottom up, up to the first rung
        that still has trials training towards it."""
        actions: list[Action] = []
        for rung in self.rungs:
            if rung.outstanding > 0:
                break
            for rid, _metric, promoted in rung.metrics:
                if not promoted and rid not in self.closed and rid not in self.early_exit:
                    actions.append(self._close(rid))
        return actions


class AshaStopOnce(_OperationAsha):
    """Stop-once ASHA (Determined <=0.37 asha_stopping.go, stop_once: true)."""

    kind = "stop_once"

    def _decide(self, request_id: str, metric: float, new_trial: NewTrial) -> list[Action]:
        r = self.trial_rungs[request_id]
        rung = self.rungs[r]
        rung.outstanding -= 1
        added = False
        actions: list[Action] = []
        if r == self.num_rungs - 1:
            rung.metrics.append([request_id, metric, False])
            if request_id not in self.early_exit:
                actions.append(self._close(request_id))
        else:
            keep = max(go_int(float(len(rung.metrics) + 1) / self.divisor), 1)
            index = bisect.bisect_left(rung.keys(), metric)
            go_on = index < keep
            rung.metrics.insert(index, [request_id, metric, go_on])
            # an early-exited trial adds its (worst) result but never advances
            if request_id not in self.early_exit:
                if go_on:
                    self.trial_rungs[request_id] = r + 1
                    self.rungs[r + 1].outstanding += 1
                    actions.append(self._op(request_id, r + 1))
                    added = True
                else:
                    actions.append(self._close(request_id))
        if not added and self._budget_left():
            actions.extend(self._create(new_trial))
        return actions
