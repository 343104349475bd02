"""The engine as trial sessions see it: `TrialSessions` is the trial server's `Sessions`
(`trialserver.py`: which run a hello names, whether it still runs, whose it is) and the
messages' `TrialHost` (`trialmessages.py`: what a message may do), over the engine's live runs,
its unmanaged runs (`unmanaged.py`) and the relay runs of gang members (`sched/gangs.py`).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Any, Protocol

from det_local.errors import DetLocalError
from det_local.sched.sessions import unmanaged
from det_local.sched.sessions.trialmessages import handle as handle_message

if TYPE_CHECKING:
    from det_local.sched.gangs import GangShares
    from det_local.sched.life.experiments import ExperimentRun, TrialRun
    from det_local.sched.life.trialjobs import TrialJobs
    from det_local.sched.sessions.reports import Reports


class SessionsHost(unmanaged.UnmanagedHost, Protocol):
    """What trial sessions need of the engine: its runs of every kind and its experiments."""

    experiments: dict[int, ExperimentRun]
    runs: dict[int, TrialRun]  # trial id -> live run
    user_ids: dict[int, int]  # experiment id -> submitter's uid
    reports: Reports
    gangs: GangShares
    trial_jobs: TrialJobs


class TrialSessions:
    """The runs trial sessions talk to, and what their messages do (see the module doc)."""

    def __init__(self, host: SessionsHost) -> None:
        self.host = host
        self.store = host.store  # TrialHost
        self.reports = host.reports

    # ------------------------------------------------------------------ Sessions
    def managed_run(self, trial_id: int) -> TrialRun | None:
        return self.host.runs.get(trial_id)

    def relay_run(self, job_id: int) -> TrialRun | None:
        return self.host.gangs.relays.get(job_id)

    def is_live(self, run: TrialRun) -> bool:
        host = self.host
        return (
            host.runs.get(run.trial_id) is run
            or host.unmanaged.get(run.trial_id) is run
            or host.gangs.relays.get(run.job_id) is run
        )

    def run_uid(self, run: TrialRun) -> int:
        """The uid a run's processes have: its job's user under a root daemon, else ours."""
        if os.geteuid() != 0:
            return os.geteuid()
        if self.host.unmanaged.get(run.trial_id) is run:  # a core_v2 process: no job
            return int(self.host.user_ids[run.experiment_id])
        return int(self.store.jobs.peek(run.job_id).uid)

    def unmanaged_hello(self, msg: dict[str, Any], writer: asyncio.StreamWriter) -> TrialRun | None:
        return unmanaged.hello(self.host, msg, writer)

    def session_opened(self, run: TrialRun) -> dict[str, Any] | None:
        """A run said hello: the first time, how long it took to start, recorded and told to
        the trial (which says it in its log); None after that."""
        if run.greeted or run.spawned_at is None:
            return None
        run.greeted = True
        seconds = time.monotonic() - run.spawned_at
        self.store.add_trial_start(run.experiment_id, run.trial_id, run.run_id, run.warm, seconds)
        return {"warm": run.warm, "seconds": round(seconds, 4)}

    def session_closed(self, run: TrialRun) -> None:
        if run.trial_id in self.host.unmanaged:
            unmanaged.disconnected(self.host, run)

    def handle(self, run: TrialRun, msg: dict[str, Any], uid: int) -> Any:
        """What one message of the run's session does: a rank of another machine's trial
        relays it to its owner; every other run's is handled here (`trialmessages.py`)."""
        if run.request_id == "relay":  # a rank of another machine's trial: its owner applies it
            placer = self.host.gangs.placer
            if placer is None:
                raise DetLocalError(
                    "this machine's cluster link is off; the trial's owner is unreachable"
                )
            return placer.relay(run, msg)
        return handle_message(self, run, msg, uid)

    # ------------------------------------------------------------------ TrialHost
    def experiment_of(self, run: TrialRun) -> ExperimentRun:
        return self.host.experiments[run.experiment_id]

    def end_unmanaged(self, run: TrialRun, msg: dict[str, Any]) -> bool:
        if self.host.unmanaged.get(run.trial_id) is not run:
            return False
        unmanaged.on_end(self.host, run, msg)
        return True

    def run_ending(self, run: TrialRun) -> None:
        """The run's pool ends it soon (`slurm/notify.py`): `TrialJobs.run_ending`."""
        self.host.trial_jobs.run_ending(run)
