"""Slurm pools, control details against a real single-host Slurm (tests/slurmkit.py): Slurm's
own time-limit timer, pausing a job still pending in Slurm, sbatch while slurmctld is down
(retried; a permanent error at once; the retry budget), the poller while slurmctld is down, and
a pool removed from daemon.yaml while its jobs run. What a restart finds:
tests/slurm/test_slurm_restart.py."""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Iterator

import pytest

from det_local.store.states import State
from tests.support import slurmkit
from tests.support.slurmctl import (
    HPC,
    check_exact,
    daemon_events,
    job_fields,
    pools,
    slurm_id,
    start_daemon,
    start_slurmctld,
    stop_slurmctld,
    submissions,
)
from tests.support.world import Env, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurmkit.Slurm]:
    yield from slurmkit.slurm_fixture(tmp_path_factory)


def test_slurms_own_timer_signal_checkpoints_before_the_limit(
    dl: Env, slurm: slurmkit.Slurm
) -> None:
    """--time=1 with signal_lead 10: Slurm 22.05 looks at time limits every 30 s and sends
    the signal at the first look within signal_lead + 30 s of the limit, so it comes 20-50 s
    into each job. 60 s of training cannot finish in one job: the first checkpoints at the
    signal and ends before its limit (COMPLETED, not TIMEOUT); a second job continues."""
    start_daemon(dl, slurm, pools(sbatch_args=["--time=1"], signal_lead=10))
    hp = {"batches": 120, "ckpt_every": 10, "delay": 0.5, "record": str(dl.record_path)}
    cfg, ctx = dl.trainer(hp, {**HPC, "max_restarts": 0})
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(lambda: slurm_id(dl, 1) > 0, timeout=60, what="the first job")
    first = slurm_id(dl, 1)
    wait_for(lambda: slurm_id(dl, 1) != first, timeout=90, what="a second job")
    fields = job_fields(slurm, first)
    assert fields["JobState"] == "COMPLETED", fields  # it ended itself, before its limit
    assert fields["TimeLimit"] == "00:01:00"
    ran = _seconds(fields["RunTime"])
    assert 15 <= ran < 60, fields  # the signal came from Slurm's timer, 20-50 s in
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=150, what="completion")
    check_exact(dl, 1, 120)
    runs = dl.records()
    assert len(runs) >= 2 and runs[1]["start"] > 0, runs
    assert submissions(dl) == len(runs)
    assert any("reaches its time limit soon" in e for e in dl.events(1))
    log = dl.log(1, 1)
    assert f"det-local: Slurm job {first} ends soon: checkpointing to continue in a new job" in log
    assert slurm.queue() == []


def _seconds(text: str) -> int:
    h, m, s = (int(x) for x in text.split("-")[-1].split(":"))
    return h * 3600 + m * 60 + s


def test_pausing_a_job_pending_in_slurm_cancels_it_at_once(dl: Env, slurm: slurmkit.Slurm) -> None:
    start_daemon(dl, slurm)
    # the only node is taken whole: the trial's job waits in Slurm's queue
    blocker = slurm.run(
        "sbatch", "--parsable", "--exclusive", "-p", "debug", "-o", "/dev/null", "--wrap",
        "sleep 600",
    ).stdout.strip()  # fmt: skip
    try:
        wait_for(lambda: blocker in slurm.queue(), what="the blocking job")
        hp = {"batches": 6, "ckpt_every": 3, "record": str(dl.record_path)}
        cfg, ctx = dl.trainer(hp, HPC)
        assert dl.det("run", "--detach", cfg, ctx).rc == 0
        wait_for(lambda: slurm_id(dl, 1) > 0, timeout=60, what="the trial's job")
        job = slurm_id(dl, 1)
        assert job_fields(slurm, job)["JobState"] == "PENDING"
        began = time.monotonic()
        r = dl.det("experiment", "pause", 1)
        assert r.out.strip() == "experiment 1 paused", r
        wait_for(lambda: str(job) not in slurm.queue(), timeout=20, what="the job to go")
        took = time.monotonic() - began
        assert took < 8, f"the pending job left squeue {took:.1f}s after the pause"  # not 30 s
        wait_for(lambda: dl.experiment(1).state == State.PAUSED, timeout=20, what="PAUSED")
        assert (
            f"trial 1: Slurm job {job} has not started yet: cancelled now (nothing to checkpoint)"
            in dl.events(1)
        )
        assert dl.store().get_trial(1).state == State.PAUSED
        assert dl.records() == []  # it never ran
    finally:
        slurm.run("scancel", blocker, check=False)
    wait_for(lambda: blocker not in slurm.queue(), what="the blocker to go")
    assert dl.det("experiment", "activate", 1).rc == 0
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=90, what="completion")
    check_exact(dl, 1, 6)
    assert [r["start"] for r in dl.records()] == [0]
    assert submissions(dl) == 2 and slurm.queue() == []


