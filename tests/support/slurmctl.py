"""Helpers of the Slurm control and restart tests (tests/slurm/test_slurm_control.py,
test_slurm_restart.py): a pool on the module's single-host Slurm, the trial's Slurm job, an
exact result, the daemon's own events, and slurmctld stopped and started again on its saved
state (an outage while jobs run on slurmd)."""

from __future__ import annotations

import os
import shlex
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

from det_local.store.states import State
from tests.support import slurmkit
from tests.support.world import Env, wait_for

HPC = {"resources": {"resource_pool": "hpc"}}


def pools(**slurm_settings: Any) -> dict[str, Any]:
    return {"resource_pools": {"hpc": {"slurm": {"partition": "debug", **slurm_settings}}}}


def start_daemon(dl: Env, slurm: slurmkit.Slurm, settings: dict[str, Any] | None = None) -> int:
    return dl.daemon_start(pools() if settings is None else settings, SLURM_CONF=str(slurm.conf))


def slurm_id(dl: Env, trial_id: int) -> int:
    """The Slurm job of the trial's latest run (its job's pid column), once recorded."""
    job = dl.store().jobs.for_trial(trial_id)
    assert job is not None
    return int(job.pid or 0)


def submissions(dl: Env, exp_id: int = 1) -> int:
    return len(list((dl.home / "experiments" / str(exp_id)).glob("trials/*/runs/*/slurm-batch.sh")))


def check_exact(dl: Env, trial_id: int, batches: int) -> None:
    final = dl.metrics(trial_id, "validation")[-1]
    assert final.metrics["x"] == sum(range(batches))  # no batch skipped or repeated
    trial = dl.store().get_trial(trial_id)
    assert trial.state == State.COMPLETED and trial.steps_completed == batches
    assert trial.restarts == 0


def job_fields(slurm: slurmkit.Slurm, job: int) -> dict[str, str]:
    out = slurm.run("scontrol", "show", "job", "-o", str(job)).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def daemon_events(dl: Env) -> list[str]:
    """Events of no experiment (the daemon's own: Slurm's controller down and back)."""
    with sqlite3.connect(dl.paths.db) as db:
        rows = db.execute("SELECT message FROM events WHERE experiment_id IS NULL ORDER BY id")
        return [r[0] for r in rows]


def stop_slurmctld(slurm: slurmkit.Slurm) -> None:
    ctld = slurm.procs[0]
    assert "slurmctld" in " ".join(str(a) for a in ctld.args)
    ctld.terminate()
    ctld.wait(timeout=30)


class Detached:
    """A daemon this test started but does not parent (the `dl` fixture kills the test's
    children at teardown; this one belongs to the module's Slurm); Popen's few methods that
    slurmkit.stop uses."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args

    def poll(self) -> int | None:
        try:
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return 0
        return 0 if state in ("Z", "X") else None

    def _send(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        self._send(signal.SIGTERM)

    def kill(self) -> None:
        self._send(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout or 60)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 60)
            time.sleep(0.05)
        return 0


def start_slurmctld(slurm: slurmkit.Slurm) -> None:
    """slurmctld again, on its saved state (the jobs it had, running on slurmd meanwhile),
    detached from the test (a shell starts it and exits)."""
    argv = [slurmkit._sbin("slurmctld"), "-D", "-i", "-f", str(slurm.conf)]
    err = shlex.quote(str(slurm.root / "slurmctld.stderr"))
    shell = f"setsid {shlex.join(argv)} </dev/null >/dev/null 2>>{err} & echo $!"
    # not the test's DET_LOCAL_HOME either: the `dl` fixture kills what names it at teardown
    env = {k: v for k, v in os.environ.items() if not k.startswith("DET_")}
    out = subprocess.run(
        ["sh", "-c", shell], env={**env, **slurm.env}, capture_output=True, text=True
    )
    slurm.procs[0] = Detached(int(out.stdout.strip()), argv)
    wait_for(
        lambda: slurm.run("squeue", "-h", check=False).returncode == 0,
        timeout=60,
        what="slurmctld to answer again",
    )
    # and its node registered again (a job submitted before waits otherwise)
    wait_for(
        lambda: slurm.node_state() in ("idle", "mixed", "allocated", "drained"),
        timeout=90,
        what=f"the node to come back (sinfo: {slurm.node_state()!r})",
    )
