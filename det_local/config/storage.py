"""`checkpoint_storage:` — shared_fs and directory (s3/gcs/azure are checked, then refused)."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

from det_local.config import check, fields
from det_local.config.check import Ctx, join
from det_local.errors import ConfigError
from det_local.suggest import did_you_mean

SAVE_SPEC: fields.Spec = {
    "save_experiment_best": fields.int_(0, lo=0),
    "save_trial_best": fields.int_(1, lo=0),
    "save_trial_latest": fields.int_(1, lo=0),
}

TYPE_SPECS: dict[str, fields.Spec] = {
    "shared_fs": {
        "host_path": fields.str_(),
        "storage_path": fields.str_(),
        "propagation": fields.str_("rprivate"),
        "container_path": fields.str_(),
        "checkpoint_path": fields.str_(),
        "tensorboard_path": fields.str_(),
    },
    "directory": {"container_path": fields.str_()},
    "s3": {
        "bucket": fields.str_(),
        "access_key": fields.str_(),
        "secret_key": fields.str_(),
        "endpoint_url": fields.str_(),
        "prefix": fields.str_(),
    },
    "gcs": {"bucket": fields.str_(), "prefix": fields.str_()},
    "azure": {
        "container": fields.str_(),
        "connection_string": fields.str_(),
        "account_url": fields.str_(),
        "credential": fields.str_(),
    },
}
SUPPORTED = ("shared_fs", "directory")
# Legacy shared_fs fields Determined leaves out of its JSON when unset.
_OMIT_IF_NULL = ("container_path", "checkpoint_path", "tensorboard_path")


@dataclass(frozen=True)
class CheckpointStorageConfig:
    """`type` None: no type given, so det-local's default storage with these GC settings."""

    type: str | None
    save_experiment_best: int = 0
    save_trial_best: int = 1
    save_trial_latest: int = 1
    host_path: str | None = None
    storage_path: str | None = None
    propagation: str | None = None
    container_path: str | None = None
    checkpoint_path: str | None = None
    tensorboard_path: str | None = None

    @property
    def path(self) -> str | None:
        """Where checkpoints go on this machine: host_path/storage_path (shared_fs),
        container_path (directory), None for det-local's default location."""
        if self.type == "shared_fs" and self.host_path is not None:
            if self.storage_path is None:
                return self.host_path
            return posixpath.normpath(posixpath.join(self.host_path, self.storage_path))
        if self.type == "directory":
            return self.container_path
        return None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.type is not None:
            out["type"] = self.type
            for name in TYPE_SPECS[self.type]:
                value = getattr(self, name)
                if not (self.type == "shared_fs" and name in _OMIT_IF_NULL and value is None):
                    out[name] = value
        out.update({name: getattr(self, name) for name in SAVE_SPEC})
        return out


def parse_checkpoint_storage(
    ctx: Ctx, raw: Any, path: str = "checkpoint_storage"
) -> CheckpointStorageConfig | None:
    if raw is None:
        return None
    obj = check.as_mapping(ctx, raw, path, example="{type: shared_fs, host_path: /data/ckpt}")
    kind = obj.get("type")
    if kind is None:
        kind = "shared_fs" if obj.get("host_path") is not None else None
    elif kind not in TYPE_SPECS:
        valid = ", ".join(TYPE_SPECS)
        hint = did_you_mean(kind, TYPE_SPECS)
        hint = hint if hint.startswith(";") else ""
        ctx.fail(join(path, "type"), f"expected one of {valid}, found {check.found(kind)}{hint}")
    spec = {**SAVE_SPEC, **(TYPE_SPECS[kind] if kind else {})}
    body = {k: v for k, v in obj.items() if k != "type"}
    if kind is None:
        for key in body:
            if key not in spec:
                ctx.fail(
                    join(path, key),
                    "checkpoint_storage has no type, so only save_experiment_best, "
                    "save_trial_best and save_trial_latest apply; add 'type: shared_fs' "
                    "and 'host_path: /absolute/path'",
                )
    values = fields.parse_fields(ctx, body, path, spec)
    if kind in ("s3", "gcs"):
        _check_prefix(ctx, values["prefix"], join(path, "prefix"))
    if kind not in SUPPORTED and kind is not None:
        raise ConfigError(
            f"{join(path, 'type')} '{kind}' is not supported by det-local yet; use shared_fs "
            "with an absolute host_path, or leave checkpoint_storage out for det-local's "
            f"default location (in {ctx.source})"
        )
    if kind == "shared_fs":
        _check_shared_fs(ctx, path, values)
    if kind == "directory":
        _check_directory(ctx, path, values)
    return CheckpointStorageConfig(type=kind, **values)


def _check_prefix(ctx: Ctx, prefix: str | None, path: str) -> None:
    if prefix is not None and ".." in prefix.split("/"):
        ctx.fail(path, f"prefix cannot contain '..', found {prefix!r}")


def _check_shared_fs(ctx: Ctx, path: str, values: dict[str, Any]) -> None:
    host = values["host_path"]
    where = join(path, "host_path")
    if host is None:
        ctx.missing(
            where,
            "shared_fs needs the directory to store checkpoints in, "
            "e.g. 'host_path: /data/checkpoints'",
        )
    if not host.startswith("/"):
        hint = " (~ is not expanded; write the full path)" if host.startswith("~") else ""
        ctx.fail(where, f"must be an absolute path, found {host!r}{hint}")
    storage = values["storage_path"]
    if storage is None:
        return
    where = join(path, "storage_path")
    if storage.startswith("/"):
        rel = posixpath.relpath(posixpath.normpath(storage), posixpath.normpath(host))
    else:
        rel = posixpath.normpath(storage)
    if rel == ".." or rel.startswith("../"):
        ctx.fail(
            where,
            f"must be a relative directory or a subdirectory of host_path ({host}), "
            f"found {storage!r}",
        )


def _check_directory(ctx: Ctx, path: str, values: dict[str, Any]) -> None:
    where = join(path, "container_path")
    target = values["container_path"]
    if target is None:
        ctx.missing(
            where,
            "type directory needs the directory to store checkpoints in, "
            "e.g. 'container_path: /data/checkpoints'",
        )
    if not target.startswith("/"):
        ctx.fail(where, f"must be an absolute path on this machine, found {target!r}")
