"""`determined.experimental.client`: re-exports det_local.trial.client."""

from det_local.trial.client import *  # noqa: F403
from det_local.trial.client import __all__  # noqa: F401
