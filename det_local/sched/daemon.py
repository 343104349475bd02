"""The per-machine daemon: one engine per DET_LOCAL_HOME that runs until it is stopped.

`det-local daemon` runs it in the foreground; `det-local daemon start|stop|status` manage it in
the background. The engine lock (an flock, released by the kernel when its holder dies, even by
kill -9) decides who runs this home's engine; the pid file only tells people which process
that is, so a stale pid file left by a crash never blocks a restart.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from det_local.errors import DetLocalError
from det_local.store.paths import Paths

if TYPE_CHECKING:
    from det_local.sched.extensions import ExtensionFactory


class DaemonError(DetLocalError):
    pass


@dataclass(frozen=True)
class DaemonInfo:
    pid: int
    started_at: float
    home: str


def read_pid_file(paths: Paths) -> DaemonInfo | None:
    try:
        data = json.loads(paths.pid_file.read_text())
        return DaemonInfo(int(data["pid"]), float(data["started_at"]), str(data["home"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def running_daemon(paths: Paths) -> DaemonInfo | None:
    """The live daemon of this home, or None (a pid file whose lock is free is stale)."""
    from det_local.sched.enginelock import lock_free

    info = read_pid_file(paths)
    if info is None or lock_free(paths):
        return None
    return info


def _prepare_home(paths: Paths) -> None:
    """System mode (root): everyone submits into the spool and reads the store; only the
    daemon writes it. The spool is sticky and world-writable, like /tmp."""
    paths.ensure()
    if os.geteuid() != 0:
        return
    os.chmod(paths.home, 0o755)
    os.chmod(paths.queue, 0o1777)
    os.chmod(paths.checkpoints, 0o1777)
    for d in (paths.run_dir, paths.queue / "responses"):
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o755)


def run_foreground(paths: Paths, extensions: Sequence[ExtensionFactory] = ()) -> int:
    """`det-local daemon`: serve until SIGTERM/SIGINT or `daemon stop`. `extensions` are
    services run on the engine's loop (federation), handed in by the entry point."""
    from det_local.sched.enginelock import EngineLock

    _prepare_home(paths)
    lock = EngineLock(paths)
    if not lock.try_acquire():
        lock.release()
        info = read_pid_file(paths)
        if info is not None:
            raise DaemonError(
                f"a det-local daemon is already running for {paths.home} (pid {info.pid}); "
                "`det-local daemon stop` stops it"
            )
        raise DaemonError(
            f"a `det-local run` is using {paths.home} right now; start the daemon when it ends "
            "(its experiments then go on under the daemon), or use another DET_LOCAL_HOME"
        )
    import asyncio  # here, not at the top: `daemon status` reads the pid file (below) only

    try:
        return asyncio.run(_serve(paths, extensions))
    finally:
        try:
            info = read_pid_file(paths)
            if info is not None and info.pid == os.getpid():
                paths.pid_file.unlink()
        except OSError:
            pass
        lock.release()


async def _serve(paths: Paths, extensions: Sequence[ExtensionFactory] = ()) -> int:
    import asyncio

    from det_local.sched.engine import Engine

    def log(line: str) -> None:
        try:
            print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}", file=sys.stderr, flush=True)
        except OSError:  # the log's disk is full: the daemon goes on without it
            pass

    _private_log(paths)
    # the loop shares the interpreter with threads that decode what users send (large trial
    # frames, spool requests: wire/budget.py's scan is Python); each time the loop gives up
    # the GIL (every syscall) it waits up to the switch interval to get it back: 1 ms, not 5
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    engine = Engine(paths, out=log, daemon=True)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, engine.request_stop)
    await engine.start()
    # only now, with the jobs of an earlier daemon adopted or settled: `daemon start` returns
    services = await _start_extensions(engine, extensions, log)
    _write_pid_file(paths, {"containment": engine.containment.as_dict()})
    # what the start built (modules, the engine, its extensions) lives as long as the daemon:
    # out of the cyclic collector's full passes, which a message of many maps and lists
    # decoded off the loop would otherwise set off over all of it (~0.5 s of every thread)
    gc.freeze()
    log(
        f"det-local: daemon {os.getpid()} serving {paths.home} with "
        f"{engine.inventory.size()} {engine.inventory.source} slot(s); "
        f"containment: {engine.containment.describe()}"
    )
    from det_local.health.looplag import FILE_NAME, LoopLag

    lag = LoopLag(paths.run_dir / FILE_NAME)  # `daemon status --json`: loop_lag_ms
    probe = asyncio.ensure_future(lag.run())
    try:
        await engine.serve_forever()
    finally:
        probe.cancel()
        lag.remove()
        for service in reversed(services):  # extension seam: before the engine stops
            await service.stop()
        await engine.stop()
        log("det-local: daemon stopped; running jobs go on and are adopted at the next start")
    return 0


async def _start_extensions(
    engine: Any, factories: Sequence[ExtensionFactory], log: Callable[[str], None]
) -> list[Any]:
    """The extension seam: each service gets an EngineView, its door into the engine."""
    from det_local.sched.extensions import EngineView

    services = []
    for factory in factories:
        service = factory(EngineView(engine, log))
        await service.start()
        services.append(service)
    return services


SWITCH_INTERVAL_S = 0.001


def _private_log(paths: Paths) -> None:
    """The daemon's log (run/daemon.log, where `daemon start` sends its output) is its owner's
    only: it names every user's jobs with their command lines. One an earlier version left
    world-readable (0644) is re-moded at start; a symbolic link there is not followed."""
    try:
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never a FIFO wait
        fd = os.open(paths.run_dir / "daemon.log", flags)
    except OSError:
        return  # none (systemd: the journal), or a link: nothing of ours to re-mode
    try:
        if os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, 0o600)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_pid_file(paths: Paths, extra: dict[str, Any] | None = None) -> None:
    tmp = paths.pid_file.with_suffix(".tmp")
    info = {"pid": os.getpid(), "started_at": time.time(), "home": str(paths.home)}
    tmp.write_text(json.dumps({**info, **(extra or {})}))
    os.chmod(tmp, 0o644)
    os.replace(tmp, paths.pid_file)
