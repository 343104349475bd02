"""`retention_policy.log_retention_days`: the daemon deletes the trial logs of experiments
that ended longer ago than that (-1, the default: kept forever). Checked when the engine
starts and every CHECK_S after; each sweep removes at most MAX_FILES files (the rest wait for
the next one), and notes once per experiment what it removed."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from det_local.sched.life.experiments import Notes
from det_local.store import retention
from det_local.store.db import Store
from det_local.store.paths import Paths

CHECK_S = 3600.0
MAX_FILES = 500


class Retaining(Notes, Protocol):
    store: Store
    paths: Paths
    loop: asyncio.AbstractEventLoop | None


def sweep(engine: Retaining, now: float | None = None) -> int:
    """Remove expired trial logs; returns how many files went."""
    removed = 0
    for exp_id in retention.expired(engine.store.conn, time.time() if now is None else now):
        gone = 0
        for t in engine.store.list_trials(exp_id):
            log = engine.paths.trial_log(exp_id, t.id)
            try:
                log.unlink()
            except FileNotFoundError:
                continue
            except OSError:
                continue
            gone += 1
        if gone:
            engine.note(
                f"removed the logs of {gone} trial{'s' if gone != 1 else ''} "
                "(retention_policy.log_retention_days)",
                experiment_id=exp_id,
            )
        removed += gone
        if removed >= MAX_FILES:
            break
    return removed


def start(engine: Retaining) -> None:
    """Sweep now, then every CHECK_S while the engine's loop runs."""

    def again() -> None:
        sweep(engine)
        if engine.loop is not None:
            engine.loop.call_later(CHECK_S, again)

    again()
