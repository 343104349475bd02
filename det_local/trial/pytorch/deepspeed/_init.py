"""deepspeed.init(): the DeepSpeedTrialContext a deepspeed.Trainer trains with. Under det-local
it initialises DeepSpeed's distributed backend in the launcher's world; off-cluster in the world
of the launcher that started the script, or a world of this process alone (DeepSpeed needs a
process group to build an engine, also to load a checkpoint outside training)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from det_local.launch.ports import free_port
from det_local.trial.pytorch._errors import InvalidTrialError
from det_local.trial.pytorch._init import trial_context
from det_local.trial.pytorch.deepspeed._context import DeepSpeedTrialContext

MANUAL_INIT_ENV = "DET_MANUAL_INIT_DISTRIBUTED"


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
