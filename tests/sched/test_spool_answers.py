"""A submission hears its answer whatever the daemon is doing (issue 37): behind a backlog of
1,000 requests, and when the daemon is killed and started again between the request and the
answer (the request is applied once: by the next daemon, or by the requester itself when it
finds no engine)."""

from __future__ import annotations

import os
import signal
import subprocess

from det_local.sched.intake import spool
from tests.support.world import Env, wait_for

BACKLOG = 1000


def test_answer_arrives_behind_a_backlog(dl: Env) -> None:
    dl.paths.ensure()
    for _ in range(BACKLOG):  # root's: exempt from the per-user cap, served in name order
        spool.submit(dl.paths, "slots", {}, durable=False)
    dl.daemon_start(DET_LOCAL_CPU_SLOTS="2")
    r = dl.det("cmd", "run", "--", "true", timeout=120)
    assert (r.rc, r.out) == (0, "Queued command 1\n"), r
    assert dl.wait_job(1).exit_code == 0
    # the backlog was answered too (before it: its requests sort first), and nothing is left
    wait_for(lambda: not spool.pending(dl.paths), what="the spool to be empty")
    answers = list(spool.responses_dir(dl.paths).glob("*.resp"))
    assert len(answers) == BACKLOG  # nobody collected these; the CLI collected its own


def test_answer_arrives_when_the_daemon_restarts_meanwhile(dl: Env) -> None:
    daemon = dl.daemon_start(DET_LOCAL_CPU_SLOTS="2")
    os.kill(daemon, signal.SIGSTOP)  # it takes nothing from now on
    try:
        cli = subprocess.Popen(
            dl.argv("cmd", "run", "--", "true"),
            env=dl.env,
            cwd=dl.tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_for(lambda: spool.pending(dl.paths), what="the request in the spool")
    finally:
        os.kill(daemon, signal.SIGKILL)
    wait_for(lambda: dl.daemon_pid() is None or not os.path.exists(f"/proc/{daemon}"))
    dl.daemon_start(DET_LOCAL_CPU_SLOTS="2")
    out, err = cli.communicate(timeout=120)
    assert cli.returncode == 0, (out, err)
    assert out == "Queued command 1\n", (out, err)
    assert dl.wait_job(1).exit_code == 0
    assert [j.id for j in dl.jobs()] == [1]  # applied once
    assert not spool.pending(dl.paths)
