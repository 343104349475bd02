"""`determined.core`: re-exports det_local.trial.core."""

from det_local.trial.core import *  # noqa: F403
from det_local.trial.core import __all__  # noqa: F401
