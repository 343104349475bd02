"""/api/ routes the learning-curve and log views read beyond jsonapi.py:

    GET /api/experiments/{id}/progress?after=N   {"experiment_id", "state", "ended",
                                                 "last"}: the row id of the experiment's
                                                 newest metric report if newer than N (else
                                                 N); what a live experiment page polls
                                                 before it fetches the curves again
    GET /api/trials/{id}/logs/raw                the trial's whole output as text/plain, an
                                                 attachment (every run and rank, as written)

Errors as jsonapi's: {"error": "one line"}, 404 for an unknown id, 400 for a bad number.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import IO

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from det_local.errors import DetLocalError
from det_local.store.states import State
from det_local.views import experiments as expviews
from det_local.views import logs as logviews
from det_local.web.responses import error_status, json_errors, json_response, path_id, query_int

CHUNK = 1 << 16  # bytes read from the log file at a time


@json_errors
def experiment_progress(request: Request) -> Response:
    exp_id = path_id(request, "experiment_id")
    state, last = expviews.experiment_progress(exp_id, query_int(request, "after"))
    ended = State(state).terminal
    return json_response({"experiment_id": exp_id, "state": state, "ended": ended, "last": last})


async def raw_log(request: Request) -> Response:
    """The log file as it is at the request, streamed up to its size then (a running trial's
    later lines are for the next download)."""
    try:
        trial_id = path_id(request, "trial_id")
        name, f = await anyio.to_thread.run_sync(logviews.open_trial_log, trial_id)
    except DetLocalError as err:
        return json_response({"error": str(err)}, error_status(err))
    headers = {"Content-Disposition": f'attachment; filename="{name}"'}
    if f is None:
        return Response(b"", media_type="text/plain; charset=utf-8", headers=headers)
    size = os.fstat(f.fileno()).st_size
    return StreamingResponse(
        _read(f, size), media_type="text/plain; charset=utf-8", headers=headers
    )


async def _read(f: IO[bytes], size: int) -> AsyncIterator[bytes]:
    try:
        left = size
        while left > 0:
            data = await anyio.to_thread.run_sync(f.read, min(CHUNK, left))
            if not data:  # truncated meanwhile
                break
            left -= len(data)
            yield data
    finally:
        f.close()


ROUTES = [
    Route("/api/experiments/{experiment_id}/progress", experiment_progress),
    Route("/api/trials/{trial_id}/logs/raw", raw_log),
]
