"""The commands page and its API: commands, shells, notebooks and TensorBoards (every job
that is not a trial), as `det-local cmd list --json` gives them (`clusterviews.commands_json`).

    GET /commands?all=1       the page (with ended ones: ?all=1)
    GET /api/commands?all=1   cmd list --json

A notebook's or TensorBoard's link is its address without a token: the dashboard has no user
authentication, and a notebook's token is printed only to its owner (by `det-local notebook
start`); the dashboard never has it (it is in the job's private environment).

Such a server is whatever its owner runs (a TensorBoard is the binary the owner's PATH names):
another user's, hostile to whoever clicks. Its link opens in a new tab with rel="noopener
noreferrer" (no handle on the dashboard's tab, no Referer); it is on another port, so another
origin than the dashboard's, whose login lives in that origin's storage (web/guard.py); an
address on the dashboard's own port is shown as text, never linked."""

from __future__ import annotations

import time
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from det_local.client.taskview import NOTEBOOK
from det_local.tables import fmt_time
from det_local.views import cluster as clusterviews
from det_local.web.html import Html, join, link, page, table, tag
from det_local.web.pages import duration, html_errors, state_badge
from det_local.web.responses import json_errors, json_response, query_flag

TOKEN_NOTE = "token: printed to its owner by `det-local notebook start`"


@json_errors
def commands_api(request: Request) -> Response:
    return json_response(clusterviews.commands_json(include_done=query_flag(request, "all")))


def _port(url: str) -> int | None:
    try:
        return urlsplit(url).port
    except ValueError:  # not a port number (out of range): no origin of this dashboard's
        return None


def _link(c: dict[str, object], own_port: int | None) -> Html:
    url = c.get("link")
    if not isinstance(url, str):
        return Html("")
    if _port(url) == own_port:  # the dashboard's own origin: never a link to follow
        return join([url, tag("span", " (this dashboard's own port: not linked)", class_="muted")])
    parts = [tag("a", url, href=url, target="_blank", rel="noopener noreferrer")]
    if c["kind"] == NOTEBOOK:
        parts.append(tag("span", TOKEN_NOTE, class_="muted"))
    return join(parts, " ")


def _state(c: dict[str, object]) -> Html:
    badge = state_badge(str(c["state"]))
    code = c.get("exit_code")
    return badge if code is None else join([badge, f" exit {code}"])


@html_errors
def commands_page(request: Request) -> Response:
    everything = query_flag(request, "all")
    now = time.time()
    listed = clusterviews.commands_json(include_done=everything)
    rows = [
        [
            link(f"/commands/{c['id']}", c["id"]),  # its page: system metrics (web/usage.py)
            str(c["kind"]).lower(),
            c["name"],
            c["user"],
            _state(c),
            f"{len(c['slots'])}/{c['slots_needed']}",
            fmt_time(c["started_at"]),
            fmt_time(c["ended_at"]),
            duration(c["started_at"], c["ended_at"] or now) if c["started_at"] else "",
            _link(c, request.url.port),
        ]
        for c in listed
    ]
    headers = ["ID", "Type", "Name", "User", "State", "Slots", "Started", "Ended", "Ran"]
    headers.append("Link")
    other = (
        link("/commands", "running and queued only")
        if everything
        else link("/commands?all=1", "with ended ones")
    )
    # jobs flagged for holding idle slots: their owners' notice (issue 30, web/usage.py)
    notes = clusterviews.idle_notes([int(str(c["id"])) for c in listed])
    told = [tag("p", line, class_="error idle-note") for line in notes.values()]
    body = join([tag("p", other), table(headers, rows, id_="commands"), *told])
    return page("Commands", body)


ROUTES = [
    Route("/commands", commands_page),
    Route("/api/commands", commands_api),
]
