"""The job queue through a real daemon: slots (fake GPUs, CPU slots, foreign processes), the
scheduler (priority, FIFO, gang, preemption, caps, quotas, backfill), `job list|update`,
experiment control, and commands (`cmd run|list|logs|kill`).

Jobs are tiny shell commands and Core API trials. A "held" command (`Env.held`) appends its
name to the file `order` when it starts and waits for the test to release it, so every test
decides when slots free up; waits are bounded polls.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import psutil
import pytest

from det_local.sched.queue.hardware import fake_uuid
from det_local.store.db import current_user
from det_local.store.states import State
from tests.support.world import Env, gone, one_line_error, steps, wait_for

CPU1 = {"DET_LOCAL_FAKE_GPUS": "0", "DET_LOCAL_CPU_SLOTS": "1"}
GPU4 = {"DET_LOCAL_FAKE_GPUS": "4"}
ME = current_user()


def states(dl: Env) -> dict[int, str]:
    return {j.id: j.state for j in dl.jobs()}


def read_env(path: Path) -> dict[str, str]:
    wait_for(lambda: path.exists() and path.read_text().endswith("\n"), what=f"{path}")
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def started(dl: Env, *names: str) -> None:
    wait_for(lambda: set(names) <= set(dl.order()), what=f"{names} to start")


def scheduled_slots(dl: Env) -> list[int]:
    return sorted(s for j in dl.jobs() if j.state == "SCHEDULED" for s in j.slots)


def trial_job(dl: Env, trial_id: int) -> Any:
    return next(j for j in dl.jobs() if j.trial_id == trial_id)


# ---------------------------------------------------------------------------- slots
def test_jobs_get_exactly_their_slots(dl: Env) -> None:
    """CUDA_VISIBLE_DEVICES holds exactly the job's fake GPU UUIDs; DET_SLOT_IDS its slots."""
    dl.daemon_start(**GPU4)
    a = dl.cmd(*dl.held("a", "env > a.env; "), slots=2)
    env = read_env(dl.tmp / "a.env")
    assert env["CUDA_VISIBLE_DEVICES"] == f"{fake_uuid(0)},{fake_uuid(1)}"
    assert json.loads(env["DET_SLOT_IDS"]) == [0, 1]
    assert env["DET_LOCAL_JOB_ID"] == str(a)

    # a 2-slot trial gets the other two
    cfg, ctx = dl.context(
        "", {"entrypoint": f"env > {dl.tmp / 't.env'}", "resources": {"slots_per_trial": 2}}
    )
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    env = read_env(dl.tmp / "t.env")
    assert env["CUDA_VISIBLE_DEVICES"] == f"{fake_uuid(2)},{fake_uuid(3)}"
    assert json.loads(env["DET_SLOT_IDS"]) == [2, 3]
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, what="the trial")

    # freed slots are handed out again, lowest first
    b = dl.cmd("sh", "-c", "env > b.env", slots=1)
    assert read_env(dl.tmp / "b.env")["CUDA_VISIBLE_DEVICES"] == fake_uuid(2)
    dl.wait_job(b)
    dl.release("a")
    dl.wait_job(a)


def test_gang_a_job_gets_all_its_slots_or_waits(dl: Env) -> None:
    dl.daemon_start(**GPU4)
    a = dl.cmd(*dl.held("a"), slots=2)
    started(dl, "a")
    b = dl.cmd(*dl.held("b", "env > b.env; "), slots=3)
    assert dl.job(a).slots == [0, 1]
    listed = {j["id"]: j for j in dl.json("job", "list")}
    assert listed[b]["state"] == "QUEUED" and listed[b]["slots"] == []
    assert listed[b]["slots_needed"] == 3
    assert dl.det("job", "list").out.splitlines()[3].split(" | ")[6].strip() == "0/3"
    assert scheduled_slots(dl) == [0, 1]  # 2 free slots stay free: no partial start
    dl.release("a")
    started(dl, "b")
    env = read_env(dl.tmp / "b.env")
    assert env["CUDA_VISIBLE_DEVICES"].split(",") == [fake_uuid(i) for i in (0, 1, 2)]
    assert dl.job(b).slots == [0, 1, 2]
    dl.release("b")
    dl.wait_job(b)


