"""The engine: experiments and their searchers, and the events that pass between components.

One engine per DET_LOCAL_HOME. It is the only writer of the store. Events come from three
sources, all on one asyncio loop, and nothing polls for work:

* the spool (submissions and control requests): `sched/intake/spoolserver.py` reads them and
  `sched/intake/dispatch.py` hands each to its handler in `sched/intake/handlers.py`, which calls
  the engine;
* the trial socket (trial reports): `sched/sessions/trialserver.py` authenticates sessions and
  `sched/sessions/trialmessages.py` handles each message (`sched/sessions/host.py` is the engine
  as sessions see it), calling the engine for what touches a searcher;
* process exits: `sched/run/supervisor.py` watches the runs it spawned through the launcher
  (`sched/run/launcher.py`) and calls `sched/life/jobexit.on_job_exit` once a run is wholly gone.

The engine owns the experiments (`sched/life/experiments.py`) and applies their searchers'
actions; it is the composition root that wires the components, each given what it needs:
submission (`sched/intake/submission.py`), trials as jobs (`sched/life/trialjobs.py`: queued,
started when the queue (`sched/queue/jobqueue.py`) says so, preempted, terminated), what a
trial's exit means (`sched/life/trialexit.py`), commands (`sched/run/commands.py`), checkpoint
GC (`sched/life/ckpt_gc.py`), gang shares (`sched/gangs.py`). `docs/architecture.md` has the
whole picture. The daemon runs an engine for good; `det-local run` with no daemon runs one in
its own process for the life of the run (embedded mode).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections import deque
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from det_local.pools import is_default, load_pools
from det_local.sched.gangs import GangShares
from det_local.sched.intake.dispatch import apply_request
from det_local.sched.intake.spool import Request
from det_local.sched.intake.spoolserver import SpoolServer
from det_local.sched.intake.submission import submit_experiment
from det_local.sched.life import changes as expcontrol
from det_local.sched.life import trialexit
from det_local.sched.life.ckpt_gc import CheckpointGC
from det_local.sched.life.experiments import (
    ExperimentRun,
    TrialRun,
    checkpoint_dir_for,
    load_experiment,
    searcher_snapshot,
)
from det_local.sched.life.jobexit import on_job_exit
from det_local.sched.life.trialjobs import TrialJobs
from det_local.sched.queue.inventory import LocalInventory
from det_local.sched.queue.jobqueue import JobQueue, check_priority
from det_local.sched.restart import recover
from det_local.sched.run import cgroups
from det_local.sched.run.commands import Commands
from det_local.sched.run.launcher import LocalLauncher
from det_local.sched.run.poolroutes import PoolRoutes
from det_local.sched.run.privatestart import prepare_private
from det_local.sched.run.runas import identity, uid_of
from det_local.sched.run.supervisor import Supervisor
from det_local.sched.run.trialstart import TrialStarter
from det_local.sched.sessions import netchannel, unmanaged
from det_local.sched.sessions.host import TrialSessions
from det_local.sched.sessions.reports import Reports
from det_local.sched.sessions.trialserver import TrialServer
from det_local.sched.settings import DaemonSettings, load_settings
from det_local.search.actions import Action, Close, Create, Shutdown, Stop, ValidateAfter
from det_local.store.db import Store, current_user
from det_local.store.paths import Paths
from det_local.store.private import PrivateFiles
from det_local.store.states import JobKind, State

if TYPE_CHECKING:
    from det_local.config.experiment import ExperimentConfig

__all__ = ["Engine", "ExperimentRun", "TrialRun", "checkpoint_dir_for"]


class Engine:
    node_name = ""  # this node's name in the cluster (set with the placer), else ""

    def __init__(
        self,
        paths: Paths,
        *,
        out: Callable[[str], None] | None = None,
        daemon: bool = False,
        offline: bool = False,
    ) -> None:
        from det_local.sched.queue import hardware as slots

        self.paths = paths.ensure()
        self.daemon = daemon
        self.offline = offline  # one request with no engine running: never start anything
        self.settings: DaemonSettings = load_settings(paths.settings)
        self.inventory = slots.discover(cpu_slots=self.settings.cpu_slots)
        self.store = Store(paths.db)
        self.private = PrivateFiles(paths)  # what must not be in the database: tokens, envs
        self.private.ensure()
        self.user = current_user()
        self.experiments: dict[int, ExperimentRun] = {}
        self.runs: dict[int, TrialRun] = {}  # trial id -> live run
        self.unmanaged: dict[int, TrialRun] = {}  # trial id -> unmanaged run (core_v2)
        self.user_ids: dict[int, int] = {}  # experiment id -> submitter's uid
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle = asyncio.Event()
        self.closing = False
        self._tasks: list[asyncio.Future[None]] = []
        self._stop_requested = asyncio.Event()
        self._out = out or _print_err
        # the components, each given what it needs
        self.launcher = LocalLauncher(
            self.paths, self.inventory, self.settings.cgroup_setting(), self.note
        )
        # resource pools (det_local/pools/): this machine's launcher, or a router over pools
        self.pools = load_pools(paths.settings)
        routes = PoolRoutes(self.store, self.pools)
        self.supervisor = Supervisor(
            self.pools.launcher(
                self.launcher, self.paths, routes.pool_of_job, routes.pool_slots, self.note
            ),
            self.store.jobs,
            note=self.note,
            on_exit=partial(on_job_exit, self),
            journal=self.journal if daemon else None,
        )
        self.slots = LocalInventory(
            self.inventory,
            foreign_busy=self.settings.foreign_gpus_busy,
            our_pids=self.supervisor.our_pids,
        )
        from det_local.sched.daytwo import drain

        drain.load(self)  # slots an admin disabled stay disabled across restarts
        self.trial_jobs = TrialJobs(self)  # trials as jobs: queued, started, stopped
        self.queue = JobQueue(
            self.store.jobs,
            self.store.next_trial_run,
            self.slots,
            self.settings,
            self.trial_jobs,
            offline=offline,
            group_caps=self._group_caps,
            after_pass=self._after_pass,
        )
        self.commands = Commands(
            self.store.jobs,
            self.paths,
            self.private,
            self.inventory,
            self.supervisor,
            admin_group=self.settings.admin_group,
            note=self.note,
            schedule=self.queue.schedule,
            slots_remedy=self.cpu_slots_remedy,
        )
        self.trials = TrialStarter(
            self.store,
            self.paths,
            self.private,
            self.inventory,
            admin_group=self.settings.admin_group,
            note=self.note,
        )
        self.gc = CheckpointGC(
            self.store,
            identity_of=self._owner_identity,
            skip=self._gc_skip,
            note=self.note,
            out=self._out,
            on_done=self.check_idle,
        )
        self.reports = Reports(
            self.store, note=self.note, apply=self.apply, fail=self._searcher_failed
        )
        self.sessions = TrialSessions(self)  # the engine as trial sessions see it
        # trials across machines (federate/ places them)
        self.gangs = GangShares(self, self.trial_jobs, self.sessions)
        self.trial_server = TrialServer(self.paths.socket, self.sessions, self.note)
        self.spool = SpoolServer(
            self.paths,
            self.store,
            self.queue,
            self.apply_request,
            note=self.note,
            out=self._out,
            daemon=daemon,
            closing=lambda: self.closing,
            tasks=self._tasks,
        )

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    @loop.setter
    def loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._loop = loop
        for part in (self.supervisor, self.queue, self.gc, self.spool):
            part.loop = loop

    @property
    def containment(self) -> cgroups.Containment:
        return self.launcher.containment

    # ================================================================== lifecycle
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.supervisor.launcher.start()
        await netchannel.start(self.trial_server, self.pools.listens())  # + pools' TCP ones
        prepare_private(self.store, self.private, self.paths, self._out)
        recover(self)
        self.gc.collect_pending()  # ended experiments whose checkpoint GC did not finish
        from det_local.sched.daytwo import retention

        retention.start(self)  # retention_policy.log_retention_days, now and hourly
        self.spool.start()
        self.queue.schedule()

    async def wait_idle(self) -> None:
        """Return once no experiment has a live process or pending work (embedded mode).

        From then on the engine is `closing`: it refuses new work (submit, activate) with a
        `retry` reply, so that nothing starts in an engine about to stop; the client then runs
        the request in an engine of its own."""
        while True:
            self.check_idle()
            if self._idle.is_set():
                self.closing = True  # no await since the check: nothing slipped in between
                self.spool.watch_stop.set()
                return
            await self._idle.wait()

    async def serve_forever(self) -> None:
        """The daemon: run until `daemon stop` (or SIGTERM); jobs outlive it and are adopted
        by the next daemon."""
        await self._stop_requested.wait()
        self.closing = True
        self.spool.watch_stop.set()

    def request_stop(self) -> None:
        self._stop_requested.set()

    def continue_experiment(self, experiment_id: int, overrides: Any) -> str:
        """`experiment continue` (sched/daytwo/cont.py)."""
        from det_local.sched.daytwo.cont import continue_experiment

        message = continue_experiment(self, experiment_id, overrides)
        self.queue.schedule()
        return message

    def set_drain(self, target: str, disabled: bool, user: str) -> str:
        """`slot disable|enable N` (target "slot:N") or `cluster node ...` ("node:NAME")."""
        from det_local.sched.daytwo import drain

        kind, _, what = target.partition(":")
        if kind == "slot":
            return drain.set_slot(self, int(what), disabled, user)
        return drain.set_node(self, what, self.node_name or "local", disabled, user)

    def stop_taking_work(self) -> None:
        """An embedded engine about to stop before it is idle (`cmd run -f` interrupted):
        requests wait in the spool for the next engine, as after `wait_idle`."""
        self.closing = True
        self.spool.watch_stop.set()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.spool.stop()
        await self.trial_server.stop()
        self.store.close()
        self.supervisor.launcher.stop()

    def _after_pass(self) -> None:
        self.gangs.offload_waiting()
        self.check_idle()

    def check_idle(self) -> None:
        """Mark the engine idle (no experiment with a live process or pending work) or busy."""
        active = any(
            self.store.get_experiment(e).state
            in (State.ACTIVE, State.STOPPING_CANCELED, State.STOPPING_PAUSED)
            for e in self.experiments
        )
        if (
            not self.supervisor
            and not active
            and not self.gc.running
            and not self.store.jobs.active()
        ):
            self._idle.set()
        else:
            self._idle.clear()

    def is_idle(self) -> bool:
        """Whether the engine is idle now (checked, not cached): `wait_idle` would return."""
        self.check_idle()
        return self._idle.is_set()

    @property
    def tasks(self) -> tuple[asyncio.Future[None], ...]:
        """The engine's own background tasks (spool, trial server, scheduling passes)."""
        return tuple(self._tasks)

    def note(
        self,
        message: str,
        *,
        experiment_id: int | None = None,
        trial_id: int | None = None,
        level: str = "INFO",
        echo: bool = True,
    ) -> None:
        """Record an event (`experiment events`) and say it: in the daemon's log, or on the
        terminal of an embedded run unless ``echo`` is False (routine housekeeping, such as
        checkpoint GC's tally, that a run's output need not show)."""
        self.store.add_event(message, experiment_id=experiment_id, trial_id=trial_id, level=level)
        if echo or self.daemon:
            self._out(f"det-local: {message}")

    def log_safely(self, message: str, level: str = "WARNING") -> None:
        """note(), falling back to the daemon's log when the store cannot be written."""
        self.spool.log_safely(message, level)

    def apply_request(self, req: Request) -> dict[str, Any]:
        """A spool request's answer (`sched/intake/dispatch.py`)."""
        return apply_request(self, req)

    # ================================================================== experiments
    def submit(
        self,
        cfg: ExperimentConfig,
        context_src: Path,
        source: str,
        *,
        test_mode: bool = False,
        user: str | None = None,
        uid: int | None = None,
        env: dict[str, str] | None = None,
        umask: int | None = None,
    ) -> int:
        """Validate, snapshot the context, record the experiment and start its searcher
        (`sched/intake/submission.py`); its id."""
        return submit_experiment(
            self,
            cfg,
            context_src,
            source,
            test_mode=test_mode,
            user=user,
            uid=uid,
            env=env,
            umask=umask,
        )

    def cpu_slots_remedy(self, slots: int) -> str | None:
        """How to get `slots` CPU slots on this machine, when it has too few (said in the
        refusal), else None."""
        from det_local.sched.queue.hardware import cpu_slots_remedy

        configured = self.settings.cpu_slots is not None
        return cpu_slots_remedy(
            self.inventory,
            slots,
            daemon=self.daemon,
            settings_path=str(self.paths.settings) if configured else None,
        )

    def add_experiment(self, exp: ExperimentRun, uid: int) -> None:
        self.experiments[exp.id] = exp
        self.user_ids[exp.id] = uid

    def experiment(self, experiment_id: int) -> ExperimentRun:
        """The experiment, brought into the engine when it is not (NotFoundError if unknown)."""
        exp = self.experiments.get(experiment_id)
        if exp is None:
            exp = load_experiment(self.store, self.paths, experiment_id)
            self.experiments[experiment_id] = exp
        return exp

    def owner_uid(self, experiment_id: int) -> int | None:
        return self.user_ids.get(experiment_id)

    def _owner_identity(self, experiment_id: int) -> dict[str, Any]:
        rec = self.store.get_experiment(experiment_id)
        return identity(self.user_ids.get(experiment_id, uid_of(rec.user)))

    def _gc_skip(self, experiment_id: int) -> bool:
        """Test-mode runs and unmanaged runs keep their checkpoints (Determined leaves those
        of unmanaged runs too)."""
        rec = self.store.get_experiment(experiment_id)
        snapshot = self.store.get_searcher_state(experiment_id) or {}
        live = self.experiments.get(experiment_id)
        return bool(
            snapshot.get("test_mode")
            or (live is not None and live.test_mode)
            or unmanaged.is_unmanaged(rec.config)
        )

    def _group_caps(self) -> dict[str, int]:
        groups: dict[str, int] = {}
        for exp in self.experiments.values():
            cap = exp.config.resources.max_slots
            if cap is not None:
                groups[f"exp:{exp.id}"] = int(cap)
        return groups

    def experiment_stopped(self, experiment_id: int) -> None:
        """No trial of the experiment runs now (it ended or paused): what the launcher keeps
        for it goes (its zygote, `sched/warm/zygotes.py`)."""
        self.supervisor.launcher.experiment_stopped(experiment_id)

    def save_searcher(self, exp: ExperimentRun) -> None:
        self.store.set_searcher_state(exp.id, searcher_snapshot(exp))

    # ================================================================== searcher actions
    def apply(self, exp: ExperimentRun, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Create):
                trial_id = self.store.create_trial(
                    exp.id,
                    hparams=action.hparams,
                    seed=action.seed,
                    warm_start_checkpoint=action.warm_start_checkpoint,
                )
                exp.trial_of[action.request_id] = trial_id
                exp.request_of[trial_id] = action.request_id
                exp.ops.setdefault(action.request_id, deque())
            elif isinstance(action, ValidateAfter):
                exp.ops.setdefault(action.request_id, deque()).append(action.length)
                if action.request_id in exp.waiting:  # promoted: resume from its checkpoint
                    exp.waiting.discard(action.request_id)
                    self.trial_jobs.enqueue_trial(exp, exp.trial_of[action.request_id])
            elif isinstance(action, Close):
                exp.closed.add(action.request_id)
                if action.request_id in exp.waiting:  # never promoted: it is done
                    exp.waiting.discard(action.request_id)
                    self.store.set_trial_state(exp.trial_of[action.request_id], State.COMPLETED)
                    self.apply(exp, exp.searcher.on_trial_exited(action.request_id))
            elif isinstance(action, Stop):
                run = self.runs.get(exp.trial_of.get(action.request_id, -1))
                if run is not None:
                    run.stop_requested = True
                    self.trial_jobs.preempt(run, exp)
            elif isinstance(action, Shutdown):
                exp.shutdown = action
        self.save_searcher(exp)
        # queue every created trial for slots
        created = [a for a in actions if isinstance(a, Create)]
        if created and exp.stopping is None:
            for action in created:
                self.trial_jobs.enqueue_trial(exp, exp.trial_of[action.request_id])
            self.queue.schedule()
        self.maybe_finish(exp)

    # ================================================================== trials and experiments
    def say(self, line: str) -> None:
        """A line on the engine's output as it is: the terminal of an embedded run (stderr,
        never raising), or the daemon's log."""
        self._out(line)

    def journal(self, line: str) -> None:
        """A line in the daemon's log only (job starts and ends: `sched/run/joblog.py`)."""
        self._out(f"det-local: {line}")

    def on_trial_exit(self, run: TrialRun, code: int, unstarted: str | None = None) -> None:
        trialexit.trial_exited(self, run, code, unstarted)

    def maybe_finish(self, exp: ExperimentRun) -> None:
        trialexit.finish_if_done(self, exp)

    def pause(self, experiment_id: int) -> str:
        return expcontrol.pause(self, experiment_id)

    def activate(self, experiment_id: int) -> str:
        return expcontrol.activate(self, experiment_id)

    def kill(self, experiment_id: int) -> str:
        return expcontrol.kill(self, experiment_id)

    def set_labels(self, experiment_id: int, add: str | None, remove: str | None) -> str:
        return expcontrol.set_labels(self, experiment_id, add, remove)

    def _searcher_failed(self, exp: ExperimentRun, trial_id: int, why: str) -> None:
        expcontrol.searcher_failed(self, exp, trial_id, why)

    def interrupt(self, count: int) -> None:
        """Ctrl-C in embedded mode: first pause (checkpoint), then stop at once."""
        if count == 1:
            for exp_id in list(self.experiments):
                if self.store.get_experiment(exp_id).state == State.ACTIVE:
                    self.pause(exp_id)
            self._out(
                "det-local: pausing; trials are asked to checkpoint (Ctrl-C again to stop now)"
            )
        else:
            for run in list(self.runs.values()):
                self.supervisor.signal(run.job_id, run.pid, signal.SIGKILL)
            self._out("det-local: stopping now; trials resume from their latest checkpoint")

    # ================================================================== queue and commands
    def update_job(
        self,
        job_id: int,
        *,
        priority: int | None = None,
        ahead_of: int | None = None,
        behind_of: int | None = None,
    ) -> str:
        return self.queue.update_job(
            job_id,
            priority=priority,
            ahead_of=ahead_of,
            behind_of=behind_of,
            experiment_priority=self.set_experiment_priority,
        )

    def set_experiment_priority(self, experiment_id: int, priority: int) -> str:
        check_priority(priority)
        self.experiment(experiment_id)
        self.store.set_experiment_priority(experiment_id, priority)
        self.queue.set_group_priority(experiment_id, priority)
        self.queue.schedule()
        return f"experiment {experiment_id}: priority {priority}"

    def submit_command(self, *, pool: str | None = None, **request: Any) -> int:
        if is_default(pool):
            return self.commands.submit(**request)
        # another pool's command holds none of this machine's slots; its pool has them
        slots = self.pools.check_command(pool, request)
        job_id = self.commands.submit(**{**request, "slots": 0, "anywhere": False})
        self.store.job_pools.set(job_id, str(pool), slots)
        return job_id

    def kill_job(self, job_id: int) -> str:
        job = self.store.jobs.get(job_id)
        if job.kind == JobKind.TRIAL:
            assert job.experiment_id is not None
            return self.kill(job.experiment_id)
        remote = self.gangs.kill_remote(job)
        if remote is not None:
            return remote
        return self.commands.kill(self.store.jobs.get(job_id))

    def start_unmanaged(self, payload: dict[str, Any], *, user: str, uid: int) -> dict[str, Any]:
        return unmanaged.start(self, payload, user=user, uid=uid)


def _print_err(line: str) -> None:
    """The engine's default output: stderr, never raising (a closed or broken stderr must not
    interrupt what the engine was doing, such as handling a trial's exit)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
