"""/api/: the CLI's --json outputs over HTTP, built by the same `det_local.api` functions
(same keys), plus what the charts and the log view read:

    GET /api/experiments                         experiment list --json (every user's)
    GET /api/experiments/{id}                    experiment describe --json
    GET /api/experiments/{id}/metrics?group=G    each trial's reports of G (validation),
                                                 downsampled, best trial first, with what
                                                 the x units need (expviews.experiment_curves):
                                                 {"experiment_id", "group", "state", ...,
                                                 "trials": [{"trial_id", ..., "reports"}]}
    GET /api/trials/{id}                         trial describe --json
    GET /api/trials/{id}/metrics?group=G         trial metrics --json, ~2,000 points a group
    GET /api/trials/{id}/logs?offset=N|tail=N    {"trial_id", "offset", "lines", "state"}
    GET /api/trials/{id}/stream?offset=N         live: server-sent events (live.py)
    GET /api/experiments/{id}/stream             live: server-sent events (live.py)
    GET /api/jobs?all=1                          job list --json
    GET /api/slots                               slots --json

Unknown ids: 404 with {"error": "one line"}; read-only: every route is GET.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from det_local.views import cluster as clusterviews
from det_local.views import experiments as expviews
from det_local.views import logs as logviews
from det_local.web.responses import (
    json_errors,
    json_response,
    path_id,
    query_flag,
    query_int,
)

DEFAULT_TAIL = 1000  # lines a log view starts with


@json_errors
def experiments(request: Request) -> Response:
    return json_response(expviews.experiments_json(all_users=True))


@json_errors
def experiment(request: Request) -> Response:
    return json_response(expviews.experiment_json(path_id(request, "experiment_id")))


@json_errors
def experiment_metrics(request: Request) -> Response:
    exp_id = path_id(request, "experiment_id")
    group = request.query_params.get("group") or expviews.VALIDATION
    return json_response(expviews.experiment_curves(exp_id, group))


@json_errors
def trial(request: Request) -> Response:
    return json_response(expviews.trial_json(path_id(request, "trial_id")))


@json_errors
def trial_metrics(request: Request) -> Response:
    group = request.query_params.get("group") or None
    reports = expviews.trial_metrics_sampled(path_id(request, "trial_id"), group)
    return json_response([r.to_json() for r in reports])


@json_errors
def trial_logs(request: Request) -> Response:
    offset = query_int(request, "offset")
    tail = query_int(request, "tail", DEFAULT_TAIL)
    chunk = logviews.trial_log_chunk(path_id(request, "trial_id"), offset=offset, tail=tail)
    return json_response(chunk)


@json_errors
def jobs(request: Request) -> Response:
    return json_response(clusterviews.jobs_json(include_done=query_flag(request, "all")))


@json_errors
def slots(request: Request) -> Response:
    return json_response(clusterviews.slots_json())


@json_errors
def unknown(request: Request) -> Response:
    return json_response(
        {"error": f"no such API route: {request.url.path} (the routes are listed at /api/)"}, 404
    )


@json_errors
def index(request: Request) -> Response:
    """Every /api/ route of the application (other modules add theirs before the catch-all)."""
    paths = [getattr(r, "path", "") for r in request.app.router.routes]
    return json_response(
        {"routes": [p for p in paths if p.startswith("/api/") and p != "/api/{rest:path}"]}
    )


def routes() -> list[Route]:
    from det_local.web.live import experiment_stream, trial_stream

    return [
        *ROUTES[:-1],
        Route("/api/trials/{trial_id}/stream", trial_stream),
        Route("/api/experiments/{experiment_id}/stream", experiment_stream),
        ROUTES[-1],
    ]


ROUTES = [
    Route("/api/", index),
    Route("/api/experiments", experiments),
    Route("/api/experiments/{experiment_id}", experiment),
    Route("/api/experiments/{experiment_id}/metrics", experiment_metrics),
    Route("/api/trials/{trial_id}", trial),
    Route("/api/trials/{trial_id}/metrics", trial_metrics),
    Route("/api/trials/{trial_id}/logs", trial_logs),
    Route("/api/jobs", jobs),
    Route("/api/slots", slots),
    Route("/api/{rest:path}", unknown),
]
