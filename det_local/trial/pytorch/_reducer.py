"""Reducers: how per-batch validation metrics become one value, and custom metrics that are
reduced correctly across slots (MetricReducer / wrap_reducer)."""

from __future__ import annotations

import abc
import enum
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, overload

from det_local.trial.pytorch._errors import InvalidTrialError
from det_local.trial.pytorch._metrics import _flatten_numbers, to_python


class Reducer(enum.Enum):
    """How evaluate_batch() values are combined over batches (AVG: weighted by batch counts
    across slots)."""

    AVG = 1
    SUM = 2
    MAX = 3
    MIN = 4


def simple_reduce(
    reducer: Reducer, values: Sequence[Any], weights: Sequence[int] | None = None
) -> Any:
    """Reduce every number in `values` (nested lists flattened) with `reducer`. With `weights`
    (AVG across slots), value i counts weights[i] times; each value must then be a number."""
    if weights is not None:
        if len(weights) != len(values):
            raise ValueError(f"{len(values)} values but {len(weights)} weights")
        if reducer == Reducer.AVG:
            total = sum(weights)
            if total == 0:
                return math.nan
            return math.fsum(float(v) * w for v, w in zip(values, weights, strict=True)) / total
    flat: list[float] = []
    ints = True
    for v in values:
        if isinstance(v, float) or (isinstance(v, list) and _has_float(v)):
            ints = False
        if not _flatten_numbers(v, flat):
            raise InvalidTrialError(
                f"cannot reduce metric values of type {type(v).__name__} with {reducer}; "
                "return numbers or tensors from evaluate_batch(), or wrap a custom reducer "
                "with context.wrap_reducer()"
            )
    if not flat:
        return math.nan
    if reducer == Reducer.AVG:
        return math.fsum(flat) / len(flat)
    if reducer == Reducer.SUM:
        s = math.fsum(flat)
        return int(s) if ints and s.is_integer() else s
    result = max(flat) if reducer == Reducer.MAX else min(flat)
    return int(result) if ints and result.is_integer() else result


def _has_float(v: list[Any]) -> bool:
    return any(isinstance(x, float) or (isinstance(x, list) and _has_float(x)) for x in v)


class MetricReducer(metaclass=abc.ABCMeta):
    """A custom metric computed in three steps: values gathered by your own ``update()`` method
    (per slot), ``per_slot_reduce()`` (picklable, per slot), then ``cross_slot_reduce(list of
    per-slot values)`` (a value if wrapped with a name, else a dict of name -> value).
    ``reset()`` runs before every training and validation workload."""

    @abc.abstractmethod
    def reset(self) -> None: ...

    @abc.abstractmethod
    def per_slot_reduce(self) -> Any: ...

    @abc.abstractmethod
    def cross_slot_reduce(self, per_slot_metrics: list[Any]) -> Any: ...


class _NotMetric:
    pass


_NOT_METRIC = _NotMetric()


class _SimpleReducer(MetricReducer):
    """A plain function as a MetricReducer: ``update(value)`` collects, the function reduces the
    flat list of every slot's values (interleaved to undo sharding)."""

    def __init__(self, fn: Callable[[list[Any]], Any]) -> None:
        self.fn = fn
        self.values: list[Any] = []

    def reset(self) -> None:
        self.values = []

    def update(self, value: Any) -> None:
        self.values.append(value)

    def per_slot_reduce(self) -> Any:
        return self.values

    def cross_slot_reduce(self, per_slot_metrics: list[Any]) -> Any:
        interleaved = itertools.zip_longest(*per_slot_metrics, fillvalue=_NOT_METRIC)
        return self.fn([m for group in interleaved for m in group if m is not _NOT_METRIC])


class _WrappedReducer:
    def __init__(
        self, reducer: MetricReducer, name: str | None, for_training: bool, for_validation: bool
    ) -> None:
        self.reducer = reducer
        self.name = name
        self.for_training = for_training
        self.for_validation = for_validation

    @property
    def label(self) -> str:
        r = self.reducer
        what = f"function {r.fn.__name__}()" if isinstance(r, _SimpleReducer) else type(r).__name__
        return f"reducer {what} (name={self.name!r})"

    def call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.reducer, method)(*args)
        except Exception as err:
            raise InvalidTrialError(f"{self.label} failed in {method}(): {err}") from err


R = TypeVar("R", bound=MetricReducer)


