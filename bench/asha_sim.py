"""ASHA on a simulated clock: det-local's adaptive_asha against Ray Tune's ASHAScheduler and
Optuna's SuccessiveHalvingPruner, each driven directly, on one synthetic problem.

The problem (bench/_asha_problem.py): Hartmann-6 with a bias that vanishes at full fidelity,
256 random configs per seed, eta=4, r=1, R=64 (rungs 1, 4, 16, 64), 4 simulated workers, one
time unit per training unit, a report after every unit. Every system sees the same config list
in the same order and gets the same training budget (one synchronous successive-halving
bracket's worth, 1024 units); its regret is the true value of its incumbent (best metric at the
highest rung reached) minus the known optimum. 30 seeds; the medians are reported.
det_local_regret is adaptive_asha with mode aggressive, the one-bracket search that Ray's and
Optuna's schedulers run by default; det_local_regret_standard is its default mode.

det-local runs in this interpreter (det_local.search.simulate, the engine in miniature). Ray and
Optuna are installed by this script into a throwaway virtual environment
(~/.cache/det-local-bench/venv-asha, or $DET_LOCAL_BENCH_VENV) and run there as a subprocess;
if that fails their keys are null and the error is in the JSON. Nothing large is written
anywhere else.

Decision latency: one adaptive_asha search of 10,000 trials played to the end; the median (and
p99) time of Searcher.on_validation over every report.

Usage: python bench/asha_sim.py [--seeds 30] [--no-peers]
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _asha_problem as prob  # noqa: E402

VENV = Path(
    os.environ.get("DET_LOCAL_BENCH_VENV", Path.home() / ".cache" / "det-local-bench" / "venv-asha")
)
PEER_PACKAGES = ["ray[tune]", "optuna"]


# ---------------------------------------------------------------------- det-local
def det_local_config(max_trials: int, mode: str = "standard") -> dict:
    return {
        "name": "asha-sim",
        "entrypoint": "python3 train.py",
        "searcher": {
            "name": "adaptive_asha",
            "metric": "loss",
            "max_trials": max_trials,
            "divisor": prob.ETA,
            "time_metric": "units",
            "max_time": prob.R_MAX,
            "max_concurrent_trials": prob.WORKERS,
            "mode": mode,
        },
        "hyperparameters": {},
        "reproducibility": {"experiment_seed": 1},
    }


def det_local_searcher(xs: list, raw: dict):
    """adaptive_asha exactly as make_searcher builds it, sampling the shared config list in
    order instead of the config's hyperparameters."""
    from det_local.config import parse_config
    from det_local.search import make_method
    from det_local.search.base import Searcher

    cfg = parse_config(raw, source="bench")
    method, kind = make_method(cfg)
    taken = iter(range(len(xs)))

    def sample(rng):
        return {"config": next(taken)}

    return Searcher(method, sample, 1, kind=kind)


def det_local_regret(seed: int, mode: str = "aggressive") -> float:
    from det_local.search.simulate import Simulation

    xs = prob.configs(seed)
    s = det_local_searcher(xs, det_local_config(prob.N_CONFIGS, mode))
    sim = Simulation(
        s,
        lambda t, r: prob.objective(xs[t.hparams["config"]], r),
        workers=prob.WORKERS,
        max_units=prob.R_MAX,
        metric="loss",
        time_metric="units",
        report_every=1,
        budget=prob.BUDGET,
    )
    res = sim.run()
    reports = {t.hparams["config"]: t.reports for t in res.trials if t.reports}
    return prob.regret(xs, reports)


