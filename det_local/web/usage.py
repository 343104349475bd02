"""System metrics and usage in the dashboard (issue 30): the same readers as the CLI
(`det_local.api.system_metrics`, `clusterviews.usage`), one set of keys.

    GET /api/trials/{id}/system      a trial's (`trial metrics ID --group system --json`)
    GET /api/commands/{id}/system    a command's (`cmd metrics ID --json`)
    GET /commands/{id}               a command's page: its facts, idle note and system charts
    GET /usage?since=30d&by=user     slot-hours per user, a chart per user
    GET /api/usage?since=30d&by=user `det-local usage --json`

The charts are drawn by static/system.js (trial and command pages) and static/usage.js."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from det_local import api
from det_local.errors import NotFoundError
from det_local.tables import fmt_time
from det_local.usage.report import BY, parse_since
from det_local.views import cluster as clusterviews
from det_local.web.html import join, link, page, page_data, table, tag
from det_local.web.pages import html_errors, state_badge
from det_local.web.responses import json_errors, json_response, path_id


def _records(records: list[object]) -> list[object]:
    return [r.to_json() for r in records]  # type: ignore[attr-defined]


@json_errors
def trial_system_api(request: Request) -> Response:
    trial_id = path_id(request, "trial_id")
    return json_response(_records(clusterviews.system_metrics(trial_id=trial_id)))


@json_errors
def command_system_api(request: Request) -> Response:
    job_id = path_id(request, "job_id")
    api.open_store().jobs.get(job_id)  # an unknown id: 404
    try:
        return json_response(_records(clusterviews.system_metrics(job_id=job_id)))
    except NotFoundError:  # no samples yet: an empty chart
        return json_response([])


def _window(request: Request) -> tuple[str, float, str]:
    since = request.query_params.get("since") or "30d"
    by = request.query_params.get("by") or "user"
    return since, parse_since(since), by


@json_errors
def usage_api(request: Request) -> Response:
    _, since, by = _window(request)
    return json_response(clusterviews.usage(since, by=by))


@html_errors
def usage_page(request: Request) -> Response:
    text, since, by = _window(request)
    rep = clusterviews.usage(since, by=by)

    def util(r: dict[str, object]) -> str:
        u = r["mean_util_pct"]
        return "-" if u is None else f"{u}%"

    rows = [
        [
            "-" if r["key"] is None else r["key"],
            r["allocations"],
            f"{r['slot_hours']:.2f}",
            f"{r['used_slot_hours']:.2f}",
            util(r),
        ]
        for r in [*rep["rows"], rep["total"]]
    ]
    choices = join([link(f"/usage?since={text}&by={b}", b) for b in BY if b != by] + [" "], " · ")
    body = join(
        [
            tag(
                "p",
                join(
                    [
                        f"Since {fmt_time(since)} ({text}); by {by}. Group by: ",
                        choices,
                        " Slot-hours are GPU-hours on GPUs; used = allocated x the mean "
                        "utilisation the daemon sampled.",
                    ]
                ),
            ),
            table(
                [by.capitalize(), "Allocations", "Slot-hours", "Used slot-hours", "Mean util"],
                rows,
                id_="usage",
            ),
            tag("div", "", id="usage-charts", class_="charts"),
            page_data({"page": "usage", "since": text, "by": by}),
        ]
    )
    return page("Usage", body, scripts=["usage.js"], charts=True)


@html_errors
def command_page(request: Request) -> Response:
    job_id = path_id(request, "job_id")
    job = api.open_store().jobs.get(job_id)
    note = clusterviews.idle_notes([job_id]).get(job_id)
    facts = table(
        ["Kind", "User", "State", "Slots", "Started", "Ended", "Command"],
        [
            [
                job.kind.lower(),
                job.user,
                state_badge(str(job.state)),
                str(job.slots or job.slots_needed),
                fmt_time(job.started_at),
                fmt_time(job.ended_at),
                job.name,
            ]
        ],
        id_="command",
    )
    body = join(
        [
            facts,
            tag("p", note, class_="error", id="idle-note") if note else "",
            tag("p", job.message or "", class_="muted"),
            tag("h2", "System metrics"),
            tag("div", "", id="system-charts", class_="charts"),
            page_data({"page": "command", "job_id": job_id}),
        ]
    )
    return page(f"Command {job_id}", body, scripts=["system.js"], charts=True)


ROUTES = [
    Route("/api/trials/{trial_id}/system", trial_system_api),
    Route("/api/commands/{job_id}/system", command_system_api),
    Route("/api/usage", usage_api),
    Route("/usage", usage_page),
    Route("/commands/{job_id}", command_page),
]
