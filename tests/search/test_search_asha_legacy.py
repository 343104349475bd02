"""<=0.37 operation-driven ASHA: promotion-based and stop_once, alone and in adaptive brackets
(asha_test.go, asha_stopping_test.go, adaptive_asha_test.go at 0.37.0), re-derived."""

from __future__ import annotations

from collections import Counter

import pytest

from det_local.search.actions import Close, ValidateAfter
from det_local.search.asha_legacy import AshaPromotion, AshaStopOnce
from det_local.search.simulate import Simulation
from tests.support.searchkit import config, constant, creates, early, searcher, value_simulation


def halving(stop_once: bool, smaller_is_better: bool = True, **extra):
    return config(
        {
            "name": "async_halving",
            "num_rungs": 3,
            "max_length": {"batches": 9000},
            "max_trials": 12,
            "divisor": 3,
            "stop_once": stop_once,
            "smaller_is_better": smaller_is_better,
            **extra,
        }
    )


def adaptive(stop_once: bool, smaller_is_better: bool = True):
    return config(
        {
            "name": "adaptive_asha",
            "max_length": {"batches": 900},
            "max_trials": 5,
            "mode": "standard",
            "max_rungs": 2,
            "divisor": 3,
            "stop_once": stop_once,
            "smaller_is_better": smaller_is_better,
        }
    )


B = "1000 3000 9000"
B2 = "1000 3000"
B1 = "1000"

PROMOTION_CASES = {
    "smaller is better": (
        True,
        [constant(B, 0.01)]
        + [constant(B2, m) for m in (0.02, 0.03, 0.04)]
        + [constant(B1, m / 100) for m in range(5, 13)],
    ),
    "early exit -- smaller is better": (
        True,
        [constant(B, 0.01), constant(B2, 0.02), early(B2, 0.03), constant(B2, 0.04)]
        + [constant(B1, m / 100) for m in range(5, 13)],
    ),
    "smaller is not better": (
        False,
        [constant(B, 0.12)]
        + [constant(B2, m) for m in (0.11, 0.10, 0.09)]
        + [constant(B1, m / 100) for m in range(8, 0, -1)],
    ),
    "early exit -- smaller is not better": (
        False,
        [constant(B, 0.12), constant(B2, 0.11), early(B2, 0.10), constant(B2, 0.09)]
        + [constant(B1, m / 100) for m in range(8, 0, -1)],
    ),
    "async promotions": (
        True,
        # the first trial is promoted by asynchronous promotion although it ends up outside
        # the top third of the base rung
        [constant(B2, 0.10), constant(B1, 0.11), early(B1, 0.12), constant(B, 0.01)]
        + [constant(B2, m) for m in (0.02, 0.03, 0.04)]
        + [constant(B1, m / 100) for m in range(5, 10)],
    ),
}


@pytest.mark.parametrize("name", list(PROMOTION_CASES))
def test_promotion_asha(name: str) -> None:  # TestASHASearchMethod
    smaller, trials = PROMOTION_CASES[name]
    s = value_simulation(halving(False, smaller), trials)
    assert isinstance(s.method, AshaPromotion)


def test_promotion_single_rung_bracket() -> None:
    cfg = config(
        {
            "name": "async_halving",
            "num_rungs": 1,
            "max_length": {"batches": 9000},
            "max_trials": 4,
            "divisor": 3,
        }
    )
    value_simulation(cfg, [constant("9000", m) for m in (0.05, 0.06, 0.07, 0.08)])


def _small(max_trials: int):
    """A 2-rung async_halving search of 8 batches, divisor 2, 2 trials at a time."""
    return searcher(
        {
            "name": "async_halving",
            "num_rungs": 2,
            "max_length": {"batches": 8},
            "max_trials": max_trials,
            "divisor": 2,
            "max_concurrent_trials": 2,
        }
    )


def _rr(pattern: list[tuple[str, float]], times: int = 3):
    return [constant(ops, m) for _ in range(times) for ops, m in pattern]


