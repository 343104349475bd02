"""What a trial's exit means, and when an experiment is over.

:func:`trial_exited` is called once a trial's run is wholly gone (the supervisor reaped it,
or a restart found it ended): `sched/life/outcome.py` decides the outcome from the facts (exit code,
what was asked of the run, restarts left), and this module applies it: the trial's state, its
job, the searcher's answer, a requeue or a restart from its latest checkpoint.
:func:`finish_if_done` ends an experiment whose work is over (completed, canceled, failed) and
hands it to checkpoint GC.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from det_local.sched.daytwo import logpolicy
from det_local.sched.gangs import GangShares
from det_local.sched.life.ckpt_gc import CheckpointGC
from det_local.sched.life.experiments import ExperimentRun, Notes, TrialRun, set_stopping
from det_local.sched.life.outcome import ExitFacts, Outcome, decide, describe_exit
from det_local.sched.life.trialjobs import TrialJobs
from det_local.sched.queue.jobqueue import JobQueue
from det_local.search.actions import Action
from det_local.store.db import Store
from det_local.store.paths import Paths
from det_local.store.private import PrivateFiles
from det_local.store.states import State, Stopping


class TrialExitHost(Notes, Protocol):
    """What a trial's exit needs of the engine."""

    store: Store
    paths: Paths
    private: PrivateFiles
    queue: JobQueue
    gc: CheckpointGC
    experiments: dict[int, ExperimentRun]
    runs: dict[int, TrialRun]
    gangs: GangShares
    trial_jobs: TrialJobs  # a trial queued again

    def apply(self, exp: ExperimentRun, actions: list[Action]) -> None: ...

    def save_searcher(self, exp: ExperimentRun) -> None: ...

    def check_idle(self) -> None: ...

    def experiment_stopped(self, experiment_id: int) -> None: ...


def trial_exited(
    engine: TrialExitHost, run: TrialRun, code: int, unstarted: str | None = None
) -> None:
    """The trial's process group is gone (reaped by the queue): decide what it means.
    ``unstarted``: its pool refused the run (why, in one line): it never ran."""
    for t in run.timers:
        t.cancel()
    for w in run.writers:
        w.close()
    engine.runs.pop(run.trial_id, None)
    exp = engine.experiments[run.experiment_id]
    if unstarted is not None:  # e.g. sbatch refused it: ERROR at once, no restart spent
        msg = f"trial {run.trial_id}: {unstarted}"
        engine.queue.finish_trial_job(run.trial_id, None, msg)
        engine.store.set_trial_state(run.trial_id, State.ERROR, msg)
        engine.note(msg, experiment_id=exp.id, trial_id=run.trial_id, level="ERROR")
        engine.apply(exp, exp.searcher.on_trial_exited_early(run.request_id, "ERRORED"))
        finish_if_done(engine, exp)
        engine.check_idle()
        return
    trial = engine.store.get_trial(run.trial_id)
    max_restarts = int(exp.config.max_restarts)
    lost = engine.gangs.peer_lost.pop(run.trial_id, None)
    requeues = engine.gangs.peer_requeues.get(run.trial_id, 0)
    policy = logpolicy.on_exit(
        engine.store,
        engine.paths.trial_log(exp.id, run.trial_id),
        run.trial_id,
        exp.config.log_policies,
    )
    outcome = decide(
        ExitFacts(
            exit_code=code,
            kill_requested=run.kill_requested or exp.stopping == Stopping.KILL,
            pause_requested=exp.stopping in (Stopping.PAUSE, Stopping.ERROR),
            stop_requested=run.stop_requested,
            preempt_acknowledged=run.acked,
            invalid_hp=run.invalid_hp,
            restarts_done=trial.restarts,
            max_restarts=max_restarts,
            requeue_requested=run.requeue_requested,
            peer_lost=lost is not None,
            peer_requeues_left=requeues < engine.gangs.max_peer_requeues,
        )
    )
    if lost is not None and outcome == Outcome.REQUEUE and not run.requeue_requested:
        engine.gangs.peer_requeues[run.trial_id] = requeues + 1
        engine.note(
            f"trial {run.trial_id}: {lost}; queued again to resume from its latest checkpoint on "
            f"live machines (a lost machine does not count toward max_restarts: peer requeue "
            f"{requeues + 1} of {engine.gangs.max_peer_requeues})",
            experiment_id=exp.id,
            trial_id=run.trial_id,
            level="WARNING",
        )
    why_not_restarted = ""
    if outcome == Outcome.RESTART and policy is not None:
        outcome = Outcome.ERROR
        why_not_restarted = (
            f"; not restarted: its output matched log policy {policy.name!r} ({policy.action})"
        )
    rid = run.request_id
    tid = run.trial_id
    where = f": {run.failed}" if run.failed else ""  # e.g. the node that failed first
    if outcome not in (Outcome.REQUEUE, Outcome.RESTART):
        engine.queue.finish_trial_job(tid, code, outcome.value)
    if outcome == Outcome.COMPLETED and (
        _test_mode_restore(engine, exp, run) or _wait_for_promotion(engine, exp, run)
    ):
        pass  # it runs again (a restore test, or a promotion), or waits to be promoted
    elif outcome in (Outcome.COMPLETED, Outcome.STOPPED):
        engine.store.set_trial_state(tid, State.COMPLETED)
        engine.apply(exp, exp.searcher.on_trial_exited(rid))
    elif outcome == Outcome.INVALID_HP:
        engine.store.set_trial_state(tid, State.COMPLETED, "ended early: invalid hyperparameters")
        engine.apply(exp, exp.searcher.on_trial_exited_early(rid, "INVALID_HP"))
    elif outcome == Outcome.PAUSED:
        engine.store.set_trial_state(tid, State.PAUSED)
        engine.note(
            f"trial {tid} paused at steps_completed={engine.store.get_trial(tid).steps_completed}",
            experiment_id=exp.id,
            trial_id=tid,
        )
    elif outcome == Outcome.REQUEUE:
        engine.trial_jobs.enqueue_trial(exp, tid)
    elif outcome == Outcome.CANCELED:
        engine.store.set_trial_state(tid, State.CANCELED)
        engine.apply(exp, exp.searcher.on_trial_exited_early(rid, "USER_CANCELED"))
    elif outcome == Outcome.RESTART:
        n = engine.store.add_restart(tid)
        engine.note(
            f"trial {tid} {describe_exit(code)}{where}; restarting from its latest checkpoint "
            f"(restart {n} of {max_restarts})",
            experiment_id=exp.id,
            trial_id=tid,
            level="WARNING",
        )
        engine.trial_jobs.enqueue_trial(exp, tid)
    else:
        msg = (
            f"trial {tid} {describe_exit(code)}{where}"
            + (
                f" after {trial.restarts} restart{'s' if trial.restarts > 1 else ''}"
                if trial.restarts
                else ""
            )
            + why_not_restarted
            + f"; see `det-local trial logs {tid}`"
        )
        engine.store.set_trial_state(tid, State.ERROR, msg)
        engine.note(msg, experiment_id=exp.id, trial_id=tid, level="ERROR")
        engine.apply(exp, exp.searcher.on_trial_exited_early(rid, "ERRORED"))
    finish_if_done(engine, exp)
    engine.check_idle()


