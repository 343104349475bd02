"""Frictions a new user met on the second day (issue 27), each reproduced: what they saw
and what they see now."""

from __future__ import annotations

import json

from conftest import Env, gone

CPU1 = {"DET_LOCAL_FAKE_GPUS": "0", "DET_LOCAL_CPU_SLOTS": "1"}
HIDDEN = "(1 ended command not shown; `det-local cmd list --all` lists them)"


def test_cmd_list_says_ended_commands_are_hidden(dl: Env) -> None:
    dl.setenv(**CPU1)
    r = dl.det("cmd", "run", "-f", "--", "echo", "hi")
    assert r.rc == 0, r
    r = dl.det("cmd", "list")
    assert r.rc == 0 and r.err == HIDDEN + "\n", r
    r = dl.det("cmd", "list", "--json")
    assert json.loads(r.out) == [] and r.err == HIDDEN + "\n", r
    r = dl.det("cmd", "list", "--all")
    assert r.rc == 0 and r.err == "" and "DONE" in r.out, r


SLOW_EXIT = """\
import atexit, sys, time
if sys.argv[1:] == ["daemon"]:  # the daemon itself, not `daemon start|stop`
    atexit.register(time.sleep, 1.5)  # an interpreter slow to end after the lock is released
"""


def test_daemon_stop_says_stopped_once_the_process_has_exited(dl: Env) -> None:
    hook = dl.tmp / "slowexit"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_EXIT)
    pid = dl.daemon_start(PYTHONPATH=f"{hook}:{dl.env.get('PYTHONPATH', '')}", **CPU1)
    r = dl.det("daemon", "stop")
    assert r.rc == 0 and r.out == f"det-local daemon {pid} stopped\n", r
    assert gone(pid)  # at once: no waiting here
