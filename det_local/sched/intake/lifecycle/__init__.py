"""Requests about what users do with runs and their results after the fact: kill one trial,
archive or delete an experiment, delete a checkpoint or edit its metadata
(`lifecycle/runs.py`), and the model registry (`lifecycle/registry.py`).

Each is a spool request like `sched/intake/handlers.py`'s, with the same ownership rule
(`handlers.authorize`); `sched/intake/dispatch.py` finds them in :data:`HANDLERS`.
"""

from __future__ import annotations

from det_local.sched.intake.lifecycle import registry, runs

HANDLERS = {**runs.HANDLERS, **registry.HANDLERS}

__all__ = ["HANDLERS"]
