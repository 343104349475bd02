"""Signals always work, whatever det-local's output is connected to (issue 24, item 4).

`det-local run long.yaml ctx 2>&1 | head -3`, then Ctrl-C: the pipe's reader is gone, so each
write fails with EPIPE; with a reader that never reads (a full pipe) each write blocks. Either
used to break the CLI (stuck in STOPPING_PAUSED, deaf to a second Ctrl-C and to SIGTERM). Here
the CLI's stdout and stderr are a real pipe: closed after three lines (as `head -3` does), or
never read at all; the first SIGINT (or SIGTERM) pauses, the second stops at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any

from det_local.store.states import State
from tests.support.world import Env, gone, wait_for

# prints fast (fills a pipe in well under a second) and never checks should_preempt()
FLOOD = """
import os, sys, time
with open(sys.argv[1], "w") as f:
    f.write(str(os.getpid()))
i = 0
while True:
    print("line", i, "x" * 200, flush=True)
    i += 1
    time.sleep(0.001)
"""
BOUND_S = 20.0  # far below the 30 s preemption timeout: "at once"


def _piped(dl: Env, *args: Any) -> subprocess.Popen[bytes]:
    """det-local ARGS with stdout and stderr into one pipe (`2>&1 |`)."""
    return subprocess.Popen(
        dl.argv(*args),
        env=dl.env,
        cwd=dl.tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )


def _head(proc: subprocess.Popen[bytes], n: int = 3) -> list[bytes]:
    """Read N lines, then close the pipe as `head -N` exits."""
    assert proc.stdout is not None
    lines = [proc.stdout.readline() for _ in range(n)]
    proc.stdout.close()
    return lines


def _stops(proc: subprocess.Popen[bytes], sig: int, dl: Env | None = None) -> float:
    """Send SIG twice; how long the CLI took to exit after the second. With `dl`: the second
    once the first was handled (experiment 1 STOPPING_PAUSED: a pause asked; the trial ignores
    it); else a moment apart (a command's first stop leaves no trace the test can read)."""
    proc.send_signal(sig)
    if dl is not None:
        wait_for(
            lambda: dl.experiment(1).state == State.STOPPING_PAUSED,
            what="the first signal to ask for a pause",
        )
    else:
        time.sleep(1.0)  # two signals pending at once would be one
    assert proc.poll() is None, "the first signal only pauses"
    proc.send_signal(sig)
    t0 = time.monotonic()
    try:
        proc.wait(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"det-local ignored a second {signal.Signals(sig).name}") from None
    return time.monotonic() - t0


def _trial_pid(dl: Env) -> int:
    pidfile = dl.tmp / "trial.pid"
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), what="the trial")
    return int(pidfile.read_text())


def test_run_piped_to_head_then_ctrl_c_twice(dl: Env) -> None:
    cfg, ctx = dl.context(FLOOD, {"entrypoint": f"python3 train.py {dl.tmp / 'trial.pid'}"})
    proc = _piped(dl, "run", cfg, ctx)
    lines = _head(proc)
    assert lines[0] == b"Created experiment 1\n", lines
    pid = _trial_pid(dl)
    took = _stops(proc, signal.SIGINT, dl)
    assert proc.returncode == 3, proc.returncode  # paused: as `run` says after a Ctrl-C
    assert took < BOUND_S
    assert dl.experiment(1).state == State.PAUSED
    wait_for(lambda: gone(pid), timeout=10, what="the trial to end")


def test_run_into_a_full_pipe_then_ctrl_c_twice(dl: Env) -> None:
    cfg, ctx = dl.context(FLOOD, {"entrypoint": f"python3 train.py {dl.tmp / 'trial.pid'}"})
    proc = _piped(dl, "run", cfg, ctx)  # nobody reads: the pipe fills, writes would block
    pid = _trial_pid(dl)
    wait_for(
        lambda: os.path.getsize(dl.paths.trial_log(1, 1)) > 1 << 20,
        what="the trial to write far more than a pipe holds",
    )
    _stops(proc, signal.SIGINT, dl)
    assert proc.returncode == 3, proc.returncode
    assert dl.experiment(1).state == State.PAUSED
    wait_for(lambda: gone(pid), timeout=10, what="the trial to end")
    assert proc.stdout is not None
    proc.stdout.close()


def test_run_piped_to_head_then_sigterm_twice(dl: Env) -> None:
    cfg, ctx = dl.context(FLOOD, {"entrypoint": f"python3 train.py {dl.tmp / 'trial.pid'}"})
    proc = _piped(dl, "run", cfg, ctx)
    _head(proc)
    pid = _trial_pid(dl)
    _stops(proc, signal.SIGTERM, dl)
    assert proc.returncode == 3, proc.returncode
    assert dl.experiment(1).state == State.PAUSED
    wait_for(lambda: gone(pid), timeout=10, what="the trial to end")


def test_activate_and_cmd_run_piped_to_head_then_ctrl_c_twice(dl: Env) -> None:
    # an experiment paused once, then `experiment activate` runs it here again (no daemon)
    cfg, ctx = dl.context(FLOOD, {"entrypoint": f"python3 train.py {dl.tmp / 'trial.pid'}"})
    proc = _piped(dl, "run", cfg, ctx)
    _head(proc)
    _trial_pid(dl)
    _stops(proc, signal.SIGINT, dl)
    (dl.tmp / "trial.pid").unlink()
    proc = _piped(dl, "experiment", "activate", "1")
    _head(proc)
    pid = _trial_pid(dl)
    _stops(proc, signal.SIGINT, dl)
    assert dl.experiment(1).state == State.PAUSED
    wait_for(lambda: gone(pid), timeout=10, what="the trial to end")
    # `cmd run -f`: the first Ctrl-C stops the command (SIGTERM), the second kills it; a
    # command that ignores SIGTERM needs the second
    dl.setenv(DET_LOCAL_FAKE_GPUS="0", DET_LOCAL_CPU_SLOTS="1")
    script = "trap '' TERM; echo $$ > cmd.pid; while :; do echo tick; done"
    proc = _piped(dl, "cmd", "run", "-f", "--", "sh", "-c", script)
    _head(proc)
    wait_for(lambda: (dl.tmp / "cmd.pid").exists(), what="the command")
    _stops(proc, signal.SIGINT)
    assert dl.job(1).state == "DONE"


def test_following_with_a_daemon_stops_at_ctrl_c_into_a_full_pipe(dl: Env) -> None:
    """`experiment create -f` and `logs -f` against a daemon: Ctrl-C stops following (the
    experiment goes on), even when nobody reads the output."""
    dl.daemon_start(DET_LOCAL_FAKE_GPUS="0", DET_LOCAL_CPU_SLOTS="1")
    cfg, ctx = dl.context(FLOOD, {"entrypoint": f"python3 train.py {dl.tmp / 'trial.pid'}"})
    for args in (["experiment", "create", "-f", cfg, ctx], ["trial", "logs", "-f", "1"]):
        proc = _piped(dl, *args)
        _trial_pid(dl)
        wait_for(
            lambda: os.path.getsize(dl.paths.trial_log(1, 1)) > 1 << 20,
            what="the trial to write far more than a pipe holds",
        )
        time.sleep(0.5)  # the CLI is writing into the full pipe
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"`det-local {' '.join(map(str, args))}` ignored Ctrl-C") from None
        assert proc.stdout is not None
        proc.stdout.close()
    assert dl.experiment(1).state == State.ACTIVE  # following stopped; the experiment goes on
