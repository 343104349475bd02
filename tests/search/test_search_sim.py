"""Whole searches played on a simulated clock (det_local.search.simulate) with a fake
objective: invariants every searcher must keep, with and without trial faults, and a searcher
rebuilt from its snapshot after every event must act exactly as one that never was."""

from __future__ import annotations

import json
import math
import random

import pytest

from det_local.search import brackets, make_searcher
from det_local.search.actions import Close, Create, Shutdown, Stop, ValidateAfter
from det_local.search.asha import initial_trial_count
from det_local.search.simulate import ENDED, Simulation
from tests.support.searchkit import config

HPS = {
    "lr": {"type": "log", "minval": -4, "maxval": -1, "base": 10, "count": 2},
    "width": {"type": "int", "minval": 1, "maxval": 4, "count": 4},
    "opt": {"type": "categorical", "vals": ["sgd", "adam"]},
    "global_batch_size": 16,
}

SEARCHERS = {
    "single": {"name": "single"},
    "random": {"name": "random", "max_trials": 12, "max_concurrent_trials": 3},
    "random-ops": {
        "name": "random",
        "max_trials": 6,
        "max_concurrent_trials": 0,
        "max_length": {"batches": 40},
    },
    "grid": {"name": "grid", "max_concurrent_trials": 3},
    "asha-0.38": {
        "name": "async_halving",
        "num_rungs": 3,
        "max_trials": 20,
        "divisor": 3,
        "max_concurrent_trials": 4,
        "time_metric": "batches",
        "max_time": 90,
    },
    "adaptive-0.38": {
        "name": "adaptive_asha",
        "max_trials": 30,
        "time_metric": "batches",
        "max_time": 64,
        "max_concurrent_trials": 5,
    },
    "adaptive-0.38-mct0": {
        "name": "adaptive_asha",
        "max_trials": 16,
        "time_metric": "batches",
        "max_time": 64,
        "max_concurrent_trials": 0,
        "mode": "conservative",
        "divisor": 2,
    },
    "asha-promotion": {
        "name": "async_halving",
        "num_rungs": 3,
        "max_trials": 20,
        "divisor": 3,
        "max_concurrent_trials": 4,
        "max_length": {"batches": 90},
    },
    "adaptive-promotion": {
        "name": "adaptive_asha",
        "max_trials": 30,
        "max_length": {"batches": 64},
        "max_concurrent_trials": 6,
    },
    "adaptive-stop-once": {
        "name": "adaptive_asha",
        "max_trials": 30,
        "stop_once": True,
        "max_length": {"batches": 64},
        "max_concurrent_trials": 6,
    },
}


def objective(trial, units: int) -> float:
    lr = trial.hparams["lr"]
    noise = random.Random(f"{trial.seed}:{units}").gauss(0, 0.01)
    return abs(math.log10(lr) + 2.5) + 1.0 / (1 + units) + 0.1 * trial.hparams["width"] + noise


def faults(kind: str):
    def fault(trial):
        r = random.Random(trial.seed).random()
        if kind == "none":
            return None
        if r < 0.1:
            return ("INVALID_HP", 0)
        if r < 0.2:
            return ("ERRORED", 3)
        if r < 0.25:
            return ("USER_CANCELED", 5)
        return None

    return fault


def play(name: str, seed: int, workers: int, fault: str, reload: bool):
    cfg = config(SEARCHERS[name], HPS, seed=seed)

    def rebuild(data):
        s = make_searcher(cfg)
        s.restore(data)
        return s

    sim = Simulation(
        make_searcher(cfg),
        objective,
        workers=workers,
        max_units=100,
        report_every=7,
        stop_delay=0.5,
        fault=faults(fault),
        reload=rebuild if reload else None,
    )
    return cfg, sim.run()


