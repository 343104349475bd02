"""`Gangs`: the cluster's half of trials across machines as one object, the `Placer` the
engine calls (`sched/gangseam.py`) and what the federation service drives (ticks, links up,
restarts). It only wires the concerns together around one `GangBook` and passes each call to
the concern it belongs to; the peers' gang messages reach the concerns through
`messages.GANG_HANDLERS`."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from det_local.federate.gangs.ends import Ends
from det_local.federate.gangs.faults import Faults
from det_local.federate.gangs.members import Members
from det_local.federate.gangs.placement import Placement
from det_local.federate.gangs.relay import Relay
from det_local.federate.gangs.state import GangBook, GangsHost

if TYPE_CHECKING:
    from det_local.sched.gangseam import GangFit
    from det_local.sched.life.experiments import TrialRun
    from det_local.store.tables.jobs import JobRecord


class Gangs:
    """The placer (sched/gangs.py `Placer`), one per federation service."""

    def __init__(self, fed: GangsHost) -> None:
        self.book = GangBook(fed)
        self.placement = Placement(self.book)
        self.frames = Relay(self.book)
        self.members = Members(self.book, self.placement, self.frames)
        self.ends = Ends(self.book)
        self.faults = Faults(self.book, self.placement, self.ends, self.members, self.frames)

    # ---------------------------------------------------------------- Placer: placement
    def fit(self, slots: int) -> GangFit:
        return self.placement.fit(slots)

    def idle_peer(self, slots: int, job_id: int | None = None) -> str | None:
        return self.placement.idle_peer(slots, job_id)

    def share_started(self, job: JobRecord) -> None:
        self.placement.share_started(job)

    def yield_share(self, job: JobRecord, why: str) -> None:
        self.placement.yield_share(job, why)

    # ---------------------------------------------------------------- Placer: life and end
    def member_started(self, job: JobRecord) -> None:
        self.members.member_started(job)

    def member_exited(self, job: JobRecord, code: int | None) -> None:
        self.members.member_exited(job, code)

    def owner_exited(self, run: TrialRun, code: int) -> bool:
        return self.ends.owner_exited(run, code)

    def stop(self, run: TrialRun) -> None:
        self.ends.stop(run)

    def abort_job(self, job: JobRecord, why: str) -> None:
        self.ends.abort_job(job, why)

    # ---------------------------------------------------------------- Placer: frames
    def relay(self, run: TrialRun, msg: dict[str, Any]) -> asyncio.Future[Any] | None:
        return self.frames.relay(run, msg)

    def down(self, run: TrialRun, frame: dict[str, Any]) -> None:
        self.frames.down(run, frame)

    # ---------------------------------------------------------------- the service's calls
    def peers_changed(self) -> None:
        self.placement.peers_changed()

    def peer_attached(self, node: str) -> None:
        self.book.forget_refusals(node)
        self.faults.peer_attached(node)

    def lending_changed(self, node: str) -> None:
        self.book.forget_refusals(node)

    def tick(self) -> None:
        self.faults.tick()

    def recover(self) -> None:
        self.faults.recover()
