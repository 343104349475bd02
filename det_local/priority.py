"""A job's priority: its bounds and default, defined here once.

Lower numbers run first (Determined's priority scheduler). The experiment config's
``resources.priority``, the CLI's ``--priority`` options, the queue's requests and the
scheduling policy (``sched/queue/policy.py``) all read these. A module of its own, importing
nothing, so that the CLI's start-up pays nothing for it.
"""

from __future__ import annotations

from det_local.errors import DetLocalError

MIN_PRIORITY = 1  # the most important
MAX_PRIORITY = 99
DEFAULT_PRIORITY = 42  # Determined's default
HELP = f"{MIN_PRIORITY} (most important) to {MAX_PRIORITY}."  # the CLI options' help
# a job's slots as a request may ask for them (the engine then checks them against its pool's)
MAX_SLOTS = 65_536


def check_slots(slots: int, option: str = "--slots") -> int:
    """A number of slots a command line asks for, or DetLocalError naming the range (a number
    too large for a request, 10**30, would otherwise fail where it is packed). A negative one
    is the engine's to refuse, with what to do (`queue.jobqueue.check_request`)."""
    if slots > MAX_SLOTS:
        raise DetLocalError(
            f"{option} {slots} is outside 0-{MAX_SLOTS:,}; ask for the slots the job uses "
            "(`det-local slots` shows what each pool has)"
        )
    return slots


def check_priority(priority: int) -> int:
    """The priority of a request (`job update`, `cmd run`...), or DetLocalError naming the
    bounds."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise DetLocalError(
            f"priority must be a whole number from {MIN_PRIORITY} to {MAX_PRIORITY}, "
            f"found {priority!r}"
        )
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise DetLocalError(
            f"priority {priority} is outside {MIN_PRIORITY}-{MAX_PRIORITY} "
            f"({MIN_PRIORITY} is the most important, {DEFAULT_PRIORITY} the default)"
        )
    return priority
