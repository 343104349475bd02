"""A machine that dies and comes back is a lost machine, whatever the timing (issue 25, item
4): every process of the member (its daemon and its ranks) is killed -9 and its daemon is
started again after 1.5 s, 5 s (and 30 s, slow); the restarted daemon finds its share's ranks
gone and reports the share lost to the owner at once; the owner requeues the trial from its
latest checkpoint without spending max_restarts (0 here), and the experiment COMPLETES."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.support.fednet import Net
from tests.support.gangnet import (
    FAULT_SCRIPT,
    REQUEUED,
    checkpoints,
    experiment,
    finished_once,
    member_jobs,
    pytestmark,  # noqa: F401  (root, iproute2; slow)
    rank_pids,
    resumed_after,
    submit,
    two_nodes,
    wait_end,
)
from tests.support.world import wait_for


@pytest.mark.parametrize(
    "away_s", [1.5, 5.0, pytest.param(30.0, marks=pytest.mark.slow, id="30.0")]
)
def test_a_member_killed_whole_and_restarted_is_a_lost_machine(
    net: Net,
    tmp_path: Path,
    away_s: float,
) -> None:
    n1, n2 = two_nodes(net)
    cfg, ctx = experiment(tmp_path, FAULT_SCRIPT, {"STEPS": "30", "STEP_SLEEP": "0.3"})
    exp_id = submit(n1, cfg, ctx)
    wait_for(lambda: checkpoints(n1, exp_id) >= 2, timeout=90, what="two checkpoints")
    assert rank_pids(n2)
    n2.signal_all(signal.SIGKILL)  # the machine dies: its daemon and its ranks
    assert n2.proc is not None
    n2.proc.wait(10)
    t0 = time.monotonic()
    wait_for(lambda: not n2.pids(), timeout=10, what="every process of n2 gone")
    left = away_s - (time.monotonic() - t0)
    if left > 0:
        time.sleep(left)  # the scenario: how long the machine stays down (as systemd would)
    n2.start()
    assert wait_end(n1, n2, exp_id, timeout=180) == "COMPLETED"
    text = n1.log_text()
    assert REQUEUED in text, text[-4000:]
    if away_s < 10.0:  # back inside the reattach window: its own report said lost
        assert "restarted and its ranks of gang" in n2.log_text(), n2.log_text()[-3000:]
    finished_once(n1, 30)  # no restart spent (max_restarts 0), every step once per run
    assert resumed_after(n1, exp_id)[-1] >= 2  # from its checkpoint, not from scratch
    states = [state for state, _code, _msg in member_jobs(n2)]
    assert states and all(s == "DONE" for s in states), member_jobs(n2)
