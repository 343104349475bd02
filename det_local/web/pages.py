"""The server-rendered pages: experiments, one experiment, one trial, the queue, the slots.
Every value goes through `html.esc` (html.py); charts and the live log are drawn by
static/dashboard.js from /api/ (building DOM with textContent)."""

from __future__ import annotations

import math
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from det_local.errors import DetLocalError
from det_local.store.states import State
from det_local.tables import flatten, fmt_time, fmt_value
from det_local.views import cluster as clusterviews
from det_local.views import experiments as expviews
from det_local.web.html import Html, join, link, page, page_data, table, tag
from det_local.web.responses import error_status, path_id, unexpected

UPLOT_VERSION = "1.6.32"  # static/vendor/uplot/README.md
GROUPS = ("validation", "training")  # the experiment page's chart groups
SORTS = ("id", "name", "state", "progress", "best", "user", "started", "duration")


def html_errors(endpoint: Any) -> Any:
    """A DetLocalError as a page saying it in one line (404 for an unknown id)."""

    def wrapped(request: Request) -> Response:
        try:
            return endpoint(request)  # type: ignore[no-any-return]
        except DetLocalError as err:
            status = error_status(err)
            return page("Not found" if status == 404 else "Error", tag("p", err), status=status)
        except Exception as err:
            import sys
            import traceback

            traceback.print_exc(file=sys.stderr)
            return page("Error", tag("p", unexpected(err)), status=500)

    return wrapped


# ---------------------------------------------------------------------------- formatting
def duration(start: float | None, end: float | None) -> str:
    if start is None:
        return ""
    s = int((end if end is not None else time.time()) - start)
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


def progress(p: float | None) -> str:
    return "" if p is None or p != p else f"{p * 100:.0f}%"


def state_badge(state: str) -> Html:
    return tag("span", state, class_=f"state s-{state.lower()}")


def value(v: Any) -> str:
    return "" if v is None else fmt_value(v)


# ---------------------------------------------------------------------------- experiments
@html_errors
def experiments_page(request: Request) -> Response:
    q = request.query_params
    want_state, want_user, want_label = q.get("state", ""), q.get("user", ""), q.get("label", "")
    sort = q.get("sort", "id") if q.get("sort") in SORTS else "id"
    descending = q.get("order", "desc" if sort == "id" else "asc") == "desc"
    # archived experiments leave the list, as in `experiment list` (?archived=1 shows them)
    with_archived = q.get("archived") == "1"
    everyone = expviews.list_experiments(all_users=True)
    exps = everyone if with_archived else expviews.list_experiments(all_users=True, archived=False)
    summaries = expviews.experiment_summaries()
    users = sorted({e.user for e in exps})
    labels = sorted({lb for e in exps for lb in e.labels})
    shown = [
        e
        for e in exps
        if (not want_state or e.state.value == want_state)
        and (not want_user or e.user == want_user)
        and (not want_label or want_label in e.labels)
    ]
    shown = _sorted(shown, summaries, sort, descending)

    def header(name: str, key: str) -> Html:
        order = "asc" if sort == key and descending else "desc"
        if sort != key:
            order = "desc" if key in ("id", "started", "progress", "duration") else "asc"
        params = {**dict(q), "sort": key, "order": order}
        arrow = (" ▼" if descending else " ▲") if sort == key else ""
        query = "&".join(f"{k}={_quote(v)}" for k, v in params.items() if v)
        return link(f"/?{query}", name + arrow)

    rows = []
    for e in shown:
        s = summaries.get(e.id, {})
        metric = s.get("metric") or ""
        counts = s.get("trials") or {}
        rows.append(
            [
                tag(
                    "input",
                    type="checkbox",
                    name="ids",
                    value=e.id,
                    form="compare-form",
                    aria_label=f"compare experiment {e.id}",
                ),
                link(f"/experiments/{e.id}", e.id),
                link(f"/experiments/{e.id}", e.name),
                state_badge(e.state.value),
                progress(e.progress),
                s.get("searcher") or "",
                tag("span", value(s.get("best")), title=metric) if metric else "",
                join((f"{n} {st.lower()}" for st, n in sorted(counts.items())), ", "),
                e.user,
                join((tag("span", lb, class_="label") for lb in e.labels), " "),
                fmt_time(e.created_at),
                duration(e.created_at, e.ended_at),
            ]
        )
    headers = [
        "",
        header("ID", "id"),
        header("Name", "name"),
        header("State", "state"),
        header("Progress", "progress"),
        "Searcher",
        header("Best", "best"),
        "Trials",
        header("User", "user"),
        "Labels",
        header("Started", "started"),
        header("Duration", "duration"),
    ]
    form = _filters(want_state, want_user, want_label, users, labels, sort, q.get("order", ""))
    archived = len(everyone) - len(exps)
    count = tag(
        "p",
        join(
            [f"{len(shown)} of {len(exps)} experiments"]
            + (
                [f"; {archived} archived not shown (", link("/?archived=1", "show them"), ")"]
                if archived
                else []
            )
        ),
        class_="muted",
    )
    compare = tag(
        "form",
        tag("button", f"Compare selected (at most {expviews.MAX_COMPARE})", type="submit"),
        id="compare-form",
        method="get",
        action="/compare",
        class_="compare",
    )
    body = join([form, count, compare, table(headers, rows, id_="experiments")])
    return page("Experiments", body)


