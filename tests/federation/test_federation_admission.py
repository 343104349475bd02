"""Pre-authentication is cheap for the daemon and expensive to abuse (issue 25, item 3): under
a keyless flood from one source (16 idle connections held + 1,000 connects a second), a keyed
machine from another address completes its handshake within 2 s, every time; the refusals are
a few lines, not one per connect; a gossiped address outside the cluster's networks is never
dialled. A real daemon on 127.0.0.1; the flood comes from 127.0.0.2 (another loopback source).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import threading
import time

import pytest

from det_local.federate import transport
from det_local.federate.admission import (
    KNOWN_MAX,
    MAX_PENDING,
    PER_SOURCE,
    Admission,
    GossipFilter,
)
from det_local.federate.ratelog import RateLog
from det_local.federate.transport import Me
from tests.support.peerlink import Victim, free_port
from tests.support.world import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs a root daemon")
FLOOD_FROM = "127.0.0.2"


class Flood:
    """16 idle connections held, and connects at `rate` a second, all from FLOOD_FROM."""

    def __init__(self, port: int, rate: int = 1000) -> None:
        self.port = port
        self.rate = rate
        self.stop = threading.Event()
        self.connects = 0
        self.idle: list[socket.socket] = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def sock(self) -> socket.socket:
        s = socket.socket()
        s.bind((FLOOD_FROM, 0))
        s.settimeout(5)
        s.connect(("127.0.0.1", self.port))
        return s

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.stop.is_set():
            due = int((time.monotonic() - t0) * self.rate)
            while self.connects < due and not self.stop.is_set():
                try:
                    s = self.sock()
                    s.close()
                except OSError:
                    pass
                self.connects += 1
            time.sleep(0.001)

    def __enter__(self) -> Flood:
        for _ in range(16):
            try:
                self.idle.append(self.sock())
            except OSError:
                pass
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
        for s in self.idle:
            s.close()


async def join(v: Victim, node: str) -> float:
    """A keyed machine's handshake from 127.0.0.1: seconds it took."""
    assert v.key is not None
    t0 = time.monotonic()
    r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", v.port), 10)
    me = Me(node, v.key, os.urandom(8).hex(), free_port())
    session, _ = await transport.client_handshake(r, w, me, "victim")
    took = time.monotonic() - t0
    session.close()
    return took


def test_a_keyed_machine_joins_within_2s_under_a_keyless_flood(victim: Victim) -> None:
    asyncio.run(join(victim, "friend"))  # known by key from now on (as after a first join)
    before = victim.text().count(f"refused a connection from {FLOOD_FROM}")
    with Flood(victim.port) as flood:
        wait_for(lambda: flood.connects >= 500, timeout=30, what="the flood under way")
        times = [asyncio.run(join(victim, "friend")) for _ in range(5)]
        # and a machine the victim never saw, from a source other than the flood's
        times.append(asyncio.run(join(victim, "newcomer")))
        wait_for(lambda: flood.connects >= 1000, timeout=30, what="1,000 connects")
    assert max(times) <= 2.0, times
    text = victim.text()
    flood_lines = [line for line in text.splitlines() if f"{FLOOD_FROM}" in line]
    assert flood.connects >= 1000
    assert len(flood_lines) <= 4, flood_lines  # once per source and kind a minute
    assert text.count(f"refused a connection from {FLOOD_FROM}") - before <= 1


def test_sixteen_idle_connections_from_one_source_hold_only_its_share(victim: Victim) -> None:
    idle = []
    for _ in range(16):
        s = socket.socket()
        s.bind((FLOOD_FROM, 0))
        s.connect(("127.0.0.1", victim.port))
        idle.append(s)
    line = victim.logged(
        f"federation: refused a connection from {FLOOD_FROM}: {PER_SOURCE} unauthenticated "
        f"connections from {FLOOD_FROM} are pending"
    )
    assert "more like it" not in line
    assert asyncio.run(join(victim, "other")) <= 2.0
    # the idle ones are cut at the first-frame deadline
    victim.logged(f"federation: refused {FLOOD_FROM}:", timeout=30)
    for s in idle:
        s.close()


def test_a_gossiped_address_outside_the_cluster_is_not_dialled(victim: Victim) -> None:
    trap = socket.socket()
    trap.bind(("127.0.0.3", 0))
    trap.listen(8)
    trap.settimeout(1.5)
    port = trap.getsockname()[1]

    async def gossip() -> None:
        assert victim.key is not None
        r, w = await asyncio.open_connection("127.0.0.1", victim.port)
        me = Me("mallory", victim.key, os.urandom(8).hex(), free_port())
        session, _ = await transport.client_handshake(r, w, me, "victim")
        await session.send(
            {"t": "peers", "list": [{"node": "n7", "host": "127.0.0.3", "port": port}]}
        )
        await session.send(
            {"t": "peers", "list": [{"node": "n8", "host": "10.98.0.2", "port": 9999}]}
        )
        await asyncio.get_running_loop().run_in_executor(
            None, victim.logged, "ignored n8 at 10.98.0.2:9999 from mallory's peer list"
        )
        session.close()

    asyncio.run(gossip())
    line = victim.logged("ignored n7 at 127.0.0.3")
    assert "outside the cluster's networks" in line and "add it to federation.peers" in line
    with pytest.raises(socket.timeout):
        trap.accept()  # never dialled
    trap.close()


def test_admission_caps() -> None:
    a = Admission(known={"10.0.0.5"})
    assert all(a.admit("10.0.0.9") is None for _ in range(PER_SOURCE))
    assert (
        a.admit("10.0.0.9") == f"{PER_SOURCE} unauthenticated connections from 10.0.0.9 are pending"
    )
    for i in range(MAX_PENDING - PER_SOURCE):
        assert a.admit(f"10.0.1.{i}") is None
    assert a.admit("10.0.2.1") == f"{MAX_PENDING} unauthenticated connections are pending"
    for _ in range(KNOWN_MAX):  # a known peer always gets a slot
        assert a.admit("10.0.0.5") is None
    assert a.admit("10.0.0.5") == f"{KNOWN_MAX} connections from known peers are pending"
    a.done("10.0.0.9", False)
    assert a.admit("10.0.0.9") is None


def test_gossip_filter_and_rate() -> None:
    now = [0.0]
    g = GossipFilter(
        [ipaddress.IPv4Network("10.77.0.0/24")], {"192.168.5.5", "gpu9.lab"}, clock=lambda: now[0]
    )
    assert g.allow("n2", "10.77.0.9") is None
    assert g.allow("n2", "192.168.5.5") is None and g.allow("n2", "gpu9.lab") is None
    why = g.allow("n2", "10.98.0.2")
    assert why is not None and why.startswith("outside the cluster's networks (10.77.0.0/24;")
    assert g.allow("n2", "evil.example") is not None  # names from peers are never resolved
    for i in range(13):  # 16 a minute: 3 above, 13 here
        assert g.allow("n2", f"10.77.0.{20 + i}") is None
    assert g.allow("n2", "10.77.0.99") == "more than 16 new addresses a minute from n2"
    now[0] = 61.0
    assert g.allow("n2", "10.77.0.99") is None


def test_ratelog_counts_what_it_held_back() -> None:
    lines: list[str] = []
    now = [0.0]
    log = RateLog(lines.append, 60.0, clock=lambda: now[0])
    assert log.say("k", "a") and not log.say("k", "a") and not log.say("k", "a")
    assert log.say("j", "b")
    now[0] = 60.5
    assert log.say("k", "a")
    assert lines == ["a", "b", "a (2 more like it in the last 60s)"]