STOP_ONCE_CASES = {
    "smaller is better": (
        True,
        [constant(B, 0.01)] + [constant(B1, m / 100) for m in range(2, 13)],
    ),
    "smaller is better (round robin)": (
        True,
        _rr([(B, 0.01), (B1, 0.02), (B1, 0.03), (B1, 0.04)]),
    ),
    "smaller is not better": (
        False,
        [constant(B, m / 100) for m in range(1, 13)],
    ),
    "smaller is not better (round robin)": (
        False,
        [constant(B, m) for m in (0.01, 0.02, 0.03, 0.04)]
        + _rr([(B1, 0.01), (B1, 0.02), (B2, 0.03), (B, 0.04)], times=2),
    ),
    "early exit -- smaller is better (round robin)": (
        True,
        [
            constant(B, 0.01),
            constant(B1, 0.02),
            constant(B1, 0.03),
            constant(B1, 0.04),
            early(B2, 0.01),
            constant(B1, 0.02),
            constant(B1, 0.03),
            constant(B1, 0.04),
            constant(B, 0.01),
            constant(B1, 0.02),
            constant(B1, 0.03),
            constant(B1, 0.04),
        ],
    ),
    "early exit -- smaller is not better (round robin)": (
        False,
        [
            constant(B, 0.01),
            constant(B, 0.02),
            constant(B, 0.03),
            early(B2, 0.04),
            constant(B1, 0.01),
            constant(B1, 0.02),
            constant(B, 0.03),
            constant(B, 0.04),
            constant(B1, 0.01),
            constant(B1, 0.02),
            constant(B, 0.03),
            constant(B, 0.04),
        ],
    ),
}


@pytest.mark.parametrize("name", list(STOP_ONCE_CASES))
def test_stop_once_asha(name: str) -> None:  # TestASHAStoppingSearchMethod (0.37)
    smaller, trials = STOP_ONCE_CASES[name]
    s = value_simulation(halving(True, smaller), trials)
    assert isinstance(s.method, AshaStopOnce)


def test_stop_once_single_rung_bracket() -> None:
    cfg = config(
        {
            "name": "async_halving",
            "num_rungs": 1,
            "max_length": {"batches": 9000},
            "max_trials": 4,
            "divisor": 3,
            "stop_once": True,
        }
    )
    value_simulation(cfg, [constant("9000", m) for m in (0.05, 0.06, 0.07, 0.08)])


ADAPTIVE_CASES = {
    "smaller is better": (
        True,
        [
            constant("300 900", 0.1),
            constant("300", 0.2),
            constant("300", 0.3),
            constant("900", 0.4),
            constant("900", 0.5),
        ],
    ),
    "early exit -- smaller is better": (
        True,
        [
            constant("300 900", 0.1),
            early("300", 0.2),
            constant("300", 0.3),
            constant("900", 0.4),
            constant("900", 0.5),
        ],
    ),
    "smaller is not better": (
        False,
        [
            constant("300 900", 0.5),
            constant("300", 0.4),
            constant("300", 0.3),
            constant("900", 0.2),
            constant("900", 0.1),
        ],
    ),
    "early exit -- smaller is not better": (
        False,
        [
            constant("300 900", 0.5),
            early("300", 0.4),
            constant("300", 0.3),
            constant("900", 0.2),
            constant("900", 0.1),
        ],
    ),
}


@pytest.mark.parametrize("stop_once", [False, True])
@pytest.mark.parametrize("name", list(ADAPTIVE_CASES))
def test_adaptive_asha_legacy(name: str, stop_once: bool) -> None:
    # TestAdaptiveASHASearchMethod and TestAdaptiveASHAStoppingSearchMethod
    smaller, trials = ADAPTIVE_CASES[name]
    value_simulation(adaptive(stop_once, smaller), trials)


@pytest.mark.parametrize(
    "length,rungs",
    [
        ({"records": 576000}, (64000, 192000, 576000)),
        ({"batches": 9000}, (1000, 3000, 9000)),
        ({"epochs": 12}, (1, 4, 12)),
    ],
)
@pytest.mark.parametrize("workers", [1, 3, 12])
def test_constant_metric_operations(length: dict, rungs: tuple, workers: int) -> None:
    # TestASHASearcherRecords/Batches/Epochs: with one constant metric, promotions come only
    # from the rungs filling up: 8 trials stop at rung 0, 3 at rung 1, one reaches the top
    cfg = config(
        {
            "name": "async_halving",
            "num_rungs": 3,
            "max_length": length,
            "max_trials": 12,
            "divisor": 3,
        }
    )
    from det_local.search import make_searcher

    res = Simulation(make_searcher(cfg), lambda t, u: 1.0, workers=workers, max_units=0).run()
    got = Counter(tuple(u for u, _ in t.reports) for t in res.trials)
    assert got == Counter({rungs[:1]: 8, rungs[:2]: 3, rungs: 1})
    assert len(res.shutdowns) == 1


