"""Determined's DeepSpeed API (``determined.pytorch.deepspeed``): DeepSpeedTrial and its
context, deepspeed.init() and Trainer, overwrite_deepspeed_config and the model-parallel unit.

Importing it does not import DeepSpeed; building and initialising engines does."""

from det_local.trial.pytorch.deepspeed._config import overwrite_deepspeed_config
from det_local.trial.pytorch.deepspeed._context import DeepSpeedTrialContext
from det_local.trial.pytorch.deepspeed._init import init
from det_local.trial.pytorch.deepspeed._mpu import (
    ModelParallelUnit,
    make_data_parallel_mpu,
    make_deepspeed_mpu,
)
from det_local.trial.pytorch.deepspeed._trainer import Trainer
from det_local.trial.pytorch.deepspeed._trial import DeepSpeedTrial

__all__ = [
    "DeepSpeedTrial",
    "DeepSpeedTrialContext",
    "ModelParallelUnit",
    "Trainer",
    "init",
    "make_data_parallel_mpu",
    "make_deepspeed_mpu",
    "overwrite_deepspeed_config",
]
