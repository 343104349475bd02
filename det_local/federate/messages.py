"""What a link's messages do: each kind a peer sends, checked by its schema
(`schema.check`), goes through a table to its handler (`PEER_HANDLERS` for the link's own
kinds, `GANG_HANDLERS` for placement, launch, relay and faults in `federate/gangs/`); and the
queries peers ask of this node (`answer`). A request is answered with reply{id, value} or
reply{id, error: one line}."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from det_local.errors import DetLocalError
from det_local.federate import schema
from det_local.federate.gangs.placer import Gangs
from det_local.federate.lending import LendRefused
from det_local.federate.peers import Link, Peer
from det_local.federate.ratelog import RateLog
from det_local.federate.transport import Me
from det_local.federate.untar import BlobError
from det_local.sched.extensions import EngineView

GANG_MESSAGES = frozenset([*schema.GANG_SCHEMAS, "blob"])


class MessagesHost(Protocol):
    """What the handlers need of the federation service (`service.Federation`)."""

    view: EngineView
    gangs: Gangs
    refusals: RateLog
    me: Me | None
    peers: dict[str, Peer]

    def spawn(self, coro: Awaitable[Any]) -> None: ...
    def close_link(self, link: Link, quiet: bool = False) -> None: ...
    def gossiped(self, peer: Peer, node: str, host: str, port: int) -> None: ...
    def next_query_id(self) -> int: ...


class Messages:
    def __init__(self, fed: MessagesHost) -> None:
        self.fed = fed

    async def handle(self, peer: Peer, link: Link, msg: dict[str, Any]) -> None:
        problem = schema.check(msg)
        if problem is not None:
            self.fed.view.log(f"federation: refused a message from {peer.node}: {problem}")
            answer: dict[str, Any] = {"t": "error", "error": problem}
            if isinstance(msg.get("id"), int) and not isinstance(msg.get("id"), bool):
                answer["id"] = msg["id"]
            await link.session.send(answer)
            return
        kind = msg["t"]
        if kind in GANG_MESSAGES:
            self.gang(peer, link, msg)
        else:  # schema.check let only the kinds of SCHEMAS through: each has its handler
            PEER_HANDLERS[kind](self, peer, link, msg)

    # ---------------------------------------------------------------- the link's own messages
    # (PEER_HANDLERS, below the class: one handler per kind, its fields checked by
    # schema.SCHEMAS before it runs)
    def on_hb(self, peer: Peer, link: Link, msg: dict[str, Any]) -> None:
        before = (peer.free, peer.total, peer.kind, peer.lend)
        peer.free, peer.total, peer.kind = msg["free"], msg["total"], msg["kind"]
        peer.digest = msg["digest"]
        peer.lend = bool(msg.get("lend", True))
        if before[3] != peer.lend:
            self.fed.gangs.lending_changed(link.node)  # what it refused may be offered again
        if before[1:] != (peer.total, peer.kind, peer.lend) or peer.free > before[0]:
            self.fed.gangs.peers_changed()  # what waits for machines (or free slots) may go

    def on_peers(self, peer: Peer, link: Link, msg: dict[str, Any]) -> None:
        for entry in msg["list"]:
            self.fed.gossiped(peer, entry["node"], entry["host"], entry["port"])

    def on_leave(self, peer: Peer, link: Link, msg: dict[str, Any]) -> None:
        peer.left = True
        self.fed.view.log(f"federation: peer {peer.node} left")
        self.fed.close_link(link, quiet=True)

    def on_query(self, peer: Peer, link: Link, msg: dict[str, Any]) -> None:
        self.fed.spawn(self.answer(link, msg))

    def on_reply(self, peer: Peer, link: Link, msg: dict[str, Any]) -> None:
        fut = link.pending.pop(msg.get("id", -1), None)
        if fut is not None and not fut.done():
            fut.set_result(msg)
        elif msg["t"] == "error":
            self.fed.view.log(f"federation: {peer.node} refused a message: {msg['error']}")

    def gang(self, peer: Peer, link: Link, msg: dict[str, Any]) -> None:
        """A placement, launch, relay or fault message (federate/gangs/); a request is
        answered with reply{id, value} or reply{id, error: one line}."""
        g = self.fed.gangs
        kind, node = msg["t"], peer.node
        rid = msg.get("id")
        try:
            if kind == "relay":
                answer = g.frames.on_relay(node, msg)
                if answer is not None:
                    link.session.send_now(answer)
                return
            if kind == "blob" and msg["last"]:  # verified and extracted off the loop
                self.fed.spawn(self.last_blob(link, msg))
                return
            value = GANG_HANDLERS[kind](g, node, msg)
            if rid is not None:
                link.session.send_now({"t": "reply", "id": rid, "value": value})
        except DetLocalError as err:
            line = f"federation: refused {kind} from {node}: {err}"
            if isinstance(err, LendRefused):  # a peer can ask again and again
                self.fed.refusals.say(f"lend|{node}|{msg.get('user')!s:.40}", line)
            elif isinstance(err, BlobError):  # a chunk flood is one line a minute
                self.fed.refusals.say(f"blob|{node}|{err.code}", line)
            else:
                self.fed.view.log(line)
            if rid is not None:
                reply = {"t": "reply", "id": rid, "error": str(err)[:1000]}
                if isinstance(err, LendRefused):  # the owner offers that job here no more
                    reply["policy"] = True
                with contextlib.suppress(Exception):
                    link.session.send_now(reply)
        except (OSError, ConnectionError):
            pass
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
            why = f"malformed {kind} message ({type(err).__name__}: {err})"[:300]
            self.fed.view.log(f"federation: refused {kind} from {node}: {why}")
            if rid is not None:
                with contextlib.suppress(Exception):
                    link.session.send_now({"t": "reply", "id": rid, "error": why})

    async def last_blob(self, link: Link, msg: dict[str, Any]) -> None:
        reply: dict[str, Any] = {"t": "reply", "id": msg.get("id", 0)}
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, self.fed.gangs.members.on_blob, link.node, msg
            )
            reply["value"] = True
        except DetLocalError as err:
            self.fed.refusals.say(
                f"blob|{link.node}|last", f"federation: refused a context from {link.node}: {err}"
            )
            reply["error"] = str(err)[:1000]
        if "id" in msg:
            with contextlib.suppress(Exception):
                link.session.send_now(reply)

    async def answer(self, link: Link, msg: dict[str, Any]) -> None:
        try:
            if msg["what"] == "jobs":
                value: Any = self.fed.view.jobs(include_done=bool(msg.get("all", False)))
            else:
                value = self.fed.view.slot_rows()
            reply = {"t": "reply", "id": msg["id"], "value": value}
        except Exception as err:
            reply = {"t": "reply", "id": msg["id"], "error": f"{type(err).__name__}: {err}"[:500]}
        with contextlib.suppress(Exception):
            await link.session.send(reply)


PeerHandler = Callable[[Messages, Peer, Link, dict[str, Any]], None]

# the link's own message kinds -> their handler (gang kinds go to GANG_HANDLERS)
PEER_HANDLERS: dict[str, PeerHandler] = {
    "hb": Messages.on_hb,
    "peers": Messages.on_peers,
    "leave": Messages.on_leave,
    "query": Messages.on_query,
    "reply": Messages.on_reply,
    "error": Messages.on_reply,
}


GangHandler = Callable[[Gangs, str, dict[str, Any]], Any]

# a gang message kind (schema.GANG_SCHEMAS; relay is answered apart) -> its handler in the
# concern of federate/gangs/ it belongs to, given the sending node; what it returns is the
# reply's value
GANG_HANDLERS: dict[str, GangHandler] = {
    "has": lambda g, node, msg: g.members.on_has(msg),
    "blob": lambda g, node, msg: g.members.on_blob(node, msg),
    "reserve": lambda g, node, msg: g.members.on_reserve(node, msg),
    "ready": lambda g, node, msg: g.placement.on_ready(node, msg),
    "commit": lambda g, node, msg: g.members.on_commit(node, msg),
    "abort": lambda g, node, msg: g.members.on_abort(node, msg),
    "share": lambda g, node, msg: g.members.on_share(node, msg),
    "wounded": lambda g, node, msg: g.placement.on_wounded(node, msg),
    "yield": lambda g, node, msg: g.ends.on_yield(node, msg),
    "member_exit": lambda g, node, msg: g.ends.on_member_exit(node, msg),
    "down": lambda g, node, msg: g.frames.on_down(node, msg),
    "log": lambda g, node, msg: g.frames.on_log(node, msg),
}
