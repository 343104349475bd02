"""One trial across two machines (cross-machine gangs), each machine a real `det-local daemon`
in its own network namespace with one CPU slot, joined by a cluster key and a static peer.

The trial asks for 2 slots: its ranks run on both machines under torch.distributed.run with
--nnodes 2; the owner (n1) records its metrics and checkpoints and shows every rank's log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from tests.support.fednet import Net
from tests.support.gangnet import (  # noqa: F401
    alive,
    checkpoints,
    db,
    exp_state,
    experiment,
    ns_pids,
    pytestmark,
    rank_pids,
    relayed,
    submit,
    trial_log,
    two_nodes,
    wait_end,
)
from tests.support.world import gone, wait_for


def test_core_api_trial_across_two_machines(net: Net, tmp_path: Path) -> None:
    n1, n2 = two_nodes(net)
    # refused before anything starts: a size no set of machines fits; storage not shared
    cfg, ctx = experiment(tmp_path, resources={"slots_per_trial": 3})
    res = n1.cli("run", "--detach", str(cfg), str(ctx))
    assert res.returncode != 0 and "3 slots cannot be fitted" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    cfg, ctx = experiment(
        tmp_path, checkpoint_storage={"type": "directory", "container_path": "/tmp"}
    )
    res = n1.cli("run", "--detach", str(cfg), str(ctx))
    assert "needs type shared_fs" in res.stderr, res.stderr
    cfg, ctx = experiment(tmp_path)
    exp_id = submit(n1, cfg, ctx)
    wait_end(n1, n2, exp_id, timeout=90)
    log = trial_log(n1, exp_id)
    assert exp_state(n1, exp_id) == "COMPLETED", log + n1.log_text() + n2.log_text()
    # ranks 0 and 1 on different nodes, collectives right, both ranks' output on the owner
    assert "RESULT rank=0 size=2 cross=0 nodes=['0', '1'] word=from-chief sum=3.0" in log
    assert "RESULT rank=1 size=2 cross=1 nodes=['0', '1'] word=from-chief sum=3.0" in log
    assert "[rank=1]" in log and "[rank=0]" in log
    with db(n1) as conn:
        metrics = conn.execute("SELECT COUNT(*) FROM metrics").fetchone()[0]
        ckpts = conn.execute("SELECT COUNT(*) FROM checkpoints").fetchone()[0]
    assert metrics >= 4 and ckpts == 3  # checkpoint GC keeps the best one; all are recorded
    # the member's share ran as an ordinary job of n2's queue, and is done
    with db(n2) as conn:
        rows = conn.execute("SELECT kind, state, exit_code FROM jobs").fetchall()
    assert rows == [("MEMBER", "DONE", 0)], rows


def test_member_killed_mid_training_requeues_without_using_max_restarts(
    net: Net, tmp_path: Path
) -> None:
    n1, n2 = two_nodes(net)
    cfg, ctx = experiment(tmp_path, env={"STEPS": "40", "STEP_SLEEP": "0.4"})
    exp_id = submit(n1, cfg, ctx)
    wait_for(lambda: checkpoints(n1, exp_id) >= 2, timeout=90, what="two checkpoints")
    relayed(n1, exp_id)  # counted at the end: what n2 had not relayed would die with it
    survivors = rank_pids(n1)
    assert survivors
    t0 = time.monotonic()
    for pid in ns_pids(n2):  # the member's daemon and its ranks, kill -9
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_for(lambda: all(gone(p) for p in survivors), timeout=20, what="the owner's ranks to stop")
    stopped = time.monotonic() - t0
    assert stopped <= 15.0, stopped
    # requeued (waiting for a second machine), not failed; max_restarts (0) untouched
    wait_for(
        lambda: "does not count toward max_restarts" in n1.log_text(),
        timeout=20,
        what="the requeue",
    )
    assert exp_state(n1, exp_id) == "ACTIVE"
    with db(n1) as conn:
        restarts = conn.execute("SELECT restarts FROM trials").fetchone()[0]
    assert restarts == 0
    res = n1.cli("job", "list")
    assert "waiting for machines" in res.stdout or "QUEUED" in res.stdout, res.stdout
    # the machine comes back: the trial is placed again and resumes from its checkpoint
    n2.start()
    assert wait_end(n1, n2, exp_id, timeout=150) == "COMPLETED"
    log = trial_log(n1, exp_id)
    assert log.count("RESULT rank=1") == 2  # two placements, each with a rank on n2
    with db(n1) as conn:
        steps = [r[0] for r in conn.execute("SELECT steps_completed FROM metrics")]
    assert max(steps) == 40


def test_pause_and_activate_reach_every_node(net: Net, tmp_path: Path) -> None:
    n1, n2 = two_nodes(net)
    cfg, ctx = experiment(tmp_path, env={"STEPS": "30", "STEP_SLEEP": "0.3"})
    exp_id = submit(n1, cfg, ctx)
    wait_for(lambda: checkpoints(n1, exp_id) >= 1, timeout=90, what="a checkpoint")
    res = n1.cli("experiment", "pause", str(exp_id))
    assert res.returncode == 0, res.stderr
    wait_for(lambda: exp_state(n1, exp_id) == "PAUSED", timeout=40, what="paused")
    assert "preempted at" in trial_log(n1, exp_id)
    with db(n2) as conn:
        rows = conn.execute("SELECT state FROM jobs").fetchall()
    assert rows == [("DONE",)], rows
    assert not rank_pids(n1) and not rank_pids(n2)
    res = n1.cli("experiment", "activate", str(exp_id))
    assert res.returncode == 0, res.stderr
    assert wait_end(n1, n2, exp_id, timeout=150) == "COMPLETED"
    with db(n1) as conn:
        steps = [r[0] for r in conn.execute("SELECT steps_completed FROM metrics")]
        restarts = conn.execute("SELECT restarts FROM trials").fetchone()[0]
    assert max(steps) == 30 and restarts == 0


def test_two_owners_place_two_machine_gangs_at_once(net: Net, tmp_path: Path) -> None:
    n1, n2 = two_nodes(net)
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    cfg_a, ctx_a = experiment(a_dir, env={"STEPS": "3", "STEP_SLEEP": "0.5"})
    cfg_b, ctx_b = experiment(b_dir, env={"STEPS": "3", "STEP_SLEEP": "0.5"})
    import threading

    ids: dict[str, int] = {}
    threads = [
        threading.Thread(target=lambda: ids.__setitem__("a", submit(n1, cfg_a, ctx_a))),
        threading.Thread(target=lambda: ids.__setitem__("b", submit(n2, cfg_b, ctx_b))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wait_end(n1, n2, ids["a"], timeout=200) == "COMPLETED"
    assert wait_end(n2, n1, ids["b"], timeout=200) == "COMPLETED"
    # one order everywhere: the gangs ran one after the other, never both holding a machine
    with db(n1) as conn:
        a = conn.execute("SELECT started_at, ended_at FROM jobs WHERE kind='TRIAL'").fetchone()
    with db(n2) as conn:
        b = conn.execute("SELECT started_at, ended_at FROM jobs WHERE kind='TRIAL'").fetchone()
    first, second = sorted([a, b])
    assert first[1] <= second[0] + 0.5, (a, b)
