"""Trials across machines: placement (owner-coordinated reserve/commit in one global order),
launch, relay of trial frames and logs, and faults (the engine's half is `sched/gangs.py`).

**Placement.** The owner's share of a gang is RESERVED by its own policy; the owner then ships
the context snapshot (by digest, cached) and sends `reserve` to the chosen peers. Each peer
queues a MEMBER job (its own policy, priorities and quotas apply); when that policy starts it,
its slots are RESERVED and the peer answers `ready`. Once every share is ready the owner picks
the chief's ports and sends `commit` (rendezvous: every node's address, slot counts, this
node's rank); each node spawns its ranks under torch.distributed.run. A RESERVED member holds
its slots at most `hold_s` without a commit, then goes back to the queue and tells the owner.

**No deadlock: wound-wait on one global order.** Every machine orders gangs by (priority,
submission time at the owner, owner id, job id). A RESERVED (uncommitted) share of a younger
gang that stands in front of an older gang's waiting share is released at once, and its owner
releases the whole gang and places it again later. Waits only go from younger to older.

**Fencing.** `run` is the owner's run id of the trial; it rises with every placement. A member
refuses a commit, abort or relay for a run older than the one it has.

**Faults.** A member whose owner is dead stops the owner's ranks here (SIGTERM, SIGKILL after
the grace period); an owner whose member is dead stops its own ranks and requeues the trial
from its latest checkpoint without using `max_restarts` (a separate cap). A rank that fails on a
member stops the gang's ranks everywhere (the owner ends its own and aborts the others).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from det_local.errors import DetLocalError
from det_local.federate.peers import Peer, peer_state
from det_local.federate.verdict import Seen, Verdict, failed_gang
from det_local.sched.gangseam import REATTACH_S, GangFit, owner_key, share_key
from det_local.sched.run.rendezvous import Rendezvous, interface_of
from det_local.store.states import JobKind
from det_local.store.tables.jobs import QUEUED, RESERVED, SCHEDULED, JobRecord

if TYPE_CHECKING:
    from det_local.federate.lending import LendPolicy
    from det_local.federate.settings import FederationSettings
    from det_local.federate.transport import Me
    from det_local.sched.extensions import EngineView
    from det_local.sched.life.experiments import TrialRun

HOLD_S = 30.0  # a RESERVED member without a commit goes back to the queue after this long
REQUEST_S = 10.0  # a reserve/commit/abort/has request without an answer: the peer is gone
END_WAIT_S = 10.0  # the owner's ranks exited: how long members get to finish theirs
LOG_EVERY_S = 0.25  # how often a member sends its ranks' new log lines to the owner
LOG_CHUNK = 256 * 1024
ANYWHERE_WAIT_S = 10.0  # a trial sent whole to a peer, not started there by then: back here
BACKLOG_MAX = 100_000  # frames a member holds for its owner while the owner's daemon restarts


@dataclass
class Share:
    """One node's part of a gang, as its owner tracks it."""

    node: str
    rank: int
    ready: bool = False
    committed: bool = False
    exited: bool = False
    code: int | None = None
    confirmed: bool = True  # False after this daemon restarted, until its node says it runs


@dataclass
class OwnerGang:
    """A gang this node owns (its trial's job is `job_id`)."""

    gang: str
    job_id: int
    trial_id: int
    experiment_id: int
    run: int
    key: list[Any]
    per_node: int
    local: int
    shares: dict[str, Share] = field(default_factory=dict)  # peer node -> its share
    state: str = "reserving"  # reserving, committed, ending, settling
    local_code: int | None = None
    failed_at: float | None = None  # when a rank of the gang was first seen failing
    trial_run: TrialRun | None = None
    failure: str | None = None  # a member's failure, when one ended the gang
    lost: str | None = None  # a machine lost
    timer: asyncio.TimerHandle | None = None
    anywhere: bool = False  # a job that fits here, sent whole to an idle peer
    # since when its members have been this daemon's to watch (a restart starts it again)
    since: float = field(default_factory=time.monotonic)
    command: bool = False  # that job is a command (`cmd run --anywhere`), not a trial
    log_bytes: int = 0  # log bytes its members relayed (capped: federation.max_log_mb)


@dataclass
class MemberGang:
    """A share of another node's gang run here (its JobKind.MEMBER job)."""

    gang: str
    owner: str
    job_id: int
    run: int
    hold_timer: asyncio.TimerHandle | None = None
    log_task: asyncio.Task[None] | None = None
    log_offset: int = 0
    since: float = field(default_factory=time.monotonic)  # as OwnerGang.since
    # frames for the owner while its link is down (its daemon restarting): sent once it is up
    backlog: list[tuple[dict[str, Any], asyncio.Future[Any] | None]] = field(default_factory=list)


class GangsHost(Protocol):
    """What the placer uses of its federation service (`federate/service.py`): this node, its
    peers, the lending policy, and a way to ask a peer and to run a task on the loop."""

    view: EngineView
    settings: FederationSettings | None
    me: Me | None
    peers: dict[str, Peer]
    lending: LendPolicy
    lend_priority_offset: int

    def spawn(self, coro: Awaitable[Any]) -> None: ...

    async def request(self, node: str, msg: dict[str, Any], timeout: float) -> dict[str, Any]: ...


