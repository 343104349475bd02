"""Live updates as server-sent events. A trial (GET /api/trials/{id}/stream?offset=N):

    event: log       data: {"offset": N, "lines": [...]}    new whole lines of its output
    event: metrics   data: {"last": ROW_ID}                 new metric reports (refetch them:
                                                            the server downsamples)
    event: state     data: {"state": "COMPLETED"}           the trial's state changed
    event: end       data: {"state": ...}                   it stopped (ended or paused), and
                                                            everything it wrote was sent

An experiment (GET /api/experiments/{id}/stream): `metrics` when any of its trials reported
(data: {"last": ROW_ID}), `state` when its state changed, `end` once it is over (COMPLETED,
CANCELED, ERROR; a paused experiment's stream stays open: it may be activated again).

A stream polls the log file and the store (bounded: POLL_S, doubling to MAX_POLL_S while
idle), in a worker thread so that the event loop never waits on a disk; a comment line every
KEEPALIVE_S keeps proxies from closing an idle stream.

Streams are bounded: at most PER_CLIENT open from one client address and TOTAL in all (a
browser holds about 6 connections to one host; each page streams one). Beyond that a stream
is refused with 503 and one line, and pages go on being answered.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from det_local.errors import DetLocalError
from det_local.store.states import State
from det_local.views import experiments as expviews
from det_local.views import logs as logviews
from det_local.web.responses import error_status, json_response, path_id, query_int

PER_CLIENT = 16
TOTAL = 64
POLL_S = 0.1
MAX_POLL_S = 1.0
KEEPALIVE_S = 15.0


def event(name: str, data: Any) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def stopped(state: str) -> bool:
    s = State(state)
    return s.terminal or s is State.PAUSED


class Streams:
    """How many streams are open, by client address and in all."""

    def __init__(self, per_client: int = PER_CLIENT, total: int = TOTAL) -> None:
        self.per_client = per_client
        self.total = total
        self.open: dict[str, int] = {}

    def count(self) -> int:
        return sum(self.open.values())

    def take(self, client: str) -> str | None:
        """None (one more stream of `client` counted), or why not (one line)."""
        why = self.why_not(client)
        if why is None:
            self.open[client] = self.open.get(client, 0) + 1
        return why

    def why_not(self, client: str) -> str | None:
        """Why `client` may not open one more stream now (one line), or None."""
        if self.open.get(client, 0) >= self.per_client:
            return (
                f"too many live streams from {client}: {self.per_client} are open (the most "
                "one client may hold); close some dashboard pages and reload"
            )
        if self.count() >= self.total:
            return (
                f"too many live streams: {self.total} are open (the most this dashboard "
                "serves); reload later"
            )
        return None

    def give(self, client: str) -> None:
        left = self.open.get(client, 0) - 1
        if left > 0:
            self.open[client] = left
        else:
            self.open.pop(client, None)


STREAMS = Streams()  # this process's (the event loop's thread only: no lock)


class _Stream(StreamingResponse):
    """A stream that gives its place back however it ends (done, client gone, cancelled)."""

    def __init__(self, events: AsyncIterator[bytes], client: str) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.client = client

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            STREAMS.give(self.client)


def client_of(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def _full(request: Request) -> Response | None:
    """The refusal, before any work, of a stream there is no room for."""
    why = STREAMS.why_not(client_of(request))
    return None if why is None else json_response({"error": why}, 503)


def _sse(request: Request, events: AsyncIterator[bytes]) -> Response:
    client = client_of(request)
    refused = STREAMS.take(client)
    if refused is not None:
        return json_response({"error": refused}, 503)
    return _Stream(events, client)


async def _follow(
    request: Request, poll: Callable[[], Awaitable[list[bytes]]]
) -> AsyncIterator[bytes]:
    """Call `poll` (what changed since its last call, as events) until the client goes or an
    `end` event was sent: every POLL_S while there is news, backing off to MAX_POLL_S while
    idle, with a keep-alive comment every KEEPALIVE_S."""
    delay = POLL_S
    quiet_since = time.monotonic()
    yield b": live\n\n"  # the headers go out at once; the page knows it is connected
    while not await request.is_disconnected():
        events = await poll()
        for e in events:
            yield e
        if events and events[-1].startswith(b"event: end\n"):
            return
        if events:
            delay = POLL_S
            quiet_since = time.monotonic()
        else:
            delay = min(delay * 2, MAX_POLL_S)
            if time.monotonic() - quiet_since > KEEPALIVE_S:
                yield b": keep-alive\n\n"
                quiet_since = time.monotonic()
        await anyio.sleep(delay)


async def trial_stream(request: Request) -> Response:
    if (full := _full(request)) is not None:
        return full
    try:
        trial_id = path_id(request, "trial_id")
        offset = query_int(request, "offset", 0) or 0
        after = query_int(request, "metrics")
        state, last = await anyio.to_thread.run_sync(expviews.trial_progress, trial_id, after)
    except DetLocalError as err:
        return json_response({"error": str(err)}, error_status(err))

    async def poll() -> list[bytes]:
        nonlocal offset, last, state
        read = functools.partial(logviews.trial_log_chunk, trial_id, offset=offset)
        chunk = await anyio.to_thread.run_sync(read)
        new_state, new_last = await anyio.to_thread.run_sync(
            expviews.trial_progress, trial_id, last
        )
        out = []
        if chunk["lines"]:
            out.append(event("log", {"offset": chunk["offset"], "lines": chunk["lines"]}))
        offset = chunk["offset"]
        out += _changes(new_last, last, new_state, state)
        last, state = new_last, new_state
        if not out and stopped(state):  # ended or paused, and everything it wrote was sent
            out.append(event("end", {"state": state}))
        return out

    return _sse(request, _follow(request, poll))


async def experiment_stream(request: Request) -> Response:
    if (full := _full(request)) is not None:
        return full
    try:
        exp_id = path_id(request, "experiment_id")
        state, last = await anyio.to_thread.run_sync(expviews.experiment_progress, exp_id, None)
    except DetLocalError as err:
        return json_response({"error": str(err)}, error_status(err))

    async def poll() -> list[bytes]:
        nonlocal last, state
        new_state, new_last = await anyio.to_thread.run_sync(
            expviews.experiment_progress, exp_id, last
        )
        out = _changes(new_last, last, new_state, state)
        last, state = new_last, new_state
        if not out and State(state).terminal:  # a paused experiment may be activated again
            out.append(event("end", {"state": state}))
        return out

    return _sse(request, _follow(request, poll))


def _changes(new_last: int, last: int, new_state: str, state: str) -> list[bytes]:
    out = []
    if new_last != last:
        out.append(event("metrics", {"last": new_last}))
    if new_state != state:
        out.append(event("state", {"state": new_state}))
    return out
