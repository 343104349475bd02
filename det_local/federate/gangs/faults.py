"""Faults of the machines under a gang: every heartbeat tick, the gangs whose machines died
(a dead peer while placing: placed again; while running: lost, requeued); and a restart of
this daemon (`recover`): the gangs whose ranks outlived it are taken back, each other node
confirms its share once its link is up, and a share whose ranks died with this daemon is
reported lost to its owner (a machine that died and came back is a lost machine)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Protocol

from det_local.errors import DetLocalError
from det_local.federate.gangs.state import GangBook, MemberGang, OwnerGang, Share
from det_local.sched.gangseam import REATTACH_S
from det_local.store.states import JobKind
from det_local.store.tables.jobs import QUEUED, SCHEDULED


class Placing(Protocol):
    """What faults ask of placement (`placement.Placement`)."""

    def unplaced(self, og: OwnerGang, why: str) -> None: ...
    def wound_younger(self) -> None: ...


class Ending(Protocol):
    """What faults ask of an owned gang's end (`ends.Ends`)."""

    def finish(self, og: OwnerGang) -> None: ...
    def lose(self, og: OwnerGang, s: Share, why: str) -> None: ...
    def on_member_exit(self, node: str, msg: dict[str, Any]) -> None: ...


class Dropping(Protocol):
    """What faults ask of the member side (`members.Members`)."""

    def drop_member(self, mg: MemberGang, why: str) -> None: ...


class Shipping(Protocol):
    """What faults ask of the relay (`relay.Relay`)."""

    def ship_logs(self, mg: MemberGang) -> None: ...
    def flush(self, mg: MemberGang) -> None: ...


