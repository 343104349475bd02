"""pytorch.init() and pytorch.Trainer: the training loop over a PyTorchTrial.

The loop follows Determined's ``_PyTorchTrialController``: after every batch it checks four
boundaries (TRAIN = max_length, VALIDATE, CHECKPOINT, REPORT). When any is reached it aggregates
and reports the training metrics of the batches since the last report, then validates and
checkpoints as the boundaries ask, then checks for preemption or a stop request (checkpoint if
needed and return). At the end it validates and checkpoints unless already done at that batch.

Differences, each deliberate:

* no device synchronisation per batch: training metrics stay on the device (detached) until a
  reporting boundary moves them to the host in one copy per (device, dtype);
* preemption and set_stop_requested() are checked after every batch when the trial runs as one
  process (a flag read on det-local), so a pause does not wait for the next boundary;
* a NaN training loss stops the trial at the next report, naming the batch, before it is saved;
* the data skip on resume comes from the checkpoint itself (trial_state.pkl), so resuming also
  works off-cluster, and validation leaves the training RNG streams untouched, so a run is the
  same whether or not (and how often) it validated or was resumed.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import numbers
import os
import random
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from det_local import __version__
from det_local.trial import InvalidHP
from det_local.trial.info import get_cluster_info
from det_local.trial.pytorch import _checkpoint
from det_local.trial.pytorch._callback import PyTorchCallback
from det_local.trial.pytorch._context import PyTorchTrialContext
from det_local.trial.pytorch._data import DataLoader, dataset_repro_error
from det_local.trial.pytorch._errors import InvalidTrialError, MetricError, NonFiniteLossError
from det_local.trial.pytorch._lr_scheduler import auto_step
from det_local.trial.pytorch._metrics import (
    MetricsBuffer,
    average_across_ranks,
    average_batches,
    first_nan,
    to_host,
    to_python,
)
from det_local.trial.pytorch._reducer import evaluation_reducers, reduce_validation
from det_local.trial.pytorch._trial import (
    PyTorchTrial,
    check_trial,
    evaluate_batch_caller,
    evaluate_batch_defined,
)
from det_local.trial.pytorch._units import (
    Batch,
    Epoch,
    TrainUnit,
    from_searcher_max_length,
    is_length,
)
from det_local.trial.pytorch.samplers import ReproducibleShuffleSampler

logger = logging.getLogger("determined.pytorch")

TEST_MODE_ENV = "DET_LOCAL_TEST_MODE"
_POLICIES = ("best", "all", "none")


# ---------------------------------------------------------------------------- init()
def _set_random_seeds(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass
    torch.random.manual_seed(seed)


def _init_distributed(info: Any, given: Any = None) -> Any:
    """On det-local: the launcher's torch.distributed world, or none for a one-slot trial.
    A DistributedContext the script built itself (Determined's Trainer guide does, before
    pytorch.init()) is used rather than a second one on the same ports."""
    from det_local.trial.core import DistributedContext

    if os.environ.get("USE_TORCH_DISTRIBUTED"):
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
        return given if given is not None else DistributedContext.from_torch_distributed()
    if len(info.container_addrs) > 1 or len(info.slot_ids) > 1:
        raise InvalidTrialError(
            f"this trial has {len(info.slot_ids)} slots: launch it with "
            "`python3 -m determined.launch.torch_distributed python3 train.py` as the entrypoint"
        )
    return None


def _torchrun_distributed() -> Any:
    """Off det-local under torchrun (``torchrun --nproc_per_node=2 train.py``) with no
    DistributedContext given: the torchrun world, as on det-local, rather than N separate
    single-process trainings. None when not under a multi-process torchrun."""
    from det_local.trial.core import DistributedContext

    try:
        world = int(os.environ.get("WORLD_SIZE") or 1)
    except ValueError:
        return None
    if world < 2 or "LOCAL_WORLD_SIZE" not in os.environ or "GROUP_RANK" not in os.environ:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    logger.info(
        f"pytorch.init(): running under torchrun with WORLD_SIZE={world}; using "
        "DistributedContext.from_torch_distributed()"
    )
    return DistributedContext.from_torch_distributed()


@contextlib.contextmanager
def init(
    *,
    hparams: dict[str, Any] | None = None,
    exp_conf: dict[str, Any] | None = None,
    distributed: Any = None,
    aggregation_frequency: int = 1,
    enable_tensorboard_logging: bool = True,
    checkpoint_storage: str | dict[str, Any] | None = None,
) -> Iterator[PyTorchTrialContext]:
    """The PyTorchTrialContext for a Trainer; use as ``with pytorch.init() as context:``.

    Under det-local (a TRIAL's cluster info exists) the random, numpy and torch RNGs are seeded
    with the trial seed, the experiment config, steps completed and (when ``hparams`` is None)
    the trial's hyperparameters come from det-local. Off-cluster the arguments are used as given;
    ``checkpoint_storage`` (a det-local addition) is where core.init() keeps checkpoints then."""

    def make_context(**kwargs: Any) -> PyTorchTrialContext:
        return PyTorchTrialContext(
            aggregation_frequency=aggregation_frequency,
            enable_tensorboard_logging=enable_tensorboard_logging,
            **kwargs,
        )

    with trial_context(
        make_context,
        hparams=hparams,
        exp_conf=exp_conf,
        distributed=distributed,
        checkpoint_storage=checkpoint_storage,
        cluster_distributed=_init_distributed,
        local_distributed=_torchrun_distributed,
    ) as context:
        yield context


@contextlib.contextmanager
def trial_context(
    make_context: Callable[..., Any],
    *,
    hparams: dict[str, Any] | None,
    exp_conf: dict[str, Any] | None,
    distributed: Any,
    checkpoint_storage: str | dict[str, Any] | None,
    cluster_distributed: Callable[[Any, Any], Any],
    local_distributed: Callable[[], Any],
) -> Iterator[Any]:
    """What pytorch.init() and deepspeed.init() share: the distributed context
    (``cluster_distributed(info, given)`` under det-local, ``local_distributed()`` off-cluster
    when none is given), the seeds, core.init(), and ``make_context(core_context=...,
    trial_seed=..., hparams=..., slots_per_trial=..., num_gpus=..., exp_conf=...,
    steps_completed=..., managed_training=True, debug_enabled=...)``. On the way out it closes
    the TensorBoard writer and tears down a process group it made."""
    import torch.distributed as dist

    from det_local.trial import core

    info = get_cluster_info()
    local = info is None or info.task_type != "TRIAL"
    had_group = dist.is_available() and dist.is_initialized()
    if local:
        trial_seed: int | None = None
        steps_completed = 0
        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        debug = False
        if distributed is None:
            distributed = local_distributed()
    else:
        assert info is not None
        distributed = cluster_distributed(info, distributed)
        trial_seed = info.trial.trial_seed
        exp_conf = info.trial._config
        steps_completed = int(info.trial._steps_completed)
        num_gpus = len(info.gpu_uuids)
        debug = bool(info.trial._debug)
        if hparams is None:
            hparams = info.trial.hparams
        _set_random_seeds(int(trial_seed))
    with core.init(
        distributed=distributed,
        checkpoint_storage=checkpoint_storage,
        preempt_mode=core.PreemptMode.WorkersAskChief,
        tensorboard_mode=core.TensorboardMode.MANUAL,
    ) as core_context:
        context = make_context(
            core_context=core_context,
            trial_seed=trial_seed,
            hparams=hparams,
            slots_per_trial=core_context.distributed.get_size(),
            num_gpus=num_gpus,
            exp_conf=exp_conf,
            steps_completed=steps_completed,
            managed_training=True,
            debug_enabled=debug,
        )
        try:
            yield context
        finally:
            if context._tbd_writer is not None:
                context._tbd_writer.close()
            if not had_group and dist.is_available() and dist.is_initialized():
                # the process group init() made goes with it: a rank exiting with a live gloo
                # group can abort at interpreter exit when its peers tear down first
                try:
                    dist.destroy_process_group()
                except Exception:
                    pass


# ---------------------------------------------------------------------------- Trainer
def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


class Trainer:
    """Trains a PyTorchTrial: ``Trainer(trial, context).fit(max_length=pytorch.Epoch(1))``."""

    def _make_controller(self, **kwargs: Any) -> _TrialController:
        return _TrialController(**kwargs)

    def __init__(self, trial: Any, context: Any) -> None:
        self._trial = trial
        self._context = context
        self._core = context._core
        self._info = get_cluster_info()
        self._local_training = self._info is None or self._info.task_type != "TRIAL"
        #: one entry per checkpoint this trainer wrote: uuid, steps_completed, async,
        #: block_ms (training blocked), and for async ones d2h_ms (the host copy) and write_ms
        #: (the background write, once it has finished)
        self.checkpoint_timings: list[dict[str, Any]] = []

    def configure_profiler(self, *args: Any, **kwargs: Any) -> None:
        logger.error(
            "`trainer.configure_profiler` has been replaced with "
            "`fit(..., profiling_enabled=True)` and will be removed in a future release."
        )

    def fit(
        self,
        checkpoint_period: TrainUnit | None = None,
        validation_period: TrainUnit | None = None,
        max_length: TrainUnit | None = None,
        reporting_period: TrainUnit = Batch(100),  # noqa: B008
        checkpoint_policy: str = "best",
        latest_checkpoint: str | None = None,
        step_zero_validation: bool = False,
        test_mode: bool = False,
        profiling_enabled: bool = False,
    ) -> None:
        """Train until ``max_length``, validating every ``validation_period``, checkpointing every
        ``checkpoint_period`` and after validations (``checkpoint_policy``: best, all, none),
        reporting training metrics every ``reporting_period``; resume from
        ``latest_checkpoint`` (a uuid, usually ``det.get_cluster_info().latest_checkpoint``).

        ``test_mode`` (or DET_LOCAL_TEST_MODE=1, set by ``det-local run --test``) trains one
        batch, validates on one batch and checkpoints."""
        test_mode = bool(test_mode) or _truthy(os.environ.get(TEST_MODE_ENV))
        checkpoint_period = checkpoint_period or Batch(sys.maxsize)
        validation_period = validation_period or Batch(sys.maxsize)
        for arg, value in (
            ("checkpoint_period", checkpoint_period),
            ("validation_period", validation_period),
            ("reporting_period", reporting_period),
        ):
            if not isinstance(value, TrainUnit):
                raise InvalidTrialError(
                    f"fit({arg}={value!r}): expected pytorch.Batch(...) or pytorch.Epoch(...)"
                )
        if checkpoint_policy not in _POLICIES:
            raise InvalidTrialError(
                f"fit(checkpoint_policy={checkpoint_policy!r}): expected one of {list(_POLICIES)}"
            )

        searcher_metric: str | None = None
        smaller_is_better = True
        trial_id = 0
        if self._local_training:
            if checkpoint_policy == "best":
                logger.warning(
                    "checkpoint_policy='best' is not supported in local training mode. "
                    "Falling back to 'all'."
                )
                checkpoint_policy = "all"
            if max_length is None and test_mode:
                max_length = Batch(1)
            if max_length is None:
                raise InvalidTrialError(
                    "fit(max_length=...) is required off-cluster: pass pytorch.Batch(N) or "
                    "pytorch.Epoch(N)"
                )
            if profiling_enabled:
                logger.warning("Profiling is not supported in local training mode.")
                profiling_enabled = False
        else:
            info = self._info
            assert info is not None
            if latest_checkpoint is None and info.latest_checkpoint is not None:
                logger.warning(
                    "latest_checkpoint has not been configured. Pause/resume training will not "
                    "be able to continue from latest checkpoint. Did you mean to set "
                    "`fit(latest_checkpoint=info.latest_checkpoint)'?"
                )
            config = info.trial._config
            searcher = config.get("searcher") or {}
            smaller_is_better = bool(searcher.get("smaller_is_better", True))
            searcher_metric = searcher.get("metric")
            trial_id = int(info.trial.trial_id)
            if max_length is None:
                gbs = info.trial.hparams.get("global_batch_size")
                max_length = from_searcher_max_length(
                    searcher.get("max_length"), int(gbs) if gbs else None
                )
                if max_length is not None and not test_mode:
                    warnings.warn(
                        "Configuring `max_length` from the `searcher.max_length` experiment "
                        "config, which was deprecated in 0.38.0 and will be removed in a future "
                        "release. Please set `fit(max_length=X)` with your desired training "
                        "length directly.",
                        FutureWarning,
                        stacklevel=2,
                    )
            if max_length is None and test_mode:
                max_length = Batch(1)
            if max_length is None:
                raise InvalidTrialError(
                    "fit(max_length=...) is required: pass pytorch.Batch(N) or pytorch.Epoch(N) "
                    "(the experiment config has no searcher.max_length to fall back on)"
                )
            if is_length(max_length):
                _check_searcher_length(searcher, max_length)
        if not is_length(max_length):
            raise InvalidTrialError(
                f"fit(max_length={max_length!r}): expected pytorch.Batch(int) or pytorch.Epoch(int)"
            )
        assert max_length is not None
        controller = self._make_controller(
            trial=self._trial,
            context=self._context,
            max_length=max_length,
            checkpoint_period=checkpoint_period,
            validation_period=validation_period,
            reporting_period=reporting_period,
            checkpoint_policy=checkpoint_policy,
            smaller_is_better=smaller_is_better,
            searcher_metric=searcher_metric,
            latest_checkpoint=latest_checkpoint,
            step_zero_validation=step_zero_validation,
            test_mode=test_mode,
            trial_id=trial_id,
            profiling_enabled=profiling_enabled,
            checkpoint_timings=self.checkpoint_timings,
        )
        controller.run()


def _check_searcher_length(searcher: dict[str, Any], max_length: TrainUnit) -> None:
    """Warn when fit(max_length) disagrees with searcher.time_metric/max_time (ASHA's length)."""
    time_metric = searcher.get("time_metric")
    max_time = searcher.get("max_time")
    if time_metric is None or max_time is None:
        return
    expected: TrainUnit | None = None
    if time_metric == "batches":
        expected = Batch(max_time)
    elif time_metric == "epochs":
        expected = Epoch(max_time)
    else:
        logger.warning(
            f"`searcher.time_metric` must be either 'batches' or 'epochs' for training with "
            f"PyTorchTrials, but got {time_metric}. Training will proceed with {max_length} but "
            "may result in unexpected behavior."
        )
        return
    if max_length != expected:
        logger.warning(
            f"`max_length` passed into `fit()` method ({max_length}) does not match "
            f"`searcher.max_time` and `searcher.time_metric` from the experiment config "
            f"({expected}). This may result in unexpected hyperparameter search behavior."
        )


# ---------------------------------------------------------------------------- the loop
class _ShouldExit(Exception):
    def __init__(self, skip_exit_checkpoint: bool = False) -> None:
        super().__init__()
        self.skip_exit_checkpoint = skip_exit_checkpoint


class _TrialState:
    """What trial_state.pkl holds (Determined's keys)."""

    def __init__(
        self,
        trial_id: int = 0,
        last_ckpt: int = 0,
        step_id: int = 0,
        last_val: int = 0,
        batches_trained: int = 0,
        epochs_trained: int = 0,
    ) -> None:
        self.trial_id = trial_id
        self.last_ckpt = last_ckpt
        self.step_id = step_id
        self.last_val = last_val
        self.batches_trained = batches_trained
        self.epochs_trained = epochs_trained


_TRAIN, _VALIDATE, _CHECKPOINT, _REPORT = "TRAIN", "VALIDATE", "CHECKPOINT", "REPORT"


class _Boundary:
    def __init__(self, kind: str, unit: TrainUnit) -> None:
        self.kind = kind
        self.unit = unit
        self.limit_reached = False


class _TrialController:
    def __init__(
        self,
        *,
        trial: PyTorchTrial,
        context: PyTorchTrialContext,
        max_length: TrainUnit,
        checkpoint_period: TrainUnit,
        validation_period: TrainUnit,
        reporting_period: TrainUnit,
        checkpoint_policy: str,
        smaller_is_better: bool,
        searcher_metric: str | None,
        latest_checkpoint: str | None,
        step_zero_validation: bool,
        test_mode: bool,
        trial_id: int,
        profiling_enabled: bool,
        checkpoint_timings: list[dict[str, Any]] | None = None,
    ) -> None:
        self.trial = trial
        self.context = context
        self.core = context._core
        self.dist = context.distributed
        self.name = type(trial).__name__
        self.is_chief = self.dist.rank == 0
        self.max_length = max_length
        self.checkpoint_period = checkpoint_period
        self.validation_period = validation_period
        self.reporting_period = reporting_period
        self.ckpt_policy = checkpoint_policy
        self.smaller_is_better = smaller_is_better
        self.searcher_metric = searcher_metric
        self.latest_checkpoint = latest_checkpoint
        self.step_zero_validation = step_zero_validation
        self.test_mode = test_mode
        self.trial_id = trial_id
        self.profiling_enabled = profiling_enabled
        self._check_trial()
        self.callbacks = self._build_callbacks()
        self.eval_by_batch = evaluate_batch_defined(trial)
        self.call_evaluate_batch = evaluate_batch_caller(trial)
        last_val = getattr(self.core.train, "_get_last_validation", None)
        self.val_from_previous_run: int | None = last_val() if callable(last_val) else None
        self.state = _TrialState(trial_id=trial_id)
        self.metrics = MetricsBuffer()
        self.exhausted = False
        # One process: preemption/stop are flag reads, so check them after every batch.
        self.stop_check_per_batch = self.dist.size == 1
        self.training_loader: Any = None
        self.validation_loader: Any = None
        self.train_iter: Any = None
        self.train_enum: Any = None
        self.train_shuffle: ReproducibleShuffleSampler | None = None
        self._tb_warned = False
        self.async_checkpointing = self._async_checkpointing()
        self.pending_write: _checkpoint.AsyncWrite | None = None
        self.checkpoint_timings = [] if checkpoint_timings is None else checkpoint_timings

    # ------------------------------------------------------------------ what subclasses change
    def _set_training_loader(
        self, skip: int, replicas: int, rank: int, checks_off: bool, *disable_hint: str
    ) -> Any:
        """training_loader from build_training_data_loader(): repeating, sharded over the
        ranks, `skip` batches in (a resumed trial). Returns what the trial built."""
        train_data = self.trial.build_training_data_loader()
        if isinstance(train_data, DataLoader):
            if isinstance(train_data.sampler, ReproducibleShuffleSampler):
                self.train_shuffle = train_data.sampler
            self.training_loader = train_data.get_data_loader(
                repeat=True, skip=skip, num_replicas=replicas, rank=rank
            )
        elif checks_off:
            self.training_loader = train_data
        else:
            raise dataset_repro_error(
                "build_training_data_loader", train_data, self.name, *disable_hint
            )
        return train_data

    def _set_validation_loader(
        self, replicas: int, rank: int, checks_off: bool, *disable_hint: str
    ) -> None:
        """validation_loader from build_validation_data_loader(): sharded over the ranks when
        evaluating by batch; on the chief alone for evaluate_full_dataset."""
        validation_data = self.trial.build_validation_data_loader()
        if not self.eval_by_batch and not self.is_chief:
            self.validation_loader = None  # evaluate_full_dataset runs on the chief alone
        elif isinstance(validation_data, DataLoader):
            shards = (replicas, rank) if self.eval_by_batch else (1, 0)
            self.validation_loader = validation_data.get_data_loader(
                repeat=False, skip=0, num_replicas=shards[0], rank=shards[1]
            )
        elif checks_off:
            self.validation_loader = validation_data
        else:
            raise dataset_repro_error(
                "build_validation_data_loader", validation_data, self.name, *disable_hint
            )

    def _check_trial(self) -> None:
        """The trial is one this loop trains, with what it must have wrapped."""
        check_trial(self.trial)
        if not self.context.models:
            raise InvalidTrialError(
                f"{self.name} wrapped no model: in {self.name}.__init__ write "
                "self.model = context.wrap_model(model)"
            )
        if not self.context.optimizers:
            raise InvalidTrialError(
                f"{self.name} wrapped no optimizer: in {self.name}.__init__ write "
                "self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), ...))"
            )

    def _async_checkpointing(self) -> bool:
        return bool(self.context.experimental._async_checkpointing)

    def _data_skip(self, start: int, saved: dict[str, Any] | None) -> int:
        """How many loader batches a run resuming at batch `start` skips (`saved`: the
        checkpoint's trial_state.pkl, None for a fresh start)."""
        return start

    def _start_iterators(self, start: int) -> None:
        """The training iterator, and train_enum: (batch_idx, batch) from `start` on."""
        self.train_iter = iter(self.training_loader)
        self.train_enum = enumerate(self.train_iter, start=start)

    def _build_callbacks(self) -> dict[str, PyTorchCallback]:
        callbacks = self.trial.build_callbacks()
        if not isinstance(callbacks, dict) or not all(
            isinstance(k, str) and isinstance(v, PyTorchCallback) for k, v in callbacks.items()
        ):
            raise InvalidTrialError(
                f"{self.name}.build_callbacks() must return a dict of name -> "
                f"pytorch.PyTorchCallback, found {type(callbacks).__name__}"
            )
        for name, cb in callbacks.items():
            if type(cb).on_checkpoint_end is not PyTorchCallback.on_checkpoint_end:
                warnings.warn(
                    f"callback '{name}': on_checkpoint_end is deprecated, please use "
                    "on_checkpoint_write_end instead.",
                    FutureWarning,
                    stacklevel=3,
                )
        return callbacks

    # ------------------------------------------------------------------ run
    def run(self) -> None:
        with contextlib.ExitStack() as stack:
            ckpt_stack = contextlib.ExitStack()  # closed once the checkpoint is loaded
            stack.callback(ckpt_stack.close)
            ckpt_dir = None
            saved: dict[str, Any] | None = None
            uuid = self.latest_checkpoint
            if uuid is not None:
                logger.info(f"Restoring trial from checkpoint {uuid}")
                ckpt_dir = ckpt_stack.enter_context(self.core.checkpoint.restore_path(uuid))
                saved = _checkpoint.read_trial_state(ckpt_dir, f"checkpoint {uuid}")
            resuming = saved is not None and saved.get("trial_id") == self.trial_id
            start = int(saved.get("batches_trained") or 0) if resuming and saved else 0
            self.context._steps_completed = start

            for cb in self.callbacks.values():
                cb.on_trial_startup(start, uuid)
                stack.callback(cb.on_trial_shutdown)

            self._set_data_loaders(skip=self._data_skip(start, saved if resuming else None))
            # The iterator exists before the RNG is restored, as in Determined: making it draws
            # from the global RNG, identically in the first and the resumed run.
            self._start_iterators(start)
            stack.callback(self._close_iterator)

            with ckpt_stack:
                if ckpt_dir is not None:
                    assert uuid is not None
                    self._load(ckpt_dir, uuid, saved if resuming else None)

            for cb in self.callbacks.values():
                cb.on_training_start()
            if self.profiling_enabled:
                self.core.profiler.on()
                stack.callback(self.core.profiler.off)
            if self.context.profiler is not None:
                stack.enter_context(self.context.profiler)
            try:
                self._run()
            except BaseException:
                self._abandon_write()
                raise
            self._collect_write(wait=True)

    def _close_iterator(self) -> None:
        # Drop the iterator explicitly so multiprocess loader workers shut down now.
        self.train_enum = None
        self.train_iter = None

    def _run(self) -> None:
        try:
            if (
                self.step_zero_validation
                and self.val_from_previous_run is None
                and self.state.batches_trained == 0
            ):
                self._validate()
            self._train()
        except _ShouldExit as e:
            if not e.skip_exit_checkpoint and not self._checkpoint_is_current():
                self._checkpoint(already_exiting=True)
        except InvalidHP:
            if not self._checkpoint_is_current():
                self._checkpoint(already_exiting=True)
            raise

    # ------------------------------------------------------------------ data
    def _set_data_loaders(self, skip: int) -> None:
        size, rank = self.dist.size, self.dist.rank
        checks_off = self.context.experimental._data_repro_checks_disabled
        self._set_training_loader(skip, size, rank, checks_off)
        try:
            epoch_len = len(self.training_loader)
        except TypeError:
            epoch_len = sys.maxsize
        epoch_len = self.dist.broadcast(epoch_len)
        if not epoch_len:
            raise InvalidTrialError(
                f"{self.name}.build_training_data_loader() returned a loader with no batches; "
                "check the dataset and the batch size"
            )
        self.context._epoch_len = epoch_len

        self._set_validation_loader(size, rank, checks_off)

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
        # test mode trains one batch in this run (a restored run: one past its checkpoint)
        length = Batch(self.state.batches_trained + 1) if self.test_mode else self.max_length
        boundaries = [
            _Boundary(_TRAIN, self.max_length),
            _Boundary(_VALIDATE, self.validation_period),
            _Boundary(_CHECKPOINT, self.checkpoint_period),
            _Boundary(_REPORT, self.reporting_period),
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
                if boundary.kind in (_TRAIN, _REPORT):
                    if self.is_chief and not progress_reported:
                        self._report_progress()
                        progress_reported = True
                elif boundary.kind == _VALIDATE:
                    if not self._validation_is_current():
                        self._validate()
                elif boundary.kind == _CHECKPOINT and not self._checkpoint_is_current():
                    self._checkpoint(already_exiting=False)
                boundary.limit_reached = False
            if hit and self.context.get_enable_tensorboard_logging():
                self._upload_tb_files()
            if self.pending_write is not None:
                self._collect_write(wait=False)
            self._check_stop()
        if self.exhausted and self._steps_until_complete(length) > 0:
            logger.warning(
                f"{self.name}'s training data ran out after {self.state.batches_trained} batches, "
                f"before max_length {self.max_length}; finishing there"
            )
        if not self._validation_is_current():
            self._validate()
        if not self._checkpoint_is_current():
            self._checkpoint(already_exiting=False)

    def _stop_wanted(self) -> bool:
        return self.context.get_stop_requested() or bool(self.core.preempt.should_preempt())

    def _check_stop(self) -> None:
        if self.core.preempt.should_preempt() or self.context.get_stop_requested():
            raise _ShouldExit()

    def _train_until_boundary(self, boundaries: list[_Boundary]) -> None:
        if self.is_chief:
            self.core.train.set_status("training")
        for model in self.context.models:
            model.train()
        self.context.reset_reducers()
        epoch_len = self.context._epoch_len
        assert epoch_len
        for batch_idx, batch in self.train_enum:
            epoch_idx, in_epoch = divmod(batch_idx, epoch_len)
            self.context._current_batch_idx = batch_idx
            if in_epoch == 0:
                self._on_epoch_start(epoch_idx)
            self.metrics.add(batch_idx, self._train_batch(batch, epoch_idx, batch_idx))
            self._step_batch()
            reached = False
            for boundary in boundaries:
                unit = boundary.unit
                if isinstance(unit, Epoch):
                    if in_epoch == epoch_len - 1 and unit.should_stop(epoch_idx + 1):
                        boundary.limit_reached = True
                elif unit.should_stop(batch_idx + 1):
                    boundary.limit_reached = True
                if boundary.kind == _TRAIN and self.test_mode:
                    boundary.limit_reached = True
                reached = reached or boundary.limit_reached
            if reached or (self.stop_check_per_batch and self._stop_wanted()):
                return
        self.exhausted = True

    def _train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        context = self.context
        context._loss_ids = {}
        if context.experimental._auto_to_device:
            batch = context.to_device(batch)
        out = self.trial.train_batch(batch=batch, epoch_idx=epoch_idx, batch_idx=batch_idx)
        if context.profiler is not None:
            context.profiler.step()
        if (
            context._scaler is not None
            and context.experimental._auto_amp
            and context._should_communicate_and_update()
        ):
            context._scaler.update()
        if isinstance(out, torch.Tensor) or (
            isinstance(out, numbers.Number) and not isinstance(out, bool)
        ):
            out = {"loss": out}
        elif not isinstance(out, dict):
            raise InvalidTrialError(
                f"{self.name}.train_batch() returned a {type(out).__name__}; return the loss (a "
                "tensor or number) or a dict of metrics such as {'loss': loss}"
            )
        if context.lr_schedulers and context._should_communicate_and_update():
            assert context._epoch_len
            for sched in context.lr_schedulers:
                auto_step(sched, batch_idx, context._aggregation_frequency, context._epoch_len)
        return out

    def _step_batch(self) -> None:
        self.state.batches_trained += 1
        epoch_len = self.context._epoch_len
        assert epoch_len
        epoch_idx, in_epoch = divmod(self.state.batches_trained - 1, epoch_len)
        if in_epoch == epoch_len - 1:
            for cb in self.callbacks.values():
                cb.on_training_epoch_end(epoch_idx)
            self.state.epochs_trained += 1

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
                self._log_tb("train", avg, rows)
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
        assert isinstance(self.max_length.value, int)
        done = (
            self.state.batches_trained
            if isinstance(self.max_length, Batch)
            else self.state.epochs_trained
        )
        total = self.max_length.value
        progress = 1.0 if total <= 0 else min(max(done / total, 0.0), 1.0)
        self.core.train.report_progress(progress)

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def _validate(self) -> dict[str, Any]:
        if self.is_chief:
            self.core.train.set_status("validating")
        rng = _checkpoint.capture_rng(self.context.device)
        try:
            metrics = self._evaluate()
        finally:
            _checkpoint.restore_rng(rng, self.context.device)
        self.state.last_val = self.state.batches_trained

        best_before: float | None = None
        if self.is_chief:
            self._log_tb("val", metrics, None)
            if self.ckpt_policy == "best":
                best_before = self.core.train.get_experiment_best_validation()
            metrics.setdefault("batches", self.state.batches_trained)
            metrics.setdefault("epochs", self.state.epochs_trained)
            self.core.train.report_validation_metrics(
                steps_completed=self.state.batches_trained, metrics=metrics
            )
        should_checkpoint = False
        if self.is_chief and not self._checkpoint_is_current():
            if self.ckpt_policy == "all":
                should_checkpoint = True
            elif self.ckpt_policy == "best":
                value = self._searcher_value(metrics)
                should_checkpoint = best_before is None or (
                    value < best_before if self.smaller_is_better else value > best_before
                )
        if self.dist.broadcast(should_checkpoint):
            self._checkpoint(already_exiting=False)
        return metrics

    def _evaluate(self) -> dict[str, Any]:
        """Run the validation and return its reduced metrics (plain Python values)."""
        self.context.reset_reducers()
        for model in self.context.models:
            model.eval()
        for cb in self.callbacks.values():
            cb.on_validation_start()
        started = time.time()
        metrics: dict[str, Any] = {}
        if self.eval_by_batch:
            for cb in self.callbacks.values():
                cb.on_validation_epoch_start()
            rows, keys, records = self._evaluate_batches()
            rows = to_host(rows)
            for cb in self.callbacks.values():
                cb.on_validation_epoch_end(rows)
            reducers = evaluation_reducers(self.trial.evaluation_reducer(), list(keys), self.name)
            metrics = reduce_validation(self.dist, rows, reducers)
            counts = self.dist.gather((records, len(rows)))
            if self.is_chief and counts:
                total_records = sum(c[0] for c in counts)
                total_batches = sum(c[1] for c in counts)
                took = time.time() - started
                logger.info(
                    f"validated: {total_records} records in {took:.3f}s "
                    f"({total_records / max(took, 1e-9):.3f} records/s), in {total_batches} batches"
                )
        elif self.is_chief:
            out = self.trial.evaluate_full_dataset(data_loader=self.validation_loader)
            if not isinstance(out, dict):
                raise InvalidTrialError(
                    f"{self.name}.evaluate_full_dataset() returned a {type(out).__name__}; return "
                    "a dict of metric name -> value"
                )
            metrics = {k: to_python(v) for k, v in out.items()}
        metrics.update(self.context.reduce_metrics(for_training=False))
        if self.dist.size > 1 and any(
            type(cb).on_validation_end is not PyTorchCallback.on_validation_end
            for cb in self.callbacks.values()
        ):
            metrics = self.dist.broadcast(metrics)
        for cb in self.callbacks.values():
            cb.on_validation_end(metrics)
        return metrics

    def _evaluate_batches(self) -> tuple[list[dict[str, Any]], list[str], int]:
        """evaluate_batch() over the validation loader: (its metrics per batch, their names,
        records seen)."""
        keys: Any = None
        rows: list[dict[str, Any]] = []
        records = 0
        for idx, batch in enumerate(self.validation_loader):
            if self.context.experimental._auto_to_device:
                batch = self.context.to_device(batch)
            records += self.trial.get_batch_length(batch)
            out = self.call_evaluate_batch(batch, idx)
            keys = self._check_eval_row(out, idx, keys)
            rows.append(
                {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
            )
            if self.test_mode:
                break
        if not rows:
            raise InvalidTrialError(
                f"{self.name}.build_validation_data_loader() gave no batches"
                + (f" on rank {self.dist.rank}" if self.dist.size > 1 else "")
                + "; validation needs at least one batch"
            )
        return rows, list(keys), records

    def _check_eval_row(self, out: Any, idx: int, keys: Any) -> Any:
        """evaluate_batch()'s answer is a dict with the names of the batches before; its keys."""
        if not isinstance(out, dict):
            raise InvalidTrialError(
                f"{self.name}.evaluate_batch() returned a {type(out).__name__}; return a "
                "dict of metric name -> value"
            )
        if keys is None:
            return out.keys()
        if out.keys() != keys:
            raise InvalidTrialError(
                f"{self.name}.evaluate_batch() returned metrics {sorted(out)} for batch "
                f"{idx} but {sorted(keys)} before; return the same names for every batch"
            )
        return keys

    def _searcher_value(self, metrics: dict[str, Any]) -> float:
        name = self.searcher_metric
        if name is None:
            raise InvalidTrialError(
                "checkpoint_policy='best' needs searcher.metric in the experiment config"
            )
        if name not in metrics:
            found = sorted(k for k in metrics if k not in ("batches", "epochs"))
            raise MetricError(
                f"the searcher metric '{name}' (searcher.metric) is not among the validation "
                f"metrics {found} of {self.name}; return '{name}' from evaluate_batch()/"
                "evaluate_full_dataset() or set searcher.metric to one of them"
            )
        value = metrics[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MetricError(
                f"the searcher metric '{name}' is {value!r} ({type(value).__name__}), not a "
                "number; return a scalar for it"
            )
        return float(value)

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self, already_exiting: bool) -> None:
        if self.is_chief:
            self.core.train.set_status("checkpointing")
        self.state.last_ckpt = self.state.batches_trained
        is_async = self.async_checkpointing and self.is_chief
        try:
            uuid = ""
            if self.is_chief:
                metadata = {
                    "determined_version": __version__,
                    "steps_completed": self.state.batches_trained,
                    "framework": f"torch-{torch.__version__}",
                    "format": "pickle",
                }
                storage = getattr(self.core.checkpoint, "_storage", None)
                exclude = [storage] if storage is not None else []
                if is_async:
                    uuid = self._checkpoint_async(metadata, exclude)
                else:
                    started = time.perf_counter()
                    with self.core.checkpoint.store_path(metadata) as (path, storage_id):
                        _checkpoint.save(
                            path,
                            context=self.context,
                            trial=self.trial,
                            callbacks=self.callbacks,
                            trial_state=vars(self.state),
                            exclude=exclude,
                            extra=self._det_local_state(),
                        )
                        uuid = storage_id
                    self.checkpoint_timings.append(
                        {
                            "uuid": uuid,
                            "steps_completed": self.state.batches_trained,
                            "async": False,
                            "block_ms": (time.perf_counter() - started) * 1000,
                        }
                    )
            uuid = self.dist.broadcast(uuid)
            if not is_async:  # an async one's callbacks run once it is written
                for cb in self.callbacks.values():
                    cb.on_checkpoint_upload_end(uuid=uuid)
        except InvalidHP:
            if not already_exiting:
                from det_local.trial.core import EarlyExitReason

                self.core.train.report_early_exit(EarlyExitReason.INVALID_HP)
                raise _ShouldExit(skip_exit_checkpoint=True) from None
            raise

    def _checkpoint_async(self, metadata: dict[str, Any], exclude: list[Any]) -> str:
        """Snapshot the state to host memory here; write and report it on a background thread.
        Waits first for the previous write (one in flight at a time)."""
        started = time.perf_counter()
        self._collect_write(wait=True)
        copy_started = time.perf_counter()
        checkpoint = _checkpoint.host_copy(
            _checkpoint.capture(self.context, self.callbacks, self._det_local_state())
        )
        d2h_ms = (time.perf_counter() - copy_started) * 1000
        trial_state = dict(vars(self.state))
        load_data = _checkpoint.host_copy(_checkpoint.load_data_of(self.context, self.trial))
        code_root = Path.cwd()
        store = self.core.checkpoint.store_path(metadata)
        path, uuid = store.__enter__()

        def job() -> None:
            try:
                _checkpoint.write(
                    path,
                    checkpoint,
                    trial_state=trial_state,
                    load_data=load_data,
                    code_root=code_root,
                    exclude=exclude,
                    fsync=True,
                )
            except BaseException as err:
                store.__exit__(type(err), err, err.__traceback__)  # removes the directory
                raise
            store.__exit__(None, None, None)  # metadata.json, then reported to det-local

        self.pending_write = _checkpoint.AsyncWrite(
            job, uuid=uuid, steps=self.state.batches_trained, path=path
        )
        self.checkpoint_timings.append(
            {
                "uuid": uuid,
                "steps_completed": self.state.batches_trained,
                "async": True,
                "block_ms": (time.perf_counter() - started) * 1000,
                "d2h_ms": d2h_ms,
                "write_ms": None,
            }
        )
        return str(uuid)

    def _collect_write(self, wait: bool) -> None:
        """Finish the background write (waiting for it if `wait`): raise if it failed, else run
        the callbacks' end-of-checkpoint hooks."""
        pending = self.pending_write
        if pending is None or not (wait or pending.done()):
            return
        self.pending_write = None
        pending.wait()
        for entry in reversed(self.checkpoint_timings):
            if entry["uuid"] == pending.uuid:
                entry["write_ms"] = pending.write_ms
                logger.info(
                    f"checkpoint {pending.uuid} (batch {pending.steps}) written in the background "
                    f"in {pending.write_ms or 0:.0f} ms; training was blocked "
                    f"{entry['block_ms']:.1f} ms"
                )
                break
        for cb in self.callbacks.values():
            cb.on_checkpoint_end(str(pending.path))
            cb.on_checkpoint_write_end(str(pending.path))
        for cb in self.callbacks.values():
            cb.on_checkpoint_upload_end(uuid=pending.uuid)

    def _abandon_write(self) -> None:
        """Training failed: still finish the write in flight, logging (not raising) its error."""
        if self.pending_write is None:
            return
        try:
            self._collect_write(wait=True)
        except Exception as err:
            logger.error(str(err))

    def _load(self, ckpt_dir: Any, uuid: str, saved: dict[str, Any] | None) -> None:
        where = f"checkpoint {uuid}"
        checkpoint = _checkpoint.read_state_dict(ckpt_dir, where)
        load_data = _checkpoint.read_load_data(ckpt_dir) or {}
        _checkpoint.restore(
            checkpoint,
            where=where,
            context=self.context,
            trial=self.trial,
            callbacks=self.callbacks,
            saved_spec=load_data.get("trial_cls_spec"),
        )
        self._resume_state(checkpoint.get("det_local") or {}, saved)

    def _resume_state(self, det_local: dict[str, Any], saved: dict[str, Any] | None) -> None:
        """The loop's counters from trial_state.pkl (`saved`; None: a fresh trial starting from
        another trial's weights) and det-local's own state from the checkpoint."""
        if saved is None:
            self.state = _TrialState(trial_id=self.trial_id)
            return
        # the training shuffle continues with the seed it started with, however this run's
        # loader was seeded (no pass has started yet: the skip replays from the first epoch)
        seed = det_local.get("train_shuffle_seed")
        if seed is not None and self.train_shuffle is not None:
            self.train_shuffle._reseed(int(seed))
        fields = vars(_TrialState())
        self.state = _TrialState(**{k: saved[k] for k in fields if saved.get(k) is not None})
        if saved.get("epochs_trained") is None and self.context._epoch_len:
            self.state.epochs_trained = self.state.batches_trained // self.context._epoch_len
        if self.state.batches_trained == self.val_from_previous_run:
            self.state.last_val = self.state.batches_trained

    def _det_local_state(self) -> dict[str, Any]:
        if self.train_shuffle is None:
            return {}
        return {"train_shuffle_seed": self.train_shuffle.seed}

    # ------------------------------------------------------------------ tensorboard
    def _tb_writer(self) -> Any:
        if not self.context.get_enable_tensorboard_logging():
            return None
        if self.context._tbd_writer is None:
            import importlib.util

            if importlib.util.find_spec("tensorboard") is None:
                if not self._tb_warned:
                    self._tb_warned = True
                    logger.info("tensorboard is not installed: metrics are not written for it")
                return None
        return self.context.get_tensorboard_writer()

    def _log_tb(
        self, kind: str, metrics: dict[str, Any], batch_metrics: list[dict[str, Any]] | None
    ) -> None:
        writer = self._tb_writer()
        if writer is None:
            return
        steps = self.state.batches_trained
        seen: set[str] = set()
        for i, row in enumerate(batch_metrics or []):
            at = steps - len(batch_metrics or []) + i
            for name, value in row.items():
                if _is_scalar(value):
                    writer.add_scalar("Determined/" + name, value, at)
                seen.add(name)
        for name, value in metrics.items():
            if name in seen:
                continue
            tag = name if kind != "val" or name.startswith("val") else "val_" + name
            if _is_scalar(value):
                writer.add_scalar("Determined/" + tag, value, steps)

    def _upload_tb_files(self) -> None:
        self.context._maybe_reset_tbd_writer()
        self.core.train.upload_tensorboard_files()


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
