"""Where the SDK reads and where it sends changes: the store of DET_LOCAL_HOME, read-only,
and the engine's spool, as the caller's own Unix user (so the owner rules of
`sched/intake/handlers.py` hold for the SDK exactly as for the CLI). With no engine running, a
change is applied by an engine in this process, as `det-local experiment kill` does."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from det_local.store.db import Store
from det_local.store.paths import Paths


class Session:
    """One det-local home as the SDK sees it (Determined's api.Session stands here)."""

    def __init__(self, paths: Paths | None = None) -> None:
        self.paths = paths or Paths.from_env()

    @contextmanager
    def store(self) -> Iterator[Store]:
        """A read-only view of the store, closed after the block."""
        store = Store(self.paths.db, readonly=True)
        try:
            yield store
        finally:
            store.close()

    def send(self, op: str, payload: dict[str, Any]) -> Any:
        """A change, as a request to the engine (or an engine here when none runs); its
        answer's value, or the DetLocalError whose one line the engine answered."""
        from det_local.client.control import control_job

        return control_job(self.paths, op, payload)

    def control(self, experiment_id: int, action: str) -> str:
        """pause / activate / kill an experiment, as `det-local experiment ACTION` does
        (activate with no engine running queues nothing: a daemon must run to start it)."""
        from det_local.errors import DetLocalError
        from det_local.sched.enginelock import lock_free

        if action == "activate" and lock_free(self.paths):
            raise DetLocalError(
                f"experiment {experiment_id}: no det-local engine is running for "
                f"{self.paths.home} to run it; `det-local daemon start`, or "
                f"`det-local experiment activate {experiment_id}` runs it in a terminal"
            )
        return str(self.send(action, {"experiment_id": experiment_id}))
