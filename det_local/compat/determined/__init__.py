"""`import determined` inside det-local trials: Determined's names, backed by det_local.trial.

This directory is put first on trial processes' PYTHONPATH. It holds no logic of its own."""

from det_local import __version__
from det_local.trial import (
    LOG_FORMAT,
    ClusterInfo,
    InvalidHP,
    RendezvousInfo,
    ResourcesInfo,
    TrialInfo,
    get_cluster_info,
    import_from_path,
)

__all__ = [
    "LOG_FORMAT",
    "ClusterInfo",
    "InvalidHP",
    "RendezvousInfo",
    "ResourcesInfo",
    "TrialInfo",
    "__version__",
    "get_cluster_info",
    "import_from_path",
]
