"""A Core API script for test mode (`det-local run --test` and the pytest plugin), failing at the
step FAIL_AT names, its config, and pytest run in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """\
import os, sys
import determined as det
from determined import core

FAIL = os.environ.get("FAIL_AT", "")
info = det.get_cluster_info()
with core.init() as ctx:
    steps = 0
    if info.latest_checkpoint:
        if FAIL == "restore":
            raise RuntimeError("cannot load the checkpoint")
        with ctx.checkpoint.restore_path(info.latest_checkpoint) as path:
            steps = int((path / "steps").read_text())
    for op in ctx.searcher.operations():
        while steps < op.length:
            steps += 1
            ctx.train.report_training_metrics(steps_completed=steps, metrics={"loss": 1.0 / steps})
        if FAIL == "validate":
            raise ValueError("validation broke")
        ctx.train.report_validation_metrics(steps_completed=steps, metrics={"loss": 0.5})
        if FAIL != "checkpoint":
            with ctx.checkpoint.store_path({"steps_completed": steps}) as (path, _):
                (path / "steps").write_text(str(steps))
        op.report_completed(0.5)
"""


def script_config(fail: str = "") -> dict:
    return {
        "searcher": {"name": "single", "metric": "loss", "max_length": {"batches": 100}},
        "hyperparameters": {"lr": {"type": "double", "minval": 0.1, "maxval": 1.0}},
        "environment": {"environment_variables": [f"FAIL_AT={fail}"]},
        "max_restarts": 3,
    }


def run_pytest(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DET_LOCAL")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
