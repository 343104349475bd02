"""The engine: experiments, their searchers and their trial processes, driven by events.

One engine per DET_LOCAL_HOME. It is the only writer of the store. Events come from the
socket (trial reports, control requests) and from process exits (pidfds); nothing polls for
work. `det-local run` with no daemon runs an engine in its own process (embedded mode).
"""

from __future__ import annotations

import asyncio
import math
import os
import secrets
import shutil
import signal
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from det_local.errors import CheckpointError, DetLocalError, NotFoundError, StateError
from det_local.sched import executor
from det_local.sched.outcome import ExitFacts, Outcome, decide, describe_exit
from det_local.sched.plan import (
    LaunchPlan,
    check_entrypoint,
    config_env_vars,
    entrypoint_argv,
    trial_env,
)
from det_local.search import Searcher, make_searcher
from det_local.search.actions import Action, Close, Create, Shutdown, Stop, ValidateAfter
from det_local.store.db import Store, current_user
from det_local.store.paths import Paths
from det_local.store.records import CheckpointRecord
from det_local.store.states import State

DEFAULT_PREEMPTION_TIMEOUT = 30.0
KILL_GRACE = 10.0


@dataclass
class TrialRun:
    """One live process (run) of a trial."""

    trial_id: int
    experiment_id: int
    request_id: str
    run_id: int
    token: str
    proc: executor.Running
    plan: LaunchPlan
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    preempt_sent: bool = False
    acked: bool = False
    invalid_hp: bool = False
    kill_requested: bool = False
    stop_requested: bool = False
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


