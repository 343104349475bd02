"""Searchers: pure state machines that decide which trials run and for how long.

``make_searcher(cfg)`` picks the method for an ExperimentConfig:

* single, random, grid (``random_search``, ``grid``);
* async_halving and adaptive_asha (``asha``, ``asha_legacy``, ``adaptive``), in the generation
  the config asks for: with ``time_metric`` and ``max_time`` the 0.38 stopping-based search,
  driven by validation reports; otherwise (``max_length``) the <=0.37 operation-driven one,
  promotion-based, or stop-once with ``stop_once: true``.
"""

from __future__ import annotations

from typing import Any

from det_local.errors import ConfigError
from det_local.search.adaptive import Bracket, Tournament, make_brackets
from det_local.search.asha import AshaStopping, make_rungs
from det_local.search.asha_legacy import AshaPromotion, AshaStopOnce
from det_local.search.base import Searcher, SearchMethod
from det_local.search.grid import GridSearch
from det_local.search.random_search import RandomSearch, SingleSearch

# What Searcher.kind says, per generation of ASHA.
STOPPING = "stopping"  # 0.38: Stop actions decided on validation reports
PROMOTION = "promotion"  # <=0.37: ValidateAfter operations; paused trials resumed later
STOP_ONCE = "stop_once"  # <=0.37: ValidateAfter operations; Close when not continued


def asha_generation(cfg: Any) -> str | None:
    """STOPPING, PROMOTION or STOP_ONCE for an ASHA config; None for other searchers."""
    s = cfg.searcher
    if not s.is_asha:
        return None
    if s.time_metric is not None and s.max_time is not None:
        return STOPPING
    if s.max_length is None:
        raise ConfigError(
            f"searcher: {s.name} needs time_metric and max_time (or the older max_length)"
        )
    return STOP_ONCE if s.stop_once else PROMOTION


def brackets(cfg: Any) -> list[Bracket]:
    """The brackets an ASHA config runs (async_halving: one). Empty for other searchers."""
    s = cfg.searcher
    if not s.is_asha:
        return []
    budget = s.asha_budget()
    assert budget is not None
    divisor = float(s.divisor if s.divisor is not None else 4.0)
    mct = int(s.max_concurrent_trials if s.max_concurrent_trials is not None else 16)
    if s.name == "async_halving":
        return [Bracket(int(s.num_rungs), int(s.max_trials), mct)]
    return make_brackets(
        max_trials=int(s.max_trials),
        divisor=divisor,
        length=int(budget[1]),
        mode=s.mode or "standard",
        max_rungs=int(s.max_rungs if s.max_rungs is not None else 5),
        bracket_rungs=tuple(s.bracket_rungs or ()),
        max_concurrent_trials=mct,
    )


def plan(cfg: Any) -> dict[str, Any]:
    """What the searcher will do, for `config check` / describe (Determined's preview-search):
    `trials`, how many trials it creates at most (InvalidHP replacements aside) and
    `max_concurrent_trials`; for ASHA the generation, the time metric and each bracket with its
    trials and rung lengths; for grid its axes (dotted name, number of values)."""
    s = cfg.searcher
    out: dict[str, Any] = {"name": s.name, "metric": s.metric}
    out["smaller_is_better"] = s.smaller_is_better
    mct = s.max_concurrent_trials if s.max_concurrent_trials is not None else 16
    if s.is_asha:
        budget = s.asha_budget()
        assert budget is not None
        divisor = float(s.divisor if s.divisor is not None else 4.0)
        out["generation"] = asha_generation(cfg)
        out["time_metric"], out["max_time"] = budget
        out["divisor"] = divisor
        out["brackets"] = [
            {
                "num_rungs": b.num_rungs,
                "max_trials": b.max_trials,
                "max_concurrent_trials": b.max_concurrent_trials,
                "rungs": make_rungs(b.num_rungs, divisor, int(budget[1])),
            }
            for b in brackets(cfg)
        ]
        out["trials"] = sum(b["max_trials"] for b in out["brackets"])
    elif s.name == "grid":
        from det_local.search.hparams_grid import grid_axes, grid_size

        axes = grid_axes(cfg.hyperparameters)
        out["trials"] = grid_size(axes)
        out["grid"] = [
            {"name": ".".join(route), "values": len(values)}
            for route, values in axes
            if len(values) > 1
        ]
    elif s.name == "random":
        out["trials"] = s.max_trials
    else:
        out["trials"] = 1
        mct = 1
    out["max_concurrent_trials"] = mct  # 0: no limit
    if not s.is_asha and s.max_length is not None:
        out["max_length"] = s.max_length.to_dict()
    return out


def make_method(cfg: Any) -> tuple[SearchMethod, str]:
    """The search method for an ExperimentConfig and its kind."""
    s = cfg.searcher
    max_length = s.max_length.value if s.max_length is not None else None
    mct = int(s.max_concurrent_trials if s.max_concurrent_trials is not None else 16)
    if s.name == "single":
        return SingleSearch(max_length), "single"
    if s.name == "random":
        return RandomSearch(int(s.max_trials), mct, max_length), "random"
    if s.name == "grid":
        return GridSearch(cfg.hyperparameters, mct, max_length), "grid"
    if not s.is_asha:
        raise ConfigError(f"searcher.name: unknown searcher '{s.name}'")
    generation = asha_generation(cfg)
    budget = s.asha_budget()
    assert budget is not None and generation is not None
    divisor = float(s.divisor if s.divisor is not None else 4.0)
    subs: list[SearchMethod] = []
    for b in brackets(cfg):
        if generation == STOPPING:
            subs.append(
                AshaStopping(
                    num_rungs=b.num_rungs,
                    max_trials=b.max_trials,
                    divisor=divisor,
                    max_time=int(budget[1]),
                    time_metric=str(budget[0]),
                    metric=s.metric,
                    smaller_is_better=s.smaller_is_better,
                    max_concurrent_trials=b.max_concurrent_trials,
                )
            )
        else:
            kind = AshaStopOnce if generation == STOP_ONCE else AshaPromotion
            subs.append(
                kind(
                    num_rungs=b.num_rungs,
                    max_trials=b.max_trials,
                    divisor=divisor,
                    max_length=int(budget[1]),
                    smaller_is_better=s.smaller_is_better,
                    max_concurrent_trials=b.max_concurrent_trials,
                )
            )
    method: SearchMethod = subs[0] if s.name == "async_halving" else Tournament(subs)
    return method, generation


def make_searcher(cfg: Any) -> Searcher:
    """The searcher for an ExperimentConfig."""
    from det_local.config import sample_hparams

    method, kind = make_method(cfg)
    warm = cfg.searcher.source_checkpoint_uuid

    def sample(rng: Any) -> dict[str, Any]:
        return sample_hparams(cfg.hyperparameters, rng)

    return Searcher(method, sample, cfg.reproducibility.experiment_seed, warm, kind=kind)


__all__ = [
    "PROMOTION",
    "STOPPING",
    "STOP_ONCE",
    "Searcher",
    "asha_generation",
    "brackets",
    "make_method",
    "make_searcher",
    "plan",
]
