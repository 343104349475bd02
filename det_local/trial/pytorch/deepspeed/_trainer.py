"""deepspeed.init() and deepspeed.Trainer: pytorch.Trainer's loop over a DeepSpeedTrial.

The loop is pytorch.Trainer's (boundaries, reporting, validation, checkpoint policy, preemption,
resume); what differs, as in Determined's DeepSpeedTrialController:

* train_batch() gets an iterator over the training loader and is called
  gradient_accumulation_steps times per batch (once for a pipeline engine or after
  disable_auto_grad_accumulation()); the metrics of one batch are the mean of its calls';
* an epoch is len(training loader) // gradient_accumulation_steps batches (a legacy Trial class
  with records_per_epoch in its config: records_per_epoch // train_batch_size);
* evaluate_batch() gets an iterator over the validation loader, called len(loader) times
  (// gradient_accumulation_steps for a pipeline engine);
* a checkpoint is written by every rank: trial.save(context, path) (each engine's
  save_checkpoint(path, tag="model<i>")) and det_state_dict_rank<r>.pth (RNG and callback
  state), plus the chief's trial_state.pkl, load_data.json and code/; load is the reverse, on
  every rank;
* the resumed training loader skips the loader batches the checkpointed run drew (recorded in
  trial_state.pkl), so a resume continues on the next micro-batch whatever train_batch() drew.
"""

from __future__ import annotations

import itertools
import logging
import math
import numbers
import sys
from collections.abc import Iterator
from typing import Any

import torch

from det_local.trial.pytorch._data import DataLoader
from det_local.trial.pytorch._errors import InvalidTrialError
from det_local.trial.pytorch._evaluate import Evaluator
from det_local.trial.pytorch._fit import FitSettings, TrialEnv, build_callbacks
from det_local.trial.pytorch._loop import Parts
from det_local.trial.pytorch._train_step import as_metrics
from det_local.trial.pytorch._trainer import Trainer as _PyTorchTrainer
from det_local.trial.pytorch._training_data import TrainingData
from det_local.trial.pytorch._trial import check_evaluate, evaluate_batch_defined
from det_local.trial.pytorch.deepspeed._checkpointer import LOADER_BATCHES, DeepSpeedCheckpointer
from det_local.trial.pytorch.deepspeed._context import DeepSpeedTrialContext
from det_local.trial.pytorch.deepspeed._trial import DeepSpeedTrial

logger = logging.getLogger("determined.pytorch.deepspeed")

_DISABLE_CHECKS = "context.disable_dataset_reproducibility_checks()"


class Trainer(_PyTorchTrainer):
    """Trains a DeepSpeedTrial: ``deepspeed.Trainer(trial, context).fit(max_length=...)``,
    with the arguments of pytorch.Trainer.fit()."""

    def _parts(self, settings: FitSettings) -> Parts:
        trial, context = self._trial, self._context
        check_deepspeed_trial(trial, context)
        env = TrialEnv(trial, context, build_callbacks(trial), settings)
        data = DeepSpeedTrainingData(env, evaluate_batch_defined(trial, DeepSpeedTrial))
        return Parts(
            env=env,
            step=DeepSpeedStep(trial, context, data),
            data=data,
            evaluator=DeepSpeedEvaluator(env, data),
            checkpointer=DeepSpeedCheckpointer(env, data, self.checkpoint_timings),
        )


def check_deepspeed_trial(trial: Any, context: Any) -> None:
    """The trial is a DeepSpeedTrial built with deepspeed.init()'s context, with an engine."""
    name = type(trial).__name__
    if not isinstance(trial, DeepSpeedTrial):
        raise InvalidTrialError(
            f"deepspeed.Trainer needs a DeepSpeedTrial instance, found "
            f"{name}; subclass determined.pytorch.deepspeed.DeepSpeedTrial"
            " (or train a PyTorchTrial with pytorch.Trainer)"
        )
    if not isinstance(context, DeepSpeedTrialContext):
        raise InvalidTrialError(
            f"deepspeed.Trainer needs the context deepspeed.init() yields, found a "
            f"{type(context).__name__}"
        )
    check_evaluate(trial, DeepSpeedTrial)
    if not context.models:
        raise InvalidTrialError(
            f"{name} wrapped no model engine: in {name}.__init__ write "
            "self.engine = context.wrap_model_engine(engine) with the engine "
            "deepspeed.initialize() returned"
        )


