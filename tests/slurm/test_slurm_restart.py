"""Slurm pools across a daemon restart with slurmctld down around it (helpers:
tests/support/slurmctl.py): a job sbatch made as the daemon died is adopted by its name; a
restart while slurmctld is down does not submit that run twice; a pause pending at the restart
cancels a job still PENDING at once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from det_local.store.states import State
from tests.support import slurmkit
from tests.support.slurmctl import (
    HPC,
    check_exact,
    daemon_events,
    job_fields,
    slurm_id,
    start_daemon,
    start_slurmctld,
    stop_slurmctld,
    submissions,
)
from tests.support.world import Env, gone, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurmkit.Slurm]:
    yield from slurmkit.slurm_fixture(tmp_path_factory)


def test_a_pause_pending_at_a_restart_cancels_a_job_still_pending_at_once(
    dl: Env, slurm: slurmkit.Slurm
) -> None:
    """Paused while slurmctld is down (its scancel cannot get through) and the daemon killed:
    the restarted daemon finds the experiment STOPPING_PAUSED and its job still PENDING in
    Slurm, and cancels it at once, as a live pause of a pending job does, instead of waiting
    the experiment's preemption_timeout (120 s here) for a checkpoint nobody can take."""
    import psutil

    start_daemon(dl, slurm)
    # the only node is taken whole: the trial's job waits in Slurm's queue
    blocker = slurm.run(
        "sbatch", "--parsable", "--exclusive", "-p", "debug", "-o", "/dev/null", "--wrap",
        "sleep 600",
    ).stdout.strip()  # fmt: skip
    try:
        wait_for(lambda: blocker in slurm.queue(), what="the blocking job")
        hp = {"batches": 6, "ckpt_every": 3, "record": str(dl.record_path)}
        cfg, ctx = dl.trainer(hp, {**HPC, "preemption_timeout": 120})
        assert dl.det("run", "--detach", cfg, ctx).rc == 0
        wait_for(lambda: slurm_id(dl, 1) > 0, timeout=60, what="the trial's job")
        job = slurm_id(dl, 1)
        assert job_fields(slurm, job)["JobState"] == "PENDING"
        stop_slurmctld(slurm)
        try:
            assert dl.det("experiment", "pause", 1).out.strip() == "experiment 1 paused"
            assert dl.experiment(1).state == State.STOPPING_PAUSED
            daemon = psutil.Process(dl.daemon_pid())
            wait_for(
                lambda: [p for p in daemon.children(recursive=True) if p.name() == "scancel"],
                timeout=30,
                what="the daemon's scancel",
            )
            kids = [p.pid for p in daemon.children(recursive=True) if p.name() == "scancel"]
            dl.kill_daemon()
            for pid in kids:  # its orphaned scancel gives up while slurmctld is down
                wait_for(lambda pid=pid: gone(pid), timeout=60, what="the orphaned scancel")
        finally:
            start_slurmctld(slurm)
        assert job_fields(slurm, job)["JobState"] == "PENDING"  # nothing reached Slurm
        began = time.monotonic()
        start_daemon(dl, slurm)
        wait_for(lambda: str(job) not in slurm.queue(), timeout=60, what="the job to go")
        took = time.monotonic() - began
        assert took < 20, f"the pending job left squeue {took:.1f}s after the restart"
        wait_for(lambda: dl.experiment(1).state == State.PAUSED, timeout=30, what="PAUSED")
        assert (
            f"trial 1: Slurm job {job} has not started yet: cancelled now (nothing to checkpoint)"
            in dl.events(1)
        )
        assert dl.records() == []  # it never ran
    finally:
        slurm.run("scancel", blocker, check=False)
    wait_for(lambda: blocker not in slurm.queue(), what="the blocker to go")
    assert dl.det("experiment", "activate", 1).rc == 0
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=90, what="completion")
    check_exact(dl, 1, 6)
    assert [r["start"] for r in dl.records()] == [0]


def test_a_job_sbatch_made_as_the_daemon_died_is_adopted_by_name(
    dl: Env, slurm: slurmkit.Slurm
) -> None:
    """The daemon is killed while a trial's sbatch is being tried (slurmctld down), and that
    sbatch goes on to make the job: the restarted daemon finds the job by its name and its
    output file in this home, and follows it; the trial is not submitted a second time."""
    import psutil

    name = "det-local_e1_t1_r1"
    others = slurm.run("squeue", "-h", "-t", "all", "-n", name, "-o", "%i").stdout.split()
    start_daemon(dl, slurm)
    # the job will wait in Slurm's queue until the daemon is back (its node drained)
    slurm.run("scontrol", "update", "NodeName=n1", "State=DRAIN", "Reason=test")
    stop_slurmctld(slurm)
    try:
        hp = {"batches": 6, "ckpt_every": 3, "record": str(dl.record_path)}
        cfg, ctx = dl.trainer(hp, HPC)
        assert dl.det("run", "--detach", cfg, ctx).rc == 0
        daemon = psutil.Process(dl.daemon_pid())
        pid = wait_for(lambda: _sbatch(daemon), timeout=60, what="the daemon's sbatch")
        dl.kill_daemon()
    finally:
        start_slurmctld(slurm)
    try:
        wait_for(lambda: gone(pid), timeout=60, what="the orphaned sbatch to end")
        listed = slurm.run("squeue", "-h", "-n", name, "-o", "%i").stdout.split()
        (made,) = set(listed) - set(others)  # earlier tests' homes had a job of that name
        assert slurm_id(dl, 1) == 0  # the daemon never learnt it
        start_daemon(dl, slurm)
        wait_for(lambda: slurm_id(dl, 1) == int(made), timeout=30, what="the job adopted")
    finally:
        slurm.run("scontrol", "update", "NodeName=n1", "State=RESUME", check=False)
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=90, what="completion")
    check_exact(dl, 1, 6)
    assert f"adopted trial job 1 (pid {made}) still running" in daemon_events(dl)
    assert submissions(dl) == 1 and [r["start"] for r in dl.records()] == [0]
    listed = slurm.run("squeue", "-h", "-t", "all", "-n", name, "-o", "%i").stdout.split()
    assert set(listed) - set(others) == {made}  # one job for the trial: not submitted again


