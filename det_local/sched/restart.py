"""The restart rules: what an engine does at start with the work an earlier one left.

After a restart (even kill -9), nothing queued is lost, nothing runs twice, no slot is booked
twice:

* **running** (a job recorded SCHEDULED): its run is adopted when its leader is still the
  same process (pid and start time) and watched like a spawned one; an experiment that was
  being paused or killed goes on pausing or being killed (a run still waiting in its pool's
  queue, a Slurm job PENDING, is cancelled at once: nothing there to checkpoint). A run found
  dead is settled from its exit record: a trial's exit is decided as if it had been watched, a
  command ends with its status; whatever it left in its cgroup is killed first;
* **half-applied** (allocated, its process maybe never started): a wrapper found by its exit
  file is recorded and adopted; one never started is queued again, in its place;
  a trial whose status was lost is queued again to resume from its latest checkpoint;
* **queued**: stays queued, in its order (the job table is durable); an ACTIVE trial with no
  job (a crash between the two commits) is queued;
* **unmanaged** (core_v2) runs lost their process's connection: they end ERROR;
* **a gang across machines** (a share of this node's trial, or of a peer's): its running
  ranks are adopted too, and the cluster's placer takes the gang back once the other nodes
  are heard (within `sched/gangseam.REATTACH_S`); a share nobody takes back is ended (a trial
  is then requeued from its latest checkpoint, as after a lost machine).
"""

from __future__ import annotations

from typing import Protocol

from det_local.sched.gangs import GangShares
from det_local.sched.life.changes import cancel_if_queued
from det_local.sched.life.experiments import ExperimentRun, TrialRun, set_stopping
from det_local.sched.life.trialjobs import TrialJobs
from det_local.sched.queue.jobqueue import JobQueue
from det_local.sched.run.commands import Commands
from det_local.sched.run.launcher import Lost
from det_local.sched.run.supervisor import Supervisor
from det_local.sched.sessions import unmanaged
from det_local.store.states import JobKind, State, Stopping
from det_local.store.tables.jobs import RESERVED, SCHEDULED, JobRecord


class Restarting(unmanaged.UnmanagedHost, Protocol):
    """What the restart needs of the engine."""

    experiments: dict[int, ExperimentRun]
    runs: dict[int, TrialRun]
    queue: JobQueue
    supervisor: Supervisor
    commands: Commands
    gangs: GangShares
    trial_jobs: TrialJobs  # adopting, requeueing, preempting, terminating trials

    def on_trial_exit(self, run: TrialRun, code: int) -> None: ...

    def maybe_finish(self, exp: ExperimentRun) -> None: ...


def recover(engine: Restarting) -> None:
    """Adopt live runs, settle dead ones, keep the queue (the rules in the module doc)."""
    store = engine.store
    for rec in store.list_experiments(states=[State.ACTIVE, State.STOPPING_CANCELED]):
        engine.experiment(rec.id)
    for rec in store.list_experiments(states=[State.PAUSED, State.STOPPING_PAUSED]):
        if rec.state == State.STOPPING_PAUSED or any(
            j.experiment_id == rec.id and j.state == SCHEDULED for j in store.jobs.active()
        ):
            # PAUSED (from STOPPING_PAUSED) once its trials have exited
            set_stopping(engine.experiment(rec.id), Stopping.PAUSE)
    settled: list[tuple[JobRecord, Lost]] = []
    live: set[str] = set()
    for job in store.jobs.active():
        if job.state == RESERVED:  # a gang's share never committed: its owner places it again
            if job.kind == JobKind.MEMBER:
                store.jobs.finish(job.id, None, "the daemon restarted before its gang committed")
            else:
                store.jobs.requeue(job.id)
            continue
        if job.kind == JobKind.MEMBER and job.state != SCHEDULED:
            store.jobs.finish(job.id, None, "the daemon restarted; its owner places it again")
            continue
        if job.state != SCHEDULED:
            continue
        if job.gang is not None and job.kind != JobKind.MEMBER and job.slots_needed == 0:
            # this node runs none of the gang's processes (they run on peers): nothing to
            # adopt here; the cluster takes the gang back (or it ends, sched/gangs.py)
            if job.kind == JobKind.TRIAL:
                assert job.experiment_id is not None
                engine.experiment(job.experiment_id)
            engine.gangs.adopt_owner(job)
            continue
        job, found = engine.supervisor.adopt(job)
        if not isinstance(found, Lost):
            _adopted(engine, job)
            live.add(engine.supervisor.run_key(job))
        elif found.at_once:  # it died while being adopted
            _settle_lost(engine, job, found)
        else:
            settled.append((job, found))
    for job, lost in settled:
        _settle_lost(engine, job, lost)
    engine.supervisor.cleanup(live)  # what runs that ended meanwhile left behind
    for exp in list(engine.experiments.values()):
        state = store.get_experiment(exp.id).state
        if state == State.STOPPING_CANCELED:
            set_stopping(exp, Stopping.KILL)
        if state != State.ACTIVE:
            engine.maybe_finish(exp)
            continue
        if unmanaged.settle_after_restart(engine, exp.id):
            continue  # its process (not ours) lost the engine: nothing to start
        for t in store.list_trials(exp.id):  # a crash between a trial and its job
            if t.state == State.ACTIVE and store.jobs.for_trial(t.id) is None:
                engine.trial_jobs.enqueue_trial(exp, t.id)


