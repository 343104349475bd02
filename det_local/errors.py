"""One exception hierarchy. Every message says what went wrong, where, and what to do."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar


class DetLocalError(Exception):
    """Base of every error det-local reports to a person.

    The CLI prints ``str(err)`` as one line (no traceback unless --debug)."""

    exit_code = 1


class ConfigError(DetLocalError):
    """The experiment config is malformed: the message names the field path."""


class ContextError(DetLocalError):
    """The context directory cannot be used (missing, too large, shadows `determined`)."""


class NotFoundError(DetLocalError):
    """An experiment, trial or checkpoint id that the store does not have."""


class StateError(DetLocalError):
    """A request that the object's current state does not allow (an illegal transition)."""


class MetricError(DetLocalError):
    """A metric report that cannot be recorded (wrong type, missing searcher metric...)."""


class CheckpointError(DetLocalError):
    """A checkpoint that cannot be stored or restored."""


class TrialError(DetLocalError):
    """A trial process failed in a way the user must act on."""


class NotSupportedYet(DetLocalError):
    """A Determined feature det-local does not provide in this version."""


class Pending(Exception):  # noqa: N818 - not an error: a request that must wait, then go again
    """A request that cannot be answered without waiting for something slow (`sbatch
    --test-only` at a submission to a Slurm pool), raised only where the caller said it will
    come back (:data:`DEFER`): nothing of the request is kept, and ``on_ready(callback)`` calls
    ``callback`` (from any thread) once it can be applied again. The spool server holds the
    request's owner meanwhile (`sched/intake/spoolserver.py`); other owners are served."""

    def __init__(self, what: str, on_ready: Callable[[Callable[[], None]], None]) -> None:
        super().__init__(what)
        self.on_ready = on_ready


# True while the engine's event loop applies a spool request: a slow check raises Pending
# instead of waiting on the loop. False (an offline or embedded engine's one request): it waits.
DEFER: ContextVar[bool] = ContextVar("det_local_defer", default=False)
