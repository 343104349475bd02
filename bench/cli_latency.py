"""How long the commands a lab member types all day take, next to `python -c pass` of the same
interpreter (the floor of any Python CLI), alternating command and floor in one run (issue 37).

    python3 bench/cli_latency.py [--runs 15] [--rows 10000] [--loop 200] [--only NAME,...]

A daemon runs on a temporary home (2 CPU slots) with one finished experiment (for `experiment
describe` and `trial logs`); a `sleep` command then holds both slots, so what the submissions
below queue waits and costs nothing while the others are timed. Each command runs once to warm
the page cache and the help cache (`det-local` answers pure help from it), then --runs times,
each run right after a run of the floor; the figure is the median of (command - floor) pairs
and the medians of each, in wall time and in CPU time (user + system of the process: what a
machine shared with other work cannot inflate as much). det_local's bytecode is compiled
first (as Python does at a first import, unless PYTHONDONTWRITEBYTECODE is set, as on the
development machine; --no-compile measures without it). Then the store gets --rows queued
commands and --rows experiments and the lists are timed the same way (0 skips them). --loop N:
a shell loop's N `cmd run` one after another, against N floors one after another (the issue's
"200 submissions from a shell loop").

Targets (2 cores): each command <= floor + 25 ms; lists of 10,000 rows <= floor + 100 ms; the
loop of 200 within the 200 floors + 5 s.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Daemon, det_local_cmd, env_with_home  # noqa: E402

CONFIG = """\
name: latency
entrypoint: python3 -c "print('a line of output')"
searcher: {name: single, metric: x, max_length: 1}
"""

COMMANDS: list[tuple[str, list[str]]] = [
    ("--help", ["--help"]),
    ("experiment --help", ["experiment", "--help"]),
    ("cmd run --help", ["cmd", "run", "--help"]),
    ("cmd run", ["cmd", "run", "--", "true"]),
    ("job list", ["job", "list"]),
    ("experiment list", ["experiment", "list"]),
    ("experiment describe", ["experiment", "describe", "1"]),
    ("trial logs", ["trial", "logs", "1"]),
    ("slots", ["slots"]),
    ("daemon status", ["daemon", "status"]),
    ("experiment create", ["experiment", "create", "config.yaml", "."]),
    ("run --detach", ["run", "--detach", "config.yaml", "."]),
]
LISTS: list[tuple[str, list[str]]] = [
    ("job list", ["job", "list"]),
    ("experiment list", ["experiment", "list"]),
    ("cmd list", ["cmd", "list"]),
]


def once(argv: list[str], env: dict[str, str], cwd: str) -> tuple[float, float]:
    """(wall ms, CPU ms: user + system of the process and what it waited for) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    p = subprocess.run(argv, env=env, cwd=cwd, capture_output=True)
    ms = (time.perf_counter() - start) * 1000
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.decode()[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) * 1000
    return ms, cpu


def paired(argv: list[str], env: dict[str, str], cwd: str, runs: int) -> dict[str, float]:
    floor_argv = [sys.executable, "-c", "pass"]
    once(argv, env, cwd)  # warm-up
    once(floor_argv, env, cwd)
    cmd, floor = [], []
    for _ in range(runs):
        floor.append(once(floor_argv, env, cwd))
        cmd.append(once(argv, env, cwd))

    def med(values: list[float]) -> float:
        return round(statistics.median(values), 1)

    return {
        "ms": med([c[0] for c in cmd]),
        "floor_ms": med([f[0] for f in floor]),
        "over_ms": med([c[0] - f[0] for c, f in zip(cmd, floor, strict=True)]),
        "cpu_ms": med([c[1] for c in cmd]),
        "floor_cpu_ms": med([f[1] for f in floor]),
        "over_cpu_ms": med([c[1] - f[1] for c, f in zip(cmd, floor, strict=True)]),
    }