@pytest.mark.parametrize(
    "n, fragment",
    [
        (5, "resources.slots_per_trial 5 is more than this machine's 4 slots; set it to 4 or less"),
        (0, "resources.slots_per_trial is 0: this job needs a slot; set it to at least 1"),
    ],
)
def test_slots_per_trial_checked_at_submission(dl: Env, n: int, fragment: str) -> None:
    pid = dl.daemon_start(**GPU4)
    cfg, ctx = dl.context("", {"entrypoint": "true", "resources": {"slots_per_trial": n}})
    one_line_error(dl.det("run", cfg, ctx), fragment)
    one_line_error(dl.det("run", "--detach", cfg, ctx), fragment)
    assert dl.json("experiment", "list", "--all") == [] and dl.jobs() == []
    assert not gone(pid)


def test_cmd_slots_checked_at_submission(dl: Env) -> None:
    dl.daemon_start(**GPU4)
    one_line_error(
        dl.det("cmd", "run", "--slots", "5", "--", "true"),
        "--slots 5 is more than this machine's 4 slots; set it to 4 or less",
    )
    one_line_error(dl.det("cmd", "run", "--slots", "-1", "--", "true"), "--slots -1 is negative")
    assert dl.jobs() == []
    # a command may need no slot at all: it starts whatever the queue holds
    dl.cmd(*dl.held("a"), slots=4)
    started(dl, "a")
    z = dl.cmd("sh", "-c", "echo $CUDA_VISIBLE_DEVICES. > z.out", slots=0)
    assert dl.wait_job(z).exit_code == 0
    assert (dl.tmp / "z.out").read_text() == ".\n"
    dl.release("a")


def test_cpu_slots_run_that_many_jobs_at_once(dl: Env) -> None:
    dl.daemon_start(DET_LOCAL_FAKE_GPUS="0", DET_LOCAL_CPU_SLOTS="2")
    ids = [dl.cmd(*dl.held(n, f"env > {n}.env; ")) for n in ("a", "b", "c")]
    started(dl, "a", "b")
    # both start at once: which of them writes first is theirs to race
    assert sorted(dl.order()) == ["a", "b"] and states(dl)[ids[2]] == "QUEUED"
    env = read_env(dl.tmp / "a.env")
    assert env["CUDA_VISIBLE_DEVICES"] == "" and json.loads(env["DET_SLOT_IDS"]) == [0]
    slots = dl.json("slots")
    assert [(s["index"], s["kind"]) for s in slots] == [(0, "cpu"), (1, "cpu")]
    assert [s["allocation"] for s in slots] == [
        f"command {ids[0]} ({ME})",
        f"command {ids[1]} ({ME})",
    ]
    dl.release("a")
    started(dl, "c")
    assert json.loads(read_env(dl.tmp / "c.env")["DET_SLOT_IDS"]) == [0]
    dl.release("b", "c")
    for i in ids:
        assert dl.wait_job(i).exit_code == 0


def _real_gpus() -> list[str]:
    """The UUIDs NVML reports, [] without a usable GPU."""
    try:
        import pynvml as nv

        nv.nvmlInit()
        try:
            return [
                str(nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(i)))
                for i in range(nv.nvmlDeviceGetCount())
            ]
        finally:
            nv.nvmlShutdown()
    except Exception:
        return []


