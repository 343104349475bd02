"""`determined.experimental.checkpoint` (what Determined's checkpoint docs import
CheckpointSortBy from): the SDK's checkpoint names."""

from det_local.sdk.checkpoint import Checkpoint, CheckpointTrainingMetadata
from det_local.sdk.enums import CheckpointSortBy, CheckpointState, DownloadMode

__all__ = [
    "Checkpoint",
    "CheckpointSortBy",
    "CheckpointState",
    "CheckpointTrainingMetadata",
    "DownloadMode",
]
