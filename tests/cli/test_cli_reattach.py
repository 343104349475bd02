"""Back to an experiment from another shell, through the real CLI against a real daemon:
`experiment logs [-f]` (every trial, prefixed, new trials as they come, the `[search]` line)
and `experiment wait` (until a terminal state; `run`'s exit codes; a pause is waited through),
Ctrl-C while following, and each bad input's one line."""

from __future__ import annotations

import io
import os
import re
import signal
from typing import Any

import psutil
import pytest
import yaml

from det_local import api
from det_local.client import attach
from det_local.errors import DetLocalError
from det_local.store.states import State
from det_local.views import logs as logviews
from tests.support.users import A, B, Shared
from tests.support.world import Env, one_line_error, wait_for

CPU2 = {"DET_LOCAL_FAKE_GPUS": "0", "DET_LOCAL_CPU_SLOTS": "2"}

# A Core API trial that says hello, waits for the test's gate file, reports a validation
# metric (smaller for a larger trial id) and says bye.
GATED = """
import pathlib, time
import determined as det

info = det.get_cluster_info()
gate = pathlib.Path(info.trial.hparams["gate"])
tid = info.trial.trial_id
with det.core.init() as core:
    print(f"hello from {tid}", flush=True)
    while not gate.exists():
        time.sleep(0.02)
    core.train.report_validation_metrics(steps_completed=1, metrics={"loss": 1.0 / tid})
    print(f"bye from {tid}", end="", flush=True)  # a last line without its newline
"""


def _gated(dl: Env, name: str, searcher: dict[str, Any], **hparams: Any) -> tuple[Any, Any]:
    gate = dl.tmp / f"gate-{name}"
    config = {
        "hyperparameters": {"gate": str(gate), **hparams},
        "searcher": {"metric": "loss", "max_length": 1, **searcher},
    }
    return dl.context(GATED, config, name=name)


def _submit(dl: Env, cfg: Any, ctx: Any) -> int:
    r = dl.det("run", "--detach", cfg, ctx)
    assert r.rc == 0 and r.out.startswith("Created experiment "), r
    return int(r.out.split()[2])


def test_logs_follow_every_trial_and_wait_for_a_search(dl: Env) -> None:
    dl.daemon_start({"scheduler": {"preemption_timeout": 1}}, **CPU2)
    cfg, ctx = _gated(dl, "grid", {"name": "grid"}, n={"type": "categorical", "vals": [1, 2, 3]})
    exp = _submit(dl, cfg, ctx)
    waiting = dl.start("experiment", "wait", exp)
    following = dl.start("experiment", "logs", "-f", exp)
    # two slots: trials 1 and 2 run, 3 waits for a slot
    wait_for(
        lambda: (
            "[trial 1] hello from 1" in following.out and "[trial 2] hello from 2" in following.out
        ),
        what="the first two trials' output",
    )
    wait_for(lambda: "[search] 2 running, 1 queued" in following.out, what="the search line")
    assert waiting.popen.poll() is None and following.popen.poll() is None
    dl.release("grid")
    r = following.wait()
    assert r.rc == 0 and r.err == "", r
    lines = r.out.splitlines()
    # trial 3 appeared while following; a last line without newline still comes, prefixed
    for tid in (1, 2, 3):
        assert f"[trial {tid}] hello from {tid}" in lines, r.out
        assert f"[trial {tid}] bye from {tid}" in lines, r.out
    assert all(re.match(r"\[(trial \d+|search)\] ", ln) for ln in lines), r.out
    search = [ln for ln in lines if ln.startswith("[search] ")]
    assert (
        search[-1]
        == "[search] 0 running, 3 completed, 0 stopped of 3; best loss 0.333333 (trial 3)"
    )
    w = waiting.wait()
    assert w.rc == 0 and w.err == "", w
    assert re.fullmatch(r"experiment 1 \(grid\) COMPLETED \(waited \d+\.\ds\)\n", w.out), w

    # without -f: what each trial wrote, trial after trial
    r = dl.det("experiment", "logs", exp)
    assert r.rc == 0, r
    assert r.out.splitlines() == [
        line
        for tid in (1, 2, 3)
        for line in (f"[trial {tid}] hello from {tid}", f"[trial {tid}] bye from {tid}")
    ]
    # wait on an ended experiment returns at once
    r = dl.det("experiment", "wait", exp)
    assert r.rc == 0 and "COMPLETED" in r.out, r


def test_wait_waits_through_a_pause_and_exits_as_run_does(dl: Env) -> None:
    dl.daemon_start({"scheduler": {"preemption_timeout": 1}}, **CPU2)
    cfg, ctx = _gated(dl, "single", {"name": "single"})
    exp = _submit(dl, cfg, ctx)
    waiting = dl.start("experiment", "wait", exp)
    wait_for(lambda: "hello from 1" in dl.log(exp, 1), what="the trial to start")
    assert dl.det("experiment", "pause", exp).rc == 0
    # the trial does not checkpoint: it is stopped after preemption_timeout, and PAUSED
    wait_for(lambda: dl.experiment(exp).state == State.PAUSED, what="the pause")
    wait_for(lambda: "is paused" in waiting.err, what="wait to say the experiment is paused")
    assert waiting.err.strip() == (
        f"det-local: experiment {exp} is paused; waiting until it ends "
        f"(`det-local experiment activate {exp}` resumes it)"
    )
    assert waiting.popen.poll() is None  # Determined's `e wait`: only a terminal state ends it
    assert dl.det("experiment", "kill", exp).rc == 0
    r = waiting.wait()
    assert r.rc == 2 and f"experiment {exp} (single) CANCELED" in r.out, r

    # an experiment that fails: 1, and why
    cfg, ctx = dl.context("import sys; sys.exit(3)\n", name="failing")
    exp = _submit(dl, cfg, ctx)
    r = dl.det("experiment", "wait", exp)
    assert r.rc == 1 and r.out.startswith(f"experiment {exp} (failing) ERROR: "), r


