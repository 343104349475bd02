"""Pre-authentication admission and gossip: cheap for this machine, expensive to abuse.

**Connections.** Before a connection proves the cluster key it costs a socket and a task, so:

* its hello must arrive within FIRST_FRAME_S (1 s), the whole handshake within
  `transport.HANDSHAKE_TIMEOUT`;
* one source address holds at most PER_SOURCE pending (unauthenticated) connections, and all
  sources together at most MAX_PENDING;
* an address a peer has authenticated from (or a static peer's, or one mDNS found) is *known*:
  its connections never count against those caps (up to KNOWN_MAX pending, for a reconnecting
  peer), so a keyless flood from elsewhere cannot keep a cluster member from joining or
  reattaching;
* refusals are logged once per source and kind a minute (`ratelog.RateLog`).

**Gossip.** A peer's `peers` list names other nodes' addresses. One is dialled only when it lies
within the addresses this cluster already uses: the static peers (`federation.peers`, exactly),
the networks of the interfaces this node discovered on (address and netmask), and addresses
peers have authenticated from; and at most GOSSIP_PER_MIN new addresses a minute from one peer.
Anything else is ignored with one rate-limited line. (A cluster spanning routed subnets names
its far members as static peers.)
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

FIRST_FRAME_S = 1.0
PER_SOURCE = 4
MAX_PENDING = 16
KNOWN_MAX = 16
GOSSIP_PER_MIN = 16


@dataclass
class Admission:
    """Counts pending (unauthenticated) connections by source; `admit` says whether a new one
    may go on (None) or why not (one line)."""

    known: set[str] = field(default_factory=set)
    pending: dict[str, int] = field(default_factory=dict)
    total: int = 0  # pending connections of unknown sources
    known_total: int = 0

    def admit(self, host: str) -> str | None:
        if host in self.known:
            if self.known_total >= KNOWN_MAX:
                return f"{KNOWN_MAX} connections from known peers are pending"
            self.known_total += 1
            self.pending[host] = self.pending.get(host, 0) + 1
            return None
        if self.pending.get(host, 0) >= PER_SOURCE:
            return f"{PER_SOURCE} unauthenticated connections from {host} are pending"
        if self.total >= MAX_PENDING:
            return f"{MAX_PENDING} unauthenticated connections are pending"
        self.total += 1
        self.pending[host] = self.pending.get(host, 0) + 1
        return None

    def done(self, host: str, was_known: bool) -> None:
        if was_known:
            self.known_total -= 1
        else:
            self.total -= 1
        left = self.pending.get(host, 0) - 1
        if left > 0:
            self.pending[host] = left
        else:
            self.pending.pop(host, None)


def interface_networks(names: tuple[str, ...] | None) -> list[ipaddress.IPv4Network]:
    """The IPv4 networks of the interfaces discovery runs on (`discovery.interface_addresses`)."""
    import psutil

    from det_local.federate.discovery import interface_addresses

    wanted = set(interface_addresses(names))
    nets: list[ipaddress.IPv4Network] = []
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family == socket.AF_INET and addr.address in wanted and addr.netmask:
                nets.append(ipaddress.IPv4Network(f"{addr.address}/{addr.netmask}", strict=False))
    return nets


@dataclass
class GossipFilter:
    """Which addresses from peers' lists may be dialled (see the module's docstring)."""

    networks: list[ipaddress.IPv4Network]
    static: set[str]
    authenticated: set[str] = field(default_factory=set)
    clock: Callable[[], float] = time.monotonic
    _recent: dict[str, deque[float]] = field(default_factory=dict)

    def within(self, host: str) -> bool:
        if host in self.static or host in self.authenticated:
            return True
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False  # a name from a peer is never resolved
        return any(ip in net for net in self.networks)

    def describe(self) -> str:
        nets = ", ".join(str(n) for n in self.networks) or "no discovered networks"
        return f"{nets}; static peers; addresses peers authenticated from"

    def allow(self, source: str, host: str) -> str | None:
        """None when `source`'s gossiped `host` may be dialled, else why not (one line)."""
        if not self.within(host):
            return (
                f"outside the cluster's networks ({self.describe()}): add it to "
                "federation.peers to dial it"
            )
        now = self.clock()
        seen = self._recent.setdefault(source, deque())
        while seen and now - seen[0] > 60.0:
            seen.popleft()
        if len(seen) >= GOSSIP_PER_MIN:
            return f"more than {GOSSIP_PER_MIN} new addresses a minute from {source}"
        seen.append(now)
        return None
