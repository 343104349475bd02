"""Determined's ``determined.experimental.core_v2``: the Core API for runs det-local did not
start ("unmanaged": a plain ``python train.py``, a notebook), recorded in the local store.

    from determined.experimental import core_v2
    core_v2.init(config=core_v2.Config(name="notebook", hparams={"lr": 0.1}))
    core_v2.train.report_training_metrics(steps_completed=1, metrics={"loss": 0.5})
    core_v2.close()

``init`` asks the det-local engine of DET_LOCAL_HOME for an experiment and its trial (an
``unmanaged`` request through the spool: the daemon if one runs, else an engine started in this
process for its lifetime, as ``det-local run`` does), then reports over the trial socket like a
trial (see ``det_local.sched.sessions.unmanaged``). ``experiment list`` and ``trial describe`` show
it
at once. ``close()`` (or a normal exit) ends the trial and its experiment COMPLETED; an uncaught
exception or a non-zero exit code ends them ERROR (Determined's rule).

Run under ``det-local run`` (a managed trial), ``init`` is ``core.init()`` and the config is
ignored, as in Determined. The singletons ``train``, ``checkpoint``, ``distributed``,
``preempt``, ``searcher`` and ``info`` are set by ``init``. The older spellings
``init(defaults=DefaultConfig(...), unmanaged=UnmanagedConfig(...))`` work, with Determined's
FutureWarning.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
import traceback
import uuid
import warnings
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from det_local.errors import DetLocalError
from det_local.trial.core import (
    CheckpointContext,
    Context,
    DistributedContext,
    DummyDistributedContext,
    DummyPreemptContext,
    PreemptMode,
    SearcherContext,
    SearcherContextMissing,
    TensorboardMode,
    TrainContext,
)
from det_local.trial.core import init as _core_init
from det_local.wire.trialinfo import ClusterInfo, get_cluster_info

if TYPE_CHECKING:
    from det_local.trial.core import PreemptContext
    from det_local.trial.session import Session

ENGINE_START_TIMEOUT_S = 60.0


@dataclasses.dataclass
class Config:
    """What an unmanaged run records (ignored when run as a managed trial)."""

    name: str | None = None
    hparams: dict[str, Any] | None = None
    data: dict[str, Any] | None = None
    description: str | None = None
    labels: list[str] | None = None
    workspace: str | None = None
    project: str | None = None
    checkpoint_storage: str | dict[str, Any] | None = None
    searcher: dict[str, Any] | None = None
    external_experiment_id: str | None = None
    external_trial_id: str | None = None


@dataclasses.dataclass
class DefaultConfig(Config):
    """Deprecated by Determined: use Config."""

    def __init__(self, **kwargs: Any) -> None:
        warnings.warn(
            "'DefaultConfig' class have been deprecated and will be removed in a future "
            "version. Please use `Config` class instead.",
            FutureWarning,
            stacklevel=2,
        )
        super().__init__(**kwargs)


@dataclasses.dataclass
class UnmanagedConfig(Config):
    """Deprecated by Determined: use Config."""

    def __init__(self, **kwargs: Any) -> None:
        warnings.warn(
            "'UnmanagedConfig' class have been deprecated and will be removed in a future "
            "version. Please use `Config` class instead.",
            FutureWarning,
            stacklevel=2,
        )
        super().__init__(**kwargs)


# The singletons init() sets.
train: TrainContext | None = None
checkpoint: CheckpointContext | None = None
distributed: DistributedContext | None = None
preempt: PreemptContext | None = None
searcher: Any = None
info: ClusterInfo | None = None

_context: Context | None = None
_atexit_registered = False


# ---------------------------------------------------------------------- the public API
def init(
    *,
    config: Config | None = None,
    defaults: DefaultConfig | None = None,
    unmanaged: UnmanagedConfig | None = None,
    client: Any = None,
    distributed: DistributedContext | None = None,
    checkpoint_storage: str | dict[str, Any] | None = None,
    preempt_mode: PreemptMode = PreemptMode.WorkersAskChief,
    tensorboard_mode: TensorboardMode = TensorboardMode.AUTO,
) -> None:
    """Start recording (singleton style): sets core_v2.train, .checkpoint, ...; end with
    close(), or let the process exit."""
    global _context, _atexit_registered
    if _context is not None:
        _context.close()
    _context = init_context(
        config=config,
        defaults=defaults,
        unmanaged=unmanaged,
        client=client,
        distributed=distributed,
        checkpoint_storage=checkpoint_storage,
        preempt_mode=preempt_mode,
        tensorboard_mode=tensorboard_mode,
    )
    _context.__enter__()
    _set_globals(_context)
    if not _atexit_registered:
        atexit.register(close)
        _atexit_registered = True


def init_context(
    *,
    config: Config | None = None,
    defaults: DefaultConfig | None = None,
    unmanaged: UnmanagedConfig | None = None,
    client: Any = None,
    distributed: DistributedContext | None = None,
    checkpoint_storage: str | dict[str, Any] | None = None,
    preempt_mode: PreemptMode = PreemptMode.WorkersAskChief,
    tensorboard_mode: TensorboardMode = TensorboardMode.AUTO,
) -> Context:
    """The context-manager style: ``with core_v2.init_context(config=...) as core_context:``."""
    merged = _merge_config(config, defaults, unmanaged)
    managed = get_cluster_info()
    if managed is not None and managed.task_type == "TRIAL":
        return _core_init(
            distributed=distributed,
            checkpoint_storage=checkpoint_storage,
            preempt_mode=preempt_mode,
            tensorboard_mode=tensorboard_mode,
        )
    assert merged is not None
    return _start_unmanaged(merged, distributed, checkpoint_storage, preempt_mode)


def close() -> None:
    """End the run: its trial and experiment end COMPLETED (ERROR if the process is exiting
    because of an uncaught exception or a non-zero exit code)."""
    global _context, train
    if _context is not None:
        _context.close()
    _context = None
    train = None


def url_reverse_webui_exp_view() -> str:
    """Where to look at the experiment: det-local has no web UI address yet, so the command."""
    if info is None or info._trial_info is None:
        raise RuntimeError("core_v2.init() has not been called")
    return f"det-local experiment describe {info._trial_info.experiment_id}"


# ---------------------------------------------------------------------- internals
def _set_globals(ctx: Context) -> None:
    global train, checkpoint, distributed, preempt, searcher, info
    train = ctx.train
    checkpoint = ctx.checkpoint
    distributed = ctx.distributed
    preempt = ctx.preempt
    searcher = ctx.searcher
    info = ctx.info


def _merge_config(
    config: Config | None, defaults: DefaultConfig | None, unmanaged: UnmanagedConfig | None
) -> Config | None:
    if defaults is not None or unmanaged is not None:
        warnings.warn(
            "'defaults' and 'unmanaged' parameters have been deprecated and will be removed in "
            "a future version. Please use `config` instead.",
            FutureWarning,
            stacklevel=3,
        )
    if config is not None:
        return config
    managed = get_cluster_info()
    if defaults is None and managed is None:
        raise ValueError(
            "either specify `defaults` or `config`, or run as a managed determined experiment"
        )
    if defaults is not None and unmanaged is not None:
        for f in ("project", "workspace", "external_experiment_id", "external_trial_id"):
            if getattr(defaults, f) is None:
                setattr(defaults, f, getattr(unmanaged, f))
    return defaults


def _storage_config(storage: str | dict[str, Any]) -> dict[str, Any]:
    """Determined's checkpoint_storage shortcuts: a path or file:// URL is shared_fs there."""
    if isinstance(storage, dict):
        return dict(storage)
    path = storage[len("file://") :] if storage.startswith("file://") else storage
    if "://" in path:
        raise DetLocalError(
            f"checkpoint_storage {storage!r}: det-local stores checkpoints on local or shared "
            "filesystems only; give a path"
        )
    return {"type": "shared_fs", "host_path": os.path.abspath(os.path.expanduser(path))}


