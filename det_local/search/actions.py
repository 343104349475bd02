"""What a searcher asks the experiment to do. Searchers are pure state machines over events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union


@dataclass(frozen=True)
class Create:
    request_id: str
    hparams: dict[str, Any]
    seed: int
    warm_start_checkpoint: str | None = None


@dataclass(frozen=True)
class ValidateAfter:
    """<=0.37: train the trial until `length` (absolute, in the searcher's units), then report."""

    request_id: str
    length: int


@dataclass(frozen=True)
class Close:
    """No more operations for this trial: once it runs out of them it is done."""

    request_id: str


@dataclass(frozen=True)
class Stop:
    """0.38: stop the trial now (it is preempted, checkpoints and completes)."""

    request_id: str


@dataclass(frozen=True)
class Shutdown:
    failure: bool = False
    cancel: bool = False


Action = Union[Create, ValidateAfter, Close, Stop, Shutdown]


@dataclass
class SearchState:
    """Bookkeeping common to every search method (persisted with the experiment).

    `trials_closed`: trials the searcher sent Close; `completed`: trials that exited normally;
    `failed`: trials that ended early (errored or canceled), `canceled` the canceled among them;
    `invalid`: trials that ended with InvalidHP. `trial_progress`: the fraction each live trial
    reported (request id -> 0..1)."""

    trials_requested: int = 0
    trials_closed: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)
    shutdown: bool = False
    canceled: list[str] = field(default_factory=list)
    trial_progress: dict[str, float] = field(default_factory=dict)

    def ended(self, request_id: str) -> bool:
        return (
            request_id in self.completed or request_id in self.failed or request_id in self.invalid
        )