@pytest.mark.parametrize("length,first", [({"records": 576000}, 64000), ({"epochs": 12}, 1)])
def test_stop_once_trial_id_metric(length: dict, first: int) -> None:
    # TestASHAStoppingSearcherRecords/Epochs: metric = trial number; only the first trial
    # continues past rung 0
    cfg = config(
        {
            "name": "async_halving",
            "num_rungs": 3,
            "max_length": length,
            "max_trials": 12,
            "divisor": 3,
            "stop_once": True,
            "max_concurrent_trials": 2,
        }
    )
    from det_local.search import make_searcher

    res = Simulation(
        make_searcher(cfg), lambda t, u: float(t.index + 1), workers=2, max_units=0
    ).run()
    lengths = [len(t.reports) for t in res.trials]
    assert lengths == [3] + [1] * 11
    assert res.trials[1].reports[0][0] == first


def test_promotion_initial_operations_and_pausing() -> None:
    s = _small(max_trials=4)
    assert s.pauses_trials
    init = s.initial_actions()
    a, b = (c.request_id for c in creates(init))
    assert [x for x in init if isinstance(x, ValidateAfter)] == [
        ValidateAfter(a, 4),
        ValidateAfter(b, 4),
    ]
    # a: rung 0 has 0 results, int(1/2) = 0 promote now -> waits; a replacement is created
    out = s.on_op_completed(a, 4, 0.5)
    assert len(creates(out)) == 1 and not any(
        isinstance(x, ValidateAfter) and x.request_id == a for x in out
    )
    # b is worse but the rung now has 2 results: the best one, a, is promoted (relaunched)
    out = s.on_op_completed(b, 4, 0.9)
    assert ValidateAfter(a, 8) in out
    assert s.rung_of(a) == 1
    # a repeated report is ignored
    assert s.on_op_completed(b, 4, 0.9) == []


def test_closeout_closes_waiting_trials_once_rung0_is_full() -> None:
    s = _small(max_trials=2)
    a, b = (c.request_id for c in creates(s.initial_actions()))
    s.on_op_completed(a, 4, 0.5)
    out = s.on_op_completed(b, 4, 0.9)
    # rung 0 is settled (no trial training towards it): b, not promoted, is closed; rung 1
    # still has a trial training, so the walk stops there
    assert out == [ValidateAfter(a, 8), Close(b)]
    assert s.on_op_completed(a, 8, 0.4) == [Close(a)]


def test_exit_without_consuming_operations_does_not_hang_the_search() -> None:
    # Code that never iterates searcher.operations() exits normally: it ranks as exited early
    s = _small(max_trials=2)
    a, b = (c.request_id for c in creates(s.initial_actions()))
    s.on_trial_exited(a)
    out = s.on_trial_exited(b)
    assert any(type(x).__name__ == "Shutdown" for x in out)


def test_invalid_hp_is_closed_and_replaced() -> None:
    s = _small(max_trials=2)
    a, b = (c.request_id for c in creates(s.initial_actions()))
    out = s.on_trial_exited_early(a, "INVALID_HP")
    assert out[0] == Close(a)
    c = creates(out)
    assert len(c) == 1 and ValidateAfter(c[0].request_id, 4) in out
    assert s.method.invalid == 1


@pytest.mark.parametrize(
    "smaller_is_better,diverged",
    [(True, float("-inf")), (False, float("inf")), (True, float("nan"))],
)
def test_infinite_metric_is_never_promoted(smaller_is_better: bool, diverged: float) -> None:
    """Promotion ranks a diverged trial's infinite metric (-inf when smaller is better, +inf
    when larger is) as the worst value, like NaN: the finite trial is promoted, not it."""
    s = searcher(
        {
            "name": "async_halving",
            "num_rungs": 2,
            "max_length": {"batches": 8},
            "max_trials": 4,
            "divisor": 2,
            "max_concurrent_trials": 2,
            "smaller_is_better": smaller_is_better,
        }
    )
    a, b = (c.request_id for c in creates(s.initial_actions()))
    s.on_op_completed(a, 4, 0.5)
    out = s.on_op_completed(b, 4, diverged)
    assert ValidateAfter(a, 8) in out and not any(
        isinstance(x, ValidateAfter) and x.request_id == b for x in out
    ), out
    assert s.rung_of(a) == 1 and s.rung_of(b) == 0
