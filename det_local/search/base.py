"""The searcher interface that single, grid, random and ASHA plug into.

A ``SearchMethod`` reacts to events with a list of actions (``search.actions``). It does no I/O
and starts no process; ``Searcher`` wraps a method with the bookkeeping every method needs
(which trials were created, closed, completed) and the snapshot the store persists.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from det_local.search.actions import Action, Close, Create, SearchState, Shutdown


class SearchMethod(Protocol):
    def initial_actions(self, new_trial: Callable[[], Create]) -> list[Action]: ...

    def on_validation(
        self, request_id: str, metrics: dict[str, Any], new_trial: Callable[[], Create]
    ) -> list[Action]: ...

    def on_op_completed(
        self, request_id: str, length: int, metric: float, new_trial: Callable[[], Create]
    ) -> list[Action]: ...

    def on_trial_exited(self, request_id: str, new_trial: Callable[[], Create]) -> list[Action]: ...

    def on_trial_exited_early(
        self, request_id: str, reason: str, new_trial: Callable[[], Create]
    ) -> list[Action]: ...

    def progress(self, state: SearchState) -> float: ...

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
    ) -> None:
        self.method = method
        self.state = SearchState()
        self._sample = sample
        self._rng = random.Random(experiment_seed)
        self._warm = warm_start_checkpoint

    def _new_trial(self) -> Create:
        hparams = self._sample(self._rng)
        request_id = str(uuid.UUID(int=self._rng.getrandbits(128), version=4))
        seed = self._rng.randrange(2**31)
        self.state.trials_requested += 1
        return Create(request_id, hparams, seed, self._warm)

    def _after(self, actions: list[Action]) -> list[Action]:
        for a in actions:
            if isinstance(a, Close) and a.request_id not in self.state.trials_closed:
                self.state.trials_closed.append(a.request_id)
        return actions

    def initial_actions(self) -> list[Action]:
        return self._after(self.method.initial_actions(self._new_trial))

    def on_validation(self, request_id: str, metrics: dict[str, Any]) -> list[Action]:
        return self._after(self.method.on_validation(request_id, metrics, self._new_trial))

    def on_op_completed(self, request_id: str, length: int, metric: float) -> list[Action]:
        return self._after(self.method.on_op_completed(request_id, length, metric, self._new_trial))

    def on_trial_exited(self, request_id: str) -> list[Action]:
        self.state.completed.append(request_id)
        return self._finish(self.method.on_trial_exited(request_id, self._new_trial))

    def on_trial_exited_early(self, request_id: str, reason: str) -> list[Action]:
        if reason == "INVALID_HP":
            self.state.invalid.append(request_id)
        else:
            self.state.failed.append(request_id)
        return self._finish(self.method.on_trial_exited_early(request_id, reason, self._new_trial))

    def _finish(self, actions: list[Action]) -> list[Action]:
        actions = self._after(actions)
        ended = set(self.state.completed) | set(self.state.failed) | set(self.state.invalid)
        if (
            not any(isinstance(a, Create) for a in actions)
            and len(ended) >= self.state.trials_requested
            and not self.state.shutdown
        ):
            self.state.shutdown = True
            failure = not self.state.completed and bool(self.state.failed)
            actions.append(Shutdown(failure=failure))
        return actions

    def progress(self) -> float:
        return self.method.progress(self.state)

    def snapshot(self) -> dict[str, Any]:
        return {
            "state": self.state.__dict__,
            "method": self.method.snapshot(),
            "rng": _rng_state(self._rng),
        }

    def restore(self, data: dict[str, Any]) -> None:
        self.state = SearchState(**data["state"])
        self.method.restore(data["method"])
        self._rng.setstate(_rng_from(data["rng"]))


def _rng_state(rng: random.Random) -> list[Any]:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _rng_from(data: list[Any]) -> tuple[Any, ...]:
    return (data[0], tuple(data[1]), data[2])
