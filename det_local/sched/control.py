"""Changing experiments from the CLI: through a running engine's socket, or, with none running,
by starting an embedded engine for the purpose."""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

from det_local import rpc
from det_local.errors import DetLocalError
from det_local.store.paths import Paths

T = TypeVar("T")


RETRY_S = 60.0  # how long a request waits for an engine that is stopping to be gone
RETRY_TICK_S = 0.05


class EngineGone(DetLocalError):
    """The engine that held the lock stopped (or is stopping): run the request elsewhere."""


def lock_free(paths: Paths) -> bool:
    """Whether no process runs this home's engine right now."""
    from det_local.sched.embedded import EngineLock

    lock = EngineLock(paths)
    free = lock.try_acquire()
    lock.release()
    return free


def retrying(paths: Paths, attempt: Callable[[], T]) -> T:
    """Run attempt(), again while it raises EngineGone (an engine was stopping), for a while."""
    deadline = time.monotonic() + RETRY_S
    while True:
        try:
            return attempt()
        except EngineGone:
            if time.monotonic() > deadline:
                raise DetLocalError(
                    f"the det-local engine of {paths.home} kept stopping while this command "
                    "was sent to it; run the command again"
                ) from None
            time.sleep(RETRY_TICK_S)


class ControlClient:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.ids = itertools.count(1)

    @classmethod
    def connect(cls, paths: Paths, timeout: float = 10.0) -> ControlClient:
        """Connect to the running engine; EngineGone when it stopped meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(str(paths.socket))
                return cls(s)
            except OSError:
                s.close()
                if lock_free(paths):
                    raise EngineGone("the det-local engine stopped") from None
                if time.monotonic() > deadline:
                    raise DetLocalError(
                        f"another det-local holds {paths.run_dir / 'engine.lock'} but its socket "
                        f"{paths.socket} does not answer; if no det-local is running, remove the "
                        "lock file and try again"
                    ) from None
                time.sleep(RETRY_TICK_S)

    def request(self, op: str, **fields: Any) -> Any:
        req = {"t": "control", "id": next(self.ids), "op": op, **fields}
        try:
            rpc.send(self.sock, req)
            reply = rpc.recv(self.sock)
        except OSError:
            reply = None
        if reply is None:
            # the engine stopped between connect and answer; nothing was done
            raise EngineGone("the det-local engine closed the connection before answering")
        if reply.get("retry"):
            raise EngineGone(str(reply.get("error") or "the det-local engine is stopping"))
        if reply.get("error"):
            raise DetLocalError(str(reply["error"]))
        return reply.get("value")


def control_experiment(paths: Paths, experiment_id: int, action: str, **fields: Any) -> str:
    return retrying(paths, lambda: _control_once(paths, experiment_id, action, **fields))


def _control_once(paths: Paths, experiment_id: int, action: str, **fields: Any) -> str:
    from det_local.sched.embedded import EngineLock, drive

    lock = EngineLock(paths)
    held = not lock.try_acquire()
    lock.release()
    if held:
        client = ControlClient.connect(paths)
        return str(client.request(action, experiment_id=experiment_id, **fields))
    if action == "activate":
        # no engine running: run the experiment here, in the foreground, as `det-local run` does
        def act(engine: Any) -> int:
            print(engine.activate(experiment_id), flush=True)
            return experiment_id

        def remote(client: ControlClient) -> int:
            client.request("activate", experiment_id=experiment_id)
            return experiment_id

        code = drive(paths, act, remote, follow=True)
        if code:
            raise _Exit(code)
        return f"experiment {experiment_id} finished"
    return _offline(paths, experiment_id, action, **fields)


class _Exit(DetLocalError):
    def __init__(self, code: int) -> None:
        super().__init__("")
        self.exit_code = code


def _offline(paths: Paths, experiment_id: int, action: str, **fields: Any) -> str:
    """No engine is running: act as one for a moment (nothing runs, so no process to signal)."""
    import asyncio

    from det_local.sched.embedded import EngineLock
    from det_local.sched.engine import Engine

    lock = EngineLock(paths)
    if not lock.try_acquire():
        lock.release()
        return str(
            ControlClient.connect(paths).request(action, experiment_id=experiment_id, **fields)
        )

    async def go() -> str:
        engine = Engine(paths)
        engine.loop = asyncio.get_running_loop()
        try:
            if action == "pause":
                return engine.pause(experiment_id)
            if action == "kill":
                return engine.kill(experiment_id)
            if action == "label_add":
                return engine.set_labels(experiment_id, str(fields["label"]), None)
            if action == "label_remove":
                return engine.set_labels(experiment_id, None, str(fields["label"]))
            raise DetLocalError(f"unknown action {action!r}")
        finally:
            engine.store.close()

    try:
        return asyncio.run(go())
    finally:
        lock.release()
