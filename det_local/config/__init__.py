"""The experiment config (Determined expconf v0): load, validate with field paths, fill defaults.

cfg = load_config("const.yaml")       # or parse_config(raw_dict, source="...")
cfg.searcher.metric, cfg.resources.slots_per_trial, cfg.to_dict()
"""

from det_local.config.environment import EnvironmentConfig
from det_local.config.experiment import ExperimentConfig, default_name, parse_config
from det_local.config.hparams import (
    CategoricalHP,
    ConstHP,
    DoubleHP,
    Hyperparameter,
    IntHP,
    LogHP,
    NestedHP,
    sample_hparams,
)
from det_local.config.load import load_config, load_yaml
from det_local.config.resources import DEFAULT_PRIORITY, ResourcesConfig, memory_bytes
from det_local.config.searcher import SEARCHERS, SearcherConfig
from det_local.config.sections import (
    BindMount,
    OptimizationsConfig,
    ProfilingConfig,
    ReproducibilityConfig,
)
from det_local.config.storage import CheckpointStorageConfig
from det_local.config.testmode import make_test_config
from det_local.config.units import UNITS, Length, Unit
from det_local.errors import ConfigError

__all__ = [
    "DEFAULT_PRIORITY",
    "SEARCHERS",
    "UNITS",
    "BindMount",
    "CategoricalHP",
    "CheckpointStorageConfig",
    "ConfigError",
    "ConstHP",
    "DoubleHP",
    "EnvironmentConfig",
    "ExperimentConfig",
    "Hyperparameter",
    "IntHP",
    "Length",
    "LogHP",
    "NestedHP",
    "OptimizationsConfig",
    "ProfilingConfig",
    "ReproducibilityConfig",
    "ResourcesConfig",
    "SearcherConfig",
    "Unit",
    "default_name",
    "load_config",
    "load_yaml",
    "make_test_config",
    "memory_bytes",
    "parse_config",
    "sample_hparams",
]