def _quote(v: str) -> str:
    from urllib.parse import quote

    return quote(v, safe="")


def _sorted(
    exps: list[Any], summaries: dict[int, dict[str, Any]], sort: str, descending: bool
) -> list[Any]:
    def best(e: Any) -> float | None:
        b = summaries.get(e.id, {}).get("best")
        return b if isinstance(b, (int, float)) and math.isfinite(b) else None

    keys: dict[str, Any] = {
        "id": lambda e: e.id,
        "name": lambda e: e.name.lower(),
        "state": lambda e: e.state.value,
        "progress": lambda e: e.progress or 0.0,
        "user": lambda e: e.user,
        "started": lambda e: e.created_at,
        "duration": lambda e: (e.ended_at or time.time()) - e.created_at,
    }
    if sort == "best":  # experiments without a best last, either way
        have = [e for e in exps if best(e) is not None]
        rest = [e for e in exps if best(e) is None]
        return sorted(have, key=lambda e: (best(e), e.id), reverse=descending) + rest
    return sorted(exps, key=lambda e: (keys[sort](e), e.id), reverse=descending)


def _filters(
    state: str, user: str, label: str, users: list[str], labels: list[str], sort: str, order: str
) -> Html:
    def select(name: str, current: str, options: list[str]) -> Html:
        opts = [tag("option", f"any {name}", value="")]
        opts += [tag("option", o, value=o, selected=o == current) for o in options]
        return tag("label", join([f"{name} ", tag("select", join(opts), name=name)]))

    states = [s.value for s in State]
    hidden = join(
        tag("input", type="hidden", name=k, value=v) for k, v in (("sort", sort), ("order", order))
    )
    return tag(
        "form",
        join(
            [
                select("state", state, states),
                select("user", user, users),
                select("label", label, labels),
                hidden,
                tag("button", "Filter", type="submit"),
            ],
            " ",
        ),
        method="get",
        action="/",
        class_="filters",
    )


