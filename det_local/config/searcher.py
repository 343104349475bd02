"""`searcher:` — single, random, grid, adaptive_asha, async_halving (both 0.37 and 0.38 shapes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from det_local.config import check, fields
from det_local.config.check import Ctx, join
from det_local.config.units import Length, parse_length
from det_local.suggest import closest

SEARCHERS = ("single", "random", "grid", "adaptive_asha", "async_halving")

# Searchers Determined still parses but no longer runs, and what to use instead.
REMOVED = {
    "custom": "custom searchers were removed in Determined 0.38; use adaptive_asha, random or grid",
    "adaptive": "the 'adaptive' searcher reached end of life; use adaptive_asha",
    "adaptive_simple": "the 'adaptive_simple' searcher reached end of life; use adaptive_asha",
    "sync_halving": "the 'sync_halving' searcher reached end of life; use async_halving",
    "pbt": "the 'pbt' searcher was removed from Determined; use adaptive_asha or random",
}
_ALIASES = {"asha": "async_halving' (plain ASHA) or 'adaptive_asha", "hyperband": "adaptive_asha"}

_COMMON = ("name", "metric", "smaller_is_better", "source_trial_id", "source_checkpoint_uuid")

# Fields each searcher takes besides the common ones (Determined's per-searcher schemas).
FIELDS: dict[str, tuple[str, ...]] = {
    "single": ("max_length",),
    "random": ("max_trials", "max_concurrent_trials", "max_length"),
    "grid": ("max_concurrent_trials", "max_length"),
    "adaptive_asha": (
        "max_trials",
        "bracket_rungs",
        "time_metric",
        "max_time",
        "mode",
        "divisor",
        "max_rungs",
        "max_concurrent_trials",
        "max_length",
        "stop_once",
    ),
    "async_halving": (
        "num_rungs",
        "max_trials",
        "divisor",
        "max_concurrent_trials",
        "time_metric",
        "max_time",
        "max_length",
        "stop_once",
    ),
}

SPEC: fields.Spec = {
    "metric": fields.str_(),
    "smaller_is_better": fields.bool_(True),
    "source_trial_id": fields.int_(),
    "source_checkpoint_uuid": fields.str_(),
    "max_trials": fields.int_(lo=1),
    "max_concurrent_trials": fields.int_(16, lo=0),
    "time_metric": fields.str_(),
    "max_time": fields.int_(lo=1),
    "mode": fields.enum("standard", "aggressive", "standard", "conservative"),
    "divisor": fields.number(4.0, lo=1, exclusive=True),
    "max_rungs": fields.int_(5, lo=1),
    "bracket_rungs": fields.int_list([], lo=1),
    "num_rungs": fields.int_(lo=1),
    "stop_once": fields.bool_(),
}

_ALL_FIELDS = (
    set(_COMMON)
    | {f for fs in FIELDS.values() for f in fs}
    | {
        "budget",
        "train_stragglers",
        "unit",
    }
)


@dataclass(frozen=True)
class SearcherConfig:
    """A filled-in searcher. Fields a searcher does not take are None (or empty)."""

    name: str
    metric: str
    smaller_is_better: bool = True
    max_length: Length | None = None
    max_trials: int | None = None
    max_concurrent_trials: int | None = None
    time_metric: str | None = None
    max_time: int | None = None
    mode: str | None = None
    divisor: float | None = None
    max_rungs: int | None = None
    bracket_rungs: tuple[int, ...] = ()
    num_rungs: int | None = None
    stop_once: bool | None = None
    source_trial_id: int | None = None
    source_checkpoint_uuid: str | None = None

    @property
    def is_asha(self) -> bool:
        return self.name in ("adaptive_asha", "async_halving")

    def asha_budget(self) -> tuple[str, int] | None:
        """(time metric, maximum) that ASHA rungs are measured in, as Determined's Length():
        time_metric/max_time when both are set, else the legacy max_length (its unit, or
        "unitless" for a bare int). None for other searchers or when neither is set."""
        if self.time_metric is not None and self.max_time is not None:
            return self.time_metric, self.max_time
        if self.max_length is not None:
            return self.max_length.unit or "unitless", self.max_length.value
        return None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "metric": self.metric,
            "smaller_is_better": self.smaller_is_better,
            "source_trial_id": self.source_trial_id,
            "source_checkpoint_uuid": self.source_checkpoint_uuid,
        }
        for name in FIELDS[self.name]:
            value = getattr(self, name)
            if name == "max_length":
                value = None if value is None else value.to_dict()
            elif name == "bracket_rungs":
                value = list(value)
            out[name] = value
        return out


def parse_searcher(ctx: Ctx, raw: Any, path: str = "searcher") -> SearcherConfig:
    if raw is None:
        ctx.missing(path, "add e.g. 'searcher: {name: single, metric: validation_loss}'")
    obj = check.as_mapping(ctx, raw, path, example="{name: single, metric: validation_loss}")
    name = _parse_name(ctx, obj.get("name"), join(path, "name"))
    allowed = _COMMON + FIELDS[name]
    for key in obj:
        if key not in allowed:
            _reject_field(ctx, path, key, name, allowed)

    values = {
        key: fields.parse_value(ctx, obj.get(key), join(path, key), SPEC[key])
        for key in allowed
        if key in SPEC
    }
    if values["metric"] is None or not values["metric"].strip():
        ctx.missing(
            join(path, "metric"),
            "add the name of the validation metric the searcher optimises, "
            "e.g. 'metric: validation_loss'",
        )
    max_length = None
    if obj.get("max_length") is not None:
        # async_halving takes a positive length object only; the others also a bare int >= 0.
        bare = name != "async_halving"
        max_length = parse_length(
            ctx, obj["max_length"], join(path, "max_length"), minimum=1, allow_bare=bare
        )
        ctx.deprecated(
            join(path, "max_length"),
            "deprecated in Determined 0.38 (still honoured); the trial decides its length, "
            "or ASHA uses time_metric/max_time",
        )
    if obj.get("stop_once") is not None:
        ctx.warn(join(path, "stop_once"), "deprecated in Determined 0.38 and ignored by ASHA")
    _check_required(ctx, path, name, values, max_length)
    if "bracket_rungs" in values:
        values["bracket_rungs"] = tuple(values["bracket_rungs"])
    return SearcherConfig(name=name, max_length=max_length, **values)


def _parse_name(ctx: Ctx, name: Any, path: str) -> str:
    valid = ", ".join(SEARCHERS)
    if name is None:
        ctx.missing(path, f"add e.g. 'name: single' (one of {valid})")
    if not isinstance(name, str):
        ctx.wrong_type(path, f"one of {valid}", name)
    if name in SEARCHERS:
        return name
    if name in REMOVED:
        ctx.fail(path, f"{REMOVED[name]}; det-local runs only {valid}")
    guess = closest(name, SEARCHERS, _ALIASES)
    hint = f"; did you mean '{guess}'?" if guess else ""
    ctx.fail(path, f"unknown searcher {check.found(name)}{hint} (valid: {valid})")


def _reject_field(ctx: Ctx, path: str, key: str, name: str, allowed: tuple[str, ...]) -> None:
    if key not in _ALL_FIELDS:
        ctx.unknown(path, key, allowed)
    takers = [s for s in SEARCHERS if key in FIELDS[s]]
    others = f" (it belongs to {', '.join(takers)})" if takers else ""
    ctx.fail(
        join(path, key),
        f"the '{name}' searcher does not take {key}{others}; remove it "
        f"(fields of '{name}': {', '.join(allowed)})",
    )


def _check_required(
    ctx: Ctx, path: str, name: str, values: dict[str, Any], max_length: Length | None
) -> None:
    if name in ("random", "adaptive_asha", "async_halving") and values.get("max_trials") is None:
        ctx.missing(
            join(path, "max_trials"),
            f"the {name} searcher needs the number of trials to create, e.g. 'max_trials: 16'",
        )
    if name == "async_halving" and values.get("num_rungs") is None:
        ctx.missing(
            join(path, "num_rungs"), "async_halving needs the number of rungs, e.g. 'num_rungs: 3'"
        )
    if name not in ("adaptive_asha", "async_halving"):
        return
    has_metric = values["time_metric"] is not None
    has_time = values["max_time"] is not None
    if has_metric and not has_time:
        ctx.missing(
            join(path, "max_time"),
            f"time_metric is set to '{values['time_metric']}', so add the value of that metric at "
            "which a trial is complete, e.g. 'max_time: 1000'",
        )
    if has_time and not has_metric:
        ctx.missing(
            join(path, "time_metric"),
            "max_time is set, so add the validation metric that measures training progress, "
            "e.g. 'time_metric: batches' (report it with every validation)",
        )
    if not has_metric and max_length is None:
        ctx.missing(
            join(path, "max_time"),
            f"{name} needs time_metric and max_time (Determined 0.38), e.g. "
            "'time_metric: batches' and 'max_time: 1000', "
            "or the older 'max_length: {batches: 1000}'",
        )