def _wait_for_promotion(engine: TrialExitHost, exp: ExperimentRun, run: TrialRun) -> bool:
    """Promotion-based ASHA (<=0.37): a trial that ran out of operations but is not closed
    waits, without a process, until the searcher promotes it (a new operation: it resumes
    from its checkpoint) or closes it. False when it is simply done."""
    rid = run.request_id
    if not exp.searcher.pauses_trials or rid in exp.closed:
        return False
    if exp.ops.get(rid):  # promoted while it was exiting
        engine.trial_jobs.enqueue_trial(exp, run.trial_id)
        return True
    exp.waiting.add(rid)
    engine.save_searcher(exp)
    return True


def _test_mode_restore(engine: TrialExitHost, exp: ExperimentRun, run: TrialRun) -> bool:
    """Test mode, after the first run: restore its checkpoint in a fresh process and train
    one more batch (an operation one batch longer for Core API scripts). False when there is
    nothing to restore, which ends the test (the report names the missing step)."""
    from det_local.sched.run.trialstart import restore_checkpoint

    if not exp.test_mode or run.run_id != 1:
        return False
    ckpt = restore_checkpoint(engine.store, run.trial_id)
    if ckpt is None:
        return False
    exp.ops.setdefault(run.request_id, deque()).append(ckpt.steps_completed + 1)
    engine.save_searcher(exp)
    engine.trial_jobs.enqueue_trial(exp, run.trial_id)
    return True


def finish_if_done(engine: TrialExitHost, exp: ExperimentRun) -> None:
    if any(r.experiment_id == exp.id for r in engine.runs.values()):
        return
    if exp.stopping is None and any(j.experiment_id == exp.id for j in engine.store.jobs.active()):
        return  # trials wait in the queue
    state = engine.store.get_experiment(exp.id).state
    if exp.stopping == Stopping.KILL:
        for t in engine.store.list_trials(exp.id):
            if not t.state.terminal:
                engine.store.set_trial_state(t.id, State.CANCELED)
        if state != State.CANCELED:
            engine.store.set_experiment_state(exp.id, State.CANCELED)
        set_stopping(exp, None)
    elif exp.stopping == Stopping.PAUSE:
        if state == State.STOPPING_PAUSED:  # its last trial process is gone
            engine.store.set_experiment_state(exp.id, State.PAUSED)
        set_stopping(exp, None)
    elif exp.stopping == Stopping.ERROR:  # the searcher could not go on (see _searcher_failed)
        rec = engine.store.get_experiment(exp.id)
        for t in engine.store.list_trials(exp.id):
            if not t.state.terminal:
                engine.store.set_trial_state(
                    t.id, State.CANCELED, f"experiment failed: {rec.message}"
                )
        if not state.terminal:
            engine.store.set_experiment_state(exp.id, State.ERROR)
        set_stopping(exp, None)
    elif exp.shutdown is not None and state == State.ACTIVE:
        if exp.shutdown.cancel and not exp.shutdown.failure:
            engine.store.set_experiment_state(exp.id, State.CANCELED)
        elif exp.shutdown.failure:
            errs = [t for t in engine.store.list_trials(exp.id) if t.state == State.ERROR]
            why = errs[0].message if errs else "every trial failed"
            engine.store.set_experiment_state(exp.id, State.ERROR, why)
        else:
            engine.store.set_experiment_progress(exp.id, 1.0)
            engine.store.set_experiment_state(exp.id, State.COMPLETED)
    now = engine.store.get_experiment(exp.id).state
    if now.terminal or now == State.PAUSED:  # no trial of it runs for now: nor its zygote
        engine.experiment_stopped(exp.id)
    if now.terminal:
        engine.private.drop_experiment_env(exp.id)  # no trial of it starts again
    engine.gc.collect_if_ended(exp.id)  # once it has ended: checkpoint_storage save_*
