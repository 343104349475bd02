"""A job's run is wholly gone (`sched/run/supervisor.py` reaped it and calls the engine's
`on_exit`): what its exit means for its kind of job (a trial's: `trialexit.py`; a gang member's
and a gang's owner: `sched/gangs.py` and the placer; a command's: `sched/run/commands.py`), a
line in the daemon's log, then a scheduling pass."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from det_local.store.states import JobKind

if TYPE_CHECKING:
    from det_local.sched.gangs import GangShares
    from det_local.sched.life.experiments import TrialRun
    from det_local.sched.queue.jobqueue import JobQueue
    from det_local.sched.run.commands import Commands
    from det_local.sched.run.supervisor import Exit
    from det_local.store.db import Store
    from det_local.store.tables.jobs import JobRecord


class JobExitHost(Protocol):
    """What a job's exit needs of the engine."""

    store: Store
    queue: JobQueue
    gangs: GangShares
    commands: Commands
    runs: dict[int, TrialRun]  # trial id -> live run
    daemon: bool  # a daemon logs each job's end (`journal`)

    def journal(self, line: str) -> None: ...

    def on_trial_exit(self, run: TrialRun, code: int, unstarted: str | None = None) -> None: ...


def on_job_exit(host: JobExitHost, ended: Exit) -> None:
    """What the exit means (the daemon logs it), then a pass."""
    job = host.store.jobs.peek(ended.job_id)
    decided = _job_exited(host, job, ended)
    if host.daemon:
        from det_local.sched.run.joblog import ended as ended_line

        host.journal(ended_line(job, ended.code, host.store.jobs.peek(job.id)))
    if decided:
        host.queue.schedule()


def _job_exited(host: JobExitHost, job: JobRecord, ended: Exit) -> bool:
    """What the exit means; False while a gang's other nodes decide it."""
    gangs = host.gangs
    host.queue.preempting.discard(ended.job_id)
    if ended.lost is not None and job.trial_id is not None:  # the pool lost it
        gangs.peer_lost.setdefault(job.trial_id, f"its run {ended.lost}")
    if job.kind == JobKind.MEMBER:
        gangs.member_job_exited(job, ended.code)
    elif job.kind == JobKind.TRIAL:
        run = host.runs.get(job.trial_id or -1)
        placer = gangs.placer
        if (
            run is not None
            and job.gang is not None
            and placer is not None
            and placer.owner_exited(run, ended.code)
        ):
            return False  # decided once the other nodes' ranks have stopped too
        if (
            run is not None and job.gang is not None and (placer is None or job.id in gangs.adopted)
        ):  # its ranks on other machines were out of reach: a machine lost, not a failure
            gangs.peer_lost.setdefault(
                run.trial_id, "the cluster was off while its ranks ran on other machines"
            )
        if run is not None:
            run.failed = ended.failed
            host.on_trial_exit(run, ended.code, ended.unstarted)
    else:
        host.commands.on_exit(job, ended.code, ended.problem or ended.unstarted)
    return True
