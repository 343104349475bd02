"""Determined's `--test` rewrite (`_make_test_experiment_config`): one short trial, no restarts."""

from __future__ import annotations

import random
import uuid

from det_local.config.experiment import ExperimentConfig, parse_config
from det_local.config.hparams import sample_hparams


def make_test_config(cfg: ExperimentConfig, rng: random.Random | None = None) -> ExperimentConfig:
    """The config `det e create --test` would run: description prefixed `[test-mode]`,
    scheduling_unit 1, min_validation_period 1 batch, every save_* 0, a single searcher on the
    same metric for 1 batch, hyperparameters replaced by one random sample, max_restarts 0."""
    rng = rng or random.Random()
    raw = cfg.to_dict()
    storage = raw["checkpoint_storage"] or {}
    raw.update(
        {
            "description": f"[test-mode] {cfg.description or uuid.uuid4()}",
            "scheduling_unit": 1,
            "min_validation_period": {"batches": 1},
            "checkpoint_storage": {
                **storage,
                "save_experiment_best": 0,
                "save_trial_best": 0,
                "save_trial_latest": 0,
            },
            "searcher": {
                "name": "single",
                "metric": cfg.searcher.metric,
                "max_length": {"batches": 1},
            },
            "hyperparameters": {
                name: {"type": "const", "val": value}
                for name, value in sample_hparams(cfg.hyperparameters, rng).items()
            },
            "max_restarts": 0,
        }
    )
    return parse_config(raw, f"{cfg.name} (test mode)")
