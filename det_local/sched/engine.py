"""The engine: experiments and their searchers, and the events that pass between components.

One engine per DET_LOCAL_HOME. It is the only writer of the store. Events come from three
sources, all on one asyncio loop, and nothing polls for work:

* the spool (submissions and control requests): `sched/intake/spoolserver.py` reads them and
  `sched/intake/dispatch.py` hands each to its handler in `sched/intake/handlers.py`, which calls
  the engine;
* the trial socket (trial reports): `sched/sessions/trialserver.py` authenticates sessions and
  `sched/sessions/trialmessages.py` handles each message, calling the engine for what touches a
  searcher;
* process exits: `sched/run/supervisor.py` watches the runs it spawned through the launcher
  (`sched/run/launcher.py`) and calls :meth:`Engine._on_job_exit` once a run is wholly gone.

The engine owns the experiments (`sched/life/experiments.py`), turns searcher actions into trials
and jobs, decides what a trial's exit means (`sched/life/outcome.py`), and starts trials when the
queue (`sched/queue/jobqueue.py`) says so (`sched/run/trialstart.py` prepares the plan). Commands
are
`sched/run/commands.py`'s, checkpoint GC is `sched/life/ckpt_gc.py`'s. `docs/architecture.md` has
the
whole picture. The daemon runs an engine for good; `det-local run` with no daemon runs one in
its own process for the life of the run (embedded mode).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from det_local.errors import DetLocalError
from det_local.pools import is_default, load_pools
from det_local.sched.gangs import GangShares
from det_local.sched.intake.dispatch import apply_request
from det_local.sched.intake.spool import Request
from det_local.sched.intake.spoolserver import SpoolServer
from det_local.sched.intake.submission import record_experiment
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
from det_local.sched.queue.inventory import LocalInventory
from det_local.sched.queue.jobqueue import JobQueue, check_priority
from det_local.sched.queue.policy import check_request
from det_local.sched.restart import recover
from det_local.sched.run import cgroups
from det_local.sched.run.commands import Commands
from det_local.sched.run.launcher import LocalLauncher
from det_local.sched.run.privatestart import prepare_private
from det_local.sched.run.runas import identity, uid_of
from det_local.sched.run.supervisor import Exit, Supervisor
from det_local.sched.run.trialstart import StartFailed, TrialStarter
from det_local.sched.sessions import unmanaged
from det_local.sched.sessions.reports import Reports
from det_local.sched.sessions.trialmessages import handle as handle_message
from det_local.sched.sessions.trialserver import TrialServer, send
from det_local.sched.settings import DaemonSettings, load_settings
from det_local.search.actions import Action, Close, Create, Shutdown, Stop, ValidateAfter
from det_local.store.db import Store, current_user
from det_local.store.paths import Paths
from det_local.store.private import PrivateFiles
from det_local.store.states import JobKind, JobState, State
from det_local.store.tables.jobs import JobRecord

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
        self._pools_of: dict[int, str] = {}  # experiment id -> its pool
        self.supervisor = Supervisor(
            self.pools.launcher(
                self.launcher, self.paths, self._pool_of_job, self._pool_slots, self.note
            ),
            self.store.jobs,
            note=self.note,
            on_exit=self._on_job_exit,
            journal=self.journal if daemon else None,
        )
        self.slots = LocalInventory(
            self.inventory,
            foreign_busy=self.settings.foreign_gpus_busy,
            our_pids=self.supervisor.our_pids,
        )
        from det_local.sched.daytwo import drain

        drain.load(self)  # slots an admin disabled stay disabled across restarts
        self.queue = JobQueue(
            self.store.jobs,
            self.store.next_trial_run,
            self.slots,
            self.settings,
            self,
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
            slots_remedy=self._cpu_slots_remedy,
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
        self.gangs = GangShares(self)  # trials across machines (federate/ places them)
        self.reports = Reports(
            self.store, note=self.note, apply=self.apply, fail=self._searcher_failed
        )
        self.trial_server = TrialServer(self.paths.socket, self, self.note)
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
        await self.trial_server.start()
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
        """Validate, snapshot the context, record the experiment and start its searcher.

        ``env`` is the submitter's environment: its allow-listed variables (PATH, LANG...) are
        kept, in a private file, for the experiment's trials; the rest is dropped here.

        With test_mode the config is rewritten as Determined's `--test` does, and the trial runs
        twice: one batch + validation + checkpoint, then a fresh process that restores that
        checkpoint and trains one more batch."""
        from det_local.sched.run.userfiles import check_umask, current_umask

        # the submitter's umask: its trials run with it (a local run: this process's own)
        umask = current_umask() if umask is None and uid is None else check_umask(umask)
        if test_mode:
            from det_local.config import make_test_config

            cfg = make_test_config(cfg)
        slots = int(cfg.resources.slots_per_trial)
        self.pools.check_experiment(cfg, self.paths.home)
        fit = None if not is_default(cfg.resources.resource_pool) else self.gangs.fit(slots)
        if not is_default(cfg.resources.resource_pool):
            pass  # the pool's own scheduler has the slots (checked above)
        elif fit is not None or cfg.resources.federate:
            self.gangs.check_storage(cfg)
        else:  # not a gang across machines: this one must do
            check_request(
                slots,
                self.inventory.size(),
                "resources.slots_per_trial",
                more=self._cpu_slots_remedy(slots),
            )
        owner = os.getuid() if uid is None else uid
        exp_id, searcher, config = record_experiment(
            self.store,
            self.paths,
            self.private,
            cfg,
            context_src,
            source,
            user=user or self.user,
            uid=owner,
            env=env,
            umask=umask,
        )
        exp = ExperimentRun(exp_id, cfg, searcher, checkpoint_dir_for(self.paths, config))
        exp.test_mode = test_mode
        self.add_experiment(exp, owner)
        self.apply(exp, searcher.initial_actions())
        self.check_idle()
        return exp_id

    def _cpu_slots_remedy(self, slots: int) -> str | None:
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
                    self.enqueue_trial(exp, exp.trial_of[action.request_id])
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
                    self.preempt(run, exp)
            elif isinstance(action, Shutdown):
                exp.shutdown = action
        self.save_searcher(exp)
        # queue every created trial for slots
        created = [a for a in actions if isinstance(a, Create)]
        if created and exp.stopping is None:
            for action in created:
                self.enqueue_trial(exp, exp.trial_of[action.request_id])
            self.queue.schedule()
        self.maybe_finish(exp)

    # ================================================================== trials as jobs
    def enqueue_trial(self, exp: ExperimentRun, trial_id: int) -> None:
        """Queue the trial (again) for slots; it starts when the policy says so."""

        def create() -> int:
            rec = self.store.get_experiment(exp.id)
            override = self.store.get_experiment_priority(exp.id)
            size = int(exp.config.resources.slots_per_trial)
            pooled = not is_default(exp.config.resources.resource_pool)
            fit = None if pooled else self.gangs.fit(size)
            return self.store.jobs.create(
                kind=JobKind.TRIAL,
                name=f"{rec.name} (trial {trial_id})",
                user=rec.user,
                uid=self.user_ids.get(exp.id, uid_of(rec.user)),
                priority=(
                    int(exp.config.resources.effective_priority) if override is None else override
                ),
                # another pool's trial holds none of this machine's slots
                slots_needed=0 if pooled else size if fit is None else fit.local,
                experiment_id=exp.id,
                trial_id=trial_id,
                umask=self.store.get_experiment_umask(exp.id),
                gang=None if fit is None else {"size": size, "per_node": fit.per_node},
                anywhere=fit is None and not pooled and bool(exp.config.resources.federate),
            )

        self.queue.enqueue_trial(trial_id, create)

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
        exp = self.experiment(job.experiment_id)
        trial_id = job.trial_id
        # derived from the daemon's key: stored nowhere, recomputed after a restart
        token = self.private.run_token(job.id, run_id)
        in_use = [p for r in self.runs.values() for p in r.ports.values()]
        try:
            plan, run = self.trials.prepare(
                exp, job, slots, token, run_id, in_use, rendezvous=rendezvous, ports=ports
            )
        except StartFailed as err:
            self._trial_failed_to_start(exp, trial_id, str(err))
            return
        self.runs[trial_id] = run  # before the spawn: a fast trial may connect at once
        run.spawned_at = time.monotonic()
        try:
            proc = self.supervisor.spawn(job, plan)
        except DetLocalError as err:
            del self.runs[trial_id]
            self.queue.finish_trial_job(trial_id, None, str(err))
            self._trial_failed_to_start(exp, trial_id, f"trial {trial_id}: {err}")
            return
        run.pid = proc.pid
        run.warm = bool(getattr(proc, "forked", False))

    def start_command(self, job: JobRecord) -> None:
        self.commands.start(job)

    def start_gang_share(self, job: JobRecord) -> None:
        """A gang's share holds its slots (RESERVED): the placer does the rest."""
        placer = self.gangs.placer
        if placer is None:  # the federation stopped: the share waits for it
            self.gangs.release(job.id, "the cluster is off")
            self.queue.hold_back[job.id] = "waiting for the cluster (federation is off)"
        elif job.kind == JobKind.MEMBER:
            placer.member_started(job)
        else:
            placer.share_started(job)

    def gang_exited(self, run: TrialRun, code: int) -> None:
        """Every rank of a gang has stopped, on every node (the placer says so)."""
        if self.runs.get(run.trial_id) is run:
            self.on_trial_exit(run, code)
        self.queue.schedule()

    def relay_run(self, job_id: int) -> TrialRun | None:
        return self.gangs.relays.get(job_id)

    def preempt_trial(self, job: JobRecord) -> bool:
        """The policy chose the trial's job as a victim: it checkpoints and requeues."""
        if job.gang is not None and (job.state == JobState.RESERVED or job.kind == JobKind.MEMBER):
            if self.gangs.placer is None:
                return False
            self.gangs.placer.yield_share(job, f"job {job.id} is preempted by more important work")
            return job.state != JobState.RESERVED  # a released share is back in the queue at once
        run = self.runs.get(job.trial_id or -1)
        if run is None:
            return False
        run.requeue_requested = True
        self.note(
            f"trial {job.trial_id} (priority {job.priority}) is preempted for more important "
            "work: it checkpoints and waits in the queue",
            experiment_id=job.experiment_id,
            trial_id=job.trial_id,
        )
        self.preempt(run, self.experiment(run.experiment_id))
        return True

    def adopt_trial(self, exp: ExperimentRun, job: JobRecord) -> TrialRun:
        """A TrialRun for a trial process an earlier daemon started (its token is derived again
        from the daemon's key)."""
        assert job.trial_id is not None
        run = TrialRun(
            job.trial_id,
            exp.id,
            exp.request_of[job.trial_id],
            job.run_id,
            self.private.run_token(job.id, job.run_id),
            job.id,
            job.pid or 0,
        )
        if job.preempt_acked:  # preempted before the restart: its exit means "requeue me"
            run.acked = True
            run.requeue_requested = True
            self.queue.preempting.add(job.id)
        self.runs[job.trial_id] = run
        return run

    def fail_trial_start(self, experiment_id: int, trial_id: int, message: str) -> None:
        """The trial cannot start as configured (a gang a member refused for good)."""
        self._trial_failed_to_start(self.experiment(experiment_id), trial_id, message)

    def _trial_failed_to_start(self, exp: ExperimentRun, trial_id: int, message: str) -> None:
        self.note(message, experiment_id=exp.id, trial_id=trial_id, level="ERROR")
        self.queue.finish_trial_job(trial_id, None, message)
        self.store.set_trial_state(trial_id, State.ERROR, message)
        self.apply(exp, exp.searcher.on_trial_exited_early(exp.request_of[trial_id], "ERRORED"))

    # ================================================================== process exits
    def journal(self, line: str) -> None:
        """A line in the daemon's log only (job starts and ends: `sched/run/joblog.py`)."""
        self._out(f"det-local: {line}")

    def _on_job_exit(self, ended: Exit) -> None:
        """A job's run is wholly gone (the supervisor reaped it): what it means (the daemon
        logs it), then a pass."""
        job = self.store.jobs.peek(ended.job_id)
        decided = self._job_exited(job, ended)
        if self.daemon:
            from det_local.sched.run.joblog import ended as ended_line

            self.journal(ended_line(job, ended.code, self.store.jobs.peek(job.id)))
        if decided:
            self.queue.schedule()

    def _job_exited(self, job: JobRecord, ended: Exit) -> bool:
        """What the exit means; False while a gang's other nodes decide it."""
        self.queue.preempting.discard(ended.job_id)
        if ended.lost is not None and job.trial_id is not None:  # the pool lost it
            self.gangs.peer_lost.setdefault(job.trial_id, f"its run {ended.lost}")
        if job.kind == JobKind.MEMBER:
            self.gangs.member_job_exited(job, ended.code)
        elif job.kind == JobKind.TRIAL:
            run = self.runs.get(job.trial_id or -1)
            placer = self.gangs.placer
            if (
                run is not None
                and job.gang is not None
                and placer is not None
                and placer.owner_exited(run, ended.code)
            ):
                return False  # decided once the other nodes' ranks have stopped too
            if (
                run is not None
                and job.gang is not None
                and (placer is None or job.id in self.gangs.adopted)
            ):  # its ranks on other machines were out of reach: a machine lost, not a failure
                self.gangs.peer_lost.setdefault(
                    run.trial_id, "the cluster was off while its ranks ran on other machines"
                )
            if run is not None:
                self.on_trial_exit(run, ended.code, ended.unstarted)
        else:
            self.commands.on_exit(job, ended.code, ended.problem or ended.unstarted)
        return True

    def _pool_of_job(self, job: JobRecord) -> str:
        """The resource pool of a job's experiment (the pool router asks)."""
        exp_id = job.experiment_id
        if exp_id is None:  # a command: `cmd run --pool`
            row = self.store.job_pools.get(job.id)
            return "" if row is None else row[0]
        if exp_id not in self._pools_of:
            config = self.store.get_experiment(exp_id).config
            self._pools_of[exp_id] = self.pools.pool_of_config(config)
        return self._pools_of[exp_id]

    def _pool_slots(self, job: JobRecord) -> int | None:
        """The slots a command asked of its pool (None: a trial's come from its config)."""
        row = self.store.job_pools.get(job.id) if job.experiment_id is None else None
        return None if row is None else row[1]

    def run_ending(self, run: TrialRun) -> None:
        """The run's pool ends it soon (a Slurm time limit): it checkpoints, and is queued
        again to continue (not a failure)."""
        if self.runs.get(run.trial_id) is not run or run.preempt_sent:
            return
        run.requeue_requested = True
        self.note(
            f"trial {run.trial_id}: its job reaches its time limit soon; it checkpoints and "
            "continues in a new job",
            experiment_id=run.experiment_id,
            trial_id=run.trial_id,
        )
        self.preempt(run, self.experiment(run.experiment_id))

    def on_trial_exit(self, run: TrialRun, code: int, unstarted: str | None = None) -> None:
        trialexit.trial_exited(self, run, code, unstarted)

    def maybe_finish(self, exp: ExperimentRun) -> None:
        trialexit.finish_if_done(self, exp)

    def preempt(self, run: TrialRun, exp: ExperimentRun) -> None:
        if run.preempt_sent:
            return
        run.preempt_sent = True
        for w in run.writers:
            send(w, {"t": "preempt"})
        if self.gangs.placer is not None:
            self.gangs.placer.down(run, {"t": "preempt"})
        configured = exp.config.preemption_timeout
        timeout = self.settings.preemption_timeout if configured is None else float(configured)
        assert self.loop is not None
        run.timers.append(self.loop.call_later(timeout, self.terminate, run))

    def terminate(self, run: TrialRun) -> None:
        """SIGTERM the group, then SIGKILL after a grace period."""
        if run.trial_id not in self.runs:
            return
        self.supervisor.terminate(run.job_id, run.pid)
        if self.gangs.placer is not None:
            self.gangs.placer.stop(run)

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
        slots = self.pools.check_command(pool, request.get("kind", "COMMAND"), request["slots"])
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

    # ================================================================== trial sessions
    def managed_run(self, trial_id: int) -> TrialRun | None:
        return self.runs.get(trial_id)

    def is_live(self, run: TrialRun) -> bool:
        return (
            self.runs.get(run.trial_id) is run
            or self.unmanaged.get(run.trial_id) is run
            or self.gangs.relays.get(run.job_id) is run
        )

    def run_uid(self, run: TrialRun) -> int:
        """The uid a run's processes have: its job's user under a root daemon, else ours."""
        if os.geteuid() != 0:
            return os.geteuid()
        if self.unmanaged.get(run.trial_id) is run:  # a core_v2 process: no job
            return int(self.user_ids[run.experiment_id])
        return int(self.store.jobs.peek(run.job_id).uid)

    def unmanaged_hello(self, msg: dict[str, Any], writer: asyncio.StreamWriter) -> TrialRun | None:
        return unmanaged.hello(self, msg, writer)

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
        if run.trial_id in self.unmanaged:
            unmanaged.disconnected(self, run)

    def handle(self, run: TrialRun, msg: dict[str, Any], uid: int) -> Any:
        if run.request_id == "relay":  # a rank of another machine's trial: its owner applies it
            placer = self.gangs.placer
            if placer is None:
                raise DetLocalError(
                    "this machine's cluster link is off; the trial's owner is unreachable"
                )
            return placer.relay(run, msg)
        return handle_message(self, run, msg, uid)

    def experiment_of(self, run: TrialRun) -> ExperimentRun:
        return self.experiments[run.experiment_id]

    def end_unmanaged(self, run: TrialRun, msg: dict[str, Any]) -> bool:
        if self.unmanaged.get(run.trial_id) is not run:
            return False
        unmanaged.on_end(self, run, msg)
        return True


def _print_err(line: str) -> None:
    """The engine's default output: stderr, never raising (a closed or broken stderr must not
    interrupt what the engine was doing, such as handling a trial's exit)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
