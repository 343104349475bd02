"""The dashboard's cluster, commands and slots pages and their API (det_local/web/cluster.py,
commands.py; clusterviews.cluster_view/peers_json/commands_json), and MetricTable.latest as an index
seek.

The cluster test is a real two-node federation in network namespaces: node 1's daemon runs the
dashboard (daemon.yaml `dashboard:`), so the dashboard lives in node 1's namespace and is
queried there."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from det_local.client.slotview import from_answer
from det_local.sched.queue import hardware as hardware
from det_local.sched.queue.inventory import engine_answer
from det_local.store.db import Store
from tests.support.dashboard import asgi_get, token_app
from tests.support.fednet import Net, namespaces
from tests.support.gangnet import (
    two_nodes,
)
from tests.support.nvml import FakeNvml, install, two_h100s
from tests.support.world import Env, wait_for

pytest.importorskip("starlette")


def get(path: str) -> tuple[int, str]:
    """GET path through the dashboard's application in this process (no socket)."""
    status, _, body = asgi_get(token_app(), path, {"host": "127.0.0.1:8080"})
    return status, body.decode()


# ---------------------------------------------------------------------------- store hot spot
def test_latest_report_is_an_index_seek(det_home: Path) -> None:
    store = Store(det_home / "db.sqlite")
    plan = store.metrics.conn.execute(
        "EXPLAIN QUERY PLAN SELECT trial_id FROM metrics WHERE trial_id=1 AND grp='training'"
        " ORDER BY id DESC LIMIT 1"
    ).fetchall()
    text = " ".join(str(r[-1]) for r in plan)
    assert "metrics_newest" in text and "TEMP B-TREE" not in text, text
    rows = [(1, 1, "training", s, 0.0, json.dumps({"loss": s}), None) for s in range(5000)]
    rows += [(2, 1, "training", 9999, 0.0, '{"loss": -1}', None)]  # another trial, later
    rows += [(1, 2, "training", 10, 0.0, '{"loss": 0.5}', None)]  # restarted from step 10
    with store.transaction():
        store.metrics.conn.executemany(
            "INSERT INTO metrics(trial_id, run_id, grp, steps_completed, time, metrics,"
            " batch_metrics) VALUES (?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
    latest = store.latest_metrics(1, "training")
    assert latest is not None  # the last recorded, not the one with the most steps
    assert (latest.run_id, latest.steps_completed, latest.metrics) == (2, 10, {"loss": 0.5})
    assert store.latest_metrics(1, "validation") is None
    store.close()


# ---------------------------------------------------------------------------- commands
NOTEBOOK_SECRET = "d1e5ec7e7c0ffee0d1e5ec7e7c0ffee0"
ARGV_SECRET = "argv0secret0token0value0abcdef12"


def test_commands_page_and_api_show_links_but_no_token(dl: Env) -> None:
    dl.daemon_start(DET_LOCAL_CPU_SLOTS="1", DET_LOCAL_CGROUPS="off")
    from det_local import api

    # a notebook-shaped job, as `notebook start` submits one: its token in its environment;
    # one more in argv, as a user might pass it
    job = api.control_job(
        "cmd_run",
        {
            "argv": [
                "sh",
                "-c",
                "sleep 60",
                "--ip=127.0.0.1",
                "--port=18888",
                f"--IdentityProvider.token={ARGV_SECRET}",
                "--password",
                ARGV_SECRET,
            ],
            "cwd": str(dl.tmp),
            "env": {"PATH": "/usr/bin:/bin", "JUPYTER_TOKEN": NOTEBOOK_SECRET},
            "slots": 0,
            "priority": 42,
            "name": "notebook :18888",
            "kind": "NOTEBOOK",
        },
    )
    dl.wait_job(int(job), "SCHEDULED")
    status, body = get("/api/commands")
    assert status == 200
    (row,) = [r for r in json.loads(body) if r["id"] == job]
    assert row["link"] == "http://127.0.0.1:18888/lab"
    assert "--IdentityProvider.token=***" in row["argv"] and "***" in row["argv"]
    assert row["kind"] == "NOTEBOOK" and row["state"] == "SCHEDULED"
    cli_rows = dl.json("cmd", "list", "--all")  # the CLI's --json: the same keys
    assert set(cli_rows[0]) == set(row)
    status, page = get("/commands")
    assert status == 200
    assert 'href="http://127.0.0.1:18888/lab"' in page and "det-local notebook start" in page
    # another user's server: a new tab with no handle on the dashboard's, no Referer (issue 34)
    assert '<a href="http://127.0.0.1:18888/lab" target="_blank" rel="noopener noreferrer">' in page
    for text in (body, page, json.dumps(cli_rows)):
        assert NOTEBOOK_SECRET not in text and ARGV_SECRET not in text
    dl.det("cmd", "kill", job)
    dl.wait_job(int(job), "DONE")
    assert json.loads(get("/api/commands")[1]) == []
    (ended,) = json.loads(get("/api/commands?all=1")[1])
    assert ended["link"] is None  # no address once it has ended


def test_a_server_on_the_dashboards_own_port_is_not_linked() -> None:
    """A command whose address is the dashboard's own port (its owner squatting it while the
    dashboard restarts) is shown as text: no link into the dashboard's origin (issue 34)."""
    from det_local.web.commands import _link

    row: dict[str, object] = {"link": "http://127.0.0.1:8080/", "kind": "TENSORBOARD"}
    shown = _link(row, 8080)
    assert "<a" not in shown and "not linked" in shown
    assert 'rel="noopener noreferrer"' in _link(row, 9090)
    assert "<a" in _link({**row, "link": "http://127.0.0.1:99999/"}, 8080)  # no such port


# ---------------------------------------------------------------------------- slots
def test_slots_usage_is_read_at_each_request(
    monkeypatch: pytest.MonkeyPatch, det_home: Path
) -> None:
    monkeypatch.delenv(hardware.FAKE_GPUS_ENV, raising=False)
    gpus = two_h100s()
    install(monkeypatch, FakeNvml(gpus))
    inv = hardware.discover()  # what the engine found at its start
    assert inv.slots[0].utilization_pct == 37
    gpus[0].util, gpus[0].used = 91, 40 * 1024 * 1024 * 1024
    gpus[1].util = None  # it stopped reporting: no stale figure
    stranger = os.getpid()  # not one of the engine's jobs: a foreign process
    gpus[0].compute = [stranger]
    rows = from_answer(engine_answer(inv, [])).rows()
    assert (rows[0]["utilization_pct"], rows[0]["memory_used_mb"]) == (91, 40 * 1024)
    assert rows[1]["utilization_pct"] is None
    assert [f["pid"] for f in rows[0]["foreign"]] == [stranger]
    # the page (no engine runs: discovered now, through the same NVML)
    status, page = get("/slots")
    assert status == 200 and "91%" in page and f"40960/{81920} MiB" in page
    assert f"pid {stranger}" in page


# ---------------------------------------------------------------------------- cluster
def test_cluster_without_a_daemon_says_how_to_start(det_home: Path) -> None:
    status, body = get("/api/peers")
    assert status == 503
    err = json.loads(body)["error"]
    assert "\n" not in err and "no det-local daemon is running" in err
    assert "det-local cluster init" in err
    status, page = get("/cluster")
    assert status == 200 and 'id="cluster-off"' in page and "det-local cluster init" in page


def test_cluster_without_a_key_says_federation_is_off(dl: Env) -> None:
    dl.daemon_start(DET_LOCAL_CPU_SLOTS="1", DET_LOCAL_CGROUPS="off", DET_LOCAL_MDNS="0")
    assert json.loads(get("/api/peers")[1]) == dl.json("cluster", "peers") == []
    view = json.loads(get("/api/cluster")[1])
    assert view["federation"] == "off" and view["why"]
    status, page = get("/cluster")
    assert "federation is off" in page and "det-local cluster init" in page


@pytest.fixture
def open_root() -> Iterator[Path]:
    """A directory the dashboard (run by a root daemon as nobody) can read."""
    base = Path(tempfile.mkdtemp(prefix="det-local-dcl-", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


FETCH = (  # GET argv[1] with the token the daemon wrote (argv[2]: its file)
    "import sys, urllib.request\n"
    "token = open(sys.argv[2]).read().strip()\n"
    "req = urllib.request.Request('http://127.0.0.1:%d' + sys.argv[1],\n"
    "                             headers={'Authorization': 'Bearer ' + token})\n"
    "with urllib.request.urlopen(req, timeout=10) as r:\n"
    "    sys.stdout.write(r.read().decode())\n"
)


@pytest.mark.netns
def test_cluster_page_of_a_two_node_federation(open_root: Path) -> None:
    import sys

    from tests.support.dashboard import free_port

    port = free_port()  # in node 1's namespace: any port is free there
    with Net(open_root) as net:
        (open_root / "home1").mkdir()
        (open_root / "home1" / "daemon.yaml").write_text(
            yaml.safe_dump({"dashboard": {"port": port}})
        )
        n1, n2 = two_nodes(net)

        def fetch(path: str) -> str:
            token = open_root / "home1" / "run" / "dashboard.token"
            r = n1.in_ns(sys.executable, "-c", FETCH % port, path, str(token))
            return r.stdout if r.returncode == 0 else ""

        wait_for(lambda: fetch("/api/peers"), timeout=30, what="node 1's dashboard")
        r = n1.cli(
            "cmd", "run", "--slots", "1", "--name", "on-n1", "--", "sleep", "60", user="root"
        )
        assert r.returncode == 0, r
        job = int(r.stdout.split()[2])

        def peers() -> dict[str, Any]:
            return {row["id"]: row for row in json.loads(fetch("/api/peers") or "[]")}

        rows = wait_for(
            lambda: (p := peers()) and [j["id"] for j in p["n1"]["jobs"]] == [job] and p,
            what="the command on node 1's row",
        )
        assert rows["n1"]["state"] == "self" and rows["n2"]["state"] == "alive"
        assert rows["n2"]["address"].startswith("10.77.0.2:")
        assert rows["n2"]["slots_total"] == 1 and rows["n2"]["jobs"] == []
        cli_rows = json.loads(n1.cli("cluster", "peers", "--json").stdout)
        assert set(cli_rows[0]) == set(rows["n1"])  # the CLI's --json: the same keys
        page = fetch("/cluster")
        assert 'id="peers"' in page and "10.77.0.2" in page and "alive" in page.lower()
        assert f"command {job} (" in page
        view = json.loads(fetch("/api/cluster"))
        assert view["federation"] == "on" and view["node"] == "n1" and view["live_peers"] == 1
    assert not [ns for ns in namespaces() if ns.startswith(net.prefix)]
