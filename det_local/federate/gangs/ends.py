"""How a gang this node owns ends: its ranks' exits on every machine, gathered (bounded by
END_WAIT_S), then one verdict (`federate/verdict.py`): the trial's own exit code, or a machine
lost (requeued from its latest checkpoint without using `max_restarts`)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from det_local.federate.gangs.state import END_WAIT_S, GangBook, OwnerGang, Share
from det_local.federate.peers import peer_state
from det_local.federate.verdict import Seen, Verdict, failed_gang
from det_local.sched.gangseam import REATTACH_S

if TYPE_CHECKING:
    from det_local.sched.life.experiments import TrialRun
    from det_local.store.tables.jobs import JobRecord


class Ends:
    """The owner's side of a running gang's end."""

    def __init__(self, book: GangBook) -> None:
        self.book = book
        self.view = book.view

    def owner_exited(self, run: TrialRun, code: int) -> bool:
        og = self.book.owned_by_trial(run.trial_id, run.run_id)
        if og is None:
            return False
        og.local_code = code
        og.trial_run = run
        og.state = "ending"
        if code != 0:
            _failed(og)
            self.book.abort_members(og, f"the trial's ranks on {self.book.node} exited with {code}")
        if _all_members_done(og):
            self.finish(og)
            return True
        loop = asyncio.get_running_loop()
        og.timer = loop.call_later(END_WAIT_S, self._end_timeout, og)
        return True

    def _end_timeout(self, og: OwnerGang) -> None:
        if self.book.owned.get(og.gang) is not og:
            return
        self.book.abort_members(og, "the trial's other ranks have ended")
        og.timer = asyncio.get_running_loop().call_later(END_WAIT_S, self.finish, og)

    def finish(self, og: OwnerGang) -> None:
        """Every rank of the gang has stopped: decide. A failure waits (bounded) until every
        other machine of the gang is known alive, or one is dead: then a machine was lost
        (federate/verdict.py)."""
        if self.book.owned.get(og.gang) is not og:
            return
        code = og.local_code if og.local_code is not None else 0
        if code == 0:
            for s in og.shares.values():
                if s.code not in (0, None):
                    code = s.code
                    break
        if code != 0 and og.lost is None and not og.command:  # a command's code is its own
            _failed(og)
            assert og.failed_at is not None
            verdict, node = failed_gang(og.failed_at, time.monotonic(), self._seen(og))
            unconfirmed = [s for s in og.shares.values() if not s.confirmed and not s.exited]
            if unconfirmed and time.monotonic() - og.failed_at < REATTACH_S:
                verdict = Verdict.WAIT  # a machine came back: did its ranks survive?
            if verdict == Verdict.WAIT:
                if og.timer is not None:
                    og.timer.cancel()
                    og.timer = None
                og.state = "settling"  # tick() asks again
                return
            if verdict == Verdict.LOST:
                og.lost = f"machine {node} was lost"
        self.book.forget_owned(og)
        if og.command:
            where = ", ".join(og.shares)
            self.view.gangs.remote_command_ended(og.job_id, code, where, og.lost)
            return
        if og.lost is not None:
            self.view.gangs.peer_lost[og.trial_id] = og.lost
            code = code or 1
        run = og.trial_run
        if run is not None:
            self.view.gang_exited(run, code)

    def _seen(self, og: OwnerGang) -> list[Seen]:
        now = time.monotonic()
        seen = []
        for node, s in og.shares.items():
            peer = self.book.fed.peers.get(node)
            if peer is None:
                seen.append(Seen(node, "gone", 0.0, False))
                continue
            linked = peer.link is not None and not peer.link.closed
            asked = s.asked if not s.confirmed and not s.exited else None
            seen.append(Seen(node, peer_state(peer, now), peer.last_heard, linked, asked))
        return seen

    def on_member_exit(self, node: str, msg: dict[str, Any]) -> None:
        og = self.book.owned.get(msg["gang"])
        if og is None or og.run != msg["run"] or node not in og.shares:
            return
        share = og.shares[node]
        share.exited, share.code = True, msg["code"]
        if msg.get("lost") and og.lost is None:  # its machine died (and may be back already)
            og.lost = f"machine {node} was lost (its ranks died with it)"
            self.view.log(f"federation: gang {og.gang} run {og.run}: {og.lost}")
            if og.state != "ending":
                self.lose(og, share, og.lost)
                return
        if share.code != 0:
            _failed(og)
        if og.state == "committed" and share.code != 0:
            why = f"the trial's ranks on {node} exited with {share.code}"
            og.failure = why
            if msg.get("lost"):
                og.lost = why
            self.book.abort_members(og, why)
            self.view.gangs.end_owner_run(og.trial_id, og.run, why, lost=og.lost is not None)
            if not og.local:
                self._check_done(og)
        elif og.state == "committed" and not og.local and _all_members_done(og):
            og.local_code = 0
            self._check_done(og)
        elif og.state == "ending" and _all_members_done(og):
            self.finish(og)

    def _check_done(self, og: OwnerGang) -> None:
        """A gang in which this node runs no ranks ends when its members have."""
        if _all_members_done(og):
            og.state = "ending"
            self.finish(og)

    def lose(self, og: OwnerGang, s: Share, why: str) -> None:
        """A machine holding a running share of the gang is lost: stop every rank, requeue."""
        s.exited, s.code = True, None
        og.lost = why
        self.book.abort_members(og, why)
        self.view.gangs.end_owner_run(og.trial_id, og.run, why, lost=True)
        if og.state == "ending" and _all_members_done(og):
            self.finish(og)
        elif not og.local:
            self._check_done(og)

    # ---------------------------------------------------------------- stopping it
    def on_yield(self, node: str, msg: dict[str, Any]) -> None:
        """A member's machine needs its slots for more important work: preempt the gang."""
        og = self.book.owned.get(msg["gang"])
        if og is None or og.run != msg["run"]:
            return
        self.view.preempt_gang(og.job_id, f"{node}: {msg['why']}")

    def abort_job(self, job: JobRecord, why: str) -> None:
        og = self.book.owned_job(job.id)
        if og is not None:
            self.book.abort_members(og, why)

    def stop(self, run: TrialRun) -> None:
        og = self.book.owned_by_trial(run.trial_id, run.run_id)
        if og is not None:
            self.book.abort_members(og, "the trial is being stopped")


def _all_members_done(og: OwnerGang) -> bool:
    return all(s.exited for s in og.shares.values())


def _failed(og: OwnerGang) -> None:
    if og.failed_at is None:
        og.failed_at = time.monotonic()
