"""The hyperparameter views of an experiment (ECharts, loaded by this page only):

    GET /experiments/{id}/hparams          parallel coordinates with brushing, the selected
                                           trials, a scatter per hyperparameter against the
                                           searcher metric (drawn by static/hparams.js)
    GET /api/experiments/{id}/hparams      expviews.hparams_json: what the page draws

The page itself shows the search space from the config (every value escaped); the charts,
notes and tables come from the API and are rebuilt with textContent only, every few seconds
while the experiment has not ended (a brush or a zoom survives the refresh).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from det_local.tables import fmt_value
from det_local.views import experiments as expviews
from det_local.web.html import STATIC, Html, join, link, page, page_data, table, tag
from det_local.web.pages import html_errors, state_badge
from det_local.web.responses import json_errors, json_response, path_id

ECHARTS_VERSION = "6.1.0"  # static/vendor/echarts/README.md
SCRIPTS = ["vendor/echarts/echarts.min.js", "hparams.js"]


@json_errors
def hparams_api(request: Request) -> Response:
    return json_response(expviews.hparams_json(path_id(request, "experiment_id")))


@html_errors
def hparams_page(request: Request) -> Response:
    exp_id = path_id(request, "experiment_id")
    d = expviews.hparams_json(exp_id)
    metric = d["metric"]
    better = "smaller" if d["smaller_is_better"] else "larger"
    facts = tag(
        "dl",
        join(
            [
                tag("dt", "Experiment"),
                tag("dd", link(f"/experiments/{exp_id}", f"{exp_id} · {d['name']}")),
                tag("dt", "State"),
                tag("dd", state_badge(d["state"])),
                tag("dt", "Metric"),
                tag(
                    "dd",
                    f"{metric} ({better} is better): each trial's best validation value, as "
                    "the experiment page's Best column"
                    if metric
                    else "the searcher names no metric",
                ),
            ]
        ),
    )
    body = join(
        [
            Html(f'<link rel="stylesheet" href="{STATIC}/hparams.css">'),
            facts,
            tag("p", "", id="hp-note", class_="muted"),
            tag("h2", "Parallel coordinates"),
            tag(
                "p",
                "Drag along an axis to select a range of trials (several axes narrow it "
                "further); click an axis outside its range to clear it.",
                class_="muted",
            ),
            tag("div", "", id="hp-parallel", class_="hp-chart hp-wide"),
            tag("p", "", id="hp-count"),
            tag("div", "", id="hp-selected", class_="hp-table"),
            tag("h2", "Fixed hyperparameters"),
            tag("ul", "", id="hp-fixed", class_="hp-fixed"),
            tag("h2", f"Each hyperparameter against {metric}" if metric else "Scatters"),
            tag("div", "", id="hp-scatters", class_="hp-scatters"),
            tag("h2", "Search space"),
            table(["Name", "Type", "Range or values"], _space_rows(d), id_="hp-space"),
            page_data({"page": "hparams", "experiment_id": exp_id}),
        ]
    )
    return page(f"Experiment {exp_id}: hyperparameters", body, scripts=SCRIPTS)


def _space_rows(d: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for hp in d["hyperparameters"]:
        kind = hp["type"]
        if kind == "categorical" and "vals" in hp:
            what = ", ".join(fmt_value(v) for v in hp["vals"])
        elif kind == "const":
            what = fmt_value(hp.get("val"))
        elif kind == "log":
            base = fmt_value(hp["base"])
            what = f"{base}^{fmt_value(hp['minval'])} … {base}^{fmt_value(hp['maxval'])}"
        elif "minval" in hp:
            what = f"{fmt_value(hp['minval'])} … {fmt_value(hp['maxval'])}"
        else:
            what = "(not in the config)"
        if "count" in hp:
            what += f" ({hp['count']} grid points)"
        rows.append([hp["name"], kind, what])
    return rows


ROUTES = [
    Route("/api/experiments/{experiment_id}/hparams", hparams_api),
    Route("/experiments/{experiment_id}/hparams", hparams_page),
]
