"""The model registry's pages and API (`det-local model`'s reads, `expviews.models_json` and
`expviews.model_json`): each model with its versions, and links to the trials their checkpoints
come from.

    GET /models                 every model
    GET /models/{name}          a model and its versions
    GET /api/models             model list --json
    GET /api/models/{name}      model describe --json (each version with its checkpoint)
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from det_local.tables import fmt_time
from det_local.views import experiments as expviews
from det_local.web.html import Html, join, link, page, table, tag
from det_local.web.pages import html_errors, state_badge
from det_local.web.responses import json_errors, json_response


@json_errors
def models_api(request: Request) -> Response:
    return json_response(expviews.models_json())


@json_errors
def model_api(request: Request) -> Response:
    return json_response(expviews.model_json(request.path_params["name"]))


def _model_href(name: str) -> str:
    from urllib.parse import quote

    return "/models/" + quote(name, safe="")


@html_errors
def models_page(request: Request) -> Response:
    rows = [
        [
            m["id"],
            link(_model_href(m["name"]), m["name"]),
            m["num_versions"],
            ", ".join(m["labels"]),
            m["user"],
            fmt_time(m["updated_at"]),
            "archived" if m["archived"] else "",
            m["description"],
        ]
        for m in expviews.models_json()
    ]
    headers = ["ID", "Name", "Versions", "Labels", "User", "Updated", "", "Description"]
    if not rows:
        body = tag("p", "No models yet: `det-local model create NAME`, then register-version.")
        return page("Models", body)
    return page("Models", table(headers, rows, id_="models"))


def _checkpoint_cells(c: dict[str, Any] | None) -> list[Any]:
    """Where the version's checkpoint comes from (linked), its steps and its state."""
    if c is None:
        return ["(record gone)", "", ""]
    if c.get("experiment_deleted"):
        where = f"experiment {c['experiment_id']} (deleted) / trial {c['trial_id']}"
        return [where, c["steps_completed"], state_badge(str(c["state"]))]
    trial = link(f"/trials/{int(c['trial_id'])}", f"trial {c['trial_id']}")
    exp = link(f"/experiments/{int(c['experiment_id'])}", f"experiment {c['experiment_id']}")
    return [join([exp, " / ", trial]), c["steps_completed"], state_badge(str(c["state"]))]


@html_errors
def model_page(request: Request) -> Response:
    data = expviews.model_json(request.path_params["name"])
    m = data["model"]
    facts = [
        ("Description", m["description"]),
        ("Labels", ", ".join(m["labels"])),
        ("Owner", m["user"]),
        ("Created", fmt_time(m["created_at"])),
        ("Updated", fmt_time(m["updated_at"])),
        ("Metadata", ", ".join(f"{k}={v}" for k, v in sorted(m["metadata"].items()))),
    ]
    if m["archived"]:
        facts.append(("Archived", "yes"))
    dl = tag("dl", join(join([tag("dt", k), tag("dd", v)]) for k, v in facts))
    rows = [
        [
            v["version"],
            tag("code", v["checkpoint_uuid"]),
            *_checkpoint_cells(v["checkpoint"]),
            v["user"],
            fmt_time(v["created_at"]),
        ]
        for v in reversed(data["versions"])  # newest first, as Determined lists them
    ]
    headers = ["Version", "Checkpoint", "From", "Steps", "State", "Registered by", "When"]
    versions: Html = (
        table(headers, rows, id_="versions") if rows else tag("p", "No versions registered yet.")
    )
    back = tag("p", link("/models", "all models"))
    return page(f"Model {m['name']}", join([back, dl, tag("h2", "Versions"), versions]))


ROUTES = [
    Route("/models", models_page),
    Route("/models/{name}", model_page),
    Route("/api/models", models_api),
    Route("/api/models/{name}", model_api),
]
