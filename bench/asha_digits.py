"""ASHA on a real wall clock, on a fair workload: adaptive ASHA against random search with the
same trials and slots, each with warm trial starts on and off.

The workload: examples/digits_pytorch (its model, data, train.py and adaptive.yaml's search
space, unchanged) searched for a model that reaches a HIGH validation accuracy (--target, default
0.975: at least 351 of the 359 held-out digits). The task is not made harder; the target is
raised, because the old target (0.96 after 600 batches) was reached early by almost any
configuration, so the order trials happened to start in decided the race, not the searcher. At
0.975 only the good corner of the space (large learning rate with enough momentum, a wide enough
layer) gets there, and only after 1,000 batches or more, so a search has to find and train a good
configuration: what a user searching hyperparameters is after. max_time is 2,000 batches (~90
passes over the 1,438 training digits; the good configurations are at their best between 1,000
and 2,000 batches; longer only makes the bench slower), 32 trials, 2 CPU slots. The fraction of
the 32 configurations that ever reach the target is measured, not assumed: every trial of the
random search trains all 2,000 batches, so `fraction_of_configs_reaching_target` is the share of
its trials whose best validation accuracy reaches the target (the issue asks for < 0.25). The
seed (--seed 1) is the one the earlier bench used; it was not chosen for this workload.

Why it is fair: both searches run the same 32 configurations (same reproducibility.
experiment_seed: both searchers draw trial k's hyperparameters and seed in creation order from
the same generator), the same entrypoint, the same validation period (train.py: every 100
batches), the same slots and the same engine; the only difference is the searcher. Nothing is
tuned for ASHA: adaptive_asha's defaults from adaptive.yaml (standard mode, divisor 4,
max_concurrent_trials 16, metric validation_loss, which ASHA ranks by; the target is on accuracy,
which it never sees), and the random search's max_concurrent_trials is the same 16.

The four arms, each one `det-local run` in embedded mode (what `det-local run config.yaml .`
does on a machine with nothing set up; the daemon runs the same engine), each on its own
throwaway DET_LOCAL_HOME with DET_LOCAL_CPU_SLOTS=2, configs written to a temp dir (examples/
is not changed), context examples/digits_pytorch itself:

* asha: adaptive.yaml's adaptive_asha, max_trials --max-trials, max_time --max-time;
* random: `name: random`, the same max_trials and max_concurrent_trials; each trial trains
  --max-time batches (train.py --batches), as ASHA's trials do when they are not stopped;
* asha_cold, random_cold: the same with DET_LOCAL_WARM_START=0 in environment_variables (every
  trial a fresh interpreter importing torch). The warm arms leave the switch unset: warm starts
  are on by default for searches.

Each trial runs with OMP_NUM_THREADS=1 (two torch processes on two cores with torch's default
two threads each run this small model ~2.5x slower than with one). A round runs the four arms
one after the other, the order reversed every other round (asha, random, asha_cold, random_cold;
then random_cold, asha_cold, random, asha); --rounds rounds (default 3); figures are medians of
the rounds (a run that never reaches the target counts as infinitely slow), with every run's
figure listed too.

Measured, all from each experiment's store (nothing parsed from the output):

* *_s_to_target: seconds from the experiment's creation to the first validation report with
  `accuracy` >= --target; null if never reached. asha_speedup = 1 - asha / random (warm);
  asha_cold_speedup the same with warm starts off; warm_start_speedup_asha /
  warm_start_speedup_random = 1 - warm / cold for each searcher.
* slot_utilization (ASHA, warm) and random_slot_utilization (and *_cold_*): busy slot-seconds /
  available slot-seconds: the sum over its trial jobs of (ended_at - started_at) (the scheduler
  books the slot at started_at and frees it when the process group is reaped, ended_at) over
  2 x (experiment end - creation).
* fraction_of_configs_reaching_target: median over the random runs of the share of trials whose
  best validation accuracy reaches the target; first_config_reaching_target: the creation index
  (1-based) of the first of them; best_accuracy of each arm.
* start_s_p50_warm / start_s_p50_cold: the daemon's own start measure (start of a run's process
  to its hello on the trial socket, `experiment describe`), p50 over the warm and cold arms.
* where the rest goes, per run: handoff_ms (p50/max of the time between a slot being freed and
  the next queued trial being given it), first_report_s (slot booked to the trial's first
  metric report), the idle tail (slot-seconds idle once no trial is left to start), trials
  stopped early, whole-search wall time.

Targets (issue 18): asha_speedup >= 0.25 (ASHA reaches the target at least 25% sooner than
random search); slot_utilization >= 0.9; fraction_of_configs_reaching_target < 0.25.

Usage: python bench/asha_digits.py [--target 0.975] [--max-trials 32] [--max-time 2000]
                                   [--seed 1] [--threads 1] [--rounds 3]
About 15-20 minutes with the defaults on the 2-core development machine (shared: its load moves
every figure; the comparisons are within a round, the figures medians). The last line printed
is one JSON object.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import det_local_cmd, env_with_home  # noqa: E402

EXAMPLE = HERE.parent / "examples" / "digits_pytorch"
SLOTS = 2
ARMS = ("asha", "random", "asha_cold", "random_cold")


@dataclass(frozen=True)
class Workload:
    target: float
    max_trials: int
    max_time: int
    seed: int
    threads: int


def configs(w: Workload) -> dict[str, dict[str, Any]]:
    """adaptive.yaml with the workload's length, trials and seed, its random-search twin, and
    both with warm starts off."""
    base = yaml.safe_load((EXAMPLE / "adaptive.yaml").read_text())
    base["entrypoint"] = f"python3 train.py --batches {w.max_time}"
    base["reproducibility"] = {"experiment_seed": w.seed}
    env = base.setdefault("environment", {}).setdefault("environment_variables", [])
    env.append(f"OMP_NUM_THREADS={w.threads}")
    asha = json.loads(json.dumps(base))
    asha["searcher"].update(max_trials=w.max_trials, max_time=w.max_time)
    rnd = json.loads(json.dumps(base))
    rnd["searcher"] = {
        "name": "random",
        "metric": base["searcher"]["metric"],
        "smaller_is_better": base["searcher"]["smaller_is_better"],
        "max_trials": w.max_trials,
        "max_concurrent_trials": asha["searcher"].get("max_concurrent_trials", 16),
    }
    out: dict[str, dict[str, Any]] = {}
    for kind, cfg in (("asha", asha), ("random", rnd)):
        for cold in (False, True):
            arm = f"{kind}_cold" if cold else kind
            c = json.loads(json.dumps(cfg))
            c["name"] = f"bench_{arm}"
            if cold:
                c["environment"]["environment_variables"].append("DET_LOCAL_WARM_START=0")
            out[arm] = c
    return out


def run_experiment(name: str, cfg: dict[str, Any], tmp: Path, w: Workload) -> dict[str, Any]:
    home = tmp / f"home-{name}"
    cfg_path = tmp / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = env_with_home(str(home))
    env["DET_LOCAL_CPU_SLOTS"] = str(SLOTS)
    env["DET_LOCAL_FAKE_GPUS"] = "0"
    env.pop("DET_LOCAL_WARM_STARTS", None)  # the daemon's default (on); arms switch per config
    started = time.time()
    with open(tmp / f"{name}.out", "wb") as out:
        proc = subprocess.run(
            [*det_local_cmd(), "run", "-q", str(cfg_path), str(EXAMPLE)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=1200,
        )
    wall = time.time() - started
    if proc.returncode != 0:
        tail = (tmp / f"{name}.out").read_text(errors="replace")[-2000:]
        raise SystemExit(f"det-local run ({name}) failed ({proc.returncode}): {tail}")
    return measure(home, wall, w)


def measure(home: Path, run_wall: float, w: Workload) -> dict[str, Any]:
    from det_local.store.db import Store

    store = Store(home / "det-local.db", readonly=True)
    try:
        exp = store.get_experiment(1)
        t0, t1 = exp.created_at, exp.ended_at or time.time()
        trials = sorted(store.list_trials(1), key=lambda t: t.id)
        jobs = [j for j in store.jobs.list(include_done=True) if j.experiment_id == 1]
        starts = store.list_trial_starts(1)
        firsts: dict[int, float] = {}
        best: dict[int, float] = {}
        hit: tuple[float, int, int] | None = None
        for t in trials:
            best[t.id] = 0.0
            for m in store.list_metrics(t.id):
                firsts[t.id] = min(firsts.get(t.id, m.time), m.time)
                if m.group != "validation":
                    continue
                acc = float(m.metrics.get("accuracy", 0.0))
                best[t.id] = max(best[t.id], acc)
                if acc >= w.target and (hit is None or m.time < hit[0]):
                    hit = (m.time, t.id, m.steps_completed)
        stopped_early = sum(1 for t in trials if t.steps_completed < w.max_time)
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
    reaching = [i + 1 for i, t in enumerate(trials) if best[t.id] >= w.target]
    return {
        "wall_s": round(t1 - t0, 2),
        "run_wall_s": round(run_wall, 2),
        "trials": len(trials),
        "stopped_early": stopped_early,
        "trained_batches": sum(t.steps_completed for t in trials),
        "s_to_target": None if hit is None else round(hit[0] - t0, 2),
        "target_trial": None if hit is None else hit[1],
        "target_batches": None if hit is None else hit[2],
        "best_accuracy": round(max(best.values(), default=0.0), 4),
        "configs_reaching_target": reaching,
        "fraction_reaching_target": round(len(reaching) / len(trials), 4) if trials else None,
        "slot_utilization": round(busy / available, 4),
        "busy_slot_s": round(busy, 2),
        "first_start_s": round(spans[0][0] - t0, 3),
        "after_last_end_s": round(t1 - max(ends), 3),
        "idle_tail_slot_s": round(tail_idle, 2),
        "handoff_ms_p50": round(statistics.median(handoffs), 1) if handoffs else None,
        "handoff_ms_max": round(max(handoffs), 1) if handoffs else None,
        "first_report_s_p50": round(statistics.median(first_report), 2) if first_report else None,
        "warm_starts": sum(1 for _, _, warm, _ in starts if warm),
        "cold_starts": sum(1 for _, _, warm, _ in starts if not warm),
        "start_s": [(bool(warm), round(s, 4)) for _, _, warm, s in starts],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--target", type=float, default=0.975, help="validation accuracy")
    parser.add_argument("--max-trials", type=int, default=32)
    parser.add_argument("--max-time", type=int, default=2000, help="batches (max_time)")
    parser.add_argument("--seed", type=int, default=1, help="reproducibility.experiment_seed")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per trial")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the 4 arms (medians)")
    parser.add_argument(
        "--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}"
    )
    args = parser.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise SystemExit(f"--arms: unknown arm(s) {unknown}; choose from {','.join(ARMS)}")
    w = Workload(args.target, args.max_trials, args.max_time, args.seed, args.threads)

    began = time.time()
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    with tempfile.TemporaryDirectory(prefix="det-local-bench-asha-") as tmp_name:
        tmp = Path(tmp_name)
        cfgs = configs(w)
        for i in range(args.rounds):  # alternate the order of the arms
            for arm in arms if i % 2 == 0 else arms[::-1]:
                result = run_experiment(f"{arm}-{i}", cfgs[arm], tmp, w)
                runs[arm].append(result)
                shown = {k: v for k, v in result.items() if k != "start_s"}
                print(f"round {i + 1} {arm}:", json.dumps(shown), flush=True)

    def median(arm: str, key: str) -> float | None:
        if arm not in runs:
            return None
        values = [r[key] for r in runs[arm]]
        med = statistics.median(math.inf if v is None else v for v in values)
        return None if med == math.inf else round(med, 3)

    def speedup(fast: str, slow: str) -> float | None:
        a, b = median(fast, "s_to_target"), median(slow, "s_to_target")
        if a is None or b is None:
            return None
        return round(1 - a / b, 3)

    def per_run(arm: str, key: str) -> list[Any]:
        return [r[key] for r in runs.get(arm, [])]

    def start_p50(warm: bool) -> float | None:
        values = [
            s for arm in runs for r in runs[arm] for is_warm, s in r["start_s"] if is_warm == warm
        ]
        return round(statistics.median(values), 4) if values else None

    randoms = [r for arm in ("random", "random_cold") for r in runs.get(arm, [])]
    fractions = [r["fraction_reaching_target"] for r in randoms]
    reaching = [r["configs_reaching_target"] for r in randoms]
    result: dict[str, Any] = {
        "asha_s_to_target": median("asha", "s_to_target"),
        "random_s_to_target": median("random", "s_to_target"),
        "asha_speedup": speedup("asha", "random"),
        "asha_cold_s_to_target": median("asha_cold", "s_to_target"),
        "random_cold_s_to_target": median("random_cold", "s_to_target"),
        "asha_cold_speedup": speedup("asha_cold", "random_cold"),
        "warm_start_speedup_asha": speedup("asha", "asha_cold"),
        "warm_start_speedup_random": speedup("random", "random_cold"),
        "slot_utilization": median("asha", "slot_utilization"),
        "random_slot_utilization": median("random", "slot_utilization"),
        "asha_cold_slot_utilization": median("asha_cold", "slot_utilization"),
        "random_cold_slot_utilization": median("random_cold", "slot_utilization"),
        "fraction_of_configs_reaching_target": (
            round(statistics.median(fractions), 4) if fractions else None
        ),
        "first_config_reaching_target": (
            statistics.median(r[0] for r in reaching if r) if any(reaching) else None
        ),
        "start_s_p50_warm": start_p50(True),
        "start_s_p50_cold": start_p50(False),
        **{f"{arm}_wall_s": median(arm, "wall_s") for arm in arms},
        **{f"{arm}_s_to_target_runs": per_run(arm, "s_to_target") for arm in arms},
        **{f"{arm}_slot_utilization_runs": per_run(arm, "slot_utilization") for arm in arms},
        **{f"{arm}_best_accuracy_runs": per_run(arm, "best_accuracy") for arm in arms},
        "fraction_reaching_target_runs": fractions,
        "configs_reaching_target_runs": reaching,
        "rounds": args.rounds,
        "arms": arms,
        "target_accuracy": w.target,
        "max_trials": w.max_trials,
        "max_time_batches": w.max_time,
        "seed": w.seed,
        "slots": SLOTS,
        "bench_s": round(time.time() - began, 1),
    }
    a = result["asha_speedup"]
    u = result["slot_utilization"]
    f = result["fraction_of_configs_reaching_target"]
    result["speedup_ok"] = a is not None and a >= 0.25
    result["utilization_ok"] = u is not None and u >= 0.9
    result["workload_fair"] = f is not None and f < 0.25
    print(json.dumps(result))


if __name__ == "__main__":
    main()
