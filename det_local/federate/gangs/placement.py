"""Placing a gang this node owns: where it fits, `reserve` on the chosen peers (the context
shipped first), `ready` from each, then `commit`; and the one global order that keeps it
deadlock-free (wound-wait: a younger RESERVED share yields to an older waiting one)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from det_local.errors import DetLocalError
from det_local.federate.gangs.state import (
    ANYWHERE_WAIT_S,
    HOLD_S,
    GangBook,
    OwnerGang,
    PeerRefused,
    Share,
)
from det_local.sched.gangseam import GangFit, owner_key, share_key
from det_local.sched.run.rendezvous import Rendezvous, interface_of
from det_local.store.states import JobKind
from det_local.store.tables.jobs import QUEUED, RESERVED, JobRecord


class Placement:
    """The owner's side of placing a gang, and wound-wait for every share on this node."""

    def __init__(self, book: GangBook) -> None:
        self.book = book
        self.view = book.view

    def fit(self, slots: int) -> GangFit:
        """Fewest nodes, equal slots per node, this node first when it can take part (one
        peer that holds the whole gang runs it alone: this node then only coordinates)."""
        me = self.book.node
        free, total, kind = self.view.slots()
        nodes: list[tuple[int, int, str]] = [(total, 1, me)]
        for node, peer in self.book.live().items():
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
            chosen = [n for n in able if n[2] == me][:1]
            chosen += [n for n in able if n[2] != me][: count - len(chosen)]
            local = per if chosen[0][2] == me else 0
            return GangFit(slots, per, tuple(n[2] for n in chosen), local)
        live = len(nodes)
        raise DetLocalError(
            f"resources.slots_per_trial: {slots} slots cannot be fitted on the cluster's live "
            f"{kind.upper()} machines ({live} node{'s' if live > 1 else ''}, at most {best} "
            "slots each; a trial across machines takes the same number of slots on each): "
            "use a multiple that fits, or wait for more machines (`det-local cluster status`)"
        )

    def idle_peer(self, slots: int, job_id: int | None = None) -> str | None:
        """A live peer that lends and has `slots` free now, less what gangs being placed here
        asked of it (the most free first), and has not refused job `job_id` for good; or None."""
        _free, _total, kind = self.view.slots()
        refused = self.book.refused.get(job_id, set()) if job_id is not None else set()
        asked: dict[str, int] = {}
        for og in self.book.owned.values():
            if og.state == "reserving":
                for node in og.shares:
                    asked[node] = asked.get(node, 0) + og.per_node
        best: tuple[int, str] | None = None
        for node, peer in self.book.live().items():
            free = peer.free - asked.get(node, 0)
            able = peer.kind == kind and peer.lend and free >= slots and node not in refused
            if able and (best is None or (free, node) > best):
                best = (free, node)
        return None if best is None else best[1]

    def peers_changed(self) -> None:
        """A peer joined, died, or has more free slots: gangs waiting for machines may fit
        now, and jobs that may run anywhere may go."""
        if self.view.release_held_back() or self.view.gangs.offloadable():
            self.view.schedule()

    # ---------------------------------------------------------------- reserve
    def share_started(self, job: JobRecord) -> None:
        size = int((job.gang or {}).get("size", 0))
        anywhere = str((job.gang or {}).get("anywhere") or "")
        if anywhere:  # a trial sent whole to an idle peer (GangShares.offload_waiting)
            peer = self.book.live().get(anywhere)
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
        me = self.book.node
        old = self.book.owned_job(job.id)
        if old is not None:
            self.book.forget_owned(old)
        og = OwnerGang(
            f"{me}:{job.id}",
            job.id,
            job.trial_id or 0,
            job.experiment_id or 0,
            job.run_id,
            list(owner_key(job, me)),
            fit.per_node,
            fit.local,
            anywhere=bool(anywhere),
            command=job.trial_id is None,
        )
        peers = [n for n in fit.nodes if n != me]
        first = 1 if fit.local else 0
        for i, node in enumerate(peers):
            og.shares[node] = Share(node, first + i)
        self.book.owned[og.gang] = og
        if og.anywhere:  # it fits here: it does not wait long in the peer's queue
            og.timer = asyncio.get_running_loop().call_later(
                ANYWHERE_WAIT_S, self._anywhere_late, og
            )
        self.book.fed.spawn(self._place(og, job))

    def _hold(self, job_id: int, why: str) -> None:
        self.view.gangs.release(job_id, why)
        self.view.hold_back(job_id, why)

    def _anywhere_late(self, og: OwnerGang) -> None:
        if self.book.owned.get(og.gang) is not og or og.state != "reserving":
            return
        why = f"not started on {', '.join(og.shares)} within {ANYWHERE_WAIT_S:.0f}s"
        self.book.abort_members(og, why)
        self.book.forget_owned(og)
        self.unplaced(og, why)

    def unplaced(self, og: OwnerGang, why: str) -> None:
        """Placing the gang did not succeed: it waits for machines and is tried again (a trial
        sent whole to a peer waits here again instead)."""
        if og.anywhere:
            self.view.gangs.back_home(og.job_id, why)
            self.view.schedule()
        else:
            self._hold(og.job_id, f"waiting for machines: {why}")
            self._retry_later(og.job_id)

    def _retry_later(self, job_id: int, after: float = 2.0) -> None:
        def again() -> None:
            if self.view.release_held_back(job_id):
                self.view.schedule()

        asyncio.get_running_loop().call_later(after, again)

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
            if self.book.owned.get(og.gang) is not og or og.state != "reserving":
                return
            why = str(err) or type(err).__name__
            permanent = isinstance(err, DetLocalError) and "[permanent]" in why
            self.book.abort_members(og, f"placement failed: {why}")
            self.book.forget_owned(og)
            if permanent and not og.anywhere:
                self.view.gang_failed(og.job_id, why.replace(" [permanent]", ""))
            else:
                if permanent:  # sent whole to a peer whose policy refused it: not again
                    self.book.refused_for_good(og)
                self.unplaced(og, why.replace(" [permanent]", ""))
            return
        self._maybe_commit(og)

    async def _reserve(self, og: OwnerGang, node: str, packed: Any, msg: dict[str, Any]) -> None:
        # the peer checks the reserve first (who, what); a context it lacks it then asks for,
        # and accepts from this node only (federate/shipments.py)
        try:
            answer = await self.book.request(node, msg)
        except PeerRefused as err:  # the peer's refusal: nothing of the gang is held there
            og.shares[node].refused = True
            og.shares[node].by_policy = err.policy
            raise
        if answer == "context" and packed is not None:
            from det_local.federate.blobs import send_context

            async def send(m: dict[str, Any]) -> None:
                if m.get("last"):
                    await self.book.request(node, m, timeout=60.0)
                else:
                    peer = self.book.fed.peers.get(node)
                    if peer is None or peer.link is None:
                        raise ConnectionError(f"the link to {node} closed")
                    await peer.link.session.send(m)

            await send_context(send, packed)
            if await self.book.request(node, msg) != "queued":
                raise DetLocalError(f"{node} did not queue the share after its context came")

    def on_ready(self, node: str, msg: dict[str, Any]) -> None:
        og = self.book.owned.get(msg["gang"])
        if og is None or og.run != msg["run"] or node not in og.shares:
            raise DetLocalError(f"gang {msg['gang']} run {msg['run']} is not being placed")
        if og.state != "reserving":
            return
        og.shares[node].ready = True
        self._maybe_commit(og)

    def on_wounded(self, node: str, msg: dict[str, Any]) -> None:
        """A member released its reservation (an older gang needs the slots, or the hold
        expired): release the whole gang; it is placed again."""
        og = self.book.owned.get(msg["gang"])
        if og is None or og.run != msg["run"] or og.state != "reserving":
            return
        self.view.log(f"federation: gang {og.gang} run {og.run} released: {node}: {msg['why']}")
        self.book.abort_members(og, f"released: {msg['why']}")
        self.book.forget_owned(og)
        if og.anywhere:
            self.unplaced(og, f"{node} released it: {msg['why']}")
            return
        self.view.gangs.release(og.job_id, f"{node} released its share: {msg['why']}")
        self.view.behind_older_gangs(og.job_id)
        self.view.schedule()

    # ---------------------------------------------------------------- commit
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
        self.book.fed.spawn(self._commit(og))

    async def _commit(self, og: OwnerGang) -> None:
        ports = {} if og.command else self.view.allocate_ports()
        addrs: list[str] = []
        if og.local:
            addrs.append(self._my_address(next(iter(og.shares))))
        for share in sorted(og.shares.values(), key=lambda s: s.rank):
            peer = self.book.fed.peers[share.node]
            addrs.append(peer.host)
        counts = [og.per_node] * len(addrs)
        self._remember(og)
        latest, steps = (None, 0) if og.command else self.view.resume_point(og.trial_id)
        secret = self.book.dist_secret(og.gang, og.run)
        try:
            await asyncio.gather(
                *(
                    self.book.request(
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
            self.book.abort_members(og, f"commit failed: {why}")
            self.book.forget_owned(og)
            self.unplaced(og, why)

    def _my_address(self, node: str) -> str:
        """This node's address as `node` reaches it (the chief's LAN address)."""
        peer = self.book.fed.peers[node]
        assert peer.link is not None
        sock = peer.link.session.writer.get_extra_info("sockname")
        return str(sock[0])

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

    # ---------------------------------------------------------------- one global order
    def yield_share(self, job: JobRecord, why: str) -> None:
        gang = job.gang or {}
        if job.kind == JobKind.MEMBER:
            mg = self.book.members.get(str(gang.get("gang")))
            if job.state == RESERVED:
                self.view.gangs.release(job.id, why)
                if mg is not None:
                    self.book.send(
                        mg.owner, {"t": "wounded", "gang": mg.gang, "run": mg.run, "why": why}
                    )
            elif mg is not None:
                msg = {"t": "yield", "gang": mg.gang, "run": mg.run, "why": why}
                self.book.send(mg.owner, msg)
            return
        og = self.book.owned_job(job.id)
        if og is not None and og.state == "reserving":
            self.book.abort_members(og, f"released: {why}")
            self.book.forget_owned(og)
        self.view.gangs.release(job.id, why)

    def wound_younger(self) -> None:
        """A RESERVED share of a younger gang in front of an older gang's waiting share is
        released at once (wound-wait): waits only go from younger to older."""
        me = self.book.node
        jobs = [j for j in self.view.active_jobs() if j.gang is not None]
        waiting = [j for j in jobs if j.state == QUEUED and not self.view.held_back(j.id)]
        if not waiting:
            return
        oldest = min(share_key(j, me) for j in waiting)
        wounded = False
        for j in jobs:
            if j.state == RESERVED and share_key(j, me) > oldest:
                self.yield_share(j, "an older gang needs these slots (wound-wait)")
                self.view.behind_older_gangs(j.id)
                wounded = True
        if wounded:
            self.view.schedule()
