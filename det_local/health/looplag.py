"""The event loop's lag: how late the daemon's one loop runs what is due.

A probe task asks to wake every ``TICK_S``; how much later than asked it wakes is how long the
loop was busy with something else (decoding, a long handler, a blocking call). The samples of
the last ``WINDOW_S`` seconds give the window's worst and 99th percentile, and the worst since
the probe started is kept too. Once a second the probe writes them to ``run/looplag.json``
(world-readable, like the pid file); `det-local daemon status --json` shows them as
``loop_lag_ms``:

    {"max": worst lag in the window, "p99": its 99th percentile, "window_s": 60,
     "samples": samples in the window, "max_since_start": worst since the probe started,
     "max_1s": worst in the second before it was written, "at": when written (unix time)}

All in milliseconds except ``window_s``, ``samples`` and ``at``. A stalled loop writes nothing
while stalled: ``at`` falls behind, which `status` shows as ``stale_s``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

TICK_S = 0.05  # the probe's period: finer than the ~100 ms the loop may lag
WINDOW_S = 60.0  # the window of max and p99
WRITE_S = 1.0  # how often the figures are written
FILE_NAME = "looplag.json"


class LoopLag:
    """The samples and their summary; `run` is the probe (a task on the loop it measures)."""

    def __init__(self, path: Path, window_s: float = WINDOW_S, tick_s: float = TICK_S) -> None:
        self.path = path
        self.tick_s = tick_s
        self.samples: deque[tuple[float, float]] = deque()  # (when, lag in s)
        self.window_s = window_s
        self.max_since_start = 0.0
        self.max_recent = 0.0  # since the last write

    def add(self, now: float, lag: float) -> None:
        self.samples.append((now, lag))
        if lag > self.max_since_start:
            self.max_since_start = lag
        if lag > self.max_recent:
            self.max_recent = lag
        cutoff = now - self.window_s
        while self.samples and self.samples[0][0] < cutoff:
            self.samples.popleft()

    def summary(self) -> dict[str, Any]:
        lags = sorted(lag for _, lag in self.samples)
        p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else 0.0
        return {
            "max": round((lags[-1] if lags else 0.0) * 1000, 1),
            "p99": round(p99 * 1000, 1),
            "window_s": self.window_s,
            "samples": len(lags),
            "max_since_start": round(self.max_since_start * 1000, 1),
            "max_1s": round(self.max_recent * 1000, 1),
            "at": round(time.time(), 3),
        }

    def write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "w") as f:
                json.dump(self.summary(), f)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a full disk: the figures are only for people

    async def run(self) -> None:
        from asyncio import sleep  # here: `daemon status` reads the file (`read`) without asyncio

        next_write = time.monotonic() + WRITE_S
        while True:
            asked = time.monotonic()
            await sleep(self.tick_s)
            now = time.monotonic()
            self.add(now, max(0.0, now - asked - self.tick_s))
            if now >= next_write:
                next_write = now + WRITE_S
                self.write()
                self.max_recent = 0.0

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()


def read(run_dir: Path) -> dict[str, Any] | None:
    """What the probe last wrote, with ``stale_s`` (how long ago), or None."""
    try:
        data = json.loads((run_dir / FILE_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    at = data.get("at")
    if isinstance(at, (int, float)):
        data["stale_s"] = round(max(0.0, time.time() - at), 1)
    return data
