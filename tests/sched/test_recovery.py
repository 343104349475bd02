"""Recovery: the daemon killed with kill -9 while jobs are queued and running, jobs that end
while no daemon watches them, and an allocation recorded without a process.

On restart nothing queued is lost (and the queue keeps its order), live processes are adopted
(same pids; their exit status comes from the wrapper's exit file), dead ones are settled
(commands with their status and a reason, trials requeued from their latest checkpoint), no
slot is booked twice, and nothing runs twice.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from det_local.sched.intake import spool
from det_local.store.states import State
from tests.support.world import Env, gone, steps, wait_for

SIZE = 3
CPU = {"DET_LOCAL_FAKE_GPUS": "0", "DET_LOCAL_CPU_SLOTS": str(SIZE)}

# A Core API trial that stops at chosen steps until the test lets it go on.
#   steps: batches in all; ckpt_at: checkpoint after this batch; pauses: on its first run,
#   after these batches touch at-N and wait for go-N; fail: exit with this code after the
#   last pause (first run only); preemptible: look at should_preempt() after every batch and,
#   when asked, touch preempted-RUN, (first run: wait for go-preempt,) checkpoint and exit.
#   Each run appends "run start pid" to runs.
TRIAL = """
import os, pathlib, sys, time
import determined as det

info = det.get_cluster_info()
hp = info.trial.hparams
out = pathlib.Path(hp["out"])
run = int(os.environ["DET_TRIAL_RUN_ID"])


def wait(path):
    deadline = time.monotonic() + 120
    while not path.exists():
        if time.monotonic() > deadline:
            sys.exit(99)
        time.sleep(0.02)


with det.core.init() as core:
    start = 0
    if info.latest_checkpoint is not None:
        with core.checkpoint.restore_path(info.latest_checkpoint) as path:
            start = int((path / "step").read_text())
    with open(out / "runs", "a") as f:
        f.write(f"{run} {start} {os.getpid()}\\n")
    pauses = hp.get("pauses") or []
    for step in range(start + 1, hp["steps"] + 1):
        core.train.report_training_metrics(steps_completed=step, metrics={"loss": 1 / step})
        if hp.get("preemptible") and core.preempt.should_preempt():  # acknowledges it
            (out / f"preempted-{run}").touch()
            if run == 1:
                wait(out / "go-preempt")
            with core.checkpoint.store_path({"steps_completed": step}) as (path, _):
                (path / "step").write_text(str(step))
            sys.exit(0)
        time.sleep(hp.get("delay", 0))
        if step == hp.get("ckpt_at"):
            with core.checkpoint.store_path({"steps_completed": step}) as (path, _):
                (path / "step").write_text(str(step))
        if run == 1 and step in pauses:
            (out / f"at-{step}").touch()
            wait(out / f"go-{step}")
            if step == pauses[-1] and hp.get("fail"):
                os._exit(hp["fail"])  # a crash: not even the session says goodbye
    core.train.report_validation_metrics(steps_completed=hp["steps"], metrics={"loss": 0.0})