class Faults:
    """Dead machines and daemon restarts, for every gang this node owns or runs a share of."""

    def __init__(
        self, book: GangBook, placing: Placing, ending: Ending, members: Dropping, logs: Shipping
    ) -> None:
        self.book = book
        self.view = book.view
        self.placing = placing
        self.ending = ending
        self.members = members
        self.logs = logs

    def tick(self) -> None:
        """Every heartbeat tick: gangs whose machines died."""
        book = self.book
        now = time.monotonic()
        for og in list(book.owned.values()):
            for s in og.shares.values():
                if s.exited:
                    continue
                if og.state == "reserving":  # nothing runs yet: a dead peer is gone at once
                    if not book.gone(s.node, og.since, now, window=0.0):
                        continue
                    why = f"machine {s.node} was lost"
                    s.exited, s.code = True, None
                    book.abort_members(og, why)
                    book.forget_owned(og)
                    self.placing.unplaced(og, why)
                    break
                # running ranks: a daemon restart inside REATTACH_S keeps them
                if book.gone(s.node, og.since, now):
                    self.ending.lose(og, s, f"machine {s.node} was lost")
            if og.state == "settling":
                self.ending.finish(og)
        for mg in list(book.members.values()):
            job = self.view.job(mg.job_id)
            running = job is not None and job.state == SCHEDULED
            if book.gone(mg.owner, mg.since, now, window=REATTACH_S if running else 0.0):
                self.members.drop_member(mg, f"the trial's owner {mg.owner} was lost")
        if any(j.state == QUEUED and j.gang is not None for j in self.view.active_jobs()):
            self.placing.wound_younger()

    # ---------------------------------------------------------------- daemon restarts
    def recover(self) -> None:
        """After this daemon restarted: the gangs whose shares were found running (adopted by
        the engine, sched/gangs.py) are taken back. Each other node confirms its share once
        its link is up (`share`); one not heard within REATTACH_S of the restart is lost.
        A share whose ranks died with this daemon is reported lost to its owner as soon as
        their link is up (a machine that died and came back is a lost machine)."""
        book = self.book
        for spec in self.view.gangs.died_with_daemon.values():
            owner, gang, run = str(spec.get("owner")), str(spec.get("gang")), spec.get("run")
            if not isinstance(run, int) or not gang:
                continue
            why = f"machine {book.node} restarted and its ranks of gang {gang} were gone"
            book.died[(gang, run)] = why
            report = {"t": "member_exit", "gang": gang, "run": run, "code": -9, "lost": True}
            book.lost_reports.setdefault(owner, []).append(report)
            self.view.log(f"federation: {why}: reported lost to {owner}")
        self.view.gangs.died_with_daemon.clear()
        for owner in list(book.lost_reports):
            if book.linked(owner):
                self.peer_attached(owner)
        for job in self.view.active_jobs():
            spec = job.gang or {}
            if job.state != SCHEDULED or not self.view.gangs.claim(job.id):
                continue
            if job.kind == JobKind.MEMBER:
                mg = MemberGang(str(spec["gang"]), str(spec["owner"]), job.id, int(spec["run"]))
                offset = self.view.gangs.member_log(job.id).with_name("log.offset")
                with contextlib.suppress(OSError, ValueError):
                    mg.log_offset = int(offset.read_text())
                book.members[mg.gang] = mg
                self.logs.ship_logs(mg)
                self.view.log(
                    f"federation: share of gang {mg.gang} run {mg.run} taken back after a restart"
                )
                continue
            if "shares" not in spec:
                continue  # placed by a daemon that did not record it: it ends (unclaimed)
            self.view.gangs.adopted.add(job.id)  # not taken back after all: it ends
            og = OwnerGang(
                f"{book.node}:{job.id}",
                job.id,
                job.trial_id or 0,
                job.experiment_id or 0,
                int(spec["run"]),
                list(spec["key"]),
                int(spec["per_node"]),
                int(spec["local"]),
                anywhere=bool(spec.get("anywhere")),
                command=job.trial_id is None,
            )
            og.state = "committed"
            for node, rank in dict(spec["shares"]).items():
                og.shares[str(node)] = Share(str(node), int(rank), True, True, confirmed=False)
            og.trial_run = None if og.command else self.view.trial_run(og.trial_id)
            book.owned[og.gang] = og
            self.view.gangs.adopted.discard(job.id)
            self.view.log(f"federation: gang {og.gang} run {og.run} taken back after a restart")

    def peer_attached(self, node: str) -> None:
        """A link to `node` is up (again): the committed shares it holds of gangs owned here
        are confirmed (it, or this daemon, may have restarted); frames held for it go."""
        book = self.book
        for report in book.lost_reports.pop(node, []):
            if not book.send(node, report):
                book.lost_reports.setdefault(node, []).append(report)
        for og in list(book.owned.values()):
            s = og.shares.get(node)
            if s is not None and og.state != "reserving" and not s.exited:
                s.confirmed = False  # until it says it still runs (a restart may have lost it)
                s.asked = time.monotonic()  # a failure's verdict waits for the answer
                book.fed.spawn(self._confirm(og, s))
        for mg in list(book.members.values()):
            if mg.owner == node and mg.backlog:
                self.logs.flush(mg)

    async def _confirm(self, og: OwnerGang, s: Share) -> None:
        try:
            value = await self.book.request(s.node, {"t": "share", "gang": og.gang, "run": og.run})
        except DetLocalError as err:
            value = {"state": "unknown", "why": str(err)}
        except (ConnectionError, asyncio.TimeoutError, OSError):
            return  # the link went again: tick() decides
        if self.book.owned.get(og.gang) is not og or s.exited:
            return
        state = value.get("state") if isinstance(value, dict) else None
        if state == "running":
            s.confirmed, s.asked = True, None
        elif state == "ended":
            code = value.get("code")
            code = int(code) if isinstance(code, int) and -255 <= code <= 255 else 1
            self.ending.on_member_exit(s.node, {"gang": og.gang, "run": og.run, "code": code})
        else:
            why = str(value.get("why", "")) if isinstance(value, dict) else ""
            self.ending.lose(og, s, f"machine {s.node} no longer runs its share ({why[:200]})")
