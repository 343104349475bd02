"""PyTorchTrialContext: what a PyTorchTrial uses to wrap its objects and take training steps."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import pathlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from det_local.trial.pytorch._data import to_device
from det_local.trial.pytorch._errors import InvalidTrialError, MissingPackageError
from det_local.trial.pytorch._experimental import PyTorchExperimentalContext
from det_local.trial.pytorch._lr_scheduler import LRScheduler
from det_local.trial.pytorch._reducer import ReducerContext

logger = logging.getLogger("determined.pytorch")


def batch_sizes(hparams: dict[str, Any], slots: int) -> tuple[int, int]:
    """(per-slot, effective global) batch size from the global_batch_size hyperparameter."""
    slots = max(slots, 1)
    gbs = hparams.get("global_batch_size")
    if not isinstance(gbs, int) or isinstance(gbs, bool):
        raise InvalidTrialError(
            f"the global_batch_size hyperparameter must be an int, found {gbs!r} "
            f"({type(gbs).__name__})"
        )
    if gbs < slots:
        raise InvalidTrialError(
            f"the global_batch_size hyperparameter ({gbs}) is smaller than the number of slots "
            f"({slots}); raise it to at least {slots}"
        )
    per_slot = gbs // slots
    if per_slot * slots != gbs:
        logger.warning(
            f"`global_batch_size` changed from {gbs} to {per_slot * slots} to divide equally "
            f"across {slots} slots."
        )
    return per_slot, per_slot * slots


class _DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """DDP that forwards unknown attributes to the wrapped module (model.my_attr keeps working)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