def test_a_restart_while_slurmctld_is_down_does_not_submit_the_run_twice(
    dl: Env, slurm: slurmkit.Slurm
) -> None:
    """The daemon is killed while a trial's sbatch is being tried (slurmctld down) and comes
    back before slurmctld does: it cannot ask Slurm whether that sbatch made a job, so it holds
    the run, asking again off its loop, instead of queueing it again; once slurmctld answers
    the trial runs in exactly one Slurm job (the orphaned sbatch's, or, when that one never
    reached Slurm, one new submission), once."""
    import psutil

    names = [f"det-local_e1_t1_r{i}" for i in (1, 2, 3)]

    def jobs_named() -> set[str]:
        out = slurm.run("squeue", "-h", "-t", "all", "-n", ",".join(names), "-o", "%i").stdout
        return set(out.split())

    others = jobs_named()  # earlier tests' homes had jobs of those names
    start_daemon(dl, slurm)
    slurm.run("scontrol", "update", "NodeName=n1", "State=DRAIN", "Reason=test")
    stop_slurmctld(slurm)
    try:
        hp = {"batches": 6, "ckpt_every": 3, "record": str(dl.record_path)}
        cfg, ctx = dl.trainer(hp, HPC)
        assert dl.det("run", "--detach", cfg, ctx).rc == 0
        daemon = psutil.Process(dl.daemon_pid())
        wait_for(lambda: _sbatch(daemon), timeout=60, what="the daemon's sbatch")
        dl.kill_daemon()
        start_daemon(dl, slurm)  # slurmctld still down
        held = "whether the sbatch under way when the daemon stopped made a job"
        wait_for(
            lambda: any(held in e for e in daemon_events(dl)),
            timeout=90,
            what=f"the run held\n{daemon_events(dl)}",
        )
        again = psutil.Process(dl.daemon_pid())
        began = time.monotonic()
        while time.monotonic() - began < 5:  # nothing submitted while Slurm cannot tell
            assert _sbatch(again) == 0
            time.sleep(0.2)
        assert slurm_id(dl, 1) == 0
    finally:
        start_slurmctld(slurm)
        slurm.run("scontrol", "update", "NodeName=n1", "State=RESUME", check=False)
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=180, what="completion")
    check_exact(dl, 1, 6)
    assert [r["start"] for r in dl.records()] == [0]  # trained once, from the start
    assert len(jobs_named() - others) == 1, (jobs_named() - others, daemon_events(dl))


def test_finding_an_unrecorded_job_waits_for_slurm_and_confirms_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`submitter.find` (a restart's question "did that sbatch make a job?"): asked again while
    slurmctld does not answer; "none" believed only when said twice CONFIRM_S apart; a job id
    is watched; an outage longer than the budget is one line, nothing submitted."""
    from det_local.slurm import client, submitter

    monkeypatch.setattr(submitter, "RETRY_DELAYS_S", (0.01,))
    monkeypatch.setattr(submitter, "CONFIRM_S", 0.2)

    def scripted(*answers: int | None) -> Any:
        calls: list[float] = []

        def lookup() -> int:
            calls.append(time.monotonic())
            answer = answers[min(len(calls), len(answers)) - 1]
            if answer is None:
                raise client.Unreachable("squeue failed: Unable to contact slurm controller")
            return answer

        return lookup, calls

    watched: list[int] = []
    lookup, calls = scripted(None, None, 42)
    sub = submitter.find(lookup, watched.append)
    assert sub.done.wait(10) and sub.job_id == 42 and watched == [42] and len(calls) == 3
    assert not sub.absent and sub.error is None

    lookup, calls = scripted(None, 0, 0)
    sub = submitter.find(lookup, watched.append)
    assert sub.done.wait(10) and sub.absent and sub.job_id is None
    assert len(calls) == 3 and calls[2] - calls[1] >= 0.2  # "none" twice, CONFIRM_S apart

    lookup, calls = scripted(None, 0, 7)  # the orphaned sbatch got through meanwhile
    sub = submitter.find(lookup, watched.append)
    assert sub.done.wait(10) and sub.job_id == 7 and not sub.absent

    lookup, calls = scripted(None)
    sub = submitter.find(lookup, watched.append, budget_s=0.1)
    assert sub.done.wait(10) and sub.job_id is None and not sub.absent
    assert sub.error == (
        "squeue failed: Unable to contact slurm controller (Slurm's controller did not answer "
        "for 0s): whether the run's sbatch, under way when the daemon stopped, made a job is "
        "unknown; the trial is not submitted again (scancel that job if squeue shows it)"
    ), sub.error


def _sbatch(daemon: Any) -> int:
    """The pid of an sbatch the daemon (a psutil.Process) is running, 0 when none."""
    kids = daemon.children(recursive=True)
    return next((p.pid for p in kids if p.name() == "sbatch"), 0)
