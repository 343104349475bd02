"""A Slurm pool against plain Slurm, on a private single-host Slurm (tests/support/slurmkit.py).

    python3 bench/slurm_pool.py [--runs 3] [--batch-s 0.2] [--checkpoint-s 0.5] [--reports 50000]
                                [--channel tcp]

Needs root and Debian's slurm-wlm and munge (`.ci/run` installs them). A user-mode det-local
daemon on a temporary home has one Slurm pool (partition debug); in the same run:

* first_metric_s: submission (`det-local run --detach`) to the trial's first metric stored
  (polled in the store every 10 ms), median over --runs; its anchor first_output_sbatch_s:
  `sbatch --wrap` of the same script outside det-local, submission to the line it writes first.
  Target: first_metric_s <= first_output_sbatch_s + 1. sbatch_to_first_metric_s splits off
  det-local's own submission (CLI, context snapshot, spool): from its sbatch call (the run's
  recorded start; sbatch runs in a thread of its own, `det_local/slurm/submitter.py`).
* pause_to_gone_s: `det-local experiment pause` to the trial's Slurm job gone from squeue, for a
  trial whose batches take batch_s and whose checkpoint takes checkpoint_s (a sleep), median
  over --runs. Target: <= batch_s + checkpoint_s + 2.
* metrics_per_s: --reports report_training_metrics calls in a tight loop inside a Slurm job,
  from the first report to the last one stored. Target: >= 10,000/s.
* metrics_per_s_tcp (with --channel tcp): the same in a second pool whose trials report over the
  TCP channel (`slurm.channel` on loopback, sealed frames) and run staged (`slurm.stage_dir`),
  right after the unix socket's run, in the same daemon.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))
from _common import Daemon, det_local_cmd  # noqa: E402

from tests.support.slurmkit import Slurm, start, stop  # noqa: E402

TRIAL = """\
import json, os, sys, time

import determined as det
from determined import core

mode = sys.argv[1]
if not os.environ.get("DET_TRIAL_ID"):  # the anchor: plain sbatch, no det-local
    with open(sys.argv[2], "a") as f:
        f.write(f"{time.time()}\\n")
    sys.exit(0)
info = det.get_cluster_info()
hp = info.trial.hparams
with core.init() as ctx:
    if mode == "first":
        ctx.train.report_training_metrics(steps_completed=1, metrics={"loss": 1.0})
    elif mode == "rate":
        n = int(hp["reports"])
        with open(hp["out"], "w") as f:
            f.write(f"{time.time()}\\n")
        for i in range(1, n + 1):
            ctx.train.report_training_metrics(steps_completed=i, metrics={"loss": 1.0 / i})
    else:  # pause: batches until told to stop, then a checkpoint
        batch = 0
        while True:
            time.sleep(hp["batch_s"])
            batch += 1
            ctx.train.report_training_metrics(steps_completed=batch, metrics={"loss": 1 / batch})
            if ctx.preempt.should_preempt():
                with ctx.checkpoint.store_path({"steps_completed": batch}) as (path, _):
                    (path / "w").write_text(str(batch))
                    time.sleep(hp["checkpoint_s"])
                break
"""


METRICS_SQL = (
    "SELECT COUNT(*) FROM metrics m JOIN trials t ON m.trial_id=t.id WHERE t.experiment_id=?"
)


def poll(check: Callable[[], object], timeout: float = 120.0, every: float = 0.01) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {check}")
        time.sleep(every)


def count(db: Path, sql: str, *args: object) -> int:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as c:
            return int(c.execute(sql, args).fetchone()[0])
    except sqlite3.Error:
        return 0


def sbatched(db: Path, exp_id: int) -> float:
    """When the trial's sbatch returned (its job's recorded start)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as c:
        row = c.execute("SELECT pid_start FROM jobs WHERE experiment_id=?", (exp_id,)).fetchone()
    return float(row[0])


def write_context(
    root: Path, name: str, mode: str, hparams: dict[str, object], pool: str = "hpc"
) -> Path:
    ctx = root / name
    ctx.mkdir()
    (ctx / "train.py").write_text(TRIAL)
    config = {
        "name": name,
        "entrypoint": f"python3 train.py {mode}",
        "searcher": {"name": "single", "metric": "loss", "max_length": 1},
        "hyperparameters": hparams,
        "resources": {"resource_pool": pool},
        "max_restarts": 0,
    }
    (ctx / "config.yaml").write_text(json.dumps(config))
    return ctx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batch-s", type=float, default=0.2)
    ap.add_argument("--checkpoint-s", type=float, default=0.5)
    ap.add_argument("--reports", type=int, default=50_000)
    ap.add_argument("--channel", choices=["unix", "tcp"], default="unix")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="slurm-bench-"))
    slurm = start(root / "slurm")
    try:
        print(json.dumps(run(root, slurm, args)))
    finally:
        stop(slurm)
        shutil.rmtree(root, ignore_errors=True)


