"""Launchers: how a multi-process trial starts its workers (Determined's ``determined.launch``).

``python3 -m det_local.launch.NAME`` (or ``determined.launch.NAME`` inside a trial):

* ``torch_distributed``: torchrun with one worker per slot (the default for Trial classes);
* ``deepspeed``: DeepSpeed's launcher with a hostfile for the trial's slots (on several
  machines: torchrun on each, as ``torch_distributed``);
* ``horovod``: horovodrun (deprecated, as in Determined 0.38);
* ``wrap_rank``: prefixes a worker's output lines with ``[rank=N] ``.

All of them run their workers under ``supervise.Supervisor`` (one failed worker stops the
rest). ``ports.allocate_ports()`` gives the engine the per-trial ports they read.
"""

from __future__ import annotations

import difflib
import importlib.abc
import sys
from typing import Any

LAUNCHERS = ("torch_distributed", "deepspeed", "horovod", "wrap_rank")


def legacy_trial_argv(entrypoint: str, slots: int, python: str | None = None) -> list[str]:
    """argv for a legacy ``module:TrialClass`` entrypoint: the harness itself for one slot,
    torch_distributed around it for more (Determined always uses torch_distributed)."""
    exe = python or sys.executable
    if slots <= 1:
        return [exe, "-m", "det_local.trial.harness", entrypoint]
    return [exe, "-m", "det_local.launch.torch_distributed", "--trial", entrypoint]


class _UnknownLauncher(importlib.abc.MetaPathFinder):
    """`python3 -m det_local.launch.nope`: name the launchers instead of 'No module named'.

    Installed last on sys.meta_path while the interpreter is still looking for its -m module,
    so it only ever sees names no other finder has."""

    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        prefix = self.package + "."
        if sys.argv[:1] != ["-m"] or not fullname.startswith(prefix):
            return None
        name = fullname[len(prefix) :]
        if "." in name or name.startswith("_"):
            return None
        close = difflib.get_close_matches(name, LAUNCHERS, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        sys.stderr.write(
            f"det-local: error: unknown launcher '{name}' ({fullname}); {hint}the launchers are "
            + ", ".join(f"{self.package}.{n}" for n in LAUNCHERS)
            + "\n"
        )
        raise SystemExit(1)


def install_unknown_launcher_hook(package: str) -> None:
    if sys.argv[:1] == ["-m"] and not any(
        isinstance(f, _UnknownLauncher) and f.package == package for f in sys.meta_path
    ):
        sys.meta_path.append(_UnknownLauncher(package))


install_unknown_launcher_hook(__name__)
