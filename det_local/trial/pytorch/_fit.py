"""The typed values a Trainer.fit() passes around: what fit() was asked (FitSettings), the
loop's counters as trial_state.pkl holds them (TrialState), what every part of the loop shares
(TrialEnv), and the interfaces of the loop's parts that differ by kind of trial (Step,
Checkpointer)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any, Protocol

from det_local.trial.pytorch._callback import PyTorchCallback
from det_local.trial.pytorch._errors import InvalidTrialError
from det_local.trial.pytorch._units import TrainUnit


@dataclasses.dataclass(frozen=True)
class FitSettings:
    """fit()'s arguments once checked and completed from the experiment config."""

    max_length: TrainUnit
    checkpoint_period: TrainUnit
    validation_period: TrainUnit
    reporting_period: TrainUnit
    checkpoint_policy: str  # best, all, none
    smaller_is_better: bool
    searcher_metric: str | None
    latest_checkpoint: str | None
    step_zero_validation: bool
    test_mode: bool
    trial_id: int
    profiling_enabled: bool


@dataclasses.dataclass
class TrialState:
    """What trial_state.pkl holds (Determined's keys, in its order)."""

    trial_id: int = 0
    last_ckpt: int = 0
    step_id: int = 0
    last_val: int = 0
    batches_trained: int = 0
    epochs_trained: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_saved(cls, saved: dict[str, Any]) -> TrialState:
        """The fields a trial_state.pkl holds (those it lacks or holds as None: defaults)."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{k: saved[k] for k in names if saved.get(k) is not None})


@dataclasses.dataclass(frozen=True)
class TrialEnv:
    """What the parts of one fit() share: the trial, its context and callbacks, the core
    context and its distributed context, the settings."""

    trial: Any
    context: Any
    callbacks: dict[str, PyTorchCallback]
    settings: FitSettings

    @property
    def core(self) -> Any:
        return self.context._core

    @property
    def dist(self) -> Any:
        return self.context.distributed

    @property
    def name(self) -> str:
        return type(self.trial).__name__

    @property
    def is_chief(self) -> bool:
        return bool(self.dist.rank == 0)


class ShouldExit(Exception):
    """Raised inside the loop to leave it: preemption, a stop request, an invalid hparam."""

    def __init__(self, skip_exit_checkpoint: bool = False) -> None:
        super().__init__()
        self.skip_exit_checkpoint = skip_exit_checkpoint


class Step(Protocol):
    """One training batch of the trial: its metrics (values may stay on the device)."""

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]: ...


class Checkpointer(Protocol):
    """How the loop writes and reads its trial's checkpoints (PyTorch: one writer, possibly in
    the background; DeepSpeed: every rank writes its part)."""

    def save(self, state: TrialState, extra: dict[str, Any]) -> str:
        """Write a checkpoint of the trial now (`extra`: det-local's own state); its uuid, on
        every rank. The callbacks' checkpoint hooks run (for a background write: once written)."""

    def load(self, ckpt_dir: Path, uuid: str) -> dict[str, Any]:
        """Restore the trial from the checkpoint in `ckpt_dir`; det-local's own state in it."""

    def collect(self, wait: bool) -> None:
        """Finish a background write (waiting for it if `wait`); raise if it failed."""

    def abandon(self) -> None:
        """Training failed: finish a background write, logging (not raising) its error."""


def build_callbacks(trial: Any) -> dict[str, PyTorchCallback]:
    """The trial's build_callbacks(), checked: a dict of name -> PyTorchCallback."""
    name = type(trial).__name__
    callbacks = trial.build_callbacks()
    if not isinstance(callbacks, dict) or not all(
        isinstance(k, str) and isinstance(v, PyTorchCallback) for k, v in callbacks.items()
    ):
        raise InvalidTrialError(
            f"{name}.build_callbacks() must return a dict of name -> "
            f"pytorch.PyTorchCallback, found {type(callbacks).__name__}"
        )
    for cb_name, cb in callbacks.items():
        if type(cb).on_checkpoint_end is not PyTorchCallback.on_checkpoint_end:
            warnings.warn(
                f"callback '{cb_name}': on_checkpoint_end is deprecated, please use "
                "on_checkpoint_write_end instead.",
                FutureWarning,
                stacklevel=3,
            )
    return callbacks