@pytest.mark.gpu
@pytest.mark.skipif(not _real_gpus(), reason="needs an NVIDIA GPU")
def test_jobs_get_exactly_their_real_gpus(dl: Env) -> None:
    uuids = _real_gpus()
    dl.setenv(DET_LOCAL_FAKE_GPUS=None)
    dl.daemon_start()
    assert [s["uuid"] for s in dl.json("slots")] == uuids
    a = dl.cmd(*dl.held("a", "env > a.env; "), slots=1)
    assert read_env(dl.tmp / "a.env")["CUDA_VISIBLE_DEVICES"] == uuids[0]
    assert dl.json("slots")[0]["allocation"] == f"command {a} ({ME})"
    if len(uuids) > 1:
        b = dl.cmd("sh", "-c", "env > b.env", slots=len(uuids) - 1)
        assert read_env(dl.tmp / "b.env")["CUDA_VISIBLE_DEVICES"].split(",") == uuids[1:]
        dl.wait_job(b)
    dl.release("a")
    dl.wait_job(a)


@pytest.fixture
def foreign() -> Any:
    """A process that det-local did not start, pretending to use fake GPU 1."""
    p = subprocess.Popen(["sleep", "300"])
    yield p
    p.kill()
    p.wait()


@pytest.mark.parametrize("busy", [True, False])
def test_foreign_gpu_process(dl: Env, foreign: Any, busy: bool) -> None:
    dl.setenv(DET_LOCAL_FAKE_GPU_FOREIGN=f"1:{foreign.pid}")
    dl.daemon_start({"slots": {"foreign_gpus_busy": busy}}, **GPU4)
    slots = dl.json("slots")
    assert slots[1]["foreign"] == [{"pid": foreign.pid, "user": ME}]
    assert f"other: {ME} (pid {foreign.pid})" in dl.det("slots").out
    assert [s["foreign"] for s in slots if s["index"] != 1] == [[], [], []]

    ids = [dl.cmd(*dl.held(n, f"env > {n}.env; ")) for n in ("a", "b", "c", "d")]
    if not busy:  # seen, but not counted: all four run
        started(dl, "a", "b", "c", "d")
        assert scheduled_slots(dl) == [0, 1, 2, 3]
    else:
        started(dl, "a", "b", "c")
        assert scheduled_slots(dl) == [0, 2, 3] and states(dl)[ids[3]] == "QUEUED"
        assert read_env(dl.tmp / "b.env")["CUDA_VISIBLE_DEVICES"] == fake_uuid(2)
        # the foreign process ends: its GPU is handed out without any other event
        foreign.kill()
        foreign.wait()
        started(dl, "d")
        assert read_env(dl.tmp / "d.env")["CUDA_VISIBLE_DEVICES"] == fake_uuid(1)
    dl.release("a", "b", "c", "d")
    for i in ids:
        dl.wait_job(i)


# ---------------------------------------------------------------------------- priority, FIFO
def test_priority_order_and_fifo_among_equals(dl: Env) -> None:
    dl.daemon_start(**CPU1)
    hold = dl.cmd(*dl.held("hold"), name="hold")
    started(dl, "hold")
    for name, prio in [("a", 50), ("b", 10), ("c", 10), ("d", 42), ("e", 1), ("f", 42)]:
        dl.cmd("sh", "-c", f"echo {name} >> order", priority=prio, name=name)

    # the list shows the order the scheduler goes by
    table = dl.det("job", "list").out.splitlines()
    assert [c.strip() for c in table[0].split("|")] == [
        "#",
        "ID",
        "Type",
        "Name",
        "Priority",
        "Submitted",
        "Slots",
        "State",
        "User",
    ]
    rows = [[c.strip() for c in line.split("|")] for line in table[2:]]
    assert [(r[0], r[3], r[4], r[6], r[7], r[8]) for r in rows] == [
        ("1", "hold", "42", "1/1", "SCHEDULED", ME),
        ("2", "e", "1", "0/1", "QUEUED", ME),
        ("3", "b", "10", "0/1", "QUEUED", ME),
        ("4", "c", "10", "0/1", "QUEUED", ME),
        ("5", "d", "42", "0/1", "QUEUED", ME),
        ("6", "f", "42", "0/1", "QUEUED", ME),
        ("7", "a", "50", "0/1", "QUEUED", ME),
    ]
    listed = dl.json("job", "list")
    assert [(j["position"], j["name"], j["kind"], j["state"]) for j in listed][1:3] == [
        (2, "e", "COMMAND", "QUEUED"),
        (3, "b", "COMMAND", "QUEUED"),
    ]
    assert listed[0]["id"] == hold and listed[0]["slots"] == [0] and listed[0]["user"] == ME
    assert all(isinstance(j["submitted_at"], float) for j in listed)
    assert "env" not in listed[0] and "token" not in listed[0]

    dl.release("hold")
    wait_for(lambda: len(dl.order()) == 7, what="every job to run")
    assert dl.order() == ["hold", "e", "b", "c", "d", "f", "a"]
    assert dl.json("job", "list") == []
    assert len(dl.json("job", "list", "--all")) == 7