"""


class SlotWatch:
    """Polls the store in a thread for the whole test: no slot is ever held by two SCHEDULED
    jobs, and no more slots than the machine has are booked."""

    def __init__(self, dl: Env) -> None:
        self.dl = dl
        self.problems: list[str] = []
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        db = self.dl.paths.db
        while not self._stop.wait(0.01):
            if not db.exists():
                continue
            try:
                conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
                rows = conn.execute("SELECT id, slots FROM jobs WHERE state='SCHEDULED'").fetchall()
                conn.close()
            except sqlite3.Error:
                continue
            held = [int(s) for _id, slots in rows for s in slots.strip("[]").split(",") if s]
            self.polls += 1
            if len(held) != len(set(held)) or len(held) > SIZE:
                self.problems.append(f"slots booked: {rows}")

    def check(self) -> None:
        self._stop.set()
        self._thread.join()
        assert self.polls > 10
        assert self.problems == []


@pytest.fixture
def watch(dl: Env) -> Iterator[SlotWatch]:
    w = SlotWatch(dl)
    yield w
    w._stop.set()


def submit_trial(dl: Env, name: str, **hp: Any) -> tuple[int, Path]:
    out = dl.tmp / f"out-{name}"
    out.mkdir()
    restarts = hp.pop("restarts", 0)
    cfg, ctx = dl.context(
        TRIAL, {"hyperparameters": {"out": str(out), **hp}, "max_restarts": restarts}, name=name
    )
    r = dl.det("run", "--detach", cfg, ctx)
    assert r.rc == 0, r
    return int(r.out.split()[-1]), out


def runs(out: Path) -> list[tuple[int, int]]:
    path = out / "runs"
    if not path.exists():
        return []
    return [
        (int(r), int(s)) for r, s, _pid in (line.split() for line in path.read_text().splitlines())
    ]


def wait_steps(dl: Env, trial_id: int, n: int) -> None:
    wait_for(lambda: steps(dl, trial_id)[-1:] == [n], what=f"trial {trial_id} at step {n}")


def group_of(pid: int) -> list[int]:
    """The job's wrapper and its lasting descendants (not the `sleep 0.02` of a polling loop)."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return [p.pid for p in procs if p.cmdline()[:2] != ["sleep", "0.02"]]


def restart(dl: Env) -> int:
    r = dl.det("daemon", "start")
    assert r.rc == 0, r
    return int(r.out.split()[2])


def daemon_log(dl: Env) -> str:
    return (dl.paths.run_dir / "daemon.log").read_text()


# ---------------------------------------------------------------------------- kill -9
def test_kill9_with_jobs_queued_and_running(dl: Env, watch: SlotWatch) -> None:
    first = dl.daemon_start(**CPU)
    running = dl.cmd(*dl.held("running", "echo ran >> ran-running; "))
    exp, out = submit_trial(dl, "t", steps=4, ckpt_at=2, pauses=[2])
    wait_for(lambda: (out / "at-2").exists(), what="the trial to reach its pause")
    wait_steps(dl, 1, 2)
    dl.cmd(*dl.held("second"), priority=40)
    queued = [dl.cmd("sh", "-c", f"echo {n} >> order", name=n, slots=2) for n in ("q1", "q2")]
    queued.append(dl.cmd("sh", "-c", "echo q3 >> order", name="q3", slots=2, priority=50))
    wait_for(lambda: "second" in dl.order(), what="three jobs to run")
    jobs = {j.id: j for j in dl.jobs()}
    assert [jobs[q].state for q in queued] == ["QUEUED"] * 3
    trial_job = next(j for j in jobs.values() if j.trial_id == 1)
    live = {
        j.id: (dl.job_pid(j.id), group_of(dl.job_pid(j.id)))
        for j in jobs.values()
        if j.state == "SCHEDULED"
    }
    assert len(live) == 3

    dl.kill_daemon()
    assert dl.daemon_pid() == first  # the stale pid file stays: the lock is what counts
    # the jobs go on without it
    for _pid, procs in live.values():
        assert not any(gone(p) for p in procs)

    new = restart(dl)
    assert new != first
    after = {j.id: j for j in dl.jobs()}
    for job_id, (pid, _procs) in live.items():
        assert (after[job_id].state, after[job_id].pid) == ("SCHEDULED", pid)
        assert after[job_id].slots == jobs[job_id].slots
        assert f"job {job_id} (pid {pid}) still running" in daemon_log(dl)
    assert [after[q].state for q in queued] == ["QUEUED"] * 3
    assert [j["name"] for j in dl.json("job", "list") if j["state"] == "QUEUED"] == [
        "q1",
        "q2",
        "q3",
    ]

    # the adopted trial reconnects and finishes; the adopted commands end with their status
    (out / "go-2").touch()
    wait_for(lambda: dl.experiment(exp).state == State.COMPLETED, what="the adopted trial")
    assert runs(out) == [(1, 0)] and steps(dl, 1) == [1, 2, 3, 4]
    assert dl.job(trial_job.id).exit_code == 0
    dl.release("running")
    assert dl.wait_job(running).exit_code == 0
    assert dl.job(running).message == f"command {running} exited with code 0"
    dl.release("second")
    for q in queued:
        dl.wait_job(q)
    # everything ran exactly once, the queue in its order
    assert dl.order() == ["running", "second", "q1", "q2", "q3"]
    assert (dl.tmp / "ran-running").read_text() == "ran\n"
    watch.check()


