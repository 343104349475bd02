"""One exception hierarchy. Every message says what went wrong, where, and what to do."""

from __future__ import annotations


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