def test_job_update_priority_ahead_behind_and_batch(dl: Env) -> None:
    dl.daemon_start(**CPU1)
    dl.cmd(*dl.held("hold"))
    started(dl, "hold")
    a, b, c, d = (dl.cmd("sh", "-c", f"echo {n} >> order", name=n) for n in "abcd")

    def queue() -> list[str]:
        return [j["name"] for j in dl.json("job", "list") if j["state"] == "QUEUED"]

    assert queue() == ["a", "b", "c", "d"]
    r = dl.det("job", "update", d, "--priority", 10)
    assert (r.rc, r.out.strip()) == (0, f"job {d}: priority 10"), r
    assert queue() == ["d", "a", "b", "c"]
    r = dl.det("job", "update", c, "--ahead-of", a)
    assert (r.rc, r.out.strip()) == (0, f"job {c}: ahead of job {a}"), r
    assert queue() == ["d", "c", "a", "b"]
    r = dl.det("job", "update", a, "--behind-of", b)
    assert (r.rc, r.out.strip()) == (0, f"job {a}: behind job {b}"), r
    assert queue() == ["d", "c", "b", "a"]
    # ahead of a more important job: it takes that job's priority too
    r = dl.det("job", "update", b, "--ahead-of", d)
    assert r.rc == 0 and dl.job(b).priority == 10, r
    assert queue() == ["b", "d", "c", "a"]

    r = dl.det("job", "update-batch", f"{a}.priority=5", f"{b}.behind-of={c}")
    assert r.rc == 0 and r.out.splitlines() == [f"job {a}: priority 5", f"job {b}: behind job {c}"]
    assert queue() == ["a", "d", "c", "b"]

    # bad updates change nothing, and say why
    one_line_error(dl.det("job", "update", a, "--priority", 0), "priority 0 is outside 1-99")
    one_line_error(dl.det("job", "update", a, "--priority", 100), "priority 100 is outside 1-99")
    one_line_error(dl.det("job", "update", a), "give exactly one of --priority")
    one_line_error(dl.det("job", "update", a, "--priority", 3, "--ahead-of", b), "exactly one")
    one_line_error(dl.det("job", "update", a, "--ahead-of", a), "relative to itself")
    one_line_error(dl.det("job", "update-batch", "1.prio=3"), "cannot read '1.prio=3'")
    # a batch is checked as a whole: one unknown job, nothing applied
    one_line_error(dl.det("job", "update-batch", f"{c}.priority=1", "99.priority=1"), "job 99")
    assert dl.job(c).priority == 42
    assert queue() == ["a", "d", "c", "b"]

    dl.release("hold")
    wait_for(lambda: len(dl.order()) == 5, what="every job to run")
    assert dl.order() == ["hold", "a", "d", "c", "b"]
    one_line_error(dl.det("job", "update", a, "--priority", 3), f"job {a} has ended")


