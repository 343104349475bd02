"""Unmanaged runs in the engine: experiments whose one trial is a process det-local did not start.

Determined's ``determined.experimental.core_v2`` lets a plain ``python train.py`` (or a notebook)
record an experiment and a trial. Here the process asks the engine with an ``unmanaged`` spool
request (kernel-verified owner, like any submission); the engine records the experiment and its
trial and answers their ids. The trial's session token is never in the answer (answers, and the
request results kept in the store, are readable by every user): it is in a file of its own,
``run/tokens/<trial>-<run>.token``, created by the engine (O_EXCL, mode 0600) and owned by the
requester, in a directory only the engine's user writes; the engine removes it once the
process has said hello. The process then reports over the trial socket like a trial, saying
``unmanaged`` in its hello; the engine also checks that the socket's peer (SO_PEERCRED) is the
requester's uid.

The trial ends when the process says so (``unmanaged_end``: COMPLETED after ``core_v2.close()``
or a normal exit, ERROR after an uncaught exception or a non-zero exit code), or ERROR when its
connection goes away without that (killed), when it never connects, or when the engine itself
stopped meanwhile (found at the next start: the process can no longer report). Nothing of it is
ever started, paused or resumed by det-local: pause and activate are refused, with the process
to stop instead; its checkpoints are never garbage-collected (Determined leaves them too).
"""

from __future__ import annotations

import os
import secrets
import shlex
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from det_local.errors import DetLocalError, StateError
from det_local.sched.life.experiments import ExperimentRun, Notes, TrialRun
from det_local.store.states import State

if TYPE_CHECKING:
    import asyncio

    from det_local.sched.settings import DaemonSettings
    from det_local.search.actions import Action
    from det_local.store.db import Store
    from det_local.store.paths import Paths

OP = "unmanaged"  # the spool request
END = "unmanaged_end"  # the socket message that ends the trial
HELLO_TIMEOUT_S = 150.0  # a trial that never connects ends ERROR (its process went away)
MAX_TOKEN_BYTES = 256
_STATES = {"COMPLETED": State.COMPLETED, "ERROR": State.ERROR}


def is_unmanaged(config: dict[str, Any] | None) -> bool:
    """Whether a stored experiment config is an unmanaged run's (marked under `internal`)."""
    internal = (config or {}).get("internal")
    if not isinstance(internal, dict):
        return False
    mark = internal.get("det_local")
    return isinstance(mark, dict) and mark.get("unmanaged") is True


def mark(raw: dict[str, Any]) -> dict[str, Any]:
    """The config with the unmanaged mark (other `internal` keys kept)."""
    internal = raw.get("internal")
    internal = dict(internal) if isinstance(internal, dict) else {}
    internal["det_local"] = {"unmanaged": True}
    return {**raw, "internal": internal}


class UnmanagedHost(Notes, Protocol):
    """What unmanaged runs need of the engine."""

    store: Store
    paths: Paths
    settings: DaemonSettings
    loop: asyncio.AbstractEventLoop | None
    unmanaged: dict[int, TrialRun]  # trial id -> its run, until it ends

    def add_experiment(self, exp: ExperimentRun, uid: int) -> None: ...

    def experiment(self, experiment_id: int) -> ExperimentRun: ...

    def owner_uid(self, experiment_id: int) -> int | None: ...

    def apply(self, exp: ExperimentRun, actions: list[Action]) -> None: ...

    def save_searcher(self, exp: ExperimentRun) -> None: ...

    def check_idle(self) -> None: ...


