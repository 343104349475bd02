"""Trials that wait a moment for their experiment's zygote (warm starts, `zygotes.py`).

The first trial of a search starts cold while its experiment's zygote imports; without this the
trials started beside it (the other free slots) would start cold too, each importing the same
modules on the same cores as the zygote. Instead, while the zygote is importing
(`Launcher.warming`, at most `zygotes.HOLD_S`), such a trial is held back before anything is
allocated to it (`JobQueue.hold_back`, with the reason `job list` shows), and released, with a
scheduling pass, as soon as the zygote is ready, gone, refused or late; then it is forked (or,
if the zygote could not serve, starts cold as before). Nothing here is durable: a restarted
daemon adopts no zygote and holds nothing.

Readiness is looked at every `CHECK_S` while a trial is held (a bounded supervision tick: the
zygote's socket appearing is not an event the engine's loop sees), never otherwise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from det_local.store.jobs import JobRecord

WHY = "waiting for its experiment's zygote to finish importing (a warm start)"
CHECK_S = 0.05


class WarmHolds:
    def __init__(
        self,
        warming: Callable[[int], bool],
        hold_back: dict[int, str],
        schedule: Callable[[], None],
    ) -> None:
        self.warming = warming  # the launcher's: is this experiment's zygote importing?
        self.hold_back = hold_back  # the queue's held jobs (this module's and others')
        self.schedule = schedule
        self.held: dict[int, int] = {}  # job id -> its experiment
        self.loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    def hold(self, job: JobRecord) -> str | None:
        """Why the trial should wait for its experiment's zygote; None: start it now."""
        if self.loop is None or job.gang is not None or job.experiment_id is None:
            return None
        if not self.warming(job.experiment_id):
            return None
        self.held[job.id] = job.experiment_id
        if self._timer is None:
            self._timer = self.loop.call_later(CHECK_S, self._check)
        return WHY

    def _check(self) -> None:
        self._timer = None
        ready = {exp for exp in set(self.held.values()) if not self.warming(exp)}
        released = [job for job, exp in self.held.items() if exp in ready]
        for job_id in released:
            del self.held[job_id]
            if self.hold_back.get(job_id) == WHY:
                del self.hold_back[job_id]
        if self.held and self.loop is not None:
            self._timer = self.loop.call_later(CHECK_S, self._check)
        if released:
            self.schedule()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
