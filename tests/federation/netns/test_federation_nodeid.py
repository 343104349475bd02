"""Node ids never collide silently (issue 25, item 5): an id is made once per home and kept
(two machines cloned from one image, same hostname and /etc/machine-id, differ); a collision
still seen over mDNS (a cloned home) is one line in the log, `daemon status` and `cluster
peers`, naming both machines and the remedy. Namespaced nodes share the host's hostname and
machine-id, which is exactly the cloned-image case."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from det_local.federate import keys
from det_local.federate.keys import default_node_id, stored_node_id, valid_node_id
from tests.support.fednet import Net, namespaces, sweep
from tests.support.world import wait_for

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2"
    ),
]
MDNS = {"DET_LOCAL_FED_INTERFACES": "eth0", "DET_LOCAL_NODE_ID": ""}  # the stored id


@pytest.fixture
def net(tmp_path: Path) -> Iterator[Net]:
    sweep()
    with Net(tmp_path) as n:
        yield n
    assert not [ns for ns in namespaces() if ns.startswith(n.prefix)]


def test_an_id_is_made_once_per_home(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    first = stored_node_id(a / "node-id")
    assert valid_node_id(first) and first != default_node_id()
    assert stored_node_id(a / "node-id") == first == (a / "node-id").read_text().strip()
    assert stored_node_id(b / "node-id") != first  # same host, another home
    (b / "node-id").write_text("../not an id\n")
    assert valid_node_id(stored_node_id(b / "node-id"))


def test_cloned_machines_get_their_own_ids_and_a_cloned_home_is_named(net: Net) -> None:
    key = keys.new_key()
    n1 = net.node(1, key).start(**MDNS)
    n2 = net.node(2, key).start(**MDNS)
    id1 = (n1.home / "node-id").read_text().strip()
    id2 = (n2.home / "node-id").read_text().strip()
    assert id1 != id2
    wait_for(
        lambda: n1.states().get(id2) == "alive" and n2.states().get(id1) == "alive",
        timeout=30,
        what="two cloned machines to see each other",
    )
    # a third machine whose home was copied from n1's: same id
    n3 = net.node(3, key)
    (n3.home / "node-id").write_text(id1 + "\n")
    n3.start(**MDNS)
    line = wait_for(
        lambda: next(
            (x for x in n3.log_text().splitlines() if "announced over mDNS by two" in x), None
        ),
        timeout=30,
        what="the collision line",
    )
    want = (
        f"node id '{id1}' is announced over mDNS by two machines: this one (10.77.0.3) and "
        f"10.77.0.1: a cloned machine or home? on one of them delete {n3.home / 'node-id'} (a "
        "new id is made at the next start) or set federation.node_id / DET_LOCAL_NODE_ID; mDNS "
        "stays off here until then"
    )
    assert line.endswith(f"federation: {want}"), line
    assert "NonUniqueNameException" not in n3.log_text()
    assert f"federation: {want}" in n3.cli("daemon", "status").stdout
    assert f"warning: {want}" in n3.cli("cluster", "peers").stdout
