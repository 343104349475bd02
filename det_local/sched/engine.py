"""The engine: experiments, their searchers and their trial processes, driven by events.

One engine per DET_LOCAL_HOME. It is the only writer of the store. Events come from the
spool (submissions and control requests, `sched/requests.py`), the socket (trial reports,
`sched/trialsocket.py`) and process exits (pidfds, `sched/queue.py`); nothing polls for work.
The daemon runs an engine for good; `det-local run` with no daemon runs one in its own process
for the life of the run (embedded mode).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from det_local.errors import (
    CheckpointError,
    ContextError,
    DetLocalError,
    NotFoundError,
    StateError,
)
from det_local.launch.ports import allocate_ports, port_env
from det_local.sched import cgroups, ckpt_gc, executor, spool, unmanaged, userfiles
from det_local.sched.backlog import Backlog, Bursts
from det_local.sched.outcome import ExitFacts, Outcome, decide, describe_exit
from det_local.sched.plan import (
    LaunchPlan,
    allowed_submitter_vars,
    base_env,
    check_entrypoint,
    entrypoint_argv,
    trial_env,
    trial_extra,
)
from det_local.sched.policy import check_request
from det_local.sched.queue import QueueMixin, _identity
from det_local.sched.requests import RequestsMixin
from det_local.sched.settings import DaemonSettings, load_settings
from det_local.sched.trialsocket import SocketState, TrialSocketMixin, _write
from det_local.search import Searcher, make_searcher
from det_local.search.actions import Action, Close, Create, Shutdown, Stop, ValidateAfter
from det_local.store.db import Store, current_user
from det_local.store.jobs import JobRecord
from det_local.store.paths import Paths
from det_local.store.private import PrivateFiles
from det_local.store.records import CHECKPOINT_DELETED
from det_local.store.states import State

KILL_GRACE = 10.0


@dataclass
class TrialRun:
    """One live process (run) of a trial."""

    trial_id: int
    experiment_id: int
    request_id: str
    run_id: int
    token: str
    job_id: int
    pid: int
    ports: dict[str, int] = field(default_factory=dict)  # rendezvous ports of this run
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    preempt_sent: bool = False
    acked: bool = False
    invalid_hp: bool = False
    kill_requested: bool = False
    stop_requested: bool = False
    requeue_requested: bool = False
    timers: list[asyncio.TimerHandle] = field(default_factory=list)


@dataclass
class ExperimentRun:
    id: int
    config: Any  # det_local.config.ExperimentConfig
    searcher: Searcher
    checkpoint_dir: Path
    trial_of: dict[str, int] = field(default_factory=dict)  # request id -> trial id
    request_of: dict[int, str] = field(default_factory=dict)
    ops: dict[str, deque[int]] = field(default_factory=dict)
    closed: set[str] = field(default_factory=set)
    stopping: str | None = None  # "pause" | "kill"
    shutdown: Shutdown | None = None
    best: float | None = None
    progress: dict[int, float] = field(default_factory=dict)
    test_mode: bool = False  # `run --test`: one batch, validate, checkpoint, then a restore run
    waiting: set[str] = field(default_factory=set)  # promotion ASHA: out of ops, may be promoted


def checkpoint_dir_for(paths: Paths, config: dict[str, Any]) -> Path:
    storage = config.get("checkpoint_storage") or {}
    kind = storage.get("type")
    if kind == "shared_fs":
        host = Path(storage["host_path"])
        sub = storage.get("storage_path")
        return host / sub if sub else host
    if kind == "directory":
        return Path(storage["container_path"])
    return paths.checkpoints


class Engine(TrialSocketMixin, QueueMixin, RequestsMixin):
    def __init__(
        self,
        paths: Paths,
        *,
        out: Callable[[str], None] | None = None,
        daemon: bool = False,
        offline: bool = False,
    ) -> None:
        from det_local.sched import slots

        self.paths = paths.ensure()
        self.daemon = daemon
        self.offline = offline  # one request with no engine running: never start anything
        self.settings: DaemonSettings = load_settings(paths.settings)
        self.inventory = slots.discover(cpu_slots=self.settings.cpu_slots)
        # how jobs are contained: detected at start (it creates this home's cgroup subtree)
        self.containment = cgroups.Containment(cgroups.OFF, "the engine has not started")
        self.store = Store(paths.db)
        self.private = PrivateFiles(paths)  # what must not be in the database: tokens, envs
        self.private.ensure()
        self.user = current_user()
        self.experiments: dict[int, ExperimentRun] = {}
        self.runs: dict[int, TrialRun] = {}  # trial id -> live run
        self.unmanaged: dict[int, TrialRun] = {}  # trial id -> unmanaged run (core_v2)
        self.procs: dict[int, executor.JobProc] = {}  # job id -> live process
        self.user_ids: dict[int, int] = {}  # experiment id -> submitter's uid
        self.socket_state = SocketState()  # the trial socket's limits and refusal log
        self.waiting: dict[int, str] = {}  # queued job id -> why it waits
        self._preempting: set[int] = set()
        self.gc_running: set[int] = set()  # experiments whose checkpoint files are being removed
        self._killing: set[int] = set()
        self._scheduling: bool = False
        self._schedule_again: bool = False
        self.kill_grace = KILL_GRACE
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: asyncio.AbstractServer | None = None
        self._idle = asyncio.Event()
        self.closing = False
        self._tasks: list[asyncio.Future[None]] = []
        self._watch_stop = asyncio.Event()
        self._stop_requested = asyncio.Event()
        self._spool_retry: asyncio.TimerHandle | None = None
        self._spool_failed: str | None = None  # the last failure logged (logged once)
        self._spool_watch_close: Callable[[], None] | None = None
        self._spool_removing: set[str] = set()
        self._spool_more_due = False
        self._spool_remover: Any = None
        self._spool_answering: set[str] = set()
        self._spool_backlog = Backlog(paths.queue, spool.SUFFIX)
        self._spool_bursts: Bursts | None = None
        self._spool_burst_summary: Any = None
        self._spool_burst_timer: asyncio.TimerHandle | None = None
        self._foreign_held = False  # a slot is busy only because of a foreign process
        self._foreign_timer: asyncio.TimerHandle | None = None
        self._out = out or (lambda line: print(line, file=sys.stderr, flush=True))

    # ================================================================== lifecycle
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.containment = cgroups.detect(self.paths.home, self.settings.cgroup_setting())
        sock = self.paths.socket
        if sock.exists():
            sock.unlink()
        self.server = await asyncio.start_unix_server(self._on_connection, path=str(sock))
        # trials of every user connect (a per-run token authenticates them); the daemon alone
        # serves other users, so only a root daemon opens the socket to them
        os.chmod(sock, 0o666 if os.geteuid() == 0 else 0o600)
        self._private_start()
        self._recover()
        ckpt_gc.collect_pending(self)  # ended experiments whose checkpoint GC did not finish
        self._start_spool()
        self._schedule()

    async def wait_idle(self) -> None:
        """Return once no experiment has a live process or pending work (embedded mode).

        From then on the engine is `closing`: it refuses new work (submit, activate) with a
        `retry` reply, so that nothing starts in an engine about to stop; the client then runs
        the request in an engine of its own."""
        while True:
            self._check_idle()
            if self._idle.is_set():
                self.closing = True  # no await since the check: nothing slipped in between
                self._watch_stop.set()
                return
            await self._idle.wait()

    async def serve_forever(self) -> None:
        """The daemon: run until `daemon stop` (or SIGTERM); jobs outlive it and are adopted
        by the next daemon."""
        await self._stop_requested.wait()
        self.closing = True
        self._watch_stop.set()

    def request_stop(self) -> None:
        self._stop_requested.set()

    def stop_taking_work(self) -> None:
        """An embedded engine about to stop before it is idle (`cmd run -f` interrupted):
        requests wait in the spool for the next engine, as after `wait_idle`."""
        self.closing = True
        self._watch_stop.set()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._spool_watch_close is not None:
            self._spool_watch_close()
            self._spool_watch_close = None
        if self._spool_burst_timer is not None:
            self._spool_burst_timer.cancel()
            self._flush_spool_log(force=True)  # the counts of rejections not logged yet
        # what the remover thread has not got to yet (refused requests not answered yet stay:
        # the next engine answers them)
        for name in list(self._spool_removing - self._spool_answering):
            try:
                spool.remove(self.paths.queue / name)
            except OSError:
                pass
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        try:
            self.paths.socket.unlink()
        except FileNotFoundError:
            pass
        self.store.close()
        self.containment.remove_base()  # when no job runs on in it

    def _check_idle(self) -> None:
        active = any(
            self.store.get_experiment(e).state
            in (State.ACTIVE, State.STOPPING_CANCELED, State.STOPPING_PAUSED)
            for e in self.experiments
        )
        if not self.procs and not active and not self.gc_running and not self.store.jobs.active():
            self._idle.set()
        else:
            self._idle.clear()

    def note(
        self,
        message: str,
        *,
        experiment_id: int | None = None,
        trial_id: int | None = None,
        level: str = "INFO",
    ) -> None:
        self.store.add_event(message, experiment_id=experiment_id, trial_id=trial_id, level=level)
        self._out(f"det-local: {message}")

    # ================================================================== submission
    def submit(
        self,
        cfg: Any,
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

        from det_local.sched.userfiles import check_umask, current_umask

        # the submitter's umask: its trials run with it (a local run: this process's own)
        umask = current_umask() if umask is None and uid is None else check_umask(umask)
        if test_mode:
            from det_local.config import make_test_config

            cfg = make_test_config(cfg)

        check_request(
            int(cfg.resources.slots_per_trial),
            self.inventory.size(),
            "resources.slots_per_trial",
            more=self._cpu_slots_remedy(int(cfg.resources.slots_per_trial)),
        )
        staging = self.paths.staging_dir(uuid.uuid4().hex)
        identity = _identity(os.getuid() if uid is None else uid)
        # the snapshot first: a missing, oversized or shadowing context is named as such
        self._snapshot_as(identity, context_src, staging)
        try:
            with executor.acting_as(**identity):
                check_entrypoint(cfg.entrypoint, context_src, source, snapshot=staging)
            # refuses forms this version cannot run (a multi-slot Trial class, launchers)
            entrypoint_argv(
                cfg.entrypoint,
                context_src,
                slots_per_trial=int(cfg.resources.slots_per_trial),
            )
            searcher = make_searcher(cfg)
            warm = self._warm_start(cfg)
            if warm is not None:
                searcher._warm = warm
            config = cfg.to_dict()
            exp_id = self.store.create_experiment(
                name=cfg.name,
                config=config,
                labels=cfg.labels,
                description=cfg.description,
                user=user or self.user,
                umask=umask,
            )
            # before the commit; always written: an id a rolled-back submission had is reused
            self.private.save_experiment_env(exp_id, allowed_submitter_vars(env or {}))
            dest = self.paths.context_dir(exp_id)
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.exists():  # left by a submission whose record a crash rolled back
                shutil.rmtree(dest)
            os.replace(staging, dest)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.store.set_experiment_context(exp_id, str(dest))
        exp = ExperimentRun(exp_id, cfg, searcher, checkpoint_dir_for(self.paths, config))
        exp.test_mode = test_mode
        self.experiments[exp_id] = exp
        self.user_ids[exp_id] = os.getuid() if uid is None else uid
        self._apply(exp, searcher.initial_actions())
        self._check_idle()
        return exp_id

    def _cpu_slots_remedy(self, slots: int) -> str | None:
        from det_local.sched.slots import cpu_slots_remedy

        configured = self.settings.cpu_slots is not None
        return cpu_slots_remedy(
            self.inventory,
            slots,
            daemon=self.daemon,
            settings_path=str(self.paths.settings) if configured else None,
        )

    def _snapshot_as(self, identity: dict[str, Any], src: Path, dest: Path) -> None:
        """Snapshot a context with its submitter's rights: a root daemon copies only what the
        submitter may read (in system mode the copy is built in a box of theirs)."""
        from det_local.store.context import snapshot_context

        if not identity:
            snapshot_context(src, dest)
            return
        box = dest.with_name(f"{dest.name}.box")
        box.mkdir(parents=True)
        try:
            os.chown(box, identity["uid"], identity["gid"])
            with executor.acting_as(**identity):
                try:
                    snapshot_context(src, box / "context")
                except PermissionError as err:  # where the context's own checks do not look
                    raise ContextError(
                        f"cannot read context {src} as {_user_name(identity['uid'])}: "
                        f"permission denied ({err.filename or src})"
                    ) from None
            os.replace(box / "context", dest)
        finally:
            shutil.rmtree(box, ignore_errors=True)

    def _warm_start(self, cfg: Any) -> str | None:
        s = cfg.searcher
        if s.source_checkpoint_uuid:
            self._usable_checkpoint(
                str(s.source_checkpoint_uuid), "searcher.source_checkpoint_uuid"
            )
            return str(s.source_checkpoint_uuid)
        if s.source_trial_id is not None:
            trial = self.store.get_trial(int(s.source_trial_id))
            if trial.latest_checkpoint is None:
                raise DetLocalError(
                    f"searcher.source_trial_id: trial {trial.id} has no checkpoint to start from"
                )
            self._usable_checkpoint(trial.latest_checkpoint, "searcher.source_trial_id")
            return trial.latest_checkpoint
        return None

    def _usable_checkpoint(self, uuid: str, field: str) -> None:
        """A warm start's checkpoint must still have its files (checkpoint GC may have removed
        them when its experiment ended)."""
        ckpt = self.store.get_checkpoint(uuid)
        if ckpt.state == CHECKPOINT_DELETED:
            raise DetLocalError(
                f"{field}: checkpoint {uuid} (trial {ckpt.trial_id}) was deleted by checkpoint "
                f"GC when experiment {ckpt.experiment_id} ended; start from another one "
                f"(`det-local checkpoint list {ckpt.experiment_id}`), or raise checkpoint_storage "
                "save_trial_best/save_trial_latest next time"
            )

    # ================================================================== searcher actions
    def _apply(self, exp: ExperimentRun, actions: list[Action]) -> None:
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
                    self._enqueue_trial(exp, exp.trial_of[action.request_id])
            elif isinstance(action, Close):
                exp.closed.add(action.request_id)
                if action.request_id in exp.waiting:  # never promoted: it is done
                    exp.waiting.discard(action.request_id)
                    self.store.set_trial_state(exp.trial_of[action.request_id], State.COMPLETED)
                    self._apply(exp, exp.searcher.on_trial_exited(action.request_id))
            elif isinstance(action, Stop):
                run = self.runs.get(exp.trial_of.get(action.request_id, -1))
                if run is not None:
                    run.stop_requested = True
                    self._preempt(run, exp)
            elif isinstance(action, Shutdown):
                exp.shutdown = action
        self.store.set_searcher_state(exp.id, self._searcher_snapshot(exp))
        # queue every created trial for slots
        created = [a for a in actions if isinstance(a, Create)]
        if created and exp.stopping is None:
            for action in created:
                self._enqueue_trial(exp, exp.trial_of[action.request_id])
            self._schedule()
        self._maybe_finish(exp)

    @staticmethod
    def _searcher_snapshot(exp: ExperimentRun) -> dict[str, Any]:
        return {
            "searcher": exp.searcher.snapshot(),
            "trial_of": exp.trial_of,
            "ops": {k: list(v) for k, v in exp.ops.items()},
            "closed": sorted(exp.closed),
            "shutdown": None if exp.shutdown is None else exp.shutdown.__dict__,
            "test_mode": exp.test_mode,
            "waiting": sorted(exp.waiting),
        }

    # ================================================================== launching
    def _resume_point(self, trial_id: int) -> tuple[str | None, int]:
        """(checkpoint uuid, steps_completed) a new run starts from."""
        trial = self.store.get_trial(trial_id)
        if trial.latest_checkpoint is None:
            warm = trial.warm_start_checkpoint
            return warm, 0
        ckpts = [
            c for c in self.store.list_checkpoints(trial_id=trial_id) if c.state == "COMPLETED"
        ]
        missing: set[str] = set()  # found gone from disk just now
        for ckpt in sorted(ckpts, key=lambda c: (c.steps_completed, c.created_at), reverse=True):
            if Path(ckpt.path).is_dir():
                if ckpt.uuid != trial.latest_checkpoint:
                    message, level = self._not_latest(
                        trial_id, trial.latest_checkpoint, ckpt, missing
                    )
                    self.note(
                        message,
                        experiment_id=trial.experiment_id,
                        trial_id=trial_id,
                        level=level,
                    )
                return ckpt.uuid, ckpt.steps_completed
            missing.add(ckpt.uuid)
            self.store.mark_checkpoint_deleted(ckpt.uuid)
        raise CheckpointError(
            f"trial {trial_id}: its checkpoints (latest {trial.latest_checkpoint}) are gone from "
            f"disk, so it cannot resume where it stopped; restore the checkpoint directory or "
            f"kill the experiment and start it again"
        )

    def _test_mode_point(
        self, exp: ExperimentRun, trial_id: int, run_id: int
    ) -> tuple[str, int] | None:
        """Test mode's restore run starts from the checkpoint step 3 judged, not the latest."""
        from det_local.sched.testmode import restore_checkpoint

        if not exp.test_mode or run_id < 2:
            return None
        ckpt = restore_checkpoint(self.store, trial_id)
        return None if ckpt is None else (ckpt.uuid, ckpt.steps_completed)

    def _not_latest(
        self, trial_id: int, latest: str, chosen: Any, missing: set[str]
    ) -> tuple[str, str]:
        """(message, level) when _resume_point picked `chosen` (the checkpoint with the most
        steps still on disk), not `latest` (the trial's most recently recorded one): why."""
        resuming = f"resuming from {chosen.uuid} (steps_completed={chosen.steps_completed})"
        if latest in missing:
            return f"trial {trial_id}: checkpoint {latest} is gone from disk; {resuming}", "WARNING"
        try:
            rec = self.store.get_checkpoint(latest)
        except NotFoundError:
            return f"trial {trial_id}: checkpoint {latest} is not recorded; {resuming}", "WARNING"
        if rec.state == CHECKPOINT_DELETED:
            return f"trial {trial_id}: checkpoint {latest} was deleted; {resuming}", "WARNING"
        return (
            f"trial {trial_id}: {resuming}, which has more steps than its latest checkpoint "
            f"{latest} (steps_completed={rec.steps_completed})",
            "INFO",
        )

    def _start_trial(
        self,
        exp: ExperimentRun,
        trial_id: int,
        job: JobRecord,
        slots: list[int],
        token: str,
        run_id: int,
    ) -> None:
        """The scheduler gave the trial its slots (recorded in its job): start its process."""
        from det_local.trial.info import ClusterInfo, ResourcesInfo, TrialInfo

        try:
            latest, steps = self._test_mode_point(exp, trial_id, run_id) or self._resume_point(
                trial_id
            )
            # its submitter's allow-listed variables (a private file; None: none were sent)
            captured = self.private.experiment_env(exp.id)
        except CheckpointError as err:
            self._trial_failed_to_start(exp, trial_id, str(err))
            return
        except DetLocalError as err:  # a damaged (or replaced) private file
            self._trial_failed_to_start(exp, trial_id, f"trial {trial_id} cannot start: {err}")
            return
        trial = self.store.get_trial(trial_id)
        if trial.state == State.PAUSED:
            self.store.set_trial_state(trial_id, State.ACTIVE)
        gpu_uuids = [
            s.uuid for s in self.inventory.slots if s.index in slots and s.uuid is not None
        ]
        rec = self.store.get_experiment(exp.id)
        context = Path(rec.context_dir)
        info_dir = self.paths.trial_info_dir(exp.id, trial_id, run_id)
        config = rec.config
        info = ClusterInfo(
            master_url="unix://" + str(self.paths.socket),
            cluster_id="det-local",
            agent_id=os.uname().nodename,
            slot_ids=list(slots),
            task_id=f"{exp.id}.{trial_id}",
            allocation_id=f"{exp.id}.{trial_id}.{run_id}",
            session_token=token,
            task_type="TRIAL",
            latest_checkpoint=latest,
            trial_info=TrialInfo(
                trial_id=trial_id,
                experiment_id=exp.id,
                trial_seed=trial.seed,
                hparams=trial.hparams,
                config=config,
                steps_completed=steps,
                trial_run_id=run_id,
                debug=bool(config.get("debug")),
            ),
            user_data=config.get("data") or {},
            resources_info=ResourcesInfo(gpu_uuids),
        )
        identity = _identity(job.uid)
        self._remove_incomplete(exp, trial_id, identity)
        owner = userfiles.owner_for(identity, job.umask, self.settings.admin_group)
        try:
            _write_info(info, info_dir, owner)
        except (OSError, DetLocalError) as err:
            why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            self._trial_failed_to_start(
                exp, trial_id, f"trial {trial_id}: cannot write its run directory {info_dir}: {why}"
            )
            return
        # unique rendezvous ports per running trial, so two multi-slot trials never collide
        ports = allocate_ports(in_use=[p for r in self.runs.values() for p in r.ports.values()])
        # a clean environment: the submitter's allow-listed variables, never the daemon's
        base = base_env(captured, job.uid)
        plan = LaunchPlan(
            argv=entrypoint_argv(
                config["entrypoint"],
                context,
                slots_per_trial=int(exp.config.resources.slots_per_trial),
            ),
            env=trial_env(
                base=base,
                experiment_id=exp.id,
                trial_id=trial_id,
                run_id=run_id,
                seed=trial.seed,
                hparams=trial.hparams,
                config=config,
                steps_completed=steps,
                latest_checkpoint=latest,
                slots=list(slots),
                socket_path=str(self.paths.socket),
                token=token,
                info_dir=str(info_dir),
                checkpoint_dir=str(exp.checkpoint_dir),
                user=job.user,
                extra=trial_extra(
                    config,
                    base=base,
                    home=str(self.paths.home),
                    threads=self.inventory.cpu_threads(len(slots)),
                    visible_devices=self.inventory.visible_devices(slots),
                    ports=port_env(ports),
                    test_mode=exp.test_mode,
                )
                + (  # its checkpoints get the admin group's ACL entry (store/acl.py)
                    [f"DET_LOCAL_ADMIN_GID={owner.admin_gid}"]
                    if owner is not None and owner.admin_gid is not None
                    else []
                ),
            ),
            cwd=str(context),
            user=job.user,
            slots=list(slots),
            log_path=str(self.paths.trial_log(exp.id, trial_id)),
            info_dir=str(info_dir),
            ports=ports,
            umask=job.umask,
            admin_gid=owner.admin_gid if owner is not None else None,
            **identity,
        )
        try:  # a storage path of the user's choosing is created with the user's rights
            with executor.acting_as(**identity):
                if owner is None:
                    exp.checkpoint_dir.mkdir(parents=True, exist_ok=True)
                else:  # and their umask
                    userfiles.makedirs_as_user(exp.checkpoint_dir, owner)
        except OSError as err:
            self._trial_failed_to_start(
                exp,
                trial_id,
                f"trial {trial_id}: cannot create checkpoint storage {exp.checkpoint_dir}"
                f" as {job.user}: {err.strerror}; fix checkpoint_storage",
            )
            return
        if identity and exp.checkpoint_dir == self.paths.checkpoints:
            _share_with(exp.checkpoint_dir)
        run = TrialRun(
            trial_id, exp.id, exp.request_of[trial_id], run_id, token, job.id, 0, ports=ports
        )
        self.runs[trial_id] = run  # before the spawn: a fast trial may connect at once
        try:
            proc = self._spawn(job, plan)
        except DetLocalError as err:
            del self.runs[trial_id]
            self._finish_trial_job(trial_id, None, str(err))
            self._trial_failed_to_start(exp, trial_id, f"trial {trial_id}: {err}")
            return
        run.pid = proc.pid

    def _remove_incomplete(
        self, exp: ExperimentRun, trial_id: int, identity: dict[str, Any]
    ) -> None:
        """Before a trial starts again: the directories of checkpoints an earlier run began
        and never completed (it died while writing them) are removed, with the owner's rights
        (links are removed, never followed)."""
        targets = self.store.list_incomplete_checkpoints(trial_id=trial_id)
        if not targets:
            return
        removed, failed = ckpt_gc.remove_files(targets, identity)
        self.store.drop_incomplete_checkpoints(ckpt_gc.settled(targets, failed))
        for uuid_ in removed:
            self.note(
                f"trial {trial_id}: removed incomplete checkpoint {uuid_} (an earlier run "
                "stopped while writing it)",
                experiment_id=exp.id,
                trial_id=trial_id,
            )
        for failure in failed:
            self.note(
                f"trial {trial_id}: could not remove incomplete checkpoint {failure}; "
                "checkpoint GC tries again when the experiment ends",
                experiment_id=exp.id,
                trial_id=trial_id,
                level="WARNING",
            )

    def _adopt_trial(self, exp: ExperimentRun, job: JobRecord) -> TrialRun:
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
            self._preempting.add(job.id)
        self.runs[job.trial_id] = run
        return run

    def _trial_failed_to_start(self, exp: ExperimentRun, trial_id: int, message: str) -> None:
        self.note(message, experiment_id=exp.id, trial_id=trial_id, level="ERROR")
        self._finish_trial_job(trial_id, None, message)
        self.store.set_trial_state(trial_id, State.ERROR, message)
        self._apply(exp, exp.searcher.on_trial_exited_early(exp.request_of[trial_id], "ERRORED"))

    # ================================================================== process exits
    def _on_trial_exit(self, run: TrialRun, code: int) -> None:
        """The trial's process group is gone (reaped by the queue): decide what it means."""
        for t in run.timers:
            t.cancel()
        for w in run.writers:
            w.close()
        self.runs.pop(run.trial_id, None)
        exp = self.experiments[run.experiment_id]
        trial = self.store.get_trial(run.trial_id)
        max_restarts = int(exp.config.max_restarts)
        outcome = decide(
            ExitFacts(
                exit_code=code,
                kill_requested=run.kill_requested or exp.stopping == "kill",
                pause_requested=exp.stopping in ("pause", "error"),
                stop_requested=run.stop_requested,
                preempt_acknowledged=run.acked,
                invalid_hp=run.invalid_hp,
                restarts_done=trial.restarts,
                max_restarts=max_restarts,
                requeue_requested=run.requeue_requested,
            )
        )
        rid = run.request_id
        tid = run.trial_id
        if outcome not in (Outcome.REQUEUE, Outcome.RESTART):
            self._finish_trial_job(tid, code, outcome.value)
        if outcome == Outcome.COMPLETED and (
            self._test_mode_restore(exp, run) or self._wait_for_promotion(exp, run)
        ):
            pass  # it runs again (a restore test, or a promotion), or waits to be promoted
        elif outcome in (Outcome.COMPLETED, Outcome.STOPPED):
            self.store.set_trial_state(tid, State.COMPLETED)
            self._apply(exp, exp.searcher.on_trial_exited(rid))
        elif outcome == Outcome.INVALID_HP:
            self.store.set_trial_state(tid, State.COMPLETED, "ended early: invalid hyperparameters")
            self._apply(exp, exp.searcher.on_trial_exited_early(rid, "INVALID_HP"))
        elif outcome == Outcome.PAUSED:
            self.store.set_trial_state(tid, State.PAUSED)
            self.note(
                f"trial {tid} paused at "
                f"steps_completed={self.store.get_trial(tid).steps_completed}",
                experiment_id=exp.id,
                trial_id=tid,
            )
        elif outcome == Outcome.REQUEUE:
            self._enqueue_trial(exp, tid)
        elif outcome == Outcome.CANCELED:
            self.store.set_trial_state(tid, State.CANCELED)
            self._apply(exp, exp.searcher.on_trial_exited_early(rid, "USER_CANCELED"))
        elif outcome == Outcome.RESTART:
            n = self.store.add_restart(tid)
            self.note(
                f"trial {tid} {describe_exit(code)}; restarting from its latest checkpoint "
                f"(restart {n} of {max_restarts})",
                experiment_id=exp.id,
                trial_id=tid,
                level="WARNING",
            )
            self._enqueue_trial(exp, tid)
        else:
            msg = (
                f"trial {tid} {describe_exit(code)}"
                + (
                    f" after {trial.restarts} restart{'s' if trial.restarts > 1 else ''}"
                    if trial.restarts
                    else ""
                )
                + f"; see `det-local trial logs {tid}`"
            )
            self.store.set_trial_state(tid, State.ERROR, msg)
            self.note(msg, experiment_id=exp.id, trial_id=tid, level="ERROR")
            self._apply(exp, exp.searcher.on_trial_exited_early(rid, "ERRORED"))
        self._maybe_finish(exp)
        self._check_idle()

    def _wait_for_promotion(self, exp: ExperimentRun, run: TrialRun) -> bool:
        """Promotion-based ASHA (<=0.37): a trial that ran out of operations but is not closed
        waits, without a process, until the searcher promotes it (a new operation: it resumes
        from its checkpoint) or closes it. False when it is simply done."""
        rid = run.request_id
        if not exp.searcher.pauses_trials or rid in exp.closed:
            return False
        if exp.ops.get(rid):  # promoted while it was exiting
            self._enqueue_trial(exp, run.trial_id)
            return True
        exp.waiting.add(rid)
        self.store.set_searcher_state(exp.id, self._searcher_snapshot(exp))
        return True

    def _test_mode_restore(self, exp: ExperimentRun, run: TrialRun) -> bool:
        """Test mode, after the first run: restore its checkpoint in a fresh process and train
        one more batch (an operation one batch longer for Core API scripts). False when there is
        nothing to restore, which ends the test (the report names the missing step)."""
        from det_local.sched.testmode import restore_checkpoint

        if not exp.test_mode or run.run_id != 1:
            return False
        ckpt = restore_checkpoint(self.store, run.trial_id)
        if ckpt is None:
            return False
        exp.ops.setdefault(run.request_id, deque()).append(ckpt.steps_completed + 1)
        self.store.set_searcher_state(exp.id, self._searcher_snapshot(exp))
        self._enqueue_trial(exp, run.trial_id)
        return True

    def _maybe_finish(self, exp: ExperimentRun) -> None:
        if any(r.experiment_id == exp.id for r in self.runs.values()):
            return
        if exp.stopping is None and any(
            j.experiment_id == exp.id for j in self.store.jobs.active()
        ):
            return  # trials wait in the queue
        state = self.store.get_experiment(exp.id).state
        if exp.stopping == "kill":
            for t in self.store.list_trials(exp.id):
                if not t.state.terminal:
                    self.store.set_trial_state(t.id, State.CANCELED)
            if state != State.CANCELED:
                self.store.set_experiment_state(exp.id, State.CANCELED)
            exp.stopping = None
        elif exp.stopping == "pause":
            if state == State.STOPPING_PAUSED:  # its last trial process is gone
                self.store.set_experiment_state(exp.id, State.PAUSED)
            exp.stopping = None
        elif exp.stopping == "error":  # the searcher could not go on (see _searcher_failed)
            rec = self.store.get_experiment(exp.id)
            for t in self.store.list_trials(exp.id):
                if not t.state.terminal:
                    self.store.set_trial_state(
                        t.id, State.CANCELED, f"experiment failed: {rec.message}"
                    )
            if not state.terminal:
                self.store.set_experiment_state(exp.id, State.ERROR)
            exp.stopping = None
        elif exp.shutdown is not None and state == State.ACTIVE:
            if exp.shutdown.cancel and not exp.shutdown.failure:
                self.store.set_experiment_state(exp.id, State.CANCELED)
            elif exp.shutdown.failure:
                errs = [t for t in self.store.list_trials(exp.id) if t.state == State.ERROR]
                why = errs[0].message if errs else "every trial failed"
                self.store.set_experiment_state(exp.id, State.ERROR, why)
            else:
                self.store.set_experiment_progress(exp.id, 1.0)
                self.store.set_experiment_state(exp.id, State.COMPLETED)
        if self.store.get_experiment(exp.id).state.terminal:
            self.private.drop_experiment_env(exp.id)  # no trial of it starts again
        ckpt_gc.collect_if_ended(self, exp.id)  # once it has ended: checkpoint_storage save_*

    # ================================================================== control
    def _preempt(self, run: TrialRun, exp: ExperimentRun) -> None:
        if run.preempt_sent:
            return
        run.preempt_sent = True
        for w in run.writers:
            _write(w, {"t": "preempt"})
        timeout = exp.config.preemption_timeout
        timeout = self.settings.preemption_timeout if timeout is None else float(timeout)
        assert self.loop is not None
        run.timers.append(self.loop.call_later(timeout, self._terminate, run))

    def _terminate(self, run: TrialRun) -> None:
        """SIGTERM the group, then SIGKILL after a grace period."""
        if run.trial_id not in self.runs:
            return
        self._terminate_pid(run.pid, run.job_id)

    def _exp(self, experiment_id: int) -> ExperimentRun:
        exp = self.experiments.get(experiment_id)
        if exp is None:
            self.store.get_experiment(experiment_id)  # NotFoundError for unknown ids
            exp = self._load(experiment_id)
        return exp

    def _load(self, experiment_id: int) -> ExperimentRun:
        """Bring a stored experiment (paused or from an earlier process) into the engine."""
        from det_local.config import parse_config

        rec = self.store.get_experiment(experiment_id)
        cfg = parse_config(rec.config, source=f"experiment {experiment_id}")
        searcher = make_searcher(cfg)
        exp = ExperimentRun(
            experiment_id, cfg, searcher, checkpoint_dir_for(self.paths, rec.config)
        )
        snap = self.store.get_searcher_state(experiment_id)
        if snap:
            searcher.restore(snap["searcher"])
            exp.trial_of = {k: int(v) for k, v in snap["trial_of"].items()}
            exp.request_of = {v: k for k, v in exp.trial_of.items()}
            exp.ops = {k: deque(v) for k, v in snap["ops"].items()}
            exp.closed = set(snap["closed"])
            exp.shutdown = Shutdown(**snap["shutdown"]) if snap["shutdown"] else None
            exp.test_mode = bool(snap.get("test_mode"))
            exp.waiting = set(snap.get("waiting") or [])
        sign = 1.0 if cfg.searcher.smaller_is_better else -1.0
        for t in self.store.list_trials(experiment_id):
            if t.best_validation is not None:
                exp.best = self._better(exp, sign * t.best_validation, exp.best)
        self.experiments[experiment_id] = exp
        return exp

    def pause(self, experiment_id: int) -> str:
        unmanaged.refuse_control(self, experiment_id, "pause")
        exp = self._exp(experiment_id)
        state = self.store.get_experiment(experiment_id).state
        if state in (State.PAUSED, State.STOPPING_PAUSED):
            return f"experiment {experiment_id} is already paused"
        if state != State.ACTIVE:
            raise StateError(
                f"experiment {experiment_id} is {state.value}; "
                "only ACTIVE experiments can be paused"
            )
        runs = [r for r in self.runs.values() if r.experiment_id == experiment_id]
        # STOPPING_PAUSED while a trial's process is still there (it checkpoints, or ignores
        # the preemption until the timeout); PAUSED when the last one has exited
        self.store.set_experiment_state(
            experiment_id, State.STOPPING_PAUSED if runs else State.PAUSED
        )
        for t in self.store.list_trials(experiment_id):
            if t.state == State.ACTIVE and t.id not in self.runs:
                self._dequeue_trial(t.id, "experiment paused")
                self.store.set_trial_state(t.id, State.PAUSED)
        if runs:
            exp.stopping = "pause"
            for r in runs:
                self._preempt(r, exp)
        self.note(
            f"experiment {experiment_id} pausing: trials checkpoint and stop"
            if runs
            else f"experiment {experiment_id} paused",
            experiment_id=experiment_id,
        )
        self._check_idle()
        return f"experiment {experiment_id} paused"

    def activate(self, experiment_id: int) -> str:
        unmanaged.refuse_control(self, experiment_id, "activate")
        exp = self._exp(experiment_id)
        state = self.store.get_experiment(experiment_id).state
        if state == State.ACTIVE and exp.stopping is None:
            return f"experiment {experiment_id} is already active"
        if state not in (State.PAUSED, State.STOPPING_PAUSED, State.ACTIVE):
            raise StateError(
                f"experiment {experiment_id} is {state.value}; "
                "only PAUSED experiments can be activated"
            )
        if exp.stopping == "pause":
            exp.stopping = None  # paused and activated before its trials stopped
        if state in (State.PAUSED, State.STOPPING_PAUSED):
            self.store.set_experiment_state(experiment_id, State.ACTIVE)
        for t in self.store.list_trials(experiment_id):
            if t.state in (State.PAUSED, State.ACTIVE) and t.id not in self.runs:
                self._enqueue_trial(exp, t.id)
        self._schedule()
        self._maybe_finish(exp)
        self._check_idle()
        return f"experiment {experiment_id} activated"

    def kill(self, experiment_id: int) -> str:
        unmanaged.refuse_control(self, experiment_id, "kill")
        exp = self._exp(experiment_id)
        state = self.store.get_experiment(experiment_id).state
        if state.terminal:
            return f"experiment {experiment_id} is already {state.value}"
        exp.stopping = "kill"
        for t in self.store.list_trials(experiment_id):
            if t.id not in self.runs:
                self._dequeue_trial(t.id, "experiment killed", cancel=True)
        runs = [r for r in self.runs.values() if r.experiment_id == experiment_id]
        if runs:
            self.store.set_experiment_state(experiment_id, State.STOPPING_CANCELED)
        for r in runs:
            r.kill_requested = True
            self._terminate(r)
        self._maybe_finish(exp)
        self._check_idle()
        return f"experiment {experiment_id} killed"

    def set_labels(self, experiment_id: int, add: str | None, remove: str | None) -> str:
        labels = set(self.store.get_experiment(experiment_id).labels)
        if add:
            labels.add(add)
        if remove:
            if remove not in labels:
                raise NotFoundError(f"experiment {experiment_id} has no label '{remove}'")
            labels.discard(remove)
        self.store.set_labels(experiment_id, labels)
        return f"experiment {experiment_id} labels: {', '.join(sorted(labels)) or '(none)'}"

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
                executor.signal_job(self.procs.get(run.job_id), run.pid, signal.SIGKILL)
            self._out("det-local: stopping now; trials resume from their latest checkpoint")


