"""Faults of a trial across two machines (issue 14, "Faults" and "Control across nodes"): a rank
that fails, a member machine that dies just after its ranks, one that is SIGSTOPped, a link that
goes down for 20 s, and a more important local job on the member. Each machine is a real
`det-local daemon` in its own network namespace with one CPU slot (tests/support/fednet.py).

A machine lost stops every surviving rank within 15 s and requeues the trial from its latest
checkpoint without using `max_restarts` (0 here); a rank's own failure ends it in ERROR. The
non-chief rank reports a "member" metric carrying the run id it belongs to: a stale run's frame
accepted after a requeue would be recorded under the new run's id, so every such row must carry
the run id it is recorded under (fencing by run id).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from det_local.federate.peers import DEAD_S
from det_local.federate.verdict import CONFIRM_S
from tests.support.fednet import Net, Node
from tests.support.gangnet import (
    FAULT_SCRIPT,
    REQUEUED,
    checkpoints,
    db,
    exp_state,
    experiment,
    finished_once,
    member_jobs,
    pytestmark,  # noqa: F401  (root, iproute2; slow)
    rank_pids,
    restarts,
    resumed_after,
    submit,
    trial_log,
    two_nodes,
    wait_end,
)
from tests.support.world import gone, wait_for

__all__ = ["pytestmark"]


def fenced(node: Node) -> list[int]:
    """The run ids of the trial's "member" metrics; each was reported by the run it is
    recorded under (a stale run's frame was never applied to a newer run)."""
    with db(node) as conn:
        rows = conn.execute("SELECT run_id, metrics FROM metrics WHERE grp='member'").fetchall()
    assert rows
    for run_id, metrics in rows:
        assert json.loads(metrics)["run"] == run_id, (run_id, metrics)
    return sorted({r[0] for r in rows})


def survivors_stop(pids: list[int], t0: float, what: str) -> float:
    try:
        wait_for(lambda: all(gone(p) for p in pids), timeout=25, what=what)
    except AssertionError:
        left = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                left.append(f"{pid} ppid={proc.ppid()} {proc.status()} {proc.cmdline()}")
        pytest.fail(f"{what}: still there after 25 s: {left}")
    took = time.monotonic() - t0
    assert took <= 15.0, f"{what}: {took:.1f}s"
    return took


def requeued(n1: Node, exp_id: int) -> None:
    wait_for(lambda: REQUEUED in n1.log_text(), timeout=25, what="the requeue")
    assert exp_state(n1, exp_id) == "ACTIVE"
    assert restarts(n1) == 0


# ---------------------------------------------------------------------------- rank failures
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_failure_ends_the_trial_in_error_and_stops_the_other_machine(
    net: Net, tmp_path: Path, rank: int
) -> None:
    n1, n2 = two_nodes(net)
    env = {"STEPS": "30", "STEP_SLEEP": "0.3", "FAIL_RANK": str(rank), "FAIL_AT": "4"}
    cfg, ctx = experiment(tmp_path, FAULT_SCRIPT, env)
    exp_id = submit(n1, cfg, ctx)
    wait_for(lambda: checkpoints(n1, exp_id) >= 1, timeout=90, what="a checkpoint")
    wait_for(
        lambda: f"rank {rank} fails at step 4" in trial_log(n1, exp_id),
        timeout=30,
        what="the failure",
    )
    t0 = time.monotonic()
    assert wait_end(n1, n2, exp_id, timeout=60) == "ERROR"
    # decided once the other machine was known alive: a bounded wait, not a peer loss
    assert time.monotonic() - t0 <= DEAD_S + CONFIRM_S + 3.0
    assert REQUEUED not in n1.log_text()
    assert restarts(n1) == 0
    assert not rank_pids(n1) and not rank_pids(n2)
    ((state, code, _),) = member_jobs(n2)
    assert state == "DONE" and code != 0


def test_a_member_dying_just_after_its_ranks_is_a_machine_lost(net: Net, tmp_path: Path) -> None:
    """The race the bench found: the member's ranks die (and the owner's rank fails on its own
    from the reset connections) and its daemon reports them, then the daemon dies too. The
    machine was lost: requeued, not ERROR."""
    n1, n2 = two_nodes(net)
    cfg, ctx = experiment(tmp_path, FAULT_SCRIPT, {"STEPS": "20", "STEP_SLEEP": "0.3"})
    exp_id = submit(n1, cfg, ctx)
    wait_for(lambda: checkpoints(n1, exp_id) >= 2, timeout=90, what="two checkpoints")
    survivors = rank_pids(n1)
    for pid in rank_pids(n2):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    wait_for(
        lambda: "the trial's ranks on n2 exited with" in n1.log_text(),
        timeout=30,
        what="the member's report of its ranks' exit",
    )
    n2.signal_all(signal.SIGKILL)  # the machine goes down just after
    survivors_stop(survivors, t0, "the owner's ranks to stop")
    requeued(n1, exp_id)
    n2.start()
    assert wait_end(n1, n2, exp_id, timeout=150) == "COMPLETED"
    finished_once(n1, 20)
    assert resumed_after(n1, exp_id)[-1] >= 2


# ---------------------------------------------------------------------------- lost machines
def test_a_sigstopped_member_is_lost_then_fenced_when_it_wakes(net: Net, tmp_path: Path) -> None:
    n1, n2 = two_nodes(net)
    cfg, ctx = experiment(tmp_path, FAULT_SCRIPT, {"STEPS": "24", "STEP_SLEEP": "0.3"})
    exp_id = submit(n1, cfg, ctx)
    wait_for(lambda: checkpoints(n1, exp_id) >= 2, timeout=90, what="two checkpoints")
    survivors, stale = rank_pids(n1), rank_pids(n2)
    assert survivors and stale
    n2.signal_all(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        survivors_stop(survivors, t0, "the owner's ranks to stop")
        requeued(n1, exp_id)
    finally:
        n2.signal_all(signal.SIGCONT)
    # awake, the member finds its owner gone (or replaced by a newer run): its stale ranks stop
    wait_for(lambda: all(gone(p) for p in stale), timeout=30, what="the stale member's ranks")
    assert wait_end(n1, n2, exp_id, timeout=150) == "COMPLETED"
    finished_once(n1, 24)
    assert len(fenced(n1)) >= 2  # both runs reported; none under another run's id
    starts = resumed_after(n1, exp_id)
    assert starts[0] == 0 and starts[-1] >= 2, starts


def test_a_link_down_for_20s_stops_both_sides_and_the_stale_run_never_commits(
    net: Net, tmp_path: Path
) -> None:
    n1, n2 = two_nodes(net)
    cfg, ctx = experiment(tmp_path, FAULT_SCRIPT, {"STEPS": "24", "STEP_SLEEP": "0.3"})
    exp_id = submit(n1, cfg, ctx)
    wait_for(lambda: checkpoints(n1, exp_id) >= 2, timeout=90, what="two checkpoints")
    owner_ranks, member_ranks = rank_pids(n1), rank_pids(n2)
    assert owner_ranks and member_ranks
    net.link(2, False)
    t0 = time.monotonic()
    try:
        survivors_stop(owner_ranks, t0, "the owner's ranks to stop")
        survivors_stop(member_ranks, t0, "the member's ranks to stop (its owner lost)")
        requeued(n1, exp_id)
        wait_for(lambda: member_jobs(n2) and member_jobs(n2)[0][0] == "DONE", timeout=30)
        assert "n1 was lost" in member_jobs(n2)[0][2], member_jobs(n2)
        with db(n1) as conn:
            during = conn.execute("SELECT COUNT(*) FROM metrics").fetchone()[0]
        time.sleep(max(0.0, t0 + 20.0 - time.monotonic()))  # the partition lasts 20 s
    finally:
        net.link(2, True)
    assert wait_end(n1, n2, exp_id, timeout=150) == "COMPLETED"
    finished_once(n1, 24)
    runs = fenced(n1)
    assert len(runs) >= 2, runs
    assert during > 0


# ---------------------------------------------------------------------------- control
def test_a_more_important_job_on_the_member_preempts_the_whole_gang_by_checkpoint(
    net: Net, tmp_path: Path
) -> None:
    n1, n2 = two_nodes(net)
    cfg, ctx = experiment(tmp_path, FAULT_SCRIPT, {"STEPS": "24", "STEP_SLEEP": "0.3"})
    exp_id = submit(n1, cfg, ctx)
    wait_for(lambda: checkpoints(n1, exp_id) >= 2, timeout=90, what="two checkpoints")
    ranks = rank_pids(n1) + rank_pids(n2)
    marker = tmp_path / "local-job-ran"
    res = n2.cli(
        "cmd", "run", "--priority", "10", "--", "sh", "-c", f"touch {marker}; sleep 4", user="root"
    )
    assert res.returncode == 0, res.stderr
    t0 = time.monotonic()
    wait_for(lambda: all(gone(p) for p in ranks), timeout=40, what="every rank to stop")
    assert time.monotonic() - t0 <= 15.0
    log = trial_log(n1, exp_id)
    at = re.findall(r"rank 0 preempted at (\d+)", log)
    assert at and re.findall(r"rank 1 preempted at (\d+)", log) == at, log[-3000:]
    with db(n1) as conn:
        latest = conn.execute("SELECT MAX(steps_completed) FROM checkpoints").fetchone()[0]
    assert latest == int(at[0])  # preempted by checkpoint, not killed
    assert exp_state(n1, exp_id) == "ACTIVE" and restarts(n1) == 0
    assert member_jobs(n2)[0][:2] == ("DONE", 0)
    wait_for(marker.exists, timeout=20, what="the local job to start")
    assert wait_end(n1, n2, exp_id, timeout=150) == "COMPLETED"
    with db(n2) as conn:
        cmd = conn.execute("SELECT ended_at FROM jobs WHERE kind='COMMAND'").fetchone()[0]
        member = conn.execute(
            "SELECT started_at FROM jobs WHERE kind='MEMBER' ORDER BY id DESC"
        ).fetchone()[0]
    assert member >= cmd - 0.5  # the gang was placed again once the local job had ended
    finished_once(n1, 24)
    assert resumed_after(n1, exp_id)[-1] == int(at[0])
