"""PreemptContext: should_preempt() is a flag read, set by the daemon's preempt message."""

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
        self._mode = mode
        self._acked = False

    def should_preempt(self, auto_ack: bool = True) -> bool:
        if self._mode == PreemptMode.ChiefOnly and self._dist.rank != 0:
            raise RuntimeError("should_preempt() called on a worker with preempt_mode=ChiefOnly")
        session = self._session
        if session is None or not session.preempted:
            return False
        if auto_ack and not self._acked:
            self.acknowledge_preemption_signal()
        return True

    def acknowledge_preemption_signal(self) -> None:
        """Tell the daemon this trial will exit to be resumed later (not because it is done)."""
        if self._session is not None and not self._acked:
            self._acked = True
            self._session.request("preempt_ack")


class DummyPreemptContext(PreemptContext):
    def __init__(self, dist: DistributedContext, mode: PreemptMode = PreemptMode.WorkersAskChief):
        super().__init__(None, dist, mode)
