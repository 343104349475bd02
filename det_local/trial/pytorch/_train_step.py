"""One training batch of a PyTorchTrial, as pytorch.Trainer's loop runs it: the batch moved to
the device, train_batch(), the AMP scaler and the LR schedulers stepped; its metrics as a dict
(left on the device). And the check that a trial is one this loop trains."""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import Tensor

from det_local.trial.pytorch._errors import InvalidTrialError
from det_local.trial.pytorch._lr_scheduler import auto_step
from det_local.trial.pytorch._trial import check_trial


def check_pytorch_trial(trial: Any, context: Any) -> None:
    """The trial is a PyTorchTrial, with the model and optimizer it must have wrapped."""
    name = type(trial).__name__
    check_trial(trial)
    if not context.models:
        raise InvalidTrialError(
            f"{name} wrapped no model: in {name}.__init__ write "
            "self.model = context.wrap_model(model)"
        )
    if not context.optimizers:
        raise InvalidTrialError(
            f"{name} wrapped no optimizer: in {name}.__init__ write "
            "self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), ...))"
        )


def as_metrics(out: Any, name: str) -> dict[str, Any]:
    """train_batch()'s answer as a dict of metrics: a loss alone becomes {"loss": loss}."""
    if isinstance(out, torch.Tensor) or (
        isinstance(out, numbers.Number) and not isinstance(out, bool)
    ):
        return {"loss": out}
    if not isinstance(out, dict):
        raise InvalidTrialError(
            f"{name}.train_batch() returned a {type(out).__name__}; return the loss (a "
            "tensor or number) or a dict of metrics such as {'loss': loss}"
        )
    return out


class PyTorchStep:
    """train_batch(batch, epoch_idx, batch_idx) for a PyTorchTrial."""

    def __init__(self, trial: Any, context: Any) -> None:
        self.trial = trial
        self.context = context
        self.name = type(trial).__name__
        self.on_cpu = context.device.type == "cpu"

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        context = self.context
        if context.experimental._auto_to_device:
            moved = not self.on_cpu or type(batch) not in (tuple, list)
            if not moved:  # tensors on the CPU device are where they go: nothing to look at
                for value in batch:
                    if type(value) is not Tensor:
                        moved = True
                        break
            if moved:
                batch = context.to_device(batch)
        out = self.trial.train_batch(batch=batch, epoch_idx=epoch_idx, batch_idx=batch_idx)
        if context.profiler is not None:
            context.profiler.step()
        if context._scaler is not None or context.lr_schedulers:
            self._after_step(batch_idx)
        if type(out) is dict:  # the common answer, as is
            return out
        return as_metrics(out, self.name)

    def _after_step(self, batch_idx: int) -> None:
        """The AMP scaler and the LR schedulers, stepped on the batches that update."""
        context = self.context
        if not context._should_communicate_and_update():
            return
        if context._scaler is not None and context.experimental._auto_amp:
            context._scaler.update()
        if context.lr_schedulers:
            assert context._epoch_len
            for sched in context.lr_schedulers:
                auto_step(sched, batch_idx, context._aggregation_frequency, context._epoch_len)
