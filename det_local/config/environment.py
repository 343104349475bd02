"""`environment:` — environment variables apply; container settings are accepted and ignored."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from det_local.config import check, fields
from det_local.config.check import Ctx, join

DEVICES = ("cpu", "cuda", "rocm")

SPEC: fields.Spec = {
    "image": fields.any_(),
    "environment_variables": fields.any_(),
    "ports": fields.mapping({}),
    "proxy_ports": fields.Field("list", []),
    "force_pull_image": fields.bool_(False),
    "registry_auth": fields.mapping(),
    "add_capabilities": fields.str_list([]),
    "drop_capabilities": fields.str_list([]),
    "pod_spec": fields.mapping(),
}

# Container-only settings: without Docker det-local has nothing to apply them to.
_CONTAINER_ONLY = ("image", "registry_auth", "pod_spec", "add_capabilities", "drop_capabilities")
_PROXY_PORT_FIELDS = ("proxy_port", "proxy_tcp", "unauthenticated", "default_service_id")


def _no_vars() -> dict[str, list[str]]:
    return {d: [] for d in DEVICES}


@dataclass(frozen=True)
class EnvironmentConfig:
    """`environment_variables` is the list for the cpu case ("K=V" strings);
    `environment_variables_by_device` holds the cpu/cuda/rocm lists (Determined's filled form);
    `environment_variables_raw` is what the config said."""

    environment_variables: list[str] = field(default_factory=list)
    environment_variables_by_device: dict[str, list[str]] = field(default_factory=_no_vars)
    environment_variables_raw: Any = field(default=None, compare=False)
    image: dict[str, str | None] = field(default_factory=lambda: dict.fromkeys(DEVICES))
    ports: dict[str, int] = field(default_factory=dict)
    proxy_ports: list[dict[str, Any]] = field(default_factory=list)
    force_pull_image: bool = False
    registry_auth: dict[str, Any] | None = None
    add_capabilities: list[str] = field(default_factory=list)
    drop_capabilities: list[str] = field(default_factory=list)
    pod_spec: dict[str, Any] | None = None

    def variables_for(self, device: str = "cpu") -> dict[str, str]:
        """The variables for a trial on `device` (cpu, cuda or rocm); later entries win."""
        out: dict[str, str] = {}
        for item in self.environment_variables_by_device[device]:
            key, _, value = item.partition("=")
            out[key] = value
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "image": dict(self.image),
            "environment_variables": copy.deepcopy(self.environment_variables_by_device),
            "ports": dict(self.ports),
            "proxy_ports": copy.deepcopy(self.proxy_ports),
            "force_pull_image": self.force_pull_image,
            "registry_auth": copy.deepcopy(self.registry_auth),
            "add_capabilities": list(self.add_capabilities),
            "drop_capabilities": list(self.drop_capabilities),
            "pod_spec": copy.deepcopy(self.pod_spec),
        }


def parse_environment(ctx: Ctx, raw: Any, path: str = "environment") -> EnvironmentConfig:
    values = fields.parse_fields(ctx, raw, path, SPEC)
    raw_vars = copy.deepcopy(values.pop("environment_variables"))
    by_device = _variables(ctx, raw_vars, join(path, "environment_variables"))
    values["image"] = _image(ctx, values["image"], join(path, "image"))
    for name, port in values["ports"].items():
        check.as_int(ctx, port, join(join(path, "ports"), name), lo=0, hi=65535)
    values["proxy_ports"] = _proxy_ports(ctx, values["proxy_ports"], join(path, "proxy_ports"))
    for name in _CONTAINER_ONLY:
        given = values[name]
        if given and (name != "image" or any(given.values())):
            ctx.warn(join(path, name), "ignored: det-local runs trials without containers")
    return EnvironmentConfig(
        environment_variables=list(by_device["cpu"]),
        environment_variables_by_device=by_device,
        environment_variables_raw=raw_vars,
        **values,
    )


def _variables(ctx: Ctx, value: Any, path: str) -> dict[str, list[str]]:
    if value is None:
        return _no_vars()
    if isinstance(value, list):
        items = _var_list(ctx, value, path)
        return {d: list(items) for d in DEVICES}
    if not isinstance(value, dict):
        ctx.wrong_type(
            path, "a list of 'KEY=VALUE' strings or a mapping of cpu/cuda/rocm to such lists", value
        )
    check.check_keys(ctx, value, path, (*DEVICES, "gpu"))
    out = {d: _var_list(ctx, value.get(d) or [], join(path, d)) for d in DEVICES}
    if not out["cuda"] and value.get("gpu"):
        out["cuda"] = _var_list(ctx, value["gpu"], join(path, "gpu"))
    return out


def _var_list(ctx: Ctx, value: Any, path: str) -> list[str]:
    items = check.as_str_list(ctx, value, path)
    for i, item in enumerate(items):
        key = item.partition("=")[0]
        if "=" not in item or not key.strip():
            ctx.fail(f"{path}[{i}]", f"expected 'KEY=VALUE', found {item!r}")
    return items


def _image(ctx: Ctx, value: Any, path: str) -> dict[str, str | None]:
    if value is None:
        return dict.fromkeys(DEVICES)
    if isinstance(value, str):
        return dict.fromkeys(DEVICES, value)
    obj = check.as_mapping(ctx, value, path, example="{cpu: image, cuda: image}")
    check.check_keys(ctx, obj, path, (*DEVICES, "gpu"))
    out: dict[str, str | None] = {}
    for device in DEVICES:
        item = obj.get(device)
        out[device] = None if item is None else check.as_str(ctx, item, join(path, device))
    if out["cuda"] is None and obj.get("gpu") is not None:
        out["cuda"] = check.as_str(ctx, obj["gpu"], join(path, "gpu"))
    return out


def _proxy_ports(ctx: Ctx, value: list[Any], path: str) -> list[dict[str, Any]]:
    out = []
    for i, item in enumerate(value):
        where = f"{path}[{i}]"
        obj = check.as_mapping(ctx, item, where, example="{proxy_port: 8080}")
        check.check_keys(ctx, obj, where, _PROXY_PORT_FIELDS)
        if obj.get("proxy_port") is None:
            ctx.missing(join(where, "proxy_port"), "add e.g. 'proxy_port: 8080'")
        entry: dict[str, Any] = {
            "proxy_port": check.as_int(
                ctx, obj["proxy_port"], join(where, "proxy_port"), lo=1, hi=65535
            )
        }
        for flag in _PROXY_PORT_FIELDS[1:]:
            given = obj.get(flag)
            entry[flag] = False if given is None else check.as_bool(ctx, given, join(where, flag))
        out.append(entry)
    return out
