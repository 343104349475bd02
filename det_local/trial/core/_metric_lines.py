"""Metric reports as compact lines in the trial's output (hence `trial logs`, `experiment logs
-f` and the output `det-local run` follows), as Determined's Core API logs each report:

    steps 400 training: loss=0.1123
    steps 400 validation: accuracy=0.958 loss=0.112

Validation reports are always shown. Training reports (and any other group) are throttled to at
most one line per group every ``INTERVAL_S`` seconds, so a loop reporting every batch cannot
flood the terminal: the first report is shown at once, later ones only once the interval has
passed. The latest training report held back is written before the next validation line (the
training loss at that validation) and when the trial closes its context (the final training loss
is always in the log). The check on a report that is not shown is one clock read.

Only the chief (rank 0) writes them. ``DET_LOCAL_METRIC_LINES=0`` (in the submitting shell or in
the config's ``environment.environment_variables``) turns them off.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

ENV = "DET_LOCAL_METRIC_LINES"
INTERVAL_S = 2.0
MAX_LINE = 200  # characters of metrics in one line; the rest is counted, not shown
_OFF = ("0", "false", "no", "off")


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether metric lines are on (DET_LOCAL_METRIC_LINES unset, or not 0/false/no/off)."""
    value = (os.environ if environ is None else environ).get(ENV, "")
    return value.strip().lower() not in _OFF


def format_value(value: Any) -> str | None:
    """A short form of one value (3-4 significant digits); None for one not shown (lists,
    dicts)."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"  # nan, inf too
    if isinstance(value, str):
        return value if len(value) <= 24 else value[:23] + "…"
    return None


def format_line(group: str, steps_completed: int, metrics: Mapping[str, Any]) -> str:
    """`steps N GROUP: name=value ...` in report order; `batches` is left out when it is
    steps_completed (PyTorch trials report both)."""
    parts: list[str] = []
    size = 0
    hidden = 0
    for name, value in metrics.items():
        if name == "batches" and value == steps_completed:
            continue
        shown = format_value(value)
        if shown is None:
            continue
        part = f"{name}={shown}"
        if size + len(part) > MAX_LINE and parts:
            hidden += 1
            continue
        parts.append(part)
        size += len(part) + 1
    text = f"steps {steps_completed} {group}: " + " ".join(parts)
    if hidden:
        text += f" (+{hidden} more)"
    return text


class MetricLines:
    """Writes report lines to ``out`` (the trial's stdout), throttled as the module says."""

    def __init__(
        self,
        out: TextIO | None = None,
        *,
        interval: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._out = out
        self._interval = interval
        self._clock = clock
        self._next: dict[str, float] = {}  # group -> when its next line may be written
        self._pending: dict[str, tuple[int, Mapping[str, Any]]] = {}  # latest not shown

    def report(self, group: str, steps_completed: int, metrics: Mapping[str, Any]) -> None:
        if group != "validation":
            now = self._clock()
            if now < self._next.get(group, 0.0):
                self._pending[group] = (steps_completed, metrics)
                return
            self._next[group] = now + self._interval
            self._pending.pop(group, None)
        elif "training" in self._pending:  # the training line held back, for context
            held_steps, held = self._pending.pop("training")
            self._next["training"] = self._clock() + self._interval
            self._write("training", held_steps, held)
        self._write(group, steps_completed, metrics)

    def flush(self) -> None:
        """Write the latest report of each group that was not shown (at the trial's end)."""
        pending, self._pending = self._pending, {}
        for group, (steps_completed, metrics) in pending.items():
            self._write(group, steps_completed, metrics)

    def _write(self, group: str, steps_completed: int, metrics: Mapping[str, Any]) -> None:
        out = self._out or sys.stdout
        try:
            out.write(format_line(group, steps_completed, metrics) + "\n")
            out.flush()
        except (OSError, ValueError):  # stdout closed by the trial: reports still go on
            pass


def for_rank(rank: int) -> MetricLines | None:
    """The chief's MetricLines when they are on; None for other ranks, or when off."""
    return MetricLines() if rank == 0 and enabled() else None
