"""Log lines that hostile input can cause, at most once per key per window.

`RateLog(log, window_s)`: `say(key, line)` logs the line when `key` (a source address, a peer
and a kind of refusal) has not logged in the last `window_s` seconds; lines held back are
counted and the next line for that key says how many were. The table is bounded (the oldest
keys go first), so a flood of sources cannot grow it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

MAX_KEYS = 4096


class RateLog:
    def __init__(
        self,
        log: Callable[[str], None],
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self.window_s = window_s
        self._clock = clock
        self._seen: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def say(self, key: str, line: str) -> bool:
        """Log `line` unless `key` logged within the window; True when it was logged."""
        now = self._clock()
        last = self._seen.get(key)
        if last is not None and now - last[0] < self.window_s:
            self._seen[key] = (last[0], last[1] + 1)
            return False
        held = last[1] if last is not None else 0
        self._seen[key] = (now, 0)
        self._seen.move_to_end(key)
        while len(self._seen) > MAX_KEYS:
            self._seen.popitem(last=False)
        suffix = f" ({held} more like it in the last {self.window_s:.0f}s)" if held else ""
        self._log(line + suffix)
        return True