# ---------------------------------------------------------------------------- preemption
def test_preemption_checkpoints_requeues_and_resumes(dl: Env) -> None:
    dl.daemon_start(**CPU1)
    hp = {"batches": 40, "ckpt_every": 5, "delay": 0.03, "record": str(dl.record_path)}
    cfg, ctx = dl.trainer(hp, {"resources": {"priority": 50}})
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(lambda: len(steps(dl, 1)) >= 3, what="the trial to train")
    urgent = dl.cmd(*dl.held("urgent"), priority=1)
    started(dl, "urgent")
    # the trial checkpointed where it stopped and waits in the queue, holding no slot
    job = trial_job(dl, 1)
    assert job.state == "QUEUED" and job.slots == [] and job.priority == 50
    assert dl.job(urgent).slots == [0]
    stopped_at = dl.trial(1).steps_completed
    assert 3 <= stopped_at < 40
    assert max(c.steps_completed for c in dl.checkpoints(1)) == stopped_at
    assert any("preempted" in e for e in dl.events(1))
    assert dl.experiment(1).state == State.ACTIVE

    dl.release("urgent")
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, what="the trial to finish")
    runs = dl.records()
    assert [r["run"] for r in runs] == [1, 2]
    assert runs[1]["start"] == stopped_at  # resumed from the preemption checkpoint
    assert steps(dl, 1) == list(range(1, 41))  # nothing trained twice, nothing skipped
    assert dl.metrics(1, "validation")[-1].metrics["x"] == sum(range(40))
    assert dl.wait_job(urgent).exit_code == 0


def test_no_preemption_when_switched_off(dl: Env) -> None:
    dl.daemon_start({"scheduler": {"preemption": False}}, **CPU1)
    hp = {"batches": 30, "ckpt_every": 10, "delay": 0.03, "record": str(dl.record_path)}
    cfg, ctx = dl.trainer(hp, {"resources": {"priority": 50}})
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(lambda: len(steps(dl, 1)) >= 2, what="the trial to train")
    urgent = dl.cmd("sh", "-c", "echo urgent >> order", priority=1)
    assert dl.wait_job(urgent).exit_code == 0
    # the trial ran to its end, in one run, before the urgent command got the slot
    assert len(dl.records()) == 1
    assert trial_job(dl, 1).ended_at <= dl.job(urgent).started_at
    assert dl.trial(1).state == State.COMPLETED


_STUBBORN = """
import os, time
import determined as det

run = int(os.environ["DET_TRIAL_RUN_ID"])
info = det.get_cluster_info()
with det.core.init() as core:
    if run == 1:
        with core.checkpoint.store_path({"steps_completed": 1}) as (path, _):
            (path / "state").write_text("1")
        core.train.report_training_metrics(steps_completed=1, metrics={"loss": 1.0})
        print("ignoring preemption", flush=True)
        while True:  # never looks at should_preempt()
            time.sleep(0.02)
    print(f"run {run} resumes from {info.latest_checkpoint}", flush=True)
    core.train.report_validation_metrics(steps_completed=2, metrics={"loss": 0.5})
"""


def test_trial_ignoring_preemption_is_killed_after_the_timeout(dl: Env) -> None:
    dl.daemon_start({"scheduler": {"preemption_timeout": 1}}, **CPU1)
    cfg, ctx = dl.context(_STUBBORN, {"resources": {"priority": 50}})
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(lambda: "ignoring preemption" in dl.log(1, 1), what="the trial")
    ckpt = dl.checkpoints(1)[0].uuid
    urgent = dl.cmd(*dl.held("urgent"), priority=1)
    started(dl, "urgent")  # after the timeout, the trial was stopped
    assert trial_job(dl, 1).state == "QUEUED"
    dl.release("urgent")
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, what="the trial to finish")
    assert f"run 2 resumes from {ckpt}" in dl.log(1, 1)
    dl.wait_job(urgent)


