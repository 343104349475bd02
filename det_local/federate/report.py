"""The cluster as this node sees it, for the cluster socket (`cluster peers`, `cluster
status`, `slots --cluster`, `job list --cluster`): this node and each peer's row, the
federation's status, and every node's jobs or slots (asked of each live peer now)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from det_local import __version__
from det_local.errors import DetLocalError
from det_local.federate import schema
from det_local.federate.peers import Peer, peer_state
from det_local.federate.transport import Me
from det_local.sched.extensions import EngineView

QUERY_TIMEOUT_S = 3.0


class ReportHost(Protocol):
    """What the report reads of the federation service (`service.Federation`)."""

    view: EngineView
    on: bool
    why_off: str
    me: Me | None
    peers: dict[str, Peer]
    address: str
    discovery: Any
    collision: str

    def next_query_id(self) -> int: ...


class Report:
    def __init__(self, fed: ReportHost) -> None:
        self.fed = fed

    def peer_rows(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        rows: list[dict[str, Any]] = []
        if self.fed.on and self.fed.me is not None:
            free, total, _kind = self.fed.view.slots()
            rows.append(
                {
                    "id": self.fed.me.node,
                    "address": self.fed.address,
                    "state": "self",
                    "slots_total": total,
                    "slots_free": free,
                    "version": __version__,
                    "last_seen_s": 0.0,
                    "queue": self.fed.view.queue_digest(),
                }
            )
        for peer in sorted(self.fed.peers.values(), key=lambda p: p.node):
            rows.append(
                {
                    "id": peer.node,
                    "address": f"{peer.host}:{peer.port}",
                    "state": peer_state(peer, now),
                    "slots_total": peer.total,
                    "slots_free": peer.free,
                    "version": peer.version,
                    "last_seen_s": round(now - peer.last_heard, 2),
                    "queue": peer.digest,
                }
            )
        return rows

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"federation": "on" if self.fed.on else "off"}
        if self.fed.on and self.fed.me is not None:
            out.update(
                node=self.fed.me.node,
                port=self.fed.me.port,
                cluster=self.fed.me.cluster,
                mdns=self.fed.discovery is not None,
                live_peers=sum(
                    peer_state(p, time.monotonic()) == "alive" for p in self.fed.peers.values()
                ),
            )
            if self.fed.collision:
                out["collision"] = self.fed.collision
        else:
            out["why"] = self.fed.why_off
        return out

    async def _ask(self, peer: Peer, what: str, include_done: bool) -> Any:
        link = peer.link
        if link is None or link.closed:
            raise ConnectionError(f"no link to {peer.node}")
        qid = self.fed.next_query_id()
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        link.pending[qid] = fut
        await link.session.send({"t": "query", "id": qid, "what": what, "all": include_done})
        try:
            answer = await asyncio.wait_for(fut, QUERY_TIMEOUT_S)
        finally:
            link.pending.pop(qid, None)
        if answer.get("error"):
            raise DetLocalError(str(answer["error"]))
        value = answer.get("value")
        problem = (schema.check_jobs if what == "jobs" else schema.check_slots)(value)
        if problem:
            raise DetLocalError(f"{peer.node} answered with an invalid list: {problem}")
        return value

    async def gather(self, what: str, include_done: bool) -> list[dict[str, Any]]:
        """Every node's jobs or slots: this node's, then each live peer's (asked now)."""
        local = (
            self.fed.view.jobs(include_done=include_done)
            if what == "jobs"
            else self.fed.view.slot_rows()
        )
        me = self.fed.me.node if self.fed.me is not None else "local"
        out: list[dict[str, Any]] = [{"node": me, "state": "self", "value": local}]
        peers = [p for p in sorted(self.fed.peers.values(), key=lambda p: p.node)]

        async def one(peer: Peer) -> dict[str, Any]:
            row: dict[str, Any] = {"node": peer.node, "state": peer_state(peer, time.monotonic())}
            try:
                row["value"] = await self._ask(peer, what, include_done)
            except (Exception, asyncio.TimeoutError) as err:
                row["error"] = str(err) or type(err).__name__
            return row

        out += await asyncio.gather(*(one(p) for p in peers))
        return out
