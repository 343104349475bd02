"""DeepSpeedTrial: the class a user subclasses to train DeepSpeed engines with det-local."""

from __future__ import annotations

import abc
import pathlib
from collections.abc import Iterator
from typing import Any

from det_local.errors import CheckpointError
from det_local.trial.pytorch._callback import PyTorchCallback
from det_local.trial.pytorch._data import data_length
from det_local.trial.pytorch._errors import InvalidTrialError
from det_local.trial.pytorch._reducer import Reducer
from det_local.trial.pytorch.deepspeed._context import DeepSpeedTrialContext


class DeepSpeedTrial(metaclass=abc.ABCMeta):
    """Subclass it: ``__init__(context)`` builds the model, calls ``deepspeed.initialize`` and
    registers the engine with ``context.wrap_model_engine``; ``train_batch`` and
    ``evaluate_batch`` get an *iterator* over the data loader (draw micro-batches with
    ``next()``); ``save``/``load`` default to DeepSpeed's own checkpoint files."""

    def __new__(cls, *args: Any, **kwargs: Any) -> DeepSpeedTrial:
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:
            raise InvalidTrialError(
                f"{cls.__name__} does not define {', '.join(m + '()' for m in missing)}, which "
                "every DeepSpeedTrial must implement; add "
                f"{'it' if len(missing) == 1 else 'them'} to the class"
            )
        return object.__new__(cls)

    @abc.abstractmethod
    def __init__(self, context: DeepSpeedTrialContext) -> None:
        """Build the model(s), ``deepspeed.initialize(...)``, ``context.wrap_model_engine()``."""

    @abc.abstractmethod
    def train_batch(
        self, dataloader_iter: Iterator[Any] | None, epoch_idx: int, batch_idx: int
    ) -> Any:
        """Train one micro-batch: ``batch = self.context.to_device(next(dataloader_iter))``,
        forward, ``engine.backward(loss)``, ``engine.step()``; return the loss or a dict of
        metrics. Called gradient_accumulation_steps times per batch (once with a pipeline
        engine, whose ``engine.train_batch(dataloader_iter)`` draws them all, or after
        ``context.disable_auto_grad_accumulation()``)."""

    @abc.abstractmethod
    def build_training_data_loader(self) -> Any:
        """A pytorch.DataLoader with batches of train_micro_batch_size_per_gpu records."""

    @abc.abstractmethod
    def build_validation_data_loader(self) -> Any:
        """A pytorch.DataLoader for validation (micro-batches as well)."""

    def build_callbacks(self) -> dict[str, PyTorchCallback]:
        """{name: callback}; the name keys the callback's state in checkpoints."""
        return {}

    def evaluate_batch(
        self, dataloader_iter: Iterator[Any] | None, batch_idx: int
    ) -> dict[str, Any]:
        """Validation metrics of one batch drawn from ``dataloader_iter`` (reduced over the
        batches by evaluation_reducer())."""
        raise NotImplementedError

    def evaluate_full_dataset(self, data_loader: Any) -> dict[str, Any]:
        """Validation metrics over the whole loader, computed on the chief alone."""
        raise NotImplementedError

    def evaluation_reducer(self) -> Reducer | dict[str, Reducer]:
        """How evaluate_batch() metrics are combined: one Reducer or {metric: Reducer}."""
        return Reducer.AVG

    def get_batch_length(self, batch: Any) -> int:
        """Records in a batch (default: length of its first tensor)."""
        return data_length(batch)

    def save(self, context: DeepSpeedTrialContext, path: pathlib.Path) -> None:
        """Write the engines' state into the checkpoint directory ``path``; called on every
        rank (each writes its own shards). Default: ``engine.save_checkpoint(path,
        tag=f"model{i}")`` for each wrapped engine."""
        for i, engine in enumerate(context.models):
            engine.save_checkpoint(path, tag=f"model{i}")

    def load(self, context: DeepSpeedTrialContext, path: pathlib.Path) -> None:
        """Restore what save() wrote; called on every rank. Default:
        ``engine.load_checkpoint(path, tag=f"model{i}")`` for each wrapped engine."""
        for i, engine in enumerate(context.models):
            load_engine(engine, i, path)


def load_engine(engine: Any, index: int, path: pathlib.Path, **kwargs: Any) -> None:
    """``engine.load_checkpoint(path, tag=f"model{index}", **kwargs)``, DeepSpeed's failures
    (bare asserts, a None load path) raised as one-line CheckpointErrors."""
    try:
        loaded = engine.load_checkpoint(path, tag=f"model{index}", **kwargs)
    except AssertionError as err:  # DeepSpeed's checks are bare asserts
        detail = f": {err}" if str(err) else ""
        raise CheckpointError(
            f"DeepSpeed could not load engine {index} from {path}/model{index}{detail}; the "
            "checkpoint was written with a different model, DeepSpeed config or slot count"
        ) from None
    if isinstance(loaded, tuple) and loaded and loaded[0] is None:
        raise CheckpointError(
            f"DeepSpeed found no checkpoint for engine {index} in {path}/model{index}; was it "
            "written by a trial with the same number of engines?"
        )
