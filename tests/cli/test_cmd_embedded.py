"""`det-local cmd run -f` with no daemon: an engine in the CLI process runs the command (as
`det-local run` runs an experiment), streams its output and exits with its status; and a job
removed from the queue before it started ends CANCELED, not DONE.

Every test drives the real CLI as subprocesses on its own DET_LOCAL_HOME; waits are bounded
polls (a CLI that hangs fails the test after its timeout).
"""

from __future__ import annotations

import json
import signal

import psutil

from det_local.sched.enginelock import lock_free
from det_local.store.states import State
from tests.support.world import Env, gone, one_line_error, wait_for

CPU1 = {"DET_LOCAL_FAKE_GPUS": "0", "DET_LOCAL_CPU_SLOTS": "1"}
CPU2 = {"DET_LOCAL_FAKE_GPUS": "0", "DET_LOCAL_CPU_SLOTS": "2"}
BOUND_S = 30.0  # a `cmd run -f` of a trivial command that takes longer has hung


def no_engine_left(dl: Env) -> None:
    """The embedded engine went with its CLI: the lock is free, no daemon, no socket."""
    assert lock_free(dl.paths)
    assert dl.daemon_pid() is None
    assert not dl.paths.socket.exists()


def cmd_rows(dl: Env) -> dict[str, list[str]]:
    """`cmd list --all` as {id: [state, exit, slots]}."""
    r = dl.det("cmd", "list", "--all")
    assert r.rc == 0, r
    rows = [[c.strip() for c in line.split("|")] for line in r.out.splitlines()[2:]]
    return {row[0]: row[1:4] for row in rows}


# ---------------------------------------------------------------------------- cmd run -f
def test_cmd_run_follow_without_a_daemon_runs_it_here(dl: Env) -> None:
    dl.setenv(**CPU1)
    r = dl.det("cmd", "run", "-f", "--", "echo", "hi", timeout=BOUND_S)
    assert (r.rc, r.out) == (0, "Queued command 1\nhi\n"), r
    assert "no daemon" not in r.err, r  # it ran: nothing waits for a daemon
    job = dl.job(1)
    assert (job.state, job.exit_code) == ("DONE", 0)
    no_engine_left(dl)
    assert cmd_rows(dl) == {"1": ["DONE", "0", "1"]}


def test_cmd_run_follow_without_a_daemon_exits_with_the_commands_status(dl: Env) -> None:
    dl.setenv(**CPU1)
    r = dl.det("cmd", "run", "-f", "--", "sh", "-c", "echo out; echo err >&2; exit 3")
    assert r.rc == 3, r
    assert r.out == "Queued command 1\nout\nerr\n", r  # its log holds both streams
    r = dl.det("cmd", "run", "--follow", "--", "sh", "-c", "kill -9 $$", timeout=BOUND_S)
    assert r.rc == 137, r  # killed by SIGKILL, as a shell reports it
    assert [(j.id, j.state, j.exit_code) for j in dl.jobs()] == [(1, "DONE", 3), (2, "DONE", 137)]
    no_engine_left(dl)


def test_cmd_run_follow_without_a_daemon_refuses_in_one_line(dl: Env) -> None:
    dl.setenv(**CPU1)
    r = dl.det("cmd", "run", "-f", "--", "no-such-program-here", timeout=BOUND_S)
    one_line_error(r, "program 'no-such-program-here' was not found on PATH")
    assert r.out == "", r
    assert dl.jobs() == []
    no_engine_left(dl)


def test_a_second_cmd_run_follow_goes_to_the_first_ones_engine(dl: Env) -> None:
    dl.setenv(**CPU2)
    first = dl.start("cmd", "run", "-f", "--", *dl.held("first", "echo first-out; "))
    wait_for(lambda: dl.order() == ["first"], what="the first command to start")
    assert not lock_free(dl.paths)  # the first CLI runs the engine
    # the second is a request to that engine, and follows the command from its own process
    r = dl.det("cmd", "run", "-f", "--", "sh", "-c", "echo second-out", timeout=BOUND_S)
    assert (r.rc, r.out) == (0, "Queued command 2\nsecond-out\n"), r
    assert first.popen.poll() is None  # its own command still runs
    dl.release("first")
    r = first.wait(timeout=BOUND_S)
    assert (r.rc, r.out) == (0, "Queued command 1\nfirst-out\n"), r
    assert [(j.id, j.state, j.exit_code) for j in dl.jobs()] == [(1, "DONE", 0), (2, "DONE", 0)]
    no_engine_left(dl)


