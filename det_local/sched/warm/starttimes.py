"""How long a trial took to start, cold or warm (`sched/warm/zygotes.py`): measured by the daemon
from the moment it begins starting a run's process to the run's hello on the trial socket (what
`det.core.init()` sends), recorded per run (`store/tables/trialstarts.py`) and told to the trial
in the answer to its hello (its chief says it in the trial's log, `trial/session.py`); `experiment
describe` shows :func:`summary`.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable


def summary(starts: Iterable[tuple[bool, float]]) -> str:
    """'2 warm (p50 0.061s), 1 cold (p50 1.920s)' from (warm, seconds) of runs; '' if none."""
    seen: dict[str, list[float]] = {"warm": [], "cold": []}
    for warm, seconds in starts:
        seen["warm" if warm else "cold"].append(seconds)
    parts = [
        f"{len(times)} {kind} (p50 {statistics.median(times):.3f}s)"
        for kind, times in seen.items()
        if times
    ]
    return ", ".join(parts)
