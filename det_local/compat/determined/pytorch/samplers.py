"""`determined.pytorch.samplers`: re-exports det_local.trial.pytorch.samplers."""

from det_local.trial.pytorch.samplers import *  # noqa: F403
from det_local.trial.pytorch.samplers import __all__  # noqa: F401
