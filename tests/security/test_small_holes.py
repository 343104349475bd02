"""The smaller holes of issue 34 (item 9), each refused with one line that says what to do.

A config file that is a FIFO (the CLI hung until killed), `--priority 2**70` and `--slots 10**30`
with a daemon running ("unexpected OverflowError"), a spool request whose `cwd` holds a NUL
(accepted; the job ended DONE with no exit code): with a real root daemon and a real user (the
`shared` fixture). The federation's advertised address: tests/federation/test_federation_link.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from det_local import api
from det_local.errors import DetLocalError
from tests.support.users import B, Shared
from tests.support.world import Env

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="multi-user tests create real users: they need root"
)


def test_a_config_that_is_a_fifo_is_refused_at_once(dl: Env, tmp_path: Path) -> None:
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    said = (
        f"error: config file {fifo} is not a regular file (a FIFO, a device or a socket); "
        "refusing to read it: pass a YAML file (save a pipe's output to one first)\n"
    )
    for args in (("experiment", "create", "-f"), ("run",), ("config", "check")):
        t0 = time.monotonic()
        r = dl.det(*args, fifo, ctx, timeout=20)
        assert (r.rc, r.err) == (1, said), (args, r)
        assert time.monotonic() - t0 < 10, args
    # daemon.yaml too (read by the daemon at its start)
    dl.home.mkdir(parents=True, exist_ok=True)
    os.mkfifo(dl.paths.settings)
    r = dl.det("daemon", "start", timeout=20)
    assert r.rc != 0 and "is not a regular file (a FIFO, a device or a socket)" in r.err, r


def test_numbers_out_of_range_name_the_range(shared: Shared) -> None:
    """With a daemon running, a number past 64 bits failed where the request was packed."""
    huge = str(2**70)
    r = shared.dl.det("cmd", "run", "--priority", huge, "--", "true")
    assert (r.rc, r.err) == (
        1,
        f"error: priority {huge} is outside 1-99 (1 is the most important, 42 the default)\n",
    )
    slots = str(10**30)
    r = shared.dl.det("cmd", "run", "--slots", slots, "--", "true")
    assert (r.rc, r.err) == (
        1,
        f"error: --slots {slots} is outside 0-65,536; ask for the slots the job uses "
        "(`det-local slots` shows what each pool has)\n",
    )
    r = shared.dl.det("shell", "start", "--slots", slots)
    assert r.rc == 1 and r.err.startswith(f"error: --slots {slots} is outside 0-65,536;"), r
    r = shared.dl.det("job", "update", "1", "--priority", huge)
    assert r.rc == 1 and r.err.startswith(f"error: priority {huge} is outside 1-99"), r
    # a number no option checks (a job id): one line, not a traceback
    r = shared.dl.det("job", "update", huge, "--ahead-of", "1")
    assert (r.rc, r.err) == (
        1,
        "error: a number in the job_update request is too large to send (more than 64 bits); "
        "nothing was submitted: check the numbers given\n",
    )


def _cmd_run(cwd: str, argv: list[str]) -> str:
    payload = {
        "argv": argv,
        "cwd": cwd,
        "env": {"PATH": "/usr/bin:/bin"},
        "slots": 1,
        "priority": 42,
        "name": None,
    }
    try:
        return f"queued {api.control_job('cmd_run', payload)}"
    except DetLocalError as err:
        return str(err)


def test_a_nul_in_a_commands_request_is_refused_at_intake(shared: Shared) -> None:
    out = str(shared.out)
    said = shared.as_user(B, _cmd_run, out + "\0/x", ["true"])
    assert said == (
        "cmd run: cwd contains a NUL byte, which no path, argument or environment variable may "
        "hold; submit it again without it"
    )
    said = shared.as_user(B, _cmd_run, out, ["echo", "a\0b"])
    assert said.startswith("cmd run: argv[1] contains a NUL byte"), said
    assert shared.dl.jobs() == []  # nothing was queued
