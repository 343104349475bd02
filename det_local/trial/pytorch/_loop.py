"""The training loop of pytorch.Trainer and deepspeed.Trainer, after Determined's
``_PyTorchTrialController``: after every batch it checks four boundaries (TRAIN = max_length,
VALIDATE, CHECKPOINT, REPORT). When any is reached it aggregates and reports the training
metrics of the batches since the last report, then validates and checkpoints as the boundaries
ask, then checks for preemption or a stop request (checkpoint if needed and return). At the end
it validates and checkpoints unless already done at that batch.

Differences, each deliberate:

* no device synchronisation per batch: training metrics stay on the device (detached) until a
  reporting boundary moves them to the host in one copy per (device, dtype);
* preemption and set_stop_requested() are checked after every batch when the trial runs as one
  process (a flag read on det-local), so a pause does not wait for the next boundary;
* a NaN training loss stops the trial at the next report, naming the batch, before it is saved;
* the data skip on resume comes from the checkpoint itself (trial_state.pkl), so resuming also
  works off-cluster, and validation leaves the training RNG streams untouched, so a run is the
  same whether or not (and how often) it validated or was resumed.

The loop owns the order of things and the counters (TrialState); what a kind of trial does
differently lives in its parts (Parts): the batch step, the data, the evaluator, the
checkpointer; TensorBoard has its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import inspect
import logging
from typing import Any

import torch

from det_local.trial import InvalidHP
from det_local.trial.pytorch._errors import InvalidTrialError, MetricError, NonFiniteLossError
from det_local.trial.pytorch._evaluate import Evaluator
from det_local.trial.pytorch._fit import Checkpointer, ShouldExit, Step, TrialEnv, TrialState
from det_local.trial.pytorch._metrics import (
    MetricsBuffer,
    average_across_ranks,
    average_batches,
    first_nan,
)
from det_local.trial.pytorch._tensorboard import TensorBoardLog
from det_local.trial.pytorch._training_data import TrainingData
from det_local.trial.pytorch._units import Batch, Epoch, TrainUnit
from det_local.trial.pytorch.checkpoints import _checkpoint

logger = logging.getLogger("determined.pytorch")


@dataclasses.dataclass(frozen=True)
class Parts:
    """What one kind of trial (PyTorchTrial, DeepSpeedTrial) plugs into the loop."""

    env: TrialEnv
    step: Step
    data: TrainingData
    evaluator: Evaluator
    checkpointer: Checkpointer


class Kind(enum.Enum):
    TRAIN = "TRAIN"  # max_length
    VALIDATE = "VALIDATE"
    CHECKPOINT = "CHECKPOINT"
    REPORT = "REPORT"


@dataclasses.dataclass(slots=True)
class Boundary:
    kind: Kind
    unit: TrainUnit
    limit_reached: bool = False


class TrialController:
    """One fit(): run() trains until max_length, a stop request or preemption."""

    def __init__(self, parts: Parts) -> None:
        env = parts.env
        self.env = env
        self.settings = env.settings
        self.trial = env.trial
        self.context = env.context
        self.core = env.core
        self.dist = env.dist
        self.callbacks = env.callbacks
        self.name = env.name
        self.is_chief = env.is_chief
        self.step = parts.step
        self.data = parts.data
        self.evaluator = parts.evaluator
        self.checkpointer = parts.checkpointer
        self.tensorboard = TensorBoardLog(env.context, env.core)
        last_val = getattr(self.core.train, "_get_last_validation", None)
        self.val_from_previous_run: int | None = last_val() if callable(last_val) else None
        self.state = TrialState(trial_id=self.settings.trial_id)
        self.metrics = MetricsBuffer()
        self.exhausted = False
        # One process: preemption/stop are flag reads, so check them after every batch.
        self.stop_check_per_batch = self.dist.size == 1

    # ------------------------------------------------------------------ run
    def run(self) -> None:
        settings, data = self.settings, self.data
        with contextlib.ExitStack() as stack:
            ckpt_stack = contextlib.ExitStack()  # closed once the checkpoint is loaded
            stack.callback(ckpt_stack.close)
            ckpt_dir = None
            saved: dict[str, Any] | None = None
            uuid = settings.latest_checkpoint
            if uuid is not None:
                logger.info(f"Restoring trial from checkpoint {uuid}")
                ckpt_dir = ckpt_stack.enter_context(self.core.checkpoint.restore_path(uuid))
                saved = _checkpoint.read_trial_state(ckpt_dir, f"checkpoint {uuid}")
            resuming = saved is not None and saved.get("trial_id") == settings.trial_id
            start = int(saved.get("batches_trained") or 0) if resuming and saved else 0
            self.context._steps_completed = start

            for cb in self.callbacks.values():
                cb.on_trial_startup(start, uuid)
                stack.callback(cb.on_trial_shutdown)

            data.set_loaders(skip=data.data_skip(start, saved if resuming else None))
            # The iterator exists before the RNG is restored, as in Determined: making it draws
            # from the global RNG, identically in the first and the resumed run.
            data.start(start)
            stack.callback(data.close)

            with ckpt_stack:
                if ckpt_dir is not None:
                    assert uuid is not None
                    det_local = self.checkpointer.load(ckpt_dir, uuid)
                    self._resume(det_local, saved if resuming else None)

            for cb in self.callbacks.values():
                cb.on_training_start()
            if settings.profiling_enabled:
                self.core.profiler.on()
                stack.callback(self.core.profiler.off)
            if self.context.profiler is not None:
                stack.enter_context(self.context.profiler)
            try:
                self._run()
            except BaseException:
                self.checkpointer.abandon()
                raise
            self.checkpointer.collect(wait=True)

    def _resume(self, det_local: dict[str, Any], saved: dict[str, Any] | None) -> None:
        """The loop's counters from trial_state.pkl (`saved`; None: a fresh trial starting from
        another trial's weights) and det-local's own state from the checkpoint."""
        if saved is None:
            self.state = TrialState(trial_id=self.settings.trial_id)
            return
        self.data.resume(det_local)
        self.state = TrialState.from_saved(saved)
        if saved.get("epochs_trained") is None and self.context._epoch_len:
            self.state.epochs_trained = self.state.batches_trained // self.context._epoch_len
        if self.state.batches_trained == self.val_from_previous_run:
            self.state.last_val = self.state.batches_trained

    def _run(self) -> None:
        try:
            if (
                self.settings.step_zero_validation
                and self.val_from_previous_run is None
                and self.state.batches_trained == 0
            ):
                self._validate()
            self._train()
        except ShouldExit as e:
            if not e.skip_exit_checkpoint and not self._checkpoint_is_current():
                self._checkpoint(already_exiting=True)
        except InvalidHP:
            if not self._checkpoint_is_current():
                self._checkpoint(already_exiting=True)
            raise

    # ------------------------------------------------------------------ training
    def _steps_until_complete(self, unit: TrainUnit) -> int:
        assert isinstance(unit.value, int)
        if isinstance(unit, Batch):
            return unit.value - self.state.batches_trained
        return unit.value - self.state.epochs_trained

    def _checkpoint_is_current(self) -> bool:
        return self.state.last_ckpt == self.state.batches_trained

    def _validation_is_current(self) -> bool:
        return self.state.last_val == self.state.batches_trained

    def _train(self) -> None:
        settings = self.settings
        # test mode trains one batch in this run (a restored run: one past its checkpoint)
        length = (
            Batch(self.state.batches_trained + 1) if settings.test_mode else settings.max_length
        )
        boundaries = [
            Boundary(Kind.TRAIN, settings.max_length),
            Boundary(Kind.VALIDATE, settings.validation_period),
            Boundary(Kind.CHECKPOINT, settings.checkpoint_period),
            Boundary(Kind.REPORT, settings.reporting_period),
        ]
        while self._steps_until_complete(length) > 0 and not self.exhausted:
            self._train_until_boundary(boundaries)
            metrics = self._report_training()
            for cb in self.callbacks.values():
                cb.on_training_workload_end(
                    avg_metrics=metrics["avg_metrics"], batch_metrics=metrics["batch_metrics"]
                )
            progress_reported = False
            hit = False
            for boundary in boundaries:
                if not boundary.limit_reached:
                    continue
                hit = True
                if boundary.kind in (Kind.TRAIN, Kind.REPORT):
                    if self.is_chief and not progress_reported:
                        self._report_progress()
                        progress_reported = True
                elif boundary.kind == Kind.VALIDATE:
                    if not self._validation_is_current():
                        self._validate()
                elif boundary.kind == Kind.CHECKPOINT and not self._checkpoint_is_current():
                    self._checkpoint(already_exiting=False)
                boundary.limit_reached = False
            if hit and self.tensorboard.enabled:
                self.tensorboard.upload()
            self.checkpointer.collect(wait=False)
            self._check_stop()
        if self.exhausted and self._steps_until_complete(length) > 0:
            logger.warning(
                f"{self.name}'s training data ran out after {self.state.batches_trained} batches, "
                f"before max_length {settings.max_length}; finishing there"
            )
        if not self._validation_is_current():
            self._validate()
        if not self._checkpoint_is_current():
            self._checkpoint(already_exiting=False)

    def _check_stop(self) -> None:
        if self.core.preempt.should_preempt() or self.context.get_stop_requested():
            raise ShouldExit()

    def _train_until_boundary(self, boundaries: list[Boundary]) -> None:
        """Train batches until a boundary is reached (or a stop is wanted, or the data end).

        The per-batch path is kept to what a hand-written loop cannot avoid either (issue 28:
        bench/trainer_overhead.py's launch-bound pair): the batch, its step, its metrics kept
        on the device, the counters; the boundaries are evaluated only from the first batch at
        which one of them can be reached (`_first_stop`), the preemption and stop check is two
        flag reads."""
        if self.is_chief:
            self.core.train.set_status("training")
        for model in self.context.models:
            model.train()
        self.context.reset_reducers()
        context, state = self.context, self.state
        epoch_len = context._epoch_len
        assert epoch_len
        train_batch = self.step.train_batch
        add = self.metrics.adder()
        callbacks = list(self.callbacks.values())
        stop_at = self._first_stop(boundaries, state.batches_trained, epoch_len)
        stop_check = self.stop_check_per_batch
        preempt = self.core.preempt
        holder = getattr(preempt, "_flag_holder", lambda: None)()
        for batch_idx, batch in self.data.train_enum:
            epoch_idx = batch_idx // epoch_len
            context._current_batch_idx = batch_idx
            if callbacks and batch_idx % epoch_len == 0:
                self._on_epoch_start(epoch_idx)
            add(batch_idx, train_batch(batch, epoch_idx, batch_idx))
            state.batches_trained += 1
            if (state.batches_trained - 1) % epoch_len == epoch_len - 1:
                for cb in callbacks:
                    cb.on_training_epoch_end((state.batches_trained - 1) // epoch_len)
                state.epochs_trained += 1
            if batch_idx + 1 >= stop_at and self._reached(boundaries, batch_idx, epoch_len):
                return
            if stop_check and (
                context._stop_requested
                or (holder is not None and holder.preempted and preempt.should_preempt())
            ):
                return
        self.exhausted = True

    def _first_stop(self, boundaries: list[Boundary], done: int, epoch_len: int) -> int:
        """The first batch count after `done` at which a boundary can be reached: before it,
        none is (0: one of them has a schedule, so every batch is checked)."""
        if self.settings.test_mode:
            return done + 1
        first = None
        for boundary in boundaries:
            value = boundary.unit.value
            if not isinstance(value, int) or isinstance(value, bool):
                return 0
            period = max(value, 1) * (epoch_len if isinstance(boundary.unit, Epoch) else 1)
            at = (done // period + 1) * period
            first = at if first is None else min(first, at)
        return first if first is not None else 0

    def _reached(self, boundaries: list[Boundary], batch_idx: int, epoch_len: int) -> bool:
        """Mark the boundaries reached at this batch; whether any is."""
        epoch_idx, in_epoch = divmod(batch_idx, epoch_len)
        reached = False
        for boundary in boundaries:
            unit = boundary.unit
            if isinstance(unit, Epoch):
                if in_epoch == epoch_len - 1 and unit.should_stop(epoch_idx + 1):
                    boundary.limit_reached = True
            elif unit.should_stop(batch_idx + 1):
                boundary.limit_reached = True
            if self.settings.test_mode and boundary.kind is Kind.TRAIN:
                boundary.limit_reached = True
            reached = reached or boundary.limit_reached
        return reached

    def _on_epoch_start(self, epoch_idx: int) -> None:
        for cb in self.callbacks.values():
            if inspect.signature(cb.on_training_epoch_start).parameters:
                cb.on_training_epoch_start(epoch_idx)
            else:
                logger.warning(
                    "on_training_epoch_start() without parameters is deprecated since 0.17.8. "
                    "Please add epoch_idx parameter."
                )
                cb.on_training_epoch_start()  # type: ignore[call-arg]

    def _report_training(self) -> dict[str, Any]:
        """Aggregate the buffered batches (the one host transfer), report them, check the loss."""
        idxs, rows = self.metrics.drain()
        if self.dist.size > 1:
            gathered = self.dist.gather(rows)
            if self.is_chief:
                rows = average_across_ranks(gathered)
        reduced = self.context.reduce_metrics(for_training=True)
        result: dict[str, Any] = {"avg_metrics": {}, "batch_metrics": [], "nan_at": -1}
        if self.is_chief:
            avg = average_batches(rows)
            avg.update(reduced)
            nan_at = first_nan(idxs, rows, "loss") if self.context._scaler is None else -1
            if rows or reduced:
                self.tensorboard.log("train", self.state.batches_trained, avg, rows)
                avg.setdefault("batches", self.state.batches_trained)
                avg.setdefault("epochs", self.state.epochs_trained)
                self.core.train.report_training_metrics(
                    steps_completed=self.state.batches_trained,
                    metrics=avg,
                    batch_metrics=rows,
                )
            result = {
                "avg_metrics": avg,
                "batch_metrics": rows,
                "nan_at": nan_at,
                "range": (idxs[0], idxs[-1]) if idxs else None,
            }
        result = self.dist.broadcast(result)
        if result["nan_at"] >= 0:
            at = result["nan_at"]
            first, last = result["range"]
            raise NonFiniteLossError(
                f"{self.name}.train_batch() returned a NaN loss at batch_idx={at} (epoch "
                f"{at // (self.context._epoch_len or 1)}; found when reporting batches "
                f"{first}-{last}): training is diverging or the data holds NaN/inf; lower the "
                "learning rate, clip gradients (step_optimizer(opt, clip_grads=...)) or check "
                "the data. Nothing after the last checkpoint was saved"
            )
        return result

    def _report_progress(self) -> None:
        max_length = self.settings.max_length
        assert isinstance(max_length.value, int)
        done = (
            self.state.batches_trained
            if isinstance(max_length, Batch)
            else self.state.epochs_trained
        )
        total = max_length.value
        progress = 1.0 if total <= 0 else min(max(done / total, 0.0), 1.0)
        self.core.train.report_progress(progress)

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def _validate(self) -> dict[str, Any]:
        settings = self.settings
        if self.is_chief:
            self.core.train.set_status("validating")
        rng = _checkpoint.capture_rng(self.context.device)
        try:
            metrics = self.evaluator.evaluate()
        finally:
            _checkpoint.restore_rng(rng, self.context.device)
        self.state.last_val = self.state.batches_trained

        best_before: float | None = None
        if self.is_chief:
            self.tensorboard.log("val", self.state.batches_trained, metrics, None)
            if settings.checkpoint_policy == "best":
                best_before = self.core.train.get_experiment_best_validation()
            metrics.setdefault("batches", self.state.batches_trained)
            metrics.setdefault("epochs", self.state.epochs_trained)
            self.core.train.report_validation_metrics(
                steps_completed=self.state.batches_trained, metrics=metrics
            )
        should_checkpoint = False
        if self.is_chief and not self._checkpoint_is_current():
            if settings.checkpoint_policy == "all":
                should_checkpoint = True
            elif settings.checkpoint_policy == "best":
                value = searcher_value(metrics, settings.searcher_metric, self.name)
                should_checkpoint = best_before is None or (
                    value < best_before if settings.smaller_is_better else value > best_before
                )
        if self.dist.broadcast(should_checkpoint):
            self._checkpoint(already_exiting=False)
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self, already_exiting: bool) -> None:
        if self.is_chief:
            self.core.train.set_status("checkpointing")
        self.state.last_ckpt = self.state.batches_trained
        try:
            self.checkpointer.save(self.state, self.data.det_local_state())
        except InvalidHP:
            if not already_exiting:
                from det_local.trial.core import EarlyExitReason

                self.core.train.report_early_exit(EarlyExitReason.INVALID_HP)
                raise ShouldExit(skip_exit_checkpoint=True) from None
            raise


def searcher_value(metrics: dict[str, Any], name: str | None, trial_name: str) -> float:
    """The searcher metric among the validation metrics, as a number (checkpoint_policy best)."""
    if name is None:
        raise InvalidTrialError(
            "checkpoint_policy='best' needs searcher.metric in the experiment config"
        )
    if name not in metrics:
        found = sorted(k for k in metrics if k not in ("batches", "epochs"))
        raise MetricError(
            f"the searcher metric '{name}' (searcher.metric) is not among the validation "
            f"metrics {found} of {trial_name}; return '{name}' from evaluate_batch()/"
            "evaluate_full_dataset() or set searcher.metric to one of them"
        )
    value = metrics[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MetricError(
            f"the searcher metric '{name}' is {value!r} ({type(value).__name__}), not a "
            "number; return a scalar for it"
        )
    return float(value)
