"""The federation service: runs on the daemon's event loop (an `sched.extensions` Extension).

With a cluster key (and no `cluster leave` since), it listens on the peer port, announces and
browses with mDNS, dials static peers and peers learned from other peers, keeps one
authenticated link per peer, sends a heartbeat every HEARTBEAT_S and judges each peer by how
long it has been silent: alive, suspect after SUSPECT_S, dead after DEAD_S (at once after a
`leave`). A dropped link is redialled at once; a peer back within REATTACH_S of its drop is
reattached (its record kept). Without a key nothing listens and nothing is announced.

The CLI on this machine reads the cluster view through the daemon's cluster socket
(`Paths.cluster_socket`, `client.py`): peers, status, and every node's jobs and slots (asked
of the peers over their links). Changing the daemon's federation (`reload` after `cluster
init|join`, `leave`) is for the daemon's own user (or root) only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from det_local.errors import DetLocalError
from det_local.federate import schema
from det_local.federate.admission import FIRST_FRAME_S, Admission, GossipFilter
from det_local.federate.gangs.placer import Gangs
from det_local.federate.keys import KeyError_, read_key
from det_local.federate.lending import LendPolicy, uid_range
from det_local.federate.localsocket import ClusterSocket
from det_local.federate.messages import Messages
from det_local.federate.peers import SUSPECT_S, Link, Peer, Target, peer_state
from det_local.federate.ratelog import RateLog
from det_local.federate.report import Report
from det_local.federate.settings import NODE_ID_FILE, FederationSettings, load
from det_local.federate.transport import (
    HANDSHAKE_TIMEOUT,
    Me,
    PeerHello,
    Refused,
    Session,
    client_handshake,
    duplicate_message,
    server_handshake,
)
from det_local.sched.extensions import EngineView
from det_local.sched.gangseam import REATTACH_S

HEARTBEAT_S = 1.0
TICK_S = 0.25
PEERS_EVERY_S = 5.0
DIAL_TIMEOUT_S = 3.0
REDIAL_MIN_S = 0.5
REDIAL_MAX_S = 5.0
STATIC_MAX_S = 30.0
REFUSED_BACKOFF_S = 30.0  # wrong key, another cluster, another version: no need to hurry
REFUSAL_LOG_S = 60.0  # a refusal of a peer's input is logged once per source and kind a minute


def extension(view: EngineView) -> Federation:
    return Federation(view)


class Federation:
    def __init__(self, view: EngineView) -> None:
        self.view = view
        self.paths = view.paths
        self.on = False
        self.why_off = "not started"
        self.settings: FederationSettings | None = None
        self.me: Me | None = None
        self.peers: dict[str, Peer] = {}
        self.targets: dict[tuple[str, int], Target] = {}
        self.server: asyncio.AbstractServer | None = None
        self.local: asyncio.AbstractServer | None = None
        self.discovery: Any = None
        self.address = ""
        self._own_nonces: set[bytes] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ticker: asyncio.Task[None] | None = None
        self._next_hb = 0.0
        self._next_peers = 0.0
        self._query_id = 0
        self._lock = asyncio.Lock()
        self.gangs = Gangs(self)  # trials across machines
        self.messages = Messages(self)  # what each peer message does
        self.report = Report(self)  # the cluster as this node sees it (the cluster socket's)
        self.lend = True
        self.lend_priority_offset = 0
        self.lending = LendPolicy("local", lend=False)
        self.admission = Admission()
        self.collision = ""  # a node id another machine announces as well (mDNS)
        self.gossip = GossipFilter([], set())
        self.refusals = RateLog(self.view.log, REFUSAL_LOG_S)  # hostile input: one line a minute

    # ================================================================== lifecycle
    async def start(self) -> None:
        sock = self.paths.cluster_socket
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        try:
            self.local = await asyncio.start_unix_server(ClusterSocket(self).serve, path=str(sock))
            os.chmod(sock, 0o666 if os.geteuid() == 0 else 0o600)
        except OSError as err:
            self.view.log(f"federation: no cluster socket at {sock} ({err.strerror})")
        await self.begin()

    async def stop(self) -> None:
        try:
            await self.end(goodbye=True)
        except Exception as err:  # the daemon stops regardless
            self.view.log(f"federation: stopping: {err}")
        if self.local is not None:
            self.local.close()
            with contextlib.suppress(FileNotFoundError):
                self.paths.cluster_socket.unlink()

    async def begin(self) -> None:
        async with self._lock:
            if self.on:
                return
            if self.paths.cluster_left.exists():
                self.why_off = "left the cluster (`det-local cluster join TOKEN` to join again)"
                return
            try:
                key = read_key(self.paths.cluster_key)
                if key is None:
                    self.why_off = "no cluster key (`det-local cluster init` or `cluster join`)"
                    return
                self.settings = settings = load(self.paths.settings)
            except (KeyError_, DetLocalError) as err:
                self.why_off = str(err)
                self.view.log(f"federation: {err}")
                return
            self.me = Me(settings.node_id, key, os.urandom(8).hex(), settings.port)
            try:
                self.server = await asyncio.start_server(
                    self._on_accept, host=settings.listen, port=settings.port, reuse_address=True
                )
            except OSError as err:
                self.why_off = (
                    f"cannot listen on {settings.listen}:{settings.port} ({err.strerror}): set "
                    "federation.port in daemon.yaml or DET_LOCAL_FED_PORT"
                )
                self.view.log(f"federation: {self.why_off}")
                return
            self.on = True
            self.why_off = ""
            self.collision = ""
            self.lend = settings.lend
            self.lending = LendPolicy(
                settings.node_id,
                settings.lend,
                settings.lend_users,
                settings.lend_peers,
                *uid_range(),
            )
            self.lend_priority_offset = settings.lend_priority_offset
            self.view.gangs.max_peer_requeues = settings.max_peer_requeues
            self.view.install_placer(self.gangs, self.me.node)
            self.gangs.recover()  # gangs whose ranks outlived a restart of this daemon
            self.peers.clear()
            self.targets.clear()
            for host, port in settings.peers:
                self.targets[(host, port)] = Target(host, port, static=True)
            from det_local.federate.admission import interface_networks
            from det_local.federate.discovery import advertised, interface_addresses

            # what it listens on is what it advertises: a specific listen address (127.0.0.1,
            # one interface's) alone, the interfaces' addresses only for a wildcard listen
            addrs = advertised(settings.listen, interface_addresses(settings.interfaces))
            statics = {host for host, _port in settings.peers}
            self.admission = Admission(known=set(statics))
            self.gossip = GossipFilter(interface_networks(settings.interfaces), statics)
            self.address = f"{addrs[0] if addrs else settings.listen}:{settings.port}"
            self._ticker = asyncio.get_running_loop().create_task(self._tick_forever())
            self.view.log(
                f"federation: node {self.me.node} listening on {settings.listen}:{settings.port} "
                f"(cluster {self.me.cluster}), mDNS {'on' if settings.mdns else 'off'}, "
                f"{len(settings.peers)} static peer(s)"
            )
            if settings.mdns:
                await self._start_discovery(addrs)

    async def _start_discovery(self, addrs: list[str]) -> None:
        assert self.me is not None and self.settings is not None
        if not addrs:
            self.view.log("federation: mDNS off: no private IPv4 interface to announce on")
            return
        from det_local.federate.discovery import Discovery

        free, total, kind = self.view.slots()
        disc = Discovery(self.me, addrs, self._discovered, self.view.log, total, kind)
        try:
            await disc.start()
        except Exception as err:
            if type(err).__name__ == "NonUniqueNameException":  # its message is empty
                other = await disc.holder()
                self.collision = collision_message(
                    self.me.node, ", ".join(addrs), other, str(self.paths.home / NODE_ID_FILE)
                )
                self.view.log(f"federation: {self.collision}")
            else:
                self.view.log(f"federation: mDNS off: {type(err).__name__}: {err}")
            with contextlib.suppress(Exception):
                await asyncio.wait_for(disc.stop(), 3.0)
            return
        self.discovery = disc

    async def end(self, goodbye: bool) -> None:
        async with self._lock:
            if not self.on:
                return
            self.on = False
            self.view.install_placer(None)
            if self._ticker is not None:
                self._ticker.cancel()
            if self.server is not None:
                self.server.close()
            links = [p.link for p in self.peers.values() if p.link is not None]
            for link in links:
                if goodbye:
                    with contextlib.suppress(Exception):
                        await link.session.send({"t": "leave"})
                self.close_link(link, quiet=True)
            for link in links:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(link.session.writer.wait_closed(), 1.0)
            if self.discovery is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.discovery.stop(), 3.0)
                self.discovery = None
            for task in list(self._tasks):
                task.cancel()
            self.peers.clear()
            self.targets.clear()

    def spawn(self, coro: Awaitable[Any]) -> None:
        self._spawn(coro)

    async def request(self, node: str, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send a request to a peer and wait for its reply (or error) message."""
        peer = self.peers.get(node)
        link = peer.link if peer is not None else None
        if link is None or link.closed:
            raise ConnectionError(f"no link to {node}")
        qid = self.next_query_id()
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        link.pending[qid] = fut
        try:
            link.session.send_now({**msg, "id": qid})
            return dict(await asyncio.wait_for(fut, timeout))
        finally:
            link.pending.pop(qid, None)

    def next_query_id(self) -> int:
        """A request id no other request on any link has (replies are matched by it)."""
        self._query_id += 1
        return self._query_id

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ================================================================== accepting
    async def _on_accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        where = _where(writer)
        source = where.rsplit(":", 1)[0]
        if not self.on or self.me is None:
            writer.transport.abort()
            return
        known = source in self.admission.known
        full = self.admission.admit(source)
        if full is not None:  # before any byte is read: a flood costs an accept and a close
            self.refusals.say(
                f"full|{source}", f"federation: refused a connection from {source}: {full}"
            )
            writer.transport.abort()
            return
        try:
            try:
                pending = await asyncio.wait_for(
                    server_handshake(
                        reader, writer, self.me, where, self._own_nonces, FIRST_FRAME_S
                    ),
                    HANDSHAKE_TIMEOUT,
                )
            except Refused as err:
                self.refusals.say(f"{err.code}|{source}", f"federation: refused {where}: {err}")
                writer.close()
                return
            except asyncio.TimeoutError:
                self.refusals.say(
                    f"slow|{source}",
                    f"federation: refused {where}: no handshake within {HANDSHAKE_TIMEOUT:.0f}s",
                )
                writer.transport.abort()
                return
            except (asyncio.IncompleteReadError, ConnectionError, OSError):
                self.refusals.say(
                    f"closed|{source}", f"federation: refused {where}: closed during the handshake"
                )
                writer.transport.abort()
                return
        finally:
            self.admission.done(source, known)
        self.admission.known.add(source)  # it holds the key: its reconnects always get a slot
        self.gossip.authenticated.add(source)
        host = where.rsplit(":", 1)[0]
        refusal = self._refuse_admission(pending.peer, host)
        if refusal is not None:
            message, code = refusal
            pending.refuse(message, code)
            if code != "link":
                self.view.log(f"federation: refused {where}: {message}")
            writer.close()
            return
        session = pending.admit()
        self._attach(session, pending.peer, host, dialer=pending.peer.node)

    def _refuse_admission(self, hello: PeerHello, host: str) -> tuple[str, str] | None:
        """Whether a peer that passed the handshake may have a link now."""
        assert self.me is not None
        peer = self.peers.get(hello.node)
        link = peer.link if peer is not None else None
        if peer is None or link is None or link.closed:
            return None
        silent = time.monotonic() - peer.last_heard
        if peer.epoch != hello.epoch and link.host != host and silent < SUSPECT_S:
            return duplicate_message(hello.node, f"{host} and {link.host}"), "duplicate"
        if peer.epoch == hello.epoch and min(self.me.node, hello.node) == link.dialer:
            return f"{hello.node} already has a link to {self.me.node}", "link"
        return None

    # ================================================================== dialling
    def _discovered(self, node: str, host: str, port: int) -> None:
        """mDNS found a node of this cluster: its address is known (always admitted)."""
        self.admission.known.add(host)
        self.gossip.authenticated.add(host)
        self._found(node, host, port)

    def gossiped(self, peer: Peer, node: str, host: str, port: int) -> None:
        """A peer's list names a node: dialled only within the cluster's addresses."""
        if self.me is None or node == self.me.node or (host, port) in self.targets:
            if self.me is not None and node != self.me.node:
                self._found(node, host, port)
            return
        why = self.gossip.allow(peer.node, host)
        if why is not None:
            self.refusals.say(
                f"gossip|{peer.node}|{host}",
                f"federation: ignored {node} at {host}:{port} from {peer.node}'s peer list: {why}",
            )
            return
        self._found(node, host, port)

    def _found(self, node: str, host: str, port: int) -> None:
        """mDNS (or a peer's list) names a node: dial it unless a link exists."""
        if self.me is None or node == self.me.node:
            return
        target = self.targets.get((host, port))
        if target is None:
            self.targets[(host, port)] = Target(host, port, node=node)
        elif target.node is None:
            target.node = node
        peer = self.peers.get(node)
        if peer is None or peer.link is None:
            t = self.targets[(host, port)]
            t.next_at = min(t.next_at, time.monotonic())
            self._dial_due()

    def _dial_due(self) -> None:
        now = time.monotonic()
        linked = {(p.host, p.port) for p in self.peers.values() if p.link is not None}
        linked_nodes = {n for n, p in self.peers.items() if p.link is not None}
        for key, target in self.targets.items():
            if target.self_ or target.dialing or target.next_at > now:
                continue
            if key in linked or (target.node is not None and target.node in linked_nodes):
                continue
            target.dialing = True
            self._spawn(self._dial(target))

    async def _dial(self, target: Target) -> None:
        assert self.me is not None
        where = f"{target.host}:{target.port}"
        writer: asyncio.StreamWriter | None = None
        try:
            reader, w = await asyncio.wait_for(
                asyncio.open_connection(target.host, target.port), DIAL_TIMEOUT_S
            )
            writer = w
            session, hello = await client_handshake(reader, w, self.me, where, self._own_nonces)
            peer_host = w.get_extra_info("peername")[0]
            target.node = hello.node
            refusal = self._refuse_admission(hello, peer_host)
            if refusal is not None:
                raise Refused(refusal[0], refusal[1])
            target.backoff = 0.0
            target.last_error = ""
            self._attach(session, hello, peer_host, dialer=self.me.node, port=target.port)
            writer = None
        except Refused as err:
            if err.code == "self":
                target.self_ = True
            elif err.code != "link" and str(err) != target.last_error:
                self.view.log(f"federation: {err}")  # once per new reason, not per retry
                target.last_error = str(err)
            slow = err.code in ("key", "cluster", "version", "duplicate")
            self._backoff(target, REFUSED_BACKOFF_S if slow else None)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as err:
            reason = (
                f"cannot reach {where} ({getattr(err, 'strerror', None) or type(err).__name__})"
            )
            if target.static and reason != target.last_error:
                self.view.log(f"federation: {reason}; trying again")
            target.last_error = reason
            self._backoff(target)
        finally:
            target.dialing = False
            if writer is not None:
                writer.transport.abort()

    def _backoff(self, target: Target, fixed: float | None = None) -> None:
        top = STATIC_MAX_S if target.static else REDIAL_MAX_S
        target.backoff = fixed or min(max(target.backoff * 2, REDIAL_MIN_S), top)
        target.next_at = time.monotonic() + target.backoff

    # ================================================================== links
    def _attach(
        self, session: Session, hello: PeerHello, host: str, dialer: str, port: int | None = None
    ) -> None:
        now = time.monotonic()
        peer = self.peers.get(hello.node)
        if peer is None:
            peer = self.peers[hello.node] = Peer(hello.node)
            self.view.log(f"federation: peer {hello.node} joined ({host}:{hello.port})")
        elif peer.link is not None:
            self.close_link(peer.link, quiet=True)
        elif peer.dropped_at is not None:
            gap = now - peer.dropped_at
            how = "reattached" if gap <= REATTACH_S else "rejoined"
            self.view.log(f"federation: peer {hello.node} {how} after {gap:.1f}s")
        elif peer.left:
            self.view.log(f"federation: peer {hello.node} rejoined")
        link = Link(session, hello.node, host, dialer)
        peer.link = link
        peer.host, peer.port = host, port or hello.port
        peer.epoch, peer.version = hello.epoch, hello.version
        peer.last_heard = now
        peer.left = False
        peer.dropped_at = None
        peer.state = "alive"
        self.targets.setdefault((host, peer.port), Target(host, peer.port, node=hello.node))
        link.task = asyncio.get_running_loop().create_task(self._read_loop(peer, link))
        self._spawn(self._greet(link))
        self.gangs.peers_changed()
        self.gangs.peer_attached(hello.node)

    async def _greet(self, link: Link) -> None:
        with contextlib.suppress(Exception):
            await link.session.send(self._hb())
            await link.session.send(self._peer_list())

    def close_link(self, link: Link, quiet: bool = False) -> None:
        link.quiet = link.quiet or quiet
        if link.closed:
            return
        link.closed = True
        link.session.close()
        for fut in link.pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError(f"the link to {link.node} closed"))
        link.pending.clear()

    async def _read_loop(self, peer: Peer, link: Link) -> None:
        why = "closed"
        try:
            while not link.closed:
                msg = await link.session.recv()
                peer.last_heard = time.monotonic()
                await self.messages.handle(peer, link, msg)
        except Refused as err:
            why = str(err)
            self.view.log(f"federation: closed the link to {peer.node}: {err}")
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            why = "closed"
        except asyncio.CancelledError:
            raise
        finally:
            quiet = link.quiet
            self.close_link(link)
            if peer.link is link:
                peer.link = None
                if not quiet and not peer.left and self.on:
                    peer.dropped_at = time.monotonic()
                    self.view.log(f"federation: link to {peer.node} dropped ({why}); redialling")
                    for target in self.targets.values():
                        if target.node == peer.node or (target.host, target.port) == (
                            peer.host,
                            peer.port,
                        ):
                            target.next_at = 0.0
                            target.backoff = 0.0
                    self._dial_due()

    # ================================================================== heartbeats, states
    def _hb(self) -> dict[str, Any]:
        free, total, kind = self.view.slots()
        return {
            "t": "hb",
            "free": free,
            "total": total,
            "kind": kind,
            "digest": self.view.queue_digest(),
            "lend": self.lend,
        }

    def _peer_list(self) -> dict[str, Any]:
        entries = [
            {"node": p.node, "host": p.host, "port": p.port}
            for p in self.peers.values()
            if p.link is not None and p.host and p.port
        ]
        return {"t": "peers", "list": entries[: schema.MAX_PEERS]}

    async def _tick_forever(self) -> None:
        while self.on:
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # a bug here must not stop the heartbeats for good
                self.view.log(f"federation: heartbeat tick failed: {type(err).__name__}: {err}")
            await asyncio.sleep(TICK_S)

    async def _tick(self) -> None:
        now = time.monotonic()
        links = [p.link for p in self.peers.values() if p.link is not None and not p.link.closed]
        if now >= self._next_hb:
            self._next_hb = now + HEARTBEAT_S
            hb = self._hb()
            send_list = now >= self._next_peers
            if send_list:
                self._next_peers = now + PEERS_EVERY_S
            plist = self._peer_list()
            for link in links:
                try:
                    await link.session.send(hb)
                    if send_list:
                        await link.session.send(plist)
                except (OSError, ConnectionError, ValueError):
                    self.close_link(link)
        for peer in self.peers.values():
            state = peer_state(peer, now)
            if state != peer.state:
                if state in ("suspect", "dead") and not peer.left:
                    silent = now - peer.last_heard
                    self.view.log(f"federation: peer {peer.node} is {state} (silent {silent:.1f}s)")
                    if state == "dead" and peer.link is not None:
                        self.close_link(peer.link)  # a silent link is a dead one: redial
                elif state == "alive" and peer.state != "alive":
                    self.view.log(f"federation: peer {peer.node} is alive")
                peer.state = state
                self.gangs.peers_changed()
        self.gangs.tick()
        self._dial_due()


def collision_message(node: str, mine: str, other: str, id_file: str) -> str:
    return (
        f"node id '{node}' is announced over mDNS by two machines: this one ({mine}) and "
        f"{other}: a cloned machine or home? on one of them delete {id_file} (a new id is "
        "made at the next start) or set federation.node_id / DET_LOCAL_NODE_ID; mDNS stays off "
        "here until then"
    )


def _where(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return "?"


Factory = Callable[[EngineView], Federation]
