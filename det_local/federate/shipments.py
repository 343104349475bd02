"""What peers may ship here, and how much of it stays (issue 25: nothing a peer sends is
unbounded). Wraps the `blobs.ContextCache` (which checks every byte of a transfer):

* a transfer is accepted only against a pending reserve: a peer's `reserve` that passed the
  lending policy and the config checks, for a context not here yet, answers "context" and lets
  that peer (only it) ship that digest for EXPECT_S;
* each peer holds at most `peer_bytes` of contexts here (the contexts it shipped first), all
  peers together at most `max_bytes` (daemon.yaml `federation.contexts_peer_mb`,
  `contexts_max_mb`); room is made by removing the least recently used contexts that no job
  on this machine refers to; a transfer that would still not fit is refused (one line);
* sizes are the packed tar's (an upper bound of what is extracted: headers included).

The index (`.index.json` in the cache's root, the daemon's only) keeps who shipped what and when
each was last used, across restarts; a context found without an entry counts as nobody's.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from det_local.federate.blobs import ContextCache
from det_local.federate.untar import BlobError
from det_local.store.context import format_size

EXPECT_S = 300.0  # a reserve's permission to ship its context
INDEX = ".index.json"


@dataclass
class Entry:
    peer: str
    size: int
    used: float  # time.time() of its last use (shipped, reserved, committed)


class Shipments:
    def __init__(
        self,
        cache: ContextCache,
        max_bytes: int,
        peer_bytes: int,
        in_use: Callable[[], set[str]],
        log: Callable[[str], None],
    ) -> None:
        self.cache = cache
        self.max_bytes = max_bytes
        self.peer_bytes = min(peer_bytes, max_bytes)
        self.in_use = in_use
        self.log = log
        self.expected: dict[tuple[str, str], float] = {}
        self.entries: dict[str, Entry] = {}
        self._lock = threading.Lock()
        self._load()

    # -- the index --------------------------------------------------------------------------
    def _load(self) -> None:
        root = self.cache.root
        try:
            raw = json.loads((root / INDEX).read_text())
        except (OSError, ValueError):
            raw = {}
        for child in root.iterdir():
            if child.name.startswith(".") or not child.is_dir():
                continue
            e = raw.get(child.name) if isinstance(raw, dict) else None
            if isinstance(e, dict) and isinstance(e.get("size"), int):
                peer = str(e.get("peer", ""))
                self.entries[child.name] = Entry(peer, e["size"], float(e.get("used", 0.0)))
            else:
                self.entries[child.name] = Entry("", _du(child), 0.0)

    def _save(self) -> None:
        data = {
            d: {"peer": e.peer, "size": e.size, "used": e.used} for d, e in self.entries.items()
        }
        tmp = self.cache.root / f"{INDEX}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.cache.root / INDEX)

    def used_bytes(self, peer: str | None = None) -> int:
        return sum(e.size for e in self.entries.values() if peer is None or e.peer == peer)

    # -- permissions ------------------------------------------------------------------------
    def expect(self, peer: str, digest: str) -> None:
        """A reserve from `peer` passed every check and needs `digest`: it may ship it."""
        now = time.monotonic()
        with self._lock:
            for key in [k for k, t in self.expected.items() if t < now]:
                del self.expected[key]
            self.expected[(peer, digest)] = now + EXPECT_S

    def has(self, digest: str) -> Path | None:
        path = self.cache.has(digest)
        if path is not None:
            with self._lock:
                e = self.entries.get(digest)
                if e is not None:
                    e.used = time.time()
        return path

    # -- a transfer -------------------------------------------------------------------------
    def receive(
        self, peer: str, digest: str, off: int, total: int, data: bytes, last: bool
    ) -> Path | None:
        tag = str(digest)[:12]
        with self._lock:
            if self.expected.get((peer, digest), 0.0) < time.monotonic():
                raise BlobError(
                    f"blob {tag} from {peer}: no pending reserve from {peer} asked for this "
                    "context (a context is accepted only for a reserve that needs it)",
                    "unasked",
                )
            if off == 0 and isinstance(total, int):
                self._make_room(peer, digest, total)
        path = self.cache.receive(digest, off, total, data, last)
        if path is not None:
            with self._lock:
                self.expected.pop((peer, digest), None)
                if digest not in self.entries:
                    self.entries[digest] = Entry(peer, total, time.time())
                self.entries[digest].used = time.time()
                self._save()
        return path

    def _make_room(self, peer: str, digest: str, total: int) -> None:
        """Room for `total` more bytes of `peer`'s: the least recently used contexts no job
        here refers to go first; BlobError when there is still no room."""
        if digest in self.entries:
            return
        if total > self.peer_bytes:
            raise BlobError(
                f"blob {digest[:12]} from {peer}: a context of {format_size(total)} is over "
                f"this machine's {format_size(self.peer_bytes)} per peer "
                "(federation.contexts_peer_mb)",
                "quota",
            )
        busy = self.in_use()
        for scope, cap, what in (
            (peer, self.peer_bytes, "per peer (federation.contexts_peer_mb)"),
            (None, self.max_bytes, "for every peer (federation.contexts_max_mb)"),
        ):
            while self.used_bytes(scope) + total > cap:
                idle = [
                    (e.used, d)
                    for d, e in self.entries.items()
                    if d not in busy and (scope is None or e.peer == scope)
                ]
                if not idle:
                    raise BlobError(
                        f"blob {digest[:12]} from {peer}: {format_size(total)} more would pass "
                        f"this machine's {format_size(cap)} of contexts {what}, and every "
                        "context held is in use; try again when its jobs end",
                        "quota",
                    )
                _used, victim = min(idle)
                self._evict(victim)

    def _evict(self, digest: str) -> None:
        entry = self.entries.pop(digest)
        shutil.rmtree(self.cache.root / digest, ignore_errors=True)
        self.log(
            f"federation: removed context {digest[:12]} ({format_size(entry.size)}, shipped by "
            f"{entry.peer or 'an earlier daemon'}): least recently used, no job refers to it"
        )
        self._save()


def _du(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total
