"""Sending a request to this home's running engine (the daemon, or another `det-local run`):
the engine lock probe, a request in the spool and its answer, retries while an engine stops.
Light on purpose: a CLI request imports neither asyncio nor the engine to ask."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from det_local.errors import DetLocalError
from det_local.sched.enginelock import lock_free
from det_local.sched.intake import spool
from det_local.store.paths import Paths

T = TypeVar("T")

RETRY_S = 60.0  # how long a request waits for an engine that is stopping to be gone
RETRY_TICK_S = 0.05
ANSWER_TIMEOUT_S = 120.0


class EngineGone(DetLocalError):
    """The engine that held the lock stopped before taking the request: run it elsewhere."""


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


def remote_request(
    paths: Paths, op: str, payload: dict[str, Any], timeout: float = ANSWER_TIMEOUT_S
) -> Any:
    """Put a request in the spool and wait for the running engine's answer. EngineGone when
    the engine stopped without taking it (the request is withdrawn: nothing was done)."""
    watch = spool.answer_watch(paths)  # before the request: its answer cannot slip by
    req_id = spool.submit(paths, op, payload, durable=False)
    return _await_answer(paths, req_id, timeout, watch)


def _await_answer(paths: Paths, req_id: str, timeout: float, watch: spool.AnswerWatch) -> Any:
    path = paths.queue / f"{req_id}{spool.SUFFIX}"
    deadline = time.monotonic() + timeout
    durable = False
    while True:
        try:
            return spool.wait_response(paths, req_id, timeout=0.25, watch=watch)
        except spool.NoAnswer:
            pass
        if not durable:  # not taken at once: from now on it waits in the spool, so keep it safe
            spool.make_durable(paths, req_id)
            durable = True
        if lock_free(paths):
            try:
                path.unlink()
            except FileNotFoundError:
                continue  # it was taken: its answer is (about to be) there
            raise EngineGone("the det-local engine stopped before taking the request") from None
        if time.monotonic() > deadline:
            raise DetLocalError(
                f"the det-local engine of {paths.home} did not answer in {timeout:.0f}s; "
                f"its request is still in {paths.queue} (`det-local daemon status`)"
            )
