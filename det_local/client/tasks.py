"""Interactive tasks on slots: `shell start`, `notebook start`, `tensorboard start`.

A shell holds its slots through a placeholder job (`tail --pid=<client> -f /dev/null`): the
queue schedules it like any command, the client opens the shell in the user's terminal with
CUDA_VISIBLE_DEVICES set to the job's slots once it is scheduled, and the placeholder ends when
the client does, even if the terminal is closed, which frees the slots. Notebooks and
TensorBoard are ordinary queued commands serving on localhost.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from typing import Any

from det_local.errors import DetLocalError
from det_local.launch.ports import free_port
from det_local.sched.intake.spool import user_name
from det_local.store.paths import Paths
from det_local.store.states import JobState
from det_local.store.tables.jobs import ENDED

WAIT_TICK_S = 0.05
ANNOUNCE_AFTER_S = 1.0  # a job that starts sooner than this is not said to wait


def _waiting(job_id: int, slots: int) -> str:
    if slots > 0:
        return f"job {job_id} waits for {slots} slot(s) (`det-local job list`)"
    # a job on no slots waits only for an engine to take it
    return (
        f"job {job_id} has not started yet; is a daemon running? "
        "(`det-local daemon status`, `det-local job list`)"
    )


class MissingTool(DetLocalError):
    pass


def _submit(paths: Paths, payload: dict[str, Any]) -> int:
    from det_local.client.control import control_job
    from det_local.sched.run.userfiles import current_umask

    # the job runs with this client's umask, as if it were run here
    return int(control_job(paths, "cmd_run", {**payload, "umask": current_umask()}))


def _wait_scheduled(paths: Paths, job_id: int, announce: bool = True) -> dict[str, Any]:
    """Wait until the job holds its slots; returns its allocation (slots, visible devices)."""
    from det_local.store.db import Store

    told = False
    since = time.monotonic()
    alloc = paths.job_dir(job_id) / "allocation.json"
    while True:
        store = Store(paths.db, readonly=True)
        try:
            job = store.jobs.get(job_id)
        finally:
            store.close()
        if job.state in ENDED:
            raise DetLocalError(f"job {job_id} ended before it started: {job.message or ''}")
        if job.state == JobState.SCHEDULED and alloc.exists():
            return dict(json.loads(alloc.read_text()))
        if announce and not told and time.monotonic() - since >= ANNOUNCE_AFTER_S:
            print(_waiting(job_id, job.slots_needed), flush=True)
            told = True
        time.sleep(WAIT_TICK_S)


def shell(paths: Paths, *, slots: int, priority: int, extra: dict[str, Any] | None = None) -> int:
    """Open an interactive shell holding `slots` slots; returns the shell's exit status."""
    if shutil.which("tail") is None:
        raise MissingTool("shell start needs coreutils' `tail` on PATH")
    job_id = _submit(
        paths,
        {
            "argv": ["tail", f"--pid={os.getpid()}", "-f", "/dev/null"],
            "cwd": os.getcwd(),
            "env": {"PATH": os.environ.get("PATH", os.defpath)},
            "slots": slots,
            "priority": priority,
            "name": f"shell of {user_name(os.geteuid())}",
            "kind": "SHELL",
            **(extra or {}),
        },
    )
    try:
        alloc = _wait_scheduled(paths, job_id)
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = alloc["cuda_visible_devices"]
        env["DET_SLOT_IDS"] = str(alloc["slots"])
        env["DET_LOCAL_JOB_ID"] = str(job_id)
        for name, value in (alloc.get("env") or {}).items():  # OMP_NUM_THREADS on CPU slots,
            env.setdefault(str(name), str(value))  # unless this shell's user set it
        print(
            f"shell on slot(s) {alloc['slots']} (job {job_id}); exit the shell to free them",
            flush=True,
        )
        return subprocess.call([os.environ.get("SHELL") or "/bin/bash", "-i"], env=env)
    finally:
        from det_local.client.control import control_job

        try:
            control_job(paths, "cmd_kill", {"job_id": job_id})
        except DetLocalError:
            pass


def _serve(
    paths: Paths,
    kind: str,
    argv: list[str],
    name: str,
    slots: int,
    url: str,
    env: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> tuple[int, str]:
    job_id = _submit(
        paths,
        {
            "argv": argv,
            "cwd": os.getcwd(),
            # like `cmd run`: the submitter's environment (kept privately by the daemon)
            "env": {**os.environ, **(env or {})},
            "slots": slots,
            "priority": 42,
            "name": name,
            "kind": kind,
            **(extra or {}),
        },
    )
    _wait_scheduled(paths, job_id, announce=True)
    return job_id, url


def notebook(paths: Paths, *, slots: int, extra: dict[str, Any] | None = None) -> tuple[int, str]:
    """A Jupyter server on localhost as a queued job; returns (job id, URL)."""
    exe = shutil.which("jupyter")
    if exe is None:
        raise MissingTool(
            "notebook start needs Jupyter, which is not installed: `pip install jupyterlab`, "
            "then try again"
        )
    port = free_port()
    token = secrets.token_hex(16)
    argv = [
        exe,
        "lab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
    ]
    return _serve(
        paths,
        "NOTEBOOK",
        argv,
        f"notebook :{port}",
        slots,
        f"http://127.0.0.1:{port}/lab?token={token}",
        # its token in the environment (private to its user), never in argv, which every user
        # sees (`ps`, `job list --json`, the database)
        env={"JUPYTER_TOKEN": token},
        extra=extra,
    )


def tensorboard(paths: Paths, experiment_ids: list[int]) -> tuple[int, str]:
    """TensorBoard over the experiments' trials (their own event files, or ones written from
    their reported metrics: client/tbexport.py), as a queued 0-slot job."""
    exe = shutil.which("tensorboard")
    if exe is None:
        raise MissingTool(
            "tensorboard start needs TensorBoard, which is not installed: "
            "`pip install tensorboard`, then try again"
        )
    from det_local.client.tbexport import trial_logdirs
    from det_local.store.db import Store

    store = Store(paths.db, readonly=True)
    try:
        # each trial's own event files, or ones written here from its reported metrics
        dirs = [f"{name}:{d}" for name, d in trial_logdirs(store, paths, experiment_ids)]
    finally:
        store.close()
    if not dirs:
        raise DetLocalError(f"experiment(s) {experiment_ids} have no trials to show yet")
    port = free_port()
    argv = [exe, f"--logdir_spec={','.join(dirs)}", "--host=127.0.0.1", f"--port={port}"]
    name = "tensorboard " + " ".join(str(e) for e in experiment_ids)
    return _serve(paths, "TENSORBOARD", argv, name, 0, f"http://127.0.0.1:{port}/")