# ---------------------------------------------------------------------- the request
def start(engine: UnmanagedHost, payload: dict[str, Any], *, user: str, uid: int) -> dict[str, Any]:
    """Record the experiment and its trial, register the run awaiting its hello, write the
    token file; the answer names ids and paths only."""
    from det_local.config import parse_config
    from det_local.config.limits import check_config_value
    from det_local.sched.life.experiments import checkpoint_dir_for
    from det_local.sched.run import userfiles
    from det_local.sched.run.runas import identity
    from det_local.sched.run.trialstart import share_with, write_info
    from det_local.search import make_searcher
    from det_local.search.actions import Create, ValidateAfter
    from det_local.wire.trialinfo import ClusterInfo, TrialInfo

    raw = payload["config"]
    if not isinstance(raw, dict):
        raise DetLocalError("unmanaged request: config is not a map")
    check_config_value(raw, "core_v2.Config")  # its size and nesting, before it is walked
    argv = [str(a) for a in payload.get("argv") or []] or ["python"]
    raw = mark({**raw, "entrypoint": shlex.join(argv), "searcher": _single(raw.get("searcher"))})
    cfg = parse_config(raw, source="core_v2.Config")
    if int(cfg.resources.slots_per_trial) != 1:
        raise DetLocalError(
            "core_v2.Config: an unmanaged run holds no det-local slots; leave "
            "resources.slots_per_trial out"
        )
    config = cfg.to_dict()
    searcher = make_searcher(cfg)
    actions = searcher.initial_actions()
    create = next(a for a in actions if isinstance(a, Create))
    exp_id = engine.store.create_experiment(
        name=cfg.name,
        config=config,
        labels=cfg.labels,
        description=cfg.description,
        user=user,
    )
    engine.store.set_experiment_context(exp_id, str(payload.get("cwd") or ""))
    exp = ExperimentRun(exp_id, cfg, searcher, checkpoint_dir_for(engine.paths, config))
    trial_id = engine.store.create_trial(exp_id, hparams=create.hparams, seed=create.seed)
    exp.trial_of[create.request_id] = trial_id
    exp.request_of[trial_id] = create.request_id
    exp.ops[create.request_id] = deque(a.length for a in actions if isinstance(a, ValidateAfter))
    engine.add_experiment(exp, uid)
    engine.save_searcher(exp)
    run_id = engine.store.next_trial_run(trial_id)

    info_dir = engine.paths.trial_info_dir(exp_id, trial_id, run_id)
    info = ClusterInfo(
        master_url="unix://" + str(engine.paths.socket),
        cluster_id="det-local",
        agent_id="unmanaged",
        slot_ids=[],
        task_id=f"{exp_id}.{trial_id}",
        allocation_id=f"{exp_id}.{trial_id}.{run_id}",
        session_token="",  # in the token file only
        task_type="TRIAL",
        trial_info=TrialInfo(
            trial_id=trial_id,
            experiment_id=exp_id,
            trial_seed=create.seed,
            hparams=create.hparams,
            config=config,
            steps_completed=0,
            trial_run_id=run_id,
        ),
        user_data=config.get("data") or {},
    )
    ids = identity(uid)
    # the run directory is the process's user's (it writes TensorBoard files there)
    write_info(info, info_dir, userfiles.owner_for(ids, None, engine.settings.admin_group))
    if ids and exp.checkpoint_dir == engine.paths.checkpoints:
        share_with(exp.checkpoint_dir)

    token = secrets.token_hex(32)
    token_file = write_token(engine, trial_id, run_id, token, uid)
    run = TrialRun(trial_id, exp_id, create.request_id, run_id, token, job_id=0, pid=0)
    engine.unmanaged[trial_id] = run
    if engine.loop is not None:
        run.timers.append(engine.loop.call_later(HELLO_TIMEOUT_S, _never_connected, engine, run))
    engine.note(
        f"experiment {exp_id}: unmanaged trial {trial_id} for {user} "
        f"({shlex.join(argv)}); it reports from a process det-local did not start",
        experiment_id=exp_id,
        trial_id=trial_id,
    )
    engine.check_idle()
    return {
        "experiment_id": exp_id,
        "trial_id": trial_id,
        "run_id": run_id,
        "token_file": str(token_file),
        "socket": str(engine.paths.socket),
        "info_dir": str(info_dir),
        "checkpoint_dir": str(exp.checkpoint_dir),
        "tensorboard_dir": str(info_dir / "tensorboard"),
    }


def _single(searcher: Any) -> Any:
    """The one-trial searcher an unmanaged run has, whatever the Config names: det-local
    starts no trials for it (Determined's master runs no search for these either); the metric
    and its direction are kept (best validation, sorting)."""
    if not isinstance(searcher, dict):
        return searcher  # parse_config names what is wrong
    kept = ("metric", "smaller_is_better", "max_length")
    return {"name": "single", **{k: searcher[k] for k in kept if k in searcher}}


def write_token(engine: UnmanagedHost, trial_id: int, run_id: int, token: str, uid: int) -> Path:
    """The token, readable by its requester only: a new file (never an existing name, never a
    link) in a directory that only the engine's user may write."""
    path = engine.paths.unmanaged_token(trial_id, run_id)
    path.parent.mkdir(mode=0o711, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o711)  # others may open a file they own there, never list or add
    try:
        path.unlink()  # left by a run whose request was answered again after a crash
    except FileNotFoundError:
        pass
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
        if os.geteuid() == 0 and uid != 0:
            os.fchown(fd, uid, -1)
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return path


def _remove_token(engine: UnmanagedHost, run: TrialRun) -> None:
    try:
        engine.paths.unmanaged_token(run.trial_id, run.run_id).unlink()
    except OSError:
        pass


