"""ASHA on a real wall clock: examples/digits_pytorch's adaptive.yaml on 2 CPU slots, against
plain random search over the same space with the same number of trials.

Both experiments run through `det-local run` in embedded mode (no daemon: what `det-local run
config.yaml .` does on a machine with nothing set up; the daemon runs the same engine), one after
the other, each on its own throwaway DET_LOCAL_HOME with DET_LOCAL_CPU_SLOTS=2. The configs are
copies of adaptive.yaml written to a temp dir (examples/ is not changed); the context is
examples/digits_pytorch itself. The two differ only in the searcher:

* ASHA: adaptive.yaml's adaptive_asha (standard mode, divisor 4, max_concurrent_trials 16,
  time_metric batches, max_time = --max-time);
* random: `name: random` with the same max_trials and max_concurrent_trials; every trial trains
  --max-time batches (train.py --batches), as ASHA's trials do when they are not stopped.

Same hyperparameter space, same reproducibility.experiment_seed (so trial k gets the same
hyperparameters and seed in both: both searchers draw them in creation order from the same
generator), same entrypoint, validation every 100 batches (train.py). Each trial runs with
OMP_NUM_THREADS=1 (environment_variables, in both configs): two torch processes on two cores
with torch's default two threads each run this small model ~2.5x slower than with one.

Measured, all from each experiment's store (nothing parsed from the output):

* asha_s_to_target / random_s_to_target: seconds from the experiment's creation to the first
  validation report with `accuracy` >= --target (default 0.96, validation accuracy on the 359
  held-out digits; the best trials of both searches end near 0.97). null if never reached.
* slot_utilization: busy slot-seconds / available slot-seconds of the ASHA experiment: the sum
  over its trial jobs of (ended_at - started_at) (the scheduler books the slot at started_at and
  frees it when the process group is reaped, ended_at) over 2 x (experiment end - creation).
  random_slot_utilization is the same for the random search.
* where the rest went: handoff_ms (p50/max of the time between a slot being freed and the next
  queued trial being given it), first_report_s (slot booked to the trial's first metric
  report: process start, Python, torch, the data and its first batches; busy time, counted as
  such), the idle tail (slot-seconds idle once no trial is left to start), and the time before
  the first trial starts and after the last one ends.

Each search runs --runs times (default 3, alternating which goes first, each on a fresh home);
the figures are medians (a run that never reaches the target counts as infinitely slow), with
every run's time to target listed too. One run is not enough: with max_time 600 a trial trains
for well under a second and spends ~3 s starting (Python, torch, the data), so one search's lead
over the other is of the same size as the run-to-run swing on a shared machine.

Targets: ASHA reaches the target accuracy sooner (median asha_s_to_target <
random_s_to_target); slot_utilization >= 0.9.

Usage: python bench/asha_digits.py [--target 0.96] [--max-trials 16] [--max-time 600]
                                   [--seed 1] [--threads 1] [--runs 3]
About 4-5 minutes with the defaults on the 2-core development machine (each search ~35-50 s).
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import det_local_cmd, env_with_home  # noqa: E402

EXAMPLE = HERE.parent / "examples" / "digits_pytorch"
SLOTS = 2


def configs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """adaptive.yaml, scaled, and its random-search twin."""
    base = yaml.safe_load((EXAMPLE / "adaptive.yaml").read_text())
    base["entrypoint"] = f"python3 train.py --batches {args.max_time}"
    base["reproducibility"] = {"experiment_seed": args.seed}
    env = base.setdefault("environment", {}).setdefault("environment_variables", [])
    env.append(f"OMP_NUM_THREADS={args.threads}")
    asha = json.loads(json.dumps(base))
    asha["name"] = "bench_asha"
    asha["searcher"].update(max_trials=args.max_trials, max_time=args.max_time)
    rnd = json.loads(json.dumps(base))
    rnd["name"] = "bench_random"
    rnd["searcher"] = {
        "name": "random",
        "metric": base["searcher"]["metric"],
        "smaller_is_better": base["searcher"]["smaller_is_better"],
        "max_trials": args.max_trials,
        "max_concurrent_trials": asha["searcher"].get("max_concurrent_trials", 16),
    }
    return {"asha": asha, "random": rnd}


def run_experiment(name: str, cfg: dict[str, Any], tmp: Path) -> dict[str, Any]:
    home = tmp / f"home-{name}"
    cfg_path = tmp / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = env_with_home(str(home))
    env["DET_LOCAL_CPU_SLOTS"] = str(SLOTS)
    env["DET_LOCAL_FAKE_GPUS"] = "0"
    started = time.time()
    with open(tmp / f"{name}.out", "wb") as out:
        proc = subprocess.run(
            [*det_local_cmd(), "run", "-q", str(cfg_path), str(EXAMPLE)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=900,
        )
    wall = time.time() - started
    if proc.returncode != 0:
        tail = (tmp / f"{name}.out").read_text(errors="replace")[-2000:]
        raise SystemExit(f"det-local run ({name}) failed ({proc.returncode}): {tail}")
    return measure(home, wall)


def measure(home: Path, run_wall: float) -> dict[str, Any]:
    from det_local.store.db import Store

    store = Store(home / "det-local.db", readonly=True)
    try:
        exp = store.get_experiment(1)
        t0, t1 = exp.created_at, exp.ended_at or time.time()
        trials = store.list_trials(1)
        jobs = [j for j in store.jobs.list(include_done=True) if j.experiment_id == 1]
        firsts: dict[int, float] = {}
        best_acc = 0.0
        hit: tuple[float, int, int] | None = None
        for t in trials:
            for m in store.list_metrics(t.id):
                firsts[t.id] = min(firsts.get(t.id, m.time), m.time)
                if m.group != "validation":
                    continue
                acc = float(m.metrics.get("accuracy", 0.0))
                best_acc = max(best_acc, acc)
                if acc >= TARGET and (hit is None or m.time < hit[0]):
                    hit = (m.time, t.id, m.steps_completed)
        stopped_early = sum(1 for t in trials if t.steps_completed < MAX_TIME)
    finally:
        store.close()
    spans = sorted((j.started_at, j.ended_at, j) for j in jobs if j.started_at and j.ended_at)
    busy = sum(end - start for start, end, _ in spans)
    available = SLOTS * (t1 - t0)
    # handoffs: a trial given a slot that another trial's end had just freed
    ends = sorted(end for _, end, _ in spans)
    handoffs = []
    for start, _, _ in spans:
        before = [e for e in ends if e <= start]
        if before and start - before[-1] < 1.0:
            handoffs.append((start - before[-1]) * 1000)
    # slot booked -> the trial's first report: process start, Python, torch, the data, and
    # its first training batches (busy time: counted as such above)
    first_report = [firsts[j.trial_id] - j.started_at for _, _, j in spans if j.trial_id in firsts]
    # idle slot-seconds once no trial is left to start: from the last start to the end
    last_start = spans[-1][0]
    tail_busy = sum(max(0.0, min(end, t1) - max(start, last_start)) for start, end, _ in spans)
    tail_idle = SLOTS * (t1 - last_start) - tail_busy
    return {
        "wall_s": round(t1 - t0, 2),
        "run_wall_s": round(run_wall, 2),
        "trials": len(trials),
        "stopped_early": stopped_early,
        "s_to_target": None if hit is None else round(hit[0] - t0, 2),
        "target_trial": None if hit is None else hit[1],
        "target_batches": None if hit is None else hit[2],
        "best_accuracy": round(best_acc, 4),
        "slot_utilization": round(busy / available, 4),
        "busy_slot_s": round(busy, 2),
        "first_start_s": round(spans[0][0] - t0, 3),
        "after_last_end_s": round(t1 - max(ends), 3),
        "idle_tail_slot_s": round(tail_idle, 2),
        "handoff_ms_p50": round(statistics.median(handoffs), 1) if handoffs else None,
        "handoff_ms_max": round(max(handoffs), 1) if handoffs else None,
        "first_report_s_p50": round(statistics.median(first_report), 2) if first_report else None,
    }


TARGET = 0.96
MAX_TIME = 600


def main() -> None:
    global TARGET, MAX_TIME
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=float, default=0.96, help="validation accuracy")
    parser.add_argument("--max-trials", type=int, default=16)
    parser.add_argument("--max-time", type=int, default=600, help="batches (max_time)")
    parser.add_argument("--seed", type=int, default=1, help="reproducibility.experiment_seed")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per trial")
    parser.add_argument("--runs", type=int, default=3, help="runs of each search (medians)")
    args = parser.parse_args()
    TARGET, MAX_TIME = args.target, args.max_time

    runs: dict[str, list[dict[str, Any]]] = {"asha": [], "random": []}
    with tempfile.TemporaryDirectory(prefix="det-local-bench-asha-") as tmp_name:
        tmp = Path(tmp_name)
        cfgs = configs(args)
        for i in range(args.runs):  # alternate which goes first
            for kind in ("asha", "random") if i % 2 == 0 else ("random", "asha"):
                runs[kind].append(run_experiment(f"{kind}-{i}", cfgs[kind], tmp))
                print(f"run {i + 1} {kind}:", json.dumps(runs[kind][-1]), flush=True)

    def median(kind: str, key: str) -> float | None:
        values = [r[key] for r in runs[kind]]
        med = statistics.median(math.inf if v is None else v for v in values)
        return None if med == math.inf else round(med, 3)

    a, r = median("asha", "s_to_target"), median("random", "s_to_target")
    utilization = median("asha", "slot_utilization")
    result = {
        "asha_s_to_target": a,
        "random_s_to_target": r,
        "slot_utilization": utilization,
        "random_slot_utilization": median("random", "slot_utilization"),
        "asha_wall_s": median("asha", "wall_s"),
        "random_wall_s": median("random", "wall_s"),
        "asha_s_to_target_runs": [x["s_to_target"] for x in runs["asha"]],
        "random_s_to_target_runs": [x["s_to_target"] for x in runs["random"]],
        "asha_sooner_runs": sum(
            x["s_to_target"] is not None
            and (y["s_to_target"] is None or x["s_to_target"] < y["s_to_target"])
            for x, y in zip(runs["asha"], runs["random"], strict=True)
        ),
        "runs": args.runs,
        "target_accuracy": args.target,
        "max_trials": args.max_trials,
        "max_time_batches": args.max_time,
        "seed": args.seed,
        "asha_sooner": a is not None and (r is None or a < r),
        "utilization_ok": utilization is not None and utilization >= 0.9,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
