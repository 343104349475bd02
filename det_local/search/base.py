"""The searcher interface that single, grid, random and ASHA plug into.

A ``SearchMethod`` reacts to events with a list of actions (``search.actions``). It does no I/O
and starts no process; ``Searcher`` wraps a method with the bookkeeping every method needs
(which trials were created, closed, completed) and the snapshot the store persists.

Events, as the engine delivers them:

* ``on_validation(request_id, metrics)``: every validation a trial reports (0.38 ASHA decides on
  these; the other methods ignore them).
* ``on_op_completed(request_id, length, metric)``: ``op.report_completed(metric)`` of a
  ``ValidateAfter`` operation (<=0.37 ASHA decides on these).
* ``on_trial_exited(request_id)``: the trial ended normally (it finished, or a Stop/Close ended
  it). A <=0.37 ASHA trial that ran out of operations without being closed is *paused*, not
  exited: the engine reports nothing until the searcher promotes it (ValidateAfter) or closes
  it (Close), and reports the exit then.
* ``on_trial_exited_early(request_id, reason)``: the trial ended early, reason INVALID_HP,
  ERRORED (after its restarts) or USER_CANCELED. This is Determined's trialExitedEarly followed
  by trialExited: the trial is over either way.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from det_local.search.actions import Action, Close, Create, SearchState, Shutdown

INVALID_HP = "INVALID_HP"
ERRORED = "ERRORED"
USER_CANCELED = "USER_CANCELED"
EXIT_REASONS = (INVALID_HP, ERRORED, USER_CANCELED)


class NewTrial(Protocol):
    """Makes a Create: samples hparams (unless given), a request id and a trial seed."""

    def __call__(self, hparams: dict[str, Any] | None = None) -> Create: ...


class SearchMethod(Protocol):
    def initial_actions(self, new_trial: NewTrial) -> list[Action]: ...

    def on_validation(
        self, request_id: str, metrics: dict[str, Any], new_trial: NewTrial
    ) -> list[Action]: ...

    def on_op_completed(
        self, request_id: str, length: int, metric: float, new_trial: NewTrial
    ) -> list[Action]: ...

    def on_trial_exited(self, request_id: str, new_trial: NewTrial) -> list[Action]: ...

    def on_trial_exited_early(
        self, request_id: str, reason: str, new_trial: NewTrial
    ) -> list[Action]: ...

    def progress(self, state: SearchState) -> float: ...

    def rung_of(self, request_id: str) -> int | None: ...

    def snapshot(self) -> dict[str, Any]: ...

    def restore(self, data: dict[str, Any]) -> None: ...


class Searcher:
    """A search method plus the experiment-level bookkeeping and hparam sampling."""

    def __init__(
        self,
        method: SearchMethod,
        sample: Callable[[random.Random], dict[str, Any]],
        experiment_seed: int,
        warm_start_checkpoint: str | None = None,
        *,
        kind: str = "",
    ) -> None:
        self.method = method
        # "single", "random", "grid", or for ASHA its generation: "stopping" (0.38: Stop on
        # validation reports), "promotion" (<=0.37: paused trials resumed when promoted) or
        # "stop_once" (<=0.37: Close when not continued).
        self.kind = kind
        self.state = SearchState()
        self._sample = sample
        self._rng = random.Random(experiment_seed)
        self._warm = warm_start_checkpoint
        self._ended: set[str] = set()
        self._closed: set[str] = set()

    def _new_trial(self, hparams: dict[str, Any] | None = None) -> Create:
        # Determined's order: hparams, then the request id, then the trial seed.
        if hparams is None:
            hparams = self._sample(self._rng)
        request_id = str(uuid.UUID(int=self._rng.getrandbits(128), version=4))
        seed = self._rng.randrange(2**31)
        self.state.trials_requested += 1
        return Create(request_id, hparams, seed, self._warm)

    def _after(self, actions: list[Action]) -> list[Action]:
        for a in actions:
            if isinstance(a, Close) and a.request_id not in self._closed:
                self._closed.add(a.request_id)
                self.state.trials_closed.append(a.request_id)
        return actions

    # ------------------------------------------------------------------ events
    def initial_actions(self) -> list[Action]:
        return self._finish(self.method.initial_actions(self._new_trial))

    def on_validation(self, request_id: str, metrics: dict[str, Any]) -> list[Action]:
        """Raises MetricError when a stopping-based ASHA report lacks the searcher metric or
        the time metric (the engine ends the experiment with ERROR, naming trial and metric)."""
        if request_id in self._ended:
            return []
        return self._after(self.method.on_validation(request_id, metrics, self._new_trial))

    def on_op_completed(self, request_id: str, length: int, metric: float) -> list[Action]:
        if request_id in self._ended:
            return []
        return self._after(self.method.on_op_completed(request_id, length, metric, self._new_trial))

    def on_trial_exited(self, request_id: str) -> list[Action]:
        if request_id in self._ended:  # a repeated report (Determined ignores these too)
            return []
        self._ended.add(request_id)
        self.state.completed.append(request_id)
        self.state.trial_progress.pop(request_id, None)
        return self._finish(self.method.on_trial_exited(request_id, self._new_trial))

    def on_trial_exited_early(self, request_id: str, reason: str) -> list[Action]:
        if request_id in self._ended:
            return []
        if reason not in EXIT_REASONS:
            raise ValueError(f"unknown early-exit reason {reason!r} (one of {EXIT_REASONS})")
        self._ended.add(request_id)
        self.state.trial_progress.pop(request_id, None)
        if reason == INVALID_HP:
            self.state.invalid.append(request_id)
        else:
            self.state.failed.append(request_id)
            if reason == USER_CANCELED:
                self.state.canceled.append(request_id)
        return self._finish(self.method.on_trial_exited_early(request_id, reason, self._new_trial))

    def set_trial_progress(self, request_id: str, progress: float) -> None:
        """The fraction (0..1) of its work a live trial reported; feeds progress()."""
        if request_id not in self._ended:
            self.state.trial_progress[request_id] = min(max(float(progress), 0.0), 1.0)

    def _finish(self, actions: list[Action]) -> list[Action]:
        """Shutdown once every requested trial has ended: Cancel when all were canceled,
        Failure when all errored, else a completed search (Determined's rule)."""
        actions = self._after(actions)
        if (
            not self.state.shutdown
            and not any(isinstance(a, Create) for a in actions)
            and len(self._ended) >= self.state.trials_requested
        ):
            self.state.shutdown = True
            requested = self.state.trials_requested
            canceled = len(self.state.canceled)
            errored = len(self.state.failed) - canceled
            actions.append(
                Shutdown(
                    failure=requested > 0 and errored >= requested,
                    cancel=requested > 0 and canceled >= requested,
                )
            )
        return actions

    # ------------------------------------------------------------------ reading
    def progress(self) -> float:
        p = self.method.progress(self.state)
        if p != p or p in (float("inf"), float("-inf")):
            return 0.0
        return min(max(p, 0.0), 1.0)

    def rung_of(self, request_id: str) -> int | None:
        """The ASHA rung (0-based) a trial has reached; None for other searchers."""
        return self.method.rung_of(request_id)

    def ended(self, request_id: str) -> bool:
        return request_id in self._ended

    @property
    def pauses_trials(self) -> bool:
        """True when a trial that runs out of operations without being closed waits to be
        promoted (its process exits; a later ValidateAfter relaunches it from its checkpoint)
        instead of having finished."""
        return self.kind == "promotion"

    def snapshot(self) -> dict[str, Any]:
        return {
            "state": {
                **self.state.__dict__,
                "trials_closed": list(self.state.trials_closed),
                "completed": list(self.state.completed),
                "failed": list(self.state.failed),
                "invalid": list(self.state.invalid),
                "canceled": list(self.state.canceled),
                "trial_progress": dict(self.state.trial_progress),
            },
            "method": self.method.snapshot(),
            "rng": _rng_state(self._rng),
        }

    def restore(self, data: dict[str, Any]) -> None:
        self.state = SearchState(**data["state"])
        self.method.restore(data["method"])
        self._rng.setstate(_rng_from(data["rng"]))
        self._ended = set(self.state.completed) | set(self.state.failed) | set(self.state.invalid)
        self._closed = set(self.state.trials_closed)


def _rng_state(rng: random.Random) -> list[Any]:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _rng_from(data: list[Any]) -> tuple[Any, ...]:
    return (data[0], tuple(data[1]), data[2])
