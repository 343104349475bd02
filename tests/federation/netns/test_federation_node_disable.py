"""`cluster node disable|enable NAME`: a disabled node takes no anywhere jobs (or gang shares)
from its peers; enabled again, it does. Two nodes in network namespaces."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.support.fednet import Net, Node
from tests.support.gangnet import (
    db,
    job_row,
    pytestmark,  # noqa: F401  (root, iproute2; slow)
    run_anywhere,
    two_nodes,
)
from tests.support.world import wait_for


def _free_seen(by: Node, peer: str) -> int | None:
    res = by.cli("cluster", "peers", "--json")
    rows = {r["id"]: r for r in json.loads(res.stdout)} if res.returncode == 0 else {}
    row = rows.get(peer)
    return None if row is None else row["slots_free"]


def test_a_disabled_node_takes_no_anywhere_job_until_enabled(
    net: Net,
    tmp_path: Path,
) -> None:
    n1, n2 = two_nodes(net)
    res = n2.cli("cluster", "node", "disable", "n2")
    assert res.returncode == 0 and res.stdout.startswith(
        "node n2 disabled: it takes no new gang"
    ), res.stdout + res.stderr
    res = n1.cli("cluster", "node", "disable", "n2")  # only on n2 itself
    assert res.returncode == 1 and "run `det-local cluster node disable n2` on n2 itself" in (
        res.stderr
    ), res.stderr
    wait_for(lambda: _free_seen(n1, "n2") == 0, timeout=30, what="n1 to see n2 with none free")
    # n1's slot is taken: an anywhere command waits here, for n2 lends nothing now
    assert n1.cli("cmd", "run", "--name", "busy", "--", "sleep", "120").returncode == 0
    work = tmp_path / "work"
    work.mkdir()
    job_id = run_anywhere(n1, work, "sh", "-c", "exit 3")

    assert job_row(n1, job_id)[0] == "QUEUED"
    with db(n2) as conn:
        assert conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 0
    # enabled: n2 advertises its free slot again and the command goes there
    assert n2.cli("cluster", "node", "enable", "n2").stdout == "node n2 enabled\n"
    wait_for(lambda: job_row(n1, job_id)[0] == "DONE", timeout=60, what="the command to run on n2")
    state, code, message = job_row(n1, job_id)
    assert code == 3 and message is not None and "on n2" in message, (code, message)


def test_an_anywhere_job_a_peer_refused_is_offered_again_when_its_wait_ends(
    net: Net,
    tmp_path: Path,
) -> None:
    """A job sent whole to a peer that could not take it waits here 10 s, then is offered
    again by itself; refused again, it waits 20 s. (It used to wait for a later event to wake
    a pass: another job, or the peer's free slots growing. When the peer's slots never
    changed, it waited here until this machine's own slot came free: under load, when a
    first try was too slow, the test above waited 60 s in vain.)"""
    n1, n2 = two_nodes(net)
    assert n2.cli("cluster", "node", "disable", "n2").returncode == 0
    wait_for(lambda: _free_seen(n1, "n2") == 0, timeout=30, what="n1 to see n2 with none free")
    assert n1.cli("cmd", "run", "--name", "busy", "--", "sleep", "300").returncode == 0
    work = tmp_path / "work"
    work.mkdir()
    job_id = run_anywhere(n1, work, "sh", "-c", "exit 4")
    away = tmp_path / "away"
    work.rename(away)  # n2 refuses it: its working directory is not there
    assert n2.cli("cluster", "node", "enable", "n2").stdout == "node n2 enabled\n"
    refused = f"the command's working directory {work} is not on this machine"
    back = f"command {job_id} waits here again: "

    def came_back() -> list[float]:
        """When n1 logged it back (its log's time stamps, to the second)."""
        lines = [line for line in n1.log_text().splitlines() if back in line]
        assert all(refused in line for line in lines), lines
        return [time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) for line in lines]

    wait_for(lambda: len(came_back()) >= 1, timeout=60, what="the command back on n1")
    assert job_row(n1, job_id)[0] == "QUEUED"
    # nothing else happens: n2's free slot never changed, n1's own slot stays taken
    wait_for(lambda: len(came_back()) >= 2, timeout=60, what="it offered again, refused again")
    away.rename(work)
    first, second = came_back()[:2]
    assert second - first >= 9.0, (first, second)  # 10 s
    wait_for(lambda: job_row(n1, job_id)[0] == "DONE", timeout=90, what="the command to run on n2")
    state, code, message = job_row(n1, job_id)
    assert code == 4 and message is not None and "on n2" in message, (code, message)
    assert len(came_back()) == 2
    with db(n1) as conn:
        ended = conn.execute("SELECT ended_at FROM jobs WHERE id=?", (job_id,)).fetchone()[0]
    assert ended - second >= 19.0, (second, ended)  # 20 s


def test_an_anywhere_job_a_peer_refuses_for_good_leaves_the_spill_path_to_the_jobs_behind(
    net: Net,
    tmp_path: Path,
) -> None:
    """Issue 34 item 8: root's `cmd run --anywhere` (a lender never runs root's work: refused
    "[permanent]") waits here for this machine's slot, and is not offered to that peer again;
    an ordinary user's anywhere command queued behind it goes to the idle peer. The peer is
    never sent an abort for the gang it refused (it logged "refused abort ...: unknown gang")."""
    n1, n2 = two_nodes(net, DET_LOCAL_CPU_SLOTS="2")
    assert n1.cli("cmd", "run", "--name", "busy", "--", "sleep", "300").returncode == 0
    res = n1.cli("cmd", "run", "--anywhere", "--", "sh", "-c", "exit 5", user="root")
    assert res.returncode == 0, res.stderr
    root_job = int(res.stdout.split()[-1])
    refused = "root never runs work from other machines"
    back = f"command {root_job} waits here again: "
    wait_for(lambda: back in n1.log_text(), timeout=60, what="root's command refused by n2")
    assert refused in n1.log_text().split(back, 1)[1].splitlines()[0]
    work = tmp_path / "work"
    work.mkdir()
    # it runs on n2 for longer than root's command's first wait (10 s), with a slot of n2
    # still free: root's command offered again would be refused again meanwhile
    job_id = run_anywhere(n1, work, "sh", "-c", "sleep 14; exit 3")
    wait_for(lambda: job_row(n1, job_id)[0] == "DONE", timeout=90, what="the command on n2")
    state, code, message = job_row(n1, job_id)
    assert code == 3 and message is not None and "on n2" in message, (code, message)
    assert job_row(n1, root_job)[0] == "QUEUED"
    assert n1.log_text().count(back) == 1, n1.log_text()
    assert "refused abort from" not in n2.log_text(), n2.log_text()