def test_wait_says_when_no_engine_runs(dl: Env) -> None:
    dl.daemon_start(**CPU2)
    cfg, ctx = _gated(dl, "orphan", {"name": "single"})
    exp = _submit(dl, cfg, ctx)
    wait_for(lambda: "hello from 1" in dl.log(exp, 1), what="the trial to start")
    dl.kill_daemon()  # its trial goes on, adopted by the next daemon
    waiting = dl.start("experiment", "wait", exp)
    wait_for(lambda: "no det-local engine" in waiting.err, what="wait's note")
    assert waiting.err.strip() == (
        f"det-local: no det-local engine is running for {dl.home}: experiment {exp} makes no "
        "progress until one starts (`det-local daemon start`)"
    )
    dl.daemon_start()
    dl.release("orphan")
    r = waiting.wait()
    assert r.rc == 0 and "COMPLETED" in r.out, r


@pytest.mark.parametrize("command", [["logs", "-f"], ["wait"]])
def test_ctrl_c_ends_quietly_and_the_experiment_goes_on(dl: Env, command: list[str]) -> None:
    dl.daemon_start(**CPU2)
    cfg, ctx = _gated(dl, "ctrlc", {"name": "single"})
    exp = _submit(dl, cfg, ctx)
    proc = dl.start("experiment", *command, exp)
    wait_for(lambda: "hello from 1" in dl.log(exp, 1), what="the trial to start")
    if command[0] == "logs":
        wait_for(lambda: "[trial 1] hello from 1" in proc.out, what="the output")
    else:  # waiting: it has the store open (a Ctrl-C before then would hit Python's start-up)
        wait_for(lambda: _has_open(proc.pid, dl.paths.db), what="wait to read the store")
    proc.signal(signal.SIGINT)
    r = proc.wait()
    word = "following" if command[0] == "logs" else "waiting"
    assert (r.rc, r.err) == (130, f"stopped {word}; experiment {exp} goes on\n"), r
    assert dl.experiment(exp).state == State.ACTIVE
    dl.release("ctrlc")
    wait_for(lambda: dl.experiment(exp).state == State.COMPLETED, what="the experiment to end")


def test_unknown_experiment(dl: Env) -> None:
    for command in (["logs"], ["logs", "-f"], ["wait"]):
        r = dl.det("experiment", *command, 42)
        one_line_error(r, "experiment 42 not found", "`det-local experiment list`")


def test_another_users_private_logs(shared: Shared) -> None:
    """A's experiment, its files private to A (umask 077): B waits for it (its state is no
    secret) but cannot read its logs; one line says who can. (The other users cannot start
    Python here: the trial is a shell loop.)"""
    ctx = shared.out / "private"
    ctx.mkdir()
    gate = shared.out / "gate-private"
    script = f"echo hello; while [ ! -e {gate} ]; do sleep 0.02; done; echo bye"
    (ctx / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "private",
                "entrypoint": ["sh", "-c", script],
                "max_restarts": 0,
                "searcher": {"name": "single", "metric": "loss", "max_length": 1},
            }
        )
    )
    os.chmod(ctx, 0o755)
    os.chmod(ctx / "config.yaml", 0o644)

    def submit() -> int:
        os.umask(0o077)
        return api.run(ctx / "config.yaml", ctx, follow=False)

    assert shared.as_user(A, submit) == 0
    wait_for(lambda: "hello" in _read(shared.paths.trial_log(1, 1)), what="A's trial to start")

    def logs() -> None:
        attach.print_logs(api.open_store(), api.paths(), 1, io.StringIO())

    with pytest.raises(DetLocalError) as exc:
        shared.as_user(B, logs)
    msg = str(exc.value)
    assert msg.startswith("permission denied: cannot read "), msg
    assert f"experiment 1's logs belong to {A}, who keeps them private" in msg, msg
    assert "\n" not in msg
    with pytest.raises(DetLocalError) as exc:  # `trial logs` says the same
        shared.as_user(B, lambda: logviews.trial_logs(1, io.BytesIO()))
    assert str(exc.value) == msg
    gate.touch()

    def wait() -> str:
        return attach.wait(api.open_store(), api.paths(), 1, lambda line: None).value

    assert shared.as_user(B, wait) == "COMPLETED"
    # A reads its own logs
    out = shared.as_user(A, lambda: _logs_text())
    assert out == "[trial 1] hello\n[trial 1] bye\n"


def _logs_text() -> str:
    buf = io.StringIO()
    attach.print_logs(api.open_store(), api.paths(), 1, buf)
    return buf.getvalue()


def _has_open(pid: int, path: Any) -> bool:
    return any(f.path == str(path) for f in psutil.Process(pid).open_files())


def _read(path: Any) -> str:
    try:
        return str(path.read_text())
    except FileNotFoundError:
        return ""
