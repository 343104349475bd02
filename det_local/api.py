"""The Python API the CLI is a thin layer over. Reads open the store read-only; changes go to
the daemon (or, with none running, to an embedded runner started for the purpose)."""

from __future__ import annotations

from pathlib import Path

from det_local.store.db import Store
from det_local.store.paths import Paths


def paths() -> Paths:
    return Paths.from_env()


def open_store(p: Paths | None = None) -> Store:
    """A read-only view of the store (empty when nothing has run yet)."""
    return Store((p or paths()).db, readonly=True)


def run(
    config_path: str | Path,
    context_dir: str | Path,
    *,
    follow: bool = True,
    quiet: bool = False,
) -> int:
    """Submit an experiment and, with follow=True, run it to the end; returns the exit code."""
    from det_local.sched.embedded import run_experiment

    return run_experiment(paths(), Path(config_path), Path(context_dir), follow=follow, quiet=quiet)


def control(experiment_id: int, action: str, **fields: object) -> str:
    """pause | activate | kill | label_add | label_remove an experiment; returns a message."""
    from det_local.sched.control import control_experiment

    return control_experiment(paths(), experiment_id, action, **fields)
