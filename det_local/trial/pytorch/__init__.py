"""Determined's PyTorch API (``determined.pytorch``): PyTorchTrial, pytorch.init() and Trainer,
DataLoader and samplers, reducers, callbacks, LR schedulers and checkpoint loading."""

from det_local.trial.pytorch import samplers
from det_local.trial.pytorch._callback import PyTorchCallback
from det_local.trial.pytorch._context import PyTorchTrialContext
from det_local.trial.pytorch._data import (
    DataLoader,
    TorchData,
    adapt_batch_sampler,
    data_length,
    to_device,
)
from det_local.trial.pytorch._errors import (
    InvalidTrialError,
    MissingPackageError,
    NonFiniteLossError,
)
from det_local.trial.pytorch._experimental import PyTorchExperimentalContext
from det_local.trial.pytorch._init import init
from det_local.trial.pytorch._lr_scheduler import LRScheduler
from det_local.trial.pytorch._reducer import MetricReducer, Reducer
from det_local.trial.pytorch._trainer import Trainer
from det_local.trial.pytorch._trial import PyTorchTrial
from det_local.trial.pytorch._units import Batch, Epoch, TrainUnit
from det_local.trial.pytorch.checkpoints._load_context import CheckpointLoadContext
from det_local.trial.pytorch.checkpoints._load_trial import load_trial_from_checkpoint_path

__all__ = [
    "Batch",
    "CheckpointLoadContext",
    "DataLoader",
    "Epoch",
    "InvalidTrialError",
    "LRScheduler",
    "MetricReducer",
    "MissingPackageError",
    "NonFiniteLossError",
    "PyTorchCallback",
    "PyTorchExperimentalContext",
    "PyTorchTrial",
    "PyTorchTrialContext",
    "Reducer",
    "TorchData",
    "TrainUnit",
    "Trainer",
    "adapt_batch_sampler",
    "data_length",
    "init",
    "load_trial_from_checkpoint_path",
    "samplers",
    "to_device",
]
