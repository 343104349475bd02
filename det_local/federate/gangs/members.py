"""A share of another node's gang run here: its context received (by digest, from its owner
only), `reserve` queues a MEMBER job under this node's own policy, `ready` once that policy
starts it, `commit` spawns its ranks, `abort` drops it; and its exit reported to the owner."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from det_local.errors import DetLocalError
from det_local.federate.gangs.state import HOLD_S, GangBook, MemberGang
from det_local.sched.run.rendezvous import Rendezvous, interface_of
from det_local.store.tables.jobs import QUEUED, RESERVED, SCHEDULED, JobRecord

if TYPE_CHECKING:
    from det_local.federate.blobs import ContextCache
    from det_local.federate.shipments import Shipments


class Wounds(Protocol):
    """Wound-wait (`placement.Placement`): a new share may stand in front of younger ones."""

    def wound_younger(self) -> None: ...


class MemberLogs(Protocol):
    """A running share's log shipping and held frames (`relay.Relay`)."""

    def ship_logs(self, mg: MemberGang) -> None: ...
    def send_log(self, mg: MemberGang, final: bool = False) -> None: ...
    def fail_backlog(self, mg: MemberGang, why: str) -> None: ...


class Members:
    """The member's side of a gang: the shares of other nodes' gangs run here."""

    def __init__(self, book: GangBook, wounds: Wounds, logs: MemberLogs) -> None:
        self.book = book
        self.view = book.view
        self.wounds = wounds
        self.logs = logs
        self._contexts: ContextCache | None = None
        self._shipments: Shipments | None = None

    # ---------------------------------------------------------------- contexts
    def contexts(self) -> ContextCache:
        if self._contexts is None:
            from det_local.federate.blobs import ContextCache

            fed = self.view.paths.home / "fed"
            fed.mkdir(mode=0o755, exist_ok=True)  # the ranks (any user) reach their context
            self._contexts = ContextCache(fed / "contexts")
        return self._contexts

    def shipments(self) -> Shipments:
        """Who may ship which context here, and the caps on what stays (shipments.py)."""
        if self._shipments is None:
            from det_local.federate.shipments import Shipments

            s = self.book.fed.settings
            mb = 1024 * 1024
            self._shipments = Shipments(
                self.contexts(),
                (s.contexts_max_mb if s is not None else 2048) * mb,
                (s.contexts_peer_mb if s is not None else 1024) * mb,
                self._digests_in_use,
                self.view.log,
            )
        return self._shipments

    def _digests_in_use(self) -> set[str]:
        return {
            str(j.gang["digest"])
            for j in self.view.active_jobs()
            if j.gang is not None and j.gang.get("digest")
        }

    def on_has(self, msg: dict[str, Any]) -> bool:
        return self.contexts().has(msg["digest"]) is not None

    def on_blob(self, node: str, msg: dict[str, Any]) -> None:
        self.shipments().receive(
            node, msg["digest"], msg["off"], msg["total"], msg["data"], msg["last"]
        )

    # ---------------------------------------------------------------- reserve, ready
    def on_reserve(self, node: str, msg: dict[str, Any]) -> str:
        gang, run = msg["gang"], msg["run"]
        if not gang.startswith(f"{node}:"):
            raise DetLocalError(f"gang {gang} is not {node}'s to place [permanent]")
        spec = msg["spec"]
        command = spec.get("command")
        free, total, kind = self.view.slots()
        if msg["slots"] > total:
            raise DetLocalError(
                f"a share of {msg['slots']} slots is more than this machine's {total} [permanent]"
            )
        if self.view.node_disabled():
            raise DetLocalError(
                "this machine is disabled (`det-local cluster node disable`): it takes no new "
                "work from peers"
            )
        self.book.fed.lending.check(node, msg["user"], msg.get("uid"))  # LendRefused: one line
        if command is not None:  # a command sent whole (`cmd run --anywhere`)
            self.view.check_gang_command(command, msg["user"])
        else:
            self.view.check_gang_config(spec["config"], msg["user"])
            if self.shipments().has(spec["digest"]) is None:
                self.shipments().expect(node, spec["digest"])
                return "context"  # ship it (accepted from this peer only), then reserve again
        old = self.book.members.get(gang)
        if old is not None:
            if run < old.run:
                raise DetLocalError(f"gang {gang}: run {run} is older than run {old.run}")
            if run == old.run:
                return "queued"  # a duplicate reserve
            self.drop_member(old, f"run {run} replaces run {old.run}")
        job_id = self.view.gangs.enqueue_member(
            name=f"{msg['user']}@{node}: {msg['name']}"[:200],
            user=msg["user"],
            priority=int(msg["priority"]) + self.book.fed.lend_priority_offset,
            slots=int(msg["slots"]),
            gang={
                "gang": gang,
                "owner": node,
                "run": run,
                "key": msg["key"],
                "hold_s": float(msg.get("hold_s", HOLD_S)),
                **spec,
            },
        )
        self.book.members[gang] = MemberGang(gang, node, job_id, run)
        self.wounds.wound_younger()
        self.view.schedule()
        return "queued"

    def member_started(self, job: JobRecord) -> None:
        gang = job.gang or {}
        mg = self.book.members.get(str(gang.get("gang")))
        if mg is None or mg.job_id != job.id:
            self.view.gangs.drop_member(job.id, "its owner no longer places it")
            return
        hold = float(gang.get("hold_s", HOLD_S))
        loop = asyncio.get_running_loop()
        mg.hold_timer = loop.call_later(hold, self._hold_expired, mg)
        self.book.fed.spawn(self._ready(mg))

    async def _ready(self, mg: MemberGang) -> None:
        try:
            await self.book.request(mg.owner, {"t": "ready", "gang": mg.gang, "run": mg.run})
        except (DetLocalError, ConnectionError, asyncio.TimeoutError, OSError) as err:
            if self.book.members.get(mg.gang) is mg:
                self.drop_member(mg, f"its owner refused ready: {err}")

    def _hold_expired(self, mg: MemberGang) -> None:
        job = self.view.job(mg.job_id)
        if self.book.members.get(mg.gang) is not mg or job is None or job.state != RESERVED:
            return
        why = "no commit within the hold time; back in the queue"
        self.view.gangs.release(mg.job_id, why)
        self.book.send(mg.owner, {"t": "wounded", "gang": mg.gang, "run": mg.run, "why": why})

    # ---------------------------------------------------------------- commit, abort, exit
    def on_commit(self, node: str, msg: dict[str, Any]) -> Any:
        mg = self._member_for(node, msg)
        job = self.view.job(mg.job_id)
        if job is not None and job.state == SCHEDULED:
            return {"pid": job.pid}  # a duplicate commit
        if job is None or job.state != RESERVED:
            raise DetLocalError(
                f"gang {mg.gang} run {mg.run}: not reserved here (the hold expired or it was "
                "released); place it again"
            )
        spec = job.gang or {}
        context = None
        if "command" not in spec:
            context = self.shipments().has(spec.get("digest", ""))
            if context is None:
                raise DetLocalError(f"gang {mg.gang}: its context is no longer here")
        addrs = list(msg["addrs"])
        rank = int(msg["node_rank"])
        rdv = Rendezvous(  # RendezvousError (one line) for a rank or counts not in addrs
            addrs,
            rank,
            list(msg["slot_counts"]),
            interface_of(addrs[rank]) if 0 <= rank < len(addrs) else None,
            self.book.dist_secret(mg.gang, mg.run),
        )
        if mg.hold_timer is not None:  # a refused commit leaves the hold running
            mg.hold_timer.cancel()
        try:
            where = None if context is None else Path(context)
            pid = self.view.gangs.launch_member(mg.job_id, msg, where, rdv)
        except DetLocalError:  # its job ended: the gang is no longer placed here
            self.book.members.pop(mg.gang, None)
            raise
        self.logs.ship_logs(mg)
        return {"pid": pid}

    def _member_for(self, node: str, msg: dict[str, Any]) -> MemberGang:
        mg = self.book.members.get(msg["gang"])
        if mg is None or mg.owner != node:
            raise DetLocalError(f"unknown gang {str(msg['gang'])[:80]}")
        if msg["run"] != mg.run:
            raise DetLocalError(
                f"gang {mg.gang}: run {msg['run']} is stale (run {mg.run} is the current one)"
                if msg["run"] < mg.run
                else f"gang {mg.gang}: run {msg['run']} was never reserved here"
            )
        return mg

    def on_abort(self, node: str, msg: dict[str, Any]) -> None:
        mg = self._member_for(node, msg)
        self.drop_member(mg, f"aborted by {node}: {msg['why']}")

    def drop_member(self, mg: MemberGang, why: str) -> None:
        if mg.hold_timer is not None:
            mg.hold_timer.cancel()
        self.logs.fail_backlog(mg, why)
        job = self.view.job(mg.job_id)
        if job is not None and job.state in (QUEUED, RESERVED):
            self.book.members.pop(mg.gang, None)
        self.view.gangs.drop_member(mg.job_id, why)

    def member_exited(self, job: JobRecord, code: int | None) -> None:
        gang = job.gang or {}
        mg = self.book.members.get(str(gang.get("gang")))
        if mg is None or mg.job_id != job.id:
            return
        self.book.members.pop(mg.gang, None)
        self.logs.fail_backlog(mg, "its ranks exited")
        self.book.fed.spawn(self._last_logs_then_exit(mg, code))

    async def _last_logs_then_exit(self, mg: MemberGang, code: int | None) -> None:
        if mg.log_task is not None:
            mg.log_task.cancel()
        with contextlib.suppress(Exception):
            self.logs.send_log(mg, final=True)
        self.book.send(
            mg.owner,
            {
                "t": "member_exit",
                "gang": mg.gang,
                "run": mg.run,
                "code": -9 if code is None else code,
            },
        )

    def on_share(self, node: str, msg: dict[str, Any]) -> dict[str, Any]:
        """The owner asks whether this node still runs its share of a gang."""
        mg = self.book.members.get(msg["gang"])
        if mg is not None and mg.owner == node and mg.run == msg["run"]:
            return {"state": "running"}
        died = self.book.died.get((msg["gang"], msg["run"]))
        if died is not None:
            return {"state": "lost", "why": died}
        for job in self.view.member_jobs(msg["gang"], msg["run"]):
            if (job.gang or {}).get("owner") == node and job.state not in (QUEUED, RESERVED):
                if job.state == SCHEDULED:
                    return {"state": "running"}
                return {"state": "ended", "code": -9 if job.exit_code is None else job.exit_code}
        raise DetLocalError(f"unknown gang {str(msg['gang'])[:80]} run {msg['run']}")
