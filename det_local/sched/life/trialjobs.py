"""Trials as jobs: queueing a trial for slots, starting it when the queue says so, preempting
and terminating it, and the runs a restart or a gang takes back.

`TrialJobs` is the queue's `Starter` (`sched/queue/jobqueue.py`) and the trial side of gang
shares (`sched/gangseam.GangTrials`); the engine (`sched/engine.py`) owns the live runs
(`TrialJobsHost.runs`) and the experiments, and hands this object to the components that start
or stop trials (the queue, gangs, restart, pause and kill, a trial's exit, `experiment
continue`).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Protocol

from det_local.errors import DetLocalError
from det_local.pools import is_default
from det_local.sched.life.experiments import ExperimentRun, Notes, TrialRun
from det_local.sched.run.runas import uid_of
from det_local.sched.run.trialstart import StartFailed
from det_local.sched.sessions.trialserver import send
from det_local.store.states import JobKind, JobState, State
from det_local.store.tables.jobs import JobRecord

if TYPE_CHECKING:
    from det_local.sched.gangs import GangShares
    from det_local.sched.queue.jobqueue import JobQueue
    from det_local.sched.run.commands import Commands
    from det_local.sched.run.supervisor import Supervisor
    from det_local.sched.run.trialstart import TrialStarter
    from det_local.sched.settings import DaemonSettings
    from det_local.search.actions import Action
    from det_local.store.db import Store
    from det_local.store.private import PrivateFiles


class TrialJobsHost(Notes, Protocol):
    """What trials as jobs need of the engine: its components, its live runs, its
    experiments and what their searchers hear."""

    store: Store
    private: PrivateFiles
    settings: DaemonSettings
    trials: TrialStarter
    supervisor: Supervisor
    queue: JobQueue
    commands: Commands
    gangs: GangShares
    runs: dict[int, TrialRun]  # trial id -> live run
    user_ids: dict[int, int]  # experiment id -> submitter's uid

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None: ...

    def experiment(self, experiment_id: int) -> ExperimentRun: ...

    def apply(self, exp: ExperimentRun, actions: list[Action]) -> None: ...

    def on_trial_exit(self, run: TrialRun, code: int) -> None: ...


class TrialJobs:
    """Each trial's job: queued, started, preempted, terminated (see the module doc)."""

    def __init__(self, host: TrialJobsHost) -> None:
        self.host = host

    # ------------------------------------------------------------------ queueing
    def enqueue_trial(self, exp: ExperimentRun, trial_id: int) -> None:
        """Queue the trial (again) for slots; it starts when the policy says so."""
        host = self.host

        def create() -> int:
            rec = host.store.get_experiment(exp.id)
            override = host.store.get_experiment_priority(exp.id)
            size = int(exp.config.resources.slots_per_trial)
            pooled = not is_default(exp.config.resources.resource_pool)
            fit = None if pooled else host.gangs.fit(size)
            return host.store.jobs.create(
                kind=JobKind.TRIAL,
                name=f"{rec.name} (trial {trial_id})",
                user=rec.user,
                uid=host.user_ids.get(exp.id, uid_of(rec.user)),
                priority=(
                    int(exp.config.resources.effective_priority) if override is None else override
                ),
                # another pool's trial holds none of this machine's slots
                slots_needed=0 if pooled else size if fit is None else fit.local,
                experiment_id=exp.id,
                trial_id=trial_id,
                umask=host.store.get_experiment_umask(exp.id),
                gang=None if fit is None else {"size": size, "per_node": fit.per_node},
                anywhere=fit is None and not pooled and bool(exp.config.resources.federate),
            )

        host.queue.enqueue_trial(trial_id, create)

    # ------------------------------------------------------------------ starting (Starter)
    def start_trial(
        self,
        job: JobRecord,
        slots: list[int],
        run_id: int,
        *,
        rendezvous: Any = None,
        ports: dict[str, int] | None = None,
    ) -> None:
        """The scheduler gave the trial its slots (recorded in its job): start its process
        (a gang's share: with the gang's rendezvous and the chief's ports)."""
        assert job.experiment_id is not None and job.trial_id is not None
        host = self.host
        exp = host.experiment(job.experiment_id)
        trial_id = job.trial_id
        # derived from the daemon's key: stored nowhere, recomputed after a restart
        token = host.private.run_token(job.id, run_id)
        in_use = [p for r in host.runs.values() for p in r.ports.values()]
        try:
            plan, run = host.trials.prepare(
                exp, job, slots, token, run_id, in_use, rendezvous=rendezvous, ports=ports
            )
        except StartFailed as err:
            self._failed_to_start(exp, trial_id, str(err))
            return
        host.runs[trial_id] = run  # before the spawn: a fast trial may connect at once
        run.spawned_at = time.monotonic()
        try:
            proc = host.supervisor.spawn(job, plan)
        except DetLocalError as err:
            del host.runs[trial_id]
            host.queue.finish_trial_job(trial_id, None, str(err))
            self._failed_to_start(exp, trial_id, f"trial {trial_id}: {err}")
            return
        run.pid = proc.pid
        run.warm = bool(getattr(proc, "forked", False))

    def start_command(self, job: JobRecord) -> None:
        self.host.commands.start(job)

    def start_gang_share(self, job: JobRecord) -> None:
        """A gang's share holds its slots (RESERVED): the placer does the rest."""
        gangs = self.host.gangs
        placer = gangs.placer
        if placer is None:  # the federation stopped: the share waits for it
            gangs.release(job.id, "the cluster is off")
            self.host.queue.hold_back[job.id] = "waiting for the cluster (federation is off)"
        elif job.kind == JobKind.MEMBER:
            placer.member_started(job)
        else:
            placer.share_started(job)

    def fail_trial_start(self, experiment_id: int, trial_id: int, message: str) -> None:
        """The trial cannot start as configured (a gang a member refused for good)."""
        self._failed_to_start(self.host.experiment(experiment_id), trial_id, message)

    def _failed_to_start(self, exp: ExperimentRun, trial_id: int, message: str) -> None:
        host = self.host
        host.note(message, experiment_id=exp.id, trial_id=trial_id, level="ERROR")
        host.queue.finish_trial_job(trial_id, None, message)
        host.store.set_trial_state(trial_id, State.ERROR, message)
        host.apply(exp, exp.searcher.on_trial_exited_early(exp.request_of[trial_id], "ERRORED"))

    def adopt_trial(self, exp: ExperimentRun, job: JobRecord) -> TrialRun:
        """A TrialRun for a trial process an earlier daemon started (its token is derived again
        from the daemon's key)."""
        assert job.trial_id is not None
        host = self.host
        run = TrialRun(
            job.trial_id,
            exp.id,
            exp.request_of[job.trial_id],
            job.run_id,
            host.private.run_token(job.id, job.run_id),
            job.id,
            job.pid or 0,
        )
        if job.preempt_acked:  # preempted before the restart: its exit means "requeue me"
            run.acked = True
            run.requeue_requested = True
            host.queue.preempting.add(job.id)
        host.runs[job.trial_id] = run
        return run

    def gang_exited(self, run: TrialRun, code: int) -> None:
        """Every rank of a gang has stopped, on every node (the placer says so)."""
        if self.host.runs.get(run.trial_id) is run:
            self.host.on_trial_exit(run, code)
        self.host.queue.schedule()

    # ------------------------------------------------------------------ stopping
    def preempt_trial(self, job: JobRecord) -> bool:
        """The policy chose the trial's job as a victim: it checkpoints and requeues."""
        host = self.host
        if job.gang is not None and (job.state == JobState.RESERVED or job.kind == JobKind.MEMBER):
            if host.gangs.placer is None:
                return False
            host.gangs.placer.yield_share(job, f"job {job.id} is preempted by more important work")
            return job.state != JobState.RESERVED  # a released share is back in the queue at once
        run = host.runs.get(job.trial_id or -1)
        if run is None:
            return False
        run.requeue_requested = True
        host.note(
            f"trial {job.trial_id} (priority {job.priority}) is preempted for more important "
            "work: it checkpoints and waits in the queue",
            experiment_id=job.experiment_id,
            trial_id=job.trial_id,
        )
        self.preempt(run, host.experiment(run.experiment_id))
        return True

    def run_ending(self, run: TrialRun) -> None:
        """The run's pool ends it soon (a Slurm time limit): it checkpoints, and is queued
        again to continue (not a failure)."""
        host = self.host
        if host.runs.get(run.trial_id) is not run or run.preempt_sent:
            return
        run.requeue_requested = True
        host.note(
            f"trial {run.trial_id}: its job reaches its time limit soon; it checkpoints and "
            "continues in a new job",
            experiment_id=run.experiment_id,
            trial_id=run.trial_id,
        )
        self.preempt(run, host.experiment(run.experiment_id))

    def preempt(self, run: TrialRun, exp: ExperimentRun) -> None:
        """Ask the trial's ranks to checkpoint and exit; terminated after the timeout."""
        host = self.host
        if run.preempt_sent:
            return
        run.preempt_sent = True
        for w in run.writers:
            send(w, {"t": "preempt"})
        if host.gangs.placer is not None:
            host.gangs.placer.down(run, {"t": "preempt"})
        configured = exp.config.preemption_timeout
        timeout = host.settings.preemption_timeout if configured is None else float(configured)
        assert host.loop is not None
        run.timers.append(host.loop.call_later(timeout, self.terminate, run))

    def terminate(self, run: TrialRun) -> None:
        """SIGTERM the group, then SIGKILL after a grace period."""
        host = self.host
        if run.trial_id not in host.runs:
            return
        host.supervisor.terminate(run.job_id, run.pid)
        if host.gangs.placer is not None:
            host.gangs.placer.stop(run)
