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
    """Bookkeeping common to every search method (persisted with the experiment)."""

    trials_requested: int = 0
    trials_closed: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)
    shutdown: bool = False