def test_adopted_command_exit_status_comes_from_its_exit_file(dl: Env) -> None:
    dl.daemon_start(**CPU)
    job = dl.cmd(
        "sh",
        "-c",
        f"echo c >> order; while [ ! -e {dl.tmp / 'gate-c'} ]; do sleep 0.02; done; exit 7",
    )
    wait_for(lambda: "c" in dl.order(), what="the command")
    dl.kill_daemon()
    restart(dl)
    dl.release("c")
    done = dl.wait_job(job)
    assert (done.exit_code, done.message) == (7, f"command {job} exited with code 7")


# ---------------------------------------------------------------------------- died while down
def test_jobs_that_ended_while_the_daemon_was_down(dl: Env, watch: SlotWatch) -> None:
    dl.daemon_start(**CPU)
    exited = dl.cmd(
        "sh",
        "-c",
        f"echo x >> order; while [ ! -e {dl.tmp / 'gate-x'} ]; do sleep 0.02; done; exit 5",
    )
    killed = dl.cmd(*dl.held("k"))
    # a trial that fails (exit 3) while the daemon is down: restarted from its checkpoint
    exp, out = submit_trial(dl, "f", steps=4, ckpt_at=2, pauses=[2], fail=3, restarts=1)
    wait_for(lambda: {"x", "k"} <= set(dl.order()) and (out / "at-2").exists(), what="jobs")
    wait_steps(dl, 1, 2)
    queued = dl.cmd("sh", "-c", "echo q >> order")
    k_group = group_of(dl.job_pid(killed))

    dl.kill_daemon()
    dl.release("x")  # exits 5; the wrapper writes its exit file
    os.killpg(k_group[0], signal.SIGKILL)  # the whole group at once: no exit file
    (out / "go-2").touch()  # the trial exits 3
    wait_for(lambda: all(gone(p) for p in k_group), what="the killed command")
    wait_for(lambda: dl.paths.job_exit_file(exited, 1).exists(), what="the exit file")
    trial_job = next(j for j in dl.jobs() if j.trial_id == 1)
    wait_for(lambda: dl.paths.job_exit_file(trial_job.id, 1).exists(), what="the trial's exit")

    restart(dl)
    e = dl.wait_job(exited)
    assert (e.exit_code, e.message) == (
        5,
        f"command {exited} ended while the daemon was down with exit code 5",
    )
    k = dl.wait_job(killed)
    assert k.exit_code is None
    assert (
        k.message == f"command {killed} ended while the daemon was down; its exit status is unknown"
    )
    wait_for(lambda: dl.experiment(exp).state == State.COMPLETED, what="the restarted trial")
    assert runs(out) == [(1, 0), (2, 2)]  # the second run resumed from the checkpoint
    assert dl.trial(1).restarts == 1
    assert steps(dl, 1) == [1, 2, 3, 4]
    assert dl.wait_job(queued).exit_code == 0
    order = dl.order()  # x and k started at once (either wrote first); q after the restart
    assert sorted(order[:2]) == ["k", "x"] and order[2:] == ["q"], order
    watch.check()


def test_trial_killed_while_the_daemon_was_down_resumes_from_its_checkpoint(dl: Env) -> None:
    dl.daemon_start(**CPU)
    exp, out = submit_trial(dl, "k", steps=5, ckpt_at=2, pauses=[3])
    wait_for(lambda: (out / "at-3").exists(), what="the trial")
    wait_steps(dl, 1, 3)
    group = group_of(dl.job_pid(next(j for j in dl.jobs() if j.trial_id == 1).id))
    dl.kill_daemon()
    os.killpg(group[0], signal.SIGKILL)
    wait_for(lambda: all(gone(p) for p in group), what="the trial's processes")
    restart(dl)
    wait_for(lambda: dl.experiment(exp).state == State.COMPLETED, what="the requeued trial")
    assert runs(out) == [(1, 0), (2, 2)]
    assert dl.trial(1).restarts == 0  # not the trial's fault: no restart is used up
    assert any("ended while the daemon was down" in e for e in dl.events(exp))
    # step 3 was trained again after the checkpoint at 2: reported by both runs
    assert steps(dl, 1) == [1, 2, 3, 3, 4, 5]


