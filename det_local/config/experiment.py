"""The whole experiment config: `parse_config` validates a dict and fills Determined's defaults."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from det_local.config import check, fields, limits, sections
from det_local.config.check import Ctx
from det_local.config.environment import EnvironmentConfig, parse_environment
from det_local.config.hparams import (
    ConstHP,
    Hyperparameter,
    check_grid_counts,
    hparams_to_dict,
    parse_hyperparameters,
)
from det_local.config.ignored import EXCLUDE_NODE, INSTEAD
from det_local.config.resources import ResourcesConfig, parse_resources
from det_local.config.searcher import SearcherConfig, parse_searcher
from det_local.config.storage import CheckpointStorageConfig, parse_checkpoint_storage
from det_local.config.units import Length, parse_length

LEGACY_TRIAL_RE = re.compile(r"^[a-zA-Z0-9_.]+:[a-zA-Z0-9_]+$")

# Top-level scalar fields (the sections have parsers of their own).
SCALARS: fields.Spec = {
    "name": fields.str_(),
    "description": fields.str_(),
    "labels": fields.str_list([]),
    "data": fields.mapping({}),
    "max_restarts": fields.int_(5, lo=0),
    "checkpoint_policy": fields.enum("best", "best", "all", "none"),
    "perform_initial_validation": fields.bool_(False),
    "scheduling_unit": fields.int_(100, lo=1),
    "records_per_epoch": fields.int_(0, lo=0),
    "debug": fields.bool_(False),
    "workspace": fields.str_(""),
    "project": fields.str_(""),
    "preemption_timeout": fields.int_(lo=0),
}

SECTIONS = (
    "entrypoint",
    "hyperparameters",
    "searcher",
    "min_validation_period",
    "min_checkpoint_period",
    "checkpoint_storage",
    "resources",
    "environment",
    "bind_mounts",
    "reproducibility",
    "optimizations",
    "profiling",
    "log_policies",
    "retention_policy",
    "security",
    "tensorboard_storage",
    "integrations",
    "slurm",
    "pbs",
    "data_layer",
    "internal",
)
TOP_LEVEL = (*SCALARS, *SECTIONS)

# Fields deprecated by Determined 0.38 that det-local still honours.
_DEPRECATED_038 = (
    "min_validation_period",
    "min_checkpoint_period",
    "scheduling_unit",
    "optimizations",
)


@dataclass(frozen=True)
class ExperimentConfig:
    """A validated experiment config with Determined's defaults filled in."""

    name: str
    entrypoint: str | list[str] | None
    searcher: SearcherConfig
    hyperparameters: dict[str, Hyperparameter]
    reproducibility: sections.ReproducibilityConfig
    description: str | None = None
    labels: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    debug: bool = False
    max_restarts: int = 5
    min_validation_period: Length = Length.batches(0)
    min_checkpoint_period: Length = Length.batches(0)
    checkpoint_policy: str = "best"
    perform_initial_validation: bool = False
    scheduling_unit: int = 100
    records_per_epoch: int = 0
    checkpoint_storage: CheckpointStorageConfig | None = None
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    bind_mounts: list[sections.BindMount] = field(default_factory=list)
    optimizations: sections.OptimizationsConfig = field(
        default_factory=sections.OptimizationsConfig
    )
    profiling: sections.ProfilingConfig = field(default_factory=sections.ProfilingConfig)
    preemption_timeout: int | None = None
    log_policies: list[dict[str, Any]] = field(default_factory=list)
    retention_policy: dict[str, Any] | None = None
    workspace: str = ""
    project: str = ""
    security: dict[str, Any] | None = None
    tensorboard_storage: dict[str, Any] | None = None
    integrations: dict[str, Any] | None = None
    slurm: dict[str, Any] | None = None
    pbs: dict[str, Any] | None = None
    data_layer: dict[str, Any] | None = None
    internal: Any = None
    # Deprecations and ignored settings noticed while validating (not part of the config).
    warnings: tuple[str, ...] = field(default=(), compare=False)
    deprecations: tuple[str, ...] = field(default=(), compare=False)

    @property
    def entrypoint_is_legacy_trial(self) -> bool:
        """True for the legacy `module:TrialClass` form (run through the Trial harness)."""
        return isinstance(self.entrypoint, str) and bool(LEGACY_TRIAL_RE.match(self.entrypoint))

    @property
    def global_batch_size(self) -> int | None:
        """`hyperparameters.global_batch_size` when it is a constant integer."""
        hp = self.hyperparameters.get("global_batch_size")
        if isinstance(hp, ConstHP) and check.is_int(hp.val):
            return int(hp.val)
        return None

    def to_dict(self) -> dict[str, Any]:
        """The filled-in config in Determined's expconf shape (what trials get as
        DET_EXPERIMENT_CONFIG); parse_config(cfg.to_dict()).to_dict() == cfg.to_dict()."""
        out: dict[str, Any] = {name: copy.deepcopy(getattr(self, name)) for name in SCALARS}
        out.update(
            {
                "entrypoint": copy.deepcopy(self.entrypoint),
                "hyperparameters": hparams_to_dict(self.hyperparameters),
                "searcher": self.searcher.to_dict(),
                "min_validation_period": self.min_validation_period.to_dict(),
                "min_checkpoint_period": self.min_checkpoint_period.to_dict(),
                "checkpoint_storage": (
                    None if self.checkpoint_storage is None else self.checkpoint_storage.to_dict()
                ),
                "resources": self.resources.to_dict(),
                "environment": self.environment.to_dict(),
                "bind_mounts": [m.to_dict() for m in self.bind_mounts],
                "reproducibility": self.reproducibility.to_dict(),
                "optimizations": self.optimizations.to_dict(),
                "profiling": self.profiling.to_dict(),
            }
        )
        for name in SECTIONS:
            if name not in out:
                out[name] = copy.deepcopy(getattr(self, name))
        return out


