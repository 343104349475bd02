"""mDNS: announce this node as `_det-local._tcp.local.` and browse for the others.

TXT (a hint only; the handshake admits a peer): id, v (protocol major), port, cluster (8 hex
of HMAC(key, "cluster-id")), slots, kind, dl (det-local version). Announced only on private
IPv4 interfaces, skipping docker*, virbr*, veth*, br-* and loopback, unless
`federation.interfaces` names them. python-zeroconf is imported here only, and this module
only when multicast is on.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Callable
from typing import Any

from det_local import __version__
from det_local.federate.keys import valid_node_id
from det_local.federate.transport import PROTOCOL_VERSION, Me

SERVICE = "_det-local._tcp.local."
SKIP_PREFIXES = ("docker", "virbr", "veth", "br-", "lo")
RESOLVE_MS = 3000
MAX_TXT = 400


def interface_addresses(names: tuple[str, ...] | None) -> list[str]:
    """IPv4 addresses to announce on: those of `names`, else of every private interface."""
    import psutil

    out: list[str] = []
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        if names is not None:
            if name not in names:
                continue
        elif name.startswith(SKIP_PREFIXES):
            continue
        for addr in addrs:
            if addr.family != socket.AF_INET:
                continue
            ip = ipaddress.ip_address(addr.address)
            if names is None and (not ip.is_private or ip.is_loopback or ip.is_link_local):
                continue
            out.append(addr.address)
    return out


WILDCARDS = frozenset({"", "0.0.0.0", "::", "*"})


def advertised(listen: str, interfaces: list[str]) -> list[str]:
    """The addresses a node announces (mDNS, its own row in `cluster`): the interfaces'
    addresses when it listens on all of them (a wildcard), else only the one it listens on, so
    that no peer is sent to an address where nothing answers."""
    return list(interfaces) if listen in WILDCARDS else [listen]


def parse_txt(props: dict[bytes, bytes | None], cluster: str) -> tuple[str, int] | None:
    """(node, port) from a TXT record of this cluster; None for anything else."""
    if sum(len(k) + len(v or b"") for k, v in props.items()) > MAX_TXT:
        return None
    try:
        text = {k.decode(): (v or b"").decode() for k, v in props.items()}
        node, port, v = text.get("id"), int(text.get("port", "")), int(text.get("v", ""))
    except (UnicodeDecodeError, ValueError):
        return None
    if not valid_node_id(node) or not 0 < port < 65536 or text.get("cluster") != cluster:
        return None
    if v != PROTOCOL_VERSION:
        return None  # the handshake would refuse it; a static dial says why
    assert node is not None
    return node, port


class Discovery:
    def __init__(
        self,
        me: Me,
        addresses: list[str],
        found: Callable[[str, str, int], None],
        log: Callable[[str], None],
        slots: int,
        kind: str,
    ) -> None:
        self.me = me
        self.addresses = addresses
        self.found = found
        self.log = log
        self.slots = slots
        self.kind = kind
        self.zc: Any = None
        self.browser: Any = None
        self.info: Any = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

        self.zc = AsyncZeroconf(interfaces=self.addresses, ip_version=IPVersion.V4Only)
        self.info = AsyncServiceInfo(
            SERVICE,
            f"{self.me.node}.{SERVICE}",
            addresses=[socket.inet_aton(a) for a in self.addresses],
            port=self.me.port,
            properties={
                "id": self.me.node,
                "v": str(PROTOCOL_VERSION),
                "port": str(self.me.port),
                "cluster": self.me.cluster,
                "slots": str(self.slots),
                "kind": self.kind,
                "dl": __version__,
            },
            server=f"{self.me.node}.local.",
        )
        self.browser = AsyncServiceBrowser(self.zc.zeroconf, [SERVICE], handlers=[self._on_change])
        # the registration returns a task that must be awaited as well (probing, ~1 s)
        await (await self.zc.async_register_service(self.info))

    def _on_change(self, zeroconf: Any, service_type: str, name: str, state_change: Any) -> None:
        from zeroconf import ServiceStateChange

        if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            task = asyncio.ensure_future(self._resolve(name))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _resolve(self, name: str) -> None:
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncServiceInfo

        if name == f"{self.me.node}.{SERVICE}":
            return
        info = AsyncServiceInfo(SERVICE, name)
        if not await info.async_request(self.zc.zeroconf, RESOLVE_MS):
            return
        got = parse_txt(info.properties or {}, self.me.cluster)
        addrs = info.parsed_addresses(IPVersion.V4Only)
        if got is None or not addrs:
            return
        node, port = got
        self.found(node, addrs[0], port)

    async def holder(self) -> str:
        """After a NonUniqueNameException: the address(es) of the machine that announces this
        node's name already ("?" when it does not answer within RESOLVE_MS)."""
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncServiceInfo

        info = AsyncServiceInfo(SERVICE, f"{self.me.node}.{SERVICE}")
        with contextlib.suppress(Exception):
            if await info.async_request(self.zc.zeroconf, RESOLVE_MS):
                theirs = [a for a in info.parsed_addresses(IPVersion.V4Only)]
                others = [a for a in theirs if a not in self.addresses]
                if others or theirs:
                    return ", ".join(others or theirs)
        return "?"

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.browser is not None:
            with contextlib.suppress(Exception):
                await self.browser.async_cancel()
        if self.zc is not None:
            if self.info is not None:
                with contextlib.suppress(Exception):  # the goodbye
                    await (await self.zc.async_unregister_service(self.info))
            await self.zc.async_close()
