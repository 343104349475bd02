"""Searchers: pure state machines that decide which trials run and for how long."""

from __future__ import annotations

from typing import Any

from det_local.errors import NotSupportedYet
from det_local.search.base import Searcher
from det_local.search.single import SingleSearch


def make_searcher(cfg: Any) -> Searcher:
    """The searcher for an ExperimentConfig."""
    from det_local.config import sample_hparams

    s = cfg.searcher
    max_length = s.max_length.value if s.max_length is not None else None
    if s.name == "single":
        method = SingleSearch(max_length)
    else:
        raise NotSupportedYet(
            f"searcher.name '{s.name}' is not supported by this det-local version yet; "
            "use searcher.name: single"
        )
    warm = s.source_checkpoint_uuid

    def sample(rng: Any) -> dict[str, Any]:
        return sample_hparams(cfg.hyperparameters, rng)

    return Searcher(method, sample, cfg.reproducibility.experiment_seed, warm)


__all__ = ["Searcher", "make_searcher"]
