"""Bracket and rung arithmetic, identical to Determined's (adaptive_asha_test.go,
asha_stopping_test.go), including Go's float64 logs and powers."""

from __future__ import annotations

import math

import pytest

from det_local.search import brackets, plan
from det_local.search.adaptive import (
    Bracket,
    bracket_max_concurrent_trials,
    bracket_max_trials,
    make_brackets,
    max_rungs_for,
    mode_rungs,
)
from det_local.search.asha import initial_trial_count, make_rungs
from det_local.search.gomath import go_log, go_pow, go_round
from tests.support.searchkit import config


def test_go_log_truncation_matches_python_for_1000_over_10() -> None:
    # Both Python's libm log and Go's math.Log give 2.9999999999999996 here: int() is 2.
    assert math.log(1000) / math.log(10) == 2.9999999999999996
    assert go_log(1000) / go_log(10) == 2.9999999999999996
    assert int(math.log(1000) / math.log(10)) == 2
    assert int(go_log(1000) / go_log(10)) == 2


def test_go_log_differs_from_libm_where_it_matters() -> None:
    # ln(243)/ln(3): libm gives 4.999999999999999 (truncates to 4), Go gives exactly 5.0.
    assert int(math.log(243) / math.log(3)) == 4
    assert go_log(243) / go_log(3) == 5.0
    assert max_rungs_for(10, 243, 10_000, 3.0) == 6  # int(5.0) + 1, as Determined computes
    assert int(go_log(59049) / go_log(3)) == 10


def test_go_log_special_values_and_accuracy() -> None:
    assert go_log(1.0) == 0.0
    assert go_log(0.0) == -math.inf
    assert math.isnan(go_log(-1.0))
    assert go_log(math.inf) == math.inf
    for x in (2.0, 3.0, 10.0, 937.0, 1e-300, 1e300, 0.5):
        assert go_log(x) == pytest.approx(math.log(x), rel=1e-15)


def test_go_pow_and_round() -> None:
    assert go_pow(4.0, 3.0) == 64.0
    assert go_pow(3.0, 0.0) == 1.0
    assert go_pow(2.5, 3.0) == 15.625
    assert go_pow(4.0, -1.0) == 0.25
    assert go_pow(1.1, 7.0) == pytest.approx(1.1**7, rel=1e-15)
    assert go_round(2.5) == 3.0 and round(2.5) == 2  # halves away from zero, unlike Python
    assert go_round(-2.5) == -3.0
    assert go_round(0.49999999999999994) == 0.0
    assert go_round(1.4) == 1.0


def test_bracket_max_trials() -> None:  # TestBracketMaxTrials
    assert bracket_max_trials(20, 3.0, [3, 2, 1]) == [12, 5, 3]
    assert bracket_max_trials(50, 3.0, [4, 3]) == [35, 15]
    assert bracket_max_trials(50, 4.0, [3, 2]) == [37, 13]
    assert bracket_max_trials(100, 4.0, [4, 3, 2]) == [70, 22, 8]


def test_bracket_max_concurrent_trials() -> None:  # TestBracketMaxConcurrentTrials
    assert bracket_max_concurrent_trials(0, 3.0, [9, 3, 1]) == [3, 3, 3]
    assert bracket_max_concurrent_trials(11, 3.0, [9, 3, 1]) == [4, 4, 3]
    assert bracket_max_concurrent_trials(0, 4.0, [40, 10]) == [10, 10]
    # fewer concurrent trials than brackets: every bracket still gets one
    assert bracket_max_concurrent_trials(1, 4.0, [7, 3]) == [1, 1]


def test_make_brackets() -> None:  # TestMakeBrackets
    assert make_brackets(
        mode="standard", length=100, max_concurrent_trials=2, max_trials=10, divisor=4.0
    ) == [Bracket(2, 7, 1), Bracket(1, 3, 1)]
    assert make_brackets(
        mode="conservative", length=1000, divisor=3.0, max_concurrent_trials=5, max_trials=10
    ) == [Bracket(3, 7, 2), Bracket(2, 2, 2), Bracket(1, 1, 1)]


