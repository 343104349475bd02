"""PreemptContext: should_preempt() reads the flag the daemon's preempt message sets.

Every rank's process has its own session with the daemon, and the daemon sends ``preempt`` to
all of them. How the ranks agree follows Determined's ``PreemptMode``:

* ``WorkersAskChief`` (default): a collective; the chief reads its flag and broadcasts it, so
  every rank gets the same answer in the same call (all ranks must call it in step);
* ``ChiefOnly``: only the chief may call it (a worker calling it raises);
* ``WorkersAskMaster``: each rank reads its own flag, no communication.

The first True with ``auto_ack`` acknowledges the preemption to the daemon (from the ranks that
read a flag), so the trial is resumed later rather than counted as finished.
"""

from __future__ import annotations

import enum

from det_local.trial.core._distributed import DistributedContext
from det_local.trial.session import Session


class PreemptMode(enum.Enum):
    WorkersAskChief = "WORKERS_ASK_CHIEF"
    ChiefOnly = "CHIEF_ONLY"
    WorkersAskMaster = "WORKERS_ASK_MASTER"


class PreemptContext:
    def __init__(
        self,
        session: Session | None,
        dist: DistributedContext,
        mode: PreemptMode = PreemptMode.WorkersAskChief,
    ) -> None:
        self._session = session
        self._dist = dist
        self._mode = PreemptMode(mode)
        self._acked = False

    def _flag_holder(self) -> Session | None:
        """What holds this process's preemption flag (its ``preempted`` attribute), for a loop
        that checks it after every batch without a call (one process only: the ranks' modes
        do not apply); None: nothing can preempt it (off det-local)."""
        return self._session

    def _flag(self, auto_ack: bool) -> bool:
        session = self._session
        if session is None or not session.preempted:
            return False
        if auto_ack and not self._acked:
            self.acknowledge_preemption_signal()
        return True

    def should_preempt(self, auto_ack: bool = True) -> bool:
        """True once the trial should save and exit (to be resumed later)."""
        rank = self._dist.rank
        if self._mode == PreemptMode.WorkersAskMaster:
            return self._flag(auto_ack)
        if rank != 0:
            if self._mode == PreemptMode.ChiefOnly:
                raise RuntimeError(
                    "PreemptContext was configured with preempt_mode=ChiefOnly but "
                    f".should_preempt() was called from non-chief worker of rank={rank}"
                )
            return bool(self._dist.broadcast(None))
        out = self._flag(auto_ack)
        if self._mode == PreemptMode.WorkersAskChief and self._dist.size > 1:
            self._dist.broadcast(out)
        return out

    def acknowledge_preemption_signal(self) -> None:
        """Tell the daemon this trial will exit to be resumed later (not because it is done)."""
        if self._session is not None and not self._acked:
            self._acked = True
            self._session.request("preempt_ack")


class DummyPreemptContext(PreemptContext):
    """Off det-local: never preempted; WorkersAskChief still synchronises the ranks, as
    Determined's stand-in does, so code behaves the same on and off det-local."""

    def __init__(self, dist: DistributedContext, mode: PreemptMode = PreemptMode.WorkersAskChief):
        super().__init__(None, dist, mode)
