"""Shared helpers for the benchmarks: a throwaway DET_LOCAL_HOME and the det-local command."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence


def det_local_cmd() -> list[str]:
    exe = shutil.which("det-local")
    return [exe] if exe else [sys.executable, "-m", "det_local.cli.main"]


def timed(argv: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None) -> float:
    """Wall time of one run in milliseconds; raises if the command fails."""
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True)
    elapsed = (time.perf_counter() - start) * 1000
    if proc.returncode != 0:
        raise SystemExit(
            f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}"
        )
    return elapsed


def median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def env_with_home(home: str) -> dict[str, str]:
    env = dict(os.environ)
    env["DET_LOCAL_HOME"] = home
    return env
