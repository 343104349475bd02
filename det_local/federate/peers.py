"""What a node knows of the others: a peer, its authenticated link, an address to dial, and
the state a peer is in by how long it has been silent (alive, suspect after SUSPECT_S, dead
after DEAD_S or at once after its `leave`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from det_local.federate.transport import Session

SUSPECT_S = 3.0
DEAD_S = 5.0


@dataclass
class Link:
    session: Session
    node: str
    host: str
    dialer: str  # node id of the side that dialled
    pending: dict[int, asyncio.Future[Any]] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    closed: bool = False
    quiet: bool = False  # closed on purpose (a duplicate link): not a drop


@dataclass
class Peer:
    node: str
    host: str = ""
    port: int = 0
    epoch: str = ""
    version: str = "?"
    free: int = 0
    total: int = 0
    kind: str = "?"
    digest: dict[str, Any] = field(default_factory=dict)
    last_heard: float = 0.0
    link: Link | None = None
    left: bool = False
    dropped_at: float | None = None
    state: str = "alive"
    lend: bool = True  # it runs shares of other machines' trials (its heartbeat says)


@dataclass
class Target:
    """An address to dial: a static peer, a learned one, or one mDNS found."""

    host: str
    port: int
    node: str | None = None
    static: bool = False
    next_at: float = 0.0
    backoff: float = 0.0
    dialing: bool = False
    last_error: str = ""
    self_: bool = False


def peer_state(peer: Peer, now: float) -> str:
    if peer.left:
        return "dead"
    silent = now - peer.last_heard
    if silent < SUSPECT_S:
        return "alive"
    if silent < DEAD_S:
        return "suspect"
    return "dead"
