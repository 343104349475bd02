"""Which node of a multi-node Slurm trial failed first (`slurm/rankexit.py`): each node's step
(`slurm/node.py`) writes its own exit; the batch shell and the daemon pick the earliest failure
of a node that was not stopped. For real over two Slurm nodes:
tests/slurm/test_slurm_nodes.py::test_two_node_trials_killed_or_failing_leave_nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from det_local.slurm import rankexit
from tests.support.world import wait_for

PY = sys.executable


def node_env(info: Path, node_rank: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(DET_LOCAL_INFO_DIR=str(info), SLURM_JOB_ID="77", SLURM_NODEID=str(node_rank))
    return env


def test_a_node_step_records_its_launchers_exit(tmp_path: Path) -> None:
    r = subprocess.run(
        [PY, "-m", "det_local.slurm.node", "--", "sh", "-c", "exit 3"],
        env=node_env(tmp_path, 1),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 3, r
    data = json.loads((tmp_path / "slurm-rank-exit.77.1").read_text())
    assert data["code"] == 3 and data["node_rank"] == 1 and data["stopped"] is False
    assert data["rank"] is None and data["node"] == os.uname().nodename
    assert [p.name for p in tmp_path.iterdir()] == ["slurm-rank-exit.77.1"]  # no temporary left


def test_a_node_step_stopped_by_srun_says_so(tmp_path: Path) -> None:
    """srun stops a node's step with SIGTERM: forwarded to the launcher, recorded as stopped."""
    ready = tmp_path / "ready"
    script = f"trap 'exit 143' TERM; touch {ready}; while :; do sleep 0.1; done"
    proc = subprocess.Popen(
        [PY, "-m", "det_local.slurm.node", "--", "sh", "-c", script], env=node_env(tmp_path, 0)
    )
    wait_for(ready.exists, timeout=60, what="the launcher to start")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    record = rankexit.read_all(str(tmp_path), 77)
    assert [(r.node_rank, r.code, r.stopped) for r in record] == [(0, 143, True)]


def test_a_node_whose_rank_failed_before_srun_stopped_it_keeps_its_own_code(
    tmp_path: Path,
) -> None:
    """Its launcher's supervisor wrote rank 1's failure (status 3) before srun's SIGTERM came:
    the node failed on its own, with that rank's code, not the launcher's 143 once stopped."""
    ready = tmp_path / "ready"
    script = (
        'printf "1 3 %s\\n" "$(date +%s.%N)" > "$DET_LOCAL_FIRST_FAILURE"; '
        f"trap 'exit 143' TERM; touch {ready}; while :; do sleep 0.1; done"
    )
    proc = subprocess.Popen(
        [PY, "-m", "det_local.slurm.node", "--", "sh", "-c", script], env=node_env(tmp_path, 1)
    )
    wait_for(ready.exists, timeout=60, what="the launcher to start")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 3
    (record,) = rankexit.read_all(str(tmp_path), 77)
    assert (record.node_rank, record.rank, record.code, record.stopped) == (1, 1, 3, False)


def test_the_first_failure_is_the_earliest_of_a_node_not_stopped() -> None:
    def rec(node_rank: int, code: int, at: float, stopped: bool = False) -> rankexit.NodeExit:
        return rankexit.NodeExit(f"n{node_rank}", node_rank, code, None, stopped, at)

    # node 0 stopped by srun (143, though its record is earlier), node 2 failed as a consequence
    records = [rec(0, 143, 1.0, True), rec(1, 3, 2.0), rec(2, 1, 3.0), rec(3, 0, 0.5)]
    assert rankexit.first_failure(records) == records[1]
    assert rankexit.first_failure([rec(0, 143, 2.0, True), rec(1, 137, 1.0, True)]) == rec(
        1, 137, 1.0, True
    )  # all stopped: the earliest
    assert rankexit.first_failure([rec(0, 0, 1.0), rec(1, 0, 1.0)]) is None
    first = rankexit.NodeExit("dln2", 1, 3, 1, False, 1.0)
    assert first.describe(12) == "rank 1 on node dln2 (node rank 1 of Slurm job 12) failed first"
    assert records[1].describe(12) == "node n1 (node rank 1 of Slurm job 12) failed first"


def test_the_batch_shell_exits_with_the_first_failing_nodes_code(tmp_path: Path) -> None:
    for node_rank, code, stopped, at in ((0, 143, True, 5.0), (1, 3, False, 6.0)):
        record = rankexit.NodeExit(f"dln{node_rank + 1}", node_rank, code, 1, stopped, at)
        rankexit.write(str(tmp_path), 77, record)
    env = {**node_env(tmp_path, 0), "SLURM_JOB_NUM_NODES": "2"}
    r = subprocess.run(
        [PY, "-m", "det_local.slurm.rankexit", "143"], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stdout == "3\n", r
    assert r.stderr == (
        "det-local: rank 1 on node dln2 (node rank 1 of Slurm job 77) failed first: exited with "
        "code 3\n"
    )
    # nothing recorded (or a success): the status as it was
    r = subprocess.run(
        [PY, "-m", "det_local.slurm.rankexit", "0"], env=env, capture_output=True, text=True
    )
    assert r.stdout == "0\n" and r.stderr == "", r
    (tmp_path / "slurm-rank-exit.77.0").unlink()
    (tmp_path / "slurm-rank-exit.77.1").unlink()
    r = subprocess.run(
        [PY, "-m", "det_local.slurm.rankexit", "143"], env=env, capture_output=True, text=True
    )
    assert r.stdout == "143\n" and r.stderr == "", r


def test_hostile_rank_exit_files_are_ignored(tmp_path: Path) -> None:
    """The run's user writes these files: a link, a FIFO, a huge or malformed file, a record
    claiming another node rank are skipped; a node's name is cut to printable characters."""
    secret = tmp_path / "secret"
    secret.write_text(json.dumps({"node": "x", "node_rank": 0, "code": 9}))
    os.symlink(secret, tmp_path / "slurm-rank-exit.5.0")
    os.mkfifo(tmp_path / "slurm-rank-exit.5.1")
    (tmp_path / "slurm-rank-exit.5.2").write_text(" " * 5000 + "{}")
    (tmp_path / "slurm-rank-exit.5.3").write_text("{not json")
    (tmp_path / "slurm-rank-exit.5.4").write_text(
        json.dumps({"node": "a", "node_rank": 0, "code": 1})
    )
    good = {"node": "evil\x1b[2Jname" + "x" * 100, "node_rank": 5, "code": 4, "rank": "2"}
    (tmp_path / "slurm-rank-exit.5.5").write_text(json.dumps(good))
    (only,) = rankexit.read_all(str(tmp_path), 5, 8)
    assert only.node_rank == 5 and only.code == 4 and only.rank == 2
    assert only.node.startswith("evil[2Jname") and len(only.node) <= 64
