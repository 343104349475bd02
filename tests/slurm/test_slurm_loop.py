"""Slurm never stalls the daemon's event loop (issue 34 item 3): the submission-time
`sbatch --test-only` runs off the loop (`slurm/submit.py`), so five submissions while slurmctld
is stopped leave the loop's lag <= 100 ms and another user's `slots` answered at once; and a
Slurm command past its timeout has its whole process group killed (`slurm/client.py`), so a
hanging sbatch, and what it started, are gone after it."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from det_local import api
from det_local.slurm import client
from det_local.store.tables.jobs import ENDED
from tests.support import slurmkit
from tests.support.slurmctl import start_slurmctld, stop_slurmctld
from tests.support.users import A, B, Shared
from tests.support.world import kill_home_processes, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("runuser") is None,
        reason="real users: needs root, useradd and runuser",
    ),
]

LAG_BUDGET_MS = 100.0


@pytest.fixture
def shared(pool_daemon: Shared) -> Shared:
    """The folder's root daemon with a Slurm pool (tests/slurm/conftest.py)."""
    return pool_daemon


class LagWatch:
    """The daemon's loop lag second by second (`run/looplag.json`'s ``max_1s``, written once a
    second by the daemon's probe), read from a thread while the test runs."""

    def __init__(self, home: Path) -> None:
        self.path = home / "run" / "looplag.json"
        self.since = time.time()
        self.seen: dict[float, float] = {}  # when written -> the worst lag of that second
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LagWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                lag = json.loads(self.path.read_text())
            except (OSError, ValueError):
                continue
            if lag.get("at", 0) > self.since:
                self.seen[lag["at"]] = lag["max_1s"]

    def worst(self) -> float:
        return max(self.seen.values(), default=0.0)


def test_submissions_while_slurmctld_is_stopped_leave_the_loop_free(
    shared: Shared, slurm: slurmkit.Slurm
) -> None:
    """Five of A's submissions to the Slurm pool while slurmctld is stopped (each check used to
    wait on the loop for its 3 s timeout: a 9 s stall, and peers declared the node dead): the
    loop's lag stays within 100 ms and B's `slots` is answered at once meanwhile; A's
    submissions are answered once the one check they share has ended."""
    from det_local.client.requester import remote_request

    def submit(i: int) -> int:
        payload = {
            "argv": ["true"],
            "cwd": str(shared.out),
            "env": {"PATH": "/usr/bin:/bin"},
            "slots": 1,
            "priority": 42,
            "name": f"s{i}",
            "pool": "hpc",
        }
        return int(api.control_job("cmd_run", payload))

    def slots() -> float:
        began = time.monotonic()
        remote_request(shared.paths, "slots", {}, timeout=30)
        return time.monotonic() - began

    stop_slurmctld(slurm)
    try:
        jobs: list[int] = []
        with LagWatch(shared.home) as watch:
            threads = [
                threading.Thread(target=lambda i=i: jobs.append(shared.as_user(A, submit, i)))
                for i in range(5)
            ]
            began = time.monotonic()
            for t in threads:
                t.start()
            answers = [shared.as_user(B, slots)]
            while any(t.is_alive() for t in threads) and time.monotonic() - began < 60:
                answers.append(shared.as_user(B, slots))
            for t in threads:
                t.join(60)
            answered = time.monotonic() - began
            done_at = time.time()  # the probe's figures up to the last answer, and a second on
            wait_for(lambda: max(watch.seen, default=0.0) > done_at, timeout=10, what="figures")
        assert len(jobs) == 5, jobs
        assert answered < 20, answered  # one 3 s check, not one each
        assert max(answers) < 1.0, answers
        # the outage's seconds, up to the last answer: what the Slurm check could stall. The
        # second after it, when the five jobs are applied and started in one scheduling pass
        # (14-107 ms on a 2-core box, whatever Slurm's state), is the queue's own cost, not
        # this (the note of issue 34 says so)
        outage = {at: lag for at, lag in watch.seen.items() if at <= done_at}
        assert len(outage) >= 2, watch.seen
        assert max(outage.values()) <= LAG_BUDGET_MS, watch.seen
        for job in jobs:  # nothing of them reaches Slurm once it is back
            shared.as_user(A, api.control_job, "cmd_kill", {"job_id": job})
        wait_for(lambda: all(shared.job(j).state in ENDED for j in jobs), timeout=60, what="killed")
    finally:
        kill_home_processes(shared.home)
        start_slurmctld(slurm)
    assert slurm.queue() == []


def _hanging_sbatch(tmp: Path) -> tuple[Path, Path]:
    """A PATH whose `sbatch` hangs as a real one does when its controller never answers, and
    has started a child of its own; the file where it writes both pids."""
    shim = tmp / "bin"
    shim.mkdir()
    pids = tmp / "pids"
    (shim / "sbatch").write_text(f"#!/bin/sh\nsleep 300 &\necho $$ $! > {pids}\nwait\n")
    (shim / "sbatch").chmod(0o755)
    pids.touch()
    pids.chmod(0o666)  # the user sbatch runs as writes it
    for d in (tmp, shim):
        d.chmod(0o755)
    return shim, pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.parametrize("as_user", [False, True], ids=["daemon", "runuser"])
