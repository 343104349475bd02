"""What system metrics cost the daemon, and `det-local usage` over a year of allocations.

    python3 bench/system_metrics.py [--jobs 16] [--cpu-s 30] [--allocations 100000] [--runs 5]

- sampling_cpu_pct: the daemon's user + system CPU (psutil cpu_times delta, % of one core)
  over --cpu-s seconds while --jobs `sleep` commands run on --jobs fake GPUs, sampled at the
  default rate (every 5 s); anchor, in the same run: the same daemon and jobs with
  ``system_metrics: {enabled: false}`` (sampling_off_cpu_pct). The two alternate, twice each;
  the medians are reported. Also the samples stored per job (rate check).
- usage_ms: wall time of the whole `det-local usage --since 365d --json` process over a store
  holding --allocations allocation records spread over a year (20 users, 8 slots, trials of
  500 experiments and commands), written through the store's API; median of --runs after one
  warm-up, and its CPU time (user + system: what a loaded machine cannot inflate). Anchors:
  `python3 -c pass` (the floor of any Python CLI) and the report's in-process time
  (clusterviews.usage).

Targets: sampling_cpu_pct <= 1 (of one core); usage_ms <= 1000.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Daemon, det_local_cmd, env_with_home, median, timed  # noqa: E402


def _daemon_cpu(jobs: int, cpu_s: float, enabled: bool) -> dict[str, float]:
    import subprocess

    import psutil

    with tempfile.TemporaryDirectory() as home:
        with open(os.path.join(home, "daemon.yaml"), "w") as f:
            f.write(f"system_metrics: {{enabled: {str(enabled).lower()}}}\n")
        with Daemon(home, DET_LOCAL_FAKE_GPUS=str(jobs)) as d:
            assert d.pid is not None
            env = d.env
            for _ in range(jobs):
                subprocess.run(
                    [*det_local_cmd(), "cmd", "run", "--slots", "1", "--", "sleep", "3600"],
                    env=env,
                    check=True,
                    capture_output=True,
                )
            from det_local.store.db import Store
            from det_local.store.paths import Paths

            db = Paths(Path(home)).db
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                s = Store(db, readonly=True)
                try:
                    running = sum(1 for j in s.jobs.active() if j.state == "SCHEDULED" and j.pid)
                finally:
                    s.close()
                if running == jobs:
                    break
                time.sleep(0.2)
            time.sleep(6)  # past the first sample of each job (the rates start at the second)
            proc = psutil.Process(d.pid)
            before = proc.cpu_times()
            t0 = time.monotonic()
            time.sleep(cpu_s)
            after = proc.cpu_times()
            elapsed = time.monotonic() - t0
            used = (after.user - before.user) + (after.system - before.system)
            s = Store(db, readonly=True)
            try:
                active = s.jobs.active()
                counts = [s.usage.count_samples(j.id) for j in active]
                now = time.time()
                # one sample at the start, then one every 5 s
                due = [1 + (now - (j.started_at or now)) / 5.0 for j in active]
            finally:
                s.close()
            return {
                "cpu_pct": round(100 * used / elapsed, 3),
                "samples_per_job": round(sum(counts) / max(1, len(counts)), 1),
                "expected": round(sum(due) / max(1, len(due)), 1),
            }


def _populate(home: str, n: int) -> None:
    from det_local.store.db import Store
    from det_local.store.paths import Paths

    rng = random.Random(30)
    now = time.time()
    year = 365 * 86400.0
    store = Store(Paths(Path(home)).db)
    try:
        with store.transaction():
            for i in range(n):
                start = now - year + rng.random() * (year - 7200)
                length = rng.uniform(60, 12 * 3600)
                trial = rng.random() < 0.8
                k = rng.choice((1, 1, 1, 2, 4))
                slots = rng.sample(range(8), k)
                store.usage.add_allocation(
                    job_id=i + 1,
                    kind="TRIAL" if trial else rng.choice(("COMMAND", "NOTEBOOK", "SHELL")),
                    user=f"user{rng.randrange(20)}",
                    slots=slots,
                    started_at=start,
                    ended_at=min(now, start + length),
                    experiment_id=rng.randrange(500) if trial else None,
                    trial_id=i + 1 if trial else None,
                    util_sum=rng.uniform(0, 100) * 10,
                    util_n=10,
                )
    finally:
        store.close()


def _usage(n: int, runs: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as home:
        _populate(home, n)
        env = env_with_home(home)
        argv = [*det_local_cmd(), "usage", "--since", "365d", "--json"]
        import resource

        timed(argv, env)  # warm-up
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        cli = median([timed(argv, env) for _ in range(runs)])
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_ms = (
            ((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)) * 1000 / runs
        )
        py = median([timed([sys.executable, "-c", "pass"], env) for _ in range(runs)])
        os.environ["DET_LOCAL_HOME"] = home
        from det_local.views import cluster as clusterviews

        inproc = []
        for _ in range(runs):
            t0 = time.perf_counter()
            rep = clusterviews.usage(time.time() - 365 * 86400)
            inproc.append(time.perf_counter() - t0)
        assert rep["total"]["allocations"] == n, rep["total"]
        return {  # timed() gives milliseconds
            "usage_ms": round(cli, 1),
            "usage_cpu_ms": round(cpu_ms, 1),  # the CLI process's own CPU (load-independent)
            "usage_in_process_ms": round(median(inproc) * 1000, 1),
            "python_pass_ms": round(py, 1),
        }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--cpu-s", type=float, default=30.0)
    ap.add_argument("--allocations", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="sampling on/off pairs (0: skip)")
    a = ap.parse_args()
    on: list[dict[str, float]] = []
    off: list[dict[str, float]] = []
    for _ in range(a.rounds):  # alternate: the machine's load changes under a long run
        on.append(_daemon_cpu(a.jobs, a.cpu_s, True))
        off.append(_daemon_cpu(a.jobs, a.cpu_s, False))
    usage = _usage(a.allocations, a.runs)
    out = {
        "jobs": a.jobs,
        "sampling_cpu_pct": median([r["cpu_pct"] for r in on]) if on else None,
        "sampling_off_cpu_pct": median([r["cpu_pct"] for r in off]) if off else None,
        "sampling_runs": [r["cpu_pct"] for r in on],
        "sampling_off_runs": [r["cpu_pct"] for r in off],
        "samples_per_job": median([r["samples_per_job"] for r in on]) if on else None,
        "expected_samples_per_job": median([r["expected"] for r in on]) if on else None,
        "allocations": a.allocations,
        **usage,
        "targets": {"sampling_cpu_pct": 1.0, "usage_ms": 1000.0},
    }
    out["ok"] = (out["sampling_cpu_pct"] or 0.0) <= 1.0 and usage["usage_ms"] <= 1000.0
    print(json.dumps(out))


if __name__ == "__main__":
    main()