# ---------------------------------------------------------------------------- one experiment
@html_errors
def experiment_page(request: Request) -> Response:
    exp_id = path_id(request, "experiment_id")
    d = expviews.experiment_json(exp_id)
    exp, trials, ckpts = d["experiment"], d["trials"], d["checkpoints"]
    events = expviews.experiment_events(exp_id)
    searcher = exp["config"].get("searcher") or {}
    metric = searcher.get("metric")
    names = _hparam_names(trials)
    has_rungs = any(t["rung"] is not None for t in trials)
    headers = ["Trial", "State", "Steps"] + (["Rung"] if has_rungs else [])
    headers += [f"Best {metric}" if metric else "Best", "Restarts", *names, "Checkpoint"]
    rows = []
    for t in trials:
        hp = dict(flatten(t["hparams"]))
        row = [link(f"/trials/{t['id']}", t["id"]), state_badge(t["state"]), t["steps_completed"]]
        row += [value(t["rung"])] if has_rungs else []
        row += [value(t["best_validation"]), t["restarts"]]
        row += [value(hp.get(n)) for n in names]
        row += [_short(t["latest_checkpoint"])]
        rows.append(row)
    info = _facts(
        [
            ("State", state_badge(exp["state"])),
            ("Progress", progress(exp["progress"])),
            ("Searcher", searcher.get("name", "")),
            ("Metric", _better(metric, searcher)),
            ("User", exp["user"]),
            ("Labels", join((tag("span", lb, class_="label") for lb in exp["labels"]), " ")),
            ("Description", exp["description"] or ""),
            ("Message", exp["message"] or ""),
            ("Started", fmt_time(exp["created_at"])),
            ("Ended", fmt_time(exp["ended_at"])),
            ("Duration", duration(exp["created_at"], exp["ended_at"])),
        ]
    )
    ckpt_rows = [
        [
            link(f"/trials/{c['trial_id']}", c["trial_id"]),
            c["steps_completed"],
            c["state"],
            fmt_time(c["created_at"]),
            _download(c),
        ]
        for c in ckpts
    ]
    event_rows = [
        [fmt_time(e["time"]), e["level"], value(e["trial_id"]), e["message"]] for e in events
    ]
    import yaml

    body = join(
        [
            tag("p", join([tag("span", exp["name"], class_="name")]), class_="subtitle"),
            tag("p", link(f"/experiments/{exp_id}/hparams", "Hyperparameter views"), class_="tabs"),
            info,
            tag("h2", "Learning curves"),
            tag(
                "div",
                join(
                    [
                        tag("button", g, type="button", data_group=g)
                        for g in ("validation", "training")
                    ],
                    " ",
                ),
                class_="groups",
            ),
            curve_controls(top_n=True),
            tag("div", "", id="charts", class_="charts"),
            tag("h2", "Trials (best first)"),
            table(headers, rows, id_="trials"),
            tag("h2", "Checkpoints"),
            table(["Trial", "Steps", "State", "Saved", "Download"], ckpt_rows, id_="checkpoints"),
            tag("h2", "Events"),
            table(["Time", "Level", "Trial", "Message"], event_rows, id_="events"),
            tag("h2", "Config"),
            tag("pre", yaml.safe_dump(exp["config"], sort_keys=False), class_="config"),
            page_data({"page": "experiment", "experiment_id": exp_id, "metric": metric}),
        ]
    )
    return page(f"Experiment {exp_id}", body, scripts=["dashboard.js"], charts=True)


X_UNITS = (
    ("batches", "batches"),
    ("records", "records"),
    ("epochs", "epochs"),
    ("time", "time (s since the trial started)"),
)
TOP_N = (1, 3, 5, 10)
DEFAULT_TOP_N = 5


def curve_controls(*, top_n: bool = False) -> Html:
    """The learning curves' controls (static/dashboard.js reads them): the x unit, log y, and
    on an experiment's page how many of the best trials are drawn in colour."""
    units = join(tag("option", text, value=v) for v, text in X_UNITS)
    parts = [
        tag("label", join(["x ", tag("select", units, id="x-unit")])),
        tag("label", join([tag("input", type="checkbox", id="log-y"), " log y"])),
    ]
    if top_n:
        opts = [tag("option", n, value=n, selected=n == DEFAULT_TOP_N) for n in TOP_N]
        opts.append(tag("option", "all", value=0))
        parts.append(
            tag("label", join(["highlight the best ", tag("select", join(opts), id="top-n")]))
        )
    parts.append(tag("span", "", id="curve-note", class_="muted"))
    return tag("div", join(parts, " "), class_="curvebar")


def _better(metric: str | None, searcher: dict[str, Any]) -> str:
    if not metric:
        return ""
    better = "smaller" if searcher.get("smaller_is_better", True) else "larger"
    return f"{metric} ({better} is better)"


def _hparam_names(trials: list[dict[str, Any]]) -> list[str]:
    names: dict[str, None] = {}
    for t in trials:
        names.update(dict.fromkeys(k for k, _ in flatten(t["hparams"])))
    return list(names)


def _download(c: dict[str, Any]) -> Html:
    """The command that downloads a checkpoint; a deleted one (checkpoint GC removed its
    files) has nothing to download, and says so."""
    if c["state"] == "DELETED":
        return tag("span", "deleted (its files are gone)", class_="muted")
    return tag("code", f"det-local checkpoint download {c['uuid']}", class_="copy")


def _short(uuid: str | None) -> Html:
    return tag("code", (uuid or "")[:8], title=uuid) if uuid else Html("")


def _facts(pairs: list[tuple[str, Any]]) -> Html:
    return tag("dl", join(join([tag("dt", k), tag("dd", v)]) for k, v in pairs if v != ""))


# ---------------------------------------------------------------------------- one trial
FOLLOW = tag("input", type="checkbox", id="log-follow", checked=True)