class Engine:
    def __init__(self, paths: Paths, *, out: Callable[[str], None] | None = None) -> None:
        self.paths = paths.ensure()
        self.store = Store(paths.db)
        self.user = current_user()
        self.experiments: dict[int, ExperimentRun] = {}
        self.runs: dict[int, TrialRun] = {}  # trial id -> live run
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: asyncio.AbstractServer | None = None
        self._idle = asyncio.Event()
        self.closing = False
        self._out = out or (lambda line: print(line, file=sys.stderr, flush=True))

    # ================================================================== lifecycle
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        sock = self.paths.socket
        if sock.exists():
            sock.unlink()
        self.server = await asyncio.start_unix_server(self._on_connection, path=str(sock))
        os.chmod(sock, 0o600)

    async def wait_idle(self) -> None:
        """Return once no experiment has a live process or pending work (embedded mode).

        From then on the engine is `closing`: it refuses new work (submit, activate) with a
        `retry` reply, so that nothing starts in an engine about to stop; the client then runs
        the request in an engine of its own."""
        while True:
            self._check_idle()
            if self._idle.is_set():
                self.closing = True  # no await since the check: nothing slipped in between
                return
            await self._idle.wait()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        try:
            self.paths.socket.unlink()
        except FileNotFoundError:
            pass
        self.store.close()

    def _check_idle(self) -> None:
        active = any(
            self.store.get_experiment(e).state in (State.ACTIVE, State.STOPPING_CANCELED)
            for e in self.experiments
        )
        if not self.runs and not active:
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
    def submit(self, cfg: Any, context_src: Path, source: str, *, test_mode: bool = False) -> int:
        """Validate, snapshot the context, record the experiment and start its searcher.

        With test_mode the config is rewritten as Determined's `--test` does, and the trial runs
        twice: one batch + validation + checkpoint, then a fresh process that restores that
        checkpoint and trains one more batch."""
        from det_local.store.context import snapshot_context

        if test_mode:
            from det_local.config import make_test_config

            cfg = make_test_config(cfg)

        staging = self.paths.staging_dir(uuid.uuid4().hex)
        # the snapshot first: a missing, oversized or shadowing context is named as such
        snapshot_context(context_src, staging)
        try:
            check_entrypoint(cfg.entrypoint, context_src, source, snapshot=staging)
            entrypoint_argv(cfg.entrypoint, context_src)  # refuses unsupported forms now
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
                user=self.user,
            )
            dest = self.paths.context_dir(exp_id)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging, dest)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.store.set_experiment_context(exp_id, str(dest))
        exp = ExperimentRun(exp_id, cfg, searcher, checkpoint_dir_for(self.paths, config))
        exp.test_mode = test_mode
        self.experiments[exp_id] = exp
        self._apply(exp, searcher.initial_actions())
        self._check_idle()
        return exp_id

    def _warm_start(self, cfg: Any) -> str | None:
        s = cfg.searcher
        if s.source_checkpoint_uuid:
            self.store.get_checkpoint(s.source_checkpoint_uuid)
            return str(s.source_checkpoint_uuid)
        if s.source_trial_id is not None:
            trial = self.store.get_trial(int(s.source_trial_id))
            if trial.latest_checkpoint is None:
                raise DetLocalError(
                    f"searcher.source_trial_id: trial {trial.id} has no checkpoint to start from"
                )
            return trial.latest_checkpoint
        return None

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
            elif isinstance(action, Close):
                exp.closed.add(action.request_id)
            elif isinstance(action, Stop):
                run = self.runs.get(exp.trial_of.get(action.request_id, -1))
                if run is not None:
                    run.stop_requested = True
                    self._preempt(run, exp)
            elif isinstance(action, Shutdown):
                exp.shutdown = action
        self.store.set_searcher_state(exp.id, self._searcher_snapshot(exp))
        # launch every created trial that has no process yet
        for action in actions:
            if isinstance(action, Create) and exp.stopping is None:
                self._launch(exp, exp.trial_of[action.request_id])
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
        for ckpt in sorted(ckpts, key=lambda c: (c.steps_completed, c.created_at), reverse=True):
            if Path(ckpt.path).is_dir():
                if ckpt.uuid != trial.latest_checkpoint:
                    self.note(
                        f"trial {trial_id}: checkpoint {trial.latest_checkpoint} is gone from "
                        f"disk; resuming from {ckpt.uuid} (steps_completed={ckpt.steps_completed})",
                        experiment_id=trial.experiment_id,
                        trial_id=trial_id,
                        level="WARNING",
                    )
                return ckpt.uuid, ckpt.steps_completed
            self.store.mark_checkpoint_deleted(ckpt.uuid)
        raise CheckpointError(
            f"trial {trial_id}: its checkpoints (latest {trial.latest_checkpoint}) are gone from "
            f"disk, so it cannot resume where it stopped; restore the checkpoint directory or "
            f"kill the experiment and start it again"
        )

    def _launch(self, exp: ExperimentRun, trial_id: int) -> None:
        from det_local.trial.info import ClusterInfo, TrialInfo

        try:
            latest, steps = self._resume_point(trial_id)
        except CheckpointError as err:
            self._trial_failed_to_start(exp, trial_id, str(err))
            return
        trial = self.store.get_trial(trial_id)
        if trial.state == State.PAUSED:
            self.store.set_trial_state(trial_id, State.ACTIVE)
        run_id = self.store.next_trial_run(trial_id)
        token = secrets.token_hex(16)
        rec = self.store.get_experiment(exp.id)
        context = Path(rec.context_dir)
        info_dir = self.paths.trial_info_dir(exp.id, trial_id, run_id)
        config = rec.config
        info = ClusterInfo(
            master_url="unix://" + str(self.paths.socket),
            cluster_id="det-local",
            agent_id=os.uname().nodename,
            slot_ids=[],
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
        )
        info._to_files(info_dir)
        plan = LaunchPlan(
            argv=entrypoint_argv(config["entrypoint"], context),
            env=trial_env(
                base=dict(os.environ),
                experiment_id=exp.id,
                trial_id=trial_id,
                run_id=run_id,
                seed=trial.seed,
                hparams=trial.hparams,
                config=config,
                steps_completed=steps,
                latest_checkpoint=latest,
                slots=[],
                socket_path=str(self.paths.socket),
                token=token,
                info_dir=str(info_dir),
                checkpoint_dir=str(exp.checkpoint_dir),
                user=self.user,
                extra=config_env_vars(config)
                + (["DET_LOCAL_TEST_MODE=1"] if exp.test_mode else []),
            ),
            cwd=str(context),
            user=self.user,
            slots=[],
            log_path=str(self.paths.trial_log(exp.id, trial_id)),
            info_dir=str(info_dir),
        )
        exp.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        try:
            proc = executor.spawn(plan)
        except DetLocalError as err:
            self._trial_failed_to_start(exp, trial_id, f"trial {trial_id}: {err}")
            return
        run = TrialRun(trial_id, exp.id, exp.request_of[trial_id], run_id, token, proc, plan)
        self.runs[trial_id] = run
        assert self.loop is not None
        if proc.pidfd is not None:
            self.loop.add_reader(proc.pidfd, self._on_exit, run)
        else:  # no pidfd (old kernel): a bounded supervision tick
            self._watch_without_pidfd(run)
        self._check_idle()

    def _watch_without_pidfd(self, run: TrialRun) -> None:
        assert self.loop is not None
        if executor.exit_code(run.proc) is not None:
            self._on_exit(run)
        else:
            self.loop.call_later(0.05, self._watch_without_pidfd, run)

    def _trial_failed_to_start(self, exp: ExperimentRun, trial_id: int, message: str) -> None:
        self.note(message, experiment_id=exp.id, trial_id=trial_id, level="ERROR")
        self.store.set_trial_state(trial_id, State.ERROR, message)
        self._apply(exp, exp.searcher.on_trial_exited_early(exp.request_of[trial_id], "ERRORED"))

    # ================================================================== process exits
    def _on_exit(self, run: TrialRun) -> None:
        assert self.loop is not None
        code = executor.exit_code(run.proc)
        if code is None:
            return  # spurious wakeup
        if run.proc.pidfd is not None:
            self.loop.remove_reader(run.proc.pidfd)
        executor.close(run.proc)
        executor.kill_group(run.proc.pid)  # no orphans: the group goes with its leader
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
                pause_requested=exp.stopping == "pause",
                stop_requested=run.stop_requested,
                preempt_acknowledged=run.acked,
                invalid_hp=run.invalid_hp,
                restarts_done=trial.restarts,
                max_restarts=max_restarts,
            )
        )
        rid = run.request_id
        tid = run.trial_id
        if outcome == Outcome.COMPLETED and self._test_mode_restore(exp, run):
            pass
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
            self._launch(exp, tid)
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
            self._launch(exp, tid)
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

    def _test_mode_restore(self, exp: ExperimentRun, run: TrialRun) -> bool:
        """Test mode, after the first run: restore its checkpoint in a fresh process and train
        one more batch (an operation one batch longer for Core API scripts). False when there is
        nothing to restore, which ends the test (the report names the missing step)."""
        if not exp.test_mode or run.run_id != 1:
            return False
        trial = self.store.get_trial(run.trial_id)
        if trial.latest_checkpoint is None:
            return False
        steps = self.store.get_checkpoint(trial.latest_checkpoint).steps_completed
        exp.ops.setdefault(run.request_id, deque()).append(steps + 1)
        self.store.set_searcher_state(exp.id, self._searcher_snapshot(exp))
        self._launch(exp, run.trial_id)
        return True

    def _maybe_finish(self, exp: ExperimentRun) -> None:
        if any(r.experiment_id == exp.id for r in self.runs.values()):
            return
        state = self.store.get_experiment(exp.id).state
        if exp.stopping == "kill":
            for t in self.store.list_trials(exp.id):
                if not t.state.terminal:
                    self.store.set_trial_state(t.id, State.CANCELED)
            if state != State.CANCELED:
                self.store.set_experiment_state(exp.id, State.CANCELED)
            exp.stopping = None
        elif exp.stopping == "pause":
            exp.stopping = None
        elif exp.shutdown is not None and state == State.ACTIVE:
            if exp.shutdown.failure:
                errs = [t for t in self.store.list_trials(exp.id) if t.state == State.ERROR]
                why = errs[0].message if errs else "every trial failed"
                self.store.set_experiment_state(exp.id, State.ERROR, why)
            else:
                self.store.set_experiment_progress(exp.id, 1.0)
                self.store.set_experiment_state(exp.id, State.COMPLETED)

    # ================================================================== control
    def _preempt(self, run: TrialRun, exp: ExperimentRun) -> None:
        if run.preempt_sent:
            return
        run.preempt_sent = True
        for w in run.writers:
            _write(w, {"t": "preempt"})
        timeout = exp.config.preemption_timeout
        timeout = DEFAULT_PREEMPTION_TIMEOUT if timeout is None else float(timeout)
        assert self.loop is not None
        run.timers.append(self.loop.call_later(timeout, self._terminate, run))

    def _terminate(self, run: TrialRun) -> None:
        """SIGTERM the group, then SIGKILL after a grace period."""
        if run.trial_id not in self.runs:
            return
        executor.terminate_group(run.proc.pid)
        assert self.loop is not None
        run.timers.append(self.loop.call_later(KILL_GRACE, executor.kill_group, run.proc.pid))

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
        sign = 1.0 if cfg.searcher.smaller_is_better else -1.0
        for t in self.store.list_trials(experiment_id):
            if t.best_validation is not None:
                exp.best = self._better(exp, sign * t.best_validation, exp.best)
        self.experiments[experiment_id] = exp
        return exp

    def pause(self, experiment_id: int) -> str:
        exp = self._exp(experiment_id)
        state = self.store.get_experiment(experiment_id).state
        if state == State.PAUSED:
            return f"experiment {experiment_id} is already paused"
        if state != State.ACTIVE:
            raise StateError(
                f"experiment {experiment_id} is {state.value}; "
                "only ACTIVE experiments can be paused"
            )
        self.store.set_experiment_state(experiment_id, State.PAUSED)
        runs = [r for r in self.runs.values() if r.experiment_id == experiment_id]
        for t in self.store.list_trials(experiment_id):
            if t.state == State.ACTIVE and t.id not in self.runs:
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
        exp = self._exp(experiment_id)
        state = self.store.get_experiment(experiment_id).state
        if state == State.ACTIVE and exp.stopping is None:
            return f"experiment {experiment_id} is already active"
        if state not in (State.PAUSED, State.ACTIVE):
            raise StateError(
                f"experiment {experiment_id} is {state.value}; "
                "only PAUSED experiments can be activated"
            )
        if exp.stopping == "pause":
            exp.stopping = None  # paused and activated before its trials stopped
        if state == State.PAUSED:
            self.store.set_experiment_state(experiment_id, State.ACTIVE)
        for t in self.store.list_trials(experiment_id):
            if t.state in (State.PAUSED, State.ACTIVE) and t.id not in self.runs:
                self._launch(exp, t.id)
        self._maybe_finish(exp)
        self._check_idle()
        return f"experiment {experiment_id} activated"

    def kill(self, experiment_id: int) -> str:
        exp = self._exp(experiment_id)
        state = self.store.get_experiment(experiment_id).state
        if state.terminal:
            return f"experiment {experiment_id} is already {state.value}"
        exp.stopping = "kill"
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
                executor.kill_group(run.proc.pid)
            self._out("det-local: stopping now; trials resume from their latest checkpoint")

    # ================================================================== socket
    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        from det_local import rpc

        run: TrialRun | None = None
        try:
            while True:
                head = await reader.readexactly(rpc.HEADER.size)
                (size,) = rpc.HEADER.unpack(head)
                if size > rpc.MAX_FRAME:
                    break
                msg = rpc.unpack(await reader.readexactly(size))
                kind = msg.get("t")
                if run is None:
                    if kind == "hello":
                        run = self._hello(msg, writer)
                        if run is None:
                            break
                        continue
                    if kind == "control":
                        await self._control(msg, writer)
                        continue
                    break
                self._handle(run, msg, writer)
        except (asyncio.IncompleteReadError, ConnectionError, rpc.FrameError):
            pass
        finally:
            if run is not None and writer in run.writers:
                run.writers.remove(writer)
            writer.close()

    def _hello(self, msg: dict[str, Any], writer: asyncio.StreamWriter) -> TrialRun | None:
        run = self.runs.get(int(msg.get("trial_id", -1)))
        if run is None or not secrets.compare_digest(str(msg.get("token", "")), run.token):
            _write(writer, {"t": "hello", "error": "unknown trial or wrong token"})
            return None
        run.writers.append(writer)
        _write(writer, {"t": "hello", "preempt": run.preempt_sent})
        return run

    async def _control(self, msg: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        uid = _peer_uid(sock) if sock is not None else None
        reply: dict[str, Any] = {"t": "reply", "id": msg.get("id")}
        try:
            if uid is not None and uid not in (0, os.getuid()):
                raise DetLocalError("permission denied: this det-local runs as another user")
            op = msg.get("op")
            exp_id = int(msg.get("experiment_id", 0))
            if self.closing and op in ("submit", "activate"):
                reply["retry"] = True
                raise DetLocalError("this det-local engine is shutting down; ask again")
            if op == "pause":
                reply["value"] = self.pause(exp_id)
            elif op == "activate":
                reply["value"] = self.activate(exp_id)
            elif op == "kill":
                reply["value"] = self.kill(exp_id)
            elif op == "label_add":
                reply["value"] = self.set_labels(exp_id, str(msg["label"]), None)
            elif op == "label_remove":
                reply["value"] = self.set_labels(exp_id, None, str(msg["label"]))
            elif op == "submit":
                from det_local.config import parse_config

                cfg = parse_config(msg["config"], source=str(msg.get("source", "<config>")))
                reply["value"] = self.submit(
                    cfg,
                    Path(msg["context"]),
                    str(msg.get("source")),
                    test_mode=bool(msg.get("test_mode")),
                )
            else:
                raise DetLocalError(f"unknown control request {op!r}")
        except DetLocalError as err:
            reply["error"] = str(err)
        _write(writer, reply)

    def _handle(self, run: TrialRun, msg: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        kind = msg.get("t")
        exp = self.experiments[run.experiment_id]
        value: Any = None
        error: str | None = None
        try:
            if kind == "metrics":
                self._on_metrics(run, exp, msg["reports"])
                return
            if kind == "progress":
                self._on_progress(run, exp, float(msg["progress"]))
                return
            if kind == "status":
                return
            if kind == "checkpoint":
                self._on_checkpoint(run, msg)
            elif kind == "ckpt_delete":
                self.store.mark_checkpoint_deleted(str(msg["uuid"]))
            elif kind == "early_exit":
                run.invalid_hp = msg.get("reason") == "INVALID_HP"
            elif kind == "best_val":
                value = (
                    None
                    if exp.best is None
                    else (exp.best if exp.config.searcher.smaller_is_better else -exp.best)
                )
            elif kind == "last_val":
                last = self.store.latest_metrics(run.trial_id, "validation")
                value = None if last is None else last.steps_completed
            elif kind == "op_next":
                q = exp.ops.get(run.request_id)
                value = q[0] if q else None
            elif kind == "op_done":
                self._on_op_done(run, exp, int(msg["length"]), msg.get("metric"))
            elif kind == "out_of_ops":
                pass
            elif kind == "preempt_ack":
                run.acked = True
            elif kind == "bye":
                pass
            else:
                error = f"unknown request {kind!r}"
        except DetLocalError as err:
            error = str(err)
        if "id" in msg:
            reply: dict[str, Any] = {"t": "reply", "id": msg["id"]}
            if error is not None:
                reply["error"] = error
            else:
                reply["value"] = value
            _write(writer, reply)

    # ================================================================== reports
    def _better(self, exp: ExperimentRun, value: float, best: float | None) -> float:
        """Best is kept as a smaller-is-better number (negated when larger is better)."""
        return value if best is None or value < best else best

    def _on_metrics(self, run: TrialRun, exp: ExperimentRun, reports: list[list[Any]]) -> None:
        self.store.add_metrics(run.trial_id, run.run_id, reports)
        metric = exp.config.searcher.metric
        sign = 1.0 if exp.config.searcher.smaller_is_better else -1.0
        if reports:
            self.store.set_trial_steps(run.trial_id, max(int(r[1]) for r in reports))
        for group, _steps, metrics, _t, _b in reports:
            if group != "validation":
                continue
            value = metrics.get(metric)
            if (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and not math.isnan(value)
            ):
                v = sign * float(value)
                trial = self.store.get_trial(run.trial_id)
                tb = None if trial.best_validation is None else sign * trial.best_validation
                if tb is None or v < tb:
                    self.store.set_best_validation(run.trial_id, float(value))
                exp.best = self._better(exp, v, exp.best)
            self._apply(exp, exp.searcher.on_validation(run.request_id, metrics))

    def _on_progress(self, run: TrialRun, exp: ExperimentRun, progress: float) -> None:
        exp.progress[run.trial_id] = progress
        total = max(exp.searcher.state.trials_requested, 1)
        done = len(exp.searcher.state.completed) + len(exp.searcher.state.failed)
        running = sum(
            exp.progress.get(t, 0.0) for t in self.runs if self.runs[t].experiment_id == exp.id
        )
        self.store.set_experiment_progress(exp.id, min((done + running) / total, 1.0))

    def _on_checkpoint(self, run: TrialRun, msg: dict[str, Any]) -> None:
        uuid_ = str(msg["uuid"])
        try:
            self.store.get_checkpoint(uuid_)
            return  # a resend after a reconnect: already recorded
        except NotFoundError:
            pass
        self.store.add_checkpoint(
            CheckpointRecord(
                uuid=uuid_,
                experiment_id=run.experiment_id,
                trial_id=run.trial_id,
                steps_completed=int(msg.get("steps_completed", 0)),
                state="COMPLETED",
                path=str(msg["path"]),
                metadata=dict(msg.get("metadata") or {}),
                resources=dict(msg.get("resources") or {}),
                created_at=time.time(),
            )
        )

    def _on_op_done(self, run: TrialRun, exp: ExperimentRun, length: int, metric: Any) -> None:
        q = exp.ops.get(run.request_id)
        if not q or q[0] != length:
            raise DetLocalError(
                f"trial {run.trial_id}: report_completed for length {length}, but the current "
                f"operation is {q[0] if q else 'none'}"
            )
        q.popleft()
        if not isinstance(metric, (int, float)) or isinstance(metric, bool):
            raise DetLocalError(
                f"trial {run.trial_id}: op.report_completed() needs a number for searcher metric "
                f"'{exp.config.searcher.metric}', found {metric!r}"
            )
        self._apply(exp, exp.searcher.on_op_completed(run.request_id, length, float(metric)))


def _write(writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
    from det_local import rpc

    try:
        writer.write(rpc.pack(msg))
    except (ConnectionError, RuntimeError):
        pass


def _peer_uid(sock: Any) -> int | None:
    import socket as _socket
    import struct

    try:
        creds = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        return int(uid)
    except OSError:
        return None


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