def test_sbatch_is_retried_while_slurmctld_is_down_and_jobs_are_not_lost(
    dl: Env, slurm: slurmkit.Slurm
) -> None:
    start_daemon(dl, slurm)
    # 220 batches of at least 0.2 s: the job runs through the outage (it ends ~30 s after batch
    # 3) with 10 s to spare, and is not waited for long after it
    hp = {"batches": 220, "ckpt_every": 50, "delay": 0.2, "record": str(dl.record_path)}
    cfg, ctx = dl.trainer(hp, {**HPC, "max_restarts": 0})
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(lambda: dl.store().get_trial(1).steps_completed >= 3, timeout=60, what="batch 3")
    running = slurm_id(dl, 1)
    stop_slurmctld(slurm)
    down = time.monotonic()
    try:
        # submitted while slurmctld is down: Slurm cannot check it now; its sbatch is retried
        cfg2, ctx2 = dl.trainer({"batches": 4, "ckpt_every": 2}, HPC, name="late")
        r = dl.det("run", "--detach", cfg2, ctx2)
        assert r.rc == 0, r
        at = dl.store().get_trial(1).steps_completed
        # the running job goes on: its trial reports, nothing takes it for lost
        wait_for(
            lambda: dl.store().get_trial(1).steps_completed >= at + 20,
            timeout=60,
            what="trial 1 to go on while slurmctld is down",
        )
        wait_for(lambda: time.monotonic() - down > 25, timeout=60, what="a long outage")
        assert dl.store().get_trial(1).steps_completed < 220  # still training through it
        began = time.monotonic()
        assert dl.det("experiment", "list").rc == 0
        assert time.monotonic() - began < 10  # the engine's loop does not wait for sbatch
        assert dl.trial(2).state == State.ACTIVE  # not ERROR: still being tried
        assert slurm_id(dl, 2) == 0
        assert dl.experiment(1).state == State.ACTIVE
        wait_for(
            lambda: any("Slurm's controller is unreachable" in e for e in daemon_events(dl)),
            timeout=30,
            what="the daemon's line about slurmctld",
        )
    finally:
        start_slurmctld(slurm)
    wait_for(lambda: dl.experiment(2).state == State.COMPLETED, timeout=120, what="exp 2")
    check_exact(dl, 2, 4)
    assert submissions(dl, 2) == 1
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=120, what="exp 1")
    check_exact(dl, 1, 220)
    assert slurm_id(dl, 1) == running and submissions(dl, 1) == 1  # the same job throughout
    assert [r["start"] for r in dl.records()] == [0]
    assert not any("lost" in e or "cancelled outside" in e for e in dl.events(1))
    events = daemon_events(dl)
    (line,) = [e for e in events if "Slurm's controller is unreachable" in e]
    assert line.startswith(
        "Slurm pool 'hpc': Slurm's controller is unreachable (squeue failed: "
        "slurm_load_jobs error: Unable to contact slurm controller (connect failure)); its "
        "jobs keep their last known state (none is taken for lost) and Slurm is asked again "
        "every 2s"
    ), line
    assert "Slurm pool 'hpc': Slurm's controller answers again" in events