class ReducerContext:
    """The wrap_reducer() part of PyTorchTrialContext; cross-slot values travel by allgather."""

    def __init__(self, allgather: Callable[[Any], list[Any]] | None = None) -> None:
        self._wrapped_reducers: list[_WrappedReducer] = []
        self._allgather_fn: Callable[[Any], list[Any]] = allgather or (lambda x: [x])

    def reset_reducers(self) -> None:
        for wrapped in self._wrapped_reducers:
            wrapped.call("reset")

    @overload
    def wrap_reducer(
        self,
        reducer: R,
        name: str | None = None,
        for_training: bool = True,
        for_validation: bool = True,
    ) -> R: ...

    @overload
    def wrap_reducer(
        self,
        reducer: Callable[[list[Any]], Any],
        name: str | None = None,
        for_training: bool = True,
        for_validation: bool = True,
    ) -> _SimpleReducer: ...

    def wrap_reducer(
        self,
        reducer: Any,
        name: str | None = None,
        for_training: bool = True,
        for_validation: bool = True,
    ) -> Any:
        """Register a custom metric. A function becomes a reducer with ``.update(value)`` whose
        result is ``fn(all values)``; a MetricReducer is returned as given."""
        if any(w.reducer is reducer for w in self._wrapped_reducers):
            raise InvalidTrialError(
                f"wrap_reducer() got the same {type(reducer).__name__} object twice; wrap each "
                "reducer once"
            )
        if not isinstance(reducer, MetricReducer):
            if not callable(reducer):
                raise InvalidTrialError(
                    f"wrap_reducer() got a {type(reducer).__name__}; pass a function or a "
                    "pytorch.MetricReducer"
                )
            reducer = _SimpleReducer(reducer)
        self._wrapped_reducers.append(_WrappedReducer(reducer, name, for_training, for_validation))
        return reducer

    def reduce_metrics(self, for_training: bool) -> dict[str, Any]:
        """Reduce the registered reducers of this workload (collective when distributed)."""
        active = [
            w
            for w in self._wrapped_reducers
            if (w.for_training if for_training else w.for_validation)
        ]
        if not active:
            return {}
        gathered = self._allgather_fn([w.call("per_slot_reduce") for w in active])
        metrics: dict[str, Any] = {}
        for i, wrapped in enumerate(active):
            reduced = wrapped.call("cross_slot_reduce", [slot[i] for slot in gathered])
            if wrapped.name is None:
                if not isinstance(reduced, dict):
                    raise InvalidTrialError(
                        f"{wrapped.label} was wrapped without a name but returned a "
                        f"{type(reduced).__name__}, not a dict; pass name='...' to "
                        "wrap_reducer() for a single metric, or return {name: value}"
                    )
                metrics.update(reduced)
            else:
                if isinstance(reduced, dict):
                    raise InvalidTrialError(
                        f"{wrapped.label} was wrapped with a name but returned a dict; return "
                        "a single value, or wrap it with name=None to report several metrics"
                    )
                metrics[wrapped.name] = reduced
        return {k: to_python(v) for k, v in metrics.items()}


def evaluation_reducers(reducer: Any, keys: Sequence[str], trial_name: str) -> dict[str, Reducer]:
    """evaluation_reducer()'s answer as {metric: Reducer} for exactly `keys`."""
    where = f"{trial_name}.evaluation_reducer()"
    if isinstance(reducer, dict):
        if set(reducer) != set(keys):
            raise InvalidTrialError(
                f"{where} returned reducers for {sorted(reducer)} but evaluate_batch() returned "
                f"metrics {sorted(keys)}; return one Reducer, or one for every metric"
            )
        reducers = dict(reducer)
    else:
        reducers = dict.fromkeys(keys, reducer)
    for key, r in reducers.items():
        if not isinstance(r, Reducer):
            raise InvalidTrialError(
                f"{where}: the reducer for '{key}' is a {type(r).__name__}; use "
                "pytorch.Reducer.AVG/SUM/MAX/MIN (or context.wrap_reducer for custom metrics)"
            )
    return reducers


def reduce_validation(
    dist: Any, batch_metrics: Sequence[dict[str, Any]], reducers: dict[str, Reducer]
) -> dict[str, Any]:
    """Reduce per-batch validation metrics on each slot, then across slots on the chief
    (AVG weighted by each slot's batch count). Non-chief ranks get {}."""
    per_slot = {
        key: simple_reduce(r, [row[key] for row in batch_metrics]) for key, r in reducers.items()
    }
    if dist.size == 1:
        return per_slot
    gathered = dist.gather((per_slot, len(batch_metrics)))
    if dist.rank != 0:
        return {}
    slots = [(m, n) for m, n in gathered if n]
    return {
        key: simple_reduce(r, [m[key] for m, _ in slots], [n for _, n in slots])
        if r == Reducer.AVG
        else simple_reduce(r, [m[key] for m, _ in slots])
        for key, r in reducers.items()
    }
