"""Membership and discovery between real daemons, one per Linux network namespace.

Each node is `det-local daemon` in its own namespace (10.77.0.N on a bridge that lives in a
namespace of its own), with its own home and DET_LOCAL_CPU_SLOTS=1. mDNS and TCP never leave
those namespaces. Waits are bounded polls of `det-local cluster peers --json`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from det_local.federate import keys
from tests.support.fednet import Net, Node, namespaces, sweep
from tests.support.world import wait_for

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2"
    ),
    pytest.mark.slow,
]

MDNS = {"DET_LOCAL_FED_INTERFACES": "eth0"}
NO_MDNS = {"DET_LOCAL_MDNS": "0"}
DEAD_BOUND_S = 5.0
TICK_SLACK_S = 2.0  # the heartbeat tick (0.25 s) late on a loaded 2-core machine


@pytest.fixture
def net(tmp_path: Path) -> Iterator[Net]:
    sweep()
    with Net(tmp_path) as n:
        yield n
    assert not [ns for ns in namespaces() if ns.startswith(n.prefix)]


def _line(node: Node, text: str) -> str | None:
    """The node's last log line holding `text`."""
    lines = [line for line in node.log_text().splitlines() if text in line]
    return lines[-1] if lines else None


def alive_set(node: Node) -> set[str]:
    return {k for k, s in node.states().items() if s == "alive"}


def wait_state(node: Node, peer: str, state: str, timeout: float = 30.0) -> float:
    t0 = time.monotonic()
    wait_for(
        lambda: node.states().get(peer) == state,
        timeout=timeout,
        interval=0.1,
        what=f"n{node.index} to see {peer} {state}",
    )
    return time.monotonic() - t0


def test_mdns_cluster_late_joiner_and_failures(net: Net) -> None:
    key = keys.new_key()
    nodes = [net.node(i, key) for i in (1, 2, 3)]
    for n in nodes:
        n.start(**MDNS)
    for n in nodes:
        others = {f"n{i}" for i in (1, 2, 3)} - {f"n{n.index}"}
        wait_for(lambda n=n, o=others: alive_set(n) == o, timeout=30, what=f"n{n.index} sees all")
    late = net.node(4, key).start(**MDNS)
    for n in [*nodes, late]:
        others = {f"n{i}" for i in (1, 2, 3, 4)} - {f"n{n.index}"}
        wait_for(lambda n=n, o=others: alive_set(n) == o, timeout=30, what=f"n{n.index} sees n4")
    n1, n2, n3 = nodes
    rows = {r["id"]: r for r in n1.peers().values()}
    assert rows["n1"]["state"] == "self" and rows["n2"]["slots_total"] == 1
    assert set(rows["n2"]) >= {"id", "address", "state", "slots_total", "slots_free", "version"}
    assert rows["n2"]["address"] == "10.77.0.2:47800"

    # the cluster view through the peers: a job queued on n2 shows in n1's job list
    res = n2.cli("cmd", "run", "--name", "on-n2", "--", "sleep", "60", user="root")
    assert res.returncode == 0, res.stderr
    out = json.loads(n1.cli("job", "list", "--cluster", "--json").stdout)
    by_node = {row["node"]: row for row in out}
    assert [j["name"] for j in by_node["n2"]["value"]] == ["on-n2"]
    assert by_node["n1"]["value"] == [] and "argv" not in by_node["n2"]["value"][0]
    slots = json.loads(n1.cli("slots", "--cluster", "--json").stdout)
    assert sorted(r["node"] for r in slots) == ["n1", "n2", "n3", "n4"]
    status = n1.cli("daemon", "status").stdout
    assert "federation: on, node n1, port 47800, 3 live peer(s)" in status

    # kill -9 of a peer: dead within the bound, as the daemon measures it (the silence it
    # logs; a `cluster peers` round trip on a loaded machine is no part of it)
    late.kill()
    wait_state(n1, "n4", "dead", timeout=DEAD_BOUND_S + 30)
    # the view computes the state from the silence; the log line comes with the next tick
    line = wait_for(lambda: _line(n1, "peer n4 is dead (silent "), timeout=30, what="n4 dead")
    silent = float(line.split("(silent ")[1].split("s)")[0])
    assert DEAD_BOUND_S <= silent <= DEAD_BOUND_S + TICK_SLACK_S, line

    # SIGSTOP: suspect, then dead; SIGCONT: alive again (suspect lasts 2 s, less than a
    # `cluster peers` round trip may take: the daemon's line says it was)
    n3.kill(signal.SIGSTOP)
    wait_for(lambda: _line(n1, "peer n3 is suspect"), timeout=30, what="n1 to see n3 suspect")
    wait_state(n1, "n3", "dead", timeout=30)
    n3.kill(signal.SIGCONT)
    wait_state(n1, "n3", "alive", timeout=30)

    # the link taken down and up again
    net.link(2, up=False)
    wait_state(n1, "n2", "dead", timeout=15)
    net.link(2, up=True)
    wait_state(n1, "n2", "alive", timeout=30)
    wait_state(n2, "n1", "alive", timeout=30)

    # cluster leave: the others see it go at once, nothing listens there any more
    res = n3.cli("cluster", "leave")
    assert res.returncode == 0, res.stderr
    wait_state(n1, "n3", "dead", timeout=30)
    wait_for(lambda: "peer n3 left" in n1.log_text(), timeout=30, what="n1 logs n3 left")
    probe = n1.in_ns(
        "python3", "-c", "import socket; socket.create_connection(('10.77.0.3', 47800), 3)"
    )
    assert "ConnectionRefusedError" in probe.stderr


