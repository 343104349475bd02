"""pytorch.init(): the PyTorchTrialContext a Trainer trains with, and trial_context(), what
pytorch.init() and deepspeed.init() share (the distributed world, the seeds, core.init())."""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch

from det_local.trial.pytorch._context import PyTorchTrialContext
from det_local.trial.pytorch._errors import InvalidTrialError
from det_local.wire.trialinfo import get_cluster_info

logger = logging.getLogger("determined.pytorch")


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
