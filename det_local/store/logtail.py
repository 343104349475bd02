"""Following log files as they grow: the one implementation behind `det-local trial logs
[-f]`, `det-local cmd logs -f` (and `cmd run`'s output) and the trial output `det-local run`
prints.

- `LogTail` is one file read from an offset: on each `pump` it copies what was appended since
  the last one, in blocks, to a writer. It opens the file by path on every pump that has
  something to read (no descriptor is held between pumps, so following a thousand trials costs
  no file descriptors); a file that does not exist yet reads as empty until it appears; a file
  that shrank (truncated) is read again from its start. With ``lines=True`` (the default) only
  whole lines are written and a trailing partial line is held back until its newline arrives
  (`rest()` hands it over at the end); with a ``prefix`` only the lines that start with it.
  ``last=N`` starts with only the last N (matching) lines of what the file holds at the first
  pump (a file that does not exist then is read from its start once it appears); ``start``
  starts at that offset instead (what an earlier follower showed already).
- `follow` / `follow_async` are the poll loop: pump until the writer is done, then pump once
  more, so that what was written before the writer's end was seen is printed too. `done()` is
  asked only when a pump found nothing new. Idle, the loop waits `poll` seconds, doubling up to
  `max_poll`; the thread loop pumps again at once while output flows, the event-loop one
  always yields between pumps (it shares its loop with the engine).

Ctrl-C (KeyboardInterrupt) is not caught here: it propagates to the caller, which alone knows
what to say (`trial logs -f` ends quietly, `cmd run -f` exits 130, `det-local run` following a
daemon's experiment says the experiment goes on).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

BLOCK = 1 << 16


class LogTail:
    """One file followed from an offset; see the module docstring."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        lines: bool = True,
        prefix: bytes | None = None,
        last: int | None = None,
        start: int = 0,
    ) -> None:
        self.path = Path(path)
        self.lines = lines
        self.prefix = prefix
        self.offset = start  # where the next pump reads from
        self._last = last  # applies at the first pump only
        self._pending = b""

    def pump(self, write: Callable[[bytes], object]) -> bool:
        """Copies what was appended since the last pump to `write`; returns whether anything
        was read (the lines written may be fewer: a partial line, or lines without the
        prefix)."""
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            self._last = None  # `last` is about what exists at the first pump
            return False
        if self._last is not None:
            with open(self.path, "rb") as f:
                self.offset = _tail_start(f, size, self._last, self.prefix)
            self._last = None
        if size < self.offset:  # truncated: start again
            self.offset = 0
        if size == self.offset:
            return False
        got = False
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            while data := f.read(BLOCK):
                got = True
                self.offset += len(data)
                if kept := self._feed(data):
                    write(kept)
        return got

    @property
    def resume_offset(self) -> int:
        """Where a later LogTail(start=...) goes on from: the end of the last whole line
        handed over (a partial line held back is read again then)."""
        return self.offset - len(self._pending)

    def rest(self) -> bytes:
        """The partial line held back (with ``lines=True``; empty otherwise), handed over once."""
        rest, self._pending = self._pending, b""
        return self._keep(rest)

    def _feed(self, data: bytes) -> bytes:
        if not self.lines:
            return data
        data = self._pending + data
        cut = data.rfind(b"\n") + 1
        self._pending = data[cut:]
        return self._keep(data[:cut])

    def _keep(self, chunk: bytes) -> bytes:
        if self.prefix is None or not chunk:
            return chunk
        return b"".join(ln for ln in chunk.splitlines(keepends=True) if ln.startswith(self.prefix))


def _tail_start(f: IO[bytes], end: int, n: int, prefix: bytes | None) -> int:
    """The offset of the first of the last `n` lines of f[:end] (lines starting with
    `prefix` when one is set), reading backwards block by block; 0 when there are fewer."""
    if n <= 0:
        return end
    need = len(prefix) if prefix else 0
    count = 0
    pos = end
    head = b""  # the first bytes of what has been scanned so far (from `pos` on)
    while pos > 0:
        step = min(BLOCK, pos)
        pos -= step
        f.seek(pos)
        data = f.read(step) + head
        i = step
        while (j := data.rfind(b"\n", 0, i)) >= 0:
            i = j
            start = pos + j + 1
            if start >= end:  # the file's final newline starts no line
                continue
            if prefix is None or data[j + 1 : j + 1 + need] == prefix:
                count += 1
                if count == n:
                    return start
        head = data[: max(need, 1)]
    return 0


def _waits(
    pump: Callable[[], bool], done: Callable[[], bool], poll: float, max_poll: float | None
) -> Iterator[float]:
    """The loop both `follow`s run: pumps again at once while a pump reads something; idle,
    asks done() and yields how long to wait; ends after the pump that follows the first
    done()."""
    delay = poll
    while True:
        if pump():
            delay = poll
            continue
        if done():
            pump()  # what was written before the end was seen
            return
        yield delay
        delay = min(delay * 2, max_poll if max_poll is not None else poll)


def follow(
    pump: Callable[[], bool],
    done: Callable[[], bool],
    *,
    poll: float,
    max_poll: float | None = None,
) -> None:
    """Pumps until done() (asked when a pump found nothing), then once more; see the module
    docstring."""
    for delay in _waits(pump, done, poll, max_poll):
        time.sleep(delay)


async def follow_async(pump: Callable[[], bool], done: Callable[[], bool], *, poll: float) -> None:
    """`follow` inside an event loop: it waits `poll` seconds after every pump, output or not
    (the loop's other work is never starved), and asks done() after every pump (a stop is seen
    within one poll)."""

    from asyncio import sleep  # here: `trial logs` reads logs without an event loop

    def pump_then_wait() -> bool:
        pump()
        return False

    for delay in _waits(pump_then_wait, done, poll, None):
        await sleep(delay)
