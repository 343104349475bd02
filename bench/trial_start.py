"""Trial start: how long a Core API trial that imports torch takes from its start to its first
reported metric, cold (a fresh interpreter) and warm (forked from its experiment's zygote,
`sched/warm/zygotes.py`), against ``python -c "import torch"`` in the same run.

One daemon (one CPU slot). Each round submits two grid searches of --trials trials, one at a
time (max_concurrent_trials 1): one with warm starts off (``DET_LOCAL_WARM_START=off``), one
on; the order alternates between rounds. The first trial of a search is cold either way (its
zygote imports meanwhile; in the warm search it waits for its zygote to be ready, so that the
later ones are forked); the figures are over the later trials: from the moment the daemon
started the trial (its job's started_at) to the time of its first reported metric. Also
reported: the daemon's own measure (spawn to hello, `experiment describe`'s "Trial start"),
and submission to the first metric of each search's first trial.

Keys: cold_s_p50, warm_s_p50, import_torch_s_p50 (target: warm_s_p50 <= 0.3).

--stack common (issue 28): the script imports the common data-science stack at its top level
(torch, scikit-learn, pandas; pyarrow comes with pandas where it is installed, and its jemalloc
starts a background thread at import, which the zygote switches off), and the anchor is
``python -c "import torch, sklearn, pandas"`` (import_stack_s_p50). The result says whether
pyarrow is installed (pyarrow_installed); the target is the same.

Usage: python3 bench/trial_start.py [--rounds 3] [--trials 5] [--stack torch|common]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Daemon, det_local_cmd  # noqa: E402

SCRIPT = r"""
import sys
preloaded = "torch" in sys.modules  # forked from the zygote
import glob, os, time
import torch
import determined as det

home, exp = os.environ["DET_LOCAL_HOME"], os.environ["DET_EXPERIMENT_ID"]
# a cold trial of the warm search (its first) waits for the zygote, for the later ones' sake
if os.environ.get("DET_LOCAL_WARM_START") == "on" and not preloaded:
    deadline = time.monotonic() + 120
    while not glob.glob(os.path.join(home, "run", "z", exp + ".*", "s")):
        assert time.monotonic() < deadline, "no zygote"
        time.sleep(0.02)
model = torch.nn.Linear(8, 1)
loss = model(torch.randn(4, 8)).pow(2).mean().item()
with det.core.init() as core:
    core.train.report_training_metrics(steps_completed=1, metrics={"loss": loss})
"""


COMMON_IMPORTS = "import torch\nimport sklearn\nimport pandas\n"


def script(stack: str) -> str:
    """The trial's script: torch alone, or the common stack imported at its top level."""
    if stack == "torch":
        return SCRIPT
    common = SCRIPT.replace("import torch\n", COMMON_IMPORTS, 1)
    return common.replace(
        "model = torch.nn", "assert pandas.DataFrame({'a': [1]}).shape\nmodel = torch.nn"
    )


def config(warm: bool, trials: int) -> str:
    return json.dumps(
        {
            "name": f"trial-start-{'warm' if warm else 'cold'}",
            "entrypoint": "python3 train.py",
            "searcher": {
                "name": "grid",
                "metric": "loss",
                "max_length": 1,
                "max_concurrent_trials": 1,
            },
            "hyperparameters": {"x": {"type": "categorical", "vals": list(range(trials))}},
            "environment": {
                "environment_variables": [f"DET_LOCAL_WARM_START={'on' if warm else 'off'}"]
            },
            "max_restarts": 0,
        }
    )


def submit(env: dict[str, str], ctx: Path, warm: bool, trials: int) -> int:
    (ctx / "config.yaml").write_text(config(warm, trials))
    out = subprocess.run(
        [*det_local_cmd(), "experiment", "create", "config.yaml", "."],
        env=env,
        cwd=ctx,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"experiment create failed: {out.stderr.strip()[-2000:]}")
    return int(out.stdout.split()[-1])