def test_pause_of_a_trial_ignoring_preemption_is_stopping_paused_until_it_exits(
    dl: Env,
) -> None:
    dl.daemon_start(**CPU1)
    cfg, ctx = dl.context(_STUBBORN, {"preemption_timeout": 3})
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(lambda: "ignoring preemption" in dl.log(1, 1), what="the trial")
    wrapper = dl.job_pid(trial_job(dl, 1).id)
    r = dl.det("experiment", "pause", 1)
    assert (r.rc, r.out.strip()) == (0, "experiment 1 paused"), r
    # its process still runs (until the 3 s preemption timeout): not PAUSED yet
    state, trial_state = dl.experiment(1).state, dl.trial(1).state
    assert not gone(wrapper), "the trial stopped before the states were read"
    assert (state, trial_state) == (State.STOPPING_PAUSED, State.ACTIVE)
    listed = dl.json("experiment", "list")
    assert [e["state"] for e in listed] == ["STOPPING_PAUSED"] or gone(wrapper), listed
    r = dl.det("experiment", "pause", 1)
    assert (r.rc, r.out.strip()) == (0, "experiment 1 is already paused"), r
    # killed at the preemption timeout: PAUSED, and resumable from its checkpoint
    wait_for(lambda: dl.experiment(1).state == State.PAUSED, what="the pause to complete")
    assert gone(wrapper) and dl.trial(1).state == State.PAUSED
    assert [e["state"] for e in dl.json("experiment", "list")] == ["PAUSED"]
    ckpt = dl.checkpoints(1)[0].uuid
    r = dl.det("experiment", "activate", 1)
    assert (r.rc, r.out.strip()) == (0, "experiment 1 activated"), r
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, what="the trial to finish")
    assert f"run 2 resumes from {ckpt}" in dl.log(1, 1)


# ---------------------------------------------------------------------------- caps, backfill
def test_max_slots_per_experiment(dl: Env) -> None:
    dl.daemon_start(**GPU4)
    gate = dl.tmp / "gate"
    script = (
        "import pathlib, sys, time\n"
        f"gate = pathlib.Path({str(gate)!r})\n"
        "d = time.monotonic() + 60\n"
        "while not gate.exists() and time.monotonic() < d:\n"
        "    time.sleep(0.02)\n"
    )
    cfg, ctx = dl.context(
        script,
        {
            "searcher": {"name": "grid", "metric": "loss", "max_length": 1},
            "hyperparameters": {"n": {"type": "categorical", "vals": [1, 2, 3, 4]}},
            "resources": {"max_slots": 2},
        },
    )
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(lambda: len(scheduled_slots(dl)) == 2, what="two trials to start")
    # two slots are free, yet the other two trials wait for the experiment's cap
    assert sorted(states(dl).values()) == ["QUEUED", "QUEUED", "SCHEDULED", "SCHEDULED"]
    other = dl.cmd("sh", "-c", "echo other >> order")
    assert dl.wait_job(other).exit_code == 0  # the free slots are usable by others
    assert sorted(states(dl).values()).count("SCHEDULED") == 2
    # a trial's job takes the priority of its experiment: updating one updates them all
    queued = next(j for j in dl.jobs() if j.state == "QUEUED")
    r = dl.det("job", "update", queued.id, "--priority", 7)
    assert (r.rc, r.out.strip()) == (0, "experiment 1: priority 7"), r
    assert {j.priority for j in dl.jobs() if j.trial_id is not None} == {7}
    gate.touch()
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=60, what="the trials")
    assert [t.state for t in dl.trials(1)] == [State.COMPLETED] * 4


def test_user_quota(dl: Env) -> None:
    dl.daemon_start({"scheduler": {"user_quota": {ME: 2}}}, **GPU4)
    ids = [dl.cmd(*dl.held(n)) for n in "abc"]
    started(dl, "a", "b")
    assert [states(dl)[i] for i in ids] == ["SCHEDULED", "SCHEDULED", "QUEUED"]
    assert scheduled_slots(dl) == [0, 1]  # slots 2 and 3 stay free
    dl.release("a")
    started(dl, "c")
    order = dl.order()  # a and b started at once (either wrote first), c after a ended
    assert sorted(order[:2]) == ["a", "b"] and order[2:] == ["c"], order
    dl.release("b", "c")
    for i in ids:
        dl.wait_job(i)