def default_name(entrypoint: str | list[str] | None) -> str:
    """`Experiment (<what it runs>)`: the Trial class, the script or module, or the command."""
    if isinstance(entrypoint, str):
        if LEGACY_TRIAL_RE.match(entrypoint):
            return f"Experiment ({entrypoint.split(':')[1]})"
        try:
            argv = shlex.split(entrypoint)
        except ValueError:
            argv = entrypoint.split()
    else:
        argv = list(entrypoint or [])
    subject = _subject(argv)
    return f"Experiment ({subject})" if subject else "Experiment"


def _subject(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--trial" and i + 1 < len(argv):
            return argv[i + 1].split(":")[-1]
        if arg.endswith(".py") or arg.endswith(".sh"):
            return arg.rsplit("/", 1)[-1]
    modules = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "-m"]
    user = [m for m in modules if not m.startswith("determined.launch")]
    if user:
        return user[-1]
    return argv[0].rsplit("/", 1)[-1] if argv else ""


def _entrypoint(ctx: Ctx, value: Any) -> str | list[str]:
    example = "add e.g. 'entrypoint: python3 train.py'"
    if value is None:
        ctx.missing("entrypoint", example)
    if isinstance(value, list):
        items = check.as_str_list(ctx, value, "entrypoint")
        if not items:
            ctx.fail("entrypoint", f"must not be an empty list; {example}")
        return items
    if not isinstance(value, str):
        ctx.wrong_type("entrypoint", "a command string or a list of strings", value)
    if not value.strip():
        ctx.fail("entrypoint", f"must not be empty; {example}")
    return value


