"""Keys det-local parses but does not act on: one warning each, naming the key and what
det-local does instead (printed by `run`, `experiment create` and `config check`;
`config/experiment.py` warns).

Nothing in a config is silently ignored: a key listed here that is set (to something other
than its default) gets its line; a key det-local acts on is not listed."""

from __future__ import annotations

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