def test_a_hanging_sbatch_leaves_nothing_behind_its_timeout(
    monkeypatch: pytest.MonkeyPatch, accounts: None, as_user: bool
) -> None:
    """sbatch that never answers (and has a child): past the timeout, sbatch, its child and the
    `runuser` in front of it (a root daemon submitting as a user) are all gone; the error says
    it did not answer, in one line."""
    tmp = Path(tempfile.mkdtemp(prefix="det-local-hang-", dir="/tmp"))
    shim, pids = _hanging_sbatch(tmp)
    try:
        monkeypatch.setenv("PATH", f"{shim}:{os.environ['PATH']}")
        uid = pwd.getpwnam(A).pw_uid if as_user else None
        began = time.monotonic()
        with pytest.raises(client.Unreachable) as err:
            client.run(["sbatch", "--test-only"], uid=uid, timeout=2.0)
        assert time.monotonic() - began < 10
        assert str(err.value) == (
            f"{shutil.which('runuser') if as_user else shim / 'sbatch'} did not answer in 2s"
        )
        wait_for(lambda: pids.exists() and len(pids.read_text().split()) == 2, timeout=5)
        started = [int(p) for p in pids.read_text().split()]
        wait_for(
            lambda: not any(_alive(p) for p in started),
            timeout=5,
            what=f"sbatch and its child ({started}) to be gone",
        )
    finally:
        for pid in [int(p) for p in pids.read_text().split()]:
            if _alive(pid):  # what the old timeout left behind
                os.kill(pid, 9)
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_stage_dir_check_as_the_submitter_never_waits_on_the_loop(
    monkeypatch: pytest.MonkeyPatch, accounts: None
) -> None:
    """A Slurm pool's stage_dir is checked as the submitter (`runuser -u USER -- test -w DIR`)
    in a thread (`slurm/offloop.py`): on the engine's loop a submission gets Pending at once,
    not a wait; once the check has ended its answer is the submission's one line; a check that
    hangs (a stuck filesystem) is killed with its process group and skipped."""
    from det_local.errors import DEFER, ConfigError, Pending
    from det_local.slurm import stage
    from det_local.slurm.config import parse_slurm_pool

    real = shutil.which("runuser")
    assert real is not None
    tmp = Path(tempfile.mkdtemp(prefix="det-local-stagecheck-", dir="/tmp"))
    try:
        shim = tmp / "bin"
        shim.mkdir()
        pids, release = tmp / "pids", tmp / "release"
        (shim / "runuser").write_text(
            f"#!/bin/sh\necho $$ >> {pids}\n"
            f'while [ ! -e {release} ]; do sleep 0.05; done\nexec {real} "$@"\n'
        )
        (shim / "runuser").chmod(0o755)
        monkeypatch.setenv("PATH", f"{shim}:{os.environ['PATH']}")
        uid = pwd.getpwnam(A).pw_uid

        def pool(d: Path) -> Any:
            d.mkdir()
            d.chmod(0o755)  # root's: A cannot write it
            return parse_slurm_pool("hpc", {"partition": "debug", "stage_dir": str(d)}, "y")

        closed = pool(tmp / "closed")
        token = DEFER.set(True)
        try:
            began = time.monotonic()
            with pytest.raises(Pending) as pending:
                stage.check_stage_dir(closed, uid)
            assert time.monotonic() - began < 1.0
            ready = threading.Event()
            pending.value.on_ready(ready.set)
            assert not ready.is_set()  # the check waits for the release, off this thread
            release.touch()
            assert ready.wait(30)
            with pytest.raises(ConfigError) as err:  # asked again: the check's own answer
                stage.check_stage_dir(closed, uid)
        finally:
            DEFER.reset(token)
        assert str(err.value) == (
            f"resource_pools.hpc.slurm.stage_dir {tmp / 'closed'} is not writable by user {A}: "
            "the pool's runs stage their context, log and info files there; make it writable "
            "by them (e.g. chmod 1777) or choose another"
        )
        # a check that never answers: killed with its group after the timeout, and skipped
        release.unlink()
        pids.write_text("")
        monkeypatch.setattr(stage, "STAGE_CHECK_TIMEOUT_S", 1.0)
        began = time.monotonic()
        stage.check_stage_dir(pool(tmp / "stuck"), uid)  # an offline engine's wait: bounded
        assert time.monotonic() - began < 10
        started = [int(p) for p in pids.read_text().split()]
        assert len(started) == 1
        wait_for(lambda: not _alive(started[0]), timeout=5, what="the hung check to be gone")
    finally:
        release.touch()  # nothing left waiting for it
        shutil.rmtree(tmp, ignore_errors=True)
