"""Keys det-local parses but does not act on: one warning each, naming the key and what
det-local does instead (printed by `run`, `experiment create` and `config check`).

Nothing in a config is silently ignored: a key listed here that is set (to something other
than its default) gets its line; a key det-local acts on is not listed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from det_local.config.check import Ctx

if TYPE_CHECKING:
    from det_local.config.experiment import ExperimentConfig

NO_CONTAINERS = "det-local runs trials without containers"

# key -> what det-local does instead (the README's table is this one)
INSTEAD: dict[str, str] = {
    "bind_mounts": f"ignored: {NO_CONTAINERS}; trials see this machine's files at their own "
    "paths (use host paths in your code)",
    "resources.devices": f"ignored: {NO_CONTAINERS}; trials see this machine's devices "
    "(GPUs are fenced to their slots)",
    "resources.shm_size": f"ignored: {NO_CONTAINERS}; trials share this machine's /dev/shm",
    "environment.ports": f"ignored: {NO_CONTAINERS}; a trial's processes bind this "
    "machine's ports directly (det-local chooses the rendezvous ports itself)",
    "environment.proxy_ports": "ignored: det-local has no proxy; reach a trial's ports on "
    "its machine directly",
    "integrations.webhooks": "ignored: det-local sends no webhooks (follow `det-local "
    "experiment list` or the dashboard)",
    "integrations.pachyderm": "ignored: det-local has no Pachyderm integration",
}

EXCLUDE_NODE = (
    "exclude_node: det-local labels the trial and stops its restarts on this machine (a "
    "single node cannot exclude itself)"
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
