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

import contextlib
import itertools
import logging
import math
import numbers
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from det_local import __version__
from det_local.launch.ports import free_port
from det_local.trial import InvalidHP
from det_local.trial.pytorch import _checkpoint
from det_local.trial.pytorch._callback import PyTorchCallback
from det_local.trial.pytorch._data import DataLoader
from det_local.trial.pytorch._errors import InvalidTrialError
from det_local.trial.pytorch._trainer import Trainer as _PyTorchTrainer
from det_local.trial.pytorch._trainer import _ShouldExit, _TrialController, trial_context
from det_local.trial.pytorch._trial import check_evaluate, evaluate_batch_defined
from det_local.trial.pytorch.deepspeed._context import DeepSpeedTrialContext
from det_local.trial.pytorch.deepspeed._trial import DeepSpeedTrial

logger = logging.getLogger("determined.pytorch.deepspeed")

MANUAL_INIT_ENV = "DET_MANUAL_INIT_DISTRIBUTED"
_DISABLE_CHECKS = "context.disable_dataset_reproducibility_checks()"
_LOADER_BATCHES = "det_local_loader_batches"  # trial_state.pkl: loader batches drawn


# ---------------------------------------------------------------------------- init()
def _one_process_world(port: int | None) -> None:
    """The variables DeepSpeed's init_distributed() reads, for a world of this process alone
    (no launcher set them)."""
    defaults = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_SIZE": "1",
        "CROSS_RANK": "0",
        "CROSS_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port or free_port()),
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def _world_context() -> Any:
    """The DistributedContext of the launcher's world, None for a world of one."""
    from det_local.trial.core import DistributedContext

    if int(os.environ.get("WORLD_SIZE") or 1) < 2:
        return None
    if "LOCAL_SIZE" not in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        return DistributedContext.from_torch_distributed()  # torchrun (a legacy entrypoint)
    return DistributedContext.from_deepspeed()


def _init_deepspeed_distributed() -> None:
    import deepspeed

    deepspeed.init_distributed(auto_mpi_discovery=False)


def _cluster_distributed(info: Any, given: Any) -> Any:
    """Under det-local: DeepSpeed's process group (deepspeed.init_distributed(), unless
    DET_MANUAL_INIT_DISTRIBUTED is set), then the launcher's DistributedContext."""
    if os.environ.get(MANUAL_INIT_ENV):
        if given is not None:
            return given
        if os.environ.get("USE_DEEPSPEED") or "WORLD_SIZE" in os.environ:
            return _world_context()
        if len(info.container_addrs) > 1 or len(info.slot_ids) > 1:
            raise InvalidTrialError(
                f"this trial has {len(info.slot_ids)} slots: launch it with "
                "`python3 -m determined.launch.deepspeed python3 train.py` as the entrypoint"
            )
        return None
    if "WORLD_SIZE" not in os.environ:
        if len(info.container_addrs) > 1 or len(info.slot_ids) > 1:
            raise InvalidTrialError(
                f"this trial has {len(info.slot_ids)} slots: launch it with "
                "`python3 -m determined.launch.deepspeed python3 train.py` as the entrypoint"
            )
        port = os.environ.get("C10D_PORT")
        _one_process_world(int(port) if port and port.isdigit() else None)
    _init_deepspeed_distributed()
    return given if given is not None else _world_context()


