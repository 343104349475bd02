"""`det-local run` with no daemon: an engine in this process for the life of the run.

If an engine already runs on this DET_LOCAL_HOME (another `det-local run`, or the daemon), the
experiment is submitted to it instead, and this process only follows its output.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from det_local.errors import DetLocalError
from det_local.sched.follow import Follower, summary
from det_local.sched.plan import allowed_submitter_vars
from det_local.sched.requester import lock_free_fd
from det_local.store.paths import Paths
from det_local.store.states import State

EXIT_CODES = {State.COMPLETED: 0, State.ERROR: 1, State.CANCELED: 2, State.PAUSED: 3}


class EngineLock:
    """An flock on run/engine.lock: held by whichever process runs this home's engine."""

    def __init__(self, paths: Paths) -> None:
        self.home = paths.home
        self.path = paths.run_dir / "engine.lock"
        self.writable = True
        try:
            paths.ensure()
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError:
            # system mode: the home is root's; other users only ever talk to its daemon
            self.writable = False
            try:
                self.fd = os.open(self.path, os.O_RDONLY)
            except OSError:
                self.fd = -1

    def try_acquire(self) -> bool:
        if not self.writable:
            if self.fd >= 0 and not lock_free_fd(self.fd):
                return False  # its daemon runs: send it the request
            raise DetLocalError(
                f"no det-local daemon is running for {self.home}, and its files belong to "
                "another user (a shared, system-mode home): ask its administrator to start "
                "it (`det-local daemon start` as root), or use a DET_LOCAL_HOME of your own"
            )
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"{os.getpid()}\n".encode())
        return True

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


Finish = Callable[[Any, int, float], tuple[str, int]]


def summarize(store: Any, exp_id: int, elapsed: float) -> tuple[str, int]:
    """The default end of a run: the summary, and the exit code for the final state."""
    code = EXIT_CODES.get(store.get_experiment(exp_id).state, 1)
    return summary(store, exp_id, elapsed), code


def test_report(paths: Paths) -> Finish:
    def finish(store: Any, exp_id: int, elapsed: float) -> tuple[str, int]:
        from det_local.sched.testmode import build_report

        report = build_report(store, paths, exp_id)
        return report.format(), 0 if report.passed else 1

    return finish


def run_experiment(
    paths: Paths,
    config_path: Path,
    context_dir: Path,
    *,
    follow: bool = True,
    quiet: bool = False,
    test_mode: bool = False,
    finish: Finish | None = None,
) -> int:
    from det_local.config import load_config

    cfg = load_config(config_path)
    context_dir = context_dir.resolve()
    source = str(config_path)

    # what trials take from this environment (PATH, LANG...): as a daemon would take it
    env = allowed_submitter_vars(os.environ)

    def act(engine: Any) -> int:
        return int(engine.submit(cfg, context_dir, source, test_mode=test_mode, env=env))

    def remote(p: Paths) -> int:
        from det_local.sched.requester import remote_request
        from det_local.sched.userfiles import current_umask

        payload = {
            "config": cfg.to_dict(),
            "context": str(context_dir),
            "source": source,
            "test_mode": test_mode,
            "env": env,
            "umask": current_umask(),  # its trials run with this umask, as if run here
        }
        return int(remote_request(p, "submit", payload))

    if finish is None:
        finish = test_report(paths) if test_mode else summarize
    return drive(paths, act, remote, follow=follow, quiet=quiet, announce=True, finish=finish)


def drive(
    paths: Paths,
    act: Callable[[Any], int],
    remote: Callable[[Paths], int],
    *,
    follow: bool,
    quiet: bool = False,
    announce: bool = False,
    finish: Finish = summarize,
) -> int:
    """Run `act(engine)` in an embedded engine (or `remote(paths)` against a live one), then
    follow the experiment it names until it stops; returns the exit code for its final state."""
    from det_local.sched.requester import retrying

    def attempt() -> tuple[EngineLock | None, int | None]:
        lock = EngineLock(paths)
        if lock.try_acquire():
            return lock, None
        lock.release()
        return None, remote(paths)

    # An engine that is stopping refuses new work (EngineGone): wait until it is gone, then
    # run the request in an engine here.
    lock, exp_id = retrying(paths, attempt)
    if lock is None:
        assert exp_id is not None
        if announce:
            print(f"Created experiment {exp_id}", flush=True)
        if not follow:
            return 0
        return _follow_remote(paths, exp_id, quiet, finish)
    if not follow:
        lock.release()
        raise DetLocalError(
            "--detach hands the experiment to a running det-local engine (another `det-local "
            f"run` on {paths.home}), and none is running; run without --detach"
        )
    try:
        return asyncio.run(_embedded(paths, act, quiet, announce, finish))
    finally:
        lock.release()


async def _embedded(
    paths: Paths, act: Callable[[Any], int], quiet: bool, announce: bool, finish: Finish
) -> int:
    from det_local.sched.engine import Engine

    engine = Engine(paths)
    await engine.start()
    started = time.time()
    try:
        exp_id = act(engine)
        if announce:
            print(f"Created experiment {exp_id}", flush=True)
        install_interrupt(engine)
        follower = Follower(engine.store, paths, exp_id, sys.stdout if not quiet else None)
        task = asyncio.create_task(follower.run(poll=0.05))
        await engine.wait_idle()
        follower.stop()
        await task
        text, code = finish(engine.store, exp_id, time.time() - started)
        if text:
            print(text, flush=True)
        return code
    finally:
        await engine.stop()


def _follow_remote(paths: Paths, exp_id: int, quiet: bool, finish: Finish) -> int:
    from det_local.store.db import Store

    store = Store(paths.db, readonly=True)
    follower = Follower(store, paths, exp_id, sys.stdout if not quiet else None)
    started = time.time()

    async def go() -> None:
        await follower.run(poll=0.1, until_stopped=True)

    try:
        asyncio.run(go())
    except KeyboardInterrupt:
        print(
            f"\nstopped following; experiment {exp_id} goes on "
            f"(`det-local experiment pause {exp_id}` to pause it)",
            file=sys.stderr,
        )
        return 0
    _wait_for_checkpoint_gc(store, exp_id)
    text, code = finish(store, exp_id, time.time() - started)
    if text:
        print(text, flush=True)
    return code


def _wait_for_checkpoint_gc(store: Any, exp_id: int, timeout: float = 10.0) -> None:
    """The engine collects an ended experiment's checkpoints just after recording its end:
    wait (bounded) for that, so that the summary shows the checkpoints that are left."""
    import sqlite3

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if not store.checkpoint_gc_due(exp_id):
                return
        except sqlite3.Error:  # a database from before checkpoint GC
            return
        time.sleep(0.05)


def install_interrupt(engine: Any) -> None:
    """SIGINT/SIGTERM in embedded mode: first pause, second stop now."""
    count = 0
    import signal

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