def populate(home: Path, rows: int) -> None:
    from det_local.store.db import Store
    from det_local.store.paths import Paths

    store = Store(Paths(home).db)
    user = "root" if os.geteuid() == 0 else str(os.geteuid())
    config = {"name": "bench", "entrypoint": "python3 train.py", "searcher": {"name": "single"}}
    with store.transaction():
        for i in range(rows):
            store.jobs.create(
                kind="COMMAND",
                name=f"python3 eval.py --shard {i}",
                user=user,
                uid=os.geteuid(),
                priority=42,
                slots_needed=1,
                argv=["python3", "eval.py", "--shard", str(i)],
                cwd="/tmp",
            )
            store.create_experiment(name=f"bench-{i:05d}", config=config, labels=["bench"])
    store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--rows", type=int, default=10000, help="rows for the lists (0: skip)")
    ap.add_argument("--loop", type=int, default=200, help="cmd runs in a loop (0: skip)")
    ap.add_argument("--only", default="", help="comma-separated command names")
    ap.add_argument("--no-compile", action="store_true", help="leave det_local's bytecode be")
    ap.add_argument("--cli", default=None, help="the det-local command (default: the script)")
    args = ap.parse_args()
    if not args.no_compile:
        import compileall

        import det_local

        compileall.compile_dir(os.path.dirname(det_local.__file__), quiet=2)
    cli = shlex.split(args.cli) if args.cli else det_local_cmd()
    only = {n.strip() for n in args.only.split(",") if n.strip()}

    with tempfile.TemporaryDirectory(prefix="det-local-bench-") as tmp:
        ctx = Path(tmp) / "ctx"
        ctx.mkdir()
        (ctx / "config.yaml").write_text(CONFIG)
        home = Path(tmp) / "home"
        env = {**env_with_home(str(home)), "XDG_CACHE_HOME": str(Path(tmp) / "cache")}
        results: dict[str, dict[str, float]] = {}
        lists: dict[str, dict[str, float]] = {}
        with Daemon(str(home), DET_LOCAL_CPU_SLOTS="2") as daemon:
            once([*cli, "run", "config.yaml", "."], env, str(ctx))  # experiment 1, trial 1
            once([*cli, "cmd", "run", "--slots", "2", "--", "sleep", "3600"], env, str(ctx))
            for name, argv in COMMANDS:
                if only and name not in only:
                    continue
                results[name] = paired([*cli, *argv], env, str(ctx), args.runs)
                r = results[name]
                print(
                    f"{name:22s} {r['ms']:7.1f} ms  floor {r['floor_ms']:6.1f}  +{r['over_ms']:.1f}"
                    f"   CPU {r['cpu_ms']:6.1f} ms  floor {r['floor_cpu_ms']:5.1f}"
                    f"  +{r['over_cpu_ms']:.1f}"
                )
            loop: dict[str, float] = {}
            if args.loop:
                floor_argv = [sys.executable, "-c", "pass"]
                submit = [*cli, "cmd", "run", "--", "true"]
                t0 = time.perf_counter()
                for _ in range(args.loop):
                    once(floor_argv, env, str(ctx))
                t1 = time.perf_counter()
                for _ in range(args.loop):
                    once(submit, env, str(ctx))
                t2 = time.perf_counter()
                loop = {
                    "n": args.loop,
                    "floor_s": round(t1 - t0, 2),
                    "cmd_run_s": round(t2 - t1, 2),
                }
                print(
                    f"loop of {args.loop} cmd run {loop['cmd_run_s']} s, floors {loop['floor_s']} s"
                )
            if args.rows:
                daemon.stop()
                populate(home, args.rows)
                for name, argv in LISTS:
                    lists[name] = paired([*cli, *argv], env, str(ctx), args.runs)
                    r = lists[name]
                    print(
                        f"{name} ({args.rows} rows) {r['ms']:7.1f} ms  floor {r['floor_ms']:6.1f}"
                        f"  +{r['over_ms']:.1f}   CPU +{r['over_cpu_ms']:.1f}"
                    )
    print(
        json.dumps(
            {
                "commands": results,
                "lists": lists,
                "loop": loop,
                "rows": args.rows,
                "runs": args.runs,
                "cpus": os.cpu_count(),
                "compiled": not args.no_compile,
                "targets": {"over_ms": 25, "list_over_ms": 100},
            }
        )
    )


if __name__ == "__main__":
    main()
