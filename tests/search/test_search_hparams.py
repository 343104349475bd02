"""Hyperparameter grids (Determined's grid_test.go) and seeded random sampling."""

from __future__ import annotations

import json
import math

import pytest

from det_local.config.check import Ctx
from det_local.config.hparams import parse_hyperparameters
from det_local.errors import ConfigError
from det_local.search.hparams_grid import grid_axes, grid_size, hyperparameter_grid
from tests.support.searchkit import config, creates, searcher


def hps(raw: dict) -> dict:
    return parse_hyperparameters(Ctx("test"), raw)


def grid(raw: dict) -> list[dict]:
    return list(hyperparameter_grid(hps(raw)))


@pytest.mark.parametrize("counts", [[1], [4], [1, 4], [3, 4], [2, 3, 4], [2, 2, 3, 3, 4, 5]])
def test_grid_size_is_the_product_of_counts(counts: list[int]) -> None:  # TestGridFunctionality
    raw = {
        str(i): {"type": "double", "minval": -1.0, "maxval": 1.0, "count": c}
        for i, c in enumerate(counts)
    }
    assert len(grid(raw)) == math.prod(counts)
    assert grid_size(grid_axes(hps(raw))) == math.prod(counts)


def test_axis_lengths() -> None:  # TestHyperparameterGridMethod
    def axis(spec: dict) -> list:
        return grid_axes(hps({"x": spec}))[0][1]

    assert len(axis({"type": "double", "minval": 0, "maxval": 2.0, "count": 5})) == 5
    assert len(axis({"type": "int", "minval": 0, "maxval": 20, "count": 7})) == 7
    assert len(axis({"type": "log", "minval": -3.0, "maxval": -2.0, "base": 10, "count": 2})) == 2
    assert axis({"type": "categorical", "vals": [1, 2, 3]}) == [1, 2, 3]
    assert axis({"type": "const", "val": 3}) == [3]
    # an empty nested group is kept as {}
    got = grid_axes(hps({"x": {"empty": {}, "full": {"type": "categorical", "vals": [1, 2, 3]}}}))
    assert got == [(("x", "empty"), [{}]), (("x", "full"), [1, 2, 3])]


def test_int_axis_values() -> None:
    def axis(lo: int, hi: int, count: int) -> list:
        return grid_axes(hps({"x": {"type": "int", "minval": lo, "maxval": hi, "count": count}}))[
            0
        ][1]

    assert axis(0, 20, 3) == [0, 10, 20]
    assert axis(0, 20, 7) == [0, 3, 7, 10, 13, 17, 20]
    assert axis(0, 4, 5) == [0, 1, 2, 3, 4]  # TestGridIntCount
    assert axis(-4, -2, 3) == [-4, -3, -2]  # TestGridIntCountNegative
    assert axis(0, 4, 10) == [0, 1, 2, 3, 4]  # clamped to the number of integers
    assert axis(0, 3, 1) == [2]  # rounded midpoint 1.5 -> 2 (half away from zero)
    assert axis(-3, 0, 1) == [-2]  # -1.5 -> -2
    assert axis(0, 5, 3) == [0, 3, 5]  # 2.5 -> 3, where Python's round() would give 2


def test_double_and_log_axis_values() -> None:
    def axis(spec: dict) -> list:
        return grid_axes(hps({"x": spec}))[0][1]

    assert axis({"type": "double", "minval": 0.0, "maxval": 1.0, "count": 5}) == [
        0.0,
        0.25,
        0.5,
        0.75,
        1.0,
    ]
    assert axis({"type": "double", "minval": 13.0, "maxval": 17.0, "count": 1}) == [15.0]
    assert axis({"type": "log", "minval": 1, "maxval": 2, "base": 10, "count": 2}) == [10.0, 100.0]
    assert axis({"type": "log", "minval": -3, "maxval": -1, "base": 10, "count": 1}) == [0.01]
    assert axis({"type": "log", "minval": 0, "maxval": 3, "base": 2, "count": 4}) == [1, 2, 4, 8]


def test_grid_order() -> None:  # TestGrid
    assert grid(
        {
            "1": {"type": "int", "minval": 0, "maxval": 20, "count": 3},
            "2": {"type": "int", "minval": 0, "maxval": 10, "count": 3},
        }
    ) == [
        {"1": 0, "2": 0},
        {"1": 0, "2": 5},
        {"1": 0, "2": 10},
        {"1": 10, "2": 0},
        {"1": 10, "2": 5},
        {"1": 10, "2": 10},
        {"1": 20, "2": 0},
        {"1": 20, "2": 5},
        {"1": 20, "2": 10},
    ]


