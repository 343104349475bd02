"""`determined.experimental`: the SDK's names (det_local/sdk/), as Determined 0.38 exports them."""

from det_local.sdk.client import (
    Checkpoint,
    CheckpointSortBy,
    CheckpointState,
    Determined,
    DownloadMode,
    Experiment,
    ExperimentSortBy,
    ExperimentState,
    Model,
    ModelSortBy,
    ModelVersion,
    OrderBy,
    TrainingMetrics,
    Trial,
    TrialMetrics,
    TrialSortBy,
    TrialState,
    ValidationMetrics,
)

from . import checkpoint, client

__all__ = [
    "Checkpoint",
    "CheckpointSortBy",
    "CheckpointState",
    "Determined",
    "DownloadMode",
    "Experiment",
    "ExperimentSortBy",
    "ExperimentState",
    "Model",
    "ModelSortBy",
    "ModelVersion",
    "OrderBy",
    "TrainingMetrics",
    "Trial",
    "TrialMetrics",
    "TrialSortBy",
    "TrialState",
    "ValidationMetrics",
    "checkpoint",
    "client",
]
