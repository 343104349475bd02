"""The helpers of Determined's ``determined.common.util`` that user scripts call (importable
as ``determined.common.util`` inside det-local trials and unmanaged scripts).

Scripts use it for the metric group names ``report_metrics`` takes (Determined's e2e fixture
``core_api/11_generic_metrics.py`` reports to ``util._LEGACY_TRAINING``), for YAML, and for a
few small utilities. Helpers that talk to a Determined master are not here: there is none.
"""

from __future__ import annotations

import functools
import io
import os
import random
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any, TypeVar

import yaml

# The built-in metric groups (Determined names them "legacy": they predate generic groups).
_LEGACY_TRAINING = "training"
_LEGACY_VALIDATION = "validation"
_INFERENCE = "inference"

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

_FALSE = frozenset(("n", "no", "f", "false", "off", "0"))


def chunks(items: Sequence[T], chunk_size: int) -> Iterator[Sequence[T]]:
    """Consecutive slices of at most `chunk_size` items: chunks("ABCDEFG", 3) -> ABC DEF G."""
    if chunk_size < 1:
        raise ValueError(f"chunks: chunk_size must be 1 or more, found {chunk_size}")
    for start in range(0, len(items), chunk_size):
        yield items[start : start + chunk_size]


def sizeof_fmt(val: float) -> str:
    """A byte count for people: 1536 -> '1.5KB' (binary multiples, one decimal)."""
    size = float(val)
    for unit in ("", "K", "M", "G", "T", "P", "E", "Z"):
        if abs(size) < 1024.0:
            return f"{size:3.1f}{unit}B"
        size /= 1024.0
    return f"{size:.1f}YB"


def debug_mode() -> bool:
    """Whether DET_DEBUG asks for debug output (true, 1 or yes)."""
    return os.environ.get("DET_DEBUG", "").lower() in ("true", "1", "yes")


def strtobool(val: str) -> bool:
    """distutils' strtobool, without the error: empty and the usual "no" words are False,
    anything else is True."""
    return bool(val) and val.lower() not in _FALSE


def preserve_random_state(fn: F) -> F:
    """Decorator: the function runs with Python's `random` state restored afterwards, so the
    draws it makes do not shift the caller's sequence."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        saved = random.getstate()
        try:
            return fn(*args, **kwargs)
        finally:
            random.setstate(saved)

    return wrapper  # type: ignore[return-value]


def yaml_safe_load(stream: IO[Any] | str) -> Any:
    """YAML to plain Python values (safe: no arbitrary objects)."""
    return yaml.safe_load(stream)


def yaml_safe_dump(
    data: Any, stream: IO[Any] | None = None, default_flow_style: bool | None = None
) -> str | None:
    """Plain Python values to YAML, keys in their order, block style unless
    `default_flow_style` says otherwise; returns the text when no stream is given."""
    flow = bool(default_flow_style)
    if stream is not None:
        yaml.safe_dump(data, stream, default_flow_style=flow, sort_keys=False)
        return None
    out = io.StringIO()
    yaml.safe_dump(data, out, default_flow_style=flow, sort_keys=False)
    return out.getvalue()


__all__ = [
    "_INFERENCE",
    "_LEGACY_TRAINING",
    "_LEGACY_VALIDATION",
    "chunks",
    "debug_mode",
    "preserve_random_state",
    "sizeof_fmt",
    "strtobool",
    "yaml_safe_dump",
    "yaml_safe_load",
]
