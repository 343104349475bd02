"""Validation primitives: each failure names the field path, what was expected, what was found."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from det_local.errors import ConfigError
from det_local.suggest import did_you_mean


def join(path: str, key: object) -> str:
    """`searcher` + `metric` -> `searcher.metric`."""
    return f"{path}.{key}" if path else str(key)


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def found(value: Any) -> str:
    """How a value the user wrote is shown in a message: `'ten' (str)`, `-2 (int)`, `null`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (bool)"
    if isinstance(value, dict):
        return f"a mapping {_short(repr(value))}"
    if isinstance(value, list):
        return f"a list {_short(repr(value))}"
    return f"{_short(repr(value))} ({type(value).__name__})"


def shown(value: Any) -> str:
    """A value in a range message (`found -2`), without its type."""
    if isinstance(value, bool):
        return str(value).lower()
    return _short(repr(value))


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(
        value
    )


@dataclass
class Ctx:
    """Where the config came from (for messages) and what validation noticed along the way."""

    source: str = "<config>"
    warnings: list[str] = field(default_factory=list)  # keys set but ignored: printed at run
    deprecations: list[str] = field(default_factory=list)  # honoured, deprecated: config check

    def fail(self, path: str, message: str) -> NoReturn:
        raise ConfigError(f"{path} in {self.source}: {message}")

    def missing(self, path: str, what_to_do: str) -> NoReturn:
        raise ConfigError(f"{path} is missing in {self.source}: {what_to_do}")

    def wrong_type(self, path: str, expected: str, value: Any, hint: str = "") -> NoReturn:
        self.fail(path, f"expected {expected}, found {found(value)}{hint}")

    def unknown(self, path: str, key: object, valid: Iterable[str], hint: str = "") -> NoReturn:
        where = join(path, key)
        suffix = hint or did_you_mean(key, valid)
        if suffix.startswith(" (valid"):
            suffix = f"; remove it or fix its spelling{suffix}"
        raise ConfigError(f"unknown field '{where}' in {self.source}{suffix}")

    def warn(self, path: str, message: str) -> None:
        """A key the config sets that det-local does not act on (what it does instead)."""
        self.warnings.append(f"{path} in {self.source}: {message}")

    def deprecated(self, path: str, message: str) -> None:
        """A key Determined 0.38 deprecates that det-local still honours."""
        self.deprecations.append(f"{path} in {self.source}: {message}")


def _bounds(lo: float | None, hi: float | None, lo_exclusive: bool) -> str:
    """`>= 1`, `> 0`, `between 1 and 99`; empty when unbounded."""
    if lo is not None and hi is not None:
        return f"between {_num(lo)} and {_num(hi)}"
    if lo is not None:
        return f"{'>' if lo_exclusive else '>='} {_num(lo)}"
    if hi is not None:
        return f"<= {_num(hi)}"
    return ""


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _check_range(
    ctx: Ctx,
    value: float,
    path: str,
    lo: float | None,
    hi: float | None,
    lo_exclusive: bool,
) -> None:
    too_low = lo is not None and (value <= lo if lo_exclusive else value < lo)
    too_high = hi is not None and value > hi
    if too_low or too_high:
        ctx.fail(path, f"must be {_bounds(lo, hi, lo_exclusive)}, found {shown(value)}")


def as_int(
    ctx: Ctx, value: Any, path: str, lo: int | None = None, hi: int | None = None, hint: str = ""
) -> int:
    if not is_int(value):
        bounds = _bounds(lo, hi, False)
        ctx.wrong_type(path, f"an integer {bounds}".rstrip(), value, hint)
    _check_range(ctx, value, path, lo, hi, False)
    return int(value)


def as_number(
    ctx: Ctx,
    value: Any,
    path: str,
    lo: float | None = None,
    hi: float | None = None,
    lo_exclusive: bool = False,
) -> float:
    if not is_number(value):
        bounds = _bounds(lo, hi, lo_exclusive)
        ctx.wrong_type(path, f"a number {bounds}".rstrip(), value)
    _check_range(ctx, value, path, lo, hi, lo_exclusive)
    return float(value)


def as_str(ctx: Ctx, value: Any, path: str, nonempty: bool = False) -> str:
    if not isinstance(value, str):
        ctx.wrong_type(path, "a string", value)
    if nonempty and not value.strip():
        ctx.fail(path, "must not be empty")
    return value


def as_bool(ctx: Ctx, value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        ctx.wrong_type(path, "true or false", value)
    return value


def as_enum(ctx: Ctx, value: Any, path: str, choices: Iterable[Any]) -> Any:
    options = list(choices)
    if value not in options or isinstance(value, bool):
        listed = ", ".join(str(c) for c in options)
        ctx.fail(
            path, f"expected one of {listed}, found {found(value)}{_enum_hint(value, options)}"
        )
    return value


def _enum_hint(value: Any, options: list[Any]) -> str:
    hint = did_you_mean(value, [str(o) for o in options])
    return hint if hint.startswith(";") else ""


def as_mapping(ctx: Ctx, value: Any, path: str, example: str = "") -> dict[str, Any]:
    if not isinstance(value, dict):
        ctx.wrong_type(path, f"a mapping{f' such as {example}' if example else ''}", value)
    for key in value:
        if not isinstance(key, str):
            ctx.fail(join(path, key), f"field names must be strings, found {found(key)}; quote it")
    return value


def as_list(ctx: Ctx, value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        ctx.wrong_type(path, "a list", value)
    return value


def as_str_list(ctx: Ctx, value: Any, path: str) -> list[str]:
    items = as_list(ctx, value, path)
    return [as_str(ctx, item, f"{path}[{i}]") for i, item in enumerate(items)]


def as_int_list(ctx: Ctx, value: Any, path: str, lo: int | None = None) -> list[int]:
    items = as_list(ctx, value, path)
    return [as_int(ctx, item, f"{path}[{i}]", lo=lo) for i, item in enumerate(items)]


def check_keys(ctx: Ctx, obj: dict[str, Any], path: str, allowed: Iterable[str]) -> None:
    valid = list(allowed)
    for key in obj:
        if key not in valid:
            ctx.unknown(path, key, valid)