def decision_latency(n_trials: int = 10_000) -> dict:
    """Median and p99 microseconds per Searcher.on_validation in an n-trial search, and the
    cost of one snapshot of the final state."""
    import random

    from det_local.search.simulate import Simulation

    s = det_local_searcher([None] * n_trials, det_local_config(n_trials))
    times: list[int] = []
    inner = s.on_validation

    def timed(request_id, metrics):
        t0 = time.perf_counter_ns()
        out = inner(request_id, metrics)
        times.append(time.perf_counter_ns() - t0)
        return out

    s.on_validation = timed  # type: ignore[method-assign]
    rng = random.Random(0)
    quality = [rng.random() for _ in range(n_trials)]
    Simulation(
        s,
        lambda t, r: quality[t.index] + 1.0 / r,
        workers=64,
        max_units=prob.R_MAX,
        metric="loss",
        time_metric="units",
        report_every=4,
    ).run()
    times.sort()
    t0 = time.perf_counter()
    text = json.dumps(s.snapshot())
    snap_ms = (time.perf_counter() - t0) * 1000
    return {
        "decisions": len(times),
        "median_us": round(times[len(times) // 2] / 1000, 2),
        "p99_us": round(times[int(len(times) * 0.99)] / 1000, 2),
        "snapshot_ms": round(snap_ms, 2),
        "snapshot_kib": round(len(text) / 1024, 1),
    }


# ---------------------------------------------------------------------- peers (in their venv)
class _Trial:
    __slots__ = ("trial_id",)

    def __init__(self, trial_id: str) -> None:
        self.trial_id = trial_id


def ray_regret(seed: int) -> float:
    import numpy as np
    from ray.tune.schedulers import ASHAScheduler, TrialScheduler

    np.random.seed(seed)
    xs = prob.configs(seed)
    sched = ASHAScheduler(
        time_attr="training_iteration",
        metric="loss",
        mode="min",
        max_t=prob.R_MAX,
        grace_period=prob.R_MIN,
        reduction_factor=prob.ETA,
        brackets=1,
    )
    trials: dict[int, _Trial] = {}

    def start(i: int) -> None:
        trials[i] = _Trial(str(i))
        sched.on_trial_add(None, trials[i])

    def report(i: int, r: int, value: float) -> bool:
        result = {"training_iteration": r, "loss": value}
        return sched.on_trial_result(None, trials[i], result) == TrialScheduler.CONTINUE

    def end(i: int, r: int, value: float, reached: bool) -> None:
        # Tune calls on_trial_complete for trials the scheduler stopped and for finished ones
        sched.on_trial_complete(None, trials[i], {"training_iteration": r, "loss": value})

    return prob.regret(xs, prob.simulate(xs, start, report, end))


def optuna_regret(seed: int) -> float:
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    xs = prob.configs(seed)
    study = optuna.create_study(
        direction="minimize",
        sampler=optuna.samplers.RandomSampler(seed=seed),
        pruner=optuna.pruners.SuccessiveHalvingPruner(
            min_resource=prob.R_MIN, reduction_factor=prob.ETA, min_early_stopping_rate=0
        ),
    )
    trials: dict[int, object] = {}

    def start(i: int) -> None:
        trials[i] = study.ask()

    def report(i: int, r: int, value: float) -> bool:
        t = trials[i]
        t.report(value, r)  # type: ignore[attr-defined]
        return not t.should_prune()  # type: ignore[attr-defined]

    def end(i: int, r: int, value: float, reached: bool) -> None:
        if reached:
            study.tell(trials[i], value)  # type: ignore[arg-type]
        else:
            study.tell(trials[i], state=TrialState.PRUNED)  # type: ignore[arg-type]

    return prob.regret(xs, prob.simulate(xs, start, report, end))


def peer_main(peer: str, seeds: int) -> None:
    fn = {"ray": ray_regret, "optuna": optuna_regret}[peer]
    version = __import__("ray" if peer == "ray" else "optuna").__version__
    print(json.dumps({"version": version, "regrets": [fn(seed) for seed in range(seeds)]}))


def ensure_venv() -> Path:
    """The peers' virtual environment, created and filled on first use."""
    py = VENV / "bin" / "python"
    check = [str(py), "-c", "import ray.tune, optuna"]
    if py.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return py
    VENV.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, capture_output=True)
    proc = subprocess.run(
        [str(py), "-m", "pip", "install", "--no-cache-dir", "-q", *PEER_PACKAGES],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"pip install {' '.join(PEER_PACKAGES)} failed: {proc.stderr[-800:]}")
    return py


def run_peer(py: Path, peer: str, seeds: int) -> dict:
    proc = subprocess.run(
        [str(py), str(Path(__file__).resolve()), "--peer", peer, "--seeds", str(seeds)],
        capture_output=True,
        text=True,
        env={**os.environ, "RAY_DEDUP_LOGS": "0", "PYTHONWARNINGS": "ignore"},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{peer} driver failed: {proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--peer", choices=["ray", "optuna"])
    ap.add_argument("--no-peers", action="store_true")
    args = ap.parse_args()
    if args.peer:
        peer_main(args.peer, args.seeds)
        return

    out: dict = {
        "problem": "hartmann6, bias vanishing at full fidelity",
        "configs": prob.N_CONFIGS,
        "eta": prob.ETA,
        "r": prob.R_MIN,
        "R": prob.R_MAX,
        "workers": prob.WORKERS,
        "seeds": args.seeds,
        "budget_units": prob.BUDGET,
    }
    t0 = time.perf_counter()
    # Ray's ASHAScheduler (brackets=1) and Optuna's SuccessiveHalvingPruner run one bracket:
    # the like-for-like det-local search is adaptive_asha in mode aggressive (one bracket).
    # Its default mode, standard, adds two less aggressive brackets that need about twice
    # this budget to finish; its figure is reported beside it.
    det = [det_local_regret(seed, "aggressive") for seed in range(args.seeds)]
    det_std = [det_local_regret(seed, "standard") for seed in range(args.seeds)]
    out["det_local_mode"] = "aggressive"
    out["det_local_regret"] = median(det)
    out["det_local_regret_standard"] = median(det_std)
    out["oracle_regret"] = median(
        [min(prob.hartmann6(x) for x in prob.configs(s)) - prob.H6_MIN for s in range(args.seeds)]
    )
    print(f"det-local adaptive_asha (aggressive): median regret {out['det_local_regret']}")
    print(f"det-local adaptive_asha (standard): median regret {out['det_local_regret_standard']}")
    print(f"best config of each list (oracle): median regret {out['oracle_regret']}")
    out["det_local_seconds"] = round(time.perf_counter() - t0, 2)

    out["ray_regret"] = out["optuna_regret"] = None
    if not args.no_peers:
        try:
            py = ensure_venv()
            for peer in ("ray", "optuna"):
                try:
                    got = run_peer(py, peer, args.seeds)
                    out[f"{peer}_regret"] = median(got["regrets"])
                    out[f"{peer}_version"] = got["version"]
                    print(f"{peer} {got['version']}: median regret {out[f'{peer}_regret']}")
                except Exception as err:  # a peer that fails is reported, not fatal
                    out[f"{peer}_error"] = str(err)
        except Exception as err:
            out["peers_error"] = str(err)

    lat = decision_latency()
    out["det_local_decision_us_10000"] = lat["median_us"]
    out["det_local_decision_p99_us_10000"] = lat["p99_us"]
    out["det_local_decisions_10000"] = lat["decisions"]
    out["det_local_snapshot_ms_10000"] = lat["snapshot_ms"]
    out["det_local_snapshot_kib_10000"] = lat["snapshot_kib"]
    print(f"decision latency, 10,000 trials: median {lat['median_us']} us, p99 {lat['p99_us']} us")

    peers = [v for v in (out["ray_regret"], out["optuna_regret"]) if v is not None]
    out["target_regret"] = round(min(peers) * 1.05, 4) if peers else None
    out["regret_ok"] = None if not peers else out["det_local_regret"] <= out["target_regret"]
    out["decision_ok"] = out["det_local_decision_us_10000"] <= 100
    print(json.dumps(out))


if __name__ == "__main__":
    main()
