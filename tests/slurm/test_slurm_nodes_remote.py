"""A trial over two Slurm nodes that are not the daemon's host: each slurmd in its own network
namespace and hostname (tests/support/slurmnodes.py) with an empty tmpfs over every test's
directory (the daemon's home and socket among them), so the ranks reach the daemon only over
the pool's TCP channel, on the host's bridge address, and see only the shared directory
(stage_dir, checkpoints): the issue's daemon on a login node with jobs on compute nodes."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from det_local.store.states import State
from tests.support import slurmkit, slurmnodes
from tests.support.trials.nodes import CORE, core_config, core_lines
from tests.support.world import Env, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.netns]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurmnodes.Nodes]:
    reason = slurmnodes.skip_reason()
    if reason:
        pytest.skip(reason)
    hidden = tmp_path_factory.getbasetemp()
    root = Path(tempfile.mkdtemp(prefix="det-local-slurmn-", dir="/tmp"))
    root.chmod(0o755)
    try:
        with slurmnodes.cluster(root, hide=(hidden,)) as cluster:
            yield cluster
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_two_node_trial_reports_over_the_tcp_channel(dl: Env, slurm: slurmnodes.Nodes) -> None:
    shared = Path(tempfile.mkdtemp(prefix="shared-", dir=slurm.root))
    for sub in ("", "stage", "ckpts"):
        (shared / sub).mkdir(exist_ok=True)
        os.chmod(shared / sub, 0o1777)
    (port,) = slurmkit._free_ports(1)
    pool = {
        "partition": "debug",
        "slots_per_node": 1,
        "channel": {"listen": f"{slurm.host_addr}:{port}"},
        "stage_dir": str(shared / "stage"),
    }
    dl.daemon_start({"resource_pools": {"hpc": {"slurm": pool}}}, SLURM_CONF=str(slurm.conf))
    probe = (
        "import os, sys\n"
        f"print('SEES_HOME', os.path.exists({str(dl.home)!r}), os.environ['DET_LOCAL_SOCKET'],"
        " flush=True)\n"
    )
    cfg = {
        **core_config({"batches": 8, "ckpt_every": 4, "hold_at": 0}),
        "checkpoint_storage": {"type": "shared_fs", "host_path": str(shared / "ckpts")},
    }
    cfg_path, ctx = dl.context(probe + CORE, cfg)
    r = dl.det("run", cfg_path, ctx, timeout=300)
    assert r.rc == 0 and "COMPLETED" in r.out, (r, slurm.logs())
    trial = dl.store().get_trial(1)
    assert trial.state == State.COMPLETED and trial.steps_completed == 8
    assert dl.metrics(1, "validation")[-1].metrics["x"] == 2 * sum(range(1, 9))
    assert [c.steps_completed for c in dl.checkpoints(1)] == [4, 8]
    logs = dl.det("trial", "logs", 1).out
    lines = core_lines(logs)
    assert sorted((d["rank"], d["host"]) for d in lines) == [("0", "dln1"), ("1", "dln2")], logs
    assert {d["hosts"] for d in lines} == {"dln1,dln2"}
    sees = [line.split("SEES_HOME ", 1)[1] for line in logs.splitlines() if "SEES_HOME " in line]
    channel = f"tcp://{slurm.host_addr}:{port}"
    assert sees == [f"False {channel}"] * 2, sees  # neither node sees the daemon's files
    assert slurm.queue() == []
    wait_for(lambda: list((shared / "stage").iterdir()) == [], timeout=30, what="stage cleanup")
    shutil.rmtree(shared, ignore_errors=True)