def test_bracket_rungs_given_are_sorted_descending() -> None:
    got = make_brackets(max_trials=100, divisor=4.0, length=1000, bracket_rungs=[2, 4, 3])
    assert [b.num_rungs for b in got] == [4, 3, 2]
    assert [b.max_trials for b in got] == [70, 22, 8]


def test_modes() -> None:
    assert mode_rungs("aggressive", 5) == [5]
    assert mode_rungs("standard", 5) == [3, 4, 5]
    assert mode_rungs("standard", 4) == [2, 3, 4]
    assert mode_rungs("standard", 1) == [1]
    assert mode_rungs("conservative", 3) == [1, 2, 3]
    with pytest.raises(ValueError):
        mode_rungs("bold", 3)


@pytest.mark.parametrize(
    "num_rungs,max_time,divisor,expected",
    [
        (3, 9, 3.0, [1, 3, 9]),
        (4, 10, 2.0, [1, 2, 5, 10]),
        (1, 9, 3.0, [9]),
        (3, 900, 3.0, [100, 300, 900]),
        (5, 3, 4.0, [1, 1, 1, 1, 3]),  # never below 1
    ],
)
def test_make_rungs(num_rungs: int, max_time: int, divisor: float, expected: list[int]) -> None:
    assert make_rungs(num_rungs, divisor, max_time) == expected  # TestMakeRungs


def test_initial_trials() -> None:
    assert initial_trial_count(16, 12, 4.0, 3) == 12
    assert initial_trial_count(3, 12, 4.0, 3) == 3
    assert initial_trial_count(0, 12, 4.0, 3) == 12  # clamp(4**2, 1, 12)
    assert initial_trial_count(0, 100, 4.0, 3) == 16
    assert initial_trial_count(0, 100, 4.0, 1) == 1


def test_mnist_adaptive_yaml() -> None:
    cfg = config({"name": "adaptive_asha", "max_trials": 16, "max_length": {"batches": 937}})
    assert brackets(cfg) == [Bracket(3, 12, 8), Bracket(2, 4, 8)]
    p = plan(cfg)
    assert [b["rungs"] for b in p["brackets"]] == [[58, 234, 937], [234, 937]]
    assert p["generation"] == "promotion"


def test_tutorial_3_hpsearch() -> None:
    cfg = config(
        {"name": "adaptive_asha", "max_trials": 10, "time_metric": "batches", "max_time": 100}
    )
    p = plan(cfg)
    assert [(b["num_rungs"], b["max_trials"]) for b in p["brackets"]] == [(2, 7), (1, 3)]
    assert [b["rungs"] for b in p["brackets"]] == [[25, 100], [100]]
    assert p["generation"] == "stopping" and p["time_metric"] == "batches"


def test_adaptive_short() -> None:
    cfg = config(
        {
            "name": "adaptive_asha",
            "mode": "aggressive",
            "divisor": 2,
            "max_rungs": 2,
            "max_trials": 5,
            "time_metric": "batches",
            "max_time": 400,
        }
    )
    p = plan(cfg)
    assert [(b["num_rungs"], b["max_trials"], b["rungs"]) for b in p["brackets"]] == [
        (2, 5, [200, 400])
    ]


def test_async_halving_is_one_bracket() -> None:
    cfg = config(
        {
            "name": "async_halving",
            "num_rungs": 3,
            "max_trials": 10,
            "divisor": 3,
            "max_concurrent_trials": 3,
            "time_metric": "batches",
            "max_time": 900,
        }
    )
    assert plan(cfg)["brackets"] == [
        {"num_rungs": 3, "max_trials": 10, "max_concurrent_trials": 3, "rungs": [100, 300, 900]}
    ]
