"""`determined.pytorch`: re-exports det_local.trial.pytorch."""

from det_local.trial.pytorch import *  # noqa: F403
from det_local.trial.pytorch import (
    __all__,  # noqa: F401
    samplers,  # noqa: F401
)
