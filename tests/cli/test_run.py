"""`det-local run` end to end: real CLI processes, real trial processes, the real store.

The trials run tests/fixtures/trainer.py (a Core API script in the style of Determined's
2_checkpoints tutorial) or small inline scripts; every wait is a bounded poll.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from det_local.store.states import State
from tests.support.world import Env, gone, wait_for


def _training_steps(dl: Env, trial_id: int) -> list[int]:
    return [m.steps_completed for m in dl.metrics(trial_id, "training")]


def _wait_for_step(dl: Env, trial_id: int, step: int) -> None:
    wait_for(
        lambda: step in _training_steps(dl, trial_id),
        what=f"trial {trial_id} to report training steps_completed={step}",
    )


def _wait_started(proc: Any, dl: Env) -> None:
    wait_for(lambda: dl.paths.db.exists() and "Created experiment" in proc.out, what="the run")


# ---------------------------------------------------------------------------- basics
def test_run_streams_output_records_metrics_and_exits_0(dl: Env) -> None:
    cfg, ctx = dl.trainer({"batches": 6, "ckpt_every": 3}, {"name": "basics"})
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    lines = r.out.splitlines()
    assert lines[0] == "Created experiment 1"
    # the trial's own output is streamed, then the summary follows
    assert lines.index("run 1 starts at batch 0") < lines.index("run 1 done: x=15")
    summary = r.out[r.out.index("Experiment 1 (basics) COMPLETED") :]
    assert "trial 1: COMPLETED, steps_completed=6" in summary
    assert "last validation (steps_completed=6): loss=0.166667, x=15" in summary
    # checkpoint GC at the end (save_trial_best 1, save_trial_latest 1: both the one at 6)
    assert "checkpoints: 1, latest" in summary
    assert "Traceback" not in r.out + r.err

    exps = dl.json("experiment", "list")
    assert [(e["id"], e["name"], e["state"], e["progress"]) for e in exps] == [
        (1, "basics", "COMPLETED", 1.0)
    ]
    trials = dl.json("trial", "list", 1)
    assert [(t["id"], t["state"], t["steps_completed"]) for t in trials] == [(1, "COMPLETED", 6)]
    described = dl.json("trial", "describe", 1)
    assert described["metrics"]["validation"]["metrics"] == {"loss": 1 / 6, "x": 15}
    assert described["metrics"]["training"]["steps_completed"] == 6
    assert [(c["steps_completed"], c["state"]) for c in described["checkpoints"]] == [
        (3, "DELETED"),
        (6, "COMPLETED"),
    ]
    assert described["trial"]["latest_checkpoint"] == described["checkpoints"][-1]["uuid"]

    assert _training_steps(dl, 1) == [1, 2, 3, 4, 5, 6]
    assert [m.metrics["x"] for m in dl.metrics(1, "training")] == [0, 1, 3, 6, 10, 15]
    # the log holds the trial's output too
    assert "run 1 done: x=15" in dl.log(1, 1)


# ---------------------------------------------------------------------------- pause / resume
def _check_resumed_exactly(dl: Env, trial_id: int, batches: int, paused_at: int) -> None:
    """The second run started from the pause checkpoint and trained every batch once."""
    runs = dl.records()
    assert [r["run"] for r in runs] == [1, 2], runs
    second = runs[1]
    assert second["start"] == second["env_steps"] == second["info_steps"] == paused_at, runs
    ckpts = dl.checkpoints(trial_id)
    at_pause = next(c for c in ckpts if c.steps_completed == paused_at)
    assert second["latest"] == second["env_latest"] == at_pause.uuid
    assert _training_steps(dl, trial_id) == list(range(1, batches + 1))
    final = dl.metrics(trial_id, "validation")[-1]
    assert final.metrics["x"] == sum(range(batches))  # no batch skipped or repeated
    trial = dl.trial(1)
    assert trial.state == State.COMPLETED and trial.steps_completed == batches


def test_ctrl_c_pauses_and_activate_resumes_from_the_checkpoint(dl: Env) -> None:
    hp = {"batches": 20, "ckpt_every": 4, "hold_at": 6, "record": str(dl.record_path)}
    cfg, ctx = dl.trainer(hp)
    run = dl.start("run", cfg, ctx)
    _wait_started(run, dl)
    _wait_for_step(dl, 1, 6)
    run.signal(signal.SIGINT)  # det-local only, as a terminal's Ctrl-C (trials have a session)
    r = run.wait()
    assert r.rc == 3, r
    assert "pausing; trials are asked to checkpoint" in r.err
    assert "run 1 preempted after batch 6" in r.out
    assert "Experiment 1 (ctx) PAUSED" in r.out
    assert "resume with: det-local experiment activate 1" in r.out
    assert dl.experiment(1).state == State.PAUSED
    trial = dl.trial(1)
    assert trial.state == State.PAUSED and trial.steps_completed == 6
    assert [c.steps_completed for c in dl.checkpoints(1)] == [4, 6]

    # no daemon runs: activate runs the experiment in the foreground
    r = dl.det("experiment", "activate", 1)
    assert r.rc == 0, r
    assert "experiment 1 activated" in r.out
    assert "run 2 starts at batch 6" in r.out
    # what the first run wrote was shown then; the resumed run's output only, now
    assert "run 1 " not in r.out, r.out
    assert r.out.index("experiment 1 activated") < r.out.index("run 2 starts at batch 6")
    assert "Experiment 1 (ctx) COMPLETED" in r.out
    assert dl.experiment(1).state == State.COMPLETED
    _check_resumed_exactly(dl, 1, 20, 6)
    # the trial's log says where the run started (issue 36), once: run 1 started fresh
    (ckpt,) = [c for c in dl.checkpoints(1) if c.steps_completed == 6]
    r = dl.det("trial", "logs", 1)
    assert r.rc == 0 and r.out.count("resuming from checkpoint") == 1, r
    assert f"trial 1 run 2: resuming from checkpoint {ckpt.uuid} at batch 6\n" in r.out, r.out


def test_pause_from_another_cli_while_running(dl: Env) -> None:
    hp = {"batches": 12, "ckpt_every": 5, "hold_at": 3, "record": str(dl.record_path)}
    cfg, ctx = dl.trainer(hp)
    run = dl.start("run", cfg, ctx)
    _wait_started(run, dl)
    _wait_for_step(dl, 1, 3)
    r = dl.det("experiment", "pause", 1)
    assert (r.rc, r.out.strip()) == (0, "experiment 1 paused"), r
    r = run.wait()
    assert r.rc == 3, r
    assert "run 1 preempted after batch 3" in r.out
    assert dl.experiment(1).state == State.PAUSED
    assert dl.trial(1).steps_completed == 3
    # pausing again is harmless; a paused experiment cannot be paused into anything else
    assert dl.det("experiment", "pause", 1).out.strip() == "experiment 1 is already paused"

    r = dl.det("experiment", "activate", 1)
    assert r.rc == 0, r
    _check_resumed_exactly(dl, 1, 12, 3)


def test_kill_from_another_cli_cancels_and_leaves_no_process(dl: Env) -> None:
    hp = {"batches": 10, "hold_at": 2, "child": True, "record": str(dl.record_path)}
    cfg, ctx = dl.trainer(hp)
    run = dl.start("run", cfg, ctx)
    _wait_started(run, dl)
    wait_for(lambda: dl.records(), what="the trial to start")
    pid, child = dl.records()[0]["pid"], dl.records()[0]["child"]
    assert not gone(pid) and not gone(child)
    r = dl.det("experiment", "kill", 1)
    assert (r.rc, r.out.strip()) == (0, "experiment 1 killed"), r
    r = run.wait()
    assert r.rc == 2, r
    assert "Experiment 1 (ctx) CANCELED" in r.out
    assert dl.experiment(1).state == State.CANCELED
    assert dl.trial(1).state == State.CANCELED
    wait_for(lambda: gone(pid) and gone(child), timeout=15, what="the trial's processes to end")
    r = dl.det("experiment", "kill", 1)
    assert r.out.strip() == "experiment 1 is already CANCELED", r


IGNORES_PREEMPTION = """
import os, subprocess, sys, time
child = subprocess.Popen(["sleep", "300"])
with open(sys.argv[1], "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
print("training without ever checking should_preempt()", flush=True)
time.sleep(300)
"""


def test_second_ctrl_c_stops_at_once(dl: Env) -> None:
    pidfile = dl.tmp / "trial.pid"
    cfg, ctx = dl.context(IGNORES_PREEMPTION, {"entrypoint": f"python3 train.py {pidfile}"})
    run = dl.start("run", cfg, ctx)
    wait_for(pidfile.exists, what="the trial to start")
    wait_for(lambda: len(pidfile.read_text().split()) == 2, what="the pid file")
    pid, child = (int(p) for p in pidfile.read_text().split())
    run.signal(signal.SIGINT)
    wait_for(lambda: "Ctrl-C again to stop now" in run.err, what="the first Ctrl-C")
    assert run.popen.poll() is None  # still waiting for the trial to checkpoint
    run.signal(signal.SIGINT)
    r = run.wait(timeout=15)  # well before the 30 s preemption timeout
    assert r.rc == 3, r
    assert "stopping now" in r.err
    assert dl.experiment(1).state == State.PAUSED
    wait_for(lambda: gone(pid) and gone(child), timeout=10, what="the trial's processes to end")


def test_trial_ignoring_preemption_is_stopped_after_preemption_timeout(dl: Env) -> None:
    pidfile = dl.tmp / "trial.pid"
    config = {"entrypoint": f"python3 train.py {pidfile}", "preemption_timeout": 1}
    cfg, ctx = dl.context(IGNORES_PREEMPTION, config)
    run = dl.start("run", cfg, ctx)
    wait_for(lambda: pidfile.exists() and len(pidfile.read_text().split()) == 2, what="trial")
    pid, child = (int(p) for p in pidfile.read_text().split())
    run.signal(signal.SIGINT)
    r = run.wait(timeout=20)  # SIGTERM after 1 s
    assert r.rc == 3, r
    assert dl.experiment(1).state == State.PAUSED
    assert dl.trial(1).state == State.PAUSED
    wait_for(lambda: gone(pid) and gone(child), timeout=10, what="the trial's processes to end")


def test_kill_a_paused_experiment_with_no_engine_running(dl: Env) -> None:
    hp = {"batches": 10, "hold_at": 2}
    cfg, ctx = dl.trainer(hp)
    run = dl.start("run", cfg, ctx)
    _wait_started(run, dl)
    _wait_for_step(dl, 1, 2)
    run.signal(signal.SIGINT)
    assert run.wait().rc == 3
    r = dl.det("experiment", "kill", 1)
    assert (r.rc, r.out.strip()) == (0, "experiment 1 killed"), r
    assert dl.experiment(1).state == State.CANCELED
    assert dl.trial(1).state == State.CANCELED


# ---------------------------------------------------------------------------- restarts
def test_max_restarts_resumes_from_latest_checkpoint_each_time(dl: Env) -> None:
    hp = {"batches": 9, "ckpt_every": 3, "crash_runs": 2, "record": str(dl.record_path)}
    cfg, ctx = dl.trainer(hp, {"max_restarts": 2})
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    assert "restarting from its latest checkpoint (restart 1 of 2)" in r.err
    assert "restarting from its latest checkpoint (restart 2 of 2)" in r.err
    trial = dl.trial(1)
    assert (trial.state, trial.restarts, trial.run_id) == (State.COMPLETED, 2, 3)
    assert "restarts=2" in r.out
    runs = dl.records()
    ckpts = {c.steps_completed: c.uuid for c in dl.checkpoints(1)}
    assert [(x["run"], x["start"], x["env_steps"]) for x in runs] == [
        (1, 0, 0),
        (2, 3, 3),
        (3, 6, 6),
    ]
    assert [x["latest"] for x in runs] == [None, ckpts[3], ckpts[6]]
    assert [x["env_latest"] for x in runs] == [None, ckpts[3], ckpts[6]]
    assert _training_steps(dl, 1) == list(range(1, 10))
    assert dl.metrics(1, "validation")[-1].metrics["x"] == sum(range(9))


def test_max_restarts_exhausted_is_an_error(dl: Env) -> None:
    hp = {"batches": 9, "ckpt_every": 3, "crash_runs": 2, "record": str(dl.record_path)}
    cfg, ctx = dl.trainer(hp, {"max_restarts": 1})
    r = dl.det("run", cfg, ctx)
    assert r.rc == 1, r
    expected = "trial 1 exited with code 1 after 1 restart; see `det-local trial logs 1`"
    assert expected in r.out  # the summary
    assert f"det-local: {expected}" in r.err
    assert "Experiment 1 (ctx) ERROR" in r.out
    exp, trial = dl.experiment(1), dl.trial(1)
    assert exp.state == State.ERROR and expected in (exp.message or "")
    assert (trial.state, trial.restarts, trial.message) == (State.ERROR, 1, expected)
    assert len(dl.records()) == 2
    assert "run 2 crashes after batch 6" in dl.log(1, 1)


# ---------------------------------------------------------------------------- context
CONTEXT_SCRIPT = """
import os, pathlib, sys, time
go = pathlib.Path(sys.argv[1])
print(f"hook={os.environ.get('HOOK_VAR')}", flush=True)
print(f"ignored={os.path.exists('ignored.txt')} {os.path.exists('data')}", flush=True)
print(f"kept={os.path.exists('kept.txt')} {os.path.exists('sub/keep.txt')}", flush=True)
print("waiting", flush=True)
deadline = time.monotonic() + 60
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.01)
import helper
print(f"value={pathlib.Path('value.txt').read_text().strip()} helper={helper.VALUE}", flush=True)
"""


def test_startup_hook_detignore_and_snapshot(dl: Env) -> None:
    go = dl.tmp / "go"
    files = {
        "startup-hook.sh": "export HOOK_VAR=from-hook\n",
        ".detignore": "ignored.txt\ndata/\n",
        "ignored.txt": "x",
        "data/big.bin": "y" * 1000,
        "kept.txt": "k",
        "sub/keep.txt": "k",
        "value.txt": "original\n",
        "helper.py": "VALUE = 'original'\n",
    }
    cfg, ctx = dl.context(CONTEXT_SCRIPT, {"entrypoint": f"python3 train.py {go}"}, files=files)
    run = dl.start("run", cfg, ctx)
    wait_for(lambda: "waiting" in run.out, what="the trial to start")
    # edits after submission do not reach the running trial
    (ctx / "value.txt").write_text("edited\n")
    (ctx / "helper.py").write_text("VALUE = 'edited'\n")
    go.touch()
    r = run.wait()
    assert r.rc == 0, r
    assert "hook=from-hook" in r.out
    assert "ignored=False False" in r.out
    assert "kept=True True" in r.out
    assert "value=original helper=original" in r.out
    snapshot = Path(dl.experiment(1).context_dir)
    assert not (snapshot / "ignored.txt").exists() and not (snapshot / "data").exists()


def test_startup_hook_with_list_entrypoint(dl: Env) -> None:
    script = "import os, sys; print('hook', os.environ['HOOK_VAR'], sys.argv[1:])"
    files = {"startup-hook.sh": "export HOOK_VAR=list-form\n"}
    cfg, ctx = dl.context(script, {"entrypoint": ["python3", "train.py", "a b", "c"]}, files=files)
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    assert "hook list-form ['a b', 'c']" in r.out


# ---------------------------------------------------------------------------- two runs
WAITS_FOR_GO = """
import pathlib, sys, time
go = pathlib.Path(sys.argv[1])
print("first is running", flush=True)
deadline = time.monotonic() + 60
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.01)
print("first done" if go.exists() else "first gave up", flush=True)
"""


def test_second_run_submits_to_the_first_runs_engine(dl: Env) -> None:
    dl.env["DET_LOCAL_CPU_SLOTS"] = "2"  # both trials run at once
    go = dl.tmp / "go"
    cfg1, ctx1 = dl.context(WAITS_FOR_GO, {"entrypoint": f"python3 train.py {go}"}, name="one")
    cfg2, ctx2 = dl.context("print('second ran')", {}, name="two")
    first = dl.start("run", cfg1, ctx1)
    wait_for(lambda: "first is running" in first.out, what="the first run's trial")
    lock_owner = (dl.paths.run_dir / "engine.lock").read_text().split()[0]
    assert int(lock_owner) == first.pid

    r = dl.det("run", cfg2, ctx2)  # runs to its end while the first still runs
    assert r.rc == 0, r
    assert r.out.splitlines()[0] == "Created experiment 2"
    assert "second ran" in r.out
    assert "Experiment 2 (two) COMPLETED" in r.out
    assert first.popen.poll() is None
    assert dl.experiment(1).state == State.ACTIVE

    go.touch()
    r1 = first.wait()
    assert r1.rc == 0, r1
    assert "first done" in r1.out and "second ran" not in r1.out
    assert [(e["id"], e["state"]) for e in dl.json("experiment", "list")] == [
        (1, "COMPLETED"),
        (2, "COMPLETED"),
    ]


def test_concurrent_runs_all_complete(dl: Env) -> None:
    """Runs started together share whichever engine is up; none is lost when an engine ends
    just as another run submits to it."""
    contexts = [dl.context(f"print('run {i}')", {}, name=f"c{i}") for i in range(6)]
    procs = [dl.start("run", cfg, ctx) for cfg, ctx in contexts]
    results = [p.wait(timeout=90) for p in procs]
    failed = [r for r in results if r.rc != 0]
    assert not failed, failed
    exps = dl.json("experiment", "list")
    assert len(exps) == 6 and {e["state"] for e in exps} == {"COMPLETED"}, exps