class _CountingIterator:
    """The training iterator handed to train_batch(); counts the loader batches drawn."""

    def __init__(self, it: Iterator[Any], drawn: int) -> None:
        self._it = it
        self.drawn = drawn

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> Any:
        item = next(self._it)
        self.drawn += 1
        return item


def _mean(values: list[Any]) -> Any:
    """The mean of one metric over a batch's train_batch() calls (tensors stay on the device)."""
    if len(values) == 1:
        return values[0]
    if all(isinstance(v, torch.Tensor) for v in values):
        try:
            return torch.stack([v.detach().float() for v in values]).mean(dim=0)
        except RuntimeError:  # different shapes: keep the last
            return values[-1]
    if all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
        return math.fsum(float(v) for v in values) / len(values)
    return values[-1]


class DeepSpeedTrainingData(TrainingData):
    """A DeepSpeedTrial's loaders: built where the MPU says, sharded over the data-parallel
    ranks; the training iterator counts the loader batches train_batch() draws, and a resumed
    run skips the ones the checkpointed run drew."""

    def __init__(self, env: TrialEnv, eval_by_batch: bool) -> None:
        super().__init__(env, eval_by_batch)
        self.num_validation_batches = 0
        self.loader_skip = 0
        self.train_iter: _CountingIterator | None = None

    def data_skip(self, start: int, saved: dict[str, Any] | None) -> int:
        drawn = (saved or {}).get(LOADER_BATCHES)
        context = self.env.context
        if isinstance(drawn, int) and drawn >= 0:
            self.loader_skip = drawn
        else:  # a checkpoint det-local did not write: assume whole batches of micro-batches
            per_batch = 1 if context._manual_grad_accumulation else None
            self.loader_skip = start * (per_batch or context.get_num_micro_batches_per_slot())
        return self.loader_skip

    def start(self, start: int) -> None:
        if self.training_loader is None:
            self.train_iter = None
        else:
            self.train_iter = _CountingIterator(iter(self.training_loader), self.loader_skip)
        self.train_enum = ((idx, None) for idx in itertools.count(start))

    def set_loaders(self, skip: int) -> None:
        env = self.env
        ctx = env.context
        mpu = ctx._mpu
        replicas, rank = mpu.data_parallel_world_size, mpu.data_parallel_rank
        checks_off = ctx._data_repro_checks_disabled
        self.training_loader = None
        self.validation_loader = None
        train_len: int | None = None
        val_len: int | None = None
        if mpu.should_build_data_loader:
            train_data = self.set_training_loader(skip, replicas, rank, checks_off, _DISABLE_CHECKS)
            if not isinstance(train_data, DataLoader):  # allowed: reproducibility checks off
                logger.warning(
                    f"{env.name}.build_training_data_loader() returned a "
                    f"{type(train_data).__name__}: make sure it repeats indefinitely"
                )
            self.set_validation_loader(replicas, rank, checks_off, _DISABLE_CHECKS)
            try:
                train_len = len(self.training_loader)
            except TypeError:
                train_len = sys.maxsize
            if self.validation_loader is not None:
                val_len = len(self.validation_loader)
                if ctx.use_pipeline_parallel:
                    val_len //= ctx.get_num_micro_batches_per_slot()
        lengths = env.dist.allgather((train_len, val_len))
        train_lens = [t for t, _ in lengths if t is not None]
        val_lens = [v for _, v in lengths if v is not None]
        if not train_lens:
            raise InvalidTrialError(
                "no rank built a training data loader: the MPU's should_build_data_loader is "
                "False everywhere"
            )
        if min(train_lens) != max(train_lens) and env.is_chief:
            logger.warning(
                "the training loaders have different lengths on different ranks; epochs use "
                "the shortest"
            )
        epoch_len = min(train_lens) // ctx.get_num_micro_batches_per_slot()
        records_per_epoch = int((ctx._exp_conf or {}).get("records_per_epoch") or 0)
        if ctx._is_pre_trainer and records_per_epoch:
            # a legacy Trial class: Determined <= 0.37 counted epochs in records
            epoch_len = max(records_per_epoch // int(ctx.models[0].train_batch_size()), 1)
        if not epoch_len:
            raise InvalidTrialError(
                f"{env.name}.build_training_data_loader() gives {min(train_lens)} micro-batches, "
                f"fewer than gradient_accumulation_steps ({ctx.get_num_micro_batches_per_slot()})"
                ": not one batch per epoch; use more data or a smaller micro-batch size"
            )
        ctx._epoch_len = epoch_len
        self.num_validation_batches = min(val_lens) if val_lens else 0


class DeepSpeedStep:
    """train_batch(None, epoch_idx, batch_idx) for a DeepSpeedTrial: the trial's train_batch()
    over the training iterator, once per micro-batch unless the engine accumulates itself."""

    def __init__(self, trial: Any, context: Any, data: DeepSpeedTrainingData) -> None:
        self.trial = trial
        self.context = context
        self.data = data
        self.name = type(trial).__name__

    def _micro_batches(self) -> int:
        """train_batch() calls per batch."""
        ctx = self.context
        if ctx.use_pipeline_parallel or ctx._manual_grad_accumulation:
            return 1
        return int(ctx.get_num_micro_batches_per_slot())

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        ctx = self.context
        ctx._loss_ids = {}
        calls = self._micro_batches()
        rows: list[dict[str, Any]] = []
        for _ in range(calls):
            try:
                out = self.trial.train_batch(self.data.train_iter, epoch_idx, batch_idx)
            except StopIteration:
                raise InvalidTrialError(
                    f"{self.name}.train_batch(): the training data ran out at batch {batch_idx}; "
                    "a custom training loader must repeat indefinitely (or return a "
                    "pytorch.DataLoader, which does)"
                ) from None
            if not ctx._mpu.should_report_metrics:
                continue
            rows.append(as_metrics(out, self.name))
        if ctx.profiler is not None:
            ctx.profiler.step()
        engine = ctx.models[0]
        accumulation = ctx.get_num_micro_batches_per_slot()
        micro_steps = getattr(engine, "micro_steps", None)
        if (
            not ctx.use_pipeline_parallel
            and isinstance(micro_steps, int)
            and micro_steps % accumulation
        ):
            raise InvalidTrialError(
                f"{self.name}.train_batch(): after batch {batch_idx} the engine has trained "
                f"{micro_steps} micro-batches, not a multiple of gradient_accumulation_steps "
                f"({accumulation}); call engine.backward() and engine.step() once per "
                "micro-batch"
                + (
                    ", for every micro-batch of the batch (disable_auto_grad_accumulation())"
                    if ctx._manual_grad_accumulation
                    else ""
                )
            )
        if not rows:
            return {}
        keys = list(rows[0])
        return {k: _mean([r[k] for r in rows if k in r]) for k in keys}


class DeepSpeedEvaluator(Evaluator):
    """evaluate_batch() gets an iterator over the validation loader, called
    num_validation_batches times."""

    data: DeepSpeedTrainingData

    def __init__(self, env: TrialEnv, data: DeepSpeedTrainingData) -> None:
        super().__init__(env, data)

    def evaluate_batches(self) -> tuple[list[dict[str, Any]], list[str], int]:
        env, data = self.env, self.data
        context = env.context
        it = iter(data.validation_loader) if data.validation_loader is not None else None
        keys: Any = None
        rows: list[dict[str, Any]] = []
        records = 0
        micro = context.get_train_micro_batch_size_per_gpu()
        per_call = micro * (
            context.get_num_micro_batches_per_slot() if context.use_pipeline_parallel else 1
        )
        for idx in range(data.num_validation_batches):
            out = env.trial.evaluate_batch(it, idx)
            records += per_call
            if context._mpu.should_report_metrics:
                keys = self.check_row(out, idx, keys)
                rows.append(
                    {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
                )
            if env.settings.test_mode:
                break
        names = [k for k in env.dist.allgather(list(keys) if keys is not None else None) if k]
        if not names:
            raise InvalidTrialError(
                f"{env.name}.build_validation_data_loader() gave no batches; validation needs "
                "at least one"
            )
        return rows, list(names[0]), records
