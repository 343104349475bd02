"""The spool's pending requests as the engine serves them: fairly across users, bounded per user.

The spool directory is listed once per pass (at start, when a watch overflowed, by the safety
sweep when nothing is known to be pending); between listings the names the watch reports are
added one by one. Each name's owner (the uid of the file, from lstat) is looked up once and kept
while the name is pending, so a directory of 65,000 entries costs one listing, not 65,000
stats, per pass. The owner found here only decides the order of service and the per-user cap;
who made a request is decided when it is read, from the descriptor it is read through.

Requests are served round-robin across owners, and in name (submission) order within one
owner: a user who floods the spool delays only their own requests. An owner with more than
`cap` requests pending has the newer ones refused (root and the daemon's own user are exempt).
"""

from __future__ import annotations

import heapq
import os
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

MAX_PENDING_PER_USER = 1000


@dataclass
class Backlog:
    queue: Path
    suffix: str
    cap: int = MAX_PENDING_PER_USER
    exempt: frozenset[int] = field(default_factory=lambda: frozenset({0, os.geteuid()}))
    owner: dict[str, int] = field(default_factory=dict)  # pending name -> its file's uid
    _heaps: dict[int, list[str]] = field(default_factory=dict)  # uid -> its names, a heap
    _turns: deque[int] = field(default_factory=deque)  # owners with names, in serving order
    _count: dict[int, int] = field(default_factory=dict)  # uid -> its pending names
    listings: int = 0  # how many times the directory was listed (for tests and diagnosis)
    # owners whose first request waits for a check off the loop (`errors.Pending`): not served
    # until it has ended (their order is kept; everyone else is served meanwhile)
    held: set[int] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.owner)

    def pending_of(self, uid: int) -> int:
        return self._count.get(uid, 0)

    def refresh(self, skip: Callable[[str], bool]) -> list[tuple[str, int]]:
        """List the directory once: add the names not known yet, forget those gone. Returns
        the names refused for being over their owner's cap, with their owner."""
        try:
            listed = {n for n in os.listdir(self.queue) if n.endswith(self.suffix)}
        except FileNotFoundError:
            listed = set()
        self.listings += 1
        for gone in [n for n in self.owner if n not in listed]:
            self._forget(gone)
        return self.add(sorted(n for n in listed if n not in self.owner and not skip(n)))

    def add(self, names: Iterable[str]) -> list[tuple[str, int]]:
        """Add names (in the order given: name order within an owner is kept by a heap).
        Names already known, vanished, or not requests are ignored; the ones over their
        owner's cap are returned (with the owner) for refusal, not added."""
        refused: list[tuple[str, int]] = []
        for name in names:
            if name in self.owner or not name.endswith(self.suffix) or name.startswith("."):
                continue
            try:
                uid = os.lstat(self.queue / name).st_uid
            except OSError:
                continue  # gone already (answered and removed, or withdrawn by its owner)
            count = self._count.get(uid, 0)
            if count >= self.cap and uid not in self.exempt:
                refused.append((name, uid))
                continue
            self.owner[name] = uid
            self._count[uid] = count + 1
            heap = self._heaps.get(uid)
            if heap is None:
                self._heaps[uid] = [name]
                self._turns.append(uid)
            else:
                heapq.heappush(heap, name)
        return refused

    def take(self) -> tuple[str, int] | None:
        """The next request to serve: the oldest of the owner whose turn it is (an owner
        held meanwhile keeps its turn for later)."""
        skipped = 0
        while len(self._turns) > skipped:
            uid = self._turns.popleft()
            if uid in self.held:
                self._turns.append(uid)
                skipped += 1
                continue
            heap = self._heaps[uid]
            name = None
            while heap:
                candidate = heapq.heappop(heap)
                if self.owner.get(candidate) == uid:
                    name = candidate
                    break
            if heap:
                self._turns.append(uid)
            else:
                del self._heaps[uid]
            if name is not None:
                self._forget(name)
                return name, uid
        return None

    def put_back(self, name: str, uid: int) -> None:
        """A request taken but not applied (a full disk...): first again in its owner's turn."""
        if name in self.owner:
            return
        self.owner[name] = uid
        self._count[uid] = self._count.get(uid, 0) + 1
        heap = self._heaps.get(uid)
        if heap is None:
            self._heaps[uid] = [name]
            self._turns.appendleft(uid)
        else:
            heapq.heappush(heap, name)

    def _forget(self, name: str) -> None:
        uid = self.owner.pop(name, None)
        if uid is None:
            return
        left = self._count.get(uid, 1) - 1
        if left > 0:
            self._count[uid] = left
        else:
            self._count.pop(uid, None)
        # its heap entry goes when it comes up (take() skips names no longer pending)


@dataclass
class _Burst:
    first: float
    count: int = 0  # events since the last line about this burst
    last_line: str = ""


class Bursts:
    """One line per burst of like events from one source: the first event's line at once, then
    every `window` seconds while the burst goes on, and when it ends, one line with the count
    of those not shown. A flood of 20,000 rejected requests is a few lines, not 20,000."""

    def __init__(
        self,
        emit: Callable[[str], None],
        window: float = 10.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        import time

        self.emit = emit
        self.window = window
        self.clock = clock or time.monotonic
        self.open: dict[object, _Burst] = {}

    def event(self, key: object, line: str) -> bool:
        """Record one event; True when its line was emitted (the first of a burst)."""
        burst = self.open.get(key)
        if burst is None:
            self.open[key] = _Burst(self.clock())
            self.emit(line)
            return True
        burst.count += 1
        burst.last_line = line
        return False

    def flush(self, summary: Callable[[object, int, float, str], str], force: bool = False) -> bool:
        """Emit the counts of bursts open for `window` seconds or more (every burst, with
        force) and close those with nothing new; True while some burst is still open."""
        now = self.clock()
        for key, burst in list(self.open.items()):
            if now - burst.first < self.window and not force:
                continue
            if burst.count:
                self.emit(summary(key, burst.count, now - burst.first, burst.last_line))
                self.open[key] = _Burst(now)
            if force or not burst.count:
                self.open.pop(key, None)
        return bool(self.open)
