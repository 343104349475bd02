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

# Determined's package imports its Core API eagerly: the tutorials call `det.core.init()` after a
# bare `import determined as det`.
from . import core

__all__ = [
    "LOG_FORMAT",
    "ClusterInfo",
    "InvalidHP",
    "RendezvousInfo",
    "ResourcesInfo",
    "TrialInfo",
    "__version__",
    "core",
    "get_cluster_info",
    "import_from_path",
]
