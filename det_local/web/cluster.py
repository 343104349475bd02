"""The cluster page and its API: this node and its peers as `det-local cluster peers` shows
them (asked of the running daemon over its cluster socket, `clusterviews.cluster_view`), with the
jobs
this node knows to run on each.

    GET /cluster          the page
    GET /api/peers        cluster peers --json (a list; [] when the daemon does not federate)
    GET /api/cluster      the whole view: {"federation", "why" | "node", "cluster", ...,
                          "peers"}

Without a daemon: the page says so in one line and how to start; the API answers 503 with
{"error": "one line"}."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from det_local.federate.client import NoDaemon
from det_local.tables import fmt_time
from det_local.views import cluster as clusterviews
from det_local.web.html import Html, join, page, table, tag
from det_local.web.pages import html_errors, state_badge
from det_local.web.responses import json_errors, json_response

NO_DAEMON_STATUS = 503
START = (
    "start a cluster with `det-local cluster init` on one machine and `det-local cluster join "
    "TOKEN` on the others (the daemon must run on each: `det-local daemon start`)"
)


@json_errors
def peers_api(request: Request) -> Response:
    try:
        return json_response(clusterviews.peers_json())
    except NoDaemon as err:
        return json_response({"error": f"{err}; {START}"}, NO_DAEMON_STATUS)


@json_errors
def cluster_api(request: Request) -> Response:
    try:
        return json_response(clusterviews.cluster_view())
    except NoDaemon as err:
        return json_response({"error": f"{err}; {START}"}, NO_DAEMON_STATUS)


def _jobs(jobs: list[dict[str, Any]]) -> Html:
    return join(
        (
            tag("span", f"{j['kind'].lower()} {j['id']} ({j['user']})", title=j["name"])
            for j in jobs
        ),
        ", ",
    )


def _queue(digest: Any) -> str:
    if not isinstance(digest, dict):
        return ""
    return f"{digest.get('running', 0)} running, {digest.get('queued', 0)} queued"


@html_errors
def cluster_page(request: Request) -> Response:
    try:
        view = clusterviews.cluster_view()
    except NoDaemon as err:
        body = tag("p", f"{err}; {START}.", id="cluster-off")
        return page("Cluster", body)
    if view.get("federation") != "on":
        body = join(
            [
                tag("p", f"federation is off: {view.get('why') or 'unknown'}", id="cluster-off"),
                tag("p", f"To {START}.", class_="muted"),
            ]
        )
        return page("Cluster", body)
    facts = tag(
        "p",
        f"node {view.get('node')} of cluster {view.get('cluster')}, port {view.get('port')}, "
        f"mDNS {'on' if view.get('mdns') else 'off'}, {view.get('live_peers', 0)} live peer(s)",
        class_="muted",
        id="cluster-facts",
    )
    rows = [
        [
            r["id"],
            r["address"],
            state_badge(str(r["state"]).upper()),
            f"{r['slots_free']}/{r['slots_total']}",
            r.get("version") or "",
            "now" if r["state"] == "self" else f"{float(r['last_seen_s']):.1f}s ago",
            _queue(r.get("queue")),
            _jobs(r.get("jobs") or []),
        ]
        for r in view["peers"]
    ]
    headers = ["Node", "Address", "State", "Slots free", "Version", "Last heard", "Queue"]
    headers.append("det-local jobs there (known here)")
    note = tag("p", f"asked of the daemon at {fmt_time(_now())}", class_="muted")
    return page("Cluster", join([facts, table(headers, rows, id_="peers"), note]))


def _now() -> float:
    import time

    return time.time()


ROUTES = [
    Route("/cluster", cluster_page),
    Route("/api/peers", peers_api),
    Route("/api/cluster", cluster_api),
]