class TrialContextBase(ReducerContext):
    """What the PyTorch and DeepSpeed trial contexts share: the trial's information, its
    device, the training position, the stop request, TensorBoard and the profiler, reducers."""

    def __init__(
        self,
        core_context: Any,
        trial_seed: int | None,
        hparams: dict[str, Any] | None,
        slots_per_trial: int,
        num_gpus: int,
        exp_conf: dict[str, Any] | None,
        steps_completed: int,
        managed_training: bool,
        debug_enabled: bool,
        enable_tensorboard_logging: bool = True,
    ) -> None:
        self._core = core_context
        self.distributed = core_context.distributed
        ReducerContext.__init__(self, self.distributed.allgather)
        self._hparams = hparams
        self._exp_conf = exp_conf
        self._trial_seed = trial_seed
        self._steps_completed = steps_completed
        self._num_gpus = num_gpus
        self._debug_enabled = debug_enabled
        self._managed_training = managed_training
        self._per_slot_batch_size: int | None = None
        self._global_batch_size: int | None = None
        if hparams and hparams.get("global_batch_size") is not None:
            self._per_slot_batch_size, self._global_batch_size = batch_sizes(
                hparams, slots_per_trial
            )
        self.device = self._init_device()

        self.models: list[Any] = []
        self.profiler: Any = None
        self._epoch_len: int | None = None
        self._current_batch_idx: int | None = None
        self._loss_ids: dict[Any, int] = {}
        self._to_device_warned_types: set[type] = set()
        self._is_pre_trainer = False
        self._stop_requested = False
        self._enable_tensorboard_logging = enable_tensorboard_logging
        self._tbd_writer: Any = None
        self._last_tb_reset_ts: float | None = None

    # ------------------------------------------------------------------ device
    def _init_device(self) -> torch.device:
        if self._num_gpus > 0 and torch.cuda.is_available():
            if self.distributed.size > 1:
                device = torch.device("cuda", self.distributed.local_rank)
                torch.cuda.set_device(device)
                return device
            return torch.device("cuda", 0)
        return torch.device("cpu")

    def to_device(self, data: Any) -> Any:
        """Move tensors (nested in dicts/lists/tuples) to this trial's device."""
        return to_device(data, self.device, self._to_device_warned_types)

    # ------------------------------------------------------------------ training position
    def _batch_idx(self) -> int:
        if self._current_batch_idx is None:
            raise InvalidTrialError("training has not started: no current batch yet")
        return self._current_batch_idx

    def _epoch_length(self) -> int:
        if self._epoch_len is None:
            raise InvalidTrialError("the training data loader is not built yet")
        return self._epoch_len

    def is_epoch_start(self) -> bool:
        return self._batch_idx() % self._epoch_length() == 0

    def is_epoch_end(self) -> bool:
        n = self._epoch_length()
        return self._batch_idx() % n == n - 1

    def current_train_epoch(self) -> int:
        return self._batch_idx() // self._epoch_length()

    def current_train_batch(self) -> int:
        return self._batch_idx()

    def get_stop_requested(self) -> bool:
        return self._stop_requested

    def set_stop_requested(self, stop_requested: bool) -> None:
        """Ask the loop to stop after the current batch: it reports, checkpoints and returns."""
        if not isinstance(stop_requested, bool):
            raise InvalidTrialError(
                f"set_stop_requested() takes a bool, found {type(stop_requested).__name__}"
            )
        if stop_requested:
            logger.info("A trial stop was requested: it stops (and checkpoints) after this batch")
        self._stop_requested = stop_requested

    # ------------------------------------------------------------------ information
    def get_hparams(self) -> dict[str, Any]:
        if self._hparams is None:
            raise InvalidTrialError(
                "get_hparams(): no hyperparameters; pass hparams=... to pytorch.init()"
            )
        return self._hparams

    def get_hparam(self, name: str) -> Any:
        hparams = self.get_hparams()
        if name not in hparams:
            raise InvalidTrialError(
                f"get_hparam({name!r}): no such hyperparameter; the trial has "
                f"{sorted(hparams)} (the config's hyperparameters section)"
            )
        if name == "global_batch_size":
            logger.warning(
                "Please use `context.get_per_slot_batch_size()` and "
                "`context.get_global_batch_size()` instead of accessing `global_batch_size` "
                "directly."
            )
        return hparams[name]

    def get_experiment_config(self) -> dict[str, Any]:
        if self._exp_conf is None:
            raise InvalidTrialError(
                "get_experiment_config(): no experiment config; pass exp_conf=... to "
                "pytorch.init() (det-local passes the experiment's config itself)"
            )
        return self._exp_conf

    def get_data_config(self) -> dict[str, Any]:
        data: dict[str, Any] = self.get_experiment_config().get("data") or {}
        return data

    def get_global_batch_size(self) -> int:
        if self._global_batch_size is None:
            raise InvalidTrialError(
                "get_global_batch_size(): the hyperparameters have no global_batch_size; add it "
                "to hyperparameters (or to pytorch.init(hparams=...))"
            )
        return self._global_batch_size

    def get_per_slot_batch_size(self) -> int:
        if self._per_slot_batch_size is None:
            raise InvalidTrialError(
                "get_per_slot_batch_size(): the hyperparameters have no global_batch_size; add "
                "it to hyperparameters (or to pytorch.init(hparams=...))"
            )
        return self._per_slot_batch_size

    def _trial_info(self) -> Any:
        info = getattr(self._core, "info", None)
        if info is None or info.task_type != "TRIAL":
            return None
        return info.trial

    def get_experiment_id(self) -> int:
        """The experiment's id (0 off-cluster)."""
        trial = self._trial_info()
        return int(trial.experiment_id) if trial is not None else 0

    def get_trial_id(self) -> int:
        """The trial's id (0 off-cluster)."""
        trial = self._trial_info()
        return int(trial.trial_id) if trial is not None else 0

    def get_trial_seed(self) -> int:
        if self._trial_seed is None:
            raise InvalidTrialError(
                "get_trial_seed(): no trial seed off-cluster (pytorch.init() ran outside "
                "det-local); seed the RNGs yourself when running locally"
            )
        return self._trial_seed

    def get_initial_batch(self) -> int:
        """The batch this run starts from (steps completed by earlier runs of the trial)."""
        return self._steps_completed

    # ------------------------------------------------------------------ tensorboard / profiler
    def get_tensorboard_path(self) -> pathlib.Path:
        return pathlib.Path(self._core.train.get_tensorboard_path())

    def get_tensorboard_writer(self) -> Any:
        """A torch.utils.tensorboard.SummaryWriter writing under get_tensorboard_path()."""
        if self._tbd_writer is None:
            if importlib.util.find_spec("tensorboard") is None:
                raise MissingPackageError(
                    "get_tensorboard_writer() needs the 'tensorboard' package, which is not "
                    "installed: pip install tensorboard"
                )
            from torch.utils import tensorboard

            self._tbd_writer = tensorboard.SummaryWriter(str(self.get_tensorboard_path()))
        return self._tbd_writer

    def _maybe_reset_tbd_writer(self) -> None:
        """Flush the writer; close it (a new event file) at most once a second."""
        if self._tbd_writer is None:
            return
        now = time.time()
        if self._last_tb_reset_ts is None:
            self._last_tb_reset_ts = now
        if int(now) > int(self._last_tb_reset_ts):
            self._tbd_writer.close()
            self._last_tb_reset_ts = now
        else:
            self._tbd_writer.flush()

    def set_enable_tensorboard_logging(self, enable_tensorboard_logging: bool) -> None:
        if not isinstance(enable_tensorboard_logging, bool):
            raise InvalidTrialError("set_enable_tensorboard_logging() takes a bool")
        self._enable_tensorboard_logging = enable_tensorboard_logging

    def get_enable_tensorboard_logging(self) -> bool:
        return self._enable_tensorboard_logging

    def set_profiler(self, *args: Any, **kwargs: Any) -> None:
        """A torch.profiler.profile writing traces under get_tensorboard_path(); the loop starts it
        and steps it once per batch."""
        self.profiler = torch.profiler.profile(
            *args,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                str(self.get_tensorboard_path())
            ),
            **kwargs,
        )

    def _set_is_pre_trainer(self) -> None:
        self._is_pre_trainer = True


