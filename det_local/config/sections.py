"""The smaller sections: optimizations, profiling, reproducibility, bind_mounts, log_policies,
retention_policy, slurm, pbs, security, integrations (validated, mostly carried as-is)."""

from __future__ import annotations

import copy
import re
import time
from dataclasses import dataclass
from typing import Any

from det_local.config import check, fields
from det_local.config.check import Ctx, join

OPTIMIZATIONS: fields.Spec = {
    "aggregation_frequency": fields.int_(1, lo=1),
    "auto_tune_tensor_fusion": fields.bool_(False),
    "average_aggregated_gradients": fields.bool_(True),
    "average_training_metrics": fields.bool_(True),
    "gradient_compression": fields.bool_(False),
    "grad_updates_size_file": fields.str_(),
    "mixed_precision": fields.enum("O0", "O0", "O1", "O2", "O3"),
    "tensor_fusion_cycle_time": fields.int_(1, lo=0),
    "tensor_fusion_threshold": fields.int_(64, lo=0),
}

PROFILING: fields.Spec = {
    "enabled": fields.bool_(False),
    "begin_on_batch": fields.int_(0, lo=0),
    "end_after_batch": fields.int_(lo=0),
    "sync_timings": fields.bool_(True),
}

SLURM: fields.Spec = {
    "slots_per_node": fields.int_(lo=1),
    "gpu_type": fields.str_(),
    "sbatch_args": fields.str_list(),
}

PBS: fields.Spec = {"slots_per_node": fields.int_(lo=1), "pbsbatch_args": fields.str_list()}

RETENTION: fields.Spec = {"log_retention_days": fields.int_(lo=-1, hi=32767)}

_BIND_MOUNT: fields.Spec = {
    "host_path": fields.str_(),
    "container_path": fields.str_(),
    "read_only": fields.bool_(False),
    "propagation": fields.str_("rprivate"),
}

_LOG_POLICY: fields.Spec = {
    "name": fields.str_(),
    "pattern": fields.str_(),
    "action": fields.any_(),
}
_LOG_ACTIONS = ("cancel_retries", "exclude_node")


@dataclass(frozen=True)
class OptimizationsConfig:
    """Deprecated in Determined 0.38 (legacy Trial harness only)."""

    aggregation_frequency: int = 1
    auto_tune_tensor_fusion: bool = False
    average_aggregated_gradients: bool = True
    average_training_metrics: bool = True
    gradient_compression: bool = False
    grad_updates_size_file: str | None = None
    mixed_precision: str = "O0"
    tensor_fusion_cycle_time: int = 1
    tensor_fusion_threshold: int = 64

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in OPTIMIZATIONS}


@dataclass(frozen=True)
class ProfilingConfig:
    enabled: bool = False
    begin_on_batch: int = 0
    end_after_batch: int | None = None
    sync_timings: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in PROFILING}


@dataclass(frozen=True)
class ReproducibilityConfig:
    """`experiment_seed` seeds the searcher (hparam sampling, trial seeds)."""

    experiment_seed: int

    def to_dict(self) -> dict[str, Any]:
        return {"experiment_seed": self.experiment_seed}


@dataclass(frozen=True)
class BindMount:
    host_path: str
    container_path: str
    read_only: bool = False
    propagation: str = "rprivate"

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _BIND_MOUNT}


def parse_optimizations(ctx: Ctx, raw: Any, path: str = "optimizations") -> OptimizationsConfig:
    values = fields.parse_fields(ctx, raw, path, OPTIMIZATIONS)
    return OptimizationsConfig(**values)


def parse_profiling(ctx: Ctx, raw: Any, path: str = "profiling") -> ProfilingConfig:
    values = fields.parse_fields(ctx, raw, path, PROFILING)
    begin, end = values["begin_on_batch"], values["end_after_batch"]
    if end is not None and begin > end:
        ctx.fail(
            join(path, "end_after_batch"),
            f"must be >= begin_on_batch ({begin}), found {end}; profile an interval that "
            "begins before it ends",
        )
    return ProfilingConfig(**values)


