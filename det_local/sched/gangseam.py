"""The seam of a trial across machines: what the engine's half (`sched/gangs.py`) and the
cluster's half (`federate/gangs/`) share. `Placer` is what the engine asks of the cluster;
`GangHost` is what gang shares use of the engine, `GangTrials` of trials as jobs
(`sched/life/trialjobs.py`), `GangSessions` of trial sessions (`sched/sessions/host.py`);
`GangFit` is a placement; the keys name a gang, a run and a share in both halves; `REATTACH_S`
is the restart window both keep."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from det_local.sched.life.experiments import TrialRun
from det_local.store.states import JobKind
from det_local.store.tables.jobs import JobRecord

if TYPE_CHECKING:
    from det_local.sched.life.experiments import ExperimentRun
    from det_local.sched.queue.hardware import Inventory
    from det_local.sched.queue.jobqueue import JobQueue
    from det_local.sched.run.commands import Commands
    from det_local.sched.run.supervisor import Supervisor
    from det_local.store.db import Store
    from det_local.store.paths import Paths
    from det_local.store.private import PrivateFiles


# a daemon restart inside this window keeps a gang's running ranks (on every node); the
# cluster's placer takes adopted shares back, else they are ended this long after the restart
REATTACH_S = 10.0


@dataclass(frozen=True)
class GangFit:
    """Where a gang of `size` slots fits: `per_node` slots on each of `nodes` (fit order; this
    node first when it takes part); `local` is this node's share (per_node or 0)."""

    size: int
    per_node: int
    nodes: tuple[str, ...]
    local: int


class Placer(Protocol):
    """The cluster's half (federate/gangs/), as the engine calls it."""

    def fit(self, slots: int) -> GangFit:
        """Where a gang of this size fits now; DetLocalError (one line) when no set of live
        nodes could ever hold it."""

    def share_started(self, job: JobRecord) -> None:
        """The owner's share holds its slots (RESERVED): place the rest."""

    def member_started(self, job: JobRecord) -> None:
        """A member share holds its slots (RESERVED): tell its owner it is ready."""

    def yield_share(self, job: JobRecord, why: str) -> None:
        """More important local work needs a share's slots: release it (RESERVED) or have its
        owner preempt the whole gang by checkpoint (running)."""

    def owner_exited(self, run: TrialRun, code: int) -> bool:
        """The owner's ranks exited; True: the placer calls `EngineView.gang_exited` once every
        member's ranks have stopped too."""

    def member_exited(self, job: JobRecord, code: int | None) -> None:
        """A member share's ranks exited."""

    def down(self, run: TrialRun, frame: dict[str, Any]) -> None:
        """A frame for every rank of the trial on other nodes (preempt)."""

    def stop(self, run: TrialRun) -> None:
        """Stop the trial's ranks on every other node (kill)."""

    def relay(self, run: TrialRun, msg: dict[str, Any]) -> asyncio.Future[Any] | None:
        """A member rank's trial frame, sent to the owner; its reply comes in the future."""

    def abort_job(self, job: JobRecord, why: str) -> None:
        """Stop whatever runs of this node's job on other nodes (a command sent whole)."""

    def idle_peer(self, slots: int, job_id: int | None = None) -> str | None:
        """A live peer that lends and has `slots` free now (the most free first) and has not
        refused job `job_id` for good, or None."""


class GangHost(Protocol):
    """What gang shares use of the engine (`sched/engine.py` is one): its components and its
    experiments. Narrow on purpose, like every other component's host; what a share
    does to a trial goes through `GangTrials`, what it does to a session through
    `GangSessions`."""

    store: Store
    queue: JobQueue
    paths: Paths
    inventory: Inventory
    supervisor: Supervisor
    commands: Commands
    private: PrivateFiles

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None: ...

    def note(
        self,
        message: str,
        *,
        experiment_id: int | None = None,
        trial_id: int | None = None,
        level: str = "INFO",
        echo: bool = True,
    ) -> None: ...

    def experiment(self, experiment_id: int) -> ExperimentRun: ...

    def owner_uid(self, experiment_id: int) -> int | None: ...


class GangTrials(Protocol):
    """What gang shares do to a trial's job (`sched/life/trialjobs.TrialJobs` is one)."""

    def start_trial(
        self,
        job: JobRecord,
        slots: list[int],
        run_id: int,
        *,
        rendezvous: Any = None,
        ports: dict[str, int] | None = None,
    ) -> None: ...

    def adopt_trial(self, exp: ExperimentRun, job: JobRecord) -> TrialRun: ...

    def gang_exited(self, run: TrialRun, code: int) -> None: ...

    def terminate(self, run: TrialRun) -> None: ...


class GangSessions(Protocol):
    """What gang shares ask of trial sessions (`sched/sessions/host.TrialSessions` is one):
    this node's live run of a trial; a relayed frame applied as a local run's message."""

    def managed_run(self, trial_id: int) -> TrialRun | None: ...

    def run_uid(self, run: TrialRun) -> int: ...

    def handle(self, run: TrialRun, msg: dict[str, Any], uid: int) -> Any: ...


def gang_key(gang: dict[str, Any]) -> tuple[int, int, str, int]:
    """One order of gangs on every machine: (priority, submission time at the owner, owner,
    owner's job id); smaller is older (goes first)."""
    key = gang.get("key") or [0, 0, "", 0]
    return (int(key[0]), int(key[1]), str(key[2]), int(key[3]))


def share_key(job: JobRecord, node: str) -> tuple[int, int, str, int]:
    """A share's place in that order: a member's is its gang's; this node's own trial job's is
    made the way its owner (`node`) sends it in `reserve`."""
    if job.kind == JobKind.MEMBER:
        return gang_key(job.gang or {})
    return owner_key(job, node)


def owner_key(job: JobRecord, node: str) -> tuple[int, int, str, int]:
    return (int(job.priority), int(job.submitted_at * 1e9), node, job.id)