class PyTorchTrialContext(TrialContextBase):
    """Made by ``pytorch.init()`` (or CheckpointLoadContext). Wrap models, optimizers, LR
    schedulers and scalers in the trial's ``__init__``; call ``backward()`` and
    ``step_optimizer()`` in ``train_batch()``."""

    def __init__(
        self,
        core_context: Any,
        trial_seed: int | None,
        hparams: dict[str, Any] | None,
        slots_per_trial: int,
        num_gpus: int,
        exp_conf: dict[str, Any] | None,
        aggregation_frequency: int,
        steps_completed: int,
        managed_training: bool,
        debug_enabled: bool,
        enable_tensorboard_logging: bool = True,
    ) -> None:
        if not isinstance(aggregation_frequency, int) or aggregation_frequency < 1:
            raise InvalidTrialError(
                f"aggregation_frequency must be a positive int, found {aggregation_frequency!r}"
            )
        TrialContextBase.__init__(
            self,
            core_context=core_context,
            trial_seed=trial_seed,
            hparams=hparams,
            slots_per_trial=slots_per_trial,
            num_gpus=num_gpus,
            exp_conf=exp_conf,
            steps_completed=steps_completed,
            managed_training=managed_training,
            debug_enabled=debug_enabled,
            enable_tensorboard_logging=enable_tensorboard_logging,
        )
        self._aggregation_frequency = aggregation_frequency
        self.models: list[nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_schedulers: list[LRScheduler] = []
        self.experimental = PyTorchExperimentalContext(self)
        self._optimizer_configs: dict[torch.optim.Optimizer, dict[str, Any]] = {}
        self._wrapped_models: dict[nn.Module, nn.Module] = {}
        self._scaler: Any = None
        self._use_apex = False
        self._average_aggregated_gradients_default = True

    # ------------------------------------------------------------------ wrapping
    def _ddp_enabled(self) -> bool:
        return (
            self.distributed.size > 1
            and torch.distributed.is_available()
            and torch.distributed.is_initialized()
        )

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Move `model` to the device (DistributedDataParallel when training on several slots);
        use the returned module from then on."""
        if not isinstance(model, nn.Module):
            raise InvalidTrialError(
                f"wrap_model() got a {type(model).__name__}; pass a torch.nn.Module"
            )
        wrapped = model
        if self._managed_training:
            model = model.to(self.device)
            wrapped = model
            if self.distributed.size > 1:
                if not self._ddp_enabled():
                    raise InvalidTrialError(
                        f"wrap_model(): this trial has {self.distributed.size} workers but "
                        "torch.distributed is not initialized; launch it with "
                        "`python3 -m determined.launch.torch_distributed`"
                    )
                device_ids = [self.device] if self.device.type == "cuda" else None
                wrapped = _DistributedDataParallel(model, device_ids=device_ids)
            self._wrapped_models[wrapped] = model
        if self.experimental._auto_amp:
            wrapped = self.autocast_forward_pass(wrapped)
        self.models.append(wrapped)
        return wrapped

    def autocast_forward_pass(self, to_wrap: nn.Module) -> nn.Module:
        """Run `to_wrap`'s forward under autocast and give float32 outputs back (so losses need
        no autocast). Returns the same module."""
        forward = to_wrap.forward
        device_type = self.device.type
        enabled = device_type == "cuda"

        def autocast_forward(*args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device_type=device_type, enabled=enabled):
                return forward(*args, **kwargs)

        to_wrap.forward = autocast_forward  # type: ignore[method-assign]
        to_wrap.register_forward_hook(_outputs_to_float32)
        return to_wrap

    def wrap_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        backward_passes_per_step: int = 1,
        fp16_compression: bool | None = None,
        average_aggregated_gradients: bool | None = None,
    ) -> torch.optim.Optimizer:
        """Register `optimizer` (its state is checkpointed); step it with step_optimizer()."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidTrialError(
                f"wrap_optimizer() got a {type(optimizer).__name__}; pass a torch.optim.Optimizer"
            )
        if backward_passes_per_step < 1:
            raise InvalidTrialError(
                "wrap_optimizer(): backward_passes_per_step must be >= 1, found "
                f"{backward_passes_per_step}"
            )
        if average_aggregated_gradients is None:
            average_aggregated_gradients = self._average_aggregated_gradients_default
        self._optimizer_configs[optimizer] = {
            "average_aggregated_gradients": bool(average_aggregated_gradients)
        }
        self.optimizers.append(optimizer)
        return optimizer

    def wrap_lr_scheduler(
        self, lr_scheduler: Any, step_mode: LRScheduler.StepMode, frequency: int = 1
    ) -> Any:
        """Register `lr_scheduler` (stepped per `step_mode`, checkpointed); returns it unchanged.
        Its optimizer must be one passed to wrap_optimizer()."""
        if (
            isinstance(lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
            and step_mode != LRScheduler.StepMode.MANUAL_STEP
        ):
            raise InvalidTrialError(
                "wrap_lr_scheduler(): ReduceLROnPlateau needs a metric in step(), so it only works "
                "with step_mode=LRScheduler.StepMode.MANUAL_STEP; step it yourself, e.g. in a "
                "callback's on_validation_end(metrics)"
            )
        opt = getattr(lr_scheduler, "optimizer", None)
        if opt is not None and opt not in self._optimizer_configs:
            raise InvalidTrialError(
                f"wrap_lr_scheduler(): the {type(lr_scheduler).__name__}'s optimizer "
                f"({type(opt).__name__}) was never passed to context.wrap_optimizer(); build the "
                "scheduler on the optimizer wrap_optimizer() returned"
            )
        self.lr_schedulers.append(LRScheduler(lr_scheduler, step_mode, frequency))
        return lr_scheduler

    def wrap_scaler(self, scaler: Any) -> Any:
        """Track a GradScaler (checkpointed); pass it to step_optimizer(scaler=...). Call before
        wrap_model()."""
        if self._scaler is not None:
            raise InvalidTrialError("wrap_scaler()/use_amp() may be called only once")
        if self.models:
            raise InvalidTrialError(
                "call wrap_scaler() (or experimental.use_amp()) before wrap_model()"
            )
        self._scaler = scaler
        return scaler

    def configure_apex_amp(self, models: Any, optimizers: Any, *args: Any, **kwargs: Any) -> Any:
        """NVIDIA apex is deprecated in Determined and not supported by det-local."""
        if kwargs.get("enabled") is False or not self._managed_training:
            return models, optimizers
        raise InvalidTrialError(
            "configure_apex_amp(): apex AMP is deprecated in Determined and not supported by "
            "det-local; use context.experimental.use_amp() or torch.amp with wrap_scaler()"
        )

    # ------------------------------------------------------------------ stepping
    def _should_communicate_and_update(self) -> bool:
        if not self._managed_training:
            return True
        if self._current_batch_idx is None:
            raise InvalidTrialError(
                "backward()/step_optimizer() called before training started; call them inside "
                "train_batch()"
            )
        return (self._current_batch_idx + 1) % self._aggregation_frequency == 0

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for model in self.models:
                if isinstance(model, nn.parallel.DistributedDataParallel):
                    stack.enter_context(model.no_sync())
            yield

    def backward(
        self,
        loss: torch.Tensor,
        gradient: torch.Tensor | None = None,
        retain_graph: bool = False,
        create_graph: bool = False,
    ) -> None:
        """loss.backward(), scaled under use_amp(); gradients are not all-reduced on batches that
        only accumulate (aggregation_frequency > 1)."""
        if self._scaler is not None and self.experimental._auto_amp:
            loss = self._scaler.scale(loss)
        if (
            self.distributed.size > 1
            and self._ddp_enabled()
            and not self._should_communicate_and_update()
        ):
            with self._no_sync():
                loss.backward(
                    gradient=gradient, retain_graph=retain_graph, create_graph=create_graph
                )
        else:
            loss.backward(gradient=gradient, retain_graph=retain_graph, create_graph=create_graph)

    def step_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        clip_grads: Callable[[Any], None] | None = None,
        auto_zero_grads: bool = True,
        scaler: Any = None,
    ) -> None:
        """Step `optimizer` (a wrapped one) on every aggregation_frequency-th batch: average the
        accumulated gradients, clip them with ``clip_grads(params)``, step (through the scaler
        under AMP) and zero them."""
        if optimizer not in self._optimizer_configs:
            wrapped = ", ".join(type(o).__name__ for o in self.optimizers) or "none"
            raise InvalidTrialError(
                f"step_optimizer() got a {type(optimizer).__name__} optimizer that was never "
                f"passed to context.wrap_optimizer() (wrapped: {wrapped}); in __init__ write "
                "self.opt = context.wrap_optimizer(opt) and step self.opt"
            )
        if self._aggregation_frequency > 1 and not auto_zero_grads:
            raise InvalidTrialError(
                "step_optimizer(auto_zero_grads=False) cannot be used with "
                f"aggregation_frequency={self._aggregation_frequency}; leave auto_zero_grads=True"
            )
        # every batch updates (aggregation_frequency 1, training started): no call to ask
        if (
            self._aggregation_frequency > 1 or self._current_batch_idx is None
        ) and not self._should_communicate_and_update():
            return
        if self._aggregation_frequency > 1 or clip_grads is not None:
            params = [p for group in optimizer.param_groups for p in group.get("params", [])]
            if (
                self._optimizer_configs[optimizer]["average_aggregated_gradients"]
                and self._aggregation_frequency > 1
            ):
                for p in params:
                    if p.grad is not None:
                        p.grad.data.div_(float(self._aggregation_frequency))
            if clip_grads is not None:
                if self._scaler is not None and self.experimental._auto_amp:
                    self._scaler.unscale_(optimizer)
                clip_grads(params)
        if scaler is None and self.experimental._auto_amp:
            scaler = self._scaler
        if scaler is not None:
            scaler.step(optimizer)
        else:
            optimizer.step()
        if auto_zero_grads:
            optimizer.zero_grad()

    def _set_default_average_aggregated_gradients(self, value: bool) -> None:
        self._average_aggregated_gradients_default = value


def _outputs_to_float32(module: nn.Module, inputs: Any, output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.float() if output.dtype in (torch.float16, torch.bfloat16) else output
    if isinstance(output, dict):
        return {k: _outputs_to_float32(module, inputs, v) for k, v in output.items()}
    if isinstance(output, list):
        return [_outputs_to_float32(module, inputs, v) for v in output]
    if isinstance(output, tuple):
        return tuple(_outputs_to_float32(module, inputs, v) for v in output)
    return output