def test_nested_grid() -> None:  # TestNestedGrid
    got = grid(
        {
            "1": {"type": "int", "minval": 0, "maxval": 20, "count": 3},
            "2": {"3": {"type": "int", "minval": 0, "maxval": 10, "count": 3}},
        }
    )
    assert got == [{"1": a, "2": {"3": b}} for a in (0, 10, 20) for b in (0, 5, 10)]


def test_nested_grid_further() -> None:  # TestNestedGridFurther
    got = grid(
        {
            "constant": 2,
            "a": {
                "b": {
                    "c1": {"type": "categorical", "vals": [3, 5]},
                    "c2": {"type": "int", "minval": 7, "maxval": 11, "count": 2},
                }
            },
            "f": {"type": "double", "minval": 13.0, "maxval": 17.0, "count": 2},
            "l": {"type": "log", "minval": 1, "maxval": 2, "base": 10, "count": 2},
        }
    )
    want = {
        json.dumps(
            {"a": {"b": {"c1": c1, "c2": c2}}, "constant": 2, "f": f, "l": lv}, sort_keys=True
        )
        for c1 in (3, 5)
        for c2 in (7, 11)
        for f in (13.0, 17.0)
        for lv in (10.0, 100.0)
    }
    seen = [json.dumps(p, sort_keys=True) for p in got]
    assert len(seen) == 16 and set(seen) == want
    # sorted-name order: a.b.c1 varies slowest, l fastest
    assert got[0] == {"a": {"b": {"c1": 3, "c2": 7}}, "constant": 2, "f": 13.0, "l": 10.0}
    assert got[1]["l"] == 100.0 and got[2]["f"] == 17.0


def test_grid_points_are_independent_copies() -> None:
    got = grid({"x": {"type": "categorical", "vals": [[1], {"k": 2}]}, "c": [1, 2]})
    got[0]["c"].append(3)
    assert got[1]["c"] == [1, 2]


def test_no_hyperparameters_is_one_point() -> None:
    assert grid({}) == [{}]


def test_grid_without_count_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"hyperparameters\.x\.count is missing"):
        config({"name": "grid"}, {"x": {"type": "int", "minval": 0, "maxval": 3}})
    # and the searcher says so too if handed such hyperparameters directly
    with pytest.raises(ConfigError, match="count"):
        grid({"x": {"type": "double", "minval": 0, "maxval": 3}})


def test_grid_search_takes_trials_from_the_end() -> None:  # TestGridSearchMethod
    s = searcher(
        {"name": "grid", "max_concurrent_trials": 2},
        {"a": {"type": "int", "minval": 0, "maxval": 3, "count": 4}},
    )
    first = creates(s.initial_actions())
    assert [c.hparams for c in first] == [{"a": 3}, {"a": 2}]
    nxt = creates(s.on_trial_exited(first[0].request_id))
    assert [c.hparams for c in nxt] == [{"a": 1}]


# ---------------------------------------------------------------------- random sampling
RANDOM_HPS = {
    "lr": {"type": "log", "minval": -4, "maxval": -1, "base": 10},
    "layers": {"type": "int", "minval": 1, "maxval": 8},
    "dropout": {"type": "double", "minval": 0.0, "maxval": 0.5},
    "opt": {"type": "categorical", "vals": ["sgd", "adam"]},
    "arch": {"width": {"type": "int", "minval": 8, "maxval": 64}, "act": "relu"},
    "global_batch_size": 32,
}


def _trials(seed: int) -> list[tuple]:
    s = searcher({"name": "random", "max_trials": 6, "max_concurrent_trials": 3}, RANDOM_HPS, seed)
    out = [
        (c.request_id, json.dumps(c.hparams, sort_keys=True), c.seed)
        for c in creates(s.initial_actions())
    ]
    for rid, *_ in list(out):
        out += [
            (c.request_id, json.dumps(c.hparams, sort_keys=True), c.seed)
            for c in creates(s.on_trial_exited(rid))
        ]
    return out


def test_same_seed_same_trials() -> None:
    a, b = _trials(42), _trials(42)
    assert a == b and len(a) == 6
    assert _trials(43) != a


def test_random_values_are_in_range() -> None:
    s = searcher({"name": "random", "max_trials": 200, "max_concurrent_trials": 0}, RANDOM_HPS)
    for c in creates(s.initial_actions()):
        h = c.hparams
        assert 1e-4 <= h["lr"] <= 1e-1
        assert 1 <= h["layers"] <= 8 and isinstance(h["layers"], int)
        assert 0.0 <= h["dropout"] <= 0.5
        assert h["opt"] in ("sgd", "adam")
        assert 8 <= h["arch"]["width"] <= 64 and h["arch"]["act"] == "relu"
        assert h["global_batch_size"] == 32
        assert 0 <= c.seed < 2**31