def test_static_peers_one_address_restart_and_duplicate_id(net: Net) -> None:
    key = keys.new_key()
    n1 = net.node(1, key).start(**NO_MDNS)
    n2 = net.node(2, key).start(**NO_MDNS, DET_LOCAL_PEERS="10.77.0.1:47800")
    n3 = net.node(3, key).start(**NO_MDNS, DET_LOCAL_PEERS="10.77.0.1:47800")
    # n2 and n3 know only n1's address: each learns the other from n1's list
    wait_for(lambda: alive_set(n2) == {"n1", "n3"}, timeout=30, what="n2 learns n3")
    wait_for(lambda: alive_set(n3) == {"n1", "n2"}, timeout=30, what="n3 learns n2")
    wait_for(lambda: alive_set(n1) == {"n2", "n3"}, timeout=30, what="n1 sees both")
    assert "mDNS off" in n1.log_text()

    # a restart within the reattach window: the peers take it back, nothing else changes
    n2.kill()
    n2.start()
    wait_for(lambda: alive_set(n1) == {"n2", "n3"}, timeout=30, what="n2 back")
    wait_for(lambda: "peer n2 reattached after" in n1.log_text(), timeout=30, what="reattach")
    wait_for(lambda: alive_set(n2) == {"n1", "n3"}, timeout=30, what="n2 sees all again")

    # a cloned machine: a second host claims n3's id while n3 is alive
    clone = net.node(4, key)
    clone.start(**NO_MDNS, DET_LOCAL_NODE_ID="n3", DET_LOCAL_PEERS="10.77.0.1:47800")
    message = "two hosts claim node id 'n3'"
    wait_for(lambda: message in clone.log_text(), timeout=30, what="the clone told why")
    wait_for(lambda: message in n1.log_text(), timeout=30, what="n1 logs the refusal")
    assert "DET_LOCAL_NODE_ID" in clone.log_text()
    rows = n1.peers()
    assert rows["n3"]["address"] == "10.77.0.3:47800" and rows["n3"]["state"] == "alive"
    assert sorted(rows) == ["n1", "n2", "n3"]


def test_readme_commands_form_a_cluster(net: Net) -> None:
    """Two daemons already running with no key: `cluster init` on one, `cluster join` on the
    other, and `cluster peers` shows both (the running daemons start federating at once)."""
    n1 = net.node(1).start(**MDNS)
    n2 = net.node(2).start(**MDNS)
    assert "federation: off (no cluster key" in n1.cli("daemon", "status").stdout
    res = n1.cli("cluster", "init")
    assert res.returncode == 0, res.stderr
    token = res.stdout.strip().splitlines()[-1]
    res = n2.cli("cluster", "join", token)
    assert res.returncode == 0, res.stderr
    wait_for(lambda: alive_set(n2) == {"n1"}, timeout=30, what="n2 sees n1")
    out = n2.cli("cluster", "peers").stdout
    assert "n1" in out and "alive" in out and "self" in out