def test_backfill_and_preemption_of_the_backfilled_trial(dl: Env) -> None:
    """A big job waits for slots; a small equally important command does not pass it (that
    could delay it), but a less important trial does, in the free slots, and is preempted as
    soon as the big job can start."""
    dl.daemon_start(**GPU4)
    dl.cmd(*dl.held("hold"), slots=2)
    started(dl, "hold")
    big = dl.cmd(*dl.held("big"), slots=4)
    small = dl.cmd("sh", "-c", "echo small >> order", slots=1)
    hp = {"batches": 200, "ckpt_every": 10, "delay": 0.02, "record": str(dl.record_path)}
    cfg, ctx = dl.trainer(hp, {"resources": {"priority": 50}})
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(lambda: len(steps(dl, 1)) >= 2, what="the backfilled trial to train")
    assert trial_job(dl, 1).slots == [2]
    assert states(dl)[big] == "QUEUED" and states(dl)[small] == "QUEUED"

    dl.release("hold")
    started(dl, "big")  # the trial checkpointed and gave its slot back
    assert dl.job(big).slots == [0, 1, 2, 3]
    assert trial_job(dl, 1).state == "QUEUED"
    stopped_at = dl.trial(1).steps_completed
    dl.release("big")
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=60, what="the trial")
    assert dl.order() == ["hold", "big", "small"]
    assert [r["start"] for r in dl.records()] == [0, stopped_at]
    assert steps(dl, 1) == list(range(1, 201))


# ---------------------------------------------------------------------------- experiments
def test_experiment_pause_activate_kill_through_the_daemon(dl: Env) -> None:
    pid = dl.daemon_start(**CPU1)
    hp = {"batches": 300, "ckpt_every": 10, "delay": 0.02, "record": str(dl.record_path)}
    cfg, ctx = dl.trainer(hp)
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(lambda: len(steps(dl, 1)) >= 2, what="the trial to train")

    r = dl.det("experiment", "pause", 1)
    assert (r.rc, r.out.strip()) == (0, "experiment 1 paused"), r
    wait_for(lambda: dl.trial(1).state == State.PAUSED, what="the trial to pause")
    paused_at = dl.trial(1).steps_completed
    # (STOPPING_PAUSED until the engine has seen the trial's exit through)
    wait_for(lambda: dl.experiment(1).state == State.PAUSED, what="the experiment to pause")
    assert dl.json("job", "list") == []  # a paused trial holds no slot and waits for nothing
    # the slot is free for others meanwhile
    assert dl.wait_job(dl.cmd("true")).exit_code == 0

    r = dl.det("experiment", "activate", 1)
    assert (r.rc, r.out.strip()) == (0, "experiment 1 activated"), r
    wait_for(
        lambda: len(dl.records()) == 2 and len(steps(dl, 1)) > paused_at + 2,
        what="the trial to resume",
    )
    assert dl.records()[1]["start"] == paused_at
    trainer_pid = dl.records()[1]["pid"]
    # through the daemon too, the trial's log names the checkpoint the run resumed from
    (ckpt,) = [c for c in dl.checkpoints(1) if c.steps_completed == paused_at]
    logs = dl.det("trial", "logs", 1).out
    assert f"resuming from checkpoint {ckpt.uuid} at batch {paused_at}\n" in logs, logs

    r = dl.det("experiment", "kill", 1)
    assert (r.rc, r.out.strip()) == (0, "experiment 1 killed"), r
    wait_for(lambda: dl.experiment(1).state == State.CANCELED, what="the experiment to stop")
    wait_for(lambda: gone(trainer_pid), what="the trial process to go")
    assert dl.trial(1).state == State.CANCELED
    assert trial_job(dl, 1).state == "DONE"
    assert not gone(pid)


def test_programs_that_do_not_exist_are_refused_at_submission(dl: Env) -> None:
    dl.daemon_start(**CPU1)
    one_line_error(
        dl.det("cmd", "run", "--", "no-such-program-xyz", "--flag"),
        "program 'no-such-program-xyz' was not found on PATH",
    )
    one_line_error(
        dl.det("cmd", "run", "--", "./missing.sh"),
        "./missing.sh does not exist or is not executable",
    )
    (dl.tmp / "plain.txt").write_text("not executable")
    one_line_error(dl.det("cmd", "run", "--", "./plain.txt"), "is not executable")
    one_line_error(dl.det("cmd", "run"), "no command given")
    cfg, ctx = dl.context("", {"entrypoint": "no-such-program-xyz --epochs 3"})
    one_line_error(dl.det("run", cfg, ctx), "no-such-program-xyz")
    cfg, ctx = dl.context("", {"entrypoint": "python3 missing.py"}, name="ctx2")
    one_line_error(dl.det("run", cfg, ctx), "missing.py")
    assert dl.jobs() == [] and dl.json("experiment", "list", "--all") == []