class Gangs:
    """The placer (sched/gangs.py `Placer`), one per federation service."""

    def __init__(self, fed: GangsHost) -> None:
        self.fed = fed
        self.view = fed.view
        self.owned: dict[str, OwnerGang] = {}
        self.members: dict[str, MemberGang] = {}
        self._contexts: Any = None
        self._shipments: Any = None
        # shares whose ranks died with this daemon: owner node -> member_exit{lost} to send
        # once its link is up; (gang, run) -> why, for its `share` question
        self.lost_reports: dict[str, list[dict[str, Any]]] = {}
        self.died: dict[tuple[str, int], str] = {}

    # ================================================================== helpers
    @property
    def node(self) -> str:
        return self.fed.me.node if self.fed.me is not None else "local"

    def _live(self) -> dict[str, Peer]:
        now = time.monotonic()
        return {
            n: p
            for n, p in self.fed.peers.items()
            if p.link is not None and not p.link.closed and peer_state(p, now) == "alive"
        }

    def _send(self, node: str, msg: dict[str, Any]) -> bool:
        peer = self.fed.peers.get(node)
        if peer is None or peer.link is None or peer.link.closed:
            return False
        try:
            peer.link.session.send_now(msg)
        except (OSError, ConnectionError, ValueError) as err:
            self.view.log(f"federation: cannot send {msg.get('t')} to {node}: {err}")
            return False
        return True

    async def _request(self, node: str, msg: dict[str, Any], timeout: float = REQUEST_S) -> Any:
        """Send a request and wait for its reply's value; DetLocalError with the peer's line."""
        answer = await self.fed.request(node, msg, timeout)
        if answer.get("error"):
            raise DetLocalError(f"{node}: {answer['error']}")
        return answer.get("value")

    def _dist_secret(self, gang: str, run: int) -> str:
        assert self.fed.me is not None
        return hmac.new(self.fed.me.key, f"dist|{gang}|{run}".encode(), hashlib.sha256).hexdigest()

    def contexts(self) -> Any:
        if self._contexts is None:
            from det_local.federate.blobs import ContextCache

            fed = self.view.paths.home / "fed"
            fed.mkdir(mode=0o755, exist_ok=True)  # the ranks (any user) reach their context
            self._contexts = ContextCache(fed / "contexts")
        return self._contexts

    def shipments(self) -> Any:
        """Who may ship which context here, and the caps on what stays (shipments.py)."""
        if self._shipments is None:
            from det_local.federate.shipments import Shipments

            s = self.fed.settings
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

    # ================================================================== fit (Placer.fit)
    def fit(self, slots: int) -> GangFit:
        """Fewest nodes, equal slots per node, this node first when it can take part (one
        peer that holds the whole gang runs it alone: this node then only coordinates)."""
        free, total, kind = self.view.slots()
        nodes: list[tuple[int, int, str]] = [(total, 1, self.node)]
        for node, peer in self._live().items():
            if peer.kind == kind and peer.lend:
                nodes.append((peer.total, 0, node))
        nodes.sort(key=lambda n: (-n[0], -n[1], n[2]))
        best = max((n[0] for n in nodes), default=0)
        for count in range(1, len(nodes) + 1):
            if slots % count:
                continue
            per = slots // count
            able = [n for n in nodes if n[0] >= per]
            if len(able) < count:
                continue
            chosen = [n for n in able if n[2] == self.node][:1]
            chosen += [n for n in able if n[2] != self.node][: count - len(chosen)]
            local = per if chosen[0][2] == self.node else 0
            return GangFit(slots, per, tuple(n[2] for n in chosen), local)
        live = len(nodes)
        raise DetLocalError(
            f"resources.slots_per_trial: {slots} slots cannot be fitted on the cluster's live "
            f"{kind.upper()} machines ({live} node{'s' if live > 1 else ''}, at most {best} "
            "slots each; a trial across machines takes the same number of slots on each): "
            "use a multiple that fits, or wait for more machines (`det-local cluster status`)"
        )

    # ================================================================== owner side
    def share_started(self, job: JobRecord) -> None:
        size = int((job.gang or {}).get("size", 0))
        anywhere = str((job.gang or {}).get("anywhere") or "")
        if anywhere:  # a trial sent whole to an idle peer (GangShares.offload_waiting)
            peer = self._live().get(anywhere)
            if peer is None or not peer.lend:
                self.view.gangs.back_home(job.id, f"machine {anywhere} is no longer reachable")
                self.view.schedule()
                return
            fit = GangFit(size, size, (anywhere,), 0)
        else:
            try:
                fit = self.fit(size)
            except DetLocalError as err:
                self._hold(job.id, f"waiting for machines: {err}")
                return
        if fit.local != job.slots_needed:  # the cluster changed since it was queued
            self.view.gangs.release(job.id, "the cluster changed; placing it again")
            self.view.set_share(job.id, fit.local, {"size": size, "per_node": fit.per_node})
            self.view.schedule()
            return
        if not anywhere:  # where it runs (`job list --cluster`)
            spec = {**(job.gang or {}), "nodes": list(fit.nodes)}
            self.view.set_share(job.id, job.slots_needed, spec)
        gang = f"{self.node}:{job.id}"
        old = self.owned.get(gang)
        if old is not None:
            self._forget_owned(old)
        og = OwnerGang(
            gang,
            job.id,
            job.trial_id or 0,
            job.experiment_id or 0,
            job.run_id,
            list(owner_key(job, self.node)),
            fit.per_node,
            fit.local,
            anywhere=bool(anywhere),
            command=job.trial_id is None,
        )
        peers = [n for n in fit.nodes if n != self.node]
        first = 1 if fit.local else 0
        for i, node in enumerate(peers):
            og.shares[node] = Share(node, first + i)
        self.owned[gang] = og
        if og.anywhere:  # it fits here: it does not wait long in the peer's queue
            og.timer = asyncio.get_running_loop().call_later(
                ANYWHERE_WAIT_S, self._anywhere_late, og
            )
        self.fed.spawn(self._place(og, job))

    def _hold(self, job_id: int, why: str) -> None:
        self.view.gangs.release(job_id, why)
        self.view.hold_back(job_id, why)

    def _anywhere_late(self, og: OwnerGang) -> None:
        if self.owned.get(og.gang) is not og or og.state != "reserving":
            return
        why = f"not started on {', '.join(og.shares)} within {ANYWHERE_WAIT_S:.0f}s"
        self._abort_members(og, why)
        self._forget_owned(og)
        self._unplaced(og, why)

    def _unplaced(self, og: OwnerGang, why: str) -> None:
        """Placing the gang did not succeed: it waits for machines and is tried again (a trial
        sent whole to a peer waits here again instead)."""
        if og.anywhere:
            self.view.gangs.back_home(og.job_id, why)
            self.view.schedule()
        else:
            self._hold(og.job_id, f"waiting for machines: {why}")
            self._retry_later(og.job_id)

    def idle_peer(self, slots: int) -> str | None:
        """A live peer that lends and has `slots` free now, less what gangs being placed here
        asked of it (the most free first), or None."""
        _free, _total, kind = self.view.slots()
        asked: dict[str, int] = {}
        for og in self.owned.values():
            if og.state == "reserving":
                for node in og.shares:
                    asked[node] = asked.get(node, 0) + og.per_node
        best: tuple[int, str] | None = None
        for node, peer in self._live().items():
            free = peer.free - asked.get(node, 0)
            able = peer.kind == kind and peer.lend and free >= slots
            if able and (best is None or (free, node) > best):
                best = (free, node)
        return None if best is None else best[1]

    def peers_changed(self) -> None:
        """A peer joined, died, or has more free slots: gangs waiting for machines may fit
        now, and jobs that may run anywhere may go."""
        if self.view.release_held_back() or self.view.gangs.offloadable():
            self.view.schedule()

    async def _place(self, og: OwnerGang, job: JobRecord) -> None:
        try:
            packed = None
            if og.command:  # its argv and directory; no context travels
                spec = self.view.command_spec(job)
            else:
                from det_local.federate.blobs import pack_context

                spec = self.view.gang_spec(job)
                assert job.experiment_id is not None
                src = Path(self.view.context_of(job.experiment_id))
                out = self.view.paths.home / "fed" / "outgoing"
                loop = asyncio.get_running_loop()
                packed = await loop.run_in_executor(None, pack_context, src, out)
                spec["digest"] = packed.digest
            reserve = {
                "t": "reserve",
                "gang": og.gang,
                "run": og.run,
                "key": og.key,
                "slots": og.per_node,
                "user": job.user,
                "uid": int(job.uid),  # as the owner's kernel gave it (the spool file's owner)
                "priority": int(job.priority),
                "name": job.name,
                "hold_s": HOLD_S,
                "spec": spec,
            }
            await asyncio.gather(*(self._reserve(og, node, packed, reserve) for node in og.shares))
        except (DetLocalError, ConnectionError, asyncio.TimeoutError, OSError) as err:
            if self.owned.get(og.gang) is not og or og.state != "reserving":
                return
            why = str(err) or type(err).__name__
            permanent = isinstance(err, DetLocalError) and "[permanent]" in why
            self._abort_members(og, f"placement failed: {why}")
            self._forget_owned(og)
            if permanent and not og.anywhere:
                self.view.gang_failed(og.job_id, why.replace(" [permanent]", ""))
            else:
                self._unplaced(og, why.replace(" [permanent]", ""))
            return
        self._maybe_commit(og)

    async def _reserve(self, og: OwnerGang, node: str, packed: Any, msg: dict[str, Any]) -> None:
        # the peer checks the reserve first (who, what); a context it lacks it then asks for,
        # and accepts from this node only (federate/shipments.py)
        if await self._request(node, msg) == "context" and packed is not None:
            from det_local.federate.blobs import send_context

            async def send(m: dict[str, Any]) -> None:
                if m.get("last"):
                    await self._request(node, m, timeout=60.0)
                else:
                    peer = self.fed.peers.get(node)
                    if peer is None or peer.link is None:
                        raise ConnectionError(f"the link to {node} closed")
                    await peer.link.session.send(m)

            await send_context(send, packed)
            if await self._request(node, msg) != "queued":
                raise DetLocalError(f"{node} did not queue the share after its context came")

    def _retry_later(self, job_id: int, after: float = 2.0) -> None:
        def again() -> None:
            if self.view.release_held_back(job_id):
                self.view.schedule()

        asyncio.get_running_loop().call_later(after, again)

    def on_ready(self, node: str, msg: dict[str, Any]) -> str | None:
        og = self.owned.get(msg["gang"])
        if og is None or og.run != msg["run"] or node not in og.shares:
            return f"gang {msg['gang']} run {msg['run']} is not being placed"
        if og.state != "reserving":
            return None
        og.shares[node].ready = True
        self._maybe_commit(og)
        return None

    def _maybe_commit(self, og: OwnerGang) -> None:
        if og.state != "reserving" or not all(s.ready for s in og.shares.values()):
            return
        job = self.view.job(og.job_id)
        if job is None or job.state != RESERVED or job.run_id != og.run:
            return
        og.state = "committed"
        if og.timer is not None:
            og.timer.cancel()
            og.timer = None
        self.fed.spawn(self._commit(og))

    async def _commit(self, og: OwnerGang) -> None:
        ports = {} if og.command else self.view.allocate_ports()
        addrs: list[str] = []
        if og.local:
            addrs.append(self._my_address(next(iter(og.shares))))
        for share in sorted(og.shares.values(), key=lambda s: s.rank):
            peer = self.fed.peers[share.node]
            addrs.append(peer.host)
        counts = [og.per_node] * len(addrs)
        self._remember(og)
        latest, steps = (None, 0) if og.command else self.view.resume_point(og.trial_id)
        secret = self._dist_secret(og.gang, og.run)
        try:
            await asyncio.gather(
                *(
                    self._request(
                        s.node,
                        {
                            "t": "commit",
                            "gang": og.gang,
                            "run": og.run,
                            "node_rank": s.rank,
                            "addrs": addrs,
                            "slot_counts": counts,
                            "ports": ports,
                            "latest_checkpoint": latest,
                            "steps_completed": steps,
                        },
                    )
                    for s in og.shares.values()
                )
            )
            for s in og.shares.values():
                s.committed = True
            ifname = interface_of(addrs[0]) if og.local else None
            self.view.gangs.launch_owner(
                og.job_id, Rendezvous(addrs, 0, counts, ifname, secret), ports
            )
            og.trial_run = self.view.trial_run(og.trial_id)
        except (DetLocalError, ConnectionError, asyncio.TimeoutError, OSError) as err:
            why = str(err) or type(err).__name__
            self.view.log(f"federation: gang {og.gang} run {og.run}: commit failed: {why}")
            self._abort_members(og, f"commit failed: {why}")
            self._forget_owned(og)
            self._unplaced(og, why)

    def _my_address(self, node: str) -> str:
        """This node's address as `node` reaches it (the chief's LAN address)."""
        peer = self.fed.peers[node]
        assert peer.link is not None
        sock = peer.link.session.writer.get_extra_info("sockname")
        return str(sock[0])

    def _abort_members(self, og: OwnerGang, why: str) -> None:
        for s in og.shares.values():
            if not s.exited:
                self._send(s.node, {"t": "abort", "gang": og.gang, "run": og.run, "why": why})

    def _forget_owned(self, og: OwnerGang) -> None:
        if og.timer is not None:
            og.timer.cancel()
        if self.owned.get(og.gang) is og:
            del self.owned[og.gang]

    def _owned_by_trial(self, trial_id: int, run_id: int) -> OwnerGang | None:
        for og in self.owned.values():
            if og.trial_id == trial_id and og.run == run_id:
                return og
        return None

    def owner_exited(self, run: TrialRun, code: int) -> bool:
        og = self._owned_by_trial(run.trial_id, run.run_id)
        if og is None:
            return False
        og.local_code = code
        og.trial_run = run
        og.state = "ending"
        if code != 0:
            self._failed(og)
            self._abort_members(og, f"the trial's ranks on {self.node} exited with {code}")
        if self._all_members_done(og):
            self._finish(og)
            return True
        loop = asyncio.get_running_loop()
        og.timer = loop.call_later(END_WAIT_S, self._end_timeout, og)
        return True

    def _end_timeout(self, og: OwnerGang) -> None:
        if self.owned.get(og.gang) is not og:
            return
        self._abort_members(og, "the trial's other ranks have ended")
        og.timer = asyncio.get_running_loop().call_later(END_WAIT_S, self._finish, og)

    def _all_members_done(self, og: OwnerGang) -> bool:
        return all(s.exited for s in og.shares.values())

    def _failed(self, og: OwnerGang) -> None:
        if og.failed_at is None:
            og.failed_at = time.monotonic()

    def _finish(self, og: OwnerGang) -> None:
        """Every rank of the gang has stopped: decide. A failure waits (bounded) until every
        other machine of the gang is known alive, or one is dead: then a machine was lost
        (federate/verdict.py)."""
        if self.owned.get(og.gang) is not og:
            return
        code = og.local_code if og.local_code is not None else 0
        if code == 0:
            for s in og.shares.values():
                if s.code not in (0, None):
                    code = s.code
                    break
        if code != 0 and og.lost is None and not og.command:  # a command's code is its own
            self._failed(og)
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
        self._forget_owned(og)
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

    def on_member_exit(self, node: str, msg: dict[str, Any]) -> None:
        og = self.owned.get(msg["gang"])
        if og is None or og.run != msg["run"] or node not in og.shares:
            return
        share = og.shares[node]
        share.exited, share.code = True, msg["code"]
        if msg.get("lost") and og.lost is None:  # its machine died (and may be back already)
            og.lost = f"machine {node} was lost (its ranks died with it)"
            self.view.log(f"federation: gang {og.gang} run {og.run}: {og.lost}")
            if og.state != "ending":
                self._lose(og, share, og.lost)
                return
        if share.code != 0:
            self._failed(og)
        if og.state == "committed" and share.code != 0:
            why = f"the trial's ranks on {node} exited with {share.code}"
            og.failure = why
            if msg.get("lost"):
                og.lost = why
            self._abort_members(og, why)
            self.view.gangs.end_owner_run(og.trial_id, og.run, why, lost=og.lost is not None)
            if not og.local:
                self._check_done(og)
        elif og.state == "committed" and not og.local and self._all_members_done(og):
            og.local_code = 0
            self._check_done(og)
        elif og.state == "ending" and self._all_members_done(og):
            self._finish(og)

    def _seen(self, og: OwnerGang) -> list[Seen]:
        now = time.monotonic()
        seen = []
        for node in og.shares:
            peer = self.fed.peers.get(node)
            if peer is None:
                seen.append(Seen(node, "gone", 0.0, False))
                continue
            linked = peer.link is not None and not peer.link.closed
            seen.append(Seen(node, peer_state(peer, now), peer.last_heard, linked))
        return seen

    def _check_done(self, og: OwnerGang) -> None:
        """A gang in which this node runs no ranks ends when its members have."""
        if self._all_members_done(og):
            og.state = "ending"
            self._finish(og)

    def on_wounded(self, node: str, msg: dict[str, Any]) -> None:
        """A member released its reservation (an older gang needs the slots, or the hold
        expired): release the whole gang; it is placed again."""
        og = self.owned.get(msg["gang"])
        if og is None or og.run != msg["run"] or og.state != "reserving":
            return
        self.view.log(f"federation: gang {og.gang} run {og.run} released: {node}: {msg['why']}")
        self._abort_members(og, f"released: {msg['why']}")
        self._forget_owned(og)
        if og.anywhere:
            self._unplaced(og, f"{node} released it: {msg['why']}")
            return
        self.view.gangs.release(og.job_id, f"{node} released its share: {msg['why']}")
        self.view.behind_older_gangs(og.job_id)
        self.view.schedule()

    def on_yield(self, node: str, msg: dict[str, Any]) -> None:
        """A member's machine needs its slots for more important work: preempt the gang."""
        og = self.owned.get(msg["gang"])
        if og is None or og.run != msg["run"]:
            return
        self.view.preempt_gang(og.job_id, f"{node}: {msg['why']}")

    def on_relay(self, node: str, msg: dict[str, Any]) -> dict[str, Any] | None:
        og = self.owned.get(msg["gang"])
        reply: dict[str, Any] | None = {"t": "reply", "id": msg["id"]} if "id" in msg else None
        try:
            if og is None or og.run != msg["run"] or node not in og.shares:
                raise DetLocalError(f"gang {msg['gang']} run {msg['run']} is not running here")
            value = self.view.gangs.apply_relayed(og.trial_id, og.run, msg["frame"])
            if reply is not None:
                reply["value"] = value
        except DetLocalError as err:
            if reply is not None:
                reply["error"] = str(err)[:1000]
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            if reply is not None:
                reply["error"] = f"malformed frame ({type(err).__name__}: {err})"[:1000]
        return reply

    def on_log(self, node: str, msg: dict[str, Any]) -> None:
        og = self.owned.get(msg["gang"])
        if og is None or og.run != msg["run"] or node not in og.shares:
            return
        data: bytes = msg["data"]
        cap = self.max_log_bytes()
        if og.log_bytes >= cap:
            return  # cut already (the line below says where)
        if og.log_bytes + len(data) > cap:
            data = data[: cap - og.log_bytes]
            data += (
                f"\n[det-local: the log relayed from {node} was cut here, after "
                f"{cap // (1024 * 1024)} MiB (federation.max_log_mb on {self.node}); the rest "
                "of its output is not kept]\n"
            ).encode()
            self.view.log(
                f"federation: job {og.job_id}: the log relayed from {node} was cut at "
                f"{cap // (1024 * 1024)} MiB (federation.max_log_mb)"
            )
        og.log_bytes += len(msg["data"])
        if og.command:
            self.view.append_command_log(og.job_id, data)
        else:
            self.view.append_trial_log(og.experiment_id, og.trial_id, data)

    def max_log_bytes(self) -> int:
        s = self.fed.settings
        return (s.max_log_mb if s is not None else 64) * 1024 * 1024

    def down(self, run: TrialRun, frame: dict[str, Any]) -> None:
        og = self._owned_by_trial(run.trial_id, run.run_id)
        if og is None:
            return
        for s in og.shares.values():
            self._send(s.node, {"t": "down", "gang": og.gang, "run": og.run, "frame": frame})

    def abort_job(self, job: JobRecord, why: str) -> None:
        og = self.owned.get(f"{self.node}:{job.id}")
        if og is not None:
            self._abort_members(og, why)

    def stop(self, run: TrialRun) -> None:
        og = self._owned_by_trial(run.trial_id, run.run_id)
        if og is not None:
            self._abort_members(og, "the trial is being stopped")

    def yield_share(self, job: JobRecord, why: str) -> None:
        gang = job.gang or {}
        if job.kind == JobKind.MEMBER:
            mg = self.members.get(str(gang.get("gang")))
            if job.state == RESERVED:
                self.view.gangs.release(job.id, why)
                if mg is not None:
                    self._send(
                        mg.owner, {"t": "wounded", "gang": mg.gang, "run": mg.run, "why": why}
                    )
            elif mg is not None:
                self._send(mg.owner, {"t": "yield", "gang": mg.gang, "run": mg.run, "why": why})
            return
        og = self.owned.get(f"{self.node}:{job.id}")
        if og is not None and og.state == "reserving":
            self._abort_members(og, f"released: {why}")
            self._forget_owned(og)
        self.view.gangs.release(job.id, why)

    # ================================================================== member side
    def on_has(self, msg: dict[str, Any]) -> bool:
        return self.contexts().has(msg["digest"]) is not None

    def on_blob(self, node: str, msg: dict[str, Any]) -> None:
        self.shipments().receive(
            node, msg["digest"], msg["off"], msg["total"], msg["data"], msg["last"]
        )

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
        self.fed.lending.check(node, msg["user"], msg.get("uid"))  # LendRefused: one line
        if command is not None:  # a command sent whole (`cmd run --anywhere`)
            self.view.check_gang_command(command, msg["user"])
        else:
            self.view.check_gang_config(spec["config"], msg["user"])
            if self.shipments().has(spec["digest"]) is None:
                self.shipments().expect(node, spec["digest"])
                return "context"  # ship it (accepted from this peer only), then reserve again
        old = self.members.get(gang)
        if old is not None:
            if run < old.run:
                raise DetLocalError(f"gang {gang}: run {run} is older than run {old.run}")
            if run == old.run:
                return "queued"  # a duplicate reserve
            self._drop_member(old, f"run {run} replaces run {old.run}")
        job_id = self.view.gangs.enqueue_member(
            name=f"{msg['user']}@{node}: {msg['name']}"[:200],
            user=msg["user"],
            priority=int(msg["priority"]) + self.fed.lend_priority_offset,
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
        self.members[gang] = MemberGang(gang, node, job_id, run)
        self.wound_younger()
        self.view.schedule()
        return "queued"

    def member_started(self, job: JobRecord) -> None:
        gang = job.gang or {}
        mg = self.members.get(str(gang.get("gang")))
        if mg is None or mg.job_id != job.id:
            self.view.gangs.drop_member(job.id, "its owner no longer places it")
            return
        hold = float(gang.get("hold_s", HOLD_S))
        loop = asyncio.get_running_loop()
        mg.hold_timer = loop.call_later(hold, self._hold_expired, mg)
        self.fed.spawn(self._ready(mg))

    async def _ready(self, mg: MemberGang) -> None:
        try:
            await self._request(mg.owner, {"t": "ready", "gang": mg.gang, "run": mg.run})
        except (DetLocalError, ConnectionError, asyncio.TimeoutError, OSError) as err:
            if self.members.get(mg.gang) is mg:
                self._drop_member(mg, f"its owner refused ready: {err}")

    def _hold_expired(self, mg: MemberGang) -> None:
        job = self.view.job(mg.job_id)
        if self.members.get(mg.gang) is not mg or job is None or job.state != RESERVED:
            return
        why = "no commit within the hold time; back in the queue"
        self.view.gangs.release(mg.job_id, why)
        self._send(mg.owner, {"t": "wounded", "gang": mg.gang, "run": mg.run, "why": why})

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
            self._dist_secret(mg.gang, mg.run),
        )
        if mg.hold_timer is not None:  # a refused commit leaves the hold running
            mg.hold_timer.cancel()
        try:
            where = None if context is None else Path(context)
            pid = self.view.gangs.launch_member(mg.job_id, msg, where, rdv)
        except DetLocalError:  # its job ended: the gang is no longer placed here
            self.members.pop(mg.gang, None)
            raise
        mg.log_task = asyncio.get_running_loop().create_task(self._ship_logs(mg))
        return {"pid": pid}

    def _member_for(self, node: str, msg: dict[str, Any]) -> MemberGang:
        mg = self.members.get(msg["gang"])
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
        self._drop_member(mg, f"aborted by {node}: {msg['why']}")

    def on_down(self, node: str, msg: dict[str, Any]) -> None:
        mg = self.members.get(msg["gang"])
        if mg is None or mg.owner != node or mg.run != msg["run"]:
            return
        self.view.gangs.relay_down(mg.job_id, msg["frame"])

    def _drop_member(self, mg: MemberGang, why: str) -> None:
        if mg.hold_timer is not None:
            mg.hold_timer.cancel()
        self._fail_backlog(mg, why)
        job = self.view.job(mg.job_id)
        if job is not None and job.state in (QUEUED, RESERVED):
            self.members.pop(mg.gang, None)
        self.view.gangs.drop_member(mg.job_id, why)

    def member_exited(self, job: JobRecord, code: int | None) -> None:
        gang = job.gang or {}
        mg = self.members.get(str(gang.get("gang")))
        if mg is None or mg.job_id != job.id:
            return
        self.members.pop(mg.gang, None)
        self._fail_backlog(mg, "its ranks exited")
        self.fed.spawn(self._last_logs_then_exit(mg, code))

    async def _last_logs_then_exit(self, mg: MemberGang, code: int | None) -> None:
        if mg.log_task is not None:
            mg.log_task.cancel()
        with contextlib.suppress(Exception):
            self._send_log(mg, final=True)
        self._send(
            mg.owner,
            {
                "t": "member_exit",
                "gang": mg.gang,
                "run": mg.run,
                "code": -9 if code is None else code,
            },
        )

    def relay(self, run: TrialRun, msg: dict[str, Any]) -> asyncio.Future[Any] | None:
        job = self.view.job(run.job_id)
        mg = self.members.get(str((job.gang or {}).get("gang"))) if job is not None else None
        if mg is None:
            raise DetLocalError("this rank's gang is no longer placed here")
        out: dict[str, Any] = {"t": "relay", "gang": mg.gang, "run": mg.run, "frame": msg}
        if mg.backlog or not self._linked(mg.owner):  # held until the owner is back (in order)
            if len(mg.backlog) >= BACKLOG_MAX:
                raise DetLocalError(f"the trial's owner {mg.owner} is unreachable")
            held = asyncio.get_running_loop().create_future() if "id" in msg else None
            mg.backlog.append((out, held))
            return held
        if "id" not in msg:
            if not self._send(mg.owner, out):
                raise DetLocalError(f"the trial's owner {mg.owner} is unreachable")
            return None
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.fed.spawn(self._ask_owner(mg, out, fut))
        return fut

    async def _ask_owner(
        self, mg: MemberGang, out: dict[str, Any], fut: asyncio.Future[Any]
    ) -> None:
        """A rank's request, relayed: the owner's answer (or its error line) in `fut`."""
        try:
            value = await self._request(mg.owner, out)
        except Exception as err:  # the rank gets the error line
            if not fut.done():
                fut.set_exception(DetLocalError(str(err) or type(err).__name__))
            return
        if not fut.done():
            fut.set_result(value)

    async def _ship_logs(self, mg: MemberGang) -> None:
        while True:
            await asyncio.sleep(LOG_EVERY_S)
            self._send_log(mg)

    def _send_log(self, mg: MemberGang, final: bool = False) -> None:
        path = self.view.gangs.member_log(mg.job_id)
        try:
            with open(path, "rb") as f:
                f.seek(mg.log_offset)
                data = f.read(LOG_CHUNK)
        except OSError:
            return
        if not final:
            cut = data.rfind(b"\n")
            data = data[: cut + 1] if cut >= 0 else b""
        if not data:
            return
        if self._send(mg.owner, {"t": "log", "gang": mg.gang, "run": mg.run, "data": data}):
            mg.log_offset += len(data)
            with contextlib.suppress(OSError):  # where a restarted daemon goes on from
                path.with_name("log.offset").write_text(str(mg.log_offset))

    # ================================================================== order, faults
    def wound_younger(self) -> None:
        """A RESERVED share of a younger gang in front of an older gang's waiting share is
        released at once (wound-wait): waits only go from younger to older."""
        jobs = [j for j in self.view.active_jobs() if j.gang is not None]
        waiting = [j for j in jobs if j.state == QUEUED and not self.view.held_back(j.id)]
        if not waiting:
            return
        oldest = min(share_key(j, self.node) for j in waiting)
        wounded = False
        for j in jobs:
            if j.state == RESERVED and share_key(j, self.node) > oldest:
                self.yield_share(j, "an older gang needs these slots (wound-wait)")
                self.view.behind_older_gangs(j.id)
                wounded = True
        if wounded:
            self.view.schedule()

    def tick(self) -> None:
        """Every heartbeat tick: gangs whose machines died."""
        now = time.monotonic()
        for og in list(self.owned.values()):
            for s in og.shares.values():
                if s.exited:
                    continue
                if og.state == "reserving":  # nothing runs yet: a dead peer is gone at once
                    if not self._gone(s.node, og.since, now, window=0.0):
                        continue
                    why = f"machine {s.node} was lost"
                    s.exited, s.code = True, None
                    self._abort_members(og, why)
                    self._forget_owned(og)
                    self._unplaced(og, why)
                    break
                # running ranks: a daemon restart inside REATTACH_S keeps them
                if self._gone(s.node, og.since, now):
                    self._lose(og, s, f"machine {s.node} was lost")
            if og.state == "settling":
                self._finish(og)
        for mg in list(self.members.values()):
            job = self.view.job(mg.job_id)
            running = job is not None and job.state == SCHEDULED
            if self._gone(mg.owner, mg.since, now, window=REATTACH_S if running else 0.0):
                self._drop_member(mg, f"the trial's owner {mg.owner} was lost")
        if any(j.state == QUEUED and j.gang is not None for j in self.view.active_jobs()):
            self.wound_younger()

    # ================================================================== daemon restarts
    def _linked(self, node: str) -> bool:
        peer = self.fed.peers.get(node)
        return peer is not None and peer.link is not None and not peer.link.closed

    def _gone(self, node: str, since: float, now: float, window: float = REATTACH_S) -> bool:
        """Whether `node` counts as lost for a gang watched since `since`: not heard for
        `window` (a daemon restarting inside it keeps the gang's running ranks)."""
        peer = self.fed.peers.get(node)
        if peer is not None and self._linked(node) and peer_state(peer, now) == "alive":
            return False
        if window <= 0.0:
            return peer is None or peer_state(peer, now) == "dead"
        heard = max(since, peer.last_heard if peer is not None else 0.0)
        return now - heard >= window

    def _lose(self, og: OwnerGang, s: Share, why: str) -> None:
        """A machine holding a running share of the gang is lost: stop every rank, requeue."""
        s.exited, s.code = True, None
        og.lost = why
        self._abort_members(og, why)
        self.view.gangs.end_owner_run(og.trial_id, og.run, why, lost=True)
        if og.state == "ending" and self._all_members_done(og):
            self._finish(og)
        elif not og.local:
            self._check_done(og)

    def _remember(self, og: OwnerGang) -> None:
        """What a restarted daemon needs to take the committed gang back (`recover`)."""
        job = self.view.job(og.job_id)
        if job is None:
            return
        spec = {
            **(job.gang or {}),
            "run": og.run,
            "key": og.key,
            "per_node": og.per_node,
            "local": og.local,
            "shares": {s.node: s.rank for s in og.shares.values()},
        }
        self.view.set_share(og.job_id, job.slots_needed, spec)

    def recover(self) -> None:
        """After this daemon restarted: the gangs whose shares were found running (adopted by
        the engine, sched/gangs.py) are taken back. Each other node confirms its share once
        its link is up (`share`); one not heard within REATTACH_S of the restart is lost.
        A share whose ranks died with this daemon is reported lost to its owner as soon as
        their link is up (a machine that died and came back is a lost machine)."""
        for spec in self.view.gangs.died_with_daemon.values():
            owner, gang, run = str(spec.get("owner")), str(spec.get("gang")), spec.get("run")
            if not isinstance(run, int) or not gang:
                continue
            why = f"machine {self.node} restarted and its ranks of gang {gang} were gone"
            self.died[(gang, run)] = why
            report = {"t": "member_exit", "gang": gang, "run": run, "code": -9, "lost": True}
            self.lost_reports.setdefault(owner, []).append(report)
            self.view.log(f"federation: {why}: reported lost to {owner}")
        self.view.gangs.died_with_daemon.clear()
        for owner in list(self.lost_reports):
            if self._linked(owner):
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
                self.members[mg.gang] = mg
                mg.log_task = asyncio.get_running_loop().create_task(self._ship_logs(mg))
                self.view.log(
                    f"federation: share of gang {mg.gang} run {mg.run} taken back after a restart"
                )
                continue
            if "shares" not in spec:
                continue  # placed by a daemon that did not record it: it ends (unclaimed)
            self.view.gangs.adopted.add(job.id)  # not taken back after all: it ends
            og = OwnerGang(
                f"{self.node}:{job.id}",
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
            self.owned[og.gang] = og
            self.view.gangs.adopted.discard(job.id)
            self.view.log(f"federation: gang {og.gang} run {og.run} taken back after a restart")

    def peer_attached(self, node: str) -> None:
        """A link to `node` is up (again): the committed shares it holds of gangs owned here
        are confirmed (it, or this daemon, may have restarted); frames held for it go."""
        for report in self.lost_reports.pop(node, []):
            if not self._send(node, report):
                self.lost_reports.setdefault(node, []).append(report)
        for og in list(self.owned.values()):
            s = og.shares.get(node)
            if s is not None and og.state != "reserving" and not s.exited:
                s.confirmed = False  # until it says it still runs (a restart may have lost it)
                self.fed.spawn(self._confirm(og, s))
        for mg in list(self.members.values()):
            if mg.owner == node and mg.backlog:
                self._flush(mg)

    async def _confirm(self, og: OwnerGang, s: Share) -> None:
        try:
            value = await self._request(s.node, {"t": "share", "gang": og.gang, "run": og.run})
        except DetLocalError as err:
            value = {"state": "unknown", "why": str(err)}
        except (ConnectionError, asyncio.TimeoutError, OSError):
            return  # the link went again: tick() decides
        if self.owned.get(og.gang) is not og or s.exited:
            return
        state = value.get("state") if isinstance(value, dict) else None
        if state == "running":
            s.confirmed = True
        elif state == "ended":
            code = value.get("code")
            code = int(code) if isinstance(code, int) and -255 <= code <= 255 else 1
            self.on_member_exit(s.node, {"gang": og.gang, "run": og.run, "code": code})
        else:
            why = str(value.get("why", "")) if isinstance(value, dict) else ""
            self._lose(og, s, f"machine {s.node} no longer runs its share ({why[:200]})")

    def on_share(self, node: str, msg: dict[str, Any]) -> dict[str, Any]:
        """The owner asks whether this node still runs its share of a gang."""
        mg = self.members.get(msg["gang"])
        if mg is not None and mg.owner == node and mg.run == msg["run"]:
            return {"state": "running"}
        died = self.died.get((msg["gang"], msg["run"]))
        if died is not None:
            return {"state": "lost", "why": died}
        for job in self.view.member_jobs(msg["gang"], msg["run"]):
            if (job.gang or {}).get("owner") == node and job.state not in (QUEUED, RESERVED):
                if job.state == SCHEDULED:
                    return {"state": "running"}
                return {"state": "ended", "code": -9 if job.exit_code is None else job.exit_code}
        raise DetLocalError(f"unknown gang {str(msg['gang'])[:80]} run {msg['run']}")

    def _flush(self, mg: MemberGang) -> None:
        held, mg.backlog = mg.backlog, []
        for out, fut in held:
            if fut is None:
                self._send(mg.owner, out)
            else:
                self.fed.spawn(self._ask_owner(mg, out, fut))

    def _fail_backlog(self, mg: MemberGang, why: str) -> None:
        held, mg.backlog = mg.backlog, []
        for _out, fut in held:
            if fut is not None and not fut.done():
                fut.set_exception(DetLocalError(f"not sent to the trial's owner: {why}"))
