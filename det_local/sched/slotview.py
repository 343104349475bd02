"""The slot inventory as the running engine sees it: what `det-local slots` and the plan of
`config check` show.

The engine discovered its slots once, at its start, in its own environment (the daemon's
DET_LOCAL_CPU_SLOTS, daemon.yaml's cpu_slots, the GPUs it can see), and knows which of them its
jobs hold. A client asks it (the `slots` spool request, answered by `engine_answer`) rather
than discovering again in the caller's environment, which can differ (a user's shell has no
DET_LOCAL_CPU_SLOTS=2 from /etc/default/det-local). Only when no engine runs does the client
discover the slots itself, as an engine started now would (daemon.yaml's cpu_slots included),
with the holders of the jobs the store records as running.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from det_local.sched import slots as hardware
from det_local.store.paths import Paths

ASK_TIMEOUT_S = 15.0
FROM_ENGINE = "engine"
FROM_DISCOVERY = "discovered"


@dataclass(frozen=True)
class SlotView:
    inventory: hardware.Inventory  # foreign processes filled in
    holders: dict[int, str]  # slot index -> "experiment E trial T (user)" / "command J (user)"
    origin: str  # FROM_ENGINE (the running engine's inventory) or FROM_DISCOVERY (this process)

    def rows(self) -> list[dict[str, Any]]:
        """`slots.describe`'s rows (table and --json)."""
        return hardware.describe(self.inventory, self.holders)


def engine_answer(inventory: hardware.Inventory, jobs: Sequence[Any]) -> dict[str, Any]:
    """The engine's answer to a `slots` request: its inventory (foreign processes, memory in
    use and utilisation looked up now) and who holds each slot, as plain values."""
    inv = hardware.read_usage(hardware.detect_foreign(inventory, _our_pids(jobs)))
    return {
        "source": inv.source,
        "note": inv.note,
        "slots": [asdict(s) for s in inv.slots],
        "holders": [[i, who] for i, who in sorted(hardware.slot_holders(jobs).items())],
    }


def from_answer(answer: dict[str, Any]) -> SlotView:
    slots = tuple(
        hardware.Slot(
            **{
                **s,
                "foreign_pids": tuple(s.get("foreign_pids") or ()),
                "foreign_users": tuple(s.get("foreign_users") or ()),
            }
        )
        for s in answer["slots"]
    )
    inv = hardware.Inventory(slots, str(answer["source"]), str(answer.get("note") or ""))
    holders = {int(i): str(who) for i, who in answer.get("holders") or []}
    return SlotView(inv, holders, FROM_ENGINE)


def current(paths: Paths) -> SlotView:
    """The running engine's inventory; this machine's, discovered here, when none runs."""
    from det_local.sched.requester import EngineGone, lock_free, remote_request

    if not lock_free(paths):
        try:
            return from_answer(remote_request(paths, "slots", {}, timeout=ASK_TIMEOUT_S))
        except EngineGone:  # it stopped meanwhile: discover, as below
            pass
    return discovered(paths)


def discovered(paths: Paths) -> SlotView:
    """No engine runs: the slots an engine started now would find (daemon.yaml's cpu_slots
    included), held by the jobs the store records as running (they outlive a stopped
    daemon)."""
    from det_local.sched.settings import load_settings
    from det_local.store.db import Store

    inv = hardware.discover(cpu_slots=load_settings(paths.settings).cpu_slots)
    store = Store(paths.db, readonly=True)
    try:
        jobs = store.jobs.active()
    finally:
        store.close()
    return SlotView(
        hardware.detect_foreign(inv, _our_pids(jobs)), hardware.slot_holders(jobs), FROM_DISCOVERY
    )


def _our_pids(jobs: Sequence[Any]) -> list[int]:
    return [j.pid for j in jobs if j.state == "SCHEDULED" and j.pid is not None]
