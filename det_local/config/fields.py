"""A small field-spec table per config section: type, default, bounds.

`parse_fields` checks a section's keys against its table (unknown keys are errors with a
did-you-mean), validates each value and fills defaults; null means "use the default"."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from det_local.config import check
from det_local.config.check import Ctx, join


@dataclass(frozen=True)
class Field:
    kind: str  # int | number | str | bool | enum | str_list | int_list | mapping | list | any
    default: Any = None
    lo: float | None = None
    hi: float | None = None
    lo_exclusive: bool = False
    choices: tuple[Any, ...] = ()


def int_(default: int | None = None, lo: int | None = None, hi: int | None = None) -> Field:
    return Field("int", default, lo, hi)


def number(default: float | None = None, lo: float | None = None, exclusive: bool = False) -> Field:
    return Field("number", default, lo, None, exclusive)


def str_(default: str | None = None) -> Field:
    return Field("str", default)


def bool_(default: bool | None = None) -> Field:
    return Field("bool", default)


def enum(default: Any, *choices: Any) -> Field:
    return Field("enum", default, choices=choices)


def str_list(default: list[str] | None = None) -> Field:
    return Field("str_list", default)


def int_list(default: list[int] | None = None, lo: int | None = None) -> Field:
    return Field("int_list", default, lo)


def mapping(default: dict[str, Any] | None = None) -> Field:
    return Field("mapping", default)


def any_(default: Any = None) -> Field:
    return Field("any", default)


Spec = Mapping[str, Field]


def parse_value(ctx: Ctx, value: Any, path: str, spec: Field) -> Any:
    """One value against its spec; null gives (a copy of) the default."""
    if value is None:
        return copy.deepcopy(spec.default)
    kind = spec.kind
    if kind == "int":
        lo = None if spec.lo is None else int(spec.lo)
        hi = None if spec.hi is None else int(spec.hi)
        return check.as_int(ctx, value, path, lo=lo, hi=hi)
    if kind == "number":
        return check.as_number(ctx, value, path, lo=spec.lo, lo_exclusive=spec.lo_exclusive)
    if kind == "str":
        return check.as_str(ctx, value, path)
    if kind == "bool":
        return check.as_bool(ctx, value, path)
    if kind == "enum":
        return check.as_enum(ctx, value, path, spec.choices)
    if kind == "str_list":
        return check.as_str_list(ctx, value, path)
    if kind == "int_list":
        return check.as_int_list(ctx, value, path, lo=None if spec.lo is None else int(spec.lo))
    if kind == "mapping":
        return copy.deepcopy(check.as_mapping(ctx, value, path))
    if kind == "list":
        return copy.deepcopy(check.as_list(ctx, value, path))
    return copy.deepcopy(value)


def section(ctx: Ctx, raw: Any, path: str) -> dict[str, Any]:
    """A section's mapping (null -> empty)."""
    if raw is None:
        return {}
    return check.as_mapping(ctx, raw, path)


def parse_fields(ctx: Ctx, raw: Any, path: str, spec: Spec) -> dict[str, Any]:
    """Validate a whole fixed-schema section: unknown keys, types, bounds, defaults."""
    obj = section(ctx, raw, path)
    check.check_keys(ctx, obj, path, spec)
    return {name: parse_value(ctx, obj.get(name), join(path, name), f) for name, f in spec.items()}