def test_metrics_reported_while_the_daemon_is_down_arrive_after_restart(dl: Env) -> None:
    dl.daemon_start(**CPU)
    exp, out = submit_trial(dl, "m", steps=8, ckpt_at=7, pauses=[3, 6])
    wait_for(lambda: (out / "at-3").exists(), what="the trial")
    wait_steps(dl, 1, 3)
    dl.kill_daemon()
    (out / "go-3").touch()
    wait_for(lambda: (out / "at-6").exists(), what="the trial to report while no daemon runs")
    assert steps(dl, 1) == [1, 2, 3]
    restart(dl)
    wait_steps(dl, 1, 6)  # the trial's session reconnected with its token and sent them
    (out / "go-6").touch()
    wait_for(lambda: dl.experiment(exp).state == State.COMPLETED, what="the trial")
    assert steps(dl, 1) == list(range(1, 9))
    assert runs(out) == [(1, 0)]
    assert [c.steps_completed for c in dl.checkpoints(1)] == [7]


# ------------------------------------------------------------------ allocation, no process
def test_allocation_without_a_process_is_requeued(dl: Env, watch: SlotWatch) -> None:
    """A crash between recording an allocation and spawning its process leaves a SCHEDULED
    job with no pid: the next daemon puts it back in the queue, in its place."""
    dl.daemon_start(**CPU)
    hold = [dl.cmd(*dl.held(n)) for n in ("h1", "h2", "h3")]
    exp, out = submit_trial(dl, "a", steps=2)
    cmd = dl.cmd("sh", "-c", "echo c >> order")
    later = dl.cmd("sh", "-c", "echo later >> order")
    wait_for(lambda: len(dl.order()) == 3, what="the holders")
    assert dl.det("daemon", "stop").rc == 0
    for n in ("h1", "h2", "h3"):
        dl.release(n)
    for h in hold:
        wait_for(lambda h=h: dl.paths.job_exit_file(h, 1).exists(), what="the holders to end")
    trial_job = next(j for j in dl.jobs() if j.trial_id == 1)
    conn = sqlite3.connect(dl.paths.db)
    with conn:
        # as the daemon would leave them: the holders reaped, the next two jobs allocated
        # (slots and token recorded, as JobTable.allocate does) but not spawned yet
        conn.execute(f"UPDATE jobs SET state='DONE', slots='[]' WHERE id IN {tuple(hold)}")
        conn.execute(
            "UPDATE jobs SET state='SCHEDULED', slots='[0]', token='t', run_id=1, pid=NULL "
            "WHERE id=?",
            (trial_job.id,),
        )
        conn.execute("UPDATE trials SET run_id=1 WHERE id=1")
        conn.execute(
            "UPDATE jobs SET state='SCHEDULED', slots='[1]', token='u', run_id=1, pid=NULL "
            "WHERE id=?",
            (cmd,),
        )
    conn.close()

    restart(dl)
    wait_for(lambda: dl.experiment(exp).state == State.COMPLETED, what="the trial")
    done = {j: dl.wait_job(j) for j in (cmd, later)}
    assert all(job.exit_code == 0 for job in done.values())
    assert len(runs(out)) == 1  # it ran once
    # requeued in its place: allocated no later than the job queued after it (with 3 free
    # slots both start in the same pass, so which writes `order` first is a race)
    assert done[cmd].started_at <= done[later].started_at
    assert dl.order()[:3] == ["h1", "h2", "h3"] and sorted(dl.order()[3:]) == ["c", "later"]
    assert any("never started" in e for e in dl.events(exp))
    watch.check()


