"""The grid of a grid search, as Determined's master builds it.

One axis per leaf hyperparameter (nested groups expanded, names sorted at every level):
int -> `count` evenly spaced rounded ints (count clamped to the number of integers in range;
count 1 -> the rounded midpoint), double -> `count` evenly spaced values including both ends
(count 1 -> the midpoint), log -> base ** (evenly spaced exponents), categorical -> every value,
const -> its value, an empty group -> {}. The grid is the cartesian product of the axes in that
order (the first axis varies slowest). Points are computed from their index, so a large grid
costs no memory; a grid search takes its trials from the end of the list."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from det_local.config.hparams import (
    CategoricalHP,
    ConstHP,
    DoubleHP,
    Hyperparameter,
    IntHP,
    LogHP,
    NestedHP,
)
from det_local.errors import ConfigError
from det_local.search.gomath import go_pow, go_round

Route = tuple[str, ...]
Axis = tuple[Route, list[Any]]


def _needs_count(route: Route, count: int | None) -> int:
    if count is None:
        raise ConfigError(
            f"hyperparameters.{'.'.join(route)}.count is missing: searcher.name is grid, so every "
            "int/double/log hyperparameter needs the number of grid points, e.g. 'count: 3'"
        )
    return count


def axis_values(route: Route, hp: Hyperparameter) -> list[Any]:
    """The values one (non-nested) hyperparameter takes in the grid."""
    if isinstance(hp, ConstHP):
        return [hp.val]
    if isinstance(hp, CategoricalHP):
        return list(hp.vals)
    if isinstance(hp, IntHP):
        lo, hi = hp.minval, hp.maxval
        count = min(_needs_count(route, hp.count), hi - lo + 1)
        if count == 1:
            return [int(go_round(float(lo + hi) / 2.0))]
        return [
            int(go_round(float(lo) + float(i * (hi - lo)) / float(count - 1))) for i in range(count)
        ]
    if isinstance(hp, DoubleHP):
        count = _needs_count(route, hp.count)
        if count == 1:
            return [(hp.minval + hp.maxval) / 2.0]
        return [
            hp.minval + float(i) * (hp.maxval - hp.minval) / float(count - 1) for i in range(count)
        ]
    if isinstance(hp, LogHP):
        count = _needs_count(route, hp.count)
        if count == 1:
            return [go_pow(hp.base, (hp.minval + hp.maxval) / 2.0)]
        return [
            go_pow(hp.base, hp.minval + float(i) * (hp.maxval - hp.minval) / float(count - 1))
            for i in range(count)
        ]
    raise TypeError(f"not a leaf hyperparameter: {hp!r}")


def grid_axes(hps: dict[str, Hyperparameter], route: Route = ()) -> list[Axis]:
    """Every axis of the grid, in Determined's order (sorted names, nested groups in place)."""
    axes: list[Axis] = []
    for name in sorted(hps):
        hp = hps[name]
        sub = (*route, name)
        if isinstance(hp, NestedHP):
            if not hp.hps:
                axes.append((sub, [{}]))
            else:
                axes.extend(grid_axes(hp.hps, sub))
        else:
            axes.append((sub, axis_values(sub, hp)))
    return axes


def grid_size(axes: list[Axis]) -> int:
    """The number of grid points. No hyperparameters at all make one point (an empty dict)."""
    n = 1
    for _, values in axes:
        n *= len(values)
    return n


def grid_point(axes: list[Axis], index: int) -> dict[str, Any]:
    """Point `index` of the cartesian product (the last axis varies fastest)."""
    picks: list[Any] = []
    for _, values in reversed(axes):
        index, i = divmod(index, len(values))
        picks.append(values[i])
    picks.reverse()
    sample: dict[str, Any] = {}
    for (route, _), value in zip(axes, picks, strict=True):
        node = sample
        for key in route[:-1]:
            node = node.setdefault(key, {})
        node[route[-1]] = copy.deepcopy(value)
    return sample


def hyperparameter_grid(hps: dict[str, Hyperparameter]) -> Iterator[dict[str, Any]]:
    """Every grid point in order (what Determined's newHyperparameterGrid returns)."""
    axes = grid_axes(hps)
    for i in range(grid_size(axes)):
        yield grid_point(axes, i)
