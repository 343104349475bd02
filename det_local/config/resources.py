"""`resources:` — slots, priority, weight, max_slots, shm_size, devices, federate."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from det_local.config import check, fields
from det_local.config.check import Ctx, join
from det_local.priority import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY

SPEC: fields.Spec = {
    "slots_per_trial": fields.int_(1, lo=0),
    "max_slots": fields.int_(lo=1),
    "weight": fields.number(1.0, lo=0, exclusive=True),
    "priority": fields.int_(lo=MIN_PRIORITY, hi=MAX_PRIORITY),
    "resource_pool": fields.str_(""),
    "shm_size": fields.any_(),
    "is_single_node": fields.bool_(),
    "devices": fields.any_([]),
    "native_parallel": fields.bool_(False),
    "slots": fields.int_(),
    "agent_label": fields.str_(),
    # det-local: may run wholly on an idle peer of the cluster when this machine is full
    "federate": fields.bool_(False),
}

_SHM_RE = re.compile(r"^(?P<num>([0-9]*[.])?[0-9]+) ?(?P<unit>[kmgtpKMGTP][iI]?[bB]?|[bB])?$")
_DEVICE_RE = re.compile(r"^/[^:]*:/[^:]*(:[rwm]*)?$")
_DEVICE_FIELDS = ("host_path", "container_path", "mode")


@dataclass(frozen=True)
class ResourcesConfig:
    slots_per_trial: int = 1
    max_slots: int | None = None
    weight: float = 1.0
    priority: int | None = None
    resource_pool: str = ""
    shm_size: int | str | None = None
    is_single_node: bool | None = None
    devices: list[dict[str, str]] = field(default_factory=list)
    native_parallel: bool = False
    slots: int | None = None
    agent_label: str | None = None
    federate: bool = False

    @property
    def effective_priority(self) -> int:
        """The priority the scheduler uses: the configured one, else DEFAULT_PRIORITY (lower
        runs first)."""
        return DEFAULT_PRIORITY if self.priority is None else self.priority

    @property
    def shm_size_bytes(self) -> int | None:
        return None if self.shm_size is None else memory_bytes(self.shm_size)

    def to_dict(self) -> dict[str, Any]:
        return {
            name: [dict(d) for d in self.devices] if name == "devices" else getattr(self, name)
            for name in SPEC
        }


def memory_bytes(size: int | str) -> int:
    """`"4G"`, `"1.5Gi"`, `"512 MB"`, 1024 -> bytes (binary multiples, as Docker's RAMInBytes).

    Determined's schema pattern wants a `b` after `i` ("1.5GiB"); "1.5Gi" is accepted too."""
    if isinstance(size, int):
        return size
    m = _SHM_RE.match(size)
    if m is None:
        raise ValueError(f"not a memory size: {size!r}")
    unit = (m.group("unit") or "b")[0].lower()
    power = "bkmgtp".index(unit)
    return int(float(m.group("num")) * 1024**power)


def parse_resources(ctx: Ctx, raw: Any, path: str = "resources") -> ResourcesConfig:
    values = fields.parse_fields(ctx, raw, path, SPEC)
    values["shm_size"] = _shm_size(ctx, values["shm_size"], join(path, "shm_size"))
    values["devices"] = _devices(ctx, values["devices"], join(path, "devices"))
    for ignored in ("slots", "agent_label"):
        if values[ignored] is not None:
            ctx.warn(join(path, ignored), "ignored for experiments (use slots_per_trial)")
    return ResourcesConfig(**values)


def _shm_size(ctx: Ctx, value: Any, path: str) -> int | str | None:
    if value is None:
        return None
    if check.is_int(value):
        return check.as_int(ctx, value, path, lo=0)
    if not isinstance(value, str):
        ctx.wrong_type(path, "a size in bytes or a string such as '4G'", value)
    if _SHM_RE.match(value) is None:
        ctx.fail(path, f"must be a valid memory size such as 4G, 1.5Gi or 512M, found {value!r}")
    return value


def _devices(ctx: Ctx, value: Any, path: str) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    for i, item in enumerate(check.as_list(ctx, value, path)):
        where = f"{path}[{i}]"
        if isinstance(item, str):
            if not _DEVICE_RE.match(item):
                ctx.fail(where, f"expected '/host/path:/container/path[:mode]', found {item!r}")
            parts = item.split(":")
            out.append(
                {
                    "host_path": parts[0],
                    "container_path": parts[1],
                    "mode": parts[2] if len(parts) > 2 else "mrw",
                }
            )
            continue
        obj = check.as_mapping(
            ctx, item, where, example="{host_path: /dev/x, container_path: /dev/x}"
        )
        check.check_keys(ctx, obj, where, _DEVICE_FIELDS)
        device = {}
        for key in ("host_path", "container_path"):
            if obj.get(key) is None:
                ctx.missing(join(where, key), f"a device needs it, e.g. '{key}: /dev/fuse'")
            device[key] = check.as_str(ctx, obj[key], join(where, key))
        mode = obj.get("mode")
        device["mode"] = "mrw" if mode is None else check.as_str(ctx, mode, join(where, "mode"))
        out.append(device)
    return out
