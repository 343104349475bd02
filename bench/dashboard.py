"""How fast the dashboard answers: server time for the experiments page over 1,000
experiments, the page of a 1,000-trial experiment, and a trial's metrics API over 1,000,000
reports (downsampled to ~2,000 points), next to the anchors in the same run: the same data
through `det-local experiment list --all --json` and `det-local trial metrics T --json`.

    python3 bench/dashboard.py [--runs N] [--experiments N] [--trials N] [--points N]

Targets (2 cores): experiments page <= 300 ms, experiment page <= 300 ms, metrics API <= 200 ms.
The store is filled directly through det_local's store API (no runs). Server time: the whole
request through the ASGI application in this process (routing, guard, store reads, rendering),
no socket. Medians after one warm-up. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import det_local_cmd, timed  # bench/ is on sys.path when run as a script

STEPS = (100, 200, 300, 400)  # the validations of each trial of the big experiment


def populate(home: Path, experiments: int, trials: int, points: int) -> tuple[int, int]:
    """Returns (the big experiment's id, the id of the trial with `points` reports)."""
    from det_local.store.db import Store
    from det_local.store.paths import Paths
    from det_local.store.states import State

    store = Store(Paths(home).ensure().db)
    config = {
        "name": "bench",
        "entrypoint": "python3 train.py",
        "searcher": {"name": "adaptive_asha", "metric": "val_loss", "max_trials": 16},
        "hyperparameters": {"lr": {"type": "log", "minval": -4, "maxval": -1, "base": 10}},
        "description": "x" * 2000,
    }
    with store.transaction():
        for i in range(experiments - 1):
            exp = store.create_experiment(
                name=f"bench-{i:04d}", config=config, labels=["bench", f"group-{i % 7}"]
            )
            store.set_experiment_progress(exp, (i % 100) / 100)
            for k in range(2):
                t = store.create_trial(exp, hparams={"lr": 0.001 * (k + 1)}, seed=k)
                store.set_best_validation(t, 1.0 / (i + k + 1))
            if i % 3 == 0:
                store.set_experiment_state(exp, State.COMPLETED)
        big = store.create_experiment(name="big", config=config, labels=["big"])
        hot = 0
        for k in range(trials):
            hp = {"lr": 10 ** -(1 + k % 3), "hidden": 32 * (1 + k % 4), "opt": {"momentum": 0.9}}
            t = store.create_trial(big, hparams=hp, seed=k)
            store.set_best_validation(t, 1.0 / (k + 1))
            store.metrics.conn.executemany(
                "INSERT INTO metrics(trial_id, run_id, grp, steps_completed, time, metrics)"
                " VALUES (?, 1, 'validation', ?, 0, ?)",
                [(t, s, json.dumps({"val_loss": 1.0 / (k + s), "acc": s / 400})) for s in STEPS],
            )
            hot = hot or t
    batch = 100_000
    for start in range(0, points, batch):
        with store.transaction():
            store.metrics.conn.executemany(
                "INSERT INTO metrics(trial_id, run_id, grp, steps_completed, time, metrics)"
                " VALUES (?, 1, 'training', ?, ?, ?)",
                (
                    (hot, s, float(s), f'{{"loss":{1.0 / (s + 1)},"lr":0.01}}')
                    for s in range(start, min(start + batch, points))
                ),
            )
    store.close()
    return big, hot


TOKEN = "bench-token-0123456789abcdef"  # every request carries the dashboard's token


def asgi_ms(app: Any, path: str, runs: int) -> tuple[float, int]:
    """Median ms of GET path through the application; returns it and the body's size."""
    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "GET",
        "path": path.partition("?")[0],
        "raw_path": path.partition("?")[0].encode(),
        "query_string": path.partition("?")[2].encode(),
        "headers": [(b"host", b"localhost:8080"), (b"authorization", b"Bearer " + TOKEN.encode())],
        "scheme": "http",
        "server": ("127.0.0.1", 8080),
        "client": ("127.0.0.1", 5000),
        "root_path": "",
    }

    async def once() -> tuple[int, int]:
        got: dict[str, Any] = {"size": 0}

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                got["status"] = message["status"]
            else:
                got["size"] += len(message.get("body", b""))

        await app(scope, receive, send)
        return got["status"], got["size"]

    samples = []
    size = 0
    for i in range(runs + 1):
        t0 = time.perf_counter()
        status, size = asyncio.run(once())
        elapsed = (time.perf_counter() - t0) * 1000
        if status != 200:
            sys.exit(f"GET {path} answered {status}")
        if i:
            samples.append(elapsed)
    return statistics.median(samples), size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--experiments", type=int, default=1000)
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--points", type=int, default=1_000_000)
    args = ap.parse_args()
    cli = det_local_cmd()
    with tempfile.TemporaryDirectory(prefix="det-local-bench-") as tmp:
        home = Path(tmp) / "home"
        os.environ["DET_LOCAL_HOME"] = str(home)
        t0 = time.perf_counter()
        big, hot = populate(home, args.experiments, args.trials, args.points)
        fill_s = time.perf_counter() - t0
        from det_local.api import paths
        from det_local.web.app import create_app
        from det_local.web.pool import install

        app = create_app(token=TOKEN)  # as the dashboard runs: one token, one pool of Stores
        install(paths())
        exps_ms, exps_size = asgi_ms(app, "/", args.runs)
        exp_ms, exp_size = asgi_ms(app, f"/experiments/{big}", args.runs)
        curves_ms, _ = asgi_ms(app, f"/api/experiments/{big}/metrics?group=validation", args.runs)
        metrics_ms, metrics_size = asgi_ms(
            app, f"/api/trials/{hot}/metrics?group=training", args.runs
        )
        api_list_ms, _ = asgi_ms(app, "/api/experiments", args.runs)
        # trial describe: its latest training and validation reports (MetricTable.latest)
        trial_ms, _ = asgi_ms(app, f"/trials/{hot}", args.runs)
        env = {**os.environ}
        list_anchor = statistics.median(
            timed([*cli, "experiment", "list", "--all", "--json"], env) for _ in range(3)
        )
        metrics_anchor = statistics.median(
            timed([*cli, "trial", "metrics", str(hot), "--group", "training", "--json"], env)
            for _ in range(3)
        )
        from det_local.views import experiments as expviews

        t0 = time.perf_counter()
        for _ in range(20):
            expviews.trial_progress(hot)
        poll_ms = (time.perf_counter() - t0) * 1000 / 20

    print(f"{os.cpu_count()} cpus; store filled in {fill_s:.1f} s; medians of {args.runs}")
    print(f"experiments page ({args.experiments})  {exps_ms:8.1f} ms ({exps_size} bytes, <= 300)")
    print(f"experiment page ({args.trials} trials) {exp_ms:8.1f} ms ({exp_size} bytes, <= 300)")
    print(f"its curves API                   {curves_ms:8.1f} ms")
    print(
        f"metrics API ({args.points} points)  {metrics_ms:8.1f} ms ({metrics_size} bytes, <= 200)"
    )
    print(f"/api/experiments                 {api_list_ms:8.1f} ms")
    print(f"trial page ({args.points} points)    {trial_ms:8.1f} ms")
    print(f"live poll (state, last report)   {poll_ms:8.2f} ms")
    print(f"anchor: experiment list --json   {list_anchor:8.1f} ms (a process)")
    print(f"anchor: trial metrics --json     {metrics_anchor:8.1f} ms (a process, every report)")
    print(
        json.dumps(
            {
                "experiments_page_ms": round(exps_ms, 1),
                "experiment_page_ms_1000_trials": round(exp_ms, 1),
                "metrics_api_ms_1m_points": round(metrics_ms, 1),
                "experiment_curves_api_ms": round(curves_ms, 1),
                "api_experiments_ms": round(api_list_ms, 1),
                "trial_page_ms_1m_points": round(trial_ms, 1),
                "live_poll_ms": round(poll_ms, 2),
                "anchor_experiment_list_json_ms": round(list_anchor, 1),
                "anchor_trial_metrics_json_ms": round(metrics_anchor, 1),
                "experiments": args.experiments,
                "trials": args.trials,
                "points": args.points,
            }
        )
    )


if __name__ == "__main__":
    main()
