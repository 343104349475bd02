"""PyTorchTrial: the class a user subclasses to train with pytorch.Trainer."""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable
from typing import Any

import torch

from det_local.trial.pytorch._callback import PyTorchCallback
from det_local.trial.pytorch._context import PyTorchTrialContext
from det_local.trial.pytorch._data import TorchData, data_length
from det_local.trial.pytorch._errors import InvalidTrialError
from det_local.trial.pytorch._reducer import Reducer


class PyTorchTrial(metaclass=abc.ABCMeta):
    """Subclass it: ``__init__(context)`` builds and wraps models/optimizers/schedulers,
    ``train_batch`` trains one batch, ``build_training_data_loader`` /
    ``build_validation_data_loader`` return ``pytorch.DataLoader``s, and exactly one of
    ``evaluate_batch`` / ``evaluate_full_dataset`` computes validation metrics."""

    def __new__(cls, *args: Any, **kwargs: Any) -> PyTorchTrial:
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:
            raise InvalidTrialError(
                f"{cls.__name__} does not define {', '.join(m + '()' for m in missing)}, which "
                "every PyTorchTrial must implement; add "
                f"{'it' if len(missing) == 1 else 'them'} to the class"
            )
        return object.__new__(cls)

    @abc.abstractmethod
    def __init__(self, context: PyTorchTrialContext) -> None:
        """Build models, optimizers and LR schedulers and wrap them with the context."""

    @abc.abstractmethod
    def train_batch(self, batch: TorchData, epoch_idx: int, batch_idx: int) -> Any:
        """Train on one batch: forward, ``context.backward(loss)``,
        ``context.step_optimizer(opt)``. Return the loss (a tensor or number: reported as
        "loss") or a dict of metrics (tensors stay on the device until a report)."""

    @abc.abstractmethod
    def build_training_data_loader(self) -> Any:
        """A pytorch.DataLoader (a torch DataLoader needs
        context.experimental.disable_dataset_reproducibility_checks())."""

    @abc.abstractmethod
    def build_validation_data_loader(self) -> Any:
        """A pytorch.DataLoader for validation."""

    def build_callbacks(self) -> dict[str, PyTorchCallback]:
        """{name: callback}; the name keys the callback's state in checkpoints."""
        return {}

    def evaluate_batch(self, batch: TorchData, batch_idx: int) -> dict[str, Any]:
        """Validation metrics of one batch (reduced over batches by evaluation_reducer())."""
        raise NotImplementedError

    def evaluation_reducer(self) -> Reducer | dict[str, Reducer]:
        """How evaluate_batch() metrics are combined: one Reducer or {metric: Reducer}."""
        return Reducer.AVG

    def evaluate_full_dataset(self, data_loader: torch.utils.data.DataLoader) -> dict[str, Any]:  # type: ignore[type-arg]
        """Validation metrics over the whole loader, computed on the chief alone."""
        raise NotImplementedError

    def get_batch_length(self, batch: Any) -> int:
        """Records in a batch (default: length of its first tensor)."""
        return data_length(batch)


def _overrides(trial: Any, name: str, base: type = PyTorchTrial) -> bool:
    method = getattr(type(trial), name, None)
    return method is not None and method is not getattr(base, name)


def evaluate_batch_defined(trial: Any, base: type = PyTorchTrial) -> bool:
    return _overrides(trial, "evaluate_batch", base)


def check_trial(trial: Any) -> None:
    """The trial is a PyTorchTrial with exactly one evaluate method."""
    if not isinstance(trial, PyTorchTrial):
        raise InvalidTrialError(
            f"pytorch.Trainer needs a PyTorchTrial instance, found {type(trial).__name__}; "
            "subclass determined.pytorch.PyTorchTrial"
        )
    check_evaluate(trial, PyTorchTrial)


def check_evaluate(trial: Any, base: type) -> None:
    """The trial overrides exactly one of evaluate_batch() and evaluate_full_dataset()."""
    name = type(trial).__name__
    batch = _overrides(trial, "evaluate_batch", base)
    full = _overrides(trial, "evaluate_full_dataset", base)
    if batch and full:
        raise InvalidTrialError(
            f"{name} defines both evaluate_batch() and evaluate_full_dataset(); keep one "
            "(evaluate_batch() is recommended: it runs on every slot)"
        )
    if not batch and not full:
        raise InvalidTrialError(
            f"{name} defines neither evaluate_batch() nor evaluate_full_dataset(); add one that "
            "returns a dict of validation metrics"
        )


def evaluate_batch_caller(trial: PyTorchTrial) -> Callable[[Any, int], Any]:
    """How to call evaluate_batch: with batch_idx when its signature takes one (by keyword when
    named batch_idx, as Determined calls it), else with the batch alone."""
    fn = trial.evaluate_batch
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return lambda batch, idx: fn(batch, idx)
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p for p in params.values() if p.kind in kinds]
    var_positional = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params.values())
    if "batch_idx" in params:
        if "batch" in params:
            return lambda batch, idx: fn(batch=batch, batch_idx=idx)
        return lambda batch, idx: fn(batch, batch_idx=idx)
    if len(positional) >= 2 or var_positional:
        return lambda batch, idx: fn(batch, idx)
    return lambda batch, idx: fn(batch)  # type: ignore[call-arg]
