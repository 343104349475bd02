"""How long a trial took to start, cold or warm (`sched/zygotes.py`): measured by the daemon
from the moment it begins starting a run's process to the run's hello on the trial socket (what
`det.core.init()` sends), recorded as one event per run and appended to the trial's log.

:func:`line` writes the event's text and :func:`summary` reads it back for `experiment
describe`: the one definition of the format lives here.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable

_LINE = re.compile(r"^trial (\d+): started (cold|warm) in (\d+\.\d+)s\b")


def line(trial_id: int, warm: bool, seconds: float) -> str:
    kind = "warm" if warm else "cold"
    return f"trial {trial_id}: started {kind} in {seconds:.3f}s (from its spawn to its hello)"


def summary(messages: Iterable[str]) -> str:
    """'2 warm (p50 0.061s), 1 cold (p50 1.920s)' from the experiment's events; '' if none."""
    seen: dict[str, list[float]] = {"warm": [], "cold": []}
    for message in messages:
        m = _LINE.match(message)
        if m is not None:
            seen[m.group(2)].append(float(m.group(3)))
    parts = [
        f"{len(times)} {kind} (p50 {statistics.median(times):.3f}s)"
        for kind, times in seen.items()
        if times
    ]
    return ", ".join(parts)