# ---------------------------------------------------------------------- the socket
def hello(
    engine: UnmanagedHost, msg: dict[str, Any], writer: asyncio.StreamWriter
) -> TrialRun | None:
    """An unmanaged process connects: its token, and its peer uid (SO_PEERCRED), must match."""
    from det_local.sched.sessions.trialserver import peer_creds
    from det_local.sched.sessions.trialserver import send as _write

    run = engine.unmanaged.get(_int(msg.get("trial_id")))
    if run is None or not secrets.compare_digest(str(msg.get("token", "")), run.token):
        _write(writer, {"t": "hello", "error": "unknown trial or wrong token"})
        return None
    owner = engine.owner_uid(run.experiment_id)
    pid, uid = peer_creds(writer.get_extra_info("socket"))
    if uid is None or (uid != owner and uid != os.geteuid()):
        engine.note(
            f"refused a connection for unmanaged trial {run.trial_id} from uid {uid}: "
            f"the trial belongs to uid {owner}",
            experiment_id=run.experiment_id,
            trial_id=run.trial_id,
            level="WARNING",
        )
        _write(writer, {"t": "hello", "error": "this trial belongs to another user"})
        return None
    if pid:
        run.pid = pid
    for t in run.timers:  # connected: no longer "never connected"
        t.cancel()
    run.timers.clear()
    _remove_token(engine, run)
    run.writers.append(writer)
    _write(writer, {"t": "hello", "preempt": False})
    return run


def on_end(engine: UnmanagedHost, run: TrialRun, msg: dict[str, Any]) -> None:
    """`unmanaged_end`: the process ends its trial (close(), its exit, its exception)."""
    state = _STATES.get(str(msg.get("state")))
    if state is None:
        raise DetLocalError(f"unmanaged_end: state must be COMPLETED or ERROR, not {msg!r}")
    reason = str(msg.get("message") or "")[:2000] or None
    end(engine, run, state, reason)


def disconnected(engine: UnmanagedHost, run: TrialRun) -> None:
    """Its last connection closed: without an `unmanaged_end` first, the process is gone."""
    if engine.unmanaged.get(run.trial_id) is not run or run.writers:
        return
    end(
        engine,
        run,
        State.ERROR,
        f"the process of unmanaged trial {run.trial_id} (pid {run.pid}) went away without "
        "ending it (killed?); what it reported is kept",
    )


def _never_connected(engine: UnmanagedHost, run: TrialRun) -> None:
    if engine.unmanaged.get(run.trial_id) is run and not run.writers:
        end(
            engine,
            run,
            State.ERROR,
            f"unmanaged trial {run.trial_id}: its process never connected in "
            f"{HELLO_TIMEOUT_S:.0f}s",
        )


def end(engine: UnmanagedHost, run: TrialRun, state: State, message: str | None) -> None:
    """Record the end of the trial, then of its experiment (through the searcher, which shuts
    down once its one trial has exited)."""
    if engine.unmanaged.get(run.trial_id) is not run:
        return
    del engine.unmanaged[run.trial_id]
    for t in run.timers:
        t.cancel()
    _remove_token(engine, run)
    exp = engine.experiment(run.experiment_id)
    engine.store.set_trial_state(run.trial_id, state, message)
    if state == State.COMPLETED:
        actions = exp.searcher.on_trial_exited(run.request_id)
    else:
        actions = exp.searcher.on_trial_exited_early(run.request_id, "ERRORED")
    engine.apply(exp, actions)
    engine.note(
        f"experiment {exp.id}: unmanaged trial {run.trial_id} ended {state.value}"
        + (f": {message}" if message else ""),
        experiment_id=exp.id,
        trial_id=run.trial_id,
        level="INFO" if state == State.COMPLETED else "ERROR",
    )
    engine.check_idle()


# ---------------------------------------------------------------------- elsewhere
def refuse_control(engine: UnmanagedHost, experiment_id: int, action: str) -> None:
    """pause/activate/kill of a live unmanaged experiment: det-local cannot stop or start its
    process, so it says which process to stop."""
    rec = engine.store.get_experiment(experiment_id)
    if not is_unmanaged(rec.config) or rec.state.terminal:
        return
    live = [r for r in engine.unmanaged.values() if r.experiment_id == experiment_id]
    who = f" (pid {live[0].pid})" if live and live[0].pid else ""
    raise StateError(
        f"experiment {experiment_id} is unmanaged: its trial is reported by a process det-local "
        f"did not start{who}, so it cannot {action} it; stop that process instead (its trial "
        "then ends)"
    )


def settle_after_restart(engine: UnmanagedHost, experiment_id: int) -> bool:
    """At engine start: an unmanaged experiment still ACTIVE lost its process's connection (the
    engine stopped meanwhile); its trials end ERROR, and nothing is started for them. False for
    other experiments."""
    rec = engine.store.get_experiment(experiment_id)
    if not is_unmanaged(rec.config):
        return False
    exp = engine.experiment(experiment_id)
    for t in engine.store.list_trials(experiment_id):
        if t.state.terminal:
            continue
        engine.store.set_trial_state(
            t.id,
            State.ERROR,
            f"the det-local engine stopped while unmanaged trial {t.id} was reporting; its "
            "process can no longer report (run the script again)",
        )
        rid = exp.request_of.get(t.id)
        if rid is not None:
            engine.apply(exp, exp.searcher.on_trial_exited_early(rid, "ERRORED"))
    if not engine.store.get_experiment(experiment_id).state.terminal:
        engine.store.set_experiment_state(experiment_id, State.ERROR)
    return True


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1