def concurrency_bound(cfg) -> int:
    s = cfg.searcher
    if s.name == "single":
        return 1
    if s.name == "random":
        return s.max_trials if s.max_concurrent_trials == 0 else s.max_concurrent_trials
    if s.name == "grid":
        return s.max_concurrent_trials
    divisor = float(s.divisor)
    return sum(
        initial_trial_count(b.max_concurrent_trials, b.max_trials, divisor, b.num_rungs)
        for b in brackets(cfg)
    )


@pytest.mark.parametrize("fault", ["none", "faults"])
@pytest.mark.parametrize("name", list(SEARCHERS))
def test_invariants(name: str, fault: str) -> None:
    for seed in (1, 2, 3):
        for workers in (1, 3, 8):
            cfg, res = play(name, seed, workers, fault, reload=False)
            s = cfg.searcher
            invalid = sum(1 for t in res.trials if t.ended_by == "INVALID_HP")
            created = len(res.trials)
            if s.name == "grid":
                assert created == 2 * 4 * 2  # lr x width x opt
            elif s.name == "single":
                assert created == 1
            else:
                assert created <= s.max_trials + invalid, (name, seed, workers)
                if fault == "none":
                    assert created == s.max_trials
            # concurrency: trials with work to do never exceed the searcher's fan-out
            assert res.max_active <= concurrency_bound(cfg), (name, seed, workers)
            assert res.max_running <= workers
            # every trial ended: closed or stopped by the searcher, or ended on its own
            assert all(t.state == ENDED for t in res.trials), (name, seed, workers)
            closed = {a.request_id for a in res.actions if isinstance(a, (Close, Stop))}
            for t in res.trials:
                assert (
                    t.request_id in closed
                    or t.ended_by != "exit"
                    or (not t.had_ops and t.units >= 100)
                ), (name, t)
            # exactly one Shutdown, and it is the last action
            assert len(res.shutdowns) == 1 and isinstance(res.actions[-1], Shutdown)
            assert not res.ops_out_of_order
            assert not res.ops_after_end


@pytest.mark.parametrize("name", list(SEARCHERS))
def test_restored_at_every_event_acts_identically(name: str) -> None:
    for seed, workers in ((4, 3), (5, 1)):
        _, plain = play(name, seed, workers, "faults", reload=False)
        _, restored = play(name, seed, workers, "faults", reload=True)
        assert restored.actions == plain.actions
        assert [t.reports for t in restored.trials] == [t.reports for t in plain.trials]


def test_stopping_asha_uses_less_budget_than_training_everything() -> None:
    _, res = play("asha-0.38", 1, 4, "none", reload=False)
    assert res.units_trained < 20 * 90 / 2
    best = min(res.trials, key=lambda t: min(v for _, v in t.reports))
    assert best.units >= 90  # the best trial reached the top rung


def test_snapshot_is_json() -> None:
    cfg = config(SEARCHERS["adaptive-promotion"], HPS, seed=3)
    s = make_searcher(cfg)
    sim = Simulation(s, objective, workers=2, max_units=100)
    sim.run()
    text = json.dumps(s.snapshot())
    assert json.loads(text)["state"]["shutdown"] is True
    assert all(isinstance(a, (Create, ValidateAfter, Close, Stop, Shutdown)) for a in sim.actions)


@pytest.mark.parametrize("name", ["asha-promotion", "adaptive-promotion"])
def test_promotion_without_an_engine_that_pauses_still_finishes(name: str) -> None:
    # An engine that ends a trial when it runs out of operations (instead of keeping it
    # waiting for promotion) gets a complete search: such trials rank as exited early.
    cfg = config(SEARCHERS[name], HPS, seed=9)
    res = Simulation(
        make_searcher(cfg), objective, workers=3, max_units=100, engine_pauses=False
    ).run()
    assert len(res.shutdowns) == 1 and isinstance(res.actions[-1], Shutdown)
    assert all(t.state == ENDED for t in res.trials)
    assert not res.ops_after_end
