"""The dashboard's SQLite handles: one read-only Store per worker thread, reused by every
request that thread serves, and the worker threads bounded (`THREADS`), so the dashboard holds
at most THREADS connections however many requests come (before, each request opened its own and
left it to the garbage collector: hundreds of handles on the database and its WAL).

`det_local.api.open_store()` asks the pool once it is installed (`install`); a Store is opened
again when the database appears after an empty one was used (nothing had run yet) or was
replaced, and the Stores of worker threads that ended are closed.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from det_local.store.db import Store
from det_local.store.paths import Paths

THREADS = 16  # worker threads (anyio's limiter), so also the most Stores open at once
SWEEP_S = 1.0  # how often the Stores of ended threads are looked for


@dataclass
class _Held:
    store: Store
    ident: tuple[int, int] | None  # (st_dev, st_ino) of the database when it was opened
    empty: bool  # an empty in-memory store: opened again once the database has its tables


def _identity(paths: Paths) -> tuple[int, int] | None:
    try:
        st = os.stat(paths.db)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _in_memory(store: Store) -> bool:
    """The empty store a reader gets before the database has its tables."""
    row = store.conn.execute("PRAGMA database_list").fetchone()
    return not row or not row[2]


class StorePool:
    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        self.lock = threading.Lock()
        self.held: dict[int, _Held] = {}  # thread id -> its Store
        self.swept = time.monotonic()

    def get(self) -> Store:
        me = threading.get_ident()
        now = _identity(self.paths)
        if time.monotonic() - self.swept >= SWEEP_S:
            self._close_orphans()
        with self.lock:
            held = self.held.get(me)
        if held is not None and held.ident == now and not (held.empty and now is not None):
            return held.store
        store = Store(self.paths.db, readonly=True)
        empty = _in_memory(store)  # nothing recorded yet, or the tables not made yet
        with self.lock:
            self.held[me] = _Held(store, now, empty)
        # the Store replaced (if any) is not closed here: a caller up this thread's stack may
        # still read from it; it closes when its last reference goes (no cycles hold it)
        return store

    def _close_orphans(self) -> None:
        self.swept = time.monotonic()
        alive = {t.ident for t in threading.enumerate()}
        with self.lock:
            gone = [i for i in self.held if i not in alive]
            stores = [self.held.pop(i).store for i in gone]
        for store in stores:
            store.close()

    def size(self) -> int:
        with self.lock:
            return len(self.held)

    def close(self) -> None:
        with self.lock:
            stores = [h.store for h in self.held.values()]
            self.held.clear()
        for store in stores:
            store.close()


def install(paths: Paths) -> StorePool:
    """Make det_local.api read through one pool for `paths` (this process: the dashboard)."""
    from det_local import api

    pool = StorePool(paths)
    api.use_store(pool.get, paths)
    return pool


def limit_threads() -> None:
    """Bound the worker threads of the running event loop (sync routes and the streams'
    polls run there): call it from inside the loop, once."""
    import anyio.to_thread

    anyio.to_thread.current_default_thread_limiter().total_tokens = THREADS
