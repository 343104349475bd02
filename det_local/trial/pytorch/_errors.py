"""The PyTorch API's errors: every one names the trial class, method or metric and what to do."""

from __future__ import annotations

from det_local.errors import CheckpointError, MetricError, TrialError


class InvalidTrialError(TrialError, ValueError):
    """The trial's code uses the PyTorch API in a way that cannot work (the message says where).

    Also a ValueError, which is what Determined raises for most of these mistakes."""


class MissingPackageError(TrialError, ImportError):
    """An optional package a requested feature needs is not installed."""


class NonFiniteLossError(TrialError):
    """train_batch() returned a NaN loss; training stops before it spoils a checkpoint."""


__all__ = [
    "CheckpointError",
    "InvalidTrialError",
    "MetricError",
    "MissingPackageError",
    "NonFiniteLossError",
    "TrialError",
]