def test_sbatch_refused_errors_at_once_and_the_retry_budget_ends(
    dl: Env, slurm: slurmkit.Slurm
) -> None:
    start_daemon(dl, slurm, pools(submit_retry=5))
    hp = {"batches": 8, "ckpt_every": 2, "hold_at": 2}
    cfg, ctx = dl.trainer(hp, {**HPC, "max_restarts": 3})
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(lambda: dl.store().get_trial(1).steps_completed >= 2, timeout=60, what="batch 2")
    assert dl.det("experiment", "pause", 1).rc == 0
    wait_for(lambda: dl.experiment(1).state == State.PAUSED, timeout=60, what="PAUSED")
    # a permanent error (the partition drained since): one line at once, no restart spent
    slurm.run("scontrol", "update", "PartitionName=debug", "State=DRAIN")
    try:
        began = time.monotonic()
        assert dl.det("experiment", "activate", 1).rc == 0
        wait_for(lambda: dl.trial(1).state == State.ERROR, timeout=30, what="ERROR")
        assert time.monotonic() - began < 10
        trial = dl.trial(1)
        assert trial.message == (
            "trial 1: sbatch failed: sbatch: error: Batch job submission failed: Required "
            "partition not available (inactive or drain)"
        ), trial.message
        assert trial.restarts == 0
    finally:
        slurm.run("scontrol", "update", "PartitionName=debug", "State=UP")

    # slurmctld down for longer than the pool's submit_retry (5 s): ERROR with sbatch's line
    stop_slurmctld(slurm)
    try:
        cfg, ctx = dl.trainer({"batches": 2}, HPC, name="late")
        assert dl.det("run", "--detach", cfg, ctx).rc == 0
        wait_for(lambda: dl.trial(2).state == State.ERROR, timeout=90, what="ERROR")
    finally:
        start_slurmctld(slurm)
    message = dl.trial(2).message or ""
    assert re.fullmatch(
        r"trial 2: sbatch failed: sbatch: error: Batch job submission failed: Unable to contact "
        r"slurm controller \(connect failure\) \(Slurm's controller did not answer for \d+s, "
        r"\d+ tr(y|ies); the pool's submit_retry is 5s\)",
        message,
    ), message
    assert dl.trial(2).restarts == 0 and slurm_id(dl, 2) == 0
    assert dl.experiment(2).state.terminal
    assert slurm.queue() == []


def test_pool_removed_from_daemon_yaml_while_its_jobs_run(dl: Env, slurm: slurmkit.Slurm) -> None:
    """Decision: a job the removed pool had submitted is adopted by its Slurm job id and
    followed to its end (its work counts; pause and kill still reach it); a run that must start
    there again is refused in one line naming the missing pool."""
    start_daemon(dl, slurm)
    hp = {"batches": 40, "ckpt_every": 10, "delay": 0.1, "record": str(dl.record_path)}
    cfg, ctx = dl.trainer(hp, HPC)
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    hold = {"batches": 8, "ckpt_every": 2, "hold_at": 2}
    cfg2, ctx2 = dl.trainer(hold, {**HPC, "max_restarts": 3}, name="held")
    assert dl.det("run", "--detach", cfg2, ctx2).rc == 0
    wait_for(lambda: dl.store().get_trial(1).steps_completed >= 3, timeout=60, what="batch 3")
    wait_for(lambda: dl.store().get_trial(2).steps_completed >= 2, timeout=60, what="batch 2")
    first, second = slurm_id(dl, 1), slurm_id(dl, 2)
    dl.kill_daemon()
    start_daemon(dl, slurm, {})  # daemon.yaml without the pool
    settings = dl.paths.settings
    missing = (
        f"resource pool 'hpc' is not in {settings} any more; pools: default (put it back "
        "under resource_pools: to run there again)"
    )
    # followed to its end by its Slurm id: the same job completes the trial
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=120, what="completion")
    check_exact(dl, 1, 40)
    assert slurm_id(dl, 1) == first and submissions(dl, 1) == 1
    job1 = dl.store().jobs.for_trial(1)
    assert job1 is not None
    assert (
        f"job {job1.id}: {missing}; its Slurm job {first} is followed to its end by its id, and "
        "the trial cannot be queued there again"
    ) in dl.events(1)
    # pause reaches the adopted job; activate cannot submit: one line, the trial ERRORs
    assert dl.det("experiment", "pause", 2).rc == 0
    wait_for(lambda: dl.experiment(2).state == State.PAUSED, timeout=60, what="PAUSED")
    wait_for(lambda: str(second) not in slurm.queue(), timeout=30, what="the job to go")
    assert dl.det("experiment", "activate", 2).rc == 0
    wait_for(lambda: dl.trial(2).state == State.ERROR, timeout=30, what="ERROR")
    assert dl.trial(2).message == f"trial 2: {missing}"
    assert dl.trial(2).restarts == 0
    # and a new experiment for the pool is refused at submission
    cfg3, ctx3 = dl.trainer({"batches": 1}, HPC, name="new")
    r = dl.det("run", "--detach", cfg3, ctx3)
    assert r.rc != 0 and "pool 'hpc' does not exist; pools: default" in r.err, r
    assert slurm.queue() == []


