"""Ranks of det-local's DistributedContext as real processes on this machine: a prelude every
rank script starts with, and run_ranks, which starts them and reads what each emits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from det_local.launch.ports import allocate_ports
from tests.support.paths import REPO

TIMEOUT = 60


PRELUDE = """
import json, os, sys, time
from det_local.trial.core import DistributedContext
from det_local.trial.core._hub import DistributedError
rank, size, local_size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
force_tcp = os.environ.get("FORCE_TCP") == "1"
def make(**kw):
    args = dict(rank=rank, size=size, local_rank=rank % local_size, local_size=local_size,
                cross_rank=rank // local_size, cross_size=size // local_size,
                chief_ip="127.0.0.1", force_tcp=force_tcp)
    args.update(kw)
    return DistributedContext(**args)
def emit(obj):
    print("RESULT " + json.dumps(obj), flush=True)
"""


def run_ranks(
    tmp_path: Path,
    body: str,
    size: int,
    local_size: int | None = None,
    env: dict[str, str] | None = None,
    timeout: float = TIMEOUT,
) -> list[tuple[int, Any, str]]:
    """Run `body` as `size` processes; [(returncode, last RESULT or None, stderr)] by rank."""
    script = tmp_path / "rank.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(REPO)
    full_env.update({k: str(v) for k, v in allocate_ports().items() if k.startswith("INTER")})
    full_env.update(env or {})
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(size), str(local_size or size)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
        )
        for r in range(size)
    ]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            results = [line[7:] for line in stdout.splitlines() if line.startswith("RESULT ")]
            out.append((p.returncode, json.loads(results[-1]) if results else None, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out
