"""`determined.pytorch.deepspeed`: re-exports det_local.trial.pytorch.deepspeed."""

from det_local.trial.pytorch.deepspeed import *  # noqa: F403
from det_local.trial.pytorch.deepspeed import __all__  # noqa: F401