def test_the_engine_itself_runs_as_a_slurm_job(dl: Env, slurm: slurmkit.Slurm) -> None:
    """`sbatch --wrap "det-local run cfg ctx"`: the embedded engine is a small job of its own
    (one CPU of the partition) and submits each trial run as another job, which reports to
    the engine's socket in DET_LOCAL_HOME (the same host here, as every Slurm pool today)."""
    dl.settings(pools())
    cfg, ctx = dl.trainer({"batches": 6, "ckpt_every": 3}, HPC)
    out = dl.tmp / "engine.out"
    engine = slurm.run(
        "sbatch", "--parsable", "-p", "debug", "-o", str(out), f"--chdir={dl.tmp}",
        "--job-name=det-local-engine", "--wrap", shlex.join(dl.argv("run", cfg, ctx)),
    ).stdout.strip()  # fmt: skip
    wait_for(lambda: engine not in slurm.queue(), timeout=180, what="the engine's job to end")
    fields = job_fields(slurm, int(engine))
    assert fields["JobState"] == "COMPLETED", (fields, out.read_text())
    assert "Experiment 1 (ctx) COMPLETED" in out.read_text()
    check_exact(dl, 1, 6)
    (job,) = dl.jobs()
    assert job.pid and job.pid != int(engine)  # the trial ran as a Slurm job of its own
    trial_job = job_fields(slurm, job.pid)
    assert trial_job["JobState"] == "COMPLETED"
    assert trial_job["JobName"] == "det-local_e1_t1_r1"
    assert slurm.queue() == []


def test_kill_while_slurmctld_is_down_reaches_the_job_once_it_answers(
    dl: Env, slurm: slurmkit.Slurm
) -> None:
    start_daemon(dl, slurm)
    cfg, ctx = dl.trainer({"batches": 400, "ckpt_every": 50, "delay": 0.2}, HPC)
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(lambda: dl.store().get_trial(1).steps_completed >= 3, timeout=60, what="batch 3")
    job = slurm_id(dl, 1)
    stop_slurmctld(slurm)
    try:
        began = time.monotonic()
        r = dl.det("experiment", "kill", 1)
        assert r.out.strip() == "experiment 1 killed", r
        assert time.monotonic() - began < 8  # scancel does not hold the engine's loop
        # the job runs on under slurmd meanwhile; nothing takes it for ended
        wait_for(lambda: time.monotonic() - began > 15, timeout=30, what="15 s of outage")
        assert dl.experiment(1).state == State.STOPPING_CANCELED
    finally:
        start_slurmctld(slurm)
    # scancel, tried again, reaches it once slurmctld answers
    wait_for(lambda: str(job) not in slurm.queue(), timeout=90, what="the job to be cancelled")
    wait_for(lambda: dl.experiment(1).state == State.CANCELED, timeout=60, what="CANCELED")
    assert dl.store().get_trial(1).steps_completed < 400
    assert job_fields(slurm, job)["JobState"] == "CANCELLED"


def test_submit_retry_is_seconds() -> None:
    from det_local.errors import ConfigError
    from det_local.slurm.config import parse_slurm_pool

    assert parse_slurm_pool("hpc", {"partition": "debug"}, "d.yaml").submit_retry == 120
    assert (
        parse_slurm_pool("hpc", {"partition": "p", "submit_retry": 0}, "d.yaml").submit_retry == 0
    )
    for bad in (-1, "2m", True, 86401):
        with pytest.raises(ConfigError) as err:
            parse_slurm_pool("hpc", {"partition": "debug", "submit_retry": bad}, "d.yaml")
        assert str(err.value) == (
            "resource_pools.hpc.slurm.submit_retry in d.yaml: expected seconds, 0 to 86400"
        )