def _experiment_config(cfg: Config, storage: str | dict[str, Any] | None) -> dict[str, Any]:
    """The experiment config an unmanaged run records (Determined's defaults for core_v2)."""
    raw: dict[str, Any] = {
        "name": cfg.name or f"unmanaged-{uuid.uuid4().hex[:8]}",
        "hyperparameters": {
            str(k): {"type": "const", "val": v} for k, v in (cfg.hparams or {}).items()
        },
        "searcher": cfg.searcher
        or {"name": "single", "metric": "unmanaged", "max_length": 100000000},
        "max_restarts": 0,
    }
    for key, value in (
        ("description", cfg.description),
        ("labels", cfg.labels),
        ("data", cfg.data),
        ("workspace", cfg.workspace),
        ("project", cfg.project),
    ):
        if value is not None:
            raw[key] = value
    storage = storage or cfg.checkpoint_storage
    if storage:
        raw["checkpoint_storage"] = _storage_config(storage)
    return raw


class _ExitWatch:
    """Determined's exit hook: remembers an uncaught exception and a sys.exit code, so that an
    exit without close() ends the trial ERROR when the process failed."""

    def __init__(self) -> None:
        self.exception: BaseException | None = None
        self.exit_code: Any = None
        self._orig_exit = sys.exit
        self._orig_hook = sys.excepthook

    def install(self) -> None:
        sys.exit = self._exit  # type: ignore[assignment]
        sys.excepthook = self._excepthook

    def uninstall(self) -> None:
        if sys.exit == self._exit:
            sys.exit = self._orig_exit
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._orig_hook

    def _exit(self, code: Any = 0) -> None:
        self.exit_code = code
        self._orig_exit(code)

    def _excepthook(self, typ: type[BaseException], value: BaseException, tb: Any) -> None:
        self.exception = value
        self._orig_hook(typ, value, tb)

    def failure(self) -> str | None:
        if self.exception is not None:
            return _describe(self.exception)
        if self.exit_code not in (None, 0):
            return f"the script exited with code {self.exit_code}"
        return None