def wait_done(db: Path, exp_id: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = query(db, "SELECT state FROM experiments WHERE id=?", (exp_id,))
        if state and state[0][0] in ("COMPLETED", "ERROR", "CANCELED"):
            if state[0][0] != "COMPLETED":
                raise SystemExit(f"experiment {exp_id} ended {state[0][0]}")
            return
        time.sleep(0.1)
    raise SystemExit(f"experiment {exp_id} did not end within {timeout:.0f}s")


def query(db: Path, sql: str, args: tuple[object, ...]) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return list(conn.execute(sql, args))
    finally:
        conn.close()


def starts(db: Path, exp_id: int) -> tuple[list[float], list[float], list[bool], float]:
    """(start to first metric, spawn to hello, warm) of the trials after the first, and
    submission to the first trial's first metric."""
    rows = query(
        db,
        "SELECT t.id, j.started_at, (SELECT MIN(m.time) FROM metrics m WHERE m.trial_id=t.id),"
        " s.seconds, s.warm FROM trials t JOIN jobs j ON j.trial_id=t.id"
        " JOIN trial_starts s ON s.trial_id=t.id WHERE t.experiment_id=? ORDER BY t.id",
        (exp_id,),
    )
    created = query(db, "SELECT created_at FROM experiments WHERE id=?", (exp_id,))[0][0]
    first = float(rows[0][2]) - float(created)  # type: ignore[arg-type]
    later = rows[1:]
    to_metric = [float(r[2]) - float(r[1]) for r in later]  # type: ignore[arg-type]
    to_hello = [float(r[3]) for r in later]  # type: ignore[arg-type]
    return to_metric, to_hello, [bool(r[4]) for r in later], first


def import_torch(stack: str = "torch") -> float:
    code = "import torch" if stack == "torch" else "import torch, sklearn, pandas"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


def pyarrow_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("pyarrow") is not None


def p50(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--stack", choices=["torch", "common"], default="torch")
    args = parser.parse_args()
    cold, warm, cold_hello, warm_hello, torch_s, first = [], [], [], [], [], []
    with tempfile.TemporaryDirectory(prefix="det-local-bench-") as tmp:
        home = Path(tmp) / "home"
        ctx = Path(tmp) / "ctx"
        ctx.mkdir()
        (ctx / "train.py").write_text(script(args.stack))
        with Daemon(str(home), DET_LOCAL_CPU_SLOTS="1", DET_LOCAL_METRIC_LINES="0") as daemon:
            db = home / "det-local.db"
            import_torch(args.stack)  # page cache
            for rnd in range(args.rounds):
                for mode in ("cold", "warm") if rnd % 2 == 0 else ("warm", "cold"):
                    torch_s.append(import_torch(args.stack))
                    on = mode == "warm"
                    exp_id = submit(daemon.env, ctx, on, args.trials)
                    wait_done(db, exp_id)
                    to_metric, to_hello, kinds, to_first = starts(db, exp_id)
                    if on and not all(kinds):
                        raise SystemExit(f"experiment {exp_id}: not every later trial was warm")
                    (warm if on else cold).extend(to_metric)
                    (warm_hello if on else cold_hello).extend(to_hello)
                    first.append(to_first)
    print(
        json.dumps(
            {
                "cold_s_p50": p50(cold),
                "warm_s_p50": p50(warm),
                "stack": args.stack,
                ("import_torch_s_p50" if args.stack == "torch" else "import_stack_s_p50"): p50(
                    torch_s
                ),
                "pyarrow_installed": pyarrow_installed(),
                "cold_spawn_to_hello_s_p50": p50(cold_hello),
                "warm_spawn_to_hello_s_p50": p50(warm_hello),
                "submit_to_first_metric_s_p50": p50(first),
                "trials_each": len(warm),
                "target_warm_s": 0.3,
                "meets_target": p50(warm) <= 0.3,
            }
        )
    )


if __name__ == "__main__":
    main()
