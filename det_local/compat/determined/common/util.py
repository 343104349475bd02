"""`determined.common.util`: re-exports det_local.trial.common_util."""

from det_local.trial.common_util import *  # noqa: F403
from det_local.trial.common_util import (  # noqa: F401  (underscored: not in a star import)
    _INFERENCE,
    _LEGACY_TRAINING,
    _LEGACY_VALIDATION,
    __all__,
)