def run(root: Path, slurm: Slurm, args: argparse.Namespace) -> dict[str, object]:
    home = root / "home"
    home.mkdir()
    pools: dict[str, object] = {"hpc": {"slurm": {"partition": "debug"}}}
    if args.channel == "tcp":
        from tests.support.slurmkit import _free_ports

        stage = root / "stage"
        stage.mkdir()
        (port,) = _free_ports(1)
        channel = {"listen": f"127.0.0.1:{port}"}
        pools["hpc-tcp"] = {
            "slurm": {"partition": "debug", "channel": channel, "stage_dir": str(stage)}
        }
    (home / "daemon.yaml").write_text(json.dumps({"resource_pools": pools}))
    db = home / "det-local.db"
    det = det_local_cmd()
    anchor, first, gone, rate = [], [], [], 0.0
    after_sbatch: list[float] = []  # det-local: the sbatch call's return to the first metric
    with Daemon(str(home), SLURM_CONF=str(slurm.conf), DET_LOCAL_METRIC_LINES="0") as d:
        env = d.env
        exp = 0

        def submit(ctx: Path) -> int:
            nonlocal exp
            r = subprocess.run(
                [*det, "run", "--detach", str(ctx / "config.yaml"), str(ctx)],
                env=env,
                capture_output=True,
                text=True,
            )
            if r.returncode != 0:
                raise SystemExit(f"det-local run failed: {r.stderr.strip()}")
            exp += 1
            return exp

        def metrics_of(exp_id: int) -> int:
            return count(db, METRICS_SQL, exp_id)

        def ended(exp_id: int) -> bool:
            sql = "SELECT COUNT(*) FROM experiments WHERE id=? AND state IN ('COMPLETED','PAUSED')"
            return count(db, sql, exp_id) == 1

        for i in range(args.runs):
            # the anchor: sbatch --wrap of the same script, to the first line it writes
            out = root / f"anchor-{i}.txt"
            ctx = write_context(root, f"first-{i}", "first", {})
            t0 = time.time()
            slurm.run(
                "sbatch", "--parsable", "-p", "debug", "-o", "/dev/null", f"--chdir={ctx}",
                f"--wrap={sys.executable} train.py first {out}",
            )  # fmt: skip
            poll(lambda o=out: o.exists() and o.read_text().strip())
            anchor.append(float(out.read_text().split()[0]) - t0)
            poll(lambda: slurm.queue() == [])
            # det-local: submission to the first metric stored
            t0 = time.time()
            exp_id = submit(ctx)
            poll(lambda e=exp_id: metrics_of(e) > 0)
            now = time.time()
            first.append(now - t0)
            after_sbatch.append(now - sbatched(db, exp_id))
            poll(lambda e=exp_id: ended(e))

        hp = {"batch_s": args.batch_s, "checkpoint_s": args.checkpoint_s}
        for i in range(args.runs):
            ctx = write_context(root, f"pause-{i}", "pause", hp)
            exp_id = submit(ctx)
            poll(lambda e=exp_id: metrics_of(e) >= 2)
            t0 = time.time()
            subprocess.run([*det, "experiment", "pause", str(exp_id)], env=env, check=True,
                           capture_output=True)  # fmt: skip
            poll(lambda: slurm.queue() == [])
            gone.append(time.time() - t0)
            poll(lambda e=exp_id: ended(e))

        marker = root / "rate-start.txt"
        ctx = write_context(root, "rate", "rate", {"reports": args.reports, "out": str(marker)})
        exp_id = submit(ctx)
        poll(lambda e=exp_id: metrics_of(e) >= args.reports, timeout=600, every=0.02)
        done = time.time()
        rate = args.reports / (done - float(marker.read_text().split()[0]))
        tcp_rate: float | None = None
        if args.channel == "tcp":  # the same, over the TCP channel, staged
            marker = root / "rate-tcp-start.txt"
            hp = {"reports": args.reports, "out": str(marker)}
            ctx = write_context(root, "rate-tcp", "rate", hp, pool="hpc-tcp")
            exp_id = submit(ctx)
            poll(lambda e=exp_id: metrics_of(e) >= args.reports, timeout=600, every=0.02)
            done = time.time()
            tcp_rate = args.reports / (done - float(marker.read_text().split()[0]))
    med_first, med_anchor = statistics.median(first), statistics.median(anchor)
    med_gone = statistics.median(gone)
    return {
        "bench": "slurm_pool",
        "runs": args.runs,
        "first_metric_s": round(med_first, 3),
        "first_output_sbatch_s": round(med_anchor, 3),
        "first_metric_overhead_s": round(med_first - med_anchor, 3),
        "first_metric_target_met": med_first <= med_anchor + 1.0,
        # the same, from det-local's sbatch call: what the Slurm pool adds to plain sbatch
        # (the rest of first_metric_s is det-local's submission: the CLI, the context
        # snapshot, the spool; the same for a local trial: bench/run_overhead.py)
        "sbatch_to_first_metric_s": round(statistics.median(after_sbatch), 3),
        "sbatch_to_first_metric_target_met": statistics.median(after_sbatch) <= med_anchor + 1.0,
        "pause_to_gone_s": round(med_gone, 3),
        "pause_target_s": round(args.batch_s + args.checkpoint_s + 2, 3),
        "pause_target_met": med_gone <= args.batch_s + args.checkpoint_s + 2,
        "metrics_per_s": round(rate),
        "metrics_target_met": rate >= 10_000,
        "channel": args.channel,
        "metrics_per_s_tcp": None if tcp_rate is None else round(tcp_rate),
        "metrics_tcp_target_met": None if tcp_rate is None else tcp_rate >= 10_000,
        "reports": args.reports,
        "samples": {
            "first_metric_s": [round(x, 3) for x in first],
            "first_output_sbatch_s": [round(x, 3) for x in anchor],
            "sbatch_to_first_metric_s": [round(x, 3) for x in after_sbatch],
            "pause_to_gone_s": [round(x, 3) for x in gone],
        },
    }


if __name__ == "__main__":
    if os.geteuid() != 0:
        raise SystemExit("bench/slurm_pool.py needs root (a private slurmd runs jobs)")
    main()
