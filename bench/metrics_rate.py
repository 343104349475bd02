"""Metric reporting rate: report_training_metrics in a tight loop inside a det-local trial.

The trial measures how fast the caller returns (reports_per_s); afterwards the store is
counted (stored must equal sent). Target: >= 50,000 reports/s and stored == sent.

Usage: python3 bench/metrics_rate.py [--reports 200000]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import det_local_cmd, env_with_home  # noqa: E402

TRIAL = """\
import json, time
from determined import core

N = {n}
with core.init() as ctx:
    t0 = time.perf_counter()
    for i in range(N):
        ctx.train.report_training_metrics(steps_completed=i, metrics={{"loss": 1.0 / (i + 1)}})
    elapsed = time.perf_counter() - t0
    with open("result.json", "w") as f:
        json.dump({{"sent": N, "loop_s": elapsed}}, f)
"""

CONFIG = """\
name: metrics-rate
entrypoint: python3 trial.py
searcher: {name: single, metric: loss}
max_restarts: 0
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reports", type=int, default=200_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="det-local-bench-") as tmp:
        ctx = os.path.join(tmp, "ctx")
        os.makedirs(ctx)
        with open(os.path.join(ctx, "trial.py"), "w") as f:
            f.write(TRIAL.format(n=args.reports))
        with open(os.path.join(ctx, "config.yaml"), "w") as f:
            f.write(CONFIG)
        home = os.path.join(tmp, "home")
        proc = subprocess.run(
            [*det_local_cmd(), "run", "config.yaml", ".", "--quiet"],
            cwd=ctx,
            env=env_with_home(home),
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise SystemExit(f"det-local run failed: {proc.stdout}\n{proc.stderr}")
        snapshot = os.path.join(home, "experiments", "1", "context", "result.json")
        with open(snapshot) as f:
            trial = json.load(f)
        db = sqlite3.connect(os.path.join(home, "det-local.db"))
        stored = db.execute("SELECT COUNT(*) FROM metrics WHERE grp='training'").fetchone()[0]
    result = {
        "reports_per_s": round(trial["sent"] / trial["loop_s"]),
        "sent": trial["sent"],
        "stored": stored,
        "loop_s": round(trial["loop_s"], 3),
        "target_reports_per_s": 50_000,
    }
    print(f"{result['reports_per_s']} reports/s in the caller; stored {stored} of {trial['sent']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