# ---------------------------------------------------------------------------- commands
def test_cmd_records_output_and_exit_status(dl: Env) -> None:
    dl.daemon_start(**CPU1)
    r = dl.det("cmd", "run", "--", "sh", "-c", "echo hi; echo err >&2; exit 3")
    assert (r.rc, r.out.strip()) == (0, "Queued command 1"), r
    job = dl.wait_job(1)
    assert (job.exit_code, job.message) == (3, "command 1 exited with code 3")
    listed = dl.json("cmd", "list", "--all")
    assert [(c["id"], c["state"], c["exit_code"], c["argv"]) for c in listed] == [
        (1, "DONE", 3, ["sh", "-c", "echo hi; echo err >&2; exit 3"])
    ]
    assert dl.json("cmd", "list") == []
    table = dl.det("cmd", "list", "--all").out.splitlines()
    assert [c.strip() for c in table[2].split("|")][:4] == ["1", "DONE", "3", "1"]
    assert dl.det("cmd", "logs", 1).out == "hi\nerr\n"
    # the exit file of the wrapper agrees
    assert dl.paths.job_exit_file(1, job.run_id).read_text().strip() == "3"


def test_cmd_run_follow_exits_with_the_commands_status(dl: Env) -> None:
    dl.daemon_start(**CPU1)
    r = dl.det("cmd", "run", "-f", "--", "sh", "-c", "echo one; echo two; exit 5")
    assert r.rc == 5, r
    assert r.out == "Queued command 1\none\ntwo\n"
    r = dl.det("cmd", "run", "--follow", "--", "sh", "-c", "kill -9 $$")
    assert r.rc == 137, r  # killed by SIGKILL, as a shell reports it
    r = dl.det("cmd", "logs", "-f", 1)
    assert (r.rc, r.out) == (5, "one\ntwo\n")


def test_cmd_kill_stops_the_whole_process_group(dl: Env) -> None:
    pid = dl.daemon_start(**CPU1)
    script = "sleep 1000 & echo $! > bg.pid; echo $$ > sh.pid; sleep 1000"
    a = dl.cmd("sh", "-c", script)
    queued = dl.cmd("sh", "-c", "echo next >> order")
    removed = dl.cmd("sh", "-c", "echo never >> order")
    wait_for(
        lambda: (dl.tmp / "bg.pid").exists() and (dl.tmp / "sh.pid").exists(),
        what="the command to start",
    )
    wrapper = dl.job_pid(a)
    tree = [wrapper, *(c.pid for c in psutil.Process(wrapper).children(recursive=True))]
    assert int((dl.tmp / "bg.pid").read_text()) in tree and len(tree) >= 4

    r = dl.det("cmd", "kill", removed)
    assert (r.rc, r.out.strip()) == (0, f"command {removed} removed from the queue"), r
    r = dl.det("cmd", "kill", a)
    assert (r.rc, r.out.strip()) == (0, f"command {a} is being stopped"), r
    job = dl.wait_job(a)
    assert job.message == "killed on request" and job.exit_code is not None
    wait_for(lambda: all(gone(p) for p in tree), what="every process of the command to go")
    # its slot went to the next command; the removed one never ran
    assert dl.wait_job(queued).exit_code == 0
    assert dl.order() == ["next"]
    assert dl.job(removed).message == "removed from the queue on request"
    r = dl.det("cmd", "kill", a)
    assert (r.rc, r.out.strip()) == (0, f"command {a} already ended"), r
    assert not gone(pid)