def parse_reproducibility(
    ctx: Ctx, raw: Any, path: str = "reproducibility"
) -> ReproducibilityConfig:
    spec: fields.Spec = {"experiment_seed": fields.int_(lo=0)}
    values = fields.parse_fields(ctx, raw, path, spec)
    seed = values["experiment_seed"]
    # Determined's default: the current unix time, fixed when the experiment is created.
    return ReproducibilityConfig(int(time.time()) if seed is None else seed)


def parse_bind_mounts(ctx: Ctx, raw: Any, path: str = "bind_mounts") -> list[BindMount]:
    if raw is None:
        return []
    out = []
    for i, item in enumerate(check.as_list(ctx, raw, path)):
        where = f"{path}[{i}]"
        values = fields.parse_fields(ctx, item, where, _BIND_MOUNT)
        for key in ("host_path", "container_path"):
            if values[key] is None:
                ctx.missing(join(where, key), f"a bind mount needs it, e.g. '{key}: /data'")
        if not values["host_path"].startswith("/"):
            ctx.fail(
                join(where, "host_path"), f"must be an absolute path, found {values['host_path']!r}"
            )
        if values["container_path"] == ".":
            ctx.fail(join(where, "container_path"), "must not be '.'; name a directory")
        out.append(BindMount(**values))
    return out


def parse_log_policies(ctx: Ctx, raw: Any, path: str = "log_policies") -> list[dict[str, Any]]:
    """0.38 shape `{name, pattern, action: cancel_retries|exclude_node}` or the legacy
    `{pattern, action: {type: ...}}`; carried as given (with nulls filled)."""
    if raw is None:
        return []
    out = []
    for i, item in enumerate(check.as_list(ctx, raw, path)):
        where = f"{path}[{i}]"
        values = fields.parse_fields(ctx, item, where, _LOG_POLICY)
        action = values["action"]
        if isinstance(action, dict):
            check.check_keys(ctx, action, join(where, "action"), ("type",))
            check.as_enum(ctx, action.get("type"), join(where, "action.type"), _LOG_ACTIONS)
        elif action is not None:
            check.as_enum(ctx, action, join(where, "action"), _LOG_ACTIONS)
        if values["pattern"] is not None:
            try:
                re.compile(values["pattern"])
            except re.error as err:
                ctx.fail(
                    join(where, "pattern"),
                    f"is not a valid regular expression ({err}): {values['pattern']!r}",
                )
        if values["name"] is None and (values["pattern"] is None or action is None):
            ctx.missing(
                join(where, "name"),
                "a log policy needs a name (and a pattern unless it disables a default policy), "
                "e.g. '{name: oom, pattern: \".*CUDA out of memory.*\", action: cancel_retries}'",
            )
        out.append(values)
    return out


def parse_fixed(ctx: Ctx, raw: Any, path: str, spec: fields.Spec) -> dict[str, Any] | None:
    """A small fixed-schema section kept as a dict (slurm, pbs, retention_policy);
    null stays null."""
    if raw is None:
        return None
    return fields.parse_fields(ctx, raw, path, spec)


def parse_security(ctx: Ctx, raw: Any, path: str = "security") -> dict[str, Any] | None:
    if raw is None:
        return None
    obj = check.as_mapping(ctx, raw, path)
    check.check_keys(ctx, obj, path, ("kerberos",))
    kerberos = obj.get("kerberos")
    if kerberos is not None:
        where = join(path, "kerberos")
        k = check.as_mapping(ctx, kerberos, where)
        check.check_keys(ctx, k, where, ("config_file",))
        check.as_str(ctx, k.get("config_file"), join(where, "config_file"))
    return {"kerberos": copy.deepcopy(kerberos)}


def parse_integrations(ctx: Ctx, raw: Any, path: str = "integrations") -> dict[str, Any] | None:
    if raw is None:
        return None
    obj = check.as_mapping(ctx, raw, path)
    check.check_keys(ctx, obj, path, ("pachyderm", "webhooks"))
    out = {}
    for key in ("pachyderm", "webhooks"):
        value = obj.get(key)
        out[key] = (
            None if value is None else copy.deepcopy(check.as_mapping(ctx, value, join(path, key)))
        )
    return out
