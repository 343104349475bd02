"""Services that run on the daemon's event loop next to the engine (federation, later others).

`sched` imports none of them: the daemon's entry point (`det-local daemon`, in `cli/`) hands
`run_foreground` a list of factories, and each service gets an `EngineView`: a narrow,
read-only view of this node (its home, its slots, its queue) and the daemon's log. A service
may not change the engine's state through the view; what it needs to change later comes as
new seams here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from det_local.store.paths import Paths

if TYPE_CHECKING:
    from det_local.sched.engine import Engine


class Extension(Protocol):
    async def start(self) -> None:
        """Called once the engine serves (jobs of an earlier daemon adopted)."""

    async def stop(self) -> None:
        """Called when the daemon stops, before the engine does; must not raise."""


ExtensionFactory = Callable[["EngineView"], Extension]

# what a job shows to other nodes (no argv, cwd, pid or message: those stay on this node)
JOB_FIELDS = (
    "id",
    "kind",
    "name",
    "user",
    "priority",
    "slots_needed",
    "state",
    "experiment_id",
    "trial_id",
    "slots",
    "submitted_at",
    "started_at",
)


class EngineView:
    """What a service may read of the engine; every method runs on the engine's loop."""

    def __init__(self, engine: Engine, log: Callable[[str], None]) -> None:
        self._engine = engine
        self._log = log

    @property
    def paths(self) -> Paths:
        return self._engine.paths

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def log(self, line: str) -> None:
        """One line in the daemon's log (not an event in the store: a flood stays cheap)."""
        self._log(f"det-local: {line}")

    def slots(self) -> tuple[int, int, str]:
        """(free, total, kind): this node's slots now; kind is gpu or cpu."""
        total = self._engine.inventory.size()
        held = sum(len(j.slots) for j in self._engine.store.jobs.active() if j.state != "QUEUED")
        kind = "cpu" if self._engine.inventory.source == "cpu" else "gpu"
        return max(total - held, 0), total, kind

    def queue_digest(self, top: int = 5) -> dict[str, Any]:
        """Queued and running counts and the first `top` queued jobs as [priority, slots]."""
        jobs = self._engine.store.jobs.active()
        queued = sorted((j for j in jobs if j.state == "QUEUED"), key=lambda j: (j.priority, j.id))
        return {
            "queued": len(queued),
            "running": len(jobs) - len(queued),
            "top": [[int(j.priority), int(j.slots_needed)] for j in queued[:top]],
        }

    def jobs(self, include_done: bool = False, limit: int = 1000) -> list[dict[str, Any]]:
        """This node's jobs as `job list --json` gives them (running first, then queued)."""
        jobs = self._engine.store.jobs.list(include_done=include_done)
        order = {"SCHEDULED": 0, "QUEUED": 1}
        jobs.sort(key=lambda j: (order.get(str(j.state), 2), j.priority, j.id))
        return [{k: getattr(j, k) for k in JOB_FIELDS} for j in jobs[:limit]]

    def slot_rows(self) -> list[dict[str, Any]]:
        """This node's slots as `slots --json` gives them (without foreign process lists)."""
        from det_local.sched.slots import describe, slot_holders

        rows = describe(self._engine.inventory, slot_holders(self._engine.store.jobs.active()))
        return [{k: v for k, v in row.items() if k != "foreign"} for row in rows]
