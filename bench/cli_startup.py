"""How long the CLI takes to answer: `det-local --help` and `det-local experiment list` over 1,000
experiments, next to the anchor `python3 -c pass` measured in the same run.

    python3 bench/cli_startup.py [--runs N] [--experiments N]

Targets (2 cores): help <= 250 ms, list of 1,000 <= 400 ms. Each command runs once to warm the
page cache, then N times; the figures are medians of wall-clock time for the whole process.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import det_local_cmd  # bench/ is on sys.path when run as a script


def populate(home: Path, n: int) -> None:
    from det_local.store.db import Store
    from det_local.store.paths import Paths
    from det_local.store.states import State

    p = Paths(home).ensure()
    store = Store(p.db)
    config = {
        "name": "bench",
        "entrypoint": "python3 train.py",
        "searcher": {"name": "adaptive_asha", "metric": "val_loss", "max_trials": 16},
        "hyperparameters": {"lr": {"type": "log", "minval": -4, "maxval": -1, "base": 10}},
        "resources": {"slots_per_trial": 1},
        "description": "x" * 2000,  # configs are not small; list must not read them
    }
    with store.transaction():
        for i in range(n):
            exp = store.create_experiment(
                name=f"bench-{i:04d}",
                config=config,
                labels=["bench", f"group-{i % 7}"],
                description=f"experiment number {i}",
            )
            store.set_experiment_progress(exp, (i % 100) / 100)
            if i % 3 == 0:
                store.set_experiment_state(exp, State.COMPLETED)
    store.close()


def time_runs(argv: list[str], env: dict[str, str], runs: int) -> tuple[float, str]:
    """Median wall-clock ms over `runs` runs after one warm-up; returns it and the last stdout."""
    out = ""
    samples = []
    for i in range(runs + 1):
        start = time.perf_counter()
        r = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        elapsed = (time.perf_counter() - start) * 1000
        if r.returncode != 0:
            sys.exit(f"{shlex.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
        out = r.stdout
        if i:
            samples.append(elapsed)
    return statistics.median(samples), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7, help="timed runs per command (>= 5)")
    ap.add_argument("--experiments", type=int, default=1000)
    ap.add_argument(
        "--cli",
        default=None,
        help="command that runs det-local (default: the det-local script, else python -m)",
    )
    args = ap.parse_args()
    runs = max(5, args.runs)

    cli = shlex.split(args.cli) if args.cli else det_local_cmd()

    with tempfile.TemporaryDirectory(prefix="det-local-bench-") as tmp:
        home = Path(tmp) / "home"
        t0 = time.perf_counter()
        populate(home, args.experiments)
        populate_s = time.perf_counter() - t0
        env = {**os.environ, "DET_LOCAL_HOME": str(home)}

        python_ms, _ = time_runs([sys.executable, "-c", "pass"], env, runs)
        help_ms, _ = time_runs([*cli, "--help"], env, runs)
        list_ms, listing = time_runs([*cli, "experiment", "list"], env, runs)
        rows = len(listing.splitlines()) - 2  # header and rule
        if rows != args.experiments:
            sys.exit(f"`experiment list` printed {rows} rows, expected {args.experiments}")

    print(f"cli: {shlex.join(cli)}; {os.cpu_count()} cpus; {runs} runs each, medians")
    print(f"store with {args.experiments} experiments written in {populate_s:.2f} s")
    print(f"python3 -c pass           {python_ms:7.1f} ms  (anchor)")
    print(f"det-local --help          {help_ms:7.1f} ms  (target <= 250)")
    print(f"det-local experiment list {list_ms:7.1f} ms  (target <= 400, {rows} rows)")
    result = {
        "help_ms": round(help_ms, 1),
        "list_1000_ms": round(list_ms, 1),
        "python_startup_ms": round(python_ms, 1),
        "runs": runs,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