def _adopted(engine: Restarting, job: JobRecord) -> None:
    if job.kind == JobKind.MEMBER:  # its owner takes it back once their link is up again
        engine.gangs.adopt_member(job)
        return
    if job.kind == JobKind.TRIAL:
        assert job.experiment_id is not None and job.trial_id is not None
        engine.trial_jobs.adopt_trial(engine.experiment(job.experiment_id), job)
        if job.gang is not None:  # its ranks run on other nodes too
            engine.gangs.adopt_owner(job)
    engine.note(f"adopted {job.kind.lower()} job {job.id} (pid {job.pid}) still running")
    if job.kind == JobKind.TRIAL and job.experiment_id is not None:
        exp = engine.experiments[job.experiment_id]
        run = engine.runs.get(job.trial_id or -1)
        if run is not None and exp.stopping in (Stopping.PAUSE, Stopping.KILL):
            if exp.stopping == Stopping.KILL:
                run.kill_requested = True
                engine.trial_jobs.terminate(run)
            elif not cancel_if_queued(engine, run):  # a pool's job still in its queue: now
                engine.trial_jobs.preempt(run, exp)


def _settle_lost(engine: Restarting, job: JobRecord, lost: Lost) -> None:
    """A job whose process ended while no engine watched it (lost.spawned False: whose
    process never started; lost.problem: why its exit record was refused)."""
    if lost.problem is not None:
        engine.note(f"job {job.id}: {lost.problem}", level="WARNING")
    if job.kind == JobKind.MEMBER:
        engine.store.jobs.finish(job.id, lost.code, "its ranks ended while the daemon was down")
        # a machine that died and came back is a lost machine for the gang's owner, never a
        # failed trial: its ranks went with the daemon (federate/gangs/ reports it)
        engine.gangs.died_with_daemon[job.id] = dict(job.gang or {})
        return
    if job.kind != JobKind.TRIAL:
        engine.commands.settle_lost(job, lost.code, lost.spawned, lost.problem)
        return
    assert job.experiment_id is not None and job.trial_id is not None
    exp = engine.experiment(job.experiment_id)
    if not lost.spawned or lost.code is None:
        # never started, or its status is lost: run it again from its latest checkpoint
        engine.store.jobs.requeue(job.id)
        engine.note(
            f"trial {job.trial_id} "
            + ("never started" if not lost.spawned else "ended while the daemon was down")
            + "; queued again to resume from its latest checkpoint"
            + (f" (its exit status is unknown: {lost.problem})" if lost.problem else ""),
            experiment_id=exp.id,
            trial_id=job.trial_id,
            level="WARNING",
        )
        return
    run = engine.trial_jobs.adopt_trial(exp, job)
    if job.gang is not None:  # its ranks ran across machines while this daemon was down
        engine.gangs.peer_lost.setdefault(
            run.trial_id, "its daemon was down while its ranks ran on other machines"
        )
    engine.on_trial_exit(run, lost.code)