def _local_distributed() -> Any:
    """Off-cluster: the world of the launcher that started this script (deepspeed, torchrun),
    or a world of this process alone, in which DeepSpeed's engines can be built."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            _one_process_world(None)
        _init_deepspeed_distributed()
    return _world_context()


@contextlib.contextmanager
def init(
    *,
    hparams: dict[str, Any] | None = None,
    exp_conf: dict[str, Any] | None = None,
    distributed: Any = None,
    enable_tensorboard_logging: bool = True,
    checkpoint_storage: str | dict[str, Any] | None = None,
) -> Iterator[DeepSpeedTrialContext]:
    """The DeepSpeedTrialContext for a Trainer: ``with deepspeed.init() as context:``.

    Under det-local it initialises DeepSpeed's distributed backend
    (``deepspeed.init_distributed(auto_mpi_discovery=False)``, unless the environment sets
    DET_MANUAL_INIT_DISTRIBUTED) and uses ``DistributedContext.from_deepspeed()``; seeds the
    RNGs with the trial seed; the config, steps completed and (when ``hparams`` is None) the
    hyperparameters are the trial's. Off-cluster the arguments are used as given."""

    def make_context(**kwargs: Any) -> DeepSpeedTrialContext:
        return DeepSpeedTrialContext(
            enable_tensorboard_logging=enable_tensorboard_logging, **kwargs
        )

    with trial_context(
        make_context,
        hparams=hparams,
        exp_conf=exp_conf,
        distributed=distributed,
        checkpoint_storage=checkpoint_storage,
        cluster_distributed=_cluster_distributed,
        local_distributed=_local_distributed,
    ) as context:
        yield context


# ---------------------------------------------------------------------------- Trainer
class Trainer(_PyTorchTrainer):
    """Trains a DeepSpeedTrial: ``deepspeed.Trainer(trial, context).fit(max_length=...)``,
    with the arguments of pytorch.Trainer.fit()."""

    def _make_controller(self, **kwargs: Any) -> _TrialController:
        return _DeepSpeedTrialController(**kwargs)


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


