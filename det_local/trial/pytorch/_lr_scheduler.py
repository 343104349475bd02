"""LRScheduler: a torch LR scheduler with a step mode, saved in checkpoints."""

from __future__ import annotations

import enum
from typing import Any


class LRScheduler:
    """Wraps a torch LR scheduler so the loop steps it (per StepMode) and checkpoints its state.

    ``context.wrap_lr_scheduler()`` creates these and returns the scheduler itself."""

    class StepMode(enum.Enum):
        """STEP_EVERY_EPOCH: every ``frequency`` epochs (when the next optimizer step falls in a new
        epoch). STEP_EVERY_BATCH: every ``frequency`` batches, whatever the aggregation.
        MANUAL_STEP: never (you call step()). STEP_EVERY_OPTIMIZER_STEP: every ``frequency``
        optimizer steps."""

        STEP_EVERY_EPOCH = 1
        STEP_EVERY_BATCH = 2
        MANUAL_STEP = 3
        STEP_EVERY_OPTIMIZER_STEP = 4

    def __init__(self, scheduler: Any, step_mode: StepMode, frequency: int = 1) -> None:
        if not isinstance(step_mode, LRScheduler.StepMode):
            raise TypeError(f"step_mode must be an LRScheduler.StepMode, found {step_mode!r}")
        if not isinstance(frequency, int) or isinstance(frequency, bool) or frequency < 1:
            raise ValueError(f"frequency must be a positive int, found {frequency!r}")
        self._scheduler = scheduler
        self._step_mode = step_mode
        self._frequency = frequency

    def step(self, *args: Any, **kwargs: Any) -> None:
        self._scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        result: list[float] = self._scheduler.get_last_lr()
        return result

    def state_dict(self) -> dict[Any, Any]:
        result: dict[Any, Any] = self._scheduler.state_dict()
        return result

    def load_state_dict(self, state_dict: dict[Any, Any]) -> None:
        self._scheduler.load_state_dict(state_dict)


def auto_step(
    sched: LRScheduler, batch_idx: int, aggregation_frequency: int, epoch_len: int
) -> None:
    """Step `sched` as its mode asks after train_batch(batch_idx); called only on batches where
    the optimizer steps (every aggregation_frequency-th)."""
    mode, freq = sched._step_mode, sched._frequency
    if mode == LRScheduler.StepMode.STEP_EVERY_BATCH:
        # the batches since the last optimizer step, each counted
        for i in range(batch_idx - aggregation_frequency + 1, batch_idx + 1):
            if (i + 1) % freq == 0:
                sched.step()
    elif mode == LRScheduler.StepMode.STEP_EVERY_OPTIMIZER_STEP:
        # optimizer steps so far (Determined counts batches here, which differs only when
        # aggregation_frequency > 1; det-local follows its documentation: every N steps)
        if ((batch_idx + 1) // aggregation_frequency) % freq == 0:
            sched.step()
    elif mode == LRScheduler.StepMode.STEP_EVERY_EPOCH:
        # epochs that end before the next optimizer step
        this_epoch = batch_idx // epoch_len
        next_step_epoch = (batch_idx + aggregation_frequency) // epoch_len
        for e in range(this_epoch, next_step_epoch):
            if (e + 1) % freq == 0:
                sched.step()
