"""The compare page (GET /compare?ids=1,2,3, or ?ids=1&ids=2 as the experiments page's form
sends them): the experiments side by side (name, state, searcher, metric, best value, trials,
where their hyperparameter spaces differ), and their learning curves, one chart per metric
with one line per trial coloured by experiment (drawn by static/dashboard.js from
/api/experiments/{id}/metrics). At most expviews.MAX_COMPARE experiments; a bad id is 400, an
unknown one 404, each in one line."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from det_local.tables import fmt_value
from det_local.views import experiments as expviews
from det_local.web.html import Html, join, link, page, page_data, table, tag
from det_local.web.pages import curve_controls, html_errors, state_badge, value
from det_local.web.responses import BadRequest, as_id

MISSING = "—"


def parse_ids(values: list[str]) -> list[int]:
    """?ids=1,2,3 and/or ?ids=1&ids=2 -> [1, 2, 3] (repeats dropped, order kept)."""
    ids: list[int] = []
    for raw in values:
        for part in raw.split(","):
            part = part.strip()
            if not part:
                continue
            if not (part.isascii() and part.isdigit()):
                raise BadRequest(
                    f"?ids={raw!r}: {part!r} is not an experiment id (ids are whole numbers, "
                    "e.g. /compare?ids=1,2)"
                )
            exp_id = as_id(part, "experiment")
            if exp_id not in ids:
                ids.append(exp_id)
    if len(ids) > expviews.MAX_COMPARE:
        raise BadRequest(
            f"{len(ids)} experiments: at most {expviews.MAX_COMPARE} can be compared at once "
            "(choose fewer)"
        )
    return ids


def describe(spec: Any) -> str:
    """A hyperparameter's definition in a few words."""
    if not isinstance(spec, dict):
        return fmt_value(spec)
    kind = spec.get("type")
    if kind == "const":
        return fmt_value(spec.get("val"))
    if kind == "categorical":
        return "one of " + ", ".join(fmt_value(v) for v in spec.get("vals") or [])
    if kind in ("int", "double"):
        return f"{kind} {fmt_value(spec.get('minval'))} .. {fmt_value(spec.get('maxval'))}"
    if kind == "log":
        base = fmt_value(spec.get("base", 10))
        lo, hi = fmt_value(spec.get("minval")), fmt_value(spec.get("maxval"))
        return f"log {base}^{lo} .. {base}^{hi}"
    return fmt_value(spec)


def space_rows(exps: list[dict[str, Any]]) -> tuple[list[list[Any]], list[str]]:
    """(a row per hyperparameter whose definition differs between the experiments, the names
    of those defined alike in all)."""
    names: dict[str, None] = {}
    for e in exps:
        names.update(dict.fromkeys(e["hyperparameters"]))
    rows, same = [], []
    for name in names:
        shown = [
            describe(e["hyperparameters"][name]) if name in e["hyperparameters"] else MISSING
            for e in exps
        ]
        if len(set(shown)) == 1:
            same.append(name)
        else:
            rows.append([tag("code", name), *shown])
    return rows, same


@html_errors
def compare_page(request: Request) -> Response:
    ids = parse_ids(request.query_params.getlist("ids"))
    exps = expviews.compare_json(ids)
    heads = [""] + [link(f"/experiments/{e['id']}", f"exp {e['id']}") for e in exps]

    def better(e: dict[str, Any]) -> str:
        if not e["metric"]:
            return ""
        way = "smaller" if e["smaller_is_better"] in (True, None) else "larger"
        return f"{e['metric']} ({way} is better)"

    rows: list[list[Any]] = [
        ["Name", *(tag("span", e["name"], class_="name") for e in exps)],
        ["State", *(state_badge(e["state"]) for e in exps)],
        ["User", *(e["user"] for e in exps)],
        ["Searcher", *(e["searcher"] or "" for e in exps)],
        ["Metric", *(better(e) for e in exps)],
        ["Best", *(value(e["best"]) for e in exps)],
        [
            "Trials",
            *(
                join((f"{n} {st.lower()}" for st, n in sorted(e["trials"].items())), ", ")
                for e in exps
            ),
        ],
    ]
    hp_rows, same = space_rows(exps)
    note: Html = Html("")
    if same:
        note = tag("p", "the same in every one: " + ", ".join(same), class_="muted", id="hp-same")
    body = join(
        [
            table(heads, rows, id_="compare"),
            tag("h2", "Hyperparameter spaces: differences"),
            table(heads, hp_rows, id_="hp-diff") if hp_rows else tag("p", "none", class_="muted"),
            note,
            tag("h2", "Learning curves"),
            curve_controls(),
            tag("div", "", id="charts", class_="charts"),
            page_data(
                {
                    "page": "compare",
                    "experiments": [
                        {"id": e["id"], "metric": e["metric"], "state": e["state"]} for e in exps
                    ],
                }
            ),
        ]
    )
    title = "Compare " + ", ".join(f"exp {e['id']}" for e in exps)
    return page(title, body, scripts=["dashboard.js"], charts=True)


ROUTES = [Route("/compare", compare_page)]
