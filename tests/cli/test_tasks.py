"""`shell start`, `notebook start`, `tensorboard start` against a real daemon."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.support.world import Env, wait_for


@pytest.fixture
def daemon(dl: Env) -> Iterator[Env]:
    dl.env["DET_LOCAL_FAKE_GPUS"] = "2"
    r = dl.det("daemon", "start")
    assert r.rc == 0, r.err
    try:
        yield dl
    finally:
        dl.det("daemon", "stop")


def test_shell_holds_its_slots_until_it_exits(daemon: Env) -> None:
    out = daemon.tmp / "shell.out"
    script = (
        f'echo "CVD=$CUDA_VISIBLE_DEVICES SLOTS=$DET_SLOT_IDS" > {out}\n'
        f"det-local job list --json >> {out}\n"
        "exit 4\n"
    )
    env = dict(
        daemon.env,
        SHELL="/bin/bash",
        PATH=os.path.dirname(sys.executable) + ":" + daemon.env["PATH"],
    )
    proc = subprocess.run(
        [sys.executable, "-m", "det_local.cli.main", "shell", "start", "--slots", "2"],
        input=script,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 4, proc.stderr
    text = out.read_text()
    assert "CVD=GPU-fake-0000-0000-0000-000000000000,GPU-fake-0000-0000-0000-000000000001" in text
    assert "SLOTS=[0, 1]" in text
    assert '"state": "SCHEDULED"' in text and '"kind": "SHELL"' in text
    # the slots are freed once the shell is gone
    wait_for(lambda: not daemon.json("job", "list"), timeout=30, what="the shell's job to end")


def test_shell_job_ends_when_its_client_dies(daemon: Env) -> None:
    env = dict(daemon.env, SHELL="/bin/sh")
    proc = subprocess.Popen(
        [sys.executable, "-m", "det_local.cli.main", "shell", "start"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    wait_for(
        lambda: [j for j in daemon.json("job", "list") if j["state"] == "SCHEDULED"],
        timeout=30,
        what="the shell's slot",
    )
    os.killpg(proc.pid, 9)  # the terminal went away
    proc.wait()
    wait_for(lambda: not daemon.json("job", "list"), timeout=30, what="the slot to be freed")


@pytest.mark.skipif(shutil.which("jupyter") is not None, reason="jupyter is installed")
def test_notebook_without_jupyter_says_what_to_install(daemon: Env) -> None:
    r = daemon.det("notebook", "start")
    assert r.rc == 1
    assert r.err.strip() == (
        "error: notebook start needs Jupyter, which is not installed: "
        "`pip install jupyterlab`, then try again"
    )


@pytest.mark.skipif(shutil.which("tensorboard") is not None, reason="tensorboard is installed")
def test_tensorboard_without_tensorboard_says_what_to_install(daemon: Env) -> None:
    r = daemon.det("tensorboard", "start", "1")
    assert r.rc == 1
    assert "tensorboard start needs TensorBoard" in r.err
    assert "pip install tensorboard" in r.err
