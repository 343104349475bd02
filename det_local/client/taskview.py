"""What a list of commands shows of each job that is not a trial: the address a notebook or a
TensorBoard serves on (never its token), and its argv with secret-looking option values hidden.

A notebook's token lives in its environment (private to its user, `client/tasks.py`) and is
printed only to its owner by `det-local notebook start`; nothing here can show it. A command
that put a secret in its argv (`--token=...`) already shows it to every user of this machine
(`ps`), but a list that may be read from elsewhere (the dashboard) hides the value anyway, by
the one rule the daemon's log uses too (`det_local/masking.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

from det_local.masking import HIDDEN, hide_secrets, hide_secrets_in_line

__all__ = ["HIDDEN", "address", "hide_secrets", "hide_secrets_in_line"]

NOTEBOOK = "NOTEBOOK"
TENSORBOARD = "TENSORBOARD"
# where a served task's address comes from: (kind) -> (host option, path)
_SERVED = {NOTEBOOK: ("--ip", "lab"), TENSORBOARD: ("--host", "")}


def _option(argv: Sequence[str], name: str) -> str | None:
    """The value of `--name=V` or `--name V` in argv (the last one wins, as argparse does)."""
    found = None
    for i, arg in enumerate(argv):
        if arg.startswith(name + "="):
            found = arg[len(name) + 1 :]
        elif arg == name and i + 1 < len(argv):
            found = argv[i + 1]
    return found


def address(kind: str, argv: Sequence[str] | None) -> str | None:
    """The URL a notebook or TensorBoard job serves on, without any token (None for other
    kinds, or when its argv names no port)."""
    if kind not in _SERVED or not argv:
        return None
    host_option, path = _SERVED[kind]
    port = _option(argv, "--port")
    if port is None or not port.isdigit():
        return None
    host = _option(argv, host_option) or "127.0.0.1"
    if host in ("0.0.0.0", "::", "*"):
        host = "127.0.0.1"
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/{path}"
