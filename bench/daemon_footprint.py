"""The idle daemon's memory and CPU, and `det-local job list` over 10,000 jobs, next to
task-spooler and `python3 -c pass` in the same run.

    python3 bench/daemon_footprint.py [--settle-s 3] [--cpu-s 10] [--jobs 10000] [--runs 7]

- idle_rss_mb: resident memory of `det-local daemon start` on a temporary home (CPU slots),
  --settle-s seconds after it serves; also its USS (memory only it holds) and thread count.
- idle_cpu_pct: its user + system CPU time over --cpu-s seconds of idleness (psutil cpu_times
  delta), as a percentage of one core.
- job_list_10000_ms: wall time of the whole `det-local job list` process (the default view:
  queued and running jobs) when the store holds --jobs QUEUED commands, each with the argv, cwd
  and environment a `det-local cmd run` records; median of --runs after one warm-up. The same
  store is timed with `--all` and `--json`; then all but 10 are marked DONE and the default
  view is timed again (a long history, a short queue: job_list_history_ms). Rows are written
  with the store's own writer (Store.jobs.create/finish) while no daemon runs.
- Anchors: `python3 -c pass` (interpreter start-up, the floor of any Python CLI); task-spooler's
  idle server RSS and CPU, and `tsp -l` listing --tsp-jobs finished `true` jobs.

Targets: idle_rss_mb <= 80, idle_cpu_pct <= 1, job_list_10000_ms <= 400.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Daemon, Tsp, det_local_cmd, env_with_home, find_tsp, median, timed  # noqa: E402


def idle_footprint(pid: int, settle_s: float, cpu_s: float) -> dict[str, float]:
    import psutil

    proc = psutil.Process(pid)
    time.sleep(settle_s)
    before = proc.cpu_times()
    t0 = time.monotonic()
    time.sleep(cpu_s)
    after = proc.cpu_times()
    elapsed = time.monotonic() - t0
    used = (after.user - before.user) + (after.system - before.system)
    mem = proc.memory_full_info()
    return {
        "rss_mb": round(mem.rss / 2**20, 1),
        "uss_mb": round(mem.uss / 2**20, 1),
        "cpu_pct": round(100 * used / elapsed, 3),
        "threads": proc.num_threads(),
    }


def populate(home: str, n: int) -> None:
    from det_local.store.db import Store
    from det_local.store.paths import Paths

    p = Paths(Path(home)).ensure()
    store = Store(p.db)
    with store.transaction():
        for i in range(n):
            store.jobs.create(
                kind="COMMAND",
                name=f"python3 eval.py --shard {i}",
                user="root" if os.geteuid() == 0 else str(os.geteuid()),
                uid=os.geteuid(),
                priority=42,
                slots_needed=1,
                argv=["python3", "eval.py", "--shard", str(i)],
                cwd="/tmp",
            )
    store.close()


def finish_all_but(home: str, keep: int) -> None:
    from det_local.store.db import Store
    from det_local.store.paths import Paths

    store = Store(Paths(Path(home)).db)
    with store.transaction():
        for job in store.jobs.active()[keep:]:
            store.jobs.finish(job.id, 0, f"command {job.id} exited with code 0")
    store.close()


def time_median(argv: list[str], env: dict[str, str], runs: int) -> float:
    timed(argv, env)  # warm-up: page cache
    return median([timed(argv, env) for _ in range(runs)])


def tsp_anchor(
    exe: str, tmp: Path, n: int, settle_s: float, cpu_s: float, runs: int
) -> tuple[dict[str, float] | None, float, int]:
    with Tsp(exe, str(tmp / "tsp"), slots=2) as tsp:
        pid = tsp.server_pid()
        idle = idle_footprint(pid, settle_s, min(cpu_s, 5.0)) if pid else None
        last = ""
        for _ in range(n):
            last = tsp("true").strip()
        if last:
            tsp("-w", last, check=False)
        while any(" running " in line for line in tsp("-l").splitlines()):
            time.sleep(0.05)
        listed = len(tsp("-l").splitlines()) - 1
        list_ms = time_median([exe, "-l"], tsp.env, runs)
    return idle, list_ms, listed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--cpu-s", type=float, default=10.0)
    parser.add_argument("--jobs", type=int, default=10000)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--tsp-jobs", type=int, default=10000, help="0 skips tsp -l")
    parser.add_argument("--no-tsp", action="store_true")
    args = parser.parse_args()

    exe = None if args.no_tsp else find_tsp()
    with tempfile.TemporaryDirectory(prefix="det-local-bench-") as tmp_name:
        tmp = Path(tmp_name)
        home = str(tmp / "home")
        with Daemon(home) as daemon:
            assert daemon.pid is not None
            idle = idle_footprint(daemon.pid, args.settle_s, args.cpu_s)

        # the daemon is stopped: the store's writer is free for the benchmark to fill
        list_home = str(tmp / "list-home")
        t0 = time.perf_counter()
        populate(list_home, args.jobs)
        populate_s = time.perf_counter() - t0
        env = env_with_home(list_home)
        cli = det_local_cmd()
        listing = {
            "default": time_median([*cli, "job", "list"], env, args.runs),
            "all": time_median([*cli, "job", "list", "--all"], env, args.runs),
            "json": time_median([*cli, "job", "list", "--json"], env, args.runs),
        }
        finish_all_but(list_home, 10)
        listing["history"] = time_median([*cli, "job", "list"], env, args.runs)
        listing["history_all"] = time_median([*cli, "job", "list", "--all"], env, args.runs)
        python_pass = time_median([sys.executable, "-c", "pass"], env, args.runs)

        tsp_idle = tsp_list_ms = tsp_listed = None
        if exe is not None:
            tsp_idle, tsp_list_ms, tsp_listed = tsp_anchor(
                exe, tmp, args.tsp_jobs, args.settle_s, args.cpu_s, args.runs
            )

    result = {
        "idle_rss_mb": idle["rss_mb"],
        "idle_cpu_pct": idle["cpu_pct"],
        "job_list_10000_ms": listing["default"],
        "job_list_all_ms": listing["all"],
        "job_list_json_ms": listing["json"],
        "job_list_history_ms": listing["history"],
        "job_list_history_all_ms": listing["history_all"],
        "idle_uss_mb": idle["uss_mb"],
        "idle_threads": idle["threads"],
        "python_pass_ms": python_pass,
        "tsp_idle_rss_mb": tsp_idle["rss_mb"] if tsp_idle else None,
        "tsp_idle_cpu_pct": tsp_idle["cpu_pct"] if tsp_idle else None,
        "tsp_list_ms": tsp_list_ms,
        "tsp_listed_jobs": tsp_listed,
        "jobs": args.jobs,
        "populate_s": round(populate_s, 2),
        "runs": args.runs,
        "cpu_window_s": args.cpu_s,
        "cpus": os.cpu_count(),
        "tsp": exe
        or (
            "skipped (--no-tsp)" if args.no_tsp else "not available (apt-get install task-spooler)"
        ),
        "targets": {"idle_rss_mb": "<= 80", "idle_cpu_pct": "<= 1", "job_list_10000_ms": "<= 400"},
    }
    print(
        f"idle daemon: {idle['rss_mb']} MB RSS ({idle['uss_mb']} MB USS), {idle['cpu_pct']}% CPU; "
        f"tsp server: {result['tsp_idle_rss_mb']} MB, {result['tsp_idle_cpu_pct']}%"
    )
    print(
        f"`det-local job list` with {args.jobs} queued jobs: {listing['default']} ms "
        f"(--all {listing['all']} ms, --json {listing['json']} ms; 10 queued + "
        f"{args.jobs - 10} done: {listing['history']} ms); `python3 -c pass` {python_pass} ms; "
        f"`tsp -l` of {tsp_listed} jobs: {tsp_list_ms} ms"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
