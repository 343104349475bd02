"""Plain records read from the store. JSON keys are stable: the CLI's --json prints to_json()."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from det_local.store.states import CheckpointState, State


def json_safe(value: Any) -> Any:
    """NaN and infinities become None so that --json output is valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


@dataclass
class ExperimentRecord:
    id: int
    name: str
    state: State
    user: str
    created_at: float
    ended_at: float | None
    labels: list[str]
    description: str | None
    context_dir: str
    progress: float
    message: str | None
    config: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = self.state.value
        return json_safe(d)


@dataclass
class TrialRecord:
    id: int
    experiment_id: int
    state: State
    hparams: dict[str, Any]
    seed: int
    run_id: int
    restarts: int
    steps_completed: int
    latest_checkpoint: str | None
    warm_start_checkpoint: str | None
    best_validation: float | None
    created_at: float
    ended_at: float | None
    message: str | None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = self.state.value
        return json_safe(d)


# its files removed by checkpoint GC (or its trial); the record stays. The name checkpoint GC
# and the engine import today (CheckpointState.DELETED)
CHECKPOINT_DELETED = CheckpointState.DELETED


@dataclass
class CheckpointRecord:
    uuid: str
    experiment_id: int
    trial_id: int
    steps_completed: int
    # a CheckpointState as read from the store (``| str`` while the trial server still passes
    # the string "COMPLETED", which CheckpointState.COMPLETED equals)
    state: CheckpointState | str
    path: str
    metadata: dict[str, Any]
    resources: dict[str, int]
    created_at: float

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = str(self.state)  # the member's value (CheckpointState.__str__)
        return json_safe(d)


@dataclass
class MetricRecord:
    trial_id: int
    run_id: int
    group: str
    steps_completed: int
    time: float
    metrics: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return json_safe(asdict(self))
