"""Checks on reported metrics: cheap enough for every batch, with one-line errors."""

from __future__ import annotations

import math
import sys
from typing import Any

from det_local.errors import MetricError

_PLAIN = (int, float, str, bool, type(None))
_warned_nan: set[tuple[str, str]] = set()


def _convert(group: str, steps: int, key: str, value: Any) -> Any:
    """A value that is not a plain number: numpy scalars convert, tensors are refused."""
    mod = type(value).__module__
    if mod.startswith("numpy") and hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if mod.startswith("torch"):
        raise MetricError(
            f"{group} metric '{key}' at steps_completed={steps} is a {type(value).__name__}; "
            f"report a Python number instead (e.g. {key}.item() at a reporting boundary)"
        )
    if isinstance(value, (list, tuple)):
        return [_convert(group, steps, key, v) if not isinstance(v, _PLAIN) else v for v in value]
    if isinstance(value, dict):
        return {
            str(k): v if isinstance(v, _PLAIN) else _convert(group, steps, key, v)
            for k, v in value.items()
        }
    raise MetricError(
        f"{group} metric '{key}' at steps_completed={steps} has type {type(value).__name__}, "
        "which is not a number; report int, float, str, bool, or lists/dicts of them"
    )


def check_metrics(
    group: str, steps_completed: Any, metrics: Any, *, allow_none: bool = True
) -> dict[str, Any]:
    """Validate one report; returns a copy safe to queue (the caller may reuse its dict)."""
    if type(steps_completed) is not int:
        if isinstance(steps_completed, bool) or not hasattr(steps_completed, "__index__"):
            raise MetricError(
                f"{group} metrics: steps_completed must be an int, found "
                f"{steps_completed!r} ({type(steps_completed).__name__})"
            )
        steps_completed = steps_completed.__index__()
    if not isinstance(metrics, dict):
        raise MetricError(
            f"{group} metrics at steps_completed={steps_completed} must be a dict of "
            f"name -> value, found {type(metrics).__name__}"
        )
    out = dict(metrics)
    for key, value in out.items():
        t = type(value)
        if t is float:
            if value != value or value in (math.inf, -math.inf):
                _warn_nonfinite(group, key, value, steps_completed)
            continue
        if t is int or t is str or t is bool:
            continue
        if value is None:
            if not allow_none:
                raise MetricError(
                    f"{group} metric '{key}' at steps_completed={steps_completed} is None; "
                    "report a number or leave the key out"
                )
            continue
        if not isinstance(key, str):
            raise MetricError(f"{group} metric names must be strings, found {key!r}")
        out[key] = _convert(group, steps_completed, key, value)
    return out


def _warn_nonfinite(group: str, key: str, value: float, steps: int) -> None:
    if (group, key) in _warned_nan:
        return
    _warned_nan.add((group, key))
    print(
        f"det-local: warning: {group} metric '{key}' is {value} at steps_completed={steps}; it is "
        "recorded as reported (a searcher ranks it worst); check the learning rate or the data",
        file=sys.stderr,
        flush=True,
    )
