"""The slot inventory as the running engine sees it: what `det-local slots` and the plan of
`config check` show.

The engine discovered its slots once, at its start, in its own environment (the daemon's
DET_LOCAL_CPU_SLOTS, daemon.yaml's cpu_slots, the GPUs it can see), and knows which of them its
jobs hold. A client asks it (the `slots` spool request, answered by
`sched/queue/inventory.engine_answer`) rather
than discovering again in the caller's environment, which can differ (a user's shell has no
DET_LOCAL_CPU_SLOTS=2 from /etc/default/det-local). Only when no engine runs does the client
discover the slots itself, as an engine started now would (daemon.yaml's cpu_slots included),
with the holders of the jobs the store records as running.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from det_local.sched.queue import hardware as hardware
from det_local.sched.queue.inventory import our_pids
from det_local.store.paths import Paths

ASK_TIMEOUT_S = 15.0
FROM_ENGINE = "engine"
FROM_DISCOVERY = "discovered"


@dataclass(frozen=True)
class SlotView:
    inventory: hardware.Inventory  # foreign processes filled in
    holders: dict[int, str]  # slot index -> "experiment E trial T (user)" / "command J (user)"
    origin: str  # FROM_ENGINE (the running engine's inventory) or FROM_DISCOVERY (this process)
    # slot index -> the job holding it: job_id, job_kind, held_since, held_for_s, idle_for_s,
    # idle_flagged (`det_local/usage/gpus.slot_jobs`)
    jobs: dict[int, dict[str, Any]] = field(default_factory=dict)

    def rows(self) -> list[dict[str, Any]]:
        """`slots.describe`'s rows (table and --json), with the holding job's keys."""
        empty = dict.fromkeys(
            ("job_id", "job_kind", "held_since", "held_for_s", "idle_for_s"), None
        )
        return [
            {**row, **empty, "idle_flagged": False, **self.jobs.get(row["index"], {})}
            for row in hardware.describe(self.inventory, self.holders)
        ]


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
    jobs = {int(i): dict(info) for i, info in answer.get("jobs") or []}
    return SlotView(inv, holders, FROM_ENGINE, jobs)


def current(paths: Paths) -> SlotView:
    """The running engine's inventory; this machine's, discovered here, when none runs."""
    from det_local.client.requester import EngineGone, remote_request
    from det_local.sched.enginelock import lock_free

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
    import time

    from det_local.usage.gpus import slot_jobs, with_fake_usage

    store = Store(paths.db, readonly=True)
    try:
        jobs = store.jobs.active()
        idle = store.usage.idle_states([j.id for j in jobs])
    finally:
        store.close()
    return SlotView(
        with_fake_usage(hardware.detect_foreign(inv, our_pids(jobs))),
        hardware.slot_holders(jobs),
        FROM_DISCOVERY,
        slot_jobs(jobs, idle, time.time()),
    )