class _DeepSpeedTrialController(_TrialController):
    trial: Any
    context: Any

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.eval_by_batch = evaluate_batch_defined(self.trial, DeepSpeedTrial)
        self.num_validation_batches = 0
        self.loader_skip = 0

    # ------------------------------------------------------------------ checks and data
    def _check_trial(self) -> None:
        if not isinstance(self.trial, DeepSpeedTrial):
            raise InvalidTrialError(
                f"deepspeed.Trainer needs a DeepSpeedTrial instance, found "
                f"{type(self.trial).__name__}; subclass determined.pytorch.deepspeed.DeepSpeedTrial"
                " (or train a PyTorchTrial with pytorch.Trainer)"
            )
        if not isinstance(self.context, DeepSpeedTrialContext):
            raise InvalidTrialError(
                f"deepspeed.Trainer needs the context deepspeed.init() yields, found a "
                f"{type(self.context).__name__}"
            )
        check_evaluate(self.trial, DeepSpeedTrial)
        if not self.context.models:
            raise InvalidTrialError(
                f"{self.name} wrapped no model engine: in {self.name}.__init__ write "
                "self.engine = context.wrap_model_engine(engine) with the engine "
                "deepspeed.initialize() returned"
            )

    def _async_checkpointing(self) -> bool:
        return False

    def _micro_batches(self) -> int:
        """train_batch() calls per batch."""
        ctx = self.context
        if ctx.use_pipeline_parallel or ctx._manual_grad_accumulation:
            return 1
        return int(ctx.get_num_micro_batches_per_slot())

    def _data_skip(self, start: int, saved: dict[str, Any] | None) -> int:
        drawn = (saved or {}).get(_LOADER_BATCHES)
        if isinstance(drawn, int) and drawn >= 0:
            self.loader_skip = drawn
        else:  # a checkpoint det-local did not write: assume whole batches of micro-batches
            per_batch = 1 if self.context._manual_grad_accumulation else None
            self.loader_skip = start * (per_batch or self.context.get_num_micro_batches_per_slot())
        return self.loader_skip

    def _start_iterators(self, start: int) -> None:
        if self.training_loader is None:
            self.train_iter = None
        else:
            self.train_iter = _CountingIterator(iter(self.training_loader), self.loader_skip)
        self.train_enum = ((idx, None) for idx in itertools.count(start))

    def _set_data_loaders(self, skip: int) -> None:
        ctx = self.context
        mpu = ctx._mpu
        replicas, rank = mpu.data_parallel_world_size, mpu.data_parallel_rank
        checks_off = ctx._data_repro_checks_disabled
        self.training_loader = None
        self.validation_loader = None
        train_len: int | None = None
        val_len: int | None = None
        if mpu.should_build_data_loader:
            train_data = self._set_training_loader(
                skip, replicas, rank, checks_off, _DISABLE_CHECKS
            )
            if not isinstance(train_data, DataLoader):  # allowed: reproducibility checks off
                logger.warning(
                    f"{self.name}.build_training_data_loader() returned a "
                    f"{type(train_data).__name__}: make sure it repeats indefinitely"
                )
            self._set_validation_loader(replicas, rank, checks_off, _DISABLE_CHECKS)
            try:
                train_len = len(self.training_loader)
            except TypeError:
                train_len = sys.maxsize
            if self.validation_loader is not None:
                val_len = len(self.validation_loader)
                if ctx.use_pipeline_parallel:
                    val_len //= ctx.get_num_micro_batches_per_slot()
        lengths = self.dist.allgather((train_len, val_len))
        train_lens = [t for t, _ in lengths if t is not None]
        val_lens = [v for _, v in lengths if v is not None]
        if not train_lens:
            raise InvalidTrialError(
                "no rank built a training data loader: the MPU's should_build_data_loader is "
                "False everywhere"
            )
        if min(train_lens) != max(train_lens) and self.is_chief:
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
                f"{self.name}.build_training_data_loader() gives {min(train_lens)} micro-batches, "
                f"fewer than gradient_accumulation_steps ({ctx.get_num_micro_batches_per_slot()})"
                ": not one batch per epoch; use more data or a smaller micro-batch size"
            )
        ctx._epoch_len = epoch_len
        self.num_validation_batches = min(val_lens) if val_lens else 0

    # ------------------------------------------------------------------ training
    def _train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        ctx = self.context
        ctx._loss_ids = {}
        calls = self._micro_batches()
        rows: list[dict[str, Any]] = []
        for _ in range(calls):
            try:
                out = self.trial.train_batch(self.train_iter, epoch_idx, batch_idx)
            except StopIteration:
                raise InvalidTrialError(
                    f"{self.name}.train_batch(): the training data ran out at batch {batch_idx}; "
                    "a custom training loader must repeat indefinitely (or return a "
                    "pytorch.DataLoader, which does)"
                ) from None
            if not ctx._mpu.should_report_metrics:
                continue
            if isinstance(out, torch.Tensor) or (
                isinstance(out, numbers.Number) and not isinstance(out, bool)
            ):
                out = {"loss": out}
            elif not isinstance(out, dict):
                raise InvalidTrialError(
                    f"{self.name}.train_batch() returned a {type(out).__name__}; return the loss "
                    "(a tensor or number) or a dict of metrics such as {'loss': loss}"
                )
            rows.append(out)
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

    # ------------------------------------------------------------------ validation
    def _evaluate_batches(self) -> tuple[list[dict[str, Any]], list[str], int]:
        it = iter(self.validation_loader) if self.validation_loader is not None else None
        keys: Any = None
        rows: list[dict[str, Any]] = []
        records = 0
        micro = self.context.get_train_micro_batch_size_per_gpu()
        per_call = micro * (
            self.context.get_num_micro_batches_per_slot()
            if self.context.use_pipeline_parallel
            else 1
        )
        for idx in range(self.num_validation_batches):
            out = self.trial.evaluate_batch(it, idx)
            records += per_call
            if self.context._mpu.should_report_metrics:
                keys = self._check_eval_row(out, idx, keys)
                rows.append(
                    {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
                )
            if self.test_mode:
                break
        names = [k for k in self.dist.allgather(list(keys) if keys is not None else None) if k]
        if not names:
            raise InvalidTrialError(
                f"{self.name}.build_validation_data_loader() gave no batches; validation needs "
                "at least one"
            )
        return rows, list(names[0]), records

    # ------------------------------------------------------------------ checkpoints
    def _loader_batches(self) -> int:
        drawn = self.train_iter.drawn if self.train_iter is not None else None
        counts = [c for c in self.dist.allgather(drawn) if c is not None]
        return max(counts) if counts else 0

    def _checkpoint(self, already_exiting: bool) -> None:
        if self.is_chief:
            self.core.train.set_status("checkpointing")
        self.state.last_ckpt = self.state.batches_trained
        started = time.perf_counter()
        metadata = {
            "determined_version": __version__,
            "steps_completed": self.state.batches_trained,
            "framework": f"torch-{torch.__version__}",
            "format": "pickle",
        }
        trial_state = dict(vars(self.state))
        trial_state[_LOADER_BATCHES] = self._loader_batches()
        try:
            with self.core.checkpoint.store_path(metadata, shard=True) as (path, uuid):
                self._save(Path(path), trial_state)
            if self.is_chief:
                self.checkpoint_timings.append(
                    {
                        "uuid": uuid,
                        "steps_completed": self.state.batches_trained,
                        "async": False,
                        "block_ms": (time.perf_counter() - started) * 1000,
                    }
                )
            uuid = self.dist.broadcast(str(uuid))
            for cb in self.callbacks.values():
                cb.on_checkpoint_upload_end(uuid=uuid)
        except InvalidHP:
            if not already_exiting:
                from det_local.trial.core import EarlyExitReason

                self.core.train.report_early_exit(EarlyExitReason.INVALID_HP)
                raise _ShouldExit(skip_exit_checkpoint=True) from None
            raise

    def _save(self, path: Path, trial_state: dict[str, Any]) -> None:
        """This rank's part of the checkpoint in `path` (the chief's includes the trial's
        files)."""
        state: dict[str, Any] = {
            "rng_state": _checkpoint.capture_rng(self.context.device),
            "callbacks": {name: cb.state_dict() for name, cb in self.callbacks.items()},
        }
        extra = self._det_local_state()
        if extra:
            state["det_local"] = extra
        for cb in self.callbacks.values():
            cb.on_checkpoint_save_start(state)
        _checkpoint.torch_save(state, path / f"det_state_dict_rank{self.dist.rank}.pth")
        self.trial.save(self.context, path)
        if self.is_chief:
            storage = getattr(self.core.checkpoint, "_storage", None)
            _checkpoint.write_code(path, [storage] if storage is not None else [])
            _checkpoint.write_trial_files(
                path,
                trial_state=trial_state,
                load_data=_checkpoint.load_data_of(self.context, self.trial, "DeepSpeedTrial"),
            )
        for cb in self.callbacks.values():
            cb.on_checkpoint_end(str(path))
        if self.is_chief:
            for cb in self.callbacks.values():
                cb.on_checkpoint_write_end(str(path))

    def _load(self, ckpt_dir: Any, uuid: str, saved: dict[str, Any] | None) -> None:
        where = f"checkpoint {uuid}"
        own = Path(ckpt_dir) / f"det_state_dict_rank{self.dist.rank}.pth"
        state: dict[str, Any] = {}
        if own.exists():
            state = _checkpoint.load_dict_file(
                own, where, lambda p: torch.load(p, map_location="cpu", weights_only=False)
            )
        else:
            logger.warning(
                f"{where} has no det_state_dict_rank{self.dist.rank}.pth (written by fewer "
                "ranks?): this rank's RNG and callback state start fresh"
            )
        for cb in self.callbacks.values():
            cb.on_checkpoint_load_start(state)
        self.trial.load(self.context, Path(ckpt_dir))
        if "rng_state" in state:
            _checkpoint.restore_rng(state["rng_state"], self.context.device)
        saved_callbacks = state.get("callbacks") or {}
        for name, cb in self.callbacks.items():
            if name in saved_callbacks:
                cb.load_state_dict(saved_callbacks[name])
            elif state and type(cb).load_state_dict is not PyTorchCallback.load_state_dict:
                logger.warning(
                    f"callback '{name}' implements load_state_dict() but {where} holds no state "
                    "for it: it starts fresh"
                )
        self._resume_state(state.get("det_local") or {}, saved)