def install_interrupt(engine: Engine) -> None:
    """SIGINT/SIGTERM in embedded mode: first pause, second stop now."""
    count = 0
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        nonlocal count
        count += 1
        engine.interrupt(count)

    try:
        loop.add_signal_handler(signal.SIGINT, on_signal)
        loop.add_signal_handler(signal.SIGTERM, on_signal)
    except (RuntimeError, ValueError):  # not the main thread (an embedding program's worker)
        pass


def _user_name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


_INFO_SECRET = "cluster.json"  # holds the run's session token: its owner's eyes only


def _write_info(info: Any, info_dir: Path, owner: userfiles.Owner | None) -> None:
    """The run's info files. System mode: written while the directory is root's and private,
    then the files and the directory are given to the trial's user (mode from their umask,
    readable by admins; cluster.json, which holds the session token, 0600)."""
    if owner is None:
        info._to_files(info_dir)
        return
    info_dir.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(info_dir):  # left by a daemon that crashed while starting this run
        shutil.rmtree(info_dir)  # (links in it are removed, never followed)
    info_dir.mkdir(mode=0o700)
    info._to_files(info_dir)
    for path in sorted(info_dir.iterdir()):
        userfiles.give_file(path, owner, secret=path.name == _INFO_SECRET)
    userfiles.make_dir(info_dir, owner)  # the trial writes in it (TensorBoard files)


def _share_with(storage: Path) -> None:
    """System mode: the trial runs as its submitter, who must create new checkpoints in the
    shared storage directory (det-local's own default storage only; never a directory a user
    named)."""
    try:
        st = storage.stat()
        if st.st_uid == 0 and st.st_mode & 0o1777 != 0o1777:
            os.chmod(storage, 0o1777)  # anyone creates, only owners delete (like /tmp)
    except OSError:
        pass