@html_errors
def trial_page(request: Request) -> Response:
    trial_id = path_id(request, "trial_id")
    d = expviews.trial_json(trial_id)
    t = d["trial"]
    info = _facts(
        [
            ("Experiment", link(f"/experiments/{t['experiment_id']}", t["experiment_id"])),
            ("State", state_badge(t["state"])),
            ("Steps completed", t["steps_completed"]),
            ("Restarts", t["restarts"]),
            ("Best validation", value(t["best_validation"])),
            ("Latest checkpoint", t["latest_checkpoint"] or ""),
            ("Message", t["message"] or ""),
            ("Started", fmt_time(t["created_at"])),
            ("Ended", fmt_time(t["ended_at"])),
        ]
    )
    hp_rows = [[k, value(v)] for k, v in flatten(t["hparams"])]
    ckpt_rows = [
        [c["steps_completed"], c["state"], fmt_time(c["created_at"]), tag("code", c["uuid"])]
        for c in d["checkpoints"]
    ]
    body = join(
        [
            info,
            tag("h2", "Hyperparameters"),
            table(["Name", "Value"], hp_rows, id_="hparams"),
            tag("h2", "Metrics"),
            tag("div", "", id="charts", class_="charts"),
            tag("h2", "System metrics"),  # the daemon's samples (web/usage.py, system.js)
            tag("div", "", id="system-charts", class_="charts"),
            tag("h2", "Logs"),
            tag(
                "div",
                join(
                    [
                        tag("input", type="search", id="log-search", placeholder="search"),
                        tag(
                            "label",
                            join(
                                [
                                    "rank ",
                                    tag(
                                        "select",
                                        tag("option", "all", value=""),
                                        id="log-rank",
                                    ),
                                ]
                            ),
                        ),
                        tag(
                            "label",
                            join(
                                [
                                    tag("input", type="checkbox", id="log-follow", checked=True),
                                    " follow",
                                ]
                            ),
                        ),
                        tag(
                            "a",
                            "download raw log",
                            href=f"/api/trials/{trial_id}/logs/raw",
                            download=True,
                            id="log-raw",
                        ),
                        tag("span", "", id="log-status", class_="muted"),
                    ],
                    " ",
                ),
                class_="logbar",
            ),
            tag("pre", "", id="log", class_="log"),
            tag("h2", "Checkpoints"),
            table(["Steps", "State", "Saved", "UUID"], ckpt_rows, id_="checkpoints"),
            page_data({"page": "trial", "trial_id": trial_id, "state": t["state"]}),
        ]
    )
    return page(f"Trial {trial_id}", body, scripts=["dashboard.js", "system.js"], charts=True)


# ---------------------------------------------------------------------------- queue and slots
@html_errors
def queue_page(request: Request) -> Response:
    jobs = clusterviews.jobs_json(include_done=request.query_params.get("all") == "1")
    now = time.time()
    rows = [
        [
            j["position"],
            j["id"],
            j["kind"],
            j["name"],
            j["priority"],
            j["user"],
            state_badge(j["state"]),
            f"{len(j['slots'])}/{j['slots_needed']}",
            fmt_time(j["submitted_at"]),
            duration(j.get("started_at"), now) if j["state"] == "SCHEDULED" else "",
        ]
        for j in jobs
    ]
    headers = [
        "#",
        "ID",
        "Type",
        "Name",
        "Priority",
        "User",
        "State",
        "Slots",
        "Submitted",
        "Running",
    ]
    more = link("/queue?all=1", "with ended jobs")
    return page("Queue", join([tag("p", more), table(headers, rows, id_="jobs")]))


@html_errors
def slots_page(request: Request) -> Response:
    rows = [
        [
            r["index"],
            r["kind"],
            r["name"],
            r["uuid"] or "",
            ""
            if r["memory_total_mb"] is None
            else f"{r['memory_used_mb'] or '?'}/{r['memory_total_mb']} MiB",
            "" if r["utilization_pct"] is None else f"{r['utilization_pct']}%",
            r["used_by"],
        ]
        for r in clusterviews.slots_json()
    ]
    headers = ["Slot", "Kind", "Name", "UUID", "Memory", "Util", "Used by"]
    return page("Slots", table(headers, rows, id_="slots"))


def _memory(used: int | None, total: int | None) -> str:
    return "" if total is None else f"{'?' if used is None else used}/{total} MiB"


@html_errors
def not_found(request: Request) -> Response:
    return page("Not found", tag("p", f"nothing at {request.url.path}"), status=404)


ROUTES = [
    Route("/", experiments_page),
    Route("/experiments", experiments_page),
    Route("/experiments/{experiment_id}", experiment_page),
    Route("/trials/{trial_id}", trial_page),
    Route("/queue", queue_page),
    Route("/slots", slots_page),
]