# ------------------------------------------------------------------ kill -9, other moments
def test_kill9_while_a_trial_is_being_preempted(dl: Env) -> None:
    """The trial acknowledged the preemption, then the daemon died before it exited: the next
    daemon must requeue it (not take its exit for the end of training)."""
    dl.daemon_start(**{**CPU, "DET_LOCAL_CPU_SLOTS": "1"})
    exp, out = submit_trial(dl, "p", steps=300, preemptible=True, delay=0.01, restarts=0)
    wait_for(lambda: len(steps(dl, 1)) >= 2, what="the trial to train")
    dl.cmd(*dl.held("urgent"), priority=1)
    wait_for(lambda: (out / "preempted-1").exists(), what="the trial to be asked to preempt")
    dl.kill_daemon()
    (out / "go-preempt").touch()  # it checkpoints (waiting for the daemon) and exits
    restart(dl)
    wait_for(lambda: "urgent" in dl.order(), what="the urgent job to start")
    job = next(j for j in dl.jobs() if j.trial_id == 1)
    assert job.state == "QUEUED" and dl.trial(1).state == State.ACTIVE
    stopped_at = dl.trial(1).steps_completed
    dl.release("urgent")
    wait_for(lambda: dl.experiment(exp).state == State.COMPLETED, timeout=60, what="the trial")
    assert runs(out) == [(1, 0), (2, stopped_at)]
    assert steps(dl, 1) == list(range(1, 301))


def test_process_spawned_but_not_recorded_is_adopted_not_run_again(dl: Env) -> None:
    """A crash after a job's process was spawned but before its pid was recorded: the next
    daemon finds the process (its wrapper names the job's exit file) and adopts it."""
    dl.daemon_start(**CPU)
    a = dl.cmd(*dl.held("a"))
    exp, out = submit_trial(dl, "s", steps=3, pauses=[1])
    wait_for(lambda: "a" in dl.order() and (out / "at-1").exists(), what="the jobs")
    wait_steps(dl, 1, 1)
    trial_job = next(j for j in dl.jobs() if j.trial_id == 1)
    pids = {a: dl.job_pid(a), trial_job.id: dl.job_pid(trial_job.id)}
    assert dl.det("daemon", "stop").rc == 0
    conn = sqlite3.connect(dl.paths.db)
    with conn:
        conn.execute("UPDATE jobs SET pid=NULL, pid_start=NULL")
    conn.close()

    restart(dl)
    for job_id, pid in pids.items():
        job = dl.job(job_id)
        assert (job.state, job.pid) == ("SCHEDULED", pid), job
    (out / "go-1").touch()
    wait_for(lambda: dl.experiment(exp).state == State.COMPLETED, what="the adopted trial")
    dl.release("a")
    assert dl.wait_job(a).exit_code == 0
    assert dl.order() == ["a"] and runs(out) == [(1, 0)]
    assert steps(dl, 1) == [1, 2, 3]


def test_kill9_during_a_burst_of_requests(dl: Env) -> None:
    """kill -9 twice while the daemon works through a burst of submissions: every request is
    answered, each applied exactly once (one job each, each job run once)."""
    dl.daemon_start(**CPU)
    n = 24
    payload = {"cwd": str(dl.tmp), "env": dl.env, "slots": 1, "priority": 42}
    ids = [
        spool.submit(dl.paths, "cmd_run", {**payload, "argv": ["sh", "-c", f"echo {i} >> order"]})
        for i in range(n)
    ]

    def jobs_created() -> int:
        conn = sqlite3.connect(f"file:{dl.paths.db}?mode=ro", uri=True)
        try:
            return int(conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])
        finally:
            conn.close()

    for at_least in (1, n // 2):
        wait_for(lambda at_least=at_least: jobs_created() >= at_least, what="jobs")
        dl.kill_daemon()
        restart(dl)
    answers = [spool.wait_response(dl.paths, i, timeout=30) for i in ids]
    assert sorted(answers) == list(range(1, n + 1)), answers
    for job_id in answers:
        dl.wait_job(job_id)
    assert sorted(dl.order(), key=int) == [str(i) for i in range(n)]
    assert len(dl.jobs()) == n