def _describe(err: BaseException) -> str:
    where = traceback.extract_tb(err.__traceback__)[-1:] if err.__traceback__ else []
    at = f" at {Path(where[0].filename).name}:{where[0].lineno}" if where else ""
    text = str(err).strip().splitlines()
    return f"the script raised {type(err).__name__}{at}" + (f": {text[0]}" if text else "")


class _UnmanagedContext(Context):
    """A Context whose end is the end of its unmanaged trial."""

    def __init__(
        self,
        *args: Any,
        engine: _EngineThread | None,
        exit_watch: _ExitWatch,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._engine = engine
        self._exit_watch = exit_watch
        self._ended = False
        self._end_lock = threading.Lock()
        atexit.register(self._at_exit)

    def __exit__(
        self,
        typ: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        from det_local.trial import InvalidHP

        failed = value is not None and not isinstance(value, InvalidHP)
        if isinstance(value, SystemExit) and value.code in (None, 0):
            failed = False
        if failed:
            assert value is not None
            self._end("ERROR", _describe(value))
        super().__exit__(typ, value, tb)

    def close(self) -> None:
        failure = self._exit_watch.failure()
        self._end("ERROR" if failure else "COMPLETED", failure)

    def _at_exit(self) -> None:
        self.close()

    def _end(self, state: str, message: str | None) -> None:
        from det_local.sched.sessions.unmanaged import END

        with self._end_lock:
            if self._ended:
                return
            self._ended = True
        atexit.unregister(self._at_exit)
        self._exit_watch.uninstall()
        try:
            if self._session is not None:
                self._session.request(END, timeout=60, state=state, message=message)
                self._session.close()
        finally:
            try:
                self.distributed.close()
            finally:
                if self._engine is not None:
                    self._engine.stop()


def _start_unmanaged(
    cfg: Config,
    dist: DistributedContext | None,
    storage: str | dict[str, Any] | None,
    preempt_mode: PreemptMode,
) -> _UnmanagedContext:
    from det_local.sched.sessions.unmanaged import MAX_TOKEN_BYTES
    from det_local.store.safe_open import read_bounded
    from det_local.trial.session import Session

    if cfg.external_experiment_id is not None or cfg.external_trial_id is not None:
        warnings.warn(
            "det-local does not resume or group unmanaged runs by external_experiment_id / "
            "external_trial_id: this run records a new experiment",
            stacklevel=4,
        )
    dist = dist or DummyDistributedContext()
    raw = _experiment_config(cfg, storage)
    payload = {
        "config": raw,
        "argv": [Path(sys.executable).name, *sys.argv] if sys.argv and sys.argv[0] else [],
        "cwd": os.getcwd(),
    }
    engine: _EngineThread | None = None
    answer: dict[str, Any] | None = None
    token = ""
    if dist.rank == 0:
        engine, answer = _request(payload)
        token = read_bounded(
            answer["token_file"], MAX_TOKEN_BYTES, owner=os.geteuid(), what="session token file"
        ).decode()
    if dist.size > 1:  # the chief records the run; the other ranks learn its ids
        answer = dist.broadcast(answer)
    assert answer is not None
    info_ = ClusterInfo._from_files(Path(answer["info_dir"]))
    assert info_ is not None
    session: Session | None = None
    if dist.rank == 0:
        session = Session(
            answer["socket"],
            token,
            int(answer["trial_id"]),
            int(answer["run_id"]),
            hello={"unmanaged": True},
        )
    storage_dir = Path(answer["checkpoint_dir"])
    storage_dir.mkdir(parents=True, exist_ok=True)  # as this user: a path of their choosing
    watch = _ExitWatch()
    watch.install()
    config = info_.trial._config
    has_ops = (config.get("searcher") or {}).get("max_length") is not None
    return _UnmanagedContext(
        checkpoint=CheckpointContext(dist, storage_dir, session),
        distributed=dist,
        preempt=DummyPreemptContext(dist, preempt_mode),  # Determined: no preemption here
        train=TrainContext(session, answer["tensorboard_dir"]),
        searcher=SearcherContext(session, dist, config) if has_ops else SearcherContextMissing(),
        info=info_,
        session=session,
        engine=engine,
        exit_watch=watch,
    )


def _request(payload: dict[str, Any]) -> tuple[_EngineThread | None, dict[str, Any]]:
    """Ask the running engine (the daemon, another det-local process) for the run, or start an
    engine in this process when none runs."""
    from det_local.client.requester import remote_request, retrying
    from det_local.sched.enginelock import lock_free
    from det_local.sched.sessions.unmanaged import OP
    from det_local.store.paths import Paths

    paths = Paths.from_env()
    box: list[_EngineThread] = []

    def attempt() -> Any:
        if not box and lock_free(paths):
            box.append(_EngineThread(paths))
        return remote_request(paths, OP, payload)

    try:
        answer = retrying(paths, attempt)
    except BaseException:
        for engine in box:
            engine.stop()
        raise
    return (box[0] if box else None), answer


async def _connections_closed(engine: Any, timeout: float = 5.0) -> None:
    """Let the socket's connection handlers see their clients' EOF (this process closed its
    session before stopping the engine) instead of cancelling them mid-read."""
    import asyncio

    me = asyncio.current_task()
    others = [t for t in asyncio.all_tasks() if t is not me and t not in engine.tasks]
    if others:
        await asyncio.wait(others, timeout=timeout)


class _EngineThread:
    """det-local's engine in this process, on a thread of its own, while no other runs: the
    one writer of the store for the life of the run (as `det-local run` does with no daemon).
    Other det-local commands meanwhile send their requests to it."""

    def __init__(self, paths: Any) -> None:
        from det_local.client.requester import EngineGone
        from det_local.sched.enginelock import EngineLock

        self.paths = paths
        self.lock = EngineLock(paths)
        if not self.lock.try_acquire():
            self.lock.release()
            raise EngineGone("another det-local engine started meanwhile")
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: Any = None
        self._stop: Any = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="det-local-engine", daemon=True)
        self._thread.start()
        if not self._ready.wait(ENGINE_START_TIMEOUT_S) or self._error is not None:
            self.lock.release()
            err = self._error
            raise DetLocalError(f"cannot start a det-local engine in this process: {err}")

    def _run(self) -> None:
        import asyncio

        asyncio.run(self._main())

    async def _main(self) -> None:
        import asyncio

        from det_local.sched.engine import Engine

        try:
            engine = Engine(self.paths)
            await engine.start()
        except BaseException as err:
            self._error = err
            self._ready.set()
            return
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ready.set()
        try:
            await self._stop.wait()
            if not engine.is_idle():
                print(
                    "det-local: this process runs the det-local engine; waiting for the work "
                    "other det-local commands gave it to finish (a `det-local daemon start` "
                    "avoids this)",
                    file=sys.stderr,
                    flush=True,
                )
            await engine.wait_idle()
            await _connections_closed(engine)
        finally:
            await engine.stop()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._stop.set)
                self._thread.join()
        finally:
            self.lock.release()
