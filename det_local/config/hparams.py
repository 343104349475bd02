"""Hyperparameter definitions (expconf `hyperparameters:`) and sampling.

A bare scalar, list or null is a const; an object with `type` is one of const, int, double, log,
categorical; an object without `type` is a nested group."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any, Union

from det_local.config import check
from det_local.config.check import Ctx, join
from det_local.suggest import did_you_mean

HP_TYPES = ("const", "int", "double", "log", "categorical")

_TYPE_ALIASES = {
    "float": "double",
    "uniform": "double",
    "real": "double",
    "integer": "int",
    "constant": "const",
    "fixed": "const",
    "choice": "categorical",
    "categorial": "categorical",
    "loguniform": "log",
    "log_uniform": "log",
}


@dataclass(frozen=True)
class ConstHP:
    val: Any

    def to_dict(self) -> dict[str, Any]:
        return {"type": "const", "val": copy.deepcopy(self.val)}

    def sample(self, rng: random.Random) -> Any:
        return copy.deepcopy(self.val)


@dataclass(frozen=True)
class IntHP:
    minval: int
    maxval: int
    count: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return _with_count(
            {"type": "int", "minval": self.minval, "maxval": self.maxval}, self.count
        )

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.minval, self.maxval)


@dataclass(frozen=True)
class DoubleHP:
    minval: float
    maxval: float
    count: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"type": "double", "minval": self.minval, "maxval": self.maxval}
        return _with_count(out, self.count)

    def sample(self, rng: random.Random) -> float:
        return rng.uniform(self.minval, self.maxval)


@dataclass(frozen=True)
class LogHP:
    minval: float
    maxval: float
    base: float
    count: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"type": "log", "minval": self.minval, "maxval": self.maxval, "base": self.base}
        return _with_count(out, self.count)

    def sample(self, rng: random.Random) -> float:
        return float(self.base ** rng.uniform(self.minval, self.maxval))


@dataclass(frozen=True)
class CategoricalHP:
    vals: list[Any]

    def to_dict(self) -> dict[str, Any]:
        return {"type": "categorical", "vals": copy.deepcopy(self.vals)}

    def sample(self, rng: random.Random) -> Any:
        return copy.deepcopy(rng.choice(self.vals))


@dataclass(frozen=True)
class NestedHP:
    hps: dict[str, Hyperparameter]

    def to_dict(self) -> dict[str, Any]:
        return {name: hp.to_dict() for name, hp in self.hps.items()}

    def sample(self, rng: random.Random) -> dict[str, Any]:
        return sample_hparams(self.hps, rng)


Hyperparameter = Union[ConstHP, IntHP, DoubleHP, LogHP, CategoricalHP, NestedHP]


def _with_count(out: dict[str, Any], count: int | None) -> dict[str, Any]:
    if count is not None:
        out["count"] = count
    return out


def sample_hparams(hps: dict[str, Hyperparameter], rng: random.Random) -> dict[str, Any]:
    """One value per hyperparameter, names in sorted order (as Determined's master does)."""
    return {name: hps[name].sample(rng) for name in sorted(hps)}


def hparams_to_dict(hps: dict[str, Hyperparameter]) -> dict[str, Any]:
    return {name: hp.to_dict() for name, hp in hps.items()}


def flat_hparams(
    hps: dict[str, Hyperparameter], prefix: str = ""
) -> list[tuple[str, Hyperparameter]]:
    """Every hyperparameter that is not a group, nested ones under dotted names ("model.width"),
    as trial hyperparameters are flattened for display (det_local.tables.flatten)."""
    out: list[tuple[str, Hyperparameter]] = []
    for name, hp in hps.items():
        if isinstance(hp, NestedHP):
            out += flat_hparams(hp.hps, f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", hp))
    return out


# -- parsing ---------------------------------------------------------------------------------

_FIELDS = {
    "const": ("type", "val"),
    "int": ("type", "minval", "maxval", "count"),
    "double": ("type", "minval", "maxval", "count"),
    "log": ("type", "minval", "maxval", "base", "count"),
    "categorical": ("type", "vals"),
}

_REQUIRED = {
    "const": ("val",),
    "int": ("minval", "maxval"),
    "double": ("minval", "maxval"),
    "log": ("minval", "maxval", "base"),
    "categorical": ("vals",),
}

_EXAMPLES = {
    "val": "val: 0.01",
    "minval": "minval: 1",
    "maxval": "maxval: 10",
    "base": "base: 10",
    "vals": "vals: [sgd, adam]",
}


def parse_hyperparameters(ctx: Ctx, raw: Any, path: str = "hyperparameters") -> dict[str, Any]:
    if raw is None:
        return {}
    obj = check.as_mapping(ctx, raw, path, example="{lr: 0.01}")
    return {name: parse_hp(ctx, value, join(path, name)) for name, value in obj.items()}


def parse_hp(ctx: Ctx, value: Any, path: str) -> Hyperparameter:
    if not isinstance(value, dict):
        return ConstHP(copy.deepcopy(value))
    check.as_mapping(ctx, value, path)
    if "type" not in value:
        return NestedHP({k: parse_hp(ctx, v, join(path, k)) for k, v in value.items()})
    kind = value["type"]
    if kind not in HP_TYPES:
        hint = did_you_mean(kind, HP_TYPES, _TYPE_ALIASES)
        if hint.startswith(";"):
            hint = f"{hint} (valid: {', '.join(HP_TYPES)})"
        ctx.fail(
            join(path, "type"),
            f"unknown hyperparameter type {check.found(kind)}{hint}; "
            "to nest a hyperparameter named 'type', write 'type: {type: const, val: ...}'",
        )
    for key in value:
        if key not in _FIELDS[kind]:
            ctx.unknown(path, key, _FIELDS[kind])
    for key in _REQUIRED[kind]:
        if key not in value or (key != "val" and value[key] is None):
            ctx.missing(
                join(path, key), f"a '{kind}' hyperparameter needs it, e.g. '{_EXAMPLES[key]}'"
            )
    count = _count(ctx, value, path)
    if kind == "const":
        return ConstHP(copy.deepcopy(value["val"]))
    if kind == "categorical":
        vals = value["vals"]
        if not isinstance(vals, list) or not vals:
            ctx.fail(
                join(path, "vals"),
                f"expected a non-empty list of values, found {check.found(vals)}",
            )
        return CategoricalHP(copy.deepcopy(vals))
    if kind == "int":
        hint = "; use type: double for a real-valued range"
        lo = check.as_int(ctx, value["minval"], join(path, "minval"), hint=hint)
        hi = check.as_int(ctx, value["maxval"], join(path, "maxval"), hint=hint)
        _check_order(ctx, path, lo, hi)
        return IntHP(lo, hi, count)
    flo = check.as_number(ctx, value["minval"], join(path, "minval"))
    fhi = check.as_number(ctx, value["maxval"], join(path, "maxval"))
    _check_order(ctx, path, flo, fhi)
    if kind == "double":
        return DoubleHP(flo, fhi, count)
    base = check.as_number(ctx, value["base"], join(path, "base"), lo=0, lo_exclusive=True)
    return LogHP(flo, fhi, base, count)


def _count(ctx: Ctx, value: dict[str, Any], path: str) -> int | None:
    if value.get("count") is None:
        return None
    return check.as_int(ctx, value["count"], join(path, "count"), lo=1)


def _check_order(ctx: Ctx, path: str, lo: float, hi: float) -> None:
    if not lo < hi:
        ctx.fail(
            join(path, "minval"),
            f"must be less than maxval ({check.shown(hi)}), found {check.shown(lo)}; "
            "swap them, or use type: const for a single value",
        )


def check_grid_counts(
    ctx: Ctx, hps: dict[str, Hyperparameter], path: str = "hyperparameters"
) -> None:
    """With searcher.name grid every int/double/log hyperparameter (at any depth) needs `count`."""
    for name, hp in hps.items():
        where = join(path, name)
        if isinstance(hp, NestedHP):
            check_grid_counts(ctx, hp.hps, where)
        elif isinstance(hp, (IntHP, DoubleHP, LogHP)) and hp.count is None:
            ctx.missing(
                join(where, "count"),
                "searcher.name is grid, so every int/double/log hyperparameter needs the number "
                "of grid points, e.g. 'count: 3'",
            )