def test_ctrl_c_stops_the_command_an_embedded_engine_runs(dl: Env) -> None:
    dl.setenv(**CPU1)
    script = "sleep 1000 & echo $! > bg.pid; echo started; wait"
    run = dl.start("cmd", "run", "-f", "--", "sh", "-c", script)
    wait_for(lambda: "started" in run.out and (dl.tmp / "bg.pid").exists(), what="the command")
    wrapper = dl.job_pid(1)
    tree = [wrapper, *(c.pid for c in psutil.Process(wrapper).children(recursive=True))]
    run.signal(signal.SIGINT)  # a terminal's Ctrl-C: det-local only (the job has a session)
    r = run.wait(timeout=BOUND_S)
    assert r.rc == 128 + signal.SIGTERM, r  # its shell, stopped by SIGTERM
    assert "stopping command 1" in r.err, r
    job = dl.job(1)
    assert (job.state, job.message) == ("DONE", "killed on request"), job
    wait_for(lambda: all(gone(p) for p in tree), what="every process of the command to go")
    no_engine_left(dl)


# ---------------------------------------------------------------------------- CANCELED
def test_a_command_removed_from_the_queue_is_canceled_without_a_daemon(dl: Env) -> None:
    r = dl.det("cmd", "run", "--", "sh", "-c", "echo never >> order")
    assert (r.rc, r.out) == (0, "Queued command 1\n"), r
    assert "waits in the queue" in r.err and "cmd run -f" in r.err, r
    r = dl.det("cmd", "kill", 1)
    assert (r.rc, r.out.strip()) == (0, "command 1 removed from the queue"), r
    assert cmd_rows(dl) == {"1": ["CANCELED", "", "1"]}
    job = dl.json("job", "list", "--all")[0]
    assert (job["state"], job["exit_code"], job["message"]) == (
        "CANCELED",
        None,
        "removed from the queue on request",
    )
    assert dl.json("job", "list") == [] and dl.json("cmd", "list") == []  # ended: --all only
    r = dl.det("cmd", "kill", 1)
    assert (r.rc, r.out.strip()) == (0, "command 1 already ended"), r
    # a daemon started later has nothing to run
    dl.daemon_start(**CPU1)
    assert dl.wait_job(dl.cmd("true")).exit_code == 0
    assert dl.job(1).state == "CANCELED" and dl.order() == []


def test_queued_jobs_canceled_through_the_daemon(dl: Env) -> None:
    dl.daemon_start(**CPU1)
    holder = dl.cmd(*dl.held("holder"))
    wait_for(lambda: dl.order() == ["holder"], what="the slot to be taken")
    queued = dl.cmd("sh", "-c", "echo queued >> order")
    cfg, ctx = dl.context("print('never')\n")
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    trial_job = wait_for(
        lambda: next((j for j in dl.jobs() if j.trial_id == 1), None), what="the trial's job"
    )
    assert trial_job.state == "QUEUED"

    r = dl.det("cmd", "kill", queued)
    assert (r.rc, r.out.strip()) == (0, f"command {queued} removed from the queue"), r
    r = dl.det("experiment", "kill", 1)
    assert (r.rc, r.out.strip()) == (0, "experiment 1 killed"), r
    wait_for(lambda: dl.experiment(1).state == State.CANCELED, what="the experiment to end")
    by_id = {j["id"]: j for j in dl.json("job", "list", "--all")}
    assert (by_id[queued]["state"], by_id[queued]["exit_code"]) == ("CANCELED", None)
    assert (by_id[trial_job.id]["state"], by_id[trial_job.id]["exit_code"]) == ("CANCELED", None)
    assert by_id[holder]["state"] == "SCHEDULED"
    assert cmd_rows(dl)[str(queued)] == ["CANCELED", "", "1"]
    # following a canceled command ends at once, with its reason
    r = dl.det("cmd", "logs", "-f", queued, timeout=BOUND_S)
    assert (r.rc, r.out) == (1, ""), r
    assert "removed from the queue on request" in r.err, r
    dl.release("holder")
    assert dl.wait_job(holder).exit_code == 0
    assert dl.order() == ["holder"]  # neither canceled job ever ran
    assert json.loads(dl.det("job", "list", "--json").out) == []