def parse_config(raw: dict[str, Any], source: str = "<config>") -> ExperimentConfig:
    """Validate an already-parsed config dict and fill in defaults. Raises ConfigError."""
    ctx = Ctx(source)
    if not isinstance(raw, dict):
        ctx.wrong_type("config", "a mapping of config fields", raw)
    limits.check_depth(raw, source)  # before anything below recurses into it
    obj = json_keys(raw)
    check.check_keys(ctx, obj, "", TOP_LEVEL)
    values = {k: fields.parse_value(ctx, obj.get(k), k, spec) for k, spec in SCALARS.items()}
    entrypoint = _entrypoint(ctx, obj.get("entrypoint"))
    searcher = parse_searcher(ctx, obj.get("searcher"))
    hps = parse_hyperparameters(ctx, obj.get("hyperparameters"))
    if searcher.name == "grid":
        check_grid_counts(ctx, hps)
    if values["name"] is None:
        values["name"] = default_name(entrypoint)
    values["labels"] = list(dict.fromkeys(values["labels"]))  # a set, in first-seen order
    parts: dict[str, Any] = {
        "min_validation_period": _period(ctx, obj, "min_validation_period"),
        "min_checkpoint_period": _period(ctx, obj, "min_checkpoint_period"),
        "checkpoint_storage": parse_checkpoint_storage(ctx, obj.get("checkpoint_storage")),
        "resources": parse_resources(ctx, obj.get("resources")),
        "environment": parse_environment(ctx, obj.get("environment")),
        "bind_mounts": sections.parse_bind_mounts(ctx, obj.get("bind_mounts")),
        "reproducibility": sections.parse_reproducibility(ctx, obj.get("reproducibility")),
        "optimizations": sections.parse_optimizations(ctx, obj.get("optimizations")),
        "profiling": sections.parse_profiling(ctx, obj.get("profiling")),
        "log_policies": sections.parse_log_policies(ctx, obj.get("log_policies")),
        "retention_policy": sections.parse_fixed(
            ctx, obj.get("retention_policy"), "retention_policy", sections.RETENTION
        ),
        "security": sections.parse_security(ctx, obj.get("security")),
        "tensorboard_storage": _ignored_mapping(ctx, obj, "tensorboard_storage"),
        "integrations": sections.parse_integrations(ctx, obj.get("integrations")),
        "slurm": sections.parse_fixed(ctx, obj.get("slurm"), "slurm", sections.SLURM),
        "pbs": sections.parse_fixed(ctx, obj.get("pbs"), "pbs", sections.PBS),
        "data_layer": _ignored_mapping(ctx, obj, "data_layer"),
        "internal": obj.get("internal"),
    }
    cfg = ExperimentConfig(
        entrypoint=entrypoint, searcher=searcher, hyperparameters=hps, **parts, **values
    )
    _warn_deprecated(ctx, cfg)
    warn_ignored(ctx, cfg)
    return dataclasses.replace(
        cfg, warnings=tuple(ctx.warnings), deprecations=tuple(ctx.deprecations)
    )


def json_keys(value: Any) -> Any:
    """A deep copy with mapping keys as JSON would write them (1 -> "1", true -> "true"), as
    Determined's CLI sends the YAML to the master as JSON."""
    if isinstance(value, dict):
        return {_json_key(k): json_keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_keys(v) for v in value]
    return copy.deepcopy(value)


def _json_key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, bool):
        return json.dumps(key)
    return str(key)


def _period(ctx: Ctx, obj: dict[str, Any], name: str) -> Length:
    value = obj.get(name)
    return Length.batches(0) if value is None else parse_length(ctx, value, name)


def _ignored_mapping(ctx: Ctx, obj: dict[str, Any], name: str) -> dict[str, Any] | None:
    value = obj.get(name)
    if value is None:
        return None
    ctx.warn(name, "no longer used by Determined; ignored")
    return copy.deepcopy(check.as_mapping(ctx, value, name))


def _warn_deprecated(ctx: Ctx, cfg: ExperimentConfig) -> None:
    """Deprecated (0.38) fields set to something other than their default."""
    defaults = {
        "min_validation_period": Length.batches(0),
        "min_checkpoint_period": Length.batches(0),
        "scheduling_unit": 100,
        "optimizations": sections.OptimizationsConfig(),
    }
    for name, default in defaults.items():
        if getattr(cfg, name) != default:
            ctx.deprecated(
                name, "deprecated in Determined 0.38 (used only by legacy Trial classes)"
            )
    if cfg.entrypoint_is_legacy_trial:
        ctx.deprecated(
            "entrypoint",
            "the 'module:TrialClass' form is deprecated in Determined 0.38; it still runs "
            "(through the torch_distributed launcher)",
        )


def warn_ignored(ctx: Ctx, cfg: ExperimentConfig) -> None:
    """One `ctx.warn` per key of INSTEAD the config sets, and per exclude_node log policy."""
    set_keys = {
        "bind_mounts": bool(cfg.bind_mounts),
        "resources.devices": bool(cfg.resources.devices),
        "resources.shm_size": cfg.resources.shm_size is not None,
        "environment.ports": bool(cfg.environment.ports),
        "environment.proxy_ports": bool(cfg.environment.proxy_ports),
    }
    for key in ("webhooks", "pachyderm"):
        set_keys[f"integrations.{key}"] = bool((cfg.integrations or {}).get(key))
    for key, is_set in set_keys.items():
        if is_set:
            ctx.warn(key, INSTEAD[key])
    for i, policy in enumerate(cfg.log_policies):
        action = policy.get("action")
        kind = action.get("type") if isinstance(action, dict) else action
        if kind == "exclude_node":
            ctx.warn(f"log_policies[{i}].action", EXCLUDE_NODE)
